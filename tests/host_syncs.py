"""Count the calls speedswap makes that would make a GPU's host wait: a model that runs on the CPU.

On CUDA a call whose result the host needs (a value, as ``.item()`` and
``.tolist()``; or a size, as ``nonzero``, ``unique`` and indexing with a
boolean mask) waits for every kernel queued before it, and the work queued
after it cannot overlap what came before. So do ``isin`` (even told its
inputs are unique) and assigning a Python number through a tensor index
(``t[index] = 1.0``: torch copies the number to the GPU with a host wait;
``t.index_fill_(0, index, 1.0)`` does not). Those calls look the same on the
CPU, so counting them there shows where a GPU step would stall, in CI.
So does ``Backend.wait_host``, a table's wait for its kernels (an event's
synchronize on a GPU, which torch's sync debug mode does not report): the
model counts the numpy backend's calls of it, as ``file:line wait_host``.

It is a model: it knows the calls listed below. Copies between devices are
left out, because on the numpy backend every tensor is on the CPU and a
copy that crosses to a GPU's host there cannot be told from one that does
not; so is ``numpy()``, which raises on a CUDA tensor rather than stalling
(the numpy backend's CPU-only branches use it). The gpu test of the same run counts
torch's own sync warnings (``torch.cuda.set_sync_debug_mode``) instead.
"""

import collections
import numbers
import os
import traceback

import torch
from torch.overrides import TorchFunctionMode

import speedswap
from speedswap.backends.base import Backend

#: Calls that always need a value or a size from the device.
_SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
            "argwhere", "unique", "unique_consecutive", "masked_select", "bincount", "isin"}
_PACKAGE = os.path.dirname(speedswap.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _tensor_index(args):
    """The tensors a __getitem__/__setitem__ call indexes with."""
    if len(args) < 2:
        return []
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return [i for i in index if isinstance(i, torch.Tensor)]


def _syncs(name, args, kwargs):
    if name in _SYNCING:
        return True
    if name in ("__getitem__", "__setitem__"):
        index = _tensor_index(args)
        if any(i.dtype is torch.bool for i in index):  # sized by the mask's True count
            return True
        # A number assigned through a tensor index reaches the GPU with a host wait.
        return name == "__setitem__" and bool(index) and isinstance(args[2], numbers.Number)
    if name == "repeat_interleave":  # sized by its repeats' sum unless told
        return "output_size" not in kwargs
    return False


class HostSyncs(TorchFunctionMode):
    """Counts, by ``file:line`` of speedswap's calling line, the calls above made by speedswap's code.

    Calls torch makes for itself (an optimizer's own ``.item()`` of its CPU
    step count) and the test's own calls are not counted.

    >>> with HostSyncs() as syncs:          # doctest: +SKIP
    ...     emb(ids)
    >>> syncs.total, syncs.where            # doctest: +SKIP
    """

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def __enter__(self):
        # A table's wait for its kernels is no torch call this mode sees: count it where it is made.
        self._wait_host = Backend.wait_host

        def wait_host(backend, buffer):
            caller = self._caller()
            if caller is not None:
                self.where[f"{caller} wait_host"] += 1
            return self._wait_host(backend, buffer)

        Backend.wait_host = wait_host
        return super().__enter__()

    def __exit__(self, *exc):
        Backend.wait_host = self._wait_host
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(getattr(func, "__name__", ""), args, kwargs):
            caller = self._caller()
            if caller is not None:
                self.where[caller] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _caller():
        """speedswap's line that made the call, or None when the innermost caller outside torch is not speedswap."""
        for frame in reversed(traceback.extract_stack()[:-2]):
            if frame.filename.startswith(_TORCH) or frame.filename == __file__:
                continue
            if frame.filename.startswith(_PACKAGE):
                return f"{frame.filename[len(_PACKAGE):]}:{frame.lineno}"
            return None
        return None
