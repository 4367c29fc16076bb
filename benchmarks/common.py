"""Shared benchmark plumbing: the machine's description, timing, tables, JSON.

Benchmarks are scripts, not tests. Each one warms up, times repeats, reports
medians with their spread, compares side by side in one run, and writes JSON
with :func:`machine` into ``benchmarks/results/``.
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


def _cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_smi(query):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine():
    """A description of this machine for the results file."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "gpu": None,
    }
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["driver"] = _nvidia_smi("driver_version")
        info["pcie_link"] = _nvidia_smi("pcie.link.gen.current,pcie.link.width.current")
        try:
            import cupy
            info["cupy"] = cupy.__version__
        except ImportError:
            info["cupy"] = None
    return info


def time_cpu(fn, repeats=20, warmup=3):
    """Median and spread (min, max) of ``fn()``'s wall time in seconds."""
    return time_interleaved({"fn": fn}, repeats, warmup, timer=_cpu_once)["fn"]


def time_cuda(fn, repeats=20, warmup=3):
    """Median and spread of ``fn()``'s GPU time, measured with CUDA events."""
    return time_interleaved({"fn": fn}, repeats, warmup, timer=_cuda_once)["fn"]


def time_interleaved(fns, repeats=20, warmup=3, timer=None):
    """Time several functions side by side, one call of each per round.

    Interleaving spreads drift (turbo, page cache, a noisy neighbour) evenly
    over all contenders, so their ratios are fairer than back-to-back runs.

    Args:
        fns: ``{name: fn}``.
        repeats: rounds timed.
        warmup: rounds run first and discarded.
        timer: ``time_cpu`` or ``time_cuda``-style single-shot timer; by
            default wall time, or CUDA events when CUDA is available.

    Returns:
        ``{name: summary}`` as :func:`summarize` returns.
    """
    timer = timer or (_cuda_once if torch.cuda.is_available() else _cpu_once)
    for _ in range(warmup):
        for fn in fns.values():
            timer(fn)
    samples = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(repeats):
        # Rotate who goes first so no contender always follows the same one.
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            samples[name].append(timer(fns[name]))
    return {name: summarize(values) for name, values in samples.items()}


def _cpu_once(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cuda_once(fn):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1000.0


def summarize(samples):
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "repeats": len(samples)}


def print_table(rows, columns):
    """Print ``rows`` (a list of dicts) as an aligned text table of ``columns``."""
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(cell.ljust(w) if i == 0 or n == 0 else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_results(name, payload):
    """Write ``payload`` plus the machine description to ``results/<name>-<device>.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    path = RESULTS / f"{name}-{kind}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2))
    print(f"\nwrote {path}")
    return path
