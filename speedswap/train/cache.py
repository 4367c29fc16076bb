"""A write-back device cache of hot rows and their optimizer state, with next-batch prefetch.

Real ids are Zipf-distributed: a few percent of the rows take most lookups.
:class:`RowCache` keeps ``num_slots`` rows, and the optimizer-state rows that
go with them, in device memory, so a hot row stops crossing the bus every step.

**Exactness.** The authoritative copy of every row (and of its state) is in
exactly one place: a cache slot while the row is cached, the host tables
otherwise. Rows enter the cache only after a step (their updated values, from
the working set) or by :meth:`RowCache.prefetch` (read from the host, where
they are authoritative); a row leaves it only by eviction, which writes the
row and its state back together unless they are clean (below). A step reads
each new row from where it is authoritative, so training with a cache does
the same arithmetic as without one.

**Policy: frequency by step, with admission.** A small count-min sketch
(two hashed rows of counters, about four counters per slot, on the device)
counts in how many recent steps each row was used, with older steps weighing
less (each step counts ``1 / DECAY`` times the one before, ``DECAY = 0.99``:
a half-life of about 70 steps). After a step, the step's rows that missed are
ranked by that count, the evictable slots by their row's count when it was
last used (free slots first: a row's count only grows when it is used), and a
missed row takes a slot only from a row counted strictly less often; the
others go back to the host as if there were no cache. A one-off row
therefore never pushes out a hot one, which LRU does all the time on Zipf ids
(``benchmarks/README.md`` has both policies' bytes against the floor of a
cache that holds the truly most frequent rows). A cache
smaller than one step's unique rows, or full of pinned rows, *falls back* in
the same way: it never raises. Rows of the current step and prefetched rows
are pinned (``stamp`` at or above the clock) and never evicted.

**Prefetch rule.** ``prefetch(ids)`` copies the ids' rows that are neither
cached nor in the current working set from the host into evictable slots and
stamps them (and those already cached) with the next step, so neither this
step's nor the next step's write-back can evict them. Rows of the current
working set are skipped: their host copies are stale until the step ends, and
after it they are in the cache (or back on the host) with their updated values;
bringing one in would also give it a second slot when the step stores it.
Unlike a step's misses, prefetched rows skip the admission rule: they evict
the cheapest slots however hot, so that the next step finds every row it can
in the cache and waits for no copy. That is the trade: on the cache
benchmark's Zipf-1.1 ids (1M rows, 5% cache) prefetching every step moved
0.398 of the bytes of no cache against 0.383 without prefetch, with 3,510
evictions a step against 653, and every row of a step was in the cache when
it began (``benchmarks/NOTES.md``, 27).

**Copies.** The slots are the first ``num_slots`` rows of the cache's
tensors; the rows after them are scratch, for one call's misses (grown to the
most misses a step's call has had; an eval read with more gathers them into a
temporary, :meth:`RowCache.read`). A step's new rows arrive in one gather into
the working set: the misses are first gathered from the host into scratch, so
one ``index_select`` over slots and scratch fills the working set in slot order,
hits and misses alike. The step's end is one row assignment from the working
set into the rows' slots, the misses that stay uncached into scratch, whose
contiguous rows then go to the host. On a CPU, where a hit costs the copy
that the host gather it replaces would, that keeps a hit at one copy each
way and a miss at one more than without a cache (see ``benchmarks/README.md``).

**Dirty rows.** A slot is *dirty* when its row or state may differ from the
host's copy: after a step stored it there. Rows brought by a prefetch, and
every row after :meth:`RowCache.flush`, are clean; a step's misses evict a
clean row without writing it back (the host holds the same values). A
prefetch writes back every row it evicts, clean or not: counting the dirty
ones would cost it a host wait, and between flushes nearly every evicted row
is dirty (on the cache benchmark's Zipf-1.1 ids, prefetching every step, the
bytes moved were the same to the byte: ``benchmarks/NOTES.md``, 42). The
price is paid after a flush (a ``save``): each clean row a prefetch evicts is
written back once more than needed.

**Bookkeeping** is six ``(num_slots,)`` device tensors (row per slot, -1 when
empty; the step each slot is pinned until; its row's count; its dirty flag;
sorted rows and their slots for ``searchsorted``) and the ``(2, ~4 num_slots)``
sketch: it never grows with the vocabulary. Host synchronisations: none in a
training forward (how many of its rows hit, :meth:`RowCache.count_hits`, is
read with the working set's count of new rows and the ids' bounds, the one
wait a forward makes without a cache), one per step (how many misses are
admitted, and how many of their victims are dirty) and one per prefetch (how
many rows to bring, read with the ids' bounds, their range check); no call
sizes a ``torch.unique``. A forward outside training makes one, its ids'
range check, which reads with it how many rows to read from the host while
some rows are cached (:meth:`RowCache.read`).
That is the CPU model's count; the GPU runs counted 2-4 a step, from four
calls the model did not know then (``torch.isin``, and Python scalars
assigned through a tensor index: ``benchmarks/NOTES.md``, 35), since replaced.
Every other size is known on the host and indexes with
:func:`~speedswap.train.sync_free.positions` (``tests/test_host_syncs.py``
counts them). On a GPU a prefetch's copies run on a side stream; the first
call into the cache after it on each stream makes that stream wait for them.

**Views.** A view of the host tables that ``to_numpy()`` or ``as_tensor()``
handed out reads and writes the host memory directly, where no cached row
shows. While one is alive (:meth:`RowCache.viewed`) the cache keeps nothing:
a step writes its rows back, a prefetch brings none, and rows cached before
are given up, clean (handing the view out flushed them), so every read
through the view is current and every write through it trains on. They are
given up at the cache's first lookup, read or prefetch after a view was
handed out, alive or not by then: one dropped already may have written rows
(kept, their cached copies would win over those writes, and a prefetch
evicting them would write them back over the writes).

**One thread.** Nothing locks the bookkeeping, so a prefetch must come from
the thread that trains (the last to fetch a step's rows or end a step outside
a backward, or the one that made the cache before any did): one from another
thread is refused. A fetch inside a backward (activation checkpointing's
recompute, which a GPU's autograd engine runs on a thread of its own) leaves
the training thread as it was; the step's end, on the thread that called
``optimizer.step()``, then names it.
"""

import contextlib
import functools
import threading
from typing import Callable, Optional, Sequence

import torch

