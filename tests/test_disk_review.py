"""Data from disk under conditions the other tests do not make: read-only file systems, the disk benchmark."""

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import speedswap as ss
from speedswap import atomic


def read_only_file_system(monkeypatch, directory):
    """Make creating or removing a file in ``directory`` fail as on a read-only mount.

    Linux answers EROFS there even to unlinking a file that does not exist,
    and to creating a save's lock file with ``os.open``.
    """
    real_open, real_os_open, real_unlink = open, os.open, os.unlink

    def refuse(name):
        if os.path.dirname(os.path.abspath(name)) == os.fspath(directory):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(name))

    def fake_open(name, mode="r", *args, **kwargs):
        if any(c in mode for c in "wxa+"):
            refuse(name)
        return real_open(name, mode, *args, **kwargs)

    def fake_os_open(name, flags, *args, **kwargs):
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            refuse(name)
        return real_os_open(name, flags, *args, **kwargs)

    def fake_unlink(name, *args, **kwargs):
        refuse(name)
        return real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(atomic, "open", fake_open, raising=False)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "unlink", fake_unlink)


@pytest.mark.parametrize("save", ["gadget", "create_npy"])
def test_a_save_onto_a_read_only_file_system_raises_path_error_naming_the_users_path(tmp_path, monkeypatch,
                                                                                       save):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    gadget = ss.DataGadget(np.ones((4, 3), np.float32), backend="numpy")
    read_only_file_system(monkeypatch, tmp_path)
    with pytest.raises(ss.PathError, match="read-only") as info:
        if save == "gadget":
            gadget.save(path)
        else:
            ss.data.create_npy(path, (4, 3), np.float32, lambda lo, hi: np.ones((hi - lo, 3), np.float32),
                               progress=False)
    assert info.value.errno == errno.EROFS and ".tmp" not in str(info.value)
    monkeypatch.undo()
    np.testing.assert_array_equal(np.load(path), np.arange(12, dtype=np.float32).reshape(4, 3))


def test_mapping_a_file_that_cannot_be_written_as_an_mmap_table_raises_path_error(tmp_path, monkeypatch):
    path = tmp_path / "t.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(4, 3))
    real_memmap = np.memmap

    def read_only_mount(filename, *args, mode="r+", **kwargs):  # what a read-only mount answers "r+"
        if mode == "r+":  # given the path, or the file opened for the map
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(getattr(filename, "name", filename)))
        return real_memmap(filename, *args, mode=mode, **kwargs)

    monkeypatch.setattr(np, "memmap", read_only_mount)
    with pytest.raises(ss.PathError, match=r"read-write.*mmap_mode='r'") as info:
        ss.HostTable.load(path, mmap=True, backend="numpy")
    assert info.value.errno == errno.EROFS


def no_permission_to_read(monkeypatch, path):
    """Make opening ``path`` fail as for a file its user may not read (root may read any, so it is simulated)."""
    import h5py
    real_open, real_h5_file = open, h5py.File

    def denied(name):
        return os.path.abspath(name) == os.fspath(path)

    def fake_open(name, *args, **kwargs):
        if denied(name):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(name))
        return real_open(name, *args, **kwargs)

    def fake_h5_file(name, *args, **kwargs):  # h5py's words, errno included
        if denied(name):
            raise OSError(errno.EACCES, f"Unable to synchronously open file (unable to open file: name = "
                                        f"'{name}', errno = 13, error message = 'Permission denied')")
        return real_h5_file(name, *args, **kwargs)

    monkeypatch.setattr(ss.files.npy, "open", fake_open, raising=False)
    monkeypatch.setattr(h5py, "File", fake_h5_file)


@pytest.mark.parametrize("name", ["t.npy", "t.h5"])
def test_a_file_without_read_permission_raises_path_error_saying_so(tmp_path, monkeypatch, rng, name):
    """A .npy file raised a raw PermissionError, and an HDF5 one was called truncated or not HDF5."""
    path = tmp_path / name
    values = rng.standard_normal((4, 3)).astype(np.float32)
    ss.HostTable.from_numpy(values, backend="numpy").save(path)
    table = ss.HostTable.from_numpy(values + 1, backend="numpy")
    no_permission_to_read(monkeypatch, path)
    for load in (lambda: ss.HostTable.load(path, backend="numpy"), lambda: table.load_from(path)):
        with pytest.raises(ss.PathError, match="no permission to read") as info:
            load()
        assert info.value.errno == errno.EACCES and name in str(info.value)
    np.testing.assert_array_equal(table.to_numpy(), values + 1)


