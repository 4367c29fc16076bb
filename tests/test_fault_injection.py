"""Fault injection: every kind of save fails, or the process dies, at each file-system call in turn.

For each save (``.npy``, ``.h5``, a directory checkpoint, ``OffloadedEmbedding.save``
to a directory and to HDF5, ``OptimizerFactory.save``), ``os.rename``,
``os.replace``, ``os.fsync`` and the single write point ``files.base.write_chunk`` are
made to fail at call 0, 1, 2, ... until the save gets through (ModelFactory.saveTorch's
``.pt`` file too, which ``torch.save`` writes). After each
failure the path must hold the whole old checkpoint (or nothing, for a first
save), which ``load`` reads; after success the whole new one. The crash tests
do the same in a forked child that dies with ``os._exit`` (no cleanup code
runs), and then check that a later save leaves no debris behind.
"""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap import files

ROWS, DIM, CAP = 30, 4, 8
POINTS = [(os, "rename"), (os, "replace"), (os, "fsync"), (files.base, "write_chunk")]


class Injected(OSError):
    pass


def _embedding(opt_class=torch.optim.Adam):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAP, storage="pageable", backend="numpy")
    emb.attach(opt_class(emb.parameters(), lr=0.1))
    return emb


def _switchers():
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(CAP, DIM)})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return ss.OptimizerFactory(opt, ROWS, DIM, model, "u", backend="numpy")


def _fill(tables, rng):
    for table in tables:
        table.apply_(lambda t: t.copy_(torch.from_numpy(
            rng.standard_normal(tuple(t.shape), dtype=np.float32))))


class TableSaver:
    def __init__(self, suffix):
        self.suffix = suffix
        self.obj = ss.HostTable.zeros(ROWS, DIM, storage="pageable", backend="numpy")

    def tables(self, obj=None):
        return {"table": (obj or self.obj)}

    def save(self, path):
        self.obj.save(path)

    def load(self, path):
        return {"table": ss.HostTable.load(path, backend="numpy")}


class EmbeddingSaver(TableSaver):
    def __init__(self, suffix):
        self.suffix, self.obj = suffix, _embedding()

    def tables(self, obj=None):
        return (obj or self.obj)._tables()

    def load(self, path):
        fresh = _embedding()
        fresh.load(path)
        return fresh._tables()


class FactorySaver(TableSaver):
    def __init__(self, suffix):
        self.suffix, self.obj = suffix, _switchers()

    def tables(self, obj=None):
        return (obj or self.obj).state.tables

    def load(self, path):
        fresh = _switchers()
        fresh.load(path)
        return fresh.state.tables


class TorchFileSaver(TableSaver):
    """``ModelFactory.saveTorch`` of a ``.pt`` file, which ``torch.save`` writes (not ``write_chunk``)."""

    unused = ("write_chunk",)

    def __init__(self, suffix):
        self.suffix, self.obj = suffix, ss.ModelFactory(torch.nn.Embedding(CAP, DIM), ROWS, DIM,
                                                        backend="numpy")

    def tables(self, obj=None):
        return {"table": (obj or self.obj).table}

    def save(self, path):
        self.obj.saveTorch(path)

    def load(self, path):
        fresh = ss.ModelFactory(torch.nn.Embedding(CAP, DIM), ROWS, DIM, backend="numpy")
        fresh.loadTorch(path)
        return {"table": fresh.table}


SAVERS = {"npy": lambda: TableSaver(".npy"), "h5": lambda: TableSaver(".h5"),
          "embedding-dir": lambda: EmbeddingSaver(""), "embedding-h5": lambda: EmbeddingSaver(".h5"),
          "optimizer-factory-dir": lambda: FactorySaver(""), "model-factory-pt": lambda: TorchFileSaver(".pt")}


def _content(tables):
    return {name: t.to_numpy(copy=True) for name, t in tables.items()}


def _holds(saver, path, expected):
    """Whether ``path`` holds exactly ``expected`` (None: nothing at all), read by ``load``."""
    try:
        loaded = _content(saver.load(path))
    except FileNotFoundError:  # MissingFileError included
        return expected is None
    return expected is not None and loaded.keys() == expected.keys() and all(
        np.array_equal(loaded[name], expected[name]) for name in expected)


