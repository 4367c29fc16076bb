"""Writes into an offloaded embedding's ``weight`` that reach no row: refused, not lost.

Between steps the ``weight`` of an :class:`~speedswap.OffloadedEmbedding` (the
working set of a step's rows) or of a :class:`~speedswap.ShardedOffloadedEmbedding`
(the rows a rank owns in a step) is scratch whose slots name no row of the table.
An initialiser over ``model.parameters()`` (``nn.init.normal_(emb.weight)``), a
``copy_`` into it, or ``emb.weight.data.uniform_(-a, a)`` in a model's
``__init__`` (word2vec's usual initialisation in PyTorch code) changes nothing the
model trains on: training would start from the table's rows, silently.
"""

import torch

from ..errors import StateError

__all__ = ["ScratchWrites"]


class ScratchWrites:
    """Finds writes into an embedding's ``weight`` made outside its steps.

    A write in place moves the weight's version: the embedding notes its own
    (the optimizer's step, a step it dropped), and any other move is refused at
    the next training forward that begins a step. A write through
    ``weight.data`` keeps the version; until the first attach the scratch still
    holds the zeros it was built with, so a value other than zero is one.

    Args:
        weight: the embedding's weight, as built.
    """

    def __init__(self, weight: torch.Tensor):
        self._version = weight._version  # as of the embedding's last write of its own
        self._clean = False  # whether no write was pending when the open own write began (begin_own)
        self._before_attach = True

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

    def refuse_written(self, weight: torch.Tensor) -> None:
        """Refuse a step's first training forward after a write into ``weight`` since the embedding's own.

        Said once: the next forward goes on.

        Raises:
            StateError: ``weight`` was written in place; nothing changes.
        """
        if weight._version != self._version:
            self._version = weight._version
            # A refused register_parametrization (spectral_norm...) is one too: torch sets the weight to its
            # right inverse (itself, most often) before it deletes the weight, which is what is refused.
            raise _written("between steps (an initialiser, a copy_ into it, or a refused "
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
                raise _written("through weight.data before attach (emb.weight.data.uniform_(-a, a), "
                               "the usual word2vec initialisation)")


def _written(how: str) -> StateError:
    return StateError(
        f"emb.weight was written {how}, but it is only the scratch an offloaded embedding trains a "
        f"step's rows in: the table was not changed. Write the table instead: emb.table.uniform_(-a, a), "
        f"emb.table.apply_(torch.nn.init.normal_, std=0.01), emb.load('vectors.npy') (or "
        f"OffloadedEmbedding.from_pretrained(...)); skip emb.weight in loops that initialise every parameter")
