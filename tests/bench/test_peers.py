"""bench/peers.py runs end to end, and its workloads keep the structure of the traces they replay.

The smoke test uses kvroute's own routers only (no peer is installed in tests) on the tiniest
settings; it checks the harness, not any timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import paired  # noqa: E402
import peers  # noqa: E402
import workloads  # noqa: E402


def _lcp(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- Mooncake ---------------------------------------------------------------------------------------------------


def test_equal_hash_ids_give_equal_text_and_different_ids_differ() -> None:
    scale = 1 / 32  # 16 words per block
    a = workloads.mooncake_prompt([7, 8, 9], 3 * 512, scale).split()
    b = workloads.mooncake_prompt([7, 8, 10], 3 * 512, scale).split()
    assert len(a) == len(b) == 48
    assert a[:32] == b[:32]  # blocks 7 and 8: the same words in both
    assert _lcp(a, b) < 48
    assert workloads.mooncake_prompt([7, 8, 9], 3 * 512, scale).split() == a  # deterministic
    # The partial last block is a prefix of the full block of the same id.
    partial = workloads.mooncake_prompt([7, 8, 9], 2 * 512 + 100, scale).split()
    assert len(partial) == 32 + round(100 * scale) and a[: len(partial)] == partial


def test_mooncake_trace_keeps_prefix_sharing_and_times(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 3 * 512, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 2 * 512 + 50, "output_length": 20, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 512, "output_length": 5, "hash_ids": [4]},
        {"timestamp": 4000, "input_length": 4 * 512, "output_length": 7, "hash_ids": [0, 1, 2, 5]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scale = 1 / 32
    trace = workloads.mooncake_trace(0, requests=0, speedup=2.0, scale=scale, sample="window", path=path)
    texts = [s.steps[0].content.split() for s in trace.sessions]
    assert [len(t) for t in texts] == [48, 34, 16, 64]
    assert _lcp(texts[0], texts[1]) >= 32 and texts[0][:32] == texts[1][:32]
    assert texts[3][:48] == texts[0]  # shares all three blocks of the first request
    assert _lcp(texts[0], texts[2]) < 16
    assert [s.start_s for s in trace.sessions] == [0.0, 0.5, 1.5, 2.0]  # ms -> s, over the speed-up
    assert [s.steps[0].max_tokens for s in trace.sessions] == [1, 1, 1, 1]  # outputs scale too (minimum 1)
    # Family sampling keeps whole families: every request whose first block is 0 comes together.
    fam = workloads.mooncake_trace(3, requests=1, scale=scale, path=path)
    firsts = {s.steps[0].content.split()[0] for s in fam.sessions}
    assert len(firsts) == 1 and len(fam.sessions) in (1, 3)


def test_public_mooncake_trace_prefixes_become_shared_text() -> None:
    if not workloads.MOONCAKE_PATH.exists():
        pytest.skip("public trace not present")
    scale = 1 / 64  # 8 words per 512-token block
    rows = [r for r in workloads.mooncake_rows()[:400] if len(r.hash_ids) >= 2]
    pairs = 0
    for i, a in enumerate(rows):
        for b in rows[i + 1 : i + 40]:
            k = _lcp(list(map(str, a.hash_ids)), list(map(str, b.hash_ids)))
            if k == 0 or k == min(len(a.hash_ids), len(b.hash_ids)):
                continue
            ta = workloads.mooncake_prompt(a.hash_ids, len(a.hash_ids) * 512, scale).split()
            tb = workloads.mooncake_prompt(b.hash_ids, len(b.hash_ids) * 512, scale).split()
            assert k * 8 <= _lcp(ta, tb) < (k + 1) * 8
            pairs += 1
    assert pairs > 0
    # Sampling whole families keeps the reuse that 200 consecutive requests lose (2-6 % of blocks).
    trace = workloads.mooncake_trace(0, requests=200, scale=scale)
    blocks, _ = workloads.working_set(trace)
    assert blocks * 16 < 0.7 * workloads.prompt_tokens(trace)


# -- shared prefix, agentic, chat ----------------------------------------------------------------------------------


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    trace = workloads.shared_prefix_trace(0, requests=40, groups=4, prompts_per_group=5, scale=1 / 20, rate=8.0)
    assert len(trace.sessions) == 40
    systems = sorted({s.system for s in trace.sessions})
    assert len(systems) == 4
    assert all(len(s.split()) == 300 for s in systems)
    for a in trace.sessions:
        for b in trace.sessions:
            if a is b:
                continue
            pa = a.system.split() + a.steps[0].content.split()
            pb = b.system.split() + b.steps[0].content.split()
            if a.system == b.system:
                if a.steps[0].content != b.steps[0].content:
                    assert _lcp(pa, pb) == 300  # the system prompt, not a word more
            else:
                assert _lcp(pa, pb) < 5
    assert all(len(s.steps[0].content.split()) == 60 and s.steps[0].max_tokens == 50 for s in trace.sessions)
    starts = [s.start_s for s in trace.sessions]
    assert starts == sorted(starts) and 2.0 < starts[-1] < 10.0  # Poisson at 8/s: about 5 s


def test_agentic_sessions_share_agent_prompts_and_grow() -> None:
    trace = workloads.agentic_trace(0, sessions=12, agents=3, scale=0.1)
    assert 1 < len({s.system for s in trace.sessions}) <= 3
    assert all(4 <= len(s.steps) <= 12 for s in trace.sessions)
    assert all(step.delay_s > 0 for s in trace.sessions for step in s.steps[1:])
    assert workloads.agentic_trace(0, sessions=12, agents=3, scale=0.1) == trace  # seeded


def test_chat_and_sizing_helpers() -> None:
    trace = workloads.chat_trace(0, sessions=10, scale=0.5)
    assert all(1 <= len(s.steps) <= 4 for s in trace.sessions)
    faster = workloads.with_rate(trace, 2.0)
    assert [s.start_s for s in faster.sessions] == [s.start_s / 2 for s in trace.sessions]
    blocks, largest = workloads.working_set(trace)
    assert blocks > 0 and largest > 0
    # A session replayed twice computes nothing new; two sessions behind one system prompt share its blocks.
    one = workloads.Trace("one", 0, trace.sessions[:1])
    assert workloads.working_set(workloads.Trace("x", 0, trace.sessions[:1] * 2)) == workloads.working_set(one)
    sp = workloads.shared_prefix_trace(0, requests=2, groups=1, prompts_per_group=2, scale=0.1)
    alone = [workloads.working_set(workloads.Trace("a", 0, (s,)))[0] for s in sp.sessions]
    assert workloads.working_set(sp)[0] == sum(alone) - 600 // 16  # the 600-token system prompt, once
    assert workloads.prompt_tokens(trace) > 0


def test_a_kvroute_router_takes_policy_options_by_name() -> None:
    plain = peers.router_of("kvaware")
    assert plain.options == () and plain.tag == "kvaware"
    variant = peers.router_of("kvaware[decode_stall_weight=0; affinity_by_load=false]")
    assert (variant.kind, variant.policy) == ("kvroute", "kvaware")
    assert dict(variant.options) == {"decode_stall_weight": 0, "affinity_by_load": False}
    assert variant.tag == "kvaware-decode_stall_weight=0-affinity_by_load=false"
    assert peers.router_of("smg:cache_aware").tag == "smg-cache_aware"
    for bad in ("smg:cache_aware[x=1]", "kvaware[decode_stall_weight]", "kvaware[x=1", "nope"):
        with pytest.raises(SystemExit):
            peers.router_of(bad)
    # --baseline's router: kvaware, named apart (its interpreter is set by the run, not by the name).
    baseline = peers.router_of(peers.BASELINE)
    assert (baseline.kind, baseline.policy, baseline.tag) == ("kvroute", "kvaware", "kvaware-baseline")
    args = peers.parse_args(["--routers", "kvaware", "--baseline", sys.executable])
    assert args.routers == ["kvaware", peers.BASELINE]
    with pytest.raises(SystemExit):
        peers.parse_args(["--baseline", "/no/such/python"])


# -- the harness end to end -------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def _run_peers(
    work: Path, traces: str, regimes: str, *extra: str, routers: str = "kvaware,round_robin"
) -> dict[tuple[str, str, str], Any]:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "peers.py"),
            "--routers",
            routers,
            "--seeds",
            "0",
            "--requests",
            "6",
            "--workers",
            "2",
            "--time-scale",
            "0.25",
            "--scale",
            "0.5",
            "--traces",
            traces,
            "--regimes",
            regimes,
            "--work",
            str(work),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=880,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((work / "peers.json").read_text())
    assert not any("failed" in r for r in data["runs"])
    return {(c["trace"], c["regime"], c["router"]): c for c in data["cells"]}


def test_peers_bench_runs_every_cell_with_kvroute_routers(tmp_path: Path) -> None:
    """Every trace on the light fleet, Mooncake on the P/D fleet (the other code path of a fleet) and on the
    other two (they differ from light by the fleet's cache sizes and protocol only): 16 runs instead of 32."""
    if not workloads.MOONCAKE_PATH.exists():
        pytest.skip(f"public trace not present at {workloads.MOONCAKE_PATH} (the checkout beside ../shared)")
    traces = ("mooncake", "shared_prefix@16", "agentic", "chat")
    regimes = ("light", "pressure", "tiered", "pd")
    cells = _run_peers(tmp_path / "a", "mooncake,shared_prefix,agentic,chat", "light")
    cells.update(_run_peers(tmp_path / "pd", "mooncake", "pd"))
    variant = "kvaware[affinity_weight=0;decode_stall_weight=0.5]"
    # --baseline: another install's kvaware in the same run (here this interpreter's, under its own name).
    extra = ("--hops", "--baseline", sys.executable)
    cells.update(_run_peers(tmp_path / "b", "mooncake", "pressure,tiered", *extra, routers=f"kvaware,{variant}"))
    expected = {(t, "light", r) for t in traces for r in ("kvaware", "round_robin")}
    expected |= {("mooncake", "pd", r) for r in ("kvaware", "round_robin")}
    expected |= {("mooncake", g, r) for g in ("pressure", "tiered") for r in ("kvaware", variant, peers.BASELINE)}
    assert set(cells) == expected
    # A variant is kvaware with those options, its files named after it.
    run_dir = next((tmp_path / "b").glob("runs-*/mooncake-pressure-0"))
    tag = "kvaware-affinity_weight=0-decode_stall_weight=0.5"
    assert (run_dir / f"receipts-{tag}.jsonl").stat().st_size > 0
    assert (run_dir / f"requests-{tag}.jsonl").stat().st_size > 0
    assert (run_dir / "requests-kvaware-baseline.jsonl").stat().st_size > 0
    for cell in cells.values():
        med = cell["median"]
        assert med["answered"] == med["requests"] > 0 and med["errors"] == 0
        assert med["ttft_p50_ms"] > 0 and 0 <= med["goodput"] <= 1
        assert med["decision_ms"] > 0  # every router here is kvroute's: its decision time is read off its page
        assert "ttft_p50_ms" in cell["ratios"] and cell["reference"] == "best other router"
        # The floor is the engine's prefill of what no cache could hold: no run is below it.
        assert 0 < med["floor_p50_ms"] <= med["floor_p99_ms"] <= med["ttft_p99_ms"]
        assert med["floor_p50_ms"] <= med["ttft_p50_ms"]
        assert 0 < med["tpot_p50_ms"] <= med["tpot_p99_ms"]
    # Cached tokens are counted from usage wherever a prompt repeats a prefix.
    for trace in traces:
        assert cells[(trace, "light", "kvaware")]["median"]["cached_tokens"] > 0
    # The P/D regime moved KV to decoders (client-side "cached" includes it), the aggregated ones did not.
    pd = cells[("mooncake", "pd", "kvaware")]["median"]
    assert pd["cached_token_ratio"] > pd["prefill_saved_ratio"]
    light = cells[("mooncake", "light", "kvaware")]["median"]
    assert light["cached_token_ratio"] == pytest.approx(light["prefill_saved_ratio"])
    for regime in regimes:
        work = tmp_path / {"light": "a", "pd": "pd"}.get(regime, "b")
        assert (work / f"peers-{regime}.png").stat().st_size > 10_000
    assert "| mooncake | kvaware |" in (tmp_path / "a" / "peers.md").read_text()
    # --hops: every answered request was found in the workers' hop log, its TTFT split in three.
    for (_, regime, _), cell in cells.items():
        med = cell["median"]
        if regime in ("pressure", "tiered"):
            assert med["hop_matched"] == med["answered"]
            assert med["hop_forward_ms"] > 0 and med["hop_engine_ms"] > 0 and med["hop_return_ms"] > 0
        else:
            assert "hop_matched" not in med
    hops_table = (tmp_path / "b" / "peers.md").read_text().split("client → engine")[1]
    assert "| mooncake | kvaware | " in hops_table and "of it, kvroute's decision" in hops_table
    # bench/paired.py pairs the two routers' requests in every run folder.
    rows = paired.paired(tmp_path / "a", "kvaware", "round_robin")
    assert sorted(r["run"] for r in rows) == sorted(f"{t}-light-0" for t in traces)
    for r in rows:
        key = (r["run"].rsplit("-", 2)[0], r["run"].rsplit("-", 2)[1], "kvaware")
        assert r["requests"] == cells[key]["median"]["answered"]


def test_paired_requests_separate_the_routers_own_time_from_the_cache() -> None:
    def req(ttft_s: float, cached: int) -> dict[str, Any]:
        return {"ttft_s": ttft_s, "cached_tokens": cached}

    a = {("s", 0): req(0.010, 100), ("s", 1): req(0.012, 100), ("t", 0): req(0.040, 0), ("u", 0): req(0.5, 0)}
    b = {("s", 0): req(0.009, 100), ("s", 1): req(0.011, 100), ("t", 0): req(0.020, 100)}
    got = paired.pair(a, b, 1000.0)
    assert got["requests"] == 3 and got["same_cache"] == 2  # ("u", 0) only in a; ("t", 0) from other caches
    assert got["same_cache_median_ms"] == pytest.approx(1.0)
    assert got["median_ms"] == pytest.approx(1.0)
    assert (got["later"], got["earlier"]) == (1, 0) and got["later_sum_ms"] == pytest.approx(20.0)


def test_requests_fall_in_classes_by_the_share_of_the_prompt_cached(tmp_path: Path) -> None:
    def req(ttft_s: float, cached: int, prompt: int = 1000) -> dict[str, Any]:
        return {"ttft_s": ttft_s, "cached_tokens": cached, "prompt_tokens": prompt}

    assert [paired.cache_class(req(0.1, c)) for c in (0, 99, 100, 899, 900, 1000)] == [
        "nothing",
        "nothing",
        "part",
        "part",
        "nearly all",
        "nearly all",
    ]
    assert paired.cache_class(req(0.1, 0, prompt=0)) == "nothing"  # no prompt count: nothing known cached
    got = paired.by_class({("a", 0): req(0.100, 0), ("b", 0): req(0.020, 950), ("c", 0): req(0.030, 990)}, 1000.0)
    assert got == {
        "nothing": {"n": 1, "median_ms": pytest.approx(100.0)},
        "nearly all": {"n": 2, "median_ms": pytest.approx(25.0)},
    }
    # Over run folders: the median of the runs' medians; a class counts the runs it occurred in.
    for seed, (first, repeat) in enumerate(((0.100, 0.004), (0.110, 0.006), (0.120, 0.008))):
        run = tmp_path / "runs-x" / f"trace-light-{seed}"
        run.mkdir(parents=True)
        rows = [{"session": "s", "turn": 0, **req(first, 0)}, {"session": "s", "turn": 1, **req(repeat, 1000)}]
        if seed == 2:
            rows.append({"session": "t", "turn": 0, **req(0.050, 500)})
        (run / "requests-kvaware.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Hops where the workers logged them: the repeat of run 0, sent at 10.000 s, at the engine 2 ms later,
    # its first token out at 10.003 and at the client at 10.004; an arrival outside its span matches nothing.
    run0 = tmp_path / "runs-x" / "trace-light-0"
    rows0 = [json.loads(line) for line in (run0 / "requests-kvaware.jsonl").read_text().splitlines()]
    rows0[1].update(prompt_key=7, sent_at=10.0, first_at=10.004)
    rows0[0].update(prompt_key=8, sent_at=20.0, first_at=20.2)
    (run0 / "requests-kvaware.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows0))
    (run0 / "hops-kvaware.log").write_text("7 10.002 10.003\n8 30.0 30.1\n")
    found = paired.classes(tmp_path, ["kvaware", "smg:cache_aware"])
    repeat = found["kvaware"]["nearly all"]
    assert (repeat["forward_ms"], repeat["engine_ms"], repeat["return_ms"]) == pytest.approx((2.0, 1.0, 1.0))
    assert "forward_ms" not in found["kvaware"]["nothing"]
    assert set(found) == {"kvaware"}  # smg answered nowhere here
    assert found["kvaware"]["nothing"] == {"runs": 3, "n": 1, "median_ms": pytest.approx(110.0)}
    assert found["kvaware"]["nearly all"]["median_ms"] == pytest.approx(6.0)
    assert found["kvaware"]["part"]["runs"] == 1
    only = paired.classes(tmp_path, ["kvaware"], "light-2")  # the run folders whose name has it
    assert only["kvaware"]["nothing"] == {"runs": 1, "n": 1, "median_ms": pytest.approx(120.0)}
    text = paired.classes_markdown(found)
    assert "| kvaware | 1, 110.00 (3 runs) | 1, 50.00 (1 runs) | 1, 6.00 (3 runs); 2.00 / 1.00 / 1.00 |" in text
