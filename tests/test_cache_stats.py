"""``stats()`` against counts made independently from the ids a run feeds.

Each counter of a training step and of the forwards outside training (eval
mode, ``no_grad``, ``inference_mode``) is predicted from the ids and from
which rows the device cache held before and after each call (its
``slot_row`` and ``dirty`` flags): a hit is an id whose row was cached, a
miss crosses with its state, a row a step leaves uncached goes back, an
evicted row goes back when dirty (a step's eviction) or always (a
prefetch's). Without a cache, and with one holding the whole table, which
rows are cached follows from the ids alone, and that is checked too.
"""

import pytest
import torch

import speedswap as ss
from speedswap.train.cache import COUNTERS

ROWS, DIM, BATCH, STEPS = 200, 4, 40, 12
ROW_BYTES = DIM * 4  # float32
WITH_STATE = ROW_BYTES * 3  # Adam's exp_avg and exp_avg_sq travel with each row
#: What stats()["eval"] counts: forwards outside training, their ids, the ids whose row was cached,
#: and the rows and bytes read from the host.
EVAL_COUNTERS = ("forwards", "lookups", "hits", "rows_h2d", "bytes_h2d")


def _cached(emb):
    """The rows the cache holds, and those of them that are dirty."""
    cache = emb._cache
    rows = cache.slot_row.cpu().numpy()
    dirty = cache.dirty.cpu().numpy()
    return set(rows[rows >= 0].tolist()), set(rows[(rows >= 0) & dirty].tolist())


def _zipf_ids(rng, size):
    return rng.zipf(1.3, size=size) % ROWS


class Expected:
    """The counters a run should report, counted from its ids and the cache's contents."""

    def __init__(self):
        self.total = dict.fromkeys(COUNTERS, 0)
        self.eval = dict.fromkeys(EVAL_COUNTERS, 0)
        self.step = None

    def begin_step(self):
        self.step = dict.fromkeys(COUNTERS, 0)

    def add(self, **amounts):
        for key, value in amounts.items():
            self.step[key] += value

    def end_step(self):
        self.step["steps"] = 1
        for key, value in self.step.items():
            self.total[key] += value

    def fetch(self, ids, cached, state_read):
        unique = set(ids.tolist())
        hits = len(unique & cached)
        misses = len(unique) - hits
        self.add(lookups=ids.size, unique_rows=len(unique), hits=hits, misses=misses, rows_h2d=misses,
                 bytes_h2d=misses * (WITH_STATE if state_read else ROW_BYTES))
        return unique

    def prefetch(self, before, after):
        brought, evicted = after - before, before - after  # a prefetch writes back every row it evicts
        self.add(prefetched_rows=len(brought), rows_h2d=len(brought), bytes_h2d=len(brought) * WITH_STATE,
                 evictions=len(evicted), rows_d2h=len(evicted), bytes_d2h=len(evicted) * WITH_STATE)
        return len(brought)

    def store(self, unique, before, dirty_before, after):
        evicted = before - after
        back = len(unique - after) + len(evicted & dirty_before)
        self.add(evictions=len(evicted), rows_d2h=back, bytes_d2h=back * WITH_STATE)

    def read(self, ids, cached):
        """Count an eval forward of ``ids``; returns the rows it must read from the host."""
        flat = ids.reshape(-1).tolist()
        hits = sum(i in cached for i in flat)
        # Hits come from the cache; each uncached row crosses once, however often it repeats. With
        # nothing cached there is nothing to look up: every id's row crosses, as without a cache.
        missing = sorted(set(flat) - cached) if cached else sorted(flat)
        for key, value in dict(forwards=1, lookups=ids.size, hits=hits, rows_h2d=len(missing),
                               bytes_h2d=len(missing) * ROW_BYTES).items():
            self.eval[key] += value
        return missing


def _recording_host_reads(emb, monkeypatch):
    """Record the rows every read of the embedding's host table asks for, in a list returned."""
    table, reads = emb._cache.table, []
    gather = table.gather_validated

    def recording(rows, out):
        reads.extend(rows.tolist())
        return gather(rows, out)

    monkeypatch.setattr(table, "gather_validated", recording)
    return reads


