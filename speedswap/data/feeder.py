"""BatchFeeder: whole batches of rows from arrays, memory-mapped files or DataGadgets, on the device.

One index array per epoch (see :mod:`speedswap.data.orders`), one gather per
source per batch: no per-row ``__getitem__``, no collate step.

>>> import numpy as np, speedswap as ss
>>> x = np.random.default_rng(0).standard_normal((10, 3)).astype(np.float32)
>>> y = np.arange(10)
>>> feeder = ss.BatchFeeder(x, y, batch_size=4, order="sequential", device="cpu")
>>> [tuple(labels.tolist()) for _, labels in feeder]
[(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
"""

import inspect
import math
import os
import threading
from typing import Callable, Optional, Union

import numpy as np
import torch

from ..backends import available_ram, get_backend, resolve_device
from ..backends.resolve import BackendLike, DeviceLike
from ..convert import as_host_array, bool_option, check_has_values, check_rows, int_option
from ..errors import (DeviceError, DTypeError, OptionError, OutOfMemoryError, ShapeError, StateError,
                      ThreadStartError, warn)
from ..table import HostTable
from .create import native_copy_advice
from .filesource import FileRows, RowReader, WindowReader, window_rows
from .gadget import DataGadget
from .orders import Order, earlier_streams, epoch_share, make_order
from .readahead import CudaStager, LaunchAhead, ReaderThread, SyncReader, in_background

__all__ = ["BatchFeeder", "Source"]

#: What a feeder reads rows from: a numpy array (an ``np.memmap`` of a ``.npy`` file too), a tensor,
#: a :class:`~speedswap.DataGadget` or a :class:`~speedswap.HostTable` (see :class:`BatchFeeder`).
Source = Union[np.ndarray, torch.Tensor, DataGadget, HostTable]

_STATE_KEYS = ("epoch", "batch", "seed", "num_rows", "batch_size", "drop_last", "rank",
               "world_size", "order", "shard")


def _table_of(source):
    """The HostTable behind a DataGadget or HostTable source, else None."""
    if isinstance(source, DataGadget):
        return source.table
    return source if isinstance(source, HostTable) else None


def _warn_copied(what):
    # Sources are promised to be read in place, so a copy must not go unnoticed: changes made
    # to the source later (between loops) are not seen by the feeder.
    warn(f"{what} is not contiguous in memory (a column slice, a transposed or reversed view), so "
         f"the feeder copies it once, now, and reads the copy: later changes to the source are not "
         f"seen, and a memory-mapped one is read into RAM whole; pass np.ascontiguousarray(x) or "
         f"x.contiguous() to make the copy yourself and change that one")


#: Unsigned sources speedswap has no tables for, read as the signed type of their width
#: (the same bits) and widened on the device: (numpy view, torch view, batch dtype, mask).
_WIDENED = {
    np.dtype(np.uint16): (np.int16, torch.int16, torch.int32, 0xFFFF),
    np.dtype(np.uint32): (np.int32, torch.int32, torch.int64, 0xFFFFFFFF),
}
_TORCH_UNSIGNED = {torch.uint16: np.dtype(np.uint16), torch.uint32: np.dtype(np.uint32)}


def _as_signed(source):
    """``(source, widen)``: uint16/uint32 data viewed as int16/int32 (no copy), and how to widen batches.

    Token ids are often stored as uint16; the rows cross (and are read from a
    file) at that width, and each batch becomes int32 (int64 for uint32)
    with its values unchanged. ``widen`` is ``(dtype, mask)``, or None for
    data that needs none.
    """
    dtype = _TORCH_UNSIGNED.get(source.dtype) if isinstance(source, torch.Tensor) else (
        source.dtype if isinstance(source, np.ndarray) else None)
    if dtype not in _WIDENED:
        return source, None
    as_numpy, as_torch, wider, mask = _WIDENED[dtype]
    view = source.view(as_torch) if isinstance(source, torch.Tensor) else source.view(as_numpy)
    return view, (wider, mask)


def _widened(tensor, widen):
    """A batch of unsigned data read as signed (see :func:`_as_signed`), back to its values."""
    if widen is None:
        return tensor
    wider, mask = widen
    return tensor.to(wider).bitwise_and_(mask)


def _rows_of(source):
    """A source's number of rows from its shape, nothing read; None where the conversion must judge it.

    None for a 0-d source, a nested tensor (which has no sizes) or a type
    that is no source: :func:`_as_tensor` refuses them with their own error.
    """
    if isinstance(source, torch.Tensor) and source.is_nested:
        return None
    if isinstance(source, (np.ndarray, torch.Tensor, DataGadget, HostTable)) and len(source.shape):
        return source.shape[0]
    return None


def _checked(source, what):
    """``(source, row_bytes)``: a source accepted, and its bytes per row; nothing read, copied or opened.

    Arrays and CPU tensors come back as a numpy array sharing their memory
    (a CPU bfloat16 tensor's as its int16 bits); DataGadgets, HostTables and
    device tensors as they are. A DataGadget's rows are read only when the
    feeder takes them (:func:`_as_tensor`), after every argument was checked.

    Raises:
        DTypeError: a source of an unsupported type or dtype, or a path.
        DeviceError: a tensor on the meta device (no values).
        ShapeError: a 0-d source, or one without rows.
        StateError: a closed DataGadget or HostTable.
        OutOfMemoryError: a host source that is not contiguous, whose copy
            would not fit in RAM (see :func:`_check_copy_fits`).
    """
    if isinstance(source, (DataGadget, HostTable)):
        if source.closed:
            raise StateError(f"{what} is closed, its rows are gone; build a new "
                             f"{type(source).__name__} over the data and a feeder over that")
        return source, _row_bytes(source.shape, source.dtype.itemsize)
    if isinstance(source, torch.Tensor) and source.device.type != "cpu":
        check_has_values(source, what)  # a meta tensor too: it has a device but no rows
        check_rows(source.shape, what)
        return source, _row_bytes(source.shape, source.dtype.itemsize)
    if isinstance(source, (str, os.PathLike)):
        raise DTypeError(f"{what} is a path ({os.fspath(source)!r}); sources are arrays: pass "
                         f"ss.DataGadget(path) or np.load(path, mmap_mode='r')")
    if not isinstance(source, (np.ndarray, torch.Tensor)):
        raise DTypeError(f"{what} is a {type(source).__name__}; sources must be numpy arrays, "
                         f"memmaps, torch tensors, DataGadgets or HostTables{_instead_of(source)}")
    if isinstance(source, np.memmap) and source.dtype.fields is None and not source.dtype.isnative:
        # as_host_array's advice, a.astype(...), would read a file larger than the RAM into it whole.
        raise DTypeError(f"{what} maps a file of {source.dtype.newbyteorder('=')} in the other byte order "
                         f"({source.dtype.str!r}, big-endian), which torch cannot read in place; "
                         f"{native_copy_advice(source.dtype)}")
    # numpy has no bfloat16: its bits are held as int16 and the tensor views them back.
    bfloat16 = isinstance(source, torch.Tensor) and source.dtype == torch.bfloat16
    array = as_host_array(source.view(torch.int16) if bfloat16 else source, what)
    if not array.flags.c_contiguous:
        _check_copy_fits(array, what)
    return array, _row_bytes(array.shape, array.itemsize)


