"""``python -m speedswap demo``: word2vec with both tables offloaded, scored, in about half a minute on a 2-core CPU.

The job itself lives in :mod:`speedswap.apps.word2vec` (``examples/word2vec.py``
runs the same code with every knob exposed). This module sizes it, runs it on
the embedded synthetic corpus, and prints what a newcomer wants to see: speed,
quality against chance, and where the bytes are.

>>> summary = run_demo(tiny=True, backend="numpy", progress=False)
>>> summary["topic purity"] > 5 * summary["chance"]
True
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterable, Optional, Sequence

import torch

import speedswap as ss

__all__ = ["BACKEND_OF_DEVICE", "DEMO", "TINY", "run_demo", "format_demo", "memory_summary", "cache_summary",
           "format_cache", "format_bytes", "format_rows", "storage_words"]

#: ``--device`` choices of the demo and the examples, and the backend each means.
BACKEND_OF_DEVICE = {"auto": "auto", "cpu": "numpy", "cuda": "cuda"}

#: The demo's size: about half a minute on a 2-core CPU (25 s in the README), seconds on a GPU.
DEMO = dict(vocab=100_000, topics=50, tokens=4_000_000, dim=64, epochs=1, batch_size=8192)
#: A smoke-test size for the test suite.
TINY = dict(vocab=2_000, topics=20, tokens=200_000, dim=32, epochs=2, batch_size=1024)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _tensor_bytes(tensors: Iterable, seen: set) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def memory_summary(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Where a training job's bytes are: host tables vs what lives on the compute device.

    ``host_bytes``/``file_bytes`` are the live speedswap tables (embedding
    rows and optimizer state) from :func:`speedswap.info`. ``device_bytes``
    is what the step itself keeps on the device: the model's parameters and
    the optimizer's state tensors, plus any ``device``-storage tables. With
    offloading that is a batch-sized working set; trained in memory, it is
    the full tables. On a GPU, ``device_peak_bytes`` adds torch's peak
    allocation (activations included).

    Returns:
        dict of byte counts plus ``device`` (where the step runs) and
        ``tables`` (live speedswap tables: embeddings and optimizer state).
    """
    held = ss.info()
    seen = set()
    working = _tensor_bytes(model.parameters(), seen)
    working += _tensor_bytes((t for state in optimizer.state.values() for t in state.values()), seen)
    device = next(model.parameters()).device
    summary = {"host_bytes": held["host_bytes"], "file_bytes": held["file_bytes"],
               "device_bytes": held["device_bytes"] + working, "device": str(device),
               "tables": held["tables"]}
    if device.type == "cuda":
        summary["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return summary


def cache_summary(tables: dict) -> dict:
    """Per-step device cache figures of offloaded embeddings, from their ``stats()``.

    Args:
        tables: ``{name: OffloadedEmbedding}``.

    Returns:
        ``{name: {...}}``: ``cache_rows``, ``cache_bytes``, ``hit_rate`` (the
        share of each step's distinct rows found in the cache), and per step
        ``h2d_bytes`` / ``d2h_bytes`` (rows and optimizer state moved to and
        from the host, evictions and prefetches included), ``evictions``,
        ``prefetched_rows``.
    """
    summary = {}
    for name, table in tables.items():
        stats = table.stats()
        total, steps = stats["total"], max(stats["total"]["steps"], 1)
        summary[name] = {"cache_rows": stats["cache_rows"], "cache_bytes": stats["cache_bytes"],
                         "hit_rate": total["hits"] / max(total["unique_rows"], 1),
                         **{key: total[counter] / steps for key, counter in (
                             ("h2d_bytes", "bytes_h2d"), ("d2h_bytes", "bytes_d2h"),
                             ("evictions", "evictions"), ("prefetched_rows", "prefetched_rows"))}}
    return summary


def format_cache(summary: dict) -> list:
    """:func:`cache_summary` as ``[(label, value)]`` rows for :func:`format_rows`."""
    return [(f"{name} cache", f"{figures['cache_rows']:,} rows ({format_bytes(figures['cache_bytes'])}): "
                              f"{100 * figures['hit_rate']:.1f}% of rows hit; per step "
                              f"{format_bytes(figures['h2d_bytes'])} in, {format_bytes(figures['d2h_bytes'])} "
                              f"out, {_per_step(figures['evictions'])} evicted, "
                              f"{_per_step(figures['prefetched_rows'])} prefetched")
            for name, figures in summary.items()]


def _per_step(rows: float) -> str:
    """A per-step average of rows: one decimal below 10, so a rare event does not read as none."""
    return f"{rows:.1f}" if rows < 10 else f"{rows:,.0f}"


def format_rows(rows: Sequence[tuple]) -> str:
    """``[(label, value), ...]`` as aligned ``label  value`` lines."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run_demo(tiny: bool = False, backend: str = "auto", storage: str = "pinned", progress: bool = True,
             seed: int = 0, cache_rows: int = 0, path: Optional[os.PathLike] = None) -> dict:
    """Train word2vec on the synthetic topic corpus with the default recipe and summarise the run.

    Args:
        tiny: the test-suite size (:data:`TINY`) instead of :data:`DEMO`.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        storage: storage kind of the tables and optimizer state.
        progress: show the progress bar.
        seed: seeds the corpus and the training: the same seed gives the same
            vectors, loss and purity.
        cache_rows: rows of each table kept on the device between steps, the
            next batch's prefetched while a step computes; 0: no cache.
        path: for ``storage="mmap"``, the directory the table files are made
            in (``centre/`` and ``context/``), kept afterwards; None: a
            temporary directory, removed before this returns.

    Returns:
        dict of plain Python values (JSON-serialisable): ``words/s``,
        ``topic purity``, ``chance``, memory figures, ``path`` (the mmap
        directory, None when temporary or not mmap), ``cache``
        (:func:`cache_summary`, with a cache), ...

    Raises:
        OptionError: ``path`` without ``storage="mmap"``, or what
            :func:`speedswap.apps.word2vec.train` raises.
        PathError: ``path`` already holds table files, or cannot be made.
    """
    from . import word2vec
    from .corpus import synthetic_corpus

    if path is not None and storage != "mmap":
        raise ss.OptionError(f"path={os.fspath(path)!r} is where storage='mmap' keeps the table files, but "
                             f"storage is {storage!r}; drop path or use storage='mmap'")
    size = TINY if tiny else DEMO
    corpus = synthetic_corpus(size["vocab"], size["topics"], size["tokens"], seed=seed)
    with contextlib.ExitStack() as cleanup:
        if ss.get_backend(backend).device.type == "cpu":
            # The caller's count back as the demo ends: a notebook or test run after it keeps its own.
            cleanup.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(word2vec.cpu_threads())
        directory = path
        if storage == "mmap" and path is None:
            directory = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="speedswap-demo-"))
        result = word2vec.train(corpus, dim=size["dim"], epochs=size["epochs"], batch_size=size["batch_size"],
                                storage=storage, backend=backend, directory=directory, seed=seed,
                                progress=progress, cache_rows=cache_rows, prefetch=cache_rows > 0)
        tables = {"centre": result.model.centre, "context": result.model.context}
        for table in tables.values():
            # Closed as the block ends: after the figures below are read, and before the
            # temporary directory (entered earlier, so left later) is removed.
            cleanup.callback(table.close)
        purity, chance = word2vec.topic_purity(result.vectors, corpus)
        memory = memory_summary(result.model, result.optimizer)
        return {"vocab": corpus.vocab_size, "dim": size["dim"], "steps": result.steps,
                "epochs": size["epochs"], "optimizer": type(result.optimizer).__name__,
                "threads": torch.get_num_threads(), "words/s": result.words_per_second,
                "pairs/s": result.pairs / result.seconds, "seconds": result.seconds,
                "final loss": float(result.losses[-1][1]), "topic purity": float(purity),
                "chance": float(chance), "seed": seed, "storage": storage,
                "path": None if path is None else os.fspath(path),
                "page-locked": result.model.centre.table.pinned, **memory,
                **({"cache": cache_summary(tables)} if cache_rows else {})}


def _storage_line(summary: dict) -> str:
    """Where the tables were: the storage kind, and what it meant on this run."""
    storage = summary["storage"]
    if storage == "mmap":
        return (f"mmap (memory-mapped .npy files in {summary['path']}, kept)" if summary["path"]
                else "mmap (memory-mapped .npy files in a temporary directory, now removed)")
    return storage_words(storage, summary["page-locked"], summary["device"])


def storage_words(storage: str, pinned: bool, device: str | torch.device) -> str:
    """A storage kind, with what it meant on this run where that is not what its name says.

    On the CPU backend there is no GPU to pin for or to hold rows: ``pinned``,
    ``mapped`` and ``device`` storage are plain host memory there.

    Args:
        storage: the storage kind the rows were held in (``HostTable.storage``).
        pinned: whether they really were page-locked (``HostTable.pinned``).
        device: where the step ran.

    Returns:
        ``storage``, or ``"<storage> (plain host memory: the CPU backend has no GPU)"``.
    """
    if pinned or storage in ("pageable", "mmap") or (storage == "device" and torch.device(device).type != "cpu"):
        return storage
    return f"{storage} (plain host memory: the CPU backend has no GPU)"


def format_demo(summary: dict) -> str:
    """The demo's closing table."""
    states = summary["tables"] - 2  # beside the two embedding tables
    rows = [
        ("vocabulary x dim", f"{summary['vocab']:,} x {summary['dim']} (2 tables"
                             + (f" + {states} {summary['optimizer']} state tables)" if states > 0
                                else f"; {summary['optimizer']} keeps no per-row state)")),
        ("training", f"{summary['epochs']} epoch(s), {summary['steps']} steps in {summary['seconds']:.1f} s "
                     f"({summary['optimizer']}; {summary['threads']} torch thread(s), and 2 threads making "
                     f"and planning pairs), final loss per pair {summary['final loss']:.3f}"),
        ("words/s", f"{summary['words/s']:,.0f}  ({summary['pairs/s']:,.0f} pairs/s)"),
        ("topic purity", f"{summary['topic purity']:.3f}  (chance {summary['chance']:.3f})"),
        ("storage", _storage_line(summary)),
        ("host tables", format_bytes(summary["host_bytes"] + summary["file_bytes"])),
        (f"on {summary['device']} for the step", format_bytes(summary["device_bytes"])),
    ]
    if "device_peak_bytes" in summary:
        rows.append(("GPU peak allocated", format_bytes(summary["device_peak_bytes"])))
    return format_rows(rows + format_cache(summary.get("cache", {})))
