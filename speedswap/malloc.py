"""Keep freed memory in the process: glibc's malloc settings for training on a CPU.

On a CPU every lookup's backward allocates a zeroed gradient of the whole
working set (``max_rows`` x dim: 14 MiB at 28,672 x 128). glibc's malloc
hands blocks of that size back to the kernel when they are freed (they were
mapped on their own, or the heap is trimmed once its free top passes the
trim threshold), so the next step takes a page fault on each 4 KiB of them
again: a third of the offloaded skip-gram step of ``benchmarks/allocator.py``.
:func:`keep_freed_memory` sets, from inside the running process, what the
environment variables ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_``
set at its start, which a notebook's kernel or a library user's script
cannot do.

It changes the whole process's allocator, not only speedswap's tensors:
freed blocks below 32 MiB are kept for reuse instead of being returned to the
kernel, so the process's resident memory stays near its peak. So speedswap
never calls it on its own: the program that owns the process decides.
"""

import ctypes
import sys

__all__ = ["keep_freed_memory"]

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Trimming only past 2 GiB of free heap top: mallopt takes a C int, and the environment
# variable's 1 TiB cannot be given here; a heap with 2 GiB free on top is trimmed, as it should be.
KEEP_TRIM_THRESHOLD = 2**31 - 1
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): blocks below it come
# from the heap, and larger ones (a table, a dataset) are still mapped, and unmapped, on their own.
KEEP_MMAP_THRESHOLD = 32 << 20


def _glibc():
    """The process's own C library (the one torch allocates with) when it is glibc, else None."""
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # not musl or another libc


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks below 32 MiB for the process's next allocations.

    Call it once, at the start of a training program on a CPU (on a GPU
    torch's caching allocator already keeps device memory, and the host side
    allocates little per step). It made the offloaded skip-gram step 1.3x
    faster on a 2-core machine, as the environment variables do
    (``benchmarks/allocator.py``, ``benchmarks/README.md``). The memory the process frees stays with it:
    its resident size stays near the peak of what it allocated in blocks
    below 32 MiB.

    Returns:
        True when glibc took both settings; False where the C library is not
        glibc (macOS, Windows, musl), which has no such settings: nothing
        changed there. With tcmalloc or jemalloc preloaded, their own
        ``mallopt`` answers.
    """
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # The trim threshold first: setting the mmap threshold also ends glibc's dynamic thresholds.
    return bool(mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)) and bool(
        mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD))
