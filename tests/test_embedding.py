"""OffloadedEmbedding: a two-tower model equals its in-memory twin; checkpoints; errors."""

import copy
import functools
import inspect
import io
import math
import os
import tracemalloc

import numpy as np
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import speedswap as ss
from test_optimizer_equivalence import OPTIMIZERS, assert_same, torch_initial
from training_helpers import (CAPACITY, NUM_ROWS, EagerStateAdagrad, failing_after_its_update, run_in_memory,
                              skipgram_loss, zipf_batches)

USERS, ITEMS, DIM, BATCH, STEPS = 300, 500, 8, 32, 200
TOL = dict(rtol=1e-5, atol=1e-6)  # float32 rounding (repeated ids' gradients summed in another order)


class TwoTower(torch.nn.Module):
    """User and item towers: an embedding and a linear layer each, scored by a dot product."""

    def __init__(self, users, items):
        super().__init__()
        self.users, self.items = users, items
        self.user_proj = torch.nn.Linear(DIM, DIM)
        self.item_proj = torch.nn.Linear(DIM, DIM)

    def forward(self, user_ids, item_ids, labels):
        u = self.user_proj(self.users(user_ids))
        i = self.item_proj(self.items(item_ids))
        return torch.nn.functional.binary_cross_entropy_with_logits((u * i).sum(-1), labels)


def zipf(rng, n, size):
    p = 1.0 / np.arange(1, n + 1)
    return rng.permutation(n)[rng.choice(n, size=size, p=p / p.sum())]


def batches(rng, steps, device):
    out = []
    for _ in range(steps):
        users = torch.from_numpy(zipf(rng, USERS, BATCH)).to(device)
        items = torch.from_numpy(zipf(rng, ITEMS, (BATCH, 2))).to(device)  # item 0 is padding
        labels = torch.from_numpy(rng.integers(0, 2, (BATCH, 2)).astype(np.float32)).to(device)
        out.append((users.unsqueeze(1).expand(BATCH, 2), items, labels))
    return out


def offloaded_model(backend, user0, item0, linear_state, storage="pinned", path=None):
    users = ss.OffloadedEmbedding(USERS, DIM, max_rows=BATCH, storage=storage, backend=backend,
                                  path=None if path is None else path / "users")
    items = ss.OffloadedEmbedding(ITEMS, DIM, max_rows=2 * BATCH, storage=storage,
                                  backend=backend, padding_idx=0,
                                  path=None if path is None else path / "items")
    users.table.apply_(lambda t: t.copy_(torch.from_numpy(user0)))
    items.table.apply_(lambda t: t.copy_(torch.from_numpy(item0)))
    model = TwoTower(users, items).to(ss.get_backend(backend).device)
    model.load_state_dict(linear_state, strict=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-30)
    users.attach(opt)
    items.attach(opt)
    return model, [opt]


def in_memory_model(device, user0, item0, linear_state):
    users = torch.nn.Embedding.from_pretrained(torch.from_numpy(user0), freeze=False, sparse=True)
    items = torch.nn.Embedding.from_pretrained(torch.from_numpy(item0), freeze=False, sparse=True,
                                               padding_idx=0)
    model = TwoTower(users, items).to(device)
    model.load_state_dict(linear_state, strict=False)
    embeddings = [users.weight, items.weight]
    dense = [p for p in model.parameters() if all(p is not e for e in embeddings)]
    # Adam with a negligible eps is the same function as SparseAdam.
    return model, [torch.optim.SparseAdam(embeddings, lr=0.01, eps=1e-30),
                   torch.optim.Adam(dense, lr=0.01, eps=1e-30)]


def train(model, opts, data):
    for users, items, labels in data:
        model(users, items, labels).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


@pytest.fixture
def init(rng):
    user0 = rng.standard_normal((USERS, DIM), dtype=np.float32)
    item0 = rng.standard_normal((ITEMS, DIM), dtype=np.float32)
    item0[0] = 0
    linear = TwoTower(torch.nn.Identity(), torch.nn.Identity()).state_dict()
    return user0, item0, linear


def test_two_tower_equals_in_memory_model(backend, init, rng):
    device = ss.get_backend(backend).device
    data = batches(rng, STEPS, device)
    off, off_opts = offloaded_model(backend, *init)
    ref, ref_opts = in_memory_model(device, *init)
    train(off, off_opts, data)
    train(ref, ref_opts, data)
    np.testing.assert_allclose(off.users.table.to_numpy(), ref.users.weight.detach().cpu(), **TOL)
    np.testing.assert_allclose(off.items.table.to_numpy(), ref.items.weight.detach().cpu(), **TOL)
    assert not off.items.table.to_numpy()[0].any()  # padding row never trained
    for name in ("user_proj.weight", "item_proj.weight", "item_proj.bias"):
        np.testing.assert_allclose(off.get_parameter(name).detach().cpu(),
                                   ref.get_parameter(name).detach().cpu(), **TOL)
    # In eval mode the table is read directly, with no capacity limit.
    off.eval()
    with torch.no_grad():
        every_user = off.users(torch.arange(USERS, device=device))
    np.testing.assert_allclose(every_user.cpu(), ref.users.weight.detach().cpu(), **TOL)


def test_state_dict_holds_the_working_set_and_the_table(backend):
    emb = ss.OffloadedEmbedding(100_000, DIM, max_rows=16, backend=backend)
    state = emb.state_dict()
    assert list(state) == ["weight", "_extra_state"] and tuple(state["weight"].shape) == (16, DIM)
    assert {k: tuple(v.shape) for k, v in state["_extra_state"]["tables"].items()} == {"table": (100_000, DIM)}


@pytest.mark.parametrize("fmt", ["ckpt.h5", "ckpt"])
def test_checkpoint_restore_equals_never_stopping(fmt, backend, init, rng, tmp_path):
    device = ss.get_backend(backend).device
    data = batches(rng, 40, device)
    straight, straight_opts = offloaded_model(backend, *init)
    train(straight, straight_opts, data)

    model, opts = offloaded_model(backend, *init)
    train(model, opts, data[:15])
    model.users.save(tmp_path / f"users-{fmt}")
    model.items.save(tmp_path / f"items-{fmt}")
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opts[0].state_dict()}, saved)

    other = [np.ones_like(init[0]), np.ones_like(init[1]), init[2]]
    model, opts = offloaded_model(backend, *other)
    saved.seek(0)
    state = torch.load(saved)
    model.load_state_dict(state["model"])
    opts[0].load_state_dict(state["opt"])
    model.users.load(tmp_path / f"users-{fmt}")
    model.items.load(tmp_path / f"items-{fmt}")
    train(model, opts, data[15:])
    for part in ("users", "items"):
        mine, theirs = getattr(model, part), getattr(straight, part)
        np.testing.assert_array_equal(mine.table.to_numpy(), theirs.table.to_numpy())
        for name, table in mine._state.tables.items():
            np.testing.assert_array_equal(table.to_numpy(), theirs._state.tables[name].to_numpy())
    for name, value in model.named_parameters():
        if "proj" in name:
            assert torch.equal(value, straight.get_parameter(name))


def test_mmap_storage_trains_in_files(backend, init, rng, tmp_path):
    device = ss.get_backend(backend).device
    data = batches(rng, 20, device)
    in_ram, ram_opts = offloaded_model(backend, *init)
    on_disk, disk_opts = offloaded_model(backend, *init, storage="mmap", path=tmp_path)
    train(in_ram, ram_opts, data)
    train(on_disk, disk_opts, data)
    on_disk.users.table.flush()
    np.testing.assert_array_equal(np.load(tmp_path / "users" / "table.npy"),
                                  in_ram.users.table.to_numpy())
    assert (tmp_path / "users" / "exp_avg_sq.npy").exists()


