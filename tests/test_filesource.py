"""BatchFeeder over files read with pread: same stream as from memory, bounded memory, errors not signals."""

import ast
import contextlib
import ctypes
import errno
import gc
import mmap
import operator
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap import atomic
from speedswap.data import filesource
from speedswap.atomic import drop_cache
from speedswap.data.orders import BlockOrder, SequentialOrder

from test_feeder import assert_child_forked_holding_succeeds, io_threads, reader_threads, run_with_deadline
from test_files import (_SWEEPS_MODEL_CTRL_C, _assert_no_descriptor_left_by_interrupts, _descriptors_left_by_interrupts,
                        _interrupted_at, _opened_in)


def write(path, array):
    np.save(path, array)
    return np.load(path, mmap_mode="r")


def stream(feeder, epochs=1):
    return [[t.numpy().copy() for t in batch] for _ in range(epochs) for batch in feeder]


@pytest.mark.parametrize("order", ["random", "block", "sequential", BlockOrder(block_rows=7, window=3)])
@pytest.mark.parametrize("world_size, drop_last", [(1, False), (1, True), (3, False), (3, True)])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_file_source_gives_the_stream_of_the_same_data_in_memory(tmp_path, rng, order, world_size,
                                                                   drop_last, prefetch):
    n, batch = int(rng.integers(200, 2000)), int(rng.integers(1, 60))
    data = rng.uniform(1, 2, size=(n, 3)).astype(np.float32)
    mapped = write(tmp_path / "x.npy", data)
    labels = write(tmp_path / "y.npy", np.arange(n))
    for rank in range(world_size):
        def make(*sources):
            return ss.BatchFeeder(*sources, batch_size=batch,
                                  order=order, seed=3, device="cpu", rank=rank, world_size=world_size,
                                  drop_last=drop_last, prefetch=prefetch)
        # Two epochs each, so the order of epoch 1 (a new permutation) is compared too.
        from_files = stream(make(labels, mapped), epochs=2)
        from_memory = stream(make(np.arange(n), data), epochs=2)
        assert len(from_files) == len(from_memory) > 0
        for (ids, rows), (ids0, rows0) in zip(from_files, from_memory):
            np.testing.assert_array_equal(ids, ids0)  # the same order, batch by batch
            np.testing.assert_array_equal(rows, data[ids])


