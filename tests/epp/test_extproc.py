"""The Endpoint Picker over a real gRPC stream, in front of simulated vLLM workers and the full router state."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import orjson
import pytest
from kvroute.router.extproc import Endpoints, endpoint_of
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import eventually, words
from tests.end_to_end.test_end_to_end import BusyHolder, indexed_blocks, metric
from tests.epp.conftest import (
    BUFFERED,
    Envoy,
    epp_fleet,
    picked_metadata,
    request_body,
    request_headers,
    response_body,
    response_headers,
    running_epp,
    set_headers,
)


def completion(model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4, **extra}


def chunks(data: bytes, n: int) -> list[bytes]:
    step = -(-len(data) // n)
    return [data[i : i + step] for i in range(0, len(data), step)]


async def test_full_duplex_pick_rewrite_and_outcome() -> None:
    async with epp_fleet(3) as (fleet, picker), httpx.AsyncClient(timeout=30) as client:
        holder = fleet[2]
        prompt = words(200, "shared")
        warm = await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))
        assert warm.status_code == 200
        await eventually(lambda: indexed_blocks(client, picker.url, holder.worker_id))

        # The client tries to steer the KV transfer; the body arrives in several chunks.
        sent = completion(
            fleet.model, prompt + " next", kv_transfer_params={"remote_host": "evil.example", "remote_port": 1}
        )
        envoy = Envoy(picker.stub)
        parts = chunks(orjson.dumps(sent), 3)
        await envoy.send(request_headers(), *(request_body(p, i == len(parts) - 1) for i, p in enumerate(parts)))
        head, body = await envoy.recv(2)

        endpoint = endpoint_of(holder.url)
        assert head.HasField("request_headers")
        headers = set_headers(head.request_headers.response.header_mutation)
        assert headers["x-gateway-destination-endpoint"] == endpoint
        assert picked_metadata(head) == endpoint
        streamed = body.request_body.response.body_mutation.streamed_response
        assert streamed.end_of_stream
        rewritten = orjson.loads(streamed.body)
        assert headers["content-length"] == str(len(streamed.body))
        assert b"evil.example" not in streamed.body
        assert "remote_host" not in (rewritten.get("kv_transfer_params") or {})
        assert rewritten["prompt"] == sent["prompt"]

        # Envoy forwards the rewritten body to the picked endpoint, then shows the picker the answer.
        answer = await client.post(
            f"http://{endpoint}/v1/completions", content=streamed.body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 200
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
        await envoy.send(response_headers(200))
        (resp_head,) = await envoy.recv()
        assert resp_head.HasField("response_headers")
        back = []
        for i, part in enumerate(chunks(answer.content, 2)):
            await envoy.send(response_body(part, i == 1))
            (echo,) = await envoy.recv()
            back.append(echo.response_body.response.body_mutation.streamed_response.body)
        assert b"".join(back) == answer.content  # passed through untouched
        await envoy.close()

        text = (await client.get(f"{picker.url}/metrics")).text
        assert metric(text, "kvroute_checked_decisions_total") == 1
        assert metric(text, "kvroute_stale_decisions_total") == 0
        assert metric(text, "kvroute_client_kv_params_removed_total") >= 1
        workers = (await client.get(f"{picker.url}/admin/workers")).json()
        assert all(w["inflight"] == 0 for w in workers["workers"])  # the pick's slot was given back


async def test_subset_hint_buffered_mode_and_errors() -> None:
    async with epp_fleet(2) as (fleet, picker), httpx.AsyncClient(timeout=30) as client:
        holder, other = fleet[0], fleet[1]
        prompt = words(120, "s")
        await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))
        await eventually(lambda: indexed_blocks(client, picker.url, holder.worker_id))

        # Envoy's subset hint wins over the cache: only the hinted endpoint may be picked. Buffered mode.
        envoy = Envoy(picker.stub)
        await envoy.send(request_headers(mode=BUFFERED, subset=[endpoint_of(other.url)]))
        (cont,) = await envoy.recv()
        assert cont.HasField("request_headers") and not cont.request_headers.response.HasField("header_mutation")
        await envoy.send(request_body(orjson.dumps(completion(fleet.model, prompt)), True))
        (picked,) = await envoy.recv()
        common = picked.request_body.response
        assert set_headers(common.header_mutation)["x-gateway-destination-endpoint"] == endpoint_of(other.url)
        assert picked_metadata(picked) == endpoint_of(other.url)
        # A streamed answer: usage is read from the SSE data lines (buffered mode: acknowledged, not echoed).
        usage = {"prompt_tokens": 120, "prompt_tokens_details": {"cached_tokens": 0}}
        await envoy.send(
            response_headers(200, "text/event-stream"),
            response_body(b'data: {"choices": [{"text": "a"}]}\n\n', False),
            response_body(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n", True),
        )
        kinds = [a.WhichOneof("response") for a in await envoy.recv(3)]
        assert kinds == ["response_headers", "response_body", "response_body"]
        await envoy.close()
        text = (await client.get(f"{picker.url}/metrics")).text
        assert metric(text, "kvroute_checked_decisions_total") == 1

        # A subset none of whose endpoints is ours: 503, as the protocol requires.
        envoy = Envoy(picker.stub)
        await envoy.send(
            request_headers(subset=["10.255.0.1:8000"]),
            request_body(orjson.dumps(completion(fleet.model, prompt)), True),
        )
        (refused,) = await envoy.recv()
        assert refused.immediate_response.status.code == 503
        assert orjson.loads(refused.immediate_response.body)["error"]["code"] == "no_healthy_worker"

        # A malformed body: 400 with an OpenAI-style JSON error, and the stream ends cleanly.
        envoy = Envoy(picker.stub)
        await envoy.send(
            request_headers(), request_body(b'{"model": "x", "prompt": ', False), request_body(b"oops", True)
        )
        (bad,) = await envoy.recv()
        assert bad.immediate_response.status.code == 400
        error = orjson.loads(bad.immediate_response.body)["error"]
        assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
        await envoy.close()

        # A GET without a body is routed on load alone, in the headers answer.
        envoy = Envoy(picker.stub)
        await envoy.send(request_headers("/v1/models", method="GET", eos=True))
        (get,) = await envoy.recv()
        target = set_headers(get.request_headers.response.header_mutation)["x-gateway-destination-endpoint"]
        assert target in {endpoint_of(w.url) for w in fleet.workers}


def dead_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(30)
async def test_no_healthy_worker_is_503() -> None:
    config = {
        "workers": [{"url": f"http://127.0.0.1:{dead_port()}", "models": ["m1"]}],
        "health_interval_s": 0.1,
        "unhealthy_after": 1,
    }
    async with running_epp(config) as picker, httpx.AsyncClient(timeout=10) as client:
        await eventually(lambda: _unhealthy(client, picker.url))
        envoy = Envoy(picker.stub)
        await envoy.send(request_headers(), request_body(orjson.dumps(completion("m1", "hello")), True))
        (answer,) = await envoy.recv()
        assert answer.immediate_response.status.code == 503
        headers = set_headers(answer.immediate_response.headers)
        assert headers["content-type"] == "application/json"
        assert orjson.loads(answer.immediate_response.body)["error"]["type"] == "service_unavailable"
        await envoy.close()


async def _unhealthy(client: httpx.AsyncClient, url: str) -> bool:
    workers = (await client.get(f"{url}/admin/workers")).json()["workers"]
    return all(w["healthy"] is False for w in workers)


async def test_p2p_plan_injects_the_peer_and_the_engine_pulls_from_it() -> None:
    """The cost model names a busy holder as ``remote_kv_source``: the picked body carries the router's
    kv_transfer_params (registered peer address, never the client's), and the engine really fetches."""
    slow = {"sim-tiny": {"prefill_tokens_per_s": 2000.0}}
    fleet = SimFleet(2, "tiny", time_scale=0.01, preset_overrides={"gpu_blocks": 512})
    async with fleet, httpx.AsyncClient(timeout=30) as client:
        config = fleet.serve_config(
            policy="kvaware",
            health_interval_s=0.2,
            metrics_interval_s=0.2,
            pool={"kv_protocol": "p2p"},
            policy_options={"models": slow},
        )
        async with running_epp(config) as picker:
            holder, other = fleet.workers
            prompt = words(1500, "hot")
            await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))

            async def indexed() -> bool:
                return await indexed_blocks(client, picker.url, holder.worker_id) >= 80

            await eventually(indexed, what="the holder's blocks in the index")
            flow = picker.app.state.kvroute.flow
            flow.policy = BusyHolder(flow.policy, holder.worker_id)

            envoy = Envoy(picker.stub)
            sent = completion(
                fleet.model,
                prompt,
                kv_transfer_params={
                    "remote_kv_source": {"kv_request_id": "x", "remote_host": "evil.example", "remote_port": 1}
                },
            )
            await envoy.send(request_headers(), request_body(orjson.dumps(sent), True))
            head, body = await envoy.recv(2)
            assert picked_metadata(head) == endpoint_of(other.url)
            forwarded = body.request_body.response.body_mutation.streamed_response.body
            source = orjson.loads(forwarded)["kv_transfer_params"]["remote_kv_source"]
            assert (source["remote_host"], source["remote_port"]) == ("127.0.0.1", holder.p2p_port)
            assert b"evil.example" not in forwarded
            answer = await client.post(
                f"{other.url}/v1/completions", content=forwarded, headers={"content-type": "application/json"}
            )
            assert answer.status_code == 200
            assert other.stats()["kv_bytes_received"] > 0 and holder.stats()["kv_bytes_sent"] > 0
            await envoy.send(response_headers(200), response_body(answer.content, True))
            await envoy.recv(2)
            await envoy.close()
            text = (await client.get(f"{picker.url}/metrics")).text
            assert metric(text, "kvroute_route_plans_total", shape="aggregated+p2p") == 1


