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
import weakref

import numpy as np
import torch

from typing import NoReturn, Optional, Union

from .. import files
from ..atomic import PathLike, as_path
from ..backends import STORAGE_KINDS, available_ram, get_backend
from ..backends.resolve import BackendLike, DeviceLike
from ..convert import (as_host_array, as_id_tensor, as_values_array, check_dense, check_rows, numpy_dtype,
                       torch_dtype)
from ..errors import DTypeError, OptionError, ShapeError, StateError
from ..table import HostTable
from .create import native_copy_advice

__all__ = ["DataGadget"]

#: A file is memory-mapped (when ``mmap=None``) once it needs more than this
#: share of the RAM available now: the rest is left for the model and the OS.
RAM_SHARE = 0.75

_CLOSED = "this DataGadget is closed; build a new one to read the data again"

#: The gadgets alive, whose locks and use counts a forked child starts afresh (see _after_fork_in_child).
_GADGETS = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """Give every gadget of a forked child a free lock and no calls under way but the forking thread's.

    A thread of the parent may have held a gadget's lock at the fork, or been
    inside a get: the child does not have that thread, so its lock would stay
    held and its count up for good (every get, or any load or close, would
    wait forever). As :mod:`logging` does for its handlers' locks. The thread
    that forked is the child's: a get it forked inside goes on, and ends, there.
    """
    for gadget in list(_GADGETS):
        gadget._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _row_length(row_shape):
    return int(np.prod(row_shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class _Held:
    """What a gadget holds, replaced whole: no reader sees the new file's shape with the old rows.

    Attributes:
        path: the absolute ``.npy`` path, or None for an in-memory array.
        array: the array (as the table copies or adopts it), None for a file.
        header: the file's header when it was opened, None for an array.
        row_shape, num_rows, dtype: the shape of a row, the rows, the table's torch dtype.
        table: the :class:`~speedswap.HostTable` once the rows are read, else None.
        file: the file a mapped table maps, held open (every call checks it for
            truncation and a new header, whatever names it by then), else None.
    """

    path: Optional[str]
    array: object
    header: object
    row_shape: tuple
    num_rows: int
    dtype: torch.dtype
    table: Optional[HostTable] = None
    file: Optional[files.MappedFile] = None


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

    def __init__(self, source: Union[PathLike, np.ndarray, torch.Tensor], *, storage: str = "pageable",
                 mmap: Optional[bool] = None,
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
        self._no_calls_under_way()
        _GADGETS.add(self)
        self._closed = False  # closed before its first read there is no table to say so
        self._held = self._describe(source)

    def _describe(self, data) -> _Held:
        """Validate the file header or array and describe it; the rows are read later (no table)."""
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
        return _Held(path, array, header, row_shape, int(shape[0]), table_dtype)

    @staticmethod
    def _read_header(path):
        # suffix_format, not file_format: a path without a suffix must not be told that HDF5 would do.
        if files.suffix_format(path) != "npy":
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
        self._live()
        return self

    def _live(self) -> _Held:
        """What the gadget holds, its rows read (on first use: now). One snapshot: a load may replace it.

        Raises:
            StateError: the gadget is closed, or was closed while its rows were read.
        """
        if self.closed:
            raise StateError(_CLOSED)
        held = self._held
        if held.table is None:
            # Read outside the lock (a process forked mid-read must not inherit it held); the
            # first table installed is the gadget's, since another thread may write into it at once.
            built = self._build_table(held)
            with self._installing:
                # Not over a load's data (read meanwhile from another file), nor once closed.
                installed = self._held is held and not self._closed
                if installed:
                    self._held = built
            if not installed:  # another thread's first use or load read the rows first, or close() came
                self._close_unused(built)
            if self._closed:
                raise StateError("this DataGadget was closed while its rows were read; build a new "
                                 "one to read the data again")
            held = self._held
        return held

    def _live_table(self) -> HostTable:
        """The table holding the rows, read on first use (see :meth:`_live`)."""
        return self._live().table

    def _no_calls_under_way(self) -> None:
        """A free lock and no calls counted: when built, and in a forked child (see :meth:`_forked`)."""
        # Replaced under the lock: first uses and loads install one table, none once closed. Re-entrant:
        # a signal handler's close() may interrupt its own thread's get while the get holds it.
        self._installing = threading.RLock()
        # The uses of the calls (get, put, ...) under way -> the table each took and its thread. A use is a
        # lock its call holds until it ends (see _InUse): a load or close waits for those of other threads
        # before it closes the table they took, so they complete on its rows instead of failing half-way.
        # Never for its own thread's: a signal handler closing the gadget inside a get would wait for a
        # call that can only go on once it returns.
        self._users = {}

    def _forked(self) -> None:
        """In a forked child: a free lock, and no calls under way but those of the thread that forked."""
        me = threading.get_ident()  # the forking thread's, in the child too
        mine = {use: taken for use, taken in self._users.items() if taken[1] == me}
        self._no_calls_under_way()
        self._users.update(mine)

    def _take(self, use) -> _Held:
        """What the gadget holds (see :meth:`_live`), its table in use until the lock ``use`` is released.

        Args:
            use: a new lock of the call's, acquired here (see :class:`_InUse`).

        Raises:
            StateError: the gadget is closed.
            FileFormatError: the file a gadget built from its path maps was
                truncated since, or rewritten in place with another header
                (:meth:`~speedswap.files.MappedFile.check`); ``use`` is held then.
        """
        self._live()  # the rows are read outside the lock
        with self._installing:
            if self._closed:  # since _live looked
                raise StateError(_CLOSED)
            held = self._held
            for ended in [used for used in self._users if not used.locked()]:  # so only calls under way stay
                del self._users[ended]
            use.acquire()
            self._users[use] = (held.table, threading.get_ident())
        if held.file is not None:
            # Before any call touches the mapped rows: a page past the end of a truncated file is a SIGBUS
            # (a get's read, a put's write, a save's copy), and a new header's rows are elsewhere.
            held.file.check("restore the file, or build a new DataGadget over it")
        return held

    def _close_unused(self, held: _Held) -> None:
        """Close ``held``'s table and mapped file once no call under way in another thread uses them (:meth:`_take`)."""
        table = held.table
        me = threading.get_ident()
        with self._installing:
            under_way = [use for use, (used, thread) in self._users.items() if used is table and thread != me]
        for use in under_way:
            with use:  # taken once that call has released it
                pass
        try:
            table.close()
        finally:
            if held.file is not None:
                held.file.close()  # after the calls under way: each checked it before touching the rows

    def _wants_mmap(self, nbytes):
        if self._mmap is None:
            return nbytes > RAM_SHARE * available_ram()
        return self._mmap

    def _build_table(self, held) -> _Held:
        """``held`` with its rows read into a new table; a mapped file's with its identity and the header mapped by.

        Args:
            held: a description without a table (:meth:`_describe`).
        """
        rows = (held.num_rows, _row_length(held.row_shape))
        if held.array is not None:
            flat = held.array.reshape(rows)
            # A strided view of a map cannot be adopted, nor can bfloat16 (a tensor) or byte-swapped
            # values (torch views neither): they are copied like any array.
            adoptable = isinstance(flat, np.ndarray) and flat.flags.c_contiguous and flat.dtype.isnative
            mapped = isinstance(flat, np.memmap) and self._mmap is not False and adoptable
            shared = self._storage == "pageable" and self._mmap is not False and adoptable
            if mapped or shared:
                return dataclasses.replace(held, table=HostTable.adopt(flat, backend=self._backend))
            return dataclasses.replace(held, table=HostTable.from_numpy(flat, storage=self._storage,
                                                                         backend=self._backend))
        header = files.read_npy_header(held.path)  # again: the file may have changed since then
        files.check_matches(header, held.header.shape, held.header.dtype, held.path)
        if self._wants_mmap(rows[0] * rows[1] * header.dtype.itemsize):
            if not header.dtype.isnative:
                raise _unmappable(held.path, header.dtype, "it needs more than 3/4 of the RAM available")
            # Writes reach the file only when asked for (mmap=True): mapped because it is
            # large (mmap=None), a smaller file's rows would be a copy, so puts must not
            # write the dataset on disk depending on the RAM free today.
            mode = "r+" if self._mmap is True and os.access(held.path, os.W_OK) else "r"
            array = files.map_npy(held.path, header, mode, rows)
            # The file the map holds, held open for every call to check for truncation and a new header:
            # the path may name another file later (removed, or replaced by a rename).
            file = files.MappedFile(held.path, header, files.mapped_identity(array.ctypes.data)
                                    or files.identity(os.stat(held.path)))
            return dataclasses.replace(held, table=HostTable.adopt(array, backend=self._backend), file=file,
                                       header=header)
        # Read into the table, not copied from a map: a file truncated meanwhile ends a read
        # early (FileFormatError), where a map's missing page is a SIGBUS.
        table = HostTable.empty(*rows, header.table_dtype, self._storage, self._backend)
        try:
            files.read_table(table, held.path, dataclasses.replace(header, shape=rows))
        except BaseException:
            table.close()  # half-filled, and perhaps page-locked memory: not left to the collector
            raise
        return dataclasses.replace(held, table=table)

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple:
        """``(n, *row_shape)``, the dataset's shape."""
        held = self._held
        return (held.num_rows, *held.row_shape)

    @property
    def row_shape(self) -> tuple:
        """The shape of one row (``()`` for a 1-D dataset such as labels)."""
        return self._held.row_shape

    @property
    def table(self) -> HostTable:
        """The :class:`~speedswap.HostTable` holding the rows (reads them if needed)."""
        return self._live_table()

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the rows, from the file's header or the array: nothing is read."""
        return self._held.dtype

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
        table = self._held.table
        return self._closed or (table is not None and table.closed)

    @property
    def path(self) -> Optional[str]:
        """The ``.npy`` file the data came from, as an absolute path, or None for an in-memory array."""
        return self._held.path

    def __len__(self):
        return self._held.num_rows

    def __getitems__(self, idx) -> NoReturn:
        """Refused: what a ``DataLoader`` over the gadget calls for each batch's rows.

        Raises:
            DTypeError: always, saying what reads the rows instead.
        """
        # torch's DataLoader fetches a batch through __getitems__ when a dataset has one, else one
        # dataset[i] per row; without this, DataLoader(gadget) failed inside torch's fetcher with
        # "'DataGadget' object is not subscriptable". No __getitem__: np.asarray would call it.
        raise DTypeError("a DataGadget is no torch Dataset for a DataLoader to read row by row: read a "
                         "batch with gadget.get(ids) (SpeedTorch: getData(ids)), or iterate whole "
                         "batches with ss.BatchFeeder(gadget, batch_size=...), one gather each")

    def __repr__(self):
        held = self._held
        where = repr(held.path) if held.path is not None else "<array>"
        if self.closed:
            state = "closed"
        else:
            state = "not read yet" if held.table is None else f"storage={held.table.storage!r}"
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
                truncated since, or rewritten in place with another header
                (rows elsewhere, or of another dtype or shape). A gadget built
                from a memory-mapped array you made sees only its file's
                length (:meth:`HostTable.adopt`): truncated under it, the file
                is refused too, but what it holds is yours to keep.
        """
        with _InUse(self) as held:
            rows = held.table.gather(idx)
        return rows.view((*rows.shape[:-1], *held.row_shape))  # a tuple: () for one label

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
            FileFormatError: as :meth:`get`; nothing is written.
        """
        with _InUse(self) as held:
            self._put(held, t, idx)

    def _put(self, held: _Held, t, idx) -> None:
        """:meth:`put` into ``held``'s table, which the caller keeps in use."""
        table = held.table
        if not table.writable and held.path is not None and self._mmap is None:
            raise StateError(f"this DataGadget maps {held.path!r} read-only: it is larger than the "
                             f"RAM free, and writing would change the dataset on disk. Pass mmap=True "
                             f"to write through to the file, or mmap=False to copy it into memory")
        # The ids' shape as the table reads them (np.shape would take a ragged list); the table checks
        # their values, where they are (uint64 ids named as given, host ids without a device wait).
        where = idx.device if isinstance(idx, torch.Tensor) else "cpu"
        # Named by position: HostTable.scatter takes the ids first, so swapped arguments are a likely
        # cause of float ids, and "convert them with .long()" alone would write the truncated values.
        flat, ids_shape = as_id_tensor(idx, table.device, to=where, num_rows=table.num_rows,
                                       what="ids (the second argument of put / insertData, after the values)")
        wanted = (*ids_shape, *held.row_shape)
        if isinstance(t, torch.Tensor):
            check_dense(t, "values")  # before .shape and .reshape, which raise on a nested or sparse one
            values = t
        else:
            values = as_values_array(t, wanted)
        if tuple(values.shape) != wanted:
            raise ShapeError(f"values have shape {tuple(values.shape)} but {len(flat)} ids of rows "
                             f"shaped {held.row_shape} need shape {wanted}")
        table.scatter(idx, values.reshape(len(flat), table.dim))

    def flush(self) -> None:
        """Make rows written with :meth:`put` durable: a mapped file is synced to disk.

        ``put`` on a memory-mapped gadget writes through to the file at once
        (other readers of the file, a :class:`~speedswap.BatchFeeder`
        included, see the new rows); ``flush`` waits until they are on disk.
        For in-memory data it only waits for pending device writes.

        Raises:
            StateError: the gadget is closed.
            FileFormatError: as :meth:`get`.
        """
        with _InUse(self) as held:
            held.table.flush()

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
            FileFormatError: as :meth:`get`; nothing is written.
        """
        if files.suffix_format(path) != "npy":
            raise OptionError(f"DataGadget saves .npy files; name the target *.npy, got {os.fspath(path)!r}")
        with _InUse(self) as held:
            self._save(held, path)

    @staticmethod
    def _save(held: _Held, path) -> None:
        """:meth:`save` of ``held``'s table, which the caller keeps in use."""
        table = held.table
        if table.is_backing_file(path):
            table.flush()
            return
        rows = table.as_tensor(for_reading=True)
        # numpy has no bfloat16: saved as float32, which holds each of its values exactly (as tables save it).
        wide = table.dtype is torch.bfloat16
        np_dtype = np.dtype(np.float32) if wide else numpy_dtype(table.dtype)
        chunks = ((rows[start:stop].float() if wide else rows[start:stop]).cpu().numpy()
                  for start, stop in files.row_ranges(table.shape, np_dtype))
        files.write_npy(path, (held.num_rows, *held.row_shape), np_dtype, chunks)

    def load(self, path: "str | os.PathLike") -> "DataGadget":
        """Replace the data with a ``.npy`` file's (any shape), held as this gadget was asked to.

        All or nothing: the new rows are read before the old ones are
        released (so both are held for a moment); until then the gadget
        serves its old data, shape and path included, to every thread, and a
        load that fails to read them leaves the gadget with its old data. Should only closing
        the old rows fail (a mapped file's flush), the new ones are held and
        that error is raised. Calls that other threads began on the old rows
        (:meth:`get`, :meth:`put`, ...) complete on them: the load waits for
        them before it releases the old rows.

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
        # The gadget keeps describing its old data until the new rows are read and installed with
        # their description at once: a get meanwhile, or a load that fails, sees no mix of the two.
        held = self._describe(path)
        built = None
        try:
            built = self._build_table(held)
            # Installed under close()'s lock: a gadget closed while the new rows were read must not
            # hold them (close() released the old ones and will not look again).
            with self._installing:
                if self._closed:
                    raise StateError("this DataGadget was closed while load() read the new rows, which "
                                     "are released; build a new DataGadget over the file to read it")
                # Installed before the old rows are closed: a flush of those that fails leaves the
                # gadget holding the file it was asked to load, not old rows under the new shape.
                old, self._held = self._held, built
        except BaseException:
            if built is not None:
                self._close_unused(built)
            raise
        if old.table is not None:
            self._close_unused(old)
        return self

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """The data as a numpy array of :attr:`shape`.

        Args:
            copy: an independent copy; otherwise host data is returned without
                a copy (writes go through), device data as a read-only host
                copy (a write into it, which could not reach the data, raises).

        Returns:
            numpy.ndarray

        Raises:
            OptionError: ``copy`` is not a bool (as :meth:`HostTable.to_numpy`).
            FileFormatError: as :meth:`get`.
        """
        with _InUse(self) as held:
            return held.table.to_numpy(copy=copy).reshape(held.num_rows, *held.row_shape)

    def close(self) -> None:
        """Release the rows' memory (flushing a mapped file); later use raises StateError. Idempotent.

        Calls that other threads began before (:meth:`get`, :meth:`put`, ...)
        complete first: close waits for them.
        """
        with self._installing:  # a first use or load reading meanwhile then releases what it read
            self._closed = True
        held = self._held
        if held.table is not None:
            self._close_unused(held)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _InUse:
    """``with _InUse(gadget) as held``: what ``gadget`` holds, its table in use by this call in the block.

    The use is a lock of the call's own, held from when it takes the table to the block's end; a load
    or close waits for it by taking it (:meth:`DataGadget._close_unused`). A class, not a generator
    function: it runs in every get, and contextlib's would add 2-3 us to it.
    """

    __slots__ = ("_gadget", "_use")

    def __init__(self, gadget: DataGadget):
        self._gadget = gadget
        self._use = threading.Lock()

    def __enter__(self) -> _Held:
        # Taken inside the try: an interrupt (Ctrl-C) that lands after the use is taken and before the
        # with block begins, where __exit__ would not run, releases it here; one before, nothing.
        # Otherwise a close or load on another thread would wait for this call forever.
        try:
            return self._gadget._take(self._use)
        except BaseException:
            if self._use.locked():  # by this call: no other takes it before it is released
                self._use.release()
            raise

    @property
    def __exit__(self):
        """The use's own ``__exit__``, which releases it: C, so no interrupt lands before it does.

        Python runs a signal handler on entering a function: one that landed as a Python ``__exit__``
        was entered would leave the use held, and a close or load on another thread waiting for good.
        """
        return self._use.__exit__


def _unmappable(path, dtype, why) -> DTypeError:
    """The error for byte-swapped (big-endian) rows a gadget would map: torch cannot view them in place."""
    what = "this memmap" if path is None else repr(path)
    return DTypeError(f"{what} holds {dtype.newbyteorder('=')} in the other byte order ({dtype.str!r}, "
                      f"big-endian), which torch cannot read in place, and it would be mapped ({why}); "
                      f"pass mmap=False to read it into memory in this machine's byte order, or "
                      f"{native_copy_advice(dtype)}")


def _refuse_token_ids(dtype):
    """Refuse uint16/uint32 rows, the widths token ids come in, naming the reader that takes them."""
    # Named in this machine's byte order: a big-endian file's '>u2' holds token ids as much as 'uint16' does.
    name = dtype.newbyteorder("=").name if isinstance(dtype, np.dtype) else str(dtype).replace("torch.", "")
    if name in ("uint16", "uint32"):
        raise DTypeError(f"DataGadget holds table dtypes, not {name}; for token ids of that width "
                         f"use BatchFeeder(np.load(path, mmap_mode='r')), which reads them as they "
                         f"are and delivers int32/int64 batches. For bfloat16 bit patterns (the file "
                         f"behind a storage='mmap' bfloat16 table) pass the tensor they are: "
                         f"DataGadget(torch.from_numpy(np.load(path).view(np.int16)).view(torch.bfloat16))")
