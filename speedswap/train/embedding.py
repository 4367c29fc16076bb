"""OffloadedEmbedding: an ``nn.Embedding`` whose table and optimizer state live in host memory.

>>> import torch, speedswap as ss
>>> emb = ss.OffloadedEmbedding(1_000, 4, max_rows=64, storage="pageable", backend="numpy")
>>> opt = torch.optim.Adam(emb.parameters(), lr=0.01)
>>> emb.attach(opt)                      # Adam's moments live in host tables too
>>> loss = emb(torch.tensor([[3, 999], [3, 5]])).pow(2).sum()
>>> loss.backward(); opt.step(); opt.zero_grad()    # rows 3, 5, 999 written back once each
"""

import contextlib
import os
import weakref
from collections.abc import Mapping
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .. import files
from ..atomic import PathLike
from ..backends.resolve import BackendLike, DeviceLike
from ..convert import (Ids, Rows, as_host_rows, as_row_ids_deferred, bool_option, check_has_values, host_tensor,
                       int_option, torch_dtype)
from ..errors import (CapacityError, DTypeError, FileFormatError, IdError, OptionError, ShapeError, SpeedswapError,
                      StateError, warn)
from ..table import HostTable
from .caching import idle_stats, new_cache, resetting_state, rewriting
from .checkpoint import checkpoint_kind, file_in, load_tables, save_tables
from .conversions import (RefusesConversion, gives_new_storage, refuse_conversion, refuse_new_gradient_storage,
                          refuse_new_parameter, refuse_new_storage)
from .leftover import untouched
from .module_state import (check_tables_state, checked_scalar_state, copy_tables, missing_hint, note_loaded,
                           refused_after, tables_state, unpicklable)
from .one_optimizer import claim
from .one_process import OneProcess
from .one_thread import OneThread, one_thread
from .options import (embedding_dtype, embedding_flags, forward_ids, max_rows_option, outside_function_transforms,
                      padding_option, refuse_bag_arguments, refuse_max_norm, refuse_other_arguments)
from .reached import KeptRows, ReachedRows, in_backward
from .row_state import (EmptySparseGradient, NarrowedStep, RowState, check_state_files, close_replaced,
                        drop_leftover_state, refuse_unasked_restart, take_assigned)
from .scratch_writes import ScratchWrites, same_memory, same_rows
from .step_hooks import StepHooks
from .working_set import WorkingSet
from .zero_marks import holds_nonzero, reads_as_zeroed

__all__ = ["OffloadedEmbedding"]

#: The plain attributes a training step sets in every forward, backward and step. nn.Module's
#: __setattr__ checks each name against the parameters, buffers and submodules (4 us a call;
#: NOTES 47): these are never any of those, so they are set as on any object.
_STEP_ATTRIBUTES = frozenset({"_narrowed", "_kept", "_seen_rows", "_backward_ran",
                              "_version_at_backward", "_grad_at_backward", "_leftover", "_stale",
                              "_empty_step", "_lookups", "_lookup_grad", "_outside", "_version_at_lookup",
                              "_eval_with_grad", "_empty_sparse"})


