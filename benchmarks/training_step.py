"""A skip-gram training step with Adam: offloaded (OffloadedEmbedding) vs entirely in memory.

4096 (center, context) pairs and 5 negatives per pair, dim 128, Zipf ids, one
tied table. In memory: nn.Embedding(sparse=True) + SparseAdam (in RAM on a
CPU, all on the GPU on a GPU); offloaded: OffloadedEmbedding + Adam, table and
state in host memory. Timed interleaved when both fit at once; on a GPU the
device memory of each setup is recorded. The measurement is
speedswap.apps.bench.training_step.

Usage:
    python benchmarks/training_step.py [--vocab 1000000 10000000] [--repeats 20] [--batch 4096] [--dim 128]
        [--threads N] [--keep-freed-memory]

Writes benchmarks/results/training_step-{cpu,gpu}.json (or into --out); another --batch or --dim
writes training_step-batch<B>-dim<D>-{cpu,gpu}.json (a small step shows the host's
work per step, which the default shape's arithmetic hides on a CPU: NOTES 37).
"""

import argparse

import common
import torch

import speedswap as ss

from speedswap.apps.bench import training_step
from speedswap.apps.bench.timing import write_json


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab", type=common.positive_int, nargs="+", default=[1_000_000, 10_000_000],
                        help="table rows to measure at")
    parser.add_argument("--repeats", type=common.positive_int, default=20, help="timed steps per setup")
    parser.add_argument("--batch", type=common.positive_int, default=training_step.StepShape.batch, help="pairs per step")
    parser.add_argument("--dim", type=common.positive_int, default=training_step.StepShape.dim, help="embedding length")
    parser.add_argument("--threads", type=common.positive_int, default=torch.get_num_threads(),
                        help="torch's intra-op threads (1 on this 2-core machine keeps the load near 1)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="ss.keep_freed_memory() first: on a CPU glibc otherwise returns each step's "
                             "freed memory to the kernel, and the page faults vary the step by tens of "
                             "percent (NOTES 31)")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kept = args.keep_freed_memory and ss.keep_freed_memory()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = training_step.StepShape(batch=args.batch, dim=args.dim)
    payload = training_step.run(args.vocab, args.repeats, device, shape)
    payload["setup"].update(threads=args.threads, keep_freed_memory=kept)
    print(training_step.format_results(payload))
    name = ("training_step" if shape == training_step.StepShape()
            else f"training_step-batch{shape.batch}-dim{shape.dim}")
    path = write_json(args.out / f"{name}-{device.type.replace('cuda', 'gpu')}.json", name, payload)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
