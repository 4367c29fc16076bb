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
>>> local, first_new, _ = ws.add(torch.tensor([[42, 7], [42, 99]]))
>>> local.tolist(), ws.rows.tolist(), first_new
([[1, 0], [1, 2]], [7, 42, 99], 0)
>>> local, first_new, _ = ws.add(torch.tensor([99, 5]))
>>> local.tolist(), ws.rows.tolist(), first_new
([2, 3], [7, 42, 99, 5], 3)

"""

from typing import Callable, List, NamedTuple, Optional

import torch

from ..errors import CapacityError, StateError
from .sync_free import find_sorted, positions, sort_marking_firsts, sort_with_order

__all__ = ["WorkingSet", "Added"]


class Added(NamedTuple):
    """What :meth:`WorkingSet.add` returns.

    Attributes:
        local: each id's slot, an int64 tensor shaped like the ids.
        first_new: the slot of the first row the call added; the rows it
            added occupy slots ``first_new..size-1``.
        counts: the values of ``count_also``'s counts, read with the call's
            own; None when the call read nothing (no ids) or had none.
    """

    local: torch.Tensor
    first_new: int
    counts: Optional[List[int]]


class WorkingSet:
    """Assigns each distinct table row touched in a step one slot of a capacity-row buffer.

    Args:
        capacity: the number of slots (rows of the device parameter): the
            most distinct rows one step may touch.
        device: the device of the parameter (local ids are returned there).
        table: the table's name in a :class:`~speedswap.CapacityError`, so
            that a model of several tables says which one overflowed.
        larger: how to make the capacity larger, for the same error.
    """

    def __init__(self, capacity: int, device, table: str = "the table",
                 larger: str = "a larger capacity"):
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.table, self.larger = table, larger
        self.clear()

    def clear(self):
        """Forget every row: the next :meth:`add` starts a new step at slot 0."""
        self._rows = torch.empty(0, dtype=torch.int64, device=self.device)
        self._sorted = self._rows
        self._slot_of_sorted = self._rows
        self._added_at = self._rows

    @property
    def rows(self):
        """The table ids held, by slot: a 1-D int64 tensor of length :attr:`size`."""
        return self._rows

    @property
    def added_at(self) -> torch.Tensor:
        """Where the rows the last :meth:`add` added were in its ids, sorted (``count_also``'s ``ids_sorted``).

        For a ``count_also`` that computed something for every sorted id and
        needs it for the new rows alone (the device cache's lookup): these are
        the positions :meth:`add` took them from, found once for both.
        """
        return self._added_at

    @property
    def size(self):
        """How many slots are in use."""
        return self._rows.shape[0]  # not len(): torch's Tensor.__len__ is Python, 1.5 us a call

    def holds(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (a 1-D int64 tensor on :attr:`device`) have a slot: a bool mask, sync-free."""
        if not self.size:
            return torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        return self._find(ids)[1]

    def slots_of(self, ids: torch.Tensor):
        """Each of ``ids``' slot, and whether it has one: ``(slots, held)``, sync-free.

        Args:
            ids: table ids, a 1-D int64 tensor on :attr:`device`; the working set must not be empty.

        Returns:
            int64 slots (meaningful where held, a valid slot elsewhere) and a bool mask, each shaped like ``ids``.
        """
        position, held = self._find(ids)
        return self._slot_of_sorted.index_select(0, position), held

    def _find(self, ids):
        """(position in the sorted rows, found) of each id; the position is meaningful where found."""
        # The rows are kept sorted, so one binary search per id finds the held ones.
        return find_sorted(self._sorted, ids)

    def start_with(self, rows: torch.Tensor):
        """Begin a step holding ``rows`` in slots ``0..len(rows)-1`` (the padding row), with no read.

        Args:
            rows: distinct, validated ids in ascending order, a 1-D int64 tensor
                on :attr:`device`, at most :attr:`capacity` of them.

        Raises:
            StateError: the working set is not empty.
        """
        if self.size:
            raise StateError("start_with() begins a step: clear() the working set first")
        self._rows = self._sorted = rows
        self._slot_of_sorted = torch.arange(len(rows), device=self.device)
        self._added_at = torch.empty(0, dtype=torch.int64, device=self.device)  # no add has run

    def add(self, ids: torch.Tensor, check_bounds: Optional[Callable[[int, int], None]] = None,
            count_also: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
            refuse_new: Optional[Callable[[int], None]] = None) -> Added:
        """Give every id a slot (reusing the slot of a row already held) and return local ids.

        Nothing changes when this raises.

        Args:
            ids: table ids, an int64 tensor of any shape on :attr:`device`;
                duplicates allowed. Validated (see
                :func:`~speedswap.convert.as_row_ids`), or all but their range.
            check_bounds: for ids not range-checked yet (see
                :func:`~speedswap.convert.as_row_ids_deferred`): called with their
                smallest and largest value, read with the count of new rows this
                call reads anyway: on a GPU the call's one host wait.
            count_also: for a caller that needs counts about the new rows
                before it can use them (the device cache: how many it holds):
                called with the ids sorted and a bool mask with one True per
                new row, it returns a 1-D int64 tensor of counts, read in the
                same transfer (:attr:`Added.counts`).
            refuse_new: for a caller that may not take new rows now: called
                with their count, when there are any, before anything changes;
                it raises.

        Returns:
            Added: ``local``, an int64 tensor shaped like ``ids`` on
            :attr:`device` holding each id's slot; ``first_new``: the rows that
            were not held before occupy slots ``first_new..size-1`` (in
            :attr:`rows`), and the caller must fill exactly those; ``counts``.

        Raises:
            CapacityError: the step would touch more distinct rows than :attr:`capacity`.
            IdError: from ``check_bounds``.
        """
        shape, flat = ids.shape, ids.reshape(-1)
        held = self.size
        if not len(flat):
            self._added_at = torch.empty(0, dtype=torch.int64, device=self.device)
            return Added(torch.empty(shape, dtype=torch.int64, device=self.device), held, None)
        # Sorted, not torch.unique: its distinct count would be a host wait of its own (on a
        # GPU), where the count of new rows is read below with the bounds anyway.
        ids_sorted, order, first = sort_marking_firsts(flat)
        if held:
            pos, found = self._find(ids_sorted)
            new = first > found  # first and not found, as bools: one kernel, where & ~ is two
        else:
            new = first
        # A new id's slot: held + (the new ids up to it) - 1, the same for each of its copies.
        new_before = torch.cumsum(new, 0)
        # Sorted: the ids' bounds are its ends. Until they are checked the ids only meet
        # other ids here, never a row.
        read = [new_before[-1:]]
        if check_bounds is not None:
            read += [ids_sorted[:1], ids_sorted[-1:]]
        if count_also is not None:
            read.append(count_also(ids_sorted, new))
        # The call's one host synchronisation: how many rows are new, the bounds, the counts.
        n_new, *values = torch.cat(read).tolist()
        if check_bounds is not None:
            check_bounds(*values[:2])
            values = values[2:]
        if refuse_new is not None and n_new:
            refuse_new(n_new)
        if held + n_new > self.capacity:
            raise CapacityError(
                f"this step touches {held + n_new} distinct rows of {self.table} but its "
                f"working set holds at most {self.capacity}; use smaller batches or "
                f"{self.larger}. Training forwards accumulate into one "
                f"step until optimizer.step(), so several forwards before a step add up, and so "
                f"do those of a step skipped before its backward (discard_step() drops them)")
        self._added_at = positions(new, n_new)
        new_rows = ids_sorted.index_select(0, self._added_at)
        slots = new_before.add_(held - 1)
        if held:
            slots = torch.where(found, self._slot_of_sorted.index_select(0, pos), slots)
        local = torch.empty_like(slots).scatter_(0, order, slots)
        if not held:
            self._rows = self._sorted = new_rows
            self._slot_of_sorted = torch.arange(n_new, device=self.device)
        elif n_new:
            # The rows by slot are sorted runs, one per add, which a merging sort merges; where
            # each sorted row came from is its slot (no slots to sort along: four kernels fewer).
            self._rows = torch.cat([self._rows, new_rows])
            self._sorted, self._slot_of_sorted = sort_with_order(self._rows, merging=True)
        return Added(local.view(shape), held, values if count_also is not None else None)
