"""The word2vec pieces the demo and examples/word2vec.py share: corpus, pairs, negatives, scoring."""

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.apps import word2vec
from speedswap.apps.corpus import keep_probabilities, read_text_corpus, skipgram_pairs, synthetic_corpus


def test_synthetic_corpus_plants_topics_with_zipf_frequencies(seed):
    corpus = synthetic_corpus(vocab=400, topics=8, tokens=40_000, background=0.0, seed=seed)
    assert corpus.tokens.shape == (40_000,) and corpus.counts.sum() == 40_000
    docs = corpus.tokens.reshape(-1, 50)
    # With no background every document stays inside one topic.
    assert (corpus.topics[docs] == corpus.topics[docs[:, :1]]).all()
    # Lower ids are more frequent (Zipf), on average.
    assert corpus.counts[:20].mean() > 5 * corpus.counts[200:220].mean()


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


def test_negative_sampler_follows_unigram_to_the_three_quarters():
    counts = np.array([8000, 0, 1000, 125])
    sampler = word2vec.NegativeSampler(counts, torch.device("cpu"), seed=0)
    draws = np.bincount(sampler((200_000,)).numpy(), minlength=4) / 200_000
    expected = counts ** 0.75 / (counts ** 0.75).sum()
    assert draws[1] == 0  # a word that never occurs is never a negative
    np.testing.assert_allclose(draws, expected, atol=0.01)


def test_read_text_corpus_ranks_words_and_keeps_lines_apart(tmp_path):
    (tmp_path / "text").write_text("b a a\n\nc a b rare\n")
    corpus = read_text_corpus(tmp_path / "text", vocab=3)
    assert corpus.words == ["a", "b", "c"]
    assert corpus.tokens.tolist() == [1, 0, 0, 2, 0, 1]  # "rare" is outside the vocabulary
    assert corpus.doc_starts.tolist() == [0, 3]
    assert corpus.counts.tolist() == [3, 2, 1]


def test_topic_purity_is_chance_for_random_vectors_and_one_for_planted_ones(rng):
    corpus = synthetic_corpus(vocab=600, topics=6, tokens=60_000, seed=1)
    purity, chance = word2vec.topic_purity(rng.standard_normal((600, 16)), corpus)
    assert abs(purity - chance) < 0.05
    planted = np.eye(6)[corpus.topics] + 0.01 * rng.standard_normal((600, 6))
    assert word2vec.topic_purity(planted, corpus)[0] == 1.0


def test_training_refuses_a_corpus_too_short_for_one_batch():
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=200, seed=0)
    with pytest.raises(ss.OptionError, match="batch_size") as error:
        word2vec.train(corpus, dim=4, steps=3, batch_size=10_000, backend="numpy", progress=False)
    assert isinstance(error.value, ValueError)  # speedswap errors subclass the built-in one


def test_training_refuses_an_unknown_optimizer():
    corpus = synthetic_corpus(vocab=50, topics=2, tokens=2000, seed=0)
    with pytest.raises(ss.OptionError, match="'sgd'.*adam"):
        word2vec.train(corpus, dim=4, steps=3, batch_size=16, optimizer="sgd", backend="numpy", progress=False)


def test_topic_purity_needs_planted_topics_and_enough_frequent_words(tmp_path, rng):
    (tmp_path / "text").write_text("a b c a b\n")
    text = read_text_corpus(tmp_path / "text", vocab=3)
    with pytest.raises(ss.OptionError, match="planted topics"):
        word2vec.topic_purity(rng.standard_normal((3, 4)), text)
    short = synthetic_corpus(vocab=100, topics=4, tokens=300, seed=0)
    with pytest.raises(ss.OptionError, match="longer"):
        word2vec.topic_purity(rng.standard_normal((100, 4)), short)


def test_corpus_errors_say_what_is_wrong(tmp_path):
    (tmp_path / "empty").write_text("\n \n")
    with pytest.raises(ss.FileFormatError, match="no words"):
        read_text_corpus(tmp_path / "empty", vocab=10)
    with pytest.raises(ss.OptionError, match="vocab"):
        read_text_corpus(tmp_path / "empty", vocab=0)
    with pytest.raises(ss.OptionError, match="topics must be a positive int, got 0"):
        synthetic_corpus(vocab=10, topics=0, tokens=100)
