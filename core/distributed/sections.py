"""The state format seen as metadata and row blocks, without a memory.

Resharding a checkpoint and checking a transfer before it is written need
to read a blob without the memory that wrote it.  Every section of the
format (docs/state-format.md) is a sequence of *metadata* (cell positions
and owners, layer indices, tensor names) and *row blocks* (a type code, a
row size, then one row per cell).  :func:`parse_section` splits a section
payload into exactly that: verbatim metadata chunks, which two ranks of a
tensor-parallel memory must agree on byte for byte, and :class:`RowBlock`\\ s,
whose rows each rank holds a different part of.  :meth:`Section.payload`
writes it back, with whatever rows the blocks hold now.

Only :mod:`statecache.state_io`'s public reader and writer are used, so the
container (header, section lengths, any field it grows) stays that module's
business.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

from statecache.dtypes import DType
from statecache.errors import StateError
from statecache.hybrid_idx import TAG_IDX
from statecache.kv_cache import KV_CELL_COUNT_EXT, TAG_KV, TAG_KV_BASE, TAG_KV_SWA, one_owner_records
from statecache.recurrent import SECTION_TAG as TAG_RECR
from statecache.state_io import CODE_DTYPES, Reader, Writer, planes_apart

#: Sections laid out as a KV cache: K rows, then V rows unless the cache is key-only.
KV_TAGS = {TAG_KV: True, TAG_KV_BASE: True, TAG_KV_SWA: True, TAG_IDX: False}
#: What each section tag holds, for error messages.
TAG_NAMES = {
    TAG_RECR: "recurrent",
    TAG_KV: "attention",
    TAG_KV_BASE: "attention.base",
    TAG_KV_SWA: "attention.swa",
    TAG_IDX: "indexer",
}


@dataclasses.dataclass
class RowBlock:
    """One state tensor (``key = ("recr", layer, name)``) or K/V layer
    (``key = ("k" | "v", layer)``) of a section: ``rows`` is ``uint8 [cells, row_bytes]``."""

    key: tuple[Any, ...]
    field: str
    type_code: int
    rows: np.ndarray
    #: Rows only, without the type code and row size before them: a recurrent section's
    #: snapshot planes, whose tensor's block (same key) already said both.
    bare: bool = False

    @property
    def dtype(self) -> DType:
        dtype = CODE_DTYPES.get(self.type_code)
        if dtype is None:
            raise StateError(f"{self.field}.type", f"unknown dtype code {self.type_code}")
        return dtype

    @property
    def elements(self) -> int:
        """Elements per row."""
        return int(self.rows.shape[1]) // self.dtype.itemsize


@dataclasses.dataclass
class Section:
    """A parsed section: ``parts`` alternates verbatim metadata (bytes) and row blocks;
    ``positions`` lists the positions of its cells (every stream)."""

    tag: bytes
    parts: list[bytes | RowBlock]
    positions: list[int]

    @property
    def name(self) -> str:
        return TAG_NAMES.get(self.tag, self.tag.decode(errors="replace"))

    @property
    def blocks(self) -> list[RowBlock]:
        return [p for p in self.parts if isinstance(p, RowBlock)]

    @property
    def metadata(self) -> list[bytes]:
        return [p for p in self.parts if isinstance(p, bytes)]

    def payload(self) -> bytes:
        w = Writer()
        for part in self.parts:
            if isinstance(part, RowBlock):
                if not part.bare:
                    w.i32(part.type_code)
                    w.u64(part.rows.shape[1])
                w.raw(np.ascontiguousarray(part.rows).data)
            else:
                w.raw(part)
        return w.getvalue()


class _Cutter:
    """Reads a payload, cutting it into verbatim chunks and row blocks."""

    def __init__(self, tag: bytes, payload: Any) -> None:
        self.data = memoryview(payload)
        self.r = Reader(self.data, TAG_NAMES.get(tag, tag.decode(errors="replace")))
        self.start = 0
        self.parts: list[bytes | RowBlock] = []

    def block(self, key: tuple[Any, ...], field: str, n_rows: int) -> None:
        """The rows of one tensor: everything since the last block is metadata."""
        self.parts.append(bytes(self.data[self.start : self.r.off]))
        code = self.r.i32(f"{field}.type")
        row_bytes = self.r.u64(f"{field}.row_bytes")
        rows = self.r.row_bytes(n_rows * row_bytes, f"{field}.rows").reshape(n_rows, row_bytes)
        self.parts.append(RowBlock(key, f"{self.r.where}.{field}", code, rows))
        self.start = self.r.off

    def bare_block(self, like: RowBlock, n_rows: int) -> None:
        """Rows of ``like``'s tensor without a type code and row size (snapshot planes)."""
        self.parts.append(bytes(self.data[self.start : self.r.off]))
        row_bytes = like.rows.shape[1]
        rows = self.r.row_bytes(n_rows * row_bytes, f"{like.field}.planes").reshape(n_rows, row_bytes)
        self.parts.append(RowBlock(like.key, f"{like.field}.planes", like.type_code, rows, bare=True))
        self.start = self.r.off

    def finish(self) -> list[bytes | RowBlock]:
        self.r.at_end()
        self.parts.append(bytes(self.data[self.start :]))
        return self.parts


