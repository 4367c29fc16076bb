"""A checkpoint restores the optimizer's scalar state for the table (Adam's step count) with its rows.

The flow every test runs: an offloaded table trained ``SAVED_AT`` steps on
Zipf ids, a checkpoint, more steps (or a new process: a new embedding and a
new optimizer), the checkpoint loaded, then the steps after ``SAVED_AT``
again. The reference is the in-memory, touched-rows-only run of the same
optimizer whose weight and optimizer state (step count included) are put back
at ``SAVED_AT``, which trains exactly as the run straight through the batches
(:func:`training_helpers.run_in_memory`). The per-row state from the
checkpoint with the optimizer's own step count (a fresh optimizer's 0, or one
10 steps ahead) used to train on silently: Adam's bias correction, NAdam's
``mu_product``, Adagrad's ``lr_decay`` and ASGD's averaging follow them.
"""

import io
import json

import numpy as np
import pytest
import torch

import speedswap as ss
from speedswap.train.checkpoint import save_tables
from speedswap.train.module_state import SCALAR_STATE
from test_optimizer_equivalence import OPTIMIZERS, assert_same, torch_initial
from training_helpers import (CAPACITY, DIM, NUM_ROWS, run_in_memory, run_offloaded, run_switchers,
                              skipgram_loss, zipf_batches)

SAVED_AT, STEPS, DETOUR = 30, 50, 10


def _setup(rng, backend):
    """A random table, the run's ``STEPS`` batches, and ``DETOUR`` other batches trained before the load."""
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, STEPS + DETOUR, device)
    return table0, batches[:STEPS], batches[STEPS:], device


def _reference(name, table0, batches, device):
    return run_in_memory(OPTIMIZERS[name], table0, batches, device, sparse=name == "sparse_adam",
                         initial_state=torch_initial)


def _offloaded(table0, name, backend):
    emb = ss.OffloadedEmbedding(len(table0), DIM, max_rows=CAPACITY, storage="pinned", backend=backend)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = OPTIMIZERS[name](emb.parameters())
    emb.attach(opt)
    return emb, opt


def _train(emb, opt, batches):
    for pos, neg, ctx in batches:
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        opt.step()
        opt.zero_grad()


def _result(emb):
    emb.flush()
    return emb.table.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()}


