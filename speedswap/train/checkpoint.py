"""Checkpoints of several tables at once: one HDF5 file, or a directory of ``.npy`` files.

A model's table and its optimizer state tables must be saved and restored
together: a checkpoint whose table is from step 1000 and whose Adam moments are
from step 900 silently trains wrong. Both formats are therefore all-or-nothing:

* ``*.h5`` / ``*.hdf5``: one file with a dataset per table, written through
  :func:`speedswap.files.write_h5` (temporary file, fsync, rename).
* any other path: a directory holding ``<name>.npy`` per table and a
  ``checkpoint.json`` manifest. It is written complete into a temporary
  sibling directory, then swapped in with two renames; should the process die
  between them, the previous checkpoint is left whole at ``<path>.old``.

Loading reads every header and checks names, shapes and dtypes against the
tables before any row is read.
"""

import contextlib
import json
import os
import shutil
import tempfile

import numpy as np

from .. import files
from ..errors import FileFormatError, OptionError

__all__ = ["save_tables", "load_tables", "file_in"]

_MANIFEST = "checkpoint.json"


def file_in(directory, name, storage):
    """The ``.npy`` file of table ``name`` when ``storage`` is ``mmap``, else None.

    An embedding and its optimizer state keep their ``mmap`` tables as
    ``<name>.npy`` files of one directory, which is created if needed.

    Raises:
        OptionError: ``mmap`` storage without a directory.
    """
    if storage != "mmap":
        return None
    if directory is None:
        raise OptionError("storage='mmap' keeps the table and optimizer state in files: pass "
                          "path= a directory for them")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(os.fspath(directory), f"{name}.npy")
_FORMAT = "speedswap-checkpoint-1"


def save_tables(path, tables, attrs):
    """Write ``tables`` to one checkpoint atomically.

    Args:
        path: ``*.h5`` / ``*.hdf5`` for one HDF5 file; any other path is a directory.
        tables: ``{name: HostTable}``.
        attrs: ``{key: str or int}`` stored beside the tables and checked by
            :func:`load_tables` (the optimizer's class, for example).

    Raises:
        FileFormatError: ``path`` is an existing directory that is not a
            speedswap checkpoint (it is never replaced).
    """
    attrs = {"format": _FORMAT, **attrs}
    if _is_h5(path):
        files.write_h5(path, {name: (t.shape, files.stored_dtype(t.dtype), t.host_chunks())
                              for name, t in tables.items()}, attrs,
                       table_dtypes={name: t.dtype for name, t in tables.items()})
        return
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isfile(os.path.join(path, _MANIFEST)):
        raise FileFormatError(f"{path!r} exists and is not a speedswap checkpoint directory; "
                              f"refusing to replace it: choose another path")
    parent = os.path.dirname(path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        for name, table in tables.items():
            files.write_npy(os.path.join(tmp, f"{name}.npy"), table.shape,
                            files.stored_dtype(table.dtype), table.host_chunks())
        manifest = {"attrs": attrs, "tables": sorted(tables)}
        with open(os.path.join(tmp, _MANIFEST), "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            old = path + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
        raise


def _is_h5(path):
    return files.suffix_format(path) == "h5"


def _read_attrs(path):
    if _is_h5(path):
        with files.open_h5(path) as f:
            return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
    manifest = os.path.join(os.fspath(path), _MANIFEST)
    try:
        with open(manifest) as f:
            return json.load(f)["attrs"]
    except FileNotFoundError:
        if not os.path.exists(path):
            raise
        raise FileFormatError(f"{os.fspath(path)!r} has no {_MANIFEST}: it is not a speedswap "
                              f"checkpoint directory") from None
    except (ValueError, KeyError) as exc:
        raise FileFormatError(f"{manifest!r} is not a valid checkpoint manifest ({exc})") from exc


def _stored_names(path):
    if _is_h5(path):
        with files.open_h5(path) as f:
            return set(f.keys())
    return {name[:-4] for name in os.listdir(path) if name.endswith(".npy")}


def load_tables(path, tables, attrs):
    """Read a checkpoint written by :func:`save_tables` into ``tables``.

    Every check runs before any row is read, so on error no table changes.

    Args:
        path: as given to :func:`save_tables`.
        tables: ``{name: HostTable}`` to fill; the checkpoint must hold exactly these names.
        attrs: ``{key: value}`` the checkpoint's attributes must equal.

    Raises:
        FileNotFoundError: no such file or directory.
        FileFormatError: not a speedswap checkpoint, other tables, other
            attributes, or a table of another shape or dtype.
    """
    stored_attrs = _read_attrs(path)
    if stored_attrs.get("format") != _FORMAT:
        raise FileFormatError(f"{os.fspath(path)!r} is not a speedswap checkpoint "
                              f"(format {stored_attrs.get('format')!r})")
    for key, value in attrs.items():
        if stored_attrs.get(key) != value:
            raise FileFormatError(f"{os.fspath(path)!r} was saved with {key}="
                                  f"{stored_attrs.get(key)!r}, but this one has {key}={value!r}; "
                                  f"a checkpoint restores only the setup that wrote it")
    stored = _stored_names(path)
    if stored != set(tables):
        raise FileFormatError(f"{os.fspath(path)!r} holds tables {sorted(stored)}, expected "
                              f"{sorted(tables)}; was it saved by another model or optimizer?")
    sources = {}
    for name, table in tables.items():
        if _is_h5(path):
            source, dataset = path, name
            header = files.read_h5_header(path, name)
        else:
            source, dataset = os.path.join(os.fspath(path), f"{name}.npy"), "table"
            header = files.read_npy_header(source)
        files.check_table_matches(header, table.shape, table.dtype, source)
        sources[name] = (source, dataset)
    for name, table in tables.items():
        table.load_from(*sources[name])
