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


_BUILDERS = {
    "HostTable": lambda device: ss.HostTable.zeros(4, 2, device=device).device,
    "OffloadedEmbedding": lambda device: ss.OffloadedEmbedding(10, 2, max_rows=4, device=device).weight.device,
    "DataGadget": lambda device: ss.DataGadget(np.ones((4, 2), np.float32), device=device).device,
    "BatchFeeder": lambda device: ss.BatchFeeder(np.ones((4, 2), np.float32), batch_size=2, device=device).device,
}


@pytest.mark.parametrize("build", _BUILDERS.values(), ids=_BUILDERS.keys())
def test_every_object_reads_device_the_same_way(build):
    """device='auto' and devices speedswap does not deliver to, as BatchFeeder has always read them.

    A table, an embedding or a gadget built with device='auto' (as the README's feeder is) raised
    "torch sees no CUDA device here" on a CPU machine, and so did device='mps', 'meta' or a typo
    ('gpu'): BackendUnavailableError there, OptionError on a GPU machine, another message each.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback's warning
        assert build("auto") == ss.get_backend("auto").device
    for device, message in [("mps", "not 'mps'"), ("meta", "not 'meta'"), ("gpu", "got 'gpu'")]:
        with pytest.raises(ss.OptionError, match=message):
            build(device)


def test_numpy_backend_on_a_gpu_device_is_refused_not_moved_to_the_cpu():
    for device in ("cuda", "cuda:1", 0):
        with pytest.raises(ss.OptionError, match="backend='numpy' runs on the CPU"):
            ss.get_backend("numpy", device)
        with pytest.raises(ss.OptionError, match="backend='numpy' runs on the CPU"):
            ss.HostTable.zeros(4, 2, backend="numpy", device=device)
    assert ss.get_backend("numpy", "cpu").device.type == "cpu"


def fake_cgroups(monkeypatch, root, version, line, limits):
    """A cgroup tree under ``root`` for ``/proc/self/cgroup``'s ``line``: ``{path: (limit, usage, inactive)}``."""
    from speedswap.backends import cpu
    key = "inactive_file" if version == "v2" else "total_inactive_file"
    names = ("memory.max", "memory.current") if version == "v2" else ("memory.limit_in_bytes",
                                                                      "memory.usage_in_bytes")
    for path, (limit, usage, inactive) in limits.items():
        directory = root / path
        directory.mkdir(parents=True, exist_ok=True)
        (directory / names[0]).write_text(f"{limit}\n")
        (directory / names[1]).write_text(f"{usage}\n")
        (directory / "memory.stat").write_text(f"active_file 12345\n{key} {inactive}\nunevictable 0\n")
    (root / "cgroup").write_text(line)
    monkeypatch.setattr(cpu, "_PROC_CGROUP", str(root / "cgroup"))
    monkeypatch.setattr(cpu, "_CGROUP_MOUNTS", {version: str(root), ("v1" if version == "v2" else "v2"): str(root / "no")})


@pytest.mark.parametrize("version, line", [("v2", "0::/\n"), ("v1", "5:cpu,cpuacct:/\n4:memory:/\n0::/\n")])
def test_available_ram_is_what_the_containers_memory_limit_still_grants(tmp_path, monkeypatch, version, line):
    """In a container MemAvailable is the host's: a 4 GiB container on a 256 GiB host was told of
    about 200 GiB, so a load staged a table in RAM that the limit kills the process for."""
    from speedswap.backends import cpu
    host = 8 << 30
    monkeypatch.setattr(cpu, "_meminfo_available", lambda: host)  # MemAvailable changes from call to call
    limit, usage, inactive = 3 << 30, 2 << 30, 256 << 20  # reclaimable page cache counts as available
    fake_cgroups(monkeypatch, tmp_path, version, line, {"": (limit, usage, inactive)})
    assert cpu.available_ram() == limit - usage + inactive
    fake_cgroups(monkeypatch, tmp_path, version, line, {"": ("max" if version == "v2" else 2**63 - 4096, 0, 0)})
    assert cpu.available_ram() == host  # no limit
    monkeypatch.setattr(cpu, "_PROC_CGROUP", str(tmp_path / "none"))  # no cgroups to read
    assert cpu.available_ram() == host


@pytest.mark.parametrize("version, line", [("v2", "0::/job_7/step_0\n"), ("v1", "4:memory:/slurm/job_7/step_0\n")])
@pytest.mark.parametrize("tighter", ["own", "ancestor"])
def test_available_ram_counts_the_limits_of_every_cgroup_above_the_process(tmp_path, monkeypatch, version, line,
                                                                           tighter):
    """A Slurm job's limit lies on the job's cgroup, below the root: only the root was read, and a
    job given 8 GiB on a large node was told of the whole node's memory."""
    from speedswap.backends import cpu
    monkeypatch.setattr(cpu, "_meminfo_available", lambda: 64 << 30)
    step = line.strip().split(":")[-1].lstrip("/")
    job = step.rsplit("/", 1)[0]
    own, ancestor = (1 << 30, 0, 0), (8 << 30, 6 << 30, 1 << 29)  # 1 GiB left here, 2.5 GiB at the job
    if tighter == "ancestor":
        own, ancestor = (16 << 30, 2 << 30, 0), ancestor
    root_limit = "max" if version == "v2" else 2**63 - 4096
    fake_cgroups(monkeypatch, tmp_path, version, line, {"": (root_limit, 40 << 30, 0), job: ancestor, step: own})
    assert cpu.available_ram() == (1 << 30 if tighter == "own" else (8 << 30) - (6 << 30) + (1 << 29))
