"""Indexing that never asks a GPU how big its result is.

On CUDA, ``tensor[mask]`` and ``mask.nonzero()`` copy the mask's True count
to the host before they can allocate their result: the host waits for every
kernel queued before them (a host synchronisation), and work queued after
cannot overlap it. Where the caller already knows the count, these
functions take it instead (``torch.nonzero_static``: on CUDA since torch 2.6,
which is why speedswap needs it).
"""

import torch

__all__ = ["positions"]


def positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the True entries of a 1-D ``mask``, in order, given that there are ``count``.

    Args:
        mask: a 1-D bool tensor.
        count: how many of its entries are True (learnt in a synchronisation
            the caller needed anyway); a wrong count gives wrong positions.

    Returns:
        a ``(count,)`` int64 tensor on the mask's device.
    """
    if count == 0:  # and an empty mask, which crashes nonzero_static on CUDA before torch 2.9
        return torch.empty(0, dtype=torch.int64, device=mask.device)
    return torch.nonzero_static(mask, size=count).squeeze(1)
