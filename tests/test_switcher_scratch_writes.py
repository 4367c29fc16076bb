"""A write into a ModelFactory's embedding between steps reaches no row: refused, not lost.

Between steps the model's ``nn.Embedding`` holds slots that the next
``beforeForwardPass`` fills with the step's rows, so ``nn.init.normal_(weight)``
there changed nothing the model trains on, silently, where in memory it
changes the table. The next ``before_forward`` (of either switcher) refuses it
once, before anything changes; ``model.load_state_dict`` and optimizer steps
at a zero gradient between steps write the slots too, and go on.
"""

import copy

import numpy as np
import pytest
import torch

import speedswap as ss
from training_helpers import CAPACITY, DIM, run_in_memory, skipgram_loss, step_failing_once, zipf_batches

ROWS = 300
LR = 0.01

WRITES = {
    "nn.init.normal_": torch.nn.init.normal_,
    "mul_ under no_grad": lambda w: torch.no_grad()(w.mul_)(2),
    "copy_ into detach()": lambda w: w.detach().copy_(torch.ones_like(w)),
}


@pytest.fixture
def table0(rng):
    return rng.standard_normal((ROWS, DIM), dtype=np.float32)


def build(backend, table0, optimizer_switcher=True, cache_rows=0):
    """A model of the switched embedding and a dense layer, Adam (SGD with weight decay alone), its switchers."""
    device = ss.get_backend(backend).device
    model = torch.nn.Module()
    model.u_embeddings = torch.nn.Embedding(CAPACITY, DIM)
    model.lin = torch.nn.Linear(DIM, 1)
    model.to(device)
    if optimizer_switcher:
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    else:  # stateless, but its weight decay writes the slots at a zero gradient too
        opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=0.1)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    switchers = [u]
    if optimizer_switcher:
        switchers.append(ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend=backend,
                                             cache_rows=cache_rows))
    return model, opt, switchers


def train_step(model, opt, switchers, batch):
    pos, neg, ctx = batch
    lp, ln = switchers[0].before_forward(pos, neg)
    for s in switchers[1:]:
        s.before_forward(pos, neg)
    skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    for s in switchers:
        s.after_step(pos, neg)


def lazy_reference(table0, batches, optimizer_switcher=True):
    """The table as in-memory training leaves it, each step changing only the rows it touched."""
    make = ((lambda p: torch.optim.Adam(p, lr=LR)) if optimizer_switcher
            else (lambda p: torch.optim.SGD(p, lr=LR, weight_decay=0.1)))
    expected, _ = run_in_memory(make, table0, batches, batches[0][2].device, initial_state=lambda name, group: 0.0)
    return expected


def empty_batch(device):
    """A step without rows of the table: the lazy reference counts it (Adam's step) and changes no row."""
    return (torch.zeros(0, dtype=torch.int64, device=device), torch.zeros((0, 3), dtype=torch.int64, device=device),
            torch.zeros((0, DIM), device=device))


@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("first", ["model", "optimizer"])
def test_a_write_into_the_slots_between_steps_is_refused_once_and_changes_nothing(
        backend, table0, rng, write, steps_before, first):
    model, opt, switchers = build(backend, table0)
    u, o = switchers
    batches = zipf_batches(rng, 6, ss.get_backend(backend).device, ROWS)
    for batch in batches[:steps_before]:
        train_step(model, opt, switchers, batch)
    table, state = u.getNumpyVersion(), o.getNumpyVersion()
    WRITES[write](model.u_embeddings.weight)
    pos, neg, _ = batches[steps_before]
    with pytest.raises(ss.StateError, match=r"was written between steps.*u_switch\.normalDistributionInit"):
        (u if first == "model" else o).before_forward(pos, neg)
    np.testing.assert_array_equal(u.getNumpyVersion(), table)
    after = o.getNumpyVersion()
    assert after.keys() == state.keys()
    for name in state:
        np.testing.assert_array_equal(after[name], state[name], err_msg=name)
    # Said once: the step goes on, and training is as if the write had not been made.
    for batch in batches[steps_before:]:
        train_step(model, opt, switchers, batch)
    np.testing.assert_allclose(u.getNumpyVersion(), lazy_reference(table0, batches), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("optimizer_switcher", [True, False])
@pytest.mark.parametrize("cache_rows", [0, 16])
def test_loads_and_zero_gradient_steps_between_steps_train_as_in_memory(
        backend, table0, rng, optimizer_switcher, cache_rows):
    """``model.load_state_dict`` of an earlier state dict and steps of the dense layer alone at a
    zero embedding gradient (``zero_grad(set_to_none=False)``) write the slots between steps: no
    refusal, and the table trains as the in-memory reference, which counts those steps too."""
    device = ss.get_backend(backend).device
    model, opt, switchers = build(backend, table0, optimizer_switcher, cache_rows)
    batches = zipf_batches(rng, 14, device, ROWS)
    reference, saved = [], None
    for step, batch in enumerate(batches):
        if step == 2:
            saved = copy.deepcopy(model.state_dict())
        if step in (5, 9):
            model.load_state_dict(saved)  # the slots as two steps ago: the switchers' tables are theirs
        if step in (6, 7, 11):  # a batch for the dense layer only
            model.lin(batch[2]).pow(2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            reference.append(empty_batch(device))
            continue
        train_step(model, opt, switchers, batch)
        reference.append(batch)
    np.testing.assert_allclose(switchers[0].getNumpyVersion(), lazy_reference(table0, reference, optimizer_switcher),
                               rtol=1e-6, atol=1e-6)


def test_a_load_into_a_bare_weight_is_refused_and_names_the_embedding_instead(backend, table0, rng):
    """A ModelFactory given the weight Parameter cannot know its module: a load is refused as any write."""
    model, opt, _ = build(backend, table0, optimizer_switcher=False)
    model2 = torch.nn.Module()
    model2.u_embeddings = torch.nn.Embedding(CAPACITY, DIM).to(model.u_embeddings.weight.device)
    u = ss.ModelFactory(model2.u_embeddings.weight, ROWS, DIM, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    model2.load_state_dict(copy.deepcopy(model2.state_dict()))
    pos, neg, _ = zipf_batches(rng, 1, model.u_embeddings.weight.device, ROWS)[0]
    with pytest.raises(ss.StateError, match="given the nn.Embedding"):
        u.before_forward(pos, neg)
    u.before_forward(pos, neg)  # said once


@pytest.mark.parametrize("optimizer_switcher", [True, False])
@pytest.mark.parametrize("retried", [True, False])
def test_a_zero_gradient_step_that_raised_after_its_update_is_no_write_to_refuse(
        backend, table0, rng, optimizer_switcher, retried):
    """A step of the dense layer alone whose optimizer raised after updating the slots ran no
    post-hook: retried or dropped, the next ``before_forward`` goes on, and a write after it is refused."""
    model, opt, switchers = build(backend, table0, optimizer_switcher)
    batches = zipf_batches(rng, 3, ss.get_backend(backend).device, ROWS)
    train_step(model, opt, switchers, batches[0])
    model.lin(batches[1][2]).pow(2).sum().backward()
    step_failing_once(opt, list(model.lin.parameters()))
    if retried:
        opt.step()
    opt.zero_grad(set_to_none=False)
    train_step(model, opt, switchers, batches[1])
    torch.nn.init.normal_(model.u_embeddings.weight)
    with pytest.raises(ss.StateError, match="was written between steps"):
        train_step(model, opt, switchers, batches[2])
