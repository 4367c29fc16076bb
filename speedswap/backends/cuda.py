"""The GPU backend: page-locked host tables read by CUDA kernels, or staged copies.

CuPy is imported here and nowhere else, and only when this backend is built.
Transport by storage kind:

* ``pinned`` / ``mapped``: the table is page-locked host memory from
  ``cudaHostAlloc``. Under unified addressing the GPU reads and writes it in
  place, so :class:`~speedswap.backends.cuda_kernels.RowKernels` move the rows
  straight between the table and device tensors (zero-copy): one kernel per
  gather or scatter, no host thread, no staging copy.
* ``pageable`` / ``mmap``: the GPU cannot address that memory, so the CPU
  gathers rows into a page-locked staging slot and the slot is copied
  asynchronously (:class:`StagingRing`), and writes scattered rows itself.
  Ids and values stay on the CPU (:meth:`CudaBackend.ids_device`).
* ``device``: the table is a CUDA tensor; rows move with ``index_select`` /
  ``index_copy_``.

Everything is ordered on torch's current stream. Nothing calls a device-wide
synchronize: host code that touches a table after kernels used it waits on
that table's own events, one per stream (:meth:`CudaBackend.wait_host`), and
so does the release of its memory.
"""

import weakref

import numpy as np
import torch

from ..convert import host_tensor, numpy_dtype, torch_dtype
from ..errors import BackendUnavailableError
from .base import Backend, Buffer
from .kernels import RowKernels
from .staging import StagingRing

__all__ = ["CudaBackend"]

_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_MAPPED = 2
_CPU = torch.device("cpu")
_INSTALL_HINT = ("install CuPy for your CUDA version: pip install 'speedswap[cuda12]' "
                 "or 'speedswap[cuda13]'")


def _wait_all(pending):
    """Wait for every event in ``pending`` (one per stream), then forget them."""
    for event in list(pending.values()):
        event.synchronize()
    pending.clear()


def _release_after_pending(array, pending):
    """Make the release of ``array``'s memory wait for the kernels in ``pending``.

    The finalizer runs when ``array`` (the one array whose base is the
    page-locked block) is collected, before numpy drops its reference to the
    block, so kernels still queued on any stream finish before the memory goes
    back to the driver: a table collected without ``close()`` right after a
    gather is safe. It holds ``pending`` only, never the array or the Buffer.
    """
    finalizer = weakref.finalize(array, _wait_all, pending)
    # At interpreter exit the process's memory goes away with it; waiting
    # then would only risk a CUDA call during teardown.
    finalizer.atexit = False


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(f"the cuda backend needs CuPy, which is not installed; "
                                      f"{_INSTALL_HINT}") from exc
    return cupy


class CudaBackend(Backend):
    """Tables in page-locked host memory (or on the GPU), rows moved by CUDA kernels.

    Args:
        device: CUDA device index; the current device when None.

    Raises:
        BackendUnavailableError: no CUDA device, or CuPy is missing.
    """

    name = "cuda"

    @classmethod
    def is_available(cls):
        if not torch.cuda.is_available():
            return False
        try:
            import cupy
        except ImportError:
            return False
        return bool(cupy.is_available())

    def __init__(self, device=None):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the cuda backend needs a CUDA device and a CUDA build "
                                          "of torch; none is visible here. Use backend='numpy' "
                                          "(or 'auto', which falls back to it)")
        self._cupy = _import_cupy()
        index = torch.cuda.current_device() if device is None else int(device)
        self.device = torch.device("cuda", index)
        self._kernels = RowKernels(self._cupy, self.device)
        self._staging = StagingRing(self.device)

    def describe(self):
        return f"cuda on {self.device} ({torch.cuda.get_device_name(self.device)})"

    def allocate(self, shape, dtype, kind):
        if kind == "device":
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            return Buffer(kind=kind, host=None, tensor=tensor)
        host_dtype = numpy_dtype(dtype)
        if kind == "pageable":
            array = np.empty(shape, dtype=host_dtype)
            return Buffer(kind=kind, host=array, tensor=host_tensor(array, dtype))
        cupy = self._cupy
        nbytes = int(np.prod(shape)) * host_dtype.itemsize
        flags = _HOST_ALLOC_PORTABLE | (_HOST_ALLOC_MAPPED if kind == "mapped" else 0)
        with cupy.cuda.Device(self.device.index):
            # PinnedMemory (not the pooled alloc_pinned_memory) so that the
            # memory goes back to the driver when the last view of it dies.
            memory = cupy.cuda.PinnedMemory(nbytes, flags)
            pointer = cupy.cuda.PinnedMemoryPointer(memory, 0)
            array = np.ndarray(shape, dtype=host_dtype, buffer=pointer)
            # Under unified addressing every cudaHostAlloc block is device
            # visible at its host address; ask the driver for mapped memory
            # so that this also holds where the address differs.
            device_ptr = (cupy.cuda.runtime.pointerGetAttributes(pointer.ptr).devicePointer
                          if kind == "mapped" else pointer.ptr)
        buffer = Buffer(kind=kind, host=array, tensor=host_tensor(array, dtype), pinned=True,
                        device_ptr=device_ptr)
        _release_after_pending(array, buffer.pending)
        return buffer

    def adopt(self, array, kind, dtype=None):
        return Buffer(kind=kind, host=array, tensor=host_tensor(array, dtype or torch_dtype(array.dtype)))

    def ids_device(self, buffer):
        """The GPU for ``device`` and kernel-moved buffers, the CPU for staged ones."""
        if buffer.kind == "device" or buffer.device_ptr is not None:
            return self.device
        return _CPU

    def _record(self, buffer, stream):
        # One event per (table, stream), re-recorded: an event marks
        # everything queued before it on its stream, and no event is created
        # per launch.
        event = buffer.pending.get(stream.cuda_stream)
        if event is None:
            event = buffer.pending[stream.cuda_stream] = torch.cuda.Event()
        event.record(stream)

    def wait_host(self, buffer):
        """Block until every kernel queued on ``buffer``, on any stream, has finished."""
        _wait_all(buffer.pending)

    def gather(self, buffer, rows, out):
        if buffer.kind == "device":
            return torch.index_select(buffer.tensor, 0, rows, out=out)
        if buffer.device_ptr is None:
            return self._staging.gather(buffer.tensor, rows, out)
        stream = torch.cuda.current_stream(self.device)
        self._kernels.gather(buffer.tensor, buffer.device_ptr, rows, out, stream)
        if len(rows):
            self._record(buffer, stream)
        return out

    def scatter(self, buffer, rows, values):
        if buffer.device_ptr is None:
            # A device table gets ids and values on the GPU, a staged one on
            # the CPU (ids_device): either way one write where the rows live.
            buffer.tensor.index_copy_(0, rows, values)
            return
        stream = torch.cuda.current_stream(self.device)
        self._kernels.scatter(buffer.tensor, buffer.device_ptr, rows, values, stream)
        if len(rows):
            self._record(buffer, stream)
