"""A refused re-attach of an ``mmap`` embedding's optimizer leaves the old one attached, its state files intact.

The new optimizer's state files take the old ones' names (``exp_avg.npy``,
``exp_avg_sq.npy``). Before, an attach again closed the old state first, so a
new state that could not be made (out of file descriptors, a disk error) left
the embedding with no optimizer attached and the old state gone. Now the new
files are made beside the old ones and replace them only once every one
exists, all of them or none (a rename that fails puts back those before it),
and only while their names hold the files the embedding made. Each case
trains an ``mmap`` embedding with Adam on Zipf ids beside SparseAdam on an
``nn.Embedding``, is refused a new Adam again and again (the fault one call
later each time), training on with the old one in between as the reference
does, then attaches the new one and trains on as the reference with a new
SparseAdam. An interrupt once the files are replaced, as the old state's
tables are closed, comes after the attach.
"""

import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap import atomic, files
from mmap_training import BATCH, DIM, ROWS, assert_as_in_memory, entries, train, trained  # tests/, as sharded_worker
from test_fault_injection import _failing_at
from test_optimizer_equivalence import assert_same, torch_initial
from training_helpers import CAPACITY, NUM_ROWS, run_in_memory, skipgram_loss, zipf_batches

STATE_FILES = ["exp_avg.npy", "exp_avg_sq.npy", "table.npy"]


def _adam(emb):
    return torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-30)  # SparseAdam adds eps elsewhere


def _sparse_adam(ref):
    return torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30)


def _trains_on_after_refusal(emb, opt, ref, ref_opt, rng, directory, before, new, steps, why=""):
    """A refused attach of ``new``: the files bit for bit as ``before``, ``new`` without state, the old ``opt``
    training on as in memory."""
    assert entries(directory) == before, why
    assert not new.state
    train(emb, opt, ref, ref_opt, rng, steps)
    assert_as_in_memory(emb, ref, ref_opt, directory)


def _trains_as_restarted(emb, new, ref, rng, directory, steps):
    """An attach of ``new`` that went through: the state files alone, ``new`` training as a new SparseAdam."""
    assert sorted(os.listdir(directory)) == STATE_FILES
    ref_opt = _sparse_adam(ref)
    train(emb, new, ref, ref_opt, rng, steps)
    assert_as_in_memory(emb, ref, ref_opt, directory)


_UNDER_LIMITS = textwrap.dedent("""
    import os, resource, sys
    import torch, speedswap as ss
    sys.path.insert(0, sys.argv[3])
    from mmap_training import assert_as_in_memory, entries, train, trained
    directory, seed = sys.argv[1], int(sys.argv[2])
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 10)
    new = torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-30)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for spare in range(-4, 64):  # one more descriptor each time, until the attach has enough
        before = entries(directory)
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + spare, hard))
        try:
            emb.attach(new)
            refused = None
        except ss.PathError as exc:
            refused = exc
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if refused is None:
            break
        assert "ulimit -n" in str(refused), refused
        assert entries(directory) == before, sorted(os.listdir(directory))  # bit for bit, no temporary either
        assert not new.state
        train(emb, opt, ref, ref_opt, rng, 2)  # the old optimizer is attached still
        assert_as_in_memory(emb, ref, ref_opt, directory)
        print("refused", flush=True)
    print("attached", sorted(os.listdir(directory)), flush=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30)
    train(emb, new, ref, ref_opt, rng, 20)
    assert_as_in_memory(emb, ref, ref_opt, directory)
    emb.close()
    print("trained as in memory", flush=True)
""")


