"""The CPU backend: tables are numpy arrays, the "device" is the CPU.

This is the backend CI runs. Storage kinds that need a GPU (``pinned``,
``mapped``, ``device``) are ordinary host memory here, because there is no
device to pin for; :attr:`Buffer.pinned` says so. A ``device`` buffer still
has no :attr:`Buffer.host` view, as on a GPU: its table hands out copies of
its rows only, so code that writes into a device table's ``to_numpy()``
fails here as it would on a GPU.
"""

import mmap
import os

import numpy as np
import torch

from ..convert import host_tensor, numpy_dtype, numpy_view, torch_dtype
from .base import Backend, Buffer

__all__ = ["NumpyBackend", "anonymous_array", "huge_page_array", "available_ram", "assign_rows"]

# Below this a table spans few pages anyway; above it TLB misses dominate random row access.
_HUGE_PAGE_MIN_BYTES = 8 << 20


#: This process's cgroups, one line per hierarchy: ``0::/path`` (v2) or ``4:memory:/path`` (v1).
_PROC_CGROUP = "/proc/self/cgroup"
#: Where each version's memory hierarchy is mounted (a container sees its own cgroup there as ``/``).
_CGROUP_MOUNTS = {"v2": "/sys/fs/cgroup", "v1": "/sys/fs/cgroup/memory"}
#: Each version's limit, usage and stat files, and the stat key of reclaimable page cache.
_MEMORY_FILES = {"v2": ("memory.max", "memory.current", "memory.stat", "inactive_file"),
                 "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file")}


def available_ram() -> int:
    """Bytes of RAM available to new allocations now.

    ``MemAvailable`` on Linux, or less where the process's memory cgroup (a
    container's limit) grants less: ``MemAvailable`` is the host's, and a
    process past its cgroup's limit is killed, not refused.
    """
    room = _cgroup_room()
    host = _meminfo_available()
    return host if room is None else min(host, room)


def _meminfo_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, or the free pages where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room():
    """The least that the memory limits of this process's cgroup and its ancestors still grant, or None without one.

    A limit may lie on any of them: a container's on its own cgroup, a Slurm
    job's on the job's, above the process's step.
    """
    rooms = [room for directory, version in _memory_cgroups() if (room := _room_in(directory, version)) is not None]
    return min(rooms, default=None)


def _memory_cgroups() -> list:
    """``(directory, version)`` of this process's memory cgroup and of each ancestor up to its mount point."""
    try:
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(":", 2)  # hierarchy id, controllers, path
        version = (None if len(fields) != 3 else "v2" if fields[1] == "" else
                   "v1" if "memory" in fields[1].split(",") else None)
        if version is not None:
            parts = [part for part in fields[2].split("/") if part]
            found += [(os.path.join(_CGROUP_MOUNTS[version], *parts[:depth]), version)
                      for depth in range(len(parts), -1, -1)]
    return found


def _room_in(directory, version):
    """Bytes the memory limit of the cgroup at ``directory`` still grants (its reclaimable page cache
    counted), or None: no limit there, or no cgroup of this version (a parser that does not know its files)."""
    limit_name, usage_name, stat_name, inactive_key = _MEMORY_FILES[version]
    try:
        with open(os.path.join(directory, limit_name)) as f:
            limit = f.read().strip()
        if limit == "max":  # cgroup v2 without a limit (v1 says so with a huge number)
            return None
        with open(os.path.join(directory, usage_name)) as f:
            usage = int(f.read())
        with open(os.path.join(directory, stat_name)) as f:
            inactive = next((int(line.split()[1]) for line in f if line.split()[:1] == [inactive_key]), 0)
        return max(0, int(limit) - usage + inactive)
    except (OSError, ValueError, IndexError):
        return None


def anonymous_array(shape, dtype):
    """An uninitialised array in an anonymous mapping of its own, page-aligned.

    Its pages belong to it alone (``cudaHostRegister`` locks whole pages), and
    the mapping is unmapped when the last array viewing it is collected: the
    returned array is the owner every view refers back to. From 8 MiB on it
    asks for transparent huge pages (see :func:`huge_page_array`).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    block = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE)
    return np.ndarray(shape, dtype=dtype, buffer=block)


def huge_page_array(shape, dtype):
    """An uninitialised array in anonymous memory that asks for transparent huge pages.

    A gather of random rows from a large table misses the TLB on nearly every
    row with 4 KiB pages; with 2 MiB pages it mostly hits (measured about 25%
    faster gathers and scatters on a 1 GiB table, see benchmarks/NOTES.md).
    Below 8 MiB, or where the platform has no ``madvise``, this is a plain
    ``np.empty``. The memory is unmapped when the last array viewing it is collected.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < _HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype=dtype)
    return anonymous_array(shape, dtype)


class NumpyBackend(Backend):
    """Rows in host memory, moved with torch's multi-threaded CPU kernels."""

    name = "numpy"
    device = torch.device("cpu")

    @classmethod
    def is_available(cls):
        return True

    def allocate(self, shape, dtype, kind):
        array = huge_page_array(shape, numpy_dtype(dtype))
        # "device" is the device's memory, which the host sees only as a copy on a GPU: handing
        # out a host view here would let code pass on the CPU that fails on a GPU.
        return Buffer(kind=kind, host=None if kind == "device" else array, tensor=host_tensor(array, dtype))

    def adopt(self, array, kind, dtype=None):
        return Buffer(kind=kind, host=array, tensor=host_tensor(array, dtype or torch_dtype(array.dtype)))

    def gather(self, buffer, rows, out):
        # index_select into a preallocated output: one parallel pass, no temporary.
        return torch.index_select(buffer.tensor, 0, rows, out=out)

    def scatter(self, buffer, rows, values):
        target = buffer.host
        if target is None:
            # A device buffer hands out no host view (see allocate), yet its memory is the CPU's:
            # numpy's assignment writes it 2-3x faster than index_copy_ (bfloat16 as its bit patterns).
            target = numpy_view(buffer.tensor)
        assign_rows(target, rows, values)


def assign_rows(target: np.ndarray, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``target[rows] = values`` on the CPU, for unique ``rows``, by numpy's fancy assignment.

    numpy copies whole rows; torch's CPU ``index_copy_`` took 1.3x as long (346 vs
    259 us for 4,900 rows of 100 floats, 7% of a word2vec training step).

    Args:
        target: the rows' home, a 2-D numpy array (bfloat16 held as its ``uint16`` bit
            patterns, see ``convert.numpy_view``).
        rows: unique int64 row ids, a CPU tensor.
        values: ``(len(rows), dim)`` CPU tensor of the table's dtype.
    """
    target[rows.numpy()] = numpy_view(values.detach())
