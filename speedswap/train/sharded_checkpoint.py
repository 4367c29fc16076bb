"""Checkpoints of a row-sharded table: one ``.npy`` file per table per rank, and a manifest.

A checkpoint directory holds ``<name>.rank<r>.npy`` for every table
(``table``, ``optimizer.exp_avg``, ...) and every saving rank ``r``, each
holding that rank's contiguous row range, ``crc32.rank<r>.json`` with the
CRC-32 of each of those files' rows, plus ``manifest.json``: the format,
table size and dtype, the saving world size and its row split, the
optimizer's class and its scalar state for the table (the step count), and
the table names.

**Complete or absent.** Rank 0 creates ``<path>.partial``; every rank writes
its shard files into it (each one atomically); the ranks agree that all
succeeded; rank 0 writes the manifest into it last and renames it over
``<path>`` (an earlier checkpoint is moved aside and removed only after the
rename, as :mod:`speedswap.train.checkpoint` does). A checkpoint without a
manifest is not one, so a crash on any rank at any point leaves the earlier
checkpoint whole. ``path`` must be on a file system every rank sees (local
disk for one machine; NFS, Lustre or similar across machines).

**Resharding.** Loading does not require the saving world size: each rank
works out which saved shards overlap the rows it owns now, checks every
header, reads each of those shards once to verify its CRC-32 (and, into a
bfloat16 table, that its values are bfloat16 values), holding only the rows
it owns, in RAM where they fit in its part of the free RAM (the ranks on one
machine share it), and only then, all ranks having succeeded, copies them
(with the manifest read in the same check): a corrupt byte changes no row,
and a file lost after the check changes none either. Rows too large to hold
are read again for the copy, as
:mod:`speedswap.train.checkpoint` does. One process can read the whole checkpoint into a plain
:class:`~speedswap.OffloadedEmbedding` (:func:`load_sharded`).
"""

import errno
import json
import os
import re
import shutil
import socket
import zlib
from typing import TYPE_CHECKING

from .. import atomic, files
from ..atomic import PathLike
from ..backends import available_ram
from ..errors import DTypeError, FileFormatError, MissingFileError, PathError, StateError, warn
from ..table import loading_into
from .caching import rewriting
from .exchange import Exchange, row_bounds, run_everywhere

if TYPE_CHECKING:  # a cycle at run time: embedding imports checkpoint, which imports this module
    from .embedding import OffloadedEmbedding

__all__ = ["save_shards", "load_shards", "all_unchanged", "stage_table_rows", "load_sharded",
           "ranks_on_this_machine", "MANIFEST"]

MANIFEST = "manifest.json"
_FORMAT = "speedswap-sharded-1"
#: What a manifest must hold for a load to read it, and the JSON type of each.
_MANIFEST_KEYS = {"num_embeddings": int, "embedding_dim": int, "dtype": str, "world_size": int,
                  "bounds": list, "optimizer": str, "scalar_state": dict, "tables": list}


def _shard_file(path, name, rank):
    return os.path.join(path, f"{name}.rank{rank}.npy")


def _checksum_file(path, rank):
    """Rank ``rank``'s CRC-32s of its shard files: ``{table name: crc}`` as JSON."""
    return os.path.join(path, f"crc32.rank{rank}.json")


#: What a checkpoint directory, or a save's leftover of one, may hold: the manifest, the
#: CRC files and shards, and the hidden temporaries of their atomic writes.
_OWN_FILE = re.compile(r"manifest\.json|crc32\.rank\d+\.json|.+\.rank\d+\.npy|\..+\.tmp")


def _remove_leftover(directory) -> None:
    """Remove ``directory`` (``<path>.partial`` or ``<path>.old``) if a save left it; refuse anything else.

    Raises:
        PathError: something else is there (a user's own ``ckpt.old`` backup,
            say), which a save must not delete.
    """
    if not os.path.lexists(directory):
        return
    if not os.path.isdir(directory) or os.path.islink(directory) or not all(
            _OWN_FILE.fullmatch(name) and os.path.isfile(os.path.join(directory, name))
            for name in os.listdir(directory)):
        raise PathError(f"{directory!r} is in the way of this checkpoint's save (it puts its files "
                        f"there while it writes) and is not what a save leaves; move it away, or "
                        f"save to another path. Nothing was written")
    shutil.rmtree(directory)


