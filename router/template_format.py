"""transformers' template environment, and which content format a chat template wants, decided as vLLM
decides it from the template's syntax tree.

"openai" (message content as a list of ``{"type": "text"}`` parts) when the template loops over a
message's content — directly, through a macro parameter that receives it, or over a top-level
``content`` variable — else "string" (text parts joined with newlines). An unparsable template, or a
loop or assignment target that is not one name, means "string", as in vLLM.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from kvroute.router.chat_prompt import ContentFormat, TokenizeError


def _raise(message: str) -> None:
    raise TokenizeError(f"chat template: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant masks) renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def jinja_environment() -> Any:
    """transformers' environment: sandboxed, trimmed blocks, loop controls, the ``generation`` tag, its
    ``tojson`` (no HTML escaping), ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _loads(node: Any, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _item(node: Any, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return _loads(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _loads(node.node, name) and node.attr == key


def _access(node: Any, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name[key]``), possibly filtered, tested or sliced."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _access(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _access(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _access(node.node, name, key)
    return _item(node, name, key) if key else _loads(node, name)


def _aliases(root: Any, name: str) -> Iterator[str]:
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(nodes.Assign):
            if _access(assign.node, current):
                target = _name(assign.target)
                yield target
                if target != current:
                    pending.append(target)


def _name(node: Any) -> str:
    """A loop or assignment target that is one name (vLLM gives up on anything else: "string")."""
    if not isinstance(node, nodes.Name):
        raise ValueError("unpacking target")
    return str(node.name)


def _content_loops(root: Any) -> Iterator[Any]:
    """Loops over a message's content: ``for m in messages`` ... ``for part in m['content']`` (or over a
    macro parameter that receives it, or over a top-level ``content`` variable)."""
    lists = list(_aliases(root, "messages"))
    message_names = [
        _name(loop.target) for loop in root.find_all(nodes.For) if any(_access(loop.iter, n) for n in lists)
    ]
    macro_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_access(arg, n, "content") for n in message_names):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(_access(kw.value, n, "content") for n in message_names):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                macro_params[id(loop)] = params
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if (
            any(_access(it, n, "content") for n in message_names)
            or (isinstance(it, nodes.Name) and it.name in macro_params.get(id(loop), ()))
            or (id(loop) not in in_macros and isinstance(it, nodes.Name) and it.name == "content")
        ):
            _name(loop.target)
            yield loop


def detect_content_format(source: str) -> ContentFormat:
    """vLLM's auto-detection: "openai" (content as a list of parts) when the template loops over message
    content, else "string" (text parts joined with newlines); "string" when the template cannot be parsed."""
    try:
        root = jinja_environment().parse(source)
        return "openai" if next(_content_loops(root), None) is not None else "string"
    except Exception:
        return "string"
