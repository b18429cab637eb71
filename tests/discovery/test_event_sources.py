"""``GET /kv_event_sources`` against small real workers (both upstream clients): vLLM-shaped answers are
parsed and resolved, older workers fall back, hostile answers are rejected without an exception."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kvroute.config import WorkerConfig
from kvroute.router.discovery import (
    EventSource,
    EventSourceProbe,
    apply_event_sources,
    fetch_event_sources,
    lookup_event_sources,
    parse_event_sources,
)
from kvroute.router.transport import Transport, make_transport
from prometheus_client import CollectorRegistry

from tests.discovery.conftest import sample
from tests.discovery.workers import Worker, serve_worker, vllm_sources


@pytest.fixture(params=["native", "aiohttp", "httpx"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    transport = make_transport(request.param, 1.0, 5.0)
    yield transport
    await transport.aclose()


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    async with serve_worker(Worker("w")) as w:
        yield w


async def test_vllm_answer_with_wildcard_hosts(client: Transport, worker: Worker) -> None:
    worker.sources = vllm_sources(host="*", base_port=5557, ranks=2, replay_base=5567)
    sources = await fetch_event_sources(client, worker.url)
    assert sources == [
        EventSource(0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567", "kv-events"),
        EventSource(1, "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5568", "kv-events"),
    ]


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "*", "127.0.0.1"])
async def test_bare_array_and_every_wildcard(client: Transport, worker: Worker, host: str) -> None:
    """vLLM's history has a bare JSON array too; ``0.0.0.0``, ``::`` and ``*`` all mean the worker."""
    worker.sources = [
        {"data_parallel_rank": 0, "endpoint": f"tcp://{host}:41001", "replay_endpoint": None, "topic": "", "x": 1}
    ]
    assert await fetch_event_sources(client, worker.url) == [EventSource(0, "tcp://127.0.0.1:41001", None, "")]


async def test_a_name_may_publish_the_address_it_resolves_to(client: Transport, worker: Worker) -> None:
    """vLLM binds ``tcp://*:0`` to the node's IP and reports that IP: fine when the URL's name resolves to it."""
    worker.sources = vllm_sources(host="127.0.0.1")
    lookup = await lookup_event_sources(client, f"http://localhost:{worker.port}")
    assert lookup.outcome == "found", lookup.reason
    assert lookup.sources[0].endpoint == "tcp://127.0.0.1:5557"


async def test_older_vllm_without_the_endpoint(client: Transport, worker: Worker) -> None:
    worker.sources = None
    assert await fetch_event_sources(client, worker.url) is None
    assert (await lookup_event_sources(client, worker.url)).outcome == "absent"


async def test_events_disabled_and_server_errors(client: Transport, worker: Worker) -> None:
    worker.sources = {"sources": []}
    assert (await lookup_event_sources(client, worker.url)).outcome == "disabled"
    worker.sources_status = 500
    assert (await lookup_event_sources(client, worker.url)).outcome == "failed"


async def test_slow_and_unreachable_workers_fail_within_the_timeout(client: Transport, worker: Worker) -> None:
    worker.sources_delay_s = 5.0
    lookup = await lookup_event_sources(client, worker.url, timeout_s=0.3)
    assert lookup.outcome == "failed"
    lookup = await lookup_event_sources(client, "http://127.0.0.1:9", timeout_s=1.0)
    assert lookup.outcome == "failed"


def _entry(**over: Any) -> dict[str, Any]:
    base = {"data_parallel_rank": 0, "endpoint": "tcp://*:5557", "replay_endpoint": None, "topic": "kv"}
    return base | over


HOSTILE: list[tuple[str, Any, str]] = [
    ("not json", b"<html>hello</html>", "not JSON"),
    ("a string", "tcp://*:5557", "not a list"),
    ("object without sources", {"endpoints": []}, "neither 'sources' nor a rank"),
    ("sources not a list", {"sources": {"0": "tcp://*:1"}}, "not a list"),
    ("entry not an object", {"sources": ["tcp://*:5557"]}, "not an object"),
    ("rank missing", {"sources": [_entry(data_parallel_rank=None)]}, "not a rank"),
    ("rank as bool", {"sources": [_entry(data_parallel_rank=True)]}, "not a rank"),
    ("rank as text", {"sources": [_entry(data_parallel_rank="0")]}, "not a rank"),
    ("negative rank", {"sources": [_entry(data_parallel_rank=-1)]}, "not a rank"),
    ("duplicate rank", {"sources": [_entry(), _entry()]}, "twice"),
    ("endpoint not a string", {"sources": [_entry(endpoint=5557)]}, "not a string"),
    ("endpoint huge", {"sources": [_entry(endpoint="tcp://" + "a" * 5000 + ":1")]}, "characters long"),
    ("inproc", {"sources": [_entry(endpoint="inproc://kv")]}, "only tcp://"),
    ("http scheme", {"sources": [_entry(endpoint="http://*:5557")]}, "only tcp://"),
    ("elsewhere", {"sources": [_entry(endpoint="tcp://10.9.9.9:5557")]}, "points at 10.9.9.9"),
    ("replay elsewhere", {"sources": [_entry(replay_endpoint="tcp://evil.example:1")]}, "points at evil.example"),
    ("unbound port", {"sources": [_entry(endpoint="tcp://*:0")]}, "no bound port"),
    ("no port", {"sources": [_entry(endpoint="tcp://*")]}, "no bound port"),
    ("bad port", {"sources": [_entry(endpoint="tcp://*:99999")]}, "invalid port"),
    ("path", {"sources": [_entry(endpoint="tcp://*:5557/x?y")]}, "not tcp://host:port"),
    ("topic not text", {"sources": [_entry(topic=["a"])]}, "topic"),
    ("topic control chars", {"sources": [_entry(topic="a\x00b")]}, "topic"),
    ("huge body", b"[" + b" " * (100 * 1024) + b"]", "larger than"),
]


