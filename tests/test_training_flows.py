"""Unusual training flows: offloaded training equals an independent in-memory reference, or raises.

Each test trains an :class:`~speedswap.OffloadedEmbedding` and an in-memory
``nn.Parameter`` table from the same random initial rows on Zipf-distributed
ids, and compares the two. The reference is lazy, like the existing
equivalence tests (``training_helpers.run_in_memory``): after each step every
row no training forward looked up gets its value and optimizer state back as
they were before the step.
"""

import concurrent.futures
import copy
import functools
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import speedswap as ss
from rendezvous import rendezvous_url
from training_helpers import step_failing_once
import speedswap.train.embedding as embedding_module
import speedswap.train.sharded as sharded_module
from speedswap.train.module_state import rows_only
from speedswap.train.reached import in_backward
from speedswap.train.zero_marks import reads_as_zeroed

ROWS, DIM, BATCH, WIDTH, STEPS = 300, 6, 8, 5, 30
PAD = 7


def zipf_ids(rng, steps):
    """``steps`` batches of ``(BATCH, WIDTH)`` ids, p(r) ~ 1/(r+1) over scattered rows, and targets."""
    p = 1.0 / np.arange(1, ROWS + 1)
    perm = rng.permutation(ROWS)
    return [(torch.from_numpy(perm[rng.choice(ROWS, size=(BATCH, WIDTH), p=p / p.sum())]),
             torch.from_numpy(rng.standard_normal((BATCH, 1)).astype(np.float32)))
            for _ in range(steps)]


class Model(torch.nn.Module):
    """An embedding bag into a linear layer: the embedding and a dense layer in one optimizer."""

    def __init__(self, embedding, linear):
        super().__init__()
        self.emb, self.lin = embedding, linear

    def forward(self, ids):
        return self.lin(torch.tanh(self.emb(ids)).sum(1))


class LazyTable(torch.nn.Module):
    """The in-memory reference table: records the ids training forwards look up."""

    def __init__(self, table0, padding_idx=None, sparse=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.from_numpy(table0.copy()))
        self.padding_idx, self.sparse, self.looked_up = padding_idx, sparse, []

    def forward(self, ids):
        if self.training and torch.is_grad_enabled():
            self.looked_up.append(ids.reshape(-1))
        return F.embedding(ids, self.weight, padding_idx=self.padding_idx, sparse=self.sparse)


def make_lazy(optimizer, table, initial=None):
    """Hook ``optimizer`` so that rows ``table`` did not look up keep their value and state at each step.

    ``initial``: ``{state name: value}`` for state torch creates with another value than zero
    (Rprop's ``step_size``, its lr), what an untouched row holds once torch creates it.
    """
    initial = initial or {}
    weight, before = table.weight, {}

    def pre(opt, args, kwargs):
        before["weight"] = weight.detach().clone()
        before["state"] = {k: v.clone() for k, v in opt.state.get(weight, {}).items()
                           if torch.is_tensor(v) and v.shape == weight.shape}

    def post(opt, args, kwargs):
        untouched = torch.ones(len(weight), dtype=torch.bool)
        for ids in table.looked_up:  # none in a step on zero gradients only
            untouched[ids] = False
        table.looked_up.clear()
        with torch.no_grad():
            weight[untouched] = before["weight"][untouched]
            for name, value in opt.state[weight].items():
                if torch.is_tensor(value) and value.shape == weight.shape:
                    value[untouched] = (before["state"][name][untouched] if name in before["state"]
                                        else initial.get(name, 0.0))

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)


def pair(rng, padding_idx=None, pad_row=None, sparse=False, cache_rows=0, sharded=False):
    """An offloaded model and its in-memory reference, from the same random rows and linear layer.

    ``sparse``: the reference table's gradient is sparse (for ``torch.optim.SparseAdam``).
    ``cache_rows``: the offloaded embedding's device cache.
    ``sharded``: a :class:`~speedswap.ShardedOffloadedEmbedding` of one rank (no padding row, no cache).
    """
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    if padding_idx is not None:
        table0[padding_idx] = 0.0 if pad_row is None else pad_row
    linear = torch.nn.Linear(DIM, 1)
    options = dict(max_rows=2 * BATCH * WIDTH + 1, storage="pageable", backend="numpy")
    emb = (ss.ShardedOffloadedEmbedding(ROWS, DIM, **options) if sharded else
           ss.OffloadedEmbedding(ROWS, DIM, padding_idx=padding_idx, cache_rows=cache_rows, **options))
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))  # pad_row too: pretrained rows
    return Model(emb, copy.deepcopy(linear)), Model(LazyTable(table0, padding_idx, sparse), linear)


def train_step(model, opt, ids, target):
    F.mse_loss(model(ids), target).backward()
    opt.step()
    opt.zero_grad()


def assert_equal_to_reference(offloaded, opt, reference, ref_opt, exact=False):
    """The offloaded model's table, optimizer state and linear layer against the reference's.

    ``exact``: bit for bit, where both take one arithmetic path; else to float32 rounding.
    """
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(offloaded.emb.table.to_numpy(), reference.emb.weight.detach().numpy(), **tol)
    ref_state = ref_opt.state[reference.emb.weight]
    for name, table in offloaded.emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), ref_state[name].numpy(), err_msg=name, **tol)
    for mine, ref in zip(offloaded.lin.parameters(), reference.lin.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), ref.detach().numpy(), **tol)


def padded_pair(rng, make_opt=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)):
    """:func:`pair` with a pretrained padding row (0.5), each side's optimizer attached, the reference lazy.

    Returns:
        (offloaded, reference, opt, ref_opt)
    """
    offloaded, reference = pair(rng, padding_idx=PAD, pad_row=0.5)
    opt, ref_opt = make_opt(offloaded.parameters()), make_opt(reference.parameters())
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    return offloaded, reference, opt, ref_opt


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
], ids=["adamw", "adam_amsgrad", "sgd_momentum"])
def test_a_pretrained_padding_row_moves_only_at_steps_that_look_it_up(make_opt, rng):
    # The padding row rides along in slot 0 of every step; with weight decay a step that
    # did not look it up used to shrink it anyway (seen: 0.5 -> 0.22 in 30 Adam steps).
    offloaded, reference, opt, ref_opt = padded_pair(rng, make_opt)
    batches = zipf_ids(rng, STEPS)
    batches[3][0][0, 0] = PAD  # looked up at one step at least, so it must move then
    for ids, target in batches:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    assert not np.allclose(offloaded.emb.table.to_numpy()[PAD], 0.5)


def test_a_pretrained_padding_row_moves_only_at_steps_one_of_several_forwards_looks_it_up(rng):
    # Whether a step's forwards looked the padding row up is one compare over all of their
    # slots together: here three forwards a step, the row in the middle one's ids at one step.
    offloaded, reference, opt, ref_opt = padded_pair(rng)
    batches = zipf_ids(rng, STEPS)
    for ids, _ in batches:
        ids[ids == PAD] = PAD + 1
    batches[3][0][3, 0] = PAD  # chunk(3) of 8 rows: rows 3-5 are the second forward's
    for ids, target in batches:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            sum(F.mse_loss(model(part), goal)
                for part, goal in zip(ids.chunk(3), target.chunk(3))).backward()
            optimizer.step()
            optimizer.zero_grad()
        if ids is batches[2][0]:  # no step so far looked it up
            np.testing.assert_array_equal(offloaded.emb.table.to_numpy()[PAD], 0.5)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    assert not np.allclose(offloaded.emb.table.to_numpy()[PAD], 0.5)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_a_compiled_model_trains_as_the_in_memory_one(rng, compiler, cache_rows):
    """``torch.compile(model)`` runs the embedding's forward eagerly and compiles the rest.

    Traced, the forward's working-set bookkeeping raised a false "emb.weight was
    written between steps" at the first step. ``aot_eager`` traces forward and
    backward as inductor does, without a C++ compiler (inductor itself passes
    too, after a 41 s compile on a 2-core CPU: too slow for the suite); ``eager``
    runs dynamo's tracing and guards alone. Some steps' losses are weighted by
    0: their rows' zero gradient keeps its mark through the compiled backward
    and ``clip_grad_norm_`` (an in-place write), and Adam moves them by their
    momentum, as in memory.
    """
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    compiled = torch.compile(offloaded, backend=compiler)
    batches = zipf_ids(rng, STEPS)
    weights = np.where(rng.random(STEPS) < 0.3, 0.0, 1.0)
    weights[:2], weights[rng.integers(2, STEPS)] = 1.0, 0.0  # momentum first, then one zero weight at least
    for (ids, target), weight in zip(batches, weights):
        for model, optimizer in ((compiled, opt), (reference, ref_opt)):
            (weight * F.mse_loss(model(ids), target)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    offloaded.eval()
    ids = batches[0][0]
    torch.testing.assert_close(compiled(ids), reference(ids), rtol=1e-6, atol=1e-6)


def test_a_step_after_eval_mode_forwards_only_is_refused_and_nothing_changes(rng):
    """nn.Embedding trains in eval mode; an offloaded eval forward reads rows without a gradient, so
    fine-tuning in eval() (to keep BatchNorm's statistics) silently left the table as it was."""
    offloaded, reference = pair(rng)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, STEPS)
    for ids, target in batches[:3]:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    table, linear = offloaded.emb.table.to_numpy(copy=True), offloaded.lin.weight.detach().clone()
    offloaded.eval()
    ids, target = batches[3]
    F.mse_loss(offloaded(ids), target).backward()
    with pytest.raises(ss.StateError, match="eval mode and none in training mode"):
        opt.step()
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)
    assert torch.equal(offloaded.lin.weight, linear)  # the whole step was refused, not just the table
    # As the error says: training mode, the step's forwards again (this model has no dropout or
    # BatchNorm: in memory, eval mode would train it the same).
    opt.zero_grad()
    offloaded.train()
    for ids, target in batches[3:]:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_an_eval_forward_between_training_forwards_of_a_step_trains_as_before(rng):
    """Evaluating without torch.no_grad() beside a step's training forwards is let through."""
    offloaded, reference = pair(rng)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    for ids, target in zipf_ids(rng, STEPS):
        offloaded.eval()
        torch.testing.assert_close(offloaded(ids), reference(ids), rtol=1e-6, atol=1e-6)
        offloaded.train()
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_a_first_step_over_an_empty_batch_counts_and_training_goes_on(rng):
    """torch created AdamW's state for the scratch at an empty first step; the next forward took it
    for state a load_state_dict() had replaced, and refused to train (found by the sharded fuzzer)."""
    offloaded, reference = pair(rng)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    empty = torch.zeros((0, WIDTH), dtype=torch.int64)
    for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
        model(empty).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    for ids, target in zipf_ids(rng, STEPS):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    assert opt.state[offloaded.emb.weight]["step"] == ref_opt.state[reference.emb.weight]["step"] == STEPS + 1


def test_a_pretrained_padding_row_stays_when_only_an_unreached_forward_looked_it_up(rng):
    offloaded, reference, opt, ref_opt = padded_pair(rng)
    (ids, target), (skipped, _) = zipf_ids(rng, 2)
    ids[ids == PAD] = PAD + 1  # only the skipped forward looks the padding row up
    skipped[0, 0] = PAD
    offloaded(skipped)  # a skipped loss: its graph is dropped before any backward
    for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
        train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy()[PAD], 0.5)


def _run_until_older_state_is_loaded(rng, make_opt):
    offloaded, _ = pair(rng)
    opt = make_opt(offloaded.parameters())
    offloaded.emb.attach(opt)
    batches = zipf_ids(rng, 12)
    for step, (ids, target) in enumerate(batches[:10]):
        if step == 4:
            older = copy.deepcopy(opt.state_dict())
        train_step(offloaded, opt, ids, target)
    return offloaded, opt, older, batches[10:]


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.Rprop(p, lr=0.02),
    lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.2),  # state made with it
], ids=["adam", "rprop", "adagrad"])
def test_an_older_optimizer_state_dict_alone_is_refused_before_the_next_step(make_opt, rng):
    # The optimizer's state_dict holds the working set's scratch, not the rows' state: in
    # memory loading it restores every row's moments, offloaded it used to train on silently
    # with the current moments and the older step count (seen: 0.055 off the reference).
    offloaded, opt, older, rest = _run_until_older_state_is_loaded(rng, make_opt)
    opt.load_state_dict(older)
    table = offloaded.emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match=r"emb\.load\(path\)"):
        offloaded(rest[0][0])
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)
    assert offloaded.emb.working_rows.numel() == 0  # nothing began: emb.load may run now


def test_an_older_optimizer_state_dict_loaded_after_the_forward_is_refused_at_the_step(rng):
    offloaded, opt, older, rest = _run_until_older_state_is_loaded(
        rng, lambda p: torch.optim.Adam(p, lr=0.01))
    ids, target = rest[0]
    F.mse_loss(offloaded(ids), target).backward()
    opt.load_state_dict(older)
    table = offloaded.emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match="replaced since the last step"):
        opt.step()
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)


