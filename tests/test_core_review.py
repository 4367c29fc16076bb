"""Training flows found in review: each equals the lazy in-memory reference, or is refused before any change.

The reference is the one of :mod:`test_training_flows`: an in-memory table
whose rows no training forward looked up get their value and optimizer
state back after each step.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from test_training_flows import (BATCH, DIM, STEPS, assert_equal_to_reference, make_lazy, pair, train_step,
                                 zipf_ids)


def test_a_second_step_without_a_forward_is_refused_before_anything_changes(rng):
    """``optimizer.step()`` twice on one backward: in memory the second step applies the gradient
    to its rows again; offloaded, those rows were written back and the gradient's slots name none.
    It is refused, with the table, the per-row state and the step count as the first step left them
    (it used to step the working-set scratch, leave the rows alone, and blame the next forward for
    "a write into emb.weight between steps")."""
    model, _ = pair(rng)
    emb = model.emb
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    emb.attach(opt)
    (ids, target), (ids2, target2) = zipf_ids(rng, 2)
    F.mse_loss(model(ids), target).backward()
    opt.step()
    table = emb.table.to_numpy(copy=True)
    state = {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()}
    step = opt.state[emb.weight]["step"].clone()
    with pytest.raises(ss.StateError, match="no training forward"):
        opt.step()
    np.testing.assert_array_equal(emb.table.to_numpy(), table)
    for name, t in emb._state.tables.items():
        np.testing.assert_array_equal(t.to_numpy(), state[name], err_msg=name)
    assert opt.state[emb.weight]["step"] == step
    opt.zero_grad()
    F.mse_loss(model(ids2), target2).backward()  # training goes on
    opt.step()


def test_an_older_optimizer_state_without_the_tables_is_refused_at_a_step_without_rows_too(rng):
    """``optimizer.load_state_dict()`` of an older state without ``emb.load`` of the tables saved
    with it is refused at the next step. When that step looked up no row of the embedding (a batch
    for the dense layer only), it was let through, and its end handed the optimizer its scratch
    state again: training went on silently with the tables' moments and the older step count (2
    where the rows had seen 3 steps). It is refused there too, before anything changes."""
    model, _ = pair(rng)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.emb.attach(opt)
    batches = zipf_ids(rng, 3)
    train_step(model, opt, *batches[0])
    older = copy.deepcopy(opt.state_dict())
    for ids, target in batches[1:]:
        train_step(model, opt, ids, target)
    opt.load_state_dict(older)
    hidden = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    F.mse_loss(model.lin(hidden), batches[0][1]).backward()
    table, linear = model.emb.table.to_numpy(copy=True), model.lin.weight.detach().clone()
    state = {name: t.to_numpy(copy=True) for name, t in model.emb._state.tables.items()}
    with pytest.raises(ss.StateError, match="was replaced since the last step"):
        opt.step()
    np.testing.assert_array_equal(model.emb.table.to_numpy(), table)
    for name, t in model.emb._state.tables.items():
        np.testing.assert_array_equal(t.to_numpy(), state[name], err_msg=name)
    assert torch.equal(model.lin.weight, linear)  # the whole step was refused


def _adam_for_all(model):
    return [torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)]


def _sparse_adam_beside_adam(model):
    return [torch.optim.SparseAdam([model.emb.weight], lr=0.01),
            torch.optim.Adam(model.lin.parameters(), lr=0.01)]


@pytest.mark.parametrize("make_opts", [_adam_for_all, _sparse_adam_beside_adam])
def test_steps_that_train_only_other_layers_after_zero_grad_set_to_none_false_train_on(rng, make_opts):
    """``zero_grad(set_to_none=False)`` leaves the embedding a zero gradient; a step whose forwards
    do not look the embedding up (a batch for the other layers only) touches none of its rows, and
    Adam counts the step, as it does in memory. Training goes on equal to the reference (it used to
    be refused at the next forward as "a write into emb.weight between steps").

    SparseAdam, the embedding's optimizer beside Adam for the dense layers, counts the step too: in
    memory a sparse embedding's zeroed gradient is an empty sparse one (it used to raise torch's
    RuntimeError "SparseAdam does not support dense gradients" at the embedding's dense zeros)."""
    sparse = make_opts is _sparse_adam_beside_adam
    model, reference = pair(rng, sparse=sparse)
    opts, ref_opts = make_opts(model), make_opts(reference)
    model.emb.attach(opts[0])
    make_lazy(ref_opts[0], reference.emb)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        hidden = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
        for m, os_ in ((model, opts), (reference, ref_opts)):
            if step % 3 == 2:
                F.mse_loss(m.lin(hidden), target).backward()
                if m is reference:
                    m.emb.looked_up.append(torch.zeros(0, dtype=torch.int64))  # no row
            else:
                F.mse_loss(m(ids), target).backward()
            for o in os_:
                o.step()
                o.zero_grad(set_to_none=False)
    opt, ref_opt = opts[0], ref_opts[0]
    assert opt.state[model.emb.weight]["step"] == ref_opt.state[reference.emb.weight]["step"] == STEPS
    assert_equal_to_reference(model, opt, reference, ref_opt)


