"""The one place that decides which backend and which device an object uses.

Every table, embedding, switcher, gadget and feeder asks :func:`get_backend`
(or :func:`resolve_device`), so ``"auto"`` means the same thing everywhere:

* a CUDA device is visible to torch: the ``cuda`` backend on that device. With
  CuPy (and its runtime compiler) the rows of ``pinned``/``mapped`` tables move
  with zero-copy kernels; without it the tables are page-locked with
  ``cudaHostRegister`` and rows are staged and copied asynchronously, and one warning names
  the extra that brings the kernels;
* no CUDA device: the ``numpy`` backend on the CPU, with one warning.

``device=None`` means torch's *current* CUDA device at the time of the call
(not at the first call of the process), so a rank that calls
``torch.cuda.set_device(local_rank)`` first gets its own GPU. One backend
instance exists per device.

>>> from speedswap.backends import get_backend
>>> get_backend("numpy").device
device(type='cpu')
"""

from typing import Union

import torch

from ..errors import BackendUnavailableError, OptionError, warn
from .base import Backend
from .cpu import NumpyBackend

__all__ = ["get_backend", "available_backends", "resolve_device", "cuda_status", "BackendLike",
           "DeviceLike"]

BackendLike = Union[str, Backend]
DeviceLike = Union[None, str, int, torch.device]

_NAMES = ("auto", "cuda", "numpy")
_CPU = NumpyBackend()
_cuda_instances = {}
_warned = set()


def _cuda_class():
    # Imported on first use: the module imports no CuPy itself, but keeping it
    # out of `import speedswap` keeps that import cheap.
    from .cuda import CudaBackend
    return CudaBackend


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warn(message)


def available_backends() -> list:
    """Names of the backends that can run on this machine, fastest first.

    Returns:
        ``["cuda", "numpy"]`` where torch sees a CUDA device, else ``["numpy"]``.
    """
    return ["cuda", "numpy"] if torch.cuda.is_available() else ["numpy"]


def cuda_status() -> str:
    """Whether the cuda backend runs here and, if not, why, in one line (for ``info``).

    Returns:
        e.g. ``"no: torch 2.13.0+cpu is a CPU build (install a CUDA build of torch)"`` or
        ``"yes: 1 device; zero-copy kernels: no (CuPy is not installed) ..."``.
    """
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return (f"no: torch {torch.__version__} is a CPU build (install a CUDA build of "
                    f"torch to use a GPU)")
        return (f"no: torch (built for CUDA {torch.version.cuda}) sees no CUDA device (no NVIDIA "
                f"driver, or CUDA_VISIBLE_DEVICES hides them)")
    count = torch.cuda.device_count()
    problem = _cuda_class().zero_copy_problem()
    kernels = "yes" if problem is None else (
        f"no ({problem}): pinned tables use staged copies; pip install 'speedswap[cuda12]' "
        f"or 'speedswap[cuda13]' for the kernels")
    return f"yes: {count} device{'s' if count > 1 else ''}; zero-copy kernels: {kernels}"


