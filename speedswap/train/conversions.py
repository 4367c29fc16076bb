"""``nn.Module``'s dtype and device conversions, which an offloaded embedding refuses.

``model.double()``, ``.half()``, ``.to(device)``, ``.cuda()`` give each
parameter new storage. An offloaded embedding's :attr:`weight` is only the
step's working set, filled from a host table (and optimizer state) kept for
one dtype on one device: converted, it would train storage the table never
sees, or fail deep in autograd. Conversions to what the embedding already is
(``model.to(its device)``, ``.float()`` of a float32 one) change nothing and
go through. A bfloat16 table's weight is float32, so ``.bfloat16()`` is
refused too, saying that the table is bfloat16 already.
"""

import torch

from ..errors import OptionError

__all__ = ["refuse_conversion"]


def refuse_conversion(kind: str, fn, weight: torch.Tensor, table_dtype: torch.dtype) -> None:
    """Raise unless ``fn`` (as ``nn.Module._apply`` calls it) leaves ``weight``'s dtype and device.

    Args:
        kind: the embedding's class name, for the message.
        fn: the conversion ``nn.Module._apply`` applies to each tensor.
        weight: the embedding's working-set parameter.
        table_dtype: the host table's dtype, for the message.

    Raises:
        OptionError: ``fn`` would convert ``weight``. torch converts a model's
            submodules in turn, so those registered before this embedding
            are converted already; the message says how to undo that.
    """
    probe = fn(torch.zeros(1, dtype=weight.dtype, device=weight.device))
    if (probe.dtype, probe.device) == (weight.dtype, weight.device):
        return
    undo = (f"torch converts a model's submodules in turn, so those registered before this embedding "
            f"were converted already: convert them back (e.g. model.to({weight.dtype}), "
            f"model.to({str(weight.device)!r})), which leaves the embedding as it is, or convert the "
            f"other submodules one by one")
    if probe.device == weight.device and probe.dtype == table_dtype:
        # A bfloat16 table trains through a float32 weight: "build it with dtype=" would send
        # the user to what they did already.
        raise OptionError(
            f"this {kind} cannot be converted to {probe.dtype} after it is built, and need not be: its "
            f"table is {table_dtype} already, and its weight (the step's working set) and optimizer "
            f"state are {weight.dtype} by design, each touched row rounded back to {table_dtype} once "
            f"per step; leave the embedding as it is (its output is {weight.dtype}: cast it where the "
            f"next layer needs {probe.dtype}). {undo}")
    raise OptionError(
        f"this {kind} cannot be converted to {probe.dtype} on {probe.device} after it is built "
        f"(its table and optimizer state live on the host for {table_dtype} rows on "
        f"{weight.device}); build it with dtype=..., device=... (backend='numpy' for the CPU) "
        f"instead. {undo}")
