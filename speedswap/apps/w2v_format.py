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
from typing import Sequence

import numpy as np

import speedswap as ss
from speedswap.atomic import atomic_output, check_readable_file

__all__ = ["save_word2vec_format", "load_word2vec_format"]


def _encoded(word) -> bytes:
    """``word`` in UTF-8, if word2vec's format can hold it: a non-empty str without whitespace.

    Raises:
        DTypeError: ``word`` is not a str.
        OptionError: ``word`` is empty, holds whitespace, or has no UTF-8 form (a lone surrogate).
    """
    if not isinstance(word, str):
        raise ss.DTypeError(f"words must be str, got {word!r} of type {type(word).__name__}; convert "
                            f"them first (e.g. [str(w) for w in words])")
    if not word or any(c.isspace() for c in word):
        raise ss.OptionError(f"word {word!r} cannot be written in word2vec's format, where a word "
                             f"is a non-empty run of non-space characters")
    try:
        return word.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ss.OptionError(f"word {word!r} cannot be written in UTF-8, word2vec's encoding: character "
                             f"{exc.start} is a lone surrogate (what decoding bytes with "
                             f"errors='surrogateescape' leaves); decode the words with their real "
                             f"encoding first") from None


def save_word2vec_format(path: os.PathLike, words: Sequence[str], vectors: np.ndarray, *,
                         binary: bool = False) -> None:
    """Write ``vectors`` with their ``words``, atomically (a crash or a full disk leaves any old file intact).

    Every word and the array are checked before the file is opened. A new
    file gets the mode a plain ``open()`` gives it; a replaced one keeps its own.

    Args:
        path: the file to write.
        words: one str per row of ``vectors``.
        vectors: ``(len(words), dim)`` array of real numbers, written as float32.
        binary: the C tool's binary format instead of text.

    Raises:
        ShapeError: ``vectors`` is not 2-D with one row per word.
        DTypeError: a word that is not a str, or ``vectors`` not real numbers.
        OptionError: a word that is empty, contains whitespace, or cannot be encoded in UTF-8.
        PathError: the directory does not exist, ``path`` is a directory, or the
            file system refused the write (read-only, full); any old file is intact.
    """
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or len(vectors) != len(words):
        raise ss.ShapeError(f"expected one vector row per word ({len(words)} words), got an array "
                            f"of shape {vectors.shape}")
    if not (np.issubdtype(vectors.dtype, np.integer) or np.issubdtype(vectors.dtype, np.floating)):
        raise ss.DTypeError(f"vectors must hold real numbers (they are written as float32), got dtype "
                            f"{vectors.dtype}")
    encoded = [_encoded(word) for word in words]
    rows = vectors.astype("<f4", copy=False)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(f"{len(encoded)} {rows.shape[1]}\n".encode())
        for word, row in zip(encoded, rows):
            if binary:
                f.write(word + b" " + row.tobytes() + b"\n")
            else:
                # repr-precision floats: the text file round-trips the float32 values.
                f.write(word + b" " + " ".join(map(repr, row.tolist())).encode() + b"\n")


def _header(line: bytes, name: str, body_bytes: int, binary: bool) -> tuple:
    """``(count, dim)`` of the header ``line``, if the ``body_bytes`` after it can hold that many vectors.

    Raises:
        FileFormatError: not two whole numbers >= 0, or more vectors than the file has room for.
    """
    try:
        count, dim = (int(field) for field in line.split())
    except ValueError:
        raise ss.FileFormatError(f"{name!r}, line 1: expected word2vec's header '<vocab> <dim>' (two "
                                 f"whole numbers), got {line[:80]!r}") from None
    if count < 0 or dim < 0:
        raise ss.FileFormatError(f"{name!r}, line 1: the header says {count} vectors of {dim} values; "
                                 f"both must be >= 0")
    # Checked before the (count, dim) array is allocated, so a bad count cannot ask for terabytes.
    # The shortest row is 4 bytes a value after a space (binary, where a word may be empty),
    # or a one-byte word and a space and a digit a value (text).
    need = count * (1 + 4 * dim if binary else 1 + 2 * dim)
    if need > body_bytes:
        raise ss.FileFormatError(f"{name!r}, line 1: the header says {count:,} vectors of {dim:,} values, "
                                 f"which take at least {need:,} bytes, but {body_bytes:,} follow it; the "
                                 f"header is wrong or the file is truncated"
                                 + ("" if binary else " (or it is binary: pass binary=True)"))
    return count, dim


