"""The working set's add (a training forward's de-duplication), before and after it stopped calling torch.unique.

Until 2026-11-28 ``WorkingSet.add`` called ``torch.unique(ids, sorted=True,
return_inverse=True)``, whose distinct count is a host wait of its own on a
GPU. It now sorts the ids and marks each distinct one (NOTES 39, 41). This
times the add against that earlier one (``UniqueWorkingSet``, its algorithm
kept here as the reference) on the same ids, side by side, and checks that
both give the same slots and rows.

Cases (ids of a 1M-row table), each a step's adds into one working set per table:

* ``skip-gram 64``: 64 pairs x 5 negatives, one tied table, three adds
  (centres, contexts, negatives), Zipf 1.1 ids: host work alone;
* ``skip-gram 4096``: the training-step benchmark's shape, 4096 pairs;
* ``word2vec 8192``: the word2vec app's step of 8,192 pairs, one add per
  table: centres sorted with repeats, the context table's sorted distinct rows;
* ``sorted distinct 49152``: one add of 49,152 sorted distinct ids.

Usage:
    python benchmarks/working_set.py [--repeats 200] [--threads 1] [--out DIR]

Writes working_set-{cpu,gpu}.json into benchmarks/results/ (or DIR).
"""

import argparse

import common
import numpy as np
import torch

from speedswap.apps.bench.timing import load_average, time_interleaved
from speedswap.train.sync_free import positions
from speedswap.train.working_set import WorkingSet

VOCAB = 1_000_000


def _check(lo, hi):
    """The range check both adds are handed (the ids are in range: it only has to be called)."""
    assert 0 <= lo <= hi < VOCAB


class UniqueWorkingSet:
    """The working set's add as it was until 2026-11-28 (``torch.unique``), reading the ids' bounds as it did."""

    def __init__(self):
        self.rows = None

    def clear(self):
        self.rows = None

    def add(self, ids, check_bounds):
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        bounds = [unique[0], unique[-1]]
        if self.rows is None:
            check_bounds(*torch.stack(bounds).tolist())
            self.rows, self._sorted, self._slot_of_sorted = unique, unique, torch.arange(len(unique),
                                                                                          device=ids.device)
            return inverse
        held = len(self.rows)
        pos = torch.searchsorted(self._sorted, unique).clamp_(max=held - 1)
        found = self._sorted[pos] == unique
        new = ~found
        n_new, *values = torch.stack([new.sum(), *bounds]).tolist()
        check_bounds(*values)
        new_rows = unique[positions(new, n_new)]
        slots = torch.where(found, self._slot_of_sorted[pos], held - 1 + torch.cumsum(new, 0))
        self.rows = torch.cat([self.rows, new_rows])
        self._sorted, self._slot_of_sorted = torch.sort(self.rows)
        return slots[inverse]


def _zipf(rng, count):
    ids = rng.zipf(1.1, count * 4)
    return ids[ids <= VOCAB][:count] - 1


def cases(rng, device):
    """``{name: [per table, the id tensors of its adds]}``."""
    as_ids = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)  # noqa: E731

    def skipgram(pairs):
        return [as_ids(_zipf(rng, pairs)), as_ids(_zipf(rng, pairs)), as_ids(_zipf(rng, pairs * 5))]

    context = np.unique(_zipf(rng, 8192 * 6))
    return {"skip-gram 64": [skipgram(64)], "skip-gram 4096": [skipgram(4096)],
            "word2vec 8192": [[as_ids(np.sort(_zipf(rng, 8192)))], [as_ids(context)]],
            "sorted distinct 49152": [[as_ids(np.sort(rng.choice(VOCAB, 49_152, replace=False)))]]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--repeats", type=common.positive_int, default=200, help="timed rounds per case")
    parser.add_argument("--threads", type=common.positive_int, default=1, help="torch's intra-op threads")
    common.add_out_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    load = load_average()
    rows_out = []
    for name, tables in cases(np.random.default_rng(0), device).items():
        now = [WorkingSet(sum(len(ids) for ids in adds), device) for adds in tables]
        before = [UniqueWorkingSet() for _ in tables]

        def adding(working_sets, local_of):
            def step():
                locals_ = []
                for ws, adds in zip(working_sets, tables):
                    ws.clear()
                    locals_ += [local_of(ws.add(ids, _check)) for ids in adds] + [ws.rows]
                return locals_
            return step

        # The same slots and rows, add by add, before the timing.
        for got, expected in zip(adding(now, lambda added: added.local)(), adding(before, lambda local: local)()):
            assert torch.equal(got, expected), name
        timed = time_interleaved({"now": adding(now, lambda added: added.local),
                                  "before": adding(before, lambda local: local)}, repeats=args.repeats,
                                 warmup=10, cuda=cuda)
        rows_out.append({"case": name, "ids": sum(len(ids) for adds in tables for ids in adds),
                         "now ms": timed["now"]["median_s"] * 1e3, "before ms": timed["before"]["median_s"] * 1e3,
                         "now / before": timed["now"]["median_s"] / timed["before"]["median_s"],
                         "timings": timed})
    common.print_table(rows_out, ["case", "ids", "now ms", "before ms", "now / before"])
    path = common.write_json(args.out / f"working_set-{'gpu' if cuda else 'cpu'}.json", "working_set", {
        "setup": {"repeats": args.repeats, "threads": args.threads, "device": str(device), "vocab": VOCAB},
        "load_average_before": load, "load_average_after": load_average(), "rows": rows_out})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
