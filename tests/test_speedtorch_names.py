"""SpeedTorch's documented API, name by name: each works as SpeedTorch's did, or says what replaces it."""

import re

import numpy as np
import pytest
import torch

import speedswap as ss

ROWS, DIM = 60, 4

MODEL_FACTORY = ["zerosInit", "uniformDistributionInit", "normalDistributionInit", "customInit",
                 "variableTransformer", "beforeForwardPass", "afterOptimizerStep", "saveCupy",
                 "loadCupy", "saveTorch", "loadTorch", "getNumpyVersion", "getTorchVar", "getCupyVar"]
# SpeedTorch's optimizer factories inherited getNumpyVersion, getCupyVar, getTorchVar, saveTorch and loadTorch.
OPTIMIZER_FACTORY = ["optInit", "beforeForwardPass", "afterOptimizerStep", "saveCupy", "loadCupy",
                     "getNumpyVersion", "getCupyVar", "getTorchVar", "saveTorch", "loadTorch"]
DATA_GADGET = ["gadgetInit", "getData", "insertData", "saveCupy", "loadCupy", "getNumpyVersion", "getCupyVar"]
CLASSES = ["ModelFactory", "OptimizerFactory", "DataGadget", "GPUPytorchModelFactory",
           "GPUPytorchOptimizerFactory", "CPUPytorchModelFactory", "CPUPytorchOptimizerFactory"]


def switchers():
    model = torch.nn.Embedding(8, DIM)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    u = ss.ModelFactory(model, ROWS, DIM, CPUPinn=True, backend="numpy")
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e",
                            CPUPinn=True, backend="numpy")
    return model, opt, u, o


def speedtorch_step(model, opt, u, o, ids, weights=1.0):
    """One step in SpeedTorch's order: both switchers' beforeForwardPass, a loss of the rows times
    ``weights``, the optimizer's step and zero_grad, both switchers' afterOptimizerStep."""
    local = u.beforeForwardPass(ids)
    o.beforeForwardPass(ids)
    (model(local) * weights).sum().backward()
    opt.step()
    opt.zero_grad()
    u.afterOptimizerStep(ids)
    o.afterOptimizerStep(ids)


def test_every_documented_name_exists():
    for name in CLASSES:
        assert hasattr(ss, name), name
    _, _, u, o = switchers()
    gadget = ss.DataGadget(np.ones((3, 2), np.float32), backend="numpy")
    for obj, names in ((u, MODEL_FACTORY), (o, OPTIMIZER_FACTORY), (gadget, DATA_GADGET)):
        missing = [n for n in names if not callable(getattr(obj, n, None))]
        assert not missing, f"{type(obj).__name__} lacks {missing}"


def test_save_and_load_torch_files_as_speedtorch_wrote_them(rng, tmp_path):
    _, _, u, _ = switchers()
    u.uniformDistributionInit(-1.0, 1.0)
    table = u.getNumpyVersion()
    u.saveTorch(tmp_path / "u.pt")
    saved = torch.load(tmp_path / "u.pt", weights_only=True)
    np.testing.assert_array_equal(saved.numpy(), table)        # a plain torch tensor
    u.zerosInit()
    u.loadTorch(tmp_path / "u.pt")
    np.testing.assert_array_equal(u.getNumpyVersion(), table)
    torch.save(torch.ones(3, 3), tmp_path / "other.pt")
    with pytest.raises(ss.FileFormatError, match=r"\(3, 3\)"):
        u.loadTorch(tmp_path / "other.pt")
    np.testing.assert_array_equal(u.getNumpyVersion(), table)   # nothing changed
    u.saveTorch(tmp_path / "u.npy")                              # other suffixes: as save
    np.testing.assert_array_equal(np.load(tmp_path / "u.npy"), table)


def test_load_torch_of_a_missing_file_says_it_is_missing(rng, tmp_path):
    """loadTorch of a path with no file raised FileFormatError "not a readable torch file ([Errno 2]
    ...)", which ``except FileNotFoundError`` misses and which reads as a damaged file; a named
    pipe would have made torch.load wait for a writer."""
    import os
    _, _, u, _ = switchers()
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    table = u.getNumpyVersion()
    with pytest.raises(ss.MissingFileError, match="no torch file at .*check the path") as info:
        u.loadTorch(tmp_path / "nothere.pt")
    assert isinstance(info.value, FileNotFoundError)
    os.mkfifo(tmp_path / "pipe.pt")
    with pytest.raises(ss.PathError, match="not a regular file"):
        u.loadTorch(tmp_path / "pipe.pt")
    np.testing.assert_array_equal(u.getNumpyVersion(), table)


