"""The shared behavioural suite: every test runs against the memory and the Redis backend."""

from __future__ import annotations

import pytest
from kvroute.indexer.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.indexer.keys import request_keys
from kvroute.indexer.service import KVIndexer, entity_id, split_entity
from kvroute.vocabulary import Tier

from .fakevllm import Chain, frames

PROMPT = list(range(1000, 1000 + 16 * 8))  # 8 blocks of 16


class Feed:
    """One worker rank's message stream into the indexer, with its own sequence counter."""

    def __init__(self, indexer: KVIndexer, worker: str, chain: Chain | None = None, dp_rank: int = 0) -> None:
        self.indexer, self.worker, self.dp_rank = indexer, worker, dp_rank
        self.chain = chain or Chain(seed=hash(worker) & 0xFFFF)
        self.seq = 0

    async def send(self, *events, form: str = "map", seq: int | None = None) -> str:  # type: ignore[no-untyped-def]
        if seq is not None:
            self.seq = seq
        message = frames(events, self.seq, self.dp_rank, form=form)
        handled = await self.indexer.handle_message(self.worker, message)
        self.seq += 1
        return handled.outcome


async def matches(indexer: KVIndexer, tokens=PROMPT, **kw) -> dict[str, tuple[int, ...]]:  # type: ignore[no-untyped-def]
    result = await indexer.lookup_tokens("m", tokens, **kw)
    return {w: (m.blocks, m.gpu, m.cpu, m.storage, m.remote) for w, m in result.matches.items()}


async def test_store_and_prefix_lookup(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    assert await a.send(a.chain.store(PROMPT[:64])) == "applied"
    assert await a.send(a.chain.store(PROMPT, start_block=4)) == "applied"
    b = Feed(indexer, "b")
    await b.send(b.chain.store(PROMPT[:48]))
    assert indexer.block_size("m") == 16
    assert await matches(indexer) == {"a": (8, 8, 0, 0, 0), "b": (3, 3, 0, 0, 0)}
    # A prompt diverging after two blocks matches two blocks everywhere; a partial block never counts.
    other = PROMPT[:32] + [7] * 40
    assert await matches(indexer, other) == {"a": (2, 2, 0, 0, 0), "b": (2, 2, 0, 0, 0)}
    assert await matches(indexer, PROMPT[:15]) == {}
    assert await matches(indexer, [5] * 64) == {}


async def test_interleaved_workers_and_array_form(indexer: KVIndexer) -> None:
    a, b = Feed(indexer, "a"), Feed(indexer, "b")
    for i in range(4):
        start = i * 2
        await a.send(a.chain.store(PROMPT[: (start + 2) * 16], start_block=start), form="array")
        await b.send(b.chain.store(PROMPT[: (start + 2) * 16], start_block=start))
    assert await matches(indexer) == {"a": (8, 8, 0, 0, 0), "b": (8, 8, 0, 0, 0)}


async def test_removal_cuts_the_run(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT))
    await a.send(a.chain.remove(PROMPT, [5, 6, 7]))
    assert await matches(indexer) == {"a": (5, 5, 0, 0, 0)}
    await a.send(a.chain.remove(PROMPT, [2]))  # a hole in the middle ends the run there
    assert await matches(indexer) == {"a": (2, 2, 0, 0, 0)}
    # Removing unknown hashes or already removed ones is ignored.
    await a.send(BlockRemoved(block_hashes=[12345, 67890]), a.chain.remove(PROMPT, [2]))
    assert await matches(indexer) == {"a": (2, 2, 0, 0, 0)}
    assert (await indexer.stats())["workers"][0]["blocks"] == 4


async def test_a_block_stored_twice_needs_two_removals(indexer: KVIndexer) -> None:
    # vLLM recomputes the last block of a fully cached, block-aligned prompt and holds two copies under
    # one hash, announcing each store and each removal: the first removal must not drop the block.
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT))
    await a.send(a.chain.store(PROMPT, start_block=7))
    await a.send(a.chain.remove(PROMPT, [7]))
    assert await matches(indexer) == {"a": (8, 8, 0, 0, 0)}
    await a.send(a.chain.remove(PROMPT, [7]))
    assert await matches(indexer) == {"a": (7, 7, 0, 0, 0)}
    await a.send(a.chain.remove(PROMPT, [7]))  # a removal beyond the copies is ignored
    assert await matches(indexer) == {"a": (7, 7, 0, 0, 0)}


async def test_all_blocks_cleared(indexer: KVIndexer) -> None:
    a, b = Feed(indexer, "a"), Feed(indexer, "b")
    await a.send(a.chain.store(PROMPT))
    await b.send(b.chain.store(PROMPT))
    await a.send(AllBlocksCleared())
    assert await matches(indexer) == {"b": (8, 8, 0, 0, 0)}
    # The worker starts afresh: new chains are indexed again.
    await a.send(a.chain.store(PROMPT[:32]))
    assert await matches(indexer) == {"a": (2, 2, 0, 0, 0), "b": (8, 8, 0, 0, 0)}


