"""SpeedTorch-style switchers, from a third review: what reads and conversions see mid-step.

Each test trains on a fresh random table with Zipf-distributed ids and
compares with an ``nn.Embedding`` holding the whole table in memory.
"""

import numpy as np
import pytest
import torch

import speedswap as ss

ROWS, DIM, CAPACITY, BATCH, STEPS = 80, 5, 40, 24, 12


def _zipf_ids(rng, device):
    p = 1.0 / np.arange(1, ROWS + 1) ** 1.1
    return torch.from_numpy(rng.permutation(ROWS)[rng.choice(ROWS, BATCH, p=p / p.sum())]).to(device)


@pytest.mark.parametrize("cache_rows", [0, 10])
def test_get_numpy_version_between_step_and_after_step_holds_the_stepped_rows(backend, rng, cache_rows):
    """It returned the rows as before optimizer.step(): the step's rows were still in the embedding's slots."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    opt = torch.optim.SGD(emb.parameters(), lr=0.3)
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    reference = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0).to(device), freeze=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3)  # plain SGD: lazy equals dense
    for _ in range(STEPS):
        ids = _zipf_ids(rng, device)
        weights = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
        (emb(u.before_forward(ids)) * weights).sum().backward()
        opt.step()
        opt.zero_grad()
        (reference(ids) * weights).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected = reference.weight.detach().cpu().numpy()
        np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(u.to_numpy(copy=True), expected, rtol=1e-6, atol=1e-6)
        u.after_step(ids)
        np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-6, atol=1e-6)


def _adagrad_switched(backend, rng, cache_rows):
    """A switched embedding of a random table with Adagrad, and the same table in memory with
    sparse Adagrad (which offloaded Adagrad equals): ``device, emb, opt, u, o, reference, ref_opt``."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    model = torch.nn.ModuleDict({"u": emb})
    opt = torch.optim.Adagrad(model.parameters(), lr=0.3)
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend=backend, cache_rows=cache_rows)
    reference = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0).to(device), freeze=False,
                                                   sparse=True)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.3)
    return device, emb, opt, u, o, reference, ref_opt


def _step_before_after_step(rng, device, emb, opt, u, o, reference, ref_opt):
    """One step on fresh Zipf ids and random loss weights, of the switched embedding (``u``, ``o``)
    and of its in-memory ``reference``, stopped between ``optimizer.step()`` and ``after_step``.

    Returns:
        the step's ids, for the ``after_step`` calls, and their local ids in the working set.
    """
    ids = _zipf_ids(rng, device)
    weights = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
    local = u.before_forward(ids)
    (emb(local) * weights).sum().backward()
    o.before_forward(ids)
    opt.step()
    opt.zero_grad()
    (reference(ids) * weights).sum().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return ids, local


