"""The word2vec pieces the demo and examples/word2vec.py share: corpus, pairs, negatives, scoring."""

import collections
import dataclasses
import errno
import functools
import io
import math
import os
import re
import stat
import threading
import tracemalloc
import warnings

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.apps import corpus as corpus_module, evaluate, w2v_format, word2vec
from speedswap.apps.demo import memory_summary
from speedswap.apps.corpus import keep_probabilities, read_text_corpus, skipgram_pairs, synthetic_corpus
from speedswap.apps.pairs import _ID_TENSORS, PairBatch, PairChunks, _groups
from speedswap.apps.skipgram import SkipGram, manual_step
from speedswap.apps.w2v_format import load_word2vec_format, save_word2vec_format
from test_skipgram_step import _assert_trained_as


def test_synthetic_corpus_plants_topics_with_zipf_frequencies(seed):
    corpus = synthetic_corpus(vocab=400, topics=8, tokens=40_000, background=0.0, seed=seed)
    assert corpus.tokens.shape == (40_000,) and corpus.counts.sum() == 40_000
    docs = corpus.tokens.reshape(-1, 50)
    # With no background every document stays inside one topic.
    assert (corpus.topics[docs] == corpus.topics[docs[:, :1]]).all()
    # Lower ids are more frequent (Zipf), on average.
    assert corpus.counts[:20].mean() > 5 * corpus.counts[200:220].mean()



