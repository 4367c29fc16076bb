"""``python -m speedswap``: every command's ``--help`` shows the defaults; the demo's options."""

import argparse
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import speedswap as ss
from speedswap.__main__ import build_parser, main
from speedswap.apps import demo

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


@pytest.mark.parametrize("storage, pinned, device, says", [
    ("device", False, "cpu", "device (plain host memory: the CPU backend has no GPU)"),
    ("pinned", False, "cpu", "pinned (plain host memory: the CPU backend has no GPU)"),
    ("device", False, "cuda:0", "device"),     # GPU memory, which is not page-locked host memory
    ("pinned", True, "cuda:0", "pinned"),
    ("pageable", False, "cpu", "pageable")])
def test_demo_says_plain_host_memory_only_where_the_storage_was(storage, pinned, device, says):
    """--storage device on a GPU was reported as "plain host memory: the CPU backend has no GPU"."""
    from speedswap.apps.demo import format_demo
    summary = {"vocab": 2000, "dim": 32, "optimizer": "SGD", "tables": 2, "epochs": 1, "steps": 10,
               "seconds": 1.0, "threads": 1, "final loss": 1.5, "words/s": 10.0, "pairs/s": 20.0,
               "topic purity": 0.9, "chance": 0.05, "storage": storage, "page-locked": pinned,
               "host_bytes": 1024, "file_bytes": 0, "device": device, "device_bytes": 512}
    assert re.search(r"storage\s+(.+)", format_demo(summary)).group(1).strip() == says


TINY_DEMO = ["demo", "--tiny", "--device", "cpu", "--no-progress"]


@pytest.fixture
def torch_threads():
    """The demo sets torch's thread count for its run; the tests after it keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_seed_defaults_to_run_demos():
    """Without --seed the demo runs as it always did: run_demo's own seed."""
    assert build_parser().parse_args(["demo"]).seed == inspect.signature(demo.run_demo).parameters["seed"].default


def test_demo_seed_json_and_mmap_tables(tmp_path, monkeypatch, capsys, torch_threads):
    made = []  # the temporary directories the demo makes for mmap without --table-dir

    def temporary_directory(*args, **kwargs):
        directory = make_temporary(*args, **kwargs)
        made.append(directory.name)
        return directory

    make_temporary = tempfile.TemporaryDirectory
    monkeypatch.setattr(tempfile, "TemporaryDirectory", temporary_directory)
    runs = {}
    for name, options in [("pinned", ["--seed", "3"]),
                          ("kept", ["--seed", "3", "--storage", "mmap", "--table-dir", str(tmp_path / "tables")]),
                          ("temporary", ["--seed", "4", "--storage", "mmap"])]:
        assert main(TINY_DEMO + options + ["--json", str(tmp_path / f"{name}.json")]) == 0
        out = capsys.readouterr().out
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
        # The JSON is the summary the table shows.
        purity = re.search(r"topic purity\s+([\d.]+)", out).group(1)
        assert f"{runs[name]['topic purity']:.3f}" == purity, out
        assert f"final loss per pair {runs[name]['final loss']:.3f}" in out, out
    pinned, kept, temporary_run = runs["pinned"], runs["kept"], runs["temporary"]
    # The same seed gives the same run, whatever holds the tables; another seed another one.
    for key in ("steps", "final loss", "topic purity", "chance"):
        assert kept[key] == pinned[key], key
    assert temporary_run["final loss"] != pinned["final loss"]
    assert (pinned["seed"], temporary_run["seed"]) == (3, 4)
    assert (pinned["storage"], pinned["path"], pinned["file_bytes"]) == ("pinned", None, 0)
    assert (kept["storage"], kept["path"]) == ("mmap", str(tmp_path / "tables"))
    table_bytes = 2 * kept["vocab"] * kept["dim"] * 4
    assert kept["file_bytes"] == temporary_run["file_bytes"] == table_bytes
    for table in ("centre", "context"):
        assert (tmp_path / "tables" / table / "table.npy").stat().st_size >= table_bytes // 2
    [directory] = [d for d in made if Path(d).name.startswith("speedswap-demo-")]
    assert not Path(directory).exists()  # removed at the end
    assert temporary_run["path"] is None


