"""ModelFactory / OptimizerFactory: the step protocol, errors that change nothing, checkpoints."""

import copy
import functools
import gc
import io
import os
import weakref

import numpy as np
import pytest
import torch

import speedswap as ss
from training_helpers import BATCH, CAPACITY, DIM, NEGS, NUM_ROWS, run_in_memory, skipgram_loss, zipf_batches

ROWS = 300


class SkipGram(torch.nn.Module):
    def __init__(self, capacity=CAPACITY):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(capacity, DIM)


def build(backend, seed_table, capacity=CAPACITY, lr=0.01):
    device = ss.get_backend(backend).device
    model = SkipGram(capacity).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, CPUPinn=True, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(seed_table)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", CPUPinn=True, backend=backend)
    return model, opt, u, o


def train(model, opt, u, o, batches):
    for pos, neg, ctx in batches:
        lp, ln = u.before_forward(pos, neg)
        o.before_forward(pos, neg)
        skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx).backward()
        opt.step()
        opt.zero_grad()
        u.after_step(pos, neg)
        o.after_step(pos, neg)


@pytest.fixture
def table0(rng):
    return rng.standard_normal((ROWS, DIM), dtype=np.float32)


def test_local_ids_are_slots_of_distinct_rows(backend, table0):
    model, opt, u, o = build(backend, table0)
    pos = np.array([[7, 7], [3, 299]])
    neg = [3, 5]
    local_pos, local_neg = u.beforeForwardPass(pos, neg)
    assert local_pos.shape == (2, 2) and local_neg.shape == (2,)
    rows = table0[np.concatenate([pos.ravel(), neg])]
    got = model.u_embeddings(torch.cat([local_pos.ravel(), local_neg])).detach().cpu().numpy()
    np.testing.assert_array_equal(got, rows)
    # 4 distinct rows use the first 4 slots.
    assert sorted(set(torch.cat([local_pos.ravel(), local_neg]).tolist())) == [0, 1, 2, 3]


def test_repeated_ids_sum_their_gradients(backend, table0):
    """Row 7 appears three times: SGD must move it by three gradients, like nn.Embedding."""
    device = ss.get_backend(backend).device
    emb = torch.nn.Embedding(4, DIM).to(device)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    u = ss.ModelFactory(emb, ROWS, DIM, storage="pageable", backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    ids = torch.tensor([7, 7, 7, 1])
    emb(u.before_forward(ids)).sum().backward()
    opt.step()
    u.after_step(ids)
    expected = table0.copy()
    expected[7] -= 0.3
    expected[1] -= 0.1
    np.testing.assert_allclose(u.to_numpy(), expected, rtol=1e-6, atol=1e-6)  # a row near 0.3 ends near 0


def test_placeholders_are_filled_in_place(backend, table0):
    model, opt, u, o = build(backend, table0)
    pos_in, neg_in = u.variableTransformer(2, 1, 3)
    assert pos_in.tolist() == [[0], [1]] and neg_in.tolist() == [[2, 3, 4], [5, 6, 7]]
    pos, neg = torch.tensor([9, 9]), torch.tensor([[9, 4, 4], [1, 2, 9]])
    local_pos, local_neg = u.before_forward(pos, neg)
    assert isinstance(pos_in, np.ndarray) and pos_in.dtype == np.int64  # SpeedTorch's type
    assert np.array_equal(pos_in.reshape(-1), local_pos.cpu().numpy())
    assert np.array_equal(neg_in.reshape(-1), local_neg.reshape(-1).cpu().numpy())
    assert pos_in[0, 0] == pos_in[1, 0] == neg_in[0, 0] == neg_in[1, 2]


def test_init_methods(backend, table0):
    # table0 comes from the rng fixture, whose seed also seeds torch's draws below.
    model, opt, u, o = build(backend, table0)
    u.zerosInit()
    assert not u.getNumpyVersion().any()
    u.uniformDistributionInit(-0.5, 0.25)
    values = u.getNumpyVersion()
    assert values.min() >= -0.5 and values.max() <= 0.25 and values.std() > 0.1
    u.normalDistributionInit(3.0, 0.5)
    # The mean of 2,400 draws has a standard deviation of 0.5 / 49 = 0.0102: 0.05 was 4.9 of them,
    # missed about once in a million seeds; 0.1 is 9.8 (never, in practice), and no other fill is near 3.
    assert abs(u.getNumpyVersion().mean() - 3.0) < 0.1
    u.customInit(torch.nn.init.constant_, 1.5)
    assert (u.getNumpyVersion() == 1.5).all()


def test_gpu_aliases_keep_the_table_in_device_storage(backend, table0):
    device = ss.get_backend(backend).device
    model = SkipGram().to(device)
    opt = torch.optim.Adagrad(model.parameters())
    u = ss.GPUPytorchModelFactory(model.u_embeddings, ROWS, DIM, backend=backend)
    o = ss.GPUPytorchOptimizerFactory(opt, ROWS, DIM, model, "u_embeddings.weight", backend=backend)
    assert u.table.storage == "device"
    assert all(t.storage == "device" for t in o.state.tables.values())


# ------------------------------------------------------------------ errors


def _host_tables(u, o):
    """The switchers' host tables themselves: mid-step the switchers refuse to hand them out, and
    the tables' own reads are refused (owner_copy reads their memory)."""
    return {"table": u._table, **o._state.tables}


def _snapshot(u, o):
    """The host tables' memory, copied (mid-step, getNumpyVersion() holds the stepped rows instead)."""
    return {k: t.owner_copy() for k, t in _host_tables(u, o).items()}


def _assert_unchanged(u, o, snap):
    for k, t in _host_tables(u, o).items():
        np.testing.assert_array_equal(t.owner_copy(), snap[k], err_msg=k)


@pytest.mark.parametrize("bad, error", [
    ([1, ROWS], ss.IdError), ([-1, 2], ss.IdError), ([1.0, 2.0], ss.DTypeError)])
def test_bad_ids_change_nothing(bad, error, backend, table0, rng):
    model, opt, u, o = build(backend, table0)
    train(model, opt, u, o, zipf_batches(rng, 3, ss.get_backend(backend).device, ROWS))
    snap = _snapshot(u, o)
    with pytest.raises(error):
        u.before_forward(bad)
    with pytest.raises(error):
        o.before_forward([0], bad)
    _assert_unchanged(u, o, snap)
    # The switchers are still usable.
    train(model, opt, u, o, zipf_batches(rng, 2, ss.get_backend(backend).device, ROWS))


def test_capacity_overflow_names_the_capacity(backend, table0):
    model, opt, u, o = build(backend, table0, capacity=8)
    snap = _snapshot(u, o)
    with pytest.raises(ss.CapacityError, match=f"of the {ROWS} x {DIM} table.* at most 8.*more rows "
                       r"in the model's embedding \(8 now\)"):
        u.before_forward(torch.arange(9))
    with pytest.raises(ss.CapacityError):
        u.before_forward(torch.arange(5), torch.arange(5, 10))
    _assert_unchanged(u, o, snap)
    u.before_forward(torch.tensor([1, 2, 1, 2, 3, 4, 5, 6, 7, 8, 8]))  # 8 distinct rows fit


def test_after_step_before_any_before_forward_says_so(backend, table0):
    model, opt, u, o = build(backend, table0)
    snap = _snapshot(u, o)
    for switcher in (u, o):
        with pytest.raises(ss.StateError, match=r"afterOptimizerStep \(after_step\) before any beforeForwardPass"):
            switcher.after_step(torch.tensor([1, 2]))
    _assert_unchanged(u, o, snap)


def test_mismatched_after_step_changes_nothing(backend, table0):
    model, opt, u, o = build(backend, table0)
    pos, neg = torch.tensor([1, 2]), torch.tensor([[3], [4]])
    lp, ln = u.before_forward(pos, neg)
    o.before_forward(pos, neg)
    context = torch.ones(2, DIM, device=model.u_embeddings.weight.device)
    skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), context).backward()
    opt.step()
    snap = _snapshot(u, o)
    for wrong in [(torch.tensor([2, 1]), neg), (pos, None), (pos, torch.tensor([[3], [5]]))]:
        with pytest.raises(ss.StateError, match=r"other than those of the last beforeForwardPass \(before_forward\)"):
            u.after_step(*wrong)
        with pytest.raises(ss.StateError):
            o.after_step(*wrong)
    _assert_unchanged(u, o, snap)
    u.after_step(pos, neg)
    o.after_step(pos, neg)
    assert not np.array_equal(u.to_numpy(), snap["table"])
    with pytest.raises(ss.StateError, match="without a matching before_forward"):
        u.after_step(pos, neg)


