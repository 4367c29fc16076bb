"""Text for word2vec: a corpus (synthetic with planted topics, or a text8-style file) and its skip-gram pairs.

The synthetic corpus plants structure that trained vectors can be scored
against (:func:`speedswap.apps.word2vec.topic_purity`); the text reader takes real
corpora. Both give a :class:`Corpus`, which :func:`skipgram_pairs` turns into
(centre, context) pairs with word2vec's subsampling and dynamic window.

>>> corpus = synthetic_corpus(vocab=100, topics=4, tokens=1_000, seed=0)
>>> len(corpus.tokens), corpus.vocab_size, corpus.name(7) == f"w7/t{corpus.topics[7]}"
(1000, 100, True)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from typing import Optional

import numpy as np

import speedswap as ss
from speedswap import convert
from speedswap.atomic import check_readable_file

__all__ = ["Corpus", "synthetic_corpus", "read_text_corpus", "keep_probabilities", "skipgram_pairs"]


@dataclasses.dataclass
class Corpus:
    """Word ids in reading order, with what training and evaluation need about them.

    Attributes:
        tokens: int32 word ids.
        doc_starts: int64 offsets where a document (line, sentence) starts;
            skip-gram windows never cross one.
        counts: int64 occurrences of each word id (the vocabulary size is its length).
        words: the word strings, or None for a synthetic corpus.
        topics: the planted topic of each word id (synthetic corpus only), else None.
    """

    tokens: np.ndarray
    doc_starts: np.ndarray
    counts: np.ndarray
    words: Optional[list] = None
    topics: Optional[np.ndarray] = None

    @property
    def vocab_size(self) -> int:
        """Distinct word ids (the embedding tables' rows)."""
        return len(self.counts)

    def name(self, word_id: int) -> str:
        """A printable name: the word, or ``w<id>/t<topic>`` for synthetic words."""
        if self.words is not None:
            return self.words[word_id]
        return f"w{word_id}/t{self.topics[word_id]}"


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ss.OptionError(f"{name} must be a positive int, got {value!r}")


def synthetic_corpus(vocab: int, topics: int, tokens: int, *, doc_len: int = 50, background: float = 0.2,
                     zipf: float = 1.0, seed: int = 0) -> Corpus:
    """A corpus with planted structure, so the trained vectors can be scored.

    Every word belongs to one topic (assigned at random, so each topic has
    frequent and rare words) and word ``i`` has Zipf weight ``1/(i+1)**zipf``,
    as natural text does. Each document picks a topic and draws its words
    from that topic's words by weight; a ``background`` share of tokens is
    instead drawn from the whole vocabulary, the way function words and
    digressions blur real topics.

    Args:
        vocab: number of word ids (the embedding tables' rows).
        topics: number of planted topics.
        tokens: corpus length.
        doc_len: tokens per document (the last one is shorter when ``tokens``
            is not a multiple of it).
        background: share of tokens drawn regardless of the document's topic.
        zipf: the frequency exponent.
        seed: for reproducible corpora.

    Returns:
        Corpus with ``topics`` set.

    Raises:
        OptionError: a size that is not a positive int, more topics than words,
            a ``seed`` that is not an int >= 0, a ``background`` outside
            [0, 1] or a ``zipf`` exponent that is negative or not finite.
        DTypeError: ``background`` or ``zipf`` is not a real number.
    """
    _check_positive(vocab=vocab, topics=topics, tokens=tokens, doc_len=doc_len)
    seed = convert.int_option(seed, "seed", minimum=0)  # numpy's generator raises its own errors for others
    # A share above 1 acted as 1, and NaN as 0: the corpus was not the one asked for.
    background = convert.float_option(background, "background")
    if not 0 <= background <= 1:
        raise ss.OptionError(f"background is the share of tokens drawn regardless of the topic: a number "
                             f"from 0 to 1, got {background!r}")
    zipf = convert.float_option(zipf, "zipf")
    if zipf < 0:
        raise ss.OptionError(f"zipf is the frequency exponent (word i has weight 1/(i+1)**zipf): a number "
                             f">= 0, got {zipf!r}")
    if topics > vocab:
        raise ss.OptionError(f"{topics} topics over {vocab} words: every topic needs words of its own; "
                             f"give at most vocab topics")
    rng = np.random.default_rng(seed)
    topic_of = rng.integers(0, topics, vocab)
    weight = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** zipf
    num_docs = -(-tokens // doc_len)
    doc_topic = rng.integers(0, topics, num_docs)
    # A topic the random assignment gave no word has no documents either: the others take them
    # (each document is filled from its topic's words, so an empty topic would leave it unfilled).
    empty = np.setdiff1d(np.arange(topics), topic_of)
    if len(empty):
        filled = np.setdiff1d(np.arange(topics), empty)
        doc_topic = filled[rng.integers(0, len(filled), num_docs)]
    ids = np.empty((num_docs, doc_len), dtype=np.int32)
    for topic in range(topics):
        members = np.flatnonzero(topic_of == topic)
        docs = np.flatnonzero(doc_topic == topic)
        if len(docs) == 0:
            continue
        cdf = np.cumsum(weight[members])
        ids[docs] = members[np.searchsorted(cdf, rng.random((len(docs), doc_len)) * cdf[-1])]
    noise = rng.random(ids.shape) < background
    cdf = np.cumsum(weight)
    ids[noise] = np.searchsorted(cdf, rng.random(int(noise.sum())) * cdf[-1])
    # Whole documents are drawn (so a multiple of doc_len gives the corpus it always gave), then cut.
    ids = ids.ravel()[:tokens]
    return Corpus(tokens=ids, doc_starts=np.arange(0, len(ids), doc_len, dtype=np.int64),
                  counts=np.bincount(ids, minlength=vocab).astype(np.int64), topics=topic_of)


def read_text_corpus(path: os.PathLike, vocab: Optional[int] = None, *, min_count: int = 1) -> Corpus:
    """Read a text8-style corpus: words separated by whitespace, one document per line.

    text8 itself is a single line of 17 million lower-case words. The
    vocabulary is built as word2vec builds it: words occurring at least
    ``min_count`` times, ranked by frequency (id 0 is the most frequent), and
    of those at most the ``vocab`` most frequent; every other word is dropped
    from the token stream before windows are drawn, as word2vec does.

    Args:
        path: a UTF-8 text file.
        vocab: the most distinct words to keep (None: no cap).
        min_count: the fewest occurrences a kept word has (word2vec's ``-min-count``).

    Returns:
        Corpus (``topics`` is None: there is no planted structure to score).

    Raises:
        OptionError: ``vocab`` or ``min_count`` is not a positive int.
        FileFormatError: the file is not UTF-8 (the message names the line and
            byte), holds no words, or none occurs ``min_count`` times.
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory.
    """
    _check_positive(min_count=min_count, **({} if vocab is None else {"vocab": vocab}))
    name = check_readable_file(path, "corpus file")
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first word.
        with open(name, encoding="utf-8-sig") as f:
            seen, tokens, line_starts = _read_words(f)
    except UnicodeDecodeError as exc:
        raise _not_utf8(name, exc) from None
    if not len(tokens):
        raise ss.FileFormatError(f"{os.fspath(path)!r} holds no words; a corpus is whitespace-separated "
                                 f"words, one document per line")
    counts = np.bincount(tokens, minlength=len(seen))
    words, tally = list(seen), counts.tolist()
    # Rank by count, ties alphabetically so the vocabulary does not depend on the order words first appear.
    ranked = sorted(np.flatnonzero(counts >= min_count).tolist(), key=lambda i: (-tally[i], words[i]))[:vocab]
    if not ranked:
        raise ss.FileFormatError(f"no word of {os.fspath(path)!r} occurs {min_count} times or more "
                                 f"(the most frequent occurs {max(tally)} times); lower min_count")
    rank = np.full(len(seen), -1, dtype=np.int32)
    rank[ranked] = np.arange(len(ranked), dtype=np.int32)
    np.take(rank, tokens, out=tokens)
    kept = tokens >= 0
    # A document is a line with a kept word; it starts where the kept words of the lines before it end.
    # Lines without words share their start with the next line's (the first line's, 0, is always there).
    line_starts = np.unique(line_starts[line_starts < len(tokens)])
    per_line = np.add.reduceat(kept, line_starts, dtype=np.int64)
    return Corpus(tokens=tokens[kept], doc_starts=(np.cumsum(per_line) - per_line)[per_line > 0],
                  counts=counts[ranked].astype(np.int64), words=[words[i] for i in ranked])


#: Characters of text read and split at a time: some 300,000 words, 20 MB of Python strings.
_READ_CHARS = 1 << 21


def _read_words(f) -> tuple:
    """Every word of a text file as an int32 id in order of first appearance, and where its lines start.

    Read :data:`_READ_CHARS` at a time and cut after the last whitespace, so no
    word straddles two pieces; each piece's words become ids at once, so only
    one piece's strings are alive at a time (text8 read as lists of strings
    took 1.8 GB), and a line may span many pieces (text8 is one line).

    Args:
        f: the file, open for reading text.

    Returns:
        ``(seen, tokens, line_starts)``: each distinct word mapped to its id
        (in id order); the int32 ids of the file's words; the int64 position
        in ``tokens`` where each line starts (equal for lines without words).
    """
    seen = collections.defaultdict(itertools.count().__next__)  # a new word gets the next id
    pieces, line_starts, position, carry = [], [np.zeros(1, np.int64)], 0, ""
    while True:
        text = f.read(_READ_CHARS)
        end, cut = not text, len(carry) + len(text)
        text = carry + text
        # The carry holds no whitespace: look for the last one in what was just read.
        while not end and cut > len(carry) and not text[cut - 1].isspace():
            cut -= 1
        if not end and cut == len(carry):  # no whitespace yet: one long word, read on
            carry = text
            continue
        text, carry = text[:cut], text[cut:]
        # The text after each newline starts a line (the first part continues the previous piece's).
        lines = [line.split() for line in text.split("\n")]
        lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
        line_starts.append(position + np.cumsum(lengths[:-1]))
        words = itertools.chain.from_iterable(lines)
        pieces.append(np.fromiter(map(seen.__getitem__, words), dtype=np.int32, count=int(lengths.sum())))
        position += int(lengths.sum())
        if end:
            return seen, np.concatenate(pieces), np.concatenate(line_starts)


def _not_utf8(name: str, exc: UnicodeDecodeError) -> ss.FileFormatError:
    """The error for a corpus file that is not UTF-8, naming the first bad line and its byte in the file.

    The text decoder's ``exc.start`` counts from the chunk it was decoding, so the
    file is read again, as bytes, to find where; only on this path.
    """
    with open(name, "rb") as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                return ss.FileFormatError(f"{name!r}, line {number:,}, byte {offset + bad.start:,}: not UTF-8 "
                                          f"({bad.reason}); a corpus is UTF-8 text of whitespace-separated "
                                          f"words: convert it (e.g. iconv -f latin1 -t utf-8)")
            offset += len(raw)
    return ss.FileFormatError(f"{name!r} is not UTF-8 ({exc.reason}); a corpus is UTF-8 text of "
                              f"whitespace-separated words: convert it (e.g. iconv -f latin1 -t utf-8)")


def keep_probabilities(counts: np.ndarray, threshold: float = 1e-3) -> np.ndarray:
    """Mikolov's subsampling: the chance a word's occurrence is kept, ``(sqrt(f/t) + 1) t/f``.

    Frequent words ("the", "of") carry little about their neighbours and
    dominate the pairs; dropping most of their occurrences speeds training
    and improves the rare words' vectors.
    """
    freq = counts / max(1, counts.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        keep = (np.sqrt(freq / threshold) + 1) * threshold / freq
    return np.nan_to_num(np.minimum(keep, 1.0), nan=1.0)


def skipgram_pairs(tokens: np.ndarray, doc_ids: np.ndarray, keep_prob: np.ndarray, window: int,
                   rng: np.random.Generator) -> tuple:
    """(centre, context) pairs of a stretch of tokens, vectorised.

    Each kept token's window is shrunk to a random reach in ``[1, window]``
    (word2vec's dynamic window, which weights near neighbours more); pairs
    never cross a document boundary.

    Args:
        tokens: int word ids.
        doc_ids: the document of each token (same length).
        keep_prob: per-word keep probability (:func:`keep_probabilities`).
        window: the largest reach.
        rng: numpy Generator.

    Returns:
        (centres, contexts): two int64 arrays of equal length.
    """
    kept = rng.random(len(tokens)) < keep_prob[tokens]
    tokens, doc_ids = tokens[kept].astype(np.int64), doc_ids[kept]
    reach = rng.integers(1, window + 1, len(tokens))
    centres, contexts = [], []
    for offset in range(1, min(window, len(tokens) - 1) + 1):
        same_doc = doc_ids[offset:] == doc_ids[:-offset]
        left, right = tokens[:-offset], tokens[offset:]
        forward = same_doc & (reach[:-offset] >= offset)
        backward = same_doc & (reach[offset:] >= offset)
        centres += [left[forward], right[backward]]
        contexts += [right[forward], left[backward]]
    if not centres:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(centres), np.concatenate(contexts)
