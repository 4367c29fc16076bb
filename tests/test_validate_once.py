"""Ids are checked once per user call: every range check is a host synchronisation on a GPU.

Also: the ids a check hands inward are contiguous int64, whatever view the user passed
(the cuda kernels read them through a raw pointer).
"""

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap import convert

from training_helpers import CAPACITY, DIM, skipgram_loss, zipf_batches

ROWS = 300


@pytest.fixture
def count_checks(monkeypatch):
    """A list that grows by one for every id range check speedswap runs."""
    calls = []
    real = convert._check_range

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(convert, "_check_range", counting)
    return calls


def test_embedding_step_checks_ids_once_per_forward(backend, rng, count_checks):
    device = ss.get_backend(backend).device
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend=backend)
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    for pos, neg, ctx in zipf_batches(rng, 3, device, ROWS):
        count_checks.clear()
        loss = skipgram_loss(emb(pos), emb(neg), ctx)   # two user calls
        loss.backward()
        opt.step()                                      # gathers and writes back state: no check
        opt.zero_grad()
        assert len(count_checks) == 2


def test_switcher_step_checks_ids_once(backend, rng, count_checks):
    device = ss.get_backend(backend).device
    model = torch.nn.Embedding(CAPACITY, DIM).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    u = ss.ModelFactory(model, ROWS, DIM, CPUPinn=True, backend=backend)
    u.uniformDistributionInit(-0.1, 0.1)
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e",
                            CPUPinn=True, backend=backend)
    for pos, neg, ctx in zipf_batches(rng, 3, device, ROWS):
        count_checks.clear()
        local_pos, local_neg = u.beforeForwardPass(pos, neg)
        o.beforeForwardPass(pos, neg)       # same ids: found, not checked again
        loss = skipgram_loss(model(local_pos), model(local_neg), ctx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        u.afterOptimizerStep(pos, neg)      # compared with the step's ids, not range-checked
        o.afterOptimizerStep(pos, neg)
        assert len(count_checks) == 1       # one check for four user calls


def test_table_calls_check_once(backend, rng, count_checks):
    table = ss.HostTable.from_numpy(rng.standard_normal((ROWS, DIM)).astype(np.float32),
                                    storage="pageable", backend=backend)
    ids = rng.choice(ROWS, size=40, replace=False)
    table.gather(ids)
    assert len(count_checks) == 1
    table.scatter(ids, torch.ones(40, DIM))
    assert len(count_checks) == 2


def test_a_bad_id_is_still_caught(backend, count_checks):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend=backend)
    emb.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    with pytest.raises(ss.IdError, match=str(ROWS)):
        emb(torch.tensor([0, ROWS]))
    assert emb._working_set.size == 0  # nothing changed


@pytest.mark.parametrize("bad", [-1, ROWS, 2**40])
def test_a_bad_id_in_a_later_forward_changes_nothing_and_the_step_goes_on(backend, rng, bad):
    """A forward after a step's first checks its ids in the working set's one read: refused before any
    slot is given, and the step trains as if the bad call had not been made."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    first, second = (torch.from_numpy(rng.integers(0, ROWS, 30)).to(device) for _ in range(2))
    trained = []
    for call_bad in (True, False):
        emb = ss.OffloadedEmbedding.from_pretrained(torch.from_numpy(table0), freeze=False, max_rows=CAPACITY,
                                                    storage="pageable", backend=backend)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        emb.attach(opt)
        out = emb(first)
        if call_bad:
            rows_before = emb.working_rows.clone()
            ids = second.clone()
            ids[7] = bad
            with pytest.raises(ss.IdError, match=str(bad)):
                emb(ids)
            assert torch.equal(emb.working_rows, rows_before)
        loss = (out.sum(1) ** 2).sum() + emb(second).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        trained.append(emb.table.to_numpy(copy=True))
    np.testing.assert_array_equal(trained[0], trained[1])
    assert not np.array_equal(trained[0], table0)


VIEWS = {
    "strided": lambda t: t.view(-1, 2)[:, 0],
    "expanded": lambda t: t[:1].expand(9),
    "transposed": lambda t: t[:12].view(3, 4).t(),
    "int32": lambda t: t.to(torch.int32),
    "numpy-strided": lambda t: t.numpy()[::3],
}


@pytest.mark.parametrize("make_view", VIEWS.values(), ids=list(VIEWS))
def test_validated_ids_are_contiguous_int64(make_view, rng):
    base = torch.from_numpy(rng.integers(0, ROWS, size=24))
    view = make_view(base)
    flat, shape = convert.as_row_ids(view, ROWS, "cpu")
    assert flat.is_contiguous() and flat.dtype == torch.int64 and flat.dim() == 1
    assert flat.stride() == (1,)
    expected = np.asarray(view.numpy() if isinstance(view, torch.Tensor) else view).reshape(-1)
    np.testing.assert_array_equal(flat.numpy(), expected)
    assert shape == tuple(view.shape)


@pytest.mark.parametrize("make_view", VIEWS.values(), ids=list(VIEWS))
def test_gather_and_scatter_with_views_equal_numpy_indexing(backend, make_view, rng):
    ref = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    table = ss.HostTable.from_numpy(ref, storage="pinned", backend=backend)
    ids = make_view(torch.from_numpy(rng.permutation(ROWS)[:24]))
    idx = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids)
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), ref[idx])
    if len(np.unique(idx)) == idx.size:
        values = rng.standard_normal((*idx.shape, DIM)).astype(np.float32)
        table.scatter(ids, values)
        ref[idx] = values
        np.testing.assert_array_equal(table.to_numpy(), ref)
