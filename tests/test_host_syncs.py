"""How often a training step makes a GPU's host wait, with and without the device cache.

The device cache issue asks for eviction and insertion "with no host
synchronisation beyond what the step already needs". A step already needs
one per forward: the working set reads how many of its rows are new, with the
ids' bounds (their range check); it sorts the ids rather than calling
``torch.unique``, whose count would be a wait of its own. The cache adds
none to a forward (how many of its rows are cached is read in that same
transfer), one per ``optimizer.step()`` (how many misses are admitted, and
how many of their victims are dirty) and one in a prefetch (how many rows to
bring, with the ids' bounds), where a prefetch without a cache checks the
ids' range alone. A forward outside training makes one too: its ids' range
check, which reads with it how many rows the host sends while some rows are
cached.

On the CPU :class:`host_syncs.HostSyncs` counts the calls that would
synchronise on CUDA; on a GPU torch's sync debug mode counts the real ones,
and the two must agree.
"""

import collections
import inspect
import os
import warnings

import numpy as np
import pytest
import torch

import speedswap as ss
from cuda_helpers import kernels_or_skip
from host_syncs import HostSyncs
from speedswap.convert import read_bounds, check_id_range
from speedswap.train import sync_free
from speedswap.train.sync_free import positions
from training_helpers import CAPACITY, DIM, NUM_ROWS, skipgram_loss, zipf_batches

STEPS = 40

#: The most host synchronisations each call may make: (no cache, with a cache).
BUDGET = {"forward": (1, 1), "second forward": (1, 1), "prefetch": (1, 1), "step": (0, 1)}


#: How torch's warning of each host synchronisation in sync debug mode "warn" begins (c10/cuda's
#: warn_or_error_on_sync; "(Triggered internally at ...)" follows).
TORCH_SYNC_WARNING = "called a synchronizing CUDA operation"


class _TorchSyncWarnings:
    """Counts torch's own warnings of CUDA host synchronisations (``set_sync_debug_mode``)."""

    def __init__(self):
        self.total = 0
        self.where = []  # "file:line" of the Python line each synchronising call came from

    def __enter__(self):
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        # torch's text for a wait; not its one-off notice that the debug mode is a prototype, which
        # speaks of "synchronizing operations" too and came first in whichever test turned the mode on.
        synced = [record for record in self._records if str(record.message).startswith(TORCH_SYNC_WARNING)]
        self.total += len(synced)
        self.where += [f"{os.path.basename(record.filename)}:{record.lineno}" for record in synced]
        self._caught.__exit__(*exc)


def _phase_counts(backend, cache_rows, counter_type, seed, padding_idx=None, clipped=False):
    """Train STEPS Zipf steps with prefetch, counting each call's host synchronisations.

    ``clipped``: the gradient is clipped (written in place) between the backward and the step.

    Returns:
        ({phase: [count per call]}, [(phase, where) per call], the cache's total stats).
    """
    device = ss.get_backend(backend).device
    batches = zipf_batches(np.random.default_rng(seed), STEPS + 1, device)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pinned",
                                backend=backend, cache_rows=cache_rows, padding_idx=padding_idx)
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    emb.attach(opt)
    counts, where = {phase: [] for phase in BUDGET}, []

    def counted(phase, call):
        with counter_type() as counter:
            result = call()
        counts[phase].append(counter.total)
        where.append((phase, counter.where))
        return result

    for step in range(STEPS):
        pos, neg, ctx = batches[step]
        pos_rows = counted("forward", lambda: emb(pos))
        neg_rows = counted("second forward", lambda: emb(neg))  # adds its rows to the step's
        loss = skipgram_loss(pos_rows, neg_rows, ctx)
        following = torch.cat([batches[step + 1][0], batches[step + 1][1].reshape(-1)])
        counted("prefetch", lambda: emb.prefetch(following))
        loss.backward()
        if clipped:
            torch.nn.utils.clip_grad_norm_(emb.parameters(), 1.0)
        counted("step", opt.step)
        opt.zero_grad()
    emb.close()
    return counts, where, emb.stats()["total"]


