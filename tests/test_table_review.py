"""Defects found reviewing HostTable, its conversions and its files: each a reproducer that failed before its fix."""

import numpy as np
import pytest
import torch

import speedswap as ss


def bf16_bits(values: torch.Tensor) -> np.ndarray:
    return values.view(torch.int16).numpy().view(np.uint16)


# ------------------------------------------------------- bfloat16 files with NaN
@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_a_bfloat16_table_holding_nan_loads_back_bit_exact(rng, tmp_path, suffix):
    """A diverged bfloat16 table (NaN rows) saved as float32 loaded back: the NaN failed the
    "exact bfloat16 value" check (NaN != NaN), and torch's float32 -> bfloat16 cast turns
    every NaN into 0xFFFF, so neither sign nor payload would have survived."""
    values = torch.from_numpy(rng.uniform(0.5, 2.0, size=(30, 5)).astype(np.float32)).to(torch.bfloat16)
    bits = bf16_bits(values).copy()
    bits[3, 1], bits[17, 4], bits[29, 0] = 0x7FC0, 0xFFC1, 0x7F81  # +NaN, -NaN, a signalling payload
    table = ss.HostTable.from_numpy(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
                                    storage="pageable", backend="numpy")
    path = tmp_path / f"t{suffix}"
    table.save(path)
    other = ss.HostTable.zeros(30, 5, "bfloat16", "pageable", "numpy").load_from(path)
    np.testing.assert_array_equal(other.to_numpy(), bits)
    if suffix == ".h5":  # the file records bfloat16: load gives a bfloat16 table
        np.testing.assert_array_equal(ss.HostTable.load(path, storage="pageable", backend="numpy").to_numpy(),
                                      bits)


def test_a_float32_nan_that_is_no_bfloat16_value_is_refused(rng, tmp_path):
    exact = torch.from_numpy(rng.uniform(0.5, 2.0, size=(8, 4)).astype(np.float32)).to(torch.bfloat16).float()
    values = exact.numpy().copy()
    values.view(np.uint32)[2, 2] = 0x7FC00001  # a NaN whose low 16 bits a bfloat16 cannot hold
    np.save(tmp_path / "f32.npy", values)
    table = ss.HostTable.from_numpy(exact.to(torch.bfloat16), storage="pageable", backend="numpy")
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="would round"):
        table.load_from(tmp_path / "f32.npy")
    np.testing.assert_array_equal(table.to_numpy(), before)


# ------------------------------------------------------------ HDF5 dataset names
@pytest.mark.parametrize("dataset", [None, "", "/", ".", 5, b"table"])
def test_a_bad_hdf5_dataset_name_is_refused_before_the_file_changes(rng, tmp_path, dataset):
    """dataset=None made h5py write an unnamed dataset: save() replaced a good file with one
    holding nothing. "" and 5 gave raw TypeErrors, "/" and "." raw ValueErrors."""
    table = ss.HostTable.from_numpy(rng.standard_normal((12, 3)).astype(np.float32),
                                    storage="pageable", backend="numpy")
    path = tmp_path / "t.h5"
    table.save(path)
    before = path.read_bytes()
    with pytest.raises(ss.OptionError, match="dataset"):
        table.save(path, dataset=dataset)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]
    with pytest.raises(ss.OptionError, match="dataset"):
        ss.HostTable.load(path, dataset=dataset, backend="numpy")
    rows = table.to_numpy(copy=True)
    with pytest.raises(ss.OptionError, match="dataset"):
        table.load_from(path, dataset=dataset)
    np.testing.assert_array_equal(table.to_numpy(), rows)


def test_a_dataset_inside_a_group_still_saves_and_loads(rng, tmp_path):
    rows = rng.standard_normal((12, 3)).astype(np.float32)
    table = ss.HostTable.from_numpy(rows, storage="pageable", backend="numpy")
    table.save(tmp_path / "t.h5", dataset="/emb/weights")
    loaded = ss.HostTable.load(tmp_path / "t.h5", dataset="emb/weights", storage="pageable", backend="numpy")
    np.testing.assert_array_equal(loaded.to_numpy(), rows)


