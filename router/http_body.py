"""The ASGI side of one request: reading the body with a limit, noticing when the client hangs up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvroute.router.errors import ApiError, bad_request
from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")

#: A scope key kvroute's own server protocol (``kvroute.apps.http_protocol``) fills with a list: the
#: callbacks in it run when the client's connection is lost before the response is complete. Under any
#: other ASGI server the key is absent and a watcher task waits on ``receive`` instead.
DISCONNECT_CALLBACKS = "kvroute.disconnect_callbacks"
#: A scope key the same protocol sets (to True) once the request's whole body has arrived: reading it then
#: cannot wait, so :func:`read_body` sets no deadline (a timer and a cancel scope per request, ~5 µs).
BODY_COMPLETE = "kvroute.body_complete"


class ClientGone(Exception):
    """The client disconnected while we waited for the worker; the worker's request was cancelled."""


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, refusing (413) anything over ``limit`` bytes without buffering it, and (408) a body
    that has not arrived whole within ``timeout_s`` (a client trickling bytes holds a connection)."""
    if timeout_s is None or request.scope.get(BODY_COMPLETE):
        return await _read_body(request, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", "request_timeout") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    receive = request.receive  # straight from the server: Request.stream() adds a generator per request
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "client disconnected while sending the body", "client_closed")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes", "request_too_large")


async def until_disconnect(receive: Receive, work: Awaitable[T], scope: Any = None) -> T:
    """Await ``work`` but cancel it when the client hangs up (``receive``: the request's, after its body
    was read, so it only returns on disconnect). The work runs in the current task; the server's
    disconnect callback (``scope[DISCONNECT_CALLBACKS]``) or, without one, a watcher task cancels it.
    Raises :class:`ClientGone` when the client left."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    def hang_up() -> None:
        nonlocal gone
        if not gone:
            gone = True
            current.cancel()

    callbacks: list[Callable[[], None]] | None = scope.get(DISCONNECT_CALLBACKS) if scope is not None else None
    watcher: asyncio.Task[None] | None = None
    if callbacks is not None:
        callbacks.append(hang_up)
    else:

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    hang_up()
                    return

        watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            current.uncancel()
            raise ClientGone() from None
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        elif callbacks is not None:
            callbacks.remove(hang_up)
