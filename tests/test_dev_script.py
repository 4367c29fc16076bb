"""``./dev``: what it installs on which machine.

The plans come from ``./dev --plan``, which runs the real setup code with a runner that
prints commands instead of running them. The machine is faked where the decision reads
it: an ``nvidia-smi`` script first (only) on PATH, pip's find-links pointed at a folder
with a dummy wheel, and PyTorch's index served from a local folder (``DEV_TORCH_INDEX``).
"""

import functools
import http.server
import importlib.machinery
import importlib.util
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
DEV = ROOT / "dev"
CP = "cp%d%d" % sys.version_info[:2]
MACHINE = platform.machine()
# manylinux2014 (glibc 2.17) so the fake wheels fit any Linux this runs on.
WHEEL = "torch-{version}-{cp}-{cp}-manylinux2014_{machine}.whl"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="./dev chooses among torch builds on Linux only")


def load_dev():
    """The script as a module (it has no .py suffix), for its pure functions."""
    loader = importlib.machinery.SourceFileLoader("dev_script", str(DEV))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("dev_script", loader))
    sys.modules["dev_script"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


dev = load_dev()


def banner(cuda, driver="570.86.15"):
    """nvidia-smi's output on an H100, as printed by the real tool."""
    return textwrap.dedent(f"""\
        Tue Mar  4 10:12:01 2025
        +-----------------------------------------------------------------------------------------+
        | NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |
        |-----------------------------------------+------------------------+----------------------+
        | GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
        | Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
        |                                         |                        |               MIG M. |
        |=========================================+========================+======================|
        |   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |                    0 |
        | N/A   31C    P0             71W /  700W |       1MiB /  81559MiB |      0%      Default |
        |                                         |                        |             Disabled |
        +-----------------------------------------+------------------------+----------------------+

        +-----------------------------------------------------------------------------------------+
        | Processes:                                                                              |
        |  GPU   GI   CI              PID   Type   Process name                        GPU Memory |
        |        ID   ID                                                               Usage      |
        |=========================================================================================|
        |  No running processes found                                                             |
        +-----------------------------------------------------------------------------------------+
        """)


def fake_nvidia_smi(bin_dir, stdout, query_stdout="", exit_code=0):
    """An ``nvidia-smi`` that prints ``stdout`` (``query_stdout`` for ``-q``) and exits."""
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      f"sys.stdout.write({query_stdout!r} if '-q' in sys.argv else {stdout!r})\n"
                      f"sys.exit({exit_code})\n")
    script.chmod(0o755)


@pytest.fixture
def torch_index(tmp_path):
    """PyTorch's wheel index, served locally: cpu, cu128 and cu130 pages listing an old and a
    new torch for this Python, and a newer one for another Python that must be passed over."""
    root = tmp_path / "index"
    for flavour in ("cpu", "cu128", "cu130"):
        page = root / flavour / "torch"
        page.mkdir(parents=True)
        names = [WHEEL.format(version=f"{v}%2B{flavour}", cp=cp, machine=MACHINE)
                 for v, cp in (("2.8.0", CP), ("2.9.0", CP), ("3.1.0", "cp27"))]
        page.joinpath("index.html").write_text("".join(
            f'<a href="/whl/{flavour}/{n}#sha256=00">{n}</a><br/>\n' for n in names))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def closed_port_url():
    """A URL nothing answers on: the index is unreachable.

    The port stays bound, never listening, for the whole test: a connection is
    refused, and no other process (a test running beside) can take the port
    and answer, as it could once a port found free was closed again.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def machine(tmp_path):
    """An empty PATH folder for a fake nvidia-smi, and an empty find-links folder."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "links").mkdir()
    return tmp_path


def plan(machine, index, *args):
    """Run ``./dev --plan ARGS`` on the faked machine; returns (its output, the commands)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DEV_"))}
    env.update(PATH=str(machine / "bin"), PIP_CONFIG_FILE=os.devnull,  # no pip.conf, no find-links
               PIP_FIND_LINKS=str(machine / "links"), DEV_VENV=str(machine / "venv"),
               DEV_TORCH_INDEX=index, no_proxy="127.0.0.1", NO_PROXY="127.0.0.1")  # a proxy can't reach our index
    result = subprocess.run([sys.executable, str(DEV), "--plan", *args], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (machine / "venv").exists(), "a dry run must create nothing"
    commands = [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]
    return result.stdout, commands


def pip_installs(commands):
    """The arguments of each ``pip install`` in order, without pip's output options."""
    return [[a for a in cmd[4:] if a not in ("--progress-bar", "off")]
            for cmd in commands if cmd[1:4] == ["-m", "pip", "install"]]


