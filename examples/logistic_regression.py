"""Multinomial logistic regression with L1/L2 penalties on numpy arrays (the Lightning Bolts post).

Logistic regression is a one-layer network followed by a softmax; written in
PyTorch it trains on any device and scales with the data. The arrays
``(X, y)`` are split into train/validation/test sets, the training rows are
fed in shuffled batches by :class:`speedswap.BatchFeeder` (one gather per
batch, straight into device tensors; the arrays are read into RAM and
standardised and split as copies, so a file larger than RAM wants the
streaming of ``linear_regression.py``), and the loss is the mean cross-entropy
plus ``l1 * |W|_1 + l2 * |W|_2^2``. Bolts' ``LogisticRegression`` divides its
penalties by the batch size as well (summed cross-entropy plus penalties, over
the batch), so its ``l1_strength=s`` is ``--l1 s/batch_size`` here. Each epoch
reports the validation accuracy; the end, the test accuracy.

Usage::

    python examples/logistic_regression.py                     # synthetic, planted weights
    python examples/logistic_regression.py --x X.npy --y y.npy --l1 1e-4
    python examples/logistic_regression.py --samples 1000000 --features 784 --classes 10

By default the data is synthetic: Gaussian features, of which only
``--informative`` carry signal, and labels drawn from the softmax of a planted
linear model. Because the true model is known, so is the best accuracy any
classifier can reach on this data (the Bayes accuracy, printed alongside).
"""

import os

# Idle OpenMP threads sleep instead of spinning (see examples/word2vec.py): on a shared CPU
# spinning threads made an epoch of logistic_regression.py 70x slower (13 s against 0.18).
# Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import speedswap as ss  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (HelpFormatter, add_common_arguments, backend_and_device,  # noqa: E402
                     existing_file, nonnegative_float, positive_float, positive_int, progress_bar, run, share,
                     write_json)


