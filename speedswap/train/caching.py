"""Owning a :class:`~speedswap.train.cache.RowCache`: what OffloadedEmbedding and the switchers share.

A cache's copy of a row (and of its optimizer state) is the authoritative
one, so its owner keeps three rules around every call that handles the host
tables as a whole:

* reading them (``save``, a numpy copy): :meth:`RowCache.flush` first;
* replacing rows or state in them (``load``, an initialiser): :func:`rewriting`,
  which flushes before (cached rows the call leaves alone keep their values)
  and invalidates after (cached rows it replaced are stale); between steps only;
* resetting the optimizer state alone (``init_state``): :func:`resetting_state`,
  which flushes before and reads the cached rows' state again after, keeping
  every row in its slot, so it may run between a forward and its step (the
  advice of a step refused for missing optimizer state);
* replacing the tables the cache serves (a new optimizer): flush the old
  cache while its tables are open, then :func:`new_cache`.
"""

import contextlib

import torch

from ..live import track_cache
from ..table import HostTable
from .cache import COUNTERS, EVAL_COUNTERS, RowCache

__all__ = ["new_cache", "rewriting", "resetting_state", "idle_stats"]


def new_cache(num_slots: int, table: HostTable, state_tables: dict,
              state_dtype: torch.dtype) -> RowCache:
    """A :class:`RowCache` over these tables, counted by :func:`speedswap.info`.

    Args:
        num_slots: rows it holds (0: it only moves and counts rows).
        table: the rows' table.
        state_tables: the optimizer's per-row state tables, ``{name: HostTable}``.
        state_dtype: the dtype of the optimizer state.

    Returns:
        the new cache, empty.
    """
    cache = RowCache(num_slots, table, state_tables, state_dtype)
    track_cache(cache)
    return cache


@contextlib.contextmanager
def _flushed_around(cache, after):
    """Flush ``cache`` (None: no cache), run the block, then ``after(cache)`` even if it raised."""
    if cache is None:
        yield
        return
    cache.flush()
    try:
        yield
    finally:
        after(cache)


def rewriting(cache):
    """Bracket a call that replaces rows or state in the host tables of ``cache`` (None: no cache).

    Call it between steps only: invalidating drops the slots a step in
    progress would write its rows to. It invalidates even when the call
    raises, which costs hits but never a row.
    """
    return _flushed_around(cache, RowCache.invalidate)


def resetting_state(cache):
    """Bracket a call that resets the optimizer state tables of ``cache`` (None: no cache).

    Unlike :func:`rewriting` it keeps the cached rows in their slots, so it is
    safe with a step's rows in flight.
    """
    return _flushed_around(cache, RowCache.reload_state)


def idle_stats(cache_rows: int) -> dict:
    """What ``stats()`` reports before a cache exists: every counter zero."""
    zeros = dict.fromkeys(COUNTERS, 0)
    return {"last_step": zeros, "total": dict(zeros), "eval": dict.fromkeys(EVAL_COUNTERS, 0),
            "cache_rows": cache_rows, "cache_bytes": 0}
