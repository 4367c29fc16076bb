"""Views of a table stay current when host writes land late, as a GPU's writes into pinned memory do.

On the cuda backend a step's write-back into a zero-copy table is a kernel
that may still run when the step returns, and reads and writes through a
numpy view of the table wait for no kernel. The numpy backend here lands
every host write as late as a GPU may (:func:`late_writes.land_host_writes_late`),
so a view read right after a step, or a write through it that the step's
write-back would land over, shows on the CPU what a GPU would do. The tables
are compared with a plain ``nn.Embedding`` trained by the same SGD in memory.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import speedswap as ss
from cuda_helpers import kernels_or_skip
from late_writes import land_host_writes_late

ROWS, DIM, CAPACITY, STEPS = 30, 4, 8, 6


class _Embedding:
    """An OffloadedEmbedding trained by SGD; ``view()`` hands out its table's memory."""

    def __init__(self, table0, cache_rows):
        self.emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pinned", backend="numpy",
                                         cache_rows=cache_rows)
        self.emb.table.scatter(np.arange(ROWS), table0)
        self.opt = torch.optim.SGD(self.emb.parameters(), lr=0.1)
        self.emb.attach(self.opt)

    def view(self):
        return self.emb.table.to_numpy()

    def step(self, ids, loss):
        loss(self.emb(ids)).backward()
        self.opt.step()
        self.opt.zero_grad()

    def table(self):
        return self.emb.table


class _Switchers:
    """A ModelFactory over an ``nn.Embedding`` of ``CAPACITY`` slots, trained by SGD."""

    def __init__(self, table0, cache_rows):
        self.model = torch.nn.Embedding(CAPACITY, DIM)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.u = ss.ModelFactory(self.model, ROWS, DIM, CPUPinn=True, backend="numpy", cache_rows=cache_rows)
        self.u.customInit(lambda t: t.copy_(torch.from_numpy(table0)))

    def view(self):
        return self.u.to_numpy()

    def step(self, ids, loss):
        local = self.u.before_forward(ids)
        loss(self.model(local)).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.u.after_step(ids)

    def table(self):
        return self.u.table


