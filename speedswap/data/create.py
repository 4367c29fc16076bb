"""Build a ``.npy`` dataset larger than RAM, chunk by chunk.

>>> import numpy as np, tempfile, os, speedswap as ss
>>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
>>> x = ss.data.create_npy(path, (10, 3), np.float32, lambda lo, hi: np.full((hi - lo, 3), lo, np.float32),
...                        chunk_bytes=48)
>>> np.load(path)[:, 0].tolist()
[0.0, 0.0, 0.0, 0.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0]
"""

import operator
import os
import sys

import numpy as np
import torch
from tqdm import tqdm

from .. import files
from ..atomic import as_path, atomic_output, open_into
from ..convert import (TABLE_DTYPES, as_values_array, check_has_values, check_rows, int_option, numpy_dtype,
                       torch_dtype)
from ..errors import DTypeError, OptionError, ShapeError

__all__ = ["create_npy", "native_copy_advice"]

#: Written data is synced and dropped from the page cache this often, so a
#: file larger than RAM does not push everything else out of memory.
_SYNC_BYTES = 1 << 30


def create_npy(path, shape, dtype, fill=None, *, chunk_bytes=64 << 20, progress=None):
    """Create a ``.npy`` file of ``shape``/``dtype`` and return it as a writable memory map.

    Without ``fill`` the file is created sparse (disk is used as rows are
    written) and you write rows into the returned map; ``map.flush()`` makes
    them durable. That file has its full shape from the start, so rows never
    written read as zeros: a writer stopped midway leaves a dataset that
    opens (with ``np.load``, ``DataGadget``) with zero rows at its end. Use
    ``fill`` where the file must be complete or absent.

    With ``fill``, ``fill(start, stop)`` is called for
    consecutive chunks of about ``chunk_bytes`` and must return rows
    ``start .. stop - 1``; they are written with ``pwrite`` (not through a
    map, so the process's resident memory stays at one chunk), synced and
    dropped from the page cache every GiB, into a temporary file renamed to
    ``path`` once complete: a failure leaves no half-written dataset behind.
    Either way an existing file is replaced by a rename, never rewritten in
    place, so a map of it made earlier keeps the rows it had.

    Args:
        path: the ``*.npy`` file to create (replaced if it exists).
        shape: ``(num_rows, ...)``; an int ``n`` means ``(n,)``, as in numpy.
        dtype: a dtype speedswap's tables hold (numpy, torch or a name), not
            bfloat16; or uint16/uint32, for token ids ``BatchFeeder`` reads.
        fill: optional ``fill(start, stop) -> array`` of shape ``(stop - start, *shape[1:])``
            (numpy, or a torch tensor on any device, bfloat16 included).
        chunk_bytes: bytes per ``fill`` call.
        progress: show a tqdm bar while filling; None shows it only on a terminal.

    Returns:
        numpy.memmap opened ``r+`` over the file.

    Raises:
        ShapeError: a bad ``shape`` (not integers, a negative or zero
            dimension), or ``fill`` returned rows of another shape or ragged lists. A bad
            ``shape`` is refused before ``path`` is touched.
        DTypeError: an unsupported ``dtype`` (bfloat16 included), ``fill``
            returned another kind of dtype (floats for an integer file),
            values the file's dtype cannot hold (integers that would wrap,
            floats that would overflow to infinity; float rounding is accepted),
            a masked array, or a sparse, nested or quantized tensor.
        DeviceError: ``fill`` returned a tensor on the meta device.
        OptionError: a non-positive ``chunk_bytes``, a ``fill`` that is not
            callable, a shape of more bytes than any file can hold, or a
            ``path`` not named ``*.npy``; each refused before ``path`` is touched.
        PathError: ``path`` is a directory, its directory does not exist, or
            the file system refused the write; a file already at ``path`` is
            intact.

    Example:
        >>> x = create_npy("X.npy", (10**8, 100), np.float32,                  # doctest: +SKIP
        ...                lambda lo, hi: rng.random((hi - lo, 100), dtype=np.float32))
    """
    shape = _shape_of(shape)
    check_rows(shape, "the dataset")  # before anything is opened: a bad shape leaves the path as it was
    dtype = _file_dtype(dtype)
    files.npy_data_bytes(shape, dtype)  # a shape past any file's size is refused before the path is touched
    chunk_bytes = int_option(chunk_bytes, "chunk_bytes")
    if fill is not None and not callable(fill):
        # Called only once the temporary exists: refused here, the path is not touched.
        raise OptionError(f"fill must be a function fill(start, stop) returning rows start .. stop - 1, "
                          f"got a {type(fill).__name__}; for an array x pass lambda lo, hi: x[lo:hi]")
    path = as_path(path)
    if files.suffix_format(path) != "npy":
        # The suffix is how speedswap (DataGadget, HostTable.load) tells a file's format: under
        # another name the dataset written here could not be opened again.
        raise OptionError(f"create_npy writes a .npy file, which DataGadget and HostTable.load know by "
                          f"its suffix; name it *.npy, got {os.fspath(path)!r}")
    if fill is None:
        # Made beside the file and renamed over it: truncating an existing file in
        # place would zero the rows of whoever maps it (a DataGadget, a feeder).
        return files.create_npy_memmap(path, shape, dtype, overwrite=True)
    # Created afresh, as without fill: a map of the old file (a writable one too) keeps the old rows.
    with atomic_output(path, replace_mapped=True) as partial:  # OSErrors become PathErrors naming path
        header = np.lib.format.open_memmap(partial, mode="w+", dtype=dtype, shape=shape)
        offset = header.offset
        del header
        _fill(partial, offset, shape, dtype, fill, chunk_bytes, progress, os.path.basename(path))
    return np.lib.format.open_memmap(path, mode="r+")


