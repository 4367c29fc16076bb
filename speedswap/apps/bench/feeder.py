"""BatchFeeder against DataLoader, a hand-written numpy loop and the copy limit.

Cases (each side by side in one run, as ratios; the contenders take turns,
one timed call each per round, so drift falls on all of them alike):

* :func:`fast_loops` -- "The fast train loops": 300,000 rows x 64 float32
  features + int64 labels, batch 300, shuffled every epoch, time per epoch of
  (a) ``DataLoader`` with the default per-item ``__getitem__`` and collate,
  (b) ``DataLoader(batch_size=None, sampler=BatchSampler(RandomSampler))`` over
  a dataset indexed by whole batches, (c) a hand-written numpy loop
  (permutation, then one fancy index per array per batch: the ceiling), and
  (d) ``BatchFeeder(x, y, batch_size=300)`` on the CPU.
* :func:`disk` -- a ``.npy`` file read through a memory map, ``order="random"``
  vs ``order="block"``: epoch time and bytes per second, with the file's pages
  evicted from the page cache before each epoch; rounds of one epoch of each,
  taking turns at going first (``benchmarks/disk.py`` pairs block epochs with ``dd``).
* :func:`regression` -- the FFCV linear-regression shape scaled to the machine
  (rows x 1,000 float32 + a target, batch 2048): an epoch of BatchFeeder
  (pinned DataGadgets on a GPU) vs ``DataLoader`` over whole batches vs a
  contiguous copy of the same bytes to the device (pinned host-to-device on a
  GPU, a memory copy on the CPU), the limit an epoch cannot beat.

>>> result = regression(rows=2048, epochs=2, workers=0, device=torch.device("cpu"), dim=16, batch=256)
>>> [row["case"] for row in result["rows"]]
['BatchFeeder', 'DataLoader 0 workers', 'contiguous copy limit']
"""

from __future__ import annotations

import gc
import os
import secrets
import statistics
import tempfile
import time
from typing import Callable, Iterable, Optional

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

import speedswap as ss
from speedswap.atomic import drop_cache, open_into

from .timing import format_table, machine, time_interleaved

__all__ = ["TARGET", "PerItem", "WholeBatch", "fast_loops", "disk", "regression", "format_fast_loops",
           "format_disk", "format_regression"]

#: An epoch of BatchFeeder over the time of a contiguous copy of the same bytes (GPU).
TARGET = ("<=", 1.3)


