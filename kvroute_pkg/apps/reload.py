"""Config reload without a restart: SIGHUP, or the config file changing on disk.

What a reload changes live: the static worker list (added, removed, changed workers), the policy and its
options, the pool's and the models' figures (a new policy is built from them and swapped in; requests
already decided finish on their plan), the models' tokenizers, the admin token, the debug-header switch.
What needs a restart (addresses, ports, the index backend, the HTTP client, body limits) is reported in
the log and left as it is. An invalid file is refused with the field named and the old config kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

from kvroute.config import ConfigError, RouterConfig, load_config
from kvroute.policies import available_policies, create_policy
from kvroute.router.state import RouterState
from kvroute.router.warmup import preload_tokenizers
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from prometheus_client import Counter

log = logging.getLogger("kvroute.reload")

#: Settings a running router cannot change; a reload that changes them says so.
RESTART_ONLY = (
    "host",
    "port",
    "index",
    "http_client",
    "max_body_bytes",
    "connect_timeout_s",
    "read_timeout_s",
    "processes",
)


class ConfigReloader:
    """A service of the router state: reloads ``path`` (with the process's flag ``overrides``) on SIGHUP and
    when the file's modification time changes (checked every ``interval_s``)."""

    def __init__(
        self, state: RouterState, path: str | os.PathLike[str], overrides: dict[str, Any], interval_s: float = 2.0
    ) -> None:
        self.state = state
        self.path = Path(path)
        self.overrides = overrides
        self.interval_s = interval_s
        self.reloads = Counter(
            "kvroute_config_reloads_total",
            "Config reloads, by outcome (applied, invalid, unchanged)",
            ["outcome"],
            registry=state.metrics.registry,
        )
        self._mtime = self._stat()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def _stat(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: file watch only
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload("SIGHUP")))
        self._task = asyncio.create_task(self._watch(), name="config-watch")

    async def stop(self) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _watch(self) -> None:
        while True:
            raise_if_cancel_swallowed()
            await asyncio.sleep(self.interval_s)
            mtime = self._stat()
            if mtime is not None and mtime != self._mtime:
                self._mtime = mtime
                await self.reload("file changed")

    async def reload(self, why: str) -> bool:
        """Load and apply; False (old config kept) when the new one is invalid."""
        async with self._lock:
            try:
                new = load_config(self.path, self.overrides)
                if new.policy not in available_policies():
                    raise ConfigError(f"invalid configuration: policy: unknown policy {new.policy!r}")
                changes = await self.apply(new)
            except (ConfigError, ValueError, TypeError) as exc:
                self.reloads.labels("invalid").inc()
                log.error("config reload (%s) refused, the running config is kept: %s", why, exc)
                return False
            self.reloads.labels("applied" if changes else "unchanged").inc()
            log.info("config reloaded (%s): %s", why, "; ".join(changes) or "no change")
            return True

    async def apply(self, new: RouterConfig) -> list[str]:
        """Carry the differences out; returns what changed, in words."""
        state, old = self.state, self.state.config
        changes: list[str] = []
        for name in RESTART_ONLY:
            if getattr(old, name) != getattr(new, name):
                log.warning("config reload: %s changed; it takes effect after a restart", name)
        # Build the new policy first: if it refuses its options nothing has been touched yet.
        policy_changed = (old.policy, old.policy_options, old.pool, old.models) != (
            new.policy,
            new.policy_options,
            new.pool,
            new.models,
        )
        if policy_changed:
            from kvroute.apps.build import pool_context

            policy = create_policy(new.policy, pool_context(new), **new.policy_options)
        registry = state.registry
        old_workers = {w.worker_id: w for w in old.workers}
        new_workers = {w.worker_id: w for w in new.workers}
        for worker_id, cfg in old_workers.items():
            if new_workers.get(worker_id) != cfg and registry.get(worker_id) is not None:
                registry.remove(worker_id)
                changes.append(f"worker {worker_id} removed" if worker_id not in new_workers else "")
        for worker_id, cfg in new_workers.items():
            if old_workers.get(worker_id) != cfg:
                await registry.add(cfg)
                changes.append(f"worker {worker_id} {'changed' if worker_id in old_workers else 'added'}")
        if policy_changed:
            state.flow.policy = policy
            state.flow.outcomes.relabel(policy.name or type(policy).__name__)
            changes.append(f"policy {new.policy} rebuilt with the new options and figures")
        retokenized = state.tokenizers.update_models(new.models)
        registry.adapters = new.adapter_bases()
        if retokenized:
            await preload_tokenizers(state.tokenizers, retokenized)
            changes.append(f"tokenizers of {', '.join(retokenized)}")
        if old.admin_token != new.admin_token:
            changes.append("admin token")
        state.flow.allow_debug = new.debug_headers
        state.config = new
        return [c for c in changes if c]
