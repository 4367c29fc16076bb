"""An ``mmap`` table whose file another writer changes: refused before any row is touched, never a SIGBUS.

Each test trains an ``OffloadedEmbedding`` kept in files (``storage="mmap"``)
with Adam a few steps on Zipf ids, changes one of its files the way another
process would, and checks what the next step does against ``SparseAdam`` on
an in-memory ``nn.Embedding`` (offloaded Adam is lazy, as SparseAdam is).
"""

import gc
import os
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest
import torch

import speedswap as ss
from mmap_training import BATCH, DIM, ROWS, step, trained, zipf_ids  # tests/, as sharded_worker

STEPS = 4
FILES = ("table", "exp_avg", "exp_avg_sq")


def _file_bytes(directory):
    return {name: (directory / f"{name}.npy").read_bytes() for name in FILES}


def _rewrite_in_place(path, array):
    """``np.save(path, array)`` from another process: it truncates and rewrites the very file the table maps."""
    done = subprocess.run([sys.executable, "-c", f"import numpy as np, sys; np.save({str(path)!r}, np.frombuffer("
                           f"sys.stdin.buffer.read(), {array.dtype.str!r}).reshape({array.shape}))"],
                          input=array.tobytes(), timeout=120)
    assert done.returncode == 0


_TRUNCATED = textwrap.dedent("""
    import os, sys
    import numpy as np, torch, speedswap as ss
    sys.path.insert(0, sys.argv[5])
    from mmap_training import BATCH, DIM, ROWS, trained, zipf_ids
    directory, seed, name, when = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 3)
    emb.flush()
    path = os.path.join(directory, name + ".npy")
    before = {n: open(os.path.join(directory, n + ".npy"), "rb").read() for n in ("table", "exp_avg", "exp_avg_sq")}
    ids, weights = zipf_ids(rng), torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32))
    try:
        if when == "before the forward":
            os.truncate(path, 100)
        loss = ((emb(ids) * weights).sum() ** 2)
        loss.backward()
        if when == "before the step":
            os.truncate(path, 100)
        opt.step()
    except ss.FileFormatError as exc:
        print("refused:", exc, flush=True)
    emb.discard_step()  # the refused step's rows stay in flight until then (it may be retried instead)
    for n, data in before.items():
        if n != name:
            assert open(os.path.join(directory, n + ".npy"), "rb").read() == data, n + " changed"
    calls = {"gather": lambda t: t.gather([ROWS - 1]), "scatter": lambda t: t.scatter([ROWS - 1], torch.ones(DIM)),
             "to_numpy": lambda t: t.to_numpy(copy=True), "save": lambda t: t.save(path + ".copy.npy"),
             "flush": lambda t: t.flush(), "load_from": lambda t: t.load_from(os.path.join(directory, "saved.npy"))}
    table = emb.table if name == "table" else emb._state.tables[name]  # no public handle on a state table
    np.save(os.path.join(directory, "saved.npy"), np.ones(table.shape, np.float32))
    for what, call in calls.items():
        try:
            call(table)
        except ss.FileFormatError as exc:
            print(what, "refused:", "truncated" in str(exc), flush=True)
    emb.close()  # no SIGBUS in its flush either
    print("closed", flush=True)
""")


@pytest.mark.parametrize("name, when", [("table", "before the forward"), ("table", "before the step"),
                                        ("exp_avg_sq", "before the step")])
def test_a_truncated_mmap_file_is_refused_with_no_sigbus_and_the_other_files_unchanged(tmp_path, seed, name, when):
    """os.truncate of an mmap table's file killed the next gather or scatter with SIGBUS: no traceback, the
    process gone, its cached rows with it."""
    done = subprocess.run([sys.executable, "-c", _TRUNCATED, str(tmp_path / "emb"), str(seed), name, when,
                           os.path.dirname(__file__)], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stdout}{done.stderr}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused:") and "truncated after it was mapped" in lines[0], done.stdout
    for what in ("gather", "scatter", "to_numpy", "save", "flush", "load_from"):
        assert f"{what} refused: True" in lines, done.stdout
    assert lines[-1] == "closed"
    assert not (tmp_path / "emb" / f"{name}.npy.copy.npy").exists()  # the refused save wrote nothing


