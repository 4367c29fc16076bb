"""Host writes that land late, as a GPU's do: the numpy backend with the cuda backend's asynchrony.

On the cuda backend a write into a zero-copy host table (``pinned``,
``mapped``) is a kernel queued on a stream: ``scatter`` returns before the
rows are written, and host code that touches the table (a numpy view of it
included) must wait for the table's kernels first (``Backend.wait_host``).
The numpy backend writes at once, so a missing wait passes on the CPU.
:func:`land_host_writes_late` makes its ``scatter`` queue the write instead,
and land the queue, in order, at the table's next ``gather`` or ``scatter``
(a later kernel on the stream runs after the queued ones) or ``wait_host``
(the host waited for them): never sooner, the latest a GPU may be. A read
or a write through a view in between sees the table as a GPU's host may.

It differs from the cuda backend in two ways. Every storage kind's writes
land late, a stricter test (there only the zero-copy kinds' do: ``pageable``
and ``mmap`` rows are written by the CPU at once). A table collected
without ``close()`` drops the writes still queued (there its memory is
released only after them): close the tables of a test that uses it.
"""

from speedswap.backends.cpu import NumpyBackend

__all__ = ["land_host_writes_late"]

#: The key of a buffer's queued writes in its ``pending`` (the cuda backend keeps its events there).
_QUEUE = "writes landing late"


def _land(backend, buffer, write):
    """Write every queued write of ``buffer``, in order, with ``write`` (the backend's own scatter)."""
    for rows, values in buffer.pending.pop(_QUEUE, []):
        write(backend, buffer, rows, values)


def land_host_writes_late(monkeypatch):
    """Make the numpy backend's writes into host tables land late, until ``monkeypatch`` is undone.

    Args:
        monkeypatch: the test's pytest ``monkeypatch`` fixture.
    """
    write, gather = NumpyBackend.scatter, NumpyBackend.gather

    def queue(self, buffer, rows, values):
        _land(self, buffer, write)
        # The values as they are now: a later write into their tensor comes after the kernel on its stream.
        buffer.pending.setdefault(_QUEUE, []).append((rows.clone(), values.detach().clone()))

    def gather_after(self, buffer, rows, out):
        _land(self, buffer, write)
        return gather(self, buffer, rows, out)

    monkeypatch.setattr(NumpyBackend, "scatter", queue)
    monkeypatch.setattr(NumpyBackend, "gather", gather_after)
    monkeypatch.setattr(NumpyBackend, "wait_host", lambda self, buffer: _land(self, buffer, write))
