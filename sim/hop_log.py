"""Where a request's time goes between processes: the simulated engine's side of ``bench/hops.py``.

A router's share of a client's time to first token cannot be read from the router alone (what it adds
before its own clock starts and after its last write is invisible to it) nor compared with a peer that
keeps no such clock. With ``KVSIM_HOP_LOG`` set to a path, each worker appends one line per streamed
request: its key, when it reached the worker and when its first token left, both ``time.monotonic()``
(one clock for every process on the machine). The client (:mod:`kvroute.sim.replay`) records the same key
with its send and first-token times, so the three hops (client to engine, engine, engine to client) split
per request for any router in between.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Mapping
from typing import IO, Any

#: The environment variable naming the log; unset, nothing is written.
#: Not under ``KVROUTE_``: ``kvroute serve`` reads every such variable as a setting of its own.
HOP_LOG_ENV = "KVSIM_HOP_LOG"


def prompt_key(body: Mapping[str, Any]) -> int:
    """A key of the request's last message (chat) or prompt tail (completions): a router rewrites the
    body's routing fields, never the prompt, and a replayed trace's last messages are distinct."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        text = str(last.get("content") if isinstance(last, Mapping) else last)
    else:
        text = str(body.get("prompt", ""))[-512:]
    return zlib.crc32(text.encode("utf-8", "replace"))


class HopLog:
    """Lines of ``key arrival first_token`` (seconds, ``time.monotonic()``), appended as they come."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - held for the process's life

    def write(self, key: int, arrival: float, first_token: float) -> None:
        self._file.write(f"{key} {arrival:.6f} {first_token:.6f}\n")


_LOG: HopLog | None = None


def hop_log() -> HopLog | None:
    """The process's log when ``KVSIM_HOP_LOG`` is set (opened on first use), else None."""
    global _LOG
    path = os.environ.get(HOP_LOG_ENV)
    if not path:
        return None
    if _LOG is None:
        _LOG = HopLog(path)
    return _LOG


def now() -> float:
    return time.monotonic()
