"""What ``python -m speedswap bench`` runs: the transport benchmark, or with ``--all`` the GPU suite.

* :func:`run_transport_bench` (plain ``bench``): the transport benchmark at a
  size this machine holds (CPU, plus the GPU cases where torch sees a GPU);
  JSON, a text table and, when matplotlib is installed, a PNG chart.
* :func:`run_all` (``bench --all``): on a GPU, every ``gpu``-marked test of the
  checkout and every GPU benchmark (transport, training step, feeder, the
  word2vec demo's job against the same job on the CPU and gensim, and a
  vocabulary beyond the GPU's memory), in that order, within a time budget
  (:data:`BUDGET_S`); JSON per benchmark plus ``SUMMARY.md`` with the
  machine, each figure and each target ratio. With ``dry_run`` every step
  runs at tiny sizes on the CPU and the GPU parts are reported as skipped,
  so CI exercises the whole orchestration.

**The budget.** A lent GPU machine runs one command for at most 10 minutes,
and a session has 15 minutes of device time, the machine's start included:
the suite must fit one call, all of it but the last step (the beyond-GPU
vocabulary, which runs in a second call since the gpu tests grew past 200 s).
So the steps run in the order of what the GPU-proof issue needs first, a step starts only while the budget has its
estimated time left (:attr:`SuiteSizes.estimates_s`; otherwise it is
reported as skipped, with the ``--steps`` that runs it alone), and the gpu
tests get what the later steps' estimates leave. The estimates come from
the first GPU run (see the comment above :data:`GPU_SIZES`); each run's real
seconds are in ``suite.json``, to correct them from. A run writes at most 8
files, flat: what a lent machine's output folder hands back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import speedswap as ss

from . import feeder, training_step, transport, word2vec
from .chart import matplotlib_missing, plot
from .gpu_tests import run_gpu_tests
from .summary import render_summary
from .timing import available_ram, load_average, machine, write_json, write_text

__all__ = ["DEFAULT_OUT", "BUDGET_S", "SuiteSizes", "GPU_SIZES", "DRY_RUN_SIZES", "fitting_rows",
           "run_transport_bench", "step_names", "run_all", "STEPS"]

#: Where results go unless ``--out`` says otherwise: beside the caller, not in the checkout.
DEFAULT_OUT = "speedswap-bench"
#: What ``bench --all`` may take by default, in seconds: a lent machine's 600 s command limit,
#: less room for the one benchmark step that may overrun its estimate (steps start within the
#: budget; the gpu tests are interrupted at their share).
BUDGET_S = 500
#: The plain bench's CPU table height; smaller machines get a shorter table.
CPU_ROWS, DIM, IDS = 2_000_000, 128, 131_072
#: A chosen step's outcome until it has run: what a summary written mid-run, or cut off, shows.
NOT_REACHED = {"status": "not reached", "seconds": 0.0,
               "reason": "the run had not reached this step when this was written (if the run has "
                         "ended, it was cut off: run the step again with --steps)"}
#: Why the GPU parts do not run in a dry run.
DRY_RUN_SKIP = "dry run: tiny sizes on the CPU; run bench --all on a CUDA machine for the GPU figures"


@dataclasses.dataclass(frozen=True)
class SuiteSizes:
    """How big each step of ``bench --all`` is.

    Attributes:
        transport_rows, transport_ids, transport_repeats: the transport cases.
        training_vocabs, training_repeats, training_shape: the training step.
        feeder_rows: rows of the FFCV regression shape (None: scaled to free RAM).
        feeder_epochs, feeder_workers, feeder_dim, feeder_batch: the rest of the feeder case.
        word2vec_size, word2vec_rounds: the word2vec job (a key of
            :data:`~speedswap.apps.bench.word2vec.DEMO_SIZES`) and its runs per contender.
        tests_timeout: seconds the gpu tests may take at most.
        estimates_s: per step of :data:`STEPS` (the gpu tests: the least they
            get), the seconds it is expected to take: a step starts only
            while the run's budget has that much left.
    """

    transport_rows: int
    transport_ids: int
    transport_repeats: int
    training_vocabs: tuple
    training_repeats: int
    training_shape: training_step.StepShape
    feeder_rows: Optional[int]
    feeder_epochs: int
    feeder_workers: int
    feeder_dim: int
    feeder_batch: int
    word2vec_size: str
    word2vec_rounds: int
    tests_timeout: float
    estimates_s: dict


# The estimates, from the first run (an H200 with 16 cores, 2026-11-28, bench --all at
# aaae4b3): transport 18 s (5 cases of 1M rows), training step 48 s (1M and 10M rows),
# feeder 36 s (4 GB of data, 6 epochs per contender, the DataLoader's ~2.5 s each
# dominating), word2vec 167 s for 2 rounds of 5 contenders (the cache + prefetch one the
# slowest, ~30 s a run), so 1 round now. Beyond the GPU (89 GB of pinned table and state
# on an H100; skipped where the host has less RAM than that, as the H200's 128 GiB host
# against its 141 GB GPU): 100 s on the H100 (2026-11-28, at 3d2b8ac, where transport took
# 17 s, training 46 s and the feeder 40 s), last because it is the likeliest to overrun. The
# training step has timed three setups more since (one lookup a step, in memory, offloaded
# and cached): 85 s on the H200 (2026-11-28 evening, at 1b425ee, where transport took 20 s,
# the feeder 32 s, and at 1ff8f53 word2vec's one round 86 s); a seventh setup since (the cache
# without prefetch), so 100 s estimated (the most one step may take). The gpu tests, about 760
# cases with the cuda case of every backend-parametrised test, took 162-183 s in 6
# pytest-xdist workers; at 0b7eb58 (H200, 2026-11-29) about 1010 cases took 214 s in 7
# (two runs: 196 s for 948, 18 s for 62), and 120 s in 6 finished half of them. They get
# what the benchmarks' estimates leave of the budget (at least 200 s, at most 240 s; one
# test at most 60 s where pytest-timeout is installed).
# The feeder's 1M rows are FFCV's shape, not scaled to MemAvailable: the GPU machines' RAM
# starts small and grows with use (their notes), and 16 GB of the 128 GiB they have is enough.
GPU_SIZES = SuiteSizes(transport_rows=1_000_000, transport_ids=131_072, transport_repeats=20,
                       training_vocabs=(1_000_000, 10_000_000), training_repeats=20,
                       training_shape=training_step.StepShape(),
                       feeder_rows=1_000_000, feeder_epochs=5, feeder_workers=min(8, os.cpu_count() or 1),
                       feeder_dim=1000, feeder_batch=2048, word2vec_size="demo", word2vec_rounds=1,
                       tests_timeout=240,
                       estimates_s={"gpu tests": 200, "transport": 25, "training step": 100, "feeder": 45,
                                    "word2vec": 90, "beyond gpu": 100})
DRY_RUN_SIZES = SuiteSizes(transport_rows=32_768, transport_ids=4096, transport_repeats=3,
                           training_vocabs=(5_000,), training_repeats=3,
                           training_shape=training_step.StepShape(batch=256, dim=32),
                           feeder_rows=4096, feeder_epochs=2, feeder_workers=1, feeder_dim=1000,
                           feeder_batch=512, word2vec_size="tiny", word2vec_rounds=1, tests_timeout=300,
                           estimates_s={"gpu tests": 60, "transport": 5, "training step": 5, "feeder": 5,
                                        "word2vec": 10, "beyond gpu": 1})


def fitting_rows(available_bytes: int, share: int = 8) -> int:
    """Table rows for the CPU transport case: the full height, or what fits in ``1/share`` of free RAM."""
    return int(max(IDS, min(CPU_ROWS, available_bytes // share // (DIM * 4))))


def _regression_rows(dim: int, cap: int = 1_000_000) -> int:
    """Rows of the FFCV regression shape that fit: the data is held about four times, in a quarter of free RAM."""
    free = available_ram() or 0
    return int(max(16_384, min(cap, free // 16 // ((dim + 1) * 4))))


def _results_dir(out_dir: os.PathLike) -> Path:
    """``out_dir``, created (parents too) before any measurement, so a bad one costs no minutes.

    Raises:
        PathError: ``out_dir`` is a file, or cannot be created (read-only, no permission).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ss.PathError(f"the results directory {str(out_dir)!r} is not a directory (a file is there); "
                           f"give --out a new or existing directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ss.PathError(f"cannot create the results directory {str(out_dir)!r} ({exc.strerror or exc}); "
                           f"give --out a directory that can be written") from exc
    return out_dir


