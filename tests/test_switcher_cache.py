"""The switchers' shared device cache of hot rows and prefetch keep SpeedTorch-style training exact.

The runs of test_cache, through ModelFactory / OptimizerFactory: a 400-row
table, caches of 0, 4 (1%), 20 (5%) and 200 (50%) rows; a step of Zipf ids
touches 44-66 distinct rows, so the 1% and 5% caches fall back. Each run
saves both switchers, trains 10 steps, loads them and trains those steps
again. Plain SGD trains with a ModelFactory alone (a cache without state).
"""

import gc
import weakref

import h5py
import numpy as np
import pytest
import torch

import speedswap as ss
from test_cache import (EQUALITIES, SIZES, assert_cached_run_equals_in_memory,
                        assert_touched_rows_equal_reference)
from test_optimizer_equivalence import OPTIMIZERS, TOL, assert_same
from training_helpers import (CAPACITY, DIM, NEGS, NUM_ROWS, refused_save_paths, run_in_memory, run_switchers,
                              skipgram_loss, zipf_batches)

#: Every size and both prefetch settings, in a few runs each (the full product is `slow`).
CORE = [("sgd", 4, True), ("sgd", 200, False), ("adam", 0, True), ("adam", 20, False),
        ("adam", 200, True), ("adagrad", 4, False), ("adagrad", 200, True)]
FULL = [(n, c, p) for n in EQUALITIES for c in SIZES for p in (False, True)
        if (n, c, p) not in CORE]


def _equality(name, cache_rows, prefetch, rng, backend):
    assert_cached_run_equals_in_memory(run_switchers, name, cache_rows, prefetch, rng, backend,
                                       dim=DIM, optimizer_switcher=name != "sgd")


@pytest.mark.parametrize("name,cache_rows,prefetch", CORE)
def test_cached_switchers_equal_in_memory(name, cache_rows, prefetch, rng, backend):
    _equality(name, cache_rows, prefetch, rng, backend)


@pytest.mark.slow
@pytest.mark.parametrize("name,cache_rows,prefetch", FULL)
def test_cached_switchers_equal_in_memory_every_size(name, cache_rows, prefetch, rng, backend):
    _equality(name, cache_rows, prefetch, rng, backend)


def _touched_rows(name, cache_rows, rng, backend):
    assert_touched_rows_equal_reference(run_switchers, name, cache_rows, rng, backend,
                                        sparse=name == "sparse_adam")


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_amsgrad", "rprop"])
def test_element_wise_optimizers_with_a_switcher_cache(name, rng, backend):
    _touched_rows(name, NUM_ROWS // 20, rng, backend)


@pytest.mark.slow
@pytest.mark.parametrize("cache_rows", [NUM_ROWS // 20, NUM_ROWS // 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_element_wise_optimizer_with_a_switcher_cache(name, cache_rows, rng, backend):
    _touched_rows(name, cache_rows, rng, backend)


# ------------------------------------------------------------------ helpers

ROWS = 60


def _pair(backend, cache_rows, table0, opt=torch.optim.Adam, optimizer_first=False, storage="pageable",
          **kwargs):
    """A model with a CAPACITY-row embedding, its optimizer, and both switchers (u, o) over ``storage``."""
    device = ss.get_backend(backend).device
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAPACITY, DIM)}).to(device)
    optimizer = opt(model.parameters(), lr=0.05, **kwargs)

    def model_switch():
        u = ss.ModelFactory(model["u"], len(table0), DIM, storage=storage, backend=backend,
                            cache_rows=cache_rows)
        u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
        return u

    def optimizer_switch():
        return ss.OptimizerFactory(optimizer, len(table0), DIM, model, "u", storage=storage,
                                   backend=backend, cache_rows=cache_rows)
    if optimizer_first:
        o = optimizer_switch()
        return model, optimizer, model_switch(), o
    u = model_switch()
    return model, optimizer, u, optimizer_switch()


def _train(model, opt, u, o, batches, optimizer_first=False):
    """SpeedTorch steps; with ``optimizer_first`` the OptimizerFactory's calls come first."""
    switches = (o, u) if optimizer_first else (u, o)
    for pos, neg, ctx in batches:
        for switch in switches:
            lpos, lneg = switch.before_forward(pos, neg)
        skipgram_loss(model["u"](lpos), model["u"](lneg), ctx).backward()
        opt.step()
        opt.zero_grad()
        for switch in switches:
            switch.after_step(pos, neg)


