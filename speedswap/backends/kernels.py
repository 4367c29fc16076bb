"""CUDA kernels that gather and scatter table rows through unified addressing.

The table may live in page-locked host memory: the kernels read and write it
directly over the bus (zero-copy), so no staging copy and no host thread is
involved. Rows are moved as opaque bytes in the widest vector type (16, 8, 4,
2 or 1 bytes) that the row length and every pointer's alignment allow, so one
kernel serves every dtype (bfloat16 included) and a 512-byte float32 row is
one warp of 16-byte loads. Reads go through the read-only data path
(``__ldg``, ``ld.global.nc``): nothing writes the source while a kernel runs.

The launch arithmetic (:func:`plan_launch`) is plain Python so that the test
suite can emulate the kernels on the CPU with exactly the numbers the launcher
uses. CuPy is handed in by the cuda backend; this module never imports it.
"""

from typing import NamedTuple

import numpy as np
import torch

from ..errors import DeviceError, DTypeError, ShapeError

__all__ = ["RowKernels", "KERNEL_SOURCE", "KERNEL_NAMES", "LaunchPlan", "vector_width", "plan_launch",
           "check_launch_args"]

_VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

# Element i of the flattened (len(rows), vecs) output is vector i % vecs of
# table row rows[i / vecs]. 64-bit indices throughout: a table may hold more
# than 2**31 vectors.
_TEMPLATES = r"""
template <typename V>
__device__ __forceinline__ void gather_rows(const V* __restrict__ table,
                                            const long long* __restrict__ rows,
                                            V* __restrict__ out,
                                            long long n, long long vecs) {
    const long long total = n * vecs;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / vecs;
        out[i] = __ldg(table + __ldg(rows + r) * vecs + (i - r * vecs));
    }
}

template <typename V>
__device__ __forceinline__ void scatter_rows(V* __restrict__ table,
                                             const long long* __restrict__ rows,
                                             const V* __restrict__ values,
                                             long long n, long long vecs) {
    const long long total = n * vecs;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long r = i / vecs;
        table[__ldg(rows + r) * vecs + (i - r * vecs)] = __ldg(values + i);
    }
}
"""

_ENTRY = r"""
extern "C" __global__ void gather_rows_{w}(const {t}* __restrict__ table,
                                           const long long* __restrict__ rows,
                                           {t}* __restrict__ out, long long n, long long vecs) {{
    gather_rows<{t}>(table, rows, out, n, vecs);
}}
extern "C" __global__ void scatter_rows_{w}({t}* __restrict__ table,
                                            const long long* __restrict__ rows,
                                            const {t}* __restrict__ values, long long n,
                                            long long vecs) {{
    scatter_rows<{t}>(table, rows, values, n, vecs);
}}
"""

#: The whole CUDA source, compiled at run time by CuPy with NVRTC (and by the
#: test suite with NVRTC where the library is installed, GPU or not).
KERNEL_SOURCE = _TEMPLATES + "".join(_ENTRY.format(w=w, t=t) for w, t in _VECTOR_TYPES.items())

#: Names of the compiled entry points, by operation and vector width.
KERNEL_NAMES = {(op, w): f"{op}_rows_{w}" for op in ("gather", "scatter") for w in _VECTOR_TYPES}

_THREADS = 256


class LaunchPlan(NamedTuple):
    """How one gather or scatter is launched.

    Attributes:
        width: bytes per vector the kernel moves (16, 8, 4, 2 or 1).
        vecs: vectors per row.
        blocks: grid size; the kernel's grid-stride loop covers the rest.
        threads: threads per block.
    """

    width: int
    vecs: int
    blocks: int
    threads: int


def vector_width(row_bytes: int, *pointers: int) -> int:
    """The widest vector (bytes) dividing the row length and every pointer.

    Args:
        row_bytes: bytes per row.
        pointers: addresses the kernel indexes in vectors (table row 0, the
            device tensor).

    Returns:
        16, 8, 4, 2 or 1.
    """
    for width in _VECTOR_TYPES:
        if row_bytes % width == 0 and all(p % width == 0 for p in pointers):
            return width
    return 1


