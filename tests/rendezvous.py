"""Where the tests' ``torch.distributed`` ranks meet."""

import uuid
from pathlib import Path


def rendezvous_url(directory) -> str:
    """A fresh ``file://`` rendezvous in ``directory``, for ``init_process_group(init_method=...)``.

    Not a TCP port found free and closed again: between the close and rank 0's
    bind another process (a gloo connection of a test running beside) may take
    it, and the launch fails by chance.
    """
    return Path(directory, f"rendezvous-{uuid.uuid4().hex}").resolve().as_uri()
