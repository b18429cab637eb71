"""bench/peers_overhead.py runs end to end, and its load and arithmetic say what the report claims.

The smoke test runs ``--quick`` with kvroute's own routers and direct only (no peer is installed in
tests) in front of a real simulated fleet; it checks the harness and that every request succeeded, not
any timing.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import peers_overhead  # noqa: E402


def test_growing_bodies_extend_the_previous_prompt_and_depend_on_the_key_alone() -> None:
    bodies = peers_overhead.growing_bodies("m", "k1", prefix_tokens=500, steps=3, step_tokens=40, answer=5)
    decoded = [orjson.loads(b) for b in bodies]
    assert len(decoded) == 4  # the cold warm-up + 3 timed steps
    system = decoded[0]["messages"][0]
    assert system["role"] == "system" and len(system["content"].split()) == 500
    for before, after in itertools.pairwise(decoded):
        n = len(before["messages"])
        assert after["messages"][:n] == before["messages"]  # the whole previous prompt, then more
        assert [m["role"] for m in after["messages"][n:]] == ["assistant", "user"]
        assert len(after["messages"][-1]["content"].split()) == 40
    assert all(d["stream"] and d["stream_options"] == {"include_usage": True} for d in decoded)
    again = peers_overhead.growing_bodies("m", "k1", prefix_tokens=500, steps=3, step_tokens=40, answer=5)
    assert again == bodies
    other = peers_overhead.growing_bodies("m", "k2", prefix_tokens=500, steps=3, step_tokens=40, answer=5)
    assert orjson.loads(other[0])["messages"][0] != system


def test_a_cached_case_sends_one_prompt_again_and_again() -> None:
    bodies = peers_overhead.repeated_bodies("m", "k1", tokens=300, steps=4, answer=5)
    assert len(bodies) == 5 and len(set(bodies)) == 1
    body = orjson.loads(bodies[0])
    words = sum(len(m["content"].split()) for m in body["messages"])
    assert words == 300 and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert peers_overhead.repeated_bodies("m", "k2", tokens=300, steps=4, answer=5)[0] != bodies[0]


def test_a_fresh_case_shares_nothing_between_its_prompts() -> None:
    bodies = [orjson.loads(b) for b in peers_overhead.fresh_bodies("m", "k1", tokens=300, steps=4, answer=5)]
    texts = [b["messages"][0]["content"] for b in bodies]
    assert len(bodies) == 5 and all(len(t.split()) == 300 for t in texts)
    assert len({tuple(t.split()[:8]) for t in texts}) == 5  # not even their first block in common
    assert all(b["stream"] is True and b["max_tokens"] == 5 for b in bodies)


def _run(rnd: int, target: str, scenario: str, p50: float, rps: float) -> dict[str, object]:
    row: dict[str, object] = {"round": rnd, "target": target, "scenario": scenario, "p50_ms": p50}
    return row | {"p99_ms": 2 * p50, "rps": rps, "requests": 10, "errors": 0}


def test_added_latency_is_against_the_same_round_and_targets_are_judged_from_medians() -> None:
    scens = [peers_overhead.Scenario("small c32", "small", 32), peers_overhead.Scenario("grow 8k", "grow", 1, 8192)]
    runs = []
    for rnd, drift in enumerate((0.0, 5.0, 10.0)):  # the machine slows down round by round
        runs += [_run(rnd, "direct", "small c32", 1.0 + drift, 1000)]
        runs += [_run(rnd, "kvaware", "small c32", 2.0 + drift, 850)]
        runs += [_run(rnd, "smg:cache_aware", "small c32", 1.5 + drift, 1000)]
        runs += [_run(rnd, "vllm-router:cache_aware", "small c32", 1.2 + drift, 1200)]
        runs += [_run(rnd, "direct", "grow 8k", 3.0 + drift, 1), _run(rnd, "kvaware", "grow 8k", 3.5 + drift, 1)]
        runs += [_run(rnd, "smg:cache_aware", "grow 8k", 4.0 + drift, 1)]
    runs.append({"round": 3, "target": "kvaware", "failed": "did not start"})
    names = ["direct", "kvaware", "smg:cache_aware", "vllm-router:cache_aware"]
    cells = {(c["scenario"], c["target"]): c for c in peers_overhead.cells_of(runs, names, scens)}
    kv = cells[("small c32", "kvaware")]
    assert kv["rounds"] == 3 and kv["added_p50_ms"] == pytest.approx(1.0)  # drift cancels out
    assert kv["added_p50_ms_range"] == pytest.approx([1.0, 1.0])
    assert kv["p50_x_direct"] == pytest.approx(7.0 / 6.0)
    assert kv["best_peer_added"] == "vllm-router:cache_aware" and kv["added_p50_vs_best_peer"] == pytest.approx(5.0)
    assert kv["best_peer_rps"] == "vllm-router:cache_aware" and kv["rps_vs_best_peer"] == pytest.approx(850 / 1200)
    assert "added_p50_vs_best_peer" not in cells[("small c32", "direct")]
    found = {(v["scenario"], v["target"]): v for v in peers_overhead.verdicts(list(cells.values()))}
    assert found[("grow 8k", "added p50 <= smg cache_aware's")]["met"]  # +0.5 vs +1.0 ms
    assert found[("grow 8k", "added p50 <= smg cache_aware's")]["margin"] == pytest.approx(-0.5)
    assert not found[("small c32", "added p50 <= vllm-router's")]["met"]  # +1.0 vs +0.2 ms
    rps = found[("small c32", "req/s >= 0.9 x smg's")]
    assert not rps["met"] and rps["ratio"] == pytest.approx(0.85)
    lines = peers_overhead.verdict_lines(list(found.values()))
    assert [line.endswith(": met") for line in lines] == [v["met"] for v in found.values()]
    assert sum(line.endswith("NOT met") for line in lines) == 2


def test_profile_frames_leave_the_event_loop_out_and_keep_kvroute_s_own_code() -> None:
    raw = "\n".join(
        [
            "<module> (kvroute/apps/cli.py:1);Runner.run (asyncio/runners.py:86) 60",
            "<module> (kvroute/apps/cli.py:1);RequestFlow.handle (router/flow.py:131);tokenize (sim/tok.py:44) 30",
            "<module> (kvroute/apps/cli.py:1);RequestFlow.handle (router/flow.py:131);send (uvicorn/h.py:4) 10",
            "garbage line",
        ]
    )
    total, busy, top, ours = peers_overhead.top_frames(raw)
    assert (total, busy) == (100, 40)
    assert top[0] == ("tokenize (sim/tok.py:44)", 30, 30)
    assert ("RequestFlow.handle (router/flow.py:131)", 40) in ours
    assert all("uvicorn" not in frame and "asyncio" not in frame for frame, _ in ours)


def test_quick_run_with_kvroute_and_direct_answers_every_request(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peers_overhead.py"),
            "--quick",
            "--routers",
            "kvaware,round_robin",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(tmp_path.glob("venv-*"))  # no peer was installed
    data = json.loads((tmp_path / "peers_overhead.json").read_text())
    assert data["peers"] == {} and data["targets"] == []
    assert not any("failed" in r for r in data["runs"])
    targets = ("direct", "kvaware", "round_robin")
    scenarios = ("small c1", "small c32", "grow 1k", "grow 4k", "cached 1k", "fresh 1k")
    cells = {(c["scenario"], c["target"]): c for c in data["cells"]}
    assert set(cells) == {(s, t) for s in scenarios for t in targets}
    for (scenario, name), cell in cells.items():
        assert cell["errors"] == 0 and cell["rounds"] == 1
        assert cell["requests"] == (100 if scenario.startswith("small") else 3)
        assert cell["p50_ms"] > 0 and cell["rps"] > 0
        if name != "direct":
            assert "added_p50_ms" in cell and "rps_x_direct" in cell
    # The growing prompts really carried their prefix, and grew step by step.
    grow = [r for r in data["runs"] if r["scenario"] == "grow 4k"]
    assert all(4096 < r["prompt_tokens_first"] < r["prompt_tokens_last"] for r in grow)
    text = (tmp_path / "peers_overhead.md").read_text()
    assert "| grow 4k | kvaware |" in text and "| small c32 | direct |" in text
    assert (tmp_path / "peers_overhead.png").stat().st_size > 10_000
    progress = [line.split() for line in done.stdout.splitlines() if line.startswith("[") and "round 1/1" in line]
    assert len(progress) == len(cells)  # one progress line per cell
