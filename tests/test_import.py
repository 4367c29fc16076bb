"""`import speedswap` must stay light: no CuPy until the cuda backend is used."""

import subprocess
import sys


def test_import_does_not_import_cupy():
    code = "import sys, speedswap; assert 'cupy' not in sys.modules, sorted(m for m in sys.modules if 'cupy' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_backend_work_does_not_import_cupy():
    code = ("import sys, numpy as np, speedswap as ss\n"
            "t = ss.HostTable.from_numpy(np.ones((4, 2), np.float32), backend='numpy')\n"
            "t.gather([0, 3]); ss.info()\n"
            "assert 'cupy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_exist():
    import speedswap
    missing = [name for name in speedswap.__all__ if not hasattr(speedswap, name)]
    assert missing == []
