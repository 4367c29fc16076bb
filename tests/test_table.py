"""HostTable round trips over every backend and storage kind, against numpy references."""

import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import speedswap as ss

DTYPES = [np.float32, np.float16, np.float64]


def random_rows(rng, shape, dtype):
    """Fresh random data, never zeros: values in [1, 2) with random signs."""
    values = rng.uniform(1.0, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return values.astype(dtype)


@pytest.fixture(params=ss.STORAGE_KINDS)
def storage(request):
    return request.param


def make(array, storage, backend, tmp_path):
    path = tmp_path / "table.npy" if storage == "mmap" else None
    return ss.HostTable.from_numpy(array, storage=storage, backend=backend, path=path)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_with_duplicates_matches_numpy(backend, storage, dtype, rng, tmp_path):
    rows, dim = int(rng.integers(1, 3000)), int(rng.integers(1, 70))
    ref = random_rows(rng, (rows, dim), dtype)
    table = make(ref, storage, backend, tmp_path)
    ids = rng.integers(0, rows, size=int(rng.integers(1, 5000)))  # with replacement: duplicates
    got = table.gather(ids)
    assert got.device == table.device and got.dtype == table.dtype
    np.testing.assert_array_equal(got.cpu().numpy(), ref[ids])


def test_gather_keeps_the_ids_shape(backend, storage, rng, tmp_path):
    ref = random_rows(rng, (50, 8), np.float32)
    table = make(ref, storage, backend, tmp_path)
    ids = torch.from_numpy(rng.integers(0, 50, size=(6, 7)))
    got = table.gather(ids)
    assert tuple(got.shape) == (6, 7, 8)
    np.testing.assert_array_equal(got.cpu().numpy(), ref[ids.numpy()])


def test_gather_into_out(backend, storage, rng, tmp_path):
    ref = random_rows(rng, (100, 16), np.float32)
    table = make(ref, storage, backend, tmp_path)
    ids = rng.integers(0, 100, size=40)
    out = torch.empty((40, 16), dtype=torch.float32, device=table.device)
    assert table.gather(ids, out=out) is out
    np.testing.assert_array_equal(out.cpu().numpy(), ref[ids])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_then_gather_round_trip(backend, storage, dtype, rng, tmp_path):
    rows, dim = int(rng.integers(2, 2000)), int(rng.integers(1, 70))
    ref = random_rows(rng, (rows, dim), dtype)
    table = make(ref, storage, backend, tmp_path)
    ids = rng.choice(rows, size=int(rng.integers(1, rows)), replace=False)
    new = random_rows(rng, (len(ids), dim), dtype)
    table.scatter(ids, torch.from_numpy(new).to(table.device))
    ref[ids] = new
    np.testing.assert_array_equal(table.to_numpy(), ref)
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), new)


def test_scatter_accepts_numpy_values_and_nd_ids(backend, storage, rng, tmp_path):
    ref = random_rows(rng, (30, 5), np.float32)
    table = make(ref, storage, backend, tmp_path)
    ids = rng.choice(30, size=12, replace=False).reshape(3, 4)
    new = random_rows(rng, (3, 4, 5), np.float32)
    table.scatter(ids, new)
    ref[ids.reshape(-1)] = new.reshape(-1, 5)
    np.testing.assert_array_equal(table.to_numpy(), ref)


def test_empty_ids_are_a_no_op(backend, rng, tmp_path):
    ref = random_rows(rng, (10, 3), np.float32)
    table = make(ref, "pageable", backend, tmp_path)
    assert tuple(table.gather([]).shape) == (0, 3)
    table.scatter(np.array([], dtype=np.int64), np.empty((0, 3), np.float32))
    np.testing.assert_array_equal(table.to_numpy(), ref)


# too_slow named too: this list replaces the CI profile's, which suppresses it (a loaded runner is slow).
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rows=st.integers(1, 300), dim=st.integers(1, 40), n=st.integers(0, 600),
       dtype=st.sampled_from(DTYPES), data_seed=st.integers(0, 2**31 - 1),
       id_dtype=st.sampled_from([np.int64, np.int32, np.uint16, np.int16]))
