"""The ``.npy`` format: validated headers, memory maps, chunked reads and atomic chunked writes."""

import contextlib
import math
import os
import sys
import threading
import tokenize
import weakref
from typing import Optional

import numpy as np

from ..atomic import (as_path, atomic_output, check_regular_file, check_writable_dir, opening_error,
                      rewrite_under_way, rewriting_error, saving_error, sync_new_name, temp_path)
from ..errors import FileFormatError, OptionError, PathError, SpeedswapError
from . import base
from .base import TableHeader, check_dtype, check_matches, reading_error, table_dtype_of

__all__ = ["read_npy_header", "MappedFile", "map_npy", "open_npy_memmap", "npy_data_bytes", "create_npy_memmap",
           "read_npy_into", "read_npy_rows", "write_npy", "is_npy_torn", "mark_npy_torn"]

#: Held while numpy parses a header. It parses with ast.literal_eval, and CPython 3.11's AST
#: constructor counts its recursion depth per interpreter, not per thread: two threads parsing
#: at once (two checkpoint loads, a load beside a feeder opening its file) can fail with
#: "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905).
HEADER_PARSE = threading.Lock()


#: The first bytes of a ``.npy`` file while a load rewrites its rows in place (:func:`mark_npy_torn`):
#: numpy's magic with one letter changed, as long as it, so that nothing else in the file moves.
TORN_MAGIC = b"\x93TORNY"
_NPY_MAGIC = np.lib.format.MAGIC_PREFIX


def is_npy_torn(fd: int, path) -> Optional[bool]:
    """Whether the ``.npy`` file open as ``fd`` carries the mark :func:`mark_npy_torn` writes.

    Args:
        fd: the file, open for reading.
        path: its path, for messages.

    Returns:
        bool, or None for a file with no ``.npy`` header (a bare ``np.memmap``
        adopted as a table), which is never marked.

    Raises:
        PathError: the file cannot be read (``errno`` says why).
    """
    try:
        head = os.pread(fd, len(TORN_MAGIC), 0)
    except OSError as exc:
        raise rewriting_error(path, exc) from exc
    return None if head not in (_NPY_MAGIC, TORN_MAGIC) else head == TORN_MAGIC


def mark_npy_torn(fd: int, path, torn: bool) -> None:
    """Mark the ``.npy`` file open as ``fd`` as rewritten in place (``torn``), or lift the mark.

    A load writes an ``mmap`` table's rows into its file in place: stopped
    midway (Ctrl-C, a crash, the power lost), the file holds part the load's
    rows, part those before, and reopened it would train on the mix. Marked
    before the first row changes, the file is refused by
    :func:`read_npy_header` (numpy takes it for no ``.npy`` file at all) until
    a load completes and lifts the mark. The mark is on disk when this
    returns (``fsync``), so lifted after the rows were flushed it never
    calls rows whole that are not. Written through the descriptor the load
    holds (:func:`~speedswap.atomic.rewriting_in_place`), never by path: the
    path may name another file by now.

    Args:
        fd: the file, open read-write; one :func:`is_npy_torn` found a ``.npy`` header in.
        path: its path, for messages.
        torn: True to mark it, False to lift the mark.

    Raises:
        PathError: the file cannot be written (``errno`` says why); the mark
            may or may not have been written.
    """
    try:
        os.pwrite(fd, TORN_MAGIC if torn else _NPY_MAGIC, 0)
        os.fsync(fd)
    except OSError as exc:
        raise rewriting_error(path, exc) from exc


