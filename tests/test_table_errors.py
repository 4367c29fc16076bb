"""Every bad input raises the right speedswap error and leaves the table bit-for-bit unchanged."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import speedswap as ss


@pytest.fixture
def table(backend, rng):
    values = rng.standard_normal((40, 6)).astype(np.float32) + 3.0
    return ss.HostTable.from_numpy(values, storage="pageable", backend=backend)


def unchanged(table, before):
    np.testing.assert_array_equal(table.to_numpy(), before)


BAD_IDS = [
    ([0, 40], ss.IdError, IndexError, "out of range.*40 rows"),
    ([3, -1], ss.IdError, IndexError, "negative"),
    (np.array([1.0, 2.0]), ss.DTypeError, TypeError, "must be integers.*float64"),
    (torch.tensor([1.0]), ss.DTypeError, TypeError, "must be integers.*torch.float32"),
    (torch.tensor([True, False]), ss.DTypeError, TypeError, "must be integers.*bool"),
    (np.array(["1"]), ss.DTypeError, TypeError, "must be integers"),
    (np.array([1, None], dtype=object), ss.DTypeError, TypeError, "must be integers"),
    (np.array([2**40], dtype=np.int64), ss.IdError, IndexError, "out of range"),
    (torch.zeros(3, dtype=torch.int64, device="meta"), ss.DeviceError, ValueError, "meta"),
]


@pytest.mark.parametrize("ids, error, builtin, message", BAD_IDS)
def test_bad_ids_in_gather(table, ids, error, builtin, message):
    with pytest.raises(error, match=message) as info:
        table.gather(ids)
    assert isinstance(info.value, builtin)


@pytest.mark.parametrize("ids, error, builtin, message", BAD_IDS)
def test_bad_ids_in_scatter_change_nothing(table, ids, error, builtin, message):
    before = table.to_numpy(copy=True)
    n = len(ids) if hasattr(ids, "__len__") else 1
    with pytest.raises(error, match=message) as info:
        table.scatter(ids, np.ones((n, 6), np.float32))
    assert isinstance(info.value, builtin)
    unchanged(table, before)


@pytest.mark.parametrize("values, error, builtin, message", [
    (np.ones((2, 6), np.float64), ss.DTypeError, TypeError, "float64.*float32"),
    (torch.ones(2, 6, dtype=torch.float16), ss.DTypeError, TypeError, "cast"),
    (np.ones((3, 6), np.float32), ss.ShapeError, ValueError, r"\(2, 6\)"),
    (np.ones((2, 5), np.float32), ss.ShapeError, ValueError, r"\(2, 6\)"),
    (np.ones(12, np.float32), ss.ShapeError, ValueError, r"\(2, 6\)"),
    (np.array([[object()] * 6] * 2), ss.DTypeError, TypeError, "object"),
    (torch.ones(2, 6, device="meta"), ss.DeviceError, ValueError, "meta"),
])
def test_bad_values_change_nothing(table, values, error, builtin, message):
    before = table.to_numpy(copy=True)
    with pytest.raises(error, match=message) as info:
        table.scatter([5, 9], values)
    assert isinstance(info.value, builtin)
    unchanged(table, before)


def test_duplicate_scatter_ids_change_nothing(table):
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.DuplicateIdError, match="repeat") as info:
        table.scatter([4, 7, 4], np.full((3, 6), 9.0, np.float32))
    assert isinstance(info.value, ValueError)
    unchanged(table, before)


@pytest.mark.parametrize("out, error, message", [
    (torch.empty(3, 6), ss.ShapeError, "shape"),
    (torch.empty(2, 6, dtype=torch.float64), ss.DTypeError, "dtype"),
    (torch.empty(6, 2).t(), ss.ShapeError, "contiguous"),
    (np.empty((2, 6), np.float32), ss.DTypeError, "torch.Tensor"),
    (torch.empty(2, 6, device="meta"), ss.DeviceError, "meta"),
])
def test_bad_out(table, out, error, message):
    if isinstance(out, torch.Tensor) and out.device.type != "meta":
        # On the gather's own device, so that only the flaw under test is wrong (to() keeps strides).
        out = out.to(table.device)
    with pytest.raises(error, match=message):
        table.gather([0, 1], out=out)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_rows=0, dim=4), "num_rows must be a positive int"),
    (dict(num_rows=10, dim=-1), "dim must be a positive int"),
    (dict(num_rows=2.5, dim=4), "num_rows"),
    (dict(num_rows=10, dim=4, storage="gpu"), "unknown storage 'gpu'"),
    (dict(num_rows=10, dim=4, storage="mmap"), "path="),
    (dict(num_rows=10, dim=4, storage="mmap", path="t.h5"), "needs a .npy path"),
])
def test_bad_construction(backend, kwargs, message):
    with pytest.raises(ss.OptionError, match=message):
        ss.HostTable.empty(backend=backend, **kwargs)


def test_unsupported_dtype(backend):
    with pytest.raises(ss.DTypeError, match="complex64"):
        ss.HostTable.empty(3, 3, dtype="complex64", backend=backend)
    with pytest.raises(ss.DTypeError, match="not a dtype"):
        ss.HostTable.empty(3, 3, dtype="floaty", backend=backend)


@pytest.mark.parametrize("name, numpy_reading, torch_reading", [("float", "float64", "float32"),
                                                                ("int", "int64", "int32")])
def test_a_dtype_name_numpy_and_torch_read_differently_is_refused(backend, name, numpy_reading,
                                                                  torch_reading):
    with pytest.raises(ss.DTypeError, match=f"{numpy_reading} in numpy but {torch_reading} in torch"):
        ss.HostTable.empty(3, 3, dtype=name, backend=backend)
    # torch's own spellings are not ambiguous, nor are explicit widths.
    assert ss.HostTable.empty(3, 3, dtype=f"torch.{name}", backend=backend).dtype == getattr(torch, name)
    assert ss.HostTable.empty(3, 3, dtype=numpy_reading, backend=backend).dtype == getattr(torch, numpy_reading)
    with pytest.raises(ss.DTypeError, match="not a torch dtype"):
        ss.HostTable.empty(3, 3, dtype="torch.floaty", backend=backend)


def test_dtype_none_is_refused_by_tables_and_torchs_default_for_embeddings(backend):
    """np.dtype(None) is float64, so dtype=None (a factory_kwargs default passed on) made a float64
    table or embedding, twice the memory, silently. An embedding reads it as nn.Embedding does."""
    with pytest.raises(ss.DTypeError, match=r"float64 in numpy but torch's default dtype \(torch.float32\)"):
        ss.HostTable.empty(3, 3, dtype=None, backend=backend)
    default = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
            for make in (ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding):  # one rank: no group
                emb = make(3, 3, max_rows=2, dtype=None, storage="pageable", backend=backend)
                assert emb.table.dtype == emb.weight.dtype == torch.nn.Embedding(3, 3, dtype=None).weight.dtype
                assert emb.table.dtype == dtype
                emb.close()
    finally:
        torch.set_default_dtype(default)


def test_an_embedding_without_dtype_takes_torchs_default_as_nn_embedding_does(backend):
    """The default was float32 whatever torch's default dtype: under torch.set_default_dtype(float64)
    nn.Embedding(n, d) is float64 but OffloadedEmbedding(n, d) was float32, so a drop-in
    replacement fed float32 rows to a float64 model."""
    default = torch.get_default_dtype()
    try:
        for dtype in (torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            for make in (ss.OffloadedEmbedding, ss.ShardedOffloadedEmbedding):  # one rank: no group
                emb = make(3, 3, max_rows=2, storage="pageable", backend=backend)
                assert emb.table.dtype == emb.weight.dtype == torch.nn.Embedding(3, 3).weight.dtype == dtype
                emb.close()
    finally:
        torch.set_default_dtype(default)


def test_from_numpy_needs_2d(backend):
    with pytest.raises(ss.ShapeError, match="reshape"):
        ss.HostTable.from_numpy(np.ones(5, np.float32), backend=backend)


WRITE_THROUGH_READ_ONLY_MAP = """
import sys
import numpy as np
import speedswap as ss

