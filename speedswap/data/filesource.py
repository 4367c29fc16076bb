"""Rows of memory-mapped ``.npy`` sources read with ``pread``: whole blocks a window at a time, or rows in parallel.

A :class:`~speedswap.BatchFeeder` never reads a file source through its
memory map. Page faults fetch a few pages at a time, so rows shuffled inside
a window of blocks defeat the kernel's read-ahead; every page touched counts
in the process's resident memory and stays in the page cache; and a file
truncated under a map kills the process with SIGBUS. ``pread`` into RAM the
feeder owns has none of these problems: a short read becomes a
:class:`~speedswap.FileFormatError`, and so does a file whose size or
modification time changed since it was opened (written in place: the rows
read next would be new ones); a file written in the timestamp tick before it
was opened is read once the tick is over, so that no later write keeps them.

* :class:`WindowReader` serves orders that visit a window of contiguous
  blocks at a time (``block``, ``sequential``). Each block is one large
  ``pread`` into a fixed arena of window slots; the next window is read on
  I/O threads while batches are gathered from the current one, and each
  block is dropped from the page cache once copied (``drop_behind``).
* :class:`RowReader` serves ``random`` order: each batch's rows are read by
  several threads at once, so the disk sees many requests in flight.

Both take validated input from the feeder; their I/O runs on a small thread
pool and only there, so closing a reader (shut the pool, then close the file
descriptors) never races a read, unless it is closed without waiting (a loop
nobody iterates, closed where no thread can wait): only reads then fail.
"""

import concurrent.futures
import os
import threading
import time
import weakref
from itertools import repeat

import numpy as np
import torch

from ..atomic import open_into, opening_error
from ..files import identity, mapped_identity, read_npy_header
from ..mappings import memmap_file_offset, shared_file_at
from ..errors import FileFormatError, SpeedswapError, StateError, ThreadStartError

__all__ = ["FileRows", "WindowReader", "RowReader", "window_rows"]

_PAGE = os.sysconf("SC_PAGE_SIZE")


