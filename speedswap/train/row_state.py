"""Optimizer state kept in host tables, one table per state tensor shaped like the parameter.

What each ``torch.optim`` optimizer keeps per element, and what torch fills it
with when it creates it, is the one piece of per-optimizer knowledge speedswap
needs; it lives in :data:`_ROW_STATE`. Scalar state (``step``, NAdam's
``mu_product``, ASGD's ``eta``/``mu``) is shared by all rows and stays in the
optimizer, where ``optimizer.state_dict()`` saves it; checkpoints record it
beside the tables too (:meth:`RowState.scalar_state`), so that a load
restores the two together.

State is found by identity, ``optimizer.state[param]``, never by position in
``state_dict()``.
"""

import contextlib
import inspect
import os
import weakref
from typing import Callable, Optional

import numpy as np
import torch

from .. import files
from ..atomic import (keep_owner_and_mode, remove_stale_temporaries, replace_together, saving_error, sync_new_name,
                      temp_path)
from ..errors import DTypeError, FileFormatError, OptionError, PathError, StateError
from ..table import HostTable
from .checkpoint import file_in
from .scratch_writes import same_memory

__all__ = ["row_state_spec", "RowState", "SUPPORTED_OPTIMIZERS", "NarrowedStep", "EmptySparseGradient",
           "drop_leftover_state", "refuse_unasked_restart", "check_state_files",
           "take_assigned", "sparse_grad_refusal", "close_replaced"]

#: (id of a scratch tensor a RowState handed an optimizer, id of its parameter) -> the tensor,
#: held weakly. By ids: a tensor's == is element-wise (no WeakSet), and an attribute on the
#: tensor would go into torch.save(optimizer.state_dict()).
_SCRATCH = weakref.WeakValueDictionary()


def drop_leftover_state(optimizer, param, restart: bool = False) -> None:
    """Drop the state an earlier attach of ``param`` left in ``optimizer`` (``step`` included).

    Attaching starts the offloaded state afresh, so the optimizer must start
    afresh too: fresh moments with the step count of an earlier run would be
    bias-corrected wrongly. Such state holds this parameter's scratch
    tensors. State the user put there (``load_state_dict`` before attaching,
    for a resume) or that torch created with the optimizer is kept, unless
    ``restart``: an ``attach(optimizer, restart=True)`` asked for a fresh
    start, and a state_dict loaded since the last step (a resume's) would
    keep its step count and be refused at the next step as per-row state
    the tables do not hold.
    """
    state = optimizer.state.get(param) or {}
    if restart or any(_SCRATCH.get((id(value), id(param))) is value for value in state.values()):
        optimizer.state.pop(param, None)


def refuse_unasked_restart(state: Optional["RowState"], optimizer, owner: str, trained: Optional[bool] = None,
                           everywhere: str = "") -> None:
    """Refuse attaching the optimizer that is attached already, once it trained the table.

    Attaching starts the offloaded state afresh (moments and step count): an
    ``attach`` left inside the training loop, or a notebook cell run twice,
    would silently train on unlike the same optimizer in memory. Called
    unless the attach says ``restart=True``.

    Args:
        state: the :class:`RowState` attached now, or None.
        optimizer: the optimizer being attached.
        owner: the embedding's class name, for the message.
        trained: whether a step or a checkpoint load changed ``state`` since
            it was made; None reads :attr:`RowState.trained`. (A sharded
            embedding tells from its step count, which every rank shares:
            a rank whose owned rows no step reached holds fresh tables.)
        everywhere: appended to the advice (" on every rank").

    Raises:
        StateError: ``optimizer`` is ``state``'s and ``trained``.
    """
    if state is None or state.optimizer is not optimizer or not (state.trained if trained is None else trained):
        return
    raise StateError(
        f"this {type(optimizer).__name__} is attached to this {owner} already, and has trained it since "
        f"(steps, or a checkpoint loaded): attaching it again would start its state for the table "
        f"afresh (moments and step count), and training would go on unlike the same optimizer in "
        f"memory. Attach once, before the training loop; to restart that state on purpose, call "
        f"emb.attach(optimizer, restart=True){everywhere}. Nothing was changed")


def _adam_like(group, defaults):
    names = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    if group.get("amsgrad"):
        names["max_exp_avg_sq"] = 0.0
    return names


def _rmsprop(group, defaults):
    names = {"square_avg": 0.0}
    if group["momentum"] > 0:
        names["momentum_buffer"] = 0.0
    if group["centered"]:
        names["grad_avg"] = 0.0
    return names


def _adagrad(group, defaults):
    # torch fills ``sum`` with the constructor's value (optimizer.defaults), whatever the
    # parameter's group says: a group's own initial_accumulator_value is ignored.
    return {"sum": float(defaults["initial_accumulator_value"])}


def _constructed_adagrad_state(optimizer, param) -> dict:
    """The state ``torch.optim.Adagrad``'s constructor gives ``param``: ``step`` 0, ``sum`` at its initial value.

    torch before 2.12 makes an Adagrad's state there only: its ``step()`` raises
    ``KeyError: 'sum'`` at a parameter whose state was dropped (a restart, a
    checkpoint saved before the first step), where 2.12 makes this same state
    at the step. Made by the constructor, so that it is torch's own in every version.
    """
    fused = _group_of(optimizer, param).get("fused")
    initial = optimizer.defaults["initial_accumulator_value"]
    return torch.optim.Adagrad([param], initial_accumulator_value=initial, fused=fused).state[param]


def _lr(group):
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


#: optimizer class -> (group, optimizer.defaults) -> {state name: the value torch fills it with}.
#: SGD's momentum buffer is created from the first gradient rather than
#: filled; zero is what a row untouched by that first step holds.
_ROW_STATE = {
    torch.optim.SGD: lambda g, d: {"momentum_buffer": 0.0} if g["momentum"] != 0 else {},
    torch.optim.Adam: _adam_like,
    torch.optim.AdamW: _adam_like,  # not a subclass of Adam in every torch version
    torch.optim.Adamax: lambda g, d: {"exp_avg": 0.0, "exp_inf": 0.0},
    torch.optim.NAdam: lambda g, d: {"exp_avg": 0.0, "exp_avg_sq": 0.0},
    torch.optim.RAdam: lambda g, d: {"exp_avg": 0.0, "exp_avg_sq": 0.0},
    torch.optim.Adagrad: _adagrad,
    torch.optim.Adadelta: lambda g, d: {"square_avg": 0.0, "acc_delta": 0.0},
    torch.optim.RMSprop: _rmsprop,
    torch.optim.Rprop: lambda g, d: {"prev": 0.0, "step_size": _lr(g)},
    torch.optim.ASGD: lambda g, d: {"ax": 0.0},
    torch.optim.SparseAdam: lambda g, d: {"exp_avg": 0.0, "exp_avg_sq": 0.0},
}

