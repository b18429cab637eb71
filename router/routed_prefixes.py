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

Noting costs a few dict operations and one slice of the key list (its checkpoint keys); a note is only
counted into the per-worker key sets when a lookup (:meth:`RoutedPrefixes.held`) could see it. Most notes
never are: a request usually gets its first bytes back, and its note forgotten, before the next lookup
of a request sharing its prefix, so they cost no per-key bookkeeping at all.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Where a note's prefix went: (model, worker).
Pair = tuple[str, str]


@dataclass(slots=True, frozen=True)
class _Note:
    expires: float
    pair: Pair
    #: The prefix's checkpoint keys (see :meth:`RoutedPrefixes._checkpoint_keys`), never empty.
    keys: tuple[int, ...]


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
        #: Every live note, oldest first.
        self._notes: OrderedDict[str, _Note] = OrderedDict()
        #: Live notes not yet counted in ``_count`` (counted by the next :meth:`held`), oldest first.
        self._uncounted: dict[str, _Note] = {}
        #: Per (model, worker) with a counted note: checkpoint key -> how many counted notes hold it.
        self._count: dict[Pair, dict[int, int]] = {}

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        return len(self._notes)

    def _checkpoint_keys(self, keys: Sequence[int]) -> tuple[int, ...]:
        """The keys a note keeps: every ``stride``-th block's and the last one's (``keys`` not empty)."""
        stride = self.stride
        points = tuple(keys[stride - 1 :: stride])
        return points if len(keys) % stride == 0 else (*points, keys[-1])

    def note(self, request_id: str, model: str, worker_id: str, keys: Sequence[int]) -> None:
        """``request_id`` went to ``worker_id``: its prefix counts as held there for ``ttl_s``."""
        if not self.enabled or not keys:
            return
        self._expire()
        self.forget(request_id)
        note = _Note(self._now() + self.ttl_s, (model, worker_id), self._checkpoint_keys(keys))
        self._notes[request_id] = note
        self._uncounted[request_id] = note
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
        self._count_notes()
        points = self._checkpoint_keys(keys)
        out: dict[str, int] = {}
        for (of_model, worker), counts in self._count.items():
            if of_model != model:
                continue
            # Markers chain: the longest run of routed checkpoints from the start is the routed prefix.
            run = 0
            for key in points:
                if key not in counts:
                    break
                run += 1
            if run:  # the run's last checkpoint is block run x stride, or the prompt's last block
                out[worker] = min(run * self.stride, len(keys))
        return out

    def _count_notes(self) -> None:
        """Count the notes made since the last lookup into their worker's key set."""
        for note in self._uncounted.values():
            counts = self._count.setdefault(note.pair, {})
            for key in note.keys:
                counts[key] = counts.get(key, 0) + 1
        self._uncounted.clear()

    def _expire(self) -> None:
        now = self._now()
        while self._notes:
            request_id, note = next(iter(self._notes.items()))
            if note.expires > now:
                break
            self._notes.popitem(last=False)
            self._drop(request_id, note)

    def _drop(self, request_id: str, note: _Note) -> None:
        """``note`` (of ``request_id``) is gone: uncount it, unless it never was counted."""
        if self._uncounted.pop(request_id, None) is not None:
            return
        counts = self._count[note.pair]
        for key in note.keys:
            left = counts[key] - 1
            if left > 0:
                counts[key] = left
            else:
                del counts[key]
        if not counts:
            del self._count[note.pair]
