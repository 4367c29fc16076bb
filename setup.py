"""Build script for speedswap (tool settings live in pyproject.toml)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "speedswap" / "__init__.py").read_text()).group(1)

# What running the notebooks (the tests do it headless) and the bench chart need.
EXAMPLES_EXTRA = ["matplotlib>=3.5", "nbclient>=0.7", "nbformat>=5.7", "ipykernel>=6"]

setup(
    name="speedswap",
    version=VERSION,
    description="Train embedding tables and optimizer state that do not fit in GPU memory",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["speedswap", "speedswap.*"]),
    python_requires=">=3.9",
    install_requires=["numpy>=1.22", "torch>=2.1", "h5py>=3.6", "tqdm>=4.60"],
    extras_require={
        # CuPy is optional and only the cuda backend imports it.
        "cuda12": ["cupy-cuda12x>=13"],
        "cuda13": ["cupy-cuda13x>=13"],
        "examples": [*EXAMPLES_EXTRA, "notebook>=7"],  # and Jupyter, to open the notebooks
        "test": ["pytest>=7", "hypothesis>=6", *EXAMPLES_EXTRA],  # the tests run the notebooks
    },
    entry_points={"console_scripts": ["speedswap=speedswap.__main__:main"]},
    classifiers=["Programming Language :: Python :: 3", "Topic :: Scientific/Engineering :: Artificial Intelligence"],
)
