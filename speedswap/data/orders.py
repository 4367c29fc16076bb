"""Epoch orders and sharding: which rows each rank reads, in which order.

An order turns ``(num_rows, seed, epoch)`` into a permutation of
``range(num_rows)``; :func:`shard` then splits it between ranks the way
``torch.utils.data.DistributedSampler`` does. Both are pure functions of
their arguments, which is what makes a :class:`~speedswap.BatchFeeder`
resumable: the rest of an epoch is recomputed, never stored.

A feeder takes a rank's share of an epoch from :func:`epoch_share`. In
``random`` order that holds an int64 id for each of the share's rows; in
``block`` and ``sequential`` order the ids are made as the epoch reaches
them, one window of blocks at a time, so an epoch's memory does not grow
with the rows (only with the blocks: their shuffled order).

>>> from speedswap.data.orders import BlockOrder, shard
>>> order = BlockOrder(block_rows=2, window=2)
>>> sorted(order.indices(7, seed=0, epoch=0).tolist())
[0, 1, 2, 3, 4, 5, 6]
>>> shard(np.arange(5), rank=1, world_size=2, drop_last=False).tolist()
[1, 3, 0]
>>> shard(np.arange(5), rank=1, world_size=2, drop_last=False, contiguous=True).tolist()
[3, 4, 0]
"""

import functools

import numpy as np

from ..backends import available_ram
from ..convert import int_option
from ..errors import OptionError

__all__ = ["Order", "RandomOrder", "BlockOrder", "SequentialOrder", "ORDERS", "make_order", "shard",
           "epoch_share"]

#: Bytes per block when a windowed order picks the block size itself (:func:`make_order`): its
#: rows and the ids the order holds for them (a block order's int64 ids). Large enough that
#: reading one block from disk is a sequential read, small enough that a window of blocks stays
#: a small share of RAM.
BLOCK_BYTES = 4 << 20


def _chosen(order):
    """The order's ``block_rows``; raises if nobody chose one."""
    if order.block_rows is None:
        raise OptionError(f"{type(order).__name__}(block_rows=None) needs a block size; build it with "
                          f"make_order(order, row_bytes) or pass block_rows")
    return order.block_rows


