"""``nn.Module``'s conversions and weight replacements, which an offloaded embedding refuses before any happens.

``model.double()``, ``.half()``, ``.to(device)``, ``.cuda()`` give each
parameter new storage. An offloaded embedding's :attr:`weight` is only the
step's working set, filled from a host table (and optimizer state) kept for
one dtype on one device: converted, it would train storage the table never
sees, or fail deep in autograd. Conversions to what the embedding already is
(``model.to(its device)``, ``.float()`` of a float32 one) change nothing and
go through. A bfloat16 table's weight is float32, so ``.bfloat16()`` is
refused too, saying that the table is bfloat16 already.

Every conversion goes through ``nn.Module._apply``, which converts a model's
submodules in turn, children first: an override on the embedding runs after
the modules registered before it were converted, and no hook of torch's runs
before them. So the first embedding built wraps ``nn.Module._apply`` once
(:func:`guard_conversions`) to check the whole tree it is called on before
it delegates to torch's own: a refused conversion leaves every module as it
was. For a tree with no offloaded embedding the wrapper only walks it.

The same goes for what replaces the weight itself (``emb.weight = ...``, a
parametrization, pruning, ``torch.__future__``'s flags that make conversions
replace parameters): :class:`RefusesConversion` keeps the parameter it was
built with.

A SpeedTorch-style switcher trains a plain ``nn.Embedding`` of the model
whose rows it fills from its host tables: no module of the tree stands for
it, so it guards the parameter instead (:func:`guard_parameter`), checked
in the same walk.
"""

import functools
import threading
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import OptionError, StateError

__all__ = ["RefusesConversion", "gives_new_storage", "guard_conversions", "guard_parameter", "refuse_conversion",
           "refuse_new_gradient_storage", "refuse_new_parameter", "refuse_new_storage"]

#: ``checked``: ``(fn, ids of the modules checked for it)`` on a thread while a checked
#: ``nn.Module._apply`` runs: torch's recursion into the children need not walk their subtrees again.
_state = threading.local()

#: parameter -> weak method ``check(fn)`` (see :func:`guard_parameter`).
_GUARDED_PARAMETERS = WeakIdKeyDictionary()


