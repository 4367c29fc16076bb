"""One rank of the sharded-training tests, and the data every rank and the reference share.

Run by ``tests/test_sharded.py`` as ``python tests/sharded_worker.py RANK WORLD RENDEZVOUS
SEED OUT SCENARIO...``, one process per rank, over gloo on this machine, meeting at the
``file://`` URL RENDEZVOUS (see ``tests/rendezvous.py``). Each scenario trains a
:class:`~speedswap.ShardedOffloadedEmbedding` on this rank's share of every step's global
batch and writes the rank's rows and optimizer state (``OUT/<scenario>.rank<r>.npz``),
or the errors it met (``OUT/<scenario>.rank<r>.json``).

The data is defined per *step*, not per rank: a global batch of ids (Zipf, so rows
repeat across ranks, plus a private block of rows only the batch's last slice uses),
cut into ``world`` contiguous slices, with the last rank's slice empty every fifth
step. Each rank's loss is ``world * sum(its squared errors) / GLOBAL_BATCH``, so the
DDP average of the ranks' gradients is the gradient of ``sum(all squared errors) /
GLOBAL_BATCH``: one reference for every world size.

The ``padding`` scenario builds the table with ``nn.Embedding``'s ``padding_idx`` and
``scale_grad_by_freq``; its reference is one :class:`~speedswap.OffloadedEmbedding` that
makes every rank's forwards itself (see :func:`padding_reference`).
"""

import contextlib
import copy
import datetime
import json
import os
import shutil
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as activation
from torch.utils._python_dispatch import TorchDispatchMode

NUM_ROWS, DIM, GLOBAL_BATCH = 301, 6, 60
STEPS, SAVE_AT = 120, 50
#: Steps the ``skip`` scenario computes but does not take, on every rank (as after a GradScaler's inf).
SKIPPED = frozenset(range(2, STEPS, 5))
#: Steps the ``zerokept`` scenario takes on a zero gradient (zero_grad(set_to_none=False)): they count.
ZEROED = frozenset(range(3, STEPS, 7))
#: The sam scenario's rho: each step moves the rows by SAM_RHO times their gradient between its two passes.
SAM_RHO = 5.0
#: Steps at which only rank 0 moves its rows (its peers' owned rows stay as gathered, theirs dropped at the
#: next forward, while rank 0 keeps its moved ones in the step).
SAM_RANK0_ONLY = frozenset(range(1, STEPS, 2))
#: scenario -> (optimizer class, its reference in one process, kwargs, sparse reference gradient)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, torch.optim.SGD, dict(lr=0.05), False),
    # Adam with eps=1e-30 is the same function as SparseAdam (which adds eps elsewhere).
    "adam": (torch.optim.Adam, torch.optim.SparseAdam, dict(lr=0.01, eps=1e-30), True),
    "adagrad": (torch.optim.Adagrad, torch.optim.Adagrad,
                dict(lr=0.1, initial_accumulator_value=0.1), True),
    # No in-memory torch reference: its weight decay shrinks every row at every step, where
    # lazy training decays only the rows a step looked up. See padding_reference.
    "adamw": (torch.optim.AdamW, None, dict(lr=0.01, weight_decay=0.1), False),
}
#: The padding scenario's padding row: in the block only the last slice looks up, so the last
#: rank owns it, and the other ranks look it up only where padded_batch puts it.
PAD = NUM_ROWS - 3
#: The padding scenario's nn.Embedding options, on every rank and in its reference.
EMBEDDING_OPTIONS = dict(padding_idx=PAD, scale_grad_by_freq=True)
#: The clip scenario's max_norm: below most steps' gradient norm, so that most steps clip.
MAX_NORM = 0.1
#: The midfail scenario's steps at which rank 1 fails between the messages of a call, by the call.
MIDWAY = {"forward": 3, "eval": 5, "step": 7, "exchange": 9, "eval ids": 11, "forward ids": 13, "eval output": 16}
#: The lastfail scenario's steps at which rank 1 fails after a call's last message (see that scenario).
AFTER_LAST = {"gather": 3, "sum": 6, "optimizer": 9, "exchange sum": 12, "narrow": 15, "lookup": 18,
              "state write": 21}
#: The init scenario's rows: blocks drawn whole, in part and cut between ranks (see ShardedOffloadedEmbedding._draw_rows).
INITIAL_ROWS = 2 * 1024 + 301
#: The checkpointed scenarios' steps: several of SKIPPED among them, and steps after the last.
CHECKPOINTED_STEPS = 30


def initial_table(seed):
    return torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def global_batch(seed, step):
    """``(ids (GLOBAL_BATCH,), targets (GLOBAL_BATCH, DIM))`` of one step."""
    rng = np.random.default_rng([seed, step])
    shared = NUM_ROWS - 20
    p = 1.0 / np.arange(1, shared + 1)
    ids = rng.permutation(shared)[rng.choice(shared, size=GLOBAL_BATCH, p=p / p.sum())]
    ids[-4:] = rng.integers(shared, NUM_ROWS, size=4)  # rows only the last slice touches
    targets = rng.standard_normal((GLOBAL_BATCH, DIM), dtype=np.float32)
    return torch.from_numpy(ids), torch.from_numpy(targets)


def padded_batch(seed, step):
    """:func:`global_batch` with the padding id at chosen places only.

    None at steps ``3k`` (the padding row's owner must leave it alone); at steps
    ``3k + 1`` the first id (rank 0's slice); at steps ``3k + 2`` the first two and the
    last (twice in one slice, and in the last non-empty slice, mostly its owner's).
    """
    ids, targets = global_batch(seed, step)
    ids = torch.where(ids == PAD, PAD + 1, ids)
    places = ((), (0,), (0, 1, -1))[step % 3]
    ids[list(places)] = PAD
    return ids, targets


def rank_slice(step, world, rank):
    """This rank's share of a step's global batch: a slice, empty for the last rank every fifth step."""
    ranks = world - 1 if world > 1 and step % 5 == 2 else world
    bounds = np.linspace(0, GLOBAL_BATCH, ranks + 1).astype(int)
    return slice(bounds[rank], bounds[rank + 1]) if rank < ranks else slice(0, 0)


def exchanged_backward(emb, seed, step, world, rank):
    """This rank's part of the step's global batch: its loss's backward, then ``exchange_gradients()`` (``weight.grad``
    then holds the gradient of the rows this rank owns). Returns the part's ids and targets."""
    ids, targets = global_batch(seed, step)
    part = rank_slice(step, world, rank)
    rank_loss(emb, ids[part], targets[part], world).backward()
    emb.exchange_gradients()
    return ids[part], targets[part]


def rank_loss(emb, ids, targets, world):
    """This rank's loss, from two forward calls (they share one step's working set)."""
    half = len(ids) // 2
    loss = ((emb(ids[:half]) - targets[:half]) ** 2).sum()
    loss = loss + ((emb(ids[half:]) - targets[half:]) ** 2).sum()
    return loss * (world / GLOBAL_BATCH)


