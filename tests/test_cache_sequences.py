"""Seeded random sequences of every call around the device cache, against an in-memory reference.

test_cache's runs and state machine each combine a few calls; these mix all
of them in one run, at random points of a step: prefetches between steps,
between a step's forwards and before its optimizer step (of the step's own
ids too, and of an eval forward's), saves, loads and state-dict round trips,
eval and no_grad reads, views of the table (``as_tensor``, ``get_extra_state``) kept alive across prefetches and
steps (and written through), writes into the table, ``init_state`` between
steps and between a forward and its step, a second ``attach`` of a new
optimizer over cached dirty rows, ``discard_step``, gradient clipping,
several forwards per step, forwards no backward reaches, refused forwards
and prefetches (bad ids, too many rows), with caches of 1, 2, 3, 8 rows or
the whole table, ``max_rows`` below the table, the padding row and bfloat16
tables. The reference is an in-memory parameter trained by the optimizer
offloaded training must equal (SGD: dense SGD; Adam: SparseAdam; Adagrad:
sparse Adagrad; the other element-wise optimizers: the same optimizer with
the untouched rows and their state put back after each step). Each step's
``stats()`` must also agree with what moved: every row crosses with its
state rows, both counted in ``bytes_h2d`` / ``bytes_d2h``. The same through
a ModelFactory and OptimizerFactory sharing one cache. Ids are drawn
Zipf-like, so that rows recur and hit the cache, and a view kept is
dropped after a few steps, so that the cache caches again. On the numpy
backend host writes land as late as a GPU's may (:mod:`late_writes`), so
that a view read or written while a write-back is in flight fails here, in CI.
"""

import copy
import io
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from late_writes import land_host_writes_late
from test_optimizer_equivalence import OPTIMIZERS, torch_initial

#: Looser than TOL: up to 60 steps of Adam moments carry summation-order differences along.
SEQ_TOL = dict(rtol=1e-4, atol=1e-5)
SEQUENCES, STEPS, DIM = 12, 60, 3

#: name: (offloaded optimizer, reference optimizer, reference gradient sparse, reference lazy)
KINDS = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), False, False),
    "adam": (lambda p: torch.optim.Adam(p, lr=0.05, eps=1e-30),
             lambda p: torch.optim.SparseAdam(list(p), lr=0.05, eps=1e-30), True, False),
    "adagrad": (lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
                lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1), True, False),
}
ELEMENT_WISE = sorted(name for name in OPTIMIZERS if name != "sparse_adam")


def draw_ids(gen, rows, count, pool, device):
    """``count`` ids drawn with repeats from ``pool`` distinct rows, which are picked Zipf-like
    (row r about 1/(r+1) of the time): low rows recur from step to step, and hit the cache."""
    weights = 1.0 / np.arange(1, rows + 1)
    chosen = gen.choice(rows, size=min(pool, rows), replace=False, p=weights / weights.sum())
    return torch.from_numpy(gen.choice(chosen, size=count)).to(device)


def step_reference(ref, ref_opt, lazy_rows=None):
    """Step the reference; with ``lazy_rows`` (the ids the step trained), put every other row and its
    state back as they were, or at torch's initial state where the step created it."""
    before = ref.detach().clone()
    state_before = {name: value.clone() for name, value in ref_opt.state.get(ref, {}).items()
                    if torch.is_tensor(value) and value.shape == ref.shape}
    ref_opt.step()
    if lazy_rows is None:
        return
    untouched = torch.ones(len(ref), dtype=torch.bool, device=ref.device)
    untouched[lazy_rows] = False
    with torch.no_grad():
        ref[untouched] = before[untouched]
        for name, value in ref_opt.state[ref].items():
            if torch.is_tensor(value) and value.shape == ref.shape:
                value[untouched] = (state_before[name][untouched] if name in state_before
                                    else torch_initial(name, ref_opt.param_groups[0]))


