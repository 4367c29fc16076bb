"""The working set: which table rows occupy which slots of a step's device parameter.

A step touches a handful of rows of a large table. The device parameter that
the model trains holds each of those rows exactly once, in "slots" ``0..k-1``;
the model is fed *local* ids (slot numbers) instead of table ids. Holding a row
once is what makes repeated ids behave as in ``nn.Embedding``: autograd sums
their gradients into the one slot, the optimizer updates the row once, and the
row is written back once (SpeedTorch gave each occurrence its own slot, so all
but the last update of a repeated row were lost).

>>> import torch
>>> ws = WorkingSet(capacity=4, device="cpu")
>>> local, first_new = ws.add(torch.tensor([[42, 7], [42, 99]]))
>>> local.tolist(), ws.rows.tolist(), first_new
([[1, 0], [1, 2]], [7, 42, 99], 0)
>>> local, first_new = ws.add(torch.tensor([99, 5]))
>>> local.tolist(), ws.rows.tolist(), first_new
([2, 3], [7, 42, 99, 5], 3)

"""

from typing import Callable, Optional

import torch

from ..errors import CapacityError
from .sync_free import positions

__all__ = ["WorkingSet"]


class WorkingSet:
    """Assigns each distinct table row touched in a step one slot of a capacity-row buffer.

    Args:
        capacity: the number of slots (rows of the device parameter): the
            most distinct rows one step may touch.
        device: the device of the parameter (local ids are returned there).
    """

    def __init__(self, capacity: int, device):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.clear()

    def clear(self):
        """Forget every row: the next :meth:`add` starts a new step at slot 0."""
        self._rows = torch.empty(0, dtype=torch.int64, device=self.device)
        self._sorted = self._rows
        self._slot_of_sorted = self._rows

    @property
    def rows(self):
        """The table ids held, by slot: a 1-D int64 tensor of length :attr:`size`."""
        return self._rows

    @property
    def size(self):
        """How many slots are in use."""
        return len(self._rows)

    def holds(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (a 1-D int64 tensor on :attr:`device`) have a slot: a bool mask, sync-free."""
        if not self.size:
            return torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        return self._find(ids)[1]

    def _find(self, ids):
        """(position in the sorted rows, found) of each id; the position is meaningful where found."""
        # The rows are kept sorted, so one binary search per id finds the held ones.
        pos = torch.searchsorted(self._sorted, ids).clamp_(max=self.size - 1)
        return pos, self._sorted[pos] == ids

    def add(self, ids: torch.Tensor, check_bounds: Optional[Callable[[int, int], None]] = None):
        """Give every id a slot (reusing the slot of a row already held) and return local ids.

        Nothing changes when this raises.

        Args:
            ids: table ids, an int64 tensor of any shape on :attr:`device`;
                duplicates allowed. Validated (see
                :func:`~speedswap.convert.as_row_ids`), or all but their range.
            check_bounds: for ids not range-checked yet (see
                :func:`~speedswap.convert.as_row_ids_deferred`): called with their
                smallest and largest value, read with the count this call reads
                anyway (on a GPU one host wait instead of two).

        Returns:
            (local, first_new): ``local`` is an int64 tensor shaped like ``ids``
            on :attr:`device` holding each id's slot; the rows that were not
            held before occupy slots ``first_new..size-1`` (in :attr:`rows`),
            and the caller must fill exactly those.

        Raises:
            CapacityError: the step would touch more distinct rows than :attr:`capacity`.
            IdError: from ``check_bounds``.
        """
        shape, flat = ids.shape, ids.reshape(-1)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        # Sorted: the ids' bounds are the ends of unique, read with the count below. Until
        # they are checked the ids only meet other ids here, never a row.
        bounds = [unique[0], unique[-1]] if check_bounds is not None and len(unique) else []
        held = self.size
        if held == 0:
            if bounds:
                check_bounds(*torch.stack(bounds).tolist())
            new_rows, slots = unique, torch.arange(len(unique), device=self.device)
        else:
            pos, found = self._find(unique)
            new = ~found
            # One host synchronisation sizes the new rows (the capacity check needs it too).
            n_new, *bounds = torch.stack([new.sum(), *bounds]).tolist()
            if bounds:
                check_bounds(*bounds)
            new_rows = unique[positions(new, n_new)]
            # New rows take the next slots in order: the k-th new row slot held + k - 1.
            slots = torch.where(found, self._slot_of_sorted[pos], held - 1 + torch.cumsum(new, 0))
        if held + len(new_rows) > self.capacity:
            raise CapacityError(
                f"this step touches {held + len(new_rows)} distinct rows but the working set "
                f"holds at most {self.capacity} (the capacity: rows of the device parameter); "
                f"use smaller batches or a larger capacity (more rows in the model's "
                f"nn.Embedding, or a larger max_rows). Training forwards accumulate into one "
                f"step until optimizer.step(), so several forwards before a step add up, and so "
                f"do those of a step skipped before its backward (discard_step() drops them)")
        self._rows = torch.cat([self._rows, new_rows]) if held else new_rows
        self._sorted, self._slot_of_sorted = (torch.sort(self._rows) if held
                                              else (new_rows, slots))
        return slots[inverse].view(shape), held
