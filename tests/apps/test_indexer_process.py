"""``kvroute indexer`` as a real process: a publisher's events end up in Redis, readable by a router."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
import zmq.asyncio
from kvroute.indexer.keys import request_keys
from kvroute.indexer.redis_index import RedisIndex

from tests.conftest import free_port
from tests.indexer.fakevllm import Chain, Publisher, eventually

PROMPT = list(range(7, 7 + 16 * 6))


def start(args: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("KVROUTE_")}
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute.apps.cli", "indexer", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def test_standalone_indexer_writes_redis(tmp_path: Path, redis_url: str, zctx: zmq.asyncio.Context) -> None:
    connecting_port = free_port()
    pub = Publisher(zctx)
    config = {
        "workers": [
            {
                "url": "http://127.0.0.1:8101",
                "id": "w1",
                "models": ["m"],
                "kv_events": pub.endpoint,
                "replay": pub.replay_endpoint,
            },
            {"url": "http://127.0.0.1:8102", "id": "w2", "models": ["m"], "kv_events_topic": "w2"},
        ],
        "index": {
            "backend": "redis",
            "redis_url": redis_url,
            "redis_prefix": "cli",
            "events_bind": f"tcp://127.0.0.1:{connecting_port}",
        },
        "admin_token": "tok",
    }
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = start(["--config", str(path), "--port", str(port)])
    reader = RedisIndex(redis_url, prefix="cli")
    pub2 = Publisher(zctx, topic="w2", connect=f"tcp://127.0.0.1:{connecting_port}")
    try:
        await asyncio.wait_for(pub.wait_subscribed(), 30)
        await asyncio.wait_for(pub2.wait_subscribed(), 30)
        await pub.publish([Chain().store(PROMPT)])
        await pub2.publish([Chain(seed=2).store(PROMPT[:32])])
        keys = request_keys(PROMPT, 16, "m")

        async def both_indexed() -> bool:
            found = await reader.lookup("m", keys)
            return {w: m.blocks for w, m in found.items()} == {"w1": 6, "w2": 2}

        await eventually(both_indexed, timeout=20)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            await eventually(lambda: _answers(client), timeout=20)
            stats = (await client.get("/admin/index/stats", headers={"Authorization": "Bearer tok"})).json()
            assert {w["id"]: w["blocks"] for w in stats["workers"]} == {"w1": 6, "w2": 2}
            assert (await client.get("/admin/index/stats")).status_code == 401
            metrics = (await client.get("/metrics")).text
            assert "kvroute_index_events_applied_total" in metrics
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await reader.close()
        await pub.close()
        await pub2.close()


async def _answers(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/health")).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"workers": []}, "no workers configured"),
        ({"workers": [{"url": "ftp://x"}]}, "invalid configuration"),
    ],
)
def test_bad_configuration_exits_2(tmp_path: Path, config: dict, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = start(["--config", str(path)])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert message in out.decode()


def test_build_from_config_reader_and_writer() -> None:
    from kvroute.apps.indexer import build_from_config
    from kvroute.config import RouterConfig
    from kvroute.indexer.memory import MemoryIndex

    config = RouterConfig.model_validate(
        {
            "workers": [
                {
                    "url": "http://127.0.0.1:8101",
                    "id": "a",
                    "models": ["m"],
                    "kv_events": "tcp://127.0.0.1:5557",
                    "dp_size": 2,
                },
                {"url": "http://127.0.0.1:8102", "id": "b", "models": ["m"]},  # no endpoint, no bind: skipped
                # No model configured: subscribed once its /v1/models answers.
                {"url": "http://127.0.0.1:8103", "id": "c", "kv_events": "tcp://127.0.0.1:5560"},
            ],
            "models": [{"name": "m", "block_size": 32}],
            "index": {"subscribe": False},
        }
    )
    reader, none = build_from_config(config, backend=MemoryIndex())
    assert none is None and reader.workers() == [] and reader.block_size("m") == 32
    writer, sub = build_from_config(config, backend=MemoryIndex(), subscribe=True)
    assert sub is not None and writer.workers() == ["a"]


async def test_workers_without_models_are_discovered() -> None:
    import uvicorn
    from fastapi import FastAPI
    from kvroute.apps.indexer import add_discovered_workers, build_from_config
    from kvroute.config import RouterConfig
    from kvroute.indexer.memory import MemoryIndex

    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "served-model", "object": "model"}]}

    port = free_port()
    config_ = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config_)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        config = RouterConfig.model_validate(
            {"workers": [{"url": f"http://127.0.0.1:{port}", "id": "c", "kv_events": "tcp://127.0.0.1:1"}]}
        )
        indexer, sub = build_from_config(config, backend=MemoryIndex(), subscribe=True)
        assert sub is not None and indexer.workers() == []
        await asyncio.wait_for(add_discovered_workers(config, sub), 20)
        assert indexer.workers() == ["c"]
        assert (await indexer.stats())["workers"][0]["model"] == "served-model"
    finally:
        server.should_exit = True
        await task