def _check_window(order, num_rows):
    """Refuse a window whose layout could not fit in the RAM available now; once per window size.

    A window larger than the data's blocks is allowed, not capped: capping
    would change the order's settings, which a saved feeder state is compared
    by. It is counted as though all its blocks were there (``windows`` lays
    out a slot for each, ``-1`` where the data has none), so an absurd window
    (``2**40``) is refused here, not when its slots are laid out.

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


#: The version of the streams the ``random`` and ``block`` orders draw from, saved with their settings
#: (:meth:`Order.describe`) in a feeder state: a state saved with other streams, resumed mid-epoch,
#: would read some of its epoch's rows twice and others never, so a feeder refuses it.
STREAMS = 2

#: How each earlier version of :data:`STREAMS` drew an epoch, for the refusal's message.
_EARLIER_STREAMS = {
    0: "each epoch's generator was seeded with SeedSequence([seed, epoch]), and one generator shuffled a block "
       "order's windows one after another (before each window had its own generator)",
    1: "each epoch's generator was seeded with SeedSequence([seed, epoch])",
}


def earlier_streams(described):
    """How a saved order drew its epochs, if with streams no order draws now.

    Args:
        described: a feeder state's ``order`` (the order's :meth:`Order.describe` when it was saved).

    Returns:
        str, the earlier streams (:data:`_EARLIER_STREAMS`); None for today's, for a
        ``sequential`` order (which has no stream) or for settings no order saved.
    """
    if not isinstance(described, dict) or described.get("name") not in ("random", "block"):
        return None
    # States saved before the version was kept: a block order's marked its per-window generators
    # with "shuffle" (version 1); a random order's stream did not change then.
    before = 1 if described["name"] == "random" or "shuffle" in described else 0
    return _EARLIER_STREAMS.get(described.get("streams", before))


def _generator(seed, epoch):
    # The seed's SeedSequence child (epoch,), not SeedSequence([seed, epoch]) nor seed + epoch: numpy
    # pads a spawn key's entropy to its pool (four words) first, so no (seed < 2**128, epoch) pair
    # shares another's stream, nor that of default_rng(seed) (a user's data drawn with the feeder's
    # seed); [seed, epoch] was default_rng(seed) at epoch 0, and seed + 2**32's epoch 0 seed's epoch 1.
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(epoch),)))


def _window_generator(seed, epoch, window):
    # The window-th child of the epoch's SeedSequence (what its spawn() would hand out), made
    # directly: a window is shuffled without drawing the shuffles of the windows before it, so
    # an epoch resumed near its end reaches its window at once.
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(epoch), int(window))))


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
            pick about 4 MiB of rows (:data:`BLOCK_BYTES`). It does not change the order.
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

    def _cursor(self, share):
        """``ids(a, b)``: the epoch's ids at positions ``[a, b)``, which in file order are the positions
        (``share``, the :class:`WindowedShare` reading them, does not matter)."""
        return lambda a, b: np.arange(a, b, dtype=np.int64)

    #: Bytes the order holds per row of a window: none (a batch's ids are made from its positions).
    _held_bytes_per_row = 0

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

    def describe(self):
        return {"name": self.name, "streams": STREAMS}


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
            4 MiB of rows and their ids (:data:`BLOCK_BYTES`, :func:`make_order`).
        window: blocks shuffled together.

    A feeder makes an epoch's row ids one window at a time, as it reaches
    the window (:func:`epoch_share`): besides a window's ids, an epoch holds
    only its shuffled blocks, whatever the rows. Each window is shuffled by
    its own generator, so a feeder resumed mid-epoch makes only the windows
    from its position on.

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

    def indices(self, num_rows, seed, epoch):
        """Blocks shuffled, then rows shuffled within each window of blocks (see :meth:`Order.indices`).

        The whole epoch at once, an int64 id a row: a feeder makes them a
        window at a time instead (:func:`epoch_share`), the same ids.

        Raises:
            OptionError: ``block_rows`` was never chosen (use :func:`make_order`),
                or the window's layout would not fit in the RAM available.
        """
        windows = self.windows(num_rows, seed, epoch)
        return np.concatenate([self._lane(num_rows, seed, epoch, k, blocks) for k, blocks in enumerate(windows)])

    def windows(self, num_rows, seed, epoch):
        """Which blocks each window of the epoch holds, in the order the epoch reads them.

        A file source is read one window at a time: the rows of window ``k``
        are exactly the rows of its blocks, and the epoch's indices visit
        window 0's rows, then window 1's, ... (each window shuffled within).

        Returns:
            numpy.ndarray of int64, shape ``(num_windows, window)``: block ids
            (block ``b`` is rows ``[b * block_rows, (b + 1) * block_rows)``),
            ``-1`` where the last window is short.

        Raises:
            OptionError: as :meth:`indices`.
        """
        num_blocks = -(-num_rows // _chosen(self))
        _check_window(self, num_rows)
        blocks = np.full(-(-num_blocks // self.window) * self.window, -1, dtype=np.int64)
        blocks[:num_blocks] = _generator(seed, epoch).permutation(num_blocks)
        return blocks.reshape(-1, self.window)

    #: Bytes the order holds per row of a window: its int64 id (:meth:`_lane`).
    _held_bytes_per_row = 8

    @property
    def _layout_bytes_per_block(self):
        """Bytes a window's ids take per block (:meth:`_lane`): ``block_rows`` int64 ids, the most a
        window holds (tests/test_lazy_orders.py measures the peak against it)."""
        return self._held_bytes_per_row * _chosen(self)

    def _lane(self, num_rows, seed, epoch, k, blocks):
        """Window ``k``'s row ids in the epoch's order: the rows of its ``blocks`` (row ``k`` of
        :meth:`windows`), shuffled by the window's own generator.

        Each window has its own generator, a child of the epoch's seed: a
        window is made without the ones before it, so a loop resumed
        mid-epoch makes only the windows it reads (:class:`_LaneCursor`).
        Until review-w one generator shuffled window after window, and a
        resumed epoch shuffled every window before its own first (NOTES 93):
        for a given seed the rows within each window now come in another
        order (the blocks of each window are the same).
        """
        size = self.block_rows
        blocks = blocks[blocks >= 0]  # -1 pads the last window; the last block may be short
        rows = np.minimum(size, num_rows - blocks * size)
        lane = np.arange(int(rows.sum()), dtype=np.int64)
        start = 0
        for block, count in zip(blocks.tolist(), rows.tolist()):
            # In place, block by block: no temporary as large as the window.
            lane[start:start + count] += block * size - start
            start += count
        _window_generator(seed, epoch, k).shuffle(lane)
        return lane

    def _cursor(self, share):
        """``ids(a, b)``: the epoch's ids at positions ``[a, b)``, made a window at a time (:class:`_LaneCursor`)."""
        lane = functools.partial(self._lane, share.num_rows, share.seed, share.epoch)
        return _LaneCursor(lambda k: lane(k, share.windows[k]), share.ends)

    def describe(self):
        return {"name": self.name, "block_rows": self.block_rows, "window": self.window, "streams": STREAMS}