def test_gather_scatter_property(backend, rows, dim, n, dtype, data_seed, id_dtype):
    rng = np.random.default_rng(data_seed)
    ref = random_rows(rng, (rows, dim), dtype)
    table = ss.HostTable.from_numpy(ref, storage="pageable", backend=backend)
    ids = rng.integers(0, min(rows, np.iinfo(id_dtype).max + 1), size=n).astype(id_dtype)
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), ref[ids])
    unique = np.unique(ids)
    new = random_rows(rng, (len(unique), dim), dtype)
    table.scatter(unique, new)
    ref[unique] = new
    np.testing.assert_array_equal(table.to_numpy(), ref)


def test_uniform_and_normal_fill_every_row(backend, storage, tmp_path, seed):
    path = tmp_path / "t.npy" if storage == "mmap" else None
    table = ss.HostTable.empty(20_000, 16, storage=storage, backend=backend, path=path)
    table.uniform_(-0.5, 0.25, generator=torch.Generator().manual_seed(seed))  # a CPU one for every kind
    values = table.to_numpy()
    assert values.min() >= -0.5 and values.max() < 0.25
    assert abs(values.mean() - (-0.125)) < 0.01
    assert (values != 0).mean() > 0.999  # every chunk was filled
    table.normal_(3.0, 2.0)
    values = table.to_numpy()
    assert abs(values.mean() - 3.0) < 0.05 and abs(values.std() - 2.0) < 0.05
    table.zero_()
    assert not table.to_numpy().any()


@pytest.mark.parametrize("fill", ["uniform_", "normal_"])
def test_a_seeded_cpu_generator_fills_every_storage_kind_alike(backend, storage, fill, tmp_path, seed):
    """On the GPU a device table draws on the CPU and copies: torch refuses a CPU generator for CUDA tensors."""
    path = tmp_path / "t.npy" if storage == "mmap" else None
    reference = ss.HostTable.empty(5000, 8, storage="pageable", backend="numpy")
    table = ss.HostTable.empty(5000, 8, storage=storage, backend=backend, path=path)
    getattr(reference, fill)(generator=torch.Generator().manual_seed(seed))
    getattr(table, fill)(generator=torch.Generator().manual_seed(seed))
    np.testing.assert_array_equal(table.to_numpy(), reference.to_numpy())


@pytest.mark.parametrize("storage", ["pageable", "mmap"])
@pytest.mark.parametrize("dim", [1, 3, 7, 16, 33])
def test_a_seeded_table_draws_what_one_call_on_the_whole_tensor_draws(storage, dim, monkeypatch, tmp_path, rng):
    """Tables are drawn chunk by chunk; nn.Embedding draws its weight in one normal_ call. The same
    seed must give the same rows and leave torch's generator in the same state: swapping an
    nn.Embedding for an OffloadedEmbedding changes no number."""
    monkeypatch.setattr(ss.files.base, "CHUNK_BYTES", 29 * dim * 4)  # 29 rows a chunk, as 64 MiB would
    rows = int(rng.integers(40, 400))                                  # a last chunk of any length
    seed = int(rng.integers(2**62))
    path = tmp_path / "t" if storage == "mmap" else None
    torch.manual_seed(seed)
    emb = ss.OffloadedEmbedding(rows, dim, max_rows=8, storage=storage, backend="numpy", path=path)
    after = torch.rand(4)
    torch.manual_seed(seed)
    reference = torch.nn.Embedding(rows, dim)
    np.testing.assert_array_equal(emb.table.to_numpy(), reference.weight.detach().numpy())
    assert torch.equal(after, torch.rand(4))
    generator = torch.Generator().manual_seed(seed)
    emb.table.uniform_(-0.5, 0.25, generator=generator)
    expected = torch.empty(rows, dim).uniform_(-0.5, 0.25, generator=generator.manual_seed(seed))
    np.testing.assert_array_equal(emb.table.to_numpy(), expected.numpy())
    emb.close()


def test_apply_sees_the_whole_table_shape(backend):
    table = ss.HostTable.empty(4000, 64, storage="pageable", backend=backend)
    table.apply_(torch.nn.init.xavier_uniform_)
    bound = np.sqrt(6.0 / (4000 + 64))  # fan_in + fan_out of the *whole* table
    values = table.to_numpy()
    # Drawn in float32, so a draw may round up past the float64 bound by an ulp; a fan seen
    # per chunk (1,000 rows, say: sqrt(6 / 1,064)) would give twice the bound.
    assert np.abs(values).max() <= bound * (1 + 1e-6)
    assert np.abs(values).max() > 0.95 * bound


