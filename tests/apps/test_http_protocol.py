"""Slow clients cannot take the router down: headers sent a byte at a time (slowloris) are cut after
``header_timeout_s``, connections beyond ``max_connections`` are refused at once, a trickled body is
answered 408 — against a real ``kvroute serve`` process and its own HTTP protocol."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import yaml

from tests.apps.test_serve_cli import KVROUTE
from tests.http.upstream import FakeWorker, free_port, serve_worker
from tests.polling import eventually


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(65536), 0.01) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_slowloris_is_cut_and_normal_clients_are_served(tmp_path: Path) -> None:
    worker = FakeWorker("w")
    port = free_port()
    config = tmp_path / "kvroute.yaml"
    async with serve_worker(worker):
        config.write_text(
            yaml.safe_dump(
                {
                    "workers": [{"url": worker.url}],
                    "policy": "round_robin",
                    "header_timeout_s": 1.0,
                    "body_timeout_s": 1.0,
                    "max_connections": 100,
                }
            )
        )
        proc = await asyncio.create_subprocess_exec(
            *KVROUTE,
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            "--log-level",
            "warning",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:

                async def ready() -> bool:
                    try:
                        return (await client.get(base + "/ready")).status_code == 200
                    except httpx.TransportError:
                        return False

                await eventually(ready, timeout=30, what="router ready")
                for _ in range(150):  # more than max_connections, each stuck in its headers
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nX-Slow: ")
                    await writer.drain()
                    slow.append((reader, writer))

                async def all_cut() -> bool:
                    return all([await closed_by_server(r) for r, _ in slow])

                await eventually(all_cut, timeout=20, what="every slow connection cut by the router")
                r = await client.post(base + "/v1/completions", json={"model": "m1", "prompt": "x"})
                assert r.status_code == 200 and r.json()["worker"] == "w"
                # A body trickled slower than body_timeout_s: 408, the connection freed.
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{"
                )
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(65536), 15)
                assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
                writer.close()
        finally:
            for _, w in slow:
                w.close()
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 15)
