"""Whole-table files: a 2-D table saved to or loaded from ``.npy`` or HDF5, all or nothing.

Picks the format from the suffix, stores a bfloat16 table as float32 (and
checks that a float32 file holds bfloat16 values before a bfloat16 table takes
them), and stages a load into a table in use (:func:`stage_table`): every row
is read and verified before :meth:`StagedRows.commit` changes anything.
"""

import os
from typing import Optional

import numpy as np
import torch

from ..atomic import one_save_at_a_time
from ..convert import torch_dtype
from ..errors import FileFormatError, OptionError, PathError, SpeedswapError
from .base import (TableHeader, changed_error, check_version, crc32_behind, crc32_of, file_format, file_version,
                   native_dtype, reading_error, row_ranges)
from .h5 import (dataset_names, normal_dataset_name, open_h5, read_before_replacing, read_h5_header, read_h5_into,
                 write_h5)
from .npy import read_npy_header, read_npy_into, read_npy_rows, write_npy

__all__ = ["stored_dtype", "read_table_header", "check_table_shape", "check_table_matches", "save_table", "read_table",
           "stage_table", "StagedRows", "STAGE_RAM_SHARE"]


def stored_dtype(table_dtype) -> np.dtype:
    """The numpy dtype a table of ``table_dtype`` is written as: its own, float32 for bfloat16.

    bfloat16 has no numpy dtype; float32 holds every bfloat16 value exactly
    and every tool reads it.
    """
    table_dtype = torch_dtype(table_dtype)
    return np.dtype(np.float32) if table_dtype is torch.bfloat16 else np.dtype(
        str(table_dtype).replace("torch.", ""))


def _format_of(path, dataset) -> str:
    """``file_format(path)``, refusing a ``dataset`` other than the default for a ``.npy`` file.

    A ``.npy`` file holds one array: a dataset name there would be ignored,
    and the caller believes it saved or read the table under that name.
    """
    fmt = file_format(path)
    if fmt == "npy" and dataset != "table":
        raise OptionError(f"dataset={dataset!r} names an HDF5 dataset, but {os.fspath(path)!r} is a .npy "
                          f"file, which holds one array: drop dataset, or use an .h5 path")
    return fmt


def read_table_header(path, dataset: str = "table") -> TableHeader:
    """The validated header of a file holding a 2-D table.

    Args:
        path: ``*.npy``, ``*.h5`` or ``*.hdf5``.
        dataset: the HDF5 dataset.

    Raises:
        OptionError: another suffix, or a ``dataset`` other than ``"table"`` for a ``.npy`` file.
        FileFormatError: a malformed file, not 2-D, no rows or empty rows, or a
            dtype no table holds.
        FileNotFoundError: no such file.
    """
    header = read_npy_header(path) if _format_of(path, dataset) == "npy" else read_h5_header(path, dataset)
    check_table_shape(header.shape, path)
    if header.table_dtype is None:
        bits = (" If it is the file of a bfloat16 mmap table (its bit patterns), map it with "
                "HostTable.load(path, mmap=True, dtype='bfloat16')." if header.dtype == np.uint16 else "")
        raise FileFormatError(f"{os.fspath(path)!r} holds {header.dtype}, which no table holds; "
                              f"convert it with numpy first (e.g. a.astype(np.float32)).{bits}")
    return header


def check_table_shape(shape, path) -> None:
    """Raise FileFormatError unless a file's array of ``shape`` can be a table: 2-D, no side 0.

    As :meth:`~speedswap.HostTable.empty` refuses to make a table of no rows,
    a load refuses a file of none, mapped or copied alike.
    """
    if len(shape) != 2:
        # A vector (biases, one value per row) is the usual case, and one reshape away from a table.
        vector = (" For one value per row, save the vector as a column: np.save(path, "
                  "np.load(path).reshape(-1, 1))" if len(shape) == 1 else "")
        raise FileFormatError(f"{os.fspath(path)!r} holds an array of shape {tuple(shape)}; "
                              f"a table needs 2-D (rows, dim).{vector}")
    if 0 in shape:
        raise FileFormatError(f"{os.fspath(path)!r} holds an array of shape {tuple(shape)}: no rows, "
                              f"or rows of no values; a table needs at least one row of at least "
                              f"one value")