def test_a_capacity_overflow_names_the_table_and_its_max_rows(backend):
    """A click model has one embedding per feature; the overflow said "the working set holds at
    most 4" and offered "more rows in the model's nn.Embedding", naming neither the table nor
    max_rows, so a user with several tables could not tell which one to enlarge."""
    small = ss.OffloadedEmbedding(50, DIM, max_rows=4, backend=backend)
    large = ss.OffloadedEmbedding(70, DIM, max_rows=40, backend=backend)
    opt = torch.optim.Adagrad([small.weight, large.weight])
    small.attach(opt)
    large.attach(opt)
    large(torch.arange(30))
    with pytest.raises(ss.CapacityError, match=r"5 distinct rows of the OffloadedEmbedding\(50, "
                       rf"{DIM}\)'s table.* at most 4.*max_rows=4"):
        small(torch.arange(5))
    with pytest.raises(ss.CapacityError, match=r"OffloadedEmbedding\(70, .* at most 40.*max_rows=40"):
        large(torch.arange(30, 70))


def test_errors_change_nothing(backend, init, tmp_path):
    device = ss.get_backend(backend).device
    emb = ss.OffloadedEmbedding(50, DIM, max_rows=4, backend=backend)
    with pytest.raises(ss.StateError, match="attach"):
        emb(torch.tensor([1]))
    opt = torch.optim.Adam(emb.parameters())
    emb.attach(opt)
    before = emb.table.to_numpy(copy=True)
    with pytest.raises(ss.CapacityError, match="at most 4"):
        emb(torch.tensor([1, 2, 3, 4, 5], device=device))
    with pytest.raises(ss.IdError):
        emb(torch.tensor([50], device=device))
    with pytest.raises(ss.DTypeError):
        emb(torch.tensor([1.0], device=device))
    emb(torch.tensor([1, 2], device=device)).sum().backward()
    with pytest.raises(ss.CapacityError):  # two more rows would overflow this step's set
        emb(torch.tensor([3, 4, 5], device=device))
    opt.step()
    trained = emb.table.to_numpy(copy=True)
    assert (trained[[1, 2]] != before[[1, 2]]).all()
    np.testing.assert_array_equal(np.delete(trained, [1, 2], 0), np.delete(before, [1, 2], 0))

    other = ss.OffloadedEmbedding(51, DIM, max_rows=4, backend=backend)
    other.attach(torch.optim.Adam(other.parameters()))
    other.save(tmp_path / "other.h5")
    with pytest.raises(ss.FileFormatError):
        emb.load(tmp_path / "other.h5")
    sgd_emb = ss.OffloadedEmbedding(50, DIM, max_rows=4, backend=backend)
    sgd_emb.attach(torch.optim.SGD(sgd_emb.parameters(), lr=0.1))
    sgd_emb.save(tmp_path / "sgd")
    with pytest.raises(ss.FileFormatError, match="optimizer"):
        emb.load(tmp_path / "sgd")
    bare = ss.OffloadedEmbedding(51, DIM, max_rows=4, backend=backend)  # e.g. built for evaluation
    with pytest.raises(ss.FileFormatError, match="holds Adam optimizer state, but no optimizer is "
                                                 "attached here; load it where a torch.optim.Adam is"):
        bare.load(tmp_path / "other.h5")
    np.testing.assert_array_equal(emb.table.to_numpy(), trained)
    with pytest.raises(ss.OptionError, match="element-wise"):
        emb.attach(torch.optim.LBFGS(emb.parameters()))


def test_npy_path_exports_and_imports_the_table_alone(backend, rng, tmp_path):
    emb = ss.OffloadedEmbedding(USERS, DIM, max_rows=BATCH, backend=backend)
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ids = torch.from_numpy(zipf(rng, USERS, BATCH)).to(emb.table.device)
    emb(ids).square().sum().backward()
    opt.step()
    opt.zero_grad()
    trained = emb.table.to_numpy(copy=True)
    state = {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()}
    emb.save(tmp_path / "vectors.npy")
    assert (tmp_path / "vectors.npy").is_file()  # a plain numpy file, not a directory
    np.testing.assert_array_equal(np.load(tmp_path / "vectors.npy"), trained)

    pretrained = rng.standard_normal((USERS, DIM)).astype(np.float32)
    np.save(tmp_path / "pretrained.npy", pretrained)
    emb.load(tmp_path / "pretrained.npy")
    np.testing.assert_array_equal(emb.table.to_numpy(), pretrained)
    for name, table in emb._state.tables.items():  # optimizer state is left as it was
        np.testing.assert_array_equal(table.to_numpy(), state[name])
    np.save(tmp_path / "short.npy", pretrained[:-1])
    with pytest.raises(ss.FileFormatError, match="holds"):
        emb.load(tmp_path / "short.npy")
    np.testing.assert_array_equal(emb.table.to_numpy(), pretrained)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_slots_with_gradients_written_by_hand_train_as_autograd_does(backend, optimizer, rng):
    device = ss.get_backend(backend).device
    start = rng.standard_normal((USERS, DIM), dtype=np.float32)
    start[0] = 0  # the padding row
    data_seed, tables = int(rng.integers(2**31)), []
    for by_hand in (False, True):
        emb = ss.OffloadedEmbedding(USERS, DIM, max_rows=BATCH, backend=backend, padding_idx=0)
        emb.table.apply_(lambda t: t.copy_(torch.from_numpy(start)))
        opt = optimizer(emb.parameters(), lr=0.01)
        emb.attach(opt)
        grad = torch.zeros_like(emb.weight)
        data = np.random.default_rng(data_seed)  # the same batches both ways
        for _ in range(20):
            ids = torch.from_numpy(zipf(data, USERS, BATCH)).to(device)  # repeats, and the padding row
            if by_hand:  # d/dw of sum(w**2) is 2w, summed over the repeats of a row
                slots = emb.slots(ids)
                assert torch.equal(emb.working_rows[slots], ids) and emb.working_rows[0] == 0
                assert len(emb.working_rows) == len(torch.unique(torch.cat([ids, ids.new_zeros(1)])))
                rows = emb.weight.detach()[slots]
                grad[:len(emb.working_rows)].zero_().index_add_(0, slots, 2 * rows * (ids != 0).unsqueeze(1))
                emb.weight.grad = grad
            else:
                opt.zero_grad()
                emb(ids).square().sum().backward()
            opt.step()
            assert len(emb.working_rows) == 0  # the step's end empties the working set
        tables.append(emb.table.to_numpy(copy=True))
    np.testing.assert_allclose(tables[1], tables[0], **TOL)
    assert not tables[1][0].any() and (tables[1] != start).any()


def test_slots_checks_ids_once_and_changes_nothing_when_it_refuses(backend):
    device = ss.get_backend(backend).device
    emb = ss.OffloadedEmbedding(50, DIM, max_rows=4, backend=backend)
    with pytest.raises(ss.StateError, match="attach"):
        emb.slots(torch.tensor([1]))
    emb.attach(torch.optim.SGD(emb.parameters(), lr=0.1))
    for bad, error in (([1, 2, 3, 4, 5], ss.CapacityError), ([50], ss.IdError), ([1.0], ss.DTypeError)):
        with pytest.raises(error):
            emb.slots(torch.tensor(bad, device=device))
        assert len(emb.working_rows) == 0
    # New rows take the next free slots, in ascending id order.
    assert emb.slots(torch.tensor([3, 7], device=device)).tolist() == [0, 1]
    assert emb.slots(torch.tensor([[9, 3], [7, 5]], device=device)).tolist() == [[3, 0], [1, 2]]
    emb.close()
    with pytest.raises(ss.StateError, match="closed"):
        emb.slots(torch.tensor([1]))


