"""Skip-gram with negative sampling: the model, and a training step that needs no autograd.

:class:`SkipGram` is the model as an ``nn.Module``, for autograd. Its
gradients are simple enough to write down (see :func:`manual_step`), and
computing them directly skips what autograd costs on a CPU here: the graph,
one ``(B, 1 + K, D)`` product per direction, and embedding gradients the size
of the working set's capacity. :func:`manual_step` trains two
:class:`~speedswap.OffloadedEmbedding` tables that way: the rows come from
:meth:`~speedswap.OffloadedEmbedding.slots`, the gradients go to
``weight.grad``, and the optimizer's own ``step()`` updates the rows and
writes them back, so the optimizer, the learning-rate scheduler and the
device cache work as with autograd, and the vectors are autograd's to
float32 rounding.

>>> import torch, speedswap as ss
>>> from speedswap.apps.pairs import PairBatch
>>> centre, context = (ss.OffloadedEmbedding(50, 8, max_rows=32, backend="numpy") for _ in range(2))
>>> opt = torch.optim.SGD([centre.weight, context.weight], lr=0.025)
>>> centre.attach(opt); context.attach(opt)
>>> step = manual_step(centre, context, opt)
>>> batch = PairBatch.plan(torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([[5, 6], [7, 1]]),
...                        centre_rows=50, context_rows=50)
>>> loss = step(batch)
>>> loss.shape
torch.Size([])
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import torch.optim.optimizer as torch_optimizer

import speedswap as ss

from .pairs import PairBatch

__all__ = ["SkipGram", "manual_step"]


def _signs(columns: int, like: torch.Tensor) -> torch.Tensor:
    """+1 for column 0 (the true context), -1 for the negatives."""
    sign = torch.ones(columns, dtype=like.dtype, device=like.device)
    sign[1:] = -1.0
    return sign


def _skipped(ids: torch.Tensor) -> torch.Tensor:
    """``(B, 1 + K)``: True where a negative is its pair's own context word (column 0 never).

    word2vec.c and gensim draw such a negative and skip it (``if (target ==
    word) continue``): it would push the context word away from the centre in
    the same step that pulls it closer. Skipped, it adds nothing to the loss or
    the gradients, so those pairs train on fewer negatives, as there.
    """
    skip = ids == ids[:, :1]
    skip[:, 0] = False
    return skip


class SkipGram(torch.nn.Module):
    """Skip-gram with negative sampling over two embedding modules.

    ``centre`` and ``context`` are anything called like ``nn.Embedding``:
    :class:`~speedswap.OffloadedEmbedding` (global word ids) or a small
    ``nn.Embedding`` batch buffer fed local ids by SpeedTorch-style switchers.
    The context table is called once per step with the positive and negative
    ids together, so each row it holds is gathered once.
    """

    def __init__(self, centre: torch.nn.Module, context: torch.nn.Module):
        super().__init__()
        self.centre = centre
        self.context = context

    def forward(self, centres: torch.Tensor, contexts: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
        """Negative-sampling loss of a batch, summed over its pairs (see :mod:`speedswap.apps.word2vec` on ``lr``).

        A negative equal to its pair's context word is skipped, as word2vec.c
        and gensim skip it: it adds nothing to the loss.

        Args:
            centres: ``(B,)`` ids.
            contexts: ``(B,)`` ids of words seen near the centres.
            negatives: ``(B, K)`` ids of sampled words.

        Returns:
            the scalar loss.
        """
        ids = torch.cat([contexts.unsqueeze(1), negatives], dim=1)
        u = self.centre(centres)
        v = self.context(ids)
        # An element-wise product and sum, not bmm: on a CPU, B tiny (K+1)x1
        # matrix products cost several times more than one pass over (B, K+1, D).
        score = (v * u.unsqueeze(1)).sum(-1)
        return -F.logsigmoid(score * _signs(score.shape[1], score)).masked_fill(_skipped(ids), 0.0).sum()


def _scores(u: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``scores[b, k] = u[b] . table[rows[b, k]]`` without gathering the ``(B, K, D)`` rows.

    A sampled matrix product (SDDMM) of ``u`` and ``table`` at the pattern
    ``rows``: one pass over the rows it reads, against a gather, a product and
    a sum over ``(B, K, D)``.
    """
    pairs, columns = rows.shape
    if columns > len(table) or u.dtype not in (torch.float32, torch.float64):
        # The sparse pattern cannot hold more entries per row than the table has columns, and
        # torch's sampled_addmm has no float16/bfloat16 kernel on every device: gather instead.
        return (table[rows] * u.unsqueeze(1)).sum(-1)
    crow = torch.arange(0, pairs * columns + 1, columns, device=rows.device)
    with warnings.catch_warnings():
        # torch calls sparse CSR tensors beta; this one is built valid, so skip the checks.
        warnings.simplefilter("ignore", UserWarning)
        pattern = torch.sparse_csr_tensor(crow, rows.reshape(-1), torch.zeros(pairs * columns, dtype=u.dtype,
                                          device=u.device), (pairs, len(table)), check_invariants=False)
    return torch.sparse.sampled_addmm(pattern, u, table.t(), beta=0.0).values().view(pairs, columns)


