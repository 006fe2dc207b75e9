"""Move one sequence's state between two instances over torch.distributed.

Disaggregated serving prefills a request on one instance and decodes it on
another; for a recurrent or hybrid model the decode side needs everything
the sequence owns: its recurrent rows in every layer with the snapshot
planes still valid, its K/V cells with their positions, its indexer rows,
and its book entries.

The payload is the metadata of ``memory.state_write(seq)`` (positions,
owners, layers, dtype codes, row sizes: everything but the row data, see
:func:`statecache.state_io.rows_apart`), then every row block of the
sequence (host tensors over gloo, CUDA tensors over NCCL): over gloo the
blocks of at most :data:`SMALL_BLOCK` bytes copied back to back into one
message, every other block its own message; a block whose rows are one run
of a host-visible pool is sent from the pool itself, any other is gathered by
its rows alone (only the sequence's cells and planes cross to the host).  The receiver reads the
metadata with the memory's own ``state_read``, so sizes, dtypes, layers,
positions and room are checked exactly as for a blob, before anything is
written.  Memories of different sizes, stream layouts and backends exchange
sequences this way; ``rows=False`` sends the whole state-format blob instead
(the fallback: any memory whose ``state_write`` writes its rows inline still
works with ``rows=True``, its blob simply carries them).

The protocol (version 6) keeps the receiver safe:

1. the sender sends a header: magic, protocol version, payload bytes, the
   sequence's first and last position, the state flags (with a bit saying
   whether the payload follows without a *go*), an optional CRC-32
   of the payload, where the metadata ends, the number of row messages, a
   hash of the row blocks' sizes, the two limits that pick the coalesced
   blocks (:func:`_coalesced`) and their total, and a hash of the header
   itself; over gloo the metadata (up to :data:`INLINE_BYTES`) travels in the
   same message;
2. the receiver checks the header (a corrupt one, or a payload larger than
   its memory could ever hold, is refused before it allocates anything) and
   posts the receive of the coalesced message, which then crosses while it
   validates.  Over gloo the sender posted the coalesced message and every
   row message right behind the header (*eager*, :data:`EAGER`): gloo moves
   a message only once its receive is posted, so nothing lands early, and a
   receiver that refuses the payload after reading the header receives what
   was posted into its staging buffer (``_Arrival.abandon``) so the pair's
   messages stay in step; only a header refused as corrupt or too large
   leaves them posted (nothing says what to drain: both sides say the tag is
   spent).  Otherwise (NCCL, where an unmatched send would stall the stream)
   the receiver answers *go* or *refused* without waiting for the answer to
   leave, and on *go* the sender posts the coalesced message, the metadata's
   own message, then the other row messages, all read from its pool while
   the receiver checked;
3. the receiver checks that every part of the metadata ends at the header's
   last position and that its row blocks are the announced messages and
   coalesced bytes (a scan of the metadata,
   :func:`statecache.distributed.sections.scan_apart`), saves
   what the destination sequence held, and runs the memory's ``state_read``:
   it validates everything from the metadata, then names the row writes its
   commit will make into rows that nothing references
   (:func:`statecache.state_io.rows_landing`: free KV cells, a free recurrent
   cell; never a shared row, the zero row or the destination's own rows).
   Those messages are received straight there (gloo, host-visible pools),
   the others into a staging buffer; then it waits for every row
   (:func:`statecache.state_io.rows_ready`: within ``timeout`` seconds),
   copying each coalesced block to where its write would go (such a free
   row, or the staging buffer) while the others arrive, checks the CRC when
   one was sent, and commits: the book, plus a copy of the staged rows only;
4. the receiver answers *accepted* or why not (eager: its only answer); the
   sender raises if not.

Before the commit the memory's book and every sequence's rows are as they
were: a failure there (a sender that dies or stalls, a bad CRC) raises
:class:`~statecache.distributed.errors.TransferError` with only free rows
written, and the memory is told (``state_landing_failed``: plans and undos
made before it are stale, since an undo could bring back a cell whose free
rows were overwritten).  If the commit itself fails, the sequence's previous
state (saved before the read, with its planes) is put back.  So a transfer
that fails anywhere leaves every observable of the receiver as it was, and
raises an error that says where it failed.

Limits: over NCCL the rows are staged through host memory on each side (a
device that is not host-visible gathers them with ``get_rows`` and downloads
only those); the receiver keeps as many planes as its own ``n_rs_seq``
allows.  After a transfer fails mid-payload the pair's message stream is out
of step: use a fresh ``tag`` (gloo) or a fresh group for the next one (a
gloo timeout closes the connection, so no row arrives after the failure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from statecache.distributed.errors import TransferError
from statecache.distributed.wire import as_tensor, group_device, host_view, on_host, post, torch_dist, wait
from statecache.errors import StateError
from statecache.hostmem import gather_rows, row_run
from statecache.memory import StateFlags
from statecache.state_io import RowSink, RowSource, RowWrite, rows_apart, unpack_sections

MAGIC = 0x5343_5351  # "SCSQ"
#: 3: the metadata travels in its own message, ahead of the rows; 4: one message per row
#: block; 5: the small row blocks travel together in one message, received while the
#: memory validates (the header says which: :func:`_coalesced`); 6: over gloo the sender posts
#: every row message right behind the header, without waiting for a *go* (``_EAGER``)
PROTOCOL = 6
ANSWER = 0x5343_4F4B  # "SCOK": the magic of every answer
_HEADER_WORDS = 14
_CRC_PRESENT = 1 << 16  # in the header's flags word, above the state flags
_ROWS_APART = 1 << 17  # the payload is metadata, then the rows (see statecache.state_io.rows_apart)
#: The sender posted every message of the payload right behind the header: the receiver
#: sends no *go*, only its verdict, and drains what it refuses once it read the header.
_EAGER = 1 << 18
_MAX_MESSAGES = 1 << 20
#: The largest coalesced message a receiver accepts (it posts its receive, or drains it
#: after refusing the payload, before it knows more than the header).
_MAX_SMALL = 64 << 20

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
    sizes: list[int] | None = None,
    small: tuple[int, int] = (0, 0),
    eager: bool = False,
) -> list[int]:
    """The header words; ``meta_bytes``: the payload is that much metadata, then row
    blocks of ``sizes`` bytes (a hash of the sizes travels); ``small``: the blocks that
    :func:`_coalesced` picks with these (block, total) limits travel in one message
    (their total travels), each other block in its own (their number travels); ``eager``:
    the payload follows the header without waiting for a *go*."""
    word = flags | (_CRC_PRESENT if crc is not None else 0) | (_ROWS_APART if meta_bytes is not None else 0)
    word |= _EAGER if eager else 0
    cut = [n for n in sizes or [] if n]
    picked = _coalesced(cut, *small)
    small_bytes = sum(n for n, p in zip(cut, picked, strict=True) if p)
    n_messages = len(cut) - sum(picked)
    words = [MAGIC, PROTOCOL, nbytes, pos_min, pos_max, word, crc or 0, meta_bytes or 0, n_messages, _cut_digest(cut),
             small[0], small[1], small_bytes]  # fmt: skip
    return [*words, _header_hash(words)]


def _coalesced(sizes: list[int], block: int, total: int) -> list[bool]:
    """Which row blocks (of these byte sizes, in order) travel together in the coalesced
    message: each of at most ``block`` bytes, in order, while their sum stays within
    ``total``.  Sender and receiver both derive it from the sizes the metadata names
    and the two limits the header carries."""
    picked, run = [], 0
    for n in sizes:
        take = 0 < n <= block and run + n <= total
        run += n if take else 0
        picked.append(take)
    return picked


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
    if not 0 <= words[8] <= min(_MAX_MESSAGES, max(words[2] - words[7], 0)):
        return f"{words[8]} row messages for a payload of {words[2]} bytes"
    if words[10] < 0 or not 0 <= words[12] <= min(words[11], _MAX_SMALL, max(words[2] - words[7], 0)):
        return f"coalesced rows of {words[12]} bytes (limits {words[10]}, {words[11]}) in a payload of {words[2]}"
    if words[12] and not words[5] & _ROWS_APART:
        return "coalesced rows in a payload without rows apart"
    if words[5] & _EAGER and not words[5] & _ROWS_APART:
        return "an eager payload without rows apart"
    return None


#: Over gloo, metadata of at most this many bytes travels in the header's message (one
#: message and the wait for the receiver's answer fewer before it can validate); the
#: rows are sent once the receiver answered the header.
INLINE_BYTES = 1 << 20


def _header_message(ch: _Channel, words: list[int], meta: bytes = b"") -> Any:
    """The header's message: its words (int64) on a device; over gloo, their bytes
    followed by the metadata when it travels inline."""
    if not on_host(ch.device):
        return ch.ints(words)
    return as_tensor(np.asarray(words, dtype="<i8").tobytes() + bytes(meta), ch.device)


class _Channel:
    """The sends and receives of one transfer with one peer (one group, one tag)."""

    def __init__(self, peer: int, group: Any, tag: int, timeout: float) -> None:
        self.torch, self.dist = torch_dist()
        self.peer, self.group, self.tag, self.timeout = peer, group, tag, timeout
        self.device = group_device(group)
        self.told: list[Any] = []  # answers posted and not yet waited for (see tell)

    def ints(self, values: list[int]) -> Any:
        return self.torch.tensor(values, dtype=self.torch.int64, device=self.device)

    def send(self, t: Any, what: str) -> Any:
        return post(lambda: self.dist.isend(t, self.peer, group=self.group, tag=self.tag), self.peer, what)

    def post_recv(self, t: Any, what: str) -> Any:
        return post(lambda: self.dist.irecv(t, self.peer, group=self.group, tag=self.tag), self.peer, what)

    def recv(self, t: Any, what: str) -> Any:
        wait(self.post_recv(t, what), self.timeout, self.peer, what)
        return t

    def tell(self, code: int) -> None:
        """Post an answer without waiting for it to leave: the receiver goes on checking
        while the sender hears it (its wait, a hand-over between the two processes that
        a loaded host can stretch by a time slice, would sit on the transfer's critical
        path).  :meth:`settle` waits for it; until then the work keeps its tensor alive."""
        try:
            self.told.append(self.send(self.ints([ANSWER, code]), "answering"))
        except TransferError:
            pass  # a peer that is gone cannot hear it; the next wait says so

    def settle(self) -> None:
        """Best effort: wait for the answers :meth:`tell` posted (long delivered, when the
        peer went on; within 5 s when it is gone)."""
        told, self.told = self.told, []
        for work in told:
            with contextlib.suppress(TransferError):
                wait(work, min(self.timeout, 5.0), self.peer, "answering")

    def answer(self, code: int) -> None:
        """Best effort: a peer that is gone cannot hear why (the caller raises anyway)."""
        self.tell(code)
        self.settle()

    def listen(self, what: str) -> tuple[Any, Any]:
        """Post the receive of the peer's next answer (:meth:`hear` waits for it)."""
        words = self.ints([0, 0])
        return words, self.post_recv(words, what)

    def hear(self, what: str, posted: tuple[Any, Any] | None = None) -> int:
        words_t, work = posted if posted is not None else self.listen(what)
        wait(work, self.timeout, self.peer, what)
        words = words_t.tolist()
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
    :func:`recv_sequence`).  The sender's memory is only read (and must not change
    until this returns: rows in one run of a host pool are sent from the pool itself).
    Raises :class:`TransferError` when the receiver refuses (the reason in words), dies
    or does not answer within ``timeout`` seconds.  ``checksum``: add a CRC-32 of the
    payload (one more pass over it on each side; gloo and NCCL deliver intact bytes,
    so it guards against bugs, not the wire; the rows are then read before they
    are sent).  ``rows``: send the sequence's rows and snapshot planes as tensors
    behind their metadata (default); False sends the state-format blob of
    ``state_write`` (no planes: the receiver can roll back only after its next
    multi-token write)."""
    t0 = time.perf_counter()
    ch = _Channel(dst, group, tag, timeout)
    try:
        pos_min, pos_max = int(memory.seq_pos_min(seq_id)), int(memory.seq_pos_max(seq_id))
        out = _Outgoing.of(memory, seq_id, int(flags)) if rows else None
        blob = memory.state_write(seq_id, flags) if out is None else out.meta
    except Exception:
        try:  # tell the receiver not to wait for a payload
            abort = _header_message(ch, _header(-1, -1, -1, int(flags), None))
            wait(ch.send(abort, "sending the abort"), min(timeout, 5.0), dst, "sending the abort")
        except TransferError:
            pass
        raise
    _offer(ch, blob, pos_min, pos_max, int(flags), checksum, f"sequence {seq_id}", out)
    nbytes = len(blob) + (out.nbytes if out is not None else 0)
    return Transfer(nbytes, pos_min, pos_max, time.perf_counter() - t0)


@dataclasses.dataclass
class _Outgoing:
    """A sequence as the sender puts it on the wire: the metadata of its state (the
    state format's, with the valid snapshot planes; see
    :func:`statecache.state_io.rows_apart`), then its row blocks (only the sequence's
    rows), in the order the metadata names them; :func:`_offer` sends the small ones
    coalesced (:meth:`part_into`), each other one as a message of its own (:meth:`part`)."""

    meta: bytes
    blocks: list[tuple[Any, Any, np.ndarray]]  # (device, buffer, rows): the non-empty blocks
    sizes: list[int]
    synced: bool = False

    @classmethod
    def of(cls, memory: Any, seq_id: int, flags: int) -> _Outgoing:
        sink = RowSink()
        with rows_apart(sink):
            meta = memory.state_write(seq_id, flags)
        blocks = [(d, b, i) for d, b, i in sink.blocks if i.size]
        return cls(meta, blocks, [int(i.size) * int(b.shape[1]) * b.dtype.itemsize for _, b, i in blocks])

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def part(self, k: int) -> np.ndarray:
        """Block ``k`` as ``uint8`` host bytes: the pool's own memory when its rows are one
        run of a host-visible buffer (no copy), else gathered (one copy, or ``get_rows``
        and one download) into a buffer of its own."""
        device, buf, idx = self.blocks[k]
        view = row_run(device, buf, idx)
        if view is None:
            return gather_rows(device, buf, idx)
        if not self.synced:  # kernels that may still write the pool finish first (as gather_rows does)
            device.synchronize()
            self.synced = True
        return view.view(np.uint8).reshape(-1)

    def part_into(self, k: int, dst: np.ndarray) -> None:
        """Block ``k``'s bytes into ``dst`` (one copy, or ``get_rows`` and one download)."""
        device, buf, idx = self.blocks[k]
        view = row_run(device, buf, idx)
        if view is None:
            gather_rows(device, buf, idx, dst)
            return
        if not self.synced:
            device.synchronize()
            self.synced = True
        np.copyto(dst, view.view(np.uint8).reshape(-1))


