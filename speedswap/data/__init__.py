"""Data: .npy datasets as device batches (DataGadget, BatchFeeder, epoch orders, read-ahead, create_npy).

Built on :class:`~speedswap.HostTable`; independent of the training layer.
"""

from .create import create_npy
from .feeder import BatchFeeder
from .gadget import DataGadget

__all__ = ["BatchFeeder", "DataGadget", "create_npy"]