def reference(name, seed, steps=STEPS, skipped=(), clip=None, zeroed=(), sam=0.0, sam_rank0_rows=None):
    """One process, one dense parameter, the union batch: the table and per-row state after ``steps``.

    The steps in ``skipped`` are left out; those in ``zeroed`` are taken on a zero gradient (Adam
    counts them); with ``clip``, every gradient is clipped to that norm; with ``sam``, each step's
    gradient is taken again with the rows moved by ``sam`` times the first one (SAM), the move
    undone through ``weight.data`` before the step, and at the steps in :data:`SAM_RANK0_ONLY` only
    rows below ``sam_rank0_rows`` (rank 0's) moved, if given.
    """
    _, ref_cls, kwargs, sparse = OPTIMIZERS[name]
    weight = torch.nn.Parameter(initial_table(seed))
    opt = ref_cls([weight], **kwargs)
    for step in range(steps):
        if step in skipped:
            continue
        ids, targets = global_batch(seed, step)

        def backward():
            (((F.embedding(ids, weight, sparse=sparse) - targets) ** 2).sum() / GLOBAL_BATCH).backward()
        backward()
        if sam:
            move = sam * weight.grad.to_dense()
            if sam_rank0_rows is not None and step in SAM_RANK0_ONLY:
                move[sam_rank0_rows:] = 0
            weight.data.add_(move)
            opt.zero_grad()
            backward()
            weight.data.sub_(move)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([weight], clip)
        if step in zeroed:
            opt.zero_grad(set_to_none=False)
        opt.step()
        opt.zero_grad()
    state = {k: v.numpy() for k, v in opt.state[weight].items() if getattr(v, "dim", int)() == 2}
    return weight.detach().numpy(), state


def padding_reference(name, seed, world):
    """The padding scenario in one process: the table and per-row state after ``STEPS``.

    One :class:`~speedswap.OffloadedEmbedding` with :data:`EMBEDDING_OPTIONS`, starting
    from :func:`initial_table` (a non-zero padding row, as if pretrained), makes every
    rank's forwards of each step itself, so that each forward counts its own ids for
    ``scale_grad_by_freq`` as that rank's does; its loss is the ranks' losses averaged, as
    the exchange averages their gradients.
    """
    import speedswap as ss
    opt_cls, _, kwargs, _ = OPTIMIZERS[name]
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=GLOBAL_BATCH + 1, storage="pageable",
                                backend="numpy", **EMBEDDING_OPTIONS)
    emb.table.scatter(torch.arange(NUM_ROWS), initial_table(seed))
    opt = opt_cls(emb.parameters(), **kwargs)
    emb.attach(opt)
    for step in range(STEPS):
        ids, targets = padded_batch(seed, step)
        parts = [rank_slice(step, world, rank) for rank in range(world)]
        (sum(rank_loss(emb, ids[part], targets[part], world) for part in parts) / world).backward()
        opt.step()
        opt.zero_grad()
    return emb.table.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()}


def bf16_reference(name, seed, world):
    """The ``bf16`` scenario in one process: the table (as float32) and per-row state after ``STEPS``.

    Plain torch, with the arithmetic the ranks do: each rank's gradient of its slice's
    :func:`rank_loss` by itself, those summed in rank order and divided by ``world`` (as the
    owner of each row sums and averages them), a float32 step, and every row rounded to
    bfloat16 after it. A reference that sums the gradients in another order (one process's
    loss over the union batch) differs from the ranks in the gradients' last float32 bits,
    which round an entry to the other bfloat16 neighbour where its new value lies within
    them of a midpoint (those are 2**16 float32 steps apart): rarely, but not never (seed
    1632855288). This one is the ranks' result exactly.
    """
    _, ref_cls, kwargs, _ = OPTIMIZERS[name]
    weight = torch.nn.Parameter(initial_table(seed).to(torch.bfloat16).float())
    opt = ref_cls([weight], **kwargs)
    for step in range(STEPS):
        ids, targets = global_batch(seed, step)
        grad = torch.zeros_like(weight)
        for rank in range(world):
            rows = weight.detach().clone().requires_grad_()
            part = rank_slice(step, world, rank)
            rank_loss(lambda i: F.embedding(i, rows), ids[part], targets[part], world).backward()
            grad += rows.grad
        weight.grad = grad / world
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            weight.copy_(weight.to(torch.bfloat16))
    state = {k: v.numpy() for k, v in opt.state[weight].items() if getattr(v, "dim", int)() == 2}
    return weight.detach().numpy(), state


def make(name, **options):
    """A sharded embedding and its attached optimizer for scenario ``name``."""
    import speedswap as ss
    opt_cls, _, kwargs, _ = OPTIMIZERS[name]
    emb = ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=options.pop("max_rows", GLOBAL_BATCH),
                                       backend="numpy", storage=options.pop("storage", "pageable"), **options)
    opt = opt_cls(emb.parameters(), **kwargs)
    emb.attach(opt)
    return emb, opt


def train(emb, opt, seed, steps, world, rank, skipped=(), before_backward=False,
          batch=global_batch):
    for step in steps:
        ids, targets = batch(seed, step)
        part = rank_slice(step, world, rank)
        loss = rank_loss(emb, ids[part], targets[part], world)
        if step in skipped and before_backward:
            opt.zero_grad()  # the loss was not finite, say: no backward, no step
            continue
        loss.backward()
        if step not in skipped:
            opt.step()
        opt.zero_grad()


def checkpointed_losses(emb, ids, targets, world, reentrant):
    """:func:`rank_loss`'s two terms, each lookup in a ``torch.utils.checkpoint`` block, one at a time (a generator).

    The backward runs each lookup again: with ``use_reentrant=False`` inside
    the backward; with ``True`` first under ``no_grad()`` (an eval forward),
    then with gradients inside the backward. The block gets a scale that
    requires a gradient, without which ``use_reentrant=True`` computes none
    through it.
    """
    half = len(ids) // 2
    scale = torch.ones((), requires_grad=True)
    for part in (slice(0, half), slice(half, None)):
        out = activation.checkpoint(lambda i, s: emb(i) * s, ids[part], scale, use_reentrant=reentrant)
        yield ((out - targets[part]) ** 2).sum() * (world / GLOBAL_BATCH)


