"""Training: the working set, optimizer rows on the host, OffloadedEmbedding, checkpoints.

Built on :class:`~speedswap.HostTable`; knows nothing of SpeedTorch's names
(those live in :mod:`speedswap.compat`) or of the data pipeline.
"""

from .embedding import OffloadedEmbedding

__all__ = ["OffloadedEmbedding"]
