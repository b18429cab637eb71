"""The index's periodic upkeep, owned by the indexer rather than by whoever feeds it events.

Three jobs, one loop: purge workers down for longer than the grace period (they lost their cache, or
left), retry a failed backend and rewrite it once it answers, and re-store every block now and then
(``refresh_s``) so that a Redis index's TTL safety net never expires long-lived hot blocks. None of it
depends on events arriving, which is why it is not the subscriber's: an indexer whose workers all went
quiet, or fed by something else, still needs it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed

log = logging.getLogger("kvroute.indexer")


class Maintained(Protocol):
    """What the loop needs of an indexer (:class:`~kvroute.indexer.service.KVIndexer` has it)."""

    async def purge_gone(self, grace_s: float) -> list[str]: ...

    async def recover(self, force: bool = False) -> bool: ...

    async def refresh(self) -> None: ...


class IndexMaintenance:
    """One indexer's maintenance task. A service (``async start()``/``stop()``, what an app's lifespan runs);
    :meth:`launch` starts it from synchronous code inside a running loop.

    ``grace_s`` is how long a worker marked down keeps its blocks; ``refresh_s`` how often every block
    is re-stored (None = never; with Redis, ``block_ttl_s / 3``). The loop wakes every quarter of the
    grace period (between 50 ms and 1 s), so purges happen at most that late.
    """

    def __init__(self, indexer: Maintained, grace_s: float = 30.0, refresh_s: float | None = None) -> None:
        self.indexer = indexer
        self.grace_s = grace_s
        self.refresh_s = refresh_s
        self.interval_s = max(0.05, min(1.0, grace_s / 4))
        self.task: asyncio.Task[None] | None = None
        self._next_refresh = 0.0

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def launch(self) -> None:
        """Start the task in the running loop (no-op while it runs)."""
        if self.running:
            return
        loop = asyncio.get_running_loop()
        self._next_refresh = loop.time() + (self.refresh_s or 0)
        self.task = loop.create_task(self._run(), name="kv-index-maintenance")

    async def start(self) -> None:
        self.launch()

    async def stop(self) -> None:
        """End the task, within a bound even when an await dropped its cancellation (:mod:`kvroute.tasks`)."""
        task, self.task = self.task, None
        if task is not None:
            await cancel_and_wait([task])

    async def tick(self) -> None:
        """One round: purge the gone, heal the backend, renew TTLs when due."""
        await self.indexer.purge_gone(self.grace_s)
        raise_if_cancel_swallowed()
        await self.indexer.recover()
        raise_if_cancel_swallowed()
        if self.refresh_s:
            now = asyncio.get_running_loop().time()
            if now >= self._next_refresh:
                self._next_refresh = now + self.refresh_s
                await self.indexer.refresh()

    async def _run(self) -> None:
        while True:
            # A cancel dropped by a Redis write (Python 3.11's wait_for) must end the loop here.
            raise_if_cancel_swallowed()
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed round must not end the upkeep
                log.exception("indexer watchdog failed; retrying")
