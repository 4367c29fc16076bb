"""The step a ModelFactory and an OptimizerFactory of one parameter share, and their device cache.

SpeedTorch code calls ``before_forward(ids)`` on both switchers of an
embedding, then ``after_step(ids)`` on both. The ids of a step are checked and
de-duplicated once, by whichever switcher comes first; the other finds the
same ids and reuses the slots, and ``after_step`` only compares its ids with
the step's (no second range check: on a GPU each one is a host synchronisation).

**The cache.** A cached row is cached with its optimizer state, so the
switchers of one parameter share one :class:`~speedswap.train.cache.RowCache`
over the ModelFactory's table and the OptimizerFactory's state tables. It is
rebuilt, after a flush, whenever a switcher joins or leaves (closed, or
collected). Within a step:

* the first ``before_forward`` (of either switcher) fetches the step's rows
  into the parameter: hits from the cache, misses from the host;
* ``OptimizerFactory.before_forward`` reads their optimizer state the same way;
* ``ModelFactory.after_step`` stores rows and state together (the rows are
  final when the model's switcher says so). When the OptimizerFactory's
  ``after_step`` came first, its state rows wait for that store; when it
  comes later, the store takes them from the optimizer and its ``after_step``
  only ends its part.

With ``cache_rows=0`` the cache holds nothing and only moves and counts rows,
so a switcher has one code path. Without a ModelFactory there is no table to
cache: a lone OptimizerFactory moves its state rows itself.
"""

import functools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..convert import as_id_tensor, bounds_check, check_id_range, is_uint64, read_bounds
from ..errors import IdError, OptionError, StateError
from ..train.caching import idle_stats, new_cache, rewriting
from ..train.conversions import (gives_new_storage, guard_parameter, refuse_conversion,
                                 refuse_new_gradient_storage, refuse_new_storage)
from ..train.leftover import untouched
from ..train.one_process import OneProcess
from ..train.one_thread import OneThread, one_thread
from ..train.row_state import row_state_spec
from ..train.scratch_writes import ScratchWrites
from ..train.step_hooks import closure_of
from ..train.working_set import WorkingSet

__all__ = ["SharedSteps", "ModuleHook", "steps_for", "MODEL", "OPTIMIZER"]

_NAMES = ("pos ids", "neg ids")

#: ``_Step.begun`` / ``ended`` hold these: which switcher of the parameter began or ended a step.
MODEL, OPTIMIZER = "model", "optimizer"

#: The OptimizerFactory's state rows have not been handed to the cache yet.
_WAITING = object()


class _Step:
    """The ids one ``before_forward`` saw, the slots they were given, and who is in the step."""

    def __init__(self, flats, shapes, locals_, rows, grad, hits, picked, version):
        self.flats = flats
        self.shapes = shapes
        self.locals = locals_
        self.rows = rows
        self.hits = hits  # the cache's count of the rows it holds, read with the working set's
        self.picked = picked  # where the rows were among the ids the cache looked up, for its fetch
        self.begun = set()  # kinds whose before_forward joined the step
        self.ended = set()  # kinds whose after_step ended their part
        self.stepped = False  # the OptimizerFactory's optimizer.step() finished within the step
        self.stepping = False  # an optimizer.step() over the parameter may have changed rows (_check_switched_steps)
        self.version = version  # the parameter's version when the step began (see tables_behind)
        self.grad = grad  # (param.grad, its version) when the step began, or None

    def same_ids(self, flats):
        return len(flats) == len(self.flats) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(flats, self.flats))

    def unfinished(self):
        """A switcher began the step and has not ended it."""
        return bool(self.begun - self.ended)


class _Member:
    """A switcher of the parameter: a weak reference to it, the tables it brings, its cache size."""

    def __init__(self, switcher, tables, cache_rows):
        self.ref = weakref.ref(switcher)
        self.tables = tables  # the ModelFactory's HostTable, or the OptimizerFactory's RowState
        self.cache_rows = cache_rows


def _refuse_leftover_gradient(ref, incoming):
    """A hook on the parameter: refuse adding a gradient to one left by the last step's rows.

    The switchers reuse the parameter's slots for other rows every step, so
    adding to a gradient left from the last step would add one step's
    gradient to another's rows (a gradient accumulated across
    ``before_forward``/``after_step`` cycles, or a forgotten ``zero_grad()``).
    ``zero_grad()`` before the backward, either kind, clears it
    (:func:`~speedswap.train.leftover.untouched`).
    """
    steps = ref()
    if steps is None or steps._leftover is None:
        return
    (left, version), steps._leftover = steps._leftover, None
    if untouched(steps.param.grad, left, version):
        raise StateError("a backward adds to a gradient left by the previous step, which no "
                         "zero_grad() cleared; its slots now hold other rows, so it would train "
                         "them. Gradient accumulation across steps (beforeForwardPass to "
                         "afterOptimizerStep; before_forward to after_step) is not supported: call "
                         "optimizer.zero_grad() before each step's backward")


class ModuleHook:
    """A hook of the switchers on a module of the user's model: a copy of the model is refused while it would be wrong.

    ``copy.deepcopy(model)`` (``torch.optim.swa_utils.AveragedModel``, an EMA
    copy) and pickling (``torch.save(model)``) copy the module's hooks with it.
    While a ModelFactory switches the embedding, its ``nn.Embedding`` holds a
    step's slots, not the table, so the copy would hold a few slots of stale
    rows and an average of it would average those: refused, naming the way out
    (:func:`_copied`). Otherwise (only an OptimizerFactory: the weight holds
    the user's rows) the copy goes on with a hook that does nothing, as the
    copy's parameter is no switcher's.

    Args:
        fn: the hook, or None for one that does nothing.
        steps: the embedding's :class:`SharedSteps`, held weakly.
    """

    def __init__(self, fn, steps=None):
        self._fn = fn
        self._steps = None if steps is None else weakref.ref(steps)

    def __call__(self, *args, **kwargs):
        return None if self._fn is None else self._fn(*args, **kwargs)

    def _refuse_copy(self):
        steps = None if self._steps is None else self._steps()
        if steps is not None and steps.serving(MODEL):
            raise _copied()

    def __deepcopy__(self, memo):
        self._refuse_copy()
        return ModuleHook(None)

    def __reduce_ex__(self, protocol):
        self._refuse_copy()
        return ModuleHook, (None,)


