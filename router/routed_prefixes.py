"""Prefixes the router has just sent somewhere, counted as cached there until the engine's events catch up.

A burst of requests sharing a new prefix (a fresh system prompt, a repository read by several agents) finds
nothing in the index: the first request's blocks are announced only once its prefill has run. Routed by
load alone, the burst spreads and every worker computes the same prefix. So the router remembers, for a few
seconds, which worker it sent each prefix to and lets the policy see it as a GPU hit there: the burst lands
on one worker, queued behind the request that computes the prefix (the queue model already counts that
wait), and the others stay free. The real events take over: vLLM publishes a block's event at the engine
step that computes it, before the first token goes out, so the note is forgotten when the request's first
bytes come back (or it fails); from then on the index alone says what is there, evictions included. A
note whose request never answers expires after ``ttl_s``.

Memory is bounded: a note keeps one key every ``stride`` blocks (block keys chain, so a key stands for the
whole prefix before it) and at most ``max_notes`` notes live at once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: One note: when it expires, where the prefix went, the model, and its checkpoint keys.
Marker = tuple[str, str, int]  # (model, worker, key)


@dataclass(slots=True, frozen=True)
class _Note:
    expires: float
    markers: tuple[Marker, ...]


class RoutedPrefixes:
    """Recently routed prefixes per worker; see the module docstring."""

    def __init__(
        self,
        ttl_s: float = 30.0,
        stride: int = 16,
        max_notes: int = 20_000,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0 or stride < 1 or max_notes < 1:
            raise ValueError("ttl_s must be >= 0, stride and max_notes >= 1")
        self.ttl_s = ttl_s
        self.stride = stride
        self.max_notes = max_notes
        self._now = now
        self._notes: OrderedDict[str, _Note] = OrderedDict()
        self._count: dict[Marker, int] = {}
        self._workers: dict[tuple[str, str], int] = {}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._notes)

    def _checkpoints(self, n: int) -> list[int]:
        """Block positions a note keeps: every ``stride``-th block and the last one."""
        points = list(range(self.stride - 1, n, self.stride))
        if n and (not points or points[-1] != n - 1):
            points.append(n - 1)
        return points

    def note(self, request_id: str, model: str, worker_id: str, keys: Sequence[int]) -> None:
        """``request_id`` went to ``worker_id``: its prefix counts as held there for ``ttl_s``."""
        if not self.enabled or not keys:
            return
        self._expire()
        self.forget(request_id)
        markers = tuple((model, worker_id, keys[i]) for i in self._checkpoints(len(keys)))
        self._notes[request_id] = _Note(self._now() + self.ttl_s, markers)
        for marker in markers:
            self._count[marker] = self._count.get(marker, 0) + 1
        pair = (model, worker_id)
        self._workers[pair] = self._workers.get(pair, 0) + 1
        while len(self._notes) > self.max_notes:
            self._drop(*self._notes.popitem(last=False))

    def forget(self, request_id: str) -> None:
        """The request failed or was sent elsewhere: its prefix will not be computed there."""
        note = self._notes.pop(request_id, None)
        if note is not None:
            self._drop(request_id, note)

    def held(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """Per worker with a live note for ``model``, the blocks of ``keys``' prefix routed there (0s left out)."""
        if not self._notes or not keys:
            return {}
        self._expire()
        points = self._checkpoints(len(keys))
        out: dict[str, int] = {}
        for of_model, worker in list(self._workers):
            if of_model != model:
                continue
            # Markers chain: the longest run of routed checkpoints from the start is the routed prefix.
            blocks = 0
            for i in points:
                if (model, worker, keys[i]) not in self._count:
                    break
                blocks = i + 1
            if blocks:
                out[worker] = blocks
        return out

    def _expire(self) -> None:
        now = self._now()
        while self._notes:
            request_id, note = next(iter(self._notes.items()))
            if note.expires > now:
                break
            self._notes.popitem(last=False)
            self._drop(request_id, note)

    def _drop(self, request_id: str, note: _Note) -> None:
        for marker in note.markers:
            left = self._count.get(marker, 0) - 1
            if left > 0:
                self._count[marker] = left
            else:
                self._count.pop(marker, None)
        if note.markers:
            model, worker, _ = note.markers[0]
            left = self._workers.get((model, worker), 0) - 1
            if left > 0:
                self._workers[(model, worker)] = left
            else:
                self._workers.pop((model, worker), None)
