"""How much of a buffer huge pages back (transport/pages.py), asked of the kernel."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from totalreduce.transport import pages

_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_NOHUGEPAGE = 14, 15


def _region(nbytes: int, advice: int) -> tuple[mmap.mmap, np.ndarray]:
    """``nbytes`` of private memory aligned to a huge page, with ``advice`` given."""
    area = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(area, np.uint8)
    start = -whole.ctypes.data % _HUGE
    region = whole[start:start + nbytes]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(region.ctypes.data, nbytes, advice) != 0:
        del whole, region
        area.close()
        pytest.skip("madvise refused")
    return area, region


def _anon_huge_kb(address: int) -> int:
    """What /proc/self/smaps says of the mapping holding ``address``: its AnonHugePages."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_small_pages_untouched_pages_and_nothing_count_as_no_huge_pages() -> None:
    if pages.huge_share(0, 0) != 0.0:
        pytest.fail("an empty range has no huge pages")
    area, small = _region(4 * _HUGE, _MADV_NOHUGEPAGE)
    try:
        if pages.huge_share(small.ctypes.data, small.nbytes) is None:
            pytest.skip("this kernel cannot say (PAGEMAP_SCAN came with Linux 6.7)")
        assert pages.huge_share(small.ctypes.data, small.nbytes) == 0.0  # untouched
        small[:] = 1
        assert pages.huge_share(small.ctypes.data, small.nbytes) == 0.0
        # Any part of it, at any offset.
        assert pages.huge_share(small.ctypes.data + 12345, 999_999) == 0.0
    finally:
        del small
        area.close()


def test_a_range_in_huge_pages_counts_whole_and_in_part() -> None:
    area, huge = _region(2 * _HUGE, _MADV_HUGEPAGE)
    try:
        huge[:] = 1
        share = pages.huge_share(huge.ctypes.data, huge.nbytes)
        if share is None:
            pytest.skip("this kernel cannot say (PAGEMAP_SCAN came with Linux 6.7)")
        given = _anon_huge_kb(huge.ctypes.data) << 10  # the kernel's other account
        if not given:
            pytest.skip("the kernel gave no huge page (transparent_hugepage off or none free)")
        assert share == given / huge.nbytes  # one of the two, or both
        if share == 1.0:
            assert pages.huge_share(huge.ctypes.data + 4096, _HUGE) == 1.0  # a part
    finally:
        del huge
        area.close()
