"""Large-scale linear regression streamed from a .npy file (the FFCV tutorial, with speedswap).

An ``N x D`` float32 matrix ``X`` is written to ``X.npy`` chunk by chunk with
``ss.data.create_npy`` (so it may be larger than RAM), with responses
``Y = X @ W + b + noise``. Training streams it with :class:`speedswap.BatchFeeder`
over a :class:`speedswap.DataGadget` (memory-mapped when the file is larger
than the RAM available, or with ``--mmap``; the feeder then reads it with
large ``pread`` calls, not through the map): one gather per batch instead of
one ``__getitem__`` per row.
Features are normalised with statistics from one sequential pass, then
plain SGD on the squared loss runs on the device. Each epoch reports its time,
the mean loss and ``||w - W||``, the distance of the recovered weights from
the true ones, which shrinks as training converges.

Usage::

    python examples/linear_regression.py                        # 100,000 x 100, random order
    python examples/linear_regression.py --rows 1000000 --features 1000 --order block
    python examples/linear_regression.py --compare              # also TensorDataset + DataLoader
    python examples/linear_regression.py --rows 6750000 --features 1000 --order block \
        --cold --ceiling --compare --max-seconds 60 --epochs 2  # 27 GB, larger than a 24 GiB machine's RAM

``--order block`` is the quasi-random order for files larger than RAM
(FFCV's QUASI_RANDOM): contiguous blocks read in shuffled order, rows
shuffled within a window of blocks. ``--cold`` empties the page cache for
the files before every epoch, so each epoch reads from disk; ``--ceiling``
times ``dd`` reading ``X.npy`` once (the sequential-read ceiling) to compare.
"""

import os

# Idle OpenMP threads sleep instead of spinning (see examples/word2vec.py): on a shared CPU
# spinning threads made an epoch of logistic_regression.py 70x slower (13 s against 0.18).
# Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import speedswap as ss  # noqa: E402
from speedswap.apps.demo import storage_words  # noqa: E402
from speedswap.atomic import drop_cache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (HelpFormatter, add_common_arguments, backend_and_device, positive_float,  # noqa: E402
                     positive_int, progress_bar, run, write_json)


def generate_dataset(directory, rows, features, seed=0, chunk_bytes=64 << 20):
    """Write ``X.npy`` (rows x features float32), ``Y.npy`` and ``truth.npz`` (W, b) into ``directory``.

    ``X`` is uniform on [0, 1) and ``Y = X @ W + b + N(0, 1)`` with ``W`` and
    ``b`` uniform on [0, 1), as in the FFCV tutorial. Rows are produced
    ``chunk_bytes`` at a time and written by ``ss.data.create_npy``, so a
    dataset larger than RAM can be made. An existing dataset of the same
    shape and seed is reused; one this function made for another shape or
    seed (``truth.npz`` says so) is replaced. ``truth.npz`` is written first,
    so an interrupted run's files are known to be its own.

    Returns:
        (path of X.npy, path of Y.npy, W, b)

    Raises:
        OptionError: ``rows`` or ``features`` below 1.
        PathError: ``directory`` is a file, or holds an ``X.npy`` or ``Y.npy``
            this function did not make (no ``truth.npz`` of its own beside
            them): they are not replaced. Raised before anything is written.
    """
    if rows < 1 or features < 1:
        raise ss.OptionError(f"a dataset of {rows} x {features}: rows and features must be at least 1")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ss.PathError(f"{str(directory)!r} is a file, not a directory for X.npy and Y.npy")
    x_path, y_path, truth_path = directory / "X.npy", directory / "Y.npy", directory / "truth.npz"
    truth = _read_truth(truth_path)
    if truth is None:
        theirs = [path.name for path in (x_path, y_path) if path.exists()]
        if theirs:
            raise ss.PathError(f"{str(directory)!r} holds {' and '.join(theirs)} that this example did not make "
                               f"(no truth.npz of its own beside them) and will not replace: give another "
                               f"directory, or remove them")
    elif (truth["shape"] == (rows, features) and truth["seed"] == seed and truth["complete"]
          and _npy_shape(x_path) == (rows, features) and _npy_shape(y_path) == (rows,)):
        return x_path, y_path, truth["W"], truth["b"]
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, b = rng.random(features).astype(np.float32), float(rng.random())
    y = np.empty(rows, dtype=np.float32)  # 4 bytes a row: fits where X does not

    def x_rows(start, stop):
        chunk = rng.random((stop - start, features), dtype=np.float32)
        y[start:stop] = chunk @ w + b + rng.standard_normal(stop - start)
        return chunk

    # Claimed before X.npy and Y.npy are written: a run stopped half-way leaves files marked as this
    # example's (incomplete), which the next run replaces instead of refusing as someone else's.
    np.savez(truth_path, W=w, b=b, shape=(rows, features), seed=seed, complete=False)
    ss.data.create_npy(x_path, (rows, features), np.float32, x_rows, chunk_bytes=chunk_bytes)
    np.save(y_path, y)
    np.savez(truth_path, W=w, b=b, shape=(rows, features), seed=seed, complete=True)
    return x_path, y_path, w, b


