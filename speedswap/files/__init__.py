"""File formats: ``.npy`` and HDF5 reading, writing, validation; all-or-nothing loads.

The code is in :mod:`~speedswap.files.tables` for now, until it is split by concept.
"""

from .tables import *  # noqa: F401,F403
from .tables import __all__  # noqa: F401