def _tables(u, o):
    """The table and state tables, current (read through the switchers)."""
    table = u.getNumpyVersion()
    return table, {k: t.to_numpy(copy=True) for k, t in o.state.tables.items()}


def _batches(rng, backend, steps):
    return zipf_batches(rng, steps, ss.get_backend(backend).device, num_rows=ROWS)


def _sparse_adam_in_memory(table0, batches, backend):
    """``table0`` trained on ``batches`` in memory with SparseAdam, which the switchers' Adam of
    :func:`_pair` (``eps=1e-30``) equals: ``(table, {state name: table})``, as :func:`_tables` reads them."""
    return run_in_memory(lambda p: torch.optim.SparseAdam(list(p), lr=0.05, eps=1e-30),
                         table0, batches, ss.get_backend(backend).device, sparse=True)


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_either_switcher_may_be_built_and_called_first(optimizer_first, rng, backend):
    """The state rows wait for the model's after_step, or are taken from the optimizer by it."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 40)
    pair = _pair(backend, 6, table0, eps=1e-30, optimizer_first=optimizer_first)
    _train(*pair, batches, optimizer_first=optimizer_first)
    assert pair[2].stats()["total"]["hits"] > 0
    expected = _sparse_adam_in_memory(table0, batches, backend)
    assert_same(_tables(*pair[2:]), expected)


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_a_step_without_ids_trains_nothing_with_a_cache(optimizer_first, rng, backend):
    """A batch with no ids (an empty shard of the data): with a cache, after_step raised a bare
    IndexError from the cache's store, which found no fetch of the step, and left the step open."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 6)
    device = ss.get_backend(backend).device
    empty = (torch.zeros(0, dtype=torch.int64, device=device),
             torch.zeros(0, NEGS, dtype=torch.int64, device=device), torch.zeros(0, DIM, device=device))
    pair = _pair(backend, 6, table0, opt=torch.optim.Adagrad, optimizer_first=optimizer_first)
    _train(*pair, batches[:3] + [empty] + batches[3:] + [empty], optimizer_first=optimizer_first)
    # Adagrad without lr_decay: in memory a step without ids moves no row and no state.
    expected = run_in_memory(lambda p: torch.optim.Adagrad(list(p), lr=0.05), table0, batches,
                             device, sparse=True)
    assert_same(_tables(*pair[2:]), expected)


