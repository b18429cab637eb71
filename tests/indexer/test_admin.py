"""The index admin API and page, served by a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.keys import request_keys
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.redis_index import RedisIndex
from kvroute.indexer.service import KVIndexer
from kvroute.router.index_admin import index_admin_router

from tests.conftest import free_port

from .fakevllm import Chain, frames

TOKEN = "s3cret"
PROMPT = list(range(40, 40 + 16 * 4))


async def fake_tokenize(model: str, prompt: str | None, messages: list[dict] | None) -> list[int]:
    if prompt == "boom":
        raise ValueError("no such template")
    text = prompt if prompt is not None else "".join(m.get("content", "") for m in messages or [])
    return PROMPT if text.startswith("hello") else [1] * 64


@pytest.fixture
def backend() -> IndexBackend:
    """The API is a thin layer over the indexer (whose backends have their own shared suite)."""
    return MemoryIndex()


@pytest.fixture
async def served(backend: IndexBackend) -> AsyncIterator[tuple[str, KVIndexer]]:
    indexer = KVIndexer(backend)
    indexer.register_worker("a", "m")
    indexer.register_worker("b", "m", dp_size=2)
    chain = Chain()
    await indexer.handle_message("a", frames([chain.store(PROMPT)], 0))
    await indexer.handle_message("a", frames([chain.store(PROMPT[:32], placeholder=True, medium="CPU")], 1))
    await indexer.handle_message("b", frames([Chain(seed=3).store(PROMPT[:32])], 0, dp_rank=1))
    app = FastAPI()
    app.include_router(index_admin_router(indexer, token=TOKEN, tokenize=fake_tokenize), prefix="/admin")
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    yield f"http://127.0.0.1:{port}", indexer
    server.should_exit = True
    await task


@pytest.fixture
async def client(served: tuple[str, KVIndexer]) -> AsyncIterator[httpx.AsyncClient]:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


async def test_token_required(served: tuple[str, KVIndexer]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url) as anon:
        assert (await anon.get("/admin/index/stats")).status_code == 401
        bad = await anon.get("/admin/index/stats", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        page = await anon.get("/admin/")
        assert page.status_code == 200 and "kvroute" in page.text and "index/stats" in page.text


async def test_stats_and_workers(client: httpx.AsyncClient) -> None:
    stats = (await client.get("/admin/index/stats")).json()
    assert stats["blocks"] == 6 and stats["block_sizes"] == {"m": 16}
    rows = {w["id"]: w for w in stats["workers"]}
    assert rows["a"]["by_tier"] == {"GPU": 4, "CPU": 2}
    assert rows["b#1"]["dp_rank"] == 1 and rows["b#1"]["blocks"] == 2
    assert rows["a"]["seconds_since_last_event"] is not None
    worker = (await client.get("/admin/index/workers/b")).json()
    assert worker["blocks"] == 2 and [r["id"] for r in worker["ranks"]] == ["b#1"]
    assert (await client.get("/admin/index/workers/zz")).status_code == 404


async def test_lookup_by_tokens_prompt_and_messages(client: httpx.AsyncClient) -> None:
    by_tokens = (await client.post("/admin/index/lookup", json={"model": "m", "token_ids": PROMPT})).json()
    assert by_tokens["num_blocks"] == 4 and by_tokens["block_size"] == 16
    assert by_tokens["matches"][0] == {
        "worker": "a",
        "blocks": 4,
        "tokens": 64,
        "gpu": 4,
        "cpu": 0,
        "storage": 0,
        "remote": 0,
    }
    assert by_tokens["matches"][1]["worker"] == "b#1"
    by_prompt = (await client.post("/admin/index/lookup", json={"model": "m", "prompt": "hello"})).json()
    assert by_prompt["matches"] == by_tokens["matches"]
    msgs = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    assert (await client.post("/admin/index/lookup", json=msgs)).json()["matches"] == by_tokens["matches"]
    other = await client.post("/admin/index/lookup", json={"model": "m", "prompt": "x"})
    assert other.json()["matches"] == []


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "prompt": "a", "token_ids": [1]},
        {"model": "m", "token_ids": [-1]},
        {"model": "m", "token_ids": ["x"]},
        {"model": "", "token_ids": [1]},
        {"prompt": "hello"},
    ],
)
async def test_lookup_rejects_bad_bodies(client: httpx.AsyncClient, body: dict) -> None:
    assert (await client.post("/admin/index/lookup", json=body)).status_code == 422


async def test_lookup_tokenizer_failure_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post("/admin/index/lookup", json={"model": "m", "prompt": "boom"})
    assert r.status_code == 400 and "no such template" in r.json()["detail"]
    r = await client.post("/admin/index/lookup", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


async def test_blocks_and_delete(client: httpx.AsyncClient) -> None:
    key = request_keys(PROMPT, 16, "m")[0]
    block = (await client.get(f"/admin/index/blocks/{key}", params={"model": "m"})).json()
    assert block["workers"] == {"a": {"bits": 3, "tiers": ["GPU", "CPU"]}, "b#1": {"bits": 1, "tiers": ["GPU"]}}
    same = (await client.get(f"/admin/index/blocks/0x{key:x}", params={"model": "m"})).json()
    assert same["workers"] == block["workers"]
    assert (await client.get("/admin/index/blocks/zzz", params={"model": "m"})).status_code == 400
    assert (await client.get(f"/admin/index/blocks/{1 << 64}", params={"model": "m"})).status_code == 400
    assert (await client.get(f"/admin/index/blocks/{key}")).status_code == 422
    deleted = (await client.delete("/admin/index/workers/b")).json()
    assert deleted == {"worker": "b", "purged_ranks": 1}
    block = (await client.get(f"/admin/index/blocks/{key}", params={"model": "m"})).json()
    assert list(block["workers"]) == ["a"]


async def test_openapi_documents_the_endpoints(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert {
        "/admin/index/stats",
        "/admin/index/lookup",
        "/admin/index/workers/{worker_id}",
        "/admin/index/blocks/{key}",
    } <= set(paths)


async def test_backend_down_is_503() -> None:
    backend = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.3)
    indexer = KVIndexer(backend, block_sizes={"m": 16})
    app = FastAPI()
    app.include_router(index_admin_router(indexer, token=TOKEN), prefix="/admin")
    transport = httpx.ASGITransport(app=app)
    auth = {"Authorization": f"Bearer {TOKEN}"}  # mutating admin routes need a token (router/admin_auth.py)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin", headers=auth) as c:
        r = await c.post("/admin/index/lookup", json={"model": "m", "token_ids": PROMPT})
        assert r.status_code == 503 and "unavailable" in r.json()["detail"]
        assert (await c.delete("/admin/index/workers/a")).status_code == 503
        assert (await c.get("/admin/index/stats")).json()["backend_ok"] is False
    await indexer.backend.close()
