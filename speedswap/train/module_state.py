"""An offloaded embedding's tables in ``nn.Module.state_dict()``: its ``_extra_state``.

``torch.save(model.state_dict())`` and ``model.load_state_dict(...)`` are the
checkpoint every training loop (Lightning, the Hugging Face Trainer) makes.
An offloaded embedding's parameter :attr:`weight` is only the step's working
set, so the table and the optimizer's per-row state travel in the module's
extra state (``get_extra_state`` / ``set_extra_state``, which torch stores
under ``<prefix>_extra_state``):

* :func:`tables_state` gives the tables as tensors over the host tables'
  own memory (no copy; the GPU tensor of a ``device`` table), as
  ``state_dict()`` gives a parameter's own storage, plus what a load checks;
* :func:`check_tables_state` validates a state against the tables it would
  replace and raises before anything changes;
* :func:`copy_tables` then writes the values in.

The owner brackets the copy as for any load (cache written back, then
invalidated; the optimizer's per-row state marked as restored).

``model.load_state_dict`` over several embeddings is not all or nothing:
torch loads module by module, and no module sees another's entries, so an
embedding whose state is refused cannot undo those loaded before it.
:func:`note_loaded` and :func:`refused_after` make its refusal name them;
:func:`check_state_dict`, called first, checks every entry (the embeddings'
and those torch loads itself), so that nothing loads unless all will. An
embedding cannot wait for the whole load to succeed before it writes its
tables: torch raises for another module's entry (or, under ``strict``, a
missing or unexpected key) only after every module loaded, runs no hook
after that (a module's load post-hooks run once its own part is loaded), and
passes each ``_load_from_state_dict`` ``strict=True`` whatever the call's.
"""

import copy
import numbers
import threading
from collections.abc import Mapping
from typing import Optional

import torch

from ..errors import DTypeError, FileFormatError, OptionError, ShapeError, SpeedswapError, StateError
from ..table import HostTable, loading_into

__all__ = ["FORMAT", "VERSION", "SCALAR_STATE", "tables_state", "check_tables_state", "checked_scalar_state",
           "check_state_dict",
           "copy_tables", "in_memory_state_dict", "missing_hint", "note_loaded", "refused_after", "rows_only",
           "unpicklable"]

FORMAT = "speedswap-module-state"
VERSION = 1
#: The entry holding the optimizer's scalar state for the table (its step count), as
#: :meth:`RowState.scalar_state` gives it; a state of an older speedswap has none.
SCALAR_STATE = "optimizer_scalar_state"


def checked_scalar_state(state: Mapping, row_state) -> Optional[dict]:
    """The optimizer's scalar state a :func:`tables_state` holds, checked for ``row_state`` (None without one).

    Returns:
        what :meth:`RowState.restore_scalar_state` takes: None for a state of an
        older speedswap, or when no optimizer is attached (``row_state`` None).

    Raises:
        FileFormatError: a damaged record (:meth:`RowState.check_scalar_state`).
    """
    return None if row_state is None else row_state.check_scalar_state(state.get(SCALAR_STATE), "the state dict")


def tables_state(kind: str, tables: dict, optimizer: str, num_embeddings: int,
                 scalar_state: Optional[dict] = None, **layout) -> dict:
    """The extra state of an embedding: its tables as zero-copy tensors and what a load checks.

    Args:
        kind: the module's class name; a state loads only into the same kind.
        tables: ``{name: HostTable}``: ``"table"`` and ``"optimizer.<state>"``.
        optimizer: the attached optimizer's class name, ``""`` when none is.
        num_embeddings: rows of the whole table (a shard's tables hold fewer).
        scalar_state: the attached optimizer's scalar state for the table
            (:meth:`~speedswap.train.row_state.RowState.scalar_state`), kept
            under :data:`SCALAR_STATE` for the owner's load to check and restore.
        layout: integers (or tuples of them) a load must match exactly
            (a shard's rank, world size and rows).

    Returns:
        a dict of strings, integers and tensors (``torch.load(weights_only=True)`` reads it).
        The tensors share the tables' memory: serialise the state (or clone
        it) before training on, as with any ``state_dict()``.
    """
    first = tables["table"]
    return {"format": FORMAT, "version": VERSION, "kind": kind,
            "num_embeddings": num_embeddings,
            "embedding_dim": first.dim, "dtype": str(first.dtype).replace("torch.", ""),
            "optimizer": optimizer, **layout,
            **({} if scalar_state is None else {SCALAR_STATE: scalar_state}),
            "tables": {name: t.as_tensor().detach() for name, t in tables.items()}}