class RefusesConversion(torch.nn.Module):
    """An ``nn.Module`` whose ``weight`` parameter, dtype and device are fixed when it is built.

    Its :meth:`check_conversion` runs for every ``model.double()``,
    ``.to(...)`` and the like on a model holding it, before anything converts.

    Its ``weight`` is the parameter it first set (the step's working set),
    which its hooks, the attached optimizer and its state are made for:
    ``emb.weight = nn.Parameter(vectors)`` (how an ``nn.Embedding`` is given
    pretrained rows), ``del emb.weight``, and what does those through
    ``nn.Module``'s own calls (``torch.nn.utils.parametrize`` and the
    ``weight_norm``/``spectral_norm`` built on it, pruning) are refused
    before the module changes: in memory they replace or reparametrize the
    whole table, here they would reach only the scratch. (``register_parametrization``
    sets the weight to its right inverse, most often itself, before the deletion
    refused: the next training forward refuses that write once, as any write
    into the scratch between steps.) What changes
    ``_parameters`` behind ``nn.Module``'s back (the deprecated
    ``torch.nn.utils.weight_norm``) is refused at the next use of
    ``weight`` (a forward, the step), before any row changes.
    """

    def __init__(self):
        super().__init__()
        guard_conversions()

    def __setattr__(self, name, value):
        if name != "weight":
            super().__setattr__(name, value)
        elif "_built_weight" in vars(self):
            if value is not self._built_weight:
                # Not registered any more: torch took it out itself (the deprecated weight_norm).
                raise _replacing_weight(type(self).__name__, "assigning emb.weight",
                                        *([_TAKEN] if "weight" not in self._parameters else []))
            super().__setattr__(name, value)
        else:
            super().__setattr__(name, value)
            if isinstance(value, torch.nn.Parameter):
                # The first weight set is the one built; held outside _parameters (object.__setattr__
                # registers nothing), so a replacement behind nn.Module's back can be told from it.
                object.__setattr__(self, "_built_weight", value)

    def __getattr__(self, name):
        # Every read of weight comes here (nn.Module keeps it in _parameters, not __dict__): as
        # nn.Module.__getattr__, which it saves a call of, but for a weight torch took out itself.
        if name == "weight" and "_built_weight" in self.__dict__:
            weight = self.__dict__["_parameters"].get("weight")
            if weight is None:
                raise _replacing_weight(type(self).__name__, "taking emb.weight out of the module's parameters "
                                                             "(the deprecated torch.nn.utils.weight_norm)", _TAKEN)
            return weight
        return super().__getattr__(name)

    def __delattr__(self, name):
        if name == "weight" and "_built_weight" in vars(self):
            raise _replacing_weight(type(self).__name__, "deleting emb.weight (as register_parametrization, "
                                                         "weight_norm and spectral_norm do)")
        super().__delattr__(name)

    def register_parameter(self, name: str, param) -> None:
        """As ``nn.Module``'s, refusing another ``weight`` or the built one under another name.

        Raises:
            OptionError: ``name`` is ``"weight"`` and ``param`` is not the built weight, or
                ``param`` is the built weight under another name (pruning moves it to
                ``weight_orig``); nothing changes.
        """
        built = vars(self).get("_built_weight")
        if built is not None and name == "weight" and param is not built:
            raise _replacing_weight(type(self).__name__, "registering another emb.weight")
        if built is not None and name != "weight" and param is built:
            raise _replacing_weight(type(self).__name__, f"registering emb.weight as {name!r} (as "
                                                         f"torch.nn.utils.prune does)")
        super().register_parameter(name, param)

    def refuse_replaced_weight(self, weight: torch.Tensor) -> None:
        """Refuse a forward whose ``weight`` is not the parameter built.

        Called once ``torch.func`` transforms were refused (they hand their own tensor in).

        Raises:
            OptionError: another tensor stands for ``weight`` (``functional_call`` with
                other values, a parameter put in ``_parameters`` directly); nothing changes.
        """
        if weight is not self._built_weight:
            raise _replacing_weight(type(self).__name__, "putting another tensor in emb.weight's place "
                                                         "(torch.func.functional_call with a 'weight', "
                                                         "_parameters['weight'] = ...)",
                                    "no row changed: this forward was refused")

    def check_conversion(self, fn) -> None:
        """Refuse ``fn`` if it would convert this module.

        Args:
            fn: the conversion ``nn.Module._apply`` applies to each tensor.

        Raises:
            OptionError: ``fn`` changes this module's dtype or device.
        """
        raise NotImplementedError


#: What a refusal after torch took the weight out of the module itself says changed.
_TAKEN = ("no row changed, but torch had taken the weight out of the module's parameters before this "
          "refusal: rebuild the embedding and load its state into it")


def _replacing_weight(kind: str, how: str, what: str = "nothing was changed") -> OptionError:
    """The error of replacing an offloaded embedding's ``weight`` (see :class:`RefusesConversion`)."""
    return OptionError(
        f"{how} is not supported by this {kind}: its weight is only the scratch a step's rows are "
        f"trained in, the one its hooks and the attached optimizer hold, and the table lives on the "
        f"host: in memory this would replace or reparametrize the whole table, here it would reach "
        f"no row ({what}). To give the table other rows, write them into it (emb.table.scatter(ids, rows), "
        f"emb.load(path); OffloadedEmbedding.from_pretrained(vectors, freeze=False, max_rows=...) "
        f"builds one from them); to constrain rows, apply the function to the lookup's output instead")


