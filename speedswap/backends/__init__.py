"""Backends: where table memory comes from and how rows cross the bus.

:mod:`~speedswap.backends.resolve` decides which backend and device an
object uses; :mod:`~speedswap.backends.base` defines the interface;
:mod:`~speedswap.backends.cpu` and :mod:`~speedswap.backends.cuda` implement
it (the latter with the row kernels of :mod:`~speedswap.backends.kernels` and
the staging ring of :mod:`~speedswap.backends.staging`).

>>> from speedswap.backends import get_backend
>>> get_backend("numpy").device
device(type='cpu')
"""

from .base import STORAGE_KINDS, Backend, Buffer
from .cpu import available_ram
from .resolve import available_backends, get_backend, resolve_device

__all__ = ["available_ram", "get_backend", "available_backends", "resolve_device", "Backend", "Buffer",
           "STORAGE_KINDS"]