def synthetic_classes(samples, features, classes, informative, separation, seed):
    """Labels drawn from ``softmax(X @ W)`` with ``W`` nonzero on ``informative`` features only.

    ``separation`` is the standard deviation of each logit: larger means
    easier classes.

    Returns:
        (X float32, y int64, Bayes-optimal predictions ``argmax(X @ W)``)
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features), dtype=np.float32)
    w = np.zeros((features, classes), np.float32)
    w[:informative] = rng.normal(0, separation / np.sqrt(informative), (informative, classes))
    logits = x @ w
    # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits).
    y = np.argmax(logits + rng.gumbel(size=logits.shape), axis=1)
    return x, y.astype(np.int64), np.argmax(logits, axis=1)


def split(n, val_share, test_share, seed):
    """Shuffled index arrays (train, val, test)."""
    order = np.random.default_rng(seed).permutation(n)
    n_test, n_val = int(n * test_share), int(n * val_share)
    return order[n_test + n_val:], order[n_test:n_test + n_val], order[:n_test]


def penalised_loss(model, x, y, l1, l2):
    """Mean cross-entropy plus the L1/L2 penalties on the weights (not the bias)."""
    loss = F.cross_entropy(model(x), y)
    if l1:
        loss = loss + l1 * model.weight.abs().sum()
    if l2:
        loss = loss + l2 * model.weight.pow(2).sum()
    return loss


@torch.no_grad()
def accuracy(model, x, y, batch_size, device):
    """Share of rows classified correctly, in sequential batches (works for data larger than memory)."""
    correct = 0
    for xb, yb in ss.BatchFeeder(x, y, batch_size=batch_size, order="sequential", device=device):
        correct += int((model(xb).argmax(1) == yb).sum())
    return correct / len(y)


def load_numbers(path, option, parser):
    """A numeric array (integers or floats, at least one dimension) from the ``.npy`` at ``path``.

    Raises:
        SystemExit: (``parser.error``) not a ``.npy`` numpy reads without
            pickles, or an array of objects, strings or booleans, or 0-d.
    """
    try:
        array = np.load(path)
    except (OSError, ValueError, EOFError) as exc:  # not a .npy, truncated, or objects (needs pickle)
        reason = ("it is not a .npy file, or holds Python objects" if "pickle" in str(exc)
                  else str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        parser.error(f"{option} {path!r} is not a .npy array of numbers: {reason}")
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "iuf":  # np.load may give an NpzFile
        parser.error(f"{option} {path!r} holds {getattr(array, 'dtype', 'an .npz of')} values, not numbers: "
                     f"give an array of integers or floats")
    if array.ndim == 0:
        parser.error(f"{option} {path!r} holds a single number (a 0-d array): give one row per sample")
    return array


def load_labelled(x_path, y_path, parser):
    """Features ``(n, d)`` float32 and class ids ``(n,)`` int64 from two ``.npy`` files.

    A class id is below the number of rows, so the model's weights (features x
    classes) are never larger than the features themselves.

    Raises:
        SystemExit: (``parser.error``) a file that is not a numeric array,
            features without rows, features that are NaN or infinite (or none per row), different row
            counts, or labels that are not class ids 0, 1, ... below the row
            count (casting 0.3 to 0 would train on labels nobody gave).
    """
    x, y = load_numbers(x_path, "--x", parser), load_numbers(y_path, "--y", parser)
    if not len(x):  # reshape(0, -1) cannot infer the features and raises
        parser.error(f"--x {x_path!r} holds no rows (shape {x.shape}): give one row per sample")
    x = x.reshape(len(x), -1)
    if x.shape[1] == 0:
        parser.error(f"--x has shape {x.shape}: every row needs at least one feature")
    if not np.isfinite(x).all():
        row = int(np.flatnonzero(~np.isfinite(x).all(1))[0])
        parser.error(f"--x row {row} holds NaN or infinite features: give finite numbers")
    if y.ndim != 1 or len(x) != len(y):
        parser.error(f"--x has {len(x):,} rows and --y has shape {y.shape}: give one label per row of --x")
    if not np.all(np.isfinite(y) & (np.floor(y) == y) & (y >= 0)):
        parser.error(f"--y must hold class ids 0, 1, 2, ... (integers >= 0), got {y.dtype} values "
                     f"such as {y[:3].tolist()}")
    if y.max() >= len(y):
        parser.error(f"--y holds class id {y.max():.0f} for {len(y):,} rows: class ids are 0, 1, 2, ... below "
                     f"the number of rows; renumber them densely")
    return x.astype(np.float32), y.astype(np.int64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--x", metavar="X.npy", type=existing_file,
                        help="features, (n, d) (default: synthetic)")
    parser.add_argument("--y", metavar="y.npy", type=existing_file,
                        help="integer class ids 0, 1, 2, ... below the number of rows, (n,)")
    parser.add_argument("--samples", type=positive_int, default=100_000, help="synthetic rows")
    parser.add_argument("--features", type=positive_int, default=100, help="synthetic features")
    parser.add_argument("--classes", type=positive_int, default=5, help="synthetic classes")
    parser.add_argument("--informative", type=positive_int, default=20,
                        help="synthetic features with signal (at most --features)")
    parser.add_argument("--separation", type=positive_float, default=4.0, help="synthetic logit std")
    parser.add_argument("--val-share", type=share, default=0.15, help="share of rows held out for validation")
    parser.add_argument("--test-share", type=share, default=0.15, help="share of rows held out for the test")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="rows per step")
    parser.add_argument("--epochs", type=positive_int, default=5, help="passes over the training rows")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="learning rate")
    parser.add_argument("--l1", type=nonnegative_float, default=0.0, help="L1 strength")
    parser.add_argument("--l2", type=nonnegative_float, default=0.0, help="L2 strength")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if (args.x is None) != (args.y is None):
        parser.error("give both --x and --y, or neither for synthetic data")
    if args.informative > args.features:
        parser.error(f"--informative {args.informative} is more than --features {args.features}")
    if args.val_share + args.test_share >= 1:
        parser.error(f"--val-share {args.val_share} and --test-share {args.test_share} leave no rows to train on")
    backend, device = backend_and_device(args)
    torch.manual_seed(args.seed)
    bayes = None
    if args.x:
        x, y = load_labelled(args.x, args.y, parser)
    else:
        x, y, best = synthetic_classes(args.samples, args.features, args.classes, args.informative,
                                       args.separation, args.seed)
    train, val, test = split(len(y), args.val_share, args.test_share, args.seed)
    if not (len(train) and len(val) and len(test)):
        parser.error(f"{len(y):,} rows split {len(train):,} train / {len(val):,} val / {len(test):,} test: "
                     f"every part needs rows; give more rows or larger shares")
    if not args.x:
        bayes = float((best[test] == y[test]).mean())
    # Standardise with the training rows' statistics (a no-op for the synthetic data).
    mean, std = x[train].mean(0), x[train].std(0) + 1e-6
    x = (x - mean) / std
    classes = int(y.max()) + 1

    model = torch.nn.Linear(x.shape[1], classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    feeder = ss.BatchFeeder(x[train], y[train], batch_size=args.batch_size, order="random",
                            seed=args.seed, device=device)
    print(f"{len(train):,} train / {len(val):,} val / {len(test):,} test rows, "
          f"{x.shape[1]} features, {classes} classes (chance {np.bincount(y[test]).max() / len(test):.3f})")
    history = []
    for epoch in range(args.epochs):
        start, total = time.perf_counter(), 0.0
        for xb, yb in progress_bar(feeder, f"epoch {epoch + 1}", args.quiet):
            loss = penalised_loss(model, xb, yb, args.l1, args.l2)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(yb)
        seconds = time.perf_counter() - start
        history.append({"epoch": epoch + 1, "seconds": seconds, "loss": total / len(train),
                        "val_accuracy": accuracy(model, x[val], y[val], 4096, device)})
        print(f"epoch {epoch + 1}: {seconds:5.2f} s  loss {history[-1]['loss']:.4f}  "
              f"val accuracy {history[-1]['val_accuracy']:.4f}")
    test_accuracy = accuracy(model, x[test], y[test], 4096, device)
    print(f"test accuracy {test_accuracy:.4f}"
          + (f"  (Bayes-optimal on this data: {bayes:.4f})" if bayes is not None else ""))
    figures = {"history": history, "test_accuracy": test_accuracy, "bayes_accuracy": bayes,
               "chance": float(np.bincount(y[test]).max() / len(test))}
    write_json(args, figures)
    return figures


if __name__ == "__main__":
    run(main)
