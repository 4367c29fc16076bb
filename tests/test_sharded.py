"""ShardedOffloadedEmbedding over real process groups: equal to one process, reshardable, no hangs.

Every multi-rank case starts one ``tests/sharded_worker.py`` process per rank
(gloo over 127.0.0.1, a free port) and kills them all after a deadline, so a
hang fails the test instead of blocking CI. Each launch runs several
scenarios to pay the processes' start-up once.
"""

import contextlib
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
import sharded_worker
from host_syncs import HostSyncs
from rendezvous import rendezvous_url
from speedswap.train import sharded_checkpoint
from speedswap.train.exchange import Exchange, row_bounds
from speedswap.train.sharded import INITIAL_BLOCK_ROWS
from sharded_worker import (AFTER_LAST, CHECKPOINTED_STEPS, DIM, INITIAL_ROWS, MIDWAY, NUM_ROWS, PAD, SAM_RHO,
                            SAVE_AT, SKIPPED, STEPS, initial_table, make, shard_arrays, train)
from test_torch_features import TORCH_FUNC_CALLS

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "sharded_worker.py"
TOL = dict(rtol=1e-5, atol=1e-6)
DEADLINE = 300  # seconds for one launch, against a hang (a collective that hangs ends at the gloo timeout, 60 s)


@functools.lru_cache(maxsize=None)
def reference(name, seed):
    """The one-process reference, computed once per optimizer and seed."""
    return sharded_worker.reference(name, seed)


def launch(world, out, seed, *scenarios):
    """Run ``scenarios`` on ``world`` ranks; return [(returncode, stderr)] per rank, killing hangs."""
    np.save(out / "table0.npy", initial_table(seed).numpy())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    rendezvous = rendezvous_url(out)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), rendezvous,
                               str(seed), str(out), *scenarios],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for rank in range(world)]
    deadline = time.monotonic() + DEADLINE
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {DEADLINE} s: a collective hung")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def assert_ok(results):
    for rank, (code, err) in enumerate(results):
        assert code == 0, f"rank {rank} failed:\n{err[-3000:]}"


def reported(out, name, world=2):
    """Each rank's JSON report of scenario ``name`` (``<name>.rank<r>.json`` in ``out``), in rank order."""
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]


def gathered(out, name, world):
    """The whole table and per-row state, concatenated from the ranks' shards in row order."""
    shards = [dict(np.load(out / f"{name}.rank{r}.npz")) for r in range(world)]
    assert [int(s["start"]) for s in shards] == sorted(int(s["start"]) for s in shards)
    table = np.concatenate([s["table"] for s in shards])
    state = {k[6:]: np.concatenate([s[k] for s in shards]) for k in shards[0] if k.startswith("state.")}
    return table, state


def assert_same(actual, expected):
    (table, state), (ref_table, ref_state) = actual, expected
    assert table.shape == (NUM_ROWS, DIM)
    np.testing.assert_allclose(table, ref_table, **TOL)
    assert set(state) == set(ref_state)
    for name in state:
        np.testing.assert_allclose(state[name], ref_state[name], **TOL, err_msg=name)


def fixture_seed(fixture):
    """A fresh seed for a module fixture's runs (or SPEEDSWAP_SEED's), printed so a failure can be replayed."""
    seed = int(os.environ.get("SPEEDSWAP_SEED", np.random.SeedSequence().entropy % 2**31))
    print(f"{fixture} seed {seed} (replay with SPEEDSWAP_SEED={seed})")
    return seed


def launched(tmp_path_factory, fixture, world, *scenarios):
    """Run ``scenarios`` on ``world`` ranks with a fresh seed (see :func:`fixture_seed`): ``(out, seed)``."""
    out = tmp_path_factory.mktemp(fixture)
    seed = fixture_seed(fixture)
    assert_ok(launch(world, out, seed, *scenarios))
    return out, seed


def on_one_and_two_ranks(tmp_path_factory, scenario, flows):
    """Run ``scenario:<flow>`` for each of ``flows`` on 1 and on 2 ranks: ``({world: out}, seed)``."""
    seed = fixture_seed(f"{scenario} runs")
    runs = {}
    for world in (1, 2):
        runs[world] = tmp_path_factory.mktemp(f"{scenario}{world}")
        assert_ok(launch(world, runs[world], seed, *(f"{scenario}:{flow}" for flow in flows)))
    return runs, seed


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Three ranks train with SGD, Adam (saving a checkpoint at SAVE_AT), Adagrad (mmap), and Adam skipping steps."""
    return launched(tmp_path_factory, "three_ranks", 3, "train:sgd", "train:adam", "train:adagrad",
                    "bf16:adagrad", "skip:adam", "skipfwd:adam")


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad"])
def test_three_ranks_equal_one_process(three_ranks, name):
    out, seed = three_ranks
    assert_same(gathered(out, name, 3), reference(name, seed))


def test_steps_skipped_on_every_rank_train_nothing(three_ranks):
    """zero_grad() after a backward whose step is skipped drops its rows, as for a dense parameter."""
    out, seed = three_ranks
    expected = sharded_worker.reference("adam", seed, skipped=sharded_worker.SKIPPED)
    assert_same(gathered(out, "adam-skip", 3), expected)


def test_steps_skipped_before_their_backward_train_nothing(three_ranks):
    """Their forwards' rows wait for the next step, which puts back those no backward reached."""
    out, seed = three_ranks
    expected = sharded_worker.reference("adam", seed, skipped=sharded_worker.SKIPPED)
    assert_same(gathered(out, "adam-skipfwd", 3), expected)


def test_three_ranks_of_a_bfloat16_table_equal_one_process(three_ranks):
    """Rows cross between ranks as bfloat16 (exactly: they were read from the table this step).

    Equal bit for bit to one process that sums the ranks' gradients as the ranks do (see
    bf16_reference), so a row or gradient that travelled wrong by a single bit shows.
    """
    out, seed = three_ranks
    table, state = gathered(out, "adagrad-bf16", 3)
    expected_table, expected_state = sharded_worker.bf16_reference("adagrad", seed, 3)
    assert not np.array_equal(expected_table, initial_table(seed).to(torch.bfloat16).float().numpy())  # it trained
    np.testing.assert_array_equal(table, expected_table)
    assert set(state) == set(expected_state) == {"sum"}
    np.testing.assert_array_equal(state["sum"], expected_state["sum"])


@pytest.fixture(scope="module")
def two_ranks(three_ranks):
    """Two ranks resume the three ranks' checkpoint, train with a bad id on rank 1 at step 3,
    train a table with a padding row, and end with an error rank 1 does not catch."""
    out, seed = three_ranks
    results = launch(2, out, seed, "resume:ckpt-3", "staged:ckpt-3", "bad:adam", "mode:adam", "npyfail:sgd",
                     "disagree:adam", "padding:adamw", "clip:sgd", "zerokept:adam", "crash:sgd")
    return out, seed, results, time.time()


def test_resume_three_rank_checkpoint_on_two_ranks(two_ranks):
    out, seed, *_ = two_ranks
    assert_same(gathered(out, "ckpt-3-resumed", 2), reference("adam", seed))


def test_a_resharding_load_holds_only_the_rows_each_rank_owns_in_its_part_of_the_ram(two_ranks):
    """Each of two ranks staged every three-rank shard it overlaps whole (rank 0: 201 rows of each
    table for its 151), each deciding against half of the free RAM as if alone on the machine."""
    out, *_ = two_ranks
    for result in reported(out, "staged"):
        held = {}
        for file, ram, rows in result["staged"]:
            assert ram == (1 << 40) // 2, file  # both ranks run on this machine
            held[file.split(".rank")[0]] = held.get(file.split(".rank")[0], 0) + rows
        owned = result["owned"]
        assert held == {"table": owned, "optimizer.exp_avg": owned, "optimizer.exp_avg_sq": owned,
                        "table0.npy": owned}


def test_bad_input_on_one_rank_raises_everywhere_and_changes_nothing(two_ranks):
    out, seed, *_ = two_ranks
    errors = reported(out, "bad")
    assert list(errors[1]) == ["IdError"] and str(NUM_ROWS) in errors[1]["IdError"]
    assert list(errors[0]) == ["StateError"] and "rank(s) [1]" in errors[0]["StateError"]
    # After the failed forward both ranks trained on: the result is as if it never happened.
    assert_same(gathered(out, "bad", 2), reference("adam", seed))


def test_a_forward_in_training_mode_on_one_rank_and_not_on_another_raises_everywhere(two_ranks):
    """Without the check the training rank took the other's lookups for its own step's rows."""
    out, seed, *_ = two_ranks
    for error in reported(out, "mode"):
        assert list(error) == ["StateError"]
        assert "training mode on rank(s) [0]" in error["StateError"]
        assert "torch.no_grad() on rank(s) [1]" in error["StateError"]
    assert_same(gathered(out, "mode", 2), reference("adam", seed))


def test_a_npy_export_one_rank_cannot_read_changes_no_rank(two_ranks):
    out, *_ = two_ranks
    results = reported(out, "npyfail")
    assert [r["changed_rows"] for r in results] == [0, 0]
    assert "injected read error" in results[1]["errors"]["FileFormatError"]
    assert "rank(s) [1]" in results[0]["errors"]["StateError"]


def test_ranks_that_disagree_about_a_step_raise_instead_of_exchanging_wrong_rows(two_ranks):
    """A step skipped everywhere, but one rank ran no backward for it, so only the other dropped it."""
    out, *_ = two_ranks
    results = reported(out, "disagree")
    for result in results:
        assert "the ranks disagree about this step" in result["errors"]["StateError"]
        assert result["unchanged"] and result["trained"]


def test_two_ranks_with_a_padding_row_and_scale_grad_by_freq_equal_one_process(two_ranks):
    """Rank 1 owns the pretrained padding row; rank 0 (and rank 1) look it up at two steps in three.

    No rank's gradient may reach it, so AdamW's moments for it stay zero and each step that
    looked it up only decays it; the steps that did not leave it alone.
    """
    out, seed, *_ = two_ranks
    table, state = gathered(out, "adamw-padding", 2)
    assert_same((table, state), sharded_worker.padding_reference("adamw", seed, world=2))
    looked_up = sum(step % 3 != 0 for step in range(STEPS))
    lr, decay = (sharded_worker.OPTIMIZERS["adamw"][2][k] for k in ("lr", "weight_decay"))
    expected = initial_table(seed)[PAD].numpy() * np.float32(1 - lr * decay) ** looked_up
    np.testing.assert_allclose(table[PAD], expected, rtol=1e-5)
    for name, rows in state.items():
        assert not rows[PAD].any(), name


def test_two_ranks_clipping_by_grad_norm_equal_one_process_clipping(two_ranks):
    """clip_grad_norm_ on each rank saw its own rows only and clipped by another factor (0.12 apart)."""
    out, seed, *_ = two_ranks
    expected = sharded_worker.reference("sgd", seed, clip=sharded_worker.MAX_NORM)
    assert not np.allclose(expected[0], reference("sgd", seed)[0], **TOL)  # the clip mattered
    assert_same(gathered(out, "sgd-clip", 2), expected)
    # Ranks that ask for norms of different orders would clip by different factors: refused on each.
    for report in reported(out, "clipnorm"):
        errors = report["errors"]
        assert "different orders [1.0, 2.0]" in errors["StateError"], errors


def test_two_ranks_stepping_on_zero_gradients_count_those_steps_as_one_process(two_ranks):
    """zero_grad(set_to_none=False) leaves a zero gradient, and a step on it counts (Adam's step) in
    memory, whether the step's gradient was discarded, no backward reached its forwards, or it had
    no forward: the ranks dropped it, skipped the step, and every later bias correction differed."""
    out, seed, *_ = two_ranks
    expected = sharded_worker.reference("adam", seed, zeroed=sharded_worker.ZEROED)
    skipped = sharded_worker.reference("adam", seed, skipped=sharded_worker.ZEROED)
    assert not np.allclose(expected[0], skipped[0], **TOL)  # counting those steps mattered
    assert_same(gathered(out, "adam-zerokept", 2), expected)


def test_uncaught_error_on_one_rank_ends_every_rank(two_ranks):
    out, _, results, ended = two_ranks
    # Timed from the crash scenario's start: the whole launch's ten scenarios take longer on a loaded machine.
    started = min(float((out / f"crash.rank{rank}.started").read_text()) for rank in range(2))
    # Ended by the error, before the 60 s gloo timeout (the bound leaves a loaded runner its slack).
    assert ended - started < 50
    (code0, err0), (code1, err1) = results
    assert code1 != 0 and "IdError" in err1
    assert code0 != 0 and "StateError" in err0 and "rank(s) [1]" in err0


@pytest.fixture(scope="module")
def failed_midway(tmp_path_factory):
    """Two ranks train Adam; at the steps of MIDWAY rank 1 fails between the messages of a call."""
    return launched(tmp_path_factory, "failed_midway", 2, "midfail:adam")


@pytest.mark.parametrize("what", sorted(set(MIDWAY) - {"forward ids"}))
def test_a_failure_between_a_calls_messages_raises_on_every_rank_at_once(failed_midway, what):
    """Rank 1 raised (out of memory, say) after the call's first message, leaving rank 0 waiting in
    the next one until the gloo timeout (then a RuntimeError, the group broken): in a training or
    an eval forward, reading the rows rank 0 asked for; in an eval forward, making the memory the
    ids rank 0 asks for arrive in; at the step, before its first message (grouping its gradients
    by owner); in exchange_gradients(), making the memory rank 0's gradients arrive in. And an
    eval forward's output, made after its last message, raised on rank 1 alone, rank 0 done with
    the call: a retry on rank 1 alone met rank 0's next call. Now every rank raises at once,
    nothing changed, and the call is retried on every rank."""
    out, _ = failed_midway
    rank0, rank1 = (result[what] for result in reported(out, "midfail"))
    expected = "MemoryError" if what != "step" else "RuntimeError"
    assert rank1["error"] == {expected: "injected"}
    assert "failed on rank(s) [1]" in rank0["error"]["StateError"], rank0["error"]
    assert rank1["heard while waiting"]
    assert rank0["unchanged"] and rank1["unchanged"]


def test_a_training_forward_makes_no_memory_sized_by_its_peers_before_their_ids_arrive(failed_midway):
    """Rank 1 could not make the memory for the ids rank 0 asked for (allocated between the forward's
    first message and the ids' all-to-all, outside any agreement): rank 0 waited in the all-to-all
    until the gloo timeout. A training forward now receives them into memory its build made (an
    eval forward agrees first, as the test above shows), so the same failure cannot happen there."""
    out, _ = failed_midway
    for result in reported(out, "midfail"):
        assert result["forward ids"]["error"] == {} and result["forward ids"]["unchanged"]
    assert reported(out, "midfail")[1]["forward ids"]["heard while waiting"]


def test_calls_retried_after_failing_midway_train_as_one_process(failed_midway):
    out, seed = failed_midway
    # The eval forwards retried read the table of the steps before them, as in memory.
    for what, repeats in (("eval", 1), ("eval output", 2)):
        table, _ = sharded_worker.reference("adam", seed, steps=MIDWAY[what])
        ids, _ = sharded_worker.global_batch(seed, MIDWAY[what])
        for rank in range(2):
            looked_up = np.tile(ids[sharded_worker.rank_slice(MIDWAY[what], 2, rank)].numpy(), repeats)
            np.testing.assert_allclose(np.load(out / f"midfail-{what}.rank{rank}.npy"), table[looked_up], **TOL)
    assert_same(gathered(out, "midfail", 2), reference("adam", seed))


@pytest.fixture(scope="module")
def failed_after_the_last_message(tmp_path_factory):
    """Two ranks train Adam; at AFTER_LAST's steps rank 1 fails after a call's last message, then calls it again."""
    return launched(tmp_path_factory, "failed_after_the_last_message", 2, "lastfail:adam")


