"""Command line: ``python -m speedswap demo | bench | info``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Optional, Sequence

from .apps.arguments import nonnegative_int, positive_int, seed, table_directory
from .apps.demo import BACKEND_OF_DEVICE
from .atomic import atomic_output
from .errors import SpeedswapError
from .info import format_info, info
from .version import __version__


class _Format(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except None: such an option's help says what it means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


_REPEATS = 20  # the plain bench's timed rounds per contender


def _demo(args: argparse.Namespace) -> int:
    from .apps.demo import format_demo, run_demo
    from .backends import get_backend

    backend = BACKEND_OF_DEVICE[args.device]
    get_backend(backend)  # --device cuda on a machine without one: refused before the header, not under it
    size = "tiny" if args.tiny else "demo"
    # Where the tables are is said at the end ("storage"): on the CPU backend pinned means plain memory.
    print(f"speedswap demo: word2vec (skip-gram, SGD with word2vec's linear decay) on a synthetic "
          f"corpus with planted topics, both tables offloaded ({size} size, seed {args.seed})")
    summary = run_demo(tiny=args.tiny, backend=backend, storage=args.storage,
                       progress=not args.no_progress, seed=args.seed, cache_rows=args.cache_rows,
                       path=args.table_dir)
    print(format_demo(summary))
    if args.json:
        # Atomic: a run killed mid-write leaves any earlier summary whole, never half of one.
        with atomic_output(args.json) as tmp, open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _info() -> int:
    from .apps.demo import format_bytes

    # For people: a count of bytes is also given in binary units, after the exact number, which
    # stays the first word of its value (scripts should read speedswap.info(), the dict, anyway).
    summary = {key: f"{value} ({format_bytes(value)})" if key.endswith("_bytes") and value >= 1024 else value
               for key, value in info().items()}
    print(format_info(summary))
    return 0


def _json_file(text: str) -> str:
    """``--json``'s type: a file in an existing directory, checked before the run, or argparse's error."""
    directory = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name, such as "
                                         f"{os.path.join(text, 'demo.json')!r}")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"the directory {directory!r} does not exist; create it first "
                                         f"(mkdir -p) or write the summary elsewhere")
    if not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {directory!r}; write the summary somewhere writable")
    return text


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .apps.bench import run_all, run_transport_bench

    if not args.all:
        _, written = run_transport_bench(out_dir=args.out, quick=args.quick, repeats=args.repeats)
        print("\n" + "\n".join(f"wrote {path}" for path in written))
        _warn_if_loaded()
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench --all measures the GPU suite and torch sees no CUDA device here; add --dry-run "
              "to exercise it at tiny sizes on the CPU, or run plain bench for the CPU transport "
              "benchmark", file=sys.stderr)
        return 2
    budget = {} if args.budget_s is None else {"budget_s": args.budget_s}
    record = run_all(out_dir=args.out, dry_run=args.dry_run, steps=args.steps, **budget)
    failed = [name for name, outcome in record["steps"].items() if outcome["status"] == "failed"]
    print(f"\n{record['mode']} done in {record['seconds']:.0f} s; wrote {args.out}/SUMMARY.md"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _warn_if_loaded() -> None:
    """Say so when other processes ran beside the benchmark: its figures are then noise."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.5 * cores:
        print(f"\nnote: the load average was {load:.1f} on {cores} cores: other processes shared the "
              f"CPU, so these figures are noise. Run again on an idle machine"
              + ("" if os.environ.get("OMP_WAIT_POLICY") else
                 ", or with OMP_WAIT_POLICY=PASSIVE (torch's waiting threads otherwise spin against "
                 "the other processes)"), file=sys.stderr)