#: Row blocks of at most this many bytes travel together in one message (protocol 5),
#: up to :data:`SMALL_TOTAL` bytes of them, over gloo: the sender copies them back to
#: back while the receiver checks the header, the receiver posts that message's
#: receive once the header passed (it crosses while the memory validates the metadata) and
#: copies each block to its destination while the large blocks arrive.  Measured on
#: the 2-core host this was written on: a message costs each side about 20-40 us of
#: CPU (posting it, gloo's ready notification, waiting for it, the landing's
#: bookkeeping), a copy 5-20 us per 64 KiB and 18-36 us per 256 KiB (more from a pool
#: that is not in cache); so blocks up to 128 KiB are clearly cheaper copied than sent
#: alone (a layer's conv state, the K/V rows of a short sequence), and near 256 KiB the
#: two cost the same (a limit of 256 KiB, which also coalesced the K/V rows of 256
#: tokens, measured no better, again with protocol 6; so did one message for every
#: block).  Larger blocks are sent from the pool.  Under CPU
#: contention the transfer's wall time follows its CPU time (see docs/distributed.md).
SMALL_BLOCK = 128 << 10
SMALL_TOTAL = 4 << 20
#: Over gloo, post the payload's messages right behind the header (protocol 6) rather
#: than on the receiver's *go* (False: the *go* round trip, as protocol 5; benchmarks):
#: one message and one wake-up fewer on each side, and the sender's hearing of the
#: *go* off the critical path.  Measured interleaved with protocol 5 on the loaded
#: 2-core host: wall time the same within the spread, CPU of both processes 0.2-1 ms
#: lower (docs/distributed.md).
EAGER = True