def test_an_hdf5_file_another_process_writes_is_refused_as_locked_not_as_damaged(tmp_path, rng):
    """HDF5 locks a file open for writing: a load called it 'truncated or not HDF5: write it with h5py
    or HostTable.save', sending the user to replace a good file."""
    path = tmp_path / "t.h5"
    values = rng.standard_normal((4, 3)).astype(np.float32)
    ss.HostTable.from_numpy(values, backend="numpy").save(path)
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time, h5py\nf = h5py.File(sys.argv[1], 'a')\n"
                               "print('open', flush=True)\ntime.sleep(60)", str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        table = ss.HostTable.from_numpy(values + 1, backend="numpy")
        for load in (lambda: ss.HostTable.load(path, backend="numpy"), lambda: table.load_from(path)):
            with pytest.raises(ss.PathError, match="another process has it open for writing") as info:
                load()
            assert "truncated" not in str(info.value)
        np.testing.assert_array_equal(table.to_numpy(), values + 1)
    finally:
        writer.kill()
        writer.wait()
    np.testing.assert_array_equal(ss.HostTable.load(path, backend="numpy").to_numpy(), values)


def test_the_disk_benchmark_reports_a_random_epoch_stopped_before_a_tenth_of_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    import disk
    path = tmp_path / "x.npy"
    np.save(path, np.ones((400, 4), np.float32))
    row = disk.feeder_epoch(path, "random", batch=8, max_seconds=0)  # stops after one batch of 50
    assert row["rss_10pct_MB"] is None and row["rss_90pct_MB"] is None
    assert row["epoch_s_is"].startswith("extrapolated")


@pytest.mark.parametrize("shape, match", [((-1, -3), "negative"),                # -1 * -3 rows of 3 floats
                                          ((2**61, 8), "truncated"),             # 2**64 elements wrap to 0
                                          ((2**62, 2**4), "truncated")])
def test_a_header_whose_shape_does_not_describe_its_bytes_is_refused(tmp_path, shape, match):
    path = tmp_path / "corrupt.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
        f.write(np.ones(3 if shape[0] < 0 else 0, np.float32).tobytes())
    for make in (lambda: ss.DataGadget(path, backend="numpy"), lambda: ss.HostTable.load(path, backend="numpy"),
                 lambda: ss.HostTable.load(path, mmap=True, backend="numpy")):
        with pytest.raises(ss.FileFormatError, match=match):
            make()


def test_a_npy_format_version_numpy_does_not_know_is_refused(tmp_path):
    path = tmp_path / "v9.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.ones((2, 2), np.float32), version=(3, 0))
    raw = bytearray(path.read_bytes())
    raw[6] = 9  # format version 9.0, with a header 3.0 would read: numpy.load refuses it
    path.write_bytes(bytes(raw))
    with pytest.raises(ss.FileFormatError, match=r"version \(9, 0\)"):
        ss.DataGadget(path, backend="numpy")


TRUNCATE_WHILE_STAGING = textwrap.dedent("""
    import os, sys, numpy as np, torch, speedswap as ss
    from speedswap import files
    from speedswap.files import base, tables
    base.CHUNK_BYTES = 16 * 4 * 100  # 100 rows a chunk: the file is read in 40
    real_crc = tables.crc32_of
    for case in ("stage", "commit", "bfloat16 load"):
        path = os.path.join(sys.argv[1], case + ".npy")
        np.save(path, (np.arange(4000 * 16) % 256).astype(np.float32).reshape(4000, 16))  # bfloat16 values
        header = files.read_table_header(path)
        staged = None
        if case == "commit":  # too large for the RAM given: verified, and read again by commit
            staged = files.stage_table(path, header, "table", torch.float32, ram_available=0)
        calls = []
        def crc(chunk, value=0):  # another writer truncates the file after the first chunk
            calls.append(1)
            if len(calls) == 2:
                os.truncate(path, 1000)
            return real_crc(chunk, value)
        # Staging checksums behind the reads on a thread (base.crc32_behind); a commit and a
        # chunked load on the reading thread (tables): the truncation comes from either.
        tables.crc32_of = base.crc32_of = crc
        try:
            if case == "stage":
                files.stage_table(path, header, "table", torch.float32, ram_available=0)
            elif case == "commit":
                staged.commit(ss.HostTable.zeros(4000, 16, storage="pageable", backend="numpy"))
            else:  # a float32 file whose CRC-32 is recorded, into a bfloat16 table: read chunk by chunk
                table = ss.HostTable.zeros(4000, 16, "bfloat16", storage="pageable", backend="numpy")
                tables.read_table(table, path, tables.TableHeader(header.shape, header.dtype, header.offset,
                                                                  header.table_dtype, crc32=0))
        except ss.FileFormatError as exc:
            print(case, "raised:", exc)
            assert "ended early" in str(exc), exc
        tables.crc32_of = base.crc32_of = real_crc
""")


