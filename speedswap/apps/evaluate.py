"""Word-vector quality on the standard test sets, read in the formats gensim reads.

* **Word similarity** (WordSim353's ``wordsim353.tsv``, SimLex-999): lines of
  ``word1<TAB>word2<TAB>score``, ``#`` comments; the figure is the Spearman
  correlation between the human scores and the vectors' cosine similarities
  over the pairs whose two words are in the vocabulary.
* **Analogies** (``questions-words.txt``): ``: section`` headers, then lines
  ``a b c d`` meaning "a is to b as c is to d"; a question counts as solved
  when the word nearest ``b - a + c`` (by cosine, among unit vectors, the
  three question words excluded) is ``d`` (3CosAdd). The figure is the share
  solved among the questions whose four words are in the vocabulary.

Both match gensim's ``KeyedVectors.evaluate_word_pairs`` and
``evaluate_word_analogies`` with their defaults (case-insensitive; only the
300,000 most frequent words are candidates), so figures compare across the
two libraries. Case-insensitive means what it means there: words are
compared upper-cased, a word's vector is its most frequent spelling's, and
an analogy's answer is the first of the five words nearest ``b - a + c``
(the question words' rows excluded) that is not another spelling of a
question word; it is right when it is a spelling of ``d``.

>>> import numpy as np
>>> vectors = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
>>> pairs = [("a", "b", 9.0), ("a", "c", 1.0), ("b", "c", 2.0)]
>>> word_similarity(vectors, ["a", "b", "c"], pairs).spearman
1.0
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Sequence

import numpy as np
import torch

import speedswap as ss
from speedswap import convert
from speedswap.atomic import check_readable_file

__all__ = ["Score", "read_word_pairs", "read_analogies", "word_similarity", "analogy_accuracy"]

#: gensim's ``restrict_vocab`` default: answers are sought among this many most frequent words.
RESTRICT_VOCAB = 300_000


@dataclasses.dataclass
class Score:
    """One evaluation's figure and how much of the test set it covers.

    Attributes:
        value: Spearman correlation (similarity) or accuracy in [0, 1] (analogies).
        used: items scored (both or all four words in the vocabulary).
        total: items in the file.
    """

    value: float
    used: int
    total: int

    @property
    def spearman(self) -> float:
        """The similarity figure under its usual name."""
        return self.value


def _lines(path: os.PathLike):
    """``(number, text)`` of each line of the UTF-8 file ``path`` that is neither blank nor a ``#`` comment.

    Raises:
        FileFormatError: a line that is not UTF-8 (named by its number).
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory.
    """
    name = check_readable_file(path, "test-set file")
    # Read as bytes and decoded line by line, so an error can name its line.
    with open(name, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # A byte-order mark (Windows editors write one) would hide the first line's "#" or ":".
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                raise ss.FileFormatError(f"{name}:{number}: not UTF-8 ({exc.reason} at byte {exc.start} of "
                                         f"the line: {raw[:80]!r}); the test sets are UTF-8: convert the "
                                         f"file (e.g. iconv -f latin1 -t utf-8)") from None
            if line and not line.startswith("#"):
                yield number, line


def read_word_pairs(path: os.PathLike) -> list:
    """``[(word1, word2, score), ...]`` of a word-similarity file (tab- or space-separated).

    The words are kept as written: the scoring compares them upper-cased, as
    gensim does (lower-casing first would lose letters, see :func:`read_analogies`).

    Raises:
        FileFormatError: a line that is not two words and a number or not UTF-8, or no pairs at all.
        MissingFileError: nothing at ``path``.
    """
    pairs = []
    for number, line in _lines(path):
        fields = line.split("\t") if "\t" in line else line.split()
        try:
            pairs.append((fields[0], fields[1], float(fields[2])))
        except (IndexError, ValueError):
            raise ss.FileFormatError(f"{os.fspath(path)}:{number}: expected 'word1<TAB>word2<TAB>score' "
                                     f"(WordSim353's format), got {line[:80]!r}") from None
    if not pairs:
        raise ss.FileFormatError(f"{os.fspath(path)!r} holds no word pairs")
    return pairs


def read_analogies(path: os.PathLike) -> list:
    """``[(a, b, c, d), ...]`` of an analogy file (questions-words.txt's format), words as written.

    The scoring compares words upper-cased, as gensim does. Lower-casing them
    here would lose what upper-casing keeps: Turkish ``"İstanbul"`` lower-cases
    to an ``i`` and a combining dot (U+0307), which upper-case to ``"I"`` and
    the dot, not back to ``"İ"``, so a question with it would be out of the
    vocabulary where gensim scores it.

    Raises:
        FileFormatError: a question that is not four words, a line that is not UTF-8, or no
            questions at all.
        MissingFileError: nothing at ``path``.
    """
    questions = []
    for number, line in _lines(path):
        if line.startswith(":"):
            continue  # a section header
        words = line.split()
        if len(words) != 4:
            raise ss.FileFormatError(f"{os.fspath(path)}:{number}: an analogy is four words "
                                     f"'a b c d' (a is to b as c is to d), got {line[:80]!r}")
        questions.append(tuple(words))
    if not questions:
        raise ss.FileFormatError(f"{os.fspath(path)!r} holds no analogy questions")
    return questions


def _unit(vectors: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only vectors (a GPU table's to_numpy(), a file opened read-only) are only read
        # here: torch's warning that it cannot refuse writes to them does not apply.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        v = torch.from_numpy(np.ascontiguousarray(vectors, dtype=np.float32))
    return v / v.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _check_rows(vectors, words: Sequence[str]) -> None:
    """Raise unless ``vectors`` is 2-D with one row per word, so row ``i`` is the vector of ``words[i]``."""
    shape = tuple(np.shape(vectors))
    if len(shape) != 2 or shape[0] != len(words):
        raise ss.ShapeError(f"expected (vocab, dim) vectors with one row per word ({len(words):,} words), "
                            f"got shape {shape}; pass the vectors and the words of the same vocabulary, "
                            f"in the same order")


def _check_items(items: Sequence[tuple], length: int, what: str, reader: str) -> None:
    """Raise unless every item has ``length`` fields: a question of three words or five scored as four
    (its ids reshaped into rows of four) silently scored other questions than those given."""
    bad = next((item for item in items if len(item) != length), None)
    if bad is not None:
        raise ss.ShapeError(f"each item is {what}, got {bad!r}; {reader} reads such items from a file")


def _is_finite_number(value) -> bool:
    """Whether ``value`` is a finite number or the text of one (``float`` takes it)."""
    try:
        return bool(np.isfinite(float(value)))
    except (TypeError, ValueError):
        return False


def _index(words: Sequence[str], limit: int) -> dict:
    """The row of each upper-cased word among the first ``limit``: gensim's case-insensitive vocabulary.

    The first (most frequent) spelling wins when upper-casing merges two words, as in gensim.
    """
    index = {}
    for i, word in enumerate(words[:limit]):
        index.setdefault(word.upper(), i)
    return index


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank (what Spearman's correlation needs)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def word_similarity(vectors: np.ndarray, words: Sequence[str], pairs: Sequence[tuple]) -> Score:
    """Spearman correlation of cosine similarity with human scores (gensim's ``evaluate_word_pairs``).

    Args:
        vectors: ``(vocab, dim)`` vectors, rows in ``words`` order (most frequent first).
        words: the vocabulary.
        pairs: ``(word1, word2, score)`` from :func:`read_word_pairs` (a score may
            also be the text of a number).

    Returns:
        Score (``value`` is NaN when fewer than two pairs are in the vocabulary).

    Raises:
        ShapeError: ``vectors`` is not ``(len(words), dim)``, or a pair is not three fields.
        DTypeError: a score of a pair in the vocabulary that is not a finite number.
    """
    _check_rows(vectors, words)
    _check_items(pairs, 3, "(word1, word2, score)", "read_word_pairs")
    index = _index(words, RESTRICT_VOCAB)
    known = [(index[a.upper()], index[b.upper()], s) for a, b, s in pairs
             if a.upper() in index and b.upper() in index]
    if len(known) < 2:
        return Score(float("nan"), len(known), len(pairs))
    bad = [score for *_, score in known if not _is_finite_number(score)]
    if bad:
        # None and NaN would rank as a tie of their own, and other text cannot be ranked with numbers.
        raise ss.DTypeError(f"a pair's score is a finite number, or the text of one; got {bad[0]!r}: read the "
                            f"pairs with read_word_pairs, or give (word1, word2, score) with numeric scores")
    unit = _unit(vectors)
    a, b, human = (np.array(column) for column in zip(*known))
    cosine = (unit[a] * unit[b]).sum(1).numpy().astype(np.float64)
    # As numbers: scores given as text (a csv reader's) were ranked as text, "10" before "9".
    value = float(np.corrcoef(_ranks(cosine), _ranks(human.astype(np.float64)))[0, 1])
    return Score(value, len(known), len(pairs))


def analogy_accuracy(vectors: np.ndarray, words: Sequence[str], questions: Sequence[tuple],
                     batch: int = 1024) -> Score:
    """Share of analogies solved by 3CosAdd (gensim's ``evaluate_word_analogies``).

    Args:
        vectors: ``(vocab, dim)`` vectors, rows in ``words`` order (most frequent first).
        words: the vocabulary.
        questions: ``(a, b, c, d)`` from :func:`read_analogies`.
        batch: questions scored per matrix product.

    Returns:
        Score (``value`` is NaN when no question is in the vocabulary).

    Raises:
        ShapeError: ``vectors`` is not ``(len(words), dim)``, or a question is not four words.
        OptionError: ``batch`` is not a positive int.
    """
    _check_rows(vectors, words)
    _check_items(questions, 4, "four words (a, b, c, d): a is to b as c is to d", "read_analogies")
    batch = convert.int_option(batch, "batch", hint=" (questions per matrix product)")
    index = _index(words, RESTRICT_VOCAB)
    known = np.array([[index[w.upper()] for w in q] for q in questions if all(w.upper() in index for w in q)],
                     dtype=np.int64).reshape(-1, 4)
    if not len(known):
        return Score(float("nan"), 0, len(questions))
    unit = _unit(vectors[:RESTRICT_VOCAB])
    # Each candidate row's word as the questions name it: the row of its most frequent spelling.
    spelling_of = torch.tensor([index[word.upper()] for word in words[:RESTRICT_VOCAB]])
    correct = 0
    for start in range(0, len(known), batch):
        q = torch.from_numpy(known[start:start + batch])
        target = unit[q[:, 1]] - unit[q[:, 0]] + unit[q[:, 2]]
        sim = target @ unit.T
        sim.scatter_(1, q[:, :3], float("-inf"))  # the question's own words are never the answer
        # gensim's most_similar(topn=5), then its first word that is no spelling of a, b or c
        # (its last one when all five are).
        nearest = spelling_of[sim.topk(min(5, sim.shape[1]), dim=1).indices]
        asked = (nearest.unsqueeze(2) == q[:, None, :3]).any(2)
        first = torch.where(asked.all(1), nearest.shape[1] - 1, (~asked).to(torch.uint8).argmax(1))
        correct += int((nearest.gather(1, first.unsqueeze(1)).squeeze(1) == q[:, 3]).sum())
    return Score(correct / len(known), len(known), len(questions))