path, backend, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
table = ss.HostTable.adopt(np.load(path, mmap_mode="r")[first:], backend=backend)
assert not table.writable
rows = table.as_tensor()
np.testing.assert_array_equal(rows.numpy(), np.load(path)[first:])  # the same bytes, read in place
rows[1] = 7.0
rows[2:4].mul_(-1.0)
rows.numpy()[4] = 9.0
# A private copy of the pages: the table keeps the file's rows, and refuses writes itself.
np.testing.assert_array_equal(table.gather([1, 2, 4]).cpu().numpy(), np.load(path)[first:][[1, 2, 4]])
try:
    table.scatter([1], np.ones((1, table.dim), np.float32))
except ss.StateError as exc:
    assert "read-only" in str(exc), exc
else:
    raise AssertionError("scatter into a read-only table was not refused")
print("written", float(rows[1, 0]), flush=True)
"""


@pytest.mark.parametrize("first", [0, 1, 1100], ids=["whole", "past-one-row", "past-a-page"])
def test_writing_through_the_tensor_of_a_read_only_map_never_crashes_nor_reaches_the_file(
        backend, rng, tmp_path, first):
    # Over the read-only map itself the write was a segmentation fault (the process died).
    values = rng.standard_normal((1200, 6)).astype(np.float32) + 3.0
    np.save(tmp_path / "t.npy", values)
    done = subprocess.run([sys.executable, "-c", WRITE_THROUGH_READ_ONLY_MAP, str(tmp_path / "t.npy"),
                           backend, str(first)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"rc={done.returncode}: {done.stderr[-2000:]}"
    assert "written 7.0" in done.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), values)



@pytest.mark.parametrize("storage", ["pinned", "pageable"])
def test_a_path_for_a_table_kept_in_memory_is_refused_not_ignored(storage, tmp_path):
    """path= with storage other than mmap wrote no file and kept nothing there, silently."""
    with pytest.raises(ss.OptionError, match=f"storage='{storage}' keeps it in memory"):
        ss.HostTable.empty(10, 4, storage=storage, backend="numpy", path=tmp_path / "t.npy")
    with pytest.raises(ss.OptionError, match=f"storage='{storage}' keeps the tables in memory"):
        ss.OffloadedEmbedding(10, 4, max_rows=4, storage=storage, backend="numpy", path=tmp_path / "emb")
    with pytest.raises(ss.OptionError, match=f"storage='{storage}' keeps the tables in memory"):
        ss.ShardedOffloadedEmbedding(10, 4, max_rows=4, storage=storage, backend="numpy", path=tmp_path / "s")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("for_reading", ["False", "no", 0])
def test_as_tensor_refuses_a_for_reading_that_is_not_a_bool(rng, tmp_path, for_reading):
    """as_tensor branched on `for_reading`'s truth: over a file mapped read-only,
    for_reading="False" handed out a tensor over the read-only map itself, whose first write kills
    the process (a segmentation fault), instead of the copy-on-write map for_reading=False gives."""
    values = rng.standard_normal((6, 3)).astype(np.float32)
    np.save(tmp_path / "t.npy", values)
    table = ss.HostTable.adopt(np.load(tmp_path / "t.npy", mmap_mode="r"), backend="numpy")
    with pytest.raises(ss.OptionError, match=f"for_reading must be True .* or False, got {for_reading!r}"):
        table.as_tensor(for_reading=for_reading)
    rows = table.as_tensor(for_reading=False)
    rows[2] = float(values[2, 0]) + 1.0  # a private copy of the page
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), values)
    np.testing.assert_array_equal(table.to_numpy(copy=True), values)


@pytest.mark.parametrize("copy", ["False", "no", 0])
def test_to_numpy_refuses_a_copy_that_is_not_a_bool(table, copy):
    """to_numpy branched on `copy`'s truth: copy="False" (or "no") handed out an independent copy, so
    rows written into it, meant for the table, were lost without an error; 0 and 1 may be counts."""
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match=f"copy must be True .* or False, got {copy!r}"):
        table.to_numpy(copy=copy)
    unchanged(table, before)
    view = table.to_numpy(copy=False)
    if view is not None and np.shares_memory(view, table.to_numpy(copy=False)):  # a host table: writes go through
        view[3] = before[3] + 1.0
        np.testing.assert_array_equal(table.gather([3]).cpu().numpy()[0], before[3] + 1.0)
