"""Build script for speedswap (tool settings live in pyproject.toml)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "speedswap" / "version.py").read_text()).group(1)

# What running the notebooks (the tests do it headless) and the bench chart need.
EXAMPLES_EXTRA = ["matplotlib>=3.5", "nbclient>=0.7", "nbformat>=5.7", "ipykernel>=6"]

setup(
    name="speedswap",
    version=VERSION,
    description="Train embedding tables and optimizer state that do not fit in GPU memory",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["speedswap", "speedswap.*"]),
    python_requires=">=3.10",  # CuPy 14, which the cuda extras need
    # The floors are tested ones: .ci/oldest runs the suite on them (.ci/oldest.txt).
    install_requires=["numpy>=1.24", "torch>=2.6", "h5py>=3.10", "tqdm>=4.60"],
    extras_require={
        # CuPy is optional and only the cuda backend imports it. From 14 on it finds the CUDA
        # runtime and NVRTC (which compiles the row kernels) in NVIDIA's wheels; CuPy 13
        # needed a system CUDA toolkit for NVRTC.
        "cuda12": ["cupy-cuda12x>=14", "cuda-toolkit[cudart,nvrtc]==12.*"],
        "cuda13": ["cupy-cuda13x>=14", "cuda-toolkit[cudart,nvrtc]==13.*"],
        "examples": [*EXAMPLES_EXTRA, "notebook>=7"],  # and Jupyter, to open the notebooks
        # gensim only for benchmarks/word2vec_quality.py's comparison.
        "gensim": ["gensim==4.4.0"],
        # The tests run the notebooks, and compile the row kernels to PTX with NVRTC (no GPU needed).
        "test": ["pytest>=7", "hypothesis>=6", "nvidia-cuda-nvrtc-cu12; platform_system == 'Linux'",
                 *EXAMPLES_EXTRA],
    },
    entry_points={"console_scripts": ["speedswap=speedswap.__main__:main"]},
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
