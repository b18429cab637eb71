"""A stand-in for the Kubernetes API server's pod list+watch, for the discovery tests.

No real cluster (nor kind, k3s or envtest binaries) is available where these tests run, so this aiohttp
server on 127.0.0.1 speaks the part of the API the Kubernetes source uses, on the wire as the real one:

- ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...[&limit=N&continue=T]``: a ``PodList`` (``kind``,
  ``apiVersion``, ``metadata.resourceVersion``, ``metadata.continue`` when more pages follow; items
  without ``kind``/``apiVersion``, like the real server's), sorted by name;
- ``...&watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=N``: a chunked
  ``application/json`` stream of one watch event per line, ``{"type": ..., "object": ...}``, with every
  change after RV (synthetic ADDED events for the current pods when RV is absent or "0"), BOOKMARK events
  (objects with only ``kind``, ``apiVersion`` and ``metadata.resourceVersion``) when asked for, and the end
  of the stream after ``timeoutSeconds``. A pod whose labels stop (or start) matching the selector is
  DELETED (ADDED) for that watch, as the real watch cache does;
- a version older than the last compaction: HTTP 200 and one ERROR event carrying a ``Status`` with
  ``code: 410, reason: Expired`` (what kube-apiserver sends), or with ``gone_as_http`` an HTTP 410 Status;
  an expired ``continue`` token: HTTP 410 Status;
- bearer-token auth (401 ``Unauthorized`` Status), RBAC refusal (403 ``Forbidden`` Status), and faults:
  ``expire_watches()``, ``drop_watches()`` (connections cut mid-stream), ``corrupt_watches()`` (a line
  that is not JSON), ``stop()``/``start()`` on the same port (an outage: connection refused).

Simplification: list pages are cut from the current state rather than a consistent snapshot at the
first page's version. Validation: tests/discovery/test_kube_apiserver.py checks every object it serves
against the official OpenAPI schemas (``kubernetes-validate``, strict) and lists + watches it with
lightkube, an independent Kubernetes client, including its decoding of ERROR 410 events.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

Pod = dict[str, Any]


def _now() -> str:
    return "2026-09-20T10:00:00Z"


def make_pod(
    name: str,
    *,
    ip: str = "127.0.0.1",
    port: int = 8000,
    port_name: str = "http",
    ready: bool = True,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    namespace: str = "default",
) -> Pod:
    """A pod as the API server returns it (the fields a vLLM Deployment's pod really has, trimmed)."""
    ready_text = "True" if ready else "False"
    pod: Pod = {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "creationTimestamp": _now(),
            "labels": dict(labels if labels is not None else {"app": "vllm"}),
        },
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.32.0",
                    "args": ["--model", "meta-llama/Llama-3.1-8B-Instruct"],
                    "ports": [
                        {"name": port_name, "containerPort": port, "protocol": "TCP"},
                        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
                    ],
                }
            ],
            "nodeName": "node-1",
            "restartPolicy": "Always",
            "serviceAccountName": "default",
        },
        "status": {"phase": phase, "qosClass": "BestEffort", "conditions": []},
    }
    status = pod["status"]
    if phase in ("Running", "Succeeded", "Failed"):
        status.update(
            podIP=ip,
            podIPs=[{"ip": ip}],
            hostIP="10.1.0.1",
            startTime=_now(),
            containerStatuses=[
                {
                    "name": "vllm",
                    "ready": ready,
                    "restartCount": 0,
                    "image": "vllm/vllm-openai:v0.32.0",
                    "imageID": "docker.io/vllm/vllm-openai@sha256:" + "0" * 64,
                    "started": True,
                    "state": {"running": {"startedAt": _now()}},
                }
            ],
        )
    status["conditions"] = [
        {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": _now()},
        {"type": "Initialized", "status": "True", "lastProbeTime": None, "lastTransitionTime": _now()},
        {"type": "ContainersReady", "status": ready_text, "lastProbeTime": None, "lastTransitionTime": _now()},
        {"type": "Ready", "status": ready_text, "lastProbeTime": None, "lastTransitionTime": _now()},
    ]
    return pod


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    """A meta/v1 Status, the body of every API error (and of ERROR watch events)."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


# ---------------------------------------------------------------------------------------------- selectors

_REQ = re.compile(r"^\s*(!?)([A-Za-z0-9./_-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def parse_selector(text: str) -> list[tuple[str, str, set[str]]]:
    """Label selector requirements: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a)``, ``k``, ``!k``."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    requirements = []
    for part in parts:
        m = _REQ.match(part)
        if m is None:
            raise ValueError(f"unable to parse requirement: {part!r}")
        neg, key, op, value, setop, values = m.groups()
        if neg:
            requirements.append(("!", key, set()))
        elif op:
            requirements.append(("!=" if op == "!=" else "=", key, {value}))
        elif setop:
            requirements.append((setop, key, {v.strip() for v in values.split(",") if v.strip()}))
        else:
            requirements.append(("exists", key, set()))
    return requirements