def _tree(root):
    """Every path under ``root``, relative to it: what a failed save must leave as it was."""
    return sorted(os.path.relpath(os.path.join(d, n), root)
                  for d, dirs, names in os.walk(root) for n in dirs + names)


def _failing_at(original, index, counter):
    def fail(*args, **kwargs):
        counter[0] += 1
        if counter[0] - 1 == index:
            raise Injected(errno.EIO, "injected failure")
        return original(*args, **kwargs)
    return fail


def _prepared(kind, first, rng, tmp_path):
    """``(saver, path, old)``: a saver with random tables and, unless ``first``, a checkpoint at path."""
    saver = SAVERS[kind]()
    path = tmp_path / f"ckpt{saver.suffix}"
    _fill(saver.tables().values(), rng)
    old = None
    if not first:
        saver.save(path)
        old = _content(saver.tables())
    return saver, path, old


@pytest.mark.parametrize("first", [False, True], ids=["replace", "first-save"])
@pytest.mark.parametrize("module,name", POINTS, ids=[n for _, n in POINTS])
@pytest.mark.parametrize("kind", list(SAVERS))
def test_a_save_failing_at_any_call_leaves_the_old_or_the_new_checkpoint(
        kind, module, name, first, rng, tmp_path, monkeypatch):
    saver, path, old = _prepared(kind, first, rng, tmp_path)
    listing = _tree(tmp_path)
    index = 0
    while True:
        _fill(saver.tables().values(), rng)
        new = _content(saver.tables())
        counter = [0]
        monkeypatch.setattr(module, name, _failing_at(getattr(module, name), index, counter))
        try:
            saver.save(path)
            failed = False
        except OSError as exc:
            failed = True
            assert isinstance(exc, ss.SpeedswapError) and "injected" in str(exc)
            assert os.fspath(path) in str(exc) and ".tmp" not in str(exc)
        finally:
            monkeypatch.undo()
        if not failed:
            assert _holds(saver, path, new)
            break
        assert _holds(saver, path, old), f"a save failing at {name} call {index} lost the old checkpoint"
        # Inside a directory checkpoint too: a version CURRENT never named is a whole copy.
        assert _tree(tmp_path) == listing, f"a save failing at {name} call {index} left files behind"
        index += 1
    if name in ("replace", "fsync", "write_chunk") and name not in getattr(saver, "unused", ()):
        assert index > 0, f"{name} was never called by the {kind} save"


class Interrupted(KeyboardInterrupt):
    pass


def _only_the_checkpoint(saver, root, path):
    """Whether ``root`` holds ``path`` and nothing else; as a directory, one version of its tables."""
    if os.listdir(root) != [path.name]:
        return False
    if not os.path.isdir(path):
        return True
    versions = [e for e in os.listdir(path) if e != "CURRENT"]
    tables = sorted(f"{name}.npy" for name in saver.tables())
    return (len(versions) == 1 and (path / "CURRENT").read_text().strip() == versions[0]
            and sorted(os.listdir(path / versions[0])) == sorted(["checkpoint.json", *tables]))


@pytest.mark.parametrize("module,name", POINTS, ids=[n for _, n in POINTS])
@pytest.mark.parametrize("kind", ["npy", "h5", "embedding-dir", "embedding-h5"])
def test_an_interrupt_at_any_call_of_a_save_leaves_one_whole_checkpoint_and_nothing_else(
        kind, module, name, rng, tmp_path, monkeypatch):
    """Ctrl-C at any point: the old checkpoint (or the new one, after the commit), no debris."""
    saver, path, old = _prepared(kind, False, rng, tmp_path)
    for index in range(64):
        _fill(saver.tables().values(), rng)
        new = _content(saver.tables())
        counter = [0]
        original = getattr(module, name)

        def interrupt(*args, **kwargs):
            counter[0] += 1
            if counter[0] - 1 == index:
                raise Interrupted()
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, interrupt)
        try:
            saver.save(path)
            interrupted = False
        except Interrupted:
            interrupted = True
        finally:
            monkeypatch.undo()
        if not interrupted:
            assert _holds(saver, path, new)
            break
        committed = _holds(saver, path, new)
        assert committed or _holds(saver, path, old), (
            f"a save interrupted at {name} call {index} left no whole checkpoint")
        assert _only_the_checkpoint(saver, tmp_path, path), (
            f"a save interrupted at {name} call {index} left {_tree(tmp_path)}")
        old = new if committed else old
    else:
        pytest.fail("the save never got through")


