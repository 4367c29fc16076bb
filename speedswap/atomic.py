"""Atomic saves: a temporary beside the target, fsync, one rename; the debris of killed saves; path checks.

Every file speedswap writes goes through :func:`atomic_output`, so a crash or
a full disk mid-save leaves the previous file intact. Temporaries are named
``.<name>.<host>.<pid>.<random>.tmp`` so a later save can prove which ones a
dead process left behind and remove exactly those. Saves to one file take
turns (:func:`one_save_at_a_time`, an ``flock`` on ``.<name>.speedswap.lock``
beside it); loads that rewrite a file in place take turns on the file itself
(:func:`rewriting_in_place`). OSErrors become :class:`~speedswap.errors.PathError` naming the
user's path, never the temporary. Beside them, :func:`open_into`, an open whose
descriptor no interrupt can lose, and the file-level calls built on it:
:func:`fsync_dir`, and :func:`drop_cache` (a file's pages out of the page
cache, for the cold reads that benchmarks and examples time).
"""

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import stat
import threading
from typing import Iterator, Optional, Union

try:
    import fcntl
except ImportError:  # Windows: threads of one process still take turns (see locked)
    fcntl = None
try:
    import resource
except ImportError:  # Windows: no descriptor limit to name
    resource = None

from .errors import DTypeError, MissingFileError, PathError, SpeedswapError, warn
from .mappings import mapped_for_writing

__all__ = ["PathLike", "as_path", "atomic_output", "temp_path", "is_temporary", "remove_stale_temporaries",
           "check_writable_dir", "check_readable_file", "check_regular_file", "opening_error", "saving_error",
           "keep_owner_and_mode", "replace_together",
           "open_into", "fsync_dir", "sync_new_name", "drop_cache", "locked", "one_save_at_a_time",
           "rewriting_in_place", "rewriting_error", "rewrite_under_way"]

#: What a path argument takes: a str, an ``os.PathLike`` (``pathlib.Path``) or bytes (:func:`as_path`).
PathLike = Union[str, bytes, os.PathLike]


def as_path(path: PathLike) -> str:
    """``path`` as a str: the one check of the paths speedswap's calls take, before any is used.

    Args:
        path: a str, an ``os.PathLike`` (``pathlib.Path``), or bytes (decoded
            as ``os.fsdecode`` does).

    Raises:
        DTypeError: anything else (None, a file descriptor, a list of paths).
        PathError: a NUL byte, which no file name holds.
    """
    try:
        path = os.fsdecode(path)
    except TypeError:
        raise DTypeError(f"path must be a str or an os.PathLike such as pathlib.Path, got "
                         f"{type(path).__name__} {path!r}") from None
    if "\0" in path:
        raise PathError(f"the path {path!r} holds a NUL byte ('\\0'), which no file name can; check how "
                        f"it was put together")
    return path


_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9-]+\.\d+\.[0-9a-f]{8}\.tmp")


def is_temporary(name) -> bool:
    """Whether the file name ``name`` is one a save makes beside its target, of any target, host, process.

    A temporary (:func:`temp_path`), or a lock (:func:`one_save_at_a_time`),
    which a killed save may leave too.
    """
    return _TEMPORARY.fullmatch(name) is not None or (name.startswith(".") and name.endswith(_LOCK_SUFFIX))


#: The longest file name (in bytes) of the usual file systems (NAME_MAX).
_NAME_MAX = 255


def _cut(name, tail) -> str:
    """``name`` cut short (at a byte) where ``.<name><tail>`` would not fit in :data:`_NAME_MAX` bytes.

    A target's own name may be as long as the file system takes; the names
    speedswap makes beside it must still fit.
    """
    return os.fsdecode(os.fsencode(name)[:_NAME_MAX - 1 - len(os.fsencode(tail))])  # surrogateescape: any cut decodes


def _temp_prefix(name) -> str:
    """``.<name>.<host>.``, the part of a temporary's name that says whose it is.

    ``name`` is cut short so that the whole temporary name, pid and random
    part included, still fits in :data:`_NAME_MAX` bytes.
    """
    return f".{_cut(name, f'.{_HOST}.{2**32}.{0:08}.tmp')}.{_HOST}."  # pids stay below 2**32 (Linux: 2**22)


