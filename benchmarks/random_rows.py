"""Random order over a memory-mapped .npy: this checkout's ``RowReader`` against the one at ``--base``, per batch.

An A/B of the reader a ``BatchFeeder`` uses for ``random`` order over file
sources, both in this process: ``RowReader`` of this checkout ("head") and
``RowReader`` of ``speedswap/data/filesource.py`` at git revision ``--base``
("base", default ``HEAD``: the working tree's edits against the last
commit), with numpy fancy indexing of the same map (``x[idx]``) for scale.

For each row size in ``--dims`` (float32 columns; ``+labels`` adds an int64
label file of the same rows, read in the same batches, as ``BatchFeeder(x,
y)`` does), a file of about ``--mb`` MB is written into ``--dir`` with
``speedswap.data.create_npy``, read into the page cache, and read one batch
of ``--batch`` random rows at a time by each contender in turn, the order of
the contenders rotating round by round. ``--drop-behind`` builds the readers
with ``drop_behind=True`` (each row dropped from the page cache once read);
the rows of each batch are then read into the page cache just before it is
timed, so both readers are timed on cached rows. The first ``--warmup``
rounds are discarded; the table gives each contender's median time per batch
and the median over rounds of ``base / head`` with its quartiles (a round's
own ratio: a loaded machine slows a round as a whole). The load average is
recorded before and after each case. The files are deleted at the end.

Run: ``python benchmarks/random_rows.py [--base REV] [--dims 16,512,128+labels] [--mb 300]
[--batch 4096] [--rounds 30] [--drop-behind] [--dir /tmp]``.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import speedswap as ss  # noqa: E402
from speedswap.data import filesource  # noqa: E402

SOURCE = "speedswap/data/filesource.py"


def git(*args):
    """``git args`` in this checkout; returns its standard output, stripped."""
    return subprocess.run(["git", "-C", str(common.ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def reader_at(revision):
    """The ``RowReader`` class of ``filesource.py`` at git ``revision`` of this checkout, imported beside today's."""
    text = git("show", f"{revision}:{SOURCE}")
    module = types.ModuleType(f"{filesource.__name__}_at_{revision}")
    module.__package__ = filesource.__package__  # its relative imports find today's package
    exec(compile(text, f"{revision}:{SOURCE}", "exec"), module.__dict__)
    return module.RowReader


def write_file(directory, shape, dtype, seed):
    """A fresh ``.npy`` of random values in ``directory``; returns its path."""
    fd, path = tempfile.mkstemp(suffix=".npy", dir=directory)
    os.close(fd)
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        fill = lambda lo, hi: rng.integers(0, 2**40, hi - lo)  # noqa: E731
    else:
        fill = lambda lo, hi: rng.standard_normal((hi - lo, *shape[1:]), dtype=dtype)  # noqa: E731
    ss.data.create_npy(path, shape, dtype, fill, progress=False)
    return path