@pytest.mark.parametrize("first", [False, True], ids=["replace", "first-save"])
@pytest.mark.parametrize("module,name", POINTS, ids=[n for _, n in POINTS])
@pytest.mark.parametrize("kind", ["npy", "h5", "embedding-dir", "optimizer-factory-dir"])
def test_a_process_dying_at_any_call_of_a_save_leaves_the_old_or_the_new_checkpoint(
        kind, module, name, first, rng, tmp_path):
    saver, path, old = _prepared(kind, first, rng, tmp_path)
    _fill(saver.tables().values(), rng)
    new = _content(saver.tables())
    for index in range(64):
        child = os.fork()
        if child == 0:  # dies at call `index`, with no cleanup at all
            counter = [0]
            original = getattr(module, name)

            def die(*args, **kwargs):
                counter[0] += 1
                if counter[0] - 1 == index:
                    os._exit(17)
                return original(*args, **kwargs)
            setattr(module, name, die)
            try:
                saver.save(path)
            finally:
                os._exit(0)
        _, status = os.waitpid(child, 0)
        died = os.waitstatus_to_exitcode(status) == 17
        if not died:
            assert _holds(saver, path, new)
            break
        # Before the commit point the old checkpoint, after it (fsync of the directory) the new.
        assert _holds(saver, path, old) or _holds(saver, path, new), (
            f"a save dying at {name} call {index} left no whole checkpoint")
    else:
        pytest.fail("the save never got through")
    # A later save removes the debris of every dead save and leaves a clean checkpoint.
    saver.save(path)
    debris = [e for e in os.listdir(tmp_path) if e.endswith(".tmp")]
    if os.path.isdir(path):
        debris += [e for e in os.listdir(path) if e not in ("CURRENT",)
                   and not e.startswith("v")]
        versions = [e for e in os.listdir(path) if e.startswith("v")]
        assert len(versions) == 1, versions
    assert not debris, debris
    assert _holds(saver, path, new)


def _saved_past_a_file_size_limit(save: str) -> str:
    """Script lines running ``save`` under a 1 MiB file-size limit, which stands in for a full disk."""
    return textwrap.dedent(f"""
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            {save}
        except ss.PathError as exc:
            print("PathError:", exc)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    """)


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, numpy as np, torch, speedswap as ss
    path = sys.argv[1]
    switch = ss.ModelFactory(torch.nn.Embedding(8, 64), 20_000, 64, backend="numpy")
    switch.uniformDistributionInit(-1, 1)
    switch.saveTorch(path)
    saved = switch.getNumpyVersion()
    switch.uniformDistributionInit(-1, 1)
""") + _saved_past_a_file_size_limit("switch.saveTorch(path)") + textwrap.dedent("""
    switch.loadTorch(path)
    print("previous file whole:", bool(np.array_equal(switch.getNumpyVersion(), saved)))
""")


def test_a_torch_file_save_that_fills_the_disk_keeps_the_previous_file(tmp_path):
    path = tmp_path / "u.pt"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, os.fspath(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"PathError: could not save {os.fspath(path)!r} (File too large)" in out.stdout
    assert "previous file whole: True" in out.stdout
    assert os.listdir(tmp_path) == ["u.pt"]


_FILE_SIZE_LIMIT = textwrap.dedent("""
    import resource, signal, sys, numpy as np, torch, speedswap as ss
    path = sys.argv[1]
    rng = np.random.default_rng(int(sys.argv[2]))
    emb = ss.OffloadedEmbedding(20_000, 64, max_rows=8, storage="pageable", backend="numpy")
    emb.attach(torch.optim.Adam(emb.parameters(), lr=0.1))
    def fill():
        for t in emb._tables().values():
            t.apply_(lambda x: x.copy_(torch.from_numpy(
                rng.standard_normal(tuple(x.shape), dtype=np.float32))))
    fill()
    emb.save(path)
    saved = {k: t.to_numpy(copy=True) for k, t in emb._tables().items()}
    fill()
""") + _saved_past_a_file_size_limit("emb.save(path)") + textwrap.dedent("""
    # (HDF5 fails the write, then the close.)
    emb.load(path)
    print("previous file whole:", all(np.array_equal(t.to_numpy(), saved[name])
                                      for name, t in emb._tables().items()))
