"""Regression tests of the defects found by fault injection and bad input (one test per defect).

Each test failed before its fix. The table-driven bad inputs are in
test_bad_inputs.py, the crash points of every save in test_fault_injection.py.
"""

import collections
import copy
import errno
import gc
import os
import re
import subprocess
import sys
import weakref
import zlib

import h5py
import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap import atomic
from speedswap.train import embedding as embedding_module
from speedswap.train.checkpoint import save_tables
from speedswap.errors import MissingFileError, OutOfMemoryError, PathError
from isolated import outcomes_in_children
from training_helpers import BATCH, CAPACITY, DIM, NUM_ROWS, run_in_memory, skipgram_loss, zipf_batches

TOL = dict(rtol=1e-5, atol=1e-6)


def make_table(rng, rows=50, dim=4):
    return ss.HostTable.from_numpy(rng.standard_normal((rows, dim), dtype=np.float32),
                                   storage="pageable", backend="numpy")


def make_embedding(rng, rows=60, **kwargs):
    emb = ss.OffloadedEmbedding(rows, DIM, max_rows=CAPACITY, storage="pageable",
                                backend="numpy", **kwargs)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(
        rng.standard_normal((rows, DIM), dtype=np.float32))))
    return emb


def train_step(emb, opt, rng, rows):
    ids = torch.from_numpy(rng.integers(0, rows, size=(BATCH,)))
    emb(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def adam_embedding(rng, **kwargs):
    """A :func:`make_embedding` with Adam attached, after one :func:`train_step` (its optimizer: ``emb._state.optimizer``)."""
    emb = make_embedding(rng, **kwargs)
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    train_step(emb, opt, rng, 60)
    return emb


# 1 ---------------------------------------------------------------------------
@pytest.mark.parametrize("make_values", [
    lambda v: torch.nn.Parameter(v),
    lambda v: torch.nn.Parameter(v) * 1.0,  # a result of a graph
], ids=["parameter", "graph"])
def test_scatter_of_values_that_require_grad_keeps_the_table_usable(rng, tmp_path, make_values):
    table = make_table(rng)
    values = torch.from_numpy(rng.standard_normal((2, 4), dtype=np.float32))
    table.scatter([3, 7], make_values(values.clone()))
    assert not table.as_tensor().requires_grad
    assert torch.equal(table.gather([3, 7]), values)
    table.save(tmp_path / "t.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy")[[3, 7]], values.numpy())


# 2 ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,make_opt", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.05)),
    ("adam", lambda p: torch.optim.Adam(p, lr=0.01)),
])
def test_step_with_the_forward_inside_a_closure_equals_in_memory(rng, name, make_opt):
    table0 = rng.standard_normal((400, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 40, "cpu")
    emb = ss.OffloadedEmbedding(400, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make_opt(emb.parameters())
    emb.attach(opt)  # a fresh embedding: the first step's closure is its first forward
    for pos, neg, ctx in batches:
        def closure():
            opt.zero_grad()
            loss = skipgram_loss(emb(pos), emb(neg), ctx)
            loss.backward()
            return loss
        opt.step(closure)
    ref_table, ref_state = run_in_memory(make_opt, table0, batches, "cpu",
                                         initial_state=lambda n, g: 0.0)
    np.testing.assert_allclose(emb.table.to_numpy(), ref_table, **TOL)
    for key, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), ref_state[key], **TOL, err_msg=key)


def test_switchers_step_with_a_closure_equals_in_memory(rng):
    table0 = rng.standard_normal((400, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 30, "cpu")
    make_opt = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAPACITY, DIM)})
    opt = make_opt(model.parameters())
    u = ss.ModelFactory(model["u"], 400, DIM, backend="numpy")
    u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    o = ss.OptimizerFactory(opt, 400, DIM, model, "u", backend="numpy")
    for pos, neg, ctx in batches:
        lpos, lneg = u.before_forward(pos, neg)
        o.before_forward(pos, neg)

        def closure():
            opt.zero_grad()
            loss = skipgram_loss(model["u"](lpos), model["u"](lneg), ctx)
            loss.backward()
            return loss
        opt.step(closure)
        u.after_step(pos, neg)
        o.after_step(pos, neg)
    ref_table, ref_state = run_in_memory(make_opt, table0, batches, "cpu",
                                         initial_state=lambda n, g: 0.0)
    np.testing.assert_allclose(u.to_numpy(), ref_table, **TOL)
    for key, table in o.state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), ref_state[key], **TOL, err_msg=key)


# 3 ---------------------------------------------------------------------------
def test_a_refused_step_leaves_the_embedding_as_it_was_and_the_advice_works(rng, tmp_path):
    emb = adam_embedding(rng)
    # As an older speedswap saved it, without the step count (emb.load now restores it).
    save_tables(tmp_path / "ckpt", emb._tables(), {"optimizer": "Adam"})
    fresh = torch.optim.Adam(emb.parameters(), lr=0.01)  # its state_dict is not restored
    emb.attach(fresh)
    emb.load(tmp_path / "ckpt")
    ids = torch.from_numpy(rng.integers(0, 60, size=(BATCH,)))
    emb(ids).pow(2).sum().backward()
    table_before = emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match="init_state"):
        fresh.step()
    assert emb.weight.shape == (emb.max_rows, DIM)
    assert emb.weight.grad.shape == (emb.max_rows, DIM)
    np.testing.assert_array_equal(emb.table.to_numpy(), table_before)
    emb.init_state()  # the message's advice
    fresh.step()
    fresh.zero_grad()
    train_step(emb, fresh, rng, 60)  # and training goes on


def test_a_step_the_optimizer_aborts_is_undone_before_the_next_use(rng, monkeypatch):
    emb = make_embedding(rng)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ids = torch.from_numpy(rng.integers(0, 60, size=(BATCH,)))
    emb(ids).pow(2).sum().backward()
    table_before = emb.table.to_numpy(copy=True)
    weight_before = emb.weight.detach().clone()

    def half_step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            p.data.mul_(3)  # changes the narrowed rows in place, then fails
        raise RuntimeError("injected optimizer failure")
    monkeypatch.setattr(torch.optim.SGD, "step", torch.optim.Optimizer.profile_hook_step(half_step))
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    monkeypatch.undo()
    emb(ids)  # the next use puts the step back
    assert emb.weight.shape == (emb.max_rows, DIM)
    assert torch.equal(emb.weight.detach(), weight_before)
    np.testing.assert_array_equal(emb.table.to_numpy(), table_before)