async def test_tiers_and_offloading_placeholders(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT))
    # The offloading connector copies blocks 0-5 to CPU (a placeholder: hashes only), then GPU evicts 3-7.
    await a.send(a.chain.store(PROMPT[:96], placeholder=True, medium="CPU"))
    await a.send(a.chain.remove(PROMPT, [3, 4, 5, 6, 7]))
    assert await matches(indexer) == {"a": (6, 3, 3, 0, 0)}
    # Self-describing storage events carry tokens; a remote copy counts as remote.
    b = Feed(indexer, "b")
    await b.send(b.chain.store(PROMPT[:64], medium="STORAGE", locality="REMOTE"))
    assert (await matches(indexer))["b"] == (4, 0, 0, 4, 4)
    blocks = await indexer.backend.block_workers("m", request_keys(PROMPT, 16, "m")[0])
    assert blocks == {"a": int(Tier.GPU | Tier.CPU), "b": int(Tier.STORAGE_REMOTE)}


async def test_tenants_and_models_never_share_keys(backend) -> None:  # type: ignore[no-untyped-def]
    indexer = KVIndexer(backend)
    indexer.register_worker("a", "m")
    indexer.register_worker("c", "other-model")
    a, c = Feed(indexer, "a"), Feed(indexer, "c")
    await a.send(a.chain.store(PROMPT[:32], extra_keys=[["tenant-1"], None]))
    await a.send(Feed(indexer, "a").chain.store(PROMPT[:64], lora_name="my-lora"))
    await c.send(c.chain.store(PROMPT))
    assert await matches(indexer) == {}
    assert await matches(indexer, cache_salt="tenant-1") == {"a": (2, 2, 0, 0, 0)}
    assert await matches(indexer, cache_salt="tenant-2") == {}
    assert await matches(indexer, lora_name="my-lora") == {"a": (4, 4, 0, 0, 0)}
    result = await indexer.lookup_tokens("other-model", PROMPT)
    assert list(result.matches) == ["c"]


async def test_purge_and_worker_removal(indexer: KVIndexer) -> None:
    a, b = Feed(indexer, "a"), Feed(indexer, "b")
    await a.send(a.chain.store(PROMPT))
    await b.send(b.chain.store(PROMPT))
    assert await indexer.purge_worker("a", "admin") == 1
    assert await matches(indexer) == {"b": (8, 8, 0, 0, 0)}
    # Sequence tracking goes on after an admin purge, and new blocks are indexed under a fresh slot.
    assert await a.send(a.chain.store([1] * 32)) == "applied"
    await a.send(a.chain.store(PROMPT[:48]))  # known hashes: parent None, all three re-announced
    assert await matches(indexer) == {"a": (3, 3, 0, 0, 0), "b": (8, 8, 0, 0, 0)}
    await indexer.unregister_worker("b")
    assert await matches(indexer) == {"a": (3, 3, 0, 0, 0)}
    assert await b.send(b.chain.store(PROMPT)) == "dropped"  # unknown worker now


async def test_data_parallel_ranks_are_separate_entities(backend) -> None:  # type: ignore[no-untyped-def]
    indexer = KVIndexer(backend)
    indexer.register_worker("w", "m", dp_size=2)
    r0, r1 = Feed(indexer, "w", dp_rank=0), Feed(indexer, "w", dp_rank=1)
    await r0.send(r0.chain.store(PROMPT[:32]))
    await r1.send(r1.chain.store(PROMPT))
    await r1.send(r1.chain.store(PROMPT[:16] + [9] * 16, start_block=1))
    assert await matches(indexer) == {"w": (2, 2, 0, 0, 0), "w#1": (8, 8, 0, 0, 0)}
    assert entity_id("w", 1) == "w#1" and split_entity("w#1") == ("w", 1) and split_entity("w") == ("w", 0)
    await indexer.purge_worker("w")
    assert await matches(indexer) == {}


async def test_engine_restart_purges(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    for i in range(3):
        await a.send(a.chain.store(PROMPT[: (i + 1) * 16], start_block=i))
    restarted = Chain(seed=99)
    assert await a.send(restarted.store(PROMPT[:32]), seq=0) == "restart"
    assert await matches(indexer) == {"a": (2, 2, 0, 0, 0)}
    # A restart whose first batches we missed still goes backwards: also a restart.
    assert await a.send(restarted.store([3] * 16), seq=1) == "applied"
    assert await a.send(AllBlocksCleared(), seq=0) == "restart"


async def test_gap_without_replay_purges(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT[:64]))
    assert await a.send(a.chain.store(PROMPT, start_block=4), seq=5) == "resync"
    # Everything before the gap is forgotten (a removal may have been lost); the new batch is kept only
    # where its parent chain is known, which it is not after a purge.
    assert await matches(indexer) == {}
    assert await a.send(a.chain.store(PROMPT[:32])) == "applied"
    assert await matches(indexer) == {"a": (2, 2, 0, 0, 0)}
    stats = await indexer.stats()
    row = next(w for w in stats["workers"] if w["id"] == "a")
    assert row["gaps"] == 1 and row["purges"] == 1


