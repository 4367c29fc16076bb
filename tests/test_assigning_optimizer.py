"""Optimizers whose step() assigns new tensors (``p.data = ...``, ``state[name] = ...``) instead of updating in place.

The offloaded parameter is narrowed to the step's rows for ``step()`` and
restored after it; an optimizer that assigns ``p.data`` or a state tensor
hands back other tensors than those it was given. Their values are taken
(training equals in-memory lazy training), or, when they cannot be (a
tensor of another shape), the step is refused before anything is written
back, so that it can be retried or discarded.
"""

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.errors import StateError
from training_helpers import (CAPACITY, DIM, NUM_ROWS, run_in_memory, run_offloaded, run_switchers,
                              skipgram_loss, zipf_batches)

STEPS = 60


class AssigningSGD(torch.optim.SGD):
    """SGD written the way some hand-written optimizers are: ``p.data = p.data - lr * grad``.

    With ``momentum`` it keeps SGD's ``momentum_buffer``, assigned anew each step.
    ``bad`` makes the next step assign a tensor of another shape: ``"weight"``
    or ``"state"``.
    """

    bad = None
    in_place = False  # update p in place (assigning only the state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if group["momentum"]:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    state["momentum_buffer"] = (update.clone() if buf is None
                                                else group["momentum"] * buf + update)
                    if self.bad == "state":
                        state["momentum_buffer"] = torch.cat([state["momentum_buffer"]] * 2)
                    update = state["momentum_buffer"][:len(p)]
                if self.in_place:
                    p.sub_(group["lr"] * update)
                else:
                    p.data = p.data - group["lr"] * update
                if self.bad == "weight":
                    p.data = torch.cat([p.data, p.data[:1]])
        return loss


def make(momentum, in_place=False):
    def build(params):
        opt = AssigningSGD(params, lr=0.05, momentum=momentum)
        opt.in_place = in_place
        return opt
    return build


def lazy_initial(name, group):
    return 0.0  # SGD's momentum buffer of a row no step touched yet


def assert_same(actual, expected):
    table, state = actual
    ref_table, ref_state = expected
    assert set(state) == set(ref_state)
    for name, value, ref in [("table", table, ref_table),
                             *((n, state[n], ref_state[n]) for n in sorted(state))]:
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("momentum, in_place", [(0.0, False), (0.9, False), (0.9, True)],
                         ids=["weight", "weight and state", "state"])
