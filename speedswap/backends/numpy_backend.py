"""The CPU backend: tables are numpy arrays, the "device" is the CPU.

This is the backend CI runs. Storage kinds that need a GPU (``pinned``,
``mapped``, ``device``) are ordinary host memory here, because there is no
device to pin for; :attr:`Buffer.pinned` says so.
"""

import numpy as np
import torch

from .base import Backend, Buffer

__all__ = ["NumpyBackend"]


class NumpyBackend(Backend):
    """Rows in host memory, moved with torch's multi-threaded CPU kernels."""

    name = "numpy"
    device = torch.device("cpu")

    @classmethod
    def is_available(cls):
        return True

    def allocate(self, shape, dtype, kind):
        array = np.empty(shape, dtype=dtype)
        return Buffer(kind=kind, host=array, tensor=torch.from_numpy(array))

    def adopt(self, array, kind):
        return Buffer(kind=kind, host=array, tensor=torch.from_numpy(array))

    def gather(self, buffer, rows, out):
        # index_select into a preallocated output: one parallel pass, no temporary.
        return torch.index_select(buffer.tensor, 0, rows, out=out)

    def scatter(self, buffer, rows, values):
        buffer.tensor.index_copy_(0, rows, values)
