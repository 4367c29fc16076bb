"""DataGadget: a ``.npy`` dataset held in host memory (or mapped from disk) whose rows move to the device.

A dataset of shape ``(n, *row_shape)`` is kept as a :class:`~speedswap.HostTable`
of ``(n, prod(row_shape))`` rows and reshaped back on the way out, so pinning,
transport, validation and saving are the table's.

>>> import numpy as np, speedswap as ss
>>> images = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
>>> gadget = ss.DataGadget(images, backend="numpy")
>>> gadget.get([3, 0]).shape
torch.Size([2, 2, 3])
"""

import dataclasses
import os
import threading

import numpy as np
import torch

from typing import Optional

from .. import files
from ..atomic import as_path
from ..backends import STORAGE_KINDS, available_ram, get_backend
from ..backends.resolve import BackendLike, DeviceLike
from ..convert import (as_host_array, as_id_tensor, as_values_array, check_dense, check_rows, numpy_dtype,
                       torch_dtype)
from ..errors import DTypeError, OptionError, ShapeError, StateError
from ..table import HostTable

__all__ = ["DataGadget"]

#: A file is memory-mapped (when ``mmap=None``) once it needs more than this
#: share of the RAM available now: the rest is left for the model and the OS.
RAM_SHARE = 0.75


def _row_length(row_shape):
    return int(np.prod(row_shape, dtype=np.int64))


