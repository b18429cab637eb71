"""Stopping background tasks reliably, even when an await dropped their cancellation.

On Python 3.11, ``asyncio.wait_for`` returns the wrapped operation's result and drops the cancellation
when the cancel lands just as that operation completes (CPython gh-86296, fixed in 3.12 where
``wait_for`` is built on ``asyncio.timeout``). redis-py's asyncio client sends every command through
``wait_for`` once ``socket_timeout`` is set, so a task cancelled in the loop iteration where its Redis
command went out carries on as if nothing happened. A loop that then waits for its next ZMQ message
never ends, and a ``stop()`` that cancels once and awaits the task without a bound hangs for ever.

Two defences, used together: loops call :func:`raise_if_cancel_swallowed` at each turn (``Task.cancelling()``
still counts the dropped request), and :func:`cancel_and_wait` cancels again any task that survives,
within a bound, without ever swallowing its caller's own cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("kvroute.tasks")

#: How long :func:`cancel_and_wait` waits for tasks to end before leaving them behind (logged).
STOP_TIMEOUT_S = 10.0
#: How often a task that is still running is cancelled again meanwhile.
RECANCEL_INTERVAL_S = 0.5


def raise_if_cancel_swallowed() -> None:
    """Raise :class:`asyncio.CancelledError` when this task was asked to stop and an await dropped it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[object]], timeout_s: float = STOP_TIMEOUT_S, recancel_s: float = RECANCEL_INTERVAL_S
) -> set[asyncio.Task[object]]:
    """Cancel ``tasks`` and wait until they are done, cancelling again those still running every
    ``recancel_s``. Bounded: returns the tasks still running after ``timeout_s`` (logged), empty when all
    ended. Their exceptions are logged, never raised; a cancellation of the caller propagates."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.error(
                "tasks still running %.1f s after being cancelled, left behind: %s",
                timeout_s,
                ", ".join(sorted(task.get_name() for task in pending)),
            )
            break
        _, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error("task %s failed before it was stopped", task.get_name(), exc_info=task.exception())
    return pending
