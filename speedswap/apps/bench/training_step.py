"""A skip-gram training step with Adam: offloaded (OffloadedEmbedding) vs entirely in memory.

Step: 4096 (center, context) pairs and 5 negatives per pair, dim 128, ids
drawn from a Zipf distribution over the vocabulary (p ~ 1/rank, as word
frequencies), one table shared by centers, contexts and negatives (tied
embeddings: the work per step is that of two tables, the memory half, so a
10M-row table with Adam's two state tables, 15 GB, fits a 24 GB machine).

* in memory: ``nn.Embedding(sparse=True)`` + ``SparseAdam`` (in RAM on a CPU,
  all on the GPU on a GPU) -- lazy Adam, the same function as the offloaded one.
* offloaded: ``OffloadedEmbedding`` with ``Adam`` attached; table and state in
  host memory (pinned on a GPU), ``max_rows`` = batch * (2 + negatives).
* cached: the same with a device cache of 5% of the rows, and the next
  step's ids prefetched between this step's forward and backward.
* cached without prefetch: the cache alone, so the two can be told apart
  (a prefetch is a host wait of its own on a GPU).
* in memory, offloaded and cached again, each step's three lookups
  (centers, contexts, negatives) made in one call
  (:func:`skipgram_loss_one_lookup`): the offloaded path's work per call
  (validation, de-duplication, a gather of the new rows, and on a GPU a host
  wait, two with a cache) is paid once a step instead of three times. The
  same loss, the same rows trained.

The setups are timed interleaved (one step of each per round, so a noisy
neighbour hits both alike) when both fit at once; otherwise one after the
other, each alone. On a GPU each setup's device memory is measured when it is
built (torch's allocator, resident and peak over its first steps): the
offloaded one holds only the working set and must not grow with the vocabulary.

>>> payload = run([500], repeats=2, device=torch.device("cpu"), shape=StepShape(batch=32, dim=8))
>>> entry = payload["results"][0]
>>> entry["vocab"], entry["offloaded"]["interleaved"], entry["throughput_ratio"] > 0
(500, True, True)
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import speedswap as ss

from .timing import available_ram, format_table, load_average, physical_ram, time_interleaved, time_one

__all__ = ["StepShape", "TARGET", "CACHED_TARGET", "GAP_TARGET", "CACHE_FRACTION", "BEYOND_GPU",
           "zipf_batches", "skipgram_loss", "skipgram_loss_one_lookup", "build_in_memory", "build_offloaded",
           "build_cached", "measure", "beyond_gpu", "run", "format_results", "describe_beyond_gpu"]

#: Offloaded throughput over in-memory throughput at a vocabulary that fits both (GPU).
TARGET = (">=", 0.9)
#: The same with a device cache and prefetch.
CACHED_TARGET = (">=", 0.95)
#: The gap to in-memory throughput with the cache over the gap without it: at least halved.
GAP_TARGET = ("<=", 0.5)
#: The cached setup's cache, as a share of the vocabulary.
CACHE_FRACTION = 0.05
#: The table and Adam state of :func:`beyond_gpu`'s vocabulary, as a multiple of the GPU's memory.
BEYOND_GPU = 1.05


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The size of one training step.

    Attributes:
        batch: (center, context) pairs per step.
        negatives: negative words per pair.
        dim: embedding length.
        lr: Adam's learning rate.
    """

    batch: int = 4096
    negatives: int = 5
    dim: int = 128
    lr: float = 1e-3

    @property
    def rows_per_step(self) -> int:
        """Ids a step looks up: centers, contexts and negatives."""
        return self.batch * (2 + self.negatives)


