"""The load side of the ``kvaware`` cost model: how long a request waits on a worker before its prefill.

:class:`QueueModel` keeps, per worker, the requests this policy sent there and has not heard back about
(send time, predicted service seconds, KV blocks held), and learns how long a request holds its blocks.
From that and the worker's load signals it answers two terms of the TTFT estimate: the work ahead (a FIFO
replay) and the wait for free KV blocks. It keeps, per decode worker, the split plans handed to it whose
KV has not arrived yet (a prefill that decoder runs itself holds their first tokens). It also weighs a
predicted hit by the chance it is still there, which falls as the worker's KV cache fills. The cost terms
themselves live in :mod:`kvroute.policies.cost`.

Kept apart from the cost terms because it is the policy's only per-worker learnt state: ``choose`` feeds it
(:meth:`QueueModel.sent`), outcomes drain it (:meth:`QueueModel.finished`), and ``explain`` reads it
without a trace (``dry_run``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Generic, TypeVar

from kvroute.policies.base import RouteOutcome, RouteRequest, WorkerView
from kvroute.policies.calibration import Calibrator
from kvroute.policies.cost_params import CostParams

#: One request sent and not yet reported: (sent at, predicted service seconds, KV blocks it holds).
Pending = tuple[float, float, int]
#: Requests sent to a worker, replayed: (how many, when the worker is free of them, KV blocks they hold).
Replay = tuple[int, float, int]
NO_REPLAY: Replay = (0, float("-inf"), 0)


def replayed(entries: Iterable[Pending]) -> Replay:
    """``entries`` (oldest first) replayed as a FIFO queue: each starts when sent or when the one before
    it is done, whichever is later."""
    count = blocks = 0
    free_at = float("-inf")
    for sent, service, held in entries:
        free_at = max(free_at, sent) + service
        blocks += held
        count += 1
    return count, free_at, blocks


#: Block keys whose recent users :class:`QueueModel` counts (least recently used first out).
MAX_PREFIX_KEYS = 8192

K = TypeVar("K")


class DecayedCounts(Generic[K]):
    """Events per key lately, each counting ``exp(-age / window_s)``. Kept as ``log(count) + at /
    window_s``: comparing keys (:meth:`order`) needs no clock and no decay each time it is read. With
    ``max_keys``, the least recently counted keys are forgotten past it."""

    __slots__ = ("_orders", "max_keys", "window_s")

    def __init__(self, window_s: float, max_keys: int | None = None) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._orders: OrderedDict[K, float] = OrderedDict()

    def count(self, key: K, now: float) -> float:
        order = self._orders.get(key)
        return 0.0 if order is None else math.exp(order - now / self.window_s)

    def add(self, key: K, now: float, weight: float = 1.0) -> None:
        orders = self._orders
        order = math.log(self.count(key, now) + weight) + now / self.window_s
        orders.pop(key, None)
        orders[key] = order
        if self.max_keys is not None:
            while len(orders) > self.max_keys:
                orders.popitem(last=False)

    def order(self, key: K) -> float:
        """A value that orders keys as :meth:`count` does at any one time (its log plus a constant)."""
        return self._orders.get(key, -math.inf)


class QueueModel:
    """Work ahead and KV-space wait per worker; see the module docstring."""

    __slots__ = (
        "_calibrator",
        "_decode_step_s",
        "_default_hold_s",
        "_handoffs",
        "_hold_s",
        "_kv_pressure_decay",
        "_max_pending",
        "_mean_blocks",
        "_parallelism",
        "_pending",
        "_prefix_users",
        "_replays",
        "_still_there",
        "_traffic",
        "_traffic_blocks_share",
        "_unknown_running_weight",
    )

    def __init__(self, params: CostParams, calibrator: Calibrator) -> None:
        self._calibrator = calibrator
        self._max_pending = params.max_pending
        self._parallelism = params.queue_parallelism
        self._unknown_running_weight = params.unknown_running_weight
        self._decode_step_s = params.decode_queue_s_per_request
        self._default_hold_s = params.default_hold_s
        self._still_there = params.still_there
        self._kv_pressure_decay = params.kv_pressure_decay
        self._traffic_blocks_share = params.traffic_blocks_share
        #: EWMA of the KV blocks a routed request adds (the scale of ``traffic_blocks_share``'s weights).
        self._mean_blocks = 0.0
        #: Per worker: the requests this policy sent there, oldest first, until their outcome is observed:
        #: a virtual FIFO queue for the queue term, and the blocks they hold for the KV-space term.
        self._pending: dict[str, OrderedDict[str, Pending]] = {}
        #: Per decode worker: split plans handed to it, request id -> when their KV should arrive (the plan's
        #: prediction), until their outcome is observed (see :meth:`handoffs_due`).
        self._handoffs: dict[str, OrderedDict[str, float]] = {}
        #: Per worker: its pending requests replayed (see :meth:`_replay`), until they change.
        self._replays: dict[str, Replay] = {}
        #: Per worker: EWMA of how long a request holds its KV blocks (sent -> outcome observed).
        self._hold_s: dict[str, float] = {}
        #: Per worker: the requests sent there lately (``traffic_window_s``).
        self._traffic: DecayedCounts[str] = DecayedCounts(params.traffic_window_s)
        #: Per block key: the requests whose deepest cached block on their best holder it was (see
        #: :meth:`prefix_users`).
        self._prefix_users: DecayedCounts[int] = DecayedCounts(params.traffic_window_s, MAX_PREFIX_KEYS)

    # -- what choose and observe tell it ---------------------------------------------------------------

    def sent(self, worker_id: str, request_id: str, service_s: float, blocks: int) -> None:
        """``choose`` sent a request to ``worker_id``: it joins that worker's replay."""
        now = self._calibrator.now()
        self._traffic.add(worker_id, now, self._traffic_weight(blocks))
        pending = self._pending.setdefault(worker_id, OrderedDict())
        pending[request_id] = (now, service_s, blocks)
        while len(pending) > self._max_pending:
            pending.popitem(last=False)
        self._replays.pop(worker_id, None)

    def _traffic_weight(self, blocks: int) -> float:
        """One request's count in the traffic: 1, or (``traffic_blocks_share``) partly its blocks relative to
        the mean request's, so the counts keep the scale of requests whatever the prompts' length."""
        share = self._traffic_blocks_share
        if share <= 0:
            return 1.0
        blocks = max(1, blocks)
        mean = self._mean_blocks
        mean = blocks if mean <= 0 else mean + 0.05 * (blocks - mean)
        self._mean_blocks = mean
        return (1.0 - share) + share * blocks / mean

    def handing_off(self, decoder: str, request_id: str, arrives_in_s: float) -> None:
        """``choose`` split a request: its KV reaches ``decoder`` in about ``arrives_in_s``."""
        due = self._handoffs.setdefault(decoder, OrderedDict())
        due[request_id] = self._calibrator.now() + arrives_in_s
        while len(due) > self._max_pending:
            due.popitem(last=False)

    def handoffs_due(self, decoder: str) -> tuple[float, ...]:
        """Seconds from now until each handoff to ``decoder`` still on its way arrives (its prefill leg is
        running): the decoder takes its decode leg then, and a prefill of its own running at that moment
        holds that request's first token until it ends. Handoffs past their predicted arrival are at the
        decoder (its load counts them) or late; either way not counted here."""
        due = self._handoffs.get(decoder)
        if not due:
            return ()
        now = self._calibrator.now()
        return tuple(at - now for at in due.values() if at > now)

    def finished(self, outcome: RouteOutcome) -> None:
        """The request's outcome came back: it leaves the replay (and the handoffs due at its decoder), and
        its hold time is learnt."""
        plan = outcome.plan
        if plan.decode != plan.prefill:
            due = self._handoffs.get(plan.decode)
            if due is not None:
                due.pop(outcome.request_id, None)
        pending = self._pending.get(outcome.plan.prefill)
        entry = pending.pop(outcome.request_id, None) if pending is not None else None
        if entry is not None:
            self._replays.pop(outcome.plan.prefill, None)
        if entry is not None and outcome.ok:
            cal = self._calibrator
            held = max(0.0, cal.now() - entry[0])
            old = self._hold_s.get(outcome.plan.prefill)
            alpha = cal.alpha
            self._hold_s[outcome.plan.prefill] = held if old is None else (1 - alpha) * old + alpha * held

    def prefix_users(self, key: int) -> float:
        """Requests lately (each counts ``exp(-age / traffic_window_s)``) whose longest cached prefix ended
        at block ``key`` on its best holder: a session's own history has one at a time, a popular shared
        prefix (a group's system prompt) many. Read by the affinity penalty (``CostParams.affinity_weight``)."""
        return self._prefix_users.count(key, self._calibrator.now())

    def used_prefix(self, key: int) -> None:
        """A request was routed whose longest cached prefix ended at block ``key``."""
        self._prefix_users.add(key, self._calibrator.now())

    def traffic(self, worker_id: str, now: float) -> float:
        """Requests sent to ``worker_id`` lately: each counts ``exp(-age / traffic_window_s)``."""
        return self._traffic.count(worker_id, now)

    def traffic_order(self, worker_id: str) -> float:
        """A value that orders workers as :meth:`traffic` does at any one time (its log plus a constant):
        the tie-break between equally ranked plans (see ``CostParams.traffic_window_s``)."""
        return self._traffic.order(worker_id)

    # -- the terms -------------------------------------------------------------------------------------

    def waits(
        self, w: WorkerView, request: RouteRequest, gpu_cached_tokens: int, dry_run: bool = False
    ) -> tuple[float, float]:
        """``(queue including the KV-space wait, the KV-space wait)`` on ``w`` for this request.

        Only the newest ``w.load`` remembered requests are still outstanding (older ones finished, their
        outcome not yet reported): ``choose`` forgets the rest for good, a ``dry_run`` only skips them.
        """
        pending = self._pending.get(w.id)
        replay = NO_REPLAY
        if pending:
            gone = len(pending) - w.load
            if gone <= 0:
                replay = self._replay(w.id, pending)
            elif dry_run:
                replay = replayed(list(pending.values())[gone:])
            else:
                for _ in range(gone):
                    pending.popitem(last=False)
                self._replays.pop(w.id, None)
                replay = self._replay(w.id, pending)
        queue = self._queue_s(w, replay)
        kv_wait = self._kv_wait_s(w, self.blocks_needed(request, gpu_cached_tokens), replay[2])
        return queue + kv_wait, kv_wait

    def _replay(self, worker_id: str, pending: OrderedDict[str, Pending]) -> Replay:
        """:func:`replayed` of ``worker_id``'s pending requests, kept until they change: every ``choose``
        reads every worker's, and at 32 clients a worker holds a dozen of them."""
        replay = self._replays.get(worker_id)
        if replay is None:
            replay = self._replays[worker_id] = replayed(pending.values())
        return replay

    def _queue_s(self, w: WorkerView, replay: Replay) -> float:
        """Work ahead of a new request on ``w``.

        The requests this policy sent there and has not heard back about (``replay``: replayed as a FIFO
        queue from the times they were sent with their predicted service times) say when the worker will
        be free. Work it cannot replay counts by calibrated service time: in full for requests the router
        has in flight or the engine reports *waiting*, at ``unknown_running_weight`` for the rest of the
        engine's *running* count. Only what the engine held beyond our own in-flight requests *at the time
        of its scrape* is foreign (``WorkerView.foreign``): against our count now, our requests finished
        since the scrape counted as foreign work (a scrape a second old, 16 req/s of 2-second streams:
        9-30 ms of queue predicted on workers that answered a cached request in 2 ms). Most running
        requests are decoding, which delays a new prefill little (continuous batching), and counting them
        as full prefills sent sessions away from the worker holding their history for a queue that was
        not there. On a decode-role worker what
        runs, the router's in-flight P/D decode legs included, is decoding: a prefill there waits for them
        as a decode leg does (``decode_queue_s_per_request`` each), not as for prefills (counted as full
        prefills, 12 decode legs priced a decoder's own 150-token prefill at +240 ms, out of every plan).
        """
        cal = self._calibrator
        known = 0.0
        own, free_at, _ = replay
        if own:
            known = max(0.0, free_at - cal.now())
        sent_unknown = max(0, w.inflight - own)
        foreign = w.foreign
        waiting = min(foreign, w.waiting)
        running = foreign - waiting
        if w.role == "decode":  # decodes (P/D legs): a new prefill joins their next step, as a decode leg does
            decodes = running + sent_unknown
            return (known + waiting * cal.service_time(w.id)) / self._parallelism + decodes * self._decode_step_s
        unknown = sent_unknown + waiting + running * self._unknown_running_weight
        return (known + unknown * cal.service_time(w.id)) / self._parallelism

    @staticmethod
    def blocks_needed(request: RouteRequest, gpu_cached_tokens: int) -> int:
        """New KV blocks the engine must allocate to admit the request: prompt + output, minus GPU hits."""
        block = max(1, request.block_size)
        total = -(-((request.prompt_tokens or 0) + (request.max_tokens or 0)) // block)
        return max(0, total - gpu_cached_tokens // block)

    def _kv_wait_s(self, w: WorkerView, needed: int, own: int) -> float:
        """Expected wait until ``needed`` KV blocks are free on ``w`` (0 when they already are).

        Used blocks are the larger of the scraped usage and what this policy's outstanding requests hold
        (``own``; the scrape lags). A request holds its blocks for about ``hold`` seconds, released at spread-out
        times, so freeing a shortfall of ``s`` of ``used`` blocks takes about ``hold x s / used``. vLLM's
        scheduler admits first come, first served once blocks are free: without this term a worker
        holding a session's history looks free while its cache cannot take the next long turn.
        """
        capacity = w.kv_blocks
        if not capacity or needed <= 0 or needed > capacity:  # unknown size, or the engine will refuse
            return 0.0
        used = min(float(capacity), max(w.kv_usage * capacity, float(own)))
        free = capacity - used
        if needed <= free or used <= 0:
            return 0.0
        hold = self._hold_s.get(w.id, self._default_hold_s)
        return hold * min(needed - free, used) / used

    def still_there(self, worker: WorkerView | None, tier: str, ratio: float) -> float:
        """Probability that a hit the index reports in ``tier`` is still there (``ratio``: the calibrated
        hit ratio, times the tier's factor from per-source ground truth); GPU hits fade as the worker's KV
        usage passes 90 % (eviction takes them first)."""
        odds = self._still_there.get(tier, 1.0) * ratio * self._calibrator.source_factor(tier)
        return self.still_there_on(worker, tier, odds)

    def tier_odds(self, ratio: float) -> dict[str, float]:
        """Per tier, :meth:`still_there` before the worker's KV pressure and the clamp: the part that is the
        same for every worker, so a request computes it once rather than once per worker and tier."""
        factor = self._calibrator.source_factor
        return {tier: p * ratio * factor(tier) for tier, p in self._still_there.items()}

    def still_there_on(self, worker: WorkerView | None, tier: str, odds: float) -> float:
        """:meth:`still_there` from the tier's :meth:`tier_odds` entry."""
        prob = odds
        if tier == "GPU" and worker is not None:
            pressure = max(0.0, min(1.0, (worker.kv_usage - 0.9) / 0.1))
            prob *= 1.0 - self._kv_pressure_decay * pressure
        return max(0.0, min(1.0, prob))
