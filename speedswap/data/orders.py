"""Epoch orders and sharding: which rows each rank reads, in which order.

An order turns ``(num_rows, seed, epoch)`` into a permutation of
``range(num_rows)``; :func:`shard` then splits it between ranks the way
``torch.utils.data.DistributedSampler`` does. Both are pure functions of
their arguments, which is what makes a :class:`~speedswap.BatchFeeder`
resumable: the rest of an epoch is recomputed, never stored.

>>> from speedswap.data.orders import BlockOrder, shard
>>> order = BlockOrder(block_rows=2, window=2)
>>> sorted(order.indices(7, seed=0, epoch=0).tolist())
[0, 1, 2, 3, 4, 5, 6]
>>> shard(np.arange(5), rank=1, world_size=2, drop_last=False).tolist()
[1, 3, 0]
>>> shard(np.arange(5), rank=1, world_size=2, drop_last=False, contiguous=True).tolist()
[3, 4, 0]
"""

import numpy as np

from ..backends import available_ram
from ..convert import int_option
from ..errors import OptionError

__all__ = ["Order", "RandomOrder", "BlockOrder", "SequentialOrder", "ORDERS", "make_order", "shard"]

#: Bytes per block when ``order="block"`` picks the block size itself: large
#: enough that reading one block from disk is a sequential read, small enough
#: that a window of blocks stays a small share of RAM.
BLOCK_BYTES = 4 << 20


def _chosen(order):
    """The order's ``block_rows``; raises if nobody chose one."""
    if order.block_rows is None:
        raise OptionError(f"{type(order).__name__}(block_rows=None) needs a block size; build it with "
                          f"make_order(order, row_bytes) or pass block_rows")
    return order.block_rows


def _check_window(order, num_rows):
    """Refuse a window whose layout could not fit in the RAM available now; once per window size.

    A window larger than the data's blocks is allowed, not capped: the layout
    pads it with empty slots, which changes a block order's shuffle, so
    capping would change the stream of a saved feeder. But the padding is
    laid out whole, so an absurd window (``2**40``) fails there.

    A window accepted once (when a feeder took the order, or at its first
    layout) is not checked again at each epoch: the RAM available dipping for
    a moment mid-training must not stop a run the order was accepted for.

    Args:
        order: a windowed order whose ``block_rows`` is chosen.
        num_rows: rows in the dataset.

    Raises:
        OptionError: one window's layout needs more than the RAM available.
    """
    size = (order.block_rows, order.window)  # public attributes: a window changed since is checked
    if order._fits == size:
        return
    per_block, room = order._layout_bytes_per_block, available_ram()
    if order.window * per_block > room:
        num_blocks = -(-num_rows // order.block_rows)
        raise OptionError(f"{type(order).__name__}(window={order.window}) would lay out "
                          f"{order.window * per_block:,} bytes per window ({per_block} per block), more than "
                          f"the RAM available ({room:,} bytes); use a window of at most {room // per_block:,} "
                          f"blocks (the data has {num_blocks:,} block(s) of {order.block_rows} rows: a window "
                          f"of {num_blocks:,} already holds them all)")
    order._fits = size


def _generator(seed, epoch):
    # A SeedSequence of the pair, not seed + epoch: (seed=0, epoch=1) and
    # (seed=1, epoch=0) must not give the same order.
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch)]))


class Order:
    """An epoch order: which permutation of the rows each epoch reads.

    The base of the three orders a feeder takes (:data:`ORDERS`), which set
    :attr:`name` and implement :meth:`indices`; a feeder refuses an order of
    another class (:func:`make_order`), whose permutation nothing would
    check and whose state it could not compare on resume. An order that
    visits the rows a window of contiguous blocks at a time also has
    ``block_rows`` and ``windows(num_rows, seed, epoch)`` (see
    :meth:`BlockOrder.windows`): the feeder then reads a file source in whole
    blocks instead of row by row.
    """

    name = None

    def indices(self, num_rows, seed, epoch):
        """The row order of one epoch, a pure function of the arguments.

        Args:
            num_rows: rows in the dataset.
            seed: the feeder's seed.
            epoch: the epoch number.

        Returns:
            numpy.ndarray of int64, a permutation of ``range(num_rows)``.
        """
        raise NotImplementedError

    def describe(self):
        """The order's settings, compared when a feeder state is loaded."""
        return {"name": self.name}


