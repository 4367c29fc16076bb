"""``holds_nonzero``: whether a gradient holds a non-zero value, told as ``any()`` tells it, on both branches."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from speedswap.train import sync_free
from speedswap.train.zero_marks import holds_nonzero

#: Values where a reduction through the least and greatest elements could part from any():
#: signed zeros, NaN, infinities, the least subnormal of float16/bfloat16's range and float32's.
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45, 6e-8, -6e-8, 1.0, -2.5]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@st.composite
def gradients(draw):
    """A float tensor mostly of zeros of either sign, some special values, as a gradient, maybe a view."""
    dtype = draw(st.sampled_from(DTYPES))
    rows, dim = draw(st.integers(0, 9)), draw(st.integers(1, 5))
    values = draw(st.lists(st.sampled_from([0.0, -0.0, 0.0, -0.0] + SPECIAL), min_size=rows * dim,
                           max_size=rows * dim))
    tensor = torch.tensor(values, dtype=torch.float64).reshape(rows, dim).to(dtype)
    start = draw(st.integers(0, rows))
    return tensor[start:] if draw(st.booleans()) else tensor.t()  # a slice of rows, or a strided view


@pytest.mark.parametrize("branch", ["cpu", "device"])
@settings(max_examples=300, deadline=None)
@given(grad=gradients())
def test_holds_nonzero_tells_what_any_tells(branch, grad):
    with pytest.MonkeyPatch.context() as patch:
        if branch == "device":  # the branch a GPU runs, on the CPU
            patch.setattr(sync_free, "_numpy_shortcut", lambda tensor: False)
        told = holds_nonzero(grad)
    assert told.dtype == torch.bool and told.dim() == 0
    assert bool(told) == bool(grad.any()) == bool(np.any(grad.to(torch.float64).numpy() != 0))


def test_holds_nonzero_of_a_steps_gradient_finds_one_value_anywhere(rng):
    grad = torch.zeros(700, 16)
    assert not bool(holds_nonzero(grad))
    grad[:350] = -0.0
    assert not bool(holds_nonzero(grad))
    for row, col in zip(rng.integers(0, 700, 20), rng.integers(0, 16, 20)):
        for value in (rng.standard_normal() * 1e-30, -abs(rng.standard_normal()), float("nan")):
            grad[row, col] = value
            assert bool(holds_nonzero(grad)), (row, col, value)
            grad[row, col] = 0.0
