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
"""

import functools
import threading
from typing import Callable, TypeVar

from ..errors import StateError

__all__ = ["OneThread", "one_thread"]

Method = TypeVar("Method", bound=Callable)


class OneThread:
    """Which thread is inside an object's calls or step, and how deep.

    Args:
        name: the object, as the error names it.
    """

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()  # makes the check and the claim one step
        self._thread, self._depth = None, 0

    def enter(self) -> None:
        """Claim the object for this thread (again, if it holds it already).

        Raises:
            StateError: another thread is inside a call or a step of it (nothing changes).
        """
        me = threading.get_ident()
        with self._lock:
            if self._thread not in (None, me):
                raise StateError(
                    f"{self._name} is in use on another thread (inside one of its calls, or between "
                    f"the hooks of an optimizer.step() of its rows). Its bookkeeping is not locked: use "
                    f"it from one thread at a time, e.g. hold one threading.Lock around the training "
                    f"step (forward, backward, optimizer.step()) and around each evaluation; a thread "
                    f"whose optimizer.step() raised holds it until its next call")
            self._thread, self._depth = me, self._depth + 1

    def exit(self) -> None:
        """Give back one :meth:`enter` of this thread."""
        with self._lock:
            self._depth -= 1
            if not self._depth:
                self._thread = None


def one_thread(method: Method) -> Method:
    """Run ``method`` holding its object's :class:`OneThread` (``self._one_thread``)."""
    @functools.wraps(method)
    def claimed(self, *args, **kwargs):
        guard = self._one_thread
        guard.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            guard.exit()
    return claimed