def run_transport_bench(out_dir: os.PathLike = DEFAULT_OUT, quick: bool = False, repeats: int = 20,
                        log: Callable[[str], None] = print) -> tuple:
    """The transport benchmark at a size this machine holds: JSON, text table, PNG chart.

    matplotlib is checked first: without it the JSON is written and the
    chart skipped with a one-line note.

    Args:
        out_dir: where ``transport-bench-{cpu,gpu}.json`` (and ``.png``) go.
        quick: 16x smaller sizes (a smoke run).
        repeats: timed rounds per contender.
        log: receives progress lines and the tables of figures.

    Returns:
        (payload dict, list of paths written)

    Raises:
        PathError: ``out_dir`` is a file or cannot be created (checked before measuring).
    """
    out_dir = _results_dir(out_dir)
    no_chart = matplotlib_missing()
    if no_chart:
        log(f"note: {no_chart}; the JSON is written, the chart skipped")
    scale = 16 if quick else 1
    payload = {"cpu": transport.run_cpu(fitting_rows(available_ram() or 0) // scale, DIM, IDS // scale,
                                        repeats=repeats)}
    log(transport.format_cpu(payload["cpu"]))
    if torch.cuda.is_available():
        payload["gpu"] = transport.run_gpu(1_000_000 // scale, IDS // scale, repeats)
        log(transport.format_gpu(payload["gpu"]))
    stem = out_dir / f"transport-bench-{'gpu' if 'gpu' in payload else 'cpu'}"
    written = [write_json(stem.with_suffix(".json"), "transport", payload)]
    if not no_chart:
        written.append(plot(payload, stem.with_suffix(".png")))
    return payload, written


def _kind(dry_run: bool) -> str:
    """The results files' suffix, as benchmarks/results/ names them."""
    return "cpu" if dry_run else "gpu"


def _written(out_dir: Path, benchmark: str, payload: dict, dry_run: bool) -> dict:
    """Write a step's results to ``<benchmark>-<cpu|gpu>.json`` in ``out_dir``.

    Args:
        out_dir: the suite's results folder.
        benchmark: the benchmark's name, in the file's name and its JSON.
        payload: the step's results.
        dry_run: a run without a GPU (the file is ``-cpu``, and the step says why the GPU parts did not run).

    Returns:
        the step's outcome for suite.json: ran, the file's name, and the results.
    """
    name = f"{benchmark}-{_kind(dry_run)}.json"
    write_json(out_dir / name, benchmark, payload)
    return {"status": "ran", "reason": DRY_RUN_SKIP if dry_run else None, "json": name, "result": payload}


def _gpu_tests_step(out_dir: Path, sizes: SuiteSizes, dry_run: bool, log: Callable) -> dict:
    # No JSON of its own: suite.json holds the outcome (counts, failed tests), the log the rest.
    outcome = run_gpu_tests(out_dir, hide_gpu=dry_run, timeout=sizes.tests_timeout)
    counts = ", ".join(f"{outcome[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if k in outcome)
    log(f"gpu tests: {outcome['status']}" + (f" ({counts})" if counts else "")
        + (f"; {outcome['reason']}" if outcome.get("reason") else ""))
    return {**outcome, "result": outcome}


def _transport_step(out_dir: Path, sizes: SuiteSizes, dry_run: bool, log: Callable) -> dict:
    if dry_run:
        payload = {"cpu": transport.run_cpu(sizes.transport_rows, DIM, sizes.transport_ids,
                                            repeats=sizes.transport_repeats),
                   "gpu_skipped": DRY_RUN_SKIP}
        log(transport.format_cpu(payload["cpu"]))
    else:
        payload = {"gpu": transport.run_gpu(sizes.transport_rows, sizes.transport_ids, sizes.transport_repeats)}
        log(transport.format_gpu(payload["gpu"]))
    return _written(out_dir, "transport", payload, dry_run)


def _training_step(out_dir: Path, sizes: SuiteSizes, dry_run: bool, log: Callable) -> dict:
    device = torch.device("cpu" if dry_run else "cuda")
    # The vocabulary beyond the GPU's memory is a step of its own, the last: the likeliest to overrun.
    payload = training_step.run(sizes.training_vocabs, sizes.training_repeats, device, sizes.training_shape,
                                beyond=False)
    log(training_step.format_results(payload))
    return _written(out_dir, "training_step", payload, dry_run)


def _feeder_step(out_dir: Path, sizes: SuiteSizes, dry_run: bool, log: Callable) -> dict:
    device = torch.device("cpu" if dry_run else "cuda")
    rows = sizes.feeder_rows or _regression_rows(sizes.feeder_dim)
    payload = {"regression": feeder.regression(rows, sizes.feeder_epochs, sizes.feeder_workers, device,
                                               dim=sizes.feeder_dim, batch=sizes.feeder_batch)}
    log(feeder.format_regression(payload["regression"]))
    return _written(out_dir, "feeder", payload, dry_run)


def _word2vec_step(out_dir: Path, sizes: SuiteSizes, dry_run: bool, log: Callable) -> dict:
    payload = word2vec.run(word2vec.DEMO_SIZES[sizes.word2vec_size], sizes.word2vec_rounds, gpu=not dry_run)
    if dry_run:
        payload["skipped"]["gpu"] = DRY_RUN_SKIP
    log(word2vec.format_results(payload))
    return _written(out_dir, "word2vec", payload, dry_run)


def _beyond_gpu_step(out_dir: Path, sizes: SuiteSizes, dry_run: bool, log: Callable) -> dict:
    device = torch.device("cpu" if dry_run else "cuda")
    payload = {"beyond_gpu": training_step.beyond_gpu(device, sizes.training_repeats, sizes.training_shape)}
    log("beyond the GPU's memory: " + training_step.describe_beyond_gpu(payload["beyond_gpu"]))
    return _written(out_dir, "beyond_gpu", payload, dry_run)


#: The steps of ``bench --all``, in the order they run: what the GPU-proof issue needs first
#: (correctness, then the transport and training targets), the riskiest last.
STEPS = {"gpu tests": _gpu_tests_step, "transport": _transport_step, "training step": _training_step,
         "feeder": _feeder_step, "word2vec": _word2vec_step, "beyond gpu": _beyond_gpu_step}


def step_names(spec: str) -> list:
    """The steps named in ``"gpu-tests,transport"`` (hyphens for spaces), in :data:`STEPS`' order.

    Raises:
        OptionError: a name that is not a step.
    """
    wanted = {name.strip().replace("-", " ") for name in spec.split(",") if name.strip()}
    unknown = wanted - set(STEPS)
    if unknown or not wanted:
        raise ss.OptionError(f"unknown bench --all step(s) {sorted(unknown) or spec!r}; choose from "
                          + ", ".join(name.replace(" ", "-") for name in STEPS))
    return [name for name in STEPS if name in wanted]


def run_all(out_dir: os.PathLike = DEFAULT_OUT, dry_run: bool = False,
            log: Callable[[str], None] = print, steps: Optional[Sequence[str]] = None,
            budget_s: float = BUDGET_S) -> dict:
    """Every gpu test and GPU benchmark within ``budget_s``; JSON per step, ``suite.json`` and
    ``SUMMARY.md`` in ``out_dir``.

    A step that raises is recorded as failed with its traceback and the
    others still run: minutes of measurements are not thrown away. A step
    whose estimate (:attr:`SuiteSizes.estimates_s`) exceeds what is left of
    the budget is skipped, with the reason and the ``--steps`` that runs it
    alone; the gpu tests are interrupted when their share is spent (see the
    module docs).

    Args:
        out_dir: the results directory (created).
        dry_run: tiny sizes on the CPU, GPU parts reported as skipped.
        log: receives progress lines and each step's table of figures.
        steps: the steps to run (names of :data:`STEPS`; None: all). The
            others are reported as skipped, so a run can be split over
            several calls, each with its own ``out_dir``.
        budget_s: seconds the run may take; a step starts only while its
            estimate fits in what is left.

    ``suite.json`` and ``SUMMARY.md`` are rewritten after every step, so a
    run stopped from outside (a time limit) leaves the steps it finished.

    Returns:
        The suite record: ``mode``, ``machine``, ``seconds``, ``budget_s``, ``finished``, and per
        step its ``status``, ``reason``, ``seconds``, ``json`` file and ``result`` (the
        figures; ``suite.json`` holds the rest of the record).

    Raises:
        OptionError: a ``budget_s`` that is not a positive, finite number of seconds.
        PathError: ``out_dir`` is a file or cannot be created.
    """
    # Finite too: suite.json records the budget, and JSON has no Infinity.
    if (not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool) or not budget_s > 0
            or not math.isfinite(budget_s)):
        raise ss.OptionError(f"budget_s must be a positive number of seconds, and finite (the default is "
                             f"{BUDGET_S}), got {budget_s!r}")
    out_dir = _results_dir(out_dir)
    sizes = DRY_RUN_SIZES if dry_run else GPU_SIZES
    record = {"mode": "dry run" if dry_run else "full", "machine": machine(),
              "sizes": dataclasses.asdict(sizes), "budget_s": budget_s, "finished": False, "steps": {}}
    start = time.perf_counter()
    chosen = list(STEPS) if steps is None else step_names(",".join(steps))
    for name in STEPS:
        record["steps"][name] = (dict(NOT_REACHED) if name in chosen else
                                 {"status": "skipped", "reason": "not among the steps asked for", "seconds": 0.0})
    for position, name in enumerate(chosen):
        elapsed = time.perf_counter() - start
        left, need = budget_s - elapsed, sizes.estimates_s[name]
        log(f"\n== {name} ({elapsed:.0f} s into the run, {left:.0f} s of the budget left)")
        if left < need:
            flag = name.replace(" ", "-")
            outcome = {"status": "skipped", "seconds": 0.0,
                       "reason": f"budget: {max(left, 0):.0f} s of the {budget_s:.0f} s left, and the step "
                                 f"takes about {need} s (an estimate); run it alone with --steps {flag}"}
            log(f"{name} skipped: {outcome['reason']}")
            record["steps"][name] = outcome
            continue
        run_sizes = sizes
        if name == "gpu tests":
            # The tests get what the later steps' estimates leave, within their own floor and cap.
            later = sum(sizes.estimates_s[other] for other in chosen[position + 1:])
            run_sizes = dataclasses.replace(sizes, tests_timeout=min(sizes.tests_timeout, max(need, left - later)))
        began = time.perf_counter()
        try:
            outcome = STEPS[name](out_dir, run_sizes, dry_run, log)
        except Exception as exc:  # noqa: BLE001 -- a broken step must not lose the others' results
            outcome = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}
            log(f"{name} failed:\n{outcome['traceback']}")
        outcome["seconds"] = time.perf_counter() - began
        record["steps"][name] = outcome
        _write_record(out_dir, record, start)  # a run cut off by a time limit keeps the steps done
    record["finished"] = True
    _write_record(out_dir, record, start)
    return record


def _write_record(out_dir: Path, record: dict, start: float):
    """Write ``suite.json`` and ``SUMMARY.md`` as the run stands now."""
    record["seconds"] = time.perf_counter() - start
    record["load_average_after"] = load_average()
    # The figures are in each step's own JSON file; suite.json says how the run went.
    steps = {name: {k: v for k, v in outcome.items() if k != "result"} for name, outcome in record["steps"].items()}
    # Each replaced whole: a run stopped mid-write keeps the previous step's record.
    write_text(out_dir / "suite.json", json.dumps({**record, "steps": steps}, indent=2, default=str))
    write_text(out_dir / "SUMMARY.md", render_summary(record))
