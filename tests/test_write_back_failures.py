"""A step whose write-back fails part-way changes nothing: rows and optimizer state stay as before it.

After ``optimizer.step()`` (or a switcher's ``afterOptimizerStep``) the step's
rows and their optimizer state rows go back: into the host table and each
state table, or into the device cache's slots, the rows the cache does not
keep to the host, and the rows a cached miss evicts to the host first. Between
those writes the write-back allocates: on a GPU, each table's write moves the
ids (and, for a staged table, the rows) to where the table is written, and
the cache re-sorts its index of rows, gathers the rows going back and finds
their positions. Out of memory at any of those calls must leave the table, the
state and the cache as before the step, never some of them written: the step
is then skipped (``discard_step()``) or stepped again (``optimizer.step()``;
for the switchers, its ``afterOptimizerStep`` called again), and training
goes on exactly as if the failure had never happened, the optimizer's step
count included.

Each test makes the ``N``-th call of one such operation inside the write-back
raise, for ``N = 1, 2, ...`` until the write-back gets through, at every step.
On the numpy backend the moves are no-ops that cannot fail; failing them here
stands for the GPU's allocations. RMSprop (centered, with momentum: three
state tables) keeps a step count that its arithmetic does not use, so the
retried steps leave the reference comparable bit for bit: the same optimizer
applied in memory to each step's touched rows, once.
"""

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.train import cache as cache_module
from speedswap.train.cache import RowCache
from speedswap.train.reached import KeptRows
from speedswap.train.row_state import RowState
from test_optimizer_equivalence import assert_same, torch_initial
from training_helpers import CAPACITY, DIM, NUM_ROWS, run_in_memory, skipgram_loss, zipf_batches

STEPS = 12


def _rmsprop(params):
    return torch.optim.RMSprop(params, lr=0.01, momentum=0.5, centered=True)


#: The operations of the write-back that allocate, as (where it is looked up, its name).
OPERATIONS = {
    "move": (torch.Tensor, "to"),  # ids and rows to where a table is written; dtype conversions
    "gather": (torch.Tensor, "index_select"),
    "sort": (torch, "sort"),  # the cache's index of the rows it holds
    "positions": (cache_module, "positions"),
    "where": (torch, "where"),  # what a step puts back instead of what it made (see KeptRows)
}

#: Those a store into the device cache makes between its writes.
CACHE_OPERATIONS = ("move", "gather", "sort", "positions")


def _allocates(operation, tensor, *args, **kwargs):
    """Whether the call may allocate: a ``.to`` that only names the tensor's own dtype never does."""
    if operation != "move":
        return True
    given = [*args, *kwargs.values()]
    return any(not isinstance(arg, torch.dtype) or arg != tensor.dtype for arg in given)


class FailingWriteBack:
    """Makes the ``at``-th call of one operation inside the write-back raise ``torch.OutOfMemoryError``.

    The write-back is :meth:`KeptRows.put_back` (rows a step leaves alone),
    :meth:`RowCache.store` and :meth:`RowState.scatter` (which runs it for an
    OffloadedEmbedding, and is a lone OptimizerFactory's).
    """

    def __init__(self, monkeypatch, operation):
        self.at, self.calls, self.failures, self._inside = None, 0, 0, 0
        owner, name = OPERATIONS[operation]
        original = getattr(owner, name)

        def failing(*args, **kwargs):
            if self._inside and self.at is not None and _allocates(operation, *args, **kwargs):
                self.calls += 1
                if self.calls == self.at:
                    self.failures += 1
                    raise torch.OutOfMemoryError(f"out of memory (injected at call {self.at} of {operation})")
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, failing)
        for cls, method in ((KeptRows, "put_back"), (RowCache, "store"), (RowState, "scatter")):
            monkeypatch.setattr(cls, method, self._watched(getattr(cls, method)))

    def _watched(self, method):
        def watched(*args, **kwargs):
            self._inside += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._inside -= 1
        return watched

    def arm(self, at):
        self.at, self.calls = at, 0

    def disarm(self):
        self.at = None

    def until_it_succeeds(self, call, host, before, recover=lambda: None):
        """``call()`` with the 1st, 2nd, ... such operation failing, until one runs through.

        After each failure the host tables must be as ``before`` (``host()``
        reads them); ``recover()`` then readies the call again.
        """
        for at in range(1, 1000):
            self.arm(at)
            try:
                call()
                return
            except torch.OutOfMemoryError:
                self.disarm()
                _assert_unchanged(host(), before, f"after call {at} failed")
                recover()
            finally:
                self.disarm()


