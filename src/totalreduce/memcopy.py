"""Big memory copies in pieces, where the C library copies pieces faster than the whole.

glibc's ``memcpy`` (which numpy's copies and memoryview slice assignments call) picks its
method by size.  On AMD CPUs it moves a block with ``rep movsb`` only while the block is
smaller than the core's L2 cache (its ``rep_movsb_stop_threshold``), and with a vector
loop from there on (elsewhere ``rep movsb`` goes on up to the non-temporal threshold,
megabytes further).  The vector loop first reads every destination line for ownership;
``rep movsb`` writes whole lines without.  That costs most where the destination's lines
sit in another core's cache, as a shared-memory ring's do, which the peer read out of a
lap ago.  On a 2-vCPU AMD EPYC VM (glibc 2.36, 1 MiB L2), writing into a buffer another
process had just read, in the placement where the two vCPUs share no cache:

=================  ==========  =============  ==============
copy               whole       1 MiB pieces   512 KiB pieces
=================  ==========  =============  ==============
1 MiB              129-130 us  (the whole)    26 us
2 MiB              209 us      255 us         51 us
4 MiB              335 us      371 us         105 us
=================  ==========  =============  ==============

(in the other placement 20.5 us whole, 16 us in 512 KiB pieces, for 1 MiB).  A 2-rank
3 MiB broadcast, whose three 1 MiB pieces went into the ring one copy each, took
0.39-0.42 ms there against 0.095 ms with each copy in two.  Into private memory no cache
holds, 32 and 128 MiB copies took 1.70 and 7.3 ms whole against 1.43-1.47 and 5.9-6.2 in
512 KiB pieces (2-8 MiB ones 2-5 % longer in pieces, which is why those stay whole).

So on AMD CPUs a message body's copy (:func:`copy_bytes`: into a ring, or out of one
into place) of at least ``L2`` bytes goes in pieces of half of it, and so does an
array's (:func:`copy_array`) from :data:`PRIVATE_FROM`.  ``TOTALREDUCE_COPY_PIECE`` sets
the piece (0: whole copies).
"""

from __future__ import annotations

import platform

import numpy as np

# Private copies from this size go in pieces: below it, pieces ran no faster (see above).
PRIVATE_FROM = 16 << 20
# The smallest piece TOTALREDUCE_COPY_PIECE may set: a copy under twice it is never cut.
MIN_PIECE = 4096


def _l2_bytes() -> int:
    """The first CPU's L2 cache size as the kernel reports it; 0 where it does not."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
    except OSError:
        return 0
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    digits = text.rstrip("KM")
    return int(digits) * scale if digits.isdigit() else 0


def _amd() -> bool:
    """Whether this is Linux on an AMD (or Hygon) x86-64 CPU, whose glibc stops using
    ``rep movsb`` at the L2 size."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() in ("AuthenticAMD", "HygonGenuine")
    except OSError:
        pass
    return False


def auto_piece() -> int:
    """The piece for this machine: half its L2 cache on AMD CPUs (512 KiB where the
    kernel does not say), 0 (whole copies) elsewhere."""
    if not _amd():
        return 0
    l2 = _l2_bytes()
    return l2 // 2 if l2 >= 64 << 10 else 512 << 10


_auto = auto_piece()  # the CPU does not change: asked once
_piece = _auto


def set_piece(piece: int) -> None:
    """Use pieces of ``piece`` bytes from now on (0: whole copies; negative: auto)."""
    global _piece
    _piece = _auto if piece < 0 else piece


def piece() -> int:
    return _piece


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for two flat byte views of one length: in pieces where it is at
    least twice the piece (the glibc threshold the piece is half of)."""
    n = src.nbytes
    step = _piece
    if (not step or n < 2 * step or src.ndim != 1 or dst.ndim != 1 or src.format != "B"
            or dst.format != "B"):
        dst[:] = src  # raises as a slice assignment does where the two differ
        return
    for lo in range(0, n, step):
        hi = lo + step
        dst[lo:hi] = src[lo:hi]


def copy_array(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)``: in pieces where both are contiguous arrays of one dtype
    and shape, at least :data:`PRIVATE_FROM` bytes."""
    if (_piece and dst.nbytes >= PRIVATE_FROM and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.flags.c_contiguous
            and src.flags.c_contiguous):
        copy_bytes(dst.reshape(-1).data.cast("B"), src.reshape(-1).data.cast("B"))
    else:
        np.copyto(dst, src)

