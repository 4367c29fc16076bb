"""Forwards outside training read through the device cache: bit for bit what an in-memory table holds.

An eval forward (eval mode, ``no_grad``, ``inference_mode``) takes its
cached rows from the cache and only the others from the host. Whatever the
cache holds (nothing, one row, some, the whole table), with or without
prefetched rows, between steps or inside one, it must return each id's
current value (a cached row is newer than its host copy) in the ids' shape,
and leave the cache as it found it: which rows it holds, their values,
stamps, scores and dirty flags, the frequency sketch and the training
counters. The reference is an ``nn.Embedding`` over the whole table trained
with Adam on the rows each step touches (what offloaded training does).
"""

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from speedswap.train import sync_free
from training_helpers import refused_save_paths

ROWS, DIM, BATCH, STEPS = 200, 8, 40, 15
KINDS = ("eval", "eval_no_grad", "no_grad", "inference_mode")


def _zipf_ids(rng, shape):
    return rng.zipf(1.2, size=shape) % ROWS


def _loss(rows, ctx):
    return -F.logsigmoid((rows * ctx).sum(-1)).sum()


class InMemory:
    """The whole table as one ``nn.Embedding`` on ``device``; a step leaves the rows it did not touch,
    and their Adam state, as they were (torch's Adam would decay their moments).

    On the offloaded side's device: torch's Adam on a GPU rounds otherwise than on the CPU (an
    H200 run against a CPU reference differed in the last bit of 1-4% of elements)."""

    def __init__(self, table0, device):
        self.emb = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()).to(device), freeze=False)
        self.opt = torch.optim.Adam(self.emb.parameters(), lr=0.01)

    def step(self, ids, ctx):
        weight = self.emb.weight
        ids, ctx = ids.to(weight.device), ctx.to(weight.device)
        before = weight.detach().clone()
        state_before = {name: value.clone() for name, value in self.opt.state.get(weight, {}).items()
                        if name != "step"}
        _loss(self.emb(ids), ctx).backward()
        self.opt.step()
        self.opt.zero_grad()
        untouched = torch.ones(ROWS, dtype=torch.bool, device=weight.device)
        untouched[ids.reshape(-1)] = False
        with torch.no_grad():
            weight[untouched] = before[untouched]
            for name, value in self.opt.state[weight].items():
                if name != "step":
                    value[untouched] = state_before[name][untouched] if name in state_before else 0.0

    def rows(self, ids):
        with torch.no_grad():
            return self.emb(ids.to(self.emb.weight.device)).cpu().numpy()


def _forward_outside_training(emb, kind, ids):
    if kind.startswith("eval"):
        emb.eval()
    try:
        if kind == "eval":  # eval mode with autograd on: a loop that forgot no_grad
            return emb(ids)
        with torch.inference_mode() if kind == "inference_mode" else torch.no_grad():
            return emb(ids)
    finally:
        emb.train()


def _cache_state(emb):
    """Everything about the cache an eval forward must leave alone, copied."""
    cache = emb._cache
    held = cache.slot_row >= 0  # a free slot's values are whatever its memory held
    tensors = [cache.slot_row, cache.stamp, cache.score, cache.dirty, cache.sketch.counts,
               *(rows[:cache.num_slots][held] for rows in (cache.weights, *cache.states.values()))]
    numbers = (cache.clock, cache._n_empty, cache.sketch.weight, cache.total, cache.last_step, cache._step)
    return [t.clone() for t in tensors], repr(numbers)


