"""The router process's heap after start-up: the garbage collector and the C allocator, set for a proxy.

Both run once, from the app's lifespan, and are off with a setting of 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("kvroute.heap")

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap: a 32k-token prompt's token list is 256 KB, its body 200 KB.
MMAP_THRESHOLD = 32 << 20


def settle_heap(gen0_threshold: int) -> None:
    """Move what start-up allocated out of the garbage collector's reach and collect young objects less
    often. Otherwise every full collection walks the app, its modules and the index on the request path:
    with 32 concurrent clients that was +25 ms of added p99 latency, +4 ms after (docs/benchmarks.md).
    The request path allocates no reference cycles worth collecting early."""
    if gen0_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, max(gen1, 50), max(gen2, 100))


def keep_freed_memory(trim_threshold_mb: int) -> bool:
    """Let glibc keep large freed blocks for reuse (``trim_threshold_mb`` above the heap's top) instead of
    unmapping them. By default a block over 128 KB is mmapped and unmapped on free, so every long prompt's
    lists, strings and body buffers come from fresh pages, each faulted in again: 120 µs of a 150 µs
    32k-token list copy (docs/benchmarks.md, "The heap"). False where the allocator is not glibc's."""
    if trim_threshold_mb <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("not glibc: the allocator is left as it is")
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold_mb << 20)
    )
