"""The HTTP/1.1 server protocol of ``kvroute serve``: uvicorn's httptools protocol with the limits it lacks.

uvicorn times out idle keep-alive connections but not a client that sends its request headers a byte at a
time (slowloris): such connections are held forever, and enough of them exhaust the process's file
descriptors so every other client is refused. This protocol closes a connection whose request headers
are not complete ``header_timeout_s`` after its first byte (or after it opened), and refuses connections
beyond ``max_connections`` at once, before they cost anything. Slow bodies are bounded by the app
(``body_timeout_s``, answered 408).

It also tells the app of a client that hangs up: each request's scope carries a list under
:data:`~kvroute.router.http_body.DISCONNECT_CALLBACKS`, called when the connection is lost before the
response is complete, so the app cancels the upstream request without a watcher task per request; and
:data:`~kvroute.router.http_body.BODY_COMPLETE` once the whole body is in, so reading it needs no deadline.

And a response's head leaves with its first body bytes, in one write: uvicorn writes the status line and
headers as soon as the app starts the response, then each body chunk, so every small answer cost two
socket writes and woke the client twice (on a loaded host, each wake-up can preempt the router before
the body goes out). :class:`HeadWithBody` holds the head until the body's first write in the same turn
of the loop, or until the loop's next turn when none comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from kvroute.router.http_body import BODY_COMPLETE, DISCONNECT_CALLBACKS
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("kvroute.http")


class HeadWithBody:
    """One response's view of the connection (what uvicorn's request cycle writes to): the first write after
    the response started (its head) is held and goes out with the next write, or at the loop's next turn.
    Everything else passes through; a close sends what is held first."""

    __slots__ = ("_cycle", "_flush", "_head_seen", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, cycle: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._cycle = cycle
        self._head_seen = False
        self._held: bytes | None = None
        self._flush: asyncio.Handle | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            assert self._flush is not None
            self._flush.cancel()
            self._transport.writelines((held, data))
        elif not self._head_seen and self._cycle.response_started:  # uvicorn writes the head just after
            self._head_seen = True
            self._held = data
            self._flush = self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        if self._held is not None:
            assert self._flush is not None
            self._flush.cancel()
            self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """Set the limits on a subclass (:func:`guarded_protocol`); uvicorn builds one instance per connection."""

    header_timeout_s: float = 10.0
    max_connections: int = 0
    _header_timer: asyncio.TimerHandle | None = None
    #: Connections refused or cut, process-wide (for the log's rate limit).
    refused: int = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            GuardedHttpToolsProtocol.refused += 1
            if GuardedHttpToolsProtocol.refused % 1000 == 1:  # one line per thousand, not one per connection
                log.warning("over max_connections=%d: refusing connections", self.max_connections)
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None and self.header_timeout_s:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            GuardedHttpToolsProtocol.refused += 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # a new request's first bytes: the clock runs
            self._arm()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        cast(dict[str, Any], self.scope)[DISCONNECT_CALLBACKS] = []
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # the cycle just made (not an upgrade's return)
            cycle.transport = cast(asyncio.Transport, HeadWithBody(self.transport, cycle, self.loop))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope and not cycle.more_body:
            cast(dict[str, Any], self.scope)[BODY_COMPLETE] = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            callbacks: list[Callable[[], None]] = cast(dict[str, Any], cycle.scope).get(DISCONNECT_CALLBACKS, [])
            for hang_up in list(callbacks):
                hang_up()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[Any]:
    """A protocol class with these limits, for ``uvicorn.run(http=...)``."""
    return type(
        "KVRouteHttpProtocol",
        (GuardedHttpToolsProtocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )
