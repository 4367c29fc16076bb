"""Page-locked staging slots for rows the GPU cannot address in place.

Tables in pageable memory or in a memory-mapped file (and pinned tables when
the zero-copy kernels are not installed), and the feeder's host sources, reach
the GPU through a ring of slots allocated by torch with ``pin_memory=True``:
the CPU gathers rows into a slot and the slot is copied asynchronously. Each
slot has its own event, so a slot is rewritten only after the copy that last
used it finished (FFCV's ring), never after a device-wide synchronize. A
gather larger than a slot's :data:`PIECE_BYTES` goes through the ring in
pieces: the page-locked memory stays bounded, and the CPU fills one slot
while the last one is copied. Needs torch's CUDA build only, not CuPy.

Writes need no ring: the rows to write arrive on the CPU (see
:meth:`~speedswap.backends.base.Backend.ids_device`) and the CPU writes them.
"""

import math
import threading

import torch

__all__ = ["StagingRing", "PIECE_BYTES"]

#: The most bytes a slot holds (unless one row is larger): a slot keeps its page-locked memory for
#: the ring's life, and one sized by the largest gather (an eval read of a whole table) kept that.
PIECE_BYTES = 64 << 20


class StagingRing:
    """Page-locked staging slots for tables the GPU cannot address.

    A slot is reused only after the copy that last read it has finished,
    which is waited for on that slot's event, never on the device. One ring
    serves every table of a backend, so gathers from several threads take
    turns: a slot is filled, copied from and its event recorded by one
    thread at a time (otherwise two threads could fill one slot, or take a
    slot whose event a filling thread has not recorded yet, and each copy
    the other's rows).

    Args:
        device: the CUDA device.
        slots: how many gathers may be in flight at once.
    """

    def __init__(self, device, slots=3):
        self._device = device
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(slots)]
        # One event per slot, re-recorded by every copy out of it: waiting on
        # a slot costs no allocation. Waiting on a never-recorded event returns at once.
        self._events = [torch.cuda.Event() for _ in range(slots)]
        self._next = 0
        self._lock = threading.Lock()

    def _take(self, nbytes, dtype, shape):
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        self._events[i].synchronize()
        if self._buffers[i].numel() < nbytes:
            with torch.cuda.device(self._device):
                self._buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buffers[i][:nbytes].view(dtype).view(shape), self._events[i]

    def gather(self, host, rows, out):
        """CPU-gather ``host[rows]`` into slots, then copy them to ``out`` asynchronously.

        In pieces of at most :data:`PIECE_BYTES`, one slot each.

        Args:
            host: a CPU tensor of rows.
            rows: ids, a 1-D int64 CPU tensor.
            out: a contiguous ``(len(rows), *host.shape[1:])`` tensor of
                ``host``'s dtype on the ring's device.

        Returns:
            ``out``, before the copy has finished; it is ordered on torch's
            current stream of the ring's device.
        """
        row_bytes = math.prod(out.shape[1:]) * out.element_size()
        rows_per_piece = max(1, PIECE_BYTES // max(1, row_bytes))
        with self._lock:
            for start in range(0, len(rows), rows_per_piece):
                part = out[start:start + rows_per_piece]
                staging, event = self._take(part.numel() * part.element_size(), part.dtype, part.shape)
                torch.index_select(host, 0, rows[start:start + rows_per_piece], out=staging)
                part.copy_(staging, non_blocking=True)
                event.record(torch.cuda.current_stream(self._device))
        return out
