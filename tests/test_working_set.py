"""The working set against a plain-Python reference: slots, local ids, new rows, capacity and range refusals."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import speedswap as ss
from speedswap.convert import as_row_ids_deferred
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
            local, first_new = ws.add(flat.view(shape), check_bounds)
            assert local.shape == tensor.shape and local.dtype == torch.int64
            assert local.reshape(-1).tolist() == expected[0] and first_new == expected[1]
            assert ws.rows.tolist() == ref.rows
            probe = torch.arange(-2, 31)
            assert ws.holds(probe).tolist() == [i in ref.rows for i in probe.tolist()]
            assert torch.equal(ws.rows[local], tensor)
        ws.clear()
        ref.rows = []
        assert ws.size == 0 and not ws.holds(torch.arange(-2, 31)).any()
