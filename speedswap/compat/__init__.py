"""SpeedTorch compatibility: its class names, argument spellings and camelCase methods.

Everything SpeedTorch users call lives here as a thin layer over the core
(:class:`~speedswap.HostTable`, :mod:`speedswap.train`, :mod:`speedswap.data`),
so the core never learns SpeedTorch's vocabulary.
"""

from .model_factory import ModelFactory
from .optimizer_factory import OptimizerFactory
from .speedtorch import (CPUPytorchModelFactory, CPUPytorchOptimizerFactory, DataGadget, GPUPytorchModelFactory,
                         GPUPytorchOptimizerFactory)

__all__ = ["ModelFactory", "OptimizerFactory", "GPUPytorchModelFactory",
           "GPUPytorchOptimizerFactory", "CPUPytorchModelFactory", "CPUPytorchOptimizerFactory",
           "DataGadget"]
