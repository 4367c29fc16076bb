"""Saving and loading: round trips, validation of bad files, atomic saves."""

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest
import torch

import speedswap as ss
import speedswap.table as table_module
from speedswap import atomic, files
from speedswap.convert import torch_dtype


@pytest.fixture
def values(rng):
    return (rng.standard_normal((300, 17)) + 5.0).astype(np.float32)


@pytest.mark.parametrize("name", ["t.npy", "t.h5", "t.hdf5"])
@pytest.mark.parametrize("storage", ["pinned", "pageable", "device"])
def test_save_load_round_trip(backend, values, tmp_path, name, storage):
    table = ss.HostTable.from_numpy(values, storage=storage, backend=backend)
    table.save(tmp_path / name)
    loaded = ss.HostTable.load(tmp_path / name, storage=storage, backend=backend)
    assert loaded.shape == values.shape and loaded.storage == storage
    np.testing.assert_array_equal(loaded.to_numpy(), values)
    other = ss.HostTable.zeros(*values.shape, backend=backend, storage=storage)
    other.load_from(tmp_path / name)
    np.testing.assert_array_equal(other.to_numpy(), values)


def test_npy_file_is_plain_numpy(backend, values, tmp_path):
    ss.HostTable.from_numpy(values, backend=backend).save(tmp_path / "t.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), values)
    assert oct(os.stat(tmp_path / "t.npy").st_mode & 0o777) == oct(0o644)


def test_float16_round_trip(backend, values, tmp_path):
    table = ss.HostTable.from_numpy(values.astype(np.float16), backend=backend)
    table.save(tmp_path / "h.h5", dataset="weights")
    loaded = ss.HostTable.load(tmp_path / "h.h5", backend=backend, dataset="weights")
    assert loaded.to_numpy().dtype == np.float16
    np.testing.assert_array_equal(loaded.to_numpy(), values.astype(np.float16))


def test_a_save_into_an_hdf5_file_holding_other_datasets_is_refused(backend, values, tmp_path, rng):
    """A save writes the whole file: saving table B as "v" beside table A's "u" deleted "u", silently."""
    path = tmp_path / "tables.h5"
    ss.HostTable.from_numpy(values, backend=backend).save(path, dataset="u")
    other = rng.standard_normal((5, 3)).astype(np.float32)
    with pytest.raises(ss.PathError, match=r"holds the datasets \['u'\] besides 'v'"):
        ss.HostTable.from_numpy(other, backend=backend).save(path, dataset="v")
    np.testing.assert_array_equal(ss.HostTable.load(path, backend=backend, dataset="u").to_numpy(), values)
    # Saving "u" again replaces it, as before.
    ss.HostTable.from_numpy(values + 1, backend=backend).save(path, dataset="u")
    np.testing.assert_array_equal(ss.HostTable.load(path, backend=backend, dataset="u").to_numpy(), values + 1)
    # Datasets inside groups count by their full names, however spelt.
    grouped = tmp_path / "grouped.h5"
    ss.HostTable.from_numpy(values, backend=backend).save(grouped, dataset="/emb/a")
    ss.HostTable.from_numpy(values + 2, backend=backend).save(grouped, dataset="emb//a")
    np.testing.assert_array_equal(ss.HostTable.load(grouped, backend=backend, dataset="emb/a").to_numpy(), values + 2)
    with pytest.raises(ss.PathError, match=r"\['emb/a'\] besides 'emb/b'"):
        ss.HostTable.from_numpy(other, backend=backend).save(grouped, dataset="emb/b")


def test_load_mmap_maps_the_file(backend, values, tmp_path):
    np.save(tmp_path / "m.npy", values)
    table = ss.HostTable.load(tmp_path / "m.npy", mmap=True, backend=backend)
    assert table.storage == "mmap" and table.memory()["file"] == values.nbytes
    table.scatter([2], np.full((1, 17), -3.0, np.float32))
    table.close()
    assert (np.load(tmp_path / "m.npy")[2] == -3.0).all()


@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
@pytest.mark.parametrize("dtype", [">f4", ">f2", ">i8"])
def test_a_big_endian_file_loads_as_the_numbers_it_holds(backend, values, tmp_path, name, dtype, monkeypatch):
    """Tables take byte-swapped arrays (from_numpy, scatter), but a big-endian file (as Java and
    NetCDF tools write) was refused as holding '>f4, which no table holds'."""
    native = (values * 100).astype(np.dtype(dtype).newbyteorder("="))
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, native.astype(dtype))
    else:
        with h5py.File(path, "w") as f:
            f.create_dataset("table", data=native.astype(dtype))
    for storage in ("pageable", "device"):  # read into the table's memory, or chunk by chunk
        loaded = ss.HostTable.load(path, storage=storage, backend=backend)
        assert loaded.dtype == torch_dtype(native.dtype)
        np.testing.assert_array_equal(loaded.to_numpy(), native)
    for ram in (1 << 40, 0):  # staged in RAM, or verified and read again
        monkeypatch.setattr(table_module, "available_ram", lambda: ram)
        table = ss.HostTable.from_numpy(native + 1, backend=backend)
        table.load_from(path)
        np.testing.assert_array_equal(table.to_numpy(), native)
    if name.endswith(".npy"):  # a map is the file's bytes, which torch cannot view swapped
        with pytest.raises(ss.FileFormatError, match="big-endian.*mmap=False"):
            ss.HostTable.load(path, mmap=True, backend=backend)


def test_truncated_npy_is_refused(backend, values, tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, values)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ss.FileFormatError, match="truncated") as info:
        ss.HostTable.load(path, backend=backend)
    assert isinstance(info.value, OSError)
    with pytest.raises(ss.FileFormatError, match="truncated"):
        ss.HostTable.load(path, mmap=True, backend=backend)