def zipf_batches(vocab: int, count: int, device: torch.device, shape: StepShape, seed: int = 0) -> list:
    """``count`` batches of (center, context, negatives) ids on ``device``, p(rank r) ~ 1/r."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    cdf /= cdf[-1]

    def draw(size):
        return torch.from_numpy(np.minimum(np.searchsorted(cdf, rng.random(size)), vocab - 1)).to(device)

    return [(draw(shape.batch), draw(shape.batch), draw((shape.batch, shape.negatives)))
            for _ in range(count)]


def skipgram_loss(emb: torch.nn.Module, center: torch.Tensor, context: torch.Tensor,
                  negatives: torch.Tensor) -> torch.Tensor:
    """Mean negative-sampling loss with one (tied) table for centers and contexts."""
    return _loss_of_rows(emb(center), emb(context), emb(negatives))


def skipgram_loss_one_lookup(emb: torch.nn.Module, center: torch.Tensor, context: torch.Tensor,
                             negatives: torch.Tensor) -> torch.Tensor:
    """:func:`skipgram_loss` with the step's ids looked up in one call, then split."""
    batch, k = negatives.shape
    rows = emb(torch.cat([center, context, negatives.reshape(-1)]))
    # split, not slices: a slice's backward zero-fills a gradient the size of all the rows.
    u, v, n = rows.split([batch, batch, batch * k])
    return _loss_of_rows(u, v, n.view(batch, k, -1))


