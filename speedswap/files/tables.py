"""Whole-table files: a 2-D table saved to or loaded from ``.npy`` or HDF5, all or nothing.

Picks the format from the suffix, stores a bfloat16 table as float32 (and
checks that a float32 file holds bfloat16 values before a bfloat16 table takes
them), and stages a load into a table in use (:func:`stage_table`): every row
is read and verified before :meth:`StagedRows.commit` changes anything.
"""

import os
import zlib
from typing import Optional

import numpy as np
import torch

from ..convert import torch_dtype
from ..errors import FileFormatError, SpeedswapError
from .base import TableHeader, file_format, reading_error, row_ranges
from .h5 import open_h5, read_h5_header, read_h5_into, write_h5
from .npy import read_npy_header, read_npy_into, write_npy

__all__ = ["stored_dtype", "read_table_header", "check_table_matches", "save_table", "read_table",
           "stage_table", "StagedRows", "STAGE_RAM_SHARE"]


def stored_dtype(table_dtype) -> np.dtype:
    """The numpy dtype a table of ``table_dtype`` is written as: its own, float32 for bfloat16.

    bfloat16 has no numpy dtype; float32 holds every bfloat16 value exactly
    and every tool reads it.
    """
    table_dtype = torch_dtype(table_dtype)
    return np.dtype(np.float32) if table_dtype is torch.bfloat16 else np.dtype(
        str(table_dtype).replace("torch.", ""))


def read_table_header(path, dataset: str = "table") -> TableHeader:
    """The validated header of a file holding a 2-D table.

    Args:
        path: ``*.npy``, ``*.h5`` or ``*.hdf5``.
        dataset: the HDF5 dataset.

    Raises:
        OptionError: another suffix.
        FileFormatError: a malformed file, not 2-D, or a dtype no table holds.
        FileNotFoundError: no such file.
    """
    header = read_npy_header(path) if file_format(path) == "npy" else read_h5_header(path, dataset)
    if len(header.shape) != 2:
        raise FileFormatError(f"{os.fspath(path)!r} holds an array of shape {header.shape}; "
                              f"a table needs 2-D (rows, dim)")
    if header.table_dtype is None:
        bits = (" If it is the file of a bfloat16 mmap table (its bit patterns), map it with "
                "HostTable.load(path, mmap=True, dtype='bfloat16')." if header.dtype == np.uint16 else "")
        raise FileFormatError(f"{os.fspath(path)!r} holds {header.dtype}, which no table holds; "
                              f"convert it with numpy first (e.g. a.astype(np.float32)).{bits}")
    return header


def check_table_matches(header: TableHeader, shape, dtype, path) -> None:
    """Raise FileFormatError unless ``header`` describes a table of ``shape`` and torch ``dtype``.

    A float32 file also matches a bfloat16 table (that is how one is stored);
    its values are checked to be exact bfloat16 values when they are read.
    """
    same_dtype = header.table_dtype == dtype or (
        dtype is torch.bfloat16 and header.dtype == np.float32)
    if tuple(header.shape) != tuple(shape) or not same_dtype:
        raise FileFormatError(f"{os.fspath(path)!r} holds {tuple(header.shape)} "
                              f"{header.table_dtype}, but this table is {tuple(shape)} {dtype}; "
                              f"load it into a table of the file's shape (HostTable.load) instead")


def save_table(table, path, dataset: str = "table") -> None:
    """Write ``table`` (a :class:`~speedswap.HostTable`) to ``.npy`` or HDF5 atomically.

    Rows are copied out in chunks (:meth:`~speedswap.HostTable.host_chunks`),
    so a device table never needs a full host copy; a bfloat16 table is
    written as float32 (exact) and, in HDF5, records its dtype.
    """
    stored = stored_dtype(table.dtype)
    if file_format(path) == "npy":
        write_npy(path, table.shape, stored, table.host_chunks())
    else:
        write_h5(path, {dataset: (table.shape, stored, table.host_chunks())},
                 table_dtypes={dataset: table.dtype})


def _file_chunks(path, header, dataset, ranges):
    """Yield ``(start, stop, numpy rows)`` of a validated table file, chunk by chunk.

    Raises:
        FileFormatError: a chunk cannot be read (corrupt, or the file changed).
    """
    try:
        if file_format(path) == "npy":
            source = np.memmap(path, dtype=header.dtype, mode="r", offset=header.offset,
                               shape=header.shape, order="C")
            for start, stop in ranges:
                yield start, stop, np.array(source[start:stop])
            return
        with open_h5(path) as f:
            for start, stop in ranges:
                yield start, stop, f[dataset][start:stop]
    except OSError as exc:
        if isinstance(exc, SpeedswapError):
            raise
        raise reading_error(path, exc) from exc


def _check_bfloat16(path, start, stop, rows):
    values = torch.from_numpy(np.ascontiguousarray(rows))
    if not torch.equal(values.to(torch.bfloat16).float(), values):
        raise FileFormatError(f"{os.fspath(path)!r} holds float32 values that are not "
                              f"bfloat16 values (rows {start}..{stop}); a bfloat16 table "
                              f"would round them: load it into a float32 table")


