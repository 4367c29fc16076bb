"""Streaming a dataset larger than RAM through BatchFeeder: what a demanding user's review found."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import speedswap as ss
import speedswap.data.feeder as feeder_module
import speedswap.data.gadget as gadget_module


def zipf_tokens(rng, n):
    """``n`` int32 token ids, Zipf-distributed as real token streams are."""
    return (rng.zipf(1.2, n) % 50_000).astype(np.int32)


@pytest.mark.parametrize("order, per_row", [("random", 32)])
def test_more_rows_than_the_ram_can_hold_an_epochs_order_of_are_refused_before_the_gadget_is_read(
        tmp_path, rng, monkeypatch, order, per_row):
    """A 1-D file of int32 tokens is 4 bytes a row, but each random epoch's order holds int64 ids for
    every row (and the next epoch's, drawn ahead): 16 to 30 bytes a row at the peak. A 4 GiB token file
    was taken without a word and ran out of memory at the first batch (numpy's MemoryError inside the
    file reader, under a 12 GiB address-space limit) or was killed for it by the kernel. (Block and
    sequential orders hold no ids since review-l, and are not refused: tests/test_lazy_orders.py.)"""
    n = int(rng.integers(3000, 5000))
    tokens = zipf_tokens(rng, n)
    np.save(tmp_path / "tokens.npy", tokens)
    mapped = np.load(tmp_path / "tokens.npy", mmap_mode="r")
    gadget = ss.DataGadget(str(tmp_path / "tokens.npy"), backend="numpy")
    ram = 4 * (n * per_row) // 3  # 3/4 of it is one row short of the order's ids
    monkeypatch.setattr(feeder_module, "available_ram", lambda: ram - 4)
    for source in (mapped, gadget):
        with pytest.raises(ss.OutOfMemoryError, match=rf"{n:,} rows, .*order holds ids for every row.*"
                                                      rf"{n * per_row:,} bytes.*order=\"block\".*reshape\(-1, 512\)"):
            ss.BatchFeeder(source, batch_size=64, order=order, device="cpu")
    assert "not read yet" in repr(gadget)
    # The remedy the message names: fewer, wider rows, a view of the same map. Its batches are the
    # map's rows as numpy indexes them, every row once an epoch.
    k = 8
    rows = mapped[:n - n % k].reshape(-1, k)
    feeder = ss.BatchFeeder(rows, np.arange(len(rows)), batch_size=16, order=order, seed=5, device="cpu")
    seen = []
    for batch, ids in feeder:
        np.testing.assert_array_equal(batch.numpy(), tokens[:n - n % k].reshape(-1, k)[ids.numpy()])
        seen.append(ids.numpy())
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(len(rows)))
    # With room for the ids, the 1-D source is taken and read as numpy indexes it.
    monkeypatch.setattr(feeder_module, "available_ram", lambda: ram + 4)
    for source in (mapped, gadget):
        feeder = ss.BatchFeeder(source, np.arange(n), batch_size=64, order=order, seed=5, device="cpu")
        for batch, ids in feeder:
            np.testing.assert_array_equal(batch.numpy(), tokens[ids.numpy()])


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">u2"])
def test_a_big_endian_file_too_large_to_read_whole_is_refused_with_a_rewrite_that_never_reads_it_whole(
        tmp_path, rng, monkeypatch, dtype):
    """A map of a big-endian .npy given to the feeder, or one a DataGadget maps because it outgrows the
    RAM, was refused with a.astype(...) (np.save(new, np.load(path, mmap_mode='r').astype(...)) for
    the gadget): for the file larger than the RAM that is mapped, a copy of all of it in RAM. The
    advice is now create_npy's chunked copy; followed to the letter, its rows stream as numpy reads
    the original's."""
    n = int(rng.integers(500, 900))
    values = (rng.zipf(1.3, (n, 3)) % 60_000).astype(dtype)
    if values.dtype.kind == "f":
        values = (rng.standard_normal((n, 3)) * values).astype(dtype)
    path, new_path = str(tmp_path / "big.npy"), str(tmp_path / "native.npy")
    np.save(path, values)
    native = np.dtype(dtype).newbyteorder("=").name
    advice = (rf"create_npy\(new_path, x.shape, '{native}', lambda lo, hi: x\[lo:hi\]\)")
    with pytest.raises(ss.DTypeError, match=r"other byte order.*" + advice):
        ss.BatchFeeder(np.load(path, mmap_mode="r"), batch_size=32, device="cpu")
    if native != "uint16":  # a DataGadget holds no token ids (it says to feed their map instead)
        monkeypatch.setattr(gadget_module, "available_ram", lambda: 4096)  # mapped: too large to copy
        with pytest.raises(ss.DTypeError, match=r"3/4 of the RAM available.*" + advice):
            ss.DataGadget(path, backend="numpy").read()
    # The advice, as written.
    x = np.load(path, mmap_mode="r")
    ss.data.create_npy(new_path, x.shape, native, lambda lo, hi: x[lo:hi], progress=False)
    mapped = np.load(new_path, mmap_mode="r")
    assert mapped.dtype.isnative
    feeder = ss.BatchFeeder(mapped, np.arange(n), batch_size=32, order="block", seed=2, device="cpu")
    seen = []
    for batch, ids in feeder:
        np.testing.assert_array_equal(batch.numpy(), values[ids.numpy()].astype(native))
        seen.append(ids.numpy())
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(n))


