"""SpeedTorch's names that are not a whole switcher: the per-storage aliases and ``DataGadget``.

:class:`~speedswap.compat.model_factory.ModelFactory` and
:class:`~speedswap.compat.optimizer_factory.OptimizerFactory` are the switchers themselves.
"""

import inspect
from typing import NoReturn, Optional, Union

import numpy as np
import torch

from ..atomic import PathLike
from ..backends.resolve import BackendLike, DeviceLike
from ..convert import ROWS_ADVICE, Ids, Rows, as_row_ids
from ..data.gadget import DataGadget as CoreDataGadget
from ..errors import OptionError
from .model_factory import ModelFactory
from .optimizer_factory import OptimizerFactory
from .switcher import SpeedTorchFiles, storage_of

__all__ = ["GPUPytorchModelFactory", "GPUPytorchOptimizerFactory", "CPUPytorchModelFactory",
           "CPUPytorchOptimizerFactory", "DataGadget"]


def _with_storage(base, storage, name, where):
    """SpeedTorch's per-storage class names: ``base`` with every table in ``storage``."""
    signature = inspect.signature(base.__init__)
    # CPUPinn's position among the arguments after self: SpeedTorch's callers may pass it positionally.
    cpupinn_at = list(signature.parameters).index("CPUPinn") - 1

    def __init__(self, *args, backend="auto", **kwargs):
        if "storage" in kwargs:
            raise OptionError(f"{name} keeps its tables in {storage!r} storage; use "
                              f"{base.__name__}(..., storage=...) for another kind")
        # SpeedTorch's per-storage classes took no CPUPinn; ignoring one would put the tables
        # elsewhere than the caller asked for.
        if "CPUPinn" in kwargs or len(args) > cpupinn_at:
            raise OptionError(f"{name} keeps its tables in {storage!r} storage, so CPUPinn does not "
                              f"apply (SpeedTorch's {name} took none); use "
                              f"{base.__name__}(..., CPUPinn=...) to choose pinned or device memory")
        base.__init__(self, *args, storage=storage, backend=backend, **kwargs)

    # help() and inspect show the base's arguments, in SpeedTorch's order, not (*args, **kwargs).
    __init__.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name not in ("storage", "CPUPinn")])
    arguments = ", ".join(list(__init__.__signature__.parameters)[1:])
    doc = (f"SpeedTorch's ``{name}``: a :class:`{base.__name__}` with the {where} in {storage!r} storage.\n\n"
           f"Args:\n    {arguments}: as in :class:`{base.__name__}`.\n\n"
           f"Raises:\n    OptionError: ``storage`` or ``CPUPinn`` is given (this class fixes where the\n"
           f"        {where} live); otherwise as :class:`{base.__name__}`.\n")
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__,
                                "__qualname__": name})


CPUPytorchModelFactory = _with_storage(ModelFactory, "pinned", "CPUPytorchModelFactory",
                                       "table")
CPUPytorchOptimizerFactory = _with_storage(OptimizerFactory, "pinned", "CPUPytorchOptimizerFactory",
                                           "state tables")
GPUPytorchModelFactory = _with_storage(ModelFactory, "device", "GPUPytorchModelFactory", "table")
GPUPytorchOptimizerFactory = _with_storage(OptimizerFactory, "device", "GPUPytorchOptimizerFactory",
                                           "state tables")


class DataGadget(SpeedTorchFiles, CoreDataGadget):
    """SpeedTorch's ``DataGadget(fileName, CPUPinn=False)``: a dataset whose rows become device tensors.

    A thin layer over :class:`speedswap.data.gadget.DataGadget` with SpeedTorch's
    argument names and methods (``getData``, ``insertData``, ``gadgetInit``,
    ``getNumpyVersion``, ``saveCupy``, ``loadCupy``).

    ``CPUPinn`` means what it meant in SpeedTorch, as for the switchers:
    ``True`` holds the rows in page-locked host memory, ``False`` (the
    default) holds them in device memory (plain host memory on the numpy
    backend). A file larger than the RAM available is memory-mapped either
    way (see ``mmap``). Pass ``storage="pageable"`` to share an in-memory
    array instead of copying it.

    Args:
        fileName: a ``.npy`` path (SpeedTorch's name for it), or a numpy
            array / CPU tensor ``(n, ...)``.
        CPUPinn: pinned host memory (True) or device memory (False).
        mmap, backend, device: as in the core class.
        storage: any storage kind but ``mmap``, overriding ``CPUPinn``.

    Raises:
        as :class:`speedswap.data.gadget.DataGadget`.
    """

    def __init__(self, fileName: Union[PathLike, np.ndarray, torch.Tensor], CPUPinn: bool = False, *,
                 mmap: Optional[bool] = None, backend: BackendLike = "auto", storage: Optional[str] = None,
                 device: DeviceLike = None):
        super().__init__(fileName, storage=storage or storage_of(CPUPinn), mmap=mmap,
                         backend=backend, device=device)

    def getNumpyVersion(self) -> np.ndarray:
        """A copy of the data as a numpy array (SpeedTorch returned a copy).

        ``to_numpy(copy=False)`` gives the zero-copy view of host data instead
        (``CPUPinn=True``; device data, ``CPUPinn=False``, as a read-only copy on every backend).

        Raises:
            StateError: the gadget is closed.
        """
        return self.to_numpy(copy=True)

    def insertData(self, dataObject: Rows, indexes: Ids) -> None:
        """SpeedTorch's name for :meth:`put` (same argument order: data, then indexes).

        Args:
            dataObject: the rows to write, shaped ``(*indexes.shape, *row_shape)``.
            indexes: distinct integer ids of the rows to write.

        Raises:
            as :meth:`put`.
        """
        self.put(dataObject, indexes)

    def getData(self, indexes: Ids, negIndexes: Optional[Ids] = None) -> torch.Tensor:
        """SpeedTorch's ``getData``: the rows of ``indexes`` flattened, then those of ``negIndexes``.

        As in SpeedTorch, the ids are flattened and concatenated, so the
        result is one tensor of ``indexes.size + negIndexes.size`` rows;
        :meth:`get` keeps the ids' shape instead.

        Args:
            indexes: integer ids of any shape (numpy, list, or tensor).
            negIndexes: optional second ids (negative samples), any shape.

        Returns:
            torch.Tensor ``(n, *row_shape)`` on :attr:`device`.

        Raises:
            IdError, DTypeError, DeviceError: bad ids; nothing is read.
        """
        ids = [indexes] if negIndexes is None else [indexes, negIndexes]
        # Each checked as given (a uint64 id past int64 named as it is, not as the negative int64
        # it becomes), on the host: get() then checks the joined ids there too, without a device wait.
        flats = [as_row_ids(i, len(self), self.device, to="cpu", what=name, advice=ROWS_ADVICE)[0]
                 for i, name in zip(ids, ("indexes", "negIndexes"))]
        return self.get(torch.cat(flats) if len(flats) > 1 else flats[0])

    def getCupyVar(self) -> NoReturn:
        """SpeedTorch returned the CuPy array behind the data; speedswap keeps CuPy out of its API.

        Raises:
            OptionError: always; use :meth:`to_numpy` or :meth:`get`.
        """
        raise OptionError("speedswap hands out no CuPy arrays: use get(ids) for rows as torch "
                          "tensors, to_numpy() for a numpy view (cupy.asarray(...) of a device "
                          "tensor if you need CuPy)")

    gadgetInit = CoreDataGadget.read
