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


@pytest.mark.parametrize("argv", [["bench", "--quick", "--repeats", "2"],
                                  ["bench", "--all", "--dry-run", "--steps", "transport"]])
def test_bench_out_that_is_a_file_is_a_one_line_error_before_measuring(argv, tmp_path, monkeypatch, capsys):
    """--out naming a file raised a raw FileExistsError, for plain bench after the whole measurement."""
    from speedswap.apps.bench import transport

    def measured(*args, **kwargs):
        raise AssertionError("measured before the results directory was checked")

    monkeypatch.setattr(transport, "run_cpu", measured)
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    assert main(argv + ["--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m speedswap bench: error: ") and str(taken) in err
    assert "Traceback" not in err and "not a directory" in err
    assert taken.read_text() == "keep me"
