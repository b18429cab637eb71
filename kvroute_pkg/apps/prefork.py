"""``kvroute serve --processes N``: one parent supervising N serving processes on one port.

The parent checks the config, reserves the port (a bound but not listening ``SO_REUSEPORT`` socket: port
0 becomes a concrete port, and it stays this router's while children restart) and starts N children,
each a whole router (``python -m kvroute.apps.cli serve``, :mod:`kvroute.apps.serving_process`) listening
on its own ``SO_REUSEPORT`` socket of that port: the kernel spreads new connections evenly over them.
The parent forwards SIGHUP (config reload) to every child, restarts a child that dies (backing off
while one keeps dying at start) and on SIGTERM or SIGINT stops them all, then exits.

Shared state (docs/design-notes.md, "Serving across cores"): with the Redis backend child 0 alone
subscribes and writes the index, the others read it; with the memory backend every child subscribes to
every worker (connect mode) and keeps its own identical index. Metrics are file-backed
(``PROMETHEUS_MULTIPROC_DIR``, a private folder per parent) so any child's ``/metrics`` is the aggregate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvroute.config import RouterConfig

log = logging.getLogger("kvroute.prefork")

#: Where the parent puts a child's spec. Not ``KVROUTE_*``: those are config overrides.
CHILD_ENV = "_KVROUTE_SERVING_PROCESS"
#: prometheus_client's multi-process folder variable (read by every child at import).
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Pending connections per child socket (uvicorn's default).
BACKLOG = 2048
#: How long children get to finish their requests after SIGTERM before they are killed.
STOP_TIMEOUT_S = 30.0
#: Restart delays: from the first, doubling while a child keeps dying young, up to the last.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
#: A child that ran this long died of something else than its start: restarted after the first delay.
STABLE_AFTER_S = 10.0


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """A child's place among its siblings, and the overrides its config (and every reload) loads with."""

    index: int
    count: int
    parent_pid: int
    overrides: dict[str, Any] = field(default_factory=dict)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ChildSpec | None:
        """The spec this process was started with, None in a process the user started."""
        raw = (os.environ if environ is None else environ).get(CHILD_ENV)
        if not raw:
            return None
        data = json.loads(raw)
        return cls(int(data["index"]), int(data["count"]), int(data["parent_pid"]), dict(data["overrides"]))