def check_table_matches(header: TableHeader, shape, dtype, path) -> None:
    """Raise FileFormatError unless ``header`` describes a table of ``shape`` and torch ``dtype``.

    A float32 file also matches a bfloat16 table (that is how one is stored);
    its values are checked to be exact bfloat16 values when they are read.
    """
    same_dtype = header.table_dtype == dtype or (
        dtype is torch.bfloat16 and header.dtype == np.float32)
    mismatch = (f"{os.fspath(path)!r} holds {tuple(header.shape)} {header.table_dtype}, but this "
                f"table is {tuple(shape)} {dtype}")
    if tuple(header.shape) != tuple(shape):
        raise FileFormatError(f"{mismatch}; load it into a table of the file's shape (HostTable.load) instead")
    if not same_dtype:
        # Commonly vectors numpy made in its default float64: converting the file is the fix.
        raise FileFormatError(f"{mismatch}; convert the file with numpy first (np.save(path, np.load(path)"
                              f".astype(np.{stored_dtype(dtype)}))), or load it into a table of "
                              f"{header.table_dtype} (HostTable.load)")


def save_table(table, path, dataset: str = "table") -> None:
    """Write ``table`` (a :class:`~speedswap.HostTable`) to ``.npy`` or HDF5 atomically.

    Rows are copied out in chunks (:meth:`~speedswap.HostTable.host_chunks`),
    so a device table never needs a full host copy; a bfloat16 table is
    written as float32 (exact) and, in HDF5, records its dtype. An HDF5 file
    records the CRC-32 of the rows too, which every load verifies. Saves to
    one path take turns (:func:`~speedswap.atomic.one_save_at_a_time`).
    """
    stored = stored_dtype(table.dtype)
    if _format_of(path, dataset) == "npy":
        write_npy(path, table.shape, stored, table.host_chunks())
    else:
        with one_save_at_a_time(path):  # the check and the write: another save to path waits for both
            _check_no_other_datasets(path, dataset)
            write_h5(path, {dataset: (table.shape, stored, table.host_chunks())},
                     table_dtypes={dataset: table.dtype})


def _check_no_other_datasets(path, dataset) -> None:
    """Refuse to replace an HDF5 file that holds datasets besides ``dataset``.

    A save writes the whole file (atomically, under a temporary name), so
    saving table B as ``"v"`` into the file holding table A as ``"u"`` would
    silently delete A.

    Raises:
        PathError: the file holds other datasets, or changed while it was
            checked (:func:`~speedswap.files.h5.read_before_replacing`); nothing is written.
    """
    name = normal_dataset_name(dataset)  # a non-name is refused as such, before the file is read
    if not os.path.isfile(path):
        return
    names = read_before_replacing(path, dataset_names)
    if names is None:
        return  # not HDF5: nothing of it would be kept by any HDF5 write
    others = sorted(set(names) - {name})
    if others:
        raise PathError(f"{os.fspath(path)!r} holds the datasets {others} besides {dataset!r}, and a save "
                        f"writes the whole file: it would delete them. Save to another file (one per "
                        f"table), or delete the file first if they are yours to lose")


def _file_chunks(path, header, dataset, ranges, version=None):
    """Yield ``(start, stop, numpy rows)`` of a validated table file, chunk by chunk, in this machine's byte order.

    The file opened must be the one ``header`` was read from, unchanged
    (:func:`~speedswap.files.base.check_version`).

    Args:
        version: when given, the file opened must still be the one of this
            :func:`~speedswap.files.base.file_version`, or nothing is read (the
            reads all go through that one open file, whatever its path names later).

    Raises:
        FileFormatError: a chunk cannot be read (corrupt, or the file
            changed), or the file is not ``version``.
    """
    try:
        if file_format(path) == "npy":
            # Read, not mapped: a file truncated while it is read raises instead of SIGBUS.
            with open(path, "rb") as f:
                check_version(header, f.fileno(), path)
                if version is not None and file_version(os.fstat(f.fileno())) != version:
                    raise changed_error(path)
                for start, stop in ranges:
                    yield start, stop, _native(read_npy_rows(f, header, start, stop, path))
            return
        with open_h5(path) as f:
            check_version(header, f.id.get_vfd_handle(), path)
            if version is not None and file_version(os.fstat(f.id.get_vfd_handle())) != version:
                raise changed_error(path)
            for start, stop in ranges:
                yield start, stop, _native(f[dataset][start:stop])
    except OSError as exc:
        if isinstance(exc, SpeedswapError):
            raise
        raise reading_error(path, exc) from exc


