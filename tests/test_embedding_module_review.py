"""Module-level cases of the offloaded embeddings that a review left open.

Each test trains an offloaded model and its lazy in-memory reference
(``test_training_flows.pair``: Zipf ids, Adam, the reference leaving untouched
rows and their state alone) and does to the model what a user does to an
``nn.Embedding`` model: it either trains as in memory or raises a
``SpeedswapError`` before anything changed, after which training goes on as in
memory.
"""

import copy

import numpy as np
import pytest
import torch

import speedswap as ss
from test_training_flows import (BATCH, DIM, ROWS, STEPS, WIDTH, LazyTable, assert_equal_to_reference, make_lazy,
                                 pair, train_step, zipf_ids)


def _lazy_pair(rng, sharded):
    offloaded, reference = pair(rng, sharded=sharded)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    return offloaded, reference, opt, ref_opt


@pytest.mark.parametrize("method", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_on_the_sharded_weight_is_refused_saying_where_its_gradient_is(rng, method):
    """An ``OffloadedEmbedding``'s weight takes autograd's gradient, so a hook on it sees the working
    set's gradient (``test_torch_features``). A ``ShardedOffloadedEmbedding``'s weight gets its gradient
    from the exchange at the step (``requires_grad=False``): torch refused the hook with its own
    ``RuntimeError`` ("cannot register a hook on a tensor that doesn't require gradient"), which said
    nothing of why or what to do. It is a ``StateError`` now (a ``RuntimeError`` too), naming the lookup's output and
    ``exchange_gradients()``; nothing is registered and training goes on as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=True)
    emb = offloaded.emb
    batches = zipf_ids(rng, STEPS)
    for step, (ids, target) in enumerate(batches):
        if step == STEPS // 2:
            with pytest.raises(ss.StateError, match=r"no gradient from autograd.*exchange_gradients"):
                getattr(emb.weight, method)(lambda *args: None)
            assert not emb.weight._backward_hooks and not getattr(emb.weight, "_post_accumulate_grad_hooks", None)
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_what_the_sharded_hook_refusal_advises_sees_the_gradients_in_memory_sees(rng):
    """The refusal's advice works: a hook on the lookup's output is handed the gradient of the rows
    looked up, as in memory, and after ``exchange_gradients()`` ``weight.grad`` holds the owned rows'
    gradient (one rank: every row of the step), as the in-memory table's gradient of those rows."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=True)
    emb = offloaded.emb
    for ids, target in zipf_ids(rng, STEPS):
        handed = {}
        for side, model in (("offloaded", offloaded), ("reference", reference)):
            out = model.emb(ids)
            out.register_hook(lambda grad, side=side: handed.__setitem__(side, grad.clone()))
            torch.nn.functional.mse_loss(model.lin(torch.tanh(out).sum(1)), target).backward()
        torch.testing.assert_close(handed["offloaded"], handed["reference"], rtol=0, atol=0)
        emb.exchange_gradients()
        owned = emb._owned.rows  # the rows of the step, by slot: every one on one rank
        assert len(owned) == len(torch.unique(ids))
        torch.testing.assert_close(emb.weight.grad[:len(owned)], reference.emb.weight.grad[owned],
                                   rtol=1e-6, atol=1e-7)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("sharded", [False, True], ids=["offloaded", "sharded_one_rank"])
@pytest.mark.parametrize("how", ["model", "embedding"])
def test_load_state_dict_with_assign_restores_the_tables_and_keeps_the_scratch(rng, sharded, how):
    """``load_state_dict(sd, assign=True)`` of a model holding an offloaded embedding, or of the
    embedding itself, restores the table and its optimizer state from the state dict, as
    ``assign=False`` does, and keeps :attr:`weight` (the scratch the rows are gathered into, which
    the optimizer holds): training resumed from it equals the in-memory run resumed from the same
    step. ``OffloadedEmbedding.load_state_dict(assign=True)`` was refused (``OptionError``) though
    its weight is never loaded, while the same load through the model went through: the two differed.
    The linear layer is frozen: ``assign=True`` hands it the state dict's tensors, which the optimizer
    built before does not hold, in memory as here."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded)
    for model in (offloaded, reference):
        model.lin.requires_grad_(False)
    emb, weight = offloaded.emb, offloaded.emb.weight
    batches = zipf_ids(rng, STEPS)
    saved = None
    for step, (ids, target) in enumerate(batches):
        if step == STEPS // 3:
            saved = [copy.deepcopy(x.state_dict()) for x in (offloaded, opt, reference, ref_opt)]
        if step == 2 * STEPS // 3:  # back to the saved step, on both sides
            state, opt_state, ref_state, ref_opt_state = copy.deepcopy(saved)
            table = state["emb._extra_state"]["tables"]["table"].clone()
            if how == "model":
                loaded = offloaded.load_state_dict(state, assign=True)
            else:
                loaded = emb.load_state_dict({k[len("emb."):]: v for k, v in state.items() if k.startswith("emb.")},
                                             assign=True)
            assert not loaded.missing_keys and not loaded.unexpected_keys
            assert emb.weight is weight and offloaded.emb.weight is weight
            np.testing.assert_array_equal(emb.table.to_numpy(), table.numpy())
            opt.load_state_dict(opt_state)
            reference.load_state_dict(ref_state)
            ref_opt.load_state_dict(ref_opt_state)
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def _tied_loss(model, ids, target):
    """A loss with an output layer tied to the embedding's weight: logits over the table's rows."""
    hidden = torch.tanh(model.emb(ids)).sum(1)
    logits = hidden @ model.emb.weight.t()
    return torch.nn.functional.mse_loss(model.lin(hidden), target) + 1e-3 * logits.pow(2).mean()


def _penalised_loss(model, ids, target):
    """A loss with an L2 penalty summed over ``model.parameters()``, the weight among them."""
    penalty = 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
    return torch.nn.functional.mse_loss(model(ids), target) + penalty


def _snapshot(offloaded, opt):
    emb = offloaded.emb
    return (emb.table.to_numpy(copy=True), {n: t.to_numpy(copy=True) for n, t in emb._state.tables.items()},
            [p.detach().clone() for p in offloaded.lin.parameters()], copy.deepcopy(opt.state_dict()["state"]))


def _assert_same_snapshot(before, after):
    np.testing.assert_array_equal(before[0], after[0])
    for name in before[1]:
        np.testing.assert_array_equal(before[1][name], after[1][name])
    for old, new in zip(before[2], after[2]):
        torch.testing.assert_close(old, new, rtol=0, atol=0)
    assert repr(before[3]) == repr(after[3])  # Adam's step counts and the linear layer's moments


@pytest.mark.parametrize("first", [True, False], ids=["first_step", "later_step"])
@pytest.mark.parametrize("loss", [_tied_loss, _penalised_loss], ids=["tied_output_layer", "penalty"])
def test_a_use_of_the_weight_outside_the_lookups_is_refused_at_a_step_with_one_forward(rng, loss, first):
    """A layer tied to ``emb.weight`` (logits over the scratch's slots, of which those past the step's rows
    hold rows of earlier steps) or a penalty over it, in a step of one forward, backward and
    ``optimizer.step()``, trained on silently: the forward refusal (``_refuse_gradient_outside_lookups``)
    needs a forward after the backward. The step is refused now, told on the host with no value read, also
    at the first step, where the slots past the step's rows are zero and their gradient can be too.
    Nothing changes (table, optimizer state, the linear layer, Adam's step counts); following the advice
    (discard, zero_grad, the weight out of the loss) trains as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=False)
    batches = zipf_ids(rng, STEPS)
    start = 0 if first else STEPS // 3
    for ids, target in batches[:start]:
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    ids, target = batches[start]
    loss(offloaded, ids, target).backward()
    _step_refused_as_outside_use_then_trained_on(offloaded, reference, opt, ref_opt, batches[start:])


def _step_refused_as_outside_use_then_trained_on(offloaded, reference, opt, ref_opt, batches):
    """``opt.step()`` refused as a use outside the lookups with nothing changed; after the advice (discard,
    zero_grad) ``batches`` train as in memory."""
    before = _snapshot(offloaded, opt)
    with pytest.raises(ss.StateError, match=r"outside its lookups.*Nothing was changed"):
        opt.step()
    _assert_same_snapshot(before, _snapshot(offloaded, opt))
    offloaded.emb.discard_step()
    opt.zero_grad()
    for ids, target in batches:
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def _shift_first_forwards_rows(table, ids, shift):
    """Add ``shift``'s rows to the rows a step's one forward so far looked up, in place under ``no_grad()``.

    An offloaded table holds them in ``weight[:len(working_rows)]``, in slot order (a sharded one of one rank
    owns every row: its owned rows); an in-memory one at their ids.
    """
    if isinstance(table, (ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding)):
        rows = _held_rows(table)[-1]
        where = slice(0, len(rows))
    else:
        rows = where = torch.unique(ids)
    with torch.no_grad():
        table.weight[where] += shift[rows]


def _held_rows(emb):
    """The rows a step holds: an offloaded embedding's working rows; a sharded one's looked-up and owned rows."""
    if isinstance(emb, ss.ShardedOffloadedEmbedding):
        return emb._looked_up.rows.clone(), emb._owned.rows.clone()
    return (emb.working_rows.clone(),)


def _squared_error(table, ids, target):
    return ((table(ids).sum(1) - target) ** 2).mean()


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "SparseAdam"])
def test_rows_written_in_place_between_two_forwards_of_one_backward_train_as_in_memory(rng, optimizer, cache_rows):
    """Forward, the rows it looked up shifted in place under ``no_grad()``, a second forward over the same rows
    (in another order, against other targets), one backward over both losses, ``optimizer.step()``: in memory
    the write breaks no graph (an embedding's backward saves its ids, not its weight) and the step trains both
    forwards' gradients. It was refused as a use of the weight outside the lookups: the lookups read a view of
    the weight, which autograd gives a new node after the write, so the two forwards' gradients reached the
    weight through two nodes, and their sum was neither node's. The lookups now read one alias with one node
    for the step: trained as the in-memory lazy reference, on fresh rows, shifts and Zipf ids.

    SGD and Adam take one arithmetic path on both sides. SparseAdam's do not: in memory it coalesces the
    two forwards' sparse gradients, one running sum over a row's lookups in both; offloaded, a row's
    gradient is each forward's sum, then the two added. Its gradient then differs by rounding, which
    ``eps`` and cancelling terms make large (below)."""
    sparse = optimizer == "SparseAdam"
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    shift = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH * WIDTH, sparse=sparse, storage="pageable",
                                backend="numpy", cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    reference = LazyTable(table0, sparse=sparse)
    # SparseAdam adds eps to sqrt(exp_avg_sq) unscaled: at a row's first step its update is proportional
    # to g / (0.0316 |g| + eps), whose slope in g where eps is a fair part of the denominator turns a
    # gradient's rounding into a table's difference (seed 2000000433, step 20: a gradient of 3.241e-6
    # offloaded, 3.261e-6 in memory, 3.318e-6 in float64; the update's slope there is 640, and the element
    # ends 1.3e-5 off, each float32 side 3.5e-5 to 4.8e-5 off float64's). With eps=1e-30, as elsewhere
    # against SparseAdam, that update is g's sign times the step's size, whatever g's rounding.
    eps = dict(eps=1e-30) if sparse else {}
    opt, ref_opt = (getattr(torch.optim, optimizer)(t.parameters(), lr=0.05, **eps) for t in (emb, reference))
    emb.attach(opt)
    make_lazy(ref_opt, reference)
    batches = zipf_ids(rng, 2 * STEPS)
    for (ids, target), (_, more_target) in zip(batches[::2], batches[1::2]):
        for table, optimizer in ((emb, opt), (reference, ref_opt)):
            loss = _squared_error(table, ids, target)
            _shift_first_forwards_rows(table, ids, shift)
            # The same rows: a forward bringing in new ones after the write is refused (test below).
            (loss + _squared_error(table, ids.flip(0), more_target)).backward()
            optimizer.step()
            optimizer.zero_grad()

    def assert_close(actual, desired, name):
        # SparseAdam's gradient, rounded otherwise, sums terms at the scale of a frequent row's values (the
        # table's up to 80): exp_avg, 0.1 * 0.9**k of each step's, cancelling to a small one, keeps their
        # rounding (seed 4177, eps=1e-30: -0.0267899 offloaded, -0.0267888 in memory, -0.0267904 in float64,
        # where the largest was 19.9), and a table element small now passed through values at the table's scale. Its
        # absolute tolerance is the relative one times the largest value; a step lost or repeated moves a row
        # by about lr = 0.05.
        atol = 1e-6 * max(1.0, np.abs(desired).max()) if sparse else 1e-6
        np.testing.assert_allclose(actual, desired, rtol=1e-6, atol=atol, err_msg=name)

    trained = emb.table.to_numpy()
    assert_close(trained, reference.weight.detach().numpy(), "table")
    assert np.abs(trained - table0).max() > 1e-3  # trained, and shifted
    ref_state = {k: v for k, v in ref_opt.state[reference.weight].items() if torch.is_tensor(v) and v.ndim}
    assert emb._state.tables.keys() == ref_state.keys()  # Adam's moments, none for SGD
    for name, table in emb._state.tables.items():
        assert_close(table.to_numpy(), ref_state[name].numpy(), name)


