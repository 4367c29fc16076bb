"""Row-sharded training over gloo: memory per rank, bytes exchanged per step, step time vs one process.

The step is ``training_step.py``'s: skip-gram with Adam, dim 128, ids drawn
from a Zipf distribution (p ~ 1/rank) over the vocabulary, one tied table for
centres, contexts and negatives, ``--pairs`` (centre, context) pairs per
*global* step with 5 negatives each. Three setups train the same global step:

* ``one process``: ``OffloadedEmbedding`` + Adam on all the pairs, one thread;
* ``sharded, W=1``: ``ShardedOffloadedEmbedding`` in one process (the class's
  own overhead, no messages);
* ``sharded, W=2``: two gloo ranks on 127.0.0.1, each with half the pairs and
  half the rows (``torch.multiprocessing.spawn``), one thread each: twice
  the cores of the one-process setups.

Per rank it records host bytes held (table + Adam state, from
``speedswap.info()``) and the bytes of ids, rows and gradients it sent to the
other ranks per step (the collectives' payload). From the measured unique ids
it also *computes* (does not measure) the volume for 8 ranks and a projected
exchange time on 10 Gb/s links; see :func:`volume`.

Run: ``python benchmarks/distributed.py [--vocab 1000000] [--repeats 20]``.
"""

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import speedswap as ss  # noqa: E402
from speedswap.train.exchange import owner_starts, owners, row_bounds  # noqa: E402

NEGS, DIM, LR, WARMUP = 5, 128, 1e-3, 3


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zipf_steps(vocab, pairs, count, seed=0):
    """``count`` global steps of (centre, context, negatives) ids, p(rank r) ~ 1/r."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    cdf /= cdf[-1]
    perm = rng.permutation(vocab)  # popular rows spread over every rank's range

    def draw(shape):
        return torch.from_numpy(perm[np.minimum(np.searchsorted(cdf, rng.random(shape)), vocab - 1)])
    return [(draw(pairs), draw(pairs), draw((pairs, NEGS))) for _ in range(count)]


def rank_share(step, rank, world):
    """This rank's contiguous share of a global step's pairs."""
    return tuple(part.tensor_split(world)[rank] for part in step)


def loss_of(emb, centre, context, negatives):
    """Negative-sampling loss; one forward over all the step's ids (one exchange per step)."""
    rows = emb(torch.cat([centre, context, negatives.reshape(-1)]))
    b = len(centre)
    u, v, n = rows[:b], rows[b:2 * b], rows[2 * b:].view(b, NEGS, DIM)
    pos = F.logsigmoid((u * v).sum(-1))
    neg = F.logsigmoid(-(n @ u.unsqueeze(-1)).squeeze(-1)).sum(-1)
    return -(pos + neg).mean()