def read_table(table, path, header: TableHeader, dataset: str = "table") -> None:
    """Fill a *new* ``table`` with the rows of a file whose ``header`` matches it.

    For a table nobody holds yet (:meth:`~speedswap.HostTable.load`): rows are
    read straight into its memory, so a failure midway leaves it half-filled.
    To replace the rows of a table in use, :func:`stage_table` then
    :meth:`StagedRows.commit`, which is all-or-nothing.

    Raises:
        FileFormatError: the file cannot be read, or holds values a bfloat16 table would round.
    """
    target = table.as_tensor()
    if target.device.type == "cpu" and table.dtype is not torch.bfloat16:
        host = table.to_numpy()
        if file_format(path) == "npy":
            read_npy_into(path, host, header)
        else:
            read_h5_into(path, host, dataset, header)
        return
    for start, stop, rows in _file_chunks(path, header, dataset, row_ranges(header.shape, header.dtype)):
        if table.dtype is torch.bfloat16:
            _check_bfloat16(path, start, stop, rows)
        target[start:stop].copy_(torch.from_numpy(np.ascontiguousarray(rows)))


#: Rows are staged in RAM when they need at most this share of the RAM available.
STAGE_RAM_SHARE = 0.5


class StagedRows:
    """A table file read and verified completely, ready to be copied into a table.

    Made by :func:`stage_table`. Either the rows themselves (``rows``, a host
    array) or, for a file too large to hold twice in RAM, the proof that every
    chunk was readable, in which case :meth:`commit` reads the file again.
    """

    def __init__(self, path, header, dataset, rows, first: int = 0):
        self.path, self.header, self.dataset, self.rows = path, header, dataset, rows
        self.first = first  # the file row that rows[0] holds

    def commit(self, table, *, rows: Optional[range] = None, at: int = 0) -> None:
        """Copy the staged rows into ``table`` (its dtype and width as checked when staging).

        Args:
            table: the table to fill.
            rows: which of the file's rows (default: all, into a table of the file's shape).
            at: the table row the first of them goes to.

        Raises:
            FileFormatError: only for a file too large to stage in RAM that
                changed since it was verified.
        """
        rows = range(self.header.shape[0]) if rows is None else rows
        ranges = [(rows.start + a, rows.start + b)
                  for a, b in row_ranges((len(rows), *self.header.shape[1:]), self.header.dtype)]
        if self.rows is None:
            chunks = _file_chunks(self.path, self.header, self.dataset, ranges)
        else:
            chunks = ((a, b, self.rows[a - self.first:b - self.first]) for a, b in ranges)
        target = table.as_tensor()[at:at + len(rows)]
        # The table's own memory, not to_numpy(): for a table on the GPU that is a copy,
        # and rows written into it would never reach the table.
        host = target.numpy() if target.device.type == "cpu" and table.dtype is not torch.bfloat16 else None
        for start, stop, chunk in chunks:
            start, stop = start - rows.start, stop - rows.start
            if host is not None and host.dtype == chunk.dtype:
                np.copyto(host[start:stop], chunk, casting="no")
            else:
                target[start:stop].copy_(torch.from_numpy(np.ascontiguousarray(chunk)))


def stage_table(path, header: TableHeader, dataset: str, table_dtype, ram_available: int,
                crc32: Optional[int] = None, rows: Optional[range] = None) -> StagedRows:
    """Read and verify every row of a table file (or of ``rows``) before any table changes.

    The first half of an all-or-nothing load: a corrupt chunk, a truncated
    file or a float32 file with values a bfloat16 table would round raises
    here, while every table still holds what it held.

    Args:
        path: a file whose ``header`` was validated and matched to the table.
        header: its header.
        dataset: the HDF5 dataset.
        table_dtype: the torch dtype of the table it will fill.
        ram_available: bytes of RAM available now
            (:func:`speedswap.backends.available_ram`): the rows are held in
            RAM when they take at most :data:`STAGE_RAM_SHARE` of it, else
            only verified (and read again by :meth:`StagedRows.commit`).
        crc32: the CRC-32 of the stored bytes recorded when it was saved,
            checked when given (it covers the whole file: not with ``rows``).
        rows: only these rows of the file (a shard's share of a whole table);
            commit them with ``commit(table, rows=rows, at=...)``.

    Returns:
        StagedRows

    Raises:
        FileFormatError: a chunk cannot be read, a CRC-32 mismatch, or values a
            bfloat16 table would round.
    """
    rows = range(header.shape[0]) if rows is None else rows
    shape = (len(rows), *header.shape[1:])
    in_memory = int(np.prod(shape, dtype=np.int64)) * header.dtype.itemsize <= STAGE_RAM_SHARE * ram_available
    held = np.empty(shape, dtype=header.dtype) if in_memory else None
    ranges = [(rows.start + a, rows.start + b) for a, b in row_ranges(shape, header.dtype)]
    crc = 0
    for start, stop, chunk in _file_chunks(path, header, dataset, ranges):
        if table_dtype is torch.bfloat16:
            _check_bfloat16(path, start, stop, chunk)
        if crc32 is not None:
            crc = zlib.crc32(memoryview(np.ascontiguousarray(chunk)).cast("B"), crc)
        if held is not None:
            held[start - rows.start:stop - rows.start] = chunk
    if crc32 is not None and crc != crc32:
        raise FileFormatError(f"{os.fspath(path)!r} does not hold the bytes that were saved "
                              f"(CRC-32 {crc:#010x}, saved {crc32:#010x}): the file is corrupt; "
                              f"nothing was loaded. Restore it from a backup")
    return StagedRows(path, header, dataset, held, first=rows.start)
