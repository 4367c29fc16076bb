"""SpeedTorch-style switchers, from a second review: a step whose ``optimizer.step()`` raised.

Each test trains on a fresh random table with Zipf-distributed ids and
compares with the same switchers trained without the failure.
"""

import contextlib
import gc

import numpy as np
import pytest
import torch

import speedswap as ss
from training_helpers import failing_after_its_update

ROWS, DIM, CAPACITY, BATCH, STEPS = 120, 5, 40, 20, 24


def _armable(opt):
    """``opt``, with the flag the failing step hooks below raise at (once each time it is set)."""
    opt.armed = False
    return opt


def _scribble(opt):
    """A step pre-hook registered after the switchers: changes the step's rows and state in place, then raises."""
    def hook(optimizer, args, kwargs):
        if not optimizer.armed:
            return
        optimizer.armed = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.add_(1.5)
                    for value in optimizer.state.get(p, {}).values():
                        if isinstance(value, torch.Tensor) and value.dim() == 2:
                            value.add_(0.25)
        raise RuntimeError("injected failure in a step pre-hook")
    return opt.register_step_pre_hook(hook)


def _refuse(opt):
    """A step pre-hook registered after the switchers that raises and changes nothing."""
    def hook(optimizer, args, kwargs):
        if optimizer.armed:
            optimizer.armed = False
            raise RuntimeError("injected failure in a step pre-hook")
    return opt.register_step_pre_hook(hook)


_OPTIMIZERS = {
    "sgd_momentum": lambda params: _armable(torch.optim.SGD(params, lr=0.05, momentum=0.9)),
    "adam": lambda params: _armable(torch.optim.Adam(params, lr=0.02)),
}


def _train(backend, rng_seed, make_opt, cache_rows, fail, table0):
    """Train the switchers; ``fail`` ("none", "refuse", "scribble", "optimizer") makes some steps raise once."""
    rng = np.random.default_rng(rng_seed)
    device = ss.get_backend(backend).device
    p = 1.0 / np.arange(1, ROWS + 1) ** 1.1
    perm = rng.permutation(ROWS)
    batches = [torch.from_numpy(perm[rng.choice(ROWS, BATCH, p=p / p.sum())]).to(device)
               for _ in range(STEPS + 1)]
    ctx = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    model = torch.nn.ModuleDict({"u": emb})
    opt = make_opt(model.parameters())
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend=backend, cache_rows=cache_rows)
    if fail == "scribble":
        _scribble(opt)
    elif fail == "refuse":
        _refuse(opt)
    for step in range(STEPS):
        ids = batches[step]
        local = u.before_forward(ids)
        o.before_forward(ids)
        ((emb(local) * ctx).sum() + emb(local).pow(2).sum()).backward()
        if fail != "none" and step % 3 == 1:
            opt.armed = True
            inside = failing_after_its_update(opt) if fail == "optimizer" else contextlib.nullcontext()
            with inside, pytest.raises(RuntimeError, match="injected failure"):
                opt.step()
            if cache_rows:
                u.prefetch(batches[step + 1])  # between the failure and the retry
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
    return u.getNumpyVersion(), {name: t.to_numpy(copy=True) for name, t in o.state.tables.items()}


@pytest.mark.parametrize("cache_rows", [0, 15, ROWS])
@pytest.mark.parametrize("opt_name,fail", [("sgd_momentum", "refuse"), ("adam", "refuse"),
                                           ("sgd_momentum", "scribble"), ("adam", "scribble"),
                                           ("sgd_momentum", "optimizer"), ("adam", "optimizer")])
def test_a_step_retried_after_optimizer_step_raised_trains_as_one_that_never_failed(
        backend, seed, opt_name, fail, cache_rows):
    """The switchers' optimizer.step() retried after one that raised failed with torch's 'The size of
    tensor a (40) must match the size of tensor b (k)': the step's state rows were never gathered
    again, and rows or state the failed step had changed in place would have been trained twice. A
    step whose Adam raised after counting it was counted twice: its bias correction ran a step ahead."""
    table0 = np.random.default_rng(seed).standard_normal((ROWS, DIM), dtype=np.float32)
    make = _OPTIMIZERS[opt_name]
    want_table, want_state = _train(backend, seed, make, cache_rows, "none", table0)
    got_table, got_state = _train(backend, seed, make, cache_rows, fail, table0)
    assert not np.array_equal(got_table, table0)
    np.testing.assert_array_equal(got_table, want_table)
    assert sorted(got_state) == sorted(want_state) and got_state
    for name in want_state:
        np.testing.assert_array_equal(got_state[name], want_state[name])


