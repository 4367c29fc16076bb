"""Offloaded training equals in-memory training, optimizer by optimizer.

Every run: 300 steps (200 in the per-optimizer sweeps) of Zipf-distributed ids (repeats in nearly every batch,
many rows never touched), a fresh random table and fresh random context
vectors. Tolerance: float32 rounding, ``rtol=1e-5, atol=1e-6`` on every table
and state entry (the sums of repeated ids' gradients may be added in another
order; SparseAdam and sparse Adagrad write the same update in other
arithmetic). Untouched rows are compared too, so any row a step must not
change, or any state torch initialises differently, fails the test.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import speedswap as ss
from training_helpers import (DIM, NUM_ROWS, run_in_memory, run_offloaded, run_switchers,
                              zipf_batches)

STEPS = 300
SWEEP_STEPS = 200
TOL = dict(rtol=1e-5, atol=1e-6)

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                              weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    "adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "radam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01,
                                             initial_accumulator_value=0.3),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5,
                                                               centered=True),
    "rprop": lambda p: torch.optim.Rprop(p, lr=0.02),
    "asgd": lambda p: torch.optim.ASGD(p, lr=0.05, t0=50),
    "sparse_adam": lambda p: torch.optim.SparseAdam(list(p), lr=0.01),
    # fused=True: one kernel for the whole update, on the CPU too (benchmarks/NOTES.md, entry 76).
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adagrad_fused": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.3,
                                                   fused=True),
    "sgd_momentum_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01,
                                                    fused=True),
}


def torch_initial(name, group):
    """What a row's state holds before torch first touches it (from the torch sources)."""
    if name == "sum":
        return group["initial_accumulator_value"]
    if name == "step_size":
        return group["lr"]
    return 0.0


def assert_same(actual, expected, exact=False):
    """Equal to float32 rounding after hundreds of steps, at the scale of each array.

    Repeated ids' gradients are summed in another order than the reference's,
    and Adam's moments carry those last-bit differences along: an element that
    is small now can hold a difference of a few ulps of the array's largest
    values (seen: 1.1e-6 on an Adam moment element of 0.004, seed 1771240504).
    A lost or doubled update is orders of magnitude larger.

    ``exact``: bit for bit, for a reference that takes the offloaded run's
    arithmetic path (the same optimizer on dense gradients, lazily: run_in_memory
    with ``initial_state``), where no rounding may differ.
    """
    table, state = actual
    ref_table, ref_state = expected
    assert set(state) == set(ref_state)
    for name, value, ref in [("table", table, ref_table),
                             *((n, state[n], ref_state[n]) for n in sorted(state))]:
        if exact:
            np.testing.assert_array_equal(value, ref, err_msg=name)
            continue
        scale = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
        np.testing.assert_allclose(value, ref, rtol=TOL["rtol"], atol=max(TOL["atol"], 1e-5 * scale),
                                   err_msg=name)


def _setup(rng, backend, steps):
    device = ss.get_backend(backend).device
    table0 = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    return table0, zipf_batches(rng, steps, device), device


@pytest.fixture
def setup(rng, backend):
    return _setup(rng, backend, STEPS)


