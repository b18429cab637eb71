# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The event decoder's two loops over a batch's bulk, compiled: the token ids and the runs of removals.

Same results as the Python reference in :mod:`kvroute.indexer.fastdecode` (property tests hold them
equal), which is also the fallback where this extension was not built.

- :func:`read_uint32s`: a ``BlockStored``'s ``token_ids``, handed over undecoded by msgspec
  (``msgspec.Raw``), read straight into the packed little-endian uint32s the block keys hash, with no
  Python int per token (decoding a 16k-token event to ``list[int]`` and packing it again cost ~0.4 ms;
  this ~30 µs). Anything but an array of integers in 0..2**32-1 answers None and the caller decodes the
  field with msgspec as before, so the verdicts on odd input do not change.
- :func:`fold`: vLLM sends one ``BlockRemoved`` per evicted block; consecutive removals from one tier
  become one event (their hashes in order), ~0.6 µs per removal in Python, ~0.1 here.
"""

from libc.stdint cimport uint32_t, uint64_t
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize


cdef inline uint64_t _be(const unsigned char* p, int width) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(width):
        v = (v << 8) | p[i]
    return v


def read_uint32s(const unsigned char[::1] raw):
    """Little-endian uint32 bytes of the msgpack array of token ids in ``raw``, or None when ``raw`` is
    not exactly one such array."""
    cdef Py_ssize_t size = raw.shape[0]
    if size == 0:
        return None
    cdef const unsigned char* p = &raw[0]
    cdef const unsigned char* end = p + size
    cdef unsigned char head = p[0]
    cdef Py_ssize_t count
    if head & 0xF0 == 0x90:
        count = head & 0x0F
        p += 1
    elif head == 0xDC and size >= 3:
        count = <Py_ssize_t>_be(p + 1, 2)
        p += 3
    elif head == 0xDD and size >= 5:
        count = <Py_ssize_t>_be(p + 1, 4)
        p += 5
    else:
        return None
    if count > end - p:  # every element takes at least one byte
        return None
    out = PyBytes_FromStringAndSize(NULL, count * 4)
    cdef unsigned char* dst = <unsigned char*>PyBytes_AS_STRING(out)
    cdef Py_ssize_t i
    cdef unsigned char tag
    cdef uint64_t value
    cdef int width
    cdef uint32_t word
    for i in range(count):
        if p >= end:
            return None
        tag = p[0]
        # The unsigned forms msgpack writers pick for ids (fixint, uint16, uint8, uint32) first, each read
        # with fixed width; the signed and 64-bit forms (a writer that never shrinks) after.
        if tag < 0x80:  # positive fixint
            value = tag
            p += 1
        elif tag == 0xCD and end - p >= 3:  # uint16
            value = (<uint64_t>p[1] << 8) | p[2]
            p += 3
        elif tag == 0xCC and end - p >= 2:  # uint8
            value = p[1]
            p += 2
        elif tag == 0xCE and end - p >= 5:  # uint32
            value = (<uint64_t>p[1] << 24) | (<uint64_t>p[2] << 16) | (<uint64_t>p[3] << 8) | p[4]
            p += 5
        else:
            if tag == 0xD0:  # int8
                width = 1
            elif tag == 0xD1:  # int16
                width = 2
            elif tag == 0xD2:  # int32
                width = 4
            elif tag == 0xCF or tag == 0xD3:  # uint64 / int64
                width = 8
            else:
                return None  # another type, or a truncated unsigned form
            if end - p < 1 + width:
                return None
            if tag >= 0xD0 and p[1] & 0x80:  # a negative signed integer
                return None
            value = _be(p + 1, width)
            if value > 0xFFFFFFFF:
                return None
            p += 1 + width
        word = <uint32_t>value
        dst[4 * i] = word & 0xFF
        dst[4 * i + 1] = (word >> 8) & 0xFF
        dst[4 * i + 2] = (word >> 16) & 0xFF
        dst[4 * i + 3] = (word >> 24) & 0xFF
    if p != end:
        return None
    return out


def fold(list typed, convert, removed_type, same_tier, Py_ssize_t max_blocks):
    """``(events, folds)`` of msgspec's typed events: each converted by ``convert``, and a removal from the
    same tier (equal raw fields) as the removal before it joined to it. None when the reference decoder
    must judge the payload: ``convert`` refused an event, or two removals are of one tier only once
    normalised (``same_tier`` of the converted events)."""
    cdef list events = []
    cdef dict folds = None
    cdef list hashes = None
    cdef object last = None
    cdef object last_type = None
    cdef object medium = None, group = None, locality = None, ownership = None
    cdef object raw, event, before, more
    cdef Py_ssize_t at
    for raw in typed:
        if last is not None and type(raw) is last_type:
            more = raw.block_hashes
            if (
                raw.medium == medium
                and raw.group_idx == group
                and raw.locality == locality
                and raw.ownership == ownership
                and len(more) <= max_blocks
            ):
                hashes.extend(more)
                if folds is None:
                    folds = {}
                at = len(events) - 1
                folds[at] = folds.get(at, 1) + 1
                continue
        event = convert(raw)
        if event is None:
            return None
        if type(event) is removed_type:
            if last is not None:
                before = events[len(events) - 1]  # (no wraparound in this module)
                if type(before) is removed_type and same_tier(event, before):
                    return None
            last, last_type, hashes = raw, type(raw), event.block_hashes
            medium, group, locality, ownership = raw.medium, raw.group_idx, raw.locality, raw.ownership
        else:
            last = None
        events.append(event)
    return events, folds
