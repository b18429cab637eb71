# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The memory index's chain walk, compiled (the decision's hottest loop: one dict read per block).

Same contract and result as :func:`kvroute.indexer.memory.walk_python`, which stays the reference (a
property test holds them equal) and the fallback where this extension was not built. The loop per block
is a borrowed ``PyDict_GetItem`` and a pointer comparison (blocks stored in one batch share one value
object); only where the value changes do the per-slot settlements run, as Python-level int operations.
"""

from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject

cdef int SLOT_BITS = 8
cdef object _BYTE = 0xFF
cdef dict _LANE_CACHE = {}


cdef object _lane_mask(Py_ssize_t nbits):
    cdef Py_ssize_t slots = (nbits + SLOT_BITS - 1) // SLOT_BITS
    mask = _LANE_CACHE.get(slots)
    if mask is None:
        mask = int.from_bytes(b"\x01" * slots, "little")
        _LANE_CACHE[slots] = mask
    return mask


cdef object _lanes(object value):
    folded = value | (value >> 1)
    folded |= folded >> 2
    folded |= folded >> 4
    return folded & _lane_mask(value.bit_length())


cdef list _slots_of(object lanes):
    cdef list out = []
    while lanes:
        low = lanes & -lanes
        out.append((low.bit_length() - 1) // SLOT_BITS)
        lanes ^= low
    return out


cdef inline void _credit(list entry, Py_ssize_t run, long bits):
    """Count ``run`` blocks held with ``bits`` in the tier they load from fastest (GPU 1, CPU 2, STORAGE 4;
    the same bits shifted by 3 are the remote copies, see kvroute.vocabulary.Tier)."""
    if run <= 0:
        return
    cdef long merged = bits | (bits >> 3)
    cdef int tier = 0 if merged & 1 else 1 if merged & 2 else 2
    entry[tier + 1] += run
    if not bits & 7:
        entry[4] += run


def walk(dict blocks, keys):
    """Per slot ``[blocks, gpu, cpu, storage, remote]`` for the longest runs from the start of ``keys``."""
    return walk_from(blocks, keys)[0]


cdef dict _copy_counts(dict result):
    return {slot: list(entry) for slot, entry in result.items()}


def walk_from(dict blocks, keys, resume=None, bint keep=False):
    """``walk``, continued from ``resume`` (see ``kvroute.indexer.memory.walk_from_python``: the same
    contract and states); with ``keep``, also the state where this walk stopped."""
    if not isinstance(keys, list):
        keys = list(keys)
    cdef list key_list = <list>keys
    cdef Py_ssize_t n = PyList_GET_SIZE(key_list)
    cdef PyObject* found
    cdef PyObject* prev_ptr = NULL
    cdef dict result
    cdef dict start
    cdef dict held
    cdef Py_ssize_t slot
    cdef Py_ssize_t i = 0
    cdef long bits
    if resume is None:
        if n == 0:
            return {}, None
        found = PyDict_GetItem(blocks, <object>PyList_GET_ITEM(key_list, 0))
        if found == NULL:
            return {}, None
        first = <object>found
        if not first:
            return {}, None
        result = {}
        start = {}
        held = {}
        lanes = _lanes(first)
        for slot in _slots_of(lanes):
            result[slot] = [0, 0, 0, 0, 0]
            start[slot] = 0
            held[slot] = (first >> (slot * SLOT_BITS)) & _BYTE
        alive_full = lanes * _BYTE
        prev_raw = first
        prev = first
        prev_ptr = found
    else:
        depth, done, counts, starts, holding, alive_full, prev_raw, prev = resume
        result = _copy_counts(counts)
        if done:
            return result, resume
        i = depth
        start = dict(starts)
        held = dict(holding)
        prev_ptr = <PyObject*>prev_raw  # never NULL: an absent key must not read as the same run
    while i < n:
        found = PyDict_GetItem(blocks, <object>PyList_GET_ITEM(key_list, i))
        if found == prev_ptr:
            i += 1
            continue
        if found == NULL:
            break
        value = <object>found
        if value == prev_raw:
            prev_ptr = found
            i += 1
            continue
        prev_raw = value
        prev_ptr = found
        value = value & alive_full
        if value != prev:
            for slot in _slots_of(_lanes(value ^ prev)):
                _credit(<list>result[slot], i - <Py_ssize_t>start[slot], <long>held[slot])
                bits = (value >> (slot * SLOT_BITS)) & 0xFF
                if bits:
                    start[slot] = i
                    held[slot] = bits
                else:
                    (<list>result[slot])[0] = i
                    del held[slot]
                    alive_full &= ~(_BYTE << (slot * SLOT_BITS))
            prev = value
            if not value:
                return result, ((i, True, _copy_counts(result), {}, {}, 0, 0, 0) if keep else None)
        i += 1
    kept = (i, False, _copy_counts(result), dict(start), dict(held), alive_full, prev_raw, prev) if keep else None
    for slot_obj, held_bits in held.items():
        entry = <list>result[slot_obj]
        _credit(entry, i - <Py_ssize_t>start[slot_obj], <long>held_bits)
        entry[0] = i
    return result, kept
