"""What both SpeedTorch-style switchers share: the parameter, the shared step and cache, the step protocol.

See :mod:`speedswap.compat.model_factory` and :mod:`speedswap.compat.optimizer_factory`.
"""

import functools
import inspect
from typing import Optional, Tuple, Union

import numpy as np
import torch

from ..atomic import PathLike
from ..convert import Ids, int_option, torch_dtype
from ..errors import DeviceError, DTypeError, OptionError, ShapeError, StateError
from ..train.one_thread import one_thread
from ..train.options import refuse_other_arguments
from .steps import steps_for

#: What ``before_forward`` returns: the local ids of ``pos``, or of ``pos`` and ``neg``.
LocalIds = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]

__all__ = ["Switcher", "SpeedTorchFiles", "LocalIds", "storage_of", "device_of", "weight_of"]


def storage_of(CPUPinn) -> str:
    """SpeedTorch's ``CPUPinn``, for every class that takes it: pinned host memory, or the device.

    Raises:
        OptionError: ``CPUPinn`` is not a bool (or 0 or 1): the string ``"False"`` is true
            to Python, and would have pinned the table.
    """
    if not (isinstance(CPUPinn, (bool, np.bool_)) or (isinstance(CPUPinn, (int, np.integer)) and CPUPinn in (0, 1))):
        raise OptionError(f"CPUPinn is True (pinned host memory) or False (device memory), got {CPUPinn!r}")
    return "pinned" if CPUPinn else "device"


def device_of(param):
    """The device a switcher's tables serve: the parameter's (None, the default, on the CPU)."""
    return param.device if param.device.type == "cuda" else None