def test_a_resume_that_restores_only_the_optimizer_state_dict_is_refused(rng, tmp_path):
    offloaded, opt, older, rest = _run_until_older_state_is_loaded(
        rng, lambda p: torch.optim.Adam(p, lr=0.01))
    offloaded.emb.save(tmp_path / "ckpt")
    saved = copy.deepcopy(opt.state_dict())
    resumed, _ = pair(rng)
    resumed.load_state_dict(rows_only(offloaded.state_dict()))  # the rows, not their optimizer state
    new_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    new_opt.load_state_dict(saved)
    resumed.emb.attach(new_opt)  # a first attach keeps the loaded step count
    with pytest.raises(ss.StateError, match=r"emb\.load\(path\)"):
        resumed(rest[0][0])
    resumed.emb.load(tmp_path / "ckpt")  # the rows' state saved with it: now the resume is whole
    for ids, target in rest:
        train_step(resumed, new_opt, ids, target)
        train_step(offloaded, opt, ids, target)
    np.testing.assert_array_equal(resumed.emb.table.to_numpy(), offloaded.emb.table.to_numpy())


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_an_in_memory_runs_optimizer_state_dict_is_refused_saying_how_its_rows_state_goes_on(rng, cache_rows):
    """Going on offloaded from an in-memory run: its optimizer's state_dict holds the whole table's
    moments, which load_state_dict puts where the step would replace them with the tables' own. The
    refusal said to restore "the checkpoint saved with it", which such a run has not; it now says
    the state is the whole table's and how it goes into the tables, and that way training goes on
    equal to the in-memory run."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, STEPS)
    for ids, target in batches[:5]:  # the in-memory run
        train_step(reference, ref_opt, ids, target)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    offloaded.lin.load_state_dict(reference.lin.state_dict())
    table = offloaded.emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match=r"shaped like the whole table \(300, 6\).*set_extra_state"):
        offloaded(batches[5][0])
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)
    weight = reference.emb.weight
    extra = offloaded.emb.get_extra_state()  # as the error says
    extra["tables"] = {"table": weight.detach().clone(),
                       **{f"optimizer.{name}": ref_opt.state[weight][name].clone()
                          for name in ("exp_avg", "exp_avg_sq")}}
    offloaded.emb.set_extra_state(extra)
    for ids, target in batches[5:]:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    assert int(opt.state[offloaded.emb.weight]["step"]) == STEPS


def test_init_state_accepts_an_older_optimizer_state_dict(rng):
    """The steps after it train as in memory from fresh moments for every row, the older step count and the
    linear layer's older moments (the test only ran them: a step that trained wrong passed)."""
    make = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    offloaded, opt, older, rest = _run_until_older_state_is_loaded(rng, make)
    reference = Model(LazyTable(offloaded.emb.table.to_numpy(copy=True)), copy.deepcopy(offloaded.lin))
    ref_opt = make(reference.parameters())
    make_lazy(ref_opt, reference.emb)
    opt.load_state_dict(older)
    offloaded.emb.init_state()  # the user's explicit choice: fresh moments, the older step count
    # The linear layer's moments; the table's are replaced below. A copy: torch loads the step counts as given,
    # so that two optimizers loaded from one dict would count each other's steps.
    ref_opt.load_state_dict(copy.deepcopy(older))
    step = older["state"][0]["step"].clone()  # the offloaded optimizer counts on in older's own
    start = int(step)
    assert 0 < start < 10  # older than the 10 steps trained
    ref_opt.state[reference.emb.weight] = {"step": step, "exp_avg": torch.zeros(ROWS, DIM),
                                           "exp_avg_sq": torch.zeros(ROWS, DIM)}
    for ids, target in rest:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    assert int(opt.state[offloaded.emb.weight]["step"]) == int(step) == start + len(rest)


@pytest.mark.parametrize("emb_first", [True, False], ids=["emb_then_opt", "opt_then_emb"])
def test_a_checkpoint_replay_with_the_optimizer_state_dict_equals_the_reference(emb_first, rng, tmp_path):
    offloaded, reference = pair(rng)
    make = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    opt, ref_opt = make(offloaded.parameters()), make(reference.parameters())
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, 20)
    for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
        for step, (ids, target) in enumerate(batches):
            if step == 5:
                saved = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model.state_dict())
                if model is offloaded:
                    offloaded.emb.save(tmp_path / "ckpt")
            if step == 15:
                if model is offloaded and emb_first:
                    offloaded.emb.load(tmp_path / "ckpt")
                optimizer.load_state_dict(saved[0])
                model.load_state_dict(saved[1])
                if model is offloaded and not emb_first:
                    offloaded.emb.load(tmp_path / "ckpt")
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_a_round_trip_of_the_optimizer_own_state_dict_trains_on(rng):
    offloaded, reference = pair(rng)
    make = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    opt, ref_opt = make(offloaded.parameters()), make(reference.parameters())
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            if step == 10:
                optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_re_attaching_an_earlier_optimizer_starts_it_afresh_as_a_new_one(rng):
    """A, then B, then A again: A's third run equals a fresh Adam's (it kept A's step count)."""
    offloaded, reference = pair(rng)
    first = torch.optim.Adam(offloaded.parameters(), lr=0.01)
    other = torch.optim.Adagrad(offloaded.parameters(), lr=0.01)
    batches = zipf_ids(rng, 15)
    for optimizer, part in ((first, batches[:5]), (other, batches[5:10])):
        offloaded.emb.attach(optimizer)
        for ids, target in part:
            train_step(offloaded, optimizer, ids, target)
    offloaded.emb.attach(first)
    # The reference: the rows and linear layer as they are now, and a fresh Adam for both models
    # (the linear layer's state is dropped in the offloaded one's too: attach concerns the table).
    for param in offloaded.lin.parameters():
        first.state.pop(param, None)
    with torch.no_grad():
        reference.emb.weight.copy_(torch.from_numpy(offloaded.emb.table.to_numpy()))
        for mine, ref in zip(offloaded.lin.parameters(), reference.lin.parameters()):
            ref.copy_(mine)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    make_lazy(ref_opt, reference.emb)
    for ids, target in batches[10:]:
        train_step(offloaded, first, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert int(first.state[offloaded.emb.weight]["step"]) == 5
    assert_equal_to_reference(offloaded, first, reference, ref_opt)


def switchers(rng, cache_rows=0):
    """A ModelFactory + OptimizerFactory pair (Adam) over random rows, in a model with a linear layer."""
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(BATCH * WIDTH, DIM), "lin": torch.nn.Linear(DIM, 1)})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    u = ss.ModelFactory(model["u"], ROWS, DIM, storage="pageable", backend="numpy", cache_rows=cache_rows)
    table0 = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    u.customInit(lambda t: t.copy_(table0))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", storage="pageable", backend="numpy",
                            cache_rows=cache_rows)
    return model, opt, u, o


def backward(model, local, target):
    F.mse_loss(model["lin"](torch.tanh(model["u"](local)).sum(1)), target).backward()


def snapshot(u, o):
    return u.getNumpyVersion().copy(), {k: t.to_numpy(copy=True) for k, t in o.state.tables.items()}


def assert_same_snapshot(a, b):
    np.testing.assert_array_equal(a[0], b[0])
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name], err_msg=name)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("model_first", [True, False], ids=["model_after_step_first", "optimizer_first"])
@pytest.mark.parametrize("late_step", [False, True], ids=["no_step", "step_after_after_step"])
def test_switchers_refuse_after_step_when_the_optimizer_did_not_step(rng, cache_rows, model_first, late_step):
    # The rows went back untrained and the next before_forward dropped the gradient, silently.
    seed = int(rng.integers(2**31))
    model, opt, u, o = switchers(np.random.default_rng(seed), cache_rows)
    in_order, in_order_opt, in_order_u, in_order_o = switchers(np.random.default_rng(seed), cache_rows)
    in_order.load_state_dict(model.state_dict())
    batches = zipf_ids(rng, 3)
    first, second = (u, o) if model_first else (o, u)
    for step, (ids, target) in enumerate(batches):
        in_order_u.before_forward(ids)
        backward(in_order, in_order_o.before_forward(ids), target)
        in_order_opt.step()
        in_order_u.after_step(ids)
        in_order_o.after_step(ids)
        in_order_opt.zero_grad()
        u.before_forward(ids)
        backward(model, o.before_forward(ids), target)
        if step == 1:
            with pytest.raises(ss.StateError,
                               match=r"afterOptimizerStep \(after_step\) without Adam\.step\(\).*zero_grad"):
                first.after_step(ids)
            if late_step:  # a step placed after after_step: the first after_step was refused already
                with pytest.raises(ss.StateError, match=r"afterOptimizerStep \(after_step\) without Adam\.step\(\)"):
                    second.after_step(ids)
        # The advice works: the refused step is still open and nothing was written back.
        opt.step()
        first.after_step(ids)
        second.after_step(ids)
        opt.zero_grad()
    assert_same_snapshot(snapshot(u, o), snapshot(in_order_u, in_order_o))
    for mine, ref in zip(model["lin"].parameters(), in_order["lin"].parameters()):
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)


def test_a_step_without_update_is_accepted_when_the_gradient_is_dropped_or_not_finite(rng):
    model, opt, u, o = switchers(rng)
    (ids, target), (eval_ids, _), (amp_ids, amp_target) = zipf_ids(rng, 3)
    before = snapshot(u, o)
    # An evaluation forward: no backward, no step.
    with torch.no_grad():
        u.before_forward(eval_ids)
        model["u"](o.before_forward(eval_ids))
    u.after_step(eval_ids)
    o.after_step(eval_ids)
    # A skipped update: the gradient dropped with zero_grad before after_step (either kind).
    for set_to_none in (False, True):
        local = u.before_forward(ids)
        o.before_forward(ids)
        opt.zero_grad()  # a gradient zeroed in place before before_forward is refused as a leftover
        backward(model, local, target)
        opt.zero_grad(set_to_none=set_to_none)
        o.after_step(ids)
        u.after_step(ids)
    # A step GradScaler skips: a non-finite gradient in another of the optimizer's parameters.
    local = u.before_forward(amp_ids)
    o.before_forward(amp_ids)
    opt.zero_grad()
    backward(model, local, amp_target)
    model["lin"].weight.grad[0, 0] = float("inf")
    u.after_step(amp_ids)
    o.after_step(amp_ids)
    opt.zero_grad()
    assert_same_snapshot(snapshot(u, o), before)