@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])  # a step that asks if zero_grad() ran
@pytest.mark.parametrize("padding_idx", [None, 0])  # the padding row joins every step without a read
@pytest.mark.parametrize("cache_rows", [0, NUM_ROWS // 5])
def test_a_step_synchronises_the_host_no_more_than_its_budget(cache_rows, padding_idx, seed, clipped):
    counts, where, total = _phase_counts("numpy", cache_rows, HostSyncs, seed, padding_idx, clipped)
    cached = bool(cache_rows)
    # The run went through every branch that could synchronise: hits and misses,
    # evictions of dirty rows, prefetched rows.
    if cached:
        assert total["hits"] and total["misses"] and total["evictions"] and total["prefetched_rows"]
    for phase, (plain, with_cache) in BUDGET.items():
        budget = with_cache if cached else plain
        worst = max(range(len(counts[phase])), key=counts[phase].__getitem__)
        # Reached, not only respected: the budget is what the call costs, not a loose bound.
        assert counts[phase][worst] == budget, (phase, [w for w in where if w[0] == phase][worst])
    assert min(counts["forward"]) == BUDGET["forward"][cached]  # every forward pays it


@pytest.mark.parametrize("cache_rows", [0, NUM_ROWS // 5, NUM_ROWS])
@pytest.mark.parametrize("device_branches", [False, True])
def test_an_eval_forward_of_device_ids_waits_on_the_host_once(cache_rows, device_branches, rng, monkeypatch):
    """An eval forward of ids already on the device waits once: their range check, which reads with
    it how many rows the host sends (and the hits) while some rows are cached, as a prefetch reads its
    counts with its ids' bounds. With some rows cached it waited twice (the ids' bounds alone, then the
    count). No count is read without a cache (every id's row crosses) or once the cache holds every row
    of the table (none does), where it is known without asking. The same for a forward far larger than
    a training batch, whose misses beyond the scratch rows go to a temporary. On the numpy backend the
    device is the CPU, so CPU ids are the device's; ``device_branches``: with sync_free's numpy
    shortcuts off, the branches a GPU runs."""
    if device_branches:
        monkeypatch.setattr(sync_free, "_numpy_shortcut", lambda tensor: False)
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=NUM_ROWS, storage="pinned", backend="numpy",
                                cache_rows=cache_rows)
    opt = torch.optim.SGD(emb.parameters(), lr=0.05)
    emb.attach(opt)
    extra, spilled = [], []
    for _ in range(30):  # 9,000 uniform ids: every row is used, and a whole-table cache fills
        emb(torch.from_numpy(rng.integers(0, NUM_ROWS, 300))).sum().backward()
        opt.step()
        opt.zero_grad()
        for size in (50, 20 * 300):
            ids = torch.from_numpy(rng.integers(0, NUM_ROWS, size))
            cache = emb._cache
            held = set(cache.slot_row.tolist()) - {-1}
            uncached = set(ids.tolist()) - held
            spilled.append(len(uncached) > len(cache.weights) - cache.num_slots)
            hits = emb.stats()["eval"]["hits"]
            with torch.no_grad(), HostSyncs() as forward:
                emb(ids)
            extra.append((forward.total, emb.stats()["eval"]["hits"] - hits, size, 0 < len(held) < NUM_ROWS,
                          dict(forward.where)))
    waits, hits, sizes, partly, where = zip(*extra)
    assert set(waits) == {1}, [w for w in where if sum(w.values()) != 1][:3]
    if cache_rows:
        assert any(spilled)  # the temporary was used
        assert any(partly)  # the count was read, with the bounds
    if cache_rows == NUM_ROWS:
        assert [wait_and_hits[1] for wait_and_hits in extra[-2:]] == [50, 6000]  # full by the end
    else:
        assert 0 < sum(hits) < sum(sizes) if cache_rows else sum(hits) == 0
    emb.close()


def test_the_model_counts_what_synchronises():
    """HostSyncs counts a value or size read back, and not work that stays on the device."""
    x = torch.arange(10)
    with HostSyncs() as syncs:
        # Calls from the test itself are not speedswap's: none is counted.
        x.sum().item()
    assert syncs.total == 0
    with HostSyncs() as syncs:
        check_id_range(x, 10)  # one transfer of both bounds
    assert syncs.total == 1 and list(syncs.where) == [f"convert.py:{_line_of_tolist()}"]
    # Calls that make a GPU's host wait without reading a value back, and their sync-free forms.
    t, index = torch.zeros(10), torch.tensor([1, 3])
    assert _counted(lambda: t.__setitem__(index, 1.0)) == 1  # t[index] = 1.0
    assert _counted(lambda: t.__setitem__((index,), True)) == 1
    assert _counted(lambda: torch.isin(index, x, assume_unique=True)) == 1
    assert _counted(lambda: t.index_fill_(0, index, 1.0)) == 0
    assert _counted(lambda: t.__setitem__(index, torch.ones(2))) == 0
    assert _counted(lambda: t.__setitem__(0, 1.0)) == 0  # no tensor index: a fill


class _EveryCaller(HostSyncs):
    """HostSyncs counting every caller's calls, the test's own too."""

    @staticmethod
    def _caller():
        return "any"


def _counted(call):
    with _EveryCaller() as syncs:
        call()
    return syncs.total


def _line_of_tolist():
    source, first = inspect.getsourcelines(read_bounds)
    return first + next(i for i, line in enumerate(source) if ".tolist()" in line)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_positions_are_the_true_entries_in_order(device, rng):
    for size, share in [(0, 0.5), (1, 1.0), (1000, 0.0), (1000, 0.3), (1000, 1.0), (70_000, 0.01)]:
        mask = torch.from_numpy(rng.random(size) < share).to(device)
        expected = mask.nonzero().squeeze(1)
        found = positions(mask, len(expected))
        assert found.dtype == torch.int64 and found.device == mask.device
        assert torch.equal(found, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("cache_rows", [0, NUM_ROWS // 5])
def test_the_cuda_step_synchronises_as_the_model_says(cache_rows, padding_idx, seed):
    kernels_or_skip()  # staged transports read ids on the host: more synchronisations
    modelled, _, _ = _phase_counts("numpy", cache_rows, HostSyncs, seed, padding_idx)
    on_gpu, where, _ = _phase_counts("cuda", cache_rows, _TorchSyncWarnings, seed, padding_idx)
    # On a mismatch, say which lines synchronised on the GPU, and how often, by phase.
    lines = collections.Counter(f"{phase}: {line}" for phase, found in where for line in found)
    assert on_gpu == modelled, f"the GPU synchronised at {dict(lines)}"


@pytest.mark.gpu
def test_host_ids_reach_the_gpu_checked_on_the_host_and_without_a_wait(rng):
    """CPU tensors, numpy arrays and lists: range-checked on the host, copied from page-locked memory."""
    from speedswap.convert import as_row_ids
    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    for make in (torch.from_numpy, np.asarray, list):
        ids = rng.integers(0, 1000, 5000)
        expected = ids.copy()
        source = make(ids) if make is not list else ids.tolist()
        busy @ busy  # queued work a pageable copy would wait for
        with _TorchSyncWarnings() as syncs:
            flat, shape = as_row_ids(source, 1000, device)
        ids[:] = -1  # the transfer holds the ids as they were at the call
        assert syncs.total == 0, make
        assert shape == (5000,) and flat.device.type == "cuda"
        np.testing.assert_array_equal(flat.cpu().numpy(), expected)
    with pytest.raises(ss.IdError):
        as_row_ids(np.array([0, 1000]), 1000, device)


def test_a_step_after_an_unreached_forward_waits_once(seed):
    """A forward no backward reaches (its output left out of the loss) has its rows put back at the
    step, which finds them in one read of the slots left untouched; marking the reached forwards'
    slots (``untouched[slots] = False``: a number through a tensor index) waited once per forward,
    and the first step's put-back of Adam's created state (``state[slots] = 0.0``) once per state."""
    batches = zipf_batches(np.random.default_rng(seed), 6, torch.device("cpu"))
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY + 3, storage="pinned", backend="numpy")
    opt = torch.optim.Adam(emb.parameters(), lr=0.05)
    emb.attach(opt)
    waits = []
    for pos, neg, ctx in batches:
        spare = sorted(set(range(NUM_ROWS)) - set(pos.tolist()) - set(neg.reshape(-1).tolist()))
        emb(torch.tensor(spare[:3]))  # rows only this forward looks up, left out of the loss
        skipgram_loss(emb(pos), emb(neg), ctx).backward()
        with HostSyncs() as syncs:
            opt.step()
        opt.zero_grad()
        waits.append(dict(syncs.where))
    assert all(sum(w.values()) == 1 for w in waits), waits


@pytest.mark.filterwarnings("ignore:a view of the table")  # a kept view turns the cache off: meant here
@pytest.mark.parametrize("cache_rows", [0, NUM_ROWS // 5])
def test_a_step_waits_for_the_tables_kernels_only_while_a_view_of_them_is_alive(cache_rows, seed):
    """A table waits for its kernels (``Backend.wait_host``: an event's synchronize on a GPU, which
    torch's sync debug mode does not report) after each gather and write-back while a view it handed
    out is alive, so that reads and writes through the view are ordered after them; with none, a
    step waits for nothing. The model counted no wait_host at all, so a wait added to a step without
    a view would have passed here unseen."""
    batches = zipf_batches(np.random.default_rng(seed), 4, torch.device("cpu"))
    emb = ss.OffloadedEmbedding(NUM_ROWS, DIM, max_rows=CAPACITY, storage="pinned", backend="numpy",
                                cache_rows=cache_rows)
    opt = torch.optim.SGD(emb.parameters(), lr=0.05)
    emb.attach(opt)
    counts = []
    for step, (pos, neg, ctx) in enumerate(batches):
        view = emb.table.to_numpy() if step % 2 else None  # every other step keeps a view
        with HostSyncs() as forwards:
            loss = skipgram_loss(emb(pos), emb(neg), ctx)
        loss.backward()
        with HostSyncs() as steps:
            opt.step()
        opt.zero_grad()
        waits = [sum(n for line, n in counter.where.items() if "wait_host" in line)
                 for counter in (forwards, steps)]
        counts.append((view is not None, waits, dict(forwards.where), dict(steps.where)))
        del view
    emb.close()
    for viewed, (forward_waits, step_waits), *where in counts:
        # Each forward's gather, and the step's write-back of the table the view shows (not of the state).
        assert (forward_waits, step_waits) == ((2, 1) if viewed else (0, 0)), (viewed, where)
