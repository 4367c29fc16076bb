"""This process's file mappings, as Linux lists them in ``/proc/self/maps``.

Saves replace a file by rename, so the path a map was opened from may name
another file by now: only the map's device and inode say which file it holds.
Where there is no ``/proc`` (not Linux), or its format is not this parser's,
no mapping is listed, and the callers fall back to what they can prove.
"""

import os
from typing import Iterator, NamedTuple

__all__ = ["Mapping", "mappings", "mapped_for_writing"]


class Mapping(NamedTuple):
    """One mapping: ``[start, end)`` in memory, its permissions (``"rw-s"``), and the mapped file's identity."""

    start: int
    end: int
    permissions: str
    identity: tuple  # (st_dev, st_ino) as os.stat gives them; st_ino 0 for an anonymous mapping


def mappings() -> Iterator[Mapping]:
    """This process's mappings, in address order (none where ``/proc/self/maps`` cannot be read)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()  # read whole: the list changes as the caller allocates
        for line in lines:
            span, permissions, _, device, inode = line.split(maxsplit=5)[:5]
            start, end = (int(part, 16) for part in span.split("-"))
            major, minor = (int(part, 16) for part in device.split(":"))
            yield Mapping(start, end, permissions, (os.makedev(major, minor), int(inode)))
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
