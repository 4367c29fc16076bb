"""Only the attached optimizer steps an offloaded ``weight``: another one's ``step()`` is refused.

An offloaded embedding's ``weight`` is a working set: its slots hold other
rows every step, and only the optimizer it is attached to narrows it to the
step's rows and swaps their optimizer state in. Another optimizer whose param
groups hold it too (``emb.attach(sparse_adam)`` beside
``torch.optim.Adam(model.parameters())``, the dense layers' optimizer) would
train that scratch with per-slot state of its own, and a step of it before the
attached one's would move the real rows twice: silently wrong training.

A global optimizer step pre-hook refuses such a step. torch runs global
pre-hooks before the optimizer's own (an attached optimizer's narrowing
hooks, a sharded embedding's collectives) and before it changes anything, so
the refused optimizer, the table and its state are left as they were.
"""

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import OptionError

__all__ = ["claim"]


class _Claim:
    """``weight`` belongs to one optimizer (held weakly); the owner's finalizer withdraws it."""

    def __init__(self, owner, weight, optimizer, frozen_may_stay, instead):
        self.optimizer = weakref.ref(optimizer)
        self.kind = type(owner).__name__
        self.frozen_may_stay = frozen_may_stay
        self.instead = instead
        # The owner holds the weight, the weight is a key only: neither is kept alive here.
        self._finalizer = weakref.finalize(owner, _withdraw, weakref.ref(weight), self)

    def remove(self):
        """Withdraw the claim now (idempotent): any optimizer may step the weight again."""
        self._finalizer()


#: weight -> its :class:`_Claim`. Keys are held weakly, by identity.
_CLAIMS = WeakIdKeyDictionary()

#: The handle of :func:`_refuse_other_optimizers`, registered at the first claim.
_HOOK = []


def claim(owner, weight, optimizer, *, frozen_may_stay: bool = True,
          instead: str = "attach this optimizer instead (emb.attach(optimizer))") -> _Claim:
    """Refuse, from now on, a ``step()`` of any optimizer but ``optimizer`` that would step ``weight``.

    The claim lasts until its ``remove()``, a later claim of ``weight`` (a
    re-attach moves it to the new optimizer), or until ``owner`` is collected.

    Args:
        owner: the embedding whose working set ``weight`` is.
        weight: its working-set parameter.
        optimizer: the attached optimizer, the only one that may step it.
        frozen_may_stay: let another optimizer hold ``weight`` while it is
            frozen (``requires_grad=False``) and has no gradient: torch's
            optimizers skip it then. False refuses any other optimizer that
            holds it (a sharded embedding's ``weight`` never requires a
            gradient, yet gets one at each step).
        instead: the refusal's other way out, for the owner's kind.

    Returns:
        the claim, whose ``remove()`` withdraws it.
    """
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_other_optimizers))
    previous = _CLAIMS.get(weight)
    if previous is not None:
        previous.remove()
    new = _Claim(owner, weight, optimizer, frozen_may_stay, instead)
    _CLAIMS[weight] = new
    return new


def _withdraw(weight_ref, claim_):
    weight = weight_ref()
    if weight is not None and _CLAIMS.get(weight) is claim_:
        del _CLAIMS[weight]


def _refuse_other_optimizers(optimizer, args, kwargs):
    """A global optimizer step pre-hook: refuse a step over a weight attached to another optimizer.

    A trainable weight is refused whether or not it has a gradient now, so
    the mistake shows at the first step whatever the order of the two
    optimizers' steps (and a closure that computes the gradient inside the
    step cannot slip past). Other optimizers pay one loop over the claims.

    Raises:
        OptionError: ``optimizer`` holds a claimed weight and is not its optimizer.
    """
    # A snapshot taken in one C call: iterating the claims themselves raised "dictionary changed
    # size during iteration" when a claim was withdrawn meanwhile, by another thread or by an
    # owner's finalizer that a garbage collection ran in the middle of the loop.
    refused = []  # (claim, the optimizer it names) for each claimed weight this optimizer holds
    for key, claim_ in _CLAIMS.data.copy().items():
        weight = key()
        if weight is None:
            continue
        attached = claim_.optimizer()
        if attached is optimizer:
            continue
        if claim_.frozen_may_stay and not weight.requires_grad and weight.grad is None:
            continue  # torch skips a parameter without a gradient, and a frozen one gets none
        if any(p is weight for group in optimizer.param_groups for p in group["params"]):
            refused.append((claim_, attached))
    if not refused:
        return
    # A model of several tables: name them all, so that one fix removes every one of them.
    claim_, attached = refused[0]
    other = "" if attached is None else f" ({type(attached).__name__})"
    if len(refused) == 1:
        what, fix = (f"the weight of the {claim_.kind} that is attached to another optimizer{other}",
                     "[p for p in model.parameters() if p is not emb.weight]")
    else:
        what, fix = (f"the weights of {len(refused)} embeddings ({claim_.kind}, ...) attached to "
                     f"other optimizers{other}",
                     "[p for p in model.parameters() if all(p is not emb.weight for emb in tables)], "
                     "tables being those embeddings")
    raise OptionError(
        f"{type(optimizer).__name__}.step() would step {what}: such a weight is a working set "
        f"whose slots hold other rows every step, so this optimizer would train them with state "
        f"of its own. Remove the embeddings' weights from this optimizer's param groups (build it "
        f"from the other parameters, e.g. {fix}), or {claim_.instead}; nothing was changed")
