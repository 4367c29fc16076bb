"""The row kernels without a GPU: NVRTC's PTX, the index arithmetic, the launch checks.

CuPy compiles :data:`KERNEL_SOURCE` with NVRTC at run time, so the test
compiles it with NVRTC too (the ``nvidia-cuda-nvrtc-cu12`` wheel, or a CUDA
toolkit's libnvrtc; skipped where neither is installed). The kernels' loop is
emulated in numpy with the launcher's own :func:`plan_launch`.
"""

import ctypes
import ctypes.util
import importlib.util
import os
import re

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.backends.kernels import (KERNEL_NAMES, KERNEL_SOURCE, check_launch_args,
                                        plan_launch, vector_width)

# The PTX type suffix each vector width must load and store with.
PTX_SUFFIX = {16: "v4.u32", 8: "v2.u32", 4: "u32", 2: "u16", 1: "u8"}


def test_vector_width_follows_row_size_and_alignment():
    assert vector_width(512, 0, 4096) == 16
    assert vector_width(24, 0, 0) == 8
    assert vector_width(512, 0, 4100) == 4
    assert vector_width(6, 0, 0) == 2
    assert vector_width(3, 0, 0) == 1
    assert vector_width(512, 8, 4096) == 8


# ----------------------------------------------------------------- NVRTC
def _nvrtc_library():
    """libnvrtc from NVIDIA's wheels (CUDA 12 or 13 layout) or the system, or None."""
    candidates = []
    for package, soname in (("nvidia.cuda_nvrtc", "libnvrtc.so.12"), ("nvidia.cu13", "libnvrtc.so.13")):
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            candidates += [os.path.join(root, "lib", soname) for root in spec.submodule_search_locations]
    system = ctypes.util.find_library("nvrtc")
    if system:
        candidates.append(system)
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _compile_ptx(lib, source, options):
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"rows.cu", 0, None, None) == 0
    try:
        encoded = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        size = ctypes.c_size_t()
        if status != 0:
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            pytest.fail(f"NVRTC could not compile KERNEL_SOURCE:\n{log.value.decode()}")
        assert lib.nvrtcGetPTXSize(program, ctypes.byref(size)) == 0
        ptx = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetPTX(program, ptx) == 0
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def test_kernel_source_compiles_with_nvrtc_to_vector_loads_and_stores():
    lib = _nvrtc_library()
    if lib is None:
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12)")
    ptx = _compile_ptx(lib, KERNEL_SOURCE, ["--gpu-architecture=compute_90", "--std=c++17"])
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n}", ptx, re.S))
    assert set(bodies) == set(KERNEL_NAMES.values())
    for (op, width), name in KERNEL_NAMES.items():
        memory_ops = [line.split()[0] for line in bodies[name].splitlines()
                      if "ld.global" in line or "st.global" in line]
        suffix = PTX_SUFFIX[width]
        # The moved rows: one read-only (non-coherent) vector load and one vector store.
        assert f"ld.global.nc.{suffix}" in memory_ops, (name, memory_ops)
        assert f"st.global.{suffix}" in memory_ops, (name, memory_ops)
        # Every global load, the ids included, takes the read-only path.
        assert all(o.startswith("ld.global.nc") for o in memory_ops if o.startswith("ld.")), memory_ops