# ------------------------------------------------------------ foreign HDF5 files
def test_an_hdf5_dataset_with_no_shape_is_a_file_format_error(rng, tmp_path):
    """h5py gives shape None for a null dataspace (h5py.Empty): load raised a raw TypeError."""
    import h5py
    path = tmp_path / "e.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("table", data=h5py.Empty("f4"))
    with pytest.raises(ss.FileFormatError, match="no shape, no values"):
        ss.HostTable.load(path, backend="numpy")
    table = ss.HostTable.from_numpy(rng.standard_normal((4, 3)).astype(np.float32), storage="pageable",
                                    backend="numpy")
    rows = table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="no shape, no values"):
        table.load_from(path)
    np.testing.assert_array_equal(table.to_numpy(), rows)


@pytest.mark.parametrize("stored, attr", [
    (np.int32, "bfloat16"),   # integers are no bfloat16 values, whatever their bits
    (np.int16, "bfloat16"),
    (np.float64, "bfloat16"),
    (np.float32, "garbage"),  # was a DTypeError "'garbage' is not a dtype; use e.g. 'float32'"
    (np.float32, "float16"),
    (np.float32, 5),
])
def test_an_hdf5_table_dtype_attribute_other_than_bfloat16_over_float32_is_refused(rng, tmp_path, stored, attr):
    """speedswap writes speedswap_dtype="bfloat16" on float32 data only; any other record was
    believed (int32 rows with the attribute passed as bfloat16 bit patterns) or gave a DTypeError."""
    import h5py
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["table"] = (rng.integers(1, 100, size=(6, 4)) * 65536).astype(stored)
        f["table"].attrs["speedswap_dtype"] = attr
    with pytest.raises(ss.FileFormatError, match="speedswap_dtype"):
        ss.HostTable.load(path, storage="pageable", backend="numpy")
    table = ss.HostTable.from_numpy(torch.from_numpy(rng.uniform(0.5, 2.0, (6, 4)).astype(np.float32))
                                    .to(torch.bfloat16), storage="pageable", backend="numpy")
    rows = table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="speedswap_dtype"):
        table.load_from(path)
    np.testing.assert_array_equal(table.to_numpy(), rows)


def test_an_hdf5_crc32_attribute_that_is_no_number_is_a_file_format_error(rng, tmp_path):
    import h5py
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["table"] = rng.standard_normal((6, 4)).astype(np.float32)
        f["table"].attrs["speedswap_crc32"] = "abc"  # was a raw ValueError from int()
    with pytest.raises(ss.FileFormatError, match="speedswap_crc32"):
        ss.HostTable.load(path, storage="pageable", backend="numpy")


# ------------------------------------------------------------------ sparse tensors
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_scatter_values_are_a_dtype_error_and_change_nothing(rng, layout):
    """Sparse values reached values.reshape: a raw 'reshape is not implemented for sparse tensors'."""
    table = ss.HostTable.from_numpy(rng.standard_normal((20, 4)).astype(np.float32), storage="pageable",
                                    backend="numpy")
    before = table.to_numpy(copy=True)
    dense = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
    values = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(ss.DTypeError, match="to_dense"):
        table.scatter([1, 5, 7], values)
    np.testing.assert_array_equal(table.to_numpy(), before)


def test_a_sparse_gather_out_is_named_as_sparse(rng):
    """A sparse out was refused as 'not contiguous', whose fix (out.contiguous()) does not apply."""
    table = ss.HostTable.from_numpy(rng.standard_normal((20, 4)).astype(np.float32), storage="pageable",
                                    backend="numpy")
    with pytest.raises(ss.DTypeError, match="dense tensor"):
        table.gather([1, 2], out=torch.zeros(2, 4).to_sparse())


