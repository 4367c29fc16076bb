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
from speedswap.backends.kernels import (KERNEL_NAMES, KERNEL_SOURCE, LaunchPlan, RowKernels,
                                        check_launch_args, plan_launch, vector_width)

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


# ------------------------------------------------- the launch, through a fake CuPy
class _FakeCupy:
    """Just the CuPy surface RowKernels uses; each launch runs the kernel's loop on the raw addresses.

    Nothing of CuPy is imported: the launch's arguments (pointers, sizes, grid,
    block, stream) are read back exactly as CUDA would receive them, so a
    swapped argument, a Python int where the kernel takes a 64-bit value, or
    the wrong stream shows here without a GPU.
    """

    def __init__(self, current_device):
        self.devices = []  # the Device contexts entered, innermost last
        self.current_device = current_device
        self.launches = []
        self.compiled = []
        fake = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                fake.devices.append(self.index)

            def __exit__(self, *exc):
                fake.devices.pop()

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr

            @classmethod
            def from_external(cls, obj):
                version, ptr = obj.__cuda_stream__()
                assert version == 0 and isinstance(ptr, int)
                return cls(ptr)

        class Runtime:
            @staticmethod
            def getDevice():  # noqa: N802 -- CuPy's name
                return fake.devices[-1] if fake.devices else fake.current_device

        self.cuda = type("cuda", (), {"Device": Device, "Stream": Stream, "runtime": Runtime})

    def RawModule(self, code, options):  # noqa: N802 -- CuPy's name
        assert code == KERNEL_SOURCE and "--std=c++17" in options
        fake = self

        class Kernel:
            def __init__(self, name):
                self.name = name

            @property
            def kernel(self):
                fake.compiled.append((self.name, fake.devices[-1] if fake.devices else None))
                return fake._function(self.name)

        return type("Module", (), {"get_function": lambda _, name: Kernel(name)})()

    def _function(self, name):
        fake = self

        def launch(grid, block, args, shared_mem=0, stream=None):
            fake.launches.append({"name": name, "grid": grid, "block": block, "args": args,
                                  "stream": stream.ptr, "device": fake.cuda.runtime.getDevice()})
            op, _, width = name.split("_")
            table, rows, moved, n, vecs = (int(a) for a in args)
            plan = LaunchPlan(int(width), vecs, grid[0], block[0])
            ids = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(rows))
            table_bytes = (int(ids.max()) + 1) * vecs * plan.width
            _emulate(op, _raw(table, table_bytes), ids, _raw(moved, n * vecs * plan.width), plan)

        return launch


def _raw(address, nbytes):
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


class _TorchStream:
    def __init__(self, handle):
        self.cuda_stream = handle


@pytest.fixture
def fake_kernels(monkeypatch):
    """RowKernels built on a fake CuPy whose device is the CPU (so that CPU tensors pass its checks)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), {"multi_processor_count": 2})())
    fake = _FakeCupy(current_device=None)
    return RowKernels(fake, torch.device("cpu")), fake


@pytest.mark.parametrize("dtype, dim, offset", [(torch.float32, 128, 0), (torch.float32, 3, 1),
                                                (torch.bfloat16, 32, 1), (torch.float16, 7, 0),
                                                (torch.int8, 5, 3)])
def test_the_launch_hands_the_kernel_its_arguments_in_order_and_width(fake_kernels, dtype, dim, offset, rng):
    kernels, fake = fake_kernels
    # Every entry point compiled and loaded inside the device's context.
    assert {name for name, _ in fake.compiled} == set(KERNEL_NAMES.values())
    table = torch.from_numpy(rng.integers(-100, 100, size=(97, dim))).to(dtype)
    expected_table = table.clone()
    ids = torch.from_numpy(rng.integers(0, 97, size=300))
    # `offset` elements into a buffer: an output whose address is not 16-byte aligned.
    out = torch.zeros(300 * dim + offset, dtype=dtype)[offset:].view(300, dim)
    kernels.gather(table, table.data_ptr(), ids, out, _TorchStream(7))
    assert torch.equal(out, table[ids])
    unique = torch.from_numpy(rng.choice(97, size=40, replace=False))
    values = torch.from_numpy(rng.integers(-100, 100, size=(40 * dim + offset,))).to(dtype)[offset:].view(40, dim)
    kernels.scatter(table, table.data_ptr(), unique, values, _TorchStream(7))
    expected_table[unique] = values
    assert torch.equal(table, expected_table)

    for launch, moved in zip(fake.launches, (out, values)):
        args = launch["args"]
        # CuPy passes a numpy scalar by its own size and a Python int as int64: every
        # parameter of the kernels (three pointers, two long longs) takes 8 bytes.
        assert all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in args)
        assert [np.dtype(type(a)).itemsize if isinstance(a, np.generic) else 8 for a in args] == [8] * 5
        assert int(args[1]) != int(args[2]) and int(args[2]) == moved.data_ptr()
        assert isinstance(launch["grid"], tuple) and isinstance(launch["block"], tuple)
        row_bytes = dim * table.element_size()
        width = int(launch["name"].rsplit("_", 1)[1])
        assert row_bytes % width == 0 and moved.data_ptr() % width == 0
        assert launch["stream"] == 7  # torch's stream, not CuPy's current one
    assert [launch["name"].split("_")[0] for launch in fake.launches] == ["gather", "scatter"]


def test_a_launch_from_another_current_device_runs_in_the_kernels_device(fake_kernels, rng):
    kernels, fake = fake_kernels
    table = torch.from_numpy(rng.standard_normal((50, 16)).astype(np.float32))
    ids = torch.arange(10)
    fake.current_device = 3  # the caller's current device is another one
    kernels.gather(table, table.data_ptr(), ids, torch.empty(10, 16), _TorchStream(11))
    fake.current_device = None
    kernels.gather(table, table.data_ptr(), ids, torch.empty(10, 16), _TorchStream(11))
    assert [launch["device"] for launch in fake.launches] == [None, None]
    # One CuPy wrapper per torch stream, made once.
    assert kernels._stream(_TorchStream(11)) is kernels._stream(_TorchStream(11))
    # No ids: nothing is launched (a zero-block grid is an error in CUDA).
    kernels.gather(table, table.data_ptr(), torch.empty(0, dtype=torch.int64), torch.empty(0, 16),
                   _TorchStream(11))
    assert len(fake.launches) == 2
