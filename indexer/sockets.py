"""ZMQ socket setup for the event subscriber: SUB sockets, bounded frames, binding, reconnects, admission.

- every SUB (and replay DEALER) refuses frames over ``MAXMSGSIZE`` before allocating anything;
- ZeroMQ reconnects by itself with a backoff capped at :data:`RECONNECT_IVL_MAX_MS`; :func:`reconnect`
  restarts a connection at once after a disconnect (a protocol error ends one for good otherwise);
- a bound socket's admission (source addresses, CURVE client keys) is checked by a ZAP handler, one per
  context (:func:`zap_for`), each bound socket with a domain of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from zmq.utils import z85

log = logging.getLogger("kvroute.indexer.subscriber")

RECV_HWM = 100_000
RECONNECT_IVL_MS = 100
#: Reconnection backoff cap: a restarted engine is found again within a second (its first batches are
#: then still in its replay buffer, and a restart is re-learnt from there anyway).
RECONNECT_IVL_MAX_MS = 1_000
#: Largest frame accepted (ZMQ ``MAXMSGSIZE``, checked before anything is allocated): a bigger one makes
#: ZMQ drop that connection. vLLM's batches are kilobytes to a few megabytes.
MAX_FRAME_BYTES = 16 << 20
#: Most messages handled before their index writes go out together.
MAX_BURST = 256

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(slots=True)
class WorkerSpec:
    """Where one worker's events come from. ``endpoint`` None = it connects to our bound socket."""

    worker_id: str
    model: str
    endpoint: str | None = None
    topic: str = ""
    replay: str | None = None
    dp_size: int = 1


def rank_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's data-parallel rank n publishes (and replays) on the configured port + n."""
    if rank == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"data-parallel ranks need a tcp://host:port endpoint, got {endpoint!r}")
    host = parts.netloc.rsplit(":", 1)[0]
    return f"tcp://{host}:{parts.port + rank}"


class Inbox:
    """A SUB socket read in bursts, without ``zmq.asyncio``'s futures.

    ``zmq.asyncio`` makes a future per receive, checks the socket's events and re-arms after each one: in
    front of a busy fleet that cost ~60 µs of the loop per message, more than applying it (the ZMQ I/O
    thread adds ~10). Here the loop watches the socket's descriptor once, for as long as the inbox lives,
    and a burst is read with non-blocking receives. ZeroMQ's descriptor only says that its mailbox has
    commands: whoever is told reads ``EVENTS`` (which takes them), so a wake-up with no reader waiting
    never leaves the descriptor readable for the loop to spin on, and a reader finds what is queued before
    it waits.
    """

    __slots__ = ("_fd", "_loop", "_waiter", "sock")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._fd = sock.FD
        self._loop.add_reader(self._fd, self._wake)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            self.sock.get(zmq.EVENTS)  # takes the commands: the descriptor is quiet until the next ones

    async def drain(self) -> list[list[bytes]]:
        """Wait for one message, then take what is already queued behind it (up to MAX_BURST).

        A burst waits one turn of the loop first, so what else is ready goes before it (an engine announces
        a prefill's blocks as it sends the first token: a response's first bytes read in the same turn are
        forwarded before a long prompt's thousand-block batch is applied), and bursts arriving back to back
        never hold the loop for longer than one of them (the memory index applies a burst without awaiting
        anything)."""
        sock = self.sock
        while True:
            await asyncio.sleep(0)
            burst: list[list[bytes]] = []
            while len(burst) < MAX_BURST and cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
                burst.append(sock.recv_multipart(zmq.NOBLOCK))
            if burst:
                return burst
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        """Stop watching the descriptor (before the socket closes; the socket is the caller's)."""
        self._loop.remove_reader(self._fd)