# -------------------------------------------------------------- impossible sizes
@pytest.mark.parametrize("shape", [(2**31, 2**31), (2**40, 2**40), (3, 2**62)])
@pytest.mark.parametrize("storage", ["pageable", "pinned", "mmap"])
def test_a_table_larger_than_any_address_space_is_an_option_error_leaving_no_file(tmp_path, shape, storage):
    """Sizes whose byte count passes 2**63: numpy's int64 np.prod wrapped, and empty raised a raw
    OverflowError or ValueError; an mmap table left its temporary, or a file whose header
    promised more bytes than it held, behind."""
    path = tmp_path / "t.npy" if storage == "mmap" else None
    with pytest.raises(ss.OptionError, match="bytes"):
        ss.HostTable.empty(*shape, storage=storage, backend="numpy", path=path)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- ids as given
def test_an_object_array_of_ids_in_range_gathers_and_scatters(rng):
    """np.array([...], dtype=object) of small ints was refused as 'beyond the int64 range'."""
    rows = rng.standard_normal((20, 4)).astype(np.float32)
    table = ss.HostTable.from_numpy(rows, storage="pageable", backend="numpy")
    ids = rng.choice(20, size=6, replace=False)
    got = table.gather(np.array(ids.tolist(), dtype=object))
    np.testing.assert_array_equal(got.numpy(), rows[ids])
    new = rng.standard_normal((6, 4)).astype(np.float32)
    table.scatter(np.array(ids.tolist(), dtype=object), new)
    np.testing.assert_array_equal(table.to_numpy()[ids], new)
    with pytest.raises(ss.IdError, match="contain 20, out of range"):
        table.gather(np.array([1, 20], dtype=object))


@pytest.mark.parametrize("ids, shown", [([2**63], "9223372036854775808"),
                                        ([1, 2**64 - 1], "18446744073709551615")])
def test_a_list_of_ids_past_int64_is_named_as_given_not_as_negative(rng, ids, shown):
    """numpy holds such a list as uint64; cast to int64 it wrapped, and the IdError said the
    ids 'contain -9223372036854775808 ... negative ids are not wrapped around'."""
    table = ss.HostTable.from_numpy(rng.standard_normal((20, 4)).astype(np.float32), storage="pageable",
                                    backend="numpy")
    before = table.to_numpy(copy=True)
    with pytest.raises(ss.IdError, match=f"contain {shown}, out of range"):
        table.gather(ids)
    with pytest.raises(ss.IdError, match=f"contain {shown}, out of range"):
        table.scatter(ids, rng.standard_normal((len(ids), 4)).astype(np.float32))
    np.testing.assert_array_equal(table.to_numpy(), before)


# ------------------------------------------------------------------- empty files
@pytest.mark.parametrize("shape", [(0, 5), (5, 0)])
@pytest.mark.parametrize("suffix", [".npy", ".h5"])
def test_a_file_of_no_rows_or_empty_rows_is_a_file_format_error_however_loaded(tmp_path, shape, suffix):
    """load() said 'num_rows must be a positive int, got 0' (an option the caller never gave),
    while load(mmap=True) made a 0-row table, which HostTable.empty refuses to make."""
    import h5py
    path = tmp_path / f"e{suffix}"
    if suffix == ".npy":
        np.save(path, np.zeros(shape, np.float32))
    else:
        with h5py.File(path, "w") as f:
            f["table"] = np.zeros(shape, np.float32)
    with pytest.raises(ss.FileFormatError, match="no rows"):
        ss.HostTable.load(path, storage="pageable", backend="numpy")
    if suffix == ".npy":
        with pytest.raises(ss.FileFormatError, match="no rows"):
            ss.HostTable.load(path, mmap=True, backend="numpy")
        np.save(path, np.zeros(shape, np.uint16))
        with pytest.raises(ss.FileFormatError, match="no rows"):
            ss.HostTable.load(path, mmap=True, dtype="bfloat16", backend="numpy")


