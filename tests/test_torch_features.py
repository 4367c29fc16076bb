"""torch features a training loop combines with an offloaded embedding: each trains as in memory, or raises.

Activation checkpointing, ``torch.compile``, ``torch.autocast`` with a
``GradScaler``, ``DistributedDataParallel``, and what user code sees of the
zero-gradient mark. Each test trains an :class:`~speedswap.OffloadedEmbedding`
beside an in-memory reference on the same random rows and Zipf ids (the
references of ``test_training_flows``: a lazy ``nn.Parameter`` table, or
``SparseAdam`` on a sparse gradient) and compares the two to float32 rounding.
"""

import concurrent.futures
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as activation

import speedswap as ss
from rendezvous import rendezvous_url
from test_training_flows import (ROWS, STEPS, adam_against_sparse_adam, assert_equal_to_reference,
                                 assert_trained_as_sparse_adam, both_sides, make_lazy, pair, step_both, train_step,
                                 zipf_ids)
from training_helpers import CAPACITY, DIM, NUM_ROWS, run_in_memory, run_switchers, skipgram_loss, zipf_batches

# dynamo's limit on recompiles, and its switch to raise at the limit: torch 2.6 names them
# cache_size_limit and fail_on_cache_limit_hit (2.13 keeps those as aliases of these).
_DYNAMO = torch._dynamo.config
RECOMPILE_LIMIT = "recompile_limit" if hasattr(_DYNAMO, "recompile_limit") else "cache_size_limit"
FAIL_AT_RECOMPILE_LIMIT = ("fail_on_recompile_limit_hit" if hasattr(_DYNAMO, "fail_on_recompile_limit_hit")
                           else "fail_on_cache_limit_hit")


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("flow", ["plain", "skipped_then_zero_grad_after_the_forward", "accumulated"])
def test_activation_checkpointing_trains_as_in_memory(backend, rng, cache_rows, reentrant, flow):
    """``torch.utils.checkpoint.checkpoint`` around the lookup and a layer after it: the backward
    runs the forward again to recompute what it did not keep (``use_reentrant=True`` runs it first
    under ``no_grad()``, then with gradients inside the backward; its block gets a scale that
    requires a gradient, without which torch computes no gradient through it, in memory too).

    In the loop order forward, ``zero_grad()``, backward, with steps skipped after their backward
    (a loss that was not finite), the recomputed forward, run inside the backward, took the
    zeroed gradient for a step ``zero_grad()`` dropped before this forward, and dropped the step's
    rows with it: the backward raised ``StateError`` ("backward through an embedding forward whose
    optimizer step has already run") where in memory the step trains the new forward's rows.
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows)
    table0 = ref.detach().clone()
    batches = zipf_ids(rng, 2 * STEPS)
    skipped = np.zeros(STEPS, dtype=bool)
    if flow == "skipped_then_zero_grad_after_the_forward":
        skipped = rng.random(STEPS) < 0.3
        skipped[rng.integers(STEPS - 1)] = True  # one at least, the case under test
        skipped[-1] = False  # the last step runs: a skipped one holds its rows until the next forward
    for step, skip in enumerate(skipped):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            def block(ids, scale):
                return torch.tanh(lookup(ids.to(to)).cpu()).sum(1) * scale
            parts = [batches[2 * step]] + ([batches[2 * step + 1]] if flow == "accumulated" else [])
            for ids, target in parts:
                out = activation.checkpoint(block, ids, torch.ones(1, requires_grad=True), use_reentrant=reentrant)
                if flow == "skipped_then_zero_grad_after_the_forward":
                    optimizer.zero_grad()
                ((out - target) ** 2).sum().backward()
            if not skip:
                optimizer.step()
                if flow != "skipped_then_zero_grad_after_the_forward":
                    optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)
    assert not torch.equal(ref, table0)  # the rows trained through the recomputed forward


def _on_a_thread_of_its_own(fn):
    """Run ``fn()`` on another thread, as a GPU's autograd engine runs a CUDA backward; re-raise what it raised."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_prefetch_after_a_backward_that_recomputed_the_lookup_on_another_thread_trains_as_in_memory(
        backend, rng, reentrant):
    """A GPU's autograd engine runs a CUDA backward, activation checkpointing's recompute of the
    lookup with it, on a thread of its own (one per device) while the thread that called
    ``backward()`` waits. The recompute's fetch made that thread the cache's training thread, so
    the training thread's ``prefetch`` of the next batch after the backward raised ``StateError``
    ("prefetch was called on another thread"). Here the backward runs on another thread on every
    backend, as it does there; each step prefetches the next batch and trains as SparseAdam in memory.
    """
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows=40)
    batches = zipf_ids(rng, STEPS + 1)
    for step in range(STEPS):
        ids, target = batches[step]
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            def block(ids, scale):
                return torch.tanh(lookup(ids.to(to)).cpu()).sum(1) * scale
            out = activation.checkpoint(block, ids, torch.ones(1, requires_grad=True), use_reentrant=reentrant)
            _on_a_thread_of_its_own(((out - target) ** 2).sum().backward)
            if lookup is emb:
                emb.prefetch(batches[step + 1][0])
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)
    assert emb.stats()["total"]["prefetched_rows"] > 0  # the prefetches brought rows


