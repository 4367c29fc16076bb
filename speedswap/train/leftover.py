"""Whether the gradient a step left behind is still there, untouched.

An offloaded parameter's slots hold other rows every step, so a gradient
the last step left (no ``zero_grad()`` after ``optimizer.step()``) must not
be added to. ``zero_grad()`` drops it (``set_to_none=True``) or zeroes it in
place, which usually bumps its version. Not always: an optimizer built with
``foreach=True`` zeroes through ``torch._foreach_zero_``, whose CUDA kernel
leaves the version as it was. So the version is asked first, and the values
only when it cannot tell (a host wait on a GPU, in that case alone); a
leftover of zeros adds nothing to any row, so it is no reason to refuse.
"""

from .zero_marks import holds_nonzero

__all__ = ["untouched"]


def untouched(grad, left, version: int) -> bool:
    """Whether ``grad`` is the gradient ``left`` at ``version``, still holding a non-zero value.

    Args:
        grad: the parameter's gradient now (or None).
        left: the gradient the last step left (or None).
        version: ``left._version`` when it was left.

    Returns:
        True when adding to ``grad`` would add the last step's gradient to other rows.
    """
    if grad is None or grad is not left or grad._version != version:
        return False
    values = grad.coalesce().values() if grad.is_sparse else grad
    return bool(holds_nonzero(values))