ORDERS = {"random": RandomOrder, "block": BlockOrder, "sequential": SequentialOrder}


def make_order(order, row_bytes, num_rows):
    """The order object for a feeder's ``order`` argument.

    Args:
        order: ``"random"``, ``"block"``, ``"sequential"``, or an order object
            (:class:`RandomOrder`, :class:`BlockOrder`, :class:`SequentialOrder`).
        row_bytes: bytes of one row across all sources; sets the block size
            of a :class:`BlockOrder` or :class:`SequentialOrder` that has none:
            :data:`BLOCK_BYTES` of rows and of the ids the order holds for
            them (a block order's 8 bytes a row: 1-byte rows in blocks of
            4 MiB of data made a window's ids 8 times its rows).
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
        chosen = order.block_rows or max(1, BLOCK_BYTES // (max(1, int(row_bytes)) + order._held_bytes_per_row))
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
    rank, world_size = _checked_rank(rank, world_size)
    n = len(indices)
    if world_size == 1 or not n:  # no rows: every share is empty (and nothing to reduce mod n)
        return indices
    first, per_rank = _run_of(n, rank, world_size, drop_last)
    # Position p of the padded order is indices[p % n] (the padding repeats it from the start).
    # Only this rank's positions are made, reduced mod n first: a world larger than the data
    # would otherwise pad it to world_size rows, past any memory (or int64) for a huge one.
    steps = np.arange(per_rank, dtype=np.int64)
    if contiguous:
        positions = first + steps
    else:
        positions = rank % n + (world_size % n) * steps  # < 2n: a step of w <= n, or one step
    return indices[positions % n]


def _checked_rank(rank, world_size):
    """``(rank, world_size)`` as ints, checked as :func:`shard` documents."""
    world_size = int_option(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise OptionError(f"rank must be an int from 0 to {world_size - 1} (the world has {world_size} "
                          f"ranks), got {rank!r}")
    return int(rank), world_size  # a numpy uint64 would promote int64 positions to float64


def _run_of(num_rows, rank, world_size, drop_last):
    """``(first, length)``: the run of the padded epoch order a rank takes with ``contiguous`` (see :func:`shard`).

    Positions ``first, ..., first + length - 1`` of the order, each taken mod
    ``num_rows`` (the padding repeats the order from its start); ``first`` is
    below ``num_rows``. A single rank takes the whole order.
    """
    if world_size == 1:
        return 0, num_rows
    per_rank = num_rows // world_size if drop_last else -(-num_rows // world_size)
    return (rank * per_rank) % num_rows, per_rank


class _LaneCursor:
    """An epoch's ids by position, made a window (a lane) at a time from an order's lanes.

    The lane holding a position is made when a position in it is first asked
    for, and dropped when a position of another is: one lane is held at a
    time, and none before the first asked for is made (a loop resumed
    mid-epoch, or the padding that evens out ranks, which repeats the epoch's
    first rows at the end of the last rank's run, costs the lanes it reads).
    A loop asks for its positions in ascending order, so it makes each lane
    once. Not shared between threads: each loop makes its own.

    Args:
        lane: ``lane(k)``, the epoch's ``k``-th lane (a numpy int64 array).
        ends: numpy int64 array, where each lane ends in the epoch (strictly increasing: no lane is empty).
    """

    def __init__(self, lane, ends):
        self._make, self._ends = lane, ends
        self._k, self._lane, self._start = -1, None, 0

    def __call__(self, a, b):
        """The ids at positions ``[a, b)`` of the epoch, a fresh int64 array."""
        pieces = []
        while a < b:
            k = int(np.searchsorted(self._ends, a, side="right"))
            if k != self._k:
                self._lane = None  # dropped before the next is made: one lane held at a time
                self._lane = self._make(k)
                self._k, self._start = k, int(self._ends[k - 1]) if k else 0
            stop = min(b, int(self._ends[k]))
            # Copied: a view would keep the whole lane alive as long as the batch's ids.
            pieces.append(self._lane[a - self._start:stop - self._start].copy())
            a = stop
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces or [np.empty(0, dtype=np.int64)])


class HeldShare:
    """A rank's ids of one epoch, held whole (``random`` order): see :func:`epoch_share`.

    Attributes:
        ids: numpy int64 array, the share's ids in order.
        windows: None (the order visits no windows of blocks).
    """

    windows = None

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def cursor(self):
        """``ids(lo, hi)``: the share's ids at positions ``[lo, hi)``."""
        return lambda lo, hi: self.ids[lo:hi]


class WindowedShare:
    """A rank's run of one epoch of a windowed order, its ids made as they are read: see :func:`epoch_share`.

    Position ``p`` of the run is position ``(first + p) % num_rows`` of the
    epoch's order (the padding that evens out ranks wraps to its start).

    Attributes:
        ids: None (nothing is held).
        num_rows, seed, epoch: the epoch's, as :func:`epoch_share` took them.
        windows: the epoch's ``(num_windows, window)`` block ids (the order's ``windows``).
        ends: numpy int64 array, where each window's rows end in the epoch's order.
        block_rows: rows per block.
    """

    ids = None

    def __init__(self, order, num_rows, seed, epoch, first, length):
        self._order, self.num_rows, self.seed, self.epoch = order, num_rows, seed, epoch
        self._first, self._length = first, length
        self.block_rows = order.block_rows
        self.windows = order.windows(num_rows, seed, epoch)
        rows = np.where(self.windows == (num_rows - 1) // self.block_rows,
                        num_rows - (num_rows - 1) // self.block_rows * self.block_rows, self.block_rows)
        # Small: an int64 a window.
        self.ends = np.cumsum(np.where(self.windows >= 0, rows, 0).sum(axis=1))

    def __len__(self):
        return self._length

    def cursor(self):
        """``ids(lo, hi)``: the run's ids at positions ``[lo, hi)``, asked for in ascending order (a loop's).

        Each call makes a fresh array of ``hi - lo`` ids, a window of the
        order at a time (see :class:`_LaneCursor`); one cursor per loop.
        """
        ids, n = self._order._cursor(self), self.num_rows

        def take(lo, hi):
            a, b = self._first + lo, self._first + hi
            if b <= n:
                return ids(a, b)
            # The run wraps to the order's start: at most world_size - 1 ids of padding.
            head = ids(a, n) if a < n else np.empty(0, dtype=np.int64)
            return np.concatenate([head, ids(max(a, n) - n, b - n)])
        return take

    def frontier(self, positions):
        """The window each of the run's ``positions`` needs read: the latest window the run has reached.

        Windows are read in the epoch's order, so it is the window of the
        position in the order, except for padding past the order's end, which
        needs the last window (its rows, from the first windows, are read
        directly if no longer held).

        Args:
            positions: int or numpy int64 array of positions in ``[0, len(self))``.

        Returns:
            Row indices into :attr:`windows`, of ``positions``' shape.
        """
        return np.searchsorted(self.ends, np.minimum(self._first + positions, self.num_rows - 1), side="right")

    def span(self, batch_size):
        """The most windows one batch of the run needs read at once (batches start at multiples of ``batch_size``).

        A batch needs windows ``frontier(lo) .. frontier(hi - 1)``: one, and one
        more for each window that starts inside it, past its first row. Counted
        over the windows, not the batches (a batch of one row over a billion
        rows would need an array of a billion batches).
        """
        # Where each window after the first starts, as a position of the run; only those its
        # frontier reaches before the order's end (padding adds no window).
        starts = self.ends[:-1] - self._first
        last = min(self._length, self.num_rows - self._first) - 1
        inside = starts[(starts >= 1) & (starts <= last) & (starts % batch_size != 0)]
        return 1 + (int(np.bincount((inside - 1) // batch_size).max()) if len(inside) else 0)


def epoch_share(order, num_rows, seed, epoch, rank, world_size, drop_last, contiguous):
    """A rank's share of one epoch, as :func:`shard` splits ``order.indices(...)``: the same ids.

    An order with ``windows`` (``block``, ``sequential``) split in runs
    (``contiguous``, or a single rank) gives a :class:`WindowedShare`, which
    makes its ids a window of blocks at a time as they are read; any other,
    a :class:`HeldShare` of the ids (an int64 a row, the whole permutation
    while it is split).

    Args:
        order: the epoch's order (see :func:`make_order`).
        num_rows: rows in the dataset (at least one).
        seed: the feeder's seed.
        epoch: the epoch.
        rank, world_size, drop_last, contiguous: as :func:`shard` takes them.

    Returns:
        A share: ``len(share)`` ids, read with ``share.cursor()(lo, hi)``.

    Raises:
        OptionError: as :func:`shard`, and as the order's ``windows`` for a window that cannot fit in RAM.
    """
    rank, world_size = _checked_rank(rank, world_size)
    if hasattr(order, "windows") and (contiguous or world_size == 1):
        first, length = _run_of(num_rows, rank, world_size, drop_last)
        return WindowedShare(order, num_rows, seed, epoch, first, length)
    return HeldShare(shard(order.indices(num_rows, seed, epoch), rank, world_size, drop_last, contiguous))