def read_npy_header(path, exact_size: bool = True, *, marked: bool = False):
    """Read and validate the header of a ``.npy`` file.

    Args:
        path: the file.
        exact_size: refuse a file that holds other than the rows its header
            describes; False for a reader that checks each row it reads (a
            feeder's pread), to which rows appended or cut later are its own
            matter.
        marked: read a file marked as rewritten in place (:func:`mark_npy_torn`)
            as the header it carries, mark aside: for a table that maps the
            file already, where the mark moves no row (its loads take turns
            with other processes' through the mark's lock, not its header).

    Returns:
        TableHeader

    Raises:
        FileFormatError: marked as rewritten in place (:func:`mark_npy_torn`:
            a load into it is under way, or one stopped midway; not with
            ``marked``), not a
            ``.npy`` file, Fortran order, object or record dtype, a negative
            dimension, a file shorter or longer than its header says (with
            ``exact_size``), or the
            header could not be read (a failing disk).
        MissingFileError: the file does not exist.
        PathError: ``path`` is a directory or another file that is not a
            regular one (a named pipe, whose open would wait for a writer),
            or it cannot be opened (no permission to read it).
    """
    path = check_regular_file(path, ".npy file")
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise opening_error(path, exc, ".npy file") from exc
    with f:
        return _read_header(f.fileno(), path, exact_size, marked)


class _PositionedReader:
    """The reads numpy's header parser makes (``read``, ``seek``, ``tell``), as ``os.pread`` of a descriptor.

    A ``pread`` moves no file offset: threads may read one descriptor at once
    (the one a :class:`MappedFile` holds, which every gather of a table checks).
    """

    def __init__(self, fd: int):
        self._fd, self._at = fd, 0

    def read(self, size: int) -> bytes:
        data = os.pread(self._fd, size, self._at)
        self._at += len(data)
        return data

    def seek(self, at: int) -> None:
        self._at = at

    def tell(self) -> int:
        return self._at


def _read_header(fd: int, path, exact_size: bool, marked: bool) -> TableHeader:
    """:func:`read_npy_header` of the file open as ``fd`` (``path`` for messages)."""
    opened = os.fstat(fd)  # before the reads: a write after it shows in the version
    f = _PositionedReader(fd)
    try:
        # No read-ahead for a few header bytes: it would cache rows nobody asked for, and mark
        # them to read ahead further for whoever reads them next (a feeder's random reads then
        # fill the page cache its drop-behind keeps empty).
        with contextlib.suppress(AttributeError, OSError):  # no fadvise here (macOS): only advice
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        torn = f.read(len(TORN_MAGIC)) == TORN_MAGIC
        f.seek(0)
    except OSError as exc:  # a failing disk: as for a read of the rows
        raise reading_error(path, exc) from exc
    if torn and not marked and rewrite_under_way(fd):
        raise FileFormatError(f"{path!r}: a load into it is under way (a process or thread of this machine "
                              f"is writing its rows in place, and the file says so until every row is "
                              f"written): open it once that load completes")
    if torn and not marked:
        raise FileFormatError(f"{path!r}: a load into it stopped before it had written every row (Ctrl-C, "
                              f"a crash, out of memory), so it holds part the load's rows, part those "
                              f"before. Make the table again (storage='mmap' with overwrite=True) and "
                              f"load the checkpoint into it, or delete the file")
    try:
        with HEADER_PARSE:
            if torn:  # numpy's read_magic refuses the mark; the version follows it, as it follows the magic
                f.seek(len(TORN_MAGIC))
                version = tuple(f.read(2))
            else:
                version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):  # 3.0 differs only in a UTF-8 header (record field names)
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:  # a layout numpy itself does not read
                raise ValueError(f"format version {version}; numpy writes 1.0, 2.0 and 3.0")
    # numpy answers some damaged headers from tokenize (a header cut mid-dict) or its dtype
    # parser (descr ',f4') with their own errors, not a ValueError.
    except (ValueError, SyntaxError, tokenize.TokenError) as exc:
        raise FileFormatError(f"{path!r} is not a valid .npy file ({exc}); "
                              f"write it with numpy.save") from exc
    except OSError as exc:  # a failing disk: as for a read of the rows
        raise reading_error(path, exc) from exc
    offset = f.tell()
    check_dtype(dtype, path)
    if fortran and len(shape) > 1:
        raise FileFormatError(f"{path!r} is stored in Fortran order; speedswap needs rows "
                              f"contiguous: re-save it with np.save(path, np.ascontiguousarray(a))")
    if any(dim < 0 for dim in shape):
        raise FileFormatError(f"{path!r} has a corrupt header: its shape {shape} has a negative "
                              f"dimension; restore the file or write it again with numpy.save")
    header = TableHeader(tuple(shape), dtype, offset, table_dtype_of(dtype), version=base.file_version(opened))
    expected, actual = _file_bytes(header), opened.st_size
    if exact_size and actual != expected:
        kind = "truncated" if actual < expected else "longer than its header says"
        raise FileFormatError(f"{path!r} is {kind}: its header describes {shape} {dtype} "
                              f"({expected} bytes) but the file has {actual} bytes")
    return header


