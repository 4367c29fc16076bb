"""A second optimizer whose param groups hold an attached embedding's weight is refused at its step.

``emb.attach(sparse_adam)`` beside ``torch.optim.Adam(model.parameters())`` for the
dense layers: the second optimizer holds ``emb.weight`` too, and its ``step()``
would train the working-set scratch (whose slots hold other rows every step)
with per-slot state of its own. The step is refused before anything changes;
an optimizer of the other parameters only trains exactly like in memory.

The models, Zipf batches and lazy in-memory reference are those of
``test_training_flows``.
"""

import copy
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from churn import churning
from rendezvous import rendezvous_url
from speedswap.errors import OptionError
from test_training_flows import (BATCH, DIM, ROWS, WIDTH, LazyTable, Model, assert_equal_to_reference,
                                 make_lazy, pair, zipf_ids)
from training_helpers import run_in_memory, run_switchers, zipf_batches

REFUSED = "attach this optimizer instead"


def make_attached(p):
    return torch.optim.Adam(p, lr=0.01)


def make_dense(p):
    return torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)


def two_optimizers(rng):
    """An offloaded model, its embedding attached to Adam and its linear layer in SGD; and the reference."""
    offloaded, reference = pair(rng)
    opt1, opt2 = make_attached(offloaded.emb.parameters()), make_dense(offloaded.lin.parameters())
    offloaded.emb.attach(opt1)
    ref1, ref2 = make_attached(reference.emb.parameters()), make_dense(reference.lin.parameters())
    make_lazy(ref1, reference.emb)
    return (offloaded, opt1, opt2), (reference, ref1, ref2)


def backward(model, ids, target):
    F.mse_loss(model(ids), target).backward()


def step_both(opt1, opt2, dense_first=False):
    for opt in ((opt2, opt1) if dense_first else (opt1, opt2)):
        opt.step()
    opt1.zero_grad()
    opt2.zero_grad()


def snapshot(model, opt1, opt2):
    """Everything a refused step must leave alone: rows, row state, weight and its grad, dense layer, opt2."""
    emb = model.emb
    grad = emb.weight.grad
    return {"table": emb.table.to_numpy(copy=True),
            "state": {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()},
            "weight": emb.weight.detach().clone(), "weight_shape": tuple(emb.weight.shape),
            "grad": None if grad is None else grad.clone(),
            "lin": [p.detach().clone() for p in model.lin.parameters()],
            "opt1": copy.deepcopy(opt1.state_dict()), "opt2": copy.deepcopy(opt2.state_dict())}