def test_a_step_failing_on_one_rank_in_its_optimizer_state_raises_on_every_rank_at_once(failed_after_the_last_message):
    """Rank 1 could not read its rows' optimizer state (out of memory, say) after the step's
    gradient exchange: rank 0 stepped its rows and rank 1 not, and rank 1's retry made a message
    rank 0 did not (StateError on both at rank 0's next forward, the step lost on rank 1). The
    state is read before the step's first message now: every rank raises, the retry steps every rank."""
    out, _ = failed_after_the_last_message
    rank0, rank1 = (result["gather"] for result in reported(out, "lastfail"))
    assert rank1 == {"MemoryError": "injected"}
    assert "optimizer.step() failed on rank(s) [1]" in rank0["StateError"], rank0


@pytest.mark.parametrize("what", sorted(set(AFTER_LAST) - {"gather"}))
def test_a_call_failing_on_one_rank_after_its_last_message_is_finished_by_that_rank_alone(
        failed_after_the_last_message, what):
    """Rank 1 failed after the call's last message (summing its peers' gradients, narrowing the
    step's rows, inside the optimizer; in a training forward, making its output from the rows
    that came), where its peers have finished the call: its retry made the call's messages
    again, which its peers did not (a StateError on both at rank 0's next call, the step lost
    on rank 1, or pairs of collectives of different calls). Now the retry on rank 1 alone
    finishes the call with no message (and the whole run trains as one process: below)."""
    out, _ = failed_after_the_last_message
    rank0, rank1 = (result[what] for result in reported(out, "lastfail"))
    assert rank0 == {}
    assert list(rank1.values()) == ["injected"], rank1


def test_calls_retried_after_failing_after_their_last_message_train_as_one_process(failed_after_the_last_message):
    """Preparing the write-back of the step's optimizer state ("state write") ran after the step's undo
    for a retry had ended: its failure left the rows stepped in the working set and Adam's step
    counted, and the retry stepped them again (896 of 1806 values wrong). It is prepared inside it now."""
    out, seed = failed_after_the_last_message
    assert_same(gathered(out, "lastfail", 2), reference("adam", seed))


#: The checkpointed scenarios: <loop>-<use_reentrant> (see sharded_worker.train_checkpointed).
CHECKPOINTED = [f"{flow}-{mode}" for flow in ("plain", "accumulated", "skipped")
                for mode in ("non_reentrant", "reentrant")]


@pytest.fixture(scope="module")
def checkpointed_runs(tmp_path_factory):
    """1 and 2 ranks train Adam with every lookup in a checkpointed block, in each loop of CHECKPOINTED."""
    return on_one_and_two_ranks(tmp_path_factory, "checkpointed", CHECKPOINTED)


@pytest.mark.parametrize("name", CHECKPOINTED)
@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing_trains_as_one_process_in_memory(checkpointed_runs, world, name):
    """``torch.utils.checkpoint`` around each lookup (both ``use_reentrant``), against ``SparseAdam``
    on ``F.embedding(sparse=True)`` over the whole table and the union batch. (No ``cache_rows``
    case: a sharded table refuses a device cache.)

    In the loop order forward, ``zero_grad()``, backward, with steps skipped after their backward,
    the forward that ``use_reentrant=False`` runs again inside the backward found the skipped
    step's gradient zeroed and dropped the step, with the rows its own first run had brought in:
    the backward raised ``StateError`` ("backward through an embedding forward whose optimizer
    step has already run") where in memory the step trains the new forward's rows.
    """
    runs, seed = checkpointed_runs
    assert reported(runs[world], f"checkpointed-{name}", world) == [{}] * world
    skipped = SKIPPED if name.startswith("skipped") else ()
    expected = sharded_worker.reference("adam", seed, steps=CHECKPOINTED_STEPS, skipped=skipped)
    assert not np.allclose(expected[0], initial_table(seed).numpy())  # the reference trained
    assert_same(gathered(runs[world], f"checkpointed-{name}", world), expected)


#: The exchzero scenarios' loops (see sharded_worker.train_exchanged_then_zeroed).
EXCHANGED_THEN_ZEROED = ["zeroed", "skipped", "skipped_late"]


@pytest.fixture(scope="module")
def exchanged_then_zeroed_runs(tmp_path_factory):
    """1 and 2 ranks train Adam, zeroing the gradient after exchange_gradients(), in each loop of EXCHANGED_THEN_ZEROED."""
    return on_one_and_two_ranks(tmp_path_factory, "exchzero", EXCHANGED_THEN_ZEROED)


@pytest.mark.parametrize("flow", EXCHANGED_THEN_ZEROED)
@pytest.mark.parametrize("world", [1, 2])
def test_zero_grad_keeping_tensors_after_exchange_gradients_trains_as_one_process_in_memory(
        exchanged_then_zeroed_runs, world, flow):
    """``exchange_gradients()``, then ``zero_grad(set_to_none=False)`` on every rank, against
    ``SparseAdam`` on ``F.embedding(sparse=True)`` over the whole table and the union batch, whose
    zeroed sparse gradient names no row: a step on it moves none (and counts), and a step skipped
    after its exchange (a GradScaler's inf) trains nothing, the next step its own rows alone.

    ``zeroed``: the sharded step moved the step's rows by Adam's momentum on the zeroed gradient.
    ``skipped``, ``skipped_late``: the next step's backward was taken for one after the exchange,
    and its exchange_gradients() raised StateError ("exchange_gradients() twice in one step").
    """
    runs, seed = exchanged_then_zeroed_runs
    assert reported(runs[world], f"exchzero-{flow}", world) == [{}] * world
    if flow == "zeroed":
        expected = sharded_worker.reference("adam", seed, zeroed=sharded_worker.ZEROED)
    else:
        expected = sharded_worker.reference("adam", seed, skipped=SKIPPED)
    assert not np.allclose(expected[0], reference("adam", seed)[0], **TOL)  # the zeroing mattered
    assert_same(gathered(runs[world], f"exchzero-{flow}", world), expected)


@pytest.fixture(scope="module")
def sam_runs(tmp_path_factory):
    """Two ranks train SGD and Adam by SAM through ``weight.data`` (the worker's sam scenario)."""
    return launched(tmp_path_factory, "sam_runs", 2, "sam:sgd", "sam:adam")


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_sam_through_weight_data_on_two_ranks_trains_as_one_process_in_memory(sam_runs, name):
    """Each rank moves its owned rows by ``SAM_RHO`` times their exchanged gradient through ``weight.data``,
    ``zero_grad()``, forward and backward again, undoes the move, steps: as SAM in one process over the
    union batch. The forward after ``zero_grad()`` took the step for skipped and read the rows again from
    their owners' tables, unperturbed, on every rank (3.8 max difference). Every fifth step the last rank
    looks up no row, but owns rows its peer's lookups moved; every other step only rank 0 moves its rows,
    so that rank 1 drops its unchanged ones at the second forward while rank 0 keeps its moved ones."""
    out, seed = sam_runs
    expected = sharded_worker.reference(name, seed, sam=SAM_RHO, sam_rank0_rows=row_bounds(NUM_ROWS, 2)[1])
    assert not np.allclose(expected[0], reference(name, seed)[0], **TOL)  # the move mattered
    assert_same(gathered(out, f"{name}-sam", 2), expected)


@pytest.fixture(scope="module")
def mismatched_calls(tmp_path_factory):
    """Two ranks make different calls at once, or build their embeddings unlike each other."""
    return launched(tmp_path_factory, "mismatched_calls", 2, "calls:adam", "savecall:sgd", "paths:sgd",
                    "differ:sgd", "replaced:adam", "exchange:adam", "reattach:adam", "infskip:sgd",
                    "zerodiffer:adam", "outsider:sgd", "twockpts:adam", "mixedload:sgd", "order:sgd",
                    "oldleft:sgd", "nopath:sgd", "mixedsd:adam", "build:adam")


def test_a_step_skipped_on_one_rank_only_raises_on_every_rank_instead_of_hanging(mismatched_calls):
    """Rank 0's step met rank 1's next forward: gloo paired collectives of different kinds and hung."""
    out, seed = mismatched_calls
    for report in reported(out, "calls"):
        error = report["StateError"]
        assert "the ranks made different calls" in error
        assert "rank 0: optimizer.step()" in error and "rank 1: a training forward" in error
    # Nothing of step 3 reached a row on either rank, and both trained on after discard_step().
    assert_same(gathered(out, "calls", 2), sharded_worker.reference("adam", seed, skipped={3}))


def test_a_save_on_one_rank_while_another_trains_raises_on_both_and_writes_nothing(mismatched_calls):
    out, _ = mismatched_calls
    for result in reported(out, "savecall"):
        assert "rank 0: save(); rank 1: a training forward" in result["errors"]["StateError"]
        assert not result["half_saved"]
    assert json.loads((out / "savecall-ckpt" / "manifest.json").read_text())["world_size"] == 2


def test_a_save_to_another_path_on_each_rank_fails_and_keeps_the_earlier_checkpoint(mismatched_calls):
    """With an old <path>.partial on rank 1's path every rank 'succeeded', and rank 0 replaced a
    good checkpoint with one lacking rank 1's shards."""
    out, _ = mismatched_calls
    results = reported(out, "paths")
    (fresh, stale), (fresh1, stale1) = (r["errors"] for r in results)
    assert "rank 1 cannot see" in fresh1["PathError"] and "same path on every rank" in fresh1["PathError"]
    assert "rank(s) [1]" in fresh["StateError"]
    assert "shards of rank(s) [1] are not in" in stale["PathError"]
    assert "rank(s) [0]" in stale1["StateError"]
    assert all(r["kept"] for r in results)  # the earlier checkpoint loads, unchanged


def test_a_path_one_rank_cannot_use_is_refused_on_every_rank_in_the_first_message(mismatched_calls):
    """Rank 1's save(None) raised after the save's first message: rank 0 waited in the next one until
    the gloo timeout (a RuntimeError, the group broken). Its load(None) raised before the first
    message, and rank 0's load met rank 1's next forward instead. Rank 1's load(None) against rank 0's
    load of a .npy was named a mismatch of calls, not the failure it is."""
    out, _ = mismatched_calls
    results = reported(out, "nopath")
    for error in results[1]["errors"]:
        assert "path must be a str" in error["DTypeError"]
    for error, what in zip(results[0]["errors"], ("save", "load")):
        assert f"{what}() failed on rank(s) [1]" in error["StateError"]
    # Rank 0 loading a .npy met rank 1's refused load, which counts as a checkpoint's: the failure comes
    # first (it read "the ranks made different calls at once ... call discard_step()").
    assert results[0]["errors"][2]["StateError"].startswith("rank(s) [1] failed (their own errors say why)")
    assert all(r["unchanged"] and r["kept"] for r in results)


def test_a_save_whose_earlier_checkpoint_cannot_be_removed_succeeds_on_every_rank(mismatched_calls):
    """The new checkpoint was in place when rank 0 failed to remove the earlier one (moved aside to
    <path>.old): every rank reported the save as failed (rank 0 the OSError, rank 1 a StateError),
    though it loads. It succeeds, rank 0 warning of the leftover, which the next save removes."""
    out, _ = mismatched_calls
    results = reported(out, "oldleft")
    assert [r["error"] for r in results] == [{}, {}]
    assert [r["loaded"] for r in results] == [True, True]
    assert len(results[0]["warnings"]) == 1 and "oldleft-ckpt.old" in results[0]["warnings"][0]
    assert "injected" in results[0]["warnings"][0] and not results[1]["warnings"]
    assert [name for name in results[0]["left"] if name.startswith("oldleft-ckpt")] == ["oldleft-ckpt"]


def test_ranks_with_unlike_embeddings_or_optimizers_raise_before_any_row_moves(mismatched_calls):
    """Another embedding_dim aborted gloo; another learning rate trained a shard unlike the others.
    Tables unlike each other are refused as they are built; optimizers at the first forward."""
    out, _ = mismatched_calls
    for result in reported(out, "differ"):
        table = r"ShardedOffloadedEmbedding #\d+ built on its group"
        for what in ("dim", "padding", "dtype", "freq"):
            error = result[what]["StateError"]
            assert error.startswith("building a ShardedOffloadedEmbedding: the ranks' embeddings differ"), error
            assert not result[f"{what} built"]
        assert re.search(rf"rank 0: {table}: {NUM_ROWS} x {DIM} float32", result["dim"]["StateError"])
        assert re.search(rf"rank 1: {table}: {NUM_ROWS} x {DIM + 1} float32", result["dim"]["StateError"])
        assert re.search(rf"rank 1: {table}: {NUM_ROWS} x {DIM} float64", result["dtype"]["StateError"])
        # Each rank scaling by its own ids' counts, or not: like no one process (it trained on, silently).
        assert f"max_rows={sharded_worker.GLOBAL_BATCH}, scale_grad_by_freq=True, no optimizer" in (
            result["freq"]["StateError"].split("; rank 1: ")[1])
        described = result["padding"]["StateError"].split("; rank 1: ")
        assert f"max_rows={sharded_worker.GLOBAL_BATCH}, no optimizer" in described[0]  # no padding_idx
        assert f"max_rows={sharded_worker.GLOBAL_BATCH}, padding_idx={PAD}, no optimizer" in described[1]
        assert result["lr built"] and "the ranks' embeddings differ" in result["lr"]["StateError"]
        assert "optimizer fingerprint" in result["lr"]["StateError"]
        assert result["lr unchanged"]


def test_a_constructor_refused_on_one_rank_raises_on_every_rank_at_once(mismatched_calls):
    """Rank 1's constructor raised (a cache_rows, an mmap path it cannot use) and rank 0, built, waited
    in its next collective until the gloo timeout, then raised gloo's RuntimeError. Every rank now
    raises at once, rank 0 naming rank 1, and a retry on every rank builds (no mmap file left behind)
    and trains as one process."""
    out, seed = mismatched_calls
    rank0, rank1 = reported(out, "build")
    assert "cache_rows=1: ShardedOffloadedEmbedding has no device cache" in rank1["cache_rows"]["OptionError"]
    assert "cannot create the directory" in rank1["path"]["PathError"]
    for what in ("cache_rows", "path"):
        assert rank0[what]["StateError"].startswith(
            "building a ShardedOffloadedEmbedding failed on rank(s) [1] (their own errors say why)")
        assert rank0[f"{what} seconds"] < 30 and rank1[f"{what} seconds"] < 30  # the gloo timeout is 60 s
    assert rank0["draw"] == rank1["draw"]  # rank 0 drew for its shard's rows and rank 1 not: apart
    assert_same(gathered(out, "build", 2), reference("adam", seed))


def test_an_older_optimizer_state_without_its_load_is_refused_on_every_rank(mismatched_calls):
    """optimizer.load_state_dict() without emb.load(): the step trained on with mismatched state."""
    out, seed = mismatched_calls
    results = reported(out, "replaced")
    (between0, at_step0), (between1, at_step1) = (r["errors"] for r in results)
    # Refused at rank 1's next forward, and at rank 0's step; by the one that failed in its own words.
    assert "was replaced since the last step" in between1["StateError"]
    assert "emb.load(path) on every rank" in between1["StateError"]
    assert "a forward failed on rank(s) [1]" in between0["StateError"]
    assert "was replaced since the last step" in at_step0["StateError"]
    assert "optimizer.step() failed on rank(s) [0]" in at_step1["StateError"]
    assert all(r["unchanged"] for r in results)
    # Resumed from the checkpoint on every rank, it trains as if nothing had happened.
    assert_same(gathered(out, "replaced", 2), reference("adam", seed))