def _native(rows: np.ndarray) -> np.ndarray:
    """``rows`` in this machine's byte order (torch views no other): the same numbers."""
    return rows if rows.dtype.isnative else rows.astype(native_dtype(rows.dtype))


def _corrupt(path, crc, saved) -> FileFormatError:
    return FileFormatError(f"{os.fspath(path)!r} does not hold the bytes that were saved "
                           f"(CRC-32 {crc:#010x}, saved {saved:#010x}): the file is corrupt; "
                           f"nothing was loaded. Restore it from a backup")


def _check_bfloat16(path, start, stop, rows):
    """Raise FileFormatError unless every float32 of ``rows`` is a bfloat16 value, bit for bit.

    A float32 is one exactly when its low 16 bits are zero: a test of the bits,
    not of the values, so that NaN (never equal to itself) passes when a
    bfloat16 NaN was saved, with its sign and payload.
    """
    if np.any(np.ascontiguousarray(rows).view(np.uint32) & 0xFFFF):
        raise FileFormatError(f"{os.fspath(path)!r} holds float32 values that are not "
                              f"bfloat16 values (rows {start}..{stop - 1}); a bfloat16 table "
                              f"would round them: load it into a float32 table")


def _as_bfloat16(rows) -> torch.Tensor:
    """The float32 ``rows`` (checked by :func:`_check_bfloat16`) as bfloat16, bit for bit.

    The high 16 bits of each float32: torch's cast would give the same values
    except NaN, which it turns into 0xFFFF whatever its sign and payload.
    """
    high = (np.ascontiguousarray(rows).view(np.uint32) >> 16).astype(np.uint16)
    return torch.from_numpy(high.view(np.int16)).view(torch.bfloat16)


def read_table(table, path, header: TableHeader, dataset: str = "table") -> None:
    """Fill a *new* ``table`` with the rows of a file whose ``header`` matches it.

    For a table nobody holds yet (:meth:`~speedswap.HostTable.load`): rows are
    read straight into its memory, so a failure midway leaves it half-filled.
    To replace the rows of a table in use, :func:`stage_table` then
    :meth:`StagedRows.commit`, which is all-or-nothing.

    Raises:
        FileFormatError: the file cannot be read, holds values a bfloat16 table
            would round, or not the bytes its recorded CRC-32 says (``header.crc32``).
    """
    target = table.load_target()
    if target.device.type == "cpu" and table.dtype is not torch.bfloat16:
        host = target.numpy()  # the table's own memory: a device table's to_numpy() is a copy
        if file_format(path) == "npy":
            read_npy_into(path, host, header)
            crc = None if header.crc32 is None else crc32_of(host)
        else:
            crc = read_h5_into(path, host, dataset, header, crc32=header.crc32 is not None)
        if crc != header.crc32:
            raise _corrupt(path, crc, header.crc32)
        return
    crc = 0
    for start, stop, rows in _file_chunks(path, header, dataset, row_ranges(header.shape, header.dtype)):
        if table.dtype is torch.bfloat16:
            _check_bfloat16(path, start, stop, rows)
        if header.crc32 is not None:
            crc = crc32_of(rows, crc)
        target[start:stop].copy_(_as_bfloat16(rows) if table.dtype is torch.bfloat16
                                 else torch.from_numpy(np.ascontiguousarray(rows)))
    if header.crc32 is not None and crc != header.crc32:
        raise _corrupt(path, crc, header.crc32)