_TRUNCATED_UNDER_A_VIEW = """
import sys, numpy as np, torch, speedswap as ss
path, wrap, order, tests = sys.argv[1:]
sys.path.insert(0, tests)
from test_streaming_review import _over_the_map
source = _over_the_map(np.load(path, mmap_mode="r"), wrap)
feeder = ss.BatchFeeder(source, batch_size=64, order=order, device="cpu", prefetch=0)
try:
    for k, (rows,) in enumerate(feeder):
        if k == 2:
            with open(path, "r+b") as f:
                f.truncate(1024)
except ss.FileFormatError as exc:
    print("raised:", exc)
"""


def _over_the_map(mapped, wrap):
    """A memmap given as what does not say it is one: a tensor over it, a plain ndarray view, or a
    DataGadget (storage="pageable") or HostTable adopting such a view."""
    return {"tensor": torch.from_numpy, "ndarray": np.asarray,
            "gadget": lambda m: ss.DataGadget(np.asarray(m), storage="pageable", backend="numpy"),
            "table": lambda m: ss.HostTable.adopt(np.asarray(m), backend="numpy")}[wrap](mapped)


@pytest.mark.parametrize("wrap", ["tensor", "ndarray", "gadget", "table"])
@pytest.mark.parametrize("order", ["random", "block"])
def test_a_tensor_or_plain_array_over_a_map_is_read_with_pread_and_a_truncation_raises_instead_of_sigbus(
        tmp_path, rng, wrap, order):
    """torch.from_numpy(np.load(path, mmap_mode='r')) and np.asarray(memmap) are no np.memmap, so the
    feeder read them through the map: a 6.1 GB file streamed in block order peaked at 6,340 MB of
    resident memory (641 MB now), and a file truncated mid-epoch killed the process with
    SIGBUS (exit status 135), where a memmap raises FileFormatError. Found by the mapping they lie in.
    A DataGadget (storage="pageable") or a HostTable adopting np.asarray(memmap) held a "pageable"
    table the feeder read in place, with the same SIGBUS: it is an mmap table now."""
    n = int(rng.integers(2000, 4000))
    data = rng.standard_normal((n, 5)).astype(np.float32)
    labels = rng.zipf(1.3, n) % 1000
    np.save(tmp_path / "x.npy", data)
    np.save(tmp_path / "y.npy", labels)
    source = _over_the_map(np.load(tmp_path / "x.npy", mmap_mode="r"), wrap)
    if wrap in ("gadget", "table"):
        assert source.storage == "mmap"
    labels_wrap = wrap if wrap in ("tensor", "ndarray") else "ndarray"  # tables hold no int64 labels
    feeder = ss.BatchFeeder(source, _over_the_map(np.load(tmp_path / "y.npy", mmap_mode="r"), labels_wrap),
                            np.arange(n),
                            batch_size=64, order=order, seed=3, device="cpu")
    assert sorted(feeder._files) == [0, 1]  # both read with pread, the ids from RAM
    seen = []
    for rows, ys, ids in feeder:
        np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
        np.testing.assert_array_equal(ys.numpy(), labels[ids.numpy()])
        seen.append(ids.numpy())
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(n))
    # In a subprocess: a SIGBUS would kill pytest itself.
    done = subprocess.run([sys.executable, "-c", _TRUNCATED_UNDER_A_VIEW, str(tmp_path / "x.npy"), wrap, order,
                           os.path.dirname(__file__)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stderr}"
    assert "raised:" in done.stdout and "x.npy" in done.stdout, done.stdout + done.stderr


def test_shared_memory_and_private_maps_are_read_in_place_as_before(tmp_path, rng):
    """Only a shared map of a file its path still names is read with pread: a tensor in shared memory
    (torch's, its file removed once mapped) and a copy-on-write map (which may hold private changes)
    are gathered where they lie, and give their own values."""
    n = int(rng.integers(500, 1000))
    data = rng.standard_normal((n, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", data)
    private = np.asarray(np.load(tmp_path / "x.npy", mmap_mode="c"))
    private[0] = 7.0  # a change the file does not hold
    shared = torch.from_numpy(data.copy()).share_memory_()
    expected = data.copy()
    expected[0] = 7.0
    for source, values in ((shared, data), (private, expected)):
        feeder = ss.BatchFeeder(source, np.arange(n), batch_size=50, order="random", seed=1, device="cpu")
        assert feeder._files == {}
        for rows, ids in feeder:
            np.testing.assert_array_equal(rows.numpy(), values[ids.numpy()])
