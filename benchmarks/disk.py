"""BatchFeeder streaming a .npy file from disk: block vs random order against the sequential-read ceiling.

A file of ``--disk-gb`` GB (rows of 1,024 float32 = 4 KiB, written with
``speedswap.data.create_npy``) is read, with the page cache emptied for it
(``posix_fadvise(DONTNEED)``) before every measurement, by:

* ``dd bs=16M`` — the sequential-read ceiling of this file on this disk, same run;
* ``BatchFeeder(order="block")`` — whole blocks, shuffled within windows;
* ``BatchFeeder(order="random")`` — one read per row, 16 in flight (stopped
  after ``--max-seconds`` and extrapolated: the JSON says so).

The disk may be shared, so its speed drifts: each block epoch is paired
with a dd read just before it (``--epochs`` rounds of dd, block), then
random order runs, then dd once more; the ratio to the ceiling is the median
over rounds of ``dd seconds / block seconds``. The feeder process's resident
memory (``VmRSS`` from ``/proc/self/status``) is sampled every 20 ms during
each epoch; the table gives the RSS before the epoch, its peak, and its
value at 10% and at 90% of the epoch (equal when it is flat). The load
average is recorded with every figure (the machine may be shared). The file
is deleted at the end.

Run: ``python benchmarks/disk.py --disk-gb 4 [--epochs 2] [--dir /tmp] [--max-seconds 60]``.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import speedswap as ss  # noqa: E402
from speedswap.atomic import drop_cache  # noqa: E402

DIM = 1024  # 4 KiB rows: random order costs one disk read per row


def rss_bytes():
    """This process's resident set size, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class RssSampler:
    """Samples VmRSS every ``interval`` seconds on a thread; ``peak`` after ``stop()``."""

    def __init__(self, interval=0.02):
        self.start_bytes = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval):
        while not self._stop.wait(interval):
            self.peak = max(self.peak, rss_bytes())

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self


def dd_seconds(path):
    drop_cache(path)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return time.perf_counter() - start


def feeder_epoch(path, order, batch, max_seconds):
    drop_cache(path)
    feeder = ss.BatchFeeder(np.load(path, mmap_mode="r"), batch_size=batch, order=order, device="cpu",
                            prefetch=4, drop_behind=True)
    sampler = RssSampler()
    load = os.getloadavg()[0]
    read = batches = 0
    rss_at_tenth = rss_at_nine_tenths = None
    start = time.perf_counter()
    for (x,) in feeder:
        read += x.numel() * x.element_size()
        batches += 1
        if rss_at_tenth is None and batches >= len(feeder) // 10:
            rss_at_tenth = rss_bytes()
        if rss_at_nine_tenths is None and batches >= 9 * len(feeder) // 10:
            rss_at_nine_tenths = rss_bytes()
        if time.perf_counter() - start > max_seconds:
            break
    seconds = time.perf_counter() - start
    sampler.stop()
    complete = batches == len(feeder)
    return {"case": f"BatchFeeder {order}", "seconds": seconds, "bytes": read, "GB_per_s": read / seconds / 1e9,
            "epoch_s": seconds if complete else seconds * os.path.getsize(path) / read,
            "epoch_s_is": "measured" if complete else f"extrapolated from {read / 1e9:.1f} GB read",
            "rss_before_MB": sampler.start_bytes / 1e6, "rss_peak_MB": sampler.peak / 1e6,
            # None when --max-seconds stopped the epoch before a tenth (or nine tenths) of it.
            "rss_10pct_MB": None if rss_at_tenth is None else rss_at_tenth / 1e6,
            "rss_90pct_MB": None if rss_at_nine_tenths is None else rss_at_nine_tenths / 1e6,
            "load_1min": [load, os.getloadavg()[0]]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--disk-gb", type=float, default=4.0, help="size of the file")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file goes")
    parser.add_argument("--batch", type=common.positive_int, default=2048)
    parser.add_argument("--epochs", type=common.positive_int, default=2, help="block-order epochs")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="stop a random-order epoch after this long and extrapolate")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    rows = int(args.disk_gb * 1e9) // (DIM * 4)
    if not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir!r} is not a directory")
    fd, path = tempfile.mkstemp(suffix=".npy", dir=args.dir)
    os.close(fd)
    table = []
    try:
        start = time.perf_counter()
        rng = np.random.default_rng(0)
        ss.data.create_npy(path, (rows, DIM), np.float32,
                           lambda lo, hi: rng.standard_normal((hi - lo, DIM), dtype=np.float32))
        size = os.path.getsize(path)
        print(f"wrote {size / 1e9:.2f} GB ({rows:,} x {DIM} float32) in {time.perf_counter() - start:.0f} s")

        def ceiling():
            load = os.getloadavg()[0]
            seconds = dd_seconds(path)
            table.append({"case": "dd bs=16M", "seconds": seconds, "bytes": size, "GB_per_s": size / seconds / 1e9,
                          "epoch_s": seconds, "epoch_s_is": "measured", "load_1min": [load, os.getloadavg()[0]]})

        for _ in range(args.epochs):
            ceiling()
            table.append(feeder_epoch(path, "block", args.batch, float("inf")))
        table.append(feeder_epoch(path, "random", args.batch, args.max_seconds))
        ceiling()
    finally:
        os.unlink(path)
    dd = [row["seconds"] for row in table if row["case"] == "dd bs=16M"]
    block = [row["epoch_s"] for row in table if row["case"] == "BatchFeeder block"]
    random = [row["epoch_s"] for row in table if row["case"] == "BatchFeeder random"][0]
    ratios = {"block_over_sequential_bandwidth": float(np.median([d / b for d, b in zip(dd, block)])),
              "block_speedup_over_random": random / np.median(block),
              "targets": {"block_over_sequential_bandwidth": ">= 0.8", "block_speedup_over_random": ">= 2"}}
    ram = common.machine().get("ram_bytes")
    print(f"\n{size / 1e9:.2f} GB file ({'larger' if ram and size > ram else 'smaller'} than RAM), "
          f"batch {args.batch}, page cache emptied before each row")
    common.print_table(table, ["case", "seconds", "GB_per_s", "epoch_s", "epoch_s_is", "rss_before_MB",
                               "rss_10pct_MB", "rss_90pct_MB", "rss_peak_MB", "load_1min"])
    print(f"block order: {ratios['block_over_sequential_bandwidth']:.2f}x the sequential bandwidth, "
          f"{ratios['block_speedup_over_random']:.1f}x faster than random order")
    common.write_results("disk", out=args.out, payload={
        "file_bytes": size, "shape": [rows, DIM], "batch": args.batch, "ram_bytes": ram,
        "larger_than_ram": bool(ram and size > ram), "page_cache": "emptied before each row",
        "rows": table, "ratios": ratios,
        "command": "python benchmarks/disk.py " + " ".join(sys.argv[1:] if argv is None else argv)})


if __name__ == "__main__":
    main()