@pytest.mark.parametrize("tokens, doc_len", [(1_020, 50), (10, 50), (99, 50), (1_000, 50), (7, 3)])
def test_a_synthetic_corpus_has_the_length_asked_its_last_document_shorter(tokens, doc_len, seed):
    """tokens=1,020 gave 1,000 tokens and tokens=10 gave 50: whole documents of doc_len only."""
    corpus = synthetic_corpus(vocab=40, topics=4, tokens=tokens, doc_len=doc_len, background=0.0, seed=seed)
    assert corpus.tokens.shape == (tokens,) and corpus.counts.sum() == tokens
    np.testing.assert_array_equal(corpus.doc_starts, np.arange(0, tokens, doc_len))
    for doc in np.split(corpus.tokens, corpus.doc_starts[1:]):  # each document inside one topic
        assert (corpus.topics[doc] == corpus.topics[doc[0]]).all()
    whole = synthetic_corpus(vocab=40, topics=4, tokens=-(-tokens // doc_len) * doc_len, doc_len=doc_len,
                             background=0.0, seed=seed)
    np.testing.assert_array_equal(corpus.tokens, whole.tokens[:tokens])  # the same draws, cut

def test_a_synthetic_corpus_whose_topics_outnumber_some_words_fills_every_document(seed):
    """60 words over 50 topics leaves some topics without words: their documents went unfilled
    (np.empty garbage as word ids); now documents go to topics that have words."""
    corpus = synthetic_corpus(vocab=60, topics=50, tokens=20_000, background=0.0, seed=seed)
    assert len(np.setdiff1d(np.arange(50), corpus.topics))  # the case: some topic has no word
    assert corpus.tokens.min() >= 0 and corpus.tokens.max() < 60 and corpus.counts.sum() == 20_000
    docs = corpus.tokens.reshape(-1, 50)
    assert (corpus.topics[docs] == corpus.topics[docs[:, :1]]).all()
    with pytest.raises(ss.OptionError, match="at most vocab topics"):
        synthetic_corpus(vocab=10, topics=11, tokens=1000)


def test_pairs_stay_inside_documents_and_windows(rng):
    doc_ids = np.repeat(np.arange(10), 100)
    positions = np.arange(1000)
    # Positions as the "words", so each pair says where it came from.
    centres, contexts = skipgram_pairs(positions, doc_ids, np.ones(1000), window=3, rng=rng)
    assert len(centres) > 1000
    assert (doc_ids[centres] == doc_ids[contexts]).all()
    distance = np.abs(centres - contexts)
    assert distance.min() >= 1 and distance.max() <= 3
    # Both directions, and every reach up to the window.
    assert (centres < contexts).any() and (centres > contexts).any()
    assert set(distance.tolist()) == {1, 2, 3}


def test_subsampling_keeps_rare_words_and_thins_frequent_ones():
    counts = np.array([1_000_000, 1_000, 10, 0])
    keep = keep_probabilities(counts, threshold=1e-3)
    assert keep[0] < 0.1 and keep[2] == 1.0 and keep[3] == 1.0



def test_subsampling_is_word2vecs_formula():
    """word2vec.c keeps an occurrence with probability (sqrt(cn / (sample * train_words)) + 1) *
    (sample * train_words) / cn, capped at 1 (gensim: the same with its threshold_count)."""
    counts = np.array([1_000_000, 54_321, 1_000, 77, 10, 1])
    sample, train_words = 1e-4, counts.sum()
    expected = [min(1.0, (math.sqrt(cn / (sample * train_words)) + 1) * (sample * train_words) / cn)
                for cn in counts.tolist()]
    np.testing.assert_allclose(keep_probabilities(counts, threshold=sample), expected, rtol=1e-12)
    assert (keep_probabilities(counts, threshold=0.0) == 1.0).all()  # 0: keep every word


def test_subsampling_and_the_dynamic_window_draw_their_distributions(rng):
    """Each token is kept with its probability, and each kept centre's reach is uniform in
    1..window, so a centre has a context d kept tokens away with probability (window - d + 1) / window.

    Positions are the words, so the pairs say which tokens were kept (a kept token always pairs with
    the next kept one) and how far apart they were. Each count is a sum of independent Bernoulli
    draws; Hoeffding's bound P(|k/n - p| >= t) <= 2 exp(-2 n t**2) at t = sqrt(log(2e10) / (2 n))
    makes each of the 2 + 2 * window checks fail with probability below 1e-10, all of them below 1e-9.
    """
    n, window = 200_000, 4
    keep = np.where(np.arange(n) % 2 == 0, 0.3, 0.8)  # two keep rates, interleaved
    centres, contexts = skipgram_pairs(np.arange(n), np.zeros(n, np.int64), keep, window, rng)

    def bound(trials):
        return math.sqrt(math.log(2e10) / (2 * trials))

    kept = np.unique(np.concatenate([centres, contexts]))
    for parity, p in ((0, 0.3), (1, 0.8)):
        share = np.isin(np.arange(parity, n, 2), kept).mean()
        assert abs(share - p) < bound(n // 2), (parity, share, p)
    rank = np.full(n, -1)
    rank[kept] = np.arange(len(kept))
    offset = rank[contexts] - rank[centres]
    assert (np.abs(offset) >= 1).all() and (np.abs(offset) <= window).all()
    for d in range(1, window + 1):
        trials = len(kept) - d  # centres with a kept token d further on (or d back)
        for direction in (1, -1):
            share = (offset == direction * d).sum() / trials
            assert abs(share - (window - d + 1) / window) < bound(trials), (direction * d, share)

def philox_uniform(seed, stream, count):
    """The uniform numbers a sampler seeded with ``seed`` draws on ``stream``: numpy's Philox, keyed by the
    seed's ``SeedSequence`` spawned to ``stream``, its float64s from the first."""
    key = np.random.SeedSequence(seed, spawn_key=stream).generate_state(2, np.uint64)
    return np.random.Generator(np.random.Philox(key=key)).random(count)


@pytest.mark.parametrize("vocab", [3, 20_000, 300_000])
@pytest.mark.parametrize("slice_", [1 << 20, 4099])  # one slice; many, the last one short
def test_negative_sampler_draws_what_a_binary_search_of_the_cdf_draws(vocab, slice_, rng, monkeypatch):
    monkeypatch.setattr(word2vec.NegativeSampler, "SLICE", slice_)
    counts = np.concatenate([[0], (1e7 / np.arange(1, vocab) ** rng.uniform(0.5, 1.5)).astype(np.int64)])
    draw_seed = int(rng.integers(2**31))  # the sampler's and the reference's, the same
    sampler = word2vec.NegativeSampler(counts, torch.device("cpu"), seed=draw_seed)
    uniform = torch.from_numpy(philox_uniform(draw_seed, (3, 1), 250_000).reshape(50_000, 5))
    cdf = np.cumsum(counts ** 0.75)
    cdf = torch.from_numpy(cdf / cdf[-1])
    assert torch.equal(sampler((50_000, 5), stream=(3, 1)), torch.searchsorted(cdf, uniform, right=True))


@pytest.mark.parametrize("lookup", ["guide table", "binary search"])
def test_negative_sampler_never_draws_a_word_of_count_zero_at_the_cdfs_edges(lookup, rng, monkeypatch):
    """The first word whose CDF *reached* u was drawn: for u == 0.0 a leading word of count 0 (Philox
    gives 0.0 once in 2**53 draws), and a word of count 0 whose CDF equals u. Now the first whose CDF
    exceeds u, tried at every edge: u = 0, u = each word's CDF exactly, the largest float below 1."""
    if lookup == "binary search":
        monkeypatch.setattr(word2vec.NegativeSampler, "_MAX_STEPS", -1)  # no guide table is fine enough
    counts = rng.integers(1, 1000, size=300)
    counts[[0, 1, 57, 58, 59, 200, 297, 298, 299]] = 0  # leading, inner runs and trailing zeros
    sampler = word2vec.NegativeSampler(counts, torch.device("cpu"))
    assert (sampler._guide is None) == (lookup == "binary search")
    cdf = np.cumsum(counts.astype(np.float64) ** 0.75)
    cdf /= cdf[-1]
    edges = np.concatenate([[0.0, np.nextafter(1.0, 0.0)], cdf[cdf < 1], np.nextafter(cdf[cdf < 1], 1.0)])
    drawn = sampler._draw(torch.from_numpy(edges)).numpy()
    assert (counts[drawn] > 0).all(), edges[counts[drawn] == 0]
    # Each is the word whose CDF interval [previous CDF, its CDF) holds u.
    np.testing.assert_array_equal(drawn, np.searchsorted(cdf, edges, side="right"))


def test_negative_sampler_follows_unigram_to_the_three_quarters():
    counts = np.array([8000, 0, 1000, 125])
    sampler = word2vec.NegativeSampler(counts, torch.device("cpu"), seed=0)
    draws = np.bincount(sampler((200_000,)).numpy(), minlength=4) / 200_000
    expected = counts ** 0.75 / (counts ** 0.75).sum()
    assert draws[1] == 0  # a word that never occurs is never a negative
    np.testing.assert_allclose(draws, expected, atol=0.01)


def test_negatives_drawn_by_position_have_the_distribution_torchs_generator_drew():
    """Negatives came from torch's generator, one stream an epoch; now from Philox streams addressed by
    position (so that a rank can draw its own pairs' negatives only). The distribution must not change.

    Pearson's chi-square of 4,000,000 draws of a 50,000-word Zipf vocabulary (words with zero count
    left out, rare ones pooled so that each bin expects at least 20 draws) against the unigram^0.75
    probabilities: a sampler that draws them exceeds the threshold, the 1 - 1e-6 quantile of the
    chi-square distribution (Wilson and Hilferty's approximation, within a fraction of a percent at
    these degrees of freedom), with probability about 1e-6. torch's generator and the inverse CDF,
    the old sampler, pass it too; the same draws fail it against unigram^0.7: the check can fail."""
    rng = np.random.default_rng(0)
    vocab, draws = 50_000, 4_000_000
    counts = (1e7 / np.arange(1, vocab + 1) ** 1.1).astype(np.int64)
    counts[rng.choice(vocab, 50, replace=False)] = 0  # words that never occur: never drawn
    cdf = torch.from_numpy(np.cumsum(counts ** 0.75) / (counts ** 0.75).sum())
    old = torch.searchsorted(cdf, torch.rand(draws, dtype=torch.float64,
                                            generator=torch.Generator().manual_seed(0))).clamp_(max=vocab - 1)
    new = word2vec.NegativeSampler(counts, torch.device("cpu"), seed=0)((draws,), stream=(0, 0))

    def chi_square(drawn, power):
        """Pearson's statistic of ``drawn`` against unigram^power, and its 1 - 1e-6 quantile."""
        expected = counts ** power / (counts ** power).sum() * draws
        observed = np.bincount(drawn.numpy(), minlength=vocab)
        assert observed[counts == 0].sum() == 0
        order = np.argsort(-expected[counts > 0])
        expected, observed = expected[counts > 0][order], observed[counts > 0][order]
        common = expected >= 20  # the rest pooled (about 11,000 words here)
        assert common.sum() > 10_000 and not common.all()
        bins_e = np.append(expected[common], expected[~common].sum())
        bins_o = np.append(observed[common], observed[~common].sum())
        df, z = len(bins_e) - 1, 4.753  # z: the standard normal's 1 - 1e-6 quantile
        return ((bins_o - bins_e) ** 2 / bins_e).sum(), df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3

    statistic, threshold = chi_square(new, 0.75)
    assert statistic < threshold, (statistic, threshold)
    statistic, threshold = chi_square(old, 0.75)
    assert statistic < threshold, (statistic, threshold)
    statistic, threshold = chi_square(new, 0.7)
    assert statistic > threshold, (statistic, threshold)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_ranks_share_of_a_step_draws_the_negatives_one_process_draws_for_those_pairs(world, seed, monkeypatch):
    """Every rank drew all of a chunk's negatives, the one-process run's, and kept its share's: 2 ranks
    trained at 0.39x the pairs/s of ranks that drew their own (NOTES 78). Now a share's negatives
    are drawn by position in the chunk's stream: the same as one process's draw of the whole chunk,
    at the cost of the share's draws only. Steps of 1,001 pairs (not a multiple of 2 or 3), slices
    of 4,099 draws and 5 negatives a pair: shares start and slices end inside Philox's 4-word blocks."""
    monkeypatch.setattr(word2vec.NegativeSampler, "SLICE", 4_099)
    corpus = synthetic_corpus(vocab=3_000, topics=8, tokens=9_000, seed=seed)
    chunks = PairChunks(corpus, window=5, negatives=5, subsample=1e-3, chunk_tokens=4_000, seed=seed)
    every = [chunk for epoch in (0, 1) for chunk in chunks.epoch(epoch)]
    # Each chunk of each epoch draws from a stream of its own: no two draw the same negatives.
    heads = {tuple(chunk.pairs(0, 200)[2].view(-1).tolist()) for chunk in every}
    assert len(every) == 6 and len(heads) == 6
    chunk = every[4]  # epoch 1's second chunk
    pairs, step = len(chunk.centres), 1_001
    assert pairs > 5 * step and pairs % step
    whole = chunk.sampler((pairs, 5), stream=(1, 1))  # one process's draw of the whole chunk, in one call
    assert len(whole.unique()) > 500
    drawn = []
    draw = word2vec.NegativeSampler._draw
    monkeypatch.setattr(word2vec.NegativeSampler, "_draw", lambda self, u: drawn.append(len(u)) or draw(self, u))
    for rank in range(world):
        drawn.clear()
        share = 0
        for start in range(0, pairs, step):
            n = min(step, pairs - start)
            first, stop = start + n * rank // world, start + n * (rank + 1) // world
            centres, contexts, negatives = chunk.pairs(first, stop)
            assert torch.equal(centres, chunk.centres[first:stop]) and torch.equal(contexts, chunk.contexts[first:stop])
            assert torch.equal(negatives, whole[first:stop]), (rank, start)
            share += stop - first
        assert sum(drawn) == 5 * share and abs(share - pairs / world) <= pairs // step + 1


def test_read_text_corpus_ranks_words_and_keeps_lines_apart(tmp_path):
    (tmp_path / "text").write_text("b a a\n\nc a b rare\n")
    corpus = read_text_corpus(tmp_path / "text", vocab=3)
    assert corpus.words == ["a", "b", "c"]
    assert corpus.tokens.tolist() == [1, 0, 0, 2, 0, 1]  # "rare" is outside the vocabulary
    assert corpus.doc_starts.tolist() == [0, 3]
    assert corpus.counts.tolist() == [3, 2, 1]
    # word2vec's vocabulary: every word seen min_count times, however many.
    frequent = read_text_corpus(tmp_path / "text", min_count=2)
    assert frequent.words == ["a", "b"] and frequent.tokens.tolist() == [1, 0, 0, 0, 1]
    with pytest.raises(ss.FileFormatError, match="occurs 9 times.*most frequent occurs 3"):
        read_text_corpus(tmp_path / "text", min_count=9)


def _read_as_string_lists(path, vocab=None, min_count=1):
    """The corpus reader as it was, every line a list of strings (1.8 GB for text8): the reference."""
    # utf-8-sig: a byte-order mark opening the file is no text, as read_text_corpus reads it.
    with open(path, encoding="utf-8-sig") as f:
        lines = [line.split() for line in f]
    counter = collections.Counter(word for line in lines for word in line)
    ranked = sorted((item for item in counter.items() if item[1] >= min_count),
                    key=lambda item: (-item[1], item[0]))[:vocab]
    index = {word: i for i, (word, _) in enumerate(ranked)}
    ids, starts = [], []
    for line in lines:
        line_ids = [index[w] for w in line if w in index]
        if line_ids:
            starts.append(len(ids))
            ids.extend(line_ids)
    return ids, starts, [c for _, c in ranked], [w for w, _ in ranked]


@pytest.mark.parametrize("read_chars", [3, 16, 1 << 21])
def test_read_text_corpus_streams_the_corpus_the_string_lists_read(read_chars, rng, tmp_path, monkeypatch):
    """Read a piece at a time (words cut nowhere, lines across pieces), the corpus is the one the
    whole-file reader built: same ids, documents, counts and words."""
    monkeypatch.setattr(corpus_module, "_READ_CHARS", read_chars)
    names = ["the", "of", "café", "naïve", "日本", "x", "a" * 40, "\ufeffbom", "b", "zz"] + [f"w{i}" for i in range(200)]
    spaces = [" ", " ", " ", "  ", "\t", "\x0c", "\xa0", "\u2028", "\u3000", "\x1f", "\x85"]
    ends = ["\n", "\n", "\r\n", "\r", "\n\n", "\n \t\n"]
    lines = []
    for _ in range(60):
        words = [names[(z - 1) % len(names)] for z in rng.zipf(1.4, rng.integers(0, 40))]
        lines.append("".join(w + spaces[rng.integers(len(spaces))] for w in words).rstrip(" ") +
                     ends[rng.integers(len(ends))])
    for trailing in ("", "\n"):
        with open(tmp_path / "text", "w", encoding="utf-8", newline="") as f:
            f.write("".join(lines).rstrip() + trailing)
        for vocab, min_count in ((None, 1), (7, 1), (None, 3)):
            ids, starts, counts, words = _read_as_string_lists(tmp_path / "text", vocab, min_count)
            corpus = read_text_corpus(tmp_path / "text", vocab, min_count=min_count)
            assert len(ids) > 100 and len(starts) > 10
            assert corpus.tokens.dtype == np.int32 and corpus.tokens.tolist() == ids
            assert corpus.doc_starts.dtype == np.int64 and corpus.doc_starts.tolist() == starts
            assert corpus.counts.dtype == np.int64 and corpus.counts.tolist() == counts
            assert corpus.words == words


def test_read_text_corpus_holds_a_piece_of_the_text_as_strings_not_all_of_it(rng, tmp_path, monkeypatch):
    """Every token held as a Python string (in a list per line) took 1.8 GB for text8's 17 million
    words, some 100 bytes a word; read a piece at a time, what stays is the int32 ids."""
    monkeypatch.setattr(corpus_module, "_READ_CHARS", 1 << 16)
    ids = (rng.zipf(1.2, 300_000) - 1) % 5_000
    ids[rng.choice(len(ids), 300, replace=False)] = -1  # 300 line breaks (drawn with replacement, fewer)
    with open(tmp_path / "text", "w") as f:
        f.write(" ".join(f"w{i}" if i >= 0 else "\n" for i in ids.tolist()))
    tracemalloc.start()
    try:
        corpus = read_text_corpus(tmp_path / "text")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(corpus.tokens) == 300_000 - 300
    assert peak < 30 * len(corpus.tokens), f"{peak / len(corpus.tokens):.0f} bytes a word at the peak"


def test_topic_purity_is_chance_for_random_vectors_and_one_for_planted_ones(rng):
    corpus = synthetic_corpus(vocab=600, topics=6, tokens=60_000, seed=1)
    purity, chance = word2vec.topic_purity(rng.standard_normal((600, 16)), corpus)
    # A statistic of the draw: over seeds 0-999 it was off chance (0.169) by 0.0073 (sd), at most
    # 0.026, so 0.05 is some 7 sd off, a seed failing far less than once in 1e9.
    assert abs(purity - chance) < 0.05
    planted = np.eye(6)[corpus.topics] + 0.01 * rng.standard_normal((600, 6))
    assert word2vec.topic_purity(planted, corpus)[0] == 1.0


def test_a_corpus_too_short_to_score_purity_ends_no_report(rng):
    """The examples scored purity after training and raised there for a short corpus (seed 777 of
    100 words x 1,500 tokens, as tests/test_distributed_word2vec.py draws one in ~1,000: ten words
    occur 20+ times), losing the run's report: the report now says it was not scored."""
    short = synthetic_corpus(vocab=100, topics=4, tokens=1500, seed=777)
    vectors = rng.standard_normal((100, 8))
    with pytest.raises(ss.OptionError, match="only 10 words occur 20"):
        word2vec.topic_purity(vectors, short)
    assert word2vec.purity_report(vectors, short) == (
        {}, "not scored: only 10 words occur 20+ times; make the corpus longer to score topic purity")
    corpus = synthetic_corpus(vocab=600, topics=6, tokens=60_000, seed=1)
    vectors = rng.standard_normal((600, 16))
    purity, chance = word2vec.topic_purity(vectors, corpus)
    assert word2vec.purity_report(vectors, corpus) == (
        {"topic_purity": purity, "chance": chance}, f"{purity:.3f}  (chance {chance:.3f})")


def test_training_refuses_a_corpus_without_pairs_and_bad_run_lengths(tmp_path):
    (tmp_path / "text").write_text("a\nb\na\n")  # one-word documents: no window holds two words
    lonely = read_text_corpus(tmp_path / "text")
    with pytest.raises(ss.OptionError, match="no skip-gram pairs") as error:
        word2vec.train(lonely, dim=4, steps=3, batch_size=8, backend="numpy", progress=False)
    assert isinstance(error.value, ValueError)  # speedswap errors subclass the built-in one
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=2000, seed=0)
    with pytest.raises(ss.OptionError, match="not both"):
        word2vec.train(corpus, dim=4, epochs=1, steps=3, backend="numpy", progress=False)
    with pytest.raises(ss.OptionError, match="epochs must be a positive int, got 0"):
        word2vec.train(corpus, dim=4, epochs=0, backend="numpy", progress=False)


def test_training_refuses_an_unknown_optimizer_or_schedule():
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=2000, seed=0)
    with pytest.raises(ss.OptionError, match="'lbfgs'.*adam"):
        word2vec.train(corpus, dim=4, steps=3, batch_size=16, optimizer="lbfgs", backend="numpy", progress=False)
    with pytest.raises(ss.OptionError, match="'cosine'"):
        word2vec.train(corpus, dim=4, steps=3, batch_size=16, schedule="cosine", backend="numpy", progress=False)

