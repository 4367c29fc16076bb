"""keep_freed_memory(): glibc keeps freed blocks for the process, so a training step stops faulting them in."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import speedswap as ss
from speedswap import malloc

ROOT = Path(__file__).resolve().parent.parent

# Resident memory given back when a 24 MiB block, the first of its size, is freed.
_GIVEN_BACK = """
import json, os, sys
import numpy as np
import speedswap as ss
kept = ss.keep_freed_memory() if sys.argv[1] == "keep" else None
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
block = np.ones(24 << 20, dtype=np.uint8)  # touched: every page resident
before = resident()
del block
print(json.dumps({"kept": kept, "given_back": before - resident()}))
"""


def _given_back(mode):
    done = subprocess.run([sys.executable, "-c", _GIVEN_BACK, mode], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None,
                    reason="glibc's malloc settings, on Linux, where the environment has not set them")
def test_after_keep_freed_memory_a_freed_block_stays_with_the_process():
    default = _given_back("default")
    if not malloc._glibc():
        pytest.skip("this Linux's C library is not glibc")
    kept = _given_back("keep")
    assert default["given_back"] >= 20 << 20  # glibc's default: mapped on its own, unmapped when freed
    assert kept["kept"] is True
    assert kept["given_back"] < 4 << 20  # kept on the heap for the next allocation


def test_where_the_c_library_is_not_glibc_nothing_changes(monkeypatch):
    monkeypatch.setattr(malloc, "_glibc", lambda: None)
    assert ss.keep_freed_memory() is False
