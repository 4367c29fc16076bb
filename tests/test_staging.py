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
