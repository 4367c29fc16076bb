"""Which of a step's rows a backward reached, so that rows of a dropped forward are left alone.

A training loop that skips a step before its backward (a loss that was not
finite) drops that forward's graph, and in-memory lazy training
(``SparseAdam``, sparse Adagrad) never sees its rows. Offloaded, those rows
are already in the step's working set, and the next ``optimizer.step()``
would move them at a zero gradient: Adam moves a row that has momentum even
so. Each training forward's lookup therefore gets a hook that fires when a
backward computes the table's gradient through it (a backward that stops
at the lookup's output, ``torch.autograd.grad(loss, output)``, does not);
at the step, the slots that only unreached forwards looked up are put back
as they were before the optimizer ran (:class:`KeptRows`), so their rows
and optimizer state are written back unchanged.

Nothing is spent when every forward was reached, the usual case: the check
is a Python counter, and the slots are computed only when some forward was not.

The same hook refuses a backward through a forward whose step has already
ended (a graph kept with ``retain_graph=True`` across ``optimizer.step()``):
its slots hold other rows by then, so its gradient would train the wrong
rows, or be dropped. In memory that gradient would count at the next step;
offloaded, the forward must be run again.
"""

import functools
import weakref
from typing import Callable, Dict, Optional, Union

import torch

from ..errors import StateError

__all__ = ["ReachedRows", "KeptRows", "in_backward", "recomputed_on_engine_thread"]


class ReachedRows:
    """The slots each training forward of a step looked up, and whether a backward reached it."""

    def __init__(self, dropped: Optional[Callable[[], bool]] = None):
        """
        Args:
            dropped: asked when a backward reaches a forward, before the
                gradient accumulates: whether ``zero_grad()`` dropped the
                gradient earlier backwards of the step gave (it then clears
                what it must, once per backward). The forwards those
                backwards reached then count as unreached: the loop order
                forward, ``zero_grad()``, backward after a step skipped
                after its backward trains only the new forwards' rows, as
                in memory.
        """
        self._step = 0
        self._dropped = dropped
        self.clear()

    def clear(self) -> None:
        """Forget the step: the next forward starts a new one, and a backward through its forwards raises."""
        self._step += 1       # hooks of earlier steps' forwards tell by it that their step is over
        self._reached = {}    # forward number -> its slots, once a backward reached it (or a gradient by hand)
        self._unreached = {}  # forward number -> its slots, until a backward reaches its lookup
        self._count = 0

    def track(self, output: torch.Tensor, slots: torch.Tensor) -> None:
        """Watch a training forward's ``output``, which looked up ``slots``: reached when a
        backward computes the table's gradient from it.

        An output that needs no gradient (a frozen embedding) gets none and
        changes nothing at the step: there is nothing to watch.
        """
        if not output.requires_grad:
            return
        key, self._count = self._count, self._count + 1
        self._unreached[key] = slots
        # On the lookup's node, not on the output: a backward that computes the output's
        # gradient but not the table's (torch.autograd.grad(loss, output), to perturb the
        # rows) never runs the node, and in memory the rows would get no gradient.
        output.grad_fn.register_prehook(functools.partial(_reach, weakref.ref(self), self._step, key))

    def without_output(self, slots: torch.Tensor) -> None:
        """Record slots a training forward looked up but returned no output for (it failed on the way).

        Unreached, as the slots of a forward no backward reaches: put back at
        the step unless a backward reaches them through another forward.
        """
        key, self._count = self._count, self._count + 1
        self._unreached[key] = slots

    def forget_reached(self) -> None:
        """Count every forward so far as unreached: the gradient their backward gave was dropped.

        Each keeps its number, so a later backward through its graph (kept
        with ``retain_graph=True``) finds it and counts it reached again.
        """
        self._unreached.update(self._reached)
        self._reached = {}

    def reached(self, slots: torch.Tensor) -> None:
        """Record slots whose gradient the caller writes itself (no autograd to watch)."""
        key, self._count = self._count, self._count + 1
        self._reached[key] = slots

    def any_reached(self) -> bool:
        """Whether a backward reached some forward of the step (else the table has no gradient)."""
        return bool(self._reached)

    def unreached_slots(self, size: int, device) -> Optional[torch.Tensor]:
        """The slots in ``[0, size)`` that only forwards no backward reached looked up, or None if none.

        Synchronises a GPU's host once, only when some forward was not reached.
        """
        if not self._unreached:
            return None
        untouched = torch.ones(size, dtype=torch.bool, device=device)
        for slots in self._reached.values():
            # index_fill_, not untouched[slots] = False: a number through a tensor index is a
            # host-to-device copy the host waits for on a GPU, one per forward.
            untouched.index_fill_(0, slots.reshape(-1), False)
        found = untouched.nonzero().squeeze(1)
        return found if len(found) else None

    def looked_up(self, slot: int, device) -> torch.Tensor:
        """Whether a forward a backward reached looked up ``slot``: a 0-dim bool tensor on ``device``.

        Computed on the device, without synchronising a GPU's host: one compare
        and one reduction over every reached forward's slots together (a
        compare and a reduction per forward would be two kernels a lookup).
        """
        reached = [slots.reshape(-1) for slots in self._reached.values()]
        if not reached:
            return torch.zeros((), dtype=torch.bool, device=device)
        looked = reached[0] if len(reached) == 1 else torch.cat(reached)
        return (looked == slot).any()


