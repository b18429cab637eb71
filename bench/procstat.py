"""A process and its descendants, read from ``/proc``: who they are and how much CPU they have used."""

from __future__ import annotations

import contextlib
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a router started with ``--processes N`` serves from children)."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                tree.extend(int(child) for child in task.read_text().split())
        i += 1
    return tree


def task_cpu_ns(task: Path) -> int:
    """CPU nanoseconds of one thread (``/proc/<pid>/task/<tid>``), from its ``schedstat``."""
    return int((task / "schedstat").read_text().split()[0])


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, summed by thread name (``main`` for the process's own)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
                out[name] = out.get(name, 0.0) + task_cpu_ns(task) / 1e9
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants, every thread, from ``/proc/<pid>/task/*/schedstat``
    (nanoseconds: a few growing requests are measurable, clock ticks are not); 0 where /proc is absent."""
    total = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{member}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += task_cpu_ns(task)
    return total / 1e9