def test_a_thread_that_takes_over_with_reentrant_checkpointed_lookups_may_prefetch_after_its_steps(backend, rng):
    """A thread that takes the training over and looks its rows up only through reentrant activation
    checkpointing (its first forward under ``no_grad()``, the training lookup in the recompute,
    inside the backward) never fetched outside a backward, so it was never the training thread:
    its prefetches between steps, after ``optimizer.step()``, raised ``StateError`` ("prefetch was
    called on another thread") at every step. A step's end makes its thread the training one."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows=40)
    batches = zipf_ids(rng, 2 * STEPS + 1)
    prefetched = []

    def train(steps, checkpointed):
        for step in steps:
            ids, target = batches[step]
            for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
                def block(ids, scale):
                    return torch.tanh(lookup(ids.to(to)).cpu()).sum(1) * scale
                scale = torch.ones(1, requires_grad=True)
                out = (activation.checkpoint(block, ids, scale, use_reentrant=True) if checkpointed
                       else block(ids, scale))
                ((out - target) ** 2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            prefetched.append(emb.prefetch(batches[step + 1][0]))

    train(range(STEPS), checkpointed=False)  # this thread trains first
    _on_a_thread_of_its_own(lambda: train(range(STEPS, 2 * STEPS), checkpointed=True))  # then this one
    assert len(prefetched) == 2 * STEPS
    assert sum(prefetched[STEPS:]) > 0  # its prefetches brought rows
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


def checkpointed_backward(lookup, ids, target, reentrant, recomputed_on):
    """The backward of a squared error on ``tanh(lookup(ids))`` under activation checkpointing.

    Adds the thread of each run of the lookup with gradients on to ``recomputed_on``: the recompute's,
    and a non-reentrant checkpoint's first forward (on the calling thread).
    """
    def block(ids, scale):
        if torch.is_grad_enabled():
            recomputed_on.add(threading.get_ident())
        return torch.tanh(lookup(ids)).sum(1) * scale
    scale = torch.ones(1, device=ids.device, requires_grad=True)
    out = activation.checkpoint(block, ids, scale, use_reentrant=reentrant)
    ((out - target.to(out.device)) ** 2).sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_cuda_lookups_with_a_prefetch_each_step_train_as_in_memory(rng, reentrant):
    """The GPU case of the test above, with torch's own threads: the lookup and the loss on the
    device, so the autograd engine recomputes the lookup on its thread for the device, and the
    training thread prefetches the next batch after each backward."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, "cuda", ROWS, cache_rows=40)
    batches = zipf_ids(rng, STEPS + 1)
    recomputed_on = set()
    for step in range(STEPS):
        ids, target = batches[step]
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            checkpointed_backward(lookup, ids.to(to), target, reentrant, recomputed_on if lookup is emb else set())
            if lookup is emb:
                emb.prefetch(batches[step + 1][0])
            optimizer.step()
            optimizer.zero_grad()
    # The case under test: the recompute ran on the engine's thread, not on this one.
    assert recomputed_on - {threading.get_ident()}, "the lookup was never recomputed on another thread"
    assert_trained_as_sparse_adam(emb, ref, ref_opt)
    assert emb.stats()["total"]["prefetched_rows"] > 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_lookups_of_a_sharded_embedding_train_as_in_memory(backend, rng, reentrant):
    """A ``ShardedOffloadedEmbedding`` of one rank under activation checkpointing, against SparseAdam in
    memory. On a GPU the autograd engine recomputes the lookup on its thread for the device while the
    training thread, which holds the step's claim, waits in ``backward()`` (NOTES' open list: the CPU
    test of ``test_training_flows`` only simulates that thread); on the CPU it recomputes on this one."""
    table0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    storage = "pinned" if backend == "cuda" else "pageable"
    emb = ss.ShardedOffloadedEmbedding(ROWS, DIM, max_rows=ROWS, storage=storage, backend=backend)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.Adam(emb.parameters(), lr=0.05, eps=1e-30)  # SparseAdam's steps at eps=1e-30
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.astype(np.float64)))
    ref_opt = torch.optim.SparseAdam([ref], lr=0.05, eps=1e-30)
    device = ss.get_backend(backend).device
    recomputed_on = set()
    for ids, target in zipf_ids(rng, STEPS):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            checkpointed_backward(lookup, ids.to(to), target, reentrant, recomputed_on if lookup is emb else set())
            optimizer.step()
            optimizer.zero_grad()
    assert recomputed_on, "the lookup was never recomputed"
    if backend == "cuda":  # the case under test: the engine's thread, not this one
        assert recomputed_on - {threading.get_ident()}, "the lookup was never recomputed on another thread"
    table = ref.detach().numpy()
    np.testing.assert_allclose(emb.table.to_numpy(), table, rtol=1e-5, atol=1e-5 * np.abs(table).max())
    for name in ("exp_avg", "exp_avg_sq"):
        expected = ref_opt.state[ref][name].numpy()
        np.testing.assert_allclose(emb._state.tables[name].to_numpy(), expected, rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max(), err_msg=name)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("fused", [None, True], ids=["plain", "fused"])