def adam_against_sparse_adam(rng, backend, max_rows, cache_rows=0, sparse=False, betas=(0.9, 0.999), **options):
    """(emb, opt, ref, ref_opt, device): an offloaded Adam (SparseAdam on a sparse gradient when
    ``sparse``; built with ``options`` too) and an in-memory SparseAdam on the same rows, both with ``betas``.

    The reference trains in float64: a float32 one carries rounding errors of its own, which
    cancelling gradients make large (seed 1774118411: a table element 2.8e-6 off float64's, where
    the offloaded one was 3.1e-7 off, on the CPU and an H200 alike)."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=max_rows, storage="pageable", backend=backend,
                                cache_rows=cache_rows, sparse=sparse)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    optimizer = torch.optim.SparseAdam if sparse else torch.optim.Adam
    opt = optimizer(emb.parameters(), lr=0.05, eps=1e-30, betas=betas, **options)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.astype(np.float64)))
    ref_opt = torch.optim.SparseAdam([ref], lr=0.05, eps=1e-30, betas=betas)
    return emb, opt, ref, ref_opt, ss.get_backend(backend).device


def assert_trained_as_sparse_adam(emb, ref, ref_opt):
    """The table and Adam's moments of :func:`adam_against_sparse_adam`'s two sides, equal to rounding.

    ``exp_avg`` sums 0.1 * 0.9**k of each step's gradient, which the offloaded side computes in
    float32 (Adam on the working set's gradient; the reference, on a coalesced sparse one in float64,
    sums a row's lookups in another order), so each term carries a rounding error relative to itself: where the
    terms cancel to a small ``exp_avg`` its error is that of the largest terms (seeds 2, 118, 127,
    147, 148, 167, 209, 300: one element 1.2e-6 to 4.8e-6 off, on moments of 0.005-0.02 where the
    largest was 10-44). So its absolute tolerance is the relative one times the largest moment; a
    row stepped wrongly, or not at all, is off by a tenth of its moment. ``exp_avg_sq`` sums
    squares, which do not cancel. The table takes those errors in each step's update, and an
    element small now passed through values at the table's scale, rounded in float32 at each
    step: its absolute tolerance is the relative one times the largest element too (seed 11:
    2.0e-6 off on an element of 0.083 where the largest was 2.7; seed 12, an accumulated backward:
    6.2e-7 on -0.003 where it was 3.6, 0.6 of a fixed atol=1e-6; a step lost or repeated moves a
    row by about lr = 0.05).
    """
    emb.flush()
    table = ref.detach().numpy()
    np.testing.assert_allclose(emb.table.to_numpy(), table, rtol=1e-5, atol=1e-5 * np.abs(table).max())
    exp_avg, exp_avg_sq = (ref_opt.state[ref][name].numpy() for name in ("exp_avg", "exp_avg_sq"))
    np.testing.assert_allclose(emb._state.tables["exp_avg"].to_numpy(), exp_avg,
                               rtol=1e-5, atol=1e-5 * np.abs(exp_avg).max(), err_msg="exp_avg")
    np.testing.assert_allclose(emb._state.tables["exp_avg_sq"].to_numpy(), exp_avg_sq,
                               rtol=1e-5, atol=1e-6, err_msg="exp_avg_sq")


def both_sides(emb, opt, ref, ref_opt, device):
    """The two sides of :func:`adam_against_sparse_adam` as ``(lookup, optimizer, device)`` triples."""
    return (emb, opt, device), (lambda i: F.embedding(i, ref, sparse=True), ref_opt, "cpu")


def step_both(sides, ids, target):
    """A plain step on each side: forward, squared-error backward, step, zero_grad."""
    for lookup, optimizer, to in sides:
        ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_step_skipped_after_its_backward_then_zero_grad_after_the_next_forward(backend, rng, cache_rows):
    """The loop order forward, ``zero_grad()``, backward, step, with steps skipped after their backward.

    The next forward joins the skipped step's working set (its gradient is
    still there: accumulation), then ``zero_grad()`` drops that gradient. In
    memory the skipped step's rows are then never trained; Adam moved them by
    their momentum at a zero gradient.
    """
    # Room for every row: skipped steps in a row all join one working set (seed 127: 123 distinct
    # rows of four steps, over the 120 of three steps' ids that this test first gave it).
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows)
    skipped = set(rng.choice(STEPS * 2 - 1, size=STEPS // 2, replace=False).tolist())  # the last steps
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS * 2)):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            out = lookup(ids.to(to)).cpu()
            optimizer.zero_grad()
            ((out.sum(1) - target) ** 2).sum().backward()
            if step not in skipped:  # a loss that was not finite, say: no step, no discard_step()
                optimizer.step()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("zero_first", [True, False], ids=["zero_grad_first", "zero_grad_last"])
def test_a_step_a_grad_scaler_skipped_with_zero_grad_set_to_none_false_trains_nothing(
        backend, rng, cache_rows, zero_first):
    """A ``GradScaler`` loop with ``zero_grad(set_to_none=False)`` and no ``discard_step()``: a step
    whose gradients are not finite is skipped, zeroed, and never trained, as in memory, where
    SparseAdam's zeroed sparse gradient names no row. The next forward used to join the skipped
    step's rows, and Adam moved them by their momentum at a zero gradient."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows)
    sides = [(*side, torch.amp.GradScaler("cpu", init_scale=4.0))
             for side in both_sides(emb, opt, ref, ref_opt, device)]
    batches = zipf_ids(rng, STEPS)
    skipped = rng.random(STEPS) < 0.3
    # A step with momentum, then a skipped one at least; the last runs (a skipped one holds its rows
    # until the next forward or zero_grad(), and emb.table refuses them with a cache).
    skipped[:2], skipped[-1] = (False, True), False
    for (ids, target), skip in zip(batches, skipped):
        for lookup, optimizer, to, scaler in sides:
            if zero_first:
                optimizer.zero_grad(set_to_none=False)
            loss = ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum()
            scaler.scale(loss * (torch.inf if skip else 1.0)).backward()
            scaler.step(optimizer)  # skipped where the gradients are not finite
            scaler.update()
            if not zero_first:
                optimizer.zero_grad(set_to_none=False)
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


#: Adam betas whose complements float32 holds exactly. CUDA's fused Adam computes ``1 - beta2`` in
#: float32, 1.29e-5 off 0.001 for 0.999: its exp_avg_sq came out 1.31e-5 off SparseAdam's on an H200,
#: past the comparison's 1e-5 (foreach on the H200, and fused on the CPU, passed with 0.999).
FLOAT32_EXACT_BETAS = (0.875, 0.9990234375)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("written", [False, True], ids=["as_left", "written_in_place"])
@pytest.mark.parametrize("option", [None, "foreach", "fused"])
def test_zero_grad_after_a_backward_then_a_step_with_no_forward_moves_no_row_as_in_memory(
        backend, rng, cache_rows, written, option, monkeypatch):
    """Backward, ``zero_grad(set_to_none=False)``, ``optimizer.step()`` with no forward between (a loop
    that skips a step by zeroing its gradients and steps anyway). In memory SparseAdam's zeroed sparse
    gradient names no row: the step moves none (and counts). The step's rows were still in flight, and
    Adam moved them by their momentum at the zero gradient. A gradient written in place but not zeroed
    (``unscale_``, clipping: ``mul_`` here) trains as it is. An optimizer built with ``foreach=True`` or
    ``fused=True`` zeroes through ``torch._foreach_zero_``, whose CUDA kernel leaves the version
    counters as they were (imitated on the CPU, the kernel itself on a GPU): the gradient looked
    untouched since the backward, and its rows were moved too."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows,
                                                              betas=FLOAT32_EXACT_BETAS,
                                                              **({option: True} if option else {}))
    imitated = option is not None and device.type == "cpu"
    if imitated:
        monkeypatch.setattr(torch, "_foreach_zero_", lambda grads: [grad.data.zero_() for grad in grads])
        monkeypatch.setattr(ss.train.embedding, "_foreach_zero_keeps_version", lambda device: True)
    skipped = rng.random(STEPS) < 0.3
    skipped[:2] = False  # momentum first
    skipped[rng.integers(2, STEPS)] = True  # then at least one skipped step, the case under test
    for (ids, target), skip in zip(zipf_ids(rng, STEPS), skipped):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            if skip:
                version = emb.weight.grad._version
                optimizer.zero_grad(set_to_none=False)
                assert not imitated or optimizer is ref_opt or emb.weight.grad._version == version  # as on CUDA
            elif written and optimizer is opt:
                emb.weight.grad.mul_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    monkeypatch.undo()
    assert skipped.any()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("flow", ["zero_grad", "grad_scaler", "as_left", "negated"])
def test_a_loss_weighted_by_zero_then_a_step_with_no_forward_trains_as_in_memory(backend, rng, cache_rows, flow):
    """A loss weighted by 0 leaves its rows a gradient of exact zeros; then the step, with no forward between.

    In memory the sparse gradient names those rows at zero values: SparseAdam
    moves them by their momentum, as it is (``as_left``), unscaled by a
    ``GradScaler`` or negated for gradient ascent (written in place). After
    ``zero_grad(set_to_none=False)`` it names none, and the step moves none.
    Offloaded, a gradient zeroed in place could not be told from one unscaled
    when the backward left it zero: the zeroed step trained its rows as the
    unscaled one does. Then a negated one was taken for a zeroed one.
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows)
    sides = [(*side, torch.amp.GradScaler("cpu", init_scale=4.0))
             for side in both_sides(emb, opt, ref, ref_opt, device)]
    weighted = rng.random(STEPS) < 0.3
    weighted[:2] = False  # momentum first
    weighted[rng.integers(2, STEPS)] = True  # then at least one step on a loss weighted by 0
    for (ids, target), zero in zip(zipf_ids(rng, STEPS), weighted):
        for lookup, optimizer, to, scaler in sides:
            loss = ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum() * (0.0 if zero else 1.0)
            if flow == "grad_scaler":
                scaler.scale(loss).backward()
                scaler.step(optimizer)  # unscale_ writes the gradient in place: a zero stays a zero
                scaler.update()
            else:
                loss.backward()
                if zero and flow == "zero_grad":
                    optimizer.zero_grad(set_to_none=False)
                if flow == "negated":  # gradient ascent: -0.0 becomes +0.0, as zero_() writes
                    optimizer.param_groups[0]["params"][0].grad.neg_()
                optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    assert_trained_as_sparse_adam(emb, ref, ref_opt)
    assert int(opt.state[emb.weight]["step"]) == int(ref_opt.state[ref]["step"])


def _multiply_by_zero(optimizer, weight, edited):
    """A non-zero gradient multiplied by 0 in place (``grad.mul_(0.0)``: a gradient mask, a warm-up
    factor of 0). In memory SparseAdam's sparse gradient still names the rows, at zero values, and
    moves them by their momentum; only ``zero_()`` empties it. Offloaded, any gradient zeroed since a
    backward that left it non-zero counted as ``zero_grad()``: those rows were left alone."""
    if edited:
        weight.grad.mul_(0.0)


def _zero_grad_then_negate(optimizer, weight, edited):
    """``zero_grad(set_to_none=False)`` after a backward, then ``grad.neg_()`` (gradient ascent applied
    to every step, a skipped one too). In memory the zeroed sparse gradient names no row, negated or
    not, and SparseAdam moves none of the skipped forward's rows. Offloaded, the negation turned
    zero_()'s ``+0.0`` into ``-0.0``, which read as a gradient the backward had left at zero: Adam
    moved the skipped rows by their momentum."""
    if edited:
        optimizer.zero_grad(set_to_none=False)
    weight.grad.neg_()


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("then", ["step", "another_backward"])
@pytest.mark.parametrize("edit", [_multiply_by_zero, _zero_grad_then_negate], ids=["mul_0", "zero_grad_neg"])
def test_a_gradient_edited_in_place_after_a_backward_trains_as_in_memory(backend, rng, cache_rows, then, edit):
    """A backward, the gradient edited in place at some steps (``edit``'s docstring says how, what memory
    does, and what offloaded training did wrong), then the step, or another forward and backward first."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows)
    batches = zipf_ids(rng, 2 * STEPS)
    edited = rng.random(STEPS) < 0.3
    edited[:2], edited[rng.integers(2, STEPS)] = False, True  # momentum first, then one edited step at least
    for step, edit_now in enumerate(edited):
        (ids, target), (more_ids, more_target) = batches[2 * step], batches[2 * step + 1]
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            edit(optimizer, emb.weight if optimizer is opt else ref, edit_now)
            if then == "another_backward":
                ((lookup(more_ids.to(to)).cpu().sum(1) - more_target) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("zeroed", [False, True], ids=["scaled", "zeroed"])
def test_a_zero_gradient_written_in_place_then_accumulated_into_trains_as_in_memory(backend, rng, cache_rows, zeroed):
    """A loss weighted by 0, its gradient written in place (scaled by 2, or zeroed), then another
    forward and backward of the same step. In memory the scaled sparse gradient keeps the first
    forward's rows, at zero values, and SparseAdam steps them with the second's; zero_() drops them.
    Offloaded, any in-place write counted as zero_grad(): the first forward's rows were dropped."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows)
    batches = zipf_ids(rng, 2 * STEPS)
    for step in range(STEPS):
        (first, target), (second, target2) = batches[2 * step], batches[2 * step + 1]
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            weight = emb.weight if optimizer is opt else ref
            ((lookup(first.to(to)).cpu().sum(1) - target) ** 2).sum().mul(0.0 if step % 3 == 2 else 1.0).backward()
            if step % 3 == 2:
                weight.grad.zero_() if zeroed else weight.grad.mul_(2.0)
            ((lookup(second.to(to)).cpu().sum(1) - target2) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


#: (offloaded optimizer, its in-memory reference, whether the reference's gradient is sparse).
#: Adam adds eps to the bias-corrected root of exp_avg_sq, SparseAdam to the root itself: with
#: eps 1e-30, as in adam_against_sparse_adam, the two agree where exp_avg_sq is near zero too.
_LAZY_PAIRS = {"adam": (functools.partial(torch.optim.Adam, eps=1e-30),
                        functools.partial(torch.optim.SparseAdam, eps=1e-30), True),
               "sgd": (torch.optim.SGD, torch.optim.SGD, False),
               "adagrad": (torch.optim.Adagrad, torch.optim.Adagrad, True)}


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("flow", ["plain", "accumulated", "negated", "skipped_by_a_grad_scaler"])
@pytest.mark.parametrize("kind", list(_LAZY_PAIRS))
def test_a_loss_with_negative_zero_gradients_trains_as_in_memory(backend, rng, kind, flow, cache_rows):
    """A loss whose gradient holds ``-0.0`` elements of its own: a ReLU of negated rows gives
    ``-0.0`` wherever it is off, and at some steps it is off everywhere (SparseAdam still steps
    those rows by momentum). The step's zero-gradient check reads a ``-0.0`` in the table's
    gradient as one ``zero_()`` did not write. The lookup's backward sums them into ``+0.0``
    (as ``nn.Embedding``'s does); gradient ascent (``grad.neg_()`` after the backward) puts
    ``-0.0`` into the table's gradient itself. Plain steps, two forwards and backwards per step,
    gradient ascent, and a ``GradScaler`` skipping steps with ``zero_grad(set_to_none=False)``;
    Adam against SparseAdam, SGD against dense SGD, Adagrad against sparse Adagrad. Passed when
    written: no case is taken for ``zero_()``, nor the reverse."""
    make, make_ref, sparse = _LAZY_PAIRS[kind]
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=ROWS, storage="pageable", backend=backend,
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(emb.parameters(), lr=0.05)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt, device = make_ref([ref], lr=0.05), ss.get_backend(backend).device
    sides = [(emb, opt, emb.weight, device, torch.amp.GradScaler("cpu", init_scale=4.0)),
             (lambda i: F.embedding(i, ref, sparse=sparse), ref_opt, ref, "cpu",
              torch.amp.GradScaler("cpu", init_scale=4.0))]
    batches = zipf_ids(rng, 2 * STEPS)
    dead = rng.random(STEPS) < 0.3  # the ReLU off on every row of the step's first forward
    dead[:2], dead[rng.integers(2, STEPS)] = False, True  # momentum first, then one such step at least
    skipped = (rng.random(STEPS) < 0.3) & (flow == "skipped_by_a_grad_scaler")
    skipped[-1] = False  # the last step runs: a skipped one holds its rows until the next forward
    negative_zeros = {"lookup": 0, "table": 0}

    def count(where, grad):
        negative_zeros[where] += int((torch.signbit(grad) & (grad == 0)).sum())
    for step in range(STEPS):
        parts = batches[2 * step:2 * step + (2 if flow == "accumulated" else 1)]
        for lookup, optimizer, weight, to, scaler in sides:
            for part, (ids, target) in enumerate(parts):
                rows = lookup(ids.to(to))
                if optimizer is opt:
                    rows.register_hook(functools.partial(count, "lookup"))
                act = F.relu(-rows.cpu() - (1e3 if dead[step] and part == 0 else 0.0))
                loss = ((act.sum(1) - target) ** 2).sum() * (torch.inf if skipped[step] else 1.0)
                scaler.scale(loss).backward()
            if flow == "negated":
                weight.grad.neg_()
                if optimizer is opt and not dead[step]:  # _note_backward marks none of these
                    count("table", weight.grad[:len(emb.working_rows)])
            scaler.step(optimizer)  # skipped where the gradient is not finite
            scaler.update()
            optimizer.zero_grad(set_to_none=flow != "skipped_by_a_grad_scaler")
    assert negative_zeros["lookup"] > 0 and (negative_zeros["table"] > 0) == (flow == "negated")
    emb.flush()
    # The table's tolerance at the scale of its largest values too (assert_trained_as_sparse_adam says why).
    trained = ref.detach().numpy()
    np.testing.assert_allclose(emb.table.to_numpy(), trained, rtol=1e-5, atol=1e-5 * np.abs(trained).max())
    for name, table in emb._state.tables.items():
        state = ref_opt.state[ref][name].numpy()
        np.testing.assert_allclose(table.to_numpy(), state, rtol=1e-5, atol=1e-5 * np.abs(state).max(), err_msg=name)
    assert not np.allclose(trained, table0)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_second_order_backward_through_a_zero_gradient_trains_as_in_memory(backend, rng, cache_rows):
    """``backward(create_graph=True)`` of a loss at its minimum (the gradient is zero, its derivative
    is not), then a backward through ``weight.grad`` (a gradient penalty), then an SGD step. The
    zero-gradient mark must stay out of the graph: recorded, it made the penalty's derivative for
    the gradient's first element zero, and the row in slot 0 missed its update."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH * WIDTH, storage="pageable", backend=backend,
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt, device = torch.optim.SGD([ref], lr=0.1), ss.get_backend(backend).device
    for ids, _ in zipf_ids(rng, 6):
        curvature = torch.from_numpy(rng.uniform(0.5, 2.0, (BATCH, WIDTH, DIM)).astype(np.float32))
        for lookup, optimizer, weight, to in ((emb, opt, emb.weight, device),
                                              (lambda i: F.embedding(i, ref), ref_opt, ref, "cpu")):
            rows = lookup(ids.to(to)).cpu()
            (curvature * (rows - rows.detach()) ** 2).sum().backward(create_graph=True)
            weight.grad.sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # create_graph's gradient holds its graph
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)


_DDP_SCRIPT = r"""
import os, sys
import numpy as np, torch, torch.distributed as dist
import speedswap as ss

dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
DDP = torch.nn.parallel.DistributedDataParallel


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ss.OffloadedEmbedding(50, 4, max_rows=40, storage="pageable", backend="numpy")
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.emb(ids).sum(1))


