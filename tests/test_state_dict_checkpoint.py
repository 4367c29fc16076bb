"""The standard PyTorch checkpoint, ``torch.save(model.state_dict())``, keeps an offloaded table.

An OffloadedEmbedding's table and its optimizer's per-row state travel in the
module's ``_extra_state``. A run saved after N steps and resumed in a fresh
model and optimizer must train the next M steps exactly as the run that went
on, and both must equal an in-memory lazy reference over the whole run.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from speedswap.train.module_state import check_state_dict, in_memory_state_dict, rows_only
from test_training_flows import DIM, ROWS, LazyTable, Model, make_lazy, zipf_ids

CAPACITY = 81
N_STEPS, M_STEPS = 8, 8


def make_adam(params):
    return torch.optim.Adam(params, lr=0.01)


def offloaded(storage, dtype, cache_rows, path, table0=None, linear=None):
    """A Model over a fresh OffloadedEmbedding (default init unless ``table0``) and a Linear."""
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage=storage, dtype=dtype,
                                backend="numpy", path=path if storage == "mmap" else None,
                                cache_rows=cache_rows)
    if table0 is not None:
        emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    return Model(emb, copy.deepcopy(linear) if linear is not None else torch.nn.Linear(DIM, 1))


def step(model, opt, ids, target):
    F.mse_loss(model(ids), target).backward()
    opt.step()
    opt.zero_grad()


def snapshot(model):
    """The table (as float32), every per-row state table and the linear layer, as numpy copies."""
    emb = model.emb
    out = {"table": emb.table.as_tensor().float().numpy().copy()}
    if emb._state is not None:
        out.update({name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()})
    out.update({f"lin.{n}": p.detach().numpy().copy() for n, p in model.lin.named_parameters()})
    return out


def assert_same(a, b, **tol):
    assert a.keys() == b.keys()
    for name in a:
        if tol:
            np.testing.assert_allclose(a[name], b[name], err_msg=name, **tol)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def reference_run(table0, linear, batches, dtype):
    """In-memory lazy Adam over the whole run; a bfloat16 table's touched rows rounded after each step."""
    model = Model(LazyTable(table0), copy.deepcopy(linear))
    opt = make_adam(model.parameters())
    make_lazy(opt, model.emb)
    if dtype is torch.bfloat16:
        def round_rows(*_):
            with torch.no_grad():  # untouched rows are bfloat16 values already: unchanged
                model.emb.weight.copy_(model.emb.weight.to(torch.bfloat16).float())
        opt.register_step_post_hook(round_rows)
    for ids, target in batches:
        step(model, opt, ids, target)
    state = opt.state[model.emb.weight]
    out = {"table": model.emb.weight.detach().numpy().copy(),
           **{f"optimizer.{k}": v.numpy().copy() for k, v in state.items() if k != "step"}}
    out.update({f"lin.{n}": p.detach().numpy().copy() for n, p in model.lin.named_parameters()})
    return out


def initial(rng, dtype):
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    return torch.from_numpy(table0).to(dtype).float().numpy() if dtype is torch.bfloat16 else table0


def renamed(snap):
    """``snapshot`` names state tables by torch's names; the reference by ``optimizer.<name>``."""
    return {(k if k == "table" or k.startswith("lin.") else f"optimizer.{k}"): v for k, v in snap.items()}


