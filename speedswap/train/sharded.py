"""ShardedOffloadedEmbedding: one embedding table row-sharded over ``torch.distributed`` ranks.

Each rank holds a contiguous range of rows (see :mod:`speedswap.train.exchange`
for the split) and their optimizer state, in its own host memory. Every rank
calls the module on its own batch; ids travel to the rank that owns them, the
rows come back, and at ``optimizer.step()`` every row's gradient travels to
its owner, which sums the contributions of all ranks and steps the row once.

A separate class rather than a flag on :class:`~speedswap.OffloadedEmbedding`:
its forward and step are collectives that every rank must enter together,
its ``weight`` holds owned rows rather than the rows this rank looked up, and
its checkpoints are per shard; a flag would put two contracts behind one name.

Run in one process (``torch.distributed`` not initialised) it is one shard
owning every row, which is how sharded checkpoints are read for evaluation:

>>> import torch, speedswap as ss
>>> emb = ss.ShardedOffloadedEmbedding(100, 4, max_rows=16, storage="pageable", backend="numpy")
>>> emb.row_range, emb.world_size
(range(0, 100), 1)
>>> opt = torch.optim.Adam(emb.parameters(), lr=0.01)
>>> emb.attach(opt)
>>> emb(torch.tensor([[3, 99], [3, 5]])).pow(2).sum().backward(); opt.step()
"""

import collections
import contextlib
import copy
import functools
import itertools
import os
import weakref
import zlib
from typing import Callable, NoReturn, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..atomic import PathLike, as_path
from ..backends import get_backend
from ..backends.resolve import BackendLike, DeviceLike
from ..convert import Ids, as_row_ids, as_row_ids_deferred, bool_option, int_option
from ..errors import FileFormatError, OptionError, StateError
from ..table import HostTable
from .checkpoint import file_in
from .conversions import (RefusesConversion, gives_new_storage, refuse_conversion, refuse_new_parameter,
                          refuse_new_storage)
from .exchange import (BUILD, EVAL_FORWARD, EXCHANGE, GRAD_NORM, LOAD, LOAD_TABLE, SAVE, STEP, TRAIN_FORWARD,
                       Exchange, count_by_owner, owner_starts, owners, row_bounds, run_everywhere)
from .module_state import check_tables_state, checked_scalar_state, copy_tables, tables_state, unpicklable
from .one_optimizer import claim
from .one_process import OneProcess
from .one_thread import OneThread, one_thread
from .options import (embedding_dtype, embedding_flags, forward_ids, max_rows_option, outside_function_transforms,
                      padding_option, refuse_bag_arguments, refuse_max_norm, refuse_other_arguments)
from .reached import KeptRows, ReachedRows, in_backward, recomputed_on_engine_thread
from .row_state import (EmptySparseGradient, NarrowedStep, RowState, check_state_files, close_replaced,
                        drop_leftover_state, refuse_unasked_restart)
from .scratch_writes import ScratchWrites, same_memory, same_rows
from .step_hooks import StepHooks
from .sharded_checkpoint import all_unchanged, load_shards, ranks_on_this_machine, save_shards, stage_table_rows
from .working_set import WorkingSet
from .zero_marks import holds_nonzero, reads_as_zeroed

__all__ = ["ShardedOffloadedEmbedding", "INITIAL_BLOCK_ROWS"]

#: Rows of the whole table drawn from one seeded stream at build (see ShardedOffloadedEmbedding._draw_rows):
#: part of what a seed makes, so changing it changes every seeded table.
INITIAL_BLOCK_ROWS = 1024