def test_autocast_and_a_grad_scaler_that_skips_steps_train_as_in_memory(rng, cache_rows, set_to_none, fused):
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward (the linear layer runs in
    bfloat16; the lookup stays float32, as ``nn.Embedding``'s) and a ``GradScaler`` whose scale
    grows every 3 steps, with inf injected into the loss at some steps: the scaler skips those
    steps and halves its scale; no row they looked up trains (in memory the reference forgets
    them), and the next steps train as in memory. A plain Adam's step is not called at such a
    step; a ``fused=True`` one's is, handed the scaler's inf flag, and unscales and skips inside
    its kernel: its rows go back as they were, and the step it counted is taken back."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01, fused=fused) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3) for _ in range(2)]
    infinite = rng.random(STEPS) < 0.2
    infinite[rng.integers(1, STEPS - 1)], infinite[-1] = True, False  # one skipped step at least; the last runs
    for (ids, target), inf in zip(zipf_ids(rng, STEPS), infinite):
        for model, optimizer, scaler in ((offloaded, opt, scalers[0]), (reference, ref_opt, scalers[1])):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids)
            assert out.dtype == torch.bfloat16
            loss = F.mse_loss(out.float(), target) * (torch.inf if inf else 1.0)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=set_to_none)
            assert (scaler.get_scale() < scale) == inf  # skipped exactly where inf was injected
        if inf:
            reference.emb.looked_up.clear()  # in memory the skipped step's rows left with its gradient
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    assert scalers[0].get_scale() == scalers[1].get_scale()