def _describe(kind, state):
    return (f"the state dict's {kind} ({state.get('num_embeddings')} x {state.get('embedding_dim')} "
            f"{state.get('dtype')})")


def check_tables_state(state, kind: str, tables: dict, optimizer: str, num_embeddings: int,
                       **layout) -> dict:
    """Check ``state`` (from :func:`tables_state`) against ``tables``; raise before anything changes.

    Args:
        state: what ``state_dict()`` held under ``<prefix>_extra_state``.
        kind, optimizer, num_embeddings, layout: as given to :func:`tables_state` by the embedding loading it.
        tables: ``{name: HostTable}`` it would replace.

    Returns:
        ``{name: tensor}`` to copy into ``tables``, one per table.

    Raises:
        FileFormatError: not such a state, a newer format, another kind,
            layout or optimizer (optimizer state saved but none attached here,
            or the reverse: refused as ``emb.load`` refuses them; see :func:`rows_only`),
            or a table tensor without dense values (meta, sparse).
        ShapeError: another table size.
        DTypeError: another dtype.
    """
    if not isinstance(state, Mapping) or not _is_plain(state.get("format")) or state.get("format") != FORMAT:
        raise FileFormatError(f"the state dict's {kind} entry is not a speedswap table state "
                              f"(got {type(state).__name__}); load a state dict that "
                              f"{kind}.state_dict() returned")
    odd = sorted(str(key) for key, value in state.items() if key != "tables" and not _is_plain(value))
    if odd:  # an array there would compare element-wise below, and raise numpy's ValueError
        raise FileFormatError(f"the state dict's {kind} entry holds {', '.join(odd)} that are not plain "
                              f"numbers or names (an array or tensor, say): it was changed after "
                              f"{kind}.state_dict() made it; load a state dict as state_dict() returned it")
    if not isinstance(state.get("version"), int) or state["version"] > VERSION:
        raise FileFormatError(f"the state dict's {kind} table was written in format version "
                              f"{state.get('version')!r}, newer than this speedswap's {VERSION}; "
                              f"upgrade speedswap to load it")
    if state.get("kind") != kind:
        raise FileFormatError(f"the state dict holds a {state.get('kind')}'s table, not a {kind}'s; "
                              f"load it into a {state.get('kind')} (or move it with its save and load)")
    first = tables["table"]
    if (state.get("num_embeddings"), state.get("embedding_dim")) != (num_embeddings, first.dim):
        raise ShapeError(f"{_describe(kind, state)} does not fit this one, "
                         f"{num_embeddings} x {first.dim}: build it with "
                         f"num_embeddings={state.get('num_embeddings')}, "
                         f"embedding_dim={state.get('embedding_dim')} to load it")
    dtype = str(first.dtype).replace("torch.", "")
    if state.get("dtype") != dtype:
        raise DTypeError(f"{_describe(kind, state)} holds {state.get('dtype')} rows, this one "
                         f"{dtype}; build it with dtype=torch.{state.get('dtype')} to load it")
    for key, value in layout.items():
        if _plain(state.get(key)) != _plain(value):
            raise FileFormatError(f"{_describe(kind, state)} was saved with {key}={_plain(state.get(key))!r}, "
                                  f"this one has {key}={_plain(value)!r}; a state dict restores only "
                                  f"the layout that saved it: to load it at another world size, save "
                                  f"with emb.save(dir) and restore with emb.load(dir), which reshards "
                                  f"(and drop the '_extra_state' entries from the state dict)")
    saved = state.get("optimizer")
    values = state.get("tables")
    if not isinstance(values, Mapping) or "table" not in values:
        raise FileFormatError(f"{_describe(kind, state)} holds no 'table' tensor; it is damaged")
    if saved != optimizer:
        if not saved:
            raise FileFormatError(
                f"{_describe(kind, state)} holds no optimizer state (it was saved before attach), "
                f"but {optimizer} is attached here: load it before attach(optimizer), which starts "
                f"fresh state")
        attached = f"{optimizer} is attached here" if optimizer else "no optimizer is attached here"
        raise FileFormatError(
            f"{_describe(kind, state)} holds {saved} optimizer state, but {attached}: attach a "
            f"torch.optim.{saved} first to resume training (rows and optimizer state are restored "
            f"together); to load the rows alone (evaluation), load "
            f"speedswap.train.module_state.rows_only(state_dict) instead")
    if set(values) != set(tables):
        raise FileFormatError(f"{_describe(kind, state)} holds tables {sorted(values)}, expected "
                              f"{sorted(tables)}: the {optimizer} attached here keeps other per-row "
                              f"state (another amsgrad, momentum...); build it as the one that saved")
    for name, value in values.items():
        table = tables[name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != table.shape \
                or value.dtype != table.dtype:
            got = (f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor)
                   else f"a {type(value).__name__}")
            raise FileFormatError(f"{_describe(kind, state)}: {name!r} is {got}, expected "
                                  f"{table.shape} {table.dtype}; the state dict is damaged")
        # copy_ raises for these only when it reaches them, after the tables before them changed.
        if value.layout != torch.strided or value.is_meta:
            got = "a meta tensor" if value.is_meta else f"a {value.layout} tensor"
            raise FileFormatError(f"{_describe(kind, state)}: {name!r} is {got}, which holds no "
                                  f"dense values to load; load a state dict whose tensors hold "
                                  f"the values (torch.load it without map_location='meta')")
    return dict(values)


