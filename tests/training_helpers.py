"""Shared pieces of the training tests: Zipf batches, a skip-gram loss, and the runners.

Each runner trains one table for the same batches and returns the final
table and per-row optimizer state as numpy arrays, so tests compare
offloaded training against in-memory references.
"""

import contextlib
import copy
import os
import sys
import tempfile
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

import speedswap as ss

NUM_ROWS, DIM, BATCH, NEGS = 400, 8, 24, 3
CAPACITY = BATCH * (1 + NEGS)


def zipf_batches(rng, steps, device, num_rows=NUM_ROWS):
    """``steps`` batches of (pos (BATCH,), neg (BATCH, NEGS), context (BATCH, DIM)).

    Ids follow p(r) ~ 1/(r+1): the head rows repeat within almost every batch,
    and tail rows are often never touched.
    """
    weights = 1.0 / np.arange(1, num_rows + 1)
    perm = rng.permutation(num_rows)  # popular rows are scattered over the table
    p = weights / weights.sum()
    batches = []
    for _ in range(steps):
        ids = perm[rng.choice(num_rows, size=BATCH * (1 + NEGS), p=p)]
        pos = torch.from_numpy(ids[:BATCH]).to(device)
        neg = torch.from_numpy(ids[BATCH:].reshape(BATCH, NEGS)).to(device)
        ctx = torch.from_numpy(rng.standard_normal((BATCH, DIM), dtype=np.float32)).to(device)
        batches.append((pos, neg, ctx))
    return batches


def skipgram_loss(pos_rows, neg_rows, ctx):
    """Negative-sampling loss of rows against fixed random context vectors."""
    pos_score = (pos_rows * ctx).sum(-1)
    neg_score = (neg_rows * ctx.unsqueeze(1)).sum(-1)
    return -(F.logsigmoid(pos_score).sum() + F.logsigmoid(-neg_score).sum())


def row_state(optimizer, param):
    """The optimizer's state tensors shaped like ``param``, as numpy arrays."""
    state = optimizer.state.get(param, {})
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == param.shape}


