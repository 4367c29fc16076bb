"""The built wheel works on its own: installed in a fresh venv, run from outside the checkout.

Nothing in the package may load files from the source tree; this is where
that would show (``bench`` once imported ``benchmarks/*.py`` by path). The
venv borrows torch and numpy from the interpreter running the tests (by path)
and nothing is downloaded.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd, timeout=300):
    """Run a command; returns stdout, failing the test with its output otherwise."""
    # Without the caller's PYTHONPATH (which may name the checkout) and with one
    # torch thread, as the suite shares a small machine.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # UTF-8 named: pip prints non-ASCII, and the decoding would otherwise follow the process's locale,
    # which the suite on torch 2.6 saw turn ASCII midway (.ci/oldest).
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          encoding="utf-8", timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    """The python of a fresh venv with the speedswap wheel built from this checkout installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Build from a copy of the sources, so the checkout gets no build/ or egg-info from us.
    source = tmp / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "speedswap", source / "speedswap", ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: an isolated build would download setuptools.
    _run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-w", tmp / "dist"],
         cwd=tmp)
    (wheel,) = (tmp / "dist").glob("speedswap-*.whl")
    _run([sys.executable, "-m", "venv", "--system-site-packages", tmp / "venv"], cwd=tmp)
    python = tmp / "venv" / "bin" / "python"
    # The system site-packages are those of the base interpreter, which has no torch when this
    # suite runs in a virtual environment (./dev's .venv): borrow this interpreter's torch and
    # numpy by path, after the venv's own site-packages (so the wheel installed there wins).
    import numpy
    import torch
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    borrowed = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (torch, numpy))
    (site / "borrowed-torch-numpy.pth").write_text("\n".join(borrowed) + "\n")
    # --force-reinstall: a speedswap installed in the system site-packages must not satisfy it.
    _run([python, "-m", "pip", "install", "--no-deps", "--force-reinstall", wheel], cwd=tmp)
    return python


@pytest.mark.slow
def test_the_installed_wheel_is_the_one_imported(venv_python, tmp_path):
    where = Path(_run([venv_python, "-c", "import speedswap; print(speedswap.__file__)"], cwd=tmp_path).strip())
    assert where.is_relative_to(venv_python.parent.parent), where
    assert not where.is_relative_to(ROOT)


@pytest.mark.slow
def test_the_installed_wheel_runs_bench_help_and_the_demo(venv_python, tmp_path):
    out = _run([venv_python, "-m", "speedswap", "bench", "--help"], cwd=tmp_path)
    assert "--all" in out and "(default: speedswap-bench)" in out
    out = _run([venv_python, "-m", "speedswap", "demo", "--tiny", "--no-progress", "--device", "cpu"], cwd=tmp_path)
    assert "topic purity" in out and "words/s" in out


@pytest.mark.slow
def test_the_installed_wheel_runs_the_dry_suite_without_the_tests(venv_python, tmp_path):
    _run([venv_python, "-m", "speedswap", "bench", "--all", "--dry-run", "--out", "results"], cwd=tmp_path)
    summary = (tmp_path / "results" / "SUMMARY.md").read_text(encoding="utf-8")
    assert "installed wheel" in summary  # the gpu tests are not there, and the summary says so
    assert (tmp_path / "results" / "transport-cpu.json").exists()