@pytest.mark.filterwarnings("ignore:a view of the table")
@pytest.mark.parametrize("cache_rows", [0, 10])
@pytest.mark.parametrize("flow", [_Embedding, _Switchers], ids=["embedding", "switchers"])
def test_a_kept_view_shows_each_step_and_keeps_each_write_when_host_writes_land_late(
        flow, cache_rows, rng, monkeypatch):
    """Once a step returns, a view kept since before it shows its rows; a row written through the view
    then (one the step wrote back) trains on, and so does one written with ``table.scatter``."""
    land_host_writes_late(monkeypatch)
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    trained = flow(table0, cache_rows)
    reference = torch.nn.Parameter(torch.from_numpy(table0.copy()))
    ref_opt = torch.optim.SGD([reference], lr=0.1)
    context = torch.from_numpy(rng.standard_normal(DIM, dtype=np.float32))

    def loss(rows):
        return (torch.tanh(rows) @ context).sum()

    trained.step(torch.arange(3), loss)  # the cache holds rows when the view is handed out
    loss(F.embedding(torch.arange(3), reference)).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    view = trained.view()
    for step in range(STEPS):
        ids = torch.from_numpy(rng.choice(ROWS, size=5))
        trained.step(ids, loss)
        loss(F.embedding(ids, reference)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        np.testing.assert_allclose(view, reference.detach().numpy(), rtol=1e-6, atol=1e-6,
                                   err_msg=f"the view right after step {step}")
        row, value = int(ids[0]), rng.standard_normal(DIM, dtype=np.float32)
        view[row] = value
        other, scattered = int(rng.integers(ROWS)), rng.standard_normal(DIM, dtype=np.float32)
        trained.table().scatter([other], scattered.reshape(1, DIM))
        with torch.no_grad():
            reference[row] = torch.from_numpy(value)
            reference[other] = torch.from_numpy(scattered)
        np.testing.assert_allclose(view, reference.detach().numpy(), rtol=1e-6, atol=1e-6,
                                   err_msg=f"the view after writes following step {step}")
    del view
    np.testing.assert_allclose(trained.table().to_numpy(copy=True), reference.detach().numpy(),
                               rtol=1e-6, atol=1e-6, err_msg="the table at the end")



def _plain_table(rows):
    table = ss.HostTable.from_numpy(rows, storage="pinned", backend="numpy")
    return table, table.to_numpy, table.scatter, table.close


def _gadget(rows):
    gadget = ss.DataGadget(rows, storage="pinned", backend="numpy")
    return gadget, gadget.to_numpy, lambda ids, values: gadget.put(values, ids), gadget.close


@pytest.mark.parametrize("make", [_plain_table, _gadget], ids=["table", "gadget"])
def test_a_view_of_a_table_no_owner_watches_shows_each_write_and_keeps_its_own(make, rng, monkeypatch):
    """A table no embedding owns (a HostTable of one's own, a DataGadget's) followed no view: on a GPU
    a write (scatter, put) into its pinned memory was still queued when it returned, so the view read
    right after showed the rows as before, and a write through the view then was overwritten when
    the kernel ran. Now its writes land before they return while a view is alive, as an owned one's."""
    land_host_writes_late(monkeypatch)
    expected = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    _, view_of, write, close = make(expected.copy())
    view = view_of()
    for _ in range(3):
        ids = rng.choice(ROWS, size=4, replace=False)
        expected[ids] = rng.standard_normal((4, DIM), dtype=np.float32)
        write(ids, expected[ids])
        np.testing.assert_array_equal(view, expected, err_msg="the view right after the write")
        row = int(ids[0])
        expected[row] = view[row] = rng.standard_normal(DIM, dtype=np.float32)  # over the row just written
    del view
    np.testing.assert_array_equal(view_of(), expected, err_msg="the rows at the end")
    close()


# ------------------------------------------------------------------ on a GPU

def _busy_stream_and_view(rng):
    """A pinned OffloadedEmbedding's table on cuda, a view of it, its rows, and the current stream kept
    busy: kernels queued now run only after a large matmul, long after the host has gone on."""
    kernels_or_skip()  # the zero-copy kernels read and write host memory when they run
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    emb = ss.OffloadedEmbedding(ROWS, DIM, max_rows=CAPACITY, storage="pinned", backend="cuda")
    emb.table.scatter(np.arange(ROWS), table0)
    view = emb.table.to_numpy()
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 8192
    return emb, view, table0


@pytest.mark.gpu
def test_a_read_of_a_viewed_table_on_a_gpu_is_done_when_it_returns(rng):
    """A gather queued behind other work read the host rows when its kernel ran: a write through the
    view right after the call (between a forward and its step, say) reached the rows it returned."""
    emb, view, table0 = _busy_stream_and_view(rng)
    ids = torch.arange(5, device="cuda")
    out = torch.empty(5, DIM, device="cuda")
    emb.table.gather_validated(ids, out)
    view[:5] = rng.standard_normal((5, DIM), dtype=np.float32)  # after the read, in the caller's order
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), table0[:5])
    emb.close()


@pytest.mark.gpu
def test_a_write_into_a_viewed_table_on_a_gpu_has_landed_when_it_returns(rng):
    """A scatter queued behind other work wrote the host rows when its kernel ran: the view read right
    after the call showed the rows as before, and a write through it then was overwritten."""
    emb, view, table0 = _busy_stream_and_view(rng)
    new = rng.standard_normal((5, DIM), dtype=np.float32)
    emb.table.scatter_validated(torch.arange(5, device="cuda"), torch.from_numpy(new).cuda())
    np.testing.assert_array_equal(view[:5], new)  # read at once, without a wait of the caller's
    later = rng.standard_normal(DIM, dtype=np.float32)
    view[2] = later
    torch.cuda.synchronize()
    np.testing.assert_array_equal(emb.table.to_numpy(copy=True)[2], later)
    emb.close()


