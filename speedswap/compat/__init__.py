"""SpeedTorch compatibility: its class names, argument spellings and camelCase methods.

Everything SpeedTorch users call lives here as a thin layer over the core
(:class:`~speedswap.HostTable`, :mod:`speedswap.train`, :mod:`speedswap.data`),
so the core never learns SpeedTorch's vocabulary.
"""

from .speedtorch import (CPUPytorchModelFactory, CPUPytorchOptimizerFactory, DataGadget,
                         GPUPytorchModelFactory, GPUPytorchOptimizerFactory, ModelFactory,
                         OptimizerFactory)

__all__ = ["ModelFactory", "OptimizerFactory", "GPUPytorchModelFactory",
           "GPUPytorchOptimizerFactory", "CPUPytorchModelFactory", "CPUPytorchOptimizerFactory",
           "DataGadget"]