def _text_row(f, name: str, i: int, count: int, dim: int) -> tuple:
    """The word and values of vector ``i`` (line ``i + 2``) of a text-format file."""
    line = f.readline()
    if not line:
        raise ss.FileFormatError(f"{name!r} ends after {i:,} of the {count:,} vectors its header says; "
                                 f"the file is truncated or the header's count is wrong")
    fields = line.split()
    if len(fields) != dim + 1:
        got = "an empty line" if not fields else f"{len(fields) - 1} value" + "s" * (len(fields) != 2)
        raise ss.FileFormatError(f"{name!r}, line {i + 2}: expected a word and the {dim} values the "
                                 f"header says, got {got}")
    try:
        word = fields[0].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(name, f"line {i + 2}", fields[0], exc) from None
    try:
        return word, np.array(fields[1:], dtype=np.float32)
    except ValueError as exc:
        raise ss.FileFormatError(f"{name!r}, line {i + 2}: expected {dim} numbers after the word "
                                 f"{word!r} ({exc})") from None


def _binary_row(f, name: str, i: int, count: int, dim: int) -> tuple:
    """The word and values of vector ``i`` of a binary-format file."""
    start = f.tell()
    word = b""
    while (c := f.read(1)) != b" ":
        if not c:
            raise ss.FileFormatError(f"{name!r} ends after {i:,} of the {count:,} vectors its header "
                                     f"says; the file is truncated or the header's count is wrong")
        word += c
    raw = f.read(4 * dim)
    if len(raw) != 4 * dim:
        raise ss.FileFormatError(f"{name!r} ends inside vector {i + 1} (the word {word.strip()!r}): "
                                 f"{len(raw)} of its {4 * dim} bytes are there; the file is truncated, "
                                 f"or it is in the text format (pass binary=False)")
    try:
        decoded = word.strip().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(name, f"vector {i + 1} (byte {start:,})", word.strip(), exc) from None
    return decoded, np.frombuffer(raw, dtype="<f4")


def _not_utf8(name: str, where: str, word: bytes, exc: UnicodeDecodeError) -> ss.FileFormatError:
    return ss.FileFormatError(f"{name!r}, {where}: the word {word[:40]!r} is not UTF-8 ({exc.reason} at "
                              f"byte {exc.start}); word2vec files are UTF-8: convert the file "
                              f"(e.g. iconv -f latin1 -t utf-8)")


def _check_end(f, name: str, count: int, binary: bool) -> None:
    """Raise unless only whitespace follows the ``count`` vectors the header announced."""
    offset, line = f.tell(), count + 2
    while chunk := f.read(1 << 16):
        extra = len(chunk) - len(chunk.lstrip())
        if extra < len(chunk):
            line += chunk.count(b"\n", 0, extra)
            where = f"byte {offset + extra:,}" if binary else f"line {line}"
            raise ss.FileFormatError(f"{name!r} holds more than the {count:,} vectors its header says "
                                     f"(another row starts at {where}): the header and the body "
                                     f"disagree; correct the header's count or remove the extra rows")
        offset, line = offset + len(chunk), line + chunk.count(b"\n")


def load_word2vec_format(path: os.PathLike, *, binary: bool = False) -> tuple:
    """Read a file written in word2vec's text or binary format.

    Args:
        path: the file.
        binary: read the C tool's binary format instead of text.

    Returns:
        (words, vectors): a list of str and a ``(vocab, dim)`` float32 array.

    Raises:
        FileFormatError: a header that is not two whole numbers >= 0 or promises
            more vectors than the file can hold; a truncated file; a row of the
            wrong length or with a value that is not a number; a word that is
            not UTF-8; or more rows than the header says. The message names the
            line (text) or the vector and byte (binary).
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory.
    """
    name = check_readable_file(path, "word2vec file")
    with open(name, "rb") as f:
        header = f.readline()
        count, dim = _header(header, name, os.fstat(f.fileno()).st_size - len(header), binary)
        read_row = _binary_row if binary else _text_row
        words, vectors = [], np.empty((count, dim), dtype=np.float32)
        for i in range(count):
            word, vectors[i] = read_row(f, name, i, count, dim)
            words.append(word)
        _check_end(f, name, count, binary)
    return words, vectors