ids = torch.from_numpy(np.random.default_rng(int(sys.argv[1])).integers(0, 50, (6, 3)))
model = Model()
wrapped = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model.emb.attach(opt)
try:
    wrapped(ids)
except ss.OptionError as exc:
    assert "ShardedOffloadedEmbedding" in str(exc) and "_set_params_and_buffers_to_ignore_for_model" in str(exc)
    assert not len(model.emb.working_rows)  # refused before any row joined the step
else:
    raise SystemExit("DDP over an OffloadedEmbedding's weight was not refused")

ignored = Model()  # the advice: a table per rank, outside DDP's average
DDP._set_params_and_buffers_to_ignore_for_model(ignored, ["emb.weight"])
wrapped = DDP(ignored)
opt = torch.optim.SGD(ignored.parameters(), lr=0.1)
ignored.emb.attach(opt)
start = ignored.emb.table.to_numpy(copy=True)
wrapped(ids).pow(2).sum().backward()
opt.step()
assert not np.array_equal(ignored.emb.table.to_numpy(), start)  # it trained
frozen = Model()  # DDP averages no frozen parameter: a fixed table under a trained head
frozen.emb.weight.requires_grad_(False)
wrapped = DDP(frozen)
opt = torch.optim.SGD(frozen.parameters(), lr=0.1)
frozen.emb.attach(opt)
wrapped(ids).pow(2).sum().backward()
opt.step()
print("ok")
# Every result is written: end without the interpreter's teardown, where gloo's threads can
# abort the process ("terminate called without an active exception"; see
# examples/_distributed.finish).
sys.stdout.flush()
os._exit(0)
"""


def test_an_offloaded_embedding_averaged_by_ddp_is_refused(seed, tmp_path):
    """Each rank's working set holds other rows: DDP's average would train rows on other rows' gradients."""
    done = subprocess.run([sys.executable, "-c", _DDP_SCRIPT, str(seed), rendezvous_url(tmp_path)],
                          capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr[-3000:]


def test_a_second_backward_through_a_kept_graph_after_zero_grad_trains_on_its_gradient(backend, rng):
    """backward(retain_graph=True), zero_grad(), backward(), step: the rows train on the second
    backward's gradient, as in memory (a probe of the gradient, then the real backward)."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH)
    for ids, target in zipf_ids(rng, STEPS):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            loss = ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum()
            loss.backward(retain_graph=True)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("restore", ["sub_data", "assign_data"])
def test_sam_perturbing_through_weight_data_equals_in_memory(backend, rng, restore):
    """SAM: backward, perturb by rho * grad, zero_grad, forward and backward at the perturbed rows,
    restore, step. Through ``p.data.add_`` (no version bump: the step was taken for skipped and
    its rows read again, unperturbed) and ``p.data = old_p`` (davda54/sam: the optimizer then
    trained a copy the table never saw)."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH * WIDTH, storage="pageable", backend=backend)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    # lr 0.01: each step moves rows by up to 0.3-4, and the run stays bounded. At 0.1 it diverged
    # (values of 1e24), where the order a GPU sums a row's gradients in showed as 2e-4 relative.
    opt = torch.optim.SGD(emb.parameters(), lr=0.01)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SGD([ref], lr=0.01)
    device = ss.get_backend(backend).device
    for ids, target in zipf_ids(rng, STEPS):
        for lookup, optimizer, param, to in ((emb, opt, emb.weight, device),
                                             (lambda i: F.embedding(i, ref), ref_opt, ref, "cpu")):
            def loss():
                return ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum()
            loss().backward()
            perturbation = 0.05 * param.grad
            saved = param.data.clone()
            param.data.add_(perturbation)
            optimizer.zero_grad()
            loss().backward()
            if restore == "sub_data":
                param.data.sub_(perturbation)
            else:
                param.data = saved
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def _differs(a, b):
    return not np.allclose(a, b)


def _sam_over_other_ids_in_its_second_pass(rng, backend):
    """An SGD embedding and its in-memory reference, and the loop's batches: pass 1 over ``ids``, pass 2 over
    the next batch's ids, whose rows (mostly) join the step after its first backward."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=2 * BATCH * WIDTH, storage="pageable", backend=backend)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.01)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SGD([ref], lr=0.01)
    batches = zipf_ids(rng, STEPS + 1)
    return emb, opt, ref, ref_opt, list(zip(batches, batches[1:]))


@pytest.mark.parametrize("undo", ["sub_data", "assign_a_copy_after_the_second_pass", "assign_undone_values"])
def test_sam_with_a_second_pass_over_other_ids_undoing_its_move_equals_in_memory(backend, rng, undo):
    """SAM whose second pass looks up other rows, the move undone in place, or in place and then a copy
    assigned after that pass (a tensor holding the new rows as they are): trains as in memory. Undone by
    assigning ``p.data - e``, whose values are the table's to rounding only, as a stale copy's are not
    the rows' at all: refused at the step, nothing changed, and training goes on after ``discard_step()``."""
    emb, opt, ref, ref_opt, pairs = _sam_over_other_ids_in_its_second_pass(rng, backend)
    device, table0 = ss.get_backend(backend).device, emb.table.to_numpy(copy=True)
    for (ids, target), (ids2, target2) in pairs:
        for lookup, optimizer, param, to in ((emb, opt, emb.weight, device),
                                             (lambda i: F.embedding(i, ref), ref_opt, ref, "cpu")):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            move = 0.05 * param.grad
            param.data.add_(move)
            optimizer.zero_grad()
            ((lookup(ids2.to(to)).cpu().sum(1) - target2) ** 2).sum().backward()
            if undo == "assign_undone_values":
                held = param.detach().clone()
                param.data = param.data - move
                if optimizer is opt:
                    table = emb.table.to_numpy(copy=True)
                    with pytest.raises(ss.StateError, match="cannot be told from rows moved on purpose"):
                        optimizer.step()
                    assert torch.equal(emb.weight.detach(), held)
                    np.testing.assert_array_equal(emb.table.to_numpy(copy=True), table)
                    emb.discard_step()
                optimizer.zero_grad()  # the reference skips the step too
                continue
            param.data.sub_(move)
            if undo == "assign_a_copy_after_the_second_pass":
                param.data = param.data.clone()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert (np.array_equal if undo == "assign_undone_values" else _differs)(emb.table.to_numpy(), table0)


def test_sam_assigning_a_copy_older_than_its_second_pass_rows_is_refused_then_trains_on(backend, rng):
    """``old_p = p.data.clone()`` after the first backward, a second pass over other ids, ``p.data = old_p``:
    the copy's slots of the rows that joined since held other rows, which the step trained from (3.9 max
    difference to in-memory SGD, silently). Refused at the step, nothing changed; after ``discard_step()``
    (the reference skips the step too) training goes on as in memory."""
    emb, opt, ref, ref_opt, pairs = _sam_over_other_ids_in_its_second_pass(rng, backend)
    device = ss.get_backend(backend).device
    for step, ((ids, target), (ids2, target2)) in enumerate(pairs):
        refused = step % 3 == 1
        for lookup, optimizer, param, to in ((emb, opt, emb.weight, device),
                                             (lambda i: F.embedding(i, ref), ref_opt, ref, "cpu")):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            move = 0.05 * param.grad
            old = param.data.clone()
            param.data.add_(move)
            optimizer.zero_grad()
            ((lookup(ids2.to(to)).cpu().sum(1) - target2) ** 2).sum().backward()
            if not refused:
                param.data.sub_(move)
                optimizer.step()
            elif optimizer is opt:
                table, held, own = emb.table.to_numpy(copy=True), emb.weight.detach().clone(), emb.weight.data_ptr()
                param.data = old
                with pytest.raises(ss.StateError, match="joined the step after its first backward"):
                    optimizer.step()
                assert emb.weight.data_ptr() == own and torch.equal(emb.weight.detach(), held)
                np.testing.assert_array_equal(emb.table.to_numpy(copy=True), table)
                emb.discard_step()
            else:
                param.data = old  # in memory the copy is the whole table: the step skipped restores it
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_write_through_a_kept_view_after_a_dropped_step_is_refused_then_kept(backend, rng):
    """A step skipped by zero_grad() after its backward, then a write through a kept
    ``to_numpy()`` view: the next forward found the step's rows unlike the table's, took them
    for rows SAM changed in place, and the step wrote them back over the write (row 3 ended at
    its old trained value, not 7). Both cannot be told apart: it is refused, and after
    ``discard_step()`` the write stays and training goes on as in memory."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH)
    batches = zipf_ids(rng, STEPS)
    view = emb.table.to_numpy()
    for step, (ids, target) in enumerate(batches):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            loss = ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum()
            loss.backward()
            if step != STEPS // 2:
                optimizer.step()
            optimizer.zero_grad()  # the middle step is skipped: its gradient dropped
        if step == STEPS // 2:
            row = int(ids.flatten()[0])  # one of the dropped step's rows
            with torch.no_grad():
                ref[row] = 7.0
            view[row] = 7.0
            with pytest.raises(ss.StateError, match="discard_step"):
                emb(ids.to(device))
            np.testing.assert_array_equal(view[row], 7.0)
            emb.discard_step()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


def _sam_step(model, optimizer, ids, second_ids, target, set_to_none, between=lambda: None):
    """One SAM step through ``p.data``: backward, every parameter with a gradient moved by 0.05 * its
    gradient, ``zero_grad()``, ``between()``, forward and backward of ``second_ids``, the move undone, step.

    A sharded embedding's gradient reaches ``weight`` at :meth:`exchange_gradients`, called first as for
    anything that reads it. The in-memory reference's step names the rows of the second pass only, as
    a sparse gradient dropped by ``zero_grad()`` would (rows only the first pass read are not stepped)."""
    F.mse_loss(model(ids), target).backward()
    if isinstance(model.emb, ss.ShardedOffloadedEmbedding):
        model.emb.exchange_gradients()
    moves = [(p, 0.05 * p.grad) for p in model.parameters() if p.grad is not None]
    for p, move in moves:
        p.data.add_(move)
    optimizer.zero_grad(set_to_none=set_to_none)
    between()
    if isinstance(model.emb, LazyTable):
        model.emb.looked_up.clear()
    F.mse_loss(model(second_ids), target).backward()
    for p, move in moves:
        p.data.sub_(move)
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("second", ["same_ids", "other_ids"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["zero_grad", "zero_grad_keeping_tensors"])
@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.05)],
                         ids=["sgd", "adam"])
def test_sharded_sam_perturbing_through_weight_data_equals_in_memory(rng, make_opt, set_to_none, second):
    """SAM through ``p.data`` on a ShardedOffloadedEmbedding (one rank): the forward after ``zero_grad()``
    took the step for skipped and gathered its rows again from the table, unperturbed, silently (0.01 to
    0.11 max difference here; 3.8 to in-memory SGD on a summed squared error). Now the owned rows changed
    through ``weight.data`` stay in the step: the second pass reads them perturbed, and the step trains the
    restored rows on its gradient, as in memory; rows only the first pass looked up (``other_ids``) are put
    back, not stepped."""
    offloaded, reference = pair(rng, sharded=True)
    opt, ref_opt = (make_opt(m.parameters()) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, STEPS + 1)
    for (ids, target), (next_ids, _) in zip(batches, batches[1:]):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            _sam_step(model, optimizer, ids, next_ids if second == "other_ids" else ids, target, set_to_none)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("call", ["table_scatter", "save", "load_state_dict"])
def test_a_sharded_table_call_between_sams_passes_is_refused_and_sam_trains_on(rng, tmp_path, call):
    """A table write, ``save`` or ``load_state_dict`` between SAM's ``zero_grad()`` and its second pass
    dropped the step, and with it the rows moved through ``weight.data``: the second pass read them from the
    table, unmoved, silently (0.05 to 0.22 max difference to in-memory SGD over 6 steps). The step is kept,
    as the second pass's forward keeps it, and the call refused as any call in the middle of a step, nothing
    changed; SAM trains on as in memory."""
    offloaded, opt, reference, ref_opt, table_call = _adam_pair_and_table_call(rng, tmp_path, call, sharded=True)

    def refused():
        table = offloaded.emb.table.to_numpy(copy=True)
        with pytest.raises(ss.StateError, match=r"between a training forward and optimizer\.step\(\)"):
            table_call()
        np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)

    for ids, target in zipf_ids(rng, STEPS):
        _sam_step(offloaded, opt, ids, ids, target, True, between=refused)
        _sam_step(reference, ref_opt, ids, ids, target, True)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "offloaded"])
@pytest.mark.parametrize("call", ["table_scatter", "save", "load_state_dict"])
def test_a_table_call_after_a_step_whose_optimizer_raised_and_zero_grad_goes_through(rng, tmp_path, call, sharded):
    """A step whose optimizer raised, given up with ``zero_grad()``: the optimizer's writes into ``weight``
    are not the user's. Sharded: keeping SAM's step at these calls (above) first refused a ``save`` and a
    ``load_state_dict`` here, taking those writes for a move of ``weight`` in place; the step is undone
    first, as a forward does, and the call goes through. The next forward refused those writes as the
    user's between steps, once (with or without the call), as it no longer does. ``state_dict()`` held the
    failed step's count in Adam's scalar state, which the load restored (0.004 max difference to in memory
    here); it undoes the step first too. ``OffloadedEmbedding``: the next forward took those writes for
    SAM's move in place, kept the step, and refused its new rows as looked up after a write in place, until
    ``discard_step()``; ``emb.table`` refused the narrowed ``weight.data`` the failed step left as assigned
    by the user; ``state_dict()`` held the failed step's count too. Training goes on as in memory, the step
    skipped."""
    offloaded, opt, reference, ref_opt, table_call = _adam_pair_and_table_call(rng, tmp_path, call, sharded)
    for step, (ids, target) in enumerate(zipf_ids(rng, 6)):
        if step != 3:
            for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
                train_step(model, optimizer, ids, target)
            continue
        F.mse_loss(offloaded(ids), target).backward()
        step_failing_once(opt, list(offloaded.lin.parameters()))
        opt.zero_grad()
        table_call()
        if call == "table_scatter":
            with torch.no_grad():
                reference.emb.weight[0] = 0.0
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def _adam_pair_and_table_call(rng, tmp_path, call, sharded):
    """(offloaded, opt, reference, ref_opt, table_call): :func:`pair`'s model (``sharded`` or not) and its lazy
    reference, with Adam, and ``call`` of the embedding's: ``table_scatter`` (zeros into row 0), ``save`` or
    ``load_state_dict`` (of its own state dict)."""
    offloaded, reference = pair(rng, sharded=sharded)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    table_call = {"table_scatter": lambda: offloaded.emb.table.scatter([0], torch.zeros(1, DIM)),
                  "save": lambda: offloaded.emb.save(tmp_path / "checkpoint"),
                  "load_state_dict": lambda: offloaded.load_state_dict(offloaded.state_dict())}[call]
    return offloaded, opt, reference, ref_opt, table_call


def test_a_sharded_step_skipped_by_zero_grad_for_a_nan_row_is_dropped_not_kept_as_sam(rng):
    """A row that diverged to NaN makes the loss NaN; the loop skips that step with ``zero_grad()``. The next
    forward compares the skipped step's owned rows with the table's to tell a dropped step from rows SAM
    moved through ``weight.data``: NaN must count as equal to NaN, or the skipped step's rows would be kept
    in the next step (counted in its owned rows, taking its capacity). The next steps own their own rows
    only, and train as in memory."""
    offloaded, reference = pair(rng, sharded=True)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    emb = offloaded.emb
    emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    bad = int(rng.integers(ROWS))
    emb.table.scatter([bad], torch.full((1, DIM), float("nan")))
    with torch.no_grad():
        reference.emb.weight[bad] = float("nan")
    skipped = torch.from_numpy(rng.choice(ROWS, size=(BATCH, WIDTH)))
    skipped[0, 0] = bad
    for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
        loss = F.mse_loss(model(skipped), torch.zeros(BATCH, 1))
        assert not torch.isfinite(loss)
        loss.backward()
        optimizer.zero_grad()  # the step is skipped
    reference.emb.looked_up.clear()
    others = torch.from_numpy(np.setdiff1d(np.arange(ROWS), [bad]))
    for ids, target in zipf_ids(rng, 4):
        ids = others[ids % len(others)]
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
        assert emb.stats()["last_step"]["owned_rows"] == len(torch.unique(ids))
    np.testing.assert_array_equal(emb.table.to_numpy()[bad], np.nan)
    table, ref_table = emb.table.to_numpy().copy(), reference.emb.weight.detach().numpy().copy()
    table[bad] = ref_table[bad] = 0.0  # NaN never equals itself: compared apart above
    np.testing.assert_allclose(table, ref_table, rtol=1e-6, atol=1e-6)


def _eval_rows(model, ids):
    model.eval()
    with torch.no_grad():
        rows = model.emb(ids)
    model.train()
    return rows


@pytest.mark.parametrize("undo", ["sub_data", "assign_old_p"])
@pytest.mark.parametrize("sharded, cache_rows", [(False, 0), (False, 40), (True, 0)],
                         ids=["offloaded", "offloaded_cache", "sharded"])
def test_eval_forwards_between_sams_passes_read_the_moved_rows_as_in_memory(rng, sharded, cache_rows, undo):
    """SAM moves the step's rows in place, zero_grad(), a second pass, then undoes the move (in place, or
    ``p.data = old_p`` as davda54/sam) before the step; an eval forward between (a probe of the model at the
    perturbed point) read the rows from the table, unmoved, where ``nn.Embedding`` reads its weight (0.26 max
    difference offloaded, 0.09 with a cache, 0.05 sharded, silently). Now it reads the step's rows as weight
    holds them, and the rows of other ids from the table (or cache): equal to the in-memory model's at each
    point, over Zipf ids and many steps, and training is unchanged. A sharded embedding refuses the assigned
    tensor at the step; an eval forward before it is refused too, then the move is undone in place."""
    offloaded, reference = pair(rng, cache_rows=cache_rows, sharded=sharded)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    moved_apart = 0.0
    for (ids, target), (other, _) in zip(zipf_ids(rng, STEPS), zipf_ids(rng, STEPS)):
        probe = torch.cat([ids.flatten(), other.flatten()])  # the step's rows and others
        read = {}
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            F.mse_loss(model(ids), target).backward()
            if model is offloaded and sharded:
                model.emb.exchange_gradients()
            moves = [(p, p.data.clone(), 0.05 * p.grad) for p in model.parameters()]
            for p, _, move in moves:
                p.data.add_(move)
            optimizer.zero_grad()
            perturbed = _eval_rows(model, probe)
            F.mse_loss(model(ids), target).backward()
            read[model] = [perturbed, _eval_rows(model, probe)]
            if undo == "sub_data":
                for p, _, move in moves:
                    p.data.sub_(move)
            else:
                for p, saved, _ in moves:
                    p.data = saved
            if model is offloaded and sharded and undo == "assign_old_p":
                with pytest.raises(ss.StateError, match="eval forward between assigning emb.weight.data"):
                    _eval_rows(model, probe)
                with pytest.raises(ss.StateError, match=r"weight.data was assigned"):
                    optimizer.step()
                model.emb.weight.data.sub_(moves[0][2])
            read[model].append(_eval_rows(model, probe))
            optimizer.step()
            optimizer.zero_grad()
        for mine, theirs in zip(read[offloaded], read[reference]):
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-6)
        moved_apart = max(moved_apart, (read[reference][0] - read[reference][2]).abs().max().item())
    assert moved_apart > 1e-3  # the probes saw moved rows
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_eval_forwards_between_sam_passes_over_other_ids_read_as_in_memory(backend, rng):
    """The eval reads of the test above on every backend (the step's rows found on the device, taken from
    weight): SAM whose second pass brings in other rows, probed by eval forwards after the move, after the
    second pass (whose rows joined unmoved) and after the undo, against the in-memory table's rows."""
    emb, opt, ref, ref_opt, pairs = _sam_over_other_ids_in_its_second_pass(rng, backend)
    device = ss.get_backend(backend).device
    for (ids, target), (ids2, target2) in pairs:
        probe = torch.cat([ids.flatten(), ids2.flatten(), torch.from_numpy(rng.integers(0, ROWS, 20))])
        read = []
        for lookup, optimizer, param, to in ((emb, opt, emb.weight, device),
                                             (lambda i: F.embedding(i, ref), ref_opt, ref, "cpu")):
            def probed():
                if lookup is emb:
                    emb.eval()
                with torch.no_grad():
                    rows = lookup(probe.to(to)).cpu()
                emb.train()
                return rows
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            move = 0.05 * param.grad
            param.data.add_(move)
            optimizer.zero_grad()
            rows = [probed()]
            ((lookup(ids2.to(to)).cpu().sum(1) - target2) ** 2).sum().backward()
            rows.append(probed())
            param.data.sub_(move)
            rows.append(probed())
            optimizer.step()
            optimizer.zero_grad()
            read.append(rows)
        for mine, theirs in zip(*read):
            np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:a view of the table:RuntimeWarning")  # a kept view turns the cache off: meant