class Pair:
    """An OffloadedEmbedding with a cache and its in-memory reference, driven by one generator.

    Args:
        gen: the sequence's numpy generator (it draws the set-up and every call).
        kind: a key of :data:`KINDS`, or ``"element_wise"`` (an optimizer of
            :data:`ELEMENT_WISE`, against a lazy reference).
        device: the backend's device.
        backend: the backend's name.
    """

    def __init__(self, gen, kind, device, backend):
        self.gen, self.device = gen, device
        self.rows = int(gen.choice([12, 30]))
        self.max_rows = int(gen.choice([4, 6, self.rows]))
        self.pad = int(gen.integers(self.rows)) if gen.random() < 0.4 else None
        self.bf16 = gen.random() < 0.35
        if kind == "element_wise":
            make = OPTIMIZERS[str(gen.choice(ELEMENT_WISE))]
            self.make, self.make_ref, self.sparse, self.lazy = make, make, False, True
        else:
            self.make, self.make_ref, self.sparse, self.lazy = KINDS[kind]
        self.by_freq = kind == "sgd" and gen.random() < 0.3  # torch's sparse gradients refuse it
        table0 = torch.from_numpy(gen.standard_normal((self.rows, DIM)).astype(np.float32))
        if self.bf16:
            table0 = table0.bfloat16().float()
        if self.pad is not None:
            table0[self.pad] = 0.5 * gen.integers(2)  # zero, or a pretrained padding row
        self.emb = ss.OffloadedEmbedding(
            self.rows, DIM, max_rows=self.max_rows, storage="pageable", backend=backend,
            cache_rows=int(gen.choice([1, 2, 3, 8, self.rows])), padding_idx=self.pad,
            scale_grad_by_freq=self.by_freq, dtype=torch.bfloat16 if self.bf16 else torch.float32)
        self.emb.table.scatter(np.arange(self.rows), table0.to(self.emb.table.dtype).to(device))
        self.ref = torch.nn.Parameter(table0.to(device))
        self._new_optimizers()
        self.ctx = torch.from_numpy(gen.standard_normal(DIM).astype(np.float32)).to(device)
        self.tmp = tempfile.TemporaryDirectory()
        self.saved, self.view = [], None

    def _new_optimizers(self):
        self.opt = self.make(self.emb.parameters())
        self.emb.attach(self.opt)
        self.ref_opt = self.make_ref([self.ref])

    def close(self):
        self.view = None
        self.emb.close()
        self.tmp.cleanup()

    # ------------------------------------------------------------ checks
    def ids(self, count, pool):
        return draw_ids(self.gen, self.rows, count, pool, self.device)

    def expect_rows(self, got, ids, what):
        np.testing.assert_allclose(got.float().cpu().numpy(), self.ref.detach()[ids].cpu().numpy(),
                                   **SEQ_TOL, err_msg=what)

    def read(self, ids, eval_mode, what):
        """A read that must see every row as trained (the cache's copies included)."""
        if eval_mode:
            self.emb.eval()
        with torch.no_grad():
            got = self.emb(ids)
        self.emb.train()
        self.expect_rows(got, ids, what)

    def initial(self, name):
        return torch_initial(name, self.ref_opt.param_groups[0])

    def check_tables(self, what):
        """Every row (read through the cache) and the state tables (flushed: they keep their rows
        cached) against the reference's rows and state."""
        everything = torch.arange(self.rows, device=self.device)
        self.read(everything, True, what)
        if self.gen.random() < 0.5:  # the host's rows, the cache given up first
            self.expect_rows(self.emb.table.gather(everything), everything, f"{what}: the host table")
        state = self.ref_opt.state.get(self.ref, {})
        for name, table in self.emb._state.tables.items():
            got = table.to_numpy(copy=True)
            expected = state[name].cpu().numpy() if name in state else np.full_like(got, self.initial(name))
            np.testing.assert_allclose(got, expected, **SEQ_TOL, err_msg=f"{what}: {name}")

    def check_view(self, what):
        if self.view is not None:
            np.testing.assert_allclose(self.view.float().cpu().numpy(), self.ref.detach().cpu().numpy(),
                                       **SEQ_TOL, err_msg=what)

    # ------------------------------------------------------------ between steps
    def between_steps(self, step):
        op = str(self.gen.choice(["prefetch", "save", "load", "eval", "view", "drop_view", "write_view",
                                  "write_table", "init_state", "attach", "state_dict"]))
        if op == "prefetch":
            self.emb.prefetch(self.ids(int(self.gen.integers(1, 10)), self.rows))
        elif op == "save":
            path = f"{self.tmp.name}/ckpt{len(self.saved)}"
            self.emb.save(path)
            self.saved.append((path, self._snapshot()))
        elif op == "load" and self.saved:
            path, snapshot = self.saved[int(self.gen.integers(len(self.saved)))]
            self.emb.load(path)
            self._restore(snapshot)
        elif op == "state_dict":
            buffer = io.BytesIO()
            torch.save(self.emb.state_dict(), buffer)
            snapshot = self._snapshot()
            self.between_steps(step)  # something else happens before it is loaded back
            self.emb.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
            self._restore(snapshot)
        elif op == "eval":
            self.read(torch.arange(self.rows, device=self.device), True, f"eval read before step {step}")
        elif op == "view":  # emb.table empties the cache; get_extra_state() leaves its rows cached, clean
            self.view = (self.emb.table.as_tensor() if self.gen.random() < 0.5
                         else self.emb.get_extra_state()["tables"]["table"])
            self.check_view(f"a new view before step {step}")
            self._write_view()
        elif op == "drop_view":
            self.check_view(f"a view kept until step {step}")
            self.view = None
        elif op == "write_view":
            self._write_view()
        elif op == "write_table":
            self._write_row(lambda row, value: self.emb.table.scatter(
                [row], value.view(1, DIM).to(self.emb.table.dtype)))
        elif op == "init_state":
            self.init_state()
        elif op == "attach":  # the old optimizer's cached dirty rows are written back first
            self._new_optimizers()
            self.saved.clear()  # their optimizer state is another optimizer's

    def _write_view(self):
        """Most of the time, write a row through the view kept (if one is)."""
        if self.view is not None and self.gen.random() < 0.7:
            self._write_row(lambda row, value: self.view.__setitem__(row, value.to(self.view)))

    def _write_row(self, write):
        """Write a random row (not the padding row, nor one of a step in flight, which the step would undo)."""
        row = int(self.gen.integers(self.rows))
        if row == self.pad or row in self.emb.working_rows.tolist():
            return
        value = torch.from_numpy(self.gen.standard_normal(DIM).astype(np.float32)).to(self.device)
        if self.bf16:
            value = value.bfloat16().float()
        write(row, value)
        with torch.no_grad():
            self.ref[row] = value

    def _snapshot(self):
        return (copy.deepcopy(self.opt.state_dict()), self.ref.detach().clone(),
                copy.deepcopy(self.ref_opt.state_dict()))

    def _restore(self, snapshot):
        opt_state, ref, ref_opt_state = snapshot
        self.opt.load_state_dict(copy.deepcopy(opt_state))
        with torch.no_grad():
            self.ref.copy_(ref)
        self.ref_opt.load_state_dict(copy.deepcopy(ref_opt_state))

    def init_state(self):
        self.emb.init_state()
        for name, value in self.ref_opt.state.get(self.ref, {}).items():
            if torch.is_tensor(value) and value.shape == self.ref.shape:
                value.fill_(self.initial(name))

    # ------------------------------------------------------------ a step
    def within_step(self, step, ids):
        """One call between a forward of the step (of ``ids``) and the next forward or the optimizer step."""
        op = str(self.gen.choice(["prefetch_own", "prefetch", "no_grad", "eval_then_prefetch", "init_state",
                                  "view", "drop_view", "write_view", "too_many", "bad_id", "bad_prefetch",
                                  "empty"]))
        if op == "prefetch_own":  # rows of the step in flight, and others
            self.emb.prefetch(torch.cat([ids, self.ids(3, self.rows)]))
        elif op == "prefetch":
            self.emb.prefetch(self.ids(int(self.gen.integers(1, 10)), self.rows))
        elif op in ("no_grad", "eval_then_prefetch"):
            read = self.ids(5, self.rows)
            self.read(read, op != "no_grad", f"{op} within step {step}")
            if op != "no_grad":
                self.emb.prefetch(read)
        elif op == "init_state":
            self.init_state()
        elif op == "view":  # the table's own view is refused mid-step with a cache; the state's is not
            self.view = self.emb.get_extra_state()["tables"]["table"]  # the rows before the step
            self.check_view(f"a view within step {step}")
            self._write_view()
        elif op == "drop_view":
            self.view = None
        elif op == "write_view":
            self._write_view()
        elif op == "too_many" and self.max_rows < self.rows:
            with pytest.raises(ss.CapacityError):
                self.emb(torch.arange(self.rows, device=self.device))
        elif op == "bad_id":
            with pytest.raises(ss.IdError):
                self.emb(torch.tensor([0, self.rows], device=self.device))
        elif op == "bad_prefetch":
            with pytest.raises(ss.IdError):
                self.emb.prefetch(torch.tensor([1, self.rows + 3], device=self.device))
        elif op == "empty":
            self.emb(torch.empty(0, dtype=torch.int64, device=self.device))  # no backward reaches it

    def _loss(self, rows):
        return (torch.tanh(rows) @ self.ctx).sum() + 0.3 * (rows @ self.ctx).sum()

    def step(self, step):
        """Up to three forwards (within the working set's capacity), then how the step ends."""
        end = str(self.gen.choice(["step", "step", "step", "discard", "clip", "no_backward"]))
        used = []
        for _ in range(int(self.gen.integers(1, 4))):
            ids = self.ids(int(self.gen.integers(1, 6)), max(1, self.max_rows // 2))
            distinct = set(torch.cat(used + [ids]).tolist()) | ({self.pad} - {None})
            if len(distinct) > self.max_rows:
                break
            used.append(ids)
            out = self.emb(ids)
            if end != "no_backward":
                self._loss(out).backward()
                self._loss(F.embedding(ids, self.ref, padding_idx=self.pad, sparse=self.sparse,
                                       scale_grad_by_freq=self.by_freq)).backward()
            for _ in range(int(self.gen.integers(0, 3))):
                self.within_step(step, ids)
        if not used:
            return
        if end == "discard":
            self.emb.discard_step()
            self.opt.zero_grad()
            self.ref_opt.zero_grad()
            return
        if end == "clip":
            torch.nn.utils.clip_grad_norm_(self.emb.parameters(), 0.5)
            grad = self.ref.grad.coalesce() if self.ref.grad.is_sparse else self.ref.grad
            norm = (grad.values() if grad.is_sparse else grad).norm()
            self.ref.grad.mul_(torch.clamp(0.5 / (norm + 1e-6), max=1.0))  # clip_grad_norm_'s factor
        # A fresh optimizer's first step creates the state instead of reading it (plain SGD keeps none).
        state_read = bool(self.opt.state.get(self.emb.weight)) or not self.emb._state.tables
        rows = self.emb.working_rows.clone()
        self.opt.step()
        trained = self.emb.weight.detach()[:len(rows)].clone()  # float32, before the table's rounding
        self.opt.zero_grad()
        self._reference_step(torch.cat(used) if end != "no_backward" else None, rows, trained, step)
        # Without a backward torch skips the weight: the state goes back only if it was read.
        self.check_counters(step, state_read, state_written=state_read or end != "no_backward")

    def _reference_step(self, touched_ids, rows, trained, step):
        """Step the reference as the offloaded step of ``rows`` did (``trained``: their float32 values)."""
        step_reference(self.ref, self.ref_opt, touched_ids if self.lazy else None)
        self.ref_opt.zero_grad()
        if self.bf16:
            self._round_reference(rows, trained, step)

    def _round_reference(self, rows, trained, step):
        """Round the reference to bfloat16, as the table holds every row, the step's as the offloaded ones round.

        Both sides step in float32 by other operations (a dense step against a sparse one), so a
        stepped row may differ by a float32 ulp: where it lies on a bfloat16 rounding tie, the two
        round to neighbouring bfloat16 values, and the row (and its state) would train apart from
        there on. Once the step's float32 rows agree, either rounding is right: the reference takes
        the offloaded rows' rounding, by torch (round to nearest even), which the table must then hold.
        """
        np.testing.assert_allclose(trained.cpu().numpy(), self.ref.detach()[rows].cpu().numpy(), **SEQ_TOL,
                                   err_msg=f"the float32 rows of step {step}")
        with torch.no_grad():
            self.ref.copy_(self.ref.bfloat16().float())
            self.ref[rows] = trained.bfloat16().float()

    def check_counters(self, step, state_read, state_written):
        """The step's counters agree with each other and with the bytes of what they say moved.

        Args:
            step: the step's number, for the message.
            state_read: whether the step read its rows' state (else torch created it, or there is none).
            state_written: whether the step wrote its rows' state.
        """
        last = self.emb.stats()["last_step"]
        row_bytes = DIM * (2 if self.bf16 else 4)
        with_state = row_bytes + DIM * 4 * len(self.emb._state.tables)
        assert last["hits"] + last["misses"] == last["unique_rows"], (step, last)
        if state_written:
            assert last["bytes_d2h"] == last["rows_d2h"] * with_state, (step, last)
        else:  # the step's rows go back without state, rows a prefetch evicted with theirs
            state_bytes = last["bytes_d2h"] - last["rows_d2h"] * row_bytes
            assert 0 <= state_bytes <= last["rows_d2h"] * (with_state - row_bytes), (step, last)
            assert state_bytes % (with_state - row_bytes or 1) == 0, (step, last)
        if state_read:
            assert last["bytes_h2d"] == last["rows_h2d"] * with_state, (step, last)


def run_sequences(make_pair, rng, kind, backend, monkeypatch):
    """:data:`SEQUENCES` seeded sequences of :data:`STEPS` steps with calls around them, checked all along.

    Args:
        make_pair: :class:`Pair` or :class:`SwitcherPair`.
        rng: the test's generator, which draws each sequence's seed (named on failure).
        kind: the pair's optimizer kind.
        backend: the backend's name.
        monkeypatch: the test's, to land the numpy backend's host writes late.
    """
    land_host_writes_late(monkeypatch)  # the numpy backend's: a GPU's own are late already
    for seed in rng.integers(0, 2**31, SEQUENCES):
        gen = np.random.default_rng(seed)
        pair = make_pair(gen, kind, ss.get_backend(backend).device, backend)
        try:
            for step in range(STEPS):
                if pair.view is not None and gen.random() < 0.3:  # while one lives the cache keeps no row
                    pair.check_view(f"a view kept until step {step}")
                    pair.view = None
                for _ in range(int(gen.integers(0, 3))):
                    pair.between_steps(step)
                pair.step(step)
                if gen.random() < 0.1:
                    pair.check_tables(f"after step {step}")
            pair.check_view("a view kept to the end")
            pair.check_tables("at the end")
        except AssertionError as exc:
            raise AssertionError(f"sequence seed {seed}") from exc
        finally:
            pair.close()


# A kept view keeps the cache from caching, which it says once per embedding: meant here.
@pytest.mark.filterwarnings("ignore:a view of the table")
@pytest.mark.parametrize("kind", sorted(KINDS) + ["element_wise"])
def test_random_sequences_of_calls_around_the_cache_train_as_in_memory(kind, rng, backend, monkeypatch):
    run_sequences(Pair, rng, kind, backend, monkeypatch)


# ------------------------------------------------------------------ through the switchers

#: name: (optimizer, reference optimizer, reference gradient sparse, reference lazy); plain SGD
#: may train with a ModelFactory alone (a cache without state).
SWITCHER_KINDS = {**KINDS, "sgd_momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False, True)}


class SwitcherPair:
    """A ModelFactory (and OptimizerFactory) sharing a cache, and the in-memory reference.

    Args:
        gen: the sequence's numpy generator.
        kind: a key of :data:`SWITCHER_KINDS`.
        device: the backend's device.
        backend: the backend's name.
    """

    def __init__(self, gen, kind, device, backend):
        self.gen, self.device, self.backend = gen, device, backend
        self.rows, self.capacity = int(gen.choice([12, 30])), int(gen.choice([4, 6, 10]))
        self.cache_rows = int(gen.choice([1, 2, 3, 8, self.rows]))
        self.make, self.make_ref, self.sparse, self.lazy = SWITCHER_KINDS[kind]
        table0 = torch.from_numpy(gen.standard_normal((self.rows, DIM)).astype(np.float32))
        self.model = torch.nn.ModuleDict({"u": torch.nn.Embedding(self.capacity, DIM)}).to(device)
        self.opt = self.make(self.model.parameters())
        # Pinned host memory: a view to write through, on a GPU too (CPUPinn=False keeps the table
        # in GPU memory there, whose to_numpy() is a read-only copy).
        self.u = ss.ModelFactory(self.model["u"], total_classes=self.rows, embed_dimension=DIM, CPUPinn=True,
                                 backend=backend, cache_rows=self.cache_rows)
        self.u.customInit(lambda t: t.copy_(table0.to(t.device)))
        self.o = None
        if kind != "sgd" or gen.random() < 0.5:
            self._new_optimizer_switch()
        self.ref = torch.nn.Parameter(table0.to(device))
        self.ref_opt = self.make_ref([self.ref])
        self.ctx = torch.from_numpy(gen.standard_normal(DIM).astype(np.float32)).to(device)
        self.tmp = tempfile.TemporaryDirectory()
        self.saved, self.view = [], None

    def _new_optimizer_switch(self):
        self.o = ss.OptimizerFactory(self.opt, self.rows, DIM, self.model, "u", backend=self.backend,
                                     cache_rows=self.cache_rows)
        self.o.optInit()

    def close(self):
        self.view = None
        self.u.close()
        if self.o is not None:
            self.o.close()
        self.tmp.cleanup()

    def ids(self, count, pool):
        return draw_ids(self.gen, self.rows, count, pool, self.device)

    def initial(self, name):
        return torch_initial(name, self.ref_opt.param_groups[0])

    def check_tables(self, what):
        """The table and state tables (both flushed: they keep their rows cached) against the reference's."""
        np.testing.assert_allclose(self.u.to_numpy(copy=True), self.ref.detach().cpu().numpy(), **SEQ_TOL,
                                   err_msg=what)
        if self.o is None:
            return
        state = self.ref_opt.state.get(self.ref, {})
        for name, table in self.o.state.tables.items():
            got = table.to_numpy(copy=True)
            expected = state[name].cpu().numpy() if name in state else np.full_like(got, self.initial(name))
            np.testing.assert_allclose(got, expected, **SEQ_TOL, err_msg=f"{what}: {name}")

    def check_view(self, what):
        if self.view is not None:
            np.testing.assert_allclose(self.view, self.ref.detach().cpu().numpy(), **SEQ_TOL, err_msg=what)

    def between_steps(self, step):
        op = str(self.gen.choice(["prefetch", "save", "load", "read", "view", "drop_view", "init_state",
                                  "flush", "new_optimizer_switch"]))
        if op == "prefetch":
            self.u.prefetch(self.ids(int(self.gen.integers(1, 8)), self.rows))
        elif op == "save":
            k = len(self.saved)
            self.u.save(f"{self.tmp.name}/table{k}.npy")
            if self.o is not None:
                self.o.save(f"{self.tmp.name}/state{k}")
            self.saved.append((k, copy.deepcopy(self.opt.state_dict()), self.ref.detach().clone(),
                               copy.deepcopy(self.ref_opt.state_dict())))
        elif op == "load" and self.saved:
            k, opt_state, ref, ref_opt_state = self.saved[int(self.gen.integers(len(self.saved)))]
            self.u.load(f"{self.tmp.name}/table{k}.npy")
            if self.o is not None:
                self.o.load(f"{self.tmp.name}/state{k}")
            self.opt.load_state_dict(copy.deepcopy(opt_state))
            with torch.no_grad():
                self.ref.copy_(ref)
            self.ref_opt.load_state_dict(copy.deepcopy(ref_opt_state))
        elif op == "read":
            self.check_tables(f"tables before step {step}")
        elif op == "view":
            self.view = self.u.to_numpy()
            self.check_view(f"a new view before step {step}")
            if self.gen.random() < 0.7:  # a write through it trains on
                row = int(self.gen.integers(self.rows))
                value = self.gen.standard_normal(DIM).astype(np.float32)
                self.view[row] = value
                with torch.no_grad():
                    self.ref[row] = torch.from_numpy(value).to(self.device)
        elif op == "drop_view":
            self.check_view(f"a view kept until step {step}")
            self.view = None
        elif op == "init_state" and self.o is not None:
            self.o.init_state()
            for name, value in self.ref_opt.state.get(self.ref, {}).items():
                if torch.is_tensor(value) and value.shape == self.ref.shape:
                    value.fill_(self.initial(name))
        elif op == "flush":
            self.u.flush()
        elif op == "new_optimizer_switch" and self.o is not None:  # over the cached dirty rows
            self.opt = self.make(self.model.parameters())
            self._new_optimizer_switch()
            self.ref_opt = self.make_ref([self.ref])
            self.saved.clear()

    def _loss(self, rows):
        return (torch.tanh(rows) @ self.ctx).sum()

    def step(self, step):
        """before_forward on each switcher (random order), forward, backward, step, after_step on each."""
        count = int(self.gen.integers(1, self.capacity // 2 + 1))
        pos = self.ids(count, self.capacity)
        neg = self.ids(count, self.capacity) if self.gen.random() < 0.5 else None
        touched = pos if neg is None else torch.cat([pos, neg])
        if len(set(touched.tolist())) > self.capacity:
            return
        switches = [self.u] + ([] if self.o is None else [self.o])
        following = self.ids(int(self.gen.integers(1, 8)), self.rows)
        for k in self.gen.permutation(len(switches)):
            local = switches[k].before_forward(pos, neg)
            if switches[k] is self.u:
                local_pos, local_neg = (local, None) if neg is None else local
            if self.gen.random() < 0.3:  # between the switchers' before_forward: the step's own rows too
                self.u.prefetch(torch.cat([pos, following]) if self.gen.random() < 0.5 else following)
        emb = self.model["u"]
        if self.gen.random() < 0.8:
            loss, ref_loss = self._loss(emb(local_pos)), self._loss(F.embedding(pos, self.ref, sparse=self.sparse))
            if neg is not None:
                loss = loss - 0.3 * self._loss(emb(local_neg))
                ref_loss = ref_loss - 0.3 * self._loss(F.embedding(neg, self.ref, sparse=self.sparse))
            loss.backward()
            ref_loss.backward()
            if self.gen.random() < 0.3:
                self.u.prefetch(following)
            self.opt.step()
            step_reference(self.ref, self.ref_opt, touched if self.lazy else None)
        self.opt.zero_grad()
        self.ref_opt.zero_grad()
        for k in self.gen.permutation(len(switches)):
            switches[k].after_step(pos, neg)
            if self.gen.random() < 0.3:  # between the switchers' after_step
                self.u.prefetch(following)



@pytest.mark.filterwarnings("ignore:a view of the table")
@pytest.mark.parametrize("kind", sorted(SWITCHER_KINDS))
def test_random_sequences_of_calls_around_the_switchers_cache_train_as_in_memory(kind, rng, backend,
                                                                                  monkeypatch):
    """As above, through a ModelFactory and OptimizerFactory sharing one cache: prefetches between
    their before_forward calls and between their after_step calls, in either order, saves and
    loads of both, views kept and written through, optInit, and a new OptimizerFactory."""
    run_sequences(SwitcherPair, rng, kind, backend, monkeypatch)
