"""One process: a forked process may not train a table it shares with the process that built it.

``model.share_memory()`` and then training in ``torch.multiprocessing``
workers (Hogwild) trains one in-memory table from several processes. An
offloaded table lives in host memory that a forked process holds a
copy-on-write copy of: its training would reach that copy alone, never the
table of the process that built it, silently. With ``storage="mmap"`` the
forked process shares the table's and the optimizer state's files but not
the working set, the device cache or the step's bookkeeping: the processes'
steps would write the files over one another. Such training is refused
before anything changes. A forked process may still read the table (eval
forwards: what it held when the process forked), and train a copy of its own
(pageable or pinned storage, without ``share_memory()``), as an in-memory
model's forked copy trains its own.
"""

import os

import torch

from ..errors import StateError

__all__ = ["OneProcess"]

#: How many forks this process is down from the first one that imported speedswap: counted in
#: the child at each fork, so a check in a process that never forked reads one integer.
_forks = 0


def _count_fork():
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere processes are spawned, and pickling is refused
    os.register_at_fork(after_in_child=_count_fork)


class OneProcess:
    """The process that built an embedding, to refuse training it shares with a forked one.

    Args:
        name: the embedding, as the error names it.
    """

    def __init__(self, name: str):
        self._name, self._pid, self._forks = name, os.getpid(), _forks

    def refuse_shared_training(self, weight: torch.Tensor, mmap: bool) -> None:
        """Refuse to train in a forked process what the process that built the embedding holds too.

        Costs the comparison of two integers in the process that built it.

        Args:
            weight: the embedding's weight: ``model.share_memory()`` (Hogwild training) moved it
                to shared memory.
            mmap: the table lives in mmap files, which the processes share.

        Raises:
            StateError: in a forked process, ``weight`` in shared memory or ``mmap``; nothing changes.
        """
        if _forks == self._forks or not (mmap or weight.is_shared()):  # is_shared() makes a storage object
            return
        pid = os.getpid()
        if mmap:
            raise StateError(
                f"{self._name} was built in process {self._pid}, and this process ({pid}), forked from "
                f"it, would train it: its table and optimizer state are mmap files the two processes "
                f"share, but its working set, device cache and step bookkeeping are this process's "
                f"copies, so the processes' steps would write the files over one another. Nothing was "
                f"changed: build the embedding in the process that trains it, with a path of its own")
        raise StateError(
            f"{self._name} was built in process {self._pid}, and this process ({pid}), forked from it, "
            f"would train it after model.share_memory() (Hogwild): in memory the processes train one "
            f"shared table, but this one lives in host memory of process {self._pid} that this process "
            f"holds only a copy-on-write copy of, so its training would never reach that table. Nothing "
            f"was changed: train the embedding in the process that built it (to split one table over "
            f"several processes, build a ShardedOffloadedEmbedding in each, under torch.distributed)")
