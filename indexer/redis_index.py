"""The shared index: Redis, read by many router replicas, written by the indexer(s).

Layout, with ``P`` the prefix and every key of a model hash-tagged ``{model}`` (Redis Cluster keeps a
model in one hash slot, so the scripts may touch all of its keys):

- ``P:{m}:b:<8 bytes>`` block value: one byte per worker *slot*, holding its tier bits; TTL safety net.
- ``P:{m}:slots`` worker -> slot, ``P:{m}:owners`` slot -> worker, ``P:{m}:next`` slot counter.
- ``P:{m}:counts`` ``<slot>:<tier>`` and ``<slot>:any`` -> block counts (for stats).
- ``P:models`` the models seen (to purge a worker everywhere).

On a Redis Cluster (``cluster=True``) each model's keys live on the master of its slot, so models
spread over the masters; a script declares the model's keys it names and builds block key names from
ARGV, legal there because they hash to the declared keys' slot. A burst over several models is one
cluster pipeline (``EVAL``s grouped per master).

A purge (or ``AllBlocksCleared``) retires the worker's slot in O(1): lookups ignore bytes of slots
without an owner, and the next store gives the worker a fresh slot; stale bytes die with the TTL.
A lookup is one ``EVALSHA`` whatever the prefix length; a batch is one ``EVALSHA`` too.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

from kvroute.indexer.backend import IndexBackend, IndexOp, IndexUnavailable, WorkerIndexStats, WorkerMatch
from kvroute.indexer.redis_client import AnyRedis, redis_client
from kvroute.indexer.redis_lua import LOOKUP, WRITE
from kvroute.vocabulary import Tier
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("kvroute.indexer.redis")

_KIND = {"store": b"s", "remove": b"r", "clear": b"c"}
#: One argument of a write script call.
ScriptArg = bytes | int | str
#: Keys per script call when rewriting large snapshots (keeps Redis responsive for others).
MAX_KEYS_PER_CALL = 5_000
#: Failures after which a cluster client must re-read the slot map (a node died, a failover is under way).
_TOPOLOGY_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterDownError, RedisClusterException, OSError)
#: What a failed call may raise: the cluster client's own exceptions (no node reachable, a slot not
#: covered) are not RedisErrors.
_FAILURES = (RedisError, RedisClusterException, OSError)


def pack_keys(keys: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(keys)}Q", *keys)


def key_names(prefix: bytes, keys: Sequence[int]) -> bytes:
    """The blocks' Redis key names (prefix + 8 little-endian bytes), concatenated with one C-level join:
    the scripts slice them instead of building each name themselves."""
    if not keys:
        return b""
    packed = pack_keys(keys)
    return prefix + prefix.join([packed[i : i + 8] for i in range(0, len(packed), 8)])


class RedisIndex(IndexBackend):
    """Index kept in Redis. Every failure to reach Redis surfaces as :class:`IndexUnavailable`.

    Every wait on Redis is bounded by ``timeout_s``: connecting, sending, reading a reply (a server that
    stopped answering, e.g. frozen or behind a dead link, fails the call instead of blocking it), closing.
    A failed command is not retried here: the indexer keeps its local views and rewrites them once Redis
    answers again, so retries would only hold its lock longer while Redis is away.

    ``cluster=True``: ``url`` is one seed node of a Redis Cluster (:mod:`kvroute.indexer.redis_client`).
    After a connection failure redis-py re-reads the slot map on the next command; after a failed pipeline
    this class drops the client's connections and map itself, so writes, too, reach a promoted replica.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "kvr",
        ttl_s: int = 3600,
        timeout_s: float = 2.0,
        client: AnyRedis | None = None,
        cluster: bool = False,
    ) -> None:
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.redis: AnyRedis = client or redis_client(url, cluster=cluster, timeout_s=timeout_s)
        self.cluster = isinstance(self.redis, RedisCluster)
        self._write = self.redis.register_script(WRITE)
        self._lookup = self.redis.register_script(LOOKUP)
        self._models_known: set[str] = set()

    def _k(self, model: str, what: str) -> str:
        return f"{self.prefix}:{{{model}}}:{what}"

    def _model_keys(self, model: str) -> list[str]:
        return [self._k(model, "slots"), self._k(model, "owners"), self._k(model, "next"), self._k(model, "counts")]

    def _block_prefix(self, model: str) -> bytes:
        return self._k(model, "b:").encode()

    async def _call(self, what: str, coro: Any, pipeline: bool = False) -> Any:
        """Await one redis-py call (typed ``Awaitable[T] | T`` there, hence Any) as IndexUnavailable.

        With a cluster client any exception is a failure of the index: when it drops connections under
        concurrent commands (its reaction to ``CLUSTERDOWN``, a topology refresh) a command caught mid-setup
        can fail with a plain ``AttributeError``; that must cost a lookup, never a request."""
        try:
            return await coro
        except Exception as exc:
            if not isinstance(exc, _FAILURES) and not self.cluster:
                raise
            self._models_known.clear()
            if pipeline and isinstance(exc, _TOPOLOGY_ERRORS):
                await self._forget_topology()
            detail = str(exc) if isinstance(exc, _FAILURES) else f"{type(exc).__name__}: {exc}"
            raise IndexUnavailable(f"redis {what} failed: {detail}") from exc

    async def _forget_topology(self) -> None:
        """Drop the cluster client's connections and slot map: the next call re-reads them. A single command
        does this itself on a connection error; a pipeline does not, and would keep aiming at a dead node."""
        try:
            await self.redis.aclose()
        except Exception as exc:  # the same races as in _call; the next call starts afresh anyway
            log.warning("resetting the redis cluster client failed: %r", exc)

    async def _remember_model(self, model: str) -> None:
        if model not in self._models_known:
            await self._call("sadd", self.redis.sadd(f"{self.prefix}:models", model))
            self._models_known.add(model)

    def _calls(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> list[list[ScriptArg]]:
        """Script argument lists for one worker's ops, split so no call holds Redis for long."""
        prefix = self._block_prefix(model)
        head: list[ScriptArg] = [len(prefix) + 8, worker_id, self.ttl_s]
        calls: list[list[ScriptArg]] = []
        args: list[ScriptArg] = []
        size = 0
        for op in ops:
            keys = list(op.keys)
            tier = int(op.tier).bit_length() - 1 if op.kind != "clear" else 0
            if op.kind != "clear" and (tier < 0 or int(op.tier) != 1 << tier):
                raise ValueError(f"one tier bit per op, got {op.tier!r}")
            chunks = [keys[i : i + MAX_KEYS_PER_CALL] for i in range(0, len(keys), MAX_KEYS_PER_CALL)] or [[]]
            for chunk in chunks:
                if size and size + len(chunk) > MAX_KEYS_PER_CALL:
                    calls.append(head + args)
                    args, size = [], 0
                args += [_KIND[op.kind], tier, key_names(prefix, chunk)]
                size += len(chunk)
        if args:
            calls.append(head + args)
        return calls

    async def apply(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> None:
        await self.apply_many([(model, worker_id, ops)])

    async def apply_many(self, writes: Sequence[tuple[str, str, Sequence[IndexOp]]]) -> None:
        """All writes in one pipelined round trip (each script call stays atomic on its own)."""
        calls = []
        for model, worker_id, ops in writes:
            if ops:
                await self._remember_model(model)
                calls += [(model, args) for args in self._calls(model, worker_id, ops)]
        if not calls:
            return
        if len(calls) == 1:
            model, args = calls[0]
            await self._call("write", self._write(keys=self._model_keys(model), args=args))
            return
        if isinstance(self.redis, RedisCluster):
            # Grouped per node and sent concurrently by redis-py, redirections followed. EVAL, not EVALSHA:
            # a cluster pipeline cannot load a script a node lacks (a promoted replica's cache is empty).
            cpipe = self.redis.pipeline()
            for model, args in calls:
                cpipe.eval(WRITE, 4, *self._model_keys(model), *args)
            await self._call("write", cpipe.execute(), pipeline=True)
            return
        pipe = self.redis.pipeline(transaction=False)
        for model, args in calls:
            await self._write(keys=self._model_keys(model), args=args, client=pipe)
        await self._call("write", pipe.execute())

    async def _run_write(self, model: str, worker_id: str, ops_args: list[ScriptArg]) -> None:
        args = [len(self._block_prefix(model)) + 8, worker_id, self.ttl_s, *ops_args]
        await self._call("write", self._write(keys=self._model_keys(model), args=args))

    async def lookup(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        if not keys:
            return {}
        prefix = self._block_prefix(model)
        flat = await self._call(
            "lookup", self._lookup(keys=[self._k(model, "owners")], args=[len(prefix) + 8, key_names(prefix, keys)])
        )
        out: dict[str, WorkerMatch] = {}
        for i in range(0, len(flat), 6):
            worker = flat[i].decode() if isinstance(flat[i], bytes) else str(flat[i])
            out[worker] = WorkerMatch(worker, *(int(v) for v in flat[i + 1 : i + 6]))
        return out

    async def _models(self) -> list[str]:
        members = await self._call("smembers", self.redis.smembers(f"{self.prefix}:models"))
        return sorted(m.decode() for m in members)

    async def purge_worker(self, worker_id: str) -> None:
        for model in await self._models():
            await self._run_write(model, worker_id, [b"c", 0, b""])

    async def block_workers(self, model: str, key: int) -> dict[str, int]:
        value = await self._call("get", self.redis.get(self._block_prefix(model) + pack_keys([key])))
        if not value:
            return {}
        owners = await self._call("hgetall", self.redis.hgetall(self._k(model, "owners")))
        out = {}
        for slot_b, worker in owners.items():
            slot = int(slot_b)
            if slot < len(value) and value[slot]:
                out[worker.decode()] = value[slot]
        return out

    async def worker_stats(self) -> list[WorkerIndexStats]:
        out = []
        for model in await self._models():
            owners = await self._call("hgetall", self.redis.hgetall(self._k(model, "owners")))
            counts = await self._call("hgetall", self.redis.hgetall(self._k(model, "counts")))
            for slot_b, worker in sorted(owners.items(), key=lambda kv: kv[1]):
                slot = slot_b.decode()
                by_tier = {}
                for tier in Tier:
                    n = int(counts.get(f"{slot}:{int(tier).bit_length() - 1}".encode(), 0))
                    if n:
                        by_tier[tier.name or str(int(tier))] = n
                blocks = int(counts.get(f"{slot}:any".encode(), 0))
                out.append(WorkerIndexStats(worker.decode(), model, blocks, by_tier))
        return out

    async def get_block_size(self, model: str) -> int | None:
        value = await self._call("hget", self.redis.hget(self._k(model, "meta"), "block_size"))
        return int(value) if value else None

    async def set_block_size(self, model: str, block_size: int) -> None:
        await self._call("hset", self.redis.hset(self._k(model, "meta"), "block_size", block_size))

    async def get_model_meta(self, model: str) -> dict[str, str]:
        raw = await self._call("hgetall", self.redis.hgetall(self._k(model, "meta")))
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def set_model_meta(self, model: str, meta: dict[str, str]) -> None:
        if meta:
            items = [part for pair in meta.items() for part in pair]
            await self._call("hset", self.redis.hset(self._k(model, "meta"), items=items))

    async def presence(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """Two round trips whatever the length: the blocks' values (``MGET``, one slot: one hash tag) and
        the slot owners."""
        if not keys:
            return {}
        prefix = self._block_prefix(model)
        names = [prefix + pack_keys([key]) for key in keys]
        values = await self._call("mget", self.redis.mget(names))
        owners = await self._call("hgetall", self.redis.hgetall(self._k(model, "owners")))
        slots = {int(slot): worker.decode() for slot, worker in owners.items()}
        out: dict[str, int] = {}
        for i, value in enumerate(values):
            if not value:
                continue
            for slot, worker in slots.items():
                if slot < len(value) and value[slot]:
                    out[worker] = out.get(worker, 0) | (1 << i)
        return out

    async def ping(self) -> bool:
        try:
            if isinstance(self.redis, RedisCluster):  # every master answers: the whole index is reachable
                return bool(await self.redis.ping(target_nodes=RedisCluster.PRIMARIES))
            return bool(await self.redis.ping())
        except Exception as exc:
            if isinstance(exc, _FAILURES) or self.cluster:  # a cluster client's races: see _call
                return False
            raise

    async def close(self) -> None:
        """Close the connections; a Redis that is gone or frozen is logged, never raised (shutdown goes on)."""
        try:
            await self.redis.aclose()
        except _FAILURES as exc:
            log.warning("closing the redis connections failed: %s", exc)