@pytest.mark.parametrize("sharded, cache_rows", [(False, 0), (False, 40), (True, 0)],
                         ids=["offloaded", "offloaded_cache", "sharded"])
def test_an_eval_forward_after_a_write_through_a_view_into_a_dropped_steps_rows_reads_it_or_is_refused(
        rng, sharded, cache_rows):
    """A step skipped by ``zero_grad()`` after its backward, a write through a kept ``to_numpy()`` view into
    one of its rows, an eval forward: it read the row from weight, as before the write (8.7 max difference
    to in-memory, silently), where the training forward after it refuses the write (see
    ``test_a_write_through_a_kept_view_after_a_dropped_step_is_refused_then_kept``). Refused too, nothing
    changed; after ``discard_step()`` it reads the write. An eval forward before the write drops the
    step, as the table's reads do: the write then reads as in memory. Training goes on as in memory."""
    offloaded, reference = pair(rng, cache_rows=cache_rows, sharded=sharded)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (offloaded, reference))
    emb = offloaded.emb
    emb.attach(opt)
    view = emb.table.to_numpy()
    for step, (ids, target) in enumerate(zipf_ids(rng, 12)):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            F.mse_loss(model(ids), target).backward()
            if model is offloaded and sharded:
                emb.exchange_gradients()
            if step % 4 != 2:
                optimizer.step()
            optimizer.zero_grad()
        if step % 4 != 2:
            continue
        row, value = int(ids.flatten()[step % WIDTH]), float(step)
        if step % 8 == 6:  # an eval forward first drops the skipped step
            np.testing.assert_array_equal(_eval_rows(offloaded, ids).numpy(), _eval_rows(reference, ids).numpy())
        view[row] = value
        with torch.no_grad():
            reference.emb.weight[row] = value
        if step % 8 == 2:
            table = view.copy()  # emb.table refuses the write as well
            with pytest.raises(ss.StateError, match="a view the table handed out"):
                _eval_rows(offloaded, ids)
            np.testing.assert_array_equal(view, table)
            emb.discard_step()
        np.testing.assert_array_equal(_eval_rows(offloaded, ids).numpy(), _eval_rows(reference, ids).numpy())
    del view
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_sharded_sam_undoing_its_move_by_assigning_weight_data_is_refused_at_the_step_then_trains_on(rng):
    """SAM undoing its move with ``p.data = saved`` (davda54/sam) on a sharded embedding: the step trained
    the assigned tensor and wrote back the owned rows of weight's own storage, moved and unstepped (2.4 max
    difference to in-memory SGD after one step), silently. Refused at the step (in its first message: on
    every rank), the table unchanged, with weight given its own storage back: the move undone in it, the
    step trains as in memory."""
    offloaded, reference = pair(rng, sharded=True)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (offloaded, reference))
    emb = offloaded.emb
    emb.attach(opt)
    for ids, target in zipf_ids(rng, STEPS):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            F.mse_loss(model(ids), target).backward()
            if model is offloaded:
                emb.exchange_gradients()
            moves = [(p, p.data.clone(), 0.05 * p.grad) for p in model.parameters()]
            for p, _, move in moves:
                p.data.add_(move)
            optimizer.zero_grad()
            F.mse_loss(model(ids), target).backward()
            for p, saved, _ in moves:
                p.data = saved
            if model is offloaded:
                table = emb.table.to_numpy(copy=True)
                with pytest.raises(ss.StateError, match=r"weight.data was assigned.*sub_"):
                    optimizer.step()
                np.testing.assert_array_equal(emb.table.to_numpy(), table)
                assert emb.weight.data.data_ptr() == emb._full.data_ptr()
                emb.weight.data.sub_(moves[0][2])
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("how", ["view_alive", "in_place", "assigned"])
def test_sharded_sam_that_cannot_be_kept_is_refused_then_trains_on(rng, how):
    """SAM on a sharded embedding where its moved rows cannot be kept in the step. ``view_alive``: through
    ``p.data`` while a ``to_numpy()`` view of the table is alive: the moved rows cannot be told from rows a
    write through the view changed, and keeping them would write the step's rows back over such a write.
    ``in_place``: through ``p.add_`` under ``no_grad()``, which may have reached rows the step does not
    hold (``weight.mul_(0.5)``): it was refused as a write between steps, saying to write the table.
    ``assigned``: through ``p.data = p.data + e``, whose tensor the step's rows are not in: the step was
    dropped, the assignment refused as an initialiser's (write the table), once, and the forward run again
    trained on without the move. The forward is refused (in its first message: on every rank), saying what
    to do, with nothing changed; after ``discard_step()`` training goes on, the skipped step dropped, as in
    memory."""
    offloaded, reference = pair(rng, sharded=True)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    emb = offloaded.emb
    emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    view = emb.table.to_numpy() if how == "view_alive" else None
    for step, (ids, target) in enumerate(zipf_ids(rng, 6)):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            if step != 3:
                train_step(model, optimizer, ids, target)
                continue
            F.mse_loss(model(ids), target).backward()
            if model is offloaded:
                emb.exchange_gradients()
                if how == "view_alive":
                    emb.weight.data.add_(0.05 * emb.weight.grad)
                elif how == "assigned":
                    emb.weight.data = emb.weight.data + 0.05 * emb.weight.grad
                else:
                    with torch.no_grad():
                        emb.weight.add_(0.05 * emb.weight.grad)
            optimizer.zero_grad()
            if model is offloaded:
                table, owned, state = emb.table.to_numpy(copy=True), emb._owned.rows.clone(), emb.stats()
                advice = "view.*discard_step" if how == "view_alive" else r"weight\.data\.add_.*discard_step"
                for _ in range(2):  # refused until discard_step()
                    with pytest.raises(ss.StateError, match=advice):
                        offloaded(ids)
                np.testing.assert_array_equal(emb.table.to_numpy(), table)
                assert torch.equal(emb._owned.rows, owned) and emb.stats() == state
                emb.discard_step()
            else:
                model.emb.looked_up.clear()  # the step is skipped
    del view
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_weight_data_replaced_by_an_unlike_tensor_is_refused(rng):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=8, storage="pageable", backend="numpy")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    before = emb.table.to_numpy(copy=True)
    emb(torch.tensor([1, 2])).sum().backward()
    emb.weight.data = torch.zeros(3, DIM)
    with pytest.raises(ss.StateError, match="weight.data was replaced"):
        opt.step()
    np.testing.assert_array_equal(emb.table.to_numpy(), before)


