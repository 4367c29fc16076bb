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


_INTERRUPTED_WRITE = r"""
import json, resource, signal, sys
from pathlib import Path
from speedswap.apps.bench import suite
from speedswap.apps.bench.timing import write_json
import speedswap as ss

path = Path(sys.argv[1])
# A write the file system stops part way (as a full disk would): at most 1000 bytes per file.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
try:
    if path.name == "suite.json":
        suite._write_record(path.parent, {"mode": "x", "steps": {}, "padding": list(range(2000))}, 0.0)
    else:
        write_json(path, "x", {"figures": list(range(2000))})
except ss.PathError as exc:
    print("PathError:", exc)
"""


@pytest.mark.parametrize("name", ["transport-cpu.json", "suite.json"])
def test_a_results_file_whose_rewrite_fails_keeps_the_previous_one(name, tmp_path):
    """write_json and suite.json were written in place: a write stopped part way left half a JSON file."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = tmp_path / name
    path.write_text(json.dumps({"figures": [1.0, 2.0]}))
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_WRITE, str(path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("PathError:") and str(path) in done.stdout, done.stdout
    assert json.loads(path.read_text()) == {"figures": [1.0, 2.0]}  # the previous results, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary left behind


def test_a_failed_steps_multi_line_reason_stays_in_its_table_row():
    """torch's CUDA errors span lines; the reason's newlines ended the Markdown row mid-cell."""
    from speedswap.apps.bench import suite
    from speedswap.apps.bench.summary import markdown_table, render_summary

    reason = ("RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might "
              "be asynchronously reported at some other API call\nFor debugging consider passing "
              "CUDA_LAUNCH_BLOCKING=1")
    failed = {"status": "failed", "reason": reason, "seconds": 0.5}
    machine = dict.fromkeys(["date", "host", "cpu", "cores", "torch", "numpy", "python", "speedswap", "gpu",
                             "load_average"], "x")
    record = {"mode": "full", "machine": {**machine, "ram_bytes": 2**30, "ram_available_bytes": 2**29},
              "seconds": 5.0, "budget_s": 480, "finished": True, "steps": dict.fromkeys(suite.STEPS, failed)}
    text = render_summary(record)
    for section in ("## Steps", "## Targets"):
        body = text.split(section)[1].split("\n\n")[1]  # the table: every line a row of it
        assert all(line.startswith("|") and line.endswith("|") for line in body.splitlines()), body
    assert "CUDA_LAUNCH_BLOCKING=1" in text  # nothing of the reason lost
    assert markdown_table(["a"], [["x\ny"]]).splitlines()[-1] == "| x<br>y |"


def test_bench_refuses_an_infinite_budget_which_suite_json_cannot_hold(tmp_path, monkeypatch, capsys):
    """--budget-s inf ran, and suite.json said "budget_s": Infinity, which is not JSON."""
    from speedswap.apps.bench import suite

    with pytest.raises(ss.OptionError, match="positive number of seconds.*finite"):
        suite.run_all(tmp_path / "never", dry_run=True, budget_s=float("inf"))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--all", "--dry-run", "--steps", "beyond-gpu", "--budget-s", "inf"]) == 2
    assert "finite" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("seed", ["-1", str(2**32), "x"])
def test_demo_refuses_a_seed_out_of_range_before_it_runs(seed, capsys, monkeypatch):
    """demo --seed -1 built the corpus with it and died in numpy with a raw ValueError traceback."""
    from speedswap.apps import demo

    def ran(*args, **kwargs):
        raise AssertionError("the demo ran with a seed it cannot take")

    monkeypatch.setattr(demo, "run_demo", ran)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--tiny", "--seed", seed])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "2**32" in err


def test_summary_says_the_gpu_word2vec_contenders_failed_not_that_they_did_not_run():
    """Every GPU contender raising left the word2vec targets saying 'the GPU word2vec job did not run'."""
    from speedswap.apps.bench import summary

    names = ("gpu", "gpu closed form", "gpu cache + prefetch", "gpu batch x4")
    job = {"ratios": {}, "skipped": {**{name: "failed in round 1: RuntimeError: CUDA error: out of memory"
                                        for name in names}, "gensim": "gensim is not installed"},
           "failures": {name: "Traceback ..." for name in names}}
    record = {"steps": {"word2vec": {"status": "ran", "reason": None, "result": job}}}
    rows = summary._word2vec_targets(record)
    assert len(rows) == 2
    for row in rows:
        assert "did not run" not in row[2]
        assert row[2].startswith("skipped: every GPU contender failed") and "CUDA error: out of memory" in row[2]
        assert row[3] == "—"


def test_the_feeder_disk_case_makes_a_file_of_the_gigabytes_asked_for(tmp_path):
    """--disk-gb 2 made a 2 GiB file, printed as "2.15 GB" (benchmarks/disk.py's --disk-gb means 1e9 bytes)."""
    from speedswap.apps.bench import feeder

    result = feeder.disk(0.004, str(tmp_path), batch=256, max_seconds=30, repeats=3)
    assert abs(result["file_bytes"] - 0.004e9) < 4096  # one 4 KiB row of rounding
    assert feeder.format_disk(result).startswith("disk: 0.00 GB file")
    assert not list(tmp_path.iterdir())  # the temporary file is removed


def test_the_feeder_disk_case_takes_turns_over_repeated_rounds(tmp_path, monkeypatch):
    """One epoch of each order, block always first: a disk whose speed drifts (shared, or warming up)
    fell on one order only, and the ratio of two single epochs had no spread to judge it by."""
    from speedswap.apps.bench import feeder

    turns = []
    real = feeder._disk_epoch
    monkeypatch.setattr(feeder, "_disk_epoch", lambda path, order, *args, **kwargs:
                        turns.append((order, kwargs.get("max_batches"))) or real(path, order, *args, **kwargs))
    result = feeder.disk(0.002, str(tmp_path), batch=64, max_seconds=30, repeats=3, warmup_batches=2)
    assert turns == [("block", 2), ("random", 2),  # the warm-up, then rounds that take turns at going first
                     ("block", None), ("random", None), ("random", None), ("block", None), ("block", None),
                     ("random", None)]
    for row in result["rows"]:
        assert row["repeats"] == 3 and row["min_s"] <= row["epoch_s"] <= row["max_s"]
        assert row["epoch_s_is"] == "measured" and len(row["load_1min"]) == 6
    assert result["ratios"]["block_speedup_over_random"] > 0
    assert "faster than random order" in feeder.format_disk(result)
    turns.clear()
    feeder.disk(0.002, str(tmp_path), batch=64, max_seconds=30, repeats=1, warmup_batches=0)
    assert turns == [("block", None), ("random", None)]  # no warm-up asked for: none read
    with pytest.raises(ss.OptionError, match="repeats must be at least 1"):
        feeder.disk(0.002, str(tmp_path), batch=64, max_seconds=30, repeats=0)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script, option", [("cache.py", "--steps"), ("training_step.py", "--threads"),
                                            ("word2vec_quality.py", "--epochs"), ("soak.py", "--save-every"),
                                            ("eval_read.py", "--repeats")])
