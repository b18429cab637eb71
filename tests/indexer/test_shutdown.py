"""Stopping the subscriber's tasks when an await dropped their cancellation (see kvroute.tasks).

On Python 3.11, ``asyncio.wait_for`` (redis-py sends every command through it) drops a cancellation
that lands as the wrapped operation completes. The backends below drop one the same way, on every
Python version, so these tests do not depend on hitting that one loop iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import pytest
import zmq.asyncio
from kvroute.indexer.backend import IndexOp
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed

from .fakevllm import Chain, Publisher, eventually

PROMPT = list(range(700, 700 + 16 * 4))


class SwallowingIndex(MemoryIndex):
    """A write that drops the first cancellation reaching it, then completes (as wait_for does on 3.11)."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = asyncio.Event()
        self.swallowed = 0

    async def apply(self, model: str, worker_id: str, ops: Sequence[IndexOp]) -> None:
        self.writing.set()
        if not self.swallowed:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.swallowed += 1
        await super().apply(model, worker_id, ops)


async def _stop_bounded(sub: EventSubscriber, tasks: list[asyncio.Task[None]]) -> bool:
    """Run sub.stop() with a bound; on failure end the tasks it left so the test cleans up."""
    stopping = asyncio.create_task(sub.stop())
    done, _ = await asyncio.wait({stopping}, timeout=8)
    if not done:
        for _ in range(3):
            for task in tasks:
                task.cancel()
            await asyncio.sleep(0.05)
        await asyncio.wait({stopping}, timeout=2)
    return bool(done)


@pytest.mark.parametrize("mode", ["connect", "bind"])
async def test_stop_ends_a_worker_loop_that_dropped_its_cancel(zctx: zmq.asyncio.Context, mode: str) -> None:
    """The CI hang: stop() cancelled the worker loop during a Redis write, the write dropped the cancel, the
    loop went back to waiting for the next ZMQ message and stop() waited for it for ever."""
    backend = SwallowingIndex()
    indexer = KVIndexer(backend)
    bind = "tcp://127.0.0.1:*" if mode == "bind" else None
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=30, bind=bind)
    if mode == "bind":
        sub.add_worker(WorkerSpec("a", "m", topic="kv"))
        await sub.start()
        assert sub.bound_endpoint is not None
        pub = Publisher(zctx, topic="kv", connect=sub.bound_endpoint)
    else:
        pub = Publisher(zctx)
        sub.add_worker(WorkerSpec("a", "m", endpoint=pub.endpoint, replay=pub.replay_endpoint))
        await sub.start()
    maintenance = indexer.maintenance
    assert maintenance is not None
    tasks = [t for ts in sub._tasks.values() for t in ts] + [sub._bound_task, maintenance.task]
    tasks = [t for t in tasks if t is not None]
    try:
        await pub.wait_subscribed()
        await pub.publish([Chain().store(PROMPT)])
        await asyncio.wait_for(backend.writing.wait(), 10)
        stopped = await _stop_bounded(sub, tasks)
        assert backend.swallowed == 1
        assert stopped, "stop() hung on a task that dropped its cancellation"
        assert all(task.done() for task in tasks)
    finally:
        await pub.close()


async def test_stop_ends_a_watchdog_that_dropped_its_cancel(zctx: zmq.asyncio.Context) -> None:
    """Same for the watchdog: a cancel dropped by its recovery rewrite must not keep it looping."""
    backend = SwallowingIndex()
    indexer = KVIndexer(backend)
    indexer.register_worker("a", "m")
    sub = EventSubscriber(indexer, ctx=zctx, grace_s=0.2)
    indexer.prime_catch_up("a")
    indexer.mark_backend_down("test")
    indexer.mirror.next_recover = 0.0
    await sub.start()
    assert indexer.maintenance is not None and indexer.maintenance.task is not None
    tasks = [indexer.maintenance.task]
    await asyncio.wait_for(backend.writing.wait(), 10)  # the watchdog is rewriting the worker
    stopped = await _stop_bounded(sub, tasks)
    assert backend.swallowed == 1
    assert stopped, "stop() hung on a watchdog that dropped its cancellation"


async def test_stop_maintenance_ends_a_loop_that_dropped_its_cancel() -> None:
    """The indexer's own upkeep, without any subscriber: stop_maintenance() is bounded the same way."""
    backend = SwallowingIndex()
    indexer = KVIndexer(backend)
    indexer.register_worker("a", "m")
    indexer.prime_catch_up("a")
    indexer.mark_backend_down("test")
    indexer.mirror.next_recover = 0.0
    maintenance = indexer.start_maintenance(grace_s=0.2)
    task = maintenance.task
    assert task is not None
    await asyncio.wait_for(backend.writing.wait(), 10)  # the upkeep is rewriting the worker
    stopping = asyncio.create_task(indexer.stop_maintenance())
    done, _ = await asyncio.wait({stopping}, timeout=8)
    if not done:
        for _ in range(3):
            task.cancel()
            await asyncio.sleep(0.05)
    assert backend.swallowed == 1
    assert done, "stop_maintenance() hung on a loop that dropped its cancellation"
    assert task.done() and indexer.maintenance is None


async def test_cancel_and_wait_cancels_again_and_stays_bounded() -> None:
    release = asyncio.Event()

    async def drops_one() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        await asyncio.sleep(30)  # a loop going back to its next wait

    async def drops_all() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)

    once = asyncio.create_task(drops_one())
    stubborn = asyncio.create_task(drops_all())
    await asyncio.sleep(0)
    left = await cancel_and_wait([once, stubborn], timeout_s=1.0, recancel_s=0.05)
    assert once.cancelled()
    assert left == {stubborn} and not stubborn.done()  # bounded: given up on, not waited for
    release.set()
    stubborn.cancel()
    await asyncio.wait({stubborn}, timeout=2)
    assert stubborn.done()


async def test_cancel_and_wait_lets_its_callers_cancellation_through() -> None:
    """The old stop() suppressed CancelledError around ``await task``: a timeout around stop() was eaten."""
    release = asyncio.Event()

    async def drops_all() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)

    stubborn = asyncio.create_task(drops_all())
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await cancel_and_wait([stubborn], timeout_s=30)
    release.set()
    stubborn.cancel()
    await asyncio.wait({stubborn}, timeout=2)


async def test_raise_if_cancel_swallowed() -> None:
    seen: list[str] = []

    async def body() -> None:
        raise_if_cancel_swallowed()  # nothing asked: no-op
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("dropped")
        raise_if_cancel_swallowed()
        seen.append("carried on")

    task = asyncio.create_task(body())
    await asyncio.sleep(0)
    task.cancel()
    await eventually(task.done)
    assert task.cancelled() and seen == ["dropped"]
