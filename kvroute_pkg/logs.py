"""Logging that an attacker or an outage cannot turn into a flood.

A failure that repeats per request or per message (a Redis outage, a hostile publisher, a tokenizer that is
down) must not write one line per occurrence: :class:`RateLimitedLog` writes the first one of each kind,
then at most one line per ``interval_s`` saying how many were suppressed meanwhile. Counting each
occurrence is the metrics' job.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most one record per ``key`` and ``interval_s``; the next one says how many were dropped."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, max_keys: int = 1024) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: dict[str, tuple[float, int]] = {}

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log unless ``key`` was logged less than ``interval_s`` ago; True when a line was written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = time.monotonic()
        last, dropped = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval_s:
            self._last[key] = (last, dropped + 1)
            return False
        if len(self._last) >= self.max_keys and key not in self._last:
            self._last.clear()  # bounded: many distinct keys (hostile input) cannot grow this
        self._last[key] = (now, 0)
        if dropped:
            msg += f" ({dropped} similar suppressed in the last {self.interval_s:g} s)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.ERROR, key, msg, *args, exc_info=exc_info)
