"""The Helm chart deploy/helm/kvroute: lint, render every mode, validate every object, check what it means.

No Kubernetes API server can run here, so "valid" means: ``helm lint --strict`` passes, every rendered
object of a Kubernetes API group validates against that Kubernetes version's schema (kubernetes-validate,
strict: unknown fields are errors), every custom resource against its CRD's rules (crd_schemas.py), the
objects refer to each other consistently (Services select pods, ports exist, ...), the rendered
kvroute.yaml loads in kvroute's own config model and each container's arguments parse with kvroute's own
command line.
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy import chart
from tests.deploy.crd_schemas import validate_custom_resource
from tests.deploy.validation import K8S_VERSIONS, check_object

MODES = chart.MODES
ALL = (None, *MODES, chart.EVERYTHING)  # None: the chart's own defaults
KVROUTE_CONTAINERS = ("router", "epp", "indexer")


def ids(mode: str | None) -> str:
    return mode or "chart-defaults"


def pod_specs(r: chart.Rendered) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in r.all("Deployment")}


def containers(r: chart.Rendered) -> list[dict[str, Any]]:
    return [c for spec in pod_specs(r).values() for c in spec["containers"]]


def kvroute_container(r: chart.Rendered, name: str) -> dict[str, Any]:
    found = [c for c in containers(r) if c["name"] == name]
    assert len(found) == 1, f"expected one {name} container"
    return found[0]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- lint and schemas -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_helm_lint(helm: str, mode: str | None) -> None:
    done = chart.helm("lint", "--strict", str(chart.CHART), *chart.values_args(mode), check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_install_notes_render(helm: str, mode: str | None) -> None:
    """``helm install --dry-run=client`` renders NOTES.txt too (and the Secret's lookup, which finds none)."""
    done = chart.helm(
        "install", chart.RELEASE, str(chart.CHART), *chart.values_args(mode), "--dry-run=client", "-n", "llm"
    )
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "kvaware policy" in notes and "kubectl -n llm get secret" in notes


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_every_object_validates(render: Any, mode: str | None) -> None:
    r = render(mode)
    assert r.objects, "nothing rendered"
    for obj in r.objects:
        check_object(obj)


def test_the_validators_are_not_vacuous(render: Any) -> None:
    """A misspelt field fails both kinds of validation (so a pass above means something)."""
    r = render("epp")
    deployment = copy.deepcopy(r.one("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    pool = copy.deepcopy(r.one("InferencePool"))
    pool["spec"]["extensionRef"] = pool["spec"].pop("endpointPickerRef")  # the pre-v1 name
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(pool)
    pool = copy.deepcopy(r.one("InferencePool"))
    del pool["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(jsonschema.ValidationError):
        validate_custom_resource(pool)


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_objects_refer_to_each_other(render: Any, mode: str | None) -> None:
    r = render(mode)
    deployments = r.all("Deployment")
    templates = {d["metadata"]["name"]: d["spec"]["template"] for d in deployments}
    for d in deployments:
        assert matches(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
    config_maps = {c["metadata"]["name"] for c in r.all("ConfigMap")}
    secrets = {s["metadata"]["name"] for s in r.all("Secret")}
    accounts = {s["metadata"]["name"] for s in r.all("ServiceAccount")}
    for name, spec in pod_specs(r).items():
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, f"{name}: missing ConfigMap"
        if "serviceAccountName" in spec:
            assert spec["serviceAccountName"] in accounts, f"{name}: missing ServiceAccount"
        for container in spec["containers"]:
            ports = {p["name"] for p in container.get("ports", [])}
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                handler = container.get(probe, {})
                for kind in ("httpGet", "tcpSocket"):
                    if kind in handler and isinstance(handler[kind]["port"], str):
                        assert handler[kind]["port"] in ports, f"{name}: {probe} on an unknown port"
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] in secrets:
                    secret = r.one("Secret", ref["name"])
                    assert ref["key"] in secret.get("data", {}) | secret.get("stringData", {})
    for service in r.all("Service"):
        backing = [t for t in templates.values() if matches(service["spec"]["selector"], t["metadata"]["labels"])]
        assert len(backing) == 1, f"Service {service['metadata']['name']} selects {len(backing)} workloads"
        port_names = {p["name"] for c in backing[0]["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {service['metadata']['name']}: {port['targetPort']}"
    for pdb in r.all("PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(matches(selector, t["metadata"]["labels"]) for t in templates.values())
    for binding in r.all("RoleBinding"):
        assert binding["roleRef"]["name"] in {role["metadata"]["name"] for role in r.all("Role")}
        assert {s["name"] for s in binding["subjects"]} <= accounts
    services = {s["metadata"]["name"]: s for s in r.all("Service")}
    for pool in r.all("InferencePool"):
        ref = pool["spec"]["endpointPickerRef"]
        assert ref["name"] in services, "endpointPickerRef names no Service of the release"
        assert ref["port"]["number"] in {p["port"] for p in services[ref["name"]]["spec"]["ports"]}
    for route in r.all("HTTPRoute"):
        pools = {p["metadata"]["name"] for p in r.all("InferencePool")}
        for rule in route["spec"]["rules"]:
            for backend in rule["backendRefs"]:
                assert backend["kind"] == "InferencePool" and backend["name"] in pools
    for monitor in r.all("ServiceMonitor"):
        selected = [
            s for s in services.values() if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
        assert any(p["name"] in scraped for s in selected for p in s["spec"]["ports"]), "ServiceMonitor scrapes nothing"


# --- what kvroute sees --------------------------------------------------------------------------------------


def test_kvaware_is_the_default_policy(render: Any) -> None:
    assert render(None).config()["policy"] == "kvaware"
    for mode in MODES:
        assert render(mode).config()["policy"] == "kvaware", mode


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_rendered_config_loads_in_kvroute(render: Any, mode: str | None, tmp_path: Path) -> None:
    from kvroute.config import RouterConfig, load_config

    data = render(mode).config()
    if "discovery" in data and "discovery" not in RouterConfig.model_fields:
        pytest.skip("this kvroute has no `discovery` config section yet (the chart renders it already)")
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(data))
    # The token reaches the router the way the pods pass it: KVROUTE_ADMIN_TOKEN from the Secret.
    config = load_config(path, environ={"KVROUTE_ADMIN_TOKEN": "from-the-secret"})
    assert config.admin_token == "from-the-secret"
    assert config.host == "0.0.0.0"
    if mode == "discovery":
        assert not config.workers


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_container_arguments_parse_and_ports_agree(render: Any, mode: str | None) -> None:
    from kvroute.apps.cli import build_parser

    r = render(mode)
    port = r.config()["port"]
    for container in containers(r):
        if container["name"] not in KVROUTE_CONTAINERS:
            continue
        args = build_parser(container["args"]).parse_args(container["args"])
        assert args.command == container["args"][0] == container["name"].replace("router", "serve")
        assert args.config == "/etc/kvroute/kvroute.yaml"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if args.command == "serve":
            assert ports["http"] == port  # the router listens on the config's port
        elif args.command == "epp":
            assert (ports["http"], ports["grpc"]) == (args.port, args.grpc_port)
        else:
            assert args.backend == "redis" and args.host == "0.0.0.0" and ports["metrics"] == args.port


def test_router_mode(render: Any) -> None:
    r = render("default")
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount"} <= r.kinds()
    assert not r.kinds() & {"InferencePool", "Role", "RoleBinding", "Secret"}  # admin.existingSecret here
    router = kvroute_container(r, "router")
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    config = r.config()
    assert config.get("index", {}).get("backend", "memory") == "memory"
    assert [w["id"] for w in config["workers"]] == ["vllm-0", "vllm-1"]
    assert r.one("Deployment", chart.RELEASE)["spec"]["replicas"] == 1


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_pods_run_non_root_with_a_read_only_root(render: Any, mode: str | None) -> None:
    r = render(mode)
    for name, spec in pod_specs(r).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in sc["capabilities"], name
            assert container.get("resources", {}).get("requests"), f"{name}: no resource requests"
            if container["name"] in KVROUTE_CONTAINERS:
                tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
                volume = next(v for v in spec["volumes"] if v["name"] == tmp["name"])
                assert "emptyDir" in volume


@pytest.mark.parametrize("mode", ALL, ids=ids)
def test_admin_token_comes_from_a_secret(render: Any, mode: str | None) -> None:
    r = render(mode)
    for container in containers(r):
        if container["name"] not in KVROUTE_CONTAINERS:
            continue
        env = {e["name"]: e for e in container["env"]}
        ref = env["KVROUTE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        secrets = {s["metadata"]["name"]: s for s in r.all("Secret")}
        if mode in ("default", "epp"):  # the static manifests: a Secret the user creates
            assert ref == {"name": "kvroute-admin", "key": "token"} and not secrets
        else:
            token = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
            assert len(token) >= 32 and token.isalnum()  # generated
    assert "admin_token" not in r.config()


def test_admin_token_given(render: Any) -> None:
    r = render(None, "--set", "admin.token=s3cret")
    assert base64.b64decode(r.one("Secret")["data"]["token"]) == b"s3cret"
    assert "s3cret" not in r.one("ConfigMap", chart.RELEASE)["data"]["kvroute.yaml"]


def test_discovery_mode(render: Any) -> None:
    r = render("discovery")
    config = r.config()
    assert config["discovery"] == {
        "kubernetes": {
            "namespace": "default",
            "selector": "app=vllm-llama",
            "port_name": "http",
            "events_port": 5557,
            "replay_port": 5567,
        }
    }
    assert config["workers"] == []
    role = r.one("Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = r.one("RoleBinding")
    account = r.one("ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "default"}]
    spec = pod_specs(r)[chart.RELEASE]
    assert spec["serviceAccountName"] == account and spec["automountServiceAccountToken"] is True
    # Without discovery nothing may talk to the API server.
    assert pod_specs(render("default"))[chart.RELEASE]["automountServiceAccountToken"] is False


def test_discovery_in_another_namespace_and_by_dns(render: Any) -> None:
    r = render(
        "discovery",
        "--set",
        "discovery.kubernetes.namespace=llm,discovery.kubernetes.port=8000,discovery.kubernetes.portName=",
        "--set",
        "discovery.kubernetes.eventsPort=null,discovery.kubernetes.replayPort=null,discovery.graceS=10",
        "--set",
        "discovery.dns.enabled=true,discovery.dns.name=vllm.llm.svc.cluster.local,discovery.dns.intervalS=2",
    )
    assert r.config()["discovery"] == {
        "kubernetes": {"namespace": "llm", "selector": "app=vllm-llama", "port": 8000},
        "dns": {"name": "vllm.llm.svc.cluster.local", "port": 8000, "interval_s": 2},
        "grace_s": 10,
    }
    assert r.one("Role")["metadata"]["namespace"] == "llm"
    assert r.one("RoleBinding")["subjects"][0]["namespace"] == "default"  # the release's ServiceAccount


def test_replicas_with_redis(render: Any) -> None:
    r = render("replicas-redis")
    assert r.one("Deployment", chart.RELEASE)["spec"]["replicas"] == 3
    index = r.config()["index"]
    assert index == {
        "backend": "redis",
        "redis_url": "redis://kvroute-redis:6379/0",
        "redis_prefix": "kvr",
        "subscribe": False,
    }
    indexer = r.one("Deployment", "kvroute-indexer")
    assert indexer["spec"]["replicas"] == 1 and indexer["spec"]["strategy"]["type"] == "Recreate"
    assert kvroute_container(r, "indexer")["args"][0] == "indexer"
    redis = r.one("Service", "kvroute-redis")
    assert redis["spec"]["ports"][0]["port"] == 6379
    assert r.one("Deployment", "kvroute-redis")["spec"]["template"]["spec"]["containers"][0]["image"].startswith(
        "redis:"
    )
    assert r.one("PodDisruptionBudget", "kvroute-router")["spec"]["maxUnavailable"] == 1
    assert r.one("ConfigMap", "kvroute-dashboard")["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert r.one("ServiceMonitor")


def test_external_redis(render: Any) -> None:
    r = render(None, "--set", "router.replicas=2,redis.external.url=redis://cache.example:6379/3")
    assert r.config()["index"]["redis_url"] == "redis://cache.example:6379/3"
    assert not [d for d in r.all("Deployment") if d["metadata"]["name"] == "kvroute-redis"]
    secret = render(None, "--set", "router.replicas=2,redis.external.existingSecret=redis-url")
    assert "redis_url" not in secret.config()["index"]
    env = {e["name"]: e for e in kvroute_container(secret, "router")["env"]}
    assert env["KVROUTE_INDEX__REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-url", "key": "url"}
    cluster = render(
        None, "--set", "router.replicas=2,redis.external.url=redis://seed.example:6379,redis.external.cluster=true"
    )
    assert cluster.config()["index"]["redis_cluster"] is True
    assert "redis_cluster" not in r.config()["index"]


def test_several_replicas_without_redis_are_refused(helm: str) -> None:
    for flags in (
        "router.replicas=3",
        "router.enabled=false,epp.enabled=true,epp.replicas=2,inferencePool.selector.app=x",
    ):
        done = chart.helm("template", chart.RELEASE, str(chart.CHART), "--set", flags, check=False)
        assert done.returncode != 0 and "shared Redis index" in done.stderr, done.stderr


def test_bad_values_are_refused(helm: str) -> None:
    cases = {
        "router.replicaCount=3": "additional properties",  # values.schema.json: typos fail
        "config.admin_token=x": "admin.token",
        "epp.enabled=true,router.enabled=false": "inferencePool.selector",
        "discovery.kubernetes.enabled=true": "selector",
        "discovery.kubernetes.enabled=true,discovery.kubernetes.selector=app=x": "port",
        "router.enabled=false": "nothing to run",
        "discovery.dns.enabled=true,discovery.dns.port=null": "port",
        # `kvroute indexer` exits without static workers: the chart says so instead.
        "redis.enabled=true,config.workers=null,discovery.dns.enabled=true,discovery.dns.name=v": "indexer",
        "redis.enabled=true,redis.external.cluster=true": "redis.external.cluster needs",  # the chart's is one node
    }
    for flags, message in cases.items():
        done = chart.helm("template", chart.RELEASE, str(chart.CHART), "--set", flags, check=False)
        assert done.returncode != 0 and message in done.stderr, (flags, done.stderr)


def test_epp_mode(render: Any) -> None:
    r = render("epp")
    assert "kvroute" not in {d["metadata"]["name"] for d in r.all("Deployment")}  # no router
    epp = kvroute_container(r, "epp")
    assert epp["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert epp["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    service = r.one("Service", "kvroute-epp")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc-ext-proc"]["port"] == 9002 and ports["grpc-ext-proc"]["appProtocol"] == "http2"
    assert ports["http"]["port"] == 9090
    pool = r.one("InferencePool", "vllm-llama")
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app": "vllm-llama"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {
            "kind": "Service",
            "name": "kvroute-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        },
    }
    route = r.one("HTTPRoute", "vllm-llama")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    assert r.config()["port"] == 9090
    assert r.one("PodDisruptionBudget", "kvroute-epp")


def test_epp_discovery_follows_the_pool_selector(render: Any) -> None:
    r = render("epp", "--set", "discovery.kubernetes.enabled=true,discovery.kubernetes.port=8000")
    assert r.config()["discovery"]["kubernetes"]["selector"] == "app=vllm-llama"


def test_dashboard_configmap_carries_the_dashboard(render: Any) -> None:
    assert chart.CHART_DASHBOARD.read_bytes() == chart.DASHBOARD.read_bytes(), (
        "deploy/helm/kvroute/dashboards/kvroute.json differs from deploy/grafana/kvroute.json: "
        "run python -m tests.deploy.regenerate"
    )
    r = render(None, "--set", "grafanaDashboard.enabled=true")
    data = r.one("ConfigMap", "kvroute-dashboard")["data"]["kvroute.json"]
    assert json.loads(data) == json.loads(chart.DASHBOARD.read_text())
    assert "kvroute-dashboard" not in {c["metadata"]["name"] for c in render(None).all("ConfigMap")}


@pytest.mark.parametrize("manifest", chart.STATIC, ids=lambda m: m.path.name)
def test_static_manifests_are_the_chart_rendered(helm: str, manifest: chart.StaticManifest) -> None:
    assert manifest.path.read_text() == chart.static_text(manifest), (
        f"{manifest.path.relative_to(chart.ROOT)} is not helm template of ci/{manifest.mode}.yaml: "
        "run python -m tests.deploy.regenerate"
    )