def test_fills_that_would_do_nothing_or_fail_inside_torch_say_what_to_do(backend, rng):
    table = ss.HostTable.from_numpy(rng.standard_normal((6, 3)).astype(np.float32), backend=backend)
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="returned a new one"):
        table.apply_(lambda t: torch.ones_like(t))  # not in place: its ones would be dropped
    np.testing.assert_array_equal(table.to_numpy(), before)
    table.apply_(lambda t: t.mul_(2))  # in place, returning the tensor itself
    np.testing.assert_array_equal(table.to_numpy(), 2 * before)
    ids = ss.HostTable.empty(6, 3, dtype="int64", backend=backend)
    for fill in (ids.uniform_, ids.normal_):
        with pytest.raises(ss.DTypeError, match="holds torch.int64.*apply_\\(torch.Tensor.random_"):
            fill()
    ids.apply_(torch.Tensor.random_, 0, 5)
    assert set(np.unique(ids.to_numpy())) <= set(range(5))


def test_zeros_constructor(backend, storage, tmp_path):
    path = tmp_path / "z.npy" if storage == "mmap" else None
    table = ss.HostTable.zeros(33, 3, dtype="float16", storage=storage, backend=backend, path=path)
    assert table.to_numpy().dtype == np.float16 and not table.to_numpy().any()
    assert table.shape == (33, 3) and table.nbytes == 33 * 3 * 2


def test_to_numpy_of_a_device_table_is_a_read_only_copy_on_every_backend(backend, rng):
    """``storage="device"`` is the device's memory, which numpy cannot view: ``to_numpy()`` is a read-only
    copy, writes go through ``scatter`` or ``as_tensor()``. On the CPU backend it was a writable view, so
    code that wrote into it passed CI and raised "read-only" only on a GPU (stop 46, on an H200)."""
    ref = random_rows(rng, (10, 4), np.float32)
    table = ss.HostTable.from_numpy(ref, storage="device", backend=backend)
    array = table.to_numpy()
    np.testing.assert_array_equal(array, ref)
    assert not table.viewable  # to_numpy() is never the table's memory
    assert not np.shares_memory(array, table.to_numpy())  # a copy each time, not the table
    with pytest.raises(ValueError, match="read-only"):
        array[3] = 42.0
    copy = table.to_numpy(copy=True)  # a copy asked for is the caller's to write
    copy[3] = 42.0
    np.testing.assert_array_equal(table.to_numpy(), ref)
    new = random_rows(rng, (2, 4), np.float32)
    table.scatter([3, 7], new)
    table.as_tensor()[5] = torch.from_numpy(new[0]).to(table.device)
    expected = ref.copy()
    expected[[3, 7]], expected[5] = new, new[0]
    np.testing.assert_array_equal(table.to_numpy(), expected)
    np.testing.assert_array_equal(array, ref)  # the copy handed out before stays as it was
    table.close()


@pytest.mark.parametrize("storage, dtype", [("device", torch.float32), ("device", torch.bfloat16),
                                            ("pageable", torch.bfloat16), ("pageable", torch.float32)],
                         ids=["device", "device-bfloat16", "pageable-bfloat16", "pageable"])
def test_host_chunks_are_read_only_views_of_the_tables_memory_or_copies(backend, rng, storage, dtype):
    """A chunk that is not the table's memory (a device table's rows, bfloat16 widened) is a copy, on
    every backend: a write into it, which could not reach the table, raises. A CPU device table's
    chunks were views of its memory, so a write through one reached the table in CI and went nowhere,
    silently, on a GPU. A host table's float chunks are its memory on every backend, read-only too:
    a write through one went past an owner's device cache (test_cache), and the table stays writable."""
    ref = random_rows(rng, (40, 6), np.float32)
    table = ss.HostTable.from_numpy(torch.from_numpy(ref).to(dtype), storage=storage, backend=backend)
    before = table.gather(np.arange(40)).float().cpu().numpy()
    chunks = list(table.host_chunks())
    np.testing.assert_array_equal(np.concatenate(chunks), before)
    own_memory = storage != "device" and dtype is not torch.bfloat16
    for chunk in chunks:
        assert not chunk.flags.writeable
        assert np.shares_memory(chunk, table.to_numpy()) == own_memory
        with pytest.raises(ValueError, match="read-only"):
            chunk[0] = 7.0
    np.testing.assert_array_equal(table.gather(np.arange(40)).float().cpu().numpy(), before)
    table.scatter([0], torch.full((1, 6), 7.0, dtype=dtype))  # the table's own writes still land
    before[0] = 7.0
    np.testing.assert_array_equal(table.gather(np.arange(40)).float().cpu().numpy(), before)
    table.close()