async def test_gap_reported_for_replay(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT[:16]))
    lost = a.chain.store(PROMPT[:32], start_block=1)
    handled = await indexer.handle_message("a", frames([a.chain.store(PROMPT[:48], start_block=2)], 2), on_gap="report")
    assert handled.outcome == "gap" and handled.dp_rank == 0 and handled.seq == 2
    assert indexer.expected_seq("a") == 1
    indexer.begin_replay("a", 0, 1)
    assert (await indexer.handle_message("a", frames([lost], 1), replay=True)).outcome == "applied"
    again = frames([a.chain.store(PROMPT[:48], start_block=2)], 2)
    assert (await indexer.handle_message("a", again, replay=True)).outcome == "applied"
    # The live message that revealed the gap is now a duplicate, as is any overlap.
    assert (await indexer.handle_message("a", again)).outcome == "duplicate"
    assert await matches(indexer) == {"a": (3, 3, 0, 0, 0)}


async def test_unknown_parent_and_block_size_mismatch_are_dropped(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT[:32]))
    orphan = BlockStored(block_hashes=[1, 2], parent_block_hash=424242, token_ids=PROMPT[:32], block_size=16)
    other_size = BlockStored(block_hashes=[3], parent_block_hash=None, token_ids=PROMPT[:32], block_size=32)
    assert await a.send(orphan, other_size) == "applied"
    assert await matches(indexer) == {"a": (2, 2, 0, 0, 0)}
    row = (await indexer.stats())["workers"][0]
    assert row["dropped"] == 2
    assert indexer.check_block_size("m", 16) and not indexer.check_block_size("m", 32)


async def test_bytes_hashes(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a", Chain(int_hashes=False))
    await a.send(a.chain.store(PROMPT))
    await a.send(a.chain.remove(PROMPT, [7]))
    assert await matches(indexer) == {"a": (7, 7, 0, 0, 0)}


async def test_stats_and_worker_stats(indexer: KVIndexer) -> None:
    a = Feed(indexer, "a")
    await a.send(a.chain.store(PROMPT))
    await a.send(a.chain.store(PROMPT[:32], placeholder=True, medium="CPU"))
    stats = await indexer.stats()
    assert stats["backend_ok"] and stats["block_sizes"] == {"m": 16}
    row = next(w for w in stats["workers"] if w["id"] == "a")
    assert row["blocks"] == 8 and row["by_tier"] == {"GPU": 8, "CPU": 2}
    backend_rows = {r.worker_id: r for r in await indexer.backend.worker_stats()}
    assert backend_rows["a"].blocks == 8 and backend_rows["a"].by_tier == {"GPU": 8, "CPU": 2}
    info = await indexer.worker_info("a")
    assert info is not None and info["blocks"] == 8
    assert await indexer.worker_info("nobody") is None


@pytest.mark.parametrize("n_workers", [3, 9])
async def test_many_workers_with_varied_prefixes(backend, n_workers: int) -> None:  # type: ignore[no-untyped-def]
    """Holders drop out at different depths and tiers change mid-run: the walk's slow path."""
    indexer = KVIndexer(backend)
    expected = {}
    for i in range(n_workers):
        wid = f"w{i}"
        indexer.register_worker(wid, "m")
        feed = Feed(indexer, wid)
        depth = 1 + i % 8
        await feed.send(feed.chain.store(PROMPT[: depth * 16]))
        cpu = 0
        if i % 3 == 0 and depth > 1:
            await feed.send(feed.chain.store(PROMPT[:16], placeholder=True, medium="CPU"))
            await feed.send(feed.chain.remove(PROMPT, [0]))
            cpu = 1
        expected[wid] = (depth, depth - cpu, cpu, 0, 0)
    assert await matches(indexer) == expected


async def test_batched_writes_keep_order(indexer: KVIndexer) -> None:
    """Deferred writes (one per entity per burst) give the same index, purges included."""
    a, b = Feed(indexer, "a"), Feed(indexer, "b")
    async with indexer.batched():
        await a.send(a.chain.store(PROMPT[:64]))
        await b.send(b.chain.store(PROMPT))
        await a.send(a.chain.store(PROMPT, start_block=4))
        await a.send(a.chain.remove(PROMPT, [6]))
        assert await a.send(Chain(seed=77).store(PROMPT[:32]), seq=0) == "restart"  # purge mid-burst
        await a.send(Chain(seed=77).store(PROMPT[:48], start_block=2))
        await b.send(b.chain.remove(PROMPT, [5]))
    assert await matches(indexer) == {"a": (3, 3, 0, 0, 0), "b": (5, 5, 0, 0, 0)}
