"""One thread at a time: a call on an OffloadedEmbedding while another thread is inside a call or a step raises.

Before, an evaluation thread's lookups while the training thread was inside
``optimizer.step()`` put the step's rows back under the optimizer: SGD and
Adam failed with a size mismatch (512 against 151 rows), or the update was
lost. Calls from several threads one after another work.
"""

import threading

import numpy as np
import pytest
import torch

import speedswap as ss

NUM_ROWS, DIM, IDS, LR = 300, 6, 40, 0.1


def _zipf_ids(rng):
    p = 1.0 / np.arange(1, NUM_ROWS + 1)
    return torch.from_numpy(rng.permutation(NUM_ROWS)[rng.choice(NUM_ROWS, size=IDS, p=p / p.sum())])


def _pair(rng, backend, cache_rows):
    """An offloaded embedding and an in-memory one holding the same random rows, each with its optimizer."""
    rows = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=IDS, cache_rows=cache_rows, backend=backend)
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rows)))
    opt = torch.optim.SGD(emb.parameters(), lr=LR)
    emb.attach(opt)
    reference = torch.nn.Embedding(NUM_ROWS, DIM)
    reference.weight.data.copy_(torch.from_numpy(rows))
    return emb, opt, reference, torch.optim.SGD(reference.parameters(), lr=LR)


def _loss(rows, ids):
    return ((rows - ids.unsqueeze(1).float() / NUM_ROWS) ** 2).sum()


def _reference_step(reference, opt, ids):
    _loss(reference(ids), ids).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("cache_rows", [0, 60])
def test_calls_from_another_thread_inside_a_step_are_refused_and_change_nothing(backend, rng, cache_rows,
                                                                                  tmp_path):
    emb, opt, reference, ref_opt = _pair(rng, backend, cache_rows)
    inside, go = threading.Event(), threading.Event()
    go.set()

    def hold(_optimizer, _args, _kwargs):  # runs after the embedding's hook narrowed the step's rows
        inside.set()
        assert go.wait(60)
    opt.register_step_pre_hook(hold)
    device = emb.weight.device
    for _ in range(4):
        ids = _zipf_ids(rng)
        _loss(emb(ids.to(device)), ids.to(device)).backward()
        opt.step()
        opt.zero_grad()
        _reference_step(reference, ref_opt, ids)
    ids = _zipf_ids(rng)
    _loss(emb(ids.to(device)), ids.to(device)).backward()
    go.clear()
    inside.clear()
    raised = []
    stepping = threading.Thread(target=lambda: raised.extend(_raised(opt.step)))
    stepping.start()
    try:
        assert inside.wait(60)
        other = _zipf_ids(rng).to(device)
        calls = {"training forward": lambda: emb(other),
                 "eval forward": lambda: _no_grad(emb, other),
                 "table read": lambda: emb.table.to_numpy(),
                 "flush": emb.flush,
                 "discard_step": emb.discard_step,
                 "save": lambda: emb.save(tmp_path / "ck.h5")}
        if cache_rows:
            calls["prefetch"] = lambda: emb.prefetch(other)
        for what, call in calls.items():
            with pytest.raises(ss.StateError, match="another thread"):
                call()
            assert inside.is_set(), what
    finally:
        go.set()
        stepping.join(60)
    assert raised == []
    assert not (tmp_path / "ck.h5").exists()
    opt.zero_grad()
    _reference_step(reference, ref_opt, ids)
    for _ in range(4):  # this thread trains on where the other left off
        ids = _zipf_ids(rng)
        _loss(emb(ids.to(device)), ids.to(device)).backward()
        opt.step()
        opt.zero_grad()
        _reference_step(reference, ref_opt, ids)
    np.testing.assert_allclose(emb.table.to_numpy(), reference.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache_rows", [0, 60])
def test_training_beside_an_evaluation_thread_trains_as_in_memory(backend, rng, cache_rows):
    """Whatever the interleaving, each call runs whole or is refused whole: retrying refused ones trains exactly."""
    emb, opt, reference, ref_opt = _pair(rng, backend, cache_rows)
    device = emb.weight.device
    done, outcomes = threading.Event(), {"looked up": 0, "refused": 0, "other": []}

    def evaluate():
        draws = np.random.default_rng(int(rng.integers(2**31)))
        while not done.is_set():
            try:
                _no_grad(emb, torch.from_numpy(draws.integers(0, NUM_ROWS, 500)).to(device))
                outcomes["looked up"] += 1
            except ss.StateError as exc:
                if "another thread" in str(exc):
                    outcomes["refused"] += 1
                else:
                    outcomes["other"].append(exc)

    evaluator = threading.Thread(target=evaluate)
    evaluator.start()
    try:
        for _ in range(60):
            ids = _zipf_ids(rng)
            rows = _retried(lambda: emb(ids.to(device)))
            _loss(rows, ids.to(device)).backward()
            _retried(opt.step)
            opt.zero_grad()
            _reference_step(reference, ref_opt, ids)
    finally:
        done.set()
        evaluator.join(60)
    assert outcomes["other"] == [] and outcomes["looked up"] > 0
    np.testing.assert_allclose(emb.table.to_numpy(), reference.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


def _retried(call):
    """``call()``, again for as long as another thread's call refuses it."""
    while True:
        try:
            return call()
        except ss.StateError as exc:
            if "another thread" not in str(exc):
                raise


def _no_grad(emb, ids):
    with torch.no_grad():
        return emb(ids)


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 -- handed to the test's thread
        return [exc]
    return []