@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_a_file_loads_into_a_device_table_whole(backend, rng, tmp_path, name):
    """A load into a new device table (HostTable.load, OffloadedEmbedding.from_pretrained) reads the
    file into the table's own memory, not into a ``to_numpy()`` copy that would be dropped."""
    ref = random_rows(rng, (50, 6), np.float32)
    path = tmp_path / name
    ss.HostTable.from_numpy(ref, storage="pageable", backend=backend).save(path)
    loaded = ss.HostTable.load(path, storage="device", backend=backend)
    np.testing.assert_array_equal(loaded.gather(np.arange(50)).cpu().numpy(), ref)
    if name.endswith(".npy"):  # from_pretrained reads .npy files only
        emb = ss.OffloadedEmbedding.from_pretrained(path, max_rows=8, storage="device", backend=backend)
        np.testing.assert_array_equal(emb.table.gather(np.arange(50)).cpu().numpy(), ref)


def test_to_numpy_shares_host_memory(backend, rng):
    ref = random_rows(rng, (10, 4), np.float32)
    table = ss.HostTable.from_numpy(ref, storage="pageable", backend=backend)
    view = table.to_numpy()
    view[3] = 42.0
    np.testing.assert_array_equal(table.gather([3]).cpu().numpy(), np.full((1, 4), 42.0))
    copy = table.to_numpy(copy=True)
    copy[4] = -1.0
    assert table.to_numpy()[4, 0] != -1.0


def test_memory_accounting_and_close(backend, rng):
    table = ss.HostTable.from_numpy(random_rows(rng, (100, 10), np.float32), backend=backend)
    held = table.memory()
    assert held["host"] + held["device"] == 100 * 10 * 4 and held["file"] == 0
    gc.collect()  # tables of earlier tests go now, not between the two counts
    before = ss.info()
    assert before["tables"] >= 1
    table.close()
    table.close()  # idempotent
    assert table.closed and table.memory() == {"host": 0, "device": 0, "file": 0}
    after = ss.info()
    assert after["tables"] == before["tables"] - 1
    assert after["host_bytes"] + after["device_bytes"] == \
        before["host_bytes"] + before["device_bytes"] - 4000
    with pytest.raises(ss.StateError, match="closed"):
        table.gather([0])


def test_context_manager_releases_memory(backend, rng):
    with ss.HostTable.from_numpy(random_rows(rng, (64, 8), np.float32), backend=backend) as table:
        memory = weakref.ref(table._buffer.tensor)
        assert table.gather([1]).shape == (1, 8)
    assert table.closed
    gc.collect()
    assert memory() is None  # nothing keeps the rows alive after close


def test_mmap_table_larger_than_touched_pages_writes_through(backend, rng, tmp_path):
    path = tmp_path / "big.npy"
    rows, dim = 2_000_000, 128  # a 1 GiB file, created sparse
    table = ss.HostTable.empty(rows, dim, storage="mmap", backend=backend, path=path)
    ids = np.unique(rng.integers(0, rows, size=200))
    new = random_rows(rng, (len(ids), dim), np.float32)
    table.scatter(ids, new)
    np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), new)
    table.close()
    on_disk = np.load(path, mmap_mode="r")
    assert on_disk.shape == (rows, dim)
    np.testing.assert_array_equal(on_disk[ids], new)
    allocated = path.stat().st_blocks * 512
    assert allocated < rows * dim * 4 // 8, "the file should hold only the pages written"
    reopened = ss.HostTable.load(path, mmap=True, backend=backend)
    np.testing.assert_array_equal(reopened.gather(ids[:5]).cpu().numpy(), new[:5])