def test_whole_table_calls_see_the_cache(rng, backend, tmp_path):
    """Each call, with every row cached, does what it does without a cache."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 24)
    plain, cached = _pair(backend, 0, table0), _pair(backend, ROWS, table0)

    def both(call):
        for k, pair in enumerate((plain, cached)):
            call(k, *pair)
        (table, state), (cached_table, cached_state) = _tables(*plain[2:]), _tables(*cached[2:])
        np.testing.assert_allclose(cached_table, table, **TOL)
        assert cached_state.keys() == state.keys()
        for name in state:
            np.testing.assert_allclose(cached_state[name], state[name], **TOL, err_msg=name)

    for pair in (plain, cached):
        _train(*pair, batches[:4])
    model, opt, u, o = cached
    # Every touched row is in the cache only: the host table's memory is stale until a flush.
    assert bool(u._steps.cache.dirty.any())
    both(lambda k, m, opt, u, o: u.saveCupy(tmp_path / f"u{k}.npy"))
    both(lambda k, m, opt, u, o: o.saveCupy(tmp_path / f"o{k}"))
    np.testing.assert_array_equal(np.load(tmp_path / "u1.npy"), u.getNumpyVersion())
    both(lambda k, *pair: _train(*pair, batches[4:8]))
    both(lambda k, m, opt, u, o: u.customInit(torch.nn.init.constant_, 0.5))
    both(lambda k, *pair: _train(*pair, batches[8:12]))
    both(lambda k, m, opt, u, o: o.optInit())
    both(lambda k, *pair: _train(*pair, batches[12:16]))
    both(lambda k, m, opt, u, o: (u.loadCupy(tmp_path / f"u{k}.npy"), o.loadCupy(tmp_path / f"o{k}")))
    both(lambda k, *pair: _train(*pair, batches[16:20]))
    both(lambda k, m, opt, u, o: u.getTorchVar()[:5].fill_(2.0))  # a write through the view
    both(lambda k, m, opt, u, o: u.saveTorch(tmp_path / f"u{k}.pt"))
    both(lambda k, *pair: _train(*pair, batches[20:]))
    both(lambda k, m, opt, u, o: u.loadTorch(tmp_path / f"u{k}.pt"))


@pytest.mark.parametrize("copy", ["to_numpy", "getNumpyVersion"])
def test_a_copy_of_a_device_table_leaves_the_cache_as_it_is(copy, rng, backend):
    """A device table (``CPUPinn=False``, SpeedTorch's default) hands out no host memory, so its
    ``to_numpy()`` is a read-only copy; yet ModelFactory.to_numpy() emptied the device cache as for
    the table's own memory handed out, and every later step fetched its rows again."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 12)
    expected, _ = _sparse_adam_in_memory(table0, batches[:8], backend)
    counts = []
    for copied in (False, True):
        model, opt, u, o = _pair(backend, 20, table0, eps=1e-30, storage="device")
        _train(model, opt, u, o, batches[:8])
        assert bool(u._steps.cache.dirty.any())  # trained rows only in the cache: the copy must read them
        if copied:
            array = getattr(u, copy)()
            np.testing.assert_allclose(array, expected, **TOL)
            assert array.flags.writeable == (copy == "getNumpyVersion")  # to_numpy(): a read-only copy
        _train(model, opt, u, o, batches[8:])
        # Rows the copy wrote back (bytes to the host) would have gone back at eviction or the end.
        counts.append({k: v for k, v in u.stats()["total"].items() if "d2h" not in k})
        u.close()
        o.close()
    assert counts[0]["hits"] > 0
    assert counts[1] == counts[0]


@pytest.mark.parametrize("storage", ["device", "pageable"])
def test_torch_files_leave_the_cache_working(storage, rng, backend, tmp_path):
    """saveTorch copied the table through ``as_tensor()``, which a device table (``CPUPinn=False``)
    counts as a view alive for good: after one saveTorch (or loadTorch, which wrote through it) the
    cache kept no row again, and every later step fetched its rows from the table. A host table's
    cache gave its rows up too. A saveTorch must leave the cache as a saveCupy does, and a loadTorch
    as a loadCupy does (rows dropped, cached again by the next steps)."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 12)
    saved, _ = _sparse_adam_in_memory(table0, batches[:8], backend)
    expected, _ = _sparse_adam_in_memory(table0, batches, backend)
    counts = {}
    for calls in ("none", "saveTorch", "saveCupy+loadCupy", "saveTorch+loadTorch"):
        model, opt, u, o = _pair(backend, 20, table0, eps=1e-30, storage=storage)
        _train(model, opt, u, o, batches[:8])
        assert bool(u._steps.cache.dirty.any())  # trained rows only in the cache: the save must read them
        pt, npy = tmp_path / f"{calls}.pt", tmp_path / f"{calls}.npy"
        if "Torch" in calls:
            u.saveTorch(pt)
            np.testing.assert_allclose(torch.load(pt).numpy(), saved, **TOL)
        if calls == "saveCupy+loadCupy":
            u.saveCupy(npy)
            u.loadCupy(npy)
        if calls == "saveTorch+loadTorch":
            u.loadTorch(pt)
        _train(model, opt, u, o, batches[8:])
        np.testing.assert_allclose(u.getNumpyVersion(), expected, **TOL, err_msg=calls)
        counts[calls] = {k: v for k, v in u.stats()["total"].items() if "d2h" not in k}
        u.close()
        o.close()
    assert counts["none"]["hits"] > 0
    assert counts["saveTorch"] == counts["none"]
    assert counts["saveTorch+loadTorch"] == counts["saveCupy+loadCupy"]


def test_stats_are_shared_and_prefetched_rows_hit(backend, rng):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 8, table0, opt=torch.optim.SGD)
    first, second = torch.tensor([1, 2, 2]), torch.tensor([2, 3, 4])
    for ids, ahead in ((first, second), (second, None)):
        local = u.before_forward(ids)
        o.before_forward(ids)
        if ahead is not None:
            assert u.prefetchNextBatch(ahead) == 2  # 2 is in this step: skipped
        model["u"](local).sum().backward()
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
    last = u.stats()["last_step"]
    assert (last["hits"], last["misses"], last["unique_rows"]) == (3, 0, 3)
    assert o.stats() == u.stats()
    assert u.stats()["cache_rows"] == 8 and u.stats()["cache_bytes"] > 0


def test_a_small_cache_falls_back_without_error(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 1, table0)
    _train(model, opt, u, o, _batches(rng, backend, 3))
    assert u.stats()["last_step"]["rows_d2h"] > 0  # rows that did not fit went back


def test_a_model_factory_alone_caches_rows_without_state(rng, backend):
    device = ss.get_backend(backend).device
    emb = torch.nn.Embedding(8, DIM).to(device)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    u = ss.ModelFactory(emb, ROWS, DIM, storage="pageable", backend=backend, cache_rows=10)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    expected = table0.copy()
    for ids in ([3, 7, 7], [7, 9], [3, 9, 9, 9]):
        ids = torch.tensor(ids)
        emb(u.before_forward(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        np.subtract.at(expected, ids.numpy(), 0.1)
    assert u.stats()["total"]["hits"] == 3
    np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- errors

def test_mismatched_cache_rows_are_refused_in_either_order(rng, backend):
    device = ss.get_backend(backend).device
    for first_model in (True, False):
        model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAPACITY, DIM)}).to(device)
        opt = torch.optim.Adam(model.parameters())

        def u(rows):
            switch = ss.ModelFactory(model["u"], ROWS, DIM, backend=backend, cache_rows=rows)
            switch.uniformDistributionInit(-1.0, 1.0)
            return switch

        def o(rows):
            return ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend=backend, cache_rows=rows)
        first, second = (u, o) if first_model else (o, u)
        kept = first(10)
        with pytest.raises(ss.OptionError, match="cache_rows=10.*same cache_rows"):
            second(5)
        assert kept.stats()["cache_rows"] == 10
        pair = (kept, second(10)) if first_model else (second(10), kept)
        _train(model, opt, *pair, _batches(rng, backend, 2))


@pytest.mark.parametrize("bad", [-1, 1.5, "many", True])
def test_bad_cache_rows(bad):
    with pytest.raises(ss.OptionError, match="cache_rows"):
        ss.ModelFactory(torch.nn.Embedding(8, DIM), ROWS, DIM, backend="numpy", cache_rows=bad)


def test_bad_prefetch_ids_change_nothing(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 10, table0)
    _train(model, opt, u, o, _batches(rng, backend, 2))
    before = u.stats()
    for bad, error in (([1, ROWS], ss.IdError), ([-1], ss.IdError), ([0.5], ss.DTypeError)):
        with pytest.raises(error):
            u.prefetch(bad)
        with pytest.raises(error):
            u.prefetch([1], bad)
    assert u.stats() == before
    plain = _pair(backend, 0, table0)[2]
    assert plain.prefetch([1, 2]) == 0


def test_calls_in_the_middle_of_a_step_are_refused(rng, backend, tmp_path):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 10, table0)
    pos, neg, _ = _batches(rng, backend, 1)[0]
    o.before_forward(pos, neg)  # the optimizer's switcher began the step, the model's has not
    with pytest.raises(ss.StateError, match="optimizer switcher"):
        u.before_forward(pos[:3])
    for call in (lambda: u.zerosInit(), lambda: u.load(tmp_path / "missing.npy"), lambda: o.optInit(),
                 lambda: ss.ModelFactory(model["u"], ROWS, DIM, backend=backend, cache_rows=10)):
        with pytest.raises(ss.StateError, match="between"):
            call()
    # Reads are not refused before optimizer.step(): the tables hold what memory does.
    np.testing.assert_array_equal(u.getTorchVar().numpy(), table0)
    np.testing.assert_array_equal(u.to_numpy(), table0)
    u.before_forward(pos, neg)  # the same ids join the step
    u.getNumpyVersion()  # a copy is fine: cached rows are clean after the flush


def test_a_step_ends_on_both_switchers_before_the_next_begins(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 10, table0)
    batches = _batches(rng, backend, 2)
    _train(model, opt, u, o, batches[:1])
    pos, neg, ctx = batches[1]
    lpos, lneg = u.before_forward(pos, neg)
    o.before_forward(pos, neg)
    skipgram_loss(model["u"](lpos), model["u"](lneg), ctx).backward()
    opt.step()
    u.after_step(pos, neg)
    with pytest.raises(ss.StateError, match="optimizer switcher"):
        u.before_forward(pos, neg)  # the same ids: still not a step it may join again
    o.after_step(pos, neg)
    u.before_forward(pos, neg)  # now a new step


def test_a_refused_optimizer_step_leaves_the_cache_consistent(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 10, table0)
    batches = _batches(rng, backend, 3)
    _train(model, opt, u, o, batches[:1])
    before = _tables(u, o)
    opt.state.clear()  # lost: restoring the state_dict would be the fix
    with pytest.raises(ss.StateError, match="load_state_dict"):
        o.before_forward(*batches[1][:2])
    after = _tables(u, o)
    np.testing.assert_array_equal(after[0], before[0])
    o.optInit()  # the message's other advice
    _train(model, opt, u, o, batches[1:])


def test_a_newer_switcher_replaces_the_older_one(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, old, o = _pair(backend, 10, table0)
    new = ss.ModelFactory(model["u"], ROWS, DIM, storage="pageable", backend=backend,
                          cache_rows=10)
    with pytest.raises(ss.StateError, match="replaced"):
        old.before_forward([1])
    _train(model, opt, new, o, _batches(rng, backend, 2))
    assert new.stats()["total"]["steps"] == 2


def test_closing_one_switcher_leaves_the_other_working(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 4)
    model, opt, u, o = _pair(backend, 10, table0, opt=torch.optim.SGD, momentum=0.9)
    _train(model, opt, u, o, batches[:2])
    buffer = o.state.tables["momentum_buffer"]
    o.close()  # its cached state rows are written back before its tables close
    assert buffer.closed
    # The momentum optimizer alone would mix rows' momentum across slots: refused at its step.
    lpos, lneg = u.before_forward(*batches[2][:2])
    skipgram_loss(model["u"](lpos), model["u"](lneg), batches[2][2]).backward()
    with pytest.raises(ss.OptionError, match="OptimizerFactory"):
        opt.step()
    opt.zero_grad()
    u.after_step(*batches[2][:2])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)  # stateless: the ModelFactory alone is exact
    for pos, neg, ctx in batches[2:]:
        lpos, lneg = u.before_forward(pos, neg)
        skipgram_loss(model["u"](lpos), model["u"](lneg), ctx).backward()
        opt.step()
        opt.zero_grad()
        u.after_step(pos, neg)
    u.close()
    with pytest.raises(ss.StateError, match="closed"):
        u.before_forward([1])


def test_dropping_a_switcher_frees_its_tables_without_the_cycle_collector(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 10, table0)
    _train(model, opt, u, o, _batches(rng, backend, 2))
    table, state = weakref.ref(u.table), weakref.ref(o.state.tables["exp_avg"])
    gc.collect()
    gc.disable()
    try:
        del u
        assert table() is None  # the cache over it went with it
        del o
        assert state() is None
    finally:
        gc.enable()


def test_info_reports_the_switchers_cache(rng, backend):
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    gc.collect()  # caches of earlier tests go now, not in the middle of this one
    before = ss.info()
    model, opt, u, o = _pair(backend, 10, table0)
    _train(model, opt, u, o, _batches(rng, backend, 5))
    now = ss.info()
    assert now["caches"] == before["caches"] + 1
    assert now["cache_bytes"] == before["cache_bytes"] + u.stats()["cache_bytes"]
    assert 0 < now["cache_hit_rate"] <= 1
    u.close()
    assert ss.info()["cache_bytes"] == before["cache_bytes"]


def test_rprop_rows_prefetched_before_the_first_step_start_from_its_lr(rng, backend):
    """A scheduler changes lr after the switchers were built; rows a prefetch cached before the
    first step must start from the lr torch creates Rprop's step_size with, as the others do."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model, opt, u, o = _pair(backend, 8, table0, opt=torch.optim.Rprop)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 0.1)  # lr 0.05 -> 0.005 now
    device = ss.get_backend(backend).device
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()).to(device), freeze=False)
    ref_opt = torch.optim.Rprop(ref.parameters(), lr=0.005)
    steps = [torch.tensor(ids, device=device) for ids in ([1], [5, 6], [7])]  # each row once
    assert u.prefetchNextBatch(torch.cat(steps[1:])) == 3  # before the first step
    for ids in steps:
        local = u.before_forward(ids)
        o.before_forward(ids)
        model["u"](local).sum().backward()
        opt.step()
        opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
        ref(ids).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().cpu().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cache_rows", [0, 20])