@pytest.mark.parametrize("name", FILES)
def test_an_mmap_file_rewritten_with_another_header_is_refused_and_no_file_changes(tmp_path, seed, name):
    """np.save of another array to an mmap table's path (same inode, truncated and rewritten) was read
    and trained with as the old layout: float64 halves as float32 rows, silently."""
    emb, opt, ref, ref_opt, rng = trained(tmp_path / "emb", seed, STEPS)
    emb.flush()
    new = rng.standard_normal((ROWS, DIM // 2))  # float64: the same bytes, other rows
    _rewrite_in_place(tmp_path / "emb" / f"{name}.npy", new)
    before = _file_bytes(tmp_path / "emb")
    ids = zipf_ids(rng)
    with pytest.raises(ss.FileFormatError, match=r"rewritten in place with another \.npy header.*float64 \(4,\)"):
        (emb(ids).sum() ** 2).backward()
        opt.step()
    assert _file_bytes(tmp_path / "emb") == before  # the rewritten file too: nothing was written into it
    np.testing.assert_array_equal(np.load(tmp_path / "emb" / f"{name}.npy"), new)
    emb.close()


def test_a_write_back_refused_for_one_file_writes_none_of_the_steps_tables(tmp_path, seed):
    """A step writes its rows and their optimizer state back together: a state file changed once the step
    read its rows (here inside Adam's update) is found before the table's rows are written, not after."""
    emb, opt, ref, ref_opt, rng = trained(tmp_path / "emb", seed, STEPS)
    ids = zipf_ids(rng)
    (emb(ids).sum() ** 2).backward()
    adam = sys.modules[type(opt).__module__]  # torch.optim.adam, whose update function step() calls
    update, before = adam.adam, {}

    def update_then_rewrite(*args, **kwargs):  # the step has read every row it writes back
        update(*args, **kwargs)
        _rewrite_in_place(tmp_path / "emb" / "exp_avg_sq.npy", rng.standard_normal((ROWS, DIM // 2)))
        before.update(_file_bytes(tmp_path / "emb"))
    with mock.patch.object(adam, "adam", update_then_rewrite):
        with pytest.raises(ss.FileFormatError, match="exp_avg_sq.npy' was rewritten in place"):
            opt.step()
    assert before and _file_bytes(tmp_path / "emb") == before
    emb.discard_step()
    emb.close()


def test_an_mmap_file_rewritten_with_the_same_header_holds_the_new_rows(tmp_path, seed):
    """The table is the file: rows another writer puts there in the table's layout are its rows from then on,
    as rows another process writes through its own map are (documented in HostTable._check_file)."""
    emb, opt, ref, ref_opt, rng = trained(tmp_path / "emb", seed, STEPS)
    emb.flush()
    new = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    _rewrite_in_place(tmp_path / "emb" / "table.npy", new)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(new))
    for _ in range(STEPS):  # the state rows are as before: both go on from them
        step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng),
             weights=torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)))
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    emb.close()


