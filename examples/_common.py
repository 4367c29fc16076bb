"""Command-line plumbing the examples share: the --device and --json flags, input files, errors.

The examples put every tensor where speedswap's backend computes (its
``device``), so a table, the model and the batches can never end up on
different devices.
"""

import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

import speedswap as ss
from speedswap.apps.arguments import (SEED_LIMIT, nonnegative_float, nonnegative_int,  # noqa: F401 (the examples')
                                       positive_float, positive_int, seed, share, table_directory)
from speedswap.apps.demo import BACKEND_OF_DEVICE, format_bytes
from speedswap.atomic import atomic_output


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except where there is none or the help already says it."""

    def _get_help_string(self, action):
        if action.default is None or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def existing_file(path):
    """argparse ``type=`` for an input file: a missing one is argparse's own one-line error."""
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no file at {path!r}")
    return path


def writable_file(path):
    """argparse ``type=`` for an output file: its directory exists and the path is not a directory.

    Checked when the arguments are read, so a bad path fails before a run
    that would only find out when it saves its results.
    """
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory: give a file path")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"no directory {directory!r} to write {path!r} in: create it first")
    if not os.access(path if os.path.exists(path) else directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path!r} cannot be written here (permission denied)")
    return path


def check_torchrun(parser, args):
    """``--distributed`` without torchrun's ``RANK``/``WORLD_SIZE`` is argparse's one-line error.

    Without them the process group would wait for a master that nobody started.
    """
    if args.distributed and not {"RANK", "WORLD_SIZE"} <= set(os.environ):
        parser.error(f"--distributed runs one process per rank: launch it with torchrun, e.g. "
                     f"torchrun --nproc-per-node 2 {parser.prog} --distributed")


def run(main):
    """Run an example's ``main()``: a speedswap error ends it with its message, not a traceback.

    The message says what was expected and how to fix it; a traceback into
    the library would only hide it. Other exceptions keep their traceback.
    A run that succeeded under torchrun (``--distributed``) ends every rank
    through :func:`_distributed.finish`.
    """
    try:
        main()
    except ss.SpeedswapError as exc:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {exc}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from _distributed import finish  # only under torchrun: a one-process run needs none of its imports
        finish()  # every rank, past a barrier; skips a teardown that gloo can abort


def add_common_arguments(parser):
    """Add ``--device``, ``--seed`` and ``--json`` to an argparse parser."""
    parser.add_argument("--device", choices=sorted(BACKEND_OF_DEVICE), default="auto",
                        help="where to train: cuda needs CuPy and a GPU; auto uses one if present")
    parser.add_argument("--seed", type=seed, default=0, help="seeds the data and the training (0 to 2**32 - 1)")
    parser.add_argument("--json", metavar="PATH", type=writable_file,
                        help="also write the reported figures to PATH")


def backend_and_device(args):
    """``(backend name, torch.device)`` for the ``--device`` flag.

    Under torchrun each rank first makes the GPU of its ``LOCAL_RANK`` the
    current one: speedswap's default device is the current CUDA device,
    which would otherwise be GPU 0 on every rank (NCCL refuses two ranks on one GPU).
    """
    backend = BACKEND_OF_DEVICE[args.device]
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and backend != "numpy" and torch.cuda.is_available():
        if int(local_rank) >= torch.cuda.device_count():
            raise SystemExit(f"local rank {local_rank} has no GPU of its own: this machine has "
                             f"{torch.cuda.device_count()}; start at most that many processes per "
                             f"node (torchrun --nproc-per-node), or train with --device cpu")
        torch.cuda.set_device(int(local_rank))
    return backend, ss.get_backend(backend).device


def progress_bar(batches, desc, quiet):
    """``batches`` under a tqdm progress bar that goes away when done; none with ``--quiet``.

    Shown on a terminal only (``disable=None``), so redirected logs are not
    flooded.
    """
    return tqdm(batches, desc=desc, leave=False, disable=True if quiet else None)


def memory_rows(memory, storage):
    """The report's memory rows: the host tables (in ``--storage``) and what the step keeps on its device.

    Args:
        memory: what :func:`speedswap.apps.demo.memory_summary` returned.
        storage: the ``--storage`` the tables were built with.

    Returns:
        ``[(label, value), ...]`` rows for ``format_rows``.
    """
    return [("host tables", f"{format_bytes(memory['host_bytes'] + memory['file_bytes'])} ({storage})"),
            (f"on {memory['device']} for the step", format_bytes(memory["device_bytes"]))]


def write_json(args, figures):
    """Write ``figures`` to ``--json`` when given (the tests read it), atomically.

    A run stopped mid-write (a full disk, a kill) leaves any previous file whole.
    """
    if args.json:
        with atomic_output(args.json) as tmp, open(tmp, "w") as f:
            json.dump(figures, f, indent=2)
