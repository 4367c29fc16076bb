"""SpeedTorch-style switchers: ModelFactory and OptimizerFactory (and their GPU-resident aliases).

A switcher keeps a full table in a :class:`~speedswap.HostTable` and, around
each optimizer step, swaps the rows a batch touches into (and out of) the
model's own ``nn.Embedding``, whose rows are the step's *working set*:

>>> import torch, speedswap as ss
>>> model = torch.nn.Embedding(8, 4)            # capacity: 8 distinct rows per step
>>> switch = ss.ModelFactory(model, total_classes=1000, embed_dimension=4, backend="numpy")
>>> switch.uniformDistributionInit(-0.1, 0.1)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> ids = torch.tensor([17, 999, 17])
>>> local = switch.before_forward(ids)          # [0, 1, 0]: one slot per distinct row
>>> model(local).sum().backward(); opt.step(); opt.zero_grad()
>>> switch.after_step(ids)                      # rows 17 and 999 written back, once each

Unlike SpeedTorch, each distinct row occupies one slot, so repeated ids get
their gradients summed exactly as in ``nn.Embedding`` instead of losing all
updates but the last. With an :class:`OptimizerFactory`, ``optimizer.step()``
sees the parameter (and its gradient and state) narrowed to the ``k`` rows
the step touches, so the optimizer's work scales with the batch, not with the
capacity, and no unused slot is updated.
"""

import contextlib
import os
import warnings
import weakref
from typing import Optional

import numpy as np
import torch

from ..backends import get_backend
from ..data.gadget import DataGadget as CoreDataGadget
from ..convert import int_option, torch_dtype
from ..errors import DeviceError, DTypeError, FileFormatError, OptionError, ShapeError, StateError
from ..train.caching import idle_stats
from ..train.row_state import NarrowedStep, RowState
from ..train.step_hooks import StepHooks
from ..table import HostTable
from .steps import MODEL, OPTIMIZER, steps_for

__all__ = ["ModelFactory", "OptimizerFactory", "GPUPytorchModelFactory",
           "GPUPytorchOptimizerFactory", "CPUPytorchModelFactory", "CPUPytorchOptimizerFactory",
           "DataGadget"]


#: How many forwards of a switcher's embedding are checked for stale placeholder copies.
_STALE_CHECKS = 20


def _check_stale(owner, args):
    switcher = owner()
    if switcher is not None and args:
        switcher._warn_if_stale(args[0])


def _is_torch_file(path):
    return os.path.splitext(os.fspath(path))[1].lower() in (".pt", ".pth")


def _storage_of(CPUPinn):
    """SpeedTorch's ``CPUPinn``, for every class that takes it: pinned host memory, or the device."""
    return "pinned" if CPUPinn else "device"


def _device_of(param):
    """The device a switcher's tables serve: the parameter's (None, the default, on the CPU)."""
    return param.device if param.device.type == "cuda" else None