def plan_launch(num_ids: int, row_bytes: int, pointers, max_blocks: int) -> LaunchPlan:
    """The launch of a kernel moving ``num_ids`` rows of ``row_bytes`` bytes.

    Args:
        num_ids: rows to move (at least 1).
        row_bytes: bytes per row.
        pointers: the table's and the device tensor's addresses.
        max_blocks: the most blocks worth launching on the device.

    Returns:
        LaunchPlan
    """
    width = vector_width(row_bytes, *pointers)
    vecs = row_bytes // width
    blocks = max(1, min(max_blocks, -(-num_ids * vecs // _THREADS)))
    return LaunchPlan(width, vecs, blocks, _THREADS)


def _describe(tensor):
    return (f"{tensor.dtype} of shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
            f"on {tensor.device}")


def check_launch_args(table: torch.Tensor, rows: torch.Tensor, tensor: torch.Tensor,
                      device: torch.device, what: str) -> None:
    """Refuse any argument whose raw pointer a row kernel would misread.

    The kernels see bare addresses: a strided, broadcast (stride 0) or int32
    id tensor, or a tensor on another device, would make them read the wrong
    rows or write outside the table. The table layer hands over validated ids;
    this is the last check before the pointers leave torch.

    Args:
        table: the table's rows as a host tensor (dtype and row length).
        rows: the row ids: must be a contiguous 1-D int64 tensor on ``device``.
        tensor: ``out`` of a gather or ``values`` of a scatter: must be a
            contiguous ``(len(rows), dim)`` tensor of the table's dtype on ``device``.
        device: the device the kernel runs on.
        what: ``"out"`` or ``"values"``, for messages.

    Raises:
        DTypeError, ShapeError, DeviceError: naming the argument and what it must be.
    """
    if rows.dtype != torch.int64:
        raise DTypeError(f"row ids reaching the kernel must be int64, got {_describe(rows)}; "
                         f"convert them with .long() (HostTable.gather/scatter do)")
    if rows.dim() != 1 or not rows.is_contiguous():
        raise ShapeError(f"row ids reaching the kernel must be a contiguous 1-D tensor, got "
                         f"{_describe(rows)}; pass ids.reshape(-1).contiguous()")
    if rows.device != device or tensor.device != device:
        raise DeviceError(f"the kernel runs on {device} but the ids are on {rows.device} and "
                          f"{what} on {tensor.device}; move them with .to({str(device)!r})")
    if tensor.dtype != table.dtype:
        raise DTypeError(f"{what} has dtype {tensor.dtype}, the table holds {table.dtype}")
    expected = (rows.numel(), table.shape[1])
    if tuple(tensor.shape) != expected or not tensor.is_contiguous():
        raise ShapeError(f"{what} must be a contiguous tensor of shape {expected}, got "
                         f"{_describe(tensor)}; pass a fresh tensor or .contiguous()")
    if not table.is_contiguous():
        raise ShapeError(f"the table's rows must be contiguous in memory, got {_describe(table)}")


class _StreamHandle:
    """A raw ``cudaStream_t`` offered through the CUDA stream protocol.

    torch streams implement ``__cuda_stream__`` only in recent releases; this
    works with every torch this package supports.
    """

    __slots__ = ("_handle",)

    def __init__(self, handle):
        self._handle = handle

    def __cuda_stream__(self):
        return (0, self._handle)


class RowKernels:
    """The compiled gather/scatter kernels of one device.

    Compiles :data:`KERNEL_SOURCE` with NVRTC and loads every entry point on
    ``device`` when built, so a missing or broken runtime compiler shows here
    and not at the first gather.

    Args:
        cupy: the imported cupy module (imported by the cuda backend only).
        device: the CUDA device the kernels run on.

    Raises:
        Exception: whatever CuPy raised compiling or loading the module (the
            cuda backend turns it into ``BackendUnavailableError``).
    """

    def __init__(self, cupy, device: torch.device):
        self._cupy = cupy
        self.device = device
        self._index = device.index
        with cupy.cuda.Device(self._index):
            module = cupy.RawModule(code=KERNEL_SOURCE, options=("--std=c++17",))
            # RawKernel.kernel compiles and loads the module for the current
            # device; keeping the loaded functions spares a lookup per launch.
            self._functions = {key: module.get_function(name).kernel
                               for key, name in KERNEL_NAMES.items()}
        # Enough resident blocks to keep many bus requests in flight; the
        # grid-stride loop covers the rest.
        self._max_blocks = torch.cuda.get_device_properties(device).multi_processor_count * 8
        # CuPy >= 14 deprecates ExternalStream (it warns on every construction).
        self._from_external = getattr(cupy.cuda.Stream, "from_external", None)
        self._streams = {}

    def _stream(self, stream):
        """CuPy's wrapper of the torch stream ``stream``, made once per stream."""
        handle = stream.cuda_stream
        wrapper = self._streams.get(handle)
        if wrapper is None:
            if self._from_external is not None:
                wrapper = self._from_external(_StreamHandle(handle))
            else:
                wrapper = self._cupy.cuda.ExternalStream(handle, self._index)
            self._streams[handle] = wrapper
        return wrapper

    def _launch(self, op, table, table_ptr, rows, tensor, stream):
        check_launch_args(table, rows, tensor, self.device, "out" if op == "gather" else "values")
        n = rows.numel()
        if n == 0:
            return
        row_bytes = table.shape[1] * table.element_size()
        plan = plan_launch(n, row_bytes, (table_ptr, tensor.data_ptr()), self._max_blocks)
        function = self._functions[(op, plan.width)]
        args = (np.uint64(table_ptr), np.uint64(rows.data_ptr()), np.uint64(tensor.data_ptr()),
                np.int64(n), np.int64(plan.vecs))
        wrapper = self._stream(stream)
        # The loaded function belongs to this device's context: switch only
        # when the caller's current device is another one.
        if self._cupy.cuda.runtime.getDevice() == self._index:
            function((plan.blocks,), (plan.threads,), args, stream=wrapper)
        else:
            with self._cupy.cuda.Device(self._index):
                function((plan.blocks,), (plan.threads,), args, stream=wrapper)

    def gather(self, table, table_ptr, rows, out, stream):
        """Launch ``out[i] = table[rows[i]]`` on ``stream``.

        Args:
            table: the table's rows as a host tensor (dtype and row length).
            table_ptr: device-visible address of row 0.
            rows: ids, a contiguous 1-D int64 tensor on :attr:`device`.
            out: a contiguous ``(len(rows), dim)`` tensor of the table's dtype
                on :attr:`device`.
            stream: the torch stream to launch on.

        Raises:
            DTypeError, ShapeError, DeviceError: an argument the kernel would misread.

        Note: asynchronous; the rows are in ``out`` once the stream reaches it.
        """
        self._launch("gather", table, table_ptr, rows, out, stream)

    def scatter(self, table, table_ptr, rows, values, stream):
        """Launch ``table[rows[i]] = values[i]`` on ``stream``.

        Arguments as :meth:`gather`, ``values`` in place of ``out``; ``rows``
        must be unique.

        Note: asynchronous; host code must wait for the stream before reading
        the rows (the cuda backend records an event for that).
        """
        self._launch("scatter", table, table_ptr, rows, values, stream)