@linux_only
def test_no_gpu_installs_the_local_cpu_wheel_then_the_cpu_index(machine, torch_index):
    wheel = machine / "links" / WHEEL.format(version="9.9.9+cpu", cp=CP, machine=MACHINE)
    wheel.write_bytes(b"")  # never installed: the plan only names it
    (machine / "links" / WHEEL.format(version="9.9.9+cu128", cp=CP, machine=MACHINE)).write_bytes(b"")
    out, commands = plan(machine, torch_index, "test", "-m", "not slow")
    assert "no nvidia-smi on PATH" in out
    assert commands[0][1:3] == ["-m", "venv"]
    assert pip_installs(commands) == [
        [str(wheel)],  # first the local wheel, ...
        ["torch==2.9.0+cpu", "--index-url", f"{torch_index}/cpu"],  # ... if that fails the CPU index,
        ["torch"],  # ... and last the default index
        ["--editable", f"{ROOT}[test]"],
    ]
    assert commands[-1][1:] == ["-m", "pytest", "-m", "not slow"]


@linux_only
def test_no_gpu_and_unreachable_cpu_index_falls_back_to_the_default_index_quickly(machine, closed_port_url):
    start = time.monotonic()
    out, commands = plan(machine, closed_port_url, "demo", "--tiny")
    assert time.monotonic() - start < 30
    assert f"{closed_port_url}/cpu could not be read" in out
    assert "about 2.5 GB of CUDA libraries" in out  # the fallback says what it costs
    assert pip_installs(commands) == [["torch"], ["--editable", str(ROOT)]]
    assert commands[-1][1:] == ["-m", "speedswap", "demo", "--tiny"]


@linux_only
@pytest.mark.parametrize("cuda, build, extra", [("12.8", "cu128", "cuda12"), ("13.0", "cu130", "cuda13")])
def test_gpu_installs_the_cuda_build_of_torch_and_the_matching_cupy(machine, torch_index, cuda, build, extra):
    fake_nvidia_smi(machine / "bin", banner(cuda))
    (machine / "links" / WHEEL.format(version="9.9.9+cpu", cp=CP, machine=MACHINE)).write_bytes(b"")
    out, commands = plan(machine, torch_index, "test")
    assert f"NVIDIA driver 570.86.15 supporting CUDA {cuda}" in out
    assert pip_installs(commands) == [
        [f"torch==2.9.0+{build}", "--index-url", f"{torch_index}/{build}"],  # never the CPU wheel
        ["torch"],
        ["--editable", f"{ROOT}[test,{extra}]"],
    ]


@linux_only
def test_cuda_version_missing_from_the_banner_is_read_from_the_query(machine, torch_index):
    fake_nvidia_smi(machine / "bin", banner("N/A"), query_stdout="    CUDA Version                          : 13.0\n")
    _, commands = plan(machine, torch_index, "demo")
    assert pip_installs(commands)[0] == ["torch==2.9.0+cu130", "--index-url", f"{torch_index}/cu130"]
    assert pip_installs(commands)[-1] == ["--editable", f"{ROOT}[cuda13]"]


@linux_only
def test_nvidia_smi_without_a_driver_means_cpu(machine, torch_index):
    fake_nvidia_smi(machine / "bin", "NVIDIA-SMI has failed because it couldn't communicate with the "
                    "NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\n",
                    exit_code=9)
    out, commands = plan(machine, torch_index, "test")
    assert "nvidia-smi failed (exit 9: NVIDIA-SMI has failed" in out
    assert pip_installs(commands)[0] == ["torch==2.9.0+cpu", "--index-url", f"{torch_index}/cpu"]
    assert pip_installs(commands)[-1] == ["--editable", f"{ROOT}[test]"]


@pytest.mark.parametrize("cuda, build, extra", [
    ((12, 8), "cu128", "cuda12"), ((13, 0), "cu130", "cuda13"), ((12, 5), "cu124", "cuda12"),
    ((13, 2), "cu130", "cuda13"), ((11, 8), "cu118", None), ((11, 4), "cpu", None)])
def test_the_newest_torch_build_the_driver_runs(cuda, build, extra):
    target = dev.choose_target(dev.Gpu(True, cuda, "a GPU"))
    assert (target.torch, target.cuda_extra) == (build, extra)


def test_a_gpu_of_unknown_cuda_version_gets_the_default_torch_and_no_cupy():
    target = dev.choose_target(dev.Gpu(True, None, "a GPU"))
    assert (target.torch, target.cuda_extra) == ("default", None)


