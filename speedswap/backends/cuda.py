"""The GPU backend: page-locked host tables read by CUDA kernels, or staged copies.

One instance per CUDA device (:mod:`~speedswap.backends.resolve` keeps them);
every stream, event and context it uses is that device's. Transport by
storage kind:

* ``pinned`` / ``mapped`` with ``zero_copy=True``: the table is page-locked
  host memory from ``cudaHostAlloc`` (through CuPy). Under unified addressing
  the GPU reads and writes it in place, so
  :class:`~speedswap.backends.kernels.RowKernels` move the rows straight
  between the table and device tensors: one kernel per gather or scatter, no
  host thread, no staging copy. Ids and values live on the GPU.
* ``pinned`` / ``mapped`` with ``zero_copy=False`` (no CuPy): anonymous host
  memory of exactly the table's size, page-locked with ``cudaHostRegister``
  (torch's pinned allocator would round it up to a power of two and keep it
  after the table is closed), moved like ``pageable``.
* ``pageable`` / ``mmap`` (and the above): the CPU gathers rows into a
  page-locked staging slot copied asynchronously (:class:`StagingRing`), and
  writes scattered rows itself. Ids and values live on the CPU.
* ``device``: the table is a CUDA tensor; rows move with ``index_select`` /
  ``index_copy_``.

Everything is ordered on torch's current stream of the backend's device.
Nothing calls a device-wide synchronize: host code that touches a table after
kernels used it waits on that table's own events, one per stream
(:meth:`CudaBackend.wait_host`), and so does the release of its memory. A
``device`` table's memory is torch's: its tensor is recorded for each stream
that moves its rows (``record_stream``), so the caching allocator hands the
memory out again only after the work those streams queued before its release.
"""

import ctypes
import functools
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from ..convert import host_tensor, numpy_dtype, torch_dtype
from ..errors import BackendUnavailableError, OutOfMemoryError
from .base import Backend, Buffer
from .cpu import anonymous_array
from .kernels import RowKernels
from .staging import StagingRing

__all__ = ["CudaBackend"]

# cudaHostAllocPortable / cudaHostAllocMapped, the same bits as cudaHostRegisterPortable / Mapped.
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_MAPPED = 2
_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_CPU = torch.device("cpu")
_INSTALL_HINT = ("install CuPy >= 14 with the CUDA runtime and NVRTC from the package index: "
                 "pip install 'speedswap[cuda12]' or 'speedswap[cuda13]' (matching your CUDA "
                 "version)")
# The smallest program NVRTC can compile: loading the library and its
# builtins is what fails on a broken install, not our source.
_PROBE_SOURCE = 'extern "C" __global__ void speedswap_probe() {}'


def _nvrtc_problem(cupy) -> Optional[str]:
    """Why CuPy's NVRTC cannot compile a kernel, or None when it can."""
    nvrtc = cupy.cuda.nvrtc
    try:
        program = nvrtc.createProgram(_PROBE_SOURCE, "probe.cu", (), ())
        try:
            nvrtc.compileProgram(program, ())
        finally:
            nvrtc.destroyProgram(program)
    except Exception as exc:  # missing library, missing builtins, version mismatch, ...
        return f"CuPy cannot load NVRTC, its runtime compiler ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def _zero_copy_problem() -> Optional[str]:
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name != "cupy":
            return f"CuPy cannot import {exc.name!r}"
        return "CuPy is not installed"
    except Exception as exc:  # CuPy wraps a broken CUDA install in ImportError, others vary
        return f"CuPy is installed but fails to import ({type(exc).__name__}: {exc})"
    if not cupy.is_available():
        return ("CuPy is installed but sees no CUDA device (a CuPy build for another CUDA "
                "major version, or a driver too old for it?)")
    return _nvrtc_problem(cupy)


# Guards every Buffer.pending: a feeder's reader thread records kernels on a table while
# the training thread may wait on it. Re-entrant: the finalizer of a collected table
# waits on its events, and collection can happen inside _record on the same thread.
_PENDING_LOCK = threading.RLock()


def _wait_all(pending):
    """Wait for every event in ``pending`` (one per stream), then forget them."""
    with _PENDING_LOCK:  # an event recorded meanwhile is either in the list or left pending
        events = list(pending.values())
        pending.clear()
    for event in events:
        event.synchronize()


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


