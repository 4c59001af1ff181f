"""The arrays ``bench collectives`` hands every backend, by ``--arrays``.

``numpy`` (the default) makes them as a user would, with ``np.ones``/``np.empty``: which of
their pages the kernel backs with huge pages then depends on where malloc put them, and
that differs from one job to another (the libraries' own allocations come first).  A
16 MB array was backed 1.0/1.0 in its two halves in an MPI job and 0.94/0.81 in one of
ours in the same sitting, and arrays under 4 MiB, which numpy does not advise for huge
pages, get small ones.  ``huge`` makes every array start on a 2 MiB boundary and advises
the kernel to back it with huge pages, in every backend's job alike: MPICH's 1-4 MB
collectives, whose kernel copies pin the arrays' pages one by one, ran two to three times
faster that way here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import numpy as np

ARRAYS = ("numpy", "huge")

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15


def _madvise(address: int, nbytes: int, advice: int) -> None:
    """``madvise`` over ``nbytes`` at ``address`` (2 MiB aligned); where the kernel cannot
    take the advice (not Linux, no transparent huge pages) the pages stay as they come."""
    if platform.system() != "Linux" or nbytes <= 0:
        return
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or None).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    madvise(address, nbytes, advice)


def float32s(count: int, arrays: str, fill: float | None = 1.0) -> np.ndarray:
    """``count`` float32s filled with ``fill`` (None: left undefined, as ``np.empty``),
    made the way ``arrays`` names."""
    if arrays == "numpy":
        return np.empty(count, np.float32) if fill is None else np.full(count, fill,
                                                                          np.float32)
    if arrays != "huge":
        raise ValueError(f"arrays must be one of {', '.join(ARRAYS)}, not {arrays!r}")
    return aligned_float32s(count, fill)


def aligned_float32s(count: int, fill: float | None, huge: bool = True) -> np.ndarray:
    """``count`` float32s on a 2 MiB boundary, filled as :func:`float32s` does, whose
    pages the kernel was asked before their first touch to back with huge pages
    (``huge``) or never to."""
    nbytes = count * 4
    span = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    raw = np.empty(span + _HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % _HUGE_PAGE
    _madvise(raw.ctypes.data + start, span, _MADV_HUGEPAGE if huge else _MADV_NOHUGEPAGE)
    out = raw[start:start + nbytes].view(np.float32)
    if fill is None:
        out[::1024] = 0  # mapped, as a reused np.empty array's pages are
    else:
        out.fill(fill)
    return out
