"""What PyTorch does to any ``nn.Module``, done to a model holding an offloaded embedding.

Each test trains an offloaded model and its lazy in-memory reference
(``test_training_flows.pair``) on Zipf ids, tries what a user would do to an
``nn.Embedding`` model half way, and checks that it either trains as in memory
or raises a ``SpeedswapError`` before anything changed, after which training
goes on as in memory.
"""

import multiprocessing
import os
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.utils.prune as prune
from torch.nn.utils import parametrize

import speedswap as ss
from test_training_flows import (ROWS, STEPS, assert_equal_to_reference, backward, make_lazy, pair, switchers,
                                 train_step, zipf_ids)


class _Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def _old_weight_norm(emb):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations.weight_norm
        torch.nn.utils.weight_norm(emb, "weight")


#: What replaces or reparametrizes an ``nn.Embedding``'s weight through ``nn.Module``'s own calls.
#: In memory each replaces or constrains the whole table; the first is how pretrained vectors are
#: put into an ``nn.Embedding`` (``emb.weight = nn.Parameter(vectors)``).
REPLACEMENTS = {
    "assign_pretrained_rows": lambda emb: setattr(
        emb, "weight", torch.nn.Parameter(torch.randn(ROWS, emb.embedding_dim))),
    "assign_a_scratch_like_parameter": lambda emb: setattr(
        emb, "weight", torch.nn.Parameter(torch.randn_like(emb.weight))),
    "delete": lambda emb: delattr(emb, "weight"),
    "register_parameter": lambda emb: emb.register_parameter("weight", None),
    "register_parametrization": lambda emb: parametrize.register_parametrization(emb, "weight", _Doubled()),
    "weight_norm": lambda emb: torch.nn.utils.parametrizations.weight_norm(emb, "weight"),
    "spectral_norm": lambda emb: torch.nn.utils.parametrizations.spectral_norm(emb, "weight"),
    "prune": lambda emb: prune.random_unstructured(emb, "weight", amount=0.3),
}

#: Those that set the weight (to itself) before the deletion refused: ``register_parametrization``
#: and what is built on it without a right inverse returning several tensors (weight_norm's does).
SETS_THE_WEIGHT_FIRST = {"register_parametrization", "spectral_norm"}


def _lazy_pair(rng, cache_rows=0, sharded=False):
    offloaded, reference = pair(rng, cache_rows=cache_rows, sharded=sharded)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    return offloaded, reference, opt, ref_opt


@pytest.mark.parametrize("sharded, cache_rows", [(False, 0), (False, 40), (True, 0)],
                         ids=["offloaded", "offloaded_cached", "sharded_one_rank"])
@pytest.mark.parametrize("how", list(REPLACEMENTS))
def test_replacing_or_reparametrizing_the_weight_is_refused_before_the_module_changes(rng, how, sharded,
                                                                                   cache_rows):
    """``emb.weight = nn.Parameter(vectors)`` (before or after attach) left the table as it was and trained
    the old weight's rows: silently not what the same model in memory trains (a table started from
    ``vectors``); a parametrization (``weight_norm`` gave NaN rows), pruning or ``del emb.weight`` trained
    wrongly or failed deep inside (``AttributeError: 'NoneType' object has no attribute 'is_sparse'``).
    Each is refused with ``OptionError`` before the module changes (but for the write of the weight onto
    itself that ``register_parametrization`` makes first, which the next training forward refuses once, as
    any write into the scratch between steps), and training goes on as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, cache_rows, sharded)
    emb = offloaded.emb
    weight, names = emb.weight, [name for name, _ in offloaded.named_parameters()]
    batches = zipf_ids(rng, STEPS)
    for step, (ids, target) in enumerate(batches):
        if step == STEPS // 2:
            table = emb.table.to_numpy(copy=True)
            with pytest.raises(ss.OptionError, match="emb.table.scatter"):
                REPLACEMENTS[how](emb)
            assert emb.weight is weight and type(emb) in (ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding)
            assert [name for name, _ in offloaded.named_parameters()] == names
            assert not emb._forward_pre_hooks  # pruning's hook, had it gone that far
            np.testing.assert_array_equal(emb.table.to_numpy(), table)
            if how in SETS_THE_WEIGHT_FIRST:
                with pytest.raises(ss.StateError, match="register_parametrization"):
                    offloaded(ids)
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("sharded", [False, True], ids=["offloaded", "sharded_one_rank"])
def test_a_weight_taken_out_behind_the_modules_back_is_refused_at_the_next_forward(rng, sharded):
    """The deprecated ``torch.nn.utils.weight_norm`` deletes ``_parameters['weight']`` itself before it
    sets the computed weight: refused at that assignment, and again at every forward and step, with no
    row changed (before, the embedding trained the scratch and left the table as it was, silently)."""
    offloaded, _, opt, _ = _lazy_pair(rng, sharded=sharded)
    (ids, target), = zipf_ids(rng, 1)
    table = offloaded.emb.table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="rebuild the embedding"):
        _old_weight_norm(offloaded.emb)
    for _ in range(2):
        with pytest.raises(ss.OptionError, match="rebuild the embedding"):
            offloaded(ids)
    with pytest.raises(ss.OptionError, match="rebuild the embedding"):
        opt.step()
    np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)


@pytest.mark.parametrize("mode", ["train", "eval", "no_grad"])
def test_functional_call_with_another_weight_is_refused_and_with_the_models_own_trains_as_in_memory(rng, mode):
    """``torch.func.functional_call(model, {"emb.weight": other}, ids)`` returned rows of ``other`` by
    working-set slot (in memory: ``other[ids]``), or in eval mode the table's rows: silently another
    output. Refused, nothing changed; with the model's own parameters it trains as the model does."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng)
    other = torch.randn_like(offloaded.emb.weight)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        if step == STEPS // 2:
            offloaded.train(mode == "train")
            with torch.set_grad_enabled(mode != "no_grad"), pytest.raises(ss.OptionError, match="functional_call"):
                torch.func.functional_call(offloaded, {"emb.weight": other}, (ids,))
            offloaded.train()
        for model, optimizer in ((offloaded, opt), (reference, ref_opt)):
            out = torch.func.functional_call(model, dict(model.named_parameters()), (ids,))
            torch.nn.functional.mse_loss(out, target).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("flag", ["overwrite", "swap"])