def _instead_of(source) -> str:
    """What to pass in place of a source that is no array, for what DataLoader users reach for; else ''."""
    if isinstance(source, torch.utils.data.DataLoader):
        return ("; the feeder takes the DataLoader's place: pass the arrays its dataset holds, as "
                "ss.BatchFeeder(*loader.dataset.tensors, batch_size=...) for a TensorDataset")
    if isinstance(source, torch.utils.data.Dataset):
        # A Dataset's rows come one __getitem__ at a time, the per-row cost the feeder exists to avoid.
        return ("; the feeder gathers each batch from arrays in one index, with no per-row __getitem__: "
                "pass the arrays the dataset holds, as ss.BatchFeeder(*dataset.tensors, batch_size=...) "
                "for a TensorDataset")
    if isinstance(source, (list, tuple)):
        return ("; convert it with np.asarray(...), or pass the arrays it holds as sources of their own: "
                "ss.BatchFeeder(x, y, batch_size=...)")
    return ""


def _check_copy_fits(array, what):
    """Refuse to copy a source that is not contiguous when the copy would not fit in RAM.

    Such a source is copied into RAM whole (see :func:`_as_tensor`); a column
    slice of a file larger than RAM would run the process out of memory. The
    bound is DataGadget's: a file is mapped rather than read past 3/4 of the
    RAM available.

    Raises:
        OutOfMemoryError: the copy would take more than 3/4 of the RAM available.
    """
    room = available_ram() * 3 // 4
    if array.nbytes > room:
        raise OutOfMemoryError(
            f"{what} is not contiguous in memory (a column slice, a transposed or Fortran-order "
            f"array), so the feeder would copy it into RAM: {array.nbytes:,} bytes, more than 3/4 of "
            f"the RAM available ({room:,} bytes); write a contiguous copy to disk and feed that: "
            f"ss.data.create_npy(path, x.shape, x.dtype, lambda lo, hi: x[lo:hi]), then "
            f"np.load(path, mmap_mode='r')")


def _row_bytes(shape, itemsize):
    """Bytes in a row of data shaped ``shape`` of ``itemsize``-byte values (Python ints: no int64 wrap)."""
    return math.prod(int(d) for d in shape[1:]) * itemsize


def _as_tensor(source, checked, what):
    """``(tensor, file)``: a source's rows as a tensor, and the file it maps (or None).

    The tensor shares the source's memory unless the source is not
    contiguous; then it is a copy, made here with a warning. uint16 and
    uint32 sources come as int16 and int32 tensors of the same bits (see
    :func:`_as_signed`).

    Args:
        source: the source, after :func:`_as_signed`.
        checked: what :func:`_checked` made of it.
        what: how the source is named in messages.
    """
    if isinstance(checked, (DataGadget, HostTable)):
        table = _table_of(checked)
        tensor = table.as_tensor(for_reading=True).view(checked.shape)
        mapped = table.storage == "mmap"  # on any backend its rows are the file's, in host memory
        return tensor, FileRows.of(table.to_numpy(), tensor) if mapped else None
    if isinstance(checked, torch.Tensor):  # on a device
        if not checked.is_contiguous():  # rows are gathered with one index_select over contiguous rows
            _warn_copied(what)
        return checked.detach().contiguous(), None
    array = checked
    flat = array.reshape(len(array), -1)  # a view that stays a memmap when the source is one
    if not array.flags.c_contiguous:  # rows must be contiguous to be gathered: one copy
        _warn_copied(what)
        flat = np.ascontiguousarray(flat)
    # Shares the array's memory; a memmap stays on disk and is paged in as rows are read.
    table = HostTable.adopt(flat, backend="numpy")
    tensor = table.as_tensor(for_reading=True).view(array.shape)
    bfloat16 = isinstance(source, torch.Tensor) and source.dtype == torch.bfloat16
    return (tensor.view(torch.bfloat16) if bfloat16 else tensor), FileRows.of(flat, tensor)


#: DataLoader keywords people bring along, and what BatchFeeder does instead: the error for one
#: says so, rather than only list options whose names do not match.
_DATALOADER_KEYWORDS = {
    "shuffle": 'order="random" (a new permutation each epoch, from seed) or order="sequential"',
    "num_workers": "prefetch=N (batches read ahead on a thread; a batch is one gather, no workers needed)",
    "prefetch_factor": "prefetch=N (batches read ahead)",
    "persistent_workers": "nothing: there are no worker processes to keep between loops",
    "pin_memory": "nothing: on a GPU batches are staged in pinned memory already",
    "collate_fn": "transform=fn (called with each whole batch)",
    "sampler": 'order= ("random", "block", "sequential" or an order object) and rank=, world_size=',
    "batch_sampler": 'batch_size= with order= ("random", "block", "sequential" or an order object)',
    "generator": "seed=N (the same seed gives the same stream)",
}


def _close_readers(readers, wait: bool = True) -> None:
    """Close a loop's readers, the batch reader first (it may wait on the file reader).

    Args:
        readers: the loop's readers.
        wait: wait for their threads (see each reader's ``close``).
    """
    for reader in readers:
        reader.close(wait=wait)


