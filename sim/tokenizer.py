"""Tokenizers the simulated workers (and the router's local tokenizer) agree on.

The built-in scheme needs no download: one token per whitespace-delimited piece, its id a stable hash
of the piece. It is pure and fast, so the router can import :func:`tokenize` and :func:`encode_chat`
without starting anything. A real ``tokenizer.json`` (``tokenizers``) with a Jinja chat template is
optional, for runs that must count tokens like a given model.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

#: Ids 0..255 are reserved (specials); pieces hash into the rest of a Llama-3-sized vocabulary.
VOCAB_SIZE = 128_256
RESERVED_IDS = 256
BOS_ID = 1
_SPAN = VOCAB_SIZE - RESERVED_IDS
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
#: Every code point above U+3000 fails ``str.isspace`` (a test checks the whole range).
WIDEST_SPACE = 0x3000


def piece_id(piece: str) -> int:
    """Stable id of one whitespace-delimited piece (the same in every process, unlike ``hash``): FNV-1a
    over its UTF-8 bytes, which the compiled tokenizer computes in the same pass that finds the pieces,
    then MurmurHash3's finaliser (FNV's high bits alone are poorly mixed) and the top 32 bits scaled to
    the span (no division)."""
    h = _FNV_OFFSET
    for byte in piece.encode():
        h = ((h ^ byte) * _FNV_PRIME) & _MASK
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & _MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & _MASK
    h ^= h >> 33
    return RESERVED_IDS + ((h >> 32) * _SPAN >> 32)


class _PieceCache(dict[str, int]):
    """piece -> id memo for the Python tokenizer; ``map(cache.__getitem__, ...)`` stays in C for known
    pieces."""

    limit = 1 << 20

    def __missing__(self, piece: str) -> int:
        if len(self) >= self.limit:
            self.clear()
        value = self[piece] = piece_id(piece)
        return value


_PIECES = _PieceCache()


def piece_ids_python(text: str) -> array[int]:
    """The reference tokenizer (and the fallback where the compiled one was not built)."""
    return array("I", map(_PIECES.__getitem__, text.split()))


try:
    from kvroute.sim import _pieces
except ImportError:  # pragma: no cover - the extension is built by `pip install .`
    token_array = piece_ids_python
    TOKENIZER = "python"
else:
    _pieces.set_whitespace(
        [c for c in range(128) if chr(c).isspace()], [c for c in range(128, WIDEST_SPACE + 1) if chr(c).isspace()]
    )

    def token_array(text: str) -> array[int]:
        """Built-in tokenization as ``array("I")`` (what the router's tokenizer cache keeps)."""
        return _pieces.piece_ids(text, RESERVED_IDS, _SPAN)

    TOKENIZER = "compiled"


def tokenize(text: str) -> list[int]:
    """Built-in tokenization: one id per whitespace-delimited piece."""
    return token_array(text).tolist()


def _content_text(content: object) -> str:
    """OpenAI content is a string or a list of parts; only text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
        return " ".join(texts)
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The built-in chat template: ``<|role|> content <|end|>`` per message, then ``<|assistant|>``."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError("messages must be a list")
    parts = []
    for i, message in enumerate(messages):
        # Most of a long conversation: a plain dict with a string role and text (spared the ABC checks).
        if type(message) is dict:
            role, content = message.get("role"), message.get("content")
            if type(role) is str and role and type(content) is str:
                parts.append(f"<|{role}|> {content} <|end|>")
                continue
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        parts.append(f"<|{role}|> {_content_text(message.get('content'))} <|end|>")
    if add_generation_prompt:
        parts.append("<|assistant|>")
    return " ".join(parts)


def encode_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat request under the built-in template (what /tokenize and the engine see)."""
    return tokenize(render_chat(messages, add_generation_prompt))


class Tokenizer(Protocol):
    """What the simulated worker needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]: ...


def extend_ids(prefix: str, prefix_count: int, text: str) -> tuple[int, array[int]] | None:
    """How :func:`tokenize` of ``text`` follows from its ``prefix``'s ``prefix_count`` ids: keep the first
    ``keep`` of them, then ``tail`` (None when ``text`` does not start with ``prefix``). Pieces are
    whitespace-delimited (``str.split``), so only the prefix's last piece can change, and only when
    neither side of the cut is whitespace."""
    if not text.startswith(prefix):
        return None
    rest = text[len(prefix) :]
    if not prefix or not rest or prefix[-1].isspace() or rest[0].isspace():
        return prefix_count, token_array(rest)
    start = len(prefix)
    while start > 0 and not prefix[start - 1].isspace():
        start -= 1
    return prefix_count - 1, token_array(text[start:])


class BuiltinTokenizer:
    """The default: :func:`tokenize` and :func:`encode_chat` (``extend`` and ``render_chat`` let the
    router's plugin tokenizer cache it by text prefix)."""

    name = "builtin"

    def encode(self, text: str) -> list[int]:
        return tokenize(text)

    def encode_ids(self, text: str) -> array[int]:
        """:meth:`encode` as ``array("I")``: the router's tokenizer keeps ids that way."""
        return token_array(text)

    def extend(self, prefix: str, prefix_count: int, text: str) -> tuple[int, array[int]] | None:
        return extend_ids(prefix, prefix_count, text)

    def stable_count(self, prefix: str, prefix_count: int) -> int:
        """How many of ``prefix``'s ``prefix_count`` ids every text extending it keeps: all but the last
        piece, unless the prefix ends with whitespace (what follows may continue that piece)."""
        return prefix_count if not prefix or prefix[-1].isspace() else max(0, prefix_count - 1)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        return render_chat(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return encode_chat(messages, add_generation_prompt)


class HFTokenizer:
    """A ``tokenizer.json`` through ``tokenizers``, with a Jinja chat template (from the file or the folder).

    ``path`` is a tokenizer.json or a folder holding it (and optionally ``tokenizer_config.json`` whose
    ``chat_template`` is used when no template file is given).
    """

    def __init__(self, path: str | Path, chat_template: str | Path | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        self._tok = _HF.from_file(str(file))
        self.name = str(file)
        self._bos: str | None = None
        template = None
        if chat_template is not None:
            template = Path(chat_template).read_text()
        config = folder / "tokenizer_config.json"
        if config.exists():
            data = json.loads(config.read_text())
            template = template or data.get("chat_template")
            bos = data.get("bos_token")
            self._bos = bos.get("content") if isinstance(bos, dict) else bos
        self._template = None
        if template:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(template)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if self._template is None:
            return self.encode(render_chat(messages, add_generation_prompt))
        text = self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self._bos or ""
        )
        # The template already placed the specials (as vLLM does for chat requests).
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(path: str | None = None, chat_template: str | None = None) -> Tokenizer:
    """The built-in tokenizer, or a tokenizer.json when ``path`` is given."""
    if not path or path == "builtin":
        return BuiltinTokenizer()
    return HFTokenizer(path, chat_template)