def test_a_write_into_the_optimizer_state_in_the_middle_of_a_step_is_refused(cache_rows, rng, backend):
    """after_step wrote the step's state rows back over a write through the state tables between
    before_forward and after_step (a reference kept from between steps): the write was lost."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 30)
    pair = _pair(backend, cache_rows, table0, eps=1e-30)
    model, opt, u, o = pair
    _train(*pair, batches[:15])
    kept = o.state.tables
    pos, neg, ctx = batches[15]
    lpos, lneg = u.before_forward(pos, neg)
    o.before_forward(pos, neg)
    with pytest.raises(ss.StateError, match=r"between beforeForwardPass \(before_forward\) and afterOptimizerStep"):
        kept["exp_avg"].scatter([int(pos[0])], torch.full((1, DIM), 0.25))
    skipgram_loss(model["u"](lpos), model["u"](lneg), ctx).backward()
    opt.step()
    opt.zero_grad()
    u.after_step(pos, neg)
    o.after_step(pos, neg)
    _train(*pair, batches[16:])
    expected = _sparse_adam_in_memory(table0, batches, backend)
    assert_same(_tables(u, o), expected)


def test_writes_through_table_and_state_between_steps_reach_training_with_a_cache(rng, backend):
    """u.table and o.state hand out current tables whose writes the next steps see, as without a cache."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 30)
    runs = []
    for cache_rows in (0, 20):
        pair = _pair(backend, cache_rows, table0, eps=1e-30)
        model, opt, u, o = pair
        for start in range(0, len(batches), 10):
            chunk = batches[start:start + 10]
            _train(*pair, chunk)
            # The chunk's most used row: the cache, which keeps the rows used most, holds it now
            # (a row of the chunk's first batch was often evicted since, at seed 1 among others).
            ids = torch.cat([torch.cat([pos, neg.reshape(-1)]) for pos, neg, _ in chunk])
            hot = int(torch.bincount(ids.cpu(), minlength=ROWS).argmax())
            if cache_rows:
                assert hot in u._steps.cache.slot_row.tolist(), f"row {hot} was evicted"
            u.table.scatter([hot], torch.full((1, DIM), 0.5))
            o.state.tables["exp_avg"].scatter([hot], torch.full((1, DIM), 0.25))
        runs.append(_tables(u, o))
    assert_same(runs[1], runs[0])
    assert u.stats()["total"]["hits"] > 0
    pos, neg, ctx = batches[0]
    lpos, lneg = u.before_forward(pos, neg)  # the step's rows are in the cache until after_step
    o.before_forward(pos, neg)
    # Before optimizer.step() the cache writes its rows back for u.table and o.state, which read
    # what memory holds; from optimizer.step() until after_step they are refused.
    assert_same((u.table.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in o.state.tables.items()}),
                runs[1])
    skipgram_loss(model["u"](lpos), model["u"](lneg), ctx).backward()
    opt.step()
    with pytest.raises(ss.StateError, match="before afterOptimizerStep"):
        u.table
    with pytest.raises(ss.StateError, match="before afterOptimizerStep"):
        o.state


