"""Conversation store for bidirectional KV reuse: the last decoder's ``kv_transfer_params`` per conversation.

The decoder keeps a finished turn's KV for ``decoder_kv_blocks_ttl`` (480 s by default), counted once from
the end of the turn and never renewed. An entry here is therefore:

* written at the end of a turn, with a TTL safely below that retention (and never extended);
* **single use**: the next turn takes it with an atomic get-and-delete, so two concurrent turns of one
  conversation can never both pull the same blocks (one of them recomputes);
* tagged with the worker that holds the blocks, so a turn only reuses it while that worker is registered.

Two implementations share one interface: :class:`MemoryConversationStore` (one router process) and
:class:`RedisConversationStore` (router replicas sharing state; ``GETDEL`` makes take atomic).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from kvroute.router.kv_params import conversation_params_from_response

#: vLLM's default ``decoder_kv_blocks_ttl``; entries must expire before it.
DECODER_RETENTION_S = 480.0
CONVERSATION_HEADER = "x-conversation-id"
MAX_ID_LENGTH = 256
MAX_PARAMS_BYTES = 64 * 1024


class ConversationError(ValueError):
    """A bad conversation id or entry (answer 400); never a crash."""


def validate_conversation_id(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH or not value.isprintable():
        raise ConversationError(f"conversation_id must be a printable string of 1..{MAX_ID_LENGTH} chars")
    return value


def safe_ttl(configured_s: float, retention_s: float = DECODER_RETENTION_S, margin_s: float = 30.0) -> float:
    """The TTL to store with: the configured one, capped ``margin_s`` below the decoder's retention."""
    cap = retention_s - margin_s
    if cap <= 0:
        raise ConversationError(f"decoder retention {retention_s}s leaves no room for a {margin_s}s margin")
    return max(0.001, min(configured_s, cap))


@dataclass(slots=True, frozen=True)
class ConversationEntry:
    """What a finished turn leaves for the next one."""

    worker_id: str
    kv_transfer_params: dict[str, Any]
    #: Tokens the decoder holds (prompt + answer) and our block-key chain's last full-block key over them,
    #: so the next turn can check its prompt really extends them before pulling.
    tokens: int = 0
    last_block_key: int | None = None
    blocks: int = 0
    stored_at: float = 0.0

    def to_json(self) -> bytes:
        data = orjson.dumps(asdict(self))
        if len(data) > MAX_PARAMS_BYTES:
            raise ConversationError(f"conversation entry too large ({len(data)} bytes)")
        return data

    @classmethod
    def from_json(cls, raw: bytes | str) -> ConversationEntry:
        try:
            data = orjson.loads(raw)
            return cls(
                worker_id=str(data["worker_id"]),
                kv_transfer_params=dict(data["kv_transfer_params"]),
                tokens=int(data.get("tokens", 0)),
                last_block_key=data.get("last_block_key"),
                blocks=int(data.get("blocks", 0)),
                stored_at=float(data.get("stored_at", 0.0)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConversationError(f"corrupt conversation entry: {exc}") from None

    def reusable_tokens(self, block_keys: list[int], block_size: int) -> int:
        """Tokens of a new prompt (given its block keys) that this entry's decoder already holds."""
        if self.blocks <= 0 or self.last_block_key is None:
            return 0
        if len(block_keys) < self.blocks or block_keys[self.blocks - 1] != self.last_block_key:
            return 0
        return self.blocks * block_size


def entry_from_turn(
    worker_id: str,
    response: Any,
    prompt_block_keys: Sequence[int],
    prompt_tokens: int,
    completion_tokens: int = 0,
    now: Callable[[], float] = time.time,
) -> ConversationEntry | None:
    """The entry a finished turn leaves, or None when the decoder returned nothing reusable.

    ``response`` is the decoder's final JSON answer; a streamed answer (bytes, or a dict without
    ``kv_transfer_params``) yields None: nothing is stored and the next turn falls back to the index.
    Only the prompt's full blocks are offered (the router never tokenizes the answer).
    """
    params = conversation_params_from_response(response)
    if params is None or not prompt_block_keys:
        return None
    return ConversationEntry(
        worker_id=worker_id,
        kv_transfer_params=params,
        tokens=prompt_tokens + completion_tokens,
        last_block_key=prompt_block_keys[-1],
        blocks=len(prompt_block_keys),
        stored_at=now(),
    )


class ConversationStore(ABC):
    """Per-conversation, single-use, expiring entries."""

    def __init__(self, ttl_s: float = 420.0, retention_s: float = DECODER_RETENTION_S) -> None:
        self.ttl_s = safe_ttl(ttl_s, retention_s)

    @abstractmethod
    async def put(self, conversation_id: str, entry: ConversationEntry) -> None:
        """Store a finished turn's entry (replacing an older one); its TTL starts now, never renewed."""

    @abstractmethod
    async def take(self, conversation_id: str) -> ConversationEntry | None:
        """Atomically get and delete the entry (None when absent or expired)."""

    @abstractmethod
    async def count(self) -> int:
        """Live entries (for /metrics and the admin API)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class MemoryConversationStore(ConversationStore):
    """One process; bounded (oldest entries dropped first) so a flood of ids cannot exhaust memory."""

    def __init__(
        self,
        ttl_s: float = 420.0,
        retention_s: float = DECODER_RETENTION_S,
        max_entries: int = 100_000,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(ttl_s, retention_s)
        self.max_entries = max_entries
        self.now = now
        self._entries: OrderedDict[str, tuple[float, ConversationEntry]] = OrderedDict()

    async def put(self, conversation_id: str, entry: ConversationEntry) -> None:
        validate_conversation_id(conversation_id)
        self._entries.pop(conversation_id, None)
        self._entries[conversation_id] = (self.now() + self.ttl_s, entry)
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def take(self, conversation_id: str) -> ConversationEntry | None:
        item = self._entries.pop(conversation_id, None)
        if item is None or item[0] <= self.now():
            return None
        return item[1]

    async def count(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        now = self.now()
        # Insertion order is expiry order (one TTL for all, never renewed): stop at the first live one.
        while self._entries:
            key, (expires, _) = next(iter(self._entries.items()))
            if expires > now:
                break
            del self._entries[key]


class RedisConversationStore(ConversationStore):
    """Shared by router replicas. Keys ``{prefix}:conv:{id}`` with a PX expiry; take is ``GETDEL``.
    On a Redis Cluster (``cluster``) conversations spread over the masters by their key's slot."""

    def __init__(
        self,
        url: str,
        ttl_s: float = 420.0,
        retention_s: float = DECODER_RETENTION_S,
        prefix: str = "kvr",
        cluster: bool = False,
    ) -> None:
        super().__init__(ttl_s, retention_s)
        from kvroute.indexer.redis_client import redis_client

        self.prefix = prefix
        self.client = redis_client(url, cluster=cluster)

    def _key(self, conversation_id: str) -> str:
        return f"{self.prefix}:conv:{validate_conversation_id(conversation_id)}"

    async def put(self, conversation_id: str, entry: ConversationEntry) -> None:
        await self.client.set(self._key(conversation_id), entry.to_json(), px=max(1, int(self.ttl_s * 1000)))

    async def take(self, conversation_id: str) -> ConversationEntry | None:
        raw = await self.client.getdel(self._key(conversation_id))
        return None if raw is None else ConversationEntry.from_json(raw)

    async def count(self) -> int:
        n = 0
        async for _ in self.client.scan_iter(match=f"{self.prefix}:conv:*", count=1000):
            n += 1
        return n

    async def close(self) -> None:
        await self.client.aclose()
