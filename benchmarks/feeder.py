"""BatchFeeder against DataLoader and a hand-written numpy loop; block vs random order from disk.

Cases (all on one machine, side by side, as ratios):

* ``fast_loops`` — "The fast train loops": 300,000 rows x 64 float32 features
  + int64 labels, batch 300, shuffled every epoch, time per epoch of
  (a) ``DataLoader`` with the default per-item ``__getitem__`` and collate,
  (b) ``DataLoader(batch_size=None, sampler=BatchSampler(RandomSampler))`` over
  a dataset indexed by whole batches, (c) a hand-written numpy loop
  (permutation, then one fancy index per array per batch: the ceiling), and
  (d) ``BatchFeeder(x, y, batch_size=300)`` on the CPU.
* ``disk`` — a ``.npy`` file read through a memory map, ``order="random"`` vs
  ``order="block"``: epoch time and bytes per second. The page cache is
  emptied for the file (``posix_fadvise(DONTNEED)``) before each epoch, so
  every epoch reads from disk even when the file would fit in RAM; the JSON
  says whether the file really was larger than RAM. The file is deleted at the end.
* ``gpu`` (only with CUDA) — the FFCV linear-regression shape scaled to the
  machine (rows x 1,000 float32, batch 2048), epoch time of BatchFeeder
  (pinned DataGadget -> GPU) vs ``DataLoader(num_workers, pin_memory=True)``
  over whole batches vs the pinned host-to-device copy of the same bytes.

Run: ``python benchmarks/feeder.py [--epochs 5] [--disk-gb 2] [--disk-dir /tmp] [--skip-disk]``.
"""

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import speedswap as ss  # noqa: E402