def _shard_checksums(path, rank, manifest) -> dict:
    """The CRC-32s rank ``rank`` saved, or ``{}`` for a checkpoint saved before they were.

    Raises:
        FileFormatError: the manifest says they were saved and they are gone.
    """
    try:
        with open(_checksum_file(path, rank)) as f:
            return json.load(f)
    except FileNotFoundError:
        if manifest.get("checksums"):
            raise FileFormatError(f"{_checksum_file(path, rank)!r} is missing, so rank {rank}'s shards "
                                  f"cannot be verified: the checkpoint is incomplete; restore it from "
                                  f"a backup") from None
        return {}
    except ValueError as exc:
        raise FileFormatError(f"{_checksum_file(path, rank)!r} is not valid JSON ({exc}): the "
                              f"checkpoint is corrupt; restore it from a backup") from exc


def _stage(source, header, table, crc32, rows, sharing) -> files.StagedRows:
    """Read and verify a ``.npy`` shard file before a load changes any row; hold its ``rows``.

    Checks its CRC-32 when given (reading every row) and, for a bfloat16
    table, that its values are bfloat16 values. The rows this rank loads
    from it are held in RAM where they fit in this rank's part of it (the
    ``sharing`` ranks on this machine stage at once), so the copy that
    follows reads no file and cannot fail midway.
    """
    return files.stage_table(source, header, "table", table.dtype, available_ram() // sharing,
                             crc32=crc32, rows=rows)


def ranks_on_this_machine(exchange) -> int:
    """How many ranks of the group run on this machine (by host name; a collective)."""
    host = zlib.crc32(socket.gethostname().encode())
    return len(next(group for group in exchange.ranks_by_value(host) if exchange.rank in group))


def _restore_scalar_state(row_state, manifest):
    """Give the optimizer the saved step count; its per-row state is read from the tables."""
    stepped = manifest.get("stepped")
    if stepped is None:
        # Saved before manifests said so. An optimizer with no scalar state (SGD
        # with momentum) looks the same stepped or not; the rows tell them apart.
        stepped = bool(manifest["scalar_state"]) or not row_state.holds_initial_state()
    if not stepped:  # saved before the first step: every row holds torch's initial state
        row_state.optimizer.state.pop(row_state.param, None)
        row_state.init_state()
        return
    row_state.restore_scalar_state({"stepped": True, "scalars": manifest["scalar_state"]})