@pytest.mark.parametrize("cache_rows", [0, 40])
def test_user_code_sees_a_zero_gradient_as_in_memory_but_for_the_signs_of_two_zeros(rng, cache_rows):
    """A backward that leaves the table's gradient at zero (a loss weighted by 0) marks it: two
    elements hold ``-0.0`` and ``+0.0`` (README, "What exact means"). What user code reads of the
    gradient of the step's rows is what it reads in memory: the values (``torch.equal``, ``abs().sum()``,
    ``count_nonzero``, ``sign()``), ``clip_grad_norm_``'s total norm, and the gradient a hook
    registered on the weight is handed (the mark is written after it runs); only code that tells
    ``-0.0`` from ``+0.0`` (``torch.signbit``, ``copysign``, ``1 / x``) sees the two marked elements.
    Training goes on as in memory."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    emb = offloaded.emb
    emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    handed = {}
    for side, model in (("offloaded", offloaded), ("reference", reference)):
        # Keyed by name: a hook holding its model keeps it, and the embedding's device cache, alive
        # past the test (torch's garbage collector does not see through a tensor's hooks).
        model.emb.weight.register_hook(lambda grad, side=side: handed.__setitem__(side, grad.clone()))
    weights = np.where(rng.random(STEPS) < 0.5, 0.0, 1.0)
    weights[rng.integers(STEPS)] = 0.0  # one zero-weighted loss at least, the case under test
    for (ids, target), weight in zip(zipf_ids(rng, STEPS), weights):
        for model in (offloaded, reference):
            (weight * F.mse_loss(model(ids), target)).backward()
        rows = emb.working_rows
        grad, ref_grad = emb.weight.grad[:len(rows)], reference.emb.weight.grad[rows]
        mine, theirs = handed["offloaded"][:len(rows)], handed["reference"][rows]
        norms = [torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) for model in (offloaded, reference)]
        if weight == 0.0:  # exact zeros on both sides (a row's lookups are summed in another order otherwise)
            assert torch.equal(grad, ref_grad) and torch.equal(grad.sign(), ref_grad.sign())
            assert grad.abs().sum() == 0 and torch.count_nonzero(grad) == 0
            assert norms[0] == norms[1] == 0 and torch.equal(grad, torch.zeros_like(grad))
            assert int((torch.signbit(grad) != torch.signbit(ref_grad)).sum()) <= 2
            assert torch.equal(torch.signbit(mine), torch.signbit(theirs)) and torch.equal(mine, theirs)
        else:
            torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("inside", ["read", "auxiliary_loss"])
def test_a_forward_inside_a_custom_backward_trains_as_in_memory(backend, rng, cache_rows, inside):
    """A custom ``autograd.Function`` whose backward runs the embedding's forward, which is no
    activation checkpointing: it reads other rows to gate the gradient (no gradient mode there:
    an eval read), or computes an auxiliary loss on other rows with gradients on and backwards it
    (a training forward inside the backward, which leaves ``zero_grad()``'s verdict to the
    backward: ``reached.in_backward``). Both train as in memory (SparseAdam). Passed when written."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows)
    batches = zipf_ids(rng, 2 * STEPS)
    for step in range(STEPS):
        (ids, target), (other, _) = batches[2 * step], batches[2 * step + 1]
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            class Gate(torch.autograd.Function):
                @staticmethod
                def forward(ctx, rows):
                    return rows.clone()

                @staticmethod
                def backward(ctx, grad):
                    if inside == "read":
                        return grad * (1.5 + 0.5 * torch.tanh(lookup(other[:, 0].to(to)).cpu().sum(1))).view(-1, 1, 1)
                    with torch.enable_grad():
                        (lookup(other.to(to)).cpu() ** 2).sum().mul(0.1).backward()
                    return grad
            rows = Gate.apply(lookup(ids.to(to)).cpu())
            ((rows.sum((1, 2)) - target.view(-1)) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


_DDP_RANK = r"""
import os, sys, datetime
import numpy as np, torch, torch.distributed as dist
import speedswap as ss
from test_training_flows import STEPS, assert_equal_to_reference, make_lazy, pair, train_step, zipf_ids

rank, rendezvous, seed = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
DDP = torch.nn.parallel.DistributedDataParallel
for cache_rows in (0, 40):
    rng = np.random.default_rng([seed, rank, cache_rows])  # each rank its own rows and batches
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt = torch.optim.Adam(offloaded.parameters(), lr=0.01)
    offloaded.emb.attach(opt)
    batches = zipf_ids(rng, STEPS)
    table0 = offloaded.emb.table.to_numpy(copy=True)
    try:
        DDP(offloaded)(batches[0][0])
    except ss.OptionError as exc:  # on every rank, before any row joined the step
        assert "ShardedOffloadedEmbedding" in str(exc), exc
        assert not len(offloaded.emb.working_rows)
        np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table0)
    else:
        raise SystemExit("DDP averaging an OffloadedEmbedding's weight was not refused")
    # The advice: a table per rank, left out of DDP's average, on a model built anew (the refused
    # DDP copied rank 0's weight into this one); the linear layer is averaged. The reference leaves
    # its in-memory table out alike.
    offloaded.emb.close()
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt = torch.optim.Adam(offloaded.parameters(), lr=0.01)
    offloaded.emb.attach(opt)
    table0 = offloaded.emb.table.to_numpy(copy=True)
    for model in (offloaded, reference):
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["emb.weight"])
    wrapped, ref_wrapped = DDP(offloaded), DDP(reference)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    make_lazy(ref_opt, reference.emb)
    for ids, target in batches:
        train_step(wrapped, opt, ids, target)
        train_step(ref_wrapped, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    lin = [torch.zeros_like(offloaded.lin.weight) for _ in range(2)]
    dist.all_gather(lin, offloaded.lin.weight.detach())  # averaged: alike on the ranks
    torch.testing.assert_close(lin[0], lin[1], rtol=0, atol=0)
    assert not np.allclose(offloaded.emb.table.to_numpy(), table0)
    offloaded.emb.close()
open(os.path.join(os.path.dirname(rendezvous[len("file://"):]), f"ok{rank}"), "w").close()
sys.stdout.flush()
os._exit(0)  # without the interpreter's teardown, where gloo's threads can abort the process
"""


def test_ddp_over_an_offloaded_embedding_is_refused_and_a_table_per_rank_trains_as_in_memory(seed, tmp_path):
    """``DistributedDataParallel`` on 2 gloo ranks around a model holding an ``OffloadedEmbedding``.

    DDP would average the weight's gradient, but each rank's weight holds other rows (its step's
    working set): the training forward raises ``OptionError`` on every rank before any row joins
    the step, the table as it was. Leaving the weight out of DDP, as the error advises, each rank
    trains its own table while DDP averages the linear layer: equal, rank by rank, to the same
    loop over an in-memory table left out alike (cache or not). The model is built anew for that:
    the refused DDP's construction copied rank 0's weight into the working set, a write that its
    next training forward refuses (README).
    """
    run_two_ranks(_DDP_RANK, seed, tmp_path)


def run_two_ranks(body, seed, tmp_path):
    """Run the script ``body`` as 2 processes (``rank rendezvous seed`` as arguments); each must write ``ok<rank>``
    beside the rendezvous file and exit 0, within 120 s (a hung collective is killed)."""
    script = tmp_path / "rank.py"
    script.write_text(body)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]), "OMP_NUM_THREADS": "1"}
    rendezvous = rendezvous_url(tmp_path)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), rendezvous, str(seed)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0 and (tmp_path / f"ok{rank}").exists(), f"rank {rank}:\n{output[-3000:]}"


