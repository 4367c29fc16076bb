"""The cuda backend: real pinned/mapped memory, kernels equal to numpy, ids of any layout.

Tests marked ``gpu`` skip themselves without a CUDA device; those that need
the zero-copy kernels also skip where CuPy or its NVRTC is missing. Streams,
events and memory lifetime are in test_cuda_streams.py; the kernels' PTX and
index arithmetic, which need no GPU, in test_kernels.py.
"""

import contextlib
import gc
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.backends import cuda

from cuda_helpers import kernels_or_skip, make_table

HOST_KINDS = ["pinned", "mapped", "pageable", "mmap", "device"]
NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------- no GPU needed
@pytest.fixture
def fresh_problem_cache():
    cuda._zero_copy_problem.cache_clear()
    yield
    cuda._zero_copy_problem.cache_clear()


def test_without_cupy_zero_copy_names_the_extras(monkeypatch, fresh_problem_cache):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    assert cuda.CudaBackend.zero_copy_problem() == "CuPy is not installed"
    # Past the device check, so that this runs without a GPU too.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ss.BackendUnavailableError,
                       match=r"CuPy is not installed.*speedswap\[cuda12\].*speedswap\[cuda13\]"):
        cuda.CudaBackend(torch.device("cuda", 0), zero_copy=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the missing-GPU error")
def test_no_device_is_refused_before_anything_else():
    with pytest.raises(ss.BackendUnavailableError, match="backend='numpy'"):
        cuda.CudaBackend(torch.device("cuda", 0), zero_copy=False)


class FakeCudart:
    """torch.cuda.cudart()'s host-registration calls, recorded (status: what cudaHostRegister returns)."""

    def __init__(self, status=0):
        self.status, self.registered, self.unregistered = status, {}, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 -- the CUDA runtime's names
        if not self.status:
            self.registered[ptr] = (size, flags)
        return self.status

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, status):  # noqa: N802
        return "out of memory"


@pytest.fixture
def registering_backend(monkeypatch):
    """A zero_copy=False cuda backend whose CUDA runtime is a FakeCudart (no GPU needed)."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    backend = object.__new__(cuda.CudaBackend)  # past __init__'s device and stream set-up
    backend.device, backend.zero_copy = torch.device("cuda", 0), False
    return backend, fake


@pytest.mark.parametrize("kind, flags", [("pinned", 1), ("mapped", 3)])
def test_without_cupy_exactly_the_tables_pages_are_locked_and_unlocked_when_collected(
        registering_backend, kind, flags):
    """Not torch's pinned allocator, which rounds 12,000 bytes up to 16,384 and keeps them after close."""
    backend, fake = registering_backend
    buffer = backend.allocate((1000, 3), torch.float32, kind)
    ptr = buffer.host.ctypes.data
    assert fake.registered == {ptr: (12_000, flags)} and buffer.pinned
    assert ptr % mmap.PAGESIZE == 0  # its own pages: registration locks whole pages
    buffer.tensor[:] = torch.arange(3000, dtype=torch.float32).view(1000, 3)
    view = buffer.host[10:20]
    del buffer
    gc.collect()
    assert fake.unregistered == []  # a view still uses the pages
    assert view[0].tolist() == [30.0, 31.0, 32.0]
    del view
    gc.collect()
    assert fake.unregistered == [ptr]


def test_host_memory_that_cannot_be_locked_raises_a_clear_error(registering_backend):
    backend, fake = registering_backend
    fake.status = 2  # cudaErrorMemoryAllocation
    with pytest.raises(ss.OutOfMemoryError, match=r"page-lock 12,000 bytes.*out of memory.*'pageable'"):
        backend.allocate((1000, 3), torch.float32, "pinned")
    assert fake.registered == {}


# --------------------------------------------------------------- GPU tests
def random_rows(rng, shape, dtype):
    """Random values over the dtype's range (every byte pattern for 1-byte integers)."""
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 40).astype(dtype)


@pytest.mark.gpu
def test_pinned_and_mapped_memory_really_are(tmp_path):
    for kind in ("pinned", "mapped"):
        table = make_table(kind, np.ones((1000, 64), np.float32), tmp_path)
        assert table.pinned and table.as_tensor().is_pinned()
    assert not make_table("pageable", np.ones((10, 4), np.float32), tmp_path).as_tensor().is_pinned()