@pytest.mark.parametrize("option,error,match", [
    (dict(batch_size=0), ss.OptionError, r"batch_size must be a positive int, got 0 \(pairs per step\)"),
    (dict(batch_size=2.5), ss.OptionError, r"batch_size must be a positive int, got 2.5"),
    (dict(window=0), ss.OptionError, r"window must be a positive int, got 0"),
    (dict(chunk_tokens=0), ss.OptionError, r"chunk_tokens must be a positive int, got 0"),
    (dict(dim=0), ss.OptionError, r"dim must be a positive int, got 0"),
    (dict(negatives=-1), ss.OptionError, r"negatives must be an int >= 0, got -1"),
    (dict(seed=-1), ss.OptionError, r"seed must be an int >= 0, got -1"),
    (dict(seed=1 << 50), ss.OptionError, r"seed must be below 2\*\*32"),
    (dict(steps=np.int64(0)), ss.OptionError, r"steps must be a positive int, got (np.int64\()?0"),
    (dict(lr="x"), ss.DTypeError, r"lr must be a real number, got 'x'"),
    (dict(lr=0.0), ss.OptionError, r"lr must be > 0, got 0.0; None gives sgd's default, 0.025"),
    (dict(lr=float("nan")), ss.OptionError, r"lr must be finite"),
    (dict(subsample=-1e-3), ss.OptionError, r"subsample must be >= 0 \(0: keep every word\), got -0.001"),
    (dict(subsample=float("inf")), ss.OptionError, r"subsample must be finite"),
])
def test_training_checks_every_numeric_option_before_it_starts(option, error, match, monkeypatch):
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=2000, seed=0)

    def started(*args, **kwargs):
        raise AssertionError("the pair thread started before the options were checked")

    monkeypatch.setattr(word2vec, "PairChunks", started)
    options = dict(dim=4, steps=3, batch_size=16, backend="numpy", progress=False)
    with pytest.raises(error, match=match):
        word2vec.train(corpus, **{**options, **option})


def test_an_epoch_reads_every_token_once_and_a_partial_batch_trains():
    corpus = synthetic_corpus(vocab=300, topics=4, tokens=30_000, seed=0)
    result = word2vec.train(corpus, dim=8, epochs=2, batch_size=4096, chunk_tokens=7_000, backend="numpy",
                            progress=False)
    assert result.words == 60_000
    # Each chunk's pairs train in full: its last batch may be smaller than batch_size.
    assert result.pairs > (result.steps - 10) * 4096 - 1 and result.pairs % 4096 != 0


def test_the_losses_end_with_the_last_steps_whatever_sets_the_runs_length():
    corpus = synthetic_corpus(vocab=300, topics=4, tokens=20_000, seed=0)
    options = dict(dim=8, batch_size=256, schedule="constant", backend="numpy", progress=False)
    one_pass = word2vec.train(corpus, epochs=1, **options)
    assert one_pass.steps % 50 not in (0, 1)  # a step whose loss is not read for the progress bar
    # The same batches and rates, counted in steps: the run records its last step's loss.
    counted = word2vec.train(corpus, steps=one_pass.steps, **options)
    assert one_pass.losses == counted.losses and one_pass.losses[-1][0] == one_pass.steps


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_linear_schedule_decays_to_word2vecs_floor_and_constant_stays(optimizer):
    corpus = synthetic_corpus(vocab=300, topics=4, tokens=20_000, seed=0)
    lr = word2vec.DEFAULT_LR[optimizer]
    decayed = word2vec.train(corpus, dim=8, epochs=1, batch_size=256, optimizer=optimizer, backend="numpy",
                             progress=False)
    assert decayed.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 1e-4, rel=1e-6)
    constant = word2vec.train(corpus, dim=8, steps=20, batch_size=256, optimizer=optimizer, lr=0.003,
                              schedule="constant", backend="numpy", progress=False)
    assert constant.optimizer.param_groups[0]["lr"] == 0.003


def test_loss_is_summed_over_pairs_so_lr_is_per_pair(seed):
    torch.manual_seed(seed)
    model = word2vec.SkipGram(torch.nn.Embedding(20, 6), torch.nn.Embedding(20, 6))
    centres, contexts = torch.randint(0, 20, (8,)), torch.randint(0, 20, (8,))
    negatives = torch.randint(0, 20, (8, 3))
    whole = model(centres, contexts, negatives)
    parts = sum(model(centres[i:i + 1], contexts[i:i + 1], negatives[i:i + 1]) for i in range(8))
    torch.testing.assert_close(whole, parts)
    # One pair's loss is word2vec's: -log s(u.v) - sum log s(-u.n), over the negatives that are not
    # the pair's own context word (word2vec.c skips those; with 20 words, 3 draws hit it 14% of the time).
    negatives[0, 0] = contexts[0]  # one such draw, always
    kept = negatives[0][negatives[0] != contexts[0]]
    u, v, n = model.centre.weight[centres[0]], model.context.weight[contexts[0]], model.context.weight[kept]
    expected = -torch.nn.functional.logsigmoid(u @ v) - torch.nn.functional.logsigmoid(-(n @ u)).sum()
    torch.testing.assert_close(model(centres[:1], contexts[:1], negatives[:1]), expected)