def temp_path(path) -> str:
    """A fresh hidden temporary name beside ``path`` that says who made it.

    ``.<name>.<host>.<pid>.<random>.tmp``: the host and process id let a later
    save prove a leftover temporary is a dead save's (see :func:`remove_stale_temporaries`).
    A name too long to take all that is cut short (:func:`_temp_prefix`).
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    return os.path.join(directory, f"{_temp_prefix(name)}{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _pid_alive(pid):
    if pid == os.getpid():
        return True  # another save of this process may be running in a thread
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


def remove_stale_temporaries(path) -> list:
    """Remove the temporaries of saves to ``path`` whose process has died.

    Only names made by :func:`temp_path` for this very ``path``, on this host,
    by a process id that no longer exists, are removed: never a file speedswap
    cannot prove it left behind.

    Returns:
        the paths removed.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    pattern = re.compile(re.escape(_temp_prefix(name)) + r"(\d+)\.[0-9a-f]{8}\.tmp")
    removed = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        stale = os.path.join(directory, entry)
        with contextlib.suppress(OSError):
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale)
            else:
                os.unlink(stale)
            removed.append(stale)
    return removed


def check_writable_dir(path) -> str:
    """The absolute directory ``path`` will be written in, which must exist.

    Raises:
        PathError: the directory does not exist or is not a directory.
    """
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise PathError(f"cannot save {os.fspath(path)!r}: {directory!r} is a file, not a "
                        f"directory; save somewhere else")
    if not os.path.isdir(directory):
        raise PathError(f"cannot save {os.fspath(path)!r}: the directory {directory!r} does "
                        f"not exist; create it first (os.makedirs(..., exist_ok=True))")
    return directory


def saving_error(path, exc, temporary=None) -> "PathError":
    """A :class:`PathError` naming the user's ``path`` for an OSError raised while saving it.

    Args:
        path: the file or checkpoint the user asked to save.
        exc: the OSError.
        temporary: the temporary the save wrote to, if any: a reason that
            names it (HDF5 puts the file name in its messages) names ``path``
            instead, since the temporary is gone when the user reads it.

    Returns:
        PathError, with ``errno`` set as ``exc``'s.
    """
    reason = exc.strerror or str(exc)
    if temporary is not None:
        reason = reason.replace(os.fspath(temporary), os.fspath(path))
    hint = {errno.EROFS: "the file system is read-only; save somewhere writable",
            errno.EACCES: "no permission to write there; save somewhere writable",
            errno.EPERM: "no permission to write there; save somewhere writable",
            errno.ENOSPC: "the disk is full; free space or save elsewhere",
            errno.EDQUOT: "the disk quota is exceeded; free space or save elsewhere",
            errno.EFBIG: "the file is larger than this file system or the process's file-size "
                         "limit (ulimit -f) allows; save elsewhere or raise the limit",
            errno.ENOMEM: "the process has no address space left to map it (ulimit -v); raise the limit "
                          "or use fewer or smaller mmap tables"}.get(exc.errno)
    hint = hint or _descriptors_hint(exc) or "check the path"
    error = PathError(f"could not save {os.fspath(path)!r} ({reason}): {hint}. Any previous "
                      f"file at that path is intact")
    error.errno = exc.errno
    return error


def _descriptors_hint(exc: OSError) -> Optional[str]:
    """What to do when ``exc`` says the process or the system has run out of file descriptors, else None."""
    if exc.errno == errno.EMFILE:
        limit = (f" ({resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; ulimit -n, or "
                 f"resource.setrlimit(resource.RLIMIT_NOFILE, ...) up to its hard limit)" if resource else "")
        return (f"the process has as many files open as its limit allows{limit}; an mmap table holds two "
                f"descriptors while it lives (its map and one that checks its file). Raise the limit, close "
                f"tables no longer used, or keep fewer tables in mmap storage")
    if exc.errno == errno.ENFILE:
        return "the system has as many files open as it allows (fs.file-max); close files or raise that limit"
    return None


def rewriting_error(path, exc: OSError) -> "PathError":
    """A :class:`PathError` naming ``path`` for an OSError met while a load rewrites that file in place.

    For a load into an ``mmap`` table (:func:`rewriting_in_place`), which
    writes the table's own file rather than saving a new one: what
    :func:`saving_error` says (a previous file intact, save elsewhere) does
    not hold for it.

    Args:
        path: the table's file.
        exc: the OSError.

    Returns:
        PathError, with ``errno`` set as ``exc``'s.
    """
    hint = {errno.EROFS: "the file system is read-only",
            errno.EACCES: "no permission to write the file",
            errno.EPERM: "no permission to write the file",
            errno.ENOSPC: "the disk is full; free space",
            errno.EDQUOT: "the disk quota is exceeded; free space"}.get(exc.errno, "check the file")
    error = PathError(f"a load into the mmap table over {os.fspath(path)!r} could not read or write that "
                      f"file in place ({exc.strerror or exc}): {hint}, and load again (or load into a table whose "
                      f"file is writable)")
    error.errno = exc.errno
    return error


