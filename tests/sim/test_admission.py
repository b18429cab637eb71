"""Admission control (vLLM >= 0.32 ``--max-num-queued-reqs`` / ``--max-num-queued-tokens``): a full
worker answers 503 with vLLM's body before any byte, counts ``vllm:admission_rejections_total``, and
admits again once requests finish."""

from __future__ import annotations

import asyncio
from typing import Any

from kvroute.sim.admission import QUEUE_FULL_MESSAGE, TOKENS_FULL_MESSAGE

from tests.sim.conftest import words
from tests.sim.test_transfers import metric

#: Slow enough that requests stay in flight while the test sends more (real seconds at time_scale 1).
SLOW_DECODE = {"decode_base_s": 0.05, "decode_per_seq_s": 0.0}
SLOW_PREFILL = {"prefill_tokens_per_s": 100.0, "attention_coeff_s": 0.0}


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _queue_full(r: Any) -> None:
    """vLLM's exact answer: 503, JSON (no SSE even for a stream), ``QueueOverflowError``'s message."""
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json() == {
        "error": {"message": QUEUE_FULL_MESSAGE, "type": "Service Unavailable", "param": None, "code": 503}
    }
    assert "retry-after" not in r.headers


async def test_max_num_queued_reqs_rejects_before_any_byte_then_admits_again(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_DECODE, max_num_queued_reqs=2)
    w = fleet[0]
    url = w.url
    body = {"prompt": words(20), "max_tokens": 30}
    running = [asyncio.create_task(client.post(f"{url}/v1/completions", json=body)) for _ in range(2)]
    await _until(lambda: w.admission.requests == 2)
    # Full: every generation surface refuses, streams included, before anything is sent.
    _queue_full(await client.post(f"{url}/v1/completions", json=body))
    _queue_full(await client.post(f"{url}/v1/completions", json={**body, "stream": True}))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _queue_full(await client.post(f"{url}/v1/chat/completions", json={**chat, "stream": True}))
    _queue_full(await client.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 2}))
    r = await client.post(f"{url}/v1/messages", json={"model": w.model, "max_tokens": 2, **chat})
    assert r.status_code == 503
    assert r.json() == {"type": "error", "error": {"type": "overloaded_error", "message": QUEUE_FULL_MESSAGE}}
    # Not generation: tokenize and health still answer.
    assert (await client.post(f"{url}/tokenize", json={"prompt": "a b"})).status_code == 200
    text = (await client.get(f"{url}/metrics")).text
    assert metric(text, "vllm:admission_rejections_total", reason="max_num_queued_reqs", model_name=w.model) == 5
    assert f'vllm:admission_rejections_total{{model_name="{w.model}",reason="max_num_queued_tokens"}} 0.0' in text
    for answer in await asyncio.gather(*running):
        assert answer.status_code == 200
    assert w.admission.requests == 0 and w.admission.prefill_tokens == 0
    assert (await client.post(f"{url}/v1/completions", json={**body, "max_tokens": 1})).status_code == 200


async def test_streams_hold_their_slot_until_they_end(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_DECODE, max_num_queued_reqs=1)
    w = fleet[0]
    body = {"prompt": words(20), "max_tokens": 20, "stream": True}
    async with client.stream("POST", f"{w.url}/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        chunks = stream.aiter_lines()
        assert (await chunks.__anext__()).startswith("data: ")  # first token out: in decode, still counted
        assert w.admission.requests == 1 and w.admission.prefill_tokens == 0
        _queue_full(await client.post(f"{w.url}/v1/completions", json={**body, "stream": False}))
    # The client hung up mid-stream: the slot is given back.
    await _until(lambda: w.admission.requests == 0)
    await _until(lambda: w.engine.running == 0)
    assert (await client.post(f"{w.url}/v1/completions", json={**body, "max_tokens": 1})).status_code == 200


async def test_max_num_queued_tokens_counts_prompts_still_in_prefill(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_PREFILL, max_num_queued_tokens=100)
    w = fleet[0]
    first = asyncio.create_task(client.post(f"{w.url}/v1/completions", json={"prompt": words(100), "max_tokens": 1}))
    await _until(lambda: w.admission.prefill_tokens == 100)
    # current (100) >= max (100): refused, however small the new prompt.
    r = await client.post(f"{w.url}/v1/completions", json={"prompt": "tiny", "max_tokens": 1})
    assert r.status_code == 503
    assert r.json()["error"] == {
        "message": TOKENS_FULL_MESSAGE,
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
    text = (await client.get(f"{w.url}/metrics")).text
    assert metric(text, "vllm:admission_rejections_total", reason="max_num_queued_tokens") == 1
    assert (await first).status_code == 200
    assert w.admission.prefill_tokens == 0
    assert (await client.post(f"{w.url}/v1/completions", json={"prompt": "tiny", "max_tokens": 1})).status_code == 200


async def test_prefill_backlog_below_the_limit_admits_any_size(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_PREFILL, max_num_queued_tokens=101)
    w = fleet[0]
    first = asyncio.create_task(client.post(f"{w.url}/v1/completions", json={"prompt": words(100), "max_tokens": 1}))
    await _until(lambda: w.admission.prefill_tokens == 100)
    r = await client.post(f"{w.url}/v1/completions", json={"prompt": words(200, "big-"), "max_tokens": 1})
    assert r.status_code == 200  # 100 < 101: admitted, although the backlog then exceeds the limit
    assert (await first).status_code == 200


async def test_limits_count_over_every_data_parallel_rank(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1, time_scale=1.0, preset_overrides=SLOW_DECODE, max_num_queued_reqs=2, dp_size=2)
    w = fleet[0]
    body = {"prompt": words(20), "max_tokens": 30}
    running = [
        asyncio.create_task(
            client.post(f"{w.url}/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
        )
        for rank in (0, 1)
    ]
    await _until(lambda: w.admission.requests == 2)
    assert [r.inflight for r in w.ranks] == [1, 1]
    _queue_full(await client.post(f"{w.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "0"}))
    for answer in await asyncio.gather(*running):
        assert answer.status_code == 200


async def test_no_limits_by_default(make_fleet: Any, client: Any) -> None:
    fleet = await make_fleet(1)
    w = fleet[0]
    answers = await asyncio.gather(
        *(client.post(f"{w.url}/v1/completions", json={"prompt": words(20), "max_tokens": 2}) for _ in range(12))
    )
    assert all(a.status_code == 200 for a in answers)
    text = (await client.get(f"{w.url}/metrics")).text
    assert metric(text, "vllm:admission_rejections_total") == 0
