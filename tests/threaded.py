"""Servers for synchronous tests (hypothesis runs its examples synchronously): an async setup run in a thread
of its own, for as long as the caller needs it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def in_thread(setup: Callable[[], AbstractAsyncContextManager[T]], start_timeout_s: float = 30.0) -> Iterator[T]:
    """Enter ``setup()`` in a new event loop on a thread; yield what it yields; leave it when done."""
    ready: dict[str, object] = {}
    stop = threading.Event()

    async def main() -> None:
        async with setup() as value:
            ready["value"] = value
            while not stop.is_set():
                await asyncio.sleep(0.05)

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by the wait below
            ready["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for _ in range(int(start_timeout_s / 0.05)):
        if "value" in ready or "error" in ready:
            break
        stop.wait(0.05)
    assert "value" in ready, ready.get("error")
    try:
        yield ready["value"]  # type: ignore[misc]
    finally:
        stop.set()
        thread.join(15)


__all__ = ["in_thread"]