def test_a_re_attach_out_of_descriptors_keeps_the_old_optimizer_and_its_files_and_a_retry_restarts(tmp_path, seed):
    """In a subprocess: the limit is the process's."""
    done = subprocess.run([sys.executable, "-c", _UNDER_LIMITS, str(tmp_path / "emb"), str(seed),
                           os.path.dirname(__file__)], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # Refused at the first new table, then at the second (its temporary directory's file, its map, the
    # descriptor that checks it), then attached.
    assert lines.count("refused") >= 2, done.stdout
    assert lines[-2] == f"attached {STATE_FILES}", done.stdout
    assert lines[-1] == "trained as in memory"


#: The calls that make the new state's files: its temporary directories, each file's header and size,
#: the sync before it has its name there, its mode, the descriptor that checks it, and the hard link
#: that gives each old file a second name for the renames to put it back from (the renames over the old
#: files: the tests below). Some failures are let through (a directory's sync; makedirs of the embedding's
#: directory, which exists; a link, for which a rename stands in): the attach succeeds then.
POINTS = [(os, "mkdir"), (files.npy, "_write_sparse"), (os, "fsync"), (os, "chmod"), (os, "open"), (os, "link")]


def _re_attach_failing_at(module, name, index, directory, seed, cache_rows, monkeypatch):
    """Train, then attach a new Adam with call ``index`` of ``name`` failing; check what follows.

    Refused, the old optimizer must stay attached with its files bit for bit
    as they were and train on as in memory, and a retry must succeed. Either
    way the new optimizer must then train as a new SparseAdam in memory.

    Returns:
        ``(reached, refused)``: whether the attach made that call, and whether it was refused.
    """
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 10, cache_rows=cache_rows)
    new = _adam(emb)
    emb.flush()
    before = entries(directory)
    counter = [0]
    monkeypatch.setattr(module, name, _failing_at(getattr(module, name), index, counter))
    try:
        emb.attach(new)
        refused = None
    except OSError as exc:
        refused = exc
    finally:
        monkeypatch.undo()
    if refused is not None:
        assert isinstance(refused, ss.PathError) and "injected failure" in str(refused), refused
        _trains_on_after_refusal(emb, opt, ref, ref_opt, rng, directory, before, new, 5,
                                 f"a re-attach failing at {name} call {index} changed the files")
        emb.attach(new)
    _trains_as_restarted(emb, new, ref, rng, directory, 10)
    emb.close()
    return counter[0] > index, refused is not None


@pytest.mark.parametrize("cache_rows", [0, 16])
@pytest.mark.parametrize("module,name", POINTS, ids=[name for _, name in POINTS])
def test_a_re_attach_failing_at_any_call_keeps_the_old_optimizer_and_its_files_and_a_retry_restarts(
        module, name, cache_rows, tmp_path, seed, monkeypatch):
    """Each call in turn, from a new embedding trained alike, until the attach makes no more of them."""
    outcomes = []
    while not outcomes or outcomes[-1][0]:
        outcomes.append(_re_attach_failing_at(module, name, len(outcomes), tmp_path / f"emb{len(outcomes)}", seed,
                                              cache_rows, monkeypatch))
    refusals = [refused for _, refused in outcomes]
    if name == "link":  # the old file is renamed aside instead, as where there are no hard links
        assert not any(refusals), f"a failure of {name} refused the attach: {refusals}"
    else:
        assert any(refusals), f"no failure of {name} refused the attach"


class Interrupted(KeyboardInterrupt):
    pass


def test_an_interrupt_at_any_directory_sync_of_a_re_attach_refuses_it_before_the_renames_and_not_after(
        tmp_path, seed, monkeypatch):
    """A Ctrl-C lands as a directory's slow sync returns: the new files' (refused), or the renames' (attached)."""
    outcomes = []
    while not outcomes or outcomes[-1] != "done":
        index, directory = len(outcomes), tmp_path / f"emb{len(outcomes)}"
        emb, opt, ref, ref_opt, rng = trained(directory, seed, 10)
        new = _adam(emb)
        before = entries(directory)
        counter, sync = [0], atomic.fsync_dir

        def interrupted(path, index=index, counter=counter, sync=sync):
            counter[0] += 1
            sync(path)
            if counter[0] - 1 == index:
                raise Interrupted

        monkeypatch.setattr(atomic, "fsync_dir", interrupted)
        try:
            emb.attach(new)
            outcomes.append("done")
        except Interrupted as exc:
            notes = getattr(exc, "__notes__", [])
            if emb._state.optimizer is new:
                outcomes.append("attached")
                assert any(f"{os.fspath(directory)}/exp_avg" in note and "is the new file" in note for note in notes)
            else:
                outcomes.append("refused")
        finally:
            monkeypatch.undo()
        if outcomes[-1] == "refused":
            _trains_on_after_refusal(emb, opt, ref, ref_opt, rng, directory, before, new, 5)
            emb.attach(new)
        _trains_as_restarted(emb, new, ref, rng, directory, 10)
        emb.close()
    assert "refused" in outcomes and "attached" in outcomes, outcomes


