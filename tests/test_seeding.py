"""The suite's seeds: the seed a run prints (SPEEDSWAP_SEED) replays its hypothesis tests too."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Records every example hypothesis draws. The first is always the simplest one (0),
# whatever the seed, so the run's whole list is compared, not its first example.
# No deadline: run without CI, hypothesis keeps its default of 200 ms, and one file write
# a loaded runner stalls past it fails the test ("Unreliable test timings"; a 300 ms
# sleep in one example did).
DRAWING_TEST = '''
from hypothesis import given, settings, strategies as st


@settings(max_examples=10, database=None, deadline=None)
@given(st.integers(0, 2**62))
def test_draws(n):
    with open("draws.txt", "a") as draws:
        draws.write(f"{n}\\n")
'''


def run_drawing_test(directory, speedswap_seed, ci):
    """Run DRAWING_TEST under tests/conftest.py in a fresh pytest process.

    Args:
        directory: an empty directory of the test's own; the run's files go there.
        speedswap_seed: the SPEEDSWAP_SEED to run with, or None to leave it unset.
        ci: run with ``CI`` set (hypothesis then loads its "ci" profile), else with it unset.

    Returns:
        (the hypothesis seed the run printed, the examples it drew in order).
    """
    shutil.copy(Path(__file__).with_name("conftest.py"), directory)
    (directory / "test_draws.py").write_text(DRAWING_TEST)
    (directory / "draws.txt").unlink(missing_ok=True)
    env = {name: value for name, value in os.environ.items() if name not in ("SPEEDSWAP_SEED", "CI")}
    if ci:
        env["CI"] = "true"
    if speedswap_seed is not None:
        env["SPEEDSWAP_SEED"] = str(speedswap_seed)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "test_draws.py"],
                         cwd=directory, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    printed = re.search(r"hypothesis seed for test_draws: (\d+) \(replay with SPEEDSWAP_SEED=\1\)", run.stdout)
    assert printed, run.stdout
    return int(printed.group(1)), (directory / "draws.txt").read_text().split()


@pytest.mark.slow  # three pytest processes, each importing torch
@pytest.mark.parametrize("ci", [False, True], ids=["local", "CI"])
def test_the_printed_seed_replays_a_hypothesis_run_and_an_unseeded_run_is_fresh(tmp_path, ci):
    """Under CI hypothesis's "ci" profile derandomised every run: the same examples each time
    whatever the seed, so CI never drew fresh ones (this test failed there, same draws)."""
    first_seed, first = run_drawing_test(tmp_path, None, ci)
    second_seed, second = run_drawing_test(tmp_path, None, ci)
    # No SPEEDSWAP_SEED: a fresh seed each run, and another seed draws other examples.
    assert second_seed != first_seed and second != first
    replay_seed, replayed = run_drawing_test(tmp_path, first_seed, ci)
    assert replay_seed == first_seed and replayed == first