class SharedSteps:
    """The step in progress for one parameter and its device cache, shared by its switchers.

    Args:
        param: the model's embedding parameter (its rows are the working set).
        num_rows: rows of the full table.
    """

    def __init__(self, param: torch.nn.Parameter, num_rows: int):
        self.param = param
        self.num_rows = num_rows
        self.working_set = WorkingSet(
            param.shape[0], param.device, table=f"the {num_rows} x {param.shape[1]} table",
            larger=f"more rows in the model's embedding ({param.shape[0]} now), "
                   f"whose rows are the working set")
        self.current = None
        self.cache = None
        self._members = {}  # MODEL / OPTIMIZER -> _Member
        self._open = False  # the cache fetched the current step's rows and has not stored them
        self._states = _WAITING  # state rows handed over by OptimizerFactory.after_step
        self._leftover = None  # the last step's gradient, untouched since (see _refuse_leftover_gradient)
        self._finished = None  # (param.grad, its version) when the last step ended (see refuse_stepping_between_steps)
        self._hook = None  # on the parameter once it requires grad (see _watch_gradients)
        # Between steps the parameter's slots hold no row: a write into them in place is lost
        # at the next before_forward, so it is refused there (see watch_loads for the loads).
        self.scratch_writes = ScratchWrites(param, _written)
        self._scratch = None  # the slots' memory (param.data) since a ModelFactory joined (see take_back_scratch)
        self._load_hooks = {}  # id(module) -> its load_state_dict pre and post hooks (see watch_loads)
        # Both switchers' calls claim it, and a step holds it from its first begin() until it is
        # no longer busy(): another thread's before_forward would clear the working set under
        # the step, and its reads would flush and refill the cache the step fetches from.
        self._one_process = OneProcess("this embedding's pair of switchers (ModelFactory, OptimizerFactory)")
        self._in_files = False  # whether a member's table or optimizer state is in mmap files (see join)
        self._one_thread = OneThread(
            "this embedding's pair of switchers (ModelFactory, OptimizerFactory)",
            span="between the beforeForwardPass (before_forward) that began a step and the last "
                 "afterOptimizerStep (after_step) that ends it, or inside an optimizer.step()",
            step="each step (beforeForwardPass on every switcher to afterOptimizerStep on every switcher)",
            release="a thread that began a step holds them until it ends the step with afterOptimizerStep "
                    "on every switcher that began it")

    # ------------------------------------------------------------ members
    def is_member(self, switcher, kind) -> bool:
        """Whether ``switcher`` is the parameter's switcher of ``kind`` (not one replaced since)."""
        member = self._members.get(kind)
        return member is not None and member.ref() is switcher

    def serving(self, kind) -> bool:
        """Whether a live switcher of ``kind`` serves the parameter (none once the last one closed)."""
        member = self._members.get(kind)
        return member is not None and member.ref() is not None

    def alone(self, kind) -> bool:
        """Whether the parameter's live switchers are one of ``kind`` and none of the other kind."""
        return self.serving(kind) and not self.serving(OPTIMIZER if kind == MODEL else MODEL)

    def busy(self) -> bool:
        """Whether a step is in progress: a switcher began it and has not ended it."""
        return self.current is not None and self.current.unfinished()

    def check_join(self, kind: str, cache_rows: int, who: str) -> None:
        """Raise unless a switcher of ``kind`` may join now with ``cache_rows``; nothing changes.

        Raises:
            StateError: a step of the parameter is in progress.
            OptionError: the parameter's switcher of the other kind has another ``cache_rows``.
        """
        if self.busy():
            raise StateError(f"{who} built between beforeForwardPass (before_forward) and "
                             f"afterOptimizerStep (after_step) of this parameter's switchers; build "
                             f"switchers between steps (before the "
                             f"first forward works for every optimizer, Rprop included: "
                             f"SpeedTorch's advice to build its OptimizerFactory after a first "
                             f"backward does not apply)")
        for kind_, member in self._members.items():
            other = member.ref()
            if kind_ != kind and other is not None and member.cache_rows != cache_rows:
                raise OptionError(
                    f"{who}(cache_rows={cache_rows}) for an embedding whose "
                    f"{type(other).__name__} has cache_rows={member.cache_rows}: the switchers "
                    f"of one embedding share one device cache of rows and their optimizer "
                    f"state; pass the same cache_rows to both (or close the other one first)")

    @one_thread
    def join(self, switcher, kind: str, cache_rows: int, tables) -> weakref.finalize:
        """Make ``switcher`` the parameter's switcher of ``kind``: the last act of its constructor.

        A switcher of the same kind built earlier is replaced: every call of
        it but ``close()`` raises from now on (see
        :class:`~speedswap.compat.switcher.Switcher`). The cache is rebuilt
        over the members' tables.

        Args:
            switcher: the ModelFactory or OptimizerFactory.
            kind: :data:`MODEL` or :data:`OPTIMIZER`.
            cache_rows: its ``cache_rows``.
            tables: its HostTable (a ModelFactory) or RowState (an OptimizerFactory).

        Returns:
            the call that removes the switcher again (from ``close``); it runs
            by itself when the switcher is collected.

        Raises:
            as :meth:`check_join`.
        """
        self.check_join(kind, cache_rows, type(switcher).__name__)
        self._watch_gradients()
        guard_parameter(self.param, self.check_conversion)
        _watch_optimizer_steps()
        member = self._members[kind] = _Member(switcher, tables, cache_rows)
        if kind == MODEL:  # its slots are the table's from here: writes before are not lost to it
            self.scratch_writes.note_own(self.param)
            self._scratch = self.param.data
        state = getattr(tables, "tables", None)  # an OptimizerFactory's RowState: {name: HostTable}
        # Kept once a member brought one: forked processes would share those files (see prepare).
        self._in_files |= any(t.storage == "mmap" for t in (state.values() if state is not None else [tables]))
        self._rebuild()
        _STEPS[self.param] = weakref.ref(self)
        leave = weakref.finalize(switcher, self._leave, kind, member)
        leave.atexit = False  # at exit there is nothing to keep consistent
        return leave

    @one_thread
    def check_conversion(self, fn) -> None:
        """Refuse ``model.double()``, ``.half()``, ``.to(...)`` of the parameter while a switcher serves it.

        The switchers' host tables hold rows of the parameter's dtype for its
        device: converted, it would take rows it cannot hold. Checked before
        any module of the model converts (:func:`guard_parameter`); once every
        switcher is closed, the parameter converts as any other.

        Raises:
            OptionError: ``fn`` changes the parameter's dtype or device; nothing was converted.
            StateError: between before_forward and after_step, ``fn`` gives the
                parameter new storage (``to_empty()``; see :func:`refuse_new_storage`),
                or between steps its gradient (:func:`refuse_new_gradient_storage`).
        """
        live = [member.ref() for member in self._members.values() if member.ref() is not None]
        if live:
            kind = f"embedding switched by {type(live[0]).__name__}"
            refuse_conversion(kind, fn, self.param, self.param.dtype,
                              instead="convert the model first and build the switchers after it, with "
                                      "the matching datatype (or close() them before converting)")
            if self.busy():
                refuse_new_storage(kind, fn, self.param, "after_step")
            refuse_new_gradient_storage(kind, fn, self.param)
            if gives_new_storage(fn, self.param):
                self.scratch_writes.note_conversion()  # to_empty(): its memory is no write of the user's

    def _watch_gradients(self):
        """Hook :func:`_refuse_leftover_gradient` on the parameter, once, when it takes gradients.

        torch hooks only a tensor that requires gradients, and a frozen working
        set (``nn.Embedding.from_pretrained``) takes none: it is hooked when a
        step begins after ``requires_grad_(True)``, before any backward of it.
        """
        if self._hook is None and self.param.requires_grad:
            self._hook = self.param.register_hook(
                functools.partial(_refuse_leftover_gradient, weakref.ref(self)))
            weakref.finalize(self, self._hook.remove).atexit = False

    def watch_loads(self, module: torch.nn.Module) -> None:
        """Take ``module.load_state_dict(...)`` as a write of the switchers' own, once per module.

        ``module`` holds the parameter: a load of the model's state dict
        (saved with the switchers' tables, which ``save``/``load`` restore)
        writes the slots in place, as a load overwrites the weight in memory,
        and is no write to refuse at the next ``before_forward``. A load with
        ``assign=True``, which would replace the parameter, is refused before
        it reaches the module (:func:`_refuse_assign`).

        Args:
            module: the module whose own parameter the switched weight is.
        """
        if id(module) not in self._load_hooks:
            ref = weakref.ref(self)
            self._load_hooks[id(module)] = (
                module.register_load_state_dict_pre_hook(ModuleHook(functools.partial(_refuse_assign, ref), self)),
                module.register_load_state_dict_post_hook(ModuleHook(functools.partial(_note_load, ref), self)))

    def take_back_scratch(self) -> None:
        """Between steps, give the parameter its slots back after ``param.data = tensor``.

        ``torch.nn.utils.vector_to_parameters`` (or an update written by hand)
        assigns the weight other memory, which torch counts as no write: the
        next step would fill it with the table's rows, and the values
        assigned would be lost. Other values than the slots hold are refused
        at the step's start (:meth:`ScratchWrites.take_back`, then
        :meth:`prepare`). In a step (SAM's ``p.data = old_p``) the step's rows
        are in the assigned memory and after_step writes them back; with no
        ModelFactory the parameter holds the user's own rows.
        """
        if self._scratch is not None and self.serving(MODEL) and not self.busy():
            self.scratch_writes.take_back(self.param, self._scratch)

    def _leave(self, kind, member):
        if self._members.get(kind) is not member:
            return  # replaced by a newer switcher of its kind
        if self.busy():
            self._abandon()
        del self._members[kind]
        self._rebuild()
        if not self._members:
            self._release()

    def _release(self):
        """Let go of the parameter once its last switcher left: it trains as any parameter again.

        A closed switcher kept alive would keep this object alive too, and with it the
        gradient hook, the step check of :func:`_check_switched_steps` (both of which
        refused in-memory training: a backward adding to the gradient an evaluation
        step found, a second ``step()``) and the last step's gradient. A switcher built
        later for the parameter starts a new one (:func:`steps_for`).
        """
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for handles in self._load_hooks.values():
            for handle in handles:
                handle.remove()
        self._load_hooks.clear()
        self._leftover = self._finished = self.current = None
        if _STEPS.get(self.param) is not None and _STEPS[self.param]() is self:
            del _STEPS[self.param]

    def _rebuild(self):
        # The old cache is flushed while the tables it serves are still open.
        if self.cache is not None:
            self.cache.flush()
            self.cache = None
        model, optimizer = self._members.get(MODEL), self._members.get(OPTIMIZER)
        if model is not None:
            states = {} if optimizer is None else optimizer.tables.tables
            self.cache = new_cache(model.cache_rows, model.tables, states, self.param.dtype)

    def _abandon(self):
        """Drop the step in progress (a switcher left in the middle of it): nothing is written back."""
        if self._open:
            self.cache.end_step()  # the cache still holds the rows as before the step
        self._open, self._states = False, _WAITING
        self.current.ended |= self.current.begun
        self.scratch_writes.note_own(self.param)  # the slots of a dropped step: the step's writes
        self._one_thread.hold(False)  # the step's claim (see begin)

    def _undo_interrupted_step(self):
        """Give the parameter its full shape back after an ``optimizer.step()`` that raised.

        The OptimizerFactory narrows it for the step; a step that raised
        (a check in another hook, say) left it narrowed until the next
        ``optimizer.step()``, and the forward and backward before that
        would see the narrowed parameter. The step's rows and state are read
        back as they were before it (see :meth:`fetch_again`).
        """
        member = self._members.get(OPTIMIZER)
        switcher = None if member is None else member.ref()
        if switcher is not None:
            switcher._abort_step()

    # ---------------------------------------------------------------- ids
    def _as_tensors(self, pos, neg):
        """``(flats, shapes, unsigned)`` of the given ids: flat int64 tensors, shapes, and which were uint64."""
        ids = (pos,) if neg is None else (pos, neg)
        converted = [as_id_tensor(i, self.param.device, what=n) for i, n in zip(ids, _NAMES)]
        return ([flat for flat, _ in converted], [shape for _, shape in converted],
                [is_uint64(i) for i in ids])

    def _bounds_check(self, flats, unsigned):
        """``check_bounds(lo, hi)`` of the concatenated ``flats``, for a read made anyway (one host wait, not two)."""
        check = bounds_check(self.num_rows, unsigned=all(unsigned))

        def named(lo, hi):
            try:
                check(lo, hi)
            except IdError:
                for flat, name, uint64 in zip(flats, _NAMES, unsigned):  # only on failure: say which ids
                    check_id_range(flat, self.num_rows, what=name, unsigned=uint64)
                raise
        return named

    # ---------------------------------------------------------------- steps
    def prepare(self, pos, neg, kind):
        """The step ``kind``'s switcher begins with these ids: the one in progress, or a new one.

        The ids are range-checked once, when a new step starts. Nothing is
        committed (see :meth:`begin`), so a later check can still refuse.

        Raises:
            IdError, DTypeError, DeviceError: bad ids.
            CapacityError: more distinct rows than the parameter has.
            StateError: a step is in progress that ``kind`` cannot join (other
                ids, or it ended its part already); in a process forked from the one
                that built the switchers, tables the two share (after ``model.share_memory()``,
                or in mmap files: see :mod:`~speedswap.train.one_process`); once, a new step
                after a write into the ModelFactory's embedding since the last step, in place
                or through ``param.data = tensor`` (:meth:`take_back_scratch`;
                :meth:`ScratchWrites.refuse_written`: it reached no row of the table).
        """
        self._one_process.refuse_shared_training(self.param, self._in_files)
        self._undo_interrupted_step()
        flats, shapes, unsigned = self._as_tensors(pos, neg)
        self._watch_gradients()  # a parameter unfrozen since the switchers were built
        if self.busy():
            step = self.current
            if step.same_ids(flats) and kind not in step.ended:
                return step
            missing = " and ".join(sorted(step.begun - step.ended))
            raise StateError(f"beforeForwardPass (before_forward) while the {missing} switcher of "
                             f"this embedding has not called afterOptimizerStep (after_step) for the "
                             f"last step; finish the step on every switcher first")
        # An optimizer.step() between steps that raised ran no post-hook: its write is still open.
        self.scratch_writes.end_own(self.param)
        if self.serving(MODEL):  # a lone OptimizerFactory's parameter holds the user's rows: theirs to write
            self.scratch_writes.refuse_written(self.param)
        ws = self.working_set
        # The slots are about to hold other rows: a gradient still on them from the last
        # step must not be added to (zero_grad() drops it, or zeroes it in place: a new version).
        grad = self.param.grad
        self._leftover = None if grad is None else (grad, grad._version)
        self._finished = None
        ws.clear()
        cached = self.cache is not None and self.cache.num_slots
        # The ids' range is checked in the working set's read, before anything reaches a row.
        local, _, hits = ws.add(torch.cat(flats) if len(flats) > 1 else flats[0],
                                self._bounds_check(flats, unsigned), self.cache.count_hits if cached else None)
        pieces = torch.split(local, [len(f) for f in flats])
        locals_ = tuple(p.view(s) for p, s in zip(pieces, shapes))
        # The fetch writes the rows through param.data, which leaves this version as it is.
        return _Step(flats, shapes, locals_, ws.rows, self._leftover, hits, ws.added_at, self.param._version)

    def begin(self, step, kind, rows):
        """Start ``kind``'s part of ``step`` (from :meth:`prepare`); the first part fetches its rows.

        From here until no switcher's part is unfinished (:meth:`end`,
        :meth:`withdraw`, a switcher closed in the middle of it) the calling
        thread holds the switchers' claim: a call from another thread raises
        (see :mod:`speedswap.train.one_thread`).

        Args:
            step: the step.
            kind: :data:`MODEL` or :data:`OPTIMIZER`.
            rows: the parameter's storage: its first ``len(step.rows)`` rows
                receive the step's rows (cached ones from the cache).
        """
        self.current = step
        if not self._open and self.cache is not None:
            k = len(step.rows)
            with torch.no_grad():
                self.cache.fetch(step.rows, rows[:k], 0, sum(len(f) for f in step.flats),
                                 hits=step.hits, picked=step.picked)
            self._open = True
        step.begun.add(kind)
        self._one_thread.hold(True)  # the step's, until it is no longer busy (withdraw, end, _abandon)

    def withdraw(self, step, kind):
        """Undo :meth:`begin` of a ``before_forward`` that raised after it."""
        step.begun.discard(kind)
        if not step.begun:
            self._abandon()

    def fetch_again(self, step, rows):
        """Read ``step``'s rows into the parameter again after an ``optimizer.step()`` that raised.

        The step stored nothing, so the cache and the host tables still hold
        its rows as before it: what the failed step changed in place is read
        back from them, and the retried step trains the rows once. Its state
        rows are then read again through :meth:`read_state`, whose cache reads
        follow this fetch. Without a ModelFactory (no cache) the parameter's
        rows are the caller's: nothing is read.

        Args:
            step: the step in progress.
            rows: the parameter's full storage (its first ``len(step.rows)`` rows receive them).
        """
        if not self._open:
            return
        self.cache.restart_step()
        with torch.no_grad():
            self.cache.fetch(step.rows, rows[:len(step.rows)], 0, 0, again=True)

    def read_state(self):
        """What fills the optimizer's state views for :meth:`RowState.gather`: the cache, or None (the tables)."""
        return None if self.cache is None else self.cache.read_state

    def match(self, pos, neg, who):
        """The current step, which must have been started with exactly these ids.

        Raises:
            StateError: no step begun yet, or other ids (nothing is written back).
        """
        self._undo_interrupted_step()
        flats, _, _ = self._as_tensors(pos, neg)
        if self.current is None:
            raise StateError(f"{who}.afterOptimizerStep (after_step) before any beforeForwardPass "
                             f"(before_forward): a step begins with beforeForwardPass(ids), then the "
                             f"forward, backward and optimizer.step(), then afterOptimizerStep(ids) "
                             f"(nothing was written back)")
        if not self.current.same_ids(flats):
            raise StateError(f"{who}.afterOptimizerStep (after_step) got ids other than those of the "
                             f"last beforeForwardPass (before_forward); pass the same pos (and neg) ids "
                             f"to both, in the same order (nothing was written back)")
        return self.current

    def end(self, step, kind, rows):
        """End ``kind``'s part of ``step``; the model's part stores the step's rows and state.

        The store is the model's: its rows are final when its ``after_step``
        says so. Only in a step the model's switcher took no part in does the
        optimizer's part store them.

        Args:
            step: the step in progress, begun by ``kind``.
            kind: :data:`MODEL` or :data:`OPTIMIZER`.
            rows: the parameter's storage (the step's updated rows are its
                first ``len(step.rows)``).

        Raises:
            StateError: the optimizer's state does not have the names expected
                (see :meth:`RowState.scatter`), or the step's gradient was
                never stepped (see :meth:`_check_stepped`); nothing is written.
        """
        if not step.ended:  # the first after_step: the step's rows are still as the optimizer left them
            self._check_stepped(step)
        if kind == OPTIMIZER:
            state = self._members[OPTIMIZER].tables
            if self.cache is None:
                state.scatter(step.rows)  # no table, no cache: straight to the state tables
            elif self._open:
                state.scatter(step.rows, write=self._hand_over)
        if self._open and (kind == MODEL or MODEL not in step.begun):
            self.cache.store(step.rows, rows[:len(step.rows)], self._states_of(step))
            self._open, self._states = False, _WAITING
        step.ended.add(kind)
        if not step.unfinished():
            self.scratch_writes.note_own(self.param)  # in a step the slots are its rows: its writes
            grad = self.param.grad
            self._finished = None if grad is None else (grad, grad._version)
            self._one_thread.hold(False)

    def rows_in_step(self):
        """``(rows, values)`` of the step in progress, or None between steps.

        Between ``before_forward`` and the last ``after_step`` the step's rows
        are current in the parameter's first ``len(rows)`` slots, not in the
        host table or the cache: ``optimizer.step()`` updated them there, and
        ``after_step`` writes them back. A read of the whole table in that
        window puts these over the stored rows, as an in-memory table holds
        the stepped rows once ``optimizer.step()`` returned.

        Returns:
            None, or the step's table ids (1-D int64) and a detached view of
            their slots (``(len(rows), dim)``, on the parameter's device).
        """
        if not self.busy():
            return None
        rows = self.current.rows
        return rows, self.param.detach()[:len(rows)]

    def refuse_stepping_between_steps(self, optimizer) -> None:
        """Raise before an ``optimizer.step()`` between steps with a gradient on the parameter.

        Between steps the slots hold no row the step would write back: none of
        the table before the first ``before_forward``, and the last step's
        rows, written back already, after its ``after_step``. A gradient
        there is either the last step's, still untouched (``step()`` twice,
        or no ``zero_grad()`` after a step: the step would move only the
        slots and count one more step in the optimizer's scalar state, Adam's
        ``step``, for every row), or one from a forward that no
        ``before_forward`` began (forgotten, or over a ModelFactory built on
        the weight Parameter, whose forwards are not checked): its update
        would be lost, the first step's included. A gradient of zeros
        (``zero_grad(set_to_none=False)``) moves no row and passes; so does
        SpeedTorch's Rprop recipe, a forward and backward before the
        OptimizerFactory is built with no ``step()`` until the first step.

        Raises:
            StateError: such a gradient; nothing has changed.
        """
        grad = self.param.grad
        # A host synchronisation, but only for a step() outside a step, which a right loop never makes.
        if self.busy() or grad is None or not bool(_values(grad).any()):
            return
        name = type(optimizer).__name__
        if self._finished is not None and untouched(grad, *self._finished):
            raise StateError(f"{name}.step() after afterOptimizerStep (after_step) with the step's "
                             f"gradient still on the embedding (step() twice, or no zero_grad() after "
                             f"a step): afterOptimizerStep wrote the step's rows back, so this step "
                             f"would move only the slots, which hold no row now, and count one more "
                             f"step in the optimizer's state. Nothing was changed: call "
                             f"optimizer.zero_grad() after each step, and optimizer.step() once, "
                             f"between loss.backward() and afterOptimizerStep")
        held = "the last step's rows, written back already" if self.current is not None else \
            "no rows of the table yet"
        raise StateError(f"{name}.step() with a gradient on the embedding from a forward that no "
                         f"beforeForwardPass (before_forward) began: its slots hold {held}, so this "
                         f"update would reach no row of the table. Nothing was changed: begin each "
                         f"step with beforeForwardPass(ids) on every switcher and feed the model the "
                         f"local ids it returns, then loss.backward(), optimizer.step() and "
                         f"afterOptimizerStep(ids); to drop this gradient, call optimizer.zero_grad()")

    def _check_stepped(self, step):
        """Raise when a backward of ``step`` left a gradient no optimizer.step() applied.

        after_step would write the rows back untrained and the next
        before_forward would drop the gradient with their slots: a forgotten
        ``optimizer.step()`` (or one placed after after_step) trained nothing,
        silently. Steps that rightly apply no gradient pass: a forward without
        backward (evaluation), a gradient dropped with ``zero_grad()``, and a
        step skipped for a non-finite gradient in any of the optimizer's
        parameters (``torch.amp.GradScaler`` skips ``optimizer.step()`` then).
        Without an OptimizerFactory the optimizer is unknown, and so is
        whether a step was skipped for that reason: nothing is checked.

        Raises:
            StateError: such a gradient, before anything is written back.
        """
        member = self._members.get(OPTIMIZER)
        grad = self.param.grad
        if step.stepped or member is None or member.ref() is None or grad is None:
            return
        if step.grad is not None and step.grad[0] is grad and step.grad[1] == grad._version:
            return  # no backward since before_forward
        # Host synchronisations, but only in a step that no optimizer.step() finished.
        if not bool(_values(grad).any()):
            return  # zeroed in place: zero_grad(set_to_none=False)
        optimizer = member.tables.optimizer
        if any(p.grad is not None and not bool(torch.isfinite(_values(p.grad)).all())
               for group in optimizer.param_groups for p in group["params"]):
            return
        raise StateError(
            f"afterOptimizerStep (after_step) without {type(optimizer).__name__}.step(): this step's "
            f"backward left a gradient on the embedding's rows that no optimizer.step() applied, so "
            f"afterOptimizerStep would write them back untrained and the next beforeForwardPass would "
            f"drop the gradient. Call optimizer.step() between loss.backward() and "
            f"afterOptimizerStep(ids) on the switchers; to skip this step's update on purpose, call "
            f"optimizer.zero_grad() before afterOptimizerStep (nothing was written back)")

    def _hand_over(self, states):
        self._states = states

    def _states_of(self, step):
        """The optimizer state rows the store writes with the step's rows."""
        optimizer = self._members.get(OPTIMIZER)
        if OPTIMIZER in step.begun:
            if self._states is _WAITING:  # its after_step comes later: take them now
                optimizer.tables.scatter(step.rows, write=self._hand_over)
            return self._states
        # No offloaded optimizer state took part: cached state rows stay as they are,
        # and rows that miss go back to the host (their state there is current).
        return None if optimizer is not None and optimizer.tables.tables else {}

    # -------------------------------------------------------------- the cache
    def prefetch(self, pos, neg) -> int:
        """Start bringing the rows of ids ``pos`` (and ``neg``) and their state into the cache.

        Returns:
            the number of rows brought from the host.

        Raises:
            IdError, DTypeError, DeviceError: bad ids (nothing changes).
        """
        flats, _, unsigned = self._as_tensors(pos, neg)
        ids = torch.cat(flats) if len(flats) > 1 else flats[0]
        if self.cache is None:
            if len(ids):  # nothing to bring, but the caller still learns of bad ids
                self._bounds_check(flats, unsigned)(*read_bounds(ids))
            return 0
        # Rows of a step in progress are skipped (see RowCache.prefetch).
        in_step = (self.working_set.holds if self._open
                   else lambda rows: torch.zeros_like(rows, dtype=torch.bool))
        with torch.no_grad():
            return self.cache.prefetch(ids, in_step, self._bounds_check(flats, unsigned))

    def flush(self) -> None:
        """Write cached rows and state back to the host tables (they stay cached)."""
        if self.cache is not None:
            self.cache.flush()

    def rewriting(self):
        """A context for a call that replaces rows or state in the host tables (see :func:`rewriting`)."""
        return rewriting(self.cache)

    def hand_out(self, what: str) -> None:
        """Make the host table current before ``what`` hands out its memory; uncached between steps.

        Between steps every row is afterwards read from the host again, so
        writes through the memory handed out are seen by the next step. In a
        step, before its rows changed (see :meth:`tables_behind`), the cache
        keeps its rows, the step's in flight until after_step stores them:
        writes through the tables' methods are refused until then, and a view
        handed out makes the cache give up its other rows at its next lookup.

        Raises:
            StateError: the tables are behind the step (see :meth:`refuse_stale`).
        """
        self.refuse_stale(what)
        if self.cache is None:
            return
        self.cache.flush()
        if not self._open:
            self.cache.invalidate()

    def tables_behind(self) -> bool:
        """Whether the tables hold the step's rows or their state as before changes made since it began.

        From an ``optimizer.step()`` over the parameter (marked by
        :func:`_check_switched_steps` as it begins, or once its closure
        returned: the optimizer changes no row before), or with a ModelFactory an in-place
        write into the parameter (``nn.Embedding(max_norm=...)`` renormalises
        the rows its forward looks up), until the step's rows are stored (the
        ModelFactory's after_step; a lone OptimizerFactory's). Before that the
        step's rows in the parameter and the optimizer are those read from the
        tables, which (once a cache wrote its rows back) hold what memory holds.
        A write through ``param.data`` changes no version and goes unseen
        (between steps, ``param.data = tensor`` is refused: :meth:`take_back_scratch`).
        """
        step = self.current
        if step is None or not step.unfinished():
            return False
        if self.cache is None:  # no ModelFactory: only the state tables, which only the step changes
            return step.stepping
        return self._open and (step.stepping or self.param._version != step.version)

    def refuse_stale(self, what: str) -> None:
        """Raise before ``what`` hands out or reads the host tables while they are behind the step.

        Raises:
            StateError: :meth:`tables_behind`: the step's rows and their state
                are current only in the model's embedding and the optimizer
                (and cached, with a cache) until after_step writes them back.
        """
        if not self.tables_behind():
            return
        if self.current.stepping:
            since = before = "optimizer.step()"
            changed = ("this step's rows and their optimizer state changed in the model's embedding "
                       "and the optimizer")
        else:
            # No optimizer.step() seen (one with a closure is seen once its closure returned): the
            # parameter's version tells only that something wrote the rows in place, not what.
            since = ("an in-place write into the model's embedding since beforeForwardPass (the "
                     "renormalisation of an nn.Embedding(max_norm=...) forward, an update written by hand "
                     "such as weight.sub_(...) under torch.no_grad(), or an optimizer.step(closure) that "
                     "changed the rows before calling its closure)")
            before = "that write"
            changed = "this step's rows changed in the model's embedding"
        raise StateError(f"{what} after {since} and before afterOptimizerStep: {changed}, "
                         f"and the tables show them as before until the ModelFactory's "
                         f"afterOptimizerStep writes them back; call afterOptimizerStep first, or read "
                         f"before {before} (for the rows now, ModelFactory.getNumpyVersion() "
                         f"copies the table with the step's rows as they are; their optimizer state, "
                         f"with an OptimizerFactory, is optimizer.state[weight][name] at the local ids "
                         f"ModelFactory.before_forward returned, weight being the model's embedding weight)")

    def stats(self, cache_rows: int) -> dict:
        """The cache's counters (see :meth:`RowCache.stats`), all zero without a cache."""
        return idle_stats(cache_rows) if self.cache is None else self.cache.stats()