_SWITCHERS_RANK = r"""
import os, sys, datetime
import numpy as np, torch, torch.distributed as dist
import speedswap as ss

rank, rendezvous, seed = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng([seed, rank])
model = torch.nn.Sequential(torch.nn.Embedding(16, 4))
opt = torch.optim.Adam(model.parameters(), lr=0.1)
u_switch = ss.ModelFactory(model[0], 100, 4, backend="numpy")
u_switch.customInit(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((100, 4)).astype(np.float32))))
opt_switch = ss.OptimizerFactory(opt, 100, 4, model, "0", backend="numpy")
opt_switch.optInit()
dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
wrapped = torch.nn.parallel.DistributedDataParallel(model)
ids = torch.from_numpy(rng.integers(0, 100, 6))  # each rank its own rows
table0, slots0 = u_switch.getNumpyVersion(), model[0].weight.detach().clone()
for switch in (u_switch, opt_switch):
    try:
        switch.beforeForwardPass(ids)
    except ss.OptionError as exc:
        assert "2 ranks" in str(exc) and "ShardedOffloadedEmbedding" in str(exc), exc
    else:
        raise SystemExit(f"{type(switch).__name__}.beforeForwardPass under 2 ranks was not refused")
np.testing.assert_array_equal(u_switch.getNumpyVersion(), table0)
assert torch.equal(model[0].weight, slots0)
open(os.path.join(os.path.dirname(rendezvous[len("file://"):]), f"ok{rank}"), "w").close()
sys.stdout.flush()
os._exit(0)  # without the interpreter's teardown, where gloo's threads can abort the process
"""


def test_switchers_built_before_the_process_group_refuse_to_step_under_several_ranks(seed, tmp_path):
    """Switchers built before ``init_process_group`` (which refuses to build them under several
    ranks: each rank would train its own copy of the table), then ``DistributedDataParallel`` over
    the model: each rank's working set holds other rows in the same slots, and DDP averaged their
    gradients, silently (seen: both ranks trained without an error). Each ``beforeForwardPass``
    now refuses, on every rank, before any row moves."""
    run_two_ranks(_SWITCHERS_RANK, seed, tmp_path)