class ShardedOffloadedEmbedding(RefusesConversion):
    """An ``nn.Embedding`` whose rows and optimizer state are split over the ranks of a process group.

    **Contract.** Like DDP, every rank of the group calls :meth:`forward` the
    same number of times per step (with its own ids, possibly none) and
    calls ``optimizer.step()`` every step: both are collectives. A step that
    is skipped (a loss that was not finite, a ``GradScaler`` that found infs)
    is skipped on every rank: ``optimizer.zero_grad()`` after its backward
    then drops its rows and gradients, as it drops a dense parameter's (or
    :meth:`discard_step` does, on every rank; after :meth:`exchange_gradients`,
    ``zero_grad(set_to_none=False)`` does too). Skipped before its backward,
    its forwards' rows wait for the next step, which puts back those that no
    backward reached. Every call starts with one message in which the
    ranks check that they make the same call (a forward, an
    :meth:`exchange_gradients`, a step, a save, a load) on embeddings built
    alike and in the same order (each rank's n-th table on the group meets
    its peers' n-th), with the same optimizer class and hyperparameters attached (or
    loaded) at the same step, and, at a step, that they agree on the rows
    they exchange; they raise ``StateError`` together if not, no row changed.
    A check one rank makes alone (bad ids, an optimizer state replaced by
    ``optimizer.load_state_dict()``) travels in that message too. As on a
    dense parameter, a step's gradient stays on :attr:`weight` until
    ``optimizer.zero_grad()``; a step that would apply it again (``step()``
    twice on one backward, no ``zero_grad()`` after a step) is refused with
    ``StateError``, nothing changed: its rows were written back. A training
    forward, step or :meth:`exchange_gradients` that fails on one rank after
    its last message (making the forward's output, summing the gradients that
    came to it, inside the optimizer or before writing the stepped rows back:
    they are written whole or not at all), when its peers are done, raises on
    that rank alone, its rows and their state unchanged: the same call again on
    that rank alone (with the same ids, for a forward) finishes it, with no
    message. A forward not run again trains nothing, as in memory; a rank that
    trains on without its failed step is refused at its next call, on every
    rank (its step count differs from its peers').

    **One thread at a time.** Each call, and a step from its first training
    forward to the ``optimizer.step()`` (or :meth:`discard_step`) that ends
    it (a step without a forward: its ``optimizer.step()``), belong to one
    thread (see :mod:`speedswap.train.one_thread`): a call
    from another thread meanwhile, an eval-mode forward too, raises
    ``StateError`` on this rank, before anything changes or any message is sent.

    **What is averaged.** A row's gradient is the sum over ranks of each
    rank's gradient for it, divided by the world size ``W``: the average DDP
    takes of a dense parameter. Training therefore equals one process that
    sees the union of the ranks' batches and minimises ``(1/W) * sum over
    ranks of each rank's loss`` (the mean loss when each rank averages over
    a batch of the same size). Each touched row is stepped once per step by
    its owner, lazily, as :class:`~speedswap.OffloadedEmbedding` steps rows
    (offloaded Adam equals ``SparseAdam``, and so on).

    **The optimizer.** Each rank builds its own optimizer over
    ``model.parameters()`` and :meth:`attach` es it. :attr:`weight` is the
    working set of the rows *this rank owns* that some rank touched this
    step (capacity ``min(W * max_rows, ceil(num_embeddings / W))``, equal on
    every rank); it gets its gradient from the exchange, not from autograd,
    so it has ``requires_grad=False`` and DDP leaves it alone (a rank's
    weight holds other rows than its peers'). Wrap the model in DDP as a
    whole; the dense parameters are averaged by DDP, the table here. A loss
    term over :attr:`weight` itself (an L2 penalty summed over
    ``model.parameters()``) is therefore a constant that trains no row,
    where in memory it trains the rows a step looks up: penalise those rows
    (``emb(ids).pow(2).sum()``) or use the optimizer's ``weight_decay``. A
    hook on :attr:`weight` (``register_hook``), which no backward would run,
    is refused with ``StateError`` (hook the lookup's output instead).

    The rows start as ``nn.Embedding``'s do, N(0, 1), and the whole table
    they make is the same at any world size: each block of
    :data:`INITIAL_BLOCK_ROWS` rows of the whole table is drawn from a stream
    of its own (numpy's PCG64, seeded by one draw from torch's global
    generator and the block's number), and each rank draws the blocks its rows
    are in. Ranks seeded alike (``torch.manual_seed(s)``, as DDP code does)
    so start from one table on 1, 2 or ``W`` ranks, whose shards never
    repeat each other; the values are not those ``nn.Embedding`` draws with
    torch's generator (that stream cannot skip to a rank's first row).

    ``state_dict()`` holds this rank's shard of the rows and of their
    optimizer state as ``<prefix>_extra_state`` (not :attr:`weight`, per-step
    scratch whose size depends on ``W``), with the rank, the world size and
    the rows: it loads only on the same rank of a group of the same size.
    :meth:`save` / :meth:`load` write one checkpoint of every rank's rows
    and the optimizer's step count, and reshard to any world size.

    Args:
        num_embeddings: rows of the whole table (at least the world size).
        embedding_dim: row length.
        max_rows: the most distinct rows *this rank* looks up in one step (required).
        process_group: the ranks sharing the table; None is the default
            group, or a single rank when ``torch.distributed`` is not initialised.
        storage: where this rank's rows and optimizer state live (as for
            :class:`~speedswap.OffloadedEmbedding`; ``mmap`` files go in
            ``path/rank<r>``).
        dtype: the rows' dtype (bfloat16 tables train in float32, as in
            :class:`~speedswap.OffloadedEmbedding`); None (the default) is
            torch's default dtype, as for ``nn.Embedding``.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``. Use NCCL for tables
            on a GPU and gloo for tables on the CPU: messages are built on
            the table's device.
        path: for ``storage="mmap"``, the directory for every rank's files.
        device: the CUDA device the rows move to.
        cache_rows: must be 0: a sharded table has no device cache of hot
            rows (:meth:`prefetch` and :meth:`flush` are refused too); the
            keyword exists so that code moved over from
            :class:`~speedswap.OffloadedEmbedding` is told so.
        padding_idx: as in ``nn.Embedding``: this row starts at zero (on the
            rank that owns it) and gets no gradient from any rank. As any
            row, it is stepped only at steps where some rank looked it up (a
            weight decay then shrinks a pretrained, non-zero padding row, as
            in :class:`~speedswap.OffloadedEmbedding`), and left alone at the
            others. Every rank must pass the same one.
        scale_grad_by_freq: as in ``nn.Embedding``: each forward scales a
            row's gradient by the inverse of how often its own ids name it,
            so each rank scales by the counts of its own batch, as DDP over
            ``nn.Embedding(scale_grad_by_freq=True)`` does. Every rank must pass the same one.
        sparse: accepted for ``nn.Embedding`` code; changes nothing. The
            owned rows' gradient is dense over the step's rows only, and
            ``torch.optim.SparseAdam`` trains it as it would a sparse one.
        max_norm: not supported (only None): ``nn.Embedding`` renormalises
            the rows it looks up in place, in eval forwards too, a write that
            the offloaded table does not make.
        norm_type: ``nn.Embedding``'s, for ``max_norm``; only the default.
        *positional: refused, saying which keywords ``nn.Embedding`` reads
            them as: every argument but the two sizes is taken by keyword.
        **others: refused, saying what to do instead: ``nn.Embedding``'s
            ``_weight`` and ``_freeze``, ``nn.EmbeddingBag``'s ``mode``,
            ``include_last_offset`` and ``per_sample_weights``.

    Building is a collective too: every rank of the group builds its
    shard, then the ranks agree in one message that every rank built one,
    alike. A rank that raises raises its own error, and every other rank a
    ``StateError`` naming it, at once (not at its next collective, after the
    process group's timeout).

    Raises:
        OptionError: bad sizes (no ``max_rows``), storage or ``padding_idx``, fewer rows than
            ranks, a ``cache_rows``; ``max_norm`` or ``norm_type`` given; a
            ``scale_grad_by_freq`` or ``sparse`` that is not a bool; a
            ``process_group`` this process is not a member of (on that rank alone).
        DTypeError: a dtype that is not floating point; a keyword argument
            it does not take, or a third positional one (a ``TypeError``, as
            Python's).
        PathError, OutOfMemoryError: this rank's ``mmap`` files or memory (as for
            :class:`~speedswap.OffloadedEmbedding`).
        StateError: another rank raised one of these; ranks whose tables differ
            (``num_embeddings``, ``embedding_dim``, ``max_rows``, ``dtype``,
            ``padding_idx``, ``scale_grad_by_freq``), or another call (a forward) on another rank: on
            every rank. Nothing is built on any rank (a shard made is released,
            its ``mmap`` file removed).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *positional, max_rows: Optional[int] = None,
                 process_group: Optional["torch.distributed.ProcessGroup"] = None, storage: str = "pinned",
                 dtype: Optional[torch.dtype] = None, backend: BackendLike = "auto",
                 path: Optional[PathLike] = None, device: DeviceLike = None,
                 cache_rows: int = 0, padding_idx: Optional[int] = None,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 max_norm: Optional[float] = None, norm_type: float = 2.0, **others):
        super().__init__()
        # Each call claims it, and a step holds it from its first training forward (a step without
        # one from its pre-hook) until the step ends (see _new_step and _begin_step): another
        # thread's call in between would drop the step, or undo it.
        self._one_process = OneProcess("this ShardedOffloadedEmbedding")
        self._one_thread = OneThread(
            "this ShardedOffloadedEmbedding",
            span="between a training forward and the optimizer.step() (or discard_step()) that ends "
                 "its step, or inside an optimizer.step()",
            step="each training step (its forwards, backward and optimizer.step())",
            release="a thread whose training forward began a step holds it until that step's "
                    "optimizer.step() or discard_step() (after a zero_grad() that dropped the step, "
                    "until its next call; after an optimizer.step() without a forward that raised, "
                    "until its next training forward or step)")
        # nn.Embedding's initialisation, the same table at any world size: one draw from torch's
        # global generator seeds every block's stream (see _draw_rows). A build that fails (on every
        # rank together, see _agree_built) puts the generator back on every rank: a refused build
        # changes nothing, and ranks of which some drew and some did not would stay apart.
        generator = torch.get_rng_state()
        seed = int(torch.randint(0, 2 ** 62, ()).item())
        try:
            error, resolved = None, None
            try:
                refuse_other_arguments(type(self).__name__, ShardedOffloadedEmbedding.__init__, positional, others, {
                    "_weight": "write this rank's rows into the table on every rank (emb.table.apply_(lambda t: "
                               "t.copy_(weight[emb.row_range.start:emb.row_range.stop]))), or emb.load(checkpoint)",
                    "_freeze": "look rows up in eval mode or under torch.no_grad(): forwards then read the table "
                               "and nothing trains"})
                if int_option(cache_rows, "cache_rows", minimum=0):
                    raise OptionError(f"cache_rows={cache_rows}: ShardedOffloadedEmbedding has no device cache; "
                                      f"its rows reach their owners through the exchange every step. Pass "
                                      f"cache_rows=0, or train in one process with OffloadedEmbedding(cache_rows=...)")
                refuse_max_norm("ShardedOffloadedEmbedding", max_norm, norm_type, "emb.table.apply_ on every rank")
                num_embeddings = int_option(num_embeddings, "num_embeddings")
                padding_idx = padding_option(padding_idx, num_embeddings)
                scale_grad_by_freq, sparse = embedding_flags(scale_grad_by_freq, sparse)
                path = None if path is None else as_path(path)
                embedding_dim = int_option(embedding_dim, "embedding_dim")
                max_rows = max_rows_option(max_rows, num_embeddings, "ShardedOffloadedEmbedding",
                                           "this rank in one step")
                dtype = embedding_dtype(dtype)
                self.num_embeddings, self.embedding_dim, self.max_rows = num_embeddings, embedding_dim, max_rows
                self.padding_idx = padding_idx
                self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
                self._storage = storage
                resolved = get_backend(backend, device)
            except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it (see _agree_built)
                error = exc
            # Its own errors (no torch.distributed, or a process_group without this process) have no
            # peer waiting for this rank: they raise here. Without a backend, messages go on the group's device.
            self._exchange = Exchange(process_group, None if resolved is None else resolved.device)
            self.rank, self.world_size = self._exchange.rank, self._exchange.world_size
            self.table = None
            if error is None:
                try:
                    self._build_shard(dtype, resolved, path, seed)
                except Exception as exc:  # noqa: BLE001 -- as above
                    error = exc
            self._agree_built(error)
        except BaseException:
            torch.set_rng_state(generator)
            raise

    def _build_shard(self, dtype: torch.dtype, backend, path: Optional[str], seed: int) -> None:
        """This rank's part of the constructor, from validated options: its shard of the table, the step's scratch."""
        num_embeddings, embedding_dim, max_rows = self.num_embeddings, self.embedding_dim, self.max_rows
        self.bounds = row_bounds(num_embeddings, self.world_size)
        self._starts = owner_starts(self.bounds, backend.device)
        shard_rows = self.bounds[self.rank + 1] - self.bounds[self.rank]
        self._path = None if path is None else os.path.join(path, f"rank{self.rank}")
        self.table = HostTable.empty(shard_rows, embedding_dim, dtype, self._storage, backend,
                                     file_in(self._path, "table", self._storage))
        self._draw_rows(seed)
        if self.padding_idx is not None and self.padding_idx in self.row_range:
            self.table.scatter([self.padding_idx - self.row_range.start],
                               torch.zeros(1, embedding_dim, dtype=dtype))
        compute = torch.float32 if dtype is torch.bfloat16 else dtype
        device = self.table.device
        # Each rank looks up at most max_rows distinct rows per step, so an owner
        # receives at most W * max_rows: the owned working set can never overflow
        # after the lookups passed their own checks (nothing fails between collectives).
        capacity = min(self.world_size * max_rows, self.bounds[1] - self.bounds[0])
        self.weight = torch.nn.Parameter(
            torch.zeros(capacity, embedding_dim, dtype=compute, device=device), requires_grad=False)
        # No backward reaches weight: torch's own refusal of a hook on it says nothing of why (see _refuse_hook).
        for method in ("register_hook", "register_post_accumulate_grad_hook"):
            setattr(self.weight, method, functools.partial(_refuse_hook, method))
        self._full = self.weight.data
        # A write into the scratch between steps (nn.init.normal_(emb.weight)) reaches no row: refused
        # at the next training forward, or (through weight.data, before it) at the first attach.
        self._scratch_writes = ScratchWrites(self.weight)
        self._owned = WorkingSet(capacity, device)          # shard-local ids of owned rows
        self._looked_up = WorkingSet(                       # global ids this rank asked for
            max_rows, device,
            table=f"the ShardedOffloadedEmbedding({num_embeddings}, {embedding_dim})'s table",
            larger=f"a larger max_rows (max_rows={max_rows} now, on every rank)")
        # The rows this rank looked up, as the leaf autograd sums their gradients into.
        self._rows = torch.zeros(max_rows, embedding_dim, dtype=compute, device=device,
                                 requires_grad=True)
        self._grad = torch.zeros_like(self._full)
        # A bfloat16 table's owned rows in its own dtype, on their way from it (_gather_owned) and back
        # (_end_step): made here, so that the write-back, once it wrote the rows' optimizer state, needs
        # no memory to write the rows (out of memory there left the state stepped and the rows not).
        self._in_table_dtype = None if dtype == compute else torch.empty_like(self._full, dtype=dtype)
        # Where the ids the peers ask for in a training forward arrive: each asks for at most
        # max_rows new rows of this shard a forward. Made here, where a failure is agreed on
        # (_agree_built), not between a forward's messages, whose agreement would cost one more.
        self._asked = torch.empty(self.world_size * min(max_rows, shard_rows), dtype=torch.int64, device=device)
        # What the gradient placeholder holds in its last element until the exchange (see
        # _note_backward): the smallest normal number, which a rescale changes and a norm hardly sees.
        self._mark = torch.finfo(compute).tiny
        # What the exchange writes into an exchanged gradient left at zero (see _mark_zero_gradient).
        self._zero_marks = torch.tensor([-0.0, 0.0], dtype=compute, device=device)
        self._state = None
        # Where the attached optimizer's state came from (_ATTACHED, _LOADED) and the steps taken
        # since: equal on every rank that attaches, loads and steps alike, so that a rank that
        # attached alone (its state restarted, its peers' not) is refused at the next call.
        self._state_origin, self._steps_since = 0, 0
        self._hooks = None  # StepHooks on the attached optimizer
        self._claim = None  # refuses other optimizers' steps over weight (see attach)
        self._created = {}  # mmap state files this embedding made and may replace: RowState.made_files
        # A backward reaching the looked-up rows gives `weight` a gradient for the optimizer's
        # zero_grad() to drop: a step whose gradient is gone is then discarded, not taken.
        self._backward_ran = False
        self._rows.register_post_accumulate_grad_hook(_note_backward(weakref.ref(self)))
        self._narrowed = None
        self._agreed = False  # see _new_step
        self._empty_sparse = None  # an EmptySparseGradient while a step without rows is under way
        # Whether a step without rows on the kept zero gradient is under way: the optimizer counts it
        # (Adam's step), and _abort_step takes the count back for a retry.
        self._empty_counted = False
        self._reached = ReachedRows(dropped=_gradient_dropped(weakref.ref(self)))
        self._total, self._last_step = dict.fromkeys(_COUNTERS, 0), dict.fromkeys(_COUNTERS, 0)  # see stats()
        self._new_step()
        self.table.watch_writes(self._prepare_table_write)  # see _prepare_table_write

    def _draw_rows(self, seed: int) -> None:
        """Fill this rank's shard with its rows of the N(0, 1) table ``seed`` makes at any world size.

        Block ``b`` of the whole table (rows ``b * INITIAL_BLOCK_ROWS`` up to
        the next block's) is ``standard_normal`` values, row after row, from numpy's PCG64 seeded with
        ``SeedSequence(seed, spawn_key=(b,))``: independent streams (torch's
        generator takes only 32 bits of a seed, and the 2**32 streams it has
        would repeat blocks between tables). Each rank draws the part of each
        of its blocks up to its last row: at most one block's rows more than it owns.
        """
        start, stop, dim = self.row_range.start, self.row_range.stop, self.embedding_dim

        def fill(shard: torch.Tensor) -> None:
            drawn = np.float64 if shard.dtype == torch.float64 else np.float32  # others round from float32
            # Drawn straight into the rows where numpy can write them (host memory of the drawn dtype).
            direct = shard.device.type == "cpu" and shard.dtype in (torch.float32, torch.float64)
            for first in range(start - start % INITIAL_BLOCK_ROWS, stop, INITIAL_BLOCK_ROWS):
                block = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
                    seed, spawn_key=(first // INITIAL_BLOCK_ROWS,))))
                if first < start:
                    block.standard_normal((start - first, dim), dtype=drawn)  # the rows before this rank's
                rows = shard[max(first, start) - start:min(first + INITIAL_BLOCK_ROWS, stop) - start]
                if direct:
                    block.standard_normal(dtype=drawn, out=rows.numpy())
                else:
                    rows.copy_(torch.from_numpy(block.standard_normal(tuple(rows.shape), dtype=drawn)))
        self.table.apply_(fill)

    def _agree_built(self, error: Optional[BaseException]) -> None:
        """End the constructor with one message: every rank built its shard, alike, or every rank raises.

        A rank that raised alone (an option refused there only, a ``path``
        it cannot use, memory it cannot have) would leave its peers waiting
        in their next collective until the process group's timeout; ranks
        that built unlike tables (another size, dtype, ``max_rows``,
        ``padding_idx``) would learn it only at their first forward.

        Raises:
            ``error`` on the rank that met it; on the others (on every rank
            for the rest) StateError: a rank failed, another call on another
            rank, or ranks whose tables differ. Every rank's shard is then
            released (and its ``mmap`` file removed: a retry makes it again).
        """
        # Which table of the group this is, counted once built on every rank (a failed build counts
        # on none): ranks calling tables built alike in another order (a then b here, b then a
        # there) would pair one table's messages with another's.
        self._number = _BUILT[self._exchange.ranks] + 1
        try:
            # A rank that failed sends zeros for its config: its error is raised before any config is read.
            config = [0] * _CONFIG_LENGTH if error else self._config(with_optimizer=False)
            self._exchange.begin(BUILD, error, config, _describe, "building a ShardedOffloadedEmbedding")
        except BaseException:
            if self.table is not None:
                made = self.table.path
                self.table.close()
                if made is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(made)
            raise
        _BUILT[self._exchange.ranks] += 1

    def _new_step(self):
        self._restore_narrowed()
        self._release_agreed_state()
        self._owned.clear()
        self._looked_up.clear()
        self._sent_to_me = [[] for _ in range(self.world_size)]  # owned slots, per source, per call
        self._forwards = 0
        # weight's version once the step's last training forward had gathered its rows: one that differs
        # at the next forward was written in place in the middle of the step (see _refuse_forward_after_write).
        self._version_at_lookup = None
        # Whether the owned working set holds rows of a step zero_grad() dropped, changed through
        # weight.data since (SAM's perturbation): the next forwards read them (see _drop_zeroed_step).
        self._carried = False
        self._moved = dict.fromkeys(_FORWARD_COUNTERS, 0)  # the step's forwards', for stats()
        self._rows.grad = None
        self.weight.grad = None
        self._backward_ran = False
        self._reached.clear()
        self._kept = self._put_back = None
        self._exchanged = self._late_backward = False
        # Whether the step's messages all went (_begin_step), and the exchange's message, while the
        # local work after it is still to do (_take_gradients): a retry on this rank finishes alone.
        self._agreed, self._arrived = False, None
        self._unfinished = None  # (ids, slots) of a training forward that failed after its messages: see _look_up
        self._placeholder_version = None
        # The version of the gradient the last step left on `weight`, while weight.grad holds it
        # (see _leftover_unchanged); and whether a backward of this step found it not zeroed.
        self._leftover_version, self._stale = None, False
        self._zero_kept = False  # see _keep_zero_grad
        self._one_thread.hold(False)  # the step's claim, taken by its first training forward

    @one_thread
    def discard_step(self) -> None:
        """Drop the rows and gradients of the forwards since the last step, whose step will not run.

        Call it on every rank (the step is skipped everywhere, as DDP needs);
        ``optimizer.zero_grad()`` after the backward does it by itself
        (``set_to_none=False`` too once :meth:`exchange_gradients` ran; before
        the next forward; after it, the skipped gradient is dropped and the
        skipped forwards' rows wait unchanged, as rows no backward reached).
        The rows and their optimizer state stay as they were.

        A gradient :attr:`weight` holds is zeroed, not dropped: after
        ``zero_grad(set_to_none=False)`` an in-memory table's gradient is
        zeros, and an ``optimizer.step()`` on it still counts (Adam's step).
        """
        had_grad, in_step = self.weight.grad is not None, self._forwards
        self._new_step()
        if in_step and not same_memory(self.weight.data, self._full):
            # Assigned in the step (SAM's p.data = p.data + e, refused at the next forward): dropped with
            # it, as a write in place is below, not refused again as an initialiser's between steps.
            self.weight.data = self._full
        self._scratch_writes.note_own(self.weight)  # a step that failed in its optimizer wrote the scratch
        if had_grad:
            self._keep_zero_grad()

    def _keep_zero_grad(self) -> None:
        """Give :attr:`weight` a zero gradient between steps, as ``zero_grad(set_to_none=False)`` leaves in memory.

        Not None: torch steps a parameter with a zero gradient (Adam counts the
        step) where it skips one with None. A step without a backward then
        moves no row, lazily (see :meth:`_begin_step` and :meth:`_exchange_gradients`).
        """
        self.weight.grad = self._grad.zero_()
        self._zero_kept = True

    def _holds_kept_zero(self) -> bool:
        """Whether :attr:`weight`'s gradient is the zeros :meth:`_keep_zero_grad` left (no backward since)."""
        return self._zero_kept and self.weight.grad is self._grad

    @one_thread
    def _prepare_table_write(self):
        """Refuse a write into this rank's shard that the step in flight would undo (:meth:`HostTable.watch_writes`).

        The rows of the shard that a step's forwards (on any rank) looked up
        are gathered at the forward and written back at the step, over
        whatever was written into them meanwhile; a step skipped before its
        backward keeps them for the next step.

        Raises:
            StateError: rows of the shard are in a step; nothing changes.
        """
        self._abort_step()
        self._drop_zeroed_step(carry=True)  # rows SAM moved stay in the step: refused below, as any step's
        if self._owned.size:
            raise StateError("a write into this rank's shard between a training forward and optimizer.step() "
                             "would be undone by the step, which writes the rows it gathered back; write "
                             "between steps (after a step skipped before its backward, call "
                             "emb.discard_step() first, on every rank)")

    def _drop_zeroed_step(self, *, exchanged: bool = True, carry: bool = False) -> Optional[StateError]:
        """Discard the step if ``zero_grad()`` dropped its gradient after a backward.

        Args:
            exchanged: also discard a step whose gradient ``zero_grad(set_to_none=False)``
                zeroed after :meth:`exchange_gradients` (a step a ``GradScaler`` skipped),
                keeping the zero gradient, as in memory. The step passes False: it takes
                such a step, moving no row, on every rank alike (see :meth:`_begin_step`).
            carry: a training forward's call, or a call that refuses a step in flight (a
                table write, save, load_state_dict): owned rows changed through ``weight.data``
                since they were gathered (SAM perturbs them between two passes over a batch,
                with a ``zero_grad()`` between) stay in the owned working set, in their slots
                of :attr:`weight`, for this forward and the step to read and write back; the
                rest of the step is dropped (every rank looks its rows up again, from their
                owners, so that each reads them as changed). Costs a gather of the owned rows,
                on this path only. Decided by each rank for its own rows: a rank whose rows
                are unchanged drops them, which its table holds as they are.

        Returns:
            With ``carry``, the refusal for the forward to raise on every rank (other callers
            refuse the step it leaves in flight), nothing dropped (rows changed while a view of
            the table is alive; :attr:`weight` written in place, or its ``.data`` assigned,
            since the step's last forward), or None.
        """
        if self._backward_ran and self.weight.grad is None:
            drop = self._new_step
        elif exchanged and self._zeroed_since_exchange():
            drop = self.discard_step
        else:
            return None
        if carry and self._version_at_lookup is not None and self.weight._version != self._version_at_lookup:
            # Written in place (p.add_(e) under no_grad()): whether it reached rows the step does not hold
            # (weight.mul_(0.5) reaches every row in memory) cannot be told, as for any forward after one.
            return StateError(_WRITTEN_BEFORE_DROP)
        if carry and not same_memory(self.weight.data, self._full):
            # Assigned (p.data = p.data + e): the owned rows are in weight's own storage, unmoved, and the
            # assigned tensor's slots cannot be told to hold them (see _DATA_ASSIGNED). Dropping the step
            # here lost the move, and the next forward refused the tensor as an initialiser's, once.
            return StateError(_ASSIGNED_BEFORE_DROP)
        owned = None
        if carry and self._owned_rows_changed():
            if self.table.viewed:
                return StateError(
                    "the owned rows of the step zero_grad() dropped differ from this rank's table, and a view "
                    "the table handed out (to_numpy(), as_tensor()) is alive: a write through it cannot be told "
                    "from rows changed through emb.weight.data between two backwards (SAM), whose step goes on "
                    "and would write its rows back over the write. Nothing was changed: call emb.discard_step() "
                    "on every rank after zero_grad() of a skipped step, before writing through a view (or write "
                    "with emb.table.scatter), then go on")
            owned = copy.copy(self._owned)
        drop()
        if owned is not None:
            self._owned, self._carried = owned, True
        return None

    def _owned_rows_changed(self) -> bool:
        """Whether the owned rows in :attr:`weight` differ from this rank's table's values of them.

        A write through ``weight.data`` (``p.data.add_(e)``) keeps the weight's
        version, so the rows themselves are compared. NaN counts as equal to
        NaN: a row that diverged to NaN (the usual reason to skip a step) is
        unchanged, not perturbed.
        """
        k = self._owned.size
        if not k:
            return False
        table = self.table.gather_validated(
            self._owned.rows, torch.empty(k, self.embedding_dim, dtype=self.table.dtype, device=self.table.device))
        return not bool(same_rows(table.to(self._full.dtype), self._full[:k]).all())

    @property
    def row_range(self) -> range:
        """The rows this rank owns: ``range(bounds[rank], bounds[rank + 1])``."""
        return range(self.bounds[self.rank], self.bounds[self.rank + 1])

    @property
    def bytes_sent(self) -> int:
        """Bytes of ids, rows and gradients this rank has sent to other ranks so far."""
        return self._exchange.bytes_sent

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, max_rows={self.max_rows}, "
                f"rank={self.rank}, world_size={self.world_size}, rows={self.row_range.start}.."
                f"{self.row_range.stop - 1}, storage={self.table.storage!r}"
                + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}")
                + (", scale_grad_by_freq=True" if self.scale_grad_by_freq else "")
                + (", sparse=True" if self.sparse else ""))

    def _replicate_for_data_parallel(self):
        raise OptionError(
            "nn.DataParallel would copy a ShardedOffloadedEmbedding onto each GPU of this process, "
            "every copy gathering into and writing back the same shard, and exchanging rows in "
            "collectives the other ranks do not match: its rows would train wrongly or hang. Run "
            "one process per GPU with DistributedDataParallel instead")

    def __reduce_ex__(self, protocol):
        raise unpicklable(type(self).__name__)

    @one_thread
    def check_conversion(self, fn: Callable) -> None:
        refuse_conversion(type(self).__name__, fn, self.weight, self.table.dtype)
        refuse_new_parameter(type(self).__name__)
        if not self.table.closed and self._step_in_flight():
            refuse_new_storage(type(self).__name__, fn, self.weight, "optimizer.step()")
        if gives_new_storage(fn, self.weight):
            self._scratch_writes.take_back(self.weight, self._full)  # weight.data = ... before it: the user's
            self._scratch_writes.note_conversion()  # to_empty(): its memory is no write of the user's

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Save this rank's shard as ``<prefix>_extra_state`` alone: :attr:`weight` is scratch."""
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Restore this rank's shard; accept (and ignore) a ``weight`` key from any world size."""
        key = prefix + "_extra_state"
        if key in state_dict:
            self.set_extra_state(state_dict[key])
        else:  # saved by an older speedswap, whose state_dict() held nothing of this module
            missing_keys.append(key)

    def _layout(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size,
                "rows": [self.row_range.start, self.row_range.stop]}

    @one_thread
    def get_extra_state(self) -> dict:
        """This rank's shard of the table and of the optimizer's per-row state, for ``state_dict()``.

        Not a collective: each rank's ``state_dict()`` holds its own shard,
        with its rank, the world size and its rows, and loads only on the
        same rank of a group of that size (save one per rank). It also holds
        the steps the optimizer state has taken since :meth:`attach` or
        :meth:`load` (``"steps"``), which the ranks compare once restored, and the
        optimizer's scalar state for the shard (the step count). The tensors
        share the host tables' memory, as :class:`~speedswap.OffloadedEmbedding`'s do.

        Raises:
            StateError: a closed embedding.
        """
        self._check_open()
        self._abort_step()  # a step the optimizer raised inside counted itself in the scalar state: undone first
        optimizer = "" if self._state is None else type(self._state.optimizer).__name__
        scalars = None if self._state is None else self._state.scalar_state()
        return {**tables_state(type(self).__name__, self._tables(), optimizer, self.num_embeddings,
                               scalar_state=scalars, **self._layout()), "steps": self._steps_since}

    @one_thread
    def set_extra_state(self, state: dict) -> None:
        """Restore this rank's shard from :meth:`get_extra_state`'s state; everything is checked first.

        Not a collective, but every rank must load its own shard, of the same
        step: a rank that did not, or failed, or restored a state saved at
        another step than its peers' (each rank its own "latest" file), makes
        the next collective call raise ``StateError`` on every rank, no row
        changed: its optimizer state's history differs (the state's
        ``"steps"``; a state saved without it counts none). The optimizer's
        step count becomes the saved one, as :meth:`load` restores it (a state
        of an older speedswap, which holds none, is treated as
        :meth:`OffloadedEmbedding.load` treats such a checkpoint), and
        ``optimizer.load_state_dict`` may come before or after. To change the
        world size, :meth:`save` and :meth:`load` reshard.

        Args:
            state: what this rank's :meth:`get_extra_state` returned.

        Raises:
            FileFormatError: another rank, world size or rows, another
                optimizer (or optimizer state saved before attach, or the
                reverse), a newer format, a ``"steps"`` that is not a count,
                a damaged record of the optimizer's scalar state.
            ShapeError, DTypeError: another table size or dtype.
            StateError: between a training forward and the step, or a closed embedding.
        """
        values, scalars = self._check_extra_state(state)
        copy_tables(values, self._tables())
        if self._state is not None:  # as after load(): optimizer.load_state_dict() may follow
            self._state.restore_scalar_state(scalars)  # the step count: see OffloadedEmbedding.load
            # The saved count, not 0: ranks that restored states of different steps (Adam's step
            # counts differ, SGD's rows are of different steps) are refused at the next call.
            self._state_origin, self._steps_since = _RESTORED, state.get("steps", 0)

    def _check_extra_state(self, state) -> dict:
        """Check a state of :meth:`get_extra_state` against this shard (also for module_state.check_state_dict).

        Returns:
            ``({table name: tensor} to copy into the tables, the optimizer's
            scalar state for RowState.restore_scalar_state)``.

        Raises:
            as :meth:`set_extra_state`; nothing changes.
        """
        self._check_between_steps("load_state_dict")
        optimizer = "" if self._state is None else type(self._state.optimizer).__name__
        values = check_tables_state(state, type(self).__name__, self._tables(), optimizer,
                                    self.num_embeddings, **self._layout())
        steps = state.get("steps", 0)
        if type(steps) is not int or steps < 0:
            raise FileFormatError(f"the state dict's {type(self).__name__} entry holds steps={steps!r}, "
                                  f"not a count of steps: it was changed after state_dict() made it; "
                                  f"load a state dict as state_dict() returned it")
        return values, checked_scalar_state(state, self._state)

    # ------------------------------------------------------------- training
    @one_thread
    def attach(self, optimizer: torch.optim.Optimizer, *, restart: bool = False) -> None:
        """Offload ``optimizer``'s per-row state for the rows this rank owns and hook its ``step()``.

        Args:
            optimizer: this rank's ``torch.optim`` optimizer, built over
                parameters that include :attr:`weight`.
            restart: attach the optimizer attached already again, starting
                its state afresh on purpose (see below).

        ``optimizer.step(closure)`` works: the closure's forwards and
        backward run first (on every rank), then the exchange and the step.

        Attaching again starts the offloaded optimizer state afresh (an
        ``mmap`` embedding's state files included; the same optimizer's scalar
        state for :attr:`weight`, Adam's ``step``, too; with ``restart=True``
        also state its ``load_state_dict`` put there). The optimizer
        attached already is refused once it trained the table (a step, or
        a checkpoint loaded) unless ``restart=True``: by mistake (an attach
        inside the training loop) it would silently restart Adam's moments
        and step count. Attach on every rank alike: the next collective call
        of a rank that attached alone raises ``StateError`` on every rank, no
        row changed.

        Only this optimizer may step :attr:`weight` from now on (until
        :meth:`close`, or another ``attach``): the ``step()`` of any other
        optimizer whose param groups hold it (``torch.optim.Adam(model.parameters())``
        for the dense layers beside the attached one) raises ``OptionError``
        on this rank before it changes anything or enters a collective: build
        that optimizer from the other parameters. :attr:`weight` never
        requires a gradient, so unlike :class:`~speedswap.OffloadedEmbedding`'s
        it is refused whenever it is held: alike on every rank, whatever
        gradient each one has.

        Raises:
            DTypeError: ``optimizer`` is not an optimizer (its class, or the parameters).
            OptionError: the optimizer does not hold :attr:`weight`, or its
                state is not element-wise; ``restart`` that is not a bool.
                Nothing changes.
            PathError: with ``storage="mmap"``, a file the new state would
                replace exists and this embedding did not create it (or another
                file was put under its name since), or a new state file cannot
                be made (out of file descriptors, a disk error). Nothing changes:
                the optimizer attached before stays, its state files intact (see
                :meth:`OffloadedEmbedding.attach`).
            StateError: between a training forward and the step; ``optimizer``
                attached already and trained since, without ``restart=True``; in a
                process forked from the one that built it, a shard the two share
                (see :mod:`~speedswap.train.one_process`).
            OutOfMemoryError: the new state tables do not fit. Nothing changes:
                the new state is made before the old one is released, so the
                optimizer attached before stays, with its state.
        """
        self._check_between_steps("attach")
        self._one_process.refuse_shared_training(self.weight, self._storage == "mmap")
        restart = bool_option(restart, "restart", hint=" (start the attached optimizer's state afresh)")
        if not restart:
            refuse_unasked_restart(self._state, optimizer, type(self).__name__,
                                   trained=self._state_origin != _ATTACHED or self._steps_since > 0,
                                   everywhere=" on every rank")
        self._scratch_writes.refuse_written_through_data(self._full)  # on this rank: attach is no collective
        # An unsupported optimizer, or a file the new state may not replace, is refused before
        # anything changes.
        check_state_files(optimizer, self.weight, self._storage, self._path, self._created)
        held = optimizer.state.get(self.weight)
        drop_leftover_state(optimizer, self.weight, restart)  # this one's or an earlier one's: a fresh start
        try:
            state = RowState(optimizer, self.weight, self.table.num_rows, self.weight.dtype,
                             self._storage, self.table.backend, self._path, overwrite=self._created,
                             replace_later=True)
            try:
                state.replace_files()
            except BaseException:
                state.close()
                raise
        except BaseException:
            if held is not None:  # the state an earlier attach left it (Adam's step) stays, as the old tables do
                optimizer.state[self.weight] = held
            raise
        self._created |= state.made_files()
        old = self._unhook_state()
        self._state = state
        self._state_origin, self._steps_since = _ATTACHED, 0
        # Weak hooks that run a closure's forward and backward before the exchange (step(closure)).
        self._hooks = StepHooks(self, optimizer)
        # Refused whatever the gradient, which differs from rank to rank: every rank alike.
        self._claim = claim(self, self.weight, optimizer, frozen_may_stay=False)
        close_replaced(old, state)  # last: an interrupt during it comes after the attach

    def _unhook_state(self) -> Optional[RowState]:
        """Unhook the attached optimizer and let go of its state.

        Returns:
            the state let go of, still to be closed (see :func:`~speedswap.train.row_state.close_replaced`);
            None where no optimizer was attached.
        """
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        state, self._state = self._state, None
        return state

    # Run eagerly under torch.compile, as OffloadedEmbedding.forward: the exchange and the step's
    # bookkeeping are Python state and collectives, not graph material.
    @torch.compiler.disable
    def forward(self, input: Optional[Ids] = None, *extra, ids: Optional[Ids] = None,
                offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rows of this rank's ids: a tensor of shape ``(*ids.shape, embedding_dim)``.

        A collective: every rank of the group must call it (with empty ids
        if it has none). In eval mode or under ``torch.no_grad()`` it reads
        the owners' tables directly, with no capacity limit.

        Args:
            input: integer ids of any shape, in ``[0, num_embeddings)``, under
                ``nn.Embedding``'s name.
            ids: the same, under speedswap's name: give one of the two.
            extra, offsets, per_sample_weights: ``nn.EmbeddingBag``'s
                arguments, refused: this is no bag (pool the rows yourself, as
                README's "Pooled lookups" section shows).

        Raises:
            IdError, DTypeError, DeviceError: bad ids on this rank (both
                ``input`` and ``ids``, or neither: DTypeError; ``offsets`` or
                ``per_sample_weights``, by position or keyword: DTypeError).
            CapacityError: this rank looks up more than ``max_rows`` distinct rows in a step.
            StateError: training in a process forked from the one that built it a shard the
                two share (see :mod:`~speedswap.train.one_process`; raised on this rank alone);
                training before :meth:`attach`, an optimizer whose
                state ``optimizer.load_state_dict()`` replaced without the
                matching :meth:`load`, bad input on another rank, another call
                (a step, a save) on another rank, or ranks whose embeddings or
                optimizers differ; another rank failed to read the rows this one
                asked for, or, in an eval forward, to make the memory for the ids
                this one asked for or for its own output (out of memory, say: that
                rank raises its own error). Whoever fails, every rank raises at
                once and no row changes: the same forward again on every rank retries it.
            StateError: a training forward after a write into :attr:`weight` in place since
                the step's last training forward, which its lookups would not see (on
                every rank, or on this rank alone for the retry of a forward that failed
                after its messages); nothing changes: :meth:`discard_step` drops the step.
            StateError: a training forward (an eval one too, while a view of this rank's table is
                alive) after a ``zero_grad()`` that dropped a step whose owned
                rows were changed through ``weight.data`` (SAM), while a view of the table is alive
                (such rows cannot be told from a write through the view), or whose :attr:`weight`
                was written in place, or its ``.data`` assigned, after its last forward (SAM through
                ``weight.add_`` or ``p.data = p.data + e``): on every rank; nothing changes:
                :meth:`discard_step` drops the step.
            OptionError: a forward under a ``torch.func`` transform, raised on
                each rank that runs one, before any message (nothing changes).
            StateError: another thread is inside a call of this embedding, or
                between a training forward and the step (on this rank alone;
                nothing changes, and no message is sent). On a GPU a forward
                inside a backward (activation checkpointing's recompute, which the
                autograd engine runs on a device thread of its own) takes no claim.
            A training forward that fails after its messages (out of memory
            making its output) raises on this rank alone: the same forward (the
            same ids) again on this rank alone finishes it, with no message.
        """
        if recomputed_on_engine_thread(self.weight.device):
            # Activation checkpointing's recompute, for the thread that waits in its backward (and holds
            # the step's claim once its first training forward ran): on a GPU the autograd engine runs it
            # on a device thread of its own, which cannot be told from another thread's. On the CPU a
            # backward runs on the thread that called it, which claims as for any call: another thread's
            # backward (an eval forward in it too) is refused.
            with self._one_thread.lent():
                return self._claimed_forward(input, extra, ids, offsets, per_sample_weights)
        with self._one_thread:
            return self._claimed_forward(input, extra, ids, offsets, per_sample_weights)

    def _claimed_forward(self, input, extra, ids, offsets, per_sample_weights) -> torch.Tensor:
        """:meth:`forward`, once this thread may use the embedding."""
        # Refused whatever it reads: its lookup, a collective, is not made to run outside a transform.
        outside_function_transforms(type(self).__name__, False, input, self.weight)
        self.refuse_replaced_weight(self.weight)
        training = self.training and torch.is_grad_enabled()
        refusal = None  # of the step zero_grad() dropped, raised in the first message: on every rank
        # A step whose optimizer raised is put back first: an eval forward's owned rows are read from weight.
        self._abort_step()
        if training:
            # A forked process sends no message its parent's ranks would match: raised here alone.
            self._one_process.refuse_shared_training(self.weight, self._storage == "mmap")
            # Activation checkpointing runs the forward again inside the backward, on every rank
            # alike, after any zero_grad() since its first run, whose rows are in the step: dropping
            # the step here would drop them too. The backward decides when it reaches the lookup
            # (_gradient_dropped), and the step's exchange flags the rows it left unreached.
            if not in_backward():
                refusal = self._refusal_of_dropped_step()
            if self._agreed and refusal is None:
                self._reopen_step()  # a step that failed after its messages gets this forward's rows too
            if self._forwards == 0:
                # weight is scratch between steps, and to_empty() (or weight.data = ...) may have
                # given it other storage since: the step trains weight.data, and the rows are
                # gathered into, and written back from, _full. Other values assigned are refused below.
                self._scratch_writes.take_back(self.weight, self._full)
                self.weight.data = self._full
        elif self._owned.size and self.table.viewed:
            # A write through a view after zero_grad() dropped the step reached the table, not weight, which
            # _answer reads the step's owned rows from: the step is dropped first (refused where they differ
            # from the table's), as by a training forward.
            refusal = self._refusal_of_dropped_step()
        # Whoever fails, every rank raises with the step as it was before this forward: the working
        # sets replace their tensors rather than write into them (see WorkingSet.add), so these restore them.
        before = copy.copy(self._looked_up), copy.copy(self._owned), [parts[:] for parts in self._sent_to_me]
        error, send, counts, unfinished = None, None, None, None
        try:
            self._check_open()
            if refusal is not None:
                raise refusal
            if extra or offsets is not None or per_sample_weights is not None:
                refuse_bag_arguments(type(self).__name__, extra, offsets, per_sample_weights)
            ids = forward_ids(input, ids)
            if training:
                # Range-checked in the working set's read: see as_row_ids_deferred.
                flat, shape, check_bounds = as_row_ids_deferred(ids, self.num_embeddings, self.table.device)
                if self._state is None:
                    raise StateError("call emb.attach(optimizer) before training: the optimizer's "
                                     "step() is where gradients reach the rows' owners")
                unfinished, self._unfinished = self._unfinished, None
                if unfinished is not None and not torch.equal(unfinished[0], flat.view(shape)):
                    unfinished = None  # another forward: the failed one's rows wait unreached (see _look_up)
                if self._forwards == 0:
                    # Raised on every rank, as bad input is: the ranks' forwards stay one collective.
                    self._scratch_writes.refuse_written(self.weight)
                    self._check_optimizer_state()  # before a step begins, when emb.load still may run
                elif self.weight._version != self._version_at_lookup:
                    self._refuse_forward_after_write()  # on every rank too
                # Each rank's count of the new rows rides in the working set's one read.
                local, first_new, counts = self._looked_up.add(flat.view(shape), check_bounds, self._count_new)
                send = self._looked_up.rows[first_new:]  # sorted, so grouped by owner
                counts = [0] * self.world_size if counts is None else counts  # no ids: nothing read
            else:
                flat, shape = as_row_ids(ids, self.num_embeddings, self.table.device)
                send, inverse = torch.unique(flat, return_inverse=True)
                counts = count_by_owner(owners(send, self._starts), self.world_size).tolist()
                # The output's memory (and a float32 copy of a bfloat16 table's rows), made before the first
                # message, where a failure (out of memory) reaches every rank: made after the last one, it
                # raised on this rank alone, its peers done with the call, and nothing told a retry.
                out = torch.empty(len(flat), self.embedding_dim, dtype=self.weight.dtype, device=self.weight.device)
                as_weight = (None if self.table.dtype == self.weight.dtype
                             else torch.empty(len(send), self.embedding_dim, dtype=self.weight.dtype,
                                              device=self.weight.device))
        except Exception as exc:  # noqa: BLE001 -- any failure must still reach the other ranks
            error = exc
        if unfinished is not None:  # its messages went: on this rank alone, with none
            if error is not None:  # a write into weight since (its peers are done: no message to tell them)
                self._unfinished = unfinished
                raise error
            return self._look_up(*unfinished)
        try:
            recv_counts, _ = self._exchange.begin(TRAIN_FORWARD if training else EVAL_FORWARD, error,
                                                  self._config(with_optimizer=training), _describe,
                                                  "a forward", send_counts=counts)
            # An eval forward's peers ask for any number of rows: their ids' memory is made, and agreed on, here.
            asked = self._exchange.rows("a forward (making the memory for the ids other ranks ask for)", send,
                                        counts, recv_counts, into=self._asked if training else None)
            rows = self._exchange.reply("a forward (reading the rows other ranks asked for)",
                                        lambda: self._answer(asked, recv_counts, training), recv_counts, counts)
        except BaseException:
            self._looked_up, self._owned, self._sent_to_me = before
            raise
        if not training:  # into the memory made above: nothing here may fail once the peers are done
            rows = rows if as_weight is None else as_weight.copy_(rows)
            return torch.index_select(rows, 0, inverse, out=out).view(*shape, self.embedding_dim)
        self._forwards += 1
        self._one_thread.hold(True)  # the step is this thread's until _new_step ends it
        moved = self._moved
        moved["lookups"] += local.numel()
        # Only rows new to the step travel: each row once per step and pair of ranks.
        moved["rows_from_peers"] += sum(counts) - counts[self.rank]
        moved["rows_to_peers"] += sum(recv_counts) - recv_counts[self.rank]
        with torch.no_grad():
            self._rows[first_new:first_new + len(rows)] = rows  # a bfloat16 table's rows made float32 in place
        self._version_at_lookup = self.weight._version  # _answer gathered through _full, which it does not count
        return self._look_up(flat.view(shape), local)

    def _refusal_of_dropped_step(self) -> Optional[BaseException]:
        """:meth:`_drop_zeroed_step` for a forward: the refusal it returns or raises (every rank raises it), or None."""
        if self.table.closed:
            return None  # refused by the forward's own check
        try:
            return self._drop_zeroed_step(carry=True)
        except Exception as exc:  # noqa: BLE001 -- its gather failed (memory), nothing dropped
            return exc

    def _refuse_forward_after_write(self) -> NoReturn:
        """Refuse a training forward in a step whose :attr:`weight` was written in place since its last one.

        :attr:`weight` holds the owned rows the step's forwards (on any rank)
        looked up; the lookups read copies of the rows, taken from their
        owners' weights at each forward. A write into it (``weight.mul_(0.5)``
        under ``no_grad()``, a perturbation of the held rows) reaches the owned
        rows, which the step trains, but none of those copies: a later forward
        would read the step's rows without it, where ``nn.Embedding``'s
        forward reads them with it, and the rows it brings in would come from
        the table without it. Refused for held rows as well as new ones (where
        :class:`~speedswap.OffloadedEmbedding` refuses new ones only: its
        lookups read its weight). Told from the version, on the host.

        Raises:
            StateError: always; the caller sends it to every rank, before any row moves.
        """
        raise StateError("emb.weight was written in place since this step's last training forward: a "
                         "ShardedOffloadedEmbedding's forwards read the step's rows as its forwards gathered "
                         "them from their owners, which the write did not reach, where nn.Embedding's forward "
                         "reads the weight as written (and rows new to the step would come from the table "
                         "without it). Write into emb.weight after the step's last training forward, or write "
                         "the table between steps (emb.table.apply_ on every rank); nothing was changed "
                         "(emb.discard_step() on every rank drops the step)")

    def _look_up(self, ids: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """A training forward's output, from the step's rows, once its messages brought them.

        Work of this rank alone, which may fail here (out of memory, say) when
        its peers have finished the forward: the same forward again (the same
        ``ids``) on this rank then comes back here, with no message. Any other
        forward instead leaves the failed one's rows unreached, as a forward no
        backward reaches: they train nothing.
        """
        try:
            # Slots name rows one to one, so counting them counts this forward's ids (scale_grad_by_freq).
            out = F.embedding(local, self._rows, scale_grad_by_freq=self.scale_grad_by_freq)
            self._reached.track(out, local)  # a forward no backward reaches trains nothing
        except BaseException:
            self._reached.without_output(local)
            self._unfinished = ids.clone(), local  # a copy: the caller may reuse its tensor before the retry
            raise
        return out

    def _answer(self, asked: torch.Tensor, recv_counts, training: bool) -> torch.Tensor:
        """The rows of this rank's shard that the ranks' ``asked`` global ids name, in the table's dtype.

        Work between a forward's messages, which may fail (memory, a read): see :meth:`Exchange.reply`.
        A training forward also takes them into the step (the owned working set, gathered from the table).
        """
        asked = asked - self.bounds[self.rank]
        if not training:
            out = torch.empty(len(asked), self.embedding_dim, dtype=self.table.dtype, device=self.table.device)
            rows = self.table.gather_validated(asked, out)
            return self._with_step_rows(asked, rows) if self._owned.size else rows
        slots, first_owned, _ = self._owned.add(asked)
        self._gather_owned(first_owned)
        for source, part in enumerate(slots.split(recv_counts)):
            self._sent_to_me[source].append(part)
        # Rows travel in the table's dtype: these were read from the table this step,
        # so a bfloat16 table's rows go back to bfloat16 exactly, at half the bytes.
        return self._full[slots].to(self.table.dtype)

    def _with_step_rows(self, asked: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of the shard-local ``asked`` ids read from the table, the step's owned rows as weight holds them.

        Between a training forward and ``optimizer.step()`` the table holds the
        step's rows as before it, and :attr:`weight` holds the owned ones as
        the step will train them: moved in place, where SAM perturbs them
        between its two passes. ``nn.Embedding``'s eval forward reads its
        weight, moved rows too (they were read unmoved: 0.031 max difference).
        In the table's dtype, as rows travel: a bfloat16 table's moved rows
        are rounded to it.

        Raises:
            StateError: :attr:`weight`'s ``.data`` was assigned another tensor,
                which the step refuses too; nothing changes.
        """
        if not same_memory(self.weight.data, self._full):
            raise StateError("an eval forward between assigning emb.weight.data and optimizer.step(): a "
                             "ShardedOffloadedEmbedding trains its weight's own storage, and refuses the "
                             "assigned tensor at the step. Move and undo rows in place "
                             "(emb.weight.data.add_(e), emb.weight.data.sub_(e)), or call emb.discard_step()")
        slots, held = self._owned.slots_of(asked)
        return torch.where(held[:, None], self._full.index_select(0, slots).to(rows.dtype), rows)

    def prefetch(self, ids: Ids) -> NoReturn:
        """Refused: a sharded table has no device cache to prefetch into (see ``cache_rows``).

        Raises:
            OptionError: always, saying what to do instead; nothing changes.
        """
        raise OptionError("ShardedOffloadedEmbedding has no device cache, so prefetch() has nowhere to bring "
                          "rows: each training forward fetches its rows from their owners. Drop the call, "
                          "or train in one process with OffloadedEmbedding(cache_rows=...), whose prefetch() "
                          "brings the next step's rows into its cache")

    def flush(self) -> NoReturn:
        """Refused: a sharded table has no device cache to write back (see ``cache_rows``).

        Raises:
            OptionError: always, saying what to do instead; nothing changes.
        """
        raise OptionError("ShardedOffloadedEmbedding has no device cache, so flush() has nothing to write "
                          "back: emb.table holds every row this rank owns, as of the last optimizer.step(). "
                          "Drop the call; to keep the rows, emb.save(path) on every rank")

    def stats(self) -> dict:
        """This rank's row counters: ``{"last_step": {...}, "total": {...}}``.

        Counted when an ``optimizer.step()`` writes its rows back (a step
        dropped by :meth:`discard_step` or ``zero_grad()`` counts nothing; a
        step skipped before its backward counts with the step that takes its
        rows; eval forwards count nothing). ``total`` adds every step's,
        ``last_step`` is the last one's:

        * ``steps``: steps that wrote rows back;
        * ``lookups``: ids in this rank's training forwards;
        * ``unique_rows``: the distinct rows they looked up;
        * ``owned_rows``: the distinct rows of this rank's shard that some
          rank looked up, each read from :attr:`table` (with its optimizer
          state at the step) and written back once;
        * ``rows_from_peers``: rows other ranks own that this rank's forwards
          received (the step sends each one's gradient back);
        * ``rows_to_peers``: rows of this rank's shard sent to other ranks'
          forwards (the step receives each one's gradient).

        Bytes between ranks: :attr:`bytes_sent`.
        """
        return {"last_step": dict(self._last_step), "total": dict(self._total)}

    def _count_new(self, ids_sorted, new):
        """The working set's ``count_also``: how many of a forward's new rows each rank owns."""
        return count_by_owner(owners(ids_sorted, self._starts), self.world_size, where=new)

    def _gather_owned(self, first):
        rows = self._owned.rows[first:]
        if len(rows):
            target = self._full[first:first + len(rows)]
            if self._in_table_dtype is None:
                self.table.gather_validated(rows, target)
            else:
                target.copy_(self.table.gather_validated(rows, self._in_table_dtype[first:first + len(rows)]))

    @one_thread
    def exchange_gradients(self) -> None:
        """Send this step's row gradients to the rows' owners now, so that :attr:`weight` holds them.

        A collective: call it on every rank, after the step's last backward.
        ``optimizer.step()`` does it by itself; call it first when something
        reads or rescales gradients between the backward and the step:

        * ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``: without
          it they would clip a gradient that has not arrived yet, and the step
          refuses (it sees ``weight.grad`` changed). ``clip_grad_norm_`` sees
          this rank's rows only: with several ranks clip by the whole
          table's norm, :meth:`grad_norm`, as in memory;
        * a ``GradScaler`` (``unscale_``, or ``scaler.step``, which unscales):
          without it the scaler would unscale (and check for infs) a gradient
          that has not arrived yet, and the step refuses. The ranks must also
          agree on skipping a step whose gradients hold infs: use a scaler
          that all-reduces its check, such as
          ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
          (a step skipped on some ranks only is refused on every rank).

        After it, ``optimizer.step()`` starts with one message of its own, in
        which the ranks agree to step (a rank whose backward came late, or
        whose scaler skipped the step, would otherwise leave its peers'
        rows stepped and its own not), and whether ``zero_grad(set_to_none=False)``
        zeroed the exchanged gradient: as in memory, where the zeroed sparse
        gradient names no row, the step then moves none, and counts (Adam's step).

        Raises:
            StateError: no training forward since the last step, a second call
                in one step, ``weight.grad`` changed before it (or still holding
                the last step's gradient: no ``zero_grad()`` after it), the optimizer's
                state replaced (see :meth:`forward`), or ranks that disagree
                about the step. Whichever rank fails, every rank raises, before
                any gradient moves; except after the exchange's message (out of
                memory summing the gradients that came to it): that rank alone
                raises, and its retry of ``exchange_gradients()`` (alone) finishes it.
        """
        if self._arrived is not None:
            # Its messages went, and it failed after them on this rank alone: finished here, with no message.
            self._take_gradients()
            return
        error = None
        try:
            self._check_open()
            self._drop_zeroed_step()
            if self._forwards == 0:
                raise StateError("exchange_gradients() without a training forward since the last step: "
                                 "there is no gradient to send; call it after the step's backward, on "
                                 "every rank")
            if self._exchanged:
                raise StateError("exchange_gradients() twice in one step; call it once, after the "
                                 "step's last backward, then optimizer.step()")
            self._check_grad_untouched(None)
            self._check_optimizer_state()
        except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it, not wait in the exchange
            error = exc
        self._exchange_gradients(error, EXCHANGE)
        self._take_gradients()

    @one_thread
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole table's gradient, every rank's owned rows: the same on every rank.

        A collective: call it on every rank, after :meth:`exchange_gradients`.
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would count only
        the rows this rank owns, so each rank would clip by another factor
        (and DDP's replicas of the dense layers would drift apart); clip by
        the norm in-memory training would see instead::

            emb.exchange_gradients()
            dense = [p.grad for p in model.parameters() if p is not emb.weight and p.grad is not None]
            norm = torch.nn.utils.get_total_norm([emb.grad_norm(), *dense])
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)

        Args:
            norm_type: the norm's order (``torch.linalg.vector_norm``'s ``ord``, or
                ``"inf"`` as ``clip_grad_norm_`` takes it), the same on every rank.

        Returns:
            A 0-dim tensor on the table's device.

        Raises:
            StateError: no :meth:`exchange_gradients` since the step's last
                backward, or one that failed after its message and was not
                called again, on any rank (every rank raises, before any message).
            OptionError: ``norm_type`` is not a number (on that rank; StateError on the others,
                as for any failure taking a rank's norm: out of memory, say).
        """
        error = None
        try:
            self._check_open()
            if self._arrived is not None:
                raise StateError("grad_norm() after an exchange_gradients() that failed on this rank after "
                                 "its message (its own error said why): call emb.exchange_gradients() "
                                 "again on this rank alone to finish it, then grad_norm() on every rank")
            if not self._exchanged or self._late_backward:
                raise StateError("grad_norm() before the gradients reached their owners: call "
                                 "emb.exchange_gradients() on every rank after the step's last "
                                 "backward, then grad_norm()")
            try:
                order = float(norm_type)
            except (TypeError, ValueError):
                raise OptionError(f"norm_type={norm_type!r}: the norm's order must be a number, as "
                                  f"torch.linalg.vector_norm's ord (2.0, 1.0, float('inf'), ...)") from None
            # This rank's norm before the first message: failing after it (out of memory), this rank
            # raised alone and its peers waited in the norms' all-gather until the group's timeout.
            grad = self.weight.grad  # this rank's owned rows; zero beyond them
            local = (torch.zeros((), dtype=self.weight.dtype, device=self.weight.device) if grad is None
                     else torch.linalg.vector_norm(grad, order))
        except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it, not wait for this one
            error = exc
        self._exchange.begin(GRAD_NORM, error, self._config(), _describe, "grad_norm()")
        return self._exchange.norm(local, order)

    def _check_grad_untouched(self, optimizer) -> None:
        """Refuse a ``weight.grad`` that something changed before the gradients arrived.

        ``optimizer`` is the stepping optimizer (None from :meth:`exchange_gradients`).

        Raises:
            StateError: a clip, a ``GradScaler``'s ``unscale_`` (or its inf check, which a
                fused optimizer's ``scaler.step`` makes), or ``zero_grad(set_to_none=False)``
                acted on the placeholder; or the gradient the last step left is still there.
        """
        if self._stale or self._leftover_unchanged():
            raise StateError(_GRADIENT_LEFT)
        changed = (self.weight.grad is self._grad and not self._holds_kept_zero()
                   and self._grad._version != self._placeholder_version)
        # A fused optimizer's scaler.step() hands it the inf check it made (found_inf) instead.
        # (A GradScaler's unscale_, which keeps the version, is seen by the exchange: the mark.)
        checked = getattr(optimizer, "found_inf", None) is not None
        if changed or checked:
            raise StateError(_GRAD_CHANGED)

    def _check_optimizer_state(self) -> None:
        """Refuse, before any collective, optimizer state that the step's gather would refuse.

        Raises:
            StateError: ``optimizer.load_state_dict()`` replaced the per-row
                state without the matching :meth:`load`, or left none for
                trained rows.
        """
        try:
            self._state.check_not_replaced()
        except StateError as exc:
            raise StateError(f"{exc}. A ShardedOffloadedEmbedding: emb.discard_step(), then "
                             f"emb.load(path) on every rank, or attach(optimizer) on every rank to "
                             f"start afresh") from exc
        if self._state.step_state() is None:
            # No state for the parameter: gather() refuses it unless torch may create it now.
            # Asked for no row, it refuses here what it would refuse after the exchange, on this
            # rank alone (or prepares torch's initial state, as it would then).
            self._state.gather(self._owned.rows[:0])

    def _exchange_gradients(self, error, call):
        """The exchange's messages: each rank's gradient for every row travels to the row's owner.

        ``error``, this rank's reason to stop, is raised on every rank (as
        StateError on the others) before anything is sent; ``call`` is
        :data:`EXCHANGE` or :data:`STEP`. What arrived waits in ``_arrived``
        for :meth:`_take_gradients`.
        """
        what = "exchange_gradients()" if call == EXCHANGE else "optimizer.step()"
        counts, flags = None, 0
        if error is None:
            try:
                grad, order, counts, unreached, flags = self._gradients_by_owner()
            except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it, not wait in the exchange
                error = exc
        recv_counts, flags = self._exchange.begin(
            call, error, self._config(), _describe, what, send_counts=counts,
            expected=[sum(len(part) for part in parts) for parts in self._sent_to_me], flags=flags)
        any_unreached, received = flags & _UNREACHED, None
        if flags & _REACHED:  # else no gradient moves (see _take_gradients)
            received = self._exchange.reply(what, lambda: self._by_owner(grad, order, unreached, any_unreached),
                                            counts, recv_counts)
        self._exchanged = True  # not before: a retry after a failed reply exchanges again
        self._arrived = received, recv_counts, flags

    def _take_gradients(self) -> None:
        """The owner's part of the exchange, after its last message: its rows' gradients summed into ``weight.grad``.

        Work of this rank alone, which may fail here (memory, say) when its
        peers have finished the call: the message stays in ``_arrived`` until
        this is done, and the call retried on this rank alone comes here, with
        no message. Each run starts afresh from the message.
        """
        received, recv_counts, flags = self._arrived
        self._put_back = None
        if not flags & _REACHED:
            if flags & _ZERO_KEPT:
                # No backward reached the step, but the table's gradient is zeros
                # (zero_grad(set_to_none=False)): torch steps it, counting the step as in
                # memory, and every row goes back unchanged, as lazily in memory. On every rank.
                self._keep_zero_grad()
                self._put_back = torch.arange(self._owned.size, device=self.weight.device)
            else:
                # No backward reached a forward of this step on any rank: in memory the table would
                # have no gradient, and torch's step would skip it (Adam's step count included).
                self.weight.grad = None
            self._arrived = None
            return
        slots = torch.cat([part for parts in self._sent_to_me for part in parts])
        k = self._owned.size
        # All of it: the placeholder's mark, or an earlier step's rows, must not reach a clip's norm.
        owned_grad = self._grad.zero_()[:k]
        # One add per source, in rank order: a source's rows are distinct, so no
        # add races another (on a GPU index_add_ sums duplicates atomically, in
        # no fixed order), and every run sums a row's gradients in the same order.
        for lo, hi in itertools.pairwise(itertools.accumulate(recv_counts, initial=0)):
            if hi > lo:
                owned_grad.index_add_(0, slots[lo:hi], received[lo:hi, :self.embedding_dim])
        owned_grad.div_(self.world_size)
        self._mark_zero_gradient()
        self.weight.grad = self._grad
        self._zero_kept = False
        if flags & _UNREACHED:
            # The slots some reached row asked for, marked with no host wait (a bool mask's
            # indexing reads its count, a number through a tensor index is copied to a GPU):
            # the others point at a spare last entry.
            asked_by_reached = torch.where(received[:, -1] > 0, slots, k)
            got = torch.zeros(k + 1, dtype=torch.bool, device=slots.device).index_fill_(0, asked_by_reached, True)
            kept = (~got[:k]).nonzero().squeeze(1)
            self._put_back = kept if len(kept) else None
        self._arrived = None

    def _gradients_by_owner(self):
        """This rank's part of the gradient exchange, before its first message: everything that may fail.

        Returns:
            (the looked-up rows' gradient, the order that groups its rows by owner, the count
            for each owner, the slots of forwards no backward reached or None, the exchange's flags).

        Raises:
            StateError: ``weight.grad``'s placeholder was rescaled before the exchange
                (see :meth:`_check_grad_untouched`).
        """
        k_local = self._looked_up.size
        grad = self._rows.grad
        grad = (grad[:k_local] if grad is not None
                else torch.zeros(k_local, self.embedding_dim, dtype=self.weight.dtype,
                                 device=self.weight.device))
        if self.padding_idx is not None:
            # The padding row's slot differs from rank to rank and step to step, so the forward
            # cannot name it to F.embedding; zeroing its gradient here gives what
            # nn.Embedding(padding_idx=...) gives (zero, even where the loss's gradient is not
            # finite). Its owner still steps it when some rank looked it up, as any row.
            grad = grad.masked_fill((self._looked_up.rows == self.padding_idx).unsqueeze(1), 0)
        # Stable: an owner gets each source's rows in the order it sent the ids.
        dest = owners(self._looked_up.rows, self._starts)
        order = torch.argsort(dest, stable=True)
        counts = count_by_owner(dest, self.world_size)
        placeholder = self.weight.grad is self._grad and not self._holds_kept_zero()
        if placeholder:
            # The GradScaler's in-place unscale does not bump the placeholder's version (torch
            # 2.x): its marked element, which any rescaling changes, tells it. Read with the
            # counts: on a GPU one wait for the host, not two.
            counts = torch.cat([counts, (self._grad[-1:, -1] != self._mark).to(counts.dtype)])
        counts = counts.tolist()
        if placeholder and counts.pop():
            raise StateError(_GRAD_CHANGED)
        unreached = self._reached.unreached_slots(k_local, grad.device)
        # Owned rows carried from a dropped step (SAM) that no forward since asked for are put back too.
        flags = (_UNREACHED * (unreached is not None or self._carried) | _REACHED * self._reached.any_reached()
                 | _ZERO_KEPT * self._holds_kept_zero())
        return grad, order, counts, unreached, flags

    @staticmethod
    def _by_owner(grad: torch.Tensor, order: torch.Tensor, unreached: Optional[torch.Tensor],
                  flagged: bool) -> torch.Tensor:
        """The exchange's message: ``grad``'s rows in ``order``, and with ``flagged`` a column that is
        0 for ``unreached`` ones.

        Rows of forwards no backward reached (a step skipped before its backward) are
        flagged, so that owners put back those no reached forward looked up.
        """
        if flagged:
            reached = torch.ones(len(grad), 1, dtype=grad.dtype, device=grad.device)
            if unreached is not None:
                reached.index_fill_(0, unreached, 0)  # not reached[unreached] = 0: a host wait on a GPU
            grad = torch.cat([grad, reached], 1)
        return grad[order]

    def _mark_zero_gradient(self) -> None:
        """Mark the exchanged gradient, where it is zero, so that :meth:`_zeroed_since_exchange` tells ``zero_()`` apart.

        A gradient the exchange left at zero (a loss weighted by 0, or a rank
        owning none of the step's rows) gets ``-0.0`` and ``+0.0`` in two
        elements of its first row, the same values, on the device in one
        launch: ``zero_()`` writes ``+0.0`` over them, a clip or ``unscale_``
        multiplies them by a positive factor and ``mul_(0.0)`` by zero, which
        keep the ``-0.0``, and a negation turns the ``+0.0`` into one.
        """
        grad = self._grad
        marks = grad[0, :2] if self.embedding_dim > 1 else grad[:2, 0]
        torch.where(holds_nonzero(grad), marks, self._zero_marks[:len(marks)], out=marks)

    def _zeroed_since_exchange(self) -> bool:
        """Whether ``zero_grad(set_to_none=False)`` zeroed this rank's gradient since the exchange filled it.

        In memory ``zero_()`` empties the sparse gradient, which then names no
        row, negated since or not, where a clip, ``unscale_`` or ``mul_(0.0)``
        keeps its rows. Told by the signs of its zeros
        (:func:`~speedswap.train.zero_marks.reads_as_zeroed`, the marks of
        :meth:`_mark_zero_gradient` among them): a gradient whose values were
        all of one sign multiplied by 0 reads as zeroed on this rank (the
        step asks every rank). A host read, made only after an exchange, before its step.
        """
        grad = self._grad
        return (self._exchanged and self._arrived is None and self.weight.grad is grad and not self._zero_kept
                and bool(~holds_nonzero(grad) & reads_as_zeroed(grad)))

    def _restore_narrowed(self) -> None:
        """Give :attr:`weight` and the optimizer their full-size tensors back after a step that raised."""
        if self._narrowed is not None:
            self._narrowed.restore()
            self._narrowed = None
            self._kept = None  # made again by the retried step
            if self._state is not None:  # close() releases the state first
                self._state.release()
                self._state.undo_scalar_state()  # the optimizer may have counted the step

    def _leftover_unchanged(self) -> bool:
        """Whether ``weight.grad`` still holds the gradient the last step applied, no ``zero_grad()`` since.

        In memory a step (or a backward adding to it) would apply that gradient
        again, to rows written back since: the caller refuses it. One that
        ``zero_grad(set_to_none=False)`` zeroed is kept as zeros (see
        :meth:`_keep_zero_grad`): a step on it moves no row, lazily, but counts.
        """
        if self._leftover_version is None:
            return False
        if self.weight.grad is self._grad and self._grad._version == self._leftover_version:
            return True
        if self.weight.grad is self._grad:
            self._keep_zero_grad()
        self._leftover_version = None
        return False

    def _set_placeholder(self) -> None:
        """Give :attr:`weight` its zero gradient until the exchange, marked (see ``_check_grad_untouched``)."""
        placeholder = self._grad.zero_()
        placeholder[-1, -1] = self._mark
        self.weight.grad = placeholder
        self._placeholder_version = placeholder._version
        self._leftover_version, self._zero_kept = None, False  # the placeholder replaced them

    @one_thread
    def _abort_step(self) -> None:
        """Undo a step that raised before its write-back (in its optimizer, say), for a retry.

        As :class:`~speedswap.OffloadedEmbedding` does: nothing was written
        back, so the table and state tables hold every owned row as before
        it; the owned rows, which the optimizer may have half updated, are
        read from the table again, and the optimizer's scalar state (Adam's
        step count) is put back. The exchanged gradient stays: the retry
        steps on it with no message (see :meth:`_begin_step`).
        """
        self._put_back_dense_zero_grad()
        self._one_thread.hold(self._forwards > 0)  # a step without rows ends here (see _begin_step)
        if self._empty_counted:
            self._empty_counted = False
            self._scratch_writes.end_own(self.weight)  # the retry begins it again
            self._state.release()  # torch may have made its per-row state for the scratch
            self._state.undo_scalar_state()  # the optimizer may have counted the step before it raised
        if self._narrowed is not None:
            self._restore_narrowed()
            self._gather_owned(0)
            # The optimizer's writes, undone by the gather: no write of the user's for the next forward to refuse,
            # in this step or, once zero_grad() gave it up, the next (as discard_step() notes).
            self._version_at_lookup = self.weight._version
            self._scratch_writes.note_own(self.weight)

    def _reopen_step(self) -> None:
        """Make a step that failed after its messages exchange again: a forward or backward since adds to its gradient.

        The exchange is a collective: the peers must run that forward or
        backward too (a forward is one; a backward on this rank alone is
        refused at the exchange, by the rows it sends, on every rank).
        """
        self._release_agreed_state()
        self._agreed = self._exchanged = self._late_backward = False
        self._arrived = self._put_back = None
        self._set_placeholder()  # the gradient the exchange made is made again, backwards since included

    def _release_agreed_state(self) -> None:
        """Give the optimizer its full-size scratch back if a step read its rows' state and did not write it back.

        A step reads the state before its first message; one that failed
        after its messages and is dropped (or opened again) leaves it read,
        which the next step's check would take for a state that
        ``optimizer.load_state_dict()`` replaced.
        """
        if self._agreed and self._state is not None:
            self._state.release()

    def _put_back_dense_zero_grad(self):
        if self._empty_sparse is not None:
            self._empty_sparse.restore()
            self._empty_sparse = None

    # The step protocol of StepHooks, which calls _abort_step() first (a retry of a step that raised).
    @one_thread
    def _begin_step(self):
        """Narrow :attr:`weight` to the step's owned rows, with their gradient and optimizer state.

        A failure before the step's last message raises on every rank, nothing
        changed (:meth:`_agree_to_step`); one after it, on this rank alone,
        with the rows and their state unchanged and what the messages brought
        kept: ``optimizer.step()`` again on this rank alone then finishes the
        step with no message (a forward or backward before it makes the step
        exchange again, a collective).
        """
        self._drop_zeroed_step(exchanged=False)
        if self._forwards == 0:
            if self._carried:
                # Rows carried for a forward (SAM's second pass) that failed and was not run again: no
                # forward reads them, and the optimizer may step the scratch they are in. Dropped, as
                # any write through weight.data between steps goes unseen.
                self._owned.clear()
                self._carried = False
            # No gradient (forwards and zero_grad are on every rank alike): no step, no collective,
            # unless the gradient is the last step's, which in memory would be applied again. A
            # zero one torch steps on the scratch (Adam counts the step, as in memory).
            if self._leftover_unchanged():
                raise StateError(_GRADIENT_LEFT)
            self._scratch_writes.begin_own(self.weight)  # the optimizer may step the scratch: its own write
            if self._holds_kept_zero():
                self._state.check_not_replaced()  # the scratch must be this state's, as at any step
                self._state.keep_scalar_state()  # the optimizer counts a step without rows too
                self._empty_counted = True
                if self._state.needs_sparse_grad:
                    self._empty_sparse = EmptySparseGradient(self.weight)
            # This thread's until _end_step (or the next call's _abort_step): another thread's training
            # forward between the hooks would put rows under the optimizer's step of the scratch, and
            # _end_step would take them for rows this step stepped. (A forward holds it for a step with rows.)
            self._one_thread.hold(True)
            return
        if self._agreed and self._late_backward:
            self._reopen_step()  # a backward since the step failed: the retry exchanges its gradient too
        if self._agreed:
            # A retry of a step that failed after its last message, on this rank alone: its peers
            # have stepped, so it makes no message, and reads the state again (_abort_step released it).
            self._state.gather(self._owned.rows)
        else:
            self._agree_to_step()
        # Work of this rank alone from here on: a failure raises here only, and the retry comes back here.
        if self._arrived is not None:
            self._take_gradients()
        self._state.keep_scalar_state()  # a step undone (_restore_narrowed) counts once when retried
        self._narrowed = NarrowedStep(self.weight, self._owned.size, self._state.needs_sparse_grad)
        if self._put_back is not None:
            self._kept = KeptRows(self._put_back, self._full, self._state.step_state(), self._state.spec)

    def _agree_to_step(self) -> None:
        """The step's checks and messages: every rank steps, or every rank raises with nothing changed.

        Everything of the step that may fail and needs no message runs before
        the first one, the read of the rows' optimizer state included: after
        the last message a rank failing alone would leave its rows unstepped
        where its peers' are stepped.
        """
        error, holds, gathered = None, 0, False
        try:
            if not same_memory(self.weight.data, self._full):
                # The step trains, and writes back, the owned rows in weight's own storage: assigned values
                # would be stepped and lost. Given back, with the rows as before the assignment.
                self.weight.data = self._full
                raise StateError(_DATA_ASSIGNED)
            if self._arrived is not None:  # exchange_gradients() failed after its messages: finished first
                self._take_gradients()
            if self._exchanged and self._late_backward:
                raise StateError("a backward ran after exchange_gradients(), and its gradient would be "
                                 "lost: call exchange_gradients() after the step's last backward (or "
                                 "discard_step() on every rank to skip the step)")
            if not self._exchanged:
                self._check_grad_untouched(self._state.optimizer)
            else:
                holds = _HOLDS_GRADIENT * (not self._zeroed_since_exchange())
            self._check_optimizer_state()  # optimizer.load_state_dict() since the forward
            self._state.gather(self._owned.rows)
            gathered = True
        except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it, not step without this one
            error = exc
        try:
            if self._exchanged:
                # The step makes no other message after exchange_gradients(): without this one a rank
                # refusing its step (or skipping it, its own GradScaler having found infs) would
                # leave its peers' rows stepped and its own not.
                _, flags = self._exchange.begin(STEP, error, self._config(), _describe, "optimizer.step()",
                                                flags=holds)
                if not flags & _HOLDS_GRADIENT:
                    # zero_grad(set_to_none=False) zeroed the exchanged gradient on every rank: in memory
                    # the zeroed sparse gradient names no row, so the step moves none but counts (Adam's
                    # step). Decided by every rank's gradient, so alike on every rank (_take_gradients).
                    self._arrived = None, None, _ZERO_KEPT
            else:
                self._exchange_gradients(error, STEP)
        except BaseException:
            if gathered:  # the tables hold the state as it was: the optimizer gets its scratch back
                self._state.release()
            raise
        self._agreed = True

    @one_thread
    def _end_step(self):
        if self._forwards == 0:
            self._one_thread.hold(False)  # the claim of a step without rows (see _begin_step)
            self._scratch_writes.end_own(self.weight)
            self._empty_counted = False
            if self._empty_sparse is not None or self._holds_kept_zero():
                # A step on the zero gradient alone (Adam counted it, as in memory) stepped the
                # scratch only; torch's state for it becomes this state's scratch, as after any step.
                self._put_back_dense_zero_grad()
                self._state.release()
                self._steps_since += 1  # a rank that took it alone is refused at its next call
            return
        rows, k = self._owned.rows, self._owned.size
        try:
            # An optimizer may assign new tensors (p.data = p.data - lr * p.grad): their values
            # are the step's, or the step is refused before anything is written back (on every
            # rank alike, the optimizer being the same; the retry exchanges again).
            self._state.check_step(k)
            self._narrowed.finish()
            # Everything that may fail (memory) before the first write into the host tables: the step
            # is then written back whole, or (_abort_step) not at all, its rows read back for a retry.
            if self._kept is not None:
                self._kept.put_back(self._full, self._state.step_state())
            values = self._full[:k]
            if self._in_table_dtype is not None:
                values = self._in_table_dtype[:k].copy_(values)
            # Owned rows are unique shard-local ids, validated when they were looked up. The tables'
            # writes are prepared (staged: on a cuda table, memory) here, where a failure undoes the step.
            write_state = self._state.prepare_scatter(rows)
            write_rows = self.table.prepare_scatter(rows, values)
        except BaseException:
            self._abort_step()
            raise
        self._narrowed = None
        write_state()
        write_rows()
        self._steps_since += 1
        self._last_step = {"steps": 1, "unique_rows": self._looked_up.size, "owned_rows": k, **self._moved}
        for name, count in self._last_step.items():
            self._total[name] += count
        stepped = self.weight.grad is not None  # None where no backward reached the step on any rank
        zero = self._holds_kept_zero()  # a step on the kept zero gradient alone: it stays zeros, as in memory
        self._new_step()
        self._scratch_writes.note_own(self.weight)  # the optimizer wrote it in place
        if zero:
            self._keep_zero_grad()
        elif stepped:
            # As on a dense parameter, the step's gradient stays until zero_grad(): another step on
            # it is refused rather than let train what it would not in memory (see _leftover_unchanged).
            self.weight.grad = self._grad
            self._leftover_version = self._grad._version

    @one_thread
    def close(self) -> None:
        """Release this rank's rows and optimizer state memory and unhook the optimizer. Idempotent.

        Call it on every rank, between steps. An ``mmap`` table's files are
        flushed and kept. Afterwards every call but ``close`` raises
        :class:`~speedswap.StateError` (a forward on every rank, as for any
        bad input, when every rank calls it); the optimizer's ``step()`` no
        longer touches this embedding.
        """
        if self.table.closed:
            return
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        if self._claim is not None:
            self._claim.remove()
        if self._state is not None:
            self._state.close()
            self._state = None
        self._new_step()
        self.table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self.table.closed:
            raise StateError("this ShardedOffloadedEmbedding is closed (close() released this rank's rows "
                             "and optimizer state); build a new ShardedOffloadedEmbedding on every rank and load "
                             "the checkpoint saved before close() into it (emb.load(dir)) to go on from there")

    # ---------------------------------------------------------- checkpoints
    def _tables(self):
        tables = {"table": self.table}
        if self._state is not None:
            tables.update({f"optimizer.{name}": t for name, t in self._state.tables.items()})
        return tables

    def _step_in_flight(self) -> bool:
        """Whether training forwards since the last step hold rows for a step still to come.

        A step ``zero_grad()`` dropped after its backward is discarded first,
        unless SAM moved its rows between two passes (:meth:`_drop_zeroed_step`'s
        ``carry``, whose refusals leave the step in flight for the next forward
        to raise); one skipped before its backward leaves its rows here, waiting
        for the next step. A step the optimizer raised inside is undone first (as a
        forward does), or its writes into :attr:`weight` would read as the user's.
        """
        self._abort_step()
        self._drop_zeroed_step(carry=True)
        return bool(self._looked_up.size or self._forwards or self._carried)

    def _check_between_steps(self, what):
        self._check_open()
        if self._step_in_flight():
            raise StateError(f"{what} between a training forward and optimizer.step() would be "
                             f"undone by the step; call it between steps (after a step skipped "
                             f"before its backward, call emb.discard_step() first, on every rank)")

    def _config(self, with_optimizer: bool = True, with_history: bool = True) -> list:
        """What must be equal on every rank: integers for :meth:`Exchange.begin` (see :func:`_describe`).

        This embedding's number among those built on its group in this
        process (ranks calling two tables in another order would exchange
        one table's rows for the other's), the table's size and dtype,
        ``max_rows`` (an owner's working set is
        sized for ``W * max_rows`` rows from its peers), ``padding_idx`` (a
        rank that took the row for an ordinary one would send its owner a
        gradient for it), ``scale_grad_by_freq`` (ranks scaling unlike each
        other train like no one process, silently) and, unless
        ``with_optimizer`` is false (an eval forward), a fingerprint of the
        attached optimizer: a shard stepped by another optimizer, or another
        learning rate, would train unlike one process, silently; and where
        its state came from (:meth:`attach` or :meth:`load`) with the steps
        since, unless ``with_history`` is false (a load, which replaces that
        state): a rank that attached alone restarted its state (Adam's
        moments and step count) while its peers' went on.
        """
        dtype = self.table.dtype
        dtype_code = _DTYPE_CODES.get(dtype, len(_DTYPES) + zlib.crc32(str(dtype).encode()))
        history = with_optimizer and with_history and self._state is not None
        padding = _NO_PADDING if self.padding_idx is None else self.padding_idx
        return [self._number, self.num_embeddings, self.embedding_dim, self.max_rows, padding,
                int(self.scale_grad_by_freq), dtype_code,
                _optimizer_fingerprint(self._state, self.weight) if with_optimizer else 0,
                self._state_origin if history else 0, self._steps_since if history else 0]

    def _begin_between_steps(self, call: int, what: str, path) -> Tuple[str, int]:
        """Start the collective ``call`` (save or load) of ``path``: this rank's checks travel to every rank.

        ``path`` is checked here, in the message: a rank that raised on it
        after the message (``None`` where its peers pass a path) would leave
        its peers waiting in the save's next collective until the process
        group's timeout, or pair their load with its next call.

        Returns:
            (``path`` as a str, the call: :data:`LOAD_TABLE` for a load of a
            ``*.npy`` file that is not a directory).
        """
        error = None
        try:
            self._check_between_steps(what)
            path = as_path(path)
            # A directory is a checkpoint whatever its name: save() writes one at a path ending ".npy" too.
            if call == LOAD and path.endswith(".npy") and not os.path.isdir(path):
                call = LOAD_TABLE
        except Exception as exc:  # noqa: BLE001 -- the other ranks must hear of it, not hang
            error = exc
        # A load replaces the optimizer state: ranks whose states went apart may load to agree again.
        self._exchange.begin(call, error, self._config(with_history=call not in (LOAD, LOAD_TABLE)),
                             _describe, f"{what}()")
        return path, call

    @one_thread
    def save(self, path: PathLike) -> None:
        """Write every rank's rows and optimizer state to the checkpoint directory ``path``.

        A collective. Each rank writes its shard; the checkpoint (a manifest
        with the world size, the split, the optimizer and its step count) is
        complete only when every rank succeeded, and replaces an earlier
        one at ``path`` atomically. ``path`` must be on a file system that every
        rank sees (see :mod:`speedswap.train.sharded_checkpoint`).

        Args:
            path: the checkpoint directory, the same on every rank.

        Raises:
            StateError: called between a forward and the step, a rank failed
                to write, another call on another rank, or ranks whose
                embeddings or optimizers differ.
            FileFormatError: ``path`` exists and is not a sharded checkpoint.
            PathError: the ranks do not write into one directory (another
                ``path`` on some rank, or no file system every rank sees), or
                a ``path`` with a NUL byte.
            DTypeError: ``path`` is not a path (None, say). A bad ``path`` raises
                on its rank and ``StateError`` on the others, before anything is written.
        """
        path, _ = self._begin_between_steps(SAVE, "save", path)
        save_shards(path, self._tables(), self._state, self.bounds, self._exchange)

    @one_thread
    def load(self, path: PathLike) -> None:
        """Restore a checkpoint written by :meth:`save` with any world size, or a ``.npy`` table.

        A collective. Each rank reads every saved shard that overlaps the
        rows it now owns, whole (to verify its CRC-32 before any row changes),
        holding only those rows (in RAM where they fit in this rank's part of
        it), and copies them. With an
        optimizer attached (the class that saved), its per-row state and step
        count are restored too; without one, the rows alone (for evaluation).
        A ``*.npy`` file (not a directory) holds a whole table (pretrained
        vectors): each rank reads its rows and the optimizer state is left as it is.

        Args:
            path: a checkpoint directory :meth:`save` wrote, or a ``.npy`` file; the same on every rank.

        Raises:
            FileFormatError: another table size, dtype or optimizer, or bad files
                (checked on every rank before any row changes).
            StateError: called between a forward and the step, a rank failed,
                another call on another rank, ranks whose embeddings or
                optimizers differ, or ranks that read different checkpoints.
            DTypeError, PathError: ``path`` is not a path (None, say), or holds a
                NUL byte: on its rank, ``StateError`` on the others, no row changed.
        """
        path, call = self._begin_between_steps(LOAD, "load", path)
        if call == LOAD_TABLE:
            sharing = ranks_on_this_machine(self._exchange)
            # Every rank stages its rows before any rank commits: all ranks load, or none.
            staged = run_everywhere(self._exchange, f"checking {os.fspath(path)!r}", lambda: stage_table_rows(
                path, self.table, self.row_range, self.num_embeddings, sharing))
            run_everywhere(self._exchange, f"checking {os.fspath(path)!r} again",
                           lambda: all_unchanged([staged]))
            run_everywhere(self._exchange, f"loading {os.fspath(path)!r}",
                           lambda: staged.commit(self.table, rows=self.row_range, at=0))
            return
        load_shards(path, self._tables(), self._state, self.row_range, self.num_embeddings,
                    self._exchange)
        if self._state is not None:  # every rank's optimizer state restored alike
            self._state_origin, self._steps_since = _LOADED, 0


#: ShardedOffloadedEmbeddings built in this process, per group (its global ranks).
_BUILT = collections.Counter()
#: Floating dtypes as integers for the ranks' comparison, and back into words for its error.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
#: Why a step refuses a placeholder gradient that something changed before the exchange.
_GRAD_CHANGED = (
    "weight.grad was changed or read between the backward and optimizer.step() (a gradient clip, a "
    "GradScaler's unscale_ or inf check, or zero_grad(set_to_none=False)), but a "
    "ShardedOffloadedEmbedding's gradient reaches its owners only at the step: call "
    "emb.exchange_gradients() on every rank before clipping or unscaling, or emb.discard_step() on "
    "every rank to skip the step")
#: Why a step (or exchange) refuses the gradient the last step applied.
_GRADIENT_LEFT = (
    "weight.grad of a ShardedOffloadedEmbedding still holds the gradient the last optimizer.step() "
    "applied (step() twice on one backward, or no zero_grad() after a step): in memory the step would "
    "apply it again, but its rows were written back then and its slots hold other rows now. Nothing "
    "was changed: call optimizer.zero_grad() after each step on every rank, and emb.discard_step() on "
    "every rank to drop the forwards since")
#: Why a forward refuses a step zero_grad() dropped after emb.weight was written in place.
_WRITTEN_BEFORE_DROP = (
    "emb.weight was written in place after this step's last training forward, and zero_grad() then dropped "
    "the step's gradient: this forward would drop the step and read its rows from the table, without the "
    "write. For SAM, move the rows through emb.weight.data instead (emb.weight.data.add_(e), then "
    "emb.weight.data.sub_(e) before optimizer.step()): the step keeps them for its second pass. To "
    "initialise rows, write the table (emb.table.apply_ on every rank). Nothing was changed: "
    "emb.discard_step() on every rank drops the step, and the write with it")
#: Why a forward refuses a step zero_grad() dropped after emb.weight.data was assigned another tensor.
_ASSIGNED_BEFORE_DROP = (
    "emb.weight.data was assigned another tensor after this step's last training forward (SAM moving the "
    "rows with p.data = p.data + e, say), and zero_grad() then dropped the step's gradient: a "
    "ShardedOffloadedEmbedding keeps the step's rows in weight's own storage, which the assignment did not "
    "reach, so this forward would read them unmoved. Move the rows in place instead "
    "(emb.weight.data.add_(e), then emb.weight.data.sub_(e) before optimizer.step()): the step keeps them "
    "for its second pass. Nothing was changed: emb.discard_step() on every rank drops the step, and the "
    "assignment with it")
#: Why a step refuses a weight whose .data was assigned another tensor since the step's forwards.
_DATA_ASSIGNED = (
    "emb.weight.data was assigned another tensor in the middle of a step (SAM undoing its move with "
    "p.data = old_p, say), but a ShardedOffloadedEmbedding's step trains and writes back the owned rows in "
    "weight's own storage: the assigned values would be stepped and lost. Undo the move in place instead "
    "(emb.weight.data.sub_(e)). Nothing was changed, and emb.weight has its own storage back, holding the "
    "rows as they were before the assignment: undo the move in it and call optimizer.step() again, or "
    "emb.discard_step() on every rank to skip the step")
#: Where the attached optimizer's state came from, as integers for the ranks' comparison.
_ORIGINS = ("", "attach()", "load()", "attach() or load(), as counted by the state_dict() that "
                                      "load_state_dict() restored")
_ATTACHED, _LOADED, _RESTORED = 1, 2, 3
#: ``padding_idx=None`` for the ranks' comparison: no row id.
_NO_PADDING = -1
#: The exchange's flags: some rank's step has rows only unreached forwards looked up; some
#: rank's backward reached a forward of the step; some rank's gradient is the zeros
#: zero_grad(set_to_none=False) left (torch steps the table then, counting the step).
_UNREACHED, _REACHED, _ZERO_KEPT = 1, 2, 4
#: The step's flag after exchange_gradients(): some rank's gradient is not zero_grad(set_to_none=False)'s
#: zeros (see _zeroed_since_exchange); without it on any rank, the step moves no row.
_HOLDS_GRADIENT = 8


def _refuse_hook(method: str, *args, **kwargs) -> NoReturn:
    """Refuse ``emb.weight.<method>(hook)`` on a sharded embedding's weight, which no backward reaches.

    Set on that parameter in place of torch's methods (a subclass of
    ``nn.Parameter`` would break ``nn.Parameter(emb.weight)``, as
    ``weight_norm`` calls it, whose refusal must be this module's). Its
    ``requires_grad=False`` (so DDP leaves it alone) made torch raise "cannot
    register a hook on a tensor that doesn't require gradient", which says
    nothing of why: its gradient is the owned rows' average over the ranks,
    written by :meth:`ShardedOffloadedEmbedding.exchange_gradients` (or the
    step). An :class:`~speedswap.OffloadedEmbedding`'s weight hook sees the
    working set's gradient in the backward; here there is no such moment.

    Raises:
        StateError: always (a ``RuntimeError``, as torch's was); nothing is registered.
    """
    raise StateError(
        f"emb.weight.{method}(...) on a ShardedOffloadedEmbedding: its weight takes no gradient from "
        f"autograd (requires_grad=False; the owned rows' gradient, averaged over the ranks, arrives by "
        f"the exchange at optimizer.step()), so no backward would ever run the hook. Nothing was "
        f"registered. To see or change the gradient of the rows a rank looks up, register the hook on "
        f"the lookup's output (out = emb(ids); out.register_hook(fn)), as on any activation; to read "
        f"or rescale the owned rows' gradient, call emb.exchange_gradients() on every rank after the "
        f"last backward and use emb.weight.grad before optimizer.step()")


def _plain(value):
    """``value`` with tensors as Python numbers, so that its ``repr`` holds every digit."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _optimizer_fingerprint(row_state, weight) -> int:
    """0 without an optimizer; else a number that differs for another class or hyperparameters.

    Taken from the optimizer's class and the settings (``lr``, ``betas``,
    ...) of the parameter group holding ``weight``; a learning-rate schedule
    changes them alike on every rank.
    """
    if row_state is None:
        return 0
    optimizer = row_state.optimizer
    group = next((g for g in optimizer.param_groups if any(p is weight for p in g["params"])), {})
    settings = sorted((key, _plain(value)) for key, value in group.items() if key != "params")
    text = repr((type(optimizer).__module__, type(optimizer).__qualname__, settings))
    return zlib.crc32(text.encode()) + (1 << 32)  # never 0, which says "no optimizer"


#: The counters of :meth:`ShardedOffloadedEmbedding.stats`; the forwards count the last three.
_FORWARD_COUNTERS = ("lookups", "rows_from_peers", "rows_to_peers")
_COUNTERS = ("steps", "unique_rows", "owned_rows", *_FORWARD_COUNTERS)
#: The integers of :meth:`ShardedOffloadedEmbedding._config`, which :func:`_describe` names.
_CONFIG_LENGTH = 10


def _describe(config) -> str:
    """One rank's :meth:`ShardedOffloadedEmbedding._config` in words."""
    number, rows, dim, max_rows, padding, by_freq, dtype, optimizer, origin, steps = config
    dtype = str(_DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(_DTYPES) else "another dtype"
    optimizer = "no optimizer" if optimizer == 0 else f"optimizer fingerprint {optimizer:#x}"
    if origin:
        optimizer += f", {steps} step(s) since {_ORIGINS[origin]}"
    padding = "" if padding == _NO_PADDING else f", padding_idx={padding}"
    padding += ", scale_grad_by_freq=True" if by_freq else ""
    return (f"ShardedOffloadedEmbedding #{number} built on its group: {rows} x {dim} {dtype}, "
            f"max_rows={max_rows}{padding}, {optimizer}")


def _gradient_dropped(ref):
    """For :class:`ReachedRows`: whether ``zero_grad()`` dropped the gradient of the step's earlier backwards.

    ``zero_grad()`` drops only ``weight``'s placeholder; the looked-up rows'
    own gradient, which the exchange sends, is cleared here, before this
    backward adds to it.
    """
    def dropped():
        embedding = ref()
        if embedding is None:
            return False
        # After exchange_gradients(), zero_grad(set_to_none=False) zeroes the exchanged gradient.
        zeroed = embedding._zeroed_since_exchange()
        if not zeroed and (not embedding._backward_ran or embedding.weight.grad is not None):
            return False
        if zeroed:
            embedding._keep_zero_grad()  # the gradient this backward adds to, as in memory
        embedding._rows.grad = None
        embedding._backward_ran = False  # asked once per backward: its end sets it again
        embedding._stale = False  # the last step's gradient, if it was there, went with it
        # A step whose gradients were exchanged (for a GradScaler that then skipped it): its
        # exchange is void too, and the next step's makes a fresh one, the dropped forwards
        # flagged unreached so that their owners put their rows back.
        embedding._release_agreed_state()
        embedding._exchanged = embedding._late_backward = embedding._agreed = False
        embedding._put_back = embedding._arrived = None
        return True
    return dropped


def _note_backward(ref):
    """A post-accumulate-grad hook for the looked-up rows that holds the embedding weakly."""
    def note(_rows):
        embedding = ref()
        if embedding is None:
            return
        if embedding._exchanged:
            embedding._late_backward = True  # its gradient arrives after the exchange
        elif (embedding.weight.grad is None or embedding._leftover_version is not None
              or embedding._zero_kept):
            embedding._backward_ran = True
            # Not zeroed, the last step's gradient would be added to in memory: refused at the
            # step, unless a zero_grad() drops the step (and it) first.
            embedding._stale = embedding._leftover_unchanged()
            # Zeros until the exchange fills it before the step; a change to them (a clip,
            # zero_grad(set_to_none=False)) is refused at the step, by the version. A GradScaler
            # unscales in place without bumping it: the last element, marked, shows a rescale.
            embedding._set_placeholder()
    return note