def _file_bytes(header: "TableHeader") -> int:
    """The size of the ``.npy`` file ``header`` describes: the header, then every row."""
    # Python ints: an int64 product of a corrupt shape such as (2**61, 8) wraps to 0
    # and would match a file that holds only its header.
    return header.offset + math.prod(header.shape) * header.dtype.itemsize


class MappedFile:
    """A descriptor held on a mapped ``.npy`` file, to check the file through before the map's pages are touched.

    Reading a memory-mapped page past the end of a truncated file kills the
    process with SIGBUS, so mapped readers :meth:`check` before they touch
    the pages (a truncation between the check and the read can still crash).
    The check goes through a descriptor of the mapped file itself, opened
    when it was mapped: it sees that file whatever names it has now (renamed
    away, or truncated through a hard link or a directory moved), and never
    another file that now sits at its path. A file removed, or replaced at
    its path by a rename, stays whole in the map, and the check finds it so.

    The descriptor is closed by :meth:`close`, or when the holder drops this
    object (a finalizer), so a holder collected without closing leaks none.

    Threads may :meth:`check` at once (the header is read with ``pread``);
    none may while another closes it (the descriptor's number may name
    another file by then).
    """

    def __init__(self, path, header: TableHeader, identity: Optional[tuple]):
        """Open the mapped file, which must still be at ``path``.

        Args:
            path: the file, just mapped.
            header: its header when it was mapped.
            identity: the mapped file's :func:`~speedswap.files.identity`
                (from the map itself where the system shows it); None when
                it is not known (no file at ``path`` by then).

        Raises:
            FileFormatError: ``path`` names another file than the one mapped
                (replaced by a rename since), or none.
            PathError: the file cannot be opened for reading (``errno`` says why).
        """
        self.path = os.fspath(path)
        self.header = header
        self._seen = header.version  # the file's version at which its header was last found to be header's
        try:
            # Not inherited by a child process (PEP 446); a named pipe renamed to the path meanwhile is
            # refused below, not waited on for a writer.
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError as exc:
            raise base.changed_error(self.path) from exc
        except OSError as exc:
            raise opening_error(self.path, exc, ".npy file") from exc
        self._close = weakref.finalize(self, os.close, fd)
        self._fd = fd
        if identity is None or base.identity(os.fstat(fd)) != tuple(identity):
            self.close()
            raise base.changed_error(self.path)

    def close(self) -> None:
        """Close the descriptor. Idempotent."""
        self._close()

    def check(self, remedy: str, *, marked: bool = False) -> None:
        """Raise FileFormatError when the mapped file was cut short or rewritten with another header.

        A file rewritten in place (``np.save`` to its path truncates and
        writes the mapped file) with another header puts its rows elsewhere,
        or makes them of another dtype or row shape: the map would read its
        bytes as the old header placed them. The header is read again only
        when the file changed (its size or times) since it was last found
        unchanged: a mapped file nobody writes costs one ``fstat``.

        Args:
            remedy: what the holder of the map can do, ending each message
                (``"restore the file, or build a new DataGadget over it"``).
            marked: take a file marked as rewritten in place by a load as the
                header it carries (see :func:`read_npy_header`): for a table
                whose own loads mark its file.

        Raises:
            FileFormatError: the file is shorter than the header mapped says,
                or its header now puts the rows elsewhere or makes them of
                another dtype or row shape (or is no ``.npy`` header any more,
                or, without ``marked``, is marked as rewritten in place by a load).
        """
        header, path = self.header, self.path
        need = _file_bytes(header)
        stat = os.fstat(self._fd)
        if stat.st_size < need:
            raise FileFormatError(f"{path!r} is {stat.st_size:,} bytes but its header needs {need:,}: "
                                  f"it was truncated after it was mapped, and the map's rows past its end are "
                                  f"gone (reading one would kill the process with SIGBUS); {remedy}")
        version = base.file_version(stat)  # taken before the header is read: a write after it is checked next time
        if version == self._seen:
            return
        now = _read_header(self._fd, path, exact_size=False, marked=marked)
        if (now.offset, now.dtype, now.shape[1:]) != (header.offset, header.dtype, header.shape[1:]):
            raise FileFormatError(f"{path!r} was rewritten in place with another .npy header since it "
                                  f"was mapped: the map reads rows of {header.dtype} {header.shape[1:]} from byte "
                                  f"{header.offset}, the file now holds rows of {now.dtype} {now.shape[1:]} from "
                                  f"byte {now.offset}, so the mapped rows are not the file's; {remedy}")
        self._seen = version


