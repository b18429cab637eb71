"""bench/soak.py: its load keeps conversations honest, its arithmetic holds, and a few seconds of it run
end to end (a real simulated fleet and router) with every series sampled and no error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import soak  # noqa: E402
import soak_load  # noqa: E402


def test_conversations_grow_end_and_never_overlap() -> None:
    work = soak_load.Workload(3, soak_load.Mix(turns=(2, 4), max_idle=5))
    in_flight: dict[str, soak_load.Conversation] = {}
    lengths: dict[str, int] = {}
    surfaces = set()
    for i in range(400):
        conv = work.next()
        assert conv.id not in in_flight  # one turn of a conversation at a time
        assert conv.messages[-1]["role"] == "user"
        assert len(conv.messages) > lengths.get(conv.id, 0)  # a later turn extends the earlier one
        lengths[conv.id] = len(conv.messages)
        surfaces.add(conv.surface)
        body = work.body(conv, "m")
        assert ("messages" in body) == (conv.api == "chat") and ("prompt" in body) == (conv.api == "completions")
        assert body.get("stream", False) == conv.stream
        in_flight[conv.id] = conv
        if i % 3 == 0:  # answers come back later and out of order; some requests fail
            for cid in list(in_flight)[-2:]:
                work.finish(in_flight.pop(cid), None if i % 9 == 0 else "an answer")
    assert surfaces == {"chat-stream", "chat", "completions-stream", "completions"}
    assert work.started > 50 and work.ended > 0 and len(work.idle) <= 5
    assert max(lengths.values()) >= 1 + 2 * 2  # system, then user + assistant per finished turn


def test_slope_window_stats_and_verdict() -> None:
    assert soak.slope_per_min([(0, 100.0), (60, 102.0), (120, 104.0)]) == pytest.approx(2.0)
    assert soak.slope_per_min([(0, 5.0)]) == 0.0
    ok = soak_load.Outcome("chat", 0.0, 1.0, ttft_s=0.010, e2e_s=0.020)
    bad = soak_load.Outcome("chat-stream", 0.0, 1.0, error="HTTP 502: x")
    stats = soak.window_stats([ok, ok, bad])
    assert stats["done"] == 3 and stats["errors"] == 1 and stats["ttft_p99_ms"] == 10.0
    assert stats["error_samples"] == ["chat-stream: HTTP 502: x"] and stats["error_kinds"] == {"HTTP 502": 1}
    base = {"done": 10, "sent": 10, "errors": 0, "fds": 50.0, "threads": 7.0, "hwm_mb": 90.0, "in_flight": 3}
    samples = [{**base, "t_s": t, "rss_mb": 80.0 + (t >= 30) * 0.5} for t in (0, 10, 20, 30, 40, 50, 60)]
    samples[-1] |= {"errors": 2, "error_kinds": {"HTTP 504": 2}, "in_flight_peak": 40}
    result = soak.verdict(samples, 60.0, 10.0, 1.0)
    assert result["errors"] == 2 and result["memory_flat"] and result["fds_growth_second_half"] == 0
    assert result["error_kinds"] == {"HTTP 504": 2} and result["errors_while_backlogged"] == 2
    assert result["backlogged_windows"] == 1
    growing = [{**s, "rss_mb": 80.0 + s["t_s"]} for s in samples]
    assert not soak.verdict(growing, 60.0, 10.0, 1.0)["memory_flat"]
    assert "GROWING" in soak.summary(soak.verdict(growing, 60.0, 10.0, 1.0))
    assert "HTTP 504 x2" in soak.summary(result)


def test_proc_status_reads_this_process() -> None:
    figures = soak.proc_status(os.getpid())
    assert figures["rss_mb"] > 10 and figures["fds"] >= 3 and figures["threads"] >= 1


@pytest.mark.slow
def test_a_short_soak_samples_every_series_without_errors(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--duration",
            "6",
            "--window",
            "2",
            "--rate",
            "15",
            "--workers",
            "2",
            "--max-blocks",
            "200",
            "--gpu-blocks",
            "256",
            "--cpu-blocks",
            "256",
            "--settle",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict: RSS slope" in done.stdout
    report = json.loads((tmp_path / "soak.json").read_text())
    samples = report["samples"]
    assert len(samples) >= 4 and samples[0]["sent"] == 0  # the idle baseline, then one per window
    for s in samples:
        assert s["rss_mb"] > 10 and s["fds"] > 0 and s["threads"] >= 1
    assert all(s["error_samples"] == [] and s["error_kinds"] == {} for s in samples)
    result = report["verdict"]
    assert result["errors"] == 0 and result["requests"] == samples[-1]["sent"] > 30
    assert any(s["ttft_p99_ms"] for s in samples) and report["broke"] is None
    assert samples[-1]["settled"] and result["fds_settled"] == samples[-1]["fds"] > 0
    assert result["index_blocks_end"] > 0 and result["index_evicted_total"] > 0  # the bound was reached
    surfaces = report["conversations"]
    assert surfaces["started"] > 0
    assert (tmp_path / "soak.png").stat().st_size > 10_000
