"""Matrix factorisation on explicit ratings, with user and item tables offloaded.

A rating is predicted as ``mean + user_bias + item_bias + user_vector . item_vector``.
The four tables (two vector tables, two bias tables) and their Adam state live
in host memory as :class:`speedswap.OffloadedEmbedding`; each step moves only
the rows of the batch's users and items to the device. The same run is then
repeated entirely in memory (``nn.Embedding(sparse=True)`` + ``SparseAdam``,
which is what offloaded Adam is defined to equal), from the same initial
values and the same batches: the two must agree to float32 rounding.

Usage::

    python examples/recommender.py                          # synthetic low-rank ratings
    python examples/recommender.py --ratings ml-100k/u.data # MovieLens 100k
    python examples/recommender.py --ratings ml-25m/ratings.csv --dim 64 --epochs 5
    torchrun --nproc-per-node 2 examples/recommender.py --distributed   # tables sharded over 2 ranks

MovieLens files come from https://grouplens.org/datasets/movielens/ (ml-100k
holds ``u.data``; ml-latest-small, ml-25m hold ``ratings.csv``).

By default the ratings are synthetic: ``users x items`` with a planted rank
``--rank`` structure plus biases and Gaussian noise of ``--noise``, so the
reachable test RMSE (the noise) and the predict-the-mean baseline are known.
"""

import os

# Idle OpenMP threads sleep instead of spinning (see examples/word2vec.py): on a shared CPU
# spinning threads made an epoch of logistic_regression.py 70x slower (13 s against 0.18).
# Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import speedswap as ss  # noqa: E402
from speedswap.apps.demo import format_rows, memory_summary  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (HelpFormatter, add_common_arguments, backend_and_device, check_torchrun,  # noqa: E402
                     existing_file, memory_rows, nonnegative_float, positive_float, positive_int, progress_bar,
                     run, share, write_json)


def read_ratings(path):
    """MovieLens ratings as ``(users, items, ratings)`` with dense 0-based ids.

    Reads ``u.data`` (ml-100k: tab-separated ``user item rating timestamp``,
    no header) and ``ratings.csv`` (ml-latest, ml-25m: ``userId,movieId,rating,timestamp``
    with a header). MovieLens ids have gaps, so they are renumbered.

    Raises:
        FileFormatError: the file is empty, not in that format (another
            separator, fewer columns, text where numbers go), or holds ids
            that are not integers or ratings that are NaN or infinite.
    """
    path = Path(path)
    csv = path.suffix == ".csv"
    expected = ("a MovieLens ratings.csv: a header line, then userId,movieId,rating,timestamp lines" if csv
                else "a MovieLens u.data: tab-separated 'user item rating timestamp' lines, no header")
    try:
        with warnings.catch_warnings():  # an empty file: numpy warns, and the check below says so
            warnings.simplefilter("ignore", UserWarning)
            raw = np.loadtxt(path, delimiter="," if csv else "\t", skiprows=1 if csv else 0,
                             usecols=(0, 1, 2), dtype=np.float64, ndmin=2)
    except ValueError as exc:  # text where numbers go, another separator, a short line, not UTF-8
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ss.FileFormatError(f"{str(path)!r} is not {expected} ({first})") from exc
    if not len(raw):
        raise ss.FileFormatError(f"{str(path)!r} holds no ratings; expected {expected}")
    if not np.isfinite(raw).all() or np.any(raw[:, :2] != np.floor(raw[:, :2])):
        line = int(np.flatnonzero(~np.isfinite(raw).all(1) | (raw[:, :2] != np.floor(raw[:, :2])).any(1))[0])
        raise ss.FileFormatError(f"{str(path)!r} line {line + 1 + csv} holds {raw[line].tolist()}: ids must be "
                                 f"integers and ratings finite numbers; expected {expected}")
    _, users = np.unique(raw[:, 0].astype(np.int64), return_inverse=True)
    _, items = np.unique(raw[:, 1].astype(np.int64), return_inverse=True)
    return users.astype(np.int64), items.astype(np.int64), raw[:, 2].astype(np.float32)


def synthetic_ratings(users, items, rank, count, noise, seed):
    """Ratings with a planted low-rank structure: ``3.5 + b_u + b_i + p_u . q_i + noise``.

    Items are drawn with Zipf-like popularity (exponent 0.6), so a batch
    repeats popular items the way real rating logs do. ``p . q`` has unit
    variance whatever the rank.

    Returns:
        (users, items, ratings) arrays.
    """
    rng = np.random.default_rng(seed)
    scale = rank ** -0.25
    p, q = rng.normal(0, scale, (users, rank)), rng.normal(0, scale, (items, rank))
    user_bias, item_bias = rng.normal(0, 0.3, users), rng.normal(0, 0.3, items)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.6
    u = rng.integers(0, users, count)
    i = rng.choice(items, count, p=popularity / popularity.sum())
    r = 3.5 + user_bias[u] + item_bias[i] + (p[u] * q[i]).sum(1) + rng.normal(0, noise, count)
    return u, i, r.astype(np.float32)


