"""CUDA kernels that gather and scatter table rows through unified addressing.

The table may live in page-locked host memory: the kernels read and write it
directly over the bus (zero-copy), so no staging copy and no host thread is
involved. Rows are moved as opaque bytes in the widest vector type (16, 8, 4,
2 or 1 bytes) that the row length and every pointer's alignment allow, so one
kernel serves every dtype and a 512-byte float32 row is one warp of 16-byte loads.
"""

import numpy as np

__all__ = ["RowKernels", "KERNEL_SOURCE", "vector_width"]

_VECTOR_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

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
        out[i] = table[rows[r] * vecs + (i - r * vecs)];
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
        table[rows[r] * vecs + (i - r * vecs)] = values[i];
    }
}
"""

_ENTRY = r"""
extern "C" __global__ void gather_rows_{w}(const {t}* table, const long long* rows, {t}* out,
                                           long long n, long long vecs) {{
    gather_rows<{t}>(table, rows, out, n, vecs);
}}
extern "C" __global__ void scatter_rows_{w}({t}* table, const long long* rows, const {t}* values,
                                            long long n, long long vecs) {{
    scatter_rows<{t}>(table, rows, values, n, vecs);
}}
"""

#: The whole CUDA source (also compiled by the test suite with nvcc when present).
KERNEL_SOURCE = _TEMPLATES + "".join(_ENTRY.format(w=w, t=t) for w, t in _VECTOR_TYPES.items())

_THREADS = 256


def vector_width(row_bytes, *pointers):
    """The widest vector (bytes) dividing the row length and every pointer."""
    for width in _VECTOR_TYPES:
        if row_bytes % width == 0 and all(p % width == 0 for p in pointers):
            return width
    return 1


class RowKernels:
    """The compiled gather/scatter kernels of one device.

    Args:
        cupy: the imported cupy module (imported by the cuda backend only).
        device_index: the CUDA device the kernels run on.
    """

    def __init__(self, cupy, device_index):
        self._cupy = cupy
        self._device_index = device_index
        with cupy.cuda.Device(device_index):
            self._module = cupy.RawModule(code=KERNEL_SOURCE, options=("-std=c++17",))
            attrs = cupy.cuda.runtime.getDeviceProperties(device_index)
        # Enough resident blocks to keep many bus requests in flight; the
        # grid-stride loop covers the rest.
        self._max_blocks = attrs["multiProcessorCount"] * 8

    def _launch(self, op, table_ptr, rows, tensor, row_bytes, stream_ptr):
        n = rows.numel()
        if n == 0:
            return
        width = vector_width(row_bytes, table_ptr, tensor.data_ptr())
        vecs = row_bytes // width
        blocks = max(1, min(self._max_blocks, -(-n * vecs // _THREADS)))
        kernel = self._module.get_function(f"{op}_rows_{width}")
        cupy = self._cupy
        with cupy.cuda.Device(self._device_index), cupy.cuda.ExternalStream(stream_ptr):
            kernel((blocks,), (_THREADS,),
                   (np.uint64(table_ptr), np.uint64(rows.data_ptr()), np.uint64(tensor.data_ptr()),
                    np.int64(n), np.int64(vecs)))

    def gather(self, table_ptr, rows, out, row_bytes, stream_ptr):
        """Launch ``out[i] = table[rows[i]]`` on the stream ``stream_ptr``.

        Args:
            table_ptr: device-visible address of row 0.
            rows: int64 ids on the device.
            out: contiguous device tensor receiving the rows.
            row_bytes: bytes per row.
            stream_ptr: the raw ``cudaStream_t`` to launch on.

        Note: asynchronous; the rows are in ``out`` once the stream reaches it.
        """
        self._launch("gather", table_ptr, rows, out, row_bytes, stream_ptr)

    def scatter(self, table_ptr, rows, values, row_bytes, stream_ptr):
        """Launch ``table[rows[i]] = values[i]`` on the stream ``stream_ptr``.

        Note: asynchronous; host code must wait for the stream before reading
        the rows (the cuda backend records an event for that).
        """
        self._launch("scatter", table_ptr, rows, values, row_bytes, stream_ptr)
