"""Move one sequence's state between two instances over torch.distributed.

Disaggregated serving prefills a request on one instance and decodes it on
another; for a recurrent or hybrid model the decode side needs everything
the sequence owns: its recurrent rows in every layer with the snapshot
planes still valid, its K/V cells with their positions, its indexer rows,
and its book entries.

The payload is the sequence's rows themselves, as one contiguous ``uint8``
tensor (a host tensor over gloo, a CUDA tensor over NCCL): the metadata of
``memory.state_write(seq)`` (positions, owners, layers, dtype codes, row
sizes: everything but the row data, see
:func:`statecache.state_io.rows_apart`), followed by every row block of the
sequence, each gathered from the device's pool by its rows alone (only the
sequence's cells and planes cross to the host, with one copy).  The
receiver reads that metadata with the memory's own ``state_read`` while the
rows come from the tensor, so sizes, dtypes, layers, positions and room are
checked exactly as for a blob, before anything is written.  Memories of
different sizes, stream layouts and backends exchange sequences this way;
``rows=False`` sends the whole state-format blob instead (the fallback: any
memory whose ``state_write`` writes its rows inline still works with
``rows=True``, its blob simply carries them).

The protocol keeps the receiver safe:

1. the sender sends a header: magic, protocol version, payload bytes, the
   sequence's first and last position, the state flags, an optional CRC-32
   of the payload, where the metadata ends, the message size of the rows,
   and a hash of the header itself;
2. the receiver checks the header (a corrupt one, or a payload larger than
   its memory could ever hold, is refused before it allocates anything) and
   answers *go* or *refused*;
3. the sender sends the metadata in one message, then the rows in
   :data:`CHUNK_BYTES` messages, each as soon as it is gathered (gathering
   overlaps the wire); the receiver posts every receive at once and, while
   the rows travel, checks that every part's last position is the header's
   and that the metadata uses every row byte, saves what the destination
   sequence held, and runs the memory's ``state_read``, which validates
   everything from the metadata and then, before writing anything, waits
   for the rows (:func:`statecache.state_io.rows_ready`: within ``timeout``
   seconds, the CRC checked when one was sent; a sender that dies or stalls
   raises :class:`~statecache.distributed.errors.TransferError` there, with
   nothing written), and writes them;
4. the receiver answers *accepted* or why not; the sender raises if not.

The receiving memory changes only in step 3's writes, after the whole state
is validated and the whole payload staged; if writing
fails after validation, the sequence's previous state (saved before the
read, with its planes) is put back.  So a transfer that fails anywhere
leaves the receiver as it was, and raises an error that says where it failed.

Limits: the rows are staged through host memory on each side, also for NCCL
(a device that is not host-visible gathers them with ``get_rows`` and
downloads only those); the receiver keeps as many planes as its own
``n_rs_seq`` allows.  After a transfer fails mid-payload the pair's message
stream is out of step (a send may still be pending): use a fresh ``tag``
(gloo) or a fresh group for the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from statecache.distributed.errors import TransferError
from statecache.distributed.wire import as_tensor, group_device, host_view, on_host, post, torch_dist, wait
from statecache.errors import StateError
from statecache.memory import StateFlags
from statecache.state_io import RowSink, RowSource, rows_apart, unpack_sections

MAGIC = 0x5343_5351  # "SCSQ"
PROTOCOL = 3  # 3: the metadata travels in its own message, ahead of the rows
ANSWER = 0x5343_4F4B  # "SCOK": the magic of every answer
_HEADER_WORDS = 10
_CRC_PRESENT = 1 << 16  # in the header's flags word, above the state flags
_ROWS_APART = 1 << 17  # the payload is metadata, then the rows (see statecache.state_io.rows_apart)
#: Rows travel in messages of this size, each sent as soon as it is gathered, so that
#: gathering the next overlaps the wire (the receiver posts every receive at once).
CHUNK_BYTES = 8 << 20
_MAX_CHUNKS = 1 << 16

OK = 0
BAD_HEADER = 1
TOO_LARGE = 2
BAD_CHECKSUM = 3
REFUSED = 4
FAILED = 5
ABORTED = 6
#: What each answer code means (sent as a number, told to the sender's user in words).
REASONS = {
    OK: "accepted",
    BAD_HEADER: "the header is corrupt",
    TOO_LARGE: "the payload is larger than the receiving memory could hold",
    BAD_CHECKSUM: "the payload does not match its CRC-32",
    REFUSED: "the receiving memory refused the state (layout, dtype, sizes or positions differ)",
    FAILED: "writing the state failed on the receiver (its previous state was put back)",
    ABORTED: "the sender could not write the sequence",
}


@dataclasses.dataclass(frozen=True)
class Transfer:
    """What moved: payload bytes, the sequence's positions, wall seconds on this side."""

    nbytes: int
    pos_min: int
    pos_max: int
    seconds: float