def _zipf_problem(seed, backend):
    """A fresh problem: ``(rng, device, table0, STEPS batches of Zipf ids, ctx)``."""
    rng = np.random.default_rng(seed)
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    p = 1.0 / np.arange(1, ROWS + 1) ** 1.1
    perm = rng.permutation(ROWS)
    batches = [torch.from_numpy(perm[rng.choice(ROWS, BATCH, p=p / p.sum())]).to(device) for _ in range(STEPS)]
    ctx = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
    return rng, device, table0, batches, ctx


@pytest.mark.parametrize("end", ["close", "collect"])
def test_ending_the_optimizer_factory_after_a_step_that_raised_gives_the_model_its_full_embedding(backend, seed,
                                                                                                   end):
    """OptimizerFactory.close() after an optimizer.step() that raised left the model's embedding
    narrowed to that step's rows: the ModelFactory's next before_forward resized the narrowed
    storage and the forward raised torch's 'index out of range in self'. A factory dropped and
    collected instead of closed left it narrowed too."""
    rng, device, table0, batches, ctx = _zipf_problem(seed, backend)
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    model = torch.nn.ModuleDict({"u": emb})
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend=backend)
    opt.armed = True
    _refuse(opt)
    ids = batches[0]
    local = u.before_forward(ids)
    o.before_forward(ids)
    (emb(local) * ctx).sum().backward()
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    if end == "close":
        o.close()  # abandons the step: its rows are not written back
    else:
        del o
        gc.collect()
    assert emb.weight.shape == (CAPACITY, DIM)
    assert all(v.shape == emb.weight.shape for v in opt.state[emb.weight].values() if v.dim() == 2)

    # The ModelFactory trains on with a stateless optimizer, as an in-memory embedding does.
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False).to(device)
    sgd, ref_sgd = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    sgd.zero_grad()
    for ids in batches[1:]:
        local = u.before_forward(ids)
        (emb(local) * ctx).sum().backward()
        sgd.step()
        sgd.zero_grad()
        u.after_step(ids)
        (ref(ids) * ctx).sum().backward()
        ref_sgd.step()
        ref_sgd.zero_grad()
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_rows", [0, 30])
def test_a_write_through_a_kept_model_factory_table_is_kept_and_one_mid_step_is_refused(backend, seed, cache_rows):
    """``table = u.table`` kept from the start. Between before_forward and after_step a write into
    it was overwritten by the step's rows (4.1 from in-memory SGD): it is refused, nothing changes.
    Between steps, with a cache, the cache wrote its rows back over it at eviction: it is kept."""
    rng, device, table0, batches, ctx = _zipf_problem(seed, backend)
    new_rows = torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    table = u.table
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    written = STEPS // 2
    for step, ids in enumerate(batches):
        local = u.before_forward(ids)
        (emb(local) * ctx).sum().backward()
        if step == written:
            before = table.owner_copy()  # the table's memory: mid-step its reads are refused too
            with pytest.raises(ss.StateError, match="undone by afterOptimizerStep"):
                table.scatter(torch.arange(ROWS), new_rows)
            np.testing.assert_array_equal(table.owner_copy(), before)
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        (ref(ids) * ctx).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == written:
            table.scatter(torch.arange(ROWS), new_rows)
            with torch.no_grad():
                ref.weight.copy_(new_rows)
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)


def test_kept_switcher_tables_are_written_and_read_as_in_memory(backend, seed):
    """``u.table`` and ``o.state.tables["momentum_buffer"]`` kept from the start, the state written
    between steps: with a device cache, the cache wrote its state rows back over the write at
    eviction (3.2 from in-memory SGD with momentum), and reads through the kept references missed
    the rows and state the cache held."""
    from test_training_flows import LazyTable, make_lazy
    rng, device, table0, batches, ctx = _zipf_problem(seed, backend)
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    model = torch.nn.ModuleDict({"u": emb})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend, cache_rows=30)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend=backend, cache_rows=30)
    table, momentum = u.table, o.state.tables["momentum_buffer"]
    ref = LazyTable(table0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    make_lazy(ref_opt, ref)
    for step, ids in enumerate(batches):
        local = u.before_forward(ids)
        o.before_forward(ids)
        (emb(local) * ctx).sum().backward()
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
        (ref(ids.cpu()) * ctx.cpu()).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == STEPS // 2:
            momentum.apply_(torch.Tensor.mul_, -0.5)
            with torch.no_grad():
                ref_opt.state[ref.weight]["momentum_buffer"].mul_(-0.5)
    # Read through the kept references too: the cache gives its rows and state back first.
    np.testing.assert_allclose(table.to_numpy(copy=True), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(momentum.to_numpy(copy=True), ref_opt.state[ref.weight]["momentum_buffer"].numpy(),
                               rtol=1e-5, atol=1e-6)
