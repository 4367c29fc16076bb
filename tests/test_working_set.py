"""The working set against a plain-Python reference: slots, local ids, new rows, capacity and range refusals."""

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

import speedswap as ss
from speedswap.convert import as_row_ids_deferred
from speedswap.train import sync_free
from speedswap.train.sync_free import _TORCH_SORTS_FASTER_UP_TO, find_sorted, sort_marking_firsts, sort_with_order
from speedswap.train.working_set import WorkingSet

CAPACITY = 12
NUM_ROWS = 28  # the ids drawn below run from -2 to 30: some out of range


class ReferenceSlots:
    """A step's rows in a list: new rows join in increasing order, each keeps its first slot."""

    def __init__(self):
        self.rows = []

    def add(self, ids):
        first_new = len(self.rows)
        new = sorted(set(ids) - set(self.rows))
        if first_new + len(new) > CAPACITY:
            return None
        self.rows += new
        return [self.rows.index(i) for i in ids], first_new


# Steps of adds: each add a batch of ids (duplicates and repeats of held rows likely) of up to 3 dims.
batches = st.lists(st.integers(-2, 30), min_size=0, max_size=14).flatmap(
    lambda ids: st.sampled_from([(len(ids),), (1, len(ids))] + ([(2, len(ids) // 2)] if len(ids) % 2 == 0 else []))
    .map(lambda shape: (ids, shape)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(batches, min_size=1, max_size=5), min_size=1, max_size=3))
def test_adds_give_the_reference_slots_and_a_refused_add_changes_nothing(steps):
    """Ids range-checked by the working set itself (as a training forward's are), in its own read."""
    ws, ref = WorkingSet(CAPACITY, "cpu"), ReferenceSlots()
    for step in steps:
        for ids, shape in step:
            before = ws.rows.clone()
            tensor = torch.tensor(ids, dtype=torch.int64).view(shape)
            flat, _, check_bounds = as_row_ids_deferred(tensor, NUM_ROWS, "cpu")
            if any(not 0 <= i < NUM_ROWS for i in ids):
                with pytest.raises(ss.IdError, match=str(NUM_ROWS)):
                    ws.add(flat.view(shape), check_bounds)
                assert torch.equal(ws.rows, before)  # nothing changed
                continue
            expected = ref.add(ids)
            if expected is None:
                with pytest.raises(ss.CapacityError):
                    ws.add(flat.view(shape), check_bounds)
                assert torch.equal(ws.rows, before)  # nothing changed
                continue
            # A count about the new rows, read with the call's own: how many of them are multiples of 3.
            thirds = lambda ids_sorted, new: (new & (ids_sorted % 3 == 0)).sum().view(1)  # noqa: E731
            local, first_new, counts = ws.add(flat.view(shape), check_bounds, thirds if ids else None)
            assert local.shape == tensor.shape and local.dtype == torch.int64
            assert local.reshape(-1).tolist() == expected[0] and first_new == expected[1]
            assert counts == ([sum(row % 3 == 0 for row in ref.rows[first_new:])] if ids else None)
            assert ws.rows.tolist() == ref.rows
            probe = torch.arange(-2, 31)
            assert ws.holds(probe).tolist() == [i in ref.rows for i in probe.tolist()]
            assert torch.equal(ws.rows[local], tensor)
        ws.clear()
        ref.rows = []
        assert ws.size == 0 and not ws.holds(torch.arange(-2, 31)).any()


@pytest.fixture(params=["cpu", "cpu, device branches", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """Where the tensors live; "cpu, device branches": on the CPU with sync_free's numpy shortcuts
    off, so that CI runs the branches a GPU runs."""
    if request.param == "cpu, device branches":
        monkeypatch.setattr(sync_free, "_numpy_shortcut", lambda tensor: False)
        return "cpu"
    return request.param


@pytest.mark.parametrize("length", [1, 2, 300, _TORCH_SORTS_FASTER_UP_TO, _TORCH_SORTS_FASTER_UP_TO + 1, 30_000])
def test_sort_marking_firsts_gives_what_unique_gives(device, length, rng):
    """Both sorts (torch's, and numpy's for a large CPU tensor) against torch.unique, on Zipf ids with repeats."""
    ids = torch.from_numpy(rng.zipf(1.1, length).astype(np.int64) - rng.integers(0, 3)).to(device)
    values, order, first = sort_marking_firsts(ids)
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    assert torch.equal(ids[order], values) and torch.equal(torch.sort(ids).values, values)
    assert torch.equal(values[first], unique)
    # Each id's run index among the distinct ids is unique's inverse.
    run = torch.cumsum(first, 0) - 1
    assert torch.equal(torch.empty_like(run).index_copy_(0, order, run), inverse)


@pytest.mark.parametrize("sizes", [(0, 5), (7, 0), (3000, 2000), (5000, 40)])
def test_merging_two_sorted_runs_sorts_them(device, sizes, rng):
    """The working set merges its sorted rows with its sorted new rows (distinct from them)."""
    distinct = torch.from_numpy(rng.choice(10**12, sum(sizes), replace=False)).to(device)
    runs = [torch.sort(part).values for part in torch.split(distinct, list(sizes))]
    merged = torch.cat(runs)
    values, order = sort_with_order(merged, merging=True)
    assert torch.equal(values, torch.sort(distinct).values) and torch.equal(merged[order], values)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("sizes", [(1, 1), (1, 500), (50_000, 28_672), (3_000, 7)])
def test_find_sorted_finds_what_a_reference_search_finds(device, dtype, sizes, rng):
    """numpy's search on the CPU, torch's on a GPU, against a dictionary of the values' positions."""
    n_values, n_keys = sizes
    values = torch.from_numpy(np.sort(rng.choice(10**6, n_values, replace=False))).to(device, dtype)
    # Zipf keys, some held and some not, unsorted, with repeats and keys past both ends.
    keys = torch.from_numpy(rng.zipf(1.1, n_keys).astype(np.int64) - 2).clamp_(max=2 * 10**6)
    keys[::3] = values[torch.from_numpy(rng.integers(0, n_values, len(keys[::3])))].cpu().to(torch.int64)
    keys = keys.to(device, dtype)
    position, found = find_sorted(values, keys)
    at = {v: i for i, v in enumerate(values.tolist())}
    assert found.tolist() == [k in at for k in keys.tolist()]
    assert position[found].tolist() == [at[k] for k in keys.tolist() if k in at]
    assert position.dtype == torch.int64 and position.device == keys.device
    assert int(position.min()) >= 0 and int(position.max()) < n_values


def test_large_adds_keep_the_slot_rules(device, rng):
    """Adds past the size where the CPU sorts with numpy: each id's slot holds it, new rows join sorted."""
    ws = WorkingSet(60_000, device)
    for length in (9000, 20_000, 300, 9000):
        ids = torch.from_numpy(rng.zipf(1.1, length).astype(np.int64) % 500_000).to(device)
        before = ws.rows.tolist()
        local, first_new, _ = ws.add(ids.view(-1, 3) if length % 3 == 0 else ids)
        assert first_new == len(before) and ws.rows[:first_new].tolist() == before
        new = sorted(set(ids.tolist()) - set(before))
        assert ws.rows[first_new:].tolist() == new
        assert torch.equal(ws.rows[local.reshape(-1)], ids)
        assert ws.holds(ids).all() and not ws.holds(torch.tensor([500_001], device=device)).any()


def test_start_with_holds_the_rows_in_the_first_slots_and_refuses_a_started_step():
    ws = WorkingSet(CAPACITY, "cpu")
    ws.start_with(torch.tensor([5]))
    local, first_new, _ = ws.add(torch.tensor([9, 5, 2, 9]))
    assert ws.rows.tolist() == [5, 2, 9] and local.tolist() == [2, 0, 1, 2] and first_new == 1
    assert ws.holds(torch.tensor([2, 3, 5, 9])).tolist() == [True, False, True, True]
    with pytest.raises(ss.StateError, match="clear"):
        ws.start_with(torch.tensor([5]))
    assert ws.rows.tolist() == [5, 2, 9]


def test_steps_of_several_zipf_lookups_give_the_reference_slots(device, rng):
    """Steps of three lookups of Zipf ids (repeats within a lookup and of rows held from earlier ones), some
    begun with a padding row, against :class:`ReferenceSlots`: on a GPU's branches too (``device``)."""
    ws = WorkingSet(3000, device)
    for step in range(4):
        ref = ReferenceSlots()
        if step % 2:
            padding = int(rng.integers(0, 50))
            ws.start_with(torch.tensor([padding], device=device))
            ref.rows = [padding]
        for length in rng.integers(1, 600, 3):
            ids = rng.zipf(1.2, length) % 100_000
            # How many new rows are odd, read with the add's own count.
            odd = lambda ids_sorted, new: (new & (ids_sorted % 2 == 1)).sum().view(1)  # noqa: E731
            local, first_new, counts = ws.add(torch.from_numpy(ids).to(device), count_also=odd)
            expected_first = len(ref.rows)
            ref.rows += sorted(set(ids.tolist()) - set(ref.rows))
            assert first_new == expected_first and ws.rows.tolist() == ref.rows
            assert local.tolist() == [ref.rows.index(i) for i in ids.tolist()]
            assert counts == [sum(row % 2 for row in ref.rows[first_new:])]
            probe = torch.from_numpy(rng.integers(0, 100_000, 200)).to(device)
            assert ws.holds(probe).tolist() == [i in ref.rows for i in probe.tolist()]
        ws.clear()
