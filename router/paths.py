"""Which paths reach a worker, decided on one canonical form.

A client can spell a path many ways (``/v1/./completions``, ``//reset_prefix_cache``, ``/%2e/sleep``,
``/v1/completions/``). :func:`canonical_path` reduces every spelling to one (RFC 3986 §6.2.2:
percent-decoding of unreserved characters, dot-segment removal, no empty segments, no trailing slash), and
that one form is what is checked, routed *and forwarded*. :func:`proxied` is an allowlist of vLLM's
inference and read-only endpoints: everything else — engine control (cache resets, sleep, LoRA loading,
profiling, weight updates), unknown paths — is answered 404 by the router and never reaches a worker.
"""

from __future__ import annotations

import re

#: vLLM's OpenAI-compatible inference surface and its read-only helpers (vLLM 0.32-0.33 api_server routes).
PROXIED_POST = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/responses",
        "/v1/responses/render",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/render",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/tokenize",
        "/detokenize",
        "/invocations",
    }
)
PROXIED_GET = frozenset({"/version", "/v1/models"})
#: ``/v1/responses/{id}`` (GET: retrieve) and ``/v1/responses/{id}/cancel`` (POST).
_RESPONSE_ID = re.compile(r"^/v1/responses/[A-Za-z0-9_\-]{1,128}$")
_RESPONSE_CANCEL = re.compile(r"^/v1/responses/[A-Za-z0-9_\-]{1,128}/cancel$")

#: vLLM's engine-control endpoints: named in the 404 so an operator knows to call the worker directly.
CONTROL_PATHS = frozenset(
    {
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/pause",
        "/resume",
        "/is_paused",
        "/update_weights",
        "/init_weight_transfer",
        "/server_info",
        "/load",
        "/abort_requests",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")


def _decode_unreserved(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED else match.group(0).upper()


def canonical_path(path: str) -> str:
    """The one spelling of ``path`` (no query): unreserved characters decoded, ``.``/``..`` segments and
    empty segments removed, no trailing slash. Never climbs above the root. Other characters (``?``, ``%``,
    spaces) stay as they are: no proxied path has them, so such a path is refused, never reinterpreted."""
    if "%" in path:
        path = _PERCENT.sub(_decode_unreserved, path)
    if "//" not in path and "/." not in path and not (path.endswith("/") and len(path) > 1):
        return path if path.startswith("/") else "/" + path
    out: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return "/" + "/".join(out)


def proxied(method: str, path: str) -> bool:
    """Whether a worker may be called with ``method`` on canonical ``path``."""
    if method == "POST":
        return path in PROXIED_POST or _RESPONSE_CANCEL.match(path) is not None
    if method in ("GET", "HEAD"):
        return path in PROXIED_GET or _RESPONSE_ID.match(path) is not None
    return False
