"""A simulated worker is warm when it starts: its first request pays nothing real vLLM's would not."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import asyncio, sys
from kvroute.sim.fleet import SimFleet

BACKEND = "anyio._backends._asyncio"

async def main() -> None:
    assert BACKEND not in sys.modules, "imported before the worker started: the probe proves nothing"
    async with SimFleet(1, "tiny"):
        print(BACKEND in sys.modules)

asyncio.run(main())
"""


def test_a_started_worker_has_imported_what_its_first_streamed_answer_needs() -> None:
    """Starlette's first streamed answer imports anyio's event-loop backend (~20 ms on these cores, the
    first request of every fresh worker in a benchmark); the worker does it while starting. A fresh
    interpreter, so nothing else imported it first."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