@pytest.mark.parametrize("move", ["in_place", "assigned"])
def test_sam_reading_the_table_between_its_passes_keeps_the_move_or_refuses_an_assigned_one(rng, move):
    """``emb.table`` with a cache between SAM's passes (the rows moved, ``zero_grad()``): the read
    sees the rows before the step, and SAM trains as in memory. Rows moved through ``p.data =
    p.data + e`` are refused there, nothing changed: an assigned tensor cannot be told from a copy
    taken before the step's forwards (the loop of ``_rolled_back_mid_step``), which holds other
    rows; after ``discard_step()`` (the reference skips the step too) training goes on."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=16, storage="pageable", backend="numpy", cache_rows=6)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    ids = torch.from_numpy(rng.choice(ROWS, size=3, replace=False))
    for lookup, optimizer, param in ((emb, opt, emb.weight), (lambda i: F.embedding(i, ref), ref_opt, ref)):
        (lookup(ids) ** 3).sum().backward()
        saved, unmoved = param.data.clone(), param.detach().clone()
        if move == "in_place":
            param.data.add_(0.5 * param.grad)
        else:
            param.data = param.data + 0.5 * param.grad
        optimizer.zero_grad()
        if optimizer is opt and move == "assigned":
            with pytest.raises(ss.StateError, match="cannot be told from rows moved on purpose"):
                emb.table.to_numpy(copy=True)
            assert torch.equal(emb.weight.detach(), unmoved)
            emb.discard_step()
            np.testing.assert_array_equal(emb.table.to_numpy(copy=True), table0)
        elif optimizer is opt:
            np.testing.assert_array_equal(emb.table.to_numpy(copy=True), table0)
        if move == "assigned":
            param.data = saved  # the reference skips the step as well
            continue
        (lookup(ids) ** 3).sum().backward()
        param.data = saved
        optimizer.step()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)
    if move == "in_place":
        assert not np.allclose(table0[ids.numpy()], ref.detach().numpy()[ids.numpy()])


@pytest.mark.parametrize("then", ["zero_grad", "step", "discard_step"])
def test_rolling_back_to_a_copy_taken_before_the_steps_forwards_is_refused_then_trains_on(rng, then):
    """``saved = p.data.clone()`` at the top of the loop, forward, backward, then ``p.data = saved`` (to undo
    what a hook wrote, or a loss spike) and ``zero_grad()`` to skip the step, or ``optimizer.step()`` to
    take it from the saved values: in memory the copy is the table as before the step. It held other rows'
    values (the last step's slots): the next forward took them for rows SAM moved and trained them (4.47
    max difference to in-memory SGD, silently), and a step took them for the rows (3.55 over four steps
    rolled back, silently). Refused at that forward or step, nothing changed; after ``discard_step()``
    training goes on as in memory (the reference skips those steps too). ``discard_step()`` right after
    the assignment skips the step: the next forward took the copy back as a write into weight between
    steps and refused it, once, saying to write the table; now the copy goes with the step."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=2 * BATCH * WIDTH, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.01)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SGD([ref], lr=0.01)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        table = emb.table.to_numpy(copy=True)
        for lookup, optimizer, param in ((emb, opt, emb.weight), (lambda i: F.embedding(i, ref), ref_opt, ref)):
            saved = param.data.clone()
            ((lookup(ids).sum(1) - target) ** 2).sum().backward()
            if step % 4 == 3:
                held = param.detach().clone()
                param.data = saved
                if then == "zero_grad":
                    optimizer.zero_grad()
                if optimizer is opt and then == "discard_step":
                    emb.discard_step()
                    assert emb.weight.data_ptr() == emb._full.data_ptr()  # the copy went with the step
                    np.testing.assert_array_equal(emb.table.to_numpy(copy=True), table)
                elif optimizer is opt:
                    with pytest.raises(ss.StateError, match="a snapshot to roll back to"):
                        emb(ids) if then == "zero_grad" else optimizer.step()
                    assert torch.equal(emb.weight.detach(), held)
                    emb.discard_step()
                    np.testing.assert_array_equal(emb.table.to_numpy(copy=True), table)
                optimizer.zero_grad()
                continue
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("probe", ["autograd_grad_of_the_output", "backward_into_another_input"])
@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_forward_whose_table_gradient_no_backward_computed_leaves_its_rows_alone(backend, rng,
                                                                                   probe, cache_rows):
    """A probe forward per step whose backward stops short of the table (the gradient of its output,
    for an input perturbation; a backward into another leaf only), then the real forward and backward.

    In memory the probe's rows get no gradient, so SparseAdam leaves them alone; Adam must not move
    them by their momentum either.
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows)
    scale = torch.nn.Parameter(torch.tensor(1.5))
    batches = zipf_ids(rng, 2 * STEPS)
    for (probe_ids, probe_target), (ids, target) in zip(batches[::2], batches[1::2]):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            out = lookup(probe_ids.to(to))
            probe_loss = ((scale * out.cpu().sum(1) - probe_target) ** 2).sum()
            if probe == "autograd_grad_of_the_output":
                (grad_of_out,) = torch.autograd.grad(probe_loss, out)
                assert grad_of_out.abs().sum() > 0
            else:
                probe_loss.backward(inputs=[scale])
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


def test_a_gradient_taken_with_autograd_grad_and_assigned_by_hand_trains(backend, rng):
    """Gradient surgery (PCGrad): ``g = torch.autograd.grad(loss, [weight])``, changed, then
    ``weight.grad = g``: no gradient accumulates into the table, and its rows must train all the same."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH)
    for ids, target in zipf_ids(rng, STEPS):
        for lookup, weight, optimizer, to in (
                (emb, emb.weight, opt, device),
                (lambda i: F.embedding(i, ref, sparse=True), ref, ref_opt, "cpu")):
            loss = ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum()
            (grad,) = torch.autograd.grad(loss, [weight])
            weight.grad = 0.5 * grad
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_step_on_the_gradient_the_last_step_left_is_refused(backend, rng, cache_rows):
    """No zero_grad() after optimizer.step(): the next backward adds the last step's gradient, whose
    slots now hold other rows, to this step's. The step is refused before anything changes; after
    discard_step() and zero_grad() (either kind) training goes on equal to SparseAdam."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            def backward():
                ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            backward()
            if step and optimizer is opt:  # the reference zeroes after each step
                table = None if cache_rows else emb.table.to_numpy(copy=True)  # (a cache: mid-step)
                with pytest.raises(ss.StateError, match="no zero_grad"):
                    optimizer.step()
                if table is not None:
                    np.testing.assert_array_equal(emb.table.to_numpy(), table)
                emb.discard_step()
                optimizer.zero_grad(set_to_none=bool(step % 2))
                backward()
            optimizer.step()
            if optimizer is ref_opt:
                optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_gradient_zeroed_without_a_version_bump_is_not_refused(backend, rng, cache_rows):
    """``zero_grad(set_to_none=False)`` of an optimizer built with ``foreach=True`` zeroes the
    gradients with ``torch._foreach_zero_``, whose CUDA kernel leaves their version counters as
    they were: the gradient the last step left looks untouched, yet holds zeros. Zeroing through
    ``.data`` (a tensor with a version counter of its own) does the same on any device. Such a
    step is not refused, and training equals SparseAdam's."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows)
    for ids, target in zipf_ids(rng, STEPS):
        for lookup, weight, optimizer, to in (
                (emb, emb.weight, opt, device),
                (lambda i: F.embedding(i, ref, sparse=True), ref, ref_opt, "cpu")):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            optimizer.step()
            if weight is ref:
                optimizer.zero_grad()
            else:
                version = weight.grad._version
                weight.grad.data.zero_()
                assert weight.grad._version == version  # as _foreach_zero_ leaves it on CUDA
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("option", ["foreach", "fused"])
def test_a_foreach_or_fused_step_on_the_cpu_reads_no_values_of_a_gradient_its_version_vouches_for(rng, option,
                                                                                                  monkeypatch):
    """On the CPU ``zero_grad()`` of an optimizer built with ``foreach=True`` or ``fused=True``
    bumps the gradient's version (``torch._foreach_zero_`` runs ``zero_()`` on each tensor), so the
    version tells whether the gradient was zeroed since the backward, as for any optimizer. Its
    steps read the values anyway, as on CUDA, whose kernel leaves the version: the zero-gradient
    check (``reads_as_zeroed``, counted here) over the step's gradient and a copy of the step's rows and state, put back through ``torch.where``,
    every step. Only a step whose gradient was written since reads them now; training is as before."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, "numpy", BATCH * WIDTH, **{option: True})
    written = rng.random(STEPS) < 0.3
    written[0], written[rng.integers(1, STEPS)] = False, True  # one written gradient at least
    read, checks = [], []
    monkeypatch.setattr(embedding_module, "reads_as_zeroed",
                        lambda zeros: checks.append(zeros) or reads_as_zeroed(zeros))
    for (ids, target), write in zip(zipf_ids(rng, STEPS), written):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            if optimizer is opt:
                if write:
                    emb.weight.grad.mul_(1.0)  # unscale_ or a clip writes it so
                before = len(checks)
                optimizer.step()
                read.append(len(checks) > before)
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    assert read == written.tolist()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_step_skipped_by_zero_grad_is_dropped_when_a_row_of_it_is_nan(backend, rng, cache_rows, tmp_path):
    """A row that diverged to NaN makes the loss NaN; the loop skips that step with ``zero_grad()``.

    The skipped step's rows are compared with the table's to tell a dropped
    step from rows perturbed in place (SAM); NaN never equals itself, so the
    step was kept: ``emb.load`` was refused as "between a training forward
    and optimizer.step()", and its rows held slots of the next step
    (CapacityError with a working set sized for one batch).
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows)
    bad = int(rng.integers(ROWS))
    emb.table.scatter([bad], torch.full((1, DIM), float("nan")))
    with torch.no_grad():
        ref[bad] = float("nan")
    emb.save(tmp_path / "ckpt")
    skipped = torch.from_numpy(rng.choice(ROWS, size=(BATCH, WIDTH)))
    skipped[rng.integers(BATCH), rng.integers(WIDTH)] = bad
    loss = emb(skipped.to(device)).sum()
    assert not torch.isfinite(loss)
    loss.backward()
    opt.zero_grad()  # the step is skipped
    emb.load(tmp_path / "ckpt")  # what the table held before: the skipped step is gone
    assert not len(emb.working_rows)
    others = np.setdiff1d(np.arange(ROWS), [bad])
    ids = torch.from_numpy(rng.permutation(others)[:BATCH * WIDTH].reshape(BATCH, WIDTH))
    target = torch.from_numpy(rng.standard_normal((BATCH, 1)).astype(np.float32))
    step_both(both_sides(emb, opt, ref, ref_opt, device), ids, target)
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("write", ["apply_", "scatter"])
def test_a_table_write_after_a_step_skipped_with_zero_grad_is_kept(backend, rng, write):
    """forward, backward, ``zero_grad()`` (the step is skipped), a write through ``emb.table``, next step.

    The skipped step is dropped at the next forward, which compares its rows
    with the table's to tell a dropped step from rows perturbed in place
    (SAM): the write made them differ, so the step went on and wrote the
    skipped step's old rows over the write (and ``emb.load`` was refused as
    "between a training forward and optimizer.step()").
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH)
    batches = zipf_ids(rng, 2)
    ((emb(batches[0][0].to(device)).cpu().sum(1) - batches[0][1]) ** 2).sum().backward()
    opt.zero_grad()  # the loss was not finite, say: the step is skipped
    new_rows = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    if write == "apply_":
        emb.table.apply_(lambda t: t.copy_(new_rows))
    else:
        emb.table.scatter(torch.arange(ROWS), new_rows)
    with torch.no_grad():
        ref.copy_(new_rows)
    ids, target = batches[1]
    step_both(both_sides(emb, opt, ref, ref_opt, device), ids, target)
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("lr_at_save, lr_after", [(0.01, 0.03), (0.02, 0.03), (0.02, 0.02)])
def test_a_resume_from_before_the_first_step_after_steps_at_another_lr_trains_on(rng, tmp_path, lr_at_save,
                                                                                 lr_after):
    """Rprop fills ``step_size`` with the lr of its first step. A checkpoint saved before that step,
    restored (with the optimizer's state_dict, and so its lr) after steps at another lr, was
    refused at the next step ("the host tables hold trained state"): the tables were compared
    with the initial state of the lr of the detour's first step, not the lr at attach (which
    they hold) or now (which torch creates the state with)."""
    offloaded, reference = pair(rng)
    make = lambda p: torch.optim.Rprop(p, lr=0.01)  # noqa: E731
    opt, ref_opt = make(offloaded.parameters()), make(reference.parameters())
    offloaded.emb.attach(opt)
    batches = zipf_ids(rng, 25)
    for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
        optimizer.param_groups[0]["lr"] = lr_at_save
        saved = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model.state_dict())
        if model is offloaded:
            offloaded.emb.save(tmp_path / "ckpt")
        optimizer.param_groups[0]["lr"] = lr_after
        for ids, target in batches[:5]:
            train_step(model, optimizer, ids, target)
        if model is offloaded:
            offloaded.emb.load(tmp_path / "ckpt")
        optimizer.load_state_dict(saved[0])
        model.load_state_dict(saved[1])
        if model is reference:  # lazy from the resume on: its step_size rows start at the lr then
            reference.emb.looked_up.clear()
            make_lazy(ref_opt, reference.emb, initial={"step_size": lr_at_save})
        for ids, target in batches[5:]:
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("write", ["apply_", "scatter"])
@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_write_through_a_table_reference_kept_across_steps_is_kept(backend, rng, write, cache_rows):
    """``table = emb.table`` kept from the start: steps, one skipped with ``zero_grad()``, a write
    through ``table``, more steps.

    Only ``emb.table`` itself dropped the skipped step and emptied the cache first: through the kept
    reference, the next forward kept the skipped step and wrote its old rows back over the write,
    and the cache wrote its rows back over it (3.3 from in-memory training).
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows)
    table = emb.table
    batches = zipf_ids(rng, STEPS)
    skipped = len(batches) // 2
    new_rows = torch.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32))
    written = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches[skipped - 3:skipped + 1]]))
    for step, (ids, target) in enumerate(batches):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
            if step != skipped:  # a loss that was not finite, say: the step is skipped
                optimizer.step()
            optimizer.zero_grad()
        if step == skipped:
            if write == "apply_":
                table.apply_(torch.Tensor.mul_, 0.5)
                with torch.no_grad():
                    ref.mul_(0.5)
            else:
                table.scatter(written, new_rows[written])
                with torch.no_grad():
                    ref[written] = new_rows[written].to(ref.dtype)
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_table_write_between_a_training_forward_and_its_step_is_refused(backend, rng, cache_rows):
    """The step writes its rows back over whatever was written into the table meanwhile: refused,
    nothing changes, and the step then trains as in memory."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, BATCH * WIDTH, cache_rows)
    table = emb.table
    (ids, target), = zipf_ids(rng, 1)
    ((emb(ids.to(device)).cpu().sum(1) - target) ** 2).sum().backward()
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match="between a training forward and optimizer.step"):
        table.scatter(torch.unique(ids), torch.zeros(len(torch.unique(ids)), DIM))
    np.testing.assert_array_equal(table.to_numpy(), before)
    opt.step()
    ((F.embedding(ids, ref, sparse=True).sum(1) - target) ** 2).sum().backward()
    ref_opt.step()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


def test_a_step_on_zero_gradients_after_discard_step_counts_as_in_memory(rng):
    """Backward, ``zero_grad(set_to_none=False)``, ``discard_step()``, then ``optimizer.step()`` on
    the zero gradients. In memory the table's gradient is zeros, so Adam counts that step for it
    (bias correction); discard_step() set it to None, torch skipped the table, and every later
    step's update differed from in-memory training's."""
    offloaded, reference = pair(rng)
    make = lambda p: torch.optim.Adam(p, lr=0.1)  # noqa: E731
    opt, ref_opt = make(offloaded.parameters()), make(reference.parameters())
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, 8)
    for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
        train_step(model, optimizer, *batches[0])
        F.mse_loss(model(batches[1][0]), batches[1][1]).backward()
        optimizer.zero_grad(set_to_none=False)  # the step is skipped
        if model is offloaded:
            offloaded.emb.discard_step()
        else:
            reference.emb.looked_up.clear()  # its rows are left alone, lazily
        optimizer.step()  # on zero gradients: Adam counts it
        optimizer.zero_grad()
        for ids, target in batches[2:]:
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("kind,cache_rows", [("offloaded", 0), ("offloaded", 40), ("sharded", 0)])
@pytest.mark.parametrize("lookup", ["none", "no_grad"])
def test_a_step_without_rows_whose_optimizer_raised_after_counting_it_counts_once_when_retried(rng, kind, cache_rows,
                                                                                               lookup):
    """A step of the linear layer alone (no forward of the embedding, or one under torch.no_grad(), after
    zero_grad(set_to_none=False)) whose Adam raised after counting it was not undone: the retry made the
    next forward raise 'emb.weight was written between steps' (the failed step's write into the scratch),
    and the table's step was counted twice, its bias correction a step ahead from then on (a sharded
    embedding of one rank: counted twice too)."""
    offloaded, reference = pair(rng, cache_rows=cache_rows, sharded=kind == "sharded")
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, 9)
    x = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    for step, (ids, target) in enumerate(batches):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            if step % 3 == 2:  # the linear layer alone
                if lookup == "no_grad":
                    with torch.no_grad():
                        model.emb(ids)
                F.mse_loss(model.lin(x), target).backward()
                if model is offloaded:
                    step_failing_once(opt, list(offloaded.lin.parameters()))
            else:
                F.mse_loss(model(ids), target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    assert int(opt.state[offloaded.emb.weight]["step"]) == len(batches)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_sharded_lookup_recomputed_on_the_autograd_engines_thread_trains_as_in_memory(rng, reentrant, monkeypatch):
    """On a GPU the autograd engine runs a backward, activation checkpointing's recompute of the lookup with
    it, on a thread of its own while the thread that called ``backward()`` waits. A sharded embedding holds
    its claim from the step's first training forward: the recompute was refused (``StateError`` in the
    backward; reentrant, whose first run is no training forward, the recompute took the step's claim and
    the training thread's ``optimizer.step()`` was refused). Here the backward runs on another thread, as
    there, and the embedding is told it is a GPU's (no CUDA needed); it trains as in memory."""
    monkeypatch.setattr(sharded_module, "recomputed_on_engine_thread", lambda device: in_backward())
    offloaded, reference = pair(rng, sharded=True)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    for ids, target in zipf_ids(rng, 8):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            def block(ids, scale, model=model):
                return model(ids) * scale
            out = checkpoint(block, ids, torch.ones(1, requires_grad=True), use_reentrant=reentrant)
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as engine:
                engine.submit(F.mse_loss(out, target).backward).result()
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_a_switchers_step_without_rows_whose_optimizer_raised_after_counting_it_counts_once_when_retried(
        rng, cache_rows):
    """As above, for the SpeedTorch-style switchers: a step of the linear layer alone (no before_forward)
    whose Adam raised after counting it was counted twice once retried."""
    model, opt, u, o = switchers(rng, cache_rows)
    table0 = u.getNumpyVersion()
    reference = Model(LazyTable(table0), copy.deepcopy(model["lin"]))
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, 9)
    x = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    for step, (ids, target) in enumerate(batches):
        if step % 3 == 2:  # the linear layer alone
            for lin, optimizer in ((model["lin"], opt), (reference.lin, ref_opt)):
                F.mse_loss(lin(x), target).backward()
                if optimizer is opt:  # the reference never fails
                    step_failing_once(opt, list(lin.parameters()))
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            continue
        u.before_forward(ids)
        backward(model, o.before_forward(ids), target)
        opt.step()
        u.after_step(ids)
        o.after_step(ids)
        opt.zero_grad(set_to_none=False)
        F.mse_loss(reference(ids), target).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
    assert int(opt.state[model["u"].weight]["step"]) == len(batches)
    table, state = snapshot(u, o)
    assert not np.allclose(table, table0, atol=1e-3)
    tol = dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(table, reference.emb.weight.detach().numpy(), **tol)
    for name, values in state.items():
        np.testing.assert_allclose(values, ref_opt.state[reference.emb.weight][name].numpy(), err_msg=name, **tol)
    for mine, ref in zip(model["lin"].parameters(), reference.lin.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), ref.detach().numpy(), **tol)


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_reading_the_table_between_a_backward_and_its_step_sees_the_rows_before_it(backend, rng, cache_rows):
    """Logging the table between a backward and ``optimizer.step()`` (every row, and the batch's rows),
    as a loop logs an in-memory table's norm before it steps: the rows are those before the step.
    Without a device cache ``emb.table`` read them, as ``state_dict()`` does with one; with one it was
    refused ("this step's rows are in flight"). The cache goes on caching (it gives no rows up for a
    read), and training goes on as in memory."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows)
    sides = both_sides(emb, opt, ref, ref_opt, device)
    for ids, target in zipf_ids(rng, STEPS):
        for lookup, optimizer, to in sides:
            ((lookup(ids.to(to)).cpu().sum(1) - target) ** 2).sum().backward()
        np.testing.assert_allclose(emb.table.to_numpy(copy=True), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(emb.table.gather(ids.to(device)).cpu().numpy(), ref.detach()[ids].numpy(),
                                   rtol=1e-5, atol=1e-6)
        for lookup, optimizer, to in sides:
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)
    assert (emb.stats()["total"]["hits"] > 0) == bool(cache_rows)


@pytest.mark.parametrize("read", ["gather", "to_numpy", "save"])
def test_a_read_through_a_table_reference_kept_across_steps_is_current(backend, rng, read, tmp_path):
    """``table = emb.table`` kept from the start, read after cached steps: only ``emb.table`` had the
    cache write its rows back first, so the kept reference read the rows the cache held as they
    were before (0.44 from in-memory training)."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows=40)
    table = emb.table
    for ids, target in zipf_ids(rng, 10):
        step_both(both_sides(emb, opt, ref, ref_opt, device), ids, target)
    if read == "gather":
        rows = table.gather(torch.arange(ROWS)).cpu().numpy()
    elif read == "to_numpy":
        rows = table.to_numpy(copy=True)
    else:
        table.save(tmp_path / "table.npy")
        rows = np.load(tmp_path / "table.npy")
    np.testing.assert_allclose(rows, ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def _views(emb, how):
    """A view of ``emb``'s table and one of its Adam ``exp_avg`` table, as the user would keep them."""
    if how == "extra_state":
        tables = emb.get_extra_state()["tables"]
        return tables["table"].numpy(), tables["optimizer.exp_avg"].numpy()
    table, state = emb.table, emb._state.tables["exp_avg"]
    if how == "to_numpy":
        return table.to_numpy(), state.to_numpy()
    return table.as_tensor().numpy(), state.as_tensor().numpy()


@pytest.mark.filterwarnings("ignore:a view of the table:RuntimeWarning")  # said once: test_cache
@pytest.mark.parametrize("how", ["to_numpy", "as_tensor", "extra_state"])
def test_views_kept_across_cached_steps_read_and_write_as_in_memory(backend, rng, how):
    """Views of the tables kept across steps of an embedding with a device cache, as a view of an
    in-memory parameter is kept: reads see every row's current value, and writes between steps
    train on. The cache held rows the views did not show (0.46 off in-memory training after 10
    steps), and trained on its copy of a row written through one (the table 2.0 off)."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows=40)
    rows, moments = _views(emb, how)
    batches = zipf_ids(rng, 2 * STEPS)
    for step, (ids, target) in enumerate(batches):
        step_both(both_sides(emb, opt, ref, ref_opt, device), ids, target)
        if step + 1 < len(batches):
            emb.prefetch(batches[step + 1][0])  # brings nothing while a view lives
        # assert_trained_as_sparse_adam's tolerances, for its reasons: an element small now was rounded at
        # the table's scale, and a row's gradient sums its lookups in another order than SparseAdam's
        # coalesce, so terms of a few units can cancel to a moment near zero (seed 1018821822 left 1.9e-6
        # on -0.0073, the same without a cache). What this test catches is 0.05 and more.
        table = ref.detach().numpy()
        np.testing.assert_allclose(rows, table, rtol=1e-5, atol=1e-5 * np.abs(table).max(), err_msg=f"step {step}")
        exp_avg = ref_opt.state[ref]["exp_avg"].numpy()
        np.testing.assert_allclose(moments, exp_avg, rtol=1e-5, atol=1e-5 * np.abs(exp_avg).max())
        if step % 7 == 3:  # a hot row, cached by now
            hot = int(ids[0, 0])
            new = rng.standard_normal(DIM).astype(np.float32)
            rows[hot] = new
            with torch.no_grad():
                ref[hot] = torch.from_numpy(new)


def test_a_checkpoint_saved_before_the_first_step_resumes_in_a_run_at_another_lr(rng, tmp_path):
    """Rprop's initial ``step_size`` is the lr. A checkpoint saved before the first step of a run at
    lr 0.01, loaded into a run attached at lr 0.002, holds neither the lr at this attach nor the lr
    now, and the first step was refused ("the host tables hold trained state"); in memory a fresh
    Rprop starts every row at the lr of its first step, and so does the offloaded one now."""
    offloaded, reference = pair(rng)
    offloaded.emb.attach(torch.optim.Rprop(offloaded.parameters(), lr=0.01))
    offloaded.emb.save(tmp_path / "ckpt")
    opt, ref_opt = (torch.optim.Rprop(m.parameters(), lr=0.002) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    offloaded.emb.load(tmp_path / "ckpt")
    make_lazy(ref_opt, reference.emb, initial={"step_size": 0.002})
    for ids, target in zipf_ids(rng, STEPS):
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_grad", "sparse_grad"])
@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("order", ["forward_backward_twice", "both_forwards_first", "zero_grad_between"])
def test_an_accumulated_backward_whose_table_gradient_is_exactly_zero_trains_as_in_memory(
        backend, rng, cache_rows, order, sparse):
    """Gradient accumulation in which one backward gives the table an exactly zero gradient (a loss
    weighted by 0). In memory its rows are in the sparse gradient at zero values, and SparseAdam
    moves them by their momentum; the zero gradient was taken for one ``zero_grad()`` dropped, and
    those rows were left alone. A ``zero_grad(set_to_none=False)`` after that backward does drop
    them (in memory the zeroed sparse gradient names no row)."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 2 * BATCH * WIDTH, cache_rows,
                                                              sparse)
    batches = zipf_ids(rng, 2 * STEPS)
    zero_weighted = rng.random(STEPS) < 0.4
    zero_weighted[rng.integers(STEPS)] = True  # at least one zero-weighted backward, the case under test
    for ((ids, target), (more_ids, more_target)), weight in zip(zip(batches[::2], batches[1::2]),
                                                                np.where(zero_weighted, 0.0, 1.0)):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            losses = [lambda out, t=t: ((out.cpu().sum(1) - t) ** 2).sum() for t in (target, more_target)]
            if order == "both_forwards_first":
                outs = [lookup(ids.to(to)), lookup(more_ids.to(to))]
                (weight * losses[0](outs[0])).backward()
                losses[1](outs[1]).backward()
            else:
                (weight * losses[0](lookup(ids.to(to)))).backward()
                if order == "zero_grad_between":
                    optimizer.zero_grad(set_to_none=False)
                losses[1](lookup(more_ids.to(to))).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert zero_weighted.any()
    # A row a zero-weighted backward wrongly left alone keeps its whole moment where SparseAdam keeps
    # 0.9 of it: off by a tenth of it.
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


