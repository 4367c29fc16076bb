"""File formats: ``.npy`` and HDF5 reading, writing, validation; all-or-nothing loads.

Every save goes through :func:`speedswap.atomic.atomic_output`: the data is
written to a temporary file beside the target, flushed to disk, and renamed
over the target only when complete, so a crash or a full disk mid-save leaves
the previous file intact. Every load validates the header (magic, dtype,
order, shape, and that the file is as long as its header says) before a
single row is read, and a load into a table in use reads and verifies every
row first (:func:`stage_table`), so a corrupt file changes nothing.
"""

import contextlib
import errno
import io
import os
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..convert import torch_dtype
from ..atomic import atomic_output, check_writable_dir, saving_error, temp_path
from ..errors import (DTypeError, FileFormatError, MissingFileError, OptionError, PathError,
                     SpeedswapError)

__all__ = [
    "NPY_SUFFIXES",
    "H5_SUFFIXES",
    "file_format",
    "TableHeader",
    "read_npy_header",
    "open_npy_memmap",
    "create_npy_memmap",
    "read_npy_into",
    "write_npy",
    "read_h5_header",
    "read_h5_into",
    "open_h5",
    "check_matches",
    "write_h5",
    "row_ranges",
    "check_size",
    "suffix_format",
    "stored_dtype",
    "read_table_header",
    "check_table_matches",
    "save_table",
    "read_table",
    "stage_table",
    "StagedRows",
    "check_readable_file",
]

NPY_SUFFIXES = (".npy",)
H5_SUFFIXES = (".h5", ".hdf5")


def suffix_format(path) -> Optional[str]:
    """``"npy"``, ``"h5"``, or None (another suffix) from a path's suffix: the one place that sniffs it."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
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
    """

    shape: tuple
    dtype: np.dtype
    offset: int = 0
    table_dtype: Optional[torch.dtype] = None


def _check_dtype(dtype, path):
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise FileFormatError(f"{path!r} holds an array of {dtype}; speedswap reads plain "
                              f"numeric arrays only (no objects or records)")


