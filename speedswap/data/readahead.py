"""Read-ahead for :class:`~speedswap.BatchFeeder`: background threads and GPU staging.

Four pieces, used together or alone:

* :func:`in_background` computes one value on a thread of its own (the
  next epoch's order, drawn while this epoch is read).
* :class:`LaunchAhead` reads batches a fixed number ahead on the loop's own
  thread, for reads that only queue work on a GPU (kernel launches): the
  device starts their copies early, and no second thread contends for the
  GIL or hands batches over through a queue.

* :class:`ReaderThread` runs the feeder's batch reads on a daemon thread,
  a fixed number of batches ahead, and hands them over through a bounded
  queue. An exception raised while reading is handed over in place of the
  batch and re-raised in the training loop; the thread always posts either a
  batch or an error for every batch it owes, and a loop waiting for a batch
  wakes up when another thread closes the reader, so it never waits forever.
* :class:`CudaStager` moves a batch to the GPU the way FFCV does: rows are
  gathered on the CPU into a ring of page-locked staging slots
  (:class:`~speedswap.backends.staging.StagingRing`, one event per slot so
  a slot is rewritten only after its previous copy finished) and copied on a
  side CUDA stream; the training stream waits on an event recorded after the
  copies, never on the whole device.
"""

import atexit
import collections
import concurrent.futures
import os
import queue
import threading
import weakref

import torch

from ..errors import StateError, ThreadStartError
from ..live import Registry

__all__ = ["in_background", "SyncReader", "LaunchAhead", "ReaderThread", "CudaStager"]


def in_background(fn, *args) -> concurrent.futures.Future:
    """Start ``fn(*args)`` on a daemon thread of its own; its future holds the value or the exception.

    ``future.result()`` waits for it and re-raises, on the caller's thread, what
    ``fn`` raised. A daemon thread: an interpreter that exits meanwhile does not
    wait for a value nobody will read. Where no thread can start (the
    process's thread limit, the interpreter shutting down), ``fn`` runs on the
    caller's thread before this returns: the same value, computed sooner; an
    interrupt (Ctrl-C) meanwhile is the caller's, and is raised at once.

    Args:
        fn: the function; it must give the same value on any thread.
        *args: its arguments.

    Returns:
        concurrent.futures.Future
    """
    future = concurrent.futures.Future()

    def run(kept=BaseException):
        try:
            future.set_result(fn(*args))
        except kept as exc:  # noqa: BLE001 - re-raised by future.result() on the caller's thread
            future.set_exception(exc)

    try:
        threading.Thread(target=run, daemon=True, name="speedswap-in-background").start()
    except RuntimeError:  # "can't start new thread": the value does not depend on the thread
        # Errors wait in the future as the thread's would; an interrupt is not kept for a
        # result() that a loop ending first never asks for.
        run(kept=Exception)
    return future


def _stopped_by_another_thread() -> StateError:
    return StateError("this loop's read-ahead was stopped by another thread (set_epoch, load_state_dict "
                      "or a new loop over the feeder); iterate the feeder anew, from one thread at a time")


class SyncReader:
    """Reads batch ``k`` when asked for it, on the calling thread.

    Args:
        read: ``read(k)`` returns batch ``k``.
        start: the first batch to read.
    """

    def __init__(self, read, start):
        self._read = read
        self._next = start

    def next(self):
        """The next batch."""
        batch = self._read(self._next)
        self._next += 1
        return batch

    def close(self, wait: bool = True) -> None:
        """Nothing runs in the background; present so readers are interchangeable (``wait`` too)."""


class LaunchAhead:
    """Reads batches ``start .. stop - 1`` on the calling thread, ``depth`` ahead of the one handed out.

    Each :meth:`next` reads the batches after the one it returns until
    ``depth`` are read ahead, before returning it: for reads that queue
    asynchronous work (a batch's kernels on a side stream), their copies are
    queued before the loop's work on the batch it gets, whether or not the
    loop then waits for the device. An exception raised reading a batch
    ahead is raised when that batch is asked for; nothing after it is read.

    Args:
        read: ``read(k)`` returns batch ``k``.
        start, stop: the batches to read, in order.
        depth: how many batches to keep read ahead.
    """

    def __init__(self, read, start, stop, depth):
        self._read, self._next, self._stop, self._depth = read, start, stop, depth
        self._ahead = collections.deque()  # (ok, batch or exception), in order
        self._failed = False

    def _read_one(self):
        try:
            self._ahead.append((True, self._read(self._next)))
        except Exception as exc:  # noqa: BLE001 - raised when its batch is asked for
            self._ahead.append((False, exc))
            self._failed = True
        self._next += 1

    def next(self):
        """The next batch, after reading ahead; re-raises what reading it raised.

        Raises:
            Exception: whatever reading the batch raised.
            StateError: another thread closed this reader (it moved the feeder)
                meanwhile.
        """
        if not self._ahead:
            self._read_one()
        try:
            ok, value = self._ahead.popleft()
        except IndexError:  # close() on another thread dropped the batch read for this call
            raise _stopped_by_another_thread() from None
        while not self._failed and len(self._ahead) < self._depth and self._next < self._stop:
            self._read_one()
        if not ok:
            raise value
        return value

    def close(self, wait: bool = True) -> None:
        """Drop the batches read ahead (their copies finish on their own; nothing to ``wait`` for)."""
        self._ahead.clear()