def bind_shared(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket on (host, port) with ``SO_REUSEPORT``, the way every process of one ``kvroute serve``
    shares its port. ``listen=False`` only reserves the port (the kernel hands connections to listening
    sockets only). ``IPPROTO_TCP`` explicitly, so the asyncio loop disables Nagle on its connections (it does
    only for sockets it knows to be TCP; uvloop always does)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def reserve_port(host: str, port: int) -> socket.socket:
    """The parent's hold on the port. A first bind without ``SO_REUSEPORT`` fails when anything listens
    there already (with it, a second router of the same user would silently share the port)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    return bind_shared(host, port, listen=False)


def refusal(config: RouterConfig, *, serve: bool = True) -> str | None:
    """Why ``config`` cannot run in several processes (None: it can)."""
    if config.processes <= 1:
        return None
    if not serve:
        return "processes > 1 is for kvroute serve; run one process per Endpoint Picker replica"
    index = config.index
    if index.subscribe and index.events_bind and index.backend == "memory":
        return (
            "index.events_bind with processes > 1 needs index.backend: redis (one process binds it and "
            "writes the shared index); with the memory backend give each worker's kv_events endpoint "
            "(vLLM binds, every process connects)"
        )
    return None


def cautions(config: RouterConfig) -> list[str]:
    """What a user of several processes should know about this config (logged at start)."""
    notes = [
        f"{config.processes} serving processes: load estimates and in-flight counts are per process; workers "
        "are added and removed through the config file (SIGHUP) or discovery, not POST /admin/workers"
    ]
    if config.index.subscribe and config.index.backend == "memory":
        notes.append(
            "memory index: every process subscribes to every worker and keeps its own copy "
            f"({config.processes}x the index memory and event decoding; index.backend: redis shares one)"
        )
    if config.pool.kv_protocol == "nixl" and config.index.backend == "memory":
        notes.append(
            "conversation reuse is per process with the memory backend (a turn served by another process "
            "recomputes); index.backend: redis shares the conversation store"
        )
    return notes


def child_overrides(config: RouterConfig, overrides: Mapping[str, Any], index: int, port: int) -> dict[str, Any]:
    """The overrides child ``index`` loads its config with: the parent's flags, the reserved port, and with
    Redis, ``index.subscribe: false`` for all children but the first (one writer, the others read)."""
    out: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    out["port"] = port
    out["processes"] = config.processes
    if config.index.backend == "redis" and config.index.subscribe and index > 0:
        out["index"] = {**(out.get("index") or {}), "subscribe": False}
    return out


@dataclass(slots=True)
class _Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    delay_s: float = 0.0


class Supervisor:
    """Starts, watches and stops the children (:meth:`run` until SIGTERM or SIGINT)."""

    def __init__(
        self,
        config: RouterConfig,
        config_path: str | None,
        overrides: Mapping[str, Any],
        *,
        reload_path: str | None = None,
        stop_timeout_s: float = STOP_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = dict(overrides)
        #: The file SIGHUP reloads (--config or $KVROUTE_CONFIG); without one SIGHUP is ignored.
        self.reload_path = reload_path
        self.stop_timeout_s = stop_timeout_s
        self.slots = [_Slot(i) for i in range(config.processes)]
        self.port = config.port
        self.metrics_dir = ""
        self._stop = asyncio.Event()

    def command(self) -> list[str]:
        """How a child is started: the same CLI, the same config file (flags travel in its spec)."""
        argv = [sys.executable, "-m", "kvroute.apps.cli", "serve"]
        return [*argv, "--config", self.config_path] if self.config_path else argv

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            reserved = reserve_port(self.config.host, self.config.port)
        except OSError as exc:
            log.error("cannot bind %s:%d: %s", self.config.host, self.config.port, exc.strerror or exc)
            return 1
        self.port = reserved.getsockname()[1]
        self.metrics_dir = tempfile.mkdtemp(prefix="kvroute-metrics-")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        for note in cautions(self.config):
            log.info("%s", note)
        keepers = [asyncio.create_task(self._keep(slot), name=f"serving-process-{slot.index}") for slot in self.slots]
        log.info(
            "kvroute serve: %d processes on http://%s:%d (parent pid %d)",
            len(self.slots),
            self.config.host,
            self.port,
            os.getpid(),
        )
        try:
            await self._stop.wait()
            log.info("stopping %d serving processes", len(self.slots))
            await self._stop_children(keepers)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            reserved.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return 0

    def _reload(self) -> None:
        if not self.reload_path:
            log.warning("SIGHUP: no config file to reload (start with --config)")
            return
        log.info("SIGHUP: reloading %s in every serving process", self.reload_path)
        self._signal_all(signal.SIGHUP)

    def _signal_all(self, sig: signal.Signals) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    def _env(self, slot: _Slot) -> dict[str, str]:
        spec = ChildSpec(
            slot.index,
            len(self.slots),
            os.getpid(),
            child_overrides(self.config, self.overrides, slot.index, self.port),
        )
        return {**os.environ, CHILD_ENV: spec.to_env(), METRICS_ENV: self.metrics_dir}

    async def _keep(self, slot: _Slot) -> None:
        """Run child ``slot`` until the parent stops, restarting it when it exits."""
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            started = loop.time()
            try:
                # Its own process group: a terminal's Ctrl-C reaches the parent only, which stops the
                # children once (a second SIGINT would make uvicorn drop its open requests).
                slot.proc = await asyncio.create_subprocess_exec(*self.command(), env=self._env(slot), process_group=0)
            except OSError as exc:
                log.error("cannot start serving process %d: %s", slot.index, exc)
                code: int | str = "no start"
            else:
                if self._stop.is_set():  # stopped while it was being started
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.send_signal(signal.SIGTERM)
                code = await slot.proc.wait()
                self._forget(slot.proc.pid)
            if self._stop.is_set():
                return
            lived = loop.time() - started
            slot.delay_s = (
                RESTART_MIN_S if lived >= STABLE_AFTER_S else min(RESTART_MAX_S, max(RESTART_MIN_S, 2 * slot.delay_s))
            )
            log.warning(
                "serving process %d exited (%s) after %.1f s: restarting in %.1f s",
                slot.index,
                code,
                lived,
                slot.delay_s,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), slot.delay_s)

    def _forget(self, pid: int) -> None:
        """A dead child's live gauges leave the aggregate (its counters stay: they happened)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]

    async def _stop_children(self, keepers: Sequence[asyncio.Task[None]]) -> None:
        self._signal_all(signal.SIGTERM)
        _, running = await asyncio.wait(keepers, timeout=self.stop_timeout_s)
        if running:
            log.warning("serving processes still running %.0f s after SIGTERM: killed", self.stop_timeout_s)
            self._signal_all(signal.SIGKILL)
            await asyncio.wait(keepers)


def supervise(
    config: RouterConfig, config_path: str | None, overrides: Mapping[str, Any], reload_path: str | None
) -> int:
    """Run the parent of ``config.processes`` serving processes until stopped; the exit code."""
    return asyncio.run(Supervisor(config, config_path, overrides, reload_path=reload_path).run())