def _weight_of(variable):
    """The 2-D parameter behind an ``nn.Embedding`` (or anything with ``.weight``) or a Parameter."""
    weight = variable if isinstance(variable, torch.nn.Parameter) else getattr(variable, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        raise OptionError(f"expected an nn.Embedding or its 2-D weight Parameter, got "
                          f"{type(variable).__name__}")
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


class _Switcher:
    """What both switchers share: the parameter, the shared step and cache, the step protocol."""

    _kind = None  # MODEL or OPTIMIZER: the switcher's part in the shared step

    def __init__(self, param, total_classes, embed_dimension, dtype, cache_rows):
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
                             f"hold {torch_dtype(dtype)}; pass the same dtype")
        self._param = param
        self._built_for = (param.dtype, param.device)
        self._steps = steps_for(param, total_classes)
        self._steps.check_join(self._kind, cache_rows, type(self).__name__)
        self.cache_rows = cache_rows
        self._leave = None

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

    def _check_member(self):
        if not self._is_member():
            name = type(self).__name__
            raise StateError(f"this {name} was closed, or replaced by a newer {name} of the same "
                             f"embedding; use the newer one")

    def _check_device(self, table):
        if table.device != self._param.device:
            raise DeviceError(f"the table's rows move to {table.device} but the model's "
                              f"embedding is on {self._param.device}; move the model with "
                              f".to({str(table.device)!r}) or pick the matching backend")

    def _param_rows(self):
        """The parameter's storage now; it must still be the dtype and device it was built with.

        ``model.double()``, ``.half()``, ``.to(device)`` after the switcher was
        built give the parameter new storage of another kind, which the host
        table cannot fill: training would silently stop.

        Raises:
            OptionError: the parameter was converted since.
        """
        data = self._param.data
        if (data.dtype, data.device) != self._built_for:
            dtype, device = self._built_for
            raise OptionError(f"the model's embedding was converted to {data.dtype} on "
                              f"{data.device} after {type(self).__name__} was built for {dtype} on "
                              f"{device}; convert the model first (model.to(...), .double(), ...) "
                              f"and build the switchers after it, with the matching datatype")
        return data

    def _check_idle(self, what):
        if self._is_member() and self._steps.busy():
            raise StateError(f"{what} between before_forward and after_step would be undone by "
                             f"after_step; call it between steps")

    def _rewriting(self, what):
        """A context for ``what``, which replaces host rows or state: flush before, invalidate after.

        Raises:
            StateError: in the middle of a step.
        """
        self._check_idle(what)
        return self._steps.rewriting() if self._is_member() else contextlib.nullcontext()

    def flush(self) -> None:
        """Write the device cache's rows and their optimizer state back to the host tables.

        Afterwards the tables hold every row's current value (the rows stay
        cached). The switchers' own methods (``save``, ``getNumpyVersion``,
        ``load``, the initialisers, ...) do this themselves; call it before
        reading ``table`` or ``state.tables`` directly. Without a cache
        (``cache_rows=0``) the tables are always current.
        """
        if self._is_member():
            self._steps.flush()

    def stats(self) -> dict:
        """The device cache's transport counters, shared by both switchers of the embedding.

        Returns:
            ``{"last_step": {...}, "total": {...}, "cache_rows", "cache_bytes"}``
            as :meth:`speedswap.OffloadedEmbedding.stats`: lookups, hits,
            misses, rows and bytes each way, evictions and prefetched rows.
            All zero for a lone OptimizerFactory (no table, no cache).
        """
        return self._steps.stats(self.cache_rows) if self._is_member() else idle_stats(self.cache_rows)

    def _finish(self, pos, neg):
        self._check_member()
        step = self._steps.match(pos, neg, type(self).__name__)
        if self._gathered is not step:
            raise StateError(f"{type(self).__name__}.after_step without a matching "
                             f"before_forward on this switcher; call before_forward(ids) first")
        return step

    @staticmethod
    def _result(step):
        return step.locals[0] if len(step.locals) == 1 else step.locals