class DataGadget:
    """A dataset whose rows are gathered into device tensors.

    The data is a ``.npy`` file or an array already in memory (no need to save
    a file first). It is held where ``storage`` says: ``pageable`` (the
    default: an in-memory C-contiguous array is shared, not copied),
    ``pinned`` (a page-locked copy, so rows reach the GPU at full bus speed),
    ``device`` (a copy in GPU memory), ... A file larger than the RAM
    available (or any file with ``mmap=True``) is memory-mapped instead:
    nothing is read up front and rows are paged in as they are used.

    The file is validated when the gadget is built (truncated files, Fortran
    order, object or record dtypes raise :class:`~speedswap.FileFormatError`);
    its rows are read on first use or by :meth:`read` (threads that use it
    first at once may each read them; the first copy read is kept, the
    others are released). SpeedTorch's spelling
    (``DataGadget(fileName, CPUPinn)``, ``getData``, ``insertData``, ...) is
    :class:`speedswap.DataGadget`, a thin layer over this class.

    Values of another byte order (a big-endian file or array) are read into
    memory in this machine's (they cannot be mapped: torch reads only native
    values in place). A CPU ``bfloat16`` tensor is held as a bfloat16 table
    (a copy: numpy has no bfloat16); ``.npy`` files store bfloat16 data as
    ``float32``, which holds each value exactly, and give float32 rows.

    Args:
        source: a ``.npy`` path, or a numpy array / CPU tensor of shape ``(n, ...)``.
            An ``np.memmap`` stays mapped.
        storage: any :data:`~speedswap.STORAGE_KINDS` kind except ``mmap``.
        mmap: ``True`` maps the file itself (writes through :meth:`put` reach
            the file when it is writable; a read-only file gives a read-only
            gadget), ``False`` reads it into memory, ``None`` maps it only when
            it would take more than 3/4 of the RAM available.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        device: the CUDA device rows are delivered to; None is torch's current one.

    Raises:
        FileFormatError: a malformed ``.npy`` file.
        FileNotFoundError: no such file.
        OptionError: a file that is not ``.npy``, ``mmap=True`` for an
            in-memory array or a strided view of a map, a bad ``storage``, or an
            ``mmap`` other than True, False (numpy's too) or None.
        ShapeError: an array with no rows, or rows of no elements.
        DTypeError: an unsupported dtype, or ``mmap=True`` for values of
            another byte order (at the first read: ``mmap=None`` where they
            outgrow the RAM).
        BackendUnavailableError: ``backend`` or ``device`` asks for CUDA where
            there is none.

    Example:
        >>> gadget = DataGadget("pairs.npy", storage="pinned")           # doctest: +SKIP
        >>> batch = gadget.get(torch.randint(0, len(gadget), (4096,)))  # doctest: +SKIP
    """

    def __init__(self, source, *, storage: str = "pageable", mmap: Optional[bool] = None,
                 backend: BackendLike = "auto", device: DeviceLike = None):
        if storage not in STORAGE_KINDS or storage == "mmap":
            raise OptionError(f"storage must be one of {[k for k in STORAGE_KINDS if k != 'mmap']}, "
                              f"got {storage!r}; memory-map a file with mmap=True instead")
        # numpy's bools too, made Python's: the table is built on `mmap is True` / `is not False`.
        if mmap is not None and not isinstance(mmap, (bool, np.bool_)):  # 1 == True, but no bool
            raise OptionError(f"mmap must be True, False or None (decide by size), got {mmap!r}")
        self._storage = storage
        self._mmap = None if mmap is None else bool(mmap)
        self._backend = get_backend(backend, device)
        self._table = None
        self._installing = threading.Lock()  # first uses install one table, none once closed
        self._closed = False  # closed before its first read there is no table to say so
        self._mapped = None  # the identity of the file a mapped table maps
        self._set_source(source)

    def _set_source(self, data):
        """Validate the file header or array and remember it; the rows are read later."""
        if isinstance(data, (str, bytes, os.PathLike)):
            # Absolute: the rows are read on first use, and a relative path would then name the
            # file of whatever directory is current by that time.
            path, array = os.path.abspath(as_path(data)), None
            header = self._read_header(path)
            shape, dtype = header.shape, header.dtype
            _refuse_token_ids(dtype)
        else:
            _refuse_token_ids(getattr(data, "dtype", None))
            # Checked as the table will hold them: bfloat16 (which numpy lacks) as its bit patterns,
            # byte-swapped values in the native order; both are kept as they are, to be copied.
            bfloat16 = isinstance(data, torch.Tensor) and data.dtype == torch.bfloat16
            swapped = isinstance(data, np.ndarray) and not data.dtype.isnative
            checked = as_host_array(data.view(torch.int16) if bfloat16 else
                                    data.view(data.dtype.newbyteorder("=")) if swapped else data, "the dataset")
            path, array, header = None, data if bfloat16 or swapped else checked, None
            shape, dtype = checked.shape, array.dtype
            if self._mmap and not isinstance(array, np.memmap):
                raise OptionError("mmap=True maps a .npy file; this array is already in memory. "
                                  "Pass the file's path, or np.load(path, mmap_mode='r+')")
            if self._mmap and not array.flags.c_contiguous:
                raise OptionError("mmap=True reads rows in place, and this memmap is a strided view "
                                  "(such as m[::2]) whose rows are not contiguous in the file; pass "
                                  "the whole map, or mmap=None to copy the view into memory")
        if self._mmap and isinstance(dtype, np.dtype) and not dtype.isnative:
            raise _unmappable(path, dtype, "mmap=True")
        row_shape = check_rows(shape, "the dataset")
        # The table's dtype, known before its rows are read (a feeder checks its arguments with it).
        table_dtype = torch_dtype(dtype.newbyteorder("=") if isinstance(dtype, np.dtype) else dtype)
        self._path, self._array, self._header = path, array, header
        self._row_shape, self._num_rows, self._dtype = row_shape, int(shape[0]), table_dtype

    @staticmethod
    def _read_header(path):
        if files.file_format(path) != "npy":
            raise OptionError(f"DataGadget reads .npy files; {path!r} is not one. Convert it "
                              f"with np.save, or load HDF5 tables with HostTable.load")
        return files.read_npy_header(path)

    # ------------------------------------------------------------------ load
    def read(self) -> "DataGadget":
        """Read the rows now (otherwise the first :meth:`get` does). Returns self.

        Raises:
            FileFormatError: the file changed since the gadget was built, or
                was truncated while its rows were read.
        """
        self._live_table()
        return self

    def _live_table(self):
        if self.closed:
            raise StateError("this DataGadget is closed; build a new one to read the data again")
        if self._table is None:
            # Read outside the lock (a process forked mid-read must not inherit it held); the
            # first table installed is the gadget's, since another thread may write into it at once.
            table = self._build_table()
            with self._installing:
                if self._table is None and not self._closed:
                    self._table, table = table, None
            if table is not None:  # another thread's first use read the rows first, or close() came
                table.close()
            if self._closed:
                raise StateError("this DataGadget was closed while its rows were read; build a new "
                                 "one to read the data again")
        return self._table

    def _wants_mmap(self, nbytes):
        if self._mmap is None:
            return nbytes > RAM_SHARE * available_ram()
        return self._mmap

    def _build_table(self):
        rows = (self._num_rows, _row_length(self._row_shape))
        if self._array is not None:
            flat = self._array.reshape(rows)
            # A strided view of a map cannot be adopted, nor can bfloat16 (a tensor) or byte-swapped
            # values (torch views neither): they are copied like any array.
            adoptable = isinstance(flat, np.ndarray) and flat.flags.c_contiguous and flat.dtype.isnative
            mapped = isinstance(flat, np.memmap) and self._mmap is not False and adoptable
            shared = self._storage == "pageable" and self._mmap is not False and adoptable
            if mapped or shared:
                return HostTable.adopt(flat, backend=self._backend)
            return HostTable.from_numpy(flat, storage=self._storage, backend=self._backend)
        header = files.read_npy_header(self._path)  # again: the file may have changed since then
        files.check_matches(header, self._header.shape, self._header.dtype, self._path)
        if self._wants_mmap(rows[0] * rows[1] * header.dtype.itemsize):
            if not header.dtype.isnative:
                raise _unmappable(self._path, header.dtype, "it needs more than 3/4 of the RAM available")
            # Writes reach the file only when asked for (mmap=True): mapped because it is
            # large (mmap=None), a smaller file's rows would be a copy, so puts must not
            # write the dataset on disk depending on the RAM free today.
            mode = "r+" if self._mmap is True and os.access(self._path, os.W_OK) else "r"
            array = files.map_npy(self._path, header, mode, rows)
            # The file the map holds, which get() checks for truncation: the path may
            # name another file later (removed, or replaced by a rename).
            self._mapped = (files.mapped_identity(array.ctypes.data)
                            or files.identity(os.stat(self._path)))
            return HostTable.adopt(array, backend=self._backend)
        # Read into the table, not copied from a map: a file truncated meanwhile ends a read
        # early (FileFormatError), where a map's missing page is a SIGBUS.
        table = HostTable.empty(*rows, header.table_dtype, self._storage, self._backend)
        try:
            files.read_table(table, self._path, dataclasses.replace(header, shape=rows))
        except BaseException:
            table.close()  # half-filled, and perhaps page-locked memory: not left to the collector
            raise
        return table

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple:
        """``(n, *row_shape)``, the dataset's shape."""
        return (self._num_rows, *self._row_shape)

    @property
    def row_shape(self) -> tuple:
        """The shape of one row (``()`` for a 1-D dataset such as labels)."""
        return self._row_shape

    @property
    def table(self) -> HostTable:
        """The :class:`~speedswap.HostTable` holding the rows (reads them if needed)."""
        return self._live_table()

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the rows, from the file's header or the array: nothing is read."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """The device :meth:`get` returns tensors on."""
        return self._live_table().device

    @property
    def storage(self) -> str:
        """Where the rows live: a storage kind, ``mmap`` when mapped from the file."""
        return self._live_table().storage

    @property
    def closed(self) -> bool:
        """Whether the gadget was closed (or its table was): its rows are gone."""
        return self._closed or (self._table is not None and self._table.closed)

    @property
    def path(self) -> Optional[str]:
        """The ``.npy`` file the data came from, as an absolute path, or None for an in-memory array."""
        return self._path

    def __len__(self):
        return self._num_rows

    def __repr__(self):
        where = repr(self._path) if self._path is not None else "<array>"
        if self.closed:
            state = "closed"
        else:
            state = "not read yet" if self._table is None else f"storage={self.storage!r}"
        return f"DataGadget({where}, shape={self.shape}, {state})"

    # ------------------------------------------------------------- transport
    def get(self, idx) -> torch.Tensor:
        """Rows ``idx`` as a tensor on :attr:`device`.

        Args:
            idx: integer ids of any shape (numpy, list, or tensor on the CPU or
                the device); duplicates allowed.

        Returns:
            torch.Tensor of shape ``(*idx.shape, *row_shape)``. On a GPU the
            copy is ordered on torch's current stream and may still be running.

        Raises:
            IdError, DTypeError, DeviceError: bad ids.
            FileFormatError: the file a gadget built from its path maps was
                truncated since. A gadget built from a memory-mapped array you
                made cannot see its file: truncating that file under it ends
                the process with SIGBUS, as it would for numpy.
        """
        table = self._live_table()
        if self._path is not None and table.storage == "mmap":
            files.check_size(self._path, self._header, self._mapped)  # not SIGBUS on a truncated file
        rows = table.gather(idx)
        return rows.view((*rows.shape[:-1], *self._row_shape))  # a tuple: () for one label

    def put(self, t, idx) -> None:
        """Write ``t[i]`` into row ``idx[i]`` (through to the file when memory-mapped; see :meth:`flush`).

        Args:
            t: values of shape ``(*idx.shape, *row_shape)`` with the dataset's
                dtype (tensor on the CPU or the device, or numpy array).
            idx: unique integer ids.

        Raises:
            IdError, DTypeError, DeviceError, ShapeError: bad ids or values.
            DuplicateIdError: ``idx`` repeats an id.
            StateError: the data is read-only (a read-only file or array, or a
                file mapped because it outgrew the RAM, without ``mmap=True``).
        """
        table = self._live_table()
        if not table.writable and self._path is not None and self._mmap is None:
            raise StateError(f"this DataGadget maps {self._path!r} read-only: it is larger than the "
                             f"RAM free, and writing would change the dataset on disk. Pass mmap=True "
                             f"to write through to the file, or mmap=False to copy it into memory")
        # The ids' shape as the table reads them (np.shape would take a ragged list); the table checks
        # their values, where they are (uint64 ids named as given, host ids without a device wait).
        where = idx.device if isinstance(idx, torch.Tensor) else "cpu"
        # Named by position: HostTable.scatter takes the ids first, so swapped arguments are a likely
        # cause of float ids, and "convert them with .long()" alone would write the truncated values.
        flat, ids_shape = as_id_tensor(idx, table.device, to=where,
                                       what="ids (the second argument of put / insertData, after the values)")
        wanted = (*ids_shape, *self._row_shape)
        if isinstance(t, torch.Tensor):
            check_dense(t, "values")  # before .shape and .reshape, which raise on a nested or sparse one
            values = t
        else:
            values = as_values_array(t, wanted)
        if tuple(values.shape) != wanted:
            raise ShapeError(f"values have shape {tuple(values.shape)} but {len(flat)} ids of rows "
                             f"shaped {self._row_shape} need shape {wanted}")
        table.scatter(idx, values.reshape(len(flat), table.dim))

    def flush(self) -> None:
        """Make rows written with :meth:`put` durable: a mapped file is synced to disk.

        ``put`` on a memory-mapped gadget writes through to the file at once
        (other readers of the file, a :class:`~speedswap.BatchFeeder`
        included, see the new rows); ``flush`` waits until they are on disk.
        For in-memory data it only waits for pending device writes.

        Raises:
            StateError: the gadget is closed.
        """
        self._live_table().flush()

    # ------------------------------------------------------------------ files
    def save(self, path: "str | os.PathLike") -> None:
        """Write the dataset to a ``.npy`` file atomically (previous file intact on failure); bfloat16 as float32.

        Args:
            path: the target ``*.npy``; the gadget's own mapped file is flushed in place.

        Raises:
            OptionError: ``path`` is not a ``.npy`` file.
            PathError: ``path`` is the file the gadget maps, but the gadget
                holds only part of it (a slice) or reads it as another dtype.
            StateError: the gadget is closed.
        """
        if files.file_format(path) != "npy":
            raise OptionError(f"DataGadget saves .npy files; name the target *.npy, got {os.fspath(path)!r}")
        table = self._live_table()
        if table.is_backing_file(path):
            table.flush()
            return
        rows = table.as_tensor(for_reading=True)
        # numpy has no bfloat16: saved as float32, which holds each of its values exactly (as tables save it).
        wide = table.dtype is torch.bfloat16
        np_dtype = np.dtype(np.float32) if wide else numpy_dtype(table.dtype)
        chunks = ((rows[start:stop].float() if wide else rows[start:stop]).cpu().numpy()
                  for start, stop in files.row_ranges(table.shape, np_dtype))
        files.write_npy(path, self.shape, np_dtype, chunks)

    def load(self, path: "str | os.PathLike") -> "DataGadget":
        """Replace the data with a ``.npy`` file's (any shape), held as this gadget was asked to.

        All or nothing: the new rows are read before the old ones are
        released (so both are held for a moment), and a load that fails to
        read them leaves the gadget with its old data. Should only closing
        the old rows fail (a mapped file's flush), the new ones are held and
        that error is raised.

        Args:
            path: the ``*.npy`` file.

        Returns:
            self

        Raises:
            FileFormatError, FileNotFoundError, OptionError: as the constructor.
            OutOfMemoryError: no room for the new rows.
            StateError: the gadget is closed, or was closed by another thread while
                the new rows were read (they are released, not kept).
        """
        if self.closed:  # as a closed HostTable's load_from: nothing is read
            raise StateError("this DataGadget is closed; build a new one over the file to read it")
        source = (self._path, self._array, self._header, self._row_shape, self._num_rows, self._dtype,
                  self._mapped)
        self._set_source(path)
        table = None
        try:
            table = self._build_table()
            # Installed under close()'s lock: a gadget closed while the new rows were read must not
            # hold them (close() released the old ones and will not look again).
            with self._installing:
                if self._closed:
                    raise StateError("this DataGadget was closed while load() read the new rows, which "
                                     "are released; build a new DataGadget over the file to read it")
                # Installed before the old rows are closed: a flush of those that fails leaves the
                # gadget holding the file it was asked to load, not old rows under the new shape.
                old, self._table = self._table, table
        except BaseException:
            (self._path, self._array, self._header, self._row_shape, self._num_rows, self._dtype,
             self._mapped) = source
            if table is not None:
                table.close()
            raise
        if old is not None:
            old.close()
        return self

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """The data as a numpy array of :attr:`shape`.

        Args:
            copy: an independent copy; otherwise host data is returned without
                a copy (writes go through), device data as a host copy.

        Returns:
            numpy.ndarray
        """
        return self._live_table().to_numpy(copy=copy).reshape(self.shape)

    def close(self) -> None:
        """Release the rows' memory (flushing a mapped file); later use raises StateError. Idempotent."""
        with self._installing:  # a first use reading meanwhile then releases what it read
            self._closed = True
        if self._table is not None:
            self._table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _unmappable(path, dtype, why) -> DTypeError:
    """The error for byte-swapped (big-endian) rows a gadget would map: torch cannot view them in place."""
    what = "this memmap" if path is None else repr(path)
    return DTypeError(f"{what} holds {dtype.newbyteorder('=')} in the other byte order ({dtype.str!r}, "
                      f"big-endian), which torch cannot read in place, and it would be mapped ({why}); "
                      f"pass mmap=False to read it into memory in this machine's byte order, or write it "
                      f"once in that order: np.save(new, np.load(path, mmap_mode='r').astype('={dtype.char}'))")


def _refuse_token_ids(dtype):
    """Refuse uint16/uint32 rows, the widths token ids come in, naming the reader that takes them."""
    name = str(dtype).replace("torch.", "")
    if name in ("uint16", "uint32"):
        raise DTypeError(f"DataGadget holds table dtypes, not {name}; for token ids of that width "
                         f"use BatchFeeder(np.load(path, mmap_mode='r')), which reads them as they "
                         f"are and delivers int32/int64 batches. For bfloat16 bit patterns (the file "
                         f"behind a storage='mmap' bfloat16 table) pass the tensor they are: "
                         f"DataGadget(torch.from_numpy(np.load(path).view(np.int16)).view(torch.bfloat16))")