def _read_truth(path):
    """``truth.npz`` as ``{W, b, shape, seed, complete}``, or None when there is none of this example's."""
    try:
        with np.load(path) as truth:
            return {"W": truth["W"], "b": float(truth["b"]), "shape": tuple(truth["shape"].tolist()),
                    "seed": int(truth["seed"]),
                    # Files written before the flag existed wrote truth.npz last: complete.
                    "complete": bool(truth["complete"]) if "complete" in truth.files else True}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # none, not an npz, or not this example's
        return None


def _npy_shape(path):
    """The shape of the ``.npy`` at ``path`` (read from its header), or None when there is no readable one."""
    try:
        return np.load(path, mmap_mode="r").shape
    except (OSError, ValueError):
        return None


def feature_stats(x, batch_size, device):
    """Per-feature mean and standard deviation from one sequential pass (float64 sums)."""
    total = total_sq = None
    for (batch,) in ss.BatchFeeder(x, batch_size=batch_size, order="sequential", device=device):
        batch = batch.double()
        total = batch.sum(0) if total is None else total + batch.sum(0)
        total_sq = batch.pow(2).sum(0) if total_sq is None else total_sq + batch.pow(2).sum(0)
    mean = total / len(x)
    return mean.float(), (total_sq / len(x) - mean.pow(2)).sqrt().float()


def fit(loader, mean, std, true_w, *, epochs, lr, device, label, progress=True, cold=(),
        max_seconds=None):
    """SGD on the squared loss over the normalised features; per-epoch figures.

    ``loader`` is any iterable of ``(x, y)`` batches, so the speedswap feeder
    and the DataLoader baseline run exactly the same arithmetic. The files in
    ``cold`` are dropped from the page cache before each epoch. An epoch
    that passes ``max_seconds`` (None: no limit) is stopped after the batch
    in hand, and its time extrapolated from the share of rows it saw
    (``complete`` says which).

    Returns:
        a list with each epoch's ``seconds``, mean ``loss``, ``w_distance``
        (``||w - W||``) and ``complete``.
    """
    w = torch.zeros(len(mean), device=device)
    b = torch.zeros(1, device=device)
    true_w = torch.from_numpy(true_w).to(device)
    history = []
    max_seconds = float("inf") if max_seconds is None else max_seconds
    rows = len(loader.dataset) if hasattr(loader, "dataset") else None
    for epoch in range(epochs):
        for path in cold:
            drop_cache(path)
        total_loss, seen = 0.0, 0
        start = time.perf_counter()
        for x, y in progress_bar(loader, f"{label} epoch {epoch + 1}", quiet=not progress):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = (x - mean) / std
            residual = x @ w + b - y
            w -= lr * (x.T @ residual) / len(x)
            b -= lr * residual.mean()
            total_loss += float(residual.pow(2).sum())
            seen += len(x)
            if time.perf_counter() - start > max_seconds:  # after a batch: an epoch sees at least one
                break
        seconds = time.perf_counter() - start
        total = rows if rows is not None else loader.rows_per_rank
        complete = seen == total
        if not complete:
            seconds *= total / seen
        # In the normalised coordinates w_j = W_j * std_j, so W is recovered as w / std.
        distance = float(torch.linalg.vector_norm(w / std - true_w))
        history.append({"epoch": epoch + 1, "seconds": seconds, "loss": total_loss / seen,
                        "w_distance": distance, "complete": complete})
        note = "" if complete else f"  (extrapolated from {seen:,} of {total:,} rows)"
        print(f"{label:>10} epoch {epoch + 1}: {seconds:6.2f} s  loss {total_loss / seen:8.4f}  "
              f"||w - W|| {distance:.4f}{note}")
    return history