@pytest.mark.gpu
def test_zero_copy_tables_are_device_mapped(tmp_path):
    kernels_or_skip()
    import cupy
    for kind in ("pinned", "mapped"):
        table = make_table(kind, np.ones((1000, 64), np.float32), tmp_path)
        attrs = cupy.cuda.runtime.pointerGetAttributes(table.to_numpy().ctypes.data)
        assert attrs.type == cupy.cuda.runtime.memoryTypeHost
        assert attrs.devicePointer != 0


@pytest.mark.gpu
def test_ids_live_where_the_rows_are_moved(tmp_path):
    backend = ss.get_backend("cuda")
    cpu = torch.device("cpu")
    for kind in ("pinned", "mapped", "pageable", "device"):
        buffer = backend.allocate((8, 4), torch.float32, kind)
        moved_by_gpu = kind == "device" or (kind != "pageable" and backend.zero_copy)
        assert backend.ids_device(buffer) == (backend.device if moved_by_gpu else cpu), kind
    mapped = np.lib.format.open_memmap(tmp_path / "m.npy", mode="w+", dtype=np.float32, shape=(8, 4))
    assert backend.ids_device(backend.adopt(mapped, "mmap")) == cpu


@pytest.mark.gpu
@pytest.mark.parametrize("kind", HOST_KINDS)
@pytest.mark.parametrize("dtype, dim", [(np.float32, 128), (np.float16, 64), (np.float32, 3),
                                        (np.float16, 7), (np.float64, 33), (np.int8, 5),
                                        (np.uint8, 64)])
def test_gpu_gather_scatter_equal_numpy(kind, dtype, dim, rng, tmp_path):
    values = random_rows(rng, (5000, dim), dtype)
    table = make_table(kind, values, tmp_path)
    ids = rng.integers(0, 5000, size=20_000)
    got = table.gather(torch.from_numpy(ids).cuda())
    assert got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), values[ids])
    unique = rng.choice(5000, size=1500, replace=False)
    new = random_rows(rng, (1500, dim), dtype)
    table.scatter(torch.from_numpy(unique).cuda(), torch.from_numpy(new).cuda())
    values[unique] = new
    np.testing.assert_array_equal(table.to_numpy(), values)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", HOST_KINDS)
@pytest.mark.parametrize("dim", [64, 7])
def test_bfloat16_rows_move_as_bytes(kind, dim, rng, tmp_path):
    source = torch.from_numpy(rng.standard_normal((3000, dim)).astype(np.float32) * 50).bfloat16()
    path = tmp_path / "t.npy" if kind == "mmap" else None
    table = ss.HostTable.empty(3000, dim, dtype="bfloat16", storage=kind, backend="cuda", path=path)
    table.as_tensor().copy_(source)
    ids = torch.from_numpy(rng.integers(0, 3000, size=9000))
    got = table.gather(ids.cuda())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.cpu().view(torch.int16), source[ids].view(torch.int16))
    unique = torch.from_numpy(rng.choice(3000, size=800, replace=False))
    new = torch.from_numpy(rng.standard_normal((800, dim)).astype(np.float32)).bfloat16()
    table.scatter(unique.cuda(), new.cuda())
    source[unique] = new
    assert torch.equal(table.as_tensor().cpu().view(torch.int16), source.view(torch.int16))


def _ids(layout, rng, n, unique):
    """Ids on the GPU in the layouts that once reached the kernel as raw pointers."""
    draw = (lambda k: rng.choice(n, size=k, replace=False)) if unique else (lambda k: rng.integers(0, n, size=k))
    if layout == "strided":  # pairs[:, 0]
        return torch.from_numpy(draw(1000).reshape(500, 2)).cuda()[:, 0]
    if layout == "transposed":
        return torch.from_numpy(draw(600).reshape(30, 20)).cuda().t()
    if layout == "int32":
        return torch.from_numpy(draw(700).astype(np.int32)).cuda()
    assert layout == "expanded" and not unique  # stride 0: one id, repeated
    return torch.tensor(int(draw(1)[0]), device="cuda").expand(400)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", HOST_KINDS)
