"""argparse ``type=`` checks of numbers and directories, shared by the command lines (``python -m speedswap``, the examples, the benchmarks).

Each turns a bad value into argparse's own one-line error (exit status 2)
before anything runs, saying what was expected: a 0 or a negative count
would otherwise end a run in a raw traceback after its set-up (a median of
no samples, a division by zero steps), and a seed numpy refuses only after
a corpus was built with it.
"""

import argparse
import math
import os

__all__ = ["positive_int", "nonnegative_int", "positive_float", "nonnegative_float", "share", "seed",
           "SEED_LIMIT", "table_directory"]


def _number(text: str, kind, accept, expected: str):
    """``kind(text)`` if ``accept`` takes it, else argparse's one-line error saying what was ``expected``."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {expected}") from None
    if not accept(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count or size: an integer >= 1."""
    return _number(text, int, lambda n: n >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse ``type=`` for an integer >= 0."""
    return _number(text, int, lambda n: n >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse ``type=`` for a rate or a limit: a finite number > 0 (not NaN, not inf)."""
    return _number(text, float, lambda x: 0 < x < math.inf, "a finite number > 0")


def nonnegative_float(text: str) -> float:
    """argparse ``type=`` for a penalty or a noise level: a finite number >= 0 (not NaN, not inf)."""
    return _number(text, float, lambda x: 0 <= x < math.inf, "a finite number >= 0")


def share(text: str) -> float:
    """argparse ``type=`` for a share of the rows: a number strictly between 0 and 1."""
    return _number(text, float, lambda x: 0 < x < 1, "a share strictly between 0 and 1")


#: Seeds are below 2**32: numpy, torch and speedswap's word2vec all take them.
SEED_LIMIT = 2 ** 32


def seed(text: str) -> int:
    """argparse ``type=`` for ``--seed``: an integer in [0, 2**32)."""
    return _number(text, int, lambda n: 0 <= n < SEED_LIMIT, "a seed: an integer from 0 to 2**32 - 1")


def table_directory(text: str) -> str:
    """argparse ``type=`` for ``--table-dir``: a new or empty directory for ``storage="mmap"``'s table files."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a directory for the table files")
    if os.path.isdir(text) and os.listdir(text):
        # The run makes its tables afresh and never replaces files: a second run into the
        # same directory would stop at the first table file, after building the corpus.
        raise argparse.ArgumentTypeError(f"{text!r} is not empty; give a new or empty directory (the "
                                         f"run writes fresh table files), or remove what is in it")
    return text