def test_an_npy_file_truncated_as_it_is_mapped_is_refused_not_grown_with_zeros(values, tmp_path, monkeypatch):
    path = tmp_path / "t.npy"
    np.save(path, values)
    size = os.path.getsize(path)
    checked = files.tables.read_npy_header  # the header HostTable.load maps the file by

    def truncated_after_the_check(*args):  # as another process truncating the file just then
        header = checked(*args)
        os.truncate(path, size // 2)
        return header

    monkeypatch.setattr(files.tables, "read_npy_header", truncated_after_the_check)
    with pytest.raises(ss.FileFormatError, match="truncated"):
        ss.HostTable.load(path, mmap=True, backend="numpy")
    assert os.path.getsize(path) == size // 2  # the file as it was left, not grown back with zeros


def test_npy_longer_than_its_header_is_refused(backend, values, tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, values)
    with open(path, "ab") as f:
        f.write(b"\0" * 68)
    with pytest.raises(ss.FileFormatError, match="longer than its header"):
        ss.HostTable.load(path, backend=backend)


@pytest.mark.parametrize("make, message", [
    (lambda p, v: p.write_bytes(b"not a numpy file at all"), "not a valid .npy"),
    (lambda p, v: np.save(p, np.asfortranarray(v)), "Fortran order"),
    (lambda p, v: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True), "objects"),
    (lambda p, v: np.save(p, v[:, 0]), "2-D"),
])
def test_malformed_npy_is_refused(backend, values, tmp_path, make, message):
    path = tmp_path / "bad.npy"
    make(path, values)
    with pytest.raises(ss.FileFormatError, match=message):
        ss.HostTable.load(path, backend=backend)


def _damage_header(path, values, at, new):
    ss.HostTable.from_numpy(values, backend="numpy").save(path)  # header format 2.0, as checkpoints'
    raw = bytearray(path.read_bytes())
    raw[at:at + len(new)] = new
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("at, new", [
    (8, b"\x20"),  # the header's length cut to 32 bytes, mid-dict: tokenize's TokenError
    (23, b","),  # descr ',f4', which numpy's dtype parser answers with a SyntaxError
], ids=["header-cut-short", "descr-damaged"])
def test_a_damaged_npy_header_is_a_file_format_error_and_the_table_keeps_its_rows(
        backend, values, tmp_path, at, new):
    """numpy reads a header through tokenize and its dtype parser, which raise TokenError and
    SyntaxError (no ValueError) for some damage; both reached the caller raw."""
    path = tmp_path / "bad.npy"
    _damage_header(path, values, at, new)
    table = ss.HostTable.from_numpy(values[::-1].copy(), backend=backend)
    with pytest.raises(ss.FileFormatError, match="not a valid .npy") as info:
        table.load_from(path)
    assert isinstance(info.value, OSError)
    np.testing.assert_array_equal(table.to_numpy(), values[::-1])


def test_a_read_error_in_an_npy_header_is_a_file_format_error_and_the_table_keeps_its_rows(
        backend, values, tmp_path, monkeypatch):
    """A failing disk (EIO) under the header's read escaped as the raw OSError, where the same
    error under the rows' read is a FileFormatError."""
    import errno
    from speedswap.files import npy
    path = tmp_path / "t.npy"
    np.save(path, values)

    def failing_read(self, size):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(npy._PositionedReader, "read", failing_read)  # the header's reads, by pread
    table = ss.HostTable.from_numpy(values[::-1].copy(), backend=backend)
    with pytest.raises(ss.FileFormatError, match="could not be read.*Input/output error"):
        table.load_from(path)
    np.testing.assert_array_equal(table.to_numpy(), values[::-1])


def test_h5_without_the_dataset_is_refused(backend, values, tmp_path):
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f["other"] = values
    with pytest.raises(ss.FileFormatError, match="no dataset 'table'.*other"):
        ss.HostTable.load(path, backend=backend)


def test_h5_dataset_of_a_type_numpy_cannot_hold_is_a_file_format_error(backend, values, tmp_path):
    """h5py answers a datatype without a numpy equivalent (HDF5's time type; a damaged datatype or
    attribute encoding alike) with a TypeError, which escaped the loads raw."""
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        h5py.h5d.create(f.id, b"table", h5py.h5t.UNIX_D32LE, h5py.h5s.create_simple(values.shape))
    table = ss.HostTable.from_numpy(values, backend=backend)
    for load in (lambda: ss.HostTable.load(path, backend=backend), lambda: table.load_from(path)):
        with pytest.raises(ss.FileFormatError, match="TypeTimeID"):
            load()
    np.testing.assert_array_equal(table.to_numpy(), values)


def test_h5_compressed_with_a_filter_not_installed_here_is_refused_as_such(backend, values, tmp_path):
    """A dataset compressed by a plugin filter (Blosc, Zstandard: PyTables' and others' defaults) that
    HDF5 cannot load here was called corrupt, once its first chunk failed to read."""
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        data = f.create_dataset("table", shape=values.shape, dtype=values.dtype, chunks=(100, 17),
                                compression=511, allow_unknown_filter=True)  # 511: no plugin has it
        for start in range(0, len(values), 100):
            data.id.write_direct_chunk((start, 0), values[start:start + 100].tobytes())
    table = ss.HostTable.from_numpy(values + 1, backend=backend)
    for load in (lambda: ss.HostTable.load(path, backend=backend), lambda: table.load_from(path)):
        with pytest.raises(ss.FileFormatError, match="filter 511, which HDF5 cannot load here.*hdf5plugin") as info:
            load()
        assert "corrupt" not in str(info.value)
    np.testing.assert_array_equal(table.to_numpy(), values + 1)


def test_corrupt_h5_is_refused(backend, tmp_path):
    path = tmp_path / "t.h5"
    path.write_bytes(b"\x89HDF garbage" * 10)
    with pytest.raises(ss.FileFormatError, match="not a readable HDF5"):
        ss.HostTable.load(path, backend=backend)


@pytest.mark.parametrize("storage", ["pageable", "device"])
def test_a_bit_flipped_in_the_rows_of_an_h5_table_file_is_refused(backend, values, tmp_path, rng, storage):
    """HostTable.save wrote HDF5 without the CRC-32 checkpoints record: a flipped bit in the rows
    loaded as a wrong value, silently."""
    path = tmp_path / "t.h5"
    ss.HostTable.from_numpy(values, backend=backend).save(path)
    with h5py.File(path, "r") as f:
        at = f["table"].id.get_offset() + int(rng.integers(values.nbytes))
    damaged = bytearray(path.read_bytes())
    damaged[at] ^= 1 << int(rng.integers(8))
    path.write_bytes(bytes(damaged))
    table = ss.HostTable.from_numpy(values + 1, storage=storage, backend=backend)
    for load in (lambda: ss.HostTable.load(path, storage=storage, backend=backend), lambda: table.load_from(path)):
        with pytest.raises(ss.FileFormatError, match="CRC-32"):
            load()
    np.testing.assert_array_equal(table.to_numpy(), values + 1)