def map_npy(path, header: "TableHeader", mode: str, shape=None) -> np.memmap:
    """Memory-map the rows of a ``.npy`` file whose validated ``header`` was read from it.

    numpy grows a file shorter than a ``r+`` map with zeros (and a ``r`` map
    of it fails with a bare ValueError), so the size is checked on the file
    opened for the map: a file truncated since its header was read raises,
    rather than its lost rows coming back as zeros and the file being
    extended on disk.

    Args:
        path: the file.
        header: its header.
        mode: ``"r"`` or ``"r+"``.
        shape: the map's shape, of as many elements as ``header.shape``
            (default: ``header.shape``).

    Returns:
        numpy.memmap

    Raises:
        FileFormatError: the file is shorter than its header says, or ``path``
            names another file than the one ``header`` was read from.
        OSError: the file cannot be opened or mapped as asked.
    """
    path = os.fspath(path)  # as a str the map's filename is the path's, which readers open again
    need = _file_bytes(header)
    with open(path, "r+b" if mode == "r+" else "rb") as f:
        base.check_version(header, f.fileno(), path, unchanged=False)  # its size is checked here
        size = os.fstat(f.fileno()).st_size
        if size < need:
            raise FileFormatError(f"{path!r} is {size:,} bytes but its header needs {need:,}: it was "
                                  f"truncated after its header was read; restore it and open it again")
        return np.memmap(f, dtype=header.dtype, mode=mode, offset=header.offset,
                         shape=header.shape if shape is None else shape, order="C")


def open_npy_memmap(path, writable=True, header: Optional[TableHeader] = None):
    """Memory-map a validated ``.npy`` file.

    Args:
        path: the file.
        writable: map read-write (changes write through to the file).
        header: its :func:`read_npy_header`, if read already: the file mapped
            must be the one it was read from, unchanged.

    Returns:
        numpy.memmap

    Raises:
        FileFormatError: the file holds its numbers byte-swapped (big-endian),
            which torch cannot view where they lie, it was truncated as it was mapped,
            or it was changed or replaced since ``header`` was read from it.
        PathError: the file cannot be opened as asked (read-write on a
            read-only file or file system); ``errno`` says why.
    """
    header = header or read_npy_header(path)
    if not header.dtype.isnative:
        raise FileFormatError(f"{os.fspath(path)!r} holds {header.dtype.str} numbers, stored in the other "
                              f"byte order (a big-endian file), which torch cannot view where they lie: "
                              f"load a copy with mmap=False, or save the file again in this machine's "
                              f"byte order")
    try:
        return map_npy(path, header, "r+" if writable else "r")
    except FileFormatError:
        raise
    except OSError as exc:
        hint = ("an mmap table writes through to its file. Make the file writable, or share it "
                "read-only with HostTable.adopt(np.load(path, mmap_mode='r'))" if writable else
                "check the path and its permissions")
        error = PathError(f"cannot map {os.fspath(path)!r} {'read-write' if writable else 'read-only'} "
                          f"({exc.strerror or exc}): {hint}")
        error.errno = exc.errno
        raise error from exc


