"""Unusual inputs to HostTable's public calls: each works exactly, or raises a clear error, changing nothing."""

import warnings

import numpy as np
import pytest
import torch

import speedswap as ss


def random_rows(rng, shape, dtype=np.float32):
    return (rng.uniform(1.0, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(dtype)


@pytest.fixture
def table(backend, rng):
    return ss.HostTable.from_numpy(random_rows(rng, (40, 6)), storage="pageable", backend=backend)


# ------------------------------------------------------------------ ids
@pytest.mark.parametrize("ids, shown", [
    (np.array([3, 2**64 - 1], dtype=np.uint64), "18446744073709551615"),
    (np.array([2**63], dtype=np.uint64), "9223372036854775808"),
    (np.uint64(2**64 - 5), "18446744073709551611"),
    (torch.tensor([2**63 + 7, 1], dtype=torch.uint64), "9223372036854775815"),
])
def test_uint64_ids_beyond_int64_are_named_as_given(table, ids, shown):
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.IdError, match=f"contain {shown}, out of range") as info:
        table.scatter(ids, np.ones((len(ids) if hasattr(ids, "__len__") else 1, 6), np.float32))
    assert isinstance(info.value, IndexError)
    with pytest.raises(ss.IdError, match=f"contain {shown}, out of range"):
        table.gather(ids)
    np.testing.assert_array_equal(table.to_numpy(), before)


@pytest.mark.parametrize("ids", [[2**70], [5, -2**64], 2**65])
def test_python_ints_beyond_int64_are_out_of_range_not_a_dtype_error(table, ids):
    with pytest.raises(ss.IdError, match="beyond the int64 range") as info:
        table.gather(ids)
    assert isinstance(info.value, IndexError)


def test_timedelta_ids_are_refused(table):
    # numpy counts timedelta64 as an integer type; they are durations, not row ids.
    with pytest.raises(ss.DTypeError, match="must be integers.*timedelta64"):
        table.gather(np.array([1, 2], dtype="timedelta64[s]"))


def test_byte_swapped_ids_read_as_their_values(table, rng):
    ids = rng.integers(0, 40, size=17)
    np.testing.assert_array_equal(table.gather(ids.astype(">i4")).cpu().numpy(), table.to_numpy()[ids])


# --------------------------------------------------------------- values
def test_ragged_values_raise_a_shape_error_and_change_nothing(table):
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.ShapeError, match="different lengths") as info:
        table.scatter([1, 2], [[1.0] * 6, [2.0] * 5])
    assert isinstance(info.value, ValueError)
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_read_only_ids_and_values_are_written_without_a_warning(table, rng):
    """Arrays marked read-only (a read-only memmap, say) are only read: torch's warning would mislead."""
    ids, values = rng.permutation(40)[:5], rng.standard_normal((5, table.dim)).astype(np.float32)
    ids.flags.writeable = values.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table.scatter(ids, values)
        np.testing.assert_array_equal(table.gather(ids).cpu().numpy(), values)


def test_byte_swapped_values_are_written_exactly(table, rng):
    values = random_rows(rng, (3, 6))
    rows = [4, 31, 7]
    table.scatter(rows, values.astype(">f4"))
    np.testing.assert_array_equal(table.to_numpy()[rows], values)


@pytest.mark.parametrize("values, hint, cast", [
    (np.full((2, 6), 1.5), r"\.astype\('float32'\)", lambda v: v.astype("float32")),
    # A list has no .astype (it was advised one).
    ([[1.5] * 6] * 2, r"np\.asarray\(values, dtype='float32'\)", lambda v: np.asarray(v, dtype="float32")),
    (torch.full((2, 6), 1.5, dtype=torch.float64), r"\.to\(torch\.float32\)", lambda v: v.to(torch.float32)),
])
def test_dtype_hint_fits_the_kind_of_values(table, values, hint, cast):
    with pytest.raises(ss.DTypeError, match=hint):
        table.scatter([1, 2], values)
    table.scatter([1, 2], cast(values))  # the advice, followed, writes the rows
    np.testing.assert_array_equal(table.gather([1, 2]).cpu().numpy(), np.full((2, 6), 1.5, np.float32))