SUPPORTED_OPTIMIZERS = tuple(sorted({cls.__name__ for cls in _ROW_STATE}))

#: Optimizers that refuse dense gradients.
_SPARSE_GRAD_ONLY = (torch.optim.SparseAdam,)

#: The steps of torch's optimizers that refuse a sparse gradient ("Adam does not support sparse
#: gradients"): of the ones above, SGD, Adagrad and SparseAdam take one. Unwrapped, as the first
#: optimizer built of a class wraps its class's step in a profiling hook.
_DENSE_GRAD_STEPS = frozenset(inspect.unwrap(cls.step) for cls in _ROW_STATE
                              if cls not in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam))
#: The steps that take a sparse gradient only without weight decay ("weight_decay option is not
#: compatible with sparse gradients", and SGD's "add(sparse, dense) is not supported").
_UNDECAYED_SPARSE_GRAD_STEPS = frozenset(inspect.unwrap(cls.step) for cls in (torch.optim.SGD, torch.optim.Adagrad))


def sparse_grad_refusal(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Optional[str]:
    """What of ``optimizer`` makes its ``step()`` raise at a sparse gradient of ``param``, if anything.

    A subclass with a step of its own may take one: only torch's own steps are known to refuse it.

    Args:
        optimizer: any optimizer.
        param: the parameter whose gradient is sparse.

    Returns:
        ``"Adam"`` for Adam, AdamW, Adamax, NAdam, RAdam, Adadelta, RMSprop,
        Rprop and ASGD (and their subclasses that keep torch's ``step``),
        ``"SGD with weight_decay=0.1"`` for SGD or Adagrad whose group of
        ``param`` decays; None otherwise (an optimizer that does not hold
        ``param`` too: that is refused elsewhere).
    """
    step = getattr(type(optimizer), "step", None)
    if not callable(step):
        return None
    step, name = inspect.unwrap(step), type(optimizer).__name__
    if step in _DENSE_GRAD_STEPS:
        return name
    if step in _UNDECAYED_SPARSE_GRAD_STEPS:
        for group in getattr(optimizer, "param_groups", ()):
            if any(p is param for p in group["params"]) and group.get("weight_decay", 0) != 0:
                return f"{name} with weight_decay={group['weight_decay']}"
    return None


def _group_of(optimizer, param):
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise OptionError(f"the optimizer {type(optimizer).__name__} does not hold this parameter "
                      f"(shape {tuple(param.shape)}); build it from model.parameters() that "
                      f"include the embedding")


def row_state_spec(optimizer, param, group=None):
    """The per-row state tensors ``optimizer`` keeps for ``param`` and their initial values.

    Args:
        optimizer: a ``torch.optim.Optimizer`` holding ``param``.
        param: the parameter.
        group: ``param``'s param group, when the caller knows it (found otherwise).

    Returns:
        dict ``{name: fill value}``, e.g. ``{"exp_avg": 0.0, "exp_avg_sq": 0.0}``
        for Adam, ``{"prev": 0.0, "step_size": lr}`` for Rprop.

    Raises:
        DTypeError: ``optimizer`` is not an optimizer (its class, or the parameters).
        OptionError: the optimizer does not hold ``param``, or its state is not
            element-wise (LBFGS keeps whole-parameter history) or unknown.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        # Checked first: the lookup below would call it "cannot be offloaded", even torch.optim.Adam.
        got = (f"the class {optimizer.__name__}" if isinstance(optimizer, type)
               else f"a {type(optimizer).__name__}")
        name = optimizer.__name__ if isinstance(optimizer, type) else "torch.optim.Adam"
        raise DTypeError(f"expected an optimizer, got {got}; build one over the model's parameters "
                         f"and pass that: opt = {name}(model.parameters(), lr=...)")
    for cls in type(optimizer).__mro__:
        if cls in _ROW_STATE:
            return _ROW_STATE[cls](_group_of(optimizer, param) if group is None else group, optimizer.defaults)
    # An allow-list: an optimizer of the user's own may well be element-wise, but the names and
    # starting values of its state, which rows never touched must hold, are unknown.
    raise OptionError(f"{type(optimizer).__name__} cannot be offloaded: speedswap moves optimizer "
                      f"state row by row, which is exact only for optimizers whose state is "
                      f"element-wise, and it knows the state of these torch.optim optimizers (their "
                      f"names and starting values) and their subclasses only: "
                      f"{', '.join(SUPPORTED_OPTIMIZERS)}. Train the embedding with one of them (another "
                      f"optimizer may step the model's other parameters)")


def _may_replace(overwrite, file) -> bool:
    """Whether an ``mmap`` state table may replace ``file`` (``overwrite`` as :class:`RowState` takes it).

    Not by its name alone: another file put under that name since the owner
    made its own there (moved or saved there by the user, or by another
    process) is not the owner's to replace.
    """
    if isinstance(overwrite, bool):
        return overwrite
    try:
        return file in overwrite and files.identity(os.stat(file)) == overwrite[file]
    except OSError:  # gone since, or a dangling symbolic link: no file of the owner's
        return False


def check_state_files(optimizer, param, storage, path=None, overwrite=False) -> None:
    """Refuse, before anything changes, an optimizer whose :class:`RowState` could not be made.

    An owner that attaches again keeps its old state until the new one is
    made in full (with ``mmap`` storage the new files are made beside the old
    ones' and replace them last), so a refused attach leaves the old optimizer
    attached; what can be told from the arguments alone is refused here, before
    the owner changes anything (the optimizer's leftover state).

    Args:
        optimizer, param, storage, path, overwrite: as :class:`RowState` takes them.

    Raises:
        DTypeError, OptionError: an optimizer that cannot be offloaded (see
            :func:`row_state_spec`).
        PathError: an ``mmap`` state file exists and may not be replaced: the
            owner did not make it, or another file was put under its name since.
    """
    for name in row_state_spec(optimizer, param):
        file = file_in(path, name, storage)
        if file is not None and os.path.exists(file) and not _may_replace(overwrite, file):
            if not isinstance(overwrite, bool) and file in overwrite:
                raise PathError(f"{file!r} is not the file speedswap made there: another one was put under that "
                                f"name since (moved, copied or saved there), and the state table {name!r} of "
                                f"{type(optimizer).__name__} would replace it; speedswap does not replace a file "
                                f"it did not create. Move it out of {os.fspath(path)!r}, or build the owner with "
                                f"overwrite=True; nothing was changed (the optimizer attached before stays "
                                f"attached)")
            raise PathError(f"{file!r} already exists, and the state table {name!r} of "
                            f"{type(optimizer).__name__} would replace it; speedswap does not replace "
                            f"a file it did not create. Move it out of {os.fspath(path)!r}, or build the "
                            f"owner with overwrite=True; nothing was changed (the optimizer attached "
                            f"before stays attached)")


def close_replaced(old: Optional["RowState"], new: "RowState") -> None:
    """Close ``old``, the state an attach replaced with ``new``, then make ``new``'s file names durable.

    Last in an attach, once ``new`` is attached in ``old``'s place: closing
    the old tables flushes their maps, which may take long, and an interrupt
    (Ctrl-C) meanwhile would have left the owner half released had it held
    ``old`` still. It comes after the attach, and carries a note saying so
    (Python 3.11+); the old tables it left open are released as they are
    collected.

    Args:
        old: the state let go of (None where no optimizer was attached).
        new: the state attached.

    Raises:
        KeyboardInterrupt (or any BaseException of the close or the sync): with that note.
    """
    try:
        if old is not None:
            old.close()
    except BaseException as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"speedswap: the new optimizer is attached: this {type(exc).__name__} came after the "
                         f"attach, as the old one's state tables were closed; those left open are released as "
                         f"they are collected")
        raise
    finally:
        new.sync_names()  # an interrupt during it has its own note (sync_new_name)


def _described(tensor) -> str:
    return f"a {tuple(tensor.shape)} {tensor.dtype} tensor on {tensor.device}"


def take_assigned(own, data, rows, refusal) -> bool:
    """Copy the first ``rows`` rows of ``data``, assigned to a parameter's ``.data`` in place of ``own``, into ``own``.

    An optimizer whose ``step()`` assigns ``p.data = p.data - lr * p.grad``,
    or SAM restoring ``p.data = old_p``, leaves the parameter's values in a
    new tensor, while the owner's storage ``own`` is what its rows are read
    from and written back: the assigned values are taken into it.

    Args:
        own: the storage the parameter's ``.data`` should be.
        data: the parameter's ``.data`` now.
        rows: how many leading rows hold values to take.
        refusal: called with ``data`` and ``own``, the message of the error
            raised when ``data`` cannot be taken.

    Returns:
        whether ``data`` was another tensor (and was copied); False when it
        is ``own`` itself (the same memory, shape and strides).

    Raises:
        StateError: ``data`` is not shaped, typed and placed as ``own``.
            Nothing changes.
    """
    if same_memory(data, own):
        return False
    if (data.shape, data.dtype, data.device) != (own.shape, own.dtype, own.device):
        raise StateError(refusal(data, own))
    with torch.no_grad():
        values = data[:rows]
        if values.untyped_storage().data_ptr() == own.untyped_storage().data_ptr():
            values = values.clone()  # another view of the same memory: copy_ may not overlap
        own[:rows].copy_(values)
    return True


def _refused_in_step(data, own):
    return (f"the optimizer's step() assigned the offloaded parameter's .data {_described(data)}; "
            f"during the step the parameter holds the step's {own.shape[0]} rows, "
            f"{_described(own)}, and the values it is assigned must be shaped, typed and placed "
            f"like them (or updated in place). Nothing was written back: fix the optimizer and call "
            f"step() again, or drop the step (discard_step(), or zero_grad() before the next forward)")


class NarrowedStep:
    """Narrows ``param`` to the first ``k`` rows of its storage for one optimizer step.

    Outside the step the parameter keeps its declared ``(capacity, dim)``
    shape, which autograd remembers for it across steps; only the step itself
    sees the ``k`` touched rows, so the optimizer's work scales with the batch
    and no slot outside the step is updated. The gradient is narrowed with it
    (a dense one to a view, a sparse one re-sized, or made sparse for an
    optimizer that takes only sparse gradients); :meth:`finish` (the step
    done) or :meth:`restore` (the step dropped) puts both back.

    Args:
        param: the working-set parameter.
        k: rows the step touched (slots ``0..k-1``).
        sparse: hand the optimizer a sparse gradient.
    """

    def __init__(self, param, k, sparse=False):
        self._param, self._full, self._grad, self._k = param, param.data, param.grad, k
        param.data = self._full[:k]
        grad = self._grad
        if grad is None:
            return
        if grad.is_sparse:
            # Local ids are below k, so the entries fit the narrowed shape as they are.
            grad = torch.sparse_coo_tensor(grad._indices(), grad._values(), param.shape,
                                           check_invariants=False)
        else:
            grad = grad[:k]
            if sparse:
                slots = torch.arange(k, device=grad.device).unsqueeze(0)
                grad = torch.sparse_coo_tensor(slots, grad, grad.shape, is_coalesced=True,
                                               check_invariants=False)
        param.grad = grad

    def finish(self):
        """:meth:`restore` after the step, keeping its result even if the optimizer assigned ``param.data``.

        An optimizer whose step assigns ``p.data = p.data - lr * p.grad``
        leaves the step's rows in a new tensor: they are copied into the
        narrowed storage first (see :func:`take_assigned`).

        Raises:
            StateError: the assigned tensor is not shaped, typed and placed as
                the narrowed parameter; nothing changes (the parameter stays
                narrowed: :meth:`restore` drops the step).
        """
        take_assigned(self._full[:self._k], self._param.data, self._k, _refused_in_step)
        self.restore()

    def restore(self):
        """Give the parameter back its full storage and its full gradient.

        A gradient set to None meanwhile (``zero_grad()`` after a step that
        raised) stays None: the step is being dropped.
        """
        self._param.data = self._full
        self._param.grad = None if self._param.grad is None else self._grad


class EmptySparseGradient:
    """Hands an optimizer that takes only sparse gradients (SparseAdam) an empty one for a step without rows.

    ``zero_grad(set_to_none=False)`` leaves the working set a dense zero
    gradient, which SparseAdam refuses with a RuntimeError; in memory a sparse
    embedding's zeroed gradient is an empty sparse one, whose step it counts.
    :meth:`restore` puts the dense zeros back after the step (or its abort).

    Args:
        param: the working-set parameter; its gradient must be dense zeros.
    """

    def __init__(self, param):
        self._param, self._dense = param, param.grad
        no_slots = torch.zeros(1, 0, dtype=torch.int64, device=self._dense.device)
        param.grad = torch.sparse_coo_tensor(no_slots, self._dense[:0], self._dense.shape, is_coalesced=True,
                                             check_invariants=False)

    def restore(self):
        if self._param.grad is not None:  # a zero_grad() after a step that raised keeps None
            self._param.grad = self._dense


def _made_beside(target, file) -> str:
    """Where the new state table that is to replace ``target`` (named ``file``) is made: in a new directory beside it.

    A directory, not a temporary file name: a table's file is named
    ``*.npy``. :func:`temp_path` names it, so that the next attach removes
    it once this process is gone (a kill left it).

    Raises:
        PathError: ``target`` is not a regular file (a rename over it would
            fail after others were done), or the directory cannot be made (a
            read-only or full file system).
    """
    if os.path.exists(target) and not os.path.isfile(target):
        raise PathError(f"{file!r} is not a regular file (a directory, a named pipe, a socket or a device), and the "
                        f"state table {os.path.splitext(os.path.basename(file))[0]!r} would replace it with one; "
                        f"move it away. Nothing was replaced")
    remove_stale_temporaries(target)  # of an attach that was killed
    directory = temp_path(target)
    try:
        os.mkdir(directory)
    except OSError as exc:
        raise saving_error(file, exc, directory) from exc
    return os.path.join(directory, os.path.basename(file))


class RowState:
    """The per-row optimizer state of one embedding parameter, in host tables.

    Before a step, :meth:`gather` puts the state rows of the working set into
    ``optimizer.state[param]`` (narrowed to the ``k`` rows the step touches);
    after it, :meth:`scatter` writes them back. Rows never touched keep the
    value torch itself creates (zeros, Adagrad's ``initial_accumulator_value``,
    Rprop's ``lr``).

    Args:
        optimizer: the optimizer holding ``param``.
        param: the working-set parameter, ``(capacity, dim)``.
        num_rows: rows of the full table.
        dtype: the state dtype (the parameter's).
        storage: storage kind of the state tables.
        backend: the backend (name or instance).
        path: for ``storage="mmap"``, the directory for ``<name>.npy`` files.
        overwrite: let ``mmap`` tables replace existing files: True, or the
            files that may be replaced (those the owner made itself), ``{path:
            identity}`` as :meth:`made_files` gives them: each only while its
            path still names that file.
            The new tables are made under temporary names beside those files,
            which they replace only once every table exists (:meth:`replace_files`).
        replace_later: leave that replacing to the owner's call of
            :meth:`replace_files`, once its other work succeeded too (a device
            cache over the new tables), and :meth:`sync_names` after it, once it
            took the new state as its own; :meth:`close` before it replaces nothing.

    Raises:
        OptionError: an optimizer that cannot be offloaded (see :func:`row_state_spec`).
        PathError: an ``mmap`` file exists and may not be replaced, cannot be
            made (out of descriptors, a disk error), or cannot be renamed in
            place (see :meth:`replace_files`). No file was replaced.
    """

    def __init__(self, optimizer, param, num_rows, dtype, storage, backend, path=None,
                 overwrite=False, replace_later=False):
        self.optimizer = optimizer
        self.param = param
        self.spec = row_state_spec(optimizer, param)
        self._shape = tuple(param.shape)
        self._group = _group_of(optimizer, param)  # its options are read again at every step
        self._scratch = {}
        self._scalars_before = None  # see keep_scalar_state
        self.needs_sparse_grad = isinstance(optimizer, _SPARSE_GRAD_ONLY)
        self._initial_specs = []  # every initial state init_state filled the tables with
        self.tables = {}
        # Until replace_files: the mmap files this made at names no file had, and (table name, its
        # file in a temporary directory, the file it is to replace, the name the owner gave that)
        # for each table made beside a file it is to replace; close() removes them (see there).
        self._made, self._aside = [], []
        self._unsynced = {}  # directory -> a file replace_files renamed in it (see sync_names)
        try:
            for name in self.spec:
                file = file_in(path, name, storage)
                replacing = file is not None and os.path.lexists(file) and _may_replace(overwrite, file)
                at = file  # an existing file that may not be replaced is refused by HostTable.empty
                if replacing:
                    # Made beside the file it replaces, which stays until every table exists (and the
                    # owner's other work succeeded: replace_later): a refused state replaces nothing.
                    # In a temporary directory, under its own name (a table's file is named *.npy).
                    target = os.path.realpath(file)  # a symbolic link keeps naming the state file
                    at = _made_beside(target, file)
                    self._aside.append((name, at, target, file))
                self.tables[name] = HostTable.empty(num_rows, param.shape[1], dtype, storage, backend, at,
                                                    device=param.device)
                if replacing:
                    try:
                        if os.path.exists(target):  # (a symbolic link may name no file yet)
                            keep_owner_and_mode(at, target)
                    except OSError as exc:
                        raise saving_error(file, exc, at) from exc
                elif file is not None:
                    self._made.append(file)
            self.init_state()  # HostTable.zero_ leaves the new sparse files of mmap tables as they are
            if not replace_later:
                self.replace_files()
        except BaseException:
            self.close()
            raise
        # Whether the tables were restored (a checkpoint load, an explicit init_state)
        # since the last step, so that state an optimizer.load_state_dict() put in place
        # may be replaced by theirs; the initial state set here does not count.
        self._restored = False
        # The per-row state tensors known to be in the optimizer: the scratch it holds between
        # steps, and before the first one what torch created with the optimizer (Adagrad's
        # sum), if it is still the initial state the tables hold too.
        state = optimizer.state.get(param) or {}
        self._held = {name: state[name] for name, value in self.spec.items()
                      if isinstance(state.get(name), torch.Tensor) and bool((state[name] == value).all())}
        if not replace_later:
            self.sync_names()  # last: an interrupt during it comes after the files were replaced

    @property
    def trained(self) -> bool:
        """Whether a step or a checkpoint load changed the optimizer's state for the parameter since this was made.

        The tables tell of a load or of a step with rows (until :meth:`init_state`);
        the optimizer's step count, of a step that wrote no row (one without
        rows, or one before :meth:`init_state` reset the rows): it counted that
        step, and goes on counting (Adam's bias correction).
        """
        step = (self.optimizer.state.get(self.param) or {}).get("step")
        return not self._fresh or (step is not None and bool(step != 0))

    def init_state(self):
        """Set every row's state to the value torch creates it with (a fresh optimizer).

        A state that starts at zero leaves a new ``mmap`` file nothing has
        written into sparse (see :meth:`HostTable.zero_`).
        """
        for name, value in self.spec.items():
            if value == 0:
                self.tables[name].zero_()
            else:
                self.tables[name].apply_(torch.nn.init.constant_, value)
        # Rprop's step_size follows the lr: a checkpoint saved before the first step holds
        # one of these (see gather).
        if self.spec not in self._initial_specs:
            self._initial_specs.append(dict(self.spec))
        # Until a step has written rows back, every row holds torch's initial
        # state, so torch may create the state itself at the first step.
        self._fresh = True
        self._restored = True

    def _initial_state_at_the_tables_lr(self):
        """Torch's initial state at the lr the tables' first row was filled with, or None if it does not follow the lr.

        Rprop's ``step_size`` starts at the lr: a checkpoint saved before the
        first step of a run at another lr holds that run's. Whether every row
        holds it is for :meth:`holds_initial_state` to tell.
        """
        group = _group_of(self.optimizer, self.param)
        at_one = row_state_spec(self.optimizer, self.param, {**group, "lr": 1.0})
        at_two = row_state_spec(self.optimizer, self.param, {**group, "lr": 2.0})
        following = [name for name in at_one if at_one[name] != at_two[name]]
        if not following:
            return None
        spec = row_state_spec(self.optimizer, self.param)
        for name in following:
            spec[name] = float(next(self.tables[name].host_chunks()).flat[0])
        return spec

    def holds_initial_state(self, spec=None) -> bool:
        """Whether every row's state is the value torch creates it with (read chunk by chunk).

        Args:
            spec: ``{name: value}`` to compare with (a subset of the tables'
                names); :attr:`spec`, the state made at attach or the first step, if None.
        """
        spec = self.spec if spec is None else spec
        return all(bool(np.all(chunk == value)) for name, value in spec.items()
                   for chunk in self.tables[name].host_chunks())

    def mark_loaded(self):
        """Record that the tables now hold trained state (read from a checkpoint)."""
        self._fresh = False
        self._restored = True

    def scalar_state(self) -> dict:
        """The optimizer's state for the parameter that is not per row, for a checkpoint beside the tables.

        The per-row moments in the tables are only half of it: Adam's bias
        correction follows the step count, NAdam's ``mu_product`` and ASGD's
        ``eta`` and ``mu`` the steps taken, so the tables restored with the
        count of another point of training train wrong.

        Returns:
            ``{"stepped": bool, "scalars": {name: [value, dtype name or None]}}``
            of JSON values (None: a Python number, as SparseAdam's count).
            ``stepped`` tells "never stepped" from SGD's "no scalar state".
        """
        state = self.optimizer.state.get(self.param) or {}
        scalars = {}
        for name, value in state.items():
            if name in self.spec:
                continue
            if isinstance(value, torch.Tensor):
                scalars[name] = [value.item(), str(value.dtype).replace("torch.", "")]
            else:
                scalars[name] = [value, None]
        return {"stepped": bool(state), "scalars": scalars}

    def check_scalar_state(self, saved, source: str) -> Optional[dict]:
        """Check what :meth:`scalar_state` gave a checkpoint, before any table changes.

        Args:
            saved: the checkpoint's record, or None for a checkpoint written
                before speedswap recorded it.
            source: the checkpoint, as the error names it.

        Returns:
            ``saved``, for :meth:`restore_scalar_state`.

        Raises:
            FileFormatError: not such a record (the checkpoint was edited or damaged).
        """
        if saved is None:
            return None
        scalars = saved.get("scalars") if isinstance(saved, dict) else None
        if not (isinstance(saved, dict) and isinstance(saved.get("stepped"), bool)
                and isinstance(scalars, dict)
                and all(isinstance(name, str) and name not in self.spec and isinstance(entry, list)
                        and len(entry) == 2 and isinstance(entry[0], (int, float))
                        and not isinstance(entry[0], bool)
                        and (entry[1] is None or isinstance(getattr(torch, str(entry[1]), None), torch.dtype))
                        for name, entry in scalars.items())):
            raise FileFormatError(f"{source}: the optimizer's scalar state recorded there ({saved!r}) is not "
                                  f"what a save writes ({{'stepped': bool, 'scalars': {{name: [number, "
                                  f"dtype]}}}}); the checkpoint was changed: restore it from a backup")
        return saved

    def restore_scalar_state(self, saved: Optional[dict]) -> None:
        """Give the optimizer the checkpoint's scalar state for the parameter, once the tables hold its rows.

        The optimizer's own (another point of training) is replaced: its
        per-row state is the tables'. ``optimizer.load_state_dict`` of the
        state_dict saved beside the checkpoint may still follow, or come
        first: it holds the same values.

        Args:
            saved: from :meth:`check_scalar_state`. None, a checkpoint of an
                older speedswap, which holds none: the optimizer's own scalar
                state stays only where it cannot be of another point of
                training: there is none (SGD), or ``optimizer.load_state_dict``
                put it there since the last step (the state_dict saved with
                the checkpoint, loaded first). Otherwise it is dropped, so
                that the next step asks for ``optimizer.load_state_dict``
                (see :meth:`gather`) instead of training on with a count
                that does not go with the tables.
        """
        optimizer, param = self.optimizer, self.param
        if saved is None:
            state = optimizer.state.get(param) or {}
            loaded = any(name in state and state[name] is not self._held.get(name) for name in self.spec)
            if not loaded and any(name not in self.spec for name in state):
                optimizer.state.pop(param)
            self.mark_loaded()
            return
        optimizer.state.pop(param, None)
        if not saved["stepped"]:
            # Saved before the first step: as there, the next step starts the optimizer afresh
            # if the tables hold torch's initial state, and refuses otherwise (see gather).
            self.mark_loaded()
            return
        group = _group_of(optimizer, param)
        state = optimizer.state[param]
        for name in self.spec:
            state[name] = self._buffer(name)  # replaced by the step's rows at the next step
        for name, (value, dtype) in saved["scalars"].items():
            # Where torch puts them: the step count on the CPU unless the optimizer is fused or
            # capturable, everything else (ASGD's eta and mu) on the parameter's device.
            on_param = name != "step" or group.get("fused") or group.get("capturable")
            state[name] = value if dtype is None else torch.tensor(
                value, dtype=getattr(torch, dtype), device=param.device if on_param else "cpu")
        self.mark_loaded()

    def check_options(self) -> None:
        """Refuse group options that now ask for per-row state the tables do not hold.

        The tables are made at attach for the state the parameter's group asks
        for then. Setting ``momentum`` on an SGD or RMSprop group that had none
        (a momentum warm-up from 0), or turning ``amsgrad`` or ``centered`` on,
        makes torch keep another per-row state, which it would create for
        every element: offloaded there is no table to keep it in (SGD would
        step, then be refused with its rows put back; Adam and RMSprop raise a
        ``KeyError``). Options that drop state (momentum back to 0) keep the
        tables, which torch then leaves alone.

        Raises:
            OptionError: the group asks for state the tables lack. Nothing changes.
        """
        group = self._group
        if not any(g is group for g in self.optimizer.param_groups):  # load_state_dict() makes new groups
            group = self._group = _group_of(self.optimizer, self.param)
        # Only the names matter here: a copy of the group whose lr is a float, so that Rprop's
        # fill value never reads a tensor lr (on a GPU, .item() is a host wait at every step).
        names = row_state_spec(self.optimizer, self.param, {**group, "lr": 0.0})
        missing = [name for name in names if name not in self.spec]
        if missing:
            raise OptionError(
                f"{type(self.optimizer).__name__}'s options for the offloaded parameter changed since it "
                f"was attached: they now keep per-row state {missing}, which its host tables (made for "
                f"{sorted(self.spec) or 'no per-row state'}) do not hold. Set the option before "
                f"attaching, or attach again (emb.attach(optimizer, restart=True); a new "
                f"OptimizerFactory), which makes the tables anew and starts the per-row state and step "
                f"count afresh; nothing was changed")

    def check_not_replaced(self) -> None:
        """Refuse per-row state that ``optimizer.load_state_dict()`` put in place of the tables'.

        Between steps the optimizer holds this object's scratch buffers for the
        parameter. ``load_state_dict`` replaces them with the saved scratch, which
        holds the rows of whichever step ran last, not the table's rows: in memory
        it would restore every row's state, offloaded it cannot, and training on
        would silently use the tables' current state with the restored step count.
        It is accepted when the tables were restored since the last step (the
        matching :meth:`mark_loaded` checkpoint or :meth:`init_state`), or when it
        put back what the optimizer already held (a round trip of its own state_dict).

        Raises:
            StateError: the state was replaced and the tables were not restored.
                Nothing changes.
        """
        self.check_options()
        state = self.optimizer.state.get(self.param)
        if self._restored or not state:
            return
        held = self._held
        replaced = [name for name in self.spec if name in state and state[name] is not held.get(name)]
        if all(name in held and state[name].shape == held[name].shape
               and torch.allclose(state[name].to(held[name].device), held[name], rtol=0, atol=0,
                                  equal_nan=True)
               for name in replaced):
            return
        raise StateError(
            f"{type(self.optimizer).__name__}'s per-row state for the offloaded parameter "
            f"({', '.join(replaced)}) was replaced since the last step, by "
            f"optimizer.load_state_dict(...) or a re-attach; speedswap keeps that state in host "
            f"tables, which the optimizer's state_dict does not hold. Restore the tables from the "
            f"checkpoint saved with it (emb.load(path), after emb.discard_step() if a forward "
            f"already ran; an OptimizerFactory's load(path)), or start the rows' state afresh "
            f"(emb.init_state(), OptimizerFactory.optInit()); then train on"
            + self._whole_table_hint({name: state[name] for name in replaced}))

    def _whole_table_hint(self, replaced) -> str:
        """How to restore per-row state loaded shaped like the whole table (an in-memory run's), or "".

        An in-memory optimizer's ``state_dict`` holds every row's state: it
        goes into the tables with the rows themselves, not through the
        optimizer, where the step would replace it with the tables' own.
        """
        whole = tuple(next(iter(self.tables.values())).shape)
        if not any(isinstance(value, torch.Tensor) and tuple(value.shape) == whole for value in replaced.values()):
            return ""
        tables = ", ".join(f"'optimizer.{name}': ..." for name in self.tables)
        return (f". The state loaded is shaped like the whole table {whole}, as an in-memory "
                f"optimizer's state_dict holds it: to go on from such a run, put it and the rows into "
                f"an OffloadedEmbedding's tables (extra = emb.get_extra_state(); "
                f"extra['tables'] = {{'table': rows, {tables}}}; emb.set_extra_state(extra)), and the "
                f"optimizer's state_dict is accepted with them")

    def _buffer(self, name):
        if name not in self._scratch:
            # Sized from the declared shape: the parameter may be narrowed right now. Zeros,
            # not whatever the memory held: the optimizer's state_dict holds this scratch.
            self._scratch[name] = torch.zeros(self._shape, dtype=self.param.dtype,
                                              device=self.param.device)
            _SCRATCH[id(self._scratch[name]), id(self.param)] = self._scratch[name]
        return self._scratch[name]

    def gather(self, rows, read=None, resetting=contextlib.nullcontext):
        """Put the state of ``rows`` (the step's working set, by slot) into the optimizer.

        Args:
            rows: the working set's rows: validated, unique int64 ids (not checked again).
            read: fills the state instead of the tables (a device cache):
                called as ``read(rows, {name: (k, dim) view to fill})``.
            resetting: brackets a reset of the tables to a new initial state
                (Rprop's step_size follows the lr of the first step), so that a
                device cache's copies of state rows are reset too.

        Raises:
            StateError: the optimizer has no state for the parameter although
                the tables hold trained state (its state_dict was not restored).
                Nothing changes.
        """
        if not self.spec:
            return  # plain SGD keeps no per-row state (even after a checkpoint load)
        state = self.optimizer.state.get(self.param)
        if not state or any(name not in state for name in self.spec):
            if not self._fresh:
                # A checkpoint saved before the first step holds torch's initial state in
                # every row: with no optimizer state beside it, that is a fresh start (as a
                # sharded checkpoint's load finds too). The check reads the tables, so a
                # device cache gives its state rows back first; it runs only on this path.
                # Any initial state counts: one the tables were filled with (at attach, at the
                # first step), the one torch would make now (Rprop's step_size is the lr, which
                # the optimizer state_dict saved with such a checkpoint restores), or one made at
                # another lr (a checkpoint of a run at another lr).
                specs = self._initial_specs + [row_state_spec(self.optimizer, self.param)]
                with resetting():
                    specs.append(self._initial_state_at_the_tables_lr())
                    held = next((spec for spec in specs if spec and self.holds_initial_state(spec)), None)
                self._fresh = held is not None
                if held is not None:
                    self.spec = held  # what the tables hold: moved to torch's below
            if not self._fresh:
                raise StateError(
                    f"{type(self.optimizer).__name__} holds no state for the offloaded parameter, but "
                    f"the host tables hold trained state (loaded from a checkpoint of an older "
                    f"speedswap, which records no step count, say); restore the optimizer with "
                    f"optimizer.load_state_dict(...) of the state_dict saved with it, after the load (it "
                    f"holds the step count), or restart the "
                    f"optimizer state from scratch with init_state() (OffloadedEmbedding.init_state, "
                    f"OptimizerFactory.optInit; a ShardedOffloadedEmbedding: discard_step() and "
                    f"attach(optimizer, restart=True) on every rank); then call step() again")
            # torch creates the initial state at this step, from the group as it is now
            # (Rprop's step_size is the lr now, which a scheduler may have changed since
            # attach): every table row must hold what torch creates.
            spec = row_state_spec(self.optimizer, self.param)
            if spec != self.spec:
                self.spec = spec
                with resetting():
                    self.init_state()
            if state or not isinstance(self.optimizer, torch.optim.Adagrad):
                return
            # torch before 2.12 steps an Adagrad only on the state its constructor made: made so,
            # holding the scratch the optimizer holds between steps, then read as any step's.
            state = self.optimizer.state[self.param] = _constructed_adagrad_state(self.optimizer, self.param)
            self._hand_back(state)
            if not rows.shape[0]:
                return  # asked for no row (a sharded step's check before its messages): prepared
        k = rows.shape[0]
        views = {name: self._buffer(name)[:k] for name in self.tables}
        if read is not None:
            read(rows, views)
        else:
            for name, view in views.items():
                self.tables[name].gather_validated(rows, view)
        state.update(views)  # only once every gather succeeded

    def step_state(self):
        """The optimizer's per-row state of the step in progress (``{name: (k, dim)}``), or None.

        None before torch creates it (a fresh optimizer's first step, or a
        parameter torch skipped).
        """
        state = self.optimizer.state.get(self.param)
        return state if state and all(name in state for name in self.spec) else None

    def release(self):
        """Give the optimizer its full-size scratch back after a step that never finished.

        The tables still hold every row's state as it was before that step.
        """
        state = self.optimizer.state.get(self.param)
        if state and all(name in state for name in self.spec):
            for name in self.spec:
                state[name] = self._held[name] = self._buffer(name)

    def keep_scalar_state(self) -> None:
        """Keep the optimizer's scalar state for the parameter as it is before a step (see :meth:`undo_scalar_state`).

        Torch counts a step (Adam's ``step``, in place) before it updates the
        rows: a step that raised after that is retried from the rows as they
        were, and would count twice.
        """
        state = self.optimizer.state.get(self.param) or {}
        self._scalars_before = bool(state), {name: value.clone() if isinstance(value, torch.Tensor) else value
                                             for name, value in state.items() if name not in self.spec}

    def undo_scalar_state(self) -> None:
        """Give the optimizer back the scalar state :meth:`keep_scalar_state` kept, after a step that raised.

        The per-row state is :meth:`release`'s. A state torch made at that
        step (there was none) is dropped whole: the retry makes it afresh.
        Once per :meth:`keep_scalar_state`; nothing without one.
        """
        if self._scalars_before is None:
            return
        had_state, scalars = self._scalars_before
        self._scalars_before = None
        if not had_state:
            self.optimizer.state.pop(self.param, None)
        elif self.param in self.optimizer.state:
            self.optimizer.state[self.param].update(scalars)

    def made_files(self) -> dict:
        """The state tables' ``mmap`` files, and which file each is: ``{path: (st_dev, st_ino)}``.

        For the owner's ``overwrite`` at a later attach: the files it may replace.
        Those of the tables' maps, named as :meth:`replace_files` names them.
        """
        return {table.path: table.file_identity for table in self.tables.values() if table.path is not None}

    def replace_files(self) -> None:
        """Put the ``mmap`` files made beside the files they replace in their place, and name them so.

        The files replaced may be mapped by the old state's tables: those keep
        their files (a map holds its file whatever its names), so the old
        state trains on exactly until its owner closes it. Called by
        ``__init__`` unless ``replace_later``; once.

        Raises:
            PathError: a rename failed (an I/O error, a remount read-only,
                another user's file in a sticky directory), and those before
                it were put back: nothing was replaced
                (:func:`~speedswap.atomic.replace_together`, all or none). The
                old state's tables go on with their files under their names.
                :meth:`close` removes the new files.
        """
        replace_together([(at, target) for _, at, target, _ in self._aside])
        for name, at, target, file in self._aside:
            self.tables[name].renamed(file)
            self._unsynced[os.path.dirname(target)] = target
            with contextlib.suppress(OSError):  # empty now; left, it goes with the process (see _made_beside)
                os.rmdir(os.path.dirname(at))
        self._made, self._aside = [], []

    def sync_names(self) -> None:
        """Make the names :meth:`replace_files` gave the new files durable: sync their directories.

        Apart from :meth:`replace_files`, for the owner to call once it took
        this state as its own: a sync may take long, and an interrupt (Ctrl-C)
        during it comes after the files were replaced, so it must not undo the
        attach. It carries a note saying so (Python 3.11+).
        """
        unsynced, self._unsynced = self._unsynced, {}
        for directory, file in unsynced.items():
            sync_new_name(directory, file, "the new optimizer state's files are in place")

    def close(self):
        """Release the state tables' memory.

        The files of a state refused before :meth:`replace_files` go too:
        half made, they are no state, and the owner, which never learns of
        them, would refuse a retry (a file it did not create). The files they
        were to replace stay as they are.
        """
        for table in self.tables.values():
            table.close()
        for file in self._made + [at for _, at, _, _ in self._aside]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file)
        for _, at, _, _ in self._aside:
            with contextlib.suppress(OSError):  # not shutil.rmtree: it takes descriptors, which may be what lacked
                os.rmdir(os.path.dirname(at))
        self._made, self._aside = [], []

    def check_step(self, k):
        """Refuse per-row state the step left in a form the tables cannot take, before any is written.

        The optimizer's state for the step is normally the ``(k, dim)`` views
        :meth:`gather` put in place, updated in place; an optimizer that
        assigns new tensors (``state["exp_avg"] = beta * exp_avg + g``) is
        followed, as long as they are shaped, typed and placed like them.

        Args:
            k: rows the step touched.

        Raises:
            StateError: a state tensor of another shape, dtype or device, or
                state names this torch version was not expected to use.
                Nothing changes.
        """
        state = self.optimizer.state.get(self.param)
        if not state:
            return
        like = (torch.Size((k, self._shape[1])), self.param.dtype, self.param.device)
        for name in self.spec:
            value = state.get(name)
            if value is self._scratch.get(name):
                continue  # given back by release() after a step that raised: its rows are the gathered ones
            if isinstance(value, torch.Tensor) and (value.shape, value.dtype, value.device) != like:
                raise StateError(
                    f"{type(self.optimizer).__name__}'s step() left its per-row state {name!r} for "
                    f"the offloaded parameter as {_described(value)}; during the step the parameter "
                    f"holds the step's {k} rows and each per-row state must be a {tuple(like[0])} {like[1]} "
                    f"tensor on {like[2]} "
                    f"(its rows go back to host tables of that shape). Nothing was written back: fix "
                    f"the optimizer and call step() again, or drop the step (discard_step(), or "
                    f"zero_grad() before the next forward)")
        shaped = {name for name, value in state.items()
                  if isinstance(value, torch.Tensor) and value.dim() == 2}
        if shaped != set(self.spec):
            raise StateError(
                f"{type(self.optimizer).__name__} keeps per-row state {sorted(shaped)} but "
                f"speedswap expected {sorted(self.spec)}; this torch version is not supported "
                f"for offloading this optimizer")

    def scatter(self, rows, write=None):
        """Write the state of ``rows`` back to the tables after the step.

        Args:
            rows: the ids given to :meth:`gather`.
            write: stores the state instead of the tables (a device cache):
                called once, as ``write({name: (k, dim) state})``, or as
                ``write(None)`` when torch skipped a parameter that has per-row state.

        Raises:
            StateError: the step left state the tables cannot take (see
                :meth:`check_step`); nothing is written.
            Whatever ``write`` or a table raises (out of memory): no table is
                written (``write`` must keep to that too), and the optimizer
                holds its full-size scratch again all the same.
        """
        state = self.optimizer.state.get(self.param)
        if not state:
            if write is not None:
                # Without per-row state (plain SGD) there is none to lose.
                write(None if self.spec else {})
            return  # the parameter had no gradient: torch skipped it, nothing changed
        k = rows.shape[0]
        self.check_step(k)
        try:
            if write is not None:
                write({name: state[name][:k] for name in self.tables})
            else:
                self._table_writes(rows, state, k)()
        finally:
            # After a write that raised (out of memory) too, so that the next step, once this
            # one is discarded, takes the state as its own.
            self._hand_back(state)
        self._fresh = self._restored = False

    def prepare_scatter(self, rows: torch.Tensor) -> Callable[[], None]:
        """Everything of :meth:`scatter` into the tables that may fail, now; the writes themselves, returned.

        For an owner that writes the rows' table with their state (a step's
        write-back) and undoes the step when anything fails before the first
        write: it prepares the table's write and this, then writes. A failure
        here writes nothing and leaves the optimizer holding the step's state,
        for the owner's undo (:meth:`release`, :meth:`undo_scalar_state`).

        Args:
            rows: the ids given to :meth:`gather`.

        Returns:
            the writes, to call once: they also give the optimizer its full-size scratch back, as :meth:`scatter`.

        Raises:
            As :meth:`scatter` without ``write``; nothing is written.
        """
        state = self.optimizer.state.get(self.param)
        if not state:
            return lambda: None  # the parameter had no gradient: torch skipped it, nothing changed
        k = rows.shape[0]
        self.check_step(k)
        write_rows = self._table_writes(rows, state, k)

        def write():
            write_rows()
            self._hand_back(state)
            self._fresh = self._restored = False
        return write

    def _table_writes(self, rows, state, k) -> Callable[[], None]:
        """Every state table's write of the step's ``k`` rows, prepared (allocated); returns the writes.

        Prepared before any is made: out of memory leaves each state table as
        it was, never some of them written.
        """
        writes = [table.prepare_scatter(rows, state[name][:k]) for name, table in self.tables.items()]

        def write():
            for write_rows in writes:
                write_rows()
        return write

    def _hand_back(self, state) -> None:
        """Give the optimizer its full-size scratch in ``state`` after a step's write-back.

        Between steps the optimizer holds it, so that its state_dict has the
        parameter's declared shape.
        """
        for name in self.tables:
            state[name] = self._held[name] = self._buffer(name)