_RUNNING = Registry()


@atexit.register
def _stop_running_readers():
    # A loop abandoned without being closed leaves its reader blocked on a full
    # queue; stop it before the interpreter tears torch down under it.
    for reader in _RUNNING.snapshot():
        reader.close()


#: How often a reader thread blocked on its full queue checks whether it was told to stop.
_POLL_S = 0.05


def _work(batches, closing, read, start, stop):
    """A :class:`ReaderThread`'s thread: ``read(k)`` for ``k`` in ``[start, stop)`` into the queue ``batches``.

    Each batch goes in as ``(True, batch)``; an exception as ``(False, exc)``, after which
    nothing more is read. Returns once ``closing`` is set.
    """
    try:
        for k in range(start, stop):
            if not _offer(batches, closing, (True, read(k))):
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the training loop, re-raised there
        _offer(batches, closing, (False, exc))


def _offer(batches, closing, item) -> bool:
    """Put ``item`` into the queue ``batches`` as soon as it has room; False if ``closing`` was set first."""
    while not closing.is_set():
        try:
            batches.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class ReaderThread:
    """Reads batches ``start .. stop - 1`` on a daemon thread, up to ``depth`` ahead.

    A reader collected without :meth:`close` tells its thread to stop: the
    thread holds ``read`` (and what it reads) until it ends, never the reader.

    Args:
        read: ``read(k)`` returns batch ``k``; runs on the reader thread.
        start, stop: the batches to read, in order.
        depth: how many finished batches may wait in the queue.

    Raises:
        ThreadStartError: the thread could not start (the process's thread
            limit, the interpreter shutting down); nothing was read.
    """

    def __init__(self, read, start, stop, depth):
        self._queue = queue.Queue(maxsize=depth)
        self._closing = threading.Event()
        # Tells the thread to stop once this reader is collected unclosed: a loop whose close a Ctrl-C
        # cut short, dropped with its feeder, or one interrupted as it was handed this reader. Holds the
        # event, not the reader; the thread holds the queue, the event and `read`, never the reader.
        self._stop = weakref.finalize(self, self._closing.set)
        self._pid = os.getpid()  # a forked child has the queue but not the thread that fills it
        self._thread = threading.Thread(target=_work, args=(self._queue, self._closing, read, start, stop),
                                        daemon=True, name="speedswap-feeder-reader")
        try:
            self._thread.start()
            _RUNNING.add(self)
        except RuntimeError as exc:
            raise ThreadStartError(f"the feeder's read-ahead thread could not start ({exc}): the "
                                   f"process is at its thread limit or the interpreter is shutting "
                                   f"down; read on the loop's thread instead (prefetch=0) or run "
                                   f"fewer threads") from exc
        except BaseException:
            # An interrupt (Ctrl-C) once the thread runs: no reader is returned to stop it, and it
            # would read on for good. One inside start() may come before the thread counts as started,
            # when it cannot be waited for: it is only told to stop then.
            self.close(wait=self._thread.is_alive())
            raise

    def next(self):
        """The next batch; re-raises here an exception the reader thread met.

        Raises:
            Exception: whatever reading the batch raised, with its traceback.
            StateError: another thread closed this reader (it moved the feeder)
                while this one waited.
        """
        if os.getpid() != self._pid:
            ok, value = self._left_from_before_the_fork()
        else:
            while True:
                try:
                    ok, value = self._queue.get(timeout=_POLL_S)
                    break
                except queue.Empty:
                    # The reader posts nothing more once closed: without this check
                    # a loop on another thread than the closing one would wait forever.
                    if self._closing.is_set():
                        raise _stopped_by_another_thread() from None
        if ok:
            return value
        self.close()
        raise value

    def _left_from_before_the_fork(self):
        """In a process forked mid-loop: the next batch queued before the fork, else StateError.

        The child has the queue but not the thread that fills it, and that thread may have
        held the queue's lock at the fork (inside ``put``), for good in the child: the
        queue's items are taken without it (no other thread runs here).
        """
        if not self._queue.queue:
            raise StateError("this loop's read-ahead thread is gone (the process was forked "
                             "during the loop); iterate the feeder anew in this process")
        return self._queue.queue.popleft()

    def close(self, wait: bool = True) -> None:
        """Stop reading ahead and wait for the thread (at most the batch it is reading). Idempotent.

        Args:
            wait: False returns without waiting: the thread ends by itself after
                the batch it is reading. For a loop closed on its own reader
                thread (or an I/O thread that thread waits for), where waiting
                would wait for itself.
        """
        self._closing.set()  # the finalizer's call, here again at every close: an interrupted one is redone
        # Nothing is left for the collection to do: it then calls no Python code, where a Ctrl-C
        # would be swallowed ("Exception ignored in <finalize object>").
        self._stop.detach()
        if wait:
            self._thread.join()
        _RUNNING.discard(self)


