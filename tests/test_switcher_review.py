"""The switchers' cases a review left open: each trains as in memory, or is refused clearly.

* ``weight.data = tensor`` between steps (``torch.nn.utils.vector_to_parameters``)
  reached no row: refused once by the next ``before_forward``, the slots given back.
"""

import numpy as np
import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import speedswap as ss
from test_switcher_scratch_writes import ROWS, build, lazy_reference, train_step
from training_helpers import CAPACITY, DIM, zipf_batches


@pytest.fixture
def table0(rng):
    return rng.standard_normal((ROWS, DIM), dtype=np.float32)


def assert_unchanged(switchers, before):
    """The switchers' tables (and state tables) hold what ``before`` (their getNumpyVersion()s) held."""
    for switcher, was in zip(switchers, before):
        now = switcher.getNumpyVersion()
        if isinstance(was, dict):
            assert now.keys() == was.keys()
            for name in was:
                np.testing.assert_array_equal(now[name], was[name], err_msg=name)
        else:
            np.testing.assert_array_equal(now, was)


def assert_trained_as_in_memory(switchers, table0, batches, optimizer_switcher=True):
    np.testing.assert_allclose(switchers[0].getNumpyVersion(), lazy_reference(table0, batches, optimizer_switcher),
                               rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ weight.data = tensor

def assign_data(model, rng):
    model.u_embeddings.weight.data = torch.from_numpy(
        rng.standard_normal((CAPACITY, DIM), dtype=np.float32)).to(model.u_embeddings.weight.device)


def assign_vector(model, rng):
    n = sum(p.numel() for p in model.parameters())
    device = model.u_embeddings.weight.device
    vector_to_parameters(torch.from_numpy(rng.standard_normal(n, dtype=np.float32)).to(device), model.parameters())


@pytest.mark.parametrize("assign", [assign_data, assign_vector], ids=["weight.data=", "vector_to_parameters"])
@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("first", ["model", "optimizer"])
@pytest.mark.parametrize("optimizer_switcher", [True, False])
def test_weight_data_assigned_between_steps_is_refused_once_and_changes_nothing(
        backend, table0, rng, assign, steps_before, first, optimizer_switcher):
    if first == "optimizer" and not optimizer_switcher:
        pytest.skip("no OptimizerFactory to begin the step")
    model, opt, switchers = build(backend, table0, optimizer_switcher)
    batches = zipf_batches(rng, 7, ss.get_backend(backend).device, ROWS)
    for batch in batches[:steps_before]:
        train_step(model, opt, switchers, batch)
    before = [s.getNumpyVersion() for s in switchers]
    slots = model.u_embeddings.weight.data_ptr()
    assign(model, rng)
    pos, neg, _ = batches[steps_before]
    with pytest.raises(ss.StateError, match=r"weight\.data = tensor between steps.*u_switch\.normalDistributionInit"):
        switchers[0 if first == "model" else 1].before_forward(pos, neg)
    assert_unchanged(switchers, before)
    assert model.u_embeddings.weight.data_ptr() == slots  # given back: the step trains its own slots
    # Said once: the step goes on, and training is as if nothing had been assigned.
    for batch in batches[steps_before:]:
        train_step(model, opt, switchers, batch)
    assert_trained_as_in_memory(switchers, table0, batches, optimizer_switcher)


@pytest.mark.parametrize("how", ["round trip", "to_empty"])
def test_weight_data_given_the_same_values_or_converted_goes_on(backend, table0, rng, how):
    """``vector_to_parameters(parameters_to_vector(...))`` assigns the slots' own values, and
    ``to_empty()`` (uninitialised memory) is a conversion, not a write: neither is refused."""
    model, opt, switchers = build(backend, table0)
    device = ss.get_backend(backend).device
    batches = zipf_batches(rng, 8, device, ROWS)
    for step, batch in enumerate(batches):
        if step in (2, 5):
            if how == "round trip":
                vector_to_parameters(parameters_to_vector(model.parameters()).clone(), model.parameters())
            else:
                opt.zero_grad()  # to_empty() of a gradient's zeros is refused (test_module_conversions_review)
                model.to_empty(device=device)
        train_step(model, opt, switchers, batch)
    assert_trained_as_in_memory(switchers, table0, batches)
