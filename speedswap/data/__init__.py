"""Data: .npy datasets as device batches (DataGadget, BatchFeeder, epoch orders, read-ahead).

Built on :class:`~speedswap.HostTable`; independent of the training layer.
"""

from .feeder import BatchFeeder
from .gadget import DataGadget

__all__ = ["BatchFeeder", "DataGadget"]
