"""BatchFeeder against DataLoader and a hand-written numpy loop; block vs random order from disk.

* fast_loops: "The fast train loops" (300,000 x 64 float32 + labels, batch
  300): per-item DataLoader, BatchSampler DataLoader, a numpy loop, BatchFeeder.
* disk: a memory-mapped .npy (the feeder reads it with pread; see disk.py), block vs random order, cold page
  cache, --disk-repeats rounds of one epoch of each after a short warm-up.
* gpu (only with CUDA): the FFCV linear-regression shape (rows x 1,000
  float32, batch 2048): BatchFeeder vs DataLoader(num_workers, pin_memory)
  vs the pinned host-to-device copy of the same bytes.

The measurements are speedswap.apps.bench.feeder.

Usage:
    python benchmarks/feeder.py [--epochs 5] [--repeats 5] [--disk-gb 2] [--disk-repeats 3] [--disk-dir /tmp]
                                [--skip-disk]

Writes benchmarks/results/feeder-{cpu,gpu}.json.
"""

import argparse
import os
import sys
import tempfile

import common
import torch

from speedswap.apps.bench import feeder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=common.positive_int, default=5, help="epochs per timed repeat (fast_loops; the per-item DataLoader runs one)")
    parser.add_argument("--repeats", type=common.positive_int, default=5, help="timed rounds, each timing every contender once (GPU case: one epoch each)")
    parser.add_argument("--disk-gb", type=float, default=2.0, help="size of the file for the disk case, GB (10**9 bytes)")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(), help="where the disk case's file goes")
    parser.add_argument("--disk-batch", type=common.positive_int, default=2048, help="rows per batch in the disk case")
    parser.add_argument("--disk-max-seconds", type=float, default=120.0,
                        help="stop an epoch after this long and extrapolate")
    parser.add_argument("--disk-repeats", type=common.positive_int, default=3,
                        help="timed rounds of the disk case, each one cold epoch of either order")
    parser.add_argument("--skip-disk", action="store_true", help="leave out the disk case")
    parser.add_argument("--gpu-rows", type=common.positive_int, default=1_000_000, help="rows of the FFCV regression shape")
    parser.add_argument("--gpu-workers", type=common.positive_int, default=min(8, os.cpu_count() or 1),
                        help="DataLoader workers in the GPU case")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    payload = {"fast_loops": feeder.fast_loops(args.epochs, args.repeats)}
    print(feeder.format_fast_loops(payload["fast_loops"]))
    if not args.skip_disk:
        payload["disk"] = feeder.disk(args.disk_gb, args.disk_dir, args.disk_batch, args.disk_max_seconds,
                                      args.disk_repeats)
        print(feeder.format_disk(payload["disk"]))
    if torch.cuda.is_available():
        payload["gpu"] = feeder.regression(args.gpu_rows, args.repeats, args.gpu_workers, torch.device("cuda"))
        print(feeder.format_regression(payload["gpu"]))
    payload["command"] = "python benchmarks/feeder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    common.write_results("feeder", payload, args.out)
    return payload


if __name__ == "__main__":
    main()
