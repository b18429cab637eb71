"""Per-request receipts: the plan, its prediction and runner-up, and what the engine did, over real sockets."""

from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import FAST, eventually, routed_fleet, words
from tests.end_to_end.test_end_to_end import indexed_blocks
from tests.http.upstream import serve


async def test_receipts_hold_plan_prediction_runner_up_and_observation(tmp_path: Path) -> None:
    path = tmp_path / "receipts.jsonl"
    async with SimFleet(2, "tiny", time_scale=FAST) as fleet:
        config = fleet.serve_config(
            policy="kvaware", health_interval_s=0.2, metrics_interval_s=0.2, receipts=10, receipts_path=str(path)
        )
        async with (
            serve(build_app(RouterConfig.model_validate(config)), lifespan="on") as url,
            httpx.AsyncClient(timeout=30) as client,
        ):
            prompt = words(300, "receipt")
            body = {
                "model": fleet.model,
                "prompt": prompt,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            first = await client.post(f"{url}/v1/completions", json=body)
            assert first.status_code == 200
            holder = orjson.loads((await client.get(f"{url}/admin/receipts")).content)["receipts"][0]["prefill"]
            await eventually(lambda: indexed_blocks(client, url, holder))
            second = await client.post(f"{url}/v1/completions", json={**body, "prompt": prompt + " more"})
            assert second.status_code == 200
            receipts = (await client.get(f"{url}/admin/receipts", params={"limit": 5})).json()["receipts"]
            assert (await client.get(f"{url}/admin/receipts", params={"limit": -1})).status_code == 400
    assert [r["policy"] for r in receipts] == ["kvaware", "kvaware"]
    last = receipts[-1]
    assert last["prefill"] == holder
    assert last["predicted"]["cached_tokens"] == last["observed"]["cached_tokens"] > 0
    assert last["predicted"]["by_tier"] == {"GPU": last["predicted"]["cached_tokens"]}
    assert last["observed"]["ttft_s"] is not None and last["observed"]["status"] == 200
    assert last["predicted"]["terms"]["prefill_s"] >= 0
    assert last["runner_up"] is not None and last["runner_up"]["prefill"] != holder
    assert last["runner_up"]["ttft_s"] > 0 and last["runner_up"]["cached_tokens"] == 0  # the other worker holds none
    assert last["runner_up"]["terms"]["prefill_s"] > last["predicted"]["terms"]["prefill_s"]  # it recomputes the prefix
    assert last["alternatives"][0] == last["runner_up"] and last["runner_up"]["rank_s"] >= last["predicted"]["ttft_s"]
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]  # flushed at shutdown
    assert [line["request_id"] for line in lines] == [r["request_id"] for r in receipts]


async def test_a_split_plan_reports_its_prefill_leg_and_the_handoff_is_learnt_from_it(tmp_path: Path) -> None:
    """The router times the prefiller's answer itself: the rest of the first token's wait is the handoff and
    the decoder's step, which the cost model learns instead of blaming the prefill speed for it."""
    async with routed_fleet(
        2,
        roles=["prefill", "decode"],
        pool={"kv_protocol": "nixl"},
        policy_options={"pd_local_prefill": False},
        receipts=10,
    ) as (fleet, url, app):
        policy = app.state.kvroute.flow.policy
        async with httpx.AsyncClient(timeout=30) as client:
            body = {
                "model": fleet.model,
                "prompt": words(900, "split"),
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            answer = await client.post(f"{url}/v1/completions", json=body)
            assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
            receipt = (await client.get(f"{url}/admin/receipts")).json()["receipts"][-1]
    assert receipt["kind"] == "P/D" and receipt["prefill"] != receipt["decode"]
    observed, terms = receipt["observed"], receipt["predicted"]["terms"]
    assert 0 < observed["prefill_leg_s"] < observed["ttft_s"]
    # The answer counts the KV the decoder pulled as cached; the prefiller's own hit is its leg's: none.
    assert observed["prefill_leg_cached_tokens"] == 0 < observed["cached_tokens"]
    assert policy.feedback.reported_cached_tokens == 0
    error = (observed["ttft_s"] - observed["prefill_leg_s"]) - (terms["handoff_s"] + terms["decode_queue_s"])
    learnt = policy.calibrator.handoff_extra_s(fleet.model)
    assert learnt == pytest.approx(max(-terms["handoff_s"], min(0.5, 0.2 * error)))
    assert learnt != 0.0