def test_placeholder_shape_mismatch_changes_nothing(backend, table0):
    model, opt, u, o = build(backend, table0)
    pos_in = u.variableTransformer(4, 1)
    before = pos_in.copy()
    with pytest.raises(ss.ShapeError, match="variableTransformer"):
        u.before_forward(torch.tensor([1, 2, 3]))
    assert np.array_equal(pos_in, before)
    u.before_forward(torch.tensor([1, 2, 3, 3]))


def test_construction_errors(backend):
    device = ss.get_backend(backend).device
    model = SkipGram().to(device)
    with pytest.raises(ss.ShapeError, match="embed_dimension"):
        ss.ModelFactory(model.u_embeddings, ROWS, DIM + 1, backend=backend)
    with pytest.raises(ss.DTypeError):
        ss.ModelFactory(model.u_embeddings, ROWS, DIM, datatype="float16", backend=backend)
    with pytest.raises(ss.OptionError, match="no parameter or embedding 'v_embeddings'"):
        ss.OptimizerFactory(torch.optim.Adam(model.parameters()), ROWS, DIM, model, "v_embeddings",
                            backend=backend)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ss.OptionError, match="element-wise"):
        ss.OptimizerFactory(lbfgs, ROWS, DIM, model, "u_embeddings", backend=backend)
    other = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2, device=device))])
    with pytest.raises(ss.OptionError, match="does not hold"):
        ss.OptimizerFactory(other, ROWS, DIM, model, "u_embeddings", backend=backend)


def test_a_dtype_mismatch_names_the_argument_that_fixes_it(backend):
    """The switchers' dtype arguments have two names (ModelFactory's ``datatype``, SpeedTorch's, and
    OptimizerFactory's ``dtype``); the refusal said only "pass the same dtype", naming neither."""
    device = ss.get_backend(backend).device
    model = SkipGram().to(device=device, dtype=torch.float64)
    with pytest.raises(ss.DTypeError, match="holds torch.float64.*pass datatype='float64'"):
        ss.ModelFactory(model.u_embeddings, ROWS, DIM, backend=backend)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ss.DTypeError, match="holds torch.float64.*pass dtype='float64'"):
        ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend=backend)
    # Passed as the message says, both build.
    ss.ModelFactory(model.u_embeddings, ROWS, DIM, datatype="float64", backend=backend)
    ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", dtype="float64", backend=backend)


def test_switchers_take_embeddings_only(table0, rng):
    """An nn.Linear has a 2-D weight too, but its forward multiplies by the rows the ids should pick."""
    linear = torch.nn.Linear(DIM, DIM)
    with pytest.raises(ss.OptionError, match="got a Linear, which is not an embedding"):
        ss.ModelFactory(linear, ROWS, DIM, backend="numpy")
    with pytest.raises(ss.OptionError, match="got a Linear, which is not an embedding"):
        ss.OptimizerFactory(torch.optim.Adam(linear.parameters()), ROWS, DIM,
                            torch.nn.ModuleDict({"l": linear}), "l", backend="numpy")
    # An nn.EmbeddingBag looks its rows up by id: it trains as in memory.
    bag = torch.nn.EmbeddingBag(CAPACITY, DIM, mode="sum")
    opt = torch.optim.SGD(bag.parameters(), lr=0.05)
    u = ss.ModelFactory(bag, ROWS, DIM, backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    ref = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    ref.weight.data.copy_(torch.from_numpy(table0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for pos, neg, ctx in zipf_batches(rng, 30, "cpu", ROWS):
        ids = torch.cat([pos[:, None], neg], dim=1)
        local = u.before_forward(ids)
        torch.nn.functional.logsigmoid(bag(local) * ctx).sum().backward()
        opt.step(); opt.zero_grad()
        u.after_step(ids)
        torch.nn.functional.logsigmoid(ref(ids) * ctx).sum().backward()
        ref_opt.step(); ref_opt.zero_grad()
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_switchers_over_a_mean_embedding_bag_with_offsets_train_as_sparse_adagrad_in_memory(rng):
    """The README's click-model section: a SpeedTorch model pooling bags of ids with offsets keeps
    its nn.EmbeddingBag(mode="mean") as the working set and trains as the whole table would."""
    rows = rng.standard_normal((ROWS, DIM))  # float64: a reordered sum stays far below the tolerance
    bag = torch.nn.EmbeddingBag(CAPACITY, DIM, mode="mean", dtype=torch.float64)
    opt = torch.optim.Adagrad(bag.parameters(), lr=0.05)
    u = ss.ModelFactory(bag, ROWS, DIM, "float64", backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(rows)))
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"bag": bag}), "bag", dtype="float64",
                            backend="numpy")
    ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(rows.copy()), freeze=False, mode="mean",
                                                sparse=True)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    for pos, neg, _ in zipf_batches(rng, 30, "cpu", ROWS):
        ids = torch.cat([pos, neg.flatten()])
        # Every id in some bag and no bag empty, whatever the draw: bags start at 0 and at distinct cuts.
        cuts = np.sort(rng.choice(np.arange(1, len(ids)), len(pos) - 1, replace=False))
        offsets = torch.from_numpy(np.concatenate([[0], cuts]))
        target = torch.from_numpy(rng.standard_normal((len(pos), DIM)))
        local = u.before_forward(ids)
        o.before_forward(ids)
        (bag(local, offsets) - target).pow(2).sum().backward()
        opt.step(); opt.zero_grad()
        u.after_step(ids)
        o.after_step(ids)
        (ref(ids, offsets) - target).pow(2).sum().backward()
        ref_opt.step(); ref_opt.zero_grad()
    np.testing.assert_allclose(u.getNumpyVersion(), ref.weight.detach().numpy(), rtol=0, atol=1e-12)
    assert not np.allclose(u.getNumpyVersion(), rows, atol=1e-3)  # it trained