from ..backends.cpu import assign_rows, huge_page_array
from ..convert import host_tensor, numpy_dtype, numpy_view, read_bounds
from ..errors import StateError, warn
from ..table import HostTable
from .reached import in_backward
from .sketch import FrequencySketch
from .sync_free import find_sorted, positions, reads_are_free, sort_marking_firsts

__all__ = ["RowCache", "COUNTERS", "EVAL_COUNTERS"]

#: The names of :meth:`RowCache.stats`' counters. ``rows_*`` count table rows; ``bytes_*`` count
#: their bytes and those of the optimizer state that crosses with them (or alone: ``reload_state``).
COUNTERS = ("steps", "lookups", "unique_rows", "hits", "misses", "rows_h2d", "bytes_h2d",
            "rows_d2h", "bytes_d2h", "evictions", "prefetched_rows")

#: The names of the counters of reads outside training (:meth:`RowCache.read` of an eval forward),
#: kept apart from :data:`COUNTERS` so that a training step's hit rate stays its own. ``hits``
#: counts ids whose row was cached, served from the cache; ``rows_h2d`` the rows read from the
#: host: each uncached row once, or one per id while nothing is cached.
EVAL_COUNTERS = ("forwards", "lookups", "hits", "rows_h2d", "bytes_h2d")

#: Sketch counters per cache slot: enough that collisions rarely lift a cold row's count.
_SKETCH_COUNTERS_PER_SLOT = 4


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _outside_inference_mode(method):
    """Run the cache's ``method`` with inference mode off, whatever the caller's mode.

    The tensors a call keeps (a prefetch's stamps, the scratch a fetch grows)
    take in-place writes at later steps: made under ``torch.inference_mode()``
    (a prefetch, or ``emb.slots``, in an evaluation loop) they would be
    inference tensors, and the next ``optimizer.step()`` would raise torch's
    "Inplace update to inference tensor" halfway through its write-back.
    """
    @functools.wraps(method)
    def run(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False):
            return method(*args, **kwargs)
    return run


def _rows(count, dim, dtype, device):
    """An uninitialised ``(count, dim)`` tensor for cached rows.

    On the CPU in transparent huge pages, as the host tables are: a hit is a
    random row read, and with 4 KiB pages nearly every one missed the TLB
    (a cached step of ``benchmarks/cache.py``, 5% cache, took 2-6% longer).
    """
    if device.type != "cpu":
        return torch.empty((count, dim), dtype=dtype, device=device)
    return host_tensor(huge_page_array((count, dim), numpy_dtype(dtype)), dtype)


def _read_checked(counts, ids_sorted, check_bounds):
    """Device counts as Python ints, in one transfer (a GPU's host wait) with the ids' range check.

    Args:
        counts: 0-d int64 device tensors.
        ids_sorted: the call's ids, ascending, not empty.
        check_bounds: for ids not range-checked yet
            (:func:`~speedswap.convert.as_row_ids_deferred`), called with their
            smallest and largest value before this returns; None when checked.

    Returns:
        the counts' values, in order; no transfer is made when there are none
        and no bounds to check.

    Raises:
        IdError: from ``check_bounds``.
    """
    if check_bounds is not None:
        counts = [*counts, ids_sorted[0], ids_sorted[-1]]
    if not counts:
        return []
    values = torch.stack(counts).tolist()
    if check_bounds is not None:
        check_bounds(*values[-2:])
        del values[-2:]
    return values


def _take_rows(source, index, out):
    """``out[:] = source[index]`` in one gather (two when the dtypes differ); returns ``out``."""
    if out.dtype == source.dtype:
        return torch.index_select(source, 0, index, out=out)
    return out.copy_(source.index_select(0, index))


def _put_rows(target, index, values):
    """``target[index] = values`` for unique ``index``, converted to ``target``'s dtype."""
    values = values.detach().to(target.dtype)
    if target.device.type != "cpu":
        target.index_copy_(0, index, values)
        return
    # 0.77 ms for 7,000 rows of 128 float32 where index_copy_ took 1.46 ms.
    assign_rows(numpy_view(target), index, values)


