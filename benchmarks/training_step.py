"""A skip-gram training step with Adam: offloaded (OffloadedEmbedding) vs entirely in memory.

4096 (center, context) pairs and 5 negatives per pair, dim 128, Zipf ids, one
tied table. In memory: nn.Embedding(sparse=True) + SparseAdam (in RAM on a
CPU, all on the GPU on a GPU); offloaded: OffloadedEmbedding + Adam, table and
state in host memory. Timed interleaved when both fit at once; on a GPU the
device memory of each setup is recorded. The measurement is
speedswap.apps.bench.training_step.

Usage:
    python benchmarks/training_step.py [--vocab 1000000 10000000] [--repeats 20]

Writes benchmarks/results/training_step-{cpu,gpu}.json.
"""

import argparse

import common
import torch

from speedswap.apps.bench import training_step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1_000_000, 10_000_000],
                        help="table rows to measure at")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per setup")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    payload = training_step.run(args.vocab, args.repeats, device)
    print(training_step.format_results(payload))
    common.write_results("training_step", payload)
    return payload


if __name__ == "__main__":
    main()