def _parse_recurrent(tag: bytes, payload: Any, planes: bool) -> Section:
    c = _Cutter(tag, payload)
    r = c.r
    n = r.u32("cell_count")
    positions = []
    for i in range(n):
        positions.append(r.i32(f"cell[{i}].pos"))
        for k in range(r.u32(f"cell[{i}].n_seq_id")):
            r.i32(f"cell[{i}].seq_id[{k}]")
    r.u32("s_trans")
    r.u32("n_layer")
    tensors: list[RowBlock] = []
    for _ in range(r.u32("n_state_layers")):
        layer = r.u32("layer")
        for _ in range(r.u32(f"layer[{layer}].n_tensors")):
            name = r.name(f"layer[{layer}].tensor")
            c.block(("recr", layer, name), f"layer[{layer}].{name}", n)
            tensors.append(c.parts[-1])  # type: ignore[arg-type]
    if planes or planes_apart():  # snapshot planes: per cell how many, then per tensor their rows
        total = sum(r.u32(f"cell[{i}].n_planes") for i in range(n))
        for block in tensors:
            c.bare_block(block, total)
    return Section(tag, c.finish(), positions)


def _parse_kv(tag: bytes, payload: Any) -> Section:
    c = _Cutter(tag, payload)
    r = c.r
    positions = []
    for strm in range(r.u32("n_stream")):
        word = r.u32(f"stream[{strm}].cell_count")
        count = word & ~KV_CELL_COUNT_EXT
        ext = bool(word & KV_CELL_COUNT_EXT)
        one_owner = one_owner_records(r, count, ext)
        if one_owner is not None:  # a sequence's blob: fixed-size records, read at once
            positions += one_owner[0].tolist()
        for i in range(0 if one_owner is not None else count):
            positions.append(r.i32(f"stream[{strm}].cell[{i}].pos"))
            for _ in range(r.u32(f"stream[{strm}].cell[{i}].n_seq_id")):
                r.i32(f"stream[{strm}].cell[{i}].seq_id")
            if ext:
                r.i32(f"stream[{strm}].cell[{i}].ext_x")
                r.i32(f"stream[{strm}].cell[{i}].ext_y")
        if not count:
            continue
        n_layer = r.u32(f"stream[{strm}].n_layer")
        for kind in ("k", "v") if KV_TAGS[tag] else ("k",):
            for _ in range(n_layer):
                il = r.u32(f"stream[{strm}].{kind}_layer")
                c.block((kind, il), f"stream[{strm}].{kind}[{il}]", count)
    return Section(tag, c.finish(), positions)


def parse_section(tag: bytes, payload: Any, planes: bool = False) -> Section:
    """Split one section payload (from :func:`statecache.state_io.unpack_sections`);
    ``planes``: the blob has ``StateFlags.WITH_PLANES`` (a recurrent section then ends
    with the snapshot planes, cut into bare row blocks of their tensors' keys).
    Raises :class:`StateError` naming the field for a truncated or unknown section."""
    if tag == TAG_RECR:
        return _parse_recurrent(tag, payload, planes)
    if tag in KV_TAGS:
        return _parse_kv(tag, payload)
    raise StateError("section", f"no layout is known for section {tag.decode(errors='replace')!r}")


