"""Training flows found in review: each equals the lazy in-memory reference, or is refused before any change.

The reference is the one of :mod:`test_training_flows`: an in-memory table
whose rows no training forward looked up get their value and optimizer
state back after each step.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from test_training_flows import pair, zipf_ids


def test_a_second_step_without_a_forward_is_refused_before_anything_changes(rng):
    """``optimizer.step()`` twice on one backward: in memory the second step applies the gradient
    to its rows again; offloaded, those rows were written back and the gradient's slots name none.
    It is refused, with the table, the per-row state and the step count as the first step left them
    (it used to step the working-set scratch, leave the rows alone, and blame the next forward for
    "a write into emb.weight between steps")."""
    model, _ = pair(rng)
    emb = model.emb
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    emb.attach(opt)
    (ids, target), (ids2, target2) = zipf_ids(rng, 2)
    F.mse_loss(model(ids), target).backward()
    opt.step()
    table = emb.table.to_numpy(copy=True)
    state = {name: t.to_numpy(copy=True) for name, t in emb._state.tables.items()}
    step = opt.state[emb.weight]["step"].clone()
    with pytest.raises(ss.StateError, match="no training forward"):
        opt.step()
    np.testing.assert_array_equal(emb.table.to_numpy(), table)
    for name, t in emb._state.tables.items():
        np.testing.assert_array_equal(t.to_numpy(), state[name], err_msg=name)
    assert opt.state[emb.weight]["step"] == step
    opt.zero_grad()
    F.mse_loss(model(ids2), target2).backward()  # training goes on
    opt.step()