def test_load_torch_of_another_table_says_how_to_load_it(rng, tmp_path):
    """A .pt of another shape or dtype, or of no tensor, said only what it held, not what to do."""
    _, _, u, _ = switchers()
    table = u.getNumpyVersion()
    torch.save(torch.from_numpy(rng.standard_normal((ROWS + 1, DIM))), tmp_path / "other.pt")
    torch.save({"weight": torch.ones(ROWS, DIM)}, tmp_path / "dict.pt")
    with pytest.raises(ss.FileFormatError, match=rf"total_classes={ROWS + 1}, embed_dimension={DIM}, "
                                                 r"datatype='float64'"):
        u.loadTorch(tmp_path / "other.pt")
    with pytest.raises(ss.FileFormatError, match=r"holds dict.*torch.save\(tensor\)"):
        u.loadTorch(tmp_path / "dict.pt")
    np.testing.assert_array_equal(u.getNumpyVersion(), table)


def test_get_numpy_version_is_a_copy_and_get_torch_var_a_view():
    _, _, u, _ = switchers()
    u.uniformDistributionInit(-1.0, 1.0)
    copy = u.getNumpyVersion()
    copy /= np.linalg.norm(copy, axis=1, keepdims=True)          # SpeedTorch users normalise it
    assert not np.allclose(u.to_numpy(), copy)                   # the table is untouched
    u.getTorchVar()[0] = 5.0
    assert (u.to_numpy()[0] == 5.0).all()


def test_get_cupy_var_names_the_replacement():
    _, _, u, _ = switchers()
    with pytest.raises(ss.OptionError, match="getTorchVar"):
        u.getCupyVar()


def test_optimizer_factory_save_cupy_round_trip(tmp_path):
    model, opt, u, o = switchers()
    u.uniformDistributionInit(-1.0, 1.0)
    ids = torch.tensor([1, 5, 1])
    speedtorch_step(model, opt, u, o, ids)
    state = o.state.tables["sum"].to_numpy(copy=True)
    o.saveCupy(tmp_path / "opt")
    o.optInit()
    o.loadCupy(tmp_path / "opt")
    np.testing.assert_array_equal(o.state.tables["sum"].to_numpy(), state)


def test_get_data_flattens_and_joins_indexes_as_speedtorch_did(rng, tmp_path):
    data = rng.standard_normal((20, 3)).astype(np.float32)
    np.save(tmp_path / "data.npy", data)
    gadget = ss.DataGadget(fileName=str(tmp_path / "data.npy"), backend="numpy")
    pos, neg = rng.integers(0, 20, (4, 2)), rng.integers(0, 20, (4, 5))
    # SpeedTorch: CUPYcorpus[np.concatenate([pos.reshape(-1), neg.reshape(-1)])]
    np.testing.assert_array_equal(gadget.getData(pos, neg).numpy(),
                                  data[np.concatenate([pos.reshape(-1), neg.reshape(-1)])])
    np.testing.assert_array_equal(gadget.getData(torch.from_numpy(pos)).numpy(), data[pos.reshape(-1)])
    np.testing.assert_array_equal(gadget.getData([7]).numpy(), data[[7]])
    with pytest.raises(ss.DTypeError, match="negIndexes"):
        gadget.getData(pos, neg.astype(np.float32))


def test_data_gadget_get_cupy_var_names_the_replacement(rng):
    gadget = ss.DataGadget(rng.standard_normal((5, 2)).astype(np.float32), backend="numpy")
    with pytest.raises(ss.OptionError, match="get\\(ids\\)"):
        gadget.getCupyVar()


def test_cpu_pytorch_factories_keep_pinned_tables():
    model = torch.nn.Embedding(8, DIM)
    u = ss.CPUPytorchModelFactory(model, ROWS, DIM, backend="numpy")
    o = ss.CPUPytorchOptimizerFactory(torch.optim.Adam(model.parameters()), ROWS, DIM,
                                      torch.nn.ModuleDict({"e": model}), "e", backend="numpy")
    assert u.table.storage == "pinned"
    assert all(t.storage == "pinned" for t in o.state.tables.values())


