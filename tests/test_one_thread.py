"""One thread at a time: a call while another thread is inside a call or a step's span raises.

Before, an evaluation thread's lookups while the training thread was inside
``optimizer.step()`` put an OffloadedEmbedding's step rows back under the
optimizer: SGD and Adam failed with a size mismatch (512 against 151 rows),
or the update was lost. The SpeedTorch-style switchers and the sharded
embedding were not covered: an evaluation thread's ``before_forward`` lookups
cleared the working set under the training thread's step (71 of 300 rows
trained wrong in 60 steps, or ``before_forward`` raised "called twice" on the
training thread), its ``getNumpyVersion()`` loop flushed the device cache
under the step (24 rows wrong), and a ``ShardedOffloadedEmbedding.save()`` loop
dropped steps whose backward was running (21 rows wrong). Calls from several
threads one after another work.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import numpy as np
import pytest
import torch

import speedswap as ss

NUM_ROWS, DIM, IDS, LR = 300, 6, 40, 0.1


def _zipf_ids(rng):
    p = 1.0 / np.arange(1, NUM_ROWS + 1)
    return torch.from_numpy(rng.permutation(NUM_ROWS)[rng.choice(NUM_ROWS, size=IDS, p=p / p.sum())])


def _loss(rows, ids):
    return ((rows - ids.unsqueeze(1).float() / NUM_ROWS) ** 2).sum()


class _Trained:
    """One of speedswap's ways to train a table, and what another thread may call on it.

    ``spans_forward``: whether a training step holds the claim from its first
    lookup (not only between the optimizer's step hooks).
    """

    spans_forward = True

    def step(self, ids, before_step=lambda: None, retried=lambda call: call()):
        """One training step of ``ids`` (each call through ``retried``); ``before_step()`` runs before the step."""
        device = self.opt.param_groups[0]["params"][0].device
        ids = ids.to(device)
        _loss(retried(lambda: self.lookup(ids)), ids).backward()
        before_step()
        retried(self.opt.step)
        self.opt.zero_grad()
        retried(lambda: self.finish(ids))

    def finish(self, ids):
        """What ends a step after ``optimizer.step()``."""


class _Offloaded(_Trained):
    """An OffloadedEmbedding: the claim spans the step's hooks only."""

    spans_forward = False

    def __init__(self, rows, backend, cache_rows):
        self.emb = self.build(backend, cache_rows)
        self.emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rows)))
        self.opt = torch.optim.SGD(self.emb.parameters(), lr=LR)
        self.emb.attach(self.opt)

    @staticmethod
    def build(backend, cache_rows):
        return ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=IDS, cache_rows=cache_rows, backend=backend)

    def lookup(self, ids):
        return self.emb(ids)

    def rows(self):
        return self.emb.table.to_numpy()

    def evaluate(self, ids, path):
        _no_grad(self.emb, ids)
        self.emb.table.to_numpy()

    def calls(self, other, path):
        calls = {"training forward": lambda: self.emb(other),
                 "eval forward": lambda: _no_grad(self.emb, other),
                 "table read": lambda: self.emb.table.to_numpy(),
                 "flush": self.emb.flush,
                 "discard_step": self.emb.discard_step,
                 "save": lambda: self.emb.save(path / "ck.h5"),
                 "optimizer.step()": self.opt.step}
        if self.emb.cache_rows:
            calls["prefetch"] = lambda: self.emb.prefetch(other)
        return calls