class FileRows:
    """Where a source's rows lie in a file: ``num_rows`` rows of ``row_bytes`` from byte ``offset``.

    Args:
        path: the file.
        offset: byte offset of row 0.
        num_rows: rows.
        row_shape: the torch shape of one row.
        dtype: the torch dtype of the rows.
        identity: ``(st_dev, st_ino)`` of the file the rows are mapped from,
            or None when it cannot be known: then pread, which could read
            another file, is never used (:meth:`replaced` is True).
        layout: where the ``.npy`` file's header put its rows, and as what
            (:func:`_layout`), when the map was made; None for a file without
            a ``.npy`` header (a raw memmap).
    """

    def __init__(self, path, offset, num_rows, row_shape, dtype, identity, layout=None):
        self.path, self.offset, self.num_rows = path, int(offset), int(num_rows)
        self.row_shape, self.dtype = tuple(row_shape), dtype
        self.row_bytes = int(np.prod(row_shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        self.identity = identity
        self.layout = layout

    def check_layout(self) -> None:
        """Refuse a ``.npy`` file rewritten in place with another header since it was mapped.

        The map (and the array the user holds) still places the rows where
        the old header did: read through it or with pread, a row would be
        bytes of the new header or straddle two rows. Rewrites that keep the
        header (new values, same layout) are read as the file now holds them.

        Raises:
            FileFormatError: the header now puts the rows elsewhere or makes
                them of another dtype or shape, or the file is no ``.npy``
                file any more or is being loaded into (its mark says so).
        """
        if self.layout is None:
            return
        now = _layout(read_npy_header(self.path, exact_size=False))
        if now != self.layout:
            offset, dtype, row_shape = self.layout
            raise FileFormatError(
                f"{self.path!r} was rewritten in place with another .npy header since it was mapped: the "
                f"map puts its rows of {dtype} {row_shape} at byte {offset}, the file now at byte "
                f"{now[0]} as {now[1]} {now[2]}, so the mapped rows are no longer the file's rows; map "
                f"it again (np.load(path, mmap_mode='r')) and build a new BatchFeeder over it")

    def replaced(self) -> bool:
        """Whether pread of the path might not read the mapped file.

        Returns:
            True when the path now names another file, or none, or the mapped
            file's identity is unknown.
        """
        if self.identity is None:
            return True
        try:
            return identity(os.stat(self.path)) != self.identity
        except OSError:  # removed, or no longer reachable: either way not provably the mapped file
            return True

    @classmethod
    def of(cls, array, tensor):
        """The file behind ``array``, or None when it is not a shared file map pread can read.

        The file is the one ``array`` maps, not whatever its path names now;
        where that cannot be confirmed, :meth:`replaced` is True and the
        feeder reads through the map.

        A plain array or tensor over a shared map of a file (``np.asarray(memmap)``,
        ``torch.from_numpy(memmap)``) is found by its address among the process's
        mappings: read through the map, it was paged in whole and killed the
        process with SIGBUS when the file was truncated.

        Args:
            array: a host numpy array (the source's memory), C-contiguous.
            tensor: the source's tensor view of it (gives the row shape and dtype).

        Returns:
            FileRows or None.
        """
        if not isinstance(array, np.memmap):
            return cls._of_address(array, tensor)
        handle = getattr(array, "_mmap", None)
        # A copy-on-write map ("c") may hold private changes pread would not see.
        if handle is None or array.mode == "c" or not array.filename:
            return None
        if not array.flags.c_contiguous:
            return None
        offset = memmap_file_offset(array)
        try:
            layout = _layout(read_npy_header(array.filename, exact_size=False))
        except SpeedswapError:  # a raw file, or none at the path now: nothing to hold the map to
            layout = None
        return cls(array.filename, offset, len(array), tensor.shape[1:], tensor.dtype,
                   mapped_identity(array.ctypes.data), layout)

    @classmethod
    def _of_address(cls, array, tensor):
        """:meth:`of` for an array that is no ``np.memmap``: the file of the shared mapping holding it, or None."""
        if not array.flags.c_contiguous or not array.nbytes:
            return None
        root = array
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.flags.owndata:  # numpy allocated it: no file behind it, and no need to read the mappings
            return None
        found = shared_file_at(array.ctypes.data, array.nbytes)
        if found is None:
            return None
        try:
            layout = _layout(read_npy_header(found.path, exact_size=False))
        except SpeedswapError:  # a raw file: nothing to hold the map to
            layout = None
        return cls(found.path, found.offset + array.ctypes.data - found.start, len(array), tensor.shape[1:],
                   tensor.dtype, found.identity, layout)


def _layout(header) -> tuple:
    """``(offset, dtype, row shape)`` of a ``.npy`` header: where its rows begin and what each is."""
    return header.offset, header.dtype, tuple(header.shape[1:])


def _version(stat) -> tuple:
    """``(size, mtime in ns)`` of an ``os.stat`` result: they change when the file is written."""
    return stat.st_size, stat.st_mtime_ns


#: The coarsest tick of the clock Linux stamps writes with (one jiffy at HZ=100). Kernels before
#: 6.13 stamp every write with it, so a write in the tick of the one before keeps its mtime.
_TICK_NS = 10_000_000
#: The tick where modification times are whole seconds (FAT stamps every 2 s).
_SECONDS_TICK_NS = 2_000_000_000


def _tick(mtime) -> int:
    """The timestamp tick, in ns, of a file whose modification time is ``mtime`` ns: whole seconds mean 2 s."""
    return _SECONDS_TICK_NS if mtime % 10**9 == 0 else _TICK_NS


def _settle(versions) -> None:
    """Wait until a write from now on would stamp each file later than its modification time in ``versions``.

    A file written in the timestamp tick before a reader opened it could be
    written again in that tick with its size and modification time unchanged,
    and the reader would feed old and new rows together. Once the tick is over,
    every later write changes the time; a write before then lands before any
    row is read, so the loop reads one version either way. Only a file
    written in the last tick waits, at most one tick (10 ms, or 2 s where
    times are whole seconds).
    """
    now = time.time_ns()
    # Never longer than the file's own tick: a time ahead of this clock (another machine's, on a network
    # file system) is not waited out; once a tick has passed here, it has there too.
    wait = max((min(mtime + _tick(mtime) - now, _tick(mtime)) for _, mtime in versions), default=0)
    if wait > 0:
        time.sleep(wait / 1e9)


def _check_long_enough(file, size) -> None:
    """Refuse a file cut short since it was mapped, before a loop hands out any of its rows.

    Otherwise a loop in ``random`` order hands out every batch whose rows the
    shorter file still holds, and raises only at the first row past its end,
    mid-epoch. A file cut during a loop is :meth:`_PoolReader._check_unchanged`'s.

    Args:
        file: the :class:`FileRows` of the source.
        size: the file's size in bytes now.

    Raises:
        FileFormatError: the file ends before the last of the source's rows.
    """
    end = file.offset + file.num_rows * file.row_bytes
    if size < end:
        raise FileFormatError(
            f"{file.path!r} is {size:,} bytes, too short for the {file.num_rows:,} rows this feeder was "
            f"built with (bytes {file.offset:,} to {end:,}): it was truncated, or rewritten with fewer "
            f"rows, since it was mapped. Restore the file to go on, or map it again "
            f"(np.load(path, mmap_mode='r')) and build a new BatchFeeder over it")


def _disk_error(file, exc, doing) -> FileFormatError:
    """A :class:`FileFormatError` naming the file for an OSError of the disk or file system (EIO).

    Args:
        file: the :class:`FileRows` whose file failed.
        exc: the OSError; its ``errno`` is kept.
        doing: what failed, for the message (``"reading rows 0..99 (bytes 128 to 1,328)"``).

    Returns:
        FileFormatError, with ``errno`` set as ``exc``'s (raise it ``from exc``).
    """
    error = FileFormatError(f"{file.path!r}: {exc.strerror or exc} while {doing}, a disk or file "
                            f"system error. Check the device (dmesg) and restore the file if it is "
                            f"damaged; iterating the feeder again retries from this batch")
    error.errno = exc.errno
    return error


def _pages(position, end):
    """``(start, length)`` of the whole pages holding bytes ``[position, end)``: what drop-behind drops.

    Rows are read once per epoch, so a reader that drops behind keeps them out
    of the page cache. The kernel drops only whole pages inside a range, so it
    is rounded out: a page shared with a row not read yet is read again then,
    and the page cache stays bounded whatever the row size. Works on ints and
    on int64 numpy arrays alike.
    """
    start = position - position % _PAGE
    return start, end - start + _PAGE - 1 - (end - 1) % _PAGE


def _closed_by_another_thread() -> StateError:
    return StateError("this feeder loop's file reader was closed by another thread (set_epoch, "
                      "load_state_dict or a new loop); iterate the feeder anew, one thread at a time")


def _close_fds(fds) -> None:
    """Close a file reader's descriptors, each taken out of the list ``fds`` before its close: none twice.

    The one way a reader's files are closed: by :meth:`_PoolReader.close`, and by the reader's
    finalizer when it is collected unclosed. An interrupt (Ctrl-C) lands on entering a function or
    once a call into C has returned: one between two closes leaves the rest in ``fds`` for the next
    close, and one never closes a number again that another file may have by then. Taken from the
    end: a read on an I/O thread that :meth:`_PoolReader.close` did not wait for finds its file's
    number, or none (IndexError).

    Args:
        fds: the reader's list of descriptors (``_PoolReader._fds``), emptied.
    """
    while fds:
        fd = fds[-1]
        del fds[-1]  # no call: nothing lands between this and the close
        os.close(fd)


class _PoolReader:
    """Open file descriptors and the I/O thread pool shared by both readers.

    A reader collected without :meth:`close` closes its files then (the pool's
    threads end once the pool is collected): a loop whose close a Ctrl-C cut
    short, or one interrupted as it was handed its reader, leaves nothing open
    once dropped.
    """

    def __init__(self, files, threads, drop_behind, advice):
        self._files = files
        self._drop = drop_behind
        # Before the files are opened: an interrupt (Ctrl-C) once they are would leave them open
        # with no reader returned to close them. The pool starts its threads on its first read.
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="speedswap-io")
        self._closed = False
        # set_epoch on one thread and the loop's cleanup on another may close at once: the second
        # waits for the first, so neither returns with the files open nor closes a number twice.
        self._close_lock = threading.Lock()
        self._pid = os.getpid()  # a forked child has the pool's state but none of its threads
        self._fds = []  # each file's descriptor, from its opening (open_into)
        # Holds the list, not the reader. Not at the interpreter's exit: the process's end closes the
        # files, and a daemon read-ahead thread may still read them then.
        self._release = weakref.finalize(self, _close_fds, self._fds)
        self._release.atexit = False
        self._versions = []  # each file's (size, mtime) when opened: a rewrite in place changes them
        try:
            for file in files:
                stat = os.fstat(open_into(self._fds, file.path, os.O_RDONLY))
                if identity(stat) != file.identity:  # replaced since checked
                    raise FileFormatError(f"{file.path!r} was replaced by another file while the "
                                          f"feeder opened it; iterate the feeder again")
                _check_long_enough(file, stat.st_size)
                self._versions.append(_version(stat))
                os.posix_fadvise(self._fds[-1], 0, 0, advice)
            _settle(self._versions)
        except BaseException as exc:  # an interrupt in the settling wait too: nobody else closes them
            _close_fds(self._fds)
            if isinstance(exc, OSError) and not isinstance(exc, FileFormatError):
                raise opening_error(file.path, exc, ".npy file") from exc
            raise

    def _check_process(self) -> None:
        """Refuse to read in a process forked since the reader was made.

        The child has the I/O pool's state but none of its threads: a read it
        queued would wait forever for a thread that never takes it, and so
        would a wait for a read the parent had in flight at the fork.

        Raises:
            StateError: this is a forked child.
        """
        if os.getpid() != self._pid:
            raise StateError("this feeder loop's file reader belongs to the process this one was forked "
                             "from, whose I/O threads it does not have; iterate the feeder anew in this "
                             "process")

    def _read(self, column, first, count, out):
        """``pread`` rows ``[first, first + count)`` of file ``column`` into the uint8 array ``out``.

        Raises:
            FileFormatError: the file ends before the rows, or the disk failed (EIO) reading them.
        """
        file, fd = self._files[column], self._fds[column]
        view = memoryview(out).cast("B")
        position, end = file.offset + first * file.row_bytes, file.offset + (first + count) * file.row_bytes
        done = 0
        while done < len(view):  # a regular file returns less only at its end, but loop to be sure
            try:
                got = os.preadv(fd, [view[done:]], position + done)
                size = os.fstat(fd).st_size if got == 0 else None
            except OSError as exc:
                raise self._reading_error(column, first, count, exc) from exc
            if got == 0:
                raise FileFormatError(
                    f"{file.path!r} ends at byte {size:,} but rows {first}..{first + count - 1} need "
                    f"bytes up to {end:,}: the file was truncated or rewritten while the feeder read "
                    f"it; restore it (or rebuild the DataGadget/memmap) and resume from a state_dict")
            done += got
        if self._drop:
            os.posix_fadvise(fd, *_pages(position, end), os.POSIX_FADV_DONTNEED)

    def _reading_error(self, column, first, count, exc):
        """The :func:`_disk_error` of ``exc``, an OSError reading rows ``[first, first + count)`` of file ``column``."""
        file = self._files[column]
        position, end = file.offset + first * file.row_bytes, file.offset + (first + count) * file.row_bytes
        return _disk_error(file, exc, f"reading rows {first}..{first + count - 1} (bytes {position:,} to {end:,})")

    def _check_unchanged(self):
        """Raise when a file was written since it was opened: rows read from then on may be new ones.

        Called after a batch's reads: a write that reached a row read for it
        stamped the file first, so the batch is not handed over.

        Raises:
            FileFormatError: a file's size or modification time changed, or it could not be
                checked (a disk error).
            StateError: the reader was closed by another thread meanwhile.
        """
        for file, fd, version in zip(self._files, self._fds, self._versions):
            try:
                now = _version(os.fstat(fd))
            except OSError as exc:
                if self._closed:  # set_epoch on another thread closed the descriptor (EBADF)
                    raise _closed_by_another_thread() from exc
                raise _disk_error(file, exc, "checking it for changes (fstat)") from exc
            if self._closed:  # closed before the fstat: the number may name another file by now
                raise _closed_by_another_thread()
            if now != version:
                raise FileFormatError(
                    f"{file.path!r} changed while the feeder read it (its size or modification time "
                    f"is not what it was when this loop opened it): this epoch's later batches would "
                    f"mix old and new rows. The batches already yielded hold the old rows; iterate the "
                    f"feeder again to go on with the file as it is now, or load_state_dict() a state "
                    f"saved before the change (set_epoch() to start the epoch over). Either way the "
                    f"feeder reads the {file.num_rows:,} rows it was built with: rows appended to the "
                    f"file since are seen only by a new feeder over a new np.load(path, mmap_mode='r')")
        if self._closed:  # closed before the loop began: close() left no descriptor to check
            raise _closed_by_another_thread()

    def _submit(self, fn, *args):
        """Run ``fn(*args)`` on the I/O pool.

        Returns:
            concurrent.futures.Future

        Raises:
            StateError: the reader was closed (by another thread).
            ThreadStartError: the pool needed a thread and none could start.
        """
        if self._closed:
            raise _closed_by_another_thread()
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError as exc:
            # close() on another thread may shut the pool between the check above and here.
            if self._closed:
                raise _closed_by_another_thread() from exc
            # Else a thread could not start ("can't start new thread", or after the interpreter's
            # shutdown). A read the pool queued without its thread is cancelled by close().
            paths = ", ".join(repr(file.path) for file in self._files)
            raise ThreadStartError(
                f"no I/O thread could start to read {paths} ({exc}): a memory-mapped source is "
                f"read with pread on I/O threads, and the process is at its thread limit (ulimit "
                f"-u, a container's pids.max) or the interpreter is shutting down. Run fewer "
                f"threads (DataLoader workers, torch.set_num_threads), or hold the rows in memory "
                f"(np.load(path) without mmap_mode, DataGadget(path, mmap=False)); iterating the "
                f"feeder again resumes from this batch") from exc

    @staticmethod
    def _wait(futures):
        try:
            for future in futures:
                future.result()
        except concurrent.futures.CancelledError:
            raise StateError("this feeder loop's file reader was closed by another thread (set_epoch, "
                             "load_state_dict or a new loop); iterate the feeder anew") from None

    def close(self, wait: bool = True) -> None:
        """Cancel reads not started, wait for running ones, close the files.

        Idempotent, and from any thread: every call returns once the files are closed. An
        interrupt (Ctrl-C) in the wait for the I/O threads still closes them; one as the call
        begins or between two closes leaves the rest to the next call (the feeder's next loop,
        ``set_epoch`` or ``load_state_dict``), which finishes the job, or, where none comes, to
        the reader's collection.

        Args:
            wait: False closes the files without waiting for the reads running on
                the I/O threads (nobody sees what they read: see the comment
                in the code), and returns at once if another thread is closing
                the reader: for a loop nobody iterates any more, closed on one
                of its own threads, which waiting could wait for.
        """
        if os.getpid() != self._pid:
            # A forked child: the pool's threads stayed in the parent, and a lock one held at
            # the fork (handing the pool a read) stays held here for good. The child closes
            # its copies of the files only; the parent's reader is the parent's to close.
            if not self._closed:
                self._closed = True
                _close_fds(self._fds)
            return
        # [True] once the turn is taken: appended by C as acquire returns (see atomic.open_into), so an
        # interrupt then is inside the try that lets go of it, and no later close waits for it forever.
        taken = []
        try:
            taken.extend(map(self._close_lock.acquire, [wait]))
            if not taken[0]:
                return  # the closing thread may be waiting for this one's read: it closes the files
            # Not `if self._closed: return`: a close interrupted before it closed every file left the rest
            # to this one. Shutting a shut pool down again only waits for threads that have ended.
            self._closed = True  # first: reads submitted from now on raise StateError
            try:
                self._pool.shutdown(wait=wait, cancel_futures=True)
            finally:  # an interrupt in the wait too: the files are closed as with wait=False (below)
                # With wait=False a read still running may use a descriptor number closed here, which
                # any open() in the process may take at once. That harms no file: the read only
                # preads (read-only, no file offset moved; a pipe, socket or eventfd refuses it with
                # ESPIPE, a write-only file with EBADF) into this reader's buffers, and its DONTNEED
                # drops only clean, unmapped page-cache pages (dirty ones are written back, never
                # dropped): the other file costs a disk read later, its data stays. Nor does anyone
                # see those buffers: wait=False comes only from a feeder loop nobody iterates, whose
                # read-ahead thread was told to stop first and drops the batches it reads from then on;
                # an interrupted wait only from a loop torn down or superseded, whose reads, done once
                # _closed is set, raise StateError (_check_unchanged) instead of handing their rows over.
                _close_fds(self._fds)
                # Nothing is left for the collection to close: it then calls no Python code, where a
                # Ctrl-C would be swallowed ("Exception ignored in <finalize object>").
                self._release.detach()
        finally:
            if True in taken:
                self._close_lock.release()


class RowReader(_PoolReader):
    """Reads a batch's rows from files with ``threads`` ``pread`` calls in flight (random order).

    Args:
        files: the :class:`FileRows` of the file sources.
        threads: reads in flight at once.
        drop_behind: drop each row from the page cache once read.
    """

    def __init__(self, files, threads=16, drop_behind=True):
        super().__init__(files, threads, drop_behind, os.POSIX_FADV_RANDOM)
        self._threads = threads

    def read(self, lo, ids):
        """The rows ``ids`` (positions ``lo, lo + 1, ...`` of the epoch), one fresh CPU tensor per file.

        Args:
            lo: the position of ``ids[0]`` in this rank's epoch (unused: rows are read where they are).
            ids: the batch's row ids, an int64 numpy array, in range.

        Raises:
            FileFormatError: a file is shorter than its rows, or a disk error (EIO) reading it.
            StateError: the reader was closed by another thread, or this process was forked from its own.
            ThreadStartError: no I/O thread could start.
        """
        self._check_process()
        outs = [torch.empty((len(ids), *f.row_shape), dtype=f.dtype) for f in self._files]
        # Each thread takes a stretch of the sorted ids: nearby rows go to the
        # disk together, and a thread's requests arrive in ascending order.
        order = np.argsort(ids, kind="stable")
        futures = [self._submit(self._rows, column, ids, part, out.view(-1).view(torch.uint8).numpy())
                   for column, out in enumerate(outs)
                   for part in np.array_split(order, min(self._threads, len(ids)))]
        self._wait(futures)
        self._check_unchanged()
        return outs

    def _rows(self, column, ids, positions, out):
        """Read rows ``ids[positions]`` of file ``column`` into their places in ``out`` (uint8, the batch's bytes).

        A row is one ``pread`` straight into its place: the offsets are worked
        out for the whole part at once, since Python per row cost more than the
        call itself (benchmarks/NOTES.md, entries 68 and 69). A short read (the
        file's end, a signal) goes to :meth:`_read`, which reads on or explains;
        an OSError is raised as :meth:`_read` raises it, never retried.
        """
        file, fd = self._files[column], self._fds[column]
        size, rows = file.row_bytes, ids[positions]
        position = file.offset + rows * size
        reads = zip(rows.tolist(), position.tolist(), (positions * size).tolist())
        # Each row's own pages, as _read drops them. One drop over the part's whole span would also
        # drop the cached pages of rows not read yet (later batches', other readers'): each a disk read.
        drops = zip(*(a.tolist() for a in _pages(position, position + size))) if self._drop else repeat(None)
        view, preadv, fadvise, dontneed = memoryview(out), os.preadv, os.posix_fadvise, os.POSIX_FADV_DONTNEED
        for (row, offset, at), drop in zip(reads, drops):
            try:
                got = preadv(fd, [view[at:at + size]], offset)
            except OSError as exc:
                raise self._reading_error(column, row, 1, exc) from exc
            if got != size:
                self._read(column, row, 1, out[at:at + size])
            elif drop is not None:
                fadvise(fd, *drop, dontneed)


def window_rows(num_rows: int, block_rows: int, window: int) -> int:
    """Rows in each of a :class:`WindowReader`'s window slots (it holds two at least): no more blocks than the file has.

    Args:
        num_rows: rows in the file.
        block_rows: rows per block.
        window: blocks per window.

    Returns:
        int
    """
    return min(window, -(-num_rows // block_rows)) * block_rows


class WindowReader(_PoolReader):
    """Serves an epoch that visits a window of contiguous blocks at a time from RAM, reading ahead.

    The epoch's windows are read in order into an arena of ``slots`` window
    slots per file (one large ``pread`` per block), ``slots - 1`` windows
    ahead of the batch being gathered; a window's slot is reused once no
    later batch needs it. A batch is one ``index_select`` from the arena. The
    few rows a window no longer resident holds (the padding that evens out
    ranks repeats the epoch's first rows) are read directly.

    Args:
        files: the :class:`FileRows` of the file sources.
        share: this rank's share of the epoch, a
            :class:`~speedswap.data.orders.WindowedShare`: its windows of blocks
            in reading order, and which window each position needs. Its ids
            come with each batch (:meth:`read`); none are held here.
        batch_size: rows per batch.
        threads: blocks read at once.
        drop_behind: drop each block from the page cache once copied.
    """

    def __init__(self, files, share, batch_size, threads=2, drop_behind=True):
        # RANDOM turns the kernel's read-ahead off: a block is read whole by its own
        # pread, and read-ahead past its end would fetch the neighbouring block,
        # which this epoch reads at another time (or, with drop_behind, reads again).
        super().__init__(files, threads, drop_behind, os.POSIX_FADV_RANDOM)
        try:
            self._plan(files, share, batch_size)
        except BaseException:  # the arena may not fit: the caller never gets a reader to close
            self.close()
            raise

    def _plan(self, files, share, batch_size):
        """Map blocks to windows and slots, and allocate the arena (``__init__``'s arguments)."""
        num_rows = files[0].num_rows
        self._share, self._block_rows = share, share.block_rows
        windows = self._windows = share.windows
        num_blocks = -(-num_rows // self._block_rows)
        self._window_rows = window_rows(num_rows, self._block_rows, windows.shape[1])
        self._window_of_block = np.empty(num_blocks, dtype=np.int64)
        self._slot_of_block = np.empty(num_blocks, dtype=np.int64)
        valid = windows >= 0
        self._window_of_block[windows[valid]] = np.nonzero(valid)[0]
        self._slot_of_block[windows[valid]] = np.nonzero(valid)[1]
        # The windows this rank visits, in reading order: every one from its first position's to
        # its last's (a window holds at least one row). Nothing per row: the window a position
        # needs is worked out per batch (share.frontier).
        self._last = int(share.frontier(len(share) - 1)) if len(share) else -1
        self._slots = max(2, share.span(batch_size))
        self._arenas = [torch.empty((self._slots * self._window_rows, f.row_bytes), dtype=torch.uint8)
                        for f in files]
        self._typed = [a.view(f.dtype).view(len(a), *f.row_shape) for a, f in zip(self._arenas, files)]
        self._resident = {}  # window (a row of `windows`) -> (slot, futures)
        self._free = list(range(self._slots))
        self._next = None  # the next window to read

    def read(self, lo, ids):
        """The rows ``ids``, positions ``lo, lo + 1, ...`` of the epoch (batches in order), a fresh CPU tensor per file.

        Args:
            lo: the position of ``ids[0]`` in this rank's share.
            ids: the batch's row ids (the share's at those positions), an int64 numpy array.

        Raises:
            FileFormatError: a file is shorter than its rows, or a disk error (EIO) reading it.
            StateError: the reader was closed by another thread, or this process was forked from its own.
            ThreadStartError: no I/O thread could start.
        """
        self._check_process()
        hi = lo + len(ids)
        first, last = int(self._share.frontier(lo)), int(self._share.frontier(hi - 1))
        for index in [i for i in self._resident if i < first]:
            slot, futures = self._resident.pop(index)
            self._wait(futures)  # a slot is rewritten only after its reads finished
            self._free.append(slot)
        if self._next is None or self._next < first:
            self._next = first
        while self._free and self._next <= self._last:
            self._load(self._next)
            self._next += 1
        for index in range(first, last + 1):
            self._wait(self._resident[index][1])
        blocks = ids // self._block_rows
        wins = self._window_of_block[blocks]
        slots = np.zeros(hi - lo, dtype=np.int64)
        held = np.zeros(hi - lo, dtype=bool)
        for index in range(first, last + 1):
            here = wins == index
            slots[here], held[here] = self._resident[index][0], True
        local = (slots * self._window_rows + self._slot_of_block[blocks] * self._block_rows
                 + ids - blocks * self._block_rows)
        local[~held] = 0
        local = torch.from_numpy(local)
        outs = [torch.index_select(typed, 0, local) for typed in self._typed]
        stray = np.nonzero(~held)[0]
        if len(stray):
            futures = [self._submit(self._read, column, int(ids[p]), 1,
                                    out[p].view(-1).view(torch.uint8).numpy())
                       for column, out in enumerate(outs) for p in stray]
            self._wait(futures)
        self._check_unchanged()
        return outs

    def _load(self, index):
        slot = self._free.pop()
        blocks = self._windows[index]
        futures = []
        # Blocks in file order, so the requests in flight are close together on disk.
        for position in np.argsort(blocks):
            block = int(blocks[position])
            if block < 0:
                continue
            first = block * self._block_rows
            count = min(self._block_rows, self._files[0].num_rows - first)
            row = slot * self._window_rows + int(position) * self._block_rows
            for column, arena in enumerate(self._arenas):
                futures.append(self._submit(self._read, column, first, count,
                                            arena[row:row + count].numpy()))
        self._resident[index] = (slot, futures)