def test_lost_optimizer_state_is_refused(backend, table0, rng):
    model, opt, u, o = build(backend, table0)
    batches = zipf_batches(rng, 2, ss.get_backend(backend).device, ROWS)
    train(model, opt, u, o, batches[:1])
    opt.state.clear()
    with pytest.raises(ss.StateError, match="load_state_dict"):
        o.before_forward(*batches[1][:2])


def test_an_older_optimizer_state_dict_without_the_factorys_load_is_refused(backend, table0, rng,
                                                                              tmp_path):
    """The state dict holds the last step's scratch, not the rows' state: the tables must come too."""
    model, opt, u, o = build(backend, table0)
    batches = zipf_batches(rng, 8, ss.get_backend(backend).device, ROWS)
    train(model, opt, u, o, batches[:2])
    o.save(tmp_path / "opt")
    older = copy.deepcopy(opt.state_dict())
    train(model, opt, u, o, batches[2:5])
    opt.load_state_dict(older)
    before = {name: table.to_numpy(copy=True) for name, table in o.state.tables.items()}
    with pytest.raises(ss.StateError, match="OptimizerFactory's load"):
        o.before_forward(*batches[5][:2])
    for name, table in o.state.tables.items():
        np.testing.assert_array_equal(table.to_numpy(), before[name], err_msg=name)
    o.load(tmp_path / "opt")  # the tables saved with that state dict: training goes on
    train(model, opt, u, o, batches[5:])


def test_a_round_trip_of_the_optimizer_state_before_a_step_without_the_factorys_rows_changes_nothing(
        backend, table0, rng):
    """``opt.load_state_dict(opt.state_dict())``, then a step that trains only another layer after
    ``zero_grad(set_to_none=False)``: the optimizer stepped the loaded copies of the embedding's
    scratch state at its zero gradient, and the next ``before_forward`` took them for another
    state_dict's and refused ("was replaced since the last step"). Training goes on as without the
    round trip."""
    device = ss.get_backend(backend).device
    batches = zipf_batches(rng, 5, device, ROWS)
    init_seed, runs = int(rng.integers(2**31)), []
    for round_trip in (False, True):
        torch.manual_seed(init_seed)  # the same linear layer both ways
        model = SkipGram().to(device)
        model.lin = torch.nn.Linear(DIM, 1).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, backend=backend)
        u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
        o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend=backend)
        for step, (pos, neg, ctx) in enumerate(batches):
            if step == 2:  # a batch for the dense layer only
                if round_trip:
                    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                model.lin(ctx).pow(2).sum().backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                continue
            lp, ln = u.before_forward(pos, neg)
            o.before_forward(pos, neg)
            skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            u.after_step(pos, neg)
            o.after_step(pos, neg)
        runs.append((u.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in o.state.tables.items()}))
    (table, state), (table_rt, state_rt) = runs
    np.testing.assert_array_equal(table_rt, table)
    for name in state:
        np.testing.assert_array_equal(state_rt[name], state[name], err_msg=name)


def test_sparse_adam_steps_switched_tables_through_a_step_without_one_of_them(backend, rng):
    """Two dense ``nn.Embedding``s switched for SparseAdam (SpeedTorch's README builds them with
    ``sparse=False``), a step that uses only the first after ``zero_grad(set_to_none=False)``: the
    second's zeroed gradient is dense, and torch raised "SparseAdam does not support dense
    gradients"; in memory a sparse embedding's zeroed gradient is an empty sparse one, whose step
    SparseAdam counts. Both tables train on as two in-memory sparse embeddings."""
    device = ss.get_backend(backend).device
    tables0 = rng.standard_normal((2, ROWS, DIM), dtype=np.float32)
    model = torch.nn.ModuleDict({k: torch.nn.Embedding(CAPACITY, DIM) for k in "ab"}).to(device)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.01)
    reference = torch.nn.ModuleDict({k: torch.nn.Embedding.from_pretrained(torch.from_numpy(t.copy()), freeze=False,
                                                                          sparse=True)
                                     for k, t in zip("ab", tables0)}).to(device)
    ref_opt = torch.optim.SparseAdam(list(reference.parameters()), lr=0.01)
    switches = {}
    for k, t in zip("ab", tables0):
        switches[k] = (ss.ModelFactory(model[k], ROWS, DIM, backend=backend),
                       ss.OptimizerFactory(opt, ROWS, DIM, model, k, backend=backend))
        switches[k][0].customInit(lambda w, t=t: w.copy_(torch.from_numpy(t)))
    for step, (pos, neg, ctx) in enumerate(zipf_batches(rng, 6, device, ROWS)):
        used = "a" if step % 3 == 1 else "ab"
        for m, o, local in ((model, opt, True), (reference, ref_opt, False)):
            loss = 0
            for k in used:
                lp, ln = switches[k][0].before_forward(pos, neg) if local else (pos, neg)
                if local:
                    switches[k][1].before_forward(pos, neg)
                loss = loss + skipgram_loss(m[k](lp), m[k](ln), ctx)
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=False)
            for k in used if local else ():
                switches[k][0].after_step(pos, neg)
                switches[k][1].after_step(pos, neg)
    for k in "ab":
        np.testing.assert_allclose(switches[k][0].to_numpy(), reference[k].weight.detach().cpu().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=k)
    # The second table's steps count the steps without it, as in memory.
    assert opt.state[model["b"].weight]["step"] == ref_opt.state[reference["b"].weight]["step"] == 6


