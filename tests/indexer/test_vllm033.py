"""vLLM 0.33's event fields in the index, on both backends, as 0.33 encodes them: lookahead hashing (EAGLE),
hybrid models' KV-cache groups, ownership of offloaded copies, and entries set aside as doubtful (a reset
or restart seen outside the events)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.indexer.hybrid import group_hit, window_hit
from kvroute.indexer.keys import lookahead_keys, request_keys
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer
from prometheus_client import CollectorRegistry

from .fakevllm import frames_v033

BS = 16
PROMPT = list(range(2000, 2000 + BS * 6))  # 6 blocks
TAIL = [1] * 10


class Engine:
    """One engine rank's block hashes and events under vLLM 0.33's rules: a block's hash covers its tokens,
    its parents' and the ``lookahead`` tokens after it, and exists only once those tokens do."""

    def __init__(self, lookahead: int = 0, seed: int = 0) -> None:
        self.lookahead = lookahead
        self.rng = random.Random(seed)
        self.by_prefix: dict[tuple[int, ...], int] = {}

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        out = []
        for i in range(max(0, len(tokens) - self.lookahead) // BS):
            covered = tuple(tokens[: (i + 1) * BS + self.lookahead])
            out.append(self.by_prefix.setdefault(covered, self.rng.getrandbits(64)))
        return out

    def store(
        self,
        tokens: Sequence[int],
        start: int = 0,
        *,
        group: int = 0,
        kind: str = "full_attention",
        window: int | None = None,
        medium: str = "GPU",
        ownership: str | None = None,
        only: Sequence[int] | None = None,
    ) -> BlockStored:
        """Blocks ``start..`` of ``tokens`` (``only``: just those block indexes, each its own parent's child)."""
        hashes = self.hashes(tokens)
        blocks = list(only) if only is not None else list(range(start, len(hashes)))
        assert only is None or len(blocks) == 1 or blocks == list(range(blocks[0], blocks[-1] + 1))
        first = blocks[0]
        la = self.lookahead
        return BlockStored(
            block_hashes=[hashes[i] for i in blocks],
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=list(tokens[first * BS : (blocks[-1] + 1) * BS]),
            block_size=BS,
            medium=medium,
            group_idx=group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            ownership=ownership,
            lookahead_token_ids=[list(tokens[(i + 1) * BS : (i + 1) * BS + la]) for i in blocks] if la else None,
        )

    def remove(
        self,
        tokens: Sequence[int],
        blocks: Sequence[int],
        *,
        group: int = 0,
        medium: str = "GPU",
        owner: str | None = None,
    ) -> BlockRemoved:
        hashes = self.hashes(tokens)
        return BlockRemoved(block_hashes=[hashes[i] for i in blocks], medium=medium, group_idx=group, ownership=owner)


class Feed:
    """One worker's 0.33-encoded message stream into an indexer."""

    def __init__(self, indexer: KVIndexer, worker: str) -> None:
        self.indexer, self.worker, self.seq = indexer, worker, 0

    async def send(self, *events: KVEvent) -> str:
        handled = await self.indexer.handle_message(self.worker, frames_v033(events, self.seq))
        self.seq += 1
        return handled.outcome


async def blocks(indexer: KVIndexer, tokens: Sequence[int]) -> dict[str, tuple[int, int, int]]:
    result = await indexer.lookup_tokens("m", tokens)
    return {w: (m.blocks, m.gpu, m.cpu) for w, m in result.matches.items()}


def isolated(backend: IndexBackend) -> tuple[KVIndexer, CollectorRegistry]:
    registry = CollectorRegistry()
    indexer = KVIndexer(backend, metrics=IndexerMetrics(registry))
    for worker in ("a", "b"):
        indexer.register_worker(worker, "m")
    return indexer, registry


# -- lookahead hashing ---------------------------------------------------------------------------------


async def test_lookahead_blocks_match_only_prompts_that_continue_alike(indexer: KVIndexer) -> None:
    engine = Engine(lookahead=1)
    a = Feed(indexer, "a")
    assert await a.send(engine.store(PROMPT)) == "applied"  # 96 tokens: blocks 0-4 (block 5 lacks token 96)
    assert indexer.model_info("m").lookahead == 1
    assert await blocks(indexer, PROMPT) == {"a": (5, 5, 0)}
    # Same first 48 tokens, token 48 differs: block 2's hash covers token 48, so only 2 blocks are shared.
    assert await blocks(indexer, PROMPT[:48] + [9] * 48) == {"a": (2, 2, 0)}
    # A prompt ending at a block boundary has no key for its last block: its lookahead token is missing.
    assert await blocks(indexer, PROMPT[:64]) == {"a": (3, 3, 0)}
    assert await blocks(indexer, PROMPT[:65]) == {"a": (4, 4, 0)}
    result = await indexer.lookup_tokens("m", PROMPT[:65])
    assert result.num_blocks == 4 and result.keys == request_keys(PROMPT[:65], BS, "m", lookahead=1)


async def test_one_block_under_two_lookaheads_is_two_blocks(indexer: KVIndexer) -> None:
    engine = Engine(lookahead=1)
    a = Feed(indexer, "a")
    one, two = PROMPT[:33], [*PROMPT[:32], 7]  # block 1 followed by token 32, or by 7
    await a.send(engine.store(one))
    await a.send(engine.store(two, start=1))  # block 0 is shared: its lookahead token (16) is the same
    assert await blocks(indexer, one) == await blocks(indexer, two) == {"a": (2, 2, 0)}
    await a.send(engine.remove(one, [1]))
    assert await blocks(indexer, one) == {"a": (1, 1, 0)}
    assert await blocks(indexer, two) == {"a": (2, 2, 0)}  # the other copy of block 1 is still there


async def test_a_worker_hashing_another_lookahead_is_dropped(backend: IndexBackend) -> None:
    indexer, registry = isolated(backend)
    a, b = Feed(indexer, "a"), Feed(indexer, "b")
    await a.send(Engine(lookahead=1).store(PROMPT))
    await b.send(Engine(lookahead=2, seed=1).store(PROMPT))
    bad = Engine(lookahead=1, seed=2).store(PROMPT)
    assert bad.lookahead_token_ids is not None
    bad.lookahead_token_ids.pop()  # one entry short: not one per block
    await b.send(bad)
    assert await blocks(indexer, PROMPT) == {"a": (5, 5, 0)}
    for reason in ("lookahead_mismatch", "bad_lookahead"):
        assert registry.get_sample_value("kvroute_index_dropped_total", {"worker": "b", "reason": reason}) == 1


def test_lookahead_keys_fold_the_next_tokens_into_the_plain_chain() -> None:
    plain = request_keys(PROMPT, BS, "m")
    keys = lookahead_keys(plain, PROMPT, BS, 2)
    assert len(keys) == (len(PROMPT) - 2) // BS == 5
    assert not set(keys) & set(plain)
    changed = lookahead_keys(plain, [*PROMPT[:17], 0, *PROMPT[18:]], BS, 2)  # token 17: block 0's lookahead
    assert changed[0] != keys[0] and changed[1:] == keys[1:]  # the chain of block 1 on is the caller's to change


# -- hybrid models: KV-cache groups ----------------------------------------------------------------------


def hybrid_store(engine: Engine, tokens: Sequence[int], **kw: object) -> list[BlockStored]:
    """One step of a hybrid model whose group 0 is sliding-window attention and group 1 full attention."""
    return [
        engine.store(tokens, group=0, kind="sliding_window", window=32, **kw),  # type: ignore[arg-type]
        engine.store(tokens, group=1, kind="full_attention", **kw),  # type: ignore[arg-type]
    ]


async def test_hybrid_hit_is_what_every_group_serves(indexer: KVIndexer) -> None:
    engine = Engine()
    a = Feed(indexer, "a")
    await a.send(*hybrid_store(engine, PROMPT))
    info = indexer.model_info("m")
    assert info.primary == 1 and info.side_groups == (0,)  # chosen by kv_cache_spec_kind, not group 0
    assert await blocks(indexer, PROMPT + TAIL) == {"a": (6, 6, 0)}
    assert await blocks(indexer, PROMPT) == {"a": (5, 5, 0)}  # vLLM computes the last token: at most 5 of 6
    # The window group lost blocks 2-3: a hit at 4 blocks lacks its window (2-3), at 3 too (1-2); 2 holds.
    await a.send(engine.remove(PROMPT, [2, 3], group=0))
    assert await blocks(indexer, PROMPT[:64] + TAIL) == {"a": (2, 2, 0)}
    assert await blocks(indexer, PROMPT + TAIL) == {"a": (6, 6, 0)}  # its window (4-5) is still there
    # Full attention lost block 5: the run stops at 5 blocks, whose window (3-4) lacks block 3.
    await a.send(engine.remove(PROMPT, [5], group=1))
    assert await blocks(indexer, PROMPT + TAIL) == {"a": (2, 2, 0)}


async def test_every_group_kind_cuts_the_hit_its_own_way(backend: IndexBackend) -> None:
    indexer, registry = isolated(backend)
    engine = Engine()
    a = Feed(indexer, "a")
    await a.send(
        engine.store(PROMPT, group=0),
        engine.store(PROMPT[:64], group=1, kind="mla_attention"),  # a second full-attention group: 4 blocks
        engine.store(PROMPT, group=2, kind="mamba", only=[2]),  # a state checkpoint after block 2
        engine.store(PROMPT, group=3, kind="chunked_local_attention"),  # not modelled: not indexed
    )
    assert indexer.model_info("m").side_groups == (1, 2)
    assert await blocks(indexer, PROMPT + TAIL) == {"a": (3, 3, 0)}  # 6 -> 4 (group 1) -> 3 (state at block 2)
    dropped = {"worker": "a", "reason": "other_group"}
    assert registry.get_sample_value("kvroute_index_dropped_total", dropped) == 1
    await a.send(AllBlocksCleared(), engine.store(PROMPT, group=0))  # every group cleared, group 0 only again
    assert await blocks(indexer, PROMPT + TAIL) == {}


def test_window_and_group_hits_follow_vllms_search() -> None:
    held = 0b110011  # blocks 0, 1, 4, 5
    assert window_hit(held, 6, 2) == 6 and window_hit(held, 5, 2) == 2 and window_hit(held, 1, 2) == 1
    assert window_hit(0b1101, 4, 3) == 1  # no 3-block window: the run from the start (shorter than 3)
    assert window_hit(0, 4, 1) == 0
    assert group_hit([(0, 0b111), (2, 0b110011)], 6) == 2  # full attention holds 3, the window fits at 2


# -- ownership -------------------------------------------------------------------------------------------


async def test_a_secondary_tier_copy_outlives_the_primary_tiers(indexer: KVIndexer) -> None:
    engine = Engine()
    a = Feed(indexer, "a")
    head = PROMPT[:64]
    await a.send(
        engine.store(head), engine.store(head, medium="CPU"), engine.store(head, medium="CPU", ownership="kvcr")
    )
    await a.send(engine.remove(head, [0, 1, 2, 3]))  # GPU evicted: the CPU copies remain
    assert await blocks(indexer, head + TAIL) == {"a": (4, 0, 4)}
    await a.send(engine.remove(head, [0, 1], medium="CPU"))  # the primary CPU tier drops two
    assert await blocks(indexer, head + TAIL) == {"a": (4, 0, 4)}  # kvcr still has them
    await a.send(engine.remove(head, [0, 1], medium="CPU", owner="kvcr"))
    await a.send(engine.remove(head, [0], medium="CPU", owner="kvcr"))  # kvcr holds no copy any more: nothing
    assert await blocks(indexer, head + TAIL) == {}
    await a.send(engine.remove(head, [2, 3], medium="CPU", owner="other"))  # no copy of that tier: nothing
    stats = await indexer.worker_info("a")
    assert stats is not None and stats["ranks"][0]["by_tier"] == {"CPU": 2}


# -- shared index readers --------------------------------------------------------------------------------


async def test_a_reader_of_a_shared_index_learns_lookahead_and_groups(redis_url: str) -> None:
    writer = KVIndexer(RedisIndex(redis_url, prefix="t033"))
    reader = KVIndexer(RedisIndex(redis_url, prefix="t033"))
    try:
        writer.register_worker("a", "m")
        engine = Engine(lookahead=1)
        feed = Feed(writer, "a")
        await feed.send(*hybrid_store(engine, PROMPT + TAIL))
        await feed.send(engine.remove(PROMPT, [3], group=0))  # the window group lost block 3
        for tokens in (PROMPT + TAIL, PROMPT[:80] + TAIL, PROMPT[:48] + [9] * 48):
            assert await blocks(reader, tokens) == await blocks(writer, tokens), tokens
        assert await blocks(reader, PROMPT[:80] + TAIL) == {"a": (3, 3, 0)}
        info = reader.model_info("m")
        assert (info.lookahead, info.primary, info.side_groups) == (1, 1, (0,))
    finally:
        await writer.backend.close()
        await reader.backend.close()


# -- doubt: a reset or restart seen outside the events ---------------------------------------------------


async def test_a_doubted_worker_counts_again_once_its_events_come(backend: IndexBackend) -> None:
    indexer, registry = isolated(backend)
    engine, other = Engine(), Engine(seed=1)
    a, b = Feed(indexer, "a"), Feed(indexer, "b")
    await a.send(engine.store(PROMPT))
    await b.send(other.store(PROMPT))
    indexer.doubt_worker("a", "engine_restarted")
    assert set(await blocks(indexer, PROMPT)) == {"b"}
    await b.send(other.store(PROMPT + [5] * BS, start=6))
    assert set(await blocks(indexer, PROMPT)) == {"b"}  # another worker's events change nothing
    await a.send(AllBlocksCleared(), engine.store(PROMPT[:32]))  # its next step: the reset, then new blocks
    assert await blocks(indexer, PROMPT) == {"a": (2, 2, 0), "b": (6, 6, 0)}
    assert registry.get_sample_value("kvroute_index_doubts_total", {"worker": "a", "reason": "engine_restarted"}) == 1
    indexer.doubt_worker("a", max_s=0.0)  # a deadline already past: it never counts as doubtful
    assert set(await blocks(indexer, PROMPT)) == {"a", "b"}
    indexer.doubt_worker("b")
    assert await indexer.purge_worker("b") == 1  # a purge is the operator's word: nothing left to doubt
    assert not indexer.registry.doubtful


@pytest.mark.parametrize("rank", [0, 1])
async def test_doubt_covers_every_rank_and_readers(backend: IndexBackend, rank: int) -> None:
    indexer = KVIndexer(backend, metrics=IndexerMetrics(CollectorRegistry()))
    indexer.register_worker("w", "m", dp_size=2)
    await indexer.handle_message("w", frames_v033([Engine(seed=rank).store(PROMPT)], 0, dp_rank=rank))
    entity = "w" if rank == 0 else "w#1"
    assert set(await blocks(indexer, PROMPT)) == {entity}
    indexer.doubt_worker("w")
    assert await blocks(indexer, PROMPT) == {}
    reader = KVIndexer(backend, metrics=IndexerMetrics(CollectorRegistry()))  # no entities: doubts by worker
    reader.doubt_worker("w")
    if isinstance(backend, RedisIndex):
        assert await blocks(reader, PROMPT) == {}
