"""Round-robin: the simplest baseline, blind to cache and load."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvroute.policies.base import Policy, RoutePlan, RouteRequest, WorkerView, split_roles
from kvroute.policies.registry import register_policy


@register_policy
class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        prefill, decode = split_roles(workers)
        n = next(self._counter)
        p = prefill[n % len(prefill)]
        d = p if p.can_decode else decode[n % len(decode)]
        return RoutePlan(prefill=p.id, decode=d.id, reason="round robin", policy=self.name)