class ModelFactory(_Switcher):
    """Keeps a full embedding table on the host and swaps a step's rows into the model.

    Args:
        model_variable: the model's ``nn.Embedding`` (or its weight). Its rows
            are the working set: their number is the capacity, the most
            distinct rows one step may touch.
        total_classes: rows of the full table.
        embed_dimension: row length; must equal the embedding's.
        datatype: the table's dtype; must equal the embedding's.
        CPUPinn: keep the table in pinned host memory (True) or in device
            memory (False, as in SpeedTorch).
        storage: any storage kind, overriding ``CPUPinn`` (``"mmap"`` for a
            table larger than RAM, with ``path``).
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        path: the ``.npy`` file of an ``mmap`` table.
        overwrite: let an ``mmap`` table replace an existing file at ``path``.
        cache_rows: rows kept in device memory between steps, with their
            optimizer state: a write-back LRU cache of hot rows (see
            :mod:`speedswap.train.cache`), shared with the embedding's
            :class:`OptimizerFactory`, which must be built with the same
            ``cache_rows``. 0 (the default) turns it off. A cached row is
            current only in the cache until it is evicted or flushed: every
            method here sees it, but read ``table`` directly only after
            :meth:`flush`. :meth:`prefetch` brings the next step's rows in.

    The table starts at zero; call an initialiser (``uniformDistributionInit``,
    ``customInit``, ...) before training.

    Raises:
        OptionError, ShapeError, DTypeError: a bad embedding, size, dtype or
            ``cache_rows`` (another than the embedding's OptimizerFactory's).
        DeviceError: the model is not on the backend's device.
        StateError: built in the middle of a step of the embedding's switchers.

    Example:
        >>> import torch, speedswap as ss
        >>> emb = torch.nn.Embedding(8, 4)
        >>> switch = ss.ModelFactory(emb, 1000, 4, backend="numpy", cache_rows=50)
        >>> opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        >>> for ids, next_ids in [([1, 2, 2], [2, 3]), ([2, 3], None)]:
        ...     local = switch.before_forward(ids)
        ...     if next_ids is not None:
        ...         _ = switch.prefetch(next_ids)      # while this step computes
        ...     emb(local).sum().backward(); opt.step(); opt.zero_grad()
        ...     switch.after_step(ids)
        >>> switch.stats()["total"]["hits"]    # 2 (stored by step 1) and 3 (prefetched)
        2
    """

    _kind = MODEL

    def __init__(self, model_variable, total_classes, embed_dimension, datatype="float32",
                 CPUPinn=False, *, storage=None, backend="auto", path=None, overwrite=False,
                 cache_rows: int = 0):
        param = _weight_of(model_variable)
        super().__init__(param, total_classes, embed_dimension, datatype, cache_rows)
        storage = storage or _storage_of(CPUPinn)
        # An mmap table starts as a zero-filled sparse file; writing zeros would make it dense.
        make = HostTable.empty if storage == "mmap" else HostTable.zeros
        self.table = make(total_classes, embed_dimension, datatype, storage, backend, path,
                          device=_device_of(param), overwrite=overwrite)
        self._check_device(self.table)
        self._placeholders = None
        # The first forwards of the model's embedding are checked for stale placeholder copies.
        self._stale_checks, self._stale_hook = _STALE_CHECKS, None
        if isinstance(model_variable, torch.nn.Module):
            owner = weakref.ref(self)
            self._stale_hook = model_variable.register_forward_pre_hook(
                lambda module, args: _check_stale(owner, args))
        self._register(self.table)

    # ------------------------------------------------------------------ steps
    def variableTransformer(self, batchSize, posPerBatch, negPerBatch=None):
        """SpeedTorch's placeholders: numpy id arrays that every :meth:`before_forward` fills in place.

        They are numpy ``int64`` arrays, as SpeedTorch returned, holding the
        step's *local* ids (slots of the de-duplicated working set) after each
        :meth:`before_forward`. Convert them every step (``torch.from_numpy(x)``
        shares their memory, so one ``from_numpy`` view kept across steps stays
        current; ``torch.tensor(x)`` copies). A copy made once before the loop
        would feed stale ids: the first forwards are checked for that, with a
        warning. Simpler: feed the ids :meth:`before_forward` returns.

        Args:
            batchSize: rows of the batch.
            posPerBatch: positive ids per row.
            negPerBatch: negative ids per row, when a second input is used.

        Returns:
            an ``int64`` array ``(batchSize, posPerBatch)``, or a tuple with a
            second ``(batchSize, negPerBatch)`` one.
        """
        n_pos = batchSize * posPerBatch
        pos = np.arange(n_pos, dtype=np.int64).reshape(batchSize, posPerBatch)
        if negPerBatch is None:
            self._placeholders = (pos,)
        else:
            neg = np.arange(n_pos, n_pos + batchSize * negPerBatch,
                            dtype=np.int64).reshape(batchSize, negPerBatch)
            self._placeholders = (pos, neg)
        # What a copy taken before the loop holds; later, what one taken a step ago holds.
        self._initial = [p.copy() for p in self._placeholders]
        self._stale = list(self._initial)
        return self._placeholders[0] if negPerBatch is None else self._placeholders

    def _warn_if_stale(self, ids):
        """Warn once when a forward is fed an old copy of the placeholders instead of their ids now."""
        self._stale_checks -= 1
        if self._stale_checks <= 0 and self._stale_hook is not None:
            self._stale_hook.remove()
            self._stale_hook = None
        if self._placeholders is None or self._gathered is None or not isinstance(ids, torch.Tensor):
            return
        fed = ids.detach().cpu().numpy()
        for old in self._stale:
            current = [p for p in self._placeholders if p.shape == old.shape]
            if fed.shape == old.shape and np.array_equal(fed, old) and not any(
                    np.array_equal(fed, p) for p in current):
                warnings.warn("the model was fed ids equal to an earlier content of the "
                              "variableTransformer placeholders, not their content now: a copy "
                              "made once (torch.tensor(x)) trains the wrong rows. Convert the "
                              "placeholders every step, or feed the ids before_forward returns",
                              RuntimeWarning, stacklevel=3)
                self._stale_checks = 0
                return

    def _check_placeholders(self, step):
        if self._placeholders is None:
            return
        if len(self._placeholders) != len(step.flats) or any(
                p.size != len(f) for p, f in zip(self._placeholders, step.flats)):
            want = [tuple(p.shape) for p in self._placeholders]
            got = [tuple(s) for s in step.shapes]
            raise ShapeError(f"before_forward got ids of shapes {got} but variableTransformer "
                             f"made placeholders of shapes {want}; call variableTransformer "
                             f"again for this batch size, or feed the ids before_forward returns")

    def before_forward(self, pos, neg=None):
        """Gather the rows of ``pos`` (and ``neg``) into the model's embedding (cached ones from the cache).

        Args:
            pos: table ids of any shape: numpy array, list, or tensor on the
                CPU or the model's device. Duplicates are fine.
            neg: optional second set of ids (negative samples).

        Returns:
            the local ids to feed the model, shaped like ``pos`` (a tuple with
            ``neg``'s when ``neg`` is given). Placeholders from
            :meth:`variableTransformer` are filled with them too.

        Raises:
            IdError, DTypeError, DeviceError: bad ids.
            CapacityError: more distinct rows than the embedding has.
            ShapeError: ids that do not fit the placeholders.
            StateError: the previous step was not finished with :meth:`after_step`
                (on this switcher, or on the embedding's OptimizerFactory).

        Nothing changes when this raises.
        """
        if self._gathered is not None:
            raise StateError("before_forward called twice without after_step; finish the "
                             "step with after_step(ids) so its rows are written back")
        self._check_member()
        rows = self._param_rows()
        step = self._steps.prepare(pos, neg, MODEL)
        self._check_placeholders(step)
        self._steps.begin(step, MODEL, rows)
        for placeholder, local in zip(self._placeholders or (), step.locals):
            np.copyto(placeholder, local.cpu().numpy().reshape(placeholder.shape))
        return self._result(step)

    def after_step(self, pos, neg=None):
        """Write the step's updated rows back to the table, each distinct row once.

        With a cache, rows go to the cache (hits, and misses that find a
        slot), with their optimizer state, and the rest back to the table.

        Args:
            pos, neg: the same ids given to :meth:`before_forward`.

        Raises:
            StateError: other ids than the last ``before_forward``'s, or no
                ``before_forward`` on this switcher; nothing is written.
        """
        step = self._finish(pos, neg)
        self._steps.end(step, MODEL, self._param_rows())
        if self._placeholders is not None and self._stale_checks > 0:
            # What a copy made before the loop, or now, would hold.
            self._stale = self._initial + [p.copy() for p in self._placeholders]

    def prefetch(self, pos, neg=None) -> int:
        """Start bringing the rows of the next step's ids (and their optimizer state) into the cache.

        Call it while the current step computes, with the ids the next
        :meth:`before_forward` will get. Rows of the current step are skipped
        (its ``after_step`` puts them in the cache with their updated values);
        rows brought or already cached cannot be evicted before the end of the
        next step. Without a cache (``cache_rows=0``) it only checks the ids.
        On a GPU the copies run on a side stream and may still be running on
        return; on the CPU they are done. Alias ``prefetchNextBatch``.

        Args:
            pos: the next step's ids, as for :meth:`before_forward`.
            neg: its second set of ids, if any.

        Returns:
            the number of rows brought from the host.

        Raises:
            IdError, DTypeError, DeviceError: bad ids (nothing changes).
            StateError: a closed or replaced switcher.
        """
        self._check_member()
        return self._steps.prefetch(pos, neg)

    # ------------------------------------------------------------ whole table
    def zerosInit(self):
        """Set every row to zero."""
        with self._rewriting("zerosInit"):
            self.table.zero_()

    def uniformDistributionInit(self, low, high):
        """Fill the table from U(low, high) (torch's global generator)."""
        with self._rewriting("uniformDistributionInit"):
            self.table.uniform_(low, high)

    def normalDistributionInit(self, mean, stdDev):
        """Fill the table from N(mean, stdDev²) (torch's global generator)."""
        with self._rewriting("normalDistributionInit"):
            self.table.normal_(mean, stdDev)

    def customInit(self, initFunction, *args):
        """Run an in-place initialiser such as ``torch.nn.init.xavier_uniform_`` on the whole table."""
        with self._rewriting("customInit"):
            self.table.apply_(initFunction, *args)

    def save(self, path):
        """Write the table (cached rows included) to ``path`` (``.npy`` or ``.h5``) atomically.

        Alias ``saveCupy``.
        """
        self.flush()
        self.table.save(path)

    def load(self, path):
        """Replace the table's rows with a file's of the same shape and dtype. Alias ``loadCupy``.

        Cached rows are dropped (their optimizer state is written back first).

        Raises:
            FileFormatError: another shape or dtype, or a bad file (nothing changes).
            StateError: called in the middle of a step.
        """
        with self._rewriting("load"):
            self.table.load_from(path)

    def close(self):
        """Release the table's memory (an ``mmap`` table gets the cached rows first). Idempotent.

        The embedding's OptimizerFactory keeps working, without a cache.
        Closing in the middle of a step abandons the step: its rows are not
        written back.
        """
        if self._stale_hook is not None:
            self._stale_hook.remove()
            self._stale_hook = None
        self._leave()
        self.table.close()

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """The table as a numpy array (the table's own memory for host storage, unless ``copy``).

        Cached rows are written back first. Handing out the table's memory
        (``copy=False``) also drops them from the cache, so writes to it before
        the next step are seen by that step (with a cache, call it between steps).

        Raises:
            StateError: ``copy=False`` in the middle of a step, with a cache.
        """
        if copy:
            self.flush()
        elif self._is_member():
            self._steps.hand_out("to_numpy(copy=False)")
        return self.table.to_numpy(copy=copy)

    def getNumpyVersion(self) -> np.ndarray:
        """A copy of the table as a numpy array, as SpeedTorch returned (``to_numpy()`` shares memory)."""
        return self.to_numpy(copy=True)

    def saveTorch(self, path) -> None:
        """SpeedTorch's ``saveTorch``: ``*.pt``/``*.pth`` through ``torch.save`` (the table as one
        CPU tensor, as SpeedTorch wrote it); other suffixes as :meth:`save`."""
        if _is_torch_file(path):
            self.flush()
            torch.save(self.table.as_tensor().cpu().clone(), path)
        else:
            self.save(path)

    def loadTorch(self, path) -> None:
        """SpeedTorch's ``loadTorch``: reads ``*.pt``/``*.pth`` with ``torch.load(weights_only=True)``.

        Raises:
            FileFormatError: the file holds no tensor of the table's shape and dtype (nothing changes).
        """
        if not _is_torch_file(path):
            self.load(path)
            return
        self._check_idle("loadTorch")
        try:
            tensor = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise FileFormatError(f"{os.fspath(path)!r} is not a readable torch file ({exc})") from exc
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != self.table.shape \
                or tensor.dtype != self.table.dtype:
            what = (f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__)
            raise FileFormatError(f"{os.fspath(path)!r} holds {what}, but this table is "
                                  f"{self.table.shape} {self.table.dtype}")
        with self._rewriting("loadTorch"):
            self.table.as_tensor().copy_(tensor)

    def getTorchVar(self) -> torch.Tensor:
        """SpeedTorch's ``getTorchVar``: the full table as a torch tensor sharing its memory.

        As :meth:`to_numpy` with ``copy=False``: cached rows are written back
        and dropped from the cache first.

        Raises:
            StateError: in the middle of a step, with a cache.
        """
        if self._is_member():
            self._steps.hand_out("getTorchVar")
        return self.table.as_tensor()

    def getCupyVar(self):
        """SpeedTorch returned the CuPy array behind the table; speedswap keeps CuPy out of its API.

        Raises:
            OptionError: always; use :meth:`getTorchVar` (a torch view) or :meth:`to_numpy`.
        """
        raise OptionError("speedswap hands out no CuPy arrays: use getTorchVar() for a torch view "
                          "of the table, to_numpy() for a numpy view (cupy.asarray(...) of the "
                          "torch view if you need CuPy)")

    beforeForwardPass = before_forward
    afterOptimizerStep = after_step
    prefetchNextBatch = prefetch
    saveCupy = save
    loadCupy = load