class _SkipGram(torch.nn.Module):
    """The skip-gram loss over an ``nn.Embedding`` that switchers fill: what ``torch.compile`` compiles."""

    def __init__(self, embedding):
        super().__init__()
        self.emb = embedding

    def forward(self, pos, neg, ctx):
        return skipgram_loss(self.emb(pos), self.emb(neg), ctx)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_a_compiled_model_trained_by_switchers_trains_as_in_memory_without_recompiling(rng, compiler):
    """``torch.compile`` of a model whose ``nn.Embedding`` a ``ModelFactory`` and an ``OptimizerFactory``
    switch, against in-memory lazy Adam. The switcher's check of its forwards' ids (stale
    placeholder copies, table ids) is a forward pre-hook; traced, it recompiled at every checked
    forward until dynamo's recompile limit (8) stopped compiling it, with a warning, or, with
    ``torch._dynamo.config.fail_on_recompile_limit_hit``, raised ``FailOnRecompileLimitHit``. It runs
    eagerly now, and still refuses a stale placeholder copy fed to the compiled model."""
    table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32)
    batches = zipf_batches(rng, STEPS, "cpu")
    make_opt = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    model = _SkipGram(torch.nn.Embedding(CAPACITY, DIM))
    opt = make_opt(model.parameters())
    u_switch = ss.ModelFactory(model.emb, total_classes=NUM_ROWS, embed_dimension=DIM, backend="numpy")
    u_switch.customInit(lambda t: t.copy_(torch.from_numpy(table0)))
    opt_switch = ss.OptimizerFactory(opt, NUM_ROWS, DIM, model, "emb", backend="numpy")
    opt_switch.optInit()
    pos_in, neg_in = u_switch.variableTransformer(len(batches[0][0]), 1, batches[0][1].shape[1])
    stale = torch.tensor(pos_in)  # a copy made once, before the loop: stale from the first step on
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compiler)
    with torch._dynamo.config.patch(**{FAIL_AT_RECOMPILE_LIMIT: True}):
        for step, (pos, neg, ctx) in enumerate(batches):
            for switch in (u_switch, opt_switch):
                switch.beforeForwardPass(pos, neg)
            if step == 8:  # after the forwards that recompiled
                with pytest.raises(ss.StateError, match="earlier content of the variableTransformer"):
                    compiled(stale, torch.from_numpy(neg_in), ctx)
            compiled(torch.from_numpy(pos_in).squeeze(1), torch.from_numpy(neg_in), ctx).backward()
            opt.step()
            opt.zero_grad()
            for switch in (u_switch, opt_switch):
                switch.afterOptimizerStep(pos, neg)
    torch._dynamo.reset()
    table, _ = run_in_memory(make_opt, table0, batches, "cpu", initial_state=lambda name, group: 0.0)
    np.testing.assert_allclose(u_switch.getNumpyVersion(), table, rtol=1e-5, atol=1e-6)


def test_compiling_a_model_whole_with_fullgraph_is_refused_by_torch_before_any_row_moves(rng):
    """``torch.compile(model, fullgraph=True)``: the embedding's forward must run eagerly (it is
    ``torch.compiler.disable``'d), which a full graph cannot hold, so torch raises
    ``torch._dynamo.exc.Unsupported`` at the first call (README says so: its hint, to remove the
    ``disable``, does not apply). Nothing has joined the step then: the same model, compiled with
    its embedding outside the graph (the linear layer alone with ``fullgraph=True``), trains as in memory."""
    offloaded, reference = pair(rng)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    batches = zipf_ids(rng, STEPS)
    table0 = offloaded.emb.table.to_numpy(copy=True)
    torch._dynamo.reset()
    # torch 2.6 names the disabled forward's wrapper: "inline in skipfiles: OffloadedEmbedding.forward | _fn".
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable|skipfiles: OffloadedEmbedding.forward"):
        torch.compile(offloaded, backend="eager", fullgraph=True)(batches[0][0])
    assert not len(offloaded.emb.working_rows)
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table0)
    offloaded.lin = torch.compile(offloaded.lin, backend="eager", fullgraph=True)
    for ids, target in batches:
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            train_step(model, optimizer, ids, target)
    torch._dynamo.reset()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)



@pytest.mark.parametrize("compiler, closure, cache_rows", [("eager", False, 40), ("aot_eager", False, 0),
                                                       ("eager", True, 0)])
