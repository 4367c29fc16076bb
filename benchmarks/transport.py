"""Row transport: HostTable.gather/scatter against the obvious alternatives.

CPU (always): a 2,000,000 x 128 float32 table and 131,072 random ids;
HostTable.gather/scatter vs torch.index_select, index_copy_, np.take and a
contiguous copy of the same bytes.

GPU (when torch sees one): the SpeedTorch case, a 1,000,000 x 128 float32
pinned table and 131,072 ids drawn with replacement, to a CUDA parameter and
back: speedswap vs (a) SpeedTorch's CuPy fancy indexing on pinned memory,
(b) a pinned torch tensor + .cuda() / .cpu() + index_put_, (c) an all-GPU
table, and the ceilings (d) pinned contiguous H2D/D2H copies and (e) a
device-to-device copy; then 64, 256 and 1024-byte rows and bfloat16.
The measurements are speedswap.apps.bench.transport.

Usage:
    python benchmarks/transport.py            # full size
    python benchmarks/transport.py --quick    # 16x smaller, a smoke run

Writes benchmarks/results/transport-{cpu,gpu}.json (transport-quick-* with --quick).
"""

import argparse

import common  # noqa: F401  (puts this checkout's speedswap first on the path)
import torch

from speedswap.apps.bench import transport


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16x smaller sizes (a smoke run)")
    parser.add_argument("--repeats", type=common.positive_int, default=20, help="timed rounds per contender")
    parser.add_argument("--no-write", action="store_true", help="do not write the JSON result")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    scale = 16 if args.quick else 1
    payload = {"cpu": transport.run_cpu(2_000_000 // scale, 128, 131_072 // scale, repeats=args.repeats)}
    print(transport.format_cpu(payload["cpu"]))
    if torch.cuda.is_available():
        payload["gpu"] = transport.run_gpu(1_000_000 // scale, 131_072 // scale, args.repeats)
        print(transport.format_gpu(payload["gpu"]))
    if not args.no_write:
        common.write_results("transport" + ("-quick" if args.quick else ""), payload, args.out)
    return payload


if __name__ == "__main__":
    main()
