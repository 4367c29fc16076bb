"""The page-locked staging ring that carries rows of pageable and memory-mapped tables to the GPU."""

import threading

import numpy as np
import pytest
import torch

import speedswap as ss


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["pageable", "mmap"])
def test_gathers_from_several_threads_each_get_their_own_rows(kind, tmp_path, rng):
    """Every staged table of a backend shares one ring: threads must not fill each other's slots."""
    tables = [ss.HostTable.from_numpy(rng.standard_normal((5_000, 64)).astype(np.float32),
                                      storage=kind, backend="cuda",
                                      path=tmp_path / f"t{k}.npy" if kind == "mmap" else None)
              for k in range(2)]
    results, failures = {}, []
    start = threading.Barrier(4)

    def gather(thread):
        try:
            table = tables[thread % 2]
            ids = np.random.default_rng(thread).integers(0, 5_000, size=(60, 3_000))
            start.wait()
            results[thread] = [(table, batch, table.gather(batch)) for batch in ids]
            torch.cuda.synchronize()
        except BaseException as exc:  # re-raised on the test's thread below
            failures.append(exc)

    threads = [threading.Thread(target=gather, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for gathered in results.values():
        for table, batch, rows in gathered:
            np.testing.assert_array_equal(rows.cpu().numpy(), table.to_numpy()[batch])


@pytest.mark.gpu
def test_a_gather_larger_than_a_slot_goes_through_the_ring_in_pieces(monkeypatch, rng):
    """A slot keeps its page-locked memory for the ring's life: one sized by the largest gather (an
    eval read of a whole pageable table) held that much pinned host memory for good. Pieces of at
    most PIECE_BYTES (64 KiB here) bring every row, in order, and no slot grows past a piece."""
    from speedswap.backends import staging

    monkeypatch.setattr(staging, "PIECE_BYTES", 64 << 10)
    table = ss.HostTable.from_numpy(rng.standard_normal((20_000, 48)).astype(np.float32), storage="pageable",
                                    backend="cuda")
    ids = rng.integers(0, 20_000, size=7_001)  # 1,344,192 bytes: 21 pieces of 341 rows and a last one
    ring = table.backend._staging
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), table.to_numpy()[ids])
    assert max(buffer.numel() for buffer in ring._buffers) <= 64 << 10
