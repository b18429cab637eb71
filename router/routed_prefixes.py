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
whole prefix before it) and at most ``max_notes`` notes live at once. Checkpoints alone would round a shared
prefix down to a multiple of ``stride`` blocks: a group's 752-token system prompt counted as 512 tokens
routed, so a request queued behind the one computing it was predicted 240 tokens of prefill (26 ms) it
never ran, and its holder looked that much slower than it was. So a note also refers to its request's
whole key list (the list the lookup made, not a copy) while the keys so referred stay under
``max_chain_keys``, and the routed prefix is followed block by block past its last checkpoint.

Noting costs a few dict operations and one slice of the key list (its checkpoint keys); a note is only
counted into the per-worker key sets when a lookup (:meth:`RoutedPrefixes.held`) could see it. Most notes
never are: a request usually gets its first bytes back, and its note forgotten, before the next lookup
of a request sharing its prefix, so they cost no per-key bookkeeping at all.

A note also says which part of its prefix the worker is still computing (what it was not known to hold
when the request went there): those blocks are a local hit for a request queued behind it there, but not
yet something a peer can fetch. A P2P fetch of them waits out the whole prefill on the source, which made
a 905-token prompt take 155-189 ms where computing it afresh took 107 (design note "A prefix being
computed is not a source yet").
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
    #: Index in ``keys`` of the first checkpoint the worker is computing (``len(keys)``: none).
    computing_from: int
    #: The request's whole key list (None past ``max_chain_keys``) and how many of its blocks were ready.
    chain: Sequence[int] | None = None
    ready: int = 0


class RoutedPrefixes:
    """Recently routed prefixes per worker; see the module docstring."""

    def __init__(
        self,
        ttl_s: float = 30.0,
        stride: int = 16,
        max_notes: int = 20_000,
        now: Callable[[], float] = time.monotonic,
        max_chain_keys: int = 2_000_000,
    ) -> None:
        if ttl_s < 0 or stride < 1 or max_notes < 1 or max_chain_keys < 0:
            raise ValueError("ttl_s must be >= 0, stride and max_notes >= 1, max_chain_keys >= 0")
        self.ttl_s = ttl_s
        self.stride = stride
        self.max_notes = max_notes
        self.max_chain_keys = max_chain_keys
        #: Keys referred to by live notes' chains (bounded by ``max_chain_keys``).
        self.chain_keys = 0
        self._now = now
        #: Every live note, oldest first.
        self._notes: OrderedDict[str, _Note] = OrderedDict()
        #: Live notes not yet counted in ``_count`` (counted by the next :meth:`held`), oldest first.
        self._uncounted: dict[str, _Note] = {}
        #: Per (model, worker) with a counted note: checkpoint key -> how many counted notes hold it.
        self._count: dict[Pair, dict[int, int]] = {}
        #: The same for the checkpoints a counted note's worker is still computing.
        self._computing: dict[Pair, dict[int, int]] = {}
        #: Per (model, worker): checkpoint key -> the latest counted note with a chain holding it.
        self._chains: dict[Pair, dict[int, _Note]] = {}

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

    def note(self, request_id: str, model: str, worker_id: str, keys: Sequence[int], ready: int = 0) -> None:
        """``request_id`` went to ``worker_id``: its prefix counts as held there for ``ttl_s``. ``ready``:
        the blocks of it the worker was known to hold already; it computes the rest."""
        if not self.enabled or not keys:
            return
        self._expire()
        self.forget(request_id)
        points = self._checkpoint_keys(keys)
        # Checkpoint i stands for the blocks up to (i + 1) x stride: computing once it reaches past ``ready``.
        computing_from = len(points) if ready >= len(keys) else max(0, ready) // self.stride
        chain = keys if self.chain_keys + len(keys) <= self.max_chain_keys else None
        if chain is not None:
            self.chain_keys += len(keys)
        note = _Note(self._now() + self.ttl_s, (model, worker_id), points, computing_from, chain, max(0, ready))
        self._notes[request_id] = note
        self._uncounted[request_id] = note
        while len(self._notes) > self.max_notes:
            self._drop(*self._notes.popitem(last=False))

    def grow(self, request_id: str, keys: Sequence[int]) -> None:
        """``request_id``'s prompt is ``keys`` (its note was made from the first of them): a live note covers
        them all now, on the same worker, with the same blocks ready there."""
        note = self._notes.get(request_id)
        if note is not None:
            self.note(request_id, *note.pair, keys, note.ready)

    def forget(self, request_id: str) -> None:
        """The request failed or was sent elsewhere: its prefix will not be computed there."""
        note = self._notes.pop(request_id, None)
        if note is not None:
            self._drop(request_id, note)

    def held(self, model: str, keys: Sequence[int]) -> dict[str, int]:
        """Per worker with a live note for ``model``, the blocks of ``keys``' prefix routed there (0s left out)."""
        return {worker: blocks for worker, (blocks, _) in self.held_ready(model, keys).items()}

    def held_ready(self, model: str, keys: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Per worker with a live note for ``model``: (blocks of ``keys``' prefix routed there, how many of
        them from the start no routed request is still computing there); workers with none left out."""
        if not self._notes or not keys:
            return {}
        self._expire()
        self._count_notes()
        points = self._checkpoint_keys(keys)
        stride, n = self.stride, len(keys)
        out: dict[str, tuple[int, int]] = {}
        for pair, counts in self._count.items():
            if pair[0] != model:
                continue
            computing = self._computing.get(pair, {})
            # Markers chain: the longest run of routed checkpoints from the start is the routed prefix.
            run = ready = 0
            for key in points:
                if key not in counts:
                    break
                run += 1
                if ready == run - 1 and key not in computing:
                    ready = run
            if run:  # the run's last checkpoint is block run x stride, or the prompt's last block
                blocks, ready_blocks = min(run * stride, n), min(ready * stride, n)
                if blocks < n:
                    blocks, ready_blocks = self._past_checkpoint(pair, keys, points[run - 1], blocks, ready_blocks)
                out[pair[1]] = (blocks, ready_blocks)
        return out

    def _past_checkpoint(self, pair: Pair, keys: Sequence[int], last: int, blocks: int, ready: int) -> tuple[int, int]:
        """``blocks`` of ``keys`` are routed to ``pair`` up to the checkpoint ``last``: follow a note holding
        it block by block to where the prefixes part (before the next checkpoint, which no note has). The
        blocks gained are ready when all before them are and that note's worker held them already."""
        note = self._chains.get(pair, {}).get(last)
        if note is None or note.chain is None:
            return blocks, ready
        chain = note.chain
        end = min(len(keys), len(chain), blocks + self.stride - 1)
        grown = blocks
        while grown < end and keys[grown] == chain[grown]:
            grown += 1
        if ready == blocks:
            ready = max(ready, min(grown, note.ready))
        return grown, ready

    def _count_notes(self) -> None:
        """Count the notes made since the last lookup into their worker's key set."""
        for note in self._uncounted.values():
            counts = self._count.setdefault(note.pair, {})
            for key in note.keys:
                counts[key] = counts.get(key, 0) + 1
            if note.computing_from < len(note.keys):
                computing = self._computing.setdefault(note.pair, {})
                for key in note.keys[note.computing_from :]:
                    computing[key] = computing.get(key, 0) + 1
            if note.chain is not None:
                chains = self._chains.setdefault(note.pair, {})
                for key in note.keys:
                    chains[key] = note
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
        if note.chain is not None:
            self.chain_keys -= len(note.chain)
        if self._uncounted.pop(request_id, None) is not None:
            return
        _uncount(self._count, note.pair, note.keys)
        if note.computing_from < len(note.keys):
            _uncount(self._computing, note.pair, note.keys[note.computing_from :])
        chains = self._chains.get(note.pair)
        if note.chain is not None and chains is not None:
            for key in note.keys:
                if chains.get(key) is note:
                    del chains[key]
            if not chains:
                del self._chains[note.pair]


def _uncount(table: dict[Pair, dict[int, int]], pair: Pair, keys: Sequence[int]) -> None:
    counts = table[pair]
    for key in keys:
        left = counts[key] - 1
        if left > 0:
            counts[key] = left
        else:
            del counts[key]
    if not counts:
        del table[pair]