#: Token-id widths BatchFeeder reads (and widens on the device) though no table holds them.
_TOKEN_DTYPES = {name: np.dtype(name) for name in ("uint16", "uint32")}
#: The dtypes a file create_npy writes may hold, as its refusal lists them: a table's
#: (torch_dtype's list would offer bfloat16 and leave out the token ids).
_FILE_DTYPES = sorted(set(TABLE_DTYPES) - {"bfloat16"} | set(_TOKEN_DTYPES))


def native_copy_advice(dtype: np.dtype) -> str:
    """How to rewrite a ``.npy`` file of byte-swapped ``dtype`` in this machine's byte order, a chunk at a time.

    For the errors that refuse such a file where it would be read in place:
    ``np.load(path, mmap_mode='r').astype(...)`` reads the whole file into
    RAM, and a file mapped because it is larger than the RAM runs the process
    out of memory that way.

    Args:
        dtype: the file's numpy dtype, in the other byte order (``'>f4'``).

    Returns:
        The advice, a sentence to end a message with.
    """
    return (f"write a copy in this machine's byte order a chunk at a time (x.astype() would read the whole "
            f"file into RAM): x = np.load(path, mmap_mode='r'); ss.data.create_npy(new_path, x.shape, "
            f"'{dtype.newbyteorder('=').name}', lambda lo, hi: x[lo:hi]), then read new_path")


def _file_dtype(dtype) -> np.dtype:
    """The file's numpy dtype: one speedswap's tables hold, or uint16/uint32 token ids.

    Raises:
        DTypeError: any other dtype, bfloat16 included (no .npy holds it), or
            one of the other byte order (the file is written in this machine's).
    """
    name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else None
    if name is None:
        try:
            parsed = np.dtype(dtype)
        except TypeError:
            parsed = None  # not a numpy dtype: torch_dtype below says what is supported
        if parsed is not None and not parsed.isnative:
            # Refused whatever the kind: token ids would be written in this order under a header saying
            # so, where a table's dtype was refused with advice for arrays (astype) that fits no dtype.
            raise DTypeError(f"dtype {dtype!r} is {parsed.name} in the other byte order; create_npy "
                             f"writes this machine's ({sys.byteorder}-endian): pass {parsed.name!r}")
        name = None if parsed is None else parsed.name
    if name in _TOKEN_DTYPES:
        return _TOKEN_DTYPES[name]
    if name is not None and name != "bfloat16" and name not in _FILE_DTYPES:
        advice = (" (uint64 token ids: uint32 holds those below 2**32, int64 those below 2**63)"
                  if name == "uint64" else "")
        raise DTypeError(f"dtype {name} is not supported by create_npy; use one of {_FILE_DTYPES}{advice}")
    if torch_dtype(dtype) is torch.bfloat16:  # DTypeError first for a name that is no dtype
        raise DTypeError("numpy has no bfloat16, so a .npy file cannot hold it; create the file as "
                         "float32, which holds every bfloat16 value exactly")
    return numpy_dtype(dtype)


def _shape_of(shape):
    """``shape`` as a tuple of ints: an int ``n`` is ``(n,)``, as numpy's ``shape`` arguments take it.

    Raises:
        ShapeError: ``shape`` or one of its dimensions is not an integer
            (``int(2.5)`` would silently drop rows).
    """
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    try:
        if isinstance(dims, (str, bytes)) or any(isinstance(d, bool) for d in dims):
            raise TypeError
        return tuple(operator.index(d) for d in dims)
    except TypeError:
        raise ShapeError(f"the dataset's shape must be an int or a tuple of ints such as "
                         f"(num_rows, row_size), got {shape!r}") from None