@pytest.mark.parametrize("cache_rows", [0, 64])
def test_an_offloaded_embedding_trains_with_an_assigning_optimizer_as_in_memory(rng, momentum, in_place,
                                                                                cache_rows):
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")
    expected = run_in_memory(make(momentum, in_place), table0, batches, "cpu", initial_state=lazy_initial)
    assert not np.allclose(expected[0], table0)
    actual = run_offloaded(make(momentum, in_place), table0, batches, "numpy", cache_rows=cache_rows,
                           replay_at=STEPS // 2)
    assert_same(actual, expected)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("cache_rows", [0, 64])
def test_speedtorch_switchers_train_with_an_assigning_optimizer_as_in_memory(rng, momentum, cache_rows):
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")
    expected = run_in_memory(make(momentum), table0, batches, "cpu", initial_state=lazy_initial)
    actual = run_switchers(make(momentum), table0, batches, "numpy", cache_rows=cache_rows,
                           replay_at=STEPS // 2)
    assert_same(actual, expected)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_one_rank_sharded_embedding_trains_with_an_assigning_optimizer_as_in_memory(rng, momentum):
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")
    expected = run_in_memory(make(momentum), table0, batches, "cpu", initial_state=lazy_initial)
    emb = ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=len(batches[0][0]) * 4,
                                       storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(momentum)(emb.parameters())
    emb.attach(opt)
    for pos, neg, ctx in batches:
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        opt.step()
        opt.zero_grad()
    state = {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()}
    assert_same((emb.table.to_numpy(copy=True), state), expected)


def _snapshot(emb):
    emb.flush()  # the cache's rows too (emb.table would refuse in the middle of a step)
    return (emb._table.to_numpy(copy=True),
            {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()})


@pytest.mark.parametrize("bad", ["weight", "state"])
@pytest.mark.parametrize("cache_rows", [0, 64])
def test_an_assigned_tensor_of_another_shape_is_refused_before_anything_is_written(rng, bad, cache_rows):
    """Refused at the step's end with nothing written back; the step is then retried (or discarded)."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 12, "cpu")
    discarded = 7
    expected = run_in_memory(make(0.9), table0, batches[:discarded] + batches[discarded + 1:], "cpu",
                             initial_state=lazy_initial)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=len(batches[0][0]) * 4, storage="pageable",
                                backend="numpy", cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(0.9)(emb.parameters())
    emb.attach(opt)
    for step, (pos, neg, ctx) in enumerate(batches):
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        if step in (3, discarded):
            before = _snapshot(emb)
            opt.bad = bad
            with pytest.raises(StateError, match="shape"):
                opt.step()
            opt.bad = None
            assert emb.weight.shape == (emb.max_rows, DIM)
            assert emb.weight.data.data_ptr() == emb._full.data_ptr()
            if step == discarded:
                emb.discard_step()
                opt.zero_grad()
                after = _snapshot(emb)
                np.testing.assert_array_equal(after[0], before[0])
                assert set(after[1]) == set(before[1]) == {"momentum_buffer"}
                for name in before[1]:
                    np.testing.assert_array_equal(after[1][name], before[1][name])
                continue
        opt.step()  # at step 3, the retry
        opt.zero_grad()
    assert_same(_snapshot(emb), expected)


@pytest.mark.parametrize("bad", ["weight", "state"])
@pytest.mark.parametrize("cache_rows", [0, 64])
def test_switchers_refuse_an_assigned_tensor_of_another_shape_and_the_dropped_batch_changes_nothing(
        rng, bad, cache_rows):
    """SpeedTorch-style loops drop a batch whose step raised: zero_grad() and after_step write nothing new."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 10, "cpu")
    dropped = 6
    expected = run_in_memory(make(0.9), table0, batches[:dropped] + batches[dropped + 1:], "cpu",
                             initial_state=lazy_initial)
    model = torch.nn.ModuleDict({"u_embeddings": torch.nn.Embedding(CAPACITY, DIM)})
    emb = model["u_embeddings"]
    opt = make(0.9)(model.parameters())
    u = ss.ModelFactory(emb, total_classes=NUM_ROWS, embed_dimension=DIM, backend="numpy",
                        cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, NUM_ROWS, DIM, model, "u_embeddings", backend="numpy",
                            cache_rows=cache_rows)
    o.optInit()

    def snapshot():
        return u.getNumpyVersion(), o.state.tables["momentum_buffer"].to_numpy(copy=True)

    for step, (pos, neg, ctx) in enumerate(batches):
        if step == dropped:
            before = snapshot()
        local_pos, local_neg = u.before_forward(pos, neg)
        o.before_forward(pos, neg)
        skipgram_loss(emb(local_pos), emb(local_neg), ctx).backward()
        if step == dropped:
            opt.bad = bad
            with pytest.raises(StateError, match="shape"):
                opt.step()
            opt.bad = None
            assert emb.weight.shape == (CAPACITY, DIM)
        else:
            opt.step()
        opt.zero_grad()
        u.after_step(pos, neg)
        o.after_step(pos, neg)
        if step == dropped:
            after = snapshot()
            np.testing.assert_array_equal(after[0], before[0])
            np.testing.assert_array_equal(after[1], before[1])
    assert_same((u.getNumpyVersion(), {"momentum_buffer": o.state.tables["momentum_buffer"].to_numpy(copy=True)}),
                expected)


@pytest.mark.parametrize("bad", ["weight", "state"])
def test_a_one_rank_sharded_embedding_refuses_an_assigned_tensor_of_another_shape_and_retries(rng, bad):
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 8, "cpu")
    expected = run_in_memory(make(0.9), table0, batches, "cpu", initial_state=lazy_initial)
    emb = ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(0.9)(emb.parameters())
    emb.attach(opt)
    for step, (pos, neg, ctx) in enumerate(batches):
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        if step == 4:
            before = (emb.table.to_numpy(copy=True), emb._state.tables["momentum_buffer"].to_numpy(copy=True))
            opt.bad = bad
            with pytest.raises(StateError, match="shape"):
                opt.step()
            opt.bad = None
            assert emb.weight.shape == (CAPACITY, DIM)
            np.testing.assert_array_equal(emb.table.to_numpy(), before[0])
            np.testing.assert_array_equal(emb._state.tables["momentum_buffer"].to_numpy(), before[1])
        opt.step()  # at step 4, the retry
        opt.zero_grad()
    state = {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()}
    assert_same((emb.table.to_numpy(copy=True), state), expected)