def test_cpu_threads_respects_omp_num_threads_and_the_cores_granted(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # One of the budget's threads is the one that makes pairs.
    assert word2vec.cpu_threads() == max(cores - 1, 1)
    assert word2vec.cpu_threads(cores + 7) == max(cores - 1, 1)
    assert word2vec.cpu_threads(1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert word2vec.cpu_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ss.OptionError, match="OMP_NUM_THREADS='many'"):
        word2vec.cpu_threads()
    with pytest.raises(ss.OptionError, match="threads must be a positive int, got 0"):
        word2vec.cpu_threads(0)


def test_pair_stream_equals_the_epochs_and_raises_the_threads_errors():
    corpus = synthetic_corpus(vocab=200, topics=4, tokens=9_000, seed=0)
    chunks = PairChunks(corpus, window=3, negatives=2, subsample=1e-3, chunk_tokens=2_000, seed=5)
    expected = [c for epoch in range(2) for c in chunks.epoch(epoch)]
    streamed = list(chunks.stream(2, ahead=1))
    assert [c.tokens for c in streamed] == [c.tokens for c in expected] == [2000] * 4 + [1000] + [2000] * 4 + [1000]
    for a, b in zip(streamed, expected):
        assert all(map(torch.equal, a.pairs(0, len(a.centres)), b.pairs(0, len(b.centres))))
    assert streamed[0].pairs(0, len(streamed[0].centres))[2].shape == (len(streamed[0].centres), 2)
    early = chunks.stream(100, ahead=1)
    next(early)
    early.close()  # stops the thread: leaving a loop early strands nothing

    def broken(epoch):
        yield from ()
        raise RuntimeError("disk gone")

    chunks.epoch = broken
    with pytest.raises(RuntimeError, match="disk gone"):
        list(chunks.stream(1))


def test_an_epochs_pairs_are_drawn_from_the_seeds_epoch_child_not_its_own_stream(rng):
    """An epoch's subsampling, windows and shuffles were drawn from default_rng([seed, epoch]), which numpy
    pads with zero words: epoch 0 was default_rng(seed)'s stream, the one synthetic_corpus(seed=seed)
    makes its corpus from (the demo passes both the same seed), and seed s + 2**32 read seed s's epoch 1
    at its epoch 0. Now each epoch draws from the seed's SeedSequence child (epoch,): its first chunk is
    made here from that definition, and from neither of the streams it used to share."""
    seed = int(rng.integers(1 << 32))
    corpus = synthetic_corpus(vocab=300, topics=4, tokens=3_000, seed=seed)
    doc_ids = np.searchsorted(corpus.doc_starts, np.arange(2_000), side="right")
    keep = keep_probabilities(corpus.counts, 1e-3)

    def first_chunk(generator):
        centres, contexts = skipgram_pairs(corpus.tokens[:2_000], doc_ids, keep, 3, generator)
        shuffle = generator.permutation(len(centres))
        return centres[shuffle], contexts[shuffle]

    def made(seed, epoch):
        chunks = PairChunks(corpus, window=3, negatives=2, subsample=1e-3, chunk_tokens=2_000, seed=seed)
        chunk = next(chunks.epoch(epoch))
        return chunk.centres.numpy(), chunk.contexts.numpy()

    for epoch in (0, 1):
        expected = first_chunk(np.random.default_rng(np.random.SeedSequence(seed).spawn(epoch + 1)[epoch]))
        got = made(seed, epoch)
        assert len(got[0]) > 1_000 and all(map(np.array_equal, got, expected)), epoch
    assert not all(map(np.array_equal, made(seed, 0), first_chunk(np.random.default_rng(seed))))
    assert not all(map(np.array_equal, made(seed + 2**32, 0), made(seed, 1)))


def test_a_planned_batch_holds_the_same_pairs_sorted_by_centre_and_groups_its_ids(rng, backend):
    device = ss.get_backend(backend).device
    pairs, columns, vocab = 500, 5, 300
    perm = rng.permutation(vocab)  # Zipf heads scattered over the table
    centres, contexts = (torch.from_numpy(perm[(rng.zipf(1.3, pairs) - 1) % vocab]) for _ in range(2))
    negatives = torch.from_numpy(perm[(rng.zipf(1.3, (pairs, columns - 1)) - 1) % vocab])
    planned = PairBatch.plan(centres.to(device), contexts.to(device), negatives.to(device), centre_rows=vocab,
                             context_rows=vocab, words=12.5)
    assert planned.centres.device.type == device.type and planned.context_pairs.device.type == device.type
    names = _ID_TENSORS
    assert set(names) == {field.name for field in dataclasses.fields(PairBatch)} - {"words", "block"}
    batch = dataclasses.replace(planned, **{name: getattr(planned, name).cpu() for name in names})
    assert len(batch) == pairs and batch.words == 12.5 and batch.ids.shape == (pairs, columns)
    as_rows = lambda c, x, n: sorted(zip(c.tolist(), x.tolist(), map(tuple, n.tolist())))
    assert as_rows(batch.centres, batch.contexts, batch.negatives) == as_rows(centres, contexts, negatives)
    assert bool((batch.centres[1:] >= batch.centres[:-1]).all())
    assert batch.centre_rows.tolist() == sorted(set(centres.tolist()))
    runs = torch.bincount(torch.searchsorted(batch.centre_rows, batch.centres))
    assert torch.equal(batch.centre_starts, (runs.cumsum(0) - runs) * columns)
    flat = batch.ids.reshape(-1)
    assert batch.context_rows.tolist() == sorted(set(flat.tolist()))
    assert torch.equal(batch.context_order, torch.sort(flat, stable=True).indices)
    assert torch.equal(batch.context_pairs, batch.context_order // columns)
    occurrences = torch.bincount(torch.searchsorted(batch.context_rows, flat))
    assert torch.equal(batch.context_starts, occurrences.cumsum(0) - occurrences)
    assert torch.equal(batch.context_rows[planned.context_slots().cpu()], batch.ids)
    # Planned on the CPU (numpy's radix sort) and moved, or planned where the ids are: the same batch.
    on_cpu = PairBatch.plan(centres, contexts, negatives, centre_rows=vocab, context_rows=vocab, words=12.5)
    assert on_cpu.to("cpu") is on_cpu
    moved = on_cpu.to(device)
    assert all(torch.equal(getattr(moved, name).cpu(), getattr(batch, name)) for name in names)
    # Packed into one block (page-locked for a GPU), the batch is the same and moves in one copy.
    packed = on_cpu.packed(pin=device.type == "cuda")
    assert packed.block.is_pinned() == (device.type == "cuda") and packed.words == 12.5
    block = packed.block.untyped_storage().data_ptr()
    assert all(getattr(packed, name).untyped_storage().data_ptr() == block for name in names)
    for copy in (packed, packed.to(device)):
        assert all(torch.equal(getattr(copy, name).cpu(), getattr(batch, name)) for name in names)
    assert packed.to(device).block.device.type == device.type
    with pytest.raises(ss.ShapeError, match=r"got shapes \(500,\), \(499,\) and \(500, 4\)"):
        PairBatch.plan(centres, contexts[1:], negatives, centre_rows=vocab, context_rows=vocab)
    with pytest.raises(ss.IdError, match="centre ids contain -1"):
        PairBatch.plan(torch.cat([centres[1:], torch.tensor([-1])]), contexts, negatives, centre_rows=vocab,
                       context_rows=vocab)


def test_planned_batches_are_the_chunks_cut_in_order_and_closing_stops_both_threads():
    corpus = synthetic_corpus(vocab=200, topics=4, tokens=9_000, seed=0)
    chunks = PairChunks(corpus, window=3, negatives=2, subsample=1e-3, chunk_tokens=2_000, seed=5)
    expected = [b for epoch in range(2) for chunk in chunks.epoch(epoch) for b in chunk.batches(300, 200)]
    with chunks.batches(2, batch_size=300, ahead_pairs=600) as stream:
        streamed = list(stream)
    assert len(streamed) == len(expected) > 10
    for a, b in zip(streamed, expected):
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in _ID_TENSORS) and a.words == b.words
    assert sum(b.words for b in streamed) == pytest.approx(2 * 9_000)
    assert {len(b) for b in streamed} >= {300} and max(len(b) for b in streamed) == 300
    # A chunk without a pair (one-word documents) is one empty batch carrying its words.
    empty = synthetic_corpus(vocab=50, topics=2, tokens=400, doc_len=1, seed=0)
    lone = next(PairChunks(empty, window=3, negatives=2, subsample=1e-3, chunk_tokens=400, seed=0).epoch(0))
    assert [(len(b), b.words) for b in lone.batches(64, 50)] == [(0, 400.0)]
    stream = chunks.batches(100, batch_size=64, ahead_pairs=128)
    next(stream)
    stream.close()  # leaving a loop early strands neither thread
    assert not any(t.name.startswith("speedswap-w2v") for t in threading.enumerate())

    def broken(epoch):
        yield from ()
        raise RuntimeError("disk gone")

    chunks.epoch = broken  # an error making pairs reaches the loop through both threads
    with pytest.raises(RuntimeError, match="disk gone"):
        list(chunks.batches(1, batch_size=64))
    assert not any(t.name.startswith("speedswap-w2v") for t in threading.enumerate())


@pytest.mark.gpu
def test_batches_planned_for_a_gpu_arrive_packed_in_page_locked_memory():
    corpus = synthetic_corpus(vocab=200, topics=4, tokens=6_000, seed=0)
    chunks = PairChunks(corpus, window=3, negatives=2, subsample=1e-3, chunk_tokens=2_000, seed=5)
    expected = [b for chunk in chunks.epoch(0) for b in chunk.batches(300, 200)]
    with chunks.batches(1, batch_size=300, pin=True) as stream:
        streamed = [(b.block.is_pinned(), b.to("cuda")) for b in stream]
    assert len(streamed) == len(expected) > 5 and all(pinned for pinned, _ in streamed)
    for (_, a), b in zip(streamed, expected):
        assert all(torch.equal(getattr(a, n).cpu(), getattr(b, n)) for n in _ID_TENSORS) and a.words == b.words


def test_a_run_cut_short_by_its_steps_stops_both_background_threads():
    corpus = synthetic_corpus(vocab=200, topics=4, tokens=20_000, seed=0)
    # Steps mode streams endless epochs; the loop's end must close the stream.
    result = word2vec.train(corpus, dim=8, steps=5, batch_size=64, backend="numpy", progress=False)
    assert result.steps == 5 and result.pairs == 5 * 64
    assert not any(t.name.startswith("speedswap-w2v") for t in threading.enumerate())


@pytest.mark.parametrize("refused", ["speedswap-w2v-pairs", "speedswap-w2v-plans"])
def test_a_pair_stream_whose_thread_cannot_start_says_so_and_leaves_no_thread(monkeypatch, refused):
    """A thread that cannot start (the process's thread limit) is a ThreadStartError, and the
    stream's other thread, already running, is stopped: none is left reading the corpus."""
    corpus = synthetic_corpus(vocab=200, topics=4, tokens=20_000, seed=0)
    chunks = PairChunks(corpus, window=3, negatives=2, subsample=1e-3, chunk_tokens=2_000, seed=5)
    start = threading.Thread.start

    def start_unless_refused(thread):
        if thread.name == refused:
            raise RuntimeError("can't start new thread")
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", start_unless_refused)
    with pytest.raises(ss.ThreadStartError, match=f"{refused}.*thread limit"):
        chunks.batches(1, batch_size=300)
    assert not any(t.name.startswith("speedswap-w2v") for t in threading.enumerate())


def test_topic_purity_needs_planted_topics_and_enough_frequent_words(tmp_path, rng):
    (tmp_path / "text").write_text("a b c a b\n")
    text = read_text_corpus(tmp_path / "text", vocab=3)
    with pytest.raises(ss.OptionError, match="planted topics"):
        word2vec.topic_purity(rng.standard_normal((3, 4)), text)
    short = synthetic_corpus(vocab=100, topics=4, tokens=300, seed=0)
    with pytest.raises(ss.OptionError, match="longer"):
        word2vec.topic_purity(rng.standard_normal((100, 4)), short)



def test_files_that_start_with_a_byte_order_mark_read_as_without_it(tmp_path, rng):
    """Windows editors start UTF-8 files with a byte-order mark: it became part of the corpus's first
    word ("\\ufeffthe", a word of its own), hid the test sets' first "#" comment or ": section" header
    (refused as a malformed pair or question), and was part of a first pair's word."""
    words = ["the", "cat", "sat", "on", "mat"]
    text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(20)) + "\n"
    files = {"corpus": text, "ws": "# Word 1\tWord 2\tHuman (mean)\ncat\tmat\t7.5\n", "ws2": "cat\tmat\t7.5\n",
             "q": ": family\nthe cat sat on\n", "q2": "the cat sat on\n"}
    for name, content in files.items():
        (tmp_path / name).write_text(content, encoding="utf-8")
        (tmp_path / f"{name}.bom").write_text(content, encoding="utf-8-sig")
        assert (tmp_path / f"{name}.bom").read_bytes()[:3] == b"\xef\xbb\xbf"
    plain, marked = (read_text_corpus(tmp_path / name) for name in ("corpus", "corpus.bom"))
    assert marked.words == plain.words and all(w in words for w in marked.words)
    np.testing.assert_array_equal(marked.tokens, plain.tokens)
    np.testing.assert_array_equal(marked.counts, plain.counts)
    for name in ("ws", "ws2"):
        assert evaluate.read_word_pairs(tmp_path / f"{name}.bom") == [("cat", "mat", 7.5)]
    for name in ("q", "q2"):
        assert evaluate.read_analogies(tmp_path / f"{name}.bom") == [("the", "cat", "sat", "on")]