def _score_gradients(score: torch.Tensor, ids: torch.Tensor) -> tuple:
    """The loss's gradient with respect to each score, and the loss, of ``(B, 1 + K)`` scores.

    Column 0 holds the true contexts' scores, the others the negatives';
    ``ids`` are the ``(B, 1 + K)`` ids scored, whose negatives equal to their
    pair's context are skipped (:func:`_skipped`).
    """
    sign = _signs(score.shape[1], score)
    signed = score * sign
    skip = _skipped(ids)
    # dL/d(signed) = -s(-signed), as autograd computes it (no 1 - s(x) cancellation).
    return (torch.sigmoid(signed.neg()).mul_(sign.neg()).masked_fill_(skip, 0.0),
            -F.logsigmoid(signed).masked_fill_(skip, 0.0).sum())


def manual_step(centre: torch.nn.Module, context: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                in_place: Optional[bool] = None) -> Callable[..., torch.Tensor]:
    """A training step of :class:`SkipGram` on two attached OffloadedEmbeddings, without autograd.

    With ``u`` the centre row of a pair and ``v_k`` its context (``k=0``)
    and negative rows, the loss ``-log s(u.v_0) - sum log s(-u.v_k)`` (the
    sum skips negatives equal to the context, as :class:`SkipGram` does) has
    ``dL/d(u.v_k) = g_k = s(u.v_k) - [k == 0]``, so the centre row's gradient
    is ``sum_k g_k v_k`` and row ``v_k``'s is ``g_k u``, summed over every
    occurrence of a row in the batch. The step brings the rows in with
    :meth:`~speedswap.OffloadedEmbedding.slots`, computes those sums with
    gather-and-sum kernels (``embedding_bag`` over the runs a
    :class:`~speedswap.apps.pairs.PairBatch` groups, which never
    materialises the ``(B, 1 + K, D)`` products), hands them over as
    ``weight.grad`` (only the step's rows are written) and calls
    ``optimizer.step()``, whose hooks write the rows back. The result is
    autograd's, to float32 rounding.

    **In place.** When the tables' memory is the device's (the CPU backend),
    without a device cache, and the optimizer is plain SGD (no momentum,
    weight decay, Nesterov or ``maximize``, and no step pre-hook of the
    user's, which could change the gradients first) on float32 tables, the copies into
    the working set and back buy nothing: the step then reads the rows where
    they are and adds ``-lr`` times the same gradients to them in place, the
    update SGD's ``step()`` makes (``lr`` read from the optimizer at every
    step, so schedulers work). The vectors equal those of the copying step to
    float32 rounding. ``optimizer.step()`` is still called, with no gradients
    (so it changes nothing), so step hooks and schedulers see a step as usual.
    The conditions are checked at every step; when one stops holding, the
    step copies again.

    Args:
        centre, context: :class:`~speedswap.OffloadedEmbedding` tables
            attached to ``optimizer``, without ``padding_idx`` or ``scale_grad_by_freq``.
        optimizer: the optimizer of both tables' ``weight``.
        in_place: None: in place whenever the conditions above hold; False:
            always through the working set; True: in place, raising when the
            conditions do not hold.

    Returns:
        ``step(batch, between=None) -> loss``: ``batch`` a non-empty
        :class:`~speedswap.apps.pairs.PairBatch` on the tables' device;
        ``between()``, when given, is called once the step's rows are in and
        before the optimizer updates them (where to prefetch the next
        batch's rows). The loss (summed over the pairs) is detached.

    Raises:
        OptionError: a table with a padding row (skip-gram has none) or with
            ``scale_grad_by_freq``, or one table as both ``centre`` and ``context``; (also from a step)
            ``in_place=True`` where the step cannot train in place.
        ShapeError: (from a step) an empty batch.
        IdError: (from a step) a batch planned for larger tables.
        StateError: (from a step) a table already holds rows of an unfinished step.

    A step that raises (bad ids, a full working set, the optimizer) leaves both
    tables as they were and free for the next step.
    """
    if centre.padding_idx is not None or context.padding_idx is not None:
        raise ss.OptionError("skip-gram tables have no padding row; build them without padding_idx")
    if centre.scale_grad_by_freq or context.scale_grad_by_freq:
        # The closed form sums each row's gradients as they are; autograd would divide them by the row's count.
        raise ss.OptionError("manual_step computes unscaled gradients, and a table built with "
                             "scale_grad_by_freq=True divides each row's by its count in the batch; build "
                             "the tables without it, or train SkipGram with autograd")
    if centre is context:
        # The step takes each table's slots from 0; one table would hand out both sets from one.
        raise ss.OptionError("manual_step needs two tables (centre and context); for one shared "
                             "table train SkipGram(emb, emb) with autograd")
    centre_grad, context_grad = torch.zeros_like(centre.weight), torch.zeros_like(context.weight)

    def copying_step(batch: PairBatch, between: Optional[Callable[[], None]]) -> torch.Tensor:
        with torch.no_grad():
            u_slots = centre.slots(batch.centres)
            # Sorted, distinct ids at a step's start take slots 0, 1, ...: the batch's local ids.
            context.slots(batch.context_rows)
            if between is not None:
                between()
            v_local = batch.context_slots()
            v_rows = context.weight.detach()[:len(batch.context_rows)]
            u = centre.weight.detach().index_select(0, u_slots)
            g, loss = _score_gradients(_scores(u, v_local, v_rows), v_local)
            # Centre rows: sum_k g_k v_k over each row's pairs, one bag per centre (the pairs come
            # sorted by centre, whose slots are 0, 1, ... in the same order). Not a per-pair sum
            # then index_add_: on a GPU that adds with atomics, in an order that varies run to run.
            centre_grad[:len(batch.centre_rows)] = F.embedding_bag(
                v_local.view(-1), v_rows, batch.centre_starts, per_sample_weights=g.view(-1), mode="sum")
            # Context rows: sum of g_k u over each row's occurrences, which the batch groups by row.
            context_grad[:len(batch.context_rows)] = F.embedding_bag(
                batch.context_pairs, u, batch.context_starts, per_sample_weights=g.view(-1)[batch.context_order],
                mode="sum")
            centre.weight.grad, context.weight.grad = centre_grad, context_grad
        optimizer.step()
        return loss

    def step(batch: PairBatch, between: Optional[Callable[[], None]] = None) -> torch.Tensor:
        if not len(batch):
            raise ss.ShapeError("the batch has no pairs, so no step to take; skip empty batches")
        if len(centre.working_rows) or len(context.working_rows):
            raise ss.StateError("a training forward ran since the last optimizer step; the step's slots "
                                "would not be its own: call optimizer.step() first, or the tables' "
                                "discard_step() to drop that forward")
        rates = None if in_place is False else _in_place_rates(centre, context, optimizer)
        if rates is None and in_place:
            raise ss.OptionError("in_place=True needs float32 tables on the CPU backend without a device "
                                 "cache, and plain SGD (no momentum, weight_decay, nesterov or maximize, "
                                 "no step pre-hook of yours, which would not see the gradients); "
                                 "pass in_place=None to copy rows when that does not hold")
        if rates is None:
            try:
                return copying_step(batch, between)
            except BaseException:
                # The rows taken in stay as they were (a step refused by its checks changes
                # nothing), and the next step must not find them in flight.
                centre.discard_step()
                context.discard_step()
                raise
        loss = _in_place_sgd(centre, context, rates, batch, between)
        centre.weight.grad = context.weight.grad = None  # nothing left for step() to apply
        optimizer.step()
        return loss

    return step