#: Adam's epsilon for both runs. Adam adds it to sqrt(v / bias_correction2) and
#: SparseAdam to sqrt(v), so with the usual 1e-8 they are slightly different
#: functions; with a negligible epsilon both compute the same lazy Adam update.
EPS = 1e-30


class Factorisation(torch.nn.Module):
    """Biased matrix factorisation over four embedding modules (offloaded or in memory)."""

    def __init__(self, user_vec, item_vec, user_bias, item_bias, mean):
        super().__init__()
        self.user_vec, self.item_vec = user_vec, item_vec
        self.user_bias, self.item_bias = user_bias, item_bias
        self.mean = float(mean)

    def forward(self, users, items):
        """Predicted ratings and each pair's squared vector norms (for the L2 penalty)."""
        p, q = self.user_vec(users), self.item_vec(items)
        predicted = (self.mean + self.user_bias(users).squeeze(-1) + self.item_bias(items).squeeze(-1)
                     + (p * q).sum(-1))
        return predicted, p.pow(2).sum(-1) + q.pow(2).sum(-1)


def initial_tables(num_users, num_items, dim, seed):
    """Initial values shared by both runs: N(0, 0.1) vectors, zero biases."""
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.1, (num_users, dim)).astype(np.float32),
            rng.normal(0, 0.1, (num_items, dim)).astype(np.float32),
            np.zeros((num_users, 1), np.float32), np.zeros((num_items, 1), np.float32)]


def offloaded_model(initial, mean, args, backend):
    """Four OffloadedEmbeddings (rows and Adam state on the host) and their Adam."""
    tables = []
    for values in initial:
        emb = ss.OffloadedEmbedding(values.shape[0], values.shape[1], max_rows=args.batch_size,
                                    storage=args.storage, backend=backend)
        emb.table.apply_(lambda table, values=values: table.copy_(torch.from_numpy(values)))
        tables.append(emb)
    model = Factorisation(*tables, mean)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=EPS)
    for emb in tables:
        emb.attach(optimizer)
    return model, optimizer, lambda: [emb.table.to_numpy() for emb in tables]


def in_memory_model(initial, mean, args, device):
    """The same model with whole tables in memory: nn.Embedding(sparse=True) + SparseAdam."""
    tables = [torch.nn.Embedding.from_pretrained(torch.tensor(values), freeze=False, sparse=True)
              for values in initial]
    model = Factorisation(*tables, mean).to(device)
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=args.lr, eps=EPS)
    return model, optimizer, lambda: [emb.weight.detach().cpu().numpy() for emb in tables]


def largest_difference(ours, theirs):
    """The largest absolute difference between two runs' tables; inf where either holds NaN or inf.

    A float max() would drop a NaN after the first table (``max(1e-8, nan)``
    is ``1e-8``), so a diverged run would pass as agreeing.
    """
    largest = 0.0
    for a, b in zip(ours, theirs, strict=True):
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            return float("inf")
        largest = max(largest, float(np.abs(a - b).max(initial=0.0)))
    return largest


def rmse(tables, mean, users, items, ratings):
    """RMSE of the full tables' predictions (numpy, so both runs are scored the same way)."""
    user_vec, item_vec, user_bias, item_bias = tables
    predicted = (mean + user_bias[users, 0] + item_bias[items, 0]
                 + np.einsum("ij,ij->i", user_vec[users], item_vec[items]))
    return float(np.sqrt(np.mean((predicted - ratings) ** 2)))