def matches(requirements: list[tuple[str, str, set[str]]], labels: dict[str, str]) -> bool:
    for op, key, values in requirements:
        present, value = key in labels, labels.get(key)
        ok = {
            "=": present and value in values,
            "!=": not present or value not in values,
            "in": present and value in values,
            "notin": not present or value not in values,
            "exists": present,
            "!": not present,
        }[op]
        if not ok:
            return False
    return True


# ---------------------------------------------------------------------------------------------- server


@dataclass
class _Change:
    version: int
    type: str  # ADDED / MODIFIED / DELETED
    obj: Pod
    old: Pod | None


@dataclass(eq=False)
class _Watcher:
    namespace: str
    selector: list[tuple[str, str, set[str]]]
    queue: asyncio.Queue[_Change | str] = field(default_factory=asyncio.Queue)


class KubeApiServer:
    """The stand-in. Mutate pods with :meth:`add`, :meth:`update`, :meth:`terminate`, :meth:`delete`."""

    def __init__(
        self,
        *,
        token: str | None = None,
        bookmark_interval_s: float = 0.2,
        gone_as_http: bool = False,
        ssl_context: Any = None,
    ) -> None:
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.gone_as_http = gone_as_http
        self.ssl_context = ssl_context
        self.forbidden = False
        self.pods: dict[tuple[str, str], Pod] = {}
        self.history: list[_Change] = []
        self.version = itertools.count(100)
        self.current = next(self.version)
        self.compacted = 0
        self.watchers: set[_Watcher] = set()
        #: Every request received: {"path", "query", "authorization"}.
        self.requests: list[dict[str, Any]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.ssl_context, reuse_address=True)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """An outage: open watches are cut and new connections refused until :meth:`start` (same port)."""
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ state changes

    def _bump(self) -> int:
        self.current = next(self.version)
        return self.current

    def _record(self, kind: str, obj: Pod, old: Pod | None) -> None:
        change = _Change(self.current, kind, copy.deepcopy(obj), copy.deepcopy(old) if old else None)
        self.history.append(change)
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(change)

    def add(self, pod: Pod) -> Pod:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        assert key not in self.pods, f"pod {key} exists"
        meta["resourceVersion"] = str(self._bump())
        self.pods[key] = pod
        self._record("ADDED", pod, None)
        return pod

    def update(self, name: str, namespace: str = "default", **changes: Any) -> Pod:
        """``ready=``, ``phase=``, ``labels=``, ``ip=``: a MODIFIED event like the kubelet's status updates."""
        old = copy.deepcopy(self.pods[(namespace, name)])
        pod = self.pods[(namespace, name)]
        if "labels" in changes:
            pod["metadata"]["labels"] = dict(changes["labels"])
        if "ready" in changes or "phase" in changes or "ip" in changes:
            spec_port = pod["spec"]["containers"][0]["ports"][0]
            fresh = make_pod(
                name,
                ip=changes.get("ip", pod["status"].get("podIP", "127.0.0.1")),
                port=spec_port["containerPort"],
                port_name=spec_port["name"],
                ready=changes.get("ready", self._ready(pod)),
                phase=changes.get("phase", pod["status"]["phase"]),
                namespace=namespace,
            )
            pod["status"] = fresh["status"]
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self._record("MODIFIED", pod, old)
        return pod

    @staticmethod
    def _ready(pod: Pod) -> bool:
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))

    def terminate(self, name: str, namespace: str = "default") -> Pod:
        """``kubectl delete`` with a grace period: first a MODIFIED event with ``deletionTimestamp``."""
        old = copy.deepcopy(self.pods[(namespace, name)])
        pod = self.pods[(namespace, name)]
        pod["metadata"]["deletionTimestamp"] = _now()
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self._record("MODIFIED", pod, old)
        return pod

    def delete(self, name: str, namespace: str = "default") -> None:
        pod = self.pods.pop((namespace, name))
        pod["metadata"]["resourceVersion"] = str(self._bump())
        self._record("DELETED", pod, None)

    def compact(self) -> None:
        """etcd compaction: every version up to now is gone (watches from them get 410)."""
        self.compacted = self.current
        self.history = [c for c in self.history if c.version > self.compacted]

    def expire_watches(self) -> None:
        """Open watches receive ERROR 410 (their version fell out of the watch cache)."""
        self.compact()
        for watcher in list(self.watchers):
            watcher.queue.put_nowait("expire")

    def corrupt_watches(self) -> None:
        """Open watches receive a line that is not JSON (a broken proxy in between, say)."""
        for watcher in list(self.watchers):
            watcher.queue.put_nowait("garbage")

    def drop_watches(self) -> None:
        for watcher in list(self.watchers):
            watcher.queue.put_nowait("drop")

    def list_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if not r["query"].get("watch")]

    def watch_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["query"].get("watch")]

    # ------------------------------------------------------------------ wire

    @staticmethod
    def _error(code: int, reason: str, message: str) -> web.Response:
        return web.Response(
            status=code, body=orjson.dumps(status_object(code, reason, message)), content_type="application/json"
        )

    @staticmethod
    def _typed(pod: Pod) -> Pod:
        return {"kind": "Pod", "apiVersion": "v1", **pod}

    def _for_watcher(self, change: _Change, namespace: str, selector: list[tuple[str, str, set[str]]]) -> str | None:
        """What a watch with this selector sees of a change (label changes become ADDED / DELETED)."""
        if change.obj["metadata"]["namespace"] != namespace:
            return None
        now = matches(selector, change.obj["metadata"].get("labels", {}))
        before = change.old is not None and matches(selector, change.old["metadata"].get("labels", {}))
        if change.type == "MODIFIED":
            if now and before:
                return "MODIFIED"
            return "ADDED" if now else ("DELETED" if before else None)
        return change.type if now else None

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(
            {"path": request.path, "query": query, "authorization": request.headers.get("Authorization")}
        )
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(401, "Unauthorized", "Unauthorized")
        namespace = request.match_info["namespace"]
        if self.forbidden:
            return self._error(
                403,
                "Forbidden",
                f'pods is forbidden: User "system:serviceaccount:{namespace}:kvroute" cannot list resource '
                f'"pods" in API group "" in the namespace "{namespace}"',
            )
        try:
            selector = parse_selector(query.get("labelSelector", ""))
        except ValueError as exc:
            return self._error(400, "BadRequest", str(exc))
        if query.get("watch") in ("1", "true"):
            return await self._watch(request, namespace, selector, query)
        return self._list(namespace, selector, query)

    def _list(self, namespace: str, selector: list[tuple[str, str, set[str]]], query: dict[str, str]) -> web.Response:
        items = [
            copy.deepcopy(pod)
            for (ns, name), pod in sorted(self.pods.items())
            if ns == namespace and matches(selector, pod["metadata"].get("labels", {}))
        ]
        version, start = self.current, 0
        if query.get("continue"):
            token = orjson.loads(base64.urlsafe_b64decode(query["continue"]))
            version, start = int(token["rv"]), int(token["start"])
            if version < self.compacted:
                return self._error(
                    410, "Expired", "The provided continue parameter is too old to display a consistent list result."
                )
        limit = int(query.get("limit") or 0)
        page = items[start : start + limit] if limit else items[start:]
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        if limit and start + limit < len(items):
            raw = orjson.dumps({"rv": version, "start": start + limit})
            metadata["continue"] = base64.urlsafe_b64encode(raw).decode()
            metadata["remainingItemCount"] = len(items) - start - limit
        body = {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _watch(
        self, request: web.Request, namespace: str, selector: list[tuple[str, str, set[str]]], query: dict[str, str]
    ) -> web.StreamResponse:
        since_raw = query.get("resourceVersion") or "0"
        since = int(since_raw)
        too_old = since_raw != "0" and since < self.compacted
        if too_old and self.gone_as_http:
            return self._error(410, "Expired", f"too old resource version: {since} ({self.compacted})")
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await resp.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")

        if too_old:
            await send("ERROR", status_object(410, "Expired", f"too old resource version: {since} ({self.compacted})"))
            await resp.write_eof()
            return resp
        watcher = _Watcher(namespace, selector)
        self.watchers.add(watcher)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(query.get("timeoutSeconds") or 1800)
        try:
            if since_raw == "0":
                for (ns, _), pod in sorted(self.pods.items()):
                    if ns == namespace and matches(selector, pod["metadata"].get("labels", {})):
                        await send("ADDED", self._typed(copy.deepcopy(pod)))
            else:
                for change in [c for c in self.history if c.version > since]:
                    kind = self._for_watcher(change, namespace, selector)
                    if kind is not None:
                        await send(kind, self._typed(change.obj))
                    # Already queued live as well: skip those when they come out of the queue.
                    since = change.version
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(min(self.bookmark_interval_s, left)):
                        item = await watcher.queue.get()
                except TimeoutError:
                    if bookmarks:
                        bookmark = {
                            "kind": "Pod",
                            "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(self.current)},
                        }
                        await send("BOOKMARK", bookmark)
                    continue
                if item == "drop":
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                if item == "garbage":
                    await resp.write(b'{"type": "MODIFIED", "object": {"metadata": \n')
                    continue
                if item == "expire":
                    await send("ERROR", status_object(410, "Expired", "too old resource version"))
                    break
                assert isinstance(item, _Change)
                if item.version <= since:
                    continue
                kind = self._for_watcher(item, namespace, selector)
                if kind is not None:
                    await send(kind, self._typed(item.obj))
            with contextlib.suppress(ConnectionError):
                await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.watchers.discard(watcher)
        return resp
