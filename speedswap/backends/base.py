"""The Backend interface: where table memory comes from and how rows move.

A backend allocates a :class:`Buffer` for a table and moves rows between that
buffer and tensors on its device. Ids and values reach a backend already
validated (see :mod:`speedswap.convert`), so backends only move bytes.
"""

import abc
from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
import torch

__all__ = ["Backend", "Buffer", "STORAGE_KINDS"]

#: Where a table's rows may live. ``pinned``: page-locked host memory;
#: ``mapped``: page-locked and mapped into the device address space
#: (zero-copy); ``pageable``: ordinary host memory; ``mmap``: a ``.npy`` file
#: on disk, paged in on demand (tables larger than RAM); ``device``: memory of
#: the backend's device.
STORAGE_KINDS = ("pinned", "mapped", "pageable", "mmap", "device")


@dataclass
class Buffer:
    """The memory behind one table.

    Attributes:
        kind: the storage kind (one of :data:`STORAGE_KINDS`).
        host: the rows as a numpy array when they live in host memory, else None
            (always None for ``device`` storage, on every backend: host code
            sees a device table through copies only).
        tensor: a torch view of the same memory (never a copy).
        pinned: whether the host memory really is page-locked.
        device_ptr: the address the device reads the rows at (zero-copy
            kinds on the cuda backend), else None.
        pending: kernels that may still read or write the rows, as one event
            per CUDA stream (keyed by the stream's handle) recorded after the
            last kernel queued on that stream; an event covers everything
            queued before it on its stream. Host code waits on all of them
            before touching the rows, and before the memory is freed (cuda
            backend only).
    """

    kind: str
    host: Optional[np.ndarray]
    tensor: torch.Tensor
    pinned: bool = False
    device_ptr: Optional[int] = None
    pending: Dict[int, object] = field(default_factory=dict)


class Backend(abc.ABC):
    """Allocates table memory and moves rows between it and the device.

    Attributes:
        name: ``"numpy"`` or ``"cuda"``.
        device: the torch device that ``gather`` returns tensors on.
    """

    name: str
    device: torch.device

    @classmethod
    @abc.abstractmethod
    def is_available(cls):
        """Whether this backend can run on this machine."""

    @abc.abstractmethod
    def allocate(self, shape, dtype, kind):
        """Allocate uninitialised rows.

        Args:
            shape: ``(num_rows, dim)``.
            dtype: the table's torch dtype; host memory holds
                :func:`~speedswap.convert.numpy_dtype` of it and
                :attr:`Buffer.tensor` views it with
                :func:`~speedswap.convert.host_tensor` (bfloat16 rows are
                uint16 bit patterns on the host).
            kind: one of :data:`STORAGE_KINDS` except ``mmap``.

        Returns:
            Buffer
        """

    @abc.abstractmethod
    def adopt(self, array, kind, dtype=None):
        """Use an existing C-contiguous host array as a table's memory, without copying.

        Args:
            array: a 2-D numpy array (an ``np.memmap`` for ``mmap``).
            kind: ``"mmap"`` or ``"pageable"``.
            dtype: the table's torch dtype when it is not the array's own
                (``torch.bfloat16`` over ``uint16`` bit patterns).

        Returns:
            Buffer
        """

    @abc.abstractmethod
    def gather(self, buffer, rows, out):
        """Copy rows ``rows`` of ``buffer`` into ``out``.

        Args:
            buffer: the table's Buffer.
            rows: validated ids: a contiguous 1-D int64 tensor on :meth:`ids_device`.
            out: a contiguous tensor ``(len(rows), dim)`` on :attr:`device`.

        Returns:
            ``out``. On a GPU the copy is ordered on torch's current stream
            and may not have finished when this returns.
        """

    @abc.abstractmethod
    def scatter(self, buffer, rows, values):
        """Write ``values[i]`` to row ``rows[i]`` of ``buffer``.

        Args:
            buffer: the table's Buffer.
            rows: validated, unique ids: a contiguous 1-D int64 tensor on :meth:`ids_device`.
            values: a contiguous tensor ``(len(rows), dim)`` of the table's dtype on
                :meth:`ids_device`.
        """

    def ids_device(self, buffer):
        """Where :meth:`gather` and :meth:`scatter` want ``buffer``'s row ids and scatter values.

        The backend's device where a kernel or the device moves the rows; the
        CPU where the CPU does (the cuda backend's staged kinds), so that ids
        and values are not sent to the GPU and back.

        Returns:
            torch.device
        """
        return self.device

    def wait_host(self, buffer):
        """Block until asynchronous device work on ``buffer`` is done, before host code reads it.

        The CPU backend has none; the cuda backend waits on every event in
        :attr:`Buffer.pending` (one per stream that ran kernels on the rows).
        """

    def describe(self):
        """A one-line description of the backend and its device."""
        return f"{self.name} on {self.device}"
