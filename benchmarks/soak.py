"""Soak: thousands of training steps with the resident set size sampled, to catch slow leaks.

Three scenarios, each in this one process, one after the other:

* ``offloaded``: an ``OffloadedEmbedding`` with ``Adam`` attached, a skip-gram
  step per iteration (Zipf ids, repeats in every batch), and a directory
  checkpoint saved every ``--save-every`` steps (versions replaced in place).
* ``switchers``: the same job with SpeedTorch's ``ModelFactory`` /
  ``OptimizerFactory`` around an ``nn.Embedding``, saving the table (``.npy``)
  and the optimizer state (directory) every ``--save-every`` steps.
* ``rebuild``: an ``OffloadedEmbedding`` built, attached, stepped once and
  dropped (not closed) per iteration, with the optimizer kept alive: its
  tables must be freed when it is dropped.

RSS is read from ``/proc/self/statm`` every ``--sample-every`` steps. After
the first 10% of the steps (warm-up: allocator pools, page faults of touched
rows) the RSS must stay within 2% of its value there: ``flat`` in the results.

Run: ``python benchmarks/soak.py [--steps 10000] [--vocab 1000000]``; results go to
``benchmarks/results/soak-cpu.json`` (``-gpu`` on a GPU) with the machine and
the load average before and after.
"""

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import speedswap as ss  # noqa: E402

FLAT_TOLERANCE = 0.02
WARMUP_SHARE = 0.1


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def zipf_pool(vocab, batch, negs, count, device, seed=0):
    """``count`` batches of (center, context, negatives), p(rank r) ~ 1/r, reused cyclically."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    cdf /= cdf[-1]
    perm = rng.permutation(vocab)  # popular rows scattered over the table

    def draw(shape):
        return torch.from_numpy(perm[np.minimum(np.searchsorted(cdf, rng.random(shape)),
                                                vocab - 1)]).to(device)
    return [(draw(batch), draw(batch), draw((batch, negs))) for _ in range(count)]


def skipgram_loss(u, ctx, neg):
    pos = F.logsigmoid((u * ctx).sum(-1))
    negative = F.logsigmoid(-(neg @ u.unsqueeze(-1)).squeeze(-1)).sum(-1)
    return -(pos + negative).mean()


def run(name, steps, sample_every, step_fn):
    """Call ``step_fn(i)`` ``steps`` times; sample RSS; return the scenario's figures."""
    samples = []
    start = time.perf_counter()
    for i in range(steps):
        step_fn(i)
        if i % sample_every == 0 or i == steps - 1:
            samples.append((i, rss_bytes()))
    seconds = time.perf_counter() - start
    warm = [rss for i, rss in samples if i >= WARMUP_SHARE * steps]
    baseline = warm[0]
    growth = (max(warm) - baseline) / baseline
    slope = np.polyfit([i for i, _ in samples if i >= WARMUP_SHARE * steps], warm, 1)[0]
    result = {"steps": steps, "seconds": seconds, "steps_per_second": steps / seconds,
              "rss_baseline_bytes": baseline, "rss_max_bytes": max(warm),
              "rss_final_bytes": warm[-1], "growth_after_warmup": growth,
              "slope_bytes_per_step": float(slope), "flat": growth <= FLAT_TOLERANCE,
              "samples": samples}
    print(f"{name:10s} {steps} steps in {seconds:7.1f} s   RSS {baseline / 2**20:8.1f} MiB -> "
          f"max {max(warm) / 2**20:8.1f} MiB ({growth:+.2%}), slope {slope:+.1f} B/step   "
          f"{'flat' if result['flat'] else 'GROWS'}")
    return result


def offloaded(args, batches, directory):
    emb = ss.OffloadedEmbedding(args.vocab, args.dim, max_rows=args.batch * (2 + args.negs),
                                storage="pinned")
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    emb.attach(opt)

    def step(i):
        center, context, negatives = batches[i % len(batches)]
        skipgram_loss(emb(center), emb(context), emb(negatives)).backward()
        opt.step()
        opt.zero_grad()
        if args.save_every and (i + 1) % args.save_every == 0:
            emb.save(os.path.join(directory, "offloaded"))
    try:
        return run("offloaded", args.steps, args.sample_every, step)
    finally:
        emb.close()