def check_state_dict(model: torch.nn.Module, state_dict: Mapping, strict: bool = True) -> None:
    """Check ``state_dict`` against ``model`` as ``model.load_state_dict`` would, changing nothing.

    ``model.load_state_dict`` loads module by module: a state dict that fits
    the first embedding and not the second replaces the first's table before
    the second refuses, and one whose entry of a later module (a ``Linear``'s
    weight of another shape) torch refuses has replaced every table before
    it. Checked first, a load is all or nothing for the tables. It checks
    what each embedding's own load checks (sizes, dtype, optimizer, format,
    and no step in flight; a shard's rank and world size), for every submodule
    that can (:class:`~speedswap.OffloadedEmbedding`, :class:`~speedswap.ShardedOffloadedEmbedding`:
    through their ``_check_extra_state``),
    and what torch refuses of the other entries: a parameter or buffer
    entry of another shape, or not a tensor, and under ``strict`` missing
    or unexpected keys (those of a module with a load of its own, as
    BatchNorm's, which adds entries old checkpoints lack, are left to it).

    >>> check_state_dict(model, state); model.load_state_dict(state)  # doctest: +SKIP

    Args:
        model: the module ``state_dict`` is to be loaded into.
        state_dict: what ``model.state_dict()`` returned (or ``torch.load`` read).
        strict: as ``model.load_state_dict`` will be called.

    Raises:
        ShapeError, DTypeError, FileFormatError, StateError: as the
            embedding's ``load_state_dict``, the message naming its entry.
        ShapeError: a parameter or buffer entry torch would refuse for its shape.
        FileFormatError: an entry that is not a tensor, or under ``strict``
            missing or unexpected keys (each named).
    """
    scratch = set()  # the embeddings' working-set weights, which their load skips (given or not)
    for name, module in model.named_modules():
        check = getattr(module, "_check_extra_state", None)
        prefix = f"{name}." if name else ""
        if check is None:
            continue
        scratch.add(prefix + "weight")
        if prefix + "_extra_state" not in state_dict:
            continue
        try:
            check(state_dict[prefix + "_extra_state"])
        except SpeedswapError as exc:
            raise type(exc)(f"{prefix + '_extra_state'!r}: {exc}; nothing was loaded") from exc
    _check_torch_entries(model, state_dict, strict, scratch)


def _check_torch_entries(model, state_dict, strict, scratch):
    """Raise what ``model.load_state_dict`` would refuse of the entries torch loads itself.

    As :func:`check_state_dict` says; ``scratch`` are the keys whose shapes no load checks.
    The entries of a module with a load of its own are left to the load: a
    ``_load_from_state_dict`` override or a load pre-hook may add, rename or
    reshape them (BatchNorm adds the ``num_batches_tracked`` old checkpoints lack).
    """
    owners = {f"{name}." if name else "": module for name, module in model.named_modules()}
    own = model.state_dict(keep_vars=True)
    refused, odd, missing = [], [], []
    for key, value in own.items():
        if not _loads_by_torch_rules(_owner(key, owners)):
            continue
        if key not in state_dict:
            missing.append(key)
            continue
        if key in scratch or key == "_extra_state" or key.endswith("._extra_state"):
            continue  # extra state is checked by its module (or handed to it unchecked, as torch does)
        given = state_dict[key]
        if not torch.overrides.is_tensor_like(given):
            odd.append(f"{key!r} is a {type(given).__name__}, not a tensor")
        elif not torch.nn.parameter.is_lazy(value) and tuple(given.shape) != tuple(value.shape) \
                and not (value.dim() == 0 and tuple(given.shape) == (1,)):  # torch takes a 1-element one
            refused.append(f"{key!r} is {tuple(given.shape)}, the model's {tuple(value.shape)}")
    unexpected = [key for key in state_dict if key not in own and key not in scratch
                  and _loads_by_torch_rules(_owner(key, owners))]
    problems = refused + odd + ([f"missing {', '.join(map(repr, missing))}"] if strict and missing else []) \
        + ([f"unexpected {', '.join(map(repr, unexpected))}"] if strict and unexpected else [])
    if problems:
        error = ShapeError if refused else FileFormatError
        raise error(f"model.load_state_dict would raise for this state dict after loading every entry it "
                    f"takes (offloaded tables too): {'; '.join(problems)}. Nothing was loaded: "
                    f"load a state dict saved from a model built as this one"
                    + ("" if refused or odd else ", or load with strict=False"))


