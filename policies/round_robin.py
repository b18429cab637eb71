"""Round-robin: the simplest baseline, blind to cache and load."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import Policy, RoutePlan, RouteRequest, WorkerView, split_roles
from kvroute.policies.registry import register_policy


@register_policy
class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        #: Decisions made so far: the next one takes worker ``turn mod n``.
        self._turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        prefill, decode = split_roles(workers)
        n = self._turn
        self._turn = n + 1
        p = prefill[n % len(prefill)]
        d = p if p.can_decode else decode[n % len(decode)]
        return RoutePlan(prefill=p.id, decode=d.id, reason="round robin", policy=self.name)

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The plan of the worker whose turn it is; the turn does not advance."""
        prefill, decode = split_roles(workers)
        n = self._turn
        p = prefill[n % len(prefill)]
        d = p if p.can_decode else decode[n % len(decode)]
        return RoutePlan(prefill=p.id, decode=d.id, reason="round robin", policy=self.name)