def test_a_compiled_optimizer_step_trains_as_in_memory(rng, compiler, closure, cache_rows):
    """``torch.compile(opt.step)``, PyTorch's recipe for a faster step, of the attached optimizer (and of
    the reference's), with and without a closure. Dynamo traced the step hooks with the rest of the
    step: the narrowing's ``param.data`` and ``param.grad`` assignments ran out of order, and the first
    step raised torch's ``RuntimeError: attempting to assign a gradient of size '[81, 6]' to a tensor
    of size '[24, 6]'``. The hooks (and a closure's narrowing) run eagerly now; the rest of the step
    is compiled.

    The offloaded step's state views are new each step, so dynamo compiles it again each step; past
    its recompile limit (8) it runs eagerly, whose Adam rounds the bias correction otherwise (Python
    floats, not tensors) than the still-compiled reference: the limit covers the run here, for a
    comparison bit for bit."""
    offloaded, reference = pair(rng, cache_rows=cache_rows)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    torch._dynamo.reset()
    steps = {optimizer: torch.compile(optimizer.step, backend=compiler) for optimizer in (opt, ref_opt)}
    with torch._dynamo.config.patch(**{RECOMPILE_LIMIT: 16}):  # 12 steps, each compiled
        for ids, target in zipf_ids(rng, 12):
            for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
                def loss(model=model, optimizer=optimizer):
                    optimizer.zero_grad()
                    value = F.mse_loss(model(ids), target)
                    value.backward()
                    return value
                if closure:
                    steps[optimizer](loss)
                else:
                    loss()
                    steps[optimizer]()
    torch._dynamo.reset()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt, exact=True)


def test_switchers_train_with_a_compiled_optimizer_step_as_in_memory(rng):
    """``torch.compile(opt.step)`` under an ``OptimizerFactory``: its step hooks raised torch's
    ``RuntimeError`` (a gradient assigned to a parameter of another size) at the first step. The
    reference's step is compiled too (compiled Adam rounds its bias correction otherwise than eager
    Adam), and dynamo's recompile limit covers each run's steps (see the test above): bit for bit."""
    table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32)
    batches = zipf_batches(rng, 12, "cpu")

    def compiled_adam(params):
        opt = torch.optim.Adam(params, lr=0.01)
        opt.step = torch.compile(opt.step, backend="eager")
        return opt

    with torch._dynamo.config.patch(**{RECOMPILE_LIMIT: 16}):
        torch._dynamo.reset()
        table, state = run_switchers(compiled_adam, table0, batches, "numpy")
        torch._dynamo.reset()
        ref_table, ref_state = run_in_memory(compiled_adam, table0, batches, "cpu",
                                             initial_state=lambda name, group: 0.0)
        torch._dynamo.reset()
    np.testing.assert_array_equal(table, ref_table)
    for name, value in ref_state.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)

