"""Conversation store: single use, fixed TTL below the decoder's retention, memory and real Redis alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from kvroute.indexer.keys import root_key
from kvroute.router.conversations import (
    ConversationEntry,
    ConversationError,
    ConversationStore,
    MemoryConversationStore,
    RedisConversationStore,
    entry_from_turn,
    safe_ttl,
)
from kvroute.router.errors import ApiError
from kvroute.router.requests import ParsedRequest, parse_request

ENTRY = ConversationEntry(
    worker_id="d1",
    kv_transfer_params={"remote_block_ids": [1, 2], "remote_host": "h"},
    tokens=100,
    last_block_key=1234,
    blocks=6,
    stored_at=1.0,
)


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[ConversationStore]:
    if request.param == "memory":
        yield MemoryConversationStore()
        return
    if request.param == "redis-cluster":  # conversations spread over three masters; count() scans them all
        s = RedisConversationStore(request.getfixturevalue("cluster_url"), prefix="kvrtest", cluster=True)
        yield s
        await s.close()
        return
    redis_url = request.getfixturevalue("redis_url")
    s = RedisConversationStore(redis_url, prefix="kvrtest")
    yield s
    await s.close()


async def test_put_then_take_is_single_use(store: ConversationStore) -> None:
    await store.put("conv-1", ENTRY)
    assert await store.count() == 1
    assert await store.take("conv-1") == ENTRY
    assert await store.take("conv-1") is None
    assert await store.take("never-stored") is None
    assert await store.count() == 0


async def test_concurrent_takes_get_the_entry_once(store: ConversationStore) -> None:
    await store.put("conv-2", ENTRY)
    results = await asyncio.gather(*(store.take("conv-2") for _ in range(8)))
    assert sum(r is not None for r in results) == 1


async def test_a_new_turn_replaces_the_old_entry(store: ConversationStore) -> None:
    await store.put("conv-3", ENTRY)
    newer = ConversationEntry(worker_id="d2", kv_transfer_params={"remote_host": "h2"})
    await store.put("conv-3", newer)
    assert await store.take("conv-3") == newer


async def test_bad_ids_are_refused(store: ConversationStore) -> None:
    for bad in ("", "x" * 300, "line\nbreak"):
        with pytest.raises(ConversationError):
            await store.put(bad, ENTRY)


async def test_memory_entries_expire_at_a_fixed_time_not_renewed() -> None:
    clock = [0.0]
    s = MemoryConversationStore(ttl_s=100.0, now=lambda: clock[0])
    await s.put("a", ENTRY)
    clock[0] = 99.0
    assert await s.count() == 1
    clock[0] = 100.0
    assert await s.take("a") is None and await s.count() == 0


async def test_memory_store_is_bounded() -> None:
    s = MemoryConversationStore(max_entries=3)
    for i in range(5):
        await s.put(f"c{i}", ENTRY)
    assert await s.count() == 3
    assert await s.take("c0") is None and await s.take("c4") == ENTRY


async def test_redis_ttl_is_set_below_the_decoder_retention(redis_url: str) -> None:
    import redis.asyncio as aioredis

    s = RedisConversationStore(redis_url, ttl_s=1000.0, prefix="kvrttl")
    await s.put("c", ENTRY)
    client = aioredis.Redis.from_url(redis_url)
    ttl_ms = await client.pttl("kvrttl:conv:c")
    await client.aclose()
    await s.close()
    assert 0 < ttl_ms <= 450_000


async def test_redis_corrupt_entry_is_a_clear_error(redis_url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    await client.set("kvrbad:conv:c", b"not json")
    await client.aclose()
    s = RedisConversationStore(redis_url, prefix="kvrbad")
    with pytest.raises(ConversationError, match="corrupt"):
        await s.take("c")
    await s.close()


def test_safe_ttl_stays_below_retention() -> None:
    assert safe_ttl(420.0) == 420.0
    assert safe_ttl(1000.0) == 450.0
    assert safe_ttl(100.0, retention_s=60.0, margin_s=10.0) == 50.0
    with pytest.raises(ConversationError):
        safe_ttl(10.0, retention_s=5.0, margin_s=10.0)


def test_conversation_id_from_body_header_or_session() -> None:
    """The router's conversation key: ``conversation_id`` (body, popped: vLLM must not see it), else the
    X-Conversation-Id header, else vLLM's own ``session_id`` / X-Session-ID (kept: the engine reads it)."""

    def parse(body: dict[str, object], headers: dict[str, str] | None = None) -> ParsedRequest:
        raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        return parse_request("POST", "/v1/completions", raw, orjson.dumps({"prompt": "x", **body}))

    first = parse({"model": "m", "conversation_id": "abc"}, {"X-Conversation-Id": "hdr"})
    assert first.conversation_id == "abc" and "conversation_id" not in orjson.loads(first.body)
    assert parse({"model": "m"}, {"x-conversation-id": "hdr"}).conversation_id == "hdr"
    assert parse({"model": "m"}).conversation_id is None
    session = parse({"model": "m", "session_id": "s1"})
    assert session.conversation_id == "s1" and orjson.loads(session.body)["session_id"] == "s1"
    assert parse({"model": "m"}, {"X-Session-ID": "s2"}).conversation_id == "s2"
    with pytest.raises(ApiError) as refused:
        parse({"model": "m", "conversation_id": 12})
    assert refused.value.status == 400


def test_reusable_tokens_checks_the_new_prompt_extends_the_old_turn() -> None:
    keys = [root_key("m") + i for i in range(10)]
    entry = ConversationEntry(worker_id="d", kv_transfer_params={}, tokens=100, last_block_key=keys[5], blocks=6)
    assert entry.reusable_tokens(keys, 16) == 96
    assert entry.reusable_tokens(keys[:4], 16) == 0
    assert entry.reusable_tokens([0] * 10, 16) == 0
    assert ConversationEntry(worker_id="d", kv_transfer_params={}).reusable_tokens(keys, 16) == 0


def test_entry_from_a_non_streamed_turn_only() -> None:
    keys = [11, 22, 33]
    answer = {"choices": [], "kv_transfer_params": {"remote_block_ids": [4], "remote_host": "d"}}
    entry = entry_from_turn("d1", answer, keys, prompt_tokens=50, completion_tokens=7, now=lambda: 5.0)
    assert entry is not None and entry.blocks == 3 and entry.last_block_key == 33 and entry.tokens == 57
    assert entry.reusable_tokens([11, 22, 33, 44], 16) == 48
    assert entry_from_turn("d1", b"data: {}", keys, prompt_tokens=50) is None  # streamed
    assert entry_from_turn("d1", {"choices": []}, keys, prompt_tokens=50) is None
    assert entry_from_turn("d1", answer, [], prompt_tokens=5) is None