def dataloader(x_path, y_path, batch_size, seed):
    """The baseline from the FFCV tutorial, over memory maps: TensorDataset + shuffling DataLoader."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    with warnings.catch_warnings():  # torch cannot mark a tensor over a read-only map read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        dataset = TensorDataset(torch.from_numpy(np.load(x_path, mmap_mode="r")),
                                torch.from_numpy(np.load(y_path, mmap_mode="r")))
    return DataLoader(dataset, batch_size=batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def dd_seconds(path):
    """Seconds ``dd bs=16M`` takes to read ``path`` from disk: the sequential-read ceiling."""
    drop_cache(path)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=100_000, help="N, rows of X (at least 2)")
    parser.add_argument("--features", type=positive_int, default=100, help="D, columns of X")
    parser.add_argument("--data-dir", help="where X.npy / Y.npy go; X.npy or Y.npy this example did not make "
                        "are refused, not replaced (default: a folder in the temp dir)")
    parser.add_argument("--order", choices=("random", "block", "sequential"), default="random",
                        help="order rows are visited in each epoch (block: random blocks, read sequentially)")
    parser.add_argument("--batch-size", type=positive_int, default=2048, help="rows per step")
    parser.add_argument("--epochs", type=positive_int, default=5, help="passes over the data")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="learning rate")
    parser.add_argument("--mmap", action="store_true",
                        help="memory-map X.npy even if it fits in RAM (default: only if it does not)")
    parser.add_argument("--compare", action="store_true",
                        help="also train from a TensorDataset + DataLoader over memory maps of the files")
    parser.add_argument("--cold", action="store_true",
                        help="empty the page cache for the files before every epoch (read from disk)")
    parser.add_argument("--ceiling", action="store_true",
                        help="time dd reading X.npy once from disk, the sequential-read ceiling")
    parser.add_argument("--max-seconds", type=positive_float,
                        help="stop a DataLoader epoch after this long and extrapolate its time "
                        "(default: no limit)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.rows < 2:
        parser.error("--rows must be at least 2: the features are normalised by their standard deviation")
    if args.max_seconds is not None and not args.compare:
        parser.error("--max-seconds limits the DataLoader's epochs, which only --compare runs: give --compare")
    backend, device = backend_and_device(args)
    data_dir = args.data_dir or Path(tempfile.gettempdir()) / f"speedswap-linreg-{args.rows}x{args.features}"

    start = time.perf_counter()
    x_path, y_path, true_w, _ = generate_dataset(data_dir, args.rows, args.features, args.seed)
    print(f"data: {x_path} ({args.rows:,} x {args.features}, "
          f"{args.rows * args.features * 4 / 1e6:,.0f} MB), ready in {time.perf_counter() - start:.1f} s")

    x = ss.DataGadget(str(x_path), mmap=True if args.mmap else None, backend=backend)
    y = ss.DataGadget(str(y_path), mmap=True if args.mmap else None, backend=backend)
    mean, std = feature_stats(x, args.batch_size, device)
    feeder = ss.BatchFeeder(x, y, batch_size=args.batch_size, order=args.order, seed=args.seed,
                            device=device)
    print(f"speedswap: X in storage {storage_words(x.storage, x.table.pinned, device)}, order {args.order!r}, "
          f"{len(feeder)} batches of {args.batch_size}")
    cold = (x_path, y_path) if args.cold else ()
    options = dict(epochs=args.epochs, lr=args.lr, device=device, progress=not args.quiet, cold=cold)
    size = os.path.getsize(x_path)
    figures = {"rows": args.rows, "features": args.features, "order": args.order, "x_bytes": size,
               "cold": args.cold, "initial_w_distance": float(np.linalg.norm(true_w)),
               "load_1min": [os.getloadavg()[0]],
               "speedswap": fit(feeder, mean, std, true_w, label="speedswap", **options)}
    ours = np.median([e["seconds"] for e in figures["speedswap"]])
    figures["load_1min"].append(os.getloadavg()[0])
    if args.ceiling:
        figures["dd_seconds"] = dd_seconds(x_path)
        print(f"dd reads X.npy ({size / 1e9:.1f} GB) in {figures['dd_seconds']:.1f} s: a speedswap epoch "
              f"takes {ours / figures['dd_seconds']:.2f}x that")
    if args.compare:
        figures["dataloader"] = fit(dataloader(x_path, y_path, args.batch_size, args.seed),
                                    mean, std, true_w, label="DataLoader", max_seconds=args.max_seconds,
                                    **options)
        theirs = np.median([e["seconds"] for e in figures["dataloader"]])
        print(f"median epoch: speedswap {ours:.2f} s, DataLoader {theirs:.2f} s "
              f"({theirs / ours:.1f}x)")
    figures["load_1min"].append(os.getloadavg()[0])
    write_json(args, figures)
    return figures


if __name__ == "__main__":
    run(main)
