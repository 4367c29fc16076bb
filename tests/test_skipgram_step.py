"""The closed-form skip-gram step (manual_step) at its edges: tiny tables, half floats, failures, one table."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.optim.optimizer as torch_optimizer

import speedswap as ss
from speedswap.apps.pairs import PairBatch
from speedswap.apps.skipgram import SkipGram, manual_step


def _tables(u0, v0, optimizer=torch.optim.SGD, dtype=torch.float32, **kwargs):
    tables = []
    for init in (u0, v0):
        table = ss.OffloadedEmbedding(*init.shape, max_rows=len(init), storage="pageable", backend="numpy",
                                      dtype=dtype)
        table.table.apply_(lambda t, init=init: t.copy_(torch.from_numpy(init)))
        tables.append(table)
    opt = optimizer([t.weight for t in tables], lr=0.05, **kwargs)
    for table in tables:
        table.attach(opt)
    return tables, opt


def _reference(u0, v0, batches, optimizer=torch.optim.SGD, dtype=torch.float32, lr_scale=1.0, **kwargs):
    """Dense nn.Embeddings trained by autograd on the same pairs: the independent reference."""
    model = SkipGram(*(torch.nn.Embedding.from_pretrained(torch.from_numpy(t).to(dtype), freeze=False,
                                                          sparse=optimizer is torch.optim.SparseAdam)
                       for t in (u0, v0)))
    opt = optimizer(model.parameters(), lr=0.05 * lr_scale, **kwargs)
    for batch in batches:
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
    return [m.weight.detach().float().numpy() for m in (model.centre, model.context)]


def _assert_trained_as(actual, expected, steps):
    """float32 ``actual`` equal to ``expected`` to ``steps`` roundings of the table.

    Each SGD step adds a row's gradient, summed in another order than autograd's, to the row:
    the sum can round one ulp the other way, at most 2**-23 of the largest element, and the
    next steps carry it (a rtol=0, atol=1e-6 bound is about two ulps of 4: one came to 0.48
    of it over 15 seeds). Twice that allows for the lr = 0.05 feedback through the loss, and
    stays far below a lost or doubled update, lr times a gradient (~1e-2).
    """
    bound = 2 * steps * 2.0**-23 * np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=0, atol=bound)


@pytest.mark.parametrize("in_place", [None, False])
def test_a_table_with_fewer_rows_than_a_pair_has_columns_trains_as_autograd(in_place, rng):
    """1 + negatives columns per pair against a 4-row table: the sampled product cannot hold them."""
    vocab, negatives = 4, 5
    u0, v0 = (rng.standard_normal((vocab, 3)).astype(np.float32) for _ in range(2))
    batches = [(torch.from_numpy(rng.integers(0, vocab, 6)), torch.from_numpy(rng.integers(0, vocab, 6)),
                torch.from_numpy(rng.integers(0, vocab, (6, negatives)))) for _ in range(5)]
    tables, opt = _tables(u0, v0)
    step = manual_step(*tables, opt, in_place=in_place)
    for batch in batches:
        step(PairBatch.plan(*batch, centre_rows=vocab, context_rows=vocab))
    for table, expected in zip(tables, _reference(u0, v0, batches)):
        _assert_trained_as(table.table.to_numpy(), expected, len(batches))


def test_float16_tables_train_as_autograd(rng):
    vocab = 30
    u0, v0 = (rng.standard_normal((vocab, 4)).astype(np.float16) for _ in range(2))
    batches = [(torch.from_numpy(rng.integers(0, vocab, 8)), torch.from_numpy(rng.integers(0, vocab, 8)),
                torch.from_numpy(rng.integers(0, vocab, (8, 2)))) for _ in range(4)]
    tables, opt = _tables(u0, v0, dtype=torch.float16)
    step = manual_step(*tables, opt)
    for batch in batches:
        step(PairBatch.plan(*batch, centre_rows=vocab, context_rows=vocab))
    for table, expected in zip(tables, _reference(u0, v0, batches, dtype=torch.float16)):
        # Each step rounds a row to float16 once (the reference rounds its float16 gradient too, and
        # sums it in another order): at most one float16 ulp of the row's value the other way a step,
        # of 1 for values near zero, whose updates are at the operands' scale (about 1). Seen: 2 ulps
        # over 200 seeds; the old bound (rtol 2**-10, atol 2e-3) was under 2 ulps for values in 4-5.8.
        # A lost update, lr times a gradient (median 0.67), is about 34 ulps of 1.
        ulp = np.spacing(np.maximum(np.abs(expected), 1).astype(np.float16)).astype(np.float32)
        error = np.abs(table.table.to_numpy().astype(np.float32) - expected)
        assert (error <= (len(batches) + 1) * ulp).all(), (error / ulp).max()


def test_a_step_that_raises_leaves_both_tables_free_and_unchanged(rng):
    """A batch planned for a larger context table fails after the centre rows came in: the step
    raises, changes nothing, and the next good step trains as if it had not been tried."""
    vocab = 20
    u0, v0 = (rng.standard_normal((vocab, 3)).astype(np.float32) for _ in range(2))
    tables, opt = _tables(u0, v0, optimizer=torch.optim.Adam, eps=1e-30)  # Adam: the copying path
    step = manual_step(*tables, opt)
    wide = PairBatch.plan(torch.tensor([1, 2]), torch.tensor([3, 30]), torch.tensor([[4], [5]]),
                          centre_rows=vocab, context_rows=40)
    with pytest.raises(ss.IdError):
        step(wide)
    assert all(len(t.working_rows) == 0 for t in tables)
    np.testing.assert_array_equal(tables[0].table.to_numpy(), u0)
    good = (torch.tensor([1, 2, 1]), torch.tensor([3, 4, 5]), torch.tensor([[6, 7], [8, 1], [3, 9]]))
    step(PairBatch.plan(*good, centre_rows=vocab, context_rows=vocab))
    expected = _reference(u0, v0, [good], optimizer=torch.optim.SparseAdam, eps=1e-30)
    for table, reference in zip(tables, expected):
        np.testing.assert_allclose(table.table.to_numpy(), reference, rtol=0, atol=1e-6)


def test_one_table_as_centre_and_context_is_refused():
    emb = ss.OffloadedEmbedding(10, 3, max_rows=10, backend="numpy")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    with pytest.raises(ss.OptionError, match="two tables"):
        manual_step(emb, emb, opt)


@pytest.mark.parametrize("which", ["centre", "context"])
def test_a_table_that_scales_gradients_by_frequency_is_refused(which):
    # Autograd divides each row's gradient by its count in the forward; the closed form sums them
    # unscaled, so the two trained different vectors (0.17 apart after one step) until this was refused.
    centre, context = (ss.OffloadedEmbedding(20, 4, max_rows=20, backend="numpy", scale_grad_by_freq=name == which)
                       for name in ("centre", "context"))
    opt = torch.optim.SGD([centre.weight, context.weight], lr=0.1)
    centre.attach(opt)
    context.attach(opt)
    with pytest.raises(ss.OptionError, match="scale_grad_by_freq.*autograd"):
        manual_step(centre, context, opt)


@pytest.mark.parametrize("where", ["optimizer", "global"])
def test_a_step_pre_hook_of_the_users_sees_the_gradients_the_in_place_step_would_skip(where, rng):
    """A pre-hook that scales the gradients (clipping, say) must shape the update, as with autograd.

    The in-place step adds -lr times the gradients before optimizer.step(), which it calls
    without gradients: a hook there saw none and the rows were trained unscaled.
    """
    vocab = 40
    u0, v0 = (rng.standard_normal((vocab, 4)).astype(np.float32) for _ in range(2))
    batches = [(torch.from_numpy(rng.zipf(1.3, 16) % vocab), torch.from_numpy(rng.integers(0, vocab, 16)),
                torch.from_numpy(rng.integers(0, vocab, (16, 3)))) for _ in range(6)]

    def halve_gradients(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)

    tables, opt = _tables(u0, v0)
    register = (opt.register_step_pre_hook if where == "optimizer"
                else torch_optimizer.register_optimizer_step_pre_hook)
    handle = register(halve_gradients)
    try:
        step = manual_step(*tables, opt)
        for batch in batches:
            step(PairBatch.plan(*batch, centre_rows=vocab, context_rows=vocab))
        with pytest.raises(ss.OptionError, match="step pre-hook"):
            manual_step(*tables, opt, in_place=True)(PairBatch.plan(*batches[0], centre_rows=vocab,
                                                                     context_rows=vocab))
    finally:
        handle.remove()
    # The reference: autograd with the gradients halved, which is SGD at half the rate.
    for table, expected in zip(tables, _reference(u0, v0, batches, lr_scale=0.5)):
        _assert_trained_as(table.table.to_numpy(), expected, len(batches))


def _word2vec_loss(u_table, v_table, centres, contexts, negatives):
    """word2vec.c's negative-sampling loss written out: a negative equal to its pair's context is skipped."""
    u = u_table(centres)
    positive = F.logsigmoid((u * v_table(contexts)).sum(-1)).sum()
    drawn = negatives != contexts.unsqueeze(1)
    negative = F.logsigmoid(-(u.unsqueeze(1) * v_table(negatives)).sum(-1))[drawn].sum()
    return -(positive + negative)


@pytest.mark.parametrize("in_place", [None, False])
def test_a_negative_equal_to_its_context_is_skipped_as_word2vec_skips_it(in_place, rng):
    """word2vec.c and gensim skip a drawn negative that is the pair's own context word
    (``if (target == word) continue``); it was kept, pushing the context away as it pulled it in."""
    vocab, negatives = 60, 4
    u0, v0 = (rng.uniform(-0.5, 0.5, (vocab, 6)).astype(np.float32) for _ in range(2))
    perm = rng.permutation(vocab)
    batches = [tuple(torch.from_numpy(perm[(rng.zipf(1.3, size) - 1) % vocab]) for size in (32, 32, (32, negatives)))
               for _ in range(40)]
    assert sum(int((n == c.unsqueeze(1)).sum()) for _, c, n in batches) > 40  # Zipf heads collide often
    tables, opt = _tables(u0, v0)
    step = manual_step(*tables, opt, in_place=in_place)
    model = SkipGram(*(torch.nn.Embedding.from_pretrained(torch.tensor(t), freeze=False) for t in (u0, v0)))
    reference = [torch.nn.Embedding.from_pretrained(torch.tensor(t), freeze=False) for t in (u0, v0)]
    reference_opt = torch.optim.SGD([e.weight for e in reference], lr=0.05)
    for batch in batches:
        expected = _word2vec_loss(*reference, *batch)
        np.testing.assert_allclose(float(step(PairBatch.plan(*batch, centre_rows=vocab, context_rows=vocab))),
                                   float(expected.detach()), rtol=1e-5)
        np.testing.assert_allclose(float(model(*batch).detach()),
                                   float(_word2vec_loss(model.centre, model.context, *batch).detach()),
                                   rtol=1e-5)
        reference_opt.zero_grad()
        expected.backward()
        reference_opt.step()
        with torch.no_grad():  # the model follows the reference, so each step's losses are compared afresh
            for mine, theirs in zip((model.centre, model.context), reference):
                mine.weight.copy_(theirs.weight)
    for table, expected, initial in zip(tables, reference, (u0, v0)):
        expected = expected.weight.detach().numpy()
        assert np.abs(expected - initial).max() > 0.1  # trained well away from the start
        np.testing.assert_allclose(table.table.to_numpy(), expected, rtol=0, atol=1e-5)