""")


def test_an_hdf5_save_past_the_file_size_limit_is_a_path_error_and_keeps_the_previous_file(
        rng, tmp_path):
    path = tmp_path / "emb.h5"
    out = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, os.fspath(path),
                          str(rng.integers(1 << 30))], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"PathError: could not save {os.fspath(path)!r}" in out.stdout, out.stdout
    assert "ulimit -f" in out.stdout and ".tmp" not in out.stdout
    assert "previous file whole: True" in out.stdout
    assert os.listdir(tmp_path) == ["emb.h5"]


def test_an_hdf5_file_that_cannot_be_closed_is_a_path_error_and_keeps_the_previous_file(
        rng, tmp_path, monkeypatch):
    """The data fits but writing the metadata at close fails: HDF5 says so with a RuntimeError."""
    import h5py
    saver, path, old = _prepared("embedding-h5", False, rng, tmp_path)
    _fill(saver.tables().values(), rng)
    close = h5py.File.close

    def full_at_close(self):
        writing = self.id.valid and self.mode != "r"
        close(self)
        if writing:
                raise RuntimeError("Can't decrement id ref count (unable to extend file properly, "
                                   "errno = 28, error message = 'No space left on device')")
    monkeypatch.setattr(h5py.File, "close", full_at_close)
    with pytest.raises(ss.PathError, match="disk is full") as info:
        saver.save(path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and os.fspath(path) in str(info.value)
    assert _holds(saver, path, old)
    assert os.listdir(tmp_path) == [path.name]


_KILLED_SAVE = textwrap.dedent("""
    import sys, numpy as np, speedswap as ss
    path, value = sys.argv[1], float(sys.argv[2])
    table = ss.HostTable.empty(1_000_000, 64, storage="pageable", backend="numpy")
    table.apply_(lambda t: t.fill_(value))
    print("ready", flush=True)
    while True:
        table.save(path)
