"""Routing policies: (request facts, index view, worker load) -> RoutePlan. Pure and synchronous."""

from kvroute.policies.base import (
    CandidatePlan,
    Policy,
    RouteOutcome,
    RoutePlan,
    RouteRequest,
    WorkerView,
)
from kvroute.policies.registry import available_policies, create_policy, register_policy

__all__ = [
    "CandidatePlan",
    "Policy",
    "RouteOutcome",
    "RoutePlan",
    "RouteRequest",
    "WorkerView",
    "available_policies",
    "create_policy",
    "register_policy",
]
