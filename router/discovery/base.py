"""The discovery interface: sources that see workers, and the sink the reconciler applies changes to.

A source only ever reports its *complete* current set (never deltas): a missed or duplicated report then
cannot leave a stale worker behind, and the reconciler can compare sets from several sources directly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

from kvroute.config import WorkerConfig

#: Called by a source with every worker it currently sees, keyed by worker id, whenever that set changes.
ReportWorkers = Callable[[Mapping[str, WorkerConfig]], None]
#: Called by a source when one attempt failed (it keeps its last set and retries on its own).
ReportError = Callable[[str], None]


@runtime_checkable
class DiscoverySource(Protocol):
    """Something that watches where workers are (the Kubernetes API, DNS, ...)."""

    #: Short and stable: the ``source`` label of the metrics, e.g. ``kubernetes``.
    name: str

    async def run(self, report: ReportWorkers, error: ReportError) -> None:
        """Run until cancelled: call ``report`` with the complete set at start and after each change.

        On a failure (API outage, DNS timeout) call ``error`` and retry with a bounded backoff, without
        reporting: the last set stays in force, so an outage never empties the pool."""
        ...


class WorkerSink(Protocol):
    """Where the reconciler applies its decisions (the worker registry, through :class:`RegistrySink`)."""

    async def add(self, worker: WorkerConfig) -> None:
        """Start routing to ``worker``. May raise (e.g. the id is taken): the reconciler retries later."""
        ...

    async def remove(self, worker_id: str) -> None:
        """Stop routing to the worker; a worker that is already gone is not an error."""
        ...


class Backoff:
    """Exponential retry delays with jitter, bounded by ``max_s``; :meth:`reset` after a success.

    The jitter keeps many router replicas from hammering a recovering API server in lockstep."""

    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0, factor: float = 2.0, jitter: float = 0.2) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self.jitter = jitter
        self._next = initial_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * self.factor, self.max_s)
        return min(self.max_s, delay * (1.0 + random.uniform(-self.jitter, self.jitter)))

    def reset(self) -> None:
        self._next = self.initial_s


def describe(exc: BaseException) -> str:
    """One line for logs and error reports: the type and the message, never a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
