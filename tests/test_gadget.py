"""DataGadget: rows of .npy files and in-memory arrays to the device and back."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import speedswap as ss
import speedswap.data.gadget


def random_data(rng, shape, dtype=np.float32):
    """Fresh random values in [1, 2) with random signs: never zeros."""
    return (rng.uniform(1.0, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)


@pytest.fixture(params=["file", "array"])
def kind(request):
    return request.param


def gadget_of(data, kind, tmp_path, **kwargs):
    if kind == "file":
        path = tmp_path / "data.npy"
        np.save(path, data)
        return ss.DataGadget(path, **kwargs)
    return ss.DataGadget(data, **kwargs)


@pytest.mark.parametrize("shape", [(500, 12), (300, 3, 4), (400,)])
@pytest.mark.parametrize("pinned", [False, True])
def test_get_matches_numpy(backend, kind, shape, pinned, rng, tmp_path):
    data = random_data(rng, shape)
    gadget = gadget_of(data, kind, tmp_path, CPUPinn=pinned, backend=backend)
    assert gadget.shape == shape and len(gadget) == shape[0]
    ids = rng.integers(0, shape[0], size=(7, 90))  # duplicates, any shape
    got = gadget.get(ids)
    assert tuple(got.shape) == (7, 90, *shape[1:])
    assert got.device == gadget.device and got.dtype == torch.float32
    np.testing.assert_array_equal(got.cpu().numpy(), data[ids])
    np.testing.assert_array_equal(gadget.getData(torch.from_numpy(ids[0])).cpu().numpy(), data[ids[0]])
    assert gadget.storage == ("pinned" if pinned else "device")  # SpeedTorch's CPUPinn


def test_integer_labels_round_trip(backend, rng):
    labels = rng.integers(-1000, 1000, size=777)
    gadget = ss.DataGadget(labels, backend=backend)
    ids = rng.integers(0, 777, size=1000)
    got = gadget.get(ids)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.cpu().numpy(), labels[ids])
    one = gadget.get(int(ids[0]))  # a scalar id: one label, shape ()
    assert one.shape == () and int(one) == labels[ids[0]]
    assert gadget.get(np.array(ids[:6]).reshape(2, 3)).shape == (2, 3)


def test_a_strided_view_of_a_map_is_copied_or_refused_when_it_must_be_mapped(rng, tmp_path):
    np.save(tmp_path / "x.npy", rng.standard_normal((12, 4)).astype(np.float32))
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    gadget = ss.data.DataGadget(mapped[::2], backend="numpy")
    np.testing.assert_array_equal(gadget.get([1, 5]).numpy(), mapped[::2][[1, 5]])
    with pytest.raises(ss.OptionError, match="strided view"):
        ss.data.DataGadget(mapped[::2], mmap=True, backend="numpy")


def test_put_then_get(backend, kind, rng, tmp_path):
    data = random_data(rng, (200, 2, 5))
    gadget = gadget_of(data.copy(), kind, tmp_path, CPUPinn=True, backend=backend)
    rows = rng.choice(200, size=30, replace=False)
    values = random_data(rng, (30, 2, 5))
    gadget.put(torch.from_numpy(values).to(gadget.device), rows)
    expected = data.copy()
    expected[rows] = values
    np.testing.assert_array_equal(gadget.to_numpy(), expected)
    more = rng.choice(200, size=4, replace=False)
    values = random_data(rng, (4, 2, 5))
    gadget.insertData(values, more)  # SpeedTorch's argument order: data, then indexes
    expected[more] = values
    np.testing.assert_array_equal(gadget.getNumpyVersion(), expected)


def test_pageable_array_is_shared_pinned_is_copied(rng):
    data = random_data(rng, (50, 3))
    shared = ss.DataGadget(data, storage="pageable", backend="numpy")
    shared.put(np.full((1, 3), 7.0, np.float32), [4])
    assert data[4].tolist() == [7.0, 7.0, 7.0]
    copied = ss.DataGadget(data, CPUPinn=True, backend="numpy")
    copied.put(np.full((1, 3), 9.0, np.float32), [4])
    assert data[4].tolist() == [7.0, 7.0, 7.0]


@pytest.mark.parametrize("as_type", ["numpy", "tensor", "list"])
def test_a_boolean_mask_as_ids_is_refused_with_advice_that_selects_its_rows(as_type, rng):
    # SpeedTorch's CuPy arrays took a mask as an index; here the error said to convert it with
    # .astype(np.int64) / .long(), which makes the mask's True and False the ids 1 and 0: rows 1
    # and 0, read or overwritten in place of the rows the mask selects.
    data = random_data(rng, (10, 3))
    gadget = ss.DataGadget(data.copy(), backend="numpy")
    mask = np.zeros(10, dtype=bool)
    mask[rng.choice(10, 3, replace=False)] = True
    ids = {"numpy": mask, "tensor": torch.from_numpy(mask), "list": mask.tolist()}[as_type]
    for call in (lambda: gadget.getData(ids), lambda: gadget.get(ids),
                 lambda: gadget.insertData(torch.ones(3, 3), ids)):
        with pytest.raises(ss.DTypeError, match="must be integers") as raised:
            call()
        message = str(raised.value)
        assert "astype(np.int64)" not in message and ".long()" not in message, message
        advice = re.search(r"np\.flatnonzero\(mask\)|mask\.nonzero\(\)\.flatten\(\)", message)
        assert advice is not None, message
        selected = (np.flatnonzero(mask) if advice.group() == "np.flatnonzero(mask)"
                    else torch.from_numpy(mask).nonzero().flatten())
        np.testing.assert_array_equal(gadget.get(selected).numpy(), data[mask])  # the advice selects its rows
    np.testing.assert_array_equal(gadget.to_numpy(), data)


def test_a_dataloader_over_a_gadget_is_refused_with_what_reads_its_rows_and_that_works(rng, tmp_path):
    # DataLoader(gadget) failed inside torch's fetcher with "'DataGadget' object is not subscriptable",
    # which names neither get() nor BatchFeeder.
    data = random_data(rng, (30, 2, 3))
    np.save(tmp_path / "x.npy", data)
    gadget = ss.DataGadget(str(tmp_path / "x.npy"), CPUPinn=True, backend="numpy")
    advice = r"read a batch with gadget.get\(ids\) \(SpeedTorch: getData\(ids\)\), or iterate whole batches " \
             r"with ss.BatchFeeder\(gadget, batch_size=...\)"
    with pytest.raises(ss.DTypeError, match=advice):
        next(iter(torch.utils.data.DataLoader(gadget, batch_size=8)))
    ids = rng.permutation(30)[:8]
    np.testing.assert_array_equal(gadget.get(ids).numpy(), data[ids])
    feeder = ss.BatchFeeder(gadget, batch_size=8, order="sequential", device="cpu")
    np.testing.assert_array_equal(torch.cat([rows for (rows,) in feeder]).numpy(), data)


def test_bad_puts_change_nothing(rng):
    data = random_data(rng, (40, 3))
    gadget = ss.DataGadget(data.copy(), backend="numpy")
    with pytest.raises(ss.ShapeError, match=r"need shape \(2, 3\)"):
        gadget.put(np.ones((2, 4), np.float32), [1, 2])
    with pytest.raises(ss.DuplicateIdError):
        gadget.put(np.ones((2, 3), np.float32), [5, 5])
    with pytest.raises(ss.IdError):
        gadget.put(np.ones((2, 3), np.float32), [5, 40])
    with pytest.raises(ss.DTypeError):
        gadget.put(np.ones((2, 3), np.float64), [1, 2])
    np.testing.assert_array_equal(gadget.to_numpy(), data)


@pytest.mark.parametrize("ids, shown", [
    (np.array([3, 2**63 + 5], dtype=np.uint64), "9223372036854775813"),
    (np.array([2**64 - 1], dtype=np.uint64), "18446744073709551615"),
    ([1, 2**63], "9223372036854775808"),
    ([2**70, 2], str(2**70)),
])
@pytest.mark.parametrize("call", ["get", "getData", "put", "insertData"])
def test_ids_beyond_int64_say_they_must_fit_int64_and_the_rows_and_change_nothing(call, ids, shown, rng):
    """Such ids said "check the vocabulary size": no vocabulary size makes an id of 2**63 or more
    a row of this data. The message names the id as given, int64, and the rows ids must lie in."""
    data = random_data(rng, (int(rng.integers(10, 50)), 3))
    gadget = ss.DataGadget(data.copy(), backend="numpy")
    n = len(ids)
    with pytest.raises(ss.IdError) as info:
        if call in ("get", "getData"):
            getattr(gadget, call)(ids)
        else:
            getattr(gadget, call)(random_data(rng, (n, 3)), ids)
    message = str(info.value)
    assert isinstance(info.value, IndexError)
    assert f"contain {shown}," in message and "int64" in message, message
    assert f"[0, {len(data)})" in message and "vocabulary" not in message, message
    np.testing.assert_array_equal(gadget.to_numpy(), data)


@pytest.mark.parametrize("as_type", [np.asarray, list, torch.tensor])
@pytest.mark.parametrize("call", ["get", "getData", "put", "insertData"])
def test_ids_past_the_last_row_say_to_check_them_against_the_rows_and_change_nothing(call, as_type, rng):
    """Ids in int64 but past the data's rows said "check the vocabulary size": a dataset has rows,
    not a vocabulary. The message names the id, the rows, and what to check."""
    data = random_data(rng, (int(rng.integers(10, 50)), 3))
    gadget = ss.DataGadget(data.copy(), backend="numpy")
    past = len(data) + int(rng.integers(0, 5))
    ids = rng.permutation(np.append(rng.choice(len(data), 3, replace=False), past))
    with pytest.raises(ss.IdError) as info:
        if call in ("get", "getData"):
            getattr(gadget, call)(as_type(ids.tolist()))
        else:
            getattr(gadget, call)(random_data(rng, (len(ids), 3)), as_type(ids.tolist()))
    message = str(info.value)
    assert isinstance(info.value, IndexError)
    assert f"contain {past}," in message and f"[0, {len(data)})" in message, message
    assert "vocabulary" not in message and "check the ids against the number of rows" in message, message
    np.testing.assert_array_equal(gadget.to_numpy(), data)


def test_read_only_sources_refuse_puts(rng, tmp_path):
    data = random_data(rng, (30, 2))
    frozen = data.copy()
    frozen.setflags(write=False)
    path = tmp_path / "ro.npy"
    np.save(path, data)
    for gadget in (ss.DataGadget(frozen, storage="pageable", backend="numpy"),
                   ss.DataGadget(np.load(path, mmap_mode="r"), backend="numpy")):
        np.testing.assert_array_equal(gadget.get([0, 29]).numpy(), data[[0, 29]])
        with pytest.raises(ss.StateError, match="read-only"):
            gadget.put(np.ones((1, 2), np.float32), [0])
    np.testing.assert_array_equal(np.load(path), data)


def test_save_load_round_trip_keeps_the_shape(backend, rng, tmp_path):
    data = random_data(rng, (120, 3, 2))
    gadget = ss.DataGadget(data, CPUPinn=True, backend=backend)
    gadget.saveCupy(tmp_path / "out.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data)
    other = random_data(rng, (9, 4))
    np.save(tmp_path / "other.npy", other)
    assert gadget.loadCupy(tmp_path / "other.npy") is gadget
    assert gadget.shape == (9, 4) and gadget.storage == "pinned"
    np.testing.assert_array_equal(gadget.get([8, 0]).cpu().numpy(), other[[8, 0]])


def test_mmap_reads_lazily_and_writes_through(backend, rng, tmp_path):
    path = tmp_path / "data.npy"
    data = random_data(rng, (300, 6))
    np.save(path, data)
    gadget = ss.DataGadget(path, mmap=True, backend=backend)
    assert "not read yet" in repr(gadget)
    assert gadget.gadgetInit() is gadget and gadget.storage == "mmap"
    ids = rng.integers(0, 300, size=100)
    np.testing.assert_array_equal(gadget.get(ids).cpu().numpy(), data[ids])
    values = random_data(rng, (2, 6))
    gadget.put(values, [10, 20])
    gadget.save(path)  # its own file: flushed in place
    data[[10, 20]] = values
    np.testing.assert_array_equal(np.load(path), data)


def test_mmap_is_chosen_when_the_file_outgrows_ram(rng, tmp_path, monkeypatch):
    path = tmp_path / "data.npy"
    data = random_data(rng, (64, 16))  # 4 KiB
    np.save(path, data)
    monkeypatch.setattr(speedswap.data.gadget, "available_ram", lambda: 4096)
    large = ss.DataGadget(path, backend="numpy")
    assert large.storage == "mmap"
    np.testing.assert_array_equal(large.get([3]).numpy(), data[[3]])
    # Mapped for its size, it is read-only: a put must not change the dataset on disk.
    with pytest.raises(ss.StateError, match="read-only.*mmap=True"):
        large.put(data[[3]] + 1, [3])
    large.close()
    np.testing.assert_array_equal(np.load(path), data)
    monkeypatch.setattr(speedswap.data.gadget, "available_ram", lambda: 1 << 30)
    assert ss.DataGadget(path, backend="numpy").storage == "device"  # CPUPinn=False
    assert ss.DataGadget(path, mmap=True, backend="numpy").storage == "mmap"


def _resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read memory use")
def test_mmap_over_a_file_far_larger_than_the_rows_touched(rng, tmp_path):
    rows, dim = 2_000_000, 256  # a 2 GiB file, sparse on disk: only the rows written use space
    path = tmp_path / "big.npy"
    big = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    touched = rng.choice(rows, size=2000, replace=False)
    values = random_data(rng, (2000, dim))
    big[touched] = values
    big.flush()
    del big
    before = _resident_bytes()
    gadget = ss.DataGadget(path, mmap=True, backend="numpy")
    order = rng.permutation(2000)
    np.testing.assert_array_equal(gadget.get(touched[order]).numpy(), values[order])
    grown = _resident_bytes() - before
    assert gadget.storage == "mmap" and gadget.table.memory()["host"] == 0
    # The kernel pages in some read-ahead around each row touched (~64 KiB), but
    # nothing like the whole file: reading it up front would add 2 GiB.
    file_bytes = rows * dim * 4
    assert grown < file_bytes // 4, f"resident memory grew by {grown} bytes reading 2000 rows"
    gadget.close()


def test_bad_files_fail_at_construction(tmp_path, rng):
    good = rng.standard_normal((10, 4)).astype(np.float32)
    np.save(tmp_path / "t.npy", good)
    raw = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "truncated.npy").write_bytes(raw[:-8])
    np.save(tmp_path / "fortran.npy", np.asfortranarray(good))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    (tmp_path / "junk.npy").write_bytes(b"not a numpy file at all")
    for name, match in [("truncated", "truncated"), ("fortran", "Fortran"),
                        ("objects", "object"), ("junk", "not a valid .npy")]:
        with pytest.raises(ss.FileFormatError, match=match):
            ss.DataGadget(tmp_path / f"{name}.npy", backend="numpy")
    np.save(tmp_path / "complex.npy", good.astype(np.complex64))
    with pytest.raises(ss.DTypeError, match="complex64"):
        ss.DataGadget(tmp_path / "complex.npy", backend="numpy")
    with pytest.raises(FileNotFoundError):
        ss.DataGadget(tmp_path / "missing.npy", backend="numpy")
    with pytest.raises(ss.OptionError, match=".npy"):
        ss.DataGadget(tmp_path / "data.h5", backend="numpy")


def test_file_changed_before_it_is_read(tmp_path, rng):
    path = tmp_path / "d.npy"
    np.save(path, rng.standard_normal((10, 4)).astype(np.float32))
    gadget = ss.DataGadget(path, backend="numpy")
    np.save(path, rng.standard_normal((11, 4)).astype(np.float32))
    with pytest.raises(ss.FileFormatError, match=r"\(11, 4\)"):
        gadget.gadgetInit()


@pytest.mark.parametrize("make, error, match", [
    (lambda: ss.DataGadget(np.ones((3, 2), np.float32), mmap=True), ss.OptionError, "already in memory"),
    (lambda: ss.DataGadget(np.ones((3, 2), np.float32), storage="mmap"), ss.OptionError, "mmap=True"),
    (lambda: ss.DataGadget(np.ones((3, 2), np.float32), storage="gpu"), ss.OptionError, "storage"),
    (lambda: ss.DataGadget(np.ones((3, 2), np.float32), mmap="yes"), ss.OptionError, "mmap"),
    (lambda: ss.DataGadget(np.ones((0, 2), np.float32)), ss.ShapeError, "at least one row"),
    (lambda: ss.DataGadget(np.float32(3.0)), ss.ShapeError, "at least one row"),
    (lambda: ss.DataGadget(np.array(["a", "b"])), ss.DTypeError, "not supported"),
    (lambda: ss.DataGadget(np.arange(6, dtype=np.uint16).reshape(3, 2)), ss.DTypeError,
     r"not uint16.*BatchFeeder\(np.load\(path, mmap_mode='r'\)\)"),
    (lambda: ss.DataGadget(np.arange(6, dtype=np.uint32).reshape(3, 2)), ss.DTypeError, "BatchFeeder"),
    # Token ids from a big-endian file were told "uint16 is not supported", without the reader that takes them.
    (lambda: ss.DataGadget(np.arange(6, dtype=">u2").reshape(3, 2)), ss.DTypeError, r"not uint16.*BatchFeeder"),
    # Objects that hold no numbers were called "0-d" data (np.asarray makes a 0-d object array of them).
    (lambda: ss.DataGadget(None), ss.DTypeError, "the dataset is a NoneType, not numbers"),
    (lambda: ss.DataGadget({"x": [1.0, 2.0]}), ss.DTypeError, "is a dict, not numbers"),
    (lambda: ss.DataGadget(ss.DataGadget(np.ones((3, 2), np.float32))), ss.DTypeError,
     "is a DataGadget, not numbers"),
    (lambda: ss.DataGadget([[1.0, None]]), ss.DTypeError, "is a list, not numbers"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("read_first", [True, False])
def test_closed_gadget_says_so(rng, kind, tmp_path, read_first):
    # Closed before its first read, it read the data again on the next get (and fed a BatchFeeder);
    # its repr raised the StateError instead of saying it was closed.
    data = random_data(rng, (5, 2))
    gadget = gadget_of(data, kind, tmp_path, backend="numpy")
    if read_first:
        gadget.get([0])
    gadget.close()
    assert gadget.closed and "closed" in repr(gadget)
    np.save(tmp_path / "other.npy", random_data(rng, (3, 2)))
    for use in (lambda: gadget.get([0]), lambda: ss.BatchFeeder(gadget, batch_size=2, device="cpu"),
                lambda: gadget.load(tmp_path / "other.npy")):
        with pytest.raises(ss.StateError, match="closed"):
            use()


def test_a_mapped_file_truncated_after_opening_raises_not_sigbus(rng, tmp_path):
    path = tmp_path / "data.npy"
    np.save(path, random_data(rng, (4096, 64)))
    gadget = ss.DataGadget(path, mmap=True, backend="numpy")
    gadget.get([0, 4095])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ss.FileFormatError, match="truncated"):
        gadget.get([4095])


_TRUNCATED_UNDER_A_GADGET = textwrap.dedent("""
    import os, sys, numpy as np, speedswap as ss
    path = sys.argv[1]
    np.save(path, np.random.default_rng(int(sys.argv[2])).uniform(1, 2, (4096, 64)).astype(np.float32))
    gadget = ss.DataGadget(path, mmap=True, backend="numpy")
    gadget.get([4095])
    os.truncate(path, os.path.getsize(path) // 2)
    calls = {"put": lambda: gadget.put(np.ones((1, 64), np.float32), [4095]),
             "save": lambda: gadget.save(path + ".copy.npy"),
             "getNumpyVersion": gadget.getNumpyVersion}
    for name, call in calls.items():
        try:
            call()
        except ss.FileFormatError as exc:
            print(name, "raised:", exc, flush=True)
""")


def test_every_call_on_a_mapped_file_truncated_after_opening_raises_not_sigbus(rng, tmp_path):
    # Only get checked the file: a put into a row past the new end, a save or getNumpyVersion
    # copying the rows, ended the process with SIGBUS.
    path = tmp_path / "data.npy"
    done = subprocess.run([sys.executable, "-c", _TRUNCATED_UNDER_A_GADGET, str(path), str(rng.integers(2**31))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stderr}"
    for name in ("put", "save", "getNumpyVersion"):
        assert f"{name} raised:" in done.stdout and "truncated" in done.stdout, done.stdout + done.stderr
    assert os.listdir(tmp_path) == ["data.npy"]  # the save wrote nothing


@pytest.mark.parametrize("rewrite, now", [(np.float64, "float64 (4,)"), (np.float32, "float32 (8,)")])
def test_a_mapped_file_rewritten_in_place_with_another_header_is_refused_not_read_as_the_old_one(
        rng, tmp_path, rewrite, now):
    # np.save by another writer to the path truncates and rewrites the very file the gadget maps:
    # get read the new bytes where the old header put its rows, float64 halves as float32 values.
    path = tmp_path / "data.npy"
    data = random_data(rng, (4096, 4))
    np.save(path, data)
    gadget = ss.DataGadget(path, mmap=True, backend="numpy")
    np.testing.assert_array_equal(gadget.get([7, 4095]).numpy(), data[[7, 4095]])
    gadget.put(-data[:2], [0, 1])  # writes through the map: the file changes, its header not
    np.testing.assert_array_equal(gadget.get([1, 7]).numpy(), np.stack([-data[1], data[7]]))
    new = random_data(rng, (4096, 4)).astype(rewrite).reshape(-1, *((8,) if rewrite is np.float32 else (4,)))
    done = subprocess.run([sys.executable, "-c", f"import numpy as np, sys; np.save({str(path)!r}, "
                           f"np.frombuffer(sys.stdin.buffer.read(), {new.dtype.str!r}).reshape({new.shape}))"],
                          input=new.tobytes(), timeout=120)
    assert done.returncode == 0
    for call in (lambda: gadget.get([7]), lambda: gadget.put(data[:2], [0, 1])):
        with pytest.raises(ss.FileFormatError, match=rf"rewritten in place with another .npy header.*now "
                                                     rf"holds rows of {re.escape(now)}"):
            call()
    np.testing.assert_array_equal(np.load(path), new)  # the refused put wrote nothing into the new file
    gadget.close()
    fresh = ss.DataGadget(path, mmap=True, backend="numpy")  # what the message says to do
    np.testing.assert_array_equal(fresh.get([7]).numpy(), new[[7]])
    fresh.close()


@pytest.mark.parametrize("change", ["removed", "replaced by a shorter file"])
def test_a_mapped_file_removed_or_replaced_by_rename_still_gives_its_rows(rng, tmp_path, change):
    path = tmp_path / "data.npy"
    data = random_data(rng, (64, 8))
    np.save(path, data)
    gadget = ss.DataGadget(path, mmap=True, backend="numpy").read()
    if change == "removed":
        os.unlink(path)
    else:  # the map keeps the old file: a shorter new one at the path is no truncation of it
        np.save(tmp_path / "new.npy", data[:3])
        os.replace(tmp_path / "new.npy", path)
    np.testing.assert_array_equal(gadget.get([63, 0]).numpy(), data[[63, 0]])
    gadget.close()


def test_a_mapped_file_whose_directory_was_moved_and_replaced_by_a_file_still_gives_its_rows(rng, tmp_path):
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "x.npy"
    data = random_data(rng, (64, 8))
    np.save(path, data)
    gadget = ss.DataGadget(path, mmap=True, backend="numpy").read()
    os.rename(tmp_path / "data", tmp_path / "moved")
    (tmp_path / "data").write_bytes(b"")  # the path now fails with ENOTDIR, not ENOENT
    np.testing.assert_array_equal(gadget.get([63, 0]).numpy(), data[[63, 0]])
    gadget.close()


@pytest.mark.parametrize("mmap", [False, True])
def test_a_relative_path_names_the_file_of_the_directory_the_gadget_was_built_in(rng, tmp_path, monkeypatch,
                                                                                 mmap):
    data = {}
    for name in ("train", "test"):  # the same file name and shape in two directories
        (tmp_path / name).mkdir()
        data[name] = random_data(rng, (40, 3))
        np.save(tmp_path / name / "x.npy", data[name])
    monkeypatch.chdir(tmp_path / "train")
    gadget = ss.DataGadget("x.npy", mmap=mmap, backend="numpy")  # rows read on first use
    monkeypatch.chdir(tmp_path / "test")
    np.testing.assert_array_equal(gadget.get([0, 39]).numpy(), data["train"][[0, 39]])
    assert gadget.path == str(tmp_path / "train" / "x.npy")
    gadget.close()


@pytest.mark.parametrize("held", ["array", "file"])
def test_a_load_that_fails_reading_the_rows_keeps_the_old_data(rng, tmp_path, monkeypatch, held):
    data = random_data(rng, (30, 3))
    gadget = gadget_of(data.copy(), held, tmp_path, mmap=False, storage="pinned", backend="numpy")
    gadget.put(np.full((1, 3), 5.0, np.float32), [7])  # rows only this gadget holds
    data[7] = 5.0
    np.save(tmp_path / "other.npy", random_data(rng, (11, 4)))

    def no_room(*args, **kwargs):  # as pinning a file too large for the page-locked memory left
        raise ss.OutOfMemoryError("no page-locked memory left for the rows")

    monkeypatch.setattr(ss.HostTable, "empty", no_room)
    with pytest.raises(ss.OutOfMemoryError):
        gadget.load(tmp_path / "other.npy")
    monkeypatch.undo()
    assert gadget.shape == (30, 3) and gadget.path == (str(tmp_path / "data.npy") if held == "file" else None)
    np.testing.assert_array_equal(gadget.to_numpy(), data)
    np.testing.assert_array_equal(gadget.get([7, 29]).numpy(), data[[7, 29]])
    assert gadget.load(tmp_path / "other.npy").shape == (11, 4)  # and a load that can succeed does


def test_a_load_whose_old_rows_fail_to_flush_holds_the_new_file_consistently(rng, tmp_path, monkeypatch):
    path = tmp_path / "data.npy"
    np.save(path, random_data(rng, (30, 3)))
    gadget = ss.DataGadget(path, mmap=True, backend="numpy")
    old = gadget.table
    other = random_data(rng, (11, 4))
    np.save(tmp_path / "other.npy", other)

    def disk_error(buffer):  # as msync failing on the old file's disk (close syncs, without flush's checks)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(old, "_sync", disk_error)
    with pytest.raises(OSError):
        gadget.load(tmp_path / "other.npy")
    assert gadget.table is not old and gadget.shape == (11, 4)
    np.testing.assert_array_equal(gadget.get([10, 0]).numpy(), other[[10, 0]])


@pytest.mark.parametrize("storage", ["pageable", "pinned", "device"])
def test_a_cpu_bfloat16_tensor_is_held_and_delivered_as_bfloat16(backend, storage, rng, tmp_path):
    """DataGadget refused CPU bfloat16 (numpy has no bfloat16), which HostTable and BatchFeeder take."""
    values = torch.from_numpy(random_data(rng, (300, 3, 4))).to(torch.bfloat16)
    gadget = ss.data.gadget.DataGadget(values, storage=storage, backend=backend)
    ids = rng.integers(0, 300, size=(5, 40))  # duplicates
    got = gadget.get(ids)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (5, 40, 3, 4)
    assert torch.equal(got.cpu(), values[torch.from_numpy(ids)])
    new = torch.from_numpy(random_data(rng, (2, 3, 4))).to(torch.bfloat16)
    gadget.put(new.to(gadget.device), [7, 11])
    values[[7, 11]] = new
    gadget.save(tmp_path / "saved.npy")  # float32, which holds every bfloat16 value exactly
    saved = np.load(tmp_path / "saved.npy")
    assert saved.dtype == np.float32
    np.testing.assert_array_equal(saved, values.float().numpy())


@pytest.mark.parametrize("mmap", [None, False])
def test_big_endian_rows_are_read_in_this_machines_byte_order(backend, kind, mmap, rng, tmp_path):
    """A big-endian file or array was refused ('other byte order'): its values are read swapped."""
    data = random_data(rng, (400, 6)).astype(">f4")
    gadget = gadget_of(data, kind, tmp_path, mmap=mmap, backend=backend)
    ids = rng.integers(0, 400, size=250)
    got = gadget.get(ids)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.cpu().numpy(), data[ids])
    np.testing.assert_array_equal(gadget.to_numpy(copy=True), data)


def test_big_endian_rows_are_refused_where_they_would_be_mapped(rng, tmp_path, monkeypatch):
    path = tmp_path / "big.npy"
    data = random_data(rng, (64, 16)).astype(">f4")
    np.save(path, data)
    with pytest.raises(ss.DTypeError, match="big-endian.*mmap=True.*pass mmap=False"):
        ss.DataGadget(path, mmap=True, backend="numpy")
    with pytest.raises(ss.DTypeError, match="this memmap.*big-endian.*pass mmap=False"):
        ss.DataGadget(np.load(path, mmap_mode="r"), mmap=True, backend="numpy")
    monkeypatch.setattr(speedswap.data.gadget, "available_ram", lambda: 4096)  # too large to copy: mapped
    gadget = ss.DataGadget(path, backend="numpy")
    with pytest.raises(ss.DTypeError, match="3/4 of the RAM available.*pass mmap=False"):
        gadget.get([1])
    np.testing.assert_array_equal(ss.DataGadget(path, mmap=False, backend="numpy").get([1]).numpy(), data[[1]])


# Read: the file is opened again after the check, and found changed (a truncation once it is open ends the read early).
@pytest.mark.parametrize("mmap, match", [(False, "changed or replaced since it was verified"), (True, "truncated")])
def test_a_file_truncated_while_it_is_read_or_mapped_raises_a_file_format_error(rng, tmp_path, monkeypatch,
                                                                                 mmap, match):
    path = tmp_path / "data.npy"
    np.save(path, random_data(rng, (4096, 64)))
    gadget = ss.DataGadget(path, mmap=mmap, backend="numpy")
    checked = speedswap.files.check_matches

    def truncated_after_the_check(*args):  # as another process truncating the file just then
        checked(*args)
        os.truncate(path, os.path.getsize(path) // 2)

    monkeypatch.setattr(speedswap.files, "check_matches", truncated_after_the_check)
    with pytest.raises(ss.FileFormatError, match=match):
        gadget.read()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", ">f4", "bfloat16"])
def test_dtype_is_known_before_the_rows_are_read(kind, dtype, rng, tmp_path):
    """dtype read the whole table (into RAM, or pinned) to answer, so a BatchFeeder that needs a row's
    bytes to check its arguments read its gadgets before it could refuse them."""
    if dtype == "bfloat16" and kind == "file":
        pytest.skip(".npy files have no bfloat16")
    data = random_data(rng, (50, 3), np.float32 if dtype == "bfloat16" else dtype)
    expected = data[[4, 0, 4]].astype(np.float32)
    if dtype == "bfloat16":  # a CPU tensor, held as it is
        data = torch.from_numpy(data).to(torch.bfloat16)
        expected = data[[4, 0, 4]].float().numpy()
    gadget = gadget_of(data, kind, tmp_path, backend="numpy")
    known = gadget.dtype
    assert "not read yet" in repr(gadget)
    got = gadget.get([4, 0, 4])
    assert known == gadget.table.dtype == got.dtype
    np.testing.assert_array_equal(got.float().numpy(), expected)


def test_mmap_takes_numpys_bools_and_refuses_other_truthy_values(rng, tmp_path):
    """mmap=np.True_ (a flag read from a numpy config) passed the check but not `mmap is True`: the
    file was mapped read-only and put raised StateError, where mmap=True writes through; mmap=1 too."""
    path = tmp_path / "data.npy"
    data = random_data(rng, (30, 4))
    np.save(path, data)
    gadget = ss.data.gadget.DataGadget(path, mmap=np.True_, backend="numpy")
    values = random_data(rng, (2, 4))
    gadget.put(values, [3, 17])
    gadget.flush()
    data[[3, 17]] = values
    np.testing.assert_array_equal(np.load(path), data)
    assert ss.data.gadget.DataGadget(path, mmap=np.False_, backend="numpy").storage == "pageable"
    for bad in (1, 0, "yes"):
        with pytest.raises(ss.OptionError, match="mmap must be True, False or None"):
            ss.data.gadget.DataGadget(path, mmap=bad, backend="numpy")


def test_two_threads_first_use_keeps_the_rows_one_of_them_wrote(rng, tmp_path, monkeypatch):
    """A gadget reads its rows on first use. Two threads using it first at once each read the file
    into a table of their own, and the one installed last replaced the other: rows a thread had
    put into the replaced table were lost, without an error."""
    path = tmp_path / "data.npy"
    data = random_data(rng, (40, 3))
    np.save(path, data)
    gadget = ss.data.gadget.DataGadget(path, backend="numpy")
    build, calls, put_done = speedswap.data.gadget.DataGadget._build_table, [], threading.Event()

    def slow_first_build(self, held):
        calls.append(threading.current_thread().name)
        table = build(self, held)
        if len(calls) == 1:  # the first reader is still reading while the other reads, installs, puts
            put_done.wait(10)
        return table

    monkeypatch.setattr(speedswap.data.gadget.DataGadget, "_build_table", slow_first_build)
    values = random_data(rng, (2, 3))

    def reader():
        gadget.get([0])

    def writer():
        while not calls:  # the reader thread is reading
            time.sleep(0.001)
        gadget.put(values, [5, 9])
        put_done.set()

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert len(calls) == 2  # both read the file: the case this test is about
    data[[5, 9]] = values
    np.testing.assert_array_equal(gadget.to_numpy(), data)


def close_once_the_rows_are_read(monkeypatch):
    """Make every gadget's reads of rows close it from another thread once they are read.

    Returns:
        the list that each read's description with its table is appended to.
    """
    build, built = speedswap.data.gadget.DataGadget._build_table, []

    def closed_while_reading(self, held):
        built.append(build(self, held))
        closer = threading.Thread(target=self.close)
        closer.start()
        closer.join(10)
        return built[-1]

    monkeypatch.setattr(speedswap.data.gadget.DataGadget, "_build_table", closed_while_reading)
    return built


def test_a_gadget_closed_while_its_first_use_reads_releases_the_rows_read(rng, tmp_path, monkeypatch):
    """close() on one thread while another thread's first use was reading the rows: the read table
    was installed in the closed gadget afterwards, held (page-locked memory, for a pinned gadget)
    for the gadget's life, and that first use returned rows of a closed gadget."""
    path = tmp_path / "data.npy"
    np.save(path, random_data(rng, (40, 3)))
    gadget = ss.data.gadget.DataGadget(path, storage="pinned", backend="numpy")
    built = close_once_the_rows_are_read(monkeypatch)
    with pytest.raises(ss.StateError, match="closed"):
        gadget.get([0])
    assert gadget.closed and built[0].table.closed  # the rows read are released, not held by the gadget


def test_a_gadget_closed_while_a_load_reads_the_new_rows_holds_none_of_them(rng, tmp_path, monkeypatch):
    """close() on one thread while load() on another read the new file: load installed the rows it
    read into the closed gadget afterwards (page-locked memory, for a pinned gadget, held for the
    gadget's life) and returned as if it had loaded them."""
    path, other = tmp_path / "data.npy", tmp_path / "other.npy"
    np.save(path, random_data(rng, (40, 3)))
    np.save(other, random_data(rng, (17, 5)))
    gadget = ss.data.gadget.DataGadget(path, storage="pinned", backend="numpy").read()
    old = gadget.table
    built = close_once_the_rows_are_read(monkeypatch)
    with pytest.raises(ss.StateError, match="closed"):
        gadget.load(other)
    assert gadget.closed and old.closed and built[0].table.closed  # neither the old rows nor the new are held
    assert gadget.shape == (40, 3) and gadget.path == str(path)  # the data it held when closed


def test_a_load_failing_while_another_thread_reads_the_gadget_first_keeps_the_old_data(rng, tmp_path,
                                                                                      monkeypatch):
    """load() described the gadget as the new file while it read it, and put the old description back
    if the read failed: a first use on another thread meanwhile read and kept the new file's rows,
    so after the failed load the gadget served them under the old file's name and shape."""
    old, new = random_data(rng, (30, 6)), random_data(rng, (20, 6))
    path, other = tmp_path / "data.npy", tmp_path / "other.npy"
    np.save(path, old)
    np.save(other, new)
    gadget = ss.data.gadget.DataGadget(path, backend="numpy")  # rows not read yet
    build, loads = speedswap.data.gadget.DataGadget._build_table, []

    def first_use_meanwhile_then_no_room(self, *args):
        if loads:  # the other thread's first use
            return build(self, *args)
        loads.append(args)
        reader = threading.Thread(target=self.read)
        reader.start()
        reader.join(10)
        raise ss.OutOfMemoryError("no page-locked memory left for the rows")

    monkeypatch.setattr(speedswap.data.gadget.DataGadget, "_build_table", first_use_meanwhile_then_no_room)
    with pytest.raises(ss.OutOfMemoryError):
        gadget.load(other)
    monkeypatch.undo()
    assert gadget.shape == (30, 6) and gadget.path == str(path)
    np.testing.assert_array_equal(gadget.get([0, 29]).numpy(), old[[0, 29]])
    np.testing.assert_array_equal(gadget.to_numpy(), old)


def test_a_gadget_read_while_a_load_reads_the_new_file_gives_the_old_data_in_its_shape(rng, tmp_path,
                                                                                      monkeypatch):
    """load() described the gadget as the new file while it read it, its table still the old one's:
    a get() on another thread meanwhile gave the old rows in the new file's row shape (or a raw
    RuntimeError from the view where the sizes differ), and len() the new file's."""
    old, new = random_data(rng, (30, 6)), random_data(rng, (20, 2, 3))
    path, other = tmp_path / "data.npy", tmp_path / "other.npy"
    np.save(path, old)
    np.save(other, new)
    gadget = ss.data.gadget.DataGadget(path, backend="numpy").read()
    build, seen = speedswap.data.gadget.DataGadget._build_table, []

    def read_meanwhile(self, *args):
        reader = threading.Thread(target=lambda: seen.append((len(self), self.get([0, 29]).numpy())))
        reader.start()
        reader.join(10)
        return build(self, *args)

    monkeypatch.setattr(speedswap.data.gadget.DataGadget, "_build_table", read_meanwhile)
    gadget.load(other)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0][0] == 30
    np.testing.assert_array_equal(seen[0][1], old[[0, 29]])
    assert gadget.shape == (20, 2, 3)
    np.testing.assert_array_equal(gadget.get([19, 0]).numpy(), new[[19, 0]])


