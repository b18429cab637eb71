"""The fleet API, the `kvroute sim` command, seeded traces and the replayer."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvroute.apps.sim import add_parser
from kvroute.config import RouterConfig
from kvroute.sim.replay import percentile, replay
from kvroute.sim.traces import agentic_trace, chat_trace, make_trace, mixed_trace


async def test_serve_config_is_a_valid_router_config(make_fleet: Any) -> None:
    fleet = await make_fleet(3, roles=["prefill", "decode"])
    config = RouterConfig.model_validate(fleet.serve_config(policy="round_robin"))
    assert [w.role for w in config.workers] == ["prefill", "decode", "prefill"]
    assert all(w.kv_events and w.replay and w.p2p_port for w in config.workers)
    assert config.models[0].bytes_per_token == fleet.preset.bytes_per_token
    assert len({w.worker_id for w in config.workers}) == 3
    # Each worker answers on its URL; the fleet shares one hash seed (P2P peers must agree).
    assert len({w.engine.cache.seed for w in fleet.workers}) == 1


def test_cli_parser_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["sim", "--workers", "2", "--roles", "prefill,nope"])
    assert args.func(args) == 2
    assert "unknown role" in capsys.readouterr().err
    args = parser.parse_args(["sim", "--workers", "0"])
    assert args.func(args) == 2


def test_kvroute_sim_process_prints_config_and_serves(tmp_path: Path) -> None:
    out = tmp_path / "sim.yaml"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute.apps.cli",
            "sim",
            "--workers",
            "2",
            "--preset",
            "tiny",
            "--base-port",
            "0",
            "--config-out",
            str(out),
            "--time-scale",
            "0.01",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        config = yaml.safe_load(out.read_text())
        assert len(config["workers"]) == 2
        url = config["workers"][1]["url"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello there", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        stdout, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert b"kvroute serve --config" in stdout


def test_traces_are_seeded_and_shaped() -> None:
    a = agentic_trace(3, sessions=4, steps=(5, 6))
    assert a == agentic_trace(3, sessions=4, steps=(5, 6))
    assert a != agentic_trace(4, sessions=4, steps=(5, 6))
    assert len({s.system for s in a.sessions}) == 1  # one shared system prompt
    assert all(5 <= len(s.steps) <= 6 for s in a.sessions)
    starts = [s.start_s for s in a.sessions]
    assert starts == sorted(starts) and starts[-1] > 0
    long = agentic_trace(0, sessions=1, steps=(30, 30))
    history = sum(len(step.content.split()) + step.max_tokens for step in long.sessions[0].steps)
    assert history > 10_000  # agent histories grow to tens of thousands of tokens
    c = chat_trace(1, sessions=10)
    assert len({s.system for s in c.sessions}) == 10  # little sharing
    m = mixed_trace(2, agentic_sessions=2, chat_sessions=3)
    assert {s.kind for s in m.sessions} == {"agentic", "chat"} and len(m.sessions) == 5
    assert make_trace("chat", 1, sessions=10) == c
    with pytest.raises(ValueError, match="unknown trace kind"):
        make_trace("nope")


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


async def test_replay_measures_ttft_latency_and_cached_tokens(make_fleet: Any) -> None:
    fleet = await make_fleet(1, "llama-8b-h100", preset_overrides={"gpu_blocks": 4096}, time_scale=0.01)
    trace = agentic_trace(
        5,
        sessions=3,
        steps=(3, 4),
        system_tokens=300,
        tool_tokens=(50, 200),
        answer_tokens=(5, 10),
        arrival_rate=50.0,
        tool_time_s=(0.0, 0.1),
    )
    seen: list[Any] = []
    report = await replay(trace, fleet[0].url, time_scale=0.01, on_result=seen.append)
    assert len(report.results) == trace.n_requests == len(seen)
    assert all(r.ok and r.ttft_s is not None and r.e2e_s is not None for r in report.results)
    assert all(r.e2e_s >= r.ttft_s for r in report.results)  # type: ignore[operator]
    later = [r for r in report.results if r.turn > 0]
    assert all(r.cached_tokens > 0 for r in later)  # each step re-reads its own history
    summary = report.summary()
    assert summary["errors"] == 0 and 0 < summary["cached_token_ratio"] < 1
    assert summary["ttft_p99_s"] >= summary["ttft_p50_s"] > 0


async def test_replay_records_errors_without_crashing(make_fleet: Any) -> None:
    fleet = await make_fleet(1)
    trace = chat_trace(0, sessions=2, turns=(2, 2), arrival_rate=0)
    report = await replay(trace, fleet[0].url, model="wrong-model", time_scale=0.0)
    assert len(report.results) == 2 and all(r.status == 404 and not r.ok for r in report.results)
    assert report.summary()["errors"] == 2


async def test_fleet_stats_and_reset(make_fleet: Any) -> None:
    fleet = await make_fleet(2)
    async with httpx.AsyncClient(timeout=10) as c:
        for _ in range(2):
            r = await c.post(
                f"{fleet.urls[0]}/v1/completions", json={"prompt": " ".join("abcdefghij" * 4), "max_tokens": 1}
            )
            assert r.status_code == 200
    stats = fleet.stats()
    assert stats[0]["requests"] == 2 and stats[0]["prefix_cache_queries"] == 80
    assert stats[0]["prefix_cache_hits"] == 32 and stats[1]["requests"] == 0
    assert fleet.reset()
    assert len(fleet[0].engine.cache.gpu) == 0


def test_hf_tokenizer_with_chat_template(tmp_path: Path) -> None:
    import json

    from kvroute.sim.tokenizer import load_tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %} {{ m.role }} {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %} assistant{% endif %}"
    )
    config = {"chat_template": template, "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = load_tokenizer(str(tmp_path))
    assert hf.encode("hello world") == [2, 3]
    ids = hf.encode_chat([{"role": "user", "content": "hello"}])
    assert ids == [1, 4, 2, 5]