def train_checkpointed(emb, opt, seed, world, rank, flow, reentrant):
    """Train :data:`CHECKPOINTED_STEPS` steps on :func:`checkpointed_losses` in the loop ``flow``.

    ``plain``: one backward a step; ``accumulated``: one backward a forward;
    ``skipped``: the order forward, ``zero_grad()``, backward, the steps in
    :data:`SKIPPED` skipped after their backward (a loss that was not
    finite, say) on every rank.
    """
    for step in range(CHECKPOINTED_STEPS):
        ids, targets = global_batch(seed, step)
        part = rank_slice(step, world, rank)
        losses = checkpointed_losses(emb, ids[part], targets[part], world, reentrant)
        if flow == "accumulated":
            for loss in losses:
                loss.backward()
        else:
            loss = sum(losses)
            if flow == "skipped":
                opt.zero_grad()
            loss.backward()
        if flow == "skipped" and step in SKIPPED:
            continue
        opt.step()
        if flow != "skipped":
            opt.zero_grad()


def train_exchanged_then_zeroed(emb, opt, seed, world, rank, flow):
    """Train :data:`STEPS` steps with ``exchange_gradients()`` after every backward and ``zero_grad(set_to_none=False)``.

    ``zeroed``: at the steps in :data:`ZEROED` the exchanged gradient is zeroed
    before the step (it counts, as Adam's step on a zero gradient in memory);
    ``skipped``: the steps in :data:`SKIPPED` are not taken after their exchange
    (a GradScaler found infs), their gradient zeroed before the next forward,
    and only they call ``exchange_gradients()`` (the other steps exchange by
    themselves); ``skipped_late``: every step calls it, in the loop order
    forward, ``zero_grad()``, backward.
    """
    for step in range(STEPS):
        ids, targets = global_batch(seed, step)
        part = rank_slice(step, world, rank)
        loss = rank_loss(emb, ids[part], targets[part], world)
        if flow == "skipped_late":
            opt.zero_grad(set_to_none=False)
        loss.backward()
        if flow != "skipped" or step in SKIPPED:
            emb.exchange_gradients()
        if flow == "zeroed" and step in ZEROED:
            opt.zero_grad(set_to_none=False)
        if flow == "zeroed" or step not in SKIPPED:
            opt.step()
        if flow != "skipped_late":
            opt.zero_grad(set_to_none=False)


def shard_arrays(emb):
    table = emb.table.as_tensor().float().numpy().copy()  # bfloat16 tables as float32
    arrays = {"table": table, "start": np.array(emb.row_range.start)}
    arrays.update({f"state.{k}": t.to_numpy(copy=True) for k, t in emb._state.tables.items()})
    return arrays


def train_past_a_failed_forward(emb, opt, seed, world, rank, failing, errors_file):
    """Load table0, train every step, calling ``failing(ids)`` before step 3's forward; its errors to a file."""
    import speedswap as ss
    emb.load(os.path.join(os.path.dirname(errors_file), "table0.npy"))
    errors = {}
    for step in range(STEPS):
        ids, targets = global_batch(seed, step)
        part = rank_slice(step, world, rank)
        if step == 3:
            try:
                failing(ids[part])
            except ss.SpeedswapError as exc:
                errors[type(exc).__name__] = str(exc)
        rank_loss(emb, ids[part], targets[part], world).backward()
        opt.step()
        opt.zero_grad()
    with open(errors_file, "w") as f:
        json.dump(errors, f)


class MemoryFails(TorchDispatchMode):
    """Out of memory for any new tensor that ``which(tensor)`` picks, however torch makes it (a mode).

    Args:
        which: takes each tensor an operation made (not a view, nor one it wrote into).
    """

    def __init__(self, which):
        super().__init__()
        self.which = which

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if (isinstance(result, torch.Tensor) and not func.is_view and not func._schema.is_mutable
                and self.which(result)):
            raise MemoryError("injected")
        return result


def caught(call):
    """``{error class name: message}`` of the speedswap error ``call()`` raised, or ``{}``."""
    import speedswap as ss
    try:
        call()
    except ss.SpeedswapError as exc:
        return {type(exc).__name__: str(exc)}
    return {}