def unsealed_save(save, monkeypatch):
    """Run ``save()`` with the seal, a save's last write into the file, left out: the file a save that
    stopped just before it leaves (here renamed into place, as a copy of its temporary would be)."""
    with monkeypatch.context() as patched:
        patched.setattr(files.h5, "seal", lambda path, spans: None)
        save()


def test_an_h5_file_a_save_never_sealed_is_refused_as_incomplete(backend, values, tmp_path, monkeypatch, rng):
    """Its user block, reserved for the seal, is empty: the file was read unchecked, as if another
    tool had written it, though nothing can verify its HDF5 metadata."""
    path = tmp_path / "t.h5"
    unsealed_save(lambda: ss.HostTable.from_numpy(values, backend=backend).save(path), monkeypatch)
    with h5py.File(path, "r") as f:  # a whole HDF5 file all the same: only the seal is missing
        np.testing.assert_array_equal(f["table"][...], values)
    other = rng.standard_normal(values.shape).astype(np.float32)
    table = ss.HostTable.from_numpy(other, backend=backend)
    for load in (lambda: ss.HostTable.load(path, backend=backend), lambda: table.load_from(path)):
        with pytest.raises(ss.FileFormatError, match="incomplete.*seal.*nothing was read") as refused:
            load()
        assert "save it again" in str(refused.value)
    np.testing.assert_array_equal(table.to_numpy(), other)
    ss.HostTable.from_numpy(values, backend=backend).save(path)  # a save replaces it, sealed
    np.testing.assert_array_equal(ss.HostTable.load(path, backend=backend).to_numpy(), values)


def test_an_h5_checkpoint_a_save_never_sealed_is_refused_and_changes_nothing(rng, tmp_path, monkeypatch):
    path = tmp_path / "emb.h5"
    rows = rng.standard_normal((40, 3)).astype(np.float32)
    emb = ss.OffloadedEmbedding(40, 3, max_rows=8, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rows)))
    emb.attach(torch.optim.Adam(emb.parameters(), lr=0.1))
    unsealed_save(lambda: emb.save(path), monkeypatch)
    other = ss.OffloadedEmbedding(40, 3, max_rows=8, storage="pageable", backend="numpy")
    other.attach(torch.optim.Adam(other.parameters(), lr=0.1))
    before = other.table.to_numpy(copy=True)
    with pytest.raises(ss.FileFormatError, match="incomplete"):
        other.load(path)
    np.testing.assert_array_equal(other.table.to_numpy(), before)


def test_h5_files_of_other_writers_load_with_or_without_a_user_block(backend, values, tmp_path):
    """Unsealed, and read as before: no user block (h5py's default, an older speedswap's), or one
    holding another tool's bytes."""
    for name, userblock in (("plain.h5", None), ("text.h5", b"written by another tool\n")):
        path = tmp_path / name
        with h5py.File(path, "w", **({} if userblock is None else {"userblock_size": 512})) as f:
            f["table"] = values
        if userblock is not None:
            with open(path, "r+b") as f:
                f.write(userblock)
        np.testing.assert_array_equal(ss.HostTable.load(path, backend=backend).to_numpy(), values)


def test_missing_file_is_file_not_found(backend, tmp_path):
    with pytest.raises(FileNotFoundError):
        ss.HostTable.load(tmp_path / "nope.npy", backend=backend)


def test_unknown_suffix_is_refused(backend, values, tmp_path):
    table = ss.HostTable.from_numpy(values, backend=backend)
    with pytest.raises(ss.OptionError, match=r"\*.npy"):
        table.save(tmp_path / "t.pt")


@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_load_from_a_mismatched_file_changes_nothing(backend, values, tmp_path, name):
    ss.HostTable.from_numpy(values[:, :16], backend=backend).save(tmp_path / name)
    table = ss.HostTable.from_numpy(values, backend=backend)
    with pytest.raises(ss.FileFormatError, match=r"holds \(300, 16\).*\(300, 17\)"):
        table.load_from(tmp_path / name)
    np.testing.assert_array_equal(table.to_numpy(), values)
    ss.HostTable.from_numpy(values.astype(np.float64), backend=backend).save(tmp_path / "d.npy")
    with pytest.raises(ss.FileFormatError, match="float64"):
        table.load_from(tmp_path / "d.npy")
    np.testing.assert_array_equal(table.to_numpy(), values)


def test_failing_npy_writer_leaves_the_old_file_intact(backend, values, tmp_path, monkeypatch):
    path = tmp_path / "t.npy"
    ss.HostTable.from_numpy(values, backend=backend).save(path)
    original = path.read_bytes()
    calls = []

    def failing_write(f, start, chunk):
        calls.append(len(chunk))
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.base, "write_chunk", failing_write)
    with pytest.raises(OSError, match="No space left"):
        ss.HostTable.from_numpy(values * 2, backend=backend).save(path)
    assert calls, "the failing writer was not reached"
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["t.npy"], "the temporary file was not removed"


def test_failing_h5_save_leaves_the_old_file_intact(values, tmp_path):
    path = tmp_path / "t.h5"
    files.write_h5(path, {"table": (values.shape, values.dtype, [values])})
    original = path.read_bytes()

    def chunks():
        yield values[:100]
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        files.write_h5(path, {"table": (values.shape, values.dtype, chunks())})
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["t.h5"]


@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_load_from_reaches_a_table_whose_to_numpy_is_a_copy(values, tmp_path, name, monkeypatch):
    """A table on the GPU gives a host copy from to_numpy(): loading must write the table itself."""
    ss.HostTable.from_numpy(values, storage="pageable", backend="numpy").save(tmp_path / name)
    table = ss.HostTable.zeros(*values.shape, storage="device", backend="numpy")
    monkeypatch.setattr(ss.HostTable, "to_numpy", lambda self, copy=False: self.as_tensor().numpy().copy())
    table.load_from(tmp_path / name)
    np.testing.assert_array_equal(table.as_tensor().numpy(), values)


def test_save_of_a_device_table_is_chunked(backend, values, tmp_path, monkeypatch):
    monkeypatch.setattr(files.base, "CHUNK_BYTES", 17 * 4 * 64)  # 64 rows a chunk
    sizes = []
    original = files.base.write_chunk
    monkeypatch.setattr(files.base, "write_chunk", lambda f, s, c: (sizes.append(len(c)), original(f, s, c)))
    ss.HostTable.from_numpy(values, storage="device", backend=backend).save(tmp_path / "c.npy")
    assert sizes == [64, 64, 64, 64, 44]
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), values)


