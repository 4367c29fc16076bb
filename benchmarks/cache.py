"""The device cache of hot rows: hit rate, bytes moved per step and step time vs cache size.

Skip-gram with Adam on one tied OffloadedEmbedding (vocabulary 1M, dim 128):
4096 (center, context) pairs and 5 negatives per pair a step, ids Zipf with
exponents 1.05, 1.1, 1.2 (popular rows scattered over the table) and one
uniform case; caches of 0, 1, 5 and 20% of the rows. Per distribution the
four embeddings are built, warmed up (the cache fills), then timed in
interleaved rounds so load from other processes hits every size alike. Each
figure carries ``os.getloadavg()`` from when it was measured.

Hit rate is per unique row of a step (what decides the bytes): hits /
unique rows. Bytes count rows and their Adam state, both directions. The
"floor" is the ratio a cache that always held the truly most probable rows
would reach (see ``static_misses``).

With ``--prefetch`` each step also prefetches the next step's rows, which
trades bytes for a step that finds every row it can in the cache. With
``--fused`` Adam is built ``fused=True`` (one kernel for its whole update):
the same rows trained, bit for bit, in less time (NOTES 76).

Usage:
    python benchmarks/cache.py [--steps 20] [--warmup 100] [--ids 1.1 uniform] [--caches 0.05]
        [--threads 1] [--prefetch] [--fused] [--keep-freed-memory]

Writes benchmarks/results/cache[-prefetch][-fused][-subset]-{cpu,gpu}.json and a PNG plot beside
it ("-subset" when ``--ids`` or ``--caches`` leave part of the sweep out).
"""

import argparse
import os
import time

import common
import numpy as np
import torch
import torch.nn.functional as F

import speedswap as ss
from speedswap.atomic import atomic_output

VOCAB, DIM, PAIRS, NEGS = 1_000_000, 128, 4096, 5
CACHE_FRACTIONS = [0.0, 0.01, 0.05, 0.20]
DISTRIBUTIONS = [1.05, 1.1, 1.2, "uniform"]


def id_sampler(exponent, rng, vocab=VOCAB):
    """(draw, rank): ``draw(n)`` gives n ids, Zipf over ranks 0..vocab-1 scattered over rows
    (or uniform); ``rank[row]`` is the row's popularity rank (None when uniform)."""
    if exponent == "uniform":
        return (lambda n: rng.integers(0, vocab, n)), None
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    row_of_rank = rng.permutation(vocab)
    rank = np.empty(vocab, dtype=np.int64)
    rank[row_of_rank] = np.arange(vocab)
    return (lambda n: row_of_rank[np.minimum(np.searchsorted(cdf, rng.random(n)), vocab - 1)]), rank


def static_misses(rank, batches, cache_rows):
    """Per step, the unique rows outside the ``cache_rows`` most probable ones: a floor.

    A cache that always held the truly most frequent rows would miss exactly
    these. Once a cache is full every row it takes in pushes one out, so for
    independent draws ``misses / unique`` is about the least
    ``bytes_vs_no_cache`` a policy that knows only the past can keep up (a
    cache still filling moves less: its new rows push nothing out).
    """
    return [int((rank[torch.unique(torch.cat([ids.reshape(-1) for ids in batch])).numpy()]
                 >= cache_rows).sum()) for batch in batches]


def make_batch(sample):
    ids = torch.from_numpy(sample(PAIRS * (2 + NEGS)))
    return ids[:PAIRS], ids[PAIRS:2 * PAIRS], ids[2 * PAIRS:].view(PAIRS, NEGS)


def step(emb, opt, batch, following=None):
    """One skip-gram step; with ``following``, the next batch's rows are prefetched during it."""
    center, context, negatives = (emb(ids) for ids in batch)
    if following is not None:
        emb.prefetch(torch.cat([ids.reshape(-1) for ids in following]))
    pos = (center * context).sum(-1)
    neg = (negatives * center.unsqueeze(1)).sum(-1)
    (-(F.logsigmoid(pos).sum() + F.logsigmoid(-neg).sum())).backward()
    opt.step()
    opt.zero_grad()


def fill(emb, opt, batch, most):
    """Step ``emb`` on fresh ``batch()``es until its cache is full, at most ``most`` steps; returns how many.

    A cache is full once a step writes back as many bytes as it reads: each
    row taken in then pushes one out (or goes back itself). Before, rows
    taken into free slots push nothing out, and a step moves less than a full
    cache can keep up: a 20% cache of Zipf 1.2 ids took 88 of its 1,000
    misses a step out after 100 steps, and measured 0.10x the no-cache bytes
    against a floor of 0.12x.
    """
    for done in range(most + 1):
        last = emb.stats()["last_step"]
        if not emb.cache_rows or last["bytes_d2h"] >= last["bytes_h2d"]:
            return done
        if done < most:
            step(emb, opt, batch())
    return most