def _penalty(parameters):
    return 1e-2 * sum(p.pow(2).sum() for p in parameters)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("flow", ["accumulated", "penalty_backward_first"])
def test_a_penalty_over_the_weight_itself_before_a_forward_of_the_step_is_refused(rng, cache_rows, flow):
    """An L2 penalty summed over ``model.parameters()`` reaches ``emb.weight``, the working set,
    whose slots past the step's rows hold rows of earlier steps. With gradient accumulation (a
    penalty in each micro-batch's loss) or the penalty's own backward before the forward, a
    forward after that backward put its rows in those slots, and they trained on the penalty's
    gradient of other rows (or the step, still without rows, was taken for one ``zero_grad()``
    dropped and the gradient zeroed): the table drifted from the in-memory one, silently. That
    forward is refused before anything changes; leaving the weight out of the penalty and
    penalising the rows looked up, as the error says, trains as in memory."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, STEPS)
    for ids, target in batches[:3]:  # the working set's slots now hold rows of these steps
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    ids, target = batches[3]
    if flow == "accumulated":
        looked_up = ids[:BATCH // 2]
        (F.mse_loss(offloaded(looked_up), target[:BATCH // 2]) + _penalty(offloaded.parameters())).backward()
    else:
        looked_up = ids[:0]
        _penalty(offloaded.parameters()).backward()
    table, rows = offloaded.emb.table.to_numpy(copy=True), offloaded.emb.working_rows.clone()
    with pytest.raises(ss.StateError, match=r"gradient outside .* lookups.*Nothing was changed"):
        offloaded(ids[BATCH // 2:])
    torch.testing.assert_close(offloaded.emb.working_rows, rows, rtol=0, atol=0)
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)
    assert bool(offloaded.emb.weight.grad[len(rows):].any())  # the refused forward kept it too
    offloaded.emb.discard_step()
    opt.zero_grad()
    for ids, target in batches[3:]:  # as the error says: the looked-up rows penalised, and the rest
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            for part, goal in zip(ids.chunk(2), target.chunk(2)):
                rows = model.emb(part)
                (F.mse_loss(model.lin(torch.tanh(rows).sum(1)), goal) + _penalty([rows])
                 + _penalty(model.lin.parameters())).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def _flow_optimizers(flow, offloaded, reference):
    """Each side's optimizer for a flow of :func:`test_everyday_training_flows_train_as_in_memory`."""
    def make(model):
        if flow == "two_param_groups":  # the table's group second, with its own lr and weight decay
            return torch.optim.AdamW([{"params": model.lin.parameters(), "lr": 0.001, "weight_decay": 0.0},
                                      {"params": [model.emb.weight], "lr": 0.02, "weight_decay": 0.1}])
        if flow == "step_lr_rprop":
            return torch.optim.Rprop(model.parameters(), lr=0.01)
        if flow == "one_cycle_sgd":
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return make(offloaded), make(reference)


