"""An ``mmap`` embedding trained with Adam beside SparseAdam on an ``nn.Embedding``: for tests that train one.

A module of its own, not a fixture: that file's SIGBUS cases train in a
subprocess (a crash there fails the test instead of killing pytest), which
imports it as the tests do.
"""

import os

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
    train(emb, opt, ref, ref_opt, rng, steps)
    return emb, opt, ref, ref_opt, rng


def step(*models, ids, weights):
    """One step of each ``(module, optimizer)`` on the same batch."""
    for module, optimizer in models:
        ((module(ids) * weights).sum() ** 2).backward()
        optimizer.step()
        optimizer.zero_grad()


def train(emb, opt, ref, ref_opt, rng, steps):
    """``steps`` more steps of ``emb`` with ``opt`` and of ``ref`` with ``ref_opt``, on the same Zipf batches."""
    for _ in range(steps):
        step((emb, opt), (ref, ref_opt), ids=zipf_ids(rng), weights=torch.from_numpy(
            rng.standard_normal((BATCH, DIM), dtype=np.float32)))


def assert_as_in_memory(emb, ref, ref_opt, directory=None):
    """``emb``'s table and its attached Adam's moments are ``ref``'s and ``ref_opt``'s (SparseAdam's).

    ``emb``: an OffloadedEmbedding, or a ShardedOffloadedEmbedding of one rank. With ``directory`` (where
    ``emb`` keeps its files), its files hold them too: ``table.npy``, ``exp_avg.npy``, ``exp_avg_sq.npy``.
    """
    if isinstance(emb, ss.OffloadedEmbedding):
        emb.flush()  # the cached rows' state into the tables (a sharded embedding caches none)
    table = emb.table.to_numpy()
    np.testing.assert_allclose(table, ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    ref_state = ref_opt.state[ref.weight]
    for name in ("exp_avg", "exp_avg_sq"):
        moments = emb._state.tables[name].to_numpy()
        # Moments up to ~10 (a squared loss): their float32 rounding, summed in another order by SparseAdam,
        # reaches 1e-6 in entries near zero.
        np.testing.assert_allclose(moments, ref_state[name].to_dense().numpy(), rtol=1e-4, atol=1e-5)
        if directory is not None:
            np.testing.assert_array_equal(np.load(os.path.join(directory, f"{name}.npy")), moments)
    if directory is not None:
        np.testing.assert_array_equal(np.load(os.path.join(directory, "table.npy")), table)


def entries(directory) -> dict:
    """Every entry of ``directory``: a file's name -> its bytes, anything else's -> None."""
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                found[name] = f.read()
        else:
            found[name] = None
    return found