@pytest.mark.parametrize("sharded", [False, True], ids=["offloaded", "sharded_one_rank"])
def test_a_conversion_under_torchs_future_flags_that_replace_parameters_is_refused(rng, flag, sharded):
    """With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, ``model.to("cpu")`` of
    a model on the CPU gave the weight a new ``Parameter`` that neither the embedding's hooks nor the
    attached optimizer hold; with ``set_swap_module_params_on_conversion(True)`` it failed
    inside torch (``RuntimeError: _apply(): Couldn't swap OffloadedEmbedding.weight``). Refused with
    ``OptionError`` before any module converts; with the flag back off the conversion goes through and
    training goes on as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=sharded)
    setter = getattr(torch.__future__, f"set_{flag}_module_params_on_conversion")
    lin_weight = offloaded.lin.weight
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        if step == STEPS // 2:
            setter(True)
            try:
                with pytest.raises(ss.OptionError, match=f"set_{flag}_module_params_on_conversion"):
                    offloaded.to("cpu")
            finally:
                setter(False)
            assert offloaded.lin.weight is lin_weight  # nothing converted (under the flag a new Parameter)
            offloaded.to("cpu")
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


#: ``weight.data = tensor`` between steps, as torch's own utilities and hand-written loops make it.
DATA_ASSIGNMENTS = {
    "scaled": lambda model: setattr(model.emb.weight, "data", model.emb.weight.data * 1.5),
    "vector_to_parameters": lambda model: torch.nn.utils.vector_to_parameters(
        torch.nn.utils.parameters_to_vector(model.emb.parameters()) + 1, model.emb.parameters()),
    # to_empty()'s own new storage goes through; the values assigned before it are still refused.
    "scaled_then_to_empty": lambda model: (DATA_ASSIGNMENTS["scaled"](model), model.emb.to_empty(device="cpu")),
}


@pytest.mark.parametrize("sharded, cache_rows", [(False, 0), (False, 40), (True, 0)],
                         ids=["offloaded", "offloaded_cached", "sharded_one_rank"])
@pytest.mark.parametrize("how", list(DATA_ASSIGNMENTS))
@pytest.mark.parametrize("read_table", [False, True], ids=["", "table_read_before_the_forward"])
def test_other_values_assigned_to_weight_data_between_steps_are_refused_once(rng, how, sharded, cache_rows,
                                                                             read_table):
    """``emb.weight.data = tensor`` between steps (``vector_to_parameters``) put values in slots that name
    no row: the next forward pointed the weight back at its scratch and the values were lost, silently (in
    memory they replace the table's rows). Refused once at the next training forward, with nothing
    changed; the same values again (``weight.data = weight.data.clone()``) go through. Training goes on as
    the in-memory model that was not assigned anything."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, cache_rows, sharded)
    for step, (ids, target) in enumerate(zipf_ids(rng, STEPS)):
        if step == STEPS // 2:
            table = offloaded.emb.table.to_numpy(copy=True)
            DATA_ASSIGNMENTS[how](offloaded)
            if read_table:  # with a cache, a read of the table brings the weight its scratch back first
                offloaded.emb.table.to_numpy()
            with pytest.raises(ss.StateError, match=r"weight.data = tensor between steps"):
                offloaded(ids)
            np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)
        if step == STEPS // 2 + 1:
            offloaded.emb.weight.data = offloaded.emb.weight.data.clone()
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def _in_a_forked_process(step, *args):
    """Exit 0 if ``step(*args)`` (a training forward and step) ran, 3 if it raised StateError, 4 else.

    One torch thread: GNU OpenMP is not fork-safe, and a forked child's first parallel region waits
    forever for the parent's pool threads, which it does not have (the whole suite hung here once
    earlier tests had started that pool).
    """
    torch.set_num_threads(1)
    try:
        step(*args)
    except ss.StateError:
        os._exit(3)
    except BaseException:
        os._exit(4)
    os._exit(0)