def test_opt_init_leaves_the_new_state_files_of_an_mmap_optimizer_factory_sparse(rng, tmp_path):
    """optInit(), which SpeedTorch's recipe calls right after building the OptimizerFactory, wrote
    Adam's zeros into state files created as sparse files of zeros: at 10^7 x 32 that made 1.2 GB
    of disk dense per file (attach() was fixed in 2911649, optInit() was not)."""
    rows = 20_000
    probe = ss.HostTable.empty(rows, DIM, storage="mmap", path=tmp_path / "probe.npy", backend="numpy")
    if os.stat(tmp_path / "probe.npy").st_blocks * 512 >= probe.to_numpy().nbytes:
        pytest.skip("this file system stores no sparse files")
    probe.close()
    table0 = rng.standard_normal((rows, DIM), dtype=np.float32)
    model = SkipGram()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-30)  # SparseAdam adds eps elsewhere
    u = ss.ModelFactory(model.u_embeddings, rows, DIM, storage="mmap", path=tmp_path / "u.npy",
                        backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, rows, DIM, model, "u_embeddings", storage="mmap",
                            path=tmp_path / "opt", backend="numpy")
    o.optInit()
    for table in o.state.tables.values():
        table.flush()
    for name in ("exp_avg", "exp_avg_sq"):
        file = tmp_path / "opt" / f"{name}.npy"
        assert os.stat(file).st_blocks * 512 < os.stat(file).st_size / 4, f"{name}.npy was written whole"
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30)
    batches = zipf_batches(rng, 3, "cpu", rows)  # the state rows read from the holes are torch's zeros
    train(model, opt, u, o, batches)
    for pos, neg, ctx in batches:
        skipgram_loss(ref(pos), ref(neg), ctx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    np.testing.assert_allclose(u.to_numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    o.optInit()  # the tables hold trained state now: it is reset
    assert all(not table.to_numpy().any() for table in o.state.tables.values())


# ------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("fmt", ["h5", "dir"])
def test_checkpoint_restore_equals_never_stopping(fmt, backend, table0, rng, tmp_path):
    device = ss.get_backend(backend).device
    batches = zipf_batches(rng, 60, device, ROWS)
    straight = build(backend, table0)
    train(*straight, batches)

    first = build(backend, table0)
    train(*first, batches[:25])
    model, opt, u, o = first
    u.saveCupy(tmp_path / "u.npy")
    o.save(tmp_path / ("opt.h5" if fmt == "h5" else "opt"))
    opt_bytes = io.BytesIO()
    torch.save(opt.state_dict(), opt_bytes)

    other = rng.standard_normal((ROWS, DIM), dtype=np.float32)  # would differ if not loaded
    model, opt, u, o = resumed = build(backend, other)
    u.loadCupy(tmp_path / "u.npy")
    o.load(tmp_path / ("opt.h5" if fmt == "h5" else "opt"))
    opt_bytes.seek(0)
    opt.load_state_dict(torch.load(opt_bytes))
    train(*resumed, batches[25:])
    np.testing.assert_array_equal(u.to_numpy(), straight[2].to_numpy())
    for name, table in o.state.tables.items():
        np.testing.assert_array_equal(table.to_numpy(), straight[3].state.tables[name].to_numpy())


def test_loading_another_shape_changes_nothing(backend, table0, tmp_path):
    model, opt, u, o = build(backend, table0)
    np.save(tmp_path / "small.npy", np.ones((ROWS - 1, DIM), np.float32))
    snap = _snapshot(u, o)
    with pytest.raises(ss.FileFormatError, match="holds"):
        u.load(tmp_path / "small.npy")
    # A checkpoint of another optimizer, and one of another table size.
    sgd_model = SkipGram()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    ss.OptimizerFactory(sgd, ROWS, DIM, sgd_model, "u_embeddings", storage="pageable",
                        backend="numpy").save(tmp_path / "sgd.h5")
    with pytest.raises(ss.FileFormatError, match="holds SGD optimizer state, but Adam is attached here"):
        o.load(tmp_path / "sgd.h5")
    small_model = SkipGram()
    small_opt = torch.optim.Adam(small_model.parameters())
    ss.OptimizerFactory(small_opt, ROWS - 1, DIM, small_model, "u_embeddings",
                        storage="pageable", backend="numpy").save(tmp_path / "small_opt")
    with pytest.raises(ss.FileFormatError):
        o.load(tmp_path / "small_opt")
    _assert_unchanged(u, o, snap)


def test_directory_checkpoint_never_replaces_a_foreign_directory(backend, table0, tmp_path):
    model, opt, u, o = build(backend, table0)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ss.errors.PathError, match="not a speedswap checkpoint"):
        o.save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    o.save(tmp_path / "ckpt")
    o.save(tmp_path / "ckpt")  # replacing its own checkpoint is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "mine"]


def test_switchers_refuse_several_ranks_and_name_the_sharded_embedding(monkeypatch):
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    model = torch.nn.Embedding(8, 4)
    with pytest.raises(ss.OptionError, match="ShardedOffloadedEmbedding"):
        ss.ModelFactory(model, 100, 4, backend="numpy")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ss.OptionError, match="2 ranks"):
        ss.OptimizerFactory(opt, 100, 4, torch.nn.ModuleDict({"e": model}), "e", backend="numpy")
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    ss.ModelFactory(model, 100, 4, backend="numpy")  # one rank: fine


def _placeholder_run(convert_once, rng, steps=4, by_keyword=False):
    """SpeedTorch-style steps feeding placeholders; ``convert_once`` copies them before the loop.

    Returns:
        The table after the steps, and what in-memory SGD makes of the initial table: each step
        takes 0.1 from its four distinct rows (the gradient of a sum is one).
    """
    model = torch.nn.Embedding(16, DIM)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    u = ss.ModelFactory(model, ROWS, DIM, CPUPinn=True, backend="numpy")
    u.uniformDistributionInit(-0.1, 0.1)
    expected = u.getNumpyVersion().copy()
    pos_in = u.variableTransformer(4, 1)
    fed = convert_once(pos_in)
    for _ in range(steps):
        ids = torch.from_numpy(rng.choice(ROWS, size=4, replace=False))
        u.beforeForwardPass(ids)
        (model(input=fed) if by_keyword else model(fed)).sum().backward()
        opt.step()
        opt.zero_grad()
        u.afterOptimizerStep(ids)
        expected[ids.numpy()] -= np.float32(0.1)
    return u.getNumpyVersion(), expected


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_a_placeholder_copied_once_before_the_loop_raises_before_training_the_wrong_rows(by_keyword, rng):
    """Ids passed as ``model(input=ids)`` went unchecked (the hook read only positional ones)."""
    with pytest.raises(ss.StateError, match="earlier content of the variableTransformer"):
        _placeholder_run(lambda x: torch.tensor(x), rng, by_keyword=by_keyword)


@pytest.mark.parametrize("mistake", ["copy kept", "reshaped copy kept", "copy of new placeholders", "table ids"])
def test_wrong_ids_fed_after_the_first_forwards_raise_before_training_the_wrong_rows(mistake, rng):
    """The model's ids were checked in its embedding's first 20 forwards only: a copy of the placeholders
    kept from a later step on (a model that keeps its input tensor), a copy of placeholders made anew by
    a later variableTransformer, or the table ids fed after those forwards trained the wrong rows
    silently (1.08 off in-memory SGD at the end). Every forward is checked now, a copy reshaped
    (squeeze(1)) too, and the refused forward changes nothing."""
    table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32)
    batches = zipf_batches(rng, 30, "cpu")
    emb = torch.nn.Embedding(CAPACITY, DIM)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    u = ss.ModelFactory(emb, NUM_ROWS, DIM, backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    pos_in, neg_in = u.variableTransformer(BATCH, 1, NEGS)
    late = 25  # two forwards a step: past the first 20
    for step, (pos, neg, ctx) in enumerate(batches):
        if step == late and mistake == "copy of new placeholders":
            pos_in, neg_in = u.variableTransformer(BATCH, 1, NEGS)
            kept = torch.tensor(pos_in)
        u.beforeForwardPass(pos, neg)
        if step == late - 1:
            kept = torch.tensor(pos_in).squeeze(1) if mistake == "reshaped copy kept" else torch.tensor(pos_in)
        if step == late:
            with pytest.raises(ss.StateError, match="earlier content of the variableTransformer|was fed id"):
                emb(pos if mistake == "table ids" else kept)
        skipgram_loss(emb(torch.from_numpy(pos_in)).squeeze(1), emb(torch.from_numpy(neg_in)), ctx).backward()
        opt.step()
        opt.zero_grad()
        u.afterOptimizerStep(pos, neg)
    expected, _ = run_in_memory(lambda params: torch.optim.SGD(params, lr=0.1), table0, batches, "cpu")
    assert not np.allclose(expected, table0, atol=1e-3)
    np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-5, atol=1e-6)


def test_a_from_numpy_view_of_the_placeholder_stays_current(rng):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        table, expected = _placeholder_run(lambda x: torch.from_numpy(x), rng)
    # The same float32 subtractions on both sides, at most four per element.
    np.testing.assert_allclose(table, expected, rtol=1e-6, atol=1e-7)