def test_corpus_errors_say_what_is_wrong(tmp_path):
    (tmp_path / "empty").write_text("\n \n")
    with pytest.raises(ss.FileFormatError, match="no words"):
        read_text_corpus(tmp_path / "empty", vocab=10)
    with pytest.raises(ss.OptionError, match="vocab"):
        read_text_corpus(tmp_path / "empty", vocab=0)
    with pytest.raises(ss.OptionError, match="topics must be a positive int, got 0"):
        synthetic_corpus(vocab=10, topics=0, tokens=100)


def test_similarity_and_analogy_files_read_as_gensim_reads_them(tmp_path):
    (tmp_path / "ws.tsv").write_text("# Word 1\tWord 2\tHuman (mean)\nTiger\tcat\t7.35\nking\tqueen\t8.58\n")
    # As written: the scoring compares words upper-cased, as gensim does.
    assert evaluate.read_word_pairs(tmp_path / "ws.tsv") == [("Tiger", "cat", 7.35), ("king", "queen", 8.58)]
    (tmp_path / "q.txt").write_text(": capital-common-countries\nAthens Greece Baghdad Iraq\n: family\nboy girl he she\n")
    assert evaluate.read_analogies(tmp_path / "q.txt") == [("Athens", "Greece", "Baghdad", "Iraq"),
                                                          ("boy", "girl", "he", "she")]
    (tmp_path / "bad.tsv").write_text("tiger cat\n")
    with pytest.raises(ss.FileFormatError, match="bad.tsv:1: expected"):
        evaluate.read_word_pairs(tmp_path / "bad.tsv")
    (tmp_path / "bad.txt").write_text(": s\na b c\n")
    with pytest.raises(ss.FileFormatError, match="bad.txt:2: an analogy is four words"):
        evaluate.read_analogies(tmp_path / "bad.txt")


def test_word_similarity_is_spearmans_rho_over_known_pairs(rng):
    scipy_stats = pytest.importorskip("scipy.stats")
    words = [f"w{i}" for i in range(50)]
    vectors = rng.standard_normal((50, 8))
    pairs = [(f"w{a}", f"w{b}", float(rng.integers(0, 5))) for a, b in rng.integers(0, 50, (80, 2)) if a != b]
    score = evaluate.word_similarity(vectors, words, pairs + [("w1", "unknown", 3.0)])
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = [unit[int(a[1:])] @ unit[int(b[1:])] for a, b, _ in pairs]
    expected = scipy_stats.spearmanr(cosine, [s for *_, s in pairs]).statistic  # ties in the human scores
    assert score.value == pytest.approx(expected, abs=1e-6)
    assert (score.used, score.total) == (len(pairs), len(pairs) + 1)



def test_similarity_scores_given_as_text_are_ranked_as_numbers(rng):
    """Scores from a csv reader are strings: they were ranked as strings, "10" below "9"; a score
    that is not a number was ranked among them too, and NaN as a tie of its own."""
    words = [f"w{i}" for i in range(12)]
    vectors = rng.standard_normal((12, 4))
    pairs = [(f"w{a}", f"w{b}", float(rng.integers(0, 12))) for a, b in rng.integers(0, 12, (30, 2)) if a != b]
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = np.array([unit[int(a[1:])] @ unit[int(b[1:])] for a, b, _ in pairs])
    human = np.array([s for *_, s in pairs])
    ranks = [np.array([(x < v).sum() + ((x == v).sum() - 1) / 2 for v in x]) for x in (cosine, human)]
    expected = np.corrcoef(*ranks)[0, 1]  # Spearman: Pearson of the average ranks
    text = [(a, b, f"{s:g}") for a, b, s in pairs]
    assert evaluate.word_similarity(vectors, words, text).value == pytest.approx(expected, abs=1e-6)
    assert evaluate.word_similarity(vectors, words, pairs).value == pytest.approx(expected, abs=1e-6)
    for score in ("high", None, float("nan")):  # ranked among the others, or a raw error: now a clear one
        with pytest.raises(ss.DTypeError, match=f"a pair's score is a finite number.*got {score!r}"):
            evaluate.word_similarity(vectors, words, text + [("w1", "w2", score)])

def test_analogies_are_solved_by_3cosadd_excluding_the_question_words():
    # Two directions: "royal" (x) and "female" (y); the answer to man:woman::king:? is queen.
    words = ["man", "woman", "king", "queen", "prince"]
    vectors = np.array([[0, 1, 0.1], [0, 0, 1.1], [1, 1, 0.1], [1, 0, 1], [1, 1, 0.3]])
    questions = [("man", "woman", "king", "queen"), ("man", "king", "woman", "prince"), ("a", "b", "c", "d")]
    score = evaluate.analogy_accuracy(vectors, words, questions)
    assert (score.value, score.used, score.total) == (0.5, 2, 3)


