"""The seal of speedswap's HDF5 files: a CRC-32 of their HDF5 metadata, checked before HDF5 reads any of it.

The HDF5 C library trusts the metadata it parses (superblock, object headers,
B-trees, heaps): one flipped bit there can make it spin forever (deaf to
Ctrl-C) or crash the process, so a damaged checkpoint must be refused before
h5py opens it. :func:`~speedswap.files.h5.write_h5` reserves an HDF5 user
block (bytes HDF5 itself never reads; every HDF5 tool still opens the file)
and, once HDF5 has closed the file, :func:`seal` fills it with this header
(little-endian)::

    0   16 bytes  MAGIC
    16  uint32    CRC-32 of the metadata: every byte of the file outside the
                  spans left out, with these two CRC fields read as zeros
    20  uint32    CRC-32 of the header: MAGIC and bytes 24 to its end
    24  uint32    VERSION
    28  uint32    n, the number of spans left out
    32  uint64    the file's size
    40  n x (uint64 offset, uint64 size): the spans left out, in file order

The writer chooses the spans left out: the datasets' raw data, so that
checking a file of any size reads only a few kilobytes (each dataset's own
CRC-32 covers its rows), and the few bytes an HDF5 writer changes in place
merely by opening the file (the superblock's consistency flags). :func:`check_seal`
verifies a file that starts with MAGIC, and refuses one that starts with a
few bits off it (a seal damaged in its first bytes must not pass for a file
without one). The seal is a save's last write into the file: one whose user
block is there but empty where MAGIC goes is a save that stopped before it
(or a copy of its temporary file), whose HDF5 metadata nothing can verify,
and is refused as incomplete. Files without a user block (an older
speedswap's, h5py's default) or with another tool's bytes in it are not checked.
"""

import os
import struct
import zlib

from ..errors import FileFormatError

__all__ = ["MAGIC", "VERSION", "SUPERBLOCK", "userblock_size", "seal", "check_seal"]

MAGIC = b"speedswap-hdf5\r\n"
#: The HDF5 superblock's signature, at the file's start or after a user block.
SUPERBLOCK = b"\x89HDF\r\n\x1a\n"
VERSION = 1
_FIXED = struct.Struct("<16sIIIIQ")  # MAGIC, metadata CRC, header CRC, VERSION, n, file size
_SPAN = struct.Struct("<QQ")
_CRCS = slice(16, 24)  # the two CRC fields, outside what either covers
#: A file whose first bytes differ from MAGIC in at most this many bits holds a damaged seal.
_NEAR_BITS = 8
_READ_BYTES = 1 << 20


def userblock_size(spans: int) -> int:
    """The HDF5 user block to reserve for a seal that leaves out ``spans`` spans.

    HDF5 takes a power of two of at least 512 bytes.
    """
    size = 512
    while size < _FIXED.size + spans * _SPAN.size:
        size *= 2
    return size


def seal(path, spans) -> None:
    """Write the seal into the user block of the HDF5 file ``path``, which HDF5 has closed.

    Args:
        path: a file written by h5py with ``userblock_size=userblock_size(len(spans))`` or more.
        spans: ``(offset, size)`` of the bytes the metadata's CRC-32 leaves out, none
            overlapping, all after the user block.

    Raises:
        OSError: the file could not be read or written.
    """
    spans = sorted(spans)
    size = os.path.getsize(path)
    body = struct.pack("<IIQ", VERSION, len(spans), size) + b"".join(_SPAN.pack(*span) for span in spans)
    header = MAGIC + bytes(8) + body
    with open(path, "r+b") as f:
        f.write(header)
        metadata_crc = _metadata_crc(f, spans, size)
        f.seek(_CRCS.start)
        f.write(struct.pack("<II", metadata_crc, zlib.crc32(MAGIC + body)))