def check_readable_file(path, what="file") -> str:
    """``path`` as a string, if it names an existing regular file.

    Raises:
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise PathError(f"{path!r} is a directory, but a {what} was expected here; pass the "
                        f"file's path")
    if not os.path.exists(path):
        raise MissingFileError(errno.ENOENT, f"no {what} at {path!r}; check the path", path)
    return path


def reading_error(path, exc) -> FileFormatError:
    """A :class:`FileFormatError` for an OSError raised while reading rows of ``path``."""
    return FileFormatError(f"{os.fspath(path)!r} could not be read ({exc}); the file is "
                           f"corrupt or was changed during the load: nothing was loaded")


def read_npy_header(path):
    """Read and validate the header of a ``.npy`` file.

    Args:
        path: the file.

    Returns:
        TableHeader

    Raises:
        FileFormatError: not a ``.npy`` file, Fortran order, object or record
            dtype, or a file shorter or longer than its header says.
        MissingFileError: the file does not exist.
        PathError: ``path`` is a directory.
    """
    path = check_readable_file(path, ".npy file")
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as exc:
            raise FileFormatError(f"{path!r} is not a valid .npy file ({exc}); "
                                  f"write it with numpy.save") from exc
        offset = f.tell()
    _check_dtype(dtype, path)
    if fortran and len(shape) > 1:
        raise FileFormatError(f"{path!r} is stored in Fortran order; speedswap needs rows "
                              f"contiguous: re-save it with np.save(path, np.ascontiguousarray(a))")
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = os.path.getsize(path)
    if actual != expected:
        kind = "truncated" if actual < expected else "longer than its header says"
        raise FileFormatError(f"{path!r} is {kind}: its header describes {shape} {dtype} "
                              f"({expected} bytes) but the file has {actual} bytes")
    return TableHeader(tuple(shape), dtype, offset, _table_dtype(dtype))


def check_size(path, header: "TableHeader") -> None:
    """Raise FileFormatError when a ``.npy`` file is shorter than ``header`` says.

    Reading a memory-mapped page past the end of a truncated file kills the
    process with SIGBUS, so mapped readers check before they touch the pages
    (a truncation between this check and the read can still crash).
    """
    need = header.offset + int(np.prod(header.shape, dtype=np.int64)) * header.dtype.itemsize
    size = os.path.getsize(path)
    if size < need:
        raise FileFormatError(f"{os.fspath(path)!r} is {size:,} bytes but its header needs {need:,}: "
                              f"it was truncated after it was opened; restore it and rebuild the "
                              f"DataGadget")


def open_npy_memmap(path, writable=True):
    """Memory-map a validated ``.npy`` file.

    Args:
        path: the file.
        writable: map read-write (changes write through to the file).

    Returns:
        numpy.memmap
    """
    header = read_npy_header(path)
    return np.memmap(path, dtype=header.dtype, mode="r+" if writable else "r",
                     offset=header.offset, shape=header.shape, order="C")


def create_npy_memmap(path, shape, dtype, overwrite: bool = False):
    """Create a ``.npy`` file of ``shape``/``dtype`` and memory-map it read-write.

    The file is created sparse where the file system allows, so a table larger
    than RAM costs disk only as its rows are written. An existing file is
    never replaced unless ``overwrite``: it may be someone's trained table.

    Raises:
        PathError: ``path`` exists (without ``overwrite``), is a directory, its
            directory does not exist, or the file system refused it.
    """
    path = os.fspath(path)
    check_writable_dir(path)
    if os.path.isdir(path):
        raise PathError(f"cannot create {path!r}: it is a directory; choose a file name")
    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)}
    if os.path.exists(path) and not overwrite:
        raise PathError(f"{path!r} already exists; speedswap does not replace a file it did not "
                        f"create. Open it with HostTable.load(path, mmap=True), or pass "
                        f"overwrite=True to start it afresh")
    # Created under a temporary name and renamed: a replaced file keeps its inode for
    # whoever still maps it, and the name never holds a half-made header.
    tmp = temp_path(path)
    try:
        with open(tmp, "xb") as f:
            np.lib.format.write_array_header_2_0(f, header)
            offset = f.tell()
            f.truncate(offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if the file appeared meanwhile: never replaced
            except FileExistsError:
                raise
            except OSError:  # no hard links on this file system: rename, after the check above
                os.rename(tmp, path)
            else:
                os.unlink(tmp)
    except FileExistsError:
        os.unlink(tmp)
        raise PathError(f"{path!r} already exists; speedswap does not replace a file it did not "
                        f"create; pass overwrite=True to start it afresh") from None
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise saving_error(path, exc) from exc
    return np.memmap(path, dtype=dtype, mode="r+", offset=offset, shape=tuple(shape), order="C")


def read_npy_into(path, out, header=None):
    """Read a validated ``.npy`` file into the C-contiguous array ``out``, in chunks.

    Reads straight into ``out``'s memory (no temporary copy of the data).

    Raises:
        FileFormatError: the file's shape or dtype differ from ``out``'s.
    """
    header = header or read_npy_header(path)
    check_matches(header, out.shape, out.dtype, path)
    view = memoryview(out.reshape(-1).view(np.uint8))
    try:
        with open(path, "rb") as f:
            f.seek(header.offset)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:done + _CHUNK_BYTES])
                if not n:
                    raise FileFormatError(f"{os.fspath(path)!r} ended early while reading; "
                                          f"was it changed during the load?")
                done += n
    except OSError as exc:
        if isinstance(exc, SpeedswapError):
            raise
        raise reading_error(path, exc) from exc


def check_matches(header, shape, dtype, path):
    """Raise FileFormatError unless ``header`` describes ``shape``/``dtype``."""
    if tuple(header.shape) != tuple(shape) or np.dtype(header.dtype) != np.dtype(dtype):
        raise FileFormatError(f"{os.fspath(path)!r} holds {tuple(header.shape)} {header.dtype}, "
                              f"but this table is {tuple(shape)} {np.dtype(dtype)}; load it into "
                              f"a table of the file's shape (HostTable.load) instead")


_CHUNK_BYTES = 64 << 20


def _write_chunk(sink, start, chunk):
    """Write one chunk of rows at row ``start``: the single place table bytes reach a file.

    ``sink`` is an open binary file (written sequentially) or an HDF5 dataset.
    Fault-injection tests make this fail on purpose.
    """
    if isinstance(sink, io.IOBase):
        sink.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
    else:
        sink[start:start + len(chunk)] = chunk


def write_npy(path, shape, dtype, chunks):
    """Atomically write a ``.npy`` file from row chunks.

    Args:
        path: the target file.
        shape: the array's shape.
        dtype: its numpy dtype.
        chunks: an iterable of C-contiguous numpy arrays whose rows, in order,
            make up the array (so device tables never need one full host copy).
    """
    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)}
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.lib.format.write_array_header_2_0(f, header)
        start = 0
        for chunk in chunks:
            _write_chunk(f, start, chunk)
            start += len(chunk)
        f.flush()


def _h5py():
    import h5py
    return h5py


def read_h5_header(path, dataset):
    """Validate dataset ``dataset`` of an HDF5 file and describe it.

    Raises:
        FileFormatError: not an HDF5 file, no such dataset (or a group), or a non-numeric dtype.
        MissingFileError, PathError: no such file, or a directory.
    """
    h5py = _h5py()
    path = os.fspath(path)
    with open_h5(path) as f:
        if dataset not in f:
            raise FileFormatError(f"{path!r} has no dataset {dataset!r} (it has "
                                  f"{sorted(f.keys())}); pass dataset= to pick one")
        data = f[dataset]
        if not isinstance(data, h5py.Dataset):
            raise FileFormatError(f"{path!r}: {dataset!r} is an HDF5 {type(data).__name__}, not "
                                  f"a dataset; pass dataset= naming the array itself")
        shape, dtype = data.shape, data.dtype
        table_dtype = data.attrs.get(_TABLE_DTYPE_ATTR)
    _check_dtype(np.dtype(dtype), path)
    table_dtype = _table_dtype(np.dtype(dtype)) if table_dtype is None else torch_dtype(str(table_dtype))
    return TableHeader(tuple(shape), np.dtype(dtype), table_dtype=table_dtype)


def open_h5(path):
    """Open an HDF5 file for reading (h5py is imported only when HDF5 is used).

    Raises:
        MissingFileError, PathError: no such file, or a directory.
        FileFormatError: not a readable HDF5 file (truncated, another format).
    """
    path = check_readable_file(path, "HDF5 file")
    try:
        return _h5py().File(path, "r")
    except OSError as exc:
        raise FileFormatError(f"{path!r} is not a readable HDF5 file ({exc}); it is truncated "
                              f"or not HDF5: write it with h5py or HostTable.save") from exc


def read_h5_into(path, out, dataset, header=None):
    """Read dataset ``dataset`` into the C-contiguous array ``out``, in row chunks.

    Raises:
        FileFormatError: the dataset's shape or dtype differ from ``out``'s.
    """
    header = header or read_h5_header(path, dataset)
    check_matches(header, out.shape, out.dtype, path)
    with open_h5(path) as f:
        data = f[dataset]
        for start, stop in row_ranges(out.shape, out.dtype):
            try:
                data.read_direct(out, np.s_[start:stop], np.s_[start:stop])
            except OSError as exc:  # a corrupt (compressed) chunk
                raise reading_error(path, exc) from exc


def write_h5(path, datasets, attrs=None, table_dtypes=None):
    """Atomically write one HDF5 file holding several datasets.

    Args:
        path: the target file.
        datasets: ``{name: (shape, dtype, chunks)}`` with chunks as in :func:`write_npy`.
        attrs: optional ``{name: value}`` stored on the file's root.
        table_dtypes: optional ``{name: torch dtype}`` recorded on datasets
            whose table dtype is not the stored one (bfloat16).
    """
    h5py = _h5py()
    with atomic_output(path) as tmp, h5py.File(tmp, "w") as f:
        for name, (shape, dtype, chunks) in datasets.items():
            data = f.create_dataset(name, shape=tuple(shape), dtype=np.dtype(dtype))
            if (table_dtypes or {}).get(name) is torch.bfloat16:
                data.attrs[_TABLE_DTYPE_ATTR] = "bfloat16"
            start = 0
            for chunk in chunks:
                _write_chunk(data, start, chunk)
                start += len(chunk)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value


def row_ranges(shape, dtype, chunk_bytes=None):
    """``(start, stop)`` row ranges of about ``chunk_bytes`` (64 MiB) each covering ``shape[0]`` rows."""
    chunk_bytes = chunk_bytes or _CHUNK_BYTES
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize)
    step = max(1, chunk_bytes // row_bytes)
    return [(s, min(s + step, shape[0])) for s in range(0, shape[0], step)]


# ------------------------------------------------------------------ tables
_TABLE_DTYPE_ATTR = "speedswap_dtype"


def _table_dtype(dtype):
    """The table dtype a stored numpy dtype stands for, or None when no table can hold it."""
    try:
        return torch_dtype(dtype)
    except DTypeError:
        return None


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
        raise FileFormatError(f"{os.fspath(path)!r} holds {header.dtype}, which no table holds; "
                              f"convert it with numpy first (e.g. a.astype(np.float32))")
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

    def __init__(self, path, header, dataset, rows):
        self.path, self.header, self.dataset, self.rows = path, header, dataset, rows

    def commit(self, table) -> None:
        """Copy the staged rows into ``table`` (same shape and dtype as checked when staging).

        Raises:
            FileFormatError: only for a file too large to stage in RAM that
                changed since it was verified.
        """
        ranges = row_ranges(self.header.shape, self.header.dtype)
        chunks = ((a, b, self.rows[a:b]) for a, b in ranges) if self.rows is not None else (
            _file_chunks(self.path, self.header, self.dataset, ranges))
        host = None if table.dtype is torch.bfloat16 else table.to_numpy()
        target = table.as_tensor()
        for start, stop, rows in chunks:
            if host is not None and host.dtype == rows.dtype:
                np.copyto(host[start:stop], rows, casting="no")
            else:
                target[start:stop].copy_(torch.from_numpy(np.ascontiguousarray(rows)))


def stage_table(path, header: TableHeader, dataset: str, table_dtype, ram_available: int,
                crc32: Optional[int] = None) -> StagedRows:
    """Read and verify every row of a table file before any table changes.

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
        crc32: the CRC-32 of the stored bytes recorded when it was saved, checked when given.

    Returns:
        StagedRows

    Raises:
        FileFormatError: a chunk cannot be read, a CRC-32 mismatch, or values a
            bfloat16 table would round.
    """
    nbytes = int(np.prod(header.shape, dtype=np.int64)) * header.dtype.itemsize
    in_memory = nbytes <= STAGE_RAM_SHARE * ram_available
    ranges = row_ranges(header.shape, header.dtype)
    rows = np.empty(header.shape, dtype=header.dtype) if in_memory else None
    crc = 0
    for start, stop, chunk in _file_chunks(path, header, dataset, ranges):
        if table_dtype is torch.bfloat16:
            _check_bfloat16(path, start, stop, chunk)
        if crc32 is not None:
            crc = zlib.crc32(memoryview(np.ascontiguousarray(chunk)).cast("B"), crc)
        if rows is not None:
            rows[start:stop] = chunk
    if crc32 is not None and crc != crc32:
        raise FileFormatError(f"{os.fspath(path)!r} does not hold the bytes that were saved "
                              f"(CRC-32 {crc:#010x}, saved {crc32:#010x}): the file is corrupt; "
                              f"nothing was loaded. Restore it from a backup")
    return StagedRows(path, header, dataset, rows)