def test_speedtorch_argument_names_work_as_keywords(rng, tmp_path):
    """SpeedTorch's documented argument names, passed by keyword as old code may (they raised TypeError)."""
    model, opt, u, o = switchers()
    u.uniformDistributionInit(low=-1.0, high=1.0)
    pos = torch.from_numpy(rng.integers(0, ROWS, 3))
    neg = torch.from_numpy(rng.integers(0, ROWS, (3, 1)))  # at most 6 distinct rows: the working set holds 8
    local_pos, local_neg = u.beforeForwardPass(retrievedPosIndexes=pos, retrievedNegIndexes=neg)
    o.beforeForwardPass(retrievedPosIndexes=pos, retrievedNegIndexes=neg)
    (model(local_pos).sum() + model(local_neg).square().sum()).backward()
    opt.step()
    opt.zero_grad()
    u.afterOptimizerStep(retrievedPosIndexes=pos, retrievedNegIndexes=neg)
    o.afterOptimizerStep(retrievedPosIndexes=pos, retrievedNegIndexes=neg)
    table, state = u.getNumpyVersion(), o.state.tables["sum"].to_numpy(copy=True)
    u.saveCupy(saveFileName=tmp_path / "u.npy")
    u.saveTorch(saveFileName=tmp_path / "u.pt")
    o.saveCupy(saveFileName=tmp_path / "opt")
    u.zerosInit()
    o.optInit()
    u.loadCupy(loadFileName=tmp_path / "u.npy")
    o.loadCupy(loadFileName=tmp_path / "opt")
    np.testing.assert_array_equal(u.getNumpyVersion(), table)
    np.testing.assert_array_equal(o.state.tables["sum"].to_numpy(), state)
    u.zerosInit()
    u.loadTorch(loadFileName=tmp_path / "u.pt")
    np.testing.assert_array_equal(u.getNumpyVersion(), table)

    data = rng.standard_normal((10, 3)).astype(np.float32)
    gadget = ss.DataGadget(data, backend="numpy")
    gadget.saveCupy(saveFileName=tmp_path / "data.npy")
    gadget.insertData(dataObject=torch.zeros(2, 3), indexes=[1, 4])
    gadget.loadCupy(loadFileName=tmp_path / "data.npy")
    np.testing.assert_array_equal(gadget.getData(indexes=[1, 4]).numpy(), data[[1, 4]])


def test_save_and_load_of_a_torch_file_name_save_torch_and_load_torch(rng, tmp_path):
    """saveCupy("u.pt") / loadCupy("u.pt") said "name it *.npy (numpy) or *.h5 / *.hdf5 (HDF5)", not
    that the switcher's saveTorch / loadTorch write and read torch files; then "loadTorch writes and reads"."""
    _, _, u, _ = switchers()
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    table = u.getNumpyVersion()
    u.saveTorch(tmp_path / "u.pt")
    u.zerosInit()
    for call, name in ((u.saveCupy, "saveTorch"), (u.save, "saveTorch"), (u.loadCupy, "loadTorch"),
                       (u.load, "loadTorch")):
        with pytest.raises(ss.OptionError, match=rf"{name} takes \*\.pt"):
            call(tmp_path / "u.pt")
    assert not np.any(u.getNumpyVersion())  # nothing loaded
    np.testing.assert_array_equal(torch.load(tmp_path / "u.pt", weights_only=True).numpy(), table)  # nor written
    u.loadTorch(tmp_path / "u.pt")  # what the message says
    np.testing.assert_array_equal(u.getNumpyVersion(), table)


def test_an_optimizer_factory_save_of_a_npy_name_says_it_holds_no_single_table(rng, tmp_path):
    """saveCupy("u_opt.npy"), the name SpeedTorch's cupy.save took, said "cannot tell the checkpoint
    format of 'u_opt.npy'" and then that "*.npy is the table alone (an export)", which an
    OptimizerFactory, with one state table per state tensor, has none of."""
    model, opt, u, o = switchers()
    o.optInit()
    speedtorch_step(model, opt, u, o, torch.from_numpy(rng.integers(0, ROWS, 6)))
    state = o.getNumpyVersion()
    for call in (o.saveCupy, o.save, o.loadCupy, o.load):
        with pytest.raises(ss.OptionError) as info:
            call(tmp_path / "u_opt.npy")
        message = str(info.value)
        assert "cannot tell" not in message and "u_opt.npy" in message, message
        assert repr(str(tmp_path / "u_opt.h5")) in message and repr(str(tmp_path / "u_opt")) in message, \
            message  # the names to use instead
    assert list(tmp_path.iterdir()) == []
    for name, table in o.getNumpyVersion().items():
        np.testing.assert_array_equal(table, state[name])  # nothing loaded