def assert_same(a, b):
    np.testing.assert_array_equal(a["table"], b["table"])
    assert a["state"].keys() == b["state"].keys()
    for name in a["state"]:
        np.testing.assert_array_equal(a["state"][name], b["state"][name], err_msg=name)
    assert a["weight_shape"] == b["weight_shape"]
    torch.testing.assert_close(a["weight"], b["weight"], rtol=0, atol=0)
    assert (a["grad"] is None) == (b["grad"] is None)
    if a["grad"] is not None:
        torch.testing.assert_close(a["grad"], b["grad"], rtol=0, atol=0)
    for x, y in zip(a["lin"], b["lin"]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for key in ("opt1", "opt2"):
        torch.testing.assert_close(a[key]["state"], b[key]["state"], rtol=0, atol=0)


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_second_optimizer_holding_the_weight_is_refused_and_changes_nothing(rng, when):
    """Its step after (or before) the attached one's raises; the run then equals the reference."""
    (offloaded, opt1, opt2), (reference, ref1, ref2) = two_optimizers(rng)
    batches = zipf_ids(rng, 10)
    for ids, target in batches[:4]:  # opt2 has momentum state for the linear layer by now
        for model, a, b in ((offloaded, opt1, opt2), (reference, ref1, ref2)):
            backward(model, ids, target)
            step_both(a, b)
    opt2.add_param_group({"params": [offloaded.emb.weight]})  # the mistake
    for ids, target in batches[4:6]:
        backward(offloaded, ids, target)
        if when == "after":
            opt1.step()
        before = snapshot(offloaded, opt1, opt2)
        with pytest.raises(OptionError, match=REFUSED):
            opt2.step()
        assert_same(snapshot(offloaded, opt1, opt2), before)
        # The user's loop stops here; the test goes on as if the weight were never in opt2.
        del opt2.param_groups[-1]
        if when == "before":
            opt1.step()
        opt2.step()
        opt1.zero_grad()
        opt2.zero_grad()
        opt2.add_param_group({"params": [offloaded.emb.weight]})
        backward(reference, ids, target)
        step_both(ref1, ref2)
    del opt2.param_groups[-1]
    for ids, target in batches[6:]:
        for model, a, b in ((offloaded, opt1, opt2), (reference, ref1, ref2)):
            backward(model, ids, target)
            step_both(a, b)
    assert_equal_to_reference(offloaded, opt1, reference, ref1)


def test_adam_of_all_model_parameters_beside_an_attached_sparse_adam_is_refused_at_its_first_step(rng):
    """The mistake as users write it: the dense optimizer is built from model.parameters()."""
    offloaded, _ = pair(rng)
    sparse_adam = torch.optim.SparseAdam(offloaded.emb.parameters(), lr=0.01)
    adam = torch.optim.Adam(offloaded.parameters(), lr=0.01)
    offloaded.emb.attach(sparse_adam)
    (ids, target), = zipf_ids(rng, 1)
    backward(offloaded, ids, target)
    sparse_adam.step()
    before = snapshot(offloaded, sparse_adam, adam)
    with pytest.raises(OptionError, match="SparseAdam"):
        adam.step()
    assert_same(snapshot(offloaded, sparse_adam, adam), before)
    assert not adam.state  # the linear layer did not move either


def test_a_dense_optimizer_over_several_tables_is_refused_naming_all_of_them(rng):
    """A click model has a table per feature. The refusal named "the weight of the
    OffloadedEmbedding" and suggested excluding emb.weight: following it for one table led to the
    same refusal for the next. It now counts them and shows how to leave every table out."""
    tables = [ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH, backend="numpy") for _ in range(3)]
    model = torch.nn.ModuleDict({f"t{i}": t for i, t in enumerate(tables)} | {"mlp": torch.nn.Linear(DIM, 1)})
    adagrad = torch.optim.Adagrad([t.weight for t in tables])
    for t in tables:
        t.attach(adagrad)
    adam = torch.optim.Adam(model.parameters())
    with pytest.raises(OptionError, match=r"the weights of 3 embeddings \(OffloadedEmbedding, \.\.\.\) "
                       r"attached to other optimizers \(Adagrad\).*if all\(p is not emb.weight for emb in "
                       r"tables\)"):
        adam.step()
    # The suggestion, followed, trains.
    adam = torch.optim.Adam([p for p in model.parameters() if all(p is not emb.weight for emb in tables)])
    for t in tables:
        t(torch.from_numpy(rng.integers(0, ROWS, 7))).sum().backward()
    adagrad.step()
    adam.step()


@pytest.mark.parametrize("how", ["no_backward_yet", "after_zero_grad", "closure"])
def test_a_trainable_weight_is_refused_without_a_gradient_too(rng, how):
    """Documented: refused whatever its gradient now, so the step order cannot hide the mistake."""
    offloaded, _ = pair(rng)
    opt1 = make_attached(offloaded.emb.parameters())
    opt2 = make_dense(offloaded.parameters())
    offloaded.emb.attach(opt1)
    (ids, target), = zipf_ids(rng, 1)
    if how == "after_zero_grad":
        backward(offloaded, ids, target)
        opt1.step()
        opt1.zero_grad()
    assert offloaded.emb.weight.grad is None
    before = snapshot(offloaded, opt1, opt2)
    closure_ran = []

    def closure():
        closure_ran.append(True)
        opt2.zero_grad()
        loss = F.mse_loss(offloaded(ids), target)
        loss.backward()
        return loss

    with pytest.raises(OptionError, match=REFUSED):
        opt2.step(closure) if how == "closure" else opt2.step()
    assert not closure_ran
    assert_same(snapshot(offloaded, opt1, opt2), before)


def test_a_frozen_weight_may_stay_in_the_second_optimizer(rng):
    """requires_grad=False and no gradient: torch skips it, so the step goes on; the rows stay."""
    offloaded, reference = pair(rng)
    for model in (offloaded, reference):
        model.emb.weight.requires_grad_(False)
    opt1, opt2 = make_attached(offloaded.emb.parameters()), make_dense(offloaded.parameters())
    offloaded.emb.attach(opt1)
    ref2 = make_dense(reference.lin.parameters())
    table0 = offloaded.emb.table.to_numpy(copy=True)
    for step, (ids, target) in enumerate(zipf_ids(rng, 6)):
        backward(offloaded, ids, target)
        step_both(opt1, opt2, dense_first=step % 2 == 0)
        backward(reference, ids, target)
        ref2.step()
        ref2.zero_grad()
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table0)
    for mine, ref in zip(offloaded.lin.parameters(), reference.lin.parameters()):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)
    # A gradient left on it (frozen after a backward) would be stepped: refused again.
    offloaded.emb.weight.grad = torch.ones_like(offloaded.emb.weight)
    with pytest.raises(OptionError, match=REFUSED):
        opt2.step()


