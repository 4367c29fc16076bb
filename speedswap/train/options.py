"""``nn.Embedding``'s constructor options and forward call, checked alike by every offloaded embedding."""

import contextlib
import inspect
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..convert import bool_option, int_option, torch_dtype
from ..errors import DTypeError, OptionError

__all__ = ["max_rows_option", "padding_option", "embedding_dtype", "embedding_flags", "refuse_max_norm", "refuse_other_arguments",
           "forward_ids", "refuse_bag_arguments", "outside_function_transforms"]

_POOLING = ("it looks rows up and pools none: look a step's flat ids up in one call and pool the rows per "
            "bag yourself (README, 'Pooled lookups, several tables and optimizers: a click model', gives "
            "bag_sum(emb, ids, offsets, per_sample_weights), nn.EmbeddingBag(mode='sum')'s result)")

#: What to do instead of nn.EmbeddingBag's arguments, which no offloaded embedding takes; what
#: replaces nn.Embedding's ``_weight`` and ``_freeze`` depends on the class (its ``instead``).
_BAG_INSTEAD = {
    "mode": _POOLING,
    "include_last_offset": _POOLING,
    "per_sample_weights": "it is nn.EmbeddingBag's forward argument, and " + _POOLING,
}


def max_rows_option(max_rows, num_embeddings: int, who: str, per: str) -> int:
    """``max_rows``, the working set's capacity, as an int no larger than ``num_embeddings``.

    Args:
        max_rows: as given (required: None means it was left out).
        num_embeddings: rows of the whole table (a capacity beyond them is never needed).
        who: the class, for the message.
        per: who looks the rows up in one step (``"one step"``, ``"this rank in one step"``).

    Raises:
        OptionError: left out, or not a positive int.
    """
    what = f"the most distinct rows {per} may look up"
    if max_rows is None:
        raise OptionError(f"{who} needs max_rows=: {what}, all of the step's forwards together (each "
                          f"row once however often its id repeats). It sizes the device working set "
                          f"(max_rows x embedding_dim); a step that needs more raises CapacityError "
                          f"saying how many it needed. The number of ids a step looks up is a safe "
                          f"bound")
    return min(int_option(max_rows, "max_rows", hint=f" ({what})"), num_embeddings)


def padding_option(padding_idx, num_embeddings: int) -> Optional[int]:
    """``padding_idx`` as an int row id, or None.

    Raises:
        OptionError: not an integer in ``[0, num_embeddings)`` (``nn.Embedding``'s
            negative ids, counted from the end, are refused).
    """
    if padding_idx is None:
        return None
    if isinstance(padding_idx, (int, np.integer)) and not isinstance(padding_idx, bool) and padding_idx < 0:
        hint = (f"pass padding_idx={num_embeddings + padding_idx} for the row nn.Embedding means"
                if padding_idx >= -num_embeddings else "it is out of range even counted from the end")
        raise OptionError(f"padding_idx must be in [0, {num_embeddings}), got {padding_idx}: nn.Embedding's "
                          f"negative ones, counted from the end, are not taken; {hint}")
    padding_idx = int_option(padding_idx, "padding_idx", minimum=0)
    if padding_idx >= num_embeddings:
        raise OptionError(f"padding_idx must be in [0, {num_embeddings}), got {padding_idx!r}")
    return padding_idx


def embedding_dtype(dtype) -> torch.dtype:
    """The torch dtype an embedding's rows are trained in: ``dtype``, or torch's default for None.

    Args:
        dtype: as given to the embedding (a torch or numpy dtype, a name, or None).

    Returns:
        a floating-point ``torch.dtype``.

    Raises:
        DTypeError: a dtype torch does not have, or one that is not floating point.
    """
    # None: torch's default, as nn.Embedding reads it (numpy would read float64).
    dtype = torch.get_default_dtype() if dtype is None else torch_dtype(dtype)
    if not dtype.is_floating_point:
        raise DTypeError(f"an embedding trains floating-point rows, not {dtype}; use "
                         f"torch.float32, torch.bfloat16, torch.float16 or torch.float64")
    return dtype


def embedding_flags(scale_grad_by_freq, sparse) -> tuple:
    """``(scale_grad_by_freq, sparse)`` as bools, if they are (``bool("False")`` is True: a string would
    turn the gradient scaling on).

    Raises:
        OptionError: either is not a bool.
    """
    return (bool_option(scale_grad_by_freq, "scale_grad_by_freq",
                        hint=" (scale each row's gradient by its count in the batch)"),
            bool_option(sparse, "sparse", hint=" (nn.Embedding's sparse gradients)"))


