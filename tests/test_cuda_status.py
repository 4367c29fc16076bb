"""`info()` says why the cuda backend cannot run, not only that it does not."""

import pytest
import torch

import speedswap as ss
from speedswap.backends import resolve


def test_cpu_build_of_torch_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    status = resolve.cuda_status()
    assert status.startswith("no:") and "CPU build" in status and torch.__version__ in status


def test_cuda_build_without_a_device_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    status = resolve.cuda_status()
    assert "CUDA 12.8" in status and "no CUDA device" in status and "CUDA_VISIBLE_DEVICES" in status


@pytest.mark.skipif("cuda" in ss.available_backends(), reason="this machine has a GPU")
def test_info_carries_the_status():
    assert ss.info()["cuda"] == resolve.cuda_status()
    assert ss.info()["cuda"].startswith("no:")