def _values(grad):
    """The stored values of a gradient, dense or sparse (``nn.Embedding(sparse=True)``)."""
    return grad.coalesce().values() if grad.is_sparse else grad


#: param -> weak reference to its SharedSteps: an entry lives as long as a
#: switcher of the parameter does, so dropping every switcher frees the size.
_STEPS = WeakIdKeyDictionary()


def _keeps_row_state(optimizer, param) -> bool:
    """Whether ``optimizer`` keeps state per element of ``param`` (Adam's moments, SGD's momentum, LBFGS's history)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        # Its history spans every element of its parameters, flattened: shaped like none of them,
        # and none yet at the first step, which the state's shapes below would let through.
        return True
    try:
        return bool(row_state_spec(optimizer, param))
    except OptionError:  # a class speedswap does not know: judge by the state it has made
        state = optimizer.state.get(param, {})
        return any(isinstance(v, torch.Tensor) and v.shape == param.shape for v in state.values())


def _row_state_instead(optimizer, param) -> str:
    """What to do instead of stepping a ModelFactory alone with ``optimizer``, which keeps per-row state."""
    try:
        row_state_spec(optimizer, param)
    except OptionError:  # LBFGS, or a class speedswap does not know: an OptimizerFactory refuses it too
        return (f"An OptimizerFactory cannot switch {type(optimizer).__name__}'s state either (speedswap "
                f"moves the state of the element-wise optimizers it knows only): step the embedding "
                f"with such an element-wise optimizer and an OptimizerFactory, or with SGD without "
                f"momentum (stateless), and the model's other parameters with "
                f"{type(optimizer).__name__}")
    return ("Build an OptimizerFactory(optimizer, ...) for this embedding too (it switches the state "
            "rows with the embedding's), or use a stateless optimizer (SGD without momentum)")


def _check_switched_steps(optimizer, args, kwargs):
    """A global optimizer step pre-hook: refuse stepping a switched embedding's slots wrongly.

    The ModelFactory's slots hold other rows every step, so without an
    OptimizerFactory swapping the state rows with them, Adam's moments (or
    SGD's momentum) of one row would move another; and between steps they
    hold no row, so a step there with a gradient on them is refused
    (:meth:`SharedSteps.refuse_stepping_between_steps`). A step let through marks the
    switchers' step as stepping: from here the tables are behind its rows
    (:meth:`SharedSteps.tables_behind`). With a closure
    (``optimizer.step(closure)``) both come after it returned, as the
    step's narrowing does (:mod:`~speedswap.train.step_hooks`): its forward
    and backward make the gradient looked at, and until it returns the
    optimizer has changed no row, so reads inside it show what memory does.
    """
    closure, replace = closure_of(args, kwargs)
    if closure is None:
        _check_switched_params(optimizer)
        return None

    def closure_then_check():
        loss = closure()
        _check_switched_params(optimizer)
        return loss

    return replace(closure_then_check)


def _check_switched_params(optimizer):
    """:func:`_check_switched_steps`'s checks and mark, once ``optimizer``'s gradients are the step's.

    Only parameters with a switcher and a gradient are looked at, so other
    optimizers pay one loop over a near-empty dictionary.

    Raises:
        OptionError, StateError: as :func:`_check_switched_steps`; nothing has changed.
    """
    # A snapshot in one C call, as one_optimizer's hook takes: a switcher built or collected
    # meanwhile (another thread, a finalizer run by a collection inside the loop) would
    # otherwise change the dictionary under the loop.
    for key, ref in _STEPS.data.copy().items():
        param, steps = key(), ref()
        if param is None or steps is None or param.grad is None:
            continue  # torch skips a parameter without a gradient
        if not any(p is param for group in optimizer.param_groups for p in group["params"]):
            continue
        with steps._one_thread:  # a step on another thread than the step's is refused, unmarked
            if not steps.busy():
                steps.refuse_stepping_between_steps(optimizer)
                # A zero gradient: the step may write the slots (Adam's moments, weight decay), which
                # hold no row; its write is the switchers' own (_note_switched_steps ends it). One such
                # step that raised ran no post-hook: its write, the optimizer's too, ends here.
                steps.scratch_writes.end_own(param)
                steps.scratch_writes.begin_own(param)
                continue
            if steps.alone(MODEL) and _keeps_row_state(optimizer, param):
                raise OptionError(
                    f"{type(optimizer).__name__} keeps state per row of the embedding, but only a "
                    f"ModelFactory switches its rows: each step's slots hold other rows, so one row's "
                    f"state would move another. {_row_state_instead(optimizer, param)}")
            steps.current.stepping = True  # the tables fall behind the step's rows (tables_behind)


def _note_switched_steps(optimizer, args, kwargs):
    """A global optimizer step post-hook: end the own writes :func:`_check_switched_params` began between steps.

    A step that raised runs no post-hook: the next step's pre-hook, or the
    next ``before_forward``, ends its write.
    """
    for key, ref in _STEPS.data.copy().items():  # a snapshot, as in _check_switched_params
        param, steps = key(), ref()
        if param is None or steps is None or steps.busy():
            continue
        if any(p is param for group in optimizer.param_groups for p in group["params"]):
            steps.scratch_writes.end_own(param)


def _refuse_assign(ref, module, state_dict, prefix, local_metadata, *_):
    """A load_state_dict pre-hook (see :meth:`SharedSteps.watch_loads`): refuse replacing the switched weight.

    Raises:
        OptionError: ``load_state_dict(..., assign=True)`` of a state dict holding the weight; the
            module and those under it are left as they were (modules loaded before it in the
            model were loaded).
    """
    steps = ref()
    if steps is None or not local_metadata.get("assign_to_params_buffers", False):
        return
    name = next((n for n, p in module.named_parameters(recurse=False) if p is steps.param), None)
    if name is None or prefix + name not in state_dict:
        return
    # torch writes the flag into the state dict's own _metadata and never takes it back: a retry
    # of the same state dict with assign=False would be taken as assign=True again.
    local_metadata.pop("assign_to_params_buffers")
    raise OptionError(
        f"model.load_state_dict(..., assign=True) would replace the model's embedding weight "
        f"{prefix + name!r} with the state dict's tensor, but speedswap's switchers (and the optimizer) "
        f"hold this Parameter: they would fill and step the old one, which the model no longer reads. "
        f"The embedding was not loaded (modules before it in the model were): load with assign=False "
        f"(the default), which copies into the embedding's slots (the switchers' loadCupy restores "
        f"the table), or close() its switchers, load, and build them again")


def _note_load(ref, module, incompatible_keys):
    """A load_state_dict post-hook (see :meth:`SharedSteps.watch_loads`): the load's write is the switchers'."""
    steps = ref()
    if steps is not None:
        steps.scratch_writes.note_own(steps.param)


def _written(how: str) -> StateError:
    """The refusal of a write into the ModelFactory's embedding between steps (see :class:`ScratchWrites`)."""
    return StateError(
        f"the model's embedding weight, switched by a ModelFactory, was written {how}, but between steps "
        f"its slots hold no row of the table (beforeForwardPass fills them with the step's rows): the "
        f"table was not changed, and nothing was. Write the table instead, between steps: "
        f"u_switch.normalDistributionInit(mean, std), u_switch.uniformDistributionInit(low, high), "
        f"u_switch.customInit(fn), u_switch.table.apply_(torch.nn.init.normal_, std=0.01), "
        f"u_switch.loadCupy(path); skip the embedding's weight in loops that initialise every parameter "
        f"(model.load_state_dict(...) is accepted once a ModelFactory was given the nn.Embedding, or an "
        f"OptimizerFactory the model, not the bare weight). The next beforeForwardPass goes on")