def _check_prefetch(prefetch, batch_bytes, device):
    """Refuse a read-ahead whose batches would take more than half the memory free now.

    Up to ``prefetch + 2`` batches are held at once besides the one the loop
    has: read ahead in a queue on the CPU, in page-locked staging slots and
    in device memory on a GPU (see **Read-ahead** in :class:`BatchFeeder`).

    Args:
        prefetch: batches to read ahead (validated, >= 0).
        batch_bytes: bytes of one batch over all sources.
        device: where batches are delivered.

    Raises:
        OptionError: the batches would not fit in half the RAM available
            (on a GPU, or in half its free memory).
    """
    room, where = available_ram() // 2, "half the RAM available now"
    if device.type == "cuda":
        # What torch's caching allocator holds but no tensor uses is free to the batches too.
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        free_on_device = (torch.cuda.mem_get_info(device)[0] + unused) // 2
        if free_on_device < room:
            room, where = free_on_device, f"half the free memory of {device}"
    if (prefetch + 2) * batch_bytes > room:
        most = max(0, room // max(1, batch_bytes) - 2)
        raise OptionError(f"prefetch={prefetch} would hold {prefetch + 2} batches of {batch_bytes:,} bytes "
                          f"read ahead, more than {where} ({room:,} bytes); use prefetch <= {most} "
                          f"(2 to 4 hide a batch's read time) or a smaller batch_size")


#: RAM a ``random`` epoch's order takes per row of the dataset, at its peak: int64 row ids for the
#: epoch being read and for the next one, drawn ahead, and a rank's share split from the whole
#: permutation. Measured over two epochs of 20,000,000 rows: 16-30 bytes a row, by source (in RAM
#: or a file) and world size (benchmarks/NOTES.md, entries 81 and 88); rounded up, for the margin a
#: peak that depends on when the thread drawing the next epoch runs needs. ``block`` and
#: ``sequential`` orders hold no ids (:class:`~speedswap.data.orders.WindowedShare`).
_RANDOM_ORDER_BYTES_PER_ROW = 32


def _check_order_fits(order, num_rows):
    """Refuse a dataset with more rows than the RAM available can hold a ``random`` epoch's order of.

    Windows and batches are bounded whatever the file's size, and so are the
    ids of a ``block`` or ``sequential`` epoch, made a window at a time; but
    a ``random`` epoch is one permutation of every row, held whole. A 4 GiB
    file of int32 tokens (a billion rows) needs about 32 GB for it, and ran
    the process out of memory at the first batch or, past the overcommit
    limit, was killed for it as the next epoch's order was drawn. Checked
    once, as the window is: nothing is read yet.

    Args:
        order: the feeder's order.
        num_rows: rows in the dataset.

    Raises:
        OutOfMemoryError: a ``random`` order's ids would take more than 3/4 of the RAM available.
    """
    if order.name != "random":
        return
    per_row = _RANDOM_ORDER_BYTES_PER_ROW
    need, room = num_rows * per_row, available_ram() * 3 // 4
    if need > room:
        raise OutOfMemoryError(
            f"the sources have {num_rows:,} rows, and each epoch's random order holds ids for every "
            f"row: about {need:,} bytes of RAM ({per_row} a row), more than 3/4 of the RAM available "
            f"({room:,} bytes); use order=\"block\" (shuffled blocks of rows, their ids made a window "
            f"at a time: no per-row memory, and a file is read in long stretches), or give the feeder "
            f"fewer, wider rows: view a 1-D token file as sequences (x[:len(x) - len(x) % 512]"
            f".reshape(-1, 512), a view: nothing is read)")


def _check_windows_fit(order, files, num_rows):
    """Refuse an order whose windows of file rows would take more than half the RAM available now.

    In ``block`` and ``sequential`` order a file source is read a window of
    blocks at a time into RAM the feeder owns, the next window while batches
    come from this one: two windows at least (see
    :class:`~speedswap.data.filesource.WindowReader`). The order's own check
    counts only its layout of ids, where a window of the files holds their
    whole rows. Checked once, as the layout is: a dip in the RAM free
    mid-training must not stop a run.

    Args:
        order: the feeder's order, with ``windows``.
        files: the :class:`~speedswap.data.filesource.FileRows` of the file sources (at least one).
        num_rows: rows in the dataset.

    Raises:
        OptionError: two windows would take more than half the RAM available.
    """
    row_bytes = sum(file.row_bytes for file in files)
    need = 2 * window_rows(num_rows, order.block_rows, order.window) * row_bytes
    room = available_ram() // 2
    if need > room:
        most = room // (2 * order.block_rows * row_bytes)
        smaller = (f"a window of at most {most:,} blocks" if most else
                   f"window=1 and blocks of at most {max(1, room // (2 * row_bytes)):,} rows")
        raise OptionError(f"{type(order).__name__}(block_rows={order.block_rows}, window={order.window}) reads "
                          f"the file sources a window of blocks at a time into RAM, two windows at once: "
                          f"{need:,} bytes, more than half the RAM available now ({room:,} bytes); use "
                          f"{smaller}")


def _resolve_ranks(rank, world_size):
    """``(rank, world_size)``: as given, or from ``torch.distributed`` when it is initialised.

    Raises:
        OptionError: a bad rank or world size, a rank outside the world, or
            ``world_size > 1`` without ``rank`` while ``torch.distributed`` is
            not initialised (every process would take rank 0 and read the same rows).
    """
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    world_size = int_option(world_size, "world_size")
    if rank is None and not initialised and world_size > 1:
        raise OptionError(f"world_size={world_size} without rank: torch.distributed is not "
                          f"initialised, so every process would be rank 0 and read the same rows; "
                          f"pass rank (0 .. {world_size - 1}) with world_size, or initialise "
                          f"torch.distributed")
    if rank is None and initialised:
        # Out of range only when world_size was given smaller than the group's: the message
        # must say where a rank the caller never passed came from.
        rank, given = dist.get_rank(), (": it is this process's torch.distributed rank; with a "
                                        "world_size other than the group's, pass rank too (rank=0, "
                                        "world_size=1 reads every row in every process)")
    else:
        rank, given = 0 if rank is None else rank, ""
    ranks = f"ranks are 0 .. {world_size - 1} in a world of {world_size}"
    rank = int_option(rank, "rank", minimum=0, hint=f" (outside the world: {ranks})")
    if rank >= world_size:
        raise OptionError(f"rank {rank!r} is outside the world: {ranks}{given}")
    return rank, world_size


class BatchFeeder:
    """Iterate over whole batches of rows of one or more sources, delivered on the device.

    Sources are numpy arrays, ``np.memmap`` files, torch tensors,
    :class:`~speedswap.DataGadget` or :class:`~speedswap.HostTable` objects with
    the same number of rows; they are read in place. A source that is not
    contiguous in memory (a column slice, a transposed tensor) is the
    exception: it is copied once, when the feeder is built, with a warning,
    and later changes to it are not seen (pass ``np.ascontiguousarray(x)`` or
    ``x.contiguous()`` to own the copy instead); a copy that would take more
    than 3/4 of the RAM available is refused. Each batch
    is a tuple with one tensor per source (a dict when the sources are given by
    name), each gathered with one indexing call.

    **Epochs.** Iterating yields the rest of the current epoch; after its last
    batch the feeder moves to the next epoch by itself (``set_epoch`` sets it,
    as with ``DistributedSampler``). The position lives in the feeder, not in
    the loop: a loop left early with ``break`` is continued by the next one,
    and :meth:`state_dict` / :meth:`load_state_dict` restart the exact stream.

    **Lookahead.** With ``lookahead=True`` iterating yields pairs
    ``(batch, next_batch)``: ``next_batch`` is the batch the next pair will
    start with (equal values, the same tensors), or None for the last batch
    of the epoch. A training loop can then start moving the next step's rows
    while it trains on this one (``emb.prefetch(next_ids)``). Only ``batch``
    counts as yielded: :meth:`state_dict` after a pair points at
    ``next_batch``, so a resumed loop starts with it. The stream and its
    state are the same with and without lookahead; ``next_batch`` is read
    (and transformed) before ``batch`` is handed over, and an error doing so
    is raised before it.

    **Lifetime.** Yielded tensors are never reused by the feeder: keep them
    as long as you like. On the CPU each is a fresh tensor. On a GPU each is a
    fresh device allocation filled on a side stream and recorded as used by
    your current stream, so the caching allocator does not hand its memory out
    again while your work on it is queued.

    **Read-ahead.** On a GPU, rows are gathered into a ring of ``prefetch + 2``
    page-locked staging slots per source by a background thread and copied on
    a side CUDA stream, so batch ``i + 1`` is read and copied while batch ``i``
    trains. Sources the GPU gathers itself (pinned tables the zero-copy
    kernel reads, device tensors) need no thread: when the loop takes a
    batch, the kernels of the next ``prefetch`` are queued on the side
    stream first, and your stream waits for a batch's on an event. On the
    CPU a background thread reads ``prefetch`` batches ahead when a source
    is a memory-mapped file; in-RAM sources are gathered on the
    spot, which is faster than any hand-off. On every device the next epoch's
    order is drawn on a thread while this epoch is read (it is a pure function
    of ``seed`` and the epoch, so a loop that jumps elsewhere draws its own;
    memory: one more epoch of row ids in ``random`` order). Where no thread can start (the
    process's thread limit, the interpreter shutting down), both are done on
    the loop's thread: the same batches, later (a warning says so for the
    read-ahead). An exception met while reading
    ahead is raised in the training loop. Sources must not be changed while a
    feeder iterates over them; between loops they may be, except those copied
    because they were not contiguous (on a GPU, a loop's
    copies wait for the work your stream had queued when the loop began, and
    its CPU gathers from a pinned table for the writes queued into it). A
    write during a loop may or may not reach the batches after it: on the
    CPU an in-RAM source is gathered at each batch and sees it, but batches
    already read ahead (on a GPU, or from a file) were read before it.
    One thread at a time iterates a feeder: a loop superseded from another
    thread raises :class:`~speedswap.StateError`.

    **Files.** A memory-mapped source (``np.load(path, mmap_mode="r")``, a
    mapped DataGadget, a tensor or plain array over a shared map of a file:
    ``torch.from_numpy(np.load(path, mmap_mode="r"))``) is read with ``pread``,
    never through its map (see :mod:`speedswap.data.filesource`). In ``block`` and ``sequential`` order
    each block is one large read into RAM the feeder owns, the next window is
    read while batches come from the current one, so an epoch streams at
    about the disk's sequential speed; ``random`` order keeps 16 row reads in
    flight. Resident memory stays within ``max(2, windows one batch spans)``
    windows of ``window * block_rows`` rows plus ``prefetch + 1`` batches,
    whatever the file's size. So is the epoch's order in ``block`` and
    ``sequential`` order, whose row ids are made a window at a time as the
    epoch reaches them; in ``random`` order it holds an id for every row,
    counted as 32 bytes a row (the next epoch's is drawn ahead). An order
    whose two windows would not fit in half the RAM available, or a ``random``
    order whose ids would not fit in 3/4 of it, is refused when the feeder is
    built. A file truncated while it is read raises
    :class:`~speedswap.FileFormatError` (one cut short between loops, as the next loop begins, before
    it hands out a batch), and so does one written in place
    (its size or modification time changed since the loop opened it), at
    the first batch read after the write, rather than go on with a mix of
    old and new rows (a file written just before the loop opened it is read
    once the file system's timestamp tick is over: at most 10 ms, or 2 s where
    times are whole seconds; no later write then keeps the time).
    A file replaced by a rename is not mixed in: the map keeps the old one.
    One rewritten in place between loops is read as it is now, unless its
    new ``.npy`` header moved the rows or changed their dtype or shape: the
    next loop then raises :class:`~speedswap.FileFormatError` (the map's
    rows are no longer the file's). A feeder's rows are those its sources had when it was built: rows
    appended to a file later (which the loop reading it also raises for)
    are read only by a new feeder over a new ``np.load(path, mmap_mode="r")``.
    The reads run on I/O threads: where none can start (the thread limit, the
    interpreter shutting down), the loop raises
    :class:`~speedswap.ThreadStartError`, the feeder at the batch it was
    reading and the files closed.

    Args:
        *sources: the data, each of shape ``(n, ...)``. Every option is a
            keyword: ``BatchFeeder(x, 64)``, DataLoader's way of giving the
            batch size, is refused, saying ``BatchFeeder(x, batch_size=64)``.
        batch_size: rows per batch (required).
        order: ``"random"`` (a new permutation each epoch, from ``(seed, epoch)``),
            ``"block"`` (quasi-random: shuffled contiguous blocks, rows
            shuffled within a window of blocks, for files larger than RAM),
            ``"sequential"``, or an order object from :mod:`speedswap.data.orders`.
            A block is about 4 MiB of rows unless the order names its size
            (in ``block`` order, 4 MiB of rows and their 8-byte ids, which the
            order holds a window of), and never more rows than the sources have (:attr:`order` is then
            a copy with the block size used).
        drop_last: drop the last, incomplete batch (and, with several ranks,
            the rows that do not divide evenly between them).
        seed: seeds the order; the same seed gives the same stream (the
            default, 0, gives every run the same orders, where DataLoader's
            shuffle differs from run to run). A
            ``"block"`` order's block size depends on the bytes of a row over
            all sources too (name it with ``BlockOrder(block_rows=...)`` to
            give feeders over different sources the same stream).
        device: ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``,
            a CUDA index or a ``torch.device``; None is ``"auto"`` (torch's current
            CUDA device, else the CPU), as for tables and gadgets.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"`` (the CPU), as for every
            speedswap object; ``device`` picks the GPU of ``"cuda"``.
        prefetch: batches read ahead (0: none, everything on the calling thread);
            ``prefetch + 2`` batches must fit in half the RAM available (on a
            GPU, also in half its free memory).
        rank, world_size: this process's share of every epoch, split as
            ``DistributedSampler`` does (padded by repeating rows unless
            ``drop_last``): every ``world_size``-th row of the epoch's order;
            in ``block`` and ``sequential`` order, the ``rank``-th of
            ``world_size`` equal runs of it instead, so that each rank reads
            about ``1 / world_size`` of a file rather than all of it.
            Default: from ``torch.distributed`` when it is initialised, else
            a single rank; ``world_size > 1`` without ``torch.distributed``
            needs ``rank``.
        transform: ``transform(batch)`` applied to each batch before it is
            yielded, on the calling thread. A batch whose transform raises
            is not counted as delivered: resuming yields it again.
        drop_behind: drop file pages from the page cache once read (they are
            read once per epoch). Default (None): only when the file sources
            exceed half the RAM available, since a smaller file stays cached
            for the next epoch.
        lookahead: yield ``(batch, next_batch)`` pairs (see **Lookahead**).
        **named_sources: sources by name; batches are then dicts.

    Raises:
        OptionError: no sources, no ``batch_size``, a number given by position
            (``DataLoader(x, 64)``'s batch size), both positional and named ones, an unknown
            option (a keyword whose value is not a source; for DataLoader's
            ``shuffle``, ``num_workers``, ``sampler``, ``collate_fn`` and the like
            the message names the option that does the job), a bad backend, a bad
            ``batch_size``/``prefetch``/``seed`` (a ``prefetch`` whose batches
            would not fit, see there), an unknown ``order``, a rank
            outside the world, ``world_size > 1`` without ``rank`` while
            ``torch.distributed`` is not initialised, a non-callable ``transform``, or
            ``drop_last`` with fewer rows per rank than ``batch_size`` (every
            epoch would be empty), a ``drop_last`` or ``lookahead`` that is not a bool,
            or a ``block`` or ``sequential`` order over file sources whose
            two windows of their rows would not fit in half the RAM available.
        ShapeError: sources with different numbers of rows, or none.
        DeviceError: a source on another device than ``device``, or on the meta
            device (which holds no values).
        BackendUnavailableError: ``device`` or ``backend`` asks for CUDA where
            there is none.
        DTypeError: a source of an unsupported type or dtype.
        StateError: a DataGadget or HostTable source that is closed.
        OutOfMemoryError: a source that is not contiguous whose copy would
            take more than 3/4 of the RAM available (a column slice of a
            file larger than RAM): write a contiguous copy to disk instead;
            or, in ``random`` order, so many rows that the ids of an epoch's
            order would take more than 3/4 of the RAM available (a 1-D file
            of small values): use ``block`` order, or view them as fewer,
            wider rows.

    Every argument is checked before a DataGadget source's rows are read
    (a gadget built from a path reads them when the feeder takes it) or a
    source that is not contiguous is copied; only a source on a device
    other than ``device``, and windows of file sources too large for the RAM
    (whether a DataGadget maps its file is known once it is taken), are found
    once the rows are where they will stay.

    uint16 and uint32 sources (token ids, say) are read and moved at their
    width and delivered as int32 and int64 batches with the same values.
    bfloat16 tensors, which numpy cannot hold, are fed as they are.

    Example:
        >>> feeder = ss.BatchFeeder(ss.DataGadget("x.npy"), labels, batch_size=4096)  # doctest: +SKIP
        >>> for epoch in range(10):                                            # doctest: +SKIP
        ...     for x, y in feeder:
        ...         loss = model(x, y); ...
        >>> import numpy as np, speedswap as ss
        >>> ids = np.random.default_rng(0).integers(0, 1000, (10, 3))
        >>> feeder = ss.BatchFeeder(ids, batch_size=4, order="sequential", device="cpu",
        ...                         lookahead=True)
        >>> for (ids,), ahead in feeder:       # ahead: the next pair's batch, None at the end
        ...     print(len(ids), None if ahead is None else len(ahead[0]))
        4 4
        4 2
        2 None
    """

    def __init__(self, *sources: Source, batch_size: Optional[int] = None, order: Union[str, Order] = "random",
                 drop_last: bool = False, seed: int = 0, device: DeviceLike = "auto", prefetch: int = 2,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 transform: Optional[Callable[[object], object]] = None, drop_behind: Optional[bool] = None,
                 lookahead: bool = False, backend: BackendLike = "auto", **named_sources: Source):
        for name, value in named_sources.items():
            # A DataLoader keyword is refused whatever its value (a sampler, a function) unless
            # it is data: a source may be named "sampler", but a RandomSampler is no source.
            data = isinstance(value, (np.ndarray, torch.Tensor, DataGadget, HostTable))
            if value is None or isinstance(value, (bool, int, float, str)) or (
                    name in _DATALOADER_KEYWORDS and not data):
                options = [p.name for p in inspect.signature(BatchFeeder).parameters.values()
                           if p.kind is p.KEYWORD_ONLY]
                instead = (f"; DataLoader's {name} is {_DATALOADER_KEYWORDS[name]} here"
                           if name in _DATALOADER_KEYWORDS else "")
                raise OptionError(f"BatchFeeder has no option {name!r} (got {name}={value!r}){instead}; "
                                  f"a keyword that is not an option names a data source (an array, "
                                  f"tensor, DataGadget or HostTable). Options: {', '.join(options)}")
        numbers = [value for value in sources if isinstance(value, (int, float, np.number))]
        if numbers:  # bool is an int too: DataLoader(x, 64, True)'s shuffle
            raise OptionError(f"BatchFeeder takes every option by keyword: its positional arguments are data "
                              f"sources, and {numbers[0]} is none. For the batch size, which "
                              f"DataLoader(x, {numbers[0]}) reads there: BatchFeeder(x, batch_size={numbers[0]})")
        if batch_size is None:
            raise OptionError("BatchFeeder needs batch_size=: the rows of each batch, e.g. "
                              "BatchFeeder(x, y, batch_size=4096)")
        if sources and named_sources:
            raise OptionError("give the sources either all by position (batches are tuples) or "
                              "all by name (batches are dicts), not both")
        if not sources and not named_sources:
            raise OptionError("BatchFeeder needs at least one source: BatchFeeder(x, y, batch_size=...)")
        batch_size = int_option(batch_size, "batch_size")
        prefetch = int_option(prefetch, "prefetch", minimum=0, hint=" (batches read ahead)")
        # DataLoader shuffles differently each run by default; here the default is one order
        # (seed 0), and None, a DataLoader user's way of asking for a fresh one, must say how.
        seed = int_option(seed, "seed", minimum=0,
                          hint="; the same seed gives the same stream (resumable). For a different order "
                               "each run, draw one (seed=secrets.randbits(63)) and keep it with the "
                               "checkpoint")
        if seed >= 2**128:
            # numpy's SeedSequence pads a seed to four 32-bit words before an epoch's spawn key, so
            # (seed, epoch, window) name one stream each below 2**128; a longer seed runs into the key.
            raise OptionError(f"seed must be below 2**128, got {seed} (seed=secrets.randbits(128) draws one)")
        if transform is not None and not callable(transform):
            raise OptionError(f"transform must be callable, got {type(transform).__name__}")
        if drop_behind is not None and not isinstance(drop_behind, (bool, np.bool_)):  # 1 == True, but no bool
            raise OptionError(f"drop_behind must be True, False or None (decide by size), got {drop_behind!r}")
        drop_behind = None if drop_behind is None else bool(drop_behind)
        drop_last = bool_option(drop_last, "drop_last", hint=" (drop the last, incomplete batch)")
        lookahead = bool_option(lookahead, "lookahead", hint=" (yield (batch, next_batch) pairs)")
        self._names = tuple(named_sources) if named_sources else None
        items = named_sources.items() if named_sources else enumerate(sources)
        described = [(f"source {key!r}", source) for key, source in items]
        # Compared before any source is converted: a DataGadget's rows are read (into RAM, or
        # pinned) when the feeder first takes them, which a refused feeder must not have done.
        lengths = {what: rows for what, rows in ((what, _rows_of(source)) for what, source in described)
                   if rows is not None}
        if len(set(lengths.values())) > 1:
            raise ShapeError(f"sources must have the same number of rows, got "
                             f"{', '.join(f'{w}: {n}' for w, n in lengths.items())}")
        signed = [_as_signed(source) for _, source in described]
        widen = tuple(widen for _, widen in signed)
        # Every argument is checked before any source is taken: a DataGadget's rows are read then,
        # and a source that is not contiguous is copied.
        checked = [_checked(source, what) for (what, _), (source, _) in zip(described, signed)]
        self._num_rows = int(checked[0][0].shape[0])
        row_bytes = sum(bytes_ for _, bytes_ in checked)
        if not self._num_rows or not all(bytes_ for _, bytes_ in checked):
            raise ShapeError("the sources have no rows (or empty rows); give at least one row")
        # A backend named explicitly decides the device as it does for tables and gadgets.
        self._device = (resolve_device(device) if isinstance(backend, str) and backend == "auto"
                        else get_backend(backend, None if device == "auto" else device).device)
        self._order = make_order(order, row_bytes, self._num_rows)
        self._batch_size = int(batch_size)
        self._drop_last = drop_last
        self._seed = int(seed)
        self._prefetch = int(prefetch)
        self._rank, self._world_size = _resolve_ranks(rank, world_size)
        # Orders that visit a window of blocks at a time give each rank a run of the epoch, not
        # a stride, or every rank reads every block of a file (see `shard`). Memory sources
        # are split alike, so a file and the same data in memory give the same stream.
        self._contiguous = hasattr(self._order, "windows") and self._world_size > 1
        if self._drop_last and self._share() < self._batch_size:
            raise OptionError(f"batch_size={self._batch_size} with drop_last=True leaves every epoch "
                              f"empty: each of the {self._world_size} rank(s) gets {self._share()} "
                              f"rows; use a batch_size <= {self._share()} or drop_last=False")
        # A batch_size past the rows makes one batch of them all: that is what read-ahead holds.
        _check_prefetch(self._prefetch, min(self._batch_size, self._share()) * row_bytes, self._device)
        _check_order_fits(self._order, self._num_rows)
        self._widen = widen if any(widen) else None  # read per batch: None when nothing widens
        columns = [_as_tensor(source, data, what)
                   for (what, _), (source, _), (data, _) in zip(described, signed, checked)]
        self._columns = tuple(tensor for tensor, _ in columns)
        tables = [_table_of(source) for _, source in described]
        self._tables = [(what, source, table) for (what, source), table in zip(described, tables)
                        if table is not None]
        self._files = {k: file for k, (_, file) in enumerate(columns) if file is not None}
        if self._files and hasattr(self._order, "windows"):
            _check_windows_fit(self._order, self._files.values(), self._num_rows)
        # Where a table's rows live is known once it is read (a DataGadget asked for device
        # memory maps a file larger than the RAM instead).
        for (what, _), tensor in zip(described, self._columns):
            if tensor.device.type != "cpu" and tensor.device != self._device:
                raise DeviceError(f"{what} lives on {tensor.device} but this feeder delivers to "
                                  f"{self._device}; move it, or pass device={str(tensor.device)!r}")
        self._transform = transform
        self._lookahead = lookahead
        file_bytes = sum(f.row_bytes * f.num_rows for f in self._files.values())
        self._drop_behind = file_bytes > available_ram() // 2 if drop_behind is None else drop_behind
        # Pinned tables the zero-copy kernel reads go straight into the device
        # batch: no CPU gather, no staging copy.
        self._kernel_tables = {k: t for k, t in enumerate(tables)
                               if t is not None and t.device == self._device and t.moves_on_device
                               and self._columns[k].device.type == "cpu"}
        host_columns = sum(t.device.type == "cpu" for t in self._columns) - len(self._kernel_tables)
        self._stager = (CudaStager(self._device, host_columns, self._prefetch + 2,
                                   self._kernel_tables)
                        if self._device.type == "cuda" else None)
        self._epoch = 0
        self._batch = 0
        self._generation = 0  # bumped whenever the position is set from outside an iteration
        # Whether the position is one load_state_dict() restored and no loop has started from yet.
        self._restored = False
        self._lock = threading.Lock()  # the position and generation change together
        self._readers = ()  # the running loop's batch reader and file reader
        self._ids = (None, None, None)  # (epoch, its share, device ids or None) of the epoch being read
        # (epoch, Future of its share, the drawing process): the next epoch's, drawn ahead.
        self._next_ids = (None, None, None)

    # ------------------------------------------------------------ properties
    def _share(self):
        """This rank's rows of each epoch's order (padding included), before ``drop_last`` drops a short batch."""
        n, w = self._num_rows, self._world_size
        if w == 1:
            return n
        return n // w if self._drop_last else -(-n // w)

    @property
    def rows_per_rank(self) -> int:
        """Rows this rank reads per epoch: padding rows included, a last batch ``drop_last`` drops not."""
        return len(self) * self._batch_size if self._drop_last else self._share()

    def __len__(self):
        """Batches per epoch on this rank (the same on every rank), wherever the feeder stands.

        As a ``DataLoader``'s: a loop begun mid-epoch (after :meth:`load_state_dict`
        or a ``break``) yields only the rest of the epoch,
        ``len(feeder) - feeder.state_dict()["batch"]`` batches.
        """
        rows = self._share()
        return rows // self._batch_size if self._drop_last else -(-rows // self._batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def device(self) -> torch.device:
        """The device batches are delivered on."""
        return self._device

    @property
    def order(self) -> Order:
        """The order object (see :mod:`speedswap.data.orders`)."""
        return self._order

    def __repr__(self):
        return (f"BatchFeeder({len(self._columns)} sources x {self._num_rows} rows, "
                f"batch_size={self._batch_size}, order={self._order.name!r}, device={self._device}, "
                f"rank {self._rank}/{self._world_size}, epoch {self._epoch}, batch {self._batch}/{len(self)})")

    # -------------------------------------------------------------- position
    def _reposition(self, epoch=None, batch=0) -> int:
        """Supersede the running loop and move to batch ``batch`` of ``epoch`` (None: stay where the feeder is).

        Returns:
            The new generation, the one a loop from here runs under.
        """
        self._restored = False
        with self._lock:
            self._generation += 1
            generation = self._generation
            # Where the feeder stands is taken here, with the generation: a loop on another thread counts
            # its batches under this lock, and a position read before it would hand them out again.
            if epoch is not None:
                self._epoch, self._batch = epoch, batch
        # After the bump: a loop on another thread that wakes up sees it was superseded.
        self._stop_reader()
        return generation

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch (its order depends on it).

        After :meth:`load_state_dict`, and before a loop has started, the
        restored epoch keeps its restored position: a ``DistributedSampler``
        loop calls ``set_epoch`` at the top of every epoch, the resumed one
        too, and starting it over would train its first batches twice.

        Args:
            epoch: the epoch to start, from 0.

        Raises:
            OptionError: a negative or non-int epoch.
        """
        epoch = int_option(epoch, "epoch", minimum=0)
        if self._restored and epoch == self._epoch:
            self._restored = False
            return
        self._reposition(epoch, 0)

    def state_dict(self) -> dict:
        """Where the stream stands: the next batch to yield, and what defines the stream.

        Batches read ahead but not yet yielded are not counted, so resuming
        repeats none and skips none.

        Returns:
            dict of plain Python values (safe for ``torch.save`` / JSON).
        """
        return {"epoch": self._epoch, "batch": self._batch, "seed": self._seed,
                "num_rows": self._num_rows, "batch_size": self._batch_size,
                "drop_last": self._drop_last, "rank": self._rank, "world_size": self._world_size,
                "order": self._order.describe(), "shard": "contiguous" if self._contiguous else "interleaved"}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream from :meth:`state_dict`'s position.

        Every rank of a world reads the same number of batches per epoch, in
        step, so a state saved by one rank resumes every rank of the same
        world (each keeps its own ``rank``): rank 0's checkpoint serves all.
        A :meth:`set_epoch` of the restored epoch before the next loop keeps
        the position (see there).

        Args:
            state: a dict from :meth:`state_dict` (of this feeder, one built
                with the same arguments, or another rank's of the same world).

        Raises:
            StateError: the state comes from a feeder with another seed, data
                size, batch size, order, ``drop_last``, world size or split
                between ranks (``shard``: a state saved before ranks took runs of
                a block or sequential order, or a random or block order's state
                saved with earlier streams (:data:`~speedswap.data.orders.STREAMS`),
                is continued by no feeder, and the message says to ``set_epoch``
                its epoch instead); or is malformed
                (not a dict, keys missing, a position that is not an int in
                range). Nothing changes then.
        """
        if not isinstance(state, dict):
            raise StateError(f"not a BatchFeeder state: expected the dict state_dict() returns, got "
                             f"{type(state).__name__}")
        # States saved before the contiguous split had none: theirs was interleaved.
        before_split = "shard" not in state
        state = {"shard": "interleaved", **state}
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise StateError(f"not a BatchFeeder state: keys {missing} are missing")
        mine = self.state_dict()
        # The position is every rank's (see above): the saving rank's own number does not matter.
        differ = [f"{key}: saved {state[key]!r}, this feeder {mine[key]!r}"
                  for key in _STATE_KEYS[2:] if key != "rank" and state[key] != mine[key]]
        if differ:
            remedy = "build the feeder with the same arguments to resume it"
            if before_split and state["shard"] != mine["shard"]:
                # No arguments rebuild the old strided split, so no feeder continues the position.
                remedy = (f"it was saved before ranks took runs of each epoch in {mine['order']['name']} "
                          f"order, and no feeder continues it: start its epoch afresh with "
                          f"set_epoch({state['epoch']!r})")
            elif earlier_streams(state["order"]) is not None:
                # Its epochs came from streams no order draws now: no feeder continues the position.
                remedy = (f"it was saved when {earlier_streams(state['order'])}, and no feeder continues it "
                          f"(its epochs now come in another order): start its epoch afresh with "
                          f"set_epoch({state['epoch']!r})")
            raise StateError("this state belongs to a different stream (" + "; ".join(differ) + "); " + remedy)
        epoch, batch = state["epoch"], state["batch"]
        # bool is an int to Python, but True is no epoch: a state holding one was not saved by a feeder.
        # numpy's ints are (a state kept in a numpy or Arrow log).
        whole = [isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in (epoch, batch)]
        if not (all(whole) and epoch >= 0 and 0 <= batch < max(1, len(self))):
            raise StateError(f"state position epoch={epoch!r}, batch={batch!r} is not one of this "
                             f"feeder's ({len(self)} batches per epoch)")
        self._reposition(int(epoch), int(batch))
        self._restored = True

    # ------------------------------------------------------------- iteration
    def _host_ids(self, epoch):
        """This rank's share of ``epoch`` (:func:`~speedswap.data.orders.epoch_share`): its rows, in order.

        A pure function of the feeder's settings and ``epoch``. In ``random``
        order the ids are held; in ``block`` and ``sequential`` order they are
        made as a loop reads them.
        """
        return epoch_share(self._order, self._num_rows, self._seed, epoch, self._rank, self._world_size,
                           self._drop_last, self._contiguous)

    def _epoch_ids(self, epoch):
        if self._ids[0] != epoch:
            drawn, future, pid = self._next_ids
            self._next_ids = (None, None, None)
            # A process forked during the draw has no thread to finish it: it draws its own.
            ids = future.result() if drawn == epoch and pid == os.getpid() else self._host_ids(epoch)
            # Held ids go to the device once an epoch; a windowed share's are made per batch, and the
            # stager copies each batch's (CudaStager.launch).
            on_device = (torch.from_numpy(ids.ids).to(self._device)
                         if ids.ids is not None and (self._kernel_tables or
                                                     any(t.device.type == "cuda" for t in self._columns))
                         else None)
            if on_device is not None and self._stager is not None:
                # Its batches are gathered on the side stream: a new epoch must not free it under them.
                self._stager.reads(on_device)
            self._ids = (epoch, ids, on_device)
        return self._ids[1], self._ids[2]

    def _stop_reader(self):
        readers = self._readers
        _close_readers(readers)
        # Forgotten only once closed: an interrupt (Ctrl-C) in the close leaves them to the next one.
        if self._readers is readers:
            self._readers = ()

    def _file_reader(self, share):
        """The reader of this epoch's file sources: whole blocks if the share visits windows, else rows."""
        files = list(self._files.values())
        if share.windows is None:
            return RowReader(files, drop_behind=self._drop_behind)
        # A batch past the epoch is the epoch: the reader's int64 arithmetic cannot take 2**63 or more.
        return WindowReader(files, share, min(self._batch_size, len(share)), drop_behind=self._drop_behind)

    def __iter__(self):
        return self._run(self._reposition())

    def _check_tables(self):
        """Refuse table sources closed or reloaded since the feeder was built.

        Raises:
            StateError: a DataGadget or HostTable source was closed, or a
                DataGadget reloaded (its rows here would be the old ones).
        """
        for what, source, table in self._tables:
            live = _table_of(source)  # a closed DataGadget raises here
            if live is not table or live.closed:
                raise StateError(f"{what} was closed or reloaded after this feeder was built, so "
                                 f"the feeder would serve its old rows; build a new BatchFeeder over it")

    def _check_sources(self):
        """Refuse table sources closed or reloaded since; read files pread cannot confirm through their maps.

        Raises:
            StateError: as :meth:`_check_tables`.
            FileFormatError: a mapped ``.npy`` file rewritten in place with
                another header (:meth:`FileRows.check_layout`).
        """
        self._check_tables()
        replaced = [k for k, file in self._files.items() if file.replaced()]
        for k, file in self._files.items():
            if k not in replaced:  # a replaced file's map holds the old file, whose header the map read
                file.check_layout()
        for k in replaced:
            warn(f"{self._files.pop(k).path!r} was replaced or removed after it was memory-mapped "
                 f"(or this system cannot show which file a map holds); the feeder reads the "
                 f"mapped rows through the map (slower) from now on")

    def _run(self, generation):
        self._check_current(generation)
        self._check_sources()
        count = len(self)
        epoch, start = self._epoch, self._batch
        share, device_ids = self._epoch_ids(epoch)
        size, total = self._batch_size, len(share)
        advanced_by = threading.get_ident()  # the thread that last ran the loop

        # `read` holds what it reads, not the feeder: the loop's readers hold `read`, and the feeder
        # its readers, so a feeder dropped still holding them (a Ctrl-C cut their close short) would
        # wait for the garbage collector to close its files, or for good while a read-ahead thread
        # runs `read`.
        columns, stager, file_columns = self._columns, self._stager, tuple(self._files)
        files = self._file_reader(share) if self._files else None
        # This loop's own: a windowed share's cursor keeps the window it is in (batches come in order).
        take = share.cursor()

        def read(k):
            lo = k * size
            ids = take(lo, min(lo + size, total))  # the last batch stops at the epoch's end
            rows = torch.from_numpy(ids)
            # File sources come already gathered, in batch order.
            parts = {} if files is None else dict(zip(file_columns, files.read(lo, ids)))
            if stager is not None:
                return stager.launch(columns, rows, None if device_ids is None else device_ids[lo:lo + size], parts)
            if not parts:  # in-RAM sources: the common case, and a batch costs microseconds
                return tuple(torch.index_select(column, 0, rows) for column in columns), None
            return tuple(parts[j] if j in parts else torch.index_select(column, 0, rows)
                         for j, column in enumerate(columns)), None

        # A thread only for work that leaves the GIL: file reads and CPU gathers into staging.
        # Batches the GPU gathers itself cost their loop a few kernel launches, which a thread
        # would run under the same GIL and hand over through a queue (NOTES 46: 35-45 us a
        # batch): they are launched ahead on the loop's own thread instead.
        threaded = self._prefetch > 0 and (files is not None or (self._stager is not None
                                                                 and self._stager.gathers_on_cpu))
        launched = self._prefetch > 0 and self._stager is not None and not threaded
        try:
            if self._next_ids[0] != epoch + 1:
                # Drawn on a thread while this epoch is read: a permutation of a million rows takes
                # 12 ms of the CPU (15% of a 1M x 64 float32 epoch), and numpy's shuffle releases
                # the GIL. Drawn once the file reader has this epoch's windows (a block order keeps
                # the last layout it computed).
                self._next_ids = (epoch + 1, in_background(self._host_ids, epoch + 1), os.getpid())
            if self._stager is not None:
                self._stager.follow()
            self._follow_host_writes()
            reader = (self._reader_thread(read, start, count) if threaded
                      else LaunchAhead(read, start, count, self._prefetch) if launched
                      else SyncReader(read, start))
            # Recorded by no call, as this try ends: no interrupt (Ctrl-C) lands between it and the try
            # below, whose finally closes the readers.
            readers = self._readers = (reader,) if files is None else (reader, files)
        except BaseException:
            # No loop will close its files (an interrupt, a CUDA error, the read-ahead warning made an error).
            if files is not None:
                files.close()
            raise
        try:
            ahead = None  # with lookahead: the batch read for the previous pair, yielded now
            for k in range(start, count):
                self._check_current(generation)
                batch = self._finish(*reader.next()) if k == start or not self._lookahead else ahead
                if self._lookahead:
                    ahead = self._finish(*reader.next()) if k + 1 < count else None
                # Read ahead or not, no batch is handed over once a source's rows are not the
                # feeder's any more (a gadget reloaded or closed during the loop).
                self._check_tables()
                # Counted only once transformed (a batch whose transform raised comes
                # again on resume), and only if no other thread moved the feeder meanwhile.
                with self._lock:
                    self._check_current(generation)
                    self._batch += 1
                    if self._batch == count:
                        self._epoch, self._batch = self._epoch + 1, 0
                yield (batch, ahead) if self._lookahead else batch
                advanced_by = threading.get_ident()
        finally:
            if threading.get_ident() == advanced_by:
                _close_readers(readers)
            else:
                # An abandoned loop finalised by the garbage collector on another thread, which may
                # be one of its readers' own: closing them there would wait for that thread itself
                # (a reader thread joining itself, or waiting for a read on this I/O thread).
                closer = threading.Thread(target=_close_readers, args=(readers,), daemon=True,
                                          name="speedswap-feeder-close")
                try:
                    closer.start()
                except RuntimeError:
                    # No thread can start (the thread limit, the interpreter shutting down): close
                    # them here, waiting for no thread (this one may be theirs), or their files stay open.
                    _close_readers(readers, wait=False)
            if self._readers is readers:
                self._readers = ()

    def _follow_host_writes(self):
        """Make this loop's CPU gathers read the device writes queued so far into its table sources.

        A source in page-locked memory on a GPU is written by kernels (``DataGadget.put`` of rows on
        the device) that may still be queued when the loop starts, and the CPU reads its rows through
        the tensor the feeder took when it was built, which no write waits for: the loop's batches
        showed the rows as before them. Once per loop, as :meth:`CudaStager.follow` orders what the
        GPU reads (the sources the zero-copy kernel reads are ordered by it, with no host wait).
        """
        read_by_kernels = [id(table) for table in self._kernel_tables.values()]
        for _, _, table in self._tables:
            # A file map's rows are written by the CPU, at once; its flush() would sync the file.
            if id(table) not in read_by_kernels and table.storage != "mmap":
                table.flush()  # a wait for the table's device writes, and nothing else

    def _reader_thread(self, read, start, count):
        """A :class:`ReaderThread`, or where none can start a :class:`SyncReader`: the same batches, later."""
        try:
            return ReaderThread(read, start, count, self._prefetch)
        except ThreadStartError as exc:
            warn(f"{exc}; this loop reads each batch when it is asked for, without read-ahead")
            return SyncReader(read, start)

    def _check_current(self, generation):
        if self._generation != generation:
            raise StateError("this loop over the feeder was superseded: a newer loop, set_epoch "
                             "or load_state_dict moved the feeder since; iterate the feeder anew")

    def _finish(self, tensors, done):
        if done is not None:
            tensors = self._stager.deliver(tensors, done)
        if self._widen is not None:
            tensors = tuple(_widened(t, widen) for t, widen in zip(tensors, self._widen))
        batch = dict(zip(self._names, tensors)) if self._names is not None else tensors
        return batch if self._transform is None else self._transform(batch)