def _gensim_analogy_accuracy(vectors, words, questions):
    """gensim's ``evaluate_word_analogies`` with its defaults, written out: words keyed upper-cased (the
    most frequent spelling's row), ``most_similar(positive=[b, c], negative=[a], topn=5)``, and the first
    of those five whose key is none of the question's three is the answer."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = {word.upper(): i for i, word in reversed(list(enumerate(words)))}
    solved = used = 0
    for question in questions:
        a, b, c, expected = (word.upper() for word in question)
        if not all(word in keys for word in (a, b, c, expected)):
            continue
        used += 1
        mean = unit[keys[b]] + unit[keys[c]] - unit[keys[a]]
        ranked = [i for i in np.argsort(-(unit @ mean), kind="stable") if i not in (keys[a], keys[b], keys[c])]
        predicted = None
        for i in ranked[:5]:
            predicted = words[i].upper()
            if predicted not in (a, b, c):
                break
        solved += predicted == expected
    return solved / used, used


def test_analogies_count_a_words_other_spellings_as_gensim_does(rng):
    words = ["man", "woman", "king", "queen", "france", "paris", "germany", "berlin"]
    words += [f"w{i}" for i in range(40)] + ["Queen", "Paris", "KING", "Straße"]
    vectors = rng.standard_normal((len(words), 8))
    # Unit rows, so b - a + c below is the very direction both scorers rank by (they add unit vectors).
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    row = {word: i for i, word in enumerate(words)}
    # "Queen" is the answer's other spelling, nearest b - a + c: gensim counts the question solved.
    vectors[row["Queen"]] = vectors[row["king"]] - vectors[row["man"]] + vectors[row["woman"]]
    vectors[row["queen"]] = vectors[row["Queen"]] + 0.3 * rng.standard_normal(8)
    # "Paris" is a question word's other spelling, nearest b - a + c: gensim passes over it to "berlin".
    vectors[row["Paris"]] = vectors[row["paris"]] - vectors[row["france"]] + vectors[row["germany"]]
    vectors[row["berlin"]] = vectors[row["Paris"]] + 0.01 * rng.standard_normal(8)
    vectors[row["KING"]] = vectors[row["king"]] + 0.01 * rng.standard_normal(8)
    questions = [("man", "king", "woman", "queen"), ("france", "paris", "germany", "berlin")]
    # gensim compares words upper-cased, so "strasse" is "Straße" (lower-cased, they differ).
    questions += [tuple(rng.choice(words[:48], 4)) for _ in range(200)] + [("man", "woman", "strasse", "w1")]
    score = evaluate.analogy_accuracy(vectors, words, questions, batch=7)
    assert (score.value, score.used) == pytest.approx(_gensim_analogy_accuracy(vectors, words, questions))
    assert evaluate.analogy_accuracy(vectors, words, questions[:2]).value == 1.0



def test_test_set_words_whose_lower_case_does_not_upper_case_back_are_scored_as_gensim_scores_them(tmp_path, rng):
    """Turkish "İ" lower-cases to "i" and a combining dot, which upper-case to "I" and the dot: the
    readers lower-cased, so "İstanbul" and "İzmir" of the files were out of the vocabulary that
    holds them, where gensim (which upper-cases the words as written) scores them."""
    words = ["İstanbul", "Türkiye", "Paris", "Fransa", "İzmir", "Lyon"] + [f"w{i}" for i in range(30)]
    vectors = rng.standard_normal((len(words), 8))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    row = {word: i for i, word in enumerate(words)}
    vectors[row["Fransa"]] = vectors[row["Türkiye"]] - vectors[row["İstanbul"]] + vectors[row["Paris"]]
    (tmp_path / "q.txt").write_text(": capitals\nİstanbul Türkiye Paris Fransa\nİzmir İstanbul Lyon Paris\n"
                                    ": others\nw1 w2 w3 w4\n", encoding="utf-8")
    questions = evaluate.read_analogies(tmp_path / "q.txt")
    score = evaluate.analogy_accuracy(vectors, words, questions)
    assert (score.value, score.used) == pytest.approx(_gensim_analogy_accuracy(vectors, words, questions))
    assert score.used == 3
    assert evaluate.analogy_accuracy(vectors, words, questions[:1]).value == 1.0  # the planted answer
    (tmp_path / "ws.tsv").write_text("İstanbul\tİzmir\t8\nParis\tLyon\t7\nw1\tw2\t1\n", encoding="utf-8")
    assert evaluate.word_similarity(vectors, words, evaluate.read_word_pairs(tmp_path / "ws.tsv")).used == 3

def test_read_only_vectors_are_scored_as_writable_ones_without_a_warning(rng):
    """A GPU table's to_numpy() and a file opened read-only give read-only float32 arrays, which
    torch.from_numpy warned of (it cannot refuse writes) though the scoring writes none."""
    words = [f"w{i}" for i in range(60)]
    vectors = rng.standard_normal((60, 8)).astype(np.float32)
    questions = [tuple(rng.choice(words, 4)) for _ in range(100)]
    frozen = vectors.copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score = evaluate.analogy_accuracy(frozen, words, questions)
    assert (score.value, score.used) == pytest.approx(_gensim_analogy_accuracy(vectors, words, questions))


@pytest.mark.parametrize("question", [("man", "woman", "king"), ("man", "woman", "king", "queen", "prince"),
                                      "man woman king queen"])
def test_analogy_questions_that_are_not_four_words_are_refused_not_scored_as_others(question, rng):
    """Ids of three- or five-word questions were reshaped into rows of four: four three-word
    questions scored as three other questions, four five-word ones as five (used > total), and a
    question given as one string was out of the vocabulary (its letters looked up)."""
    words = ["man", "woman", "king", "queen", "prince"]
    vectors = rng.standard_normal((5, 3))
    with pytest.raises(ss.ShapeError, match=r"four words \(a, b, c, d\).*got " + re.escape(repr(question))):
        evaluate.analogy_accuracy(vectors, words, [question] * 4)
    with pytest.raises(ss.ShapeError, match=r"\(word1, word2, score\), got \('man', 'woman'\)"):
        evaluate.word_similarity(vectors, words, [("man", "king", 1.0), ("man", "woman")])

@pytest.mark.parametrize("rows", [3, 6])
def test_evaluation_refuses_vectors_without_one_row_per_word(rows, rng):
    words = ["man", "woman", "king", "queen", "prince"]
    vectors = rng.standard_normal((rows, 3))
    with pytest.raises(ss.ShapeError, match=rf"one row per word \(5 words\), got shape \({rows}, 3\)"):
        evaluate.word_similarity(vectors, words, [("man", "woman", 1.0), ("king", "queen", 2.0)])
    with pytest.raises(ss.ShapeError, match=rf"one row per word \(5 words\), got shape \({rows}, 3\)"):
        evaluate.analogy_accuracy(vectors, words, [("man", "woman", "king", "queen")])
    with pytest.raises(ss.ShapeError, match=r"got shape \(5,\)"):
        evaluate.word_similarity(rng.standard_normal(5), words, [("man", "woman", 1.0)])


def test_a_test_set_file_that_is_not_utf8_is_refused_naming_its_line(tmp_path):
    (tmp_path / "ws.tsv").write_bytes(b"# Word 1\tWord 2\tHuman\ntiger\tcat\t7.35\ncaf\xe9\tcoffee\t8\n")
    with pytest.raises(ss.FileFormatError, match=r"ws.tsv:3: not UTF-8 .*iconv"):
        evaluate.read_word_pairs(tmp_path / "ws.tsv")
    (tmp_path / "q.txt").write_bytes(b": s\nboy girl he she\n\xe9t\xe9 a b c\n")
    with pytest.raises(ss.FileFormatError, match=r"q.txt:3: not UTF-8"):
        evaluate.read_analogies(tmp_path / "q.txt")


@pytest.mark.parametrize("binary", [False, True])
def test_word2vec_format_round_trips_and_gensim_reads_it(tmp_path, rng, binary):
    words = ["the", "caf\u00e9", "x"]
    vectors = rng.standard_normal((3, 5)).astype(np.float32)
    path = tmp_path / "vectors.bin"
    save_word2vec_format(path, words, vectors, binary=binary)
    read_words, read_vectors = load_word2vec_format(path, binary=binary)
    assert read_words == words and np.array_equal(read_vectors, vectors)  # exact, text included
    with pytest.raises(ss.OptionError, match="'two words'"):
        save_word2vec_format(path, ["two words"], vectors[:1])
    assert load_word2vec_format(path, binary=binary)[0] == words  # a failed save leaves the old file
    keyed = pytest.importorskip("gensim.models").KeyedVectors.load_word2vec_format(str(path), binary=binary)
    assert keyed.index_to_key == words and np.array_equal(keyed.vectors, vectors)

@pytest.mark.parametrize("content,binary,match", [
    (b"2 x\na 1\nb 2\n", False, r"line 1: expected word2vec's header '<vocab> <dim>'"),
    (b"2 2 2\n", False, r"line 1: expected word2vec's header"),
    (b"-1 2\n", False, r"line 1: the header says -1 vectors of 2 values; both must be >= 0"),
    (b"99999999999 99999999\na 1\n", False, r"line 1: the header says 99,999,999,999 vectors .* file is truncated"),
    (b"2 2\na 1 x\nb 3 4\n", False, r"line 2: expected 2 numbers after the word 'a' \(.*b'x'\)"),
    (b"2 2\na 1 2\n\nb 3 4\n", False, r"line 3: expected a word and the 2 values the header says, got an empty line"),
    (b"2 2\na 1 2\n\xff\xfe 3 4\n", False, r"line 3: the word b'\\xff\\xfe' is not UTF-8"),
    (b"1 2\na 1 2\nb 3 4\n", False, r"more than the 1 vectors its header says \(another row starts at line 3\)"),
    (b"1 2\na 1 2\n\n  \nb 3 4\n", False, r"another row starts at line 5\): the header and the body disagree"),
    (b"1 1\na \0\0\x80\x3f\nb \0\0\0\x40\n", True, r"another row starts at byte 11\)"),
    (b"1 1\n\xe9 \0\0\x80\x3f\n", True, r"vector 1 \(byte 4\): the word b'\\xe9' is not UTF-8"),
])
def test_a_malformed_word2vec_file_is_refused_naming_its_line(tmp_path, content, binary, match):
    path = tmp_path / "vectors"
    path.write_bytes(content)
    with pytest.raises(ss.FileFormatError, match=match) as error:
        load_word2vec_format(path, binary=binary)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("binary", [False, True])
def test_trailing_blank_lines_after_the_last_word2vec_row_are_no_extra_rows(tmp_path, binary):
    path = tmp_path / "vectors"
    save_word2vec_format(path, ["a", "b"], np.eye(2), binary=binary)
    with open(path, "ab") as f:
        f.write(b"\n \r\n")
    assert load_word2vec_format(path, binary=binary)[0] == ["a", "b"]


@pytest.mark.parametrize("words,error,match", [
    (["a", 2], ss.DTypeError, r"words must be str, got 2 of type int"),
    (["a", "b\ud800"], ss.OptionError, r"cannot be written in UTF-8.*lone surrogate"),
])
def test_saving_word2vec_format_checks_every_word_before_writing(tmp_path, words, error, match):
    path = tmp_path / "vectors.txt"
    save_word2vec_format(path, ["old", "file"], np.eye(2))
    before = path.read_bytes()
    with pytest.raises(error, match=match):
        save_word2vec_format(path, words, np.ones((2, 2)))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["vectors.txt"]


def test_a_full_disk_while_saving_word2vec_format_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "vectors.txt"
    save_word2vec_format(path, ["old", "file"], np.eye(2))
    before = path.read_bytes()

    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    # The module's own name `open`, so only the save's file fills up.
    monkeypatch.setattr(w2v_format, "open", lambda *args: FullDisk(), raising=False)
    with pytest.raises(ss.PathError, match="vectors.txt.*disk is full.*previous file at that path is intact"):
        save_word2vec_format(path, ["new", "file"], np.ones((2, 2)))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["vectors.txt"]


def test_a_saved_word2vec_file_has_the_mode_a_plain_open_gives_it(tmp_path):
    umask = os.umask(0o022)  # the usual umask, restored below
    try:
        path = tmp_path / "vectors.txt"
        save_word2vec_format(path, ["a"], np.ones((1, 2)))
        (tmp_path / "plain").write_bytes(b"")
        assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == 0o644
        os.chmod(path, 0o640)  # a replaced file keeps its mode, as with open(path, "w")
        save_word2vec_format(path, ["b"], np.ones((1, 2)))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    finally:
        os.umask(umask)


def test_sgd_without_autograd_trains_the_vectors_autograd_trains(backend, seed):
    corpus = synthetic_corpus(vocab=500, topics=10, tokens=60_000, seed=seed % 1000)
    runs = [word2vec.train(corpus, dim=16, steps=300, batch_size=256, chunk_tokens=20_000, backend=backend,
                           storage="pageable", seed=seed, progress=False, autograd=autograd)
            for autograd in (True, False)]
    for table in ("centre", "context"):
        reference, closed_form = (getattr(run.model, table).table.to_numpy() for run in runs)
        assert np.abs(reference).max() > 0.1  # trained well away from the initialisation
        # The same sums in another order: each step may round a row one ulp the other way, and later
        # steps carry it. Seen: 7-16 ulps of the largest values (0.7-1.2), 0.48 of the old fixed
        # atol=2e-6 over 26 seeds, a bound that did not grow with the steps or the table's scale.
        _assert_trained_as(closed_form, reference, steps=300)
    np.testing.assert_allclose([loss for _, loss in runs[1].losses], [loss for _, loss in runs[0].losses],
                               rtol=1e-5)


def _skipgram_tables(u0, v0, in_place, tmp_path):
    """Two attached numpy-backend tables holding ``u0``/``v0``, their SGD (with a decay) and step."""
    vocab, dim = u0.shape
    tables = [ss.OffloadedEmbedding(vocab, dim, max_rows=rows, storage="pageable", backend="numpy")
              for rows in (64, 64 * 4)]
    for table, init in zip(tables, (u0, v0)):
        table.table.load_from(_npy(tmp_path / f"{in_place}-{id(table)}.npy", init))
    optimizer = torch.optim.SGD([t.weight for t in tables], lr=0.05)
    for table in tables:
        table.attach(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 400)
    return tables, optimizer, scheduler, manual_step(*tables, optimizer, in_place=in_place)


def _npy(path, array):
    np.save(path, array)
    return path


def test_in_place_sgd_trains_what_the_working_set_and_autograd_train(rng, tmp_path):
    vocab, dim, pairs, negatives, steps = 300, 12, 64, 3, 240
    u0 = rng.uniform(-0.5, 0.5, (vocab, dim)).astype(np.float32)
    v0 = rng.normal(0, 0.3, (vocab, dim)).astype(np.float32)
    # Zipf ids, popular words scattered over the table: heads repeat in every batch.
    perm = rng.permutation(vocab)
    batches = [tuple(torch.from_numpy(perm[(rng.zipf(1.3, size) - 1) % vocab])
                     for size in (pairs, pairs, (pairs, negatives))) for _ in range(steps)]
    runs = {mode: _skipgram_tables(u0, v0, mode, tmp_path) for mode in (True, False)}
    # The independent reference: dense nn.Embeddings, autograd, SGD on the whole tables.
    model = SkipGram(torch.nn.Embedding.from_pretrained(torch.tensor(u0), freeze=False),
                     torch.nn.Embedding.from_pretrained(torch.tensor(v0), freeze=False))
    dense = torch.optim.SGD(model.parameters(), lr=0.05)
    dense_schedule = torch.optim.lr_scheduler.LambdaLR(dense, lambda step: 1 - step / 400)
    for i, batch in enumerate(batches):
        planned = PairBatch.plan(*batch, centre_rows=vocab, context_rows=vocab)
        for mode, (tables, optimizer, scheduler, step) in runs.items():
            loss = step(planned)
            scheduler.step()
            if i == steps // 2 and mode:  # a checkpoint in the middle, restored into the same tables
                for k, table in enumerate(tables):
                    table.save(tmp_path / f"mid{k}.h5")
                    table.table.uniform_(-1, 1)
                    table.load(tmp_path / f"mid{k}.h5")
        dense.zero_grad()
        reference_loss = model(*batch)
        reference_loss.backward()
        reference_loss = reference_loss.detach()
        dense.step()
        dense_schedule.step()
        assert abs(float(loss) - float(reference_loss)) <= 1e-4 * abs(float(reference_loss))
    for k, reference in enumerate((model.centre.weight, model.context.weight)):
        in_place, copied = (runs[mode][0][k].table.to_numpy() for mode in (True, False))
        assert np.abs(in_place - (u0, v0)[k]).max() > 0.1  # trained well away from the start
        np.testing.assert_allclose(in_place, copied, rtol=0, atol=3e-6)
        np.testing.assert_allclose(in_place, reference.detach().numpy(), rtol=0, atol=3e-6)


def test_in_place_sgd_steps_aside_when_it_would_train_the_wrong_thing(rng, tmp_path):
    u0 = rng.uniform(-0.5, 0.5, (50, 4)).astype(np.float32)
    v0 = rng.normal(0, 0.3, (50, 4)).astype(np.float32)
    batch = PairBatch.plan(torch.tensor([1, 2, 1]), torch.tensor([3, 4, 5]), torch.tensor([[6, 7], [8, 1], [3, 9]]),
                           centre_rows=50, context_rows=50)
    def train(in_place, weight_decay):
        tables, optimizer, _, step = _skipgram_tables(u0, v0, in_place, tmp_path)
        step(batch)
        # Weight decay touches every trained row, which the in-place update leaves out: the step copies.
        optimizer.param_groups[0]["weight_decay"] = weight_decay
        for _ in range(3):
            step(batch)
        return tables, optimizer, [t.table.to_numpy() for t in tables]

    tables, optimizer, decayed = train(None, 0.5)
    copied, plain = train(False, 0.5)[2], train(None, 0.0)[2]
    for k in range(2):
        np.testing.assert_allclose(decayed[k], copied[k], rtol=0, atol=1e-6)
        assert np.abs(decayed[k] - plain[k]).max() > 1e-3
    with pytest.raises(ss.OptionError, match="plain SGD"):
        manual_step(*tables, optimizer, in_place=True)(batch)
    # Ids are checked where a batch is planned, and a planned batch against the tables it meets.
    with pytest.raises(ss.IdError, match="context and negative ids contain 50"):
        PairBatch.plan(batch.centres, batch.contexts, torch.tensor([[6, 7], [8, 50], [3, 9]]), centre_rows=50,
                       context_rows=50)
    wide = PairBatch.plan(batch.centres, batch.contexts, torch.tensor([[6, 7], [8, 50], [3, 9]]), centre_rows=50,
                          context_rows=51)
    small = _skipgram_tables(u0, v0, True, tmp_path)
    before = [t.table.to_numpy() for t in small[0]]
    with pytest.raises(ss.IdError, match="context id 50 but the context table has 50 rows"):
        small[3](wide)
    with pytest.raises(ss.ShapeError, match="no pairs"):
        small[3](PairBatch.plan([], [], np.zeros((0, 2), np.int64), centre_rows=50, context_rows=50))
    for table, old in zip(small[0], before):
        assert np.array_equal(table.table.to_numpy(), old)  # refused before anything changed


@pytest.mark.parametrize("optimizer,speedtorch_api", [("sgd", False), ("adam", False), ("adam", True)])
def test_a_device_cache_and_prefetch_leave_the_vectors_as_they_are(optimizer, speedtorch_api, backend, seed,
                                                                    monkeypatch):
    corpus = synthetic_corpus(vocab=2000, topics=10, tokens=30_000, seed=seed % 1000)
    # A cached table is trained through the working set; so is the uncached one here, for the same
    # float32 sums (in place they differ by rounding: see the in-place tests).
    monkeypatch.setattr(word2vec, "manual_step", functools.partial(manual_step, in_place=False))
    # autograd=False: the closed-form step is the default for SGD on the CPU only.
    options = dict(dim=16, steps=150, batch_size=256, chunk_tokens=10_000, optimizer=optimizer, backend=backend,
                   storage="pageable", seed=seed, progress=False, autograd=optimizer == "adam",
                   speedtorch_api=speedtorch_api)
    plain = word2vec.train(corpus, **options)
    # About two steps' context rows: rows are evicted (and written back) and prefetched all along.
    cached = word2vec.train(corpus, cache_rows=1200, prefetch=True, **options)
    np.testing.assert_array_equal(cached.vectors, plain.vectors)

    def context(result):
        """The context table's owner: its embedding, or (SpeedTorch's API) its switcher."""
        return result.switchers[1] if speedtorch_api else result.model.context

    def rows(result):
        return context(result).to_numpy() if speedtorch_api else context(result).table.to_numpy()

    np.testing.assert_array_equal(rows(cached), rows(plain))
    total = context(cached).stats()["total"]
    assert total["hits"] > 0 and total["evictions"] > 0 and total["prefetched_rows"] > 0
    assert context(plain).stats()["total"]["prefetched_rows"] == 0
    # The tables live as long as the result, whichever API owns them.
    assert memory_summary(cached.model, cached.optimizer)["host_bytes"] > 0


def test_cache_and_prefetch_options_are_checked():
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=2000, seed=0)
    options = dict(dim=4, steps=3, batch_size=16, backend="numpy", progress=False)
    with pytest.raises(ss.OptionError, match="cache_rows > 0"):
        word2vec.train(corpus, prefetch=True, **options)
    with pytest.raises(ss.OptionError, match="cache_rows must be an int >= 0"):
        word2vec.train(corpus, cache_rows=-1, **options)
    with pytest.raises(ss.OptionError, match="SpeedTorch API"):
        word2vec.train(corpus, speedtorch_api=True, autograd=False, **options)


@pytest.mark.parametrize("bound", [7, 40_000, 3_000_000, 1 << 40])  # one radix pass, two, torch's sort
def test_context_ids_are_grouped_as_a_stable_sort_and_unique_group_them(bound, rng):
    ids = torch.from_numpy(rng.integers(0, bound, 5000))
    unique, order, starts = _groups(ids, bound)
    expected_unique, expected_inverse = torch.unique(ids, return_inverse=True)
    assert torch.equal(unique, expected_unique)
    assert torch.equal(order, torch.sort(ids, stable=True).indices)
    counts = torch.bincount(expected_inverse)
    assert torch.equal(starts, counts.cumsum(0) - counts)


@pytest.mark.parametrize("speedtorch_api", [False, True])
def test_an_mmap_run_refuses_existing_table_files_before_it_makes_any(speedtorch_api, tmp_path):
    """Built table by table, a clash at the second table left the first's files behind."""
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=2000, seed=0)
    taken = tmp_path / ("context.npy" if speedtorch_api else "context")
    if speedtorch_api:
        taken.write_bytes(b"someone's file")
    else:
        taken.mkdir()
        (taken / "table.npy").write_bytes(b"someone's file")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ss.PathError, match="already holds"):
        word2vec.train(corpus, dim=8, steps=2, batch_size=64, storage="mmap", directory=str(tmp_path),
              backend="numpy", speedtorch_api=speedtorch_api, progress=False)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    (tmp_path / "fresh" / "centre").mkdir(parents=True)  # an empty directory is fine
    word2vec.train(corpus, dim=8, steps=2, batch_size=64, storage="mmap", directory=str(tmp_path / "fresh"),
          backend="numpy", speedtorch_api=speedtorch_api, progress=False)