def save_shards(path, tables, row_state, bounds, exchange) -> None:
    """Write this rank's ``tables`` as its shard of the checkpoint ``path`` (a collective).

    Args:
        path: the checkpoint directory.
        tables: ``{name: HostTable}``: this rank's rows of each table.
        row_state: the :class:`~speedswap.train.row_state.RowState` or None.
        bounds: the row split (:func:`~speedswap.train.exchange.row_bounds`).
        exchange: the ranks' :class:`~speedswap.train.exchange.Exchange`.

    Raises:
        FileFormatError: ``path`` exists and is not a sharded checkpoint (on every rank).
        PathError: the ranks do not write into one directory (another path on
            some rank, or no file system shared by every rank).
        StateError: another rank failed; OSError: this rank failed to write.
    """
    path = os.path.abspath(atomic.as_path(path))
    partial = path + ".partial"

    def prepare():
        if os.path.exists(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
            raise FileFormatError(f"{path!r} exists and is not a sharded speedswap checkpoint; "
                                  f"refusing to replace it: choose another path")
        _remove_leftover(partial)  # left by a save that crashed
        if os.path.exists(path):
            _remove_leftover(path + ".old")  # checked now: finish() moves the earlier one there
        os.makedirs(partial)

    unshared = ("pass the same path on every rank, on a file system every rank sees (a shared "
                "one, NFS or Lustre, across machines)")

    def write_shard():
        if not os.path.isdir(partial):
            raise PathError(f"rank {exchange.rank} cannot see {partial!r}, which rank 0 has just "
                            f"created for the checkpoint: {unshared}")
        # Files of the checkpoint written aside: an interrupt leaves none saved (no note_interrupt).
        checksums = {name: files.write_npy(_shard_file(partial, name, exchange.rank), table.shape,
                                           files.stored_dtype(table.dtype), table.host_chunks(),
                                           checksum=True, note_interrupt=False)
                     for name, table in tables.items()}
        with atomic.atomic_output(_checksum_file(partial, exchange.rank), note_interrupt=False) as tmp, \
                open(tmp, "w") as f:
            json.dump(checksums, f)

    def finish():
        # A rank that wrote elsewhere (another path, a disk of its own holding an old
        # <path>.partial) succeeded without its files being here: without them the
        # checkpoint would be complete-looking and unloadable, and replace a good one.
        absent = sorted({rank for rank in range(len(bounds) - 1)
                         for file in (_checksum_file(partial, rank),
                                      *(_shard_file(partial, name, rank) for name in tables))
                         if not os.path.isfile(file)})
        if absent:
            raise PathError(f"the shards of rank(s) {absent} are not in {partial!r} although every "
                            f"rank wrote its own: {unshared}. Nothing was replaced")
        scalars = {"stepped": False, "scalars": {}} if row_state is None else row_state.scalar_state()
        manifest = {"format": _FORMAT, "num_embeddings": bounds[-1],
                    "embedding_dim": tables["table"].dim,
                    "dtype": str(tables["table"].dtype).replace("torch.", ""),
                    "world_size": len(bounds) - 1, "bounds": list(bounds),
                    "optimizer": "" if row_state is None else type(row_state.optimizer).__name__,
                    "scalar_state": scalars["scalars"], "tables": sorted(tables),
                    # Whether the optimizer has stepped: SGD's momentum has no step count to say it.
                    "stepped": scalars["stepped"],
                    "checksums": True}  # every rank's crc32.rank<r>.json: a lost one is refused
        with atomic.atomic_output(os.path.join(partial, MANIFEST), note_interrupt=False) as tmp, open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        if os.path.exists(path):
            old = path + ".old"
            _remove_leftover(old)
            os.rename(path, old)
            try:
                os.rename(partial, path)
            except BaseException:
                os.rename(old, path)  # the earlier checkpoint back where it was
                raise
            try:
                shutil.rmtree(old)
            except OSError as exc:
                # The new checkpoint is in place: the save succeeded on every rank, and only the
                # earlier one's space is still taken (the next save to path removes it first).
                warn(f"checkpoint {path!r} is saved, but the earlier one, moved aside to {old!r}, "
                     f"could not be removed ({exc}); delete it to free its space (the next save to "
                     f"{path!r} removes it too)")
        else:
            os.rename(partial, path)

    run_everywhere(exchange, f"preparing checkpoint {path!r}", prepare, on_rank=0)
    try:
        run_everywhere(exchange, f"writing the shards of {path!r}", write_shard)
        run_everywhere(exchange, f"completing checkpoint {path!r}", finish, on_rank=0)
    except BaseException:
        if exchange.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def read_manifest(path) -> dict:
    """The validated manifest of the sharded checkpoint ``path``.

    Raises:
        MissingFileError: nothing at ``path``, and no earlier checkpoint beside it.
        FileFormatError: no manifest, not a sharded speedswap checkpoint, or
            one that lacks an entry a load reads.
    """
    manifest_path = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        old = os.fspath(path) + ".old"
        hint = (f"; a save killed between its two renames left the previous checkpoint at "
                f"{old!r}: rename it to {os.fspath(path)!r}"
                if os.path.isfile(os.path.join(old, MANIFEST)) else "")
        if not hint and not os.path.exists(path):  # a typo in the path, not a damaged checkpoint
            raise MissingFileError(errno.ENOENT, f"no sharded checkpoint at {os.fspath(path)!r}; "
                                                 f"check the path", os.fspath(path)) from None
        raise FileFormatError(f"{os.fspath(path)!r} has no {MANIFEST}: it is not a (complete) "
                              f"sharded speedswap checkpoint{hint}") from None
    except ValueError as exc:
        raise FileFormatError(f"{manifest_path!r} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise FileFormatError(f"{manifest_path!r} is not a sharded speedswap checkpoint manifest")
    mangled = [key for key, kind in _MANIFEST_KEYS.items() if not isinstance(manifest.get(key), kind)]
    if mangled or manifest["world_size"] < 1:
        raise FileFormatError(f"{manifest_path!r} lacks or mangles {mangled or ['world_size']} (expected "
                              f"{', '.join(f'{k}: {t.__name__}' for k, t in _MANIFEST_KEYS.items())}, "
                              f"as save() writes them); was it edited? Restore it from a backup")
    bounds = manifest["bounds"]
    if bounds != row_bounds(manifest["num_embeddings"], manifest["world_size"]):
        raise FileFormatError(f"{manifest_path!r} has a row split {bounds} that is not the one "
                              f"speedswap makes; was it edited?")
    return manifest


def _plan(path, manifest, tables, row_state, rows, num_embeddings, sharing):
    """``[(staged, table, file rows, table start)]``: what to copy, all checked (see :func:`_stage`)."""
    dim = tables["table"].dim
    dtype = str(tables["table"].dtype).replace("torch.", "")
    stored = (manifest["num_embeddings"], manifest["embedding_dim"], manifest["dtype"])
    if stored != (num_embeddings, dim, dtype):
        raise FileFormatError(f"{os.fspath(path)!r} holds a {stored[0]} x {stored[1]} {stored[2]} "
                              f"table, this one is {num_embeddings} x {dim} {dtype}")
    wanted = {"table": tables["table"]} if row_state is None else tables
    if row_state is not None:
        optimizer = type(row_state.optimizer).__name__
        if manifest["optimizer"] != optimizer or set(manifest["tables"]) != set(tables):
            raise FileFormatError(
                f"{os.fspath(path)!r} was saved with optimizer {manifest['optimizer'] or 'none'!r} "
                f"(tables {manifest['tables']}), but {optimizer} is attached here (tables "
                f"{sorted(tables)}); attach the optimizer class that saved it, or load before "
                f"attaching to read the rows alone")
    bounds, plan = manifest["bounds"], []
    for rank in range(manifest["world_size"]):
        lo, hi = max(bounds[rank], rows.start), min(bounds[rank + 1], rows.stop)
        if lo >= hi:
            continue
        checksums = _shard_checksums(path, rank, manifest)
        for name, table in wanted.items():
            if manifest.get("checksums") and name not in checksums:
                raise FileFormatError(f"{_checksum_file(path, rank)!r} has no CRC-32 for {name!r}: "
                                      f"the checkpoint is incomplete; restore it from a backup")
            source = _shard_file(path, name, rank)
            header = files.read_npy_header(source)
            files.check_table_matches(header, (bounds[rank + 1] - bounds[rank], dim), table.dtype,
                                      source)
            file_rows = range(lo - bounds[rank], hi - bounds[rank])
            plan.append((_stage(source, header, table, checksums.get(name), file_rows, sharing), table,
                         file_rows, lo - rows.start))
    return plan


def _fingerprint(path, manifest) -> int:
    """A number that tells checkpoints apart: the CRC-32 of the manifest and of every rank's CRC-32s.

    The manifest alone is the same at every step of SGD without momentum (no
    step count); the shards' CRC-32s differ (a checkpoint saved before they
    were has none: its manifest tells it).

    Raises:
        FileFormatError: a rank's CRC-32s missing or unreadable.
    """
    checksums = [_shard_checksums(path, rank, manifest) for rank in range(manifest["world_size"])]
    return zlib.crc32(json.dumps([manifest, checksums], sort_keys=True).encode())


def load_shards(path, tables, row_state, rows, num_embeddings, exchange) -> None:
    """Fill this rank's ``tables`` (rows ``rows``) from a checkpoint of any world size (a collective).

    Args:
        path: the checkpoint directory.
        tables: ``{name: HostTable}`` holding this rank's rows of each table.
        row_state: the attached RowState, or None to read the ``table`` rows alone.
        rows: the global row range this rank owns.
        num_embeddings: rows of the whole table.
        exchange: the ranks' Exchange.

    Raises:
        FileFormatError: the checkpoint does not match (on the rank that saw
            it; StateError on the others). Every file is checked on every
            rank before any row changes.
        StateError: the ranks read different checkpoints (another ``path``
            on some rank), on every rank, before any row changes.
    """
    # Ranks on one machine stage their rows at once, each seeing the same free RAM.
    sharing = ranks_on_this_machine(exchange)

    def check():
        manifest = read_manifest(path)
        if row_state is not None:  # before any row changes (whether it stepped is read from the rows after)
            row_state.check_scalar_state({"stepped": True, "scalars": manifest["scalar_state"]},
                                         repr(os.fspath(path)))
        fingerprint = _fingerprint(path, manifest)
        return manifest, _plan(path, manifest, tables, row_state, rows, num_embeddings, sharing), fingerprint

    manifest, plan, fingerprint = run_everywhere(exchange, f"checking checkpoint {os.fspath(path)!r}",
                                                 check)
    # Ranks reading different checkpoints (another step of the run, each rank its own "latest")
    # would each restore its own rows and step count: the shards would train unlike one table.
    groups = exchange.ranks_by_value(fingerprint)
    if len(groups) > 1:
        raise StateError(f"load(): {os.fspath(path)!r} is not the same checkpoint on every rank "
                         f"(ranks {groups[0]} read one, ranks {groups[1]} another"
                         f"{', and more' if len(groups) > 2 else ''}); pass the path of one checkpoint "
                         f"on every rank. No row changed")
    # A shard too large to stage in RAM is read again at commit: every rank confirms its files are
    # still the ones verified before any rank writes a row, or a change seen by one rank would
    # leave the ranks before it loaded and the rest not.
    unchanged = [staged for staged, *_ in plan]
    run_everywhere(exchange, f"checking checkpoint {os.fspath(path)!r} again",
                   lambda: all_unchanged(unchanged))

    def read():
        names = {id(table): name for name, table in tables.items()}
        loaded = []
        for staged, table, file_rows, at in plan:
            try:
                staged.commit(table, rows=file_rows, at=at)
            except FileFormatError as exc:
                if not loaded:
                    raise
                # The error speaks of its own file; the shards before it already hold the
                # checkpoint's rows beside the others' own: training on would mix two states.
                raise FileFormatError(f"{exc}. This rank had loaded rows of {sorted(set(loaded))} from "
                                      f"{os.fspath(path)!r} before it: load an intact checkpoint before "
                                      f"training on") from exc
            loaded.append(names[id(table)])
        if row_state is not None:
            _restore_scalar_state(row_state, manifest)

    # A rank that stopped midway leaves the table part loaded on every rank: each refuses use.
    with loading_into(tables.values(), path):
        run_everywhere(exchange, f"reading checkpoint {os.fspath(path)!r}", read)


def all_unchanged(staged) -> None:
    """Raise unless every one of the :class:`~speedswap.files.StagedRows` ``staged`` may still be committed.

    Raises:
        FileFormatError: a file too large to stage in RAM changed since it was verified.
    """
    for rows in staged:
        rows.check_unchanged()


def stage_table_rows(path, table, rows, num_embeddings, sharing) -> files.StagedRows:
    """Read and check rows ``rows`` of the whole-table ``.npy`` file ``path``, for ``table``.

    Only this rank's rows are read: an export holds every rank's rows, and
    each rank reading all of them would multiply the I/O by the world size.
    They are held in RAM where they fit in this rank's part of it (the
    ``sharing`` ranks on this machine, :func:`ranks_on_this_machine`, stage
    at once). Nothing changes until the result is committed
    (``commit(table, rows=rows, at=0)``), which every rank does only once
    every rank has staged its rows.

    Raises:
        FileFormatError: the file is not a ``(num_embeddings, dim)`` table of
            the table's dtype, cannot be read, or holds values a bfloat16
            table would round.
    """
    header = files.read_npy_header(path)
    files.check_table_matches(header, (num_embeddings, table.dim), table.dtype, path)
    return files.stage_table(os.fspath(path), header, "table", table.dtype, available_ram() // sharing,
                             rows=rows)


def load_sharded(path: PathLike, embedding: "OffloadedEmbedding") -> None:
    """Read a sharded checkpoint, whatever its world size, into one plain OffloadedEmbedding.

    For evaluation or export in a single process: afterwards
    ``embedding.save("table.npy")`` writes the whole table. With an optimizer
    attached (the class that saved), its state and step count are restored
    too, so training can go on unsharded.

    Args:
        path: a directory written by :meth:`ShardedOffloadedEmbedding.save`.
        embedding: a :class:`~speedswap.OffloadedEmbedding` of the same size and dtype.

    Raises:
        FileFormatError: another size, dtype or optimizer, or bad files (nothing changes).
        StateError: called between a training forward and the optimizer step.
        DTypeError: ``embedding`` is not an OffloadedEmbedding.
    """
    # Imported here: both modules import this one.
    from .embedding import OffloadedEmbedding
    from .sharded import ShardedOffloadedEmbedding

    if not isinstance(embedding, OffloadedEmbedding):
        fix = (": a ShardedOffloadedEmbedding reads its own checkpoints (of any world size) with "
               "emb.load(path)" if isinstance(embedding, ShardedOffloadedEmbedding) else "")
        raise DTypeError(f"load_sharded reads a sharded checkpoint into an OffloadedEmbedding, got a "
                         f"{type(embedding).__name__}{fix}")
    if embedding._step_in_flight():
        raise StateError("load between a training forward and optimizer.step() would be "
                         "undone by the step; load between steps")
    # A device cache holds the authoritative copy of its rows: flushed before, forgotten after.
    with rewriting(embedding._cache):
        load_shards(path, embedding._tables(), embedding._state, range(embedding.num_embeddings),
                    embedding.num_embeddings, Exchange(local=True))
