"""Shared fixtures: every test that takes ``backend`` runs on each available backend."""

import os

import numpy as np
import pytest
import torch

import speedswap as ss


def _cuda_ready():
    return "cuda" in ss.available_backends()


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests of the zero-copy kernels also need CuPy)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The cuda case carries the gpu mark, so `pytest -m gpu` (what `bench --all` runs on a
# GPU) runs every backend-parametrised test there too, not only the GPU-only ones.
@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.gpu) if name == "cuda" else name
                        for name in ss.available_backends()])
def backend(request):
    """The name of each backend this machine can run."""
    return request.param


@pytest.fixture
def seed(request):
    """A fresh seed per test run, printed so a failure can be replayed (SPEEDSWAP_SEED=...)."""
    value = int(os.environ.get("SPEEDSWAP_SEED", np.random.SeedSequence().entropy % (2**31)))
    print(f"seed for {request.node.name}: {value} (replay with SPEEDSWAP_SEED={value})")
    torch.manual_seed(value)
    return value


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)