def _bench_steps(text: str) -> list:
    """``--steps``' type: the suite's step names, or argparse's own error message."""
    from .apps.bench.suite import step_names

    try:
        return step_names(text)
    except SpeedswapError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m speedswap`` argument parser (every ``--help`` shows the defaults)."""
    from .apps.bench import DEFAULT_OUT
    from .apps.bench.suite import BUDGET_S, STEPS

    parser = argparse.ArgumentParser(prog="python -m speedswap", description="speedswap command line",
                                     formatter_class=_Format)
    parser.add_argument("--version", action="version", version=f"speedswap {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, backends, device, memory held by live tables",
                        formatter_class=_Format)
    demo = commands.add_parser("demo", formatter_class=_Format,
                               help="train word2vec with offloaded tables (about half a minute on a 2-core CPU)")
    demo.add_argument("--tiny", action="store_true", help="a few seconds, for smoke tests")
    demo.add_argument("--device", choices=sorted(BACKEND_OF_DEVICE), default="auto",
                      help="cuda needs a GPU (CuPy adds the zero-copy kernels); auto uses one when present")
    demo.add_argument("--storage", default="pinned", choices=("pinned", "mapped", "pageable", "device", "mmap"),
                      help="where the tables and optimizer state live (mmap: memory-mapped .npy files)")
    # Named as in examples/word2vec.py, which takes the same directory.
    demo.add_argument("--table-dir", type=table_directory, metavar="DIR",
                      help="with --storage mmap: a new or empty directory for the table files, kept after the "
                           "run (default: a temporary directory, removed at the end)")
    demo.add_argument("--seed", type=seed, default=0, metavar="N",
                      help="seeds the corpus and the training, 0 to 2**32 - 1 (the same seed gives the same "
                           "vectors, loss and purity)")
    demo.add_argument("--json", type=_json_file, metavar="PATH",
                      help="also write the summary to PATH as JSON (replaced atomically)")
    demo.add_argument("--cache-rows", type=nonnegative_int, default=0, metavar="N",
                      help="keep N hot rows of each table on the device between steps, prefetching the next "
                           "batch's (0: no cache)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench = commands.add_parser(
        "bench", formatter_class=_Format,
        help="row transport benchmark (JSON, table, PNG chart); --all: the whole GPU suite",
        description="Without --all: the row transport benchmark at a size this machine holds. "
                    "With --all: every gpu-marked test of the checkout and every GPU benchmark "
                    "(transport, training step, feeder, word2vec, a vocabulary beyond the GPU's "
                    "memory) within a time budget, JSON plus SUMMARY.md.")
    bench.add_argument("--out", default=DEFAULT_OUT, help="directory for the results")
    bench.add_argument("--quick", action="store_true", help="16x smaller sizes (a smoke run; without --all)")
    bench.add_argument("--repeats", type=positive_int, default=_REPEATS,
                       help="timed repeats per method (without --all)")
    bench.add_argument("--all", action="store_true",
                       help="the GPU suite: gpu tests and every GPU benchmark, in that order, within "
                            "--budget-s")
    bench.add_argument("--dry-run", action="store_true",
                       help="with --all: every step at tiny sizes on the CPU, GPU parts reported as skipped")
    bench.add_argument("--steps", type=_bench_steps,
                       help="with --all: only these steps, comma-separated, of "
                            + ", ".join(name.replace(" ", "-") for name in STEPS)
                            + " (to split the suite over calls with a time limit; default: all)")
    # run_all checks the value (an OptionError, printed as the command's error).
    bench.add_argument("--budget-s", type=float, metavar="SECONDS",
                       help=f"with --all: the seconds the run may take (default {BUDGET_S}, which fits "
                            f"one 10-minute command); a step starts only while its estimated time is "
                            f"left, the others are reported as skipped")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and args.all and (args.quick or args.repeats != _REPEATS):
        parser.error("--quick and --repeats size the plain transport benchmark; bench --all has its own "
                     "sizes (use --dry-run for a small run)")
    if args.command == "bench" and args.steps and not args.all:
        parser.error("--steps goes with --all (bench --all --steps transport,feeder)")
    if args.command == "bench" and args.dry_run and not args.all:
        parser.error("--dry-run goes with --all (bench --all --dry-run)")
    if args.command == "bench" and args.budget_s is not None and not args.all:
        parser.error("--budget-s goes with --all (bench --all --budget-s 300)")
    if args.command == "demo" and args.table_dir is not None and args.storage != "mmap":
        parser.error(f"--table-dir is the directory of --storage mmap's files, and --storage is "
                     f"{args.storage}; add --storage mmap or drop --table-dir")
    # A warning names the user's line that led to it; here there is none (runpy's frame would
    # be shown), so the command line shows the category and the message alone.
    formatwarning = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_: f"{category.__name__}: {message}\n"
    try:
        if args.command == "info":
            return _info()
        if args.command == "demo":
            return _demo(args)
        return _bench(args)
    except SpeedswapError as exc:
        # The message says what was expected and how to fix it; a traceback would bury it.
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = formatwarning  # main() called in a process that goes on


if __name__ == "__main__":
    sys.exit(main())