def test_exchange_gradients_refused_on_one_rank_raises_on_every_rank_at_once(mismatched_calls):
    """A rank's own refusal left the others waiting in the exchange until the process group's timeout."""
    out, seed = mismatched_calls
    rank0, rank1 = reported(out, "exchange")
    assert "without a training forward" in rank1["no forward"]["StateError"]
    assert "exchange_gradients() failed on rank(s) [1]" in rank0["no forward"]["StateError"]
    assert rank1["heard while waiting"]  # before the fix rank 0 heard only at rank 1's next collective
    assert rank0["unchanged"] and rank1["unchanged"]
    assert "twice in one step" in rank1["twice"]["StateError"]
    assert "rank 0: optimizer.step(); rank 1: exchange_gradients()" in rank0["twice"]["StateError"]
    assert "a backward ran after exchange_gradients()" in rank0["late"]["StateError"]
    assert "optimizer.step() failed on rank(s) [0]" in rank1["late"]["StateError"]
    # Steps 0 and 2 were dropped on every rank, step 1 was taken once: as one process.
    assert_same(gathered(out, "exchange", 2), sharded_worker.reference("adam", seed, skipped={0, 2}))


def test_attach_on_one_rank_only_is_refused_on_every_rank(mismatched_calls):
    """Its optimizer state restarted (Adam's step count 0) while its peer's went on, silently."""
    out, seed = mismatched_calls
    for result in reported(out, "reattach"):
        error = result["error"]["StateError"]
        assert "the ranks' embeddings differ" in error and "a rank that attached alone" in error
        assert "5 step(s) since attach(); rank 1: " in error and "0 step(s) since attach())" in error
        assert result["unchanged"]
    assert_same(gathered(out, "reattach", 2), reference("adam", seed))


def test_a_step_a_grad_scaler_skips_on_one_rank_only_is_refused_on_every_rank(mismatched_calls):
    """A plain GradScaler checks this rank's owned gradients only: one rank stepped, the other not."""
    out, seed = mismatched_calls
    rank0, rank1 = reported(out, "infskip")
    for result in (rank0, rank1):
        assert "rank 0: optimizer.step(); rank 1: a training forward" in result["error"]["StateError"]
        assert "ShardedGradScaler" in result["error"]["StateError"]
        assert result["unchanged"]
    assert_same(gathered(out, "infskip", 2), sharded_worker.reference("sgd", seed, skipped={0}))


def test_ranks_that_read_a_zeroed_exchanged_gradient_differently_are_refused_on_every_rank(mismatched_calls):
    """After exchange_gradients() and a skipped step, rank 0 zeroed its gradient (zero_grad(set_to_none=False))
    and rank 1 multiplied its by 0: rank 0 dropped the step at the next forward, rank 1 kept it. The
    next step is refused on both ranks, no row changed, instead of hanging one of them."""
    out, seed = mismatched_calls
    rank0, rank1 = reported(out, "zerodiffer")
    assert "a backward ran after exchange_gradients()" in rank1["error"]["StateError"]
    assert "failed on rank(s) [1]" in rank0["error"]["StateError"]
    assert rank0["unchanged"] and rank1["unchanged"]
    assert_same(gathered(out, "zerodiffer", 2), sharded_worker.reference("adam", seed, skipped={0}))


def test_an_embedding_built_on_a_group_this_rank_is_not_in_is_refused_with_an_option_error(mismatched_calls):
    """Its rank -1 in the group made a shard of no rows: 'num_rows must be a positive int, got 0'."""
    out, _ = mismatched_calls
    rank0, rank1 = reported(out, "outsider")
    assert rank0 == {}  # the group's one rank builds its embedding
    assert "not a member of process_group" in rank1["OptionError"]
    assert "only on the group's ranks" in rank1["OptionError"]


def test_ranks_restoring_state_dicts_of_different_steps_are_refused_before_any_row_changes(mismatched_calls):
    """Rank 0 restored its state_dict() of step 2, rank 1 its of step 5: they trained on, rank 0's
    Adam rows at step count 2 and rank 1's at 5. Both restoring step 5's then equals one process."""
    out, seed = mismatched_calls
    for result in reported(out, "mixedsd"):
        error = result["error"]["StateError"]
        assert "the ranks' embeddings differ" in error and "state_dict()s of different steps" in error
        assert "rank 0: " in error and "2 step(s) since attach() or load(), as counted by the state_dict()" in error
        assert "rank 1: " in error and "5 step(s) since attach() or load(), as counted by the state_dict()" in error
        assert result["unchanged"]
    assert_same(gathered(out, "mixedsd", 2), reference("adam", seed))


def test_ranks_loading_different_checkpoints_are_refused_before_any_row_changes(mismatched_calls):
    """Each rank restored its own checkpoint's rows and Adam step count (2 here, 4 there), silently."""
    out, _ = mismatched_calls
    for result in reported(out, "twockpts"):
        assert "not the same checkpoint on every rank" in result["error"]["StateError"]
        assert "ranks [0] read one, ranks [1] another" in result["error"]["StateError"]
        assert result["unchanged"]
        assert result["resumed"]  # from the first checkpoint on every rank, steps 2 and 3 again


def test_a_npy_load_on_one_rank_and_a_checkpoint_load_on_another_is_refused_on_both(mismatched_calls):
    """Their collectives paired: each rank loaded its own file, silently (or hung, comparing checkpoints)."""
    out, _ = mismatched_calls
    for result in reported(out, "mixedload"):
        error = result["error"]["StateError"]
        assert "rank 0: load() of a whole-table .npy; rank 1: load() of a sharded checkpoint" in error
        assert result["unchanged"]


def test_tables_built_alike_but_called_in_another_order_on_each_rank_are_refused(mismatched_calls):
    """Rank 0's lookup in its first table paired with rank 1's in its second: rows of the other table, silently."""
    out, _ = mismatched_calls
    for result in reported(out, "order"):
        error = result["error"]["StateError"]
        assert "the ranks' embeddings differ" in error and "in the same order on every rank" in error
        first, second = map(int, re.findall(r"rank \d: ShardedOffloadedEmbedding #(\d+) built on its group", error))
        assert second == first + 1  # rank 0 called its first table, rank 1 its second
        assert result["looked_up"] == 0


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path, seed):
    assert_ok(launch(2, tmp_path, seed, "train:sgd", "train:adam", "train:adagrad"))
    for name in ("sgd", "adam", "adagrad"):
        assert_same(gathered(tmp_path, name, 2), reference(name, seed))


def test_resume_three_rank_checkpoint_in_one_process(three_ranks):
    """World size 1 (no process group): the sharded class and a plain OffloadedEmbedding."""
    out, seed = three_ranks
    ckpt = out / "ckpt-3"
    assert json.loads((ckpt / "manifest.json").read_text())["world_size"] == 3
    emb, opt = make("adam")
    emb.load(ckpt)
    train(emb, opt, seed, range(SAVE_AT, STEPS), world=1, rank=0)
    expected = reference("adam", seed)
    arrays = shard_arrays(emb)
    assert_same((arrays["table"], {k[6:]: v for k, v in arrays.items() if k.startswith("state.")}),
                expected)

    # With a device cache holding dirty rows of other training: the load replaces them too.
    plain = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=NUM_ROWS, storage="pageable",
                                  backend="numpy", cache_rows=NUM_ROWS // 2)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01, eps=1e-30)
    plain.attach(plain_opt)
    train(plain, plain_opt, seed + 1, range(3), world=1, rank=0)
    assert plain.stats()["total"]["hits"] > 0  # the cache held rows when the load came
    ss.load_sharded(ckpt, plain)
    train(plain, plain_opt, seed, range(SAVE_AT, STEPS), world=1, rank=0)
    plain.flush()
    assert_same((plain.table.to_numpy(), {k: t.to_numpy() for k, t in plain._state.tables.items()}),
                expected)


def test_checkpoint_must_match(three_ranks, tmp_path):
    out, _ = three_ranks
    emb, _ = make("sgd")
    with pytest.raises(ss.FileFormatError, match="optimizer 'Adam'"):
        emb.load(out / "ckpt-3")
    other = ss.ShardedOffloadedEmbedding(NUM_ROWS + 1, DIM, max_rows=4, backend="numpy",
                                         storage="pageable")
    before = other.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match=f"{NUM_ROWS} x {DIM}"):
        other.load(out / "ckpt-3")
    np.testing.assert_array_equal(other.table.to_numpy(), before)
    with pytest.raises(ss.FileFormatError, match="manifest.json"):
        other.load(tmp_path)
    (tmp_path / "not-a-checkpoint").mkdir()
    (tmp_path / "not-a-checkpoint" / "keep.txt").write_text("x")
    with pytest.raises(ss.FileFormatError, match="refusing"):
        emb.save(tmp_path / "not-a-checkpoint")
    assert (tmp_path / "not-a-checkpoint" / "keep.txt").exists()


def test_eval_forward_reads_rows_and_attach_is_required(rng):
    emb = ss.ShardedOffloadedEmbedding(50, 3, max_rows=8, backend="numpy", storage="pageable")
    ids = torch.from_numpy(rng.integers(0, 50, size=(4, 5)))
    with pytest.raises(ss.StateError, match="attach"):
        emb(ids)
    with torch.no_grad():
        rows = emb(ids)
    np.testing.assert_array_equal(rows.numpy(), emb.table.to_numpy()[ids.numpy()])
    with pytest.raises(ss.IdError):
        emb.eval()(torch.tensor([50]))
    assert list(emb.state_dict()) == ["_extra_state"]  # the shard, not the scratch weight


def _example_under_torchrun(example, args, tmp_path):
    """Run ``examples/<example> --distributed`` on 2 gloo ranks; rank 0's JSON figures."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         f"examples/{example}", "--distributed", "--device", "cpu", "--storage", "pageable",
         "--quiet", "--json", tmp_path / "figures.json", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0, done.stderr[-3000:]
    # Rank 0 speaks for the run: a line that every rank prints shows up once per rank.
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), done.stdout
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["world_size"] == 2
    return figures


@pytest.mark.slow
def test_word2vec_example_under_torchrun(tmp_path):
    """``torchrun --nproc-per-node 2 examples/word2vec.py --distributed`` learns the planted topics."""
    figures = _example_under_torchrun(
        "word2vec.py", ["--vocab", "2000", "--topics", "20", "--tokens", "200000", "--dim", "32",
                        "--steps", "150", "--batch-size", "512", "--optimizer", "adam"], tmp_path)
    # The same bar the one-process example meets (tests/test_examples.py).
    assert figures["topic_purity"] > 0.6 and figures["topic_purity"] > 8 * figures["chance"]
    assert figures["losses"][-1][1] < 0.7 * figures["losses"][0][1]
    # Per pair, as one process reports it: zero context vectors make the first
    # loss log 2 for the positive and for each of the 5 negatives, less the few
    # negatives that drew the pair's own context word, which are skipped as in
    # word2vec.c (here about 0.2% of them).
    assert 5.9 * math.log(2) < figures["losses"][0][1] <= 6 * math.log(2) * (1 + 1e-6)
    assert figures["bytes_sent_per_step"] > 0


@pytest.mark.slow
def test_word2vec_example_under_torchrun_steps_sgd_at_one_process_rate(tmp_path):
    """--lr is per pair, as in one process: each rank's summed loss, averaged over the ranks, trained at lr / 2."""
    figures = _example_under_torchrun(
        "word2vec.py", ["--vocab", "2000", "--topics", "20", "--tokens", "200000", "--dim", "32",
                        "--steps", "150", "--batch-size", "512", "--optimizer", "sgd"], tmp_path)
    # One process (examples/word2vec.py --schedule constant --autograd, the same sizes) ends at 3.49 per pair,
    # and at half the rate at 4.12, where the ranks' averaged gradients left this run.
    assert figures["losses"][-1][1] < 3.8


def _bfloat16_pair(rng):
    """``(rows, embeddings, optimizers)``: a one-rank sharded and an OffloadedEmbedding on the same
    random bfloat16 rows, each with Adagrad."""
    table0 = torch.from_numpy(rng.standard_normal((40, 4), dtype=np.float32)).to(torch.bfloat16)
    embs = [cls(40, 4, max_rows=12, dtype=torch.bfloat16, backend="numpy", storage="pageable")
            for cls in (ss.ShardedOffloadedEmbedding, ss.OffloadedEmbedding)]
    opts = []
    for emb in embs:
        emb.table.scatter(torch.arange(40), table0)
        opts.append(torch.optim.Adagrad(emb.parameters(), lr=0.1))
        emb.attach(opts[-1])
    return table0, embs, opts


def test_one_rank_bfloat16_equals_offloaded_embedding(rng):
    """Without a process group the sharded class is one shard; bfloat16 rows train in float32."""
    table0, embs, opts = _bfloat16_pair(rng)
    for _ in range(30):
        ids = torch.from_numpy(rng.integers(0, 40, size=12))
        target = torch.from_numpy(rng.standard_normal((12, 4), dtype=np.float32))
        for emb, opt in zip(embs, opts):
            ((emb(ids[:5]) - target[:5]) ** 2).sum().add(((emb(ids[5:]) - target[5:]) ** 2).sum()).backward()
            opt.step()
            opt.zero_grad()
    sharded, plain = (emb.table.as_tensor().float() for emb in embs)
    assert sharded.dtype == torch.float32 and not torch.equal(sharded, table0.float())  # it trained
    torch.testing.assert_close(sharded, plain, rtol=0, atol=0)
    ids = zipf_ids(rng, 40, (3, 10), 0, False)  # repeated ids, in float32 as a training forward's
    with torch.no_grad():
        torch.testing.assert_close(embs[0](ids), sharded[ids], rtol=0, atol=0)


def zipf_ids(rng, rows, shape, pad, with_pad):
    """Ids with p(r) ~ 1/(r+1) over scattered rows, holding ``pad`` twice if ``with_pad``, else never."""
    p = 1.0 / np.arange(1, rows + 1)
    ids = torch.from_numpy(rng.permutation(rows)[rng.choice(rows, size=shape, p=p / p.sum())])
    ids = torch.where(ids == pad, (pad + 1) % rows, ids)
    if with_pad:
        ids.view(-1)[[0, -1]] = pad
    return ids


@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_one_rank_nn_embedding_options_train_as_nn_embedding_does(rng, option):
    """``padding_idx`` with ``scale_grad_by_freq`` (Adagrad: lazy equals dense) or ``sparse`` (SparseAdam).

    The padding row is pretrained (not zero) and looked up at two steps in three: it gets
    no gradient, and these optimizers leave a row without one as it is. torch refuses the
    two options together, so each has its own reference.
    """
    rows, dim, pad = 60, 4, 2
    table0 = rng.standard_normal((rows, dim)).astype(np.float32)
    emb = ss.ShardedOffloadedEmbedding(rows, dim, max_rows=40, storage="pageable", backend="numpy",
                                       padding_idx=pad, **{option: True})
    emb.table.scatter(torch.arange(rows), torch.from_numpy(table0))
    ref = torch.nn.Embedding.from_pretrained(torch.from_numpy(table0.copy()), freeze=False,
                                             padding_idx=pad, **{option: True})
    optimizer = (torch.optim.SparseAdam if option == "sparse"
                 else functools.partial(torch.optim.Adagrad, initial_accumulator_value=0.1))
    opt, ref_opt = optimizer(emb.parameters(), lr=0.05), optimizer(ref.parameters(), lr=0.05)
    emb.attach(opt)
    for step in range(60):
        ids = zipf_ids(rng, rows, (5, 4), pad, with_pad=step % 3 != 0)
        target = torch.from_numpy(rng.standard_normal((5, 4, dim)).astype(np.float32))
        for model, optim in ((emb, opt), (ref, ref_opt)):
            # Two forwards a step: each counts its own ids, as nn.Embedding's do.
            loss = ((model(ids) - target) ** 2).sum() + model(ids[:2]).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.weight.detach().numpy(), **TOL)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), ref_opt.state[ref.weight][name].numpy(), **TOL,
                                   err_msg=name)
    np.testing.assert_array_equal(emb.table.to_numpy()[pad], table0[pad])
    assert not np.allclose(emb.table.to_numpy(), table0, atol=1e-3)  # it trained


