"""Command line: ``python -m speedswap demo | bench | info``."""

import argparse
import sys

from .apps.demo import BACKEND_OF_DEVICE
from .info import format_info, info


def _demo(args):
    from .apps.demo import format_demo, run_demo

    size = "tiny" if args.tiny else "demo"
    print(f"speedswap demo: word2vec (skip-gram, Adam) on a synthetic corpus with planted topics, "
          f"both tables and their Adam state in {args.storage} host memory ({size} size)")
    summary = run_demo(tiny=args.tiny, backend=BACKEND_OF_DEVICE[args.device], storage=args.storage,
                       progress=not args.no_progress)
    print(format_demo(summary))


def _bench(args):
    from .apps.bench import run_bench

    _, json_path, png_path = run_bench(out_dir=args.out, quick=args.quick, repeats=args.repeats)
    print(f"\nwrote {json_path}\nwrote {png_path}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m speedswap",
                                     description="speedswap command line")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, backends, device, memory held by live tables")
    demo = commands.add_parser("demo", help="train word2vec with offloaded tables (about a minute)")
    demo.add_argument("--tiny", action="store_true", help="a few seconds, for smoke tests")
    demo.add_argument("--device", choices=sorted(BACKEND_OF_DEVICE), default="auto",
                      help="cuda needs CuPy and a GPU; auto uses one when present")
    demo.add_argument("--storage", default="pinned", choices=("pinned", "mapped", "pageable", "device"),
                      help="where the tables and optimizer state live")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench = commands.add_parser("bench", help="row transport benchmark, JSON + PNG chart")
    bench.add_argument("--quick", action="store_true", help="16x smaller sizes (a smoke run)")
    bench.add_argument("--repeats", type=int, default=20, help="timed repeats per method")
    bench.add_argument("--out", help="directory for the JSON and PNG (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(format_info(info()))
    elif args.command == "demo":
        _demo(args)
    else:
        _bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