def guard_conversions() -> None:
    """Make ``nn.Module._apply`` check every :class:`RefusesConversion` in its tree first; once per process.

    The wrapper keeps torch's ``_apply`` (or whatever it was) as it is and
    calls it unchanged once every check passed. Calls nested in a checked one
    (torch's own recursion into children) are not checked again.
    """
    apply = torch.nn.Module._apply
    if getattr(apply, "_speedswap_checks_first", False):
        return

    @functools.wraps(apply)
    def checked_apply(module, fn, recurse=True):
        outer = getattr(_state, "checked", None)
        if outer is not None and outer[0] is fn and id(module) in outer[1]:
            return apply(module, fn, recurse)
        tree = list(module.modules()) if recurse else [module]
        for sub in tree:
            if isinstance(sub, RefusesConversion):
                sub.check_conversion(fn)
            if _GUARDED_PARAMETERS:
                _check_parameters(sub, fn)
        _state.checked = (fn, {id(sub) for sub in tree})
        try:
            return apply(module, fn, recurse)
        finally:
            _state.checked = outer

    checked_apply._speedswap_checks_first = True
    torch.nn.Module._apply = checked_apply


def _check_parameters(module, fn):
    """Run the checks :func:`guard_parameter` registered for ``module``'s own parameters."""
    for param in module._parameters.values():
        check = None if param is None else _GUARDED_PARAMETERS.get(param)
        check = None if check is None else check()
        if check is not None:
            check(fn)


def guard_parameter(param: torch.nn.Parameter, check) -> None:
    """Have every conversion of a module holding ``param`` call ``check(fn)`` before anything converts.

    For a parameter whose dtype and device something outside the model
    depends on (a switcher's host tables), where no :class:`RefusesConversion`
    module of the tree stands for it. A later call for ``param`` replaces the check.

    Args:
        param: the parameter.
        check: a bound method taking the conversion ``fn`` (as
            ``nn.Module._apply`` calls it) and raising :class:`OptionError`
            to refuse it; held weakly.
    """
    guard_conversions()
    _GUARDED_PARAMETERS[param] = weakref.WeakMethod(check)


def refuse_conversion(kind: str, fn, weight: torch.Tensor, table_dtype: torch.dtype, *,
                      instead: str = "build it with dtype=..., device=... (backend='numpy' for the CPU) "
                                     "instead") -> None:
    """Raise unless ``fn`` (as ``nn.Module._apply`` calls it) leaves ``weight``'s dtype and device.

    Args:
        kind: the embedding's class name, for the message.
        fn: the conversion ``nn.Module._apply`` applies to each tensor.
        weight: the embedding's working-set parameter.
        table_dtype: the host table's dtype, for the message.
        instead: what the message says to do instead.

    Raises:
        OptionError: ``fn`` would convert ``weight``. Called before anything
            converts (:func:`guard_conversions`), so the model is as it was.
    """
    probe = fn(torch.zeros(1, dtype=weight.dtype, device=weight.device))
    if (probe.dtype, probe.device) == (weight.dtype, weight.device):
        return
    # The example converts as the call did: model.head.double() after a .half() sent users the wrong way.
    to = f"{probe.dtype}" if probe.dtype != weight.dtype else repr(str(probe.device))
    unchanged = (f"Nothing was converted: convert the other submodules one by one "
                 f"(e.g. model.head.to({to})), leaving the embedding as it is")
    if probe.device == weight.device and probe.dtype == table_dtype:
        # A bfloat16 table trains through a float32 weight: "build it with dtype=" would send
        # the user to what they did already.
        raise OptionError(
            f"this {kind} cannot be converted to {probe.dtype} after it is built, and need not be: its "
            f"table is {table_dtype} already, and its weight (the step's working set) and optimizer "
            f"state are {weight.dtype} by design, each touched row rounded back to {table_dtype} once "
            f"per step; leave the embedding as it is (its output is {weight.dtype}: cast it where the "
            f"next layer needs {probe.dtype}). {unchanged}")
    raise OptionError(
        f"this {kind} cannot be converted to {probe.dtype} on {probe.device} after it is built "
        f"(its table and optimizer state live on the host for {table_dtype} rows on "
        f"{weight.device}); {instead}. {unchanged}")