def _rows_payload(memory: Any, seq_id: int, flags: int) -> tuple[np.ndarray, int, list[int]]:
    """The sequence as one contiguous host buffer (metadata, then every row block), the
    metadata's length and the row messages' sizes: what :func:`send_sequence` sends,
    gathered in one place (tests, benchmarks)."""
    out = _Outgoing.of(memory, seq_id, flags)
    parts = [np.frombuffer(out.meta, dtype=np.uint8), *(out.part(k) for k in range(len(out.sizes)))]
    return np.concatenate(parts), len(out.meta), list(out.sizes)


def _offer(
    ch: _Channel,
    blob: bytes,
    pos_min: int,
    pos_max: int,
    flags: int,
    checksum: bool,
    what: str,
    out: _Outgoing | None = None,
) -> None:
    """The sender's side of the protocol for one payload (see the module docstring):
    ``blob`` alone in one message, or, with ``out``, ``blob`` (its metadata) and then
    the row messages: the small blocks coalesced into one (:func:`_coalesced`), then one
    per other block.  The row blocks are read (the small ones copied together, the
    others wrapped as tensors over the pool) while the receiver checks the header and
    validates the metadata, so that its *go* finds every send ready to post."""
    n_parts = len(out.sizes) if out is not None else 0
    parts: list[np.ndarray | None] = [None] * n_parts
    crc = None
    if checksum:  # the CRC goes in the header: every part is read first
        crc = zlib.crc32(blob)
        for k in range(n_parts):
            assert out is not None
            parts[k] = out.part(k)
            crc = zlib.crc32(parts[k].data, crc)  # type: ignore[union-attr]
    nbytes = len(blob) + (out.nbytes if out is not None else 0)
    meta_bytes, sizes = (None, None) if out is None else (len(blob), out.sizes)
    host = on_host(ch.device)
    # over a device every block is staged on both sides anyway: nothing to coalesce
    small = (SMALL_BLOCK, SMALL_TOTAL) if out is not None and host else (0, 0)
    picked = _coalesced(list(sizes or []), *small)
    # over gloo a message moves only once its receive is posted, and a receiver that
    # refuses the payload after reading the header drains it: the rows can follow the
    # header at once (over NCCL an unmatched send would stall the stream: wait for the go)
    eager = out is not None and host and EAGER
    header = _header(nbytes, pos_min, pos_max, flags, crc, meta_bytes, sizes, small, eager)
    inline = out is not None and host and len(blob) <= INLINE_BYTES
    sent = ch.send(_header_message(ch, header, blob if inline else b""), "sending the header")
    heard = ch.listen("waiting for the answer to the header" if not eager else "waiting for the answer to the payload")
    tensors: list[Any] = []  # kept alive until sent
    coalesced = None
    if any(picked):  # the small blocks back to back, in order
        assert out is not None
        buf = _send_buffer(header[12])
        off = 0
        for k in (k for k in range(n_parts) if picked[k]):
            out.part_into(k, buf[off : off + out.sizes[k]])
            off += out.sizes[k]
        coalesced = as_tensor(buf, ch.device)
    if host:  # tensors over pool views (no copy) or over gathered rows
        assert out is not None or not n_parts
        for k in range(n_parts):
            if not picked[k]:
                if parts[k] is None:
                    parts[k] = out.part(k)  # type: ignore[union-attr]
                tensors.append(as_tensor(parts[k], ch.device))  # type: ignore[arg-type]
    if not eager:
        code = ch.hear("waiting for the answer to the header", heard)
        if code != OK:
            raise TransferError(ch.peer, f"rank {ch.peer} refused {what}: {REASONS[code]}")
    label = "sending the metadata" if out else "sending the payload"
    metadata = None if inline else (as_tensor(blob, ch.device), label)
    works = _post_payload(ch, coalesced, metadata, tensors, n_parts - sum(picked), None if host else out, parts)
    code = ch.hear("waiting for the answer to the payload", heard if eager else None)
    if eager and code in (BAD_HEADER, TOO_LARGE):
        # refused before the receiver knew what to drain: the posted messages stay
        # unmatched on this tag (their works keep the rows alive)
        raise TransferError(
            ch.peer,
            f"rank {ch.peer} refused {what}: {REASONS[code]} (its rows stay posted on tag {ch.tag}: "
            "use a fresh tag or group for the next transfer to that rank)",
        )
    wait(sent, ch.timeout, ch.peer, "sending the header")
    for work in works:
        wait(work, ch.timeout, ch.peer, "sending the payload")
    if code != OK:
        raise TransferError(ch.peer, f"rank {ch.peer} refused {what}: {REASONS[code]}")