@pytest.mark.parametrize("umask", [0o077, 0o002])
@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_a_saved_file_gets_the_mode_of_a_plain_open_and_a_replaced_one_keeps_its_own(umask, name, backend,
                                                                                      values, tmp_path):
    table = ss.HostTable.from_numpy(values, backend=backend)
    old = os.umask(umask)
    try:
        open(tmp_path / "plain", "wb").close()
        table.save(tmp_path / name)
        assert os.stat(tmp_path / name).st_mode & 0o777 == os.stat(tmp_path / "plain").st_mode & 0o777
        os.chmod(tmp_path / name, 0o640)
        table.save(tmp_path / name)
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_new_mmap_tables_file_is_on_disk_before_it_is_named_and_its_name_after(tmp_path, monkeypatch, overwrite):
    """Without overwrite the file was linked to its name unsynced, and the directory never synced: a
    crash could leave the name without its header, or lose the file whose rows flush() had synced."""
    path = tmp_path / "m.npy"
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), path.exists()))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ss.HostTable.empty(5, 3, storage="mmap", path=path, overwrite=overwrite, backend="numpy")
    assert any(name.startswith(str(tmp_path / ".m.npy.")) and not named for name, named in synced), synced
    assert (str(tmp_path), True) in synced, synced


@pytest.mark.parametrize("at", ["fsync", "link"])
def test_an_interrupt_while_an_mmap_tables_file_is_made_leaves_nothing_behind(tmp_path, monkeypatch, at):
    """Ctrl-C there left the temporary (of the table's whole size), which no later save removes while
    the process lives: a notebook's kernel kept it."""
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, at, interrupted)
    with pytest.raises(KeyboardInterrupt):
        ss.HostTable.empty(5, 3, storage="mmap", path=tmp_path / "m.npy", backend="numpy")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_interrupt_while_a_new_mmap_tables_directory_is_synced_says_the_file_is_there(tmp_path, rng, monkeypatch,
                                                                                        overwrite):
    """Once a new mmap table's file has its name only the directory's fsync is left. Without overwrite
    Ctrl-C there came out bare, reading as a table that was not made, though the file is at the path
    (so making it again is refused: the path exists). The interrupt says the file is there, and what
    to do, as a save's does (with overwrite the file is made by atomic_output, which said so already)."""
    path = tmp_path / "m.npy"
    _interrupting_directory_syncs(monkeypatch)
    with pytest.raises(KeyboardInterrupt) as info:
        ss.HostTable.empty(5, 3, storage="mmap", path=path, overwrite=overwrite, backend="numpy")
    monkeypatch.undo()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"{str(path)!r} is the new file" in notes, notes
    assert "overwrite=True" in notes if not overwrite else "saving again makes sure" in notes, notes
    table = ss.HostTable.load(path, mmap=True, backend="numpy")
    assert table.shape == (5, 3) and os.listdir(tmp_path) == ["m.npy"]
    values = rng.standard_normal((5, 3)).astype(np.float32)
    table.scatter(torch.arange(5), torch.from_numpy(values))
    table.close()
    np.testing.assert_array_equal(np.load(path), values)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="only root may give a file to another user")
@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_a_replaced_file_keeps_its_owner_as_with_a_plain_open(name, backend, values, tmp_path):
    """The replacement was the saving user's: root in a container saving over a mounted directory's
    file took it from its owner, who could no longer write it (a plain open keeps the owner)."""
    path = tmp_path / name
    ss.HostTable.from_numpy(values, backend=backend).save(path)
    os.chown(path, 65534, 65534)
    ss.HostTable.from_numpy(values + 1, backend=backend).save(path)
    assert (os.stat(path).st_uid, os.stat(path).st_gid) == (65534, 65534)
    np.testing.assert_array_equal(ss.HostTable.load(path, backend=backend).to_numpy(), values + 1)


@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_a_save_through_a_symbolic_link_replaces_its_target_and_keeps_the_link(name, backend, values,
                                                                                 tmp_path):
    (tmp_path / "store").mkdir()
    ss.HostTable.from_numpy(values[::-1].copy(), backend=backend).save(tmp_path / "store" / name)
    os.symlink(tmp_path / "store" / name, tmp_path / name)
    ss.HostTable.from_numpy(values, backend=backend).save(tmp_path / name)
    assert os.path.islink(tmp_path / name)
    loaded = ss.HostTable.load(tmp_path / "store" / name, backend=backend)
    np.testing.assert_array_equal(loaded.to_numpy(), values)
    assert sorted(os.listdir(tmp_path / "store")) == [name]  # no temporary left beside it


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads this process's mappings from /proc (Linux)")
@pytest.mark.parametrize("name", ["m.npy", "m.h5"])
def test_a_save_over_a_file_a_live_table_writes_through_a_map_is_refused(name, values, tmp_path):
    """The save replaced the file; the mmap table went on writing to the old one, nameless since,
    so its writes and flushes were lost without a word, while its path named the new file."""
    path = tmp_path / "m.npy"
    mapped = ss.HostTable.empty(*values.shape, storage="mmap", path=path, backend="numpy")
    mapped.scatter(np.arange(len(values)), values)
    other = ss.HostTable.from_numpy(values[::-1].copy(), backend="numpy")
    target = tmp_path / name
    if name.endswith(".h5"):  # the same file, named by a link: its identity counts, not its name
        os.link(path, target)
    with pytest.raises(ss.PathError, match="maps that file for writing.*close"):
        other.save(target)
    assert sorted(os.listdir(tmp_path)) == sorted({"m.npy", name})  # no temporary left
    mapped.flush()
    np.testing.assert_array_equal(np.load(path), values)
    reader = np.load(path, mmap_mode="r")  # a read-only map keeps the old file's rows: no loss
    mapped.close()
    other.save(path)
    np.testing.assert_array_equal(np.load(path), values[::-1])
    np.testing.assert_array_equal(reader, values)
    kept = ss.HostTable.load(path, mmap=True, backend="numpy")  # writes through a map again
    assert kept.writable
    # Asked to start the file afresh, a new table replaces it all the same.
    fresh = ss.HostTable.empty(*values.shape, storage="mmap", path=path, overwrite=True, backend="numpy")
    fresh.scatter(np.arange(len(values)), values * 2)
    fresh.flush()
    np.testing.assert_array_equal(np.load(path), values * 2)