@pytest.fixture
def sweep(rng, backend):
    return _setup(rng, backend, SWEEP_STEPS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_switchers_equal_touched_rows_reference(name, sweep, backend):
    table0, batches, device = sweep
    make = OPTIMIZERS[name]
    sparse = name == "sparse_adam"
    expected = run_in_memory(make, table0, batches, device, sparse=sparse,
                             initial_state=torch_initial)
    assert_same(run_switchers(make, table0, batches, backend, sparse=sparse), expected)


def test_switchers_give_sparse_adam_a_sparse_gradient_from_a_dense_embedding(sweep, backend):
    """SpeedTorch's README builds nn.Embedding(sparse=False); SparseAdam takes only sparse gradients."""
    table0, batches, device = sweep
    make = OPTIMIZERS["sparse_adam"]
    expected = run_in_memory(make, table0, batches, device, sparse=True, initial_state=torch_initial)
    assert_same(run_switchers(make, table0, batches, backend, sparse=False), expected)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_offloaded_embedding_equals_touched_rows_reference(name, sweep, backend):
    table0, batches, device = sweep
    make = OPTIMIZERS[name]
    expected = run_in_memory(make, table0, batches, device, sparse=name == "sparse_adam",
                             initial_state=torch_initial)
    assert_same(run_offloaded(make, table0, batches, backend), expected)


def test_reference_is_lazy(rng):
    """The touched-rows reference really differs from plain dense training (so it tests something)."""
    table0, batches, device = _setup(rng, "numpy", 20)
    make = OPTIMIZERS["adam"]
    lazy, _ = run_in_memory(make, table0, batches, device, initial_state=torch_initial)
    dense, _ = run_in_memory(make, table0, batches, device)
    assert not np.allclose(lazy, dense, **TOL)


# The three equalities the design names, each against plain torch with no masking.

@pytest.mark.parametrize("runner", ["switchers", "embedding"])
def test_sgd_equals_dense_sgd(runner, setup, backend):
    table0, batches, device = setup
    make = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    run = run_switchers if runner == "switchers" else run_offloaded
    assert_same(run(make, table0, batches, backend), run_in_memory(make, table0, batches, device))


@pytest.mark.parametrize("runner", ["switchers", "embedding"])
def test_adam_equals_sparse_adam(runner, setup, backend):
    """Adam with eps=1e-30 is the same function as SparseAdam (which adds eps elsewhere)."""
    table0, batches, device = setup
    run = run_switchers if runner == "switchers" else run_offloaded
    table, state = run(lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-30), table0, batches, backend)
    ref_table, ref_state = run_in_memory(
        lambda p: torch.optim.SparseAdam(list(p), lr=0.01, eps=1e-30), table0, batches, device,
        sparse=True)
    assert_same((table, state), (ref_table, ref_state))


@pytest.mark.parametrize("runner", ["switchers", "embedding"])
def test_adagrad_equals_sparse_adagrad(runner, setup, backend):
    table0, batches, device = setup
    make = lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1)  # noqa: E731
    run = run_switchers if runner == "switchers" else run_offloaded
    assert_same(run(make, table0, batches, backend),
                run_in_memory(make, table0, batches, device, sparse=True))


#: Scalar state as torch creates it (from the torch sources), for pre-loading state by hand.
SCALAR_INIT = {"step": lambda g: 0.0, "mu_product": lambda g: 1.0, "eta": lambda g: g["lr"],
               "mu": lambda g: 1.0}