def _post_payload(
    ch: _Channel,
    coalesced: Any,
    metadata: tuple[Any, str] | None,
    tensors: list[Any],
    n_messages: int,
    out: _Outgoing | None,
    parts: list[np.ndarray | None],
) -> list[Any]:
    """Post the payload's messages in the order the receiver posts their receives: the
    coalesced small blocks (its receive is posted first, once the header passed), the
    metadata (tensor, what) when it did not travel inline (or the whole blob), then the ``n_messages`` row messages
    (``tensors``; with ``out``, a device: each block gathered, uploaded, then sent, so that
    the gathers overlap the sends).  Returns their works."""
    works = []
    if coalesced is not None:
        works.append(ch.send(coalesced, "sending the small rows"))
    if metadata is not None:
        works.append(ch.send(*metadata))
    for k in range(n_messages):  # received once the receiver's memory named their destinations
        if out is not None:
            part = parts[k]
            if part is None:
                part = parts[k] = out.part(k)  # kept alive until sent
            tensors.append(as_tensor(part, ch.device))
        works.append(ch.send(tensors[k], "sending the rows"))
    return works


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
    state: layout, dtype or sizes differ); in every case ``memory``'s book and every
    sequence's state are as they were (rows that landed in free rows before a failure
    make plans and undos made before it stale, see docs/distributed.md).
    """
    t0 = time.perf_counter()
    ch = _Channel(src, group, tag, timeout)
    limit = default_max_bytes(memory) if max_bytes is None else int(max_bytes)
    try:
        return _receive(memory, seq_id, ch, limit, t0)
    finally:
        ch.settle()  # the go told in _take (long delivered unless the sender is gone)


def _receive(memory: Any, seq_id: int, ch: _Channel, limit: int, t0: float) -> Transfer:
    got = _take(ch, limit)
    try:
        sizes = _check_positions(got.meta, got.pos_max, got.rows)
        if got.rows is not None:
            got.cut(sizes)
    except StateError:
        got.abandon()
        ch.answer(REFUSED)
        raise
    got.post_early()  # the first rows travel into the staging buffer while the memory validates the metadata
    # what a failure after validation must put back (an empty destination: nothing to save)
    held = max(memory.seq_pos_min(seq_id), memory.seq_pos_max(seq_id)) >= 0  # either part of a hybrid
    backup = _save(memory, seq_id, got.flags) if held else None
    # state_read validates, hands the writes into free rows to got.land (received straight there),
    # waits for the rows (got.arrive), then writes the others and the book
    source = None if got.rows is None else RowSource(got.rows, wait=got.arrive, land=got.land if got.host else None)
    try:
        _read(memory, got.meta, source, seq_id, got.flags)
        if source is not None and source.landed:
            raise RuntimeError(f"rows of {len(source.landed)} blocks landed but the memory did not commit them")
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


#: Row messages that start within this many bytes are received into the staging buffer
#: at once, while the memory validates the metadata (and copied into it at the commit);
#: the others, posted once the memory named their destinations, land straight in its
#: free rows.  0: every row lands.  Measured on a loaded 2-core host, staging the first
#: 4 MiB made the transfer slower: its copy costs CPU the wire needs, and the posts of
#: the landing receives waited for the staged messages.
EARLY_BYTES = 0


@dataclasses.dataclass
class _Arrival:
    """A payload whose header the receiver accepted: its metadata is here (a whole blob,
    for ``rows=False``), its rows (``rows``, the staging array) may still be arriving.
    The coalesced message of the small blocks (``small``, protocol 5) is received as
    soon as the header passed.  Once :meth:`cut` knows the row messages,
    :meth:`post_early` receives the first ones into ``rows``, :meth:`land` the others
    straight into the memory's free rows (or into ``rows``) and names where each small
    block goes; :meth:`arrive` waits for them all, copies the small blocks out (while
    the large ones arrive) and checks the CRC, raising TransferError."""

    ch: _Channel
    nbytes: int
    pos_min: int
    pos_max: int
    flags: int
    meta: Any
    rows: np.ndarray | None
    host: bool = True
    payload: Any = None  # the receive buffer: metadata, then the staged rows
    n_messages: int = 0
    digest: int = 0
    crc: int | None = None
    limits: tuple[int, int] = (0, 0)  # the coalesced blocks' (block, total) limits
    small: tuple[Any, Any] | None = None  # the coalesced message: its tensor and its posted receive
    messages: list[tuple[int, int]] | None = None  # [lo, hi) of each row message, in rows
    smalls: list[tuple[int, int]] | None = None  # [lo, hi) of each coalesced block, in rows
    small_into: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # by lo: where a small block lands
    pending: list[Any] = dataclasses.field(default_factory=list)
    into: dict[int, Any] = dataclasses.field(default_factory=dict)  # by lo: where each posted message goes
    posted: int = 0  # row messages posted, in order
    finish: Callable[[], None] = lambda: None
    waited: bool = False

    def cut(self, sizes: list[int]) -> None:
        """The row messages the metadata implies; refused unless the sender announced them."""
        sizes = [n for n in sizes if n]
        picked = _coalesced(sizes, *self.limits)
        small_bytes = sum(n for n, p in zip(sizes, picked, strict=True) if p)
        announced = int(self.small[0].numel()) if self.small is not None else 0
        if len(sizes) - sum(picked) != self.n_messages or _cut_digest(sizes) != self.digest or small_bytes != announced:
            raise StateError(
                "rows",
                f"the metadata names {len(sizes)} row blocks ({small_bytes} bytes of them coalesced); the sender "
                f"announced {self.n_messages} row messages and {announced} coalesced bytes of others",
            )
        ends = list(itertools.accumulate(sizes))
        spans = [(hi - n, hi) for n, hi in zip(sizes, ends, strict=True)]
        self.messages = [m for m, p in zip(spans, picked, strict=True) if not p]
        self.smalls = [m for m, p in zip(spans, picked, strict=True) if p]

    def _receive_into(self, k: int, into: Any = None) -> tuple[Any, Any]:
        """Row message ``k``'s receive tensor and where its bytes end up: the staging
        buffer, or ``into`` (a host array)."""
        assert self.messages is not None and self.rows is not None
        lo, hi = self.messages[k]
        base = self.nbytes - self.rows.size  # the metadata's length
        if into is None:
            return self.payload[base + lo : base + hi], self.rows[lo:hi]
        return self.ch.torch.from_numpy(into), into

    def _post_all(self, targets: list[tuple[Any, Any]]) -> None:
        """Post the receives of the next row messages, in order, back to back: once the
        first is posted its message streams in, and each later post takes gloo's
        per-connection lock from the thread reading it (so nothing else runs between them)."""
        assert self.messages is not None
        for tensor, into in targets:
            self.pending.append(self.ch.post_recv(tensor, "receiving the rows"))
            self.into[self.messages[self.posted][0]] = into
            self.posted += 1

    def post_early(self) -> None:
        """Receive the messages that start within :data:`EARLY_BYTES` into the staging
        buffer now (every message, on a device: it lands nowhere else)."""
        if self.messages is None:
            return
        early = [k for k, (lo, _) in enumerate(self.messages) if not self.host or lo < EARLY_BYTES]  # a prefix
        self._post_all([self._receive_into(k) for k in early])

    def land(self, writes: list[RowWrite]) -> list[RowWrite]:
        """Post the receives still to post: a message that is exactly one of ``writes``
        (a block the memory is about to write into rows free now) whose destination is
        one run of a host buffer goes straight there; any other into the staging buffer.
        A coalesced block that is exactly one of ``writes`` will be copied there by
        :meth:`arrive`.  Returns the writes that land."""
        assert self.messages is not None and self.rows is not None and self.smalls is not None
        base = int(self.rows.__array_interface__["data"][0])
        by_offset = {int(w.rows.__array_interface__["data"][0]) - base: w for w in writes}
        landed = []
        synced: set[int] = set()

        def destination(lo: int, hi: int) -> tuple[RowWrite, np.ndarray] | None:
            w = by_offset.get(lo)
            dest = None if w is None or w.rows.nbytes != hi - lo else row_run(w.device, w.buf, w.idx)
            if w is None or dest is None or dest.nbytes != hi - lo:
                return None
            if id(w.device) not in synced:  # kernels that may still touch the pool finish first
                w.device.synchronize()
                synced.add(id(w.device))
            landed.append(w)
            return w, dest.view(np.uint8).reshape(-1)

        targets = []
        for k in range(self.posted, len(self.messages)):  # first: the wire waits for these
            found = destination(*self.messages[k])
            targets.append(self._receive_into(k, None if found is None else found[1]))
        self._post_all(targets)
        for lo, hi in self.smalls:
            found = destination(lo, hi)
            if found is not None:
                self.small_into[lo] = found[1]
        return landed

    def arrive(self, check: bool = True) -> None:
        """Wait for every row message (posting those not posted yet into the staging
        buffer), copying the coalesced blocks to where they go while the others arrive;
        ``check``: then check the CRC, when one was sent."""
        if self.waited:
            return
        self.waited = True
        if self.messages is not None:
            # not landed: into the staging buffer
            self._post_all([self._receive_into(k) for k in range(self.posted, len(self.messages))])
        what = "receiving the rows"
        if self.small is not None:
            small_t, work = self.small
            wait(work, self.ch.timeout, self.ch.peer, "receiving the small rows")
            small = np.frombuffer(host_view(small_t), dtype=np.uint8)
            off = 0
            for lo, hi in self.smalls or []:  # landed, or into the staging buffer
                assert self.rows is not None
                dest = self.small_into.get(lo)
                if dest is None:
                    dest = self.small_into[lo] = self.rows[lo:hi]
                np.copyto(dest, small[off : off + hi - lo])
                off += hi - lo
        for work in self.pending:
            wait(work, self.ch.timeout, self.ch.peer, what)
        self.pending = []
        self.finish()
        if check and self.crc is not None:
            crc = zlib.crc32(self.meta)
            for _, part in sorted([*self.into.items(), *self.small_into.items()], key=lambda kv: kv[0]):
                crc = zlib.crc32(part.data if isinstance(part, np.ndarray) else _host_bytes(part), crc)
            if crc != self.crc:
                self.ch.answer(BAD_CHECKSUM)
                raise TransferError(
                    self.ch.peer, f"the payload from rank {self.ch.peer} does not match its CRC-32; nothing was written"
                )

    def abandon(self) -> None:
        """Refused before the rows arrived: let them arrive (best effort) so the pair's
        messages stay in step, within the timeout."""
        if self.waited or self.rows is None:
            return
        if self.messages is None:  # the metadata was not understood: n messages of at most all the rows
            self.messages = [(0, self.rows.size)] * self.n_messages
            self.smalls = []  # the coalesced message is received, not copied anywhere
        with contextlib.suppress(TransferError):
            self.arrive(check=False)  # refused anyway: no second answer


def _host_bytes(t: Any) -> Any:
    return np.ascontiguousarray(t.cpu().numpy()).data


def _cut_digest(sizes: list[int] | None) -> int:
    """A 62-bit hash of the row messages' sizes (0: no row messages)."""
    if not sizes:
        return 0
    data = np.asarray(sizes, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def _take(ch: _Channel, limit: int) -> _Arrival:
    """The receiver's side up to a payload whose metadata it holds (the rows are posted
    later: :class:`_Arrival`); the final answer is the caller's."""
    src = ch.peer
    host = on_host(ch.device)
    if host:  # one message of at most the header and INLINE_BYTES of metadata (gloo takes a shorter one)
        first = ch.recv(_buffer("header", ch.torch, 8 * _HEADER_WORDS + INLINE_BYTES), "receiving the header")
        words = np.frombuffer(host_view(first), dtype="<i8", count=_HEADER_WORDS).tolist()
    else:  # NCCL: every message has the size its receive expects
        words = [int(x) for x in ch.recv(ch.ints([0] * _HEADER_WORDS), "receiving the header").tolist()]
    bad = _check_header(words)
    if bad is not None:
        ch.answer(BAD_HEADER)
        raise TransferError(src, f"corrupt header from rank {src}: {bad}; nothing was received")
    nbytes, pos_min, pos_max, flags_word, crc, meta_bytes, n_messages, digest = words[2:10]
    small_block, small_total, small_bytes = words[10:13]
    if nbytes == -1:
        raise TransferError(src, f"rank {src} could not write the sequence it was to send; nothing was received")
    if nbytes > limit:
        ch.answer(TOO_LARGE)
        posted = " (its rows stay posted on this tag: use a fresh one)" if flags_word & _EAGER else ""
        raise TransferError(src, f"rank {src} announced {nbytes} bytes, more than max_bytes={limit}; refused{posted}")
    small = None
    if small_bytes:  # the sender's first message after the go: it crosses while the memory validates
        small_t = _buffer(f"small:{ch.device}", ch.torch, small_bytes, ch.device)
        # posted before the go, so that gloo's ready notification reaches the sender first
        # and its send, posted on the go, is written at once
        small = (small_t, ch.post_recv(small_t, "receiving the small rows"))
    if not flags_word & _EAGER:
        ch.tell(OK)  # go: the receiver checks the metadata while the sender hears it
    payload = _receive_buffer(ch, nbytes)
    flags = flags_word & 0xFFFF
    crc = crc if flags_word & _CRC_PRESENT else None
    if not flags_word & _ROWS_APART:  # a whole blob in one message
        ch.recv(payload, "receiving the payload")
        data = host_view(payload)
        if crc is not None and zlib.crc32(data) != crc:
            ch.answer(BAD_CHECKSUM)
            raise TransferError(src, f"the payload from rank {src} does not match its CRC-32; nothing was written")
        return _Arrival(ch, nbytes, pos_min, pos_max, flags, data, None, waited=True)
    if host and meta_bytes <= INLINE_BYTES:  # it came with the header
        meta = host_view(first)[8 * _HEADER_WORDS : 8 * _HEADER_WORDS + meta_bytes]
    else:
        ch.recv(payload[:meta_bytes], "receiving the metadata")
        meta = host_view(payload[:meta_bytes])
    # over NCCL the rows land on the device: they are read from a host copy made once they are all there
    rows_host = np.frombuffer(host_view(payload), dtype=np.uint8) if host else np.empty(nbytes, dtype=np.uint8)
    rows = rows_host[meta_bytes:]
    if not host:
        meta = memoryview(bytes(meta))

    def finish() -> None:
        if not host:
            ch.torch.from_numpy(rows).copy_(payload[meta_bytes:])

    return _Arrival(ch, nbytes, pos_min, pos_max, flags, meta, rows, host, payload, n_messages, digest, crc,
                    (small_block, small_total), small, finish=finish)  # fmt: skip


_BUFFERS = threading.local()


def _receive_buffer(ch: _Channel, nbytes: int) -> Any:
    """``nbytes`` of a receive buffer kept for the next transfer (per thread and device):
    touching fresh pages for every payload costs about as much as receiving it.  The
    payload is only read until ``state_read`` has copied it, so reuse is safe."""
    return _buffer(str(ch.device), ch.torch, nbytes, ch.device)


def _buffer(key: str, lib: Any, nbytes: int, device: Any = None) -> Any:
    """A kept ``uint8`` torch buffer of at least ``nbytes`` on ``device``, its first ``nbytes``."""
    cache = getattr(_BUFFERS, "by_device", None)
    if cache is None:
        cache = _BUFFERS.by_device = {}
    buf = cache.get(key)
    if buf is None or buf.shape[0] < nbytes:
        buf = lib.empty(nbytes, dtype=lib.uint8, device=device)
        cache[key] = buf
    return buf[:nbytes]


def _send_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of a host buffer kept for the next coalesced message (per thread): the
    sender waits for its sends before it returns, so reuse is safe."""
    buf = getattr(_BUFFERS, "send", None)
    if buf is None or buf.size < nbytes:
        buf = _BUFFERS.send = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def release_buffers() -> None:
    """Free the buffers this thread keeps for its next transfer."""
    _BUFFERS.by_device = {}
    _BUFFERS.send = None


def _check_positions(data: Any, pos_max: int, rows: np.ndarray | None = None) -> list[int]:
    """Every part of the blob ends at the header's last position (an empty sequence: no
    cells); with ``rows`` apart, the metadata's row blocks also use every row byte.
    Returns the sizes of the row blocks, in order (none for a blob).  Metadata with its
    rows apart is scanned (:func:`statecache.distributed.sections.scan_apart`: what the
    receiver checks before rows land, in a few tens of microseconds); a section the
    scan does not take, and every blob, is parsed, which names what is wrong."""
    if rows is not None:
        sizes = _scan_positions(data, pos_max, rows)
        if sizes is not None:
            return sizes
    return _parse_positions(data, pos_max, rows)


def _scan_positions(data: Any, pos_max: int, rows: np.ndarray) -> list[int] | None:
    """:func:`_check_positions` of metadata whose rows are apart, by the fast scan; None
    when a section is not well formed or the rows do not add up (the parse then says why)."""
    from statecache.distributed.sections import TAG_NAMES, scan_apart

    with rows_apart(RowSource(rows)):
        _, sections = unpack_sections(data)
    sizes: list[int] = []
    for tag, payload in sections:
        scanned = scan_apart(tag, payload)
        if scanned is None:
            return None
        last, blocks = scanned
        last = -1 if last is None else last
        if last != pos_max:
            name = TAG_NAMES.get(tag, tag.decode(errors="replace"))
            raise StateError(f"{name}.pos", f"the sequence ends at position {last} there, the header says {pos_max}")
        sizes += blocks
    return sizes if sum(sizes) == rows.size else None


def _parse_positions(data: Any, pos_max: int, rows: np.ndarray | None = None) -> list[int]:
    """:func:`_check_positions` by the full parse (every field named in its errors)."""
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
    if source is None:
        return []
    source.at_end()
    return source.taken