_U32 = struct.Struct("<I")
_POS_SEQS = struct.Struct("<iI")  # a cell's position and its number of sequence ids
_CODE_ROWS = struct.Struct("<iQ")  # a row block's type code and row size


class _Malformed(Exception):
    """The fast scan met something :func:`parse_section` must name."""


def scan_apart(tag: bytes, payload: Any) -> tuple[int | None, list[int]] | None:
    """What a transfer's receiver checks before it lets rows land, from one section of
    metadata whose rows are apart (:func:`statecache.state_io.rows_apart`): the last
    position of its cells (None: no cells) and the byte size of every row block, in
    order.  The same walk as :func:`parse_section` inside ``rows_apart`` (snapshot
    planes included), without building blocks, copying metadata or naming fields (a
    few tens of microseconds for a 16-layer hybrid instead of a few hundred); None
    when the section is unknown or not well formed, and then ``parse_section`` says
    what is wrong."""
    data = memoryview(payload).cast("B")
    try:
        if tag == TAG_RECR:
            return _scan_recurrent(data)
        if tag in KV_TAGS:
            return _scan_kv(data, KV_TAGS[tag])
    except (struct.error, _Malformed, UnicodeDecodeError, IndexError, ValueError):
        return None
    return None


def _scan_recurrent(d: memoryview) -> tuple[int | None, list[int]]:
    (n,) = _U32.unpack_from(d, 0)
    off, last = 4, None
    for _ in range(n):
        pos, n_seq = _POS_SEQS.unpack_from(d, off)
        off += 8 + 4 * n_seq
        last = pos if last is None else max(last, pos)
    off += 8  # s_trans, n_layer
    (n_state,) = _U32.unpack_from(d, off)
    off += 4
    row_sizes = []
    for _ in range(n_state):
        (n_tensors,) = _U32.unpack_from(d, off + 4)  # after the layer index
        off += 8
        for _ in range(n_tensors):
            length = d[off]
            bytes(d[off + 1 : off + 1 + length]).decode()  # a name parse_section would refuse
            off += 1 + length
            _, row_bytes = _CODE_ROWS.unpack_from(d, off)
            off += 12
            row_sizes.append(row_bytes)
    if off + 4 * n > len(d):
        raise _Malformed
    planes = int(np.frombuffer(d[off : off + 4 * n], dtype="<u4").sum(dtype=np.int64))  # per cell: its planes
    off += 4 * n
    if off != len(d):
        raise _Malformed
    return last, [n * rb for rb in row_sizes] + [planes * rb for rb in row_sizes]


def _scan_kv(d: memoryview, with_v: bool) -> tuple[int | None, list[int]]:
    (n_stream,) = _U32.unpack_from(d, 0)
    off, last = 4, None
    sizes = []
    for _ in range(n_stream):
        (word,) = _U32.unpack_from(d, off)
        off += 4
        count, ext = word & ~KV_CELL_COUNT_EXT, bool(word & KV_CELL_COUNT_EXT)
        width = 5 if ext else 3
        if count and off + count * width * 4 <= len(d):  # one owner per cell: every record read at once
            rec = np.frombuffer(d[off : off + count * width * 4], dtype="<i4").reshape(count, width)
            one_owner = bool((rec[:, 1] == 1).all() and (rec[:, 0] >= 0).all())
        else:
            one_owner = False
        if one_owner:
            top = int(rec[:, 0].max())
            last = top if last is None else max(last, top)
            off += count * width * 4
        else:
            for _ in range(count):
                pos, n_seq = _POS_SEQS.unpack_from(d, off)
                off += 8 + 4 * n_seq + (8 if ext else 0)
                last = pos if last is None else max(last, pos)
        if not count:
            continue
        (n_layer,) = _U32.unpack_from(d, off)
        off += 4
        for _ in range(n_layer * (2 if with_v else 1)):
            _, row_bytes = _CODE_ROWS.unpack_from(d, off + 4)  # after the layer index
            off += 16
            sizes.append(count * row_bytes)
    if off != len(d):
        raise _Malformed
    return last, sizes
