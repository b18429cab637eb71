"""One bounded wait for every test tier: poll a condition instead of sleeping a fixed time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


async def eventually(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Wait until ``predicate()`` (sync or async) is truthy and return its value; fail the test after a
    generous ``timeout``. A bounded wait, never a timing assertion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"{what} not met after {timeout:.0f} s")
        await asyncio.sleep(interval)