def waits(thread) -> bool:
    """Whether ``thread`` is blocked in the wait of a :mod:`threading` Condition or Event, or in a DataGadget's
    wait for the calls under way (on the lock of each: C, so it shows as the waiting function's frame)."""
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and (frame.f_code.co_filename, frame.f_code.co_name) in {
        (threading.__file__, "wait"), (ss.data.gadget.__file__, "_close_unused")}


@pytest.mark.parametrize("ending", ["load", "close"])
@pytest.mark.parametrize("call", ["get", "put", "to_numpy"])
def test_a_call_under_way_when_another_thread_replaces_the_rows_completes_on_the_old_ones(
        rng, tmp_path, monkeypatch, call, ending):
    """load() (or close()) on one thread closed the old table while a get, put or to_numpy on another
    had already taken it: the call then failed half-way with "this HostTable is closed; its memory was
    released", about a gadget that was open (for a load) and that it had begun to read."""
    old, ids = random_data(rng, (30, 6)), rng.choice(30, size=5, replace=False)
    path, other = tmp_path / "data.npy", tmp_path / "other.npy"
    np.save(path, old)
    np.save(other, random_data(rng, (20, 4)))
    values = random_data(rng, (5, 6))
    gadget = ss.data.gadget.DataGadget(path, mmap=True, backend="numpy").read()
    table, ender = gadget.table, threading.Thread(target=getattr(gadget, ending), args=(other,)[:ending == "load"])
    method = {"get": "gather", "put": "scatter", "to_numpy": "to_numpy"}[call]
    taken, original, seen = threading.Event(), getattr(table, method), []

    def once_the_ender_closed_or_waits(*args, **kwargs):
        taken.set()
        # The ender closes the table at once, waits for this call, or ends without closing it.
        while not (table.closed or waits(ender) or ender.ident and not ender.is_alive()):
            time.sleep(0.001)
        return original(*args, **kwargs)

    monkeypatch.setattr(table, method, once_the_ender_closed_or_waits)
    args = {"get": (ids,), "put": (values, ids), "to_numpy": ()}[call]

    def make_the_call():
        try:
            seen.append(getattr(gadget, call)(*args))
        except Exception as exc:  # raised by the test below, not lost in the thread
            seen.append(exc)

    caller = threading.Thread(target=make_the_call)
    caller.start()
    assert taken.wait(10)
    ender.start()
    caller.join(10)
    ender.join(10)
    assert not caller.is_alive() and not ender.is_alive() and table.closed
    (result,) = seen
    if isinstance(result, Exception):
        raise result
    if call == "get":
        np.testing.assert_array_equal(result.numpy(), old[ids])
    elif call == "to_numpy":
        np.testing.assert_array_equal(result, old)
    else:  # the write reached the old file, flushed when its table closed after it
        expected = old.copy()
        expected[ids] = values
        np.testing.assert_array_equal(np.load(path), expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("at_the_fork", ["a thread holds the lock", "a thread is inside get"])
def test_a_process_forked_while_a_thread_uses_the_gadget_can_read_load_and_close_it(rng, tmp_path, monkeypatch,
                                                                                  at_the_fork):
    """Every get counts itself under the gadget's lock, and load/close wait for the count. A process
    forked (a DataLoader worker) while another thread held that lock, or was inside a get, inherited
    the lock held or the count up, for a thread the child does not have: the child's next get waited
    on the lock for good, or its load/close waited for that get for good."""
    old, new, ids = random_data(rng, (30, 4)), random_data(rng, (12, 3)), rng.choice(12, size=5)
    other = tmp_path / "other.npy"
    np.save(other, new)
    gadget = ss.data.gadget.DataGadget(old, backend="numpy").read()
    table, entered, release = gadget.table, threading.Event(), threading.Event()
    gather = table.gather

    def held_up(*args, **kwargs):
        entered.set()
        release.wait(10)
        return gather(*args, **kwargs)

    def child():
        signal.alarm(60)  # a child waiting for good is killed: status 14 (not sooner: a loaded runner is slow)
        release.set()  # the child's own gets are not held up
        same = np.array_equal(gadget.get(ids).numpy(), old[ids])
        same &= np.array_equal(gadget.load(other).get(ids).numpy(), new[ids])
        gadget.close()
        return 0 if same else 3

    monkeypatch.setattr(table, "gather", held_up)
    inside = threading.Thread(target=gadget.get, args=(ids,))
    try:
        if at_the_fork == "a thread is inside get":
            inside.start()
            assert entered.wait(10)
        with gadget._installing if at_the_fork == "a thread holds the lock" else contextlib.nullcontext():
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = child()
                finally:
                    os._exit(code)
    finally:
        release.set()
        if inside.ident:
            inside.join(10)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


@pytest.mark.parametrize("ending", ["load", "close"])
def test_a_load_or_close_inside_a_get_on_the_same_thread_does_not_wait_for_itself(rng, tmp_path, monkeypatch,
                                                                                   ending):
    """load/close wait for the calls under way on the old table, but not for their own thread's: a
    signal handler (or a count an interrupt left behind) closing the gadget inside a get would wait
    for a call that can only go on once it returns. The get then fails clearly instead."""
    old, ids = random_data(rng, (30, 6)), rng.choice(30, size=5, replace=False)
    path, other = tmp_path / "data.npy", tmp_path / "other.npy"
    np.save(path, old)
    np.save(other, random_data(rng, (20, 4)))
    gadget = ss.data.gadget.DataGadget(path, backend="numpy").read()
    table, seen = gadget.table, []
    original = table.gather

    def ended_inside(*args, **kwargs):
        getattr(gadget, ending)(*(other,)[:ending == "load"])
        seen.append("ended")
        return original(*args, **kwargs)

    monkeypatch.setattr(table, "gather", ended_inside)

    def get():
        try:
            seen.append(gadget.get(ids))
        except ss.StateError as exc:
            seen.append(exc)

    caller = threading.Thread(target=get, daemon=True)  # blocked for good before the fix
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), f"{ending}() inside a get waited for its own thread"
    assert seen[0] == "ended" and table.closed
    assert isinstance(seen[1], ss.StateError) and "closed" in str(seen[1])
    if ending == "load":
        assert gadget.shape == (20, 4)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_inside_a_get_ends_that_get_and_closes_the_gadget_in_both(rng, tmp_path, monkeypatch):
    """A forked child starts with no calls of the parent's other threads under way (they are not in
    the child), but the thread that forked inside a get goes on with it in the child too: the child
    had dropped that get's count as well, so its end of the get raised KeyError."""
    data, ids = random_data(rng, (30, 4)), rng.choice(30, size=5)
    gadget = ss.data.gadget.DataGadget(data, backend="numpy").read()
    table, parent, pids = gadget.table, os.getpid(), []
    gather = table.gather

    def forking(*args, **kwargs):
        pids.append(os.fork())
        return gather(*args, **kwargs)

    def closes_from_another_thread() -> bool:
        closer = threading.Thread(target=gadget.close, daemon=True)  # waits for good on a count left up
        closer.start()
        closer.join(10)
        return not closer.is_alive() and gadget.closed

    monkeypatch.setattr(table, "gather", forking)
    try:
        got = gadget.get(ids)
    except BaseException as exc:
        if os.getpid() == parent:
            raise
        (tmp_path / "child.txt").write_text(repr(exc))
        os._exit(4)
    if os.getpid() != parent:  # the child, killed by SIGALRM should it wait for good
        code = 1
        try:
            signal.alarm(15)
            monkeypatch.undo()  # the child's own gets do not fork
            same = np.array_equal(got.numpy(), data[ids]) and np.array_equal(gadget.get(ids).numpy(), data[ids])
            code = 0 if same and closes_from_another_thread() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pids[0], 0)
    said = (tmp_path / "child.txt").read_text() if (tmp_path / "child.txt").exists() else ""
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x} {said}"
    np.testing.assert_array_equal(got.numpy(), data[ids])
    assert closes_from_another_thread(), "the parent's close waited for the get that forked"


