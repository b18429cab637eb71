"""KV transfers between simulated workers: the provider side (holds, lookups, fetches) and the consumer side.

Covers the P2P tier (``remote_kv_source``, ``remote_prefiller``, ``remote_decoder``), NixlConnector
pull P/D (``do_remote_decode`` / ``do_remote_prefill``) and bidirectional multi-turn retention. A
transfer's time is bytes / link bandwidth, slept by the provider before it answers; the consumer then
inserts the blocks into its own cache (emitting ``BlockStored``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from kvroute.indexer.events import BlockHash
from kvroute.sim.kvcache import Allocation, PagedCache
from kvroute.sim.kvparams import KVParams, NixlRemote, PeerRef
from kvroute.sim.metrics import SimMetrics
from kvroute.sim.options import WorkerOptions
from kvroute.sim.p2p import HIT, HIT_PENDING, MISS, RETRY, P2PClient
from kvroute.sim.timing import transfer_seconds

if TYPE_CHECKING:
    from kvroute.sim.engine import Engine

HoldKind = Literal["p2p", "nixl", "retain"]


@dataclass(slots=True)
class Hold:
    """Blocks kept for another worker: pinned (referenced) until read or until the lease ends."""

    kind: HoldKind
    key: str
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    alloc: Allocation = field(default_factory=Allocation)
    hashes: list[BlockHash] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    timer: asyncio.TimerHandle | None = None
    reads: int = 0


def _prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Transfers:
    def __init__(self, engine: Engine, client: P2PClient | None) -> None:
        self.engine = engine
        self.client = client
        self.holds: dict[HoldKind, dict[str, Hold]] = {"p2p": {}, "nixl": {}, "retain": {}}
        self.active_out = 0

    @property
    def cache(self) -> PagedCache:
        return self.engine.cache

    @property
    def opts(self) -> WorkerOptions:
        return self.engine.opts

    @property
    def metrics(self) -> SimMetrics:
        return self.engine.metrics

    # -- holds ---------------------------------------------------------------------------------------

    def open_hold(self, kind: HoldKind, key: str) -> Hold:
        """Announce a hold before its blocks exist (lookups answer HIT_PENDING meanwhile)."""
        self.drop_hold(kind, key)
        hold = Hold(kind, key)
        self.holds[kind][key] = hold
        return hold

    def fill_hold(self, hold: Hold, hashes: list[BlockHash], num_tokens: int, ttl_s: float) -> None:
        """Pin the blocks (own references, independent of the request's); the lease is fixed from now and
        never renewed."""
        hashes = [h for h in hashes if h in self.cache.gpu]
        self.cache.acquire(hold.alloc, hashes)
        hold.hashes = hashes
        hold.block_ids = self.cache.block_ids(hashes)
        hold.num_tokens = num_tokens
        hold.ready.set()
        loop = asyncio.get_running_loop()
        hold.timer = loop.call_later(self.opts.scaled(ttl_s), self.drop_hold, hold.kind, hold.key, hold)

    def drop_hold(self, kind: HoldKind, key: str, only: Hold | None = None) -> None:
        hold = self.holds[kind].get(key)
        if hold is None or (only is not None and hold is not only):
            return
        del self.holds[kind][key]
        if hold.timer is not None:
            hold.timer.cancel()
        self.cache.release(hold.alloc)
        hold.ready.set()
        self.engine.pump()

    def close(self) -> None:
        for kind, holds in self.holds.items():
            for key in list(holds):
                self.drop_hold(kind, key)

    # -- provider ------------------------------------------------------------------------------------

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one control message from a peer."""
        op = msg.get("op")
        hashes = msg.get("hashes") or []
        if not isinstance(hashes, list):
            raise ValueError("hashes must be a list")
        if op == "lookup":
            status, n = self._lookup(msg, hashes)
            self.metrics.lookup(status)
            return {"status": status, "num_blocks": n}
        if op == "fetch":
            return await self._fetch(msg, hashes)
        if op == "nixl_lookup":
            hold = self._nixl_hold(msg.get("remote_request_id"))
            n = _prefix(hashes, hold.hashes) if hold is not None and hold.ready.is_set() else 0
            status = HIT if n else MISS
            self.metrics.lookup(status)
            return {"status": status, "num_blocks": n}
        if op == "nixl_read":
            return await self._nixl_read(msg)
        raise ValueError(f"unknown op {op!r}")

    def _lookup(self, msg: dict[str, Any], hashes: list[BlockHash]) -> tuple[str, int]:
        if self.active_out >= self.opts.p2p_max_concurrent_transfers:
            return RETRY, 0
        if msg.get("mode") == "hold":
            hold = self.holds["p2p"].get(str(msg.get("kv_request_id")))
            if hold is None or not hold.ready.is_set():
                return HIT_PENDING, 0  # the producer's prefill has not finished (or not started) yet
            n = _prefix(hashes, hold.hashes)
            return (HIT if n else MISS), n
        n = 0
        for h in hashes:
            if h not in self.cache.gpu and h not in self.cache.cpu:
                break
            n += 1
        if n < len(hashes) and self.engine.pending.get(hashes[n]):
            return HIT_PENDING, n
        return (HIT if n else MISS), n

    async def _send(self, blocks: int, protocol: str) -> tuple[int, float]:
        nbytes = blocks * self.engine.preset.bytes_per_block
        seconds = self.opts.scaled(transfer_seconds(self.engine.preset, blocks))
        self.active_out += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.active_out -= 1
        self.metrics.transfer("sent", protocol, blocks, nbytes, seconds)
        return nbytes, seconds

    async def _fetch(self, msg: dict[str, Any], hashes: list[BlockHash]) -> dict[str, Any]:
        if msg.get("mode") == "hold":
            key = str(msg.get("kv_request_id"))
            hold = self.holds["p2p"].get(key)
            if hold is None or not hold.ready.is_set():
                return {"status": MISS, "num_blocks": 0}
            n = _prefix(hashes, hold.hashes[int(msg.get("start", 0)) :])
            nbytes, _ = await self._send(n, "p2p")
            self.drop_hold("p2p", key, hold)  # single use
            return {"status": "OK", "num_blocks": n, "bytes": nbytes}
        # From the cache: pin what is on GPU for the duration of the copy.
        pin = Allocation()
        n = 0
        for h in hashes:
            if h in self.cache.gpu:
                self.cache.acquire(pin, [h])
            elif h not in self.cache.cpu:
                break
            n += 1
        try:
            nbytes, _ = await self._send(n, "p2p")
        finally:
            self.cache.release(pin)
        return {"status": "OK", "num_blocks": n, "bytes": nbytes}

    def _nixl_hold(self, key: object) -> Hold | None:
        name = str(key)
        return self.holds["nixl"].get(name) or self.holds["retain"].get(name)

    async def _nixl_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        hold = self._nixl_hold(msg.get("remote_request_id"))
        block_ids = msg.get("block_ids") or []
        if hold is None or not hold.ready.is_set() or not isinstance(block_ids, list):
            return {"status": MISS, "num_blocks": 0}
        held = set(hold.block_ids)
        n = 0
        for bid in block_ids:
            if bid not in held:
                break
            n += 1
        hold.reads += 1
        nbytes, _ = await self._send(n, "nixl")
        if hold.kind == "nixl":
            self.drop_hold("nixl", hold.key, hold)  # the decoder read it: free the prefiller's blocks
        return {"status": "OK", "num_blocks": n, "bytes": nbytes}

    # -- consumer ------------------------------------------------------------------------------------

    async def load(self, kv: KVParams | None, hashes: list[BlockHash], start: int, limit: int) -> int:
        """Fetch blocks ``start .. limit`` of ``hashes`` from wherever ``kv`` says; returns how many came."""
        if kv is None or start >= limit or self.client is None:
            return 0
        if kv.remote_prefiller is not None and kv.remote_loads_allowed:
            return await self._p2p(kv.remote_prefiller, "hold", hashes, start, limit)
        if kv.remote_kv_source is not None and kv.remote_loads_allowed:
            return await self._p2p(kv.remote_kv_source, "cache", hashes, start, limit)
        if kv.nixl_remote is not None and kv.do_remote_prefill:
            return await self._nixl_pull(kv.nixl_remote, start, limit, None)
        if kv.nixl_remote is not None and kv.do_remote_decode:
            return await self._nixl_pull(kv.nixl_remote, start, limit, hashes)
        return 0

    async def _call(
        self, host: str, port: int, msg: dict[str, Any], extra_timeout: float = 0.0
    ) -> dict[str, Any] | None:
        assert self.client is not None
        return await self.client.call(host, port, msg, self.opts.control_timeout_s + extra_timeout)

    async def _p2p(self, peer: PeerRef, mode: str, hashes: list[BlockHash], start: int, limit: int) -> int:
        assert peer.host is not None and peer.port is not None
        want = hashes[:limit]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.opts.scaled(self.opts.p2p_pending_timeout_s)
        poll = max(self.opts.scaled(self.opts.p2p_poll_s), 0.001)
        retries = 0
        while True:
            reply = await self._call(
                peer.host,
                peer.port,
                {"op": "lookup", "mode": mode, "hashes": want, "kv_request_id": peer.kv_request_id},
            )
            if reply is None:
                return 0
            status = reply.get("status")
            n = int(reply.get("num_blocks") or 0)
            if status == RETRY and retries < self.opts.p2p_max_retries:
                retries += 1
                await asyncio.sleep(poll * (2**retries))
                continue
            if status == HIT_PENDING and loop.time() < deadline:
                await asyncio.sleep(poll)
                continue
            break  # HIT, MISS, RETRY out of budget, or HIT_PENDING past the bound: use what is there
        n = min(n, limit)
        if status == RETRY or n <= start:
            return 0
        expected = self.opts.scaled(transfer_seconds(self.engine.preset, n - start))
        t0 = loop.time()
        reply = await self._call(
            peer.host,
            peer.port,
            {"op": "fetch", "mode": mode, "start": start, "hashes": want[start:n], "kv_request_id": peer.kv_request_id},
            expected,
        )
        if reply is None or reply.get("status") != "OK":
            return 0
        got = min(int(reply.get("num_blocks") or 0), n - start)
        self.metrics.transfer("received", "p2p", got, got * self.engine.preset.bytes_per_block, loop.time() - t0)
        return got

    async def _nixl_pull(self, remote: NixlRemote, start: int, limit: int, hashes: list[BlockHash] | None) -> int:
        """Read the other side's blocks by id. With ``hashes`` (bidirectional reuse on a prefiller), first
        ask how many are reusable and pull only past ``kv_recompute_threshold`` tokens."""
        loop = asyncio.get_running_loop()
        end = min(limit, len(remote.block_ids))
        if hashes is not None:
            reply = await self._call(
                remote.host,
                remote.port,
                {"op": "nixl_lookup", "hashes": hashes[:limit], "remote_request_id": remote.request_id},
            )
            n = int(reply.get("num_blocks") or 0) if reply and reply.get("status") == HIT else 0
            end = min(end, n)
            if (end - start) * self.cache.block_size < self.opts.kv_recompute_threshold:
                self.engine.recompute_decisions += 1
                return 0
        if end <= start:
            return 0
        expected = self.opts.scaled(transfer_seconds(self.engine.preset, end - start))
        t0 = loop.time()
        read = {"op": "nixl_read", "remote_request_id": remote.request_id, "block_ids": remote.block_ids[start:end]}
        reply = await self._call(remote.host, remote.port, read, expected)
        if reply is None or reply.get("status") != "OK":
            return 0
        got = min(int(reply.get("num_blocks") or 0), end - start)
        self.metrics.transfer("received", "nixl", got, got * self.engine.preset.bytes_per_block, loop.time() - t0)
        return got


async def close_client(client: P2PClient | None) -> None:
    if client is not None:
        with contextlib.suppress(Exception):
            await client.close()