@pytest.mark.parametrize("cache_rows", [0, NUM_ROWS // 10])
@pytest.mark.parametrize("how", ["zero_grad", "discard_step", "before_backward"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum", "adagrad"])
def test_a_skipped_step_leaves_the_rows_of_its_forwards_alone(optimizer, how, cache_rows, backend, rng):
    """A step skipped (a loss that was not finite, a GradScaler's inf) trains nothing, as in memory.

    ``zero_grad()`` drops the skipped forwards' rows with their gradients;
    after ``zero_grad(set_to_none=False)`` ``discard_step()`` does. A step
    skipped before its backward leaves its forwards' rows in the next step,
    which puts back those no backward reached. The reference trains only
    the steps that ran.
    """
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 80, device)
    skipped = rng.random(len(batches)) < 0.3
    # The table is then read with the skipped forward's rows still held; before its backward
    # nothing can tell a skipped step from one whose backward is still to come.
    skipped[-1] = how != "before_backward"
    # The rows of steps skipped before their backward stay in the working set until a step ends.
    capacity = NUM_ROWS if how == "before_backward" else CAPACITY
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=capacity, storage="pageable", backend=backend,
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = OPTIMIZERS[optimizer](emb.parameters())
    emb.attach(opt)
    for (pos, neg, ctx), skip in zip(batches, skipped):
        loss = skipgram_loss(emb(pos), emb(neg), ctx)
        if skip and how == "before_backward":
            opt.zero_grad()  # the loss was not finite, say: no backward
            continue
        loss.backward()
        if not skip:
            opt.step()
            opt.zero_grad()
        elif how == "zero_grad":
            opt.zero_grad()
        else:
            opt.zero_grad(set_to_none=False)
            emb.discard_step()
            # The gradient is zeros, as an in-memory table's after zero_grad(set_to_none=False).
            assert not len(emb.working_rows) and not emb.weight.grad.any()
    emb.flush()
    ran = [batch for batch, skip in zip(batches, skipped) if not skip]
    assert 0 < len(ran) < len(batches)
    expected = run_in_memory(OPTIMIZERS[optimizer], table0, ran, device, initial_state=torch_initial)
    assert_same((emb.table.to_numpy(copy=True), {k: t.to_numpy(copy=True) for k, t in emb._state.tables.items()}),
                expected)


def test_a_frozen_embedding_trains_nothing_and_does_not_fail(backend, rng):
    """weight.requires_grad_(False), as when only other layers train: forwards work, rows stay."""
    emb = ss.OffloadedEmbedding(20, 3, max_rows=8, storage="pageable", backend=backend)
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    emb.weight.requires_grad_(False)
    before = emb.table.to_numpy(copy=True)
    head = torch.nn.Linear(3, 1)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.1)
    for _ in range(3):
        ids = torch.from_numpy(rng.integers(0, 20, 6)).to(ss.get_backend(backend).device)
        head(emb(ids).cpu()).sum().backward()
        opt.step()
        head_opt.step()
        opt.zero_grad()
        head_opt.zero_grad()
    np.testing.assert_array_equal(emb.table.to_numpy(), before)


def test_a_gradient_cleared_after_a_step_that_raised_stays_cleared(rng):
    """A check that raises inside optimizer.step(), then zero_grad(): the batch is dropped, as in memory."""
    table0 = rng.standard_normal((20, 3)).astype(np.float32)
    emb = ss.OffloadedEmbedding(20, 3, max_rows=8, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.Adam(emb.parameters(), lr=0.1, eps=1e-30)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SparseAdam([ref], lr=0.1, eps=1e-30)

    class Skip(Exception):
        pass

    def refuse_once(*_):
        if refuse_once.armed:
            refuse_once.armed = False
            raise Skip
    refuse_once.armed = False
    opt.register_step_pre_hook(refuse_once)  # after the embedding's own hook
    for step, ids in enumerate([[1, 2, 3], [3, 4], [5, 6], [3, 6]]):
        ids = torch.tensor(ids)
        emb(ids).pow(2).sum().backward()
        refuse_once.armed = step == 1
        try:
            opt.step()
        except Skip:
            pass
        opt.zero_grad()
        if step != 1:
            torch.nn.functional.embedding(ids, ref, sparse=True).pow(2).sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_same_rows_is_exact_with_nan_equal_to_nan_as_both_embeddings_ask_it(dtype, rng):
    """same_rows answers whether a step's rows were written, for OffloadedEmbedding (_rows_changed, assigned
    weight.data) and ShardedOffloadedEmbedding (_owned_rows_changed, which asked torch.allclose with rtol=0,
    atol=0, equal_nan=True). Random rows, each changed in at most one element to a value drawn from random
    ones, signed zeros, infinities and NaN, against an element by element reference in Python floats."""
    from speedswap.train.scratch_writes import same_rows
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]
    a = rng.standard_normal((64, 5))
    a.flat[rng.choice(a.size, 40, replace=False)] = rng.choice(specials, 40)
    b = a.copy()
    changed = rng.random(64) < 0.5
    for row in np.flatnonzero(changed):
        b[row, rng.integers(5)] = rng.choice(specials + [float(rng.standard_normal())])
    a, b = torch.from_numpy(a).to(dtype), torch.from_numpy(b).to(dtype)
    expected = [all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(ra.tolist(), rb.tolist()))
                for ra, rb in zip(a, b)]
    assert same_rows(a, b).tolist() == expected
    assert [torch.allclose(ra, rb, rtol=0, atol=0, equal_nan=True) for ra, rb in zip(a, b)] == expected
    assert not all(expected) and any(expected)  # both answers drawn (each all but certain)


@pytest.mark.parametrize("cache_rows", [0, 6])
def test_sam_perturbs_the_rows_between_two_passes_and_trains_as_in_memory(cache_rows, rng):
    """Sharpness-aware minimisation: backward, perturb weight in place, zero_grad, forward and
    backward again, undo the perturbation, step. zero_grad() between the passes is not a skipped step."""
    table0 = rng.standard_normal((20, 3)).astype(np.float32)
    emb = ss.OffloadedEmbedding(20, 3, max_rows=16, storage="pageable", backend="numpy",
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(6):
        ids = torch.from_numpy(rng.integers(0, 20, 5))
        for model, optimizer in ((emb, opt), (ref, ref_opt)):
            (model(ids) ** 3).sum().backward()
            with torch.no_grad():
                e = 0.05 * model.weight.grad / model.weight.grad.norm()
                model.weight.add_(e)
            optimizer.zero_grad()
            (model(ids) ** 3).sum().backward()
            with torch.no_grad():
                model.weight.sub_(e)
            optimizer.step()
            optimizer.zero_grad()
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prefetch", [False, True])
def test_rprop_rows_start_from_the_lr_of_the_first_step_as_torch_creates_them(prefetch, rng):
    """A scheduler built after attach changes lr before torch creates Rprop's step_size; rows a
    prefetch cached before the first step must get it too, in the cache as in the tables."""
    table0 = rng.standard_normal((20, 3)).astype(np.float32)
    emb = ss.OffloadedEmbedding(20, 3, max_rows=4, storage="pageable", backend="numpy",
                                cache_rows=8 if prefetch else 0)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.Rprop(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False)
    ref_opt = torch.optim.Rprop(ref.parameters(), lr=0.1)
    if prefetch:
        assert emb.prefetch(torch.tensor([5, 6, 7])) == 3
    for optimizer in (opt, ref_opt):
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 0.1)  # lr 0.1 -> 0.01 now
    for ids in ([1], [5], [6, 7]):  # rows touched once: lazy Rprop is dense Rprop on them
        for model, optimizer in ((emb, opt), (ref, ref_opt)):
            model(torch.tensor(ids)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cache_rows", [0, 6])
def test_a_backward_after_the_step_of_its_forward_is_refused(cache_rows, rng):
    """A graph kept across optimizer.step() (retain_graph=True): its gradient has no rows left to train.

    In memory it would count at the next step; offloaded it would land on slots
    that hold other rows. The backward raises before any gradient reaches them,
    and the next step trains as if it had not been called.
    """
    table0 = rng.standard_normal((20, 3)).astype(np.float32)
    emb = ss.OffloadedEmbedding(20, 3, max_rows=8, storage="pageable", backend="numpy", cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.Adam(emb.parameters(), lr=0.1, eps=1e-30)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SparseAdam([ref], lr=0.1, eps=1e-30)
    kept = None
    for step, ids in enumerate([[1, 2, 3], [3, 4], [5, 6], [3, 6]]):
        ids = torch.tensor(ids)
        loss = (emb(ids) ** 3).sum()
        loss.backward(retain_graph=True)
        if step == 1:
            with pytest.raises(ss.StateError, match="already run"):
                kept.backward()
            assert emb.weight.grad is not None and emb.weight.grad[len(emb.working_rows):].eq(0).all()
        opt.step()
        opt.zero_grad()
        kept = loss
        (torch.nn.functional.embedding(ids, ref, sparse=True) ** 3).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_attaching_the_same_optimizer_again_restarts_its_state_step_count_included(rng):
    """attach(restart=True) starts the offloaded state afresh: Adam's bias correction must restart with its moments."""
    table0 = rng.standard_normal((20, 3)).astype(np.float32)
    emb = ss.OffloadedEmbedding(20, 3, max_rows=8, storage="pageable", backend="numpy")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1, eps=1e-30)
    emb.attach(opt)
    for ids in ([1, 2], [2, 3]):
        (emb(torch.tensor(ids)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    emb.attach(opt, restart=True)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SparseAdam([ref], lr=0.1, eps=1e-30)
    for ids in ([4, 5], [5, 1], [1, 2, 4]):
        ids = torch.tensor(ids)
        (emb(ids) ** 3).sum().backward()
        opt.step()
        opt.zero_grad()
        (torch.nn.functional.embedding(ids, ref, sparse=True) ** 3).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind, options", [(ss.OffloadedEmbedding, {}), (ss.OffloadedEmbedding, {"cache_rows": 60}),
                                           (ss.ShardedOffloadedEmbedding, {})], ids=["plain", "cached", "sharded"])
@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.Adagrad, EagerStateAdagrad])
def test_a_restart_right_after_the_optimizers_load_state_dict_starts_it_afresh(make, kind, options, rng, tmp_path):
    """A resume (emb.load, then the optimizer's load_state_dict, as documented), then
    attach(optimizer, restart=True) before any step: the restart kept the loaded state (Adam's step
    count, the saved scratch) and the next step raised StateError "per-row state ... was replaced",
    advising init_state(), which would have kept the loaded step count. Now it trains as a fresh
    optimizer of its kind, in memory, lazily, from the loaded rows."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 8, "cpu")
    opt_options = dict(lr=0.05, eps=1e-30) if make is torch.optim.Adam else dict(lr=0.05)

    def train(emb, opt, steps):
        for pos, neg, ctx in steps:
            skipgram_loss(emb(pos), emb(neg), ctx).backward()
            opt.step()
            opt.zero_grad()

    emb = kind(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy", **options)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(emb.parameters(), **opt_options)
    emb.attach(opt)
    train(emb, opt, batches[:4])
    emb.save(tmp_path / "ckpt")
    saved = copy.deepcopy(opt.state_dict())
    emb.close()
    emb = kind(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy", **options)
    opt = make(emb.parameters(), **opt_options)
    emb.attach(opt)
    emb.load(tmp_path / "ckpt")
    opt.load_state_dict(saved)
    emb.attach(opt, restart=True)
    loaded = emb.table.to_numpy(copy=True)
    train(emb, opt, batches[4:])
    expected, expected_state = run_in_memory(lambda p: make(p, **opt_options), loaded, batches[4:], "cpu",
                                             initial_state=torch_initial)
    assert int(opt.state[emb.weight]["step"]) == len(batches[4:])
    np.testing.assert_allclose(emb.table.to_numpy(), expected, **TOL)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), expected_state[name], err_msg=name, **TOL)


@pytest.mark.parametrize("kind, options", [(ss.OffloadedEmbedding, {}), (ss.OffloadedEmbedding, {"cache_rows": 60}),
                                           (ss.ShardedOffloadedEmbedding, {})], ids=["plain", "cached", "sharded"])
def test_attaching_the_attached_optimizer_again_by_mistake_is_refused_and_training_goes_on_as_in_memory(
        rng, tmp_path, kind, options):
    """An attach left inside the training loop (a notebook cell run twice) restarted Adam's moments and
    step count for the table, silently: training went on unlike the same Adam in memory. Once the
    optimizer trained the table (steps, or a checkpoint loaded) it is refused, nothing changed, unless
    restart=True; before any step there is nothing to lose and it is taken."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 12, "cpu")
    make = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    emb = kind(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy", **options)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(emb.parameters())
    emb.attach(opt)
    emb.attach(opt)  # nothing trained yet
    for step, (pos, neg, ctx) in enumerate(batches):
        if step == 6:
            table = emb.table.to_numpy(copy=True)
            state = {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()}
            with pytest.raises(ss.StateError, match=r"attached to this \w+ already.*restart=True"):
                emb.attach(opt)
            with pytest.raises(ss.OptionError, match="restart"):
                emb.attach(opt, restart="yes")
            np.testing.assert_array_equal(emb.table.to_numpy(), table)
            for name, values in state.items():
                np.testing.assert_array_equal(emb._state.tables[name].to_numpy(), values, err_msg=name)
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        opt.step()
        opt.zero_grad()
    expected, expected_state = run_in_memory(make, table0, batches, "cpu", initial_state=lambda name, group: 0.0)
    np.testing.assert_allclose(emb.table.to_numpy(), expected, **TOL)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), expected_state[name], err_msg=name, **TOL)
    # A resume: the checkpoint loaded into a new Adam is trained state too.
    emb.save(tmp_path / "ckpt")
    emb.close()
    emb = kind(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy", **options)
    opt = make(emb.parameters())
    emb.attach(opt)
    emb.load(tmp_path / "ckpt")
    with pytest.raises(ss.StateError, match="restart=True"):
        emb.attach(opt)
    emb.attach(opt, restart=True)  # on purpose: a fresh Adam over the loaded table
    for name, table in emb._state.tables.items():
        assert not table.to_numpy().any(), name


@pytest.mark.parametrize("cache_rows", [0, 10])
@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.SparseAdam])
def test_an_attach_by_mistake_after_init_state_is_refused_for_the_step_count_it_would_drop(make, cache_rows, rng):
    """init_state() restarts the rows' moments and leaves the step count going on, so the tables were as
    fresh as at attach: attaching the same optimizer again was taken, and silently restarted its step
    count (Adam's bias correction) as well. The count is trained state too; restart=True takes it."""
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    batches = zipf_batches(rng, 8, "cpu")
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pageable", backend="numpy",
                                cache_rows=cache_rows)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = make(emb.parameters(), lr=0.05, eps=1e-30)  # Adam then trains as SparseAdam does
    emb.attach(opt)

    def train(steps):
        for pos, neg, ctx in steps:
            skipgram_loss(emb(pos), emb(neg), ctx).backward()
            opt.step()
            opt.zero_grad()

    train(batches[:3])
    emb.init_state()  # the moments restart; the count, 3, goes on
    with pytest.raises(ss.StateError, match=r"attached to this OffloadedEmbedding already.*restart=True"):
        emb.attach(opt)
    train(batches[3:])
    # What went on is SparseAdam in memory whose moment tensors were zeroed after 3 steps, its count kept.
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SparseAdam([ref], lr=0.05, eps=1e-30)
    for step, (pos, neg, ctx) in enumerate(batches):
        if step == 3:
            for name in ("exp_avg", "exp_avg_sq"):
                ref_opt.state[ref][name].zero_()
        rows = functools.partial(torch.nn.functional.embedding, weight=ref, sparse=True)
        skipgram_loss(rows(pos), rows(neg), ctx).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert int(opt.state[emb.weight]["step"]) == int(ref_opt.state[ref]["step"]) == len(batches)
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), **TOL)