@pytest.mark.parametrize("kind", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding], ids=lambda kind: kind.__name__)
def test_an_interrupt_as_a_re_attach_closes_the_old_state_s_tables_leaves_the_new_optimizer_attached(
        kind, tmp_path, seed, monkeypatch):
    """A Ctrl-C lands as each old table's map is flushed in turn: the attach is done by then, and holds."""
    outcomes = []
    while not outcomes or outcomes[-1] != "done":
        emb, opt, ref, ref_opt, rng, directory = _trained(kind, tmp_path / f"emb{len(outcomes)}", seed)
        index = len(outcomes)
        new = _adam(emb)
        monkeypatch.setattr(ss.HostTable, "close", _interrupted_at(ss.HostTable.close, index))
        try:
            emb.attach(new)
            outcomes.append("done")
        except Interrupted as exc:
            outcomes.append("interrupted")
            assert any("the new optimizer is attached" in note for note in getattr(exc, "__notes__", [])), exc
        finally:
            monkeypatch.undo()
        assert emb._state.optimizer is new
        _trains_as_restarted(emb, new, ref, rng, directory, 10)
        emb.close()
    assert outcomes == ["interrupted", "interrupted", "done"], outcomes  # Adam's two old tables, then none


def _interrupted_at(original, index):
    """``original``, whose call ``index`` raises :class:`Interrupted` before it runs."""
    counter = [0]

    def interrupted(*args, **kwargs):
        counter[0] += 1
        if counter[0] - 1 == index:
            raise Interrupted
        return original(*args, **kwargs)
    return interrupted


def _no_hard_links(src, dst, **kwargs):
    """``os.link`` on a file system without hard links (vfat, exFAT, FUSE mounts): the source is looked up first."""
    os.lstat(src)
    raise OSError(errno.EPERM, "Operation not permitted (injected: no hard links)")


def test_a_re_attach_where_no_hard_link_can_be_made_replaces_the_files_and_trains_as_restarted(
        tmp_path, seed, monkeypatch):
    """The old files are renamed aside to be put back from: the attach goes through as with links."""
    directory = tmp_path / "emb"
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 10)
    new = _adam(emb)
    monkeypatch.setattr(os, "link", _no_hard_links)
    emb.attach(new)
    monkeypatch.undo()
    assert emb._state.optimizer is new
    _trains_as_restarted(emb, new, ref, rng, directory, 10)  # no old file left under a name aside either
    emb.close()


def test_a_re_attach_whose_first_rename_fails_changes_nothing(tmp_path, seed, monkeypatch):
    directory = tmp_path / "emb"
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 10)
    new = _adam(emb)
    before = entries(directory)
    monkeypatch.setattr(os, "replace", _failing_at(os.replace, 0, [0]))
    with pytest.raises(ss.PathError, match="injected failure") as refused:
        emb.attach(new)
    monkeypatch.undo()
    assert "already" not in str(refused.value)
    _trains_on_after_refusal(emb, opt, ref, ref_opt, rng, directory, before, new, 10)
    emb.close()


def _amsgrad(params):
    """AdamW with amsgrad: three state tables (exp_avg, exp_avg_sq, max_exp_avg_sq), three renames at a re-attach."""
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, amsgrad=True)


def _steps(emb, opt, batches):
    """A step of ``opt`` over ``emb`` for each of ``batches`` (training_helpers', as run_offloaded takes them)."""
    for pos, neg, ctx in batches:
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        opt.step()
        opt.zero_grad()


