"""What is alive now (tables, device caches), for :func:`speedswap.info`.

``info`` sits beside ``train`` in the layers, so it cannot reach the caches
the training classes hold; they register here instead, as tables do
(:func:`speedswap.table.live_tables`). A registry holds weak references: an
object dropped by its owner leaves it at once.
"""

import weakref

__all__ = ["Registry", "track_cache", "live_caches"]


class Registry:
    """Objects alive now, held weakly, listed by :meth:`snapshot` from any thread.

    A ``weakref.WeakSet`` listed with ``list()`` raised "Set changed size
    during iteration" when another thread added or closed a member
    meanwhile; the snapshot here is one C call (``set.copy``).
    """

    def __init__(self):
        self._refs = set()

    def add(self, member) -> None:
        """Count ``member`` until :meth:`discard` or until it is collected."""
        self._refs.add(weakref.ref(member, self._refs.discard))

    def discard(self, member) -> None:
        """Stop counting ``member`` (no error if it is not counted)."""
        self._refs.discard(weakref.ref(member))  # refs to one live object are equal

    def snapshot(self) -> list:
        """The members alive now."""
        return [member for ref in self._refs.copy() if (member := ref()) is not None]


_CACHES = Registry()


def track_cache(cache) -> None:
    """Count ``cache`` in :func:`live_caches` for as long as it lives.

    Args:
        cache: a :class:`~speedswap.train.cache.RowCache` (anything with its
            ``num_slots``, ``table`` and ``stats()``).
    """
    _CACHES.add(cache)


def live_caches() -> list:
    """The caches registered by :func:`track_cache` and not yet collected (those of closed tables too)."""
    return _CACHES.snapshot()
