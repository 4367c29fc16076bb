"""``python -m speedswap bench``: the plain transport benchmark and the ``--all`` suite (dry run here, GPU on a GPU)."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speedswap import atomic
from speedswap.__main__ import main
from speedswap.apps.bench import feeder, gpu_tests, suite, summary, timing, training_step, transport, word2vec
from speedswap.apps.bench.summary import render_summary, target_rows
from speedswap.apps.corpus import synthetic_corpus

from conftest import gpu_only_first
from test_backends import fake_cgroups
from test_files import (_SWEEPS_MODEL_CTRL_C, _assert_no_descriptor_left_by_interrupts, _descriptors_left_by_interrupts,
                        _opened_in)

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["Machine", "Steps", "Targets", "GPU tests", "Transport", "Training step", "Feeder", "word2vec",
            "Beyond the GPU's memory"]


def sections(markdown):
    """``{heading: body}`` of the ``## `` sections of a Markdown text."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


@pytest.mark.slow
def test_dry_run_writes_every_result_and_a_summary_with_numbers(tmp_path):
    out = tmp_path / "results"
    # From outside the checkout, as a user would: results go where --out says.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "speedswap", "bench", "--all", "--dry-run", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # Every file, flat, and no more than 8 of them: all a lent GPU machine's output folder hands back.
    names = {p.name for p in out.iterdir()}
    assert names == {"SUMMARY.md", "suite.json", "gpu-tests.log", "transport-cpu.json", "training_step-cpu.json",
                     "feeder-cpu.json", "word2vec-cpu.json", "beyond_gpu-cpu.json"}, names

    summary = (out / "SUMMARY.md").read_text()
    found = sections(summary)
    assert list(found) == SECTIONS
    # A vocabulary beyond the GPU's memory has nothing to exceed on the CPU: the one section without figures.
    assert "skipped: no GPU memory to exceed on the CPU" in found.pop("Beyond the GPU's memory")
    for name, body in found.items():
        assert re.search(r"\d+\.\d+", body), f"section {name!r} has no figure:\n{body}"
    # Every GPU target is listed, each skipped with its reason.
    targets = [line for line in found["Targets"].splitlines() if line.startswith("| ") and "goal" not in line]
    assert len(targets) == 12
    assert all("skipped: dry run" in line for line in targets), targets

    transport_json = json.loads((out / "transport-cpu.json").read_text())
    assert transport_json["machine"]["cores"] and len(transport_json["machine"]["load_average"]) == 3
    assert all(value > 0 for value in transport_json["cpu"]["targets"].values())
    feeder_json = json.loads((out / "feeder-cpu.json").read_text())["regression"]
    # The summary quotes the run's own figures.
    assert f"{feeder_json['feeder_over_limit']:.3g}x the limit" in found["Feeder"]
    training_json = json.loads((out / "training_step-cpu.json").read_text())
    assert f"{training_json['results'][0]['throughput_ratio']:.3g}" in found["Training step"]

    record = json.loads((out / "suite.json").read_text())
    tests = record["steps"]["gpu tests"]
    assert tests["status"] == "ran" and tests["cuda_hidden"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # CUDA was hidden from every one
    assert "slowest" in (out / "gpu-tests.log").read_text()  # pytest's --durations, to resize from
    assert record["mode"] == "dry run" and record["finished"] and set(record["steps"]) == set(suite.STEPS)
    assert all(step["status"] == "ran" for step in record["steps"].values())


@pytest.mark.slow
def test_the_gpu_session_script_packs_the_profile_the_working_set_and_the_suite(tmp_path):
    """``benchmarks/gpu_session.sh``, a lent GPU machine's one call, run with its CPU sizes.

    Issue 11's run must work at its first try on a machine whose minutes are
    counted: every part it runs is run here, and what comes back is checked.
    """
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    committed = {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").rglob("*")}
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "SPEEDSWAP_SESSION_DRY": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(f"{script} exit 0" in done.stdout for script in ("profile_step.py", "working_set.py", "op_count.py")), \
        done.stdout
    assert {p.name for p in out.iterdir()} == {"results.tgz", "SUMMARY.md"}
    with tarfile.open(out / "results.tgz") as archive:
        names = {name.lstrip("./") for name in archive.getnames()}
        suite_record = json.load(archive.extractfile("./bench/suite.json"))
    assert {"profile_step-cpu.json", "working_set-cpu.json", "op_count-cpu.json", "bench/suite.json",
            "bench.log"} <= names, names
    assert suite_record["finished"]
    # Every step but the beyond-GPU vocabulary, which does not fit beside the gpu tests in one call.
    assert {name: step["status"] for name, step in suite_record["steps"].items()} == {
        **{name: "ran" for name in suite_record["steps"]}, "beyond gpu": "skipped"}
    # Written into $OUT, never into the checkout's committed results.
    assert {p.name: p.stat().st_mtime_ns for p in (ROOT / "benchmarks" / "results").rglob("*")} == committed


def test_the_gpu_session_script_refuses_to_run_without_out():
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    done = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "set OUT" in done.stderr


def test_bench_all_needs_a_gpu_or_dry_run(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench --all would run the full suite")
    assert main(["bench", "--all"]) == 2
    assert "--dry-run" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "--dry-run"], ["bench", "--all", "--quick"],
                                  ["bench", "--all", "--repeats", "3"], ["bench", "--steps", "feeder"]])