def test_a_table_file_truncated_while_it_is_read_raises_instead_of_sigbus(tmp_path):
    # In a subprocess: a SIGBUS would kill pytest itself.
    done = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_STAGING, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode} (-7 is SIGBUS): {done.stderr}"
    for case in ("stage", "commit", "bfloat16 load"):
        assert f"{case} raised:" in done.stdout, done.stdout + done.stderr


def test_a_float32_file_refused_for_a_bfloat16_table_names_rows_it_has(tmp_path):
    path = tmp_path / "t.npy"
    values = np.ones((4, 3), np.float32)
    values[0, 0] = 1.001  # not a bfloat16 value
    np.save(path, values)
    table = ss.HostTable.zeros(4, 3, "bfloat16", storage="pageable", backend="numpy")
    with pytest.raises(ss.FileFormatError, match=r"not bfloat16 values \(rows 0\.\.3\)"):
        table.load_from(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("name, read", [
    ("pipe.npy", "ss.DataGadget(sys.argv[1], backend='numpy')"),
    # HDF5 opened the pipe and waited for a writer, forever.
    ("pipe.h5", "ss.HostTable.load(sys.argv[1], backend='numpy')"),
    ("pipe.h5", "ss.HostTable.zeros(2, 2, backend='numpy').load_from(sys.argv[1])"),
])
def test_a_named_pipe_is_refused_instead_of_waiting_for_a_writer(tmp_path, name, read):
    path = tmp_path / name
    os.mkfifo(path)
    # Opening a pipe for reading waits for a writer: in a subprocess, killed if it hangs. The time
    # allowed starts once the child has imported what the read needs ("ready"): on a loaded machine
    # the imports alone took 14 s of the 30.
    child = subprocess.Popen([sys.executable, "-c", "import sys, h5py, speedswap as ss\n"
                              "print('ready', flush=True)\n"
                              f"try:\n    {read}\n"
                              "except ss.PathError as exc:\n    print(exc)", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    try:
        ready = child.stdout.readline()  # unbuffered: reads no further than the line, which communicate reads
        out, err = (b.decode() for b in child.communicate(timeout=30))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{read} waited for a writer to the named pipe")
    finally:
        child.kill()
        child.wait()
    assert ready == b"ready\n" and "not a regular file" in out, (ready, out, err)


def test_create_npy_replacing_a_file_keeps_a_link_at_the_path_and_the_files_mode(tmp_path, rng):
    """Without fill, a replaced file went through its own rename: a link became a plain file, and 0o640 0o644."""
    target = tmp_path / "data" / "x.npy"
    target.parent.mkdir()
    np.save(target, rng.standard_normal((3, 2)).astype(np.float32))
    os.chmod(target, 0o640)
    link = tmp_path / "x.npy"
    link.symlink_to(target)
    rows = rng.standard_normal((5, 4)).astype(np.float32)
    x = ss.data.create_npy(link, (5, 4), np.float32)
    x[:] = rows
    x.flush()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert os.stat(target).st_mode & 0o777 == 0o640
    np.testing.assert_array_equal(np.load(target), rows)
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.npy"]


@pytest.mark.parametrize("fill", [False, True])
def test_a_dataset_larger_than_any_file_is_refused_before_the_path_is_touched(tmp_path, fill):
    """(2**40, 2**40) float32: numpy's int64 size wrapped or overflowed into raw OverflowError/ValueError."""
    with pytest.raises(ss.OptionError, match="more than any memory or file can hold"):
        ss.data.create_npy(tmp_path / "x.npy", (2**40, 2**40), np.float32,
                           (lambda lo, hi: np.ones((hi - lo, 2**40), np.float32)) if fill else None, progress=False)
    assert list(tmp_path.iterdir()) == []