def _train(emb, opt, ref, rng, steps):
    """``steps`` Adam steps on Zipf ids, offloaded and in the reference."""
    device = emb.weight.device
    for _ in range(steps):
        ids = torch.from_numpy(_zipf_ids(rng, BATCH))
        ctx = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32))
        _loss(emb(ids.to(device)), ctx.to(device)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(ids, ctx)


def _assert_refused_changing_nothing(emb, call, error, label, match=None):
    """``call()`` raises ``error`` and leaves the cache's rows, flags and ``stats()`` as they were; the error."""
    tensors, numbers = _cache_state(emb)
    stats = emb.stats()
    with pytest.raises(error, match=match) as raised:
        call()
    assert emb.stats() == stats, label
    after, after_numbers = _cache_state(emb)
    assert after_numbers == numbers, label
    for before, now in zip(tensors, after):
        assert torch.equal(before, now), label
    return raised.value


def _eval_ids(rng, case):
    if case == "empty":
        return np.zeros(0, dtype=np.int64)
    if case == "duplicates":
        ids = _zipf_ids(rng, int(rng.integers(1, 30)))
        return rng.permutation(np.concatenate([ids, ids[:int(rng.integers(1, len(ids) + 1))]]))
    if case == "2d":
        return _zipf_ids(rng, (int(rng.integers(1, 5)), int(rng.integers(1, 12))))
    return rng.integers(0, ROWS, int(rng.integers(1, 3 * ROWS)))  # "wide": many rows, most of them cold


def _check_eval_forward(emb, ref, rng, where):
    kind, case = KINDS[int(rng.integers(len(KINDS)))], ["empty", "duplicates", "2d", "wide"][int(rng.integers(4))]
    ids = _eval_ids(rng, case)
    tensors, numbers = _cache_state(emb)
    out = _forward_outside_training(emb, kind, torch.from_numpy(ids).to(emb.weight.device))
    context = f"{where}, {kind}, {case} ids {ids.shape}"
    assert out.shape == (*ids.shape, DIM) and out.dtype == torch.float32, context
    np.testing.assert_array_equal(out.detach().cpu().numpy(), ref.rows(torch.from_numpy(ids)), err_msg=context)
    after, after_numbers = _cache_state(emb)
    assert after_numbers == numbers, context
    for before, now in zip(tensors, after):
        assert torch.equal(before, now), context


def _embedding_and_reference(cache_rows, backend, rng):
    """An attached offloaded embedding (Adam) and its in-memory reference, from one random table."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=ROWS, storage="pageable", backend=backend,
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    return emb, opt, InMemory(table0, emb.weight.device)


def _check_tables(emb, ref):
    """Every row and its Adam state, once flushed, equal the reference's bit for bit."""
    emb.flush()
    np.testing.assert_array_equal(emb.table.to_numpy(copy=True), ref.emb.weight.detach().cpu().numpy())
    for name, table in emb._state.tables.items():
        np.testing.assert_array_equal(table.to_numpy(copy=True), ref.opt.state[ref.emb.weight][name].cpu().numpy(),
                                      err_msg=name)


@pytest.mark.parametrize("cache_rows", [0, 1, 10, ROWS])
@pytest.mark.parametrize("prefetch", [False, True])
def test_eval_forwards_equal_an_in_memory_embedding_and_change_nothing(cache_rows, prefetch, backend, rng):
    emb, opt, ref = _embedding_and_reference(cache_rows, backend, rng)
    device = emb.weight.device
    batches = [_zipf_ids(rng, BATCH) for _ in range(STEPS + 1)]
    batches[STEPS // 2] = rng.permutation(ROWS)  # every row: from then on a whole-table cache holds them all
    for step in range(STEPS):
        for _ in range(int(rng.integers(1, 4))):
            _check_eval_forward(emb, ref, rng, f"before step {step}")
        ids = torch.from_numpy(batches[step])
        ctx = torch.from_numpy(rng.standard_normal((len(ids), DIM), dtype=np.float32))
        rows = emb(ids.to(device))
        if prefetch:
            emb.prefetch(torch.from_numpy(batches[step + 1]).to(device))
        # Inside the step the rows are still the values before it, wherever they are.
        _check_eval_forward(emb, ref, rng, f"inside step {step}")
        _loss(rows, ctx.to(device)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(ids, ctx)
        if step == STEPS // 2:
            missed = emb.stats()["eval"]["lookups"] - emb.stats()["eval"]["hits"]
    if cache_rows:
        assert emb.stats()["eval"]["hits"] > 0  # the cache served some of them
    if cache_rows == ROWS:  # and after the step of every row, all of them
        assert emb.stats()["eval"]["lookups"] - emb.stats()["eval"]["hits"] == missed
    _check_tables(emb, ref)
    emb.close()


def _wide_eval_ids(rng, spread, cached):
    """30 training batches of ids: of any row, Zipf's, or nine in ten of rows in ``cached``."""
    if spread == "uniform":
        return rng.integers(0, ROWS, 30 * BATCH)
    if spread == "zipf" or not cached:
        return _zipf_ids(rng, 30 * BATCH)
    return rng.permutation(np.concatenate([rng.choice(sorted(cached), 27 * BATCH), rng.integers(0, ROWS, 3 * BATCH)]))


@pytest.mark.parametrize("cache_rows", [0, 1, 10, ROWS // 2, ROWS])
@pytest.mark.parametrize("spread", ["uniform", "zipf", "cached"])
@pytest.mark.parametrize("device_branches", [False, True])
def test_an_eval_forward_far_larger_than_a_batch_leaves_the_cache_bytes_as_they_were(cache_rows, spread,
                                                                                     device_branches, backend,
                                                                                     rng, monkeypatch):
    """Eval batches are often many training batches: their uncached rows grew the cache's scratch
    rows, and those of each optimizer state, to their number for good, device memory later training
    could not use. Those beyond the scratch rows there are pass through a temporary the call frees.
    ``device_branches``: with sync_free's numpy shortcuts off, the branches a GPU runs."""
    if device_branches:
        monkeypatch.setattr(sync_free, "_numpy_shortcut", lambda tensor: False)
    emb, opt, ref = _embedding_and_reference(cache_rows, backend, rng)
    device = emb.weight.device

    def step(ids):
        ctx = torch.from_numpy(rng.standard_normal((len(ids), DIM), dtype=np.float32))
        _loss(emb(torch.from_numpy(ids).to(device)), ctx.to(device)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(torch.from_numpy(ids), ctx)

    for _ in range(4):
        step(_zipf_ids(rng, BATCH))
    cache_bytes = emb.stats()["cache_bytes"]
    for kind in KINDS:
        cached = set(emb._cache.slot_row.tolist()) - {-1}
        ids = _wide_eval_ids(rng, spread, cached)
        if cache_rows:  # more rows to read than there are scratch rows: the case in question
            uncached = set(ids.tolist()) - cached
            assert len(uncached) > len(emb._cache.weights) - emb._cache.num_slots, kind
        tensors, numbers = _cache_state(emb)
        hits = emb.stats()["eval"]["hits"]
        out = _forward_outside_training(emb, kind, torch.from_numpy(ids).to(device))
        if spread == "cached" and cache_rows:  # most rows from the slots, the rest put over them
            assert emb.stats()["eval"]["hits"] - hits > len(ids) // 2, kind
        np.testing.assert_array_equal(out.detach().cpu().numpy(), ref.rows(torch.from_numpy(ids)), err_msg=kind)
        assert emb.stats()["cache_bytes"] == cache_bytes, kind
        after, after_numbers = _cache_state(emb)
        assert after_numbers == numbers, kind
        for before, now in zip(tensors, after):
            assert torch.equal(before, now), kind
    if cache_rows:
        assert emb.stats()["eval"]["hits"] > 0
    for _ in range(2):  # training goes on as it would have
        step(_zipf_ids(rng, BATCH))
    _check_eval_forward(emb, ref, rng, "after the wide eval forwards")
    _check_tables(emb, ref)
    emb.close()


@pytest.mark.parametrize("cache_rows", [0, 10, ROWS])
@pytest.mark.parametrize("device_branches", [False, True])
def test_an_eval_forward_of_ids_out_of_range_raises_before_anything_changes(cache_rows, device_branches, backend,
                                                                            rng, monkeypatch):
    """Ids already on the device are range-checked in the read the cache makes anyway (its count of
    rows to read), after sorting and looking them up: that must still raise IdError, saying which id
    and why, before a row is read or a counter moves. ``2**32 + row``, an int32 key of the cached
    ``row`` (the cache's index holds int32 rows), must not pass for that row."""
    if device_branches:
        monkeypatch.setattr(sync_free, "_numpy_shortcut", lambda tensor: False)
    emb, opt, ref = _embedding_and_reference(cache_rows, backend, rng)
    device = emb.weight.device
    for ids in [_zipf_ids(rng, BATCH) for _ in range(3)] + [rng.permutation(ROWS)]:  # then a whole-table cache is full
        ids = torch.from_numpy(ids)
        ctx = torch.from_numpy(rng.standard_normal((len(ids), DIM), dtype=np.float32))
        _loss(emb(ids.to(device)), ctx.to(device)).backward()
        opt.step()
        opt.zero_grad()
        ref.step(ids, ctx)
        cached = sorted(set(emb._cache.slot_row.tolist()) - {-1})
        good = rng.choice(cached, 5) if cached else rng.integers(0, ROWS, 5)
        for bad, message in ((ROWS + int(rng.integers(0, 5)), "out of range"), (-int(rng.integers(1, 5)), "negative"),
                             (2**32 + int(good[0]), "out of range")):
            for kind in KINDS:
                ids = torch.from_numpy(rng.permutation(np.append(good, bad))).to(device)
                raised = _assert_refused_changing_nothing(
                    emb, lambda: _forward_outside_training(emb, kind, ids), ss.IdError, kind, match=message)
                assert str(bad) in str(raised), kind
    _check_eval_forward(emb, ref, rng, "after the refused forwards")
    _check_tables(emb, ref)
    emb.close()


@pytest.mark.parametrize("cache_rows", [10, ROWS])
def test_a_table_read_refused_for_its_out_changes_nothing(cache_rows, backend, rng):
    """``table.gather(ids, out=...)`` through a kept table had the cache write its rows back before
    it looked at ``out``: a refused read (``out`` a non-contiguous view, of another shape or dtype)
    left the cache's rows clean and its counters moved (rows_d2h, bytes_d2h)."""
    emb, opt, ref = _embedding_and_reference(cache_rows, backend, rng)
    device = emb.weight.device
    table = emb.table  # kept: reads through it have the cache write its rows back first
    _train(emb, opt, ref, rng, STEPS)
    assert bool(emb._cache.dirty.any())  # what a read through the table would write back
    ids = torch.from_numpy(_zipf_ids(rng, 6)).to(device)
    wide = torch.empty(6, 2 * DIM, device=device)
    for out, error in ((wide[:, :DIM], ss.ShapeError), (torch.empty(5, DIM, device=device), ss.ShapeError),
                       (torch.empty(6, DIM, dtype=torch.float64, device=device), ss.DTypeError)):
        _assert_refused_changing_nothing(emb, lambda: table.gather(ids, out=out), error, str(error))
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), ref.rows(ids.cpu()))
    _check_tables(emb, ref)
    emb.close()


def _refused_loads(tmp_path, rng):
    """Files a load refuses: missing, another shape (.npy and .h5), and a torch file."""
    other = ss.OffloadedEmbedding(ROWS + 1, DIM, max_rows=8, storage="pageable", backend="numpy")
    other.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS + 1, DIM), dtype=np.float32))))
    other.save(tmp_path / "other.npy")
    other.save(tmp_path / "other.h5")
    other.close()
    return [(tmp_path / "missing.h5", ss.MissingFileError), (tmp_path / "other.npy", ss.FileFormatError),
            (tmp_path / "other.h5", ss.FileFormatError), (tmp_path / "x.pt", ss.OptionError)]