@pytest.mark.parametrize("layout", ["strided", "transposed", "int32", "expanded"])
def test_ids_of_any_layout_move_the_right_rows(kind, layout, rng, tmp_path):
    n, dim = 2000, 24
    values = rng.standard_normal((n, dim)).astype(np.float32)
    table = make_table(kind, values, tmp_path)
    ids = _ids(layout, rng, n, unique=False)
    got = table.gather(ids)
    assert got.shape == (*ids.shape, dim)
    np.testing.assert_array_equal(got.cpu().numpy(), values[ids.cpu().numpy()])
    if layout == "expanded":
        return  # repeated ids cannot be scattered
    ids = _ids(layout, rng, n, unique=True)
    new = rng.standard_normal((*ids.shape, dim)).astype(np.float32)
    table.scatter(ids, torch.from_numpy(new).cuda())
    values[ids.cpu().numpy().reshape(-1)] = new.reshape(-1, dim)
    np.testing.assert_array_equal(table.to_numpy(), values)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", HOST_KINDS)
@pytest.mark.parametrize("dtype, dim, offset", [(torch.float32, 128, 4), (torch.float16, 64, 2),
                                                (torch.float64, 16, 8), (torch.float32, 3, 4)])
def test_misaligned_out_and_values(kind, dtype, dim, offset, rng, tmp_path):
    n, m = 5000, 700
    values = rng.standard_normal((n, dim)).astype(NUMPY[dtype])
    table = make_table(kind, values, tmp_path)
    nbytes = m * dim * values.itemsize

    def misaligned():
        # Guard bytes either side catch writes past the view.
        raw = torch.full((nbytes + 32,), 0xAB, dtype=torch.uint8, device="cuda")
        view = raw[offset:offset + nbytes].view(dtype).view(m, dim)
        assert view.data_ptr() % 16 != 0
        return raw, view

    ids = rng.integers(0, n, size=m)
    raw, out = misaligned()
    table.gather(torch.from_numpy(ids).cuda(), out=out)
    np.testing.assert_array_equal(out.cpu().numpy(), values[ids])
    guards = torch.cat([raw[:offset], raw[offset + nbytes:]])
    assert bool((guards == 0xAB).all())

    unique = rng.choice(n, size=m, replace=False)
    _, new = misaligned()
    new.copy_(torch.from_numpy(rng.standard_normal((m, dim))).to(dtype))
    table.scatter(torch.from_numpy(unique).cuda(), new)
    values[unique] = new.cpu().numpy()
    np.testing.assert_array_equal(table.to_numpy(), values)


def _available_ram():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


@pytest.mark.gpu
@pytest.mark.slow
def test_a_table_over_two_to_the_31_elements(rng):
    # 3-byte rows move in 1-byte vectors: the kernel's vector index and the
    # byte offset of the last rows both pass 2**31.
    num_rows, dim = (1 << 31) // 3 + 4096, 3
    if _available_ram() < 4 * num_rows * dim:
        pytest.skip("needs about 8 GiB of free host memory")
    table = ss.HostTable.empty(num_rows, dim, dtype="uint8", storage="pinned", backend="cuda")
    host = table.to_numpy()
    edges = [slice(0, 4096), slice(num_rows - 4096, num_rows)]
    for edge in edges:
        host[edge] = rng.integers(0, 256, size=host[edge].shape, dtype=np.uint8)
    ids = np.concatenate([rng.choice(4096, 500, replace=False),
                          num_rows - 1 - rng.choice(4096, 500, replace=False)])
    got = table.gather(torch.from_numpy(ids).cuda())
    np.testing.assert_array_equal(got.cpu().numpy(), host[ids])
    expected = [host[edge].copy() for edge in edges]
    new = rng.integers(0, 256, size=(len(ids), dim), dtype=np.uint8)
    table.scatter(torch.from_numpy(ids).cuda(), torch.from_numpy(new).cuda())
    expected[0][ids[:500]] = new[:500]
    expected[1][ids[500:] - (num_rows - 4096)] = new[500:]
    host = table.to_numpy()
    for edge, want in zip(edges, expected):
        np.testing.assert_array_equal(host[edge], want)
    table.close()


