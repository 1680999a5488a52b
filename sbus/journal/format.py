"""The journal's on-disk format, sans-IO: bytes in, bytes out.

A segment file is::

    header (32 bytes) | block | block | ... | [index | trailer]   (index+trailer once sealed)

A *block* holds the messages of one flush, stored column-wise so a reader can turn
it into Arrow arrays without touching individual records::

    head (32 bytes): magic "SBJB", count, first_seq, keys_len, payloads_len, body crc32
    body: ts int64[count] | key offsets int32[count+1] | payload offsets int32[count+1]
          | key bytes | payload bytes | zero padding to a multiple of 8

Sequence numbers inside a block are consecutive (``first_seq + i``), so only the
first is stored.  The CRC lets recovery tell a complete block from a torn tail.

A sealed segment ends with an index (one entry per block: position, first_seq,
count, min/max receive time) and a fixed trailer pointing at it, so a reader can
split a segment into byte ranges without scanning it.

Nothing read from a file is trusted: every count, size, position and offset is checked
against the bytes actually there before it is used (`decode_block`, `decode_index`),
always, whether or not the CRC is verified.  A damaged file is a `FormatError`, never
an out-of-bounds view (which Arrow would turn into a crash) or a huge allocation.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from itertools import accumulate

try:  # the same CRC-32 as zlib's, ~10x as fast (SIMD); every block read is checked with it
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - the record extra installs it
    from zlib import crc32

__all__ = [
    "FILE_HEAD", "BLOCK_HEAD", "TRAILER", "INDEX_ENTRY", "FormatError", "Block", "BlockInfo",
    "encode_header", "decode_header", "encode_block", "block_parts", "decode_block_head",
    "decode_block", "check_offsets", "crc32",
    "encode_index", "decode_trailer", "decode_index", "block_size",
]

FILE_MAGIC = b"SBUSJRN1"
BLOCK_MAGIC = b"SBJB"
TRAILER_MAGIC = b"SBJEND01"
VERSION = 1

FILE_HEAD = struct.Struct("<8sqqI4x")          # magic, first_seq, created_ns, version
BLOCK_HEAD = struct.Struct("<4sIqIIII")        # magic, count, first_seq, klen, plen, crc, 0
INDEX_ENTRY = struct.Struct("<qqqqq")          # pos, first_seq, count, min_ts, max_ts
TRAILER = struct.Struct("<qqII8s")             # index_pos, blocks, index crc, 0, magic

#: Offsets are int32 (Arrow's ``binary``): a block must stay below 2 GiB of keys or payloads.
MAX_COLUMN_BYTES = 2**31 - 1


class FormatError(ValueError):
    """Bytes that are not (or no longer) a valid journal structure."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """Where a block is and what it holds (an index entry)."""

    pos: int
    first_seq: int
    count: int
    min_ts: int
    max_ts: int
    size: int = 0

    @property
    def end(self) -> int:
        return self.pos + self.size

    @property
    def next_seq(self) -> int:
        return self.first_seq + self.count


@dataclass(frozen=True, slots=True)
class Block:
    """One decoded block: column buffers as memoryviews into the bytes read (no copies)."""

    first_seq: int
    count: int
    ts: memoryview            # int64 nanoseconds since the epoch, one per record
    key_offsets: memoryview   # int32[count+1]
    payload_offsets: memoryview
    keys: memoryview
    payloads: memoryview

    def records(self):
        """``(seq, ts_ns, key, payload)`` tuples: convenient, not fast."""
        ts = self.ts.cast("q")
        ko = self.key_offsets.cast("i")
        po = self.payload_offsets.cast("i")
        for i in range(self.count):
            yield (self.first_seq + i, ts[i], bytes(self.keys[ko[i]:ko[i + 1]]),
                   bytes(self.payloads[po[i]:po[i + 1]]))


def encode_header(first_seq: int, created_ns: int) -> bytes:
    return FILE_HEAD.pack(FILE_MAGIC, first_seq, created_ns, VERSION)


def decode_header(data: bytes) -> tuple[int, int]:
    """``(first_seq, created_ns)`` of a segment header."""
    if len(data) < FILE_HEAD.size:
        raise FormatError("segment shorter than its header")
    magic, first_seq, created_ns, version = FILE_HEAD.unpack_from(data)
    if magic != FILE_MAGIC:
        raise FormatError("not an sbus journal segment (bad magic)")
    if version != VERSION:
        raise FormatError(f"unsupported journal version {version}")
    return first_seq, created_ns


def _pad(n: int) -> int:
    return -n % 8


def block_size(count: int, keys_len: int, payloads_len: int) -> int:
    """Total bytes of a block with these sizes (head included)."""
    body = 8 * count + 8 * (count + 1) + keys_len + payloads_len
    return BLOCK_HEAD.size + body + _pad(body)


def encode_block(first_seq: int, ts: array, keys: list[bytes], payloads: list[bytes]) -> bytes:
    """One block from parallel lists; *ts* is an ``array('q')`` of nanoseconds."""
    if not len(keys) == len(payloads) == len(ts):
        raise ValueError("a block needs equally long columns")
    koff = array("i", [0])
    koff.extend(accumulate(map(len, keys)))
    poff = array("i", [0])
    poff.extend(accumulate(map(len, payloads)))
    return b"".join(block_parts(first_seq, ts, koff, [b"".join(keys)], poff,
                                [b"".join(payloads)]))


def block_parts(first_seq: int, ts, key_offsets, keys: list, payload_offsets,
                payloads: list) -> list:
    """One block as buffers to write one after another (``os.writev``), head first.

    *ts* int64[count] and the offsets int32[count+1] (from 0) are buffers as laid out on
    disk; *keys* and *payloads* are lists of buffers whose concatenation the offsets point
    into, so nothing is copied here."""
    body = [memoryview(b).cast("B") for b in (ts, key_offsets, payload_offsets, *keys,
                                              *payloads)]
    count = len(body[0]) // 8
    klen = sum(map(len, body[3:3 + len(keys)]))
    plen = sum(map(len, body[3 + len(keys):]))
    if count == 0:
        raise ValueError("a block needs at least one record")
    if len(body[1]) != len(body[2]) or len(body[1]) != 4 * (count + 1):
        raise ValueError("offset columns must be int32[count + 1]")
    if klen > MAX_COLUMN_BYTES or plen > MAX_COLUMN_BYTES:
        raise ValueError("block too large")
    body.append(bytes(_pad(16 * count + 8 + klen + plen)))
    crc = 0
    for b in body:
        crc = crc32(b, crc)
    return [BLOCK_HEAD.pack(BLOCK_MAGIC, count, first_seq, klen, plen, crc, 0), *body]


def decode_block_head(data, pos: int = 0) -> tuple[int, int, int, int, int]:
    """``(count, first_seq, keys_len, payloads_len, crc)``; FormatError if not a block head."""
    if len(data) - pos < BLOCK_HEAD.size:
        raise FormatError("truncated block head")
    magic, count, first_seq, klen, plen, crc, _ = BLOCK_HEAD.unpack_from(data, pos)
    if magic != BLOCK_MAGIC or count == 0:
        raise FormatError("bad block head")
    return count, first_seq, klen, plen, crc


def decode_block(data, pos: int = 0, verify: bool = True) -> tuple[Block, int]:
    """The block at *pos* of *data* and the position after it.

    Raises FormatError for a torn or corrupt block (short, bad magic, bad CRC, offsets
    that do not rise from 0 to the column's length)."""
    count, first_seq, klen, plen, crc = decode_block_head(data, pos)
    size = block_size(count, klen, plen)
    end = pos + size
    if len(data) < end:
        raise FormatError("truncated block")
    view = memoryview(data)
    body = view[pos + BLOCK_HEAD.size:end]
    if verify and crc32(body) != crc:
        raise FormatError("block checksum mismatch")
    a = 8 * count
    b = a + 4 * (count + 1)
    c = b + 4 * (count + 1)
    d = c + klen
    block = Block(first_seq, count, body[:a], body[a:b], body[b:c], body[c:d], body[d:d + plen])
    check_offsets(block.key_offsets, klen, "key")
    check_offsets(block.payload_offsets, plen, "payload")
    return block, end


def check_offsets(offsets: memoryview, length: int, what: str) -> None:
    """Offsets must start at 0, never fall, and end at the column's length: otherwise an
    Arrow array built on them reads outside the block."""
    import numpy as np  # the journal's readers and writer use it anyway

    o = np.frombuffer(offsets, dtype="<i4")
    if o[0] != 0 or o[-1] != length or (len(o) > 1 and (np.diff(o) < 0).any()):
        raise FormatError(f"corrupt {what} offsets")


def encode_index(blocks: list[BlockInfo], index_pos: int) -> bytes:
    """Index plus trailer for a sealed segment whose index starts at *index_pos*."""
    index = b"".join(INDEX_ENTRY.pack(b.pos, b.first_seq, b.count, b.min_ts, b.max_ts)
                     for b in blocks)
    return index + TRAILER.pack(index_pos, len(blocks), crc32(index), 0, TRAILER_MAGIC)


def decode_trailer(data: bytes) -> tuple[int, int, int]:
    """``(index_pos, block_count, index_crc)`` from a segment's last TRAILER.size bytes."""
    if len(data) != TRAILER.size:
        raise FormatError("truncated trailer")
    index_pos, nblocks, crc, _, magic = TRAILER.unpack(data)
    if magic != TRAILER_MAGIC:
        raise FormatError("segment is not sealed (no trailer)")
    return index_pos, nblocks, crc


def decode_index(data: bytes, nblocks: int, crc: int, index_pos: int) -> list[BlockInfo]:
    """Index entries; each block's size is derived from its successor (the last one ends
    where the index starts)."""
    if len(data) != nblocks * INDEX_ENTRY.size or crc32(data) != crc:
        raise FormatError("corrupt segment index")
    raw = [INDEX_ENTRY.unpack_from(data, i * INDEX_ENTRY.size) for i in range(nblocks)]
    out = []
    for i, (pos, first_seq, count, lo, hi) in enumerate(raw):
        end = raw[i + 1][0] if i + 1 < nblocks else index_pos
        smallest = block_size(count, 0, 0) if count > 0 else 0
        if pos < FILE_HEAD.size or count <= 0 or end - pos < smallest or \
                (out and first_seq != out[-1].next_seq):
            raise FormatError(f"corrupt segment index (entry {i})")
        out.append(BlockInfo(pos, first_seq, count, lo, hi, end - pos))
    return out