def _as_in_memory(emb, directory, table0, batches):
    """``emb``'s table, its attached optimizer's state tables and their files: ``_amsgrad`` stepped in memory over
    ``batches`` from ``table0`` (the touched rows only), bit for bit."""
    emb.flush()
    state = {name: table.to_numpy(copy=True) for name, table in emb._state.tables.items()}
    assert_same((emb.table.to_numpy(copy=True), state),
                run_in_memory(_amsgrad, table0, batches, torch.device("cpu"), initial_state=torch_initial), exact=True)
    for name, rows in state.items():
        np.testing.assert_array_equal(np.load(directory / f"{name}.npy"), rows, err_msg=name)


@pytest.mark.parametrize("links,failing,calls_made", [(True, 1, 3), (False, 2, 5), (False, 3, 7)],
                         ids=["links", "no-links-aside", "no-links-over"])
def test_a_re_attach_whose_second_of_three_renames_fails_puts_the_first_back_and_changes_nothing(
        links, failing, calls_made, tmp_path, seed, monkeypatch):
    """The first state file renamed is put back: every file as before, the old optimizer training on from them.

    Without hard links each old file is renamed aside before its new one is renamed over it: the second
    file's rename aside fails, or its new file's rename once its old one is aside; those done are put back.
    """
    rng = np.random.default_rng(seed)
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 30, torch.device("cpu"))
    directory = tmp_path / "emb"
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="mmap", path=directory, backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    emb.attach(opt := _amsgrad(emb.parameters()))
    _steps(emb, opt, batches[:10])
    emb.flush()
    before, new, calls = entries(directory), _amsgrad(emb.parameters()), [0]
    assert len(before) == 4  # the table and three state files
    monkeypatch.setattr(os, "replace", _failing_at(os.replace, failing, calls))
    if not links:
        monkeypatch.setattr(os, "link", _no_hard_links)
    with pytest.raises(ss.PathError, match="injected failure") as refused:
        emb.attach(new)
    monkeypatch.undo()
    assert calls[0] == calls_made  # the renames before the failed one, it, and each of those put back
    assert os.fspath(directory / "exp_avg_sq.npy") in str(refused.value)
    assert f"{[os.fspath(directory / 'exp_avg.npy')]!r}, were put back: nothing was replaced" in str(refused.value)
    assert entries(directory) == before  # bit for bit, no temporary or second name left
    assert not new.state
    _steps(emb, opt, batches[10:20])
    _as_in_memory(emb, directory, table0, batches[:20])  # its files still its own: flushed, and named
    emb.attach(new)
    table = emb.table.to_numpy(copy=True)
    _steps(emb, new, batches[20:])
    _as_in_memory(emb, directory, table, batches[20:])
    emb.close()


@pytest.mark.parametrize("links,failing", [(True, (2, 3)), (False, (3, 4))], ids=["links", "no-links"])
def test_renames_together_whose_putting_back_fails_too_say_where_the_old_files_are(links, failing, tmp_path,
                                                                                   monkeypatch):
    """b's rename fails, then a's putting back: a's old file is kept, and named.

    Without hard links a's old file is renamed aside (the first rename), then b's (the third) fails.
    """
    targets = [tmp_path / f"{name}.npy" for name in ("a", "b", "c")]
    moves = []
    for index, target in enumerate(targets):
        target.write_bytes(b"old %d" % index)
        (tmp_path / f"new{index}").write_bytes(b"new %d" % index)
        moves.append((os.fspath(tmp_path / f"new{index}"), os.fspath(target)))
    calls, replace = [], os.replace

    def failing_replace(*args):  # b's rename, then a's putting back
        calls.append(args)
        if len(calls) in failing:
            raise OSError(errno.EIO, "injected failure")
        return replace(*args)

    monkeypatch.setattr(os, "replace", failing_replace)
    if not links:
        monkeypatch.setattr(os, "link", _no_hard_links)
    with pytest.raises(ss.PathError, match="putting back those renamed failed too") as refused:
        atomic.replace_together(moves)
    monkeypatch.undo()
    assert len(calls) == failing[-1]
    kept = [name for name in os.listdir(tmp_path) if atomic.is_temporary(name)]
    assert len(kept) == 1 and (tmp_path / kept[0]).read_bytes() == b"old 0"
    assert f"{ {os.fspath(targets[0]): os.fspath(tmp_path / kept[0])}!r}" in str(refused.value), refused.value
    assert [target.read_bytes() for target in targets] == [b"new 0", b"old 1", b"old 2"]
    os.replace(tmp_path / kept[0], targets[0])  # as the message says
    atomic.replace_together(moves[1:])
    assert [target.read_bytes() for target in targets] == [b"old 0", b"new 1", b"new 2"]
    assert sorted(os.listdir(tmp_path)) == ["a.npy", "b.npy", "c.npy"]