class SequentialOrder(Order):
    """Rows in file order, every epoch the same.

    Args:
        block_rows: rows per block when a file source is read a window of
            blocks at a time (see :meth:`windows`); None lets :func:`make_order`
            pick about 4 MiB of rows. It does not change the order.
        window: blocks read together.
    """

    name = "sequential"

    def __init__(self, block_rows=None, window=8):
        self.block_rows = None if block_rows is None else int_option(block_rows, "SequentialOrder block_rows")
        self.window = int_option(window, "SequentialOrder window")
        self._fits = None  # the (block_rows, window) found to fit in RAM (see _check_window)

    def indices(self, num_rows, seed, epoch):
        """``arange(num_rows)``; ``seed`` and ``epoch`` are ignored."""
        return np.arange(num_rows, dtype=np.int64)

    @property
    def _layout_bytes_per_block(self):
        """Bytes :meth:`windows` lays out per block of a window: its int64 block id."""
        return 8

    def windows(self, num_rows, seed, epoch):
        """The blocks in file order, ``window`` at a time (see :meth:`BlockOrder.windows`).

        Raises:
            OptionError: ``block_rows`` was never chosen, or the window's layout
                would not fit in the RAM available.
        """
        num_blocks = -(-num_rows // _chosen(self))
        _check_window(self, num_rows)
        grid = np.full(-(-num_blocks // self.window) * self.window, -1, dtype=np.int64)
        grid[:num_blocks] = np.arange(num_blocks)
        return grid.reshape(-1, self.window)


class RandomOrder(Order):
    """A fresh uniform permutation per epoch, drawn from ``(seed, epoch)``.

    Reads rows at random, so a memory-mapped source larger than RAM is read
    at the disk's random-access speed; prefer :class:`BlockOrder` there.
    """

    name = "random"

    def indices(self, num_rows, seed, epoch):
        """A uniform permutation drawn from ``(seed, epoch)``."""
        return _generator(seed, epoch).permutation(num_rows)


class BlockOrder(Order):
    """Quasi-random order that reads a large file mostly sequentially (FFCV's QUASI_RANDOM).

    The rows are cut into contiguous blocks of ``block_rows``; the blocks are
    shuffled, taken ``window`` at a time, and the rows of each window are
    shuffled together. At any moment only one window of blocks is being read,
    each block a contiguous stretch of the file, so a memory-mapped dataset
    larger than RAM streams from disk instead of seeking per row. Every row
    still appears exactly once per epoch; rows from blocks far apart in the
    file never share a batch window, which is the price of the speed.

    Args:
        block_rows: rows per block, or None to let the feeder pick about
            4 MiB of rows (see :func:`make_order`).
        window: blocks shuffled together.

    Raises:
        OptionError: a non-positive ``block_rows`` or ``window``; when a feeder
            takes the order (or an epoch is first laid out), a window whose
            ``window * block_rows`` row ids would not fit in the RAM available
            (not checked again each epoch).
    """

    name = "block"

    def __init__(self, block_rows=None, window=8):
        self.block_rows = None if block_rows is None else int_option(block_rows, "BlockOrder block_rows")
        self.window = int_option(window, "BlockOrder window")
        self._fits = None  # the (block_rows, window) found to fit in RAM (see _check_window)
        self._last = (None, None)

    def indices(self, num_rows, seed, epoch):
        """Blocks shuffled, then rows shuffled within each window of blocks (see :meth:`Order.indices`).

        Raises:
            OptionError: ``block_rows`` was never chosen (use :func:`make_order`),
                or the window's layout would not fit in the RAM available.
        """
        return self._layout(num_rows, seed, epoch)[1]

    def windows(self, num_rows, seed, epoch):
        """Which blocks each window of the epoch holds, in the order the epoch reads them.

        A file source is read one window at a time: the rows of window ``k``
        are exactly the rows of its blocks, and the epoch's indices visit
        window 0's rows, then window 1's, ... (each window shuffled within).

        Returns:
            numpy.ndarray of int64, shape ``(num_windows, window)``: block ids
            (block ``b`` is rows ``[b * block_rows, (b + 1) * block_rows)``),
            ``-1`` where the last window is short.
        """
        return self._layout(num_rows, seed, epoch)[0]

    @property
    def _layout_bytes_per_block(self):
        """Bytes the layout takes per block of a window: ``block_rows`` int64 row ids, and their shuffled copy."""
        return 16 * _chosen(self)

    def _layout(self, num_rows, seed, epoch):
        # The feeder asks for an epoch's indices and then its windows: compute them once.
        key = (num_rows, seed, epoch, self.block_rows, self.window)
        last = self._last  # read once: the feeder draws the next epoch's on another thread
        if last[0] != key:
            last = self._last = (key, self._compute_layout(num_rows, seed, epoch))
        return last[1]

    def _compute_layout(self, num_rows, seed, epoch):
        size, window = _chosen(self), self.window
        _check_window(self, num_rows)
        rng = _generator(seed, epoch)
        num_blocks = -(-num_rows // size)
        num_windows = -(-num_blocks // window)
        # A (windows, window * size) grid of row ids, block after block in the
        # shuffled block order, with -1 where the last block or window is
        # short; shuffling each grid row and dropping the -1s shuffles every
        # window in one vectorised pass.
        blocks = np.full(num_windows * window, -1, dtype=np.int64)
        blocks[:num_blocks] = rng.permutation(num_blocks)
        grid = blocks[:, None] * size + np.arange(size, dtype=np.int64)
        grid[(blocks < 0)[:, None] | (grid >= num_rows)] = -1
        grid = rng.permuted(grid.reshape(num_windows, window * size), axis=1).reshape(-1)
        return blocks.reshape(num_windows, window), grid[grid >= 0]

    def describe(self):
        return {"name": self.name, "block_rows": self.block_rows, "window": self.window}


ORDERS = {"random": RandomOrder, "block": BlockOrder, "sequential": SequentialOrder}


def make_order(order, row_bytes, num_rows):
    """The order object for a feeder's ``order`` argument.

    Args:
        order: ``"random"``, ``"block"``, ``"sequential"``, or an order object
            (:class:`RandomOrder`, :class:`BlockOrder`, :class:`SequentialOrder`).
        row_bytes: bytes of one row across all sources; sets the block size
            of a :class:`BlockOrder` that has none (about 4 MiB per block).
        num_rows: rows in the dataset: no block is larger (a block order
            lays out and shuffles whole windows of blocks, so ten rows of one
            byte in a block of 4 MiB of rows cost 0.5 GiB and 2 s an epoch).

    Returns:
        An order object with an ``indices(num_rows, seed, epoch)`` method.

    Raises:
        OptionError: an unknown order, or a window whose layout would not fit
            in the RAM available.
    """
    if isinstance(order, str):
        if order not in ORDERS:
            raise OptionError(f"unknown order {order!r}; choose one of {sorted(ORDERS)} "
                              f"or pass an order object such as BlockOrder(block_rows=4096)")
        order = ORDERS[order]()
    if not isinstance(order, tuple(ORDERS.values())):
        raise OptionError(f"order must be one of {sorted(ORDERS)} or an object of "
                          f"{[cls.__name__ for cls in ORDERS.values()]}, got {type(order).__name__}: a "
                          f"feeder takes no other order; for rows in an order of your own, read each "
                          f"batch's ids from the source yourself (a DataGadget's get(ids))")
    if isinstance(order, (BlockOrder, SequentialOrder)):
        chosen = order.block_rows or max(1, BLOCK_BYTES // max(1, int(row_bytes)))
        capped = min(chosen, max(1, int(num_rows)))
        if capped != order.block_rows:
            order = type(order)(capped, order.window)
        _check_window(order, num_rows)
    return order


def shard(indices, rank, world_size, drop_last, contiguous=False):
    """This rank's share of an epoch's indices, as ``DistributedSampler`` splits them.

    Every rank gets the same number of rows. Without ``drop_last`` the order
    is padded by repeating its first rows until it divides evenly (so a few
    rows are read twice per epoch); with ``drop_last`` the tail that does not
    divide evenly is dropped. Rank ``r`` takes positions ``r, r + world_size, ...``,
    or with ``contiguous`` the ``r``-th of ``world_size`` equal runs of them.

    Args:
        indices: the epoch's order (a permutation of the rows).
        rank: this rank, in ``[0, world_size)``.
        world_size: the number of ranks.
        drop_last: drop the uneven tail instead of padding.
        contiguous: runs instead of a stride. For an order that visits a
            window of blocks at a time, a stride gives every rank rows of
            every window, so each rank reads the whole file; a run holds
            about ``1 / world_size`` of the windows.

    Returns:
        numpy.ndarray of int64.

    Raises:
        OptionError: a ``world_size`` that is not a positive int, or a
            ``rank`` that is not an int in ``[0, world_size)`` (a stride
            would hand it another rank's rows, a run none).
    """
    world_size = int_option(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise OptionError(f"rank must be an int from 0 to {world_size - 1} (the world has {world_size} "
                          f"ranks), got {rank!r}")
    rank = int(rank)  # a numpy uint64 would promote the int64 positions below to float64
    n = len(indices)
    if world_size == 1 or not n:  # no rows: every share is empty (and nothing to reduce mod n)
        return indices
    per_rank = n // world_size if drop_last else -(-n // world_size)
    # Position p of the padded order is indices[p % n] (the padding repeats it from the start).
    # Only this rank's positions are made, reduced mod n first: a world larger than the data
    # would otherwise pad it to world_size rows, past any memory (or int64) for a huge one.
    steps = np.arange(per_rank, dtype=np.int64)
    if contiguous:
        positions = (rank * per_rank) % n + steps
    else:
        positions = rank % n + (world_size % n) * steps  # < 2n: a step of w <= n, or one step
    return indices[positions % n]