def _parameter_named(model, variable_name):
    """``model``'s parameter ``variable_name``, or the ``weight`` of its submodule of that name."""
    try:
        return model.get_parameter(variable_name)
    except AttributeError:
        pass
    try:
        return _weight_of(model.get_submodule(variable_name))
    except AttributeError:
        names = [n for n, _ in model.named_parameters()]
        raise OptionError(f"the model has no parameter or embedding {variable_name!r}; its "
                          f"parameters are {names}") from None


class OptimizerFactory(_Switcher):
    """Keeps an optimizer's per-row state for one embedding in host tables.

    One table per state tensor shaped like the parameter (Adam's ``exp_avg``
    and ``exp_avg_sq``, ...); scalar state such as ``step`` stays in the
    optimizer. Rows never touched hold the value torch creates the state with.

    Args:
        given_optimizer: the optimizer over the model's parameters. SGD (with
            momentum), Adam, AdamW (incl. amsgrad), Adamax, NAdam, RAdam,
            Adagrad, Adadelta, RMSprop, Rprop, ASGD and SparseAdam are supported.
        total_classes: rows of the full table.
        embed_dimension: row length.
        model: the model holding the embedding.
        variable_name: the embedding's name in ``model`` (``"u_embeddings"``) or
            its parameter's (``"u_embeddings.weight"``).
        dtype: the state dtype; must equal the embedding's.
        CPUPinn: pinned host memory (True) or device memory (False).
        storage: any storage kind, overriding ``CPUPinn``.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        path: for ``storage="mmap"``, a directory for the state files.
        overwrite: let ``mmap`` state files replace existing ones in ``path``.
        cache_rows: the embedding's device cache of hot rows (see
            :class:`ModelFactory`): it holds their state rows too, so it is
            shared, and both switchers of one embedding must be built with
            the same ``cache_rows``. Without a ModelFactory there is no cache.

    Raises:
        OptionError: no such parameter, an optimizer not holding it, one
            whose state is not element-wise (LBFGS), or a bad ``cache_rows``
            (another than the embedding's ModelFactory's).
        StateError: built in the middle of a step of the embedding's switchers.
    """

    _kind = OPTIMIZER

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False, *, storage=None, backend="auto", path=None,
                 overwrite=False, cache_rows: int = 0):
        param = _parameter_named(model, variable_name)
        super().__init__(param, total_classes, embed_dimension, dtype, cache_rows)
        self.state = RowState(given_optimizer, param, total_classes, torch_dtype(dtype),
                              storage or _storage_of(CPUPinn),
                              get_backend(backend, _device_of(param)), path, overwrite=overwrite)
        for table in self.state.tables.values():
            self._check_device(table)
        self._narrowed = None
        # Weak hooks (see StepHooks): they act only inside a step, and
        # optimizer.step(closure) narrows after the closure's forward.
        self._hooks = StepHooks(self, given_optimizer)
        self._register(self.state)

    # The step protocol of StepHooks.
    def _begin_step(self):
        if self._gathered is not None and self._narrowed is None:
            self._narrowed = NarrowedStep(self._param, len(self._gathered.rows))

    def _end_step(self):
        if self._narrowed is not None:
            self._narrowed.restore()
            self._narrowed = None

    def _abort_step(self):
        if self._narrowed is not None:
            self._end_step()
            self.state.release()

    def close(self):
        """Release the state tables' memory and unhook the optimizer. Idempotent.

        The embedding's ModelFactory keeps working, its cache without state
        rows. Closing in the middle of a step abandons the step: its rows are
        not written back.
        """
        self._hooks.remove()
        self._leave()  # cached state rows are written back while the tables are open
        self.state.close()

    def init_state(self):
        """Reset every row's state to torch's initial value (cached state rows too). Alias ``optInit``."""
        with self._rewriting("init_state"):
            self.state.init_state()

    def before_forward(self, pos, neg=None):
        """Put the optimizer state of the step's rows into the optimizer.

        Call it with the same ids as the embedding's :class:`ModelFactory`
        (before or after it); the de-duplication is shared.

        Returns:
            the local ids, as :meth:`ModelFactory.before_forward`.

        Raises:
            as :meth:`ModelFactory.before_forward`; StateError also when the
            optimizer's state was lost (see :meth:`RowState.gather`).
        """
        if self._gathered is not None:
            raise StateError("before_forward called twice without after_step; finish the "
                             "step with after_step(ids) so its state rows are written back")
        self._check_member()
        rows = self._param_rows()
        step = self._steps.prepare(pos, neg, OPTIMIZER)
        self._steps.begin(step, OPTIMIZER, rows)
        try:
            self.state.gather(step.rows, read=self._steps.read_state())
        except BaseException:
            self._steps.withdraw(step, OPTIMIZER)
            raise
        return self._result(step)

    def after_step(self, pos, neg=None):
        """Write the step's optimizer state rows back, each distinct row once.

        Raises:
            StateError: other ids than the last ``before_forward``'s, or no
                ``before_forward`` on this switcher; nothing is written.
        """
        step = self._finish(pos, neg)
        self._steps.end(step, OPTIMIZER, self._param_rows())

    def save(self, path):
        """Write every state table (cached state rows included) to one checkpoint (``.h5`` file or
        directory), atomically."""
        from ..train.checkpoint import save_tables
        self.flush()
        save_tables(path, self.state.tables, {"optimizer": type(self.state.optimizer).__name__})

    def load(self, path):
        """Read state tables written by :meth:`save`; restore the optimizer's state_dict too.

        Raises:
            FileFormatError: a checkpoint of another optimizer or shape (nothing changes).
            StateError: called in the middle of a step.
        """
        from ..train.checkpoint import load_tables
        with self._rewriting("load"):
            load_tables(path, self.state.tables, {"optimizer": type(self.state.optimizer).__name__})
            self.state.mark_loaded()

    optInit = init_state
    beforeForwardPass = before_forward
    afterOptimizerStep = after_step
    saveCupy = save
    loadCupy = load