def test_views_of_table_and_state_kept_across_cached_steps_stay_current(rng, backend):
    """``getTorchVar()`` and a state table's ``to_numpy()`` kept across cached steps read every
    row's current value, as without a cache (the table view was 1.4 off in-memory SparseAdam after
    30 steps)."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 30)
    pair = _pair(backend, 20, table0, eps=1e-30)
    view, moments = pair[2].getTorchVar(), pair[3].state.tables["exp_avg"].to_numpy()
    with pytest.warns(RuntimeWarning, match="cache keeps no rows until it is dropped"):
        _train(*pair, batches)
    expected = _sparse_adam_in_memory(table0, batches, backend)
    assert_same((view.cpu().numpy(), {"exp_avg": moments}),
                (expected[0], {"exp_avg": expected[1]["exp_avg"]}))
    assert_same(_tables(*pair[2:]), expected)


def test_a_refused_load_leaves_the_shared_cache_as_it_was(rng, backend, tmp_path):
    """A switcher's load of a file it refuses flushed the shared cache before reading the file and
    dropped every cached row after the refusal: hits lost, and stats() counted the flush's writes."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 30)
    pair = _pair(backend, 20, table0, eps=1e-30)
    model, opt, u, o = pair
    _train(*pair, batches[:20])
    other = torch.nn.Embedding(CAPACITY, DIM)
    other_u = ss.ModelFactory(other, ROWS + 1, DIM, backend="numpy")
    other_u.save(tmp_path / "other.npy")
    other_o = ss.OptimizerFactory(torch.optim.Adam(other.parameters(), lr=0.05), ROWS + 1, DIM,
                                  torch.nn.ModuleDict({"u": other}), "u", backend="numpy")
    other_o.save(tmp_path / "other_state.h5")
    cache = u._steps.cache
    assert bool((cache.slot_row >= 0).any()) and bool(cache.dirty.any())
    for load, path, error in ((u.load, "missing.npy", ss.MissingFileError), (u.load, "other.npy", ss.FileFormatError),
                              (o.load, "missing.h5", ss.MissingFileError),
                              (o.load, "other_state.h5", ss.FileFormatError)):
        held, dirty, stats = cache.slot_row.clone(), cache.dirty.clone(), u.stats()
        with pytest.raises(error):
            load(tmp_path / path)
        assert u.stats() == stats, path
        assert torch.equal(cache.slot_row, held) and torch.equal(cache.dirty, dirty), path
    _train(*pair, batches[20:])
    expected = _sparse_adam_in_memory(table0, batches, backend)
    assert_same(_tables(u, o), expected)


