"""``python -m speedswap``: every command's ``--help`` shows the defaults."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from speedswap.__main__ import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _subparsers(parser):
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices


@pytest.mark.parametrize("command", ["info", "demo", "bench"])
def test_every_option_with_a_default_says_it_in_help(command):
    parser = _subparsers(build_parser())[command]
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    help_text = parser.format_help()
    for action in parser._actions:
        if action.option_strings and action.default not in (None, argparse.SUPPRESS):
            assert action.help, f"{command} {action.option_strings[0]} has no help to show its default in"
            assert f"(default: {action.default})" in " ".join(help_text.split())


def test_bench_help_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "speedswap", "bench", "--help"], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert "--all" in out and "--dry-run" in out and "(default: speedswap-bench)" in out


def test_demo_cache_line_shows_rare_per_step_events():
    from speedswap.apps.demo import format_cache
    figures = {"cache_rows": 500, "cache_bytes": 2048, "hit_rate": 0.5, "h2d_bytes": 1024.0,
               "d2h_bytes": 1024.0, "evictions": 1234.6, "prefetched_rows": 0.3}
    [(label, line)] = format_cache({"centre": figures})
    assert label == "centre cache"
    assert "1,235 evicted" in line and "0.3 prefetched" in line


@pytest.mark.parametrize("optimizer, tables, says", [("SGD", 2, "(2 tables; SGD keeps no per-row state)"),
                                                     ("Adam", 4, "(2 tables + 2 Adam state tables)")])
def test_demo_names_the_state_tables_that_exist(optimizer, tables, says):
    from speedswap.apps.demo import format_demo
    summary = {"vocab": 2000, "dim": 32, "optimizer": optimizer, "tables": tables, "epochs": 1, "steps": 10,
               "seconds": 1.0, "threads": 1, "final loss": 1.5, "words/s": 10.0, "pairs/s": 20.0,
               "topic purity": 0.9, "chance": 0.05, "storage": "pinned", "page-locked": True,
               "host_bytes": 1024, "file_bytes": 0, "device": "cpu", "device_bytes": 512}
    assert says in format_demo(summary)
