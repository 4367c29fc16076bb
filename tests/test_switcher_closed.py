"""A closed switcher: every public method and property refuses, naming the switcher, the call and what to do."""

import inspect

import numpy as np
import pytest
import torch

import speedswap as ss

ROWS, DIM, CAPACITY, BATCH = 50, 4, 16, 10

#: Names that refuse on an open switcher too (SpeedTorch's CuPy array): OptionError, saying what replaces them.
REFUSED_WHEN_OPEN = {("ModelFactory", "getCupyVar"), ("OptimizerFactory", "getCupyVar"),
                     ("OptimizerFactory", "getTorchVar")}


def _public_names(obj):
    """Every public method and property of a switcher's class, but ``close`` (idempotent)."""
    names = set()
    for name in dir(type(obj)):
        member = inspect.getattr_static(type(obj), name)
        if not name.startswith("_") and name != "close" and (
                inspect.isfunction(member) or isinstance(member, property)):
            names.add(name)
    return names


def _session(u, o, model, opt, ids, next_ids, tmp_path, call):
    """Call every public method and property of both switchers, in an order that works on open ones.

    ``call(obj, name, *args)`` makes each call and returns its result; the model's own training
    between a step's before_forward and after_step runs only while ``model`` is given.
    """
    for switcher in (u, o):
        call(switcher, "flush")
        call(switcher, "stats")
    call(u, "zerosInit")
    call(u, "uniformDistributionInit", -0.1, 0.1)
    call(u, "normalDistributionInit", 0.0, 0.1)
    call(o, "optInit")
    call(o, "init_state")
    for before, after in (("before_forward", "after_step"), ("beforeForwardPass", "afterOptimizerStep")):
        local = call(u, before, ids)
        call(o, before, ids)
        call(u, "prefetch", next_ids)
        call(u, "prefetchNextBatch", next_ids)
        if model is not None:
            model(local).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        call(u, after, ids)
        call(o, after, ids)
    for name, path in (("save", "u.npy"), ("saveCupy", "u2.npy"), ("saveTorch", "u.pt")):
        call(u, name, tmp_path / path)
    for name, path in (("load", "u.npy"), ("loadCupy", "u2.npy"), ("loadTorch", "u.pt")):
        call(u, name, tmp_path / path)
    for name, path in (("save", "o.h5"), ("saveCupy", "o2.h5"), ("saveTorch", "o3.h5")):
        call(o, name, tmp_path / path)
    for name, path in (("load", "o.h5"), ("loadCupy", "o2.h5"), ("loadTorch", "o3.h5")):
        call(o, name, tmp_path / path)
    for name in ("to_numpy", "getNumpyVersion", "getTorchVar", "getCupyVar", "table"):
        call(u, name)
    for name in ("getNumpyVersion", "getTorchVar", "getCupyVar"):
        call(o, name)
    call(u, "customInit", torch.nn.init.uniform_, -0.2, 0.2)
    call(u, "variableTransformer", BATCH, 1)
    call(o, "state")


def _switchers(rng, backend):
    device = ss.get_backend(backend).device
    model = torch.nn.Embedding(CAPACITY, DIM).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    u = ss.ModelFactory(model, ROWS, DIM, backend=backend)
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e", backend=backend)
    ids = torch.from_numpy(rng.integers(0, ROWS, BATCH)).to(device)
    next_ids = torch.from_numpy(rng.integers(0, ROWS, BATCH)).to(device)
    return model, opt, u, o, ids, next_ids


