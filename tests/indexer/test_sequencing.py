"""The sequence rules alone (docs/indexer.md, 'Sequence numbers, replays, purges'), without any I/O."""

from __future__ import annotations

from kvroute.indexer.sequencing import SeqTrack


def test_verdicts() -> None:
    seq = SeqTrack()
    assert seq.expected() is None
    v = seq.check(7, 1.0, "report", replay=False)  # first message of a running worker: catch up first
    assert (v.outcome, v.apply, v.gap) == ("gap", False, False) and seq.expected() == 0
    assert not seq.prime()  # it has a position now
    seq.begin_replay(0)
    for n in range(3):
        v = seq.check(n, 1.0 + n, "report", replay=True)
        assert (v.outcome, v.apply, v.purge) == ("applied", True, None)
        assert seq.expected() == n + 1  # an APPLY verdict takes the position at once
    v = seq.check(1, 2.0, "report", replay=False)  # live overlap queued behind the replay
    assert (v.outcome, v.apply) == ("duplicate", False)
    v = seq.check(3, 4.0, "report", replay=False)
    assert v.apply and v.outcome == "applied"
    assert seq.replay_floor is None and seq.last_ts == 4.0 and seq.expected() == 4
    v = seq.check(1, 9.0, "report", replay=False)  # backwards, not overlap: the engine restarted
    assert (v.outcome, v.apply, v.purge, v.gap) == ("restart", True, "engine_restart", False)
    assert seq.expected() == 4  # the position moves only once the purge is done and the caller commits
    seq.commit(1, 9.0, replay=False)
    assert seq.expected() == 2
    seq.check(2, 9.5, "report", replay=False)
    seq.check(3, 9.6, "report", replay=False)
    v = seq.check(9, 9.0, "report", replay=False)  # a gap with a replay endpoint: reported
    assert (v.outcome, v.apply, v.gap) == ("gap", False, True)
    v = seq.check(9, 9.0, "report", replay=True)  # the replay starts after what we missed
    assert (v.outcome, v.apply, v.purge) == ("resync", True, "replay_too_old")
    v = seq.check(9, 9.0, "purge", replay=False)  # no replay endpoint
    assert (v.outcome, v.apply, v.purge) == ("resync", True, "gap")
    assert (seq.gaps, seq.replays) == (3, 1)
    seq.forget()
    assert seq.expected() is None
    assert seq.check(5, 1.0, "purge", replay=False).outcome == "applied"  # a new baseline
    fresh = SeqTrack()
    assert fresh.prime() and fresh.expected() == 0