def test_zero_grad_of_the_second_optimizer_is_not_refused(rng):
    offloaded, _ = pair(rng)
    opt1, opt2 = make_attached(offloaded.emb.parameters()), make_dense(offloaded.parameters())
    offloaded.emb.attach(opt1)
    (ids, target), = zipf_ids(rng, 1)
    backward(offloaded, ids, target)
    opt1.step()
    opt2.zero_grad(set_to_none=False)
    assert not offloaded.emb.weight.grad.any()
    opt2.zero_grad()
    assert offloaded.emb.weight.grad is None
    backward(offloaded, ids, target)  # training goes on
    opt1.step()


def test_re_attaching_moves_the_weight_to_the_new_optimizer(rng):
    offloaded, reference = pair(rng)
    first, second = make_attached(offloaded.parameters()), make_attached(offloaded.parameters())
    offloaded.emb.attach(first)
    offloaded.emb.attach(second)
    ref_opt = make_attached(reference.parameters())
    make_lazy(ref_opt, reference.emb)
    for step, (ids, target) in enumerate(zipf_ids(rng, 8)):
        backward(offloaded, ids, target)
        if step in (0, 5):
            before = snapshot(offloaded, first, second)
            with pytest.raises(OptionError, match=r"attached to another optimizer \(Adam\)"):
                first.step()
            assert_same(snapshot(offloaded, first, second), before)
        second.step()
        second.zero_grad()
        backward(reference, ids, target)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_equal_to_reference(offloaded, second, reference, ref_opt)


@pytest.mark.parametrize("how", ["close", "collect"])
def test_a_closed_or_collected_embedding_no_longer_refuses_other_optimizers(rng, how):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH * WIDTH, storage="pageable", backend="numpy")
    weight = emb.weight
    opt1, opt2 = make_attached([weight]), make_dense([weight])
    emb.attach(opt1)
    weight.grad = torch.from_numpy(rng.standard_normal(tuple(weight.shape), dtype=np.float32))
    with pytest.raises(OptionError, match=REFUSED):
        opt2.step()
    if how == "close":
        emb.close()
    else:
        del emb
        gc.collect()
    opt2.step()  # opt1 keeps the weight alive; nothing refuses a plain parameter
    assert opt2.state[weight]


def test_two_optimizers_of_disjoint_parameters_train_exactly_like_in_memory(rng):
    """The legitimate setup, steps in either order, with a closure and with step-level zero_grads."""
    (offloaded, opt1, opt2), (reference, ref1, ref2) = two_optimizers(rng)
    for step, (ids, target) in enumerate(zipf_ids(rng, 25)):
        for model, a, b in ((offloaded, opt1, opt2), (reference, ref1, ref2)):
            if step % 5 == 4:
                def closure(model=model, a=a, b=b):
                    a.zero_grad()
                    b.zero_grad()
                    loss = F.mse_loss(model(ids), target)
                    loss.backward()
                    return loss
                a.step(closure)
                b.step()
                a.zero_grad()
                b.zero_grad()
                continue
            backward(model, ids, target)
            step_both(a, b, dense_first=step % 2 == 1)
    assert_equal_to_reference(offloaded, opt1, reference, ref1)