def _has_foreign_pre_hooks(optimizer) -> bool:
    """Whether a step pre-hook not of speedswap's runs before ``optimizer.step()`` (its own or global).

    Such a hook may change the gradients (clip, scale, add noise) before the
    update, so a step that updates rows without handing the optimizer
    gradients must not be taken in its place. speedswap's own hooks narrow,
    exchange or check, and leave the gradients of other parameters alone.
    """
    # The registries behind torch.optim.optimizer.register_optimizer_step_pre_hook and
    # Optimizer.register_step_pre_hook (private names: absent, they count as empty).
    hooks = [*getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
             *getattr(optimizer, "_optimizer_step_pre_hooks", {}).values()]
    return any(not getattr(hook, "__module__", "").startswith("speedswap.") for hook in hooks)


def _in_place_rates(centre, context, optimizer) -> Optional[tuple]:
    """The SGD learning rates of ``centre`` and ``context`` when a step may update their tables in place, else None."""
    if type(optimizer) is not torch.optim.SGD or _has_foreign_pre_hooks(optimizer):
        return None
    rates = []
    for table in (centre, context):
        if (table.cache_rows or table.table.device.type != "cpu" or table.table.dtype != torch.float32
                or not table.table.writable):
            return None
        group = next((g for g in optimizer.param_groups if any(p is table.weight for p in g["params"])), None)
        if group is None or group["momentum"] or group["weight_decay"] or group["nesterov"] or group["maximize"]:
            return None
        rates.append(float(group["lr"]))
    return tuple(rates)