def run_switchers(make_opt, table0, batches, backend, sparse=False, cache_rows=0, prefetch=False,
                  replay_at=None, optimizer_switcher=True, restore_optimizer=True):
    """SpeedTorch-style training: placeholders, camelCase methods, host tables.

    Args:
        cache_rows: the switchers' device cache of hot rows.
        prefetch: call ``prefetchNextBatch`` with the next step's ids between
            the two switchers' ``beforeForwardPass`` (so some of them are in the
            working set already).
        replay_at: as in :func:`run_offloaded`, through the switchers' ``save``
            and ``load`` (and the optimizer's state_dict).
        restore_optimizer: as in :func:`run_offloaded`.
        optimizer_switcher: build an OptimizerFactory; without it the
            ModelFactory trains alone (plain SGD keeps no per-row state).
    """
    device = ss.get_backend(backend).device
    model = torch.nn.ModuleDict({"u_embeddings": torch.nn.Embedding(CAPACITY, DIM, sparse=sparse)})
    model.to(device)
    emb = model["u_embeddings"]
    opt = make_opt(model.parameters())
    u_switch = ss.ModelFactory(emb, total_classes=len(table0), embed_dimension=DIM,
                               CPUPinn=True, backend=backend, cache_rows=cache_rows)
    u_switch.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    switches = [u_switch]
    if optimizer_switcher:
        opt_switch = ss.OptimizerFactory(opt, len(table0), DIM, model, "u_embeddings",
                                         CPUPinn=True, backend=backend, cache_rows=cache_rows)
        opt_switch.optInit()
        switches.append(opt_switch)
    pos_in, neg_in = u_switch.variableTransformer(BATCH, 1, NEGS)
    with tempfile.TemporaryDirectory() as tmp:
        step, saved = 0, None
        while step < len(batches):
            if step == replay_at and saved is None:
                for k, switch in enumerate(switches):
                    switch.saveCupy(os.path.join(tmp, f"switch{k}" + (".npy" if k == 0 else "")))
                saved = (step, copy.deepcopy(opt.state_dict()))
            elif replay_at is not None and saved is not None and step == saved[0] + 10:
                for k, switch in enumerate(switches):
                    switch.loadCupy(os.path.join(tmp, f"switch{k}" + (".npy" if k == 0 else "")))
                if restore_optimizer:
                    opt.load_state_dict(saved[1])
                step, replay_at = saved[0], None
            pos, neg, ctx = batches[step]
            u_switch.beforeForwardPass(pos, neg)
            if prefetch and step + 1 < len(batches):
                u_switch.prefetchNextBatch(*batches[step + 1][:2])
            for switch in switches[1:]:
                switch.beforeForwardPass(pos, neg)
            # SpeedTorch code feeds the placeholders (numpy, converted every step), now filled
            # with de-duplicated slots.
            loss = skipgram_loss(emb(torch.from_numpy(pos_in).to(device)).squeeze(1),
                                 emb(torch.from_numpy(neg_in).to(device)), ctx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            for switch in switches:
                switch.afterOptimizerStep(pos, neg)
            step += 1
    table = u_switch.getNumpyVersion()  # cached rows and their state are written back first
    state = ({k: t.to_numpy(copy=True) for k, t in opt_switch.state.tables.items()}
             if optimizer_switcher else {})
    return table, state


def run_offloaded(make_opt, table0, batches, backend, cache_rows=0, prefetch=False,
                  replay_at=None, restore_optimizer=True):
    """OffloadedEmbedding training: two forward calls per step share one working set.

    Args:
        cache_rows: the embedding's device cache of hot rows.
        prefetch: call ``emb.prefetch`` with the next step's ids between the
            step's two forwards (so some of them are in the working set already).
        replay_at: a step at which to save a checkpoint, train 10 more steps,
            then load the checkpoint (and the optimizer's state_dict) and train
            those steps again: the result must not change.
        restore_optimizer: load the optimizer's state_dict saved with the
            checkpoint; without it the checkpoint alone must restore the
            optimizer's scalar state (Adam's step count).
    """
    emb = ss.OffloadedEmbedding(len(table0), DIM, max_rows=CAPACITY, storage="pinned",
                                backend=backend, cache_rows=cache_rows,
                                dtype=torch.from_numpy(table0).dtype)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make_opt(emb.parameters())
    emb.attach(opt)
    with tempfile.TemporaryDirectory() as tmp:
        step, saved = 0, None
        while step < len(batches):
            if step == replay_at and saved is None:
                emb.save(os.path.join(tmp, "ckpt"))
                saved = (step, copy.deepcopy(opt.state_dict()))
            elif replay_at is not None and saved is not None and step == saved[0] + 10:
                emb.load(os.path.join(tmp, "ckpt"))
                if restore_optimizer:
                    opt.load_state_dict(saved[1])
                step, replay_at = saved[0], None
            pos, neg, ctx = batches[step]
            pos_rows = emb(pos)
            if prefetch and step + 1 < len(batches):
                nxt_pos, nxt_neg, _ = batches[step + 1]
                emb.prefetch(torch.cat([nxt_pos, nxt_neg.reshape(-1)]))
            skipgram_loss(pos_rows, emb(neg), ctx).backward()
            opt.step()
            opt.zero_grad()
            step += 1
    emb.flush()
    state = {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()}
    return emb.table.to_numpy(copy=True), state


def run_in_memory(make_opt, table0, batches, device, sparse=False, initial_state=None):
    """The whole table as one in-memory parameter.

    With ``initial_state`` given, the reference is lazy: after each step every
    row the batch did not touch gets its parameter and per-row state back as
    they were before the step (``initial_state(name, group)`` is the value a row
    holds before torch first creates the state). That is "the same torch
    optimizer applied to the touched rows only", computed independently of
    speedswap's working set.
    """
    weight = torch.nn.Parameter(torch.from_numpy(table0.copy()).to(device))
    opt = make_opt([weight])
    group = opt.param_groups[0]
    for pos, neg, ctx in batches:
        before = weight.detach().clone()
        state_before = {k: v.clone() for k, v in opt.state.get(weight, {}).items()
                        if isinstance(v, torch.Tensor) and v.shape == weight.shape}
        loss = skipgram_loss(F.embedding(pos, weight, sparse=sparse),
                             F.embedding(neg, weight, sparse=sparse), ctx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if initial_state is None:
            continue
        untouched = torch.ones(len(table0), dtype=torch.bool, device=device)
        untouched[torch.cat([pos, neg.reshape(-1)])] = False
        with torch.no_grad():
            weight[untouched] = before[untouched]
            for name, value in opt.state[weight].items():
                if isinstance(value, torch.Tensor) and value.shape == weight.shape:
                    value[untouched] = (state_before[name][untouched] if name in state_before
                                        else initial_state(name, group))
    return weight.detach().cpu().numpy(), row_state(opt, weight)


def refused_save_paths(tmp_path):
    """``[(path, error)]`` a save refuses only once it is under way: a missing directory (each
    format), an HDF5 file of someone else's datasets, a directory that is no checkpoint, and a
    checkpoint directory whose ``CURRENT`` was changed by hand."""
    theirs = ss.HostTable.from_numpy(np.ones((3, 2), dtype=np.float32), storage="pageable", backend="numpy")
    theirs.save(tmp_path / "data.h5", dataset="theirs")
    theirs.close()
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "CURRENT").write_text("v000009\n")
    return [*((tmp_path / "missing" / name, ss.PathError) for name in ("emb.h5", "emb", "emb.npy")),
            (tmp_path / "data.h5", ss.PathError), (tmp_path / "photos", ss.PathError),
            (tmp_path / "edited", ss.FileFormatError)]


@contextlib.contextmanager
def failing_after_its_update(optimizer, message="injected failure inside the optimizer"):
    """Make ``optimizer``'s next steps raise ``RuntimeError(message)`` after its update ran.

    The update function torch's ``step()`` calls (``torch.optim.adam.adam``,
    ``torch.optim.sgd.sgd``, ...) runs whole, the step counted (Adam's
    ``step``) and the rows and state updated in place, then raises: a failure
    inside the optimizer, which skips the step's post-hooks. Patched in its
    module rather than by overriding ``step`` in a subclass, whose
    ``super().step()`` runs the step hooks itself once torch has wrapped the
    parent class's ``step`` (it does when any instance of it is made).
    """
    module = sys.modules[type(optimizer).__module__]
    name = type(optimizer).__name__.lower()
    update = getattr(module, name)

    def update_then_fail(*args, **kwargs):
        update(*args, **kwargs)
        raise RuntimeError(message)
    with mock.patch.object(module, name, update_then_fail):
        yield


def step_failing_once(optimizer, dense):
    """``optimizer.step()`` raising after its update (:func:`failing_after_its_update`), then ``dense`` put back.

    In memory nothing undoes a step that raised, and speedswap undoes its own
    parameters' only: the test puts the ``dense`` parameters and their
    optimizer state back by hand, so that the caller's retry of the step
    trains exactly as a step that never failed.
    """
    saved = [(p.detach().clone(), copy.deepcopy(optimizer.state.get(p))) for p in dense]
    try:
        with failing_after_its_update(optimizer):
            optimizer.step()
    except RuntimeError as exc:
        assert "injected failure" in str(exc), exc
    else:
        raise AssertionError("optimizer.step() did not raise")
    with torch.no_grad():
        for p, (values, state) in zip(dense, saved):
            p.copy_(values)
            if state is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = state


class EagerStateAdagrad(torch.optim.Adagrad):
    """``torch.optim.Adagrad`` as torch 2.6-2.11 steps it: only on the state its constructor made.

    torch 2.12 makes an Adagrad's state at a step too; before, a step at a
    parameter whose state was dropped (a restart, a checkpoint saved before the
    first step) raised ``KeyError: 'sum'``. The CI's torch is newer: this is
    the older ones' step, for the tests of the paths that drop the state.
    """

    def _init_group(self, group, *args):
        for p in group["params"]:
            if p.grad is not None and "sum" not in self.state[p]:
                raise KeyError("sum")
        return super()._init_group(group, *args)
