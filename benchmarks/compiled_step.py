"""Whether a compiled optimizer step over the whole working set beats the eager step over the step's rows.

``torch.compile(optimizer.step)`` with an offloaded embedding attached
compiles again at every step (``benchmarks/NOTES.md``, entry 74): the step
hands the optimizer new ``(k, dim)`` views of its rows each time, and
dynamo guards a compiled optimizer's state by identity. The one way out is
to step the same full-size tensors every time, all ``max_rows`` slots of
the working set, the slots past the step's ``k`` rows on a zero gradient.
That multiplies the optimizer's arithmetic by ``max_rows / k``; this script
measures whether compilation wins it back, on the optimizer's work alone
(plain torch, no speedswap), in interleaved rounds:

* ``narrowed eager``: what the offloaded step does now: each step, the
  parameter and its state are fresh ``(k, dim)`` views of full-size buffers;
* ``narrowed fused``: the same with the optimizer built ``fused=True``
  (one kernel for the whole update, on the CPU too), which needs no compile;
* ``whole eager``: the full ``(max_rows, dim)`` tensors, uncompiled;
* ``whole compiled``: the same, with ``torch.compile(optimizer.step)``
  (inductor; on a GPU, without CUDA graphs).

``k`` is a step's unique rows in ``benchmarks/cache.py``'s skip-gram
(4096 pairs x 7 ids, ``max_rows`` 28,672): 8,819 at Zipf 1.1 and 28,270 at
uniform ids (entry 74's counts, medians of 5 batches).

Usage:
    python benchmarks/compiled_step.py [--repeats 30] [--dim 128] [--threads 1]

Writes benchmarks/results/compiled_step-<cpu|gpu>.json.
"""

import argparse
import os
import time

import common
import torch

import speedswap as ss
from speedswap.apps.bench.timing import time_interleaved

MAX_ROWS = 28_672
#: The step's unique rows in benchmarks/cache.py's workload (entry 74).
ROWS = {"zipf 1.1": 8_819, "uniform": 28_270}
OPTIMIZERS = {
    "Adam": lambda params, fused: torch.optim.Adam(params, lr=1e-3, fused=fused),
    "Adagrad": lambda params, fused: torch.optim.Adagrad(params, lr=1e-2, fused=fused),
    "SGD momentum": lambda params, fused: torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=fused),
}


def narrowed_step(make, weight, grad, k, fused):
    """One eager step of fresh ``(k, dim)`` views, as the offloaded step narrows its parameter each step."""
    param = torch.nn.Parameter(weight[:k])
    optimizer = make([param], fused)
    full_state = {}

    def step():
        param.data = weight[:k]
        param.grad = grad[:k]
        state = optimizer.state[param]
        for name, value in full_state.items():
            state[name] = value if value.dim() == 0 else value[:k]
        optimizer.step()
        for name, value in state.items():  # the first step made the state: keep it full-size
            if name not in full_state:
                full_state[name] = value if value.dim() == 0 else _full_like(value, weight)
    return step


def _full_like(rows, weight):
    full = torch.zeros_like(weight)
    full[:len(rows)] = rows
    return full


def whole_step(make, weight, grad, compiled):
    """One step of the full ``(max_rows, dim)`` tensors; ``compiled`` wraps it in ``torch.compile``."""
    param = torch.nn.Parameter(weight)
    param.grad = grad
    optimizer = make([param], None)
    return torch.compile(optimizer.step) if compiled else optimizer.step


def measure(name, k, dim, device, repeats):
    """Medians of the three contenders for optimizer ``name`` at ``k`` rows, and the compile's seconds."""
    make = OPTIMIZERS[name]
    generator = torch.Generator(device=device).manual_seed(0)

    def buffers():
        weight = torch.randn(MAX_ROWS, dim, device=device, generator=generator)
        grad = torch.zeros(MAX_ROWS, dim, device=device)
        grad[:k] = torch.randn(k, dim, device=device, generator=generator)
        return weight, grad

    contenders = {"narrowed eager": narrowed_step(make, *buffers(), k, fused=None),
                  "narrowed fused": narrowed_step(make, *buffers(), k, fused=True),
                  "whole eager": whole_step(make, *buffers(), compiled=False),
                  "whole compiled": whole_step(make, *buffers(), compiled=True)}
    start = time.perf_counter()
    contenders["whole compiled"]()  # the compilation, timed on its own
    compile_s = time.perf_counter() - start
    timings = time_interleaved(contenders, repeats=repeats, warmup=3, cuda=device.type == "cuda")
    medians = {c: t["median_s"] for c, t in timings.items()}
    return {"optimizer": name, "rows": k, "max_rows": MAX_ROWS, "dim": dim, "compile_s": compile_s,
            **{f"{c} ms": medians[c] * 1e3 for c in contenders},
            "compiled / narrowed": medians["whole compiled"] / medians["narrowed eager"],
            "fused / narrowed": medians["narrowed fused"] / medians["narrowed eager"],
            "timings": timings}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=common.positive_int, default=30, help="interleaved rounds timed")
    parser.add_argument("--dim", type=common.positive_int, default=128, help="row length")
    parser.add_argument("--threads", type=common.positive_int, default=1, help="torch threads (CPU)")
    common.add_out_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # glibc otherwise hands the steps' freed temporaries back to the kernel until its dynamic
    # thresholds adapt, and the page faults fall on whichever contender runs first (NOTES 31).
    kept = ss.keep_freed_memory()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load_before = os.getloadavg()
    rows = [measure(name, k, args.dim, device, args.repeats)
            for name in OPTIMIZERS for k in ROWS.values()]
    columns = ["optimizer", "rows", "compile_s", "narrowed eager ms", "narrowed fused ms", "whole eager ms",
               "whole compiled ms", "compiled / narrowed", "fused / narrowed"]
    common.print_table(rows, columns)
    common.write_results("compiled_step", {"device": str(device), "threads": args.threads,
                                           "keep_freed_memory": kept,
                                           "repeats": args.repeats, "row_counts": ROWS,
                                           "loadavg_start": load_before, "loadavg_end": os.getloadavg(),
                                           "rows": rows}, args.out)


if __name__ == "__main__":
    main()
