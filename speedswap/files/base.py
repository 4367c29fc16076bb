"""What ``.npy`` and HDF5 files share: the format from a suffix, the header, rows in chunks.

The layer under :mod:`~speedswap.files.npy` and :mod:`~speedswap.files.h5`:
:class:`TableHeader` (what a file says about its array), the checks a file
passes before it is read, the row ranges reads and writes go by, and
:func:`write_chunk`, the single place table bytes reach a file.
"""

import io
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from ..atomic import as_path
from ..convert import torch_dtype
from ..errors import DTypeError, FileFormatError, OptionError
from ..mappings import mappings

__all__ = [
    "NPY_SUFFIXES",
    "H5_SUFFIXES",
    "suffix_format",
    "file_format",
    "TableHeader",
    "check_dtype",
    "native_dtype",
    "table_dtype_of",
    "reading_error",
    "check_matches",
    "identity",
    "file_version",
    "changed_error",
    "check_version",
    "mapped_identity",
    "CHUNK_BYTES",
    "crc32_of",
    "crc32_behind",
    "write_chunk",
    "row_ranges",
]

NPY_SUFFIXES = (".npy",)
H5_SUFFIXES = (".h5", ".hdf5")


def suffix_format(path) -> Optional[str]:
    """``"npy"``, ``"h5"``, or None (another suffix) from a path's suffix: the one place that sniffs it."""
    suffix = os.path.splitext(as_path(path))[1].lower()
    if suffix in NPY_SUFFIXES:
        return "npy"
    if suffix in H5_SUFFIXES:
        return "h5"
    return None


def file_format(path) -> str:
    """``"npy"`` or ``"h5"`` from a path's suffix.

    Raises:
        OptionError: the suffix is neither.
    """
    fmt = suffix_format(path)
    if fmt is None:
        raise OptionError(f"cannot tell the format of {os.fspath(path)!r}: name it *.npy "
                          f"(numpy) or *.h5 / *.hdf5 (HDF5)")
    return fmt


@dataclass(frozen=True)
class TableHeader:
    """What a file says about the array inside it.

    Attributes:
        shape: the array's shape.
        dtype: the numpy dtype stored in the file.
        offset: where the data starts (``.npy`` only).
        table_dtype: the torch dtype of the table it holds. ``bfloat16`` tables
            are stored as float32 (exact, and readable by any tool) and say so
            in an HDF5 attribute or a checkpoint's manifest.
        crc32: the CRC-32 of the stored bytes, where the file records one (the
            datasets of a speedswap HDF5 checkpoint); a read verifies it.
        version: the :func:`file_version` of the file the header was read from,
            as it was open for that read. A read of the rows opens the path
            again, and must find that very file, unchanged
            (:func:`check_version`): a save renamed to the path meanwhile
            would have its rows read by another file's header.
    """

    shape: tuple
    dtype: np.dtype
    offset: int = 0
    table_dtype: Optional[torch.dtype] = None
    crc32: Optional[int] = None
    version: Optional[tuple] = None


def check_dtype(dtype, path):
    """Raise FileFormatError unless ``dtype`` is a plain numeric dtype (no objects or records)."""
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise FileFormatError(f"{path!r} holds an array of {dtype}; speedswap reads plain "
                              f"numeric arrays only (no objects or records)")


def native_dtype(dtype) -> np.dtype:
    """``dtype`` in this machine's byte order: what rows stored byte-swapped (a big-endian file) are read as."""
    return np.dtype(dtype).newbyteorder("=")


def table_dtype_of(dtype):
    """The table dtype a stored numpy dtype stands for, or None when no table can hold it.

    Byte-swapped data stands for the same numbers: a copy of it is swapped as it is read.
    """
    try:
        return torch_dtype(native_dtype(dtype))
    except DTypeError:
        return None


def identity(stat) -> tuple:
    """``(st_dev, st_ino)`` of an ``os.stat`` result: which file it is, whatever its path."""
    return stat.st_dev, stat.st_ino


