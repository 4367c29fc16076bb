"""Eval forwards through the device cache: time and rows read from the host, cached against uncached.

An ``OffloadedEmbedding`` forward outside training (here ``eval()`` under
``no_grad``) takes its cached rows from the cache and reads only the others
from the host, each once (``RowCache.read``). Per id distribution (Zipf 1.1,
popular rows scattered over the table, and uniform) one embedding per cache
size (0, 1, 5, 20% of the rows; vocabulary 1M, dim 64, Adam) is trained by
``cache.py``'s skip-gram step until its cache is full (``cache.fill``), then eval
forwards of fresh ids (4096 each, the same ids for every cache size) are
timed in interleaved rounds, so load from other processes hits every size
alike. Rows and bytes read from the host per forward come from
``emb.stats()["eval"]``: they are exact whatever the load. The "ideal" hit
rate is the share of the same ids a cache holding the truly most probable
rows would serve (Zipf only). Last, one eval forward ten times a training
step's ids is run on each cache, whose ``cache_bytes`` must stay as it was
(an eval read keeps no scratch rows).

Usage:
    python benchmarks/eval_read.py [--vocab 1000000] [--dim 64] [--ids 4096] [--repeats 30]
        [--train-steps 60] [--distributions 1.1 uniform] [--caches 0.01 0.05 0.2] [--threads 1]
    python benchmarks/eval_read.py --quick    # tiny sizes, a smoke run of a few seconds

Writes benchmarks/results/eval_read-{cpu,gpu}.json (eval_read-quick-* with --quick), or into --out.
"""

import argparse
import os
import time

import cache
import common
import numpy as np
import torch

import speedswap as ss
from speedswap.apps.arguments import nonnegative_int, positive_float, seed, share

QUICK = {"vocab": 20_000, "dim": 16, "ids": 512, "repeats": 5, "train_steps": 5, "warmup": 2}
TRAIN_IDS = cache.PAIRS * (2 + cache.NEGS)  # ids a training step of cache.py looks up


def distribution(text):
    """argparse ``type=`` for an id distribution: ``uniform``, or a Zipf exponent (a number > 0)."""
    if text == "uniform":
        return text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'uniform' nor a Zipf exponent > 0") from None


def measure(distribution, fractions, args):
    """Train, then time eval forwards on every cache size of one id distribution; returns their rows.

    Args:
        distribution: a Zipf exponent, or ``"uniform"``.
        fractions: cache sizes as shares of the rows, 0 (no cache) among them.
        args: the parsed options (sizes, repeats, seed).

    Returns:
        one dict per cache size: timings, eval counters per forward, ``cache_bytes`` around a wide forward.
    """
    rng = np.random.default_rng(args.seed)
    sample, rank = cache.id_sampler(distribution, rng, args.vocab)
    setups = []
    for fraction in fractions:
        emb = ss.OffloadedEmbedding(args.vocab, args.dim, max_rows=TRAIN_IDS, storage="pageable",
                                    backend="numpy", cache_rows=int(fraction * args.vocab))
        opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
        emb.attach(opt)
        setups.append((fraction, emb, opt))
    # Every cache size trains on the same batches and is timed on the same eval ids.
    for batch in [cache.make_batch(sample) for _ in range(args.train_steps)]:
        for _, emb, opt in setups:
            cache.step(emb, opt, batch)
    # Then on until its cache is full: 60 steps left a 20% cache of Zipf 1.1 ids still filling, holding every
    # row it had met rather than the rows its policy keeps.
    trained, filling = {}, {}
    for fraction, emb, opt in setups:
        trained[fraction] = args.train_steps + cache.fill(emb, opt, lambda: cache.make_batch(sample),
                                                          10 * args.train_steps)
        last = emb.stats()["last_step"]
        filling[fraction] = bool(emb.cache_rows and last["bytes_d2h"] < last["bytes_h2d"])
    batches = [torch.from_numpy(sample(args.ids)) for _ in range(args.warmup + args.repeats)]
    for _, emb, _ in setups:
        emb.eval()
    label = distribution if distribution == "uniform" else f"zipf {distribution}"
    with torch.no_grad():  # from here on, forwards as an evaluation loop makes them
        rows = [{"distribution": label, "train_steps": trained[row["cache_fraction"]],
                 "filling": filling[row["cache_fraction"]], **row}
                for row in evaluate(setups, batches, sample, rank, args)]
    for _, emb, _ in setups:
        emb.close()
    annotate(rows)
    return rows


