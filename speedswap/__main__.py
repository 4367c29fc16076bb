"""Command line: ``python -m speedswap info``."""

import argparse
import sys

from .info import format_info, info


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m speedswap",
                                     description="speedswap command line")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, backends, device, memory held by live tables")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(format_info(info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
