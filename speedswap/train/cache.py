"""A write-back device cache of hot rows and their optimizer state, with next-batch prefetch.

Real ids are Zipf-distributed: a few percent of the rows take most lookups.
:class:`RowCache` keeps ``num_slots`` rows, and the optimizer-state rows that
go with them, in device memory, so a hot row stops crossing the bus every step.

**Exactness.** The authoritative copy of every row (and of its state) is in
exactly one place: a cache slot while the row is cached, the host tables
otherwise. Rows enter the cache only after a step (their updated values, from
the working set) or by :meth:`RowCache.prefetch` (read from the host, where
they are authoritative); a row leaves it only by eviction or
:meth:`RowCache.flush`, which write the row and its state back together. A
step reads each new row from where it is authoritative, so training with a
cache does the same arithmetic as without one.

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

**Bookkeeping** is five ``(num_slots,)`` device tensors (row per slot, -1 when
empty; the step each slot is pinned until; its row's count; sorted rows and
their slots for ``searchsorted``) and the ``(2, ~4 num_slots)`` sketch: it never grows with the
vocabulary. Host synchronisations: one per training
forward (how many rows hit), one per step (how many slots may be evicted) and
one per prefetch (how many rows to bring), the same order as the
``torch.unique`` the working set already does. On a GPU a prefetch's copies
run on a side stream; every other call makes the current stream wait for it.
"""

import contextlib

import torch

from ..table import HostTable
from .sketch import FrequencySketch

__all__ = ["RowCache", "COUNTERS"]

#: The names of :meth:`RowCache.stats`' counters.
COUNTERS = ("steps", "lookups", "unique_rows", "hits", "misses", "rows_h2d", "bytes_h2d",
            "rows_d2h", "bytes_d2h", "evictions", "prefetched_rows")