def test_one_rank_pretrained_padding_row_with_adamw_equals_offloaded_embedding(rng, tmp_path):
    """AdamW decays the padding row at the steps that look it up, and only then, as OffloadedEmbedding does.

    The sharded table reads its pretrained rows from a ``.npy`` export and, halfway, goes
    on in a new embedding loaded from its checkpoint; the reference gets them through
    ``emb.table``. One step's padding lookup is in a forward no backward reaches (a skipped
    loss): that lookup does not count.
    """
    rows, dim, pad, lr, decay = 80, 5, 61, 0.01, 0.1
    table0 = rng.standard_normal((rows, dim)).astype(np.float32)
    np.save(tmp_path / "pretrained.npy", table0)

    def build(cls):
        emb = cls(rows, dim, max_rows=48, storage="pageable", backend="numpy", padding_idx=pad)
        opt = torch.optim.AdamW(emb.parameters(), lr=lr, weight_decay=decay)
        emb.attach(opt)
        return emb, opt

    (emb, opt), (plain, plain_opt) = build(ss.ShardedOffloadedEmbedding), build(ss.OffloadedEmbedding)
    assert not emb.table.to_numpy()[pad].any()  # zero until the pretrained rows arrive
    emb.load(tmp_path / "pretrained.npy")
    plain.table.scatter(torch.arange(rows), torch.from_numpy(table0))
    decayed = 0
    for step in range(60):
        if step == 30:  # a new embedding and optimizer, from the checkpoint (Adam's step count too)
            emb.save(tmp_path / "ckpt")
            emb.close()
            emb, opt = build(ss.ShardedOffloadedEmbedding)
            emb.load(tmp_path / "ckpt")
        with_pad = step % 3 == 1
        ids = zipf_ids(rng, rows, (8, 5), pad, with_pad)
        target = torch.from_numpy(rng.standard_normal((8, 5, dim)).astype(np.float32))
        skipped = zipf_ids(rng, rows, (3,), pad, with_pad=step % 3 == 2)
        before = emb.table.to_numpy()[pad].copy()
        for model, optim in ((emb, opt), (plain, plain_opt)):
            model(skipped)  # a loss that was skipped: its graph is dropped before any backward
            ((model(ids) - target) ** 2).sum().backward()
            optim.step()
            optim.zero_grad()
        decayed += with_pad
        if with_pad:
            np.testing.assert_allclose(emb.table.to_numpy()[pad], before * np.float32(1 - lr * decay),
                                       rtol=1e-6)
        else:
            np.testing.assert_array_equal(emb.table.to_numpy()[pad], before)
    np.testing.assert_allclose(emb.table.to_numpy(), plain.table.to_numpy(), **TOL)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), plain._state.tables[name].to_numpy(), **TOL,
                                   err_msg=name)
        assert not table.to_numpy()[pad].any(), name  # no gradient ever reached it
    assert decayed == 20 and not np.allclose(emb.table.to_numpy()[pad], table0[pad])


def test_the_padding_row_gets_no_gradient_even_from_a_loss_that_is_not_finite(rng):
    """As ``nn.Embedding(padding_idx=...)``: its gradient is zero whatever flows into its lookups."""
    table0 = torch.from_numpy(rng.standard_normal((30, 3)).astype(np.float32))
    emb = ss.ShardedOffloadedEmbedding(30, 3, max_rows=8, storage="pageable", backend="numpy",
                                       padding_idx=4)
    emb.table.scatter(torch.arange(30), table0)
    ref = torch.nn.Embedding.from_pretrained(table0.clone(), freeze=False, padding_idx=4)
    ids = torch.tensor([4, 9, 4, 17])
    scale = torch.tensor([float("inf"), 2.0, float("nan"), -3.0]).unsqueeze(1)
    for model in (emb, ref):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if model is emb:
            emb.attach(opt)
        (model(ids) * scale).sum().backward()
        opt.step()
    np.testing.assert_array_equal(emb.table.to_numpy(), ref.weight.detach().numpy())
    assert torch.equal(emb.table.as_tensor()[4], table0[4])


def test_nn_embedding_options_are_checked_and_shown(rng):
    """Bad ``padding_idx`` and any ``max_norm`` are refused as OffloadedEmbedding refuses them."""
    make_emb = functools.partial(ss.ShardedOffloadedEmbedding, 20, 3, max_rows=4, storage="pageable",
                                 backend="numpy")
    for bad in (-1, 20, 1.5, True, "3"):
        with pytest.raises(ss.OptionError, match="padding_idx"):
            make_emb(padding_idx=bad)
    with pytest.raises(ss.OptionError, match=r"does not support max_norm .*clip the rows yourself"):
        make_emb(max_norm=1.0)
    with pytest.raises(ss.OptionError, match=r"norm_type=1\.0"):
        make_emb(norm_type=1.0)
    emb = make_emb(padding_idx=19, scale_grad_by_freq=True, sparse=True)
    assert "padding_idx=19, scale_grad_by_freq=True, sparse=True" in repr(emb)
    assert "padding_idx" not in repr(make_emb())
    with torch.no_grad():
        rows = emb(torch.tensor([19, 0]))
    assert not rows[0].any() and rows[1].all()  # the padding row starts at zero, the others not


def test_a_bfloat16_shard_refuses_float32_values_it_would_round_and_changes_nothing(rng, tmp_path):
    """As OffloadedEmbedding.load does: an export or a checkpoint shard holding non-bfloat16 values."""
    table0 = torch.from_numpy(rng.standard_normal((40, 4), dtype=np.float32)).to(torch.bfloat16)
    emb = ss.ShardedOffloadedEmbedding(40, 4, max_rows=12, dtype=torch.bfloat16, backend="numpy",
                                       storage="pageable")
    emb.table.scatter(torch.arange(40), table0)
    emb.save(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "table.rank0.npy"
    values = np.load(shard)
    values[37, 2] += 2.0 ** -12 * abs(values[37, 2])  # between two bfloat16 values
    np.save(shard, values)
    np.save(tmp_path / "export.npy", values)
    for path in (tmp_path / "ckpt", tmp_path / "export.npy"):
        with pytest.raises(ss.FileFormatError, match=r"not bfloat16 values \(rows 0\.\.39\)"):
            emb.load(path)
        assert torch.equal(emb.table.as_tensor(), table0)
    values[37, 2] = table0[37, 2].float()
    np.save(shard, values)
    emb.table.zero_()
    emb.load(tmp_path / "ckpt")
    assert torch.equal(emb.table.as_tensor(), table0)


def _adam_step_saved(rng, path):
    """A one-rank Adam embedding after one step, saved at ``path``: (emb, opt, its tables' rows)."""
    emb = ss.ShardedOffloadedEmbedding(40, 4, max_rows=12, backend="numpy", storage="pageable")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    emb(torch.from_numpy(rng.integers(0, 40, size=12))).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    emb.save(path)
    return emb, opt, {name: t.to_numpy(copy=True) for name, t in emb._tables().items()}


def test_a_checkpoint_saved_at_a_path_ending_in_npy_loads_back(rng, tmp_path):
    """load() took any '*.npy' path for a whole-table file: the directory save() wrote there was refused."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "vectors.npy")
    emb(torch.arange(12)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    emb.load(tmp_path / "vectors.npy")
    assert opt.state[emb.weight]["step"] == 1
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)


def test_a_corrupt_shard_is_refused_before_any_row_changes(rng, tmp_path):
    """Each rank records its shards' CRC-32s; a load reads every shard it needs before changing a row."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    state = tmp_path / "ckpt" / "optimizer.exp_avg.rank0.npy"
    good = state.read_bytes()
    state.write_bytes(good[:-3] + bytes([good[-3] ^ 1]) + good[-2:])  # one bit of the last row
    emb.table.zero_()
    before = {name: t.to_numpy(copy=True) for name, t in emb._tables().items()}
    with pytest.raises(ss.FileFormatError, match="CRC-32"):
        emb.load(tmp_path / "ckpt")
    for name, table in emb._tables().items():  # the table too, though its own file is sound
        np.testing.assert_array_equal(table.to_numpy(), before[name], err_msg=name)
    state.write_bytes(good)
    (tmp_path / "ckpt" / "crc32.rank0.json").unlink()
    with pytest.raises(ss.FileFormatError, match="crc32.rank0.json' is missing"):
        emb.load(tmp_path / "ckpt")  # the manifest says the CRC-32s were saved
    manifest = tmp_path / "ckpt" / "manifest.json"
    older = json.loads(manifest.read_text())
    del older["checksums"]  # as a checkpoint saved before CRC-32s
    manifest.write_text(json.dumps(older))
    emb.load(tmp_path / "ckpt")
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)


@pytest.mark.parametrize("beside", ["ckpt.old", "ckpt.partial"])
def test_a_save_never_deletes_a_users_directory_beside_the_checkpoint(rng, tmp_path, beside):
    """``<path>.old`` and ``<path>.partial`` are a save's own names; a user's files there stay."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    mine = tmp_path / beside
    mine.mkdir()
    (mine / "notes.txt").write_text("my backup")
    emb.table.uniform_(-1, 1)
    with pytest.raises(ss.PathError, match="is in the way of this checkpoint's save"):
        emb.save(tmp_path / "ckpt")
    assert (mine / "notes.txt").read_text() == "my backup"
    emb.load(tmp_path / "ckpt")  # the earlier checkpoint is whole
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)
    (mine / "notes.txt").unlink()  # what a killed save leaves is cleared as before
    (mine / "table.rank0.npy").write_bytes(b"half a shard")
    emb.save(tmp_path / "ckpt")
    assert not mine.exists()


@pytest.mark.parametrize("edit", ["bounds", "tables", "world_size"])
def test_a_manifest_lacking_an_entry_is_refused_with_a_speedswap_error(rng, tmp_path, edit):
    """A manifest of the right format missing a key raised a bare KeyError."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / "manifest.json"
    edited = json.loads(manifest.read_text())
    if edit == "world_size":
        edited[edit] = 0
    else:
        del edited[edit]
    manifest.write_text(json.dumps(edited))
    for table in emb._tables().values():
        table.uniform_(-1, 1)
    before = {name: t.to_numpy(copy=True) for name, t in emb._tables().items()}
    with pytest.raises(ss.FileFormatError, match=f"lacks or mangles \\['{edit}'\\]"):
        emb.load(tmp_path / "ckpt")
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), before[name], err_msg=name)


def test_a_sharded_checkpoint_that_is_not_there_is_a_missing_file(rng, tmp_path):
    """A typo in the path read as a damaged checkpoint: FileFormatError "'ckpt2' has no
    manifest.json: it is not a (complete) sharded speedswap checkpoint", which
    ``except FileNotFoundError`` misses, where every other load says MissingFileError."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    plain = ss.OffloadedEmbedding(40, 4, max_rows=12, backend="numpy")
    for load in (emb.load, lambda path: ss.load_sharded(path, plain)):
        with pytest.raises(ss.MissingFileError, match="no sharded checkpoint at .*ckpt2.*check the path") as info:
            load(tmp_path / "ckpt2")
        assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ss.FileFormatError, match="has no manifest.json"):  # there, but not a checkpoint
        emb.load(tmp_path / "empty")
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)


def test_a_load_reads_no_file_once_every_shard_is_verified(rng, tmp_path, monkeypatch):
    """All or nothing: shards are staged in RAM while checked, so losing the files then changes nothing."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    for table in emb._tables().values():
        table.zero_()
    checked = sharded_checkpoint._plan

    def checked_then_lost(path, *args):
        plan = checked(path, *args)
        shutil.rmtree(path)  # the disk goes between the check and the copy
        return plan

    monkeypatch.setattr(sharded_checkpoint, "_plan", checked_then_lost)
    emb.load(tmp_path / "ckpt")
    assert opt.state[emb.weight]["step"] == 1  # the step count too, read with the manifest
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)


def test_an_mmap_shard_attaches_again_over_its_own_state_files(rng, tmp_path):
    """As OffloadedEmbedding does: the new optimizer's state starts afresh, in the same files."""
    emb = ss.ShardedOffloadedEmbedding(40, 4, max_rows=12, backend="numpy", storage="mmap", path=tmp_path)

    def train(opt):
        for _ in range(5):
            ids = torch.from_numpy(rng.integers(0, 40, size=12))
            emb(ids).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    first = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(first)
    train(first)
    assert all(table.to_numpy().any() for table in emb._state.tables.values())
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    tables = emb._state.tables
    assert not any(table.to_numpy().any() for table in tables.values())
    train(opt)
    for table in tables.values():
        assert table.to_numpy().any()
        np.testing.assert_array_equal(np.load(table.path), table.to_numpy())
    with pytest.raises(ss.OptionError, match="attach this optimizer instead"):
        first.step()  # the first optimizer no longer steps the weight: it is opt's now
    with pytest.raises(ss.OptionError):
        emb.attach(torch.optim.LBFGS(emb.parameters()))
    assert emb._state.tables is tables  # refused before anything changed


@pytest.mark.slow
def test_recommender_example_under_torchrun(tmp_path):
    """``torchrun --nproc-per-node 2 examples/recommender.py --distributed`` learns the ratings."""
    figures = _example_under_torchrun("recommender.py", ["--epochs", "4"], tmp_path)
    test_rmse = [epoch["test_rmse"] for epoch in figures["sharded"]]
    assert test_rmse[-1] < test_rmse[0] < figures["baseline_rmse"]
    # The planted noise (0.5) bounds what any model reaches; the mean predictor is far above it.
    assert test_rmse[-1] < 0.6 * figures["baseline_rmse"]


@pytest.mark.parametrize("manifest_flag", ["written", "older checkpoint without it"])
def test_sgd_momentum_survives_a_checkpoint(tmp_path, seed, manifest_flag):
    """SGD keeps no step count, so 'no scalar state' must not be read as 'never stepped'."""
    def build():
        emb = ss.ShardedOffloadedEmbedding(NUM_ROWS, DIM, max_rows=sharded_worker.GLOBAL_BATCH,
                                           backend="numpy", storage="pageable")
        emb.table.scatter(torch.arange(NUM_ROWS), initial_table(seed))
        opt = torch.optim.SGD(emb.parameters(), lr=0.05, momentum=0.9, dampening=0.3)
        emb.attach(opt)
        return emb, opt

    straight, straight_opt = build()
    train(straight, straight_opt, seed, range(STEPS), world=1, rank=0)
    first, first_opt = build()
    train(first, first_opt, seed, range(SAVE_AT), world=1, rank=0)
    first.save(tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / "manifest.json"
    if manifest_flag != "written":
        saved = json.loads(manifest.read_text())
        assert saved.pop("stepped") is True and saved["scalar_state"] == {}
        manifest.write_text(json.dumps(saved))
    resumed, resumed_opt = build()
    resumed.load(tmp_path / "ckpt")
    train(resumed, resumed_opt, seed, range(SAVE_AT, STEPS), world=1, rank=0)
    for name, array in shard_arrays(straight).items():
        np.testing.assert_array_equal(shard_arrays(resumed)[name], array, err_msg=name)


def test_a_checkpoint_saved_before_the_first_step_starts_the_optimizer_afresh(tmp_path, seed):
    emb, opt = make("adam")
    emb.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["stepped"] is False
    loaded, loaded_opt = make("adam")
    loaded.load(tmp_path / "ckpt")
    fresh, fresh_opt = make("adam")
    fresh.table.scatter(torch.arange(NUM_ROWS), emb.table.as_tensor())
    for e, o in ((loaded, loaded_opt), (fresh, fresh_opt)):
        train(e, o, seed, range(5), world=1, rank=0)
    for name, array in shard_arrays(fresh).items():
        np.testing.assert_array_equal(shard_arrays(loaded)[name], array, err_msg=name)


def test_a_step_refused_for_missing_optimizer_state_leaves_the_embedding_usable(rng):
    """The optimizer's state reset between steps: the step raises, and the advice it gives works."""
    emb = ss.ShardedOffloadedEmbedding(40, 3, max_rows=8, backend="numpy", storage="pageable")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)

    def step(ids):
        emb(torch.as_tensor(ids)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    step(rng.integers(0, 40, 5))
    capacity = emb.weight.shape
    opt.load_state_dict(torch.optim.Adam(emb.parameters(), lr=0.1).state_dict())
    before = emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match="discard_step\\(\\) and attach\\(optimizer, restart=True\\)"):
        step(rng.integers(0, 40, 5))
    assert emb.weight.shape == capacity  # not left narrowed to the failed step's rows
    np.testing.assert_array_equal(emb.table.to_numpy(), before)
    emb.discard_step()
    emb.attach(opt, restart=True)
    for _ in range(3):
        step(rng.integers(0, 40, 8))
    assert not np.array_equal(emb.table.to_numpy(), before)