def npy_data_bytes(shape, dtype) -> int:
    """The bytes of an array of ``shape`` and ``dtype``, computed without numpy's int64 wrap.

    Raises:
        OptionError: more bytes than any file, map or numpy array can count (``sys.maxsize``).
    """
    size = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    if size > sys.maxsize:
        # Beyond what numpy, mmap and a file offset can count: their int64 arithmetic wraps,
        # and the failure would come from deep inside (a temporary file left behind).
        raise OptionError(f"a {tuple(shape)} {np.dtype(dtype)} array is {size} bytes, more than any "
                          f"memory or file can hold (at most {sys.maxsize}); check the shape")
    return size


def create_npy_memmap(path, shape, dtype, overwrite: bool = False):
    """Create a ``.npy`` file of ``shape``/``dtype`` and memory-map it read-write.

    The file is created sparse where the file system allows, so a table larger
    than RAM costs disk only as its rows are written. An existing file is
    never replaced unless ``overwrite``: it may be someone's trained table.
    A Ctrl-C once the file has its name (while its directory is synced)
    carries a note that the file is there and how to open it or make it again.

    Raises:
        OptionError: more bytes than a file can hold (:func:`npy_data_bytes`).
        PathError: ``path`` exists (without ``overwrite``), is a directory, its
            directory does not exist, or the file system refused it.
    """
    path = as_path(path)
    size = npy_data_bytes(shape, dtype)  # before anything is touched
    directory = check_writable_dir(path)
    if os.path.isdir(path):
        raise PathError(f"cannot create {path!r}: it is a directory; choose a file name")
    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)}
    if os.path.exists(path) and not overwrite:
        raise PathError(f"{path!r} already exists; speedswap does not replace a file it did not "
                        f"create. Open it with HostTable.load(path, mmap=True) (add "
                        f"dtype='bfloat16' for a bfloat16 table's file), or pass "
                        f"overwrite=True to start it afresh")
    # Created under a temporary name and renamed: a replaced file keeps its inode for
    # whoever still maps it, and the name never holds a half-made header.
    if overwrite:
        # atomic_output also keeps a symbolic link at path (its target is replaced) and
        # the replaced file's permission bits. A live table mapping the old file was asked
        # to be replaced: it keeps the old inode.
        with atomic_output(path, replace_mapped=True) as tmp:
            offset = _write_sparse(tmp, header, size)
            # Mapped before it takes the name: a map that fails (no descriptor left) leaves the old file.
            array = _mapped(tmp, dtype, offset, shape, named=path)
        array.filename = os.path.abspath(path)  # as np.memmap(path) names it; the inode is the same
        return array
    tmp = temp_path(path)
    try:
        offset = _write_sparse(tmp, header, size)
        with open(tmp, "rb") as f:  # its header on disk before it has a name, as atomic_output's
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails if the file appeared meanwhile: never replaced
        except FileExistsError:
            raise
        except OSError:  # no hard links on this file system: rename, after the check above
            os.rename(tmp, path)
        else:
            os.unlink(tmp)
    except BaseException as exc:  # an interrupt too: a live process's temporary is never removed later
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, FileExistsError):
            raise PathError(f"{path!r} already exists; speedswap does not replace a file it did not "
                            f"create; pass overwrite=True to start it afresh") from None
        if isinstance(exc, OSError):
            raise saving_error(path, exc) from exc
        raise
    # The name on disk too (flush() syncs the rows, never the directory); a Ctrl-C meanwhile comes
    # after the file exists, and making it again would be refused.
    sync_new_name(directory, path, "open it as it is (its rows are zeros) with HostTable.load(path, mmap=True) "
                                   "(add dtype='bfloat16' for a bfloat16 table's file), or make it again with "
                                   "overwrite=True, which also makes its name durable")
    try:
        return _mapped(path, dtype, offset, shape)
    except BaseException:  # the file made for nothing goes
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def _mapped(path, dtype, offset, shape, named=None) -> np.memmap:
    """``path``'s rows mapped for writing; ``named``, the name it will have, if it is a temporary.

    Raises:
        PathError: the process has no descriptor or address space left (what to do is said).
    """
    try:
        return np.memmap(path, dtype=dtype, mode="r+", offset=offset, shape=tuple(shape), order="C")
    except OSError as exc:
        raise (saving_error(path, exc) if named is None else saving_error(named, exc, temporary=path)) from exc


