"""SpeedTorch-style switchers, from a review: cases the other switcher tests do not reach.

Each test compares against an in-memory ``nn.Embedding`` with the same torch
optimizer, on fresh random tables and Zipf-distributed ids.
"""

import numpy as np
import pytest
import torch

import speedswap as ss

ROWS, DIM, CAPACITY, BATCH = 200, 6, 48, 24


def zipf_ids(rng, steps, device):
    p = 1.0 / np.arange(1, ROWS + 1)
    perm = rng.permutation(ROWS)
    return [torch.from_numpy(perm[rng.choice(ROWS, BATCH, p=p / p.sum())]).to(device)
            for _ in range(steps)]


def test_a_frozen_working_set_builds_and_trains_once_unfrozen(backend, rng):
    """``nn.Embedding.from_pretrained`` freezes its weight; building a switcher over it raised
    torch's 'cannot register a hook on a tensor that doesn't require gradient'."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = torch.nn.Embedding.from_pretrained(torch.zeros(CAPACITY, DIM)).to(device)
    u = ss.ModelFactory(emb, ROWS, DIM, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy())).to(device)
    batches = zipf_ids(rng, 30, device)
    ctx = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
    for ids in batches[:5]:  # frozen: lookups only
        local = u.before_forward(ids)
        torch.testing.assert_close(emb(local), ref(ids), rtol=0, atol=0)
        u.after_step(ids)
    np.testing.assert_array_equal(u.getNumpyVersion(), table0)

    emb.weight.requires_grad_(True)
    ref.weight.requires_grad_(True)
    opt, ref_opt = (torch.optim.SGD(e.parameters(), lr=0.1) for e in (emb, ref))
    for ids in batches[5:]:
        (ref(ids) * ctx).sum().backward(); ref_opt.step(); ref_opt.zero_grad()
        local = u.before_forward(ids)
        (emb(local) * ctx).sum().backward(); opt.step(); opt.zero_grad()
        u.after_step(ids)
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().cpu().numpy(),
                               rtol=1e-5, atol=1e-6)

    # The leftover-gradient check guards the unfrozen parameter too.
    ids = batches[0]
    local = u.before_forward(ids)
    emb(local).sum().backward()
    opt.step()  # no zero_grad(): the next step's backward would add to this gradient
    u.after_step(ids)
    local = u.before_forward(batches[1])
    with pytest.raises(ss.StateError, match="zero_grad"):
        emb(local).sum().backward()


def test_adagrad_rows_start_from_the_constructors_initial_accumulator_value(backend, rng):
    """torch's Adagrad fills ``sum`` with the constructor's ``initial_accumulator_value`` whatever the
    parameter's group says; the switchers filled the group's, and the first step raised a StateError
    blaming an ``optimizer.load_state_dict`` that never happened."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    head0 = rng.standard_normal((DIM, 1), dtype=np.float32)

    def make_opt(head, weight):
        return torch.optim.Adagrad([{"params": [head]},
                                    {"params": [weight], "initial_accumulator_value": 0.7}],
                                   lr=0.1, initial_accumulator_value=0.2)

    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False).to(device)
    ref_head = torch.nn.Parameter(torch.from_numpy(head0.copy()).to(device))
    ref_opt = make_opt(ref_head, ref.weight)

    model = torch.nn.Module()
    model.u_embeddings = torch.nn.Embedding(CAPACITY, DIM).to(device)
    model.head = torch.nn.Parameter(torch.from_numpy(head0.copy()).to(device))
    opt = make_opt(model.head, model.u_embeddings.weight)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend=backend)
    for ids in zipf_ids(rng, 40, device):
        (ref(ids) @ ref_head).tanh().sum().backward(); ref_opt.step(); ref_opt.zero_grad()
        local = u.before_forward(ids)
        o.before_forward(ids)
        (model.u_embeddings(local) @ model.head).tanh().sum().backward(); opt.step(); opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
    # Bit for bit on the CPU; CUDA's embedding backward may split a row's repeated ids into other
    # partial sums for the working set's slots than for the table's rows.
    tol = dict(rtol=0, atol=0) if device.type == "cpu" else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().cpu().numpy(), **tol)
    np.testing.assert_allclose(o.state.tables["sum"].to_numpy(copy=True),
                               ref_opt.state[ref.weight]["sum"].cpu().numpy(), **tol)
    np.testing.assert_allclose(model.head.detach().cpu().numpy(), ref_head.detach().cpu().numpy(), **tol)


