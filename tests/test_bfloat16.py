"""bfloat16 tables: transport, files, checkpoints, and training with float32 math and state.

A bfloat16 embedding trains like this in-memory reference: float32 weights and
optimizer state; after each step the touched rows are rounded to bfloat16 once.
"""

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss

from training_helpers import CAPACITY, DIM, skipgram_loss, zipf_batches

ROWS = 300


def bf16_rows(rng, shape):
    """Fresh random bfloat16 values (never zeros), and their exact float32 copy."""
    values = torch.from_numpy(rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1, 1], size=shape))
    bf16 = values.to(torch.bfloat16)
    return bf16, bf16.float().numpy()


@pytest.fixture(params=["pinned", "pageable", "mmap", "device"])
def storage(request):
    return request.param


def bf16_table(rng, storage, backend, tmp_path):
    rows, exact = bf16_rows(rng, (ROWS, DIM))
    table = ss.HostTable.empty(ROWS, DIM, "bfloat16", storage, backend,
                               tmp_path / "t.npy" if storage == "mmap" else None)
    table.scatter(np.arange(ROWS), rows.to(table.device))
    return table, exact


def test_gather_scatter_round_trip(backend, storage, rng, tmp_path):
    table, exact = bf16_table(rng, storage, backend, tmp_path)
    assert table.dtype is torch.bfloat16 and table.nbytes == ROWS * DIM * 2
    ids = rng.integers(0, ROWS, size=500)
    got = table.gather(ids)
    assert got.dtype is torch.bfloat16
    np.testing.assert_array_equal(got.float().cpu().numpy(), exact[ids])
    new, new_exact = bf16_rows(rng, (5, DIM))
    rows = rng.choice(ROWS, size=5, replace=False)
    table.scatter(rows, new.to(table.device))
    exact[rows] = new_exact
    np.testing.assert_array_equal(table.gather(np.arange(ROWS)).float().cpu().numpy(), exact)


def test_to_numpy_gives_the_bit_patterns_on_every_storage_kind(backend, storage, rng, tmp_path):
    """numpy has no bfloat16: every kind, a ``device`` table too (no host array, a copy of the
    tensor's rows), gives the rows' uint16 bit patterns."""
    table, exact = bf16_table(rng, storage, backend, tmp_path)
    bits = torch.from_numpy(exact).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for copy in (False, True):
        values = table.to_numpy(copy=copy)
        assert values.dtype == np.uint16
        np.testing.assert_array_equal(values, bits)


@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_save_writes_exact_float32_and_load_restores_bfloat16(backend, storage, suffix, rng, tmp_path):
    table, exact = bf16_table(rng, storage, backend, tmp_path)
    path = tmp_path / f"saved{suffix}"
    table.save(path)
    if suffix == ".npy":
        np.testing.assert_array_equal(np.load(path), exact)  # a plain numpy file
        loaded = ss.HostTable.load(path, storage="pageable", backend=backend)
        assert loaded.dtype is torch.float32  # the file says float32
    else:
        with h5py.File(path) as f:
            assert f["table"].attrs["speedswap_dtype"] == "bfloat16"
            np.testing.assert_array_equal(f["table"][...], exact)
        loaded = ss.HostTable.load(path, storage="pageable", backend=backend)
        assert loaded.dtype is torch.bfloat16  # recorded in the file
    np.testing.assert_array_equal(loaded.gather(np.arange(ROWS)).float().cpu().numpy(), exact)
    other = ss.HostTable.zeros(ROWS, DIM, "bfloat16", "pageable", backend)
    other.load_from(path)  # float32 file into a bfloat16 table: exact values, accepted
    np.testing.assert_array_equal(other.gather(np.arange(ROWS)).float().cpu().numpy(), exact)


def test_load_refuses_float32_values_a_bfloat16_table_would_round(backend, rng, tmp_path):
    table, exact = bf16_table(rng, "pageable", backend, tmp_path)
    inexact = exact.copy()
    inexact[7, 3] += 1e-3
    np.save(tmp_path / "f32.npy", inexact)
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="would round"):
        table.load_from(tmp_path / "f32.npy")
    np.testing.assert_array_equal(table.to_numpy(), before)


def _reference(table0, batches, device):
    """float32 in-memory Adam on the touched rows only, those rounded to bfloat16 after every step.

    Adam over the whole table with the untouched rows (and their state) put
    back after each step: the same element-wise arithmetic the offloaded
    rows get, computed without speedswap (SparseAdam, the other lazy Adam,
    rounds differently in float32's last bit, which bfloat16 rounding can
    turn into a one-ulp difference that later steps carry on).
    """
    weight = torch.nn.Parameter(torch.from_numpy(table0.copy()).to(device))
    opt = torch.optim.Adam([weight], lr=0.01, eps=1e-30)
    for pos, neg, ctx in batches:
        before = weight.detach().clone()
        state_before = {k: v.clone() for k, v in opt.state.get(weight, {}).items() if k != "step"}
        skipgram_loss(F.embedding(pos, weight), F.embedding(neg, weight), ctx).backward()
        opt.step()
        opt.zero_grad()
        untouched = torch.ones(len(table0), dtype=torch.bool, device=device)
        untouched[torch.cat([pos, neg.reshape(-1)])] = False
        with torch.no_grad():
            weight[untouched] = before[untouched]
            weight[~untouched] = weight[~untouched].to(torch.bfloat16).float()
            for name, value in opt.state[weight].items():
                if name != "step":  # Adam's moments start at zero
                    value[untouched] = state_before[name][untouched] if name in state_before else 0.0
    state = opt.state[weight]
    return weight.detach().cpu().numpy(), {k: v.cpu().numpy() for k, v in state.items() if k != "step"}


def test_bfloat16_embedding_trains_with_float32_state(backend, rng):
    device = ss.get_backend(backend).device
    rows, table0 = bf16_rows(rng, (ROWS, DIM))
    batches = zipf_batches(rng, 150, device, ROWS)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pinned",
                                dtype=torch.bfloat16, backend=backend)
    emb.table.scatter(np.arange(ROWS), rows.to(emb.table.device))
    assert emb.weight.dtype is torch.float32
    opt = torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-30)
    emb.attach(opt)
    for name, table in emb._state.tables.items():
        assert table.dtype is torch.float32, name
    for pos, neg, ctx in batches:
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        opt.step()
        opt.zero_grad()
    ref_table, ref_state = _reference(table0, batches, device)
    got = emb.table.gather(np.arange(ROWS)).float().cpu().numpy()
    np.testing.assert_array_equal(got, ref_table)  # the same arithmetic, element for element
    for name, value in ref_state.items():
        np.testing.assert_array_equal(emb._state.tables[name].to_numpy(), value)
    emb.eval()  # reads the table directly, in the weight's dtype
    looked_up = emb(torch.tensor([1, 2], device=device))
    assert looked_up.dtype is torch.float32
    np.testing.assert_array_equal(looked_up.cpu().numpy(), got[[1, 2]])