#: Rows are staged in RAM when they need at most this share of the RAM available.
STAGE_RAM_SHARE = 0.5


class StagedRows:
    """A table file read and verified completely, ready to be copied into a table.

    Made by :func:`stage_table`. Either the rows themselves (``rows``, a host
    array), or, for a file too large to hold twice in RAM, what verifying it
    saw: the file's identity, size and change times, and the CRC-32 of every
    chunk of rows. :meth:`commit` then reads the file again and writes only
    what it verified: it refuses before the first row changes when the file
    was changed or replaced since (:meth:`check_unchanged`), and compares
    each chunk's CRC-32 before writing it.

    Without a second copy of the rows nothing can make that re-read
    all-or-nothing: a read error, or a writer changing the file in place
    *while* :meth:`commit` runs, is found at the chunk it hits, after the
    chunks before it were written. :meth:`commit` then raises a
    FileFormatError naming the rows already replaced; no chunk the
    verification did not see is ever written.
    """

    def __init__(self, path, header, dataset, rows, first: int = 0, version: Optional[tuple] = None,
                 chunks: Optional[list] = None):
        self.path, self.header, self.dataset, self.rows = path, header, dataset, rows
        self.first = first  # the file row that rows[0] holds
        self._version = version  # the file as verified (file_version), when rows is None
        self._chunks = chunks  # [(start, stop, CRC-32 of the rows up to stop)] as verified

    def check_unchanged(self) -> None:
        """Raise unless :meth:`commit` would read the very file that was verified, unchanged.

        Call it for every table of an all-or-nothing load before committing
        the first. A no-op for rows held in RAM.

        Raises:
            FileFormatError: the file was changed, replaced or removed since
                it was verified; nothing was loaded.
        """
        if self.rows is None and not _same_version(self.path, self._version):
            raise changed_error(self.path)

    def commit(self, table, *, rows: Optional[range] = None, at: int = 0) -> None:
        """Copy the staged rows into ``table`` (its dtype and width as checked when staging).

        Args:
            table: the table to fill.
            rows: which of the file's rows (default: all, into a table of the
                file's shape); they must be among the rows staged.
            at: the table row the first of them goes to.

        Raises:
            FileFormatError: only for a file too large to stage in RAM: it
                changed since it was verified (nothing changes), or a chunk
                could not be read again or differs from the one verified
                (the message names the rows already replaced).
        """
        rows = range(self.header.shape[0]) if rows is None else rows
        target = table.load_target()[at:at + len(rows)]
        # The table's own memory, not to_numpy(): for a table on the GPU that is a copy,
        # and rows written into it would never reach the table.
        host = target.numpy() if target.device.type == "cpu" and table.dtype is not torch.bfloat16 else None

        def write(start, stop, chunk):  # file rows start..stop
            start, stop = start - rows.start, stop - rows.start
            if host is not None and host.dtype == chunk.dtype:
                np.copyto(host[start:stop], chunk, casting="no")
            elif table.dtype is torch.bfloat16:  # float32 rows, checked when staged
                target[start:stop].copy_(_as_bfloat16(chunk))
            else:
                target[start:stop].copy_(torch.from_numpy(np.ascontiguousarray(chunk)))

        if self.rows is not None:
            for a, b in row_ranges((len(rows), *self.header.shape[1:]), self.header.dtype):
                start, stop = rows.start + a, rows.start + b
                write(start, stop, self.rows[start - self.first:stop - self.first])
            return
        self._commit_again(rows, write)

    def _commit_again(self, rows, write):
        """Read the verified chunks that hold ``rows`` again and ``write`` each one that still matches."""
        self.check_unchanged()
        spans = [(i, a, b) for i, (a, b, _) in enumerate(self._chunks) if a < rows.stop and b > rows.start]
        crc = self._chunks[spans[0][0] - 1][2] if spans and spans[0][0] else 0
        written = rows.start
        chunks = _file_chunks(self.path, self.header, self.dataset, [(a, b) for _, a, b in spans],
                              self._version)
        try:
            for (i, _, _), (start, stop, chunk) in zip(spans, chunks):
                crc = crc32_of(chunk, crc)
                if crc != self._chunks[i][2]:
                    raise FileFormatError(f"{os.fspath(self.path)!r} holds other bytes in rows "
                                          f"{start}..{stop - 1} than when it was verified")
                lo, hi = max(start, rows.start), min(stop, rows.stop)
                write(lo, hi, chunk[lo - start:hi - start])
                written = hi
        except FileFormatError as exc:
            if written == rows.start:
                raise FileFormatError(f"{exc}; nothing was loaded from it: load it again") from exc
            raise FileFormatError(f"{exc}, while it was loaded: the table's rows for file rows "
                                  f"{rows.start}..{written - 1} were replaced, the rest were not. "
                                  f"The file changed (another writer?) or could not be read "
                                  f"again; load an intact copy again") from exc


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
            only verified, recording the file's identity and change times and
            each chunk's CRC-32, and read again by :meth:`StagedRows.commit`.
        crc32: the CRC-32 of the stored bytes recorded when it was saved,
            checked when given. It covers the whole file: with ``rows`` too,
            every row is read to check it, and only ``rows`` are held. Each
            chunk's CRC-32 is computed on a second thread while the next
            chunk is read (:func:`~speedswap.files.base.crc32_behind`).
        rows: only these rows of the file (a shard's share of a whole table),
            the only ones read unless ``crc32`` is given; commit them with
            ``commit(table, rows=rows, at=...)``. The RAM they need decides
            whether they are held.

    Returns:
        StagedRows

    Raises:
        FileFormatError: a chunk cannot be read, a CRC-32 mismatch, values a
            bfloat16 table would round, or a file not staged in RAM that
            changed while it was verified.
    """
    if crc32 is None and rows is None:
        crc32 = header.crc32  # the file's own record of its bytes (a whole table's)
    rows = range(header.shape[0]) if rows is None else rows
    shape = (len(rows), *header.shape[1:])
    in_memory = int(np.prod(shape, dtype=np.int64)) * header.dtype.itemsize <= STAGE_RAM_SHARE * ram_available
    held = np.empty(shape, dtype=native_dtype(header.dtype)) if in_memory else None
    read = range(header.shape[0]) if crc32 is not None else rows  # a CRC-32 covers every row
    ranges = [(read.start + a, read.start + b)
              for a, b in row_ranges((len(read), *header.shape[1:]), header.dtype)]
    version = None
    if held is None:  # commit reads the file again: it must find what is verified here
        try:
            version = file_version(os.stat(path))
        except OSError as exc:
            raise reading_error(path, exc) from exc

    def verified():  # each chunk read, checked and held
        for start, stop, chunk in _file_chunks(path, header, dataset, ranges, version):
            if table_dtype is torch.bfloat16:
                _check_bfloat16(path, start, stop, chunk)
            if held is not None:
                lo, hi = max(start, rows.start), min(stop, rows.stop)
                if lo < hi:
                    held[lo - rows.start:hi - rows.start] = chunk[lo - start:hi - start]
            yield chunk
    crcs = []  # the CRC-32 of the rows up to the end of each chunk
    if crc32 is not None or held is None:
        crc = crc32_behind(verified(), running=crcs)
    else:
        for _ in verified():
            pass
    if crc32 is not None and crc != crc32:
        raise _corrupt(path, crc, crc32)
    chunks = [] if held is not None else [(start, stop, upto) for (start, stop), upto in zip(ranges, crcs)]
    if held is None and not _same_version(path, version):
        raise changed_error(path)  # written while it was read: the CRC-32s may describe no single file
    return StagedRows(path, header, dataset, held, first=rows.start, version=version,
                      chunks=chunks)


def _same_version(path, version) -> bool:
    """Whether ``path`` is still the file of :func:`~speedswap.files.base.file_version` ``version``, unchanged."""
    try:
        return file_version(os.stat(path)) == version
    except OSError:
        return False