@pytest.mark.parametrize("cache_rows", [0, 10])
@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_nn_embedding_gradient_options_train_as_nn_embedding_does(backend, rng, cache_rows, option):
    """``scale_grad_by_freq`` (Adagrad: lazy equals dense) and ``sparse`` (SparseAdam), Zipf ids with repeats.

    torch refuses the two options together, so each has its own reference.
    """
    rows, dim = 60, 4
    table0 = rng.standard_normal((rows, dim)).astype(np.float32)
    device = ss.get_backend(backend).device
    emb = ss.OffloadedEmbedding(rows, dim, max_rows=40, storage="pageable", backend=backend,
                                padding_idx=2, cache_rows=cache_rows, **{option: True})
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False,
                                             padding_idx=2, **{option: True})
    optimizer = (torch.optim.SparseAdam if option == "sparse"
                 else functools.partial(torch.optim.Adagrad, initial_accumulator_value=0.1))
    opt, ref_opt = optimizer(emb.parameters(), lr=0.05), optimizer(ref.parameters(), lr=0.05)
    emb.attach(opt)
    for step in range(60):
        ids = torch.from_numpy(zipf(rng, rows, (5, 4)))
        target = torch.from_numpy(rng.standard_normal((5, 4, dim)).astype(np.float32))
        for model, optim, to in ((emb, opt, device), (ref, ref_opt, "cpu")):
            # Two forwards a step: each counts its own ids, as nn.Embedding's do.
            loss = ((model(ids.to(to)).cpu() - target) ** 2).sum() + model(ids[:2].to(to)).cpu().sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
        if step == 30:
            emb.flush()
            np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)