# 4 ---------------------------------------------------------------------------
def corrupt_chunk(path, dataset, chunk_index):
    """Overwrite the middle of one compressed chunk of ``dataset`` with garbage."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(chunk_index)
    with open(path, "r+b") as f:
        f.seek(info.byte_offset + info.size // 2)
        f.write(b"\xff\x00" * 8)


def write_compressed(path, datasets, attrs=None):
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f.create_dataset(name, data=data, chunks=(max(1, len(data) // 8), data.shape[1]),
                             compression="gzip")
        f.attrs.update(attrs or {})


def test_a_corrupt_hdf5_chunk_loads_nothing(rng, tmp_path):
    rows = 20_000
    table = make_table(rng, rows=rows)
    before = table.to_numpy(copy=True)
    path = tmp_path / "t.h5"
    write_compressed(path, {"table": rng.standard_normal((rows, 4), dtype=np.float32)})
    corrupt_chunk(path, "table", 6)  # after three quarters of the rows
    with pytest.raises(ss.FileFormatError, match="nothing was loaded"):
        table.load_from(path)
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_a_checkpoint_with_a_corrupt_table_loads_neither_table_nor_state(rng, tmp_path):
    emb = adam_embedding(rng)
    opt = emb._state.optimizer
    emb.save(tmp_path / "good.h5")
    with h5py.File(tmp_path / "good.h5") as f:
        content = {name: f[name][()] for name in f}
        attrs = dict(f.attrs)
    write_compressed(tmp_path / "bad.h5", {k: v + 1 for k, v in content.items()}, attrs)
    corrupt_chunk(tmp_path / "bad.h5", "optimizer.exp_avg_sq", 5)  # read after the table
    train_step(emb, opt, rng, 60)
    snapshot = {k: t.to_numpy(copy=True) for k, t in emb._tables().items()}
    with pytest.raises(ss.FileFormatError):
        emb.load(tmp_path / "bad.h5")
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), snapshot[name], err_msg=name)


def test_a_directory_checkpoint_with_a_flipped_byte_fails_its_checksum(rng, tmp_path):
    emb = make_embedding(rng)
    emb.attach(torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9))
    emb.save(tmp_path / "ckpt")
    version = os.path.join(tmp_path / "ckpt", (tmp_path / "ckpt" / "CURRENT").read_text().strip())
    with open(os.path.join(version, "optimizer.momentum_buffer.npy"), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x7f")
    before = emb.table.to_numpy(copy=True)
    emb.table.zero_()
    with pytest.raises(ss.FileFormatError, match="CRC-32"):
        emb.load(tmp_path / "ckpt")
    assert not emb.table.to_numpy().any()  # the table was not loaded either
    assert before.any()


# 5, 6 -------------------------------------------------------------------------
def test_save_never_touches_a_dot_old_it_did_not_write(rng, tmp_path):
    emb = make_embedding(rng)
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "mine.txt").write_text("keep me")
    emb.save(tmp_path / "ckpt")
    emb.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt.old" / "mine.txt").read_text() == "keep me"


def test_load_says_where_an_interrupted_old_style_save_left_the_checkpoint(rng, tmp_path):
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "checkpoint.json").write_text("{}")
    with pytest.raises(MissingFileError, match="rename it"):
        make_embedding(rng).load(tmp_path / "ckpt")


def test_mmap_embedding_never_overwrites_an_existing_table_file(rng, tmp_path):
    saved = rng.standard_normal((60, DIM), dtype=np.float32)
    np.save(tmp_path / "table.npy", saved)
    with pytest.raises(PathError, match="overwrite=True"):
        ss.OffloadedEmbedding(60, DIM, max_rows=8, storage="mmap", path=tmp_path, backend="numpy")
    np.testing.assert_array_equal(np.load(tmp_path / "table.npy"), saved)
    emb = ss.OffloadedEmbedding(60, DIM, max_rows=8, storage="mmap", path=tmp_path,
                                backend="numpy", overwrite=True)
    assert not np.array_equal(emb.table.to_numpy(), saved)


def test_mmap_embedding_reattaches_over_its_own_state_files(rng, tmp_path):
    emb = ss.OffloadedEmbedding(60, DIM, max_rows=CAPACITY, storage="mmap", path=tmp_path,
                                backend="numpy")
    first = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(first)
    train_step(emb, first, rng, 60)
    assert all(table.to_numpy().any() for table in emb._state.tables.values())
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)  # its own exp_avg.npy may be replaced: the new optimizer starts afresh
    tables = emb._state.tables
    assert sorted(os.path.basename(t.path) for t in tables.values()) == ["exp_avg.npy", "exp_avg_sq.npy"]
    assert not any(table.to_numpy().any() for table in tables.values())
    train_step(emb, opt, rng, 60)
    for table in tables.values():  # it trains in its files
        assert table.to_numpy().any()
        np.testing.assert_array_equal(np.load(table.path), table.to_numpy())


@pytest.mark.parametrize("kind, folder", [(ss.OffloadedEmbedding, ""), (ss.ShardedOffloadedEmbedding, "rank0")])
def test_a_refused_mmap_reattach_leaves_the_old_optimizer_attached(rng, tmp_path, kind, folder):
    # A file the new optimizer's state would replace is refused before the old state is closed:
    # the old optimizer trains on as if the attach had never been tried. (The sharded one's
    # refusal came after, and the next forward said to attach.)
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 12, "cpu")
    make = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    emb = kind(NUM_ROWS, DIM, max_rows=CAPACITY, storage="mmap", path=tmp_path, backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(emb.parameters())
    emb.attach(opt)
    stranger = rng.standard_normal((3, 2))
    stray = tmp_path / folder / "exp_avg.npy"
    for step, (pos, neg, ctx) in enumerate(batches):
        if step == 6:
            np.save(stray, stranger)
            with pytest.raises(PathError, match="exp_avg.npy"):
                emb.attach(torch.optim.Adam(emb.parameters(), lr=0.01))
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        opt.step()
        opt.zero_grad()
    np.testing.assert_array_equal(np.load(stray), stranger)
    expected, expected_state = run_in_memory(make, table0, batches, "cpu",
                                             initial_state=lambda name, group: 0.0)
    np.testing.assert_allclose(emb.table.to_numpy(), expected, **TOL)
    np.testing.assert_allclose(emb._state.tables["momentum_buffer"].to_numpy(),
                               expected_state["momentum_buffer"], **TOL)


@pytest.mark.parametrize("kind, where", [(ss.OffloadedEmbedding, "state"), (ss.OffloadedEmbedding, "cache"),
                                         (ss.ShardedOffloadedEmbedding, "state")])
@pytest.mark.parametrize("again", [False, True], ids=["another_optimizer", "same_optimizer"])
def test_an_attach_out_of_memory_leaves_the_old_optimizer_attached_and_unchanged(rng, monkeypatch, kind, where,
                                                                                  again):
    # The old state used to be released first, to make room: a new state (or device cache) that
    # did not fit left the embedding detached, the old optimizer's per-row state gone and, attached
    # again, its step count dropped. The new state is now made before the old one goes.
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 18, "cpu")
    make_sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    make_adam = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    cache = {"cache_rows": 20} if kind is ss.OffloadedEmbedding else {}  # a shard has no device cache
    emb = kind(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy", **cache)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))

    def train(opt, steps):
        for pos, neg, ctx in steps:
            skipgram_loss(emb(pos), emb(neg), ctx).backward()
            opt.step()
            opt.zero_grad()

    adam = make_adam(emb.parameters())
    emb.attach(adam)
    train(adam, batches[:6])
    make_new = make_adam if again else make_sgd
    new = adam if again else make_new(emb.parameters())

    def out_of_memory(*args, **kwargs):
        raise MemoryError(f"the new {where} does not fit (injected)")
    if where == "state":
        monkeypatch.setattr(type(emb.table.backend), "allocate", out_of_memory)
    else:
        monkeypatch.setattr(embedding_module, "new_cache", out_of_memory)
    with pytest.raises(MemoryError):
        emb.attach(new, restart=again)  # the same Adam, trained: a restart on purpose
    monkeypatch.undo()
    train(adam, batches[6:12])  # as if the attach had never been tried
    fresh = lambda name, group: 0.0  # noqa: E731
    middle, middle_state = run_in_memory(make_adam, table0, batches[:12], "cpu", initial_state=fresh)
    np.testing.assert_allclose(emb.table.to_numpy(), middle, **TOL)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), middle_state[name], err_msg=name, **TOL)
    emb.attach(new, restart=again)  # a retry that fits starts afresh
    train(new, batches[12:])
    expected, expected_state = run_in_memory(make_new, middle, batches[12:], "cpu", initial_state=fresh)
    np.testing.assert_allclose(emb.table.to_numpy(), expected, **TOL)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), expected_state[name], err_msg=name, **TOL)


# 9 ---------------------------------------------------------------------------
def test_a_failed_model_factory_does_not_block_the_corrected_retry():
    emb = torch.nn.Embedding(8, 4)
    with pytest.raises(ss.OptionError, match="path="):
        ss.ModelFactory(emb, 100, 4, storage="mmap", backend="numpy")
    switch = ss.ModelFactory(emb, 200, 4, backend="numpy")
    assert switch.table.num_rows == 200
    del switch
    gc.collect()
    assert ss.ModelFactory(emb, 300, 4, backend="numpy").table.num_rows == 300


# 10 --------------------------------------------------------------------------
def test_a_bad_id_with_padding_changes_nothing(rng):
    emb = make_embedding(rng, padding_idx=2)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    with pytest.raises(ss.IdError):
        emb(torch.tensor([1, 60]))
    assert emb._working_set.size == 0
    train_step(emb, opt, rng, 60)


# 12 --------------------------------------------------------------------------
def dead_pid():
    """The id of a process that has exited."""
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_later_saves_remove_only_the_temporaries_of_dead_saves(rng, tmp_path):
    table = make_table(rng)
    dead = dead_pid()
    host = atomic._HOST
    stale = tmp_path / f".t.npy.{host}.{dead}.0123abcd.tmp"
    live = tmp_path / f".t.npy.{host}.{os.getppid()}.0123abcd.tmp"
    foreign = [tmp_path / ".t.npy.x7f3k2.tmp", tmp_path / f".u.npy.{host}.{dead}.0123abcd.tmp"]
    for path in [stale, live, *foreign]:
        path.write_bytes(b"partial")
    table.save(tmp_path / "t.npy")
    assert not stale.exists()
    assert live.exists() and all(p.exists() for p in foreign)


@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_a_file_name_as_long_as_the_file_system_takes_is_saved_and_its_dead_temporaries_removed(
        rng, tmp_path, suffix):
    """The temporary added host, pid and a random part to the name: a valid name of 255 bytes (fewer
    with a long host name) made one too long, and the save was refused with 'File name too long'."""
    table = make_table(rng)
    path = tmp_path / ("\u00e9" * 100 + "e" * (55 - len(suffix)) + suffix)  # 255 bytes in UTF-8
    assert len(os.fsencode(path.name)) == 255
    stale = atomic.temp_path(path).replace(f".{os.getpid()}.", f".{dead_pid()}.")
    open(stale, "wb").close()
    table.save(path)
    assert os.listdir(tmp_path) == [path.name]  # the dead save's temporary is proved its and removed
    np.testing.assert_array_equal(ss.HostTable.load(path, backend="numpy").to_numpy(), table.to_numpy())
    if suffix == ".npy":
        mapped = ss.HostTable.empty(3, 2, storage="mmap", path=path, overwrite=True, backend="numpy")
        assert mapped.shape == (3, 2) and os.listdir(tmp_path) == [path.name]


# 13 --------------------------------------------------------------------------
def test_dropping_an_embedding_frees_its_tables_without_the_cycle_collector(rng):
    emb = adam_embedding(rng)
    opt = emb._state.optimizer
    table, state = weakref.ref(emb.table), weakref.ref(emb._state.tables["exp_avg"])
    gc.collect()
    gc.disable()
    try:
        del emb
        assert table() is None and state() is None
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    finally:
        gc.enable()


def test_dropping_an_optimizer_factory_frees_its_state_without_the_cycle_collector():
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(8, 4)})
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    switch = ss.OptimizerFactory(opt, 100, 4, model, "u", backend="numpy")
    state = weakref.ref(switch.state.tables["exp_avg"])
    gc.collect()
    gc.disable()
    try:
        del switch
        assert state() is None
    finally:
        gc.enable()


def test_close_releases_the_embedding_and_unhooks_the_optimizer(rng):
    with make_embedding(rng) as emb:
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        emb.attach(opt)
        train_step(emb, opt, rng, 60)
    assert emb.table.closed
    with pytest.raises(ss.StateError, match="closed"):
        emb(torch.tensor([1]))
    emb.close()  # idempotent
    opt.step()  # the optimizer no longer reaches the embedding


# 15 and the first hour ------------------------------------------------------
def test_a_scalar_id_takes_one_row(rng):
    table = make_table(rng)
    row = torch.from_numpy(rng.standard_normal(4, dtype=np.float32))
    table.scatter(np.int64(5), row)
    assert torch.equal(table.gather(5), row)


def test_numpy_integers_are_sizes_everywhere():
    emb = ss.OffloadedEmbedding(np.int64(50), np.int32(4), max_rows=np.int64(8), backend="numpy")
    assert (emb.num_embeddings, emb.max_rows) == (50, 8)


def test_saving_into_a_missing_directory_names_the_users_path(rng, tmp_path):
    with pytest.raises(PathError, match="nope") as info:
        make_table(rng).save(tmp_path / "nope" / "t.npy")
    assert ".tmp" not in str(info.value)


def test_saving_under_a_file_says_it_is_a_file_not_a_missing_directory(rng, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PathError, match="afile' is a file, not a directory"):
        make_table(rng).save(tmp_path / "afile" / "t.npy")
    assert (tmp_path / "afile").read_text() == "x"


def test_an_unknown_checkpoint_suffix_is_refused(rng, tmp_path):
    with pytest.raises(ss.OptionError, match="no suffix"):
        make_embedding(rng).save(tmp_path / "emb.pt")
    assert not (tmp_path / "emb.pt").exists()


def test_a_table_larger_than_ram_says_how_much_and_suggests_mmap():
    with pytest.raises(OutOfMemoryError, match="storage='mmap'") as info:
        ss.HostTable.empty(2**40, 1024, storage="pageable", backend="numpy")
    assert "GiB" in str(info.value) and isinstance(info.value, MemoryError)


def test_a_table_larger_than_the_gpu_says_so_and_suggests_host_memory(monkeypatch):
    """torch's OutOfMemoryError is a RuntimeError, not a MemoryError: it is translated too."""
    backend = ss.get_backend("numpy")

    def no_gpu_memory(shape, dtype, kind):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 TiB")
    monkeypatch.setattr(backend, "allocate", no_gpu_memory)
    # A GPU's: the numpy backend's device tables are in RAM, and are told so (test_bad_inputs).
    monkeypatch.setattr(backend, "device", torch.device("cuda", 0))
    with pytest.raises(OutOfMemoryError, match=r"4096\.00 GiB of GPU memory.*storage='pinned'") as info:
        ss.HostTable.empty(2**30, 1024, storage="device", backend=backend)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_saving_onto_a_read_only_file_system_names_the_users_path(rng, tmp_path, monkeypatch):
    table = make_table(rng)
    table.save(tmp_path / "t.npy")
    before = (tmp_path / "t.npy").read_bytes()

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)
    monkeypatch.setattr(atomic, "open", read_only, raising=False)
    with pytest.raises(PathError, match="read-only") as info:
        table.save(tmp_path / "t.npy")
    assert os.fspath(tmp_path / "t.npy") in str(info.value) and ".tmp" not in str(info.value)
    assert isinstance(info.value, OSError) and info.value.errno == errno.EROFS
    assert (tmp_path / "t.npy").read_bytes() == before


