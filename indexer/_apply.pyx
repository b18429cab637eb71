# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The removal loops of ingestion, compiled: a worker's local view, then the memory index's table.

vLLM evicts a block at a time and a full cache evicts as many blocks as it stores, so a fresh 16k-token
prompt on a full worker is ~1,000 removals through both loops; in Python each block cost ~0.6 µs per
loop. Same results as the Python references (:func:`kvroute.indexer.ingest.remove_python`,
:func:`kvroute.indexer.memory.unhold_python`; property tests hold them equal), which are also the
fallbacks where this extension was not built.
"""

from cpython.dict cimport PyDict_Check, PyDict_DelItem, PyDict_GetItem, PyDict_SetItem
from cpython.object cimport PyObject


cdef inline dict _table(object table):
    """``table`` as a dict, subclasses included (a typed ``dict`` argument would refuse them); read and
    written through the dict API, as the Python references' ``dict`` operations do for plain dicts."""
    if not PyDict_Check(table):
        raise TypeError(f"expected a dict, got {type(table).__name__}")
    return <dict>table


def remove(alias_, bits_, holders_, counts, chain_, long bit, list hashes, owner):
    """Keys that left tier ``bit`` of a worker's view (their last copy went) for ``owner``'s removal of
    ``hashes``: ``alias`` vLLM hash -> key, ``bits`` key -> tier bits, ``holders`` (key, bit) -> copies
    per owner, ``counts`` blocks per tier bit, ``chain`` (lookahead hashing) vLLM hash -> plain key."""
    cdef dict alias = _table(alias_), bits = _table(bits_), holders = _table(holders_)
    cdef dict chain = _table(chain_)
    cdef list keys = []
    cdef PyObject* found
    cdef object h, key, held, where, bit_obj = bit
    cdef long old
    cdef Py_ssize_t copies, removed = 0
    for h in hashes:
        found = PyDict_GetItem(alias, h)
        if found is NULL:
            continue
        key = <object>found
        found = PyDict_GetItem(bits, key)
        old = <long><object>found if found is not NULL else 0
        if not old & bit:
            continue
        if holders:
            where = (key, bit_obj)
            found = PyDict_GetItem(holders, where)
        else:
            found = NULL
        if found is not NULL:
            held = <object>found
            copies = held.get(owner, 0)
            if not copies:
                continue  # that owner holds no copy of this block
            if copies > 1:
                held[owner] = copies - 1
                continue
            del held[owner]
            if held:
                if len(held) == 1 and held.get(None) == 1:
                    del holders[where]  # back to the one copy of the primary tier
                continue  # another copy still holds the block
            del holders[where]
        elif owner is not None:
            continue  # the one copy is the primary tier's
        keys.append(key)
        removed += 1
        if old == bit:
            PyDict_DelItem(bits, key)
            PyDict_DelItem(alias, h)
            if chain:
                chain.pop(h, None)
        else:
            PyDict_SetItem(bits, key, old & ~bit)
    if removed:
        counts[bit_obj] -= removed
    return keys


def unhold(held_, blocks_, keys, long bit, shifted):
    """Take tier ``bit`` (``shifted`` to the worker's slot in ``blocks``' bit sets) from ``keys`` in the
    worker's reverse map ``held`` and the model's table ``blocks``; returns how many keys had it."""
    cdef dict held = _table(held_), blocks = _table(blocks_)
    cdef PyObject* found
    cdef object key, value
    cdef object mask = ~shifted
    cdef long old
    cdef Py_ssize_t n = 0
    for key in keys:
        found = PyDict_GetItem(held, key)
        if found is NULL:
            continue
        old = <long><object>found
        if not old & bit:
            continue
        if old == bit:
            PyDict_DelItem(held, key)
        else:
            PyDict_SetItem(held, key, old & ~bit)
        n += 1
        found = PyDict_GetItem(blocks, key)
        if found is NULL:
            raise KeyError(key)  # held by the worker but not in the table: as the Python loop would
        value = <object>found & mask
        if value:
            PyDict_SetItem(blocks, key, value)
        else:
            PyDict_DelItem(blocks, key)
    return n


cdef dict _set_all(dict table, list keys, object bit):
    """Set every key of ``keys`` to the one ``bit`` object; returns the values the keys had before (for
    those that were there), which the callers or back in."""
    cdef dict olds = {}
    cdef PyObject* found
    cdef object key
    for key in keys:
        found = PyDict_GetItem(table, key)
        if found is not NULL:
            olds[key] = <object>found
    for key in keys:
        PyDict_SetItem(table, key, bit)
    return olds


def add_bits(table_, list keys, bit):
    """``table[key] |= bit`` for every key (keys not there yet all get the one ``bit`` object, as
    ``dict.fromkeys`` gives them); returns the keys that were there already."""
    cdef dict table = _table(table_)
    cdef dict olds = _set_all(table, keys, bit)
    for key, old in olds.items():
        PyDict_SetItem(table, key, old | bit)
    return set(olds)


def add_bits_counted(table_, list keys, bit):
    """:func:`add_bits`, returning how many keys did not have ``bit`` before (for maintained counters)."""
    cdef dict table = _table(table_)
    cdef Py_ssize_t before = len(table), new
    cdef dict olds = _set_all(table, keys, bit)
    new = len(table) - before
    for key, old in olds.items():
        PyDict_SetItem(table, key, old | bit)
        if not old & bit:
            new += 1
    return new


def having(table_, list keys, long bit):
    """The keys (in order, repeats kept) whose value in ``table`` has ``bit``: what a store's copies
    bookkeeping must look at, usually none."""
    cdef dict table = _table(table_)
    cdef list out = []
    cdef PyObject* found
    cdef object key
    for key in keys:
        found = PyDict_GetItem(table, key)
        if found is not NULL and <long><object>found & bit:
            out.append(key)
    return out
