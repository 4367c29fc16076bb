"""``python -m speedswap bench``: the transport benchmark at a size this machine holds, plus a chart.

The measurements are ``benchmarks/transport.py``'s (HostTable gather/scatter
against torch, numpy and a contiguous copy on the CPU; against SpeedTorch's
CuPy method, pinned torch tensors, an all-GPU table and the memcpy limit on a
GPU). This module picks the size, runs it, and writes the JSON and a PNG bar
chart side by side. The benchmark scripts live in the source tree, not in the
installed package, so this needs a checkout (``pip install -e .``).
"""

import importlib.util
import json
import os
from pathlib import Path

__all__ = ["load_benchmark", "fitting_rows", "run_bench", "plot", "chart"]

CHECKOUT = Path(__file__).resolve().parent.parent
#: The SpeedTorch case's table height; smaller machines get a shorter table.
FULL_ROWS, DIM, IDS = 2_000_000, 128, 131_072


def load_benchmark(name):
    """Import ``benchmarks/<name>.py`` from the checkout this package runs from.

    Raises:
        FileNotFoundError: speedswap was installed without its source tree.
    """
    path = CHECKOUT / "benchmarks" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"python -m speedswap bench runs {path}, which is not there: "
                                f"the benchmarks ship with the source, so clone the repository "
                                f"and install it with pip install -e .")
    spec = importlib.util.spec_from_file_location(f"speedswap_benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fitting_rows(available_bytes, share=8):
    """Table rows for the CPU case: the full height, or what fits in ``1/share`` of free RAM."""
    return int(max(IDS, min(FULL_ROWS, available_bytes // share // (DIM * 4))))


def _available_ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return FULL_ROWS * DIM * 4 * 8


def run_bench(out_dir=None, quick=False, repeats=20):
    """Run the transport benchmark; write ``transport-bench-{cpu,gpu}.json`` and ``.png``.

    Args:
        out_dir: where to write (default ``benchmarks/results/`` of the checkout).
        quick: a 16x smaller smoke run.
        repeats: timed repeats per contender.

    Returns:
        (payload dict, json path, png path)
    """
    import speedswap as ss

    transport = load_benchmark("transport")
    scale = 16 if quick else 1
    rows = fitting_rows(_available_ram()) // scale
    payload = {"cpu": transport.run_cpu(rows, DIM, IDS // scale, repeats=repeats)}
    if "cuda" in ss.available_backends():
        payload["gpu"] = transport.run_gpu(quick, repeats)
    out_dir = Path(out_dir) if out_dir else CHECKOUT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"transport-bench-{'gpu' if 'gpu' in payload else 'cpu'}"
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    machine = load_benchmark("common").machine()
    json_path.write_text(json.dumps({"benchmark": "transport", "machine": machine, **payload}, indent=2))
    plot(payload, png_path)
    return payload, json_path, png_path


def _panels(payload):
    """``(title, rows)`` for each chart panel: CPU gather/scatter, then the first GPU case."""
    cpu = payload["cpu"]
    config = cpu["config"]
    size = f"{config['num_ids']:,} of {config['num_rows']:,} x {config['dim']} rows"
    panels = [(f"CPU gather ({size})", cpu["gather"]), (f"CPU scatter ({size})", cpu["scatter"])]
    if "gpu" in payload:
        case = payload["gpu"][0]
        size = f"{case['config']['num_ids']:,} of {case['config']['num_rows']:,} x {case['config']['dim']} rows"
        panels += [(f"to GPU ({size})", case["to_gpu"]), (f"from GPU ({size})", case["from_gpu"])]
    return panels


def plot(payload, path):
    """Save :func:`chart` of ``payload`` as a PNG at ``path``."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the bench chart needs matplotlib: pip install 'speedswap[examples]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = chart(payload)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def chart(payload):
    """A matplotlib figure: throughput (GB/s, higher is better) per method and direction.

    speedswap's own rows are orange. ``payload`` is what :func:`run_bench`
    (or ``benchmarks/transport.py``) returns.
    """
    import matplotlib.pyplot as plt

    panels = _panels(payload)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels):
        names = [row["method"] for row in rows]
        speeds = [row["GB/s"] for row in rows]
        colors = ["tab:orange" if name.startswith(("HostTable", "speedswap")) else "tab:blue"
                  for name in names]
        ax.barh(names, speeds, color=colors)
        ax.invert_yaxis()
        ax.set_xlim(0, max(speeds) * 1.15)  # room for the value labels
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GB/s (median)")
        for y, speed in enumerate(speeds):
            ax.text(speed, y, f" {speed:.1f}", va="center", fontsize=8)
    fig.tight_layout()
    return fig
