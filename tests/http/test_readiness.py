"""``/ready`` waits for the index to catch up: a fresh router replica over workers that already hold blocks
answers 503 (``index_catching_up``) until its replay of their event buffers has ended, so a Kubernetes
Service never sends it requests it would route blind. Real HTTP, real ZMQ (a publisher speaking vLLM's
wire format, its replay ROUTER answering slowly)."""

from __future__ import annotations

import httpx
import zmq.asyncio

from tests.http.conftest import run_router
from tests.http.upstream import FakeWorker, serve_worker
from tests.indexer.fakevllm import Chain, Publisher
from tests.polling import eventually

PROMPT = list(range(1000, 1000 + 16 * 4))


async def test_ready_only_once_the_index_has_caught_up(client: httpx.AsyncClient) -> None:
    ctx = zmq.asyncio.Context()
    worker = FakeWorker("w", models=["m1"])
    publisher = Publisher(ctx)
    publisher.replay_pause_s = 0.4  # each batch well within the per-reply timeout, the whole replay ~1.6 s
    chain = Chain()
    for k in range(4):  # cached before the router came up: only its catch-up replay can learn them
        await publisher.publish([chain.store(PROMPT[: 16 * (k + 1)], start_block=k)], lose=True)
    try:
        async with serve_worker(worker):
            spec = {"url": worker.url, "models": ["m1"], "kv_events": publisher.endpoint}
            spec["replay"] = publisher.replay_endpoint
            async with run_router([spec], policy="kvaware") as (url, app):
                indexer = app.state.kvroute.indexer
                answers: list[tuple[int, dict]] = []  # type: ignore[type-arg]

                async def ready() -> bool:
                    r = await client.get(url + "/ready")
                    answers.append((r.status_code, r.json()))
                    return r.status_code == 200

                await eventually(ready, timeout=20, interval=0.05, what="ready")
                known = (await indexer.lookup_tokens("m1", PROMPT)).matches
                # Ready means the whole buffer is in the index, and before that the answer said why not.
                assert [m.blocks for m in known.values()] == [4]
                waiting = [body for status, body in answers if status == 503 and body["index_catching_up"]]
                assert waiting and waiting[-1]["healthy_workers"] == 1
                assert publisher.replay_requests == [0]
    finally:
        await publisher.close()
        ctx.destroy(0)