def file_version(stat) -> tuple:
    """Which file an ``os.stat`` result is, and its size and change times: any write changes one.

    The times are as fine as the file system keeps them: a write within the
    same clock tick as an earlier ``stat`` may leave them equal.
    """
    return (*identity(stat), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def changed_error(path) -> FileFormatError:
    """The :class:`FileFormatError` for a file changed or replaced between its verification and a read of it."""
    return FileFormatError(f"{os.fspath(path)!r} was changed or replaced since it was verified (a "
                           f"save to it, or another writer?); nothing was loaded from it: load it again "
                           f"once the writer is done (do not save to a file while it is loaded)")


def check_version(header: TableHeader, fd: int, path, *, unchanged: bool = True) -> None:
    """Raise :func:`changed_error` unless the file open as ``fd`` is the one ``header`` was read from, unchanged.

    Args:
        header: the file's header (one with no ``version`` passes).
        fd: the file opened again to read its rows.
        path: its path, for the message.
        unchanged: also refuse a write to it since (its size or times changed). False
            for a map, which shares its rows with whoever writes them (another
            process's ``mmap`` table): only which file it is matters.
    """
    if header.version is None:
        return
    now = file_version(os.fstat(fd))
    if (now != header.version) if unchanged else (now[:2] != header.version[:2]):
        raise changed_error(path)


def mapped_identity(address) -> Optional[tuple]:
    """``(st_dev, st_ino)`` of the file mapped at ``address`` in this process, or None if unknown.

    The path a memmap was opened from may name another file by now (saves
    replace by rename), so only the map itself says which file it holds:
    Linux lists each mapping's device and inode in ``/proc/self/maps``.

    Args:
        address: an address inside the mapping.

    Returns:
        the identity as ``os.stat`` gives it, or None: no ``/proc`` (not
        Linux), no mapping there, or an anonymous one.
    """
    found = next((m for m in mappings() if m.start <= address < m.end), None)
    return found.identity if found is not None and found.identity[1] else None


def reading_error(path, exc) -> FileFormatError:
    """A :class:`FileFormatError` for an OSError raised while reading rows of ``path``."""
    return FileFormatError(f"{os.fspath(path)!r} could not be read ({exc}); the file is "
                           f"corrupt or was changed during the load: nothing was loaded from it")


def check_matches(header, shape, dtype, path):
    """Raise FileFormatError unless ``header`` describes ``shape``/``dtype`` (in either byte order)."""
    if tuple(header.shape) != tuple(shape) or native_dtype(header.dtype) != native_dtype(dtype):
        raise FileFormatError(f"{os.fspath(path)!r} holds {tuple(header.shape)} {header.dtype}, "
                              f"but this table is {tuple(shape)} {np.dtype(dtype)}; load it into "
                              f"a table of the file's shape (HostTable.load) instead")


#: About how many bytes one chunk of rows holds, read or written.
CHUNK_BYTES = 64 << 20


def crc32_of(chunk, crc: int = 0) -> int:
    """The CRC-32 of ``chunk``'s bytes, continued from ``crc``: what saves record and loads verify."""
    return zlib.crc32(memoryview(np.ascontiguousarray(chunk)).cast("B"), crc)


def crc32_behind(chunks: Iterable[np.ndarray], running: Optional[list] = None) -> int:
    """The :func:`crc32_of` all that ``chunks`` yields, each chunk's on a second thread while the next is made.

    ``zlib.crc32`` releases the GIL over more than 5 KiB, so reading chunk
    ``i + 1`` (the iteration) and checksumming chunk ``i`` overlap, where a
    second core is free. One worker runs the CRC-32s in order, each
    continuing the one before. The next chunk is asked for only once the
    CRC-32 before the last one is done: at most two chunks wait for theirs,
    however much faster the reads are (a read may make new arrays). Where no
    thread can start, they run on the caller's thread, one after each read.

    Args:
        chunks: arrays none of which changes once yielded (the rows just read).
        running: a list to extend by the CRC-32 of the chunks up to each one, in order.

    Returns:
        the CRC-32 of their bytes, in order.
    """
    worker = ThreadPoolExecutor(1, thread_name_prefix="speedswap-crc32")
    try:
        crcs = [worker.submit(int)]  # 0, the CRC-32 of nothing; starts the thread
    except RuntimeError:  # no thread can start (the thread limit, interpreter shutdown): on this one
        worker.shutdown()
        crc = 0
        for chunk in chunks:
            crc = crc32_of(chunk, crc)
            if running is not None:
                running.append(crc)
        return crc
    with worker:
        for chunk in chunks:
            crcs.append(worker.submit(lambda chunk=chunk, before=crcs[-1]: crc32_of(chunk, before.result())))
            crcs[-2].result()
        if running is not None:
            running.extend(crc.result() for crc in crcs[1:])
        return crcs[-1].result()


def write_chunk(sink, start, chunk):
    """Write one chunk of rows at row ``start``: the single place table bytes reach a file.

    ``sink`` is an open binary file (written sequentially) or an HDF5 dataset.
    Fault-injection tests make this fail on purpose; every writer calls it as
    ``base.write_chunk`` so that replacing it here reaches them all.
    """
    if isinstance(sink, io.IOBase):
        sink.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
    else:
        sink[start:start + len(chunk)] = chunk


def row_ranges(shape, dtype, chunk_bytes=None):
    """``(start, stop)`` row ranges of about ``chunk_bytes`` (64 MiB) each covering ``shape[0]`` rows."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize)
    step = max(1, chunk_bytes // row_bytes)
    return [(s, min(s + step, shape[0])) for s in range(0, shape[0], step)]