@pytest.mark.parametrize("cache_rows", [0, 8])
def test_a_step_whose_optimizer_raised_after_counting_it_counts_once_when_retried(backend, cache_rows, rng):
    """The rows and state of a step whose optimizer raised are read back as they were, for a retry;
    Adam's step count, which it had incremented in place before it updated the rows, was not: the
    retry counted the step twice, and the bias correction ran ahead from then on."""
    table0 = torch.from_numpy(rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32))
    batches = [torch.from_numpy(zipf(rng, NUM_ROWS, BATCH)) for _ in range(9)]
    runs = []
    for failing in (set(), {1, 4, 7}):
        emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=2 * BATCH, storage="pageable", backend=backend,
                                    cache_rows=cache_rows)
        emb.table.apply_(lambda t: t.copy_(table0))
        opt = torch.optim.Adam(emb.parameters(), lr=0.05)
        emb.attach(opt)
        for step, ids in enumerate(batches):
            emb(ids.to(emb.weight.device)).pow(2).sum().backward()
            if step in failing:
                with failing_after_its_update(opt), pytest.raises(RuntimeError, match="injected failure"):
                    opt.step()
            opt.step()
            opt.zero_grad()
        emb.flush()
        runs.append((int(opt.state[emb.weight]["step"]), emb.table.to_numpy(copy=True),
                     {name: table.to_numpy(copy=True) for name, table in emb._state.tables.items()}))
    (steps, table, state), (failed_steps, failed_table, failed_state) = runs
    assert failed_steps == steps == len(batches)
    assert not np.array_equal(table, table0.numpy())
    np.testing.assert_array_equal(failed_table, table)
    assert sorted(failed_state) == sorted(state) == ["exp_avg", "exp_avg_sq"]
    for name in state:
        np.testing.assert_array_equal(failed_state[name], state[name])
    assert not np.allclose(emb.table.to_numpy(), table0, atol=1e-3)

@pytest.mark.parametrize("option", [dict(max_norm=1.0), dict(norm_type=1.0)])
def test_max_norm_is_refused_with_the_reason(option):
    with pytest.raises(ss.OptionError, match="max_norm"):
        ss.OffloadedEmbedding(10, 3, max_rows=4, storage="pageable", backend="numpy", **option)


def test_a_norm_type_alone_is_told_to_leave_norm_type_out():
    """norm_type=1.0 without max_norm (which nn.Embedding ignores) was told to 'leave max_norm out',
    which it had: the remedy named the one argument the call did not pass."""
    with pytest.raises(ss.OptionError, match=r"norm_type=1\.0.* leave max_norm and norm_type out"):
        ss.OffloadedEmbedding(10, 3, max_rows=4, storage="pageable", backend="numpy", norm_type=1.0)


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
@pytest.mark.parametrize("given, instead", [
    (lambda rows: dict(_weight=rows), r"_weight=: .*(from_pretrained|emb\.table\.apply_)"),
    (lambda rows: dict(_weight=rows, _freeze=True), r"_freeze=: .*(freeze=True|torch\.no_grad)"),
    (lambda rows: dict(mode="sum", include_last_offset=True), r"mode= and include_last_offset=: .*bag_sum"),
    (lambda rows: dict(per_sample_weights=rows[:, 0]), r"per_sample_weights=: .*forward argument.*bag_sum"),
    (lambda rows: dict(max_row=4), r"max_row=: no such argument"),
])
def test_other_nn_embedding_and_bag_arguments_are_refused_saying_what_to_do_instead(cls, given, instead, rng,
                                                                                      tmp_path):
    """nn.Embedding's _weight/_freeze and nn.EmbeddingBag's arguments raised Python's bare TypeError
    (an unexpected keyword), naming one of them and nothing to do instead."""
    rows = torch.from_numpy(rng.standard_normal((10, 3)).astype(np.float32))
    generator = torch.get_rng_state()
    with pytest.raises(ss.DTypeError, match=instead) as refused:
        cls(10, 3, max_rows=4, storage="mmap", path=tmp_path / "emb", backend="numpy", **given(rows))
    assert isinstance(refused.value, TypeError)  # as Python's, for code that catches that
    assert "It takes num_embeddings, embedding_dim, max_rows" in str(refused.value)
    assert not (tmp_path / "emb").exists()  # nothing was built: no table file, no random rows drawn
    assert torch.equal(torch.get_rng_state(), generator)


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
def test_the_constructor_signature_shows_no_private_argument(cls, tmp_path):
    """OffloadedEmbedding's signature (inspect.signature, help()) showed from_pretrained's private
    _initialise=True as a keyword to pass: given False, it built a table of whatever the memory held."""
    names = list(inspect.signature(cls).parameters)
    assert [name for name in names if name.startswith("_")] == [], names
    with pytest.raises(ss.DTypeError, match="_initialise=: no such argument"):
        cls(10, 3, max_rows=4, storage="mmap", path=tmp_path / "emb", backend="numpy", _initialise=False)
    assert not (tmp_path / "emb").exists()


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
@pytest.mark.parametrize("max_rows", [{"max_rows": 4}, {}])
def test_nn_embeddings_positional_padding_idx_is_refused_saying_to_pass_it_by_keyword(cls, max_rows, rng,
                                                                                      tmp_path):
    """``cls(n, d, 0)``, nn.Embedding's padding_idx by position, raised Python's bare TypeError (takes 3
    positional arguments but 4 were given, or a missing max_rows), naming neither what the 0 would be
    read as nor what to write instead."""
    padding_idx = int(rng.integers(0, 10))
    generator = torch.get_rng_state()
    with pytest.raises(ss.DTypeError, match=rf"by position.*nn\.Embedding.*padding_idx={padding_idx}.*"
                                            rf"by keyword.*max_rows=") as refused:
        cls(10, 3, padding_idx, storage="mmap", path=tmp_path / "emb", backend="numpy", **max_rows)
    assert isinstance(refused.value, TypeError)  # as Python's, for code that catches that
    assert not (tmp_path / "emb").exists()  # nothing was built: no table file, no random rows drawn
    assert torch.equal(torch.get_rng_state(), generator)
    emb = cls(10, 3, padding_idx=padding_idx, max_rows=4, backend="numpy").eval()  # the keyword way works
    np.testing.assert_array_equal(emb(torch.tensor([padding_idx])).detach().numpy(), np.zeros((1, 3)))


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
def test_a_missing_max_rows_is_refused_saying_it_is_required_and_what_it_is(cls, rng, tmp_path):
    """``cls(n, d)`` without ``max_rows`` said "max_rows must be a positive int, got None", as if the
    user had passed None: not that the argument is required, nor how to choose it."""
    num_rows, dim = int(rng.integers(5, 50)), int(rng.integers(1, 9))
    generator = torch.get_rng_state()
    with pytest.raises(ss.OptionError, match=rf"{cls.__name__} needs max_rows=.*distinct rows.*"
                                            r"CapacityError") as refused:
        cls(num_rows, dim, storage="mmap", path=tmp_path / "emb", backend="numpy")
    assert "got None" not in str(refused.value)
    assert not (tmp_path / "emb").exists()  # nothing was built: no table file, no random rows drawn
    assert torch.equal(torch.get_rng_state(), generator)
    with pytest.raises(ss.OptionError, match=r"max_rows must be a positive int, got 0"):
        cls(num_rows, dim, max_rows=0, backend="numpy")  # a wrong value is still named as such


