"""Row ownership and the collectives that move ids, rows and gradients between ranks.

**The split.** A table of ``num_rows`` rows sharded over ``world_size`` ranks
is cut into contiguous ranges exactly as ``torch.tensor_split(rows,
world_size)`` cuts it: the first ``num_rows % world_size`` ranks own
``num_rows // world_size + 1`` rows, the others one fewer. Rank ``r`` owns
rows ``bounds[r] <= id < bounds[r + 1]``. Contiguous ranges make the owner of
an id one binary search, keep sorted ids grouped by owner, and make a
checkpoint shard one slice of the table (resharding reads ranges).

**The exchange.** Every message is an ``all_to_all_single`` with per-rank
split sizes (NCCL and, since torch 2.x, gloo implement it with uneven
splits), so a message is as long as the rows a step touches, never the
table. A rank with nothing to send takes part with empty splits.

**Failures.** A collective that one rank skips hangs the others, and two
ranks in collectives of different kinds or sizes hang or abort. So every
call (a forward, an exchange of gradients, a step, a save, a load) starts with the same message
(and a table's construction ends with it),
:meth:`Exchange.begin`: what the rank is doing, whether its checks passed,
the table's size and optimizer, and the counts of the rows to come. Every
check that can fail runs *before* it; a rank that met bad input says so,
every rank sees it, the failing rank raises its own error and the others a
:class:`~speedswap.StateError` naming it, all without changing a row, and
ranks that make different calls or hold different tables all raise
``StateError``. Work that can fail between collectives (file writes) ends
with :meth:`Exchange.agree` (:func:`run_everywhere`), a message whose
making can fail (the rows other ranks asked for, in memory sized by them)
is sent by :meth:`Exchange.reply`, which agrees first, and the memory a
message sized by the other ranks arrives in is made under that agreement
too, or before the call's first message (:meth:`Exchange.rows`).

>>> row_bounds(10, 3)
[0, 4, 7, 10]
>>> starts = owner_starts(row_bounds(10, 3), "cpu")
>>> owners(torch.tensor([0, 3, 4, 9]), starts).tolist()
[0, 0, 1, 2]
>>> count_by_owner(owners(torch.tensor([0, 3, 4, 9]), starts), 3).tolist()
[2, 1, 1]
"""

import functools
import operator
from typing import Callable, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from ..errors import OptionError, StateError

__all__ = ["row_bounds", "owner_starts", "owners", "count_by_owner", "Exchange", "CALLS", "TRAIN_FORWARD", "EVAL_FORWARD", "STEP", "SAVE",
           "LOAD", "EXCHANGE", "GRAD_NORM", "LOAD_TABLE", "BUILD", "run_everywhere"]

T = TypeVar("T")

#: The collective calls, as :meth:`Exchange.begin` names them when ranks make different ones.
#: An explicit exchange_gradients() is a call of its own: a rank exchanging there must not
#: pair with a rank whose step exchanges (and steps) at once. So is a load of a whole-table
#: .npy: its messages would pair with a sharded checkpoint's load, each rank loading its own file.
CALLS = ("a training forward", "an eval forward (eval mode or torch.no_grad())",
         "optimizer.step()", "save()", "load() of a sharded checkpoint", "exchange_gradients()",
         "grad_norm()", "load() of a whole-table .npy", "building a ShardedOffloadedEmbedding")
TRAIN_FORWARD, EVAL_FORWARD, STEP, SAVE, LOAD, EXCHANGE, GRAD_NORM, LOAD_TABLE, BUILD = range(len(CALLS))


def row_bounds(num_rows: int, world_size: int) -> List[int]:
    """The first row of each rank's range, then ``num_rows``: ``torch.tensor_split``'s cut.

    Args:
        num_rows: rows of the whole table.
        world_size: ranks sharing it.

    Returns:
        ``world_size + 1`` increasing offsets; rank ``r`` owns ``[bounds[r], bounds[r + 1])``.

    Raises:
        OptionError: fewer rows than ranks (a rank would own no row).
    """
    if num_rows < world_size:
        raise OptionError(f"a table of {num_rows} rows cannot be sharded over {world_size} ranks: "
                          f"every rank must own at least one row; use fewer ranks or an "
                          f"unsharded OffloadedEmbedding")
    base, extra = divmod(num_rows, world_size)
    bounds = [0]
    for rank in range(world_size):
        bounds.append(bounds[-1] + base + (rank < extra))
    return bounds


