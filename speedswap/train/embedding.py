"""OffloadedEmbedding: an ``nn.Embedding`` whose table and optimizer state live in host memory.

>>> import torch, speedswap as ss
>>> emb = ss.OffloadedEmbedding(1_000, 4, max_rows=64, storage="pageable", backend="numpy")
>>> opt = torch.optim.Adam(emb.parameters(), lr=0.01)
>>> emb.attach(opt)                      # Adam's moments live in host tables too
>>> loss = emb(torch.tensor([[3, 999], [3, 5]])).pow(2).sum()
>>> loss.backward(); opt.step(); opt.zero_grad()    # rows 3, 5, 999 written back once each
"""

import os

import torch
import torch.nn.functional as F

from .checkpoint import load_tables, save_tables
from ..errors import OptionError, StateError
from .row_state import NarrowedStep, RowState
from ..table import HostTable
from .working_set import WorkingSet

__all__ = ["OffloadedEmbedding"]


def _is_npy(path):
    return os.fspath(path).lower().endswith(".npy")


class OffloadedEmbedding(torch.nn.Module):
    """A drop-in ``nn.Embedding`` for tables larger than device memory.

    The full ``(num_embeddings, embedding_dim)`` table is a
    :class:`~speedswap.HostTable`. While training, each ``forward`` gathers the
    rows its ids need into :attr:`weight`, the step's working set of at most
    ``max_rows`` distinct rows (several forward calls in one step share it, so
    gradient accumulation works). After :meth:`attach`, the optimizer's
    ``step()`` narrows :attr:`weight` and the optimizer's per-row state to the
    rows touched, updates them, and writes rows and state back to the host,
    each distinct row once. The result is lazy training: exactly what the
    optimizer would do to the touched rows of an in-memory ``nn.Embedding``,
    with every untouched row (and its state) left alone.

    In eval mode or under ``torch.no_grad()`` ``forward`` reads the table
    directly, with no capacity limit.

    ``state_dict()`` holds only :attr:`weight`, the ``max_rows`` working-set
    scratch (not the table): save the table and optimizer state with
    :meth:`save`, and the optimizer's scalar state (``step``) with
    ``optimizer.state_dict()``.

    Args:
        num_embeddings: rows of the table.
        embedding_dim: row length.
        max_rows: the working set's capacity: the most distinct rows one step
            may touch.
        storage: where the table (and optimizer state) lives: ``pinned``,
            ``mapped``, ``pageable``, ``mmap`` (files in the directory ``path``)
            or ``device``.
        dtype: the rows' torch dtype.
        padding_idx: as in ``nn.Embedding``: this row starts at zero and gets
            no gradient.
        backend: ``"auto"``, ``"cuda"`` or ``"numpy"``.
        path: for ``storage="mmap"``, the directory for ``table.npy`` and the
            optimizer state files.

    Raises:
        OptionError: bad sizes, padding_idx or storage.
    """

    def __init__(self, num_embeddings, embedding_dim, *, max_rows, storage="pinned",
                 dtype=torch.float32, padding_idx=None, backend="auto", path=None):
        super().__init__()
        if not isinstance(max_rows, int) or max_rows < 1:
            raise OptionError(f"max_rows must be a positive int, got {max_rows!r}")
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise OptionError(f"padding_idx must be in [0, {num_embeddings}), got {padding_idx!r}")
        if storage == "mmap":
            if path is None:
                raise OptionError("storage='mmap' keeps the table in files: pass path= a directory")
            os.makedirs(path, exist_ok=True)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_rows, self.padding_idx = max_rows, padding_idx
        self._storage, self._backend, self._path = storage, backend, path
        self.table = HostTable.empty(num_embeddings, embedding_dim, dtype, storage, backend,
                                     self._file("table"))
        self.table.normal_()  # nn.Embedding's initialisation
        if padding_idx is not None:
            self.table.scatter([padding_idx], torch.zeros(1, embedding_dim, dtype=dtype))
        self.weight = torch.nn.Parameter(
            torch.zeros(max_rows, embedding_dim, dtype=dtype, device=self.table.device))
        self._full = self.weight.data
        self._working_set = WorkingSet(max_rows, num_embeddings, self.table.device)
        self._state = None
        self._narrowed = None
        self._hooks = ()

    def _file(self, name):
        return None if self._path is None else os.path.join(self._path, f"{name}.npy")

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, max_rows={self.max_rows}, "
                f"storage={self.table.storage!r}"
                + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}"))

    # ------------------------------------------------------------- training
    def attach(self, optimizer):
        """Offload ``optimizer``'s per-row state for :attr:`weight` and hook its ``step()``.

        Attaching (again, or to another optimizer) starts the offloaded
        optimizer state afresh.

        Args:
            optimizer: a ``torch.optim`` optimizer whose params include :attr:`weight`.

        Raises:
            OptionError: the optimizer does not hold :attr:`weight`, or its
                state is not element-wise (LBFGS).
        """
        state = RowState(optimizer, self.weight, self.num_embeddings, self.weight.dtype,
                         self._storage, self._backend, self._path)
        for handle in self._hooks:
            handle.remove()
        self._state = state
        self._hooks = (optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step))

    def forward(self, ids):
        """The rows of ``ids``: a tensor of shape ``(*ids.shape, embedding_dim)``.

        Args:
            ids: integer ids of any shape (tensor on the CPU or the table's
                device, numpy array, or list).

        Raises:
            IdError, DTypeError, DeviceError: bad ids.
            CapacityError: the step touches more than ``max_rows`` distinct rows.
            StateError: training before :meth:`attach`.
        """
        if not (self.training and torch.is_grad_enabled()):
            return self.table.gather(ids)
        if self._state is None:
            raise StateError("call emb.attach(optimizer) before training: the optimizer's "
                             "step() is where the updated rows are written back")
        ws = self._working_set
        if ws.size == 0 and self.padding_idx is not None:
            self._gather_new(*ws.add(torch.tensor([self.padding_idx])))  # always slot 0
        local, first_new = ws.add(ids)
        self._gather_new(local, first_new)
        return F.embedding(local, self.weight,
                           padding_idx=None if self.padding_idx is None else 0)

    def _gather_new(self, _local, first_new):
        rows = self._working_set.rows[first_new:]
        if len(rows):
            with torch.no_grad():
                self.table.gather(rows, out=self._full[first_new:first_new + len(rows)])

    def _before_step(self, optimizer, args, kwargs):
        rows = self._working_set.rows
        if not len(rows):
            return
        self._narrowed = NarrowedStep(self.weight, len(rows), self._state.needs_sparse_grad)
        self._state.gather(rows)

    def _after_step(self, optimizer, args, kwargs):
        rows = self._working_set.rows
        if not len(rows):
            return
        self._narrowed.restore()
        self._state.scatter(rows)
        self.table.scatter(rows, self._full[:len(rows)], check_unique=False)
        self._working_set.clear()

    # ---------------------------------------------------------- checkpoints
    def _tables(self):
        tables = {"table": self.table}
        if self._state is not None:
            tables.update({f"optimizer.{name}": t for name, t in self._state.tables.items()})
        return tables

    def _attrs(self):
        optimizer = "" if self._state is None else type(self._state.optimizer).__name__
        return {"optimizer": optimizer}

    def save(self, path):
        """Write the table and all offloaded optimizer state to one checkpoint, atomically.

        Args:
            path: ``*.h5`` for one HDF5 file; ``*.npy`` for the table alone as
                a plain numpy file (an export, without optimizer state);
                otherwise a directory of ``.npy`` files (see :mod:`speedswap.train.checkpoint`).
        """
        if _is_npy(path):
            self.table.save(path)
            return
        save_tables(path, self._tables(), self._attrs())

    def load(self, path):
        """Restore a checkpoint written by :meth:`save` (attach the same optimizer class first).

        A ``*.npy`` path replaces the table's rows only (pretrained vectors, say)
        and leaves the optimizer state as it is.

        Restore the optimizer's own ``state_dict`` too: it holds the step count.

        Raises:
            FileFormatError: another shape, optimizer or a bad file (nothing changes).
            StateError: called between a training forward and the optimizer step.
        """
        if self._working_set.size:
            raise StateError("load between a training forward and optimizer.step() would be "
                             "undone by the step; load between steps")
        if _is_npy(path):
            self.table.load_from(path)  # the table alone; optimizer state is left as it is
            return
        load_tables(path, self._tables(), self._attrs())
        if self._state is not None:
            self._state.mark_loaded()
