"""Whether a gradient of zeros is ``zero_()``'s (``zero_grad(set_to_none=False)``), told by its signs.

In memory ``zero_()`` empties an embedding's sparse gradient, which then
names no row, and the step moves none; a backward that left the gradient at
zero (a loss weighted by 0), ``unscale_``, clipping, a negation and a mask
(``mul_(0.0)``) keep its rows at zero values, and SparseAdam moves them by
their momentum. An offloaded gradient is dense over the step's rows, where
only the signs of its zeros tell: ``zero_()`` writes ``+0.0`` over every
element, and a negation after it (gradient ascent) ``-0.0`` over every
element, while a backward that leaves the gradient at zero marks two of its
elements ``-0.0`` and ``+0.0`` (the same values: the embeddings write the
marks), which the others keep or swap, and a mask leaves ``-0.0`` wherever a
value was negative and ``+0.0`` where it was not.

Whether a gradient is zero at all is asked at every backward:
:func:`holds_nonzero` asks it as fast as each device allows.
"""

import torch

from .sync_free import reads_are_free

__all__ = ["holds_nonzero", "reads_as_zeroed"]

#: The integer dtype of each float's size: its bits tell -0.0 from +0.0, which compare equal as numbers.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def reads_as_zeroed(zeros: torch.Tensor) -> torch.Tensor:
    """Whether a step's gradient of ``zeros`` was zeroed by ``zero_()``, negated since or not.

    Every element ``+0.0``, or (of two elements or more) every one ``-0.0``.
    A step of one element has room for one mark, ``-0.0``, which its negation
    turns into ``zero_()``'s: there only ``+0.0`` reads as zeroed. A non-zero
    gradient multiplied by 0 whose values were all of one sign reads as
    zeroed too; in memory it would train its rows at zero values.

    Args:
        zeros: the step's gradient values; the answer holds where they are
            all zero, which the callers check.

    Returns:
        a 0-dim bool tensor on their device (no host wait).
    """
    if zeros.numel() < 2:
        return ~torch.signbit(zeros).any()
    # Zeros whose bits are all alike are all +0.0 or all -0.0: one comparison and one reduction,
    # as cheap as reading the signs alone.
    bits = zeros.reshape(-1).view(_BITS[zeros.element_size()])
    return (bits == bits[0]).all()


def holds_nonzero(values: torch.Tensor) -> torch.Tensor:
    """Whether any element of ``values`` is not zero (NaN is not), as ``values.any()`` tells.

    On the CPU a float tensor is asked through its least and greatest
    elements: torch's ``any()`` over floats is not vectorised there, and took
    about ten times as long as ``aminmax`` (1.1-2.0 ms against 0.12 ms for a
    step's gradient of 8,800 rows of 128 floats, ``benchmarks/NOTES.md``, 94).
    NaN makes both NaN, which is not zero; ``-0.0`` equals zero. On a GPU
    ``any()`` is one kernel where this would be four.

    Args:
        values: a dense tensor (a gradient, or its step's rows).

    Returns:
        a 0-dim bool tensor on their device (no host wait).
    """
    if not (reads_are_free(values) and values.is_floating_point() and values.numel()):
        return values.any()
    least, greatest = torch.aminmax(values)
    return (least != 0) | (greatest != 0)
