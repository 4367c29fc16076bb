"""A skip-gram training step with Adam: offloaded (OffloadedEmbedding) vs entirely in memory.

Step: 4096 (center, context) pairs and 5 negatives per pair, dim 128, ids
drawn from a Zipf distribution over the vocabulary (p ~ 1/rank, as word
frequencies), one table shared by centers, contexts and negatives (tied
embeddings: the work per step is that of two tables, the memory half, so a
10M-row table with Adam's two state tables, 15 GB, fits a 24 GB machine).

* in memory: ``nn.Embedding(sparse=True)`` + ``SparseAdam`` (in RAM on a CPU,
  all on the GPU on a GPU) — lazy Adam, the same function as the offloaded one.
* offloaded: ``OffloadedEmbedding`` with ``Adam`` attached; table and state in
  host memory (pinned on a GPU), ``max_rows`` = 4096 * 7.

Run: ``python benchmarks/training_step.py [--vocab 1000000 10000000] [--repeats 20]``.
The two setups are timed interleaved (one step of each per round, so a noisy
neighbour hits both alike) when both fit in RAM together; otherwise one after
the other, each alone. On a GPU, peak device memory of each setup is recorded
(the offloaded one holds only the working set and must not grow with the vocabulary).
"""

import argparse
import gc
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import speedswap as ss  # noqa: E402

BATCH, NEGS, DIM, LR = 4096, 5, 128, 1e-3


def zipf_batches(vocab, count, device, seed=0):
    """``count`` batches of (center, context, negatives) ids, p(rank r) ~ 1/r."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    cdf /= cdf[-1]
    draw = lambda shape: torch.from_numpy(  # noqa: E731
        np.minimum(np.searchsorted(cdf, rng.random(shape)), vocab - 1)).to(device)
    return [(draw(BATCH), draw(BATCH), draw((BATCH, NEGS))) for _ in range(count)]


def skipgram_loss(emb, center, context, negatives):
    u = emb(center)
    pos = F.logsigmoid((u * emb(context)).sum(-1))
    neg = F.logsigmoid(-(emb(negatives) @ u.unsqueeze(-1)).squeeze(-1)).sum(-1)
    return -(pos + neg).mean()


def in_memory(vocab, device):
    emb = torch.nn.Embedding(vocab, DIM, sparse=True).to(device)
    return emb, torch.optim.SparseAdam(list(emb.parameters()), lr=LR)


def offloaded(vocab, device):
    storage = "pinned" if device.type == "cuda" else "pageable"
    emb = ss.OffloadedEmbedding(vocab, DIM, max_rows=BATCH * (2 + NEGS), storage=storage)
    opt = torch.optim.Adam(emb.parameters(), lr=LR)
    emb.attach(opt)
    return emb, opt


def device_bytes(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def step_fn(build, vocab, batches, device):
    """A function running one training step (cycling through ``batches``), and its model."""
    emb, opt = build(vocab, device)
    position = [0]

    def step():
        center, context, negatives = batches[position[0] % len(batches)]
        position[0] += 1
        skipgram_loss(emb, center, context, negatives).backward()
        opt.step()
        opt.zero_grad()

    return step, (emb, opt)


def host_bytes_needed(vocab):
    """Table plus Adam's two state tables, float32."""
    return vocab * DIM * 4 * 3


def measure(vocab, batches, device, repeats):
    """Time both setups: interleaved when both fit in RAM at once, else one after the other."""
    builds = {"in_memory": in_memory, "offloaded": offloaded}
    ram = common.machine().get("ram_bytes", 0)
    if device.type == "cpu" and 2 * host_bytes_needed(vocab) < 0.7 * ram:
        fns, keep = {}, []
        for name, build in builds.items():
            fns[name], model = step_fn(build, vocab, batches, device)
            keep.append(model)
        timings = common.time_interleaved(fns, repeats=repeats)
        for name in builds:
            timings[name]["interleaved"] = True
        return timings
    timings = {}
    timer = common.time_cuda if device.type == "cuda" else common.time_cpu
    for name, build in builds.items():
        fn, model = step_fn(build, vocab, batches, device)
        # On a GPU each setup runs alone, so its device memory is its own.
        timings[name] = {**timer(fn, repeats=repeats), "interleaved": False,
                         "device_bytes": device_bytes(device)}
        del fn, model
        gc.collect()
    return timings


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, results = [], []
    for vocab in args.vocab:
        batches = zipf_batches(vocab, 8, device)
        distinct = float(np.mean([len(torch.unique(torch.cat([c, x, n.reshape(-1)])))
                                  for c, x, n in batches]))
        load = os.getloadavg()  # other work on the machine skews the figures; say how much
        timings = measure(vocab, batches, device, args.repeats)
        ratio = timings["offloaded"]["median_s"] / timings["in_memory"]["median_s"]
        results.append({"vocab": vocab, "distinct_rows_per_step": distinct, "ratio": ratio,
                        "load_average_before": load,
                        **timings})
        rows.append({"vocab": vocab, "distinct rows": round(distinct),
                     "in-memory ms": 1e3 * timings["in_memory"]["median_s"],
                     "offloaded ms": 1e3 * timings["offloaded"]["median_s"],
                     "offloaded / in-memory": ratio,
                     "interleaved": timings["in_memory"]["interleaved"],
                     "GPU MiB in-memory": _mib(timings["in_memory"].get("device_bytes")),
                     "GPU MiB offloaded": _mib(timings["offloaded"].get("device_bytes"))})
    common.print_table(rows, list(rows[0]))
    common.write_results("training_step", {
        "setup": {"batch": BATCH, "negatives": NEGS, "dim": DIM, "optimizer": "Adam", "lr": LR,
                  "ids": "Zipf p~1/rank", "tied_embeddings": True,
                  "in_memory": "nn.Embedding(sparse=True) + SparseAdam",
                  "offloaded": "OffloadedEmbedding + Adam (lazy; same function as SparseAdam "
                               "up to where eps is added)",
                  "target": "CPU: offloaded <= 1.2x in-memory"},
        "results": results})


def _mib(value):
    return None if value is None else value / 2**20


if __name__ == "__main__":
    main()