def test_a_re_attach_over_another_file_put_under_a_state_file_s_name_is_refused_and_changes_nothing(tmp_path, seed):
    """By which file is there, not its name: a copy of the state file itself, moved over it, is not speedswap's."""
    directory = tmp_path / "emb"
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 10)
    emb.flush()
    shutil.copyfile(directory / "exp_avg_sq.npy", tmp_path / "copy.npy")
    os.replace(tmp_path / "copy.npy", directory / "exp_avg_sq.npy")  # the same bytes, another file
    before, new = entries(directory), _adam(emb)
    with pytest.raises(ss.PathError, match="is not the file speedswap made there") as refused:
        emb.attach(new)
    assert os.fspath(directory / "exp_avg_sq.npy") in str(refused.value)
    assert entries(directory) == before
    assert not new.state
    train(emb, opt, ref, ref_opt, rng, 10)
    assert_as_in_memory(emb, ref, ref_opt)  # from its maps: its exp_avg_sq file has no name any more
    os.unlink(directory / "exp_avg_sq.npy")  # the other file moved away: the retry makes a new one there
    emb.attach(new)
    _trains_as_restarted(emb, new, ref, rng, directory, 20)
    emb.close()


def _trained(kind, path, seed):
    """``trained(path, seed, 10)`` for an OffloadedEmbedding, or the same for a one-rank ShardedOffloadedEmbedding.

    Returns:
        the embedding, its Adam, an nn.Embedding with SparseAdam, the generator, and where the state files are.
    """
    if kind is ss.OffloadedEmbedding:
        return (*trained(path, seed, 10), path)
    rng = np.random.default_rng(seed)
    emb = ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=BATCH, storage="mmap", path=path, backend="numpy")
    emb.table.scatter(torch.arange(ROWS), torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32)))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.table.to_numpy(copy=True)), freeze=False,
                                             sparse=True)
    emb.attach(opt := _adam(emb))
    ref_opt = _sparse_adam(ref)
    train(emb, opt, ref, ref_opt, rng, 10)
    return emb, opt, ref, ref_opt, rng, path / "rank0"


def test_a_refused_re_attach_of_a_one_rank_sharded_embedding_keeps_the_old_optimizer_and_its_files(
        tmp_path, seed, monkeypatch):
    """ShardedOffloadedEmbedding.attach makes its new state as OffloadedEmbedding's does."""
    emb, opt, ref, ref_opt, rng, directory = _trained(ss.ShardedOffloadedEmbedding, tmp_path, seed)
    new = _adam(emb)
    for index in (0, 1):  # Adam's first state table, then its second
        before = entries(directory)
        monkeypatch.setattr(files.npy, "_write_sparse", _failing_at(files.npy._write_sparse, index, [0]))
        with pytest.raises(ss.PathError, match="injected failure"):
            emb.attach(new)
        monkeypatch.undo()
        _trains_on_after_refusal(emb, opt, ref, ref_opt, rng, directory, before, new, 5)
    emb.attach(new)
    _trains_as_restarted(emb, new, ref, rng, directory, 20)
    emb.close()


def _mmap_embedding_with_adam(directory, rng, **options):
    """A new mmap embedding of random rows with a new Adam attached, and an nn.Embedding of them with SparseAdam."""
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH, storage="mmap", path=directory, backend="numpy", **options)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    emb.attach(opt := _adam(emb))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.table.to_numpy(copy=True)), freeze=False,
                                             sparse=True)
    return emb, opt, ref, _sparse_adam(ref)