@pytest.mark.parametrize("cache_rows", [0, 40], ids=["no_cache", "cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("storage", ["pageable", "mmap"])
def test_a_run_resumed_from_the_model_state_dict_equals_the_run_that_went_on(storage, dtype, cache_rows,
                                                                            rng, tmp_path):
    table0, linear = initial(rng, dtype), torch.nn.Linear(DIM, 1)
    batches = zipf_ids(rng, N_STEPS + M_STEPS)
    model = offloaded(storage, dtype, cache_rows, tmp_path / "a", table0, linear)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    for ids, target in batches[:N_STEPS]:
        step(model, opt, ids, target)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    for ids, target in batches[N_STEPS:]:
        step(model, opt, ids, target)
    went_on = snapshot(model)

    # A fresh model (its own random table and linear layer) and optimizer, attached, then loaded.
    resumed = offloaded(storage, dtype, cache_rows, tmp_path / "b")
    opt2 = make_adam(resumed.parameters())
    resumed.emb.attach(opt2)
    saved = torch.load(tmp_path / "ckpt.pt")  # weights_only: the extra state is plain data
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for ids, target in batches[N_STEPS:]:
        step(resumed, opt2, ids, target)
    assert_same(snapshot(resumed), went_on)
    assert_same(renamed(went_on), reference_run(table0, linear, batches, dtype), rtol=1e-6, atol=1e-6)


def test_a_state_dict_read_with_torch_load_mmap_resumes_too(rng, tmp_path):
    table0, linear = initial(rng, torch.float32), torch.nn.Linear(DIM, 1)
    batches = zipf_ids(rng, 6)
    model = offloaded("pageable", torch.float32, 0, None, table0, linear)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    for ids, target in batches[:3]:
        step(model, opt, ids, target)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    expected = snapshot(model)
    resumed = offloaded("pageable", torch.float32, 0, None)
    opt2 = make_adam(resumed.parameters())
    resumed.emb.attach(opt2)
    resumed.load_state_dict(torch.load(tmp_path / "model.pt", mmap=True))
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert_same(snapshot(resumed), expected)
    for ids, target in batches[3:]:
        step(model, opt, ids, target)
        step(resumed, opt2, ids, target)
    assert_same(snapshot(resumed), snapshot(model))


def test_the_state_dict_shares_the_host_tables_memory(rng):
    model = offloaded("pageable", torch.bfloat16, 0, None, initial(rng, torch.bfloat16))
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    extra = model.state_dict()["emb._extra_state"]
    assert extra["version"] == 1 and extra["dtype"] == "bfloat16" and extra["optimizer"] == "Adam"
    assert sorted(extra["tables"]) == ["optimizer.exp_avg", "optimizer.exp_avg_sq", "table"]
    table = extra["tables"]["table"]
    assert table.dtype is torch.bfloat16
    assert table.data_ptr() == model.emb.table.as_tensor().data_ptr()


@pytest.mark.parametrize("change", ["rows", "dim", "dtype"])
def test_a_state_dict_of_another_shape_or_dtype_is_refused_and_changes_nothing(change, rng):
    source = offloaded("pageable", torch.float32, 0, None, initial(rng, torch.float32))
    opt = make_adam(source.parameters())
    source.emb.attach(opt)
    step(source, opt, *zipf_ids(rng, 1)[0])
    rows, dim, dtype = {"rows": (ROWS + 1, DIM, torch.float32), "dim": (ROWS, DIM + 1, torch.float32),
                        "dtype": (ROWS, DIM, torch.bfloat16)}[change]
    target = ss.OffloadedEmbedding(rows, dim, max_rows=CAPACITY, storage="pageable", dtype=dtype,
                                   backend="numpy", cache_rows=10)
    target_opt = make_adam(target.parameters())
    target.attach(target_opt)
    before = target.table.to_numpy(copy=True), {n: t.to_numpy(copy=True) for n, t in target._state.tables.items()}
    weight = target.weight.detach().clone()
    error = ss.DTypeError if change == "dtype" else ss.ShapeError
    with pytest.raises(error, match="build it with"):
        target.load_state_dict(source.emb.state_dict())
    np.testing.assert_array_equal(target.table.to_numpy(), before[0])
    for name, table in target._state.tables.items():
        np.testing.assert_array_equal(table.to_numpy(), before[1][name])
    assert torch.equal(target.weight, weight)


def two_embeddings(rng, user_rows, item_rows):
    """A model of two offloaded embeddings, 'user' then 'item', with random rows."""
    model = torch.nn.ModuleDict({
        name: ss.OffloadedEmbedding(rows, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
        for name, rows in (("user", user_rows), ("item", item_rows))})
    for emb in model.values():
        rows = rng.standard_normal((emb.num_embeddings, DIM)).astype(np.float32)
        emb.table.apply_(lambda t, rows=rows: t.copy_(torch.from_numpy(rows)))
    return model


def test_a_refusal_in_a_model_of_several_embeddings_names_those_it_already_loaded(rng):
    """torch loads module by module and no embedding sees another's entries, so a state dict that
    fits the first embedding and not the second replaced the first's table before the second
    refused; the refusal said nothing of it."""
    source, target = two_embeddings(rng, ROWS, ROWS), two_embeddings(rng, ROWS, ROWS + 1)
    item = target["item"].table.to_numpy(copy=True)
    with pytest.raises(ss.ShapeError, match="build it with") as info:
        target.load_state_dict(source.state_dict())
    assert "embedding(s) 'user'" in str(info.value) and "this one ('item')" in str(info.value)
    # As it says: the first embedding holds the state dict's rows, the refused one its own.
    np.testing.assert_array_equal(target["user"].table.to_numpy(), source["user"].table.to_numpy())
    np.testing.assert_array_equal(target["item"].table.to_numpy(), item)
    # Refused by the first embedding it reaches, another load names none (nor the last call's).
    with pytest.raises(ss.ShapeError, match="build it with") as info:
        two_embeddings(rng, ROWS + 1, ROWS).load_state_dict(source.state_dict())
    assert "Beware" not in str(info.value)


def test_check_state_dict_refuses_before_any_embedding_of_the_model_changes(rng):
    """The way to an all-or-nothing load over several embeddings: every entry checked first."""
    source, target = two_embeddings(rng, ROWS, ROWS), two_embeddings(rng, ROWS, ROWS + 1)
    before = {name: emb.table.to_numpy(copy=True) for name, emb in target.items()}
    with pytest.raises(ss.ShapeError, match="'item._extra_state'.*nothing was loaded"):
        check_state_dict(target, source.state_dict())
    for name, emb in target.items():
        np.testing.assert_array_equal(emb.table.to_numpy(), before[name])
    fitting = two_embeddings(rng, ROWS, ROWS)
    check_state_dict(fitting, source.state_dict())
    fitting.load_state_dict(source.state_dict())
    for name, emb in fitting.items():
        np.testing.assert_array_equal(emb.table.to_numpy(), source[name].table.to_numpy())


def test_check_state_dict_refuses_what_torch_refuses_of_the_other_entries_before_the_table_changes(rng):
    """A state dict whose Linear torch refuses (another shape) passed check_state_dict, and the load
    then replaced the table before torch raised: the check-first load was not all or nothing."""
    source = offloaded("pageable", torch.float32, 0, None, initial(rng, torch.float32))
    target = offloaded("pageable", torch.float32, 0, None, initial(rng, torch.float32), torch.nn.Linear(DIM, 2))
    before = snapshot(target)
    with pytest.raises(ss.ShapeError, match=rf"'lin.weight' is \(1, {DIM}\), the model's \(2, {DIM}\).*"
                                            "Nothing was loaded"):
        check_state_dict(target, source.state_dict())
    assert_same(snapshot(target), before)
    # Why it is checked first: torch refuses the Linear after it has replaced the table.
    with pytest.raises(RuntimeError, match="size mismatch for lin.weight"):
        target.load_state_dict(source.state_dict())
    assert not np.array_equal(snapshot(target)["table"], before["table"])
    # Missing and unexpected keys are refused as strict loads refuse them, and only then.
    state = source.state_dict()
    state["lin.scale"] = torch.ones(1)
    del state["lin.bias"]
    with pytest.raises(ss.FileFormatError, match="missing 'lin.bias'; unexpected 'lin.scale'.*strict=False"):
        check_state_dict(source, state)
    with pytest.raises(RuntimeError, match="Missing key"):
        source.load_state_dict(state)
    check_state_dict(source, state, strict=False)
    source.load_state_dict(state, strict=False)


@pytest.mark.parametrize("cache_rows", [0, 40], ids=["no_cache", "cache"])
def test_a_state_dict_load_stopped_while_it_writes_the_tables_leaves_them_refusing_use_until_a_load(
        cache_rows, rng, monkeypatch):
    """Ctrl-C (or out of memory) while model.load_state_dict() copied the tables in left the table
    loaded and the optimizer state not, without a word: training went on with two states mixed. As
    after an emb.load stopped midway, every table now refuses use until a load completes."""
    batches = zipf_ids(rng, 6)
    source = offloaded("pageable", torch.float32, 0, None, initial(rng, torch.float32))
    opt = make_adam(source.parameters())
    source.emb.attach(opt)
    for ids, target in batches[:3]:
        step(source, opt, ids, target)
    state, saved = source.state_dict(), snapshot(source)
    model = offloaded("pageable", torch.float32, cache_rows, None, initial(rng, torch.float32))
    opt2 = make_adam(model.parameters())
    model.emb.attach(opt2)
    for ids, target in batches[3:]:
        step(model, opt2, ids, target)
    apply_, writes = ss.HostTable.apply_, []

    def stopped_at_the_second(table, fn, *args, **kwargs):
        writes.append(table)
        if len(writes) == 2:  # the table holds the state dict's rows, the optimizer state its own
            raise KeyboardInterrupt
        return apply_(table, fn, *args, **kwargs)
    monkeypatch.setattr(ss.HostTable, "apply_", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        model.load_state_dict(state)
    monkeypatch.setattr(ss.HostTable, "apply_", apply_)
    ids, target = batches[0]
    for use in (lambda: step(model, opt2, ids, target), lambda: model.state_dict(),
                lambda: model.emb.table.to_numpy(), lambda: model.emb._state.tables["exp_avg"].gather([0])):
        with pytest.raises(ss.StateError, match="stopped.*KeyboardInterrupt.*load a checkpoint again"):
            use()
    model.load_state_dict(state)  # a load that completes lifts the refusal
    assert_same(snapshot(model), saved)
    step(model, opt2, ids, target)  # and it trains again


@pytest.mark.parametrize("fault", ["earlier_shape", "later_shape", "missing", "unexpected"])
def test_a_load_torch_refuses_for_another_entry_replaces_the_table_as_in_memory(fault, rng):
    """Torch raises only after it has loaded every module, whatever entry it refuses (a Linear before
    or after the embedding of another shape, under strict a missing or an unexpected key). In memory
    the nn.Embedding's weight is loaded by then; the offloaded table is too, as the README says."""
    def model(embedding):
        return torch.nn.ModuleDict({"pre": torch.nn.Linear(DIM, DIM), "emb": embedding,
                                    "lin": torch.nn.Linear(DIM, 1)})
    saved, own = (rng.standard_normal((ROWS, DIM)).astype(np.float32) for _ in range(2))
    source = model(ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy"))
    source["emb"].table.apply_(lambda t: t.copy_(torch.from_numpy(saved)))
    offloaded = model(ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy"))
    offloaded["emb"].table.apply_(lambda t: t.copy_(torch.from_numpy(own)))
    in_memory = model(torch.nn.Embedding.from_pretrained(torch.from_numpy(own.copy()), freeze=False))
    in_memory.load_state_dict({k: v for k, v in offloaded.state_dict().items() if not k.startswith("emb.")},
                              strict=False)  # the same Linears
    state = source.state_dict()
    if fault in ("earlier_shape", "later_shape"):
        name = "pre" if fault == "earlier_shape" else "lin"
        state[f"{name}.weight"] = torch.from_numpy(rng.standard_normal((3, DIM)).astype(np.float32))
    elif fault == "missing":
        del state["lin.bias"]
    else:
        state["lin.scale"] = torch.ones(1)
    torch_state = {k: v for k, v in state.items() if not k.startswith("emb.")}
    torch_state["emb.weight"] = torch.from_numpy(saved)
    for target, given in ((offloaded, state), (in_memory, torch_state)):
        with pytest.raises(RuntimeError, match="size mismatch|Missing key|Unexpected key"):
            target.load_state_dict(given)
    np.testing.assert_array_equal(in_memory["emb"].weight.detach().numpy(), saved)
    np.testing.assert_array_equal(offloaded["emb"].table.to_numpy(), saved)
    for name in ("pre", "lin"):
        for key, value in offloaded[name].state_dict().items():
            torch.testing.assert_close(value, in_memory[name].state_dict()[key], rtol=0, atol=0)


def test_a_state_dict_the_embedding_refuses_was_loaded_into_the_modules_before_it_only(rng):
    """As the README says: the embedding's refusal raises at once, after torch loaded the modules
    registered before it; the embedding and the modules after it keep their own values."""
    def model(rows):
        emb = ss.OffloadedEmbedding(rows, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
        emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((rows, DIM)).astype(np.float32))))
        return torch.nn.ModuleDict({"pre": torch.nn.Linear(DIM, DIM), "emb": emb, "lin": torch.nn.Linear(DIM, 1)})
    source, target = model(ROWS), model(ROWS + 1)
    table, lin = target["emb"].table.to_numpy(copy=True), copy.deepcopy(target["lin"].state_dict())
    with pytest.raises(ss.ShapeError, match="build it with"):
        target.load_state_dict(source.state_dict())
    for key, value in target["pre"].state_dict().items():
        torch.testing.assert_close(value, source["pre"].state_dict()[key], rtol=0, atol=0)
    np.testing.assert_array_equal(target["emb"].table.to_numpy(), table)
    for key, value in target["lin"].state_dict().items():
        torch.testing.assert_close(value, lin[key], rtol=0, atol=0)


def test_check_state_dict_leaves_the_entries_of_a_module_with_a_load_of_its_own_to_it(rng):
    """BatchNorm's load adds the num_batches_tracked a checkpoint of an old torch lacks: the check,
    which replays no module's own load, refused as missing what the load accepts."""
    def model():
        emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
        return torch.nn.ModuleDict({"emb": emb, "norm": torch.nn.BatchNorm1d(DIM)})
    source, target = model(), model()
    source["emb"].table.apply_(lambda t: t.copy_(torch.from_numpy(initial(rng, torch.float32))))
    state = source.state_dict()
    del state["norm.num_batches_tracked"]
    state._metadata["norm"]["version"] = 1
    check_state_dict(target, state)
    target.load_state_dict(state)
    np.testing.assert_array_equal(target["emb"].table.to_numpy(), source["emb"].table.to_numpy())


@pytest.mark.parametrize("make", [lambda t: t.to("meta"), lambda t: t.to_sparse()], ids=["meta", "sparse"])
def test_a_state_dict_whose_state_tensor_holds_no_dense_values_is_refused_and_changes_nothing(make, rng):
    # A meta tensor (a state dict of a model built on the meta device) or a sparse one is shaped
    # and typed like the table, but copy_ cannot take it: the tables before it would be replaced.
    model = offloaded("pageable", torch.float32, 0, None, initial(rng, torch.float32))
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    step(model, opt, *zipf_ids(rng, 1)[0])
    state = copy.deepcopy(model.state_dict())
    tables = state["emb._extra_state"]["tables"]
    tables["table"] += 1
    tables["optimizer.exp_avg_sq"] = make(tables["optimizer.exp_avg_sq"])
    before = snapshot(model)
    with pytest.raises(ss.FileFormatError, match="dense"):
        model.load_state_dict(state)
    assert_same(snapshot(model), before)


def test_a_state_dict_saved_before_attach_loads_before_attach_only(rng):
    table0 = initial(rng, torch.float32)
    source = offloaded("pageable", torch.float32, 0, None, table0)
    state = copy.deepcopy(source.state_dict())
    assert state["emb._extra_state"]["optimizer"] == ""

    attached = offloaded("pageable", torch.float32, 0, None)
    opt = make_adam(attached.parameters())
    attached.emb.attach(opt)
    before = attached.emb.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="load it before attach"):
        attached.load_state_dict(state)
    np.testing.assert_array_equal(attached.emb.table.to_numpy(), before)

    # Loaded before attach, then attached: fresh optimizer state over the loaded rows.
    model = offloaded("pageable", torch.float32, 0, None)
    model.load_state_dict(state)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    reference = Model(LazyTable(table0), copy.deepcopy(source.lin))
    ref_opt = make_adam(reference.parameters())
    make_lazy(ref_opt, reference.emb)
    for ids, target in zipf_ids(rng, 5):
        step(model, opt, ids, target)
        step(reference, ref_opt, ids, target)
    np.testing.assert_allclose(model.emb.table.to_numpy(), reference.emb.weight.detach().numpy(),
                               rtol=1e-6, atol=1e-6)


def test_a_state_dict_with_optimizer_state_into_an_unattached_embedding_needs_rows_only(rng):
    source = offloaded("pageable", torch.float32, 0, None, initial(rng, torch.float32))
    opt = make_adam(source.parameters())
    source.emb.attach(opt)
    step(source, opt, *zipf_ids(rng, 1)[0])
    state = source.state_dict()
    model = offloaded("pageable", torch.float32, 0, None)
    before = model.emb.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="rows_only"):
        model.load_state_dict(state)
    np.testing.assert_array_equal(model.emb.table.to_numpy(), before)
    model.load_state_dict(rows_only(state))  # evaluation: the rows alone
    np.testing.assert_array_equal(model.emb.table.to_numpy(), source.emb.table.to_numpy())
    assert state["emb._extra_state"]["optimizer"] == "Adam"  # rows_only copies, never edits


@pytest.mark.parametrize("cache_rows", [0, 40], ids=["no_cache", "cache"])
def test_mid_step_the_state_dict_holds_the_rows_before_the_step_and_a_load_is_refused(cache_rows, rng):
    table0, linear = initial(rng, torch.float32), torch.nn.Linear(DIM, 1)
    batches = zipf_ids(rng, 6)
    model = offloaded("pageable", torch.float32, cache_rows, None, table0, linear)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    reference = Model(LazyTable(table0), copy.deepcopy(linear))
    ref_opt = make_adam(reference.parameters())
    make_lazy(ref_opt, reference.emb)
    for ids, target in batches[:3]:
        step(model, opt, ids, target)
        step(reference, ref_opt, ids, target)
    between = copy.deepcopy(model.state_dict())  # between steps: a state to try loading mid-step
    ids, target = batches[3]
    for m in (model, reference):
        F.mse_loss(m(ids), target).backward()
    mid = copy.deepcopy(model.state_dict())
    ref_mid = copy.deepcopy(reference.state_dict())  # in memory: the parameters before the step
    np.testing.assert_allclose(mid["emb._extra_state"]["tables"]["table"].numpy(),
                               ref_mid["emb.weight"].numpy(), rtol=1e-6, atol=1e-6)
    working = model.emb.weight.detach().clone()
    with pytest.raises(ss.StateError, match="between steps"):
        model.load_state_dict(between)
    assert torch.equal(model.emb.weight, working)  # the step's rows are as they were
    for m, o in ((model, opt), (reference, ref_opt)):
        o.step()
        o.zero_grad()
    for ids, target in batches[4:]:
        step(model, opt, ids, target)
        step(reference, ref_opt, ids, target)
    np.testing.assert_allclose(model.emb.table.to_numpy(), reference.emb.weight.detach().numpy(),
                               rtol=1e-6, atol=1e-6)


def test_a_state_dict_without_the_table_is_reported_missing_with_a_hint(rng):
    model = offloaded("pageable", torch.float32, 0, None)
    old = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    before = model.emb.table.to_numpy(copy=True)
    with pytest.warns(RuntimeWarning, match=r"emb.load\(path\)"), \
            pytest.raises(RuntimeError, match="emb._extra_state"):
        model.load_state_dict(old)
    with pytest.warns(RuntimeWarning, match="left as it is"):
        result = model.load_state_dict(old, strict=False)
    assert result.missing_keys == ["emb._extra_state"]
    np.testing.assert_array_equal(model.emb.table.to_numpy(), before)


@pytest.mark.parametrize("key", ["format", "version", "kind", "num_embeddings", "embedding_dim", "dtype",
                                 "optimizer"])
def test_an_array_in_a_field_of_the_table_state_is_a_file_format_error(key, rng):
    """A state dict whose fields were changed into arrays raised numpy's 'truth value of an array
    is ambiguous' ValueError from the comparisons."""
    for emb in (offloaded("pageable", torch.float32, 0, None).emb, sharded()):
        before = emb.table.to_numpy(copy=True)
        state = {**emb.get_extra_state(), key: np.zeros((2, 2))}
        with pytest.raises(ss.FileFormatError):
            emb.set_extra_state(state)
        np.testing.assert_array_equal(emb.table.to_numpy(), before)


def test_an_nn_embedding_state_dict_is_reported_with_how_to_copy_its_table_in(rng):
    """A model moving over from nn.Embedding: its whole-table 'weight' is not loaded, and the hint
    said it came from an older speedswap and to emb.load(path) a file the user never had."""
    model = offloaded("pageable", torch.float32, 0, None)
    before = model.emb.table.to_numpy(copy=True)
    dense = torch.nn.Embedding(ROWS, DIM)
    torch.nn.init.normal_(dense.weight, generator=torch.Generator().manual_seed(int(rng.integers(2**31))))
    with pytest.warns(RuntimeWarning, match=r"nn.Embedding saves.*emb\.table\.scatter\(torch\.arange") as hint:
        result = model.load_state_dict({"emb." + k: v for k, v in dense.state_dict().items()}
                                       | {"lin." + k: v for k, v in model.lin.state_dict().items()},
                                       strict=False)
    assert "emb.load(path)" not in str(hint[0].message)
    assert result.missing_keys == ["emb._extra_state"]
    np.testing.assert_array_equal(model.emb.table.to_numpy(), before)  # left as it is
    model.emb.table.scatter(torch.arange(ROWS), dense.weight)  # what the hint says
    np.testing.assert_array_equal(model.emb.table.to_numpy(), dense.weight.detach().numpy())


def test_a_state_dict_of_a_newer_format_or_another_optimizer_is_refused(rng):
    model = offloaded("pageable", torch.float32, 0, None)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    state = model.state_dict()
    newer = {**state, "emb._extra_state": {**state["emb._extra_state"], "version": 2}}
    with pytest.raises(ss.FileFormatError, match="upgrade speedswap"):
        model.load_state_dict(newer)
    other = offloaded("pageable", torch.float32, 0, None)
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other.emb.attach(sgd)
    with pytest.raises(ss.FileFormatError, match="Adam optimizer state, but SGD"):
        other.load_state_dict(state)


# ------------------------------------------------------------------ sharded
def sharded(table0=None):
    emb = ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
    if table0 is not None:
        emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0[emb.row_range.start:emb.row_range.stop])))
    return emb