def _owner(key: str, owners: dict) -> torch.nn.Module:
    """The innermost module of ``owners`` (``{prefix: module}``) whose prefix ``key`` starts with."""
    parts = key.split(".")[:-1]
    while parts and ".".join(parts) + "." not in owners:
        parts.pop()
    return owners[".".join(parts) + "." if parts else ""]


def _loads_by_torch_rules(module: torch.nn.Module) -> bool:
    """Whether torch's own rules decide which of ``module``'s entries load (speedswap's embeddings' too)."""
    return not module._load_state_dict_pre_hooks and (
        type(module)._load_from_state_dict is torch.nn.Module._load_from_state_dict
        or hasattr(module, "_check_extra_state"))


def copy_tables(values: dict, tables: dict) -> None:
    """Write checked values (from :func:`check_tables_state`) into their tables, chunk by chunk.

    A copy stopped midway (Ctrl-C, out of memory) leaves some tables loaded
    and others not: every table then refuses use until a load completes, as
    after a stopped :meth:`~speedswap.HostTable.load_from` (:func:`~speedswap.table.loading_into`).

    Args:
        values: ``{name: tensor}`` shaped and typed as the tables (any device).
        tables: ``{name: HostTable}``.
    """
    with loading_into(tables.values(), "state_dict"):
        for name, value in values.items():
            table: HostTable = tables[name]
            table.apply_(lambda t, v=value: t.copy_(v))


#: This thread's latest ``load_state_dict`` call (``load``: the ``error_msgs`` list torch hands every
#: module of one call) and the prefixes of the embeddings whose tables it replaced.
_LOADS = threading.local()


def note_loaded(load: list, prefix: str) -> None:
    """Record that the ``load_state_dict`` call ``load`` replaced the tables of the embedding at ``prefix``.

    Args:
        load: the ``error_msgs`` list torch passes to ``_load_from_state_dict``:
            one list per ``load_state_dict`` call, shared by all its modules.
        prefix: the embedding's prefix in the state dict (``"user."``).
    """
    if getattr(_LOADS, "load", None) is not load:
        _LOADS.load, _LOADS.prefixes = load, []
    _LOADS.prefixes.append(prefix)


def refused_after(exc: Exception, load: list, prefix: str) -> Optional[Exception]:
    """``exc``, a refusal in the ``load_state_dict`` call ``load``, naming the embeddings it already loaded.

    Args:
        exc: the refusal (a :class:`~speedswap.errors.SpeedswapError`).
        load: as for :func:`note_loaded`.
        prefix: the refusing embedding's prefix.

    Returns:
        None when the call loaded no embedding before, else an exception of
        ``exc``'s type whose message adds which it loaded.
    """
    if getattr(_LOADS, "load", None) is not load or not _LOADS.prefixes:
        return None
    names = ", ".join(repr(loaded[:-1]) for loaded in _LOADS.prefixes)
    return type(exc)(f"{exc}. Beware: this model.load_state_dict() had already replaced the tables (and "
                     f"optimizer state) of the embedding(s) {names} with the state dict's (torch loads "
                     f"module by module, and those came first), while this one ({prefix[:-1]!r}) and the "
                     f"modules after it keep their own: load a state dict that fits the whole model, or "
                     f"restore those embeddings too, before training on (speedswap.train.module_state."
                     f"check_state_dict(model, state_dict) before a load checks them all first)")