@pytest.mark.parametrize("write", ["scatter", "to_numpy", "as_tensor"])
def test_zero_leaves_a_new_mmap_file_sparse_and_zeroes_one_written_into(write, rng, tmp_path):
    """zero_ skips the writes only while the new file still reads as zeros from its holes."""
    path = tmp_path / "t.npy"
    table = ss.HostTable.empty(20_000, 16, storage="mmap", path=path, backend="numpy")
    if path.stat().st_blocks * 512 >= table.nbytes:
        pytest.skip("this file system stores no sparse files")
    table.zero_()
    table.flush()
    assert path.stat().st_blocks * 512 < table.nbytes / 4, "zero_ wrote the new file's zeros"
    ids = np.unique(rng.integers(0, 20_000, size=50))
    rows = random_rows(rng, (len(ids), 16), np.float32)
    if write == "scatter":
        table.scatter(ids, rows)
    else:
        view = table.to_numpy() if write == "to_numpy" else table.as_tensor().numpy()
        view[ids] = rows
        del view
    assert table.to_numpy().any()
    table.zero_()
    assert not table.to_numpy().any()
    table.close()


@pytest.mark.filterwarnings("error")
def test_from_numpy_copies_a_read_only_memmap_without_warnings(backend, storage, rng, tmp_path):
    ref = random_rows(rng, (500, 12), np.float32)
    np.save(tmp_path / "src.npy", ref)
    source = np.load(tmp_path / "src.npy", mmap_mode="r")
    table = make(source, storage, backend, tmp_path)
    np.testing.assert_array_equal(table.to_numpy(), ref)


def test_a_bfloat16_mmap_tables_file_is_mapped_again_with_its_dtype(rng, tmp_path):
    """The file behind a bfloat16 mmap table holds the bit patterns as uint16 (numpy has no bfloat16)."""
    path = tmp_path / "t.npy"
    values = torch.from_numpy(rng.standard_normal((5, 3)).astype(np.float32)).to(torch.bfloat16)
    table = ss.HostTable.empty(5, 3, "bfloat16", storage="mmap", path=path, backend="numpy")
    table.scatter(torch.arange(5), values)
    table.close()
    with pytest.raises(ss.FileFormatError, match="dtype='bfloat16'"):
        ss.HostTable.load(path, mmap=True, backend="numpy")
    again = ss.HostTable.load(path, mmap=True, dtype="bfloat16", backend="numpy")
    assert again.dtype is torch.bfloat16 and again.storage == "mmap"
    assert torch.equal(again.gather(torch.arange(5)), values)
    again.scatter([2], torch.full((1, 3), 0.5, dtype=torch.bfloat16))  # writes reach the file
    again.close()
    assert torch.equal(ss.HostTable.load(path, mmap=True, dtype=torch.bfloat16, backend="numpy").gather([2]),
                       torch.full((1, 3), 0.5, dtype=torch.bfloat16))
    np.save(tmp_path / "f.npy", rng.standard_normal((5, 3)).astype(np.float32))
    for kwargs, error in ((dict(mmap=False, dtype="bfloat16"), ss.OptionError),
                          (dict(mmap=True, dtype="float16"), ss.OptionError)):
        with pytest.raises(error, match="dtype"):
            ss.HostTable.load(path, backend="numpy", **kwargs)
    with pytest.raises(ss.FileFormatError, match="uint16"):
        ss.HostTable.load(tmp_path / "f.npy", mmap=True, dtype="bfloat16", backend="numpy")


@pytest.mark.parametrize("spelling", ["symlinked directory", "relative path after chdir"])
def test_saving_an_mmap_table_to_its_own_file_under_another_name_flushes_it(spelling, rng, tmp_path,
                                                                            monkeypatch):
    """Writing a new file over the mapped one would leave the table writing to a deleted copy."""
    (tmp_path / "real").mkdir()
    monkeypatch.chdir(tmp_path / "real")
    table = ss.HostTable.empty(4, 3, "float32", storage="mmap", path="t.npy", backend="numpy")
    table.scatter(torch.arange(4), torch.from_numpy(rng.standard_normal((4, 3)).astype(np.float32)))
    if spelling == "symlinked directory":
        (tmp_path / "link").symlink_to(tmp_path / "real")
        same = tmp_path / "link" / "t.npy"
    else:
        monkeypatch.chdir(tmp_path)
        same = "real/t.npy"
    table.save(same)
    table.scatter([1], torch.full((1, 3), 5.0))  # after the save: must still reach the file
    table.close()
    np.testing.assert_array_equal(np.load(tmp_path / "real" / "t.npy")[1], np.full(3, 5.0, np.float32))
