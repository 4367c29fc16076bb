"""This process's file mappings, as Linux lists them in ``/proc/self/maps``.

Saves replace a file by rename, so the path a map was opened from may name
another file by now: only the map's device and inode say which file it holds.
Where there is no ``/proc`` (not Linux), or its format is not this parser's,
no mapping is listed, and the callers fall back to what they can prove.
"""

import mmap
import os
import stat as stat_module
from typing import Iterator, NamedTuple, Optional

import numpy as np

__all__ = ["Mapping", "mappings", "mapped_for_writing", "shared_file_at", "memmap_file_offset"]


class Mapping(NamedTuple):
    """One mapping: ``[start, end)`` in memory, its permissions (``"rw-s"``), and the mapped file's identity.

    ``offset`` is the file offset mapped at ``start``; ``path`` the file's path as the kernel shows it
    (``""`` for an anonymous mapping; ending ``" (deleted)"`` once the file was removed).
    """

    start: int
    end: int
    permissions: str
    identity: tuple  # (st_dev, st_ino) as os.stat gives them; st_ino 0 for an anonymous mapping
    offset: int = 0
    path: str = ""


def mappings() -> Iterator[Mapping]:
    """This process's mappings, in address order (none where ``/proc/self/maps`` cannot be read)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()  # read whole: the list changes as the caller allocates
        for line in lines:
            parts = line.split(maxsplit=5)
            span, permissions, offset, device, inode = parts[:5]
            start, end = (int(part, 16) for part in span.split("-"))
            major, minor = (int(part, 16) for part in device.split(":"))
            yield Mapping(start, end, permissions, (os.makedev(major, minor), int(inode)), int(offset, 16),
                          parts[5].rstrip("\n") if len(parts) > 5 else "")
    except (OSError, ValueError):  # no /proc, or a format this parser does not know
        return


def mapped_for_writing(path) -> bool:
    """Whether this process maps the file at ``path`` shared and writable (its writes reach that file).

    Args:
        path: any path; a missing file is mapped by nothing.

    Returns:
        bool: False too where the mappings cannot be read.
    """
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return any(m.identity == (stat.st_dev, stat.st_ino) and "w" in m.permissions and m.permissions.endswith("s")
               for m in mappings())


def shared_file_at(address: int, size: int) -> Optional[Mapping]:
    """The shared mapping of a regular file that holds all of ``[address, address + size)``, if any.

    What a tensor or a plain array over a memory map (``torch.from_numpy(np.load(path,
    mmap_mode="r"))``, ``np.asarray(memmap)``) does not say itself: that its rows are a file's.

    Args:
        address: the first byte's address in this process.
        size: bytes from there (at least 1).

    Returns:
        The :class:`Mapping`, or None: the bytes are anonymous memory, a private (copy-on-write)
        map, in more than one mapping, or of a file whose path now names another file or none
        (removed: shared memory handed between processes, a replaced file).
    """
    found = next((m for m in mappings() if m.start <= address and address + size <= m.end), None)
    if found is None or not found.identity[1] or not found.permissions.endswith("s"):
        return None
    try:
        now = os.stat(found.path)
    except (OSError, ValueError):  # removed (the path ends " (deleted)"), or not a path at all
        return None
    if not stat_module.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != found.identity:
        return None
    return found


def memmap_file_offset(array, memmap=None) -> int:
    """The byte of its file at which an array over a memory map starts.

    Args:
        array: an ``np.memmap`` (or a view of one, which keeps its map) whose
            map is open (its ``_mmap`` is not None), or any array inside ``memmap``'s map.
        memmap: the ``np.memmap`` holding ``array``; None: ``array`` itself.

    Returns:
        The file offset of ``array``'s first byte.
    """
    memmap = array if memmap is None else memmap
    # np.memmap maps from the allocation boundary at or before its offset (a view keeps its
    # parent's); the array's own bytes start wherever it lies inside that map.
    mapped_from = memmap.offset - memmap.offset % mmap.ALLOCATIONGRANULARITY
    return mapped_from + array.ctypes.data - np.frombuffer(memmap._mmap, np.uint8).ctypes.data