def run_scenario(scenario, seed, world, rank, out):
    """Train (and checkpoint) one scenario; write this rank's shard or its errors."""
    import speedswap as ss
    kind, _, name = scenario.partition(":")
    table_file = os.path.join(out, "table0.npy")
    if kind == "train":      # train every step; the adam run also saves at SAVE_AT
        storage = "mmap" if name == "adagrad" else "pageable"
        emb, opt = make(name, storage=storage,
                        path=os.path.join(out, f"mmap-{name}-{world}") if storage == "mmap" else None)
        emb.load(table_file)
        train(emb, opt, seed, range(SAVE_AT), world, rank)
        if name == "adam":
            emb.save(os.path.join(out, f"ckpt-{world}"))
        train(emb, opt, seed, range(SAVE_AT, STEPS), world, rank)
    elif kind == "init":     # the starting rows of a table of INITIAL_ROWS rows of dtype `name`, seeded alike
        torch.manual_seed(seed)
        emb = ss.ShardedOffloadedEmbedding(INITIAL_ROWS, DIM, max_rows=1, backend="numpy", storage="pageable",
                                           dtype=getattr(torch, name))
        emb.attach(torch.optim.SGD(emb.parameters(), lr=0.1))  # no state tables: the rows alone are saved
        name = f"init-{name}"
    elif kind == "bf16":     # a bfloat16 table: rows travel as bfloat16, gradients as float32
        emb, opt = make(name, dtype=torch.bfloat16)
        rows = emb.row_range
        emb.table.scatter(torch.arange(len(rows)),
                          initial_table(seed)[rows.start:rows.stop].to(torch.bfloat16))
        train(emb, opt, seed, range(STEPS), world, rank)
        name = f"{name}-bf16"
    elif kind == "skip":     # steps in SKIPPED computed and dropped by zero_grad(), on every rank
        emb, opt = make(name)
        emb.load(table_file)
        train(emb, opt, seed, range(STEPS), world, rank, skipped=SKIPPED)
        name = f"{name}-skip"
    elif kind == "skipfwd":  # the same steps dropped before their backward
        emb, opt = make(name)
        emb.load(table_file)
        train(emb, opt, seed, range(STEPS), world, rank, skipped=SKIPPED, before_backward=True)
        name = f"{name}-skipfwd"
    elif kind == "zerokept":  # zero_grad(set_to_none=False) throughout; ZEROED steps on zero gradients
        emb, opt = make(name)
        emb.load(table_file)
        for step in range(STEPS):
            ids, targets = global_batch(seed, step)
            part = rank_slice(step, world, rank)
            how = step % 3 if step in ZEROED else None
            if how != 2:  # 2: no forward at all (a step of the other layers only)
                loss = rank_loss(emb, ids[part], targets[part], world)
            if how is None or how == 0:
                loss.backward()
            if how == 0:  # the step is skipped after its backward, on every rank
                opt.zero_grad(set_to_none=False)
                emb.discard_step()
            opt.step()  # 1: on forwards no backward reached
            opt.zero_grad(set_to_none=False)
        name = f"{name}-zerokept"
    elif kind == "checkpointed":  # lookups run again inside the backward; name: <flow>-<reentrant or not>
        flow, _, mode = name.partition("-")
        # Rows of a step skipped after its backward wait in the next step's working set: room for two steps.
        emb, opt = make("adam", max_rows=2 * GLOBAL_BATCH)
        emb.load(table_file)
        errors = caught(lambda: train_checkpointed(emb, opt, seed, world, rank, flow, mode == "reentrant"))
        with open(os.path.join(out, f"checkpointed-{name}.rank{rank}.json"), "w") as f:
            json.dump(errors, f)
        name = f"checkpointed-{name}"
    elif kind == "exchzero":  # zero_grad(set_to_none=False) after exchange_gradients(); name: the flow
        # skipped_late: the rows of a step skipped after its exchange wait in the next step's working
        # set until its backward drops them: room for two steps.
        emb, opt = make("adam", max_rows=2 * GLOBAL_BATCH)
        emb.load(table_file)
        errors = caught(lambda: train_exchanged_then_zeroed(emb, opt, seed, world, rank, name))
        with open(os.path.join(out, f"exchzero-{name}.rank{rank}.json"), "w") as f:
            json.dump(errors, f)
        name = f"exchzero-{name}"
    elif kind == "sam":      # SAM through weight.data: rows moved by SAM_RHO times their gradient between two passes
        emb, opt = make(name)
        emb.load(table_file)
        for step in range(STEPS):
            ids, targets = exchanged_backward(emb, seed, step, world, rank)  # weight.grad: for SAM to read
            move = SAM_RHO * emb.weight.grad * (rank == 0 or step not in SAM_RANK0_ONLY)
            emb.weight.data.add_(move)
            opt.zero_grad()
            rank_loss(emb, ids, targets, world).backward()
            emb.weight.data.sub_(move)
            opt.step()
            opt.zero_grad()
        name = f"{name}-sam"
    elif kind == "padding":  # padding_idx, scale_grad_by_freq; the last rank owns the padding row
        emb, opt = make(name, **EMBEDDING_OPTIONS)
        emb.load(table_file)  # the padding row too: pretrained, not zero
        train(emb, opt, seed, range(STEPS), world, rank, batch=padded_batch)
        name = f"{name}-padding"
    elif kind == "clip":     # every step clipped by the whole table's gradient norm, as in memory
        emb, opt = make(name)
        emb.load(table_file)
        for step in range(STEPS):
            exchanged_backward(emb, seed, step, world, rank)
            torch.nn.utils.clip_grads_with_norm_(emb.parameters(), MAX_NORM, emb.grad_norm())
            opt.step()
            opt.zero_grad()
        # One more step, whose ranks ask for norms of different orders: refused on both, then dropped.
        ids, targets = global_batch(seed, 0)
        rank_loss(emb, ids[rank_slice(0, world, rank)], targets[rank_slice(0, world, rank)], world).backward()
        emb.exchange_gradients()
        errors = {}
        try:
            emb.grad_norm(1.0 if rank == 1 else 2.0)
        except ss.SpeedswapError as exc:
            errors[type(exc).__name__] = str(exc)
        emb.discard_step()
        opt.zero_grad()
        with open(os.path.join(out, f"clipnorm.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors}, f)
        name = f"{name}-clip"
    elif kind == "resume":   # load another world size's Adam checkpoint and go on
        emb, opt = make("adam")
        emb.load(os.path.join(out, name))
        train(emb, opt, seed, range(SAVE_AT, STEPS), world, rank)
        name = f"{name}-resumed"
    elif kind == "staged":   # load another world size's checkpoint (and a .npy), recording what is staged
        from speedswap import files
        from speedswap.train import sharded_checkpoint
        emb, opt = make("adam")
        stage, ram = files.stage_table, sharded_checkpoint.available_ram
        staged = []

        def recording(path, header, dataset, table_dtype, ram_available, **kwargs):
            rows = stage(path, header, dataset, table_dtype, ram_available, **kwargs)
            staged.append([os.path.basename(path), ram_available, None if rows.rows is None else len(rows.rows)])
            return rows

        files.stage_table, sharded_checkpoint.available_ram = recording, lambda: 1 << 40
        try:
            emb.load(os.path.join(out, name))
            emb.load(table_file)
        finally:
            files.stage_table, sharded_checkpoint.available_ram = stage, ram
        with open(os.path.join(out, f"staged.rank{rank}.json"), "w") as f:
            json.dump({"staged": staged, "owned": len(emb.row_range)}, f)
        return
    elif kind == "bad":      # rank 1 passes an id out of range at step 3, then good ids
        def out_of_range(ids):
            bad = ids.clone()
            if rank == 1:
                bad[0] = NUM_ROWS
            emb(bad)
        emb, opt = make(name)
        train_past_a_failed_forward(emb, opt, seed, world, rank, out_of_range,
                                    os.path.join(out, f"bad.rank{rank}.json"))
        name = "bad"
    elif kind == "mode":     # at step 3 rank 1 calls the forward under no_grad, rank 0 training
        def mixed_modes(ids):
            with torch.set_grad_enabled(rank != 1):
                emb(ids)
        emb, opt = make(name)
        train_past_a_failed_forward(emb, opt, seed, world, rank, mixed_modes,
                                    os.path.join(out, f"mode.rank{rank}.json"))
        name = "mode"
    elif kind == "npyfail":  # rank 1 cannot read its rows of a .npy export: no rank changes
        emb, opt = make(name)
        before = emb.table.to_numpy(copy=True)
        from speedswap.files import tables
        readable = tables._file_chunks

        def unreadable(*args, **kwargs):
            raise ss.FileFormatError("an injected read error")
            yield  # a generator, as the function it replaces

        errors = {}
        try:
            if rank == 1:
                tables._file_chunks = unreadable
            emb.load(table_file)
        except ss.SpeedswapError as exc:
            errors[type(exc).__name__] = str(exc)
        finally:
            tables._file_chunks = readable
        changed = int((emb.table.to_numpy() != before).any(axis=1).sum())
        with open(os.path.join(out, f"npyfail.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors, "changed_rows": changed}, f)
        name = "npyfail"
    elif kind == "disagree":  # a step skipped everywhere, but rank 1 ran no backward for it
        emb, opt = make(name)
        emb.load(table_file)
        before = emb.table.to_numpy(copy=True)
        ids = torch.arange(3) * 100 + rank  # rows of both shards
        out_rows = emb(ids if rank == 0 else ids[:0])
        if rank == 0:
            out_rows.sum().backward()
        opt.zero_grad()  # the step is skipped on every rank
        emb(ids).pow(2).sum().backward()
        errors = {}
        try:
            opt.step()
        except ss.SpeedswapError as exc:
            errors[type(exc).__name__] = str(exc)
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        emb.discard_step()  # on every rank, as the error says; then training goes on
        opt.zero_grad()
        train(emb, opt, seed, range(3), world, rank)
        with open(os.path.join(out, f"disagree.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors, "unchanged": unchanged,
                       "trained": not np.array_equal(emb.table.to_numpy(), before)}, f)
        name = "disagree"
    elif kind == "calls":    # at step 3 rank 1 skips optimizer.step() (its own GradScaler saw an inf)
        emb, opt = make(name)
        emb.load(table_file)
        errors = {}
        for step in range(STEPS):
            ids, targets = global_batch(seed, step)
            part = rank_slice(step, world, rank)
            rank_loss(emb, ids[part], targets[part], world).backward()
            if step != 3:
                opt.step()
            else:  # rank 0 steps; rank 1 goes on to its next forward: the ranks pair different calls
                try:
                    if rank == 0:
                        opt.step()
                    else:
                        emb(ids[part])
                except ss.SpeedswapError as exc:
                    errors[type(exc).__name__] = str(exc)
                emb.discard_step()  # on every rank, as the error says: step 3 is dropped
            opt.zero_grad()
        with open(os.path.join(out, f"calls.rank{rank}.json"), "w") as f:
            json.dump(errors, f)
        name = "calls"
    elif kind == "savecall":  # rank 0 saves while rank 1 trains, then both save
        emb, opt = make(name)
        emb.load(table_file)
        ckpt = os.path.join(out, "savecall-ckpt")
        errors = {}
        try:
            if rank == 0:
                emb.save(ckpt)
            else:
                train(emb, opt, seed, range(1), world, rank)
        except ss.SpeedswapError as exc:
            errors[type(exc).__name__] = str(exc)
        emb.discard_step()
        opt.zero_grad()
        half_saved = os.path.exists(ckpt) or os.path.exists(ckpt + ".partial")
        emb.save(ckpt)  # made on every rank, it works
        with open(os.path.join(out, f"savecall.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors, "half_saved": half_saved}, f)
        name = "savecall"
    elif kind == "oldleft":  # rank 0 cannot remove the earlier checkpoint once the new one is in place
        emb, opt = make(name)
        emb.load(table_file)
        ckpt = os.path.join(out, "oldleft-ckpt")
        emb.save(ckpt)
        train(emb, opt, seed, range(2), world, rank)
        saved = emb.table.to_numpy(copy=True)
        rmtree = shutil.rmtree

        def failing(path, *args, **kwargs):
            if os.fspath(path).endswith(".old"):
                raise PermissionError(13, "Permission denied (injected)", os.fspath(path))
            return rmtree(path, *args, **kwargs)

        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if rank == 0:
                shutil.rmtree = failing
            try:
                error = caught(lambda: emb.save(ckpt))
            except OSError as exc:  # rank 0's own failure, not a SpeedswapError
                error = {type(exc).__name__: str(exc)}
            finally:
                shutil.rmtree = rmtree
        train(emb, opt, seed, range(2, 4), world, rank)
        emb.load(ckpt)
        loaded = bool(np.array_equal(emb.table.to_numpy(), saved))
        emb.save(ckpt)  # the next save removes the leftover
        with open(os.path.join(out, f"oldleft.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "warnings": [str(w.message) for w in warned], "loaded": loaded,
                       "left": sorted(os.listdir(out)) if rank == 0 else []}, f)
        return
    elif kind == "paths":    # each rank passes its own path: the save must fail, not half-succeed
        emb, opt = make(name)
        emb.load(table_file)
        ckpt = os.path.join(out, "paths-ckpt")
        emb.save(ckpt)  # a good checkpoint, which the failed saves below must leave alone
        saved = emb.table.to_numpy(copy=True)
        train(emb, opt, seed, range(2), world, rank)
        errors = []
        for stale in (False, True):
            # A rank of its own path, holding a .partial an earlier crash left (stale) or not.
            mine = ckpt if rank == 0 else f"{ckpt}-rank{rank}-{stale}"
            if stale:
                os.makedirs(mine + ".partial")
            try:
                emb.save(mine)
            except ss.SpeedswapError as exc:
                errors.append({type(exc).__name__: str(exc)})
        emb.load(ckpt)
        with open(os.path.join(out, f"paths.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors, "kept": bool(np.array_equal(emb.table.to_numpy(), saved))}, f)
        return
    elif kind == "nopath":   # rank 1 passes None where rank 0 passes the path: to save(), then to load() (twice)
        emb, opt = make(name)
        emb.load(table_file)
        ckpt = os.path.join(out, "nopath-ckpt")
        emb.save(ckpt)  # a good checkpoint, which the failed save below must leave alone
        saved = emb.table.to_numpy(copy=True)
        train(emb, opt, seed, range(2), world, rank)
        trained = emb.table.to_numpy(copy=True)
        errors = [caught(lambda: emb.save(ckpt if rank == 0 else None)),
                  caught(lambda: emb.load(ckpt if rank == 0 else None)),
                  # Rank 1's load, refused before it could tell a .npy from a checkpoint, counts as the latter.
                  caught(lambda: emb.load(table_file if rank == 0 else None))]
        unchanged = bool(np.array_equal(emb.table.to_numpy(), trained))
        train(emb, opt, seed, range(2, 4), world, rank)  # the ranks' calls still pair up
        emb.load(ckpt)
        with open(os.path.join(out, f"nopath.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors, "unchanged": unchanged,
                       "kept": bool(np.array_equal(emb.table.to_numpy(), saved))}, f)
        return
    elif kind == "mixedsd":  # each rank restores its own state_dict() of another step, then of one step
        emb, opt = make(name)
        emb.load(table_file)
        saved = {}
        for step in range(5):
            train(emb, opt, seed, [step], world, rank)
            saved[step + 1] = copy.deepcopy({"emb": emb.state_dict(), "opt": opt.state_dict()})
        emb, opt = make(name)

        def restore(steps):
            emb.load_state_dict(saved[steps]["emb"])
            opt.load_state_dict(saved[steps]["opt"])
        restore(2 if rank == 0 else 5)  # rank 0's latest file is older than rank 1's
        before = emb.table.to_numpy(copy=True)
        error = caught(lambda: train(emb, opt, seed, [5], world, rank))
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        restore(5)
        train(emb, opt, seed, range(5, STEPS), world, rank)
        with open(os.path.join(out, f"mixedsd.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "unchanged": unchanged}, f)
        name = "mixedsd"
    elif kind == "differ":   # rank 1 builds its embedding (its options too) or optimizer unlike rank 0's
        results = {}
        for what, dim, lr, options in (("dim", DIM + rank, 0.05, {}),
                                       ("lr", DIM, 0.05 * (1 + rank), {}),
                                       ("padding", DIM, 0.05, dict(padding_idx=PAD) if rank else {}),
                                       ("dtype", DIM, 0.05, dict(dtype=torch.float64) if rank else {}),
                                       ("freq", DIM, 0.05, dict(scale_grad_by_freq=True) if rank else {})):
            built = []
            results[what] = caught(lambda: built.append(ss.ShardedOffloadedEmbedding(
                NUM_ROWS, dim, max_rows=GLOBAL_BATCH, backend="numpy", storage="pageable", **options)))
            results[f"{what} built"] = bool(built)
            if not built:
                continue
            emb, = built
            opt = torch.optim.SGD(emb.parameters(), lr=lr)
            emb.attach(opt)
            before = emb.table.to_numpy(copy=True)
            results[what] = caught(lambda: train(emb, opt, seed, range(1), world, rank))
            results[f"{what} unchanged"] = bool(np.array_equal(emb.table.to_numpy(), before))
        with open(os.path.join(out, f"differ.rank{rank}.json"), "w") as f:
            json.dump(results, f)
        return
    elif kind == "build":    # a constructor refused on rank 1 alone: every rank raises at once, then builds alike
        ckpt_dir, blocked = os.path.join(out, "build-mmap"), os.path.join(out, "build-blocked")
        if rank == 1:
            open(blocked, "w").close()  # a file where rank 1's mmap directory would go
        torch.distributed.barrier()
        torch.manual_seed(seed)  # on every rank alike, as DDP code does
        results = {}
        for what, options in (("cache_rows", dict(cache_rows=rank)),  # refused on rank 1 only
                              ("path", dict(storage="mmap", path=blocked if rank else ckpt_dir))):
            started = time.monotonic()
            results[what] = caught(lambda: make(name, **options))
            results[f"{what} seconds"] = time.monotonic() - started
        # Every rank drew from torch's generator as many times: DDP code seeded alike still draws alike.
        results["draw"] = torch.randint(0, 2 ** 62, ()).item()
        # Built again with good options on every rank (rank 0's mmap file of the failed build was removed).
        emb, opt = make(name, storage="mmap", path=ckpt_dir)
        emb.load(table_file)
        train(emb, opt, seed, range(STEPS), world, rank)
        with open(os.path.join(out, f"build.rank{rank}.json"), "w") as f:
            json.dump(results, f)
        name = "build"
    elif kind == "replaced":  # optimizer.load_state_dict() of an older state without emb.load()
        emb, opt = make(name)
        emb.load(table_file)
        ckpt = os.path.join(out, "replaced-ckpt")
        train(emb, opt, seed, range(3), world, rank)
        emb.save(ckpt)
        saved = copy.deepcopy(opt.state_dict())  # saved with the checkpoint, as a resume needs
        train(emb, opt, seed, range(3, 5), world, rank)
        before = emb.table.to_numpy(copy=True)
        errors = []
        if rank == 1:  # between steps, on rank 1 alone: its next forward is refused on every rank
            opt.load_state_dict(saved)
        errors.append(caught(lambda: train(emb, opt, seed, range(5, 6), world, rank)))
        emb.discard_step()
        opt.zero_grad()
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        emb.load(ckpt)  # on every rank: the tables now match rank 1's optimizer
        train(emb, opt, seed, range(3, 4), world, rank)
        ids, targets = global_batch(seed, 4)
        part = rank_slice(4, world, rank)
        rank_loss(emb, ids[part], targets[part], world).backward()
        if rank == 0:  # between the backward and the step, on rank 0 alone: the step is refused
            opt.load_state_dict(saved)
        errors.append(caught(opt.step))
        emb.discard_step()
        opt.zero_grad()
        opt.load_state_dict(saved)  # the resume done right, on every rank
        emb.load(ckpt)
        train(emb, opt, seed, range(3, STEPS), world, rank)
        with open(os.path.join(out, f"replaced.rank{rank}.json"), "w") as f:
            json.dump({"errors": errors, "unchanged": unchanged}, f)
        name = "replaced"
    elif kind == "exchange":  # exchange_gradients() refused on one rank: every rank hears it at once
        emb, opt = make(name)
        emb.load(table_file)
        before = emb.table.to_numpy(copy=True)
        done = os.path.join(out, "exchange.rank0.done")
        result = {}
        ids, targets = global_batch(seed, 0)
        part = rank_slice(0, world, rank)
        rank_loss(emb, ids[part], targets[part], world).backward()
        if rank == 1:
            opt.zero_grad()  # rank 1 alone drops the step: its exchange has no forward left
        result["no forward"] = caught(emb.exchange_gradients)
        if rank == 0:
            open(done, "w").close()
        else:  # handling its error, in no collective, until rank 0 has heard of it
            # Not a time rank 0 must hear within: rank 1 may reach its refusal seconds after rank 0
            # entered the exchange on a loaded machine. Heard while rank 1 waits here, in no collective,
            # or never (the bug): rank 0 would hear only at rank 1's next collective, after this wait.
            give_up = time.monotonic() + 30
            while not os.path.exists(done) and time.monotonic() < give_up:
                time.sleep(0.01)
            result["heard while waiting"] = os.path.exists(done)
        result["unchanged"] = bool(np.array_equal(emb.table.to_numpy(), before))
        emb.discard_step()  # on every rank: step 0 is dropped
        opt.zero_grad()
        ids, targets = global_batch(seed, 1)
        part = rank_slice(1, world, rank)
        rank_loss(emb, ids[part], targets[part], world).backward()
        emb.exchange_gradients()
        # Rank 1 exchanges twice; rank 0 goes on to the step, which must not step without rank 1.
        result["twice"] = caught(emb.exchange_gradients if rank == 1 else opt.step)
        opt.step()  # on every rank now: step 1 is taken once
        opt.zero_grad()
        ids, targets = global_batch(seed, 2)
        part = rank_slice(2, world, rank)
        loss = rank_loss(emb, ids[part], targets[part], world)
        loss.backward(retain_graph=True)
        emb.exchange_gradients()
        if rank == 0:
            loss.backward()  # after the exchange: its gradient would be lost
        result["late"] = caught(opt.step)
        emb.discard_step()  # on every rank: step 2 is dropped
        opt.zero_grad()
        train(emb, opt, seed, range(3, STEPS), world, rank)
        with open(os.path.join(out, f"exchange.rank{rank}.json"), "w") as f:
            json.dump(result, f)
        name = "exchange"
    elif kind == "reattach":  # rank 1 alone attaches its optimizer again, mid-training
        emb, opt = make(name)
        emb.load(table_file)
        ckpt = os.path.join(out, "reattach-ckpt")
        train(emb, opt, seed, range(3), world, rank)
        emb.save(ckpt)
        train(emb, opt, seed, range(3, 5), world, rank)
        before = emb.table.to_numpy(copy=True)
        if rank == 1:
            emb.attach(opt, restart=True)  # its Adam moments and step count restart; its peer's go on
        error = caught(lambda: train(emb, opt, seed, range(5, 6), world, rank))
        emb.discard_step()
        opt.zero_grad()
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        emb.load(ckpt)  # on every rank, as the error says: the optimizer states agree again
        train(emb, opt, seed, range(3, STEPS), world, rank)
        with open(os.path.join(out, f"reattach.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "unchanged": unchanged}, f)
        name = "reattach"
    elif kind == "infskip":  # a plain GradScaler finds infs in rank 1's owned rows only
        emb, opt = make(name)
        emb.load(table_file)
        before = emb.table.to_numpy(copy=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        ids, targets = global_batch(seed, 0)
        part = rank_slice(0, world, rank)
        ids, targets = torch.cat([ids[part], torch.tensor([NUM_ROWS - 1])]), targets[part]
        out_rows = emb(ids)
        loss = ((out_rows[:-1] - targets) ** 2).sum() * (world / GLOBAL_BATCH)
        if rank == 0:  # an overflow in the gradient of the last row, which rank 1 owns
            loss = loss + out_rows[-1].sum() * float("inf")
        scaler.scale(loss).backward()
        emb.exchange_gradients()
        error = caught(lambda: scaler.step(opt))  # rank 1's scaler skips; rank 0's steps
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        if rank == 1:  # its step skipped, it goes on to the next step, as a training loop does
            scaler.update()
            opt.zero_grad()
            error = caught(lambda: train(emb, opt, seed, range(1, 2), world, rank))
        emb.discard_step()  # on every rank, as the error says: step 0 is dropped
        opt.zero_grad()
        train(emb, opt, seed, range(1, STEPS), world, rank)
        with open(os.path.join(out, f"infskip.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "unchanged": unchanged}, f)
        name = "infskip"
    elif kind == "zerodiffer":  # after exchange_gradients() rank 0 zero_()s its gradient, rank 1 masks it by 0
        emb, opt = make(name, max_rows=2 * GLOBAL_BATCH)
        emb.load(table_file)
        ids, targets = global_batch(seed, 0)
        part = rank_slice(0, world, rank)
        rank_loss(emb, ids[part], targets[part], world).backward()
        emb.exchange_gradients()
        if rank == 0:  # step 0 is skipped (a GradScaler's inf), and each rank zeroes its own way
            opt.zero_grad(set_to_none=False)
        else:
            emb.weight.grad.mul_(0.0)
        before = emb.table.to_numpy(copy=True)
        # Rank 0 read its gradient as zero_grad()'s and dropped step 0 at this forward, rank 1 not.
        error = caught(lambda: train(emb, opt, seed, range(1, 2), world, rank))
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        emb.discard_step()  # on every rank, as the error says: steps 0 and 1 are dropped
        opt.zero_grad()
        train(emb, opt, seed, range(1, STEPS), world, rank)
        with open(os.path.join(out, f"zerodiffer.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "unchanged": unchanged}, f)
        name = "zerodiffer"
    elif kind == "twockpts":  # each rank loads another checkpoint of the same run (Adam: its step count)
        emb, opt = make(name)
        emb.load(table_file)
        ckpts = [os.path.join(out, f"twockpts-{step}") for step in (2, 4)]
        train(emb, opt, seed, range(2), world, rank)
        emb.save(ckpts[0])
        train(emb, opt, seed, range(2, 4), world, rank)
        emb.save(ckpts[1])
        before = emb.table.to_numpy(copy=True)
        error = caught(lambda: emb.load(ckpts[rank % 2]))
        unchanged = bool(np.array_equal(emb.table.to_numpy(), before))
        emb.load(ckpts[0])  # the same one on every rank: the resume done right
        train(emb, opt, seed, range(2, 4), world, rank)
        with open(os.path.join(out, f"twockpts.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "unchanged": unchanged,
                       "resumed": bool(np.array_equal(emb.table.to_numpy(), before))}, f)
        return
    elif kind == "mixedload":  # rank 0 loads a whole-table .npy, rank 1 a sharded checkpoint
        emb, opt = make(name)
        ckpt = os.path.join(out, "mixedload-ckpt")
        emb.save(ckpt)
        train(emb, opt, seed, range(1), world, rank)
        before = emb.table.to_numpy(copy=True)
        error = caught(lambda: emb.load(table_file if rank == 0 else ckpt))
        with open(os.path.join(out, f"mixedload.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "unchanged": bool(np.array_equal(emb.table.to_numpy(), before))}, f)
        return
    elif kind == "order":    # two tables built alike; rank 1 calls them in the other order
        first, opt = make(name)
        second = ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=GLOBAL_BATCH, backend="numpy",
                                              storage="pageable")
        second.attach(OPTIMIZERS[name][0](second.parameters(), **OPTIMIZERS[name][2]))
        ids = torch.tensor([0, NUM_ROWS - 1])  # a row of each rank's shard
        calls = (first, second) if rank == 0 else (second, first)
        rows = {}
        error = caught(lambda: rows.update((id(emb), emb(ids)) for emb in calls))
        with open(os.path.join(out, f"order.rank{rank}.json"), "w") as f:
            json.dump({"error": error, "looked_up": len(rows)}, f)
        return
    elif kind == "outsider":  # every rank builds on a group of rank 0 alone, rank 1 too
        group = torch.distributed.new_group([0])  # made by every rank, as torch requires
        error = caught(lambda: make(name, process_group=group))
        with open(os.path.join(out, f"outsider.rank{rank}.json"), "w") as f:
            json.dump(error, f)
        return
    elif kind == "midfail":  # rank 1 fails between a call's messages (memory, a read): see MIDWAY
        from unittest import mock
        emb, opt = make(name)
        emb.load(table_file)
        results = {}

        def fails_on_rank_1(what, call, injected):
            """``call()`` on every rank, ``injected`` (a patch) making it fail on rank 1: the errors to ``results``."""
            before = emb.table.to_numpy(copy=True)
            try:
                with injected if rank == 1 else contextlib.nullcontext():
                    call()
                error = {}
            except Exception as exc:  # rank 1's own error is no SpeedswapError
                error = {type(exc).__name__: str(exc)}
            result = {"error": error, "unchanged": bool(np.array_equal(emb.table.to_numpy(), before))}
            done = os.path.join(out, f"midfail-{what}.rank0.done")
            if rank == 0:
                open(done, "w").close()
            else:  # in no collective until rank 0 has heard: heard at once, or never (see "exchange")
                give_up = time.monotonic() + 30
                while not os.path.exists(done) and time.monotonic() < give_up:
                    time.sleep(0.01)
                result["heard while waiting"] = os.path.exists(done)
            results[what] = result

        new_empty = torch.Tensor.new_empty

        def ids_buffer_fails(tensor, *args, **kwargs):
            """``Tensor.new_empty``, out of memory for int64 tensors: the ids other ranks ask for."""
            if tensor.dtype == torch.int64:
                raise MemoryError("injected")
            return new_empty(tensor, *args, **kwargs)

        for step in range(STEPS):
            ids, targets = global_batch(seed, step)
            part = rank_slice(step, world, rank)
            if step == MIDWAY["forward"]:  # reading the rows its peer asked for: the retry is the step's forward
                fails_on_rank_1("forward", lambda: rank_loss(emb, ids[part], targets[part], world),
                                mock.patch.object(emb, "_gather_owned", side_effect=MemoryError("injected")))
            if step == MIDWAY["eval"]:  # an eval forward, then again: the rows of the table trained so far
                with torch.no_grad():
                    fails_on_rank_1("eval", lambda: emb(ids[part]), mock.patch.object(
                        emb.table, "gather_validated", side_effect=MemoryError("injected")))
                    np.save(os.path.join(out, f"midfail-eval.rank{rank}.npy"), emb(ids[part]).numpy())
            if step == MIDWAY["eval ids"]:  # the memory the ids its peer asks for arrive in
                with torch.no_grad():
                    fails_on_rank_1("eval ids", lambda: emb(ids[part]),
                                    mock.patch.object(torch.Tensor, "new_empty", ids_buffer_fails))
            if step == MIDWAY["forward ids"]:  # the same in a training forward, whose retry is the step's forward
                fails_on_rank_1("forward ids", lambda: rank_loss(emb, ids[part], targets[part], world),
                                mock.patch.object(torch.Tensor, "new_empty", ids_buffer_fails))
            if step == MIDWAY["eval output"]:  # making an eval forward's output, then again
                # Its ids each there twice: no other tensor of the forward is as long as its output.
                twice = torch.cat([ids[part], ids[part]])
                output = MemoryFails(lambda t: t.is_floating_point() and t.numel() == twice.numel() * DIM)
                with torch.no_grad():
                    fails_on_rank_1("eval output", lambda: emb(twice), output)
                    np.save(os.path.join(out, f"midfail-eval output.rank{rank}.npy"), emb(twice).numpy())
            rank_loss(emb, ids[part], targets[part], world).backward()
            if step == MIDWAY["step"]:  # grouping its gradients by owner, before the step's first message
                fails_on_rank_1("step", opt.step, mock.patch("torch.argsort", side_effect=RuntimeError("injected")))
            if step == MIDWAY["exchange"]:  # the memory its peer's gradients arrive in
                fails_on_rank_1("exchange", emb.exchange_gradients, mock.patch.object(
                    torch.Tensor, "new_empty", side_effect=MemoryError("injected")))
                emb.exchange_gradients()
            opt.step()
            opt.zero_grad()
        with open(os.path.join(out, f"midfail.rank{rank}.json"), "w") as f:
            json.dump(results, f)
        name = "midfail"
    elif kind == "lastfail":  # rank 1 fails after a step's (or exchange's) last message: see AFTER_LAST
        from unittest import mock
        emb, opt = make(name)
        emb.load(table_file)
        results = {}

        def only_on_floats(method):
            """A patch of ``torch.Tensor.method`` that raises for floating tensors: the gradients, not the ids."""
            original = getattr(torch.Tensor, method)

            def fails(tensor, *args, **kwargs):
                if tensor.is_floating_point():
                    raise RuntimeError("injected")
                return original(tensor, *args, **kwargs)
            return mock.patch.object(torch.Tensor, method, fails)

        def retried(what, call, injected):
            """``call()`` on every rank, ``injected`` making it fail on rank 1; a rank that raised calls it again."""
            error = {}
            try:
                with injected if rank == 1 else contextlib.nullcontext():
                    return call()
            except Exception as exc:
                error = {type(exc).__name__: str(exc)}
                return call()  # alone, unless every rank raised
            finally:
                results[what] = error

        failures = {  # the call, the patch making it fail on rank 1 after (or, now, before) its last message
            "gather": (opt.step, mock.patch.object(emb._state, "gather", side_effect=MemoryError("injected"))),
            "sum": (opt.step, only_on_floats("index_add_")),  # the owner summing its peers' gradients
            "optimizer": (opt.step, mock.patch("torch.optim.adam.adam", side_effect=MemoryError("injected"))),
            "exchange sum": (emb.exchange_gradients, only_on_floats("index_add_")),
            "narrow": (opt.step, mock.patch("speedswap.train.sharded.NarrowedStep",
                                            side_effect=MemoryError("injected"))),
            # Preparing the write-back of the rows' optimizer state (staging memory on a cuda table),
            # its last table's, once the others' are prepared: the step ran and nothing is written yet.
            "state write": (opt.step, mock.patch.object(list(emb._state.tables.values())[-1], "prepare_scatter",
                                                        side_effect=MemoryError("injected"))),
        }
        for step in range(STEPS):
            ids, targets = global_batch(seed, step)
            part = rank_slice(step, world, rank)
            loss = lambda: rank_loss(emb, ids[part], targets[part], world)  # noqa: E731
            if step == AFTER_LAST["lookup"]:  # the forward's output, from the rows its messages brought
                retried("lookup", loss, mock.patch("torch.nn.functional.embedding",
                                                   side_effect=MemoryError("injected"))).backward()
            else:
                loss().backward()
            stepped = False
            for what, (call, injected) in failures.items():
                if step == AFTER_LAST[what]:
                    retried(what, call, injected)
                    stepped = call == opt.step
            if not stepped:  # after exchange_gradients() too
                opt.step()
            opt.zero_grad()
        with open(os.path.join(out, f"lastfail.rank{rank}.json"), "w") as f:
            json.dump(results, f)
        name = "lastfail"
    elif kind == "crash":    # rank 1 does not catch its error: every rank must exit, not hang
        emb, opt = make(name)
        ids = torch.arange(4) + (NUM_ROWS if rank == 1 else 0)
        with open(os.path.join(out, f"crash.rank{rank}.started"), "w") as f:
            f.write(repr(time.time()))  # the test times the end of every rank from here
        emb(ids)
        raise AssertionError("unreachable: the forward above raises on every rank")
    np.savez(os.path.join(out, f"{name}.rank{rank}.npz"), **shard_arrays(emb))


def main(argv):
    rank, world, rendezvous, seed = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    out, scenarios = argv[4], argv[5:]
    torch.distributed.init_process_group(
        "gloo", init_method=rendezvous, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60))
    try:
        for scenario in scenarios:
            run_scenario(scenario, seed, world, rank, out)
    finally:
        torch.distributed.destroy_process_group()
    # The results are written. Skip the interpreter's teardown: in CI under load a rank
    # aborted there ("terminate called without an active exception", after
    # destroy_process_group), which says nothing about what these tests check. Not yet
    # understood; noted for the next session.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
