"""Run many cases in forked children, so that one that hangs or crashes the process is seen, not suffered.

A fault-injection test reads thousands of damaged files; the HDF5 C library
can spin forever (ignoring SIGINT) or die by a signal on one of them. Forking
per case is slow, so a child runs the cases in turn and reports each outcome
as one line; when it hangs or dies, that case is recorded as such and a new
child goes on with the next case. A child also ends itself (SIGALRM, whose
default action no C loop can ignore) when a case runs past twice the
timeout, so none outlives a parent that was killed while it hung.
"""

import os
import select
import signal

__all__ = ["outcomes_in_children"]


def outcomes_in_children(cases, check, timeout: float = 5.0) -> list:
    """``[check(case) for case in cases]``, each computed in a forked child.

    Args:
        cases: the cases, in order.
        check: ``case -> str``, one line with no newline; it must catch what it expects to be raised.
        timeout: seconds one case may take before its child is killed.

    Returns:
        the outcomes in the order of ``cases``: ``check``'s line, ``"hang"`` for a case
        that ran past ``timeout`` (its child is killed), ``"died: signal N"`` or
        ``"died: exit N"`` for one whose child ended without reporting it (a raise
        out of ``check`` is exit 1).
    """
    outcomes = []
    while len(outcomes) < len(cases):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no return into pytest, whatever happens
            code = 1
            try:
                os.close(read_fd)
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                for case in cases[len(outcomes):]:
                    signal.alarm(int(2 * timeout) + 1)
                    os.write(write_fd, (check(case) + "\n").encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_fd)
        outcomes += _reports(read_fd, pid, len(cases) - len(outcomes), timeout)
    return outcomes


def _reports(read_fd, pid, count, timeout) -> list:
    """The lines child ``pid`` writes to ``read_fd``, up to ``count``, then what stopped it short."""
    reports, pending, hung = [], b"", False
    try:
        while len(reports) < count:
            ready, _, _ = select.select([read_fd], [], [], timeout)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                hung = True
                break
            data = os.read(read_fd, 1 << 16)
            if not data:
                break
            pending += data
            *lines, pending = pending.split(b"\n")
            reports += [line.decode() for line in lines]
    except BaseException:  # Ctrl-C: no child left running
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if hung:
        reports.append("hang")
    elif len(reports) < count:
        reports.append(f"died: signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"died: exit {os.WEXITSTATUS(status)}")
    return reports
