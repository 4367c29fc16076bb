"""Training: the working set, optimizer rows on the host, OffloadedEmbedding, row sharding, checkpoints.

Built on :class:`~speedswap.HostTable`; knows nothing of SpeedTorch's names
(those live in :mod:`speedswap.compat`) or of the data pipeline.
"""

from .embedding import OffloadedEmbedding
from .sharded import ShardedOffloadedEmbedding
from .sharded_checkpoint import load_sharded

__all__ = ["OffloadedEmbedding", "ShardedOffloadedEmbedding", "load_sharded"]