def test_a_step_without_the_optimizer_factorys_before_forward_is_refused_before_it_runs(backend, table0):
    model, opt, u, o = build(backend, table0)
    pos, neg = torch.tensor([1, 2]), torch.tensor([[3], [4]])
    context = torch.ones(2, DIM, device=model.u_embeddings.weight.device)
    for step in range(3):
        lp, ln = u.before_forward(pos, neg)
        if step < 2:
            o.before_forward(pos, neg)
        skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), context).backward()
        if step < 2:
            opt.step()
            opt.zero_grad()
            u.after_step(pos, neg)
            o.after_step(pos, neg)
    snap = _snapshot(u, o)
    with pytest.raises(ss.StateError, match="OptimizerFactory's did not"):
        opt.step()
    _assert_unchanged(u, o, snap)


@pytest.mark.parametrize("between", ["no step", "a step"])
def test_a_gradient_left_from_the_last_step_is_not_added_to_other_rows(backend, table0, between):
    """Slots hold other rows every step: accumulation across steps, or a forgotten zero_grad(), raises."""
    model, opt, u, o = build(backend, table0)
    context = torch.ones(2, DIM, device=model.u_embeddings.weight.device)

    def cycle(pos, neg, step=True):
        lp, ln = u.before_forward(pos, neg)
        o.before_forward(pos, neg)
        skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), context).backward()
        if step:
            opt.step()
        u.after_step(pos, neg)
        o.after_step(pos, neg)

    if between == "no step":
        # Accumulating across steps begins with an after_step that no optimizer.step() preceded.
        snap = _snapshot(u, o)
        with pytest.raises(ss.StateError, match=r"afterOptimizerStep \(after_step\) without"):
            cycle(torch.tensor([1, 2]), torch.tensor([[3], [4]]), step=False)
        _assert_unchanged(u, o, snap)
        return
    cycle(torch.tensor([1, 2]), torch.tensor([[3], [4]]))  # no zero_grad()
    snap = _snapshot(u, o)
    with pytest.raises(ss.StateError, match="left by the previous step"):
        cycle(torch.tensor([5, 6]), torch.tensor([[7], [8]]))
    _assert_unchanged(u, o, snap)


@pytest.mark.parametrize("set_to_none", [True, False, "through .data"])
def test_zero_grad_after_before_forward_is_fine(backend, table0, set_to_none):
    """Either kind of zero_grad(), and zeroing that keeps the gradient's version (as
    _foreach_zero_ does on CUDA for an optimizer built with foreach=True; here through .data)."""
    model, opt, u, o = build(backend, table0)
    device = model.u_embeddings.weight.device
    context = torch.ones(2, DIM, device=device)
    batches = [(torch.tensor([1, 2]), torch.tensor([[3], [4]])), (torch.tensor([5, 6]), torch.tensor([[7], [8]]))]
    for pos, neg in batches:
        lp, ln = u.before_forward(pos, neg)
        o.before_forward(pos, neg)
        grad = model.u_embeddings.weight.grad
        if set_to_none == "through .data":
            if grad is not None:
                version = grad._version
                grad.data.zero_()
                assert grad._version == version
        else:
            opt.zero_grad(set_to_none=set_to_none)
        skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), context).backward()
        opt.step()
        u.after_step(pos, neg)
        o.after_step(pos, neg)
    assert_trained_as_lazy_adam(u, table0, [(pos.to(device), neg.to(device), context) for pos, neg in batches])


def assert_trained_as_lazy_adam(u, table0, batches):
    """``u``'s table equals in-memory Adam (``build``'s) on the rows each of ``batches`` touched.

    Each step's rows are distinct, so both sides run the same float32 arithmetic on each element,
    apart from where torch's vectorised kernels fuse a multiply-add that the reference's
    (a tensor of another length) leaves unfused: a few ulps of values near 1.
    """
    expected, _ = run_in_memory(lambda p: torch.optim.Adam(p, lr=0.01), table0, batches,
                                batches[0][2].device, initial_state=lambda name, group: 0.0)
    np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-6, atol=1e-6)


def test_a_step_that_raised_leaves_the_next_steps_working(backend, table0):
    """A check that raises inside optimizer.step(): the loop catches it, drops the batch, goes on."""
    model, opt, u, o = build(backend, table0)
    device = model.u_embeddings.weight.device
    context = torch.ones(2, DIM, device=device)

    def refuse_once(*_):
        if refuse_once.armed:
            refuse_once.armed = False
            raise RuntimeError("not finite")
    refuse_once.armed = False
    opt.register_step_pre_hook(refuse_once)
    capacity = model.u_embeddings.weight.shape
    batches = [(torch.tensor([1, 2]), torch.tensor([[3], [4]])), (torch.tensor([5, 6]), torch.tensor([[7], [8]])),
               (torch.tensor([2, 9]), torch.tensor([[3], [1]]))]
    for step, (pos, neg) in enumerate(batches):
        lp, ln = u.before_forward(pos, neg)
        o.before_forward(pos, neg)
        assert model.u_embeddings.weight.shape == capacity
        skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), context).backward()
        refuse_once.armed = step == 1
        try:
            opt.step()
        except RuntimeError:
            assert step == 1
        opt.zero_grad()
        u.after_step(pos, neg)
        o.after_step(pos, neg)
    # The batch whose step raised is dropped: its rows keep their values, the others train on.
    assert_trained_as_lazy_adam(u, table0, [(pos.to(device), neg.to(device), context)
                                            for step, (pos, neg) in enumerate(batches) if step != 1])


def test_switchers_built_again_and_again_leave_no_hooks_behind():
    model = torch.nn.Embedding(8, DIM)
    for _ in range(4):
        switcher = ss.ModelFactory(model, ROWS, DIM, backend="numpy")
        del switcher
        gc.collect()
    assert not model.weight._backward_hooks
    switcher = ss.ModelFactory(model, ROWS, DIM, backend="numpy")  # named: collected, it would take its hook
    assert len(model.weight._backward_hooks) == 1