def _clear_last_cuda_error():
    """Reset the runtime's last error after a failed call, as CuPy does after each failure.

    Left set, the next ``cudaGetLastError`` torch makes after a kernel launch
    would report it as that kernel's failure. torch exposes no binding for
    it; its CUDA runtime is loaded with global symbols, so the process can
    call it directly. Where it cannot, the error stays set: nothing else to do.
    """
    try:
        ctypes.CDLL(None).cudaGetLastError()
    except (AttributeError, OSError):
        pass


def _unregister_when_collected(array, cudart):
    """Unlock ``array``'s pages (``cudaHostUnregister``) when it is collected, before they are unmapped.

    Only the CPU touches a registered table (rows are staged), so no kernel
    can still be using the pages. ``array`` owns its mapping: every view
    keeps it alive.
    """
    finalizer = weakref.finalize(array, cudart.cudaHostUnregister, array.ctypes.data)
    finalizer.atexit = False  # the process's memory goes with it; no CUDA call during teardown


class CudaBackend(Backend):
    """Tables in page-locked host memory (or on the GPU), rows moved by CUDA kernels or staged.

    Args:
        device: the CUDA device, with its index (resolve.py validates it).
        zero_copy: move ``pinned``/``mapped`` rows with the CuPy kernels
            (compiled here, on ``device``); False uses torch alone and never
            imports CuPy.

    Raises:
        BackendUnavailableError: no CUDA device; or ``zero_copy`` and CuPy,
            its NVRTC, or the kernels' compilation is missing or broken.
    """

    name = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        """Whether torch sees a CUDA device (CuPy is optional: see :meth:`zero_copy_problem`)."""
        return torch.cuda.is_available()

    @classmethod
    def zero_copy_problem(cls) -> Optional[str]:
        """Why the zero-copy kernels cannot run here, or None when they can.

        Checked once per process: CuPy imports, sees a device, and its
        runtime compiler (NVRTC) compiles a kernel.

        Returns:
            None, or a short reason such as ``"CuPy is not installed"``.
        """
        return _zero_copy_problem()

    def __init__(self, device: torch.device, *, zero_copy: bool):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the cuda backend needs a CUDA device and a CUDA build "
                                          "of torch; none is visible here. Use backend='numpy' "
                                          "(or 'auto', which falls back to it)")
        self.device = torch.device(device)
        self.zero_copy = bool(zero_copy)
        self._cupy = None
        self._kernels = None
        if self.zero_copy:
            problem = self.zero_copy_problem()
            if problem is not None:
                raise BackendUnavailableError(f"the zero-copy kernels cannot run: {problem}; "
                                              f"{_INSTALL_HINT}, or use zero_copy=False")
            import cupy
            try:
                self._kernels = RowKernels(cupy, self.device)
            except Exception as exc:  # NVRTC or driver failures come in many types
                raise BackendUnavailableError(
                    f"CuPy could not compile or load the row kernels on {self.device} "
                    f"({type(exc).__name__}: {exc}); {_INSTALL_HINT}, or use "
                    f"zero_copy=False") from exc
            self._cupy = cupy
        self._staging = StagingRing(self.device)

    def describe(self):
        transport = "zero-copy kernels" if self.zero_copy else "staged copies (no CuPy kernels)"
        return f"cuda on {self.device} ({torch.cuda.get_device_name(self.device)}), {transport}"

    def allocate(self, shape, dtype, kind):
        if kind == "device":
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            return Buffer(kind=kind, host=None, tensor=tensor)
        host_dtype = numpy_dtype(dtype)
        if kind == "pageable":
            array = np.empty(shape, dtype=host_dtype)
            return Buffer(kind=kind, host=array, tensor=host_tensor(array, dtype))
        flags = _HOST_ALLOC_PORTABLE | (_HOST_ALLOC_MAPPED if kind == "mapped" else 0)
        if not self.zero_copy:
            return self._allocate_registered(shape, host_dtype, flags, kind, dtype)
        nbytes = int(np.prod(shape)) * host_dtype.itemsize
        return self._allocate_zero_copy(shape, host_dtype, nbytes, flags, kind, dtype)

    def _allocate_registered(self, shape, host_dtype, flags, kind, dtype):
        # Not torch.empty(pin_memory=True): torch's caching host allocator rounds every
        # block up to a power of two (a 40 GiB table would lock 64 GiB) and keeps it
        # after the table is closed. This locks exactly the table's own pages.
        array = anonymous_array(shape, host_dtype)
        if array.nbytes:
            cudart = torch.cuda.cudart()
            with torch.cuda.device(self.device):
                status = cudart.cudaHostRegister(array.ctypes.data, array.nbytes, flags)
            if int(status):
                _clear_last_cuda_error()
                raise OutOfMemoryError(
                    f"could not page-lock {array.nbytes:,} bytes of host memory for a {kind} table "
                    f"(cudaHostRegister: {cudart.cudaGetErrorString(status)}); use storage='pageable' "
                    f"or 'mmap', or free host memory (the locked-memory limit is `ulimit -l`)")
            _unregister_when_collected(array, cudart)
        return Buffer(kind=kind, host=array, tensor=host_tensor(array, dtype), pinned=True)

    def _allocate_zero_copy(self, shape, host_dtype, nbytes, flags, kind, dtype):
        cupy = self._cupy
        with cupy.cuda.Device(self.device.index):
            # PinnedMemory (not the pooled alloc_pinned_memory) so that the
            # memory goes back to the driver when the last view of it dies.
            try:
                memory = cupy.cuda.PinnedMemory(nbytes, flags)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                if exc.status != _CUDA_ERROR_MEMORY_ALLOCATION:
                    raise
                raise MemoryError(f"cudaHostAlloc of {nbytes:,} bytes: {exc}") from exc  # HostTable says more
            pointer = cupy.cuda.PinnedMemoryPointer(memory, 0)
            # Under unified addressing the host address is the device address
            # of any cudaHostAlloc block; asking the driver also covers mapped
            # memory where the two differ.
            device_ptr = cupy.cuda.runtime.pointerGetAttributes(pointer.ptr).devicePointer
        array = np.ndarray(shape, dtype=host_dtype, buffer=pointer)
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
        with _PENDING_LOCK:
            event = buffer.pending.get(stream.cuda_stream)
            if event is None:
                event = buffer.pending[stream.cuda_stream] = torch.cuda.Event()
            event.record(stream)

    def _launch(self, kernel, buffer, rows, data):
        """Queue a zero-copy ``kernel`` (with ``data``: a gather's ``out``, a scatter's values)
        on ``buffer``'s host rows and record it, as one step.

        Under the lock :meth:`wait_host` takes: a wait on another thread between
        the launch and its record would miss the kernel, and its caller read
        host rows the kernel still writes, or free the memory under it.
        """
        stream = torch.cuda.current_stream(self.device)
        with _PENDING_LOCK:
            kernel(buffer.tensor, buffer.device_ptr, rows, data, stream)
            if len(rows):
                self._record(buffer, stream)

    def wait_host(self, buffer):
        """Block until every kernel queued on ``buffer``, on any stream, has finished."""
        _wait_all(buffer.pending)

    def _record_device(self, buffer):
        # Freed, a device table's block goes back to the stream that made it, which takes it
        # again at once unless the streams that used it were recorded: a prefetch's write-back
        # on the cache's side stream would then write rows into an unrelated tensor. Cheap
        # on the stream that made it: the allocator returns at once.
        buffer.tensor.record_stream(torch.cuda.current_stream(self.device))

    def gather(self, buffer, rows, out):
        if buffer.kind == "device":
            self._record_device(buffer)
            return torch.index_select(buffer.tensor, 0, rows, out=out)
        if buffer.device_ptr is None:
            return self._staging.gather(buffer.tensor, rows, out)
        self._launch(self._kernels.gather, buffer, rows, out)
        return out

    def scatter(self, buffer, rows, values):
        if buffer.device_ptr is None:
            # A device table gets ids and values on the GPU, a staged one on
            # the CPU (ids_device): either way one write where the rows live.
            if buffer.kind == "device":
                self._record_device(buffer)
            buffer.tensor.index_copy_(0, rows, values)
            return
        self._launch(self._kernels.scatter, buffer, rows, values)
