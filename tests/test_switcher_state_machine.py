"""A random mix of SpeedTorch-style calls on a cached ModelFactory + OptimizerFactory pair
equals in-memory training after every call.

The hypothesis state machine drives the two switchers of one embedding
(numpy backend, ``storage="pageable"``, a device cache) through training steps
of Zipf-like ids (pos and neg, repeats included) with either switcher called
first, independently for ``before_forward`` and ``after_step``; prefetches of
the next step's ids, made between steps or at any point of the step before,
followed by that step; saves and loads of both switchers (the ModelFactory to
``.npy`` or ``.h5``, the OptimizerFactory to a directory or ``.h5``, a slot
sometimes saved over) with the optimizer's ``state_dict``; ``flush()``;
``getNumpyVersion()``; and ``optInit()``. SpeedTorch's camelCase aliases and
the snake_case names are drawn too.

The reference is a full ``(ROWS, DIM)`` parameter trained by plain torch:
offloaded Adam (eps=1e-30) against ``SparseAdam``, offloaded Adagrad against
sparse-gradient Adagrad, SGD against dense SGD (see test_optimizer_equivalence).

``optInit`` resets the state *tables* to torch's initial values
(``RowState.init_state``) and leaves the optimizer's scalar state alone: Adam's
(and Adagrad's) ``step`` goes on counting. The reference does the same: its
per-row state tensors are refilled in place, its ``step`` is kept.

After every call the invariant compares the table and state that hold for
each row now, read without side effects: the host tables overlaid with the
rows the cache holds (its copy is the authoritative one). Reading them through
``getNumpyVersion``/``state`` would flush (and empty) the cache after every
call, and dirty rows would never be evicted. The ``flush`` and
``getNumpyVersion`` rules check the public reads.

Cache sizes (drawn): 0, 3 (fewer than the distinct rows of most steps, which
look up 4 to 32 ids: the cache falls back, writing the rest to the host),
10 (5% of ROWS) and 100 (50%). The longer variants are marked ``slow``.
"""

import copy
import os
import tempfile

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import speedswap as ss
from test_optimizer_equivalence import assert_same, torch_initial
from training_helpers import skipgram_loss

ROWS, DIM, NEGS = 200, 4, 3
MAX_BATCH = 8
CAPACITY = MAX_BATCH * (1 + NEGS)  # the most distinct rows a step can touch
CACHE_SIZES = [0, 3, ROWS // 20, ROWS // 2]

#: name: (offloaded optimizer, reference optimizer, reference uses sparse gradients)
SETUPS = {
    "adam": (lambda p: torch.optim.Adam(p, lr=0.05, eps=1e-30),
             lambda p: torch.optim.SparseAdam(list(p), lr=0.05, eps=1e-30), True),
    # lr_decay makes the step count matter (it must survive optInit on both sides).
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
                True),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05), False),
}

#: A Zipf-like rank: log-uniform over 1..ROWS, so p(rank r) ~ 1/(r+1); shrinks to the hottest row.
RANK = st.integers(0, 10_000).map(lambda u: min(int(ROWS ** (u / 10_000)) - 1, ROWS - 1))


@st.composite
def batches(draw):
    """Ranks of one step: ``b`` pos ids and ``b * NEGS`` neg ids (mapped to rows by the machine)."""
    b = draw(st.integers(1, MAX_BATCH))
    return draw(st.lists(RANK, min_size=b * (1 + NEGS), max_size=b * (1 + NEGS)))


#: Where a prefetch of the next step's ids goes in the step before: after the first
#: before_forward, after both, after optimizer.step(), after the first after_step.
PREFETCH_POINTS = ["first_before", "both_before", "optimizer_step", "first_after"]