def _host(table, states):
    return table.to_numpy(copy=True), {name: t.to_numpy(copy=True) for name, t in states.items()}


def _assert_unchanged(got, before, what):
    np.testing.assert_array_equal(got[0], before[0], err_msg=f"the table, {what}")
    for name in before[1]:
        np.testing.assert_array_equal(got[1][name], before[1][name], err_msg=f"state {name!r}, {what}")


def _reference(table0, batches):
    return run_in_memory(_rmsprop, table0, batches, torch.device("cpu"), initial_state=torch_initial)


def _train_recovering(emb, opt, batches, failing, recover):
    """Train ``emb`` on ``batches``; a failed step is dropped and trained again (``recover="discard"``)
    or stepped again (``"retry"``).

    Each failure must leave the host's rows and state as before the step (flushed from the cache
    first), and a failed step counts as none, as in memory; the table is flushed at the end.
    """
    def flushed_host():
        emb.flush()
        return _host(emb.table, emb._state.tables)

    for pos, neg, ctx in batches:
        def train():
            skipgram_loss(emb(pos), emb(neg), ctx).backward()

        def dropped():  # "retry": the failed step itself again
            if recover == "discard":
                opt.zero_grad()
                emb.discard_step()
                train()
        train()
        failing.until_it_succeeds(opt.step, flushed_host, flushed_host(), dropped)
        opt.zero_grad()
    assert failing.failures, "no injected failure happened"
    assert opt.state[emb.weight]["step"] == len(batches)  # a failed step counts as none, as in memory
    emb.flush()


@pytest.mark.parametrize("cache_rows,operation", [
    (0, "move"),
    *((20, operation) for operation in CACHE_OPERATIONS),
])
@pytest.mark.parametrize("recover", ["discard", "retry"])
def test_an_offloaded_step_whose_write_back_fails_changes_nothing(cache_rows, operation, recover, rng, monkeypatch):
    """OffloadedEmbedding: no cache (the table, then each state table), and a 20-row cache (5%:
    hits, misses that evict, misses that go back to the host). The failed step is dropped and
    trained again, or stepped again as it is."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")
    expected = _reference(table0, batches)
    failing = FailingWriteBack(monkeypatch, operation)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy",
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = _rmsprop(emb.parameters())
    emb.attach(opt)
    _train_recovering(emb, opt, batches, failing, recover)
    assert_same(_host(emb.table, emb._state.tables), expected, exact=True)


@pytest.mark.parametrize("operation", CACHE_OPERATIONS)
def test_a_cached_step_stored_again_after_a_failure_keeps_the_rows_a_run_without_it_keeps(operation, rng,
                                                                                        monkeypatch):
    """The policy too: a store that failed counted the step's rows in the cache's sketch; stored
    again, the step must not count them twice (its rows would outrank rows used as often, and
    evict them where a run without the failure keeps them)."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")

    def cached():
        emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy",
                                    cache_rows=20)
        emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
        opt = _rmsprop(emb.parameters())
        emb.attach(opt)
        return emb, opt

    clean, clean_opt = cached()
    for pos, neg, ctx in batches:
        skipgram_loss(clean(pos), clean(neg), ctx).backward()
        clean_opt.step()
        clean_opt.zero_grad()
    clean.flush()
    emb, opt = cached()
    _train_recovering(emb, opt, batches, FailingWriteBack(monkeypatch, operation), "retry")
    torch.testing.assert_close(emb._cache.slot_row, clean._cache.slot_row, rtol=0, atol=0)
    torch.testing.assert_close(emb._cache.score, clean._cache.score, rtol=0, atol=0)


def _switchers_host(u, o):
    """The switchers' host tables, the cache's rows written back first (the switchers' own reads: a
    read through a table is refused in the middle of a step)."""
    cache = u._steps.cache
    if cache is not None:
        cache.flush()
    return u._table.owner_copy(), {name: t.owner_copy() for name, t in o._state.tables.items()}