def missing_hint(key: str, kind: str, weight=None, table_shape=None) -> str:
    """The warning of a ``load_state_dict`` whose state dict has no ``key``, the embedding's table.

    Args:
        key: the missing ``<prefix>_extra_state``.
        kind: the embedding's class name.
        weight: the state dict's ``<prefix>weight``, if it holds one.
        table_shape: the embedding's ``(num_embeddings, embedding_dim)``.
    """
    if table_shape is not None and tuple(getattr(weight, "shape", ())) == tuple(table_shape):
        # nn.Embedding's state dict (a model moving over): its weight is the whole table.
        return (f"the state dict holds no {key!r}, the table of the {kind}, but a whole {tuple(table_shape)} "
                f"'weight', as nn.Embedding saves, which the {kind} does not load (its weight is the "
                f"step's working set), so the table is left as it is; copy those rows in with "
                f"emb.table.scatter(torch.arange({table_shape[0]}), weight), or build the embedding "
                f"with OffloadedEmbedding.from_pretrained(weight, freeze=False, max_rows=...)")
    return (f"the state dict holds no {key!r}, the table of the {kind} (it was saved before speedswap "
            f"put tables in state_dict(), when only the working-set scratch 'weight' was saved), so "
            f"the table is left as it is; restore it from the checkpoint written by emb.save(path): "
            f"model.load_state_dict(state, strict=False), then emb.load(path)")


def unpicklable(kind: str) -> StateError:
    """The error of pickling or deep-copying an embedding (``torch.save(model)``, ``copy.deepcopy``)."""
    return StateError(f"{kind} cannot be pickled or deep-copied: its table and optimizer state "
                      f"live in host memory (or files) that the module only points to. Checkpoint "
                      f"with torch.save(model.state_dict()), which holds them, or emb.save(path); "
                      f"for a copy, build another model and load_state_dict() into it. A weight average "
                      f"(torch.optim.swa_utils.AveragedModel, an EMA copy) deep-copies the model: average "
                      f"the other modules alone (AveragedModel(model.head)), not the table. If this came "
                      f"from torch.save(model, path), torch had opened path first and left it truncated: "
                      f"a checkpoint kept there is lost")


def rows_only(state_dict):
    """A copy of ``state_dict`` whose speedswap tables hold the rows alone, without optimizer state.

    For loading a training checkpoint into a model without an attached
    optimizer (evaluation, export). The tensors are shared, not copied.

    >>> model.load_state_dict(rows_only(torch.load("ckpt.pt")["model"]))  # doctest: +SKIP
    """
    out = copy.copy(state_dict)  # an OrderedDict keeps its _metadata
    for key, value in state_dict.items():
        if key.endswith("_extra_state") and isinstance(value, Mapping) and value.get("format") == FORMAT:
            tables = value.get("tables") or {}
            out[key] = {**{k: v for k, v in value.items() if k != SCALAR_STATE}, "optimizer": "",
                        "tables": {k: v for k, v in tables.items() if k == "table"}}
    return out


def in_memory_state_dict(state_dict):
    """A copy of ``state_dict`` that the same model with ``nn.Embedding`` in place of each ``OffloadedEmbedding`` loads.

    For deployment or evaluation in memory: each embedding's ``weight`` (the
    scratch of a step's rows) becomes its whole table, in the weight's dtype
    (a table stored in bfloat16 as the float32 rows the embedding computes
    with: a copy; otherwise shared, not copied), and its ``_extra_state``
    (tables, optimizer state) goes.

    >>> plain_model.load_state_dict(in_memory_state_dict(offloaded_model.state_dict()))  # doctest: +SKIP

    Args:
        state_dict: an offloaded model's ``state_dict()`` (or one ``torch.load`` read back).

    Returns:
        a new state dict, with the same ``_metadata``.

    Raises:
        OptionError: it holds a ``ShardedOffloadedEmbedding``'s state, one rank's
            shard of the rows (nothing is made): export the whole table from a
            sharded checkpoint with ``speedswap.load_sharded`` instead.
    """
    out = copy.copy(state_dict)  # an OrderedDict keeps its _metadata
    for key, value in state_dict.items():
        if not (key.endswith("_extra_state") and isinstance(value, Mapping) and value.get("format") == FORMAT):
            continue
        if value.get("kind") != "OffloadedEmbedding":
            raise OptionError(
                f"{key!r} is a {value.get('kind')}'s state: one rank's shard of the table, not the whole "
                f"table an nn.Embedding holds. Save the table on every rank (emb.save(path)), read it "
                f"into an OffloadedEmbedding in one process with speedswap.load_sharded(path, emb), and "
                f"convert that model's state dict")
        weight = key[:-len("_extra_state")] + "weight"
        del out[key]
        out[weight] = value["tables"]["table"].to(state_dict[weight].dtype)
    return out


def _is_plain(value) -> bool:
    """Whether ``value`` is what :func:`tables_state` writes beside the tables: a number, a name, None,
    a list of them or a dict of them by name (the scalar state)."""
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return value is None or isinstance(value, (str, numbers.Number))


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