def switchers(args, batches, directory):
    model = torch.nn.ModuleDict({"u": torch.nn.Embedding(args.batch * (2 + args.negs), args.dim)})
    model.to(ss.get_backend().device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    u = ss.ModelFactory(model["u"], args.vocab, args.dim, CPUPinn=True)
    u.normalDistributionInit(0.0, 1.0)
    o = ss.OptimizerFactory(opt, args.vocab, args.dim, model, "u", CPUPinn=True)

    def step(i):
        center, context, negatives = batches[i % len(batches)]
        lc, lx = u.beforeForwardPass(torch.cat([center, context]), negatives)
        o.beforeForwardPass(torch.cat([center, context]), negatives)
        c, x = model["u"](lc).split(len(center))
        skipgram_loss(c, x, model["u"](lx)).backward()
        opt.step()
        opt.zero_grad()
        u.afterOptimizerStep(torch.cat([center, context]), negatives)
        o.afterOptimizerStep(torch.cat([center, context]), negatives)
        if args.save_every and (i + 1) % args.save_every == 0:
            u.save(os.path.join(directory, "switchers.npy"))
            o.save(os.path.join(directory, "switchers-optimizer"))
    try:
        return run("switchers", args.steps, args.sample_every, step)
    finally:
        u.close()
        o.close()


def rebuild(args, batches):
    rows = max(1, args.vocab // 20)
    kept_alive = []  # the optimizers outlive the embeddings they were attached to

    def step(i):
        center, context, negatives = batches[i % len(batches)]
        emb = ss.OffloadedEmbedding(rows, args.dim, max_rows=args.batch * 2, storage="pinned")
        opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
        emb.attach(opt)
        (emb(center % rows) * emb(context % rows)).sum().backward()
        opt.step()
        kept_alive[:] = [opt]  # only the last one: the dropped embeddings must not be held
    return run("rebuild", args.rebuild_steps, max(1, args.sample_every // 10), step)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=common.positive_int, default=10_000)
    parser.add_argument("--rebuild-steps", type=common.positive_int, default=1_000)
    parser.add_argument("--vocab", type=common.positive_int, default=1_000_000)
    parser.add_argument("--dim", type=common.positive_int, default=64)
    parser.add_argument("--batch", type=common.positive_int, default=512)
    parser.add_argument("--negs", type=common.positive_int, default=5)
    parser.add_argument("--save-every", type=common.positive_int, default=2_500)
    parser.add_argument("--sample-every", type=common.positive_int, default=100)
    common.add_out_option(parser)
    args = parser.parse_args()
    device = ss.get_backend().device
    batches = zipf_pool(args.vocab, args.batch, args.negs, 64, device)
    load_before = os.getloadavg()
    print(f"soak: vocab {args.vocab} x dim {args.dim}, batch {args.batch} (+{args.negs} "
          f"negatives), {args.steps} steps, on {device}; load average {load_before}")
    with tempfile.TemporaryDirectory(prefix="soak-", dir=os.environ.get("SOAK_DIR")) as directory:
        results = {"offloaded": offloaded(args, batches, directory)}
        gc.collect()
        results["switchers"] = switchers(args, batches, directory)
        gc.collect()
    results["rebuild"] = rebuild(args, batches)
    flat = all(r["flat"] for r in results.values())
    print(f"RSS flat within {FLAT_TOLERANCE:.0%} after warm-up in every scenario: {flat}")
    common.write_results("soak", out=args.out, payload={"config": {**vars(args), "out": str(args.out)}, "flat": flat,
                                  "tolerance": FLAT_TOLERANCE, "warmup_share": WARMUP_SHARE,
                                  "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                                  "scenarios": results})


if __name__ == "__main__":
    main()