def _with_storage(base, storage, name, where):
    """SpeedTorch's per-storage class names: ``base`` with every table in ``storage``."""

    def __init__(self, *args, backend="auto", **kwargs):
        if "storage" in kwargs:
            raise OptionError(f"{name} keeps its tables in {storage!r} storage; use "
                              f"{base.__name__}(..., storage=...) for another kind")
        base.__init__(self, *args, storage=storage, backend=backend, **kwargs)

    doc = f":class:`{base.__name__}` with the {where} in {storage!r} storage (SpeedTorch's name)."
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__,
                                "__qualname__": name})


CPUPytorchModelFactory = _with_storage(ModelFactory, "pinned", "CPUPytorchModelFactory",
                                       "table")
CPUPytorchOptimizerFactory = _with_storage(OptimizerFactory, "pinned", "CPUPytorchOptimizerFactory",
                                           "state tables")
GPUPytorchModelFactory = _with_storage(ModelFactory, "device", "GPUPytorchModelFactory", "table")
GPUPytorchOptimizerFactory = _with_storage(OptimizerFactory, "device", "GPUPytorchOptimizerFactory",
                                           "state tables")


class DataGadget(CoreDataGadget):
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
        fileName_or_array: a ``.npy`` path, or a numpy array / CPU tensor ``(n, ...)``.
        CPUPinn: pinned host memory (True) or device memory (False).
        mmap, backend, device: as in the core class.
        storage: any storage kind but ``mmap``, overriding ``CPUPinn``.

    Raises:
        as :class:`speedswap.data.gadget.DataGadget`.
    """

    def __init__(self, fileName_or_array, CPUPinn: bool = False, *, mmap: Optional[bool] = None,
                 backend="auto", storage: Optional[str] = None, device=None):
        super().__init__(fileName_or_array, storage=storage or _storage_of(CPUPinn), mmap=mmap,
                         backend=backend, device=device)

    def getNumpyVersion(self) -> np.ndarray:
        """A copy of the data as a numpy array (SpeedTorch returned a copy).

        ``to_numpy(copy=False)`` gives the zero-copy view instead.
        """
        return self.to_numpy(copy=True)

    def insertData(self, dataObject, indexes) -> None:
        """SpeedTorch's name for :meth:`put` (same argument order: data, then indexes)."""
        self.put(dataObject, indexes)

    def getData(self, indexes, negIndexes=None):
        """SpeedTorch's ``getData``: rows of ``indexes`` (and of ``negIndexes``, as a pair)."""
        if negIndexes is None:
            return self.get(indexes)
        return self.get(indexes), self.get(negIndexes)

    gadgetInit = CoreDataGadget.read
    saveCupy = CoreDataGadget.save
    loadCupy = CoreDataGadget.load
