"""The README's examples marked ``<!-- readme-test -->`` run as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"<!-- readme-test -->\s*```python\n(.*?)```", README.read_text(), re.S)


def test_there_are_runnable_examples():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path):
    # This checkout's speedswap, not an installed one.
    env = {**os.environ, "PYTHONPATH": str(README.parent)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert any(tmp_path.iterdir()), "the example saves its results"
