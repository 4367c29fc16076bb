"""Shared fixtures: every test that takes ``backend`` runs on each available backend."""

import os

import numpy as np
import pytest
import torch
from hypothesis import settings

import speedswap as ss


def fresh_seed():
    """A new seed for a run that names none (SPEEDSWAP_SEED unset)."""
    return int(np.random.SeedSequence().entropy % (2**31))


# tryfirst: hypothesis's own pytest_configure reads --hypothesis-seed, so this must come before it.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Seed hypothesis from SPEEDSWAP_SEED, or with one fresh seed for the run, as the ``seed`` fixture does.

    A hypothesis test that fails prints its shrunk example but not the seed it
    drew it with, so without a seed of our own a CI failure could not be
    replayed. ``--hypothesis-seed`` given on the command line still wins.
    With ``CI`` set hypothesis loads its "ci" profile, which derandomises:
    every CI run drew the same examples whatever the seed. Its other settings
    are kept, not that one (a ``--hypothesis-profile`` given still wins).
    """
    settings.register_profile("speedswap", parent=settings.default, derandomize=False)
    settings.load_profile("speedswap")
    if config.getoption("hypothesis_seed", default=None) is None:
        config.option.hypothesis_seed = os.environ.get("SPEEDSWAP_SEED", str(fresh_seed()))


def pytest_runtest_setup(item):
    """Print a hypothesis test's seed (captured, so shown with its failure), as the ``seed`` fixture does."""
    if item.get_closest_marker("hypothesis"):
        value = item.config.option.hypothesis_seed
        print(f"hypothesis seed for {item.name}: {value} (replay with SPEEDSWAP_SEED={value})")


def _cuda_ready():
    return "cuda" in ss.available_backends()


def gpu_only_first(items):
    """Sort ``items`` (stably) so that tests written for a GPU alone come before the rest.

    Those carry the ``gpu`` mark on their function or module; the cuda cases
    of backend-parametrised tests carry it on their parameter only. A GPU run
    cut short by a time limit (``bench --all`` gives the tests 480 s) has then
    run the tests nothing else covers.
    """
    def own_gpu_mark(item):
        marks = [getattr(item, "function", None), getattr(item, "module", None)]
        for owner in marks:
            declared = getattr(owner, "pytestmark", [])
            if any(mark.name == "gpu" for mark in (declared if isinstance(declared, (list, tuple)) else [declared])):
                return True
        return False
    items.sort(key=lambda item: not own_gpu_mark(item))


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        gpu_only_first(items)
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
    value = int(os.environ.get("SPEEDSWAP_SEED", fresh_seed()))
    print(f"seed for {request.node.name}: {value} (replay with SPEEDSWAP_SEED={value})")
    torch.manual_seed(value)
    return value


@pytest.fixture
def rng(seed):
    return np.random.default_rng(seed)
