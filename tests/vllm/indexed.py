"""kvroute's indexer (KVIndexer + EventSubscriber) wired to the real vLLM pool, and the probe check.

The check is the tier's core claim: for a request about to be sent to a worker, the index's match
turned into tokens (``engine_cached``) equals ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec

from .kvwire import wait_for
from .servers import BLOCK_SIZE, MODEL_NAME, VllmServer
from .workload import Answer, ReferenceTokenizer, chat, complete, engine_cached, prompt_words

#: Generous: events travel through ZMQ on a loaded 2-core machine.
SYNC_TIMEOUT_S = 60.0


def spec_for(server: VllmServer) -> WorkerSpec:
    """vLLM binding its PUB (ipc) -> we connect to it; vLLM connecting (tcp) -> our bound socket."""
    endpoint = server.events if server.vllm_binds_events else None
    return WorkerSpec(
        worker_id=server.name, model=MODEL_NAME, endpoint=endpoint, topic=server.topic, replay=server.replay
    )


@dataclass
class Probe:
    """One comparison: what the index predicted for a worker and what vLLM then reported."""

    worker: str
    kind: str
    prompt_tokens: int
    predicted: int
    cached: int

    @property
    def ok(self) -> bool:
        return self.predicted == self.cached


@dataclass
class IndexedPool:
    """An indexer subscribed to every server of the pool, as ``kvroute serve`` would run it."""

    servers: list[VllmServer]
    backend: IndexBackend
    tokenizer: ReferenceTokenizer
    grace_s: float = 30.0
    indexer: KVIndexer | None = None
    subscriber: EventSubscriber | None = None
    probes: list[Probe] = field(default_factory=list)

    async def start(self, indexer: KVIndexer | None = None) -> None:
        """Subscribe (a fresh indexer unless one is given: the 'router restarted' cases).

        The session's servers have served other tests before: the subscriber's catch-up replay (on a
        worker's first message) must bring that history in, or the first probes fail.
        """
        self.indexer = indexer or KVIndexer(self.backend)
        bind = next((s.events for s in self.servers if not s.vllm_binds_events), None)
        self.subscriber = EventSubscriber(self.indexer, bind=bind, grace_s=self.grace_s)
        for server in self.servers:
            self.subscriber.add_worker(spec_for(server))
        await self.subscriber.start()

    async def stop(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.stop()
            self.subscriber = None

    async def matched_blocks(self, worker: str, tokens: list[int], cache_salt: str | None = None) -> int:
        assert self.indexer is not None
        result = await self.indexer.lookup_tokens(MODEL_NAME, tokens, cache_salt=cache_salt)
        match = result.matches.get(worker)
        return 0 if match is None else match.blocks

    async def sync(self, server: VllmServer, http: httpx.AsyncClient, rng: random.Random) -> None:
        """Barrier: send a fresh sentinel prompt and wait until the index shows its blocks.

        Each worker's events are applied in sequence order, so once the sentinel's blocks are in the
        index, every earlier event of that worker is too (evictions it caused included). A new
        sentinel goes out every few seconds: right after a subscriber starts, ZMQ may not be
        connected yet and the first one can be lost.
        """
        deadline = asyncio.get_running_loop().time() + SYNC_TIMEOUT_S
        while True:
            prompt = prompt_words(rng, 60)
            tokens = self.tokenizer.completion(prompt)
            await complete(http, server.url, prompt, max_tokens=1)
            want = len(tokens) // BLOCK_SIZE

            async def arrived(tokens: list[int] = tokens, want: int = want) -> bool:
                return await self.matched_blocks(server.name, tokens) >= want

            try:
                await wait_for(arrived, 5.0, what="sentinel")
                return
            except AssertionError:
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(
                        f"the index never showed {server.name}'s sentinel blocks within {SYNC_TIMEOUT_S:.0f} s"
                    ) from None

    async def probe(
        self,
        server: VllmServer,
        http: httpx.AsyncClient,
        rng: random.Random,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        max_tokens: int = 1,
        cache_salt: str | None = None,
    ) -> Answer:
        """Sync, predict from the index, send, record predicted vs reported cached tokens.

        ``prompt`` may be token ids (sent as such: no BOS added), to hit exact block boundaries.
        """
        await self.sync(server, http, rng)
        if messages is not None:
            tokens, kind = self.tokenizer.chat(messages), "chat"
        elif isinstance(prompt, list):
            tokens, kind = list(prompt), "token ids"
        else:
            tokens, kind = self.tokenizer.completion(prompt or ""), "completion"
        predicted = engine_cached(len(tokens), await self.matched_blocks(server.name, tokens, cache_salt))
        extra = {"cache_salt": cache_salt} if cache_salt else {}
        if messages is not None:
            answer = await chat(http, server.url, messages, max_tokens=max_tokens, **extra)
        else:
            answer = await complete(http, server.url, prompt or "", max_tokens=max_tokens, **extra)
        assert answer.prompt_tokens == len(tokens), "reference tokens differ from the engine's"
        self.probes.append(Probe(server.name, kind, len(tokens), predicted, answer.cached_tokens))
        return answer

    def assert_all_exact(self) -> None:
        bad = [p for p in self.probes if not p.ok]
        assert self.probes, "no probe was made"
        assert not bad, "index predictions differ from vLLM's cached tokens:\n" + "\n".join(map(str, bad))

    async def stats(self) -> dict[str, Any]:
        assert self.indexer is not None
        return await self.indexer.stats()