def refuse_max_norm(cls: str, max_norm, norm_type, advice: str) -> None:
    """Refuse ``max_norm``, which ``nn.Embedding`` applies by writing rows in place at every lookup.

    Args:
        cls: the embedding class, for the message.
        max_norm, norm_type: as given to it.
        advice: how to clip that class's rows instead.

    Raises:
        OptionError: ``max_norm`` given, or a ``norm_type`` other than the default.
    """
    if max_norm is not None or norm_type != 2.0:
        raise OptionError(
            f"{cls} does not support max_norm (got max_norm={max_norm!r}, norm_type={norm_type!r}): "
            f"nn.Embedding renormalises looked-up rows in place at every forward, eval included; "
            f"clip the rows yourself between steps ({advice}) or leave max_norm and norm_type out")


def refuse_other_arguments(cls: str, init: Callable, positional: Sequence, others: Mapping,
                           instead: Mapping[str, str]) -> None:
    """Refuse the arguments an embedding's (or a switcher's) constructor collected and does not take.

    Code moved over from ``nn.Embedding`` or ``nn.EmbeddingBag`` passes
    theirs: ``nn.Embedding``'s options by position (``padding_idx`` third),
    where an offloaded embedding takes all but the two sizes by keyword (a
    third positional argument could mean ``nn.Embedding``'s ``padding_idx``
    or the offloaded one's ``max_rows``, so none is guessed at), or keywords
    it does not take (``_weight``, ``_freeze``, ``mode``, ...). Python's
    ``TypeError`` for either names one argument and says nothing of what to
    do instead.

    Args:
        cls: the embedding (or switcher) class, for the message.
        init: its ``__init__``, whose arguments the message lists as the ones it takes.
        positional: the positional arguments it collected after ``embedding_dim`` (``*positional``).
        others: the keyword arguments it collected (``**others``); neither: nothing is refused.
        instead: what to do instead of ``_weight`` and ``_freeze`` for that class (of other
            keywords too, for a switcher).

    Raises:
        DTypeError: any given (a ``TypeError``, as Python's for an unexpected argument).
    """
    if not positional and not others:
        return
    refusals = []
    if positional:
        # What nn.Embedding, whose code passes them, reads them as: the keywords to write instead.
        names = list(inspect.signature(torch.nn.Embedding.__init__).parameters)[3:]
        read_as = ", ".join(f"{name}={value!r}" for name, value in zip(names, positional))
        refusals.append(f"{cls} takes num_embeddings and embedding_dim by position and every other argument "
                        f"by keyword, but got {len(positional)} more by position "
                        f"({', '.join(map(repr, positional))}), which nn.Embedding reads as {read_as}: "
                        f"pass {'it' if len(positional) == 1 else 'them'} by keyword, with max_rows= "
                        f"(the most distinct rows one step may touch)")
    if others:
        advice, told = {**_BAG_INSTEAD, **instead}, {}
        for name in others:  # one piece of advice for the arguments it answers
            told.setdefault(advice.get(name, "no such argument (check its spelling)"), []).append(f"{name}=")
        told = "; ".join(f"{' and '.join(names)}: {why}" for why, names in told.items())
        refusals.append(f"{cls} does not take {', '.join(f'{name}=' for name in others)}. {told}")
    taken = [name for name, p in inspect.signature(init).parameters.items()
             if name != "self" and not name.startswith("_") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    raise DTypeError(f"{'. '.join(refusals)}. It takes {', '.join(taken)}; nothing was built")


def forward_ids(input, ids):
    """The ids a forward was given: as ``input``, ``nn.Embedding.forward``'s name (or by position), or as ``ids``.

    Args:
        input, ids: the forward's two names for its ids; one is None.

    Returns:
        the ids given, unchecked.

    Raises:
        DTypeError: both given, or neither (a ``TypeError``, as Python's for a call's arguments).
    """
    if (input is None) == (ids is None):
        given = "both input= and ids=" if ids is not None else "none"
        raise DTypeError(f"forward takes the ids to look up once: emb(ids), emb(input=ids) as nn.Embedding "
                         f"names them, or emb(ids=ids); got {given}")
    return ids if input is None else input


def refuse_bag_arguments(cls: str, extra: tuple, offsets, per_sample_weights) -> None:
    """Refuse ``nn.EmbeddingBag``'s forward arguments: an offloaded embedding looks rows up, it pools none.

    The forwards call it only when one was given, so the usual call pays nothing.

    Args:
        cls: the embedding class, for the message.
        extra: the positional arguments after the ids (``emb(ids, offsets)``).
        offsets, per_sample_weights: as given by keyword.

    Raises:
        DTypeError: always (a ``TypeError``, as Python's for a call's arguments).
    """
    given = [name for name, value in (("offsets", offsets), ("per_sample_weights", per_sample_weights))
             if value is not None]
    if extra:
        given.insert(0, f"{len(extra)} positional argument{'s' if len(extra) > 1 else ''} after the ids")
    raise DTypeError(f"{cls} is an nn.Embedding, not an nn.EmbeddingBag: its forward takes the ids alone, "
                     f"got {' and '.join(given)} too. Look up a step's flat ids in one call and pool "
                     f"the rows per bag yourself: README, 'Pooled lookups, several tables and "
                     f"optimizers: a click model', gives bag_sum(emb, ids, offsets, per_sample_weights), "
                     f"nn.EmbeddingBag(mode='sum')'s result; bags padded to one length pool as "
                     f"emb(ids).sum(1) with padding_idx")


# torch has no public way to ask whether a torch.func transform is running, or to step out of one:
# these are the private calls torch's own code uses for it. A torch without the first cannot be
# asked, so forwards run unchecked there (a transform's call may fail inside); one without the
# second refuses reads under a transform as it refuses training.
_TRANSFORM_RUNNING = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
_STEP_OUT = getattr(torch._C, "_DisableFuncTorch", None)


def outside_function_transforms(cls: str, reads: bool, ids, weight: torch.Tensor) -> tuple:
    """Where a forward that a ``torch.func`` transform calls (``grad``, ``vjp``, ``vmap``, ...) runs, if it can.

    A training forward gathers the ids' rows into the working set,
    :attr:`weight`, and the optimizer's step writes them back from it: a
    transform hands it a wrapped ``weight`` without storage
    (``functional_call``) or batched ids (``vmap``), which failed deep inside
    with a ``RuntimeError``. A forward that reads the table (eval mode,
    ``torch.no_grad()``, a frozen weight) of ids no transform batches, with a
    weight none wraps, is a constant to it, as ``nn.Embedding``'s rows of an
    untracked weight are: it runs outside the transform, whose wrapped
    tensors the host reads cannot take. Called before anything changes.

    Args:
        cls: the embedding class, for the message.
        reads: the forward reads the table, training nothing.
        ids: the ids as given (a tensor an op inside ``grad`` made is wrapped
            by it, and carries no gradient: its values are taken).
        weight: the forward's :attr:`weight`.

    Returns:
        ``(context, ids)``: a context manager to run the forward in (a null
        one without a transform) and the ids to look up in it.

    Raises:
        OptionError: under a transform, a training forward, or one of ids it
            batches or a weight it wraps (a read too, on a torch that cannot
            step out of it). A torch that cannot tell whether a transform runs
            raises nothing.
    """
    if _TRANSFORM_RUNNING is None or _TRANSFORM_RUNNING() is None:
        return contextlib.nullcontext(), ids
    if reads and _STEP_OUT is not None:
        functorch = torch._C._functorch  # torch's own torch.func needs these: there whenever it is
        while isinstance(ids, torch.Tensor) and functorch.is_gradtrackingtensor(ids):
            ids = functorch.get_unwrapped(ids)
        wrapped = functorch.is_functorch_wrapped_tensor
        if not (isinstance(ids, torch.Tensor) and wrapped(ids)) and not wrapped(weight):
            return _STEP_OUT(), ids
    raise OptionError(
        f"{cls} under a torch.func transform (grad, vjp, vmap, a functional_call inside one), training, of "
        f"ids it batches or of a weight it wraps: its weight is the step's working set, which the forward "
        f"fills from the host table and optimizer.step() writes back, so the transform cannot call it. "
        f"Look the rows up outside the transform (rows = emb(ids)) and pass them in; hand their gradient "
        f"back with rows.backward(grad_of_rows) before optimizer.step() (a lookup that reads the table, "
        f"in eval mode, under torch.no_grad() or of a frozen weight, runs inside one)")