def test_a_directory_checkpoint_may_go_into_an_empty_directory_or_over_debris(rng, tmp_path):
    emb = make_embedding(rng)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".CURRENT.speedswap.lock").touch()  # the lock of a first save killed as it wrote CURRENT
    emb.save(tmp_path / "ckpt")  # made with os.makedirs beforehand: nothing to lose
    (tmp_path / "ckpt" / "v000009").mkdir()  # a version a killed save never pointed to
    (tmp_path / "ckpt" / f".v000010.{atomic._HOST}.{dead_pid()}.0123abcd.tmp").mkdir()
    emb.save(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["CURRENT", "v000010"]
    fresh = make_embedding(rng)
    fresh.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(fresh.table.to_numpy(), emb.table.to_numpy())


def test_a_file_too_large_to_stage_in_ram_is_verified_first_then_read_again(rng, tmp_path,
                                                                            monkeypatch):
    import speedswap.table as table_module
    monkeypatch.setattr(table_module, "available_ram", lambda: 0)  # nothing may be staged in RAM
    rows = 20_000
    table = make_table(rng, rows=rows)
    before = table.to_numpy(copy=True)
    good = rng.standard_normal((rows, 4), dtype=np.float32)
    write_compressed(tmp_path / "bad.h5", {"table": good})
    corrupt_chunk(tmp_path / "bad.h5", "table", 7)
    with pytest.raises(ss.FileFormatError):
        table.load_from(tmp_path / "bad.h5")
    np.testing.assert_array_equal(table.to_numpy(), before)
    write_compressed(tmp_path / "good.h5", {"table": good})
    table.load_from(tmp_path / "good.h5")
    np.testing.assert_array_equal(table.to_numpy(), good)


# Checkpoint saves and loads ---------------------------------------------------
def contents(emb):
    return {name: t.to_numpy(copy=True) for name, t in emb._tables().items()}


def assert_unchanged(emb, before):
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), before[name], err_msg=name)


def test_an_hdf5_checkpoint_never_replaces_a_file_that_is_not_one(rng, tmp_path):
    data = rng.standard_normal((100, 3))
    with h5py.File(tmp_path / "features.h5", "w") as f:
        f["features"] = data
    (tmp_path / "notes.h5").write_bytes(b"not HDF5 at all")
    emb = adam_embedding(rng)
    with pytest.raises(PathError, match="not a speedswap checkpoint.*'features'"):
        emb.save(tmp_path / "features.h5")
    with pytest.raises(PathError, match="not a readable HDF5 file"):
        emb.save(tmp_path / "notes.h5")
    with h5py.File(tmp_path / "features.h5") as f:
        assert list(f) == ["features"]
        np.testing.assert_array_equal(f["features"][()], data)
    assert (tmp_path / "notes.h5").read_bytes() == b"not HDF5 at all"
    emb.save(tmp_path / "emb.h5")
    emb.save(tmp_path / "emb.h5")  # a checkpoint is replaced, as ever
    assert sorted(os.listdir(tmp_path)) == ["emb.h5", "features.h5", "notes.h5"]


@pytest.mark.parametrize("suffix", ["", ".h5"])
def test_a_bfloat16_checkpoint_is_refused_by_a_float32_embedding_in_either_format(rng, suffix,
                                                                                  tmp_path):
    path = tmp_path / f"ckpt{suffix}"
    source = adam_embedding(rng, dtype=torch.bfloat16)
    source.save(path)
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match="bfloat16.*float32"):
        target.load(path)
    assert_unchanged(target, before)
    same = adam_embedding(rng, dtype=torch.bfloat16)
    same.load(path)  # into a bfloat16 embedding it loads
    for name, table in same._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), contents(source)[name], err_msg=name)


def _first_version(path):
    return path / (path / "CURRENT").read_text().strip()


MANIFEST_EDITS = {
    "attrs a list": lambda m: {**m, "attrs": []},
    "tables a string": lambda m: {**m, "tables": "table"},
    "crc32 a list": lambda m: {**m, "crc32": []},
    "crc32 of text": lambda m: {**m, "crc32": {name: "x" for name in m["crc32"]}},
    "dtypes of another dtype": lambda m: {**m, "dtypes": {"table": "float16"}},
    "not an object": lambda m: [m],
}


@pytest.mark.parametrize("edit", list(MANIFEST_EDITS))
def test_a_hand_edited_manifest_is_a_file_format_error(rng, edit, tmp_path):
    import json
    emb = adam_embedding(rng)
    emb.save(tmp_path / "ckpt")
    manifest = _first_version(tmp_path / "ckpt") / "checkpoint.json"
    manifest.write_text(json.dumps(MANIFEST_EDITS[edit](json.loads(manifest.read_text()))))
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match="not a valid checkpoint manifest"):
        target.load(tmp_path / "ckpt")
    assert_unchanged(target, before)


def test_a_current_pointer_that_is_not_text_is_a_file_format_error(rng, tmp_path):
    adam_embedding(rng).save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "CURRENT").write_bytes(b"\xff\xfe\n")
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match="not text"):
        target.load(tmp_path / "ckpt")
    assert_unchanged(target, before)


def test_an_hdf5_checkpoint_replaced_while_it_loads_loads_nothing(rng, tmp_path, monkeypatch):
    """Another process saves over the file between the tables' reads: never a mix of two saves."""
    from speedswap import files
    path = tmp_path / "ckpt.h5"
    writer = adam_embedding(rng)
    writer.save(path)
    train_step(writer, writer._state.optimizer, rng, 60)
    stage, staged = files.stage_table, []

    def stage_then_save(*args, **kwargs):
        staged.append(stage(*args, **kwargs))
        if len(staged) == 1:
            writer.save(path)
        return staged[-1]
    monkeypatch.setattr(files, "stage_table", stage_then_save)
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match="replaced while it was being loaded"):
        target.load(path)
    assert_unchanged(target, before)
    monkeypatch.undo()
    target.load(path)  # loading again reads the new checkpoint whole
    for name, table in target._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), contents(writer)[name], err_msg=name)


@pytest.mark.parametrize("suffix", ["", ".h5"])
def test_a_checkpoint_without_optimizer_state_says_to_load_it_before_attach(rng, suffix,
                                                                           tmp_path):
    path = tmp_path / f"ckpt{suffix}"
    make_embedding(rng).save(path)
    target = adam_embedding(rng)
    with pytest.raises(ss.FileFormatError, match="before attach"):
        target.load(path)
    fresh = make_embedding(rng)
    fresh.load(path)  # the advice works
    fresh.attach(torch.optim.Adam(fresh.parameters(), lr=0.01))


def test_a_sharded_checkpoint_loaded_into_a_plain_embedding_names_load_sharded(rng, tmp_path):
    # It was called "not a speedswap checkpoint directory", and the way to read it went unsaid.
    ss.ShardedOffloadedEmbedding(60, DIM, max_rows=CAPACITY, storage="pageable",
                                 backend="numpy").save(tmp_path / "sharded")
    emb = adam_embedding(rng)
    before = contents(emb)
    with pytest.raises(ss.FileFormatError, match=r"ShardedOffloadedEmbedding.*ss\.load_sharded"):
        emb.load(tmp_path / "sharded")
    assert_unchanged(emb, before)


def test_a_table_file_loaded_as_a_checkpoint_names_load_from(rng, tmp_path):
    table = make_table(rng, rows=60, dim=DIM)
    table.save(tmp_path / "vectors.h5")
    target = make_embedding(rng)
    with pytest.raises(ss.FileFormatError, match="load_from"):
        target.load(tmp_path / "vectors.h5")
    target.table.load_from(tmp_path / "vectors.h5")  # the advice works
    np.testing.assert_array_equal(target.table.to_numpy(), table.to_numpy())


# A checkpoint too large to stage in RAM: verified, then read again into the tables ----------
def _nothing_staged_in_ram(monkeypatch):
    import speedswap.train.checkpoint as checkpoint_module
    monkeypatch.setattr(checkpoint_module, "available_ram", lambda: 0)


def _rewrite_in_place(path):
    """Change the last bytes of ``path`` where they are: same file, same size (another writer)."""
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        tail = f.read()
        f.seek(-8, os.SEEK_END)
        f.write(bytes(b ^ 0x55 for b in tail))


def _rows_behind_the_refusal(table):
    """The rows of a table a stopped load left refusing use (which is checked), as they are."""
    with pytest.raises(ss.StateError, match=r"stopped \(FileFormatError\).*load a checkpoint again"):
        table.to_numpy()
    return table._open_buffer().host


@pytest.mark.parametrize("changed", ["table", "optimizer.exp_avg_sq"])
def test_a_checkpoint_too_large_to_stage_changed_after_it_was_verified_loads_nothing(
        rng, tmp_path, monkeypatch, changed):
    # The second read took whatever the file held by then: no CRC-32, the rows written in place.
    from speedswap import files
    _nothing_staged_in_ram(monkeypatch)
    path = tmp_path / "ckpt"
    source = adam_embedding(rng)
    source.save(path)
    version = _first_version(path)
    stage, staged = files.stage_table, []

    def stage_then_change(*args, **kwargs):
        staged.append(stage(*args, **kwargs))
        if len(staged) == len(source._tables()):  # every table verified, none written yet
            _rewrite_in_place(version / f"{changed}.npy")
        return staged[-1]
    monkeypatch.setattr(files, "stage_table", stage_then_change)
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match="changed or replaced since it was verified.*nothing "
                                                 "was loaded"):
        target.load(path)
    assert_unchanged(target, before)
    monkeypatch.setattr(files, "stage_table", stage)
    source.save(path)
    target.load(path)  # an intact checkpoint still loads through the second read
    for name, table in target._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), contents(source)[name], err_msg=name)


def _commits_stop_at_the_second(monkeypatch, stop):
    """Make a load's second table write raise ``stop``: the first table holds the checkpoint's rows,
    the others their own. Returns the real ``StagedRows.commit``, to put back."""
    from speedswap.files import tables as tables_module
    commit, commits = tables_module.StagedRows.commit, []

    def stopped_at_the_second(staged, table, **kwargs):
        commits.append(table)
        if len(commits) == 2:
            raise stop()
        return commit(staged, table, **kwargs)
    monkeypatch.setattr(tables_module.StagedRows, "commit", stopped_at_the_second)
    return commit