def measure(exponent, fractions, steps, warmup, seed, prefetch=False, fused=False):
    """Warm up and time the cache sizes ``fractions`` on one id distribution; returns their rows.

    With ``prefetch`` every step prefetches the next one's rows (the no-cache run cannot); with
    ``fused`` Adam is built ``fused=True``.
    """
    rng = np.random.default_rng(seed)
    sample, rank = id_sampler(exponent, rng)
    setups = []
    for fraction in fractions:
        emb = ss.OffloadedEmbedding(VOCAB, DIM, max_rows=PAIRS * (2 + NEGS), storage="pageable",
                                    backend="numpy", cache_rows=int(fraction * VOCAB))
        opt = torch.optim.Adam(emb.parameters(), lr=1e-3, fused=fused or None)
        emb.attach(opt)
        setups.append((fraction, emb, opt))
    batches = [make_batch(sample) for _ in range(warmup + steps + 1)]

    def following(i, emb):
        return batches[i + 1] if prefetch and emb.cache_rows else None

    warmed = {}
    for fraction, emb, opt in setups:
        for i in range(warmup):
            step(emb, opt, batches[i], following(i, emb))
        warmed[fraction] = warmup + fill(emb, opt, lambda: make_batch(sample), 10 * warmup)
    times = {fraction: [] for fraction in fractions}
    before = {fraction: emb.stats()["total"] for fraction, emb, _ in setups}
    loads = []
    for i in range(warmup, warmup + steps):
        # One step of each size per round, in a rotating order.
        order = setups[len(loads) % len(setups):] + setups[:len(loads) % len(setups)]
        loads.append(os.getloadavg()[0])
        for fraction, emb, opt in order:
            start = time.perf_counter()
            step(emb, opt, batches[i], following(i, emb))
            times[fraction].append(time.perf_counter() - start)
    rows = []
    for fraction, emb, _ in setups:
        floor = (None if rank is None or not fraction else
                 sum(static_misses(rank, batches[warmup:warmup + steps], emb.cache_rows)))
        after = emb.stats()["total"]
        delta = {k: after[k] - before[fraction][k] for k in after}
        t = np.array(times[fraction])
        rows.append({
            "distribution": exponent if exponent == "uniform" else f"zipf {exponent}",
            "cache_fraction": fraction, "cache_rows": emb.cache_rows,
            "cache_bytes": emb.stats()["cache_bytes"],
            "hit_rate": delta["hits"] / max(delta["unique_rows"], 1),
            "unique_rows_per_step": delta["unique_rows"] / steps,
            "bytes_h2d_per_step": delta["bytes_h2d"] / steps,
            "bytes_d2h_per_step": delta["bytes_d2h"] / steps,
            "evictions_per_step": delta["evictions"] / steps,
            "warmup_steps": warmed[fraction],
            # Still taking rows into free slots while timed (fill's cap reached): bytes below what it keeps up.
            "filling": bool(delta["bytes_d2h"] < delta["bytes_h2d"]),
            "floor_bytes_vs_no_cache": None if floor is None else floor / delta["unique_rows"],
            "step_s_median": float(np.median(t)),
            "step_s_p25": float(np.percentile(t, 25)), "step_s_p75": float(np.percentile(t, 75)),
            "loadavg_1min": [round(x, 2) for x in loads],
        })
    for _, emb, _ in setups:
        emb.close()
    return rows