class CudaStager:
    """Gathers batches into page-locked staging slots and copies them to the GPU on a side stream.

    The tensors it returns are fresh device allocations made on the side
    stream; :meth:`deliver` makes the caller's stream wait for the copies and
    records the tensors as used by that stream, so the caching allocator does
    not hand their memory out again while the caller still uses them. The
    caller may keep them as long as it likes.

    Args:
        device: the CUDA device.
        host_columns: how many sources live in host memory (one staging ring each).
        slots: staging slots per source; reads ahead by up to ``slots - 1`` batches
            without waiting for a copy.
        kernel_tables: ``{column index: HostTable}`` of sources in pinned memory
            that the zero-copy kernel gathers straight into the batch on the
            GPU (no staging ring for them).
    """

    def __init__(self, device, host_columns, slots, kernel_tables=None):
        from ..backends.staging import StagingRing  # torch-only; no CuPy import
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._rings = [StagingRing(device, slots) for _ in range(host_columns)]
        self._kernel_tables = dict(kernel_tables or {})

    @property
    def gathers_on_cpu(self) -> bool:
        """Whether some source's rows are gathered by the CPU into staging (work that leaves the GIL)."""
        return bool(self._rings)

    def follow(self):
        """Order every later batch after the work queued so far on the caller's current stream.

        Called once per loop, on the caller's thread: a device source (or a
        pinned one the kernel reads) written on that stream before the loop
        started is read with those writes. Not per batch: that would make
        each copy wait for the training step queued before it.
        """
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def reads(self, tensor):
        """Mark ``tensor``, made on the caller's stream, as read by the side stream (once suffices).

        When it is freed, the caching allocator waits for the side stream's
        work queued until then before handing its memory out again.
        """
        tensor.record_stream(self._stream)

    def launch(self, columns, ids, device_ids, gathered):
        """Start moving rows ``ids`` of every column to the GPU; returns before the copies finish.

        Args:
            columns: the feeder's source tensors, in order; host ones are
                gathered on the CPU and staged, device ones gathered on the GPU.
            ids: the batch's row ids, a CPU int64 tensor.
            device_ids: the same ids on the GPU, or None: then they are copied
                here when a column is on the GPU or read by a kernel (a
                ``block`` or ``sequential`` epoch's ids are made per batch).
            gathered: ``{column index: CPU tensor}`` of columns whose batch was
                already read (file sources); they are staged whole.

        Returns:
            ``(tensors, event)``: the batch's device tensors and the event that
            fires when they are complete.
        """
        rings = iter(self._rings)
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            if device_ids is None and (self._kernel_tables or any(c.device.type == "cuda" for c in columns)):
                # Through page-locked memory: a copy from pageable memory would make the host wait for
                # the side stream. Made and used on this stream, so freed after its work here.
                device_ids = ids.pin_memory().to(self._device, non_blocking=True)
            out = []
            for k, column in enumerate(columns):
                if column.device.type == "cuda":
                    out.append(torch.index_select(column, 0, device_ids))
                    continue
                target = torch.empty((len(ids), *column.shape[1:]), dtype=column.dtype,
                                     device=self._device)
                if k in self._kernel_tables:  # ids were checked when the epoch was drawn
                    self._kernel_tables[k].gather_validated(device_ids, target.view(len(ids), -1))
                    out.append(target)
                    continue
                if k in gathered:
                    column, rows = gathered[k], torch.arange(len(ids))
                else:
                    rows = ids
                out.append(next(rings).gather(column, rows, target))
            done = torch.cuda.Event()
            done.record(self._stream)
        return tuple(out), done

    def deliver(self, tensors, done):
        """Order the caller's current stream after a batch's copies (no host wait).

        Returns:
            ``tensors``.
        """
        stream = torch.cuda.current_stream(self._device)
        stream.wait_event(done)
        for tensor in tensors:
            tensor.record_stream(stream)
        return tensors
