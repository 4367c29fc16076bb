"""What speedswap sees on this machine and what its live tables and device caches hold."""

import torch

from .backends import available_backends, available_ram, get_backend
from .backends.resolve import cuda_status
from .live import live_caches
from .table import live_tables
from .version import __version__

__all__ = ["info", "format_info"]


def info() -> dict:
    """A summary of versions, backends, the device, and memory held by live tables and caches.

    Returns:
        dict with ``version``, ``torch``, ``backends`` (available names),
        ``cuda`` (whether the cuda backend runs here, and why not),
        ``device`` (what ``backend="auto"`` would use), ``ram_available_bytes``
        (RAM free for new allocations now: ``MemAvailable``, or less where the
        process's memory cgroup, a container's limit, grants less),
        ``tables`` (the number open) and ``host_bytes`` / ``device_bytes`` /
        ``file_bytes`` held by them;
        ``caches`` (device caches of hot rows in use: those of open embeddings
        and switchers built with ``cache_rows`` > 0), ``cache_bytes`` (device
        bytes they hold) and ``cache_hit_rate`` (their hits over the distinct
        rows their training steps looked up, since they were made, eval
        forwards left out as in ``stats()["total"]``; 0.0 before any step).
    """
    backends = available_backends()
    summary = {
        "version": __version__,
        "torch": torch.__version__,
        "backends": backends,
        "cuda": cuda_status(),
        "device": get_backend(backends[0]).describe(),
        "ram_available_bytes": available_ram(),
        "tables": 0,
        "host_bytes": 0,
        "device_bytes": 0,
        "file_bytes": 0,
    }
    for table in live_tables():
        summary["tables"] += 1
        for where, nbytes in table.memory().items():
            summary[f"{where}_bytes"] += nbytes
    stats = [cache.stats() for cache in live_caches()
             if cache.num_slots and not cache.table.closed]
    hits = sum(s["total"]["hits"] for s in stats)
    looked_up = sum(s["total"]["unique_rows"] for s in stats)
    summary.update(caches=len(stats), cache_bytes=sum(s["cache_bytes"] for s in stats),
                   cache_hit_rate=hits / looked_up if looked_up else 0.0)
    return summary


def format_info(summary: dict) -> str:
    """Render :func:`info` as aligned text lines."""
    width = max(len(k) for k in summary)
    return "\n".join(f"{key:<{width}}  {', '.join(value) if isinstance(value, list) else value}"
                     for key, value in summary.items())
