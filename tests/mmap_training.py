"""An ``mmap`` embedding trained with Adam beside SparseAdam on an ``nn.Embedding``: for ``test_table_file_changes.py``.

A module of its own, not a fixture: that file's SIGBUS cases train in a
subprocess (a crash there fails the test instead of killing pytest), which
imports it as the tests do.
"""

import numpy as np
import torch

import speedswap as ss

ROWS, DIM, BATCH = 500, 8, 64


def zipf_ids(rng):
    """A batch of ``BATCH`` ids, Zipf over the rows in a random order of ranks."""
    p = 1.0 / np.arange(1, ROWS + 1)
    return torch.from_numpy(rng.permutation(ROWS)[rng.choice(ROWS, BATCH, p=p / p.sum())])


def trained(directory, seed, steps, cache_rows=0):
    """An mmap embedding and its Adam, and an nn.Embedding with SparseAdam, trained alike on Zipf ids."""
    rng = np.random.default_rng(seed)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=BATCH, storage="mmap", path=directory,
                                backend="numpy", cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((ROWS, DIM), dtype=np.float32))))
    opt = torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-30)  # SparseAdam adds eps elsewhere
    emb.attach(opt)
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.table.to_numpy(copy=True)), freeze=False,
                                             sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30)
    for _ in range(steps):
        step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng), weights=torch.from_numpy(
            rng.standard_normal((BATCH, DIM), dtype=np.float32)))
    return emb, opt, ref, ref_opt, rng


def step(*models, ids, weights):
    """One step of each ``(module, optimizer)`` on the same batch."""
    for module, optimizer in models:
        ((module(ids) * weights).sum() ** 2).backward()
        optimizer.step()
        optimizer.zero_grad()
