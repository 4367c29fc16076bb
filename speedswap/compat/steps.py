"""The step a ModelFactory and an OptimizerFactory of one parameter share.

SpeedTorch code calls ``before_forward(ids)`` on both switchers of an
embedding, then ``after_step(ids)`` on both. The ids of a step are checked and
de-duplicated once, by whichever switcher comes first; the other finds the
same ids and reuses the slots, and ``after_step`` only compares its ids with
the step's (no second range check: on a GPU each one is a host synchronisation).
"""

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..convert import as_id_tensor, check_id_range
from ..errors import OptionError, StateError
from ..train.working_set import WorkingSet

__all__ = ["SharedSteps", "steps_for", "register_steps"]

_NAMES = ("pos ids", "neg ids")


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
    """The step in progress for one parameter, shared by its switchers.

    Args:
        param: the model's embedding parameter (its rows are the working set).
        num_rows: rows of the full table.
    """

    def __init__(self, param: torch.nn.Parameter, num_rows: int):
        self.param = param
        self.num_rows = num_rows
        self.working_set = WorkingSet(param.shape[0], param.device)
        self.current = None

    def _as_tensors(self, pos, neg):
        ids = (pos,) if neg is None else (pos, neg)
        converted = [as_id_tensor(i, self.param.device, what=n) for i, n in zip(ids, _NAMES)]
        return [flat for flat, _ in converted], [shape for _, shape in converted]

    def _check_range(self, flats):
        try:
            check_id_range(torch.cat(flats) if len(flats) > 1 else flats[0], self.num_rows)
        except IndexError:
            for flat, name in zip(flats, _NAMES):  # only on failure: say which ids
                check_id_range(flat, self.num_rows, what=name)
            raise

    def prepare(self, pos, neg):
        """The step for these ids: the current one when they are the same, else a new one.

        The ids are range-checked once, when a new step starts. Nothing is
        committed (see :meth:`commit`), so a later check can still refuse.

        Raises:
            IdError, DTypeError, DeviceError: bad ids.
            CapacityError: more distinct rows than the parameter has.
        """
        flats, shapes = self._as_tensors(pos, neg)
        if self.current is not None and self.current.same_ids(flats):
            return self.current
        self._check_range(flats)
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
        """The current step, which must have been started with exactly these ids.

        Raises:
            StateError: other ids (nothing is written back).
        """
        flats, _ = self._as_tensors(pos, neg)
        if self.current is None or not self.current.same_ids(flats):
            raise StateError(f"{who}.after_step got ids other than those of the last "
                             f"before_forward; pass the same pos (and neg) ids to both, in the "
                             f"same order (nothing was written back)")
        return self.current


#: param -> weak reference to its SharedSteps: an entry lives as long as a
#: switcher of the parameter does, so dropping every switcher frees the size.
_STEPS = WeakIdKeyDictionary()


def steps_for(param: torch.nn.Parameter, num_rows: int) -> SharedSteps:
    """The :class:`SharedSteps` of ``param``, found by identity, or a new unregistered one.

    A new one is registered by :func:`register_steps` once its switcher is
    built, so a constructor that fails later leaves nothing behind.

    Raises:
        OptionError: a live switcher of ``param`` was built for another table size.
    """
    ref = _STEPS.get(param)
    steps = None if ref is None else ref()
    if steps is None:
        return SharedSteps(param, num_rows)
    if steps.num_rows != num_rows:
        raise OptionError(f"this parameter already has a switcher over {steps.num_rows}"
                          f" rows; every switcher of one parameter needs the same total_classes")
    return steps


def register_steps(steps: SharedSteps) -> None:
    """Make ``steps`` the shared step of its parameter (the last act of a switcher's constructor)."""
    _STEPS[steps.param] = weakref.ref(steps)
