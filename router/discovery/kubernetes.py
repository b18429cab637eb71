"""Kubernetes discovery: the workers are the Ready pods a label selector picks in one namespace.

It selects pods the way an InferencePool does (namespace + label selector) and follows them with the
API's list+watch, the protocol every Kubernetes controller uses:

1. ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...&limit=500`` (following ``metadata.continue``)
   gives the complete set and the ``resourceVersion`` it is valid at;
2. ``GET ...?watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=N`` streams one JSON
   watch event per line (ADDED / MODIFIED / DELETED / BOOKMARK / ERROR) from there. A stream the server
   ends (``timeoutSeconds``) is resumed from the last version seen, bookmarks included, without a list;
3. ``410 Gone`` (an ERROR event whose Status has ``code: 410``, or an HTTP 410) means that version was
   compacted away: list again. Any other failure keeps the last set and retries with a bounded backoff.

A pod is a worker while it is ``Running``, its ``Ready`` condition is ``True``, it has a ``podIP`` and
no ``deletionTimestamp`` (terminating pods leave before they stop answering). Its id is the pod name
(stable for StatefulSets, unique in the namespace); its URL ``http://{podIP}:{port}``.

**Why httpx and not lightkube.** lightkube (installed) speaks to a plain-HTTP stand-in fine, and the
tests use it as an independent client to check the stand-in's wire format. But its public ``watch()``
cannot ask for bookmarks, and after a 410 it silently watches again "from now" instead of listing, which
drops the DELETED events of the gap: a set kept from it would keep dead pods. Driving list+watch
ourselves keeps those semantics explicit, bounds every line read from the stream, and uses the same
HTTP stack (httpx) as the rest of the router instead of lightkube 1.x's separate ``httpx2``. The auth
rules are the ones client-go and lightkube apply: in-cluster service account (``KUBERNETES_SERVICE_HOST``
/ ``_PORT``, the token re-read from its file on every request since the kubelet rotates it, the
cluster CA), or a kubeconfig file (server, CA file/data, ``insecure-skip-tls-verify``, ``token`` /
``tokenFile``, client certificate/key file/data, basic auth). ``exec`` and ``auth-provider`` credential
plugins are not supported (a clear error at start): outside a cluster, give a kubeconfig with a token.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import orjson
import yaml
from kvroute.config import KubernetesDiscoveryConfig, WorkerConfig
from kvroute.router.discovery.base import Backoff, ReportError, ReportWorkers, describe

log = logging.getLogger("kvroute.discovery")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_PORT = 8000
#: One watch event is one pod; real ones are a few KiB. A line beyond this is not the API server.
MAX_LINE_BYTES = 8 * 1024 * 1024
MAX_LIST_BYTES = 256 * 1024 * 1024


class KubeConfigError(ValueError):
    """No usable Kubernetes credentials (raised at construction: the router does not start)."""


class _Expired(Exception):
    """410 Gone: the resourceVersion is too old; the caller lists again."""


class _ApiError(Exception):
    pass


# ---------------------------------------------------------------------------------------------- auth


@dataclass(slots=True)
class KubeApi:
    """Where the API server is and how to authenticate to it."""

    server: str
    namespace: str = "default"
    verify: ssl.SSLContext | bool = True
    token: str | None = None
    token_file: str | None = None
    basic: tuple[str, str] | None = None
    source: str = field(default="explicit")

    def headers(self) -> dict[str, str]:
        """Fresh per request: a rotated service-account token is picked up without a restart."""
        headers = {"Accept": "application/json"}
        token = self.token
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip() or token
            except OSError as exc:
                log.warning("cannot read the token file %s: %s", self.token_file, describe(exc))
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif self.basic is not None:
            raw = base64.b64encode(f"{self.basic[0]}:{self.basic[1]}".encode()).decode()
            headers["Authorization"] = f"Basic {raw}"
        return headers


def _tls_context(
    *,
    ca_file: str | None = None,
    ca_data: bytes | None = None,
    insecure: bool = False,
    cert_file: str | None = None,
    key_file: str | None = None,
    cert_data: bytes | None = None,
    key_data: bytes | None = None,
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file, cadata=ca_data.decode() if ca_data else None)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert_data is not None or key_data is not None:
        # ssl only loads a key pair from files: a private temporary directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="kvroute-kube-") as tmp:
            if cert_data is not None:
                cert_file = os.path.join(tmp, "client.crt")
                Path(cert_file).write_bytes(cert_data)
            if key_data is not None:
                key_file = os.path.join(tmp, "client.key")
                Path(key_file).write_bytes(key_data)
            if cert_file:
                ctx.load_cert_chain(cert_file, key_file)
    elif cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def in_cluster_api(sa_dir: str = SERVICE_ACCOUNT_DIR, environ: Mapping[str, str] | None = None) -> KubeApi:
    """The pod's own service account, as every in-cluster client finds it."""
    env = os.environ if environ is None else environ
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise KubeConfigError("not in a cluster: KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT are not set")
    account = Path(sa_dir)
    token_file = account / "token"
    if not token_file.is_file():
        raise KubeConfigError(f"no service-account token at {token_file} (automountServiceAccountToken: false?)")
    ca = account / "ca.crt"
    namespace_file = account / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.is_file() else "default"
    host = f"[{host}]" if ":" in host else host
    try:
        verify: ssl.SSLContext | bool = _tls_context(ca_file=str(ca)) if ca.is_file() else True
    except (OSError, ssl.SSLError) as exc:
        raise KubeConfigError(f"cannot load the cluster CA {ca}: {describe(exc)}") from None
    return KubeApi(f"https://{host}:{port}", namespace, verify, token_file=str(token_file), source="in-cluster")


