"""The speedswap exception family.

Every error speedswap raises derives from :class:`SpeedswapError` *and* from
the built-in exception a caller would naturally catch (``IndexError`` for bad
ids, ``TypeError`` for wrong dtypes, ``OSError`` for bad files, ...), so both
``except speedswap.SpeedswapError`` and ``except IndexError`` work.

Messages say what was expected and how to fix it. Every check that can fail
runs before any row is changed. :func:`warn` is the warnings' counterpart:
it names the user's line, not speedswap's.
"""

import contextlib
import os
import sys
import warnings

__all__ = [
    "SpeedswapError",
    "IdError",
    "DuplicateIdError",
    "DTypeError",
    "ShapeError",
    "DeviceError",
    "FileFormatError",
    "BackendUnavailableError",
    "CapacityError",
    "StateError",
    "ThreadStartError",
    "OptionError",
    "PathError",
    "OutOfMemoryError",
    "MissingFileError",
]


class SpeedswapError(Exception):
    """Base class of every exception speedswap raises."""


class IdError(SpeedswapError, IndexError):
    """A row id is out of range or negative."""


class DuplicateIdError(SpeedswapError, ValueError):
    """Ids that must be unique (a scatter's rows) repeat."""


class DTypeError(SpeedswapError, TypeError):
    """Ids are not integers, or values do not have the table's dtype."""


class ShapeError(SpeedswapError, ValueError):
    """An array does not have the shape the call expects."""


class DeviceError(SpeedswapError, ValueError):
    """A tensor lives on a device the backend cannot read from."""


class FileFormatError(SpeedswapError, OSError):
    """A file is truncated, malformed, or does not match the table."""


class BackendUnavailableError(SpeedswapError, RuntimeError):
    """The requested backend cannot run here (no CuPy, no CUDA device)."""


class CapacityError(SpeedswapError, ValueError):
    """A step touches more unique rows than the working set can hold."""


class StateError(SpeedswapError, RuntimeError):
    """A call came in the wrong order (closed table, mismatched step)."""


class ThreadStartError(SpeedswapError, RuntimeError):
    """A thread speedswap needs could not start (the process's thread limit, the interpreter shutting down)."""


class OptionError(SpeedswapError, ValueError):
    """An argument is outside its allowed choices (unknown storage kind, bad size)."""


class PathError(SpeedswapError, OSError):
    """A path cannot be written or read as asked: a missing directory, a read-only
    file system, a directory where a file is expected, or a file speedswap did
    not create and will not replace without ``overwrite=True``."""


class OutOfMemoryError(SpeedswapError, MemoryError):
    """A table does not fit in the memory available (use ``storage="mmap"``)."""


class MissingFileError(PathError, FileNotFoundError):
    """A file or checkpoint to read does not exist.

    Built as ``FileNotFoundError`` is (``errno``, message, path), so code that
    reads ``.errno`` or ``.filename`` keeps working; its text is the message
    alone, which names the path already.
    """

    def __str__(self) -> str:
        return self.strerror or super().__str__()


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type = RuntimeWarning) -> None:
    """Warn at the first caller outside speedswap and torch, so the warning shows the user's line.

    Args:
        message: what happened and what to do about it.
        category: the warning class.
    """
    # speedswap's hooks run inside torch (optimizer.step(), a module's call, load_state_dict):
    # the line to show is the user's call of torch, not torch's call of the hook. speedswap's
    # context managers run inside contextlib's: its frames are skipped too.
    torch = sys.modules.get("torch")
    skipped = (_PACKAGE,) if torch is None else (
        _PACKAGE, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame, level = sys._getframe(1), 2  # stacklevel 2 is warn's caller
    while frame is not None and (frame.f_code.co_filename.startswith(skipped)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