def _fill(path, offset, shape, dtype, fill, chunk_bytes, progress, name):
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    step = max(1, chunk_bytes // max(1, row_bytes))
    disable = not sys.stderr.isatty() if progress is None else not progress
    opened = []  # the file's descriptor, from its opening (open_into): closed whatever comes
    try:
        fd = open_into(opened, path, os.O_WRONLY)
        unsynced = 0
        with tqdm(total=shape[0] * row_bytes, unit="B", unit_scale=True, desc=name,
                  disable=disable) as bar:
            for start in range(0, shape[0], step):
                stop = min(start + step, shape[0])
                rows = _as_numpy(fill(start, stop), f"fill({start}, {stop})", (stop - start, *shape[1:]))
                if rows.shape != (stop - start, *shape[1:]):
                    raise ShapeError(f"fill({start}, {stop}) returned shape {rows.shape}; expected "
                                     f"{(stop - start, *shape[1:])} (rows start .. stop - 1)")
                # Integers of either sign go to integers (int64 token ids to uint16), their values
                # checked below; numpy calls signed to unsigned another kind.
                integers = np.issubdtype(rows.dtype, np.integer) and np.issubdtype(dtype, np.integer)
                if rows.dtype != dtype and not (integers or np.can_cast(rows.dtype, dtype, "same_kind")):
                    raise DTypeError(f"fill({start}, {stop}) returned {rows.dtype}; the file holds "
                                     f"{dtype}: return {dtype} rows")
                with np.errstate(over="ignore"):  # an overflow is refused just below
                    data = np.ascontiguousarray(rows, dtype=dtype)
                if not np.can_cast(rows.dtype, dtype, "safe"):
                    _check_converted(rows, data, start, stop)
                view, written = memoryview(data).cast("B"), 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], offset + start * row_bytes + written)
                unsynced += len(view)
                if unsynced >= _SYNC_BYTES:
                    _sync_and_drop(fd)
                    unsynced = 0
                bar.update(len(view))
        _sync_and_drop(fd)
    finally:
        if opened:
            os.close(opened[0])


def _as_numpy(rows, what, shape) -> np.ndarray:
    """``fill``'s rows as a numpy array; a torch tensor may be on any device, and bfloat16.

    Args:
        rows: what ``fill`` returned.
        what: ``fill(start, stop)``, for messages.
        shape: the shape the rows must have, for messages.

    Raises:
        DTypeError: a numpy masked array (``np.asarray`` would drop its mask), a
            sparse or nested tensor, or one numpy has no dtype for (quantized).
        DeviceError: a tensor on the meta device.
        ShapeError: nested lists of different lengths.
    """
    if not isinstance(rows, torch.Tensor):
        return as_values_array(rows, shape, f"{what}'s rows")
    check_has_values(rows, f"{what}'s rows")
    # A lazy conjugation or negation (z.conj().imag) is no memory of the values: .numpy() refuses it.
    rows = rows.detach().cpu().resolve_conj().resolve_neg()
    # numpy has no bfloat16: float32 holds each of its values exactly.
    rows = rows.float() if rows.dtype == torch.bfloat16 else rows
    try:
        return rows.numpy()
    except TypeError:  # quantized: integers that stand for other values
        raise DTypeError(f"{what} returned a tensor of {rows.dtype}, which numpy cannot hold; return "
                         f"its values (t.dequantize()) or plain numbers") from None


def _check_converted(rows, data, start, stop):
    """Refuse a narrowing conversion that changed values beyond float rounding.

    Integers must come through exactly (int64 300 is int8 44); floats may
    round but not overflow to infinity.
    """
    if np.issubdtype(rows.dtype, np.floating):
        changed = np.isinf(data) & np.isfinite(rows)
    else:
        changed = data != rows
    if changed.any():
        first = tuple(int(i) for i in np.argwhere(changed)[0])
        raise DTypeError(f"fill({start}, {stop}) returned {rows.dtype} values that {data.dtype} "
                         f"cannot hold (row {start + first[0]}: {rows[first].item()!r} became "
                         f"{data[first].item()!r}); return {data.dtype} rows or create the file with a "
                         f"wider dtype. The file was not created")


def _sync_and_drop(fd):
    # Written pages are dirty until synced, and only clean pages can be dropped.
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
