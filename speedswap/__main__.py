"""Command line: ``python -m speedswap demo | bench | info``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .apps.demo import BACKEND_OF_DEVICE
from .errors import SpeedswapError
from .info import format_info, info
from .version import __version__

_FORMAT = argparse.ArgumentDefaultsHelpFormatter
_REPEATS = 20  # the plain bench's timed rounds per contender


def _demo(args: argparse.Namespace) -> int:
    from .apps.demo import format_demo, run_demo

    size = "tiny" if args.tiny else "demo"
    print(f"speedswap demo: word2vec (skip-gram, SGD with word2vec's linear decay) on a synthetic "
          f"corpus with planted topics, both tables in {args.storage} host memory ({size} size)")
    summary = run_demo(tiny=args.tiny, backend=BACKEND_OF_DEVICE[args.device], storage=args.storage,
                       progress=not args.no_progress, cache_rows=args.cache_rows)
    print(format_demo(summary))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .apps.bench import run_all, run_transport_bench

    if not args.all:
        _, written = run_transport_bench(out_dir=args.out, quick=args.quick, repeats=args.repeats)
        print("\n" + "\n".join(f"wrote {path}" for path in written))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench --all measures the GPU suite and torch sees no CUDA device here; add --dry-run "
              "to exercise it at tiny sizes on the CPU, or run plain bench for the CPU transport "
              "benchmark", file=sys.stderr)
        return 2
    record = run_all(out_dir=args.out, dry_run=args.dry_run, steps=args.steps)
    failed = [name for name, outcome in record["steps"].items() if outcome["status"] == "failed"]
    print(f"\n{record['mode']} done in {record['seconds']:.0f} s; wrote {args.out}/SUMMARY.md"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


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
    from .apps.bench.suite import STEPS

    parser = argparse.ArgumentParser(prog="python -m speedswap", description="speedswap command line",
                                     formatter_class=_FORMAT)
    parser.add_argument("--version", action="version", version=f"speedswap {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, backends, device, memory held by live tables",
                        formatter_class=_FORMAT)
    demo = commands.add_parser("demo", help="train word2vec with offloaded tables (about a minute)",
                               formatter_class=_FORMAT)
    demo.add_argument("--tiny", action="store_true", help="a few seconds, for smoke tests")
    demo.add_argument("--device", choices=sorted(BACKEND_OF_DEVICE), default="auto",
                      help="cuda needs CuPy and a GPU; auto uses one when present")
    demo.add_argument("--storage", default="pinned", choices=("pinned", "mapped", "pageable", "device"),
                      help="where the tables and optimizer state live")
    demo.add_argument("--cache-rows", type=int, default=0, metavar="N",
                      help="keep N hot rows of each table on the device between steps, prefetching the next "
                           "batch's (0: no cache)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench = commands.add_parser(
        "bench", formatter_class=_FORMAT,
        help="row transport benchmark (JSON, table, PNG chart); --all: the whole GPU suite",
        description="Without --all: the row transport benchmark at a size this machine holds. "
                    "With --all: every gpu-marked test of the checkout and every GPU benchmark "
                    "(transport, training step, feeder, word2vec), JSON plus SUMMARY.md.")
    bench.add_argument("--out", default=DEFAULT_OUT, help="directory for the results")
    bench.add_argument("--quick", action="store_true", help="16x smaller sizes (a smoke run; without --all)")
    bench.add_argument("--repeats", type=int, default=_REPEATS, help="timed repeats per method (without --all)")
    bench.add_argument("--all", action="store_true",
                       help="the GPU suite: gpu tests and every GPU benchmark (about 12 minutes on an H100, "
                            "estimated; see --steps)")
    bench.add_argument("--dry-run", action="store_true",
                       help="with --all: every step at tiny sizes on the CPU, GPU parts reported as skipped")
    bench.add_argument("--steps", type=_bench_steps,
                       help="with --all: only these steps, comma-separated, of "
                            + ", ".join(name.replace(" ", "-") for name in STEPS)
                            + " (to split the suite over calls with a time limit; default: all)")
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
    try:
        if args.command == "info":
            print(format_info(info()))
            return 0
        if args.command == "demo":
            return _demo(args)
        return _bench(args)
    except SpeedswapError as exc:
        # The message says what was expected and how to fix it; a traceback would bury it.
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