@pytest.mark.parametrize("cache_rows", [10, ROWS])
def test_a_refused_load_leaves_the_cache_as_it_was(cache_rows, backend, rng, tmp_path):
    """emb.load of a file it refuses flushed the cache before the file was read, and dropped every
    cached row after the refusal: the next steps missed rows the cache had held (hits lost, the rows
    read from the host again), and stats() had counted the flush's writes."""
    emb, opt, ref = _embedding_and_reference(cache_rows, backend, rng)
    _train(emb, opt, ref, rng, STEPS)
    assert bool((emb._cache.slot_row >= 0).any()) and bool(emb._cache.dirty.any())
    for path, error in _refused_loads(tmp_path, rng):
        _assert_refused_changing_nothing(emb, lambda: emb.load(path), error, path.name)
    _train(emb, opt, ref, rng, 3)
    _check_tables(emb, ref)
    emb.close()


@pytest.mark.parametrize("name", ["x.txt", "x.pt", "x.npz"])
def test_a_save_refused_for_its_suffix_leaves_the_cache_as_it_was(name, backend, rng, tmp_path):
    """emb.save flushed the cache before it looked at the suffix: a refused save had written every
    dirty row back (stats' rows_d2h moved, dirty flags cleared)."""
    emb, opt, ref = _embedding_and_reference(10, backend, rng)
    _train(emb, opt, ref, rng, STEPS)
    assert bool(emb._cache.dirty.any())
    _assert_refused_changing_nothing(emb, lambda: emb.save(tmp_path / name), ss.OptionError, name)
    assert list(tmp_path.iterdir()) == []
    _check_tables(emb, ref)
    emb.close()