@pytest.mark.parametrize("change", ["replaced by a rename", "removed"])
def test_an_mmap_file_renamed_away_keeps_training_exactly_and_flush_refuses_to_lose_the_rows(tmp_path, seed,
                                                                                            change):
    """The map holds the old file, whole: training goes on with it exactly. But it is a file no path names,
    which goes at close: table.flush() returned as if the rows were on disk at the path."""
    emb, opt, ref, ref_opt, rng = trained(tmp_path / "emb", seed, STEPS)
    path = tmp_path / "emb" / "table.npy"
    other = rng.standard_normal((3, DIM), dtype=np.float32)
    if change == "removed":
        os.unlink(path)
    else:
        np.save(tmp_path / "other.npy", other)
        os.replace(tmp_path / "other.npy", path)
    for _ in range(STEPS):
        step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng),
             weights=torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)))
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ss.PathError, match="no longer names the file this table maps"):
        emb.table.flush()
    if change == "replaced by a rename":
        np.testing.assert_array_equal(np.load(path), other)  # the refused flush left the new file alone
    emb.table.save(path)  # what the message says: the rows, in a new file at the path
    np.testing.assert_allclose(np.load(path), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    emb.close()


_TRUNCATED_ELSEWHERE = textwrap.dedent("""
    import os, sys
    import numpy as np, torch, speedswap as ss
    sys.path.insert(0, sys.argv[4])
    from mmap_training import BATCH, DIM, trained, zipf_ids
    directory, seed, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 3)
    emb.flush()
    path = os.path.join(directory, "table.npy")
    if how == "renamed away":
        reached = os.path.join(directory, "moved.npy")
        os.rename(path, reached)
    elif how == "its directory moved":
        os.rename(directory, directory + ".moved")
        reached = os.path.join(directory + ".moved", "table.npy")
    else:  # "a hard link, the path replaced": the path names a new whole file, the link the mapped one
        reached = os.path.join(os.path.dirname(directory), "link.npy")
        os.link(path, reached)
        np.save(path + ".new.npy", np.ones((3, DIM), np.float32))
        os.replace(path + ".new.npy", path)
    os.truncate(reached, 100)
    ids, weights = zipf_ids(rng), torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32))
    try:
        ((emb(ids) * weights).sum() ** 2).backward()
        opt.step()
    except ss.FileFormatError as exc:
        print("refused:", exc, flush=True)
    emb.discard_step()
    emb.close()
    print("closed", flush=True)
""")


@pytest.mark.parametrize("how", ["renamed away", "its directory moved", "a hard link, the path replaced"])
def test_a_mapped_file_truncated_through_another_name_is_refused_with_no_sigbus(tmp_path, seed, how):
    """The check went by path: a file renamed away (or reached through a hard link once its path named
    another file) went unchecked, and truncated through that name it killed the next gather with SIGBUS."""
    done = subprocess.run([sys.executable, "-c", _TRUNCATED_ELSEWHERE, str(tmp_path / "emb"), str(seed), how,
                           os.path.dirname(__file__)], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stdout}{done.stderr}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused:") and "truncated after it was mapped" in lines[0], done.stdout
    assert lines[-1] == "closed" and not done.stderr, done.stdout + done.stderr


def test_a_mapped_file_renamed_away_is_checked_by_its_own_header_not_the_file_at_its_path(tmp_path, seed):
    """Renamed away, the mapped file is still the table: rewritten in place through its new name with the
    same header its rows are the table's (the new file at its path, of another header, is never read);
    with another header it is refused, where the check by path had let it be read as the old layout."""
    emb, opt, ref, ref_opt, rng = trained(tmp_path / "emb", seed, STEPS)
    emb.flush()
    path, moved = tmp_path / "emb" / "table.npy", tmp_path / "moved.npy"
    os.rename(path, moved)
    np.save(path, rng.standard_normal((ROWS, DIM // 2)))  # float64 rows: another header at the path
    new = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    _rewrite_in_place(moved, new)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(new))
    for _ in range(STEPS):
        step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng),
             weights=torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)))
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    emb.flush()
    other = rng.standard_normal((ROWS, DIM // 2))
    _rewrite_in_place(moved, other)
    with pytest.raises(ss.FileFormatError, match=r"rewritten in place with another \.npy header.*float64 \(4,\)"):
        emb.table.gather([0])
    np.testing.assert_array_equal(np.load(moved), other)
    emb.close()


def _open_descriptors():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
def test_mapped_files_hold_no_descriptor_once_closed_or_dropped(tmp_path, seed):
    """Each mmap table (and mapped DataGadget) holds a descriptor of its file: closed with it, once however
    often close() is called, and with the table when it is dropped unclosed."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    np.save(tmp_path / "data.npy", rows)
    before = _open_descriptors()
    for i in range(2000):
        table = ss.HostTable.load(tmp_path / "data.npy", mmap=True, backend="numpy")
        picked = rng.integers(0, ROWS, 4)
        np.testing.assert_array_equal(table.gather(picked).numpy(), rows[picked])
        if i % 3:
            table.close()
        if i % 3 == 2:
            table.close()  # a second close closes no other descriptor that took its number
        del table  # i % 3 == 0: dropped unclosed
    for i in range(200):
        gadget = ss.DataGadget(tmp_path / "data.npy", mmap=True, backend="numpy")
        gadget.load(tmp_path / "data.npy")  # the first file's table and descriptor go
        np.testing.assert_array_equal(gadget.get([i % ROWS]).numpy(), rows[[i % ROWS]])
        if i % 2:
            gadget.close()
        del gadget
    gc.collect()
    assert _open_descriptors() == before


_CLOSE_TRUNCATED = textwrap.dedent("""
    import os, sys
    import numpy as np, torch, speedswap as ss
    sys.path.insert(0, sys.argv[4])
    from mmap_training import BATCH, DIM, step, trained, zipf_ids
    directory, seed, then = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    emb, opt, ref, ref_opt, rng = trained(directory, seed, 3, cache_rows=200)
    emb.flush()
    path = os.path.join(directory, "table.npy")
    whole = open(path, "rb").read()
    step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng),
         weights=torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)))  # rows cached, dirty
    os.truncate(path, 100)
    if then == "never closed":
        sys.exit(0)  # the embedding is open at exit
    try:
        emb.close()
    except ss.FileFormatError as exc:
        print("refused:", exc, flush=True)
    if then == "restored":
        with open(path, "r+b") as f:  # the very file the table maps, whole again
            f.write(whole)
        emb.close()
        np.testing.assert_allclose(np.load(path), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
        for name in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(np.load(os.path.join(directory, name + ".npy")),
                                       ref_opt.state[ref.weight][name].numpy(), rtol=1e-5, atol=1e-6)
        print("kept", flush=True)
    elif then == "discarded":
        emb.close(discard=True)
        emb.close()
        print("closed", flush=True)
""")


@pytest.mark.parametrize("then", ["restored", "discarded", "left open", "never closed"])
def test_a_cached_embedding_over_a_truncated_file_says_what_close_loses_and_exits_with_no_traceback(
        tmp_path, seed, then):
    """close() of a cached mmap embedding whose file was truncated raised the table's error, named no lost
    rows, could not be got past, and at exit the finalizer printed the same traceback again."""
    done = subprocess.run([sys.executable, "-c", _CLOSE_TRUNCATED, str(tmp_path / "emb"), str(seed), then,
                           os.path.dirname(__file__)], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stdout}{done.stderr}"
    lines = done.stdout.splitlines()
    if then == "never closed":  # nothing told the user: one warning, and no traceback
        assert not lines and "Traceback" not in done.stderr, done.stderr
        assert "could not write back the" in done.stderr and "they are lost" in done.stderr, done.stderr
        return
    assert not done.stderr, done.stderr
    assert lines[0].startswith("refused: close() could not write back the ") and "truncated" in lines[0], lines
    assert "rows of this embedding's device cache" in lines[0] and "close(discard=True)" in lines[0], lines
    assert int(lines[0].split("write back the ")[1].split()[0]) > 0, lines
    assert lines[1:] == {"restored": ["kept"], "discarded": ["closed"], "left open": []}[then], lines


def test_close_discard_drops_the_cached_rows_not_yet_written_back(tmp_path, seed):
    """close(discard=True) of a whole file: the files keep what the last write-back put there, byte for byte."""
    emb, opt, ref, ref_opt, rng = trained(tmp_path / "emb", seed, STEPS, cache_rows=200)
    emb.flush()
    before = _file_bytes(tmp_path / "emb")
    step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng),
         weights=torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)))
    with pytest.raises(ss.OptionError, match="discard"):
        emb.close(discard="False")
    emb.close(discard=True)
    assert _file_bytes(tmp_path / "emb") == before
    assert not np.array_equal(np.load(tmp_path / "emb" / "table.npy"), ref.weight.detach().numpy())


_ADOPTED_TRUNCATED = textwrap.dedent("""
    import os, sys
    import numpy as np, speedswap as ss
    path, seed, mode, view = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((1000, 16), dtype=np.float32)
    np.save(path, rows)
    as_given = np.asarray if view == "plain" else lambda array: array  # np.asarray: a view that is no memmap
    whole = ss.HostTable.adopt(as_given(np.load(path, mmap_mode=mode)), backend="numpy")
    part = ss.HostTable.adopt(as_given(np.load(path, mmap_mode=mode)[100:400]), backend="numpy")  # rows 100-399
    assert whole.storage == part.storage == "mmap"
    offset = os.path.getsize(path) - rows.nbytes
    os.truncate(path, offset + 600 * rows.itemsize * 16)  # rows 600 on are gone
    picked = rng.integers(0, 300, 64)
    assert np.array_equal(part.gather(picked).numpy(), rows[100:400][picked]), "part"
    print("part read", flush=True)
    for call in (lambda: whole.gather([999]), lambda: whole.to_numpy(copy=True), lambda: whole.gather([0])):
        try:
            call()
        except ss.FileFormatError as exc:
            print("refused:", exc, flush=True)
    os.truncate(path, offset + 200 * rows.itemsize * 16)  # now part of the view's rows too
    try:
        part.gather([0])
    except ss.FileFormatError as exc:
        print("refused:", exc, flush=True)
    whole.close()
    part.close()
    print("closed", flush=True)
""")


@pytest.mark.parametrize("view", ["memmap", "plain"])
@pytest.mark.parametrize("mode", ["r+", "r", "c"])
def test_an_adopted_memmap_whose_file_is_truncated_is_refused_with_no_sigbus(tmp_path, seed, mode, view):
    """HostTable.adopt(np.load(path, mmap_mode=...)) checked nothing: truncating the file under it killed the
    next gather with SIGBUS. Now each call checks the file still holds the adopted rows (a view's own only).
    A plain view of a memmap (np.asarray(memmap)) was a "pageable" table and went unchecked: it is one too."""
    done = subprocess.run([sys.executable, "-c", _ADOPTED_TRUNCATED, str(tmp_path / "data.npy"), str(seed), mode,
                           view], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stdout}{done.stderr}"
    lines = done.stdout.splitlines()
    assert lines[0] == "part read" and lines[-1] == "closed" and len(lines) == 6, done.stdout
    for line in lines[1:5]:
        assert line.startswith("refused:") and "truncated after it was mapped" in line, line
    assert "reaches byte" in lines[1] and "data.npy" in lines[1], lines[1]
