"""HostTable: a 2-D row table in host (or device) memory with row transport.

>>> import numpy as np, torch, speedswap as ss
>>> table = ss.HostTable.from_numpy(np.arange(12, dtype=np.float32).reshape(4, 3),
...                                 storage="pageable", backend="numpy")
>>> table.gather([3, 0, 3]).tolist()
[[9.0, 10.0, 11.0], [0.0, 1.0, 2.0], [9.0, 10.0, 11.0]]
>>> table.scatter([1], torch.ones(1, 3))
>>> table.to_numpy()[1].tolist()
[1.0, 1.0, 1.0]
"""

import contextlib
import dataclasses
import errno
import math
import os
import warnings
import weakref
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from . import files
from .atomic import PathLike, as_path, rewriting_in_place
from .backends import STORAGE_KINDS, available_ram, get_backend
from .backends.resolve import BackendLike, DeviceLike
from .convert import (ROWS_ADVICE, DTypeLike, Ids, Rows, as_host_rows, as_row_ids, as_row_values, bool_option,
                      check_not_masked, float_option, host_tensor, initialiser_option, int_option, numpy_dtype,
                      numpy_view, torch_dtype)
from .errors import (DeviceError, DuplicateIdError, DTypeError, FileFormatError, OptionError, OutOfMemoryError,
                     PathError, ShapeError, StateError)
from .live import Registry
from .mappings import memmap_file_offset

__all__ = ["HostTable", "live_tables", "check_storage", "loading_into"]

_LIVE = Registry()


def live_tables():
    """The tables that are open now (not closed, not collected)."""
    return _LIVE.snapshot()


def check_storage(storage, path=None):
    """Raise :class:`OptionError` unless ``storage`` is a storage kind (``mmap`` with a .npy path, the others without)."""
    if storage not in STORAGE_KINDS:
        raise OptionError(f"unknown storage {storage!r}; choose one of {STORAGE_KINDS}")
    if storage != "mmap" and path is not None:
        raise OptionError(f"path={os.fspath(path)!r} is the file storage='mmap' keeps the table in; "
                          f"storage={storage!r} keeps it in memory and writes no file: drop path, or "
                          f"use storage='mmap'")
    if storage == "mmap" and path is None:
        raise OptionError("storage='mmap' keeps the table in a .npy file: pass path='table.npy'")
    if storage == "mmap" and files.file_format(path) != "npy":
        raise OptionError(f"storage='mmap' needs a .npy path, got {os.fspath(path)!r}")


def _out_of_memory(shape, dtype, storage, device: torch.device):
    nbytes = shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size()
    needs = f"a {shape[0]} x {shape[1]} {dtype} table needs {nbytes / 2**30:.2f} GiB of"
    if storage == "device" and device.type == "cuda":  # on the numpy backend a device table is in RAM
        return OutOfMemoryError(f"{needs} GPU memory, which could not be allocated; keep it in "
                                f"host memory (storage='pinned': only the rows a step touches go "
                                f"to the GPU), or use fewer rows")
    return OutOfMemoryError(
        f"{needs} RAM, which could not be allocated ({available_ram() / 2**30:.2f} GiB of RAM is "
        f"available now); use storage='mmap' to keep it in a file, with path= a .npy file for a HostTable "
        f"or ModelFactory, a directory for an OffloadedEmbedding or OptimizerFactory (which keep their "
        f"optimizer state there too); or use fewer rows")


def _aligned(ranges, dim, multiple):
    """``ranges`` of rows ``dim`` long cut again: each but the last holds a multiple of ``multiple``
    values, about as many as before, and the last at least ``multiple`` (or all of them)."""
    unit = multiple // math.gcd(dim, multiple)  # the fewest rows holding a multiple of `multiple` values
    step = max(unit, (ranges[0][1] - ranges[0][0]) // unit * unit)
    rows = ranges[-1][1]
    starts = list(range(0, rows, step))
    if len(starts) > 1 and (rows - starts[-1]) * dim < multiple:
        starts.pop()  # too short a last chunk joins the one before
    return list(zip(starts, starts[1:] + [rows]))


def _has_duplicates(flat):
    # A sort and a neighbour compare: cheaper than torch.unique, no extra
    # memory per table row, and the same code on the CPU and the GPU.
    if len(flat) < 2:
        return False
    ordered = torch.sort(flat).values
    return bool((ordered[1:] == ordered[:-1]).any())


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the contiguous tensors ``a`` and ``b`` share any byte of memory."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return (a_start < b_start + b.numel() * b.element_size()
            and b_start < a_start + a.numel() * a.element_size())


def _file_id(path) -> Optional[tuple]:
    """Which file is at ``path`` (:func:`~speedswap.files.identity`), or None when there is none."""
    try:
        return files.identity(os.stat(path))
    except OSError:
        return None


def _maps_whole_file(array: np.ndarray, path) -> bool:
    """Whether ``array`` is all of the ``.npy`` file at ``path``'s data, as stored (a view of the
    whole map, not a slice or a reinterpretation of it)."""
    mapping = getattr(array, "_mmap", None)
    node = array
    while node.base is not mapping:  # each view on the way must cover what its parent covers
        parent = node.base
        if (not isinstance(parent, np.ndarray) or parent.nbytes != node.nbytes or parent.dtype != array.dtype
                or parent.__array_interface__["data"][0] != node.__array_interface__["data"][0]):
            return False
        node = parent
    header = files.read_npy_header(path)
    return (isinstance(node, np.memmap) and node.offset == header.offset and node.dtype == header.dtype
            and node.nbytes == int(np.prod(header.shape)) * header.dtype.itemsize)


def _memmap_under(array: np.ndarray) -> Optional[np.memmap]:
    """The ``np.memmap`` whose map holds ``array``: itself, or the first memmap among its bases, or None.

    ``np.asarray(memmap)`` and other plain views of a memmap are no memmaps,
    yet their rows are the file's as much as the memmap's are.
    """
    node = array
    while isinstance(node, np.ndarray):
        if isinstance(node, np.memmap) and getattr(node, "_mmap", None) is not None:
            return node
        node = node.base
    return None


def _copy_on_write(array: np.ndarray, memmap: np.memmap) -> Optional[np.ndarray]:
    """A private copy-on-write map of the file bytes ``array``, inside a read-only memmap, shows, or None.

    Reading it reads the same page cache (no copy). A write copies the page it
    touches into this process's private memory, so it reaches neither the file
    nor ``array``, and cannot fault on a page the system mapped read-only.

    Args:
        array: a view of ``memmap`` (itself, or a plain view: :func:`_memmap_under`).
        memmap: an ``np.memmap`` over a file mapped ``'r'``.

    Returns:
        numpy.ndarray of ``array``'s shape and dtype, or None when the file
        cannot be mapped again: no file name (a memmap of a file object), or
        the name now names another file (replaced since it was mapped).
    """
    if memmap.filename is None:
        return None
    offset = memmap_file_offset(array, memmap)
    try:
        with open(memmap.filename, "rb") as f:
            mapped = files.mapped_identity(array.ctypes.data)
            if mapped is not None and mapped != files.identity(os.fstat(f.fileno())):
                return None
            return np.memmap(f, dtype=array.dtype, mode="c", offset=offset, shape=array.shape)
    except OSError:
        return None


def _bfloat16_bits_header(path, dtype, mmap) -> files.TableHeader:
    """The header of the uint16 ``.npy`` file behind a bfloat16 ``mmap`` table, read as bfloat16.

    Raises:
        OptionError: ``dtype`` other than bfloat16, or without ``mmap``.
        FileFormatError: the file is not 2-D uint16, or has no rows or empty rows.
    """
    if not mmap:
        raise OptionError("dtype= goes with mmap=True: it maps the file of a bfloat16 mmap table; "
                          "to copy it elsewhere, map it and save() it (saved files hold float32)")
    if torch_dtype(dtype) is not torch.bfloat16:
        raise OptionError(f"dtype={dtype!r}: only 'bfloat16' is read from another stored dtype "
                          f"(uint16 bit patterns); leave dtype=None to use the file's own")
    header = files.read_npy_header(path)
    if header.dtype != np.dtype(np.uint16) or len(header.shape) != 2:
        raise FileFormatError(f"{os.fspath(path)!r} holds {header.shape} {header.dtype}, but the "
                              f"file of a bfloat16 mmap table is 2-D uint16 (its bit patterns); "
                              f"leave dtype=None to load it as what it holds")
    files.check_table_shape(header.shape, path)
    return dataclasses.replace(header, table_dtype=torch.bfloat16)