def test_every_public_call_of_a_closed_switcher_says_it_was_closed_and_what_to_do(backend, rng, tmp_path):
    """They said "this HostTable is closed; its memory was released" (an internal class, no remedy), or
    nothing at all: flush(), stats(), variableTransformer() and ``table`` answered as if open."""
    model, opt, u, o, ids, next_ids = _switchers(rng, backend)
    called = {u: set(), o: set()}

    def works(obj, name, *args):
        called[obj].add(name)
        if (type(obj).__name__, name) in REFUSED_WHEN_OPEN:
            with pytest.raises(ss.OptionError):
                getattr(obj, name)(*args)
            return None
        member = getattr(obj, name)
        return member(*args) if callable(member) else member

    _session(u, o, model, opt, ids, next_ids, tmp_path, works)
    for switcher in (u, o):
        assert called[switcher] == _public_names(switcher), "the session must call every public name"
    table = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table)))
    np.testing.assert_array_equal(u.getNumpyVersion(), table)   # open: the calls still work

    u.close()
    o.close()

    def refused(obj, name, *args):
        cls = type(obj).__name__
        with pytest.raises(ss.StateError, match=rf"^{cls}\.{name}\b.* was closed .* build a new {cls}") as info:
            member = getattr(obj, name)
            member(*args)
        assert isinstance(info.value, RuntimeError)

    _session(u, o, None, None, ids, next_ids, tmp_path, refused)
    u.close()  # still idempotent
    o.close()


def test_a_closed_switcher_refuses_before_anything_changes(backend, rng, tmp_path):
    """loadTorch of a missing file said the file was missing, and OptimizerFactory.load a checkpoint's
    problem: the closed switcher was found out only after the file was looked at."""
    _, _, u, o, _, _ = _switchers(rng, backend)
    u.close()
    o.close()
    with pytest.raises(ss.StateError, match=r"ModelFactory\.loadTorch\(\)"):
        u.loadTorch(tmp_path / "missing.pt")
    with pytest.raises(ss.StateError, match=r"OptimizerFactory\.load\(\)"):
        o.load(tmp_path / "missing.h5")
    assert not list(tmp_path.iterdir())


def test_every_public_call_of_a_replaced_switcher_says_it_was_replaced(backend, rng, tmp_path):
    """Only the steps of a switcher replaced by a newer one of the embedding refused: its initialisers,
    saves, loads, copies, ``table``, ``stats`` and ``flush`` went on over its own table, which no
    longer trains, so an initialisation or a save through it missed the table training."""
    model, opt, old_u, old_o, ids, next_ids = _switchers(rng, backend)
    u = ss.ModelFactory(model, ROWS, DIM, backend=backend)
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e", backend=backend)
    table = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    u.customInit(lambda t: t.copy_(torch.from_numpy(table)))

    def refused(obj, name, *args):
        cls = type(obj).__name__
        with pytest.raises(ss.StateError, match=rf"^{cls}\.{name}\b.* was replaced by a newer {cls} "
                                                rf"of the same embedding; use the newer one") as info:
            member = getattr(obj, name)
            member(*args)
        assert isinstance(info.value, RuntimeError)

    _session(old_u, old_o, None, None, ids, next_ids, tmp_path, refused)
    assert not list(tmp_path.iterdir())  # no save went through
    np.testing.assert_array_equal(u.getNumpyVersion(), table)  # no initialiser or load reached it
    old_u.close()  # releasing what a replaced switcher holds still works
    old_o.close()
    local = u.before_forward(ids)  # the newer ones train on
    o.before_forward(ids)
    model(local).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    u.after_step(ids)
    o.after_step(ids)
    trained = u.getNumpyVersion()
    touched = np.unique(ids.cpu().numpy())
    untouched = np.setdiff1d(np.arange(ROWS), touched)
    np.testing.assert_array_equal(trained[untouched], table[untouched])
    assert (trained[touched] != table[touched]).all(axis=1).all()