def run_two_ranks(tmp_path, body):
    """Run ``body`` (Python lines) on 2 gloo ranks that know ``rank`` and ``out`` (``tmp_path``); both must exit 0.

    The script ends with ``os._exit(0)``: no interpreter teardown, where gloo's threads can abort the
    process. ``body`` writes what the test reads under ``out``.
    """
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys, datetime, numpy as np, torch, torch.distributed as dist, speedswap as ss\n"
        "rank, rendezvous, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
        "dist.init_process_group('gloo', init_method=rendezvous, rank=rank, world_size=2,\n"
        "                        timeout=datetime.timedelta(seconds=60))\n"
        + body + "os._exit(0)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    rendezvous = rendezvous_url(tmp_path)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), rendezvous, str(tmp_path)], env=env)
             for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]


def test_ranks_seeded_alike_draw_different_starting_rows(tmp_path, seed):
    """DDP code calls torch.manual_seed(s) on every rank; the shards must not repeat each other."""
    run_two_ranks(tmp_path,
                  f"torch.manual_seed({seed})\n"
                  "emb = ss.ShardedOffloadedEmbedding(10, 4, max_rows=4, backend='numpy', storage='pageable')\n"
                  "np.save(f'{out}/rows{rank}.npy', emb.table.to_numpy())\n"
                  "dist.barrier()\n")
    rows = np.concatenate([np.load(tmp_path / f"rows{r}.npy") for r in range(2)])
    assert len(np.unique(rows, axis=0)) == 10
    # N(0, 1), as nn.Embedding. 40 * std**2 of 40 draws is chi-squared: std > 1.5 has a chance of
    # 1e-5 a seed; outside (0.3, 2), below 1e-14, and no other init is near 1.
    assert abs(rows.mean()) < 1 and 0.3 < rows.std() < 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_seeded_table_starts_from_the_same_rows_at_any_world_size(tmp_path_factory, dtype):
    """Each rank drew its shard from a generator seeded with its rank: ranks seeded alike started
    from another table on 1, 2 and 3 ranks, so that no run could be compared with (or resumed as)
    one of another size. Each block of rows of the whole table has its own seeded stream now."""
    assert INITIAL_ROWS > 2 * INITIAL_BLOCK_ROWS  # blocks cut between ranks, and a last block in part
    seed = fixture_seed("initial rows")
    tables = {}
    for world in (1, 2, 3):
        out = tmp_path_factory.mktemp(f"init{world}")
        assert_ok(launch(world, out, seed, f"init:{dtype}"))
        tables[world], _ = gathered(out, f"init-{dtype}", world)
    np.testing.assert_array_equal(tables[2], tables[1])
    np.testing.assert_array_equal(tables[3], tables[1])
    rows = tables[1]
    assert rows.shape == (INITIAL_ROWS, DIM) and len(np.unique(rows, axis=0)) == INITIAL_ROWS
    # N(0, 1), as nn.Embedding: the mean and std of 14,094 draws are off by under 0.05 but once in 1e9.
    assert abs(rows.mean()) < 0.05 and abs(rows.std() - 1) < 0.05


#: The collectives each call makes on 2 ranks, by kind (see the test below).
COLLECTIVES = {
    # the call's check (begin), the ids, the agreement that the rows asked for were read (reply), the rows
    "training forward": {"all_gather": 1, "all_to_all_single": 2, "all_reduce": 1},
    # and the agreement on the memory the ids arrive in, which nothing bounds here (Exchange.rows)
    "eval forward": {"all_gather": 1, "all_to_all_single": 2, "all_reduce": 2},
    "backward": {},
    # the call's check, the agreement that the gradients to send were made, the gradients
    "optimizer.step()": {"all_gather": 1, "all_to_all_single": 1, "all_reduce": 1},
    "exchange_gradients()": {"all_gather": 1, "all_to_all_single": 1, "all_reduce": 1},
    "optimizer.step() after exchange_gradients()": {"all_gather": 1},  # the ranks agree to step
}


def test_each_call_makes_the_collectives_its_agreements_need_and_no_more(tmp_path, seed):
    """Each collective is a latency every step pays (on NCCL a host wait, too): the agreements that
    keep a failing rank from hanging its peers are counted here, so that none is added unnoticed."""
    run_two_ranks(tmp_path,
                  "import collections, json\n"
                  "made = collections.Counter()\n"
                  "def counted(name, collective):\n"
                  "    def call(*args, **kwargs):\n"
                  "        made[name] += 1\n"
                  "        return collective(*args, **kwargs)\n"
                  "    return call\n"
                  "for name in ('all_gather', 'all_reduce', 'all_to_all_single', 'broadcast', 'barrier',\n"
                  "             'all_gather_object', 'all_gather_into_tensor', 'reduce_scatter', 'send', 'recv'):\n"
                  "    setattr(dist, name, counted(name, getattr(dist, name)))\n"
                  "emb = ss.ShardedOffloadedEmbedding(60, 4, max_rows=16, storage='pageable', backend='numpy')\n"
                  "opt = torch.optim.Adam(emb.parameters(), lr=0.1)\n"
                  "emb.attach(opt)\n"
                  "calls = {}\n"
                  "def count(what, call):\n"
                  "    made.clear()\n"
                  "    result = call()\n"
                  "    calls.setdefault(what, []).append(dict(made))\n"
                  "    return result\n"
                  f"rng = np.random.default_rng([{seed}, rank])\n"
                  "for step in range(4):\n"
                  "    ids = torch.from_numpy(np.minimum(rng.zipf(1.5, 12), 60) - 1)\n"
                  "    rows = count('training forward', lambda: emb(ids))\n"
                  "    count('backward', lambda: rows.pow(2).sum().backward())\n"
                  "    if step % 2:\n"
                  "        count('exchange_gradients()', emb.exchange_gradients)\n"
                  "        count('optimizer.step() after exchange_gradients()', opt.step)\n"
                  "    else:\n"
                  "        count('optimizer.step()', opt.step)\n"
                  "    opt.zero_grad()\n"
                  "    with torch.no_grad():\n"
                  "        count('eval forward', lambda: emb(ids))\n"
                  "json.dump(calls, open(f'{out}/calls{rank}.json', 'w'))\n")
    for rank in range(2):
        calls = json.loads((tmp_path / f"calls{rank}.json").read_text())
        assert calls == {what: [made] * len(calls[what]) for what, made in COLLECTIVES.items()}, calls


def test_ranks_whose_zero_grad_differs_are_told_to_zero_gradients_alike(tmp_path):
    """A step with no forward after zero_grad(set_to_none=False) on rank 0 and zero_grad() on rank 1
    counts on rank 0 only (a zero gradient against None): the next forward refused on both ranks,
    with advice about attach and load alone."""
    run_two_ranks(tmp_path,
                  "emb = ss.ShardedOffloadedEmbedding(20, 3, max_rows=8, storage='pageable', backend='numpy')\n"
                  "opt = torch.optim.Adam(emb.parameters(), lr=0.1)\n"
                  "emb.attach(opt)\n"
                  "ids = torch.tensor([1, 15])\n"
                  "emb(ids).pow(2).sum().backward()\n"
                  "opt.step()\n"
                  "opt.zero_grad(set_to_none=rank == 1)\n"
                  "opt.step()  # the other layers' step: counts on rank 0 (a zero gradient), not on rank 1\n"
                  "try:\n"
                  "    emb(ids)\n"
                  "    message = 'no error'\n"
                  "except ss.StateError as exc:\n"
                  "    message = str(exc)\n"
                  "open(f'{out}/rank{rank}.txt', 'w').write(message)\n")
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "differ" in message and "zero gradients alike on every rank" in message, message


def test_a_save_that_fails_at_its_last_rename_keeps_the_earlier_checkpoint(tmp_path, seed, monkeypatch):
    emb, opt = make("adam")
    train(emb, opt, seed, range(3), world=1, rank=0)
    emb.save(tmp_path / "ckpt")
    saved = shard_arrays(emb)
    train(emb, opt, seed, range(3, 6), world=1, rank=0)
    rename = os.rename

    def failing(src, dst):
        if str(src).endswith(".partial"):
            raise OSError(28, "No space left on device (injected)")
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="injected"):
        emb.save(tmp_path / "ckpt")
    monkeypatch.setattr(os, "rename", rename)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    restored, _ = make("adam")
    restored.load(tmp_path / "ckpt")
    for name, array in saved.items():
        np.testing.assert_array_equal(shard_arrays(restored)[name], array, err_msg=name)
    # A save killed between its renames leaves only the earlier checkpoint, beside the path.
    rename(tmp_path / "ckpt", tmp_path / "ckpt.old")
    with pytest.raises(ss.FileFormatError, match="left the previous checkpoint at .*ckpt.old"):
        restored.load(tmp_path / "ckpt")


