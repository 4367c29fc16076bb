"""BatchFeeder: every row once per epoch, reproducible orders, exact resume, sharding."""

import inspect
import os
import re
import signal
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.data.orders import BlockOrder, Order, RandomOrder, SequentialOrder, make_order, shard

ORDERS = ["random", "block", "sequential"]


def random_data(rng, shape, dtype=np.float32):
    """Fresh random values in [1, 2) with random signs: never zeros."""
    return (rng.uniform(1.0, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)


def ids_of(feeder, batches=None):
    """The row ids of the next ``batches`` batches (default: the rest of the epoch), one array each.

    The feeder's first source must be ``np.arange(n)`` so that a batch of it
    names the rows it holds.
    """
    out = []
    for batch in feeder:
        out.append(batch[0].cpu().numpy().copy())
        if batches is not None and len(out) == batches:
            break
    return out


def small_order(order):
    # Blocks far smaller than the data, so the block order is really exercised.
    return BlockOrder(block_rows=7, window=3) if order == "block" else order


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_row_once_per_epoch(order, drop_last, rng):
    n = int(rng.integers(1, 3000))
    batch = int(rng.integers(1, min(400, n) + 1))  # drop_last needs at least one batch
    data = random_data(rng, (n, 3, 2))
    feeder = ss.BatchFeeder(np.arange(n), data, batch_size=batch, order=small_order(order),
                            drop_last=drop_last, seed=int(rng.integers(1000)), device="cpu")
    for epoch in range(2):
        batches = list(feeder)
        assert len(batches) == len(feeder) == (n // batch if drop_last else -(-n // batch))
        for ids, rows in batches:
            np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
        sizes = [len(ids) for ids, _ in batches]
        assert all(size == batch for size in sizes[:-1])
        seen = np.concatenate([ids.numpy() for ids, _ in batches])
        assert len(np.unique(seen)) == len(seen)  # no row twice
        if drop_last:
            assert len(seen) == (n // batch) * batch
        else:
            np.testing.assert_array_equal(np.sort(seen), np.arange(n))
        assert feeder.epoch == epoch + 1


@pytest.mark.parametrize("order", ["random", "block"])
def test_seeds_and_epochs_change_the_order_and_the_same_seed_repeats_it(order, seed):
    n = 5000

    def stream(s, epochs=2):
        feeder = ss.BatchFeeder(np.arange(n), batch_size=512, order=small_order(order), seed=s,
                                device="cpu")
        return [np.concatenate(ids_of(feeder)) for _ in range(epochs)]

    first, second = stream(seed)
    assert not np.array_equal(first, second)  # epochs differ
    again = stream(seed)
    np.testing.assert_array_equal(again[0], first)
    np.testing.assert_array_equal(again[1], second)
    assert not np.array_equal(stream(seed + 1)[0], first)
    assert not np.array_equal(first, np.arange(n))


def test_sequential_order_is_file_order():
    feeder = ss.BatchFeeder(np.arange(10), batch_size=4, order="sequential", device="cpu")
    for _ in range(2):
        assert [ids.tolist() for ids in ids_of(feeder)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_block_order_reads_one_window_of_blocks_at_a_time(rng):
    n, block, window = 10_000, 100, 4
    order = BlockOrder(block_rows=block, window=window).indices(n, seed=int(rng.integers(99)), epoch=3)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    for start in range(0, n, block * window):
        blocks = np.unique(order[start:start + block * window] // block)
        assert len(blocks) <= window  # each stretch of the epoch touches at most `window` blocks
    # ... and the rows within a window are really shuffled
    assert not np.array_equal(order[:block], np.sort(order[:block]))


def test_set_epoch_gives_that_epochs_order():
    natural = ss.BatchFeeder(np.arange(300), batch_size=64, seed=5, device="cpu")
    explicit = ss.BatchFeeder(np.arange(300), batch_size=64, seed=5, device="cpu")
    for epoch in range(3):
        explicit.set_epoch(epoch)
        np.testing.assert_array_equal(np.concatenate(ids_of(natural)), np.concatenate(ids_of(explicit)))
    explicit.set_epoch(1)
    natural.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate(ids_of(natural)), np.concatenate(ids_of(explicit)))


def make_resumable(order, drop_last, source):
    return ss.BatchFeeder(source, batch_size=37, order=small_order(order), drop_last=drop_last, seed=11,
                          device="cpu")


@pytest.fixture(params=["memory", "memmap"])
def id_source(request, tmp_path):
    """np.arange(1000) in memory, or as a memory-mapped file (read by the reader thread)."""
    if request.param == "memory":
        return np.arange(1000)
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(1000))
    return np.load(path, mmap_mode="r")


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_matches_the_uninterrupted_stream(order, drop_last, id_source, rng):
    per_epoch = len(make_resumable(order, drop_last, id_source))
    total = 3 * per_epoch
    reference = make_resumable(order, drop_last, id_source)
    expected = [b for _ in range(3) for b in ids_of(reference)]
    assert len(expected) == total
    # Interrupt mid-epoch, then twice within one epoch, then exactly at an epoch boundary.
    cuts = sorted({int(rng.integers(1, per_epoch)), per_epoch + 3, per_epoch + per_epoch // 2,
                   2 * per_epoch})
    got, state, done = [], None, 0
    for cut in cuts + [total]:
        feeder = make_resumable(order, drop_last, id_source)
        if state is not None:
            feeder.load_state_dict(state)
        while done < cut:
            got.extend(ids_of(feeder, batches=cut - done))
            done = len(got)
        state = feeder.state_dict()
    assert len(got) == total
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_a_distributed_sampler_loop_resumed_mid_epoch_trains_each_batch_once(rng):
    """The loop calls set_epoch at the top of every epoch, the resumed one too: starting that epoch
    over replayed its first batches (a state at batch 3 of 10 trained 3 batches twice)."""
    def make():
        return ss.BatchFeeder(np.arange(97), batch_size=10, seed=5, device="cpu")

    def train(feeder, first_epoch, stop_after=None):
        seen = []
        for epoch in range(first_epoch, 3):
            feeder.set_epoch(epoch)
            for batch in feeder:
                seen.append(batch[0].numpy().copy())
                if len(seen) == stop_after:
                    return seen
        return seen

    expected = train(make(), 0)
    cut = int(rng.integers(1, len(expected) - 1))
    interrupted = make()
    before = train(interrupted, 0, stop_after=cut)
    state = interrupted.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    after = train(resumed, state["epoch"])
    assert len(before) + len(after) == len(expected)
    for got, want in zip(before + after, expected):
        np.testing.assert_array_equal(got, want)
    # Another epoch, or the restored one once a loop has started from it, starts from its first batch.
    jumped = make()
    jumped.load_state_dict(state)
    jumped.set_epoch(state["epoch"] + 1)
    assert len(ids_of(jumped)) == len(jumped)
    again = make()
    again.load_state_dict(state)
    ids_of(again, batches=1)
    again.set_epoch(state["epoch"])
    assert len(ids_of(again)) == len(again)


def test_state_at_an_epoch_boundary_points_at_the_next_epoch():
    feeder = ss.BatchFeeder(np.arange(100), batch_size=10, device="cpu")
    list(feeder)
    assert feeder.state_dict()["epoch"] == 1 and feeder.state_dict()["batch"] == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_the_whole_epochs_batch_count_wherever_the_feeder_stands(rng, drop_last):
    """After a mid-epoch load_state_dict, len(feeder) is the whole epoch's batch count, as a DataLoader's
    len is whatever its sampler skips, while a loop from there yields only the rest of the epoch:
    len(feeder) - state_dict()["batch"] batches, the count README tells a resumed progress bar to start
    from. The next epoch's loop yields len(feeder) again."""
    rows, size, seed = int(rng.integers(200, 400)), int(rng.integers(7, 30)), int(rng.integers(2**31))
    x = random_data(rng, (rows, 3))

    def make():
        return ss.BatchFeeder(np.arange(rows), x, batch_size=size, drop_last=drop_last, seed=seed, device="cpu")

    epoch_batches = len(torch.utils.data.DataLoader(range(rows), batch_size=size, drop_last=drop_last))
    whole = ids_of(make())
    cut = int(rng.integers(1, epoch_batches))
    interrupted = make()
    ids_of(interrupted, batches=cut)
    state = interrupted.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert len(interrupted) == len(resumed) == len(whole) == epoch_batches
    rest = ids_of(resumed)
    assert len(rest) == len(resumed) - state["batch"] == epoch_batches - cut
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(whole[cut:]))
    assert len(ids_of(resumed)) == len(resumed) == epoch_batches


def test_a_loop_left_early_is_continued_by_the_next():
    feeder = ss.BatchFeeder(np.arange(100), batch_size=10, seed=3, device="cpu")
    reference = ss.BatchFeeder(np.arange(100), batch_size=10, seed=3, device="cpu")
    first = ids_of(feeder, batches=4)
    rest = ids_of(feeder)
    np.testing.assert_array_equal(np.concatenate(first + rest), np.concatenate(ids_of(reference)))


def test_a_superseded_loop_raises():
    feeder = ss.BatchFeeder(np.arange(100), batch_size=10, device="cpu")
    old = iter(feeder)
    next(old)
    feeder.set_epoch(4)
    with pytest.raises(ss.StateError, match="superseded"):
        next(old)
    assert len(list(feeder)) == 10


class _SwitchBeforeTaking:
    """A feeder's lock that first runs ``switch`` once, where a thread switch could land just before it is taken."""

    def __init__(self, lock, switch):
        self._lock, self._switch = lock, switch

    def __enter__(self):
        switch, self._switch = self._switch, None
        if switch is not None:
            switch()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


@pytest.mark.parametrize("order", ORDERS)
def test_a_loop_started_while_another_threads_loop_counts_a_batch_hands_out_no_batch_twice(order, rng):
    """A loop started on one thread while another thread's loop ran took the position before the lock
    that loop counts its batches under: batches counted meanwhile (one, or 57 in a stress run) were
    handed out again by the new loop, rows read twice in the epoch. The old loop's batch counted just
    before the new one took over is its last; the new loop goes on from the next."""
    n, batch = int(rng.integers(200, 400)), int(rng.integers(3, 12))
    rows = random_data(rng, (n, 3))
    feeder = ss.BatchFeeder(np.arange(n), rows, batch_size=batch, order=order, seed=int(rng.integers(100)),
                            device="cpu")
    old = iter(feeder)
    delivered = [next(old) for _ in range(int(rng.integers(1, 4)))]
    # The old loop's thread counts one more batch as the new loop begins (see _SwitchBeforeTaking).
    feeder._lock = _SwitchBeforeTaking(feeder._lock, lambda: delivered.append(next(old)))
    delivered += list(feeder)
    with pytest.raises(ss.StateError, match="superseded"):
        next(old)
    ids = np.concatenate([i.numpy() for i, _ in delivered])
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))  # every row once in the epoch
    for i, got in delivered:
        np.testing.assert_array_equal(got.numpy(), rows[i.numpy()])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharding_splits_each_epoch_between_ranks(world_size, drop_last, rng):
    n = int(rng.integers(world_size, 900))
    batch = int(rng.integers(1, min(60, n // world_size) + 1))  # drop_last needs a batch per rank
    for epoch in range(2):
        shares = []
        for rank in range(world_size):
            feeder = ss.BatchFeeder(np.arange(n), batch_size=batch, drop_last=drop_last, seed=9,
                                    rank=rank, world_size=world_size, device="cpu")
            feeder.set_epoch(epoch)
            batches = ids_of(feeder)
            assert len(batches) == len(feeder)
            shares.append(np.concatenate(batches))
        assert len({len(feeder) for _ in shares}) == 1  # the same number of batches everywhere
        everything = np.concatenate(shares)
        if drop_last:
            assert len(np.unique(everything)) == len(everything)  # disjoint
            per_rank = (n // world_size) // batch * batch
            assert all(len(share) == per_rank for share in shares)
        else:
            np.testing.assert_array_equal(np.unique(everything), np.arange(n))  # union covers the data
            per_rank = -(-n // world_size)
            assert all(len(share) == per_rank for share in shares)
            # DistributedSampler pads with repeated rows: exactly that many repeats
            assert len(everything) - n == per_rank * world_size - n
            if n % world_size == 0:
                assert len(np.unique(everything)) == len(everything)


def distributed_sampler_share(indices, rank, world_size, drop_last, contiguous):
    """torch's DistributedSampler split, written out: pad by repeating from the start (or cut), then split."""
    n = len(indices)
    total = n // world_size * world_size if drop_last else -(-n // world_size) * world_size
    padded = np.array([indices[i % n] for i in range(total)], dtype=np.int64)
    per_rank = total // world_size
    return padded[rank * per_rank:(rank + 1) * per_rank] if contiguous else padded[rank:total:world_size]


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_takes_only_this_ranks_rows_whatever_the_world_size(rng, drop_last, contiguous):
    """shard padded the whole epoch to world_size * rows-per-rank before taking one rank's share: a
    world larger than the data (accepted: DistributedSampler pads it) raised MemoryError from 2**40
    ranks, and OverflowError past int64, at the loop's first batch."""
    for _ in range(200):
        n = int(rng.integers(1, 60))
        world_size = int(rng.integers(1, 2 * n + 3))
        rank = int(rng.integers(0, world_size))
        order = rng.permutation(n)
        np.testing.assert_array_equal(shard(order, rank, world_size, drop_last, contiguous),
                                      distributed_sampler_share(order, rank, world_size, drop_last, contiguous))
    order = rng.permutation(50)
    for world_size in (2**40, 2**70):
        rank = world_size - 3
        got = shard(order, rank, world_size, drop_last, contiguous)
        np.testing.assert_array_equal(got, [] if drop_last else [order[rank % 50]])
    if not drop_last:
        feeder = ss.BatchFeeder(np.arange(50), batch_size=4, rank=2**70 - 3, world_size=2**70,
                                order="sequential", device="cpu")
        assert ids_of(feeder) == [[(2**70 - 3) % 50]]


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_of_an_empty_order_is_empty_for_every_rank(rng, drop_last, contiguous):
    """shard reduced each position mod the order's length: an empty order (which DistributedSampler
    splits into empty shares, and shard did too before) raised ZeroDivisionError."""
    world_size = int(rng.integers(2, 9))
    for rank in range(world_size):
        sampler = torch.utils.data.DistributedSampler(range(0), num_replicas=world_size, rank=rank,
                                                      shuffle=False, drop_last=drop_last)
        got = shard(np.array([], dtype=np.int64), rank, world_size, drop_last, contiguous)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.array(list(sampler), dtype=np.int64))


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("rank_type", [np.uint64, np.int64, np.uint32, np.int8])
def test_shard_takes_a_numpy_integer_rank_as_its_value(rng, rank_type, drop_last, contiguous):
    """shard accepts any numpy integer as the rank, but computed positions with it: a np.uint64
    rank made numpy promote them to float64 (uint64 with int64), and indexing raised IndexError
    "arrays used as indices must be of integer (or boolean) type"."""
    for _ in range(20):
        n = int(rng.integers(1, 40))
        world_size = int(rng.integers(2, 2 * n + 3))
        rank = int(rng.integers(0, min(world_size, 127)))
        order = rng.permutation(n)
        np.testing.assert_array_equal(shard(order, rank_type(rank), world_size, drop_last, contiguous),
                                      distributed_sampler_share(order, rank, world_size, drop_last, contiguous))


def test_rank_defaults_to_torch_distributed(monkeypatch):
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    feeder = ss.BatchFeeder(np.arange(40), batch_size=5, seed=1, device="cpu")
    assert feeder.state_dict()["rank"] == 2 and feeder.state_dict()["world_size"] == 4
    mine = np.concatenate(ids_of(feeder))
    explicit = ss.BatchFeeder(np.arange(40), batch_size=5, seed=1, device="cpu", rank=2, world_size=4)
    np.testing.assert_array_equal(mine, np.concatenate(ids_of(explicit)))


def test_sources_of_every_kind_and_names(backend, rng, tmp_path):
    n = 257
    features = random_data(rng, (n, 4, 3))
    labels = rng.integers(0, 10, size=n)
    weights = random_data(rng, (n,), np.float64)
    np.save(tmp_path / "features.npy", features)
    feeder = ss.BatchFeeder(ids=torch.arange(n),
                            features=ss.DataGadget(tmp_path / "features.npy", CPUPinn=True, backend=backend),
                            labels=np.load(tmp_path / "features.npy", mmap_mode="r")[:, 0, 0].copy(),
                            weights=torch.from_numpy(weights),
                            table=ss.HostTable.from_numpy(labels.reshape(n, 1), storage="pageable",
                                                          backend=backend),
                            batch_size=50, device="cpu")
    total = 0
    for batch in feeder:
        assert set(batch) == {"ids", "features", "labels", "weights", "table"}
        ids = batch["ids"].numpy()
        np.testing.assert_array_equal(batch["features"].numpy(), features[ids])
        np.testing.assert_array_equal(batch["labels"].numpy(), features[ids, 0, 0])
        np.testing.assert_array_equal(batch["weights"].numpy(), weights[ids])
        np.testing.assert_array_equal(batch["table"].numpy(), labels[ids].reshape(-1, 1))
        assert batch["weights"].dtype == torch.float64
        total += len(ids)
    assert total == n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("order", ["random", "block"])
def test_unsigned_token_ids_arrive_widened_with_their_values(order, device, rng, tmp_path):
    """uint16 and uint32 data (token ids) are read at their width and delivered as int32/int64."""
    n = 300
    # Half the values have the top bit set: read as int16/int32 they would be negative.
    short = rng.integers(0, 1 << 16, size=(n, 5)).astype(np.uint16)
    wide = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    assert (short >= 1 << 15).any() and (wide >= 1 << 31).any()
    np.save(tmp_path / "tokens.npy", short)
    seen = []
    feeder = ss.BatchFeeder(np.arange(n), np.load(tmp_path / "tokens.npy", mmap_mode="r"),
                            torch.from_numpy(wide.astype(np.int64)).to(torch.uint32),
                            batch_size=64, order=order, device=device, lookahead=True,
                            transform=lambda batch: seen.append(batch[1].dtype) or batch)
    total = 0
    for (ids, tokens, big), _ in feeder:
        assert tokens.dtype == torch.int32 and big.dtype == torch.int64
        assert tokens.device.type == big.device.type == device
        ids = ids.cpu().numpy()
        np.testing.assert_array_equal(tokens.cpu().numpy(), short[ids])
        np.testing.assert_array_equal(big.cpu().numpy(), wide[ids])
        total += len(ids)
    assert total == n and set(seen) == {torch.int32}
    assert feeder._files  # the file is still read with pread, at two bytes a value


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_cpu_bfloat16_tensors_are_fed_as_they_are(device, prefetch, rng):
    # They were refused ("numpy has no such dtype"), though a device one was fed and a table holds them.
    n = 200
    values = torch.from_numpy(random_data(rng, (n, 2, 6))).to(torch.bfloat16)
    columns = values[:, :, ::2]  # not contiguous: copied once, with a warning, as any such source
    with pytest.warns(RuntimeWarning, match="not contiguous"):
        feeder = ss.BatchFeeder(np.arange(n), values, columns, batch_size=32, order="random", seed=5,
                                device=device, prefetch=prefetch)
    total = 0
    for ids, rows, picked in feeder:
        assert rows.dtype == picked.dtype == torch.bfloat16 and rows.device.type == device
        ids = torch.from_numpy(ids.cpu().numpy())
        # The same bits, so NaN-free data compares exactly.
        assert torch.equal(rows.cpu(), values[ids]) and torch.equal(picked.cpu(), columns[ids])
        total += len(ids)
    assert total == n
    with pytest.raises(ss.DTypeError, match=r"float8_e4m3fn.*data.float\(\)$"):  # no promise to feed it
        ss.BatchFeeder(values.float().to(torch.float8_e4m3fn), batch_size=32, device="cpu")


def test_transform_and_lifetime():
    data = np.arange(60, dtype=np.float32).reshape(30, 2)
    feeder = ss.BatchFeeder(data, batch_size=7, order="sequential", device="cpu",
                            transform=lambda batch: batch[0] * 2)
    kept = list(feeder)  # every yielded tensor stays valid after later batches
    list(feeder)
    np.testing.assert_array_equal(torch.cat(kept).numpy(), data * 2)


def reader_threads():
    return [t for t in threading.enumerate() if t.name == "speedswap-feeder-reader"]


def test_memmapped_sources_are_read_ahead_on_a_thread(tmp_path, rng):
    data = random_data(rng, (2000, 16))
    np.save(tmp_path / "x.npy", data)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    feeder = ss.BatchFeeder(np.arange(2000), mapped, batch_size=100, seed=4, device="cpu", prefetch=3)
    inline = ss.BatchFeeder(np.arange(2000), mapped, batch_size=100, seed=4, device="cpu", prefetch=0)
    for k, ((ids, rows), (ids0, rows0)) in enumerate(zip(feeder, inline)):
        assert len(reader_threads()) <= 1
        if k < 10:  # 20 batches, 3 ahead: the reader is at work (it ends once all are read)
            assert len(reader_threads()) == 1
        np.testing.assert_array_equal(ids.numpy(), ids0.numpy())
        np.testing.assert_array_equal(rows.numpy(), data[ids.numpy()])
    assert reader_threads() == []
    for _ in feeder:  # leaving a loop early stops its reader
        break
    assert reader_threads() == []


def run_with_deadline(fn, seconds=30):
    """Run ``fn`` on a helper thread; fail (instead of hanging the suite) if it does not finish."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome["error"] = exc
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the feeder hung for {seconds} s"
    return outcome


def io_threads():
    return [t for t in threading.enumerate() if t.name.startswith("speedswap-io")]


@pytest.mark.parametrize("order, fail_at", [("random", 230), (BlockOrder(block_rows=50, window=2), 7)])
def test_a_reader_error_reaches_the_loop_and_never_hangs(tmp_path, monkeypatch, order, fail_at):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(1000))
    feeder = ss.BatchFeeder(np.load(path, mmap_mode="r"), batch_size=50, order=order, device="cpu",
                            prefetch=2)
    real, calls = os.preadv, []

    class DiskGone(OSError):
        pass

    def failing(*args):
        calls.append(threading.current_thread().name)
        if len(calls) == fail_at:
            raise DiskGone("input/output error")
        return real(*args)

    monkeypatch.setattr(os, "preadv", failing)
    seen = []
    outcome = run_with_deadline(lambda: [seen.append(b[0].numpy().copy()) for b in feeder])
    error = outcome.get("error")  # named by file and rows, the disk's own error its cause
    assert isinstance(error, ss.errors.FileFormatError) and isinstance(error.__cause__, DiskGone)
    assert calls[fail_at - 1].startswith("speedswap-io")  # it really was raised on an I/O thread
    assert 0 < len(seen) < len(feeder) and feeder.state_dict()["batch"] == len(seen)
    assert reader_threads() == [] and io_threads() == []
    monkeypatch.setattr(os, "preadv", real)
    rest = run_with_deadline(lambda: [b[0].numpy().copy() for b in feeder])["value"]
    np.testing.assert_array_equal(np.sort(np.concatenate(seen + rest)), np.arange(1000))


@pytest.mark.parametrize("make, error, match", [
    (lambda: ss.BatchFeeder(np.ones(5), np.ones(6), batch_size=2), ss.ShapeError, "same number of rows.*5.*6"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=0), ss.OptionError, "batch_size"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=-3), ss.OptionError, "batch_size"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2.0), ss.OptionError, "batch_size"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=True), ss.OptionError, "batch_size"),
    # DataLoader(x, 64)'s positional batch size (and shuffle) raised a bare TypeError "missing batch_size"
    (lambda: ss.BatchFeeder(np.ones(5), 2), ss.OptionError, r"by keyword.*BatchFeeder\(x, batch_size=2\)"),
    (lambda: ss.BatchFeeder(np.ones(5), np.int64(2), True), ss.OptionError, r"batch_size=2\)"),
    (lambda: ss.BatchFeeder(np.ones(5), 4, batch_size=2), ss.OptionError, "every option by keyword"),
    (lambda: ss.BatchFeeder(np.ones(5)), ss.OptionError, "needs batch_size="),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, order="shuffle"), ss.OptionError, "unknown order"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, rank=4, world_size=4), ss.OptionError, "outside"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, rank=-1, world_size=2), ss.OptionError, "outside"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, world_size=0), ss.OptionError, "world_size"),
    (lambda: ss.BatchFeeder(np.ones(8), batch_size=2, world_size=2), ss.OptionError,
     "world_size=2 without rank"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, prefetch=-1), ss.OptionError, "prefetch"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, seed=-1), ss.OptionError, "seed"),
    # Five 32-bit words: numpy appends the epoch's spawn key unpadded, into another seed's (seed, epoch, window).
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, seed=2**128), ss.OptionError, r"below 2\*\*128"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, transform=3), ss.OptionError, "callable"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, drop_last="no"), ss.OptionError, "drop_last"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, drop_last=None), ss.OptionError, "drop_last"),
    (lambda: ss.BatchFeeder(batch_size=2), ss.OptionError, "at least one source"),
    (lambda: ss.BatchFeeder(np.ones(5), y=np.ones(5), batch_size=2), ss.OptionError, "not both"),
    (lambda: ss.BatchFeeder([1, 2, 3], batch_size=2), ss.DTypeError, "list"),
    (lambda: ss.BatchFeeder(np.ones(5, np.complex64), batch_size=2), ss.DTypeError, "complex64"),
    (lambda: ss.BatchFeeder(np.ones((0, 3)), batch_size=2), ss.ShapeError, "no rows"),
    (lambda: ss.BatchFeeder(np.array(1.0), batch_size=2), ss.ShapeError, "0-d"),
    (lambda: ss.BatchFeeder(torch.tensor(1.0), batch_size=2), ss.ShapeError, "0-d"),
    (lambda: ss.BatchFeeder(torch.ones(0, 2), batch_size=2), ss.ShapeError, "no rows"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, device="tpu"), ss.OptionError, "device"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, order=BlockOrder(window=0)), ss.OptionError, "window"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, shuffle=True), ss.OptionError, "no option 'shuffle'"),
    (lambda: ss.BatchFeeder(x=np.ones(5), batch_size=2, shufle=None), ss.OptionError, "no option 'shufle'"),
    (lambda: ss.BatchFeeder("x.npy", batch_size=2), ss.DTypeError, "DataGadget\\(path\\)"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, backend="tpu"), ss.OptionError, "unknown backend"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, backend="numpy", device="cuda"), ss.OptionError,
     "backend='numpy' runs on the CPU"),
    (lambda: ss.BatchFeeder(np.ones(5), batch_size=2, drop_behind=1), ss.OptionError, "drop_behind"),
    # Not "lives on meta ... pass device='meta'", which is refused in turn: a meta tensor has no rows.
    (lambda: ss.BatchFeeder(torch.empty(5, 2, device="meta"), batch_size=2, device="cpu"), ss.DeviceError,
     "meta device, which holds no values"),
])
def test_bad_arguments_fail_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("keyword, value, instead", [
    ("shuffle", True, 'order="random"'),
    ("num_workers", 4, "prefetch=N"),
    ("prefetch_factor", 2, "prefetch=N"),
    ("pin_memory", True, "nothing: on a GPU batches are staged in pinned memory"),
    ("persistent_workers", True, "nothing: there are no worker processes"),
    ("collate_fn", None, "transform=fn"),
    ("generator", None, "seed=N"),
    ("collate_fn", lambda batch: batch, "transform=fn"),
    ("sampler", torch.utils.data.RandomSampler(range(10)), 'order= ("random"'),
    ("batch_sampler", torch.utils.data.BatchSampler(range(10), 2, False), "batch_size= with order="),
])
def test_a_dataloader_keyword_is_refused_with_what_the_feeder_does_instead(rng, keyword, value, instead):
    # A DataLoader user's first call (shuffle=True, num_workers=4) got only the list of options,
    # none of which has that name: the message now says which option does the job.
    x = rng.standard_normal((10, 3)).astype(np.float32)
    with pytest.raises(ss.OptionError, match=f"no option '{keyword}'.*DataLoader's {keyword} is {re.escape(instead)}"):
        ss.BatchFeeder(x, batch_size=2, device="cpu", **{keyword: value})


def test_a_dataloader_or_dataset_given_as_a_source_is_refused_with_the_feeder_that_replaces_it(rng):
    # BatchFeeder(loader) said only which types a source may be, leaving a DataLoader user to dig
    # the arrays out. The advice now given, followed, hands out the loader's batches.
    x = torch.from_numpy(rng.standard_normal((50, 3)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 5, 50))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    for given, advice in [(loader, "DataLoader's place: pass the arrays its dataset holds, as "
                                   "ss.BatchFeeder(*loader.dataset.tensors, batch_size=...)"),
                          (loader.dataset, "no per-row __getitem__: pass the arrays the dataset holds, as "
                                           "ss.BatchFeeder(*dataset.tensors, batch_size=...)"),
                          ([x, y], "np.asarray(...), or pass the arrays it holds as sources of their own")]:
        with pytest.raises(ss.DTypeError, match=re.escape(advice)):
            ss.BatchFeeder(given, batch_size=8, device="cpu")
    feeder = ss.BatchFeeder(*loader.dataset.tensors, batch_size=8, order="sequential", device="cpu")
    assert len(feeder) == len(loader)
    for (xb, yb), (x_loaded, y_loaded) in zip(feeder, loader):
        assert torch.equal(xb, x_loaded) and torch.equal(yb, y_loaded)


def test_a_source_not_contiguous_whose_copy_would_not_fit_in_ram_is_refused_before_it_is_copied(
        monkeypatch, rng):
    # A column slice or a Fortran-order .npy of a file larger than RAM was copied into RAM
    # whole, with a warning: the process ran out of memory instead of being told what to do.
    import speedswap.data.feeder as feeder_module
    x = np.asfortranarray(rng.standard_normal((64, 8)).astype(np.float32))  # 2,048 bytes
    monkeypatch.setattr(feeder_module, "available_ram", lambda: 4 * x.nbytes // 3 - 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copy's warning would mean the copy was begun
        with pytest.raises(ss.OutOfMemoryError, match=r"source 0 is not contiguous.*2,048 bytes.*create_npy"):
            ss.BatchFeeder(x, batch_size=8, device="cpu")
    monkeypatch.setattr(feeder_module, "available_ram", lambda: 4 * x.nbytes // 3 + 4 + (1 << 20))
    with pytest.warns(RuntimeWarning, match="not contiguous"):
        fits = ss.BatchFeeder(x, batch_size=8, order="sequential", device="cpu")
    np.testing.assert_array_equal(torch.cat([b for (b,) in fits]).numpy(), np.ascontiguousarray(x))


@pytest.mark.parametrize("bad_seed", [None, -1])
def test_a_seed_that_is_no_seed_is_refused_saying_how_to_get_a_fresh_order_each_run(rng, bad_seed):
    # seed=None (DataLoader's way to a fresh shuffle each run) got "seed must be an int >= 0, got
    # None": not that the default seed gives one order every run, nor how to draw another.
    x = rng.standard_normal((10, 3)).astype(np.float32)
    with pytest.raises(ss.OptionError, match=r"seed must be an int >= 0, got .*different order each "
                                             r"run.*secrets\.randbits"):
        ss.BatchFeeder(x, batch_size=2, seed=bad_seed, device="cpu")


def test_a_prefetch_whose_batches_would_not_fit_in_half_the_ram_is_refused_before_anything_starts(
        monkeypatch, rng):
    # Unbounded: prefetch=10**9 queued a whole epoch of a file larger than RAM, ahead of the loop.
    import speedswap.data.feeder as feeder_module
    x = rng.standard_normal((40, 16)).astype(np.float32)  # 64 bytes a row
    with pytest.raises(ss.OptionError, match=r"prefetch=1000000000 .*half the RAM available.*prefetch <= "):
        ss.BatchFeeder(x, batch_size=8, prefetch=10**9, device="cpu")
    whole = ss.BatchFeeder(x, batch_size=10**12, device="cpu")  # one batch of every row: it fits
    assert [len(b) for (b,) in whole] == [40]
    batch_bytes = 8 * x[0].nbytes
    monkeypatch.setattr(feeder_module, "available_ram", lambda: 2 * 12 * batch_bytes)
    fits = ss.BatchFeeder(x, batch_size=8, prefetch=10, device="cpu")  # 10 + 2 staged batches: half the RAM
    np.testing.assert_array_equal(np.sort(torch.cat([b for (b,) in fits]).numpy(), axis=0), np.sort(x, axis=0))
    with pytest.raises(ss.OptionError, match=r"prefetch=11 .*prefetch <= 10\b"):
        ss.BatchFeeder(x, batch_size=8, prefetch=11, device="cpu")
    assert reader_threads() == []


@pytest.mark.gpu
def test_on_a_gpu_prefetch_fits_in_half_the_free_memory_counting_what_torch_caches(monkeypatch, rng):
    # Memory torch's caching allocator holds unused is free to batches, though mem_get_info counts it used.
    x = rng.standard_normal((4096, 256)).astype(np.float32)  # 1 KiB a row: a batch of 512 is 512 KiB
    torch.cuda.empty_cache()
    cached = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del cached  # 64 MiB stays reserved by the allocator, used by no tensor
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 40))  # the GPU full
    fits = ss.BatchFeeder(x, batch_size=512, prefetch=2, seed=1, device="cuda")  # 4 batches: 2 MiB
    fed = torch.cat([b for (b,) in fits]).cpu().numpy()
    np.testing.assert_array_equal(np.sort(fed, axis=0), np.sort(x, axis=0))
    with pytest.raises(ss.OptionError, match=r"half the free memory of cuda.*prefetch <= "):
        ss.BatchFeeder(x, batch_size=512, prefetch=10**6, device="cuda")


def test_numpy_bools_and_ints_pass_where_python_ones_do(rng):
    """np.True_ was refused as "must be True ... or False, got np.True_", and a state holding
    np.int64 positions (kept in a numpy or Arrow log) as "not one of this feeder's"."""
    x = np.arange(50)
    made = ss.BatchFeeder(x, batch_size=7, seed=2, drop_last=np.True_, lookahead=np.False_,
                          drop_behind=np.False_, device="cpu")
    reference = ss.BatchFeeder(x, batch_size=7, seed=2, drop_last=True, device="cpu")
    assert len(made) == len(reference) == 7
    first = ids_of(reference, batches=int(rng.integers(1, 6)))
    state = {key: np.int64(value) if key in ("epoch", "batch") else value
             for key, value in reference.state_dict().items()}
    made.load_state_dict(state)
    assert made.state_dict()["batch"] == len(first) and type(made.state_dict()["batch"]) is int
    for got, want in zip(ids_of(made), ids_of(reference)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ss.StateError, match="not one of this feeder's"):
        made.load_state_dict({**state, "batch": np.bool_(True)})


def test_backend_numpy_delivers_on_the_cpu(rng):
    x = rng.standard_normal((10, 3)).astype(np.float32)
    feeder = ss.BatchFeeder(x, batch_size=4, order="sequential", backend="numpy")
    (first,) = next(iter(feeder))
    assert first.device.type == "cpu"
    np.testing.assert_array_equal(first.numpy(), x[:4])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(ss.BackendUnavailableError, match="no CUDA device"):
        ss.BatchFeeder(np.ones(5), batch_size=2, device="cuda")


def test_foreign_or_malformed_state_is_refused():
    feeder = ss.BatchFeeder(np.arange(100), batch_size=10, seed=1, device="cpu")
    other = ss.BatchFeeder(np.arange(100), batch_size=10, seed=2, device="cpu").state_dict()
    with pytest.raises(ss.StateError, match="seed: saved 2, this feeder 1"):
        feeder.load_state_dict(other)
    with pytest.raises(ss.StateError, match="missing"):
        feeder.load_state_dict({"epoch": 1})
    for malformed in (None, "epoch batch", [("epoch", 1)]):
        with pytest.raises(ss.StateError, match="not a BatchFeeder state"):
            feeder.load_state_dict(malformed)
    for position in ({"epoch": True}, {"batch": True}, {"epoch": 1.0}):
        with pytest.raises(ss.StateError, match="state position"):
            feeder.load_state_dict(dict(feeder.state_dict(), **position))
    bad = dict(feeder.state_dict(), batch=10)
    with pytest.raises(ss.StateError, match="batch=10"):
        feeder.load_state_dict(bad)
    with pytest.raises(ss.OptionError):
        feeder.set_epoch(-1)
    assert feeder.state_dict()["epoch"] == 0 and feeder.state_dict()["batch"] == 0


@pytest.mark.parametrize("order", ["random", "block", "sequential"])
def test_rank_zeros_state_resumes_every_rank_of_the_same_world(order, rng):
    """The usual checkpoint: rank 0 saves, every rank loads; each rank then continues its own share."""
    data, world, batch = rng.permutation(1_003), 3, 16

    def feeder(rank, world_size=world):
        return ss.BatchFeeder(data, batch_size=batch, order=order, seed=5, device="cpu",
                              rank=rank, world_size=world_size, drop_last=True)

    saver = feeder(0)
    for _ in zip(range(7), saver):
        pass
    saved = saver.state_dict()
    for rank in range(world):
        resumed, straight = feeder(rank), feeder(rank)
        resumed.load_state_dict(saved)
        assert resumed.state_dict()["rank"] == rank
        expected = [b[0] for b in straight][7:]  # the uninterrupted run of this rank, after 7 batches
        got = [b[0] for b in resumed]
        assert len(got) == len(expected) > 0
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(ss.StateError, match="world_size: saved 3, this feeder 2"):
        feeder(1, world_size=2).load_state_dict(saved)


def test_a_state_saved_before_ranks_took_runs_is_refused_where_the_split_changed():
    # States from before the contiguous split have no "shard" key: their ranks took strides.
    def old_state(feeder):
        return {k: v for k, v in feeder.state_dict().items() if k != "shard"}

    blocks = ss.BatchFeeder(np.arange(100), batch_size=10, order="block", device="cpu", rank=1, world_size=2)
    with pytest.raises(ss.StateError, match="shard: saved 'interleaved', this feeder 'contiguous'"):
        blocks.load_state_dict(dict(old_state(blocks), batch=2))
    blocks.load_state_dict(dict(blocks.state_dict(), batch=2))
    assert blocks.state_dict()["batch"] == 2
    for feeder in (ss.BatchFeeder(np.arange(100), batch_size=10, order="block", device="cpu"),
                   ss.BatchFeeder(np.arange(100), batch_size=10, device="cpu", rank=1, world_size=2)):
        feeder.load_state_dict(dict(old_state(feeder), batch=3))  # one rank, or a random order: unchanged
        assert feeder.state_dict()["batch"] == 3


def test_a_state_saved_before_ranks_took_runs_is_refused_with_a_remedy_that_works(rng):
    """The refusal said 'build the feeder with the same arguments to resume it', which the caller had:
    no arguments rebuild the old strided split of a block or sequential order."""
    data = rng.standard_normal((100, 3)).astype(np.float32)

    def feeder():
        return ss.BatchFeeder(data, batch_size=10, order="sequential", device="cpu", rank=1, world_size=2)

    saver = feeder()
    saver.set_epoch(2)
    old = {k: v for k, v in dict(saver.state_dict(), batch=3).items() if k != "shard"}
    resumed = feeder()
    with pytest.raises(ss.StateError) as info:
        resumed.load_state_dict(old)
    message = str(info.value)
    assert "same arguments" not in message and "set_epoch(2)" in message, message
    resumed.set_epoch(2)  # what the message says: epoch 2 afresh, as an uninterrupted run reads it
    straight = feeder()
    straight.set_epoch(2)
    got, expected = [b[0] for b in resumed], [b[0] for b in straight]
    assert len(got) == len(expected) == len(straight) and all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("order, saved_order", [
    ("random", {"name": "random"}),
    ("block", {"name": "block", "block_rows": 7, "window": 3, "shuffle": "per-window"}),
    ("block", {"name": "block", "block_rows": 7, "window": 3}),
], ids=["random", "block-per-window", "block-one-generator"])
def test_a_state_saved_with_earlier_streams_is_refused_with_a_remedy_that_works(rng, order, saved_order):
    """Until review-z an epoch was drawn from SeedSequence([seed, epoch]) (and, before review-w, a block
    order's windows were shuffled one after another by one generator): such a state resumed mid-epoch
    would read some of the epoch's rows twice and others never, and nothing would say so. Refused,
    nothing changed, with the remedy that works (its epoch afresh); a sequential order's state, which
    has no stream, is taken."""
    data = rng.permutation(100)

    def feeder(order):
        if order == "block":
            order = BlockOrder(block_rows=7, window=3)
        return ss.BatchFeeder(data, batch_size=10, order=order, seed=3, device="cpu")

    resumed = feeder(order)
    saved = resumed.state_dict()
    with pytest.raises(ss.StateError) as info:
        resumed.load_state_dict(dict(saved, epoch=2, batch=3, order=saved_order))
    message = str(info.value)
    assert "set_epoch(2)" in message and "same arguments" not in message, message
    assert "SeedSequence([seed, epoch])" in message, message
    assert ("its own generator" in message) == ("shuffle" not in saved_order and order == "block"), message
    assert resumed.state_dict() == saved
    resumed.set_epoch(2)  # what the message says: epoch 2 afresh, as an uninterrupted run reads it
    straight = feeder(order)
    straight.set_epoch(2)
    got, expected = [b[0] for b in resumed], [b[0] for b in straight]
    assert len(got) == len(expected) == len(straight) and all(torch.equal(a, b) for a, b in zip(got, expected))
    other = feeder("sequential")
    other.load_state_dict(dict(other.state_dict(), epoch=2, batch=3))
    assert (other.state_dict()["epoch"], other.state_dict()["batch"]) == (2, 3)


@pytest.mark.parametrize("kind", [RandomOrder, BlockOrder])
def test_an_epochs_order_is_not_the_seeds_own_stream_nor_another_seeds_epoch(rng, kind):
    """Epochs were drawn from SeedSequence([seed, epoch]), which numpy pads with zero words: epoch 0 was
    default_rng(seed)'s own stream (data a user drew with the feeder's seed shared its bits: its
    permutation(n) was the random order of epoch 0), and seed s + 2**32 (two 32-bit words) read seed s's
    epoch 1 at its epoch 0, which a millisecond timestamp as seed can hit."""
    n = 1000
    order = kind() if kind is RandomOrder else kind(block_rows=1, window=n)  # blocks of one row: one window
    seed = int(rng.integers(1 << 32))
    first = order.indices(n, seed, 0)
    assert not np.array_equal(first, np.random.default_rng(seed).permutation(n))
    assert not np.array_equal(order.indices(n, seed + 2**32, 0), order.indices(n, seed, 1))
    if kind is BlockOrder:  # the blocks' permutation, which the epoch's generator draws
        assert not np.array_equal(order.windows(n, seed, 0)[0], np.random.default_rng(seed).permutation(n))


@pytest.mark.gpu
def test_gpu_batches_match_the_cpu_and_stay_valid(rng, tmp_path):
    n = 5000
    data = random_data(rng, (n, 33))
    np.save(tmp_path / "x.npy", data)
    on_gpu = torch.from_numpy(random_data(rng, (n, 5))).cuda()
    sources = (np.arange(n), ss.DataGadget(tmp_path / "x.npy", CPUPinn=True, backend="cuda"),
               np.load(tmp_path / "x.npy", mmap_mode="r"), on_gpu)
    gpu = ss.BatchFeeder(*sources, batch_size=256, seed=2, device="cuda", prefetch=3)
    kept = []
    for batch in gpu:
        assert all(t.device.type == "cuda" for t in batch)
        kept.append(batch)
        torch.cuda._sleep(1000)  # keep the training stream busy, so copies overlap with it
    torch.cuda.synchronize()
    for ids, a, b, c in kept:  # no batch was overwritten by a later one
        ids = ids.cpu()
        np.testing.assert_array_equal(a.cpu().numpy(), data[ids.numpy()])
        np.testing.assert_array_equal(b.cpu().numpy(), data[ids.numpy()])
        torch.testing.assert_close(c.cpu(), on_gpu.cpu()[ids], rtol=0, atol=0)
    assert sorted(torch.cat([k[0].cpu() for k in kept]).tolist()) == list(range(n))


@pytest.mark.gpu
def test_a_mapped_gadget_on_the_gpu_backend_is_read_by_the_file_reader(rng, tmp_path):
    """pread and block reads, not page faults through the map: the table's backend does not matter."""
    data = random_data(rng, (3000, 9))
    np.save(tmp_path / "x.npy", data)
    gadget = ss.DataGadget(tmp_path / "x.npy", mmap=True, backend="cuda")
    feeder = ss.BatchFeeder(gadget, np.arange(3000), batch_size=256, order="block", device="cuda")
    assert list(feeder._files) == [0]
    seen = [(rows.cpu().numpy(), ids.cpu().numpy()) for rows, ids in feeder]
    for rows, ids in seen:
        np.testing.assert_array_equal(rows, data[ids])
    assert sorted(np.concatenate([ids for _, ids in seen]).tolist()) == list(range(3000))


@pytest.mark.parametrize("make", [lambda d: d[:, :2], lambda d: torch.from_numpy(d)[:, 1:],
                                  lambda d: torch.from_numpy(d.T.copy()).T, lambda d: d[::-1]],
                         ids=["column slice", "tensor column slice", "transposed tensor", "reversed"])
def test_a_source_not_contiguous_is_copied_with_a_warning_and_a_contiguous_one_read_in_place(rng, make):
    data = random_data(rng, (8, 4))
    source = make(data)
    with pytest.warns(RuntimeWarning, match="not contiguous.*copies it once.*later changes"):
        feeder = ss.BatchFeeder(source, batch_size=8, order="sequential", device="cpu")
    (first,) = next(iter(feeder))
    source[:] = 1  # the copy does not see it, as the warning said
    (second,) = next(iter(feeder))
    assert torch.equal(first, second) and not (second == 1).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        in_place = ss.BatchFeeder(data, batch_size=8, order="sequential", device="cpu")
    data[:] = 2
    assert (next(iter(in_place))[0] == 2).all()


@pytest.mark.gpu
def test_a_source_changed_between_loops_is_read_changed(rng):
    """The side stream waits for writes the caller's stream queued before the loop, however late they run."""
    n = 4096
    source = torch.from_numpy(random_data(rng, (n, 16))).cuda()
    feeder = ss.BatchFeeder(source, torch.arange(n).cuda(), batch_size=512, order="sequential",
                            device="cuda", prefetch=3)
    for rows, ids in feeder:
        break  # the next loop continues with batch 1, ids as before (no new epoch, no copy of them)
    torch.cuda._sleep(50_000_000)  # the caller's stream is busy for a while before the write runs
    source.mul_(-1)
    for rows, ids in feeder:
        torch.testing.assert_close(rows, source[ids], rtol=0, atol=0)


@pytest.mark.gpu
def test_pinned_sources_go_through_the_zero_copy_kernel_not_staging(rng):
    """A pinned table's rows reach the batch in one kernel, not a CPU gather plus a copy."""
    n = 4000
    data = random_data(rng, (n, 3, 7))
    gadget = ss.DataGadget(data, CPUPinn=True, backend="cuda")
    labels = np.arange(n)
    feeder = ss.BatchFeeder(gadget, labels, batch_size=300, seed=4, device="cuda", prefetch=2)
    if not gadget.table.moves_on_device:
        pytest.skip("no zero-copy kernels here (CuPy missing): pinned rows are staged")
    assert list(feeder._kernel_tables) == [0]
    assert len(feeder._stager._rings) == 1  # the labels only
    seen = []
    for rows, ids in feeder:
        seen.append((rows, ids))
    torch.cuda.synchronize()
    for rows, ids in seen:
        np.testing.assert_array_equal(rows.cpu().numpy(), data[ids.cpu().numpy()])
    assert sorted(torch.cat([ids.cpu() for _, ids in seen]).tolist()) == list(range(n))


@pytest.mark.gpu
def test_sources_the_gpu_gathers_itself_are_read_without_a_thread(rng):
    """Pinned tables and device tensors cost a batch only kernel launches: no reader thread."""
    n = 3000
    data = random_data(rng, (n, 5))
    gadgets = [ss.DataGadget(data, CPUPinn=True, backend="cuda"),
               ss.DataGadget(np.arange(n), CPUPinn=True, backend="cuda")]
    if not gadgets[0].table.moves_on_device:
        pytest.skip("no zero-copy kernels here (CuPy missing): pinned rows are staged")
    on_device = torch.from_numpy(-data).cuda()
    feeder = ss.BatchFeeder(*gadgets, on_device, batch_size=256, seed=9, device="cuda", prefetch=2)
    assert not feeder._stager.gathers_on_cpu
    seen = []
    for rows, ids, negated in feeder:
        assert reader_threads() == []
        seen.append((rows, ids, negated))
    torch.cuda.synchronize()
    for rows, ids, negated in seen:
        expected = data[ids.cpu().numpy()]
        np.testing.assert_array_equal(rows.cpu().numpy(), expected)
        np.testing.assert_array_equal(negated.cpu().numpy(), -expected)
    assert sorted(torch.cat([ids.cpu() for _, ids, _ in seen]).tolist()) == list(range(n))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_orders_drawn_ahead_are_each_epochs_own_order(order, world_size, rng):
    """The next epoch's order is drawn on a thread while this one is read; whatever the loop does
    meanwhile (leave early, jump with set_epoch, load a state), each epoch reads its own order."""
    rows, batch, seed = 503, 40, int(rng.integers(1 << 30))

    def make(rank=world_size - 1):
        return ss.BatchFeeder(np.arange(rows), batch_size=batch, order=small_order(order), seed=seed,
                              rank=rank, world_size=world_size, device="cpu")

    feeder = make()
    drawn = make_order(small_order(order), 8, rows)

    def expected(epoch, start=0, stop=None):
        ids = shard(drawn.indices(rows, seed, epoch), world_size - 1, world_size, False,
                    contiguous=hasattr(drawn, "windows") and world_size > 1)
        return [ids[k * batch:(k + 1) * batch] for k in range(len(feeder))][start:stop]

    def check(got, want):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)

    check(ids_of(feeder), expected(0))            # epoch 1 is drawn meanwhile
    check(ids_of(feeder, batches=3), expected(1, 0, 3))
    feeder.set_epoch(4)                           # not the epoch drawn ahead
    check(ids_of(feeder), expected(4))
    check(ids_of(feeder), expected(5))
    state = make()
    state.set_epoch(2)
    ids_of(state, batches=2)
    feeder.load_state_dict(state.state_dict())    # back to epoch 2, batch 2
    check(ids_of(feeder), expected(2, 2))
    check(ids_of(feeder, batches=1), expected(3, 0, 1))


def test_an_order_that_raises_when_drawn_ahead_raises_in_the_loop_at_its_epoch():
    class Failing(RandomOrder):
        def indices(self, num_rows, seed, epoch):
            if epoch == 1 and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("no order for epoch 1")
            return super().indices(num_rows, seed, epoch)

    feeder = ss.BatchFeeder(np.arange(100), batch_size=10, order=Failing(), seed=2, device="cpu")
    reference = ss.BatchFeeder(np.arange(100), batch_size=10, seed=2, device="cpu")
    first = ids_of(feeder)                        # epoch 0 reads; epoch 1's draw fails meanwhile
    np.testing.assert_array_equal(np.concatenate(first), np.concatenate(ids_of(reference)))
    with pytest.raises(RuntimeError, match="no order for epoch 1"):
        ids_of(feeder)                            # raised here, on the loop's thread
    assert feeder.state_dict()["epoch"] == 1      # nothing was read: the epoch starts again
    np.testing.assert_array_equal(np.concatenate(ids_of(feeder)), np.concatenate(ids_of(reference)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_while_the_next_order_is_drawn_draws_its_own():
    """The thread drawing the next epoch's order does not exist in a forked child: waiting for it
    would hang forever, so the child draws the order itself."""
    drawing = threading.Event()

    class Slow(RandomOrder):
        def indices(self, num_rows, seed, epoch):
            if epoch == 1 and threading.current_thread() is not threading.main_thread():
                drawing.set()
                time.sleep(2)  # the parent forks meanwhile
            return super().indices(num_rows, seed, epoch)

    feeder = ss.BatchFeeder(np.arange(50), batch_size=10, order=Slow(), seed=4, device="cpu")
    expected = RandomOrder().indices(50, 4, 1)[:10]
    loop = iter(feeder)
    next(loop)  # epoch 0 begins: epoch 1 is drawn on a thread
    assert drawing.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: rest of epoch 0, then epoch 1's first batch, within 5 s or killed
        code = 1
        try:
            signal.alarm(5)
            for _ in loop:
                pass
            code = 0 if np.array_equal(next(iter(feeder))[0].numpy(), expected) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    for _ in loop:
        pass
    np.testing.assert_array_equal(next(iter(feeder))[0].numpy(), expected)  # the parent's draw


@pytest.mark.parametrize("order", ["block", BlockOrder(block_rows=2**62, window=4)])
def test_a_block_is_never_larger_than_the_data(order):
    """Ten one-byte rows once got blocks of 4 MiB of rows: 0.5 GiB and 2 s an epoch laid out."""
    feeder = ss.BatchFeeder(np.arange(10, dtype=np.uint8), batch_size=5, order=order, seed=1, device="cpu")
    assert feeder.order.block_rows == 10
    epochs = [np.sort(np.concatenate(ids_of(feeder))) for _ in range(3)]
    for rows in epochs:
        np.testing.assert_array_equal(rows, np.arange(10))
    small = ss.BatchFeeder(np.zeros((10_000, 9), dtype=np.uint8), batch_size=1000, order="block", device="cpu")
    assert small.order.block_rows == 10_000  # 4 MiB of 9-byte rows and their 8-byte ids is 246,723 rows
    large = ss.BatchFeeder(np.zeros((5_000, 1024), dtype=np.uint8), batch_size=1000, order="block", device="cpu")
    assert large.order.block_rows == 4064  # 4 MiB of 1 KiB rows and their ids: the data holds more
    # A sequential order holds no ids: 4 MiB of rows.
    large = ss.BatchFeeder(np.zeros((5_000, 1024), dtype=np.uint8), batch_size=1000, order="sequential",
                           device="cpu")
    assert large.order.block_rows == 4096


def test_launch_ahead_reads_depth_batches_ahead_in_order_and_raises_at_the_failing_batch():
    """The GPU's reader for batches it gathers itself, on the loop's thread (see NOTES 46)."""
    from speedswap.data.readahead import LaunchAhead
    calls = []

    def read(k):
        calls.append(k)
        if k == 6:
            raise RuntimeError("batch 6 failed")
        return k * 10

    reader = LaunchAhead(read, 2, 9, depth=3)
    assert reader.next() == 20 and calls == [2, 3, 4, 5]  # batch 2 handed out, 3 read ahead
    assert reader.next() == 30 and calls == [2, 3, 4, 5, 6]  # batch 6 failed: nothing after it
    assert reader.next() == 40 and reader.next() == 50 and calls == [2, 3, 4, 5, 6]
    with pytest.raises(RuntimeError, match="batch 6 failed"):
        reader.next()
    reader = LaunchAhead(read, 7, 9, depth=3)
    assert [reader.next(), reader.next()] == [70, 80] and calls[-2:] == [7, 8]  # never past the stop
    reader.close()


def test_launch_ahead_closed_by_another_thread_right_after_a_read_raises_state_error():
    """set_epoch on another thread closes the loop's LaunchAhead (a GPU feeder's): landing between
    the read of the batch asked for and its hand-over, the loop popped an emptied queue (IndexError)."""
    import collections
    from speedswap.data.readahead import LaunchAhead

    reader = LaunchAhead(lambda k: k * 10, 0, 9, depth=3)

    class ClosedAfterAppend(collections.deque):
        def append(self, item):
            super().append(item)
            reader.close()  # the GIL may pass to the closing thread right after the append

    reader._ahead = ClosedAfterAppend()
    with pytest.raises(ss.StateError, match="another thread"):
        reader.next()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("read_ahead_s", [0.0, 0.5])  # at the fork: batches queued or not yet
def test_a_loop_continued_in_a_forked_process_raises_and_a_new_loop_reads_on(tmp_path, rng, read_ahead_s):
    """A memory-mapped source is read ahead on a thread, which a forked child does not have: its
    loop hands out the batches read before the fork, then says so instead of waiting forever, and
    a new loop in the child reads the stream on from the batch after them. (The test expected no
    batch read ahead at the fork; a loaded machine let the thread queue two first, and it failed.)"""
    np.save(tmp_path / "x.npy", np.arange(2000))
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    feeder = ss.BatchFeeder(mapped, batch_size=100, seed=3, device="cpu", prefetch=2)
    expected = ids_of(ss.BatchFeeder(np.arange(2000), batch_size=100, seed=3, device="cpu"))
    loop = iter(feeder)
    first = next(loop)[0].numpy().copy()
    time.sleep(read_ahead_s)
    pid = os.fork()
    if pid == 0:  # the child: within 10 s or killed
        code = 1
        try:
            signal.alarm(10)
            handed = []
            try:
                for batch in loop:
                    handed.append(batch[0].numpy())
                code = 2
            except ss.StateError as exc:
                code = 0 if "forked" in str(exc) and len(handed) <= 2 else 3
            if code == 0:
                rest = [b[0].numpy() for b in feeder]  # a new loop: the batches not yet handed out
                code = 0 if all(np.array_equal(a, b) for a, b in zip(handed + rest, expected[1:])) \
                    and len(handed + rest) == len(expected) - 1 else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        loop.close()  # its reader thread would outlive the failure, and fail the worker's later tests
        pytest.fail(f"child status {status}")
    np.testing.assert_array_equal(first, expected[0])
    rest = [b[0].numpy() for b in loop]
    assert len(rest) == len(expected) - 1
    for a, b in zip(rest, expected[1:]):
        np.testing.assert_array_equal(a, b)



@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
@pytest.mark.parametrize("cls, source, options", [
    (ss.BatchFeeder, np.ones(5), {"batch_size": 2, "device": "cuda"}),
    (ss.BatchFeeder, np.ones(5), {"batch_size": 2, "backend": "cuda"}),
    (ss.data.DataGadget, np.ones((5, 2), np.float32), {"backend": "cuda"}),
])
def test_asking_for_cuda_without_it_raises_an_error_the_docstring_names(cls, source, options):
    with pytest.raises(ss.SpeedswapError) as caught:
        cls(source, **options)
    raises = cls.__doc__.split("Raises:")[1]
    assert f"{type(caught.value).__name__}:" in raises, f"{cls.__name__} raised {caught.value!r}"


def assert_child_forked_holding_succeeds(lock, child, alarm_s=5):
    """Fork while ``lock`` is held, as by a thread caught holding it at the fork (a thread the child
    does not have), run ``child()`` in the child under an alarm, and assert it returned 0."""
    with lock:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(alarm_s)  # a child waiting on the lock for good is killed: status 14
                code = child()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_read_ahead_forked_while_its_thread_queued_a_batch_hands_out_the_queue_then_says_so():
    """A process forked while the read-ahead thread was putting a batch in the queue inherits the
    queue's lock held, by a thread the child does not have: the child's next() waited on it forever.
    The child hands out the batches queued before the fork, then raises StateError."""
    from speedswap.data.readahead import ReaderThread

    reader = ReaderThread(lambda k: k * 10, 0, 5, depth=2)

    def child():
        handed = [reader.next(), reader.next()]
        try:
            reader.next()
            return 2
        except ss.StateError as exc:
            return 0 if handed == [0, 10] and "forked" in str(exc) else 3
        finally:
            reader.close()

    try:
        deadline = time.monotonic() + 10
        while reader._queue.qsize() < 2 and time.monotonic() < deadline:  # batches 0 and 1 queued
            time.sleep(0.01)
        # Said here, or a slow thread would fail the fork check below for another reason.
        assert reader._queue.qsize() == 2, "the read-ahead thread queued less than two batches in 10 s"
        assert_child_forked_holding_succeeds(reader._queue.mutex, child)  # as the thread inside put()
    finally:
        reader.close()


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
@pytest.mark.parametrize("window", [2**40, 2**70])
def test_a_window_whose_layout_cannot_fit_in_ram_is_refused_with_the_largest_that_fits(kind, window, rng):
    """window=2**40 raised a raw MemoryError (8 TiB of padding) and 2**70 numpy's ValueError, mid-loop."""
    x = rng.standard_normal((50, 2)).astype(np.float32)
    with pytest.raises(ss.OptionError, match=rf"window={window}\) .*RAM available.*use a window of at most "):
        ss.BatchFeeder(x, batch_size=10, order=kind(window=window), device="cpu")
    with pytest.raises(ss.OptionError, match=rf"window={window}\) .*RAM available"):
        kind(block_rows=5, window=window).windows(50, seed=0, epoch=0)


def test_the_largest_window_named_is_accepted_and_one_more_is_refused(monkeypatch, rng):
    import speedswap.data.orders as orders_module
    monkeypatch.setattr(orders_module, "available_ram", lambda: 1 << 20)
    block_rows = int(rng.integers(3, 9))
    with pytest.raises(ss.OptionError, match=r"use a window of at most [\d,]+ blocks") as refused:
        BlockOrder(block_rows=block_rows, window=1 << 20).indices(50, seed=0, epoch=0)
    most = int(re.search(r"at most ([\d,]+) ", str(refused.value)).group(1).replace(",", ""))
    rows = BlockOrder(block_rows=block_rows, window=most).indices(50, seed=0, epoch=0)
    np.testing.assert_array_equal(np.sort(rows), np.arange(50))
    with pytest.raises(ss.OptionError):
        BlockOrder(block_rows=block_rows, window=most + 1).indices(50, seed=0, epoch=0)


@pytest.mark.filterwarnings("ignore:speedswap. no CUDA device here")
def test_device_none_is_documented_and_delivers_where_auto_and_a_tables_none_do(rng):
    """device=None was accepted as "auto" though the docstring listed only the strings."""
    device_doc = re.search(r"^    device: (.*?)^    \w", inspect.getdoc(ss.BatchFeeder), re.S | re.M).group(1)
    assert "None" in device_doc and "torch.device" in device_doc
    x = rng.standard_normal((30, 3)).astype(np.float32)
    none = ss.BatchFeeder(x, batch_size=7, device=None, seed=5)
    auto = ss.BatchFeeder(x, batch_size=7, device="auto", seed=5)
    table = ss.HostTable.zeros(4, 3, device=None)
    assert none.device == auto.device == table.device
    for (a,), (b,) in zip(none, auto):
        assert a.device == none.device
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    table.close()


@pytest.mark.parametrize("kind", [BlockOrder, SequentialOrder])
def test_a_window_accepted_when_the_feeder_was_built_is_not_refused_when_ram_dips_later(kind, monkeypatch,
                                                                                        rng, tmp_path):
    """The window was checked against the RAM available when the feeder took the order and again
    at every epoch's layout: RAM free dipping for a moment mid-training (another process's peak)
    stopped the run with OptionError at the next epoch, for a window accepted at build time."""
    import speedswap.data.orders as orders_module
    path = tmp_path / "x.npy"
    np.save(path, rng.standard_normal((int(rng.integers(40, 80)), 3)).astype(np.float32))
    x, seed = np.load(path, mmap_mode="r"), int(rng.integers(1 << 30))

    def feeder():  # a memory-mapped file: read a window of blocks at a time (windows() per epoch)
        return ss.BatchFeeder(x, batch_size=7, order=kind(block_rows=4, window=3), device="cpu", seed=seed)

    accepted = feeder()
    expected = [[batch.clone() for (batch,) in accepted] for _ in range(2)]
    dipped = feeder()
    monkeypatch.setattr(orders_module, "available_ram", lambda: 1)  # less than any window's layout
    for epoch in expected:
        got = [batch for (batch,) in dipped]
        assert len(got) == len(epoch)
        for batch, want in zip(got, epoch):
            torch.testing.assert_close(batch, want, rtol=0, atol=0)
        rows = torch.cat(got).numpy()
        np.testing.assert_array_equal(rows[np.lexsort(rows.T)], np.asarray(x)[np.lexsort(np.asarray(x).T)])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_uint64_ids_are_refused_saying_how_to_convert_them(rng, kind):
    """A feeder or gadget over uint64 ids (hashes, a tokenizer's output) said only "dtype uint64 is
    not supported; use one of [...]", not that ids.astype(np.int64) keeps them."""
    ids = rng.integers(0, 2**40, size=(64, 3), dtype=np.uint64)
    source = ids if kind == "numpy" else torch.from_numpy(ids.astype(np.int64)).to(torch.uint64)
    for build in (lambda: ss.BatchFeeder(source, batch_size=16, order="sequential", device="cpu"),
                  lambda: ss.DataGadget(source, backend="numpy")):
        with pytest.raises(ss.DTypeError, match=r"uint64") as refused:
            build()
        assert "ids.astype(np.int64)" in str(refused.value) and "ids.to(torch.int64)" in str(refused.value)
    # What the message advises keeps every id.
    feeder = ss.BatchFeeder(ids.astype(np.int64), batch_size=16, order="sequential", device="cpu")
    np.testing.assert_array_equal(torch.cat([batch for (batch,) in feeder]).numpy().astype(np.uint64), ids)


def test_an_order_of_another_class_is_refused_naming_the_orders_a_feeder_takes(rng):
    """Order's docstring invited subclasses ("set name and implement indices"), which the feeder
    refused saying only "or an order object"; it now names the three it takes and what to do."""
    class Reversed(Order):
        name = "reversed"

        def indices(self, num_rows, seed, epoch):
            return np.arange(num_rows)[::-1].copy()

    data = rng.standard_normal((10, 3)).astype(np.float32)
    with pytest.raises(ss.OptionError, match=r"\['RandomOrder', 'BlockOrder', 'SequentialOrder'\], got "
                                             r"Reversed.*get\(ids\)"):
        ss.BatchFeeder(data, batch_size=4, order=Reversed(), device="cpu")
