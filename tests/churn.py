"""Races on purpose: a step repeated on another thread while the test's own code runs."""

import contextlib
import sys
import threading


@contextlib.contextmanager
def churning(step):
    """Run ``step(i)`` for i = 0, 1, ... on another thread for the duration of the with-block.

    The interpreter hands the GIL over every microsecond meanwhile, so the
    steps land inside the block's loops (registries read while another
    thread adds to them or removes from them).
    """
    stop = threading.Event()

    def run():
        i = 0
        while not stop.is_set():
            step(i)
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
