"""ModelFactory: SpeedTorch's switcher of a model's embedding rows.

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

import os
import pickle
import weakref
from typing import Callable, NoReturn, Optional, Tuple, Union

import numpy as np
import torch

from ..atomic import PathLike, as_path, atomic_output, check_regular_file
from ..backends import get_backend
from ..backends.resolve import BackendLike
from ..convert import DTypeLike, Ids, bool_option, host_tensor, initialiser_option, int_option
from ..errors import FileFormatError, OptionError, ShapeError, StateError
from ..files import suffix_format
from ..table import HostTable, loading_into
from ..train.one_thread import one_thread
from .steps import MODEL, ModuleHook
from .switcher import LocalIds, Switcher, device_of, storage_of, weight_of

__all__ = ["ModelFactory"]


# Run eagerly under torch.compile: the check reads the ids on the host, which dynamo would
# trace again at each forward (recompiling each time).
@torch.compiler.disable
def _check_stale(owner, args, kwargs):
    switcher = owner()
    # nn.Embedding and nn.EmbeddingBag name their ids ``input``: emb(input=ids) is checked too.
    ids = args[0] if args else kwargs.get("input")
    if switcher is not None and ids is not None:
        switcher._refuse_wrong_ids(ids)


def _is_torch_file(path):
    return os.path.splitext(as_path(path))[1].lower() in (".pt", ".pth")


def _refuse_unknown_suffix(path, call):
    """Raise before ``saveTorch``/``loadTorch`` of a path whose suffix names no format.

    SpeedTorch's saveTorch handed any name to ``torch.save`` (``saveTorch("u")``
    wrote ``u``); the format here comes from the suffix, and the one these two
    add to :meth:`~ModelFactory.save`'s is ``*.pt``.

    Raises:
        OptionError: neither a torch suffix nor a table file's; nothing is read or written.
    """
    if not _is_torch_file(path) and suffix_format(path) is None:
        raise OptionError(f"{call} cannot tell the format of {os.fspath(path)!r}: name it *.pt / *.pth "
                          f"(torch.save of the whole table; a file SpeedTorch's saveTorch wrote under "
                          f"another name loads once renamed so), or *.npy / *.h5 / *.hdf5 as saveCupy takes")


def _refuse_torch_file(path, instead):
    """Raise before ``save``/``load`` of a ``.pt``/``.pth`` path: saveTorch/loadTorch take those.

    Raises:
        OptionError: ``path`` names a torch file; nothing is read or written.
    """
    if _is_torch_file(path):
        raise OptionError(f"{os.fspath(path)!r} is a torch file: {instead} takes *.pt / *.pth "
                          f"(torch.save of the whole table, as SpeedTorch's saveTorch/loadTorch did); "
                          f"save/load (saveCupy/loadCupy) take *.npy or *.h5 / *.hdf5")


class ModelFactory(Switcher):
    """Keeps a full embedding table on the host and swaps a step's rows into the model.

    Args:
        model_variable: the model's ``nn.Embedding`` or ``nn.EmbeddingBag`` (or
            its weight); another module is refused. Its rows
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
            optimizer state: a write-back cache of the most used rows (see
            :mod:`speedswap.train.cache`), shared with the embedding's
            :class:`OptimizerFactory`, which must be built with the same
            ``cache_rows``. 0 (the default) turns it off. A cached row is
            current only in the cache until it is evicted or flushed: every
            method here sees it, and :attr:`table` writes it back and
            empties it first. :meth:`prefetch` brings the next step's rows in.

    The table starts at zero; call an initialiser (``uniformDistributionInit``,
    ``customInit``, ...) before training.

    Raises:
        OptionError, ShapeError, DTypeError: not an embedding, a bad size, dtype or
            ``cache_rows`` (another than the embedding's OptimizerFactory's); a
            keyword it does not take (``device``, ``max_rows``: DTypeError, a TypeError).
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
    _dtype_argument = "datatype"
    _after_close = ("table", "for the embedding, and load the table saved before close() into it "
                             "(loadCupy / loadTorch) to go on from there")

    def __init__(self, model_variable: Union[torch.nn.Embedding, torch.nn.EmbeddingBag, torch.nn.Parameter],
                 total_classes: int, embed_dimension: int, datatype: DTypeLike = "float32",
                 CPUPinn: bool = False, *, storage: Optional[str] = None, backend: BackendLike = "auto",
                 path: Optional[PathLike] = None, overwrite: bool = False, cache_rows: int = 0, **others):
        self._refuse_other_keywords(others)
        param = weight_of(model_variable)
        module = model_variable if isinstance(model_variable, torch.nn.Module) else None
        super().__init__(param, total_classes, embed_dimension, datatype, cache_rows,
                         find_param=None if module is None else lambda: weight_of(module))
        storage = storage or storage_of(CPUPinn)
        backend = get_backend(backend, device_of(param))
        self._check_device(backend)  # before the table's mmap file is made (or replaced)
        # zero_ leaves a new mmap table's sparse file of zeros as it is (see HostTable.zero_).
        self._table = HostTable.zeros(total_classes, embed_dimension, datatype, storage, backend, path,
                                      device=device_of(param), overwrite=overwrite)
        self._placeholders = None
        # Every forward of the model's embedding is checked for ids other than the step's local ones.
        self._stale_hook = None
        if isinstance(model_variable, torch.nn.Module):
            owner = weakref.ref(self)
            self._stale_hook = model_variable.register_forward_pre_hook(
                ModuleHook(lambda module, args, kwargs: _check_stale(owner, args, kwargs), self._steps),
                with_kwargs=True)
        self._register(self._table)
        if module is not None:  # its loads write the slots: not refused (a bare weight's module is unknown)
            self._steps.watch_loads(module)
        # Reads and writes through any reference to the table see the cache's rows.
        self._table.watch_reads(self._prepare_table_read)
        self._table.watch_writes(self._prepare_table_write)

    # ------------------------------------------------------------------ steps
    def variableTransformer(self, batchSize: int, posPerBatch: int,
                            negPerBatch: Optional[int] = None) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
        """SpeedTorch's placeholders: numpy id arrays that every :meth:`before_forward` fills in place.

        They are numpy ``int64`` arrays, as SpeedTorch returned, holding the
        step's *local* ids (slots of the de-duplicated working set) after each
        :meth:`before_forward`. Convert them every step (``torch.from_numpy(x)``
        shares their memory, so one ``from_numpy`` view kept across steps stays
        current; ``torch.tensor(x)`` copies). A copy made once before the loop
        would feed stale ids: every forward of the embedding is checked for
        that, and raises :class:`~speedswap.StateError`. Simpler: feed the ids :meth:`before_forward` returns.

        Args:
            batchSize: rows of the batch.
            posPerBatch: positive ids per row.
            negPerBatch: negative ids per row, when a second input is used.

        Returns:
            an ``int64`` array ``(batchSize, posPerBatch)``, or a tuple with a
            second ``(batchSize, negPerBatch)`` one.

        Raises:
            OptionError: a size that is not a positive int; the placeholders
                are kept as they were.
        """
        batchSize = int_option(batchSize, "batchSize", hint=" (rows of the batch)")
        posPerBatch = int_option(posPerBatch, "posPerBatch", hint=" (positive ids per row)")
        if negPerBatch is not None:
            negPerBatch = int_option(negPerBatch, "negPerBatch",
                                     hint=" (negative ids per row; None for no second input)")
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

    def _refuse_wrong_ids(self, ids):
        """Refuse a forward fed other ids than the step's local ones: table ids, or an old placeholder copy.

        Raises:
            StateError: a training forward outside a step, once a step ran or
                the OptimizerFactory was built (it would train slots that hold
                the last step's rows, or none, and nothing would write the
                update to the table); a forward outside a step fed ids past
                the capacity (table ids); an id names a slot
                past the step's distinct rows (the table ids given to
                before_forward, fed as they are); or the ids equal an earlier
                content of the placeholders and not their content now (either
                would train the wrong rows).
        """
        step = self._gathered
        if step is None and self._is_member():
            self._refuse_forward_outside_step(ids)
        if step is None or not isinstance(ids, torch.Tensor) or not ids.numel():
            return
        fed = ids.detach().cpu().numpy()
        if fed.max() >= len(step.rows):
            # Slots past the step's rows hold none of them (or are past the capacity: torch's
            # bare IndexError): the model was fed the table ids instead of the local ones.
            raise StateError(f"the model's embedding was fed id {fed.max()}, but this step's "
                             f"{len(step.rows)} distinct rows sit in slots 0 to {len(step.rows) - 1}: "
                             f"feed the model the local ids before_forward returns (or the "
                             f"variableTransformer placeholders it fills), not the table ids")
        if self._placeholders is None:
            return
        # Compared flat: a copy reshaped (squeeze(1)) is as stale. The step's own ids first: most
        # forwards need that one comparison only.
        fed = fed.ravel()
        if any(p.size == fed.size and np.array_equal(fed, p.ravel()) for p in self._placeholders):
            return
        if any(old.size == fed.size and np.array_equal(fed, old.ravel()) for old in self._stale):
            raise StateError("the model was fed ids equal to an earlier content of the "
                             "variableTransformer placeholders, not their content now: a copy "
                             "made once (torch.tensor(x)) would train the wrong rows. Convert "
                             "the placeholders every step (torch.from_numpy(x) shares their "
                             "memory), or feed the ids before_forward returns")

    def _refuse_forward_outside_step(self, ids):
        """Refuse a forward of the model's embedding that no before_forward began (see :meth:`_refuse_wrong_ids`)."""
        # A training forward before the first step is allowed while no OptimizerFactory exists:
        # SpeedTorch's Rprop recipe ran one, and its backward, before building it. An
        # optimizer.step() on its gradient is refused (SharedSteps.refuse_stepping_between_steps).
        begun = self._steps.current is not None or not self._steps.alone(MODEL)
        if begun and torch.is_grad_enabled() and self._param.requires_grad:
            held = "the last step's rows" if self._steps.current is not None else "no rows of the table yet"
            raise StateError(f"a training forward of the model's embedding outside a step: its "
                             f"slots hold {held}, and nothing would write this update to the "
                             f"table (the next beforeForwardPass would drop it). Begin each step "
                             f"with beforeForwardPass(ids) (on every switcher) and feed the local "
                             f"ids it returns")
        capacity = self._param.shape[0]
        if isinstance(ids, torch.Tensor) and ids.numel() and int(ids.max()) >= capacity:
            # torch would raise its bare 'index out of range in self': these are table ids.
            raise StateError(f"the model's embedding was fed id {int(ids.max())} outside a step, but "
                             f"it holds only the {capacity} slots of a step's rows: begin each step "
                             f"with beforeForwardPass(ids) and feed the local ids it returns; to read "
                             f"rows of the table outside training, use switcher.table.gather(ids)")

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

    def before_forward(self, pos: Ids, neg: Optional[Ids] = None) -> LocalIds:
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
                (on this switcher, or on the embedding's OptimizerFactory); once, the
                model's embedding was written in place since the last step, or given
                other values through ``weight.data = tensor``, which reached no row of
                the table (an initialiser over ``model.parameters()``,
                ``torch.nn.utils.vector_to_parameters``).
            OptionError: ``torch.distributed`` runs several ranks (the
                switcher was built before ``init_process_group``).

        Nothing changes when this raises.
        """
        if self._gathered is not None:
            raise StateError("beforeForwardPass (before_forward) called twice without afterOptimizerStep "
                             "(after_step); finish the step with afterOptimizerStep(ids) so its rows are "
                             "written back")
        self._check_step_start()
        rows = self._param_rows()
        step = self._steps.prepare(pos, neg, MODEL)
        self._check_placeholders(step)
        self._steps.begin(step, MODEL, rows)
        for placeholder, local in zip(self._placeholders or (), step.locals):
            np.copyto(placeholder, local.cpu().numpy().reshape(placeholder.shape))
        return self._result(step)

    def after_step(self, pos: Ids, neg: Optional[Ids] = None) -> None:
        """Write the step's updated rows back to the table, each distinct row once.

        With a cache, rows go to the cache (hits, and misses that find a
        slot), with their optimizer state, and the rest back to the table.

        Args:
            pos, neg: the same ids given to :meth:`before_forward`.

        Raises:
            as :meth:`Switcher.after_step <speedswap.compat.switcher.Switcher.after_step>`; nothing is written.
        """
        super().after_step(pos, neg)
        if self._placeholders is not None:
            # What a copy made before the loop, or now, would hold.
            self._stale = self._initial + [p.copy() for p in self._placeholders]

    def prefetch(self, pos: Ids, neg: Optional[Ids] = None) -> int:
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
            StateError: a closed or replaced switcher, or a call on another
                thread than the training one (nothing changes).
        """
        return self._steps.prefetch(pos, neg)

    # ------------------------------------------------------------ whole table
    def zerosInit(self) -> None:
        """Set every row to zero.

        Raises:
            StateError: called in the middle of a step (nothing changes).
        """
        with self._rewriting("zerosInit"):
            self._table.zero_()

    def uniformDistributionInit(self, low: float, high: float) -> None:
        """Fill the table from U(low, high) (torch's global generator).

        Args:
            low, high: the bounds, finite real numbers with ``low <= high``.

        Raises:
            DTypeError: a bound is not a real number (nothing changes).
            OptionError: a bound is NaN or infinite, or ``low > high`` (nothing changes).
            StateError: called in the middle of a step (nothing changes).
        """
        with self._rewriting("uniformDistributionInit"):
            self._table.uniform_(low, high)

    def normalDistributionInit(self, mean: float, stdDev: float) -> None:
        """Fill the table from N(mean, stdDev²) (torch's global generator).

        Args:
            mean: the mean, a finite real number.
            stdDev: the standard deviation, a finite real number ``>= 0``.

        Raises:
            DTypeError: ``mean`` or ``stdDev`` is not a real number (nothing changes).
            OptionError: NaN or infinite, or ``stdDev < 0`` (nothing changes).
            StateError: called in the middle of a step (nothing changes).
        """
        with self._rewriting("normalDistributionInit"):
            self._table.normal_(mean, stdDev)

    def customInit(self, initFunction: Callable[..., object], *args) -> None:
        """Run an in-place initialiser such as ``torch.nn.init.xavier_uniform_`` on the whole table.

        Args:
            initFunction: ``fn(tensor, *args)`` that fills the table's tensor in place.
            *args: passed to ``initFunction`` after the tensor (``normal_``'s mean and std).

        Raises:
            OptionError: ``initFunction`` is not callable (before the cache is flushed),
                or returned a new tensor instead of filling the given one.
            StateError: called in the middle of a step.
            Exception: whatever ``initFunction`` raised; it writes the table in
                place (a copy to undo it would double the memory), so the rows
                it wrote before raising stay written, as :meth:`HostTable.apply_` says.
        """
        initialiser_option(initFunction, "initFunction")
        with self._rewriting("customInit"):
            self._table.apply_(initFunction, *args)

    def save(self, path: PathLike) -> None:
        """Write the table (cached rows included) to ``path`` (``.npy`` or ``.h5``) atomically.

        Alias ``saveCupy``.

        Args:
            path: the target, ``.npy`` or ``.h5``.

        Raises:
            OptionError: a ``.pt``/``.pth`` path (:meth:`saveTorch` writes those; nothing is written).
            StateError: called from ``optimizer.step()`` until :meth:`after_step`, where the table
                holds the step's rows as before the step (nothing is written); before
                ``optimizer.step()`` it holds what memory does.
        """
        _refuse_torch_file(path, "saveTorch")
        self._check_saving()
        # The table's save checks the path, then has the cache write its rows back
        # (watch_reads): a refused save leaves the cache as it was.
        self._table.save(path)

    def load(self, path: PathLike) -> None:
        """Replace the table's rows with a file's of the same shape and dtype. Alias ``loadCupy``.

        Cached rows are dropped (their optimizer state is written back first)
        once the file is verified; a refused load leaves them cached.

        Args:
            path: a ``.npy`` or ``.h5`` file of the table's shape and dtype.

        Raises:
            FileFormatError: another shape or dtype, or a bad file (nothing changes, the cache included).
            OptionError: a ``.pt``/``.pth`` path (:meth:`loadTorch` reads those; nothing changes).
            StateError: called in the middle of a step.
        """
        _refuse_torch_file(path, "loadTorch")
        self._check_idle("load")
        # The table's watch_writes hook (_prepare_table_write) has the cache write its rows back
        # and drop them once the file is verified: a refused load leaves the cache as it was.
        self._table.load_from(path)

    @one_thread
    def close(self) -> None:
        """Release the table's memory (an ``mmap`` table gets the cached rows first). Idempotent.

        The embedding's OptimizerFactory keeps working, without a cache.
        Closing in the middle of a step abandons the step: its rows are not
        written back. Once the embedding's last switcher is closed, no hook of
        theirs stays on its parameter, which trains as any other. Every other
        method then raises :class:`~speedswap.StateError`, saying so.
        """
        self._closed = True
        if self._stale_hook is not None:
            self._stale_hook.remove()
            self._stale_hook = None
        self._leave()
        self._table.close()

    @property
    def table(self) -> HostTable:
        """The whole table: a :class:`~speedswap.HostTable` holding every row's current value.

        With a device cache, the cache first writes its rows (and their
        optimizer state) back and forgets them (in a step, all but the
        step's), so reads see every row as trained, as without a cache.
        Reads and writes through the table's methods (``gather``,
        ``to_numpy``, ``save``; ``scatter``, ``apply_``, the initialisers,
        ``load_from``), through any reference to it, a kept one too, see the
        cache's rows and reach the next step (see :meth:`_prepare_table_write`).
        Writes are refused between before_forward and after_step, which
        would write the step's rows back over them, and once a newer
        ModelFactory replaced this one (reads then still see the rows as
        trained until the replacement); reads from
        ``optimizer.step()`` until after_step (:meth:`_prepare_table_read`),
        where the table holds the step's rows as before the step; before
        ``optimizer.step()`` they read what memory holds. A view
        ``to_numpy()`` or ``as_tensor()`` hands out stays current while it
        lives, the cache keeping no rows meanwhile
        (:meth:`RowCache.viewed <speedswap.train.cache.RowCache.viewed>`),
        except from ``optimizer.step()`` until :meth:`after_step`, which makes
        it current again: it shows the step's rows as before the step (read
        :meth:`getNumpyVersion` there).

        Raises:
            StateError: from ``optimizer.step()`` (or an in-place write into the
                step's rows: a ``max_norm`` forward, an update written by hand)
                until after_step (see :meth:`SharedSteps.tables_behind`).
        """
        self._steps.hand_out("ModelFactory.table")
        return self._table

    @one_thread
    def _prepare_table_write(self):
        """Make a write into the table, through any reference to it, take effect as in memory.

        Called by the table before each write of its methods
        (:meth:`HostTable.watch_writes`): the device cache writes its rows
        back and forgets them, as it would otherwise write them back over
        the write when they are evicted.

        Raises:
            StateError: between before_forward and after_step, which writes
                the step's rows back over the write, or once a newer
                ModelFactory replaced this one; nothing changes.
        """
        self._refuse_write_when_replaced("table")
        self._check_idle("a write into the table")
        self._steps.hand_out("a write into the table")

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """The table as a numpy array (the table's own memory for host storage, unless ``copy``; for
        device storage, ``CPUPinn=False``, a read-only copy on every backend: see :meth:`HostTable.to_numpy`).

        Cached rows are written back first. Handing out the table's memory
        (``copy=False``) also drops them from the cache, so writes to it before
        the next step are seen by that step (write between steps: after_step
        writes a step's rows back over a write made since its before_forward).
        A copy (``copy=True``, or the read-only one of a device table)
        leaves them cached, and the next step hits them as without it.
        A copy made in the middle of a step holds the step's rows as they are
        in the model's embedding: after ``optimizer.step()``, the stepped rows,
        as an in-memory table holds them; the table's memory (``copy=False``)
        holds them once ``after_step`` wrote them back. So a view kept from
        between steps shows the step's rows as before the step from
        ``optimizer.step()`` until :meth:`after_step`, which makes it current
        again (a view of an in-memory weight shows them stepped); reads
        through a numpy view cannot be refused.

        Args:
            copy: a copy of the rows rather than the table's own memory.

        Returns:
            numpy.ndarray of shape ``(total_classes, embed_dimension)``.

        Raises:
            StateError: ``copy=False`` of a table in host memory from ``optimizer.step()``
                until :meth:`after_step` (as :attr:`table`); before ``optimizer.step()`` the
                view shows what memory does.
            OptionError: ``copy`` is not a bool (``bool("False")`` is True: writes
                meant for the table would go to a copy).
        """
        copy = bool_option(copy, "copy", hint=" (an independent copy; False: the table's own memory)")
        if not copy and self._table.viewable:
            self._steps.hand_out("to_numpy(copy=False)")
            return self._table.to_numpy()
        # A copy: the cache keeps its rows (a flush leaves them cached), and the next step hits them.
        self.flush()
        array = self._table.owner_copy()  # after optimizer.step() the table's to_numpy refuses
        in_step = self._steps.rows_in_step()
        if in_step is not None:
            rows, values = in_step
            host_tensor(array, self._table.dtype)[rows.cpu()] = values.cpu()
        # Not asked for, it stands in for memory numpy cannot view: a write into it could not reach
        # the table, so it raises, as HostTable.to_numpy's copy of such a table does.
        array.flags.writeable = copy
        return array

    def getNumpyVersion(self) -> np.ndarray:
        """A copy of the table as a numpy array, as SpeedTorch returned (``to_numpy()`` shares memory).

        Raises:
            StateError: the switcher is closed.
        """
        return self.to_numpy(copy=True)

    def saveTorch(self, saveFileName: PathLike) -> None:
        """SpeedTorch's ``saveTorch``: ``*.pt``/``*.pth`` through ``torch.save`` (the table as one
        CPU tensor, as SpeedTorch wrote it); other suffixes as :meth:`save`.

        Atomic like every save: a failure leaves any previous file at ``saveFileName`` whole.

        Args:
            saveFileName: the target path.

        Raises:
            PathError: the directory is missing or the write failed (full disk, read-only).
            OptionError: a suffix that names no format (SpeedTorch's ``saveTorch("u")``): name it ``u.pt``.
            StateError: called from ``optimizer.step()`` until :meth:`after_step` (nothing is
                written; see :meth:`save`).
        """
        _refuse_unknown_suffix(saveFileName, "saveTorch")
        if _is_torch_file(saveFileName):
            self._check_saving()
            self.flush()
            # A copy, as getNumpyVersion's: as_tensor() would count as a view handed out (a device
            # table's for good), and the cache would give up its rows.
            tensor = host_tensor(self._table.owner_copy(), self._table.dtype)
            # Written beside the target and renamed over it, as every save is: a failed write
            # (a full disk) leaves the previous file whole.
            with atomic_output(saveFileName) as temporary, open(temporary, "wb") as file:
                try:
                    torch.save(tensor, file)
                except RuntimeError as exc:
                    # torch's writer reports the file system's error (a full disk) as a
                    # RuntimeError raised while handling it; atomic_output names the OSError.
                    if isinstance(exc.__context__, OSError):
                        raise exc.__context__ from exc
                    raise
        else:
            self.save(saveFileName)

    def loadTorch(self, loadFileName: PathLike) -> None:
        """SpeedTorch's ``loadTorch``: reads ``*.pt``/``*.pth`` with ``torch.load(weights_only=True)``.

        Other suffixes load as :meth:`load`.

        Args:
            loadFileName: the file to read.

        Raises:
            FileFormatError: the file holds no dense tensor of the table's shape and dtype (nothing changes).
            MissingFileError: no file at ``loadFileName``.
            OptionError: a suffix that names no format (a file SpeedTorch's ``saveTorch("u")``
                wrote): rename it ``u.pt``.
            PathError: a directory, or not a regular file (a named pipe, which
                torch.load would wait on for a writer).
        """
        _refuse_unknown_suffix(loadFileName, "loadTorch")
        if not _is_torch_file(loadFileName):
            self.load(loadFileName)
            return
        self._check_idle("loadTorch")
        check_regular_file(loadFileName, "torch file")
        try:
            tensor = torch.load(loadFileName, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
            raise FileFormatError(f"{os.fspath(loadFileName)!r} is not a readable torch file ({exc})") from exc
        # A sparse tensor of the table's shape and dtype would pass, and copy_ refuse it raw.
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != self._table.shape \
                or tensor.dtype != self._table.dtype or tensor.layout != torch.strided:
            if not isinstance(tensor, torch.Tensor):
                what = type(tensor).__name__
                fix = "give a file of torch.save(tensor) of the whole table (saveTorch writes one)"
            elif tensor.layout != torch.strided:
                what = f"{tuple(tensor.shape)} {tensor.dtype} as a {tensor.layout} tensor"
                fix = "save its tensor.to_dense()"
            else:
                what = f"{tuple(tensor.shape)} {tensor.dtype}"
                fix = "a switcher of its size loads it" + (
                    f" (total_classes={tensor.shape[0]}, embed_dimension={tensor.shape[1]}, "
                    f"datatype={str(tensor.dtype).removeprefix('torch.')!r})" if tensor.dim() == 2 else "")
            raise FileFormatError(f"{os.fspath(loadFileName)!r} holds {what}, but this table is "
                                  f"{self._table.shape} {self._table.dtype}; {fix}")
        # load_target(), as every load: as_tensor() would count as a view handed out (a device
        # table's for good), and the cache would keep no rows from then on.
        with self._rewriting("loadTorch"), loading_into([self._table], loadFileName):
            self._table.load_target().copy_(tensor)

    def getTorchVar(self) -> torch.Tensor:
        """SpeedTorch's ``getTorchVar``: the full table as a torch tensor sharing its memory.

        As :meth:`to_numpy` with ``copy=False``: cached rows are written back
        and dropped from the cache first. The view shows a step's rows as
        before the step from ``optimizer.step()`` until :meth:`after_step`,
        which makes it current again.

        Raises:
            StateError: from ``optimizer.step()`` until :meth:`after_step` (as :attr:`table`).
        """
        self._steps.hand_out("getTorchVar")
        return self._table.as_tensor()

    def getCupyVar(self) -> NoReturn:
        """SpeedTorch returned the CuPy array behind the table; speedswap keeps CuPy out of its API.

        Raises:
            OptionError: always; use :meth:`getTorchVar` (a torch view) or :meth:`to_numpy`.
        """
        raise OptionError("speedswap hands out no CuPy arrays: use getTorchVar() for a torch view "
                          "of the table, to_numpy() for a numpy view (cupy.asarray(...) of the "
                          "torch view if you need CuPy)")

    prefetchNextBatch = prefetch
