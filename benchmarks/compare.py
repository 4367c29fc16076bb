"""Did a change make speedswap slower? Compare a fresh benchmark result with a committed one.

Each benchmark writes side-by-side ratios (speedswap against a reference
timed in the same run: the numpy loop, in-memory training, a plain copy),
which move much less with the machine and its load than the times they come
from. This script pairs the ratios of two result files of one benchmark by
where they sit in the JSON (a row is known by its ``case``, ``method``,
``vocab``, ... fields, not by its position), and says for each whether it
got better, worse or stayed within the tolerance. Only the ratios named in
:data:`BETTER` are compared: each has a known good direction. The results of
``distributed.py``, ``soak.py``, ``word2vec_quality.py`` and the beyond-GPU
step hold none (bytes, memory slopes, quality and absolute rates, which no
run beside a reference makes a ratio of) and are refused.

Usage:
    python benchmarks/compare.py NEW.json [--rev HEAD] [--tolerance 0.1]
    python benchmarks/compare.py BASELINE.json NEW.json [--tolerance 0.1]

With one file, the baseline is that file as committed at ``--rev`` (git's
``HEAD`` by default): the benchmark scripts write over the committed result,
so after a change to the feeder,

    python benchmarks/feeder.py --skip-disk --epochs 5 --repeats 5
    python benchmarks/compare.py benchmarks/results/feeder-cpu.json

says what the change did to the feeder's ratios.

Exit status: 0 when no ratio got worse by more than the tolerance, 1 when one
did, 2 when the files cannot be compared (different benchmarks, no shared
ratio, not a result file). A run taken while the load average was above the
machine's core count (or above 1 on a machine of two cores or fewer), or
that recorded none, is flagged: its ratios may be noise.
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

#: Each compared ratio's good direction: ``"higher"`` or ``"lower"``.
BETTER = {
    # feeder.py: other loops' epoch time / BatchFeeder's; BatchFeeder's / the numpy loop's or the copy's
    "speedup_vs_per_item": "higher", "speedup_vs_batch_sampler": "higher",
    "feeder_over_numpy": "lower", "feeder_over_limit": "lower",
    # disk.py: the feeder's bandwidth against dd's, block order against random
    "block_over_sequential_bandwidth": "higher", "block_speedup_over_random": "higher",
    # training_step.py: offloaded time / in-memory time, and throughputs over in-memory's
    "ratio": "lower", "throughput_ratio": "higher", "cached_throughput_ratio": "higher",
    "cached_no_prefetch_throughput_ratio": "higher",
    "one_lookup_throughput_ratio": "higher", "cached_one_lookup_throughput_ratio": "higher",
    # transport.py: reference time / speedswap's, and bandwidth over the copy's
    "gather_vs_index_select": "higher", "scatter_vs_index_copy": "higher",
    "scatter_unchecked_vs_index_copy": "higher", "gather_fraction_of_copy": "higher",
    "scatter_fraction_of_copy": "higher", "gather_fraction_of_h2d": "higher",
    "scatter_fraction_of_d2h": "higher", "round_trip_vs_speedtorch": "higher",
    "round_trip_vs_torch_pinned": "higher",
    # cache.py: against the same run without a cache, and the hit rate
    "bytes_vs_no_cache": "lower", "step_vs_no_cache": "lower", "hit_rate": "higher",
    # eval_read.py: an eval forward's time and rows and bytes from the host against no cache (and its hit rate)
    "time_vs_no_cache": "lower", "rows_h2d_vs_no_cache": "lower", "bytes_h2d_vs_no_cache": "lower",
    # bench word2vec: each GPU contender's words/s over the CPU's and gensim's
    "over_cpu": "higher", "over_gensim": "higher",
    # allocator.py: a step's time under each allocator over glibc's; working_set.py: now over before
    "vs_glibc": "lower", "now / before": "lower",
    # h5_load.py: each way of loading an .h5 table over reading its rows, then checksumming them
    "vs_read_then_crc": "lower",
}

#: Fields that tell the rows of a list apart (the first scalar ones a row has, in this order).
ROW_KEYS = ("case", "method", "setup", "allocator", "order", "name", "distribution", "vocab",
            "cache_fraction", "variant")


class CompareError(Exception):
    """The two files cannot be compared; the message says why."""


def _row_label(row: dict, index: int) -> str:
    keys = [f"{key}={row[key]}" for key in ROW_KEYS
            if key in row and isinstance(row[key], (str, int, float)) and not isinstance(row[key], bool)]
    if "config" in row:  # transport's GPU cases: one per row size and dtype
        keys.append("config=" + json.dumps(row["config"], sort_keys=True))
    return ",".join(keys) if keys else f"#{index}"


def ratios(result: dict) -> Iterator[tuple]:
    """``(path, name, value)`` of every :data:`BETTER` ratio in a result, outside ``targets`` goals.

    A ``targets`` dict holds either goals (strings such as ``">= 25"``) or,
    in transport's results, the measured ratios themselves; only numbers are
    ratios.
    """
    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in BETTER and isinstance(value, (int, float)) and not isinstance(value, bool):
                    if math.isfinite(value):
                        yield "/".join(path + [key]), key, float(value)
                else:
                    yield from walk(value, path + [str(key)])
        elif isinstance(node, list):
            for index, item in enumerate(node):
                label = _row_label(item, index) if isinstance(item, dict) else f"#{index}"
                yield from walk(item, path + [f"[{label}]"])

    return walk(result, [])


def load_averages(result: dict) -> list:
    """Every one-minute load average the result recorded (at its start, per row, per step)."""
    found = []

    def walk(node, key=None):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            if key and "load" in key and node and all(isinstance(x, (int, float)) for x in node):
                # [1 min, 5 min, 15 min] triples (load_average, load_average_before/_after,
                # loadavg_start/_end), or a series of one-minute samples (loadavg_1min)
                triple = key.startswith("load_average") or key in ("loadavg_start", "loadavg_end")
                found.extend(node[:1] if triple else node)
            else:
                for item in node:
                    walk(item)

    walk(result)
    return found


def _noise(result: dict) -> Optional[str]:
    """Why the run's ratios may be noise: a load average above the machine's cores (1 on <= 2 cores), or none recorded."""
    cores = (result.get("machine") or {}).get("cores") or 1
    limit = 1.0 if cores <= 2 else float(cores)
    loads = load_averages(result)
    if not loads:
        return "recorded no load average: whether its ratios are noise is unknown"
    if max(loads) > limit:
        return (f"saw a load average of {max(loads):.2f}: its ratios are noise; run it again "
                f"on a quiet machine before trusting the verdict")
    return None


def _benchmark(result: dict) -> Optional[str]:
    """The result's benchmark, a part of a sweep (``cache.py --caches 0.05``: "cache-subset") as the whole's."""
    name = result.get("benchmark")
    return name[:-len("-subset")] if isinstance(name, str) and name.endswith("-subset") else name


def compare(baseline: dict, new: dict, tolerance: float) -> list:
    """One row per ratio both results hold: ``(path, baseline, new, change, verdict)``.

    ``change`` is new / baseline - 1; ``verdict`` is ``"better"``, ``"worse"``
    or ``"same"`` (within ``tolerance`` of the baseline).

    Raises:
        CompareError: the results are of different benchmarks, or share no ratio.
    """
    names = _benchmark(baseline), _benchmark(new)
    if None in names or names[0] != names[1]:
        raise CompareError(f"these are results of {names[0]!r} and {names[1]!r}: compare two results "
                           f"of one benchmark (each file's 'benchmark' field)")
    before = {path: (name, value) for path, name, value in ratios(baseline)}
    rows = []
    for path, name, value in ratios(new):
        if path not in before:
            continue
        old = before[path][1]
        # A ratio of 0 (the no-cache row's hit rate) has no relative change: 0 again is the same,
        # anything else an unbounded change.
        change = value / old - 1 if old else (0.0 if value == old else math.inf)
        gain = change if BETTER[name] == "higher" else -change
        verdict = "same" if abs(change) <= tolerance else ("better" if gain > 0 else "worse")
        rows.append((path, old, value, change, verdict))
    if not rows:
        raise CompareError(f"the two {names[0]} results share no ratio (a different setup or "
                           f"an older format): nothing to compare")
    return rows


def _parse(text: str, where: str) -> dict:
    try:
        result = json.loads(text)
    except ValueError as exc:
        raise CompareError(f"{where} is not JSON: {exc}") from None
    if not isinstance(result, dict):
        raise CompareError(f"{where} is not a benchmark result (a JSON object with a 'benchmark' field)")
    return result


def _read(path: str) -> dict:
    try:
        return _parse(Path(path).read_text(), path)
    except OSError as exc:
        raise CompareError(f"cannot read {path}: {exc}") from None


def _committed(path: str, rev: str) -> dict:
    """The result file ``path`` as git holds it at ``rev``."""
    file = Path(path).resolve()
    try:
        done = subprocess.run(["git", "show", f"{rev}:./{file.name}"], cwd=file.parent,
                              capture_output=True, text=True)
    except OSError as exc:
        raise CompareError(f"cannot run git to read the committed {path}: {exc}") from None
    if done.returncode:
        raise CompareError(f"git has no {path} at {rev} ({done.stderr.strip()}): "
                           f"give the baseline file as well")
    return _parse(done.stdout, f"{path} at {rev}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="BASELINE.json NEW.json, or NEW.json alone to compare it with its committed self")
    parser.add_argument("--rev", default="HEAD", help="the commit of the baseline, with one file (default HEAD)")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="a relative change within which a ratio counts as the same (default 0.1)")
    args = parser.parse_args(argv)
    if len(args.files) > 2:
        parser.error(f"give one or two result files, not {len(args.files)}")
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance must be in [0, 1), got {args.tolerance}")
    try:
        if len(args.files) == 2:
            baseline, new = _read(args.files[0]), _read(args.files[1])
        else:
            baseline, new = _committed(args.files[0], args.rev), _read(args.files[0])
        rows = compare(baseline, new, args.tolerance)
    except CompareError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    width = max(len(row[0]) for row in rows)
    for path, old, value, change, verdict in rows:
        print(f"{path:<{width}}  {old:9.4g} -> {value:9.4g}  {change:+7.1%}  {verdict}")
    worse = [row for row in rows if row[4] == "worse"]
    noise = {label: why for label, result in (("baseline", baseline), ("new", new))
             if (why := _noise(result)) is not None}
    print(f"\n{len(rows)} ratios: {sum(r[4] == 'better' for r in rows)} better, {len(worse)} worse, "
          f"{sum(r[4] == 'same' for r in rows)} within {args.tolerance:.0%}")
    for label, why in noise.items():
        print(f"the {label} run {why}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
