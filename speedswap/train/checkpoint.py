"""Checkpoints of several tables at once: one HDF5 file, or a directory of ``.npy`` files.

A model's table and its optimizer state tables must be saved and restored
together: a checkpoint whose table is from step 1000 and whose Adam moments are
from step 900 silently trains wrong. So must the optimizer's scalar state for
them (Adam's step count, which its bias correction follows): it is stored as
the attribute ``optimizer_scalar_state`` (JSON text) and restored with the
tables. Both formats are therefore all-or-nothing:

* ``*.h5`` / ``*.hdf5``: one file with a dataset per table, written through
  :func:`speedswap.files.write_h5` (temporary file, fsync, rename). It
  replaces only an earlier checkpoint, never another HDF5 file.
* a path with no suffix: a directory. Each save writes a complete new version
  ``v000007/`` (``<name>.npy`` per table and a ``checkpoint.json`` manifest with
  a CRC-32 per table and which tables are bfloat16) under a temporary name,
  renames it into place, and only then replaces the one-line pointer file
  ``CURRENT`` atomically; older versions are removed after that (an interrupt
  during that cleanup goes on with a note that the save completed). Whenever the
  process dies, ``CURRENT`` names a whole version: the old one or the new one;
  a save that fails or is interrupted removes the version it wrote. The first
  save builds the whole directory under a temporary name and renames it to ``path``.

Loading reads every header, checks names, shapes and dtypes, then reads and
verifies every row of every table (CRC-32, readable chunks) before the first
table changes; an HDF5 file replaced by a save in the meantime is refused.
A table too large to stage in RAM is read twice: verified first, then read
again into the table, chunk by chunk, each chunk checked against the CRC-32
the verification recorded (see :class:`~speedswap.files.StagedRows`).
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
from typing import Callable, Optional

import numpy as np
import torch

from .. import atomic, files
from ..backends import available_ram
from ..errors import (FileFormatError, MissingFileError, OptionError, PathError,
                      SpeedswapError)
from ..table import loading_into
from .module_state import SCALAR_STATE  # the state dict names the record as the files do
from .sharded_checkpoint import MANIFEST as SHARDED_MANIFEST

__all__ = ["save_tables", "load_tables", "file_in", "checkpoint_kind", "current_version"]

_MANIFEST = "checkpoint.json"
_POINTER = "CURRENT"
_VERSION = re.compile(r"v(\d{6,})")
_FORMAT = "speedswap-checkpoint-1"


def file_in(directory, name, storage):
    """The ``.npy`` file of table ``name`` when ``storage`` is ``mmap``, else None.

    An embedding and its optimizer state keep their ``mmap`` tables as
    ``<name>.npy`` files of one directory, which is created if needed.

    Args:
        directory: the directory for the files (an embedding's ``path``).
        name: the table's name (``"table"``, ``"exp_avg"``, ...).
        storage: the storage kind.

    Returns:
        ``directory/<name>.npy``, or None for any storage but ``mmap``.

    Raises:
        OptionError: ``mmap`` storage without a directory, or a directory
            for any other storage (which would be ignored).
        PathError: ``directory`` is a file, would create a directory named
            like a file (``emb.npy``), or cannot be created.
    """
    directory = None if directory is None else atomic.as_path(directory)
    if storage != "mmap":
        if directory is not None:
            raise OptionError(f"path={os.fspath(directory)!r} is where storage='mmap' keeps its files; "
                              f"storage={storage!r} keeps the tables in memory and writes none: drop "
                              f"path, or use storage='mmap'")
        return None
    if directory is None:
        raise OptionError("storage='mmap' keeps the table and optimizer state in files: pass "
                          "path= a directory for them")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise PathError(f"path={os.fspath(directory)!r} is a file, but storage='mmap' keeps the table "
                        f"and optimizer state as .npy files in a directory; pass a directory")
    made = os.path.abspath(os.fspath(directory))
    while not os.path.exists(made):  # each directory os.makedirs will create, innermost first
        # path='emb.npy' reads as the table's own file; a directory of that name would
        # leave the user looking for a file that is not there.
        if files.suffix_format(made) is not None:
            named = os.path.basename(made)
            raise PathError(f"path={os.fspath(directory)!r} would create a directory named {named!r}, "
                            f"which is a file's name: path is the directory where storage='mmap' keeps "
                            f"table.npy and the optimizer state files; pass a directory, such as "
                            f"{os.path.splitext(named)[0]!r} instead of {named!r}")
        made = os.path.dirname(made)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise PathError(f"cannot create the directory {os.fspath(directory)!r} for the mmap files "
                        f"({exc.strerror}); pass a writable directory") from exc
    return os.path.join(os.fspath(directory), f"{name}.npy")


def checkpoint_kind(path) -> str:
    """``"h5"`` for ``*.h5`` / ``*.hdf5``, ``"dir"`` for a path with no suffix.

    Raises:
        OptionError: any other suffix (``emb.pt`` is not a directory name
            anyone expects): say which format is meant; for a torch file
            (``*.pt`` / ``*.pth``), how torch checkpoints are written and read;
            for ``*.npy`` (one table), the ``.h5`` and directory names to use.
    """
    fmt = files.suffix_format(path)
    if fmt == "h5":
        return "h5"
    suffix = os.path.splitext(os.fspath(path))[1]
    if fmt is None and (not suffix or os.path.isdir(path)):
        return "dir"
    formats = ("a checkpoint is *.h5 / *.hdf5 (one HDF5 file) or a path with no suffix (a directory "
               "of .npy files); *.npy is the table alone (an export)")
    if fmt == "npy":
        # An OffloadedEmbedding's save and load take *.npy (its table alone) before asking here;
        # what asks is an OptimizerFactory, whose state may be one table (Adagrad's): what a .npy
        # file cannot hold is the optimizer's name beside it.
        stem = os.path.splitext(os.fspath(path))[0]
        raise OptionError(f"{os.fspath(path)!r} names a .npy file, which holds one array and nothing "
                          f"beside it, but this checkpoint holds the optimizer state's tables (one per "
                          f"state tensor) and the name of the optimizer they belong to, which a load "
                          f"checks: name one HDF5 file (*.h5 / *.hdf5, such as {stem + '.h5'!r}) or a "
                          f"directory (no suffix, such as {stem!r})")
    if suffix.lower() in (".pt", ".pth"):
        raise OptionError(f"{os.fspath(path)!r} is a torch file, which this save/load does not write or "
                          f"read ({formats}). A torch checkpoint is written with "
                          f"torch.save(model.state_dict(), path) and read with "
                          f"model.load_state_dict(torch.load(path)) (an optimizer's with "
                          f"optimizer.load_state_dict(torch.load(path))): an OffloadedEmbedding's "
                          f"state dict holds its table and optimizer state rows, while an "
                          f"OptimizerFactory's state tables are kept only by its save()")
    raise OptionError(f"cannot tell the checkpoint format of {os.fspath(path)!r}: {formats}")


def current_version(path):
    """The directory holding the tables of the directory checkpoint ``path``.

    Raises:
        MissingFileError: no checkpoint at ``path``.
        FileFormatError: ``path`` is not a speedswap checkpoint directory (or is
            a sharded one, read by :func:`~speedswap.train.sharded_checkpoint.load_sharded`).
    """
    path = atomic.as_path(path)
    if not os.path.isdir(path):
        if os.path.exists(path):
            raise PathError(f"{path!r} is a file; a directory checkpoint was expected")
        # A path with no suffix names a directory: emb.load("vectors") after emb.save("vectors.npy")
        # found no directory, and said only that.
        beside = [path + suffix for suffix in (".npy", ".h5", ".hdf5") if os.path.isfile(path + suffix)]
        hint = (f"; a path with no suffix names a directory checkpoint, and {beside[0]!r} is a file: "
                f"load that path, suffix included" if beside else "; check the path")
        if os.path.isfile(os.path.join(path + ".old", _MANIFEST)):
            hint = (f"; an interrupted save of an older speedswap left the previous checkpoint "
                    f"at {path + '.old'!r}: rename it to {path!r}")
        raise MissingFileError(2, f"no checkpoint at {path!r}{hint}", path)
    pointer = os.path.join(path, _POINTER)
    if os.path.isfile(pointer):
        name = _pointed_to(path)
        if name is None or not _VERSION.fullmatch(name) or not os.path.isdir(os.path.join(path, name)):
            named = "no version (it is not text)" if name is None else f"{name!r}"
            raise FileFormatError(f"{pointer!r} names {named}, which is not a version of this "
                                  f"checkpoint; the directory was changed by hand: write the name "
                                  f"of one of its v###### directories into it, or restore it")
        return os.path.join(path, name)
    if os.path.isfile(os.path.join(path, _MANIFEST)):
        return path  # a checkpoint written before versions existed
    if os.path.isfile(os.path.join(path, SHARDED_MANIFEST)):
        raise FileFormatError(f"{path!r} is the checkpoint of a ShardedOffloadedEmbedding (it has "
                              f"{SHARDED_MANIFEST}): load it with ShardedOffloadedEmbedding.load, or "
                              f"into one OffloadedEmbedding with ss.load_sharded(path, emb)")
    raise FileFormatError(f"{path!r} has no {_POINTER} or {_MANIFEST}: it is not a speedswap "
                          f"checkpoint directory")


def _pointed_to(path):
    """The version ``path/CURRENT`` names, or None when it is missing or unreadable text."""
    try:
        with open(os.path.join(path, _POINTER), encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):  # a binary CURRENT names no version either
        return None


def _ours(path):
    """Whether the existing directory ``path`` is a checkpoint, or holds nothing but the
    debris of one (empty, versions never pointed to, temporaries and locks of killed saves)."""
    entries = os.listdir(path)
    if _POINTER in entries or _MANIFEST in entries:
        return True
    return all(_VERSION.fullmatch(e) or atomic.is_temporary(e) for e in entries)


def _write_version(directory, tables, attrs):
    """Write every table and the manifest (with CRC-32s) into the new directory ``directory``.

    The directory is a version written aside, which an interrupt removes: its
    files' interrupts get no note that they were saved (``note_interrupt``).
    """
    checksums = {name: files.write_npy(os.path.join(directory, f"{name}.npy"), table.shape,
                                       files.stored_dtype(table.dtype), table.host_chunks(),
                                       checksum=True, note_interrupt=False)
                 for name, table in tables.items()}
    # Stored as float32 (exact): only the manifest can say a table was bfloat16, and
    # a load into a float32 table is then refused as it is from an HDF5 checkpoint.
    dtypes = {name: "bfloat16" for name, table in tables.items() if table.dtype is torch.bfloat16}
    manifest = {"attrs": attrs, "tables": sorted(tables), "crc32": checksums, "dtypes": dtypes}
    text = json.dumps(manifest).encode()
    with atomic.atomic_output(os.path.join(directory, _MANIFEST), note_interrupt=False) as tmp, open(tmp, "wb") as f:
        files.base.write_chunk(f, 0, np.frombuffer(text, dtype=np.uint8))


def _save_dir(path, tables, attrs):
    path = os.path.abspath(atomic.as_path(path))
    atomic.check_writable_dir(path)
    # Two saves of one checkpoint at once would each remove the version the other is about
    # to point CURRENT at, and a load meanwhile would find its version gone: a save holds the
    # checkpoint exclusively (its parent while the first save creates it), loads share it.
    while True:
        if os.path.exists(path):
            with atomic.locked(path) if os.path.isdir(path) else contextlib.nullcontext():
                return _save_version(path, tables, attrs)
        with atomic.locked(os.path.dirname(path)):
            if not os.path.exists(path):  # else another save created it meanwhile: a new version
                return _save_first(path, tables, attrs)


def _save_first(path, tables, attrs):
    """The first save builds the whole directory aside and renames it into place."""
    atomic.remove_stale_temporaries(path)
    staging = atomic.temp_path(path)
    os.mkdir(staging)
    try:
        os.mkdir(os.path.join(staging, "v000001"))
        _write_version(os.path.join(staging, "v000001"), tables, attrs)
        _write_pointer(staging, "v000001")
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic.fsync_dir(os.path.dirname(path))


def _save_version(path, tables, attrs):
    """A new version of the existing checkpoint ``path``, then ``CURRENT`` pointed at it."""
    atomic.remove_stale_temporaries(path)
    if not os.path.isdir(path) or not _ours(path):
        raise PathError(f"{path!r} exists and is not a speedswap checkpoint directory; "
                        f"refusing to replace it: choose another path")
    if any(os.path.isfile(os.path.join(path, f)) for f in (_POINTER, _MANIFEST)):
        current_version(path)  # a CURRENT changed by hand is refused, not saved over
    # Above every version present, so a version a killed save left unpointed is never reused.
    numbers = [int(m.group(1)) for m in map(_VERSION.fullmatch, os.listdir(path)) if m]
    name = f"v{max(numbers, default=0) + 1:06d}"
    final = os.path.join(path, name)
    atomic.remove_stale_temporaries(final)
    staging = atomic.temp_path(final)
    os.mkdir(staging)
    try:
        _write_version(staging, tables, attrs)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    with _noting_a_commit(path, name):
        try:
            atomic.fsync_dir(path)
            _write_pointer(path, name)  # the commit point
        except BaseException:
            # CURRENT decides which version the failure left as the checkpoint: the other
            # is a whole copy of the tables nothing will read, so it goes now, not at the
            # next save (after a full disk the user would otherwise be short of that space).
            if _pointed_to(path) == name:
                _remove_old_versions(path, name)
            else:
                shutil.rmtree(final, ignore_errors=True)
            raise
        _remove_old_versions(path, name)


@contextlib.contextmanager
def _noting_a_commit(path, name):
    """Let what stops a save after its commit go on, with a note that the save happened.

    Once ``CURRENT`` names the new version ``name``, only cleanup is left
    (syncing the directory, removing the older versions), which raises
    nothing but an interrupt (Ctrl-C) or the like. That must not be
    swallowed, but bare it reads as a save that failed, and the caller may
    retry or give up on a checkpoint that is in place: the note (Python 3.11+)
    says so. Whatever the cleanup left, loads do not read and the next save removes.
    """
    try:
        yield
    except BaseException as exc:
        if hasattr(exc, "add_note") and _pointed_to(path) == name:
            exc.add_note(f"speedswap: the save of {path!r} had completed when this {type(exc).__name__} "
                         f"came: CURRENT names the new version {name}, which loads read; only the cleanup "
                         f"after it was cut short, and the next save removes the older versions it left")
        raise


def _write_pointer(directory, name):
    # No note of atomic_output's: in a first save's directory written aside, an interrupt removes
    # it; over a checkpoint, _noting_a_commit says what the interrupt left.
    with atomic.atomic_output(os.path.join(directory, _POINTER), note_interrupt=False) as tmp, open(tmp, "wb") as f:
        files.base.write_chunk(f, 0, np.frombuffer(f"{name}\n".encode(), dtype=np.uint8))


def _remove_old_versions(path, keep):
    """Remove versions other than ``keep`` (and the files of a pre-version checkpoint).

    After the commit a failure here only leaves files behind (the next save
    removes them): it never raises. ``ignore_errors`` is not enough for that:
    CPython 3.11's ``rmtree`` calls its first ``os.fstat`` outside its error handler.
    """
    with contextlib.suppress(OSError):
        for entry in os.listdir(path):
            if _VERSION.fullmatch(entry) and entry != keep:
                with contextlib.suppress(OSError):
                    shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
    _remove_pre_version_files(path)


def _remove_pre_version_files(path):
    """Remove the files of a checkpoint written before versions, once ``CURRENT`` names a version.

    Such a checkpoint kept ``checkpoint.json`` and one ``<name>.npy`` per table
    at the top of ``path``. Only the files its manifest names are removed (the
    user's own files beside them stay), and the manifest goes last: a removal
    cut short (Ctrl-C) leaves it naming what is left, which the next save removes.
    """
    manifest = os.path.join(path, _MANIFEST)
    try:
        with open(manifest) as f:
            content = json.load(f)
        _check_manifest(content)
    except (OSError, ValueError, KeyError, TypeError):
        return  # none, or one that names nothing for sure: nothing is removed
    # A name with a separator would reach outside the checkpoint: no save wrote one.
    tables = [os.path.join(path, f"{name}.npy") for name in content["tables"] if os.path.basename(name) == name]
    for table in tables:
        with contextlib.suppress(OSError, ValueError):  # ValueError: a NUL in a hand-edited name
            os.unlink(table)
    if not any(os.path.lexists(table) for table in tables):
        with contextlib.suppress(OSError):
            os.unlink(manifest)


def _check_replaceable_h5(path):
    """Raise PathError when ``path`` is a file other than a speedswap HDF5 checkpoint.

    A directory checkpoint refuses to replace a directory that is not one; an
    HDF5 checkpoint must not replace someone's data file either.
    """
    if not os.path.isfile(path):
        return  # nothing there (a directory is refused by the writer itself)
    # bool(): an attribute damaged into an array reads as "not a readable HDF5 file".
    found = files.read_before_replacing(path, lambda f: (bool(f.attrs.get("format") == _FORMAT), sorted(f.keys())))
    if found is not None and found[0]:
        return
    what = "not a readable HDF5 file" if found is None else f"an HDF5 file with datasets {found[1]}"
    raise PathError(f"{os.fspath(path)!r} exists and is not a speedswap checkpoint ({what}); "
                    f"refusing to replace it: choose another path, or delete the file first "
                    f"if it is yours to lose")


def save_tables(path, tables, attrs, row_state=None):
    """Write ``tables`` to one checkpoint atomically.

    Each table is read (:meth:`~speedswap.HostTable.host_chunks`, whose
    ``watch_reads`` method has an owner's device cache write its rows back)
    only once the path passed every check below: a refused save leaves the
    owners' caches as they were.

    Args:
        path: ``*.h5`` / ``*.hdf5`` for one HDF5 file; a path with no suffix is a directory.
        tables: ``{name: HostTable}``.
        attrs: ``{key: str or int}`` stored beside the tables and checked by
            :func:`load_tables` (the optimizer's class, for example).
        row_state: the :class:`~speedswap.train.row_state.RowState` whose
            tables are among ``tables``: the optimizer's scalar state for them
            (the step count) is stored too, for :func:`load_tables` to restore.

    Raises:
        OptionError: a path with another suffix.
        PathError: ``path`` is an existing file or directory that is not a
            speedswap checkpoint (it is never replaced), an HDF5 file that
            changed while the save checked it (by a writer other than a
            speedswap save of this host, which waits its turn), its parent
            directory does not exist, or the file system
            refused the write (whatever ``path`` held before is intact).
        FileFormatError: a checkpoint directory whose ``CURRENT`` was changed by hand.
    """
    attrs = {"format": _FORMAT, **attrs}
    if row_state is not None:
        attrs[SCALAR_STATE] = json.dumps(row_state.scalar_state())
    if checkpoint_kind(path) == "h5":
        with atomic.one_save_at_a_time(path):  # the check and the write: another save to path waits for both
            _check_replaceable_h5(path)
            files.write_h5(path, {name: (t.shape, files.stored_dtype(t.dtype), t.host_chunks())
                                  for name, t in tables.items()}, attrs,
                           table_dtypes={name: t.dtype for name, t in tables.items()})
        return
    try:
        _save_dir(path, tables, attrs)
    except OSError as exc:
        # A file inside the new version failed: report the checkpoint's path
        # and the root cause, never the hidden temporary it was written to.
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        if isinstance(cause, SpeedswapError):
            raise  # a refusal that already names the path
        raise atomic.saving_error(path, cause) from exc


def _check_manifest(content):
    """Raise ValueError unless ``content`` has the structure :func:`_write_version` writes."""
    if not isinstance(content, dict):
        raise ValueError(f"a JSON object was expected, not {type(content).__name__}")
    kinds = {"attrs": dict, "tables": list, "crc32": dict, "dtypes": dict}
    for key, kind in kinds.items():
        if key in content and not isinstance(content[key], kind):
            raise ValueError(f"{key!r} is a {type(content[key]).__name__}, not a {kind.__name__}")
    if not all(isinstance(name, str) for name in content["tables"]):
        raise ValueError("'tables' holds something else than names")
    if not all(isinstance(crc, int) for crc in content.get("crc32", {}).values()):
        raise ValueError("'crc32' holds something else than integers")
    if set(content.get("dtypes", {}).values()) - {"bfloat16"}:
        raise ValueError(f"'dtypes' names {sorted(set(content['dtypes'].values()))}; only "
                         f"'bfloat16' is recorded")


def _read_manifest(path):
    """``(attrs, {name: (source file, dataset, crc32 or None, bfloat16?)})`` of a checkpoint."""
    if checkpoint_kind(path) == "h5":
        with files.open_h5(path) as f:
            attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
            # read_h5_header reads a bfloat16 table's dtype, and its CRC-32, from its dataset.
            return attrs, {name: (os.fspath(path), name, None, False) for name in f.keys()}
    version = current_version(path)
    manifest = os.path.join(version, _MANIFEST)
    try:
        with open(manifest) as f:
            content = json.load(f)
        attrs, names = content["attrs"], content["tables"]
        _check_manifest(content)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FileFormatError(f"{manifest!r} is not a valid checkpoint manifest ({exc}); the "
                              f"checkpoint was changed by hand: restore it from a backup") from exc
    crcs, dtypes = content.get("crc32", {}), content.get("dtypes", {})
    return attrs, {name: (os.path.join(version, f"{name}.npy"), "table", crcs.get(name),
                          dtypes.get(name) == "bfloat16")
                   for name in names}


def _check_same_file(path, held):
    """Raise FileFormatError unless ``path`` still names the file open as ``held`` (a descriptor).

    A save replaces an HDF5 checkpoint by renaming a new file over it. The file
    is opened by name for every table read, so one replaced midway would give
    a table from one save and optimizer state from the next. Holding the
    original open keeps its inode from being reused, so the same identity at
    the end proves every read saw that one file.
    """
    try:
        same = files.identity(os.stat(path)) == files.identity(os.fstat(held))
    except OSError:
        same = False
    if not same:
        raise FileFormatError(f"{os.fspath(path)!r} was replaced while it was being loaded (a save "
                              f"to it in another process?); nothing was loaded: load it again")


def _check_attrs(path, stored, attrs):
    """Raise FileFormatError unless the checkpoint's attributes ``stored`` equal ``attrs``."""
    # An HDF5 attribute whose dataspace was damaged reads as an array, which == compares element-wise.
    arrays = sorted(key for key in ("format", *attrs) if isinstance(stored.get(key), np.ndarray))
    if arrays:
        raise FileFormatError(f"{os.fspath(path)!r}: the attributes {arrays} hold arrays, where speedswap "
                              f"stores one value each: the checkpoint is damaged; restore it from a backup")
    if stored.get("format") != _FORMAT:
        raise FileFormatError(f"{os.fspath(path)!r} is not a speedswap checkpoint (no format "
                              f"{_FORMAT!r}): a table file written by HostTable.save or a "
                              f"ModelFactory's save holds one table; load it into a table with "
                              f"table.load_from(path) (emb.table.load_from for an embedding)")
    for key, value in attrs.items():
        saved = stored.get(key)
        if key == "optimizer" and saved != value:
            if not saved:
                raise FileFormatError(f"{os.fspath(path)!r} holds no optimizer state (it was saved "
                                      f"before attach), but {value} is attached here; load it "
                                      f"before attach(optimizer), which starts fresh state")
            here = f"{value} is attached here" if value else "no optimizer is attached here"
            raise FileFormatError(f"{os.fspath(path)!r} holds {saved} optimizer state, "
                                  f"but {here}; load it where a torch.optim.{saved} is "
                                  f"attached: a checkpoint restores rows and optimizer state together")
        if saved != value:
            raise FileFormatError(f"{os.fspath(path)!r} was saved with {key}={saved!r}, but this "
                                  f"one has {key}={value!r}; a checkpoint restores only the setup "
                                  f"that wrote it")


def _saved_scalar_state(path, stored, row_state):
    """The checked scalar state the checkpoint's attributes ``stored`` hold for ``row_state``
    (:meth:`RowState.check_scalar_state`), None when an older speedswap saved none."""
    text = stored.get(SCALAR_STATE)
    if text is None:
        return None
    try:
        saved = json.loads(text)
    except (TypeError, ValueError):  # TypeError: an attribute damaged into another type
        saved = text
    return row_state.check_scalar_state(saved, repr(os.fspath(path)))


def _stage_all(path, tables, attrs, row_state):
    """Check a checkpoint against ``tables``, ``attrs`` and ``row_state`` and read every row.

    Returns:
        ``({name: StagedRows}, the scalar state for row_state)``.
    """
    stored_attrs, sources = _read_manifest(path)
    _check_attrs(path, stored_attrs, attrs)
    scalars = None if row_state is None else _saved_scalar_state(path, stored_attrs, row_state)
    if set(sources) != set(tables):
        # key=str: h5py lists a name that is not UTF-8 (a damaged one) as bytes, beside str names.
        raise FileFormatError(f"{os.fspath(path)!r} holds tables {sorted(sources, key=str)}, expected "
                              f"{sorted(tables)}; was it saved by another model or optimizer?")
    headers = {}
    for name, table in tables.items():
        source, dataset, _, bfloat16 = sources[name]
        if files.suffix_format(source) == "h5":
            header = files.read_h5_header(source, dataset)
        else:
            header = files.read_npy_header(source)
            if bfloat16 and header.dtype == np.float32:
                header = dataclasses.replace(header, table_dtype=torch.bfloat16)
        if tuple(header.shape) != tuple(table.shape):
            # Named by the user's path, not a version's inner file, and fixed by the object that
            # saved it: the files layer's own advice (HostTable.load) loads no checkpoint.
            saved, own = (" x ".join(map(str, shape)) for shape in (header.shape, table.shape))
            rows = " rows of ".join(map(str, header.shape))
            raise FileFormatError(f"{os.fspath(path)!r} holds a {saved} table, but this one is "
                                  f"{own}; build the embedding (or switchers) with {rows}, as the "
                                  f"one that saved it")
        files.check_table_matches(header, table.shape, table.dtype, source)
        headers[name] = header
    staged = {}
    for name, table in tables.items():  # RAM is asked again: earlier stagings took some
        source, dataset, crc32, _ = sources[name]
        staged[name] = files.stage_table(source, headers[name], dataset, table.dtype,
                                         available_ram(), crc32=crc32)
    return staged, scalars


def load_tables(path, tables, attrs, before_writes: Optional[Callable[[], None]] = None, row_state=None):
    """Read a checkpoint written by :func:`save_tables` into ``tables``, all or nothing.

    Every header is checked, then every row of every table is read and
    verified into staging (:func:`~speedswap.files.stage_table`), and only then
    are the tables written: on any error no table changes. An HDF5 checkpoint
    replaced by a save while it is read is refused (the tables would come
    from two saves); a directory checkpoint reads one version throughout.

    A table too large to stage in RAM is read again when it is written. Before
    the first table changes, every such file must still be the one verified,
    unchanged (identity, size, change times), or nothing is loaded; each
    chunk read again must match the CRC-32 verified before it is written.
    Only a read error or a writer changing a file *during* the writes can
    then stop the load midway: that error names the tables and rows already
    replaced. After any stop midway (that, Ctrl-C, out of memory) every table
    refuses use until a load completes (:func:`~speedswap.table.loading_into`).

    Args:
        path: as given to :func:`save_tables`.
        tables: ``{name: HostTable}`` to fill; the checkpoint must hold exactly these names.
        attrs: ``{key: value}`` the checkpoint's attributes must equal.
        before_writes: called once every table was read and verified, just
            before the first one changes (a device cache writes its rows back
            and drops them there): a refused load never reaches it.
        row_state: the :class:`~speedswap.train.row_state.RowState` whose
            tables are among ``tables``: once they are loaded, the optimizer
            gets the scalar state saved with them (checked with the headers;
            see :meth:`~speedswap.train.row_state.RowState.restore_scalar_state`
            for a checkpoint that holds none).

    Raises:
        MissingFileError: no such file or directory.
        FileFormatError: not a speedswap checkpoint, other tables, other
            attributes, a table of another shape or dtype (a bfloat16 table's
            checkpoint into a float32 table included), a damaged record of
            the optimizer's scalar state, a corrupt file, an HDF5 file
            replaced during the load, or a file too large to stage
            in RAM changed since it was verified.
    """
    if checkpoint_kind(path) == "dir" and os.path.isdir(path):
        # A save meanwhile would remove the version read here: it waits (see _save_dir).
        with atomic.locked(path, shared=True):
            return _load_tables(path, tables, attrs, before_writes, row_state)
    return _load_tables(path, tables, attrs, before_writes, row_state)


def _load_tables(path, tables, attrs, before_writes, row_state):
    opened = []  # an HDF5 file's descriptor, from its opening (atomic.open_into): closed whatever comes
    try:
        if checkpoint_kind(path) == "h5":
            with contextlib.suppress(OSError):  # the reads below say what is wrong with the path
                atomic.open_into(opened, path, os.O_RDONLY)
        held = opened[0] if opened else None
        try:
            staged, scalars = _stage_all(path, tables, attrs, row_state)
        except FileFormatError:
            if held is not None:  # a file saved over meanwhile explains what the reads found
                _check_same_file(path, held)
            raise
        if held is not None:
            _check_same_file(path, held)
        for rows in staged.values():  # every table's file as verified, before the first table changes
            rows.check_unchanged()
    finally:
        if opened:
            os.close(opened[0])
    if before_writes is not None:
        before_writes()
    loaded = []
    with loading_into(tables.values(), path):
        for name, table in tables.items():  # the commit: rows staged in RAM cannot fail; see above
            try:
                staged[name].commit(table)
            except FileFormatError as exc:
                if not loaded:
                    raise
                # The error speaks of its own file; the tables before it already hold the checkpoint's
                # rows, beside the others' own: training on would mix two states.
                raise FileFormatError(f"{exc}. The tables {loaded} were loaded from {os.fspath(path)!r} "
                                      f"before it, the others were not: load an intact checkpoint before "
                                      f"training on") from exc
            loaded.append(name)
        if row_state is not None:
            row_state.restore_scalar_state(scalars)
