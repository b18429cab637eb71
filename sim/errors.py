"""The error shapes of vLLM's HTTP surfaces (shared by the OpenAI, Anthropic and Responses handlers)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """Bad input found while parsing, answered as vLLM's JSON error with this status (never a 500)."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_body(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> dict[str, Any]:
    """vLLM's (OpenAI-style) error object, also the payload of an in-band streaming error."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


#: ``_ANTHROPIC_ERROR_TYPE_BY_STATUS`` of ``vllm/entrypoints/anthropic/protocol.py`` (vLLM 0.33).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """vLLM's ``translate_error_type``: Anthropic's ``error.type`` vocabulary for an HTTP status."""
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``AnthropicErrorResponse``: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