def test_a_save_refused_inside_the_save_leaves_the_cache_as_it_was(backend, rng, tmp_path):
    """emb.save flushed the cache before save_tables / HostTable.save looked at the path: a save
    refused there (PathError, FileFormatError) had written every dirty row back (rows_d2h moved,
    dirty flags cleared). The saves that succeed after them still write the cached, trained rows."""
    emb, opt, ref = _embedding_and_reference(10, backend, rng)
    _train(emb, opt, ref, rng, STEPS)
    assert bool(emb._cache.dirty.any())
    for path, error in refused_save_paths(tmp_path):
        _assert_refused_changing_nothing(emb, lambda: emb.save(path), error, path.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.h5", "edited", "photos"]
    emb.save(tmp_path / "emb.npy")
    emb.save(tmp_path / "emb.h5")
    weight, state = ref.emb.weight.detach().cpu().numpy(), ref.opt.state[ref.emb.weight]
    np.testing.assert_array_equal(np.load(tmp_path / "emb.npy"), weight)
    with h5py.File(tmp_path / "emb.h5") as f:
        np.testing.assert_array_equal(f["table"][:], weight)
        for name in emb._state.tables:
            np.testing.assert_array_equal(f[f"optimizer.{name}"][:], state[name].cpu().numpy(), err_msg=name)
    _train(emb, opt, ref, rng, 3)
    _check_tables(emb, ref)
    emb.close()
