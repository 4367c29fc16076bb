"""File formats: ``.npy`` and HDF5 reading, writing, validation; all-or-nothing loads.

Every save goes through :func:`speedswap.atomic.atomic_output`: the data is
written to a temporary file beside the target, flushed to disk, and renamed
over the target only when complete, so a crash or a full disk mid-save leaves
the previous file intact. Every load validates the header (magic, dtype,
order, shape, and that the file is as long as its header says) before a
single row is read, and a load into a table in use reads and verifies every
row first (:func:`stage_table`), so a corrupt file changes nothing.

One module per concept, each importing only those above it in this list:
:mod:`~speedswap.files.base` is what every array file shares (the format from
a suffix, :class:`TableHeader`, row chunks and the single write point);
:mod:`~speedswap.files.npy` and :mod:`~speedswap.files.h5` are the two
formats (:mod:`~speedswap.files.h5seal` checks the HDF5 metadata of the files
speedswap wrote before HDF5 parses it); :mod:`~speedswap.files.tables` saves and loads whole tables in
either, bfloat16 and all-or-nothing staging included.
"""

from .base import (H5_SUFFIXES, NPY_SUFFIXES, TableHeader, check_matches, file_format, identity,
                   mapped_identity, row_ranges, suffix_format)
from .h5 import open_h5, read_before_replacing, read_h5_header, read_h5_into, write_h5
from .npy import (MappedFile, create_npy_memmap, is_npy_torn, map_npy, mark_npy_torn, npy_data_bytes,
                  open_npy_memmap, read_npy_header, read_npy_into, write_npy)
from .tables import (StagedRows, check_table_matches, check_table_shape, read_table, read_table_header,
                     save_table, stage_table, stored_dtype)

__all__ = [
    "identity",
    "mapped_identity",
    "NPY_SUFFIXES",
    "H5_SUFFIXES",
    "file_format",
    "TableHeader",
    "read_npy_header",
    "map_npy",
    "open_npy_memmap",
    "is_npy_torn",
    "mark_npy_torn",
    "create_npy_memmap",
    "npy_data_bytes",
    "read_npy_into",
    "write_npy",
    "read_h5_header",
    "read_h5_into",
    "open_h5",
    "read_before_replacing",
    "check_matches",
    "write_h5",
    "row_ranges",
    "MappedFile",
    "suffix_format",
    "stored_dtype",
    "read_table_header",
    "check_table_shape",
    "check_table_matches",
    "save_table",
    "read_table",
    "stage_table",
    "StagedRows",
]