def _trained_with_a_dirty_cache(rng, backend):
    """Both switchers of a random table, with Adam and a 20-row cache, after 20 steps (the cache
    holds rows not yet written back), and the same training in memory.

    Returns:
        ``(u, o, expected)``, ``expected`` as :func:`_sparse_adam_in_memory` returns it.
    """
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    batches = _batches(rng, backend, 20)
    pair = _pair(backend, 20, table0, eps=1e-30)
    _train(*pair, batches)
    return pair[2], pair[3], _sparse_adam_in_memory(table0, batches, backend)


@pytest.mark.parametrize("name", ["x.txt", "x.npz"])
def test_a_switcher_save_refused_for_its_suffix_leaves_the_shared_cache_as_it_was(name, rng, backend, tmp_path):
    """saveCupy / OptimizerFactory.save flushed the shared cache before the suffix was looked at."""
    u, o, expected = _trained_with_a_dirty_cache(rng, backend)
    cache = u._steps.cache
    for save in (u.saveCupy, o.save):
        assert bool(cache.dirty.any())
        dirty, stats = cache.dirty.clone(), u.stats()
        with pytest.raises(ss.OptionError):
            save(tmp_path / name)
        assert u.stats() == stats and torch.equal(cache.dirty, dirty)
    assert list(tmp_path.iterdir()) == []
    assert_same(_tables(u, o), expected)


