"""Benchmark plumbing: the machine's description, interleaved timing, text tables, JSON.

Every benchmark warms up, times repeats, reports the median with its spread,
compares contenders side by side in one run (as ratios), and writes JSON that
records the machine and how loaded it was.

>>> summary = time_interleaved({"sum": lambda: sum(range(100))}, repeats=3, warmup=1)["sum"]
>>> summary["repeats"], summary["min_s"] <= summary["median_s"] <= summary["max_s"]
(3, True)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

import speedswap as ss
from speedswap.atomic import atomic_output, saving_error

__all__ = ["machine", "available_ram", "physical_ram", "load_average", "time_interleaved", "time_one", "summarize",
           "format_table", "write_text", "write_json"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_smi(query: str) -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _sysconf_bytes(pages: str) -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(pages)
    except (ValueError, OSError):
        return None


def available_ram() -> int:
    """Bytes of RAM free for new allocations now, within the memory limit of the process's container.

    speedswap's own reading (:func:`speedswap.info`): ``MemAvailable`` is the
    host's, and a benchmark sized by it in a container runs past the limit,
    which kills it rather than refuse.
    """
    return ss.info()["ram_available_bytes"]


def physical_ram() -> Optional[int]:
    """Bytes of RAM this machine has (``SC_PHYS_PAGES``), or None where the platform does not say."""
    return _sysconf_bytes("SC_PHYS_PAGES")


def load_average() -> Optional[list]:
    """The 1, 5 and 15 minute load averages: other work on the machine skews every figure."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    """A description of this machine and its load, for results files.

    Returns:
        dict with the date, CPU model, cores, RAM, load average, the Python,
        numpy, torch and speedswap versions, and, where torch sees a GPU, its
        name, memory, driver, CUDA version, PCIe link, the CuPy version and
        whether pinned tables move by the zero-copy kernels (``cuda_backend``).
    """
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": physical_ram(),
        "ram_available_bytes": available_ram(),
        "load_average": load_average(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "speedswap": ss.__version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=properties.name, gpu_memory_bytes=properties.total_memory,
                    driver=_nvidia_smi("driver_version"), cuda=torch.version.cuda,
                    pcie_link=_nvidia_smi("pcie.link.gen.current,pcie.link.width.current"))
        try:
            import cupy
            info["cupy"] = cupy.__version__
        except ImportError:
            info["cupy"] = None
        # Without working CuPy kernels pinned tables are staged: say which path was measured.
        info["cuda_backend"] = ss.info()["cuda"]
    return info


def time_interleaved(fns: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 3,
                     cuda: bool = False) -> dict:
    """Time several functions side by side, one call of each per round.

    Interleaving spreads drift (turbo, page cache, a noisy neighbour) evenly
    over all contenders, so their ratios are fairer than back-to-back runs.

    Args:
        fns: ``{name: fn}``; each ``fn()`` does one unit of work.
        repeats: rounds timed.
        warmup: rounds run first and discarded (allocator, caches, kernel compilation).
        cuda: time with CUDA events on torch's current stream, so work a
            call leaves queued on the GPU is counted; otherwise wall time.

    Returns:
        ``{name: summary}`` as :func:`summarize` returns.

    Raises:
        OptionError: ``repeats`` below 1 (no sample to take a median of) or a negative ``warmup``.
    """
    # Checked before any call: a median of no samples fails only after the warm-up's work.
    if repeats < 1 or warmup < 0:
        raise ss.OptionError(f"repeats must be at least 1 and warmup at least 0 (rounds to time and to "
                             f"discard first), got repeats={repeats!r}, warmup={warmup!r}")
    once = _cuda_once if cuda else _wall_once
    for _ in range(warmup):
        for fn in fns.values():
            once(fn)
    samples = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(repeats):
        # Rotate who goes first so no contender always follows the same one.
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(once(fns[name]))
    return {name: summarize(values) for name, values in samples.items()}


def time_one(fn: Callable[[], Any], *, repeats: int, warmup: int = 3, cuda: bool = False) -> dict:
    """:func:`time_interleaved` of a single function; returns its summary."""
    return time_interleaved({"fn": fn}, repeats=repeats, warmup=warmup, cuda=cuda)["fn"]


def _wall_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cuda_once(fn: Callable[[], Any]) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1000.0


def summarize(samples: Sequence[float]) -> dict:
    """``{"median_s", "min_s", "max_s", "repeats"}`` of timings in seconds."""
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "repeats": len(samples)}


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` (dicts) as an aligned text table of ``columns``; floats to 4 significant digits."""
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(cell.ljust(w) if i == 0 or n == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_text(path: os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically, creating its directory.

    A results file is replaced whole or not at all: a run stopped, or a disk
    filled, mid-write leaves the previous file as it was, never half of one.

    Args:
        path: the file.
        text: its new contents.

    Returns:
        The path written.

    Raises:
        PathError: the directory cannot be created or the file system refused the write.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise saving_error(path, exc) from exc
    with atomic_output(path) as tmp, open(tmp, "w") as f:
        f.write(text)
    return path


def write_json(path: os.PathLike, name: str, payload: Mapping[str, Any]) -> Path:
    """Write ``{"benchmark": name, "machine": machine(), **payload}`` to ``path``, atomically.

    Args:
        path: the ``.json`` file (its directory is created).
        name: the benchmark's name.
        payload: the figures.

    Returns:
        The path written.

    Raises:
        PathError: as :func:`write_text`.
    """
    return write_text(path, json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2))