def test_an_optimizer_factory_save_of_a_npy_name_does_not_claim_tables_it_lacks(tmp_path):
    """The refusal of a .npy name said "this checkpoint holds several tables" to an
    OptimizerFactory over Adagrad, whose checkpoint holds one state table ("sum"): what a .npy
    file cannot hold is the manifest beside the tables, which names the optimizer a load checks."""
    model, opt, u, o = switchers()
    o.optInit()
    assert len(o.state.tables) == 1  # Adagrad's sum
    with pytest.raises(ss.OptionError) as info:
        o.save(tmp_path / "u_opt.npy")
    message = str(info.value)
    assert "several tables" not in message, message
    assert "one per state tensor" in message and "optimizer" in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, first", [("GPUPytorchModelFactory", "model_variable"),
                                         ("CPUPytorchModelFactory", "model_variable"),
                                         ("GPUPytorchOptimizerFactory", "given_optimizer"),
                                         ("CPUPytorchOptimizerFactory", "given_optimizer")])
def test_per_storage_classes_show_speedtorch_arguments_in_help(name, first):
    """help(ss.GPUPytorchModelFactory) showed ``(*args, backend='auto', **kwargs)`` and a one-line doc
    with no Args or Raises: nothing told a SpeedTorch user what to pass, or in what order."""
    import inspect
    import pydoc
    cls = getattr(ss, name)
    base = cls.__mro__[1]
    expected = [p for p in inspect.signature(base).parameters if p not in ("storage", "CPUPinn")]
    assert list(inspect.signature(cls).parameters) == expected
    assert expected[0] == first
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    # The arguments in SpeedTorch's order, each with its type hint.
    assert re.search(rf"{name}\({first}: [^\n]+, total_classes: int, embed_dimension: int", text), text[:600]
    doc = inspect.getdoc(cls)
    assert "Args:" in doc and "Raises:" in doc and "storage" in doc


def test_per_storage_classes_refuse_cpupinn(rng):
    """GPUPytorchModelFactory(..., CPUPinn=True) silently kept its table in device memory, and
    CPUPytorch*(..., CPUPinn=False) in pinned memory: the argument was ignored. SpeedTorch's
    per-storage classes took no CPUPinn; now it is refused, positional or keyword, before anything is built."""
    model = torch.nn.Embedding(8, DIM)
    holder = torch.nn.ModuleDict({"e": model})
    opt = torch.optim.Adam(model.parameters())
    for make in (lambda: ss.GPUPytorchModelFactory(model, ROWS, DIM, "float32", True, backend="numpy"),
                 lambda: ss.GPUPytorchModelFactory(model, ROWS, DIM, CPUPinn=True, backend="numpy"),
                 lambda: ss.CPUPytorchModelFactory(model, ROWS, DIM, CPUPinn=False, backend="numpy"),
                 lambda: ss.CPUPytorchOptimizerFactory(opt, ROWS, DIM, holder, "e", "float32", False,
                                                       backend="numpy"),
                 lambda: ss.GPUPytorchOptimizerFactory(opt, ROWS, DIM, holder, "e", CPUPinn=True,
                                                       backend="numpy")):
        with pytest.raises(ss.OptionError, match="CPUPinn does not apply.*CPUPinn=") as info:
            make()
        assert isinstance(info.value, ValueError)
    # Nothing was built: the embedding trains with the classes as SpeedTorch called them.
    u = ss.GPUPytorchModelFactory(model, ROWS, DIM, torch.float, backend="numpy")
    o = ss.GPUPytorchOptimizerFactory(opt, ROWS, DIM, holder, "e", torch.float, backend="numpy")
    u.normalDistributionInit(0.0, 1.0)
    ids = torch.from_numpy(rng.integers(0, ROWS, 6))
    speedtorch_step(model, opt, u, o, ids)
    assert u.table.storage == "device"


