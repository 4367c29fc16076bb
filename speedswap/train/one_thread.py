"""One thread at a time: a call that starts while another thread is inside a call or a step is refused.

``nn.Embedding``'s forward only reads its weight, so an evaluation thread may
look rows up while another trains (and read rows half updated). An offloaded
table's forwards change its bookkeeping: the working set, the parameter
narrowed to the step's rows between the optimizer's step hooks, the device
cache's slots and scratch rows. Nothing locks it, so a forward on a second
thread while a step runs would put the step's rows back under the optimizer
(the update lost, or a size mismatch inside the optimizer), and one while a
training forward runs could read the rows a cache evicts. Such a call raises
before anything changes; calls from several threads one after another work.

Besides its calls, an object holds the claim for a span of its state: an
:class:`~speedswap.OffloadedEmbedding` between the hooks of a step (one
without its rows too), the SpeedTorch-style switchers of one embedding from
``before_forward`` to the last ``after_step``, a
:class:`~speedswap.ShardedOffloadedEmbedding` from a training forward to the
step (see :meth:`OneThread.hold`). A GPU's autograd engine recomputes a
checkpointed lookup on a thread of its own for the thread that waits in
``backward()``: that call runs lent the waiting thread's claim
(:meth:`OneThread.lent`).
"""

import contextlib
import functools
import threading
from typing import Callable, TypeVar

from ..errors import StateError

__all__ = ["OneThread", "one_thread"]

Method = TypeVar("Method", bound=Callable)


class OneThread:
    """Which thread is inside an object's calls or span, and how deep.

    Args:
        name: the object, as the error names it.
        span: when, besides its calls, a thread holds it, as the error says it.
        step: what a training thread should hold a lock around, as the error says it.
        release: how a thread that stopped inside the span gives it back, as the error says it.
    """

    def __init__(self, name: str, span: str = "between the hooks of an optimizer.step()",
                 step: str = "the training step (forward, backward, optimizer.step())",
                 release: str = "a thread whose optimizer.step() raised holds it until its next call"):
        self._name, self._span, self._step, self._release = name, span, step, release
        self._lock = threading.Lock()  # makes the check and the claim one step
        self._thread, self._depth = None, 0
        self._holding = False  # whether hold() holds one of the depth's claims (see hold)
        self._lent = threading.local()  # .on: this thread runs lent the claim (see lent)

    def enter(self) -> None:
        """Claim the object for this thread (again, if it holds it already).

        Raises:
            StateError: another thread is inside a call or a span of it (nothing changes).
        """
        if getattr(self._lent, "on", False):
            return
        me = threading.get_ident()
        with self._lock:
            if self._thread not in (None, me):
                raise StateError(
                    f"{self._name} is in use on another thread (inside one of its calls, or {self._span}). "
                    f"Its bookkeeping is not locked: use it from one thread at a time, e.g. hold one "
                    f"threading.Lock around {self._step} and around each evaluation; {self._release}")
            self._thread, self._depth = me, self._depth + 1

    def exit(self) -> None:
        """Give back one :meth:`enter` of this thread."""
        if getattr(self._lent, "on", False):
            return
        with self._lock:
            self._depth -= 1
            if not self._depth:
                self._thread = None

    def hold(self, busy: bool) -> None:
        """Hold one claim for as long as the object is ``busy`` (inside a span, such as a step), none once not.

        Called, inside a call this thread claimed (so the claim cannot be
        refused), wherever a span may have begun or ended: the claim then
        follows the object's state, whichever path (the span's end, an error,
        a discard) led there.

        Args:
            busy: whether the object is inside a span now.
        """
        if getattr(self._lent, "on", False):
            return  # the span is the waiting thread's, which ends it
        if busy != self._holding:
            if busy:
                self.enter()
            else:
                self.exit()
            self._holding = busy

    @contextlib.contextmanager
    def lent(self):
        """Run the block on this thread for the thread that holds the claim, or would take it, and waits.

        For the autograd engine's thread of a device, which runs a backward
        (activation checkpointing's recompute of a lookup in it) while the
        thread that called ``backward()`` waits in it: the two never run at
        once. The block's calls take, hold and give back no claim: whatever
        the waiting thread holds stays its own, and a span the block begins
        is not claimed until that thread's next call.
        """
        self._lent.on = True
        try:
            yield
        finally:
            self._lent.on = False

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc) -> None:
        self.exit()


def one_thread(method: Method) -> Method:
    """Run ``method`` holding its object's :class:`OneThread` (``self._one_thread``)."""
    @functools.wraps(method)
    def claimed(self, *args, **kwargs):
        with self._one_thread:
            return method(self, *args, **kwargs)
    return claimed