def open_into(opened, path, flags, mode=0o777) -> int:
    """``os.open``, the descriptor appended to the list ``opened`` by C as ``os.open`` returns it.

    An interrupt (Ctrl-C) lands once a call into C has returned to Python code: one after ``os.open``
    returned would lose a descriptor held nowhere yet, open for good. The caller closes what ``opened``
    holds, whatever comes.

    Args:
        opened: the caller's list; it closes the descriptors in it in a ``finally``.
        path, flags, mode: ``os.open``'s.

    Returns:
        the descriptor.

    Raises:
        OSError: ``os.open``'s.
    """
    opened.extend(map(os.open, [path], [flags], [mode]))
    return opened[-1]


def fsync_dir(directory) -> None:
    """Make a rename in ``directory`` durable (not every file system can fsync a directory)."""
    opened = []
    with contextlib.suppress(OSError):
        try:
            os.fsync(open_into(opened, directory, os.O_RDONLY))
        finally:
            if opened:
                os.close(opened[0])


def sync_new_name(directory, path, then: str) -> None:
    """:func:`fsync_dir` once the new file ``path`` has its name in ``directory``; an interrupt meanwhile says so.

    The file at ``path`` already is the new one: a Ctrl-C while its directory
    is synced would otherwise read as an operation that failed.

    Args:
        directory: the directory ``path`` is in.
        path: the file just named (renamed or linked into place).
        then: what to do next, for the note (e.g. that saving again makes sure).

    Raises:
        KeyboardInterrupt (or any BaseException of the sync): with a note
            (Python 3.11+) that ``path`` is the new file and ``then``.
    """
    try:
        fsync_dir(directory)
    except BaseException as exc:  # an interrupt: fsync_dir lets no OSError out
        _note_new_name(exc, path, "while its directory was synced", then)
        raise