class PerItem(Dataset):
    """The textbook Dataset: one row per ``__getitem__``, batched by the default collate."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class WholeBatch(PerItem):
    """A Dataset indexed by a list of ids, for ``batch_size=None`` + ``BatchSampler``."""

    def __getitem__(self, ids):
        # index_select, the kernel BatchFeeder uses, so the comparison measures
        # the DataLoader's own overhead (x[ids] is slower when cores are busy).
        ids = torch.as_tensor(ids)
        return torch.index_select(self.x, 0, ids), torch.index_select(self.y, 0, ids)


def drain(iterable):
    count = 0
    for batch in iterable:
        count += len(batch[1])
    return count


def fast_loops(epochs, repeats):
    n, dim, batch = 300_000, 64, 300
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((n, dim), dtype=np.float32)
    y_np = rng.integers(0, 10, size=n)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    per_item = DataLoader(PerItem(x, y), batch_size=batch, shuffle=True)
    batched = DataLoader(WholeBatch(x, y), batch_size=None,
                         sampler=BatchSampler(RandomSampler(range(n)), batch, drop_last=False))
    feeder = ss.BatchFeeder(x_np, y_np, batch_size=batch, order="random", device="cpu")
    loop_rng = np.random.default_rng(1)

    def numpy_loop():
        order = loop_rng.permutation(n)
        count = 0
        for start in range(0, n, batch):
            ids = order[start:start + batch]
            count += len(y_np[ids])
            x_np[ids]
        return count

    def epochs_of(fn):
        def run():
            for _ in range(epochs):
                assert fn() == n
        return run

    cases = [("DataLoader per item", epochs_of(lambda: drain(per_item)), 1),
             ("DataLoader BatchSampler", epochs_of(lambda: drain(batched)), repeats),
             ("numpy loop", epochs_of(numpy_loop), repeats),
             ("BatchFeeder", epochs_of(lambda: drain(feeder)), repeats)]
    rows = []
    for name, fn, reps in cases:
        timing = common.time_cpu(fn, repeats=reps, warmup=1)
        rows.append({"case": name, "epoch_s": timing["median_s"] / epochs,
                     "min_s": timing["min_s"] / epochs, "max_s": timing["max_s"] / epochs,
                     "repeats": reps, "epochs_per_repeat": epochs})
    feeder_s = rows[-1]["epoch_s"]
    for row in rows:
        row["vs_feeder"] = row["epoch_s"] / feeder_s
    ratios = {"speedup_vs_per_item": rows[0]["epoch_s"] / feeder_s,
              "speedup_vs_batch_sampler": rows[1]["epoch_s"] / feeder_s,
              "feeder_over_numpy": feeder_s / rows[2]["epoch_s"],
              "targets": {"speedup_vs_per_item": ">= 25", "speedup_vs_batch_sampler": ">= 3",
                          "feeder_over_numpy": "<= 1.25"}}
    print(f"\nfast train loops: {n} x {dim} float32 + labels, batch {batch}, {epochs} epochs per repeat")
    common.print_table(rows, ["case", "epoch_s", "min_s", "max_s", "repeats", "vs_feeder"])
    print(f"BatchFeeder: {ratios['speedup_vs_per_item']:.1f}x per-item DataLoader, "
          f"{ratios['speedup_vs_batch_sampler']:.1f}x BatchSampler DataLoader, "
          f"{ratios['feeder_over_numpy']:.2f}x the numpy loop's time")
    return {"shape": [n, dim], "batch": batch, "rows": rows, "ratios": ratios}


def _evict(path):
    """Drop the file's pages from the page cache, so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_big(path, rows, dim, seed):
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    rng = np.random.default_rng(seed)
    step = max(1, (64 << 20) // (dim * 4))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        out[start:stop] = rng.standard_normal((stop - start, dim), dtype=np.float32)
    out.flush()
    del out


def disk(gigabytes, directory, batch, max_seconds):
    dim = 1024  # 4 KiB rows: one page each, so random order costs a disk read per row
    rows = int(gigabytes * (1 << 30)) // (dim * 4)
    nbytes = rows * dim * 4
    ram = common.machine().get("ram_bytes")
    fd, path = tempfile.mkstemp(suffix=".npy", dir=directory)
    os.close(fd)
    results = []
    try:
        start = time.perf_counter()
        _write_big(path, rows, dim, seed=0)
        print(f"\nwrote {nbytes / 1e9:.2f} GB ({rows} x {dim} float32) in {time.perf_counter() - start:.1f} s")
        for order in ("block", "random"):
            # Evicted while nothing maps the file: the kernel keeps mapped pages.
            _evict(path)
            gadget = ss.DataGadget(path, mmap=True, backend="numpy")
            feeder = ss.BatchFeeder(gadget, batch_size=batch, order=order, device="cpu", prefetch=4)
            read = batches = 0
            start = time.perf_counter()
            for (x,) in feeder:
                read += x.numel() * 4
                batches += 1
                if time.perf_counter() - start > max_seconds:
                    break
            seconds = time.perf_counter() - start
            complete = batches == len(feeder)
            results.append({"order": order, "batches": batches, "of": len(feeder), "complete": complete,
                            "seconds": seconds, "MB_per_s": read / seconds / 1e6,
                            "epoch_s": seconds if complete else seconds * nbytes / read,
                            "epoch_s_is": "measured" if complete else "extrapolated from the part read"})
            del feeder, x
            gadget.close()
            gc.collect()
    finally:
        os.unlink(path)
    print(f"disk: {nbytes / 1e9:.2f} GB file via mmap, batch {batch}, cold page cache each epoch "
          f"({'larger' if ram and nbytes > ram else 'smaller'} than RAM)")
    common.print_table(results, ["order", "batches", "of", "seconds", "MB_per_s", "epoch_s", "epoch_s_is"])
    return {"file_bytes": nbytes, "shape": [rows, dim], "batch": batch, "ram_bytes": ram,
            "larger_than_ram": bool(ram and nbytes > ram), "page_cache": "evicted before each epoch",
            "rows": results}


def gpu(rows, epochs, workers):
    dim, batch = 1000, 2048
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((rows, dim), dtype=np.float32)
    y_np = rng.standard_normal(rows, dtype=np.float32)
    x_gadget = ss.DataGadget(x_np, CPUPinn=True)
    y_gadget = ss.DataGadget(y_np, CPUPinn=True)
    feeder = ss.BatchFeeder(x_gadget, y_gadget, batch_size=batch, order="random", device="cuda")
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    loader = DataLoader(WholeBatch(x, y), batch_size=None, num_workers=workers, pin_memory=True,
                        persistent_workers=True,
                        sampler=BatchSampler(RandomSampler(range(rows)), batch, drop_last=False))
    source = torch.empty((rows, dim + 1), dtype=torch.float32, pin_memory=True)
    target = torch.empty_like(source, device="cuda")

    def consume(iterable, to_device):
        total = torch.zeros((), device="cuda")
        for xb, yb in iterable:
            if to_device:
                xb, yb = xb.cuda(non_blocking=True), yb.cuda(non_blocking=True)
            total += xb[:, 0].sum() + yb.sum()  # touch the batch on the GPU
        return total

    cases = [("BatchFeeder", lambda: consume(feeder, False)),
             (f"DataLoader {workers} workers pin_memory", lambda: consume(loader, True)),
             ("pinned copy limit", lambda: target.copy_(source, non_blocking=True))]
    table = []
    for name, fn in cases:
        timing = common.time_cuda(fn, repeats=epochs, warmup=1)
        table.append({"case": name, "epoch_s": timing["median_s"], "min_s": timing["min_s"],
                      "max_s": timing["max_s"]})
    limit = table[-1]["epoch_s"]
    for row in table:
        row["vs_limit"] = row["epoch_s"] / limit
    print(f"\ngpu: {rows} x {dim} float32 + targets, batch {batch}")
    common.print_table(table, ["case", "epoch_s", "min_s", "max_s", "vs_limit"])
    return {"shape": [rows, dim], "batch": batch, "rows": table, "target": "BatchFeeder <= 1.3x the limit"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="epochs per timed repeat (fast_loops)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--disk-gb", type=float, default=2.0, help="size of the file for the disk case")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir())
    parser.add_argument("--disk-batch", type=int, default=2048)
    parser.add_argument("--disk-max-seconds", type=float, default=120.0,
                        help="stop an epoch after this long and extrapolate")
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--gpu-rows", type=int, default=1_000_000)
    parser.add_argument("--gpu-workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    payload = {"fast_loops": fast_loops(args.epochs, args.repeats)}
    if not args.skip_disk:
        payload["disk"] = disk(args.disk_gb, args.disk_dir, args.disk_batch, args.disk_max_seconds)
    if torch.cuda.is_available():
        payload["gpu"] = gpu(args.gpu_rows, args.repeats, args.gpu_workers)
    payload["command"] = "python benchmarks/feeder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    common.write_results("feeder", payload)


if __name__ == "__main__":
    main()