def test_a_corpus_file_that_is_missing_a_directory_or_not_utf8_is_refused_naming_its_line(tmp_path):
    with pytest.raises(ss.MissingFileError, match="no corpus file"):
        read_text_corpus(tmp_path / "missing.txt")
    with pytest.raises(ss.PathError, match="is a directory"):
        read_text_corpus(tmp_path)
    # Past the text decoder's first chunk, so a chunk-relative offset would name the wrong byte.
    (tmp_path / "latin1.txt").write_bytes(b"word " * 20_000 + b"\nfine words\ncaf\xe9 au lait\n")
    with pytest.raises(ss.FileFormatError, match=r"line 3, byte 100,015: not UTF-8"):
        read_text_corpus(tmp_path / "latin1.txt")


def test_a_corpus_without_pairs_is_refused_before_an_mmap_run_makes_its_table_files(tmp_path):
    (tmp_path / "text").write_text("a\nb\na\n")  # one-word documents: no window holds two words
    lonely = read_text_corpus(tmp_path / "text")
    tables = tmp_path / "tables"
    tables.mkdir()
    with pytest.raises(ss.OptionError, match="no skip-gram pairs.*two or more words"):
        word2vec.train(lonely, dim=4, steps=3, batch_size=8, backend="numpy", storage="mmap",
                       directory=str(tables), progress=False)
    assert not list(tables.iterdir())  # else the next run in it is refused for the files this one left
    # A document of two words, both subsampled away (a word that is the whole corpus keeps 3% of itself):
    # the message blames subsampling, not the documents.
    (tmp_path / "pair").write_text("a a\n")
    with pytest.raises(ss.OptionError, match="no skip-gram pairs in a pass: subsampling"):
        word2vec.train(read_text_corpus(tmp_path / "pair"), dim=4, steps=3, batch_size=8, backend="numpy",
                       progress=False)