def test_crc32_behind_the_reads_is_the_crc32_of_all_the_chunks_in_order(rng, tmp_path, monkeypatch):
    """HostTable.load computes the rows' CRC-32 on a second thread, chunk by chunk behind the reads: it must
    be zlib's CRC-32 of every byte in order, the one saves record (files saved before still verify)."""
    import zlib
    chunks = [rng.standard_normal((int(rng.integers(1, 5000)), 7)).astype(np.float32) for _ in range(6)]
    whole = np.concatenate(chunks)
    assert files.base.crc32_behind(iter(chunks)) == zlib.crc32(whole.tobytes())
    assert files.base.crc32_behind(iter([])) == 0
    path = tmp_path / "t.h5"
    ss.HostTable.from_numpy(whole, backend="numpy").save(path)
    out = np.empty_like(whole)
    header = files.read_h5_header(path, "table")
    monkeypatch.setattr(files.base, "CHUNK_BYTES", 64 << 10)  # several chunks of rows
    assert files.read_h5_into(path, out, "table", header, crc32=True) == zlib.crc32(whole.tobytes()) == header.crc32
    np.testing.assert_array_equal(out, whole)


def test_crc32_behind_asks_for_a_chunk_only_two_ahead_and_gives_the_running_crc32s(rng, monkeypatch):
    """Staged loads read each chunk into a new array and checksum it behind the reads: were the reads
    faster than the CRC-32, every chunk of a file too large for RAM would wait in memory for its turn.
    A chunk is asked for only once all but the last two have their CRC-32; the CRC-32 up to each chunk
    is what a staged load records to check the file when it reads it again."""
    import time
    import zlib
    chunks = [rng.standard_normal((int(rng.integers(1, 5000)), 7)).astype(np.float32) for _ in range(6)]
    done, waiting = [0], []
    crc32_of = files.base.crc32_of

    def slow_crc32_of(chunk, crc=0):
        time.sleep(0.02)
        done[0] += 1
        return crc32_of(chunk, crc)
    monkeypatch.setattr(files.base, "crc32_of", slow_crc32_of)

    def reads():
        for i, chunk in enumerate(chunks):
            waiting.append(i - done[0])  # chunks asked for whose CRC-32 is not done
            yield chunk
    running = []
    assert files.base.crc32_behind(reads(), running=running) == zlib.crc32(np.concatenate(chunks).tobytes())
    assert max(waiting) <= 2 and done[0] == len(chunks), waiting
    assert running == [zlib.crc32(np.concatenate(chunks[:i + 1]).tobytes()) for i in range(len(chunks))]


def test_crc32_behind_checksums_on_the_callers_thread_where_no_thread_can_start(rng, tmp_path, monkeypatch):
    """At the process's thread limit (or while the interpreter shuts down) the CRC-32's thread cannot
    start: a load then checksums on its own thread, with the same CRC-32s, rather than fail."""
    import threading
    import zlib
    start = threading.Thread.start

    def start_unless_crc32(thread):
        if thread.name.startswith("speedswap-crc32"):
            raise RuntimeError("can't start new thread")
        start(thread)
    monkeypatch.setattr(threading.Thread, "start", start_unless_crc32)
    chunks = [rng.standard_normal((int(rng.integers(1, 5000)), 7)).astype(np.float32) for _ in range(4)]
    running = []
    assert files.base.crc32_behind(iter(chunks), running=running) == zlib.crc32(np.concatenate(chunks).tobytes())
    assert running == [zlib.crc32(np.concatenate(chunks[:i + 1]).tobytes()) for i in range(len(chunks))]
    path = tmp_path / "t.h5"
    ss.HostTable.from_numpy(np.concatenate(chunks), backend="numpy").save(path)
    np.testing.assert_array_equal(ss.HostTable.load(path, backend="numpy").to_numpy(), np.concatenate(chunks))


def _other_save(path, kind, seed) -> str:
    """Save to the HDF5 file ``path`` a table as dataset 'v' (``kind`` "table") or a checkpoint: what happened."""
    rows = np.random.default_rng(seed).standard_normal((6, 3)).astype(np.float32)
    try:
        if kind == "table":
            ss.HostTable.from_numpy(rows, backend="numpy").save(path, dataset="v")
        else:
            emb = ss.OffloadedEmbedding(6, 3, max_rows=6, storage="pageable", backend="numpy")
            emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rows)))
            emb.save(path)
    except ss.PathError as exc:
        return f"refused: {exc}"
    return "saved"


class _OtherWriter:
    """:func:`_other_save` run on a thread of this process, or in a process of its own."""

    def __init__(self, where, path, kind, seed):
        args = (os.fspath(path), kind, seed)
        if where == "thread":
            self._outcome = []
            self._thread = threading.Thread(target=lambda: self._outcome.append(_other_save(*args)))
            self._thread.start()
        else:  # this very speedswap, and this module for _other_save
            here = os.path.dirname(os.path.abspath(__file__))
            root = os.path.dirname(os.path.dirname(os.path.abspath(ss.__file__)))
            code = ("import sys; from test_files import _other_save; "
                    "print(_other_save(sys.argv[1], sys.argv[2], int(sys.argv[3])))")
            self._process = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE,
                                             text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, here])))
        self.where = where

    def done(self) -> bool:
        return not self._thread.is_alive() if self.where == "thread" else self._process.poll() is not None

    def outcome(self) -> str:
        if self.where == "thread":
            self._thread.join(120)
            return self._outcome[0]
        try:
            return self._process.communicate(timeout=120)[0].strip().splitlines()[-1]
        finally:
            self._process.kill()  # none left running, whatever happened


def _waiting_for_a_lock_in(directory) -> bool:
    """Whether some thread or process waits for an ``flock`` on a file in ``directory`` (Linux's /proc/locks)."""
    inodes = {entry.inode() for entry in os.scandir(directory)}
    with open("/proc/locks") as f:  # a waiter's line: "1: -> FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> ..."
        waiting = [field for line in f if "->" in line for field in line.split() if field.count(":") == 2]
    return any(int(field.rsplit(":", 1)[1]) in inodes for field in waiting)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="sees a save wait for its turn in /proc/locks (Linux)")