def sub_socket(ctx: zmq.asyncio.Context, max_frame_bytes: int = MAX_FRAME_BYTES) -> zmq.Socket[bytes]:
    """A plain SUB socket (read through an :class:`Inbox`) in the subscriber's context."""
    sock: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def dealer_socket(ctx: zmq.asyncio.Context, endpoint: str, max_frame_bytes: int) -> zmq.asyncio.Socket:
    """A DEALER connected to a worker rank's replay endpoint, frames bounded like the SUB's."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, RECV_HWM)
    dealer.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    dealer.connect(endpoint)
    return dealer


async def bind_when_free(sock: zmq.Socket[Any], endpoint: str, wait_s: float = 5.0) -> None:
    """Bind, waiting briefly while the address is still held: ZeroMQ releases a closed socket's listener
    in its I/O thread, so a subscriber restarted at once (a router restart) can find it busy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or loop.time() > deadline:
                raise
        await asyncio.sleep(0.05)


def reconnect(spec: WorkerSpec, sock: zmq.Socket[bytes], endpoint: object) -> None:
    """Connect again at once. ZeroMQ ends a connection for good after a protocol error (a frame over
    MAXMSGSIZE: a real engine's one oversized batch must not cut it off for ever), and a fresh connect
    starts the backoff from its 100 ms floor (a restarted engine is found at once)."""
    assert spec.endpoint is not None
    ranks = [rank_endpoint(spec.endpoint, r) for r in range(spec.dp_size)]
    ep = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else str(endpoint)
    for target in [ep] if ep in ranks else ranks:
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(target)
        with contextlib.suppress(zmq.ZMQError):
            sock.connect(target)


@dataclass(slots=True)
class Admission:
    """Who may connect to one bound socket: source addresses (None = any), CURVE client keys (None = any)."""

    addresses: frozenset[str] | None
    curve_keys: frozenset[bytes] | None


class ZapHandler:
    """ZeroMQ's authentication protocol (ZAP, RFC 27) for one context: each bound socket has its own
    domain and its own :class:`Admission`; anything not admitted is refused (the peer is disconnected
    before a single message of it is read)."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.domains: dict[bytes, Admission] = {}
        self.sock: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None

    async def add(self, domain: bytes, admission: Admission) -> None:
        self.domains[domain] = admission
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.REP)
            self.sock.setsockopt(zmq.LINGER, 0)
            await bind_when_free(self.sock, ZAP_ENDPOINT)
            self.task = asyncio.create_task(self._serve(self.sock), name="kv-events-zap")

    async def remove(self, domain: bytes) -> None:
        self.domains.pop(domain, None)
        if not self.domains and self.sock is not None:
            task, sock, self.task, self.sock = self.task, self.sock, None, None
            if task is not None:
                await cancel_and_wait([task])
            sock.close(0)

    def verdict(self, domain: bytes, address: bytes, mechanism: bytes, credentials: list[bytes]) -> bool:
        admission = self.domains.get(domain)
        if admission is None:
            return False
        if admission.addresses is not None and address.decode(errors="replace") not in admission.addresses:
            return False
        if mechanism == b"CURVE":
            key = z85.encode(credentials[0]) if credentials else b""
            return admission.curve_keys is None or key in admission.curve_keys
        return mechanism == b"NULL"

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            raise_if_cancel_swallowed()
            msg = await sock.recv_multipart()
            if len(msg) < 6:  # not a ZAP request: refuse it, but answer (a REP socket must, or it stalls)
                await sock.send_multipart([b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"malformed", b"", b""])
                continue
            version, request_id, domain, address, _identity, mechanism, *credentials = msg
            ok = self.verdict(domain, address, mechanism, credentials)
            code, text = (b"200", b"OK") if ok else (b"400", b"not admitted")
            if not ok:
                log.warning("kv events: refused a connection from %s", address.decode(errors="replace"))
            await sock.send_multipart([version, request_id, code, text, b"", b""])


_zap_handlers: weakref.WeakKeyDictionary[zmq.asyncio.Context, ZapHandler] = weakref.WeakKeyDictionary()


def zap_for(ctx: zmq.asyncio.Context) -> ZapHandler:
    handler = _zap_handlers.get(ctx)
    if handler is None:
        handler = _zap_handlers[ctx] = ZapHandler(ctx)
    return handler