class PerItem(Dataset):
    """The textbook Dataset: one row per ``__getitem__``, batched by the default collate."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
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


def _drain(iterable: Iterable) -> int:
    count = 0
    for batch in iterable:
        count += len(batch[1])
    return count


def fast_loops(epochs: int, repeats: int, rows: int = 300_000, dim: int = 64, batch: int = 300) -> dict:
    """Epoch time of DataLoader (per item, whole batches), a numpy loop and BatchFeeder, interleaved.

    Args:
        epochs: epochs per timed repeat (the per-item DataLoader, 30x slower, runs one).
        repeats: timed rounds, each timing every case once.
        rows, dim, batch: the data's size.

    Returns:
        ``{"shape", "batch", "rows": figures per case, "ratios"}``.
    """
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((rows, dim), dtype=np.float32)
    y_np = rng.integers(0, 10, size=rows)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    per_item = DataLoader(PerItem(x, y), batch_size=batch, shuffle=True)
    batched = DataLoader(WholeBatch(x, y), batch_size=None,
                         sampler=BatchSampler(RandomSampler(range(rows)), batch, drop_last=False))
    feeder = ss.BatchFeeder(x_np, y_np, batch_size=batch, order="random", device="cpu")
    loop_rng = np.random.default_rng(1)

    def numpy_loop():
        order = loop_rng.permutation(rows)
        count = 0
        for start in range(0, rows, batch):
            ids = order[start:start + batch]
            count += len(y_np[ids])
            x_np[ids]
        return count

    def epochs_of(count: int, fn: Callable[[], int]) -> Callable[[], None]:
        def run():
            for _ in range(count):
                delivered = fn()
                if delivered != rows:
                    raise ss.SpeedswapError(f"an epoch delivered {delivered} rows, not {rows}")
        return run

    # name: (epochs per timed call, one loop); the per-item DataLoader is 30x slower: one epoch.
    cases = {"DataLoader per item": (1, lambda: _drain(per_item)),
             "DataLoader BatchSampler": (epochs, lambda: _drain(batched)),
             "numpy loop": (epochs, numpy_loop),
             "BatchFeeder": (epochs, lambda: _drain(feeder))}
    timings = time_interleaved({name: epochs_of(count, fn) for name, (count, fn) in cases.items()},
                               repeats=repeats, warmup=1)
    table = []
    for name, (count, _) in cases.items():
        timing = timings[name]
        table.append({"case": name, "epoch_s": timing["median_s"] / count,
                      "min_s": timing["min_s"] / count, "max_s": timing["max_s"] / count,
                      "repeats": timing["repeats"], "epochs_per_repeat": count})
    feeder_s = table[-1]["epoch_s"]
    for row in table:
        row["vs_feeder"] = row["epoch_s"] / feeder_s
    ratios = {"speedup_vs_per_item": table[0]["epoch_s"] / feeder_s,
              "speedup_vs_batch_sampler": table[1]["epoch_s"] / feeder_s,
              "feeder_over_numpy": feeder_s / table[2]["epoch_s"],
              "targets": {"speedup_vs_per_item": ">= 25", "speedup_vs_batch_sampler": ">= 3",
                          "feeder_over_numpy": "<= 1.25"}}
    return {"shape": [rows, dim], "batch": batch, "epochs_per_repeat": epochs, "rows": table,
            "ratios": ratios}


def _write_big(path: str, rows: int, dim: int, seed: int) -> None:
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    rng = np.random.default_rng(seed)
    step = max(1, (64 << 20) // (dim * 4))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        out[start:stop] = rng.standard_normal((stop - start, dim), dtype=np.float32)
    out.flush()
    del out


def _disk_epoch(path: str, order: str, batch: int, max_seconds: float, max_batches: Optional[int] = None) -> dict:
    """An epoch of the ``.npy`` at ``path`` in ``order``, from a cold page cache.

    Stopped after ``max_seconds`` (its time then extrapolated from the bytes
    read) or ``max_batches``.

    Returns:
        ``{"batches", "of", "complete", "seconds", "epoch_s", "load_1min"}``.
    """
    # Dropped while nothing maps the file: the kernel keeps mapped pages.
    drop_cache(path)
    gadget = ss.DataGadget(path, mmap=True, backend="numpy")
    feeder = ss.BatchFeeder(gadget, batch_size=batch, order=order, device="cpu", prefetch=4)
    load = os.getloadavg()[0]
    read = batches = 0
    start = time.perf_counter()
    for (x,) in feeder:
        read += x.numel() * 4
        batches += 1
        if time.perf_counter() - start > max_seconds or batches == max_batches:
            break
    seconds = time.perf_counter() - start
    total, nbytes = len(feeder), gadget.shape[0] * gadget.shape[1] * 4
    del feeder, x
    gadget.close()
    gc.collect()
    return {"batches": batches, "of": total, "complete": batches == total, "seconds": seconds,
            "epoch_s": seconds * nbytes / read, "load_1min": [load, os.getloadavg()[0]]}


def disk(gigabytes: float, directory: Optional[str], batch: int, max_seconds: float, repeats: int,
         warmup_batches: int = 10) -> dict:
    """Epoch time of a memory-mapped ``.npy`` file in block vs random order, cold page cache, round robin.

    After a warm-up (``warmup_batches`` batches of each order: the code
    paths, the thread pools, the disk's first seek), ``repeats`` rounds each
    time one epoch of either order, taking turns at going first (as
    ``benchmarks/disk.py`` pairs each block epoch with a ``dd``), so the drift
    of a shared disk falls on both alike. The ratio is the median over
    rounds of random's epoch time over block's in the same round.

    Args:
        gigabytes: file size in GB of 10**9 bytes, as printed and as ``benchmarks/disk.py``'s
            ``--disk-gb`` (4 KiB rows: one page each, so random order costs a read per row).
        directory: where the temporary file goes (deleted at the end).
        batch: rows per batch.
        max_seconds: stop an epoch after this long and extrapolate.
        repeats: timed rounds.
        warmup_batches: batches of each order read first and discarded (0: none).

    Returns:
        ``{"file_bytes", "shape", "batch", "ram_bytes", "larger_than_ram", "page_cache", "repeats",
        "rows": per order, "ratios"}``; a row gives the median epoch time and its spread.

    Raises:
        OptionError: ``repeats`` below 1.
    """
    if repeats < 1:  # before the file is written: a median of no rounds fails only after them
        raise ss.OptionError(f"repeats must be at least 1 (rounds to time), got {repeats!r}")
    dim = 1024
    rows = int(gigabytes * 1e9) // (dim * 4)
    nbytes = rows * dim * 4
    ram = machine().get("ram_bytes")
    orders = ("block", "random")
    epochs = {order: [] for order in orders}
    path = os.path.join(tempfile.gettempdir() if directory is None else directory,
                        f"speedswap-disk-{secrets.token_hex(8)}.npy")
    # The new file's descriptor, from its opening (not tempfile.mkstemp's, which an interrupt as it
    # returns would lose): once it is here, the file is this case's to remove, whatever comes.
    made = []
    try:
        try:
            open_into(made, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: never another's file
        finally:
            if made:
                os.close(made[0])
        _write_big(path, rows, dim, seed=0)
        for order in orders if warmup_batches else ():
            _disk_epoch(path, order, batch, max_seconds, max_batches=warmup_batches)
        for round_ in range(repeats):
            for order in orders[round_ % 2:] + orders[:round_ % 2]:
                epochs[order].append(_disk_epoch(path, order, batch, max_seconds))
    finally:
        if made:
            os.unlink(path)
    table = []
    for order, runs in epochs.items():
        times = [run["epoch_s"] for run in runs]
        complete = all(run["complete"] for run in runs)
        table.append({"order": order, "batches": runs[0]["of"], "epoch_s": statistics.median(times),
                      "min_s": min(times), "max_s": max(times), "MB_per_s": nbytes / statistics.median(times) / 1e6,
                      "epoch_s_is": "measured" if complete else "extrapolated from the part read",
                      "repeats": len(runs), "load_1min": [x for run in runs for x in run["load_1min"]]})
    speedup = statistics.median(r["epoch_s"] / b["epoch_s"] for b, r in zip(epochs["block"], epochs["random"]))
    return {"file_bytes": nbytes, "shape": [rows, dim], "batch": batch, "ram_bytes": ram,
            "larger_than_ram": bool(ram and nbytes > ram), "page_cache": "evicted before each epoch",
            "repeats": repeats, "rows": table,
            "ratios": {"block_speedup_over_random": speedup, "targets": {"block_speedup_over_random": ">= 2"}}}


def regression(rows: int, epochs: int, workers: int, device: torch.device, dim: int = 1000,
               batch: int = 2048) -> dict:
    """An epoch of the FFCV linear-regression shape: BatchFeeder vs DataLoader vs the copy limit, interleaved.

    Args:
        rows: dataset rows (scale to the machine: the data is held about four times over).
        epochs: timed rounds, each one epoch of every case (after one warm-up round).
        workers: the DataLoader's worker processes.
        device: where batches are delivered; on ``cuda`` the data is pinned
            and times are CUDA events.
        dim, batch: features per row and rows per batch.

    Returns:
        ``{"shape", "batch", "device", "rows": per case, "feeder_over_limit", "target"}``.
    """
    cuda = device.type == "cuda"
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((rows, dim), dtype=np.float32)
    y_np = rng.standard_normal(rows, dtype=np.float32)
    backend = "cuda" if cuda else "numpy"
    gadgets = [ss.DataGadget(a, CPUPinn=cuda, backend=backend) for a in (x_np, y_np)]
    feeder = ss.BatchFeeder(*gadgets, batch_size=batch, order="random", device=device)
    loader = DataLoader(WholeBatch(torch.from_numpy(x_np), torch.from_numpy(y_np)), batch_size=None,
                        num_workers=workers, pin_memory=cuda, persistent_workers=workers > 0,
                        sampler=BatchSampler(RandomSampler(range(rows)), batch, drop_last=False))
    source = torch.empty((rows, dim + 1), dtype=torch.float32, pin_memory=cuda)
    target = torch.empty_like(source, device=device)

    def consume(iterable, to_device):
        total = torch.zeros((), device=device)
        for xb, yb in iterable:
            if to_device:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            total += xb[:, 0].sum() + yb.sum()  # touch the batch where it was delivered
        return total

    cases = {"BatchFeeder": lambda: consume(feeder, False),
             f"DataLoader {workers} workers" + (" pin_memory" if cuda else ""): lambda: consume(loader, True),
             "contiguous copy limit": lambda: target.copy_(source, non_blocking=True)}
    table = [{"case": name, "epoch_s": timing["median_s"], "min_s": timing["min_s"],
              "max_s": timing["max_s"], "repeats": timing["repeats"]}
             for name, timing in time_interleaved(cases, repeats=epochs, warmup=1, cuda=cuda).items()]
    limit = table[-1]["epoch_s"]
    for row in table:
        row["vs_limit"] = row["epoch_s"] / limit
    for gadget in gadgets:
        gadget.close()
    return {"shape": [rows, dim], "batch": batch, "device": str(device), "rows": table,
            "feeder_over_limit": table[0]["vs_limit"],
            "limit": "pinned host-to-device copy" if cuda else "host memory copy",
            "target": "BatchFeeder <= 1.3x the limit"}


def format_fast_loops(result: dict) -> str:
    """:func:`fast_loops`'s figures as text."""
    ratios = result["ratios"]
    (rows, dim), batch = result["shape"], result["batch"]
    return "\n".join([
        f"fast train loops: {rows} x {dim} float32 + labels, batch {batch}, "
        f"{result['epochs_per_repeat']} epochs per repeat (per item: 1), contenders interleaved",
        format_table(result["rows"], ["case", "epoch_s", "min_s", "max_s", "repeats", "epochs_per_repeat",
                                      "vs_feeder"]),
        f"BatchFeeder: {ratios['speedup_vs_per_item']:.1f}x per-item DataLoader, "
        f"{ratios['speedup_vs_batch_sampler']:.1f}x BatchSampler DataLoader, "
        f"{ratios['feeder_over_numpy']:.2f}x the numpy loop's time"])


def format_disk(result: dict) -> str:
    """:func:`disk`'s figures as text."""
    return "\n".join([
        f"disk: {result['file_bytes'] / 1e9:.2f} GB file via mmap, batch {result['batch']}, cold page "
        f"cache each epoch ({'larger' if result['larger_than_ram'] else 'smaller'} than RAM), "
        f"{result['repeats']} rounds of both orders",
        format_table(result["rows"], ["order", "batches", "epoch_s", "min_s", "max_s", "MB_per_s", "epoch_s_is"]),
        f"block order: {result['ratios']['block_speedup_over_random']:.2f}x faster than random order "
        f"(median over rounds; target {result['ratios']['targets']['block_speedup_over_random']})"])


def format_regression(result: dict) -> str:
    """:func:`regression`'s figures as text."""
    (rows, dim), batch = result["shape"], result["batch"]
    return "\n".join([
        f"FFCV regression shape on {result['device']}: {rows} x {dim} float32 + targets, batch {batch} "
        f"(limit: {result['limit']})",
        format_table(result["rows"], ["case", "epoch_s", "min_s", "max_s", "vs_limit"])])
