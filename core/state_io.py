"""statecache's binary state format: a header, then tagged sections with lengths.

Layout (little-endian; docs/state-format.md has the full table)::

    magic   4 bytes  b"SCST"
    version u16      FORMAT_VERSION (2; version 1 blobs still read)
    flags   u16      StateFlags used when writing
    count   u32      number of sections
    count x section:
        tag     4 bytes (b"RECR" recurrent, b"KVAT" attention, ...)
        length  u64     bytes of the payload that follows
        crc32   u32     zlib CRC-32 of the payload (version 2 only)
        payload

The checksum turns a flipped bit anywhere in a payload (a position, a
sequence id, a state value) into a refused blob naming its section, instead
of a silently different state; the structural checks of every memory still
run on top (a well-formed but inconsistent blob is refused by them).

Memories write their payload with :class:`Writer` and read it with
:class:`Reader`, whose every read names the field, so a truncated or corrupt
blob raises :class:`~statecache.errors.StateError` naming what was wrong.  A
composite memory concatenates the sections of its parts with
:func:`pack_sections` and splits them with :func:`unpack_sections`, validates
every part, and only then applies any.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from statecache.dtypes import DType
from statecache.errors import StateError

MAGIC = b"SCST"
#: Written by this library.  Version 1 (no checksums) is still read.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
_HEADER = struct.Struct("<4sHHI")
_SECTION_V1 = struct.Struct("<4sQ")
_SECTION = struct.Struct("<4sQI")  # version 2: tag, length, crc32 of the payload
#: Header flag bits a reader understands (``StateFlags``: PARTIAL_ONLY, ON_DEVICE, WITH_PLANES).
#: A reader older than WITH_PLANES refuses such a blob by its flags, naming the unknown bit.
KNOWN_FLAGS = 0b111
#: The flag that changes which sections a blob holds: reader and writer must agree on it.
PARTIAL_ONLY = 1
#: The recurrent section ends with the snapshot planes (``StateFlags.WITH_PLANES``): the
#: blob's own bit decides how it is read.
WITH_PLANES = 4

#: dtype codes stored in blobs (never renumber).
DTYPE_CODES: dict[DType, int] = {DType.F32: 0, DType.F16: 1, DType.BF16: 30, DType.I32: 26}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


@dataclasses.dataclass
class RowSink:
    """Where :meth:`Writer.rows` records row blocks while :func:`rows_apart` is active:
    ``blocks`` lists ``(device, buffer, row indices)`` in the order the payload
    would hold them, ``nbytes`` their total size.  :meth:`gather` copies them back
    to back into one host buffer (the device's rows, without the metadata)."""

    blocks: list[tuple[Any, Any, np.ndarray]] = dataclasses.field(default_factory=list)
    nbytes: int = 0

    def gather(self, out: np.ndarray, progress: Any = None) -> None:
        """Every recorded block, back to back, into ``out`` (``uint8``, ``nbytes`` long);
        ``progress(n)``, when given, hears after each block that ``out[:n]`` is ready."""
        from statecache.hostmem import gather_rows  # hostmem sits above the backend protocol

        off = 0
        for device, buf, idx in self.blocks:
            n = idx.size * buf.shape[1] * buf.dtype.itemsize
            gather_rows(device, buf, idx, out[off : off + n])
            off += n
            if progress is not None:
                progress(off)


@dataclasses.dataclass(frozen=True)
class RowWrite:
    """One row write a memory's ``state_read`` is about to make: ``buf[idx] = rows``, where
    ``rows`` is a view a :class:`RowSource` handed out (see :func:`rows_landing`)."""

    device: Any
    buf: Any
    idx: np.ndarray
    rows: np.ndarray


def _view_key(rows: np.ndarray) -> tuple[int, int]:
    return int(rows.__array_interface__["data"][0]), int(rows.nbytes)


@dataclasses.dataclass
class RowSource:
    """Row blocks for :meth:`Reader.rows` while :func:`rows_apart` is active: taken
    from ``data`` (``uint8``) in order, from ``offset`` on.

    ``wait``, when given, is called once, by :func:`rows_ready`, before the first row
    is written: the rows may still be arriving while the metadata is validated (the
    views :meth:`take` hands out are only read when written), and ``wait`` returns
    once all of ``data`` is there, or raises why it never will be.

    ``land``, when given with ``wait``, is handed the writes a memory is about to make
    (:func:`rows_landing`) and returns those whose rows it will put straight into
    their destination instead of into ``data``: the memory's write of such a view is
    then skipped (:func:`rows_landed`)."""

    data: np.ndarray
    offset: int = 0
    wait: Callable[[], None] | None = None
    #: The wait happened only once the memory was writing (see :func:`rows_ready`).
    late: bool = False
    land: Callable[[list[RowWrite]], list[RowWrite]] | None = None
    #: The size of every block taken, in order.
    taken: list[int] = dataclasses.field(default_factory=list)
    #: The writes ``land`` took, by the identity of their view (which the write keeps
    #: alive), until the memory makes them (:func:`rows_landed`).
    landed: dict[int, RowWrite] = dataclasses.field(default_factory=dict)
    #: The same writes by their view's address and size, built when a memory writes
    #: through another view object than the one it announced (an equal slice).
    landed_at: dict[tuple[int, int], int] | None = None
    #: What the memory said to call when rows landed and the read then failed.
    spoil: Callable[[], None] | None = None

    def ready(self, writing: bool = False) -> None:
        """Block until every row is in ``data`` (see ``wait``); then a no-op."""
        wait, self.wait = self.wait, None
        if wait is not None:
            self.late = writing
            try:
                wait()
            except BaseException:
                self.abandon_landed()
                raise

    def abandon_landed(self) -> None:
        """The read fails after rows landed in free rows: tell the memory (its book is as
        before; the rows it had free hold other bytes now)."""
        if self.landed and self.spoil is not None:
            self.spoil()
        self.landed, self.landed_at = {}, None

    def take(self, n: int, field: str) -> np.ndarray:
        if self.offset + n > self.data.size:
            raise StateError(field, f"truncated rows: needs {n} bytes, {self.data.size - self.offset} left")
        out = self.data[self.offset : self.offset + n]
        self.offset += n
        self.taken.append(n)
        return out

    def at_end(self) -> None:
        if self.offset != self.data.size:
            raise StateError("rows", f"{self.data.size - self.offset} row bytes were sent but not read")


_ROWS: contextvars.ContextVar[RowSink | RowSource | None] = contextvars.ContextVar("statecache_rows", default=None)


@contextlib.contextmanager
def rows_apart(where: RowSink | RowSource) -> Iterator[RowSink | RowSource]:
    """Within this context the row blocks of every state payload live apart from its
    metadata: a :class:`Writer` records them into the :class:`RowSink` (the blob then
    holds metadata only, with each block's type code and row size), a :class:`Reader`
    takes them from the :class:`RowSource`.  A sequence transfer moves the rows as one
    contiguous tensor this way, while the same parsers validate the metadata as they
    validate a blob.  A blob written apart is not the state format (its rows are
    elsewhere, and a recurrent section carries its snapshot planes, see
    :func:`planes_apart`); never store one."""
    token = _ROWS.set(where)
    try:
        yield where
    finally:
        _ROWS.reset(token)


def rows_ready(writing: bool = False) -> None:
    """Memories call this in ``state_read`` after validating everything and before
    writing anything: inside :func:`rows_apart` with a :class:`RowSource` whose rows
    are still arriving (a sequence transfer validates the metadata while the rows
    are on the wire), it waits for them, and raises, with nothing written, when they
    never come.  Elsewhere a no-op.  ``writing``: called where rows are written
    (:func:`statecache.hostmem.scatter_rows`, for a memory that did not call it
    before), so a failure there may follow writes."""
    source = _ROWS.get()
    if isinstance(source, RowSource):
        source.ready(writing)


def rows_landing(writes: Callable[[], list[RowWrite]], spoil: Callable[[], None]) -> None:
    """Memories call this in ``state_read`` after validating everything and before
    :func:`rows_ready`, with ``writes()``: the row writes their commit will make into
    rows that nothing references now (free cells, never a shared row or the zero row),
    each with the view :meth:`Reader.rows` gave.  A sequence transfer receives such rows
    straight into their destination (no staging copy); the commit then skips those
    writes (:func:`rows_landed`) and only updates the book.  ``spoil()`` is called if
    the read fails after rows landed: the book is as before, but the memory must no
    longer trust what those free rows held (an undo that would bring such a cell back,
    see the memories' ``state_landing_failed``).  Elsewhere a no-op (``writes`` is not called)."""
    source = _ROWS.get()
    if isinstance(source, RowSource) and source.land is not None and source.wait is not None:
        source.spoil = spoil
        for w in source.land(writes()):
            source.landed[id(w.rows)] = w
        source.landed_at = None


def rows_landed(buf: Any, idx: np.ndarray, rows: np.ndarray) -> bool:
    """True when ``rows`` (a view from :meth:`Reader.rows`) already landed in ``buf[idx]``
    (:func:`rows_landing`): the write is done.  Raises ``RuntimeError`` when the view
    landed elsewhere (the commit does not write what the memory announced)."""
    source = _ROWS.get()
    if not isinstance(source, RowSource) or not source.landed or not isinstance(rows, np.ndarray):
        return False
    w = source.landed.pop(id(rows), None)  # the very view announced (alive in w: its id is its own)
    if w is None:  # another view object: the same bytes?
        if source.landed_at is None:  # (an address costs a microsecond: taken once per view, only here)
            source.landed_at = {_view_key(v.rows): k for k, v in source.landed.items()}
        k = source.landed_at.pop(_view_key(rows), None)
        w = None if k is None else source.landed.pop(k, None)
        if w is None:
            return False
    if w.buf is not buf or not _same_rows(w.idx, idx):
        raise RuntimeError("a memory wrote a landed row block elsewhere than it announced in rows_landing")
    return True


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two row-index arrays, without its overhead for the few rows
    of one sequence's block."""
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    return a.tolist() == b.tolist() if a.size <= 64 else bool(np.array_equal(a, b))


def planes_apart() -> bool:
    """True inside :func:`rows_apart`: a recurrent section then also carries the
    sequence's snapshot planes that are still valid (the state format holds plane 0
    only; a transfer keeps the rollback budget)."""
    return _ROWS.get() is not None


class Writer:
    """Accumulates little-endian fields."""

    def __init__(self) -> None:
        self._parts: list[bytes | memoryview] = []
        self.nbytes = 0

    def _add(self, part: bytes | memoryview) -> None:
        self._parts.append(part)
        self.nbytes += len(part)

    def u8(self, v: int) -> None:
        self._add(struct.pack("<B", v))

    def u32(self, v: int) -> None:
        self._add(struct.pack("<I", v))

    def i32(self, v: int) -> None:
        self._add(struct.pack("<i", v))

    def u64(self, v: int) -> None:
        self._add(struct.pack("<Q", v))

    def raw(self, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Append bytes; a contiguous array is kept as a view until :meth:`getvalue`
        (one copy, the join, instead of two)."""
        if isinstance(data, bytes):
            self._add(data)
        elif isinstance(data, np.ndarray) and data.flags.c_contiguous:
            self._add(memoryview(data.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
        else:
            self._add(bytes(data))

    def rows(self, device: Any, buf: Any, idx: np.ndarray) -> None:
        """The rows ``idx`` of the 2-D device buffer ``buf``, back to back (gathered
        on the device, one copy to the host); recorded instead inside :func:`rows_apart`."""
        where = _ROWS.get()
        if isinstance(where, RowSink):
            idx = np.asarray(idx, dtype=np.int64)
            where.blocks.append((device, buf, idx))
            where.nbytes += idx.size * buf.shape[1] * buf.dtype.itemsize
            return
        from statecache.hostmem import gather_rows

        self.raw(gather_rows(device, buf, np.asarray(idx, dtype=np.int64)))

    def name(self, s: str) -> None:
        b = s.encode()
        self.u8(len(b))
        self.raw(b)

    def getvalue(self) -> bytes:
        return b"".join(self._parts)

    def crc32(self) -> int:
        """zlib CRC-32 of everything written so far (without joining it)."""
        crc = 0
        for part in self._parts:
            crc = zlib.crc32(part, crc)
        return crc

    @property
    def parts(self) -> list[bytes | memoryview]:
        return self._parts


class Reader:
    """Reads fields from a buffer; every read names its field for errors."""

    def __init__(self, data: bytes | bytearray | memoryview, where: str = "") -> None:
        self.data = memoryview(bytes(data)) if not isinstance(data, memoryview) else data
        self.off = 0
        self.where = where

    def _take(self, n: int, field: str) -> memoryview:
        if n < 0 or self.off + n > len(self.data):
            raise StateError(
                self._f(field), f"truncated: needs {n} bytes at offset {self.off}, {len(self.data) - self.off} left"
            )
        out = self.data[self.off : self.off + n]
        self.off += n
        return out

    def _f(self, field: str) -> str:
        return f"{self.where}.{field}" if self.where else field

    def u8(self, field: str) -> int:
        return int(struct.unpack("<B", self._take(1, field))[0])

    def u32(self, field: str) -> int:
        return int(struct.unpack("<I", self._take(4, field))[0])

    def i32(self, field: str) -> int:
        return int(struct.unpack("<i", self._take(4, field))[0])

    def u64(self, field: str) -> int:
        return int(struct.unpack("<Q", self._take(8, field))[0])

    def raw(self, n: int, field: str) -> memoryview:
        return self._take(n, field)

    def rows(self, n_rows: int, row_bytes: int, dtype: DType, field: str) -> np.ndarray:
        """``n_rows`` rows of ``row_bytes`` as a read-only ``dtype`` array ``[n_rows, width]``
        (a view, no copy); taken from the :class:`RowSource` inside :func:`rows_apart`."""
        raw = self.row_bytes(n_rows * row_bytes, field)
        return raw.view(dtype.numpy).reshape(n_rows, row_bytes // dtype.itemsize)

    def row_bytes(self, n: int, field: str) -> np.ndarray:
        """``n`` bytes of row data as a ``uint8`` view (from the :class:`RowSource`
        inside :func:`rows_apart`)."""
        where = _ROWS.get()
        if isinstance(where, RowSource):  # the field's full name only for the error it raises
            return where.take(n, self._f(field) if where.offset + n > where.data.size else field)
        return np.frombuffer(self._take(n, field), dtype=np.uint8)

    def name(self, field: str) -> str:
        n = self.u8(field)
        try:
            return bytes(self._take(n, field)).decode()
        except UnicodeDecodeError as exc:
            raise StateError(self._f(field), "not valid UTF-8") from exc

    def match(self, want: bytes) -> bool:
        """Consume ``want`` when the next bytes are exactly it; else consume nothing and
        return False.  A parser whose fields all have one expected value (a memory's
        layout: layer ids, tensor names, dtype codes, row sizes) compares their bytes, as
        written by the same :class:`Writer` calls, in one step, and reads them field by
        field (naming what is wrong) only when they differ."""
        n = len(want)
        if self.data[self.off : self.off + n] != want:
            return False
        self.off += n
        return True

    def expect(self, field: str, got: Any, want: Any) -> None:
        if got != want:
            raise StateError(self._f(field), f"is {got!r}, this memory expects {want!r}")

    def fail(self, field: str, message: str) -> None:
        raise StateError(self._f(field), message)

    def at_end(self) -> None:
        if self.off != len(self.data):
            raise StateError(self._f("length"), f"{len(self.data) - self.off} unread trailing bytes")


def pack_sections(sections: Sequence[tuple[bytes, bytes | Writer]], flags: int = 0) -> bytes:
    """A whole blob from ``(tag, payload)`` pairs (the current format version, with
    checksums).  A payload may be the :class:`Writer` that wrote it: its parts are
    then copied once, into the blob, instead of being joined first."""
    flags = int(flags)
    if flags & ~KNOWN_FLAGS:
        raise ValueError(f"unknown state flags {flags:#x} (known: {KNOWN_FLAGS:#x})")
    parts: list[bytes | memoryview] = [_HEADER.pack(MAGIC, FORMAT_VERSION, flags, len(sections))]
    for tag, payload in sections:
        if len(tag) != 4:
            raise ValueError(f"section tag {tag!r} must be 4 bytes")
        if isinstance(payload, Writer):
            parts.append(_SECTION.pack(tag, payload.nbytes, payload.crc32()))
            parts += payload.parts
        else:
            parts.append(_SECTION.pack(tag, len(payload), zlib.crc32(payload)))
            parts.append(bytes(payload))
    return b"".join(parts)


def unpack_sections(data: Any, flags: int | None = None) -> tuple[int, list[tuple[bytes, memoryview]]]:
    """Validate the header, section lengths and checksums; returns ``(flags, [(tag, payload)])``.

    The blob's flags must not carry unknown bits.  ``flags``: the flags a
    memory whose sections depend on ``PARTIAL_ONLY`` (an iSWA pair, a hybrid)
    reads with; the blob's ``PARTIAL_ONLY`` bit must then equal the caller's
    (a partial blob holds other sections than a full one)."""
    try:
        raw = bytes(data) if not isinstance(data, bytes | bytearray | memoryview) else data
    except TypeError as exc:
        raise StateError("blob", f"expected bytes, got {type(data).__name__}") from exc
    mv = memoryview(raw)
    if len(mv) < _HEADER.size:
        raise StateError("magic", f"truncated: blob has {len(mv)} bytes, the header needs {_HEADER.size}")
    magic, version, blob_flags, count = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise StateError("magic", f"is {bytes(magic)!r}, expected {MAGIC!r}")
    if version not in READ_VERSIONS:
        raise StateError("version", f"is {version}, this library reads versions {', '.join(map(str, READ_VERSIONS))}")
    if blob_flags & ~KNOWN_FLAGS:
        raise StateError("flags", f"is {blob_flags:#x}: bits {blob_flags & ~KNOWN_FLAGS:#x} are not StateFlags")
    if flags is not None and (blob_flags ^ int(flags)) & PARTIAL_ONLY:
        written = "with" if blob_flags & PARTIAL_ONLY else "without"
        asked = "with" if int(flags) & PARTIAL_ONLY else "without"
        raise StateError("flags", f"the blob was written {written} PARTIAL_ONLY, read {asked} it")
    section = _SECTION if version >= 2 else _SECTION_V1
    off = _HEADER.size
    out = []
    for i in range(count):
        if off + section.size > len(mv):
            raise StateError(f"section[{i}].tag", "truncated: section header missing")
        tag, length, *crc = section.unpack_from(mv, off)
        off += section.size
        if off + length > len(mv):
            raise StateError(f"section[{i}].length", f"is {length}, only {len(mv) - off} bytes left (truncated)")
        payload = mv[off : off + length]
        if crc and zlib.crc32(payload) != crc[0]:
            name = bytes(tag).decode(errors="replace")
            raise StateError(f"section[{i}].crc32", f"section {name!r}: checksum mismatch (the blob is corrupt)")
        out.append((bytes(tag), payload))
        off += length
    if off != len(mv):
        raise StateError("length", f"{len(mv) - off} trailing bytes after the last section")
    return blob_flags, out


def expect_sections(sections: Sequence[tuple[bytes, memoryview]], tags: Sequence[bytes], reader: str) -> None:
    """The blob holds exactly the sections ``reader`` writes (``tags``), no more, no fewer.

    Each reader looks its sections up by tag, so without this a blob of another kind
    of memory that happens to contain them was accepted and its other sections
    silently dropped: a hybrid blob read into a KV cache restored the attention
    cells without the recurrent state, a hybrid-idx blob read into a plain hybrid
    lost its indexer, a hybrid blob read into a recurrent memory lost its attention
    cells, and the caller believed the sequence restored."""
    have = sorted(t for t, _ in sections)
    if have != sorted(tags):
        names = [t.decode(errors="replace") for t, _ in sections]
        want = [t.decode(errors="replace") for t in tags]
        raise StateError(
            "section", f"the blob holds sections {names}, a {reader} reads exactly {want} (a blob of another kind)"
        )


def find_section(sections: Sequence[tuple[bytes, memoryview]], tag: bytes) -> memoryview:
    found = [p for t, p in sections if t == tag]
    if len(found) != 1:
        have = [t.decode(errors="replace") for t, _ in sections]
        raise StateError("section", f"expected exactly one {tag.decode()} section, found {len(found)} in {have}")
    return found[0]
