"""Where a training step's time goes, and where it makes the host wait: the profile behind NOTES 33.

The skip-gram step of ``training_step.py`` (4096 pairs x 5 negatives, dim
128, Adam, Zipf ids) in each setup, offloaded, cached (5% of the rows, next
step prefetched), in memory, each of those three with each step's ids
looked up in one call, and offloaded with its table in GPU memory (on the
CPU: the offloaded setup again), after warm-up:

* **host waits** (CUDA only): ``torch.cuda.set_sync_debug_mode("warn")`` over
  a few steps; each warning is counted by the innermost line of speedswap's
  own code on the stack when it was raised (or the benchmark's, for the
  in-memory setup), per step;
* **ops**: ``torch.profiler`` over the same number of steps, the ops with the
  most self time (device time on a GPU, CPU time on a CPU), and on a GPU the
  kernels' busy time against the step's wall time (a step that leaves the GPU
  idle most of its time is bound by the host: launches and waits);
* **host time** by speedswap function: ``cProfile`` over the same number of
  steps, the functions of speedswap with the most cumulative time a step
  (the torch ops they call and the host waits inside those count in them),
  and the Python calls a step: where a host-bound step's time goes, which
  the op table (time inside ops only) does not say.

Usage:
    python benchmarks/profile_step.py [--vocab 1000000] [--steps 10] [--out DIR]

Writes ``profile_step-{cpu,gpu}.json`` (into benchmarks/results/, or DIR) and
prints the tables. On a lent GPU machine, after ``bench --all``:
``python3 benchmarks/profile_step.py --out "$OUT"``.
"""

import argparse
import collections
import cProfile
import functools
import os
import pstats
import time
import traceback
import warnings

import common
import torch
from torch.profiler import ProfilerActivity, profile

from speedswap.apps.bench import training_step
from speedswap.apps.bench.timing import write_json

PACKAGE = os.path.dirname(training_step.ss.__file__) + os.sep
HERE = os.path.abspath(__file__)
TOP_OPS = 25
TOP_FUNCTIONS = 20


def _line(filename, lineno, function):
    """``speedswap/file.py:line (function)``."""
    return f"{os.path.relpath(filename, os.path.dirname(PACKAGE.rstrip(os.sep)))}:{lineno} ({function})"


def _where(stack):
    """``file:line (function)`` of the innermost frame of speedswap's code (or this script's)."""
    for frame in reversed(stack):
        if frame.filename.startswith(PACKAGE) or frame.filename == HERE:
            return _line(frame.filename, frame.lineno, frame.name)
    return "outside speedswap"


def host_waits(step, steps):
    """``{line: waits per step}`` of the CUDA synchronisations ``steps`` calls of ``step`` make."""
    found = collections.Counter()

    def capture(message, category, filename, lineno, file=None, line=None):
        # torch's text for a wait, not its one-off notice that the mode is a prototype (which counted
        # as 0.1 waits a step at this function's own set_sync_debug_mode line on an H200).
        if str(message).startswith("called a synchronizing CUDA operation"):  # then "(Triggered internally at"
            found[_where(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = capture
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {where: count / steps for where, count in found.most_common()}


def host_time(step, steps, cuda):
    """speedswap's functions with the most cumulative host time over ``steps`` steps (cProfile), per step.

    cProfile slows every Python call a little, so the times are larger than
    unprofiled ones; their shares say where a host-bound step spends itself.
    """
    profiler = cProfile.Profile()
    if cuda:
        torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, function): (primitive calls, calls, self s, cum s, callers)}
    rows = [{"function": _line(*where), "calls_per_step": calls / steps, "cum_ms_per_step": 1e3 * cum / steps,
             "self_ms_per_step": 1e3 * own / steps}
            for where, (_, calls, own, cum, _) in stats.items() if where[0].startswith(PACKAGE)]
    rows.sort(key=lambda row: row["cum_ms_per_step"], reverse=True)
    return {"python_calls_per_step": sum(entry[1] for entry in stats.values()) / steps,
            "functions": rows[:TOP_FUNCTIONS]}


def op_profile(step, steps, cuda):
    """The ops with the most self time over ``steps`` steps, and the step's wall and busy time (ms)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - began) / steps
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP_OPS]
    rows = [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": getattr(e, key) / 1e3 / steps,
             "cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in ops]
    result = {"wall_ms_per_step": 1e3 * wall, "top_ops_by": key, "ops": rows}
    if cuda:
        # Kernel time only (no memcpy/memset rows counted twice): what the GPU itself was busy with.
        busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        result["device_busy_ms_per_step"] = busy / 1e3 / steps
        result["device_busy_share"] = result["device_busy_ms_per_step"] / result["wall_ms_per_step"]
    return result


#: The benchmark's setups, and the offloaded one with its table in GPU memory: its time
#: against ``offloaded``'s splits the gap to ``in_memory`` into transport and bookkeeping.
SETUPS = {**training_step._setups(),
          "offloaded_on_device": (functools.partial(training_step.build_offloaded, gpu_storage="device"),
                                  training_step.skipgram_loss, False)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab", type=common.positive_int, default=1_000_000, help="table rows")
    parser.add_argument("--steps", type=common.positive_int, default=10, help="steps profiled (and counted for waits)")
    parser.add_argument("--batch", type=common.positive_int, default=training_step.StepShape.batch, help="pairs per step")
    parser.add_argument("--dim", type=common.positive_int, default=training_step.StepShape.dim)
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = training_step.StepShape(batch=args.batch, dim=args.dim)
    batches = training_step.zipf_batches(args.vocab, 16, device, shape)
    setups = {}
    for name, (build, loss, prefetch) in SETUPS.items():
        step, _ = training_step._step_fn(build, args.vocab, batches, device, shape, loss, prefetch)
        for _ in range(3):  # warm-up past the first steps' allocations
            step()
        waits = host_waits(step, args.steps) if cuda else "not counted: no CUDA device"
        setups[name] = {"host_waits_per_step": waits, **op_profile(step, args.steps, cuda),
                        "host_time": host_time(step, args.steps, cuda)}
        del step
        if cuda:
            torch.cuda.empty_cache()
    for name, result in setups.items():
        busy = (f", device busy {result['device_busy_ms_per_step']:.2f} ms "
                f"({result['device_busy_share']:.0%})" if cuda else "")
        print(f"\n== {name}: {result['wall_ms_per_step']:.2f} ms a step{busy}")
        waits = result["host_waits_per_step"]
        if isinstance(waits, dict):
            print("host waits per step: " + (", ".join(f"{w:g} at {where}" for where, w in waits.items()) or "none"))
        print(common.format_table(result["ops"], ["op", "calls_per_step", "self_ms_per_step", "cpu_ms_per_step"]))
        host = result["host_time"]
        print(f"host time by speedswap function (cProfile; {host['python_calls_per_step']:.0f} Python calls a step):")
        print(common.format_table(host["functions"], ["function", "calls_per_step", "cum_ms_per_step",
                                                      "self_ms_per_step"]))
    path = write_json(args.out / f"profile_step-{'gpu' if cuda else 'cpu'}.json", "profile_step", {
        "setup": {"vocab": args.vocab, "steps": args.steps, "batch": shape.batch, "negatives": shape.negatives,
                  "dim": shape.dim, "optimizer": "Adam", "device": str(device),
                  "cached": f"cache_rows = {training_step.CACHE_FRACTION:.0%} of the vocabulary, prefetch"},
        "setups": setups})
    print(f"\nwrote {path}")
    return setups


if __name__ == "__main__":
    main()