def run_case(paths, base, batch, rounds, warmup, drop_behind):
    """Time base, head and numpy over the files ``paths`` (read together, as a feeder's sources)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    maps = [np.load(path, mmap_mode="r") for path in paths]
    files = [filesource.FileRows.of(m, torch.from_numpy(np.empty((0, *m.shape[1:]), m.dtype))) for m in maps]
    rows, needed = len(maps[0]), (warmup + rounds) * batch
    rng = np.random.default_rng(1)
    ids = {name: np.concatenate([rng.permutation(rows) for _ in range(-(-needed // rows))])
           for name in ("base", "head", "numpy")}
    readers = {"base": base(files, ids["base"], drop_behind=drop_behind),
               "head": filesource.RowReader(files, ids["head"], drop_behind=drop_behind)}
    fds = [os.open(path, os.O_RDONLY) for path in paths]
    try:
        samples = {name: [] for name in ids}
        load = [os.getloadavg()[0]]
        for round_ in range(warmup + rounds):
            lo = round_ * batch
            shift = round_ % len(ids)
            for name in list(ids)[shift:] + list(ids)[:shift]:
                if drop_behind and name != "numpy":  # the batch's rows into the page cache, untimed
                    for fd, file in zip(fds, files):
                        for row in ids[name][lo:lo + batch].tolist():
                            os.pread(fd, file.row_bytes, file.offset + row * file.row_bytes)
                start = time.perf_counter()
                if name == "numpy":
                    [m[ids["numpy"][lo:lo + batch]] for m in maps]
                else:
                    got = readers[name].read(lo, lo + batch)
                samples[name].append(time.perf_counter() - start)
                if name != "numpy":  # every contender reads the right rows
                    for out, m in zip(got, maps):
                        np.testing.assert_array_equal(out.numpy(), m[ids[name][lo:lo + batch]])
        load.append(os.getloadavg()[0])
    finally:
        for reader in readers.values():
            reader.close()
        for fd in fds:
            os.close(fd)
    timed = {name: np.array(values[warmup:]) for name, values in samples.items()}
    result = {name: {**common.summarize(values.tolist()), "p25_s": float(np.percentile(values, 25)),
                     "p75_s": float(np.percentile(values, 75))} for name, values in timed.items()}
    for numerator, denominator in (("base", "head"), ("head", "numpy")):
        ratios = timed[numerator] / timed[denominator]
        result[f"{numerator} / {denominator}"] = {"median": float(np.median(ratios)),
                                                  "p25": float(np.percentile(ratios, 25)),
                                                  "p75": float(np.percentile(ratios, 75))}
    result["load_1min"] = load
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="git revision whose RowReader is the baseline")
    parser.add_argument("--dims", default="16,512,128+labels",
                        help="float32 columns per row, comma-separated; '+labels' adds an int64 label file")
    parser.add_argument("--mb", type=common.positive_int, default=300, help="size of each feature file, MB")
    parser.add_argument("--batch", type=common.positive_int, default=4096)
    parser.add_argument("--rounds", type=common.positive_int, default=30, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="rounds run first and discarded")
    parser.add_argument("--drop-behind", action="store_true", help="readers drop each row from the page cache")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir!r} is not a directory")
    base = reader_at(args.base)
    # What was compared, as commits: "HEAD" names another commit once the change is committed.
    revisions = {"base": git("rev-parse", "--short", args.base),
                 "head": git("rev-parse", "--short", "HEAD")
                 + (" + edits" if git("status", "--porcelain", SOURCE) else "")}
    table = []
    for spec in args.dims.split(","):
        dim, labels = int(spec.split("+")[0]), spec.endswith("+labels")
        rows = args.mb * 10**6 // (4 * dim)
        if rows < args.batch:
            parser.error(f"{args.mb} MB of {dim} float32 columns is {rows:,} rows, fewer than a batch: raise --mb")
        paths = []
        try:
            paths.append(write_file(args.dir, (rows, dim), np.float32, 0))
            if labels:
                paths.append(write_file(args.dir, (rows,), np.int64, 1))
            result = run_case(paths, base, args.batch, args.rounds, args.warmup, args.drop_behind)
        finally:
            for path in paths:
                os.unlink(path)
        row = {"case": spec, "rows": rows, "row_bytes": 4 * dim + 8 * labels}
        for name in ("base", "head", "numpy"):
            row[f"{name} ms"] = result[name]["median_s"] * 1e3
        for pair in ("base / head", "head / numpy"):
            row[pair] = result[pair]["median"]
            row[f"{pair} p25-p75"] = f"{result[pair]['p25']:.3g}-{result[pair]['p75']:.3g}"
        row["load_1min"] = " ".join(f"{x:.1f}" for x in result["load_1min"])
        row["detail"] = result
        table.append(row)
    print(f"\nbase {revisions['base']}, head {revisions['head']}, batch {args.batch}, drop_behind "
          f"{args.drop_behind}, {args.rounds} rounds after {args.warmup} of warm-up; medians per batch, ratios the "
          f"median of the rounds' own")
    common.print_table(table, [c for c in table[0] if c != "detail"])
    common.write_results("random_rows" + ("-drop-behind" if args.drop_behind else ""), out=args.out, payload={
        **revisions, "batch": args.batch, "drop_behind": args.drop_behind, "rounds": args.rounds,
        "warmup": args.warmup, "rows": table,
        "command": "python benchmarks/random_rows.py " + " ".join(sys.argv[1:] if argv is None else argv)})


if __name__ == "__main__":
    main()