def test_speedtorch_names_document_args_and_raises():
    """help() of SpeedTorch's own names (zerosInit, uniformDistributionInit, beforeForwardPass,
    saveCupy, ...) gave a single line: no arguments, no errors, though they are what a SpeedTorch
    user calls and they raise (low > high, a step in progress, a bad path)."""
    import inspect
    _, _, u, o = switchers()
    gadget = ss.DataGadget(np.ones((3, 2), np.float32), backend="numpy")
    missing = []
    for obj, names in ((u, MODEL_FACTORY), (o, OPTIMIZER_FACTORY), (gadget, DATA_GADGET)):
        for name in names:
            method = getattr(obj, name)
            doc = inspect.getdoc(method) or ""
            takes_args = any(p.kind is not p.VAR_KEYWORD for p in inspect.signature(method).parameters.values())
            wanted = (["Args:"] if takes_args else []) + ["Raises:"]
            missing += [f"{type(obj).__name__}.{name}: {w}" for w in wanted if w not in doc]
    assert not missing, missing


def test_data_gadget_names_only_npy_for_a_path_without_suffix(rng, tmp_path):
    """DataGadget.saveCupy("data") (cupy.save added ".npy" in SpeedTorch) said "name it *.npy (numpy) or
    *.h5 / *.hdf5 (HDF5)"; following that with "data.h5" was then refused, since a DataGadget saves
    and reads .npy only. Opening or loadCupy of "data" said the same."""
    data = rng.standard_normal((6, 3)).astype(np.float32)
    gadget = ss.DataGadget(data, backend="numpy")
    bare = tmp_path / "data"
    for call in (gadget.saveCupy, gadget.loadCupy, lambda path: ss.DataGadget(path, backend="numpy")):
        with pytest.raises(ss.OptionError) as info:
            call(bare)
        assert ".npy files" in str(info.value) and "*.h5" not in str(info.value)
    assert not any(tmp_path.iterdir())                        # nothing written
    np.testing.assert_array_equal(gadget.getNumpyVersion(), data)


def test_save_cupy_without_a_suffix_says_which_to_use(rng, tmp_path):
    """README's migration notes: SpeedTorch's saveCupy("u") wrote u.npy (cupy.save adds it); here the
    suffix is needed, and the error names it, with nothing written. An OptimizerFactory writes a directory."""
    model, opt, u, o = switchers()
    u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    gadget = ss.DataGadget(rng.standard_normal((5, 3)).astype(np.float32), backend="numpy")
    for obj in (u, gadget):
        with pytest.raises(ss.OptionError, match=r"\*\.npy"):
            obj.saveCupy(tmp_path / "u")
    assert not any(tmp_path.iterdir())
    o.saveCupy(tmp_path / "u_opt")
    assert (tmp_path / "u_opt").is_dir()


