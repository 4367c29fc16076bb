"""Backend selection, the CPU fallback, and the errors when CUDA cannot run."""

import sys
import warnings

import pytest
import torch

import speedswap as ss
from speedswap import backends


def test_numpy_is_always_available():
    assert "numpy" in ss.available_backends()
    assert ss.get_backend("numpy").device == torch.device("cpu")


def test_backend_instances_are_shared():
    assert ss.get_backend("numpy") is ss.get_backend("numpy")
    assert ss.get_backend(ss.get_backend("numpy")) is ss.get_backend("numpy")


def test_unknown_backend_is_refused():
    with pytest.raises(ss.OptionError, match="unknown backend 'tpu'"):
        ss.get_backend("tpu")


@pytest.mark.skipif("cuda" in ss.available_backends(), reason="tests the fallback")
def test_auto_falls_back_to_numpy_with_one_warning(monkeypatch):
    monkeypatch.setattr(backends, "_warned_fallback", False)
    with pytest.warns(RuntimeWarning, match="numpy backend"):
        assert ss.get_backend("auto").name == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ss.get_backend("auto").name == "numpy"


@pytest.mark.skipif("cuda" in ss.available_backends(), reason="tests the missing-GPU error")
def test_cuda_without_device_names_the_fix():
    with pytest.raises(ss.BackendUnavailableError, match="backend='numpy'") as info:
        ss.get_backend("cuda")
    assert isinstance(info.value, RuntimeError)


def test_cuda_without_cupy_names_the_extra(monkeypatch):
    from speedswap.backends import cuda as cuda_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    assert not cuda_backend.CudaBackend.is_available()
    with pytest.raises(ss.BackendUnavailableError, match=r"speedswap\[cuda12\].*speedswap\[cuda13\]"):
        cuda_backend.CudaBackend()