def test_nearest_neighbours_never_list_the_query_and_refuse_more_than_there_are(rng):
    vectors = rng.standard_normal((8, 4))
    ids = np.arange(8)
    assert (word2vec.nearest_neighbours(vectors, ids, ids, k=7) != ids[:, None]).all()
    # Eight candidates, one the query itself: an eighth neighbour would be the query (it was listed last).
    with pytest.raises(ss.OptionError, match="k=8 .* at most 7"):
        word2vec.nearest_neighbours(vectors, ids, ids, k=8)
    with pytest.raises(ss.OptionError, match="k=9 .* at most 7"):
        word2vec.nearest_neighbours(vectors, ids, ids, k=9)  # was torch's RuntimeError
    assert word2vec.nearest_neighbours(vectors, [0], ids[1:], k=7).shape == (1, 7)  # not a candidate: all 7



@pytest.mark.parametrize("batch", [0, -1, 2.5])
def test_analogy_accuracy_refuses_a_batch_that_is_not_a_positive_int(batch):
    vectors = np.array([[1, 0], [0, 1], [1, 0.1], [0.1, 1]], dtype=np.float32)
    questions = [("a", "b", "c", "d")]
    assert evaluate.analogy_accuracy(vectors, list("abcd"), questions).value == 1.0
    # -1 scored no question and reported 0% solved; 0 was range()'s ValueError.
    with pytest.raises(ss.OptionError, match="batch must be a positive int"):
        evaluate.analogy_accuracy(vectors, list("abcd"), questions, batch=batch)


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_a_synthetic_corpus_refuses_a_seed_that_is_not_an_int_from_0(seed):
    with pytest.raises(ss.OptionError, match="seed must be an int >= 0"):
        synthetic_corpus(vocab=10, topics=2, tokens=100, seed=seed)


@pytest.mark.parametrize("option, value, error", [("background", 1.5, ss.OptionError), ("background", -0.1, ss.OptionError),
                                                  ("background", float("nan"), ss.OptionError),
                                                  ("zipf", -1.0, ss.OptionError), ("zipf", float("inf"), ss.OptionError),
                                                  ("zipf", "1", ss.DTypeError)])
def test_a_synthetic_corpus_refuses_a_share_or_exponent_it_would_not_honour(option, value, error):
    """background 1.5 acted as 1 and NaN as 0: a corpus other than the one asked for, without a word."""
    with pytest.raises(error, match=option):
        synthetic_corpus(vocab=10, topics=2, tokens=100, **{option: value})


@pytest.mark.parametrize("value", ["0", "-2"])
def test_cpu_threads_names_omp_num_threads_when_it_is_not_positive(value, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", value)  # the message said "threads must be ...", an option not given
    with pytest.raises(ss.OptionError, match=f"OMP_NUM_THREADS={value!r} is not a positive int"):
        word2vec.cpu_threads()


@pytest.mark.parametrize("speedtorch_api", [False, True])
def test_training_refuses_a_table_directory_without_mmap_storage(speedtorch_api, tmp_path, monkeypatch):
    # It was ignored: the tables stayed in memory and nothing was written where the caller asked.
    monkeypatch.setattr(word2vec, "PairChunks", lambda *a, **k: pytest.fail("the run started"))
    corpus = synthetic_corpus(vocab=100, topics=4, tokens=2000, seed=0)
    with pytest.raises(ss.OptionError, match="directory=.* storage='mmap'.*storage is 'pinned'"):
        word2vec.train(corpus, dim=4, steps=2, batch_size=32, backend="numpy", storage="pinned",
                       directory=str(tmp_path), speedtorch_api=speedtorch_api, progress=False)


@pytest.mark.parametrize("speedtorch_api", [False, True])
def test_training_refuses_mmap_storage_without_a_table_directory(speedtorch_api, monkeypatch):
    # The first table refused it, after the pair thread started, asking for its own path=, which train() has not.
    monkeypatch.setattr(word2vec, "PairChunks", lambda *a, **k: pytest.fail("the run started"))
    corpus = synthetic_corpus(vocab=100, topics=4, tokens=2000, seed=0)
    with pytest.raises(ss.OptionError, match="storage='mmap' keeps the tables in files: pass directory="):
        word2vec.train(corpus, dim=4, steps=2, batch_size=32, backend="numpy", storage="mmap",
                       speedtorch_api=speedtorch_api, progress=False)


@pytest.mark.parametrize("speedtorch_api", [False, True])
def test_an_mmap_run_makes_its_table_directory_with_either_api(speedtorch_api, tmp_path):
    corpus = synthetic_corpus(vocab=100, topics=4, tokens=2000, seed=0)
    options = dict(dim=4, steps=2, batch_size=32, backend="numpy", storage="mmap", speedtorch_api=speedtorch_api,
                   progress=False)
    # OffloadedEmbedding made the directory; the SpeedTorch API said it "does not exist; create it first".
    word2vec.train(corpus, directory=str(tmp_path / "new" / "tables"), **options)
    assert os.listdir(tmp_path / "new" / "tables")
    (tmp_path / "file").write_text("someone's")
    with pytest.raises(ss.PathError, match="'file'|file.*(Not a directory|File exists)") as error:
        word2vec.train(corpus, directory=str(tmp_path / "file"), **options)
    assert "does not exist" not in str(error.value)  # it does: it is a file


def test_a_run_whose_loss_overflows_stops_and_says_what_to_lower():
    """SGD at a rate that blows up: the run used to go on, report 'loss 4.2 -> inf' and vectors of noise."""
    corpus = synthetic_corpus(vocab=300, topics=5, tokens=30_000, seed=3)
    with pytest.raises(ss.OptionError, match=r"training diverged: the loss per pair was (nan|inf) at step 51 "
                                             r"\(2,048 pairs a step, learning rate 1e\+03\)"):
        word2vec.train(corpus, dim=8, steps=60, batch_size=2048, lr=1e3, backend="numpy", progress=False)
    # The same run at word2vec's rate trains.
    result = word2vec.train(corpus, dim=8, steps=60, batch_size=2048, backend="numpy", progress=False)
    assert all(np.isfinite(loss) for _, loss in result.losses)


@pytest.mark.parametrize("speedtorch_api", [False, True])
def test_the_vectors_are_a_snapshot_that_leaves_the_tables_to_train_on(speedtorch_api, backend, seed, rng):
    """The result's vectors were a live view of the centre table with OffloadedEmbedding (a copy with
    the switchers): a view kept alive holds the device cache empty for any further training, and on a
    GPU a device table's view is a read-only copy. Both APIs now hand out the same independent copy."""
    corpus = synthetic_corpus(vocab=500, topics=5, tokens=10_000, seed=seed % 1000)
    result = word2vec.train(corpus, dim=8, steps=20, batch_size=128, backend=backend, storage="pageable",
                            seed=seed, progress=False, cache_rows=100, prefetch=True,
                            speedtorch_api=speedtorch_api)
    table = result.switchers[0] if speedtorch_api else result.model.centre.table
    rows = table.to_numpy(copy=True)
    np.testing.assert_array_equal(result.vectors, rows)
    assert result.vectors.flags.writeable and not np.shares_memory(result.vectors, table.to_numpy())
    if speedtorch_api:
        return  # its model is batch-sized: training on goes through the switchers' calls
    del table, rows
    assert not result.model.centre.table.viewed
    kept = result.vectors.copy()
    centre = result.model.centre
    hits = centre.stats()["total"]["hits"]
    for _ in range(3):  # train on: Zipf ids, so the cache hits
        ids = [torch.from_numpy(np.minimum(rng.zipf(1.3, shape), corpus.vocab_size) - 1)
               for shape in ((64,), (64,), (64, 3))]
        loss = result.model(*ids)
        result.optimizer.zero_grad()
        loss.backward()
        result.optimizer.step()
    assert centre.stats()["total"]["hits"] > hits  # the cache was not held off
    np.testing.assert_array_equal(result.vectors, kept)
    assert not np.array_equal(centre.table.to_numpy(copy=True), kept)