def run(emb, opt, steps, share):
    """Time ``len(steps)`` training steps after WARMUP; returns per-step seconds."""
    times = []
    for i, step in enumerate(steps):
        start = time.perf_counter()
        loss_of(emb, *share(step)).backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def build(cls, vocab, pairs, world=1):
    max_rows = -(-pairs // world) * (2 + NEGS)  # rank 0's share, the largest of tensor_split's
    emb = cls(vocab, DIM, max_rows=max_rows, storage="pageable", backend="numpy")
    opt = torch.optim.Adam(emb.parameters(), lr=LR)
    emb.attach(opt)
    return emb, opt


def _rank_main(rank, world, port, vocab, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    emb, opt = build(ss.ShardedOffloadedEmbedding, vocab, len(steps[0][0]), world)
    held = ss.info()["host_bytes"] + ss.info()["file_bytes"]
    sent_before = emb.bytes_sent
    times = run(emb, opt, steps, lambda s: rank_share(s, rank, world))
    result = {"rank": rank, "host_bytes": held, "step": common.summarize(times),
              "bytes_sent_per_step": (emb.bytes_sent - sent_before) / len(steps)}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def volume(steps, vocab, world):
    """Bytes one rank sends per step, averaged over ranks and steps, counted from the ids.

    Per forward, rank r sends the ids it looks up that another rank owns
    (8 bytes each) and, for the ids others look up in its rows, the rows
    (4*dim bytes each); at the step it sends the gradients of the rows it
    looked up that another rank owns (4*dim bytes each). With U_r unique ids
    on rank r and a fraction f_r of them owned elsewhere (about (W-1)/W)::

        sent_r ~= U_r * f_r * (8 + 4*dim) + (rows others ask of r) * 4*dim

    and summed over ranks, sum_r U_r * f_r * (8 + 8*dim) bytes cross the
    network per step.
    """
    starts = owner_starts(row_bounds(vocab, world), "cpu")
    total = 0
    for step in steps:
        for rank in range(world):
            ids = torch.unique(torch.cat([p.reshape(-1) for p in rank_share(step, rank, world)]))
            remote = int((owners(ids, starts) != rank).sum())
            total += remote * (8 + 8 * DIM)
    return total / len(steps) / world


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=common.positive_int, default=1_000_000)
    parser.add_argument("--pairs", type=common.positive_int, default=4096, help="pairs per global step")
    parser.add_argument("--repeats", type=common.positive_int, default=20)
    parser.add_argument("--link-gbit", type=float, default=10.0, help="link speed of the projection")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    steps = zipf_steps(args.vocab, args.pairs, args.repeats + WARMUP)

    results = {}
    # One thread per process everywhere: on a shared 2-core machine OpenMP
    # threads that spin for a busy core make a step many times slower.
    torch.set_num_threads(1)
    for name, cls in (("one process", ss.OffloadedEmbedding),
                      ("sharded, W=1", ss.ShardedOffloadedEmbedding)):
        before = ss.info()["host_bytes"]
        emb, opt = build(cls, args.vocab, args.pairs)
        held = ss.info()["host_bytes"] - before
        results[name] = {"host_bytes": held, "step": common.summarize(run(emb, opt, steps, lambda step: step)),
                         "bytes_sent_per_step": 0}
        del emb, opt

    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        mp.spawn(_rank_main, args=(2, port, args.vocab, steps, out), nprocs=2)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    results["sharded, W=2"] = {"ranks": ranks, "step": ranks[0]["step"],
                               "host_bytes": max(r["host_bytes"] for r in ranks),
                               "bytes_sent_per_step": statistics.mean(
                                   r["bytes_sent_per_step"] for r in ranks)}
    load_after = os.getloadavg()

    whole = results["one process"]["host_bytes"]
    rows = [{"setup": name, "step ms": r["step"]["median_s"] * 1e3,
             "min ms": r["step"]["min_s"] * 1e3, "max ms": r["step"]["max_s"] * 1e3,
             "host MiB per rank": r["host_bytes"] / 2**20,
             "share of whole": r["host_bytes"] / whole,
             "KiB sent per rank per step": r["bytes_sent_per_step"] / 1024}
            for name, r in results.items()]
    common.print_table(rows, list(rows[0]))

    counted_2 = volume(steps, args.vocab, 2)
    counted_8 = volume(steps, args.vocab, 8)
    link = args.link_gbit * 1e9 / 8
    projection = {
        "formula": "bytes sent per rank per step ~= U_r * f_r * (8 + 8*dim) (ids out, rows in/out "
                   "balanced, grads out); U_r unique ids of rank r, f_r ~ (W-1)/W owned elsewhere",
        "counted_bytes_per_rank_step_W2": counted_2,
        "measured_bytes_per_rank_step_W2": results["sharded, W=2"]["bytes_sent_per_step"],
        "counted_bytes_per_rank_step_W8": counted_8,
        "link_gbit": args.link_gbit,
        "projected_exchange_ms_W8": counted_8 / link * 1e3,
    }
    print(f"\nbytes per rank per step, W=2: counted {counted_2 / 1024:.0f} KiB, measured "
          f"{projection['measured_bytes_per_rank_step_W2'] / 1024:.0f} KiB")
    print(f"W=8 ({args.pairs // 8} pairs per rank): {counted_8 / 1024:.0f} KiB per rank per step "
          f"-> {projection['projected_exchange_ms_W8']:.2f} ms on {args.link_gbit:g} Gb/s links "
          f"(bandwidth only; add 7 collective latencies per step: 4 a forward, 3 a step)")
    print(f"load average before {load_before}, after {load_after}")
    common.write_results("distributed", out=args.out, payload={
        "vocab": args.vocab, "pairs_per_global_step": args.pairs, "dim": DIM, "negatives": NEGS,
        "repeats": args.repeats, "loadavg_before": load_before, "loadavg_after": load_after,
        "results": results, "projection": projection})


if __name__ == "__main__":
    main()
