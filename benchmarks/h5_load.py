"""Loading an ``.h5`` table: the rows' CRC-32 computed after the reads, or behind them on a second thread.

Every ``.h5`` table speedswap saves records the CRC-32 of its rows, which
every load verifies. ``HostTable.load`` read the rows, then ran ``zlib.crc32``
over all of them; it now computes each chunk's CRC-32 on a second thread
while the next chunk is read (:func:`speedswap.files.base.crc32_behind`). A
table of ``--mib`` MiB (float32, random values) is saved once, kept in the
page cache, and read into one array, in interleaved rounds, by:

* ``read``: the rows alone, no CRC-32 (the floor);
* ``read, then CRC-32``: the rows, then ``crc32_of`` over all of them (before);
* ``CRC-32 behind the reads``: ``read_h5_into(..., crc32=True)`` (after);
* ``HostTable.load``: the whole load, a new table included;
* ``stage_table, held``: the first half of ``load_from`` and of a checkpoint's
  load, every chunk read, held in RAM and its CRC-32 verified;
* ``stage_table, verified only``: the same for a table too large to stage in
  RAM (``ram_available=0``), each chunk's running CRC-32 recorded.

Each round times every variant once (:func:`time_interleaved`); the load
average is recorded before and after, since the machine may be shared and the
overlap needs a free core. Both CRC-32 variants must give the one recorded.
To compare two checkouts, run each one's copy of this script in turn (it measures its own checkout).

Run: ``python benchmarks/h5_load.py [--mib 256] [--repeats 9] [--warmup 2] [--chunk-mib 64]``.
Writes ``benchmarks/results/h5_load-cpu.json``.
"""

import argparse
import os
import tempfile

import common
import numpy as np
import torch

import speedswap as ss
from speedswap.apps.bench.timing import load_average, time_interleaved
from speedswap.files import base, read_h5_header, read_h5_into, stage_table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mib", type=common.positive_int, default=256, help="the table's size in MiB")
    parser.add_argument("--repeats", type=common.positive_int, default=9, help="interleaved rounds timed")
    parser.add_argument("--warmup", type=int, default=2, help="rounds run first and discarded")
    parser.add_argument("--chunk-mib", type=common.positive_int, default=base.CHUNK_BYTES >> 20,
                        help="rows read (and checksummed) per chunk, in MiB")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    base.CHUNK_BYTES = args.chunk_mib << 20  # row_ranges reads it at each call
    dim = 256
    rows = (args.mib << 20) // (4 * dim)
    values = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "table.h5")
        ss.HostTable.from_numpy(values, backend="numpy").save(path)
        header = read_h5_header(path, "table")
        out = np.empty_like(values)
        crcs = []

        def read():
            read_h5_into(path, out, "table", header)

        def read_then_crc():
            read_h5_into(path, out, "table", header)
            crcs.append(base.crc32_of(out))

        def crc_behind():
            crcs.append(read_h5_into(path, out, "table", header, crc32=True))

        def load():
            ss.HostTable.load(path, backend="numpy").close()

        def staged(ram_available):  # a wrong CRC-32 raises
            return lambda: stage_table(path, header, "table", torch.float32, ram_available)
        load_before = load_average()
        timings = time_interleaved({"read": read, "read, then CRC-32": read_then_crc,
                                    "CRC-32 behind the reads": crc_behind, "HostTable.load": load,
                                    "stage_table, held": staged(4 * values.nbytes),
                                    "stage_table, verified only": staged(0)},
                                   repeats=args.repeats, warmup=args.warmup)
        load_after = load_average()
    if set(crcs) != {header.crc32}:
        raise SystemExit(f"a CRC-32 variant gave {sorted(set(crcs))}, not the recorded {header.crc32}")
    floor, before = timings["read"]["median_s"], timings["read, then CRC-32"]["median_s"]
    rows_out = [{"variant": name, **summary, "vs_read_then_crc": summary["median_s"] / before,
                 "vs_read": summary["median_s"] / floor} for name, summary in timings.items()]
    common.print_table(rows_out, ["variant", "median_s", "min_s", "max_s", "vs_read_then_crc", "vs_read"])
    print(f"load average before {load_before}, after {load_after}")
    common.write_results("h5_load", {"mib": args.mib, "chunk_mib": args.chunk_mib, "repeats": args.repeats,
                                     "load_average_before": load_before, "load_average_after": load_after,
                                     "rows": rows_out}, args.out)


if __name__ == "__main__":
    main()