def _copied() -> StateError:
    """The refusal of a copy of a model whose embedding a ModelFactory switches (see :class:`ModuleHook`)."""
    return StateError(
        "a model whose nn.Embedding a ModelFactory switches cannot be deep-copied or pickled: the "
        "embedding holds only the slots of a step's rows (stale rows between steps), while the table "
        "lives in the switcher's host memory, so a copy (copy.deepcopy, an EMA copy, "
        "torch.optim.swa_utils.AveragedModel) would hold, and average, those slots. Average the other "
        "modules alone (AveragedModel(model.head)); for a copy of the whole model, build it with an "
        "nn.Embedding of every row and copy the table in (nn.Embedding.from_pretrained("
        "torch.from_numpy(u_switch.getNumpyVersion()), freeze=False)); checkpoint with "
        "torch.save(model.state_dict()) and u_switch.saveCupy(path). If this came from "
        "torch.save(model, path), torch had opened path first and left it truncated")


#: The handles of :func:`_check_switched_steps` and :func:`_note_switched_steps`, registered when the
#: first switcher joins.
_SWITCHED_STEPS_HOOK = []


def _watch_optimizer_steps():
    if not _SWITCHED_STEPS_HOOK:
        _SWITCHED_STEPS_HOOK.append(register_optimizer_step_pre_hook(_check_switched_steps))
        _SWITCHED_STEPS_HOOK.append(register_optimizer_step_post_hook(_note_switched_steps))


def steps_for(param: torch.nn.Parameter, num_rows: int) -> SharedSteps:
    """The :class:`SharedSteps` of ``param``, found by identity, or a new unregistered one.

    A new one is registered by :meth:`SharedSteps.join` once its switcher is
    built, so a constructor that fails later leaves nothing behind.

    Raises:
        OptionError: a live switcher of ``param`` was built for another table size.
    """
    ref = _STEPS.get(param)
    steps = None if ref is None else ref()
    if steps is None:
        return SharedSteps(param, num_rows)
    if steps.num_rows != num_rows:
        raise OptionError(f"this parameter already has a switcher over {steps.num_rows}"
                          f" rows; every switcher of one parameter needs the same total_classes")
    return steps