@pytest.mark.parametrize("then", ["backward", "step"])
def test_closed_switchers_leave_the_embedding_to_train_as_in_memory(then, backend, table0, rng):
    """Closed, the switchers kept their gradient hook and step check on the parameter while the
    objects lived: a backward onto the gradient an evaluation step found, or a step() with the
    gradient still on, raised StateError, and zero_grad() left the last gradient in memory."""
    model, opt, u, o = build(backend, table0)
    emb = model.u_embeddings
    (pos, neg, ctx), (pos2, neg2, ctx2) = zipf_batches(rng, 2, emb.weight.device, ROWS)
    lp, ln = u.before_forward(pos, neg)
    o.before_forward(pos, neg)
    skipgram_loss(emb(lp), emb(ln), ctx).backward()
    opt.step()  # zero_grad() at the loop's start: the gradient stays on
    u.after_step(pos, neg)
    o.after_step(pos, neg)
    if then == "backward":  # an evaluation step: a forward without backward
        lp, ln = u.before_forward(pos2, neg2)
        o.before_forward(pos2, neg2)
        with torch.no_grad():
            skipgram_loss(emb(lp), emb(ln), ctx2)
        u.after_step(pos2, neg2)
        o.after_step(pos2, neg2)
    u.close()
    o.close()
    reference = copy.deepcopy(model)
    reference.u_embeddings.weight.grad = emb.weight.grad.clone()  # a Parameter's deepcopy drops it
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # else both step the same moments
    for trained, optimizer in ((model, opt), (reference, ref_opt)):
        if then == "backward":  # adds to the gradient on, as an nn.Embedding's does
            skipgram_loss(trained.u_embeddings(lp), trained.u_embeddings(ln), ctx2).backward()
        optimizer.step()
    torch.testing.assert_close(emb.weight.grad, reference.u_embeddings.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(emb.weight, reference.u_embeddings.weight, rtol=0, atol=0)
    left = weakref.ref(emb.weight.grad)
    opt.zero_grad()
    gc.collect()
    assert left() is None, "the closed switchers still hold the embedding's last gradient"


@pytest.mark.parametrize("copy_", ["False", "no", 0])
def test_to_numpy_refuses_a_copy_that_is_not_a_bool(copy_, backend, table0, rng):
    """to_numpy(copy="False") is true to Python: it returned a copy, and what was written into it,
    meant for the table, was lost without an error."""
    model, opt, u, o = build(backend, table0)
    with pytest.raises(ss.OptionError, match=f"copy must be True .* or False, got {copy_!r}"):
        u.to_numpy(copy=copy_)
    view = u.to_numpy(copy=False)
    rows = rng.standard_normal((2, DIM), dtype=np.float32)
    view[[3, 7]] = rows  # the way that works: written into the table's own memory
    np.testing.assert_array_equal(u.getNumpyVersion()[[3, 7]], rows)


@pytest.mark.parametrize("make,refused", [
    (lambda p: torch.optim.SGD(p, lr=0.1), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
    (lambda p: torch.optim.Adam(p, lr=0.1), True),
    (lambda p: torch.optim.Adagrad(p, lr=0.1), True),
])
@pytest.mark.parametrize("in_closure", [False, True], ids=["step()", "step(closure)"])
def test_a_model_factory_alone_with_per_row_optimizer_state_is_refused_at_the_step(make, refused, in_closure,
                                                                                     backend, table0, rng):
    """Without an OptimizerFactory, state kept per slot would move with the slot to other rows.

    With ``step(closure)`` the first step went through: the check looked for a gradient before the
    closure's backward made one."""
    device = ss.get_backend(backend).device
    model = SkipGram().to(device)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, storage="pageable", backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(model.parameters())
    head = torch.nn.Linear(DIM, 1).to(device)  # other parameters are unaffected
    head_opt = torch.optim.Adam(head.parameters(), lr=0.1)
    batches = zipf_batches(rng, 3, device, num_rows=ROWS)
    for pos, neg, ctx in batches:
        lp, ln = u.before_forward(pos, neg)

        def closure():
            opt.zero_grad()
            loss = skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx) + head(ctx).sum()
            loss.backward()
            return loss

        if not in_closure:
            closure()
        step = functools.partial(opt.step, closure) if in_closure else opt.step
        if refused:
            before = model.u_embeddings.weight.detach().clone()
            with pytest.raises(ss.OptionError, match="OptimizerFactory"):
                step()
            assert torch.equal(model.u_embeddings.weight, before)
        else:
            step()
        head_opt.step()
        opt.zero_grad()
        head_opt.zero_grad()
        u.after_step(pos, neg)
    if refused:
        np.testing.assert_array_equal(u.getNumpyVersion(), table0)
    else:  # stateless SGD trains as in memory (repeated ids' gradients summed in another order)
        expected, _ = run_in_memory(make, table0, batches, device)
        np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-5, atol=1e-6)


def test_lbfgs_stepping_a_model_factory_alone_is_refused_before_any_row_changes(backend, table0, rng):
    """LBFGS keeps its history (search directions, the last gradient) over every element of the
    working set, flattened: not shaped like the parameter, so a ModelFactory alone let it through,
    and from the second step on it moved this step's rows along directions of another step's rows
    (0.30 from in-memory LBFGS after two steps). No OptimizerFactory can switch that state: the
    refusal says to step the embedding with another optimizer."""
    device = ss.get_backend(backend).device
    model = SkipGram().to(device)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, storage="pageable", backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.LBFGS(model.u_embeddings.parameters(), lr=0.5, max_iter=3)
    for pos, neg, ctx in zipf_batches(rng, 3, device, num_rows=ROWS):
        lp, ln = u.before_forward(pos, neg)

        def closure():
            opt.zero_grad()
            loss = skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx)
            loss.backward()
            return loss

        before = model.u_embeddings.weight.detach().clone()
        with pytest.raises(ss.OptionError, match="LBFGS .*element-wise optimizer"):
            opt.step(closure)
        assert torch.equal(model.u_embeddings.weight, before)
        opt.zero_grad()
        u.after_step(pos, neg)
    np.testing.assert_array_equal(u.getNumpyVersion(), table0)


def test_a_frozen_embedding_of_a_model_factory_alone_may_sit_in_a_stateful_optimizer(backend, table0):
    """Adam skips a parameter without a gradient, so there is no state to mix."""
    device = ss.get_backend(backend).device
    model = SkipGram().to(device)
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, storage="pageable", backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    model.u_embeddings.weight.requires_grad_(False)
    head = torch.nn.Linear(DIM, 1).to(device)
    opt = torch.optim.Adam(list(model.parameters()) + list(head.parameters()), lr=0.1)
    ids = torch.tensor([3, 9], device=device)
    head(model.u_embeddings(u.before_forward(ids))).sum().backward()
    opt.step()
    u.after_step(ids)
    np.testing.assert_array_equal(u.getNumpyVersion(), table0)


def test_an_optimizer_factory_alone_over_the_whole_table_is_refused(backend, table0):
    """Its state rows go to slots 0..k-1, which in a whole table are other rows; with a working-set
    embedding (smaller than the table) a lone OptimizerFactory is the user's own swapping and is allowed."""
    device = ss.get_backend(backend).device
    whole = SkipGram(capacity=ROWS).to(device)
    opt = torch.optim.Adam(whole.parameters(), lr=0.1)
    o = ss.OptimizerFactory(opt, ROWS, DIM, whole, "u_embeddings", storage="pageable", backend=backend)
    with pytest.raises(ss.OptionError, match="whole table"):
        o.before_forward(torch.tensor([1, 2], device=device))
    assert not o.state.tables["exp_avg"].to_numpy().any()
    u = ss.ModelFactory(whole.u_embeddings, ROWS, DIM, storage="pageable", backend=backend)
    o.before_forward(torch.tensor([1, 2], device=device))  # with its ModelFactory it is fine
    u.before_forward(torch.tensor([1, 2], device=device))
    small = SkipGram().to(device)
    alone = ss.OptimizerFactory(torch.optim.Adam(small.parameters(), lr=0.1), ROWS, DIM, small, "u_embeddings",
                                storage="pageable", backend=backend)
    assert alone.before_forward(torch.tensor([7, 3, 7], device=device)).tolist() == [1, 0, 1]


