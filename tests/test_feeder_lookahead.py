"""BatchFeeder(lookahead=True): each batch comes with the next one, and the stream stays the same."""

import numpy as np
import pytest
import torch

import speedswap as ss
from test_feeder import ORDERS, id_source, random_data, small_order  # noqa: F401 - a fixture

N, BATCH = 1000, 37


def feeder(source, order, lookahead, drop_last=False, **kwargs):
    return ss.BatchFeeder(source, batch_size=BATCH, order=small_order(order), drop_last=drop_last,
                          seed=11, device="cpu", lookahead=lookahead, **kwargs)


def ids_of(pairs):
    """``(batch ids, next batch ids or None)`` for each pair; the first source names the rows."""
    return [(b[0].numpy().copy(), None if a is None else a[0].numpy().copy()) for b, a in pairs]


def check_pairs(got):
    """Each pair's next batch is the next pair's batch; the last of the epoch has none."""
    for (_, ahead), (batch, _) in zip(got, got[1:]):
        np.testing.assert_array_equal(ahead, batch)
    assert got[-1][1] is None


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_pairs_are_the_plain_stream_with_the_next_batch(order, drop_last, id_source):
    plain = feeder(id_source, order, False, drop_last)
    ahead = feeder(id_source, order, True, drop_last, prefetch=3)
    for _ in range(2):  # the second epoch too
        expected = [b[0].numpy() for b in plain]
        pairs = list(ahead)
        assert len(pairs) == len(expected) == len(ahead)
        for (batch, next_batch), following in zip(pairs, pairs[1:]):
            assert next_batch is following[0]  # the same tensors, read once
        got = ids_of(pairs)
        check_pairs(got)
        for (batch, _), want in zip(got, expected):
            np.testing.assert_array_equal(batch, want)
    assert ahead.epoch == plain.epoch == 2


@pytest.mark.parametrize("order", ORDERS)
def test_resume_mid_epoch_starts_with_the_next_batch(order, id_source, rng):
    plain = feeder(id_source, order, False)
    per_epoch = len(plain)
    reference = [b[0].numpy().copy() for _ in range(3) for b in plain]
    cuts = sorted({int(rng.integers(1, per_epoch)), per_epoch + per_epoch // 2, 2 * per_epoch})
    got, state, promised = [], None, None
    for k, cut in enumerate(cuts + [3 * per_epoch]):
        lookahead = k % 2 == 0  # a lookahead feeder's state resumes a plain one, and back
        resumed = feeder(id_source, order, lookahead)
        if state is not None:
            resumed.load_state_dict(state)
        first = len(got)
        while len(got) < cut:
            for item in resumed:
                got.append((item[0] if lookahead else item)[0].numpy().copy())
                if len(got) == cut:
                    break
        if promised is not None:  # the next batch of the last pair before the cut
            np.testing.assert_array_equal(got[first], promised)
        promised = item[1][0].numpy().copy() if lookahead and item[1] is not None else None
        state = resumed.state_dict()
        assert (state["epoch"], state["batch"]) == divmod(cut, per_epoch)
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        np.testing.assert_array_equal(a, b)


def test_a_loop_left_early_continues_with_the_next_batch():
    ahead = ss.BatchFeeder(np.arange(100), batch_size=10, seed=3, device="cpu", lookahead=True)
    for (batch,), next_batch in ahead:
        if batch[0] >= 0:
            break
    assert ahead.state_dict()["batch"] == 1
    (first,), _ = next(iter(ahead))
    np.testing.assert_array_equal(first.numpy(), next_batch[0].numpy())


def test_named_sources_and_a_transform_run_once_per_batch(rng):
    x = random_data(rng, (50, 3))
    calls = []

    def transform(batch):
        calls.append(batch["ids"][0].item())
        return {**batch, "x": batch["x"] * 2}
    ahead = ss.BatchFeeder(ids=np.arange(50), x=x, batch_size=8, order="sequential", device="cpu",
                           transform=transform, lookahead=True)
    pairs = list(ahead)
    assert len(calls) == len(pairs) == 7  # each batch transformed once, when it was read
    for batch, next_batch in pairs:
        np.testing.assert_array_equal(batch["x"].numpy(), x[batch["ids"].numpy()] * 2)
        assert next_batch is None or next_batch["ids"][0] == batch["ids"][-1] + 1


def test_an_error_reading_the_next_batch_comes_before_this_one_is_counted():
    def transform(batch):
        if batch[0][0] == 20:
            raise ValueError("bad batch")
        return batch
    ahead = ss.BatchFeeder(np.arange(40), batch_size=10, order="sequential", device="cpu",
                           transform=transform, lookahead=True)
    seen = []
    with pytest.raises(ValueError, match="bad batch"):
        for (batch,), _ in ahead:
            seen.append(batch[0].item())
    # Batch 10 was never handed over (reading 20 for its pair failed): it comes again.
    assert seen == [0] and ahead.state_dict()["batch"] == 1


def test_lookahead_must_be_a_bool():
    with pytest.raises(ss.OptionError, match="lookahead"):
        ss.BatchFeeder(np.arange(5), batch_size=2, lookahead="yes")


def test_a_loop_prefetching_the_next_batch_trains_as_one_without(rng):
    """The loop lookahead is for: emb.prefetch(next ids) while this step computes."""
    ids = rng.integers(0, 200, size=(300, 4))
    tables = []
    for cache_rows, lookahead in ((0, False), (120, True)):
        torch.manual_seed(1)
        emb = ss.OffloadedEmbedding(200, 4, max_rows=64, storage="pageable", backend="numpy",
                                    cache_rows=cache_rows)
        opt = torch.optim.Adam(emb.parameters(), lr=0.05)
        emb.attach(opt)
        stream = ss.BatchFeeder(ids, batch_size=8, seed=2, device="cpu", lookahead=lookahead)
        for _ in range(2):
            for item in stream:
                (batch,), ahead = item if lookahead else (item, None)
                rows = emb(batch)
                if ahead is not None:
                    emb.prefetch(ahead[0])
                rows.pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
        if cache_rows:
            assert emb.stats()["total"]["prefetched_rows"] > 0
        emb.flush()
        tables.append(emb.table.to_numpy(copy=True))
    np.testing.assert_array_equal(tables[0], tables[1])


@pytest.mark.gpu
def test_gpu_pairs_match_the_cpu(rng):
    data = random_data(rng, (500, 6))
    cpu = ss.BatchFeeder(np.arange(500), data, batch_size=64, seed=4, device="cpu", lookahead=True)
    gpu = ss.BatchFeeder(np.arange(500), data, batch_size=64, seed=4, device="cuda",
                         lookahead=True)
    for (batch, ahead), (gbatch, gahead) in zip(cpu, gpu):
        for a, b in zip(batch, gbatch):
            np.testing.assert_array_equal(a.numpy(), b.cpu().numpy())
        assert (ahead is None) == (gahead is None)
        if ahead is not None:
            np.testing.assert_array_equal(ahead[1].numpy(), gahead[1].cpu().numpy())
