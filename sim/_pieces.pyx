# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The built-in tokenizer's ids, compiled: one pass over a text's UTF-8 bytes, no object per piece.

Same contract and result as :func:`kvroute.sim.tokenizer.piece_ids_python`, the reference (a property
test holds them equal) and the fallback where this extension was not built: the text is cut where
``str.split()`` cuts it (runs of whitespace, Unicode's included), and each piece's id is
``reserved + scaled(fmix64(fnv1a_64(its UTF-8 bytes)))`` (a
finaliser, then the top 32 bits scaled to ``span``: no division). The Python version makes a ``str`` per piece and looks
it up in a dict; with the text's memory cold (a router between two requests), that was ~0.7 µs a piece.
"""

from cpython.array cimport array, clone, resize
from libc.stdint cimport uint32_t, uint64_t

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL

cdef uint64_t FNV_OFFSET = 0xCBF29CE484222325
cdef uint64_t FNV_PRIME = 0x100000001B3
cdef uint64_t FMIX_1 = 0xFF51AFD7ED558CCD
cdef uint64_t FMIX_2 = 0xC4CEB9FE1A85EC53
cdef array _IDS = array("I")
#: ASCII whitespace as str.split() sees it (0x1C-0x1F included), and the code points above 0x7F.
cdef unsigned char _ASCII_SPACE[128]
cdef uint32_t _WIDE_SPACE[64]
cdef Py_ssize_t _WIDE_COUNT = 0


def set_whitespace(ascii_codes, wide_codes) -> None:
    """The whitespace table, computed by the caller from ``str.isspace`` (so it is Python's own)."""
    global _WIDE_COUNT
    cdef int c
    for c in range(128):
        _ASCII_SPACE[c] = 0
    for c in ascii_codes:
        _ASCII_SPACE[c] = 1
    if len(wide_codes) > 64:
        raise ValueError("more wide whitespace code points than the table holds")
    _WIDE_COUNT = 0
    for c in wide_codes:
        _WIDE_SPACE[_WIDE_COUNT] = c
        _WIDE_COUNT += 1


cdef inline uint32_t _scaled(uint64_t h, uint32_t span) noexcept nogil:
    """MurmurHash3's 64-bit finaliser (FNV's high bits alone are poorly mixed), then the top 32 bits
    scaled to ``span``: no division."""
    h ^= h >> 33
    h *= FMIX_1
    h ^= h >> 33
    h *= FMIX_2
    h ^= h >> 33
    return <uint32_t>(((h >> 32) * span) >> 32)


cdef inline int _seq_len(unsigned char lead) noexcept nogil:
    if lead < 0xE0:
        return 2
    if lead < 0xF0:
        return 3
    return 4


cdef inline bint _wide_space(const unsigned char* s, Py_ssize_t i, int n) noexcept nogil:
    """Whether the ``n``-byte UTF-8 sequence at ``s[i]`` is a whitespace code point."""
    cdef uint32_t cp
    cdef Py_ssize_t k
    if n == 2:
        cp = ((s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F)
    elif n == 3:
        cp = ((s[i] & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F)
    else:
        return False  # no whitespace above U+FFFF
    for k in range(_WIDE_COUNT):
        if _WIDE_SPACE[k] == cp:
            return True
    return False


def piece_ids(str text, uint32_t reserved, uint32_t span) -> array:
    """The ids of ``text``'s whitespace-delimited pieces, as ``array("I")``."""
    cdef Py_ssize_t size = 0
    cdef const unsigned char* s = <const unsigned char*>PyUnicode_AsUTF8AndSize(text, &size)
    cdef array out = clone(_IDS, size // 2 + 1, False)
    cdef uint32_t* ids = out.data.as_uints
    cdef Py_ssize_t i = 0, count = 0
    cdef uint64_t h
    cdef unsigned char c
    cdef int n, k
    cdef bint in_piece = False
    with nogil:
        while i < size:
            c = s[i]
            if c < 0x80:
                if _ASCII_SPACE[c]:
                    if in_piece:
                        ids[count] = reserved + _scaled(h, span)
                        count += 1
                        in_piece = False
                    i += 1
                    continue
                n = 1
            else:
                n = _seq_len(c)
                if i + n > size:
                    n = <int>(size - i)
                elif _wide_space(s, i, n):
                    if in_piece:
                        ids[count] = reserved + _scaled(h, span)
                        count += 1
                        in_piece = False
                    i += n
                    continue
            if not in_piece:
                h = FNV_OFFSET
                in_piece = True
            for k in range(n):
                h = (h ^ s[i + k]) * FNV_PRIME
            i += n
        if in_piece:
            ids[count] = reserved + _scaled(h, span)
            count += 1
    resize(out, count)  # ids never outnumber half the bytes plus one: this only shrinks it
    return out
