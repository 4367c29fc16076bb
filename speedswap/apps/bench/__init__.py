"""Benchmarks inside the package, so an installed wheel can measure itself.

``python -m speedswap bench`` runs :func:`run_transport_bench`; ``bench --all``
runs :func:`run_all` (every gpu test and GPU benchmark, ``SUMMARY.md``). The
scripts in the checkout's ``benchmarks/`` call the same modules:

* :mod:`.timing` -- the machine's description, interleaved medians, tables, JSON
* :mod:`.transport` -- HostTable gather/scatter vs torch, numpy, SpeedTorch's CuPy method, copy ceilings
* :mod:`.training_step` -- a skip-gram Adam step, offloaded vs in memory
* :mod:`.feeder` -- BatchFeeder vs DataLoader, a numpy loop and the copy limit
* :mod:`.gpu_tests` -- the checkout's ``gpu`` tests in a subprocess
* :mod:`.chart`, :mod:`.summary` -- the PNG chart and ``SUMMARY.md``
* :mod:`.suite` -- what the command line runs
"""

from .suite import DEFAULT_OUT, run_all, run_transport_bench

__all__ = ["DEFAULT_OUT", "run_all", "run_transport_bench"]
