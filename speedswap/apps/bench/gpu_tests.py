"""Run the checkout's ``gpu``-marked tests in a subprocess and read back what happened.

The tests ship with the source, not with the wheel: :func:`find_tests`
looks for a ``tests/`` directory beside the installed package, and an
installed wheel without one is reported as such, not as a pass.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Mapping, Optional

import speedswap as ss

__all__ = ["find_tests", "pytest_command", "gpu_test_environment", "run_interruptibly", "run_gpu_tests", "read_junit"]

#: Seconds an interrupted pytest gets to write its report before it is killed.
GRACE_S = 15
#: Seconds one gpu test may take where pytest-timeout is installed (the GPU machines have it):
#: their numpy twins take under 10 s each on 2 CPU cores, so more is a hang, which must not eat
#: the run's budget.
TEST_TIMEOUT_S = 60
#: Where each failed test's traceback goes, beside the log: an interrupted pytest prints none
#: (stop 46's 54 failures on an H200 needed a second call to see why), but its report has them.
FAILURES_LOG = "gpu-tests-failures.log"
#: The slowest tests the log lists (pytest's --durations): what to resize when the tests overrun.
SLOWEST_LISTED = 25
#: CPU cores per pytest worker where pytest-xdist is installed (the GPU machines have it, and
#: 16 cores): the tests spend much of their time on the CPU, and every worker shares one GPU.
#: On an H200 with 16 cores the ~650 gpu tests took 168 s in 6 workers; 4 had done 59% in 135 s;
#: at 0b7eb58 948 of the ~1010 took 196 s in 7.
CORES_PER_WORKER = 2
#: At most this many workers: each holds a CUDA context of its own on the one GPU (7 ran side
#: by side on an H200, 2026-11-29).
MAX_WORKERS = 8
#: The environment variable that sets the workers instead (1: in pytest's own process), for a
#: run whose tests misbehave side by side.
WORKERS_VARIABLE = "SPEEDSWAP_GPU_TEST_WORKERS"


def find_tests() -> Optional[Path]:
    """The ``tests/`` directory of the checkout this speedswap runs from, or None (an installed wheel)."""
    tests = Path(ss.__file__).resolve().parent.parent / "tests"
    return tests if (tests / "conftest.py").is_file() else None


def run_interruptibly(command: list, *, cwd: os.PathLike, env: dict, log: os.PathLike, timeout: float,
                      grace: float = GRACE_S) -> tuple:
    """Run ``command`` with its output going to ``log`` as it comes; past ``timeout`` interrupt it.

    Interrupting is SIGINT, as Ctrl-C would, then a kill after ``grace``:
    pytest answers SIGINT by ending the session and still writes its
    ``--junitxml`` report, so a suite cut off by a time limit says what
    passed and, in its verbose log, which test it stopped in. The log is
    written while the command runs, so even a kill from outside leaves it.

    Returns:
        (returncode, interrupted): the exit status (None when it had to be
        killed) and whether the timeout was reached.
    """
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)
        try:
            return process.wait(timeout=grace), True
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None, True


def read_junit(path: os.PathLike) -> dict:
    """Counts, and the failed tests' names and tracebacks, from a pytest ``--junitxml`` report.

    Returns:
        ``{"tests", "passed", "failed", "errors", "skipped", "seconds", "failed_tests",
        "failure_reports", "skip_reasons"}``; a failure report is the test's name, its
        failure's message and its traceback, one per line block.
    """
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed, reports, reasons = [], [], set()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for failure in (*case.iter("failure"), *case.iter("error")):
            if name not in failed:
                failed.append(name)
            reports.append(f"{name}\n{failure.get('message', '')}\n{(failure.text or '').strip()}")
        skipped = case.find("skipped")
        if skipped is not None:
            reasons.add(skipped.get("message", ""))
    return {"tests": counts["tests"], "failed": counts["failures"], "errors": counts["errors"],
            "skipped": counts["skipped"],
            "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "seconds": sum(float(s.get("time", 0)) for s in suites),
            "failed_tests": failed, "failure_reports": reports, "skip_reasons": sorted(reasons)}


def run_gpu_tests(out_dir: os.PathLike, *, hide_gpu: bool, timeout: float) -> dict:
    """Run ``python -m pytest -m gpu tests/`` of the checkout; its log goes to ``out_dir``.

    The subprocess imports the checkout's own package (its root goes first on
    ``PYTHONPATH``), so the tests check the code that is being benchmarked.
    pytest's JUnit report is read into the result and not kept: the log
    (verbose, with the slowest tests listed) is the file this writes, and
    :data:`FAILURES_LOG` beside it when tests failed (each one's traceback,
    from the report: an interrupted run's log has none).

    Args:
        out_dir: where ``gpu-tests.log`` is written.
        hide_gpu: run with ``CUDA_VISIBLE_DEVICES=""``, so every gpu test
            reports skipped (the dry run exercises the plumbing on a CPU).
        timeout: seconds before the run is interrupted and reported as failed
            (timed out); the tests that ran until then are still counted.

    Returns:
        ``{"status": "ran" | "skipped" | "failed", "reason", "command", "timeout_s", ...}``
        plus :func:`read_junit`'s counts when pytest wrote its report.
    """
    tests = find_tests()
    if tests is None:
        return {"status": "skipped",
                "reason": "no tests directory next to the package: this speedswap is an installed "
                          "wheel; run bench --all from a checkout (pip install -e .) to include the gpu tests"}
    with tempfile.TemporaryDirectory() as scratch:
        return _run(tests, Path(out_dir) / "gpu-tests.log", Path(scratch) / "gpu-tests.xml",
                    hide_gpu=hide_gpu, timeout=timeout)


def pytest_command(tests: os.PathLike, xml: os.PathLike, *, cores: int, xdist: bool, timeout: bool,
                   workers: Optional[str] = None) -> tuple:
    """The pytest command line of the gpu tests, and how many workers it runs them in.

    Args:
        tests: the tests directory.
        xml: where pytest writes its JUnit report.
        cores: this machine's CPU cores.
        xdist: pytest-xdist is installed: the tests run in one worker per
            :data:`CORES_PER_WORKER` cores (at most :data:`MAX_WORKERS`), so
            more of them fit in the run's budget. An interrupted run still
            writes its report (the controller writes it).
        timeout: pytest-timeout is installed: one test may take at most
            :data:`TEST_TIMEOUT_S`.
        workers: the :data:`WORKERS_VARIABLE` environment variable's value,
            when set: that many workers instead (1: none).

    Returns:
        (command, workers): the argument list, and 1 when the tests run in
        pytest's own process.

    Raises:
        OptionError: ``workers`` is not a positive whole number, or asks for
            more than one without pytest-xdist.
    """
    command = [sys.executable, "-m", "pytest", "-m", "gpu", str(tests), "-v", "-rs", "--tb=short",
               "-p", "no:cacheprovider", f"--durations={SLOWEST_LISTED}", f"--junitxml={xml}"]
    if workers is None:
        workers = min(MAX_WORKERS, cores // CORES_PER_WORKER) if xdist else 1
    elif not workers.strip().isdigit() or int(workers) < 1 or (int(workers) > 1 and not xdist):
        raise ss.OptionError(f"{WORKERS_VARIABLE} must be a positive whole number of pytest workers (1: "
                             f"none; more needs pytest-xdist{'' if xdist else ', which is not installed'}), "
                             f"got {workers!r}")
    else:
        workers = int(workers)
    if workers > 1:
        # Workers take tests in collection order, so the gpu-only tests still go first.
        command += ["-n", str(workers)]
    if timeout:
        # One hung test (a stream waiting forever) fails alone instead of eating the whole budget.
        command.append(f"--timeout={TEST_TIMEOUT_S}")
    return command, max(workers, 1)


def gpu_test_environment(environ: Mapping[str, str], root: Path, *, cores: int, workers: int,
                     hide_gpu: bool) -> dict:
    """The environment the gpu tests run in.

    Args:
        environ: the environment to start from (``os.environ``).
        root: the checkout, put first on ``PYTHONPATH`` so its speedswap is the one tested.
        cores: this machine's CPU cores.
        workers: the pytest workers sharing them.
        hide_gpu: set ``CUDA_VISIBLE_DEVICES`` empty.

    Returns:
        A new dict. In several workers, ``OMP_NUM_THREADS`` (unless set) is each worker's
        share of the cores: torch and the word2vec job start a thread per core otherwise, and
        the workers' threads together oversubscribe the cores (the word2vec job's test, CPU
        bound for part of its run, ran past its 60 s in 6 and in 8 workers on an H100's 16
        cores; alone on 2 cores here its CPU half takes about 5 s).
    """
    env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), environ.get("PYTHONPATH")]))}
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if workers > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))
    return env


def _run(tests: Path, log: Path, xml: Path, *, hide_gpu: bool, timeout: float) -> dict:
    """:func:`run_gpu_tests` once the tests are found: the JUnit report goes to ``xml``."""
    root = tests.parent
    command, workers = pytest_command(tests, xml, cores=os.cpu_count() or 1,
                                      xdist=importlib.util.find_spec("xdist") is not None,
                                      timeout=importlib.util.find_spec("pytest_timeout") is not None,
                                      workers=os.environ.get(WORKERS_VARIABLE))
    env = gpu_test_environment(os.environ, root, cores=os.cpu_count() or 1, workers=workers, hide_gpu=hide_gpu)
    start = time.perf_counter()
    returncode, interrupted = run_interruptibly(command, cwd=root, env=env, log=log, timeout=timeout)
    result = {"command": "python " + " ".join(command[1:6]), "returncode": returncode,
              "wall_seconds": time.perf_counter() - start, "timeout_s": timeout, "workers": workers,
              "cuda_hidden": hide_gpu,
              "log": log.name}
    timed_out = f"timed out after {timeout:.0f} s"
    if not xml.exists():
        why = timed_out if interrupted else f"pytest exited {returncode} without a report"
        return {**result, "status": "failed", "reason": f"{why} (see {log.name})"}
    counts = read_junit(xml)
    reports = counts.pop("failure_reports")
    failures = f"; tracebacks in {FAILURES_LOG}" if reports else ""
    if reports:
        (log.parent / FAILURES_LOG).write_text("\n\n".join(reports) + "\n")
        result["failures_log"] = FAILURES_LOG
    # pytest exits 0 (all passed or skipped), 1 (failures) or 5 (no gpu tests collected).
    passed = returncode in (0, 5) and not counts["failed"] and not counts["errors"] and not interrupted
    status, reason = ("ran", None) if passed else ("failed", None)
    if interrupted:
        running = ("the log's last test line names the one that was running" if workers == 1 else
                   f"the log lists the tests {workers} workers finished")
        reason = (f"{timed_out} and interrupted: the counts are of the tests that ran until then; "
                  f"{running} (see {log.name}{failures})")
    elif not passed:
        reason = f"{counts['failed']} failed, {counts['errors']} errors (see {log.name}{failures})"
    elif hide_gpu:
        reason = "dry run: CUDA hidden from the tests, so every gpu test reports skipped"
    return {**result, **counts, "status": status, "reason": reason}