class _Switchers(_Trained):
    """A ModelFactory and an OptimizerFactory over a model's nn.Embedding: one claim for the pair."""

    def __init__(self, rows, backend, cache_rows):
        self.emb = torch.nn.Embedding(IDS, DIM).to(ss.get_backend(backend).device)
        model = torch.nn.ModuleDict({"u_embeddings": self.emb})
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.model_switch = ss.ModelFactory(self.emb, NUM_ROWS, DIM, backend=backend, cache_rows=cache_rows)
        self.model_switch.customInit(lambda t: t.copy_(torch.from_numpy(rows)))
        self.opt_switch = ss.OptimizerFactory(self.opt, NUM_ROWS, DIM, model, "u_embeddings", backend=backend,
                                              cache_rows=cache_rows)

    def lookup(self, ids):
        local = self.model_switch.beforeForwardPass(ids)
        self.opt_switch.beforeForwardPass(ids)
        return self.emb(local)

    def finish(self, ids):
        self.model_switch.afterOptimizerStep(ids)
        self.opt_switch.afterOptimizerStep(ids)

    def rows(self):
        return self.model_switch.getNumpyVersion()

    def evaluate(self, ids, path):
        local = self.model_switch.before_forward(ids[:IDS])  # SpeedTorch's lookup: a step without a backward
        try:
            _no_grad(self.emb, local)
        finally:
            self.model_switch.after_step(ids[:IDS])
        self.model_switch.getNumpyVersion()

    def calls(self, other, path):
        model_switch, opt_switch = self.model_switch, self.opt_switch
        return {"ModelFactory.before_forward": lambda: model_switch.before_forward(other),
                "OptimizerFactory.before_forward": lambda: opt_switch.before_forward(other),
                "after_step": lambda: model_switch.after_step(other),
                "getNumpyVersion": model_switch.getNumpyVersion,
                "OptimizerFactory.getNumpyVersion": opt_switch.getNumpyVersion,
                "table": lambda: model_switch.table,
                "state": lambda: opt_switch.state,
                "flush": model_switch.flush,
                "prefetch": lambda: model_switch.prefetch(other),
                "init": lambda: model_switch.uniformDistributionInit(-1, 1),
                "saveCupy": lambda: model_switch.saveCupy(path / "table.npy"),
                "OptimizerFactory.save": lambda: opt_switch.save(path / "state.h5"),
                "optimizer.step()": self.opt.step,
                "ModelFactory.close": model_switch.close,
                "OptimizerFactory.close": opt_switch.close}


class _Sharded(_Offloaded):
    """A ShardedOffloadedEmbedding in one process (one rank): the claim spans a training forward to the step."""

    spans_forward = True

    @staticmethod
    def build(backend, cache_rows):
        assert not cache_rows  # it has no cache
        return ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=IDS, storage="pageable", backend=backend)

    def evaluate(self, ids, path):
        _no_grad(self.emb, ids)
        self.emb.save(path / "ck")

    def calls(self, other, path):
        emb = self.emb
        return {"training forward": lambda: emb(other),
                "eval forward": lambda: _no_grad(emb, other),
                "discard_step": emb.discard_step,
                "exchange_gradients": emb.exchange_gradients,
                "grad_norm": emb.grad_norm,
                "state_dict": emb.state_dict,
                "table write": lambda: emb.table.apply_(torch.nn.init.zeros_),
                "save": lambda: emb.save(path / "ck"),
                "load": lambda: emb.load(path / "ck"),
                "attach": lambda: emb.attach(self.opt),
                "optimizer.step()": self.opt.step,
                "close": emb.close,
                # As activation checkpointing's recompute runs, inside this thread's own backward
                # (a custom backward runs with gradients off: an eval forward).
                "training forward inside a backward": lambda: _in_backward(lambda: emb(other), grad=True),
                "eval forward inside a backward": lambda: _in_backward(lambda: emb(other), grad=False)}


class _Reference:
    """The same table trained in memory: nn.Embedding and the same torch optimizer."""

    def __init__(self, rows):
        self.emb = torch.nn.Embedding(NUM_ROWS, DIM)
        self.emb.weight.data.copy_(torch.from_numpy(rows))
        self.opt = torch.optim.SGD(self.emb.parameters(), lr=LR)

    def step(self, ids):
        _loss(self.emb(ids), ids).backward()
        self.opt.step()
        self.opt.zero_grad()

    def rows(self):
        return self.emb.weight.detach().numpy()