@pytest.mark.parametrize("cache_rows", [0, 10])
def test_tables_handed_out_mid_step_are_refused_without_a_cache_too(backend, rng, cache_rows):
    """Without a cache, u.table, getTorchVar(), to_numpy() and o.state handed out the host tables
    between optimizer.step() and after_step, which hold the step's rows and state as before the
    step: reads showed them stale. With a cache they were refused; now both are. The refusal says
    where the rows and their state are read instead, and that is what memory holds. The table is
    in device memory (CPUPinn=False), so to_numpy() hands out no view but a read-only copy, which
    holds the step's rows as memory does, as getNumpyVersion() does."""
    device, emb, opt, u, o, reference, ref_opt = _adagrad_switched(backend, rng, cache_rows)
    for _ in range(STEPS):
        ids, local = _step_before_after_step(rng, device, emb, opt, u, o, reference, ref_opt)
        copy = u.to_numpy()
        np.testing.assert_allclose(copy, reference.weight.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
        assert not copy.flags.writeable
        for name, call in (("table", lambda: u.table), ("getTorchVar", u.getTorchVar),
                           ("state", lambda: o.state)):
            with pytest.raises(ss.StateError, match="before afterOptimizerStep") as refused:
                call()
            # The ways to the rows and their state now: a copy of the table, and the optimizer's
            # state at the local ids. Each holds what the in-memory reference does.
            assert "getNumpyVersion() copies the table" in str(refused.value)
            assert "optimizer.state[weight][name] at the local ids" in str(refused.value)
        np.testing.assert_allclose(u.getNumpyVersion(), reference.weight.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(opt.state[emb.weight]["sum"][local].cpu().numpy(),
                                   ref_opt.state[reference.weight]["sum"][ids].cpu().numpy(), rtol=1e-5, atol=1e-6)
        u.after_step(ids)
        o.after_step(ids)
        np.testing.assert_allclose(u.getNumpyVersion(), reference.weight.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(o.state.tables["sum"].to_numpy(copy=True),
                                   ref_opt.state[reference.weight]["sum"].cpu().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_rows", [0, 10])
def test_reads_through_tables_kept_from_between_steps_are_refused_mid_step(backend, rng, tmp_path, cache_rows):
    """A table kept from between steps (u.table, o.state.tables) bypassed the mid-step refusal:
    gather, to_numpy(copy=True) and save between optimizer.step() and after_step read the step's
    rows and state as before the step, silently. They are refused, nothing written, as u.table is."""
    device, emb, opt, u, o, reference, ref_opt = _adagrad_switched(backend, rng, cache_rows)
    kept = {"table": u.table, **o.state.tables}  # kept between steps, read mid-step
    for step in range(STEPS):
        ids, _ = _step_before_after_step(rng, device, emb, opt, u, o, reference, ref_opt)
        for name, table in kept.items():
            path = tmp_path / f"{name}-{step}.npy"
            for read in (lambda: table.gather(ids), lambda: table.to_numpy(copy=True),
                         lambda: table.save(path)):
                with pytest.raises(ss.StateError, match="before afterOptimizerStep"):
                    read()
            assert not path.exists()
        u.after_step(ids)
        o.after_step(ids)
        expected = {"table": reference.weight.detach(), "sum": ref_opt.state[reference.weight]["sum"]}
        for name, table in kept.items():  # between steps the kept tables read every row as trained
            np.testing.assert_allclose(table.to_numpy(copy=True), expected[name].cpu().numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(table.gather(ids).cpu().numpy(), expected[name][ids].cpu().numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("model_first", [True, False], ids=["model first", "optimizer first"])
@pytest.mark.parametrize("cache_rows", [0, 10])
def test_views_kept_from_between_steps_show_the_step_once_the_model_factorys_after_step_wrote_it(
        backend, rng, cache_rows, model_first):
    """What README and the docstrings say of a kept view, which no read through it can be refused:
    from optimizer.step() until ModelFactory.after_step it shows the step's rows and state as before
    the step, as in memory before and after that window."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = torch.nn.Embedding(CAPACITY, DIM).to(device)
    model = torch.nn.ModuleDict({"u": emb})
    opt = torch.optim.Adagrad(model.parameters(), lr=0.3)
    u = ss.ModelFactory(emb, ROWS, DIM, CPUPinn=True, backend=backend, cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", CPUPinn=True, backend=backend, cache_rows=cache_rows)
    reference = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0).to(device), freeze=False,
                                                   sparse=True)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.3)
    rows = {"to_numpy()": u.to_numpy(), "getTorchVar()": u.getTorchVar(),
            "table.to_numpy()": u.table.to_numpy(), "table.as_tensor()": u.table.as_tensor()}
    state = o.state.tables["sum"].to_numpy()

    def assert_views(weight, sums, when):
        for name, view in rows.items():
            np.testing.assert_allclose(np.asarray(view), weight, rtol=1e-5, atol=1e-6, err_msg=f"{name} {when}")
        np.testing.assert_allclose(state, sums, rtol=1e-5, atol=1e-6, err_msg=f"state {when}")

    def in_memory():
        sums = ref_opt.state[reference.weight]["sum"] if ref_opt.state else torch.zeros(ROWS, DIM)
        return reference.weight.detach().cpu().numpy().copy(), sums.cpu().numpy().copy()

    for _ in range(4):
        ids = _zipf_ids(rng, device)
        weights = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
        local = u.before_forward(ids)
        o.before_forward(ids)
        (emb(local) * weights).sum().backward()
        (reference(ids) * weights).sum().backward()
        before = in_memory()
        assert_views(*before, "before optimizer.step()")
        opt.step()
        ref_opt.step()
        assert_views(*before, "after optimizer.step()")
        first, second = (u, o) if model_first else (o, u)
        first.after_step(ids)
        assert_views(*(in_memory() if model_first else before), f"after {type(first).__name__}.after_step")
        second.after_step(ids)
        assert_views(*in_memory(), f"after {type(second).__name__}.after_step")
        opt.zero_grad()
        ref_opt.zero_grad()