class SwitchersAgainstInMemory(RuleBasedStateMachine):
    """A ModelFactory + OptimizerFactory pair with a device cache against an in-memory reference."""

    optimizer = None  # a key of SETUPS, set by the subclasses

    @initialize(cache_rows=st.sampled_from(CACHE_SIZES), seed=st.integers(0, 2**32 - 1),
                model_built_first=st.booleans(), opt_init=st.booleans())
    def build(self, cache_rows, seed, model_built_first, opt_init):
        self.gen = np.random.default_rng(seed)
        table0 = self.gen.standard_normal((ROWS, DIM), dtype=np.float32)
        self.perm = self.gen.permutation(ROWS)  # the hot rows are scattered over the table
        self.cache_rows = cache_rows
        make, make_ref, self.sparse = SETUPS[self.optimizer]
        self.model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAPACITY, DIM)})
        self.opt = make(self.model.parameters())

        def model_switch():
            u = ss.ModelFactory(self.model["u"], ROWS, DIM, storage="pageable", backend="numpy",
                                cache_rows=cache_rows)
            u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
            return u

        def optimizer_switch():
            return ss.OptimizerFactory(self.opt, ROWS, DIM, self.model, "u", storage="pageable",
                                       backend="numpy", cache_rows=cache_rows)

        if model_built_first:
            self.u = model_switch()
            self.o = optimizer_switch()
        else:
            self.o = optimizer_switch()
            self.u = model_switch()
        if opt_init:
            self.o.optInit()
        self.ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
        self.ref_opt = make_ref([self.ref])
        self.tmp = tempfile.TemporaryDirectory()
        self.saved = {}  # slot -> (u path, o path, optimizer state_dict, ref, ref state_dict)
        self.steps = 0

    def teardown(self):
        if hasattr(self, "tmp"):
            self.tmp.cleanup()

    # ------------------------------------------------------------- helpers
    def _ids(self, ranks):
        ids = torch.from_numpy(self.perm[np.asarray(ranks, dtype=np.int64)])
        b = len(ranks) // (1 + NEGS)
        return ids[:b], ids[b:].reshape(b, NEGS)

    def _expected(self):
        """The reference's table and per-row state, torch's initial value where it has none yet."""
        state = self.ref_opt.state.get(self.ref, {})
        group = self.ref_opt.param_groups[0]
        expected = {}
        for name in self.o._state.tables:
            value = state.get(name)
            expected[name] = (value.detach().numpy().copy() if value is not None
                              else np.full((ROWS, DIM), torch_initial(name, group), dtype=np.float32))
        return self.ref.detach().numpy().copy(), expected

    def _current(self):
        """Every row's table and state values now, without flushing: the host overlaid with the cache."""
        table = self.u._table.to_numpy(copy=True)
        state = {k: t.to_numpy(copy=True) for k, t in self.o._state.tables.items()}
        cache = self.u._steps.cache
        if cache is not None and cache.num_slots:
            held = torch.nonzero(cache.slot_row >= 0).squeeze(1)
            rows = cache.slot_row[held].numpy()
            table[rows] = cache.weights[held].numpy()
            for name in state:
                state[name][rows] = cache.states[name][held].numpy()
        return table, state

    def _train(self, ranks, model_first_before, model_first_after, alias, prefetch=None):
        """One step of both switchers and the same step of the reference.

        ``prefetch``: ``(ranks of the next step, point)``, prefetched at ``point`` of this step.
        """
        pos, neg = self._ids(ranks)
        ctx = torch.from_numpy(self.gen.standard_normal((len(pos), DIM), dtype=np.float32))
        order = (self.u, self.o) if model_first_before else (self.o, self.u)
        after = (self.u, self.o) if model_first_after else (self.o, self.u)
        brought = None

        def maybe_prefetch(point):
            nonlocal brought
            if prefetch is not None and prefetch[1] == point:
                brought = self._prefetch(prefetch[0], alias)

        locals_ = []
        for k, switch in enumerate(order):
            before = switch.beforeForwardPass if alias else switch.before_forward
            locals_.append(before(pos, neg))
            if k == 0:
                maybe_prefetch("first_before")
        maybe_prefetch("both_before")
        (lpos, lneg), (lpos2, lneg2) = locals_
        assert torch.equal(lpos, lpos2) and torch.equal(lneg, lneg2)
        emb = self.model["u"]
        skipgram_loss(emb(lpos), emb(lneg), ctx).backward()
        self.opt.step()
        self.opt.zero_grad()
        maybe_prefetch("optimizer_step")
        for k, switch in enumerate(after):
            (switch.afterOptimizerStep if alias else switch.after_step)(pos, neg)
            if k == 0:
                maybe_prefetch("first_after")

        loss = skipgram_loss(F.embedding(pos, self.ref, sparse=self.sparse),
                             F.embedding(neg, self.ref, sparse=self.sparse), ctx)
        loss.backward()
        self.ref_opt.step()
        self.ref_opt.zero_grad()
        self.steps += 1

        # The counters are shared, and add up for this step.
        stats = self.u.stats()
        assert self.o.stats() == stats
        last, distinct = stats["last_step"], len(torch.unique(torch.cat([pos, neg.reshape(-1)])))
        assert last["lookups"] == len(pos) * (1 + NEGS)
        assert last["unique_rows"] == distinct
        assert last["hits"] + last["misses"] == distinct
        # Rows that find no slot go back to the host (a cache smaller than the step falls back).
        assert last["rows_d2h"] >= distinct - self.cache_rows
        if not self.cache_rows:
            assert last["hits"] == 0 and last["rows_d2h"] == distinct
        return brought

    def _prefetch(self, ranks, alias):
        pos, neg = self._ids(ranks)
        brought = (self.u.prefetchNextBatch if alias else self.u.prefetch)(pos, neg)
        distinct = len(torch.unique(torch.cat([pos, neg.reshape(-1)])))
        assert 0 <= brought <= min(distinct, self.cache_rows)
        return brought

    # --------------------------------------------------------------- rules
    @rule(ranks=batches(), model_first_before=st.booleans(), model_first_after=st.booleans(),
          alias=st.booleans())
    def step(self, ranks, model_first_before, model_first_after, alias):
        self._train(ranks, model_first_before, model_first_after, alias)

    @rule(ranks=batches(), ahead=batches(), point=st.sampled_from(PREFETCH_POINTS),
          model_first_before=st.booleans(), model_first_after=st.booleans(),
          next_model_first_before=st.booleans(), next_model_first_after=st.booleans(),
          alias=st.booleans())
    def step_prefetching_the_next(self, ranks, ahead, point, model_first_before,
                                  model_first_after, next_model_first_before,
                                  next_model_first_after, alias):
        """A step that prefetches the next step's ids at ``point``, then that next step."""
        self._train(ranks, model_first_before, model_first_after, alias, prefetch=(ahead, point))
        self._train(ahead, next_model_first_before, next_model_first_after, alias)

    @rule(ranks=batches(), model_first_before=st.booleans(), model_first_after=st.booleans(),
          alias=st.booleans())
    def prefetch_then_step(self, ranks, model_first_before, model_first_after, alias):
        """A prefetch between steps, then the step of those ids: a large enough cache hits them all."""
        brought = self._prefetch(ranks, alias)
        self._train(ranks, model_first_before, model_first_after, alias)
        if self.cache_rows >= ROWS // 2:  # room for every row of a step, however pinned
            last = self.u.stats()["last_step"]
            assert last["hits"] == last["unique_rows"], (brought, last)

    @rule(slot=st.integers(0, 3), u_h5=st.booleans(), o_h5=st.booleans(), alias=st.booleans())
    def save(self, slot, u_h5, o_h5, alias):
        """Save both switchers to a slot's files, over an earlier save of the slot if any."""
        u_path = os.path.join(self.tmp.name, f"u{slot}" + (".h5" if u_h5 else ".npy"))
        o_path = os.path.join(self.tmp.name, f"o{slot}" + (".h5" if o_h5 else ""))
        (self.u.saveCupy if alias else self.u.save)(u_path)
        (self.o.saveCupy if alias else self.o.save)(o_path)
        self.saved[slot] = (u_path, o_path, copy.deepcopy(self.opt.state_dict()),
                            self.ref.detach().clone(), copy.deepcopy(self.ref_opt.state_dict()))
        if not u_h5:  # the file holds every row as trained now (the cache's included)
            assert_same((np.load(u_path), {}), (self._expected()[0], {}))

    @precondition(lambda self: self.saved)
    @rule(which=st.integers(0, 3), model_first=st.booleans(), alias=st.booleans())
    def load(self, which, model_first, alias):
        u_path, o_path, opt_state, ref, ref_opt_state = self.saved[sorted(self.saved)[which % len(self.saved)]]
        loads = [(self.u, u_path), (self.o, o_path)]
        for switch, path in (loads if model_first else loads[::-1]):
            (switch.loadCupy if alias else switch.load)(path)
        # load_state_dict keeps the tensors it is given, which the steps then update in place.
        self.opt.load_state_dict(copy.deepcopy(opt_state))
        with torch.no_grad():
            self.ref.copy_(ref)
        self.ref_opt.load_state_dict(copy.deepcopy(ref_opt_state))

    @rule(through_optimizer=st.booleans())
    def flush(self, through_optimizer):
        """After a flush (of either switcher) the host tables hold every row as trained."""
        (self.o if through_optimizer else self.u).flush()
        host = (self.u._table.to_numpy(copy=True),
                {k: t.to_numpy(copy=True) for k, t in self.o._state.tables.items()})
        assert_same(host, self._expected())

    @rule()
    def numpy_version(self):
        """getNumpyVersion is the current table, and a copy: writing to it changes nothing."""
        table = self.u.getNumpyVersion()
        assert_same((table, {}), (self._expected()[0], {}))
        table[:] = 7.0

    @rule(alias=st.booleans())
    def opt_init(self, alias):
        """Reset every row's optimizer state to torch's initial value; the step count goes on."""
        (self.o.optInit if alias else self.o.init_state)()
        state = self.ref_opt.state.get(self.ref, {})
        group = self.ref_opt.param_groups[0]
        with torch.no_grad():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == self.ref.shape:
                    value.fill_(torch_initial(name, group))

    @invariant()
    def every_row_equals_the_reference(self):
        if hasattr(self, "u"):
            assert_same(self._current(), self._expected())


class AdamSwitchers(SwitchersAgainstInMemory):
    optimizer = "adam"


class AdagradSwitchers(SwitchersAgainstInMemory):
    optimizer = "adagrad"


class SGDSwitchers(SwitchersAgainstInMemory):
    optimizer = "sgd"


def _settings(examples, steps):
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None)


AdamSwitchers.TestCase.settings = _settings(30, 30)
AdagradSwitchers.TestCase.settings = _settings(20, 30)
SGDSwitchers.TestCase.settings = _settings(15, 30)
TestAdamSwitchers = AdamSwitchers.TestCase
TestAdagradSwitchers = AdagradSwitchers.TestCase
TestSGDSwitchers = SGDSwitchers.TestCase


@pytest.mark.slow
class TestAdamSwitchersLonger(AdamSwitchers.TestCase):
    settings = _settings(80, 50)


@pytest.mark.slow
class TestAdagradSwitchersLonger(AdagradSwitchers.TestCase):
    settings = _settings(50, 50)