def evaluate(setups, batches, sample, rank, args):
    """Time eval forwards of ``batches`` (the first ``args.warmup`` untimed) on every setup, then one wide one.

    Returns:
        one dict per setup, as :func:`measure` returns them but for their distribution.
    """
    for ids in batches[:args.warmup]:
        for _, emb, _ in setups:
            emb(ids)
    before = {fraction: emb.stats()["eval"] for fraction, emb, _ in setups}
    times = {fraction: [] for fraction, _, _ in setups}
    loads = []
    for i, ids in enumerate(batches[args.warmup:]):
        loads.append(os.getloadavg()[0])
        for fraction, emb, _ in setups[i % len(setups):] + setups[:i % len(setups)]:  # rotating order
            start = time.perf_counter()
            emb(ids)
            times[fraction].append(time.perf_counter() - start)
    timed = torch.cat(batches[args.warmup:]).numpy()
    wide = torch.from_numpy(sample(10 * TRAIN_IDS))
    rows = []
    for fraction, emb, _ in setups:
        after = emb.stats()["eval"]
        delta = {key: after[key] - before[fraction][key] for key in after}
        held = emb.stats()["cache_bytes"]
        emb(wide)
        t = np.array(times[fraction])
        rows.append({
            "cache_fraction": fraction, "cache_rows": emb.cache_rows,
            "forwards": delta["forwards"], "ids_per_forward": delta["lookups"] / delta["forwards"],
            "hit_rate": delta["hits"] / delta["lookups"],
            # What a cache holding the truly most probable rows would serve of the same ids.
            "ideal_hit_rate": None if rank is None else float((rank[timed] < emb.cache_rows).mean()),
            "rows_h2d_per_forward": delta["rows_h2d"] / delta["forwards"],
            "bytes_h2d_per_forward": delta["bytes_h2d"] / delta["forwards"],
            "forward_s_median": float(np.median(t)), "forward_s_p25": float(np.percentile(t, 25)),
            "forward_s_p75": float(np.percentile(t, 75)), "forward_s_min": float(t.min()),
            "forward_s_max": float(t.max()),
            "wide_forward_ids": len(wide), "cache_bytes_before_wide_forward": held,
            "cache_bytes_after_wide_forward": emb.stats()["cache_bytes"],
            "loadavg_1min": [round(x, 2) for x in loads],
        })
    return rows


def annotate(rows):
    """Ratios to the no-cache run of the same distribution, and whether the timing gap is noise."""
    base = next(r for r in rows if r["cache_fraction"] == 0.0)
    for row in rows:
        row["time_vs_no_cache"] = row["forward_s_median"] / base["forward_s_median"]
        row["rows_h2d_vs_no_cache"] = row["rows_h2d_per_forward"] / base["rows_h2d_per_forward"]
        row["bytes_h2d_vs_no_cache"] = row["bytes_h2d_per_forward"] / base["bytes_h2d_per_forward"]
        # Interquartile ranges that overlap: the difference is within the noise of a loaded machine.
        row["time_difference_is_noise"] = bool(row["forward_s_p25"] <= base["forward_s_p75"]
                                               and base["forward_s_p25"] <= row["forward_s_p75"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab", type=common.positive_int, default=1_000_000, help="table rows")
    parser.add_argument("--dim", type=common.positive_int, default=64, help="embedding length")
    parser.add_argument("--ids", type=common.positive_int, default=4096, help="ids per timed eval forward")
    parser.add_argument("--repeats", type=common.positive_int, default=30,
                        help="timed eval forwards per cache size, each of fresh ids")
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="eval forwards per cache size before timing")
    parser.add_argument("--train-steps", type=nonnegative_int, default=60,
                        help=f"training steps first ({TRAIN_IDS} ids each, cache.py's), the same for every cache size; "
                             "then each trains on until its cache is full, at most 10x as many more steps")
    parser.add_argument("--distributions", nargs="+", type=distribution, default=[1.1, "uniform"],
                        help="id distributions: Zipf exponents, or 'uniform'")
    parser.add_argument("--caches", nargs="+", type=share, default=[0.01, 0.05, 0.2],
                        help="cache sizes as shares of the rows (no cache is always run too: "
                             "the ratios are against it)")
    parser.add_argument("--threads", type=common.positive_int, default=1, help="torch's intra-op threads")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few repeats (a smoke run of a few seconds): " + str(QUICK))
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    fractions = sorted({0.0, *args.caches})
    started = os.getloadavg()
    rows = []
    for exponent in args.distributions:
        rows += measure(exponent, fractions, args)
    common.print_table([{"ids": r["distribution"], "cache": f"{100 * r['cache_fraction']:g}%",
                         "hit rate": r["hit_rate"], "ideal": r["ideal_hit_rate"], "rows h2d": r["rows_h2d_per_forward"],
                         "rows x": r["rows_h2d_vs_no_cache"], "median us": r["forward_s_median"] * 1e6,
                         "p25 us": r["forward_s_p25"] * 1e6, "p75 us": r["forward_s_p75"] * 1e6,
                         "time x": r["time_vs_no_cache"], "noise": r["time_difference_is_noise"],
                         "cache bytes kept": r["cache_bytes_before_wide_forward"]
                         == r["cache_bytes_after_wide_forward"]} for r in rows],
                       ["ids", "cache", "hit rate", "ideal", "rows h2d", "rows x", "median us", "p25 us", "p75 us",
                        "time x", "noise", "cache bytes kept"])
    payload = {"vocab": args.vocab, "dim": args.dim, "ids": args.ids, "optimizer": "Adam", "backend": "numpy",
               "mode": "eval() under no_grad", "train_steps": args.train_steps, "train_ids_per_step": TRAIN_IDS,
               "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads, "seed": args.seed,
               "quick": args.quick, "loadavg_start": started, "loadavg_end": os.getloadavg(), "rows": rows}
    common.write_results("eval_read" + ("-quick" if args.quick else ""), payload, args.out)
    return payload


if __name__ == "__main__":
    main()
