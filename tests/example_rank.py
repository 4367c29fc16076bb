"""One rank of an example's ``--distributed`` run, started the way torchrun would start it.

Run as ``python tests/example_rank.py RANK WORLD RENDEZVOUS EXAMPLE ARGS...``, one
process per rank: it joins a gloo group at the ``file://`` URL RENDEZVOUS (see
``tests/rendezvous.py``; torchrun's TCP port could be taken by a test running
beside), sets torchrun's ``RANK``/``WORLD_SIZE`` and runs ``examples/EXAMPLE.py``
as ``__main__`` with ARGS (the example finds the group joined).
"""

import os
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def main(rank, world, rendezvous, example, *args):
    os.environ.update(RANK=rank, WORLD_SIZE=world)
    dist.init_process_group("gloo", init_method=rendezvous, rank=int(rank), world_size=int(world))
    path = str(EXAMPLES / f"{example}.py")
    sys.argv = [path, *args]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main(*sys.argv[1:])