def _header_hash(words: list[int]) -> int:
    data = np.asarray(words[: _HEADER_WORDS - 1], dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _header(
    nbytes: int,
    pos_min: int,
    pos_max: int,
    flags: int,
    crc: int | None,
    meta_bytes: int | None = None,
    chunk: int = 0,
) -> list[int]:
    """The header words; ``meta_bytes``: the payload is that much metadata, then rows;
    ``chunk``: the payload comes in messages of that many bytes (0: one message)."""
    word = flags | (_CRC_PRESENT if crc is not None else 0) | (_ROWS_APART if meta_bytes is not None else 0)
    words = [MAGIC, PROTOCOL, nbytes, pos_min, pos_max, word, crc or 0, meta_bytes or 0, chunk]
    return [*words, _header_hash(words)]


def _check_header(words: list[int]) -> str | None:
    """Why the header is corrupt, or None."""
    if words[0] != MAGIC:
        return f"magic is {words[0]:#x}, expected {MAGIC:#x}"
    if words[_HEADER_WORDS - 1] != _header_hash(words):
        return "the header hash does not match its fields"
    if words[1] != PROTOCOL:
        return f"protocol version {words[1]}, this library speaks {PROTOCOL}"
    if words[2] < -1:
        return f"payload size {words[2]}"
    if words[5] & _ROWS_APART and not 0 < words[7] <= words[2]:
        return f"metadata of {words[7]} bytes in a payload of {words[2]}"
    if words[8] < 0 or (words[8] and words[2] > words[8] * _MAX_CHUNKS):
        return f"messages of {words[8]} bytes for a payload of {words[2]}"
    return None


class _Channel:
    """The sends and receives of one transfer with one peer (one group, one tag)."""

    def __init__(self, peer: int, group: Any, tag: int, timeout: float) -> None:
        self.torch, self.dist = torch_dist()
        self.peer, self.group, self.tag, self.timeout = peer, group, tag, timeout
        self.device = group_device(group)

    def ints(self, values: list[int]) -> Any:
        return self.torch.tensor(values, dtype=self.torch.int64, device=self.device)

    def send(self, t: Any, what: str) -> Any:
        return post(lambda: self.dist.isend(t, self.peer, group=self.group, tag=self.tag), self.peer, what)

    def post_recv(self, t: Any, what: str) -> Any:
        return post(lambda: self.dist.irecv(t, self.peer, group=self.group, tag=self.tag), self.peer, what)

    def recv(self, t: Any, what: str) -> Any:
        wait(self.post_recv(t, what), self.timeout, self.peer, what)
        return t

    def answer(self, code: int) -> None:
        """Best effort: a peer that is gone cannot hear why (the caller raises anyway)."""
        try:
            wait(self.send(self.ints([ANSWER, code]), "answering"), min(self.timeout, 5.0), self.peer, "answering")
        except TransferError:
            pass

    def hear(self, what: str) -> int:
        words = self.recv(self.ints([0, 0]), what).tolist()
        if words[0] != ANSWER or words[1] not in REASONS:
            raise TransferError(self.peer, f"rank {self.peer} answered {words}, not a transfer answer")
        return int(words[1])


def send_sequence(
    memory: Any,
    seq_id: int,
    dst: int,
    group: Any = None,
    *,
    flags: int = StateFlags.NONE,
    timeout: float = 60.0,
    checksum: bool = False,
    tag: int = 0,
    rows: bool = True,
) -> Transfer:
    """Send sequence ``seq_id`` of ``memory`` to global rank ``dst`` (which calls
    :func:`recv_sequence`).  The sender's memory is only read.  Raises
    :class:`TransferError` when the receiver refuses (the reason in words), dies or
    does not answer within ``timeout`` seconds.  ``checksum``: add a CRC-32 of the
    payload (one more pass over it on each side; gloo and NCCL deliver intact bytes,
    so it guards against bugs, not the wire; the rows are then gathered before they
    are sent).  ``rows``: send the sequence's rows and snapshot planes as a tensor
    behind their metadata (default); False sends the state-format blob of
    ``state_write`` (no planes: the receiver can roll back only after its next
    multi-token write)."""
    t0 = time.perf_counter()
    ch = _Channel(dst, group, tag, timeout)
    try:
        pos_min, pos_max = int(memory.seq_pos_min(seq_id)), int(memory.seq_pos_max(seq_id))
        fill = None
        if rows:
            payload, meta_bytes, fill = _rows_payload(memory, seq_id, int(flags))
        else:
            payload, meta_bytes = memory.state_write(seq_id, flags), None
    except Exception:
        try:  # tell the receiver not to wait for a payload
            abort = ch.ints(_header(-1, -1, -1, int(flags), None))
            wait(ch.send(abort, "sending the abort"), min(timeout, 5.0), dst, "sending the abort")
        except TransferError:
            pass
        raise
    _offer(ch, payload, pos_min, pos_max, int(flags), checksum, f"sequence {seq_id}", meta_bytes, fill)
    return Transfer(len(payload), pos_min, pos_max, time.perf_counter() - t0)


def _rows_payload(memory: Any, seq_id: int, flags: int) -> tuple[np.ndarray, int, Callable[..., None]]:
    """The sequence as one contiguous host buffer: the metadata of its state (the state
    format's, with the valid snapshot planes), then every row block (only the sequence's
    rows); the metadata's length; and ``fill(progress=None)``, which gathers the rows
    from the device into the buffer block by block, calling ``progress(n)`` when the
    first ``n`` bytes of the buffer are ready."""
    sink = RowSink()
    with rows_apart(sink):
        meta = memory.state_write(seq_id, flags)
    out = _buffer("send", np, len(meta) + sink.nbytes)
    out[: len(meta)] = np.frombuffer(meta, dtype=np.uint8)

    def fill(progress: Callable[[int], None] | None = None) -> None:
        sink.gather(out[len(meta) :], None if progress is None else lambda n: progress(len(meta) + n))
        if progress is not None:
            progress(len(out))

    return out, len(meta), fill


def _offer(
    ch: _Channel,
    blob: bytes | np.ndarray,
    pos_min: int,
    pos_max: int,
    flags: int,
    checksum: bool,
    what: str,
    meta_bytes: int | None = None,
    fill: Callable[..., None] | None = None,
) -> None:
    """The sender's side of the protocol for one payload (see the module docstring).
    ``fill``: the payload's rows are not gathered yet; ``fill(progress)`` gathers them
    and the payload goes in :data:`CHUNK_BYTES` messages as they become ready."""
    if fill is not None and checksum:  # the CRC goes in the header: everything first
        fill()
        fill = None
    crc = zlib.crc32(blob if isinstance(blob, bytes) else blob.data) if checksum else None
    chunk = CHUNK_BYTES if meta_bytes is not None else 0
    header = _header(len(blob), pos_min, pos_max, flags, crc, meta_bytes, chunk)
    sent = ch.send(ch.ints(header), "sending the header")
    code = ch.hear("waiting for the answer to the header")
    if code != OK:
        raise TransferError(ch.peer, f"rank {ch.peer} refused {what}: {REASONS[code]}")
    works: list[Any] = []
    if meta_bytes is None:
        works.append(ch.send(as_tensor(blob, ch.device), "sending the payload"))
    else:  # the metadata first, on its own, so the receiver validates it while the rows travel
        host = np.frombuffer(blob, dtype=np.uint8) if not isinstance(blob, np.ndarray) else blob
        if on_host(ch.device):
            tensor = as_tensor(host, ch.device)  # the buffer itself: rows gathered into it are sent from it
        else:  # NCCL: each message is uploaded once its bytes are gathered, then sent from the device
            tensor = ch.torch.empty(len(blob), dtype=ch.torch.uint8, device=ch.device)

        def send(lo: int, hi: int, what: str) -> None:
            if not on_host(ch.device):
                tensor[lo:hi].copy_(ch.torch.from_numpy(host[lo:hi]))
            works.append(ch.send(tensor[lo:hi], what))

        send(0, meta_bytes, "sending the metadata")
        cuts = _row_messages(len(blob), meta_bytes, chunk)
        if fill is None:
            for lo, hi in cuts:
                send(lo, hi, "sending the rows")
        else:

            def progress(ready: int) -> None:  # send every message whose rows are all gathered
                while len(works) <= len(cuts) and cuts[len(works) - 1][1] <= ready:
                    send(*cuts[len(works) - 1], "sending the rows")

            fill(progress)
    code = ch.hear("waiting for the answer to the payload")
    wait(sent, ch.timeout, ch.peer, "sending the header")
    for work in works:
        wait(work, ch.timeout, ch.peer, "sending the payload")
    if code != OK:
        raise TransferError(ch.peer, f"rank {ch.peer} refused {what}: {REASONS[code]}")


def _row_messages(nbytes: int, meta_bytes: int, chunk: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` byte ranges of the payload's row messages: after the metadata
    (its own message), ``chunk`` bytes at a time (none when there are no rows)."""
    return [(lo, min(lo + chunk, nbytes)) for lo in range(meta_bytes, nbytes, chunk)]


def default_max_bytes(memory: Any) -> int:
    """The largest payload :func:`recv_sequence` accepts by default: twice every byte the
    memory holds (a sequence's rows never exceed its memory; metadata per cell is
    smaller than a cell's rows) plus 1 MiB."""
    return 2 * int(sum(memory.memory_breakdown().values())) + (1 << 20)


def recv_sequence(
    memory: Any,
    seq_id: int,
    src: int,
    group: Any = None,
    *,
    timeout: float = 60.0,
    max_bytes: int | None = None,
    tag: int = 0,
) -> Transfer:
    """Receive the sequence global rank ``src`` sends (:func:`send_sequence`) into
    sequence ``seq_id`` of ``memory``, replacing what ``seq_id`` held.

    Works between memories of different sizes, stream layouts and backends (the
    state format's metadata describes the sequence, not the memory); of the
    snapshot planes that arrive, this memory keeps as many as its ``n_rs_seq``.  Raises
    :class:`TransferError` (no or a corrupt header, a payload over ``max_bytes``, a
    sender that dies or stalls past ``timeout`` seconds, a bad checksum or
    positions) or :class:`~statecache.errors.StateError` (the memory refused the
    state: layout, dtype or sizes differ); in every case ``memory`` is as it was.
    """
    t0 = time.perf_counter()
    ch = _Channel(src, group, tag, timeout)
    limit = default_max_bytes(memory) if max_bytes is None else int(max_bytes)
    got = _take(ch, limit)
    try:
        _check_positions(got.meta, got.pos_max, got.rows)
    except StateError:
        got.abandon()
        ch.answer(REFUSED)
        raise
    # what a failure after validation must put back (an empty destination: nothing to save)
    held = max(memory.seq_pos_min(seq_id), memory.seq_pos_max(seq_id)) >= 0  # either part of a hybrid
    backup = _save(memory, seq_id, got.flags) if held else None
    # the rows travel while the above and state_read's validation run; it waits for them before writing
    source = None if got.rows is None else RowSource(got.rows, wait=got.arrive)
    try:
        _read(memory, got.meta, source, seq_id, got.flags)
    except TransferError:
        if source is not None and source.late:  # a memory that waited only once writing
            _put_back(memory, backup, seq_id, got.flags)
        raise  # else raised by the wait for the rows, before anything was written
    except StateError:
        got.abandon()
        ch.answer(REFUSED)  # state_read validates everything before writing: nothing changed
        raise
    except BaseException:
        got.abandon()
        _put_back(memory, backup, seq_id, got.flags)
        ch.answer(FAILED)
        raise
    got.arrive()  # a blob (rows inline) or a memory that wrote no rows: the payload is still complete
    ch.answer(OK)
    return Transfer(got.nbytes, got.pos_min, got.pos_max, time.perf_counter() - t0)


def _put_back(memory: Any, backup: tuple[bytes, np.ndarray] | None, seq_id: int, flags: int) -> None:
    """After a failure that may have written: the sequence's previous state, or nothing."""
    if backup is not None:
        _read(memory, *backup, seq_id, flags)
    else:
        memory.seq_rm(seq_id, -1, -1)


def _save(memory: Any, seq_id: int, flags: int) -> tuple[bytes, np.ndarray]:
    """Sequence ``seq_id`` as metadata and rows, its snapshot planes included, so that
    putting it back (:func:`_read`) restores its rollback budget too."""
    sink = RowSink()
    with rows_apart(sink):
        meta = memory.state_write(seq_id, flags)
    rows = np.empty(sink.nbytes, dtype=np.uint8)
    sink.gather(rows)
    return meta, rows


def _read(memory: Any, meta: Any, rows: np.ndarray | RowSource | None, seq_id: int, flags: int) -> None:
    """``state_read`` of a blob, or of metadata whose rows are apart (a RowSource whose
    ``wait`` the memory calls between validating and writing, or the rows themselves)."""
    if rows is None:
        memory.state_read(meta, seq_id, flags)
        return
    with rows_apart(rows if isinstance(rows, RowSource) else RowSource(rows)):
        memory.state_read(meta, seq_id, flags)


@dataclasses.dataclass
class _Arrival:
    """A payload whose header the receiver accepted: its metadata is here (a whole blob,
    for ``rows=False``), its rows (``rows``, a host array) may still be arriving;
    :meth:`arrive` waits for them (and checks the CRC), raising TransferError."""

    ch: _Channel
    nbytes: int
    pos_min: int
    pos_max: int
    flags: int
    meta: Any
    rows: np.ndarray | None
    pending: list[Any]
    finish: Callable[[], None]
    waited: bool = False

    def arrive(self) -> None:
        if self.waited:
            return
        self.waited = True
        what = "receiving the rows"
        for work in self.pending:
            wait(work, self.ch.timeout, self.ch.peer, what)
        self.pending = []
        self.finish()

    def abandon(self) -> None:
        """Refused before the rows arrived: let them arrive (best effort) so the pair's
        messages stay in step, within the timeout."""
        if not self.waited:
            with contextlib.suppress(TransferError):
                self.arrive()


def _take(ch: _Channel, limit: int) -> _Arrival:
    """The receiver's side up to a payload whose metadata it holds (the rows may still
    be on the wire: :meth:`_Arrival.arrive`); the final answer is the caller's."""
    src = ch.peer
    words = [int(x) for x in ch.recv(ch.ints([0] * _HEADER_WORDS), "receiving the header").tolist()]
    bad = _check_header(words)
    if bad is not None:
        ch.answer(BAD_HEADER)
        raise TransferError(src, f"corrupt header from rank {src}: {bad}; nothing was received")
    nbytes, pos_min, pos_max, flags_word, crc, meta_bytes, chunk = words[2:9]
    if nbytes == -1:
        raise TransferError(src, f"rank {src} could not write the sequence it was to send; nothing was received")
    if nbytes > limit:
        ch.answer(TOO_LARGE)
        raise TransferError(src, f"rank {src} announced {nbytes} bytes, more than max_bytes={limit}; refused")
    ch.answer(OK)
    payload = _receive_buffer(ch, nbytes)
    host = on_host(ch.device)
    flags = flags_word & 0xFFFF
    checked = flags_word & _CRC_PRESENT

    def check_crc(data: Any) -> None:
        if checked and zlib.crc32(data) != crc:
            raise TransferError(src, f"the payload from rank {src} does not match its CRC-32; nothing was written")

    if not flags_word & _ROWS_APART:  # a whole blob in one message
        ch.recv(payload, "receiving the payload")
        data = host_view(payload)
        try:
            check_crc(data)
        except TransferError:
            ch.answer(BAD_CHECKSUM)
            raise
        return _Arrival(ch, nbytes, pos_min, pos_max, flags, data, None, [], lambda: None, waited=True)
    # every message posted at once, into its place: the metadata, then the rows
    first = ch.post_recv(payload[:meta_bytes], "receiving the metadata")  # posted first: messages match in order
    works = [ch.post_recv(payload[lo:hi], "receiving the rows") for lo, hi in _row_messages(nbytes, meta_bytes, chunk)]
    wait(first, ch.timeout, src, "receiving the metadata")
    meta = host_view(payload[:meta_bytes])
    # over NCCL the rows land on the device: they are read from a host copy made once they are all there
    rows_host = np.frombuffer(host_view(payload), dtype=np.uint8) if host else np.empty(nbytes, dtype=np.uint8)
    rows = rows_host[meta_bytes:]

    def finish() -> None:
        if not host:
            ch.torch.from_numpy(rows).copy_(payload[meta_bytes:])
            rows_host[:meta_bytes] = np.frombuffer(meta, dtype=np.uint8)
        try:
            check_crc(rows_host.data if host else rows_host)
        except TransferError:
            ch.answer(BAD_CHECKSUM)
            raise

    return _Arrival(ch, nbytes, pos_min, pos_max, flags, meta, rows, works, finish)


_BUFFERS = threading.local()


def _receive_buffer(ch: _Channel, nbytes: int) -> Any:
    """``nbytes`` of a receive buffer kept for the next transfer (per thread and device):
    touching fresh pages for every payload costs about as much as receiving it.  The
    payload is only read until ``state_read`` has copied it, so reuse is safe."""
    return _buffer(str(ch.device), ch.torch, nbytes, ch.device)


def _buffer(key: str, lib: Any, nbytes: int, device: Any = None) -> Any:
    """A kept ``uint8`` buffer of at least ``nbytes`` (a torch tensor on ``device``, or a
    NumPy array when ``lib`` is NumPy: the sender's host buffer), its first ``nbytes``."""
    cache = getattr(_BUFFERS, "by_device", None)
    if cache is None:
        cache = _BUFFERS.by_device = {}
    buf = cache.get(key)
    if buf is None or buf.shape[0] < nbytes:
        if lib is np:
            buf = np.empty(nbytes, dtype=np.uint8)
        else:
            buf = lib.empty(nbytes, dtype=lib.uint8, device=device)
        cache[key] = buf
    return buf[:nbytes]


def release_buffers() -> None:
    """Free the receive buffers this thread keeps for its next transfer."""
    _BUFFERS.by_device = {}


def _check_positions(data: Any, pos_max: int, rows: np.ndarray | None = None) -> None:
    """Every part of the blob ends at the header's last position (an empty sequence: no
    cells); with ``rows`` apart, the metadata's row blocks also use every row byte."""
    from statecache.distributed.sections import parse_section

    source = RowSource(rows) if rows is not None else None
    with rows_apart(source) if source is not None else contextlib.nullcontext():
        _, sections = unpack_sections(data)
        for tag, payload in sections:
            sec = parse_section(tag, payload)
            last = max(sec.positions) if sec.positions else -1
            if last != pos_max:
                raise StateError(
                    f"{sec.name}.pos", f"the sequence ends at position {last} there, the header says {pos_max}"
                )
    if source is not None:
        source.at_end()