def test_a_switcher_save_refused_inside_the_save_leaves_the_shared_cache_as_it_was(rng, backend, tmp_path):
    """saveCupy and OptimizerFactory.save had the shared cache write its rows back before
    HostTable.save / save_tables looked at the path: a save refused there (a missing directory, an
    HDF5 file of other datasets, a directory that is no checkpoint, an edited CURRENT) had cleared
    the dirty flags and counted the writes. The saves that succeed after them hold the trained rows."""
    u, o, expected = _trained_with_a_dirty_cache(rng, backend)
    cache = u._steps.cache
    refused = refused_save_paths(tmp_path)
    # A ModelFactory saves its one table (.npy, .h5), an OptimizerFactory a checkpoint (.h5, a directory).
    for save, (path, error) in [*((u.saveCupy, r) for r in refused if r[0].suffix),
                                *((o.save, r) for r in refused if r[0].suffix != ".npy")]:
        assert bool(cache.dirty.any())
        held, dirty, stats = cache.slot_row.clone(), cache.dirty.clone(), u.stats()
        with pytest.raises(error):
            save(path)
        assert u.stats() == stats, path.name
        assert torch.equal(cache.slot_row, held) and torch.equal(cache.dirty, dirty), path.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.h5", "edited", "photos"]
    u.saveCupy(tmp_path / "u.npy")
    o.save(tmp_path / "o.h5")
    with h5py.File(tmp_path / "o.h5") as f:
        saved = np.load(tmp_path / "u.npy"), {name: f[name][:] for name in o.state.tables}
    assert_same(saved, expected)
    assert_same(_tables(u, o), expected)
