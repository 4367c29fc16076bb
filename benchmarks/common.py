"""What the benchmark scripts share: this checkout's speedswap first on the path, where results go,
and the package's timing helpers (``machine``, ``summarize``, ``print_table``).

The measurements themselves live in the package (``speedswap.apps.bench``),
so an installed wheel can run them too (``python -m speedswap bench``).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Measure the speedswap of this checkout, not another one installed elsewhere.
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from speedswap.apps.arguments import positive_int  # noqa: E402,F401 (the scripts' count options)
from speedswap.apps.bench.timing import format_table, machine, summarize, write_json  # noqa: E402,F401

RESULTS = Path(__file__).resolve().parent / "results"


def add_out_option(parser):
    """Give a script's ``parser`` the ``--out DIR`` option: where its results go.

    The default is the tracked ``benchmarks/results``; an A/B run from a
    second worktree passes a folder of its own, so it leaves no tree dirty.
    """
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the folder the results go to (default: benchmarks/results)")


def write_results(name, payload, out=RESULTS):
    """Write ``payload`` plus the machine's description to ``<out>/<name>-<cpu|gpu>.json``; returns the path."""
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    path = write_json(Path(out) / f"{name}-{kind}.json", name, payload)
    print(f"\nwrote {path}")
    return path


def print_table(rows, columns):
    """Print ``rows`` (dicts) as a text table of ``columns``."""
    print(format_table(rows, columns))
