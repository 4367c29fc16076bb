"""Helpers shared by the cuda backend's tests."""

import pytest

import speedswap as ss
from speedswap.backends.cuda import CudaBackend


def kernels_or_skip():
    """Skip unless the zero-copy kernels can run here (CuPy with a working NVRTC)."""
    problem = CudaBackend.zero_copy_problem()
    if problem is not None:
        pytest.skip(f"the zero-copy kernels cannot run: {problem}")


def make_table(kind, values, tmp_path, backend="cuda"):
    """A table of ``kind`` holding a copy of ``values`` (an ``mmap`` one in ``tmp_path``)."""
    path = tmp_path / "t.npy" if kind == "mmap" else None
    return ss.HostTable.from_numpy(values, storage=kind, backend=backend, path=path)
