"""Reviewed defects of the benchmark app and its command line, each pinned by a test."""

import pytest

import speedswap as ss
from speedswap.__main__ import main
from speedswap.apps.bench.timing import time_interleaved


@pytest.mark.parametrize("repeats", ["0", "-3"])
def test_bench_refuses_repeats_that_time_nothing(repeats, capsys, tmp_path):
    """--repeats 0 measured the table, then died in statistics.median with a raw traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--quick", "--repeats", repeats, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--repeats" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was measured or written


@pytest.mark.parametrize("repeats, warmup", [(0, 3), (-1, 3), (2, -1)])
def test_timing_refuses_repeats_that_time_nothing(repeats, warmup):
    with pytest.raises(ss.OptionError, match="repeats|warmup"):
        time_interleaved({"f": lambda: None}, repeats=repeats, warmup=warmup)