@pytest.mark.parametrize("source", ["array", "tensor", "npy"])
def test_from_pretrained_starts_from_the_rows_and_trains_like_nn_embedding(rng, tmp_path, source):
    rows = rng.standard_normal((60, 5)).astype(np.float32)
    np.save(tmp_path / "vectors.npy", rows)
    given = {"array": rows, "tensor": torch.from_numpy(rows.copy()), "npy": tmp_path / "vectors.npy"}[source]
    frozen = ss.OffloadedEmbedding.from_pretrained(given, max_rows=16, backend="numpy", padding_idx=3)
    ids = torch.from_numpy(rng.integers(0, 60, (4, 6)))
    out = frozen(ids)  # training mode, no attach: a frozen table is read directly
    assert not out.requires_grad
    np.testing.assert_array_equal(out.numpy(), rows[ids.numpy()])  # the padding row kept, as nn.Embedding
    emb = ss.OffloadedEmbedding.from_pretrained(given, freeze=False, max_rows=16, backend="numpy")
    # Dense gradients, bit for bit: sparse-gradient Adagrad coalesces repeated ids and divides then adds.
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(rows.copy()), freeze=False)
    opt, ref_opt = torch.optim.Adagrad(emb.parameters(), lr=0.1), torch.optim.Adagrad(ref.parameters(), lr=0.1)
    emb.attach(opt)
    for _ in range(5):
        ids = torch.from_numpy(rng.integers(0, 60, (4, 3)))
        for module, optimizer in ((emb, opt), (ref, ref_opt)):
            (module(ids) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_array_equal(emb.table.to_numpy(), ref.weight.detach().numpy())


@pytest.mark.parametrize("source", ["array", "tensor", "npy"])
@pytest.mark.parametrize("storage", ["pageable", "mmap"])
def test_from_pretrained_draws_no_random_numbers_as_nn_embedding_draws_none(rng, tmp_path, source, storage):
    """from_pretrained drew nn.Embedding's N(0, 1) for the whole table before copying the rows over
    it: torch's generator moved on, so a model built as in memory (pretrained tables, then Linear
    layers under one seed) started its other layers from other values, and the table was written
    twice (a file of an mmap table too)."""
    rows = rng.standard_normal((60, 5)).astype(np.float32)
    np.save(tmp_path / "vectors.npy", rows)
    given = {"array": rows, "tensor": torch.from_numpy(rows.copy()), "npy": tmp_path / "vectors.npy"}[source]
    before = torch.get_rng_state()
    emb = ss.OffloadedEmbedding.from_pretrained(given, max_rows=16, backend="numpy", padding_idx=3,
                                                storage=storage,
                                                path=tmp_path / "table" if storage == "mmap" else None)
    assert torch.equal(torch.get_rng_state(), before)
    torch.nn.Embedding.from_pretrained(torch.from_numpy(rows), padding_idx=3)
    assert torch.equal(torch.get_rng_state(), before)  # the reference's behaviour
    np.testing.assert_array_equal(emb.table.to_numpy(), rows)  # every row, the padding row's too
    emb.close()


def test_from_pretrained_reads_a_file_into_an_mmap_table_without_a_copy_in_ram(rng, tmp_path):
    """from_pretrained(path) staged the whole file in RAM (emb.load's all-or-nothing copy, for a
    table in use) before writing the new table: at 10^7 x 32 float32 it held 2.4 GB of anonymous
    memory for a 1.2 GB table, and an mmap table, meant for tables larger than RAM, needed the file
    in RAM once more. A new table has no rows to keep; the file goes straight into it."""
    rows = rng.standard_normal((20_000, 16)).astype(np.float32)  # 1.28 MB: one chunk
    np.save(tmp_path / "vectors.npy", rows)
    tracemalloc.start()  # numpy's allocations are traced; the mmap table's pages are not
    try:
        emb = ss.OffloadedEmbedding.from_pretrained(tmp_path / "vectors.npy", max_rows=16, backend="numpy",
                                                    storage="mmap", path=tmp_path / "table")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < rows.nbytes / 4, f"from_pretrained allocated {peak} bytes for a {rows.nbytes}-byte file"
    np.testing.assert_array_equal(emb.table.to_numpy(), rows)
    emb.close()


def test_attach_leaves_the_new_state_files_of_an_mmap_embedding_sparse(rng, tmp_path):
    """attach() wrote Adam's zeros into state files that were created as sparse files of zeros:
    at 10^7 x 32 that made 2.5 GB of disk dense and left it dirty in the page cache, and the first
    training steps waited for its write-back (0.5-1.3 s a step against 3-10 ms once it was written)."""
    probe = ss.HostTable.empty(20_000, 16, storage="mmap", path=tmp_path / "probe.npy", backend="numpy")
    if os.stat(tmp_path / "probe.npy").st_blocks * 512 >= probe.to_numpy().nbytes:
        pytest.skip("this file system stores no sparse files")
    probe.close()
    emb = ss.OffloadedEmbedding(20_000, 16, max_rows=64, storage="mmap", path=tmp_path / "emb", backend="numpy")
    opt = torch.optim.Adam(emb.parameters(), lr=0.01, eps=1e-30)  # SparseAdam adds eps elsewhere
    emb.attach(opt)
    emb.flush()
    for name in ("exp_avg", "exp_avg_sq"):
        file = tmp_path / "emb" / f"{name}.npy"
        assert os.stat(file).st_blocks * 512 < os.stat(file).st_size / 4, f"{name}.npy was written whole"
    table0 = emb.table.to_numpy(copy=True)
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False, sparse=True)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-30)
    for _ in range(3):  # the state rows read from the holes are torch's initial zeros
        ids = torch.from_numpy(rng.integers(0, 20_000, 50))
        for module, optimizer in ((emb, opt), (ref, ref_opt)):
            (module(ids) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)
    emb.close()


@pytest.mark.parametrize("make_opt", [
    lambda ps, offloaded: torch.optim.Adagrad(ps, lr=0.05),
    lambda ps, offloaded: (torch.optim.Adam if offloaded else torch.optim.SparseAdam)(ps, lr=0.01, eps=1e-30),
], ids=["adagrad", "adam"])
def test_padded_bags_summed_with_padding_idx_train_as_an_embedding_bag(rng, make_opt):
    """The README's pooled lookups: bags padded with padding_idx, looked up and summed, train as
    nn.EmbeddingBag(mode="sum", padding_idx=...) with sparse gradients (empty bags included)."""
    rows, pad, length = rng.standard_normal((300, DIM)), 0, 6
    rows[pad] = 0
    emb = ss.OffloadedEmbedding.from_pretrained(rows, freeze=False, max_rows=256, padding_idx=pad,
                                                backend="numpy")
    ref = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(rows.copy()), freeze=False, mode="sum",
                                                padding_idx=pad, sparse=True)
    opt, ref_opt = make_opt([emb.weight], True), make_opt([ref.weight], False)
    emb.attach(opt)
    for _ in range(20):
        ids = (rng.zipf(1.2, (32, length)) % 299) + 1
        ids[np.arange(length) >= rng.integers(0, length + 1, (32, 1))] = pad  # bags of 0 to 6 ids
        ids, target = torch.from_numpy(ids), torch.from_numpy(rng.standard_normal((32, DIM)))
        for pooled, optimizer in ((lambda: emb(ids).sum(1), opt), (lambda: ref(ids), ref_opt)):
            (pooled() - target).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=0, atol=1e-12)
    assert not emb.table.to_numpy()[pad].any()
    assert not np.allclose(emb.table.to_numpy(), rows, atol=1e-3)  # it trained


