"""Block and sequential epochs whose row ids are made a window at a time: the same orders, bounded memory.

Until review-l a feeder held an int64 id for every row of an epoch (and of the next, drawn ahead): 16 to
48 bytes a row (benchmarks/NOTES.md, entry 81), so a 1-D token file needed several times its size in
RAM, and a large one was refused. In ``block`` and ``sequential`` order the ids are now made as the epoch
reaches them. These tests hold the lazy orders to a reference laid out whole, written here from their
definition (the epoch's generator, the seed's SeedSequence child ``(epoch,)``, draws the block order; since
review-w each window's rows are shuffled by that window's child of the epoch's SeedSequence, so a resumed
epoch makes no window before its own), for
one rank and for each rank of a world, across epochs, resumed mid-epoch, with and without ``drop_last``;
and measure the memory of an epoch over 2**27 rows.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.data.orders import BLOCK_BYTES, BlockOrder, RandomOrder, SequentialOrder, epoch_share


def reference_order(order, num_rows, seed, epoch):
    """The epoch's order laid out whole, in one pass: a random order's is the permutation the epoch's
    generator draws; a block order's blocks are drawn by it, then the rows of each window permuted by the
    generator of the window's child of the epoch's SeedSequence (SeedSequence.spawn's, where the order
    makes the child directly). The epoch's SeedSequence is the seed's own ``epoch``-th child."""
    if isinstance(order, SequentialOrder):
        return np.arange(num_rows)
    sequence = np.random.SeedSequence(seed).spawn(epoch + 1)[epoch]
    if isinstance(order, RandomOrder):
        return np.random.default_rng(sequence).permutation(num_rows)
    size, window = order.block_rows, order.window
    num_blocks = -(-num_rows // size)
    num_windows = -(-num_blocks // window)
    blocks = np.full(num_windows * window, -1)
    blocks[:num_blocks] = np.random.default_rng(sequence).permutation(num_blocks)
    grid = blocks[:, None] * size + np.arange(size)
    grid[(blocks < 0)[:, None] | (grid >= num_rows)] = -1
    lanes = []
    for row, child in zip(grid.reshape(num_windows, window * size), sequence.spawn(num_windows)):
        rows = row[row >= 0]
        lanes.append(rows[np.random.default_rng(child).permutation(len(rows))])
    return np.concatenate(lanes)


def reference_share(order, rank, world_size, drop_last):
    """DistributedSampler's split into runs: pad the order by repeating it (or cut it), take the rank-th run."""
    n = len(order)
    per_rank = n // world_size if drop_last else -(-n // world_size)
    padded = np.resize(order, per_rank * world_size)  # np.resize repeats the order from its start
    return padded[rank * per_rank:(rank + 1) * per_rank]


def reference_batches(share, batch_size, drop_last):
    batches = [share[lo:lo + batch_size] for lo in range(0, len(share), batch_size)]
    return batches[:-1] if drop_last and len(batches[-1]) < batch_size else batches