@pytest.mark.parametrize("fed", ["table ids", "slots past the step's rows"])
def test_a_forward_fed_other_ids_than_the_local_ones_is_refused_before_training(fed, rng):
    """Ids that name no slot of the step: the table ids themselves, or past its distinct rows.

    Table ids of the capacity or more raised torch's bare 'index out of range in self'; smaller
    ones trained slots that hold other rows (or none), and the step wrote them back.
    """
    capacity = 16
    model = torch.nn.Embedding(capacity, DIM)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    u = ss.ModelFactory(model, ROWS, DIM, backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    before = u.getNumpyVersion()
    # Six distinct ids, the first one no slot has, as table ids have (set after the draw, it could
    # repeat another one: 5 rows, and the test failed for seed 659720812).
    first = int(rng.integers(capacity, ROWS))
    rest = rng.choice(np.setdiff1d(np.arange(ROWS), [first]), size=5, replace=False)
    ids = torch.from_numpy(np.concatenate([[first], rest]))
    local = u.beforeForwardPass(ids)
    wrong = ids if fed == "table ids" else local.clone()
    if fed != "table ids":
        wrong[0] = len(ids)  # 6 distinct rows fill slots 0-5: slot 6 holds none of this step's
    with pytest.raises(ss.StateError, match="before_forward returns"):
        model(wrong)
    model(local).sum().backward()  # the step goes on with the right ids
    opt.step()
    opt.zero_grad()
    u.afterOptimizerStep(ids)
    after = u.getNumpyVersion()
    changed = np.flatnonzero((after != before).any(axis=1))
    np.testing.assert_array_equal(np.sort(changed), np.sort(ids.numpy()))


def test_a_training_forward_outside_a_step_is_refused(rng):
    """A step that forgot beforeForwardPass trained the slots of the last step, and nothing wrote them back.

    The next beforeForwardPass overwrote the slots: the step was lost without an error (with
    an OptimizerFactory and Adam too).
    """
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(16, DIM)})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    u = ss.ModelFactory(model["u"], ROWS, DIM, backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    o = ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend="numpy")
    ids = torch.from_numpy(rng.choice(ROWS, size=6))
    local = u.beforeForwardPass(ids)
    o.beforeForwardPass(ids)
    model["u"](local).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    u.afterOptimizerStep(ids)
    o.afterOptimizerStep(ids)
    table = u.getNumpyVersion()
    with pytest.raises(ss.StateError, match="beforeForwardPass"):
        model["u"](local)  # the next step, its beforeForwardPass forgotten
    with torch.no_grad():
        model["u"](local)  # no gradient, nothing to lose: not refused
    np.testing.assert_array_equal(u.getNumpyVersion(), table)


@pytest.mark.parametrize("ids_past_capacity", [False, True], ids=["ids within the capacity", "table ids"])
def test_a_first_step_without_before_forward_is_refused(ids_past_capacity, backend, table0, rng):
    """A loop that forgot beforeForwardPass from its first step trained the model's own embedding.

    Before the first step the forward was let through (for SpeedTorch's Rprop recipe, which ran
    one before building the OptimizerFactory): ids past the capacity raised torch's bare 'index
    out of range in self', and smaller ones trained the embedding's own initial rows, step after
    step, with the table never written (afterOptimizerStep, forgotten too, would have said so).
    """
    model, opt, u, o = build(backend, table0)
    high = ROWS if ids_past_capacity else CAPACITY
    ids = torch.from_numpy(rng.integers(0, high, size=8)).to(model.u_embeddings.weight.device)
    if ids_past_capacity:
        ids[0] = int(rng.integers(CAPACITY, ROWS))
    with pytest.raises(ss.StateError, match="beforeForwardPass"):
        model.u_embeddings(ids)
    with torch.no_grad():
        # Reading the working set with table ids is wrong in eval too: the table has the rows.
        if ids_past_capacity:
            with pytest.raises(ss.StateError, match="table.gather"):
                model.u_embeddings(ids)
        else:
            model.u_embeddings(ids)
    np.testing.assert_array_equal(u.getNumpyVersion(), table0)
    train(model, opt, u, o, [(ids, ids[:4], torch.randn(8, DIM, device=ids.device))])  # begun right, it trains
    changed = np.flatnonzero((u.getNumpyVersion() != table0).any(axis=1))
    np.testing.assert_array_equal(changed, np.unique(ids.cpu().numpy()))


@pytest.mark.parametrize("switched", ["nn.Embedding", "its weight"])
def test_a_step_that_no_before_forward_began_is_refused_at_optimizer_step(switched, backend, table0, rng):
    """With a ModelFactory alone, a step that forgot beforeForwardPass lost its update without an error.

    Its forward fed ids within the capacity, so torch took them: the first training forward is
    let through (SpeedTorch's Rprop recipe runs one before building the OptimizerFactory), and a
    ModelFactory over the weight Parameter checks no forward at all. optimizer.step() then moved
    slots holding no row of the table (or the last step's, written back already), and the next
    beforeForwardPass overwrote them: the first step's update was lost, every step's over a weight.
    """
    device = ss.get_backend(backend).device
    model = SkipGram().to(device)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    weight = model.u_embeddings.weight
    u = ss.ModelFactory(model.u_embeddings if switched == "nn.Embedding" else weight, ROWS, DIM, backend=backend)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    batches = zipf_batches(rng, 5, device, ROWS)
    # The nn.Embedding's forwards are checked from the first step on: only the first is refused late.
    forgotten = (0,) if switched == "nn.Embedding" else (0, 3)
    for i, (pos, neg, ctx) in enumerate(batches):
        if i in forgotten:  # beforeForwardPass forgotten, ids within the capacity fed as they are
            wrong_pos, wrong_neg, wrong_ctx = zipf_batches(rng, 1, device, CAPACITY)[0]
            skipgram_loss(model.u_embeddings(wrong_pos), model.u_embeddings(wrong_neg), wrong_ctx).backward()
            slots = weight.detach().clone()
            with pytest.raises(ss.StateError, match="no beforeForwardPass"):
                opt.step()
            torch.testing.assert_close(weight.detach(), slots, rtol=0, atol=0)  # nothing changed
            opt.zero_grad()
        lp, ln = u.beforeForwardPass(pos, neg)
        skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx).backward()
        opt.step()
        opt.zero_grad()
        u.afterOptimizerStep(pos, neg)
    expected, _ = run_in_memory(lambda p: torch.optim.SGD(p, lr=lr), table0, batches, device)
    np.testing.assert_allclose(u.getNumpyVersion(), expected, rtol=1e-5, atol=1e-6)


def test_the_rprop_recipe_forward_before_the_optimizer_factory_is_still_allowed(table0, rng):
    """SpeedTorch's Rprop recipe: one forward and backward of the model's embedding, then the OptimizerFactory."""
    model = SkipGram()
    u = ss.ModelFactory(model.u_embeddings, ROWS, DIM, backend="numpy")
    model.u_embeddings(torch.from_numpy(rng.integers(0, CAPACITY, size=8))).sum().backward()
    opt = torch.optim.Rprop(model.parameters(), lr=0.01)
    opt.zero_grad()
    ss.OptimizerFactory(opt, ROWS, DIM, model, "u_embeddings", backend="numpy").optInit()
    assert u.getNumpyVersion().shape == (ROWS, DIM)


