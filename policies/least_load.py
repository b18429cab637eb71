"""Least-load: the worker with the least outstanding work (in-flight or running, plus waiting)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import Policy, RoutePlan, RouteRequest, WorkerView, split_roles
from kvroute.policies.registry import register_policy


def least_loaded(workers: Sequence[WorkerView]) -> WorkerView:
    """Ties go to the lower KV usage, then the id, so the choice is deterministic."""
    return min(workers, key=lambda w: (w.load, w.kv_usage, w.id))


@register_policy
class LeastLoad(Policy):
    name = "least_load"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        prefill, decode = split_roles(workers)
        p = least_loaded(prefill)
        d = p if p.can_decode else least_loaded(decode)
        return RoutePlan(prefill=p.id, decode=d.id, reason=f"least load ({p.load} outstanding)", policy=self.name)

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """Stateless: the dry run is the decision itself."""
        return self.choose(request, workers)