def test_a_replaced_switcher_whose_newer_one_was_closed_says_to_build_a_new_one(backend, rng):
    """Once the newer switcher was closed too, a call of the replaced one (and a write into a table
    kept from it) still said "use the newer one": a switcher that refuses every call itself."""
    model, opt, old_u, old_o, _, _ = _switchers(rng, backend)
    kept = old_u.table
    u = ss.ModelFactory(model, ROWS, DIM, backend=backend)
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e", backend=backend)
    rows = torch.from_numpy(rng.choice(ROWS, 3, replace=False))
    values = torch.from_numpy(rng.standard_normal((3, DIM), dtype=np.float32))
    before = kept.to_numpy(copy=True)
    u.close()
    for switcher, cls, newer in ((old_u, "ModelFactory", u), (old_o, "OptimizerFactory", o)):
        if newer is o:  # while the newer one serves, it is the one to use
            with pytest.raises(ss.StateError, match=r"replaced by a newer OptimizerFactory of the same "
                                                    r"embedding; use the newer one"):
                switcher.stats()
            o.close()
        with pytest.raises(ss.StateError, match=rf"^{cls}\.stats\(\): this {cls} was replaced by a newer "
                                                rf"{cls} of the same embedding, closed since: build a new "
                                                rf"{cls} ") as refused:
            switcher.stats()
        assert "use the newer one" not in str(refused.value)
    with pytest.raises(ss.StateError, match=r"replaced by a newer ModelFactory.*closed since.*build a new "
                                            r"ModelFactory") as refused:
        kept.scatter(rows, values)
    assert "write into the newer" not in str(refused.value)
    np.testing.assert_array_equal(kept.to_numpy(copy=True), before)  # refused before any row changed


def test_a_table_kept_from_a_replaced_switcher_refuses_writes_and_still_reads(backend, rng, tmp_path):
    """A ModelFactory's ``table`` or an OptimizerFactory's state table taken before a newer switcher
    replaced it took scatter, apply_, the initialisers and load_from, into rows nothing trains any
    more: the writes were lost, silently. Reads stay: its rows are as trained until the replacement."""
    model, opt, old_u, old_o, ids, _ = _switchers(rng, backend)
    old_u.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    kept = {("ModelFactory", "table"): old_u.table}
    for name, state_table in old_o.state.tables.items():
        state_table.apply_(lambda t: t.copy_(torch.from_numpy(rng.random((ROWS, DIM), dtype=np.float32))))
        kept[("OptimizerFactory", name)] = state_table
    rows = {key: table.to_numpy(copy=True) for key, table in kept.items()}
    for key, table in kept.items():
        table.save(tmp_path / f"{key[1]}.npy")  # a file of the right shape for load_from
    u = ss.ModelFactory(model, ROWS, DIM, backend=backend)
    o = ss.OptimizerFactory(opt, ROWS, DIM, torch.nn.ModuleDict({"e": model}), "e", backend=backend)
    assert len(kept) == 3  # the table, Adam's exp_avg and exp_avg_sq

    some = torch.from_numpy(np.unique(rng.integers(0, ROWS, BATCH)))
    for (cls, name), table in kept.items():
        newer = "table" if cls == "ModelFactory" else "state.tables"
        writes = [lambda: table.scatter(some, torch.from_numpy(rng.standard_normal((len(some), DIM),
                                                                                    dtype=np.float32))),
                  lambda: table.apply_(torch.Tensor.mul_, 2.0),
                  table.zero_, table.uniform_, table.normal_,
                  lambda: table.load_from(tmp_path / f"{name}.npy")]
        for write in writes:
            with pytest.raises(ss.StateError, match=rf"its {cls} was replaced by a newer {cls} of the same "
                                                    rf"embedding.*write into the newer {cls}'s {newer}"):
                write()
            np.testing.assert_array_equal(table.to_numpy(copy=True), rows[cls, name])  # refused before any row changed
        np.testing.assert_array_equal(table.gather(some).cpu().numpy(), rows[cls, name][some.numpy()])
    # What the rows are still good for: copying them into the newer switchers' tables.
    u.table.load_from(tmp_path / "table.npy")
    for name, state_table in o.state.tables.items():
        state_table.scatter(torch.arange(ROWS), kept["OptimizerFactory", name].gather(torch.arange(ROWS)))
        np.testing.assert_array_equal(state_table.to_numpy(copy=True), rows["OptimizerFactory", name])
    np.testing.assert_array_equal(u.getNumpyVersion(), rows["ModelFactory", "table"])