def _clip_run(table0, batches, clip, exchange, sharded, scaler=None):
    """SGD on squared errors with a gradient clip (and a GradScaler): sharded (one rank) or a dense reference."""
    if sharded:
        emb = ss.ShardedOffloadedEmbedding(len(table0), table0.shape[1], max_rows=16, backend="numpy",
                                           storage="pageable")
        emb.table.scatter(torch.arange(len(table0)), torch.from_numpy(table0))
        params = list(emb.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        emb.attach(opt)
        lookup = emb
    else:
        weight = torch.nn.Parameter(torch.from_numpy(table0.copy()))
        params = [weight]
        opt = torch.optim.SGD(params, lr=0.1)
        lookup = functools.partial(torch.nn.functional.embedding, weight=weight)
    for ids, targets in batches:
        loss = ((lookup(ids) - targets) ** 2).sum()
        (loss if scaler is None else scaler.scale(loss)).backward()
        if exchange:
            emb.exchange_gradients()
        if scaler is not None:
            scaler.unscale_(opt)
        clip(params)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return emb.table.to_numpy() if sharded else weight.detach().numpy()


@pytest.mark.parametrize("clip", [lambda p: torch.nn.utils.clip_grad_norm_(p, 0.5),
                                  lambda p: torch.nn.utils.clip_grad_value_(p, 0.05)], ids=["norm", "value"])
def test_gradients_clipped_after_exchange_gradients_equal_in_memory_clipping(clip, rng):
    table0 = rng.standard_normal((40, 3)).astype(np.float32)
    batches = [(torch.from_numpy(rng.integers(0, 40, 12)), torch.from_numpy(rng.standard_normal((12, 3),
                                                                                             dtype=np.float32)))
               for _ in range(20)]
    expected = _clip_run(table0, batches, clip, exchange=False, sharded=False)
    np.testing.assert_allclose(_clip_run(table0, batches, clip, exchange=True, sharded=True), expected,
                               rtol=1e-6, atol=1e-6)
    # Without the exchange the clip would act on a gradient that has not arrived: refused.
    with pytest.raises(ss.StateError, match="exchange_gradients\\(\\) on every rank before clipping"):
        _clip_run(table0, batches, clip, exchange=False, sharded=True)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_grad_norm_is_the_tables_gradient_norm_and_needs_the_exchange(rng, norm_type):
    emb, opt, ref, _ = _sgd_against_in_memory(rng, 12)
    ids = torch.from_numpy(rng.integers(0, 30, 10))
    emb(ids).pow(3).sum().backward()
    with pytest.raises(ss.StateError, match="call emb.exchange_gradients\\(\\) on every rank"):
        emb.grad_norm(norm_type)
    emb.exchange_gradients()
    F.embedding(ids, ref).pow(3).sum().backward()
    expected = torch.linalg.vector_norm(ref.grad, norm_type)
    torch.testing.assert_close(emb.grad_norm(norm_type), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm_type", ["fro", None])
def test_a_grad_norm_order_that_is_not_a_number_is_refused_before_any_message(rng, norm_type):
    """float(norm_type) raised a bare ValueError (TypeError) after the ranks' first message, so a
    rank passing it left its peers waiting in the norm's all-gather."""
    emb, opt, ref, _ = _sgd_against_in_memory(rng, 12)
    ids = torch.from_numpy(rng.integers(0, 30, 10))
    emb(ids).pow(3).sum().backward()
    emb.exchange_gradients()
    with pytest.raises(ss.OptionError, match="norm_type=.*a number, as torch.linalg.vector_norm's ord"):
        emb.grad_norm(norm_type)
    F.embedding(ids, ref).pow(3).sum().backward()
    torch.testing.assert_close(emb.grad_norm("inf"), ref.grad.abs().max(), rtol=1e-6, atol=0)  # as torch's clip takes it


def _errors_told(emb, monkeypatch):
    """The error (or None) each of ``emb``'s messages from now on tells its peers, in a list filled as they go."""
    told, begin = [], emb._exchange.begin

    def telling(call, error, *args, **kwargs):
        told.append(error)
        return begin(call, error, *args, **kwargs)
    monkeypatch.setattr(emb._exchange, "begin", telling)
    return told


def _out_of_memory(*_, **__):
    raise MemoryError("injected")


def test_a_grad_norm_failing_on_one_rank_tells_its_peers_in_the_first_message(rng, monkeypatch):
    """The norm of this rank's rows was taken after the ranks' first message: out of memory there
    raised on this rank alone and left its peers waiting in the norms' all-gather until the group's
    timeout. It is taken before now, and its failure goes in that message (every rank raises)."""
    emb, opt, ref, _ = _sgd_against_in_memory(rng, 12)
    ids = torch.from_numpy(rng.integers(0, 30, 10))
    emb(ids).pow(3).sum().backward()
    emb.exchange_gradients()
    told = _errors_told(emb, monkeypatch)
    with monkeypatch.context() as failing:
        failing.setattr(torch.linalg, "vector_norm", _out_of_memory)
        with pytest.raises(MemoryError, match="injected"):
            emb.grad_norm()
    assert len(told) == 1 and isinstance(told[0], MemoryError)
    F.embedding(ids, ref).pow(3).sum().backward()
    torch.testing.assert_close(emb.grad_norm(), ref.grad.norm(), rtol=1e-6, atol=0)  # retried


def test_a_forward_retried_on_its_rank_alone_after_a_write_into_the_weight_is_refused_there_alone(
        rng, monkeypatch):
    """A training forward that failed after its messages (making its output) is finished by the same
    forward again on its rank alone, with no message. A write into ``emb.weight`` before that retry
    reaches none of the rows it would read: it is refused, as any forward after such a write, on this
    rank alone, sending no message its peers (done with the forward) would not match; nothing changes.
    After ``discard_step()`` training goes on as in memory."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 12)
    ids = torch.from_numpy(rng.integers(0, 30, 8))
    told = _errors_told(emb, monkeypatch)
    emb(ids).pow(3).sum().backward()
    with monkeypatch.context() as failing:
        failing.setattr(F, "embedding", _out_of_memory)  # the output, made after the forward's messages
        with pytest.raises(MemoryError, match="injected"):
            emb(ids.flip(0))
    assert len(told) == 2
    with torch.no_grad():
        emb.weight.mul_(0.5)
    for _ in range(2):  # refused again: nothing changed
        with pytest.raises(ss.StateError, match=r"written in place since this step's last training forward"):
            emb(ids.flip(0))
    assert len(told) == 2  # no message
    emb.discard_step()
    opt.zero_grad()
    for _ in range(3):
        ids = torch.from_numpy(rng.integers(0, 30, 8))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            lookup(ids).pow(3).sum().backward()
            optim.step()
            optim.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def _exchange_with_peers(monkeypatch, world):
    """An Exchange of ``world`` ranks in this one process: every peer sends what this rank sends."""
    monkeypatch.setattr(torch.distributed, "all_gather",
                        lambda out, sent, group=None: [part.copy_(sent) for part in out])
    exchange = Exchange()
    exchange.world_size = world
    return exchange


@pytest.mark.parametrize("norm_type", [2.0, 3.0])
def test_a_float16_grad_norm_over_ranks_is_finite_where_the_tables_norm_is(monkeypatch, rng, norm_type):
    """Each rank's norm was raised to norm_type in float16: one past 256 squared to inf, and clipping
    by inf zeroes every gradient, where in memory (torch sums a float16 norm in float32) it is finite."""
    grad = (torch.from_numpy(rng.standard_normal((500, 8))) * 30).half()  # a norm near 1,900
    total = _exchange_with_peers(monkeypatch, 2).norm(torch.linalg.vector_norm(grad, norm_type), norm_type)
    expected = torch.linalg.vector_norm(torch.cat([grad, grad]).double(), norm_type)
    assert total.dtype == torch.float16
    torch.testing.assert_close(total.double(), expected, rtol=2e-3, atol=0)



@pytest.mark.parametrize("norm_type", [0.0, -math.inf, -1.0, 0.5, 1.0, math.inf])
def test_grad_norm_over_ranks_combines_the_parts_as_torch_norms_the_whole(monkeypatch, rng, norm_type):
    """Every order torch.linalg.vector_norm takes: order 0 (a count of non-zero entries) raised
    ZeroDivisionError after the collective, and -inf gave 1.0 where the smallest entry is 0."""
    grad = torch.from_numpy(rng.standard_normal((100, 4)))
    grad[rng.random(100) < 0.3] = 0  # rows no lookup reached
    total = _exchange_with_peers(monkeypatch, 2).norm(torch.linalg.vector_norm(grad, norm_type), norm_type)
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.cat([grad, grad]), norm_type))
def test_grad_norm_over_ranks_makes_one_host_wait_however_many_ranks(monkeypatch, rng):
    """Exchange.norm read each rank's norm_type with a float() of its own: on a GPU a host wait per
    rank, every step that clips (tests/host_syncs.py counts them on the CPU)."""
    local = torch.linalg.vector_norm(torch.from_numpy(rng.standard_normal(50)))
    for world in (2, 8):
        exchange = _exchange_with_peers(monkeypatch, world)
        with HostSyncs() as syncs:
            total = exchange.norm(local, 2.0)
        assert syncs.total == 1, dict(syncs.where)
        torch.testing.assert_close(total, local * math.sqrt(world))


def test_a_grad_scaler_after_exchange_gradients_unscales_the_tables_gradient(rng):
    table0 = rng.standard_normal((40, 3)).astype(np.float32)
    batches = [(torch.from_numpy(rng.integers(0, 40, 12)), torch.from_numpy(rng.standard_normal((12, 3),
                                                                                             dtype=np.float32)))
               for _ in range(20)]
    no_clip = lambda p: None  # noqa: E731
    expected = _clip_run(table0, batches, no_clip, exchange=False, sharded=False,
                         scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    got = _clip_run(table0, batches, no_clip, exchange=True, sharded=True,
                    scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["scaler.step", "unscale_ then step", "unscale_ before exchange_gradients",
                                 "fused scaler.step"])
def test_a_grad_scaler_without_exchange_gradients_is_refused_before_any_row_changes(rng, how):
    """Its in-place unscale did not bump the placeholder's version: the table stepped on the
    still-scaled gradient (init_scale times too far), its infs unchecked."""
    emb = ss.ShardedOffloadedEmbedding(40, 3, max_rows=16, backend="numpy", storage="pageable")
    emb.table.scatter(torch.arange(40), torch.from_numpy(rng.standard_normal((40, 3), dtype=np.float32)))
    opt = torch.optim.Adam(emb.parameters(), lr=0.1, fused=how.startswith("fused"))
    emb.attach(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ids = torch.from_numpy(rng.integers(0, 40, 12))
    target = torch.from_numpy(rng.standard_normal((12, 3), dtype=np.float32))
    before = emb.table.to_numpy(copy=True)
    scaler.scale(((emb(ids) - target) ** 2).sum()).backward()
    if how.startswith("unscale_"):
        scaler.unscale_(opt)
    advice = "exchange_gradients\\(\\) on every rank before clipping or unscaling"
    with pytest.raises(ss.StateError, match=advice):
        emb.exchange_gradients() if how.endswith("exchange_gradients") else scaler.step(opt)
    np.testing.assert_array_equal(emb.table.to_numpy(), before)
    emb.discard_step()  # as the error says; done right, the step trains
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(((emb(ids) - target) ** 2).sum()).backward()
    emb.exchange_gradients()
    scaler.step(opt)
    assert not np.array_equal(emb.table.to_numpy(), before)


def test_zero_grad_keeping_tensors_after_a_backward_is_refused_at_the_step(rng):
    """zero_grad(set_to_none=False) would zero a gradient that has not arrived; discard_step() skips."""
    emb, opt = make("adam")
    ids = torch.from_numpy(rng.integers(0, NUM_ROWS, 10))
    emb(ids).pow(2).sum().backward()
    opt.zero_grad(set_to_none=False)
    before = emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match="discard_step\\(\\) on every rank to skip"):
        opt.step()
    emb.discard_step()
    emb(ids).pow(2).sum().backward()
    emb.exchange_gradients()
    with pytest.raises(ss.StateError, match="twice in one step"):
        emb.exchange_gradients()
    emb(ids).pow(2).sum().backward()  # after the exchange: its gradient would be lost
    with pytest.raises(ss.StateError, match="a backward ran after exchange_gradients"):
        opt.step()
    emb.discard_step()
    np.testing.assert_array_equal(emb.table.to_numpy(), before)
    with pytest.raises(ss.StateError, match="without a training forward"):
        emb.exchange_gradients()


@pytest.mark.parametrize("cache_rows", [1, 100])
def test_a_device_cache_is_refused_with_a_speedswap_error(cache_rows):
    """Code moved over from OffloadedEmbedding(cache_rows=...) is told the sharded table has none."""
    with pytest.raises(ss.OptionError, match="no device cache"):
        ss.ShardedOffloadedEmbedding(50, 3, max_rows=8, backend="numpy", storage="pageable",
                                     cache_rows=cache_rows)
    ss.ShardedOffloadedEmbedding(50, 3, max_rows=8, backend="numpy", storage="pageable", cache_rows=0)


@pytest.mark.parametrize("call", ["prefetch", "flush"])
def test_prefetch_and_flush_are_refused_saying_what_to_do(call, rng):
    """Code moved over from OffloadedEmbedding met an AttributeError; a call that did nothing would hide
    that the sharded table has no cache. Refused, naming what to do, and nothing changes."""
    emb = ss.ShardedOffloadedEmbedding(50, 3, max_rows=8, backend="numpy", storage="pageable")
    opt = torch.optim.Adam(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ids = torch.from_numpy(rng.integers(0, 50, 6))
    emb(ids).pow(2).sum().backward()
    before = emb.table.to_numpy(copy=True)
    args = (ids,) if call == "prefetch" else ()
    with pytest.raises(ss.OptionError, match=rf"has no device cache, so {call}\(\)") as raised:
        getattr(emb, call)(*args)
    assert ("OffloadedEmbedding(cache_rows=...)" if call == "prefetch" else "emb.save(path)") in str(raised.value)
    np.testing.assert_array_equal(emb.table.to_numpy(), before)
    opt.step()  # the step under way goes on
    assert not np.array_equal(emb.table.to_numpy(), before)


def test_stats_count_each_ranks_rows_as_its_ids_and_its_peers_say(tmp_path, seed):
    """Each rank's counters against counts made from every rank's ids: Zipf ids, two forwards a step,
    Adam, a step dropped by zero_grad() (it counts nothing) and an eval forward (nothing either)."""
    rows = 97
    run_two_ranks(tmp_path,
                  "import json\n"
                  f"rng = np.random.default_rng([{seed}, rank])\n"
                  f"emb = ss.ShardedOffloadedEmbedding({rows}, 4, max_rows=80, backend='numpy', storage='pageable')\n"
                  "opt = torch.optim.Adam(emb.parameters(), lr=0.01)\n"
                  "emb.attach(opt)\n"
                  f"p = 1.0 / np.arange(1, {rows} + 1)\n"
                  "p /= p.sum()\n"
                  "record = []\n"
                  "for step in range(6):\n"
                  f"    zipf = rng.permutation({rows})\n"
                  f"    forwards = [zipf[rng.choice({rows}, size=rng.integers(1, 40), p=p)] for _ in range(2)]\n"
                  "    sum(emb(torch.from_numpy(ids)).pow(2).sum() for ids in forwards).backward()\n"
                  "    if step != 3:\n"
                  "        opt.step()\n"
                  "    opt.zero_grad()\n"
                  "    record.append({'ids': [f.tolist() for f in forwards], 'stats': emb.stats()})\n"
                  "with torch.no_grad():\n"
                  f"    emb(torch.arange({rows}))\n"
                  "json.dump({'steps': record, 'end': emb.stats()}, open(f'{out}/stats{rank}.json', 'w'))\n")
    ranks = [json.loads((tmp_path / f"stats{r}.json").read_text()) for r in range(2)]
    bounds = [0, 49, rows]  # torch.tensor_split's cut of 97 rows over 2 ranks
    owned = [set(range(bounds[r], bounds[r + 1])) for r in range(2)]
    total = [dict.fromkeys(ranks[0]["end"]["total"], 0) for _ in range(2)]
    for step in range(6):
        looked_up = [set().union(*ranks[r]["steps"][step]["ids"]) for r in range(2)]
        for r in range(2):
            expected = {"steps": 1, "unique_rows": len(looked_up[r]),
                        "owned_rows": len((looked_up[0] | looked_up[1]) & owned[r]),
                        "lookups": sum(len(ids) for ids in ranks[r]["steps"][step]["ids"]),
                        "rows_from_peers": len(looked_up[r] - owned[r]),
                        "rows_to_peers": len(looked_up[1 - r] & owned[r])}
            last = ranks[r]["steps"][step - (step == 3)]["stats"]["last_step"]  # step 3 was dropped
            if step != 3:
                for name, count in expected.items():
                    total[r][name] += count
                assert last == expected, (step, r)
            assert ranks[r]["steps"][step]["stats"]["last_step"] == last, (step, r)
            assert ranks[r]["steps"][step]["stats"]["total"] == total[r], (step, r)
    for r in range(2):
        assert ranks[r]["end"]["total"] == total[r]  # the eval forward counted nothing
        assert total[r]["rows_from_peers"] > 0 and total[r]["rows_to_peers"] > 0


def test_close_releases_the_shard_keeps_mmap_files_and_refuses_later_calls(tmp_path, rng):
    emb = ss.ShardedOffloadedEmbedding(40, 3, max_rows=8, backend="numpy", storage="mmap", path=tmp_path)
    head = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam([emb.weight, *head.parameters()], lr=0.1)
    emb.attach(opt)
    ids = torch.from_numpy(rng.integers(0, 40, 6))
    head(emb(ids)).sum().backward()
    opt.step()
    opt.zero_grad()
    trained = emb.table.to_numpy(copy=True)
    with emb:
        pass  # the context manager closes it
    emb.close()  # idempotent
    assert emb.table.closed
    np.testing.assert_array_equal(np.load(tmp_path / "rank0" / "table.npy"), trained)
    for call in (lambda: emb(ids), lambda: emb.attach(opt), lambda: emb.save(tmp_path / "ckpt"),
                 lambda: emb.load(tmp_path / "rank0" / "table.npy"), emb.exchange_gradients):
        with pytest.raises(ss.StateError, match="closed"):
            call()
    head(torch.ones(2, 3)).sum().backward()
    opt.step()  # the optimizer goes on with its other parameters


def test_a_shard_too_large_to_stage_changed_after_it_was_verified_loads_nothing(rng, tmp_path, monkeypatch):
    """Read again at commit, every shard is confirmed unchanged before the first table changes."""
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    monkeypatch.setattr(sharded_checkpoint, "available_ram", lambda: 0)  # nothing staged in RAM
    for table in emb._tables().values():
        table.uniform_(-1, 1)
    before = {name: t.to_numpy(copy=True) for name, t in emb._tables().items()}
    checked = sharded_checkpoint._plan
    last = tmp_path / "ckpt" / "optimizer.exp_avg_sq.rank0.npy"  # the last table committed
    good = last.read_bytes()

    def checked_then_changed(path, *args):
        plan = checked(path, *args)
        last.write_bytes(good[:-4] + bytes(b ^ 0x55 for b in good[-4:]))  # another writer, in place
        return plan

    monkeypatch.setattr(sharded_checkpoint, "_plan", checked_then_changed)
    with pytest.raises(ss.FileFormatError, match="changed or replaced since it was verified"):
        emb.load(tmp_path / "ckpt")
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), before[name], err_msg=name)
    last.write_bytes(good)
    monkeypatch.setattr(sharded_checkpoint, "_plan", checked)
    emb.load(tmp_path / "ckpt")  # read twice, the intact checkpoint loads
    for name, table in emb._tables().items():
        np.testing.assert_array_equal(table.to_numpy(), saved[name], err_msg=name)


def test_a_whole_table_npy_too_large_to_stage_changed_after_it_was_verified_loads_nothing(
        rng, tmp_path, monkeypatch):
    import speedswap.train.sharded as sharded_module
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    path = tmp_path / "vectors.npy"
    np.save(path, rng.standard_normal(emb.table.shape).astype(np.float32))
    good = path.read_bytes()
    monkeypatch.setattr(sharded_checkpoint, "available_ram", lambda: 0)
    staged_by = sharded_module.stage_table_rows

    def staged_then_changed(*args):
        staged = staged_by(*args)
        path.write_bytes(good[:-4] + bytes(b ^ 0x55 for b in good[-4:]))
        return staged

    monkeypatch.setattr(sharded_module, "stage_table_rows", staged_then_changed)
    with pytest.raises(ss.FileFormatError, match="changed or replaced since it was verified"):
        emb.load(path)
    np.testing.assert_array_equal(emb.table.to_numpy(), saved["table"])
    path.write_bytes(good)
    monkeypatch.setattr(sharded_module, "stage_table_rows", staged_by)
    emb.load(path)
    np.testing.assert_array_equal(emb.table.to_numpy(), np.load(path))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_step_skipped_after_its_backward_then_zero_grad_after_the_next_forward(rng, optimizer):
    """forward, zero_grad(), backward, step, with steps skipped after their backward: the skipped
    gradient is dropped (it was sent with the next step's), as in memory."""
    rows, dim, steps = 50, 4, 40
    table0 = rng.standard_normal((rows, dim)).astype(np.float32)
    emb = ss.ShardedOffloadedEmbedding(rows, dim, max_rows=40, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    if optimizer == "sgd":
        opt, ref_opt = torch.optim.SGD(emb.parameters(), lr=0.1), torch.optim.SGD([ref], lr=0.1)
    else:
        opt = torch.optim.Adam(emb.parameters(), lr=0.05, eps=1e-30)
        ref_opt = torch.optim.SparseAdam([ref], lr=0.05, eps=1e-30)
    emb.attach(opt)
    p = 1.0 / np.arange(1, rows + 1)
    skipped = set(rng.choice(steps, size=steps // 3, replace=False).tolist())
    for step in range(steps):
        ids = torch.from_numpy(rng.choice(rows, size=12, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((12, dim)).astype(np.float32))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref, sparse=True), ref_opt)):
            out = lookup(ids)
            optim.zero_grad()
            ((out - target) ** 2).sum().backward()
            if step not in skipped:
                optim.step()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_step_whose_forwards_no_backward_reached_leaves_the_optimizer_alone(rng):
    """In memory a table that no backward reached has no gradient and torch's step skips it: Adam's
    step count stays. The sharded step gave it a zero gradient, counted the step, and every later
    step's bias correction differed (0.02 on unit rows after four steps)."""
    rows, dim, steps = 40, 3, 12
    _, emb, opt, ref, ref_opt = _one_rank_adam(rng, rows, dim)
    unreached = {1, 2, 7}  # the first two before the optimizer made any state
    for step in range(steps):
        ids = torch.from_numpy(rng.integers(0, rows, 10))
        target = torch.from_numpy(rng.standard_normal((10, dim)).astype(np.float32))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref, sparse=True), ref_opt)):
            out = lookup(ids)
            if step not in unreached:  # else the output does not enter the loss: no backward reaches it
                ((out - target) ** 2).sum().backward()
            optim.step()
            if step not in unreached:  # no gradient to drop: the next backward needs no zero_grad()
                optim.zero_grad()
    assert opt.state[emb.weight]["step"] == ref_opt.state[ref]["step"] == steps - len(unreached)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["adam", "sparse_adam"])