async def test_prefill_decode_pool_is_refused_not_half_done() -> None:
    fleet = SimFleet(2, "tiny", time_scale=0.01, roles=["prefill", "decode"])
    async with fleet, httpx.AsyncClient(timeout=30) as client:
        config = fleet.serve_config(policy="kvaware", health_interval_s=0.2, pool={"kv_protocol": "p2p"})
        async with running_epp(config) as picker:
            await eventually(lambda: _all_healthy(client, picker.url))
            envoy = Envoy(picker.stub)
            await envoy.send(request_headers(), request_body(orjson.dumps(completion(fleet.model, "hi")), True))
            (answer,) = await envoy.recv()
            assert answer.immediate_response.status.code == 503
            assert orjson.loads(answer.immediate_response.body)["error"]["code"] == "unroutable_plan"


async def _all_healthy(client: httpx.AsyncClient, url: str) -> bool:
    workers = (await client.get(f"{url}/admin/workers")).json()["workers"]
    return all(w["healthy"] is True and w["models"] for w in workers)


async def test_endpoints_are_reported_by_address() -> None:
    assert endpoint_of("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert endpoint_of("http://[fd00::5]:8000/") == "[fd00::5]:8000"
    assert endpoint_of("https://10.0.0.5") == "10.0.0.5:443"
    book = Endpoints()
    assert book.of("http://localhost:8000") == "localhost:8000"  # not resolved yet: by name
    await book.refresh(["http://localhost:8000", "http://10.0.0.5:8000"])
    assert book.of("http://localhost:8000") in {"127.0.0.1:8000", "[::1]:8000"}  # as Envoy knows the pod
    assert book.of("http://10.0.0.5:8000") == "10.0.0.5:8000"