def _named(items: Any, name: str, what: str, path: str) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name and isinstance(item.get(what), dict):
            found: dict[str, Any] = item[what]
            return found
    raise KubeConfigError(f"{path}: no {what} named {name!r}")


def _b64(value: Any, what: str, path: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError:
        raise KubeConfigError(f"{path}: {what} is not base64") from None


def kubeconfig_api(path: str, context: str | None = None) -> KubeApi:
    """A kubeconfig file's current (or given) context."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {describe(exc)}") from None
    if not isinstance(data, dict):
        raise KubeConfigError(f"{path}: not a kubeconfig")
    name = context or data.get("current-context")
    if not name:
        raise KubeConfigError(f"{path}: no current-context")
    ctx = _named(data.get("contexts"), name, "context", path)
    cluster = _named(data.get("clusters"), str(ctx.get("cluster")), "cluster", path)
    user: dict[str, Any] = _named(data.get("users"), str(ctx["user"]), "user", path) if ctx.get("user") else {}
    base = Path(path).resolve().parent

    def rel(value: Any) -> str | None:
        return None if value is None else str(base / str(value))

    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise KubeConfigError(f"{path}: cluster {ctx.get('cluster')!r} has no http(s) server")
    for plugin in ("exec", "auth-provider"):
        if plugin in user:
            raise KubeConfigError(
                f"{path}: user {ctx.get('user')!r} uses an {plugin} credential plugin, which kvroute does not run; "
                "use a kubeconfig with a token (kubectl create token ...) or run in the cluster"
            )

    def inline(where: dict[str, Any], key: str) -> bytes | None:
        return _b64(where[key], key, path) if where.get(key) else None

    verify: ssl.SSLContext | bool = True
    if server.startswith("https://"):
        try:
            verify = _tls_context(
                ca_file=rel(cluster.get("certificate-authority")),
                ca_data=inline(cluster, "certificate-authority-data"),
                insecure=bool(cluster.get("insecure-skip-tls-verify")),
                cert_file=rel(user.get("client-certificate")),
                key_file=rel(user.get("client-key")),
                cert_data=inline(user, "client-certificate-data"),
                key_data=inline(user, "client-key-data"),
            )
        except (OSError, ssl.SSLError) as exc:
            raise KubeConfigError(f"{path}: cannot set up TLS: {describe(exc)}") from None
    basic = None
    if user.get("username") is not None and user.get("password") is not None:
        basic = (str(user["username"]), str(user["password"]))
    token = user.get("token")
    return KubeApi(
        server=server.rstrip("/"),
        namespace=str(ctx.get("namespace") or "default"),
        verify=verify,
        token=str(token) if token else None,
        token_file=rel(user.get("tokenFile")),
        basic=basic,
        source=f"kubeconfig {path}",
    )


def discover_api(
    kubeconfig: str | None = None, *, sa_dir: str = SERVICE_ACCOUNT_DIR, environ: Mapping[str, str] | None = None
) -> KubeApi:
    """The given kubeconfig; else the in-cluster service account; else ``$KUBECONFIG`` or ``~/.kube/config``."""
    env = os.environ if environ is None else environ
    if kubeconfig:
        return kubeconfig_api(kubeconfig)
    if env.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster_api(sa_dir, env)
    candidates = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    candidates.append(str(Path(env.get("HOME", str(Path.home()))) / ".kube" / "config"))
    for candidate in candidates:
        if Path(candidate).is_file():
            return kubeconfig_api(candidate)
    raise KubeConfigError(
        "no Kubernetes credentials: not in a cluster, no discovery.kubernetes.kubeconfig, "
        "no $KUBECONFIG or ~/.kube/config"
    )


# ---------------------------------------------------------------------------------------------- pods


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def pod_port(pod: Mapping[str, Any], config: KubernetesDiscoveryConfig) -> int | None:
    """The worker's HTTP port: the named container port when configured and declared, else ``port``."""
    if config.port_name:
        for container in _obj(pod.get("spec")).get("containers") or []:
            for port in _obj(container).get("ports") or []:
                port = _obj(port)
                number = port.get("containerPort")
                if port.get("name") == config.port_name and isinstance(number, int) and 0 < number < 65536:
                    return number
        return config.port  # None: the pod does not declare it and there is no fallback
    return config.port or DEFAULT_PORT


def pod_ready(pod: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the pod may take traffic, and why not."""
    meta, status = _obj(pod.get("metadata")), _obj(pod.get("status"))
    if meta.get("deletionTimestamp"):
        return False, "terminating"
    if status.get("phase") != "Running":
        return False, f"phase {status.get('phase')}"
    if not status.get("podIP"):
        return False, "no pod IP"
    for condition in status.get("conditions") or []:
        condition = _obj(condition)
        if condition.get("type") == "Ready":
            return (True, "ready") if condition.get("status") == "True" else (False, "not ready")
    return False, "no Ready condition"


def worker_from_pod(pod: Mapping[str, Any], config: KubernetesDiscoveryConfig) -> WorkerConfig | None:
    """The worker a pod stands for, or None while it must not take traffic."""
    ok, _ = pod_ready(pod)
    if not ok:
        return None
    name = _obj(pod.get("metadata")).get("name")
    ip = str(_obj(pod.get("status")).get("podIP"))
    port = pod_port(pod, config)
    if not isinstance(name, str) or not name or port is None:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return WorkerConfig(
        url=f"http://{host}:{port}",
        id=name,
        kv_events=f"tcp://{host}:{config.events_port}" if config.events_port else None,
        replay=f"tcp://{host}:{config.replay_port}" if config.replay_port else None,
    )


# ---------------------------------------------------------------------------------------------- source


class KubernetesSource:
    """A :class:`~kvroute.router.discovery.base.DiscoverySource` over the pods of a label selector."""

    def __init__(
        self,
        config: KubernetesDiscoveryConfig,
        *,
        name: str = "kubernetes",
        api: KubeApi | None = None,
        watch_timeout_s: int = 300,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 30.0,
        page_size: int = 500,
        backoff: Backoff | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.api = api or discover_api(config.kubeconfig)
        self.namespace = config.namespace or self.api.namespace
        self.url = f"{self.api.server}/api/v1/namespaces/{quote(self.namespace, safe='')}/pods"
        self.watch_timeout_s = watch_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.page_size = page_size
        self.backoff = backoff or Backoff(initial_s=0.5, max_s=30.0)
        #: pod name -> the worker it is (None while not ready): the complete picture, kept through failures.
        self._pods: dict[str, WorkerConfig | None] = {}
        self._reported: dict[str, WorkerConfig] | None = None
        self._unported: set[str] = set()
        log.info(
            "kubernetes discovery: pods %r in namespace %s via %s (%s)",
            config.selector,
            self.namespace,
            self.api.server,
            self.api.source,
        )

    @property
    def workers(self) -> dict[str, WorkerConfig]:
        return {name: cfg for name, cfg in self._pods.items() if cfg is not None}

    def _worker(self, pod: Mapping[str, Any]) -> WorkerConfig | None:
        name = _obj(pod.get("metadata")).get("name")
        try:
            cfg = worker_from_pod(pod, self.config)
        except ValueError as exc:  # e.g. a podIP that makes no URL: skip that pod, not the whole stream
            log.warning("pod %s cannot be a worker: %s", name, describe(exc))
            return None
        if cfg is None and pod_ready(pod)[0] and isinstance(name, str) and name not in self._unported:
            self._unported.add(name)
            log.warning(
                "pod %s declares no container port named %r and discovery.kubernetes.port is not set: skipped",
                name,
                self.config.port_name,
            )
        return cfg

    def _publish(self, report: ReportWorkers) -> None:
        workers = self.workers
        if workers != self._reported:
            self._reported = workers
            report(dict(workers))

    # ------------------------------------------------------------------ wire

    def _params(self, **extra: str) -> dict[str, str]:
        return {"labelSelector": self.config.selector, **extra}

    async def _fail(self, resp: httpx.Response) -> _ApiError:
        body = (await resp.aread())[: 64 * 1024]
        message = body.decode("utf-8", "replace")
        with contextlib.suppress(ValueError):
            status = orjson.loads(body)
            if isinstance(status, dict) and status.get("message"):
                message = str(status["message"])
        hint = " (RBAC: the service account needs get/list/watch on pods)" if resp.status_code in (401, 403) else ""
        return _ApiError(f"HTTP {resp.status_code}: {message[:500]}{hint}")

    async def _list(self, client: httpx.AsyncClient) -> str:
        """The complete set, replacing what was known; returns the resourceVersion to watch from."""
        pods: dict[str, WorkerConfig | None] = {}
        params = self._params(limit=str(self.page_size))
        total = 0
        while True:
            async with client.stream("GET", self.url, params=params, headers=self.api.headers()) as resp:
                if resp.status_code != 200:
                    raise await self._fail(resp)
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_LIST_BYTES:
                        raise _ApiError(f"a page of the pod list is larger than {MAX_LIST_BYTES} bytes")
            total += len(body)
            page = _obj(orjson.loads(body))
            if page.get("kind") not in (None, "PodList"):
                raise _ApiError(f"expected a PodList, got {page.get('kind')!r}")
            for pod in page.get("items") or []:
                pod = _obj(pod)
                name = _obj(pod.get("metadata")).get("name")
                if isinstance(name, str):
                    pods[name] = self._worker(pod)
            meta = _obj(page.get("metadata"))
            token = meta.get("continue")
            if not token:
                version = meta.get("resourceVersion")
                if not isinstance(version, str) or not version:
                    raise _ApiError("the pod list has no metadata.resourceVersion")
                break
            params = self._params(limit=str(self.page_size), **{"continue": str(token)})
        self._pods = pods
        self.backoff.reset()
        log.debug("listed %d pods (%d bytes) at resourceVersion %s", len(pods), total, version)
        return version

    def _event(self, line: bytes, version: str) -> tuple[str, bool]:
        """Apply one watch event; returns the version to resume from and whether the set may have changed."""
        event = _obj(orjson.loads(line))
        kind, obj = event.get("type"), _obj(event.get("object"))
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message") or obj.get("reason") or "watch error"
            if code == 410 or obj.get("reason") in ("Expired", "Gone"):
                raise _Expired(str(message))
            raise _ApiError(f"watch error {code}: {message}")
        meta = _obj(obj.get("metadata"))
        new_version = meta.get("resourceVersion")
        if isinstance(new_version, str) and new_version:
            version = new_version
        if kind == "BOOKMARK":
            return version, False
        name = meta.get("name")
        if not isinstance(name, str) or (meta.get("namespace") not in (None, self.namespace)):
            return version, False
        if kind in ("ADDED", "MODIFIED"):
            self._pods[name] = self._worker(obj)
        elif kind == "DELETED":
            self._pods.pop(name, None)
            self._unported.discard(name)
        else:
            log.debug("ignoring watch event type %r", kind)
            return version, False
        return version, True

    async def _watch(self, client: httpx.AsyncClient, version: str, report: ReportWorkers) -> tuple[str, int]:
        """Follow changes from ``version`` until the server ends the stream; returns (version, events)."""
        params = self._params(
            watch="1",
            resourceVersion=version,
            allowWatchBookmarks="true",
            timeoutSeconds=str(self.watch_timeout_s),
        )
        # The server ends the stream after timeoutSeconds: silence well past that is a dead connection.
        timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s, read=self.watch_timeout_s + 30)
        events = 0
        async with client.stream("GET", self.url, params=params, headers=self.api.headers(), timeout=timeout) as resp:
            if resp.status_code == 410:
                raise _Expired("HTTP 410")
            if resp.status_code != 200:
                raise await self._fail(resp)
            self.backoff.reset()
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                changed = False
                while (end := buf.find(b"\n")) >= 0:
                    line = bytes(buf[:end]).strip()
                    del buf[: end + 1]
                    if line:
                        version, did = self._event(line, version)
                        changed |= did
                        events += 1
                if changed:
                    self._publish(report)
                if len(buf) > MAX_LINE_BYTES:
                    raise _ApiError(f"a watch event longer than {MAX_LINE_BYTES} bytes")
            if buf.strip():
                version, did = self._event(bytes(buf).strip(), version)
                events += 1
                if did:
                    self._publish(report)
        return version, events

    async def run(self, report: ReportWorkers, error: ReportError) -> None:
        timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s)
        async with httpx.AsyncClient(verify=self.api.verify, timeout=timeout, trust_env=False) as client:
            version: str | None = None
            loop = asyncio.get_running_loop()
            listed_at = float("-inf")
            while True:
                try:
                    if version is None:
                        version = await self._list(client)
                        listed_at = loop.time()
                        self._publish(report)
                    started = loop.time()
                    version, events = await self._watch(client, version, report)
                    if events == 0 and loop.time() - started < 1.0:
                        await asyncio.sleep(self.backoff.next())  # a server that closes at once: no hot loop
                except _Expired as exc:
                    log.info("watch of pods %r expired (%s): listing again", self.config.selector, exc)
                    version = None
                    if loop.time() - listed_at < 1.0:  # expired right after a list: do not spin on it
                        await asyncio.sleep(self.backoff.next())
                except asyncio.CancelledError:
                    raise
                except (httpx.HTTPError, _ApiError, ValueError, OSError) as exc:
                    what = "listing" if version is None else "watching"
                    error(f"{what} pods {self.config.selector!r} in {self.namespace}: {describe(exc)}")
                    if isinstance(exc, ValueError):
                        version = None  # an answer that does not parse: start again from a fresh list
                    await asyncio.sleep(self.backoff.next())
