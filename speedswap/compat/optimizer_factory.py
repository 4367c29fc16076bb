"""OptimizerFactory: SpeedTorch's switcher of an optimizer's per-row state for one embedding."""

import contextlib
import weakref
from typing import NoReturn, Optional

import torch

from ..atomic import PathLike
from ..backends import get_backend
from ..backends.resolve import BackendLike
from ..convert import DTypeLike, Ids, bool_option, torch_dtype
from ..errors import DTypeError, OptionError, StateError
from ..train.caching import resetting_state
from ..train.one_optimizer import claim
from ..train.one_thread import one_thread
from ..train.row_state import EmptySparseGradient, NarrowedStep, RowState, sparse_grad_refusal
from ..train.step_hooks import StepHooks
from .steps import MODEL, OPTIMIZER
from .switcher import LocalIds, Switcher, device_of, storage_of, weight_of

__all__ = ["OptimizerFactory"]


def _parameter_named(model, variable_name):
    """``model``'s parameter ``variable_name``, or the ``weight`` of its submodule of that name.

    Raises:
        DTypeError: ``model`` is not an ``nn.Module``.
        OptionError: it has no such parameter or submodule.
    """
    if not isinstance(model, torch.nn.Module):  # get_parameter would raise a raw AttributeError
        raise DTypeError(f"model must be the nn.Module holding the embedding (SpeedTorch's "
                         f"OptimizerFactory(optimizer, total_classes, embed_dimension, model, "
                         f"variable_name)), got {type(model).__name__}")
    try:
        return model.get_parameter(variable_name)
    except AttributeError:
        pass
    try:
        return weight_of(model.get_submodule(variable_name))
    except AttributeError:
        names = [n for n, _ in model.named_parameters()]
        raise OptionError(f"the model has no parameter or embedding {variable_name!r}; its "
                          f"parameters are {names}") from None


def _owner_named(model, variable_name):
    """The module whose own parameter :func:`_parameter_named` found: the submodule, or the parameter's owner."""
    try:
        return model.get_submodule(variable_name)
    except AttributeError:  # the parameter's name: its owner is the module before the last dot
        return model.get_submodule(variable_name.rpartition(".")[0])


def _refuse_sparse_embedding(optimizer, param, owner, variable_name):
    """Refuse an ``nn.Embedding(sparse=True)`` whose optimizer's step raises at its sparse gradient.

    Refused here, before anything is built: the first ``optimizer.step()``
    would raise torch's RuntimeError in the middle of the switchers' step.

    Raises:
        OptionError: ``owner`` was built with ``sparse=True`` and ``optimizer``
            is one of torch's that takes no sparse gradient of ``param``
            (Adam, Adamax, ..., SGD or Adagrad with weight decay).
    """
    refused = sparse_grad_refusal(optimizer, param) if getattr(owner, "sparse", False) is True else None
    if refused is not None:
        raise OptionError(f"the model's {variable_name!r} ({type(owner).__name__}) was built with sparse=True, "
                          f"and {refused} does not take the sparse gradient it gives: its first "
                          f"optimizer.step() would raise. Build it with sparse=False (SpeedTorch's README asks "
                          f"for that too; the step updates only the step's rows either way), or train it "
                          f"with SGD or Adagrad (without weight_decay) or SparseAdam, which take sparse "
                          f"gradients")


class _Narrowing:
    """The parameter's narrowing for the step in progress, held apart from the factory.

    A factory dropped after an ``optimizer.step()`` that raised leaves the
    parameter narrowed to that step's rows, and no hook of its puts it back:
    its finalizer holds this (not the factory) and restores it.

    Args:
        state: the factory's per-row state, whose optimizer scratch goes back too.
    """

    def __init__(self, state: RowState):
        self.state = state
        self.step = None  # the NarrowedStep, from the step's begin to its end

    def restore(self):
        """Give the parameter its full shape, and the optimizer its full-size state scratch, back."""
        if self.step is not None:
            self.step.restore()
            self.step = None
            self.state.release()