def _outside_training(emb, kind, ids):
    if kind == "eval":
        emb.eval()
        with torch.no_grad():
            out = emb(ids)
        emb.train()
    elif kind == "no_grad":
        with torch.no_grad():
            out = emb(ids)
    else:
        with torch.inference_mode():
            out = emb(ids)
    return out


@pytest.mark.parametrize("cache_rows", [0, 10, ROWS])
@pytest.mark.parametrize("prefetch", [False, True])
def test_every_counter_matches_a_count_from_the_ids_with_eval_forwards_apart(cache_rows, prefetch, backend,
                                                                              rng, monkeypatch):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=ROWS, storage="pageable", backend=backend,
                                cache_rows=cache_rows)
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    host_reads = _recording_host_reads(emb, monkeypatch)
    device = emb.weight.device
    batches = [_zipf_ids(rng, BATCH) for _ in range(STEPS + 1)]
    expected, seen = Expected(), set()  # seen: the rows a whole-table cache must hold
    for step in range(STEPS):
        for _ in range(int(rng.integers(0, 3))):
            kind = ["eval", "no_grad", "inference_mode"][int(rng.integers(0, 3))]
            ids = _zipf_ids(rng, (int(rng.integers(1, 4)), int(rng.integers(1, 20))))
            cached, dirty = _cached(emb)
            training_before = emb.stats()["total"]
            host_reads.clear()
            out = _outside_training(emb, kind, torch.from_numpy(ids).to(device))
            assert out.shape == (*ids.shape, DIM)
            # What the counters say crossed is what was read from the host: the uncached rows, once.
            assert sorted(host_reads) == expected.read(ids, cached), (step, kind)
            assert _cached(emb) == (cached, dirty)  # a read neither brings nor evicts a row
            assert emb.stats()["total"] == training_before, kind
            assert emb.stats()["eval"] == expected.eval, (step, kind)
        ids = batches[step]
        expected.begin_step()
        cached, _ = _cached(emb)
        if cache_rows == 0:
            assert cached == set()
        elif cache_rows == ROWS:
            assert cached == seen
        unique = expected.fetch(ids, cached, state_read=step > 0)  # the first step creates Adam's state
        loss = emb(torch.from_numpy(ids).to(device)).pow(2).sum()
        if prefetch:
            before, _ = _cached(emb)
            brought = emb.prefetch(torch.from_numpy(batches[step + 1]).to(device))
            after, _ = _cached(emb)
            assert brought == expected.prefetch(before, after)
            seen |= after
        loss.backward()
        before, dirty_before = _cached(emb)
        opt.step()
        opt.zero_grad()
        after, _ = _cached(emb)
        expected.store(unique, before, dirty_before, after)
        expected.end_step()
        seen |= unique
        stats = emb.stats()
        assert stats["last_step"] == expected.step, step
        assert stats["total"] == expected.total, step
        assert stats["eval"] == expected.eval, step
    assert expected.eval["forwards"] > 0 and expected.total["unique_rows"] > 0
    if cache_rows:
        assert expected.total["hits"] > 0 and expected.eval["hits"] > 0
    emb.close()
    assert emb.stats()["eval"] == expected.eval  # kept, as the training counters are


def test_eval_forwards_leave_the_training_hit_rate_and_info_alone(backend, rng):
    """``info()``'s hit rate, like ``total``, is the training steps': eval reads count apart."""
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=ROWS, storage="pageable", backend=backend, cache_rows=50)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    device = emb.weight.device
    for _ in range(5):
        emb(torch.from_numpy(_zipf_ids(rng, BATCH)).to(device)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    total = emb.stats()["total"]
    rate = ss.info()["cache_hit_rate"]
    with torch.no_grad():
        emb(torch.from_numpy(_zipf_ids(rng, 500)).to(device))
    assert emb.stats()["total"] == total and ss.info()["cache_hit_rate"] == rate
    assert emb.stats()["eval"]["lookups"] == 500
    emb.close()


def test_stats_before_attach_have_every_section_at_zero(backend, rng):
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=ROWS, storage="pageable", backend=backend, cache_rows=8)
    with torch.no_grad():
        emb(torch.from_numpy(_zipf_ids(rng, 30)))  # reads the table itself: no cache yet
    stats = emb.stats()
    assert stats["eval"] == dict.fromkeys(EVAL_COUNTERS, 0)
    assert stats["total"] == stats["last_step"] == dict.fromkeys(COUNTERS, 0)
