"""Module-level cases of the offloaded embeddings that a review left open.

Each test trains an offloaded model and its lazy in-memory reference
(``test_training_flows.pair``: Zipf ids, Adam, the reference leaving untouched
rows and their state alone) and does to the model what a user does to an
``nn.Embedding`` model: it either trains as in memory or raises a
``SpeedswapError`` before anything changed, after which training goes on as in
memory.
"""

import copy

import numpy as np
import pytest
import torch

import speedswap as ss
from test_training_flows import STEPS, assert_equal_to_reference, make_lazy, pair, train_step, zipf_ids


def _lazy_pair(rng, sharded):
    offloaded, reference = pair(rng, sharded=sharded)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (offloaded, reference))
    offloaded.emb.attach(opt)
    make_lazy(ref_opt, reference.emb)
    return offloaded, reference, opt, ref_opt


@pytest.mark.parametrize("method", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_hook_on_the_sharded_weight_is_refused_saying_where_its_gradient_is(rng, method):
    """An ``OffloadedEmbedding``'s weight takes autograd's gradient, so a hook on it sees the working
    set's gradient (``test_torch_features``). A ``ShardedOffloadedEmbedding``'s weight gets its gradient
    from the exchange at the step (``requires_grad=False``): torch refused the hook with its own
    ``RuntimeError`` ("cannot register a hook on a tensor that doesn't require gradient"), which said
    nothing of why or what to do. It is a ``StateError`` now (a ``RuntimeError`` too), naming the lookup's output and
    ``exchange_gradients()``; nothing is registered and training goes on as in memory."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=True)
    emb = offloaded.emb
    batches = zipf_ids(rng, STEPS)
    for step, (ids, target) in enumerate(batches):
        if step == STEPS // 2:
            with pytest.raises(ss.StateError, match=r"no gradient from autograd.*exchange_gradients"):
                getattr(emb.weight, method)(lambda *args: None)
            assert not emb.weight._backward_hooks and not getattr(emb.weight, "_post_accumulate_grad_hooks", None)
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


def test_what_the_sharded_hook_refusal_advises_sees_the_gradients_in_memory_sees(rng):
    """The refusal's advice works: a hook on the lookup's output is handed the gradient of the rows
    looked up, as in memory, and after ``exchange_gradients()`` ``weight.grad`` holds the owned rows'
    gradient (one rank: every row of the step), as the in-memory table's gradient of those rows."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded=True)
    emb = offloaded.emb
    for ids, target in zipf_ids(rng, STEPS):
        handed = {}
        for side, model in (("offloaded", offloaded), ("reference", reference)):
            out = model.emb(ids)
            out.register_hook(lambda grad, side=side: handed.__setitem__(side, grad.clone()))
            torch.nn.functional.mse_loss(model.lin(torch.tanh(out).sum(1)), target).backward()
        torch.testing.assert_close(handed["offloaded"], handed["reference"], rtol=0, atol=0)
        emb.exchange_gradients()
        owned = emb._owned.rows  # the rows of the step, by slot: every one on one rank
        assert len(owned) == len(torch.unique(ids))
        torch.testing.assert_close(emb.weight.grad[:len(owned)], reference.emb.weight.grad[owned],
                                   rtol=1e-6, atol=1e-7)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)


@pytest.mark.parametrize("sharded", [False, True], ids=["offloaded", "sharded_one_rank"])
@pytest.mark.parametrize("how", ["model", "embedding"])
def test_load_state_dict_with_assign_restores_the_tables_and_keeps_the_scratch(rng, sharded, how):
    """``load_state_dict(sd, assign=True)`` of a model holding an offloaded embedding, or of the
    embedding itself, restores the table and its optimizer state from the state dict, as
    ``assign=False`` does, and keeps :attr:`weight` (the scratch the rows are gathered into, which
    the optimizer holds): training resumed from it equals the in-memory run resumed from the same
    step. ``OffloadedEmbedding.load_state_dict(assign=True)`` was refused (``OptionError``) though
    its weight is never loaded, while the same load through the model went through: the two differed.
    The linear layer is frozen: ``assign=True`` hands it the state dict's tensors, which the optimizer
    built before does not hold, in memory as here."""
    offloaded, reference, opt, ref_opt = _lazy_pair(rng, sharded)
    for model in (offloaded, reference):
        model.lin.requires_grad_(False)
    emb, weight = offloaded.emb, offloaded.emb.weight
    batches = zipf_ids(rng, STEPS)
    saved = None
    for step, (ids, target) in enumerate(batches):
        if step == STEPS // 3:
            saved = [copy.deepcopy(x.state_dict()) for x in (offloaded, opt, reference, ref_opt)]
        if step == 2 * STEPS // 3:  # back to the saved step, on both sides
            state, opt_state, ref_state, ref_opt_state = copy.deepcopy(saved)
            table = state["emb._extra_state"]["tables"]["table"].clone()
            if how == "model":
                loaded = offloaded.load_state_dict(state, assign=True)
            else:
                loaded = emb.load_state_dict({k[len("emb."):]: v for k, v in state.items() if k.startswith("emb.")},
                                             assign=True)
            assert not loaded.missing_keys and not loaded.unexpected_keys
            assert emb.weight is weight and offloaded.emb.weight is weight
            np.testing.assert_array_equal(emb.table.to_numpy(), table.numpy())
            opt.load_state_dict(opt_state)
            reference.load_state_dict(ref_state)
            ref_opt.load_state_dict(ref_opt_state)
        train_step(offloaded, opt, ids, target)
        train_step(reference, ref_opt, ids, target)
    assert_equal_to_reference(offloaded, opt, reference, ref_opt)