# ------------------------------------------------------------ gather out=
# An out can share memory with what gather reads only where it reads on the out's device:
# "device" tables (on a GPU, rows and ids stay there). A pageable table on a GPU is read
# on the host, from a copy of the ids, and a host out is refused there for its device.
def test_out_aliasing_the_table_is_refused(backend, rng):
    table = ss.HostTable.from_numpy(random_rows(rng, (40, 6)), storage="device", backend=backend)
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="shares memory with the table") as info:
        table.gather([0, 1, 2], out=table.as_tensor()[1:4])
    assert isinstance(info.value, ValueError)
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_out_aliasing_the_ids_is_refused(backend, rng):
    table = ss.HostTable.from_numpy(rng.integers(0, 5, size=(8, 1)), storage="device", backend=backend)
    ids = torch.from_numpy(rng.permutation(8)[:3].copy()).to(table.device)
    kept = ids.clone()
    with pytest.raises(ss.OptionError, match="shares memory with the ids"):
        table.gather(ids, out=ids.view(3, 1))
    assert torch.equal(ids, kept)


def test_out_beside_the_table_memory_is_accepted(table, rng):
    base = torch.from_numpy(random_rows(rng, (30,))).to(table.device)
    ids = [5, 9, 0]
    out = table.gather(ids, out=base[6:24].view(3, 6))
    np.testing.assert_array_equal(out.cpu().numpy(), table.to_numpy()[ids])


# --------------------------------------------------------------- from_numpy
@pytest.mark.parametrize("storage", ["pageable", "pinned", "device"])
def test_from_numpy_copies_a_bfloat16_tensor_exactly(backend, storage, rng):
    """A ``device`` table has no host array (on the numpy backend too): its fill converted the int16
    bit patterns it is handed by value (0x3F80, bfloat16 1.0, became 16256.0), which an H200 run caught."""
    rows = torch.from_numpy(random_rows(rng, (9, 4))).bfloat16()
    table = ss.HostTable.from_numpy(rows, storage=storage, backend=backend)
    assert table.dtype is torch.bfloat16
    assert torch.equal(table.gather(list(range(9))).cpu(), rows)


def test_from_numpy_reads_a_tensor_that_requires_grad(backend, rng):
    rows = torch.from_numpy(random_rows(rng, (5, 3))).requires_grad_()
    table = ss.HostTable.from_numpy(rows, storage="pageable", backend=backend)
    np.testing.assert_array_equal(table.to_numpy(), rows.detach().numpy())


def test_from_numpy_copies_byte_swapped_arrays(backend, rng):
    rows = random_rows(rng, (7, 3))
    table = ss.HostTable.from_numpy(rows.astype(">f4"), storage="pageable", backend=backend)
    assert table.dtype is torch.float32
    np.testing.assert_array_equal(table.to_numpy(), rows)


@pytest.mark.parametrize("array, error, message", [
    ([[1.0, 2.0], [3.0]], ss.ShapeError, "different lengths"),
    (torch.ones(3, 2, device="meta"), ss.DeviceError, "meta"),
    (torch.ones(3, 2, dtype=torch.complex64), ss.DTypeError, "complex64 is not supported"),
])
def test_from_numpy_refuses_clearly(backend, array, error, message):
    with pytest.raises(error, match=message):
        ss.HostTable.from_numpy(array, storage="pageable", backend=backend)


def test_adopt_byte_swapped_names_the_byte_order(backend, rng):
    with pytest.raises(ss.DTypeError, match="other byte order.*newbyteorder"):
        ss.HostTable.adopt(random_rows(rng, (4, 3)).astype(">f4"), backend=backend)