class RowCache:
    """``num_slots`` rows of a :class:`~speedswap.HostTable` and its state tables, on the device.

    Used by :class:`~speedswap.OffloadedEmbedding`; all ids it is handed were
    validated by the public call (``convert.as_row_ids``) and are not checked again.
    With ``num_slots=0`` it caches nothing and only moves and counts rows, so
    the embedding has one code path.

    Args:
        num_slots: rows the cache holds (0 turns caching off).
        table: the embedding's table.
        state_tables: the optimizer's per-row state tables, ``{name: HostTable}``.
        state_dtype: the dtype of the optimizer state (the working set's).
    """

    def __init__(self, num_slots: int, table: HostTable, state_tables: dict,
                 state_dtype: torch.dtype):
        self.num_slots, self.table, self.state_tables = int(num_slots), table, state_tables
        n, dim, device = self.num_slots, table.dim, table.device
        self.device = device
        self.slot_row = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(n, dtype=torch.bool, device=device)
        self.sketch = FrequencySketch(_SKETCH_COUNTERS_PER_SLOT * max(n, 1), device,
                                      wide_rows=table.num_rows > 2**32)
        # Each slot's row count as of its last use (-inf when free): ranking the slots
        # needs no hashing of every slot, and an unused row's count does not change.
        self.score = torch.full((n,), -torch.inf, dtype=torch.float32, device=device)
        # Slots first, then scratch rows (none until a call needs them).
        self.weights = _rows(n, dim, table.dtype, device)
        self.states = {name: _rows(n, dim, state_dtype, device) for name in state_tables}
        self._row_bytes = dim * _itemsize(table.dtype)
        self._state_row_bytes = dim * _itemsize(state_dtype)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and n else None
        self._waited = set()  # streams that waited for the side stream since it was last given work
        self.clock = 0  # the current step; stamps below it are evictable
        # The training thread: the one that made the cache, then the last to fetch a step's rows
        # or end a step, outside a backward (_note_training_thread).
        self._thread = threading.get_ident()
        self._n_empty = n
        self._warned_views = False  # see _warn_views
        self._views_seen = self._views_handed_out()  # see _give_up_for_views
        # The sorted index holds rows as int32 where they fit: half the memory a binary
        # search misses the CPU's caches in, and a faster sort.
        self._key_dtype = torch.int32 if table.num_rows < 2**31 else torch.int64
        self._reindex(self.slot_row)
        self.total = dict.fromkeys(COUNTERS, 0)
        self.last_step = dict.fromkeys(COUNTERS, 0)
        self.eval_total = dict.fromkeys(EVAL_COUNTERS, 0)
        self._begin_step()

    # ------------------------------------------------------------ bookkeeping
    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds: rows, state rows (slots and scratch) and bookkeeping."""
        if not self.num_slots:
            return 0
        row = self._row_bytes + self._state_row_bytes * len(self.states)
        bookkeeping = sum(t.numel() * t.element_size() for t in (
            self.slot_row, self.stamp, self.dirty, self.score, self._sorted_rows, self._sorted_slots))
        return len(self.weights) * row + bookkeeping + self.sketch.nbytes

    def _reindex(self, slot_row):
        """Make ``slot_row`` the row of each slot, with its sorted index; when sorting fails, nothing changes.

        Sorting allocates (device memory on a GPU), so callers pass the new
        rows out of place and change the slots' other bookkeeping after it.
        """
        sorted_rows, sorted_slots = torch.sort(slot_row.to(self._key_dtype))
        if hasattr(self, "_sorted_rows"):  # none yet when __init__ builds the first index
            self._retire(self.slot_row, self._sorted_rows, self._sorted_slots)
        self.slot_row, self._sorted_rows, self._sorted_slots = slot_row, sorted_rows, sorted_slots

    def _retire(self, *tensors):
        """Record ``tensors``, about to be dropped, for the current stream (on a GPU).

        The cache's tensors are made on the stream it was made on, and training
        may run on another: freed, a tensor goes back to the pool of the stream
        that made it, which hands it out again at once, while the current
        stream's queued work may still read or write it. Recorded, it waits for
        that work (on the stream that made it, the allocator returns at once).
        """
        if self._side is not None:
            stream = torch.cuda.current_stream(self.device)
            for tensor in tensors:
                tensor.record_stream(stream)

    def _begin_step(self):
        self._step = dict.fromkeys(COUNTERS, 0)
        self._counted = False  # whether a store counted the step's rows in the sketch (see store)
        self.restart_step()

    def restart_step(self):
        """Forget the step's fetches but not its counters, for a step that raised inside the optimizer.

        Its rows are fetched again (``fetch(..., again=True)``) from where they
        still are: the step stored nothing, so hits are still cached and misses
        still on the host. The clock does not move: the step has not ended.
        """
        self._looked_up = None  # count_hits' lookup, for the fetch that follows it
        self._slot_parts = []  # per fetch: each new row's slot, -1 for a miss
        self._pinned = True  # whether the step's hits are pinned (see _pin)
        self._n_hits = self._n_misses = 0

    def _lookup(self, rows):
        """(found, slot) for ``rows`` (duplicates allowed): slot is meaningful where found."""
        pos, found = find_sorted(self._sorted_rows, rows.to(self._key_dtype))
        return found, self._sorted_slots.index_select(0, pos)

    def _step_slots(self):
        """Each working-set row's slot (by working-set slot), -1 for the step's misses."""
        parts = self._slot_parts
        if not parts:  # a step without rows (no ids): fetch returned before recording any
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]  # read_state and store both need them: one cat a step
        return parts[0]

    def _pin(self, stamp):
        """Pin the step's hits in ``stamp`` (the cache's stamps or a copy, changed in place; returned).

        A row this step uses must outlive the step, and eviction takes stamps
        below the clock: pinned once a step, before its first call that evicts
        (a prefetch, the step's store), not at each fetch.
        """
        slots = self._step_slots()
        if self._n_misses:
            # A miss's -1 becomes slot 0 with stamp -1, which leaves that stamp as it is.
            used, slots = torch.where(slots >= 0, self.clock, -1), slots.clamp(min=0)
        else:
            used = torch.full_like(slots, self.clock)
        # amax: a row a prefetch pinned for the next step (clock + 1) stays pinned longer.
        return stamp.scatter_reduce_(0, slots, used, "amax")

    def _scratch(self, count):
        """The scratch rows' first index, after making sure there are ``count`` of them."""
        n = self.num_slots
        if len(self.weights) - n < count:
            size = n + (1 << (count - 1).bit_length())  # powers of two: few regrowths

            def grown(old):
                new = _rows(size, old.shape[1], old.dtype, old.device)
                new[:n] = old[:n]  # scratch holds nothing between calls
                return new

            self._retire(self.weights, *self.states.values())
            self.weights = grown(self.weights)
            self.states = {name: grown(rows) for name, rows in self.states.items()}
        return n

    def _on_side(self):
        """Where a prefetch's copies run: the side stream on a GPU, the current one elsewhere."""
        return contextlib.nullcontext() if self._side is None else torch.cuda.stream(self._side)

    def _wait_prefetch(self):
        """Make the current stream wait for the copies a prefetch queued on the side stream.

        Once per stream and prefetch: a stream that waited runs its later work
        after every copy queued before, and only a prefetch queues more (a
        GPU step made the wait, an event created, recorded and waited on,
        at each of its six calls into the cache).
        """
        if self._side is None:
            return
        current = torch.cuda.current_stream(self.device)
        if current not in self._waited:
            current.wait_stream(self._side)
            self._waited.add(current)

    def _count(self, **amounts):
        for key, value in amounts.items():
            self._step[key] += value

    # --------------------------------------------------------------- transport
    def _gather_host(self, table, rows, out):
        """Copy host rows into ``out`` (any float dtype) and return it."""
        if out.dtype == table.dtype and out.is_contiguous():
            return table.gather_validated(rows, out)
        staged = torch.empty(len(rows), table.dim, dtype=table.dtype, device=self.device)
        return out.copy_(table.gather_validated(rows, staged))

    def _host_writes(self, rows, weights, states, counters=None) -> Callable[[], None]:
        """Prepare writing rows (and their state, when given) back to the host tables; returns the writes.

        Everything that may fail (converting the rows to the table's dtype,
        each table's allocations: :meth:`HostTable.prepare_scatter`) runs
        now, so that the rows and their state are written all together or
        not at all. The returned call writes them, reading ``weights`` (in the
        table's dtype; in another they are converted now) and ``states`` then.
        """
        writes = [self.table.prepare_scatter(rows, weights.to(self.table.dtype))]
        moved = len(rows) * self._row_bytes
        if states is not None:
            writes += [table.prepare_scatter(rows, states[name]) for name, table in self.state_tables.items()]
            moved += len(rows) * self._state_row_bytes * len(states)
        counters = self._step if counters is None else counters

        def write():
            for write_rows in writes:
                write_rows()
            counters["rows_d2h"] += len(rows)
            counters["bytes_d2h"] += moved
        return write

    def _evicted(self, slots, n_changed):
        """The slots of ``slots`` (cheapest first, free ones first) whose rows must be written back
        before they change hands, and those rows.

        :meth:`_write_back` them before :meth:`_take`: the write-back allocates
        (device memory on a GPU), and a failure there must find every slot
        still describing its row.

        Args:
            slots: the slots about to change hands.
            n_changed: how many of ``slots`` are dirty (free slots never are),
                which the caller learnt in a host synchronisation it needed
                anyway; None to count every evicted row as changed.

        Returns:
            (changed, changed_rows): the evicted slots that are dirty (or all
            of them), and their rows.
        """
        held = slots[min(len(slots), self._n_empty):]
        changed = held if n_changed is None else slots.index_select(
            0, positions(self.dirty.index_select(0, slots), n_changed))
        return changed, self.slot_row.index_select(0, changed)

    def _take(self, slots, rows, stamp, score, dirty):
        """Give ``slots`` (cheapest first, free ones first) to ``rows``: the bookkeeping half.

        Their rows must have been written back first (:meth:`_evicted`); the
        caller fills the slots' values after it. When it raises (out of memory
        re-sorting the index) nothing has changed hands.
        """
        self._reindex(self.slot_row.scatter(0, slots, rows))  # first: the one part that allocates
        free = min(len(slots), self._n_empty)
        self._n_empty -= free
        # index_fill_, not `[slots] =`: a Python scalar assigned through a tensor index
        # is copied to the GPU with a host wait.
        self.stamp.index_fill_(0, slots, stamp)
        self.score.scatter_(0, slots, score)
        self.dirty.index_fill_(0, slots, dirty)
        self._count(evictions=len(slots) - free)

    def _write_back(self, slots, rows, counters=None):
        """Write the rows of ``slots`` and their state to the host (``rows``: their ids)."""
        if len(slots):
            self._host_writes(rows, self.weights.index_select(0, slots),
                              {name: s.index_select(0, slots) for name, s in self.states.items()},
                              counters)()

    def _sources(self, rows, found, slot, n_miss, missed=None, into=None):
        """Where each of ``rows`` is once its uncached rows are gathered from the host: its slot, or
        ``num_slots`` plus the row of ``into`` its host copy is gathered into (misses in order).

        Args:
            rows: validated rows; a row that repeats has its entries next to each other.
            found, slot: the rows' :meth:`_lookup` (``found`` is not read when ``n_miss`` is 0).
            n_miss: how many rows to gather from the host.
            missed: marks those rows, each uncached row once, at its first entry; None for
                ``~found``, when ``rows`` are unique.
            into: ``(n_miss, dim)`` rows in the table's dtype to gather them into; None for the
                scratch rows (grown to fit), which follow the slots in :attr:`weights`.

        Returns:
            an int64 ``(len(rows),)`` tensor of indices: into :attr:`weights` when ``into`` is
            None, else into the slots followed by ``into``.
        """
        if not n_miss:
            return slot
        missed = ~found if missed is None else missed
        if into is None:
            begin = self._scratch(n_miss)
            into = self.weights[begin:begin + n_miss]
        self._gather_host(self.table, rows.index_select(0, positions(missed, n_miss)), into)
        # A repeat of a missed row is not marked: the sum leaves it at its first entry's row.
        return torch.where(found, slot, self.num_slots - 1 + torch.cumsum(missed, 0))

    def _victims(self, count):
        """The ``count`` slots cheapest to give up, and their scores, cheapest first.

        Free slots score -inf, pinned ones (rows of this step, prefetched rows)
        +inf, the others their row's use count.
        """
        score = torch.where(self.stamp < self.clock, self.score, torch.inf)
        # Scores are >= +0.0 or +-inf, whose float32 bit patterns order as int32s do; on
        # the CPU topk over the integers takes about two thirds of the time. The values it
        # returns are the victims' scores' bit patterns: viewed back, they need no gather.
        bits, slots = torch.topk(score.view(torch.int32), count, largest=False, sorted=True)
        return bits.view(torch.float32), slots

    # ---------------------------------------------------------------- the step
    def count_hits(self, ids_sorted: torch.Tensor, new: torch.Tensor,
                   carried_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The counts :meth:`fetch` needs, before the rows it will fetch are known: ``[hits(, carried hits)]``.

        For the working set to read with its own count (``WorkingSet.add``'s
        ``count_also``), so that a training forward makes one host wait, not
        two. The lookup is kept for the :meth:`fetch` given these counts, which
        then takes its rows' slots from it instead of searching again.

        Args:
            ids_sorted: a forward's ids, sorted; ``new`` marks one entry per row
                new to the working set: the rows :meth:`fetch` is then given,
                in this order, after the carried ones.
            new: bool mask over ``ids_sorted``.
            carried_rows: the rows fetched with them without being looked up
                (the padding row at a step's start), or None.

        Returns:
            an int64 device tensor: how many of the rows to fetch are cached,
            and with ``carried_rows`` how many of those (``(2,)``; else ``(1,)``).
        """
        self._give_up_for_views()
        found, slot = self._lookup(ids_sorted)
        hits = (found & new).sum(0, keepdim=True)
        if carried_rows is None:  # every lookup but a padded step's first: no count to stack with it
            self._looked_up = (found, slot, None)
            return hits
        carried_found, carried_slot = self._lookup(carried_rows)
        carried = carried_found.sum()
        self._looked_up = (found, slot, (carried_found, carried_slot))
        return torch.cat([hits + carried, carried.view(1)])

    def _looked_up_rows(self, picked, found_too):
        """(found, slot) of the rows :meth:`count_hits` looked up, carried first, then the new ones at
        ``picked``; found is None unless ``found_too``."""
        found, slot, carried = self._looked_up
        self._looked_up = None
        slot = slot.index_select(0, picked)
        found = found.index_select(0, picked) if found_too else None
        if carried is not None:
            slot = torch.cat([carried[1], slot])
            found = None if found is None else torch.cat([carried[0], found])
        return found, slot

    @_outside_inference_mode
    def fetch(self, rows: torch.Tensor, out: torch.Tensor, first: int, lookups: int, *,
              carried: int = 0, again: bool = False, hits: Optional[Sequence[int]] = None,
              picked: Optional[torch.Tensor] = None):
        """Fill ``out`` with the rows new to the working set: hits from the cache, misses from the host.

        Args:
            rows: the new rows (unique, validated), working-set slots
                ``first..first+len(rows)-1``.
            out: ``(len(rows), dim)`` rows of the working-set parameter (contiguous).
            first: the working-set slot of ``rows[0]``.
            lookups: the ids the forward looked up (for the counters).
            carried: how many of the first ``rows`` every step carries without
                looking them up (the padding row): moved and cached like the
                others, but not counted as unique rows, hits or misses.
            again: the rows of a step that raised, fetched a second time after
                :meth:`restart_step`: the copies count, the rows' use does not.
            hits: :meth:`count_hits`' values for these rows, read with the
                working set's count (its lookup then gives the rows' slots):
                ``[hits]``, or ``[hits, carried hits]`` with ``carried``; None
                to look the rows up and read the counts here (a host wait).
            picked: with ``hits``: where the new rows were among the ids
                :meth:`count_hits` looked up (``WorkingSet.added_at``, found
                once for the working set and the cache).
        """
        self._wait_prefetch()
        self._note_training_thread()
        if not again:
            self._count(lookups=lookups, unique_rows=len(rows) - carried)
        if not len(rows):
            return
        n_hit = n_carried_hit = 0
        if self.num_slots:
            if hits is None:
                self._give_up_for_views()
                found, slot = self._lookup(rows)
                # One host synchronisation: the hits, and how many of them are carried rows.
                hits = torch.stack([found.sum(), found[:carried].sum()]).tolist()
            else:
                # All hits (every row prefetched, the steady state): which were found goes unused.
                found, slot = self._looked_up_rows(picked, found_too=hits[0] < len(rows))
            n_hit, n_carried_hit = hits[0], hits[1] if carried else 0
            if n_hit and n_hit < len(rows):
                self._scratch(len(rows) - n_hit)  # an allocation that may fail: before the bookkeeping
            # All hits (every row prefetched, the steady state): the slots need no masking.
            self._slot_parts.append(slot if n_hit == len(rows) else torch.where(found, slot, -1))
            self._pinned = self._pinned and not n_hit
        n_miss = len(rows) - n_hit
        if n_hit == 0:
            self._gather_host(self.table, rows, out)
        else:  # the hits' slots are pinned for the step before anything evicts (_pin)
            _take_rows(self.weights, self._sources(rows, found, slot, n_miss), out)
        self._n_hits += n_hit
        self._n_misses += n_miss
        if not again:
            self._count(hits=n_hit - n_carried_hit, misses=n_miss - (carried - n_carried_hit))
        self._count(rows_h2d=n_miss, bytes_h2d=n_miss * self._row_bytes)

    def read_state(self, rows: torch.Tensor, views: dict):
        """Fill the optimizer's state ``views`` for the step's ``rows``: hits from the cache.

        Args:
            rows: the working set's rows, by slot.
            views: ``{name: (len(rows), dim) contiguous tensor}`` to fill.
        """
        self._wait_prefetch()
        if self._n_hits:
            source = step_slot = self._step_slots()
            n_miss = self._n_misses
            if n_miss:
                missed = step_slot < 0
                source = torch.where(missed, self.num_slots - 1 + torch.cumsum(missed, 0), step_slot)
                missed_rows = rows.index_select(0, positions(missed, n_miss))
                begin = self._scratch(n_miss)
        for name, view in views.items():
            table = self.state_tables[name]
            if not self._n_hits:
                self._gather_host(table, rows, view)
                continue
            cached = self.states[name]
            if n_miss:
                self._gather_host(table, missed_rows, cached[begin:begin + n_miss])
            _take_rows(cached, source, view)
        self._count(bytes_h2d=self._n_misses * self._state_row_bytes * len(views))

    def store(self, rows: torch.Tensor, weights: torch.Tensor, states):
        """End the step: every row of the working set goes to the cache, or back to the host.

        Hits are updated in their slots; misses take free slots, or the slots
        of rows used less often (whose rows and state are written back first
        when dirty); misses left over, or all of them when torch skipped the
        parameter (``states`` is None), are written back to the host.

        All or nothing: when it raises (out of memory), the slots and the host
        tables hold every row and its state as before it, so the step can be
        stored again or dropped (:meth:`end_step`).

        Args:
            rows: the working set's rows, by slot.
            weights: ``(len(rows), dim)`` updated rows.
            states: ``{name: (len(rows), dim)}`` updated state, or None.
        """
        self._wait_prefetch()
        if not self.num_slots or self.viewed():
            if self.num_slots:
                self._warn_views()
                self.flush()  # the step's rows then go over their cached (older) values
            self._host_writes(rows, weights, states)()
            if self.num_slots:
                self._forget()  # all clean: the host holds every row's current value
            self._finish_step()
            return
        # Each row's slot, -1 for rows going back to the host: a copy, changed below, so that the
        # step's own record stays as fetched for a store tried again after one that failed.
        target = self._step_slots().clone()
        if not self._pinned:  # before the victims are chosen
            self._pin(self.stamp)
            self._pinned = True
        # The step's use of its rows, counted once for all its fetches: one hashing, not one per lookup.
        # A store tried again after one that failed reads the counts the first one added: counted
        # twice, the step's rows would outrank rows as used and evict them where a run without
        # the failure keeps them.
        count = self.sketch.estimate(rows) if self._counted else self.sketch.add(rows)
        self._counted = True
        if self._n_hits:
            hit_slot, hit_count = target, count  # all hits: no misses to leave out
            if self._n_misses:
                hit_pos = positions(target >= 0, self._n_hits)
                hit_slot, hit_count = target.index_select(0, hit_pos), count.index_select(0, hit_pos)
            self.score.scatter_(0, hit_slot, hit_count)
            self.dirty.index_fill_(0, hit_slot, True)  # not `[hit_slot] = True`: see _take
        cached = 0
        if self._n_misses and states is not None:
            # Misses by use count, most used first, against slots by score, cheapest first:
            # "miss i beats victim i" holds for a prefix, the misses admitted.
            miss_pos = positions(target < 0, self._n_misses)
            candidates = min(self._n_misses, self.num_slots)
            victim_score, victims = self._victims(candidates)
            # Stable: tied misses go in working-set order on every device (CUDA's small sorts are not).
            miss_score, ranked = torch.sort(count.index_select(0, miss_pos), descending=True, stable=True)
            admitted = miss_score[:candidates] > victim_score
            # The step's one host synchronisation: how many misses are admitted, and how
            # many of their victims must be written back.
            cached, n_changed = torch.stack(
                [admitted.sum(), (admitted & self.dirty.index_select(0, victims)).sum()]).tolist()
        if cached + self._n_hits == 0:
            # Nothing cached this step: the rows go back as they are, without a copy.
            self._host_writes(rows, weights, states)()
            self._finish_step()
            return
        # Everything that may fail (out of memory: device memory on a GPU) runs before the first
        # write, so that a failure leaves every slot describing its row, and the slots and the
        # host tables as before the step. The scratch the rows going back need:
        n_rest = self._n_misses - cached
        begin = self._scratch(n_rest)
        # Rows in the cache's dtype (a bfloat16 table's, from float32 math): the conversion
        # allocates too. No copy when the dtypes match.
        weights = weights.detach().to(self.weights.dtype)
        if cached:
            placed, victims = miss_pos.index_select(0, ranked[:cached]), victims[:cached]
            target.scatter_(0, placed, victims)
        write_rest = None
        if n_rest:
            rest = positions(target < 0, n_rest)
            end = begin + n_rest
            target.scatter_(0, rest, torch.arange(begin, end, device=self.device))
            # Prepared now, run last: the writes read the scratch rows the assignment below fills.
            write_rest = self._host_writes(rows.index_select(0, rest), self.weights[begin:end],
                                           None if states is None else
                                           {name: self.states[name][begin:end] for name in states})
        if cached:
            # A failure in the write-back leaves the evicted rows cached (and dirty), one in
            # _take leaves every slot to its row: the host copies written meanwhile are the same.
            self._write_back(*self._evicted(victims, n_changed))
            self._take(victims, rows.index_select(0, placed), self.clock, miss_score[:cached], True)
        # From here nothing allocates. One assignment puts every row in its slot, and the rows
        # going back in scratch (contiguous, in slot order) for the host writes.
        _put_rows(self.weights, target, weights)
        for name, values in (states or {}).items():
            _put_rows(self.states[name], target, values)
        if write_rest is not None:
            write_rest()
        self._finish_step()

    def _finish_step(self):
        self._step["steps"] = 1
        self.end_step()

    def end_step(self):
        """Close the step's accounts and advance the clock (also after a step that was abandoned)."""
        # A thread whose lookups all ran inside a backward (reentrant checkpointing's recompute) fetched
        # on no training forward of its own: its step's end makes it the training thread.
        self._note_training_thread()
        self.clock += 1
        divisor = self.sketch.next_step()
        if divisor != 1.0:
            self.score.div_(divisor)
        self.last_step = self._step
        for key, value in self._step.items():
            self.total[key] += value
        self._begin_step()

    def _note_training_thread(self):
        """Make this thread the training one (the only one :meth:`prefetch` serves), unless inside a backward.

        A forward inside a backward (activation checkpointing's recompute), and an optimizer
        step run by a gradient hook, run on a GPU on the autograd engine's thread of the
        device, while the thread that called backward() waits for it: that thread still
        trains, and its prefetch after the backward is due.
        """
        if not in_backward():
            self._thread = threading.get_ident()

    # ---------------------------------------------------------------- prefetch
    @_outside_inference_mode
    def prefetch(self, ids: torch.Tensor, in_step: Callable[[torch.Tensor], torch.Tensor],
                 check_bounds: Optional[Callable[[int, int], None]] = None) -> int:
        """Bring the rows of ``ids`` that are neither cached nor in the working set into the cache.

        Rows brought or already cached are pinned until the end of the step
        after the current one (the current step being the one a training
        forward would join now). Between steps that keeps them one step
        longer than needed if the ids are for the coming step, but a loop may
        prefetch the step after before the coming step's forward, and the
        cache cannot tell the two apart: only speed is at stake, never the
        arithmetic. As many rows are brought as there are evictable slots beyond the
        ones the current step's misses will need. On a GPU the copies run on a
        side stream and may still be running on return.

        Args:
            ids: validated ids (any order, duplicates allowed).
            in_step: which of some ids the current working set holds, as
                a bool mask (:meth:`WorkingSet.holds`); those rows are skipped (see
                the module docs).
            check_bounds: for ids not range-checked yet
                (:func:`~speedswap.convert.as_row_ids_deferred`): called with
                their smallest and largest value, read with this call's counts
                (on the CPU, where a read makes no wait, as soon as the ids
                are sorted), before anything changes.

        Returns:
            the number of rows brought from the host.

        Raises:
            IdError: from ``check_bounds``.
            StateError: called on another thread than the training one (see below).
        """
        if not self.num_slots or not len(ids) or self.viewed():
            if check_bounds is not None and len(ids):
                check_bounds(*read_bounds(ids))
            return 0
        # Nothing locks the bookkeeping: a prefetch landing inside a forward (between its lookup
        # and its fetch) or a step's store evicts rows they hold, and trains wrong values.
        if threading.get_ident() != self._thread:
            raise StateError(
                "prefetch was called on another thread than the one training this table (the last to "
                "run a training forward or optimizer.step() outside a backward, or to attach the optimizer "
                "before any): a prefetch landing inside a forward or a step would train wrong rows. Call "
                "it on the training thread, after a training forward or a step there, between the forward "
                "and optimizer.step() or between steps: on a GPU its copies run on a side stream in the "
                "background already")
        self._wait_prefetch()
        self._give_up_for_views()  # an evicted row is written back, clean or not
        # Sorted with each distinct id marked, not torch.unique: no host wait for its count.
        ids_sorted, _, first = sort_marking_firsts(ids)
        if check_bounds is not None and reads_are_free(ids_sorted):
            # On the CPU the bounds cost no wait: checked now, the stamps change in place (a copy of
            # 400 kB spared at a 50,000-row cache, whatever the prefetch brings).
            check_bounds(*ids_sorted.numpy()[[0, -1]].tolist())
            check_bounds = None
        found, slot = self._lookup(ids_sorted)
        # Out of place while the ids' bounds are not checked: until they are read below, nothing changes.
        # The step's own hits are pinned first, or the count of evictable slots would include them.
        stamp = self.stamp if check_bounds is None else self.stamp.clone()
        if not self._pinned:
            self._pin(stamp)
        stamp.scatter_reduce_(0, slot, torch.where(found, self.clock + 1, -1), "amax")
        # first and neither found nor in the step, as bools (one kernel, where & ~ is two); not
        # torch.isin, which makes a GPU's host wait.
        new = first > (found | in_step(ids_sorted))
        n_new, evictable = _read_checked([new.sum(), (stamp < self.clock).sum()], ids_sorted, check_bounds)
        if stamp is not self.stamp:
            self._retire(self.stamp)
            self.stamp = stamp
        self._pinned = True
        bring = min(n_new, evictable - self._n_misses)
        if bring <= 0:
            return 0
        # Every missing row a slot can be found for, however rarely used (see the module docs).
        rows, (_, victims) = ids_sorted.index_select(0, positions(new, n_new)[:bring]), self._victims(bring)
        # Every row they evict is written back, clean or not: counting the dirty ones would be a
        # host wait, and between flushes nearly every cached row is dirty (a step stored it).
        changed, changed_rows = self._evicted(victims, None)
        score = self.sketch.estimate(rows)
        if self._side is not None:
            # Copies wait for the current stream's earlier writes; the tensors
            # they read or write must outlive them on the side stream: the cache's
            # rows too, which a cache dropped before any stream waited for the
            # copies (an embedding collected right after a prefetch) would free
            # under them, for the allocator to hand out while they still write.
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            for tensor in (rows, victims, changed, changed_rows, self.weights, *self.states.values()):
                tensor.record_stream(self._side)
        self._waited.clear()  # every stream waits for the copies queued below
        # What may fail (the write-back's and the copies' allocations) runs before the slots
        # change hands: a failure leaves every slot describing its row.
        with self._on_side():
            self._write_back(changed, changed_rows)
            weights = self._gather_host(self.table, rows, torch.empty_like(self.weights[:bring]))
            states = {name: self._gather_host(table, rows, torch.empty_like(self.states[name][:bring]))
                      for name, table in self.state_tables.items()}
        # Brought from the host, the rows are clean: evicting them again writes nothing.
        self._take(victims, rows, self.clock + 1, score, False)
        with self._on_side():
            _put_rows(self.weights, victims, weights)
            for name, values in states.items():
                _put_rows(self.states[name], victims, values)
        moved = bring * (self._row_bytes + self._state_row_bytes * len(self.states))
        self._count(prefetched_rows=bring, rows_h2d=bring, bytes_h2d=moved)
        return bring

    # ------------------------------------------------------- whole-table access
    @_outside_inference_mode  # as fetch: what it keeps (a re-sorted index) is never an inference tensor
    def read(self, ids: torch.Tensor, *, counted: bool = False,
             check_bounds: Optional[Callable[[int, int], None]] = None) -> torch.Tensor:
        """The current value of rows ``ids`` (validated, duplicates allowed), in the table's dtype.

        Cached rows come from the cache, the others from the host, each once
        however often it repeats: the ids are sorted, which finds the repeats
        and speeds up the lookup, the uncached rows are gathered into scratch,
        and one gather over the cache's rows fills the result in id order.
        How many rows to gather is one host synchronisation, as in a training
        step, and it reads the ids' bounds for ``check_bounds`` too. There is
        none when nothing is cached (then every id's row is read from the host,
        one per id, as without a cache) or when every row of the table is, but
        the bounds' own read when ``check_bounds`` is given. Nothing the cache
        holds changes, its scratch rows included: its rows, stamps, counts,
        training counters and size stay as they are.
        Uncached rows beyond the scratch rows there are go into a temporary,
        freed on return (:meth:`_take_slots_and_spill` fills the result from
        it and the slots): grown scratch would keep their room, and that of
        every optimizer state, on the device for good.

        Args:
            ids: validated ids, but for their range when ``check_bounds`` is given.
            counted: an eval forward's read, counted in :data:`EVAL_COUNTERS`
                (the embedding's own reads are not).
            check_bounds: for ids not range-checked yet
                (:func:`~speedswap.convert.as_row_ids_deferred`): called with
                their smallest and largest value, read with this call's counts,
                before any row is read.

        Returns:
            ``(len(ids), dim)`` rows on the device.

        Raises:
            IdError: from ``check_bounds``.
        """
        self._wait_prefetch()
        self._give_up_for_views()
        out = torch.empty(len(ids), self.table.dim, dtype=self.table.dtype, device=self.device)
        held = self.num_slots - self._n_empty
        if not held or not len(ids):
            if check_bounds is not None and len(ids):
                check_bounds(*read_bounds(ids))
            hits, n_miss = 0, len(ids)
            self._gather_host(self.table, ids, out)
        else:
            # Sorting and the lookup are safe on ids out of range: no row is read before the check.
            rows, order, first = sort_marking_firsts(ids)
            found, slot = self._lookup(rows)
            if held == self.table.num_rows:  # each row has one slot at most: every row is cached
                hits, n_miss, missed = len(ids), 0, None
                _read_checked([], rows, check_bounds)
            else:
                missed = first > found  # each uncached row once; as bools, one kernel where & ~ is two
                # The read's one host synchronisation: its hits, how many rows the host sends, the bounds.
                hits, n_miss = _read_checked([found.sum(), missed.sum()], rows, check_bounds)
            # Misses beyond the scratch rows there are go to a temporary (see above).
            spill = None if n_miss <= len(self.weights) - self.num_slots else torch.empty(
                n_miss, self.table.dim, dtype=self.table.dtype, device=self.device)
            source = self._sources(rows, found, slot, n_miss, missed, into=spill)
            # Back in id order: the indices move, not the rows.
            source = torch.empty_like(source).index_copy_(0, order, source)
            if spill is None:
                _take_rows(self.weights, source, out)
            else:
                self._take_slots_and_spill(source, spill, len(ids) - hits, out)
        if counted:
            for key, value in (("forwards", 1), ("lookups", len(ids)), ("hits", hits), ("rows_h2d", n_miss),
                               ("bytes_h2d", n_miss * self._row_bytes)):
                self.eval_total[key] += value
        return out

    def _take_slots_and_spill(self, source, spill, n_spilled, out):
        """``out[i] =`` slot ``source[i]``, or ``spill[source[i] - num_slots]`` from ``num_slots`` on.

        Two sources, where :func:`_take_rows` gathers from one: every row is
        gathered from the one that holds most of them (the other's rows get
        its row 0 for now), then the other's rows, gathered apart, are put
        over them. That copies ``len(out)`` rows plus twice the fewer, where
        a gather from each and a ``torch.where`` copy three times ``len(out)``
        and hold two more results of its size.

        Args:
            source: int64 indices (:meth:`_sources` with ``into=spill``), one per row of ``out``.
            spill: the uncached rows, numbered from ``num_slots`` in ``source``.
            n_spilled: how many of ``source`` are ``>= num_slots``.
            out: the ``(len(source), dim)`` result, in :attr:`weights`' dtype.
        """
        spilled = source >= self.num_slots
        in_spill = source - self.num_slots
        if 2 * n_spilled <= len(source):  # most rows are cached
            _take_rows(self.weights, torch.where(spilled, 0, source), out)
            few, index, put, count = spill, in_spill, spilled, n_spilled
        else:
            _take_rows(spill, torch.where(spilled, in_spill, 0), out)
            few, index, put, count = self.weights, source, ~spilled, len(source) - n_spilled
        at = positions(put, count)
        _put_rows(out, at, few.index_select(0, index.index_select(0, at)))

    def flush(self):
        """Write every dirty cached row and its state back to the host; they stay cached (clean).

        Afterwards the host tables hold every row's current value, and on a GPU
        the writes have finished. Work queued on streams other than the current
        one (and the side stream) is not waited for: the caller orders it first
        (``wait_stream``), as torch asks for any tensor used across streams.
        """
        self._wait_prefetch()
        changed = torch.nonzero(self.dirty).squeeze(1)
        self._write_back(changed, self.slot_row[changed], self.total)
        self.dirty[changed] = False
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def drop_changes(self):
        """Forget which cached rows changed since they were last written back: :meth:`flush` writes none of them.

        For an owner whose host tables can no longer take the rows (a file
        truncated under its map) and that is told to drop them. The rows stay
        cached as they are until the cache goes.
        """
        self._wait_prefetch()  # a prefetch's writes of the flags first
        self.dirty.zero_()

    def reload_state(self):
        """Read every cached row's optimizer state from the host again (its state tables were reset).

        Flush first: a dirty row's state would be lost. The rows keep their
        slots, so a step whose rows are in flight still stores them where it
        expects; only the state values change.
        """
        self._wait_prefetch()
        held = torch.nonzero(self.slot_row >= 0).squeeze(1)
        if not len(held) or not self.states:
            return
        rows = self.slot_row[held]
        for name, table in self.state_tables.items():
            _put_rows(self.states[name], held, self._gather_host(
                table, rows, torch.empty_like(self.states[name][:len(held)])))
        # State alone crosses: bytes, but no table row (rows_h2d counts table rows, as everywhere).
        self.total["bytes_h2d"] += len(held) * self._state_row_bytes * len(self.states)

    def invalidate(self):
        """Forget every cached row without writing it back (the host tables were replaced).

        Raises:
            StateError: a step's rows are in flight (fetched, not yet stored):
                their slots would be forgotten while the step still writes to them.
        """
        if self._slot_parts:
            raise StateError("the device cache cannot be invalidated while a step's rows are in flight; "
                             "replace the tables between steps")
        self._wait_prefetch()
        self._forget()

    def _forget(self, keep: Optional[torch.Tensor] = None):
        """Free every slot but those ``keep`` marks (None: all), without writing a row back."""
        drop = torch.ones_like(self.dirty) if keep is None else ~keep
        slot_row = self.slot_row.masked_fill(drop, -1)
        n_empty = self.num_slots if keep is None else int((slot_row < 0).sum())
        self._reindex(slot_row)  # first: the one part that allocates (see _take)
        self.stamp.masked_fill_(drop, -1)
        self.score.masked_fill_(drop, -torch.inf)
        self.dirty.masked_fill_(drop, False)
        self._n_empty = n_empty

    def viewed(self) -> bool:
        """Whether a view of the tables handed out is alive (:attr:`HostTable.viewed`): then nothing is cached.

        Reads and writes through such a view reach the host tables directly,
        so while one lives the host holds every row's current value: a step
        writes its rows back and the cache keeps none, a prefetch brings
        none, and rows cached before are given up (:meth:`_give_up_for_views`).
        """
        return self.table.viewed or any(table.viewed for table in self.state_tables.values())

    def _warn_views(self):
        """Say, once, that a view kept alive keeps the cache from caching: it costs speed, unseen."""
        if not self._warned_views:
            self._warned_views = True
            if any(t.viewed_for_good for t in (self.table, *self.state_tables.values())):
                # A cloned state_dict does not help here: making it handed the tensor out already.
                warn("a device table's tensor was handed out (as_tensor(), state_dict(), getTorchVar()); "
                     "speedswap cannot tell when such a tensor and its views are gone, so the device cache "
                     "keeps no rows from now on, for the table's life. Checkpoint with emb.save (the "
                     "switchers' saveCupy or saveTorch), which copy the rows and leave the cache working")
                return
            warn("a view of the table or its optimizer state that to_numpy() or as_tensor() handed out "
                 "(or a kept state_dict(), whose tensors are such views) is still alive, so the device "
                 "cache keeps no rows until it is dropped: reads and writes through it must see every "
                 "row. Keep to_numpy(copy=True) (or a cloned state_dict) instead to let the cache work")

    def _views_handed_out(self) -> int:
        return self.table.views_handed_out + sum(t.views_handed_out for t in self.state_tables.values())

    def _give_up_for_views(self):
        """Forget the clean cached rows a step in flight does not hold while :meth:`viewed`, or after a
        view was handed out since the last call: a write through it may have changed their host copy.

        Handing a view out flushed the cache (``watch_reads``), and while one
        lives no step caches a row. A dirty row was stored since by a step
        whose forward came before the view was handed out, and which ended
        after it was dropped: its value wins, as a step's over any write through
        a view between its forward and its optimizer step; forgotten, the step
        would be lost. The step's own rows keep their slots for its :meth:`store`,
        which frees them.
        """
        handed_out = self._views_handed_out()
        new_views, self._views_seen = handed_out != self._views_seen, handed_out
        if self._n_empty == self.num_slots or not (new_views or self.viewed()):
            return
        keep = self.dirty.clone()
        for slots in self._slot_parts:
            keep[slots[slots >= 0]] = True
        self._forget(keep)

    def stats(self) -> dict:
        """Counters of the last step and since the cache was made, the step in progress included
        (see :data:`COUNTERS`), and of eval reads since it was made (:data:`EVAL_COUNTERS`)."""
        return {"last_step": dict(self.last_step),
                "total": {key: value + self._step[key] for key, value in self.total.items()},
                "eval": dict(self.eval_total),
                "cache_rows": self.num_slots, "cache_bytes": self.nbytes}