def _join(child, timeout=120):
    """Wait for a forked child; a hung one is killed and fails the test, not the suite."""
    child.join(timeout)
    if child.exitcode is None:
        child.kill()
        child.join()
        pytest.fail(f"the forked process hung for {timeout} s")


@pytest.mark.skipif(sys.platform != "linux", reason="forks the test process")
@pytest.mark.parametrize("sharded, case", [(False, "share_memory"), (False, "mmap"), (False, "private_copy"),
                                           (True, "share_memory"), (True, "private_copy")],
                         ids=lambda value: {False: "offloaded", True: "sharded_one_rank"}.get(value, value))
def test_training_in_a_forked_process_a_table_shared_with_the_parent_is_refused(rng, tmp_path, sharded, case):
    """``model.share_memory()`` then training in forked ``torch.multiprocessing`` workers (Hogwild): in
    memory the children train the parent's table; the offloaded children trained copy-on-write copies
    of its host memory and the parent's table never moved, silently (with mmap storage they wrote the
    shared files through working sets of their own). Refused in the child before anything changes;
    a child training its own copy (no ``share_memory()``, in memory as offloaded) still may. The parent
    trains on as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=sharded)
    if case == "mmap":
        table0 = offloaded.emb.table.to_numpy(copy=True)
        emb = ss.OffloadedEmbedding(ROWS, table0.shape[1], max_rows=offloaded.emb.max_rows, storage="mmap",
                                    path=tmp_path, backend="numpy")
        emb.table.scatter(torch.arange(ROWS), torch.from_numpy(table0))
        offloaded.emb = emb
        opt = torch.optim.Adam(offloaded.parameters(), lr=0.05)
        emb.attach(opt)
    batches = zipf_ids(rng, STEPS)
    for step, (ids, target) in enumerate(batches):
        if step == STEPS // 2:
            if case == "share_memory":
                offloaded.share_memory()
            table = offloaded.emb.table.to_numpy(copy=True)
            child = multiprocessing.get_context("fork").Process(
                target=_in_a_forked_process, args=(train_step, offloaded, opt, *batches[0]))
            child.start()
            _join(child)
            assert child.exitcode == (0 if case == "private_copy" else 3)
            np.testing.assert_array_equal(offloaded.emb.table.to_numpy(), table)
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_a_weight_average_of_the_model_is_refused_saying_what_to_average_instead(rng):
    """``AveragedModel(model)`` deep-copies the model, which an offloaded embedding refuses: the message
    said to build another model for a copy, not what to average instead. Averaging the dense layers
    alone trains as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng)
    with pytest.raises(ss.StateError, match=r"AveragedModel\(model.head\)"):
        torch.optim.swa_utils.AveragedModel(offloaded)
    averages = [torch.optim.swa_utils.AveragedModel(model.lin) for model in (offloaded, reference)]
    for ids, target in zipf_ids(rng, STEPS):
        for model, optimizer, average in zip((offloaded, reference), (opt, ref_opt), averages):
            train_step(model, optimizer, ids, target)
            average.update_parameters(model.lin)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
    for mine, ref in zip(*(average.parameters() for average in averages)):
        np.testing.assert_allclose(mine.detach().numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)


def _switch_step(model, opt, u, o, ids, target):
    u.before_forward(ids)
    backward(model, o.before_forward(ids), target)
    opt.step()
    u.after_step(ids)
    o.after_step(ids)
    opt.zero_grad()


@pytest.mark.skipif(sys.platform != "linux", reason="forks the test process")
def test_switchers_refuse_training_in_a_forked_process_after_share_memory(rng):
    """The switchers' host tables are as private to a forked process as an OffloadedEmbedding's: after
    ``model.share_memory()`` a child's steps trained its copies and the parent's table never moved,
    silently. Refused in the child before anything changes; the parent trains on as a run that
    never forked."""
    seed = int(rng.integers(2**31))
    model, opt, u, o = switchers(np.random.default_rng(seed))
    alone, alone_opt, alone_u, alone_o = switchers(np.random.default_rng(seed))
    alone.load_state_dict(model.state_dict())
    batches = zipf_ids(rng, 6)
    for step, (ids, target) in enumerate(batches):
        if step == 3:
            model.share_memory()
            child = multiprocessing.get_context("fork").Process(
                target=_in_a_forked_process, args=(_switch_step, model, opt, u, o, *batches[0]))
            child.start()
            _join(child)
            assert child.exitcode == 3
        _switch_step(model, opt, u, o, ids, target)
        _switch_step(alone, alone_opt, alone_u, alone_o, ids, target)
    np.testing.assert_array_equal(u.getNumpyVersion(), alone_u.getNumpyVersion())
    for name, table in o.state.tables.items():
        np.testing.assert_array_equal(table.to_numpy(), alone_o.state.tables[name].to_numpy(), err_msg=name)