@pytest.mark.parametrize("option", [
    (lambda p: torch.optim.SGD(p, lr=0.05), {"momentum": 0.9}, "momentum_buffer"),
    (lambda p: torch.optim.RMSprop(p, lr=0.01), {"centered": True}, "grad_avg"),
    (lambda p: torch.optim.Adam(p, lr=0.01), {"amsgrad": True}, "max_exp_avg_sq"),
], ids=["sgd_momentum", "rmsprop_centered", "adam_amsgrad"])
def test_a_group_option_that_asks_for_per_row_state_the_tables_lack_is_refused(rng, option):
    """A momentum warm-up from 0 (or amsgrad, centered turned on) after attach: torch would create
    the new per-row state for every element, but the host tables were made for the state the group
    asked for at attach. Refused before anything changes, the dense layer included (SGD used to step
    it, then raise "this torch version is not supported"; Adam and RMSprop a raw KeyError)."""
    make, change, name = option
    model, _ = pair(rng)
    # The dense layer in a group of its own: torch itself cannot turn amsgrad or centered on for
    # a parameter that already has state.
    opt = make([{"params": [model.emb.weight]}, {"params": list(model.lin.parameters())}])
    model.emb.attach(opt)
    batches = zipf_ids(rng, 3)
    for ids, target in batches[:2]:
        F.mse_loss(model(ids), target).backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0].update(change)
    table = model.emb.table.to_numpy(copy=True)
    linear = [p.detach().clone() for p in model.lin.parameters()]
    ids, target = batches[2]
    with pytest.raises(ss.OptionError, match=name):
        F.mse_loss(model(ids), target).backward()
        opt.step()
    np.testing.assert_array_equal(model.emb.table.to_numpy(), table)
    for mine, before in zip(model.lin.parameters(), linear):
        assert torch.equal(mine.detach(), before)
    model.emb.attach(opt, restart=True)  # the advice: attaching again makes the tables for the new state
    opt.zero_grad()
    F.mse_loss(model(ids), target).backward()
    opt.step()


def test_a_batch_without_ids_trains_no_row_and_training_goes_on(rng):
    """A training forward of no ids (an empty last batch) gives ``weight`` a zero gradient and the
    step no rows: Adam counts the step, as in memory, and moves no row, lazily. The next step
    trains on, equal to the reference (it was refused as "a write into emb.weight between steps")."""
    model, reference = pair(rng)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    model.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        if step % 4 == 3:
            ids, target = ids[:0], target[:0]
        for m, o in ((model, opt), (reference, ref_opt)):
            F.mse_loss(m(ids), target, reduction="sum").backward()
            o.step()
            o.zero_grad()
    assert opt.state[model.emb.weight]["step"] == STEPS
    assert_equal_to_reference(model, opt, reference, ref_opt)


def test_checking_the_group_options_never_reads_a_tensor_lr():
    """Rprop's fill value is its lr: read as a tensor at every check, on a GPU a host wait each step."""
    emb = ss.OffloadedEmbedding(20, 3, max_rows=8, storage="pageable", backend="numpy")
    opt = torch.optim.Rprop(emb.parameters(), lr=torch.tensor(0.01))
    emb.attach(opt)

    class Unreadable(torch.Tensor):
        def item(self):
            raise AssertionError("check_options read the lr's value")

    opt.param_groups[0]["lr"] = torch.tensor(0.01).as_subclass(Unreadable)
    emb._state.check_options()
