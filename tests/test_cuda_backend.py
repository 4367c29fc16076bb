"""The cuda backend: real pinned/mapped memory, kernels equal to the CPU result, no races.

Tests marked ``gpu`` skip themselves without a CUDA device and CuPy. The
kernels' PTX and index arithmetic, which need no GPU, are in test_kernels.py.
"""

import gc
import weakref

import numpy as np
import pytest
import torch

import speedswap as ss

HOST_KINDS = ["pinned", "mapped", "pageable", "mmap", "device"]


def _table(kind, values, tmp_path):
    path = tmp_path / "t.npy" if kind == "mmap" else None
    return ss.HostTable.from_numpy(values, storage=kind, backend="cuda", path=path)


@pytest.mark.gpu
def test_pinned_and_mapped_memory_really_are(tmp_path):
    import cupy
    for kind in ("pinned", "mapped"):
        table = _table(kind, np.ones((1000, 64), np.float32), tmp_path)
        assert table.pinned
        attrs = cupy.cuda.runtime.pointerGetAttributes(table.to_numpy().ctypes.data)
        assert attrs.type == cupy.cuda.runtime.memoryTypeHost
        assert attrs.devicePointer != 0
    assert not _table("pageable", np.ones((10, 4), np.float32), tmp_path).pinned


@pytest.mark.gpu
@pytest.mark.parametrize("kind", HOST_KINDS)
@pytest.mark.parametrize("dtype, dim", [(np.float32, 128), (np.float16, 64), (np.float32, 3),
                                        (np.float16, 7), (np.float64, 33)])
def test_gpu_gather_scatter_equal_cpu(kind, dtype, dim, rng, tmp_path):
    values = rng.standard_normal((5000, dim)).astype(dtype)
    gpu = _table(kind, values, tmp_path)
    cpu = ss.HostTable.from_numpy(values, storage="pageable", backend="numpy")
    ids = rng.integers(0, 5000, size=20_000)
    got = gpu.gather(torch.from_numpy(ids).cuda())
    assert got.is_cuda
    np.testing.assert_array_equal(got.cpu().numpy(), cpu.gather(ids).numpy())
    unique = rng.choice(5000, size=1500, replace=False)
    new = rng.standard_normal((1500, dim)).astype(dtype)
    gpu.scatter(unique, torch.from_numpy(new).cuda())
    cpu.scatter(unique, new)
    np.testing.assert_array_equal(gpu.to_numpy(), cpu.to_numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pinned", "mapped", "pageable"])
def test_no_stream_races_over_many_rounds(kind, rng, tmp_path):
    """Gather, modify on the GPU, scatter back, round after round, on a non-default stream."""
    values = rng.standard_normal((20_000, 32)).astype(np.float32)
    table = _table(kind, values, tmp_path)
    reference = torch.from_numpy(values.copy()).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(200):
            ids = torch.from_numpy(rng.choice(20_000, size=2048, replace=False)).cuda()
            rows = table.gather(ids)
            rows.mul_(0.5).add_(1.0)
            table.scatter(ids, rows, check_unique=False)
            reference[ids] = reference[ids] * 0.5 + 1.0
    np.testing.assert_allclose(table.to_numpy(), reference.cpu().numpy(), rtol=0, atol=0)


@pytest.mark.gpu
def test_pinned_memory_is_released_on_close(tmp_path):
    table = _table("pinned", np.ones((1 << 16, 64), np.float32), tmp_path)
    memory = weakref.ref(table._buffer.host.base.mem)  # the cupy PinnedMemory block
    table.close()
    gc.collect()
    assert memory() is None


@pytest.mark.gpu
def test_ids_on_the_gpu_and_the_cpu_give_the_same_rows(rng, tmp_path):
    values = rng.standard_normal((300, 16)).astype(np.float32)
    table = _table("pinned", values, tmp_path)
    ids = rng.integers(0, 300, size=(4, 50))
    a = table.gather(ids)
    b = table.gather(torch.from_numpy(ids).cuda())
    assert a.shape == (4, 50, 16)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ss.IdError):
        table.gather(torch.tensor([300], device="cuda"))