def _write_sparse(target, header, size) -> int:
    """Write a .npy ``header`` at the start of ``target`` and size it for ``size`` bytes of data (sparse).

    Returns:
        The data's offset in the file.
    """
    with open(target, "r+b" if os.path.exists(target) else "xb") as f:
        np.lib.format.write_array_header_2_0(f, header)
        offset = f.tell()
        f.truncate(offset + size)
    return offset


def read_npy_into(path, out, header=None):
    """Read a validated ``.npy`` file into the C-contiguous array ``out``, in chunks.

    Reads straight into ``out``'s memory (no temporary copy of the data), and
    swaps the bytes there when the file holds them in the other order.

    Raises:
        FileFormatError: the file's shape or dtype differ from ``out``'s, or it was
            changed or replaced since ``header`` was read from it.
    """
    header = header or read_npy_header(path)
    check_matches(header, out.shape, out.dtype, path)
    try:
        with open(path, "rb") as f:
            base.check_version(header, f.fileno(), path)
            f.seek(header.offset)
            _read_exactly(f, memoryview(out.reshape(-1).view(np.uint8)), path)
    except OSError as exc:
        if isinstance(exc, SpeedswapError):
            raise
        raise reading_error(path, exc) from exc
    if not header.dtype.isnative:
        out.byteswap(inplace=True)


def read_npy_rows(f, header: TableHeader, start: int, stop: int, path) -> np.ndarray:
    """Rows ``start .. stop - 1`` of a validated ``.npy`` file open as ``f``, read into a new array.

    Read, not memory-mapped: a page of a map past the end of a file truncated
    meanwhile kills the process with SIGBUS, where a short read raises.

    Args:
        f: the file, open for binary reading.
        header: its validated header.
        start, stop: the rows.
        path: its path, for messages.

    Returns:
        numpy.ndarray of shape ``(stop - start, *header.shape[1:])``.

    Raises:
        FileFormatError: the file ends before row ``stop``.
        OSError: the read failed.
    """
    rows = np.empty((stop - start, *header.shape[1:]), dtype=header.dtype)
    f.seek(header.offset + start * math.prod(header.shape[1:]) * header.dtype.itemsize)
    _read_exactly(f, memoryview(rows.reshape(-1).view(np.uint8)), path)
    return rows


def _read_exactly(f, view, path) -> None:
    """Fill the byte memoryview ``view`` from ``f``'s position, in chunks; FileFormatError at an early end."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:done + base.CHUNK_BYTES])
        if not n:
            raise FileFormatError(f"{os.fspath(path)!r} ended early while reading; "
                                  f"was it changed during the load?")
        done += n


def write_npy(path, shape, dtype, chunks, *, checksum: bool = False, note_interrupt: bool = True) -> Optional[int]:
    """Atomically write a ``.npy`` file from row chunks.

    Args:
        path: the target file.
        shape: the array's shape.
        dtype: its numpy dtype.
        chunks: an iterable of C-contiguous numpy arrays whose rows, in order,
            make up the array (so device tables never need one full host copy).
        checksum: also compute the CRC-32 of the rows' bytes, for a load to verify.
        note_interrupt: as :func:`~speedswap.atomic.atomic_output` takes it.

    Returns:
        the CRC-32 with ``checksum``, else None.
    """
    dtype = np.dtype(dtype)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": tuple(shape)}
    crc = 0 if checksum else None
    with atomic_output(path, note_interrupt=note_interrupt) as tmp, open(tmp, "wb") as f:
        np.lib.format.write_array_header_2_0(f, header)
        start = 0
        for chunk in chunks:
            base.write_chunk(f, start, chunk)
            start += len(chunk)
            if checksum:
                crc = base.crc32_of(chunk, crc)
        f.flush()
    return crc