# ------------------------------------------------------------ initialisers
def test_apply_on_a_slice_in_place_is_accepted(table):
    before = table.to_numpy(copy=True)
    table.apply_(lambda t: t[5:].mul_(2))
    expected = before.copy()
    expected[5:] *= 2
    np.testing.assert_array_equal(table.to_numpy(), expected)


def test_apply_returning_a_new_tensor_is_still_refused(table):
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="in place"):
        table.apply_(lambda t: t * 2)
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_apply_says_what_fn_left_in_the_table_when_it_fails(table):
    """apply_ keeps no full-size copy to undo fn: its error must not claim the table is untouched."""
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="what it wrote into the given tensor in place, if anything, is"):
        table.apply_(lambda t: t.mul_(2).clone())
    np.testing.assert_array_equal(table.to_numpy(), 2 * before)

    def half_then_fail(t):
        t[: len(t) // 2].zero_()
        raise RuntimeError("fn failed")

    with pytest.raises(RuntimeError, match="fn failed"):  # fn's own error, as it raised it
        table.apply_(half_then_fail)
    expected = 2 * before
    expected[: len(expected) // 2] = 0
    np.testing.assert_array_equal(table.to_numpy(), expected)


@pytest.mark.parametrize("generator", [np.random.default_rng(0), 0])
@pytest.mark.parametrize("fill", ["uniform_", "normal_"])
def test_generator_must_be_a_torch_generator(table, generator, fill):
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.DTypeError, match="torch.Generator") as info:
        getattr(table, fill)(generator=generator)
    assert isinstance(info.value, TypeError)
    np.testing.assert_array_equal(table.to_numpy(), before)


@pytest.mark.parametrize("dtype, low, high", [
    ("float16", -1e6, 1e6), ("float16", 0.0, 65519.0), ("float32", -3e38, 3e38), ("bfloat16", 0.0, 1e39),
    ("float64", -1e308, 1e308),
])
def test_uniform_bounds_beyond_the_dtype_raise_an_option_error(backend, rng, dtype, low, high):
    table = ss.HostTable.empty(6, 4, dtype=dtype, storage="pageable", backend=backend)
    table.uniform_(-1, 1, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="largest") as info:
        table.uniform_(low, high)
    assert isinstance(info.value, ValueError)
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_uniform_at_the_dtype_limit_still_works(backend):
    table = ss.HostTable.empty(6, 4, dtype="float16", storage="pageable", backend=backend)
    table.uniform_(0.0, 65504.0)
    assert bool(torch.isfinite(table.as_tensor()).all())


# ---------------------------------------------------------------- close
def test_a_closed_table_refuses_save_and_keeps_its_description(table, tmp_path):
    storage, nbytes = table.storage, table.nbytes
    table.close()
    for call in (lambda: table.save(tmp_path / "t.npy"), lambda: table.is_backing_file(tmp_path / "t.npy")):
        with pytest.raises(ss.StateError, match="closed"):
            call()
    assert not (tmp_path / "t.npy").exists()
    assert (table.storage, table.nbytes, table.pinned) == (storage, nbytes, False)


class _IndexCopyBackend(ss.backends.cpu.NumpyBackend):
    """The CPU backend writing rows as the cuda backend does for device and staged tables."""

    def scatter(self, buffer, rows, values):
        buffer.tensor.index_copy_(0, rows, values)


@pytest.mark.parametrize("backend_class", [ss.backends.cpu.NumpyBackend, _IndexCopyBackend])
def test_scatter_of_the_tables_own_rows_writes_them_as_they_were(rng, backend_class):
    backend = backend_class()
    table = ss.HostTable(backend.allocate((12, 5), torch.float32, "pageable"), backend)
    table.apply_(lambda t: t.copy_(torch.from_numpy(random_rows(rng, (12, 5)))))
    before = table.to_numpy(copy=True)
    table.scatter([3, 4, 5, 6], table.as_tensor()[2:6])  # overlapping: each row moves one down
    expected = before.copy()
    expected[3:7] = before[2:6]
    np.testing.assert_array_equal(table.to_numpy(), expected)