@pytest.mark.parametrize("kind", ["table", "checkpoint"])
@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_save_to_an_hdf5_file_another_save_is_writing_waits_its_turn_then_checks(tmp_path, rng, monkeypatch,
                                                                                    where, kind):
    """A save to an HDF5 file checks what it would replace (another table's dataset, a file that is no
    checkpoint), then writes and renames. Two saves at once both passed the check before either renamed,
    and the last rename silently deleted what the other wrote. A save now waits while another one to the
    same path is under way (thread or process), then checks the file that one left, and refuses it."""
    path = tmp_path / "t.h5"
    values = rng.standard_normal((4, 3)).astype(np.float32)
    writing, release = threading.Event(), threading.Event()
    write_chunk = files.base.write_chunk

    def held_at_its_first_write(sink, start, chunk):
        if not writing.is_set():
            writing.set()
            assert release.wait(120)
        write_chunk(sink, start, chunk)
    monkeypatch.setattr(files.base, "write_chunk", held_at_its_first_write)
    first = threading.Thread(target=ss.HostTable.from_numpy(values, backend="numpy").save, args=(path,),
                             kwargs={"dataset": "u"})
    first.start()
    try:
        assert writing.wait(120)
        other = _OtherWriter(where, path, kind, int(rng.integers(2**31)))
        deadline = time.monotonic() + 120
        while not (other.done() or _waiting_for_a_lock_in(tmp_path)):  # until it is done, or waits its turn
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        release.set()
        first.join(120)
    refusal = (r"holds the datasets \['u'\] besides 'v'" if kind == "table" else
               r"is not a speedswap checkpoint \(an HDF5 file with datasets \['u'\]\)")
    outcome = other.outcome()
    assert re.search("^refused: .*" + refusal, outcome), outcome
    np.testing.assert_array_equal(ss.HostTable.load(path, backend="numpy", dataset="u").to_numpy(), values)
    assert os.listdir(tmp_path) == ["t.h5"]  # the lock file goes with the last save that held it


@pytest.mark.skipif(not hasattr(os, "fork") or atomic.fcntl is None or not os.path.exists("/proc/locks"),
                    reason="forks, and sees a save wait for its turn in /proc/locks (Linux)")
@pytest.mark.parametrize("turn", ["a save's", "a checkpoint's"])
@pytest.mark.parametrize("fork_at", ["before its flock", "after its flock"])
def test_a_child_forked_as_another_thread_takes_a_turn_does_not_keep_that_turn(tmp_path, monkeypatch, turn,
                                                                               fork_at):
    """A forked child closes its copies of the descriptors whose flock another thread of the parent holds:
    the flock belongs to the open file, which a copy keeps alive. The descriptor was recorded only once
    flock had returned, so a child forked as a thread opened a lock file or a checkpoint and took its
    flock kept its copy: the lock outlived the thread's turn for as long as the child lived, and the
    parent's save waiting for that turn waited as long."""
    import select
    import warnings

    path, checkpoint = tmp_path / "t.npy", tmp_path / "ckpt"
    checkpoint.mkdir()

    def take_the_turn():
        return atomic.one_save_at_a_time(path) if turn == "a save's" else atomic.locked(checkpoint)

    holding, let_go, fork_now, forked, taken = (threading.Event() for _ in range(5))
    leave_r, leave_w = os.pipe()
    pids = []

    def fork():  # another thread of the parent forks (a DataLoader starting its workers)
        assert fork_now.wait(60)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
            pid = os.fork()
        if pid == 0:  # the child lives on, as a worker would, until the parent is done
            select.select([leave_r], [], [], 60)
            os._exit(0)
        pids.append(pid)
        forked.set()

    flock = atomic.fcntl.flock

    def with_a_fork(fd, operation):
        if fork_at == "after its flock":
            flock(fd, operation)
        if not fork_now.is_set():  # the holder's flock only
            fork_now.set()
            assert forked.wait(60)
        if fork_at == "before its flock":
            flock(fd, operation)
    monkeypatch.setattr(atomic.fcntl, "flock", with_a_fork)

    def hold():
        with take_the_turn():
            holding.set()
            let_go.wait(60)

    def wait_for_the_turn():
        with take_the_turn():
            taken.set()
    forker, holder = threading.Thread(target=fork), threading.Thread(target=hold)
    waiter = threading.Thread(target=wait_for_the_turn, daemon=True)  # waits for good on a turn kept
    forker.start()
    holder.start()
    try:
        assert holding.wait(60) and forked.wait(60)
        waiter.start()
        deadline = time.monotonic() + 60
        while not _waiting_for_a_lock_in(tmp_path):  # the next turn waits for the holder's
            assert time.monotonic() < deadline, "the next turn never waited for the holder's"
            time.sleep(0.01)
        let_go.set()
        holder.join(60)
        assert taken.wait(10), f"the parent's next turn waited for the child forked {fork_at}"
    finally:
        let_go.set()
        os.write(leave_w, b"x")
        forker.join(60)
        for pid in pids:
            os.waitpid(pid, 0)
        os.close(leave_r)
        os.close(leave_w)


