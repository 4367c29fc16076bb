"""How many aten ops that launch kernels a training step dispatches: issue 11's host-bound step, counted.

On a GPU the offloaded step is bound by the host (NOTES 33, 53): every op
that launches a kernel costs host time whatever its size, so fewer ops is a
faster step there. This counts them with a ``TorchDispatchMode`` over the
steps of ``training_step.py``'s setups (entry 49's shape by default: vocab
1M, batch 64, dim 8, Adam, Zipf ids), leaving out views, allocations and
profiler markers, which launch nothing. Per setup it reports the ops a
step, the most frequent ops, and the sorts a step by dtype and by whether
they pass 4096 ids (where torch's CUDA sort turns to cub's radix sort, whose
kernel count the key width sets; NOTES 59).

``--device-paths`` runs, on the CPU, the branches a GPU runs: it turns off
:mod:`speedswap.train.sync_free`'s numpy shortcuts, so a CPU count stands in
for a GPU's (NOTES 56, 59). On a GPU the count is of the CUDA step itself.
``--by-line N`` also lists the N (line of speedswap, op) pairs that dispatch
the most, by the innermost line of speedswap's code on the stack.

Usage:
    python benchmarks/op_count.py [--device-paths] [--batch 64] [--by-line 20] [--out DIR]

Writes ``op_count-{cpu,gpu}.json`` (``op_count-device-paths-cpu.json`` with
``--device-paths``) into benchmarks/results/, or DIR.
"""

import argparse
import collections
import os
import traceback

import common
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speedswap.apps.bench import training_step
from speedswap.train import sync_free

PACKAGE = os.path.dirname(training_step.ss.__file__) + os.sep
# Ops that launch no kernel (views are told by the op): allocation, metadata, profiler markers;
# and a value read to the host (_local_scalar_dense), a wait that profile_step.py counts instead.
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
             "resize_as_", "lift_fresh", "_record_function_enter_new", "_record_function_exit", "sym_size",
             "sym_stride", "sym_numel", "is_nonzero", "_local_scalar_dense", "detach", "alias",
             "_reshape_alias", "is_same_size", "_has_compatible_shallow_copy_type"}
#: Past this many elements torch's CUDA sort is cub's radix sort (``should_use_small_sort``).
SMALL_SORT = 4096


class OpCount(TorchDispatchMode):
    """Counts the kernel-launching aten ops dispatched inside it, by op and (optionally) by line."""

    def __init__(self, by_line: bool):
        super().__init__()
        self.by_line = by_line
        self.ops, self.lines, self.sorts = collections.Counter(), collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "sort":
            ids = args[0]
            self.sorts[f"{str(ids.dtype).replace('torch.', '')}, "
                       f"{'over' if ids.numel() > SMALL_SORT else 'at most'} {SMALL_SORT}"] += 1
        if not (func.is_view or name in NO_KERNEL):
            self.ops[name] += 1
            if self.by_line:
                self.lines[(_speedswap_line(), name)] += 1
        return func(*args, **(kwargs or {}))


def _speedswap_line() -> str:
    """The innermost line of speedswap's code on the stack ("outside" when there is none)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(PACKAGE):
            return f"{frame.filename[len(PACKAGE):]}:{frame.lineno} ({frame.name})"
    return "outside"


def count(setup: str, args, device: torch.device) -> dict:
    """The per-step counts of one setup, over ``args.steps`` steps after ``args.warmup``."""
    build, loss, prefetch = training_step._setups()[setup]
    shape = training_step.StepShape(batch=args.batch, dim=args.dim)
    batches = training_step.zipf_batches(args.vocab, 16, device, shape)
    step, _ = training_step._step_fn(build, args.vocab, batches, device, shape, loss, prefetch)
    for _ in range(args.warmup):
        step()
    with OpCount(by_line=args.by_line > 0) as counted:
        for _ in range(args.steps):
            step()
    per_step = {name: n / args.steps for name, n in counted.ops.most_common()}
    return {"setup": setup, "ops_per_step": sum(per_step.values()),
            "sorts_per_step": {key: n / args.steps for key, n in sorted(counted.sorts.items())},
            "top_ops": dict(list(per_step.items())[:15]),
            "top_lines": [{"line": line, "op": op, "per_step": n / args.steps}
                          for (line, op), n in counted.lines.most_common(args.by_line)]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=common.positive_int, default=1_000_000)
    parser.add_argument("--batch", type=common.positive_int, default=64, help="pairs per step (entry 49's 64)")
    parser.add_argument("--dim", type=common.positive_int, default=8)
    parser.add_argument("--steps", type=common.positive_int, default=10)
    parser.add_argument("--warmup", type=common.positive_int, default=3)
    parser.add_argument("--setups", default="offloaded,cached,offloaded_one_lookup,cached_one_lookup",
                        help="comma-separated names of training_step.py's setups")
    parser.add_argument("--device-paths", action="store_true",
                        help="on the CPU, turn sync_free's numpy shortcuts off: the branches a GPU runs")
    parser.add_argument("--by-line", type=int, default=0, metavar="N",
                        help="also list the N (line, op) pairs that dispatch the most")
    common.add_out_option(parser)
    args = parser.parse_args()
    unknown = set(args.setups.split(",")) - set(training_step._setups())
    if unknown:
        parser.error(f"unknown setups {sorted(unknown)}; known: {', '.join(training_step._setups())}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device_paths:
        sync_free._numpy_shortcut = lambda tensor: False
    torch.manual_seed(0)
    rows = []
    for setup in args.setups.split(","):
        rows.append(count(setup, args, device))
        print(f"{setup}: {rows[-1]['ops_per_step']:g} ops a step, sorts {rows[-1]['sorts_per_step']}")
        for line in rows[-1]["top_lines"]:
            print(f"    {line['per_step']:6.2f}  {line['line']}  {line['op']}")
    paths = "device" if args.device_paths or device.type == "cuda" else "cpu"
    name = "op_count-device-paths" if args.device_paths else "op_count"
    common.write_results(name, {"paths": paths, "device": device.type, "vocab": args.vocab,
                                      "batch": args.batch, "dim": args.dim, "steps": args.steps, "rows": rows},
                         args.out)


if __name__ == "__main__":
    main()
