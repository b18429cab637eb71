"""The index backend interface: one contract, two implementations (memory, Redis).

The index maps ``(model, block key)`` to the workers that hold the block and in which tiers. Writes
come as per-batch operation lists (so Redis can pipeline them); a lookup walks a request's key chain
and answers, per worker, the longest run of consecutive blocks from the start and how many of them
sit in each tier. Backends are behaviourally identical; one shared test suite proves it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

OpKind = Literal["store", "remove", "clear"]


class IndexUnavailable(RuntimeError):
    """The backend cannot answer right now (e.g. Redis is down): route by load and retry later."""


@dataclass(slots=True, frozen=True)
class IndexOp:
    """One change to a worker's entries: add or remove a tier bit on keys, or drop everything."""

    kind: OpKind
    keys: Sequence[int] = ()
    tier: int = 0


@dataclass(slots=True)
class WorkerMatch:
    """How much of a request's prefix one worker holds.

    ``blocks`` is the longest run of consecutive blocks from the start present in any tier;
    ``gpu``/``cpu``/``storage`` split that run by the fastest tier each block can be loaded from,
    and ``remote`` counts the blocks of the run held only in REMOTE-locality tiers. ``pending`` counts
    the run's last blocks the worker is still computing (a request routed there has not answered): a
    request queued there reuses them, a peer cannot fetch them yet. The index itself leaves it 0.
    """

    worker_id: str
    blocks: int = 0
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    remote: int = 0
    pending: int = 0


@dataclass(slots=True)
class WorkerIndexStats:
    worker_id: str
    model: str
    blocks: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)


class IndexBackend(ABC):
    """Where block locations are kept. All methods are coroutines so Redis and memory share a shape."""

    name: str = "abstract"
    #: Called with the number of blocks a bounded backend forgot to stay within its capacity (the indexer
    #: counts them in ``kvroute_index_evicted_blocks_total``); None until someone listens.
    on_evict: Callable[[int], None] | None = None

    @abstractmethod
    async def apply(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> None:
        """Apply one event batch's operations for one worker, in order."""

    async def apply_many(self, writes: Sequence[tuple[str, str, Sequence[IndexOp]]]) -> None:
        """Several ``(model, worker_id, ops)`` writes; shared backends send them in one round trip."""
        for model, worker_id, ops in writes:
            await self.apply(model, worker_id, ops)

    @abstractmethod
    async def lookup(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        """Per worker holding at least the first block: its match. Workers with 0 blocks are omitted."""

    @abstractmethod
    async def purge_worker(self, worker_id: str) -> None:
        """Forget every block of a worker (all models), cheaply: no scan of the key space."""

    @abstractmethod
    async def block_workers(self, model: str, key: int) -> dict[str, int]:
        """Which workers hold one block, with their tier bits."""

    @abstractmethod
    async def worker_stats(self) -> list[WorkerIndexStats]:
        """Blocks per worker, model and tier."""

    async def presence(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """Per worker holding any of ``keys`` (in any tier): a bit mask, bit i set when it holds ``keys[i]``.
        What a hybrid model's sliding-window groups are asked (their blocks are not a prefix run)."""
        out: dict[str, int] = {}
        for i, key in enumerate(keys):
            for worker, bits in (await self.block_workers(model, key)).items():
                if bits:
                    out[worker] = out.get(worker, 0) | (1 << i)
        return out

    async def get_block_size(self, model: str) -> int | None:
        """The block size a writer published for ``model`` (shared backends); None when unknown."""
        return None

    async def set_block_size(self, model: str, block_size: int) -> None:  # noqa: B027 - optional hook
        """Publish the block size learnt for ``model`` so readers of a shared index can key requests."""

    async def get_model_meta(self, model: str) -> dict[str, str]:
        """What a writer published about ``model`` (:meth:`set_model_meta`); empty when nothing."""
        size = await self.get_block_size(model)
        return {"block_size": str(size)} if size else {}

    async def set_model_meta(self, model: str, meta: dict[str, str]) -> None:
        """Publish what readers of a shared index need to key requests: the block size, the lookahead and
        the KV-cache groups (``ModelInfo.meta``). Backends that keep only a block size keep that."""
        size = meta.get("block_size", "")
        if size.isdigit() and int(size) > 0:
            await self.set_block_size(model, int(size))

    async def ping(self) -> bool:
        """True when the backend can serve lookups right now."""
        return True

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