_FORK_AS_A_SAVE_OPENS_A_PIPE = r"""
import os, signal, sys, threading, warnings
import numpy as np
import speedswap as ss
path, seed = sys.argv[1], int(sys.argv[2])
table = ss.HostTable.from_numpy(np.random.default_rng(seed).standard_normal((8, 3), dtype=np.float32),
                                storage="pageable", backend="numpy")
signal.alarm(30)  # a fork held up by the save: killed by SIGALRM (the start above is not timed)
outcome = []
def save():
    try:
        table.save(path)
        outcome.append("saved")
    except ss.SpeedswapError as exc:
        outcome.append(f"{type(exc).__name__}: {exc}")
saver = threading.Thread(target=save, daemon=True)  # blocked for good where the pipe's open waits
saver.start()
saver.join(2)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a multi-threaded process
    pid = os.fork()  # a DataLoader starting its workers
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
saver.join(30)
print("forked;", *outcome)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(os, "fork") or atomic.fcntl is None,
                    reason="named pipes, fork and flock")
def test_a_named_pipe_at_a_save_lock_path_is_refused_and_holds_up_no_fork(tmp_path, seed):
    """A lock file is opened while the fork hook's lock is held (no fork copies it unrecorded): an
    open that blocks there holds up every fork of the process. A named pipe at the lock's path
    (``.t.npy.speedswap.lock``) blocked the save in os.open, waiting for a writer, and a fork by
    another thread then waited as long. The pipe is now refused, at once, and kept."""
    path, lock = tmp_path / "t.npy", tmp_path / ".t.npy.speedswap.lock"
    os.mkfifo(lock)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ss.__file__)))
    # The child times itself from after its imports: a timeout around the whole run counted the
    # interpreter's start and torch's import, 16 s alone on a loaded machine, and failed the test.
    done = subprocess.run([sys.executable, "-c", _FORK_AS_A_SAVE_OPENS_A_PIPE, str(path), str(seed)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode != -signal.SIGALRM, ("a fork waited for a save blocked opening the named pipe "
                                                "at its lock's path")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("forked; PathError") and "not a regular file" in done.stdout, done.stdout
    assert sorted(os.listdir(tmp_path)) == [lock.name] and stat.S_ISFIFO(os.lstat(lock).st_mode)


def _interrupting_directory_syncs(monkeypatch):
    """Make ``os.fsync`` of a directory raise KeyboardInterrupt (Ctrl-C while a rename is made durable)."""
    fsync = os.fsync

    def interrupted_on_a_directory(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise KeyboardInterrupt
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", interrupted_on_a_directory)


@pytest.mark.parametrize("name", ["t.npy", "t.h5", "ck.h5"])
def test_an_interrupt_while_a_saved_files_directory_is_synced_says_the_file_is_the_new_one(tmp_path, rng,
                                                                                          monkeypatch, name):
    """After the rename only the directory's fsync is left: Ctrl-C there came out bare, reading as a save
    that failed, where the file at the path is the new one (only its directory entry may not survive a
    power loss yet). The interrupt now says so, as a directory checkpoint's does after its commit."""
    path = tmp_path / name
    old, new = (rng.standard_normal((6, 3)).astype(np.float32) for _ in range(2))

    def save(rows):
        if name == "ck.h5":
            emb = ss.OffloadedEmbedding(6, 3, max_rows=6, storage="pageable", backend="numpy")
            emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rows)))
            emb.save(path)
        else:
            ss.HostTable.from_numpy(rows, backend="numpy").save(path)
    save(old)
    _interrupting_directory_syncs(monkeypatch)
    with pytest.raises(KeyboardInterrupt) as info:
        save(new)
    monkeypatch.undo()
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert f"{str(path)!r} is the new file" in notes and "saving again makes sure" in notes, notes
    np.testing.assert_array_equal(ss.HostTable.load(path, backend="numpy").to_numpy(), new)


def test_an_interrupt_while_a_directory_checkpoints_file_is_synced_before_its_commit_has_no_such_note(
        tmp_path, rng, monkeypatch):
    """A directory checkpoint's files are written into a version aside, which an interrupt removes: one
    that comes while such a file's directory is synced must not say the file was saved."""
    path = tmp_path / "ck"
    emb = ss.OffloadedEmbedding(6, 3, max_rows=6, storage="pageable", backend="numpy")
    emb.table.apply_(lambda t: t.copy_(torch.from_numpy(rng.standard_normal((6, 3)).astype(np.float32))))
    _interrupting_directory_syncs(monkeypatch)
    with pytest.raises(KeyboardInterrupt) as info:
        emb.save(path)
    monkeypatch.undo()
    assert not getattr(info.value, "__notes__", []) and os.listdir(tmp_path) == []


def _opened_in(directory) -> list:
    """The descriptors of this process open on ``directory`` or a file in it (its lock files, removed ones too)."""
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory)):
                opened.append(int(fd))
    return opened


def _taken_elsewhere(target) -> bool:
    """Whether an ``flock`` on the file or directory ``target`` is held: a descriptor of its own cannot take it."""
    fd = os.open(target, os.O_RDONLY)
    try:
        atomic.fcntl.flock(fd, atomic.fcntl.LOCK_EX | atomic.fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


#: The sweeps below raise KeyboardInterrupt from a profile function. Before Python 3.11 one raised as a
#: generator resumes (a turn's context manager, as its block ends) leaves the generator without running
#: its finally, where a signal's would run it: they would report windows a real Ctrl-C does not have.
_SWEEPS_MODEL_CTRL_C = pytest.mark.skipif(sys.version_info < (3, 11), reason="profile-raised interrupts model "
                                          "where a Ctrl-C lands from Python 3.11 on")


def _interrupted_at(run, point, modules=(atomic,)):
    """``run(counting)`` with KeyboardInterrupt raised at the ``point``-th place it can land in ``modules``' code.

    From Python 3.11 on, Python runs a signal handler (Ctrl-C's) on entering a function (or resuming a
    generator) or once a call into C has returned: the "call" and "c_return" events of a profile function.
    Only the places between ``counting(True)`` and ``counting(False)`` count.

    Returns:
        where it was raised, or None past the last such place (``run`` ran through).
    """
    seen, where, code = [0], [], {module.__file__ for module in modules}

    def profile(frame, event, arg):
        if where or event not in ("call", "c_return") or frame.f_code.co_filename not in code:
            return
        if seen[0] == point:
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno} ({event} {getattr(arg, '__name__', '')})")
            raise KeyboardInterrupt
        seen[0] += 1

    try:
        run(lambda on: sys.setprofile(profile if on else None))
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    return where[0] if where else None


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(atomic.fcntl is None or not os.path.isdir("/proc/self/fd"),
                    reason="flock, and names open files through /proc (Linux)")