def check_seal(f, path) -> None:
    """Verify the seal of an HDF5 file open for reading, if it has one; read only its header and metadata.

    Args:
        f: the file, open in binary mode (its position is left anywhere).
        path: its path, for the messages.

    Raises:
        FileFormatError: the file starts with MAGIC, or within a few bits of it, and
            its seal or its metadata does not match: it is damaged. Or its HDF5
            user block is empty where MAGIC goes: the save that wrote it stopped
            before sealing it.
        OSError: the file could not be read.
    """
    f.seek(0)
    start = f.read(_FIXED.size)
    if len(start) < _FIXED.size or start[:len(MAGIC)] != MAGIC:
        if _bits_off(start[:len(MAGIC)]) <= _NEAR_BITS:
            raise _damaged(path, "its seal's magic string is damaged")
        if not any(start[:len(MAGIC)]) and _has_user_block(f):
            raise FileFormatError(
                f"{os.fspath(path)!r} is an incomplete speedswap save: the seal a save writes into its "
                f"first bytes last, once the rest is on disk, is missing (they are empty), so the save "
                f"stopped before it finished, or the file is a copy of its temporary file. Nothing "
                f"can verify its HDF5 metadata, so nothing was read from it: restore it from another "
                f"copy, or save it again (if another HDF5 writer made it, with an empty user block, "
                f"and you trust it, copy its datasets into a new file with h5py and load that)")
        return  # no seal: a file from an older speedswap or another tool
    _, metadata_crc, header_crc, version, count, size = _FIXED.unpack(start)
    if _FIXED.size + count * _SPAN.size > min(size, os.fstat(f.fileno()).st_size):
        raise _damaged(path, "its seal's header is damaged")
    body = start[24:] + f.read(count * _SPAN.size)
    if zlib.crc32(MAGIC + body) != header_crc:
        raise _damaged(path, "its seal's header is damaged")
    if version != VERSION:
        raise FileFormatError(f"{os.fspath(path)!r} is sealed in format {version}, which this speedswap "
                              f"does not know (it knows {VERSION}); read it with a newer speedswap")
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        raise _damaged(path, f"it is truncated ({actual} bytes of the {size} written)" if actual < size
                       else f"it is {actual - size} bytes longer than written")
    spans = [_SPAN.unpack_from(body, 16 + i * _SPAN.size) for i in range(count)]
    if not _in_order(spans, size):
        raise _damaged(path, "its seal's list of spans is damaged")
    if _metadata_crc(f, spans, size) != metadata_crc:
        raise _damaged(path, "its metadata checksum does not match")


def _has_user_block(f) -> bool:
    """Whether the HDF5 superblock of the open file ``f`` follows a user block (where HDF5 looks: 512, 1024, ...)."""
    size = os.fstat(f.fileno()).st_size
    at = 512
    while at + len(SUPERBLOCK) <= size:
        f.seek(at)
        if f.read(len(SUPERBLOCK)) == SUPERBLOCK:
            return True
        at *= 2
    return False


def _bits_off(start: bytes) -> int:
    """How many bits ``start`` differs from MAGIC in (missing bytes count as 8)."""
    return (sum(bin(a ^ b).count("1") for a, b in zip(start, MAGIC)) + 8 * (len(MAGIC) - len(start)))


def _in_order(spans, size) -> bool:
    """Whether ``spans`` lie after the fixed header, inside ``size`` bytes, in order, none overlapping."""
    end = _FIXED.size
    for offset, length in spans:
        if offset < end or offset + length > size:
            return False
        end = offset + length
    return True


def _metadata_crc(f, spans, size) -> int:
    """The CRC-32 of every byte of the open file ``f`` outside ``spans`` (in order), the CRC fields read as zeros.

    A file shorter than ``size`` (cut while it is read) gives the CRC-32 of the bytes it has.
    """
    crc, position = 0, 0
    for offset, length in [*spans, (size, 0)]:
        f.seek(position)
        while position < offset:
            piece = bytearray(f.read(min(_READ_BYTES, offset - position)))
            if not piece:
                return crc
            start, stop = max(_CRCS.start, position), min(_CRCS.stop, position + len(piece))
            if start < stop:
                piece[start - position:stop - position] = bytes(stop - start)
            crc = zlib.crc32(piece, crc)
            position += len(piece)
        position = offset + length
    return crc


def _damaged(path, what) -> FileFormatError:
    return FileFormatError(f"{os.fspath(path)!r} is damaged: {what} (or another HDF5 writer changed it "
                           f"after speedswap saved it); nothing was read from it: restore it from another copy")
