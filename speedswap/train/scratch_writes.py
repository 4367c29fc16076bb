"""Writes into an offloaded embedding's ``weight`` that reach no row: refused, not lost.

Between steps the ``weight`` of an :class:`~speedswap.OffloadedEmbedding` (the
working set of a step's rows) or of a :class:`~speedswap.ShardedOffloadedEmbedding`
(the rows a rank owns in a step) is scratch whose slots name no row of the table.
An initialiser over ``model.parameters()`` (``nn.init.normal_(emb.weight)``), a
``copy_`` into it, or ``emb.weight.data.uniform_(-a, a)`` in a model's
``__init__`` (word2vec's usual initialisation in PyTorch code) changes nothing the
model trains on: training would start from the table's rows, silently. So does
``weight.data = tensor`` between steps (``torch.nn.utils.vector_to_parameters``).
"""

from typing import Callable, Optional

import torch

from ..errors import StateError

__all__ = ["ScratchWrites", "same_memory", "same_rows"]


class ScratchWrites:
    """Finds writes into an embedding's ``weight`` made outside its steps.

    A write in place moves the weight's version: the embedding notes its own
    (the optimizer's step, a step it dropped), and any other move is refused at
    the next training forward that begins a step. A write through
    ``weight.data`` keeps the version; until the first attach the scratch still
    holds the zeros it was built with, so a value other than zero is one.
    ``weight.data = tensor`` between steps is another tensor than the scratch:
    the embedding gives the weight its scratch back (:meth:`take_back`),
    noting a write if the values differ, unless a conversion made it
    (``to_empty()``, whose memory is uninitialised: :meth:`note_conversion`).

    Args:
        weight: the embedding's weight, as built.
        written: the error for a refused write, given how it was made; by
            default an offloaded embedding's, which names its table's methods.
    """

    def __init__(self, weight: torch.Tensor, written: Optional[Callable[[str], StateError]] = None):
        self._written = written or _written
        self._version = weight._version  # as of the embedding's last write of its own
        self._clean = False  # whether no write was pending when the open own write began (begin_own)
        self._before_attach = True
        self._replaced = False  # whether take_back found other values assigned through weight.data
        self._converting = False  # whether a conversion giving weight new storage was let through since

    def note_own(self, weight: torch.Tensor) -> None:
        """Take ``weight``'s version now as the embedding's own write (the optimizer's, in a step)."""
        self._version = weight._version

    def begin_own(self, weight: torch.Tensor) -> None:
        """Open a write of the embedding's own that may follow one of the user's (a step without rows).

        Such a step writes the scratch alone (the optimizer applies a zero
        gradient to it), and no forward ran before it to refuse a write
        pending then: that write stays one to refuse at the next forward
        (:meth:`end_own`).
        """
        self._clean = weight._version == self._version

    def end_own(self, weight: torch.Tensor) -> None:
        """Close :meth:`begin_own`'s write, done or raised: its version is the embedding's own if none was pending."""
        if self._clean:
            self._version = weight._version
        self._clean = False

    def note_conversion(self) -> None:
        """Note that a conversion (``to_empty()``) is about to give ``weight`` other storage: no write of the user's."""
        self._converting = True

    def take_back(self, weight: torch.Tensor, scratch: torch.Tensor) -> None:
        """Between steps, point ``weight.data`` back at ``scratch`` if it was replaced by a tensor like it.

        A replacement holding other values than ``scratch`` is a write that
        reaches no row, refused at the next training forward
        (:meth:`refuse_written`); one a conversion made is not. Costs a
        comparison of the two (on a GPU, one host wait), only when
        ``weight.data`` was replaced.

        Args:
            weight: the embedding's weight.
            scratch: the memory its slots live in (``weight.data`` as built).
        """
        converting, self._converting = self._converting, False
        data = weight.data
        if same_memory(data, scratch) or (data.shape, data.dtype, data.device) != \
                (scratch.shape, scratch.dtype, scratch.device):
            return  # an unlike tensor is the step's to refuse (it cannot hold the step's rows)
        with torch.no_grad():
            # NaN rows stay NaN in a clone (the scratch keeps rows of earlier steps).
            equal = bool(((data == scratch) | (data.isnan() & scratch.isnan())).all())
        self._replaced |= not (converting or equal)
        weight.data = scratch

    def refuse_written(self, weight: torch.Tensor) -> None:
        """Refuse a step's first training forward after a write into ``weight`` since the embedding's own.

        Said once: the next forward goes on.

        Raises:
            StateError: ``weight`` was written in place, or :meth:`take_back` found other values
                assigned to ``weight.data``; nothing changes.
        """
        if self._replaced:
            self._replaced = False
            raise self._written("through weight.data = tensor between steps "
                                "(torch.nn.utils.vector_to_parameters, a hand-written update)")
        if weight._version != self._version:
            self._version = weight._version
            # A refused register_parametrization (spectral_norm...) is one too: torch sets the weight to its
            # right inverse (itself, most often) before it deletes the weight, which is what is refused.
            raise self._written("between steps (an initialiser, a copy_ into it, or a refused "
                                "register_parametrization, which sets it first)")

    def refuse_written_through_data(self, scratch: torch.Tensor) -> None:
        """At the first attach, refuse a write through ``weight.data`` since the embedding was built.

        Said once: the next attach goes on. Costs one read of ``scratch`` (on
        a GPU, one host wait), once per embedding.

        Args:
            scratch: the weight's memory as built (``to_empty()`` may have
                given ``weight`` other memory since; it is not this one).

        Raises:
            StateError: ``scratch`` holds a value other than zero; nothing changes.
        """
        if self._before_attach:
            self._before_attach = False
            if bool(scratch.any()):
                raise self._written("through weight.data before attach (emb.weight.data.uniform_(-a, a), "
                                    "the usual word2vec initialisation)")


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory, shape and strides (``a`` may be another tensor object)."""
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


def same_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether ``a`` and ``b`` hold the same values, as a bool tensor.

    Exact, as numbers compare (``-0.0`` equals ``+0.0``, an infinity equals
    the same infinity), and NaN equals NaN: a row that diverged to NaN (the
    usual reason to skip a step) is unchanged, not written.

    Args:
        a, b: 2-D tensors of one shape.

    Returns:
        a bool tensor of ``a.shape[0]`` elements, on their device.
    """
    return ((a == b) | (a.isnan() & b.isnan())).all(dim=1)


def _written(how: str) -> StateError:
    return StateError(
        f"emb.weight was written {how}, but it is only the scratch an offloaded embedding trains a "
        f"step's rows in: the table was not changed. Write the table instead: emb.table.uniform_(-a, a), "
        f"emb.table.apply_(torch.nn.init.normal_, std=0.01), emb.load('vectors.npy') (or "
        f"OffloadedEmbedding.from_pretrained(...)); skip emb.weight in loops that initialise every parameter")
