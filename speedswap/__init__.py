"""speedswap: train parameters that do not fit in GPU memory.

Full tables and their optimizer state live in host memory (pinned, mapped, or
a memory-mapped file); only the rows a step touches travel to the device.
``import speedswap`` never imports CuPy: the cuda backend imports it when it
is first used.
"""

from .backends import STORAGE_KINDS, available_backends, get_backend
from .errors import (BackendUnavailableError, CapacityError, DeviceError, DTypeError,
                     DuplicateIdError, FileFormatError, IdError, MissingFileError, OptionError,
                     OutOfMemoryError, PathError, ShapeError, SpeedswapError, StateError,
                     ThreadStartError)
from .info import info
from .malloc import keep_freed_memory
from .version import __version__
from .table import HostTable
from .train import OffloadedEmbedding, ShardedOffloadedEmbedding, load_sharded
from .data import BatchFeeder
from .compat import (CPUPytorchModelFactory, CPUPytorchOptimizerFactory, DataGadget,
                     GPUPytorchModelFactory, GPUPytorchOptimizerFactory, ModelFactory,
                     OptimizerFactory)

__all__ = [
    "__version__",
    "HostTable",
    "OffloadedEmbedding",
    "ShardedOffloadedEmbedding",
    "load_sharded",
    "ModelFactory",
    "OptimizerFactory",
    "GPUPytorchModelFactory",
    "GPUPytorchOptimizerFactory",
    "CPUPytorchModelFactory",
    "CPUPytorchOptimizerFactory",
    "DataGadget",
    "BatchFeeder",
    "STORAGE_KINDS",
    "available_backends",
    "get_backend",
    "info",
    "keep_freed_memory",
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
