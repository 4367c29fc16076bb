"""HDF5 files: validated dataset headers, chunked reads and atomic writes of several datasets.

h5py is imported only when an HDF5 file is used.
"""

import contextlib
import errno
import os
import re
from typing import Optional

import numpy as np
import torch

from ..atomic import as_path, atomic_output, check_regular_file, opening_error
from ..errors import FileFormatError, OptionError, PathError, SpeedswapError
from . import base
from .base import (TableHeader, changed_error, check_dtype, check_matches, crc32_behind, file_version,
                   reading_error, row_ranges, table_dtype_of)
from .h5seal import SUPERBLOCK, check_seal, seal, userblock_size

__all__ = ["check_dataset_name", "read_h5_header", "open_h5", "read_before_replacing", "read_h5_into", "write_h5"]

#: The dataset attribute that records a table dtype the stored one stands for (bfloat16).
_TABLE_DTYPE_ATTR = "speedswap_dtype"
#: The dataset attribute holding the CRC-32 of its bytes, where the writer recorded one.
_CRC32_ATTR = "speedswap_crc32"
#: Where a superblock of version 0 or 1 keeps its 4 bytes of file consistency flags.
_FLAGS_AT = 20


def _h5py():
    import h5py
    return h5py


def check_dataset_name(dataset) -> str:
    """``dataset`` if it names an HDF5 dataset: a str with a name in it (``"table"``, ``"emb/weights"``).

    h5py takes None as "an unnamed dataset", which a save writes and no read
    can find, and raises raw TypeErrors and ValueErrors for other non-names.

    Raises:
        OptionError: not a str, or no name in it (``""``, ``"/"``, ``"."``).
    """
    if not isinstance(dataset, str) or not any(part not in ("", ".") for part in dataset.split("/")):
        raise OptionError(f"dataset={dataset!r} names no HDF5 dataset; pass a name such as "
                          f"dataset='table' (the default) or 'group/name'")
    return dataset


def normal_dataset_name(dataset: str) -> str:
    """A checked dataset name as h5py lists it: ``"/emb//weights"`` is ``"emb/weights"``."""
    return "/".join(part for part in check_dataset_name(dataset).split("/") if part not in ("", "."))


def dataset_names(f) -> list:
    """The full name of every dataset in the open HDF5 file ``f``, groups' included (``"emb/weights"``)."""
    h5py = _h5py()
    names = []
    f.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
    return names


def read_h5_header(path, dataset):
    """Validate dataset ``dataset`` of an HDF5 file and describe it.

    Raises:
        OptionError: ``dataset`` is no dataset name (:func:`check_dataset_name`).
        FileFormatError: not an HDF5 file, no such dataset (or a group, or a
            null dataset with no shape), compressed by a filter HDF5 cannot
            load here, a non-numeric dtype, or speedswap
            attributes it never writes (a table dtype other than bfloat16
            over float32, a CRC-32 that is no number).
        MissingFileError, PathError: no such file, a directory, not a regular file, or no
            permission to read it.
    """
    check_dataset_name(dataset)
    h5py = _h5py()
    path = as_path(path)
    with open_h5(path) as f:
        if dataset not in f:
            raise FileFormatError(f"{path!r} has no dataset {dataset!r} (it has "
                                  f"{sorted(f.keys())}); pass dataset= to pick one")
        data = f[dataset]
        if not isinstance(data, h5py.Dataset):
            raise FileFormatError(f"{path!r}: {dataset!r} is an HDF5 {type(data).__name__}, not "
                                  f"a dataset; pass dataset= naming the array itself")
        shape, dtype = data.shape, data.dtype
        if shape is None:  # a null dataspace (h5py.Empty): an attribute-like placeholder, no array
            raise FileFormatError(f"{path!r}: {dataset!r} is an empty HDF5 dataset (no shape, no "
                                  f"values); pass dataset= naming the array itself")
        _check_filters(data, path, dataset)
        table_dtype = data.attrs.get(_TABLE_DTYPE_ATTR)
        crc32 = data.attrs.get(_CRC32_ATTR)
        version = file_version(os.fstat(f.id.get_vfd_handle()))  # the file open_h5 verified
    check_dtype(np.dtype(dtype), path)
    if table_dtype is None:
        table_dtype = table_dtype_of(np.dtype(dtype))
    elif _attr_text(table_dtype) == "bfloat16" and np.dtype(dtype) == np.float32:
        table_dtype = torch.bfloat16
    else:
        # Only what write_h5 records: believed over other data, it would read integers'
        # bits as bfloat16 values, or name no dtype at all.
        raise FileFormatError(f"{path!r}: {dataset!r} holds {np.dtype(dtype)} with {_TABLE_DTYPE_ATTR}="
                              f"{table_dtype!r}, which speedswap never writes (it records 'bfloat16' on "
                              f"float32 data only); the file is damaged or not speedswap's: delete "
                              f"the attribute to read the data as {np.dtype(dtype)}")
    if crc32 is not None:
        try:
            crc32 = int(crc32)
        except (TypeError, ValueError):
            raise FileFormatError(f"{path!r}: {dataset!r} has {_CRC32_ATTR}={crc32!r}, not the CRC-32 "
                                  f"speedswap records; the file is damaged or not speedswap's: delete "
                                  f"the attribute to read it unverified") from None
    return TableHeader(tuple(shape), np.dtype(dtype), table_dtype=table_dtype, crc32=crc32, version=version)


