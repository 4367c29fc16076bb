"""The switchers' cases a review left open: each trains as in memory, or is refused clearly.

* ``weight.data = tensor`` between steps (``torch.nn.utils.vector_to_parameters``)
  reached no row: refused once by the next ``before_forward``, the slots given back.
* ``copy.deepcopy(model)``, ``AveragedModel(model)``, ``torch.save(model)`` of a model
  whose embedding a ModelFactory switches would copy (and average) a few slots
  of stale rows: refused, naming the way out; after ``close()``, or with only an
  OptimizerFactory, the model copies as any other.
* ``model.load_state_dict(sd, assign=True)`` would replace the switched weight:
  refused at the load, the embedding left as it was; ``assign=False`` goes on.
"""

import copy
import io
import pickle

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
# Which switcher's before_forward begins the step: the optimizer's only where there is an OptimizerFactory.
@pytest.mark.parametrize("first, optimizer_switcher", [("model", True), ("optimizer", True), ("model", False)],
                         ids=["model", "optimizer", "model_no_OptimizerFactory"])
def test_weight_data_assigned_between_steps_is_refused_once_and_changes_nothing(
        backend, table0, rng, assign, steps_before, first, optimizer_switcher):
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


# ------------------------------------------------------------------ copies of the model

COPIES = {
    "deepcopy": copy.deepcopy,
    "AveragedModel": torch.optim.swa_utils.AveragedModel,
    "torch.save": lambda model: torch.save(model, io.BytesIO()),
    "pickle": pickle.dumps,
}


@pytest.mark.parametrize("copier", list(COPIES))
@pytest.mark.parametrize("given", ["embedding", "embedding, no OptimizerFactory", "bare weight"])
def test_a_copy_of_a_switched_model_is_refused_and_names_the_way_out(backend, table0, rng, copier, given):
    optimizer_switcher = given != "embedding, no OptimizerFactory"
    if given == "bare weight":  # the OptimizerFactory, given the model, knows the module
        model, opt, switchers = build(backend, table0)
        switchers[0].close()
        switchers[0] = ss.ModelFactory(model.u_embeddings.weight, ROWS, DIM, backend=backend)
        switchers[0].customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    else:
        model, opt, switchers = build(backend, table0, optimizer_switcher)
    batches = zipf_batches(rng, 6, ss.get_backend(backend).device, ROWS)
    for batch in batches[:3]:
        train_step(model, opt, switchers, batch)
    before = [s.getNumpyVersion() for s in switchers]
    keys = list(model.state_dict())
    with pytest.raises(ss.StateError, match=r"AveragedModel\(model\.head\).*getNumpyVersion"):
        COPIES[copier](model)
    assert_unchanged(switchers, before)
    # The way out works, and the model is as it was: its state_dict, a conversion that keeps it, training.
    torch.optim.swa_utils.AveragedModel(model.lin).update_parameters(model.lin)
    assert list(model.state_dict()) == keys
    model.to(ss.get_backend(backend).device)
    for batch in batches[3:]:
        train_step(model, opt, switchers, batch)
    assert_trained_as_in_memory(switchers, table0, batches, optimizer_switcher)


def test_a_model_copies_as_any_other_once_its_switchers_are_closed_or_with_an_optimizer_factory_alone(
        backend, table0, rng):
    """The copies' hooks do nothing: a copy's forward takes any ids, and its loads go through."""
    model, opt, switchers = build(backend, table0)
    o = switchers[1]
    switchers[0].close()  # the OptimizerFactory alone: the weight holds the user's own rows
    for copier in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        copied = copier(model)
        ids = torch.arange(CAPACITY, device=model.u_embeddings.weight.device)
        torch.testing.assert_close(copied.u_embeddings(ids), model.u_embeddings(ids), rtol=0, atol=0)
        copied.load_state_dict(model.state_dict())
        torch.optim.swa_utils.AveragedModel(model).update_parameters(model)
    o.close()
    copied = copy.deepcopy(model)
    torch.testing.assert_close(copied.u_embeddings.weight, model.u_embeddings.weight, rtol=0, atol=0)


# ------------------------------------------------------------------ load_state_dict(assign=True)

@pytest.mark.parametrize("given", ["embedding", "embedding, no OptimizerFactory", "bare weight"])
@pytest.mark.parametrize("cache_rows", [0, 16])
def test_a_load_with_assign_is_refused_at_the_load_and_assign_false_trains_as_in_memory(
        backend, table0, rng, tmp_path, given, cache_rows):
    """A save and load in the middle of training (Adam, Zipf ids): the model's state_dict, the
    switchers' files and the optimizer's state; ``assign=True`` is refused before the embedding
    changes, ``assign=False`` goes on and the table trains as the in-memory reference."""
    optimizer_switcher = given != "embedding, no OptimizerFactory"
    model, opt, switchers = build(backend, table0, optimizer_switcher, cache_rows)
    if given == "bare weight":
        switchers[0].close()
        switchers[0] = ss.ModelFactory(model.u_embeddings.weight, ROWS, DIM, backend=backend, cache_rows=cache_rows)
        switchers[0].customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    batches = zipf_batches(rng, 16, ss.get_backend(backend).device, ROWS)
    weight = model.u_embeddings.weight
    for batch in batches[:4]:
        train_step(model, opt, switchers, batch)
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    files = [tmp_path / "u.npy", tmp_path / "opt"][:len(switchers)]
    for switcher, path in zip(switchers, files):
        switcher.saveCupy(path)
    for batch in batches[4:8]:
        train_step(model, opt, switchers, batch)
    slots = weight.detach().clone()
    with pytest.raises(ss.OptionError, match=r"assign=True.*'u_embeddings\.weight'.*assign=False"):
        model.load_state_dict(saved[0], assign=True)
    assert model.u_embeddings.weight is weight
    torch.testing.assert_close(weight.detach(), slots, rtol=0, atol=0)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for switcher, path in zip(switchers, files):
        switcher.loadCupy(path)
    for batch in batches[4:]:
        train_step(model, opt, switchers, batch)
    assert_trained_as_in_memory(switchers, table0, batches, optimizer_switcher)
