"""Scale-out: the examples' ``--distributed`` helpers and the feeder's ranks, at tiny sizes in one process.

Ranks are simulated by patching ``torch.distributed``'s rank and world size,
as ``tests/test_feeder.py`` does: what a rank reads depends on nothing else.
"""

import argparse
import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.apps import word2vec
from speedswap.apps.corpus import synthetic_corpus
from speedswap.apps.pairs import NegativeSampler, PairChunks
from speedswap.train.exchange import row_bounds

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name):
    """Import ``examples/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def as_rank(monkeypatch, rank, world):
    """Make ``torch.distributed`` report an initialised group in which this process is ``rank``."""
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)


def rows_of(centres, contexts, negatives):
    """A batch's pairs, each ``(centre, context, *negatives)``, sorted: the batch as a multiset of pairs."""
    return sorted(map(tuple, torch.cat([centres[:, None], contexts[:, None], negatives], dim=1).tolist()))


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_sharded_word2vec_steps_are_the_one_process_steps_cut_between_the_ranks(world, seed):
    """Each rank drew its negatives from ``--seed * 1000 + rank`` and read ``--batch-size / W`` pairs of
    its own: the steps depended on the world size. Now every step is the one-process run's batch, its
    negatives included, the ranks' slices differing by at most a pair; a chunk's short last batch trains,
    as in one process (chunks of 1000, 1000 and 2 tokens: the last makes a step of 2 pairs, in which
    some ranks get none)."""
    distributed = load_example("_distributed")
    corpus = synthetic_corpus(200, 4, 2_002, seed=seed)  # the last document: 2 words, so 2 pairs
    chunks = PairChunks(corpus, window=5, negatives=3, subsample=0, chunk_tokens=1_000, seed=seed)
    batch_size, steps = 1_001, 40  # 40 steps: more than two passes over the corpus
    with chunks.batches(1 << 30, batch_size=batch_size) as planned:
        expected = [next(b for b in planned if len(b)) for _ in range(steps)]
    shares = []
    for rank in range(world):
        with chunks.stream(1 << 30) as stream:
            batches = distributed._shares(stream, batch_size, rank, world, len(corpus.tokens))
            shares.append([next(batches) for _ in range(steps)])
    assert sum(len(batch) == 2 for batch in expected) >= 2
    for step, batch in enumerate(expected):
        ranks = [share[step] for share in shares]
        assert [pairs for *_, pairs in ranks] == [len(batch)] * world
        sizes = [len(centres) for centres, *_ in ranks]
        assert sum(sizes) == len(batch) and max(sizes) - min(sizes) <= 1
        union = [torch.cat(ids) for ids in zip(*(ids for *ids, _ in ranks))]
        assert rows_of(*union) == rows_of(batch.centres, batch.contexts, batch.negatives)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_sharded_word2vec_rank_draws_the_negatives_of_its_own_pairs_only(world, seed, monkeypatch):
    """Every rank drew all of each chunk's negatives, the one-process run's, and kept its share: 2 ranks
    trained 0.39x the pairs/s of 2 ranks drawing their own (NOTES 78). Now a rank draws the negatives
    of the pairs it trains, 1/W of them (steps of 1,001 pairs, chunks of about 6,000)."""
    distributed = load_example("_distributed")
    corpus = synthetic_corpus(200, 4, 4_000, seed=seed)
    chunks = PairChunks(corpus, window=5, negatives=3, subsample=0, chunk_tokens=1_000, seed=seed)
    drawn = []
    call = NegativeSampler.__call__
    monkeypatch.setattr(NegativeSampler, "__call__",
                        lambda self, shape, **kw: drawn.append(math.prod(shape)) or call(self, shape, **kw))
    every_pass = itertools.chain.from_iterable(map(chunks.epoch, itertools.count()))  # no thread: counted as taken
    batches = distributed._shares(every_pass, 1_001, world - 1, world, len(corpus.tokens))
    steps = [next(batches) for _ in range(15)]
    trained = sum(len(centres) for centres, *_ in steps)
    first, second = itertools.islice(chunks.epoch(0), 2)
    assert sum(pairs for *_, pairs in steps) > len(first.centres) + len(second.centres)  # into a third chunk
    assert all(negatives.shape == (len(centres), 3) for centres, _, negatives, _ in steps)
    assert sum(drawn) == 3 * trained, (sum(drawn), trained)


def test_sharded_word2vec_corpus_without_pairs_is_refused_after_one_pass():
    """One-word documents give no pair: the ranks would wait for a step for ever."""
    distributed = load_example("_distributed")
    corpus = synthetic_corpus(50, 2, 400, doc_len=1, seed=0)
    chunks = PairChunks(corpus, window=3, negatives=2, subsample=1e-3, chunk_tokens=150, seed=0)
    with chunks.stream(1 << 30) as stream:
        with pytest.raises(ss.OptionError, match=r"a pass over the corpus \(400 tokens\) gave no skip-gram pairs"):
            next(distributed._shares(stream, 64, 0, 2, len(corpus.tokens)))