def _in_place_sgd(centre, context, rates, batch: PairBatch, between) -> torch.Tensor:
    """:func:`manual_step`'s step on the host tables themselves: read the rows, then add ``-lr`` times the gradients."""
    for table, rows, what in ((centre, batch.centre_rows, "centre"), (context, batch.context_rows, "context")):
        # The batch checked its ids against the rows it was planned for; the largest must fit this table.
        if int(rows[-1]) >= table.num_embeddings:
            raise ss.IdError(f"the batch holds {what} id {int(rows[-1])} but the {what} table has "
                             f"{table.num_embeddings} rows; plan it with {what}_rows={table.num_embeddings}")
    with torch.no_grad():
        u_table, v_table = centre.table.as_tensor(), context.table.as_tensor()
        u = u_table.index_select(0, batch.centres)  # a copy: the context gradients need the rows before the update
        g, loss = _score_gradients(_scores(u, batch.ids, v_table), batch.ids)
        # The updates are -lr times the gradients, each summed over all of its row's occurrences
        # before it meets the row (as SGD adds one summed gradient; adding each pair's share to the
        # row would round at the row's magnitude, again and again for frequent words). The -lr goes
        # into the 1 + K weights per pair: cheaper than scaling rows, and index_add_ with alpha
        # took 3 times as long as without. The batch's pairs come sorted by centre: one bag per centre.
        centre_update = F.embedding_bag(batch.ids.view(-1), v_table, batch.centre_starts,
                                        per_sample_weights=g.view(-1) * -rates[0], mode="sum")
        context_update = F.embedding_bag(batch.context_pairs, u, batch.context_starts,
                                         per_sample_weights=g.view(-1)[batch.context_order] * -rates[1], mode="sum")
        if between is not None:
            between()
        # Every read is done: the updates cannot feed into this step's own gradients.
        u_table.index_add_(0, batch.centre_rows, centre_update)
        v_table.index_add_(0, batch.context_rows, context_update)
    return loss