def _check_filters(data, path, dataset) -> None:
    """Raise FileFormatError when ``data`` was compressed by a filter HDF5 cannot load here.

    Its chunks would fail to read one by one, which says "corrupt" of a sound file.
    """
    h5py = _h5py()
    plist = data.id.get_create_plist()
    for index in range(plist.get_nfilters()):
        code, _, _, name = plist.get_filter(index)
        if not h5py.h5z.filter_avail(code):
            named = f" ({name.decode('utf-8', 'replace')})" if name else ""
            raise FileFormatError(f"{path!r}: {dataset!r} is compressed with HDF5 filter {code}{named}, which "
                                  f"HDF5 cannot load here; install its plugin (pip install hdf5plugin, then "
                                  f"import hdf5plugin before loading) or save the data without it")


def _attr_text(value):
    """An HDF5 string attribute as a str (h5py gives fixed-length strings as bytes), else ``value``."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


@contextlib.contextmanager
def open_h5(path):
    """Open an HDF5 file for reading, for a ``with`` block (h5py is imported only when HDF5 is used).

    What h5py raises inside the block (a damaged file opens, then fails when
    its attributes, names, types or rows are read: ``KeyError``, ``OSError``,
    ``RuntimeError``, ``TypeError``, ``ValueError``) becomes a :class:`FileFormatError`.
    A file speedswap sealed (:mod:`~speedswap.files.h5seal`) has its HDF5
    metadata verified first: HDF5 could hang or crash on a damaged one (and
    one it began to write but never sealed is refused). HDF5
    opens the file by its path again, so the file it opened must be the one
    verified, unchanged since (:func:`~speedswap.files.base.file_version`).

    Raises:
        MissingFileError, PathError: no such file, a directory, not a regular file
            (a named pipe), no permission to read it, or locked by a writer.
        FileFormatError: not a readable HDF5 file (truncated, damaged, another format,
            a speedswap save that never sealed it), or replaced or changed between the
            check of its seal and HDF5's open.
    """
    path = check_regular_file(path, "HDF5 file")
    try:
        # Held open until HDF5 has opened the path: the verified file's inode cannot be reused meanwhile.
        with open(path, "rb") as checked:
            verified = file_version(os.fstat(checked.fileno()))  # before the check reads: a write after it shows
            check_seal(checked, path)
            # sec2 whatever HDF5_DRIVER makes the default: its handle is the descriptor compared.
            f = _h5py().File(path, "r", driver="sec2")
            try:
                if file_version(os.fstat(f.id.get_vfd_handle())) != verified:
                    raise changed_error(path)
            except BaseException:
                f.close()
                raise
    except OSError as exc:
        if isinstance(exc, SpeedswapError):
            raise
        if exc.errno in (errno.EACCES, errno.EPERM):  # the file may be fine: its reader is not allowed
            raise opening_error(path, exc, "HDF5 file") from exc
        if "unable to lock file" in str(exc):  # fine too: HDF5 locks a file while it is written
            error = PathError(f"{path!r} could not be locked for reading ({exc.strerror or exc}): another "
                              f"process has it open for writing (close it there first), or the file system "
                              f"has no locks (set HDF5_USE_FILE_LOCKING=FALSE in the environment)")
            error.errno = exc.errno
            raise error from exc
        raise FileFormatError(f"{path!r} is not a readable HDF5 file ({exc}); it is truncated "
                              f"or not HDF5: write it with h5py or HostTable.save") from exc
    try:
        with f:
            yield f
    except SpeedswapError:
        raise
    except (KeyError, OSError, RuntimeError, TypeError, ValueError) as exc:
        # TypeError: a datatype numpy has no equivalent for (HDF5's time type, a damaged one).
        raise reading_error(path, exc) from exc


def read_before_replacing(path, read):
    """``read(f)`` of the HDF5 file ``path`` a save is about to replace, or None when it is not a readable one.

    A save first looks at what it would replace (another table's dataset, a
    file that is no checkpoint), holding :func:`~speedswap.atomic.one_save_at_a_time`
    over the look and its write, so that another speedswap save to the path
    on this host waits and looks at the file this one leaves. A file that
    changes under that look all the same (a writer without that lock: another
    machine, another tool) gives no answer: which file was read is unknown,
    and open_h5's refusal of it is no sign that it is not HDF5. Saying so is
    better than silently replacing what that writer wrote.

    Args:
        path: the existing file.
        read: what to learn from the open ``h5py.File``; what it raises from
            h5py reads as "not a readable HDF5 file", as in :func:`open_h5`.

    Returns:
        what ``read`` returned, or None: ``path`` is not a readable HDF5 file.

    Raises:
        PathError: ``path`` changed or was replaced while it was read; nothing was written.
        MissingFileError: ``path`` is gone, as :func:`open_h5` raises it.
    """
    before = _version_of(path)
    try:
        with open_h5(path) as f:
            found = read(f)
    except FileFormatError:
        found = None
    if _version_of(path) != before:
        raise PathError(f"{os.fspath(path)!r} changed or was replaced while this save checked it (another "
                        f"save to it at the same time?); nothing was written: save to one path from one "
                        f"writer at a time, then save again")
    return found


def _version_of(path) -> Optional[tuple]:
    """The :func:`~speedswap.files.base.file_version` of what ``path`` names now, or None for nothing there."""
    try:
        return file_version(os.stat(path))
    except OSError:
        return None


def read_h5_into(path, out, dataset, header=None, crc32: bool = False) -> Optional[int]:
    """Read dataset ``dataset`` into the C-contiguous array ``out``, in row chunks.

    Args:
        path: the HDF5 file.
        out: the array to fill.
        dataset: the dataset's name.
        header: its :func:`read_h5_header`, if read already.
        crc32: also compute the CRC-32 of ``out``'s bytes, each chunk's
            while the next one is read (:func:`~speedswap.files.base.crc32_behind`).

    Returns:
        that CRC-32, or None without ``crc32``.

    Raises:
        FileFormatError: the dataset's shape or dtype differ from ``out``'s, a chunk cannot be read,
            or the file was changed or replaced since ``header`` was read from it.
    """
    header = header or read_h5_header(path, dataset)
    check_matches(header, out.shape, out.dtype, path)
    with open_h5(path) as f:
        base.check_version(header, f.id.get_vfd_handle(), path)
        data = f[dataset]

        def chunks():
            for start, stop in row_ranges(out.shape, out.dtype):
                try:
                    data.read_direct(out, np.s_[start:stop], np.s_[start:stop])
                except OSError as exc:  # a corrupt (compressed) chunk
                    raise reading_error(path, exc) from exc
                yield out[start:stop]
        if crc32:
            return crc32_behind(chunks())
        for _ in chunks():
            pass
        return None


def write_h5(path, datasets, attrs=None, table_dtypes=None):
    """Atomically write one HDF5 file holding several datasets, sealed (:mod:`~speedswap.files.h5seal`).

    Each dataset records the CRC-32 of its bytes, for a read to verify
    (:attr:`TableHeader.crc32`): the seal leaves the rows to it.

    Args:
        path: the target file.
        datasets: ``{name: (shape, dtype, chunks)}`` with chunks as in
            :func:`~speedswap.files.npy.write_npy`.
        attrs: optional ``{name: value}`` stored on the file's root.
        table_dtypes: optional ``{name: torch dtype}`` recorded on datasets
            whose table dtype is not the stored one (bfloat16).

    Raises:
        OptionError: a name that is no dataset name (:func:`check_dataset_name`);
            nothing is written.
        PathError: the directory does not exist, or the file system refused
            the write or the close (full, read-only, over the file-size
            limit); any previous file at ``path`` is intact.
    """
    for name in datasets:
        check_dataset_name(name)
    h5py = _h5py()
    userblock = userblock_size(len(datasets) + 1)  # each dataset's rows, and the consistency flags
    with atomic_output(path) as tmp:
        # The earliest file format, h5py's default today, pinned: its superblock (version 0)
        # is one whose consistency flags the seal knows to leave out (_consistency_flags).
        f = h5py.File(tmp, "w", userblock_size=userblock, libver="earliest")
        spans = []
        try:
            for name, (shape, dtype, chunks) in datasets.items():
                data = f.create_dataset(name, shape=tuple(shape), dtype=np.dtype(dtype))
                if (table_dtypes or {}).get(name) is torch.bfloat16:
                    data.attrs[_TABLE_DTYPE_ATTR] = "bfloat16"
                start, crc = 0, 0
                for chunk in chunks:
                    base.write_chunk(data, start, chunk)
                    start += len(chunk)
                    crc = base.crc32_of(chunk, crc)
                data.attrs[_CRC32_ATTR] = np.uint32(crc)
                if data.id.get_offset() is not None:  # contiguous, allocated: its rows lie there
                    spans.append((data.id.get_offset(), data.id.get_storage_size()))
            for key, value in (attrs or {}).items():
                f.attrs[key] = value
        except BaseException:
            # After a failed write (a full disk, a file-size limit) closing fails too, with
            # a RuntimeError that would hide the write's OSError: the file is discarded
            # anyway, so the close's own error is dropped.
            with contextlib.suppress(Exception):
                f.close()
            raise
        try:
            f.close()  # writes the metadata: the disk can fill up here as well
        except RuntimeError as exc:
            raise _file_system_error(exc) from exc
        seal(tmp, spans + _consistency_flags(tmp, userblock))


def _consistency_flags(path, userblock) -> list:
    """``[(offset, size)]`` of the consistency flags of the superblock at ``userblock`` in ``path``, if any.

    HDF5 sets them in place when a writer opens the file (and clears them when
    it closes it): a file merely opened for writing elsewhere, or left so by a
    writer that was killed, still holds what was saved, so the seal leaves
    them out. Superblocks of version 0 and 1 keep them in 4 bytes of their own;
    :func:`write_h5` writes version 0 (``libver="earliest"``). Versions 2
    and 3 (``libver="v108"`` and later, SWMR) keep them in one byte under the
    superblock's own checksum, which that open rewrites too: were one sealed,
    nothing would be left out, and a file a writer was killed holding (where
    HDF5 itself refuses a version 3 one, "file is already open for write")
    would read as damaged.
    """
    with open(path, "rb") as f:
        f.seek(userblock)
        head = f.read(len(SUPERBLOCK) + 1)
    if head[:len(SUPERBLOCK)] == SUPERBLOCK and head[len(SUPERBLOCK):] in (b"\0", b"\1"):
        return [(userblock + _FLAGS_AT, 4)]
    return []


def _file_system_error(exc: RuntimeError) -> OSError:
    """The OSError an HDF5 ``RuntimeError`` stands for, with the errno HDF5 put in its message.

    HDF5 reports a failed write at close ("unable to extend file properly,
    errno = 28") as a RuntimeError; :func:`~speedswap.atomic.atomic_output`
    turns OSErrors into a :class:`~speedswap.PathError` naming the user's path.
    """
    found = re.search(r"errno = (\d+)", str(exc))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, os.strerror(code))
