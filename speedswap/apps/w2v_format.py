"""Word vectors in the word2vec C tool's file formats, which gensim, fastText and others read.

Both formats start with a header line ``"<vocab> <dim>\\n"``. In the text
format each further line is the word and its values separated by spaces; in
the binary format each word is followed by a space, ``dim`` little-endian
float32 values and a newline. gensim reads both with
``KeyedVectors.load_word2vec_format(path, binary=...)``.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "vectors.txt")
>>> save_word2vec_format(path, ["a", "b"], np.eye(2, dtype=np.float32))
>>> open(path).read().splitlines()[0]
'2 2'
"""

from __future__ import annotations

import os
import tempfile
from typing import Sequence

import numpy as np

import speedswap as ss

__all__ = ["save_word2vec_format", "load_word2vec_format"]


def _check_word(word: str) -> str:
    if not word or any(c.isspace() for c in word):
        raise ss.OptionError(f"word {word!r} cannot be written in word2vec's format, where a word "
                             f"is a non-empty run of non-space characters")
    return word


def save_word2vec_format(path: os.PathLike, words: Sequence[str], vectors: np.ndarray, *,
                         binary: bool = False) -> None:
    """Write ``vectors`` with their ``words``, atomically (a crash leaves any old file intact).

    Args:
        path: the file to write.
        words: one word per row of ``vectors``.
        vectors: ``(len(words), dim)`` array.
        binary: the C tool's binary format instead of text.

    Raises:
        ShapeError: ``vectors`` is not 2-D with one row per word.
        OptionError: a word that is empty or contains whitespace.
    """
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or len(vectors) != len(words):
        raise ss.ShapeError(f"expected one vector row per word ({len(words)} words), got an array "
                            f"of shape {vectors.shape}")
    rows = vectors.astype("<f4", copy=False)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".w2v-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(f"{len(words)} {vectors.shape[1]}\n".encode())
            for word, row in zip(words, rows):
                word = _check_word(word).encode("utf-8")
                if binary:
                    f.write(word + b" " + row.tobytes() + b"\n")
                else:
                    # repr-precision floats: the text file round-trips the float32 values.
                    f.write(word + b" " + " ".join(map(repr, row.tolist())).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_word2vec_format(path: os.PathLike, *, binary: bool = False) -> tuple:
    """Read a file written in word2vec's text or binary format.

    Returns:
        (words, vectors): a list of str and a ``(vocab, dim)`` float32 array.

    Raises:
        FileFormatError: a bad header, a truncated file or a row of the wrong length.
    """
    name = os.fspath(path)
    with open(path, "rb") as f:
        header = f.readline().split()
        try:
            count, dim = int(header[0]), int(header[1])
        except (IndexError, ValueError):
            raise ss.FileFormatError(f"{name!r} does not start with word2vec's '<vocab> <dim>' "
                                     f"header line") from None
        words, vectors = [], np.empty((count, dim), dtype=np.float32)
        for i in range(count):
            if binary:
                word = b""
                while (c := f.read(1)) != b" ":
                    if not c:
                        raise ss.FileFormatError(f"{name!r} ends after {i} of {count} vectors")
                    word += c
                raw = f.read(4 * dim)
                if len(raw) != 4 * dim:
                    raise ss.FileFormatError(f"{name!r} ends inside the vector of {word!r}")
                words.append(word.strip().decode("utf-8"))
                vectors[i] = np.frombuffer(raw, dtype="<f4")
            else:
                fields = f.readline().split()
                if len(fields) != dim + 1:
                    raise ss.FileFormatError(f"{name!r}: vector {i + 1} has {len(fields) - 1} values, "
                                             f"the header says {dim} (or the file is truncated)")
                words.append(fields[0].decode("utf-8"))
                vectors[i] = np.array(fields[1:], dtype=np.float32)
    return words, vectors