def _reach(ref, step, key, grad_outputs):
    tracker = ref()
    if tracker is not None:
        if step != tracker._step:
            raise StateError("backward through an embedding forward whose optimizer step has already "
                             "run (or was discarded): its rows have left the working set, so this "
                             "gradient has no rows to train. Run the forward again for the next step "
                             "instead of keeping its graph (retain_graph=True) across optimizer.step()")
        if tracker._dropped is not None and tracker._dropped():
            tracker.forget_reached()
        slots = tracker._unreached.pop(key, None)
        if slots is not None:
            tracker._reached[key] = slots


def in_backward() -> bool:
    """Whether the autograd engine runs a backward on this thread.

    A training forward then is activation checkpointing's recompute, whose
    first run's rows are in the step already: it leaves to the backward
    (``ReachedRows``' ``dropped``, asked when the backward reaches a lookup)
    whether ``zero_grad()`` dropped the step, rather than drop the step, and
    those rows with it, itself.

    Returns:
        True inside a backward (``torch.autograd`` or a checkpoint's), else False.
    """
    return torch._C._current_graph_task_id() != -1


def recomputed_on_engine_thread(device: torch.device) -> bool:
    """Whether this is a forward inside a backward that the autograd engine may run on a thread of its own.

    It runs a backward on ``device`` on its thread for that device (CUDA),
    not on the thread that called ``backward()``, which waits in it: there a
    training forward is activation checkpointing's recompute for that thread.
    A CPU backward runs on the calling thread.
    """
    return in_backward() and device.type != "cpu"


class KeptRows:
    """Rows of a working set and their optimizer state, copied before a step to be put back after it.

    Args:
        slots: the slots to keep: a 1-D int64 tensor, or a ``slice`` of
            consecutive slots (the padding row's slot 0), which the copy and
            the put-back read and write as a view, without an index kernel.
        weight: the working set's full storage (rows by slot).
        state: the optimizer's per-row state for the step, ``{name: (k, dim)}``,
            or None when the optimizer creates it at the step (every row then
            starts from ``initial``).
        initial: ``{name: value}``, the value torch creates each row's state with.
        unless: a 0-dim bool tensor: where it is True the rows keep what the
            step made of them (decided on the device, so a GPU's host need not
            wait); None puts them back regardless.
    """

    def __init__(self, slots: Union[torch.Tensor, slice], weight: torch.Tensor,
                 state: Optional[Dict[str, torch.Tensor]], initial: Dict[str, float],
                 unless: Optional[torch.Tensor] = None):
        self.slots, self.initial, self.unless = slots, initial, unless
        self.rows = weight[slots].clone()
        self.state = None if state is None else {name: state[name][slots].clone() for name in initial}

    def put_back(self, weight: torch.Tensor, state: Optional[Dict[str, torch.Tensor]]) -> None:
        """Write the kept rows into ``weight`` and their state into the step's ``state``, as before it."""
        self._write(weight, self._after_step(weight, self.rows))
        if state is None:
            return  # torch skipped the parameter: its state did not change
        for name, value in self.initial.items():
            before = value if self.state is None else self.state[name]
            self._write(state[name], self._after_step(state[name], before))

    def _write(self, tensor: torch.Tensor, values) -> None:
        """``tensor[slots] = values``; a number through a tensor index is filled in, with no host wait."""
        if isinstance(values, torch.Tensor) or isinstance(self.slots, slice):
            tensor[self.slots] = values
        else:
            # tensor[slots] = 0.0 copies the number to a GPU, which the host waits for.
            tensor.index_fill_(0, self.slots, values)

    def _after_step(self, now: torch.Tensor, before) -> torch.Tensor:
        """What the slots hold after the step: ``before``, or what the step made of them if ``unless``."""
        if self.unless is None:
            return before
        # A float ``before`` stays a Python scalar: a tensor made of it on a GPU would be a
        # host-to-device copy the host waits for, at every first step of a state.
        return torch.where(self.unless, now[self.slots], before)