@pytest.mark.parametrize("staged_in_ram, cache_rows", [(True, 0), (False, 0), (True, 20)],
                         ids=["staged", "read-again", "cached"])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, MemoryError])
def test_a_load_stopped_while_it_writes_the_tables_leaves_them_refusing_use_until_a_load(
        rng, tmp_path, monkeypatch, staged_in_ram, cache_rows, stop):
    """Ctrl-C in the middle of a load's writes left the tables before it loaded and the rest not,
    without a word: training on mixed two states. Every table of the load now refuses use (the
    training forward included) until a load completes."""
    from speedswap.files import tables as tables_module
    if not staged_in_ram:
        _nothing_staged_in_ram(monkeypatch)
    path = tmp_path / "ckpt"
    source = adam_embedding(rng)
    source.save(path)
    saved = contents(source)
    target = adam_embedding(rng, cache_rows=cache_rows)
    commit = _commits_stop_at_the_second(monkeypatch, stop)
    with pytest.raises(stop) as info:
        target.load(path)
    if sys.version_info >= (3, 11):
        assert "load a checkpoint again" in " ".join(info.value.__notes__)
    monkeypatch.setattr(tables_module.StagedRows, "commit", commit)
    ids = torch.from_numpy(rng.integers(0, 60, size=(BATCH,)))
    for use in (lambda: target(ids), lambda: target.save(tmp_path / "other"),
                lambda: target.table.to_numpy(), lambda: target._state.tables["exp_avg"].gather([0])):
        with pytest.raises(ss.StateError, match=f"stopped.*{stop.__name__}.*load a checkpoint again"):
            use()
    assert not (tmp_path / "other").exists()
    target.load(path)
    for name, table in target._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)
    train_step(target, target._state.optimizer, rng, 60)  # and it trains again


def test_a_table_load_from_stopped_while_it_writes_refuses_use_until_a_load(rng, tmp_path, monkeypatch):
    from speedswap.files import base as files_base, tables as tables_module
    import speedswap.table as table_module
    monkeypatch.setattr(table_module, "available_ram", lambda: 0)
    monkeypatch.setattr(files_base, "CHUNK_BYTES", 64 << 10)  # the 320 kB file in 5 chunks
    table = make_table(rng, rows=20_000)
    good = rng.standard_normal((20_000, 4), dtype=np.float32)
    write_compressed(tmp_path / "t.h5", {"table": good})
    read, reads = tables_module._file_chunks, []

    def interrupted_after_a_chunk(*args):
        reads.append(1)
        chunks = read(*args)
        if len(reads) == 2:  # read again to be written: some rows written, the rest not
            yield next(chunks)
            raise KeyboardInterrupt
        yield from chunks
    monkeypatch.setattr(tables_module, "_file_chunks", interrupted_after_a_chunk)
    with pytest.raises(KeyboardInterrupt):
        table.load_from(tmp_path / "t.h5")
    with pytest.raises(ss.StateError, match="stopped.*KeyboardInterrupt"):
        table.gather([0, 19_999])
    monkeypatch.setattr(tables_module, "_file_chunks", read)
    with pytest.raises(MissingFileError):  # a refused load leaves it refusing
        table.load_from(tmp_path / "missing.h5")
    with pytest.raises(ss.StateError, match="stopped.*KeyboardInterrupt"):
        table.to_numpy()
    table.load_from(tmp_path / "t.h5")
    np.testing.assert_array_equal(table.to_numpy(), good)
    table.close()


def test_an_hdf5_checkpoint_too_large_to_stage_replaced_after_its_check_loads_nothing(
        rng, tmp_path, monkeypatch):
    # The identity check passed, then the second read opened the path again: the newer save.
    import speedswap.train.checkpoint as checkpoint_module
    _nothing_staged_in_ram(monkeypatch)
    path = tmp_path / "ckpt.h5"
    writer = adam_embedding(rng)
    writer.save(path)
    train_step(writer, writer._state.optimizer, rng, 60)
    check = checkpoint_module._check_same_file

    def check_then_save(*args):
        check(*args)
        writer.save(path)
    monkeypatch.setattr(checkpoint_module, "_check_same_file", check_then_save)
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match="changed or replaced since it was verified"):
        target.load(path)
    assert_unchanged(target, before)


def test_a_chunk_that_differs_when_read_again_is_never_written(rng, tmp_path, monkeypatch):
    """A writer changing the file *during* the second read: found at the chunk, which is not written.

    The chunks before it are (there is no second copy to write from): the
    error says which rows were replaced.
    """
    from speedswap import files
    from speedswap.files import tables as tables_module
    _nothing_staged_in_ram(monkeypatch)
    monkeypatch.setattr(files.base, "CHUNK_BYTES", 16 * DIM * 4)  # 16 rows a chunk: 4 chunks
    path = tmp_path / "ckpt"
    source = adam_embedding(rng)
    source.save(path)
    read, reads = tables_module._file_chunks, []

    def altered_on_the_second_read(file, *args):
        reads.append(os.fspath(file))
        for n, (start, stop, chunk) in enumerate(read(file, *args)):
            if reads.count(os.fspath(file)) == 2 and n == 1:
                chunk = chunk + np.float32(1.0)
            yield start, stop, chunk
    monkeypatch.setattr(tables_module, "_file_chunks", altered_on_the_second_read)
    target = adam_embedding(rng)
    before = contents(target)
    with pytest.raises(ss.FileFormatError, match=r"other bytes in rows 16\.\.31 .*rows for file rows "
                                                 r"0\.\.15 were replaced, the rest were not"):
        target.load(path)
    first = next(iter(target._tables()))  # the table committed first
    for name, table in target._tables().items():
        expected = before[name].copy()
        if name == first:
            expected[:16] = contents(source)[name][:16]
        np.testing.assert_array_equal(_rows_behind_the_refusal(table), expected, err_msg=name)


@pytest.mark.parametrize("chunk", [0, 1], ids=["first-chunk", "second-chunk"])
def test_a_read_again_failing_in_a_later_table_names_the_tables_already_loaded(rng, tmp_path, monkeypatch,
                                                                               chunk):
    """The tables committed before the failing one were replaced whole: the error must say so.

    It said "nothing was loaded" (a failure at the table's first chunk), or
    only which rows of the failing table were replaced, while the embedding
    already held the checkpoint's rows beside its own optimizer state.
    """
    from speedswap import files
    from speedswap.files import tables as tables_module
    _nothing_staged_in_ram(monkeypatch)
    monkeypatch.setattr(files.base, "CHUNK_BYTES", 16 * DIM * 4)  # 16 rows a chunk: 4 chunks
    path = tmp_path / "ckpt"
    source = adam_embedding(rng)
    source.save(path)
    saved = contents(source)
    last = list(saved)[-1]  # the table committed last
    read, reads = tables_module._file_chunks, []

    def altered_on_the_second_read(file, *args):
        reads.append(os.fspath(file))
        for n, (start, stop, chunk_rows) in enumerate(read(file, *args)):
            if os.fspath(file).endswith(f"{last}.npy") and reads.count(os.fspath(file)) == 2 and n == chunk:
                chunk_rows = chunk_rows + np.float32(1.0)
            yield start, stop, chunk_rows
    monkeypatch.setattr(tables_module, "_file_chunks", altered_on_the_second_read)
    target = adam_embedding(rng)
    before = contents(target)
    earlier = [name for name in saved if name != last]
    with pytest.raises(ss.FileFormatError) as info:
        target.load(path)
    message = str(info.value)
    assert re.search(r"nothing was loaded(?! from it)", message) is None, message
    assert all(repr(name) in message for name in earlier), message
    for name, table in target._tables().items():
        expected = saved[name] if name in earlier else before[name].copy()
        if name == last:
            expected[:16 * chunk] = saved[name][:16 * chunk]
        np.testing.assert_array_equal(_rows_behind_the_refusal(table), expected, err_msg=name)


def test_saves_and_loads_of_one_directory_checkpoint_from_two_threads_take_turns(tmp_path, rng):
    """Two threads saving one directory checkpoint each removed the version the other was about to
    point CURRENT at, and a load meanwhile found its version gone: they now take turns, and every
    load reads one save's tables whole."""
    import threading
    values = [rng.standard_normal((300, DIM), dtype=np.float32) for _ in range(2)]
    writers = []
    for value in values:
        emb = ss.OffloadedEmbedding(300, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
        emb.table.apply_(lambda t, v=value: t.copy_(torch.from_numpy(v)))
        writers.append(emb)
    path = tmp_path / "ckpt"
    writers[0].save(path)
    failures, seen = [], set()

    def work(emb):
        reader = ss.OffloadedEmbedding(300, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy")
        try:
            for _ in range(40):
                emb.save(path)
                reader.load(path)
                got = reader.table.to_numpy()
                match = [k for k, value in enumerate(values) if np.array_equal(got, value)]
                if len(match) != 1:
                    failures.append("a load read neither save whole")
                seen.update(match)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))
        finally:
            reader.close()

    threads = [threading.Thread(target=work, args=(emb,)) for emb in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert seen  # the loads read whole saves (which ones depends on the interleaving)
    entries = sorted(os.listdir(path))  # the pointer and the one version it names
    assert len(entries) == 2 and entries[0] == "CURRENT" and entries[1].startswith("v")


def test_a_state_dict_of_another_max_rows_loads_its_tables_and_trains_on(rng):
    """The working set is scratch between steps: a state dict saved with another max_rows raised
    torch's size mismatch after the tables had already been replaced."""
    def make(max_rows):
        emb = ss.OffloadedEmbedding(60, DIM, max_rows=max_rows, storage="pageable", backend="numpy")
        opt = torch.optim.Adam(emb.parameters(), lr=0.05)
        emb.attach(opt)
        return emb, opt

    source, source_opt = make(32)
    source.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((60, DIM), dtype=np.float32))))
    batches = [torch.from_numpy(rng.integers(0, 60, 12)) for _ in range(6)]  # <= 12 rows a step

    def step(emb, opt, ids):
        emb(ids).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    for ids in batches[:3]:
        step(source, source_opt, ids)
    # Copies, as torch.save and torch.load make them: a loaded optimizer state shares its
    # tensors (Adam's step) with the state dict it came from.
    saved, saved_opt = copy.deepcopy(source.state_dict()), copy.deepcopy(source_opt.state_dict())
    for strict in (True, False):
        target, target_opt = make(16)
        result = target.load_state_dict(copy.deepcopy(saved), strict=strict)
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
        target_opt.load_state_dict(copy.deepcopy(saved_opt))
        np.testing.assert_array_equal(target.table.to_numpy(), source.table.to_numpy())
        ahead, ahead_opt = make(32)  # the max_rows the state was saved with
        ahead.load_state_dict(copy.deepcopy(saved))
        ahead_opt.load_state_dict(copy.deepcopy(saved_opt))
        for ids in batches[3:]:
            step(target, target_opt, ids)
            step(ahead, ahead_opt, ids)
        np.testing.assert_array_equal(target.table.to_numpy(), ahead.table.to_numpy())