def _note_new_name(exc, path, when, then: str) -> None:
    """Note on ``exc`` (Python 3.11+) that ``path`` is the new file, ``exc`` having come ``when``; then ``then``."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"speedswap: {path!r} is the new file: this {type(exc).__name__} came after it was given "
                     f"its name, {when}, so its directory entry may not survive a power loss yet; {then}")


@contextlib.contextmanager
def atomic_output(path, replace_mapped: bool = False, note_interrupt: bool = True):
    """Yield a temporary path; on success move it over ``path`` atomically.

    The temporary file lives in the target's directory (a rename is atomic
    only within one file system) and is fsynced before the rename. On any
    exception it is removed and the exception propagates; ``path`` is untouched.
    Temporaries of earlier saves to ``path`` that were killed are removed first.
    Saves to one path take turns (:func:`one_save_at_a_time`): this one
    waits while another is under way, in any thread or process of this host.

    A symbolic link at ``path`` is kept: the file it points to is replaced
    (in that file's directory), as writing through the link would. A
    replaced file keeps its mode, and its owner where the saving user may
    give it one (root), as with a plain ``open()``.

    Args:
        path: the file to create or replace.
        replace_mapped: replace it even where this process maps it for
            writing (a table asked to start the file afresh: ``overwrite``);
            otherwise that is refused, as the map's writes would be lost.
        note_interrupt: an interrupt (Ctrl-C) that comes after the rename
            (as it returns, while the directory is synced, as the save's
            turn ends) gets a note that ``path`` is the new file and a save
            again makes its name durable. False for a
            file of a larger save written aside (a directory checkpoint's
            new version), which an interrupt undoes: the file is not saved.

    Yields:
        str: where to write.

    Raises:
        PathError: the directory does not exist, ``path`` is a directory or
            another file that is not a regular one (a named pipe, a device), this
            process maps the file for writing (the map's writes would be lost
            with the replaced file), or the file system refused the write
            (read-only, full, no permission); the message names ``path``, not
            the temporary.
    """
    path = as_path(path)
    if os.path.islink(path):
        path = os.path.realpath(path)  # renaming over the link would turn it into a file
    directory = check_writable_dir(path)
    if os.path.isdir(path):
        raise PathError(f"cannot save {os.fspath(path)!r}: it is a directory; choose a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        # The rename would put a regular file in its place: as root, /dev/null would be gone.
        raise PathError(f"cannot save {os.fspath(path)!r}: it is not a regular file (a named pipe, "
                        f"socket or device), and a save replaces what is at the path with a new "
                        f"file; choose a file name")
    if not replace_mapped and mapped_for_writing(path):
        raise PathError(f"cannot save {os.fspath(path)!r}: this process maps that file for writing (a live "
                        f"mmap table or DataGadget, or an np.memmap), and replacing it would lose the map's "
                        f"writes; close that table (or drop the memmap) first, or save to another path")
    renamed = []  # not empty once the new file has its name: an interrupt from then on says so
    try:
        with one_save_at_a_time(path):
            remove_stale_temporaries(path)
            tmp = temp_path(path)
            try:
                try:
                    open(tmp, "xb").close()  # a new file: the mode a plain open() gives, under the umask
                    if os.path.exists(path):
                        keep_owner_and_mode(tmp, path)
                except OSError as exc:
                    raise saving_error(path, exc, tmp) from exc
                yield tmp
                try:
                    with open(tmp, "rb+") as f:
                        os.fsync(f.fileno())
                    # os.replace returns None: appended by C as it returns, for an interrupt after it to see.
                    renamed.extend(map(os.replace, [tmp], [path]))
                except OSError as exc:
                    raise saving_error(path, exc, tmp) from exc
            except BaseException as exc:
                # Not only FileNotFoundError: where the temporary could not be made (a read-only
                # file system answers EROFS even for a missing file) this would hide the real error.
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if isinstance(exc, OSError) and not isinstance(exc, SpeedswapError):
                    raise saving_error(path, exc, tmp) from exc
                raise
            fsync_dir(directory)
    except BaseException as exc:
        if renamed and note_interrupt:  # came once the new file had its name (an interrupt): the save is done
            _note_new_name(exc, path, "as the save finished (its directory synced, its turn let go of)",
                           "saving again makes sure")
        raise


def keep_owner_and_mode(new, replaced) -> None:
    """Give the new file ``new`` the owner and permission bits of ``replaced``, the file it is to replace.

    As a plain ``open()`` that rewrites a file keeps them. Only root gives a
    file away (a member, its group): the owner is kept where the user may.

    Raises:
        OSError: ``replaced`` cannot be read, or ``new``'s mode cannot be set.
    """
    kept = os.stat(replaced)
    with contextlib.suppress(OSError):
        os.chown(new, kept.st_uid, kept.st_gid)
    os.chmod(new, kept.st_mode & 0o777)


def replace_together(moves) -> None:
    """Rename new files over the files they replace, all of them or none.

    For files that go together (an optimizer's state tables): each new one is
    made, whole, under a temporary name beside its target (a :func:`temp_path`
    name, or a file in a directory of that name), so that no target is
    replaced before every new file exists. Each target's file is first given
    a second name beside it (a :func:`temp_path` name), so that a rename that
    fails puts back the files renamed before it, as does an interrupt
    (Ctrl-C) that lands as the renames return: every target then names the
    file it named before. That name is a hard link, so that the target names
    the old file or the new one at every moment; where no link can be made
    (a file system without hard links: vfat, exFAT, FUSE mounts, SMB; another
    user's file where the file system protects hard links) the old file is
    renamed to it instead, just before the new file is renamed over the
    target, which then names no file in between. The renames are one call
    into C, and so is the putting back: an interrupt lands before the first
    rename or after the last, never between two (nor between a failed rename
    and the putting back, unless in the very moment it fails). The names are
    not synced: the caller syncs their directories (:func:`sync_new_name`)
    once it has taken the new files as its own, so that an interrupt during
    that sync cannot read as the files not replaced.

    Args:
        moves: ``[(temporary, target)]``, each temporary beside its target (on its file system).

    Raises:
        PathError: a rename failed (``errno`` says why), and those before it
            were put back: nothing was replaced, and what is left of the
            temporaries is the caller's to remove. Where putting one back
            failed too (the file system failing), the message names the
            targets that hold their new files and where their old ones are.
    """
    # No save's turn (one_save_at_a_time) is taken, as atomic_output takes one: a turn keeps a save's
    # check of its target and its rename together, and no check here can go stale. The caller's (that
    # it may replace the targets: its own files, or overwrite=True) is of their names. A save of this
    # process to a target is refused (mapped_for_writing) before and after the renames alike, since the
    # old or the new state's table maps the file the name holds; that is why a hard link is made where it
    # can be: a file renamed aside leaves its target naming no file for a moment, in which another thread's
    # check passes (os.replace lets other threads run), and a kill then leaves the old file under a temporary
    # name only. A rename of another process's save, or of another owner's replace_together over the same
    # names, comes wholly before or after each of these, as with turns: the last names the file, none is
    # half written, and every table keeps its own file in its map. Two such owners at once may leave the
    # names split between their files, as the per-file turns of the overwrites before replace_together could.
    kept = []  # each target's old file's second name (None: it names no file), recorded before it is made
    leaves = []  # each target's first rename, from which on it names its old file no more (of `renames`)
    renames, backs, of = [], [], []  # in order, the renames; the one that puts each back; the move each is of
    done, undone = [], []  # os.replace returns None: appended by C as each rename returns
    replaced = False
    try:
        for index, (new, target) in enumerate(moves):
            leaves.append(len(renames))
            kept.append(temp_path(target))
            back = (kept[index], target)  # the old file back over the new one
            try:
                os.link(target, kept[index], follow_symlinks=False)  # the entry itself: a symbolic link stays one
            except FileNotFoundError:
                kept[index] = None
                back = (target, new)  # the new file back to its temporary name
            except OSError:  # no hard links here: the old file (a symbolic link itself) is renamed aside first
                renames.append((target, kept[index]))
                backs.append(back)
                of.append(index)
                back = (target, new)
            renames.append((new, target))
            backs.append(back)
            of.append(index)
        try:
            done.extend(map(os.replace, [source for source, _ in renames], [name for _, name in renames]))
            replaced = True
        except BaseException as exc:  # the OSError of rename len(done), or an interrupt as the renames returned
            try:
                # First thing: only an interrupt landing in the moment a rename fails could skip it, leaving
                # those before it renamed, their old files under the names in `kept` (not removed below).
                # Last done first: a file renamed aside goes back once its new file is off its name.
                undo = backs[:len(done)][::-1]
                undone.extend(map(os.replace, [source for source, _ in undo], [name for _, name in undo]))
            except OSError as failed:
                raise _not_put_back(moves, kept, leaves, len(done) - len(undone), failed) from exc
            if not isinstance(exc, OSError):
                raise
            failing = of[len(done)]
            error = saving_error(moves[failing][1], exc, moves[failing][0])
            if failing:
                error = PathError(f"{error}; the files renamed before it, {[name for _, name in moves[:failing]]!r}, "
                                  f"were put back: nothing was replaced")
                error.errno = exc.errno
            raise error from exc
    finally:
        # Second names of files put back (gone with that rename), of files replaced (the old state's maps
        # hold them) or not renamed: removed. Those of files renamed and not put back are the files' last.
        left = len(done) - len(undone)
        for index, aside in enumerate(kept):
            if aside is not None and (replaced or leaves[index] >= left):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(aside)


def _not_put_back(moves, kept, leaves, left: int, failed: OSError) -> "PathError":
    """The :class:`PathError` of a :func:`replace_together` whose putting back failed, ``left`` renames still done.

    Args:
        moves, kept: the call's moves, and each target's old file's second name (None where it named no file).
        leaves: each target's first rename (an index of the call's renames), from which on it names its old
            file no more.
        left: how many of the renames, the first ones, are not put back.
        failed: the OSError of the rename that was to put one back.

    Returns:
        PathError, with ``errno`` set as ``failed``'s.
    """
    moved = [index for index in range(len(moves)) if leaves[index] < left]
    kept_as = {moves[index][1]: kept[index] for index in moved if kept[index] is not None}
    made = [moves[index][1] for index in moved if kept[index] is None]
    todo = [f"rename each old file back over its target ({{target: old file}}) {kept_as!r}"] if kept_as else []
    todo += [f"remove {made!r}, which named no file before"] if made else []
    error = PathError(f"files that go together were renamed in part (a rename failed, or an interrupt came), and "
                      f"putting back those renamed failed too ({failed.strerror or failed}): the file system may "
                      f"be failing. To have the files as before, {' and '.join(todo)}")
    error.errno = failed.errno
    return error


def check_readable_file(path, what="file") -> str:
    """``path`` as a string, if it names an existing regular file.

    Raises:
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory.
    """
    path = as_path(path)
    if os.path.isdir(path):
        raise PathError(f"{path!r} is a directory, but a {what} was expected here; pass the "
                        f"file's path")
    if not os.path.exists(path):
        raise MissingFileError(errno.ENOENT, f"no {what} at {path!r}; check the path", path)
    return path


def check_regular_file(path, what="file") -> str:
    """``path`` as a string, if it names an existing regular file: one a format read by offset can read.

    A named pipe's open would wait for a writer, forever where none comes;
    a socket or a device is no file of rows either.

    Raises:
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory, or not a regular file.
    """
    path = check_readable_file(path, what)
    if not os.path.isfile(path):
        raise PathError(f"{path!r} is not a regular file (a named pipe, socket or device?); a {what} "
                        f"is read by offset: save the data to a file and pass its path")
    return path


def opening_error(path, exc, what="file") -> "PathError":
    """A :class:`PathError` for an OSError raised opening the existing file ``path`` to read it.

    Args:
        path: the file.
        exc: the OSError (h5py's too: it sets ``errno``).
        what: what the file is, for the message (``".npy file"``).

    Returns:
        PathError, with ``errno`` set as ``exc``'s.
    """
    hint = _descriptors_hint(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        message = (f"no permission to read the {what} {os.fspath(path)!r}; make it readable "
                   f"(chmod u+r) or read it as a user who may")
    elif hint:
        message = f"cannot open the {what} {os.fspath(path)!r} ({exc.strerror or exc}): {hint}"
    else:
        message = f"cannot open the {what} {os.fspath(path)!r} ({exc.strerror or exc}); check the path"
    error = PathError(message)
    error.errno = exc.errno
    return error


def drop_cache(path: "str | os.PathLike") -> None:
    """Drop a file's pages from the page cache, so its next read comes from disk (a cold start).

    Dropping is advice: where the file cannot be synced or its pages dropped
    (a ``/proc`` file answers EINVAL), it reads the same, perhaps from
    memory, so that only warns.

    Args:
        path: an existing regular file.

    Raises:
        MissingFileError: nothing at ``path``.
        PathError: ``path`` is a directory or not a regular file, or cannot be opened.
    """
    path = check_regular_file(path, "file to drop from the page cache")
    opened = []  # the file's descriptor, from its opening (open_into): closed whatever comes
    try:
        try:
            fd = open_into(opened, path, os.O_RDONLY)
        except OSError as exc:
            raise opening_error(path, exc) from exc
        try:
            os.fsync(fd)  # dirty pages cannot be dropped until they are written
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            warn(f"{path!r} could not be dropped from the page cache ({exc.strerror or exc}); its next "
                 f"read may come from memory, not the disk, so a timing of it is not a cold one")
    finally:
        if opened:
            os.close(opened[0])


_LOCKS = {}  # a directory's real path, or a save's lock file -> threading.Lock, where flock is not to be had
_LOCKS_LOCK = threading.Lock()
#: The descriptors opened for an ``flock`` (held, or waited for) -> the thread that opened them
#: (see _after_fork_in_child).
_FLOCKED = {}
#: Held while such a descriptor is opened and recorded, or closed and forgotten, and by a fork
#: (see _before_fork): a child never copies one that :data:`_FLOCKED` does not name.
_RECORDING = threading.RLock()
#: Opens under :data:`_RECORDING` never wait: a named pipe's open for reading would wait for a writer,
#: and every fork of the process with it. It changes nothing for a file's or a directory's ``flock``.
_NEVER_WAIT = getattr(os, "O_NONBLOCK", 0)


def _open_recorded(path, flags, opened, mode=0o777) -> int:
    """``os.open``, the descriptor appended to the list ``opened`` and recorded in :data:`_FLOCKED` as this thread's.

    Recorded from its opening, not once locked, and before any fork can copy it: a copy a child took
    before the ``flock`` shares the open file the lock then belongs to, and would keep it locked as well.
    Appended as it is opened (:func:`open_into`): the caller lets go of what ``opened`` holds at the end
    of its turn, whatever comes.

    Returns:
        the descriptor.

    Raises:
        OSError: ``os.open``'s.
    """
    me = threading.get_ident()
    with _RECORDING:
        _FLOCKED[open_into(opened, path, flags | _NEVER_WAIT, mode)] = me
    return opened[-1]


def _let_go(opened) -> None:
    """Close the descriptor last in ``opened``, releasing its ``flock``, and forget it (no fork copies it unrecorded).

    In the middle of a turn only: its end lets go in place (:func:`_turn`).
    An interrupt (Ctrl-C) lands on entering a function, and one on entering this one leaves the
    descriptor in ``opened`` for that end; it is taken out only as it is closed.
    """
    fd = opened[-1]
    with _RECORDING:
        try:
            del opened[-1]
            del _FLOCKED[fd]
        finally:
            os.close(fd)


def _turn(body, *args):
    """A turn on a descriptor: the generator ``body(*args, opened)``, then the descriptor it left in ``opened`` closed.

    ``body`` opens the descriptor into the list ``opened`` (:func:`_open_recorded`), takes the turn and yields
    to the turn's block; the turn ends with it, whatever comes. The close is in place here, not a call of
    :func:`_let_go`: an interrupt (Ctrl-C) lands on entering a function, and one that landed there would keep
    the descriptor, and its ``flock``, for good. One that lands on resuming this generator or ``body`` lands
    inside the ``try``.

    Args:
        body: a generator function that yields once.
        args: ``body``'s arguments before ``opened``.

    Yields:
        what ``body`` yields: a generator for :func:`contextlib.contextmanager`.
    """
    opened = []  # the descriptor, from its opening: let go of at the end, whatever comes
    try:
        return (yield from body(*args, opened))
    finally:
        if opened:  # no interrupt lands before the close
            with _RECORDING:
                try:
                    _FLOCKED.pop(opened[0], None)  # not yet recorded where an interrupt came as it was opened
                finally:
                    os.close(opened[0])


def _after_fork_in_child() -> None:
    """Free every turn that another thread of the parent held, in a forked child.

    The child does not have that thread. A threading lock of :data:`_LOCKS`
    (or :data:`_LOCKS_LOCK`) it held would stay held. A ``flock`` belongs to
    the open file, which the child shares through the copy of the descriptor
    it inherits: the lock would outlive the parent's release for as long as
    the child lives, and the child's own save (or the parent's next one of a
    checkpoint) would wait for it forever. Closing the copy leaves the
    parent's lock as it is. The forking thread's own turns stay its own.
    A descriptor is recorded from its opening, and no fork comes between
    the two (:func:`_before_fork`): a copy taken before or while another
    thread waited for the lock is closed too.
    """
    global _LOCKS_LOCK
    _LOCKS_LOCK = threading.Lock()
    _LOCKS.clear()
    me = threading.get_ident()
    try:
        for fd, thread in list(_FLOCKED.items()):
            if thread != me:
                del _FLOCKED[fd]
                with contextlib.suppress(OSError):
                    os.close(fd)
    finally:
        _RECORDING.release()  # taken by _before_fork, in the forking thread: the child's


def _before_fork() -> None:
    """Wait until no thread is between opening a lock's descriptor and recording it, or closing and forgetting it."""
    _RECORDING.acquire()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_RECORDING.release, after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def locked(directory, shared=False):
    """Hold a lock on ``directory`` for the block: saves take turns, and loads wait for them.

    A save that replaces a checkpoint's files must not interleave with
    another save of it (each would remove the version the other is about to
    point at), nor with a load (which would find its version removed).
    ``flock`` on the directory itself, so no lock file is left behind:
    exclusive for a save, ``shared`` for a load; it holds between threads
    (each opens its own descriptor) and between processes of this host.
    Where there is no ``flock`` (Windows, a file system that refuses it) or
    the directory cannot be opened, only threads of this process take turns,
    loads included.

    Args:
        directory: an existing directory (a checkpoint, or the parent its first save creates it in).
        shared: a load's lock, which other loads may hold at the same time.
    """
    return _turn(_directory_turn, directory, shared)


def _directory_turn(directory, shared, opened):
    """:func:`locked`'s turn, on the directory's descriptor, opened into ``opened`` (:func:`_turn`)."""
    flocked = False
    if fcntl is not None:
        with contextlib.suppress(OSError):  # not to be opened, or no flock (ENOLCK): threads still take turns
            fcntl.flock(_open_recorded(directory, os.O_RDONLY, opened), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            flocked = True
    if flocked:
        yield
    else:
        with _LOCKS_LOCK:
            lock = _LOCKS.setdefault(os.path.realpath(directory), threading.Lock())
        with lock:
            yield


#: The suffix of the lock file beside a file being saved (:func:`one_save_at_a_time`).
_LOCK_SUFFIX = ".speedswap.lock"
#: The lock files of the saves this thread holds: a save inside another (a check, then the write)
#: takes no second turn.
_HELD = threading.local()


def _lock_path(path) -> str:
    """``.<name>.speedswap.lock`` beside the file ``path`` (beside its target, where ``path`` is a symbolic link)."""
    directory, name = os.path.split(os.path.realpath(os.fspath(path)))
    return os.path.join(directory, f".{_cut(name, _LOCK_SUFFIX)}{_LOCK_SUFFIX}")


def _flocked(lock, opened) -> bool:
    """Take the exclusive ``flock`` of the file ``lock`` (made if need be) on a descriptor appended to ``opened``.

    Its holder removes the file as it lets go: a lock won on a file that has
    no name any more (another one may have it by now) is nobody's turn, so
    it is let go of, and taken again on the file at the name.

    Args:
        lock: the lock file.
        opened: where the descriptor goes as it is opened (see :func:`_open_recorded`); the caller lets go
            of it, whatever comes. At most one: each lost one is let go of before the next is opened.

    Returns:
        whether the ``flock`` is held; False where no lock is to be had (the file cannot be made, or its
        file system has no ``flock``).

    Raises:
        PathError: something that is not a regular file is at ``lock`` (nothing waits on it, and it stays).
    """
    if fcntl is None:
        return False
    while True:
        try:
            # Read-only: one left by another user is taken all the same.
            fd = _open_recorded(lock, os.O_RDONLY | os.O_CREAT, opened, 0o666)
        except OSError:  # a read-only or full directory: the save's own temporary fails the same way
            return False
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # its holder would remove it as it lets go
            raise PathError(f"{lock!r}, the lock file saves to the file beside it take turns on, is not a "
                            f"regular file (a named pipe, socket or device?); move it away and save again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            won, named = os.fstat(fd), os.stat(lock)
        except FileNotFoundError:  # removed by the holder this one waited for
            won = named = None
        except OSError:  # a file system without flock (ENOLCK)
            return False
        if won is not None and (won.st_dev, won.st_ino) == (named.st_dev, named.st_ino):
            return True
        _let_go(opened)


@contextlib.contextmanager
def one_save_at_a_time(path):
    """Hold the lock of saves to the file ``path`` for the block: they take turns, waiting for each other.

    A save that checks what it would replace (another table's dataset in an
    HDF5 file, a file that is no checkpoint) and then renames its file over
    it must not interleave with another save to the same path: both would
    pass the check, and the last rename would silently replace what the
    other wrote. :func:`atomic_output` holds the lock over each write; a
    save that checks first holds it over its check too (a thread that holds
    it takes it again at no cost).

    ``flock`` on the file :func:`_lock_path` names, which holds between
    threads (each opens its own descriptor) and between processes of this
    host. The holder removes that file as it lets go, so none is left
    behind; one a killed save left is taken and removed by the next save
    to ``path``. Where the file cannot be made (a read-only directory, where
    the save then fails as it would without it) or ``flock`` is not to be
    had (Windows, ENOLCK), only threads of this process take turns.

    Args:
        path: the file to be saved.

    Raises:
        PathError: something that is not a regular file (a named pipe) is where the lock file goes.
    """
    return _turn(_save_turn, path)


def _save_turn(path, opened):
    """:func:`one_save_at_a_time`'s turn, on the lock file's descriptor, opened into ``opened`` (:func:`_turn`)."""
    lock = _lock_path(as_path(path))
    held = _HELD.__dict__.setdefault("locks", set())
    if lock in held:
        yield
        return
    try:
        flocked = _flocked(lock, opened)
        held.add(lock)
        if flocked:
            try:
                yield
            finally:  # before the close: a save that wins the file then sees it has no name
                with contextlib.suppress(OSError):  # left behind, it is taken by the next save (see _flocked)
                    os.unlink(lock)
        else:
            with _LOCKS_LOCK:
                turns = _LOCKS.setdefault(lock, threading.Lock())
            with turns:
                yield
    finally:
        held.discard(lock)


@contextlib.contextmanager
def rewriting_in_place(path, identity: tuple) -> Iterator[Optional[int]]:
    """Hold the file ``path`` names open read-write, and its turn, while its contents are rewritten in place.

    For a load into an ``mmap`` table, which writes the rows into the table's
    file where they lie, its torn mark saying so on disk meanwhile
    (:func:`~speedswap.table.loading_into`). The file is opened, then checked:
    a check of the path, then an open of it, would mark whatever file another
    save renamed to that path in between. Two such loads at once (two
    processes mapping the file) would mix their rows, and the first to finish
    would lift the mark from rows the other is still writing: they take
    turns, on an exclusive ``flock`` of the file itself, which holds between
    threads (each opens its own descriptor) and processes of this host, and
    which the system lets go of when its holder dies. Where ``flock`` is not
    to be had (Windows, ENOLCK) they do not take turns.

    Args:
        path: the file's path.
        identity: ``(st_dev, st_ino)`` of the file it must be (the one the table maps).

    Yields:
        the descriptor, open read-write; None where ``path`` names no file any
        more, or another one: the map alone holds that file, and no one opens it.

    Warns:
        RuntimeWarning: before it waits for another load's turn, which a hung
            holder would keep for good.

    Raises:
        PathError: the file cannot be opened read-write (``errno`` says why).
    """
    return _turn(_rewrite_turn, path, identity)


def _rewrite_turn(path, identity, opened):
    """:func:`rewriting_in_place`'s turn, on the file's descriptor, opened into ``opened`` (:func:`_turn`)."""
    try:
        fd = _open_recorded(path, os.O_RDWR, opened)
    except (FileNotFoundError, NotADirectoryError):  # removed, or a directory on the way moved
        fd = None
    except OSError as exc:
        raise rewriting_error(path, exc) from exc
    if fd is not None:
        opened_file = os.fstat(fd)
        if (opened_file.st_dev, opened_file.st_ino) != tuple(identity):
            _let_go(opened)  # replaced by a rename: not the file rewritten
            fd = None
    if fd is not None and fcntl is not None:
        with contextlib.suppress(OSError):  # no flock (ENOLCK): loads do not take turns
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # said before the wait: a hung holder would keep it waiting for good
                warn(f"a load into {os.fspath(path)!r} waits for another one into that file to finish "
                     f"(another process or thread mapping it holds its turn); if none is running, "
                     f"look for a process that hangs with the file open (lsof {os.fspath(path)!r})")
                fcntl.flock(fd, fcntl.LOCK_EX)
    yield fd


def rewrite_under_way(fd: int) -> bool:
    """Whether a load holds the turn of the file open as ``fd`` now (:func:`rewriting_in_place`), on this host.

    Tells a file a load is writing from one a stopped load left: both carry
    the torn mark. False where ``flock`` is not to be had.

    Args:
        fd: the file, open for reading.

    Returns:
        bool
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no flock (ENOLCK)
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)  # on the open file: a fork meanwhile keeps no lock
    return False