def test_a_ctrl_c_anywhere_in_a_get_leaves_no_call_under_way(rng):
    """A get counts itself as under way while it uses the gadget's table; a close or load on another
    thread waits for it. An interrupt (Ctrl-C) that landed after the count and before the with block
    that ends it (as the lock was let go), or as that block ended (on entering its __exit__) left the
    count up for good: the close, or load, waited forever for a get that had ended. Python runs a
    signal handler on entering a function or after a call into C returns; here KeyboardInterrupt is
    raised at each such point of the gadget's code in a get, one per get, and after each a close from
    another thread must not wait."""
    gadget_class, module = ss.data.gadget.DataGadget, ss.data.gadget.__file__
    data, ids = random_data(rng, (40, 3)), rng.choice(40, size=6)

    def get_interrupted_at(point):
        """A get with KeyboardInterrupt raised at its ``point``-th such point: where, or None past the last."""
        seen, where = [0], []

        def profile(frame, event, arg):
            if where or frame.f_code.co_filename != module or event not in ("call", "c_return"):
                return
            if seen[0] == point:
                where.append(f"{frame.f_code.co_name}:{frame.f_lineno} ({event} {getattr(arg, '__name__', '')})")
                raise KeyboardInterrupt
            seen[0] += 1

        sys.setprofile(profile)
        try:
            np.testing.assert_array_equal(gadget.get(ids).numpy(), data[ids])
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        return where[0] if where else None

    hung, points = [], []
    while True:
        gadget = gadget_class(data, backend="numpy").read()
        where = get_interrupted_at(len(points))
        closer = threading.Thread(target=gadget.close, daemon=True)  # waits for good on a count left up
        closer.start()
        closer.join(10)
        if closer.is_alive():
            hung.append(where)
        if where is None:
            break
        points.append(where)
    assert any(point.startswith("_take") for point in points) and not hung, \
        f"close() waited for a get interrupted at {hung} (of {points})"