@pytest.mark.parametrize("save", ["ModelFactory.saveCupy", "ModelFactory.saveTorch", "OptimizerFactory.save"])
def test_a_save_before_after_optimizer_step_is_refused(save, backend, table0, rng, tmp_path):
    """A checkpoint taken after optimizer.step() but before afterOptimizerStep missed the step.

    The step's rows reach the table at afterOptimizerStep: the file held them as they were before
    the step (and the optimizer's state_dict already counted it), without an error.
    """
    model, opt, u, o = build(backend, table0)
    batches = zipf_batches(rng, 2, model.u_embeddings.weight.device, ROWS)
    train(model, opt, u, o, batches[:1])
    pos, neg, ctx = batches[1]
    lp, ln = u.before_forward(pos, neg)
    o.before_forward(pos, neg)
    skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx).backward()
    opt.step()
    opt.zero_grad()
    target = tmp_path / ("opt.h5" if save.startswith("Optimizer") else "u.pt" if "Torch" in save else "u.npy")
    with pytest.raises(ss.StateError, match="afterOptimizerStep"):
        {"ModelFactory.saveCupy": u.saveCupy, "ModelFactory.saveTorch": u.saveTorch,
         "OptimizerFactory.save": o.save}[save](target)
    assert not target.exists()
    u.after_step(pos, neg)
    o.after_step(pos, neg)
    u.saveCupy(tmp_path / "after.npy")  # between steps: the step's rows are in the file
    np.testing.assert_array_equal(np.load(tmp_path / "after.npy"), u.getNumpyVersion())


@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
def test_a_second_optimizer_step_after_after_optimizer_step_is_refused(optimizer, backend, table0, rng):
    """optimizer.step() twice, the second after afterOptimizerStep: the update was lost.

    The step's rows were written back already, so the second step moved only the slots, which
    the next beforeForwardPass overwrote, and Adam's step count went up by one for every row
    after it (its bias correction off from then on), without an error. In memory the gradient
    would be applied twice; neither is what the user meant.
    """
    model, opt, u, o = build(backend, table0)
    if optimizer == "SGD":
        o.close()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pos, neg, ctx = zipf_batches(rng, 1, model.u_embeddings.weight.device, ROWS)[0]
    lp, ln = u.before_forward(pos, neg)
    if optimizer == "Adam":
        o.before_forward(pos, neg)
    skipgram_loss(model.u_embeddings(lp), model.u_embeddings(ln), ctx).backward()
    opt.step()
    u.after_step(pos, neg)
    if optimizer == "Adam":
        o.after_step(pos, neg)
    table, state = u.getNumpyVersion(), copy.deepcopy(opt.state_dict())
    with pytest.raises(ss.StateError, match="zero_grad"):
        opt.step()
    np.testing.assert_array_equal(u.getNumpyVersion(), table)
    assert str(opt.state_dict()) == str(state)
    opt.zero_grad()
    opt.step()  # the gradient dropped: a step with nothing to apply is fine


def _files_under(directory):
    """Every file under ``directory`` (temporaries and locks too) -> its bytes."""
    return {os.path.relpath(os.path.join(at, name), directory): open(os.path.join(at, name), "rb").read()
            for at, _, names in os.walk(directory) for name in names}


@pytest.mark.parametrize("kind", ["ModelFactory", "OptimizerFactory"])
def test_a_switcher_refused_for_its_device_makes_and_replaces_no_file(kind, rng, tmp_path, monkeypatch):
    """A backend whose rows move to another device than the embedding's was refused (DeviceError) only
    once the switcher had made its mmap table or state files: a new file stayed behind, so a retry was
    refused for it, and overwrite=True had already replaced trained files with fresh ones, whose tables
    were never closed. (The check is made to refuse here: this machine may have one device only.)"""
    trained = SkipGram()
    trained_opt = torch.optim.Adam(trained.parameters(), lr=float(rng.uniform(0.001, 0.1)))
    u = ss.ModelFactory(trained.u_embeddings, ROWS, DIM, storage="mmap", path=tmp_path / "u.npy", backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    o = ss.OptimizerFactory(trained_opt, ROWS, DIM, trained, "u_embeddings", storage="mmap",
                            path=tmp_path / "opt", backend="numpy")
    train(trained, trained_opt, u, o, zipf_batches(rng, 3, "cpu", ROWS))
    o.close()
    u.close()
    before = _files_under(tmp_path)
    assert sorted(before) == ["opt/exp_avg.npy", "opt/exp_avg_sq.npy", "u.npy"]
    assert np.load(tmp_path / "opt" / "exp_avg.npy").any()  # trained: a fresh file in its place would differ
    model = SkipGram()
    weight = model.u_embeddings.weight.detach().clone()
    opt = torch.optim.Adam(model.parameters(), lr=float(rng.uniform(0.001, 0.1)))
    build = (functools.partial(ss.ModelFactory, model.u_embeddings, ROWS, DIM) if kind == "ModelFactory" else
             functools.partial(ss.OptimizerFactory, opt, ROWS, DIM, model, "u_embeddings"))
    name = "u.npy" if kind == "ModelFactory" else "opt"

    def refused(self, backend):
        raise ss.DeviceError("refused here")

    monkeypatch.setattr(ss.compat.switcher.Switcher, "_check_device", refused)
    for path, overwrite in ((tmp_path / name, True), (tmp_path / "new" / name, False)):
        os.makedirs(tmp_path / "new", exist_ok=True)
        with pytest.raises(ss.DeviceError, match="refused here"):
            build(storage="mmap", path=path, backend="numpy", overwrite=overwrite)
        assert _files_under(tmp_path) == before  # nothing made, replaced, or left aside
    monkeypatch.undo()
    assert torch.equal(model.u_embeddings.weight, weight) and not opt.state
    assert not model.u_embeddings.weight._backward_hooks
    build(storage="mmap", path=tmp_path / "new" / name, backend="numpy").close()  # nothing there to refuse it
    assert (tmp_path / "new" / name).exists()


@pytest.mark.parametrize("keyword, value, instead", [
    ("device", "cpu", r"device=: .*device of the model's embedding.*model\.to\(device\)"),
    ("max_rows", 8, r"max_rows=: .*the model's embedding is the working set"),
    ("wrong_name", 1, r"wrong_name=: no such argument"),
])
@pytest.mark.parametrize("kind", ["ModelFactory", "OptimizerFactory"])
def test_a_keyword_a_switcher_does_not_take_is_refused_saying_what_to_do(kind, keyword, value, instead, rng,
                                                                         tmp_path):
    """``ModelFactory(..., device="cpu")`` (an OffloadedEmbedding's keyword) raised Python's bare
    TypeError, an unexpected keyword, saying nothing of where a switcher works or what it takes."""
    model = torch.nn.Embedding(8, DIM)
    opt = torch.optim.Adam(model.parameters(), lr=float(rng.uniform(0.001, 0.1)))
    other_dtype = "dtype" if kind == "ModelFactory" else "datatype"
    for given, match in (({keyword: value}, instead),
                         ({other_dtype: "float32"}, rf"{other_dtype}=: {kind} names it "
                                                    rf"{'datatype' if kind == 'ModelFactory' else 'dtype'}=")):
        build = (functools.partial(ss.ModelFactory, model, ROWS, DIM) if kind == "ModelFactory" else
                 functools.partial(ss.OptimizerFactory, opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e"))
        with pytest.raises(ss.DTypeError, match=match) as refused:
            build(storage="mmap", path=tmp_path / "tables", backend="numpy", **given)
        assert isinstance(refused.value, TypeError)  # as Python's, for code that catches that
        assert f"It takes {'model_variable' if kind == 'ModelFactory' else 'given_optimizer'}, " \
               in str(refused.value)
        assert not (tmp_path / "tables").exists()  # nothing was built
        assert not model.weight._backward_hooks