def test_another_optimizer_over_the_switched_embedding_is_refused(backend, rng):
    """An optimizer built again over model.parameters() (the OptimizerFactory still switching the
    first one's state) kept Adam moments on the working set's slots: a row stepped with another
    row's moments, 0.07 off an in-memory run after two steps."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model = torch.nn.Module()
    model.u_embeddings = torch.nn.Embedding(CAPACITY, DIM).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend=backend)
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False).to(device)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)

    first, second = zipf_ids(rng, 2, device)
    ref(first).pow(2).sum().backward(); ref_opt.step(); ref_opt.zero_grad()
    local = u.before_forward(first)
    o.before_forward(first)
    model.u_embeddings(local).pow(2).sum().backward(); opt.step(); opt.zero_grad()
    u.after_step(first)
    o.after_step(first)
    # Adam on every row of a whole table moves only rows with a gradient at its first step.
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)

    other = torch.optim.Adam(model.parameters(), lr=0.1)
    local = u.before_forward(second)
    o.before_forward(second)
    model.u_embeddings(local).pow(2).sum().backward()
    with pytest.raises(ss.OptionError, match="OptimizerFactory"):
        other.step()
    assert not other.state  # refused before it changed anything
    opt.step()  # the switched optimizer still may
    opt.zero_grad()
    u.after_step(second)
    o.after_step(second)
    ref(second).pow(2).sum().backward(); ref_opt.step(); ref_opt.zero_grad()
    # Rows of the second step hold the same moments in a dense Adam (zero gradient at step 1 or not).
    touched = second.unique().cpu().numpy()
    np.testing.assert_allclose(u.getNumpyVersion()[touched], ref.weight.detach().cpu().numpy()[touched],
                               rtol=1e-5, atol=1e-6)

    o.close()  # without an OptimizerFactory, a stateless optimizer may step the rows again
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    local = u.before_forward(first)
    model.u_embeddings(local).pow(2).sum().backward(); sgd.step(); sgd.zero_grad()
    u.after_step(first)


def test_an_optimizer_factory_load_of_a_npy_file_names_a_load_not_a_write(tmp_path):
    """loadCupy('opt.npy'), the suffix ModelFactory.saveCupy takes, said 'cannot tell what to write'."""
    model = torch.nn.Module()
    model.u_embeddings = torch.nn.Embedding(CAPACITY, DIM)
    opt = torch.optim.Adam(model.parameters())
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend="numpy")
    np.save(tmp_path / "opt.npy", np.ones((ROWS, DIM), np.float32))
    with pytest.raises(ss.OptionError) as error:
        o.loadCupy(tmp_path / "opt.npy")
    assert "write" not in str(error.value) and "*.h5" in str(error.value)
    with pytest.raises(ss.OptionError, match=r"\*\.h5"):
        o.saveCupy(tmp_path / "opt.npy")


@pytest.mark.parametrize("value", ["False", "True", None, 2, 0.0])
def test_cpupinn_takes_a_bool_not_a_string_that_python_finds_true(value):
    """CPUPinn="False" is true to Python: the table went to pinned memory against the caller's word."""
    with pytest.raises(ss.OptionError, match="CPUPinn is True .* or False"):
        ss.ModelFactory(torch.nn.Embedding(6, 4), 100, 4, CPUPinn=value, backend="numpy")
    with pytest.raises(ss.OptionError, match="CPUPinn is True .* or False"):
        ss.DataGadget(np.zeros((3, 2), np.float32), CPUPinn=value, backend="numpy")