def random_order(rng, kind, num_rows):
    block_rows = int(rng.integers(1, max(2, num_rows // 3)))
    return kind(block_rows=block_rows, window=int(rng.integers(1, 6)))


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
def test_the_windowed_orders_are_their_definition_laid_out_whole(rng, kind):
    for _ in range(30):
        n = int(rng.integers(1, 400))
        order, seed, epoch = random_order(rng, kind, n), int(rng.integers(1 << 40)), int(rng.integers(100))
        np.testing.assert_array_equal(order.indices(n, seed, epoch), reference_order(order, n, seed, epoch))


def test_the_random_order_is_its_definition(rng):
    for _ in range(30):
        n, seed, epoch = int(rng.integers(1, 400)), int(rng.integers(1 << 40)), int(rng.integers(100))
        order = RandomOrder()
        np.testing.assert_array_equal(order.indices(n, seed, epoch), reference_order(order, n, seed, epoch))


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_ranks_lazy_share_is_its_run_of_the_whole_order_read_in_any_pieces(rng, kind, world_size):
    """Read in batches of any size, from the start or from a position mid-run, and the padding that
    wraps to the order's start: the ids shard() gives for the materialised order."""
    for _ in range(12):
        n = int(rng.integers(max(1, world_size), 300))
        order, seed, epoch = random_order(rng, kind, n), int(rng.integers(1 << 40)), int(rng.integers(10))
        whole = reference_order(order, n, seed, epoch)
        for drop_last in (False, True):
            for rank in range(world_size):
                share = epoch_share(order, n, seed, epoch, rank, world_size, drop_last, world_size > 1)
                expected = reference_share(whole, rank, world_size, drop_last)
                assert len(share) == len(expected)
                size = int(rng.integers(1, len(expected) + 2))
                start = int(rng.integers(0, len(expected)))  # a loop resumed mid-run
                take = share.cursor()
                got = [take(lo, min(lo + size, len(share))) for lo in range(start, len(share), size)]
                np.testing.assert_array_equal(np.concatenate(got), expected[start:])
                # A second pass of the same cursor starts the windows over.
                np.testing.assert_array_equal(take(0, len(share)), expected)


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
def test_the_most_windows_a_batch_needs_is_counted_as_from_every_positions_window(rng, kind):
    """WindowedShare.span counts window starts instead of batches; here it is held to the brute force the
    window reader used to work out (the running maximum of each position's window, per batch)."""
    for _ in range(40):
        n = int(rng.integers(1, 300))
        world_size = int(rng.integers(1, 4))
        order, seed = random_order(rng, kind, n), int(rng.integers(1 << 40))
        if world_size > n:
            continue
        for drop_last in (False, True):
            rank = int(rng.integers(world_size))
            share = epoch_share(order, n, seed, 0, rank, world_size, drop_last, True)
            if not len(share):
                continue
            ids = share.cursor()(0, len(share))
            window_of_block = np.empty(-(-n // order.block_rows), dtype=np.int64)
            valid = share.windows >= 0
            window_of_block[share.windows[valid]] = np.nonzero(valid)[0]
            frontier = np.maximum.accumulate(window_of_block[ids // order.block_rows])
            np.testing.assert_array_equal(share.frontier(np.arange(len(share))), frontier)
            batch = int(rng.integers(1, len(share) + 1))
            lo = np.arange(0, len(share), batch)
            hi = np.minimum(lo + batch, len(share)) - 1
            assert share.span(batch) == int((frontier[hi] - frontier[lo]).max()) + 1


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("where", ["ram", "file"])
def test_a_feeders_batches_are_the_reference_orders_across_epochs_and_resumed_mid_epoch(tmp_path, rng, kind,
                                                                                        world_size, where):
    """Every rank, both drop_last, uneven last batches: the batches of the reference order, two epochs, and
    the rest of an epoch after load_state_dict at a batch mid-epoch. From a file the window reader
    reads whole windows of blocks; in RAM rows are gathered by id: both must give the reference stream."""
    n = int(rng.integers(60, 400))
    tokens = (rng.zipf(1.3, n) % 5000).astype(np.int32)
    np.save(tmp_path / "x.npy", tokens)
    source = np.load(tmp_path / "x.npy", mmap_mode="r") if where == "file" else tokens
    order, seed = random_order(rng, kind, n), int(rng.integers(1 << 40))
    for drop_last in (False, True):
        batch_size = int(rng.integers(1, n // world_size + 1))
        for rank in range(world_size):
            def build():
                return ss.BatchFeeder(source, np.arange(n), batch_size=batch_size, order=order, seed=seed,
                                      drop_last=drop_last, rank=rank, world_size=world_size, device="cpu",
                                      prefetch=int(rng.integers(0, 3)))
            feeder = build()
            for epoch in range(2):
                expected = reference_batches(reference_share(reference_order(order, n, seed, epoch), rank,
                                                             world_size, drop_last), batch_size, drop_last)
                got = list(feeder)
                assert len(got) == len(expected) == len(feeder)
                for (values, ids), want in zip(got, expected):
                    np.testing.assert_array_equal(ids.numpy(), want)
                    np.testing.assert_array_equal(values.numpy(), tokens[want])
            # Resumed at a batch mid-epoch 1 by a feeder built afresh.
            state = feeder.state_dict()
            state["epoch"], state["batch"] = 1, int(rng.integers(0, len(feeder)))
            resumed = build()
            resumed.load_state_dict(state)
            expected = reference_batches(reference_share(reference_order(order, n, seed, 1), rank,
                                                         world_size, drop_last), batch_size, drop_last)
            got = [ids.numpy() for _, ids in resumed]
            assert len(got) == len(expected) - state["batch"]
            for ids, want in zip(got, expected[state["batch"]:]):
                np.testing.assert_array_equal(ids, want)


def test_a_cursor_makes_the_windows_it_reads_and_none_before(rng, monkeypatch):
    """A block epoch read from any position makes the window holding it and those after, each once, then
    window 0 again for the padding that wraps to the epoch's start. Until review-w one generator shuffled
    window after window, so a loop resumed near an epoch's end shuffled every window before it first
    (NOTES 91)."""
    made, lane = [], BlockOrder._lane

    def counted(self, num_rows, seed, epoch, k, blocks):
        made.append(k)
        return lane(self, num_rows, seed, epoch, k, blocks)

    monkeypatch.setattr(BlockOrder, "_lane", counted)
    for _ in range(30):
        n = int(rng.integers(20, 400))
        order, seed, epoch = random_order(rng, BlockOrder, n), int(rng.integers(1 << 40)), int(rng.integers(10))
        world_size = int(rng.integers(1, 4))
        rank = int(rng.integers(world_size))
        share = epoch_share(order, n, seed, epoch, rank, world_size, False, world_size > 1)
        expected = reference_share(reference_order(order, n, seed, epoch), rank, world_size, False)
        start, size = int(rng.integers(0, len(share))), int(rng.integers(1, 20))
        made.clear()
        take = share.cursor()
        got = [take(lo, min(lo + size, len(share))) for lo in range(start, len(share), size)]
        np.testing.assert_array_equal(np.concatenate(got), expected[start:])
        # The windows the positions read fall in, in reading order, each run of one window once.
        window_of_block = np.empty(-(-n // order.block_rows), dtype=np.int64)
        valid = share.windows >= 0
        window_of_block[share.windows[valid]] = np.nonzero(valid)[0]
        read = window_of_block[expected[start:] // order.block_rows]
        assert made == read[np.r_[True, read[1:] != read[:-1]]].tolist()


@pytest.mark.parametrize("order", ["random", "block", "sequential"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_feeder_resumed_at_a_window_start_or_inside_one_gives_the_uninterrupted_batches(tmp_path, rng, order,
                                                                                         world_size):
    """Each rank, two seeds, batches of one row (every window start is a batch's) and of a random size:
    load_state_dict at a batch that starts a window, and at batches inside one, in epochs 0 and 1, then
    read to the end of the next epoch: bit for bit the batches of a feeder never interrupted. From a file
    (the window reader) and from RAM."""
    n = int(rng.integers(60, 200))
    tokens = (rng.zipf(1.3, n) % 5000).astype(np.int32)
    np.save(tmp_path / "x.npy", tokens)
    for source in (np.load(tmp_path / "x.npy", mmap_mode="r"), tokens):
        for seed in rng.integers(1 << 40, size=2).tolist():
            kind = {"block": BlockOrder, "sequential": SequentialOrder}.get(order)
            made = order if kind is None else random_order(rng, kind, n)
            for rank in range(world_size):
                for batch_size in (1, int(rng.integers(2, n // world_size + 1))):
                    def build():
                        return ss.BatchFeeder(source, np.arange(n), batch_size=batch_size, order=made, seed=seed,
                                              rank=rank, world_size=world_size, device="cpu",
                                              prefetch=int(rng.integers(0, 3)))
                    feeder = build()
                    whole = [[(values.numpy().copy(), ids.numpy().copy()) for values, ids in feeder]
                             for _ in range(3)]
                    for epoch in (0, 1):
                        starts = np.arange(len(feeder)) * batch_size
                        if kind is None:
                            at_window = np.zeros(len(starts), dtype=bool)
                        else:
                            share = epoch_share(feeder.order, n, seed, epoch, rank, world_size, False,
                                                world_size > 1)
                            frontier = share.frontier(np.arange(len(share)))
                            at_window = np.r_[True, frontier[1:] != frontier[:-1]][starts]
                        picks = [rng.choice(np.nonzero(where)[0], size=min(2, int(where.sum())), replace=False)
                                 for where in (at_window, ~at_window)]
                        for batch in np.concatenate(picks).tolist():
                            resumed = build()
                            resumed.load_state_dict(dict(feeder.state_dict(), epoch=epoch, batch=batch))
                            got = [(values.numpy(), ids.numpy()) for _ in range(2) for values, ids in resumed]
                            want = whole[epoch][batch:] + whole[epoch + 1]
                            assert len(got) == len(want)
                            for (values, ids), (want_values, want_ids) in zip(got, want):
                                np.testing.assert_array_equal(ids, want_ids)
                                np.testing.assert_array_equal(values, want_values)


def test_a_default_block_holds_block_bytes_of_one_byte_rows_and_their_ids(rng, monkeypatch):
    """The default block size counted only the rows' data: over 1-byte rows a window's int64 ids were 8
    times its rows (268 MB a window over a 2**27-row int8 file, NOTES 88). A default block is now
    BLOCK_BYTES of rows and their ids: each window's ids as the order makes them (their arrays' bytes)
    and the window's rows come to at most window * BLOCK_BYTES, and no block is smaller than it needs to
    be. The epoch is the reference order of that block size: every row once."""
    n = 9 * (BLOCK_BYTES // 9) + int(rng.integers(1, 1 << 16))  # two windows of 8 blocks, the last short
    tokens = (rng.zipf(1.3, n) % 100).astype(np.int8)
    made, lane = [], BlockOrder._lane

    def kept(self, *args):
        made.append(lane(self, *args))
        return made[-1]

    monkeypatch.setattr(BlockOrder, "_lane", kept)
    seed = int(rng.integers(1 << 40))
    feeder = ss.BatchFeeder(tokens, batch_size=1 << 16, order="block", seed=seed, device="cpu")
    order = feeder.order
    assert order.block_rows * (1 + 8) <= BLOCK_BYTES < (order.block_rows + 1) * (1 + 8)
    values = np.concatenate([batch.numpy() for (batch,) in feeder])
    expected = reference_order(order, n, seed, 0)
    assert len(made) == 2  # each window made once
    np.testing.assert_array_equal(np.concatenate(made), expected)
    np.testing.assert_array_equal(values, tokens[expected])
    held = max(ids.nbytes for ids in made) + order.window * order.block_rows * tokens.itemsize
    assert held <= order.window * BLOCK_BYTES, (held, order.block_rows)


def test_random_order_still_refuses_rows_its_ids_cannot_fit_and_names_block_order(rng, monkeypatch):
    import speedswap.data.feeder as feeder_module
    n = int(rng.integers(3000, 5000))
    tokens = (rng.zipf(1.2, n) % 50_000).astype(np.int32)
    monkeypatch.setattr(feeder_module, "available_ram", lambda: 4 * (n * 32) // 3 - 4)
    with pytest.raises(ss.OutOfMemoryError, match=r'random order holds ids for every row.*order="block"'):
        ss.BatchFeeder(tokens, batch_size=64, order="random", device="cpu")
    for order in ("block", "sequential"):  # no ids held: taken, and every row read once an epoch
        feeder = ss.BatchFeeder(tokens, np.arange(n), batch_size=64, order=order, device="cpu")
        ids = torch.cat([ids for _, ids in feeder]).numpy()
        np.testing.assert_array_equal(np.sort(ids), np.arange(n))


_EPOCH = textwrap.dedent("""
    import sys, time
    import numpy as np, speedswap as ss
    from speedswap.data.orders import BlockOrder, SequentialOrder

    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    path, order = sys.argv[1], sys.argv[2]
    x = np.load(path, mmap_mode="r")
    order = {"block": BlockOrder(block_rows=1 << 16), "sequential": "sequential"}[order]
    feeder = ss.BatchFeeder(x, batch_size=1 << 16, order=order, device="cpu", prefetch=2)
    before, rows, total = peak(), 0, 0
    for (batch,) in feeder:
        rows += len(batch)
        total += int(batch.sum())
    print(len(x), rows, total, peak() - before)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("order", ["block", "sequential"])
def test_an_epoch_over_two_to_the_27_rows_holds_no_id_per_row(tmp_path, order):
    """2**27 int8 rows, a 128 MiB file: the old order held 16-48 bytes a row, 2-6 GB, and was refused where
    3/4 of the RAM free could not hold it. The epoch's peak resident growth is now a few windows and
    batches. The file's rows are zeros but one 1 every 16381 rows, summed to check every row was read
    once."""
    n = 1 << 27
    path = tmp_path / "big.npy"
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.int8, shape=(n,))
    x[::16381] = 1
    del x
    try:
        out = subprocess.run([sys.executable, "-c", _EPOCH, str(path), order], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr
        rows, read, total, growth = map(int, out.stdout.split())
    finally:
        path.unlink()
    assert rows == read == n and total == len(range(0, n, 16381))
    # Two windows of 2**19 rows of the file and a few batches: some 20 MB, 0.15 bytes a row. Held to
    # 1 byte a row: an int64 id per row would be 8.
    assert growth < n, f"{growth / n:.2f} bytes a row"


_WINDOWS = textwrap.dedent("""
    import sys
    import numpy as np
    from speedswap.data.orders import BlockOrder, epoch_share

    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    n, block_rows, window = map(int, sys.argv[1:])
    order = BlockOrder(block_rows=block_rows, window=window)
    share = epoch_share(order, n, 7, 0, 0, 1, False, False)
    take, before, total = share.cursor(), peak(), 0
    for lo in range(0, n, 1 << 16):
        total += int(take(lo, min(lo + (1 << 16), n)).sum())
    print(total, peak() - before, window * order._layout_bytes_per_block)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("padded", [False, True])
def test_a_block_epoch_holds_one_windows_ids_at_a_time_as_the_window_check_counts(rng, padded):
    """A pass over a block epoch of about 2**24 rows in windows of 2**23 (64 MiB of int64 ids: above
    glibc's largest mmap threshold, so a window freed goes back to the kernel and the peak is what is
    alive) peaks at one window's ids, what _check_window counts, with the last block short too. Before
    review-w a window with padding was shuffled with it, then copied without it: 17 bytes a row. The
    generator's own references to the last window (a view of it too) once held two windows' ids while
    it made the next."""
    block_rows, window = 1 << 21, 4
    n = (1 << 24) - (int(rng.integers(1, 1 << 20)) if padded else 0)
    out = subprocess.run([sys.executable, "-c", _WINDOWS, str(n), str(block_rows), str(window)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    total, growth, counted = map(int, out.stdout.split())
    assert total == n * (n - 1) // 2  # every row once
    assert counted == 8 * window * block_rows
    assert growth <= counted + (1 << 20), (growth, counted)  # 1 MiB for a batch's ids and the blocks