@pytest.mark.gpu
def test_a_write_into_a_viewed_table_no_owner_watches_has_landed_on_a_gpu_when_it_returns(rng):
    """As above, for a pinned HostTable of one's own: its scatter's kernel, queued behind other work,
    left the view showing the rows as before, and overwrote a write made through the view meanwhile.
    ``scatter_validated``, as above: ``scatter``'s id check reads the ids' bounds (a host wait for
    the matmuls queued before them), so its kernel was queued on an idle stream and the view was
    likely read after it ran, with or without the wait under test."""
    kernels_or_skip()
    table0 = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    table = ss.HostTable.from_numpy(table0, storage="pinned", backend="cuda")
    view = table.to_numpy()
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 8192
    new = rng.standard_normal((5, DIM), dtype=np.float32)
    table.scatter_validated(torch.arange(5, device="cuda"), torch.from_numpy(new).cuda())
    np.testing.assert_array_equal(view[:5], new)  # read at once, without a wait of the caller's
    later = rng.standard_normal(DIM, dtype=np.float32)
    view[2] = later
    torch.cuda.synchronize()
    np.testing.assert_array_equal(table.to_numpy(copy=True)[2], later)
    table.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_cpu_feeder_loop_shows_the_writes_queued_into_its_pinned_gadget_before_it(rng, monkeypatch, prefetch):
    """A CPU feeder over a pinned DataGadget gathers its rows on the CPU, through the tensor it took
    when it was built, which follows no write. On a GPU a ``put`` of rows on the device is a kernel
    that may still be queued when the loop starts: the loop's batches showed the rows as before it.
    Each loop now starts after the writes queued before it, as a GPU feeder's copies do."""
    land_host_writes_late(monkeypatch)
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    gadget = ss.DataGadget(rows.copy(), storage="pinned", backend="numpy")
    feeder = ss.BatchFeeder(np.arange(ROWS), gadget, batch_size=7, order="random", seed=int(rng.integers(1000)),
                            device="cpu", prefetch=prefetch)
    for _ in range(2):
        ids = rng.choice(ROWS, size=5, replace=False)
        rows[ids] = rng.standard_normal((5, DIM), dtype=np.float32)
        gadget.put(torch.from_numpy(rows[ids]), ids)
        for index, batch in feeder:
            np.testing.assert_array_equal(batch.numpy(), rows[index.numpy()])
    gadget.close()


@pytest.mark.gpu
def test_a_cpu_feeder_loop_reads_a_gpu_write_into_its_pinned_gadget_queued_behind_other_work(rng):
    """The GPU case of the test above: a write into the pinned gadget queued behind a large matmul
    (``scatter_validated``: no id check, whose host wait would run the queue first), then a loop of
    a CPU feeder over it, which read the rows before the kernel wrote them."""
    kernels_or_skip()  # the zero-copy kernels write host memory when they run
    rows = rng.standard_normal((ROWS, DIM), dtype=np.float32)
    gadget = ss.DataGadget(rows.copy(), storage="pinned", backend="cuda")
    feeder = ss.BatchFeeder(np.arange(ROWS), gadget, batch_size=7, order="sequential", device="cpu")
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 8192
    ids = rng.choice(ROWS, size=5, replace=False)
    rows[ids] = rng.standard_normal((5, DIM), dtype=np.float32)
    gadget.table.scatter_validated(torch.from_numpy(ids).cuda(), torch.from_numpy(rows[ids]).cuda())
    for index, batch in feeder:
        np.testing.assert_array_equal(batch.numpy(), rows[index.numpy()])
    gadget.close()
