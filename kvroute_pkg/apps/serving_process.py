"""One serving process of ``kvroute serve --processes N``: what a child of :mod:`kvroute.apps.prefork` does
differently from a single-process router.

The parent hands each child a :class:`ChildSpec` in the environment (its slot, the count, the config
overrides it must load with: the parent's flags, the port it reserved, ``index.subscribe: false`` for
the Redis readers). The child builds the same app as ``kvroute serve`` and then:

* listens on its own ``SO_REUSEPORT`` socket bound to the shared port (the kernel spreads new
  connections over the children's sockets);
* stops when its parent is gone (:class:`ParentWatch`), so a killed supervisor leaves no orphans;
* answers ``GET /admin/process`` (admin only): its pid, slot and whether it subscribes to KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

from fastapi import APIRouter, Depends, Request
from kvroute.apps.prefork import ChildSpec, bind_shared
from kvroute.router.admin import require_admin, state_of

log = logging.getLogger("kvroute.serving_process")

#: How often a child checks that its parent still runs.
PARENT_CHECK_S = 1.0


class ParentWatch:
    """A service of the child's state: SIGTERM to itself (uvicorn's graceful stop) once the parent is gone."""

    def __init__(self, parent_pid: int, interval_s: float = PARENT_CHECK_S) -> None:
        self.parent_pid = parent_pid
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="parent-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        while os.getppid() == self.parent_pid:
            await asyncio.sleep(self.interval_s)
        log.warning("the supervising process %d is gone: stopping", self.parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)


def process_router(spec: ChildSpec) -> APIRouter:
    """``GET /admin/process``: which serving process answered (tests, operators chasing one process)."""
    router = APIRouter(dependencies=[Depends(require_admin)])

    @router.get("/process", summary="The serving process that answered (kvroute serve --processes)")
    async def process(request: Request) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "index": spec.index,
            "processes": spec.count,
            "subscribes": state_of(request).subscriptions is not None,
        }

    return router


def serve_on_shared_port(app: Any, host: str, port: int, **uvicorn_options: Any) -> int:
    """Serve ``app`` with uvicorn on this child's own socket of the shared port; the exit code."""
    import uvicorn

    sock = bind_shared(host, port)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **uvicorn_options))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0 if server.started else 3  # uvicorn's start-up failure code
