"""``approx_text``: SGLang router's cache-aware scheme, implemented as published, as a baseline.

No KV events: the router keeps a per-worker approximate radix tree of the *text* it routed
(:class:`~kvroute.policies.text_tree.TextTree`). Per request:

1. If the pool is imbalanced — ``max_load - min_load > balance_abs_threshold`` **and**
   ``max_load > balance_rel_threshold x min_load`` — go to the least-loaded worker.
2. Else match the text in the tree; if the best match rate (matched chars ÷ text chars) exceeds
   ``cache_threshold``, go to that worker; else to the worker with the smallest tree (most free cache).
3. Insert the text under the chosen worker; trim trees above ``max_tree_size`` characters (LRU leaves).

Published defaults (sgl-router / SGLang model gateway CLI): ``cache_threshold`` 0.3,
``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5, ``eviction_interval`` 120 s,
``max_tree_size`` 2^26. SGLang evicts on a timer; this policy, being free of clocks, trims on insert.
In P/D pools the prefill worker is chosen this way and the decode worker by least load.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import Policy, RoutePlan, RouteRequest, WorkerView, split_roles
from kvroute.policies.least_load import least_loaded
from kvroute.policies.options import as_float, as_int, refuse_unknown
from kvroute.policies.registry import register_policy
from kvroute.policies.text_tree import TextTree


@register_policy
class ApproxTextPolicy(Policy):
    name = "approx_text"
    needs_text = True

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        known = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold", "max_tree_size")
        refuse_unknown(self.name, options, known)
        self.cache_threshold = as_float(options.get("cache_threshold", 0.3), "cache_threshold")
        self.balance_abs = as_float(options.get("balance_abs_threshold", 64), "balance_abs_threshold")
        self.balance_rel = as_float(options.get("balance_rel_threshold", 1.5), "balance_rel_threshold")
        self.max_tree_size = as_int(options.get("max_tree_size", 1 << 26), "max_tree_size")
        if not 0 <= self.cache_threshold <= 1 or self.max_tree_size < 1:
            raise ValueError("cache_threshold must be in [0, 1] and max_tree_size >= 1")
        self.tree = TextTree()

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The plan, then the text goes into the chosen worker's tree (SGLang's insert on route)."""
        prefill, decode = split_roles(workers)
        text = request.prompt_text or ""
        p, reason = self._prefill(prefill, text)
        if text:
            self.tree.insert(text, p.id)
            self.tree.evict(p.id, self.max_tree_size)
        d = p if p.can_decode else least_loaded(decode)
        return RoutePlan(prefill=p.id, decode=d.id, reason=reason, policy=self.name)

    def explain(self, request: RouteRequest, workers: Sequence[WorkerView]) -> RoutePlan:
        """The plan :meth:`choose` would return; the tree is matched, not written."""
        prefill, decode = split_roles(workers)
        p, reason = self._prefill(prefill, request.prompt_text or "")
        d = p if p.can_decode else least_loaded(decode)
        return RoutePlan(prefill=p.id, decode=d.id, reason=reason, policy=self.name)

    def _prefill(self, prefill: list[WorkerView], text: str) -> tuple[WorkerView, str]:
        """The prefill worker for ``text`` and why (reads the tree only)."""
        loads = [w.load for w in prefill]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return least_loaded(prefill), f"imbalanced (loads {lo}..{hi}): least loaded"
        ids = {w.id for w in prefill}
        matches = {t: n for t, n in self.tree.match(text).items() if t in ids}
        best = max(sorted(matches), key=lambda t: matches[t], default=None)
        rate = matches[best] / len(text) if best is not None and text else 0.0
        if best is not None and rate > self.cache_threshold:
            return next(w for w in prefill if w.id == best), f"text match {rate:.0%} > {self.cache_threshold:.0%}"
        p = min(prefill, key=lambda w: (self.tree.size(w.id), w.load, w.id))
        return p, f"text match {rate:.0%}: smallest tree"

    def forget_worker(self, worker_id: str) -> None:
        """Drop a worker's tree (call when it leaves the pool)."""
        self.tree.remove_tenant(worker_id)