def test_a_mapped_data_gadget_is_read_from_its_file_and_sees_put_rows(tmp_path, rng):
    data = rng.uniform(1, 2, size=(500, 2, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", data)
    gadget = ss.DataGadget(str(tmp_path / "x.npy"), mmap=True, backend="numpy")
    assert gadget.storage == "mmap"
    new = -data[[3, 7]]
    gadget.put(new, np.array([3, 7]))  # writes through to the file ...
    gadget.flush()                     # ... and is on disk after flush
    data[[3, 7]] = new
    with open(tmp_path / "x.npy", "rb") as f:  # an independent reader of the file
        f.seek(np.load(tmp_path / "x.npy", mmap_mode="r").offset)
        np.testing.assert_array_equal(np.frombuffer(f.read(), np.float32).reshape(data.shape), data)
    feeder = ss.BatchFeeder(np.arange(500), gadget, batch_size=64, order=BlockOrder(16, 2), device="cpu")
    for ids, rows in feeder:
        np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.parametrize("order", [BlockOrder(block_rows=256, window=4), "random"])
def test_resident_memory_stays_within_the_budget_for_a_file_four_times_larger(tmp_path, order, rng):
    row_bytes, batch, prefetch = 4096, 256, 2
    window_bytes = 256 * 4 * row_bytes                            # 4 MiB
    budget = 2 * window_bytes + (prefetch + 2) * batch * row_bytes + (48 << 20)  # + 48 MiB for the allocator
    rows = 4 * budget // row_bytes
    x = ss.data.create_npy(tmp_path / "x.npy", (rows, row_bytes // 4), np.float32,
                           lambda lo, hi: rng.random((hi - lo, row_bytes // 4), dtype=np.float32),
                           progress=False)
    del x
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    feeder = ss.BatchFeeder(mapped, batch_size=batch, order=order, device="cpu", prefetch=prefetch)
    index_bytes = 4 * 8 * rows  # the epoch's order and the reader's per-row arrays
    before, peak, total = rss_bytes(), 0, 0.0
    for (x,) in feeder:
        total += float(x[:, 0].sum())  # use the batch, as training would
        peak = max(peak, rss_bytes())
    assert peak - before <= budget + index_bytes, (
        f"RSS grew by {(peak - before) / 2**20:.0f} MiB over a {rows * row_bytes / 2**20:.0f} MiB file "
        f"(budget {(budget + index_bytes) / 2**20:.0f} MiB)")


def cached_fraction(path):
    """The share of ``path``'s pages in the page cache (mincore over a fresh map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(np.frombuffer(mapped, np.uint8).ctypes.data, size, vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec) / pages


@pytest.mark.parametrize("order", ["block", "sequential"])
@pytest.mark.parametrize("batch_size", [2**63, 2**70])
def test_a_batch_size_past_int64_over_a_file_gives_the_whole_epoch_as_from_memory(tmp_path, rng, order,
                                                                                   batch_size):
    """A batch_size larger than the epoch makes one batch of it; over a file read in windows of
    blocks one of 2**63 or more raised numpy's IndexError (its arange cannot step past int64)."""
    data = rng.standard_normal((100, 3)).astype(np.float32)
    mapped = write(tmp_path / "x.npy", data)
    from_file = stream(ss.BatchFeeder(mapped, batch_size=batch_size, order=order, seed=3, device="cpu"), 2)
    in_memory = stream(ss.BatchFeeder(data, batch_size=batch_size, order=order, seed=3, device="cpu"), 2)
    assert len(from_file) == 2
    for (got,), (expected,) in zip(from_file, in_memory):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.sort(from_file[0][0], axis=0), np.sort(data, axis=0))


@pytest.mark.parametrize("order", ["block", "random"])
def test_drop_behind_keeps_an_epoch_out_of_the_page_cache(tmp_path, order, rng):
    mapped = write(tmp_path / "x.npy", rng.random((8192, 512), dtype=np.float32))
    for drop_behind in (False, True):
        drop_cache(tmp_path / "x.npy")
        assert cached_fraction(tmp_path / "x.npy") < 0.05  # a cold start
        feeder = ss.BatchFeeder(mapped, batch_size=512, order=order, device="cpu", drop_behind=drop_behind)
        assert sum(len(x) for (x,) in feeder) == 8192
        fraction = cached_fraction(tmp_path / "x.npy")
        assert fraction < 0.05 if drop_behind else fraction > 0.9, (drop_behind, fraction)


def test_drop_cache_refuses_a_path_that_is_no_file_and_only_warns_when_the_advice_is_not_taken(
        tmp_path, rng, monkeypatch):
    """drop_cache (the examples' and benchmarks' --cold) raised the raw OSError of a missing file or of
    a file system that cannot drop pages, and returned quietly for a directory, which has none."""
    with pytest.raises(ss.MissingFileError, match="check the path"):
        drop_cache(tmp_path / "missing.npy")
    with pytest.raises(ss.PathError, match="is a directory"):
        drop_cache(tmp_path)
    path = tmp_path / "x.npy"
    np.save(path, rng.standard_normal((64, 4)).astype(np.float32))

    def unsupported(fd, offset, length, advice):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(os, "posix_fadvise", unsupported)
    with pytest.warns(RuntimeWarning, match="could not be dropped from the page cache.*Invalid argument"):
        drop_cache(path)  # only advice: the file reads the same, perhaps from memory
    assert fds_on(path) == 0


TRUNCATE = textwrap.dedent("""
    import os, sys, numpy as np, speedswap as ss
    from speedswap.data.orders import BlockOrder, SequentialOrder
    # Blocks far smaller than the file, so most of it is still unread when it is cut.
    orders = {"block": BlockOrder(100, 2), "sequential": SequentialOrder(100, 2), "random": "random"}
    for name, order in orders.items():
        path = os.path.join(sys.argv[1], name + ".npy")
        np.save(path, np.ones((20000, 64), np.float32))
        feeder = ss.BatchFeeder(np.load(path, mmap_mode="r"), batch_size=100, order=order, device="cpu")
        batches = iter(feeder)
        for _ in range(3):
            next(batches)
        os.truncate(path, os.path.getsize(path) // 10)
        try:
            for _ in batches:
                pass
        except ss.FileFormatError as exc:
            print(name, "raised:", exc)
    """)


def test_a_file_truncated_under_a_running_feeder_raises_instead_of_sigbus(tmp_path):
    # In a subprocess: a SIGBUS would kill pytest itself.
    done = subprocess.run([sys.executable, "-c", TRUNCATE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stderr}"
    for order in ("block", "sequential", "random"):
        assert f"{order} raised:" in done.stdout, done.stdout + done.stderr
    assert "truncated" in done.stdout


def _rewrite_rows_in_place(path, rows):
    """Write ``rows`` over the data of the ``.npy`` at ``path``: same file, same size (another writer)."""
    offset = np.load(path, mmap_mode="r").offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(rows.tobytes())


@pytest.mark.parametrize("order", ["random", BlockOrder(block_rows=64, window=2)])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_file_rewritten_in_place_under_a_running_loop_raises_instead_of_feeding_a_mix(tmp_path, rng, order,
                                                                                      prefetch):
    # Same inode, same size: the loop read old rows, then the new ones, and said nothing.
    path = tmp_path / "x.npy"
    n = 4096
    data = rng.standard_normal((n, 4)).astype(np.float32)
    source = write(path, data)
    # A dataset written an hour ago: a rewrite within the file system's timestamp tick of the
    # previous write would keep the modification time (see BatchFeeder's docstring).
    os.utime(path, ns=(time.time_ns() - 3600 * 10**9,) * 2)
    feeder = ss.BatchFeeder(np.arange(n), source, batch_size=32, order=order, device="cpu", prefetch=prefetch)
    delivered = []
    with pytest.raises(ss.FileFormatError, match="changed while the feeder read it"):
        for ids, rows in feeder:
            delivered.append((ids.numpy(), rows.numpy().copy()))
            if len(delivered) == 3:
                _rewrite_rows_in_place(path, -data)
    assert len(delivered) < len(feeder)
    for ids, rows in delivered:  # every batch handed over holds the file's rows from before the change
        np.testing.assert_array_equal(rows, data[ids])
    rest = [(ids.numpy(), rows.numpy()) for ids, rows in feeder]  # a new loop reads the file as it is now
    assert sum(len(ids) for ids, _ in delivered + rest) == n
    for ids, rows in rest:
        np.testing.assert_array_equal(rows, -data[ids])


def test_rows_appended_under_a_running_loop_raise_saying_the_feeder_keeps_the_rows_it_was_built_with(
        tmp_path, rng):
    # The error said "iterate the feeder again to go on with the file as it is now", and a user who
    # appended rows (a dataset growing over time) expected them in the next loop: they never come.
    path = tmp_path / "x.npy"
    n = 4096
    data = rng.standard_normal((n, 4)).astype(np.float32)
    source = write(path, data)
    os.utime(path, ns=(time.time_ns() - 3600 * 10**9,) * 2)  # written long ago (see the test above)
    feeder = ss.BatchFeeder(np.arange(n), source, batch_size=32, order="random", device="cpu")
    delivered = 0
    with pytest.raises(ss.FileFormatError, match=r"reads the 4,096 rows it was built with: rows appended "
                                                 r"to the file since are seen only by a new feeder"):
        for ids, rows in feeder:
            np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
            delivered += len(ids)
            if delivered == 96:
                with open(path, "ab") as f:
                    f.write(rng.standard_normal((100, 4)).astype(np.float32).tobytes())
    rest = [(ids.numpy(), rows.numpy()) for ids, rows in feeder]  # what the message says: the old rows
    assert delivered + sum(len(ids) for ids, _ in rest) == n
    for ids, rows in rest:
        np.testing.assert_array_equal(rows, data[ids])


@pytest.mark.parametrize("order", ["random", BlockOrder(block_rows=64, window=2)])
def test_a_rewrite_in_the_timestamp_tick_of_the_write_before_the_loop_is_caught(tmp_path, rng, monkeypatch, order):
    """Kernels before 6.13 stamp a write with the coarse clock (a tick of 1 to 10 ms): a file written
    just before a loop opened it and rewritten in place in that tick kept its size and modification
    time, and the loop fed old and new rows together. (Newer kernels stamp the first write after a
    stat finely.) Simulated here: modification times rounded down to ticks of 50 ms."""
    tick = 50_000_000
    # The simulated ticks round the kernel's own stamps, which come from its coarse clock (up to a
    # jiffy, the _TICK_NS the reader allows for, behind the time): the wait must cover both.
    monkeypatch.setattr(filesource, "_TICK_NS", tick + filesource._TICK_NS)
    monkeypatch.setattr(filesource, "_version", lambda stat: (stat.st_size, stat.st_mtime_ns - stat.st_mtime_ns % tick))
    path = tmp_path / "x.npy"
    n = 4096
    data = rng.standard_normal((n, 4)).astype(np.float32)
    time.sleep((tick - time.time_ns() % tick) / 1e9)  # the write starts a tick
    source = write(path, data)
    feeder = ss.BatchFeeder(np.arange(n), source, batch_size=32, order=order, device="cpu")
    delivered = []
    with pytest.raises(ss.FileFormatError, match="changed while the feeder read it"):
        for ids, rows in feeder:
            delivered.append((ids.numpy(), rows.numpy().copy()))
            if len(delivered) == 1:
                _rewrite_rows_in_place(path, -data)
    for ids, rows in delivered:  # every batch handed over holds the rows from before the rewrite
        np.testing.assert_array_equal(rows, data[ids])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loop_waiting_for_read_ahead_wakes_up_when_another_thread_moves_the_feeder(tmp_path, monkeypatch,
                                                                                    prefetch):
    mapped = write(tmp_path / "x.npy", np.arange(4000))
    feeder = ss.BatchFeeder(mapped, batch_size=100, order=BlockOrder(block_rows=100, window=2),
                            device="cpu", prefetch=prefetch)
    real = os.preadv
    reading = threading.Event()

    def slow(*args):  # a slow disk: the loop is waiting for reads when set_epoch comes
        reading.set()
        time.sleep(0.2)
        return real(*args)

    monkeypatch.setattr(os, "preadv", slow)
    outcome = {}
    waiter = threading.Thread(target=lambda: outcome.update(run_with_deadline(lambda: list(feeder), seconds=60)))
    waiter.start()
    # Not a sleep: on a loaded machine the loop may not have begun by then, and it reads epoch 1 whole.
    assert reading.wait(60)
    feeder.set_epoch(1)  # from this thread, while the loop waits on the other
    waiter.join()
    assert isinstance(outcome.get("error"), ss.StateError), outcome
    monkeypatch.setattr(os, "preadv", real)
    assert reader_threads() == [] and io_threads() == []
    assert feeder.epoch == 1 and len(list(feeder)) == 40


def test_a_reader_closed_between_its_closed_check_and_a_submit_raises_state_error(tmp_path, monkeypatch):
    import concurrent.futures
    feeder = ss.BatchFeeder(write(tmp_path / "x.npy", np.arange(1000)), batch_size=64, order="random",
                            device="cpu", prefetch=0)
    real = concurrent.futures.ThreadPoolExecutor.submit

    def closed_meanwhile(pool, *args):  # another thread's set_epoch, at the worst moment
        monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", real)
        feeder.set_epoch(0)
        return real(pool, *args)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", closed_meanwhile)
    with pytest.raises(ss.StateError, match="closed by another thread"):
        next(iter(feeder))
    assert len(next(iter(feeder))[0]) == 64


@pytest.mark.parametrize("order", ["random", BlockOrder(block_rows=64, window=2)])
@pytest.mark.parametrize("reuse_fd", [False, True])
def test_a_reader_closed_while_it_checks_the_files_for_changes_raises_state_error(tmp_path, monkeypatch,
                                                                                   order, reuse_fd):
    path = write(tmp_path / "x.npy", np.arange(1000))
    feeder = ss.BatchFeeder(path, batch_size=64, order=order, device="cpu", prefetch=0)
    real = filesource._version
    other = []

    def closed_meanwhile(stat):  # another thread's set_epoch, after the batch's reads, before the check
        monkeypatch.setattr(filesource, "_version", real)
        feeder.set_epoch(0)
        if reuse_fd:  # the closed descriptor's number now names another file, with another version
            other.append(open(tmp_path / "other", "wb"))
        return real(os.fstat(-1) if not reuse_fd else os.fstat(other[-1].fileno()))

    loop = iter(feeder)
    next(loop)
    monkeypatch.setattr(filesource, "_version", closed_meanwhile)
    with pytest.raises(ss.StateError, match="closed by another thread"):
        next(loop)
    for f in other:
        f.close()
    assert len(next(iter(feeder))[0]) == 64


@pytest.mark.parametrize("source", ["memory", "file"])
def test_a_batch_whose_transform_raised_comes_again_on_resume(tmp_path, source):
    data = np.arange(100) if source == "memory" else write(tmp_path / "x.npy", np.arange(100))
    calls = []

    def transform(batch):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("bad batch")
        return batch

    feeder = ss.BatchFeeder(data, batch_size=10, order="random", seed=2, device="cpu", transform=transform)
    first = []
    with pytest.raises(ValueError, match="bad batch"):
        for (ids,) in feeder:
            first.append(ids.numpy())
    assert len(first) == 2 and feeder.state_dict()["batch"] == 2
    resumed = ss.BatchFeeder(data, batch_size=10, order="random", seed=2, device="cpu")
    resumed.load_state_dict(feeder.state_dict())
    rest = [ids.numpy() for (ids,) in resumed]
    np.testing.assert_array_equal(np.sort(np.concatenate(first + rest)), np.arange(100))


@pytest.mark.parametrize("n, batch, world_size", [(10, 11, 1), (10, 3, 4), (5, 2, 8)])
def test_drop_last_with_a_batch_larger_than_the_data_raises(n, batch, world_size):
    with pytest.raises(ss.OptionError, match="empty.*batch_size <="):
        ss.BatchFeeder(np.arange(n), batch_size=batch, drop_last=True, rank=0, world_size=world_size,
                       device="cpu")
    assert len(ss.BatchFeeder(np.arange(n), batch_size=batch, drop_last=False, rank=0,
                              world_size=world_size, device="cpu")) > 0


def test_create_npy_fills_chunk_by_chunk_and_leaves_nothing_on_failure(tmp_path, rng):
    data = rng.uniform(1, 2, size=(1000, 5)).astype(np.float32)
    x = ss.data.create_npy(tmp_path / "x.npy", data.shape, np.float32, lambda lo, hi: data[lo:hi],
                           chunk_bytes=999, progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), data)
    x[0] = 7.0  # the returned map is writable and writes reach the file
    x.flush()
    assert np.load(tmp_path / "x.npy")[0].tolist() == [7.0] * 5
    with pytest.raises(ss.ShapeError, match=r"fill\(0, 10\) returned shape \(10, 4\)"):
        ss.data.create_npy(tmp_path / "x.npy", (20, 5), np.float32,
                           lambda lo, hi: np.ones((hi - lo, 4), np.float32), chunk_bytes=200)
    assert np.load(tmp_path / "x.npy")[0].tolist() == [7.0] * 5  # the previous file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]
    empty = ss.data.create_npy(tmp_path / "e.npy", (3, 2), np.int64)
    empty[:] = [[1, 2], [3, 4], [5, 6]]
    empty.flush()
    assert np.load(tmp_path / "e.npy").tolist() == [[1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("shape", [(-1, 3), (4, -3), (0, 3), (2.5, 3), "10", (True, 3)])
@pytest.mark.parametrize("filled", [False, True])
def test_create_npy_refuses_a_bad_shape_before_touching_the_existing_file(tmp_path, shape, filled):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    fill = (lambda lo, hi: np.ones((hi - lo, 3), np.float32)) if filled else None
    with pytest.raises(ss.ShapeError, match="negative|no rows|int"):
        ss.data.create_npy(path, shape, np.float32, fill, progress=False)
    np.testing.assert_array_equal(np.load(path), np.arange(12, dtype=np.float32).reshape(4, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


def test_create_npy_takes_an_int_shape_as_numpy_does(tmp_path):
    x = ss.data.create_npy(tmp_path / "x.npy", 10, np.int64, lambda lo, hi: np.arange(lo, hi), progress=False)
    assert x.shape == (10,)
    assert np.load(tmp_path / "x.npy").tolist() == list(range(10))
    assert ss.data.create_npy(tmp_path / "y.npy", np.int64(3), np.float32).shape == (3,)


@pytest.mark.parametrize("dtype, values, became", [
    (np.int8, np.array([100, 200, 300]), "200.*became -56"),                      # would wrap
    (np.float16, np.array([0.5, 1e5, 2.0]), "100000.0.*became inf"),             # would overflow
    (np.float32, np.array([1, 2**24 + 1, 3]), "16777217.*became 16777216.0"),    # an int float32 cannot hold
])
def test_create_npy_refuses_values_its_dtype_cannot_hold(tmp_path, dtype, values, became):
    with pytest.raises(ss.DTypeError, match=became):
        ss.data.create_npy(tmp_path / "x.npy", (3,), dtype, lambda lo, hi: values[lo:hi], progress=False)
    assert list(tmp_path.iterdir()) == []
    # Rounding a float64 into float32 is what a float32 file is for.
    rounded = ss.data.create_npy(tmp_path / "y.npy", (3,), np.float32,
                                 lambda lo, hi: np.array([0.1, 0.2, 0.3])[lo:hi], progress=False)
    np.testing.assert_array_equal(rounded, np.array([0.1, 0.2, 0.3], dtype=np.float32))


@pytest.mark.parametrize("order", ["random", "block"])
def test_a_mapped_source_whose_file_is_replaced_or_removed_still_gives_its_own_rows(tmp_path, rng, order):
    path = tmp_path / "x.npy"
    data = rng.standard_normal((64, 3)).astype(np.float32)
    np.save(path, data)
    source = np.load(path, mmap_mode="r")
    feeder = ss.BatchFeeder(source, batch_size=16, order=order, device="cpu")
    first = torch.cat([x for (x,) in feeder])
    # Saves replace by rename: the map keeps the old file, the path names a new one.
    ss.data.create_npy(path, data.shape, np.float32, lambda lo, hi: -data[lo:hi], progress=False)
    feeder.set_epoch(0)
    with pytest.warns(RuntimeWarning, match="replaced or removed"):
        again = torch.cat([x for (x,) in feeder])
    assert torch.equal(again, first)
    np.testing.assert_array_equal(np.sort(again.numpy(), axis=0), np.sort(data, axis=0))
    path.unlink()
    feeder.set_epoch(0)
    assert torch.equal(torch.cat([x for (x,) in feeder]), first)


@pytest.mark.parametrize("change", ["replaced", "removed"])
@pytest.mark.parametrize("kind", ["memmap", "gadget"])
def test_a_source_whose_path_changed_before_the_feeder_was_built_gives_its_own_rows(tmp_path, rng, change,
                                                                                   kind):
    path = tmp_path / "x.npy"
    data = rng.standard_normal((64, 3)).astype(np.float32)
    np.save(path, data)
    source = (np.load(path, mmap_mode="r") if kind == "memmap"
              else ss.DataGadget(str(path), mmap=True, backend="numpy").read())
    if change == "replaced":  # by rename, as saves do; another dtype, so pread would read garbage
        np.save(tmp_path / "new.npy", np.arange(192, dtype=np.int32).reshape(64, 3))
        os.replace(tmp_path / "new.npy", path)
    else:
        path.unlink()
    feeder = ss.BatchFeeder(source, batch_size=16, order="sequential", device="cpu")
    with pytest.warns(RuntimeWarning, match="replaced or removed"):
        np.testing.assert_array_equal(torch.cat([x for (x,) in feeder]).numpy(), data)


def test_a_file_whose_map_cannot_be_confirmed_is_read_through_the_map(tmp_path, rng, monkeypatch):
    import speedswap.data.filesource as filesource
    data = rng.standard_normal((64, 3)).astype(np.float32)
    confirmed = ss.BatchFeeder(write(tmp_path / "x.npy", data), batch_size=16, order="sequential", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(torch.cat([x for (x,) in confirmed]).numpy(), data)
    assert confirmed._files  # its file is read with pread
    monkeypatch.setattr(filesource, "mapped_identity", lambda address: None)  # as off Linux
    unknown = ss.BatchFeeder(np.load(tmp_path / "x.npy", mmap_mode="r"), batch_size=16, order="sequential",
                             device="cpu")
    with pytest.warns(RuntimeWarning, match="cannot show which file"):
        np.testing.assert_array_equal(torch.cat([x for (x,) in unknown]).numpy(), data)
    assert not unknown._files


def fds_on(path):
    return sum(os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(path)
               for fd in os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_a_window_reader_whose_arena_cannot_be_allocated_closes_its_files(tmp_path, rng, monkeypatch):
    import speedswap.data.filesource as filesource
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(write(path, rng.standard_normal((64, 3)).astype(np.float32)), batch_size=16,
                            order="sequential", device="cpu", prefetch=0)

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    held = fds_on(path)  # Python's mmap keeps a descriptor of its own
    monkeypatch.setattr(filesource.torch, "empty", no_memory)
    closed = []
    monkeypatch.setattr(filesource.concurrent.futures.ThreadPoolExecutor, "shutdown",
                        lambda pool, **kwargs: closed.append(pool))
    for _ in range(3):
        with pytest.raises(RuntimeError, match="allocate"):
            next(iter(feeder))
    assert fds_on(path) == held
    assert len(closed) == 3  # each failed reader's pool was shut down


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
@pytest.mark.parametrize("order", ["random", "block"])
def test_a_loop_interrupted_while_its_next_order_draw_starts_closes_its_files(tmp_path, rng, monkeypatch, order):
    import speedswap.data.feeder as feeder_module
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(write(path, rng.standard_normal((64, 3)).astype(np.float32)), batch_size=16,
                            order=order, device="cpu", prefetch=0)
    held = fds_on(path)  # Python's mmap keeps a descriptor of its own

    def interrupted(*args):  # Ctrl-C while the draw's thread starts (a thread that cannot start draws here)
        raise KeyboardInterrupt

    monkeypatch.setattr(feeder_module, "in_background", interrupted)
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            next(iter(feeder))
    assert fds_on(path) == held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_a_loop_interrupted_while_its_files_settle_closes_them(tmp_path, rng, monkeypatch):
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(write(path, rng.standard_normal((64, 3)).astype(np.float32)), batch_size=16,
                            device="cpu", prefetch=0)
    held = fds_on(path)

    def interrupted(versions):  # Ctrl-C in the wait for a file written in the last timestamp tick
        raise KeyboardInterrupt

    monkeypatch.setattr(filesource, "_settle", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(iter(feeder))
    assert fds_on(path) == held


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
def test_a_file_reader_closed_by_two_threads_returns_to_each_once_its_files_are_closed(tmp_path, rng):
    """set_epoch on one thread and the loop's own cleanup on another both close the reader: the
    second close must wait for the first, not return with the files open (nor close them twice,
    where a descriptor number may already name a file opened since)."""
    path = tmp_path / "x.npy"
    write(path, rng.standard_normal((64, 3)).astype(np.float32))
    rows = filesource.FileRows(str(path), ss.files.read_npy_header(path).offset, 64, (3,), torch.float32,
                               ss.files.identity(os.stat(path)))
    held = fds_on(path)
    reader = filesource.RowReader([rows])
    shutdown, entered, release = reader._pool.shutdown, threading.Event(), threading.Event()

    def slow_shutdown(**kwargs):  # as a pool waiting for a read in flight
        entered.set()
        release.wait(10)
        shutdown(**kwargs)

    reader._pool.shutdown = slow_shutdown
    first = threading.Thread(target=reader.close)
    first.start()
    assert entered.wait(10)
    open_after_close = []
    second = threading.Thread(target=lambda: (reader.close(), open_after_close.append(fds_on(path) - held)))
    second.start()
    second.join(0.5)  # without waiting for the first close, the second returns at once
    release.set()
    first.join(10)
    second.join(10)
    assert open_after_close == [0]


@pytest.mark.parametrize("second, options, error, match", [  # second: None for 20 labels
    ("21 labels", {}, ss.ShapeError, "same number of rows"),
    ("a list", {}, ss.DTypeError, "is a list"),
    ("a path", {}, ss.DTypeError, "is a path"),
    ("a closed gadget", {}, ss.StateError, "closed"),
    (None, dict(order="shuffle"), ss.OptionError, "unknown order"),
    (None, dict(rank=2, world_size=2), ss.OptionError, "outside the world"),
    (None, dict(world_size=0), ss.OptionError, "world_size"),
    (None, dict(world_size=2), ss.OptionError, "without rank"),
    (None, dict(drop_last="no"), ss.OptionError, "drop_last"),
    (None, dict(drop_last=True, batch_size=21), ss.OptionError, "leaves every epoch empty"),
    (None, dict(device="tpu"), ss.OptionError, "device"),
    (None, dict(backend="tpu"), ss.OptionError, "unknown backend"),
    (None, dict(backend="numpy", device="cuda"), ss.OptionError, "runs on the CPU"),
    (None, dict(prefetch=-1), ss.OptionError, "prefetch"),
    (None, dict(prefetch=10**15), ss.OptionError, "half the RAM"),
    (None, dict(batch_size=0), ss.OptionError, "batch_size"),
    (None, dict(seed=-1), ss.OptionError, "seed"),
    (None, dict(transform=3), ss.OptionError, "callable"),
    (None, dict(drop_behind=1), ss.OptionError, "drop_behind"),
    (None, dict(lookahead="yes"), ss.OptionError, "lookahead"),
    (None, dict(shuffle=True), ss.OptionError, "no option 'shuffle'"),
])
def test_a_feeder_refused_for_a_bad_argument_has_not_read_its_data_gadgets(tmp_path, rng, second, options,
                                                                            error, match):
    """A DataGadget built from a path reads its rows when the feeder takes them: into RAM, or pinned,
    a file larger than RAM included. Only the row counts were compared before; every other argument
    was refused after the read (DataGadget.dtype, which the feeder needs, read the table)."""
    path = tmp_path / "x.npy"
    np.save(path, rng.standard_normal((20, 2)).astype(np.float32))
    gadget = ss.DataGadget(str(path), storage="pinned", backend="numpy")
    other = {"21 labels": rng.standard_normal(21), "a list": rng.standard_normal(20).tolist(), "a path": str(path),
             "a closed gadget": ss.DataGadget(str(path), backend="numpy"), None: rng.standard_normal(20)}[second]
    if second == "a closed gadget":
        other.close()
    with open(path, "r+b") as f:  # from now on a read raises FileFormatError, not the argument's error
        f.truncate(os.path.getsize(path) - 8)
    with pytest.raises(error, match=match):
        ss.BatchFeeder(gadget, other, **{"batch_size": 4, "device": "cpu", **options})
    assert "not read yet" in repr(gadget)
    np.save(path, rng.standard_normal((20, 2)).astype(np.float32))
    ss.BatchFeeder(gadget, rng.standard_normal(20), batch_size=4, device="cpu")  # good arguments read it
    assert "storage='pinned'" in repr(gadget)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
@pytest.mark.parametrize("closer", ["starts", "cannot start"])
@pytest.mark.parametrize("on", ["read-ahead thread", "I/O thread"])
def test_a_loop_collected_on_a_thread_of_its_own_readers_closes_its_files(tmp_path, rng, monkeypatch, on,
                                                                          closer):
    """A loop left in a reference cycle is finalised on whichever thread the collector runs, its
    readers' threads too (they allocate for every batch). Closing the readers there waited for
    that thread itself: the read-ahead thread joined itself (RuntimeError, the files left open),
    an I/O thread joined the read-ahead thread waiting for its read (a deadlock). The closing goes
    to a thread of its own; where none can start (the thread limit, interpreter shutdown), the
    files were left open."""
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(write(path, rng.standard_normal((64, 3)).astype(np.float32)), batch_size=8,
                            device="cpu", prefetch=4)
    held = fds_on(path)
    name, nth = ("read", 3) if on == "read-ahead thread" else ("_rows", 20)  # batch 2, read ahead
    method, go, collected, calls = getattr(filesource.RowReader, name), threading.Event(), threading.Event(), []

    def read_then_collect(self, *args):
        calls.append(args)
        if len(calls) == nth:
            go.wait(10)
            gc.collect()  # the collector runs on this thread
            collected.set()
        return method(self, *args)

    monkeypatch.setattr(filesource.RowReader, name, read_then_collect)
    if closer == "cannot start":
        start = threading.Thread.start

        def refuse_the_closer(thread):
            if thread.name == "speedswap-feeder-close":
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", refuse_the_closer)
    gc.disable()  # only the collection above finalises the loop
    try:
        loop = iter(feeder)
        next(loop)
        cycle = [loop]
        cycle.append(cycle)
        del loop, cycle
        go.set()
        assert collected.wait(10)
    finally:
        gc.enable()
    for thread in threading.enumerate():  # the closing was handed to a thread of its own, or ends them
        if thread.name in ("speedswap-feeder-close", "speedswap-feeder-reader"):
            thread.join(10)
    assert fds_on(path) == held
    assert reader_threads() == []


def refuse_threads(monkeypatch, prefix):
    """Make ``threading.Thread.start`` fail, as at the thread limit, for threads named ``prefix...`` only."""
    start = threading.Thread.start

    def refused(thread):
        if thread.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)


@pytest.mark.parametrize("order", ["random", "block"])
def test_a_ctrl_c_during_the_next_order_draw_on_the_loops_own_thread_is_raised_at_once(rng, monkeypatch, order):
    """Where the draw's thread cannot start, the next epoch's order is drawn on the loop's thread, and
    a Ctrl-C there is aimed at the loop. in_background kept it in the future instead, like the
    thread's own errors: the last epoch's loop ran to its end and the Ctrl-C was lost."""
    n = int(rng.integers(50, 200))
    feeder = ss.BatchFeeder(rng.standard_normal((n, 3)).astype(np.float32), batch_size=16, order=order,
                            seed=int(rng.integers(1 << 30)), device="cpu", prefetch=0)
    host_ids = feeder._host_ids

    def interrupted_next_draw(epoch):  # Ctrl-C arriving while the next epoch's order is drawn
        if epoch == 1:
            raise KeyboardInterrupt
        return host_ids(epoch)

    monkeypatch.setattr(feeder, "_host_ids", interrupted_next_draw)
    refuse_threads(monkeypatch, "speedswap-in-background")
    with pytest.raises(KeyboardInterrupt):
        list(feeder)
    assert feeder.state_dict()["epoch"] == 0  # no batch was handed over: the epoch resumes whole


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
@pytest.mark.parametrize("refused", ["speedswap-in-background", "speedswap-feeder-reader"])
@pytest.mark.parametrize("order", ["random", "block"])
def test_a_loop_whose_order_draw_or_read_ahead_thread_cannot_start_reads_on_its_own_thread(
        tmp_path, rng, monkeypatch, refused, order):
    """Where no thread can start (the thread limit, interpreter shutdown), drawing the next epoch's
    order on a thread and reading ahead on one raised a raw RuntimeError("can't start new thread")
    before the first batch. Both are done on the loop's thread instead: the same stream."""
    n = int(rng.integers(100, 300))
    data = rng.uniform(1, 2, size=(n, 3)).astype(np.float32)
    path = tmp_path / "x.npy"
    mapped = write(path, data)
    held = fds_on(path)

    def make(*sources):
        return ss.BatchFeeder(*sources, batch_size=16, order=order, seed=5, device="cpu", prefetch=2)

    expected = stream(make(np.arange(n), data), epochs=2)
    refuse_threads(monkeypatch, refused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = stream(make(np.arange(n), mapped), epochs=2)
    assert len(got) == len(expected) > 0
    for (ids, rows), (ids0, rows0) in zip(got, expected):
        np.testing.assert_array_equal(ids, ids0)
        np.testing.assert_array_equal(rows, rows0)
    said = [str(w.message) for w in caught if "read-ahead" in str(w.message)]
    assert len(said) == (2 if refused == "speedswap-feeder-reader" else 0)  # once per loop, for a slower loop
    assert fds_on(path) == held and reader_threads() == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc")
@pytest.mark.parametrize("order", ["random", "block"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loop_whose_io_threads_cannot_start_raises_thread_start_error_and_resumes_later(
        tmp_path, rng, monkeypatch, order, prefetch):
    """File sources are read on an I/O thread pool; where none of its threads could start, the loop
    raised a raw RuntimeError("can't start new thread"). It raises ThreadStartError saying what to
    do, with the feeder where it was and the files closed, and iterating again once threads can
    start gives the whole stream."""
    n = int(rng.integers(100, 300))
    data = rng.uniform(1, 2, size=(n, 3)).astype(np.float32)
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(np.arange(n), write(path, data), batch_size=16, order=order, seed=5,
                            device="cpu", prefetch=prefetch)
    held, before = fds_on(path), feeder.state_dict()
    with monkeypatch.context() as patch:
        refuse_threads(patch, "speedswap-io")
        with pytest.raises(ss.ThreadStartError, match="thread limit") as raised:
            next(iter(feeder))
    assert isinstance(raised.value, RuntimeError)  # what code catching the raw error caught
    assert feeder.state_dict() == before
    assert fds_on(path) == held and reader_threads() == [] and io_threads() == []
    for ids, rows in stream(feeder):
        np.testing.assert_array_equal(rows, data[ids])
    assert feeder.state_dict()["epoch"] == 1


@pytest.mark.parametrize("change", ["load", "close"])
def test_a_feeder_over_a_data_gadget_reloaded_or_closed_refuses_to_serve_the_old_rows(tmp_path, rng, change):
    np.save(tmp_path / "a.npy", rng.standard_normal((20, 2)).astype(np.float32))
    np.save(tmp_path / "b.npy", rng.standard_normal((20, 2)).astype(np.float32))
    gadget = ss.DataGadget(str(tmp_path / "a.npy"), backend="numpy")
    feeder = ss.BatchFeeder(gadget, batch_size=5, device="cpu")
    assert len(list(feeder)) == 4
    gadget.load(str(tmp_path / "b.npy")) if change == "load" else gadget.close()
    with pytest.raises(ss.StateError, match="closed"):
        next(iter(feeder))
    table = ss.HostTable.from_numpy(np.ones((6, 2), np.float32), backend="numpy")
    over_table = ss.BatchFeeder(table, batch_size=3, device="cpu")
    table.close()
    with pytest.raises(ss.StateError, match="closed or reloaded"):
        next(iter(over_table))


@pytest.mark.parametrize("change", ["load", "close"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_running_loop_stops_when_its_data_gadget_is_reloaded_or_closed(tmp_path, rng, change, prefetch):
    """Refused at the start of a loop, a reload or close in the middle of one went unseen: the loop
    fed the rest of the epoch from the old rows (of a closed gadget too)."""
    old, new = (rng.standard_normal((40, 2)).astype(np.float32) for _ in range(2))
    np.save(tmp_path / "new.npy", new)
    gadget = ss.DataGadget(old, backend="numpy")
    feeder = ss.BatchFeeder(np.arange(40), gadget, batch_size=5, device="cpu", prefetch=prefetch)
    delivered = []
    with pytest.raises(ss.StateError, match="closed"):
        for ids, rows in feeder:
            delivered.append((ids.numpy(), rows.numpy().copy()))
            if len(delivered) == 2:
                gadget.load(str(tmp_path / "new.npy")) if change == "load" else gadget.close()
    assert len(delivered) == 2
    for ids, rows in delivered:
        np.testing.assert_array_equal(rows, old[ids])


@pytest.mark.parametrize("order", [BlockOrder(block_rows=40, window=2), SequentialOrder(block_rows=40, window=2)])
def test_ranks_split_a_windowed_epoch_into_runs_and_each_reads_its_share_of_the_file(tmp_path, rng, order,
                                                                                     monkeypatch):
    world, n = 4, 4000
    data = rng.uniform(1, 2, size=(n, 16)).astype(np.float32)
    mapped = write(tmp_path / "x.npy", data)
    read = {"bytes": 0}
    preadv = os.preadv

    def counting(fd, buffers, offset):
        got = preadv(fd, buffers, offset)
        read["bytes"] += got
        return got

    monkeypatch.setattr(os, "preadv", counting)
    seen = []
    for rank in range(world):
        read["bytes"] = 0
        feeder = ss.BatchFeeder(np.arange(n), mapped, batch_size=50, order=order, seed=5, device="cpu",
                                rank=rank, world_size=world, prefetch=0)
        ids = np.concatenate([batch_ids.numpy() for batch_ids, rows in feeder])
        seen.append(ids)
        # Each rank reads about its quarter of the file; interleaved ranks read all of it.
        assert read["bytes"] <= 0.4 * data.nbytes, (rank, read["bytes"] / data.nbytes)
        assert feeder.state_dict()["shard"] == "contiguous"
    everything = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(everything), np.arange(n))  # every row once: 4000 splits evenly


@pytest.mark.parametrize("filled", [False, True])
def test_create_npy_replaces_a_file_by_rename_so_whoever_maps_it_keeps_its_rows(tmp_path, filled):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    gadget = ss.DataGadget(path, mmap=True, backend="numpy").read()
    fill = (lambda lo, hi: np.full((hi - lo, 3), -1, np.float32)) if filled else None
    new = ss.data.create_npy(path, (4, 3), np.float32, fill, progress=False)
    assert gadget.get([1]).tolist() == [[3.0, 4.0, 5.0]]  # the old file, intact, not zeroed in place
    assert new[1].tolist() == ([-1.0] * 3 if filled else [0.0] * 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]
    gadget.close()


@pytest.mark.parametrize("filled", [False, True])
@pytest.mark.parametrize("where", ["missing directory", "a directory"])
def test_create_npy_refuses_a_path_it_cannot_write_with_a_path_error(tmp_path, filled, where):
    path = tmp_path / "nope" / "x.npy" if where == "missing directory" else tmp_path / "d.npy"
    if where == "a directory":
        path.mkdir()
    fill = (lambda lo, hi: np.ones((hi - lo, 3), np.float32)) if filled else None
    with pytest.raises(ss.PathError, match="directory") as info:
        ss.data.create_npy(path, (4, 3), np.float32, fill, progress=False)
    assert ".partial" not in str(info.value) and ".tmp" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if where == "missing directory" else ["d.npy"])


@pytest.mark.parametrize("dtype, message", [("bfloat16", "bfloat16.*float32"), ("floaty", "not a dtype"),
                                            ("uint64", "not supported")])
@pytest.mark.parametrize("filled", [False, True])
def test_create_npy_refuses_a_dtype_it_cannot_write_with_a_dtype_error(tmp_path, dtype, message, filled):
    fill = (lambda lo, hi: np.ones((hi - lo, 3), np.float32)) if filled else None
    with pytest.raises(ss.DTypeError, match=message):
        ss.data.create_npy(tmp_path / "x.npy", (4, 3), dtype, fill, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", [">f4", ">u2", np.dtype(np.int64).newbyteorder()])
@pytest.mark.parametrize("filled", [False, True])
def test_create_npy_refuses_the_other_byte_order_naming_the_native_dtype(tmp_path, rng, dtype, filled):
    """'>f4' was refused with advice for arrays (a.astype), which fits no dtype argument, while '>u2'
    was taken and written little-endian. Both are refused alike, naming the dtype to pass."""
    other = np.dtype(dtype)
    other = other.newbyteorder() if other.isnative else other  # the other order on any machine
    native = other.newbyteorder()
    rows = rng.integers(1, 1000, (4, 3)).astype(native)
    fill = (lambda lo, hi: rows[lo:hi]) if filled else None
    with pytest.raises(ss.DTypeError, match=f"other byte order.*pass '{native.name}'"):
        ss.data.create_npy(tmp_path / "x.npy", rows.shape, other, fill, progress=False)
    assert list(tmp_path.iterdir()) == []
    ss.data.create_npy(tmp_path / "x.npy", rows.shape, native.name, lambda lo, hi: rows[lo:hi], progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), rows)


@pytest.mark.parametrize("dtype", ["uint64", np.complex64, torch.uint64])
def test_create_npy_names_the_dtypes_it_writes_when_it_refuses_one(tmp_path, dtype):
    """Its refusal listed the tables' dtypes: bfloat16, which it refuses too, and not the uint16/uint32 it takes."""
    with pytest.raises(ss.DTypeError) as info:
        ss.data.create_npy(tmp_path / "x.npy", (4, 3), dtype, progress=False)
    choices = re.search(r"use one of (\[.*?\])", str(info.value))
    assert choices, str(info.value)
    offered = ast.literal_eval(choices.group(1))
    assert {"uint16", "uint32", "float32", "int64"} <= set(offered) and "bfloat16" not in offered, offered
    for name in offered:  # each choice offered is one it writes
        ss.data.create_npy(tmp_path / f"{name}.npy", (2,), name, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{name}.npy" for name in offered)


@pytest.mark.parametrize("dtype", [np.uint16, "uint32", torch.uint16, torch.uint32])
def test_create_npy_writes_token_ids_the_feeder_reads(tmp_path, rng, dtype):
    """uint16/uint32 token ids: the README's feeder takes them, and create_npy refused to write them."""
    name = str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else np.dtype(dtype).name
    top = np.iinfo(name).max
    ids = rng.integers(top - 1000, top, size=(5000, 2), endpoint=True).astype(name)  # the top of the range
    ss.data.create_npy(tmp_path / "ids.npy", ids.shape, dtype, lambda lo, hi: ids[lo:hi], chunk_bytes=4096,
                       progress=False)
    assert np.load(tmp_path / "ids.npy").dtype == np.dtype(name)
    feeder = ss.BatchFeeder(np.load(tmp_path / "ids.npy", mmap_mode="r"), batch_size=512, order="sequential",
                            device="cpu")
    got = torch.cat([batch for (batch,) in feeder]).numpy()
    np.testing.assert_array_equal(got, ids.astype(np.int64))
    # int64 ids (what a tokenizer pipeline makes) in range are written exactly; one that would wrap is refused.
    ss.data.create_npy(tmp_path / "wide.npy", ids.shape, dtype, lambda lo, hi: ids[lo:hi].astype(np.int64),
                       progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "wide.npy"), ids)
    with pytest.raises(ss.DTypeError, match="-1 became"):
        ss.data.create_npy(tmp_path / "bad.npy", (3,), dtype, lambda lo, hi: np.array([1, -1, 2])[lo:hi],
                           progress=False)
    assert not (tmp_path / "bad.npy").exists()


def test_create_npy_takes_torch_rows_of_a_dtype_numpy_lacks(tmp_path, rng):
    """A fill returning bfloat16 tensors (a bfloat16 model's output) died in np.asarray with a raw
    TypeError; float32 holds every bfloat16 value exactly, so the file gets the values themselves."""
    rows = torch.from_numpy(rng.standard_normal((50, 3)).astype(np.float32)).to(torch.bfloat16)
    made = ss.data.create_npy(tmp_path / "x.npy", rows.shape, np.float32, lambda lo, hi: rows[lo:hi],
                              chunk_bytes=96, progress=False)
    np.testing.assert_array_equal(made, rows.float().numpy())


def _quantized(rows):
    with warnings.catch_warnings():  # torch deprecates making quantized tensors; users still have them
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.from_numpy(rows), 1.0, 0, torch.quint8)


@pytest.mark.parametrize("bad, family, fragment", [
    # np.asarray dropped the mask: the bytes under it were written as the dataset's values.
    (lambda rows: np.ma.array(rows, mask=np.eye(*rows.shape)), ss.DTypeError, "masked array"),
    (lambda rows: rows.tolist()[:-1] + [rows.tolist()[-1][:-1]], ss.ShapeError, "different lengths"),
    (lambda rows: torch.from_numpy(rows).to_sparse(), ss.DTypeError, "got a sparse_coo one"),
    (lambda rows: torch.ones(rows.shape, device="meta"), ss.DeviceError, "meta device"),
    (_quantized, ss.DTypeError, "t.dequantize()"),
], ids=["masked", "ragged", "sparse", "meta", "quantized"])
def test_create_npy_refuses_fill_rows_it_cannot_read_and_leaves_the_old_file(tmp_path, rng, bad, family, fragment):
    path = tmp_path / "x.npy"
    old = rng.uniform(1, 2, size=(6, 3)).astype(np.float32)
    np.save(path, old)
    rows = rng.uniform(1, 2, size=(6, 3)).astype(np.float32)
    with pytest.raises(family, match=fragment) as info:
        ss.data.create_npy(path, rows.shape, np.float32, lambda lo, hi: bad(rows[lo:hi]), progress=False)
    assert r"fill(0, 6)'s rows" in str(info.value) or "fill(0, 6) returned" in str(info.value)
    np.testing.assert_array_equal(np.load(path), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


def test_create_npy_writes_lazily_negated_rows_as_the_values_they_show(tmp_path, seed):
    """``z.conj().imag`` holds -imag in memory: its .numpy() raised torch's RuntimeError."""
    rows = torch.randn(6, 3, dtype=torch.complex64).conj().imag
    made = ss.data.create_npy(tmp_path / "x.npy", rows.shape, np.float32, lambda lo, hi: rows[lo:hi],
                              progress=False)
    np.testing.assert_array_equal(made, rows.resolve_neg().numpy())


@pytest.mark.parametrize("fill", [np.ones((4, 2), np.float32), 5], ids=["array", "int"])
def test_create_npy_refuses_a_fill_that_is_not_a_function_before_touching_the_path(tmp_path, fill):
    """fill(start, stop) raised Python's raw TypeError ("'numpy.ndarray' object is not callable")."""
    path = tmp_path / "x.npy"
    np.save(path, np.arange(6, dtype=np.float32))
    with pytest.raises(ss.OptionError, match=r"fill must be a function fill\(start, stop\).*lambda lo, hi: x\[lo:hi\]"):
        ss.data.create_npy(path, (4, 2), np.float32, fill, progress=False)
    np.testing.assert_array_equal(np.load(path), np.arange(6, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


@pytest.mark.parametrize("order", ["random", BlockOrder(block_rows=64, window=2)])
@pytest.mark.parametrize("failing", ["preadv", "fstat"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_disk_error_names_the_file_and_rows_and_the_loop_retries_it(tmp_path, rng, monkeypatch, order,
                                                                       failing, prefetch):
    """EIO from pread (or from the fstat of the change check) came out as a bare OSError: no file, no rows."""
    n = 1024
    data = rng.standard_normal((n, 4)).astype(np.float32)
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(np.arange(n), write(path, data), batch_size=32, order=order, device="cpu",
                            prefetch=prefetch)
    delivered = []
    real = getattr(os, failing)

    def eio(*args):
        raise OSError(5, "Input/output error")

    with pytest.raises(ss.FileFormatError, match="Input/output error while") as raised:
        for ids, rows in feeder:
            delivered.append((ids.numpy(), rows.numpy().copy()))
            if len(delivered) == 3:
                monkeypatch.setattr(os, failing, eio)
    monkeypatch.setattr(os, failing, real)
    assert str(path) in str(raised.value) and raised.value.errno == 5
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == 5
    if failing == "preadv":
        assert "reading rows " in str(raised.value)
    rest = [(ids.numpy(), rows.numpy()) for ids, rows in feeder]  # the disk is back: the loop goes on
    assert sorted(np.concatenate([ids for ids, _ in delivered + rest]).tolist()) == list(range(n))
    for ids, rows in delivered + rest:
        np.testing.assert_array_equal(rows, data[ids])


def test_a_file_that_cannot_be_opened_for_pread_raises_a_path_error_naming_it(tmp_path, rng, monkeypatch):
    path = tmp_path / "x.npy"
    feeder = ss.BatchFeeder(write(path, rng.standard_normal((100, 2))), batch_size=10, device="cpu")
    real = os.open

    def failing(name, *args, **kwargs):
        if os.fspath(name) == str(path):
            raise OSError(5, "Input/output error")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", failing)
    with pytest.raises(ss.PathError, match="cannot open the .npy file .*x.npy.*Input/output error") as raised:
        next(iter(feeder))
    assert raised.value.errno == 5 and raised.value.__cause__.errno == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_file_reader_closed_in_a_forked_child_does_not_wait_for_its_parents_pool(tmp_path, rng):
    """A process forked while the read-ahead thread was handing the I/O pool a read inherits the
    pool's lock held, by a thread the child does not have: closing the reader there (the child's
    loop raising "forked", or collected) waited on that lock forever (seen: the forked-loop test of
    test_feeder.py killed by its alarm in a full run). The child closes its copies of the files only."""
    path = tmp_path / "x.npy"
    write(path, rng.standard_normal((64, 3)).astype(np.float32))
    rows = filesource.FileRows(str(path), ss.files.read_npy_header(path).offset, 64, (3,), torch.float32,
                               ss.files.identity(os.stat(path)))
    reader = filesource.RowReader([rows])

    def child():
        held = fds_on(path)
        reader.close()
        return 0 if held - fds_on(path) == 1 else 3  # its copy of the descriptor is closed

    try:  # as the parent's read-ahead thread inside pool.submit at the fork
        assert_child_forked_holding_succeeds(reader._pool._shutdown_lock, child)
    finally:
        reader.close()


@pytest.mark.parametrize("name", ["c.txt", "c", "c.npz", "c.h5"])
@pytest.mark.parametrize("filled", [False, True])
def test_create_npy_refuses_a_name_that_is_not_npy_before_touching_it(tmp_path, rng, name, filled):
    """create_npy("c.txt", ...) wrote a .npy file that DataGadget then refused to open by its suffix."""
    path = tmp_path / name
    kept = rng.bytes(64)
    path.write_bytes(kept)
    rows = rng.standard_normal((6, 3)).astype(np.float32)
    fill = (lambda lo, hi: rows[lo:hi]) if filled else None
    with pytest.raises(ss.OptionError, match=r"name it \*\.npy"):
        ss.data.create_npy(path, rows.shape, np.float32, fill, progress=False)
    assert path.read_bytes() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    made = ss.data.create_npy(tmp_path / "c.npy", rows.shape, np.float32, fill, progress=False)
    if not filled:
        made[:] = rows
        made.flush()
    np.testing.assert_array_equal(ss.DataGadget(tmp_path / "c.npy", backend="numpy").to_numpy(), rows)


def test_a_batch_read_while_another_thread_closes_the_reader_is_refused(tmp_path, rng):
    """A close between a batch's reads and its check for changes emptied the descriptors the check
    loops over: the batch came back as if nothing had happened, instead of the documented
    StateError saying the reader was closed by another thread."""
    path = tmp_path / "x.npy"
    write(path, rng.standard_normal((64, 3)).astype(np.float32))
    rows = filesource.FileRows(str(path), ss.files.read_npy_header(path).offset, 64, (3,), torch.float32,
                               ss.files.identity(os.stat(path)))
    reader = filesource.RowReader([rows])
    wait = reader._wait

    def closed_once_read(futures):  # as set_epoch closing the reader on another thread just then
        wait(futures)
        reader.close()

    reader._wait = closed_once_read
    with pytest.raises(ss.StateError, match="closed by another thread"):
        reader.read(0, rng.permutation(64)[:16])


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_in_drop_cache_leaves_no_descriptor(tmp_path, rng):
    """drop_cache opened the file (fd = os.open(...)) before the try that closes it: a Ctrl-C once
    os.open had returned left it open for good, one per interrupted drop."""
    path = tmp_path / "x.npy"
    write(path, rng.standard_normal((64, 3)).astype(np.float32))

    def drop(counting):
        counting(True)
        drop_cache(path)
        counting(False)

    _assert_no_descriptor_left_by_interrupts(drop, (filesource, atomic), tmp_path, "a drop")


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_as_a_file_reader_is_made_leaves_no_descriptor(tmp_path, rng):
    """A reader's constructor keeps its files open for the reader: one it raised from (a Ctrl-C)
    returned no reader to close them, so none of them may stay open."""
    paths = [tmp_path / "x.npy", tmp_path / "y.npy"]
    for path in paths:
        write(path, rng.standard_normal((64, 3)).astype(np.float32))
    files = [filesource.FileRows(str(path), ss.files.read_npy_header(path).offset, 64, (3,), torch.float32,
                                 ss.files.identity(os.stat(path))) for path in paths]

    def make_and_close(counting):
        counting(True)
        reader = filesource.RowReader(files)
        counting(False)
        reader.close()

    _assert_no_descriptor_left_by_interrupts(make_and_close, (filesource, atomic), tmp_path, "a reader")


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_as_create_npy_fills_leaves_no_descriptor(tmp_path, rng):
    """create_npy's fill wrote through a descriptor opened (fd = os.open(...)) before the try that
    closes it: a Ctrl-C once os.open had returned left the removed temporary open for good."""
    from speedswap.data import create
    data = rng.standard_normal((20, 5)).astype(np.float32)

    def make(counting):
        counting(True)
        ss.data.create_npy(tmp_path / "x.npy", data.shape, np.float32, lambda lo, hi: data[lo:hi], progress=False)
        counting(False)

    _assert_no_descriptor_left_by_interrupts(make, (create, atomic), tmp_path, "a create_npy")
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), data)


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_as_a_file_reader_is_closed_leaves_no_descriptor_to_a_second_close(tmp_path, rng):
    """close() set _closed, then waited for the pool's thread, then closed the files one by one: a Ctrl-C
    in the wait or between two closes returned with files open, and every later close returned at once
    (the reader was closed), so they stayed open for good. KeyboardInterrupt is raised at each place an
    interrupt can land as a reader that has read is closed (in filesource.py, atomic.py and the pool's
    and threads' code the wait runs), one per reader; then the reader is closed again, as the feeder's
    next loop, set_epoch or load_state_dict does. After each, no descriptor of tmp_path is open, the
    close's turn was free for the second close, and a file opened between the two closes (which may take
    a number the first one freed) is still open: none was closed twice."""
    import concurrent.futures.thread
    paths = [tmp_path / "x.npy", tmp_path / "y.npy"]
    data = [rng.standard_normal((64, 3)).astype(np.float32) for _ in paths]
    for path, array in zip(paths, data):
        write(path, array)
    files = [filesource.FileRows(str(path), ss.files.read_npy_header(path).offset, 64, (3,), torch.float32,
                                 ss.files.identity(os.stat(path))) for path in paths]
    wrong = []

    def read_and_close_twice(counting):
        ids = rng.permutation(64)
        reader = filesource.RowReader(files, threads=1)
        for got, array in zip(reader.read(0, ids[:32]), data):  # the pool has a thread to wait for
            np.testing.assert_array_equal(got.numpy(), array[ids[:32]])
        counting(True)
        try:
            reader.close()
        finally:
            counting(False)
            if reader._close_lock.locked():  # a second close would wait for it forever
                wrong.append("the close's turn kept")
            else:
                bystander = os.open(tmp_path / "bystander", os.O_RDONLY | os.O_CREAT)
                try:
                    reader.close()
                    if os.readlink(f"/proc/self/fd/{bystander}") != str(tmp_path / "bystander"):
                        wrong.append("a descriptor closed twice")
                except OSError as exc:  # EBADF: closed by the reader
                    wrong.append(f"a descriptor closed twice ({exc})")
                finally:
                    with contextlib.suppress(OSError):
                        os.close(bystander)

    points, left = _descriptors_left_by_interrupts(
        read_and_close_twice, (filesource, atomic, concurrent.futures.thread, threading), tmp_path)
    assert any("_close_fds" in point for point in points) and any("join" in point for point in points), points
    assert not left and not wrong, f"a close interrupted at {left}, {wrong} (of {points})"


def row_reader(path, data, threads=16, drop_behind=False):
    """A RowReader over a fresh ``.npy`` at ``path`` holding ``data``."""
    write(path, data)
    rows = filesource.FileRows(str(path), ss.files.read_npy_header(path).offset, len(data), data.shape[1:],
                               torch.from_numpy(data[:0]).dtype, ss.files.identity(os.stat(path)))
    return filesource.RowReader([rows], threads=threads, drop_behind=drop_behind)


@pytest.mark.parametrize("row_floats", [3, 1025])  # 12-byte rows, and rows that straddle pages
@pytest.mark.parametrize("threads", [1, 16])
@pytest.mark.parametrize("drop_behind", [False, True])
def test_a_short_read_mid_part_still_gives_every_row_exactly_and_drops_each_rows_pages(
        tmp_path, rng, monkeypatch, row_floats, threads, drop_behind):
    """Random order preads each row straight into the batch with offsets worked out for the whole part;
    a read that returns fewer bytes (a signal, a network file system) goes to _read, which reads the
    row again whole. The rows after it still land in their places, and drop-behind drops exactly the
    pages of each row read, as _read does, never more (the pages of rows not read yet stay cached)."""
    n = 300
    data = rng.standard_normal((n, row_floats)).astype(np.float32)
    ids = np.concatenate([rng.permutation(n), rng.integers(0, n, 100)])  # repeats too, as padding makes
    reader = row_reader(tmp_path / "x.npy", data, threads, drop_behind)
    offset, size = reader._files[0].offset, reader._files[0].row_bytes
    preadv, fadvise, calls, short, dropped = os.preadv, os.posix_fadvise, [], [], []

    def sometimes_short(fd, buffers, position, *flags):
        calls.append(position)
        if len(calls) % 7 == 3:  # a few bytes of the row only
            short.append(position)
            return preadv(fd, [buffers[0][:5]], position, *flags)
        return preadv(fd, buffers, position, *flags)

    def recording(fd, start, length, advice):
        dropped.append((start, length))
        return fadvise(fd, start, length, advice)

    monkeypatch.setattr(os, "preadv", sometimes_short)
    monkeypatch.setattr(os, "posix_fadvise", recording)
    try:
        for lo in range(0, len(ids), 64):
            (got,) = reader.read(lo, ids[lo:lo + 64])
            np.testing.assert_array_equal(got.numpy(), data[ids[lo:lo + 64]])
    finally:
        reader.close()
    assert short and len(calls) == len(ids) + len(short)  # one more pread for each short one
    page = mmap.PAGESIZE
    starts = offset + ids * size
    expected = [(s - s % page, -(-(s + size) // page) * page - (s - s % page)) for s in starts.tolist()]
    assert sorted(dropped) == (sorted(expected) if drop_behind else [])


@pytest.mark.parametrize("threads", [1, 16])
def test_a_disk_error_mid_part_is_raised_naming_its_row_and_never_read_again(tmp_path, rng, monkeypatch,
                                                                              threads):
    """The tight loop raises a row's OSError as _read does (the file, the row, errno kept): it is not
    handed to _read to try again, which would hide a disk that fails now and then."""
    data = rng.standard_normal((200, 4)).astype(np.float32)
    ids = rng.permutation(200)
    reader = row_reader(tmp_path / "x.npy", data, threads)
    offset, size = reader._files[0].offset, reader._files[0].row_bytes
    bad = int(ids[int(rng.integers(0, 100))])
    preadv, calls = os.preadv, []

    def failing_once(fd, buffers, position, *flags):
        calls.append(position)
        if position == offset + bad * size and calls.count(position) == 1:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv(fd, buffers, position, *flags)

    monkeypatch.setattr(os, "preadv", failing_once)
    try:
        with pytest.raises(ss.FileFormatError, match=rf"x\.npy.*Input/output error while reading rows "
                                                     rf"{bad}\.\.{bad} \(bytes") as raised:
            reader.read(0, ids[:100])
        assert raised.value.errno == errno.EIO and calls.count(offset + bad * size) == 1
        (got,) = reader.read(100, ids[100:200])  # the next batch reads on
        np.testing.assert_array_equal(got.numpy(), data[ids[100:]])
    finally:
        reader.close()


@_SWEEPS_MODEL_CTRL_C
def test_an_interrupt_anywhere_as_a_read_ahead_thread_starts_leaves_no_thread_running(rng):
    """ReaderThread started its thread, then recorded its process id and registered itself: a Ctrl-C
    once the thread ran returned no reader to close, and the thread, blocked on its full queue, read on
    for good (keeping the feeder and its sources alive). KeyboardInterrupt is raised at each place an
    interrupt can land in readahead.py as a reader is made, one per reader; the reader made is closed.
    After each, no read-ahead thread is left, and a reader made reads every batch in order."""
    from speedswap.data import readahead
    batches = [torch.from_numpy(rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(8)]
    left, points, got, stuck = [], [], [], set()

    def make_and_close(counting):
        counting(True)
        reader = readahead.ReaderThread(batches.__getitem__, 0, len(batches), 2)  # 8 batches, 2 ahead: it blocks
        counting(False)
        got.append([reader.next() for _ in batches])
        reader.close()

    while True:
        where = _interrupted_at(make_and_close, len(points), (readahead,))
        for thread in set(reader_threads()) - stuck:
            thread.join(5)  # told to stop, a thread ends after the batch it reads
        if set(reader_threads()) - stuck:
            left.append(where)
            stuck.update(reader_threads())
        if where is None:
            break
        points.append(where)
    assert any("getpid" in point for point in points), points
    assert not left, f"a reader interrupted at {left} left its thread running (of {points})"
    assert got and all(len(read) == len(batches) and all(map(operator.is_, read, batches)) for read in got)


def _join_once_started(thread, timeout):
    """``thread.join(timeout)``, also for a thread ``threading.enumerate()`` lists while another thread
    is still starting it (join raises RuntimeError until then)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return thread.join(max(0.0, deadline - time.monotonic()))
        except RuntimeError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)


def _sweep_for_readers_left(body, modules, tmp_path):
    """``_descriptors_left_by_interrupts`` of ``body``, noting the read-ahead and I/O threads each run leaves.

    After each run cycles are collected and speedswap's threads have time to end (a thread told to stop
    ends after the batch it reads, and the next epoch's order draw on its own), again until no new one
    is left to wait for: an I/O pool that a collection frees (this run's, or an earlier test's garbage)
    lets its threads end only then. Only a thread that runs on for good, and descriptors (of the
    sources' maps too) held by something alive for good, are left. A thread left is named once, in the
    run that left it (not waited for again).

    Returns:
        ``(points, descriptors left, threads left)``: the last a list of thread names per run that left any.
    """
    left, stuck = [], set()

    def run(counting):
        body(counting)
        waited = set(stuck)
        while True:
            gc.collect()
            ending = {thread for thread in threading.enumerate() if thread.name.startswith("speedswap-")} - waited
            if not ending:
                break
            for thread in ending:
                _join_once_started(thread, 5)
            waited |= ending
        threads = [thread for thread in reader_threads() + io_threads() if thread not in stuck]
        stuck.update(threads)
        if threads:
            left.append([thread.name for thread in threads])

    points, opened = _descriptors_left_by_interrupts(run, modules, tmp_path)
    return points, opened, left


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
@pytest.mark.parametrize("order", ["random", "block"])
def test_an_interrupt_anywhere_as_a_loop_reads_its_first_batch_leaves_no_reader_open(tmp_path, rng, order):
    """_run made its file reader and read-ahead thread in a try whose except closed the file reader
    only, then recorded both (readers = self._readers = ...) and took the thread's id before the try
    whose finally closes them: a Ctrl-C once threading.get_ident had returned left the read-ahead
    thread reading on its full queue and the files open, for good. KeyboardInterrupt is raised at
    each place an interrupt can land in feeder.py and readahead.py as a loop over a memory-mapped
    source starts and reads its first batch, one per loop; the loop is then closed. After each, no
    descriptor of tmp_path is open and no read-ahead or I/O thread runs."""
    from speedswap.data import feeder, readahead
    n = 64
    data = rng.standard_normal((n, 4)).astype(np.float32)
    write(tmp_path / "x.npy", data)
    got = []

    def first_batch(counting):
        mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
        loop = iter(ss.BatchFeeder(np.arange(n), mapped, batch_size=8, order=order, seed=5, device="cpu",
                                   prefetch=2))  # 8 batches, 2 ahead: a thread left running blocks
        counting(True)
        ids, rows = next(loop)
        counting(False)
        got.append((ids.numpy().copy(), rows.numpy().copy()))
        loop.close()

    def run(counting):
        with contextlib.suppress(KeyboardInterrupt):  # dropped here: its traceback holds the loop's frames
            first_batch(counting)

    points, opened, left = _sweep_for_readers_left(run, (feeder, readahead), tmp_path)
    assert any("get_ident" in point for point in points), points
    assert not opened and not left, f"a loop interrupted at {opened} left threads {left} (of {points})"
    assert got and all(np.array_equal(rows, data[ids]) for ids, rows in got)


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_in_set_epoch_after_an_interrupted_loop_leaves_its_readers_to_the_next_one(
        tmp_path, rng, monkeypatch):
    """A Ctrl-C as a loop closed its readers (on entering _close_readers) leaves them in the feeder for its
    next set_epoch, load_state_dict or loop to close. _stop_reader forgot them before closing them: a
    second Ctrl-C on entering that close lost them for good, the read-ahead thread waiting on its full
    queue and the files open. KeyboardInterrupt is raised at each place an interrupt can land in
    feeder.py and readahead.py during such a set_epoch, one per feeder; a second set_epoch follows.
    After each, no descriptor of tmp_path is open and no read-ahead or I/O thread runs."""
    from speedswap.data import feeder, readahead
    n = 64
    write(tmp_path / "x.npy", rng.standard_normal((n, 4)).astype(np.float32))
    close_readers = feeder._close_readers

    def interrupted_once(readers, wait=True):  # Ctrl-C on entering the loop's close
        monkeypatch.setattr(feeder, "_close_readers", close_readers)
        raise KeyboardInterrupt

    def set_epoch_twice(counting):
        source = ss.BatchFeeder(np.load(tmp_path / "x.npy", mmap_mode="r"), batch_size=8, order="random",
                                seed=5, device="cpu", prefetch=2)  # 8 batches, 2 ahead: a thread left running blocks
        loop = iter(source)
        next(loop)
        monkeypatch.setattr(feeder, "_close_readers", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            loop.close()
        counting(True)
        with contextlib.suppress(KeyboardInterrupt):
            source.set_epoch(1)
        counting(False)
        source.set_epoch(1)

    points, opened, left = _sweep_for_readers_left(set_epoch_twice, (feeder, readahead), tmp_path)
    assert any("_close_readers" in point for point in points), points
    assert not opened and not left, f"a set_epoch interrupted at {opened} left threads {left} (of {points})"


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
@pytest.mark.parametrize("then", ["loops on", "is dropped"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("order", ["random", "block"])
def test_an_interrupt_anywhere_as_a_loop_closes_leaves_a_feeder_that_loops_on_or_is_dropped_clean(
        tmp_path, rng, order, prefetch, then):
    """A Ctrl-C as a loop closes its readers (in _run's finally) leaves them in the feeder for its next
    loop, set_epoch or load_state_dict to close. The next loop did (and read the rest of the stream
    right), but a feeder dropped instead, as a notebook drops one, closed nothing: the file reader was
    collected with its files open, and a read-ahead thread (prefetch=2) ran on for good, waiting on its
    full queue and holding the feeder and its files. KeyboardInterrupt is raised at each place an
    interrupt can land in feeder.py, readahead.py and filesource.py as a loop over a memory-mapped source
    is closed after its first batch, one per feeder; the feeder then loops on over two epochs (the stream
    of the same data in memory, batch by batch) or is dropped. After each, no descriptor of tmp_path is
    open and no read-ahead or I/O thread runs."""
    from speedswap.data import feeder, readahead
    n = 64
    data = rng.standard_normal((n, 4)).astype(np.float32)
    write(tmp_path / "x.npy", data)

    def make(rows):
        return ss.BatchFeeder(np.arange(n), rows, batch_size=8, order=order, seed=5, device="cpu", prefetch=prefetch)

    expected = stream(make(data), epochs=2)[1:]  # in memory: no reader to close
    went_on = []

    def close_a_loop(counting):
        source = make(np.load(tmp_path / "x.npy", mmap_mode="r"))
        loop = iter(source)
        next(loop)
        counting(True)
        with contextlib.suppress(KeyboardInterrupt):  # dropped here: its traceback holds the loop's frames
            loop.close()
        counting(False)
        if then == "loops on":
            went_on.append(stream(source, epochs=2))

    points, opened, left = _sweep_for_readers_left(close_a_loop, (feeder, readahead, filesource), tmp_path)
    assert any("_close_readers" in point for point in points), points
    assert not opened and not left, f"a loop's close interrupted at {opened} left threads {left} (of {points})"
    for batches in went_on:
        assert len(batches) == len(expected)
        for (ids, rows), (ids0, rows0) in zip(batches, expected):
            np.testing.assert_array_equal(ids, ids0)
            np.testing.assert_array_equal(rows, rows0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
@pytest.mark.parametrize("order, made", [("random", "RowReader"), ("block", "WindowReader")])
def test_an_interrupt_as_a_file_reader_is_handed_to_its_loop_leaves_no_descriptor(tmp_path, rng, monkeypatch,
                                                                                  order, made):
    """A Ctrl-C lands once a class call has returned (Python checks for signals after every call into C,
    the class's too), where the sweeps' profile function sees none: _file_reader made the loop's file
    reader and returned it, and one landing in between dropped the reader with its files open, before
    _run's try could close it. KeyboardInterrupt is raised there (a reader class that raises once it has
    made its reader); then no descriptor of tmp_path is open, nor once the feeder is dropped."""
    from speedswap.data import feeder
    n = 64
    write(tmp_path / "x.npy", rng.standard_normal((n, 4)).astype(np.float32))
    source = ss.BatchFeeder(np.load(tmp_path / "x.npy", mmap_mode="r"), batch_size=8, order=order, seed=5,
                            device="cpu", prefetch=0)
    mapped = _opened_in(tmp_path)  # the source's map
    real = getattr(feeder, made)

    def made_then_interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(feeder, made, made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(iter(source))
    opened = sorted(set(_opened_in(tmp_path)) - set(mapped))
    del source
    gc.collect()
    left = _opened_in(tmp_path)
    for fd in left:
        os.close(fd)
    assert not opened and not left, f"a file reader dropped as it was handed over left {opened}, then {left}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_as_a_read_ahead_thread_is_handed_to_its_loop_leaves_no_thread_running(tmp_path, rng,
                                                                                            monkeypatch):
    """As for a file reader above: a Ctrl-C once ReaderThread(...) had returned, before _reader_thread
    returned it, dropped the reader with its thread running; _run's except closed the file reader, but
    the thread, its queue full, waited on it for good, holding the feeder. KeyboardInterrupt is raised
    there once the thread has filled its queue; then, the feeder dropped, no read-ahead or I/O thread
    runs and no descriptor of tmp_path is open."""
    from speedswap.data import feeder
    n = 64
    write(tmp_path / "x.npy", rng.standard_normal((n, 4)).astype(np.float32))
    source = ss.BatchFeeder(np.load(tmp_path / "x.npy", mmap_mode="r"), batch_size=8, order="random", seed=5,
                            device="cpu", prefetch=2)  # 8 batches, 2 ahead: a thread left running blocks
    real, before = feeder.ReaderThread, set(threading.enumerate())

    def made_then_interrupted(*args, **kwargs):
        reader, deadline = real(*args, **kwargs), time.monotonic() + 10
        while not reader._queue.full() and time.monotonic() < deadline:  # read ahead as far as it may
            time.sleep(0.01)
        del reader
        raise KeyboardInterrupt

    monkeypatch.setattr(feeder, "ReaderThread", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(iter(source))
    del source
    for thread in set(threading.enumerate()) - before:
        _join_once_started(thread, 5)
    gc.collect()
    left, opened = [t.name for t in reader_threads() + io_threads() if t not in before], _opened_in(tmp_path)
    for fd in opened:
        os.close(fd)
    assert not left and not opened, (f"a read-ahead thread dropped as it was handed over left {left} running, "
                                     f"{opened} open")


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
def test_windows_of_file_rows_that_cannot_fit_in_ram_are_refused_when_the_feeder_is_built(kind, tmp_path, rng,
                                                                                           monkeypatch):
    """BlockOrder(window=4096) over a 20 GB file of 1 KiB rows passed the order's check (its layout, 16
    bytes a row) and asked torch at the first batch for two 16 GiB windows: a raw RuntimeError mid-loop,
    or, below the overcommit limit, a process killed for memory as the windows filled."""
    import speedswap.data.feeder as feeder_module
    n, block_rows = int(rng.integers(2000, 3000)), int(rng.integers(20, 40))
    # Rows of 1 KiB, so that two windows, not the epoch's row ids (48 bytes a row), outgrow the RAM.
    data = rng.standard_normal((n, 256)).astype(np.float32)
    mapped, labels = write(tmp_path / "x.npy", data), write(tmp_path / "y.npy", np.arange(n))
    two_windows_of_8 = 2 * 8 * block_rows * (256 * 4 + 8)
    monkeypatch.setattr(feeder_module, "available_ram", lambda: 2 * two_windows_of_8 - 2)
    with pytest.raises(ss.OptionError, match=r"window=8\) .*half the RAM available.*at most 7 blocks"):
        ss.BatchFeeder(mapped, labels, batch_size=32, order=kind(block_rows, 8), device="cpu")
    # In memory, or read at random, no window of rows is held: not refused.
    ss.BatchFeeder(data, np.arange(n), batch_size=32, order=kind(block_rows, 8), device="cpu")
    ss.BatchFeeder(mapped, labels, batch_size=32, order="random", device="cpu")
    # The largest window named fits, and its epoch reads every row once.
    feeder = ss.BatchFeeder(labels, mapped, batch_size=32, order=kind(block_rows, 7), device="cpu")
    batches = list(feeder)
    ids = np.concatenate([i.numpy() for i, _ in batches])
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    for i, rows in batches:
        np.testing.assert_array_equal(rows.numpy(), data[i.numpy()])



@pytest.mark.parametrize("ahead_ns, tick_s", [(3600 * 10**9 + 123_456_789, 0.01), (3600 * 10**9, 2.0)])
def test_a_file_stamped_ahead_of_this_clock_waits_at_most_its_own_tick_per_loop(tmp_path, rng, monkeypatch,
                                                                               ahead_ns, tick_s):
    """A file whose modification time is ahead of this machine's clock (a network file system's server
    ahead, an archive from such a machine) made every loop wait 2 s, the whole-second tick, though its
    times have nanoseconds and the docstring promises at most 10 ms: 2 s an epoch."""
    n = int(rng.integers(100, 300))
    data = rng.standard_normal((n, 4)).astype(np.float32)
    path = tmp_path / "x.npy"
    source = write(path, data)
    ahead = time.time_ns() // 10**9 * 10**9 + ahead_ns  # whole seconds, or not: each its own tick
    os.utime(path, ns=(ahead, ahead))
    waits = []
    monkeypatch.setattr(filesource, "time", type(time)("clock"))
    filesource.time.time_ns, filesource.time.sleep = time.time_ns, waits.append
    feeder = ss.BatchFeeder(np.arange(n), source, batch_size=32, order="random", device="cpu")
    for _ in range(2):
        for ids, rows in feeder:
            np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
    assert len(waits) == 2 and all(0 < wait <= tick_s for wait in waits), waits


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("order", ["random", BlockOrder(block_rows=100, window=1)])
def test_a_loop_over_a_file_continued_in_a_forked_process_raises_and_a_new_loop_reads_on(tmp_path, rng,
                                                                                       monkeypatch, order):
    """Without read-ahead a loop reads a file's rows on I/O threads, which a forked child does not have.
    The child's loop handed its reads to the copied pool, whose count of idle threads (the parent's)
    started no thread for them, or waited for a window the parent was reading at the fork: either way
    for good. It now raises StateError, and a new loop in the child reads the stream on from the
    batch after those handed out; the parent's loop goes on."""
    n = 100 * int(rng.integers(20, 30))  # whole blocks: no batch spans three windows, two are read at a time
    data = rng.uniform(1, 2, size=(n, 8)).astype(np.float32)
    feeder = ss.BatchFeeder(np.arange(n), write(tmp_path / "x.npy", data), batch_size=64, order=order,
                            seed=int(rng.integers(100)), device="cpu", prefetch=0)
    real, loop = os.preadv, iter(feeder)
    if order == "random":
        # A batch's 16 parts read at once, on 16 threads, which then count themselves idle.
        together = threading.Barrier(16, timeout=10)
        monkeypatch.setattr(os, "preadv", lambda *args: (together.wait(), real(*args))[1])
        first = [tuple(t.numpy() for t in next(loop))]
        monkeypatch.setattr(os, "preadv", real)
        time.sleep(0.2)
    else:
        # Windows 0 and 1 are read first; the third batch frees window 0 and starts reading window 2,
        # which the disk holds back until after the fork.
        disk = threading.Event()
        disk.set()
        monkeypatch.setattr(os, "preadv", lambda *args: (disk.wait(10), real(*args))[1])
        first = [tuple(t.numpy() for t in next(loop)) for _ in range(2)]
        disk.clear()
        first.append(tuple(t.numpy() for t in next(loop)))
    pid = os.fork()
    if pid == 0:  # the child: within 10 s or killed
        code = 1
        try:
            signal.alarm(10)
            os.preadv = real  # the disk the child reads on its own
            try:
                next(loop)
                code = 2
            except ss.StateError as exc:
                code = 0 if "forked" in str(exc) else 3
            if code == 0:
                batches = first + [tuple(t.numpy() for t in batch) for batch in feeder]
                ids = np.concatenate([ids for ids, _ in batches])
                code = 0 if (np.array_equal(np.sort(ids), np.arange(n))
                             and all(np.array_equal(rows, data[ids]) for ids, rows in batches)) else 4
        finally:
            os._exit(code)
    if order != "random":
        disk.set()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    batches = first + [tuple(t.numpy() for t in batch) for batch in loop]
    np.testing.assert_array_equal(np.sort(np.concatenate([ids for ids, _ in batches])), np.arange(n))
    for ids, rows in batches:
        np.testing.assert_array_equal(rows, data[ids])


def test_a_file_rewritten_in_place_with_another_header_between_loops_is_refused_not_fed_shifted(tmp_path, rng):
    # The next loop read the rows where the old header had put them: bytes of the new, longer header
    # came out as rows (1e-19s), and every row after straddled two.
    path = tmp_path / "x.npy"
    n = 256
    data = rng.standard_normal((n, 4)).astype(np.float32)
    source = write(path, data)
    os.utime(path, ns=(time.time_ns() - 3600 * 10**9,) * 2)  # written long ago (see the tests above)
    feeder = ss.BatchFeeder(np.arange(n), source, batch_size=32, device="cpu")
    for ids, rows in feeder:
        np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
    _rewrite_rows_in_place(path, -data)  # same header: the next loop reads the new values
    for ids, rows in feeder:
        np.testing.assert_array_equal(rows.numpy(), -data[ids.numpy()])
    descr = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, 4), }" % n
    header = descr.ljust(source.offset + 64 - 10 - 1) + "\n"  # rows 64 bytes (4 rows) further on
    with open(path, "r+b") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + (2 * data).tobytes())
    np.testing.assert_array_equal(np.load(path), 2 * data)
    with pytest.raises(ss.FileFormatError, match=rf"rewritten in place with another .npy header.*at byte "
                                                 rf"{source.offset}, the file now at byte {source.offset + 64}"):
        next(iter(feeder))
    fresh = ss.BatchFeeder(np.arange(n), np.load(path, mmap_mode="r"), batch_size=32, device="cpu")
    for ids, rows in fresh:  # what the message says to do
        np.testing.assert_array_equal(rows.numpy(), 2 * data[ids.numpy()])


@pytest.mark.parametrize("cut", ["truncated", "saved with fewer rows"])
def test_a_file_cut_short_between_loops_is_refused_before_the_loop_hands_a_batch(tmp_path, rng, cut):
    # In random order the next loop handed out the batches whose rows the shorter file still held
    # (68 of 512 here, the last row cut) and raised only at the first row past its end, mid-epoch.
    path = tmp_path / "x.npy"
    n = 4096
    data = rng.standard_normal((n, 4)).astype(np.float32)
    source = write(path, data)  # never read again here: its pages past the new end would be a SIGBUS
    feeder = ss.BatchFeeder(np.arange(n), source, batch_size=8, order="random", seed=1, device="cpu")
    for ids, rows in feeder:
        np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
    if cut == "truncated":
        os.truncate(path, os.path.getsize(path) - 4 * 4)  # the last row
    else:  # another writer's np.save: same file, same header length, fewer rows
        subprocess.run([sys.executable, "-c", f"import numpy as np; np.save({str(path)!r}, "
                        f"np.ones(({n - 1}, 4), np.float32))"], check=True, timeout=120)
    handed = []
    with pytest.raises(ss.FileFormatError) as raised:
        for ids, _ in feeder:
            handed.append(ids)
    assert len(handed) == 0, f"{len(handed)} of {len(feeder)} batches handed out before the error"
    assert "too short for the 4,096 rows this feeder was built with" in str(raised.value)
    state = feeder.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 0)  # nothing counted: the loop resumes there once restored
    np.save(path, data)  # restored: the same feeder reads on
    for ids, rows in feeder:
        np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