@pytest.mark.parametrize("links", [True, False], ids=["links", "no-links"])
def test_a_re_attach_over_a_state_file_behind_a_symbolic_link_keeps_the_link_and_the_files_mode(
        links, tmp_path, seed, monkeypatch):
    """As a save through a link does (atomic_output): the file the link names is replaced, in its directory.

    Where no hard link can be made, that file is renamed aside in its directory, and removed from there.
    """
    rng = np.random.default_rng(seed)
    elsewhere, directory = tmp_path / "elsewhere", tmp_path / "emb"
    elsewhere.mkdir()
    directory.mkdir()
    np.save(elsewhere / "moments.npy", rng.standard_normal((ROWS, DIM), dtype=np.float32))
    os.chmod(elsewhere / "moments.npy", 0o640)
    os.symlink(elsewhere / "moments.npy", directory / "exp_avg.npy")
    emb, opt, ref, ref_opt = _mmap_embedding_with_adam(directory, rng, overwrite=True)
    train(emb, opt, ref, ref_opt, rng, 10)
    new = _adam(emb)
    before = entries(elsewhere)
    monkeypatch.setattr(files.npy, "_write_sparse", _failing_at(files.npy._write_sparse, 1, [0]))
    with pytest.raises(ss.PathError, match="injected failure"):
        emb.attach(new)
    monkeypatch.undo()
    assert entries(elsewhere) == before and os.path.islink(directory / "exp_avg.npy")
    train(emb, opt, ref, ref_opt, rng, 5)
    assert_as_in_memory(emb, ref, ref_opt, directory)
    if not links:
        monkeypatch.setattr(os, "link", _no_hard_links)
    emb.attach(new)
    monkeypatch.undo()
    assert os.readlink(directory / "exp_avg.npy") == os.fspath(elsewhere / "moments.npy")
    assert sorted(os.listdir(elsewhere)) == ["moments.npy"]
    assert os.stat(elsewhere / "moments.npy").st_mode & 0o777 == 0o640
    ref_opt = _sparse_adam(ref)
    train(emb, new, ref, ref_opt, rng, 10)
    assert_as_in_memory(emb, ref, ref_opt, directory)
    emb.close()


def test_an_attach_that_would_replace_a_directory_is_refused_before_any_state_file_is_replaced(tmp_path, seed):
    """Its rename would fail after the other files' were done: refused before any is made."""
    rng = np.random.default_rng(seed)
    directory = tmp_path / "emb"
    directory.mkdir()
    np.save(directory / "exp_avg.npy", rng.standard_normal((ROWS, DIM), dtype=np.float32))
    (directory / "exp_avg_sq.npy").mkdir()
    before = entries(directory)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH, storage="mmap", path=directory, backend="numpy",
                                overwrite=True)
    opt = _adam(emb)
    with pytest.raises(ss.PathError, match="exp_avg_sq.npy") as refused:
        emb.attach(opt)
    assert {name: data for name, data in entries(directory).items() if name != "table.npy"} == before
    assert "is not a regular file" in str(refused.value) and "Nothing was replaced" in str(refused.value)
    assert not opt.state
    emb.close()


def test_a_refused_restart_of_the_attached_optimizer_keeps_its_state_and_step_count(tmp_path, seed, monkeypatch):
    """``attach(opt, restart=True)`` of the attached optimizer, refused: it trains on as if never asked."""
    directory = tmp_path / "emb"
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 10)
    emb.flush()
    before = entries(directory)
    monkeypatch.setattr(files.npy, "_write_sparse", _failing_at(files.npy._write_sparse, 1, [0]))
    with pytest.raises(ss.PathError, match="injected failure"):
        emb.attach(opt, restart=True)
    monkeypatch.undo()
    assert entries(directory) == before
    train(emb, opt, ref, ref_opt, rng, 10)
    assert_as_in_memory(emb, ref, ref_opt, directory)
    assert int(opt.state[emb.weight]["step"]) == ref_opt.state[ref.weight]["step"] == 20
    emb.attach(opt, restart=True)
    ref_opt = _sparse_adam(ref)
    train(emb, opt, ref, ref_opt, rng, 10)
    assert_as_in_memory(emb, ref, ref_opt, directory)
    assert int(opt.state[emb.weight]["step"]) == 10
    emb.close()