@pytest.mark.parametrize("flow", ["discard_step", "step without a forward", "forward without a backward"])
def test_a_step_on_a_zero_gradient_counts_as_in_memory(rng, flow, optimizer):
    """With zero_grad(set_to_none=False) an in-memory table's gradient is zeros, never None, so a
    step on it counts (Adam's step) though no row moves. The sharded table dropped the zeroed
    gradient (and discard_step() set it to None): torch skipped it, and every later step's bias
    correction differed (0.0078 on unit rows after eight steps, step 7 against 8)."""
    rows, dim, steps = 40, 3, 8
    table0 = rng.standard_normal((rows, dim)).astype(np.float32)
    emb = ss.ShardedOffloadedEmbedding(rows, dim, max_rows=16, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    kwargs = dict(lr=0.05, eps=1e-30)
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SparseAdam)(emb.parameters(), **kwargs)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SparseAdam([ref], **kwargs)
    batches = [(torch.from_numpy(rng.integers(0, rows, 10)),
                torch.from_numpy(rng.standard_normal((10, dim)).astype(np.float32))) for _ in range(steps)]
    for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref, sparse=True), ref_opt)):
        for step, (ids, target) in enumerate(batches):
            out = lookup(ids)
            if step == 2 and flow == "forward without a backward":
                optim.step()  # the loss was not used, say: on a zero gradient
                continue
            ((out - target) ** 2).sum().backward()
            if step == 2 and flow == "discard_step":
                optim.zero_grad(set_to_none=False)  # the step is skipped
                if lookup is emb:
                    emb.discard_step()
            optim.step()
            optim.zero_grad(set_to_none=False)
            if step == 2 and flow == "step without a forward":
                optim.step()  # a step of the other layers only, say
    assert int(opt.state[emb.weight]["step"]) == int(ref_opt.state[ref]["step"]) == steps + 1 - (
        flow != "step without a forward")
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_save_after_a_step_skipped_before_its_backward_says_to_discard_it(rng, tmp_path):
    """The forward's rows wait for the next step, so a save is refused: the error named no way out
    ("call it between steps", where the loop already was); OffloadedEmbedding's names discard_step()."""
    emb, opt = make("adam")
    before = emb.table.to_numpy(copy=True)
    emb(torch.from_numpy(rng.integers(0, NUM_ROWS, 10))).pow(2).sum()
    opt.zero_grad()  # the loss was not finite, say: no backward, no step
    with pytest.raises(ss.StateError, match=r"emb\.discard_step\(\) first"):
        emb.save(tmp_path / "ckpt")
    emb.discard_step()
    emb.save(tmp_path / "ckpt")
    emb.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(emb.table.to_numpy(), before)


def _sgd_against_in_memory(rng, max_rows):
    """(emb, opt, ref, ref_opt): a one-process sharded SGD and an in-memory one on the same 30 rows."""
    table0 = rng.standard_normal((30, 3)).astype(np.float32)
    emb = ss.ShardedOffloadedEmbedding(30, 3, max_rows=max_rows, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    return emb, opt, ref, torch.optim.SGD([ref], lr=0.1)


def test_a_step_with_a_closure_trains_as_in_memory(rng):
    """The closure's forward ran after the step's pre-hook had exchanged nothing: StateError 'Adam's step()
    left its per-row state ... fix the optimizer', where OffloadedEmbedding and nn.Embedding train."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 12)
    for _ in range(5):
        ids = torch.from_numpy(rng.integers(0, 30, 8))
        for model, optimizer in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            def closure(model=model, optimizer=optimizer):
                optimizer.zero_grad()
                loss = model(ids).pow(3).sum()
                loss.backward()
                return loss
            optimizer.step(closure)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_a_second_backward_through_a_kept_graph_after_zero_grad_trains_on_its_gradient(rng):
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 12)
    for _ in range(10):
        ids = torch.from_numpy(rng.integers(0, 30, 8))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            loss = (lookup(ids) ** 3).sum()
            loss.backward(retain_graph=True)
            optim.zero_grad()
            loss.backward()
            optim.step()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exchange_again", [True, False])
def test_a_step_skipped_after_exchange_gradients_then_zero_grad_after_the_next_forward(rng, exchange_again):
    """The GradScaler pattern: exchange_gradients(), the scaler skips the step; the next step in the
    order forward, zero_grad(), backward trains on its own gradient alone."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 16)
    for step in range(12):
        ids = torch.from_numpy(rng.integers(0, 30, 8))
        skipped = step % 3 == 1
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            out = lookup(ids)
            optim.zero_grad()
            (out ** 3).sum().backward()
            if optim is opt and (exchange_again or skipped):
                emb.exchange_gradients()
            if not skipped:
                optim.step()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def _one_rank_adam(rng, rows, dim):
    """A one-rank sharded table of random rows with Adam, and the same rows as one parameter with SparseAdam.

    Returns:
        ``table0, emb, opt, ref, ref_opt``.
    """
    table0 = rng.standard_normal((rows, dim)).astype(np.float32)
    emb = ss.ShardedOffloadedEmbedding(rows, dim, max_rows=24, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(table0)))
    opt = torch.optim.Adam(emb.parameters(), lr=0.05, eps=1e-30)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    return table0, emb, opt, ref, torch.optim.SparseAdam([ref], lr=0.05, eps=1e-30)


def _each_side_of_each_step(rng, emb, opt, ref, ref_opt, steps=20):
    """Steps of ``_one_rank_adam``'s pair, each paused after its backward, a few of them marked for the test.

    A step pulls 12 ids, drawn Zipf-like, towards random targets, on the sharded table and then on
    the in-memory reference. About 30% of the steps are marked: never the first two (momentum
    first), one at least.

    Args:
        rng: the test's generator.
        emb, opt, ref, ref_opt: what ``_one_rank_adam`` returned.
        steps: how many steps.

    Yields:
        ``(marked, optimizer, weight)`` for each side of each step, after its backward: the caller
        may change ``weight.grad``; resuming steps ``optimizer`` and zeroes its gradients.
    """
    rows, dim = ref.shape
    p = 1.0 / np.arange(1, rows + 1)
    marked = rng.random(steps) < 0.3
    marked[:2], marked[rng.integers(2, steps)] = False, True
    for mark in marked:
        ids = torch.from_numpy(rng.choice(rows, size=12, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((12, dim)).astype(np.float32))
        for lookup, optimizer, weight in ((emb, opt, emb.weight),
                                          (lambda i: F.embedding(i, ref, sparse=True), ref_opt, ref)):
            ((lookup(ids) - target) ** 2).sum().backward()
            yield mark, optimizer, weight
            optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize("exchanged", [True, False], ids=["after_exchange_gradients", "before"])
def test_a_gradient_multiplied_by_zero_in_place_trains_as_in_memory(rng, exchanged):
    """A non-zero gradient multiplied by 0 in place (``grad.mul_(0.0)``: a mask, a warm-up factor of
    0), then the step. In memory SparseAdam's sparse gradient still names the rows, at zero values,
    and moves them by their momentum. After ``exchange_gradients()`` the sharded step does the same;
    before it the placeholder changed, and the step is refused on every rank, no row changed."""
    table0, emb, opt, ref, ref_opt = _one_rank_adam(rng, 60, 4)
    for mask, optimizer, weight in _each_side_of_each_step(rng, emb, opt, ref, ref_opt):
        if optimizer is opt and exchanged:
            emb.exchange_gradients()
        if mask:
            if not exchanged and optimizer is opt:
                before = emb.table.to_numpy(copy=True)
                weight.grad.mul_(0.0)
                with pytest.raises(ss.StateError, match=r"emb\.exchange_gradients\(\) on every rank"):
                    optimizer.step()
                np.testing.assert_array_equal(emb.table.to_numpy(), before)
                return
            weight.grad.mul_(0.0)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref.detach().numpy(), table0)  # it trained


def test_zero_grad_then_a_negation_after_exchange_gradients_drops_the_step_as_in_memory(rng):
    """``exchange_gradients()``, ``zero_grad(set_to_none=False)``, then ``grad.neg_()`` (gradient ascent
    applied to every step, a skipped one too) and the step. In memory the zeroed sparse gradient names
    no row, negated or not, and SparseAdam moves none. The sharded step took the negation's ``-0.0``
    for a gradient the exchange had left at zero: Adam moved the skipped rows by their momentum."""
    table0, emb, opt, ref, ref_opt = _one_rank_adam(rng, 60, 4)
    for skip, optimizer, weight in _each_side_of_each_step(rng, emb, opt, ref, ref_opt):
        if optimizer is opt:
            emb.exchange_gradients()
        if skip:
            optimizer.zero_grad(set_to_none=False)
        weight.grad.neg_()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref.detach().numpy(), table0)  # it trained


