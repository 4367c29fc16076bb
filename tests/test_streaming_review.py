"""Streaming a dataset larger than RAM through BatchFeeder: what a demanding user's review found."""

import numpy as np
import pytest

import speedswap as ss
import speedswap.data.feeder as feeder_module
from speedswap.data.orders import BlockOrder, SequentialOrder


def zipf_tokens(rng, n):
    """``n`` int32 token ids, Zipf-distributed as real token streams are."""
    return (rng.zipf(1.2, n) % 50_000).astype(np.int32)


@pytest.mark.parametrize("order, per_row", [("random", 32), (BlockOrder(block_rows=64), 48),
                                            (SequentialOrder(block_rows=64), 48)])
def test_more_rows_than_the_ram_can_hold_an_epochs_order_of_are_refused_before_the_gadget_is_read(
        tmp_path, rng, monkeypatch, order, per_row):
    """A 1-D file of int32 tokens is 4 bytes a row, but each epoch's order holds int64 ids for every
    row (and the next epoch's, drawn ahead): 16 to 40 bytes a row at the peak. A 4 GiB token file was
    taken without a word and ran out of memory at the first batch (numpy's MemoryError inside the
    file reader, under a 12 GiB address-space limit) or was killed for it by the kernel."""
    n = int(rng.integers(3000, 5000))
    tokens = zipf_tokens(rng, n)
    np.save(tmp_path / "tokens.npy", tokens)
    mapped = np.load(tmp_path / "tokens.npy", mmap_mode="r")
    gadget = ss.DataGadget(str(tmp_path / "tokens.npy"), backend="numpy")
    ram = 4 * (n * per_row) // 3  # 3/4 of it is one row short of the order's ids
    monkeypatch.setattr(feeder_module, "available_ram", lambda: ram - 4)
    for source in (mapped, gadget):
        with pytest.raises(ss.OutOfMemoryError, match=rf"{n:,} rows, .*order holds ids for every row.*"
                                                      rf"{n * per_row:,} bytes.*reshape\(-1, 512\)"):
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
