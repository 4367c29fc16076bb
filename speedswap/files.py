"""File formats: ``.npy`` and HDF5 reading, writing, validation, atomic saves.

Every save goes through :func:`atomic_output`: the data is written to a
temporary file beside the target, flushed to disk, and renamed over the target
only when complete, so a crash or a full disk mid-save leaves the previous
file intact. Every load validates the header (magic, dtype, order, shape, and
that the file is as long as its header says) before a single row is read.
"""

import contextlib
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from .errors import FileFormatError, OptionError

__all__ = [
    "NPY_SUFFIXES",
    "H5_SUFFIXES",
    "file_format",
    "atomic_output",
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
]

NPY_SUFFIXES = (".npy",)
H5_SUFFIXES = (".h5", ".hdf5")


def file_format(path):
    """``"npy"`` or ``"h5"`` from a path's suffix.

    Raises:
        OptionError: the suffix is neither.
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix in NPY_SUFFIXES:
        return "npy"
    if suffix in H5_SUFFIXES:
        return "h5"
    raise OptionError(f"cannot tell the format of {os.fspath(path)!r}: name it *.npy "
                      f"(numpy) or *.h5 / *.hdf5 (HDF5)")


@contextlib.contextmanager
def atomic_output(path):
    """Yield a temporary path; on success move it over ``path`` atomically.

    The temporary file lives in the target's directory (a rename is atomic
    only within one file system) and is fsynced before the rename. On any
    exception it is removed and the exception propagates; ``path`` is untouched.

    Args:
        path: the file to create or replace.

    Yields:
        str: where to write.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        # mkstemp creates 0600; give the new file the mode the old one had.
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every file system can fsync a directory
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


@dataclass(frozen=True)
class TableHeader:
    """What a file says about the array inside it."""

    shape: tuple
    dtype: np.dtype
    offset: int = 0  # where the data starts (``.npy`` only)


def _check_dtype(dtype, path):
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise FileFormatError(f"{path!r} holds an array of {dtype}; speedswap reads plain "
                              f"numeric arrays only (no objects or records)")


def read_npy_header(path):
    """Read and validate the header of a ``.npy`` file.

    Args:
        path: the file.

    Returns:
        TableHeader

    Raises:
        FileFormatError: not a ``.npy`` file, Fortran order, object or record
            dtype, or a file shorter or longer than its header says.
        FileNotFoundError: the file does not exist.
    """
    path = os.fspath(path)
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
    return TableHeader(tuple(shape), dtype, offset)


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


def create_npy_memmap(path, shape, dtype):
    """Create a ``.npy`` file of ``shape``/``dtype`` and memory-map it read-write.

    The file is created sparse where the file system allows, so a table larger
    than RAM costs disk only as its rows are written.
    """
    return np.lib.format.open_memmap(os.fspath(path), mode="w+", dtype=dtype, shape=tuple(shape))


def read_npy_into(path, out, header=None):
    """Read a validated ``.npy`` file into the C-contiguous array ``out``, in chunks.

    Reads straight into ``out``'s memory (no temporary copy of the data).

    Raises:
        FileFormatError: the file's shape or dtype differ from ``out``'s.
    """
    header = header or read_npy_header(path)
    check_matches(header, out.shape, out.dtype, path)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(path, "rb") as f:
        f.seek(header.offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + _CHUNK_BYTES])
            if not n:
                raise FileFormatError(f"{os.fspath(path)!r} ended early while reading; "
                                      f"was it changed during the load?")
            done += n


def check_matches(header, shape, dtype, path):
    """Raise FileFormatError unless ``header`` describes ``shape``/``dtype``."""
    if tuple(header.shape) != tuple(shape) or np.dtype(header.dtype) != np.dtype(dtype):
        raise FileFormatError(f"{os.fspath(path)!r} holds {tuple(header.shape)} {header.dtype}, "
                              f"but this table is {tuple(shape)} {np.dtype(dtype)}; load it into "
                              f"a table of the file's shape (HostTable.load) instead")


_CHUNK_BYTES = 64 << 20


def _write_chunk(f, chunk):
    """Write one chunk of rows; the single place bytes reach a file (tests fail it on purpose)."""
    f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))


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
        for chunk in chunks:
            _write_chunk(f, chunk)
        f.flush()


def _h5py():
    import h5py
    return h5py


def read_h5_header(path, dataset):
    """Validate dataset ``dataset`` of an HDF5 file and describe it.

    Raises:
        FileFormatError: not an HDF5 file, no such dataset, or a non-numeric dtype.
    """
    h5py = _h5py()
    path = os.fspath(path)
    try:
        with h5py.File(path, "r") as f:
            if dataset not in f:
                raise FileFormatError(f"{path!r} has no dataset {dataset!r} (it has "
                                      f"{sorted(f.keys())}); pass dataset= to pick one")
            shape, dtype = f[dataset].shape, f[dataset].dtype
    except OSError as exc:
        if isinstance(exc, FileFormatError) or isinstance(exc, FileNotFoundError):
            raise
        raise FileFormatError(f"{path!r} is not a readable HDF5 file ({exc})") from exc
    _check_dtype(np.dtype(dtype), path)
    return TableHeader(tuple(shape), np.dtype(dtype))


def open_h5(path):
    """Open an HDF5 file for reading (h5py is imported only when HDF5 is used)."""
    return _h5py().File(os.fspath(path), "r")


def read_h5_into(path, out, dataset, header=None):
    """Read dataset ``dataset`` into the C-contiguous array ``out``, in row chunks.

    Raises:
        FileFormatError: the dataset's shape or dtype differ from ``out``'s.
    """
    header = header or read_h5_header(path, dataset)
    check_matches(header, out.shape, out.dtype, path)
    h5py = _h5py()
    with h5py.File(os.fspath(path), "r") as f:
        data = f[dataset]
        for start, stop in row_ranges(out.shape, out.dtype):
            data.read_direct(out, np.s_[start:stop], np.s_[start:stop])


def write_h5(path, datasets, attrs=None):
    """Atomically write one HDF5 file holding several datasets.

    Args:
        path: the target file.
        datasets: ``{name: (shape, dtype, chunks)}`` with chunks as in :func:`write_npy`.
        attrs: optional ``{name: value}`` stored on the file's root.
    """
    h5py = _h5py()
    with atomic_output(path) as tmp, h5py.File(tmp, "w") as f:
        for name, (shape, dtype, chunks) in datasets.items():
            data = f.create_dataset(name, shape=tuple(shape), dtype=np.dtype(dtype))
            start = 0
            for chunk in chunks:
                data[start:start + len(chunk)] = chunk
                start += len(chunk)
        for key, value in (attrs or {}).items():
            f.attrs[key] = value


def row_ranges(shape, dtype, chunk_bytes=None):
    """``(start, stop)`` row ranges of about ``chunk_bytes`` (64 MiB) each covering ``shape[0]`` rows."""
    chunk_bytes = chunk_bytes or _CHUNK_BYTES
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize)
    step = max(1, chunk_bytes // row_bytes)
    return [(s, min(s + step, shape[0])) for s in range(0, shape[0], step)]