def test_a_loss_weighted_by_zero_trains_as_in_memory_after_exchange_gradients(rng):
    """A loss weighted by 0 leaves the exchanged gradient at zero, as ``zero_grad(set_to_none=False)``
    would; in memory SparseAdam's sparse gradient still names the rows, at zero values, and moves
    them by their momentum. The sharded step must not take it for a ``zero_grad()``: a mark tells."""
    rows, dim, steps = 60, 4, 20
    table0, emb, opt, ref, ref_opt = _one_rank_adam(rng, rows, dim)
    p = 1.0 / np.arange(1, rows + 1)
    weights = np.where(rng.random(steps) < 0.3, 0.0, 1.0)
    weights[:2], weights[rng.integers(2, steps)] = 1.0, 0.0  # momentum first, then one zero weight at least
    for weight in weights:
        ids = torch.from_numpy(rng.choice(rows, size=12, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((12, dim)).astype(np.float32))
        for lookup, optimizer in ((emb, opt), (lambda i: F.embedding(i, ref, sparse=True), ref_opt)):
            (((lookup(ids) - target) ** 2).sum() * weight).backward()
            if optimizer is opt:
                emb.exchange_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert int(opt.state[emb.weight]["step"]) == int(ref_opt.state[ref]["step"]) == steps


def _summing_gradients_fails():
    """A patch under which the owner's sum of the gradients that came to it runs out of memory."""
    from unittest import mock
    index_add_ = torch.Tensor.index_add_

    def fails_on_floats(tensor, *args, **kwargs):  # the owner summing gradients, not the ids' counts
        if tensor.is_floating_point():
            raise MemoryError("injected")
        return index_add_(tensor, *args, **kwargs)
    return mock.patch.object(torch.Tensor, "index_add_", fails_on_floats)


@pytest.mark.parametrize("where", ["index_add_", "NarrowedStep"])
def test_a_step_failing_after_its_exchange_then_discarded_trains_on_as_in_memory(rng, where):
    """A step that failed after reading its rows' optimizer state (narrowing the step's rows, out of
    memory, say) and was dropped with discard_step(): the optimizer kept the state read for it, and
    the next forward refused it as replaced by optimizer.load_state_dict() (StateError). The failed
    steps now train nothing, as steps skipped in memory; the others as in memory."""
    from unittest import mock
    _, emb, opt, ref, ref_opt = _one_rank_adam(rng, 40, 3)
    injected = (_summing_gradients_fails() if where == "index_add_"
                else mock.patch("speedswap.train.sharded.NarrowedStep", side_effect=MemoryError("injected")))
    p = 1.0 / np.arange(1, 41)
    failing = set(rng.choice(np.arange(2, 40), 8, replace=False).tolist())
    for step in range(40):
        ids = torch.from_numpy(rng.choice(40, size=12, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((12, 3)).astype(np.float32))
        ((emb(ids) - target) ** 2).sum().backward()
        if step in failing:
            with injected, pytest.raises(MemoryError, match="injected"):
                opt.step()
            emb.discard_step()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        ((F.embedding(ids, ref, sparse=True) - target) ** 2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, table in emb._state.tables.items():
        np.testing.assert_allclose(table.to_numpy(), ref_opt.state[ref][name].to_dense().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_exchange_failing_after_its_message_is_finished_by_calling_it_again(rng):
    """exchange_gradients() failing after its message (out of memory summing the gradients that came
    to this rank) left a half-summed gradient that grad_norm() and the step took for the exchanged
    one, and calling it again raised "twice in one step". Now grad_norm() refuses it, and the call
    made again finishes it: the norm and the steps are in-memory Adam's."""
    _, emb, opt, ref, ref_opt = _one_rank_adam(rng, 40, 3)
    p = 1.0 / np.arange(1, 41)
    for step in range(12):
        ids = torch.from_numpy(rng.choice(40, size=12, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((12, 3)).astype(np.float32))
        ((emb(ids) - target) ** 2).sum().backward()
        ((F.embedding(ids, ref, sparse=True) - target) ** 2).sum().backward()
        if step % 4 == 1:
            with _summing_gradients_fails(), pytest.raises(MemoryError, match="injected"):
                emb.exchange_gradients()
            with pytest.raises(ss.StateError, match="again on this rank alone to finish it"):
                emb.grad_norm()
        emb.exchange_gradients()
        torch.testing.assert_close(emb.grad_norm(), ref.grad.coalesce().values().norm(), rtol=1e-6, atol=0)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_forward_failing_after_its_messages_trains_nothing_unless_it_is_run_again(rng):
    """A training forward that failed making its output (out of memory, say), after its rows had
    entered the step: the step moved them at a zero gradient (Adam's momentum moves them), where
    in memory a failed lookup trains nothing. Now they are put back unless the forward is run again."""
    from unittest import mock
    _, emb, opt, ref, ref_opt = _one_rank_adam(rng, 40, 3)
    p = 1.0 / np.arange(1, 41)
    for step in range(30):
        ids = torch.from_numpy(rng.choice(40, size=12, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((12, 3)).astype(np.float32))
        if step % 5 == 3:  # not run again
            lost = torch.from_numpy(rng.choice(40, size=6, p=p / p.sum()))
            with mock.patch("torch.nn.functional.embedding", side_effect=MemoryError("injected")), \
                    pytest.raises(MemoryError, match="injected"):
                emb(lost)
        ((emb(ids) - target) ** 2).sum().backward()
        ((F.embedding(ids, ref, sparse=True) - target) ** 2).sum().backward()
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_bfloat16_step_needs_no_memory_once_it_writes_back(rng):
    """A bfloat16 table's step made its rows bfloat16 after writing their optimizer state back: out
    of memory there left the state stepped and the rows not, Adagrad's sums a step ahead of the
    rows. The rows' bfloat16 memory is made with the table now: a step makes none (here any new
    bfloat16 tensor runs out), and trains as OffloadedEmbedding does, bit for bit."""
    table0, embs, opts = _bfloat16_pair(rng)
    no_bfloat16 = sharded_worker.MemoryFails(lambda t: t.dtype == torch.bfloat16)
    for _ in range(20):
        ids = zipf_ids(rng, 40, 12, 0, False)
        target = torch.from_numpy(rng.standard_normal((12, 4), dtype=np.float32))
        for emb, opt in zip(embs, opts):
            ((emb(ids) - target) ** 2).sum().backward()
            with no_bfloat16 if emb is embs[0] else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
    sharded, plain = (emb.table.as_tensor().float() for emb in embs)
    assert not torch.equal(sharded, table0.float())  # it trained
    torch.testing.assert_close(sharded, plain, rtol=0, atol=0)
    torch.testing.assert_close(embs[0]._state.tables["sum"].as_tensor(), embs[1]._state.tables["sum"].as_tensor(),
                               rtol=0, atol=0)


def test_a_step_failing_before_its_write_back_is_retried_from_the_rows_as_they_were(rng):
    """Putting back the rows that only a forward no backward reached looked up (out of memory, say)
    raised after the optimizer had stepped the rows, which nothing read back: the retry stepped them
    again from their stepped values. A failure before the write-back now reads the rows back, as a
    step whose optimizer raised does; and the optimizer's step count, which it had counted (Adam's
    bias correction a step ahead from then on), is put back too: the retry trains as in memory."""
    from unittest import mock
    from speedswap.train.reached import KeptRows
    _, emb, opt, ref, ref_opt = _one_rank_adam(rng, 30, 3)
    p = 1.0 / np.arange(1, 26)
    failing = set(rng.choice(20, 6, replace=False).tolist())
    for step in range(20):
        ids = torch.from_numpy(rng.choice(25, size=10, p=p / p.sum()))
        target = torch.from_numpy(rng.standard_normal((10, 3)).astype(np.float32))
        emb(torch.from_numpy(rng.integers(25, 30, 3)))  # left out of the loss: its rows are put back
        ((emb(ids) - target) ** 2).sum().backward()
        if step in failing:
            with mock.patch.object(KeptRows, "put_back", side_effect=MemoryError("injected")), \
                    pytest.raises(MemoryError, match="injected"):
                opt.step()
        opt.step()
        opt.zero_grad()
        ((F.embedding(ids, ref, sparse=True) - target) ** 2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert int(opt.state[emb.weight]["step"]) == int(ref_opt.state[ref]["step"]) == 20
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_step_whose_optimizer_raised_is_retried_and_training_goes_on(rng):
    """The optimizer raised after the rows were narrowed: the retry trained, but left weight
    narrowed, and the next step failed on a gradient of the full size."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 12)
    armed = []

    def raise_once(*_):
        if armed:
            armed.pop()
            raise RuntimeError("not this time")
    opt.register_step_pre_hook(raise_once)  # after the embedding's own hook, which narrowed the rows
    for step in range(10):
        ids = torch.from_numpy(rng.integers(0, 30, 8))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            (lookup(ids) ** 3).sum().backward()
            if optim is opt and step % 3 == 0:
                armed.append(True)
                with pytest.raises(RuntimeError, match="not this time"):
                    optim.step()
            optim.step()
            optim.zero_grad()
    assert emb.weight.shape[0] == 12
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_forward_after_a_step_whose_optimizer_raised_after_writing_the_rows_is_no_write_of_the_users(
        rng, monkeypatch):
    """An optimizer that raised after it had stepped ``weight`` in place (inside its ``step()``: the
    rows are read back from the table, for a retry) moved the weight's version as a write of the
    user's does, and the next forward, which adds its rows to the failed step, must not be refused as
    a forward after a write in the middle of the step: it goes on, and the retried step trains both
    backwards' gradients, as in memory."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 16)
    module = sys.modules[torch.optim.SGD.__module__]  # torch.optim.sgd, which torch.optim's names shadow
    stepped, fail = module.sgd, []

    def steps_then_raises(*args, **kwargs):
        stepped(*args, **kwargs)
        if fail:
            fail.pop()
            raise RuntimeError("after stepping")
    monkeypatch.setattr(module, "sgd", steps_then_raises)  # what SGD.step calls to update the rows
    for _ in range(4):
        first, second = (torch.from_numpy(rng.integers(0, 30, 6)) for _ in range(2))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            (lookup(first) ** 3).sum().backward()
            if optim is opt:
                version = emb.weight._version
                fail.append(True)
                with pytest.raises(RuntimeError, match="after stepping"):
                    optim.step()
                assert emb.weight._version != version  # the optimizer wrote the rows, then raised
            (lookup(second) ** 3).sum().backward()
            optim.step()
            optim.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_after_a_step_whose_optimizer_raised_more_backwards_accumulate_and_close_works(rng):
    """Gradient accumulation goes on after the failed step (the retry exchanges again), and a
    close() right after a failed step releases the embedding."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 16)
    for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
        failing = optim.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
        (lookup(torch.tensor([1, 2, 3])) ** 3).sum().backward()
        with pytest.raises(RuntimeError, match="boom"):
            optim.step()
        failing.remove()
        (lookup(torch.tensor([3, 4])) ** 3).sum().backward()
        optim.step()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    failing = opt.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    opt.zero_grad()
    (emb(torch.tensor([5, 6])) ** 3).sum().backward()
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    emb.close()
    assert emb.table.closed


@pytest.mark.parametrize("how", ["step twice", "no zero_grad", "no zero_grad, no backward"])
def test_a_step_on_the_gradient_the_last_step_left_is_refused_before_any_row_changes(rng, how):
    """In memory step() twice on one backward applies the gradient again, and a step after
    forgetting zero_grad() applies it along with the next one; the sharded step set it to None
    and silently trained otherwise (0.74 apart). Refused, as OffloadedEmbedding refuses them;
    zero_grad() after each step, keeping tensors or not, trains as in memory."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 12)
    zero_grad = dict(set_to_none=bool(rng.integers(2)))
    for step in range(8):
        ids = torch.from_numpy(rng.integers(0, 30, 8))
        target = torch.from_numpy(rng.standard_normal((8, 3)).astype(np.float32))
        for lookup, optim in ((emb, opt), (lambda i: F.embedding(i, ref), ref_opt)):
            ((lookup(ids) - target) ** 2).sum().backward()
            optim.step()
            if optim is opt and step == 4:  # the mistake, refused; then the loop goes on right
                after = emb.table.to_numpy(copy=True)
                if how != "step twice":  # the next step's forward, the gradient not zeroed
                    out = emb(ids)
                    if how == "no zero_grad":
                        out.sum().backward()
                with pytest.raises(ss.StateError, match="zero_grad\\(\\) after each step"):
                    opt.step()
                np.testing.assert_array_equal(emb.table.to_numpy(), after)
                emb.discard_step()
            optim.zero_grad(**zero_grad)
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_compiled_model_trains_as_the_in_memory_one(rng):
    """``torch.compile`` runs the sharded forward (its exchange, its bookkeeping) eagerly, the rest compiled."""
    emb, opt, ref, ref_opt = _sgd_against_in_memory(rng, 24)
    lin = torch.nn.Linear(3, 1)
    ref_lin = torch.nn.Linear(3, 1)
    ref_lin.load_state_dict(lin.state_dict())
    opt.add_param_group({"params": lin.parameters()})
    ref_opt.add_param_group({"params": ref_lin.parameters()})
    compiled = torch.compile(torch.nn.Sequential(emb, lin), backend="aot_eager")
    for _ in range(20):
        ids = torch.from_numpy(rng.integers(0, 30, (6, 2)))
        for model, optim in ((compiled, opt), (lambda i: ref_lin(F.embedding(i, ref)), ref_opt)):
            model(ids).tanh().sum().backward()
            optim.step()
            optim.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lin.weight.detach().numpy(), ref_lin.weight.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_read_again_failing_in_a_later_shard_names_the_tables_already_loaded(rng, tmp_path, monkeypatch):
    """A shard too large to stage in RAM is read again at the commit; a failure there in a later
    file said 'nothing was loaded from it' while the tables before it held the checkpoint's rows."""
    import speedswap.train.sharded_checkpoint as sharded_checkpoint
    from speedswap.files import tables as tables_module
    emb, opt, saved = _adam_step_saved(rng, tmp_path / "ckpt")
    last = list(saved)[-1]
    monkeypatch.setattr(sharded_checkpoint, "available_ram", lambda: 0)  # nothing staged: read again
    read, reads = tables_module._file_chunks, []

    def altered_on_the_second_read(file, *args):
        reads.append(os.fspath(file))
        for start, stop, rows in read(file, *args):
            if os.fspath(file).endswith(f"{last}.rank0.npy") and reads.count(os.fspath(file)) == 2:
                rows = rows + np.float32(1.0)
            yield start, stop, rows
    monkeypatch.setattr(tables_module, "_file_chunks", altered_on_the_second_read)
    emb.table.zero_()
    with pytest.raises(ss.FileFormatError) as info:
        emb.load(tmp_path / "ckpt")
    earlier = [name for name in saved if name != last]
    assert all(repr(name) in str(info.value) for name in earlier), str(info.value)
    assert "load an intact checkpoint before training on" in str(info.value)
    with pytest.raises(ss.StateError, match=r"stopped \(FileFormatError\).*load a checkpoint again"):
        emb.table.to_numpy()  # every table the load wrote refuses use until a load completes
    np.testing.assert_array_equal(emb.table._open_buffer().host, saved["table"])  # as the message says
    emb.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(emb.table.to_numpy(), saved["table"])


@pytest.mark.parametrize("when", ["between_a_forward_and_its_step", "after_a_step_skipped_before_its_backward"])
def test_a_table_write_the_step_would_undo_is_refused_and_nothing_changes(rng, when):
    """A write into this rank's shard while its rows are in a step: the step wrote the rows it had
    gathered back over the write (4.0 from in-memory SGD), as the next one did after a step
    skipped before its backward. It is refused; after the step (or discard_step()) it is kept."""
    table0 = rng.standard_normal((60, 4)).astype(np.float32)
    emb = ss.ShardedOffloadedEmbedding(60, 4, max_rows=40, storage="pageable", backend="numpy")
    emb.table.scatter(torch.arange(60), torch.from_numpy(table0))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    emb.attach(opt)
    ref = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SGD([ref], lr=0.1)
    ids = zipf_ids(rng, 60, (12,), pad=0, with_pad=False)
    target = torch.from_numpy(rng.standard_normal((12, 4)).astype(np.float32))
    rows = torch.unique(ids)
    new_rows = torch.from_numpy(rng.standard_normal((len(rows), 4)).astype(np.float32))
    if when == "between_a_forward_and_its_step":
        ((emb(ids) - target) ** 2).sum().backward()
    else:
        emb(ids)
        opt.zero_grad()  # the loss was not finite, say: no backward
    before = emb.table.to_numpy(copy=True)
    with pytest.raises(ss.StateError, match="undone by the step"):
        emb.table.scatter(rows, new_rows)
    np.testing.assert_array_equal(emb.table.to_numpy(), before)
    if when == "between_a_forward_and_its_step":
        opt.step()
        ((F.embedding(ids, ref) - target) ** 2).sum().backward()
        ref_opt.step()
    else:
        emb.discard_step()
    opt.zero_grad()
    emb.table.scatter(rows, new_rows)
    with torch.no_grad():
        ref[rows] = new_rows
    ((emb(ids) - target) ** 2).sum().backward()
    opt.step()
    ref_opt.zero_grad()
    ((F.embedding(ids, ref) - target) ** 2).sum().backward()
    ref_opt.step()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), **TOL)


def test_a_sharded_step_counts_the_rows_for_each_owner_without_a_host_wait_of_its_own(rng):
    """A training forward counted the new rows each rank owns with torch.bincount (on a GPU a host
    wait for its size) over owners() (a copy of the ranks' bounds to the GPU, another), then read
    the counts (a third): they now ride in the working set's one read, and the step's counts
    with its read of them."""
    emb = ss.ShardedOffloadedEmbedding(60, 3, max_rows=24, backend="numpy", storage="pageable")
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    for _ in range(3):
        with HostSyncs() as forward:
            rows = emb(torch.from_numpy(rng.integers(0, 60, (4, 5))))
        rows.pow(2).sum().backward()
        with HostSyncs() as step:
            opt.step()
        opt.zero_grad()
        # The looked-up ids' one read, and the owned rows' (this rank serves itself).
        assert forward.total == 2, dict(forward.where)
        assert step.total == 1, dict(step.where)


def test_a_sharded_step_after_an_unreached_forward_reads_its_slots_once_per_side(rng):
    """Rows only a forward no backward reached looked up are put back at the step: the sender finds
    its unreached slots, the owner the slots no reached row asked for, one read each. Flagging and
    marking them through tensor indices (reached[unreached] = 0, got[slots[mask]] = True: a number
    copied to the GPU, a mask's count) waited three times more."""
    emb = ss.ShardedOffloadedEmbedding(60, 3, max_rows=24, backend="numpy", storage="pageable")
    opt = torch.optim.Adam(emb.parameters(), lr=0.01)
    emb.attach(opt)
    table = emb.table.to_numpy(copy=True)
    for _ in range(3):
        emb(torch.tensor([57, 58, 59]))  # not in the loss
        emb(torch.from_numpy(rng.integers(0, 50, (4, 5)))).pow(2).sum().backward()
        with HostSyncs() as step:
            opt.step()
        opt.zero_grad()
        assert step.total == 3, dict(step.where)  # the counts' read and the two slot reads
    np.testing.assert_array_equal(emb.table.to_numpy()[57:], table[57:])  # put back each time


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap", "vmap_without_grad", "per_sample_grads"])
def test_one_rank_torch_func_transform_of_the_forward_is_refused_and_changes_nothing(rng, transform):
    """As test_torch_features' test for OffloadedEmbedding: a ``torch.func`` transform of the
    forward failed deep inside with a ``RuntimeError``; it is refused with ``OptionError``, mid-step,
    and the rows looked up outside it train as in memory (SparseAdam)."""
    rows, dim, steps = 60, 4, 12
    _, emb, opt, ref, ref_opt = _one_rank_adam(rng, rows, dim)
    for step in range(steps):
        ids = torch.from_numpy(rng.integers(0, rows, size=(3, 4)))
        target = torch.from_numpy(rng.standard_normal((3, 4, dim)).astype(np.float32))
        for lookup, optimizer in ((emb, opt), (lambda i: F.embedding(i, ref, sparse=True), ref_opt)):
            looked_up = lookup(ids)  # a step in flight
            if step == steps // 2 and optimizer is opt:
                with pytest.raises(ss.OptionError, match="rows.backward"):
                    TORCH_FUNC_CALLS[transform](emb, ids)
            ((looked_up - target) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    np.testing.assert_allclose(emb.table.to_numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