#: torch.func calls of an embedding's forward, as they are written for an nn.Embedding.
TORCH_FUNC_CALLS = {
    "grad": lambda emb, ids: torch.func.grad(
        lambda params: torch.func.functional_call(emb, params, (ids,)).sum())(dict(emb.named_parameters())),
    "vjp": lambda emb, ids: torch.func.vjp(
        lambda weight: torch.func.functional_call(emb, {"weight": weight}, (ids,)), emb.weight),
    "vmap": lambda emb, ids: torch.func.vmap(emb)(ids),
    "vmap_without_grad": lambda emb, ids: torch.no_grad()(torch.func.vmap(emb))(ids),
    "per_sample_grads": lambda emb, ids: torch.func.vmap(
        torch.func.grad(lambda params, i: torch.func.functional_call(emb, params, (i,)).sum()),
        in_dims=(None, 0))(dict(emb.named_parameters()), ids),
}


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("transform", list(TORCH_FUNC_CALLS))
def test_a_torch_func_transform_of_the_forward_is_refused_and_rows_looked_up_outside_one_train(
        backend, rng, cache_rows, transform):
    """``torch.func`` transforms of the embedding's forward (``grad``/``vjp`` of a
    ``functional_call``, ``vmap``, per-sample gradients) hand it a wrapped ``weight`` without
    storage, or batched ids: it failed deep inside with a ``RuntimeError`` ("Cannot access data
    pointer of Tensor that doesn't have storage", "Batching rule not implemented for
    aten::ne.Tensor_out"). It is refused with ``OptionError``, mid-step with nothing changed, and
    what the refusal advises (look the rows up outside the transform, pass them in, and hand their
    gradient back with ``rows.backward``) trains as in memory."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        for lookup, optimizer, to in both_sides(emb, opt, ref, ref_opt, device):
            rows = lookup(ids.to(to))  # a step in flight
            if step == STEPS // 2 and optimizer is opt:
                with pytest.raises(ss.OptionError, match="rows.backward"):
                    TORCH_FUNC_CALLS[transform](emb, ids.to(to))
            rows.backward(torch.func.grad(lambda r: ((r.cpu().sum(1) - target) ** 2).sum())(rows.detach()))
            optimizer.step()
            optimizer.zero_grad()
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


#: Lookups that read the table inside a ``torch.func`` transform, of ids and a weight it does not
#: track: (how the lookup reads, the transform), each with its in-memory counterpart's result.
READS_UNDER_TRANSFORMS = [("eval", "grad"), ("eval", "vmap"), ("frozen", "grad"), ("frozen", "vmap"),
                          ("no_grad", "vmap")]


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("reads, transform", READS_UNDER_TRANSFORMS)
def test_a_lookup_reading_the_table_runs_under_a_torch_func_transform_as_in_memory(
        backend, rng, cache_rows, reads, transform):
    """A forward that reads the table (eval mode, ``torch.no_grad()``, a frozen ``weight``) of
    plain ids is a constant to a ``torch.func`` transform of something else: gradients of a head
    over pretrained rows (``grad`` of a function of ``x``), a ``vmap`` over other inputs. Such
    calls ran as in memory until every forward under a transform was refused with ``OptionError``
    (refused for nothing); they give nn.Embedding's results, and change nothing: training on
    afterwards matches SparseAdam."""
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, ROWS, cache_rows)
    batches = zipf_ids(rng, 6)
    for ids, target in batches[:4]:
        step_both(both_sides(emb, opt, ref, ref_opt, device), ids, target)
    ids = batches[4][0]
    xs = torch.from_numpy(rng.standard_normal((3, emb.embedding_dim)).astype(np.float32))
    if reads == "eval":
        emb.eval()
    elif reads == "frozen":
        emb.weight.requires_grad_(False)

    def under_transform(lookup):
        if transform == "grad":
            return torch.func.grad_and_value(lambda x: (lookup(ids) @ x).sin().sum())(xs[0])
        with torch.no_grad() if reads == "no_grad" else torch.enable_grad():
            return (torch.func.vmap(lambda x: lookup(ids) @ x)(xs),)

    got = under_transform(lambda i: emb(i.to(device)).cpu())
    want = under_transform(lambda i: F.embedding(i, ref.detach().float()))  # the float32 rows the emb reads
    for got_part, want_part in zip(got, want, strict=True):
        np.testing.assert_allclose(got_part.numpy(), want_part.numpy(), rtol=1e-5, atol=1e-5)
    emb.train()
    emb.weight.requires_grad_(True)
    step_both(both_sides(emb, opt, ref, ref_opt, device), *batches[5])
    assert_trained_as_sparse_adam(emb, ref, ref_opt)


#: Run in a child whose torch lacks one of the private calls the torch.func checks use; argv: the
#: call's name, a seed. Trains an offloaded embedding beside an nn.Embedding with SGD, then compares.
WITHOUT_FUNCTORCH_CALL = """
import sys
import numpy as np
import torch
delattr(torch._C if sys.argv[1] == "_DisableFuncTorch" else torch._C._functorch, sys.argv[1])
import speedswap as ss
rng = np.random.default_rng(int(sys.argv[2]))
table = rng.standard_normal((50, 4)).astype(np.float32)
emb = ss.OffloadedEmbedding.from_pretrained(torch.from_numpy(table.copy()), freeze=False, max_rows=50,
                                            storage="pageable", backend="numpy")
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
emb.attach(opt)
ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table.copy()), freeze=False)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
for _ in range(5):
    ids = torch.from_numpy(rng.integers(0, 50, (4, 3)))
    for model, optimizer in ((emb, opt), (ref, ref_opt)):
        (model(ids) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7)
emb.eval()
ids = torch.from_numpy(rng.integers(0, 50, 7))
np.testing.assert_array_equal(emb(ids).detach().numpy(), emb.table.to_numpy()[ids.numpy()])
xs = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
try:
    got = torch.func.vmap(lambda x: emb(ids) @ x)(xs)
except ss.OptionError:
    print("refused")
else:
    want = torch.func.vmap(lambda x: ref(ids) @ x)(xs)
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    print("read")
"""


@pytest.mark.parametrize("missing, under_vmap", [("peek_interpreter_stack", "read"), ("_DisableFuncTorch", "refused")])
def test_a_torch_without_the_private_functorch_calls_still_trains_as_in_memory(seed, missing, under_vmap):
    """The forward's ``torch.func`` check asks torch through private calls (torch has no public
    one), which another torch may not have: without ``peek_interpreter_stack`` every forward
    raised ``AttributeError``, training included. Without one, the embedding trains as in memory;
    a read inside a ``vmap`` of other inputs runs unchecked (no transform can be seen) or is
    refused with ``OptionError`` (no way to step out of it)."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": str(tests.parent), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", WITHOUT_FUNCTORCH_CALL, missing, str(seed)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == under_vmap