def _saved_h5(tmp_path, rng, name="ckpt.h5"):
    emb = make_embedding(rng)
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    train_step(emb, opt, rng, 60)
    path = tmp_path / name
    emb.save(path)
    return emb, path


def test_a_bit_flipped_in_an_h5_checkpoints_rows_is_refused_everywhere_it_is_read(tmp_path, rng):
    """HDF5 checkpoints record each table's CRC-32 (the directory format always did): a flipped bit
    in the rows loaded silently before."""
    emb, path = _saved_h5(tmp_path, rng)
    rows = emb.table.to_numpy(copy=True)
    data = bytearray(path.read_bytes())
    at = bytes(data).find(rows.tobytes())
    assert at > 0  # the rows are stored contiguously
    data[at + len(rows.tobytes()) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    target = make_embedding(rng)
    target.attach(torch.optim.Adam(target.parameters(), lr=0.1))
    before = target.table.to_numpy(copy=True)
    for load in (lambda: target.load(path), lambda: target.table.load_from(path, "table"),
                 lambda: ss.HostTable.load(path, dataset="table", backend="numpy")):
        with pytest.raises(ss.FileFormatError, match="CRC-32"):
            load()
        np.testing.assert_array_equal(target.table.to_numpy(), before)


def test_a_damaged_h5_checkpoint_raises_file_format_errors_and_is_not_replaced(tmp_path, rng):
    """h5py's own KeyError/OSError/RuntimeError escaped from a damaged file that still opened."""
    emb, path = _saved_h5(tmp_path, rng)
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    path.write_bytes(bytes(data))
    before = emb.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError):
        emb.load(path)
    np.testing.assert_array_equal(emb.table.to_numpy(), before)
    with pytest.raises(PathError, match="not a readable HDF5 file"):
        emb.save(path)  # someone's damaged file is never replaced: delete it first


def _as_an_older_speedswap_wrote_it(path):
    """Rewrite the HDF5 file ``path`` as speedswap wrote it before it sealed its files: no user block."""
    sealed = path.with_name("sealed-" + path.name)
    os.replace(path, sealed)
    with h5py.File(sealed, "r") as source, h5py.File(path, "w") as copy_:
        for name in source:
            source.copy(source[name], copy_, name=name)
        copy_.attrs.update(source.attrs)
    sealed.unlink()


def test_an_h5_checkpoint_with_a_table_name_that_is_not_text_is_a_file_format_error(tmp_path, rng):
    """h5py lists a name that is not UTF-8 (one flipped bit in it) as bytes, beside the others' str:
    sorting the names for the message raised a raw TypeError. (A file speedswap sealed is refused before
    h5py reads a name: the edit changed its metadata.)"""
    emb, path = _saved_h5(tmp_path, rng)
    older = tmp_path / "older.h5"
    older.write_bytes(path.read_bytes())
    _as_an_older_speedswap_wrote_it(older)
    before = {name: t.to_numpy(copy=True) for name, t in emb._tables().items()}
    for edited, message in ((older, "holds tables"), (path, "is damaged")):
        with h5py.File(edited, "r+") as f:
            f.move("optimizer.exp_avg", b"optimizer.exp_av\xe7")
        with pytest.raises(ss.FileFormatError, match=message):
            emb.load(edited)
    for name, t in emb._tables().items():
        np.testing.assert_array_equal(t.to_numpy(), before[name])


@pytest.mark.parametrize("content", [b"", b"not a torch file at all" * 10])
def test_model_factory_load_torch_of_a_file_torch_cannot_read_is_a_file_format_error(tmp_path, content):
    path = tmp_path / "weights.pt"
    path.write_bytes(content)
    switcher = ss.ModelFactory(torch.nn.Embedding(10, 4, sparse=True), 50, 4, storage="pageable",
                               backend="numpy")
    with pytest.raises(ss.FileFormatError, match="not a readable torch file"):
        switcher.loadTorch(path)


def test_model_factory_load_torch_of_a_sparse_tensor_is_a_file_format_error(tmp_path, rng):
    # Shaped and typed as the table, it passed the check, and copy_ raised a raw RuntimeError.
    path = tmp_path / "weights.pt"
    torch.save(torch.from_numpy(rng.standard_normal((50, 4), dtype=np.float32)).to_sparse(), path)
    switcher = ss.ModelFactory(torch.nn.Embedding(10, 4), 50, 4, storage="pageable", backend="numpy")
    switcher.uniformDistributionInit(-1, 1)
    before = switcher.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="sparse"):
        switcher.loadTorch(path)
    np.testing.assert_array_equal(switcher.to_numpy(), before)