KINDS = [pytest.param(_Offloaded, 0, id="OffloadedEmbedding"),
         pytest.param(_Offloaded, 60, id="OffloadedEmbedding-cached"),
         pytest.param(_Switchers, 0, id="switchers"),
         pytest.param(_Switchers, 60, id="switchers-cached"),
         pytest.param(_Sharded, 0, id="ShardedOffloadedEmbedding")]


#: Where the training thread waits while another makes its calls: inside the step, and, where the step's
#: claim spans its lookups too, between the backward and the step.
PAUSES = [pytest.param(*kind.values, where, id=f"{kind.id}-{where}") for kind in KINDS
          for where in ("inside optimizer.step()", "before optimizer.step()")
          if where == "inside optimizer.step()" or kind.values[0].spans_forward]


def _pair(rng, kind, backend, cache_rows):
    rows = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    return kind(rows, backend, cache_rows), _Reference(rows)


def _others_refused_while(stepping, inside, go, trained, other, tmp_path):
    """Start ``stepping``, a thread that sets ``inside`` and waits for ``go`` mid-step; meanwhile each of
    ``trained``'s calls from this thread (on ids ``other``) must raise StateError and leave it stepping."""
    stepping.start()
    try:
        assert inside.wait(60)
        other = other.to(trained.opt.param_groups[0]["params"][0].device)
        for what, call in trained.calls(other, tmp_path).items():
            with pytest.raises(ss.StateError, match="another thread"):
                call()
            assert stepping.is_alive(), what
    finally:
        go.set()
        stepping.join(60)


