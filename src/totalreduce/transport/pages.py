"""How much of a buffer huge pages back, which decides what lending its bytes costs.

``process_vm_readv`` (cma.py) pins the lender's pages one at a time, and pinning costs
more than copying: on a 2-vCPU AMD VM a 2 MiB read ran at 15 GB/s out of small (4 KiB)
pages and at 50 GB/s out of a transparent huge page, 8 MiB reads at 11 and 32-36 GB/s,
64 MiB at 8-9 and 15 GB/s (where memory bounds both).  MPICH's reads cost the same.
numpy asks for huge pages for arrays of 4 MiB and more (all but their unaligned ends get
them where the kernel's ``transparent_hugepage`` setting is ``madvise`` or ``always``);
torch's CPU tensors, by default, get small pages.

Linux 6.7's ``PAGEMAP_SCAN`` on ``/proc/self/pagemap`` answers for a range in one call;
before it (or elsewhere) nothing here can tell, but where the kernel never makes huge
pages the answer is none.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import threading
from typing import Any


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg (linux/fs.h)
    _fields_ = [("size", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("walk_end", ctypes.c_uint64), ("vec", ctypes.c_uint64),
                ("vec_len", ctypes.c_uint64), ("max_pages", ctypes.c_uint64),
                ("category_inverted", ctypes.c_uint64), ("category_mask", ctypes.c_uint64),
                ("category_anyof_mask", ctypes.c_uint64), ("return_mask", ctypes.c_uint64)]


class _Region(ctypes.Structure):  # struct page_region
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


_PAGE_IS_HUGE = 1 << 6
# _IOWR('f', 16, struct pm_scan_arg)
_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16
_REGIONS = 64  # runs of huge pages reported per call (a buffer has one or a few)
_PAGE = 4096
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def _load() -> Any:
    if platform.system() != "Linux":
        return None
    try:
        ioctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).ioctl
    except (OSError, AttributeError):
        return None
    ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    ioctl.restype = ctypes.c_int
    return ioctl


def _never_huge() -> bool:
    """Whether the kernel makes no transparent huge pages at all (``[never]``)."""
    try:
        with open(_THP_SETTING) as f:
            return "[never]" in f.read()
    except OSError:
        return platform.system() == "Linux"  # a Linux kernel without them


class _Pagemap:
    """This process's ``/proc/self/pagemap``, opened again after a fork: the file answers
    for the process that opened it."""

    def __init__(self) -> None:
        self._ioctl = _load()
        self._lock = threading.Lock()
        self._fd = -1
        self._pid = 0
        self._works = self._ioctl is not None
        self._never = False
        self._regions = (_Region * _REGIONS)()  # the kernel's answers (under the lock)

    def huge_share(self, address: int, nbytes: int) -> float | None:
        if nbytes <= 0:
            return 0.0
        if not self._works:
            return self._unknown()
        start = address & ~(_PAGE - 1)
        end = (address + nbytes + _PAGE - 1) & ~(_PAGE - 1)
        huge = 0
        with self._lock:
            regions = self._regions
            fd = self._open()
            if fd < 0:
                return self._unknown()
            while start < end:
                arg = _ScanArg(ctypes.sizeof(_ScanArg), 0, start, end, 0,
                               ctypes.addressof(regions), _REGIONS, 0, 0, _PAGE_IS_HUGE, 0,
                               _PAGE_IS_HUGE)
                got = self._ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
                if got < 0:
                    # ENOTTY or EINVAL before Linux 6.7: never ask again.
                    self._give_up()
                    return self._unknown()
                for region in regions[:got]:  # whole pages: clip them to the range
                    huge += max(0, min(region.end, address + nbytes)
                                - max(region.start, address))
                if got < _REGIONS or arg.walk_end <= start:
                    break
                start = arg.walk_end
        return huge / nbytes

    def _open(self) -> int:
        pid = os.getpid()
        if self._pid != pid:
            if self._fd >= 0:  # the parent's, inherited
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
            try:
                self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._give_up()
                return -1
            self._pid = pid
        return self._fd

    def _give_up(self) -> None:
        self._works = False
        self._never = _never_huge()

    def _unknown(self) -> float | None:
        """The answer where the kernel cannot say: none where it makes no huge pages."""
        return 0.0 if self._never else None


_pagemap = _Pagemap()


def huge_share(address: int, nbytes: int) -> float | None:
    """The share (0.0 to 1.0) of the ``nbytes`` bytes at ``address`` in this process that
    huge pages back now (pages not yet touched count as small ones); None where the kernel
    cannot say."""
    return _pagemap.huge_share(address, nbytes)