def fit(model, optimizer, tables, data, train, test, mean, args, device, label, score=True):
    """Train for ``--epochs``; returns per-epoch figures and the wall time.

    ``tables()`` is called after every epoch (a collective for sharded
    tables); only a process with ``score`` computes and prints the RMSEs.
    """
    users, items, ratings = data
    feeder = ss.BatchFeeder(users[train], items[train], ratings[train], batch_size=args.batch_size,
                            order="random", seed=args.seed, device=device)
    history, seconds = [], 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for batch_users, batch_items, batch_ratings in progress_bar(feeder, f"{label} epoch {epoch + 1}",
                                                                    args.quiet):
            predicted, norms = model(batch_users, batch_items)
            loss = (predicted - batch_ratings).pow(2).mean() + args.l2 * norms.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seconds += time.perf_counter() - start
        current = tables()
        if not score:
            continue
        history.append({"epoch": epoch + 1,
                        "train_rmse": rmse(current, mean, users[train], items[train], ratings[train]),
                        "test_rmse": rmse(current, mean, users[test], items[test], ratings[test])})
        print(f"{label:>10} epoch {epoch + 1}: train RMSE {history[-1]['train_rmse']:.4f}  "
              f"test RMSE {history[-1]['test_rmse']:.4f}")
    return history, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--ratings", metavar="PATH", type=existing_file,
                        help="MovieLens u.data or ratings.csv "
                        "(default: synthetic low-rank ratings)")
    parser.add_argument("--users", type=positive_int, default=2000, help="synthetic users")
    parser.add_argument("--items", type=positive_int, default=1000, help="synthetic items")
    parser.add_argument("--rank", type=positive_int, default=8, help="synthetic planted rank")
    parser.add_argument("--count", type=positive_int, default=200_000, help="synthetic ratings")
    parser.add_argument("--noise", type=nonnegative_float, default=0.5, help="synthetic rating noise (std)")
    parser.add_argument("--dim", type=positive_int, default=8, help="factor dimension")
    parser.add_argument("--epochs", type=positive_int, default=6, help="passes over the training ratings")
    parser.add_argument("--batch-size", type=positive_int, default=1024, help="ratings per step")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--l2", type=nonnegative_float, default=0.02, help="L2 penalty on the pair's vectors")
    parser.add_argument("--test-share", type=share, default=0.1,
                        help="share of ratings held out for the test (between 0 and 1)")
    parser.add_argument("--storage", default="pinned", choices=("pinned", "mapped", "pageable", "device"),
                        help="where the offloaded tables and their Adam state live")
    parser.add_argument("--no-reference", action="store_true", help="skip the in-memory run")
    parser.add_argument("--distributed", action="store_true",
                        help="run under torchrun: the four tables row-sharded over the ranks "
                        "(README: 'Several processes and machines'); no in-memory run")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    check_torchrun(parser, args)
    backend, device = backend_and_device(args)

    if args.ratings:
        data = read_ratings(args.ratings)
        noise = None
    else:
        data = synthetic_ratings(args.users, args.items, args.rank, args.count, args.noise, args.seed)
        noise = args.noise
    users, items, ratings = data
    num_users, num_items = int(users.max()) + 1, int(items.max()) + 1
    order = np.random.default_rng(args.seed).permutation(len(ratings))
    split = int(len(ratings) * (1 - args.test_share))
    train, test = np.sort(order[:split]), np.sort(order[split:])
    if not len(train) or not len(test):
        parser.error(f"--test-share {args.test_share} of {len(ratings):,} ratings leaves {len(train):,} to train "
                     f"on and {len(test):,} to test: give more ratings or another share")
    mean = float(ratings[train].mean())
    baseline = float(np.sqrt(np.mean((ratings[test] - mean) ** 2)))
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        print(f"{len(ratings):,} ratings of {num_users:,} users x {num_items:,} items; "
              f"predict-the-mean test RMSE {baseline:.4f}" + (f", noise {noise}" if noise else ""))

    initial = initial_tables(num_users, num_items, args.dim, args.seed)
    if args.distributed:
        from _distributed import recommender_sharded
        history, seconds, rank = recommender_sharded(args, initial, mean, data, train, test, backend,
                                                     fit, Factorisation, EPS)
        if rank != 0:
            return None
        figures = {"baseline_rmse": baseline, "noise": noise, "sharded": history,
                   "world_size": torch.distributed.get_world_size(), "seconds": seconds}
        print(format_rows([("predict-the-mean test RMSE", f"{baseline:.4f}"),
                           ("sharded test RMSE", f"{history[-1]['test_rmse']:.4f}  "
                                                 f"({figures['world_size']} ranks, {seconds:.1f} s)")]))
        write_json(args, figures)
        return figures
    model, optimizer, tables = offloaded_model(initial, mean, args, backend)
    offloaded, offloaded_s = fit(model, optimizer, tables, data, train, test, mean, args, device,
                                 "offloaded")
    memory = memory_summary(model, optimizer)
    offloaded_tables = [table.copy() for table in tables()]
    figures = {"baseline_rmse": baseline, "noise": noise, "offloaded": offloaded,
               "offloaded_seconds": offloaded_s, "memory": memory}
    rows = [("predict-the-mean test RMSE", f"{baseline:.4f}"),
            ("offloaded test RMSE", f"{offloaded[-1]['test_rmse']:.4f}  "
                                    f"(train {offloaded[-1]['train_rmse']:.4f}, {offloaded_s:.1f} s)")]
    if not args.no_reference:
        model, optimizer, tables = in_memory_model(initial, mean, args, device)
        reference, reference_s = fit(model, optimizer, tables, data, train, test, mean, args, device,
                                     "in memory")
        difference = largest_difference(offloaded_tables, tables())
        figures.update(in_memory=reference, in_memory_seconds=reference_s, max_table_difference=difference)
        rows += [("in-memory test RMSE", f"{reference[-1]['test_rmse']:.4f}  "
                                         f"(train {reference[-1]['train_rmse']:.4f}, {reference_s:.1f} s)"),
                 ("largest table difference", f"{difference:.2e}" if np.isfinite(difference)
                  else "inf: a table holds NaN or inf (a run diverged)")]
    if noise:
        rows.append(("noise (best reachable)", f"{noise:.4f}"))
    rows += memory_rows(memory, args.storage)
    print(format_rows(rows))
    write_json(args, figures)
    return figures


if __name__ == "__main__":
    run(main)