def _halve_weight(table, ids, shift):
    with torch.no_grad():
        table.weight.mul_(0.5)


@pytest.mark.parametrize("backward_between", [False, True], ids=["one_backward", "backward_between"])
@pytest.mark.parametrize("write", [_shift_first_forwards_rows, _halve_weight], ids=["held_rows", "whole_weight"])
@pytest.mark.parametrize("sharded, cache_rows, looked_up", [(False, 0, "new_rows"), (False, 40, "new_rows"),
                                                             (True, 0, "new_rows"), (True, 0, "held_rows")],
                         ids=["offloaded", "offloaded_cache", "sharded", "sharded_held_rows"])
def test_a_forward_of_new_rows_after_a_write_into_the_weight_in_the_middle_of_a_step_is_refused(
        rng, sharded, cache_rows, looked_up, write, backward_between):
    """``emb.weight`` holds the rows a step looked up so far. ``weight.mul_(0.5)`` between two forwards
    halves those rows, while in memory it halves the whole table: rows the second forward brought in came
    from the table unhalved, silently (a write reaching only the held rows cannot be told from it without
    reading values). A forward that brings in new rows after such a write is refused now, with or without a
    backward between, before the working set, the cache, its counters or any table changes; after the
    advice (discard the step) training goes on as in memory. A ``ShardedOffloadedEmbedding`` (one rank)
    trained on silently too, and also wrong for a forward of the step's own rows: its lookups read copies
    of the rows taken at the forwards, which the write into its weight (the owned rows) did not reach, so
    it refuses any training forward after the write."""
    offloaded, reference = pair(rng, cache_rows=cache_rows, sharded=sharded)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    emb = offloaded.emb
    shift = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        if step == STEPS // 2:
            loss = torch.nn.functional.mse_loss(offloaded(ids), target)
            if backward_between:
                loss.backward()
            write(emb, ids, shift)
            if looked_up == "new_rows":
                ids = torch.from_numpy(np.setdiff1d(np.arange(ROWS), ids.numpy())[:ids.numel()]).view(ids.shape)
            before = _snapshot(offloaded, opt)  # which flushes the cache: counted in stats()
            held, stats = _held_rows(emb), emb.stats()
            why = r".*gathered them from their owners" if sharded else r".*does not hold yet"
            with pytest.raises(ss.StateError, match=r"written in place since this step's last training forward"
                                                    + why + r".*nothing was changed"):
                offloaded(ids.flip(0))
            assert all(map(torch.equal, _held_rows(emb), held)) and emb.stats() == stats
            _assert_same_snapshot(before, _snapshot(offloaded, opt))
            emb.discard_step()  # the reference skips the step
            opt.zero_grad()
            continue
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("backward_between", [False, True], ids=["write_then_backward", "backward_then_write"])
def test_rows_written_into_the_sharded_weight_after_the_steps_last_forward_train_as_in_memory(rng, backward_between):
    """What the sharded refusal above advises: the step's rows shifted in place in ``emb.weight`` (one
    rank: its owned rows) after the step's last forward, before or after its backward, then
    ``optimizer.step()``: the step trains the shifted rows, as the in-memory lazy reference does."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=True)
    shift = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    for ids, target in zipf_ids(rng, STEPS):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            loss = torch.nn.functional.mse_loss(model(ids), target)
            if backward_between:
                loss.backward()
            _shift_first_forwards_rows(model.emb, ids, shift)
            if not backward_between:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("loss", [_tied_loss, _penalised_loss], ids=["tied_output_layer", "penalty"])
def test_a_use_of_the_weight_outside_the_lookups_after_rows_written_between_two_forwards_is_refused(rng, loss):
    """The pattern above (forward, rows written in place, a second forward of its rows, one backward) with a tied
    output layer or a penalty over the weight in the second forward's loss: refused at the step as with one
    forward, nothing changed; after the advice (discard, zero_grad) training goes on as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=False)
    shift = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    batches = zipf_ids(rng, STEPS)
    (ids, target), (_, more_target) = batches[:2]
    first = torch.nn.functional.mse_loss(offloaded(ids), target)
    _shift_first_forwards_rows(offloaded.emb, ids, shift)
    (first + loss(offloaded, ids.flip(0), more_target)).backward()
    _step_refused_as_outside_use_then_trained_on(offloaded, reference, opt, ref_opt, batches[2:])


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_hook_that_rescales_the_weights_gradient_trains_as_in_memory_and_is_no_use_outside_the_lookups(
        rng, cache_rows):
    """The step's check of a use outside the lookups compares what reaches the weight with what the lookups
    handed it; a hook of the user's on the weight (per-row rescaling of the gradient) replaces it, after
    the check: two forwards in one backward, gradient accumulation, such a hook, train as in memory."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    for model in (offloaded, reference):
        model.emb.weight.register_hook(lambda grad: grad * 0.5)
    batches = zipf_ids(rng, 2 * STEPS)
    for (ids, target), (more, more_target) in zip(batches[::2], batches[1::2]):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            both = torch.nn.functional.mse_loss(model(ids), target) + torch.nn.functional.mse_loss(model(more),
                                                                                                 more_target)
            both.backward()
            torch.nn.functional.mse_loss(model(ids[:BATCH // 2]), target[:BATCH // 2]).backward()  # accumulated
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
