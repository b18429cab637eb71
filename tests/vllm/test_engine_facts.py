"""Facts of vLLM's engine that the simulated workers copy, checked on the real one."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from .servers import BLOCK_SIZE, VllmServer
from .workload import ReferenceTokenizer, complete, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300, func_only=True)]


async def test_a_request_sent_with_another_reuses_the_prefix_it_is_computing(
    worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random, reference_tokenizer: ReferenceTokenizer
) -> None:
    """vLLM caches a block when it schedules it, before the forward pass fills it: of two requests sent at the
    same moment that share a prefix nobody sent before, one reports that prefix cached (docs/sim.md). An engine
    that reused only finished blocks would admit both before either finished and report 0 for both."""
    shared = prompt_words(rng, 160)
    first, second = shared + " " + prompt_words(rng, 12), shared + " " + prompt_words(rng, 12)
    ids = [reference_tokenizer.completion(text) for text in (first, second)]
    common = next((i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids)))
    full_blocks = common // BLOCK_SIZE * BLOCK_SIZE
    assert full_blocks >= 4 * BLOCK_SIZE, "the shared prefix is too short to tell"
    answers = await asyncio.gather(complete(http, worker_a.url, first), complete(http, worker_a.url, second))
    assert max(a.cached_tokens for a in answers) >= full_blocks, [a.cached_tokens for a in answers]
    assert min(a.cached_tokens for a in answers) == 0  # the other one computed it