@pytest.mark.parametrize("kind, cache_rows, where", PAUSES)
def test_calls_from_another_thread_inside_a_step_are_refused_and_change_nothing(backend, rng, kind, cache_rows,
                                                                                  where, tmp_path):
    trained, reference = _pair(rng, kind, backend, cache_rows)
    for _ in range(4):
        ids = _zipf_ids(rng)
        trained.step(ids)
        reference.step(ids)
    inside, go = threading.Event(), threading.Event()

    def pause(*_):
        inside.set()
        assert go.wait(60)
    # Registered after the embedding's (or switcher's) own pre-hook: it runs once the step's rows are narrowed.
    hook = trained.opt.register_step_pre_hook(pause) if where == "inside optimizer.step()" else None
    ids, raised = _zipf_ids(rng), []
    stepping = threading.Thread(target=lambda: raised.extend(_raised(lambda: trained.step(
        ids, before_step=pause if hook is None else lambda: None))))
    _others_refused_while(stepping, inside, go, trained, _zipf_ids(rng), tmp_path)
    if hook is not None:
        hook.remove()
    assert raised == []
    assert list(tmp_path.iterdir()) == []  # no save wrote anything
    reference.step(ids)
    for _ in range(4):  # this thread trains on where the other left off
        ids = _zipf_ids(rng)
        trained.step(ids)
        reference.step(ids)
    np.testing.assert_allclose(trained.rows(), reference.rows(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, cache_rows", KINDS)
def test_training_beside_an_evaluation_thread_trains_as_in_memory(backend, rng, kind, cache_rows, tmp_path):
    """Whatever the interleaving, each call runs whole or is refused whole: retrying refused ones trains exactly."""
    trained, reference = _pair(rng, kind, backend, cache_rows)
    done, outcomes = threading.Event(), {"evaluated": 0, "refused": 0, "other": []}

    def evaluate():
        draws = np.random.default_rng(int(rng.integers(2**31)))
        while not done.is_set():
            try:
                trained.evaluate(torch.from_numpy(draws.integers(0, NUM_ROWS, 500)), tmp_path)
                outcomes["evaluated"] += 1
            except Exception as exc:  # noqa: BLE001 -- anything but a refusal fails the test
                if isinstance(exc, ss.StateError) and "another thread" in str(exc):
                    outcomes["refused"] += 1
                else:
                    outcomes["other"].append(exc)

    evaluator = threading.Thread(target=evaluate)
    evaluator.start()
    try:
        for _ in range(60):
            ids = _zipf_ids(rng)
            trained.step(ids, retried=_retried)
            reference.step(ids)
    finally:
        done.set()
        evaluator.join(60)
    assert outcomes["other"] == [] and outcomes["evaluated"] > 0
    np.testing.assert_allclose(trained.rows(), reference.rows(), rtol=1e-6, atol=1e-6)


def _refused_here(call):
    """Whether ``call()`` on this thread is refused because another thread holds the embedding."""
    try:
        call()
    except ss.StateError as exc:
        if "another thread" in str(exc):
            return True
        raise
    return False


def _failing_step(opt):
    """``opt.step()`` raising inside the step, once the embedding's hook narrowed its rows."""
    def fail(*_):
        raise RuntimeError("a failure inside optimizer.step()")
    hook = opt.register_step_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="inside optimizer.step"):
            opt.step()
    finally:
        hook.remove()


def test_the_switchers_claim_ends_exactly_with_the_step_on_every_path(backend, rng):
    """Refused calls, a step that raised and a switcher closed mid-step: held while the step is unfinished only."""
    trained, reference = _pair(rng, _Switchers, backend, 0)
    model_switch, opt_switch = trained.model_switch, trained.opt_switch
    device = trained.emb.weight.device
    ids, other = _zipf_ids(rng).to(device), _zipf_ids(rng).to(device)
    with ThreadPoolExecutor(1) as training:  # one thread, which each step below runs on
        def on_training(call):
            return training.submit(call).result()

        with pytest.raises(ss.IdError):
            on_training(lambda: model_switch.before_forward(torch.tensor([NUM_ROWS])))
        assert not _refused_here(model_switch.getNumpyVersion)  # refused ids began no step
        local = on_training(lambda: model_switch.before_forward(ids))
        assert _refused_here(model_switch.getNumpyVersion)
        with pytest.raises(ss.StateError, match="while the model switcher"):
            on_training(lambda: opt_switch.before_forward(other))  # refused: the step's are other ids
        assert _refused_here(opt_switch.getNumpyVersion)
        on_training(lambda: opt_switch.before_forward(ids))
        on_training(lambda: _loss(trained.emb(local), ids).backward())
        on_training(lambda: _failing_step(trained.opt))
        assert _refused_here(model_switch.getNumpyVersion)  # the failed step's rows are still in flight
        on_training(trained.opt.step)
        trained.opt.zero_grad()
        on_training(lambda: model_switch.after_step(ids))
        assert _refused_here(model_switch.getNumpyVersion)  # the OptimizerFactory's part is unfinished
        on_training(lambda: opt_switch.after_step(ids))
        reference.step(ids.cpu())
        np.testing.assert_allclose(model_switch.getNumpyVersion(), reference.rows(), rtol=1e-6, atol=1e-6)
        on_training(lambda: trained.lookup(other))
        assert _refused_here(opt_switch.getNumpyVersion)
        on_training(model_switch.close)  # abandons the step
        assert not _refused_here(opt_switch.getNumpyVersion)


def test_the_sharded_claim_ends_exactly_with_the_step_on_every_path(backend, rng):
    """A refused forward, one that failed after its messages, discard_step and steps that raised: held from a
    training forward (or a step's pre-hook) to the step's end only."""
    trained, reference = _pair(rng, _Sharded, backend, 0)
    emb, opt = trained.emb, trained.opt
    ids = _zipf_ids(rng).to(emb.weight.device)
    with ThreadPoolExecutor(1) as training:
        def on_training(call):
            return training.submit(call).result()

        with pytest.raises(ss.IdError):
            on_training(lambda: emb(torch.tensor([NUM_ROWS])))
        assert not _refused_here(emb.state_dict)  # a refused forward began no step
        with pytest.raises(MemoryError), mock.patch("torch.nn.functional.embedding",
                                                    side_effect=MemoryError("making its output")):
            on_training(lambda: emb(ids))
        assert _refused_here(emb.state_dict)  # its rows are in the step, waiting for its retry (below)
        on_training(lambda: _loss(emb(ids), ids).backward())
        assert _refused_here(emb.state_dict)
        on_training(emb.discard_step)
        assert not _refused_here(emb.state_dict)
        on_training(lambda: _loss(emb(ids), ids).backward())
        on_training(lambda: _failing_step(opt))
        assert _refused_here(emb.state_dict)  # the failed step's rows are still in flight
        on_training(opt.step)
        assert not _refused_here(emb.state_dict)
        opt.zero_grad()
        on_training(lambda: _failing_step(opt))  # a step without a forward, raising between its hooks
        assert _refused_here(emb.state_dict)
        on_training(opt.step)  # its next step ends it
        assert not _refused_here(emb.state_dict)
    reference.step(ids.cpu())
    np.testing.assert_allclose(trained.rows(), reference.rows(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, cache_rows", KINDS)
def test_a_step_without_a_forward_is_its_threads_between_the_hooks(backend, rng, kind, cache_rows, tmp_path):
    """A step with no forward (a step of the other layers, on the zero gradient zero_grad(set_to_none=False)
    left) held no claim between its hooks: another thread's training forward there was let in. A sharded
    step's end took that forward's rows for rows it had stepped, raising "in use on another thread" on the
    stepping thread after the optimizer ran; an OffloadedEmbedding's optimizer stepped the rows that forward
    gathered into the scratch (Adam moved them by its momentum: trained wrong, silently); the switchers'
    before_forward put its rows' state under the step (Adam: torch's "The size of tensor a (11) must match
    the size of tensor b (12)"). Now every call of another thread is refused there, and the step ends as in
    memory."""
    trained, reference = _pair(rng, kind, backend, cache_rows)
    opt = trained.opt
    for _ in range(3):
        ids = _zipf_ids(rng)
        trained.step(ids)
        reference.step(ids)
    ids = _zipf_ids(rng).to(opt.param_groups[0]["params"][0].device)
    _loss(trained.lookup(ids), ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)  # weight keeps a zero gradient: the next step steps it, with no rows
    trained.finish(ids)
    reference.step(ids.cpu())
    inside, go = threading.Event(), threading.Event()

    def pause(*_):
        inside.set()
        assert go.wait(60)
    hook = opt.register_step_pre_hook(pause)  # after the embedding's: between its hooks
    raised = []
    stepping = threading.Thread(target=lambda: raised.extend(_raised(opt.step)))
    _others_refused_while(stepping, inside, go, trained, _zipf_ids(rng), tmp_path)
    hook.remove()
    assert raised == []
    assert list(tmp_path.iterdir()) == []
    assert not _refused_here(lambda: trained.evaluate(_zipf_ids(rng), tmp_path))  # the claim ended with the step
    opt.zero_grad()
    for _ in range(4):
        ids = _zipf_ids(rng)
        trained.step(ids)
        reference.step(ids)
    np.testing.assert_allclose(trained.rows(), reference.rows(), rtol=1e-6, atol=1e-6)


def _retried(call):
    """``call()``, again for as long as another thread's call refuses it."""
    while True:
        try:
            return call()
        except ss.StateError as exc:
            if "another thread" not in str(exc):
                raise
        # A retry at once held the GIL against the thread it waits for: the evaluator beside 60 steps
        # ran 240-1,750 calls in 15-124 s; pausing a millisecond, 1,867-15,962 in 6-16 s.
        time.sleep(0.001)


def _no_grad(emb, ids):
    with torch.no_grad():
        return emb(ids)


def _in_backward(call, grad):
    """``call()`` inside a backward on this thread, with gradients on (``grad``) or off."""
    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, out_grad):
            with torch.set_grad_enabled(grad):
                call()
            return out_grad
    Backward.apply(torch.ones(1, requires_grad=True)).sum().backward()


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 -- handed to the test's thread
        return [exc]
    return []
