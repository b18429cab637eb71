"""Every ``kv_transfer_params`` shape kvroute can inject is accepted by real vLLM (DESIGN.md section 6).

These servers run without a KV connector, so vLLM ignores the parameters: the point is that the
request schema takes them (200, a normal answer) and the engine keeps serving afterwards.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from .servers import VllmServer
from .workload import chat, complete, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600, func_only=True)]

PEER = {"kv_request_id": "kvr-test-1", "remote_host": "127.0.0.1", "remote_port": 5710}

#: One entry per shape the router produces (and the only legal combination of two).
INJECTED: dict[str, dict[str, Any]] = {
    "remote_decoder": {"remote_decoder": {"kv_request_id": "kvr-test-1"}},
    "remote_prefiller": {"remote_prefiller": PEER},
    "remote_kv_source": {"remote_kv_source": PEER},
    "decoder+kv_source": {
        "remote_decoder": {"kv_request_id": "kvr-test-2"},
        "remote_kv_source": {**PEER, "kv_request_id": "kvr-test-3"},
    },
    "kv_load_tiers": {
        "kv_load_tiers": [{"medium": "CPU", "locality": "LOCAL"}, {"medium": "STORAGE", "locality": "REMOTE"}]
    },
    "kv_load_tiers_empty": {"kv_load_tiers": []},
    "max_offload_tokens": {"max_offload_tokens": 0},
    "max_offload_tokens_big": {"max_offload_tokens": 4096},
    "nixl_prefill_leg": {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    },
    "nixl_decode_leg": {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": "engine-x",
        "remote_block_ids": [1, 2, 3],
        "remote_request_id": "r-1",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 96,
    },
}


@pytest.mark.parametrize("shape", list(INJECTED))
async def test_kv_transfer_params_accepted(
    shape: str, vllm_pool: list[VllmServer], http: httpx.AsyncClient, rng: random.Random
) -> None:
    params = INJECTED[shape]
    server = vllm_pool[list(INJECTED).index(shape) % 2]
    answer = await complete(http, server.url, prompt_words(rng, 40), max_tokens=2, kv_transfer_params=params)
    assert answer.prompt_tokens > 0 and answer.body["choices"][0]["finish_reason"] in ("length", "stop")
    # Without a connector vLLM does not echo parameters back (kvroute must cope with null here).
    assert answer.body.get("kv_transfer_params") is None
    answer = await chat(
        http, server.url, [{"role": "user", "content": prompt_words(rng, 20)}], max_tokens=2, kv_transfer_params=params
    )
    assert answer.prompt_tokens > 0


async def test_prefill_leg_shape_is_served(worker_a: VllmServer, http: httpx.AsyncClient, rng: random.Random) -> None:
    """The NIXL prefill leg's rewritten body (stream false, max_tokens 1, no stream_options) works."""
    body = {
        "model": "tiny",
        "prompt": prompt_words(rng, 40),
        "stream": False,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": INJECTED["nixl_prefill_leg"],
    }
    resp = await http.post(f"{worker_a.url}/v1/completions", json=body, headers={"X-Request-Id": "kvr-leg-1"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 1