#: Sketch counters per cache slot: enough that collisions rarely lift a cold row's count.
_SKETCH_COUNTERS_PER_SLOT = 4


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


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
        self.sketch = FrequencySketch(_SKETCH_COUNTERS_PER_SLOT * max(n, 1), device)
        # Each slot's row count as of its last use (-inf when free): ranking the slots
        # needs no hashing of every slot, and an unused row's count does not change.
        self.score = torch.full((n,), -torch.inf, dtype=torch.float32, device=device)
        self.weights = torch.empty((n, dim), dtype=table.dtype, device=device)
        self.states = {name: torch.empty((n, dim), dtype=state_dtype, device=device)
                       for name in state_tables}
        self._row_bytes = dim * _itemsize(table.dtype)
        self._state_row_bytes = dim * _itemsize(state_dtype)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" and n else None
        self.clock = 0  # the current step; stamps below it are evictable
        self._n_empty = n
        self._reindex()
        self.total = dict.fromkeys(COUNTERS, 0)
        self.last_step = dict.fromkeys(COUNTERS, 0)
        self._begin_step()

    # ------------------------------------------------------------ bookkeeping
    @property
    def nbytes(self) -> int:
        """Device bytes the cache holds: rows, state rows and bookkeeping."""
        if not self.num_slots:
            return 0
        per_slot = self._row_bytes + self._state_row_bytes * len(self.states) + 4 * 8 + 4
        return self.num_slots * per_slot + self.sketch.nbytes

    def _reindex(self):
        self._sorted_rows, self._sorted_slots = torch.sort(self.slot_row)

    def _begin_step(self):
        self._step = dict.fromkeys(COUNTERS, 0)
        self._hit_pos, self._hit_slot, self._miss_pos = [], [], []
        self._n_hits = self._n_misses = 0

    def _lookup(self, rows):
        """(found, slot) for unique ``rows``: slot is meaningful where found."""
        pos = torch.searchsorted(self._sorted_rows, rows).clamp_(max=self.num_slots - 1)
        return self._sorted_rows[pos] == rows, self._sorted_slots[pos]

    def _wait_prefetch(self):
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

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

    def _write_host(self, rows, weights, states, counters=None):
        """Write rows (and their state, when given) back to the host tables."""
        self.table.scatter_validated(rows, weights.to(self.table.dtype))
        moved = len(rows) * self._row_bytes
        if states is not None:
            for name, table in self.state_tables.items():
                table.scatter_validated(rows, states[name])
            moved += len(rows) * self._state_row_bytes * len(states)
        counters = self._step if counters is None else counters
        counters["rows_d2h"] += len(rows)
        counters["bytes_d2h"] += moved

    def _take(self, slots, rows, stamp, score):
        """Give ``slots`` (cheapest first, free ones first) to ``rows``: the bookkeeping half.

        Returns:
            (held, held_rows): the slots that held rows, and those rows, which
            :meth:`_write_back` must write to the host before the slots are refilled.
        """
        free = min(len(slots), self._n_empty)
        self._n_empty -= free
        held = slots[free:]
        held_rows = self.slot_row[held]
        self.slot_row[slots] = rows
        self.stamp[slots] = stamp
        self.score[slots] = score
        self._reindex()
        self._count(evictions=len(held))
        return held, held_rows

    def _write_back(self, held, held_rows):
        if len(held):
            self._write_host(held_rows, self.weights[held],
                             {name: s[held] for name, s in self.states.items()})

    def _fill(self, slots, weights, states):
        # index_copy_/index_select: on the CPU several times faster than index_put_.
        self.weights.index_copy_(0, slots, weights.to(self.weights.dtype))
        for name, values in states.items():
            self.states[name].index_copy_(0, slots, values)

    def _victims(self, count):
        """The ``count`` slots cheapest to give up, and their scores, cheapest first.

        Free slots score -inf, pinned ones (rows of this step, prefetched rows)
        +inf, the others their row's use count.
        """
        score = torch.where(self.stamp < self.clock, self.score, torch.inf)
        return torch.topk(score, count, largest=False, sorted=True)

    # ---------------------------------------------------------------- the step
    def fetch(self, rows: torch.Tensor, out: torch.Tensor, first: int, lookups: int):
        """Fill ``out`` with the rows new to the working set: hits from the cache, misses from the host.

        Args:
            rows: the new rows (unique, validated), working-set slots
                ``first..first+len(rows)-1``.
            out: ``(len(rows), dim)`` rows of the working-set parameter.
            first: the working-set slot of ``rows[0]``.
            lookups: the ids the forward looked up (for the counters).
        """
        self._wait_prefetch()
        self._count(lookups=lookups, unique_rows=len(rows))
        if not len(rows):
            return
        if self.num_slots:
            self.sketch.add(rows)
        n_hit = 0
        if self.num_slots:
            found, slot = self._lookup(rows)
            n_hit = int(found.sum())
        if n_hit == 0:
            self._gather_host(self.table, rows, out)
            self._miss_pos.append(torch.arange(first, first + len(rows), device=self.device))
            self._record_misses(len(rows))
            return
        order = torch.argsort((~found).to(torch.uint8), stable=True)  # hits first
        hit, miss = order[:n_hit], order[n_hit:]
        hit_slot = slot[hit]
        out.index_copy_(0, hit, self.weights.index_select(0, hit_slot).to(out.dtype))
        # A row this step uses must outlive the step: eviction takes stamps below the clock.
        self.stamp[hit_slot] = torch.clamp(self.stamp[hit_slot], min=self.clock)
        self.score[hit_slot] = self.sketch.estimate(rows[hit])
        if len(miss):
            out.index_copy_(0, miss, self._gather_host(
                self.table, rows[miss], torch.empty(len(miss), out.shape[1], dtype=out.dtype,
                                                    device=out.device)))
        self._hit_pos.append(hit + first)
        self._hit_slot.append(hit_slot)
        self._miss_pos.append(miss + first)
        self._n_hits += n_hit
        self._count(hits=n_hit)
        self._record_misses(len(miss))

    def _record_misses(self, count):
        self._n_misses += count
        self._count(misses=count, rows_h2d=count, bytes_h2d=count * self._row_bytes)

    def _positions(self):
        def cat(parts):
            return (torch.cat(parts) if parts
                    else torch.empty(0, dtype=torch.int64, device=self.device))
        return cat(self._hit_pos), cat(self._hit_slot), cat(self._miss_pos)

    def read_state(self, rows: torch.Tensor, views: dict):
        """Fill the optimizer's state ``views`` for the step's ``rows``: hits from the cache.

        Args:
            rows: the working set's rows, by slot.
            views: ``{name: (len(rows), dim) tensor}`` to fill.
        """
        self._wait_prefetch()
        hit_pos, hit_slot, miss_pos = self._positions()
        for name, view in views.items():
            table = self.state_tables[name]
            if self._n_hits == 0:
                table.gather_validated(rows, view)
                continue
            view.index_copy_(0, hit_pos, self.states[name].index_select(0, hit_slot))
            if len(miss_pos):
                view.index_copy_(0, miss_pos, self._gather_host(
                    table, rows[miss_pos], torch.empty(len(miss_pos), view.shape[1],
                                                       dtype=view.dtype, device=view.device)))
        self._count(bytes_h2d=self._n_misses * self._state_row_bytes * len(views))

    def store(self, rows: torch.Tensor, weights: torch.Tensor, states):
        """End the step: every row of the working set goes to the cache, or back to the host.

        Hits are updated in their slots; misses take free slots, or the slots
        of rows used less often (whose rows and state are written back first);
        misses left over, or all of them when torch skipped the parameter
        (``states`` is None), are written back to the host.

        Args:
            rows: the working set's rows, by slot.
            weights: ``(len(rows), dim)`` updated rows.
            states: ``{name: (len(rows), dim)}`` updated state, or None.
        """
        self._wait_prefetch()
        hit_pos, hit_slot, miss_pos = self._positions()
        if self._n_hits:
            self._fill(hit_slot, weights.index_select(0, hit_pos),
                       {name: values.index_select(0, hit_pos)
                        for name, values in (states or {}).items()})
        cached = 0
        if self._n_misses and self.num_slots and states is not None:
            # Misses by use count, most used first, against slots by score, cheapest first:
            # "miss i beats victim i" holds for a prefix, the misses admitted.
            candidates = min(self._n_misses, self.num_slots)
            victim_score, victims = self._victims(candidates)
            miss_score, ranked = torch.sort(self.sketch.estimate(rows[miss_pos]), descending=True)
            miss_pos = miss_pos[ranked]
            cached = int((miss_score[:candidates] > victim_score).sum())
        if cached:
            placed, victims = miss_pos[:cached], victims[:cached]
            self._write_back(*self._take(victims, rows[placed], self.clock, miss_score[:cached]))
            self._fill(victims, weights[placed],
                       {name: values[placed] for name, values in states.items()})
        rest = miss_pos[cached:]
        if len(rest) == len(rows):
            # Nothing cached this step (always so with cache_rows=0): the rows go back as they
            # are, without gathering copies of the working set.
            self._write_host(rows, weights, states)
        elif len(rest):
            self._write_host(rows[rest], weights[rest],
                             None if states is None else {n: v[rest] for n, v in states.items()})
        self._step["steps"] = 1
        self.end_step()

    def end_step(self):
        """Close the step's accounts and advance the clock (also after a step that was abandoned)."""
        self.clock += 1
        self.score.div_(self.sketch.next_step())
        self.last_step = self._step
        for key, value in self._step.items():
            self.total[key] += value
        self._begin_step()

    # ---------------------------------------------------------------- prefetch
    def prefetch(self, ids: torch.Tensor, working_rows: torch.Tensor) -> int:
        """Bring the rows of ``ids`` that are neither cached nor in the working set into the cache.

        Rows brought or already cached are pinned until the end of the next
        step. As many rows are brought as there are evictable slots beyond the
        ones the current step's misses will need. On a GPU the copies run on a
        side stream and may still be running on return.

        Args:
            ids: validated ids (any order, duplicates allowed).
            working_rows: the current working set's rows (skipped: see the module docs).

        Returns:
            the number of rows brought from the host.
        """
        if not self.num_slots or not len(ids):
            return 0
        self._wait_prefetch()
        unique = torch.unique(ids)
        found, slot = self._lookup(unique)
        self.stamp.scatter_reduce_(0, slot, torch.where(found, self.clock + 1, -1), "amax")
        new = ~found & ~torch.isin(unique, working_rows)
        n_new, evictable = torch.stack([new.sum(), (self.stamp < self.clock).sum()]).tolist()
        bring = min(n_new, evictable - self._n_misses)
        if bring <= 0:
            return 0
        rows, (_, victims) = unique[new][:bring], self._victims(bring)
        held, held_rows = self._take(victims, rows, self.clock + 1, self.sketch.estimate(rows))
        side = contextlib.nullcontext()
        if self._side is not None:
            # Copies wait for the current stream's earlier writes; the tensors
            # they read must outlive them on the side stream.
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            for tensor in (rows, victims, held, held_rows):
                tensor.record_stream(self._side)
            side = torch.cuda.stream(self._side)
        with side:
            self._write_back(held, held_rows)
            self._fill(victims, self._gather_host(self.table, rows, torch.empty_like(self.weights[:bring])),
                       {name: self._gather_host(t, rows, torch.empty_like(self.states[name][:bring]))
                        for name, t in self.state_tables.items()})
        moved = bring * (self._row_bytes + self._state_row_bytes * len(self.states))
        self._count(prefetched_rows=bring, rows_h2d=bring, bytes_h2d=moved)
        return bring

    # ------------------------------------------------------- whole-table access
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The current value of rows ``ids`` (validated, duplicates allowed), in the table's dtype."""
        self._wait_prefetch()
        out = torch.empty(len(ids), self.table.dim, dtype=self.table.dtype, device=self.device)
        self._gather_host(self.table, ids, out)
        if self.num_slots and len(ids):
            found, slot = self._lookup(ids)
            out = torch.where(found.unsqueeze(1), self.weights[slot], out)
        return out

    def flush(self):
        """Write every cached row and its state back to the host; they stay cached (clean).

        Afterwards the host tables hold every row's current value, and on a GPU
        the writes have finished.
        """
        self._wait_prefetch()
        held = torch.nonzero(self.slot_row >= 0).squeeze(1)
        if len(held):
            self._write_host(self.slot_row[held], self.weights[held],
                             {name: s[held] for name, s in self.states.items()}, self.total)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def invalidate(self):
        """Forget every cached row without writing it back (the host tables were replaced)."""
        self._wait_prefetch()
        self.slot_row.fill_(-1)
        self.stamp.fill_(-1)
        self.score.fill_(-torch.inf)
        self._n_empty = self.num_slots
        self._reindex()

    def stats(self) -> dict:
        """Counters of the last step and since the cache was made (see :data:`COUNTERS`)."""
        return {"last_step": dict(self.last_step), "total": dict(self.total),
                "cache_rows": self.num_slots, "cache_bytes": self.nbytes}