def test_wheel_fits_checks_python_label_and_glibc():
    plat = dev.Platform((3, 11), "x86_64", (2, 27))
    assert dev.wheel_fits("torch-2.9.0+cpu-cp311-cp311-manylinux2014_x86_64.whl", "cpu", plat)
    assert dev.wheel_fits("torch-2.9.0+cpu-cp311-cp311-linux_x86_64.whl", "cpu", plat)
    assert not dev.wheel_fits("torch-2.9.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "cpu", plat)
    assert not dev.wheel_fits("torch-2.9.0+cpu-cp312-cp312-manylinux2014_x86_64.whl", "cpu", plat)
    assert not dev.wheel_fits("torch-2.9.0+cu128-cp311-cp311-manylinux2014_x86_64.whl", "cpu", plat)
    assert not dev.wheel_fits("torch-2.9.0+cpu-cp311-cp311-manylinux2014_aarch64.whl", "cpu", plat)


# --- what a second run installs, given what the first one recorded ---------------------------

CPU = dev.Target("cpu", None, "no GPU")
CU130 = dev.Target("cu130", "cuda13", "a GPU")


def state(**missing):
    modules = {"torch": "/v/torch/__init__.py", "speedswap": str(ROOT / "speedswap" / "__init__.py"),
               "pytest": "/v/pytest/__init__.py", "cupy": "/v/cupy/__init__.py"}
    return {"python": [3, 11], "pip": "24.0", "modules": {k: v for k, v in modules.items() if k not in missing}}


def stamp(**fields):
    return {"torch": "cpu", "torch_from": "somewhere", "extras": ["test"], "cuda_extra": None,
            "setup_hash": "abc", **fields}


def test_a_complete_environment_needs_nothing():
    todo = dev.plan_installs(CPU, ("test",), state(cupy=1), stamp(), "abc", ROOT)
    assert not todo, todo
    assert not dev.plan_installs(CPU, (), state(cupy=1), stamp(), "abc", ROOT), "the demo needs no more"


def test_tests_after_the_demo_add_the_test_extra_only():
    todo = dev.plan_installs(CPU, ("test",), state(pytest=1, cupy=1), stamp(extras=[]), "abc", ROOT)
    assert (todo.create, todo.torch, todo.extras) == (False, False, ("test",))


def test_changed_dependencies_reinstall_the_package_with_the_extras_it_had():
    todo = dev.plan_installs(CPU, (), state(cupy=1), stamp(), "new", ROOT)
    assert (todo.torch, todo.extras) == (False, ("test",))


def test_a_package_removed_by_hand_is_reinstalled():
    assert dev.plan_installs(CPU, (), state(torch=1, cupy=1), stamp(), "abc", ROOT).torch
    assert dev.plan_installs(CPU, ("test",), state(pytest=1, cupy=1), stamp(), "abc", ROOT).extras == ("test",)


def test_speedswap_installed_from_another_checkout_is_reinstalled_from_this_one():
    elsewhere = state(cupy=1)
    elsewhere["modules"]["speedswap"] = "/elsewhere/speedswap/__init__.py"
    assert dev.plan_installs(CPU, (), elsewhere, stamp(), "abc", ROOT).extras == ("test",)


def test_a_new_driver_swaps_torch_and_cupy_builds():
    todo = dev.plan_installs(CU130, ("test",), state(), stamp(torch="cu128", cuda_extra="cuda12"), "abc", ROOT)
    assert (todo.torch, todo.uninstall, todo.extras) == (True, ("cupy-cuda12x",), ("test", "cuda13"))


def test_no_environment_means_create_and_install_everything():
    todo = dev.plan_installs(CU130, (), None, None, "abc", ROOT)
    assert (todo.create, todo.torch, todo.extras) == (True, True, ("cuda13",))


def test_an_old_pip_is_upgraded_first():
    old = state(cupy=1)
    old["pip"] = "20.2.3"  # Python 3.9.0's: too old for editable pyproject installs
    todo = dev.plan_installs(CPU, ("test",), old, stamp(), "abc", ROOT)
    assert (todo.upgrade_pip, todo.torch, todo.extras) == (True, False, None)


def test_unknown_command_is_refused_with_usage():
    result = subprocess.run([sys.executable, str(DEV), "deploy"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "expected a command, demo or test" in result.stderr and "./dev [--plan] test" in result.stderr


# --- the environment this suite runs in, when ./dev made it ----------------------------------

made_by_dev = pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve() or not (ROOT / ".venv" / dev.STAMP_NAME).exists(),
    reason="runs only under ./dev test (in the .venv it made)")


@made_by_dev
def test_second_run_installs_nothing_and_passes_arguments_and_exit_status_through():
    result = subprocess.run([str(DEV), "--plan", "demo"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "nothing to install" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("+ ")] == [
        f"+ {ROOT / '.venv' / 'bin' / 'python'} -m speedswap demo"]
    # The real run, now known to install nothing: the demo's own usage error and status come back.
    result = subprocess.run([str(DEV), "demo", "--no-such-option"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "unrecognized arguments: --no-such-option" in result.stderr


# --- the oldest releases setup.py admits --------------------------------------------------------

def test_the_oldest_run_pins_exactly_the_floors_setup_py_declares():
    """.ci/oldest tests the floors only while its constraints are them: a floor raised (or a
    dependency added) in setup.py without its pin would leave the declared floor untested."""
    setup_py = (ROOT / "setup.py").read_text()
    requires = setup_py[setup_py.index("install_requires=["):]
    floors = {name: Version(floor) for name, floor in re.findall(r'"([\w-]+)>=([\d.]+)"',
                                                                  requires[:requires.index("]")])}
    pins = {name: Version(pin) for name, pin in (line.split("==") for line in
            (ROOT / ".ci" / "oldest.txt").read_text().splitlines() if line and not line.startswith("#"))}
    assert floors and pins == floors