def annotate(rows):
    """Ratios to the no-cache run of the same distribution, and whether a timing gap is noise."""
    for row in rows:
        base = next(r for r in rows if r["distribution"] == row["distribution"]
                    and r["cache_fraction"] == 0.0)
        moved = row["bytes_h2d_per_step"] + row["bytes_d2h_per_step"]
        row["bytes_vs_no_cache"] = moved / (base["bytes_h2d_per_step"] + base["bytes_d2h_per_step"])
        row["step_vs_no_cache"] = row["step_s_median"] / base["step_s_median"]
        # Interquartile ranges that overlap: the difference is within the noise of a loaded machine.
        row["step_difference_is_noise"] = bool(row["step_s_p25"] <= base["step_s_p75"]
                                               and base["step_s_p25"] <= row["step_s_p75"])


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (hit_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for dist in dict.fromkeys(r["distribution"] for r in rows):
        mine = [r for r in rows if r["distribution"] == dist]
        x = [100 * r["cache_fraction"] for r in mine]
        hit_ax.plot(x, [r["hit_rate"] for r in mine], marker="o", label=dist)
        med = np.array([r["step_s_median"] for r in mine]) * 1e3
        err = [med - np.array([r["step_s_p25"] for r in mine]) * 1e3,
               np.array([r["step_s_p75"] for r in mine]) * 1e3 - med]
        time_ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=dist)
    hit_ax.set(xlabel="cache (% of rows)", ylabel="hit rate (per unique row)", ylim=(0, 1))
    time_ax.set(xlabel="cache (% of rows)", ylabel="step time, ms (median, p25-p75)")
    loads = [x for r in rows for x in r["loadavg_1min"]]
    fig.suptitle(f"skip-gram + Adam, 1M x 128, CPU; load average {min(loads):.1f}-{max(loads):.1f}")
    hit_ax.legend()
    fig.tight_layout()
    with atomic_output(path) as tmp:  # a stopped run keeps the previous plot whole
        fig.savefig(tmp, dpi=100, format="png")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=common.positive_int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=100,
                        help="steps before timing (the cache's counts settle); then more, up to 10x as "
                             "many, until the cache is full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ids", nargs="+", default=[str(d) for d in DISTRIBUTIONS],
                        choices=[str(d) for d in DISTRIBUTIONS], help="id distributions to run")
    parser.add_argument("--caches", nargs="+", type=float, default=CACHE_FRACTIONS[1:],
                        help="cache sizes as fractions of the rows (no cache is always run too: "
                             "the ratios are against it)")
    parser.add_argument("--threads", type=common.positive_int, default=torch.get_num_threads(),
                        help="torch's intra-op threads")
    parser.add_argument("--prefetch", action="store_true",
                        help="prefetch each next step's rows (results in cache-prefetch-*.json)")
    parser.add_argument("--fused", action="store_true",
                        help="build Adam with fused=True (results in cache[-prefetch]-fused-*.json)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="ss.keep_freed_memory() first: otherwise glibc's page faults are part of "
                             "every step's time (NOTES 31, 41)")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    kept = args.keep_freed_memory and ss.keep_freed_memory()
    fractions = sorted({0.0, *args.caches})
    started = os.getloadavg()
    rows = []
    for exponent in [d for d in DISTRIBUTIONS if str(d) in args.ids]:
        rows += measure(exponent, fractions, args.steps, args.warmup, args.seed, args.prefetch, args.fused)
        print(f"{exponent}: done, load {os.getloadavg()[0]:.1f}", flush=True)
    annotate(rows)
    print(f"{'ids':>10} {'cache':>6} {'hit':>6} {'MB h2d':>8} {'MB d2h':>8} {'bytes x':>8} "
          f"{'floor x':>8} {'step ms':>8} {'x':>6} {'noise':>6} {'load':>6}")
    for r in rows:
        floor = r["floor_bytes_vs_no_cache"]
        print(f"{r['distribution']:>10} {100 * r['cache_fraction']:5.0f}% {r['hit_rate']:6.2f} "
              f"{r['bytes_h2d_per_step'] / 1e6:8.2f} {r['bytes_d2h_per_step'] / 1e6:8.2f} "
              f"{r['bytes_vs_no_cache']:8.2f} {'-' if floor is None else f'{floor:.2f}':>8} "
              f"{r['step_s_median'] * 1e3:8.1f} "
              f"{r['step_vs_no_cache']:6.2f} {str(r['step_difference_is_noise']):>6} "
              f"{np.mean(r['loadavg_1min']):6.1f}" + ("  (cache still filling)" if r["filling"] else ""))
    payload = {"policy": "frequency sketch with admission", "vocab": VOCAB, "dim": DIM, "pairs": PAIRS,
               "negatives": NEGS,
               "optimizer": "Adam (fused=True)" if args.fused else "Adam", "backend": "numpy",
               "steps": args.steps, "prefetch": args.prefetch,
               "threads": args.threads, "keep_freed_memory": kept,
               "warmup": args.warmup, "loadavg_start": started, "loadavg_end": os.getloadavg(),
               "cpu_count": os.cpu_count(), "rows": rows}
    # A subset of the sweep gets a name of its own: it must not replace the whole sweep's results.
    whole = fractions == sorted({0.0, *CACHE_FRACTIONS}) and set(args.ids) == {str(d) for d in DISTRIBUTIONS}
    name = ("cache" + ("-prefetch" if args.prefetch else "") + ("-fused" if args.fused else "")
            + ("" if whole else "-subset"))
    path = common.write_results(name, payload, args.out)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.png')}")
    return payload


if __name__ == "__main__":
    main()
