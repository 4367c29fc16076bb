"""``nn.Module``'s dtype and device conversions, which an offloaded embedding refuses.

``model.double()``, ``.half()``, ``.to(device)``, ``.cuda()`` give each
parameter new storage. An offloaded embedding's :attr:`weight` is only the
step's working set, filled from a host table (and optimizer state) kept for
one dtype on one device: converted, it would train storage the table never
sees, or fail deep in autograd. Conversions to what the embedding already is
(``model.to(its device)``, ``.float()`` of a float32 one) change nothing and
go through.
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
    if (probe.dtype, probe.device) != (weight.dtype, weight.device):
        raise OptionError(
            f"this {kind} cannot be converted to {probe.dtype} on {probe.device} after it is built "
            f"(its table and optimizer state live on the host for {table_dtype} rows on "
            f"{weight.device}); build it with dtype=..., device=... (backend='numpy' for the CPU) "
            f"instead. torch converts a model's submodules in turn, so those registered before "
            f"this embedding were converted already: convert them back (e.g. "
            f"model.to({weight.dtype}), model.to({str(weight.device)!r})), which leaves the embedding as it is, "
            f"or convert the other submodules one by one")