@pytest.mark.skipif(atomic.fcntl is None, reason="no flock here")
def test_saves_still_take_turns_where_flock_is_refused(tmp_path, rng, monkeypatch):
    """A file system without flock (ENOLCK) must not fail the save: threads of the process take turns."""
    def refused(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(atomic.fcntl, "flock", refused)
    emb = make_embedding(rng)
    emb.save(tmp_path / "ckpt")
    emb.save(tmp_path / "ckpt")
    target = make_embedding(rng)
    target.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(target.table.to_numpy(), emb.table.to_numpy())


def _a_thread_holding_both_turns(path, checkpoint):
    """Start a thread holding a save's turn at ``path`` and the lock of ``checkpoint``, and wait until it does.

    Returns:
        (thread, let_go): set ``let_go`` for the thread to let both go, then join it.
    """
    import threading
    holding, let_go = threading.Event(), threading.Event()

    def hold():
        with atomic.one_save_at_a_time(path), atomic.locked(checkpoint):
            holding.set()
            let_go.wait(60)
    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(60)
    return holder, let_go


@pytest.mark.skipif(not hasattr(os, "fork") or atomic.fcntl is None, reason="no fork or no flock here")
def test_a_forked_child_saves_where_a_thread_of_its_parent_held_the_turn(tmp_path, rng, monkeypatch):
    """Where flock is refused (ENOLCK), saves take turns on a threading.Lock. A child forked while
    another thread of the parent held one has no such thread: its lock stayed held, and the child's
    save to that path (or of that checkpoint) waited forever. A child starts with every turn free."""
    import warnings

    def refused(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(atomic.fcntl, "flock", refused)
    path, checkpoint = tmp_path / "t.npy", tmp_path / "ckpt"
    checkpoint.mkdir()
    rows = rng.standard_normal((7, 3)).astype(np.float32)
    holder, done = _a_thread_holding_both_turns(path, checkpoint)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
            pid = os.fork()
        if pid == 0:  # the child: killed by SIGALRM should it wait for the parent's thread
            try:
                import signal
                signal.alarm(10)
                with atomic.atomic_output(path) as tmp, open(tmp, "wb") as f:
                    np.save(f, rows)
                with atomic.locked(checkpoint):
                    pass
                os._exit(0)
            except BaseException:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        holder.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child ended with status {status:#x}"
    np.testing.assert_array_equal(np.load(path), rows)


@pytest.mark.skipif(not hasattr(os, "fork") or atomic.fcntl is None, reason="no fork or no flock here")
def test_a_forked_child_does_not_keep_the_flocks_of_its_parents_threads(tmp_path, rng):
    """A flock belongs to the open file, which a forked child shares through the descriptors it
    inherits. A child forked while another thread of the parent held a save's or a checkpoint's
    flock kept it after that thread let go: the child's own save of the path waited forever (on a
    lock its own copy held), and so did every later save of the checkpoint by the parent while the
    child lived (a DataLoader worker lives for an epoch). A child closes those copies."""
    import select
    import signal
    import threading
    import warnings

    path, checkpoint = tmp_path / "t.npy", tmp_path / "ckpt"
    checkpoint.mkdir()
    rows = rng.standard_normal((7, 3)).astype(np.float32)
    holder, done = _a_thread_holding_both_turns(path, checkpoint)
    saved_r, saved_w = os.pipe()
    leave_r, leave_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
        pid = os.fork()
    if pid == 0:  # the child: killed by SIGALRM should it wait for good
        try:
            signal.alarm(15)
            with atomic.atomic_output(path) as tmp, open(tmp, "wb") as f:  # waits for the parent's turn
                np.save(f, rows)
            with atomic.locked(checkpoint):
                pass
            os.write(saved_w, b"s")
            os.read(leave_r, 1)  # lives on, as a worker would, while the parent saves again
            os._exit(0)
        except BaseException:
            os._exit(3)
    try:
        done.set()  # the parent's thread lets go: the child's save may go on
        holder.join()
        again = threading.Thread(target=_save_turns, args=(path, checkpoint), daemon=True)
        again.start()
        again.join(10)
        parent_saved = not again.is_alive()
        child_saved = bool(select.select([saved_r], [], [], 10)[0])
    finally:
        os.write(leave_w, b"x")
        _, status = os.waitpid(pid, 0)
        for fd in (saved_r, saved_w, leave_r, leave_w):
            os.close(fd)
    assert parent_saved, "the parent's next save of the checkpoint waited for the child"
    assert child_saved and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    np.testing.assert_array_equal(np.load(path), rows)
    again.join()


def _save_turns(path, checkpoint):
    """Take a save's turn at ``path`` and the checkpoint ``checkpoint``'s, one after the other."""
    with atomic.one_save_at_a_time(path):
        pass
    with atomic.locked(checkpoint):
        pass


def test_npy_headers_are_parsed_one_thread_at_a_time(tmp_path, monkeypatch, rng):
    """numpy parses a header with ast.literal_eval, which CPython 3.11 cannot run in two threads at
    once: threaded saves and loads of one checkpoint failed, rarely, with "SystemError: AST
    constructor recursion depth mismatch". speedswap's header reads now take turns."""
    from speedswap.files import npy
    path = tmp_path / "t.npy"
    np.save(path, rng.standard_normal((5, 3)).astype(np.float32))
    held = []
    for name in ("read_array_header_1_0", "read_array_header_2_0"):
        parse = getattr(np.lib.format, name)
        monkeypatch.setattr(np.lib.format, name,
                            lambda f, *a, parse=parse, **k: held.append(npy.HEADER_PARSE.locked()) or parse(f, *a, **k))
    assert npy.read_npy_header(path).shape == (5, 3)
    assert held == [True]


@pytest.mark.parametrize("key", ["format", "optimizer"])
def test_an_unsealed_h5_checkpoint_whose_attribute_became_an_array_is_a_file_format_error(tmp_path, rng, key):
    """A flipped bit in an attribute's dataspace (found by the bit-flip test on a file without a seal)
    turns the value into an array, and comparing it with the expected one raised numpy's raw
    "ValueError: The truth value of an array ... is ambiguous"."""
    emb, path = _saved_h5(tmp_path, rng)
    _as_an_older_speedswap_wrote_it(path)
    with h5py.File(path, "r+") as f:
        f.attrs[key] = np.array([f.attrs[key]] * 2, dtype=h5py.string_dtype())
    before = contents(emb)
    with pytest.raises(ss.FileFormatError, match=f"attributes \\['{key}'\\] hold arrays"):
        emb.load(path)
    assert_unchanged(emb, before)


def _bit_flips(path, rng):
    """``(byte, bit, raw)`` flips of the HDF5 file ``path``: a bit of every byte outside its datasets' raw
    data (the HDF5 metadata and speedswap's seal), every bit of its first 64 bytes (the seal's header),
    and a bit of 8 bytes of each dataset's raw data (``raw`` True)."""
    with h5py.File(path, "r") as f:
        spans = []
        f.visititems(lambda name, item: spans.append((item.id.get_offset(), item.id.get_storage_size()))
                     if isinstance(item, h5py.Dataset) else None)
    in_raw = np.zeros(os.path.getsize(path), dtype=bool)
    for offset, size in spans:
        in_raw[offset:offset + size] = True
    metadata = np.flatnonzero(~in_raw[64:]) + 64
    flips = [(int(byte), int(bit), False) for byte, bit in zip(metadata, rng.integers(0, 8, len(metadata)))]
    flips += [(byte, bit, False) for byte in range(64) for bit in range(8) if not in_raw[byte]]
    for offset, size in spans:
        flips += [(int(byte), int(rng.integers(0, 8)), True) for byte in rng.integers(offset, offset + size, 8)]
    return flips


def _flipped_load(path, intact, load, expected, flip):
    """What ``load()`` makes of ``intact`` with ``flip`` applied, as written at ``path``: ``"damaged"``
    (the seal refused it), ``"crc"`` (a dataset's CRC-32 did), ``"refused"`` (another FileFormatError),
    ``"read"`` (exactly ``expected``), or what went wrong."""
    byte, bit, _ = flip
    damaged = bytearray(intact)
    damaged[byte] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    try:
        got = load()
    except ss.FileFormatError as exc:
        return "damaged" if "is damaged" in str(exc) else "crc" if "CRC-32" in str(exc) else "refused"
    except Exception as exc:  # noqa: BLE001 -- the outcome the test reports
        return f"raw {type(exc).__name__}: {exc}".replace("\n", " ")
    same = got.keys() == expected.keys() and all(got[k].tobytes() == expected[k].tobytes() for k in got)
    return "read" if same else "wrong data"


def _check_bit_flips(saved, path, rng, load, expected):
    """Flip the bits :func:`_bit_flips` picks in the file ``saved`` one at a time, each load in a forked
    child: every flip in the rows must be refused by their CRC-32, every other one by the seal, which
    covers every byte but the rows and the superblock's consistency flags (HDF5's free space too). HDF5
    itself checks those flags, which a writer sets in place: a flip there is refused or reads the rows."""
    intact = saved.read_bytes()
    flags = intact.find(b"\x89HDF\r\n\x1a\n") + 20
    flips = _bit_flips(saved, rng)
    outcomes = outcomes_in_children(flips, lambda flip: _flipped_load(path, intact, load, expected, flip))
    bad = [(flip, outcome) for flip, outcome in zip(flips, outcomes)
           if outcome not in (("refused", "read") if flags <= flip[0] < flags + 4
                              else ("crc",) if flip[2] else ("damaged",))]
    counts = collections.Counter(outcome.split(":")[0] for _, outcome in bad)
    assert not bad, (f"{len(bad)} of {len(flips)} single-bit flips were not refused as they should be "
                     f"({dict(counts)}); (byte, bit, in the rows): {bad[:20]}")


def test_no_bit_flipped_in_an_h5_table_file_hangs_crashes_or_loads_wrong_rows(tmp_path, rng):
    """A flipped bit in the HDF5 metadata reached the HDF5 C library unchecked, where it could spin
    forever (deaf to Ctrl-C) or crash the process, or load wrong rows. Each flip is read in a forked
    child: every one must be refused with a FileFormatError."""
    table = make_table(rng, rows=50, dim=8)
    expected = {"table": table.to_numpy(copy=True)}
    table.save(tmp_path / "saved.h5")
    path = tmp_path / "damaged.h5"
    _check_bit_flips(tmp_path / "saved.h5", path, rng,
                     lambda: {"table": ss.HostTable.load(path, backend="numpy").to_numpy()}, expected)


def test_no_bit_flipped_in_an_h5_checkpoint_hangs_crashes_or_loads_wrong_state(tmp_path, rng):
    """As for a table file, for a checkpoint of a table and its Adam state; a refused load changes nothing."""
    emb, saved = _saved_h5(tmp_path, rng, name="saved.h5")
    target = adam_embedding(rng)
    path = tmp_path / "damaged.h5"

    def load():
        before = contents(target)
        try:
            target.load(path)
        except ss.FileFormatError:
            assert_unchanged(target, before)
            raise
        return contents(target)
    _check_bit_flips(saved, path, rng, load, contents(emb))


def test_h5_files_an_older_speedswap_wrote_without_a_seal_still_load(tmp_path, rng):
    emb, path = _saved_h5(tmp_path, rng)
    table = make_table(rng, rows=40, dim=8)
    table.save(tmp_path / "table.h5")
    for older in (path, tmp_path / "table.h5"):
        _as_an_older_speedswap_wrote_it(older)
        with h5py.File(older, "r") as f:
            assert f.userblock_size == 0
    target = adam_embedding(rng)
    target.load(path)
    for name, rows in contents(emb).items():
        np.testing.assert_array_equal(target._tables()[name].to_numpy(), rows, err_msg=name)
    np.testing.assert_array_equal(ss.HostTable.load(tmp_path / "table.h5", backend="numpy").to_numpy(),
                                  table.to_numpy())


def test_h5py_reads_a_sealed_file_as_speedswap_saved_it(tmp_path, rng):
    """The seal lives in an HDF5 user block, which every HDF5 tool skips."""
    emb, path = _saved_h5(tmp_path, rng)
    with h5py.File(path, "r") as f:
        assert f.userblock_size >= 512
        assert f.attrs["format"] == "speedswap-checkpoint-1"
        assert sorted(f) == sorted(emb._tables())
        for name, rows in contents(emb).items():
            np.testing.assert_array_equal(f[name][()], rows, err_msg=name)
            assert int(f[name].attrs["speedswap_crc32"]) == zlib.crc32(rows.tobytes())


@pytest.mark.parametrize("bits", [2, 5, 8])
def test_a_seal_whose_magic_lost_a_few_bits_is_refused_never_read_unchecked(tmp_path, rng, bits):
    """HDF5 finds the superblock after a user block whatever it holds: a seal whose magic string was
    damaged would have let the file through unchecked."""
    emb, path = _saved_h5(tmp_path, rng)
    damaged = bytearray(path.read_bytes())
    for at in rng.choice(16 * 8, size=bits, replace=False):
        damaged[at // 8] ^= 1 << (at % 8)
    path.write_bytes(bytes(damaged))
    with pytest.raises(ss.FileFormatError, match="is damaged: its seal's magic string"):
        emb.load(path)


def replace_once_its_seal_is_checked(monkeypatch, path, other):
    """Rename ``other`` over ``path`` right after the first check of a seal (a writer racing a read).

    Returns:
        a list that holds ``path`` once it was replaced.
    """
    from speedswap.files import h5
    check_seal, replaced = h5.check_seal, []

    def check_then_replace(*args):
        check_seal(*args)
        if not replaced:
            os.replace(other, path)
            replaced.append(path)
    monkeypatch.setattr(h5, "check_seal", check_then_replace)
    return replaced


@pytest.mark.parametrize("driver", ["stdio", "core"])
def test_h5_files_load_whatever_default_driver_the_environment_gives_hdf5(tmp_path, rng, driver):
    """HDF5_DRIVER changes HDF5's default file driver for the process. open_h5 compares the file it
    verified with the descriptor HDF5 opened, which only the default sec2 driver has: under another
    driver every .h5 load failed as 'not a readable HDF5 file ([Errno 9] Bad file descriptor)'."""
    rows = rng.standard_normal((5, 3)).astype(np.float32)
    path = tmp_path / "t.h5"
    ss.HostTable.from_numpy(rows, backend="numpy").save(path)
    done = subprocess.run([sys.executable, "-c", "import sys, numpy as np, speedswap as ss\n"
                           "np.save(sys.argv[2], ss.HostTable.load(sys.argv[1], backend='numpy').to_numpy())",
                           str(path), str(tmp_path / "loaded.npy")],
                          env={**os.environ, "HDF5_DRIVER": driver}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "loaded.npy"), rows)


def test_an_h5_file_replaced_between_its_seal_check_and_hdf5s_open_is_refused(tmp_path, rng, monkeypatch):
    """open_h5 checked the seal of the file the path named, then h5py opened the path again: a file
    renamed over it in between reached HDF5 unchecked (here a sound one, whose rows then loaded)."""
    path, other = tmp_path / "t.h5", tmp_path / "other.h5"
    make_table(rng).save(path)
    make_table(rng).save(other)
    replaced = replace_once_its_seal_is_checked(monkeypatch, path, other)
    table = make_table(rng)
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="was changed or replaced since it was verified"):
        table.load_from(path)
    assert replaced
    np.testing.assert_array_equal(table.to_numpy(), before)
    table.load_from(path)  # the writer is done: a load again reads the file now there
    np.testing.assert_array_equal(table.to_numpy(), ss.HostTable.load(path, backend="numpy").to_numpy())


@pytest.mark.parametrize("saved", ["table", "checkpoint"])
def test_a_save_whose_h5_file_is_replaced_while_it_checks_it_is_refused(tmp_path, rng, monkeypatch, saved):
    """A save to an existing .h5 file first reads what it would replace (a table's other datasets, a file
    that is no checkpoint). A file replaced between open_h5's seal check and HDF5's open (another save to
    the same path, racing this one) raised open_h5's "changed" FileFormatError, which these checks took
    for "not HDF5": a table save then went on and deleted the other save's dataset 'w'; a checkpoint save
    refused the file as "not a readable HDF5 file". Both now refuse, saying the file changed under them."""
    path, other = tmp_path / "t.h5", tmp_path / "other.h5"

    def save(to=path, dataset="u"):
        if saved == "table":
            make_table(rng).save(to, dataset=dataset)
        else:
            adam_embedding(rng).save(to)
    save()
    save(other, dataset="w")
    replacement = other.read_bytes()
    replaced = replace_once_its_seal_is_checked(monkeypatch, path, other)
    with pytest.raises(PathError, match="changed or was replaced while this save checked it.*nothing was "
                                        "written"):
        save()
    assert replaced and path.read_bytes() == replacement
    monkeypatch.undo()
    if saved == "table":  # the other writer is done: a save again sees its dataset
        with pytest.raises(PathError, match=r"holds the datasets \['w'\] besides 'u'"):
            save()
    else:
        save()


def _superblock_version(path):
    data = path.read_bytes()
    return data[data.find(b"\x89HDF\r\n\x1a\n") + 8]


def _h5py_writing_with(monkeypatch, libver, override):
    """h5py.File writing with ``libver``: as h5py's default (``override`` False) or whatever the caller asks."""
    file = h5py.File

    def writing(name, mode="r", *args, **kwargs):
        if mode == "w":
            kwargs.update(libver=libver) if override else kwargs.setdefault("libver", libver)
        return file(name, mode, *args, **kwargs)
    monkeypatch.setattr(h5py, "File", writing)


def test_a_sealed_file_has_a_superblock_of_version_0_whatever_h5py_defaults_to(tmp_path, rng, monkeypatch):
    """The seal leaves out the consistency flags of superblocks 0 and 1 only: write_h5 took h5py's default
    file format (today's: superblock 0), so a newer default (1.8's, superblock 2) would have been sealed
    with its flags byte and checksum inside the CRC-32, which any HDF5 writer's open rewrites."""
    _h5py_writing_with(monkeypatch, "v108", override=False)
    table = make_table(rng)
    table.save(tmp_path / "t.h5")
    assert _superblock_version(tmp_path / "t.h5") == 0
    np.testing.assert_array_equal(ss.HostTable.load(tmp_path / "t.h5", backend="numpy").to_numpy(),
                                  table.to_numpy())


@pytest.mark.parametrize("libver,version", [("v108", 2), ("v110", 3)])
def test_a_sealed_file_with_a_superblock_of_version_2_or_3_reads_as_damaged_after_a_killed_writer(
        tmp_path, rng, monkeypatch, libver, version):
    """What speedswap never writes (see above), as its docs say: the seal covers such a superblock whole.
    An HDF5 writer's open sets its flags byte and rewrites its checksum, and its close restores both:
    the file loads; a writer killed holding it open leaves them set, and the file reads as damaged."""
    _h5py_writing_with(monkeypatch, libver, override=True)
    table = make_table(rng)
    path = tmp_path / "t.h5"
    table.save(path)
    monkeypatch.undo()
    assert _superblock_version(path) == version
    with h5py.File(path, "r+"):
        pass
    np.testing.assert_array_equal(ss.HostTable.load(path, backend="numpy").to_numpy(), table.to_numpy())
    pid = os.fork()
    if pid == 0:  # a writer killed while it holds the file open, once it flushed
        writer = h5py.File(path, "r+")
        writer.flush()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    with pytest.raises(ss.FileFormatError, match="is damaged: its metadata checksum does not match"):
        ss.HostTable.load(path, backend="numpy")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, MemoryError])
