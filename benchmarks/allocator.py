"""The CPU's memory allocator under a training step: glibc's default against settings that keep freed memory.

On a CPU, a training step of ``OffloadedEmbedding`` allocates and frees
tensors of several MiB: each lookup's backward makes a zeroed gradient of the
whole working set (``max_rows`` x dim), and Adam, the gathers and the loss
make their temporaries. glibc's malloc hands such blocks back to the kernel
when they are freed (its heap is trimmed, or they were mapped on their own),
so the next step takes a page fault on every 4 KiB of them again. This script
measures what that costs: the skip-gram step of ``training_step.py`` (4096
pairs x 5 negatives, dim 128, Adam, vocabulary 1M, Zipf ids) run in a child
process per allocator setting, in interleaved rounds so the machine's load
falls on every setting alike:

* ``glibc``: the default;
* ``glibc-keep``: ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` set
  so freed blocks stay with the process;
* ``keep_freed_memory()``: the same settings made from inside the process by
  :func:`speedswap.keep_freed_memory`, before the step is built;
* ``jemalloc`` / ``tcmalloc``: the library preloaded (``LD_PRELOAD``), where
  the machine has it (Debian: ``libjemalloc2``, ``libtcmalloc-minimal4``).

Each setting runs the offloaded step, the cached one (5% of rows) and the
in-memory reference (``nn.Embedding(sparse=True)`` + ``SparseAdam``).

Usage:
    python benchmarks/allocator.py [--rounds 3] [--repeats 30] [--threads 1]

Writes benchmarks/results/allocator-cpu.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
import torch

import speedswap as ss
from speedswap.apps.bench import training_step

VOCAB = 1_000_000
SETUPS = ("offloaded", "cached", "in_memory")
KEEP = {"MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
#: The setting made by a call in the child, not by its environment.
HELPER = "keep_freed_memory()"
PRELOADS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def settings():
    """``{name: extra environment}`` for every allocator setting this machine can run."""
    found = {"glibc": {}, "glibc-keep": dict(KEEP), HELPER: {}}
    for name, library in PRELOADS.items():
        path = next((Path(d) / library for d in LIBRARY_DIRS if (Path(d) / library).exists()), None)
        if path is not None:
            found[name] = {"LD_PRELOAD": str(path)}
    return found


def child(setup, repeats, threads, keep_freed):
    """Time ``repeats`` steps of ``setup`` in this process; print their seconds as JSON."""
    if keep_freed and not ss.keep_freed_memory():
        raise SystemExit("keep_freed_memory() found no glibc to set")
    torch.set_num_threads(threads)
    device, shape = torch.device("cpu"), training_step.StepShape()
    batches = training_step.zipf_batches(VOCAB, 64, device, shape)
    step, _ = training_step._step_fn(training_step._BUILDS[setup], VOCAB, batches, device, shape)
    for _ in range(10):  # warm-up: the allocator reaches its steady state
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def run_child(setup, name, env, repeats, threads):
    helper = ["--keep-freed"] if name == HELPER else []
    out = subprocess.run([sys.executable, __file__, "--child", setup, "--repeats", str(repeats),
                          "--threads", str(threads), *helper], env={**os.environ, **env},
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--rounds", type=common.positive_int, default=3, help="interleaved rounds per setting")
    parser.add_argument("--repeats", type=common.positive_int, default=30, help="timed steps per child")
    parser.add_argument("--threads", type=common.positive_int, default=1, help="torch's intra-op threads")
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--keep-freed", action="store_true", help=argparse.SUPPRESS)
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.repeats, args.threads, args.keep_freed)
    variants = settings()
    samples = {(name, setup): [] for name in variants for setup in SETUPS}
    loads = []
    for round_ in range(args.rounds):
        names = list(variants)
        names = names[round_ % len(names):] + names[:round_ % len(names)]  # rotate the order
        for name in names:
            for setup in SETUPS:
                loads.append(os.getloadavg()[0])
                samples[name, setup] += run_child(setup, name, variants[name], args.repeats, args.threads)
                print(f"round {round_ + 1} {name:11} {setup:10} "
                      f"{1e3 * statistics.median(samples[name, setup]):7.2f} ms", flush=True)
    rows = []
    for setup in SETUPS:
        base = statistics.median(samples["glibc", setup])
        for name in variants:
            median = statistics.median(samples[name, setup])
            rows.append({"setup": setup, "allocator": name, "environment": variants[name],
                         "median_ms": 1e3 * median, "vs_glibc": median / base,
                         "steps": len(samples[name, setup])})
    common.print_table(rows, ["setup", "allocator", "median_ms", "vs_glibc", "steps"])
    print(f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}")
    common.write_results("allocator", out=args.out, payload={
        "setup": {"vocab": VOCAB, "step": "skip-gram, 4096 pairs x 5 negatives, dim 128, Adam, Zipf ids",
                  "threads": args.threads, "rounds": args.rounds, "repeats": args.repeats},
        "results": rows, "loadavg_1min": [round(x, 2) for x in loads]})


if __name__ == "__main__":
    main()
