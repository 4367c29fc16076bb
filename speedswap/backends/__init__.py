"""Backend selection.

>>> from speedswap.backends import get_backend
>>> get_backend("numpy").device
device(type='cpu')
"""

import warnings

from ..errors import OptionError
from .base import HOST_KINDS, STORAGE_KINDS, Backend, Buffer
from .cpu import NumpyBackend

__all__ = ["get_backend", "available_backends", "Backend", "Buffer", "STORAGE_KINDS", "HOST_KINDS"]

_NAMES = ("auto", "cuda", "numpy")
_instances = {}
_warned_fallback = False


def _cuda_backend_class():
    # Imported lazily: the module itself imports nothing from CuPy, but keeping
    # it out of `import speedswap` keeps that import cheap.
    from .cuda import CudaBackend
    return CudaBackend


def available_backends():
    """Names of the backends that can run on this machine, fastest first.

    Returns:
        list of str, e.g. ``["cuda", "numpy"]`` or ``["numpy"]``.
    """
    names = ["numpy"]
    if _cuda_backend_class().is_available():
        names.insert(0, "cuda")
    return names


def get_backend(name="auto"):
    """Return the (shared) backend called ``name``.

    Args:
        name: ``"cuda"``, ``"numpy"``, ``"auto"`` (cuda when available, else numpy
            with one warning), or a :class:`Backend` instance (returned as is).

    Returns:
        Backend

    Raises:
        OptionError: an unknown name.
        BackendUnavailableError: ``"cuda"`` was asked for and CuPy or a device is missing.
    """
    global _warned_fallback
    if isinstance(name, Backend):
        return name
    if name not in _NAMES:
        raise OptionError(f"unknown backend {name!r}; choose one of {_NAMES}")
    if name == "auto":
        if _cuda_backend_class().is_available():
            name = "cuda"
        else:
            if not _warned_fallback:
                _warned_fallback = True
                warnings.warn("speedswap: no usable CUDA device with CuPy here; running on the "
                              "CPU with the numpy backend (pass backend='numpy' to silence this)",
                              RuntimeWarning, stacklevel=3)
            name = "numpy"
    if name not in _instances:
        _instances[name] = NumpyBackend() if name == "numpy" else _cuda_backend_class()()
    return _instances[name]