def test_benchmark_scripts_refuse_a_count_of_zero_before_any_work(script, option):
    """cache.py --steps 0 divided by zero, training_step.py --threads 0 got torch's raw error."""
    import subprocess
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    done = subprocess.run([sys.executable, script, option, "0"], cwd=benchmarks, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"argument {option}: '0' is not a positive integer" in done.stderr


@pytest.mark.parametrize("case", ["fast_loops", "regression"])
def test_the_feeder_benchmark_times_its_contenders_round_robin(case, monkeypatch):
    """Each contender was timed all its repeats before the next began, so drift (turbo, a noisy
    neighbour) landed on some contenders and not others, and skewed their ratios."""
    import torch

    from speedswap.apps.bench import feeder, timing

    timed = []
    wall_once = timing._wall_once
    monkeypatch.setattr(timing, "_wall_once", lambda fn: timed.append(fn) or wall_once(fn))
    if case == "fast_loops":
        result = feeder.fast_loops(epochs=1, repeats=3, rows=600, dim=4, batch=30)
    else:
        result = feeder.regression(rows=600, epochs=3, workers=0, device=torch.device("cpu"), dim=4, batch=30)
    contenders = len(result["rows"])
    assert len(set(timed)) == contenders and len(timed) == 4 * contenders  # a warm-up round and 3 timed
    for start in range(0, len(timed), contenders):  # every round times each contender once
        assert len(set(timed[start:start + contenders])) == contenders, start
    assert all(row["repeats"] == 3 for row in result["rows"])