def weight_of(variable):
    """The 2-D weight of an ``nn.Embedding`` or ``nn.EmbeddingBag``, or a 2-D Parameter itself.

    Raises:
        OptionError: another module (an ``nn.Linear`` has a 2-D weight too, but its
            rows are not looked up by id), no 2-D weight, or ``padding_idx``.
    """
    if isinstance(variable, torch.nn.Module) and not isinstance(
            variable, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        # Its weight's rows would be swapped for table rows each step, and its forward
        # would multiply by them instead of looking them up: training something else, silently.
        raise OptionError(f"expected the model's nn.Embedding (or nn.EmbeddingBag), whose rows the "
                          f"step's ids look up, or its 2-D weight Parameter; got a "
                          f"{type(variable).__name__}, which is not an embedding. Pass the "
                          f"embedding submodule itself (SpeedTorch: model.u_embeddings)")
    weight = variable if isinstance(variable, torch.nn.Parameter) else getattr(variable, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        raise OptionError(f"expected an nn.Embedding or its 2-D weight Parameter, got "
                          f"{type(variable).__name__}")
    if getattr(variable, "padding_idx", None) is not None:
        # Its rows are slots that hold other table rows every step: the frozen slot would
        # freeze whichever row lands in it (the batch's smallest id), not the padding row.
        raise OptionError(f"the working-set nn.Embedding has padding_idx={variable.padding_idx}, which "
                          f"would freeze whichever table row lands in that slot; build it without "
                          f"padding_idx (speedswap.OffloadedEmbedding(padding_idx=...) keeps a padding row)")
    return weight


def _refuse_process_group(name):
    """Raise when ``torch.distributed`` runs several ranks: each would train its own whole table."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise OptionError(
            f"{name} keeps the whole table in this process, but torch.distributed runs "
            f"{dist.get_world_size()} ranks: each rank would train its own copy and the copies "
            f"would drift apart. Use speedswap.ShardedOffloadedEmbedding, which splits the rows "
            f"over the ranks and trains like one process (README: 'Several processes and machines')")


class SpeedTorchFiles:
    """SpeedTorch's ``saveCupy(saveFileName)`` / ``loadCupy(loadFileName)``: ``save`` / ``load``
    under its names, argument names included (old code may pass them by keyword)."""

    def saveCupy(self, saveFileName: PathLike) -> None:
        """SpeedTorch's name for :meth:`save`.

        Args:
            saveFileName: the target path, as :meth:`save` takes it.

        Raises:
            as :meth:`save`.
        """
        return self.save(saveFileName)

    def loadCupy(self, loadFileName: PathLike):
        """SpeedTorch's name for :meth:`load`.

        Args:
            loadFileName: the file to read, as :meth:`load` takes it.

        Returns:
            what :meth:`load` returns (a DataGadget returns itself).

        Raises:
            as :meth:`load`.
        """
        return self.load(loadFileName)


def _refused_unless_serving(name, member):
    """``member``, a public method or property of a switcher, raising before it runs once the switcher
    is closed or replaced by a newer one of the embedding, or while another thread uses the embedding's
    switchers (see :attr:`Switcher._one_thread`)."""
    if isinstance(member, property):
        return property(_refused_unless_serving(name, member.fget), doc=member.__doc__)

    @functools.wraps(member)
    @one_thread  # the check and the call under one claim: no close() on another thread comes between them
    def checked(self, *args, **kwargs):
        if self._closed or not self._is_member():
            self._refuse(name)
        return member(self, *args, **kwargs)

    checked.refused_unless_serving = True
    return checked


class Switcher(SpeedTorchFiles):
    """What both switchers share: the parameter, the shared step and cache, the step protocol.

    Once :meth:`close` ran, or a newer switcher of the same kind was built
    for the embedding (which replaces this one: it serves the embedding's
    table from then on), every public method and property of a switcher
    class raises :class:`~speedswap.StateError` before it runs, naming the
    call and how to go on (see :meth:`__init_subclass__`). ``close()``
    itself always works, a replaced switcher's too: it releases what the
    switcher holds.

    One thread at a time (:mod:`speedswap.train.one_thread`): each of those
    calls, ``close()`` and the optimizer's step hooks claim the embedding's
    switchers, and so does a step from its first ``before_forward`` to its
    last ``after_step`` (:meth:`SharedSteps.begin <speedswap.compat.steps.SharedSteps.begin>`):
    a call of either switcher from another thread meanwhile raises
    :class:`~speedswap.StateError` before anything changes.
    """

    _kind = None  # MODEL or OPTIMIZER: the switcher's part in the shared step
    _dtype_argument = None  # the constructor's name for the dtype, for the refusal to name it
    _after_close = None  # how to go on once closed: what to build, what to load into it
    _closed = False  # set by close()

    def __init_subclass__(cls, **kwargs):
        """Make every public method and property of ``cls`` (``close`` aside) refuse a closed or replaced switcher.

        One check for them all, the inherited ones (``saveCupy``,
        ``beforeForwardPass``, ...) included, so that the refusal names the
        call the user made, not the table's "HostTable is closed" from
        whichever call reached it first, or nothing from calls that read no
        table. A replaced switcher's own table no longer trains: an
        initialiser, a load or a save through it would miss the table that
        does, silently.
        """
        super().__init_subclass__(**kwargs)
        for name in dir(cls):
            member = inspect.getattr_static(cls, name)
            if name.startswith("_") or name == "close" or getattr(
                    getattr(member, "fget", member), "refused_unless_serving", False):
                continue
            if inspect.isfunction(member) or isinstance(member, property):
                setattr(cls, name, _refused_unless_serving(name, member))

    def _call_name(self, name):
        """``name`` as the refusals name the call: ``ModelFactory.save()``, ``ModelFactory.table``."""
        call = name + ("" if isinstance(inspect.getattr_static(type(self), name), property) else "()")
        return f"{type(self).__name__}.{call}"

    def _refuse(self, name):
        """Raise the refusal of ``name``, a method or property, on a closed switcher or one replaced by a newer one.

        Raises:
            StateError: always.
        """
        cls = type(self).__name__
        released, go_on = self._after_close
        if self._closed:
            why = (f"was closed (close() released its {released}) and serves the embedding no more; "
                   f"build a new {cls} {go_on}")
        elif self._steps.serving(self._kind):
            why = (f"was replaced by a newer {cls} of the same embedding; use the newer one "
                   f"(close() this one to release its {released})")
        else:
            why = (f"was replaced by a newer {cls} of the same embedding, closed since: build a new "
                   f"{cls} {go_on} (close() this one to release its {released})")
        raise StateError(f"{self._call_name(name)}: this {cls} {why}")

    def _refuse_other_keywords(self, others: dict) -> None:
        """Refuse keywords the constructor does not take, saying what to do instead, before anything is built.

        Code moved over from :class:`~speedswap.OffloadedEmbedding` passes its
        keywords (``device``, ``max_rows``), and the two switchers name the
        dtype differently; Python's ``TypeError`` says neither.

        Raises:
            DTypeError: any given (a ``TypeError``, as Python's for an unexpected keyword).
        """
        cls = type(self).__name__
        other_dtype = "dtype" if self._dtype_argument == "datatype" else "datatype"
        refuse_other_arguments(cls, type(self).__init__, (), others, {
            "device": "a switcher works on the device of the model's embedding: move the model there "
                      "(model.to(device)) before building it",
            "max_rows": "the model's embedding is the working set: its rows are the most distinct "
                        "rows a step may touch",
            other_dtype: f"{cls} names it {self._dtype_argument}="})

    def _refuse_write_when_replaced(self, newer):
        """Raise before a write into this switcher's table once a newer switcher replaced it.

        For the tables' :meth:`HostTable.watch_writes` hooks: a table kept from
        before the replacement (``old.table``) no longer trains, so a write into
        it would be lost. Its reads stay allowed: it holds the rows as trained
        until the replacement, which may be copied into the newer switcher's table.

        Args:
            newer: the newer switcher's attribute to write into instead (``"table"``).

        Raises:
            StateError: the switcher was replaced; nothing changes.
        """
        if not self._is_member():
            cls = type(self).__name__
            instead = (f"write into the newer {cls}'s {newer} instead" if self._steps.serving(self._kind)
                       else f"that one was closed since: build a new {cls} and write into its {newer}")
            raise StateError(f"a write into a table kept from a replaced switcher: its {cls} was replaced "
                             f"by a newer {cls} of the same embedding, which trains from its own table, so "
                             f"the write would be lost; {instead} (this table's rows can still be read, "
                             f"and copied there)")

    def __init__(self, param, total_classes, embed_dimension, dtype, cache_rows, find_param=None):
        _refuse_process_group(type(self).__name__)
        total_classes = int_option(total_classes, "total_classes", hint=" (rows of the full table)")
        embed_dimension = int_option(embed_dimension, "embed_dimension")
        cache_rows = min(int_option(cache_rows, "cache_rows", minimum=0,
                                    hint=" (rows kept on the device between steps)"),
                         total_classes)
        if param.shape[1] != embed_dimension:
            raise ShapeError(f"the model's embedding has rows of {param.shape[1]} but "
                             f"embed_dimension={embed_dimension}; they must match")
        if param.dtype != torch_dtype(dtype):
            raise DTypeError(f"the model's embedding holds {param.dtype} but the table would "
                             f"hold {torch_dtype(dtype)}; pass {self._dtype_argument}="
                             f"{str(param.dtype).removeprefix('torch.')!r}, or build the "
                             f"embedding with dtype={torch_dtype(dtype)}")
        self._param = param
        self._find_param = find_param  # the parameter as the model holds it now, when known
        self._built_for = (param.dtype, param.device)
        self._steps = steps_for(param, total_classes)
        self._steps.check_join(self._kind, cache_rows, type(self).__name__)
        self.cache_rows = cache_rows
        self._leave = None

    @property
    def _one_thread(self):
        """The claim of the embedding's switchers, shared by both (see :class:`SharedSteps`)."""
        return self._steps._one_thread

    def _register(self, tables):
        """Share the step and the cache with the parameter's other switcher: the constructor's last act."""
        self._leave = self._steps.join(self, self._kind, self.cache_rows, tables)

    @property
    def _gathered(self):
        """The step this switcher began and has not ended yet, or None."""
        step = self._steps.current
        if step is None or self._kind not in step.begun - step.ended or not self._is_member():
            return None
        return step

    def _is_member(self):
        return self._steps.is_member(self, self._kind)

    def _check_step_start(self):
        """Refuse to begin a step over several ranks.

        The ranks are checked at every step, not only when the switcher is
        built: one built before ``init_process_group`` would train a table per
        rank, and under ``DistributedDataParallel`` each rank's slots hold other
        rows, whose gradients DDP would average.

        Raises:
            OptionError: ``torch.distributed`` runs several ranks.
        """
        _refuse_process_group(type(self).__name__)

    def _check_device(self, backend):
        """Refuse a backend that moves rows to another device than the parameter's.

        Called with the resolved backend before the tables are made: a refused
        switcher leaves no ``mmap`` file made, or replaced, behind.

        Raises:
            DeviceError: the backend's device is not the parameter's.
        """
        if backend.device != self._param.device:
            raise DeviceError(f"the table's rows move to {backend.device} but the model's "
                              f"embedding is on {self._param.device}; move the model with "
                              f".to({str(backend.device)!r}) or pick the matching backend")

    def _param_rows(self):
        """The parameter's storage now; it must still be the dtype and device it was built with.

        ``model.double()``, ``.half()``, ``.to(device)`` after the switcher was
        built are refused before anything converts
        (:meth:`SharedSteps.check_conversion`); this catches what no
        ``nn.Module._apply`` did (``weight.data = weight.data.double()``),
        new storage of another kind, which the host table cannot fill:
        training would silently stop. Between steps, other memory of the same
        kind assigned to ``weight.data`` gives way to the slots again
        (:meth:`SharedSteps.take_back_scratch`), refused by the step it begins.

        Raises:
            OptionError: the parameter was converted or replaced since.
        """
        if self._find_param is not None and self._find_param() is not self._param:
            raise OptionError(f"the model's embedding weight was replaced after {type(self).__name__} "
                              f"was built (a Parameter assigned in its place, or a conversion that makes new "
                              f"parameters): the switcher would fill the old one and training would "
                              f"stop; build the switchers after replacing it")
        self._steps.take_back_scratch()
        data = self._param.data
        if (data.dtype, data.device) != self._built_for:
            dtype, device = self._built_for
            raise OptionError(f"the model's embedding was converted to {data.dtype} on "
                              f"{data.device} after {type(self).__name__} was built for {dtype} on "
                              f"{device}; convert the model first (model.to(...), .double(), ...) "
                              f"and build the switchers after it, with the matching datatype")
        return data

    def _check_idle(self, what):
        if self._steps.busy():
            raise StateError(f"{what} between beforeForwardPass (before_forward) and afterOptimizerStep "
                             f"(after_step) would be undone by afterOptimizerStep; call it between steps")

    def _check_saving(self):
        """Raise before a save from ``optimizer.step()`` until after_step, which writes the step's rows back.

        Before ``optimizer.step()`` a save writes what memory holds: the
        step's rows as before it, as ``optimizer.state_dict()`` counts them.

        Raises:
            StateError: the tables are behind the step (:meth:`SharedSteps.refuse_stale`);
                nothing is written.
        """
        self._steps.refuse_stale("a save")

    def _rewriting(self, what):
        """A context for ``what``, which replaces host rows or state: flush before, invalidate after.

        Raises:
            StateError: in the middle of a step.
        """
        self._check_idle(what)
        return self._steps.rewriting()

    @one_thread
    def _prepare_table_read(self):
        """Make a read of a table through any reference to it see every row as trained, or refuse it.

        Called by the switcher's tables (:meth:`HostTable.watch_reads`): a
        device cache writes its rows and state back first (without one the
        tables are current, but from ``optimizer.step()`` until after_step).
        In that window the read is refused, as :attr:`ModelFactory.table` is:
        a table kept from between steps would show the step's rows and state
        as before the step. The switchers' own reads there do not come here
        (:meth:`HostTable.owner_copy`, :meth:`HostTable.gather_validated`).

        Raises:
            StateError: the tables are behind the step (:meth:`SharedSteps.refuse_stale`);
                nothing is read.
        """
        if not self._is_member():
            return
        self._steps.refuse_stale("a read of the table")
        cache = self._steps.cache
        if cache is not None and cache.num_slots:
            cache.flush()

    def flush(self) -> None:
        """Write the device cache's rows and their optimizer state back to the host tables.

        Afterwards the tables hold every row's current value (the rows stay
        cached). The switchers' own methods (``save``, ``getNumpyVersion``,
        ``load``, the initialisers, ``table`` and ``state``, ...) do this
        themselves. Without a cache (``cache_rows=0``) the tables are always current.
        """
        self._steps.flush()

    def stats(self) -> dict:
        """The device cache's transport counters, shared by both switchers of the embedding.

        Returns:
            ``{"last_step": {...}, "total": {...}, "eval": {...}, "cache_rows", "cache_bytes"}``
            as :meth:`speedswap.OffloadedEmbedding.stats`: lookups, hits,
            misses, rows and bytes each way, evictions and prefetched rows.
            ``eval`` stays zero: the model's own forwards read the device
            parameter, not the cache. All zero for a lone OptimizerFactory
            (no table, no cache).
        """
        return self._steps.stats(self.cache_rows)

    def after_step(self, pos: Ids, neg: Optional[Ids] = None) -> None:
        """Write the step's rows back (the model's rows, or the optimizer's state rows), each distinct row once.

        Args:
            pos, neg: the same ids given to :meth:`before_forward`.

        Raises:
            StateError: other ids than the last ``before_forward``'s, or no
                ``before_forward`` on this switcher; or, with an OptimizerFactory,
                a backward since ``before_forward`` whose gradient no
                ``optimizer.step()`` applied (call it first; or
                ``optimizer.zero_grad()`` to skip the update). Nothing is written.
        """
        step = self._steps.match(pos, neg, type(self).__name__)
        if self._gathered is not step:
            raise StateError(f"{type(self).__name__}.after_step without a matching "
                             f"before_forward on this switcher; call before_forward(ids) first")
        self._steps.end(step, self._kind, self._param_rows())

    @staticmethod
    def _result(step):
        return step.locals[0] if len(step.locals) == 1 else step.locals

    # SpeedTorch's names, with its argument names: old code may pass them by keyword.
    def beforeForwardPass(self, retrievedPosIndexes: Ids,
                          retrievedNegIndexes: Optional[Ids] = None) -> LocalIds:
        """SpeedTorch's name for ``before_forward(pos, neg)``.

        Args:
            retrievedPosIndexes: the step's table ids (``pos``).
            retrievedNegIndexes: optional second ids, such as negative samples (``neg``).

        Returns:
            the local ids to feed the model, as :meth:`before_forward` returns them.

        Raises:
            as :meth:`before_forward`; nothing changes.
        """
        return self.before_forward(retrievedPosIndexes, retrievedNegIndexes)

    def afterOptimizerStep(self, retrievedPosIndexes: Ids, retrievedNegIndexes: Optional[Ids] = None) -> None:
        """SpeedTorch's name for ``after_step(pos, neg)``.

        Args:
            retrievedPosIndexes, retrievedNegIndexes: the ids given to :meth:`beforeForwardPass`.

        Raises:
            as :meth:`after_step`; nothing is written.
        """
        return self.after_step(retrievedPosIndexes, retrievedNegIndexes)
