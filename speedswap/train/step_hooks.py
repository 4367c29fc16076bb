"""The optimizer step hooks of an offloaded parameter: closures, failures, and weak references.

An offloaded parameter is narrowed to the rows a step touched for the
optimizer's ``step()`` and restored (its rows written back) after it. Three
things make that subtle, and this module handles them once for every owner
(:class:`~speedswap.OffloadedEmbedding`, :class:`~speedswap.ShardedOffloadedEmbedding`,
:class:`~speedswap.OptimizerFactory`):

* ``optimizer.step(closure)``: the forward runs *inside* the step, after the
  pre-step hook, so the rows are known only when the closure returns. The
  hook wraps the closure and narrows after it.
* failures: an owner's ``begin`` either completes or changes nothing, and an
  owner whose step was interrupted (the optimizer raised between the hooks)
  is put back by ``abort`` before anything else uses it. The post-hook runs
  first of the optimizer's, so a step the optimizer finished is kept whatever
  later hooks raise, as in memory.
* lifetime: the optimizer holds the hooks, the owner holds the optimizer; the
  hooks reach the owner through a weak reference, so dropping the owner frees
  its tables at once instead of when the cycle collector runs.
* ``torch.compile(optimizer.step)``: dynamo traces the hooks with the step,
  and the narrowing's ``param.data`` and ``param.grad`` assignments, replayed
  from the trace, ran out of order (torch's ``RuntimeError`` for a gradient of
  another size than its parameter). The hooks, and the closure wrapper that
  narrows, run eagerly (``torch.compiler.disable``: a graph break each); the
  optimizer's arithmetic between them is compiled.
"""

import weakref

import torch

__all__ = ["StepHooks", "closure_of"]


def closure_of(args, kwargs):
    """``(closure, setter)``: the closure passed to ``step`` and how to replace it in (args, kwargs)."""
    if "closure" in kwargs:
        return kwargs["closure"], lambda fn: (args, {**kwargs, "closure": fn})
    if len(args) > 1:  # args[0] is the optimizer itself
        return args[1], lambda fn: ((args[0], fn, *args[2:]), kwargs)
    return None, None


class StepHooks:
    """Registers weak step hooks of ``owner`` on ``optimizer``; removed by :meth:`remove` or with the owner.

    The owner provides three methods, each called with no arguments:

    * ``_begin_step()``: narrow the parameter to the step's rows and put their
      optimizer state in place. It must either complete or change nothing.
    * ``_end_step()``: restore the parameter and write rows and state back.
    * ``_abort_step()``: undo a ``_begin_step`` whose step never finished.

    Args:
        owner: the object whose rows the step trains.
        optimizer: the ``torch.optim`` optimizer.
    """

    def __init__(self, owner, optimizer):
        ref = weakref.ref(owner)
        post = optimizer.register_step_post_hook(_post_hook(ref))
        # First of the optimizer's post-hooks (torch has no prepend for them): as in memory, every
        # post-hook then finds the rows stepped, and one registered before attach that raises cannot
        # keep them from being written back (the next call's _abort_step would undo the update).
        optimizer._optimizer_step_post_hooks.move_to_end(post.id, last=False)
        self._handles = (optimizer.register_step_pre_hook(_pre_hook(ref)), post)
        # The hooks die with the owner; the finalizer holds the handles, not the owner.
        self._finalizer = weakref.finalize(owner, _remove, self._handles)

    def remove(self):
        """Unregister both hooks now (idempotent)."""
        self._finalizer()


def _remove(handles):
    for handle in handles:
        handle.remove()


def _pre_hook(ref):
    @torch.compiler.disable
    def before_step(optimizer, args, kwargs):
        owner = ref()
        if owner is None:
            return None
        owner._abort_step()  # a previous step that raised inside the optimizer
        closure, replace = closure_of(args, kwargs)
        if closure is None:
            owner._begin_step()
            return None

        @torch.compiler.disable
        def closure_then_narrow():
            # The forward inside the closure decides the rows; narrow only after it.
            current = ref()
            if current is not None:
                current._abort_step()  # an optimizer that calls the closure twice
            loss = closure()
            if current is not None:
                current._begin_step()
            return loss

        return replace(closure_then_narrow)
    return before_step


def _post_hook(ref):
    @torch.compiler.disable
    def after_step(optimizer, args, kwargs):
        owner = ref()
        if owner is not None:
            owner._end_step()
    return after_step