def refuse_new_parameter(kind: str) -> None:
    """Raise if ``nn.Module._apply`` would give the weight a new parameter whatever the conversion.

    With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``
    every conversion, even one to the dtype and device the module is on
    already, puts a new ``Parameter`` in ``_parameters``; with
    ``set_swap_module_params_on_conversion(True)`` it swaps the parameter's
    tensor for another (which torch refuses, deep inside, for a weight held
    weakly, as an attached embedding's is). The embedding's hooks and the
    attached optimizer hold the weight built (see :class:`RefusesConversion`).

    Args:
        kind: the embedding's class name, for the message.

    Raises:
        OptionError: either flag is set; called before anything converts.
    """
    future = torch.__future__
    flags = [name for name, on in (("set_overwrite_module_params_on_conversion",
                                    future.get_overwrite_module_params_on_conversion()),
                                   ("set_swap_module_params_on_conversion",
                                    future.get_swap_module_params_on_conversion())) if on]
    if flags:
        raise OptionError(
            f"with torch.__future__.{flags[0]}(True), every conversion (to the dtype and device the "
            f"{kind} is on already too) replaces its weight's parameter, which its hooks and the "
            f"attached optimizer hold: the step's rows would train a tensor the table never sees. "
            f"Nothing was converted: set it back to False around this call (its default), or convert "
            f"the other submodules one by one, leaving the embedding as it is")


def refuse_new_storage(kind: str, fn, weight: torch.Tensor, until: str) -> None:
    """Raise if ``fn`` gives ``weight`` new storage; for a weight that holds a step's rows now.

    ``to_empty()`` onto the device a module is on changes no dtype or device,
    so :func:`refuse_conversion` lets it through, but it replaces every
    parameter's storage with uninitialised memory: the step's rows in the
    working set would be lost, and the step would write that memory back to
    the table as trained rows. A conversion that keeps each tensor as it is
    (``.float()`` of a float32 model, ``.to(its device)``) goes through.

    Args:
        kind: the embedding's name, for the message.
        fn: the conversion ``nn.Module._apply`` applies to each tensor.
        weight: the working-set parameter.
        until: the call that writes the step's rows back, for the message.

    Raises:
        StateError: ``fn`` returns another tensor than the one it is given;
            called before anything converts, so the model is as it was.
    """
    if gives_new_storage(fn, weight):
        raise StateError(f"this {kind} holds the rows of a step in progress, and this conversion gives "
                         f"its weight new storage (to_empty() leaves it uninitialised): {until} would "
                         f"write that memory back to the table as the step's rows. Nothing was "
                         f"converted: convert between steps")


def refuse_new_gradient_storage(kind: str, fn, weight: torch.Tensor) -> None:
    """Raise if ``fn`` gives the gradient ``weight`` holds between steps new storage.

    ``zero_grad(set_to_none=False)`` leaves zeros on the working set's
    weight; ``to_empty()`` replaces them with uninitialised memory, to which
    the next backward adds its gradient: the step would train that memory
    into the table's rows. (In memory ``to_empty()`` leaves the whole table
    uninitialised as well; here the table is kept, so its training must be too.)

    Args:
        kind: the embedding's name, for the message.
        fn: the conversion ``nn.Module._apply`` applies to each tensor.
        weight: the working-set parameter.

    Raises:
        StateError: ``weight`` holds a gradient and ``fn`` returns another
            tensor than the one it is given; called before anything converts.
    """
    if weight.grad is not None and gives_new_storage(fn, weight):
        raise StateError(f"this {kind}'s weight holds a gradient (the zeros zero_grad(set_to_none=False) "
                         f"leaves), and this conversion gives it new storage (to_empty() leaves it "
                         f"uninitialised), to which the next backward would add: the step would train "
                         f"that memory into the table. Nothing was converted: call optimizer.zero_grad() "
                         f"(set_to_none=True, the default) first")


def gives_new_storage(fn, weight: torch.Tensor) -> bool:
    """Whether the conversion ``fn`` returns another tensor than a tensor like ``weight`` it is given.

    Args:
        fn: the conversion ``nn.Module._apply`` applies to each tensor.
        weight: the parameter it would convert (only its dtype and device are used).

    Returns:
        True for a conversion that gives ``weight`` other storage (``to_empty()``), False
        for one that keeps it (``.to(its device)``, ``.float()`` of a float32 one).
    """
    probe = torch.zeros(1, dtype=weight.dtype, device=weight.device)
    return fn(probe) is not probe