@pytest.mark.parametrize("options, says", [
    (["--table-dir", "{tmp}/new"], "--table-dir is the directory of --storage mmap's files, and --storage is pinned"),
    (["--storage", "mmap", "--table-dir", "{tmp}/full"], "is not empty; give a new or empty directory"),
    (["--storage", "mmap", "--table-dir", "{tmp}/full/file"], "is a file; give a directory"),
    (["--json", "{tmp}/nope/summary.json"], "does not exist; create it first"),
    (["--json", "{tmp}/full"], "is a directory; give a file name"),
    # Refused by the training run once the corpus was built, and named as the API's cache_rows.
    (["--cache-rows", "-1"], "argument --cache-rows: '-1' is not an integer >= 0"),
])
def test_demo_refuses_bad_paths_and_numbers_before_it_runs(options, says, tmp_path, monkeypatch, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("someone's")
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as info:
        main(TINY_DEMO + [option.format(tmp=tmp_path) for option in options])
    assert info.value.code == 2
    assert says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file", "full"]


def test_demo_mmap_path_named_like_a_file_is_a_one_line_error(tmp_path, capsys, torch_threads):
    assert main(TINY_DEMO + ["--storage", "mmap", "--table-dir", str(tmp_path / "tables.npy")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m speedswap demo: error: ") and err.count("\n") == 1, err
    assert "would create a directory named 'tables.npy'" in err
    assert list(tmp_path.iterdir()) == []


def test_run_demo_refuses_a_path_without_mmap_storage(tmp_path):
    with pytest.raises(ss.OptionError, match="drop path or use storage='mmap'"):
        demo.run_demo(tiny=True, backend="numpy", storage="pinned", path=tmp_path / "tables")
    assert list(tmp_path.iterdir()) == []


def test_run_demo_gives_the_callers_thread_count_back_however_it_ends(monkeypatch):
    # run_demo set torch's thread count for its run and left it so: a notebook cell or test run after
    # it ran with the demo's count.
    from speedswap.apps import word2vec
    before = torch.get_num_threads()
    during = []

    def stop(*args, **kwargs):
        during.append(torch.get_num_threads())
        raise RuntimeError("stopped")
    monkeypatch.setattr(word2vec, "cpu_threads", lambda: before + 1)
    monkeypatch.setattr(word2vec, "train", stop)
    with pytest.raises(RuntimeError, match="stopped"):
        demo.run_demo(tiny=True, backend="numpy")
    assert during == [before + 1] and torch.get_num_threads() == before


@pytest.mark.parametrize("load, omp, says", [
    (0.2, None, None),
    (3.0, None, "load average was 3.0.*noise.*OMP_WAIT_POLICY=PASSIVE"),
    (3.0, "PASSIVE", "load average was 3.0.*noise. Run again on an idle machine\n"),
])
def test_plain_bench_says_when_its_figures_were_taken_under_load(load, omp, says, monkeypatch, capsys):
    from speedswap import __main__ as cli
    monkeypatch.setattr(cli.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    if omp is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", omp)
    cli._warn_if_loaded()
    err = capsys.readouterr().err
    if says is None:
        assert err == ""
    else:
        assert re.search(says, err, re.S), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is the one a machine without CUDA gets")
def test_the_command_line_shows_a_warning_without_a_source_line():
    """`python -m speedswap` has no line of the user's to point at: '<frozen runpy>:88:' was shown."""
    run = subprocess.run([sys.executable, "-m", "speedswap", "demo", "--tiny", "--no-progress"], check=True,
                         cwd=ROOT, capture_output=True, text=True)
    assert "RuntimeWarning: speedswap: no CUDA device here" in run.stderr, run.stderr
    assert "runpy" not in run.stderr, run.stderr


def test_demo_with_a_negative_seed_is_a_one_line_error(capsys, torch_threads):
    with pytest.raises(SystemExit) as exit_:  # was numpy's ValueError from the corpus's generator
        main(TINY_DEMO + ["--seed", "-1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("python -m speedswap demo: error: argument --seed: '-1' is not a seed: an "
                                    "integer from 0 to 2**32 - 1"), err


def test_demo_on_cuda_without_a_gpu_is_refused_before_its_header(monkeypatch, capsys):
    """The header ("speedswap demo: word2vec ...") was printed, then the error under it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine, GPU or not, has none
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: pytest.fail("the demo ran"))
    assert main(["demo", "--tiny", "--device", "cuda", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("python -m speedswap demo: error: torch sees no CUDA device") and err.count("\n") == 1, err
