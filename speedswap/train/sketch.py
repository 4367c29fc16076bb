"""How often rows were used lately: a count-min sketch of fixed size on the device.

:class:`~speedswap.train.cache.RowCache` ranks rows by this count to decide
which rows stay cached. A count-min sketch (Cormode and Muthukrishnan) keeps
``depth`` rows of ``width`` counters; a table row adds to one counter per
sketch row, chosen by a hash, and its estimate is the smallest of those
counters. Collisions only ever add, so an estimate is never below the true
count, and with ``width`` a few times the number of rows that matter the
excess is small. Its size is fixed by the cache, not by the vocabulary.

Ageing: each step's use counts ``1 / decay`` times the previous step's, so
old popularity fades without touching every counter each step; when the
weight grows large the whole sketch is rescaled once (ranks are unchanged).

>>> import torch
>>> sketch = FrequencySketch(width=64, device="cpu")
>>> first = sketch.add(torch.tensor([3, 5])); rescaled_by = sketch.next_step()
>>> second = sketch.add(torch.tensor([3])); rescaled_by = sketch.next_step()
>>> counts = sketch.estimate(torch.tensor([3, 5, 7]))
>>> bool(counts[0] > counts[1] > counts[2]), float(counts[2])
(True, 0.0)
>>> bool(second[0] > first[0]) # add returns the counts including the use it adds
True
"""

import torch

__all__ = ["FrequencySketch"]

# Odd multipliers below 2**31: a 32-bit key times one stays below 2**63 (no int64 overflow).
_MULTIPLIERS = (0x6B43A9B5, 0x2C1B3C6D)
_RESCALE_AT = 1e30  # far below float32's 3.4e38, even summed over ~1 / (1 - decay) steps


class FrequencySketch:
    """Decayed per-row use counts in a ``(2, width)`` float32 tensor.

    Args:
        width: counters per sketch row, rounded up to a power of two.
        device: where the counters live (the cache's device).
        decay: the weight of the previous step's use relative to this one's, in (0, 1].
        wide_rows: whether row ids may reach ``2**32``: their high half is then
            folded into the low one before hashing (three more kernels a call).
    """

    def __init__(self, width: int, device, decay: float = 0.99, *, wide_rows: bool = True):
        self.bits = max(1, (int(width) - 1).bit_length())
        self.counts = torch.zeros(len(_MULTIPLIERS), 1 << self.bits, dtype=torch.float32,
                                  device=device)
        self.decay = float(decay)
        self.weight = 1.0  # what one use counts in the current step
        self._wide_rows = bool(wide_rows)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._multipliers = torch.tensor(_MULTIPLIERS, device=device).unsqueeze(1)
        # Each sketch row's first counter in the flattened counts (bits below are the column's).
        self._row_offsets = (torch.arange(len(_MULTIPLIERS), device=device) << self.bits).unsqueeze(1)

    @property
    def nbytes(self) -> int:
        """Device bytes of the counters."""
        return self.counts.numel() * self.counts.element_size()

    def _cells(self, rows: torch.Tensor) -> torch.Tensor:
        """``(depth, len(rows))`` indices of each row's counters in the flattened counts."""
        # Multiplicative hashing of the row's 32-bit fold: the top `bits` of the low 32 bits.
        key = (rows ^ (rows >> 32)) & 0xFFFFFFFF if self._wide_rows else rows  # narrow rows are their fold
        return ((key * self._multipliers) & 0xFFFFFFFF) >> (32 - self.bits) | self._row_offsets

    def add(self, rows: torch.Tensor) -> torch.Tensor:
        """Count one use of each of ``rows`` (int64, unique) in the current step.

        All or nothing: everything it allocates is allocated before the
        counters change, so a failure (out of memory) counts nothing.

        Returns:
            the rows' estimates including this use, as :meth:`estimate` would
            give them now (read while their counters are still in cache).
        """
        cells = self._cells(rows)
        taken = torch.empty(cells.shape, dtype=self.counts.dtype, device=self.counts.device)
        estimates = torch.empty(len(rows), dtype=self.counts.dtype, device=self.counts.device)
        self.counts.view(-1).index_add_(0, cells.view(-1), self._one.expand(cells.numel()),
                                        alpha=self.weight)
        return torch.amin(torch.take(self.counts, cells, out=taken), 0, out=estimates)

    def estimate(self, rows: torch.Tensor) -> torch.Tensor:
        """The decayed use count of each of ``rows`` (never below the true one), float32."""
        return torch.take(self.counts, self._cells(rows)).amin(0)

    def next_step(self) -> float:
        """Age every count by ``decay`` (by weighing the next step's uses more).

        Returns:
            what the counts were divided by to keep them in range (1.0 almost
            always): counts the caller keeps must be divided by it too.
        """
        self.weight /= self.decay
        divisor = 1.0
        if self.weight > _RESCALE_AT:
            divisor, self.weight = self.weight, 1.0
            self.counts.div_(divisor)
        return divisor