# ------------------------------------------------------------- bfloat16 bit patterns
def test_writing_numpy_bit_patterns_to_a_bfloat16_table_says_how(rng):
    """to_numpy() of a bfloat16 table gives uint16 bit patterns; scattering them back said
    'pass a float array of the table's dtype', which numpy (no bfloat16) cannot make."""
    values = torch.from_numpy(rng.uniform(0.5, 2.0, (10, 4)).astype(np.float32)).to(torch.bfloat16)
    table = ss.HostTable.from_numpy(values, storage="pageable", backend="numpy")
    bits = table.to_numpy(copy=True)[[3, 1]]
    with pytest.raises(ss.DTypeError, match=r"view\(torch.bfloat16\)") as info:
        table.scatter([0, 2], bits)
    # the fix the message gives works, bit for bit
    hint = str(info.value)
    assert "torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)" in hint
    table.scatter([0, 2], torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16))
    np.testing.assert_array_equal(table.to_numpy()[[0, 2]], bits)


# ------------------------------------------------------------------ masked arrays
def _masked(rng, data):
    mask = np.zeros(data.shape, bool)
    mask.flat[rng.integers(0, data.size)] = True
    return np.ma.array(data, mask=mask)


def test_masked_arrays_are_refused_not_read_through_their_mask(rng):
    """np.asarray drops a masked array's mask: the entries it hides (arbitrary data) were
    written as rows, or used as ids, without a word."""
    rows = rng.standard_normal((20, 4)).astype(np.float32)
    with pytest.raises(ss.DTypeError, match="masked"):
        ss.HostTable.from_numpy(_masked(rng, rows), storage="pageable", backend="numpy")
    with pytest.raises(ss.DTypeError, match="masked"):
        ss.HostTable.adopt(_masked(rng, rows), backend="numpy")
    table = ss.HostTable.from_numpy(rows, storage="pageable", backend="numpy")
    with pytest.raises(ss.DTypeError, match="masked"):
        table.scatter([1, 2], _masked(rng, rng.standard_normal((2, 4)).astype(np.float32)))
    with pytest.raises(ss.DTypeError, match="masked"):
        table.gather(_masked(rng, rng.integers(0, 20, size=5)))
    np.testing.assert_array_equal(table.to_numpy(), rows)
    # without masked entries it is data like any other (np.ma.getdata)
    table.scatter([1, 2], np.ma.getdata(np.ma.array(rows[[5, 6]])))
    np.testing.assert_array_equal(table.to_numpy()[[1, 2]], rows[[5, 6]])


@pytest.mark.parametrize("call", ["save", "load", "load_from"])
def test_a_dataset_name_for_a_npy_file_is_refused_not_ignored(call, tmp_path, rng):
    """A .npy file holds one array: save(x.npy, dataset='emb') wrote it under no name, silently."""
    values = rng.standard_normal((5, 3)).astype(np.float32)
    table = ss.HostTable.from_numpy(values, storage="pageable", backend="numpy")
    path = tmp_path / "t.npy"
    if call != "save":
        table.save(path)
    with pytest.raises(ss.OptionError, match="dataset='emb' names an HDF5 dataset"):
        {"save": lambda: table.save(path, dataset="emb"),
         "load": lambda: ss.HostTable.load(path, dataset="emb", backend="numpy"),
         "load_from": lambda: table.load_from(path, dataset="emb")}[call]()
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if call == "save" else ["t.npy"])
    np.testing.assert_array_equal(table.to_numpy(), values)


def test_an_unknown_storage_is_refused_even_where_mmap_ignores_it(tmp_path, rng):
    path = tmp_path / "t.npy"
    np.save(path, rng.standard_normal((4, 3)).astype(np.float32))
    with pytest.raises(ss.OptionError, match="unknown storage 'bogus'"):
        ss.HostTable.load(path, storage="bogus", mmap=True, backend="numpy")


@pytest.mark.parametrize("ids", [[True, 2], [[1, False], [2, 3]], [np.bool_(True), 4],
                                 [torch.tensor(True), 4], [torch.tensor(3), torch.tensor(False)]])
def test_a_list_mixing_bools_with_int_ids_is_refused(ids, rng):
    """numpy reads [True, 2] as the ints 1 and 2: row 1 was gathered for a bool."""
    table = ss.HostTable.from_numpy(rng.standard_normal((6, 3)).astype(np.float32), storage="pageable",
                                    backend="numpy")
    with pytest.raises(ss.DTypeError, match="mixing bools with ints"):
        table.gather(ids)
    assert table.gather([1, 2]).shape == (2, 3)
