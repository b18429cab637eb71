"""OpenAI-style JSON errors: every failure a client sees has the same shape and a meaningful status.

Clients written against the OpenAI API parse ``{"error": {"message", "type", "code"}}``; returning that
shape for our own failures (bad JSON, unknown model, no healthy worker, upstream down) lets them surface
a readable message instead of a decode error.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


class ApiError(Exception):
    """Raised anywhere in request handling; the app turns it into a JSON error response."""

    def __init__(self, status: int, message: str, code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.err_type = err_type or _TYPES.get(status, "server_error")


def error_body(status: int, message: str, code: str | None = None, err_type: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": err_type or _TYPES.get(status, "server_error"), "code": code}}
    )


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    err_type: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        error_body(status, message, code, err_type), status_code=status, media_type="application/json", headers=headers
    )


def api_error_response(exc: ApiError, headers: dict[str, str] | None = None) -> Response:
    return error_response(exc.status, exc.message, exc.code, exc.err_type, headers)


def bad_request(message: str, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "model_not_found")


def no_healthy_worker(model: str | None) -> ApiError:
    what = f"model `{model}`" if model else "this request"
    return ApiError(503, f"No healthy worker is available for {what}.", "no_healthy_worker")
