"""The device caches alive now, for :func:`speedswap.info`.

``info`` sits beside ``train`` in the layers, so it cannot reach the caches
the training classes hold; they register here instead, the way
:func:`speedswap.table.live_tables` registers tables. The registry holds weak
references: a cache dropped by its owner leaves it at once.
"""

import weakref

__all__ = ["track_cache", "live_caches"]

_CACHES = weakref.WeakSet()


def track_cache(cache) -> None:
    """Count ``cache`` in :func:`live_caches` for as long as it lives.

    Args:
        cache: a :class:`~speedswap.train.cache.RowCache` (anything with its
            ``num_slots``, ``table`` and ``stats()``).
    """
    _CACHES.add(cache)


def live_caches() -> list:
    """The caches registered by :func:`track_cache` and not yet collected (those of closed tables too)."""
    return list(_CACHES)
