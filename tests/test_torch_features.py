"""torch features a training loop combines with an offloaded embedding: each trains as in memory, or raises.

Activation checkpointing, ``torch.compile``, ``torch.autocast`` with a
``GradScaler``, ``DistributedDataParallel``, and what user code sees of the
zero-gradient mark. Each test trains an :class:`~speedswap.OffloadedEmbedding`
beside an in-memory reference on the same random rows and Zipf ids (the
references of ``test_training_flows``: a lazy ``nn.Parameter`` table, or
``SparseAdam`` on a sparse gradient) and compares the two to float32 rounding.
"""

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as activation

from test_training_flows import (BATCH, STEPS, WIDTH, adam_against_sparse_adam, assert_trained_as_sparse_adam,
                                 both_sides, zipf_ids)


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
    emb, opt, ref, ref_opt, device = adam_against_sparse_adam(rng, backend, 300, cache_rows)
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