def _serialised(obj):
    """``obj`` through torch.save and torch.load(weights_only=True), as a checkpoint file takes it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("runner", ["embedding", "switchers"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_load_without_the_optimizer_state_dict_restores_the_step_count(name, runner, rng, backend):
    """Save at step 30, 10 steps on, load (no optimizer.load_state_dict), the steps from 30 again."""
    table0, batches, _, device = _setup(rng, backend)
    run = run_offloaded if runner == "embedding" else run_switchers
    options = {"sparse": name == "sparse_adam"} if runner == "switchers" else {}
    actual = run(OPTIMIZERS[name], table0, batches, backend, replay_at=SAVED_AT,
                 restore_optimizer=False, **options)
    assert_same(actual, _reference(name, table0, batches, device))


@pytest.mark.parametrize("name,path", [*((n, "ckpt.h5") for n in sorted(OPTIMIZERS)), ("adam", "ckpt"),
                                       ("nadam", "ckpt"), ("asgd", "ckpt")])
def test_a_new_embedding_and_optimizer_resume_from_the_checkpoint_alone(name, path, rng, backend, tmp_path):
    table0, batches, _, device = _setup(rng, backend)
    emb, opt = _offloaded(table0, name, backend)
    _train(emb, opt, batches[:SAVED_AT])
    emb.save(tmp_path / path)
    emb.close()
    resumed, new_opt = _offloaded(rng.standard_normal(table0.shape, dtype=np.float32), name, backend)
    resumed.load(tmp_path / path)
    _train(resumed, new_opt, batches[SAVED_AT:])
    assert_same(_result(resumed), _reference(name, table0, batches, device))


@pytest.mark.parametrize("fresh", [False, True], ids=["same_run", "new_process"])
@pytest.mark.parametrize("optimizer_state", [None, "before", "after"])
@pytest.mark.parametrize("how", ["file", "state_dict"])
@pytest.mark.parametrize("name", ["adam", "nadam", "asgd"])
def test_the_optimizer_state_dict_restored_too_before_or_after_stays_exact(name, how, optimizer_state, fresh,
                                                                          rng, backend, tmp_path):
    """emb.load / model.load_state_dict, with opt.load_state_dict before, after, or not at all."""
    table0, batches, detour, device = _setup(rng, backend)
    emb, opt = _offloaded(table0, name, backend)
    _train(emb, opt, batches[:SAVED_AT])
    saved_opt = _serialised(opt.state_dict())
    if how == "file":
        emb.save(tmp_path / "ckpt.h5")
    else:
        saved_model = _serialised(emb.state_dict())
    if fresh:
        emb.close()
        emb, opt = _offloaded(rng.standard_normal(table0.shape, dtype=np.float32), name, backend)
    else:
        _train(emb, opt, detour)
    if optimizer_state == "before":
        opt.load_state_dict(saved_opt)
    if how == "file":
        emb.load(tmp_path / "ckpt.h5")
    else:
        emb.load_state_dict(saved_model)
    if optimizer_state == "after":
        opt.load_state_dict(saved_opt)
    _train(emb, opt, batches[SAVED_AT:])
    assert_same(_result(emb), _reference(name, table0, batches, device))
    assert int(opt.state[emb.weight]["step"]) == STEPS


def _save_as_older_speedswap(emb, path, how):
    """What ``emb.save`` / ``emb.state_dict()`` wrote before checkpoints recorded the step count."""
    if how == "file":
        save_tables(path, emb._tables(), {"optimizer": type(emb._state.optimizer).__name__})
        return None
    state = _serialised(emb.state_dict())
    del state["_extra_state"][SCALAR_STATE]
    return state


def _load(emb, path, state):
    if state is None:
        emb.load(path)
    else:
        emb.load_state_dict(state)


@pytest.mark.parametrize("how", ["file", "state_dict"])
def test_an_older_checkpoint_drops_a_step_count_of_another_point_and_the_next_step_asks_for_it(
        how, rng, backend, tmp_path):
    """Loaded into an Adam 10 steps further on, it trained on silently with the count of step 40."""
    table0, batches, detour, device = _setup(rng, backend)
    emb, opt = _offloaded(table0, "adam", backend)
    _train(emb, opt, batches[:SAVED_AT])
    saved_opt = _serialised(opt.state_dict())
    older = _save_as_older_speedswap(emb, tmp_path / "ckpt.h5", how)
    _train(emb, opt, detour)
    _load(emb, tmp_path / "ckpt.h5", older)
    rows = _result(emb)
    with pytest.raises(ss.StateError, match=r"older speedswap.*optimizer\.load_state_dict"):
        _train(emb, opt, batches[SAVED_AT:SAVED_AT + 1])
    emb.discard_step()
    assert_same(_result(emb), rows)  # the refused step changed nothing
    opt.load_state_dict(saved_opt)  # as the error says
    _train(emb, opt, batches[SAVED_AT:])
    assert_same(_result(emb), _reference("adam", table0, batches, device))


@pytest.mark.parametrize("name,optimizer_state_first", [("adam", True), ("sgd_momentum", False)])
def test_an_older_checkpoint_keeps_a_step_count_that_goes_with_it(name, optimizer_state_first, rng, backend,
                                                                 tmp_path):
    """The optimizer's state_dict saved with it, loaded just before; or SGD, which keeps no count."""
    table0, batches, detour, device = _setup(rng, backend)
    emb, opt = _offloaded(table0, name, backend)
    _train(emb, opt, batches[:SAVED_AT])
    saved_opt = _serialised(opt.state_dict())
    _save_as_older_speedswap(emb, tmp_path / "ckpt.h5", "file")
    _train(emb, opt, detour)
    if optimizer_state_first:
        opt.load_state_dict(saved_opt)
    emb.load(tmp_path / "ckpt.h5")
    _train(emb, opt, batches[SAVED_AT:])
    assert_same(_result(emb), _reference(name, table0, batches, device))


@pytest.mark.parametrize("how", ["dir", "state_dict"])
def test_a_damaged_record_of_the_step_count_is_refused_before_anything_changes(how, rng, backend, tmp_path):
    table0, batches, detour, _ = _setup(rng, backend)
    emb, opt = _offloaded(table0, "adam", backend)
    _train(emb, opt, batches[:SAVED_AT])
    if how == "dir":
        emb.save(tmp_path / "ckpt")
        manifest = next((tmp_path / "ckpt").glob("v*/checkpoint.json"))
        content = json.loads(manifest.read_text())
        content["attrs"]["optimizer_scalar_state"] = json.dumps({"stepped": True, "scalars": {"step": "30"}})
        manifest.write_text(json.dumps(content))
    else:
        state = _serialised(emb.state_dict())
        state["_extra_state"][SCALAR_STATE] = {"stepped": True, "scalars": {"step": ["30", "float32"]}}
    _train(emb, opt, detour)
    rows, step = _result(emb), int(opt.state[emb.weight]["step"])
    with pytest.raises(ss.FileFormatError, match="scalar state"):
        _load(emb, tmp_path / "ckpt", None if how == "dir" else state)
    assert_same(_result(emb), rows)
    assert int(opt.state[emb.weight]["step"]) == step == SAVED_AT + DETOUR


@pytest.mark.parametrize("name", ["adam", "nadam", "asgd"])
def test_a_sharded_state_dict_restores_the_step_count(name, rng, backend):
    """ShardedOffloadedEmbedding's state_dict() (one rank, no process group): saved at 30, 10 steps on, loaded
    without optimizer.load_state_dict, the steps from 30 again."""
    table0, batches, detour, device = _setup(rng, backend)
    emb = ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, backend=backend)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = OPTIMIZERS[name](emb.parameters())
    emb.attach(opt)
    _train(emb, opt, batches[:SAVED_AT])
    saved = _serialised(emb.state_dict())
    _train(emb, opt, detour)
    emb.load_state_dict(saved)
    _train(emb, opt, batches[SAVED_AT:])
    actual = emb.table.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()}
    assert_same(actual, _reference(name, table0, batches, device))
    assert int(opt.state[emb.weight]["step"]) == STEPS
