"""Helpers shared by the cuda backend's tests."""

import pytest
import torch

import speedswap as ss
from speedswap.backends.base import Buffer
from speedswap.backends.cpu import NumpyBackend
from speedswap.backends.cuda import CudaBackend


def kernels_or_skip():
    """Skip unless the zero-copy kernels can run here (CuPy with a working NVRTC)."""
    problem = CudaBackend.zero_copy_problem()
    if problem is not None:
        pytest.skip(f"the zero-copy kernels cannot run: {problem}")


def device_tables_without_host_memory(monkeypatch):
    """Have the numpy backend allocate ``device`` tables as the cuda backend does on a GPU: no host array.

    Their rows are a torch tensor (on the CPU here) that numpy cannot view, so
    ``to_numpy()`` copies them, as on a GPU, and writes go into the tensor, as
    the cuda backend's ``scatter`` writes a device table's.
    """
    allocate, scatter = NumpyBackend.allocate, NumpyBackend.scatter

    def no_host_for_device(self, shape, dtype, kind):
        if kind != "device":
            return allocate(self, shape, dtype, kind)
        return Buffer(kind=kind, host=None, tensor=torch.empty(shape, dtype=dtype))

    def into_the_tensor(self, buffer, rows, values):
        if buffer.host is not None:
            return scatter(self, buffer, rows, values)
        buffer.tensor.index_copy_(0, rows, values)

    monkeypatch.setattr(NumpyBackend, "allocate", no_host_for_device)
    monkeypatch.setattr(NumpyBackend, "scatter", into_the_tensor)


def make_table(kind, values, tmp_path, backend="cuda"):
    """A table of ``kind`` holding a copy of ``values`` (an ``mmap`` one in ``tmp_path``)."""
    path = tmp_path / "t.npy" if kind == "mmap" else None
    return ss.HostTable.from_numpy(values, storage=kind, backend=backend, path=path)
