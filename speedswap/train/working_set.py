"""The working set: which table rows occupy which slots of a step's device parameter.

A step touches a handful of rows of a large table. The device parameter that
the model trains holds each of those rows exactly once, in "slots" ``0..k-1``;
the model is fed *local* ids (slot numbers) instead of table ids. Holding a row
once is what makes repeated ids behave as in ``nn.Embedding``: autograd sums
their gradients into the one slot, the optimizer updates the row once, and the
row is written back once (SpeedTorch gave each occurrence its own slot, so all
but the last update of a repeated row were lost).

>>> import torch
>>> ws = WorkingSet(capacity=4, num_rows=100, device="cpu")
>>> local, first_new = ws.add(torch.tensor([[42, 7], [42, 99]]))
>>> local.tolist(), ws.rows.tolist(), first_new
([[1, 0], [1, 2]], [7, 42, 99], 0)
>>> local, first_new = ws.add(torch.tensor([99, 5]))
>>> local.tolist(), ws.rows.tolist(), first_new
([2, 3], [7, 42, 99, 5], 3)

The switchers of one parameter (its ModelFactory and OptimizerFactory) share
one :class:`SharedSteps`, found by the parameter's identity, so the ids of a
step are de-duplicated once and ``after_step`` can check it got the same ids.
"""

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..convert import as_row_ids
from ..errors import CapacityError, OptionError, StateError

__all__ = ["WorkingSet", "SharedSteps", "steps_for"]


class WorkingSet:
    """Assigns each distinct table row touched in a step one slot of a capacity-row buffer.

    Args:
        capacity: the number of slots (rows of the device parameter): the
            most distinct rows one step may touch.
        num_rows: rows of the full table; ids must lie in ``[0, num_rows)``.
        device: the device of the parameter (local ids are returned there).
    """

    def __init__(self, capacity, num_rows, device):
        self.capacity = int(capacity)
        self.num_rows = int(num_rows)
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

    def add(self, ids):
        """Give every id a slot (reusing the slot of a row already held) and return local ids.

        Nothing changes when this raises.

        Args:
            ids: table ids of any shape (numpy, list, or tensor); duplicates allowed.

        Returns:
            (local, first_new): ``local`` is an int64 tensor shaped like ``ids``
            on :attr:`device` holding each id's slot; the rows that were not
            held before occupy slots ``first_new..size-1`` (in :attr:`rows`),
            and the caller must fill exactly those.

        Raises:
            IdError, DTypeError, DeviceError: bad ids.
            CapacityError: the step would touch more distinct rows than :attr:`capacity`.
        """
        flat, shape = as_row_ids(ids, self.num_rows, self.device)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        held = self.size
        if held == 0:
            new_rows, slots = unique, torch.arange(len(unique), device=self.device)
        else:
            # Both lists are sorted, so one binary search per new id finds the held ones.
            pos = torch.searchsorted(self._sorted, unique).clamp_(max=held - 1)
            found = self._sorted[pos] == unique
            new_rows = unique[~found]
            slots = torch.empty_like(unique)
            slots[found] = self._slot_of_sorted[pos[found]]
            slots[~found] = torch.arange(held, held + len(new_rows), device=self.device)
        if held + len(new_rows) > self.capacity:
            raise CapacityError(
                f"this step touches {held + len(new_rows)} distinct rows but the working set "
                f"holds at most {self.capacity} (the capacity: rows of the device parameter); "
                f"use smaller batches or a larger capacity (more rows in the model's "
                f"nn.Embedding, or a larger max_rows)")
        self._rows = torch.cat([self._rows, new_rows]) if held else new_rows
        self._sorted, self._slot_of_sorted = (torch.sort(self._rows) if held
                                              else (new_rows, slots))
        return slots[inverse].view(shape), held


class _Step:
    """The ids one ``before_forward`` saw and the slots they were given."""

    def __init__(self, flats, shapes, locals_, rows):
        self.flats = flats
        self.shapes = shapes
        self.locals = locals_
        self.rows = rows

    def same_ids(self, flats):
        return len(flats) == len(self.flats) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(flats, self.flats))


class SharedSteps:
    """The step in progress for one parameter, shared by its ModelFactory and OptimizerFactory.

    Whichever switcher's ``before_forward`` runs first de-duplicates the ids;
    the other finds the same ids and reuses the slots.
    """

    def __init__(self, param, num_rows):
        self.param = param
        self.working_set = WorkingSet(param.shape[0], num_rows, param.device)
        self.current = None

    def validate(self, pos, neg):
        ids = (pos,) if neg is None else (pos, neg)
        names = ("pos ids", "neg ids")
        checked = [as_row_ids(i, self.working_set.num_rows, self.param.device, what=n)
                   for i, n in zip(ids, names)]
        return [flat for flat, _ in checked], [shape for _, shape in checked]

    def prepare(self, pos, neg):
        """The step for these ids: the current one when they are the same, else a new one.

        Nothing is committed (see :meth:`commit`), so a later check can still refuse.
        """
        flats, shapes = self.validate(pos, neg)
        if self.current is not None and self.current.same_ids(flats):
            return self.current
        ws = self.working_set
        ws.clear()
        local, _ = ws.add(torch.cat(flats) if len(flats) > 1 else flats[0])
        pieces = torch.split(local, [len(f) for f in flats])
        locals_ = tuple(p.view(s) for p, s in zip(pieces, shapes))
        return _Step(flats, shapes, locals_, ws.rows)

    def commit(self, step):
        """Make ``step`` (from :meth:`prepare`) the step in progress."""
        self.current = step

    def match(self, pos, neg, who):
        """The current step, which must have been started with exactly these ids."""
        flats, _ = self.validate(pos, neg)
        if self.current is None or not self.current.same_ids(flats):
            raise StateError(f"{who}.after_step got ids other than those of the last "
                             f"before_forward; pass the same pos (and neg) ids to both, in the "
                             f"same order (nothing was written back)")
        return self.current


_STEPS = WeakIdKeyDictionary()


def steps_for(param, num_rows):
    """The :class:`SharedSteps` of ``param`` (created on first use), found by identity.

    Raises:
        OptionError: another switcher of ``param`` was built for another table size.
    """
    steps = _STEPS.get(param)
    if steps is None:
        steps = _STEPS[param] = SharedSteps(param, num_rows)
    elif steps.working_set.num_rows != num_rows:
        raise OptionError(f"this parameter already has a switcher over {steps.working_set.num_rows}"
                          f" rows; every switcher of one parameter needs the same total_classes")
    return steps