def test_a_close_from_a_signal_handler_anywhere_in_a_get_ends_the_get_and_closes_the_gadget(rng):
    """A signal handler closing the gadget (a SIGTERM handler's cleanup) runs between two steps of the
    interrupted get, on its thread. Where the get held the gadget's lock (counting itself, giving its
    count back), close() waited for that lock, which only the interrupted get could let go: the
    process hung. Python runs a handler on entering a function or after a call into C returns; here
    close() runs at each such point of a get, one per get, which must end with its rows or a
    StateError, the gadget closed."""
    gadget_class, in_use = ss.data.gadget.DataGadget, ss.data.gadget._InUse
    codes = {f.__code__ for f in (gadget_class.get, gadget_class._take, gadget_class._live,
                                  in_use.__enter__, in_use.__exit__.fget)}
    data, ids = random_data(rng, (40, 3)), rng.choice(40, size=6)

    def get_closed_at(gadget, point, outcome):
        """A get with close() run at its ``point``-th such point; appends where, then its rows or error."""
        seen = [0]

        def profile(frame, event, arg):
            if frame.f_code in codes and event in ("call", "c_return"):
                if seen[0] == point:
                    outcome.append(f"{frame.f_code.co_name}:{frame.f_lineno} ({event} {getattr(arg, '__name__', '')})")
                    gadget.close()  # what the handler does
                seen[0] += 1

        sys.setprofile(profile)
        try:
            outcome.append(gadget.get(ids).numpy())
        except ss.StateError as exc:
            outcome.append(exc)
        finally:
            sys.setprofile(None)

    hung, points = [], 0
    while True:
        gadget, outcome = gadget_class(data, backend="numpy").read(), []
        getter = threading.Thread(target=get_closed_at, args=(gadget, points, outcome), daemon=True)
        getter.start()  # on a thread of its own: blocked for good before the fix
        getter.join(10)
        if getter.is_alive():
            hung.append(outcome[0])
            points += 1
            continue
        if len(outcome) == 1:  # past the last point: the get ended without a close
            np.testing.assert_array_equal(outcome[0], data[ids])
            break
        where, got = outcome
        assert gadget.closed, where
        assert isinstance(got, ss.StateError) and "closed" in str(got) or np.array_equal(got, data[ids]), \
            f"{where}: {got!r}"
        points += 1
    assert points > 5 and not hung, f"a close from a signal handler at {hung} waited for the get it interrupted"
