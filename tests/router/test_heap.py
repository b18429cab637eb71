"""The app settles its heap after start-up (gc.freeze, a higher young-generation threshold)."""

from __future__ import annotations


def test_settle_heap_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    import gc

    from kvroute.router.heap import settle_heap

    before = gc.get_threshold()
    try:
        settle_heap(0)
        assert gc.get_threshold() == before
        settle_heap(50_000)
        assert gc.get_threshold()[0] == 50_000
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_keep_freed_memory_sets_glibcs_thresholds() -> None:
    """On glibc the thresholds are set (mallopt answers 1); 0 leaves the allocator alone."""
    from kvroute.router.heap import keep_freed_memory

    assert keep_freed_memory(0) is False
    assert keep_freed_memory(128) is True