def owner_starts(bounds: Sequence[int], device) -> torch.Tensor:
    """The first row of every rank but the first, on ``device``: :func:`owners`' search table.

    Made once per table: made at each call, it would cross to a GPU with a host wait.

    Args:
        bounds: from :func:`row_bounds`.
        device: where the ids to look up live.
    """
    return torch.tensor(bounds[1:-1], dtype=torch.int64, device=device)


def owners(ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The rank owning each id (int64, same shape and device as ``ids``).

    Args:
        ids: validated int64 ids in ``[0, num_rows)``.
        starts: from :func:`owner_starts`, on the ids' device.
    """
    return torch.bucketize(ids, starts, right=True)


def count_by_owner(dest: torch.Tensor, world_size: int, where: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How many entries of ``dest`` each rank is: an int64 ``(world_size,)`` tensor, with no host wait.

    ``torch.bincount`` sizes its result by the largest entry, which a GPU's
    host waits for; here the size is known, and the counts stay on the
    device until the caller reads them with what else it reads.

    Args:
        dest: 1-D ranks, from :func:`owners`.
        world_size: ranks in the group.
        where: a bool mask shaped like ``dest``: count only the entries where it is True.
    """
    ones = torch.ones_like(dest) if where is None else where.to(dest.dtype)
    return torch.zeros(world_size, dtype=dest.dtype, device=dest.device).index_add_(0, dest, ones)


class Exchange:
    """All-to-all messages between the ranks of one process group.

    With one rank (``torch.distributed`` not initialised, or a group of one)
    every message is handed back as it is, with no collective, so a sharded
    table also works in a single process.

    Args:
        process_group: the group; None is the default group when
            ``torch.distributed`` is initialised, else a single rank.
        device: where messages are built: the table's device (a CUDA device
            for NCCL, the CPU for gloo); None, where a rank has none (its
            backend was refused), is the group's: torch's current CUDA device for NCCL, else the CPU.
        local: a single rank even when ``torch.distributed`` is initialised
            (one process reading a whole sharded checkpoint).

    Raises:
        OptionError: a ``process_group`` without ``torch.distributed`` initialised,
            or one this process is not a member of.
    """

    def __init__(self, process_group=None, device="cpu", *, local: bool = False):
        self.distributed = not local and dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.distributed:
            raise OptionError("a process_group was given but torch.distributed is not "
                              "initialised; call torch.distributed.init_process_group first")
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        if self.rank < 0:  # torch's rank of a process outside the group
            raise OptionError(f"this process (global rank {dist.get_rank()}) is not a member of "
                              f"process_group, so it owns none of the table's rows; build the "
                              f"ShardedOffloadedEmbedding only on the group's ranks")
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        #: The group's global ranks, which name it alike on every rank (None passed or the default group).
        self.ranks = (tuple(dist.get_process_group_ranks(
            dist.group.WORLD if process_group is None else process_group)) if self.distributed else (0,))
        if device is None:
            nccl = self.distributed and dist.get_backend(process_group) == dist.Backend.NCCL
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        self.bytes_sent = 0  # rows' bytes this rank sent to other ranks (the benchmark reads it)

    def _all_to_all(self, send: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                    recv: Optional[torch.Tensor]) -> torch.Tensor:
        """Send ``send`` and receive into ``recv``, from :meth:`_receive_buffer`."""
        if self.world_size == 1:
            return send
        dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts,
                               group=self.group)
        return recv

    def _receive_buffer(self, send: torch.Tensor, recv_counts: List[int]) -> Optional[torch.Tensor]:
        """Where the rows sent to this rank land (None with one rank: the message is ``send`` itself)."""
        if self.world_size == 1:
            return None
        return send.new_empty((sum(recv_counts), *send.shape[1:]))

    def begin(self, call: int, error: Optional[BaseException], config: Sequence[int],
              describe: Callable[[Sequence[int]], str], what: str, *,
              send_counts: Optional[Sequence[int]] = None, expected: Optional[Sequence[int]] = None,
              flags: int = 0) -> Tuple[List[int], int]:
        """The first message of every collective call: the ranks check that they make the same call alike.

        One all-gather of a vector whose length depends only on the world
        size and on ``config``'s (fixed) length, whatever the call. Ranks
        that make different calls (one saving while another steps, a step
        skipped on some ranks only) therefore meet in this message and find
        out, instead of pairing collectives of different kinds and sizes,
        which hangs until the process group's timeout or aborts the process.
        Every rank sees every rank's vector, so every rank reaches the same
        verdict.

        Args:
            call: what this rank is doing, one of :data:`CALLS`' indices.
            error: the exception this rank's checks raised, or None.
            config: integers that must be equal on every rank (the table's
                size, dtype and ``max_rows``, the optimizer), the same number
                of them on every rank.
            describe: turns one rank's ``config`` into words for the error.
            what: the call, named in the error the other ranks raise.
            send_counts: rows this rank will send to each rank next, if any.
            expected: rows this rank expects from each rank; when given, every
                pair of ranks must agree (rows sent that the receiver does not
                expect would be written into memory sized for others).
            flags: bits of this rank's (yes/no answers), told to every rank.

        Returns:
            (the rows this rank will receive from each rank, the bitwise OR of every rank's ``flags``).

        Raises:
            ``error`` itself on the rank that met it. On the others (on every
            rank for the rest), StateError, naming the first cause of these
            that holds: ranks that failed, ranks that make different calls,
            ranks whose ``config`` differs, or, with
            ``expected``, a rank that would send another a number of rows it
            does not expect.
        """
        world = self.world_size
        sends = [0] * world if send_counts is None or error is not None else list(send_counts)
        expects = [0] * world if expected is None else list(expected)
        mine = [call, int(error is not None), int(flags), *config, *sends, *expects]
        if world == 1:
            table = [mine]
        else:
            sent = torch.tensor(mine, dtype=torch.int64, device=self.device)
            gathered = [torch.empty_like(sent) for _ in range(world)]
            dist.all_gather(gathered, sent, group=self.group)
            table = torch.stack(gathered).tolist()
        if error is not None:
            raise error
        calls = [row[0] for row in table]
        made = "; ".join(f"rank {rank}: {CALLS[c]}" for rank, c in enumerate(calls))
        # A rank's failure first: its own error is the cause, and it may be why its call differs (a load
        # refused before it could tell a whole-table .npy from a checkpoint reports the latter).
        failed = [rank for rank, row in enumerate(table) if row[1]]
        if failed and len(set(calls)) > 1:
            raise StateError(f"rank(s) {failed} failed (their own errors say why), and the ranks made "
                             f"different calls at once ({made}); every rank stopped before changing a "
                             f"row: mend the failed rank(s)' input, and make the same calls in the same "
                             f"order on every rank")
        if failed:
            raise StateError(f"{what} failed on rank(s) {failed} (their own errors say why); "
                             f"every rank stopped before changing a row, so it can be retried "
                             f"with good input on all ranks")
        if set(calls) == {TRAIN_FORWARD, EVAL_FORWARD}:
            trains = [rank for rank, c in enumerate(calls) if c == TRAIN_FORWARD]
            evals = [rank for rank, c in enumerate(calls) if c == EVAL_FORWARD]
            raise StateError(f"{what} ran in training mode on rank(s) {trains} but in eval mode or "
                             f"under torch.no_grad() on rank(s) {evals}; every rank must make the "
                             f"same call (the same model.train()/eval() and grad mode). No row changed")
        if len(set(calls)) > 1:
            raise StateError(f"the ranks made different calls at once ({made}). Every rank must "
                             f"make the same calls in the same order, as DDP needs: every forward, "
                             f"every exchange_gradients() and optimizer.step() (a step skipped on "
                             f"every rank or none: a GradScaler must agree on infs across ranks, as "
                             f"torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler does), "
                             f"every save() and load(). No row changed; call discard_step() on every "
                             f"rank to drop the step under way, then train on")
        configs = [row[3:3 + len(config)] for row in table]
        if any(c != configs[0] for c in configs):
            ranks = "; ".join(f"rank {rank}: {describe(c)}" for rank, c in enumerate(configs))
            raise StateError(f"{what}: the ranks' embeddings differ ({ranks}). Build the "
                             f"ShardedOffloadedEmbedding with the same num_embeddings, "
                             f"embedding_dim, max_rows, dtype, padding_idx and scale_grad_by_freq on every rank, build "
                             f"and call the tables in the same order on every rank, and "
                             f"attach the same optimizer class with the same hyperparameters on every "
                             f"rank at the same point (a rank that attached alone restarted its "
                             f"optimizer state: attach() on every rank to restart it everywhere, or "
                             f"load() a checkpoint on every rank; step counts that differ come from "
                             f"state_dict()s of different steps restored on the ranks (restore one "
                             f"step's on every rank), or from a step one rank took and another "
                             f"skipped, such as a step with no forward after "
                             f"zero_grad(set_to_none=False) on one rank and zero_grad() on "
                             f"another: zero gradients alike on every rank). No row changed")
        base = 3 + len(config)
        if expected is not None:
            wrong = [(s, r, table[s][base + r], table[r][base + world + s])
                     for s in range(world) for r in range(world)
                     if table[s][base + r] != table[r][base + world + s]]
            if wrong:
                pairs = ", ".join(f"rank {s} sends rank {r} {n} rows, which expects {m}"
                                  for s, r, n, m in wrong)
                raise StateError(f"{what}: the ranks disagree about this step ({pairs}). A step "
                                 f"was skipped, or a backward left out, on some ranks only; every "
                                 f"rank must do both alike. Call discard_step() on every rank, "
                                 f"then train on")
        return ([table[s][base + self.rank] for s in range(world)],
                functools.reduce(operator.or_, (row[2] for row in table)))

    def rows(self, what: str, send: torch.Tensor, send_counts: List[int], recv_counts: List[int],
             into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Send ``send``'s rows, grouped by destination, and receive the rows sent here.

        The memory they arrive in is sized by what the other ranks send. Made
        here, it may fail on one rank (out of memory), which would leave its
        peers waiting in the all-to-all until the process group's timeout: every
        rank first hears in one :meth:`agree` whether every rank made it. A
        caller that knows a bound passes ``into``, made beforehand, which saves that message.

        Args:
            what: the call, named in the error the other ranks raise.
            send: ``(sum(send_counts), ...)`` rows, those for rank 0 first.
            send_counts: rows for each rank.
            recv_counts: rows from each rank (what :meth:`begin` returned, or
                known from an earlier message).
            into: memory for at least ``sum(recv_counts)`` rows shaped and typed
                as ``send``'s, to receive into; given on every rank, or on none.

        Returns:
            ``(sum(recv_counts), ...)`` rows, those from rank 0 first.

        Raises:
            Without ``into``: the receive memory's exception on the rank that met it;
            StateError naming the failed ranks on the others. No row has moved then.
        """
        if into is None:
            recv = run_everywhere(self, what, lambda: self._receive_buffer(send, recv_counts))
        else:
            recv = into[:sum(recv_counts)]
        self._count_bytes(send, send_counts)
        return self._all_to_all(send, send_counts, recv_counts, recv)

    def reply(self, what: str, make: Callable[[], torch.Tensor], send_counts: List[int],
              recv_counts: List[int]) -> torch.Tensor:
        """:meth:`rows` of what ``make()`` returns, once every rank has made its message.

        For work between two messages of a call that may fail on one rank
        (memory sized by what the other ranks asked for, a read of the
        table): a rank that raised there and left the call would leave its
        peers waiting in the all-to-all until the process group's timeout.
        ``make()`` and the memory the rows are received into are made first,
        then every rank hears in one :meth:`agree` whether every rank did.

        Args:
            what: the call, named in the error the other ranks raise.
            make: this rank's rows, grouped by destination, as :meth:`rows` sends them.
            send_counts, recv_counts: as for :meth:`rows`.

        Returns:
            As :meth:`rows`.

        Raises:
            ``make``'s exception (or the receive buffer's) on the rank that
            met it; StateError naming the failed ranks on the others. No row
            has moved between ranks then.
        """
        def prepare():
            send = make().contiguous()  # a copy to make, if it is not: here, where it may fail
            return send, self._receive_buffer(send, recv_counts)

        send, recv = run_everywhere(self, what, prepare)
        self._count_bytes(send, send_counts)
        return self._all_to_all(send, send_counts, recv_counts, recv)

    def _count_bytes(self, send: torch.Tensor, send_counts: List[int]) -> None:
        if len(send):
            row_bytes = send[0].numel() * send.element_size()
            self.bytes_sent += row_bytes * (sum(send_counts) - send_counts[self.rank])

    def norm(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of every rank's values, from each rank's norm ``local`` of its own.

        One all-gather of each rank's part and ``norm_type``, so that ranks
        asking for different norms (each would clip by another factor) find out.

        Args:
            local: a 0-dim float tensor, this rank's norm.
            norm_type: the norm's order, as ``torch.linalg.vector_norm`` takes it.

        Returns:
            The same 0-dim tensor on every rank.

        Raises:
            StateError: ranks passed different ``norm_type`` values (on every rank).
        """
        if self.world_size == 1:
            return local
        # The table's norm from the ranks': the largest (smallest) entry of all, the count of
        # non-zero ones, or the sum of every rank's sum of powers, whose root is taken once.
        powers = norm_type not in (0.0, float("inf"), -float("inf"))
        # In float64 before the power: a float16 norm past 256 squared to inf (torch sums a float16
        # norm in float32, so the table's is finite), and a clip by inf zeroes every gradient.
        part = local.double().pow(norm_type) if powers else local.double()
        # full_like, not torch.tensor: on a GPU a fill is queued where a copy from the host waits.
        mine = torch.stack([part, torch.full_like(part, norm_type)])
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        parts, orders = torch.stack(every).unbind(1)
        asked = sorted(set(orders.tolist()))  # every rank's in one read: one host wait, not one per rank
        if len(asked) > 1:
            raise StateError(f"grad_norm() was asked for norms of different orders {asked} on the "
                             f"ranks: each would clip by another factor; pass the same norm_type on "
                             f"every rank")
        if powers:
            total = parts.sum().pow(1.0 / norm_type)
        else:
            total = {0.0: parts.sum, float("inf"): parts.max, -float("inf"): parts.min}[norm_type]()
        return total.to(local.dtype)

    def ranks_by_value(self, value: int) -> List[List[int]]:
        """The ranks grouped by the ``value`` each passed, in order of each group's first rank (a collective).

        Args:
            value: this rank's integer (a fingerprint of what it is about to use).

        Returns:
            One list of ranks per distinct value: one list when every rank agrees.
        """
        if self.world_size == 1:
            return [[0]]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        groups = {}
        for rank, each in enumerate(torch.cat(every).tolist()):
            groups.setdefault(each, []).append(rank)
        return list(groups.values())

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Raise on every rank if ``what`` failed on any: the end of work that may fail.

        Args:
            error: this rank's exception, or None.
            what: the work, named in the error the other ranks raise.

        Raises:
            ``error`` on the rank that met it; StateError naming the failed
            ranks on the others.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        flags[self.rank] = error is not None
        dist.all_reduce(flags, group=self.group)
        if error is not None:
            raise error
        failed = flags.nonzero().flatten().tolist()
        if failed:
            raise StateError(f"{what} failed on rank(s) {failed} (their own errors say why)")


def run_everywhere(exchange: Exchange, what: str, work: Callable[[], T], *,
                   on_rank: Optional[int] = None) -> Optional[T]:
    """Run ``work()`` (on every rank, or only ``on_rank``), then raise everywhere if it failed anywhere.

    Returns:
        What ``work()`` returned (None on the ranks that did not run it).

    Raises:
        as :meth:`Exchange.agree`.
    """
    error, result = None, None
    if on_rank is None or exchange.rank == on_rank:
        try:
            result = work()
        except Exception as exc:  # noqa: BLE001 -- every rank must reach agree()
            error = exc
    exchange.agree(error, what)
    return result
