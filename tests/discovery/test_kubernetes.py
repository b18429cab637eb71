"""The Kubernetes source against the API stand-in (tests/discovery/kube_apiserver.py; no real cluster is
available here): pods join and leave a real WorkerRegistry through the reconciler; list+watch details,
410 relists, outages, auth."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvroute.config import KubernetesDiscoveryConfig, RouterConfig, WorkerConfig
from kvroute.router.discovery import (
    Backoff,
    Discovery,
    EventSourceProbe,
    KubeConfigError,
    KubernetesSource,
    RegistrySink,
    build_discovery,
    discover_api,
    in_cluster_api,
    kubeconfig_api,
    worker_from_pod,
)
from kvroute.router.registry import WorkerRegistry
from kvroute.router.transport import Transport
from prometheus_client import CollectorRegistry

from tests.discovery.conftest import sample
from tests.discovery.kube_apiserver import KubeApiServer, make_pod
from tests.discovery.workers import Worker, serve_worker
from tests.polling import eventually


def write_kubeconfig(
    tmp_path: Path, server: str, user: dict[str, Any] | None = None, namespace: str = "default"
) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stand-in", "cluster": {"server": server}}],
                "users": [{"name": "kvroute", "user": user if user is not None else {"token": "s3cret"}}],
                "contexts": [
                    {"name": "test", "context": {"cluster": "stand-in", "user": "kvroute", "namespace": namespace}}
                ],
                "current-context": "test",
            }
        )
    )
    return str(path)


def k8s_config(kubeconfig: str, **over: Any) -> KubernetesDiscoveryConfig:
    return KubernetesDiscoveryConfig.model_validate(
        {"selector": "app=vllm", "port_name": "http", "kubeconfig": kubeconfig} | over
    )


def source(config: KubernetesDiscoveryConfig, **options: Any) -> KubernetesSource:
    options.setdefault("backoff", Backoff(initial_s=0.05, max_s=0.3))
    options.setdefault("watch_timeout_s", 30)
    return KubernetesSource(config, **options)


class Collect:
    """Runs a source alone and keeps what it reports (for wire-level assertions)."""

    def __init__(self, src: KubernetesSource) -> None:
        self.src = src
        self.sets: list[dict[str, WorkerConfig]] = []
        self.errors: list[str] = []
        self.task: asyncio.Task[None] | None = None

    def _report(self, workers: Mapping[str, WorkerConfig]) -> None:
        self.sets.append(dict(workers))

    @property
    def last(self) -> set[str]:
        return set(self.sets[-1]) if self.sets else set()

    async def __aenter__(self) -> Collect:
        self.task = asyncio.create_task(self.src.run(self._report, self.errors.append))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


# ---------------------------------------------------------------------------------------------- pods


def test_which_pods_are_workers() -> None:
    cfg = KubernetesDiscoveryConfig(selector="app=vllm", port_name="http", events_port=5557, replay_port=5567)
    worker = worker_from_pod(make_pod("vllm-0", ip="10.2.0.7", port=8123), cfg)
    assert worker is not None
    assert (worker.worker_id, worker.url, worker.kv_events, worker.replay, worker.p2p_host) == (
        "vllm-0",
        "http://10.2.0.7:8123",
        "tcp://10.2.0.7:5557",
        "tcp://10.2.0.7:5567",
        "10.2.0.7",
    )
    assert worker_from_pod(make_pod("p", ready=False), cfg) is None
    assert worker_from_pod(make_pod("p", phase="Pending", ready=False), cfg) is None
    terminating = make_pod("p")
    terminating["metadata"]["deletionTimestamp"] = "2026-09-20T10:00:00Z"
    assert worker_from_pod(terminating, cfg) is None
    no_ip = make_pod("p")
    del no_ip["status"]["podIP"]
    assert worker_from_pod(no_ip, cfg) is None
    # The named port is not declared: the configured port is the fallback, else the pod is skipped.
    assert worker_from_pod(make_pod("p", port_name="api"), cfg) is None
    fallback = KubernetesDiscoveryConfig(selector="app=vllm", port_name="api", port=9000)
    assert worker_from_pod(make_pod("p", port=8123), fallback).url.endswith(":9000")  # type: ignore[union-attr]
    plain = KubernetesDiscoveryConfig(selector="app=vllm")
    v6 = worker_from_pod(make_pod("p", ip="fd00::7"), plain)
    assert v6 is not None and v6.url == "http://[fd00::7]:8000" and v6.kv_events is None


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture
async def workers() -> AsyncIterator[list[Worker]]:
    async with serve_worker(Worker("a")) as a, serve_worker(Worker("b")) as b, serve_worker(Worker("c")) as c:
        yield [a, b, c]


async def test_pods_join_and_leave_a_real_registry(
    apiserver: KubeApiServer, tmp_path: Path, workers: list[Worker], registry: WorkerRegistry, transport: Transport
) -> None:
    a, b, c = workers
    apiserver.add(make_pod("vllm-a", port=a.port))
    apiserver.add(make_pod("vllm-b", port=b.port, phase="Pending", ready=False))
    apiserver.add(make_pod("web", port=c.port, labels={"app": "web"}))
    reg = CollectorRegistry()
    static = WorkerConfig(url=c.url, id="static-c")
    await registry.add(static)
    discovery = Discovery(
        [source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)))],
        RegistrySink(registry),
        static_ids=["static-c"],
        grace_s=0.3,
        registry=reg,
        enrich=EventSourceProbe(transport, reg).fill,
    )
    await discovery.start()

    def ids() -> set[str]:
        return {w.id for w in registry.all()}

    try:
        await eventually(lambda: ids() == {"static-c", "vllm-a"}, what="the ready pod joins")
        state = registry.get("vllm-a")
        assert state is not None and state.url == a.url
        await eventually(lambda: state.healthy is True, what="probed by the add")
        assert state.config.kv_events == "tcp://127.0.0.1:5557"  # from the worker's /kv_event_sources
        assert state.config.replay == "tcp://127.0.0.1:5567"

        apiserver.update("vllm-b", phase="Running", ready=True)
        await eventually(lambda: "vllm-b" in ids(), what="a pod that became ready joins")
        apiserver.update("vllm-a", ready=False)
        await eventually(lambda: "vllm-a" not in ids(), what="an unready pod leaves after the grace period")
        apiserver.update("vllm-a", ready=True)
        await eventually(lambda: "vllm-a" in ids(), what="ready again")

        apiserver.terminate("vllm-a")
        await eventually(lambda: "vllm-a" not in ids(), what="a terminating pod leaves")
        apiserver.delete("vllm-a")
        apiserver.update("vllm-b", labels={"app": "web"})
        await eventually(lambda: "vllm-b" not in ids(), what="a pod out of the selector leaves")
        apiserver.add(make_pod("vllm-new", port=a.port))
        await eventually(lambda: ids() == {"static-c", "vllm-new"}, what="a new pod joins")
        assert registry.get("static-c") is not None, "discovery touched a static worker"
        assert sample(reg, "kvroute_discovery_changes_total", {"source": "kubernetes", "change": "removed"}) == 3
        assert sample(reg, "kvroute_event_source_discovery_total", {"outcome": "found"}) >= 3
    finally:
        await discovery.stop()


async def test_flapping_readiness_within_grace_keeps_the_worker(
    apiserver: KubeApiServer, tmp_path: Path, workers: list[Worker], registry: WorkerRegistry
) -> None:
    apiserver.add(make_pod("vllm-a", port=workers[0].port))
    reg = CollectorRegistry()
    discovery = Discovery(
        [source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)))], RegistrySink(registry), grace_s=5, registry=reg
    )
    await discovery.start()
    try:
        await eventually(lambda: registry.get("vllm-a") is not None)
        first = registry.get("vllm-a")
        for ready in (False, True, False, True):
            apiserver.update("vllm-a", ready=ready)
            await asyncio.sleep(0.15)
        await discovery.reconcile()
        assert registry.get("vllm-a") is first, "flapping readiness churned the registry"
        assert sample(reg, "kvroute_discovery_changes_total", {"source": "kubernetes", "change": "removed"}) == 0
    finally:
        await discovery.stop()


# ---------------------------------------------------------------------------------------------- wire


async def test_list_then_watch_with_bookmarks_and_resume(apiserver: KubeApiServer, tmp_path: Path) -> None:
    apiserver.add(make_pod("vllm-0", port=8000))
    src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)), watch_timeout_s=1)
    async with Collect(src) as run:
        await eventually(lambda: run.last == {"vllm-0"})
        await eventually(lambda: len(apiserver.watch_requests()) >= 3, what="watches resumed after timeoutSeconds")
        apiserver.add(make_pod("vllm-1", port=8001))
        await eventually(lambda: run.last == {"vllm-0", "vllm-1"})
    listed, watches = apiserver.list_requests(), apiserver.watch_requests()
    assert len(listed) == 1, "a watch that timed out must resume, not list again"
    assert listed[0]["query"] == {"labelSelector": "app=vllm", "limit": "500"}
    first = watches[0]["query"]
    assert first["allowWatchBookmarks"] == "true" and first["timeoutSeconds"] == "1"
    assert first["labelSelector"] == "app=vllm" and first["resourceVersion"] == "101"  # the list's version
    # Bookmarks moved the version forward while nothing changed.
    assert int(watches[2]["query"]["resourceVersion"]) >= int(first["resourceVersion"])
    assert all(r["authorization"] == "Bearer s3cret" for r in apiserver.requests)
    assert not run.errors


async def test_pagination(apiserver: KubeApiServer, tmp_path: Path) -> None:
    for i in range(5):
        apiserver.add(make_pod(f"vllm-{i}", port=8000 + i))
    src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)), page_size=2)
    async with Collect(src) as run:
        await eventually(lambda: len(run.last) == 5)
    assert len(apiserver.list_requests()) == 3
    assert "continue" in apiserver.list_requests()[1]["query"]


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists_and_drops_pods_deleted_in_the_gap(tmp_path: Path, gone_as_http: bool) -> None:
    apiserver = KubeApiServer(token="s3cret", gone_as_http=gone_as_http)
    await apiserver.start()
    try:
        apiserver.add(make_pod("vllm-0", port=8000))
        apiserver.add(make_pod("vllm-1", port=8001))
        src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)))
        async with Collect(src) as run:
            await eventually(lambda: run.last == {"vllm-0", "vllm-1"})
            await apiserver.stop()  # the router loses the API server...
            apiserver.delete("vllm-1")  # ...the pod goes meanwhile, and etcd compacts the history
            apiserver.add(make_pod("vllm-2", port=8002))
            apiserver.compact()
            await apiserver.start()
            await eventually(lambda: run.last == {"vllm-0", "vllm-2"}, what="relist after 410")
            assert len(apiserver.list_requests()) == 2
            # An expiry on an open watch (ERROR event) relists too.
            await eventually(lambda: bool(apiserver.watchers), what="watching again")
            apiserver.expire_watches()
            await eventually(lambda: len(apiserver.list_requests()) == 3, what="relist after ERROR 410")
    finally:
        await apiserver.stop()


async def test_a_corrupt_watch_line_relists(apiserver: KubeApiServer, tmp_path: Path) -> None:
    apiserver.add(make_pod("vllm-0", port=8000))
    src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)))
    async with Collect(src) as run:
        await eventually(lambda: run.last == {"vllm-0"} and apiserver.watchers)
        apiserver.corrupt_watches()
        await eventually(lambda: len(apiserver.list_requests()) == 2, what="relist after a bad line")
        apiserver.add(make_pod("vllm-1", port=8001))
        await eventually(lambda: run.last == {"vllm-0", "vllm-1"})
    assert any("JSONDecodeError" in e for e in run.errors), run.errors


async def test_an_api_outage_keeps_the_last_set(
    apiserver: KubeApiServer, tmp_path: Path, sink: Any, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.add(make_pod("vllm-0", port=8000))
    apiserver.add(make_pod("vllm-1", port=8001))
    reg = CollectorRegistry()
    src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)))
    discovery = Discovery([src], sink, grace_s=0.2, registry=reg)
    await discovery.start()
    try:
        await eventually(lambda: set(sink.workers) == {"vllm-0", "vllm-1"})
        await apiserver.stop()
        await eventually(lambda: sample(reg, "kvroute_discovery_errors_total", {"source": "kubernetes"}) >= 3)
        await asyncio.sleep(0.4)  # twice the grace period
        await discovery.reconcile()
        assert set(sink.workers) == {"vllm-0", "vllm-1"}, "an API outage emptied the pool"
        assert "watching pods 'app=vllm' in default" in caplog.text
        # A connection cut mid-stream resumes the watch (no list) once the server answers again.
        await apiserver.start()
        apiserver.delete("vllm-0")
        await eventually(lambda: set(sink.workers) == {"vllm-1"}, what="recovered after the outage")
        lists = len(apiserver.list_requests())
        apiserver.drop_watches()
        await asyncio.sleep(0.2)
        apiserver.add(make_pod("vllm-3", port=8003))
        await eventually(lambda: set(sink.workers) == {"vllm-1", "vllm-3"})
        assert len(apiserver.list_requests()) == lists
    finally:
        await discovery.stop()


async def test_auth_failures_are_reported_with_the_api_message(apiserver: KubeApiServer, tmp_path: Path) -> None:
    src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url, user={"token": "wrong"})))
    async with Collect(src) as run:
        await eventually(lambda: len(run.errors) >= 2)
    assert "HTTP 401: Unauthorized" in run.errors[0] and "RBAC" in run.errors[0]
    apiserver.forbidden = True
    src = source(k8s_config(write_kubeconfig(tmp_path, apiserver.url)))
    async with Collect(src) as run:
        await eventually(lambda: len(run.errors) >= 1)
    assert 'cannot list resource "pods"' in run.errors[0] and "get/list/watch" in run.errors[0]
    assert not run.sets


# ---------------------------------------------------------------------------------------------- credentials


def test_kubeconfig_variants(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    api = kubeconfig_api(write_kubeconfig(tmp_path, "http://127.0.0.1:1", user={"tokenFile": "token"}, namespace="ns"))
    assert api.headers()["Authorization"] == "Bearer from-file" and api.namespace == "ns"
    (tmp_path / "token").write_text("rotated")
    assert api.headers()["Authorization"] == "Bearer rotated"
    basic = kubeconfig_api(write_kubeconfig(tmp_path, "http://127.0.0.1:1", user={"username": "u", "password": "p"}))
    assert basic.headers()["Authorization"] == "Basic dTpw"
    with pytest.raises(KubeConfigError, match="exec credential plugin"):
        kubeconfig_api(write_kubeconfig(tmp_path, "https://127.0.0.1:1", user={"exec": {"command": "aws"}}))
    with pytest.raises(KubeConfigError, match="cannot read kubeconfig"):
        kubeconfig_api(str(tmp_path / "missing"))
    with pytest.raises(KubeConfigError, match="no Kubernetes credentials"):
        discover_api(environ={"HOME": str(tmp_path / "nowhere")})
    found = discover_api(environ={"KUBECONFIG": write_kubeconfig(tmp_path, "http://127.0.0.1:2")})
    assert found.server == "http://127.0.0.1:2"
    with pytest.raises(KubeConfigError, match="not in a cluster"):
        in_cluster_api(str(tmp_path), environ={})


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test CA")
async def test_in_cluster_service_account_over_tls(tmp_path: Path, registry: WorkerRegistry) -> None:
    """What a pod sees: KUBERNETES_SERVICE_HOST/PORT, the token and the cluster CA in the SA folder; the
    stand-in serves HTTPS with a certificate that CA signed, and the rotated token is picked up."""
    ca_key, ca_crt, key, csr, crt = (str(tmp_path / n) for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt"))
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        ca_key,
        "-out",
        ca_crt,
        "-days",
        "1",
        "-subj",
        "/CN=test-cluster-ca",
    )
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=kubernetes")
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca_crt,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        crt,
        "-days",
        "1",
        "-extfile",
        str(ext),
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(crt, key)
    apiserver = KubeApiServer(token="sa-token-1", ssl_context=server_ctx)
    await apiserver.start()
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    shutil.copy(ca_crt, sa / "ca.crt")
    (sa / "token").write_text("sa-token-1")
    (sa / "namespace").write_text("inference")
    try:
        api = in_cluster_api(
            str(sa), {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(apiserver.port)}
        )
        assert api.server == f"https://127.0.0.1:{apiserver.port}" and api.namespace == "inference"
        apiserver.add(make_pod("vllm-0", namespace="inference"))
        apiserver.add(make_pod("vllm-x", namespace="default"))
        src = source(KubernetesDiscoveryConfig(selector="app=vllm"), api=api)
        async with Collect(src) as run:
            await eventually(lambda: run.last == {"vllm-0"})
            (sa / "token").write_text("sa-token-2")  # the kubelet rotated it
            apiserver.token = "sa-token-2"
            apiserver.drop_watches()
            apiserver.add(make_pod("vllm-1", namespace="inference"))
            await eventually(lambda: run.last == {"vllm-0", "vllm-1"}, what="rotated token used")
        assert apiserver.requests[-1]["authorization"] == "Bearer sa-token-2"
        assert all(r["path"] == "/api/v1/namespaces/inference/pods" for r in apiserver.requests)
    finally:
        await apiserver.stop()


async def test_build_discovery_from_the_router_config(
    apiserver: KubeApiServer, tmp_path: Path, registry: WorkerRegistry, transport: Transport, workers: list[Worker]
) -> None:
    """The composition root's few lines: sources from config, the registry adapter, start/stop."""
    assert build_discovery(RouterConfig(), registry, transport) is None
    apiserver.add(make_pod("vllm-a", port=workers[0].port))
    config = RouterConfig.model_validate(
        {
            "workers": [{"url": workers[2].url, "id": "static"}],
            "discovery": {
                "kubernetes": {
                    "selector": "app=vllm",
                    "port_name": "http",
                    "kubeconfig": write_kubeconfig(tmp_path, apiserver.url),
                },
                "dns": {
                    "name": "vllm.invalid",
                    "port": 8000,
                    "nameserver": "127.0.0.1",
                    "nameserver_port": 9,
                    "interval_s": 60,
                },
                "grace_s": 1,
            },
        }
    )
    reg = CollectorRegistry()
    discovery = build_discovery(config, registry, transport, reg)
    assert discovery is not None
    assert [s.name for s in discovery.sources] == ["kubernetes", "dns"]
    await discovery.start()
    try:
        await eventually(lambda: registry.get("vllm-a") is not None)
        assert registry.get("vllm-a").config.kv_events == "tcp://127.0.0.1:5557"  # type: ignore[union-attr]
    finally:
        await discovery.stop()