def test_the_files_of_an_mmap_embedding_whose_load_stopped_say_so_until_a_load_completes(
        rng, tmp_path, monkeypatch, stop):
    """A load stopped while it wrote an ``mmap`` embedding's tables left their files part the
    checkpoint's rows, part those before. The process refused the tables, but the files said
    nothing: ``HostTable.load(path, mmap=True)`` in the next run trained on the mix. Now each file
    the load writes is marked in its header until the load completes: numpy and speedswap refuse
    it meanwhile, and speedswap says why."""
    from speedswap.files import tables as tables_module
    source = adam_embedding(rng)
    source.save(tmp_path / "ckpt")
    saved = {name.removeprefix("optimizer."): rows for name, rows in contents(source).items()}
    target = ss.OffloadedEmbedding(60, DIM, max_rows=CAPACITY, storage="mmap", path=tmp_path / "tables",
                                   backend="numpy")
    target.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((60, DIM), dtype=np.float32))))
    opt = torch.optim.Adam(target.parameters(), lr=0.01)
    target.attach(opt)
    train_step(target, opt, rng, 60)
    on_disk = {path.stem: path for path in (tmp_path / "tables").glob("*.npy")}
    assert sorted(on_disk) == sorted(saved)
    commit = _commits_stop_at_the_second(monkeypatch, stop)
    with pytest.raises(stop):
        target.load(tmp_path / "ckpt")
    for path in on_disk.values():
        with pytest.raises(ss.FileFormatError, match=r"a load into it stopped before it had written every "
                                                    r"row.*part the load's.*load the checkpoint"):
            ss.HostTable.load(path, mmap=True, backend="numpy")
        with pytest.raises(ValueError):  # numpy takes it for no .npy file at all
            np.load(path, mmap_mode="r")
    monkeypatch.setattr(tables_module.StagedRows, "commit", commit)
    target.load(tmp_path / "ckpt")  # a load that completes lifts the mark
    for name, path in on_disk.items():
        reopened = ss.HostTable.load(path, mmap=True, backend="numpy")
        np.testing.assert_array_equal(reopened.to_numpy(), saved[name], err_msg=name)
        np.testing.assert_array_equal(np.load(path), saved[name], err_msg=name)
        reopened.close()
    train_step(target, opt, rng, 60)  # and it trains again


