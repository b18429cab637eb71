"""Config reload without a restart: SIGHUP and a changed file, against a real ``kvroute serve`` process."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import yaml

from tests.apps.test_serve_cli import KVROUTE
from tests.http.upstream import FakeWorker, free_port, serve_worker


def write(path: Path, workers: list[str], **extra: object) -> None:
    path.write_text(yaml.safe_dump({"workers": [{"url": u} for u in workers], "policy": "round_robin", **extra}))


async def wait_for(check, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_sighup_and_file_change_reload_workers_policy_and_refuse_bad_config(tmp_path: Path) -> None:
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    config = tmp_path / "kvroute.yaml"
    port = free_port()
    async with serve_worker(w1), serve_worker(w2):
        write(config, [w1.url], admin_token="old")
        proc = await asyncio.create_subprocess_exec(
            *KVROUTE,
            "serve",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "info",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=5, trust_env=False) as client:

                async def ready() -> bool:
                    try:
                        return (await client.get(base + "/ready")).status_code == 200
                    except httpx.TransportError:
                        return False

                await wait_for(ready)

                async def workers(token: str) -> set[str]:
                    r = await client.get(base + "/admin/workers", headers={"Authorization": f"Bearer {token}"})
                    return {w["url"] for w in r.json()["workers"]} if r.status_code == 200 else set()

                assert await workers("old") == {w1.url}
                # An in-flight stream keeps going across the reload.
                slow = asyncio.create_task(
                    client.post(base + "/v1/completions", json={"model": "m1", "prompt": "x", "max_tokens": 3})
                )
                # SIGHUP: a second worker, a new token.
                write(config, [w1.url, w2.url], admin_token="new")
                proc.send_signal(signal.SIGHUP)

                async def two_workers() -> bool:
                    return await workers("new") == {w1.url, w2.url}

                await wait_for(two_workers)
                assert (await slow).status_code == 200
                # An invalid file is refused (the field is named in the log) and the running config kept.
                config.write_text(yaml.safe_dump({"workers": [{"url": "ftp://nope"}], "policy": "round_robin"}))
                proc.send_signal(signal.SIGHUP)
                await asyncio.sleep(0.5)
                assert await workers("new") == {w1.url, w2.url}
                metrics = (await client.get(base + "/metrics")).text
                assert 'kvroute_config_reloads_total{outcome="invalid"} 1.0' in metrics
                # The file changing on disk is enough (no signal): back to one worker, another policy.
                await asyncio.sleep(1.1)  # a later modification time than the invalid write
                write(config, [w2.url], admin_token="new", policy_options={})
                config.write_text(config.read_text().replace("round_robin", "least_load"))

                async def only_w2() -> bool:
                    return await workers("new") == {w2.url}

                await wait_for(only_w2)
                r = await client.post(base + "/v1/completions", json={"model": "m1", "prompt": "y"})
                assert r.status_code == 200 and r.json()["worker"] == "w2"
                metrics = (await client.get(base + "/metrics")).text
                assert 'kvroute_routing_decision_seconds_count{policy="least_load"}' in metrics
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 15)
        log = (await proc.stderr.read()).decode()
        assert "workers.0.url" in log and "config reload (SIGHUP) refused" in log