def test_a_forgotten_after_optimizer_step_is_refused_in_speedtorchs_names_and_the_fix_trains_exactly(rng):
    """Forgetting a switcher's ``afterOptimizerStep`` raised "before_forward called twice without after_step;
    finish the step with after_step(ids)": names a SpeedTorch user never called, for the two they did."""
    model, opt, u, o = switchers()
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    u.customInit(lambda t: t.copy_(torch.from_numpy(rows)))
    reference = torch.nn.Embedding.from_pretrained(torch.from_numpy(rows.copy()), freeze=False, sparse=True)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    batches = [torch.from_numpy((rng.zipf(1.3, 8) - 1) % ROWS) for _ in range(4)]
    weights = [torch.from_numpy(rng.standard_normal((8, DIM), dtype=np.float32)) for _ in batches]
    for step, (ids, w) in enumerate(zip(batches, weights)):
        local = u.beforeForwardPass(ids)
        o.beforeForwardPass(ids)
        (model(local) * w).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 1:  # both switchers' afterOptimizerStep forgotten
            for switcher in (u, o):
                with pytest.raises(ss.StateError, match=r"^beforeForwardPass \(before_forward\) called twice "
                                                        r"without afterOptimizerStep.* afterOptimizerStep\(ids\)"):
                    switcher.beforeForwardPass(batches[step + 1])
        u.afterOptimizerStep(ids)
        o.afterOptimizerStep(ids)
        (reference(ids) * w).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    np.testing.assert_allclose(u.getNumpyVersion(), reference.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_save_torch_and_load_torch_without_a_suffix_name_the_torch_one(rng, tmp_path):
    """SpeedTorch's ``saveTorch("u")`` wrote ``torch.save`` to ``u`` as named; here the refusal named only
    *.npy and *.h5, not the *.pt that saveTorch writes, nor how to load such a file SpeedTorch wrote."""
    model, opt, u, o = switchers()
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    u.customInit(lambda t: t.copy_(torch.from_numpy(rows)))
    with pytest.raises(ss.OptionError, match=r"saveTorch .*'.*u'.* \*\.pt"):
        u.saveTorch(tmp_path / "u")
    assert not any(tmp_path.iterdir())
    torch.save(torch.from_numpy(rows * 2), tmp_path / "speedtorch_u")   # as SpeedTorch's saveTorch wrote it
    with pytest.raises(ss.OptionError, match=r"loadTorch .*speedtorch_u.* \*\.pt.* renamed"):
        u.loadTorch(tmp_path / "speedtorch_u")
    np.testing.assert_array_equal(u.getNumpyVersion(), rows)          # nothing loaded
    (tmp_path / "speedtorch_u").rename(tmp_path / "speedtorch_u.pt")   # the way the refusal names
    u.loadTorch(tmp_path / "speedtorch_u.pt")
    np.testing.assert_array_equal(u.getNumpyVersion(), rows * 2)


@pytest.mark.parametrize("cache_rows", [0, 5])
def test_optimizer_factory_get_numpy_version_copies_every_state_table(rng, cache_rows):
    """OptimizerFactory.getNumpyVersion() raised a bare AttributeError (SpeedTorch's inherited it, its
    CuPy variant over a table it never set). Compared bit for bit with Adagrad in memory."""
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    model = torch.nn.Embedding(8, DIM)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25)
    u = ss.ModelFactory(model, ROWS, DIM, backend="numpy", cache_rows=cache_rows)
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e", backend="numpy",
                            cache_rows=cache_rows)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    # Dense gradients, bit for bit: sparse-gradient Adagrad coalesces repeated ids and divides then adds.
    reference = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0), freeze=False)
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1, initial_accumulator_value=0.25)
    for _ in range(6):
        ids = torch.from_numpy(rng.integers(0, ROWS, 6))
        weights = torch.from_numpy(rng.standard_normal((6, DIM), dtype=np.float32))
        speedtorch_step(model, opt, u, o, ids, weights)
        (reference(ids) * weights).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = o.getNumpyVersion()
    assert list(state) == ["sum"]
    np.testing.assert_array_equal(state["sum"], ref_opt.state[reference.weight]["sum"].numpy())
    state["sum"][:] = -1.0                                        # a copy: the table is untouched
    np.testing.assert_array_equal(o.getNumpyVersion()["sum"], ref_opt.state[reference.weight]["sum"].numpy())
    ids = torch.from_numpy(rng.integers(0, ROWS, 3))
    local = u.beforeForwardPass(ids)
    o.beforeForwardPass(ids)
    model(local).sum().backward()
    np.testing.assert_allclose(o.getNumpyVersion()["sum"], ref_opt.state[reference.weight]["sum"].numpy(),
                               rtol=1e-6)                         # before optimizer.step(): as in memory
    opt.step()
    with pytest.raises(ss.StateError, match="before afterOptimizerStep"):
        o.getNumpyVersion()                                       # the step's state is in the optimizer


def test_optimizer_factory_save_torch_and_load_torch_are_save_and_load(rng, tmp_path):
    """saveTorch / loadTorch, which SpeedTorch's GPU and CPU optimizer factories inherited, raised a
    bare AttributeError. They write and read the state tables' checkpoint, as save and load do."""
    _, _, _, o = switchers()
    sums = rng.uniform(0.5, 2.0, (ROWS, DIM)).astype(np.float32)
    o.state.tables["sum"].apply_(lambda t: t.copy_(torch.from_numpy(sums)))
    o.saveTorch(saveFileName=tmp_path / "opt.h5")
    o.optInit()
    o.loadTorch(loadFileName=tmp_path / "opt.h5")
    np.testing.assert_array_equal(o.getNumpyVersion()["sum"], sums)
    for call in (o.saveTorch, o.loadTorch):                       # no torch file: the checkpoint's formats
        with pytest.raises(ss.OptionError, match=r"\*\.h5"):
            call(tmp_path / "opt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt.h5"]


def test_optimizer_factory_get_cupy_var_and_get_torch_var_name_the_replacement():
    """SpeedTorch's optimizer factories inherited getCupyVar / getTorchVar over a table they never set
    (AttributeError there and here); they now say where the state tables are."""
    _, _, _, o = switchers()
    for name in ("getCupyVar", "getTorchVar"):
        with pytest.raises(ss.OptionError, match=r"\['sum'\]\. Use state\.tables\[name\]\.as_tensor\(\).*getNumpyVersion"):
            getattr(o, name)()