@pytest.mark.parametrize(("body", "why"), [(b, w) for _, b, w in HOSTILE], ids=[n for n, _, _ in HOSTILE])
async def test_hostile_answers_are_rejected(
    client: Transport, worker: Worker, body: Any, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker.sources = body
    lookup = await lookup_event_sources(client, worker.url)
    assert lookup.outcome == "rejected"
    assert why in lookup.reason
    reg = CollectorRegistry()
    probe = EventSourceProbe(client, reg)
    cfg = WorkerConfig(url=worker.url, id="w")
    with caplog.at_level(logging.WARNING, logger="kvroute.discovery"):
        assert await probe.fill(cfg) == cfg
    assert "rejected" in caplog.text and why in caplog.text
    assert sample(reg, "kvroute_event_source_discovery_total", {"outcome": "rejected"}) == 1


def test_ipc_only_from_this_machine_and_counts_are_bounded() -> None:
    remote = [_entry(endpoint="ipc:///tmp/kv-events")]
    import orjson

    with pytest.raises(ValueError, match="only tcp://"):
        parse_event_sources(orjson.dumps(remote), "10.0.0.5")
    local = parse_event_sources(orjson.dumps(remote), "127.0.0.1")
    assert local[0].endpoint == "ipc:///tmp/kv-events"
    many = [_entry(data_parallel_rank=i) for i in range(1025)]
    with pytest.raises(ValueError, match="more than 1024"):
        parse_event_sources(orjson.dumps(many), "10.0.0.5")
    assert parse_event_sources(orjson.dumps(remote[:0]), "10.0.0.5") == []
    # Hosts allowed explicitly (e.g. the nodes of a multi-node data-parallel deployment).
    other = [_entry(endpoint="tcp://10.0.0.6:5557")]
    assert parse_event_sources(orjson.dumps(other), "10.0.0.5", ["10.0.0.6"])[0].endpoint == "tcp://10.0.0.6:5557"
    v6 = parse_event_sources(orjson.dumps([_entry()]), "[fd00::5]")
    assert v6[0].endpoint == "tcp://[fd00::5]:5557"


def test_apply_to_a_worker_config() -> None:
    cfg = WorkerConfig(url="http://10.0.0.5:8000", id="pod-0")
    two = [
        EventSource(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5567", "kv"),
        EventSource(1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5568", "kv"),
    ]
    filled = apply_event_sources(cfg, two)
    assert (filled.kv_events, filled.replay, filled.kv_events_topic, filled.dp_size) == (
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5567",
        "kv",
        2,
    )
    ephemeral = [EventSource(0, "tcp://10.0.0.5:41001", None, ""), EventSource(1, "tcp://10.0.0.5:39007", None, "")]
    with pytest.raises(ValueError, match="one subscription per rank"):
        apply_event_sources(cfg, ephemeral)
    with pytest.raises(ValueError, match=r"not 0\.\.0"):
        apply_event_sources(cfg, [EventSource(1, "tcp://10.0.0.5:5558", None, "")])


async def test_probe_fills_outcomes_and_never_overrides_config(client: Transport, worker: Worker) -> None:
    reg = CollectorRegistry()
    probe = EventSourceProbe(client, reg)
    cfg = WorkerConfig(url=worker.url, id="w")
    filled = await probe.fill(cfg)
    assert (filled.kv_events, filled.replay, filled.kv_events_topic) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5567",
        "kv-events",
    )
    configured = cfg.model_copy(update={"kv_events": "tcp://127.0.0.1:6000"})
    hits = worker.hits["/kv_event_sources"]
    assert await probe.fill(configured) is configured
    assert worker.hits["/kv_event_sources"] == hits, "configured endpoints must not be looked up"
    worker.sources = None
    assert await probe.fill(cfg) == cfg
    worker.sources = vllm_sources(ranks=2) | {
        "sources": [
            {"data_parallel_rank": 0, "endpoint": "tcp://*:41001", "replay_endpoint": None, "topic": ""},
            {"data_parallel_rank": 1, "endpoint": "tcp://*:39117", "replay_endpoint": None, "topic": ""},
        ]
    }
    assert await probe.fill(cfg) == cfg  # ephemeral per-rank ports: valid answer, not usable here
    counts = {o: sample(reg, "kvroute_event_source_discovery_total", {"outcome": o}) for o in ("found", "absent")}
    assert counts == {"found": 1, "absent": 1}
    assert sample(reg, "kvroute_event_source_discovery_total", {"outcome": "unusable"}) == 1


async def test_the_simulated_vllm_worker(client: Transport) -> None:
    """kvroute's sim serves /kv_event_sources as vLLM does: the probe fills a worker from it."""
    from kvroute.sim.options import WorkerOptions
    from kvroute.sim.worker import SimWorker

    async with SimWorker(WorkerOptions()) as sim:
        filled = await EventSourceProbe(client).fill(WorkerConfig(url=sim.url, id="sim"))
        assert filled.kv_events == sim.events_endpoint
        assert filled.replay is not None and filled.replay.startswith("tcp://127.0.0.1:")
        assert filled.dp_size == 1
