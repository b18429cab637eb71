"""Sequence numbers per entity: what a message's ``seq`` means before its events are applied (DESIGN §4).

vLLM numbers batches per data-parallel rank from 0 and starts again at 0 when the engine restarts; a
subscriber that missed batches can replay them from the worker's buffer, which may already have lost
them. :class:`SeqTrack` turns (seq, batch timestamp, where the message came from) into a
:class:`Verdict`: apply, ignore as a duplicate, report a gap for the caller to replay, or purge first
(restart, unrecoverable gap). It is pure bookkeeping, no I/O, so the rules are testable alone; the
caller carries out the purge and the write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

Outcome = Literal["applied", "duplicate", "gap", "restart", "resync", "dropped"]
#: What a message that does not follow its predecessor does: ``purge`` (purge, then apply it as the new
#: baseline), ``report`` (a gap is reported for the caller to replay first), ``verify`` (a gap *and* a
#: sequence going backwards are reported: the caller checks with the replay buffer whether the engine really
#: restarted before anything is purged, see the subscriber).
GapPolicy = Literal["report", "purge", "verify"]


class Handled(NamedTuple):
    """What became of one message; ``dp_rank``/``seq`` are None when it could not be decoded."""

    outcome: Outcome
    dp_rank: int | None = None
    seq: int | None = None


class Verdict(NamedTuple):
    """What to do with one message: its outcome, whether to apply it, which purge comes first (if any),
    and whether it revealed a gap (counted even when the gap is only reported)."""

    outcome: Outcome
    apply: bool
    purge: str | None = None
    gap: bool = False


# The verdicts are constants: deciding costs no allocation on the ingestion path.
APPLY = Verdict("applied", True)
DUPLICATE = Verdict("duplicate", False)
CATCH_UP = Verdict("gap", False)
GAP_REPORTED = Verdict("gap", False, gap=True)
RESTART = Verdict("restart", True, "engine_restart")
RESTART_REPORTED = Verdict("restart", False)
REPLAY_TOO_OLD = Verdict("resync", True, "replay_too_old", gap=True)
GAP_PURGED = Verdict("resync", True, "gap", gap=True)


@dataclass(slots=True)
class SeqTrack:
    """One entity's position in its worker's batch sequence."""

    last_seq: int | None = None
    #: While catching up after a replay: live sequence numbers at or above this, behind ``last_seq``,
    #: are overlap with what the replay delivered. Otherwise a sequence going backwards is a restart.
    replay_floor: int | None = None
    #: Timestamp of the last batch applied: overlap re-delivers batches no newer than it, while an engine
    #: that restarted sends new batches (newer timestamps) with small sequence numbers again.
    last_ts: float = 0.0
    gaps: int = 0
    replays: int = 0

    def check(self, seq: int, ts: float, on_gap: GapPolicy, replay: bool) -> Verdict:
        """The verdict on message ``seq`` (batch timestamp ``ts``). ``on_gap="report"`` asks for a gap to
        be reported (the caller replays first); ``replay`` marks messages from the worker's replay socket.

        :data:`APPLY` (the common case) takes the new position at once; after a verdict with a purge, the
        caller purges, then calls :meth:`commit` (one call less per message on the ingestion path)."""
        last = self.last_seq
        if last is None:
            if seq > 0 and on_gap != "purge" and not replay:
                # First message from a worker that was already running (the router restarted, or a
                # connecting PUB lost its first batches): catch up from the start of its replay buffer.
                self.last_seq = -1
                return CATCH_UP
        elif seq != last + 1:
            if seq <= last:
                overlap = self.replay_floor is not None and seq >= self.replay_floor and ts <= self.last_ts
                if replay or overlap:
                    return DUPLICATE
                return RESTART_REPORTED if on_gap == "verify" else RESTART
            self.gaps += 1
            if replay:
                return REPLAY_TOO_OLD  # the replay buffer no longer holds what we missed: start afresh here
            return GAP_PURGED if on_gap == "purge" else GAP_REPORTED
        self.last_seq = seq
        if ts > self.last_ts:
            self.last_ts = ts
        if not replay:
            self.replay_floor = None
        return APPLY

    def commit(self, seq: int, ts: float, replay: bool) -> None:
        """Message ``seq`` is applied after a purge: it is the new position."""
        self.last_seq = seq
        if ts > self.last_ts:
            self.last_ts = ts
        if not replay:
            self.replay_floor = None

    def prime(self) -> bool:
        """Before any message was seen: expect sequence 0, so a replay starts there. False when the
        entity already has a position (nothing to catch up)."""
        if self.last_seq is not None:
            return False
        self.last_seq = -1
        return True

    def expected(self) -> int | None:
        """The next sequence number wanted (where a replay starts), None before any position."""
        return None if self.last_seq is None else self.last_seq + 1

    def begin_replay(self, start: int) -> None:
        """Live messages queued behind a replay from ``start`` are overlap, not an engine restart."""
        self.replay_floor = start
        self.replays += 1

    def restart_from_zero(self) -> None:
        """After a purge that a full resync follows: expect sequence 0 (a replay from 0 comes next)."""
        self.last_seq = -1
        self.replay_floor = None
        self.last_ts = 0.0

    def forget(self) -> None:
        """The worker is gone: whatever it sends next is a new baseline."""
        self.last_seq = None