def test_sharded_word2vec_refuses_a_corpus_without_pairs_before_it_joins_the_group_or_builds_a_table(
        monkeypatch, tmp_path):
    """One-word documents: the sharded run joined the process group and built its tables (an mmap run's
    files) before a pass of the pair stream told it there were no pairs; the one-process run refuses
    such a corpus first. Now the sharded run does too, with the one-process run's message."""
    distributed = load_example("_distributed")
    corpus = synthetic_corpus(50, 2, 400, doc_len=1, seed=0)
    with pytest.raises(ss.OptionError) as one_process:
        word2vec.train(corpus, dim=4, steps=3, batch_size=8, backend="numpy", progress=False)
    joined = []
    monkeypatch.setattr(distributed, "init", lambda device: joined.append(device) or (0, 1))

    def build(*args, **kwargs):
        raise AssertionError("a table was built for a corpus without pairs")
    monkeypatch.setattr(ss, "ShardedOffloadedEmbedding", build)
    args = argparse.Namespace(window=3, negatives=2, subsample=0.0, seed=0, steps=3, batch_size=8, dim=4,
                              table_dir=str(tmp_path), storage="mmap", optimizer="sgd", lr=None)
    with pytest.raises(ss.OptionError) as sharded:
        distributed.word2vec_sharded(args, corpus, "numpy")
    assert str(sharded.value) == str(one_process.value)
    assert "two or more words" in str(sharded.value)
    assert joined == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_word2vec_starts_from_the_one_process_table_at_any_world_size(monkeypatch, seed, world):
    """Each rank drew its centre rows from a generator seeded with ``--seed`` and its rank: the same
    seed started each world size from another table. Now every rank's rows are the one-process run's
    (chunks smaller than a rank's rows, and cut inside them)."""
    distributed = load_example("_distributed")
    monkeypatch.setattr(distributed, "CHUNK_VALUES", 70)  # 7 rows of 10 a chunk
    num_rows, dim = 100, 10
    one_process = ss.HostTable.empty(num_rows, dim, storage="pageable", backend="numpy")
    one_process.uniform_(-0.5 / dim, 0.5 / dim, generator=torch.Generator().manual_seed(seed))  # apps.word2vec's
    bounds = row_bounds(num_rows, world)
    shards = []
    for rank in range(world):
        shard = ss.HostTable.empty(bounds[rank + 1] - bounds[rank], dim, storage="pageable", backend="numpy")
        distributed.centre_rows(shard, range(bounds[rank], bounds[rank + 1]), seed)
        shards.append(shard.to_numpy())
    np.testing.assert_array_equal(np.concatenate(shards), one_process.to_numpy())


def test_a_world_size_smaller_than_the_group_says_the_rank_came_from_torch_distributed(monkeypatch):
    """world_size=1 on rank 1 of a group (every process reads every row): the rank was never given."""
    as_rank(monkeypatch, 1, 2)
    with pytest.raises(ss.OptionError) as raised:
        ss.BatchFeeder(np.arange(10), batch_size=2, device="cpu", world_size=1)
    message = str(raised.value)
    assert "torch.distributed" in message and "rank=0, world_size=1" in message, message
    assert message.startswith("rank 1 is outside the world: ranks are 0 .. 0 in a world of 1: it is this"), message
    # Passing the rank too is what the message asks for, and it works.
    feeder = ss.BatchFeeder(np.arange(10), batch_size=2, device="cpu", rank=0, world_size=1)
    assert len(feeder) == 5


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_rows_per_rank_is_the_rows_an_epoch_delivers(world_size, drop_last):
    """As documented: the rows this rank reads per epoch, padding included, a dropped last batch not."""
    for rank in range(world_size):
        feeder = ss.BatchFeeder(np.arange(23), batch_size=3, drop_last=drop_last, device="cpu",
                                rank=rank, world_size=world_size)
        assert feeder.rows_per_rank == sum(len(ids) for ids, in feeder)


@pytest.mark.parametrize("rank, world_size", [(3, 2), (2, 2), (-1, 2), (0, 0), (True, 2), (0.0, 2)])
@pytest.mark.parametrize("contiguous", [False, True])
def test_shard_refuses_a_rank_outside_the_world(rank, world_size, contiguous):
    """orders.shard is public: rank 3 of 2 used to get rows 3, 5, 7, 9 (another rank's), world 0 a ZeroDivisionError."""
    from speedswap.data.orders import shard
    with pytest.raises(ss.OptionError, match="rank|world_size"):
        shard(np.arange(10), rank=rank, world_size=world_size, drop_last=False, contiguous=contiguous)


@pytest.mark.parametrize("batch_size, world", [(1025, 2), (1, 2), (10, 4), (2, 3)])
def test_a_batch_size_the_ranks_cannot_split_evenly_is_refused(batch_size, world):
    """Rounding it down per rank trained fewer rows a step than the one-process run (1025 -> 1024, 1 -> 2)."""
    distributed = load_example("_distributed")
    with pytest.raises(ss.OptionError, match=rf"--batch-size {batch_size} does not split evenly over {world} ranks"):
        distributed.batch_per_rank(batch_size, world)


@pytest.mark.parametrize("batch_size, world", [(1024, 2), (3, 3), (4096, 8), (7, 1)])
def test_a_batch_size_the_ranks_split_evenly_gives_each_its_share(batch_size, world):
    assert load_example("_distributed").batch_per_rank(batch_size, world) * world == batch_size