def test_a_load_stopped_while_it_marks_the_files_leaves_marked_the_file_an_earlier_stopped_load_tore(
        rng, tmp_path, monkeypatch):
    """A load into several ``mmap`` tables stopped while it marked their files (Ctrl-C during a
    mark's fsync, a file it cannot open) lifted the mark from every file it had reached, even one
    an earlier stopped load had left marked: that file's rows are still part one load's, part
    those before, but the next run opened it and trained on the mix."""
    from speedswap.table import loading_into
    from speedswap.files import tables as tables_module
    checkpoint = tmp_path / "ckpt.npy"
    np.save(checkpoint, rng.standard_normal((40, 8), dtype=np.float32))
    first = ss.HostTable.from_numpy(rng.standard_normal((40, 8), dtype=np.float32), storage="mmap",
                                    path=tmp_path / "first.npy", backend="numpy")
    second_rows = rng.standard_normal((40, 8), dtype=np.float32)
    second = ss.HostTable.from_numpy(second_rows, storage="mmap", path=tmp_path / "second.npy", backend="numpy")
    commit = tables_module.StagedRows.commit

    def stopped(staged, table, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(tables_module.StagedRows, "commit", stopped)
    with pytest.raises(KeyboardInterrupt):
        first.load_from(checkpoint)  # the rows of first are now part the load's, as far as anyone knows
    monkeypatch.setattr(tables_module.StagedRows, "commit", commit)
    mark = ss.files.mark_npy_torn

    def stopped_at_the_second(fd, path, torn):
        if torn and os.path.samefile(path, tmp_path / "second.npy"):
            raise KeyboardInterrupt
        return mark(fd, path, torn)
    monkeypatch.setattr(ss.files, "mark_npy_torn", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        with loading_into([first, second], checkpoint):
            pytest.fail("no row is written before every file is marked")
    monkeypatch.setattr(ss.files, "mark_npy_torn", mark)
    with pytest.raises(ss.FileFormatError, match="a load into it stopped before it had written every row"):
        ss.HostTable.load(tmp_path / "first.npy", mmap=True, backend="numpy")
    with pytest.raises(ss.StateError, match="stopped"):
        first.to_numpy()
    np.testing.assert_array_equal(np.load(tmp_path / "second.npy"), second_rows)  # not marked, not changed
    first.close()
    second.close()


def test_a_load_stopped_while_it_flushes_an_mmap_table_leaves_it_refused_as_its_file_says(
        rng, tmp_path, monkeypatch):
    """Ctrl-C during the flush that ends a load into an ``mmap`` table (its writeback takes most
    of the load's time) left the file marked "a load into it stopped", but the table in the
    process took reads and writes as if the load had completed: it trained on, and its file,
    still marked, was refused to the next run after every later step and close."""
    checkpoint = tmp_path / "ckpt.npy"
    saved = rng.standard_normal((40, 8), dtype=np.float32)
    np.save(checkpoint, saved)
    table = ss.HostTable.from_numpy(rng.standard_normal((40, 8), dtype=np.float32), storage="mmap",
                                    path=tmp_path / "table.npy", backend="numpy")
    flush = ss.HostTable.flush

    def stopped(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(ss.HostTable, "flush", stopped)
    with pytest.raises(KeyboardInterrupt):
        table.load_from(checkpoint)
    monkeypatch.setattr(ss.HostTable, "flush", flush)
    with pytest.raises(ss.FileFormatError, match="a load into it stopped before it had written every row"):
        ss.HostTable.load(tmp_path / "table.npy", mmap=True, backend="numpy")
    with pytest.raises(ss.StateError, match="stopped"):
        table.to_numpy()
    table.load_from(checkpoint)  # a load that completes lifts both
    np.testing.assert_array_equal(table.to_numpy(), saved)
    table.close()
    reopened = ss.HostTable.load(tmp_path / "table.npy", mmap=True, backend="numpy")
    np.testing.assert_array_equal(reopened.to_numpy(), saved)
    reopened.close()


def test_an_mmap_table_too_large_to_stage_loads_from_its_own_file(rng, tmp_path, monkeypatch):
    """A load into an ``mmap`` table from the very file it maps, too large to hold in RAM (read
    again at commit, which checks the file did not change since it was verified), was refused
    midway once loads marked the file they write: the mark's write changed the file's times,
    so the load stopped ('changed or replaced since it was verified') and left the table refused
    and its file marked, rows that were whole all along."""
    from speedswap.files import tables as tables_module
    monkeypatch.setattr(tables_module, "STAGE_RAM_SHARE", 0.0)  # as for a table larger than half the RAM
    rows = rng.standard_normal((40, 8), dtype=np.float32)
    table = ss.HostTable.from_numpy(rows, storage="mmap", path=tmp_path / "table.npy", backend="numpy")
    table.load_from(tmp_path / "table.npy")
    np.testing.assert_array_equal(table.to_numpy(), rows)
    table.close()
    np.testing.assert_array_equal(np.load(tmp_path / "table.npy"), rows)


def test_a_load_into_an_mmap_table_whose_path_another_save_replaced_leaves_the_new_file_unmarked(
        rng, tmp_path, monkeypatch):
    """A load into an ``mmap`` table checked that its path still named the table's file, then
    opened the path again to mark it. Another process's save renamed its own file to that path in
    between: the load marked that file "a load into it stopped", never lifted the mark (the path no
    longer named the table's file), and the next run refused a file nobody had torn."""
    checkpoint = tmp_path / "ckpt.npy"
    saved = rng.standard_normal((40, 8), dtype=np.float32)
    np.save(checkpoint, saved)
    table_path = tmp_path / "table.npy"
    table = ss.HostTable.from_numpy(rng.standard_normal((40, 8), dtype=np.float32), storage="mmap",
                                    path=table_path, backend="numpy")
    newer = rng.standard_normal((40, 8), dtype=np.float32)
    np.save(tmp_path / "newer.npy", newer)
    real_open = os.open

    def another_save_lands_first(path, flags, *args, **kwargs):
        if os.fspath(path) == os.fspath(table_path) and (tmp_path / "newer.npy").exists():
            os.replace(tmp_path / "newer.npy", table_path)
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", another_save_lands_first)
    table.load_from(checkpoint)
    monkeypatch.setattr(os, "open", real_open)
    assert not (tmp_path / "newer.npy").exists()  # the save did land where the mark was to be written
    np.testing.assert_array_equal(table.to_numpy(), saved)
    np.testing.assert_array_equal(np.load(table_path), newer)  # neither marked nor changed
    table.close()


def test_a_mark_that_cannot_be_lifted_after_a_stopped_marking_leaves_the_first_cause_raised(
        rng, tmp_path, monkeypatch):
    """A load into three ``mmap`` tables stopped (Ctrl-C) while it marked the third file; lifting
    the mark it had put on the first then failed (an I/O error). The user saw that PathError,
    "could not save", not the Ctrl-C, and the second file kept a mark no load had earned. Now
    every mark is tried, the Ctrl-C is what is raised, and a note names the file still marked."""
    from speedswap.files.npy import TORN_MAGIC
    from speedswap.table import loading_into
    checkpoint = tmp_path / "ckpt.npy"
    np.save(checkpoint, rng.standard_normal((40, 8), dtype=np.float32))
    rows = {name: rng.standard_normal((40, 8), dtype=np.float32) for name in ("a", "b", "c")}
    tables = [ss.HostTable.from_numpy(values, storage="mmap", path=tmp_path / f"{name}.npy", backend="numpy")
              for name, values in rows.items()]
    names = {(os.stat(tmp_path / f"{name}.npy").st_dev, os.stat(tmp_path / f"{name}.npy").st_ino): name
             for name in rows}
    marks = []  # the files in the order the load marked them
    real_pwrite = os.pwrite

    def failing(fd, data, offset):
        stat = os.fstat(fd)
        name = names.get((stat.st_dev, stat.st_ino))
        if name is not None and data == TORN_MAGIC:
            marks.append(name)
            if len(marks) == 3:
                raise KeyboardInterrupt
        elif name is not None and marks and name == marks[0]:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(KeyboardInterrupt) as raised:
        with loading_into(tables, checkpoint):
            pytest.fail("no row is written before every file is marked")
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    first, second, third = marks
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"{first}.npy" in notes and "could not be lifted" in notes
    with pytest.raises(ss.FileFormatError, match="a load into it stopped"):
        ss.HostTable.load(tmp_path / f"{first}.npy", mmap=True, backend="numpy")
    for name in (second, third):  # lifted, and never marked
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), rows[name], err_msg=name)
    for table, values in zip(tables, rows.values()):  # nothing was written: the tables train on
        np.testing.assert_array_equal(table.to_numpy(), values)
        table.close()


def test_loads_into_one_mmap_file_from_two_processes_take_turns_so_its_mark_tells_the_truth(rng, tmp_path):
    """Two processes map one ``.npy`` file and each loads a checkpoint into it. The load that
    finished first lifted the file's torn mark while the other was still writing; killed then,
    that one left the file part one checkpoint's rows, part the other's, and unmarked: the next
    run trained on the mix. Now loads into one file take turns (a lock on the file, which a
    killed holder lets go of), so the second load waits and then writes every row."""
    import signal
    import threading
    path = tmp_path / "table.npy"
    table = ss.HostTable.from_numpy(rng.standard_normal((64, 8), dtype=np.float32), storage="mmap", path=path,
                                    backend="numpy")
    ours, theirs = rng.standard_normal((2, 64, 8), dtype=np.float32)
    np.save(tmp_path / "ours.npy", ours)
    np.save(tmp_path / "theirs.npy", theirs)
    to_child, from_child = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the other process, the table's map shared with this one: no return into pytest
        try:
            from speedswap.files import tables as tables_module

            def halting(staged, target, **kwargs):
                rows = target.load_target().numpy()
                rows[:32] = theirs[:32]
                os.write(from_child[1], b"1")
                os.read(to_child[0], 1)
                rows[32:48] = theirs[32:48]
                os.write(from_child[1], b"2")
                os.read(to_child[0], 1)  # killed here, before the rest
            tables_module.StagedRows.commit = halting
            table.load_from(tmp_path / "theirs.npy")
        finally:
            os._exit(1)
    try:
        assert os.read(from_child[0], 1) == b"1"  # its load marked the file and wrote half the rows
        ours_done = threading.Thread(target=table.load_from, args=(tmp_path / "ours.npy",))
        ours_done.start()
        ours_done.join(2.0)  # done at once, where loads into one file do not take turns
        os.write(to_child[1], b"g")
        assert os.read(from_child[0], 1) == b"2"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    ours_done.join(60)
    assert not ours_done.is_alive()
    np.testing.assert_array_equal(np.load(path), ours)  # whole, and unmarked
    np.testing.assert_array_equal(table.to_numpy(), ours)
    table.close()


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: loads into one file do not take turns")
def test_a_load_that_waits_for_another_ones_turn_says_so_before_it_waits(rng, tmp_path):
    """A load into a file whose turn another load holds waits for it, without a limit: a holder
    that hangs kept it waiting without a word. It now warns first, naming the file."""
    import fcntl
    import threading
    path = tmp_path / "table.npy"
    table = ss.HostTable.from_numpy(rng.standard_normal((64, 8), dtype=np.float32), storage="mmap", path=path,
                                    backend="numpy")
    checkpoint = rng.standard_normal((64, 8), dtype=np.float32)
    np.save(tmp_path / "ckpt.npy", checkpoint)
    holder = os.open(path, os.O_RDWR)  # another load's turn, as rewriting_in_place takes it
    fcntl.flock(holder, fcntl.LOCK_EX)
    threading.Timer(0.5, os.close, args=(holder,)).start()  # closing it lets go of the turn
    with pytest.warns(RuntimeWarning, match=f"a load into {re.escape(repr(str(path)))} waits for another") as caught:
        table.load_from(tmp_path / "ckpt.npy")
    # At the caller's line, not inside contextlib, whose frames the load's context managers run in.
    assert [w.filename for w in caught] == [__file__]
    np.testing.assert_array_equal(table.to_numpy(), checkpoint)
    table.close()
    np.testing.assert_array_equal(np.load(path), checkpoint)


def test_a_mark_whose_sync_fails_is_lifted_again_and_nothing_is_loaded(rng, tmp_path, monkeypatch):
    """The fsync of a load's torn mark failed (an I/O error) after the mark was written: the load
    was refused, rightly, with the table's rows unchanged, but the mark stayed on the file, and
    the next run refused a file no load had touched. Its message said "could not save" the table's
    file, "any previous file at that path is intact": a load saves no file."""
    checkpoint = tmp_path / "ckpt.npy"
    np.save(checkpoint, rng.standard_normal((40, 8), dtype=np.float32))
    rows = rng.standard_normal((40, 8), dtype=np.float32)
    table_path = tmp_path / "table.npy"
    table = ss.HostTable.from_numpy(rows, storage="mmap", path=table_path, backend="numpy")
    ours = (os.stat(table_path).st_dev, os.stat(table_path).st_ino)
    real_fsync = os.fsync
    failed = []

    def failing_once(fd):
        if not failed and (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == ours:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", failing_once)
    with pytest.raises(ss.PathError) as raised:
        table.load_from(checkpoint)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert failed and raised.value.errno == errno.EIO
    message = str(raised.value)
    assert "could not save" not in message and "previous file" not in message, message
    assert f"load into the mmap table over {str(table_path)!r}" in message and "load again" in message, message
    np.testing.assert_array_equal(table.to_numpy(), rows)
    table.close()
    np.testing.assert_array_equal(np.load(table_path), rows)  # no mark left behind


@pytest.mark.parametrize("how, suffix", [("load", ".npy"), ("load", ".h5"), ("load_from", ".npy"),
                                         ("load_from", ".h5"), ("mmap", ".npy")])
def test_a_table_file_replaced_between_its_header_and_its_rows_loads_nothing(rng, tmp_path, monkeypatch, how,
                                                                              suffix):
    """A file read for its header, then opened again by path for its rows, was replaced in between
    by another save to that path (a rename), of another dtype: the rows of the new file were read
    by the old file's header (float64 bytes as float32 numbers) and loaded without a word. Now the
    rows must come from the file the header was read from, unchanged, or nothing is loaded."""
    from speedswap.files import tables as tables_module
    path = tmp_path / f"table{suffix}"
    rows = rng.standard_normal((40, 8), dtype=np.float32)
    other = rng.standard_normal((40, 8))  # float64: another table saved to the same path

    def write(array, target):
        if suffix == ".npy":
            np.save(target, array)
        else:
            with h5py.File(target, "w") as f:  # another tool's file: no CRC-32 to catch the swap
                f["table"] = array
    write(rows, path)
    reader = "read_npy_header" if suffix == ".npy" else "read_h5_header"
    read_header = getattr(tables_module, reader)

    def replaced_after_the_header(*args):
        header = read_header(*args)
        write(other, tmp_path / f"new{suffix}")
        os.replace(tmp_path / f"new{suffix}", path)
        return header
    before = rng.standard_normal((40, 8), dtype=np.float32)
    table = ss.HostTable.from_numpy(before, backend="numpy")
    monkeypatch.setattr(tables_module, reader, replaced_after_the_header)
    with pytest.raises(ss.FileFormatError, match="was changed or replaced since it was verified"):
        if how == "load":
            ss.HostTable.load(path, backend="numpy")
        elif how == "mmap":
            ss.HostTable.load(path, mmap=True, backend="numpy")
        else:
            table.load_from(path)
    np.testing.assert_array_equal(table.to_numpy(), before)
    table.close()


def test_a_file_a_load_is_writing_says_so_not_that_a_load_stopped(rng, tmp_path):
    """Opened while another process loaded a checkpoint into it, an ``mmap`` table's file was
    refused as one a load had stopped in ("... or delete the file"): advice that, followed, deletes
    a file a live load is writing. Now a file whose load holds its turn says a load is under way."""
    from speedswap.table import loading_into
    checkpoint = tmp_path / "ckpt.npy"
    np.save(checkpoint, rng.standard_normal((40, 8), dtype=np.float32))
    path = tmp_path / "table.npy"
    table = ss.HostTable.from_numpy(rng.standard_normal((40, 8), dtype=np.float32), storage="mmap", path=path,
                                    backend="numpy")
    with loading_into([table], checkpoint):  # as the load of another process: its turn, on its own descriptor
        with pytest.raises(ss.FileFormatError, match="a load into it is under way") as raised:
            ss.HostTable.load(path, mmap=True, backend="numpy")
        assert "delete" not in str(raised.value)
    table.close()
    np.load(path)  # the load completed: whole, unmarked
