"""A model's chat template rendered the way transformers renders it for vLLM.

The environment is transformers' (sandboxed, trimmed blocks, loop controls, the ``generation`` tag, its
``tojson``); a named ``tool_use`` template is picked for requests with tools; ``continue_final_message``
cuts everything after the final message's text (the end-of-turn tail), and ``developer`` messages become
``system`` ones for templates that do not know the role. :meth:`ChatTemplate.render_prompt` renders a
:class:`~kvroute.router.chat_prompt.ChatPrompt` through vLLM's conversation first.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvroute.router.chat_prompt import ChatPrompt, TokenizeError, Unrenderable, conversation, developer_as_system
from kvroute.router.template_format import detect_content_format, jinja_environment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplate:
    """A model's chat template(s) rendered the way transformers / vLLM render them (sandboxed jinja2).

    ``tool_use`` is the named template transformers picks instead of the default when a request has
    tools (a ``tools`` list, even empty). Per template, what vLLM derives from its source: the content
    format, whether it knows the ``developer`` role."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None, tool_use: str | None = None) -> None:
        self.source = source
        self.special = dict(special or {})
        self._env = jinja_environment()
        self._sources = {"default": source, **({"tool_use": tool_use} if tool_use else {})}
        self._compiled: dict[str, Any] = {}
        self._compile("default")
        self._formats = {name: detect_content_format(src) for name, src in self._sources.items()}
        self.content_format = self._formats["default"]
        #: vLLM merges /v1/messages' inline system messages into the leading one when a template refuses
        #: a system message after the first (Qwen's ``loop.first`` guard), probing every variant.
        self.merges_inline_system = any(_refuses_inline_system(src) for src in self._sources.values())

    def _compile(self, name: str) -> Any:
        template = self._compiled.get(name)
        if template is None:
            try:
                template = self._compiled[name] = self._env.from_string(self._sources[name])
            except Exception as exc:
                raise TokenizeError(f"chat template does not compile: {exc}") from None
        return template

    def _name_for(self, tools: Any) -> str:
        return "tool_use" if tools is not None and "tool_use" in self._sources else "default"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Any] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """transformers' ``render_jinja_template`` on messages taken as they are (no vLLM parsing)."""
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise TokenizeError("messages must be a list of objects")
        if any(not isinstance(m, Mapping) for m in messages):
            raise TokenizeError("every message must be an object")
        if not messages:
            raise TokenizeError("cannot render an empty conversation")
        if documents is not None and any(not isinstance(d, Mapping) for d in documents):
            raise TokenizeError("documents must be objects")
        chat = [dict(m) for m in messages]
        name = self._name_for(tools)
        final: str | None = None
        if continue_final_message:
            if add_generation_prompt:
                raise TokenizeError("continue_final_message and add_generation_prompt cannot both be true")
            chat[-1] = copy.deepcopy(chat[-1])
            final = _mark_final(chat[-1], self._sources[name])
        try:
            rendered = str(
                self._compile(name).render(
                    messages=chat,
                    tools=tools,
                    documents=documents,
                    add_generation_prompt=add_generation_prompt,
                    **{**self.special, **kwargs},
                )
            )
        except TokenizeError:
            raise
        except Exception as exc:
            raise TokenizeError(f"chat template failed: {exc}") from None
        return rendered if final is None else _cut_after_final(rendered, final)

    def render_prompt(self, prompt: ChatPrompt) -> str:
        """A request rendered as vLLM renders it: its conversation, merged kwargs, developer handling."""
        if prompt.chat_template is not None:
            raise Unrenderable("chat_template", "the request carries its own chat template")
        kwargs = prompt.template_kwargs()
        tools = kwargs.pop("tools", None)
        name = self._name_for(tools)
        chat = conversation(prompt.messages, self._formats[name])
        source = self._sources[name]
        if any(m["role"] == "developer" for m in chat) and '"developer"' not in source and "'developer'" not in source:
            chat = developer_as_system(chat)
        return self.render(
            chat,
            add_generation_prompt=bool(kwargs.pop("add_generation_prompt", False)),
            tools=tools,
            documents=kwargs.pop("documents", None),
            continue_final_message=bool(kwargs.pop("continue_final_message", False)),
            **kwargs,
        )


def _mark_final(message: dict[str, Any], source: str) -> str:
    """Append the continuation tag to the final message's (last) text; return that text."""
    content = message.get("content")
    if content is None or "content" not in source:
        raise TokenizeError("continue_final_message: the final message has no content the template renders")
    if isinstance(content, list | tuple):
        for block in reversed(content):
            if isinstance(block, dict) and "text" in block:
                text = str(block["text"])
                block["text"] = text + _CONTINUE_TAG
                return text
        raise TokenizeError("continue_final_message: the final message has no text to continue")
    message["content"] = str(content) + _CONTINUE_TAG
    return str(content)


def _cut_after_final(rendered: str, final: str) -> str:
    """What follows the final message's text goes (transformers' ``continue_final_message``)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise TokenizeError("continue_final_message: the template does not render the final message's text")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _refuses_inline_system(source: str) -> bool:
    """vLLM's probe: [system, user, system, user] rendered with a bare environment; an error means the
    template wants one leading system message."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.from_string(source).render(messages=probe, add_generation_prompt=False)
    except Exception:
        return True
    return False


# -- files ----------------------------------------------------------------------------------------------


def load_chat_template(folder: Path, explicit: str | Path | None, config: Mapping[str, Any]) -> str | None:
    """The default template source (see :func:`load_chat_templates`)."""
    return load_chat_templates(folder, explicit, config)[0]


def load_chat_templates(
    folder: Path, explicit: str | Path | None, config: Mapping[str, Any]
) -> tuple[str | None, str | None]:
    """``(default, tool_use)`` as transformers loads them: an explicit file (then nothing else), else the
    folder's template files (``chat_template.jinja``, ``additional_chat_templates/*.jinja``), which replace
    tokenizer_config.json's template (a string, or named templates) when there are any."""
    if explicit:
        try:
            return Path(explicit).read_text(), None
        except OSError as exc:
            raise TokenizeError(f"cannot read chat template {explicit}: {exc.strerror}") from None
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text()
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files.update({f.stem: f.read_text() for f in sorted(extra.glob("*.jinja"))})
    value = config.get("chat_template")
    named: dict[Any, Any] = dict(files)  # template files replace the config's templates altogether
    if not files and isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    elif not files and isinstance(value, str):
        named = {"default": value}
    default, tool_use = named.get("default"), named.get("tool_use")
    return (default if isinstance(default, str) else None), (tool_use if isinstance(tool_use, str) else None)