class OptimizerFactory(Switcher):
    """Keeps an optimizer's per-row state for one embedding in host tables.

    One table per state tensor shaped like the parameter (Adam's ``exp_avg``
    and ``exp_avg_sq``, ...); scalar state such as ``step`` stays in the
    optimizer (:meth:`save` records it beside the tables). Rows never touched
    hold the value torch creates the state with.

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
        DTypeError: ``given_optimizer`` is not an optimizer (its class, or the parameters);
            a keyword it does not take (``device``, ``max_rows``, ``datatype``).
        OptionError: no such parameter, an optimizer not holding it, one
            whose state is not element-wise (LBFGS), one that takes no sparse
            gradient (Adam, SGD with weight decay) over an
            ``nn.Embedding(sparse=True)``, or a bad
            ``cache_rows`` (another than the embedding's ModelFactory's).
        StateError: built in the middle of a step of the embedding's switchers.

    From then on, until :meth:`close`, ``step()`` of any other optimizer
    holding the embedding raises :class:`~speedswap.OptionError` before it
    changes anything: it would keep state of its own on the working set's
    slots, which hold other rows every step.

    An ``optimizer.step()`` that raises (a check in a hook, out of memory)
    leaves the step's rows and their state as they were before it: call
    ``step()`` again, or ``zero_grad()`` and ``after_step`` to skip the batch.
    """

    _kind = OPTIMIZER
    _dtype_argument = "dtype"
    _after_close = ("optimizer state tables", "over the optimizer, and load the state saved before "
                                              "close() into it (load) to go on from there")

    def __init__(self, given_optimizer: torch.optim.Optimizer, total_classes: int, embed_dimension: int,
                 model: torch.nn.Module, variable_name: str, dtype: DTypeLike = "float32", CPUPinn: bool = False,
                 *, storage: Optional[str] = None, backend: BackendLike = "auto", path: Optional[PathLike] = None,
                 overwrite: bool = False, cache_rows: int = 0, **others):
        self._refuse_other_keywords(others)
        # bool("False") is True, and RowState reads a non-bool as a set of file names.
        overwrite = bool_option(overwrite, "overwrite", hint=" (replace existing mmap state files in path)")
        param = _parameter_named(model, variable_name)
        _refuse_sparse_embedding(given_optimizer, param, _owner_named(model, variable_name), variable_name)
        super().__init__(param, total_classes, embed_dimension, dtype, cache_rows,
                         find_param=lambda: _parameter_named(model, variable_name))
        backend = get_backend(backend, device_of(param))
        self._check_device(backend)  # before RowState makes (or replaces) any state file
        self._state = RowState(given_optimizer, param, total_classes, torch_dtype(dtype),
                              storage or storage_of(CPUPinn), backend, path, overwrite=overwrite)
        self._narrowing = _Narrowing(self._state)
        weakref.finalize(self, self._narrowing.restore).atexit = False
        self._empty_sparse = None  # SparseAdam's gradient in a step without this switcher's rows
        self._empty_step = False  # whether a step without this switcher's rows is between its hooks
        self._resetting = False  # whether RowState.gather is resetting the tables (see _resetting_state)
        # Weak hooks (see StepHooks): they act only inside a step, and
        # optimizer.step(closure) narrows after the closure's forward.
        self._hooks = StepHooks(self, given_optimizer)
        self._register(self._state)
        self._steps.watch_loads(_owner_named(model, variable_name))  # its loads write the slots: not refused
        for table in self._state.tables.values():  # reads and writes through any reference to them
            table.watch_reads(self._prepare_table_read)
            table.watch_writes(self._prepare_state_write)
        # Only this optimizer may step the working set: another one would keep per-row state
        # on its slots, which hold other rows every step (see speedswap.train.one_optimizer).
        self._claim = claim(self, param, given_optimizer,
                            instead="build the OptimizerFactory over this optimizer instead")

    # The step protocol of StepHooks; each hook claims the switchers (another thread's step is refused).
    @one_thread
    def _begin_step(self):
        step = self._steps.current
        if (self._gathered is None and step is not None and self._is_member()
                and MODEL in step.begun - step.ended and OPTIMIZER not in step.begun):
            # Raised before the optimizer runs: it would step the rows with another step's state.
            raise StateError("optimizer.step() in a step whose optimizer state rows were not gathered: "
                             "the ModelFactory's beforeForwardPass (before_forward) ran but the "
                             "OptimizerFactory's did not; call beforeForwardPass(ids) on both switchers "
                             "before the step")
        if self._gathered is None and self._param.grad is not None and self._is_member():
            # A step without this switcher's rows (a zero gradient after
            # zero_grad(set_to_none=False)) steps the optimizer's full-size scratch state. State
            # put in its place by a round trip of optimizer.load_state_dict() becomes the scratch
            # again: stepped as it is, it would no longer equal the scratch, and the next
            # before_forward would refuse it as another state_dict's. Any other state is refused now.
            self._state.check_not_replaced()
            self._state.release()
            self._state.keep_scalar_state()  # the optimizer counts the step (Adam's step): undone if it raises
            self._empty_step = True
            # This thread's until the step ends: another thread's before_forward would put its rows and
            # their state under the optimizer's step of the full-size scratch.
            self._one_thread.hold(True)
            grad = self._param.grad
            if self._state.needs_sparse_grad and not grad.is_sparse and not bool(grad.any()):
                self._empty_sparse = EmptySparseGradient(self._param)
        if self._gathered is not None and self._narrowing.step is None:
            self._state.keep_scalar_state()  # a step undone (_abort_step) counts once when retried
            # SparseAdam gets the rows' gradient as a sparse one, even from an
            # nn.Embedding(sparse=False) as SpeedTorch's README builds it.
            self._narrowing.step = NarrowedStep(self._param, len(self._gathered.rows),
                                                self._state.needs_sparse_grad)

    def _put_back_dense_zero_grad(self):
        if self._empty_sparse is not None:
            self._empty_sparse.restore()
            self._empty_sparse = None

    @one_thread
    def _end_step(self):
        self._put_back_dense_zero_grad()
        self._end_empty_step()
        step = self._gathered
        if self._narrowing.step is not None:
            try:
                # An optimizer may assign new tensors (p.data = p.data - lr * p.grad): their values
                # are the step's, or the step is refused before after_step writes anything back.
                self._state.check_step(len(step.rows))
                self._narrowing.step.finish()
            except StateError:
                self._abort_step()
                raise
            self._narrowing.step = None
        if step is not None:
            step.stepped = True  # the rows after_step writes back were stepped (see SharedSteps.end)

    def _end_empty_step(self):
        """End a step without this switcher's rows, if one is under way: its claim ends with it."""
        if self._empty_step:
            self._empty_step = False
            self._one_thread.hold(self._steps.busy())  # a step begun since keeps it (see SharedSteps.begin)

    @one_thread
    def _abort_step(self):
        self._put_back_dense_zero_grad()
        if self._empty_step:
            self._end_empty_step()
            self._state.undo_scalar_state()  # the optimizer may have counted the step before it raised
        if self._narrowing.step is None:
            return
        self._narrowing.restore()
        self._state.undo_scalar_state()  # the optimizer may have counted the step before it raised
        step = self._gathered
        if step is not None:
            # The optimizer raised inside the step, which stored nothing: the rows and their
            # state are read back from where they are authoritative (the failed step may have
            # changed them in place), so that the step can be retried or ended unchanged.
            self._steps.fetch_again(step, self._param.data)
            self._state.gather(step.rows, read=self._steps.read_state(), resetting=self._resetting_state)

    @one_thread
    def close(self) -> None:
        """Release the state tables' memory and unhook the optimizer (other optimizers may step the
        embedding again). Idempotent.

        The embedding's ModelFactory keeps working, its cache without state
        rows. Closing in the middle of a step abandons the step: its rows are
        not written back. Once the embedding's last switcher is closed, no
        hook of theirs stays on its parameter, which trains as any other.
        Every other method then raises :class:`~speedswap.StateError`, saying so.
        """
        self._closed = True
        self._hooks.remove()
        self._claim.remove()
        # After an optimizer.step() that raised the parameter is still narrowed, and no hook
        # of this switcher will put it back: the ModelFactory would train on the step's rows.
        self._narrowing.restore()
        self._end_empty_step()
        self._leave()  # cached state rows are written back while the tables are open
        self._state.close()

    @contextlib.contextmanager
    def _resetting_state(self):
        """:meth:`RowState.gather`'s bracket of its own reset of the tables, which may come mid-step.

        At a first step, or when Rprop's initial ``step_size`` follows a
        changed lr, the gather resets every row's state before it reads the
        step's rows: a write that :meth:`_prepare_state_write` lets through.
        """
        self._resetting = True
        try:
            with resetting_state(self._steps.cache):
                yield
        finally:
            self._resetting = False

    @one_thread
    def _prepare_table_read(self):
        """As :meth:`Switcher._prepare_table_read`, but letting through :meth:`RowState.gather`'s reset.

        The reset reads the tables (whether they hold an initial state) in
        the middle of a step, before the step's state rows are taken: there
        they are current, and :meth:`_resetting_state` flushed the cache.
        """
        if not self._resetting:
            super()._prepare_table_read()

    @one_thread
    def _prepare_state_write(self):
        """Make a write into a state table between steps, through any reference to it, reach the next step.

        Called by the tables before each write of their methods
        (:meth:`HostTable.watch_writes`): the device cache writes its rows
        and their state back and forgets them, as it would otherwise write
        them back over the write when they are evicted. The tables' reset
        by :meth:`RowState.gather` (see :meth:`_resetting_state`) is let
        through in the middle of a step.

        Raises:
            StateError: between before_forward and after_step, which writes the
                step's state rows back over the write, or once a newer
                OptimizerFactory replaced this one; nothing changes.
        """
        if self._resetting:
            return
        self._refuse_write_when_replaced("state.tables")
        self._check_idle("a write into the optimizer state")
        self._steps.hand_out("a write into the optimizer state")

    @property
    def state(self) -> RowState:
        """The per-row optimizer state: ``state.tables`` holds every row's current state.

        With a device cache, the cache first writes its rows and their state
        back and forgets them, so reads see every row's state as trained, as
        without a cache. Reads through the tables' methods (``to_numpy``,
        ``gather``, ...) and writes between steps (``apply_``, ``scatter``,
        ...), through any reference to them, see the cache's state rows and
        reach the next step (see :meth:`_prepare_state_write`); writes are
        refused once a newer OptimizerFactory replaced this one; reads are
        refused from ``optimizer.step()`` until the ModelFactory's
        ``after_step`` (this switcher's own, without one), a kept table's too
        (:meth:`_prepare_table_read`): the tables hold the step's state rows
        as before the step there. Before ``optimizer.step()`` they read what
        memory holds. A view of a table (``to_numpy()``) cannot be refused:
        from ``optimizer.step()`` it shows the step's rows' state as before
        the step, until that ``after_step`` makes it current again.

        Raises:
            StateError: from ``optimizer.step()`` until that after_step (see
                :meth:`SharedSteps.tables_behind`).
        """
        self._steps.hand_out("OptimizerFactory.state")
        return self._state

    def init_state(self) -> None:
        """Reset every row's state to torch's initial value (cached state rows too). Alias ``optInit``.

        Only the per-row state: the optimizer's scalar state (Adam's ``step``)
        goes on, as when an in-memory optimizer's moment tensors are zeroed.
        For a full restart, build a fresh optimizer and switchers.

        Raises:
            StateError: called in the middle of a step (nothing changes).
        """
        with self._rewriting("init_state"):
            self._state.init_state()

    def before_forward(self, pos: Ids, neg: Optional[Ids] = None) -> LocalIds:
        """Put the optimizer state of the step's rows into the optimizer.

        Call it with the same ids as the embedding's :class:`ModelFactory`
        (before or after it); the de-duplication is shared.

        Args:
            pos, neg: the ids given to :meth:`ModelFactory.before_forward`.

        Returns:
            the local ids, as :meth:`ModelFactory.before_forward`.

        Raises:
            as :meth:`ModelFactory.before_forward`; StateError also when the
            optimizer's state was lost (see :meth:`RowState.gather`).
        """
        if self._gathered is not None:
            raise StateError("beforeForwardPass (before_forward) called twice without afterOptimizerStep "
                             "(after_step); finish the step with afterOptimizerStep(ids) so its state "
                             "rows are written back")
        self._check_step_start()
        self._state.check_not_replaced()  # an optimizer.load_state_dict() without self.load()
        if self._steps.alone(OPTIMIZER) and self._param.shape[0] >= self._steps.num_rows:
            # Its state rows go to slots 0..k-1, which in a whole table hold other rows.
            raise OptionError(
                f"an OptimizerFactory without a ModelFactory, over an embedding that holds the whole "
                f"table ({self._param.shape[0]} rows for total_classes={self._steps.num_rows}): the "
                f"step's state rows would land on other rows. Build a ModelFactory for the embedding "
                f"too (its rows are then a batch-sized working set), or leave the optimizer's state "
                f"in memory (no OptimizerFactory)")
        rows = self._param_rows()
        step = self._steps.prepare(pos, neg, OPTIMIZER)
        self._steps.begin(step, OPTIMIZER, rows)
        try:
            self._state.gather(step.rows, read=self._steps.read_state(), resetting=self._resetting_state)
        except BaseException:
            self._steps.withdraw(step, OPTIMIZER)
            raise
        return self._result(step)

    def save(self, path: PathLike) -> None:
        """Write every state table (cached state rows included) to one checkpoint (``.h5`` file or
        directory), atomically, with the optimizer's scalar state for the embedding (Adam's ``step``).

        Args:
            path: the target, an ``.h5`` file or a directory.

        Raises:
            OptionError, PathError, FileFormatError: as
                :func:`~speedswap.train.checkpoint.save_tables` raises them;
                nothing is written and the device cache is as it was.
            StateError: called from ``optimizer.step()`` until after_step, where the tables
                hold the step's state rows as before the step (nothing is written); before
                ``optimizer.step()`` they hold what memory does.
        """
        from ..train.checkpoint import save_tables
        self._check_saving()
        # The state tables' watch_reads hook (_prepare_table_read) has the shared cache write its
        # rows back as save_tables first reads them, after every check: a refused save leaves it
        # as it was.
        save_tables(path, self._state.tables, {"optimizer": type(self._state.optimizer).__name__},
                    row_state=self._state)

    def load(self, path: PathLike) -> None:
        """Read state tables written by :meth:`save`, and the optimizer's scalar state for the embedding.

        The optimizer's step count (Adam's ``step``, NAdam's ``mu_product``,
        ...) for the embedding becomes the checkpoint's, whatever it did
        since (a fresh optimizer, or one further on): training goes on as
        from the save. ``optimizer.load_state_dict`` of a state_dict saved
        beside it (for the other parameters) may come before or after. A
        checkpoint of an older speedswap holds no step count: the
        optimizer's own is kept only if it has none (SGD) or its
        ``load_state_dict`` put it there since the last step; otherwise it
        is dropped, and the next step asks for that ``load_state_dict``.

        Args:
            path: what :meth:`save` wrote.

        Raises:
            FileFormatError: a checkpoint of another optimizer or shape, or a damaged one
                (nothing changes, the device cache included).
            StateError: called in the middle of a step.
        """
        from ..train.checkpoint import load_tables
        self._check_idle("load")
        # The shared cache writes its rows back and drops them once the checkpoint is verified:
        # a refused load leaves it as it was.
        load_tables(path, self._state.tables, {"optimizer": type(self._state.optimizer).__name__},
                    before_writes=self._prepare_state_write, row_state=self._state)

    # SpeedTorch's optimizer factories inherited its model factories' names, over a table they never
    # set: getNumpyVersion, getCupyVar and getTorchVar raised AttributeError, saveTorch / loadTorch
    # (GPUPytorch*) pickled the list of state tensors. Each here either does what its name says for
    # the state tables, or says what does.
    def getNumpyVersion(self) -> dict:
        """A copy of every state table as a numpy array (cached state rows included), by state name.

        Returns:
            ``{name: numpy.ndarray (total_classes, embed_dimension)}``, independent
            copies (Adam: ``exp_avg``, ``exp_avg_sq``); a bfloat16 table's rows as
            their ``uint16`` bit patterns, as :meth:`HostTable.to_numpy` gives them.

        Raises:
            StateError: from ``optimizer.step()`` until after_step: the step's state rows
                are current only in the optimizer then (nothing is read).
        """
        return {name: table.to_numpy(copy=True) for name, table in self._state.tables.items()}

    def _refuse_single_table(self, what):
        """Raise: SpeedTorch's one-table ``what`` has several tables behind it here.

        Raises:
            OptionError: always.
        """
        raise OptionError(f"an OptimizerFactory has no single table for {what}: it keeps one per "
                          f"state tensor, named {sorted(self._state.tables)}. Use "
                          f"state.tables[name].as_tensor() for a torch view of one, "
                          f"getNumpyVersion() for numpy copies of all (cupy.asarray(...) of the torch "
                          f"view if you need CuPy)")

    def getCupyVar(self) -> NoReturn:
        """SpeedTorch's ``getCupyVar``: speedswap hands out no CuPy arrays, and the state is several tables.

        Raises:
            OptionError: always; says what to call instead.
        """
        self._refuse_single_table("getCupyVar()")

    def getTorchVar(self) -> NoReturn:
        """SpeedTorch's ``getTorchVar``: the state is several tables, not one tensor.

        Raises:
            OptionError: always; says what to call instead.
        """
        self._refuse_single_table("getTorchVar()")

    def saveTorch(self, saveFileName: PathLike) -> None:
        """SpeedTorch's ``saveTorch`` of an optimizer factory: :meth:`save`.

        The state tables are written as :meth:`save` writes them (one ``*.h5`` file
        or a directory), with the optimizer's name that :meth:`load` checks; a
        ``*.pt`` path is refused, as by :meth:`save`.

        Args:
            saveFileName: the checkpoint's path.

        Raises:
            as :meth:`save`; nothing is written.
        """
        self.save(saveFileName)

    def loadTorch(self, loadFileName: PathLike) -> None:
        """SpeedTorch's ``loadTorch`` of an optimizer factory: :meth:`load`.

        Args:
            loadFileName: a checkpoint :meth:`save` (or :meth:`saveTorch`) wrote.

        Raises:
            as :meth:`load`; nothing changes.
        """
        self.load(loadFileName)

    optInit = init_state
