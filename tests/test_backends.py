"""Backend selection, the CPU fallback, and the errors when CUDA cannot run."""

import warnings

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.backends import resolve


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
    monkeypatch.setattr(resolve, "_warned", set())
    with pytest.warns(RuntimeWarning, match="numpy backend.*--device cpu"):
        assert ss.get_backend("auto").name == "numpy"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ss.get_backend("auto").name == "numpy"


@pytest.mark.skipif("cuda" in ss.available_backends(), reason="tests the fallback")
def test_the_fallback_warning_names_the_users_line_however_deep_the_call(monkeypatch):
    for build in (lambda: ss.HostTable.empty(3, 3), lambda: ss.OffloadedEmbedding(5, 2, max_rows=2),
                  lambda: ss.DataGadget(np.ones((3, 2), np.float32)).read()):
        monkeypatch.setattr(resolve, "_warned", set())
        with pytest.warns(RuntimeWarning, match="numpy backend") as caught:
            build()
        assert [w.filename for w in caught] == [__file__]


@pytest.mark.skipif("cuda" in ss.available_backends(), reason="tests the missing-GPU error")
def test_cuda_without_device_names_the_fix():
    with pytest.raises(ss.BackendUnavailableError, match="no CUDA device.*backend='numpy'") as info:
        ss.get_backend("cuda")
    assert isinstance(info.value, RuntimeError)


@pytest.mark.skipif("cuda" in ss.available_backends(), reason="tests the missing-GPU error")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda")])
def test_auto_with_a_cuda_device_named_is_refused_without_a_gpu(device):
    """A CUDA device asked for by name is not silently replaced by the CPU (only ``auto`` alone falls back)."""
    with pytest.raises(ss.BackendUnavailableError, match="no CUDA device.*backend='numpy'"):
        ss.get_backend("auto", device=device)
    with pytest.raises(ss.BackendUnavailableError, match="no CUDA device"):
        ss.OffloadedEmbedding(10, 2, max_rows=4, device=device)


def test_auto_on_cpu_device_is_numpy_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ss.get_backend("auto", device="cpu").name == "numpy"
        assert ss.get_backend("numpy", device="cpu") is ss.get_backend("numpy")


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_the_cpu_named_with_an_index_is_the_cpu_everywhere(device):
    """torch reads 'cpu:0' as the CPU, and so did resolve_device (a BatchFeeder), but get_backend did
    not: with 'auto' it said no CUDA device was here (a GPU machine: 'not cpu:0'), and 'numpy'
    refused it as another device, so no table or embedding could be built on it."""
    from speedswap.backends import resolve_device
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ss.get_backend("auto", device=device) is ss.get_backend("numpy", device=device) is ss.get_backend("numpy")
        assert ss.HostTable.zeros(4, 2, storage="pageable", device=device).backend.name == "numpy"
    assert resolve_device(device) == ss.get_backend("numpy").device


def test_resolve_device_agrees_with_get_backend():
    from speedswap.backends import resolve_device
    assert resolve_device("cpu") == torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resolve_device("auto") == ss.get_backend("auto").device
    with pytest.raises(ss.OptionError, match="not 'meta'"):
        resolve_device("meta")
    with pytest.raises(ss.OptionError, match="'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("gpu0")


def test_numpy_backend_on_a_gpu_device_is_refused_not_moved_to_the_cpu():
    for device in ("cuda", "cuda:1", 0):
        with pytest.raises(ss.OptionError, match="backend='numpy' runs on the CPU"):
            ss.get_backend("numpy", device)
        with pytest.raises(ss.OptionError, match="backend='numpy' runs on the CPU"):
            ss.HostTable.zeros(4, 2, backend="numpy", device=device)
    assert ss.get_backend("numpy", "cpu").device.type == "cpu"


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_available_ram_is_what_the_containers_memory_limit_still_grants(tmp_path, monkeypatch, version):
    """In a container MemAvailable is the host's: a 4 GiB container on a 256 GiB host was told of
    about 200 GiB, so a load staged a table in RAM that the limit kills the process for."""
    from speedswap.backends import cpu
    limit, usage, inactive = 3 << 30, 2 << 30, 256 << 20  # reclaimable page cache counts as available
    stat_key = "inactive_file" if version == "v2" else "total_inactive_file"
    (tmp_path / "limit").write_text(f"{limit}\n")
    (tmp_path / "usage").write_text(f"{usage}\n")
    (tmp_path / "stat").write_text(f"active_file 12345\n{stat_key} {inactive}\nunevictable 0\n")
    files = (str(tmp_path / "limit"), str(tmp_path / "usage"), str(tmp_path / "stat"), stat_key)
    missing = (str(tmp_path / "none"),) * 3 + ("inactive_file",)
    monkeypatch.setattr(cpu, "_CGROUP_FILES", (files, missing) if version == "v2" else (missing, files))
    host = 8 << 30
    monkeypatch.setattr(cpu, "_meminfo_available", lambda: host)  # MemAvailable changes from call to call
    assert cpu.available_ram() == min(host, limit - usage + inactive)
    (tmp_path / "limit").write_text("max\n" if version == "v2" else f"{2**63 - 4096}\n")  # no limit
    assert cpu.available_ram() == host
    monkeypatch.setattr(cpu, "_CGROUP_FILES", (missing, missing))  # not in a cgroup with memory files
    assert cpu.available_ram() == host
