"""A bar chart of the transport benchmark: throughput per method and direction.

matplotlib is optional (``pip install 'speedswap[examples]'``): callers ask
:func:`matplotlib_missing` before minutes of measuring, not after.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

from speedswap.atomic import atomic_output

__all__ = ["matplotlib_missing", "chart", "plot"]


def matplotlib_missing() -> Optional[str]:
    """Why no chart can be drawn here (matplotlib not installed), or None when it can."""
    if importlib.util.find_spec("matplotlib") is None:
        return "matplotlib is not installed (pip install 'speedswap[examples]')"
    return None


def _panels(payload: dict) -> list:
    """``(title, rows)`` for each chart panel: CPU gather/scatter, then the first GPU case."""
    panels = []
    if "cpu" in payload:
        config = payload["cpu"]["config"]
        size = f"{config['num_ids']:,} of {config['num_rows']:,} x {config['dim']} rows"
        panels += [(f"CPU gather ({size})", payload["cpu"]["gather"]),
                   (f"CPU scatter ({size})", payload["cpu"]["scatter"])]
    if payload.get("gpu"):
        case = payload["gpu"][0]
        config = case["config"]
        size = f"{config['num_ids']:,} of {config['num_rows']:,} x {config['dim']} rows"
        panels += [(f"to GPU ({size})", case["to_gpu"]), (f"from GPU ({size})", case["from_gpu"])]
    return panels


def chart(payload: dict):
    """A matplotlib figure: throughput (GB/s, higher is better) per method and direction.

    speedswap's own rows are orange.

    Args:
        payload: ``{"cpu": run_cpu(...), "gpu": run_gpu(...)}`` from
            :mod:`speedswap.apps.bench.transport` (either key may be absent).

    Returns:
        matplotlib.figure.Figure

    Raises:
        ImportError: matplotlib is not installed.
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


def plot(payload: dict, path: os.PathLike) -> Path:
    """Save :func:`chart` of ``payload`` as a PNG at ``path`` (no display needed), atomically.

    Raises:
        ImportError: matplotlib is not installed.
        PathError: the file system refused the write (the previous chart is kept).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = chart(payload)
    try:
        # The temporary's name ends in .tmp: the format is given, not taken from it.
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    return Path(path)