# ------------------------------------------------------------- emulation
def _aligned_bytes(nbytes, misalign):
    """A uint8 array whose address is ``misalign`` past a 16-byte boundary."""
    raw = np.empty(nbytes + 32, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16 + misalign
    return raw[start:start + nbytes]


def _emulate(op, table_bytes, rows, moved_bytes, plan):
    """Run the kernel's grid-stride loop for every thread of ``plan`` in numpy.

    ``table_bytes`` and ``moved_bytes`` (``out`` or ``values``) are flat uint8
    arrays, indexed in vectors of ``plan.width`` bytes exactly as the kernel
    indexes them. Returns how often each output vector was visited.
    """
    table_v = table_bytes.reshape(-1, plan.width)
    moved_v = moved_bytes.reshape(-1, plan.width)
    total = len(rows) * plan.vecs
    stride = plan.blocks * plan.threads
    visits = np.zeros(total, dtype=np.int64)
    i = np.arange(stride, dtype=np.int64)  # each thread's first index
    while (live := i[i < total]).size:
        r = live // plan.vecs
        source = rows[r] * plan.vecs + (live - r * plan.vecs)
        if op == "gather":
            moved_v[live] = table_v[source]
        else:
            table_v[source] = moved_v[live]
        np.add.at(visits, live, 1)
        i += stride
    return visits


ODD_ROWS = [(np.float16, 7), (np.float64, 33), (np.int8, 5), (np.float32, 3), (np.float32, 128)]


@pytest.mark.parametrize("dtype, dim", ODD_ROWS)
@pytest.mark.parametrize("misalign", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("max_blocks", [1, 2, 1 << 20])
def test_emulated_kernels_equal_numpy_fancy_indexing(dtype, dim, misalign, max_blocks, rng):
    num_rows, n = 97, 300
    itemsize = np.dtype(dtype).itemsize
    row_bytes = dim * itemsize
    table_bytes = _aligned_bytes(num_rows * row_bytes, 0)
    table_bytes[:] = rng.integers(0, 256, size=table_bytes.size, dtype=np.uint8)
    table = table_bytes.view(dtype).reshape(num_rows, dim)
    rows = rng.integers(0, num_rows, size=n)
    out_bytes = _aligned_bytes(n * row_bytes, misalign)
    out_bytes[:] = rng.integers(0, 256, size=out_bytes.size, dtype=np.uint8)

    plan = plan_launch(n, row_bytes, (table_bytes.ctypes.data, out_bytes.ctypes.data), max_blocks)
    assert row_bytes % plan.width == 0 and out_bytes.ctypes.data % plan.width == 0
    assert plan.blocks <= max_blocks
    visits = _emulate("gather", table_bytes, rows, out_bytes, plan)
    assert (visits == 1).all()
    np.testing.assert_array_equal(out_bytes.reshape(n, row_bytes), table_bytes.reshape(num_rows, row_bytes)[rows])

    unique = rng.choice(num_rows, size=40, replace=False)
    values_bytes = _aligned_bytes(40 * row_bytes, misalign)
    values_bytes[:] = rng.integers(0, 256, size=values_bytes.size, dtype=np.uint8)
    expected = table.copy()
    expected[unique] = values_bytes.view(dtype).reshape(40, dim)
    plan = plan_launch(40, row_bytes, (table_bytes.ctypes.data, values_bytes.ctypes.data), max_blocks)
    visits = _emulate("scatter", table_bytes, unique, values_bytes, plan)
    assert (visits == 1).all()
    np.testing.assert_array_equal(table.view(np.uint8), expected.view(np.uint8))


def test_grid_is_capped_and_covers_every_row():
    plan = plan_launch(10, 512, (0, 0), max_blocks=1000)
    assert (plan.width, plan.vecs) == (16, 32)
    assert plan.blocks * plan.threads >= 10 * 32 and plan.blocks == 2
    assert plan_launch(10**9, 512, (0, 0), max_blocks=1056).blocks == 1056


# ---------------------------------------------------------- launch checks
CPU = torch.device("cpu")


def _table(dim=4, dtype=torch.float32):
    return torch.zeros(10, dim, dtype=dtype)


@pytest.mark.parametrize("make_rows, error", [
    (lambda: torch.arange(12).reshape(6, 2)[:, 0], ss.ShapeError),          # pairs[:, 0]: stride 2
    (lambda: torch.tensor([3]).expand(6), ss.ShapeError),                    # stride 0
    (lambda: torch.arange(6).reshape(2, 3).t(), ss.ShapeError),              # transposed
    (lambda: torch.arange(6).reshape(2, 3), ss.ShapeError),                  # not flattened
    (lambda: torch.arange(6, dtype=torch.int32), ss.DTypeError),
])
def test_launch_refuses_ids_the_kernel_would_misread(make_rows, error):
    rows = make_rows()
    out = torch.empty(rows.numel(), 4)
    with pytest.raises(error, match="row ids reaching the kernel"):
        check_launch_args(_table(), rows, out, CPU, "out")


def test_launch_refuses_a_bad_out_or_device():
    rows = torch.arange(6)
    table = _table()
    with pytest.raises(ss.DTypeError, match="out has dtype torch.float64"):
        check_launch_args(table, rows, torch.empty(6, 4, dtype=torch.float64), CPU, "out")
    with pytest.raises(ss.ShapeError, match=r"values must be a contiguous tensor of shape \(6, 4\)"):
        check_launch_args(table, rows, torch.empty(4, 6).t(), CPU, "values")
    with pytest.raises(ss.ShapeError, match=r"shape \(6, 4\)"):
        check_launch_args(table, rows, torch.empty(6, 5), CPU, "out")
    with pytest.raises(ss.DeviceError, match="the kernel runs on meta"):
        check_launch_args(table, rows, torch.empty(6, 4), torch.device("meta"), "out")
    # The contiguous int64 ids and out that HostTable hands over pass.
    check_launch_args(table, rows, torch.empty(6, 4), CPU, "out")
    check_launch_args(_table(dtype=torch.bfloat16), rows, torch.empty(6, 4, dtype=torch.bfloat16),
                      CPU, "values")
