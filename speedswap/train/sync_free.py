"""Indexing that never asks a GPU how big its result is.

On CUDA, ``tensor[mask]``, ``mask.nonzero()`` and ``torch.unique`` copy a
count to the host before they can allocate their result: the host waits for
every kernel queued before them (a host synchronisation), and work queued
after cannot overlap it. Where the caller already knows the count, or can
learn it in a transfer it makes anyway, these functions work without it
(``torch.nonzero_static``: on CUDA since torch 2.6, which is why speedswap
needs it).
"""

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["positions", "find_sorted", "Sorted", "sort_with_order", "sort_marking_firsts", "reads_are_free"]

_TORCH_SORTS_FASTER_UP_TO = 4096  # ids; see sort_with_order


def _numpy_shortcut(tensor: torch.Tensor) -> bool:
    """Whether to take the CPU's numpy shortcut for ``tensor`` (on the CPU, where nothing waits).

    The one switch of every shortcut here: the tests (and op counts) replace
    it with one that says no, to run on the CPU the branches a GPU runs.
    """
    return tensor.is_cpu


def reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values on the host makes no wait (on the CPU), for callers that
    take a shortcut of their own there; the tests switch it off with the numpy shortcuts."""
    return _numpy_shortcut(tensor)


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the True entries of a 1-D ``mask``, in order, given that there are ``count``.

    Args:
        mask: a 1-D bool tensor.
        count: how many of its entries are True (learnt in a synchronisation
            the caller needed anyway); a wrong count gives wrong positions.

    Returns:
        a ``(count,)`` int64 tensor on the mask's device.
    """
    if _numpy_shortcut(mask):
        # Nothing waits on the CPU, and numpy is 4-12x faster than nonzero_static there
        # (49,152 entries: 31 us against 387).
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    if count == 0:  # and an empty mask, which crashes nonzero_static on CUDA before torch 2.9
        return torch.empty(0, dtype=torch.int64, device=mask.device)
    return torch.nonzero_static(mask, size=count).squeeze(1)


def find_sorted(values: torch.Tensor, keys: torch.Tensor):
    """Where each of ``keys`` is in the ascending, non-empty 1-D ``values``, and whether it is there.

    A binary search per key, with no host wait: the working set's and the
    device cache's lookup.

    Args:
        values: ascending 1-D integer tensor, not empty.
        keys: 1-D tensor of the same dtype and device; any order, duplicates allowed.

    Returns:
        (position, found): int64 positions into ``values`` (clamped to its
        last index; meaningful where found) and a bool mask, each shaped like
        ``keys``.
    """
    # Searched among all values but the last, a key past them all lands on the last index:
    # the position is clamped without a kernel of its own.
    if _numpy_shortcut(values):
        # numpy's search is 1.3-1.5x torch's on the CPU (28,672 sorted Zipf ids into
        # 50,000 rows: 389 us against 556 for the whole lookup, best of 200).
        table, wanted = values.numpy(), keys.numpy()
        position = table[:-1].searchsorted(wanted)  # the method: np.searchsorted adds a Python wrapper
        return torch.from_numpy(position), torch.from_numpy(table[position] == wanted)
    position = torch.searchsorted(values[:-1], keys)
    return position, values.index_select(0, position) == keys


class Sorted(NamedTuple):
    """Ids in ascending order, with what ``torch.unique`` would have needed the host for.

    Attributes:
        values: the ids, sorted (duplicates kept).
        order: where each came from: ``values == ids[order]``.
        first: True where ``values[i]`` is the first of its run, i.e. one
            entry per distinct id; ``first.sum()`` is the distinct count,
            left on the device.
    """

    values: torch.Tensor
    order: torch.Tensor
    first: torch.Tensor


def sort_with_order(ids: torch.Tensor, *, merging: bool = False):
    """``torch.sort(ids)`` for 1-D int64 ``ids``: (sorted values, order), with ``values == ids[order]``.

    ``merging``: ``ids`` are a few sorted runs one after the other, which a
    stable sort (numpy's timsort) merges: 49 us for 27,000 ids in two runs
    where its sort takes 400.

    On the CPU, numpy sorts a large array 2.0-2.5x faster than torch (8,192 Zipf
    ids: 139 us against 278; 28,672: 477 against 1,184), where torch switches
    to a slower algorithm, and torch is faster for a small one (4,096: 50 us
    against 94 with the indexing).
    """
    if _numpy_shortcut(ids) and len(ids) > _TORCH_SORTS_FASTER_UP_TO:
        order = torch.from_numpy(np.argsort(ids.numpy(), kind="stable" if merging else None))
        return ids.index_select(0, order), order
    return torch.sort(ids, stable=merging)


def sort_marking_firsts(ids: torch.Tensor) -> Sorted:
    """Sort non-empty 1-D int64 ``ids`` and mark each distinct id's first entry, with no host wait.

    What ``torch.unique(ids, sorted=True, return_inverse=True)`` gives, minus
    the one thing that needs the host: the distinct count, which sizes its
    result. A caller reads that count (a ``first.sum()``, or a cumulative sum's
    last entry) together with the other values it needs from the device, in
    one transfer, and indexes with :func:`positions`.

    Args:
        ids: a non-empty 1-D int64 tensor.

    Returns:
        Sorted
    """
    values, order = sort_with_order(ids)
    first = torch.ones(len(values), dtype=torch.bool, device=values.device)
    torch.ne(values[1:], values[:-1], out=first[1:])
    return Sorted(values, order, first)