class _HandedOut:
    """The memory behind a view :meth:`HostTable.to_numpy` or :meth:`HostTable.as_tensor` hands out.

    The view is a numpy array over this object (``np.asarray``), so every
    array and tensor made from it keeps it alive (numpy as their base, torch
    as its array's owner): the table tells from a weak reference to it
    whether any of them still is.
    """

    def __init__(self, array: np.ndarray):
        self.__array_interface__ = array.__array_interface__
        self._array = array  # the memory lives as long as any view of it


def _call_owner(method: Optional[weakref.WeakMethod]) -> None:
    """Call a method :meth:`HostTable.watch_reads` or ``watch_writes`` holds, if its owner is alive."""
    bound = None if method is None else method()
    if bound is not None:
        bound()


class HostTable:
    """A ``(num_rows, dim)`` table whose rows move to and from the device on demand.

    Build one with :meth:`empty`, :meth:`zeros`, :meth:`from_numpy` or
    :meth:`load`. ``storage`` picks where the rows live: ``pinned``
    (page-locked host memory), ``mapped`` (page-locked and mapped for
    zero-copy device access), ``pageable`` (ordinary host memory), ``mmap`` (a
    ``.npy`` file, for tables larger than RAM) or ``device`` (GPU memory). On
    the numpy backend there is no device to pin for, so ``pinned``, ``mapped``
    and ``device`` are ordinary host memory (:attr:`pinned` says which); a
    ``device`` table there still hands out no view of it, as on a GPU
    (:meth:`to_numpy` is a read-only copy), so code that runs on the CPU runs on a GPU.

    Pinned memory is returned to the driver when the table is closed (or used
    as a context manager) and no view from :meth:`to_numpy` is still alive.

    A load that stops while it writes the rows (:func:`loading_into`: Ctrl-C
    in :meth:`load_from`, or in a checkpoint's load) leaves the table
    refusing every read and write with a :class:`~speedswap.StateError`,
    as a closed one does, until a load into it completes or it is closed.

    An ``mmap`` table mapped from its own file (made by :meth:`empty` and
    the other constructors, or :meth:`load` with ``mmap=True``) holds a
    descriptor of the file until it is closed, and checks the file through it
    before each call touches its rows, at one ``os.fstat`` while the file is
    unchanged. Truncated since (its missing pages would kill the process
    with SIGBUS), under its path or any other name it has by then, or
    rewritten in place with another ``.npy`` header (``np.save``
    of another array to its path), every read, write, load and :meth:`flush`
    raises :class:`~speedswap.FileFormatError` before anything changes:
    restore the file, or build the table again from a checkpoint. Rewritten
    with the same header, the file's new rows are the table's. Removed, or
    replaced by a rename, the file stays whole in the map and the table goes
    on with it, but its path no longer names it: :meth:`flush` raises
    :class:`~speedswap.PathError`, and its rows go at :meth:`close` unless
    saved (:meth:`save` to the path writes a new file). A table over an
    adopted memmap (:meth:`adopt`) checks only that its file is still long
    enough (one ``fstat`` through the map's own descriptor), and refuses
    alike a file truncated under it; what the file holds is its caller's.

    Threads: like a numpy array or a tensor, a table takes no lock. Gathers
    may run in several threads at once, and so may scatters to disjoint rows;
    a gather that runs while another thread scatters the same rows can return
    rows that are part old, part new, and two threads scattering one row
    leave either thread's values. Serialise such calls (a ``threading.Lock``
    around them), and do not :meth:`close` a table another thread is using.
    """

    def __init__(self, buffer, backend, path: Optional[PathLike] = None,
                 header: Optional[files.TableHeader] = None):
        self._buffer = buffer
        self._backend = backend
        self._path = None if path is None else as_path(path)
        # The mapped file's identity (from the map itself where the system shows it): a save to
        # it under any spelling (a symlink, a relative path after chdir) must flush it, not write
        # a new file the map no longer reaches.
        self._file_id = None if path is None else (
            files.mapped_identity(buffer.host.ctypes.data) or _file_id(path))
        # The .npy file this table mapped itself (empty, load), held open: every call that touches the
        # rows checks it first (_check_file), whatever its names by then. None for an adopted memmap
        # (see _adopted_map) and for memory. Its path is absolute: a relative one names another file
        # after a chdir.
        self._mapped = None if header is None else files.MappedFile(os.path.abspath(path), header, self._file_id)
        # An adopted memmap's mmap object, the byte of its file its rows end at, and the file's name (None
        # for a map of a file object): every call that touches the rows checks the file is that long first,
        # through the descriptor the mmap object keeps (its size()), whatever names the file has.
        self._adopted_map = None
        self._shape = tuple(buffer.tensor.shape)
        self._dtype = buffer.tensor.dtype
        self._kind = buffer.kind  # still reported once the buffer is released
        self._writable = buffer.host is None or bool(buffer.host.flags.writeable)
        self._before_read = self._before_write = None  # see watch_reads, watch_writes
        self._views = weakref.WeakSet()  # what the views a watched table handed out are over
        self._views_handed_out = 0  # how many it handed out (see views_handed_out)
        self._device_view = False  # whether a watched device table handed out its tensor (see viewed)
        self._torn = None  # why its rows may be part one state, part another (see loading_into)
        # Whether this is a new mmap file that nothing has written into (or handed out a view of):
        # it reads as zeros from its holes, which zero_ leaves (see there).
        self._unwritten_file = False
        _LIVE.add(self)

    # ----------------------------------------------------------- constructors
    @classmethod
    def empty(cls, num_rows: int, dim: int, dtype: DTypeLike = "float32", storage: str = "pinned",
              backend: BackendLike = "auto", path: Optional[PathLike] = None, *, device: DeviceLike = None,
              overwrite: bool = False) -> "HostTable":
        """An uninitialised table.

        Args:
            num_rows: number of rows.
            dim: row length.
            dtype: ``"float32"``, ``"float16"``, ``"bfloat16"``, ... (numpy or torch dtype).
            storage: one of ``pinned``, ``mapped``, ``pageable``, ``mmap``, ``device``.
            backend: ``"auto"``, ``"cuda"`` or ``"numpy"`` (see
                :func:`~speedswap.backends.get_backend`).
            path: the ``.npy`` file backing an ``mmap`` table, created here.
            device: the CUDA device the rows move to (``"cuda:1"``); None is
                torch's current device.
            overwrite: let an ``mmap`` table replace an existing file at ``path``.

        Returns:
            HostTable

        Raises:
            OptionError: bad sizes (a byte count past ``sys.maxsize`` too) or
                storage kind, ``mmap`` without a path, or an ``overwrite`` that is not a bool.
            DTypeError: an unsupported dtype.
            BackendUnavailableError: ``backend="cuda"`` cannot run here.
            PathError: ``path`` exists (and not ``overwrite``) or cannot be created.
            OutOfMemoryError: the rows do not fit in the memory available.
        """
        shape = (int_option(num_rows, "num_rows"), int_option(dim, "dim"))
        # bool("False") is True: a truthy string would replace the file it was meant to keep.
        overwrite = bool_option(overwrite, "overwrite", hint=" (replace an existing file at path)")
        check_storage(storage, path)
        dtype = torch_dtype(dtype)
        files.npy_data_bytes(shape, numpy_dtype(dtype))  # numpy_dtype: bfloat16 as its 16-bit patterns
        backend = get_backend(backend, device)
        if storage == "mmap":
            array = files.create_npy_memmap(path, shape, numpy_dtype(dtype), overwrite)
            try:
                table = cls(backend.adopt(array, "mmap", dtype), backend, path,
                            files.TableHeader(array.shape, array.dtype, array.offset))
            except BaseException:  # out of descriptors, say: no table, and no new file a retry would refuse
                if not overwrite:
                    del array
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise
            table._unwritten_file = True
            return table
        try:
            return cls(backend.allocate(shape, dtype, storage), backend)
        except (MemoryError, OSError, torch.OutOfMemoryError) as exc:  # the last: GPU memory
            if isinstance(exc, OSError) and exc.errno != errno.ENOMEM:
                raise
            raise _out_of_memory(shape, dtype, storage, backend.device) from exc

    @classmethod
    def zeros(cls, num_rows: int, dim: int, dtype: DTypeLike = "float32", storage: str = "pinned",
              backend: BackendLike = "auto", path: Optional[PathLike] = None, *, device: DeviceLike = None,
              overwrite: bool = False) -> "HostTable":
        """A table of zeros; arguments as :meth:`empty`."""
        table = cls.empty(num_rows, dim, dtype, storage, backend, path, device=device,
                          overwrite=overwrite)
        table.zero_()
        return table

    @classmethod
    def from_numpy(cls, array: Rows, storage: str = "pinned", backend: BackendLike = "auto",
                   path: Optional[PathLike] = None,
                   *, device: DeviceLike = None, overwrite: bool = False) -> "HostTable":
        """A table holding a copy of the 2-D ``array``; arguments as :meth:`empty`.

        Args:
            array: a numpy array, nested lists, or a torch tensor on any device
                (a ``bfloat16`` tensor gives a bfloat16 table, exactly; one that
                requires grad is read, detached). A byte-swapped (big-endian)
                array is copied in the native byte order.

        Raises:
            ShapeError: ``array`` is not 2-D, or nested lists of different lengths.
            DTypeError: a dtype a table cannot hold, a numpy masked array (its
                masked entries hold no values), or a sparse or nested tensor.
            DeviceError: a tensor on the meta device (it has no values).
        """
        array, dtype = as_host_rows(array)
        if array.ndim != 2:
            raise ShapeError(f"a table is 2-D (rows, dim); got an array of shape {array.shape}: "
                             f"reshape it with a.reshape(len(a), -1)")
        table = cls.empty(array.shape[0], array.shape[1], dtype, storage, backend, path,
                          device=device, overwrite=overwrite)
        table._fill_from(lambda start, stop: array[start:stop])
        return table

    @classmethod
    def adopt(cls, array: np.ndarray, backend: BackendLike = "auto", *, device: DeviceLike = None) -> "HostTable":
        """A table over an existing 2-D host array, sharing its memory (no copy).

        Use it to serve rows of data you already hold: an in-memory array, or
        an ``np.memmap`` / ``np.load(..., mmap_mode=...)`` file larger than RAM,
        which stays on disk and is paged in as rows are read.

        Args:
            array: a C-contiguous 2-D ``numpy.ndarray`` (or ``np.memmap``).
                Writes through the table (``scatter``, initialisers) change it;
                a read-only array gives a read-only table.
            backend, device: as in :meth:`empty`.

        Returns:
            HostTable with storage ``mmap`` for a memmap, or a plain view of
            one (``np.asarray(memmap)``; writes reach the file when it was
            mapped ``r+``), and ``pageable`` otherwise. A memmap's table
            refuses every call that would touch its rows once the file was
            truncated under the map (a page past its end would kill the
            process with SIGBUS), with a :class:`~speedswap.FileFormatError`.

        Raises:
            ShapeError: ``array`` is not 2-D or not C-contiguous.
            DTypeError: an unsupported dtype, or a numpy masked array.
        """
        if not isinstance(array, np.ndarray):
            raise DTypeError(f"adopt takes a numpy array, got {type(array).__name__}; "
                             f"use from_numpy to copy other array types")
        check_not_masked(array, "the array")
        if array.ndim != 2:
            raise ShapeError(f"a table is 2-D (rows, dim); got an array of shape {array.shape}: "
                             f"reshape it with a.reshape(len(a), -1)")
        if not array.flags.c_contiguous:
            raise ShapeError("adopt needs a C-contiguous array (rows contiguous in memory); "
                             "pass np.ascontiguousarray(a) or copy it with from_numpy")
        int_option(array.shape[0], "num_rows")
        int_option(array.shape[1], "dim")
        torch_dtype(array.dtype)
        backend = get_backend(backend, device)
        memmap = _memmap_under(array)
        path = memmap.filename if memmap is not None and memmap.mode in ("r+", "w+") else None
        with warnings.catch_warnings():
            # torch warns that it cannot mark a tensor read-only; this table
            # refuses writes itself (see _writable_buffer).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            buffer = backend.adopt(array, "pageable" if memmap is None else "mmap")
        table = cls(buffer, backend, path)
        if memmap is not None:
            end = memmap_file_offset(array, memmap) + array.nbytes
            table._adopted_map = (memmap._mmap, end, memmap.filename)
        return table

    @classmethod
    def load(cls, path: PathLike, storage: str = "pinned", backend: BackendLike = "auto", mmap: bool = False,
             dataset: str = "table", *, device: DeviceLike = None,
             dtype: Optional[DTypeLike] = None) -> "HostTable":
        """A table read from a ``.npy`` or HDF5 file.

        Args:
            path: ``*.npy``, ``*.h5`` or ``*.hdf5``.
            storage: where the rows will live (ignored when ``mmap``).
            backend, device: as in :meth:`empty`.
            mmap: map the ``.npy`` file itself (storage ``mmap``): nothing is
                read up front and writes go through to the file.
            dataset: the HDF5 dataset holding the table.
            dtype: with ``mmap=True``, ``"bfloat16"`` maps a ``uint16`` ``.npy``
                file as the bfloat16 bit patterns it holds: the file behind a
                bfloat16 ``mmap`` table (numpy has no bfloat16). None: the
                file's own dtype.

        Returns:
            HostTable

        Raises:
            FileFormatError: a truncated, malformed or non-2-D file, one of
                no rows or empty rows, a ``dtype`` the file does not hold, or
                rows that differ from the CRC-32 an HDF5 file records.
            OptionError: an unknown ``storage`` (even with ``mmap``), an ``mmap``
                that is not a bool, ``dtype`` without ``mmap=True``, another
                suffix, or (HDF5) a ``dataset`` that names no dataset.
            FileNotFoundError: no such file.
            PathError: with ``mmap=True``, a file that cannot be mapped
                read-write (read-only file or file system).
        """
        if storage not in STORAGE_KINDS:  # ignored with mmap, but a misspelt kind is still a mistake
            check_storage(storage)
        # bool("False") is True: the file itself would be mapped, and training would write to it.
        mmap = bool_option(mmap, "mmap", hint=" (the file itself is the table)")
        header = (files.read_table_header(path, dataset) if dtype is None
                  else _bfloat16_bits_header(path, dtype, mmap))
        if mmap:
            check_storage("mmap", path)
            backend = get_backend(backend, device)
            array = files.open_npy_memmap(path, header=header)  # the file the header describes
            return cls(backend.adopt(array, "mmap", header.table_dtype), backend, path, header)
        if storage == "mmap":
            raise OptionError("to use the file itself as the table pass mmap=True; "
                              "storage='mmap' with a copy would need a second file")
        table = cls.empty(header.shape[0], header.shape[1], header.table_dtype, storage, backend,
                          device=device)
        files.read_table(table, path, header, dataset)
        return table

    # ------------------------------------------------------------- properties
    @property
    def shape(self):
        """``(num_rows, dim)``."""
        return self._shape

    @property
    def num_rows(self):
        return self._shape[0]

    @property
    def dim(self):
        return self._shape[1]

    @property
    def dtype(self):
        """The torch dtype of the rows."""
        return self._dtype

    @property
    def storage(self):
        """The storage kind asked for."""
        return self._kind

    @property
    def pinned(self):
        """Whether the rows really are in page-locked host memory (False once closed: none is held)."""
        return self._buffer is not None and self._buffer.pinned

    @property
    def backend(self):
        return self._backend

    @property
    def device(self):
        """The device :meth:`gather` returns tensors on."""
        return self._backend.device

    @property
    def moves_on_device(self) -> bool:
        """Whether :meth:`gather` runs on the device (a zero-copy kernel or a device table).

        Such a table takes ids on the device and needs no CPU work or staging
        copy; the others are gathered by the CPU.
        """
        return self._backend.ids_device(self._live_buffer()).type != "cpu"

    @property
    def path(self):
        """The backing file of an ``mmap`` table, else None."""
        return self._path

    @property
    def file_identity(self) -> Optional[tuple]:
        """Which file an ``mmap`` table maps, whatever its names: :func:`~speedswap.files.identity`, else None.

        For an owner that may replace the files it made, and must tell them from
        others put under their names since.
        """
        return self._file_id

    def renamed(self, path: PathLike) -> None:
        """Take ``path`` as the name of this ``mmap`` table's file, which its owner has just renamed there.

        For an owner that makes the file under a temporary name and renames it
        into place only once the rest of its work succeeded (new optimizer
        state tables replacing the old state's files). The map, and the
        descriptor that checks the file, hold the file whatever its names:
        they go on as they are.

        Args:
            path: the file's new name, where the caller renamed it (not checked).

        Raises:
            StateError: a closed table, or one that maps no file it made
                itself (memory, an adopted memmap).
        """
        buffer = self._live_buffer()
        if self._mapped is None:
            raise StateError(f"renamed() follows the file of an mmap table made by HostTable.empty or load; "
                             f"this table (storage={self.storage!r}) maps no such file")
        self._path = as_path(path)
        self._mapped.path = os.path.abspath(self._path)  # absolute, as made: a chdir must not change the file
        memmap = _memmap_under(buffer.host)
        if memmap is not None:
            memmap.filename = self._mapped.path  # as np.memmap(path) names it; the inode is the same

    @property
    def nbytes(self):
        """Bytes the rows occupy."""
        return self._shape[0] * self._shape[1] * self._dtype.itemsize

    @property
    def closed(self):
        return self._buffer is None

    @property
    def viewable(self) -> bool:
        """Whether :meth:`to_numpy` hands out the table's own memory (False: a read-only copy).

        False for a ``device`` table, on every backend (on a GPU numpy cannot view its rows).

        Raises:
            StateError: a closed table.
        """
        return self._live_buffer().host is not None

    @property
    def writable(self):
        """False for a table adopted from a read-only array (writes raise StateError)."""
        return self._writable

    def memory(self) -> dict:
        """Where this table's bytes are held.

        Returns:
            dict with ``host`` (RAM), ``device`` (GPU memory) and ``file``
            (an ``mmap`` table's file, paged in on demand) byte counts.
        """
        held = {"host": 0, "device": 0, "file": 0}
        buffer = self._buffer  # read once: another thread may close the table meanwhile
        if buffer is not None:
            where = ("file" if self.storage == "mmap"
                     else "device" if buffer.tensor.device.type != "cpu" else "host")
            held[where] = self.nbytes
        return held

    def __repr__(self):
        state = "closed" if self.closed else f"storage={self.storage!r}, backend={self._backend.name!r}"
        return f"HostTable({self.num_rows}, {self.dim}, dtype={self.dtype}, {state})"

    # -------------------------------------------------------------- transport
    def _open_buffer(self):
        if self._buffer is None:
            raise StateError("this HostTable is closed (close() released its rows, or the embedding or "
                             "switcher it belonged to was closed); load what was saved of it "
                             "(HostTable.load(path)) to read its rows again")
        return self._buffer

    def _live_buffer(self):
        if self._torn is not None:
            raise StateError(self._torn)
        return self._open_buffer()

    def _rows_buffer(self):
        """The buffer, to touch its rows: :meth:`_live_buffer` once the file passed :meth:`_check_file`."""
        buffer = self._live_buffer()
        self._check_file()
        return buffer

    def _check_file(self) -> None:
        """Refuse to touch the rows of an ``mmap`` table whose file was cut short or rewritten with another header.

        Every call that reads, writes, hands out or flushes the rows runs it
        first, once (:meth:`~speedswap.files.MappedFile.check`: one ``fstat``
        of the descriptor the table holds on its file while the file is
        unchanged): a page past the end of a truncated file would kill the
        process with SIGBUS, and a new header's rows lie elsewhere or are of
        another dtype. The descriptor reaches the mapped file whatever names
        it has: one renamed away and truncated through its new name (or a hard
        link) is refused too. A truncation between this check and the access
        can still crash. What the check lets through:

        * the file rewritten in place with the same header (``np.save`` of
          an array of its shape and dtype, another process's writes through
          its own map): the table is the file, and holds the new rows from
          then on (an embedding's device cache keeps its own until evicted).
        * the file removed, or replaced by a rename (``os.replace``, a
          save to the path from elsewhere): the map still holds the old
          file, whole, and the table goes on with it (the new file at the
          path is never read), but its path no longer names it, so its rows
          are lost once the table is closed unless another name reaches it.
          :meth:`flush` refuses then; :meth:`save` to the path writes the
          rows to a new file there.

        The mark a load puts on the file (:func:`loading_into`) moves no
        row: it is read through, and loads take their turns by its lock. An
        adopted memmap's file is checked for its length alone (what it holds
        is its caller's: it may be no ``.npy`` file); a table in memory has
        nothing to check.

        Raises:
            FileFormatError: the file is shorter than the table's rows, or
                its header now puts the rows elsewhere or makes them of
                another dtype or row length (or is no ``.npy`` header any more).
        """
        if self._mapped is not None:
            self._mapped.check("restore the file to go on (an embedding's close writes its cached rows back "
                               "only then), or build the table again from a checkpoint (HostTable.load, or "
                               "a new embedding's load)", marked=True)
        elif self._adopted_map is not None:
            mapping, end, name = self._adopted_map
            size = mapping.size()  # an fstat of the mapped file, through the mmap object's own descriptor
            if size < end:
                raise FileFormatError(f"{'the file' if name is None else repr(name)} is {size:,} bytes but the "
                                      f"memmap this table adopted reaches byte {end:,}: it was truncated after it "
                                      f"was mapped, and the map's rows past its end are gone (reading one would "
                                      f"kill the process with SIGBUS); restore the file, or map it again and "
                                      f"adopt the new map")

    def _writable_buffer(self, *, loading=False):
        """The buffer, to write; ``loading``: for a load, which a stopped one's refusal lets through."""
        buffer = self._open_buffer() if loading else self._rows_buffer()
        if not self._writable:
            raise StateError("this HostTable shares a read-only array (e.g. a file mapped with "
                             "mmap_mode='r'), so its rows cannot be written; map the file 'r+' "
                             "or copy the rows with HostTable.from_numpy")
        self._unwritten_file = False
        return buffer

    def watch_writes(self, before_write: Optional[Callable[[], None]]) -> None:
        """Have the owner's ``before_write()`` run before each write of the rows through this table's methods.

        For an owner that holds some of the rows elsewhere (an embedding's
        step in flight, its device cache): whoever writes, through whichever
        reference to the table, ``before_write`` puts those rows back first,
        or raises to refuse the write, before any row changes. The writes are
        :meth:`scatter`, :meth:`apply_`, the initialisers and :meth:`load_from`
        (after the file is verified); not :meth:`scatter_validated` (the
        owner's own path), nor writes into :meth:`to_numpy` or
        :meth:`as_tensor` views, which no method sees (the owner of a
        watched table can tell whether one is alive: :attr:`viewed`).

        Args:
            before_write: a method of the owner taking no arguments, held
                weakly (the owner holds the table), or None to stop watching.
        """
        self._before_write = None if before_write is None else weakref.WeakMethod(before_write)

    def watch_reads(self, before_read: Optional[Callable[[], None]]) -> None:
        """Have the owner's ``before_read()`` run before each read of the rows through this table's methods.

        For an owner whose device cache holds newer values of some rows:
        ``before_read`` writes them back first, so that whoever reads,
        through whichever reference to the table, sees every row's current
        value. The reads are :meth:`gather`, :meth:`to_numpy`,
        :meth:`as_tensor`, :meth:`host_chunks` (as the first chunk is read)
        and :meth:`save` (once the path passed its checks: a refused save,
        or checkpoint, does not call it); not
        :meth:`gather_validated` and :meth:`owner_copy` (the owner's own
        paths), nor later reads through a view :meth:`to_numpy` or
        :meth:`as_tensor` handed out: a watched table tracks those instead
        (:attr:`viewed`), for the owner to keep no newer rows elsewhere
        while one is alive. ``before_read`` may refuse the read by raising
        (a switcher from ``optimizer.step()`` until its after_step, whose rows
        are current only in the model): nothing has been read yet.

        Args:
            before_read: a method of the owner taking no arguments, held
                weakly (the owner holds the table), or None to stop watching.
        """
        self._before_read = None if before_read is None else weakref.WeakMethod(before_read)

    @property
    def viewed(self) -> bool:
        """Whether a view this table handed out may still be in use.

        True while an array or tensor that :meth:`to_numpy` (without
        ``copy``) or :meth:`as_tensor` returned, or anything made from it
        (a slice, ``torch.from_numpy``), is alive: reads and writes through
        it reach the host memory directly, so an owner (:meth:`watch_reads`)
        must keep every row's current value there, and, for a view of host
        memory, the table's writes (:meth:`scatter`, :meth:`scatter_validated`)
        have landed when they return, a GPU's kernels included. A table no
        owner watches follows its views too, except those of a file map
        (the CPU writes those rows, at once) and ``as_tensor(for_reading=True)``
        (a reader such as a feeder, whose gathers must not wait for it). A
        watched device table's tensor cannot be followed: once handed out it
        counts as alive for good (its reads run on a stream, after the
        writes, which need no wait for it).
        """
        return bool(self._views) or self._device_view

    @property
    def viewed_for_good(self) -> bool:
        """Whether :attr:`viewed` stays True for the table's life: a watched device table handed out its tensor."""
        return self._device_view

    @property
    def views_handed_out(self) -> int:
        """How many views this table has handed out so far that :attr:`viewed` follows.

        For an owner that keeps copies of rows elsewhere: a view handed out
        since it last looked may have written rows and be gone already, which
        :attr:`viewed` no longer tells.
        """
        return self._views_handed_out

    def _follows(self, host: np.ndarray, for_reading: bool = False) -> bool:
        """Whether a view of ``host`` handed out is one :attr:`viewed` follows (see there)."""
        return self._before_read is not None or not (for_reading or isinstance(host, np.memmap))

    def _handed_out(self, host: np.ndarray) -> np.ndarray:
        """``host``, as a view that :attr:`viewed` follows when :meth:`_follows` says so."""
        if not self._follows(host):
            return host  # a file map stays an np.memmap (a feeder reads its file by name)
        memory = _HandedOut(host)
        self._views.add(memory)
        self._views_handed_out += 1
        return np.asarray(memory)

    def _announce_write(self):
        """Run the :meth:`watch_writes` method: a public method is about to write rows."""
        _call_owner(self._before_write)

    def _announce_read(self):
        """Run the :meth:`watch_reads` method: a public method is about to read rows."""
        _call_owner(self._before_read)

    def as_tensor(self, *, for_reading: bool = False) -> torch.Tensor:
        """The rows as a torch tensor sharing the table's memory (no copy).

        For loops that move rows themselves (such as :class:`~speedswap.BatchFeeder`).
        The tensor is on the CPU for host storage kinds and on the GPU for
        ``device``; pending device writes are waited for first.

        A read-only table (:attr:`writable` is False) over a file mapped
        ``'r'`` (``np.load(path, mmap_mode="r")``) gives a copy-on-write map of
        the same file bytes instead, as numpy's ``mmap_mode="c"``: reading it
        is zero-copy, and a write through it changes only that tensor's
        private copy of the pages it touches, never the table or the file.
        torch has no read-only tensors, so such a write is not refused; over
        the read-only map itself it would kill the process with a
        segmentation fault. Write rows with :meth:`scatter`, which refuses a
        read-only table.

        Args:
            for_reading: the caller only reads the tensor (a feeder): a
                read-only table gives its own map, whatever became of its
                file since (a write through it would crash the process).

        Returns:
            torch.Tensor of shape :attr:`shape`.

        Raises:
            StateError: a closed table, or (unless ``for_reading``) a
                read-only table over a file that cannot be mapped again (a memmap made from a file object, or a
                file replaced since it was mapped): copy its rows with
                :meth:`from_numpy`.
            OptionError: ``for_reading`` is not a bool (``bool("False")`` is True:
                a read-only table would hand out its read-only map).
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped.

        Example:
            >>> import os, tempfile, numpy as np, speedswap as ss
            >>> path = os.path.join(tempfile.mkdtemp(), "vectors.npy")
            >>> np.save(path, np.ones((4, 3), np.float32))
            >>> rows = ss.HostTable.adopt(np.load(path, mmap_mode="r"), backend="numpy").as_tensor()
            >>> rows[0] = 5.0  # a private copy of the page: the file still holds ones
            >>> float(np.load(path)[0, 0]), float(rows[0, 0])
            (1.0, 5.0)
        """
        for_reading = bool_option(for_reading, "for_reading", hint=" (the caller only reads the tensor)")
        buffer = self._rows_buffer()
        self._announce_read()
        self._backend.wait_host(buffer)
        self._unwritten_file = False  # whoever holds the tensor may write through it
        memmap = None if buffer.host is None else _memmap_under(buffer.host)
        if for_reading or self._writable or memmap is None or memmap.mode != "r":
            # Memory the process may write (a read-only array over ordinary memory too).
            if buffer.host is None:
                if self._before_read is not None:
                    self._device_view = True  # see viewed
                return buffer.tensor
            if not self._follows(buffer.host, for_reading):
                return buffer.tensor
            return host_tensor(self._handed_out(buffer.host), self.dtype)
        private = _copy_on_write(buffer.host, memmap)
        if private is None:
            raise StateError("this read-only HostTable maps a file that cannot be mapped again "
                             "copy-on-write (a memmap made from a file object, or a file replaced "
                             "since it was mapped), and a tensor over its read-only map would crash "
                             "the process on a write; copy the rows with HostTable.from_numpy, or "
                             "read them with gather")
        return host_tensor(private, self.dtype)

    def gather(self, rows: Ids, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Copy rows to a tensor on :attr:`device`.

        Args:
            rows: integer ids of any shape (numpy, list, or tensor on the CPU
                or the backend's device); duplicates allowed.
            out: optional contiguous tensor of shape ``(*rows.shape, dim)``,
                the table's dtype, on :attr:`device`, to write into.

        Returns:
            torch.Tensor of shape ``(*rows.shape, dim)``. On a GPU the copy is
            ordered on torch's current stream and may still be running, unless
            a host view of the table is alive (:attr:`viewed`): then it has
            read the rows, so that a write through the view comes after it.

        Raises:
            IdError, DTypeError, DeviceError: bad ids (see :func:`~speedswap.convert.as_row_ids`).
            ShapeError, DTypeError, DeviceError: a bad ``out``.
            OptionError: ``out`` shares memory with the table or with ``rows``.
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped.
        """
        buffer = self._rows_buffer()
        flat, shape = as_row_ids(rows, self.num_rows, self.device,
                                 to=self._backend.ids_device(buffer), advice=ROWS_ADVICE)
        target_shape = (*shape, self.dim)
        if out is None:
            out = torch.empty(target_shape, dtype=self.dtype, device=self.device)
        else:
            self._check_out(out, target_shape)
            # A kernel writing rows it is still reading would fail or read its own output.
            for source, name in ((buffer.tensor, "the table's own rows"), (flat, "the ids")):
                if _overlaps(out, source):
                    raise OptionError(f"out shares memory with {name}, which gather reads while "
                                      f"it writes out; pass a separate tensor (e.g. torch.empty_like(out))")
        # After every check: the owner's cache writes its rows back only for a read that happens.
        self._announce_read()
        self._read(buffer, flat, out.view(len(flat), self.dim))
        return out

    def gather_validated(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`gather` for ids a public call has already validated: no checks of its arguments.

        The training layer's path (a second range check would be a second
        host synchronisation on a GPU).

        Args:
            rows: a contiguous 1-D int64 tensor of ids in ``[0, num_rows)``, on
                :attr:`device` or the CPU.
            out: a contiguous ``(len(rows), dim)`` tensor of the table's dtype on :attr:`device`.

        Returns:
            ``out``, as :meth:`gather`.

        Raises:
            FileFormatError: as :meth:`gather`, for an ``mmap`` table's file.
        """
        buffer = self._rows_buffer()
        self._read(buffer, rows.to(self._backend.ids_device(buffer)), out)
        return out

    def _read(self, buffer, rows, out):
        """Have the backend gather the rows; read on return while a host view is alive (:attr:`viewed`)."""
        self._backend.gather(buffer, rows, out)
        if self._views:
            # A GPU's kernel reads host memory when it runs, which may be after the call returns: a
            # write through the view meanwhile (between a forward and its step, say) would reach a
            # read the call made before it. Only while one lives, as for writes (_write).
            self._backend.wait_host(buffer)

    def _check_out(self, out, shape):
        if not isinstance(out, torch.Tensor):
            raise DTypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.is_nested or out.layout != torch.strided:  # before .shape and is_contiguous, which raise on them
            kind = "nested" if out.is_nested else str(out.layout).replace("torch.", "")
            raise DTypeError(f"out must be a dense tensor, got a {kind} "
                             f"one, and gather writes rows into out in place: pass a dense tensor "
                             f"such as torch.empty{tuple(shape)} of dtype {self.dtype}")
        if tuple(out.shape) != tuple(shape):
            raise ShapeError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
        if out.dtype != self.dtype:
            raise DTypeError(f"out has dtype {out.dtype}, the table holds {self.dtype}")
        if out.device != self.device:
            raise DeviceError(f"out is on {out.device}; gather writes to {self.device}")
        if not out.is_contiguous():
            raise ShapeError("out must be contiguous; pass a fresh tensor or out.contiguous()")
        if out.requires_grad:
            raise DTypeError("out requires grad, and gather writes into it in place; pass "
                             "out.detach() or a tensor made under torch.no_grad()")
        if out.is_inference() and not torch.is_inference_mode_enabled():
            raise DTypeError("out was made under torch.inference_mode(), and torch lets such a tensor "
                             "be written in place only there: gather under inference_mode too, or "
                             "pass a tensor made outside it")

    def scatter(self, rows: Ids, values: Rows, *, check_unique: bool = True) -> None:
        """Write ``values[i]`` into row ``rows[i]``.

        Args:
            rows: unique integer ids of any shape.
            values: tensor or array of shape ``(*rows.shape, dim)`` (or
                ``(len(rows), dim)``; one row ``(dim,)`` for a scalar id) with the
                table's dtype, on the CPU or the backend's device. A tensor that
                requires grad is read (detached), never kept in a graph.
            check_unique: refuse repeated ids (two writes to one row would make
                the result depend on write order). Pass False only when the ids
                are unique by construction: on a GPU the check costs a
                synchronisation.

        Raises:
            IdError, DTypeError, DeviceError, ShapeError: bad ids or values.
            DuplicateIdError: ``rows`` repeat an id.
            OptionError: ``check_unique`` is not a bool.
            StateError: a read-only table.
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped.

        Every check runs before any row is written. On a GPU the write is
        ordered on torch's current stream and may still be running on return,
        unless a host view of the table is alive (:attr:`viewed`): then it has
        landed, so that the view shows it.
        """
        # None or 0 would skip the check silently: only an explicit False does.
        check_unique = bool_option(check_unique, "check_unique", hint=" (refuse repeated ids)")
        buffer = self._writable_buffer()
        where = self._backend.ids_device(buffer)
        flat, ids_shape = as_row_ids(rows, self.num_rows, self.device, to=where, advice=ROWS_ADVICE)
        values = as_row_values(values, len(flat), self.dim, self.dtype, self.device, ids_shape,
                               to=where)
        if check_unique and _has_duplicates(flat):
            raise DuplicateIdError("scatter rows repeat an id, so the value kept would depend on "
                                   "write order; de-duplicate them first (torch.unique, or "
                                   "sum the rows' values with index_add_ if that is the intent)")
        if _overlaps(values, buffer.tensor):
            # Values read from the table itself (table.as_tensor()[a:b]): index_copy_, which the
            # cuda backend writes with, refuses a source it overwrites, and a kernel would read
            # rows it has already written. A copy is the values as they were when called.
            values = values.clone()
        self._announce_write()
        self._write(buffer, flat, values)

    def scatter_validated(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`scatter` for ids and values already validated: no checks of its arguments.

        On a GPU the write may still be running on return, as :meth:`scatter`'s,
        unless a host view this table handed out is alive (:attr:`viewed`): then it
        has landed, so that the view shows it.

        Args:
            rows: a contiguous 1-D int64 tensor of **unique** ids in ``[0, num_rows)``.
            values: a contiguous ``(len(rows), dim)`` tensor of the table's dtype
                on :attr:`device` or the CPU, not requiring grad.

        Raises:
            StateError: a closed or read-only table; nothing is written.
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped; nothing is written.
            torch.OutOfMemoryError, MemoryError: moving the ids or values
                where the table is written; nothing is written.
        """
        self.prepare_scatter(rows, values)()

    def prepare_scatter(self, rows: torch.Tensor, values: torch.Tensor) -> Callable[[], None]:
        """Everything of :meth:`scatter_validated` that may fail, now; the write itself, returned.

        For an owner that writes several tables as one (a step's rows and
        their optimizer state): it prepares every table's write, then runs
        them, so that a failure (out of memory moving the ids or values where
        a table is written: device memory, or host memory for the cuda
        backend's staged tables) leaves every table as it was. The returned
        call only copies and writes.

        Args:
            rows, values: as for :meth:`scatter_validated`. ``values`` are read
                when the returned call runs, not before: they may be filled in between.

        Returns:
            the write, to call once.

        Raises:
            As :meth:`scatter_validated`, and nothing is written.
        """
        buffer = self._writable_buffer()
        where = self._backend.ids_device(buffer)
        rows = rows.to(where)
        staged = values
        if values.device.type != where.type or where.index not in (None, values.device.index):
            staged = torch.empty(values.shape, dtype=values.dtype, device=where)  # filled by the write

        def write():
            if staged is not values:
                staged.copy_(values)
            self._write(buffer, rows, staged)
        return write

    def _write(self, buffer, rows, values):
        """Have the backend write the rows; landed on return while a host view is alive (:attr:`viewed`)."""
        self._backend.scatter(buffer, rows, values)
        if self._views:
            # Reads and writes through a numpy view wait for no kernel: a read right after a write (an
            # owner's write-back of a step) would show the rows as before, and the kernel would land
            # over a write made through the view meanwhile. Only while one lives: steps pay no wait.
            # A device table's tensor (as_tensor) is read on a stream, after the write: no wait.
            self._backend.wait_host(buffer)

    # ------------------------------------------------------------ initialisers
    def _row_chunks(self, writing=True, values_multiple=1):
        """Row-range views of the table, about 64 MiB each.

        Args:
            writing: the views are written (announced as a write) or only read.
            values_multiple: every chunk but the last holds a multiple of this
                many values, and the last at least this many (or is the whole table).
        """
        tensor = (self._writable_buffer() if writing else self._rows_buffer()).tensor
        if writing:
            self._announce_write()
        else:
            self._announce_read()
        self._backend.wait_host(self._buffer)
        ranges = files.row_ranges(self._shape, numpy_dtype(self.dtype))
        if values_multiple > 1 and len(ranges) > 1:
            ranges = _aligned(ranges, self._shape[1], values_multiple)
        for start, stop in ranges:
            yield start, stop, tensor[start:stop]

    def _fill_from(self, source):
        """Copy ``source(start, stop)`` (numpy rows of the table's dtype, in either byte order) into the
        table, chunk by chunk."""
        host = self._buffer.host
        for start, stop, chunk in self._row_chunks():
            rows = source(start, stop)
            if host is not None:
                # numpy reads read-only inputs (np.load(mmap_mode="r")) without torch's warning;
                # "equiv" casts nothing but the byte order.
                np.copyto(host[start:stop], rows, casting="equiv")
            else:
                # One chunk-sized host copy, in the native byte order torch views; bfloat16's
                # 16-bit patterns are viewed as bfloat16, not converted by value.
                native = torch.from_numpy(np.array(rows, dtype=rows.dtype.newbyteorder("=")))
                chunk.copy_(native.view(chunk.dtype))

    def zero_(self) -> "HostTable":
        """Set every row to zero, chunk by chunk. Returns self.

        A new ``mmap`` table (:meth:`empty`) that nothing has written into yet
        reads as zeros from its file's holes: it is left as it is, so that the
        file stays sparse on disk (writing the zeros would make it dense and
        dirty every page, whose write-back the first training steps would
        wait for). Its checks and the :meth:`watch_writes` method run all the same.
        """
        unwritten = self._unwritten_file
        for _, _, chunk in self._row_chunks():
            if not unwritten:
                chunk.zero_()
        self._unwritten_file = unwritten  # _row_chunks took the buffer to write, and wrote nothing
        return self

    def uniform_(self, low: float = 0.0, high: float = 1.0, *,
                 generator: Optional[torch.Generator] = None) -> "HostTable":
        """Fill with U(low, high) in place, chunk by chunk (no full-size temporary).

        Args:
            low, high: the bounds.
            generator: a ``torch.Generator`` for reproducible fills, on any
                device: one on another device than the rows (a CPU generator
                for a ``device`` table) draws each chunk there and copies it
                in, so one seed fills every storage kind alike.

        Returns:
            self

        Raises:
            DTypeError: a bound is not a real number, or ``generator`` is not
                a ``torch.Generator``.
            OptionError: a bound is NaN or infinite, ``low > high``, or the
                bounds or their distance exceed the table dtype's largest value.
        """
        low, high = float_option(low, "low"), float_option(high, "high")
        if low > high:
            raise OptionError(f"uniform_ needs low <= high, got low={low!r} > high={high!r}; "
                              f"swap them")
        if self.dtype.is_floating_point:  # an integer table is refused in _fill_random
            largest = torch.finfo(self.dtype).max
            # torch refuses these itself, with an error that names no argument
            if max(-low, high, high - low) > largest:
                raise OptionError(f"uniform_({low!r}, {high!r}) on a {self.dtype} table: the bounds "
                                  f"and high - low must be at most {largest:g}, the largest "
                                  f"{self.dtype} value; narrow them")
        return self._fill_random("uniform_", lambda tensor: tensor.uniform_(low, high, generator=generator),
                                 generator)

    def normal_(self, mean: float = 0.0, std: float = 1.0, *,
                generator: Optional[torch.Generator] = None) -> "HostTable":
        """Fill with N(mean, std²) in place, chunk by chunk. Returns self.

        The chunks draw what one ``normal_`` call on the whole table draws:
        after ``torch.manual_seed(s)`` a table holds the rows an
        ``nn.Embedding`` of its shape would, on the CPU.

        Args:
            mean, std: the distribution's parameters.
            generator: a ``torch.Generator`` for reproducible fills, on any
                device, as for :meth:`uniform_`.

        Raises:
            DTypeError: ``mean`` or ``std`` is not a real number, or
                ``generator`` is not a ``torch.Generator``.
            OptionError: NaN or infinite, or ``std < 0``.
        """
        mean, std = float_option(mean, "mean"), float_option(std, "std")
        if std < 0:
            raise OptionError(f"normal_ needs std >= 0, got std={std!r}")
        return self._fill_random("normal_", lambda tensor: tensor.normal_(mean, std, generator=generator),
                                 generator)

    def _fill_random(self, name, fill, generator):
        """Apply the in-place random ``fill`` to each chunk of rows; returns self.

        torch draws only with a generator on the tensor's own device. With a
        generator elsewhere (a CPU one for a ``device`` table) each chunk is
        drawn there and copied in, so one seeded CPU generator fills every
        storage kind with the same values.

        Raises:
            DTypeError: an integer table (torch draws these only as floats), or
                ``generator`` is not a ``torch.Generator``.
        """
        if not self.dtype.is_floating_point:
            raise DTypeError(f"{name} draws floating-point values and this table holds {self.dtype}; "
                             f"fill integer rows with apply_(torch.Tensor.random_, low, high) or "
                             f"from a numpy array")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise DTypeError(f"{name}'s generator must be a torch.Generator, got "
                             f"{type(generator).__name__}; pass torch.Generator().manual_seed(seed)")
        # torch's CPU normal_ draws float32 values 16 at a time and draws the last 16 of a tensor
        # again when its size is not a multiple of 16: chunks of a multiple of 16 values, the
        # last one at least 16, draw what one call on the whole table draws, so a seeded table
        # starts as nn.Embedding's does at any size and row length.
        for _, _, chunk in self._row_chunks(values_multiple=16):
            if generator is None or generator.device == chunk.device:
                fill(chunk)
            else:
                chunk.copy_(fill(torch.empty(chunk.shape, dtype=chunk.dtype, device=generator.device)))
        return self

    def apply_(self, fn: Callable[..., object], *args, **kwargs) -> "HostTable":
        """Call an in-place initialiser such as ``torch.nn.init.xavier_uniform_`` on the table.

        ``fn`` receives one tensor viewing the whole table (no copy), so
        initialisers that read the shape (fan-in/fan-out) see the true one.
        ``fn`` must work in place, as every ``torch.nn.init`` function does.
        It writes the table directly: keeping a full-size copy to undo it
        would double the table's memory, so whatever ``fn`` wrote before it
        raised (or before it returned a new tensor) stays in the table.

        Args:
            fn: ``fn(tensor, *args, **kwargs)``.

        Returns:
            self

        Raises:
            OptionError: ``fn`` is not callable (nothing changes), or returned
                a tensor outside the table's memory: it did not work in place,
                and its result would be lost (the table holds what ``fn``
                wrote into it in place, if anything).
            Exception: whatever ``fn`` raised, as it raised it; the rows it
                wrote before raising stay written.
        """
        initialiser_option(fn, "fn")
        tensor = self._writable_buffer().tensor
        self._announce_write()
        self._backend.wait_host(self._buffer)
        with torch.no_grad():
            result = fn(tensor, *args, **kwargs)
        # A view of the table (fn filled a slice in place) returns its own, later, address.
        if isinstance(result, torch.Tensor) and (
                result.device != tensor.device
                or result.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()):
            raise OptionError(f"apply_ needs fn to fill the tensor it is given in place, but "
                              f"{getattr(fn, '__name__', fn)!r} returned a new one, whose values are "
                              f"not in the table (what it wrote into the given tensor in place, if "
                              f"anything, is); use an in-place function (a name ending in '_', "
                              f"as torch.nn.init's), or lambda t: t.copy_(...)")
        return self

    # ----------------------------------------------------------------- files
    def host_chunks(self) -> Iterator[np.ndarray]:
        """The rows as read-only numpy arrays of about 64 MiB each, in order, as files store them.

        Host tables yield views of their own memory; a device table yields one
        chunk-sized host copy at a time, so no full-size copy is ever made. A
        bfloat16 table yields float32 chunks (exact; numpy has no bfloat16).
        Every chunk is read-only, on every backend: a write into a copy could
        not reach the table, and one into a view would go past the owner's
        :meth:`watch_writes` method and :attr:`viewed` (a device cache's
        rows would win over it), so both raise numpy's ValueError; write
        with :meth:`apply_` or :meth:`scatter`.
        The :meth:`watch_reads` method runs as the first chunk is taken, not
        at the call: a writer checks its path first, and a refused write
        leaves an owner's cache as it was.

        Yields:
            numpy.ndarray chunks of consecutive rows.
        """
        for _, _, chunk in self._row_chunks(writing=False):
            if self.dtype is not torch.bfloat16 and self.viewable:
                view = chunk.numpy()  # a new array over the memory: the table's own stays writable
                view.flags.writeable = False
                yield view
                continue
            # copy=True: a CPU backend's device memory is the process's own, and .cpu() would return it.
            rows = chunk.float().cpu() if self.dtype is torch.bfloat16 else chunk.to("cpu", copy=True)
            array = rows.numpy()
            array.flags.writeable = False
            yield array

    def save(self, path: PathLike, dataset: str = "table") -> None:
        """Write the table to ``path`` (``.npy`` or ``.h5``) atomically.

        The file is written beside ``path`` under a temporary name, flushed,
        and renamed over ``path`` only when complete: a failure midway leaves
        any previous file intact. A device table is copied out chunk by chunk;
        a bfloat16 table is written as float32 (see :func:`~speedswap.files.save_table`),
        except to an ``mmap`` table's own file, which is flushed as it is: it
        holds the bit patterns as uint16 (reopen it with
        ``HostTable.load(path, mmap=True, dtype="bfloat16")``). An HDF5 file
        also records the CRC-32 of the rows, which every load verifies.

        Args:
            path: ``*.npy``, ``*.h5`` or ``*.hdf5``.
            dataset: the HDF5 dataset name.

        Raises:
            OptionError: another suffix, or (HDF5) a ``dataset`` that names no
                dataset; nothing is written.
            PathError: the directory does not exist, (HDF5) the file holds
                other datasets, which the save (of the whole file) would
                delete, or it changed while the save checked it (another save
                to it at the same time); nothing is written, and the
                :meth:`watch_reads` method was not called.
            StateError: a closed table (its rows are gone).
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped; nothing is written.
        """
        self._live_buffer()
        files.file_format(path)
        # The watch_reads method runs once the path passed every check: here, or when the writer
        # first reads the rows (host_chunks). A refused save leaves an owner's cache as it was.
        if self.is_backing_file(path):
            self._announce_read()
            self.flush()
            return
        files.save_table(self, path, dataset)

    def is_backing_file(self, path: PathLike) -> bool:
        """Whether ``path`` is the ``.npy`` file this ``mmap`` table maps, whole: a save there is a flush.

        Args:
            path: any path (the file's identity decides, not its spelling).

        Returns:
            bool

        Raises:
            PathError: ``path`` is the file this table maps, but the table
                maps only part of it or reads it as another dtype: a save
                there would replace the file under the map, and the file
                would no longer hold the whole dataset.
            StateError: a closed table.
        """
        buffer = self._live_buffer()
        if self.storage != "mmap" or self._file_id is None or _file_id(path) != self._file_id:
            return False
        if not _maps_whole_file(buffer.host, path):
            raise PathError(f"{os.fspath(path)!r} is the file this table maps, but the table holds only "
                            f"part of it (or reads it as another dtype); saving over it would replace "
                            f"the file it maps: save to another path")
        return True

    def load_from(self, path: PathLike, dataset: str = "table") -> "HostTable":
        """Replace this table's rows with a file's, which must match shape and dtype.

        Args:
            path: a ``.npy`` or HDF5 (``.h5``, ``.hdf5``) file.
            dataset: the HDF5 dataset holding the rows.

        Returns:
            self

        Raises:
            FileFormatError: the file is malformed, corrupt, or another
                shape/dtype; the table is left unchanged (the file is read and
                verified completely before any row changes), or this ``mmap``
                table's own file was truncated or rewritten with another
                header since it was mapped.
            OptionError: another suffix, or (HDF5) a ``dataset`` that names
                no dataset.
            StateError: a closed or read-only table.
        """
        self._writable_buffer(loading=True)
        header = files.read_table_header(path, dataset)
        files.check_table_matches(header, self._shape, self.dtype, path)
        # Every row is read and verified before the first one changes.
        staged = files.stage_table(path, header, dataset, self.dtype, available_ram())
        self._announce_write()
        with loading_into([self], path):
            staged.commit(self)
        return self

    def load_target(self) -> torch.Tensor:
        """The table's own memory, for a load to write every row into: not a view handed out.

        For :func:`~speedswap.files.read_table`,
        :meth:`~speedswap.files.StagedRows.commit` and a switcher's
        ``loadTorch``, which write the rows and keep no reference to it. :attr:`viewed` does not follow it: a device
        table's :meth:`as_tensor` counts as alive for good, and an owner's
        cache would keep no rows after every load. The caller has run the
        :meth:`watch_writes` method (or the table is new), so nothing is
        announced here; a load that stops midway is :func:`loading_into`'s.

        Returns:
            torch.Tensor of shape :attr:`shape` over the table's memory, on the
            CPU for host storage kinds and on the GPU for ``device``.

        Raises:
            StateError: a closed or read-only table.
        """
        buffer = self._writable_buffer(loading=True)
        self._backend.wait_host(buffer)
        return buffer.tensor

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """The rows as a numpy array.

        Args:
            copy: return an independent copy. When False, a host table returns
                its own memory (writes go through; the memory stays alive as
                long as the array does), a device table a read-only host copy,
                on every backend (a write into it, which could not reach the table, raises
                numpy's ValueError; write with :meth:`scatter` or through
                :meth:`as_tensor`, the GPU's memory itself).
                The view of a table an embedding owns stays current while
                it lives: :attr:`viewed` tells the owner, whose device cache
                then keeps no rows. It shows a step's rows once the owner
                writes them back: an OffloadedEmbedding inside
                ``optimizer.step()``, the switchers at the ModelFactory's
                ``after_step`` (as before the step until then).

        Returns:
            numpy.ndarray of shape :attr:`shape`; a bfloat16 table's rows as
            their ``uint16`` bit patterns (numpy has no bfloat16).

        Raises:
            OptionError: ``copy`` is not a bool (``bool("False")`` is True: writes
                meant for the table would go to a copy).
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped.
        """
        copy = bool_option(copy, "copy", hint=" (an independent copy; False: the table's own memory)")
        buffer = self._rows_buffer()
        self._announce_read()
        if copy:
            return self.owner_copy()
        if buffer.host is None:
            # No host memory to hand out. A writable copy would take writes meant for the table and
            # drop them unseen (a host table's to_numpy() takes them: code moves between the two).
            array = self.owner_copy()
            array.flags.writeable = False
            return array
        self._backend.wait_host(buffer)
        self._unwritten_file = False  # whoever holds the view may write through it
        return self._handed_out(buffer.host)

    def owner_copy(self) -> np.ndarray:
        """:meth:`to_numpy` with ``copy=True`` for the owner's own read: the :meth:`watch_reads` method is not called.

        For an owner that reads the table where its own method would refuse
        (a switcher's copy from ``optimizer.step()`` until its after_step,
        which it completes with the step's rows itself).

        Returns:
            numpy.ndarray of shape :attr:`shape`, as :meth:`to_numpy`.

        Raises:
            StateError: a closed table.
        """
        buffer = self._rows_buffer()
        self._backend.wait_host(buffer)
        if buffer.host is not None:
            return np.array(buffer.host, copy=True)
        # copy=True: on the CPU backend the device memory is the process's own, and .cpu() returns it.
        return numpy_view(buffer.tensor.to("cpu", copy=True))

    def flush(self) -> None:
        """Wait for pending device writes; an ``mmap`` table also flushes its file.

        Raises:
            StateError: a closed table, or one a stopped load left refusing use.
            FileFormatError: an ``mmap`` table's file was truncated or rewritten
                with another header since it was mapped (see the class docstring).
            PathError: an ``mmap`` table's path no longer names the file it
                maps (removed, or replaced by a rename): the rows would be
                flushed into a file nobody can open, and go when the table is
                closed; nothing is flushed. Save them with :meth:`save`.
        """
        buffer = self._rows_buffer()
        if self._mapped is not None and _file_id(self._mapped.path) != self._file_id:
            raise PathError(f"{os.fspath(self._path)!r} no longer names the file this table maps (it was "
                            f"removed, or replaced by a rename, since the table mapped it): the table's "
                            f"rows are in that file, which no path reaches, and go when the table is "
                            f"closed. Save them with table.save(path) (a new file), then build the table "
                            f"again from it")
        self._sync(buffer)

    def _sync(self, buffer) -> None:
        """Wait for pending device writes to ``buffer``; an ``mmap`` table's file is flushed too."""
        self._backend.wait_host(buffer)
        if self.storage == "mmap":
            _memmap_under(buffer.host).flush()  # an adopted plain view of a memmap has no flush() of its own

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Release the table's memory (flushing an ``mmap`` file first). Idempotent."""
        if self._buffer is None:
            return
        self._torn = None  # its rows go, whatever they hold
        # No checks: a file truncated or replaced since is refused by every use, not by its release.
        self._sync(self._buffer)
        self._buffer = None
        self._adopted_map = None  # the map goes with the buffer, not with the table
        if self._mapped is not None:
            self._mapped.close()  # after the buffer: no call passes _live_buffer to check through it closed
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def loading_into(tables: Iterable[HostTable], path) -> Iterator[None]:
    """Bracket the writes of a verified load into ``tables``, which must hold its rows all or none.

    A load that stops once its writes have begun (Ctrl-C, out of memory, a
    chunk read again that differs from the one verified) leaves some rows
    loaded and others not. Every one of ``tables`` then refuses use, reads
    included, with a :class:`~speedswap.StateError` that says so, until a
    load into it completes (or it is closed): training on would mix two
    states. The exception goes on, with a note saying the same. The file of
    an ``mmap`` table says so too, for the processes that open it later:
    it is marked before the first write and unmarked once every row is
    written and flushed to disk (:func:`~speedswap.files.mark_npy_torn`),
    unless the load reads that very file (it writes back the rows it holds).
    Meanwhile the load holds the file's turn
    (:func:`~speedswap.atomic.rewriting_in_place`): a load into the same file
    from another process or thread waits for it.

    Args:
        tables: every table the load writes; a refusal left by an earlier
            stopped load is lifted for the writes.
        path: the file or checkpoint read (``"state_dict"`` for a state dict's tensors), for the messages.

    Raises:
        PathError: a table's file cannot be marked (nothing was written; a
            note names any mark that could not be lifted again).
    """
    tables = list(tables)
    # A load from a table's own file writes back the rows it holds: stopped, it leaves them
    # whole, and a mark would change the file the load reads again (a file too large to stage).
    reading = _file_id(path)
    for table in tables:
        table._check_file()  # before any file is marked or row written
    # Each file once, however many tables map it, and in one order for every load: two loads
    # into the same files take their turns without each holding one the other waits for.
    to_mark = {}
    for table in tables:
        if table.storage == "mmap" and table._path is not None and table._file_id not in (None, reading):
            to_mark.setdefault(table._file_id, table._path)
    with contextlib.ExitStack() as turns:
        marked = {}  # identity -> (path, descriptor) of the files that say "torn" until the writes are done
        newly_marked = []  # those this load marks: one an earlier stopped load marked stays marked
        try:
            for identity in sorted(to_mark):
                file_path = to_mark[identity]
                fd = turns.enter_context(rewriting_in_place(file_path, identity))
                was_marked = None if fd is None else files.is_npy_torn(fd, file_path)
                if was_marked is None:
                    continue
                marked[identity] = (file_path, fd)
                if not was_marked:
                    newly_marked.append((file_path, fd))  # before its write: one stopped midway is undone too
                    files.mark_npy_torn(fd, file_path, True)
        except BaseException as exc:
            _lift_marks(newly_marked, exc)  # nothing was written yet
            raise
        for table in tables:
            table._torn = None
        try:
            yield
            # Inside the try: stopped here, the files still say "torn", and so must the tables.
            for table in tables:
                if table._file_id in marked:
                    table.flush()  # the rows on disk before the mark that says they are whole
            for file_path, fd in marked.values():
                files.mark_npy_torn(fd, file_path, False)
        except BaseException as exc:
            which = f"this table and {len(tables) - 1} more" if len(tables) > 1 else "this table"
            why = (f"a load from {os.fspath(path)!r} stopped ({type(exc).__name__}) while it wrote "
                   f"{which}: the rows may be part the load's, part what was there before; load a "
                   f"checkpoint again (all of it) before using them, or close them")
            for table in tables:
                table._torn = why
            if hasattr(exc, "add_note"):  # Python 3.11+
                exc.add_note(f"speedswap: {why}.")
            raise


def _lift_marks(marks, stopped: BaseException) -> None:
    """Lift the torn marks ``marks`` (path, descriptor) that a load made before ``stopped`` stopped it.

    Every one is tried, and ``stopped`` stays the error the user sees: a mark
    that cannot be lifted (an I/O error) is a note on it (Python 3.11+).
    """
    for file_path, fd in marks:
        try:
            files.mark_npy_torn(fd, file_path, False)
        except Exception as failed:
            if hasattr(stopped, "add_note"):
                stopped.add_note(f"speedswap: {os.fspath(file_path)!r} was marked for the load, and the mark "
                                 f"could not be lifted again ({failed}): its rows are whole, but it is refused "
                                 f"as a file a load stopped in until a load into it completes; load into it "
                                 f"again")