@pytest.mark.parametrize("cache_rows", [0, 40], ids=["no_cache", "cache"])
@pytest.mark.parametrize("flow", ["inference_mode_reads", "step_lr_rprop", "one_cycle_sgd", "two_param_groups",
                                  "add_param_group", "freeze_then_unfreeze"])
def test_everyday_training_flows_train_as_in_memory(flow, cache_rows, rng):
    """Flows of ordinary training loops, each against the in-memory lazy reference: reads under
    torch.inference_mode() between steps (a prefetch there too), an lr scheduler (Rprop's step_size
    starts at the lr of the first step; OneCycleLR cycles SGD's momentum too), param groups with
    their own lr and weight decay, a param group added after training began, and the table frozen
    for a while with requires_grad_(False) while the other layers train."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = _flow_optimizers(flow, offloaded, reference)
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb, initial={"step_size": 0.01} if flow == "step_lr_rprop" else None)
    schedulers = []
    if flow == "step_lr_rprop":
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref_opt)]
    elif flow == "one_cycle_sgd":
        schedulers = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS) for o in (opt, ref_opt)]
    batches = zipf_ids(rng, STEPS)
    for step, (ids, target) in enumerate(batches):
        if flow == "add_param_group" and step == STEPS // 3:
            extra = torch.nn.Linear(DIM, 1)
            for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
                model.lin = torch.nn.Sequential(copy.deepcopy(extra), torch.nn.Identity())
                optimizer.add_param_group({"params": model.lin.parameters(), "lr": 0.003})
        if flow == "freeze_then_unfreeze" and step in (STEPS // 3, 2 * STEPS // 3):
            for model in (offloaded, reference):
                model.emb.requires_grad_(step != STEPS // 3)
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
        for scheduler in schedulers:
            scheduler.step()
        if flow == "inference_mode_reads":
            probe = torch.from_numpy(rng.integers(0, ROWS, (BATCH, WIDTH)))
            with torch.inference_mode():
                torch.testing.assert_close(offloaded(probe), reference(probe), rtol=1e-6, atol=1e-6)
                if step + 1 < STEPS:
                    offloaded.emb.prefetch(batches[step + 1][0])
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