def test_a_sharded_state_dict_holds_the_shard_and_resumes(rng, tmp_path):
    table0, linear = initial(rng, torch.float32), torch.nn.Linear(DIM, 1)
    batches = zipf_ids(rng, 8)
    model = Model(sharded(table0), copy.deepcopy(linear))
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    for ids, target in batches[:4]:
        step(model, opt, ids, target)
    state = model.state_dict()
    assert "emb.weight" not in state
    extra = state["emb._extra_state"]
    assert (extra["rank"], extra["world_size"], extra["rows"]) == (0, 1, [0, ROWS])
    torch.save({"model": state, "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    for ids, target in batches[4:]:
        step(model, opt, ids, target)

    resumed = Model(sharded(), torch.nn.Linear(DIM, 1))
    opt2 = make_adam(resumed.parameters())
    resumed.emb.attach(opt2)
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for ids, target in batches[4:]:
        step(resumed, opt2, ids, target)
    np.testing.assert_array_equal(resumed.emb.table.to_numpy(), model.emb.table.to_numpy())
    for name, table in resumed.emb._state.tables.items():
        np.testing.assert_array_equal(table.to_numpy(), model.emb._state.tables[name].to_numpy())


def test_check_state_dict_checks_a_sharded_embeddings_entry_before_anything_changes(rng):
    """check_state_dict checked OffloadedEmbedding entries only: a sharded one saved at another world
    size passed it, and model.load_state_dict() replaced the Linear before the shard refused. Its
    weight key, which the shard's load ignores, is no unexpected key."""
    source = Model(sharded(initial(rng, torch.float32)), torch.nn.Linear(DIM, 1))
    target = Model(sharded(initial(rng, torch.float32)), torch.nn.Linear(DIM, 1))
    state = source.state_dict()
    state["emb._extra_state"] = {**state["emb._extra_state"], "world_size": 2, "rows": [0, ROWS // 2]}
    before = {**snapshot(target), "emb": target.emb.table.to_numpy(copy=True)}
    with pytest.raises(ss.FileFormatError, match="'emb._extra_state'.*world_size=2.*nothing was loaded"):
        check_state_dict(target, state)
    # Why it is checked first: the load refuses it only after the Linear before it was replaced.
    with pytest.raises(ss.FileFormatError, match="world_size=2"):
        torch.nn.ModuleDict({"lin": target.lin, "emb": target.emb}).load_state_dict(
            {"lin.weight": state["lin.weight"], "lin.bias": state["lin.bias"],
             "emb._extra_state": state["emb._extra_state"]})
    assert not np.array_equal(target.lin.weight.detach().numpy(), before["lin.weight"])
    np.testing.assert_array_equal(target.emb.table.to_numpy(), before["emb"])
    fitting = {**source.state_dict(), "emb.weight": torch.zeros(CAPACITY, DIM)}
    check_state_dict(target, fitting)
    target.load_state_dict(fitting)
    np.testing.assert_array_equal(target.emb.table.to_numpy(), source.emb.table.to_numpy())


@pytest.mark.parametrize("layout", [{"world_size": 2, "rows": [0, ROWS // 2]}, {"rank": 1}])
def test_a_sharded_state_dict_of_another_layout_is_refused_and_changes_nothing(layout, rng):
    source = sharded(initial(rng, torch.float32))
    state = source.state_dict()
    tampered = {"_extra_state": {**state["_extra_state"], **layout}}
    target = sharded()
    before = target.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match=r"emb.load\(dir\)"):
        target.load_state_dict(tampered)
    np.testing.assert_array_equal(target.table.to_numpy(), before)
    target.load_state_dict(state)
    np.testing.assert_array_equal(target.table.to_numpy(), source.table.to_numpy())


@pytest.mark.parametrize("steps", [-1, 2.0, "5", True])
def test_a_sharded_state_dict_whose_step_count_is_not_a_count_is_refused_and_changes_nothing(steps, rng):
    """The ranks compare the restored steps at the next call: a mangled count is refused at the load."""
    source = sharded(initial(rng, torch.float32))
    source.attach(make_adam(source.parameters()))
    state = source.state_dict()
    assert state["_extra_state"]["steps"] == 0
    target = sharded()
    target.attach(make_adam(target.parameters()))
    before = target.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match=f"steps={steps!r}, not a count of steps"):
        target.load_state_dict({"_extra_state": {**state["_extra_state"], "steps": steps}})
    np.testing.assert_array_equal(target.table.to_numpy(), before)


def test_a_sharded_state_dict_without_the_shard_is_reported_missing():
    emb = sharded()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match="_extra_state"):
            emb.load_state_dict({})
        assert emb.load_state_dict({"weight": torch.zeros(3, DIM)}, strict=False).missing_keys == ["_extra_state"]


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_a_torch_file_given_to_save_or_load_says_how_torch_files_are_read(suffix, rng, tmp_path):
    """emb.load("ckpt.pt") said only that it "cannot tell the checkpoint format", not that a torch
    checkpoint is read with load_state_dict(torch.load(...)); so did OptimizerFactory.load/save."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model = offloaded("pageable", torch.float32, 0, None, table0)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    path = tmp_path / f"ckpt{suffix}"
    torch.save(model.state_dict(), path)
    working = torch.nn.Embedding(8, DIM)
    switched_opt = torch.optim.Adam(working.parameters(), lr=0.01)
    switcher = ss.OptimizerFactory(switched_opt, ROWS, DIM, torch.nn.ModuleDict({"e": working}), "e",
                                   backend="numpy")
    for call in (model.emb.load, model.emb.save, switcher.load, switcher.save):
        with pytest.raises(ss.OptionError, match=r"load_state_dict\(torch\.load") as refused:
            call(path)
        assert "torch.save(" in str(refused.value)
    np.testing.assert_array_equal(model.emb.table.to_numpy(copy=True), table0)  # nothing loaded
    model.load_state_dict(torch.load(path))  # what the message says works
    np.testing.assert_array_equal(model.emb.table.to_numpy(copy=True), table0)


@pytest.mark.parametrize("cache_rows", [0, 30])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_offloaded_models_state_dict_loads_into_the_same_model_with_nn_embedding(rng, tmp_path, cache_rows,
                                                                                   dtype):
    """An offloaded model's state dict held the step's scratch as ``weight`` and the table in
    ``_extra_state``: the same model built with ``nn.Embedding`` refused it (torch's size mismatch).
    ``in_memory_state_dict`` makes the one it loads: after Adam steps on Zipf ids (cached rows not yet
    written back among them), through torch.save and torch.load, it gives the trained model's outputs."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    model = offloaded("pageable", dtype, cache_rows, None, table0)
    opt = make_adam(model.parameters())
    model.emb.attach(opt)
    for ids, target in zipf_ids(rng, N_STEPS):
        step(model, opt, ids, target)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    plain = Model(torch.nn.Embedding(ROWS, DIM), torch.nn.Linear(DIM, 1))  # float32: the rows computed with
    plain.load_state_dict(in_memory_state_dict(torch.load(tmp_path / "model.pt")))
    expected = snapshot(model)
    np.testing.assert_array_equal(plain.emb.weight.detach().float().numpy(), expected["table"])
    assert not np.allclose(expected["table"], table0, atol=1e-3)  # it trained
    model.eval()
    every = torch.arange(ROWS).view(-1, 2)
    with torch.no_grad():
        np.testing.assert_array_equal(plain(every).numpy(), model(every).numpy())


def test_a_sharded_state_dict_is_refused_for_an_in_memory_model_saying_how_to_export(rng):
    emb = ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
    state = Model(emb, torch.nn.Linear(DIM, 1)).state_dict()
    with pytest.raises(ss.OptionError, match="load_sharded"):
        in_memory_state_dict(state)
    assert "emb._extra_state" in state  # nothing changed in it
