"""Routing policies: (request facts, index view, worker load) -> RoutePlan. Pure and synchronous.

The contract (:mod:`~kvroute.policies.base`): the router builds a :class:`RouteRequest` and the healthy
:class:`WorkerView` s, then

* ``choose(request, workers)`` returns the :class:`RoutePlan` to carry out (``NoWorkerError`` if none fits)
  and may update the policy's state (round-robin turn, text trees, the queue replay);
* ``explain(request, workers)`` is the same decision as a dry run for ``/admin/route/explain``: the plan
  ``choose`` would return now, with every candidate the policy weighed, and no state changed;
* ``observe(outcome)`` reports a :class:`RouteOutcome` after the answer, for policies that learn.

``needs_index`` / ``needs_text`` say what the router must gather; ``for_pool`` builds a policy from the
pool's config facts (:class:`~kvroute.policies.base.PoolContext`, per-model
:class:`~kvroute.policies.base.ModelFigures`).

Modules: ``base`` (the contract and its data), ``registry`` (policies by name), ``options`` (reading
config option values), the baselines ``round_robin``, ``least_load``, ``prefix`` (llm-d) and
``approx_text`` (SGLang, over ``text_tree``), and ``kvaware``, the cost model, in parts: ``cost`` (the
cost terms and the ranking), ``candidates`` (which plans are weighed, how one is shown), ``load_model``
(queue and KV-space wait, the per-worker state behind them), ``cost_params`` (its options),
``calibration`` (what it learns from outcomes), ``tier_policy`` (the per-request KV tiers).

Adding a policy: subclass :class:`Policy`, set ``name``, implement ``choose`` (and ``explain`` when the
policy keeps state that does not deep-copy cheaply: the default dry run is ``choose`` on a deep copy),
then either decorate it with :func:`register_policy` or, from another package, expose the class in the
``kvroute.policies`` entry-point group; ``create_policy(name, pool, **options)`` finds it either way.

Dependencies point one way: ``kvroute.router`` -> ``kvroute.policies`` -> ``kvroute.indexer``, and any of
them -> the bottom layer (``kvroute.config``, ``kvroute.vocabulary``, ``kvroute.tasks``). Nothing here
imports the router, and nothing here does I/O.
"""

from kvroute.policies.base import (
    CandidatePlan,
    ModelFigures,
    Policy,
    PoolContext,
    RouteOutcome,
    RoutePlan,
    RouteRequest,
    WorkerView,
)
from kvroute.policies.registry import available_policies, create_policy, register_policy

__all__ = [
    "CandidatePlan",
    "ModelFigures",
    "Policy",
    "PoolContext",
    "RouteOutcome",
    "RoutePlan",
    "RouteRequest",
    "WorkerView",
    "available_policies",
    "create_policy",
    "register_policy",
]