def _first_step(name, weight0, state_rows, device):
    """One torch step on a 6-row embedding from ``weight0``; ``state_rows`` pre-loads the state."""
    weight = torch.nn.Parameter(weight0.clone())
    opt = OPTIMIZERS[name]([weight])
    if state_rows is not None:
        group = opt.param_groups[0]
        # Where torch makes them: ASGD's on the parameter's device, the others' on the CPU.
        where = weight.device if name == "asgd" else None
        scalars = {k: torch.tensor(f(group), dtype=torch.float32, device=where) for k, f in SCALAR_INIT.items()}
        if name == "sparse_adam":
            scalars["step"] = 0  # SparseAdam counts with a Python int
        expected_scalars = {"sgd": (), "sgd_momentum": (), "sgd_nesterov": (),
                            "nadam": ("step", "mu_product"), "asgd": ("step", "eta", "mu")}
        keep = expected_scalars.get(name, ("step",))
        opt.state[weight] = {**{k: scalars[k] for k in keep},
                             **{k: v.clone() for k, v in state_rows.items()}}
    ids = torch.tensor([0, 2, 2, 5], device=device)
    torch.nn.functional.embedding(ids, weight, sparse=name == "sparse_adam").pow(3).sum().backward()
    opt.step()
    out = {"weight": weight.detach().cpu().numpy()}
    out.update({k: v.detach().cpu().numpy() for k, v in opt.state[weight].items()
                if isinstance(v, torch.Tensor) and v.shape == weight.shape})
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_untouched_rows_hold_torch_initial_state(name, backend, rng):
    """The tables start at torch's initial state: pre-loading their rows and stepping
    gives bit for bit what torch gives when it creates the state itself."""
    device = ss.get_backend(backend).device
    model = torch.nn.ModuleDict({"e": torch.nn.Embedding(6, DIM).to(device)})
    opt = OPTIMIZERS[name](model.parameters())
    switch = ss.OptimizerFactory(opt, 50, DIM, model, "e", storage="pageable", backend=backend)
    tables = {k: t.to_numpy(copy=True) for k, t in switch.state.tables.items()}
    group = opt.param_groups[0]
    for key, values in tables.items():
        np.testing.assert_array_equal(values, np.full_like(values, torch_initial(key, group)))
    weight0 = torch.from_numpy(rng.standard_normal((6, DIM), dtype=np.float32)).to(device)
    by_torch = _first_step(name, weight0, None, device)
    preloaded = _first_step(name, weight0, {k: torch.from_numpy(v[:6]).to(device)
                                            for k, v in tables.items()}, device)
    assert set(preloaded) == set(by_torch) == {"weight", *tables}
    if name.startswith("sgd_momentum"):
        # Torch's very first SGD step copies the gradient into the buffer
        # (skipping dampening); speedswap leaves that first step to torch
        # and stores zero for rows it did not touch, as dense torch does.
        return
    for key in by_torch:
        np.testing.assert_array_equal(preloaded[key], by_torch[key], err_msg=key)


_FLOAT16_SCRIPT = r"""
import sys
import numpy as np, torch
from training_helpers import DIM, NUM_ROWS, run_in_memory, run_offloaded, zipf_batches

OPTIMIZERS = {  # eps=1e-4: Adam's default 1e-8 is 0 in float16, and 0/0 a NaN on both sides
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-4),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.3),
}
rng = np.random.default_rng(int(sys.argv[1]))
for name, make in OPTIMIZERS.items():
    for cache_rows in (0, NUM_ROWS // 10):
        table0 = rng.standard_normal((NUM_ROWS, DIM)).astype(np.float16)
        batches = [(pos, neg, ctx.half()) for pos, neg, ctx in zipf_batches(rng, 30, "cpu")]
        table, state = run_offloaded(make, table0, batches, "numpy", cache_rows=cache_rows)
        ref_table, ref_state = run_in_memory(
            make, table0, batches, "cpu",
            initial_state=lambda key, group: group["initial_accumulator_value"] if key == "sum" else 0.0)
        assert table.dtype == np.float16 and not np.isnan(table).any()
        np.testing.assert_array_equal(table, ref_table, err_msg=name)
        assert set(state) == set(ref_state), name
        for key in state:
            np.testing.assert_array_equal(state[key], ref_state[key], err_msg=f"{name} {key}")
print(torch.backends.cpu.get_cpu_capability())
"""


def test_float16_training_equals_in_memory_bit_for_bit_without_vector_kernels(rng):
    """A float16 table trains in float16, with torch's own arithmetic: bit for bit the in-memory
    result, with and without a cache, when torch runs its plain (non-vectorised) CPU kernels.

    With AVX2, torch's float16 ``add_(other, alpha=)`` rounds an element differently in the
    vectorised body of a tensor than in its tail (-1.5244 + -0.05 * -1.4551 is -1.4521 in the
    first 32 elements of a 33-element tensor, -1.4512 in the 33rd and in a 16-element one), and
    a row sits at another place in the step's working set than in the whole table: SGD then
    differs by one float16 ulp in some elements (README, "What exact means")."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _FLOAT16_SCRIPT, str(rng.integers(2**31))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # The plain kernels really ran (torch 2.6 names them "NO AVX", 2.13 "DEFAULT").
    assert run.stdout.splitlines()[-1] in ("DEFAULT", "NO AVX")