@pytest.mark.parametrize("cache_rows,operation,first", [
    (0, "move", "model"),
    (0, "move", "optimizer"),
    *((20, operation, "model") for operation in CACHE_OPERATIONS),
    (20, "move", "optimizer"),
])
def test_a_switchers_write_back_that_fails_changes_nothing_and_after_step_again_finishes_it(
        cache_rows, operation, first, rng, monkeypatch):
    """ModelFactory + OptimizerFactory: the model's afterOptimizerStep stores the rows and their
    state (taken from the optimizer there, or handed over by the OptimizerFactory's
    afterOptimizerStep called first). When it fails, calling it again finishes the step."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")
    expected = _reference(table0, batches)
    failing = FailingWriteBack(monkeypatch, operation)
    emb = torch.nn.Embedding(CAPACITY, DIM)
    model = torch.nn.ModuleDict({"emb": emb})
    opt = _rmsprop(model.parameters())
    u = ss.ModelFactory(emb, NUM_ROWS, DIM, storage="pageable", backend="numpy", cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, NUM_ROWS, DIM, model, "emb", storage="pageable", backend="numpy",
                            cache_rows=cache_rows)
    o.optInit()
    for pos, neg, ctx in batches:
        before = _switchers_host(u, o)
        local_pos, local_neg = u.beforeForwardPass(pos, neg)
        o.beforeForwardPass(pos, neg)
        skipgram_loss(emb(local_pos), emb(local_neg), ctx).backward()
        opt.step()
        opt.zero_grad()
        if first == "optimizer":
            o.afterOptimizerStep(pos, neg)
        failing.until_it_succeeds(lambda: u.afterOptimizerStep(pos, neg), lambda: _switchers_host(u, o), before)
        if first == "model":
            o.afterOptimizerStep(pos, neg)
    assert failing.failures, "no injected failure happened"
    assert_same((u.getNumpyVersion(), {name: t.to_numpy(copy=True) for name, t in o.state.tables.items()}),
                expected, exact=True)


def test_a_lone_optimizer_factorys_write_back_that_fails_changes_no_state_table(rng, monkeypatch):
    """Without a ModelFactory the OptimizerFactory writes its state rows to its tables itself (the
    embedding's rows are the user's own swapping): all of them, or none."""
    batches = zipf_batches(rng, 4, "cpu")
    failing = FailingWriteBack(monkeypatch, "move")
    emb = torch.nn.Embedding(CAPACITY, DIM)
    model = torch.nn.ModuleDict({"emb": emb})
    opt = _rmsprop(model.parameters())
    o = ss.OptimizerFactory(opt, NUM_ROWS, DIM, model, "emb", storage="pageable", backend="numpy")
    o.optInit()
    def host():
        return None, {name: t.owner_copy() for name, t in o._state.tables.items()}

    for pos, neg, ctx in batches:
        before = host()
        local_pos, local_neg = o.beforeForwardPass(pos, neg)
        skipgram_loss(emb(local_pos), emb(local_neg), ctx).backward()
        opt.step()
        opt.zero_grad()
        failing.until_it_succeeds(lambda: o.afterOptimizerStep(pos, neg), host, before)
    assert failing.failures, "no injected failure happened"


@pytest.mark.parametrize("recover", ["discard", "retry"])
def test_an_offloaded_step_whose_kept_rows_cannot_be_put_back_changes_nothing(rng, monkeypatch, recover):
    """Before the write-back the step puts back rows it must leave alone (here the padding row, in
    every step and never looked up), which allocates. Out of memory there left the optimizer
    holding the step's narrowed state: after discard_step() the next forward refused it as state
    an optimizer.load_state_dict() had put in place, with advice that would lose every row's state.
    The step is undone now, as one whose optimizer raised: dropped, or stepped again."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = [(pos.clamp(min=1), neg.clamp(min=1), ctx) for pos, neg, ctx in zipf_batches(rng, STEPS, "cpu")]
    expected = _reference(table0, batches)
    failing = FailingWriteBack(monkeypatch, "where")
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy",
                                padding_idx=0)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = _rmsprop(emb.parameters())
    emb.attach(opt)
    _train_recovering(emb, opt, batches, failing, recover)
    assert_same(_host(emb.table, emb._state.tables), expected, exact=True)