@pytest.mark.parametrize("phase", ["taking", "leaving"])
@pytest.mark.parametrize("turn", ["a save's", "a checkpoint save's", "a checkpoint load's", "a rewrite's"])
def test_an_interrupt_anywhere_as_a_turn_is_taken_or_left_keeps_neither_the_turn_nor_a_descriptor(tmp_path, turn,
                                                                                                  phase):
    """A turn is an flock on a descriptor that atomic.py opens, records for the fork hook, and closes as
    the turn ends. Ctrl-C on entering _let_go, as a checkpoint's turn ended, left its descriptor open and
    the directory locked for good: every later save or load of it, in this process or another, waited
    forever (a save's turn kept a descriptor of its removed lock file). As a turn was taken, Ctrl-C once
    os.open had returned lost the descriptor (one per interrupted save, open for good), and one once flock had
    returned, before the turn's try, kept the turn as well. KeyboardInterrupt is raised at each place
    an interrupt can land as the turn is taken or left, one per turn; after each, no descriptor of the
    turn is open, no record or turn of this thread is left, and the lock is free."""
    path, checkpoint = tmp_path / "t.npy", tmp_path / "ckpt"
    checkpoint.mkdir()
    path.write_bytes(b"rows")  # a load into an mmap table rewrites its file, on which it takes the turn
    identity = (path.stat().st_dev, path.stat().st_ino)
    take_the_turn = {"a save's": lambda: atomic.one_save_at_a_time(path),
                     "a checkpoint save's": lambda: atomic.locked(checkpoint),
                     "a checkpoint load's": lambda: atomic.locked(checkpoint, shared=True),
                     "a rewrite's": lambda: atomic.rewriting_in_place(path, identity)}[turn]

    def take_and_leave(counting):
        counting(phase == "taking")
        with take_the_turn():
            counting(phase == "leaving")
    lock = {"a save's": atomic._lock_path(path), "a rewrite's": path}.get(turn, checkpoint)
    records = dict(atomic._FLOCKED)
    kept, points = [], []
    while True:
        where = _interrupted_at(take_and_leave, len(points))
        left = {"descriptors": _opened_in(tmp_path), "records": dict(atomic._FLOCKED.items() - records.items()),
                "turn held by this thread": lock in getattr(atomic._HELD, "locks", ()),
                "flock held": os.path.exists(lock) and _taken_elsewhere(lock)}
        if any(left.values()):
            kept.append((where, {what: it for what, it in left.items() if it}))
            for fd in left["descriptors"]:  # so that the next turn is not held up by this one
                os.close(fd)
            atomic._FLOCKED.clear()
            atomic._FLOCKED.update(records)
            getattr(atomic._HELD, "locks", set()).discard(lock)
        if where is None:
            break
        points.append(where)
    assert any("close" in point or "_let_go" in point for point in points) if phase == "leaving" else \
        any("flock" in point for point in points), points
    assert not kept, f"a turn interrupted at {kept} (of {points})"


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_in_a_save_leaves_the_old_file_or_the_new_one_and_no_descriptor(tmp_path, rng):
    """fsync_dir opened the directory, then entered the try that closes it: Ctrl-C once os.open had
    returned (after a save's rename, as its directory was synced) left the directory's descriptor open
    for as long as the process lived, one per interrupted save. KeyboardInterrupt is raised at each place
    an interrupt can land in atomic.py during a save (atomic_output), one per save; after each the path
    holds the old bytes or the new ones, and nothing else is left: no descriptor, temporary or record."""
    path = tmp_path / "t.bin"
    path.write_bytes(old := rng.bytes(64))
    records = dict(atomic._FLOCKED)
    left, points = [], []
    while True:
        new = rng.bytes(64)

        def save(counting):
            counting(True)
            with atomic.atomic_output(path) as tmp, open(tmp, "wb") as f:
                f.write(new)

        where = _interrupted_at(save, len(points))
        now = path.read_bytes()
        assert now in (old, new), f"a save interrupted at {where} left neither the old file nor the new one"
        old = now
        debris = {"descriptors": _opened_in(tmp_path), "records": dict(atomic._FLOCKED.items() - records.items()),
                  "files": sorted(set(os.listdir(tmp_path)) - {path.name, os.path.basename(atomic._lock_path(path))})}
        if any(debris.values()):
            left.append((where, {what: it for what, it in debris.items() if it}))
            for fd in debris["descriptors"]:
                os.close(fd)
        if where is None:
            break
        points.append(where)
    assert now == new and any("fsync_dir" in point for point in points), points
    assert not left, f"a save interrupted at {left} (of {points})"


def _descriptors_left_by_interrupts(run, modules, directory):
    """Run ``run(counting)`` once per place an interrupt can land in ``modules``, KeyboardInterrupt raised there.

    Returns:
        the places (in order), and ``(place, descriptors)`` for each run that left a descriptor of
        ``directory`` open (closed here, so that the next run starts clean).
    """
    points, left = [], []
    while True:
        where = _interrupted_at(run, len(points), modules)
        opened = _opened_in(directory)
        if opened:
            left.append((where, opened))
            for fd in opened:
                os.close(fd)
        if where is None:
            return points, left
        points.append(where)


def _assert_no_descriptor_left_by_interrupts(run, modules, directory, what):
    """:func:`_descriptors_left_by_interrupts` of ``run``: the sweep reached a place right after an open,
    and no interrupted run left a descriptor of ``directory`` open.

    Args:
        what: the call swept, for the message ("a drop", "a load", ...).
    """
    points, left = _descriptors_left_by_interrupts(run, modules, directory)
    assert any("open" in point for point in points), points
    assert not left, f"{what} interrupted at {left} (of {points})"


@_SWEEPS_MODEL_CTRL_C
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc (Linux)")
def test_an_interrupt_anywhere_in_an_h5_checkpoints_load_leaves_no_descriptor(tmp_path, rng):
    """_load_tables held an HDF5 checkpoint's file open (held = os.open(...)) before the try that closes
    it: a Ctrl-C once os.open had returned left it open for good, one per interrupted load."""
    from speedswap.train import checkpoint
    path = tmp_path / "ckpt.h5"
    checkpoint.save_tables(path, {"t": ss.HostTable.from_numpy(rng.standard_normal((8, 4)).astype(np.float32), backend="numpy")}, {})
    target = ss.HostTable.from_numpy(rng.standard_normal((8, 4)).astype(np.float32), backend="numpy")

    def load(counting):
        counting(True)
        checkpoint.load_tables(path, {"t": target}, {})
        counting(False)

    _assert_no_descriptor_left_by_interrupts(load, (checkpoint, atomic), tmp_path, "a load")


@_SWEEPS_MODEL_CTRL_C
def test_an_interrupt_anywhere_in_a_save_once_the_new_file_has_its_name_says_so(tmp_path, rng):
    """A Ctrl-C right after atomic_output's rename (or as the save's turn ended) came out bare, though
    the path already held the new bytes. KeyboardInterrupt is raised at each place an interrupt can land
    in atomic.py during a save, one per save: each that leaves the new bytes at the path says so, and
    none that leaves the old ones does."""
    path = tmp_path / "t.bin"
    path.write_bytes(rng.bytes(64))
    bare, noted, points = [], [], []
    while True:
        new, caught = rng.bytes(64), []

        def save(counting):
            counting(True)
            try:
                with atomic.atomic_output(path) as tmp, open(tmp, "wb") as f:
                    f.write(new)
            except KeyboardInterrupt as exc:
                caught.append(" ".join(getattr(exc, "__notes__", [])))
                raise

        where = _interrupted_at(save, len(points))
        if where is None:
            break
        says_new = f"{str(path)!r} is the new file" in caught[0] and "saving again makes sure" in caught[0]
        if path.read_bytes() == new:
            noted.append(where)
            if not says_new:
                bare.append(where)
        elif says_new:
            bare.append((where, "a note, though the old file is there"))
        points.append(where)
    assert any(point.startswith("atomic_output") for point in noted), (noted, points)
    assert not bare, f"a save interrupted at {bare} (of {points})"