def test_adagrad_with_weight_decay_decays_the_touched_rows_only(rng):
    """torch refuses weight_decay with sparse gradients, so "sparse-gradient Adagrad" is no
    reference for it; the README says offloaded Adagrad then applies it lazily. The reference is
    Adagrad's update written out for the rows each step touches."""
    lr, wd, eps = 0.05, 0.1, 1e-10
    rows = rng.standard_normal((200, DIM))
    emb = ss.OffloadedEmbedding.from_pretrained(rows, freeze=False, max_rows=64, backend="numpy")
    opt = torch.optim.Adagrad([emb.weight], lr=lr, weight_decay=wd, eps=eps)
    emb.attach(opt)
    w, total = rows.copy(), np.zeros_like(rows)
    for _ in range(30):
        ids, target = rng.zipf(1.3, 40) % 200, rng.standard_normal((40, DIM))
        (emb(torch.from_numpy(ids)) - torch.from_numpy(target)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        grad = np.zeros_like(w)
        np.add.at(grad, ids, 2 * (w[ids] - target))
        touched = np.unique(ids)
        g = grad[touched] + wd * w[touched]
        total[touched] += g ** 2
        w[touched] -= lr * g / (np.sqrt(total[touched]) + eps)
    np.testing.assert_allclose(emb.table.to_numpy(), w, rtol=0, atol=1e-12)
    untouched = np.all(total == 0, axis=1)
    assert untouched.any()
    np.testing.assert_array_equal(emb.table.to_numpy()[untouched], rows[untouched])


def test_from_pretrained_refuses_rows_that_are_not_a_table(rng):
    with pytest.raises(ss.ShapeError, match="num_embeddings, embedding_dim"):
        ss.OffloadedEmbedding.from_pretrained(rng.standard_normal(10), max_rows=4, backend="numpy")
    with pytest.raises(ss.DTypeError, match="floating-point"):
        ss.OffloadedEmbedding.from_pretrained(np.ones((5, 2), np.int64), max_rows=4, backend="numpy")


@pytest.mark.parametrize("write", [
    lambda w: torch.nn.init.normal_(w, std=0.01),
    lambda w: w.detach().copy_(torch.ones_like(w)),
], ids=["initialiser", "copy_into_detached"])
@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding], ids=lambda cls: cls.__name__)
def test_a_write_into_weight_between_steps_is_refused_at_the_next_forward(rng, write, cls):
    """emb.weight is scratch between steps: writing it changes no row, so training would silently
    ignore it (an init loop over model.parameters(), a copy of pretrained vectors). A sharded
    embedding's is the rows its rank owns in a step (one process here)."""
    emb = cls(40, 3, max_rows=8, backend="numpy")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    for _ in range(2):
        table = emb.table.to_numpy(copy=True)
        write(emb.weight)
        with pytest.raises(ss.StateError, match=r"emb\.table\.apply_"):
            emb(torch.tensor([1, 2]))
        np.testing.assert_array_equal(emb.table.to_numpy(), table)  # nothing changed
        emb(torch.tensor([1, 2])).sum().backward()  # said once: training goes on
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("written", [False, True], ids=["own", "written_before"])
@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding], ids=lambda cls: cls.__name__)
def test_a_step_without_rows_writes_the_scratch_as_its_own_and_keeps_a_write_before_it_refused(rng, cls, written):
    """A step without rows on a zero gradient (zero_grad(set_to_none=False), no forward since) has
    Adam step the scratch alone (weight decay moves it): that write is the embedding's own, and the
    next forward goes on; a write into weight made before that step is still refused there."""
    emb = cls(40, 3, max_rows=8, backend="numpy")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1, weight_decay=0.1)
    emb.attach(opt)
    ids = torch.from_numpy(rng.integers(0, 40, 6))
    emb(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    if written:
        torch.nn.init.normal_(emb.weight)
    version = emb.weight._version
    opt.step()  # no forward since: a step without rows
    assert emb.weight._version > version, "the step without rows did not write the scratch: nothing tested"
    table = emb.table.to_numpy(copy=True)
    if written:
        with pytest.raises(ss.StateError, match=r"emb\.weight was written between steps"):
            emb(ids)
        np.testing.assert_array_equal(emb.table.to_numpy(), table)
    emb(ids).pow(2).sum().backward()  # said once, or nothing to say: training goes on
    opt.step()
    assert not np.array_equal(emb.table.to_numpy(), table)


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding], ids=lambda cls: cls.__name__)
def test_a_write_through_weight_data_before_attach_is_refused_there_and_the_advice_trains_as_in_memory(rng, cls):
    """``self.emb.weight.data.uniform_(-a, a)``, word2vec's initialisation in PyTorch code, keeps the
    weight's version: it wrote the scratch unseen, and training started from the table's N(0, 1) rows,
    silently (with them the vectors barely learn)."""
    class SkipGram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = cls(50, 4, max_rows=32, backend="numpy")
            self.emb.weight.data.uniform_(-0.5 / 4, 0.5 / 4)

    model = SkipGram()
    emb, table = model.emb, model.emb.table.to_numpy(copy=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ss.StateError, match=r"written through weight\.data before attach .* the table was not "
                                            r"changed. Write the table instead: emb\.table\.uniform_\(-a, a\)"):
        emb.attach(opt)
    np.testing.assert_array_equal(emb.table.to_numpy(), table)
    assert not opt.state
    emb.table.uniform_(-0.5 / 4, 0.5 / 4)  # the advice; then attach goes on (said once)
    emb.attach(opt)
    assert np.abs(emb.table.to_numpy()).max() <= 0.5 / 4
    _assert_steps_train_as_sgd_in_memory(emb, opt, rng)


def _assert_steps_train_as_sgd_in_memory(emb, opt, rng, lr=0.05):
    """Five steps of ``emb`` (a 50 x 4 table, SGD at ``lr``) on Zipf ids equal SGD on an ``nn.Embedding``."""
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.table.to_numpy(copy=True)), freeze=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for _ in range(5):
        ids = torch.from_numpy(rng.zipf(1.3, 24) % 50)
        ctx = torch.from_numpy(rng.standard_normal((24, 4), dtype=np.float32))
        for lookup, optimizer in ((emb, opt), (ref, ref_opt)):
            (lookup(ids) * ctx).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_a_table_left_unattached_is_named_by_its_sizes(rng):
    """Of a model's several tables, the one not attached said only "call emb.attach(optimizer)"."""
    items = ss.OffloadedEmbedding(60, 4, max_rows=16, backend="numpy")
    users = ss.OffloadedEmbedding(30, 4, max_rows=16, padding_idx=0, backend="numpy")
    opt = torch.optim.Adagrad([items.weight, users.weight], lr=0.1)
    items.attach(opt)  # users forgotten
    table = users.table.to_numpy(copy=True)
    items(torch.from_numpy(rng.integers(0, 60, 8)))
    with pytest.raises(ss.StateError, match=r"this OffloadedEmbedding\(30, 4, max_rows=16, storage='pinned', "
                                            r"padding_idx=0\) has no optimizer attached: call emb\.attach"):
        users(torch.from_numpy(rng.integers(0, 30, 8)))
    np.testing.assert_array_equal(users.table.to_numpy(), table)
    assert not len(users.working_rows)


def test_new_scratch_storage_before_attach_is_no_write_through_weight_data(rng):
    """to_empty() gives weight uninitialised storage, which attach must not take for a user's write; and the
    steps after it train the table's rows as in-memory SGD does (the test only ran the attach)."""
    emb = ss.OffloadedEmbedding(50, 4, max_rows=32, backend="numpy")
    emb.weight.data = torch.full_like(emb.weight, 7.0)  # new storage, as to_empty()'s, sure to be non-zero
    emb.to_empty(device="cpu")
    opt = torch.optim.SGD(emb.parameters(), lr=0.05)
    emb.attach(opt)
    table = emb.table.to_numpy(copy=True)
    # The 7.0 assigned before to_empty() was a write of the user's that reached no row: refused once, at the
    # first training forward, as ShardedOffloadedEmbedding refuses it; nothing changed.
    with pytest.raises(ss.StateError, match="written through weight.data = tensor"):
        emb(torch.tensor([1, 2]))
    np.testing.assert_array_equal(emb.table.to_numpy(), table)
    _assert_steps_train_as_sgd_in_memory(emb, opt, rng)


def test_a_state_dict_load_into_weight_is_not_taken_for_a_stray_write(rng):
    """The step after the load trains its rows as in-memory SGD does (the test only ran it: a step
    that raised failed it, one that trained nothing or the wrong rows passed)."""
    emb = ss.OffloadedEmbedding(40, 3, max_rows=8, backend="numpy")
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(emb.table.to_numpy(copy=True)), freeze=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    emb.load_state_dict(emb.state_dict())  # copies the scratch into weight
    ids = torch.from_numpy(rng.choice(40, size=4, replace=False))
    ctx = torch.from_numpy(rng.standard_normal((4, 3), dtype=np.float32))
    for lookup, optimizer in ((emb, opt), (ref, ref_opt)):
        (lookup(ids) * ctx).sum().backward()
        optimizer.step()
    # Distinct ids: each row takes one float32 multiply-add on both sides (fused or not: < 3e-8 apart).
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls, alternative", [(ss.OffloadedEmbedding, "ShardedOffloadedEmbedding"),
                                                (ss.ShardedOffloadedEmbedding, "DistributedDataParallel")])