def _cuda_index(device):
    """The CUDA device index ``device`` names (None: torch's current device)."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise OptionError(f"device must be 'cuda', 'cuda:N', an int or a torch.device, "
                              f"got {device!r}") from exc
        if parsed.type != "cuda":
            raise OptionError(f"the cuda backend runs on a CUDA device, not {parsed}; pass "
                              f"backend='numpy' for the CPU")
        index = torch.cuda.current_device() if parsed.index is None else parsed.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise OptionError(f"CUDA device {index} does not exist; this machine has {count} "
                          f"(cuda:0 .. cuda:{count - 1})")
    return index


def _device_kind(device) -> str:
    """``"cpu"`` or ``"cuda"``: the kind of device ``device`` names as torch reads it (an int is a CUDA index).

    Checked the same way on every machine, before asking whether a GPU is there.

    Raises:
        OptionError: not a device, or one speedswap does not deliver to (``"mps"``, ``"meta"``).
    """
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise OptionError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', "
                          f"got {device!r}") from exc
    if kind not in ("cpu", "cuda"):
        raise OptionError(f"speedswap delivers to the CPU or a CUDA device, not {kind!r}; "
                          f"pass device='cpu' (or 'auto', 'cuda', 'cuda:N')")
    return kind


def _cuda_backend(device):
    cls = _cuda_class()
    index = _cuda_index(device)
    if index not in _cuda_instances:
        problem = cls.zero_copy_problem()
        if problem is not None:
            _warn_once("no-zero-copy",
                       f"speedswap: {problem}; pinned tables reach the GPU through staged "
                       f"copies instead of the zero-copy kernels. Install the kernels' "
                       f"dependencies with pip install 'speedswap[cuda12]' or "
                       f"'speedswap[cuda13]' (matching your CUDA version)")
        try:
            _cuda_instances[index] = cls(torch.device("cuda", index), zero_copy=problem is None)
        except BackendUnavailableError as exc:
            if problem is not None:
                raise
            # The probe compiled but the kernels did not: still use the GPU, staged.
            _warn_once("no-zero-copy", f"speedswap: {exc}; pinned tables reach the GPU "
                                       f"through staged copies instead")
            _cuda_instances[index] = cls(torch.device("cuda", index), zero_copy=False)
    return _cuda_instances[index]


def get_backend(name: BackendLike = "auto", device: DeviceLike = None) -> Backend:
    """The backend called ``name`` on ``device`` (one shared instance per device).

    Args:
        name: ``"auto"`` (cuda when torch sees a GPU, else numpy with one
            warning), ``"cuda"``, ``"numpy"``, or a :class:`Backend` (returned as is).
        device: for the cuda backend, ``"cuda:N"``, ``N`` or a ``torch.device``;
            None (or ``"auto"``) is torch's current device. ``"cpu"`` with
            ``name="auto"`` picks the numpy backend.

    Returns:
        Backend

    Raises:
        OptionError: an unknown name, a device that is neither the CPU nor a
            CUDA device, one that does not exist, or ``"numpy"`` with a
            device other than the CPU.
        BackendUnavailableError: ``"cuda"``, or ``"auto"`` with a CUDA ``device``,
            was asked for and torch sees no CUDA device.
    """
    if isinstance(name, Backend):
        return name
    if name not in _NAMES:
        raise OptionError(f"unknown backend {name!r}; choose one of {_NAMES}")
    if isinstance(device, str) and device == "auto":
        device = None  # what every object's default means, as a BatchFeeder's device="auto" does
    kind = None if device is None else _device_kind(device)
    if name == "numpy" and kind not in (None, "cpu"):
        raise OptionError(f"backend='numpy' runs on the CPU, but device={device!r} asks for "
                          f"another; pass device='cpu' (or none), or backend='cuda'")
    if name == "numpy" or (name == "auto" and kind == "cpu"):
        return _CPU
    if torch.cuda.is_available():
        return _cuda_backend(device)
    if name == "cuda" or device is not None:  # a CUDA device named explicitly, with "auto" too
        raise BackendUnavailableError("torch sees no CUDA device here, and the cuda backend needs "
                                      "one (and a CUDA build of torch). Use backend='numpy' or "
                                      "device='cpu' (--device cpu on the command line), or "
                                      "'auto', which falls back to the CPU")
    _warn_once("cpu-fallback", "speedswap: no CUDA device here; running on the CPU with the "
                               "numpy backend (pass backend='numpy', or --device cpu on the "
                               "command line, to silence this)")
    return _CPU


def resolve_device(device: DeviceLike = "auto") -> torch.device:
    """The torch device that ``device`` means, decided as :func:`get_backend` decides.

    Args:
        device: ``"auto"`` or None (the device of ``get_backend("auto")``), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``, an int or a ``torch.device``.

    Returns:
        torch.device (with an index for CUDA).

    Raises:
        OptionError: not a CPU or CUDA device, or a device that does not exist.
        BackendUnavailableError: a CUDA device was asked for and none is visible.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return get_backend("auto").device
    if _device_kind(device) == "cpu":
        return _CPU.device
    return get_backend("cuda", device).device