@pytest.mark.gpu
def test_ids_on_the_gpu_and_the_cpu_give_the_same_rows(rng, tmp_path):
    values = rng.standard_normal((300, 16)).astype(np.float32)
    table = make_table("pinned", values, tmp_path)
    ids = rng.integers(0, 300, size=(4, 50))
    a = table.gather(ids)
    b = table.gather(torch.from_numpy(ids).cuda())
    assert a.shape == (4, 50, 16)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ss.IdError):
        table.gather(torch.tensor([300], device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
@pytest.mark.parametrize("kind", HOST_KINDS)
def test_tables_on_a_second_gpu(kind, rng, tmp_path):
    backend = ss.get_backend("cuda", "cuda:1")
    assert backend.device == torch.device("cuda", 1) and backend is not ss.get_backend("cuda", 0)
    values = rng.standard_normal((4000, 32)).astype(np.float32)
    with torch.cuda.device(0):  # the caller's current device is another one
        table = make_table(kind, values, tmp_path, backend=backend)
        ids = rng.integers(0, 4000, size=6000)
        got = table.gather(torch.from_numpy(ids).to("cuda:1"))
        assert got.device == torch.device("cuda", 1)
        np.testing.assert_array_equal(got.cpu().numpy(), values[ids])
        unique = rng.choice(4000, size=1000, replace=False)
        new = rng.standard_normal((1000, 32)).astype(np.float32)
        table.scatter(torch.from_numpy(unique).to("cuda:1"), torch.from_numpy(new).to("cuda:1"))
    values[unique] = new
    np.testing.assert_array_equal(table.to_numpy(), values)


@pytest.mark.gpu
def test_the_staged_backend_needs_no_cupy(seed):
    """zero_copy=False: every kind round-trips with torch alone, and CuPy is never imported."""
    script = f"""
import sys, numpy as np, torch, speedswap as ss
from speedswap.backends.cuda import CudaBackend
backend = CudaBackend(torch.device("cuda", 0), zero_copy=False)
rng = np.random.default_rng({seed})
for kind in ("pinned", "mapped", "pageable", "device"):
    values = rng.standard_normal((3000, 40)).astype(np.float32)
    table = ss.HostTable.from_numpy(values, storage=kind, backend=backend)
    assert table.pinned == table.as_tensor().is_pinned() == (kind in ("pinned", "mapped")), kind
    ids = rng.integers(0, 3000, size=5000)
    assert np.array_equal(table.gather(torch.from_numpy(ids).cuda()).cpu().numpy(), values[ids]), kind
    unique = rng.choice(3000, 1000, replace=False)
    new = rng.standard_normal((1000, 40)).astype(np.float32)
    table.scatter(torch.from_numpy(unique).cuda(), torch.from_numpy(new).cuda())
    values[unique] = new
    assert np.array_equal(table.to_numpy(), values), kind
assert "cupy" not in sys.modules, "zero_copy=False imported CuPy"
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.gpu
def test_pinned_host_ids_are_copied_as_they_were_at_the_call(rng):
    """Ids the caller holds in page-locked memory cross as they were when the call returned.

    ``Tensor.pin_memory()`` returns an already pinned tensor itself, not a
    copy, so an asynchronous copy straight from the caller's buffer reads it
    only when the stream gets there: a caller refilling the buffer for the
    next step (the usual reuse of a pinned ids buffer) would have the table
    read, or written, at ids that were never range-checked.
    """
    from speedswap.convert import as_row_ids
    n = 1000
    values = rng.standard_normal((n, 8)).astype(np.float32)
    table = ss.HostTable.from_numpy(values, storage="device", backend="cuda")
    for gather in (False, True):
        ids = torch.from_numpy(rng.integers(1, n, size=4096)).pin_memory()
        assert ids.is_pinned()
        expected = ids.clone()
        torch.cuda._sleep(100_000_000)  # the stream is busy: the ids' copy waits behind it
        got = table.gather(ids) if gather else as_row_ids(ids, n, torch.device("cuda"))[0]
        ids.fill_(0)  # the caller reuses its buffer (still in range: a wrong row, not a fault)
        if gather:
            np.testing.assert_array_equal(got.cpu().numpy(), values[expected.numpy()])
        else:
            assert torch.equal(got.cpu(), expected)