def _loss_of_rows(u: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    pos = F.logsigmoid((u * v).sum(-1))
    neg = F.logsigmoid(-(n @ u.unsqueeze(-1)).squeeze(-1)).sum(-1)
    return -(pos + neg).mean()


def build_in_memory(vocab: int, device: torch.device, shape: StepShape):
    """``nn.Embedding(sparse=True)`` on ``device`` and ``SparseAdam``; returns (module, optimizer)."""
    emb = torch.nn.Embedding(vocab, shape.dim, sparse=True, device=device)
    return emb, torch.optim.SparseAdam(list(emb.parameters()), lr=shape.lr)


def build_offloaded(vocab: int, device: torch.device, shape: StepShape, cache_rows: int = 0,
                    gpu_storage: str = "pinned"):
    """``OffloadedEmbedding`` with ``Adam`` attached; returns (module, optimizer).

    On a GPU its table and state have ``gpu_storage`` (``"device"``: every bookkeeping step of
    the offloaded path, no row crossing the bus); on the CPU they are pageable.
    """
    where = (dict(storage=gpu_storage, backend="cuda") if device.type == "cuda"
             else dict(storage="pageable", backend="numpy"))
    emb = ss.OffloadedEmbedding(vocab, shape.dim, max_rows=shape.rows_per_step, cache_rows=cache_rows,
                                **where)
    opt = torch.optim.Adam(emb.parameters(), lr=shape.lr)
    emb.attach(opt)
    return emb, opt


def build_cached(vocab: int, device: torch.device, shape: StepShape):
    """:func:`build_offloaded` with a cache of :data:`CACHE_FRACTION` of the rows."""
    return build_offloaded(vocab, device, shape, cache_rows=max(1, int(CACHE_FRACTION * vocab)))


_BUILDS = {"in_memory": build_in_memory, "offloaded": build_offloaded, "cached": build_cached}
#: The setups timed again with one lookup a step, as ``<name>_one_lookup``.
_ONE_LOOKUP = ("in_memory", "offloaded", "cached")


def _setups() -> dict:
    """``{name: (build, loss, prefetch)}`` of every setup :func:`measure` times."""
    return {**{name: (build, skipgram_loss, True) for name, build in _BUILDS.items()},
            "cached_no_prefetch": (build_cached, skipgram_loss, False),
            **{f"{name}_one_lookup": (_BUILDS[name], skipgram_loss_one_lookup, True) for name in _ONE_LOOKUP}}


def _step_fn(build: Callable, vocab: int, batches: list, device: torch.device, shape: StepShape,
             loss: Callable = skipgram_loss, prefetch: bool = True):
    """Build a setup and return (step function cycling through ``batches``, its device memory).

    ``loss(module, center, context, negatives)`` is the step's loss; with
    ``prefetch``, a setup with a cache prefetches the next step's ids.

    The memory figures (None off the GPU) are torch allocator bytes added by
    building the setup and running two steps: ``device_bytes`` still held
    after them, ``device_peak_bytes`` at the highest point. A setup with a
    cache then runs one pass over ``batches`` before it is timed.
    """
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    emb, opt = build(vocab, device, shape)
    cached = getattr(emb, "cache_rows", 0) > 0
    prefetch = prefetch and cached
    position = [0]

    def step():
        center, context, negatives = batches[position[0] % len(batches)]
        position[0] += 1
        value = loss(emb, center, context, negatives)
        if prefetch:  # the next step's rows come in while this one's backward runs
            emb.prefetch(torch.cat([ids.reshape(-1) for ids in batches[position[0] % len(batches)]]))
        value.backward()
        opt.step()
        opt.zero_grad()

    step.module = emb  # lives as long as the step function: dropping it frees the setup
    step()
    step()
    memory = {"device_bytes": None, "device_peak_bytes": None}
    if cuda:
        torch.cuda.synchronize(device)
        memory = {"device_bytes": torch.cuda.memory_allocated(device) - before,
                  "device_peak_bytes": torch.cuda.max_memory_allocated(device) - before}
    if cached:
        # A cache fills and learns which rows are hot over its first steps, each admitting
        # thousands of rows: one pass over the batches first, so the timed steps are its steady state.
        for _ in batches:
            step()
    return step, memory


def _fit_together(vocab: int, device: torch.device, shape: StepShape) -> bool:
    """Whether all setups fit at once, with room to spare (table + Adam's two moments each)."""
    nbytes = vocab * shape.dim * 4 * 3
    ram = available_ram() or 0
    names = list(_setups())
    if device.type == "cpu":
        return len(names) * nbytes < 0.7 * ram
    free, _ = torch.cuda.mem_get_info(device)
    in_memory = sum(name.startswith("in_memory") for name in names)
    cached = sum(name.startswith("cached") for name in names)  # each holds its cache on the GPU
    return ((len(names) - in_memory) * nbytes < 0.7 * ram
            and (in_memory + cached * CACHE_FRACTION) * nbytes < 0.7 * free)


def measure(vocab: int, device: torch.device, repeats: int, shape: StepShape) -> dict:
    """Time every setup at ``vocab`` rows; one :func:`run` result entry.

    Returns:
        dict with ``vocab``, ``distinct_rows_per_step``, ``ratio`` (offloaded time / in-memory time), ``throughput_ratio``
        (its inverse), ``cached_throughput_ratio`` (the same for the cached
        setup), ``cached_gap_ratio`` (the cached setup's throughput gap to in
        memory over the uncached one's; None when the uncached one has no
        gap), ``cached_no_prefetch_throughput_ratio`` (the cached setup's
        without its prefetch), ``one_lookup_throughput_ratio`` and
        ``cached_one_lookup_throughput_ratio`` (offloaded, and cached, over
        in-memory throughput, all with one lookup a step), ``load_average_before``,
        and per setup its timing summary, device memory and whether it ran
        ``interleaved``.
    """
    # Enough batches that the cache sees a stream, not the same few steps again and again: the 8 the CPU
    # took before hold 72,613 distinct rows at vocabulary 1M, which a 5% cache (50,000) nearly holds whole.
    batches = zipf_batches(vocab, 64, device, shape)
    distinct = float(np.mean([len(torch.unique(torch.cat([c, x, n.reshape(-1)]))) for c, x, n in batches]))
    load = load_average()
    cuda = device.type == "cuda"
    interleaved = _fit_together(vocab, device, shape)
    timings = {}
    if interleaved:
        steps, memory = {}, {}
        for name, (build, loss, prefetch) in _setups().items():
            steps[name], memory[name] = _step_fn(build, vocab, batches, device, shape, loss, prefetch)
        for name, summary in time_interleaved(steps, repeats=repeats, cuda=cuda).items():
            timings[name] = {**summary, **memory[name], "interleaved": True}
        del steps
    else:
        for name, (build, loss, prefetch) in _setups().items():
            step, memory = _step_fn(build, vocab, batches, device, shape, loss, prefetch)
            timings[name] = {**time_one(step, repeats=repeats, cuda=cuda), **memory, "interleaved": False}
            del step
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    ratio = timings["offloaded"]["median_s"] / timings["in_memory"]["median_s"]
    cached = timings["in_memory"]["median_s"] / timings["cached"]["median_s"]
    cached_alone = timings["in_memory"]["median_s"] / timings["cached_no_prefetch"]["median_s"]
    gap = 1.0 - 1.0 / ratio
    one_lookup = {name: timings["in_memory_one_lookup"]["median_s"] / timings[f"{name}_one_lookup"]["median_s"]
                  for name in ("offloaded", "cached")}
    return {"vocab": vocab, "distinct_rows_per_step": distinct, "ratio": ratio, "throughput_ratio": 1.0 / ratio,
            "cached_throughput_ratio": cached, "cached_gap_ratio": (1.0 - cached) / gap if gap > 0 else None,
            "cached_no_prefetch_throughput_ratio": cached_alone,
            "one_lookup_throughput_ratio": one_lookup["offloaded"],
            "cached_one_lookup_throughput_ratio": one_lookup["cached"],
            "pairs_per_s": {name: shape.batch / t["median_s"] for name, t in timings.items()},
            "load_average_before": load, **timings}


def _loss_of(module: torch.nn.Module, batch: tuple) -> float:
    """A batch's loss without training: under no_grad the embedding reads its rows from the table."""
    with torch.no_grad():
        return float(skipgram_loss(module, *batch))


def beyond_gpu(device: torch.device, repeats: int, shape: StepShape, gpu_bytes: Optional[int] = None) -> dict:
    """The offloaded setup alone at a vocabulary whose table and Adam state exceed the GPU's memory.

    No all-GPU setup can hold it: the figures are that it trains (the loss
    of one batch, read through the table, falls), its speed, and its device
    memory, which must be what the smaller vocabularies take.

    Args:
        device, repeats, shape: as for :func:`measure`.
        gpu_bytes: the memory to exceed; None: the GPU's own.

    Returns:
        ``{"vocab", "state_bytes" (table and both moments), "gpu_bytes",
        "loss_before", "loss_after", "pairs_per_s", timing summary, device
        memory}``, or ``{"skipped": why}`` off a GPU, or where this host's
        RAM cannot hold more than the GPU does.
    """
    if device.type != "cuda":
        return {"skipped": "no GPU memory to exceed on the CPU"}
    gpu_bytes = gpu_bytes or torch.cuda.get_device_properties(device).total_memory
    row_bytes = shape.dim * 4 * 3  # float32 row, exp_avg, exp_avg_sq
    vocab = int(BEYOND_GPU * gpu_bytes / row_bytes)
    state_bytes, ram = vocab * row_bytes, physical_ram() or 0
    if state_bytes > 0.85 * ram:
        return {"skipped": f"the table and Adam state must exceed the GPU's {gpu_bytes / 2**30:.0f} GiB, "
                           f"and {state_bytes / 2**30:.0f} GiB of them do not fit in this host's "
                           f"{ram / 2**30:.0f} GiB of RAM"}
    batches = zipf_batches(vocab, 16, device, shape)
    try:
        step, memory = _step_fn(build_offloaded, vocab, batches, device, shape)
    except ss.OutOfMemoryError as exc:
        return {"skipped": f"{vocab:,} rows could not be allocated: {exc}"}

    before = _loss_of(step.module, batches[0])
    timing = time_one(step, repeats=repeats, cuda=True)
    after = _loss_of(step.module, batches[0])
    del step
    gc.collect()
    return {"vocab": vocab, "state_bytes": state_bytes, "gpu_bytes": gpu_bytes, "loss_before": before,
            "loss_after": after, "pairs_per_s": shape.batch / timing["median_s"], **timing, **memory}


def run(vocabs: Sequence[int], repeats: int, device: torch.device, shape: StepShape = StepShape(), *,
        beyond: bool = True) -> dict:
    """:func:`measure` at each vocabulary size, then :func:`beyond_gpu`.

    Args:
        vocabs: table rows to try, e.g. ``[1_000_000, 10_000_000]``.
        repeats: timed steps per setup.
        device: ``cuda`` (in-memory means all-GPU) or ``cpu`` (in RAM).
        shape: the step's size.
        beyond: also run :func:`beyond_gpu` (on a GPU it fills more host
            RAM than the GPU has memory: about a minute on an H100).

    Returns:
        ``{"setup": description, "results": [entry per vocabulary]}``, and
        ``"beyond_gpu"``: its entry, when ``beyond``.
    """
    results = []
    for vocab in vocabs:
        results.append(measure(vocab, device, repeats, shape))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload = {"setup": {"batch": shape.batch, "negatives": shape.negatives, "dim": shape.dim,
                         "optimizer": "Adam", "lr": shape.lr, "device": str(device),
                         "ids": "Zipf p~1/rank", "tied_embeddings": True,
                         "in_memory": "nn.Embedding(sparse=True) + SparseAdam",
                         "offloaded": "OffloadedEmbedding + Adam (lazy; same function as SparseAdam "
                                      "up to where eps is added)",
                         "cached": f"offloaded, cache_rows = {CACHE_FRACTION:.0%} of the vocabulary, "
                                   f"next step's ids prefetched before backward",
                         "cached_no_prefetch": "cached, without the prefetch",
                         "one_lookup": "in memory, offloaded and cached again, the step's centers, "
                                       "contexts and negatives looked up in one call",
                         "device_memory": "torch allocator bytes added by building the setup and "
                                          "running two steps (resident after; peak)",
                         "target": ("GPU: offloaded throughput >= 0.9x all-GPU at a vocabulary that fits, "
                                    ">= 0.95x with the cache, and the gap to all-GPU at least halved by "
                                    "the cache; CPU: offloaded <= 1.2x in-memory time")},
               "results": results}
    if beyond:
        payload["beyond_gpu"] = beyond_gpu(device, repeats, shape)
    return payload


def _mib(value: Optional[int]) -> Optional[float]:
    return None if value is None else value / 2**20


def format_results(payload: dict) -> str:
    """:func:`run`'s figures as a text table."""
    rows = [{"vocab": e["vocab"], "distinct rows": round(e["distinct_rows_per_step"]),
             "in-memory ms": 1e3 * e["in_memory"]["median_s"], "offloaded ms": 1e3 * e["offloaded"]["median_s"],
             "cached ms": 1e3 * e["cached"]["median_s"],
             "throughput offloaded/in-memory": e["throughput_ratio"],
             "throughput cached/in-memory": e["cached_throughput_ratio"],
             "cached, no prefetch ms": 1e3 * e["cached_no_prefetch"]["median_s"],
             "throughput cached, no prefetch/in-memory": e["cached_no_prefetch_throughput_ratio"],
             "one lookup: in-memory ms": 1e3 * e["in_memory_one_lookup"]["median_s"],
             "one lookup: offloaded ms": 1e3 * e["offloaded_one_lookup"]["median_s"],
             "one lookup: cached ms": 1e3 * e["cached_one_lookup"]["median_s"],
             "one lookup: throughput offloaded/in-memory": e["one_lookup_throughput_ratio"],
             "one lookup: throughput cached/in-memory": e["cached_one_lookup_throughput_ratio"],
             "interleaved": e["in_memory"]["interleaved"],
             "device MiB in-memory": _mib(e["in_memory"]["device_bytes"]),
             "device MiB offloaded": _mib(e["offloaded"]["device_bytes"])}
            for e in payload["results"]]
    setup = payload["setup"]
    return (f"training step: skip-gram, Adam, {setup['batch']} pairs x {setup['negatives']} negatives, "
            f"dim {setup['dim']}, on {setup['device']}\n" + format_table(rows, list(rows[0]))
            + ("\nbeyond the GPU's memory: " + describe_beyond_gpu(payload["beyond_gpu"])
               if "beyond_gpu" in payload else ""))


def describe_beyond_gpu(entry: dict) -> str:
    """:func:`beyond_gpu`'s entry in one line: what trained, and how; or why it was skipped."""
    if "skipped" in entry:
        return f"skipped: {entry['skipped']}"
    return (f"{entry['vocab']:,} rows ({entry['state_bytes'] / entry['gpu_bytes']:.2f}x the GPU's memory): "
            f"loss {entry['loss_before']:.4f} -> {entry['loss_after']:.4f}, {entry['pairs_per_s']:,.0f} pairs/s, "
            f"{_mib(entry['device_bytes']):,.0f} MiB on the GPU (peak {_mib(entry['device_peak_bytes']):,.0f})")