def test_bench_refuses_options_that_would_be_ignored(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "bench --all" in capsys.readouterr().err


def test_bench_all_refuses_an_unknown_step(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--all", "--dry-run", "--steps", "transport,warp-drive"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "warp drive" in err and "training-step" in err  # what is wrong, and the choices


def test_bench_all_runs_only_the_steps_asked_for(tmp_path, capsys):
    assert main(["bench", "--all", "--dry-run", "--steps", "word2vec", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "suite.json").read_text())
    assert record["steps"]["word2vec"]["status"] == "ran"
    others = [outcome for name, outcome in record["steps"].items() if name != "word2vec"]
    assert len(others) == len(suite.STEPS) - 1
    assert all(o["status"] == "skipped" and "not among the steps" in o["reason"] for o in others)
    found = sections((tmp_path / "SUMMARY.md").read_text())
    assert list(found) == SECTIONS and "not among the steps asked for" in found["Feeder"]
    assert suite.step_names("training-step, gpu tests") == ["gpu tests", "training step"]


def test_a_run_stopped_mid_step_leaves_the_steps_it_finished(tmp_path, monkeypatch):
    """The summary is rewritten after every step: a run cut off by a time limit keeps what it measured."""
    def cut_off(*args):
        raise KeyboardInterrupt  # as if the process were stopped here

    monkeypatch.setitem(suite.STEPS, "training step", cut_off)
    with pytest.raises(KeyboardInterrupt):
        suite.run_all(tmp_path, dry_run=True, log=lambda line: None,
                      steps=["transport", "training step", "feeder"])
    record = json.loads((tmp_path / "suite.json").read_text())
    assert record["finished"] is False
    statuses = {name: step["status"] for name, step in record["steps"].items()}
    assert statuses == {"gpu tests": "skipped", "transport": "ran", "training step": "not reached",
                        "feeder": "not reached", "word2vec": "skipped", "beyond gpu": "skipped"}
    found = sections((tmp_path / "SUMMARY.md").read_text())
    assert list(found) == SECTIONS
    assert "Not finished: so far" in found["Steps"] and "when this was written" in found["Machine"]
    assert re.search(r"\d+\.\d+", found["Transport"])  # the finished step's figures
    assert "not measured: the run had not reached this step" in found["Feeder"]


def test_a_step_whose_estimate_exceeds_the_budget_left_is_skipped_and_the_rest_still_run(tmp_path, monkeypatch):
    estimates = {**suite.DRY_RUN_SIZES.estimates_s, "transport": 1e-3, "training step": 1e6, "feeder": 1e-3}
    monkeypatch.setattr(suite, "DRY_RUN_SIZES", dataclasses.replace(suite.DRY_RUN_SIZES, estimates_s=estimates))
    lines = []
    record = suite.run_all(tmp_path, dry_run=True, log=lines.append, budget_s=1e5,
                           steps=["transport", "training step", "feeder"])
    steps = record["steps"]
    assert [steps[name]["status"] for name in ("transport", "training step", "feeder")] == ["ran", "skipped", "ran"]
    reason = steps["training step"]["reason"]
    assert reason.startswith("budget: ") and "about 1000000.0 s" in reason and "--steps training-step" in reason
    assert not (tmp_path / "training_step-cpu.json").exists()
    found = sections((tmp_path / "SUMMARY.md").read_text())
    assert "--steps training-step" in found["Training step"]
    assert any(line.startswith("training step skipped: budget") for line in lines)


def test_the_gpu_tests_get_what_the_later_steps_estimates_leave_of_the_budget(tmp_path, monkeypatch):
    given = []
    monkeypatch.setitem(suite.STEPS, "gpu tests",
                        lambda out, sizes, dry_run, log: given.append(sizes.tests_timeout) or {"status": "ran"})
    estimates = {**suite.DRY_RUN_SIZES.estimates_s, "gpu tests": 20, "transport": 30, "feeder": 40}
    monkeypatch.setattr(suite, "DRY_RUN_SIZES", dataclasses.replace(suite.DRY_RUN_SIZES, estimates_s=estimates))
    suite.run_all(tmp_path, dry_run=True, log=lambda line: None, budget_s=200,
                  steps=["gpu tests", "transport", "feeder"])
    assert 125 < given[0] <= 130  # 200 s less the transport's 30 and the feeder's 40
    given.clear()
    suite.run_all(tmp_path, dry_run=True, log=lambda line: None, budget_s=50, steps=["gpu tests", "feeder"])
    assert given == [20]  # 50 s less the feeder's 40 is below their own estimate, which they still get
    given.clear()
    suite.run_all(tmp_path, dry_run=True, log=lambda line: None, budget_s=1e4, steps=["gpu tests"])
    assert given == [suite.DRY_RUN_SIZES.tests_timeout]  # nor above their cap


def test_the_default_budget_fits_one_command_of_a_lent_gpu_machine():
    """Its 10-minute limit must hold the budget plus one benchmark overrunning by its own estimate
    (the gpu tests are interrupted at their share, and get their grace to report). The budget holds
    every step but the last, the beyond-GPU vocabulary: since the gpu tests grew past 200 s
    (2026-11-29) it runs in a call of its own (``--steps beyond-gpu``)."""
    estimates = suite.GPU_SIZES.estimates_s
    assert set(estimates) == set(suite.STEPS) == set(suite.DRY_RUN_SIZES.estimates_s)
    assert list(suite.STEPS)[-1] == "beyond gpu"
    assert sum(estimates.values()) - estimates["beyond gpu"] <= suite.BUDGET_S
    assert estimates["beyond gpu"] <= suite.BUDGET_S
    benchmarks = [seconds for name, seconds in estimates.items() if name != "gpu tests"]
    assert suite.BUDGET_S + max(max(benchmarks), gpu_tests.GRACE_S) <= 600


@pytest.mark.parametrize("budget", [0, -5, float("nan"), True, "60"])
def test_run_all_refuses_a_budget_that_is_not_positive_seconds(tmp_path, budget):
    with pytest.raises(suite.ss.OptionError, match="budget_s must be a positive number of seconds"):
        suite.run_all(tmp_path / "never", dry_run=True, budget_s=budget)
    assert not (tmp_path / "never").exists()  # refused before anything was written


@pytest.mark.parametrize("argv, message", [
    (["bench", "--all", "--dry-run", "--budget-s", "0"], "positive number of seconds"),
    (["bench", "--all", "--dry-run", "--budget-s", "soon"], "invalid float value: 'soon'"),
    (["bench", "--all", "--dry-run", "--budget-s", "nan"], "positive number of seconds"),
    (["bench", "--budget-s", "60"], "--budget-s goes with --all")])
def test_bench_refuses_a_bad_or_misplaced_budget(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        status = main(argv)  # run_all's refusal: the command's error, status 2
    except SystemExit as exit_:  # argparse's
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_summary_says_why_a_gpu_run_skipped_the_vocabulary_beyond_the_gpu():
    skipped = {"skipped": "the table and Adam state must exceed the GPU's 139 GiB, and 146 GiB of them do not "
                          "fit in this host's 125 GiB of RAM"}
    record = {"steps": {"beyond gpu": {"status": "ran", "reason": None, "seconds": 0.1,
                                       "result": {"beyond_gpu": skipped}}}}
    rows = {r[0]: r for r in target_rows(record)}
    beyond = rows["a vocabulary whose table + Adam state exceed the GPU's memory trains"]
    assert beyond[2:] == ["skipped: " + skipped["skipped"], "—"]


def test_without_matplotlib_bench_writes_the_json_and_skips_the_chart(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec now says it is not installed
    lines = []
    payload, written = suite.run_transport_bench(tmp_path, quick=True, repeats=2, log=lines.append)
    assert lines[0].startswith("note: matplotlib is not installed") and "chart skipped" in lines[0]
    assert [p.suffix for p in written] == [".json"] and not list(tmp_path.glob("*.png"))
    assert any("HostTable.gather" in line for line in lines)  # the table of figures is printed
    assert json.loads(written[0].read_text())["cpu"]["targets"] == payload["cpu"]["targets"]


def test_plain_bench_writes_beside_the_caller_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    written = sorted(p.name for p in (tmp_path / suite.DEFAULT_OUT).iterdir())
    assert written[0] == "transport-bench-" + ("gpu" if torch.cuda.is_available() else "cpu") + ".json"
    assert f"wrote {suite.DEFAULT_OUT}/{written[0]}" in out
    assert "median_ms" in out and "HostTable.gather" in out  # the figures, not only the paths


def test_an_installed_wheel_says_the_gpu_tests_are_not_there(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_tests, "find_tests", lambda: None)
    outcome = gpu_tests.run_gpu_tests(tmp_path, hide_gpu=False, timeout=10)
    assert outcome["status"] == "skipped" and "installed wheel" in outcome["reason"]


def _quick_and_hanging_gpu_tests(tmp_path, monkeypatch, quick, failing=False):
    """A checkout's tests as run_gpu_tests finds them: ``quick`` gpu tests that pass, then one that hangs.

    With ``failing``, a test that fails comes before the hanging one (which waits for it too).

    The hanging test begins once every quick one has passed (in workers they run beside it), and
    the run's timeout counts from then: counted from the start, it was used up on a loaded machine
    by pytest's start-up before the quick tests had run (passed 0 of 3 in two workers).

    Returns:
        A dict that holds, once the run is under way, ``"hung_at"``: ``time.perf_counter()`` when
        the hanging test began.
    """
    tests, marks = tmp_path / "tests", tmp_path / "marks"
    tests.mkdir()
    marks.mkdir()
    (tests / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'gpu: needs a GPU')\n")
    (tests / "test_cut.py").write_text(
        f"import pathlib, time, pytest\n\nMARKS = pathlib.Path({str(marks)!r})\n\n"
        f"@pytest.mark.gpu\n@pytest.mark.parametrize('i', range({quick}))\ndef test_quick(i):\n"
        f"    (MARKS / f'quick{{i}}').touch()\n\n"
        + ("@pytest.mark.gpu\ndef test_fails():\n    (MARKS / 'quick-failed').touch()\n"
           "    assert sum(range(4)) == 7, 'a distinctive failure'\n\n" if failing else "")
        + f"@pytest.mark.gpu\ndef test_hangs():\n"
        f"    while len(list(MARKS.glob('quick*'))) < {quick + failing}:\n        time.sleep(0.05)\n"
        f"    (MARKS / 'hanging').touch()\n    time.sleep(120)\n")
    monkeypatch.setattr(gpu_tests, "find_tests", lambda: tests)
    seen = {}

    class TimedFromTheHang(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is not None and not seen:  # the wait for the timeout: it starts with the hang
                deadline = time.perf_counter() + 120  # a suite that never gets there fails the test
                while not (marks / "hanging").exists() and self.poll() is None and time.perf_counter() < deadline:
                    time.sleep(0.05)
                seen["hung_at"] = time.perf_counter()
            return super().wait(timeout)

    monkeypatch.setattr(gpu_tests.subprocess, "Popen", TimedFromTheHang)
    return seen


def test_gpu_tests_cut_off_by_the_timeout_still_report_what_ran(tmp_path, monkeypatch):
    """Past the timeout pytest is interrupted, not killed: its report counts the tests that ran."""
    seen = _quick_and_hanging_gpu_tests(tmp_path, monkeypatch, quick=1)
    out = tmp_path / "out"
    out.mkdir()
    outcome = gpu_tests.run_gpu_tests(out, hide_gpu=False, timeout=5)
    assert time.perf_counter() - seen["hung_at"] < 60  # interrupted, not left to sleep
    assert outcome["status"] == "failed" and "timed out after 5 s and interrupted" in outcome["reason"]
    assert outcome["passed"] == 1 and outcome["failed"] == 0 and outcome["timeout_s"] == 5
    log = (out / "gpu-tests.log").read_text()
    assert "KeyboardInterrupt" in log and "test_hangs" in log
    assert [p.name for p in out.iterdir()] == ["gpu-tests.log"]  # the JUnit report was read, not kept


def test_gpu_tests_cut_off_by_the_timeout_keep_the_failed_tests_tracebacks(tmp_path, monkeypatch):
    """An interrupted pytest's log lists a failed test without its traceback: the report has it."""
    _quick_and_hanging_gpu_tests(tmp_path, monkeypatch, quick=1, failing=True)
    out = tmp_path / "out"
    out.mkdir()
    outcome = gpu_tests.run_gpu_tests(out, hide_gpu=False, timeout=5)
    assert outcome["status"] == "failed" and (outcome["passed"], outcome["failed"]) == (1, 1)
    assert outcome["failed_tests"] == ["tests.test_cut::test_fails"] and "failure_reports" not in outcome
    assert outcome["failures_log"] == gpu_tests.FAILURES_LOG and gpu_tests.FAILURES_LOG in outcome["reason"]
    report = (out / gpu_tests.FAILURES_LOG).read_text()
    assert report.startswith("tests.test_cut::test_fails\n")
    assert "a distinctive failure" in report and "assert sum(range(4)) == 7" in report


@pytest.mark.parametrize("cores, xdist, workers", [(16, True, 8), (64, True, 8), (8, True, 4), (3, True, 1),
                                                   (16, False, 1)])
def test_the_gpu_tests_run_in_workers_where_xdist_and_the_cores_allow(tmp_path, cores, xdist, workers):
    command, got = gpu_tests.pytest_command(tmp_path, tmp_path / "r.xml", cores=cores, xdist=xdist, timeout=True)
    assert got == workers
    assert ("-n" in command) == (workers > 1) and (workers == 1 or command[command.index("-n") + 1] == str(workers))
    assert "--timeout=60" in command and "--durations=25" in command and "-m" in command


@pytest.mark.parametrize("value, xdist, workers", [("1", True, 1), ("3", True, 3), ("1", False, 1)])
def test_the_environment_sets_the_gpu_test_workers_instead(tmp_path, value, xdist, workers):
    command, got = gpu_tests.pytest_command(tmp_path, tmp_path / "r.xml", cores=16, xdist=xdist, timeout=False,
                                            workers=value)
    assert got == workers and ("-n" in command) == (workers > 1)


@pytest.mark.parametrize("workers, given, threads", [(6, None, "2"), (8, None, "2"), (4, "3", "3"), (1, None, None)])
def test_each_gpu_test_worker_gets_its_share_of_the_cores(tmp_path, workers, given, threads):
    """Workers of one thread per core each oversubscribe the cores; OMP_NUM_THREADS set by hand is kept."""
    environ = {"PATH": "/bin", "PYTHONPATH": "/elsewhere", **({"OMP_NUM_THREADS": given} if given else {})}
    env = gpu_tests.gpu_test_environment(environ, tmp_path, cores=16, workers=workers, hide_gpu=True)
    assert env.get("OMP_NUM_THREADS") == threads and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/elsewhere"]) and env["PATH"] == "/bin"
    assert "OMP_NUM_THREADS" not in environ or environ["OMP_NUM_THREADS"] == given  # a copy, not changed


@pytest.mark.parametrize("value, xdist", [("0", True), ("two", True), ("-2", True), ("2", False)])
def test_a_bad_gpu_test_worker_count_is_refused_naming_the_variable(tmp_path, value, xdist):
    with pytest.raises(suite.ss.OptionError, match="SPEEDSWAP_GPU_TEST_WORKERS must be a positive whole number"):
        gpu_tests.pytest_command(tmp_path, tmp_path / "r.xml", cores=16, xdist=xdist, timeout=False, workers=value)


def test_gpu_tests_in_workers_cut_off_by_the_timeout_still_report_what_ran(tmp_path, monkeypatch):
    pytest.importorskip("xdist")  # the GPU machines have it; CI does not
    _quick_and_hanging_gpu_tests(tmp_path, monkeypatch, quick=3)
    monkeypatch.setattr(gpu_tests, "CORES_PER_WORKER", 1)  # two workers on this machine's cores
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for two workers")
    outcome = gpu_tests.run_gpu_tests(tmp_path, hide_gpu=False, timeout=5)
    assert outcome["workers"] == 2 and outcome["status"] == "failed"
    assert outcome["passed"] == 3 and "the log lists the tests 2 workers finished" in outcome["reason"]


def _gpu_case(row_bytes, dtype, gather, scatter, speedtorch, torch_pinned):
    """A transport case shaped as run_gpu_case returns it, with chosen ratios (to test the summary's logic)."""
    rows = [{"method": m, "median_ms": 1.0, "min_ms": 0.9, "max_ms": 1.2, "GB/s": speed}
            for m, speed in (("speedswap", 10.0), ("(a) SpeedTorch cupy", 10.0), ("(b) torch pinned", 10.0),
                             ("(d) pinned memcpy H2D", 10.0), ("(g) zero-copy kernel, consecutive rows", 12.5),
                             ("(e) device-to-device copy", 10.0))]
    return {"config": {"num_rows": 1000, "dim": row_bytes // 4, "num_ids": 100, "dtype": dtype,
                       "row_bytes": row_bytes, "repeats": 3, "load_average_before": [0.0, 0.0, 0.0],
                       "skipped": {} if speedtorch else {"(a) SpeedTorch cupy": "CuPy is not installed"}},
            "to_gpu": rows, "from_gpu": [dict(r, method=r["method"].replace("H2D", "D2H")) for r in rows[:5]],
            "targets": {"gather_fraction_of_h2d": gather, "scatter_fraction_of_d2h": scatter,
                        "round_trip_vs_speedtorch": speedtorch, "round_trip_vs_torch_pinned": torch_pinned}}


def test_summary_of_a_gpu_run_marks_each_target_met_or_not():
    machine = {"date": "d", "host": "h", "cpu": "c", "cores": 16, "ram_bytes": 2**37, "ram_available_bytes": 2**36,
               "load_average": [0.5, 0.5, 0.5], "gpu": "NVIDIA H100", "gpu_memory_bytes": 80 * 2**30,
               "driver": "580", "cuda": "12.8", "pcie_link": "5, 16", "torch": "2.9", "cupy": None,
               "numpy": "2.3", "python": "3.12", "speedswap": "0.1.0"}
    entry = {"vocab": 1_000_000, "distinct_rows_per_step": 9000.0, "ratio": 1 / 0.95, "throughput_ratio": 0.95,
             "pairs_per_s": {}, "load_average_before": None,
             "in_memory": {"median_s": 0.01, "min_s": 0.01, "max_s": 0.01, "repeats": 3, "interleaved": True,
                           "device_bytes": 1536 * 2**20, "device_peak_bytes": 1600 * 2**20},
             "offloaded": {"median_s": 0.0105, "min_s": 0.01, "max_s": 0.011, "repeats": 3, "interleaved": True,
                           "device_bytes": 64 * 2**20, "device_peak_bytes": 80 * 2**20},
             "cached": {"median_s": 0.0102, "min_s": 0.01, "max_s": 0.011, "repeats": 3, "interleaved": True,
                        "device_bytes": 300 * 2**20, "device_peak_bytes": 320 * 2**20},
             "cached_throughput_ratio": 0.98, "cached_gap_ratio": 0.4, "one_lookup_throughput_ratio": 0.85,
             "in_memory_one_lookup": {"median_s": 0.0085}, "offloaded_one_lookup": {"median_s": 0.01},
             "cached_one_lookup_throughput_ratio": 0.96, "cached_one_lookup": {"median_s": 0.0089}}
    old_entry = {key: value for key, value in entry.items() if "one_lookup" not in key}  # a run before them
    regression = {"shape": [1000, 1000], "batch": 2048, "device": "cuda", "feeder_over_limit": 1.5,
                  "limit": "pinned host-to-device copy",
                  "rows": [{"case": "BatchFeeder", "epoch_s": 1.5, "min_s": 1.4, "max_s": 1.6, "vs_limit": 1.5}]}
    job = {"setup": {"vocab": 100_000, "tokens": 4_000_000, "dim": 64, "epochs": 1, "batch_size": 2048,
                     "window": 5, "negatives": 5, "subsample": 1e-3, "rounds": 3, "cores": 16, "chance": 0.02},
           "contenders": [{"name": name, "words_per_second": speed, "topic_purity": 0.9, "runs": [{}] * 3}
                          for name, speed in [("cpu", 2e5), ("gpu", 1e6), ("gpu batch x4", 5e6), ("gensim", 1e6)]],
           "ratios": {"gpu": {"over_cpu": 5.0, "over_gensim": 1.0},
                      "gpu batch x4": {"over_cpu": 25.0, "over_gensim": 5.0}}, "skipped": {}}
    ran = lambda result: {"status": "ran", "reason": None, "seconds": 1.0, "json": "x.json", "result": result}  # noqa: E731
    record = {"mode": "full", "machine": machine, "seconds": 100.0, "budget_s": 480, "finished": True, "load_average_after": None,
              "steps": {"gpu tests": {"status": "skipped", "reason": "installed wheel", "seconds": 0.0},
                        "transport": ran({"gpu": [_gpu_case(512, "float32", 0.8, 0.7, None, 25.0)]}),
                        "training step": ran({"setup": {**dataclasses.asdict(training_step.StepShape()),
                                                        "device": "cuda", "in_memory": "e", "offloaded": "o",
                                                        "cached": "c", "one_lookup": "one call",
                                                        "device_memory": "m"},
                                              "results": [entry, {**old_entry, "vocab": 10_000_000}]}),
                        "feeder": ran({"regression": regression}),
                        "word2vec": ran(job),
                        "beyond gpu": ran({"beyond_gpu": {"vocab": 52_000_000, "state_bytes": 84 * 2**30,
                                                          "gpu_bytes": 80 * 2**30, "loss_before": 9.5,
                                                          "loss_after": 7.25, "pairs_per_s": 150_000.0,
                                                          "device_bytes": 64 * 2**20,
                                                          "device_peak_bytes": 96 * 2**20}})}}
    rows = {row[0]: row for row in target_rows(record)}
    case = "512 B float32 rows (SpeedTorch case)"
    assert rows[f"{case}: gather / pinned H2D copy bandwidth"][2:] == [0.8, "yes"]
    assert rows[f"{case}: scatter / pinned D2H copy bandwidth"][2:] == [0.7, "**no**"]
    speedtorch = rows[f"{case}: gather+scatter speed-up over SpeedTorch (CuPy on pinned memory)"]
    assert speedtorch[2] == "skipped: CuPy is not installed" and speedtorch[3] == "—"
    assert rows["training throughput offloaded / all-GPU, vocab 1,000,000 (interleaved)"][2:] == [0.95, "yes"]
    one_call = "the same, each step's ids looked up in one call (both sides), vocab"
    assert rows[f"{one_call} 1,000,000"][2:] == [0.85, "**no**"]
    assert f"{one_call} 10,000,000" not in rows  # a run that had no such contender
    cached_one_call = "the same with the cache, each step's ids looked up in one call (both sides), vocab"
    assert rows[f"{cached_one_call} 1,000,000"][2:] == [0.96, "yes"]
    assert f"{cached_one_call} 10,000,000" not in rows
    assert rows["training throughput offloaded / all-GPU, vocab 10,000,000 (interleaved)"][2:] == [0.95, "yes"]
    assert rows["training throughput with cache and prefetch / all-GPU, vocab 1,000,000"][2:] == [0.98, "yes"]
    assert rows["gap to all-GPU with the cache / without, vocab 1,000,000"][2:] == [0.4, "yes"]
    assert rows["GPU memory at vocab 1,000,000: all-GPU / offloaded (MiB, resident)"][2] == "1,536 / 64"
    beyond = rows["a vocabulary whose table + Adam state exceed the GPU's memory trains"]
    assert beyond[2:] == ["52,000,000 rows (1.05x the GPU's memory): loss 9.5000 -> 7.2500, 150,000 pairs/s, "
                          "64 MiB on the GPU (peak 96)", "yes"]
    assert rows["feeder epoch (FFCV regression shape) / pinned copy of the same bytes"][2:] == [1.5, "**no**"]
    assert rows["word2vec demo words/s: GPU (demo recipe) / the same job on this machine's CPU"][2:] == [5.0, "yes"]
    # The fastest GPU contender is the one held against gensim.
    fastest = "word2vec words/s: fastest GPU contender / gensim on this machine's cores (gpu batch x4)"
    assert rows[fastest][2:] == [5.0, "**no**"]
    text = render_summary(record)
    assert list(sections(text)) == SECTIONS
    assert ("pinned H2D 10.0 GB/s, pinned D2H 10.0 GB/s, device-to-device 10.0 GB/s, the same bytes as "
            "zero-copy kernel, consecutive rows 12.5 GB/s read, 12.5 GB/s written." in text)


def test_summary_of_failed_steps_still_lists_every_target_and_section():
    failed = {"status": "failed", "reason": "RuntimeError: boom", "seconds": 0.5}
    machine = dict.fromkeys(["date", "host", "cpu", "cores", "torch", "numpy", "python", "speedswap", "gpu",
                             "load_average"], "x")
    record = {"mode": "full", "machine": {**machine, "ram_bytes": 2**30, "ram_available_bytes": 2**29},
              "seconds": 500.0, "budget_s": 480, "finished": True, "steps": dict.fromkeys(suite.STEPS, failed)}
    text = render_summary(record)
    found = sections(text)
    assert list(found) == SECTIONS
    targets = target_rows(record)
    assert len(targets) == 12 and all("step failed (RuntimeError: boom)" in row[2] for row in targets)
    for name in ("Transport", "Training step", "Feeder", "word2vec", "Beyond the GPU's memory"):
        assert "not measured: RuntimeError: boom" in found[name]
    assert "over the 480 s budget" in found["Steps"]


def test_on_a_gpu_the_tests_written_for_it_run_first():
    """What a GPU run cut short by its time limit must not miss: the gpu-only tests, ahead of cuda cases."""
    def item(name, function_marks=(), module_marks=()):
        return SimpleNamespace(name=name, function=SimpleNamespace(pytestmark=list(function_marks)),
                               module=SimpleNamespace(pytestmark=module_marks))

    items = [item("a cuda case of a parametrised test"), item("b gpu only", [pytest.mark.gpu.mark]),
             item("c plain"), item("d in a gpu module", module_marks=pytest.mark.gpu.mark)]
    gpu_only_first(items)
    assert [i.name for i in items] == ["b gpu only", "d in a gpu module", "a cuda case of a parametrised test",
                                       "c plain"]


def test_a_word2vec_contender_that_raises_is_dropped_and_the_others_still_run(monkeypatch):
    pytest.importorskip("gensim")
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("cuSPARSE said no")
    monkeypatch.setattr(word2vec, "_gensim", broken)
    payload = word2vec.run(word2vec.DEMO_SIZES["tiny"], rounds=2, gpu=False)
    assert [c["name"] for c in payload["contenders"]] == ["cpu"] and len(payload["contenders"][0]["runs"]) == 2
    assert len(calls) == 1  # not tried again in round 2
    assert payload["skipped"]["gensim"] == "failed in round 1: RuntimeError: cuSPARSE said no"
    assert "Traceback" in payload["failures"]["gensim"]


def test_gensims_word2vec_contender_scores_a_corpus_that_leaves_words_unused():
    pytest.importorskip("gensim")
    size = dict(vocab=3000, topics=10, tokens=30_000, dim=16, epochs=1, batch_size=1024)
    corpus = synthetic_corpus(size["vocab"], size["topics"], size["tokens"], seed=0)
    # As in the demo's corpus (1,004 of its 100,000 words never occur): gensim's vocabulary lacks them.
    assert (corpus.counts == 0).any()
    sentences, words = word2vec._gensim_sentences(corpus)
    figures = word2vec._gensim(corpus, size, sentences, words, seed=0)  # was KeyError: "Key '611' not present"
    assert 0 <= figures["topic_purity"] <= 1 and figures["words_per_second"] > 0


def test_summary_when_the_demo_recipes_gpu_contender_failed_and_others_ran():
    job = {"ratios": {"gpu batch x4": {"over_cpu": 12.0, "over_gensim": 3.0}},
           "skipped": {"gpu": "failed in round 1: RuntimeError: boom"}}
    record = {"steps": {"word2vec": {"status": "ran", "result": job}}}
    rows = {row[0]: row for row in summary._word2vec_targets(record)}
    cpu = rows["word2vec demo words/s: GPU (demo recipe) / the same job on this machine's CPU"]
    assert cpu[2] == "skipped: gpu failed in round 1: RuntimeError: boom" and cpu[3] == "—"
    gensim = rows["word2vec words/s: fastest GPU contender / gensim on this machine's cores (gpu batch x4)"]
    assert gensim[2:] == [3.0, "**no**"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_transport_case_runs_every_contender(dtype):
    case = transport.run_gpu_case(num_rows=65_536, dim=64, num_ids=8192, dtype=dtype, repeats=2)
    methods = sorted(row["method"].split(" ")[0] for row in case["to_gpu"])
    if transport.cupy_missing():  # SpeedTorch's method needs CuPy; the run says why it is missing
        assert methods == ["(b)", "(c)", "(d)", "(e)", "(f)", "(g)", "speedswap"] and case["config"]["skipped"]
        assert case["targets"].pop("round_trip_vs_speedtorch") is None
    else:
        assert methods == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)", "speedswap"]
    assert all(value > 0 for value in case["targets"].values())
    back = sorted(row["method"].split(" ")[0] for row in case["from_gpu"])
    assert "(g)" in back and "(e)" not in back  # the kernel's contiguous write; no device-to-device way back


@pytest.mark.gpu
def test_speedtorch_baseline_holds_the_values_it_was_filled_with():
    cupy = pytest.importorskip("cupy")
    values = torch.randn(1000, 16).to(torch.bfloat16)
    table, _memory = transport._speedtorch_table(cupy, values)
    ids = torch.tensor([5, 999, 0, 5], device="cuda")
    rows = torch.from_dlpack(table[cupy.from_dlpack(ids)]).view(torch.bfloat16)
    assert torch.equal(rows.cpu(), values[ids.cpu()])


@pytest.mark.gpu
def test_gpu_training_and_feeder_measure_at_small_sizes():
    payload = training_step.run([5000], 2, torch.device("cuda"), training_step.StepShape(batch=256, dim=32),
                                beyond=False)
    entry = payload["results"][0]
    # The all-GPU table (plus Adam's state) is on the device; offloaded holds only the working set there.
    assert entry["in_memory"]["device_bytes"] >= 5000 * 32 * 4 * 3
    assert 0 < entry["offloaded"]["device_bytes"] < entry["in_memory"]["device_bytes"]
    result = feeder.regression(rows=4096, epochs=2, workers=0, device=torch.device("cuda"), dim=64, batch=512)
    assert result["feeder_over_limit"] > 0 and np.isfinite(result["feeder_over_limit"])


@pytest.mark.gpu
def test_beyond_the_gpu_trains_a_vocabulary_larger_than_the_memory_it_is_told_of():
    """The real case fills more host RAM than the GPU has memory; told of 64 MiB, it runs in seconds."""
    shape = training_step.StepShape(batch=256, dim=32)
    entry = training_step.beyond_gpu(torch.device("cuda"), 5, shape, gpu_bytes=64 << 20)
    assert entry["state_bytes"] > entry["gpu_bytes"] == 64 << 20
    assert entry["loss_after"] < entry["loss_before"]
    assert 0 < entry["device_bytes"] < entry["gpu_bytes"]


def test_beyond_the_gpu_is_skipped_off_a_gpu():
    entry = training_step.beyond_gpu(torch.device("cpu"), 2, training_step.StepShape(batch=32, dim=8))
    assert entry == {"skipped": "no GPU memory to exceed on the CPU"}


@pytest.mark.parametrize("name", list(word2vec.GPU_CONTENDERS), ids=lambda name: f"{name} recipe")
def test_every_gpu_contenders_recipe_trains_the_tiny_job_on_the_cpu(name):
    """The recipes differ from the CPU's in options, not in the device: each must train the job
    the gpu test below runs. A fixed 32,768 pairs a step diverged on its 2,000 words (an H200 run
    caught it): the contender raised, and the GPU figures lost it."""
    size = word2vec.DEMO_SIZES["tiny"]
    corpus = synthetic_corpus(size["vocab"], size["topics"], size["tokens"], seed=3)
    result = word2vec._speedswap(corpus, size, "numpy", 3, **word2vec.GPU_CONTENDERS[name])
    assert result["topic_purity"] > 5 * result["chance"] and np.isfinite(result["final_loss"])


@pytest.mark.gpu
def test_gpu_word2vec_job_runs_every_contender_and_trains():
    payload = word2vec.run(word2vec.DEMO_SIZES["tiny"], rounds=1, gpu=True, gensim=False)
    names = [c["name"] for c in payload["contenders"]]
    assert names == ["cpu", *word2vec.GPU_CONTENDERS]
    chance = payload["setup"]["chance"]
    # The demo's recipe learns the planted topics on the GPU as on the CPU (the demo's own check).
    assert all(c["topic_purity"] > 5 * chance for c in payload["contenders"] if c["name"] in ("cpu", "gpu"))
    assert all(r["over_cpu"] > 0 and r["over_gensim"] is None for r in payload["ratios"].values())


def test_every_helper_the_benchmark_scripts_call_on_common_exists():
    """benchmarks/*.py call helpers of benchmarks/common.py; one that moved away broke two scripts at run time."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    used = {(script.name, name) for script in (ROOT / "benchmarks").glob("*.py")
            for name in re.findall(r"\bcommon\.(\w+)", script.read_text())}
    assert used and all(hasattr(common, name) for _, name in used), \
        sorted(f"{s}: common.{n}" for s, n in used if not hasattr(common, n))


@pytest.mark.parametrize("build", ["in_memory", "offloaded", "cached"])
def test_one_lookup_a_step_is_the_same_loss_and_training(build, seed):
    """The benchmark's one-lookup contenders train what the three-lookup ones do: the same loss
    on every step, and tables equal up to the order gradients are summed in."""
    shape = training_step.StepShape(batch=64, dim=8)
    batches = training_step.zipf_batches(2000, 6, torch.device("cpu"), shape, seed=seed)
    tables, losses = [], []
    for loss in (training_step.skipgram_loss, training_step.skipgram_loss_one_lookup):
        torch.manual_seed(seed)  # both losses start from the same tables
        emb, opt = training_step._BUILDS[build](2000, torch.device("cpu"), shape)
        offloaded = build != "in_memory"
        if offloaded:
            emb.table.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(seed))
        seen = []
        for center, context, negatives in batches:
            value = loss(emb, center, context, negatives)
            seen.append(value.item())
            value.backward()
            opt.step()
            opt.zero_grad()
        losses.append(seen)
        tables.append(emb.table.to_numpy(copy=True) if offloaded else emb.weight.detach().numpy().copy())
    assert losses[0][0] == losses[1][0]  # the same rows, the same arithmetic
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    np.testing.assert_allclose(tables[0], tables[1], rtol=1e-5, atol=1e-6)
    assert len(set(losses[0])) == len(losses[0])  # it trained: every step's loss differs


@pytest.mark.parametrize("version, line", [("v2", "0::/\n"), ("v1", "4:memory:/\n")])
def test_the_benchmarks_size_their_data_by_the_ram_the_containers_limit_still_grants(tmp_path, monkeypatch,
                                                                                     version, line):
    """The benchmarks read MemAvailable, the host's: in a container of 3 GiB on an 8 GiB host they
    were told of 8 GiB and sized tables the limit kills the process for."""
    from speedswap.backends import cpu
    monkeypatch.setattr(cpu, "_meminfo_available", lambda: 8 << 30)
    fake_cgroups(monkeypatch, tmp_path, version, line, {"": (3 << 30, 2 << 30, 256 << 20)})
    room = (1 << 30) + (256 << 20)
    assert timing.available_ram() == room
    assert timing.machine()["ram_available_bytes"] == room


def test_the_eval_read_benchmark_reads_fewer_rows_through_a_cache_and_keeps_its_bytes(tmp_path):
    """``benchmarks/eval_read.py --quick``: every field of its JSON, and the properties its figures rest on.

    On Zipf ids an eval forward through a cache reads fewer rows from the host
    than one without (each uncached row once, where no cache reads one per id);
    a forward ten training steps wide leaves ``cache_bytes`` as it was.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/eval_read.py", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "eval_read-quick-cpu.json").read_text())
    assert result["benchmark"] == "eval_read-quick" and result["quick"]
    assert {"cpu", "cores", "load_average", "torch"} <= set(result["machine"])
    rows = {(r["distribution"], r["cache_fraction"]): r for r in result["rows"]}
    assert set(rows) == {(d, f) for d in ("zipf 1.1", "uniform") for f in (0.0, 0.01, 0.05, 0.2)}
    row_bytes = result["dim"] * 4
    for (distribution, fraction), row in rows.items():
        assert row["forwards"] == result["repeats"] and row["ids_per_forward"] == result["ids"]
        assert row["forward_s_p25"] <= row["forward_s_median"] <= row["forward_s_p75"]
        assert len(row["loadavg_1min"]) == result["repeats"]
        assert row["bytes_h2d_per_forward"] == row["rows_h2d_per_forward"] * row_bytes
        assert row["cache_bytes_after_wide_forward"] == row["cache_bytes_before_wide_forward"]
        assert row["wide_forward_ids"] == 10 * result["train_ids_per_step"]
        # Every cache is full when its forwards are timed, after the shared steps and at most 10x more.
        assert not row["filling"]
        assert result["train_steps"] <= row["train_steps"] <= 11 * result["train_steps"]
        if fraction:
            assert row["cache_bytes_before_wide_forward"] > 0
            # Each uncached row once: no more rows than the ids the cache missed.
            assert row["rows_h2d_per_forward"] <= row["ids_per_forward"] * (1 - row["hit_rate"])
        else:
            assert row["hit_rate"] == 0 and row["rows_h2d_per_forward"] == row["ids_per_forward"]
            assert row["time_vs_no_cache"] == row["rows_h2d_vs_no_cache"] == 1
        assert (row["ideal_hit_rate"] is None) == (distribution == "uniform")
    for fraction in (0.01, 0.05, 0.2):
        cached = rows["zipf 1.1", fraction]
        assert 0 < cached["hit_rate"] and cached["rows_h2d_vs_no_cache"] < 1
        assert cached["rows_h2d_per_forward"] < rows["zipf 1.1", 0.0]["rows_h2d_per_forward"]



@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_as_a_disk_epoch_drops_its_file_from_the_cache_leaves_no_descriptor(tmp_path, rng):
    """The disk benchmark dropped its file from the page cache through a descriptor opened before the
    try that closes it: a Ctrl-C once os.open had returned left the file open (its gigabytes of disk
    space too, once the benchmark removed it) for as long as the process lived. KeyboardInterrupt is
    raised at each place an interrupt can land in feeder.py and atomic.py during a disk epoch of one
    batch, one per epoch; after each, no descriptor of tmp_path is open."""
    path = str(tmp_path / "x.npy")
    np.save(path, rng.standard_normal((64, 4)).astype(np.float32))

    def epoch(counting):
        counting(True)
        feeder._disk_epoch(path, "block", batch=16, max_seconds=60, max_batches=1)
        counting(False)

    _assert_no_descriptor_left_by_interrupts(epoch, (feeder, atomic), tmp_path, "a disk epoch")


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_as_the_disk_case_makes_its_file_leaves_neither_a_descriptor_nor_the_file(
        tmp_path, monkeypatch):
    """disk() made its file with tempfile.mkstemp, closed the descriptor mkstemp returns, and only then
    entered the try that removes the file: a Ctrl-C once mkstemp's open had returned left that
    descriptor open for good, and one once the close had returned left the file. KeyboardInterrupt is
    raised at each place an interrupt can land in feeder.py, atomic.py and tempfile as the file is made
    (until it is written), one per disk case; after each, no descriptor of the directory is open and
    nothing is left in it."""
    directory = tmp_path / "bench"
    directory.mkdir()
    # tempfile's first name is drawn under a lock of its own, which an interrupt there would keep (every
    # later tempfile name in this process would wait for it): drawn once before the sweep.
    with tempfile.TemporaryDirectory(dir=tmp_path):
        pass
    counting_of_this_case, debris = [], []
    write_big = feeder._write_big

    def written(*args, **kwargs):  # the sweep stops here: the file is made (its epochs are swept above)
        counting_of_this_case[-1](False)
        write_big(*args, **kwargs)

    monkeypatch.setattr(feeder, "_write_big", written)

    def make_the_file(counting):
        counting_of_this_case.append(counting)
        counting(True)
        try:
            feeder.disk(0.0001, str(directory), batch=8, max_seconds=60, repeats=1, warmup_batches=0)
        finally:
            counting(False)
            if os.listdir(directory):
                debris.append(sorted(os.listdir(directory)))
                for name in os.listdir(directory):
                    os.unlink(directory / name)

    points, left = _descriptors_left_by_interrupts(make_the_file, (feeder, atomic, tempfile), directory)
    assert any("open" in point for point in points), points
    assert not left and not debris, f"a disk case interrupted at {left}, leaving {debris} (of {points})"