class OffloadedEmbedding(RefusesConversion):
    """A drop-in ``nn.Embedding`` for tables larger than device memory.

    The full ``(num_embeddings, embedding_dim)`` table is a
    :class:`~speedswap.HostTable`. While training, each ``forward`` gathers the
    rows its ids need into :attr:`weight`, the step's working set of at most
    ``max_rows`` distinct rows (several forward calls in one step share it, so
    gradient accumulation works). After :meth:`attach`, the optimizer's
    ``step()`` narrows :attr:`weight` and the optimizer's per-row state to the
    rows touched, updates them, and writes rows and state back to the host,
    each distinct row once. The result is lazy training: exactly what the
    optimizer would do to the touched rows of an in-memory ``nn.Embedding``,
    with every untouched row (and its state) left alone.

    In eval mode, under ``torch.no_grad()``, or with :attr:`weight` frozen
    (``requires_grad=False``, as :meth:`from_pretrained` leaves it by
    default) ``forward`` reads the table directly, with no capacity limit.

    There is no ``nn.EmbeddingBag`` counterpart (``offsets``,
    ``per_sample_weights``, ``mode``): look up a step's ids in one call and
    pool the rows (``index_add_`` per bag, or ``emb(padded_ids).sum(1)`` with
    ``padding_idx``), as the README's section on pooled lookups shows.

    Checkpoints, two ways. ``torch.save(model.state_dict())`` and
    ``model.load_state_dict(torch.load(...))`` work as for ``nn.Embedding``:
    besides :attr:`weight` (the ``max_rows`` working-set scratch) the state
    dict holds the table and the attached optimizer's per-row state under
    ``<prefix>_extra_state`` (:meth:`get_extra_state`, zero-copy views of the
    host tables); attach the optimizer before loading it, and restore
    ``optimizer.state_dict()`` (Adam's ``step``) after. ``torch.load`` reads
    the whole table into RAM unless given ``mmap=True``. :meth:`save` /
    :meth:`load` write and read the tables as files, atomically and table by
    table, without a copy in RAM: for tables larger than RAM (``storage="mmap"``).

    Args:
        num_embeddings: rows of the table.
        embedding_dim: row length.
        max_rows: the working set's capacity: the most distinct rows one step
            may touch (required). More than ``num_embeddings`` is taken as
            ``num_embeddings``.
        storage: where the table (and optimizer state) lives: ``pinned``,
            ``mapped``, ``pageable``, ``mmap`` (files in the directory ``path``)
            or ``device``.
        dtype: the rows' torch dtype. ``torch.bfloat16`` keeps the table in
            bfloat16 while :attr:`weight` and the optimizer state are float32:
            the step's math is float32 and each touched row is rounded back to
            bfloat16 once per step. None (the default) is torch's default
            dtype, as for ``nn.Embedding``: float32 unless
            ``torch.set_default_dtype`` changed it.
        padding_idx: as in ``nn.Embedding``: this row starts at zero and gets
            no gradient. A row id in ``[0, num_embeddings)``: negative ones,
            which ``nn.Embedding`` counts from the end, are refused.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        path: for ``storage="mmap"``, the directory for ``table.npy`` and the
            optimizer state files.
        device: the CUDA device the rows move to (``"cuda:1"``); None is
            torch's current device.
        overwrite: for ``storage="mmap"``, let the table and state files
            replace existing files in ``path`` (they are refused otherwise: they
            may hold a trained table).
        cache_rows: rows (with their optimizer state) kept in device memory
            between steps, a write-back cache of the rows used most often
            (see :mod:`speedswap.train.cache`); 0 turns it off. :attr:`table`
            sees it (it writes the cached rows back and forgets them first).
            More than ``num_embeddings`` is taken as ``num_embeddings`` (the
            whole table cached); :attr:`cache_rows` says what was kept.
        scale_grad_by_freq: as in ``nn.Embedding``: each forward scales a
            row's gradient by the inverse of how often its ids name it.
        sparse: accepted for ``nn.Embedding`` code; changes nothing.
            :attr:`weight`'s gradient is dense over the step's rows only, and
            ``torch.optim.SparseAdam`` trains it as it would a sparse one.
        max_norm: not supported (only None): ``nn.Embedding`` renormalises
            the rows it looks up in place, in eval forwards too, a write that
            the offloaded table does not make.
        norm_type: ``nn.Embedding``'s, for ``max_norm``; only the default.
        *positional: refused, saying which keywords ``nn.Embedding`` reads
            them as: every argument but the two sizes is taken by keyword
            (``nn.Embedding(n, d, 0)``'s 0 is its ``padding_idx``, where a
            third argument here might as well be meant as ``max_rows``).
        **others: refused, saying what to do instead: ``nn.Embedding``'s
            ``_weight`` and ``_freeze`` (:meth:`from_pretrained`),
            ``nn.EmbeddingBag``'s ``mode``, ``include_last_offset`` and
            ``per_sample_weights`` (README's pooled-lookup recipe).

    Raises:
        OptionError: bad sizes (no ``max_rows``), padding_idx or storage;
            ``max_norm`` or ``norm_type`` given; ``scale_grad_by_freq``,
            ``sparse`` or ``overwrite`` that is not a bool.
        DTypeError: a dtype that is not floating point; a keyword argument
            it does not take, or a third positional one (a ``TypeError``, as
            Python's). Nothing is built.
        PathError: ``mmap`` files exist in ``path`` (without ``overwrite``).

    The embedding holds host (pinned) memory until :meth:`close` or until it
    is dropped; ``with OffloadedEmbedding(...) as emb:`` closes it on exit.
    """

    def __setattr__(self, name, value):
        if name in _STEP_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init__(self, num_embeddings: int, embedding_dim: int, *positional, max_rows: Optional[int] = None,
                 storage: str = "pinned", dtype: Optional[torch.dtype] = None,
                 padding_idx: Optional[int] = None, backend: BackendLike = "auto", path: Optional[PathLike] = None,
                 device: DeviceLike = None, overwrite: bool = False, cache_rows: int = 0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, max_norm: float = None,
                 norm_type: float = 2.0, **others):
        # Set by from_pretrained on the instance it builds, which draws no rows here (see below).
        pretrained = vars(self).pop("_pretrained", False)
        super().__init__()
        self._one_thread = OneThread("this OffloadedEmbedding")
        self._one_process = OneProcess("this OffloadedEmbedding")
        refuse_other_arguments(type(self).__name__, OffloadedEmbedding.__init__, positional, others, {
            "_weight": "start the table from those rows with OffloadedEmbedding.from_pretrained(weight, "
                       "freeze=False, max_rows=...)",
            "_freeze": "OffloadedEmbedding.from_pretrained(weight, freeze=True, max_rows=...) builds a "
                       "frozen one (forwards read the table, nothing trains), as does "
                       "emb.weight.requires_grad_(False)"})
        refuse_max_norm("OffloadedEmbedding", max_norm, norm_type, "emb.table.apply_")
        num_embeddings = int_option(num_embeddings, "num_embeddings")
        embedding_dim = int_option(embedding_dim, "embedding_dim")
        max_rows = max_rows_option(max_rows, num_embeddings, "OffloadedEmbedding", "one step")
        cache_rows = min(int_option(cache_rows, "cache_rows", minimum=0), num_embeddings)
        dtype = embedding_dtype(dtype)
        padding_idx = padding_option(padding_idx, num_embeddings)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_rows, self.padding_idx = max_rows, padding_idx
        self.scale_grad_by_freq, self.sparse = embedding_flags(scale_grad_by_freq, sparse)
        overwrite = bool_option(overwrite, "overwrite", hint=" (replace existing mmap files in path)")
        self._storage, self._path, self._overwrite = storage, path, overwrite
        table_file = file_in(path, "table", storage)
        self._table = HostTable.empty(num_embeddings, embedding_dim, dtype, storage, backend,
                                     table_file, device=device, overwrite=overwrite)
        # The mmap files this embedding made and may replace, and which file each is (RowState.made_files)
        self._created = {} if table_file is None else {table_file: self._table.file_identity}
        self._backend = self._table.backend
        # from_pretrained writes every row itself and, as nn.Embedding(_weight=...) does, draws
        # no random numbers: the layers built after the table start from the values they would
        # in memory, and a table (an mmap file) is written once.
        if not pretrained:
            self._table.normal_()  # nn.Embedding's initialisation
            if padding_idx is not None:
                self._table.scatter([padding_idx], torch.zeros(1, embedding_dim, dtype=dtype))
        # bfloat16 rows train in float32: the step's math and the optimizer
        # state are float32, and each row is rounded back once per step.
        compute = torch.float32 if dtype is torch.bfloat16 else dtype
        self.weight = torch.nn.Parameter(
            torch.zeros(max_rows, embedding_dim, dtype=compute, device=self._table.device))
        self._full = self.weight.data
        self._seen_rows = 0  # working-set rows when weight.data was last seen to be _full
        # Working-set rows when the step's first backward ran (None before it): a copy of weight.data
        # taken after it (SAM's old_p) may predate the rows that joined since (see _adopt_replaced_data).
        self._rows_at_backward = None
        # Whether a backward reached `weight` since the step began: a forward that then
        # finds no gradient follows a zero_grad() that dropped the step (see discard_step).
        self._backward_ran, self._version_at_backward = False, None
        # weight's version when the step's last training forward had gathered its rows: one that differs
        # at the next forward was written in place in the middle of the step (see _refuse_rows_after_write).
        self._version_at_lookup = None
        # Whether the gradient held a non-zero value when the last backward ended (a 0-dim bool
        # tensor, computed on the device; None for a sparse gradient, which its version tells
        # about), the gradient and its version then: a gradient zero now
        # was dropped by zero_grad() if that backward left it non-zero, or if it left it at zero
        # (loss * 0) and zero_grad() cleared the mark the backward left on it (see _note_backward);
        # one a backward left at zero, untouched or unscaled since, still trains.
        self._grad_at_backward = None
        self.weight.register_post_accumulate_grad_hook(_note_backward(weakref.ref(self)))
        # The gradient a finished step left on weight, and its version then: a step must not
        # train on it (see _note_leftover_gradient). The hook is on weight's gradient
        # accumulator, which runs only where a gradient accumulates (not for
        # torch.autograd.grad(loss, [weight])); held here, as DDP holds its parameters', so it
        # and its hook live as long as weight.
        self._leftover = None
        self._stale = None  # the step's gradient, while it holds the one the last step left
        # The step's lookups read weight through one alias of it, made at its first training forward
        # (_lookup_alias): their gradient reaches weight through that alias's one node, whose output
        # (_lookup_grad) is then what reaches weight, unless something else adds to it (a penalty over
        # emb.weight, a layer tied to it): told by identity, with no value read (see _note_outside_use).
        self._lookups, self._lookup_grad, self._outside = None, None, False
        # A hook on weight itself, the first: it sees the gradient before any hook of the user's replaces it.
        self.weight.register_hook(_note_outside_use(weakref.ref(self)))
        with torch.enable_grad():  # the embedding may be built under no_grad()
            self._accumulator = self.weight.view_as(self.weight).grad_fn.next_functions[0][0]
        self._accumulator.register_prehook(_note_leftover_gradient(weakref.ref(self)))
        self._working_set = WorkingSet(
            max_rows, self._table.device,
            table=f"the OffloadedEmbedding({num_embeddings}, {embedding_dim})'s table",
            larger=f"a larger max_rows (max_rows={max_rows} now)")
        # Made once: a tensor made each step would cross to a GPU with a host wait.
        self._padding_row = (None if padding_idx is None else
                             torch.tensor([padding_idx], dtype=torch.int64, device=self._table.device))
        self._zero_marks = torch.tensor([-0.0, 0.0], dtype=compute, device=self._table.device)  # see _note_backward
        self._reached, self._kept = ReachedRows(dropped=_gradient_dropped(weakref.ref(self))), None
        self._state = None
        self._narrowed = None
        self._hooks = None
        self._claim = None  # refuses other optimizers' steps over weight (see attach)
        self.cache_rows, self._cache = cache_rows, None
        self._writeback = None  # an mmap embedding's: writes the cache back should it be dropped unclosed
        self._closed_stats = None  # what stats() reports once close() has released the cache
        # A write into the scratch between steps (nn.init.normal_(emb.weight)) reaches no row: refused
        # at the next training forward, or (through weight.data, before it) at the first attach.
        self._scratch_writes = ScratchWrites(self.weight)
        # True while a step without rows is under way (None otherwise): the optimizer's write into the
        # scratch then is its own, not one to refuse (see _end_empty_step).
        self._empty_step = None
        # The empty sparse gradient a step without rows hands SparseAdam for its dense zero one.
        self._empty_sparse = None
        # Whether an eval-mode forward with gradients enabled ran since the last step: its rows
        # carry no gradient, where nn.Embedding's would train (see _refuse_eval_only_step).
        self._eval_with_grad = False
        # Reads and writes of the table through any reference to it (one kept from before a
        # step, the HostTable's own methods) first take back the rows the cache or a skipped step hold.
        self._table.watch_reads(self._prepare_table_read)
        self._table.watch_writes(self._prepare_table_write)

    @classmethod
    def from_pretrained(cls, embeddings: Union[Rows, PathLike], freeze: bool = True, *,
                        max_rows: Optional[int] = None, **kwargs) -> "OffloadedEmbedding":
        """An embedding whose table starts as ``embeddings``, like ``nn.Embedding.from_pretrained``.

        Args:
            embeddings: the ``(num_embeddings, embedding_dim)`` rows: a tensor
                (on any device), a numpy array, or the path of a ``.npy`` file
                (read chunk by chunk into the table, never whole into RAM).
            freeze: as in ``nn.Embedding``: True leaves :attr:`weight` frozen,
                so forwards read the table and nothing trains (no
                :meth:`attach` needed); False trains it after :meth:`attach`.
            max_rows: the working set's capacity (see the class); required, as
                there (left out, it raises the class's ``OptionError`` saying what it is,
                where ``nn.Embedding.from_pretrained`` takes none).
            **kwargs: the other arguments of the class (``storage``,
                ``padding_idx``, ``backend``, ``cache_rows``, ...). ``dtype``
                defaults to the rows' floating dtype. The padding row keeps its
                pretrained value, as in ``nn.Embedding``. Like
                ``nn.Embedding.from_pretrained`` it draws no random numbers, so
                layers built after it start as they would beside an in-memory table.

        Returns:
            OffloadedEmbedding

        Raises:
            ShapeError: ``embeddings`` is not 2-D, or nested lists of different lengths.
            DTypeError: rows that are not floating point, a numpy masked array,
                or a sparse or nested tensor.
            DeviceError: a tensor on the meta device.
            FileFormatError, MissingFileError: a bad or missing file, or one
                of another dtype than ``dtype``; an ``mmap`` table's file is
                removed again (with ``overwrite=True``, the one it replaced
                is gone too).
            OptionError, PathError: as the class's constructor (``max_rows`` left out too); ``freeze`` that
                is not a bool (``bool("False")`` is True: it would freeze the table);
                an HDF5 path (``.h5``/``.hdf5``), which :meth:`load` reads.
        """
        freeze = bool_option(freeze, "freeze", hint=" (forwards read the table, nothing trains)")
        if isinstance(embeddings, (str, bytes, os.PathLike)):
            if files.suffix_format(embeddings) == "h5":  # read_npy_header would say "not a valid .npy file"
                raise OptionError(f"from_pretrained reads a .npy file, not {os.fspath(embeddings)!r}: build the "
                                  f"embedding and load a speedswap checkpoint with emb.load(path), or write "
                                  f"the rows with numpy.save and pass that file")
            header = files.read_npy_header(embeddings)
            # A big-endian file holds the same numbers, which load() swaps as it reads them.
            dtype = header.table_dtype or torch_dtype(header.dtype)  # the latter raises, naming the dtypes
            shape, rows = header.shape, None
        elif isinstance(embeddings, torch.Tensor):  # copied from where it is: a GPU's rows need no host copy
            check_has_values(embeddings, "embeddings")
            rows = embeddings.detach()
            # Refused as an array's are: copy_ into a dtype= given would drop a complex one's imaginary part.
            shape, dtype = tuple(rows.shape), torch_dtype(rows.dtype)
        else:
            array, dtype = as_host_rows(embeddings, "embeddings")
            if not isinstance(dtype, torch.dtype):  # big-endian rows: a native copy torch can view
                array = array.astype(dtype, copy=False)
            rows = host_tensor(array, dtype)
            shape, dtype = tuple(rows.shape), rows.dtype
        if len(shape) != 2:
            raise ShapeError(f"from_pretrained takes (num_embeddings, embedding_dim) rows, got shape "
                             f"{tuple(shape)}")
        if "dtype" not in kwargs and not dtype.is_floating_point:
            # embedding_dtype's "use torch.float32" says nothing of how, for rows that are not a dtype given.
            convert = ("convert the file first: np.save(path, np.load(path).astype(np.float32))" if rows is None
                       else "pass dtype=torch.float32 (or another floating dtype) to convert them as they are read")
            raise DTypeError(f"from_pretrained's rows are {dtype}, but an embedding trains floating-point rows; "
                             f"{convert}")
        kwargs.setdefault("dtype", dtype)
        if rows is None:  # before the table is made: a refused file leaves no mmap file behind
            files.check_table_matches(header, shape, embedding_dtype(kwargs["dtype"]), embeddings)
        # Built as cls(...) builds it, marked first so that its constructor draws no rows: a keyword
        # for that would show in the public signature (help(), inspect) as one to pass.
        emb = cls.__new__(cls)
        object.__setattr__(emb, "_pretrained", True)
        emb.__init__(shape[0], shape[1], max_rows=max_rows, **kwargs)
        try:
            if rows is None:
                # Straight into the new table's memory: load() would first stage the whole
                # file in RAM, which keeps a table in use intact on a bad file; this one has no
                # rows to keep (it is closed, its mmap file removed, on any error).
                files.read_table(emb._table, embeddings, header)
            else:
                emb.table.apply_(lambda t: t.copy_(rows))
        except BaseException:
            emb.close()
            # Half made, it is no table, and it would make a retry raise ("already exists"). Removed only
            # while its name holds it: another file moved or saved there since is not this one's to remove.
            for made, identity in emb._created.items():
                with contextlib.suppress(FileNotFoundError):
                    if files.identity(os.stat(made)) == identity:
                        os.unlink(made)
            raise
        emb.weight.requires_grad_(not freeze)
        return emb

    def _replicate_for_data_parallel(self):
        raise OptionError(
            "nn.DataParallel would copy an OffloadedEmbedding onto each GPU, every copy gathering "
            "into and writing back the same working set: its rows would train wrongly. Train on one "
            "GPU (the table is in host memory: a GPU's memory is not what limits it), or split the "
            "table over processes with ShardedOffloadedEmbedding and DistributedDataParallel")

    def __reduce_ex__(self, protocol):
        raise unpicklable(type(self).__name__)

    @one_thread
    def check_conversion(self, fn: Callable) -> None:
        refuse_conversion(type(self).__name__, fn, self.weight, self._table.dtype)
        refuse_new_parameter(type(self).__name__)
        if self._table.closed:
            return
        if self._step_in_flight():
            refuse_new_storage(type(self).__name__, fn, self.weight, "optimizer.step()")
        refuse_new_gradient_storage(type(self).__name__, fn, self.weight)
        if gives_new_storage(fn, self.weight):
            self._scratch_writes.note_conversion()  # to_empty(): its memory is no write of the user's

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, max_rows={self.max_rows}, "
                f"storage={self._table.storage!r}"
                + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}")
                + (", scale_grad_by_freq=True" if self.scale_grad_by_freq else "")
                + (", sparse=True" if self.sparse else ""))

    # ------------------------------------------------------------- training
    @one_thread
    def attach(self, optimizer: torch.optim.Optimizer, *, restart: bool = False) -> None:
        """Offload ``optimizer``'s per-row state for :attr:`weight` and hook its ``step()``.

        Attaching starts the offloaded optimizer state afresh; an optimizer
        attached before (to this or another speedswap parameter) also drops
        its scalar state for :attr:`weight` (Adam's ``step``), as a fresh
        optimizer's. Attaching the optimizer that is attached already, once
        it trained the table (a step, or a checkpoint loaded), is refused
        unless ``restart=True``: by mistake (an attach inside the training
        loop) it would silently restart Adam's moments and step count. State
        put there by ``optimizer.load_state_dict`` is kept, for a resume
        (then :meth:`load` the checkpoint saved with it), unless ``restart=True``
        asks for a fresh start. ``optimizer.step(closure)``
        works: the rows are narrowed after the closure's forward and backward.

        Only this optimizer may step :attr:`weight` from now on (until
        :meth:`close`, or another ``attach``): the ``step()`` of any other
        optimizer whose param groups hold it (``torch.optim.Adam(model.parameters())``
        for the dense layers beside an attached ``SparseAdam``) raises
        ``OptionError`` before it changes anything, whether or not the weight
        has a gradient then, so the mistake shows at the first step whatever
        the order of the two steps. Build that optimizer from the other
        parameters. A frozen weight (``requires_grad=False``, no gradient) may
        stay in it: torch's optimizers skip it. Its ``zero_grad()`` is not
        refused (after a backward it drops the step, as any ``zero_grad()`` does).

        Args:
            optimizer: a ``torch.optim`` optimizer whose params include :attr:`weight`.
            restart: attach the optimizer attached already again, starting
                its state for the table afresh on purpose (:meth:`init_state`
                restarts the per-row state alone, the step count going on).

        Raises:
            DTypeError: ``optimizer`` is not an optimizer (its class, or the parameters).
            OptionError: the optimizer does not hold :attr:`weight`, or its
                state is not element-wise (LBFGS); ``restart`` that is not a bool.
                Nothing changes.
            PathError: with ``storage="mmap"``, a file the new state would
                replace exists and this embedding did not create it (or another
                file was put under its name since; and no ``overwrite``), or
                a new state file cannot be made (out of file
                descriptors, a disk error). Nothing changes: the optimizer
                attached before stays, its state files intact: the new ones
                are made beside them and replace them last, all or none (where
                one of those renames fails, the ones before it are put back).
            StateError: a closed embedding, or between a training forward and the step;
                ``optimizer`` attached already and trained since, without ``restart=True``;
                at the first attach, a write into :attr:`weight` through ``weight.data``
                since it was built (``emb.weight.data.uniform_(-a, a)``), which reached no row
                (said once: the next attach goes on); in a process forked from the one that built
                it, a table the two share (see :mod:`~speedswap.train.one_process`).
            OutOfMemoryError: the new state tables or the device cache do not
                fit. Nothing changes: the new state is made before the old one
                is released (attaching again needs room for both for a moment),
                so the optimizer attached before stays, with its state.
        """
        self._check_open()
        self._one_process.refuse_shared_training(self.weight, self._storage == "mmap")
        if self._step_in_flight():
            raise StateError("attach between a training forward and optimizer.step() would drop "
                             "the step's rows; attach between steps")
        restart = bool_option(restart, "restart", hint=" (start the attached optimizer's state afresh)")
        if not restart:
            refuse_unasked_restart(self._state, optimizer, type(self).__name__)
        self._scratch_writes.refuse_written_through_data(self._full)  # as built: to_empty() may replace .data
        # An unsupported optimizer, or a file the new state may not replace, is refused before
        # anything changes.
        check_state_files(optimizer, self.weight, self._storage, self._path, self._overwrite or self._created)
        if self._cache is not None:
            # The old cache's rows into the tables while the old state is whole: once the new state's
            # files replaced the old ones' (mmap), releasing the old state must have nothing left to fail.
            self._cache.flush()
        held = optimizer.state.get(self.weight)
        drop_leftover_state(optimizer, self.weight, restart)  # this one's or an earlier one's: a fresh start
        try:
            # With mmap storage, the files that replace the old state's are made under temporary names
            # and replace them only once the cache is made too: a refused attach leaves them intact.
            state = RowState(optimizer, self.weight, self.num_embeddings, self.weight.dtype, self._storage,
                             self._backend, self._path, overwrite=self._overwrite or self._created,
                             replace_later=True)
            try:
                cache = new_cache(self.cache_rows, self._table, state.tables, self.weight.dtype)
                state.replace_files()
            except BaseException:
                state.close()  # unhooked, it would be saved and read as the attached optimizer's
                raise
        except BaseException:
            if held is not None:  # the state an earlier attach left it (Adam's step) stays, as the old tables do
                optimizer.state[self.weight] = held
            raise
        self._created |= state.made_files()  # a later attach may replace them
        old = self._unhook_state()
        for table in state.tables.values():  # reads of the state, a view kept too, as of the table
            table.watch_reads(self._prepare_table_read)
        self._state, self._cache = state, cache
        # Dropped without close() (or at exit), an mmap embedding still writes its cached rows
        # back: its files must hold them, as they hold every row without a cache. (Other
        # tables die with the embedding: nothing to write to.)
        self._writeback = weakref.finalize(self, _write_back, cache) if self._storage == "mmap" else None
        self._hooks = StepHooks(self, optimizer)
        self._claim = claim(self, self.weight, optimizer)
        close_replaced(old, state)  # last: an interrupt during it comes after the attach

    def _unhook_state(self) -> Optional[RowState]:
        """Unhook the attached optimizer, and let go of the device cache (rows written back first) and of its state.

        Returns:
            the state let go of, still to be closed (its tables' maps are flushed as they are closed,
            which may take long); None where no optimizer was attached.
        """
        if self._cache is not None:
            self._cache.flush()  # cached rows are the current ones
            if self._writeback is not None:
                self._writeback.detach()
            self._cache = None
        state, self._state = self._state, None
        if state is not None:
            self._hooks.remove()
        return state

    @one_thread
    def init_state(self) -> None:
        """Reset every row's optimizer state to the value torch creates it with.

        For restarting the optimizer's per-row state (after loading a
        checkpoint of an older speedswap, which records no step count, when
        the optimizer's ``state_dict`` was not saved). Only the per-row
        state: the optimizer's scalar state (Adam's ``step``) goes on, as
        when an in-memory optimizer's moment tensors are zeroed;
        ``attach(optimizer, restart=True)`` for a full restart.

        It may run between a forward and the step: that is the advice of a
        step refused because the optimizer holds no state for trained rows.

        Raises:
            StateError: before :meth:`attach`, or on a closed embedding.
        """
        self._check_open()
        if self._state is None:
            raise StateError("init_state needs an attached optimizer: call emb.attach(optimizer)")
        with resetting_state(self._cache):  # cached state rows would outlive the reset
            self._state.init_state()

    def _check_open(self):
        if self._table.closed:
            raise StateError("this OffloadedEmbedding is closed (close() released its table and optimizer "
                             "state); build a new OffloadedEmbedding and load what was saved before close() "
                             "into it (emb.load(path), or model.load_state_dict) to go on from there")

    # Run eagerly under torch.compile: the step's bookkeeping (rows joining the working set,
    # host reads, the forward's one host wait) is Python state a traced graph would replay
    # stale; the rest of a compiled model is still compiled around this call.
    @torch.compiler.disable
    @one_thread
    def forward(self, input: Optional[Ids] = None, *extra, ids: Optional[Ids] = None,
                offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rows of the ids: a tensor of shape ``(*ids.shape, embedding_dim)``.

        Args:
            input: integer ids of any shape (tensor on the CPU or the table's
                device, numpy array, or list), under ``nn.Embedding``'s name.
                They are checked once, here.
            ids: the same, under speedswap's name: give one of the two.
            extra, offsets, per_sample_weights: ``nn.EmbeddingBag``'s
                arguments, refused: this is no bag (see the class docstring).

        Raises:
            IdError, DTypeError, DeviceError: bad ids (nothing changes); both
                ``input`` and ``ids``, or neither (DTypeError); ``offsets`` or
                ``per_sample_weights``, by position or keyword (DTypeError).
            CapacityError: the step touches more than ``max_rows`` distinct rows.
            StateError: training before :meth:`attach`; training, in a process forked from
                the one that built it, a table the two share (after ``model.share_memory()``,
                or in mmap files: see :mod:`~speedswap.train.one_process`); a forward, an
                eval one too while a view of the table is alive, after a ``zero_grad()`` that
                dropped a step whose rows differ from the table's (see :meth:`_drop_zeroed_step`).
            OptionError: a training forward inside ``DistributedDataParallel``
                that averages :attr:`weight`'s gradient (see :func:`_refuse_ddp`);
                under a ``torch.func`` transform, a training forward, or one of
                ids or a weight the transform tracks (nothing changes). A forward
                reading the table of other ids runs as a constant to it.
        """
        if extra or offsets is not None or per_sample_weights is not None:
            refuse_bag_arguments(type(self).__name__, extra, offsets, per_sample_weights)
        ids = forward_ids(input, ids)
        weight = self.weight  # read once: each read of a parameter goes through Module.__getattr__
        reads = not (self.training and torch.is_grad_enabled() and weight.requires_grad)
        outside, ids = outside_function_transforms(type(self).__name__, reads, ids, weight)
        self.refuse_replaced_weight(weight)
        self._check_open()
        self._abort_step()
        if reads:
            if self._working_set.size and self._table.viewed:
                # A write through a view after zero_grad() dropped the step reached the table, not weight, which
                # the step's rows are read from below: the step is dropped first (refused where its rows differ
                # from the table's), as by a training forward.
                with outside:
                    self._drop_zeroed_step()
            self._eval_with_grad |= torch.is_grad_enabled() and weight.requires_grad
            with outside:
                if self._cache is None:
                    return self._table.gather(ids).to(weight.dtype)
                # The ids' range is checked by the cache, in a read it makes anyway (with some rows cached).
                flat, shape, check_bounds = as_row_ids_deferred(ids, self.num_embeddings, weight.device)
                rows = self._cache.read(flat, counted=True, check_bounds=check_bounds)
                if self._working_set.size:
                    rows = self._with_step_rows(flat, rows)
                return rows.view(*shape, self.embedding_dim).to(weight.dtype)
        self._one_process.refuse_shared_training(weight, self._storage == "mmap")
        _refuse_ddp(weight)
        local = self._add_rows(ids)
        # Slots name rows one to one, so counting them counts the ids (scale_grad_by_freq).
        out = F.embedding(local, self._lookup_alias(weight), padding_idx=None if self.padding_idx is None else 0,
                          scale_grad_by_freq=self.scale_grad_by_freq)
        self._reached.track(out, local)  # a forward no backward reaches trains nothing
        return out

    def _with_step_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of the flat ``ids`` read from the table, those of the step in flight as :attr:`weight` holds them.

        Between a training forward and ``optimizer.step()`` the table holds the
        step's rows as before it, and :attr:`weight` holds them as the step
        will train them: moved in place, where SAM perturbs them between its
        two passes. ``nn.Embedding``'s eval forward reads its weight, moved
        rows too (they were read unmoved: 0.020 max difference). A tensor
        assigned to ``weight.data`` is taken first, as the step would take it.

        Raises:
            StateError: the assigned tensor is refused (see :meth:`_adopt_replaced_data`).
        """
        self._adopt_replaced_data()
        slots, held = self._working_set.slots_of(ids)
        return torch.where(held[:, None], self._full.index_select(0, slots), rows.to(self._full.dtype))

    def _lookup_alias(self, weight: torch.Tensor) -> torch.Tensor:
        """The alias of ``weight`` every training lookup of the step reads, made at the first (see ``__init__``).

        One alias with one node (:class:`_Lookups`), so that the engine sums
        the lookups' gradients there and hands weight's gradient accumulator
        one tensor, which :func:`_note_lookups` notes. Kept for the whole step,
        also once ``weight`` was written in place between two forwards
        (rows perturbed under ``no_grad()``, then one backward over both):
        no lookup saves ``weight`` for its backward, so the write does not
        break the graph, and the one node still takes every lookup's gradient.
        """
        if self._lookups is None:
            self._lookups = _Lookups.apply(weight)
            self._lookups.grad_fn.register_hook(_note_lookups(weakref.ref(self)))
        return self._lookups

    def _forget_lookups(self):
        """End the step's lookup alias and what its backwards noted (see ``__init__``)."""
        self._lookups, self._lookup_grad, self._outside = None, None, False

    @one_thread
    def slots(self, ids: Ids) -> torch.Tensor:
        """Training without autograd: bring the rows of ``ids`` into the step and return their slots.

        What a training ``forward`` does, minus the lookup: the rows join the
        step's working set, ``weight[slots]`` are the rows of ``ids``, and the
        optimizer's ``step()`` trains them. For models that compute their own
        gradients (:mod:`speedswap.apps.skipgram`): write the gradient of the
        step's rows into a ``weight``-shaped tensor, assign it to
        ``weight.grad`` and call ``optimizer.step()``; the step reads only its
        first ``len(working_rows)`` rows. Rows new to the step take the next
        free slots in ascending id order, so a step's first call with sorted,
        distinct ids gives them slots ``0, 1, 2, ...``. With ``padding_idx``
        the padding row is slot 0 and must get no gradient. Works in any grad mode.
        To skip a step whose gradient was written by hand, call
        :meth:`discard_step`: ``zero_grad()`` alone drops the gradient but not
        the rows, which the next step would then train at a zero gradient
        (Adam moves them by their momentum).

        Args:
            ids: integer ids of any shape (as for :meth:`forward`), checked once, here.

        Returns:
            int64 slots of ``weight`` shaped like ``ids``, on its device.

        Raises:
            IdError, DTypeError, DeviceError: bad ids (nothing changes).
            CapacityError: the step touches more than ``max_rows`` distinct rows.
            StateError: before :meth:`attach`, or on a closed embedding.

        >>> import torch, speedswap as ss
        >>> emb = ss.OffloadedEmbedding(100, 4, max_rows=8, backend="numpy")
        >>> opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        >>> emb.attach(opt)
        >>> slots = emb.slots(torch.tensor([42, 7, 42]))
        >>> grad = torch.zeros_like(emb.weight)
        >>> emb.weight.grad = grad.index_add_(0, slots, torch.ones(3, 4))
        >>> opt.step()          # row 42 moves by -1.0, row 7 by -0.5
        """
        self._check_open()
        self._abort_step()
        local = self._add_rows(ids)
        self._reached.reached(local)  # the caller writes these rows' gradient
        return local

    @one_thread
    def discard_step(self) -> None:
        """Drop the rows (and gradients) of the training forwards since the last step, which will not run.

        For a step that is skipped: a loss that was not finite, a
        ``GradScaler`` that found inf gradients. Without it the next
        ``optimizer.step()`` would also train the skipped forwards' rows, with
        whatever gradient they hold (Adam moves a row even at a zero
        gradient), where in-memory lazy training leaves them alone. The table,
        the optimizer state and the cache keep those rows as they were; a
        tensor assigned to ``weight.data`` in the step (a snapshot restored
        to roll it back) goes with it.

        ``optimizer.zero_grad()`` (``set_to_none=False`` too: a gradient ``zero_()``
        zeroed after a backward with no step since counts as dropped, one the
        backward itself left at zero, or one multiplied by 0, does not) between a
        backward and the next training forward does this by itself; between
        the next forward and its backward, it leaves the skipped forwards' rows
        unchanged at the next step, as rows no backward reached. An
        ``optimizer.step()`` that follows the skipped step with no forward of
        its own moves none of its rows either (see :meth:`_zeroed_since_backward`),
        a backward that left the gradient exactly zero (a loss weighted by 0)
        included. A step
        skipped before its backward needs nothing for exactness: rows that
        only forwards no backward reached are put back unchanged when the next
        step ends (:mod:`speedswap.train.reached`); this frees their slots now.

        A gradient :attr:`weight` holds is zeroed in place, not dropped: after
        ``zero_grad(set_to_none=False)`` an in-memory table's gradient is
        zeros, and an ``optimizer.step()`` on it still counts (Adam's step).

        Raises:
            StateError: on a closed embedding.
        """
        self._check_open()
        self._abort_step()
        if self._working_set.size:
            self._working_set.clear()
            self._cache.end_step()  # nothing is stored: the cache holds the rows as before
            # A tensor assigned to weight.data in the step (a snapshot restored to skip it) goes with it, as a
            # write in place does: taken back at the next forward, it read as a write between steps and was refused.
            self.weight.data = self._full
        if self.weight.grad is not None:
            # Its slots will hold other rows, so its values go; a zero gradient stays, as in
            # memory after zero_grad(set_to_none=False), and a step on it counts (Adam's step).
            self.weight.grad.zero_()
        self._backward_ran = False
        self._stale = None
        self._forget_lookups()
        self._eval_with_grad = False
        self._scratch_writes.note_own(self.weight)  # SAM may have perturbed the dropped step's
        self._reached.clear()

    def _gradient_zeroed(self) -> bool:
        """Whether :attr:`weight` holds no gradient: None, or zeros.

        Asked only after a backward with no step since, where a gradient is
        zero because ``zero_grad()`` dropped it (``set_to_none=False``
        zeroes it in place, as after a ``GradScaler`` skipped the step: in
        memory SparseAdam's zeroed sparse gradient then names no row). Its
        version cannot tell: ``torch._foreach_zero_`` leaves it as it was
        on CUDA. So the values are read, a host wait on a GPU, in that case
        alone (a forward of gradient accumulation). A gradient the last
        backward itself left at zero on every row of the step (a loss
        weighted by 0) is not dropped unless ``zero_()`` cleared its mark
        (:meth:`_cleared`): in memory its rows are in the sparse gradient, at
        zero values, and the step trains them, until ``zero_grad()`` empties it.
        """
        grad = self.weight.grad
        if grad is None:
            return True
        # All of it, not the step's rows alone: past them it holds values only where emb.weight was
        # used outside its lookups, which no zero_grad() dropped (a forward then refuses to go on,
        # see _refuse_gradient_outside_lookups), where a step without rows would pass for dropped.
        if bool(holds_nonzero(self._step_gradient(grad) if grad.is_sparse else grad)):
            return False
        # Zero now: dropped if zero_() zeroed it since the last backward. One that backward left at
        # zero (a loss weighted by 0), or that was multiplied by 0 since, is accumulation, as in memory,
        # where the looked-up rows are in the sparse gradient at zero values and SparseAdam steps them.
        if self._grad_at_backward is None:
            return True
        nonzero = self._grad_at_backward[1]
        if nonzero is None:  # sparse: unwritten since the backward, it is the zero that backward left
            return self._written_since_backward(grad)
        return bool(self._cleared(grad))

    def _written_since_backward(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` was replaced, or written in place (its version), since the last backward noted it."""
        left, _, version = self._grad_at_backward
        return left() is not grad or grad._version != version

    def _zeroed_since_backward(self) -> Optional[torch.Tensor]:
        """Whether ``zero_grad()`` zeroed the non-zero gradient the last backward left (a step with no forward since).

        ``backward()``, ``zero_grad(set_to_none=False)``, ``optimizer.step()``:
        in memory SparseAdam's zeroed sparse gradient names no row, and the
        step moves none; the step's rows are still in flight here, and Adam
        would move them by their momentum at the zero gradient. Asked only
        where the gradient was written in place since that backward (its
        version tells, with no host wait), or may have been without its
        version telling (:meth:`_zeroes_unversioned`): ``unscale_`` and
        clipping write it too, so the answer is a 0-dim bool tensor, computed
        on the device.
        A gradient that backward left at zero (a loss weighted by 0) counts
        as zeroed where ``zero_()`` cleared its mark; one unscaled or clipped
        keeps it, and one multiplied by 0 keeps the signs of its negative
        values (:meth:`_cleared`): those train as they are, as in memory.

        Returns:
            None when the gradient is as the backward left it (or no dense
            backward gradient was noted), else True where ``zero_()`` zeroed
            it since (zero on the step's rows, its zeros all of one sign: see :meth:`_cleared`).
        """
        grad = self.weight.grad
        if not self._backward_ran or grad is None or grad.is_sparse or self._grad_at_backward is None:
            return None
        nonzero = self._grad_at_backward[1]
        if nonzero is None or not (self._written_since_backward(grad) or self._zeroes_unversioned()):
            return None
        return self._cleared(grad) & ~holds_nonzero(self._step_gradient(grad))

    def _zeroes_unversioned(self) -> bool:
        """Whether the attached optimizer's ``zero_grad()`` may zero the gradient without a version bump.

        Built with ``foreach=True`` or ``fused=True``, it zeroes through
        ``torch._foreach_zero_``, whose CUDA kernel leaves the version as it
        was. Its steps then always ask the values (on the device, and at the
        cost of a copy of the step's rows and state); the others' only when
        the version tells of a write. On the CPU ``_foreach_zero_`` zeroes
        tensor by tensor with ``zero_()``, which bumps each version: there the
        version tells for every optimizer (:func:`_foreach_zero_keeps_version`).
        """
        if not _foreach_zero_keeps_version(self.weight.device):
            return False
        defaults = self._state.optimizer.defaults
        return bool(defaults.get("foreach") or defaults.get("fused"))

    def _cleared(self, grad: torch.Tensor) -> torch.Tensor:
        """Whether the dense ``grad``, zero on the step's rows, was zeroed by ``zero_()`` (negated since or not).

        Told by the signs of its zeros (:func:`~speedswap.train.zero_marks.reads_as_zeroed`;
        a backward that leaves the step's gradient at zero marks two of them,
        :func:`_note_backward`). A 0-dim bool tensor, on the device.
        """
        return reads_as_zeroed(grad[:self._working_set.size])

    def _step_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """The values of ``grad`` for the step's rows (a sparse gradient's values)."""
        return grad.coalesce().values() if grad.is_sparse else grad[:self._working_set.size]

    def _drop_zeroed_step(self):
        """Discard the step in flight if ``zero_grad()`` dropped its gradients after a backward (it never ran).

        Unless the rows were changed in place since that backward (SAM
        perturbs them between two forward-backward passes): the step goes on
        with them as they are, and rows only the earlier forwards looked up
        are put back at the step, their gradient having been dropped.

        Raises:
            StateError: the rows differ from the table's and a view of the
                table is alive: a write through it cannot be told from rows
                changed in place, and taking it for one would undo it; or
                they were assigned (:meth:`_refuse_stale_assigned_rows`).
        """
        dropped = self._backward_ran and self._gradient_zeroed()
        self._adopt_replaced_data()  # the rows compared below are the user's
        if dropped:
            if self.weight._version != self._version_at_backward:
                self._keep_perturbed_step()
            elif self._rows_changed():
                if self._table.viewed:
                    raise StateError(
                        "the rows of the step zero_grad() dropped differ from the table's, and a view "
                        "the table handed out (to_numpy(), as_tensor()) is alive: a write through it "
                        "cannot be told from rows changed in place between two backwards (SAM), whose "
                        "step goes on and would write its rows back over the write. Call "
                        "emb.discard_step() after zero_grad() of a skipped step, before writing "
                        "through a view (or write with emb.table.scatter), then go on")
                self._keep_perturbed_step()
            else:
                self.discard_step()

    def _keep_perturbed_step(self):
        """Go on with a step whose rows were changed in place after its gradient was dropped (SAM)."""
        self._reached.forget_reached()
        self._backward_ran = False

    def _rows_changed(self) -> bool:
        """Whether the working set's rows differ from the table's (and cache's) values of them.

        A change through ``weight.data`` (``p.data.add_(e)``) keeps ``weight``'s
        version, so the rows themselves are compared: one gather of the
        step's rows, on the path where ``zero_grad()`` dropped a step only.
        NaN counts as equal to NaN: a row that diverged to NaN (the usual
        reason to skip a step) is unchanged, not perturbed.
        """
        rows = self._working_set.size
        return not bool(same_rows(self._table_rows(rows), self._full[:rows]).all())

    def _table_rows(self, rows: int) -> torch.Tensor:
        """The table's (and cache's) values of the step's first ``rows`` rows, in :attr:`weight`'s dtype: one read."""
        with torch.no_grad():
            return self._cache.read(self._working_set.rows[:rows]).to(self._full.dtype)

    def _adopt_replaced_data(self):
        """Take the values of a ``weight.data = tensor`` assignment into the working set.

        SAM (``p.data = old_p``) restores its saved rows that way; the step must
        train them, and the working set's own storage is what the table and
        the next forwards read. Only the slots the working set had when
        ``weight.data`` was last seen to be its own are taken: rows that
        joined later cannot be in the assigned copy. Between steps the slots
        hold no row: other values assigned are refused at the next training
        forward (:meth:`ScratchWrites.take_back`).

        Raises:
            StateError: the new data is not shaped, typed and placed as
                :attr:`weight`, or holds stale values for the step's rows
                (:meth:`_refuse_stale_assigned_rows`); nothing changes.
        """
        if not self._working_set.size:  # values assigned between steps reach no row: refused, not taken
            self._scratch_writes.take_back(self.weight, self._full)
        self._refuse_stale_assigned_rows()
        if take_assigned(self._full, self.weight.data, self._seen_rows, _refused_data):
            self.weight.data = self._full
        else:
            self._seen_rows = self._working_set.size

    def _refuse_stale_assigned_rows(self):
        """Refuse a ``weight.data = tensor`` whose values for the step's rows are neither theirs nor the table's.

        ``weight`` holds the step's rows only, and its slots held other rows
        before they joined. A copy taken before the step's forwards (a snapshot
        to roll back to, ``saved = p.data.clone()`` at the top of the loop), or
        after the first backward where a second pass brought in rows (SAM's
        ``old_p``), holds other rows' values in their slots, where in memory
        the copy holds the whole table. Assigned back, the step would train
        them from those values, silently (3.55 max difference to in-memory SGD
        over four steps rolled back this way, 4.47 once ``zero_grad()`` passed
        them off as rows SAM moved). Each row must be assigned its current
        values (a copy taken after it joined, then undone moves) or the
        table's (SAM's restore); other values cannot be told from a stale
        copy, so rows moved by assignment (``p.data = p.data + e``) are
        refused too. One read of the step's rows, on this path only.

        Raises:
            StateError: a row is assigned other values; nothing changes
                (:attr:`weight` gets its own storage back, holding the
                step's rows as before the assignment).
        """
        data, full, rows = self.weight.data, self._full, self._seen_rows
        if (not rows or same_memory(data, full)
                or (data.shape, data.dtype, data.device) != (full.shape, full.dtype, full.device)):
            return  # nothing assigned, or what take_assigned refuses as misshapen
        with torch.no_grad():
            assigned = data[:rows]
            table = self._table_rows(rows)
            stale = ~(same_rows(assigned, full[:rows]) | same_rows(assigned, table))
            if not bool(stale.any()):
                return
            count = int(stale.sum())
        late = 0 if self._rows_at_backward is None else rows - self._rows_at_backward
        joined = f" ({late} of them joined the step after its first backward)" if late > 0 else ""
        self.weight.data = full
        raise StateError(
            f"emb.weight.data was assigned a tensor whose values for {count} of the step's {rows} rows are "
            f"neither theirs nor the table's{joined}. emb.weight holds the step's rows only, and its slots held "
            f"other rows before these joined: a copy taken before the step's forwards (a snapshot to roll back "
            f"to) or before rows joined (SAM's old_p, with a second pass over other ids) holds other rows' "
            f"values, which cannot be told from rows moved on purpose (p.data = p.data + e). Nothing was "
            f"changed: emb.weight has its own storage back, with the step's rows as before the assignment. To "
            f"skip the step, call emb.discard_step(); to move rows, move them in place (emb.weight.data.add_(e)) "
            f"and undo the move in place, or assign a copy taken after the step's last forward")

    def _step_in_flight(self) -> bool:
        """Whether training forwards hold rows for a step still to come (a step zero_grad() dropped holds none).

        A step the optimizer raised inside is put back first: its rows are
        still in flight, and the parameter is no longer narrowed to them.
        """
        self._abort_step()
        self._drop_zeroed_step()
        return bool(self._working_set.size)

    @property
    @one_thread
    def table(self) -> HostTable:
        """The whole table: a :class:`~speedswap.HostTable` holding every row's current value.

        With a device cache, between steps the cache first writes its rows
        (and their optimizer state) back and forgets them; the cache fills
        again as training goes on. Between a training forward and
        ``optimizer.step()`` it keeps them (the step stores its rows in its
        slots), and the table, read through its methods, holds the rows
        before the step, as an in-memory table does. Reads and writes
        through the table's methods (:meth:`~speedswap.HostTable.gather`, ``to_numpy``, ``save``;
        :meth:`~speedswap.HostTable.scatter`, ``apply_``, the initialisers,
        ``load_from``), through any reference to it, a kept one too, work as
        on an in-memory table: the cache and a step ``zero_grad()`` skipped
        give their rows back first. A view ``to_numpy()`` or ``as_tensor()``
        hands out (of the optimizer state's tables too, as in
        :meth:`get_extra_state`) stays current while it, or anything made from
        it, is alive, as a view of an in-memory parameter does (the step
        writes its rows back inside ``optimizer.step()``, in a post-hook that
        runs before any other, so every step post-hook sees them stepped): the cache
        keeps no rows meanwhile (each step writes its rows back), so keep
        ``to_numpy(copy=True)`` snapshots instead of views to let it work. A
        write through a view between steps trains on; one between a training
        forward and ``optimizer.step()`` is undone by the step, which writes
        its rows back (through the table's methods such a write raises
        :class:`~speedswap.StateError`).
        """
        if self._backward_ran and not self._table.closed and self._gradient_zeroed():
            # A step zero_grad() dropped after its backward is discarded now: the next forward
            # would take rows written through the table meanwhile for rows changed in place
            # (SAM), go on with the step, and write its rows back over the writes. A step the optimizer
            # raised inside is undone first: its writes into weight are no move of SAM's.
            self._abort_step()
            self._drop_zeroed_step()
        cache = self._cache
        # Mid-step the cache must keep the slots the step stores its rows in: the table's reads
        # have it write its rows back first (_prepare_table_read), and its writes are refused.
        if cache is not None and cache.num_slots and not self._table.closed and not self._step_in_flight():
            cache.flush()
            cache.invalidate()
        return self._table

    @one_thread
    def _prepare_table_read(self):
        """Have the device cache write its rows back before a read of the table through any reference to it.

        Only with a cache of rows: without one the table is current, and an
        eval forward's read (:meth:`HostTable.gather`) waits for nothing.
        """
        if self._cache is not None and self._cache.num_slots:
            self._cache.flush()

    @one_thread
    def _prepare_table_write(self):
        """Make a write into the table, through any reference to it, take effect as in memory.

        A step ``zero_grad()`` skipped after its backward is dropped: the next
        forward would take the written rows for rows perturbed in place (SAM),
        go on with the step, and write its rows back over the write. The
        device cache writes its rows back and forgets them: it would write
        them back over the write at eviction.

        Raises:
            StateError: between a training forward and ``optimizer.step()``,
                which would write the step's rows back over the write; nothing
                changes.
        """
        if self._step_in_flight():
            raise StateError("a write into an OffloadedEmbedding's table between a training forward and "
                             "optimizer.step() would be undone by the step, which writes its rows back; "
                             "write between steps (or call emb.discard_step() first)")
        if self._cache is not None and self._cache.num_slots:
            self._cache.flush()
            self._cache.invalidate()

    @property
    def working_rows(self) -> torch.Tensor:
        """The table ids of the current step's rows, by slot (empty between steps).

        ``weight[:len(working_rows)]`` holds them; it is what ``optimizer.step()`` trains.
        """
        return self._working_set.rows

    def _add_rows(self, ids):
        """Local ids (slots) of ``ids``, their rows gathered into the working set."""
        if self._state is None:
            # Named by its sizes: in a model of several tables, the one left out of the attach loop.
            raise StateError(f"this {self!r} has no optimizer attached: call emb.attach(optimizer) "
                             f"before training it, with the optimizer that holds its weight (each "
                             f"offloaded embedding of a model is attached on its own): the optimizer's "
                             f"step() is where the updated rows are written back")
        if in_backward():
            # Activation checkpointing runs the forward again inside the backward, after any
            # zero_grad() since its first run, whose rows are in the step: dropping the step here
            # would drop them too. The backward decides when it reaches the lookup (_gradient_dropped).
            self._adopt_replaced_data()
        else:
            self._refuse_gradient_outside_lookups()
            self._drop_zeroed_step()  # which takes over a replaced weight.data first
        # The ids' range is checked by the working set, in a read it makes anyway.
        flat, shape, check_bounds = as_row_ids_deferred(ids, self.num_embeddings, self.weight.device)
        ws = self._working_set
        start = ws.size
        if start == 0:
            self._scratch_writes.refuse_written(self.weight)
            self._state.check_not_replaced()  # refused before a step begins, when emb.load still may run
            self._rows_at_backward = None  # a backward before the step's first forward holds none of its rows
        try:
            if start == 0 and self._padding_row is not None:
                ws.start_with(self._padding_row)  # slot 0
            written = start and self.weight._version != self._version_at_lookup
            local, _, hits = ws.add(flat.view(shape), check_bounds, self._count_hits(start),
                                    self._refuse_rows_after_write if written else None)
        except (CapacityError, IdError):
            if start == 0:
                ws.clear()  # the padding row too: a refused forward leaves no trace
            raise
        try:
            # The padding row is in every step without being looked up: not counted as one.
            self._gather_new(start, len(flat), carried=int(start == 0 and self.padding_idx is not None),
                             hits=hits, picked=ws.added_at)
        except BaseException:
            # The rows joined the working set but their slots were never filled (out of memory,
            # an interrupt): the step cannot go on with them, so it is dropped, as discard_step() does.
            self.discard_step()
            raise
        self._seen_rows = ws.size  # weight.data is _full (adopted above) and holds them all
        self._version_at_lookup = self.weight._version  # the gather wrote through .data, which it does not count
        return local

    def _refuse_rows_after_write(self, new: int):
        """Refuse a training forward that brings new rows into a step whose ``weight`` was written in place since.

        ``weight`` holds the rows the step looked up so far, in its first
        slots; the others are scratch. A write into it (``weight.mul_(0.5)``
        under ``no_grad()``, a perturbation) reaches those rows; rows a later
        forward brings in come from the table without it, where in
        ``nn.Embedding``'s whole weight they have it. Whether the write reached
        only the held rows (SAM's perturbation, a gradient's shape) or the
        scratch too cannot be told without reading values, so a forward of
        new rows after it is refused; forwards of held rows go on (SAM passes
        over one batch twice). Told from ``weight``'s version, on the host.

        Raises:
            StateError: always, before the working set or the cache changes.
        """
        raise StateError(f"emb.weight was written in place since this step's last training forward, and "
                         f"this forward looks up {new:,} row(s) the step does not hold yet. emb.weight holds "
                         f"only the rows the step has looked up: a write into it reaches those, and rows "
                         f"looked up after it would come from the table without it, where nn.Embedding's "
                         f"whole weight has it. Look up every row of the step before writing into "
                         f"emb.weight, or write the table between steps (emb.table.apply_, scatter); "
                         f"nothing was changed (emb.discard_step() drops the step)")

    def _refuse_gradient_outside_lookups(self):
        """Refuse a forward after a backward that gave a gradient to slots holding none of the step's rows.

        Slots past the step's rows hold rows of earlier steps, or zeros: only
        a use of :attr:`weight` itself outside the lookups (a penalty summed
        over ``model.parameters()``, a layer tied to it) gives them a
        gradient, computed from those other rows. The step's next rows would
        take these slots and train on it, where in memory a row looked up
        later in a step gets the penalty's gradient of its own value. Where
        no forward follows, the step refuses it
        (:meth:`_refuse_use_outside_lookups`, which reads no value).
        Asked only in a forward after a backward of the same step (gradient
        accumulation, a penalty's backward before the forward): one host
        wait on a GPU, on a path that waits already (:meth:`_gradient_zeroed`).
        A gradient the last step left (``_stale``) is refused at the step,
        with its own advice.

        Raises:
            StateError: the gradient is non-zero past the step's rows; nothing changes.
        """
        grad = self.weight.grad
        if not self._backward_ran or grad is None or grad.is_sparse or (self._stale and self._stale() is grad):
            return
        size = self._working_set.size
        if not bool(holds_nonzero(grad[size:])):
            return
        raise StateError(
            f"emb.weight got a gradient outside this OffloadedEmbedding's lookups (a term of the loss "
            f"over emb.weight itself: an L2 penalty summed over model.parameters(), a layer tied to "
            f"the weight) on slots {size} and above, which hold no row of this step: emb.weight is "
            f"the step's working set, so that gradient was computed from rows of earlier steps, and "
            f"the step's next rows, which take those slots, would train on it. Nothing was changed. "
            f"Leave emb.weight out of such terms ([p for p in model.parameters() if p is not "
            f"emb.weight]) and penalise the rows a step looks up (emb(ids).pow(2).sum()), or use the "
            f"optimizer's weight_decay; call emb.discard_step() and optimizer.zero_grad(), and run "
            f"the step again")

    def _count_hits(self, start):
        """The working set's ``count_also`` for a forward's rows: the cache's hits, in its one read."""
        if not self._cache.num_slots:
            return None
        carried = self._padding_row if start == 0 else None  # the padding row joins the step's first fetch
        return lambda ids_sorted, new: self._cache.count_hits(ids_sorted, new, carried)

    def _gather_new(self, first_new, lookups=0, **counting):
        # Rows new to the working set: hits from the device cache, misses from the host.
        # No torch.no_grad() needed: _full is weight.data, which autograd never sees.
        rows = self._working_set.rows[first_new:]
        self._cache.fetch(rows, self._full[first_new:first_new + rows.shape[0]], first_new, lookups, **counting)

    # The step protocol of StepHooks.
    @one_thread
    def _begin_step(self):
        # The step's rows are this thread's from here until _end_step or _abort_step puts the
        # parameter back: another thread's call in between would undo or read a step half done.
        if self._narrowed is not None:
            return
        try:
            self._narrow_step()
        finally:
            # None for a refused step. One for a step without rows too: another thread's training forward
            # would gather rows into the scratch the optimizer steps (Adam moves it by its momentum).
            self._one_thread.hold(self._narrowed is not None or self._empty_step is not None)

    def _narrow_step(self):
        rows = self._working_set.rows
        k = rows.shape[0]  # not len(): torch's Tensor.__len__ is Python (NOTES 47)
        if not k:
            self._refuse_eval_only_step()
            self._refuse_gradient_without_rows()
            # The step's end hands the optimizer its scratch state again (_end_step): state that
            # optimizer.load_state_dict() put there without the tables is refused first, as a
            # step with rows refuses it.
            self._state.check_not_replaced()
            self._state.keep_scalar_state()  # the optimizer counts a step without rows too (Adam's step)
            self._scratch_writes.begin_own(self.weight)  # the optimizer steps the scratch: its own write
            self._empty_step = True
            self._sparse_gradient_for_empty_step()
            return
        stale = self._stale and self._stale()
        if stale is not None and self.weight.grad is stale:
            raise StateError("the gradient of an OffloadedEmbedding's weight still holds the one the "
                             "previous optimizer.step() left (no zero_grad() after it); its slots now "
                             "hold other rows, so the step would train them on it. Call "
                             "emb.discard_step() and optimizer.zero_grad(), run the step's forwards "
                             "and backwards again, and zero_grad() after each step")
        self._refuse_use_outside_lookups()
        self._adopt_replaced_data()
        self._state.check_not_replaced()  # optimizer.load_state_dict() between the forward and the step
        self._state.gather(rows, read=self._cache.read_state,  # raises before anything changes
                           resetting=lambda: resetting_state(self._cache))
        zeroed = self._zeroed_since_backward()  # of the gradient as the backward left it, not narrowed
        self._state.keep_scalar_state()  # a step undone (_abort_step) counts once when retried
        self._narrowed = NarrowedStep(self.weight, k, self._state.needs_sparse_grad)
        # Rows that only forwards no backward reached (a skipped loss) go back unchanged.
        unreached = self._reached.unreached_slots(k, self.weight.device)
        state, spec = self._state.step_state(), self._state.spec
        self._kept = [] if unreached is None else [KeptRows(unreached, self._full, state, spec)]
        if zeroed is not None:
            # Decided on the device: every row goes back unless the gradient holds a value.
            self._kept.append(KeptRows(slice(0, k), self._full, state, spec, unless=~zeroed))
        if self.padding_idx is not None:
            # The padding row sits in slot 0 of every step, looked up or not. A step whose
            # forwards did not look it up leaves it alone, as in-memory lazy training does:
            # weight decay would otherwise shrink a pretrained (non-zero) padding row every step.
            # Slot 0 as a slice: its copy and put-back are views, with no index tensor made each step.
            self._kept.append(KeptRows(slice(0, 1), self._full, state, spec,
                                       unless=self._reached.looked_up(0, self.weight.device)))

    def _refuse_use_outside_lookups(self):
        """Refuse a step whose gradient a backward added to through ``weight`` itself, not the lookups.

        A term of the loss over :attr:`weight` (a layer tied to it, an L2
        penalty summed over ``model.parameters()``) reads the working-set
        scratch, not the table: its slots past the step's rows hold rows of
        earlier steps (a tied layer's logits are the scratch's slots), and
        the step's rows get the gradient of a loss in-memory training never
        computes. Told by :func:`_note_outside_use`, on the host: no value
        is read (a forward after such a backward is refused too, by
        :meth:`_refuse_gradient_outside_lookups`).

        Raises:
            StateError: nothing changes (no parameter of the optimizer is stepped).
        """
        if self._outside:
            raise StateError(
                "optimizer.step() after a backward that reached this OffloadedEmbedding's weight outside its "
                "lookups (a layer tied to emb.weight, logits = h @ emb.weight.t(); a penalty summed over "
                "model.parameters()): emb.weight is the step's working set, not the table, so that term "
                "read rows of earlier steps in its slots and the step would train on it. Nothing was "
                "changed. Leave emb.weight out of the loss: penalise the rows a step looks up "
                "(emb(ids).pow(2).sum()) or use the optimizer's weight_decay; a layer tied to the table is "
                "not supported (give the output layer its own weight). Then call emb.discard_step() and "
                "optimizer.zero_grad(), and run the step again")

    def _refuse_eval_only_step(self):
        """Refuse a step whose only forwards since the last one ran in eval mode with gradients on.

        ``nn.Embedding`` trains in eval mode (a model fine-tuned in ``eval()``
        to keep its BatchNorm statistics); an offloaded eval forward reads the
        table without a gradient, so such a step would silently leave every
        row as it was. An eval forward beside training ones (evaluating
        between steps without ``torch.no_grad()``) is let through.

        Raises:
            StateError: nothing changes (no parameter of the optimizer is stepped).
        """
        if self._eval_with_grad:
            self._eval_with_grad = False
            raise StateError(
                "optimizer.step() after forwards of an OffloadedEmbedding in eval mode and none in "
                "training mode: in eval mode it reads rows without a gradient (nn.Embedding would "
                "train them), so the step would leave the table as it was. Nothing was changed: "
                "call emb.train() (model.train(); to keep BatchNorm's statistics, put those modules "
                "alone in eval()) and run the step's forwards again, or freeze the table with "
                "emb.requires_grad_(False)")

    def _refuse_gradient_without_rows(self):
        """Refuse a step that holds no rows of this embedding while :attr:`weight` has a non-zero gradient.

        With no training forward since the last step (``optimizer.step()``
        twice on one backward, or without ``zero_grad()`` between steps) the
        gradient is the one the last step left, whose rows were written back:
        in memory the step would apply it to them again, and offloaded its
        slots name no row. A zero gradient (``zero_grad(set_to_none=False)``
        before a step that trains other layers only) moves no row, lazily, and
        is let through. Only steps without rows read the gradient here.

        Raises:
            StateError: the gradient holds a non-zero value; nothing changes.
        """
        grad = self.weight.grad
        if grad is None:
            return
        values = grad.coalesce().values() if grad.is_sparse else grad
        if bool(holds_nonzero(values)):
            raise StateError(
                "optimizer.step() found a non-zero gradient on an OffloadedEmbedding's weight but no "
                "training forward since the last step (step() twice, or no zero_grad() after a step): "
                "the rows that gradient was computed for were written back at the last step, and its "
                "slots name none now, so the step cannot apply it to them. Nothing was changed: call "
                "optimizer.zero_grad() after each step, and run a step's forwards and backward before "
                "its optimizer.step()")

    def _sparse_gradient_for_empty_step(self):
        """SparseAdam takes a step without rows at an empty sparse gradient (see :class:`EmptySparseGradient`).

        :meth:`_refuse_gradient_without_rows` checked that a dense gradient is zero.
        """
        grad = self.weight.grad
        if self._state.needs_sparse_grad and grad is not None and not grad.is_sparse:
            self._empty_sparse = EmptySparseGradient(self.weight)

    def _put_back_dense_zero_grad(self):
        if self._empty_sparse is not None:
            self._empty_sparse.restore()
            self._empty_sparse = None

    @one_thread
    def _end_step(self):
        self._eval_with_grad = False
        self._put_back_dense_zero_grad()
        if self._narrowed is None:
            if self._empty_step is not None:
                self._end_empty_step()  # Adam counted it, as in memory
            return
        rows = self._working_set.rows
        k = rows.shape[0]
        try:
            # An optimizer may assign new tensors (p.data = p.data - lr * p.grad): their
            # values are the step's, or the step is refused before anything is written back.
            self._state.check_step(k)
            self._narrowed.finish()
            # Rows no backward reached go back as they were. Putting them back may fail (out of
            # memory); before anything is written, as the refusals above, the step is undone then.
            for kept in self._kept or ():
                kept.put_back(self._full, self._state.step_state())
            weights = self._full[:k]
            # Rows and state go to the cache, or back to the host: each row written once. All or
            # nothing (out of memory): a failure leaves them where they were, to be read back below.
            self._state.scatter(rows, write=lambda states: self._cache.store(rows, weights, states))
        except BaseException:
            self._abort_step()  # the rows and state are read back as they were: retry or discard
            raise
        self._narrowed = None
        self._one_thread.hold(False)  # the step's claim (see _begin_step); this call's holds until it returns
        self._kept = None
        self._reached.clear()
        self._working_set.clear()
        self._backward_ran = False
        self._forget_lookups()
        self._scratch_writes.note_own(self.weight)  # the optimizer wrote it in place
        grad = self.weight.grad
        self._leftover = None if grad is None else (weakref.ref(grad), grad._version)

    def _end_empty_step(self):
        """End a step without rows, done or raised: the optimizer applied its zero gradient to the scratch alone.

        Its in-place write reached no row and is no write into :attr:`weight`
        between steps to refuse at the next forward, unless one was pending
        when the step began. At the first step torch created the per-row state
        for the scratch: it becomes this state's scratch, as after any step
        (the next forward would take it for a ``load_state_dict()`` that
        replaced the tables' state).
        """
        self._scratch_writes.end_own(self.weight)
        self._empty_step = None
        self._forget_lookups()
        self._one_thread.hold(False)  # the step's claim (see _begin_step); this call's holds until it returns
        self._state.release()

    @one_thread
    def _abort_step(self):
        self._put_back_dense_zero_grad()
        if self._empty_step is not None:
            self._end_empty_step()
            self._state.undo_scalar_state()  # the optimizer may have counted the step before it raised
            return
        if self._narrowed is None:
            return
        # The optimizer raised inside a step: the table and state tables still
        # hold every row as before it, so the working set is read back from them.
        self._narrowed.restore()
        self._narrowed = None
        self._one_thread.hold(False)  # the step's claim (see _begin_step); this call's holds until it returns
        self._kept = None  # the rows are read back below, as they were
        self._state.release()
        self._state.undo_scalar_state()  # the optimizer may have counted the step before it raised
        # Nothing was stored: the cache too holds the rows as before, and the step goes on.
        self._cache.restart_step()
        self._gather_new(0, again=True)
        # The optimizer's writes, undone by the gather: no write of the user's for a forward to refuse, nor, once
        # zero_grad() gave the step up, a move in place (SAM's) to keep the step for (see _drop_zeroed_step).
        self._version_at_lookup = self._version_at_backward = self.weight._version

    # ---------------------------------------------------------------- cache
    @one_thread
    def prefetch(self, ids: Ids) -> int:
        """Start bringing the rows of the next step's ``ids`` (and their state) into the cache.

        Call it while the current step computes. Rows of the current working
        set are skipped (their updated values reach the cache at the step's
        end); rows brought or already cached cannot be evicted before the end
        of the next step. Without a cache (``cache_rows=0``) it does nothing.
        On a GPU the copies run on a side stream and may still be running on
        return; on the CPU they are done.

        Args:
            ids: the next step's ids, of any shape (as for :meth:`forward`).

        Returns:
            the number of rows brought from the host.

        Raises:
            IdError, DTypeError, DeviceError: bad ids (nothing changes).
            StateError: called before :meth:`attach`, on a closed embedding, or
                on another thread than the training one (nothing changes).
        """
        self._check_open()
        if self._cache is None:
            raise StateError("call emb.attach(optimizer) before prefetch: the cache holds "
                             "optimizer state rows too")
        # The ids' range is checked by the cache, in a read it makes anyway.
        flat, _, check_bounds = as_row_ids_deferred(ids, self.num_embeddings, self.weight.device)
        with torch.no_grad():
            return self._cache.prefetch(flat, self._working_set.holds, check_bounds)

    @one_thread
    def flush(self) -> None:
        """Write the cached rows and their optimizer state back to the host tables.

        After it the host's table and state tables hold every row's current
        value, and the rows stay cached (unlike :attr:`table`, which also
        empties the cache so that writes through it are seen). On a GPU it
        follows the current stream: after training on another, make this one
        wait for it first (``torch.cuda.current_stream().wait_stream(s)``).
        """
        if self._cache is not None:
            self._cache.flush()

    def stats(self) -> dict:
        """Transport counters: ``{"last_step": {...}, "total": {...}, "eval": {...}, "cache_rows", "cache_bytes"}``.

        Training counters (see :data:`speedswap.train.cache.COUNTERS`): steps, lookups
        (ids in training forwards), unique_rows (the distinct rows they looked
        up; the padding row, which every step carries, is not counted), hits,
        misses, rows and bytes host-to-device and device-to-host (rows count
        table rows, bytes add their optimizer state's, and state that crosses
        alone, as :meth:`init_state` reads the cached rows' again, counts in
        bytes only; flushes count in ``total``), evictions and prefetched rows.
        The first step with rows after :meth:`attach` (or :meth:`init_state`) reads no
        optimizer state, which every row then holds at its initial value:
        torch makes it on the device, so that step's bytes device-to-host
        exceed its bytes host-to-device.
        ``total`` includes the step in progress (a prefetch counts at once),
        ``last_step`` is the last step that ended. A step that raised inside
        the optimizer and is retried counts its rows once and its copies twice.

        ``eval`` counts the forwards outside training (eval mode, ``no_grad``,
        ``inference_mode``, a frozen :attr:`weight`) since :meth:`attach`, apart
        from the steps so that ``total``'s hit rate stays a training step's
        (see :data:`speedswap.train.cache.EVAL_COUNTERS`): forwards, lookups
        (their ids), hits (ids whose row was cached, served from the cache),
        rows_h2d and bytes_h2d (what the host sent: each uncached row once,
        however often its id repeats; one row per id while nothing is cached).
        Such a forward of ids already on the device waits on the host once:
        their range check, which reads with it how many rows to read while
        some rows are cached (ids from the host are checked there, without a
        wait, and the count is then its only one; none while nothing or every
        row of the table is cached).

        Every counter starts at :meth:`attach`; before it they are all zero,
        and eval forwards then read the table without being counted.
        """
        if self._cache is None:
            return self._closed_stats or idle_stats(self.cache_rows)
        return self._cache.stats()

    # ---------------------------------------------------------- checkpoints
    def _tables(self):
        tables = {"table": self._table}
        if self._state is not None:
            tables.update({f"optimizer.{name}": t for name, t in self._state.tables.items()})
        return tables

    def _attrs(self):
        optimizer = "" if self._state is None else type(self._state.optimizer).__name__
        return {"optimizer": optimizer}

    @one_thread
    def save(self, path: PathLike) -> None:
        """Write the table and all offloaded optimizer state to one checkpoint, atomically.

        The device cache writes its rows back only as the save reads them,
        once the path passed every check: a refused save leaves it as it was.

        Args:
            path: ``*.h5`` / ``*.hdf5`` for one HDF5 file; a path with no suffix
                for a directory of ``.npy`` files (see
                :mod:`speedswap.train.checkpoint`); ``*.npy`` for the table alone
                as a plain numpy file (an export, without optimizer state).

        Raises:
            OptionError: another suffix (``emb.pt``): pick one of the above.
            PathError: the directory does not exist, ``path`` is something else
                than a speedswap checkpoint, or the file system refused the
                write; whatever was at ``path`` is intact.
            FileFormatError: a checkpoint directory whose ``CURRENT`` was
                changed by hand (it is not saved over).
            StateError: a closed embedding.
        """
        self._check_open()
        table_alone = files.suffix_format(path) == "npy"
        if not table_alone:
            checkpoint_kind(path)  # a refused suffix before the step is put back
        self._abort_step()
        # The tables' watch_reads hook (_prepare_table_read) has the cache write its rows and
        # their state back as the save first reads them, after every check of the path: a
        # refused save leaves the cache as it was.
        if table_alone:
            self._table.save(path)
            return
        save_tables(path, self._tables(), self._attrs(), row_state=self._state)

    @one_thread
    def load(self, path: PathLike) -> None:
        """Restore a checkpoint written by :meth:`save` (attach the same optimizer class first).

        The table, the optimizer's per-row state and its scalar state for
        :attr:`weight` (Adam's step count) are restored together, so training
        goes on as it would have from the save, whatever the optimizer did
        since (a fresh one, or one further on). Its ``load_state_dict`` of
        the state_dict saved with the checkpoint may come before or after
        (for its other parameters, and its options): it holds the same step.
        A checkpoint of an older speedswap holds no step count: the
        optimizer's own is kept only if it has none (SGD) or its
        ``load_state_dict`` put it there since the last step; otherwise it
        is dropped, and the next step asks for that ``load_state_dict``.

        A ``*.npy`` path replaces the table's rows only (pretrained vectors, say)
        and leaves the optimizer state as it is.

        Args:
            path: a checkpoint :meth:`save` wrote, or a ``.npy`` file of rows.

        Raises:
            FileFormatError: another shape, optimizer or a corrupt file: every
                row is read and verified before any changes, so nothing changes.
            MissingFileError: no checkpoint at ``path``.
            StateError: called between a training forward and the optimizer
                step, or on a closed embedding.
        """
        self._check_restorable("load")
        # The cache writes its rows and their state back and drops them (they predate the
        # file's) once the file is verified, before any row changes: a refused load leaves it
        # as it was. For a .npy file the table's own watch_writes hook does it.
        if files.suffix_format(path) == "npy":
            self._table.load_from(path)  # the table alone; optimizer state is left as it is
        else:
            load_tables(path, self._tables(), self._attrs(), before_writes=self._prepare_table_write,
                        row_state=self._state)

    def _check_restorable(self, what):
        """Refuse a restore of the tables that the step in flight would undo (one inside ``step()`` is dropped).

        Raises:
            StateError: a closed embedding, or between a training forward and the step.
        """
        self._check_open()
        if self._step_in_flight():
            raise StateError(f"{what} between a training forward and optimizer.step() would be "
                             f"undone by the step; {what} between steps (or emb.discard_step() first)")

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True,
                        assign: bool = False) -> tuple:
        """``nn.Module.load_state_dict``, refusing a ``state_dict`` that is not a mapping.

        The table and the attached optimizer's per-row state are restored from
        the state dict's ``_extra_state`` (see :meth:`set_extra_state`).

        Args:
            state_dict, strict: as ``nn.Module.load_state_dict``'s.
            assign: as ``nn.Module.load_state_dict``'s for the other modules of a
                model; for this one it changes nothing: the tables are copied
                into (they live on the host, in their own memory), and
                :attr:`weight`, the working-set scratch, is kept and not
                loaded, as without it.

        Returns:
            ``nn.Module.load_state_dict``'s named tuple of missing and unexpected keys.

        Raises:
            DTypeError: ``state_dict`` is not a mapping, or holds rows of another
                dtype (nothing changes).
            ShapeError, FileFormatError, StateError: see :meth:`set_extra_state`.
        """
        if not isinstance(state_dict, Mapping):
            raise DTypeError(f"load_state_dict takes a mapping (what state_dict() returns), got "
                             f"{type(state_dict).__name__}; the table itself is restored "
                             f"with emb.load(path)")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @one_thread
    def get_extra_state(self) -> dict:
        """The table and the attached optimizer's per-row and scalar state, for ``state_dict()``.

        The device cache is written back first, so the values are current.
        Between a training forward and ``optimizer.step()`` they are the
        rows and state before the step, as an in-memory ``state_dict()``'s
        parameters are then. The tensors share the host tables' memory (no
        copy; a ``device`` table's are on its GPU), as ``state_dict()`` shares
        a parameter's storage: kept, they follow training, and the device
        cache keeps no rows while they live (see :attr:`table`); ``torch.save``
        them, or clone them, to keep the values of now. A bfloat16 table is a
        bfloat16 tensor.

        Returns:
            ``{"format", "version", "kind", "num_embeddings", "embedding_dim",
            "dtype", "optimizer", "optimizer_scalar_state", "tables": {"table": ...,
            "optimizer.<state>": ...}}`` (see :mod:`speedswap.train.module_state`);
            ``"optimizer_scalar_state"`` (the step count: see :meth:`load`)
            only with an optimizer attached.

        Raises:
            StateError: a closed embedding.
        """
        self._check_open()
        self._abort_step()  # a step the optimizer raised inside counted itself in the scalar state: undone first
        self.flush()
        return tables_state(type(self).__name__, self._tables(), self._attrs()["optimizer"],
                            self.num_embeddings,
                            scalar_state=None if self._state is None else self._state.scalar_state())

    @one_thread
    def set_extra_state(self, state: dict) -> None:
        """Restore what :meth:`get_extra_state` returned: the table and the optimizer's per-row and scalar state.

        Everything is checked before any row changes; a copy stopped midway
        (Ctrl-C) leaves the tables refusing use until a load completes, as a
        stopped :meth:`load` does. As after :meth:`load`, the device cache is
        emptied, the optimizer's step count is the saved one (a state of an
        older speedswap, which holds none, is treated as :meth:`load` treats
        such a checkpoint), and ``optimizer.load_state_dict`` of the
        state_dict saved with it is accepted before or after. Attach the
        optimizer first: :meth:`attach` starts its per-row state afresh.

        Args:
            state: what :meth:`get_extra_state` returned (a ``state_dict()``'s ``_extra_state``).

        Raises:
            ShapeError, DTypeError: another table size or dtype: build the
                embedding as the one that saved.
            FileFormatError: not such a state, a newer format, a damaged
                scalar state, or the
                optimizer differs (state saved before attach, into an attached
                embedding, or the reverse, as :meth:`load` refuses them; for the
                rows alone see :func:`speedswap.train.module_state.rows_only`).
            StateError: between a training forward and the step, or on a closed embedding.
        """
        self._restore_extra_state(state)

    def _restore_extra_state(self, state):
        values, scalars = self._check_extra_state(state)
        with rewriting(self._cache):  # cached rows predate the state's
            copy_tables(values, self._tables())
            if self._state is not None:
                self._state.restore_scalar_state(scalars)

    def _check_extra_state(self, state) -> tuple:
        """Check a state of :meth:`get_extra_state` against this embedding (also for :func:`check_state_dict`).

        Returns:
            ``({table name: tensor} to copy into the tables, the optimizer's
            scalar state for RowState.restore_scalar_state)``.

        Raises:
            as :meth:`set_extra_state`; nothing changes.
        """
        self._check_restorable("load_state_dict")
        values = check_tables_state(state, type(self).__name__, self._tables(), self._attrs()["optimizer"],
                                    self.num_embeddings)
        return values, checked_scalar_state(state, self._state)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """torch's, with the extra state checked first, :attr:`weight` not loaded, a warning when the state is missing.

        Checked first, a refused state leaves the working set too as it was
        (mid-step it holds the step's rows). The saved :attr:`weight` is the
        working-set scratch of a module between steps, whose slots name no
        row: it is not loaded, so a state saved with another ``max_rows``
        loads too (torch would refuse its shape after the tables had been
        replaced). A state dict with :attr:`weight` but without the extra
        state (saved by an older speedswap) is reported missing by a strict
        load; either way a warning says how to restore the table (torch gives
        this method no way to tell a strict load from another).

        Over a model with several embeddings the load is all or nothing for
        each, not for all: torch loads module by module, and an embedding
        sees only its own entries. A refusal says which embeddings the same
        ``load_state_dict`` call already loaded (see :func:`refused_after`);
        :func:`~speedswap.train.module_state.check_state_dict` checks them all first.
        """
        key, weight = prefix + "_extra_state", prefix + "weight"
        if key in state_dict:
            try:
                self._check_extra_state(state_dict[key])
            except SpeedswapError as exc:
                # Embeddings this load reached first are loaded already: the message says which.
                named = refused_after(exc, error_msgs, prefix)
                if named is None:
                    raise
                raise named from exc
        elif weight in state_dict:  # this module's state dict, from an older speedswap
            warn(missing_hint(key, type(self).__name__, state_dict[weight],
                              (self.num_embeddings, self.embedding_dim)))
        without_weight = {name: value for name, value in state_dict.items() if name != weight}
        super()._load_from_state_dict(without_weight, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if key in state_dict:
            note_loaded(error_msgs, prefix)
        if weight in state_dict and weight in missing_keys:
            missing_keys.remove(weight)  # given, and rightly not loaded

    # ------------------------------------------------------------- lifecycle
    @one_thread
    def close(self, discard: bool = False) -> None:
        """Release the table and optimizer state memory and unhook the optimizer. Idempotent.

        An ``mmap`` embedding's files are flushed and kept, with the rows its
        device cache holds written back first. Afterwards every call but
        :meth:`close` raises :class:`~speedswap.StateError`; the optimizer's
        ``step()`` no longer touches this embedding.

        Args:
            discard: drop the cached rows that changed since they were last
                written back instead of writing them (with their optimizer
                state): for files that can no longer take them (see Raises).
                Their files keep what they hold of those rows.

        Raises:
            FileFormatError: the cached rows could not be written back (a
                file truncated or rewritten with another header since it was
                mapped); nothing was released. Restore the file and call
                ``close()`` again to keep them, or ``close(discard=True)`` to
                drop them. Left open, the embedding writes them back when it
                is collected or at exit if the file is whole by then, and
                drops them silently otherwise: this error said so.
            OptionError: ``discard`` is not a bool.
        """
        # bool("False") is True: the rows meant to be kept would be dropped.
        discard = bool_option(discard, "discard", hint=" (drop the cached rows not yet written back)")
        if self._table.closed:
            return
        self._abort_step()
        if discard and self._cache is not None:
            self._cache.drop_changes()
        try:
            self.flush()  # an mmap embedding's files keep the cached rows too
        except FileFormatError as exc:
            if self._writeback is not None:  # told here: at exit it writes them back quietly, or drops them
                self._writeback.detach()
                self._writeback = weakref.finalize(self, _write_back, self._cache, told=True)
            lost = int(self._cache.dirty.sum())
            raise FileFormatError(
                f"close() could not write back the {lost} rows of this embedding's device cache that changed "
                f"since they were last written back, nor their optimizer state ({exc}). Nothing was released. "
                f"Restore the file (its bytes, into the same file: the table maps it) and call close() again "
                f"to keep them, or call close(discard=True) to drop them") from exc
        if self._cache is not None:
            if self._writeback is not None:
                self._writeback.detach()
            self._closed_stats = {**self._cache.stats(), "cache_bytes": 0}
            self._cache = None  # its device memory goes now, not with the embedding
        self._narrowed = None
        if self._hooks is not None:
            self._hooks.remove()
        if self._claim is not None:
            self._claim.remove()
        if self._state is not None:
            self._state.close()
        self._working_set.clear()
        self._table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _write_back(cache, told: bool = False) -> None:
    """Write back the cached rows of an ``mmap`` embedding dropped without ``close()``, or alive at exit.

    A file that can no longer take them (truncated, or rewritten with another
    header) is said in one warning, not a traceback from a finalizer, unless a
    refused ``close()`` has said so already (``told``).
    """
    try:
        cache.flush()
    except FileFormatError as exc:
        if not told:
            warn(f"an OffloadedEmbedding dropped without close() (or open at exit) could not write back "
                 f"the {int(cache.dirty.sum())} rows of its device cache that changed since they were last "
                 f"written back; they are lost: {exc}")


def _refuse_ddp(weight):
    """Refuse a training forward run by a ``DistributedDataParallel`` that averages ``weight``'s gradient.

    ``weight`` is a working set: its slots hold other rows on every rank, so
    DDP's average would add each rank's gradient to other ranks' rows,
    silently. The DDP running a forward is the one torch itself records for
    ``torch.compile`` (``_get_active_ddp_module``).

    Raises:
        OptionError: ``weight`` is among that DDP's averaged parameters.
    """
    ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None or not weight.requires_grad:  # DDP averages no frozen parameter
        return
    averaged = getattr(ddp, "_module_parameters", None)
    if averaged is None:  # a torch without the list: every parameter of the module, to be safe
        averaged = list(ddp.module.parameters())
    if any(p is weight for p in averaged):
        raise OptionError(
            "an OffloadedEmbedding inside DistributedDataParallel: DDP would average its weight's "
            "gradient across ranks, but each rank's weight holds other rows (the step's working set), "
            "so rows would train on other rows' gradients. To split one table over the ranks, use "
            "ShardedOffloadedEmbedding; to train a table per rank on purpose, exclude it from DDP "
            "before wrapping: torch.nn.parallel.DistributedDataParallel."
            "_set_params_and_buffers_to_ignore_for_model(model, ['<its name>.weight']), on a model "
            "built anew (this DDP's construction copied rank 0's weight into this one, a write into "
            "the working set that this embedding's next training forward refuses)")


def _refused_data(data, full):
    return (f"weight.data was replaced by a {tuple(data.shape)} {data.dtype} tensor on "
            f"{data.device}; an OffloadedEmbedding's weight is its working set, "
            f"{tuple(full.shape)} {full.dtype} on {full.device}: "
            f"assign a tensor like it, or write rows with emb.table")


def _gradient_dropped(ref):
    """For :class:`ReachedRows`: whether ``zero_grad()`` dropped the gradient of the step's earlier backwards."""
    def dropped():
        embedding = ref()
        if embedding is None or not embedding._backward_ran or not embedding._gradient_zeroed():
            return False
        embedding._backward_ran = False  # asked once per backward: its end sets it again
        return True
    return dropped


def _note_leftover_gradient(ref):
    """A pre-hook on ``weight``'s gradient accumulator: note a backward that adds to the gradient the last step left.

    The next step's rows take the same slots, so a gradient no ``zero_grad()``
    cleared after ``optimizer.step()`` is added to other rows' gradients (in
    memory it would count for the rows it was computed for). Adding to it is
    noted, not refused: a ``zero_grad()`` before the step may still drop it
    (a backward with ``retain_graph=True``, ``zero_grad()``, backward again);
    the step is refused if it has not (:meth:`OffloadedEmbedding._begin_step`).
    Whether it is still there: :func:`~speedswap.train.leftover.untouched`.
    """
    def note(_grad_outputs):
        embedding = ref()
        if embedding is None:
            return None
        grad = embedding.weight.grad
        if embedding._leftover is not None:
            (left, version), embedding._leftover = embedding._leftover, None
            if untouched(grad, left(), version):
                embedding._stale = weakref.ref(grad)
        elif embedding._stale is not None and not untouched(grad, embedding._stale(),
                                                             embedding._version_at_backward):
            embedding._stale = None  # zero_grad() since the last backward dropped it
        return None
    return note


class _Lookups(torch.autograd.Function):
    """``weight`` under a node of its own, for the step's lookups (:meth:`OffloadedEmbedding._lookup_alias`).

    The same memory, not a copy. Not a view either: autograd gives a view a
    new node each time its base is written in place, and the lookups of the
    forwards before and after such a write would reach ``weight`` through two
    nodes, whose sum no hook on either node sees. A ``detach()``ed alias keeps
    this node whatever writes ``weight`` gets.
    """

    @staticmethod
    def forward(ctx, weight):
        return weight.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad  # the tensor itself: what _note_lookups notes is what reaches weight


def _note_lookups(ref):
    """A post-hook on the node of the step's lookups (:class:`_Lookups`): note the gradient it hands ``weight``.

    Held until :func:`_note_outside_use` takes it: the engine adds another
    term in place only into a tensor nothing else holds, so with it held a
    sum is another tensor.
    """
    def note(grad_inputs, _grad_outputs):
        embedding = ref()
        if embedding is not None:
            embedding._lookup_grad = grad_inputs[0]
        return None
    return note


def _note_outside_use(ref):
    """A hook on ``weight``: note a gradient that is not the lookups' alone.

    What reaches ``weight`` in a backward is the tensor the lookups'
    node handed it (:func:`_note_lookups`) exactly when nothing else used
    ``weight``: anything else is the sum, or another term. Registered first,
    it sees the gradient before a hook of the user's may replace it. Read by
    :meth:`OffloadedEmbedding._refuse_use_outside_lookups`.
    """
    def note(grad):
        embedding = ref()
        if embedding is not None:
            ours, embedding._lookup_grad = embedding._lookup_grad, None
            if grad is not ours:
                embedding._outside = True
        return None
    return note


def _foreach_zero_keeps_version(device: torch.device) -> bool:
    """Whether ``torch._foreach_zero_`` may leave a tensor's version as it was on ``device``.

    CUDA's fused kernel does; on the CPU it runs ``zero_()`` on each tensor, which bumps it.
    """
    return device.type != "cpu"


def _marks(grad: torch.Tensor, size: int) -> torch.Tensor:
    """The elements of the dense ``grad`` that mark a zero gradient (see :func:`_note_backward`), as a view.

    The first two of the step's first row; of its first column for rows of one
    value (one element where the step has one row).
    """
    return grad[0, :2] if grad.shape[1] > 1 else grad[:min(size, 2), 0]


def _note_backward(ref):
    """A post-accumulate-grad hook for an embedding's ``weight`` that holds the embedding weakly."""
    def note(_weight):
        embedding = ref()
        if embedding is not None:
            embedding._backward_ran = True
            embedding._version_at_backward = embedding.weight._version
            if embedding._rows_at_backward is None:
                embedding._rows_at_backward = embedding._working_set.size
            # A dense gradient's values are noted, on the device (a GPU's host does not wait here):
            # torch._foreach_zero_ zeroes it on CUDA without a version bump. A sparse one is zeroed
            # by zero_(), which bumps it, so its version tells, without a coalesce per backward.
            grad = embedding.weight.grad
            size = embedding._working_set.size
            nonzero = None if grad.is_sparse else holds_nonzero(grad[:size])
            if nonzero is not None and size:
                # A gradient left at zero is marked (-0.0, +0.0: the same values) for _cleared, on the
                # device, in one launch: +0.0 too, so that a negation, which turns -0.0 into +0.0 as
                # zero_() does, leaves a -0.0. Through detach(): a backward with create_graph=True leaves
                # a gradient with a graph, and a recorded write would zero those elements' derivatives.
                marks = _marks(grad.detach(), size)
                torch.where(nonzero, marks, embedding._zero_marks[:len(marks)], out=marks)
            embedding._grad_at_backward = (weakref.ref(grad), nonzero, grad._version)
    return note