""")


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_sigkill_during_saves_of_a_large_table_leaves_a_whole_file(suffix, rng, tmp_path):
    """A 256 MB table saved in a loop, SIGKILLed at moments spread over a save: the file is always whole.

    Each new saving process removes the debris of the one killed before it, so the
    temporaries are counted right after each kill. The delays are drawn from the
    measured time of one save, and the test goes on until a kill has landed inside a
    save (a temporary left behind) a few times, so it proves something on a slow disk
    and on a fast one alike. They come from the suite's seed, printed, so that a failing
    run's kill delays can be replayed (SPEEDSWAP_SEED).
    """
    path = tmp_path / f"big{suffix}"
    table = ss.HostTable.from_numpy(np.full((1_000_000, 64), 1.0, np.float32),
                                    storage="pageable", backend="numpy")
    started = time.perf_counter()
    table.save(path)
    one_save = time.perf_counter() - started
    landed = kills = 0
    while landed < 3 and kills < 20:
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, os.fspath(path), "2.0"],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 1.5 * one_save))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        landed += bool([e for e in os.listdir(tmp_path) if e.endswith(".tmp")])
        with ss.HostTable.load(path, storage="pageable", backend="numpy") as loaded:
            values = np.unique(loaded.to_numpy())
        assert len(values) == 1 and values[0] in (1.0, 2.0), values
    assert landed, f"none of {kills} kills landed inside a save; the test proved nothing"
    with ss.HostTable.load(path, backend="numpy") as loaded:
        loaded.save(path)  # a later save removes the killed saves' temporaries
    assert not [e for e in os.listdir(tmp_path) if e.endswith(".tmp")]


def test_a_save_whose_old_version_cannot_be_removed_after_the_commit_succeeds(rng, tmp_path, monkeypatch):
    """Once CURRENT names the new version the save has happened, whatever befalls the old one.

    ``shutil.rmtree(ignore_errors=True)`` still raises where its first ``os.fstat``
    fails (CPython 3.11 calls it outside its error handler): the save raised
    PathError "Any previous file at that path is intact" over the new checkpoint.
    """
    import shutil
    saver, path, old = _prepared("embedding-dir", False, rng, tmp_path)
    _fill(saver.tables().values(), rng)
    new = _content(saver.tables())
    removing, failed = [False], [0]
    rmtree, fstat = shutil.rmtree, os.fstat

    def flagged_rmtree(*args, **kwargs):
        removing[0] = True
        try:
            return rmtree(*args, **kwargs)
        finally:
            removing[0] = False

    def fstat_failing_in_rmtree(fd):
        if removing[0]:
            failed[0] += 1
            raise Injected(errno.EIO, "injected failure")
        return fstat(fd)
    monkeypatch.setattr(shutil, "rmtree", flagged_rmtree)
    monkeypatch.setattr(os, "fstat", fstat_failing_in_rmtree)
    saver.save(path)
    monkeypatch.undo()
    assert failed[0], "the save removed the old version without shutil.rmtree's os.fstat: nothing was injected"
    assert _holds(saver, path, new)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
@pytest.mark.parametrize("at", ["removal", "sync"])
def test_an_interrupt_after_a_directory_save_committed_says_the_save_happened(at, rng, tmp_path, monkeypatch):
    """Ctrl-C while the old version was removed (or CURRENT's directory synced), after CURRENT named the
    new version, came out as a bare KeyboardInterrupt of the save: the caller could only believe the save
    failed. It still goes on (an interrupt is never swallowed), with a note that the save happened; the
    next save removes what the interrupt left, and loads read the new version meanwhile."""
    import shutil
    from speedswap import atomic
    saver, path, old = _prepared("embedding-dir", False, rng, tmp_path)
    _fill(saver.tables().values(), rng)
    new = _content(saver.tables())
    module, name = (shutil, "rmtree") if at == "removal" else (atomic, "fsync_dir")
    original, calls = getattr(module, name), [0]

    def interrupted_after_the_commit(*args, **kwargs):
        calls[0] += 1
        if os.path.exists(path / "CURRENT") and (path / "CURRENT").read_text().strip() != "v000001":
            raise Interrupted()
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, interrupted_after_the_commit)
    with pytest.raises(Interrupted) as info:
        saver.save(path)
    monkeypatch.undo()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"the save of {os.fspath(path)!r} had completed" in notes and "v000002" in notes, notes
    assert _holds(saver, path, new)
    _fill(saver.tables().values(), rng)
    newer = _content(saver.tables())
    saver.save(path)
    assert _holds(saver, path, newer) and _only_the_checkpoint(saver, tmp_path, path), _tree(tmp_path)


def _pre_version_checkpoint(path):
    """Turn the directory checkpoint ``path`` into the layout before versions: its tables and manifest at the top."""
    version = path / (path / "CURRENT").read_text().strip()
    for entry in os.listdir(version):
        os.rename(version / entry, path / entry)
    os.rmdir(version)
    os.unlink(path / "CURRENT")


def test_an_interrupted_removal_of_a_pre_version_checkpoint_is_finished_by_the_next_save(rng, tmp_path,
                                                                                         monkeypatch):
    """The first save over a checkpoint written before versions removes its files after the commit. A
    Ctrl-C after the first of them (its manifest) left the tables' .npy files, which no later save
    removed (saves removed only v###### directories): a whole copy of the tables, on disk for good.
    The next save now finishes that removal, of the files the old manifest names only."""
    saver, path, _ = _prepared("embedding-dir", False, rng, tmp_path)
    _pre_version_checkpoint(path)
    (path / "notes.txt").write_text("mine")  # the user's, beside the checkpoint: never removed
    (path / "export.npy").write_bytes(b"mine too")
    _fill(saver.tables().values(), rng)
    new = _content(saver.tables())
    unlink, calls = os.unlink, [0]

    def interrupted_after_the_first_file(*args, **kwargs):
        if os.fspath(args[0]).endswith(".speedswap.lock"):  # a save's lock, let go of: not a file of the tables
            return unlink(*args, **kwargs)
        calls[0] += 1
        if calls[0] > 1:
            raise Interrupted()
        return unlink(*args, **kwargs)
    monkeypatch.setattr(os, "unlink", interrupted_after_the_first_file)
    with pytest.raises(Interrupted):
        saver.save(path)
    monkeypatch.undo()
    assert calls[0] == 2 and _holds(saver, path, new)
    _fill(saver.tables().values(), rng)
    newer = _content(saver.tables())
    saver.save(path)
    assert _holds(saver, path, newer)
    assert sorted(os.listdir(path)) == ["CURRENT", "export.npy", "notes.txt", "v000002"], _tree(tmp_path)
    assert (path / "notes.txt").read_text() == "mine" and (path / "export.npy").read_bytes() == b"mine too"