def test_switchers_train_as_before_while_an_attached_embedding_claims_its_weight(rng):
    """The global hook looks at attached weights only: an optimizer inside the switchers is unaffected."""
    offloaded, _ = pair(rng)
    offloaded.emb.attach(make_attached(offloaded.parameters()))
    table0 = rng.standard_normal((400, 8)).astype(np.float32)
    batches = zipf_batches(rng, 20, torch.device("cpu"))
    make = lambda p: torch.optim.Adagrad(p, lr=0.1)  # noqa: E731
    table, state = run_switchers(make, table0, batches, "numpy")
    ref_table, ref_state = run_in_memory(make, table0, batches, torch.device("cpu"), sparse=True)
    np.testing.assert_allclose(table, ref_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["sum"], ref_state["sum"], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- sharded
def sharded_pair(rng):
    """A one-rank sharded model (no process group) and its reference, from the same rows."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    linear = torch.nn.Linear(DIM, 1)
    emb = ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=2 * BATCH * WIDTH, storage="pageable",
                                       backend="numpy")
    emb.table.scatter(torch.arange(ROWS), torch.from_numpy(table0))
    return Model(emb, copy.deepcopy(linear)), Model(LazyTable(table0), linear)


def sharded_snapshot(model, opt2):
    emb = model.emb
    return (emb.table.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()},
            emb.weight.detach().clone(), None if emb.weight.grad is None else emb.weight.grad.clone(),
            [p.detach().clone() for p in model.lin.parameters()], copy.deepcopy(opt2.state_dict()["state"]))


@pytest.mark.parametrize("when", ["after", "before"])
def test_one_rank_sharded_embedding_refuses_a_second_optimizer_holding_its_weight(rng, when):
    offloaded, reference = sharded_pair(rng)
    opt1 = make_attached(offloaded.emb.parameters())
    opt2 = make_dense(offloaded.parameters())  # the mistake: it holds emb.weight too
    offloaded.emb.attach(opt1)
    ref1, ref2 = make_attached(reference.emb.parameters()), make_dense(reference.lin.parameters())
    make_lazy(ref1, reference.emb)
    for ids, target in zipf_ids(rng, 6):
        backward(offloaded, ids, target)
        if when == "after":
            opt1.step()
        before = sharded_snapshot(offloaded, opt2)
        with pytest.raises(OptionError, match=REFUSED):
            opt2.step()
        torch.testing.assert_close(sharded_snapshot(offloaded, opt2), before, rtol=0, atol=0)
        if when == "before":
            opt1.step()
        weight_group = opt2.param_groups[0]["params"]
        opt2.param_groups[0]["params"] = [p for p in weight_group if p is not offloaded.emb.weight]
        opt2.step()
        opt2.param_groups[0]["params"] = weight_group
        opt1.zero_grad()
        opt2.zero_grad()
        backward(reference, ids, target)
        step_both(ref1, ref2)
    np.testing.assert_allclose(offloaded.emb.table.to_numpy(), reference.emb.weight.detach().numpy(),
                               rtol=1e-6, atol=1e-6)
    for name, table in offloaded.emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), ref1.state[reference.emb.weight][name].numpy(),
                                   rtol=1e-6, atol=1e-6, err_msg=name)
    for mine, ref in zip(offloaded.lin.parameters(), reference.lin.parameters()):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)


_TWO_RANKS = """
import datetime, os, sys, numpy as np, torch, torch.distributed as dist, speedswap as ss
rank, rendezvous, out, seed = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
dist.init_process_group('gloo', init_method=rendezvous, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(seed)  # every rank alike, as DDP code seeds them
emb = ss.ShardedOffloadedEmbedding(50, 4, max_rows=8, backend='numpy', storage='pageable')
lin = torch.nn.Linear(4, 1)
model = torch.nn.ModuleList([emb, lin])
opt1 = torch.optim.Adam(emb.parameters(), lr=0.01)
opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # holds emb.weight too
emb.attach(opt1)
rng = np.random.default_rng([seed, rank])
refused = 0
for step in range(4):
    # the second rank looks up nothing at step 2: no gradient on its weight, refused all the same
    ids = torch.from_numpy(rng.integers(0, 50, size=0 if (rank, step) == (1, 2) else 6))
    lin(emb(ids)).square().sum().backward()
    for opt in ((opt2, opt1) if step % 2 else (opt1, opt2)):
        rows = emb.table.to_numpy(copy=True)
        try:
            opt.step()
        except ss.OptionError:
            refused += 1
            assert np.array_equal(emb.table.to_numpy(), rows)
    opt1.zero_grad()
    opt2.zero_grad()
np.save(f'{out}/refused{rank}.npy', np.array(refused))
# Every result is written: end without the interpreter's teardown, where gloo's threads can
# abort the process ("terminate called without an active exception"; see
# examples/_distributed.finish).
dist.barrier()
sys.stderr.flush()
os._exit(0)
"""


def test_two_ranks_refuse_the_second_optimizer_alike_and_train_on(tmp_path, seed):
    """Refused on each rank before any collective, whatever each rank's gradient: no rank hangs."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    rendezvous = rendezvous_url(tmp_path)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), rendezvous, str(tmp_path), str(seed)],
                              env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
    assert [int(np.load(tmp_path / f"refused{r}.npy")) for r in range(2)] == [4, 4]


def test_a_claim_withdrawn_while_another_optimizer_checks_the_claims_does_not_break_its_step():
    """Any optimizer's step() looked through every claim while a thread (or a finalizer run by a
    garbage collection in the middle of the loop) withdrew one: 'dictionary changed size during
    iteration', raised from inside an unrelated optimizer's step."""
    from speedswap.train import one_optimizer

    other = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)

    class Owner:
        pass

    weights = [torch.nn.Parameter(torch.randn(1)) for _ in range(2000)]
    owners = [Owner() for _ in weights]
    claims = [one_optimizer.claim(o, w, other) for o, w in zip(owners, weights)]

    def reclaim(i):
        k = i % len(claims)
        claims[k].remove()
        claims[k] = one_optimizer.claim(owners[k], weights[k], other)

    try:
        with churning(reclaim):
            for _ in range(100):
                other.step()  # the claims are this optimizer's own: nothing to refuse
    finally:
        for claim_ in claims:
            claim_.remove()