def test_data_parallel_replicas_and_pickling_are_refused_with_the_alternative(tmp_path, cls, alternative):
    """A sharded embedding's replicas went through: each would write back the same shard."""
    import pickle
    emb = cls(10, 2, max_rows=4, backend="numpy")
    with pytest.raises(ss.OptionError, match=alternative):
        emb._replicate_for_data_parallel()  # what nn.DataParallel calls on each GPU
    model = torch.nn.Sequential(emb, torch.nn.Linear(2, 1))
    for copy_it in (pickle.dumps, copy.deepcopy, lambda m: torch.save(m, tmp_path / "m.pt")):
        with pytest.raises(ss.StateError, match=rf"^{cls.__name__} cannot be pickled or deep-copied.*torch\.save\(model\.state_dict\(\)\)"):
            copy_it(model)


def test_a_refused_torch_save_of_the_model_says_that_torch_truncated_the_file(tmp_path, rng):
    """torch.save(model, path) opens and truncates path before it pickles the model, so the refusal
    comes after a checkpoint kept at that path was lost; the message did not say so."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), ss.OffloadedEmbedding(10, 2, max_rows=4, backend="numpy"))
    model[1].table.scatter(torch.arange(10), torch.from_numpy(rng.standard_normal((10, 2)).astype(np.float32)))
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(ss.StateError, match=r"torch\.save\(model, path\).*truncated"):
        torch.save(model, path)
    with pytest.raises(RuntimeError):  # as the message says: the checkpoint is gone
        torch.load(path)


def _adagrad_pair(cls, rng):
    """``cls`` (an offloaded embedding) and an nn.Embedding from the same fresh random rows, each with Adagrad."""
    table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32)
    emb = cls(NUM_ROWS, DIM, max_rows=2 * BATCH, storage="pageable", backend="numpy")
    emb.table.scatter(torch.arange(NUM_ROWS), torch.from_numpy(table0))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False)
    opt, ref_opt = torch.optim.Adagrad(emb.parameters(), lr=0.1), torch.optim.Adagrad(ref.parameters(), lr=0.1)
    emb.attach(opt)
    return emb, opt, ref, ref_opt


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
def test_forward_takes_its_ids_by_nn_embedding_s_keyword_and_by_its_own(cls, rng):
    """``nn.Embedding.forward(input)``: code that passes ``input=ids`` raised TypeError
    (an unexpected keyword); ``ids=ids`` keeps working, and both train as nn.Embedding does."""
    emb, opt, ref, ref_opt = _adagrad_pair(cls, rng)
    for step in range(6):
        ids = torch.from_numpy(zipf(rng, NUM_ROWS, (BATCH, 2)))
        target = torch.from_numpy(rng.standard_normal((BATCH, 2, DIM)).astype(np.float32))
        for model, optimizer in ((emb, opt), (ref, ref_opt)):
            out = model(input=ids) if step % 2 or model is ref else model(ids=ids)
            ((out - target) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)
    with pytest.raises(ss.DTypeError, match="once"):
        emb(input=ids, ids=ids)


@pytest.mark.parametrize("cls", [ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding])
@pytest.mark.parametrize("bag", ["offsets", "offsets and weights", "offsets=", "per_sample_weights="])
def test_embedding_bag_arguments_are_refused_naming_the_pooling_recipe(cls, bag, rng):
    """``emb(ids, offsets)``, as nn.EmbeddingBag code calls it, raised Python's bare TypeError
    (forward() takes 1 to 2 positional arguments); it names what to do now, and changes nothing."""
    emb, opt, ref, ref_opt = _adagrad_pair(cls, rng)
    ids = torch.from_numpy(zipf(rng, NUM_ROWS, BATCH))
    offsets = torch.arange(0, BATCH, 4)
    weights = torch.from_numpy(rng.random(BATCH).astype(np.float32))
    call = {"offsets": lambda: emb(ids, offsets),
            "offsets and weights": lambda: emb(ids, offsets, weights),
            "offsets=": lambda: emb(ids, offsets=offsets),
            "per_sample_weights=": lambda: emb(ids, per_sample_weights=weights)}[bag]
    with pytest.raises(ss.DTypeError, match="not an nn.EmbeddingBag") as info:
        call()
    assert isinstance(info.value, TypeError) and "Pooled lookups" in str(info.value)
    target = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
    for model, optimizer in ((emb, opt), (ref, ref_opt)):  # the refused call left no row in the step
        ((model(ids) - target) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)


@pytest.mark.parametrize("cache_rows", [0, 8])
def test_a_view_kept_from_between_steps_shows_the_stepped_rows_once_step_returns(cache_rows, rng):
    """What README and the table's docstring say of a kept view: the step writes its rows back in
    its post-hook, which runs first, so every post-hook sees them stepped, as in memory: one
    registered before attach() (it saw them as before the step) and a global one alike."""
    table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=2 * BATCH, storage="pageable", backend="numpy",
                                cache_rows=cache_rows)
    emb.table.scatter(torch.arange(NUM_ROWS), torch.from_numpy(table0))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False)
    opt, ref_opt = torch.optim.Adagrad(emb.parameters(), lr=0.1), torch.optim.Adagrad(ref.parameters(), lr=0.1)
    seen, seen_globally = [], []
    opt.register_step_post_hook(lambda *_: seen.append(view.copy()))
    emb.attach(opt)
    view = emb.table.to_numpy()  # the cache keeps no rows while it lives
    hook = register_optimizer_step_post_hook(
        lambda optimizer, *_: seen_globally.append(view.copy()) if optimizer is opt else None)
    try:
        for _ in range(4):
            ids = torch.from_numpy(zipf(rng, NUM_ROWS, BATCH))
            target = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
            for model in (emb, ref):
                ((model(ids) - target) ** 2).sum().backward()
            np.testing.assert_allclose(view, ref.weight.detach().numpy(), **TOL)
            opt.step()
            ref_opt.step()
            np.testing.assert_allclose(view, ref.weight.detach().numpy(), **TOL)
            np.testing.assert_allclose(seen.pop(), ref.weight.detach().numpy(), **TOL)
            np.testing.assert_allclose(seen_globally.pop(), ref.weight.detach().numpy(), **TOL)
            opt.zero_grad()
            ref_opt.zero_grad()
    finally:
        hook.remove()  # global: it would outlive the test


class _HookFailed(Exception):
    pass


@pytest.mark.parametrize("cache_rows", [0, 8])
def test_a_step_post_hook_registered_before_attach_that_raises_leaves_the_step_done(cache_rows, rng):
    """In memory the update stays when a step post-hook raises (the optimizer ran). The embedding's
    write-back ran after such a hook, so it never ran, and the next call undid the update: the rows
    and their state went back to before the step, 0.2 off an in-memory run after a few steps."""
    table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float32)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=2 * BATCH, storage="pageable", backend="numpy",
                                cache_rows=cache_rows)
    emb.table.scatter(torch.arange(NUM_ROWS), torch.from_numpy(table0))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False, sparse=True)
    # Adagrad: its state trains on too (sparse Adagrad in memory is what the lazy step equals).
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1)
    failing = {2, 5}

    def fail_at(step_count):
        def hook(*_):
            step_count[0] += 1
            if step_count[0] in failing:
                raise _HookFailed(f"step {step_count[0]}")
        return hook

    opt.register_step_post_hook(fail_at([0]))  # before attach: it used to run before the write-back
    ref_opt.register_step_post_hook(fail_at([0]))
    emb.attach(opt)
    for step in range(1, 9):
        ids = torch.from_numpy(zipf(rng, NUM_ROWS, BATCH))
        target = torch.from_numpy(rng.standard_normal((BATCH, DIM)).astype(np.float32))
        for model, optimizer in ((emb, opt), (ref, ref_opt)):
            ((model(ids) - target) ** 2).sum().backward()
            if step in failing:
                with pytest.raises(_HookFailed):
                    optimizer.step()
            else:
                optimizer.step()
            optimizer.zero_grad()
    emb.flush()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)
