"""The attention KV cache (docs/memory-semantics.md#kv-cells) and its iSWA pair (docs/memory-semantics.md#iswa).

The cell book lives in :class:`~statecache.kv_cells.KVCells` (one per
stream); K and V live on the device, one buffer per layer shaped
``[n_stream * size, n_embd]`` so that a token's write index is the global row
``stream * size + cell`` and the runtime writes through ``set_rows``.

Planning (``init_batch``) runs the slot search on a *clone* of the book, so
it never mutates the memory; ``apply()`` of the context replays the same
placement on the real book.  ``init_update`` hands out the deferred work:
whole-stream buffer copies queued by cross-stream ``seq_cp`` (done with
``copy_rows`` when applied) and the per-cell position shifts that the
runtime's RoPE must re-rotate K by; applying the update clears both.

State blobs (docs/state-format.md) are read in two phases: :meth:`KVCache.
state_parse` validates everything and chooses the destination cells without
touching anything; :meth:`KVCache.state_commit` writes.  Composite memories
parse every part before committing any.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.backend import Buffer, Device
from statecache.batch import SeqIds
from statecache.dtypes import DType
from statecache.errors import ArgumentError, StateError
from statecache.hostmem import gather_rows, scatter_rows
from statecache.kv_cells import EMPTY, CellJournal, KVCells, last_positions, pos_key
from statecache.kv_mask import (
    SWAType,
    build_mask_seqs,
    is_masked_swa,
    n_kv_for,
    round_up,
    swa_visible_from,
    swa_visible_from_many,
)
from statecache.memory import (
    POS_LAST,
    POS_MAX,
    ContextError,
    KVSeqCells,
    Memory,
    MemoryContext,
    MemoryStatus,
    RollbackReach,
    SeqState,
    StateFlags,
    StatusContext,
    UBatchContext,
    check_divisor,
    check_int32,
    check_seq_id,
    check_shifted,
    normalize_range,
    readonly_rows,
    view_guard,
)
from statecache.state_io import (
    CODE_DTYPES,
    DTYPE_CODES,
    Reader,
    RowWrite,
    Writer,
    expect_sections,
    find_section,
    pack_sections,
    rows_landing,
    rows_ready,
    unpack_sections,
)
from statecache.step_buffers import StepBuffers

if TYPE_CHECKING:
    from statecache.batch import BatchAllocator, UBatch

#: Section tags of KV payloads inside a state blob (statecache.state_io).
TAG_KV = b"KVAT"
TAG_KV_BASE = b"KVBS"
TAG_KV_SWA = b"KVSW"

#: Flag in a KV section's per-stream ``cell_count`` word: every cell's metadata
#: ends with its M-RoPE 2-D extension ``i32 x, i32 y``.  Written only when some
#: cell's extension differs from ``(pos, pos)`` (what a 1-D ubatch stores), so a
#: 1-D cache writes the same bytes as before and older blobs read unchanged.
KV_CELL_COUNT_EXT = 1 << 31

#: Signature of the runtime's RoPE re-rotation hook: (cache, layer index, K
#: buffer, rows of that buffer, per-row position shift).  The buffer is the
#: layer's K buffer when an update applies, or a scratch copy of some of its rows
#: when ``state_write`` writes rows a shift still waits for (rows then index the
#: copy), so the hook must rotate exactly the rows it is given, in place.
KShiftFn = Callable[["KVCache", int, Buffer, np.ndarray, np.ndarray], None]


@dataclasses.dataclass(frozen=True)
class KVLayer:
    """One attention layer's K/V row widths (``n_head_kv * head_dim``);
    ``n_embd_v = 0`` makes a key-only cache (the indexer)."""

    il: int
    n_embd_k: int
    n_embd_v: int

    def __post_init__(self) -> None:
        widths = (self.il, self.n_embd_k, self.n_embd_v)
        if any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in widths):
            raise ArgumentError("layers", f"layer {self.il}: index and widths must be integers, got {widths}")
        if self.n_embd_k <= 0 or self.n_embd_v < 0:
            raise ArgumentError("layers", f"layer {self.il}: K width must be > 0 and V width >= 0")


_NO_ROWS = np.zeros(0, dtype=np.int64)
#: Up to this many reused cells (a window cache's apply), or sequences (its eviction plan,
#: :data:`_FEW_SEQS`), are handled one by one with Python ints: below it, the NumPy calls'
#: fixed cost is what counts.
_FEW = 4
_FEW_SEQS = 16


@dataclasses.dataclass
class SlotInfo:
    """Where a ubatch's tokens go: token ``i`` -> ``(streams[i], cells[i])``."""

    streams: np.ndarray
    cells: np.ndarray
    size: int
    #: per token, the one sequence that held the cell it reuses when it was planned (a window
    #: cache's eviction), -1 for a free cell; None when no cell is reused.  The apply checks it
    #: against the book before it relies on it (so it reads no row of the sequence matrix).
    reuse_owner: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray:
        """Global write rows ``stream * size + cell`` (the ``set_rows`` indices)."""
        return np.asarray(self.streams.astype(np.int64) * self.size + self.cells, dtype=np.int64)


class _Book:
    """Cells of every stream plus the search heads."""

    def __init__(self, cells: list[KVCells], heads: list[int]) -> None:
        self.cells = cells
        self.heads = heads


class BookJournal:
    """What a plan or an apply changed in some streams of a book, to take it back.

    While it is open, each stream it covers records the before-image of every
    cell a mutation touches (:class:`~statecache.kv_cells.CellJournal`); the
    search heads are copied at the start.  :meth:`rollback` puts those
    streams back exactly: O(cells touched + streams), where copying the book
    was O(cells).  ``version_after`` is the cache's version once the change
    was complete (undo refuses to roll back over any later change)."""

    def __init__(self, book: _Book, streams: Sequence[int]) -> None:
        self.heads = list(book.heads)
        self.streams: dict[int, CellJournal] = {}
        self.version_after: Hashable = None
        try:
            for strm in streams:
                self.streams[int(strm)] = book.cells[int(strm)].attach()
        except BaseException:
            self.close(book)
            raise

    def close(self, book: _Book) -> None:
        """Stop recording (the journal keeps what it saved)."""
        for strm, j in self.streams.items():
            if book.cells[strm]._journal is j:
                book.cells[strm].detach()

    def rollback(self, book: _Book) -> None:
        """Put the covered streams and the heads back as they were when it was opened."""
        self.close(book)
        for strm, j in self.streams.items():
            book.cells[strm].rollback(j)
        book.heads[:] = self.heads

    @property
    def n_touched(self) -> int:
        return sum(j.n_touched for j in self.streams.values())


@dataclasses.dataclass
class KVStatePlan:
    """A validated KV section, ready to commit (nothing written yet)."""

    seq: int
    # per stream in the blob: (stream, destination cells, positions, sequence sets); rows per layer and stream
    placements: list[tuple[int, np.ndarray, np.ndarray, list[tuple[int, ...]]]]
    k_rows: dict[int, list[np.ndarray]]
    v_rows: dict[int, list[np.ndarray]]
    # per placement: the cells' 2-D extensions (x, y), int64 [count, 2]
    exts: list[np.ndarray] = dataclasses.field(default_factory=list)


class KVCache(Memory):
    """An attention KV cache over some layers (docs/memory-semantics.md#kv-cells).

    ``unified``: one stream shared by every sequence, else one stream per
    sequence.  ``swa_type``/``n_swa``: the sliding window used both by the
    mask and by slot reuse.  ``n_pad``: ``n_kv`` padding.  ``can_shift``:
    whether K is RoPE-rotated (False for the indexer cache, which has no
    RoPE: its shifts are cleared without a rotation).  ``k_shift``: the
    runtime's re-rotation hook, called per layer when an update is applied
    (and by ``state_write`` on a copy, so that a blob never waits for an update).

    Sliding-window reuse: the slot search may take a cell its sequence's
    window has left (``swa_evict``, the window cache of an iSWA pair), but
    never one the window of a token up to ``rollback_depth`` positions before
    the sequence's end still needs, so that a rollback of that depth (the
    ``n_rs_seq`` of a hybrid's recurrent part) finds every cell its next token
    reads.  A cache that evicts cannot promise that a context shift (which
    moves later tokens down, widening what the next window reaches) keeps
    every needed cell, so :meth:`get_can_shift` is False for it.

    Sizes and defaults (docs/memory-semantics.md#defaults): ``size`` cells
    *per stream*: a unified cache (the default) shares them between all
    sequences (a sequence of ``n_ctx`` positions needs ``n_ctx`` of them, so
    ``n_seq_max`` such sequences need ``n_seq_max * n_ctx``); with
    ``unified=False`` every sequence has its own ``size`` cells (K/V buffers of
    ``n_seq_max * size`` rows).  ``dtype`` defaults to f16.  ``n_pad`` (256)
    rounds the ``n_kv`` the attention reads up; it allocates nothing.
    ``rollback_depth`` (0) is raised by a hybrid to its recurrent part's
    ``n_rs_seq``.
    """

    def __init__(
        self,
        device: Device,
        layers: Sequence[KVLayer],
        *,
        size: int,
        n_seq_max: int,
        unified: bool = True,
        dtype: DType | str = DType.F16,
        swa_type: SWAType | str = SWAType.NONE,
        n_swa: int = 0,
        n_pad: int = 256,
        can_shift: bool = True,
        k_shift: KShiftFn | None = None,
        name: str = "kv",
        swa_evict: bool = True,
        rollback_depth: int = 0,
    ) -> None:
        for arg, value in (("size", size), ("n_seq_max", n_seq_max), ("n_swa", n_swa), ("n_pad", n_pad),
                           ("rollback_depth", rollback_depth)):  # fmt: skip
            check_int32(value, arg)  # int() would take 10.5 cells as 10
        if size <= 0:
            raise ArgumentError("size", f"must be > 0, got {size}")
        if n_pad <= 0:
            raise ArgumentError("n_pad", f"must be > 0, got {n_pad}")
        ils = [layer.il for layer in layers]
        if len(set(ils)) != len(ils):
            raise ArgumentError("layers", f"duplicate layer indices {ils}")
        self.device = device
        self.layers = list(layers)
        self.size = int(size)
        self.n_seq_max = int(n_seq_max)
        self.unified = bool(unified)
        self.n_stream = 1 if self.unified else self.n_seq_max
        self.dtype = DType.parse(dtype)
        self.swa_type = SWAType.parse(swa_type)
        self.n_swa = int(n_swa)
        if self.swa_type is not SWAType.NONE and self.n_swa <= 0:
            raise ArgumentError("n_swa", f"a {self.swa_type.value} window needs n_swa > 0")
        self.n_pad = int(n_pad)
        self.can_shift = bool(can_shift)
        self.k_shift = k_shift
        self.name = name
        self.swa_evict = bool(swa_evict)
        if rollback_depth < 0:
            raise ArgumentError("rollback_depth", f"must be >= 0, got {rollback_depth}")
        self.rollback_depth = int(rollback_depth)
        self._version = 0
        self.book = _Book([KVCells(self.size, self.n_seq_max) for _ in range(self.n_stream)], [0] * self.n_stream)
        self.pending_copies: list[tuple[int, int]] = []
        rows = self.n_stream * self.size
        self.k: dict[int, Buffer] = {}
        self.v: dict[int, Buffer] = {}
        #: the K/V write rows and masks of each step, rewritten in place (statecache.step_buffers)
        self.step_buffers = StepBuffers(device)
        for layer in self.layers:
            self.k[layer.il] = device.alloc((rows, layer.n_embd_k), self.dtype)
            if layer.n_embd_v:
                self.v[layer.il] = device.alloc((rows, layer.n_embd_v), self.dtype)

    # -- small helpers ------------------------------------------------------------
    @property
    def cells(self) -> list[KVCells]:
        return self.book.cells

    @property
    def is_swa(self) -> bool:
        return self.swa_type is not SWAType.NONE

    def stream_of(self, seq: int, name: str = "seq") -> int:
        seq = check_seq_id(seq, self.n_seq_max, name)
        return 0 if self.unified else seq

    def _check_seq(self, seq: int, name: str = "seq") -> int:
        return check_seq_id(seq, self.n_seq_max, name)

    @property
    def evicts(self) -> bool:
        """Whether the slot search may reuse cells a sliding window has left."""
        return self.is_swa and self.swa_evict

    def buffers(self) -> list[Buffer]:
        return list(self.k.values()) + list(self.v.values())

    def fill_garbage(self, seed: int) -> None:
        """Fill every K/V buffer with garbage (tests: nothing may rely on zeros)."""
        for k, buf in enumerate(self.buffers()):
            self.device.fill_bytes(buf, seed + k)

    def n_kv(self) -> int:
        """Cells the attention reads this step (max over streams, padded)."""
        if self.n_stream == 1:
            used = self.cells[0].used_max_p1()
        else:
            used = max(c.used_max_p1() for c in self.cells)
        return n_kv_for(used, self.size, self.n_pad)

    # -- placement (docs/memory-semantics.md#kv-placement) --------------------------
    def split(self, balloc: BatchAllocator, n_ubatch: int, varlen: bool = False) -> list[UBatch] | None:
        """The ubatches of a validated batch (``varlen``: packed, grouped per sequence set)."""
        balloc.split_reset()
        out = []
        while True:
            if varlen:
                ub = balloc.split_varlen(n_ubatch)
            else:
                ub = balloc.split_simple(n_ubatch) if self.n_stream == 1 else balloc.split_equal(n_ubatch, True)
            if ub.n_tokens == 0:
                break
            out.append(ub)
        return out if balloc.n_used == balloc.n_tokens else None

    def _stream_groups(self, ub: UBatch) -> list[tuple[int, np.ndarray]]:
        """The ubatch's tokens per stream: ``(stream, token indices)``, streams ascending."""
        if self.unified:
            return [(0, np.arange(ub.n_tokens))]
        primary = ub.primary
        order = np.argsort(primary, kind="stable")
        sp = primary[order]
        starts = np.flatnonzero(np.r_[True, sp[1:] != sp[:-1]])
        ends = np.r_[starts[1:], sp.size]
        return [(int(sp[a]), order[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]

    def _find_slot(self, book: _Book, ub: UBatch) -> SlotInfo | None:
        """Cells for the ubatch's tokens, per stream: free cells in cyclic order from the
        stream's search head (upstream's order, found a block at a time), then -- in a
        window cache that evicts -- cells a sliding window has left
        (:meth:`_evictable`).  O(tokens + blocks skipped), never a scan of the cells."""
        groups = self._stream_groups(ub)
        streams = np.zeros(ub.n_tokens, dtype=np.int64)
        cells_out = np.full(ub.n_tokens, -1, dtype=np.int64)
        reuse_owner = None
        for strm, tok in groups:
            cells = book.cells[strm]
            n = int(tok.size)
            if n > self.size:
                return None
            head = book.heads[strm]
            if head > cells.used + 2 * n:
                head = 0
            found = cells.free_from(head, n)
            streams[tok] = strm
            if len(found) < n and self.evicts:  # the free cells, then cells the window left
                n_free = len(found)
                taken, owners = self._evictable(cells, n - n_free, ub, tok)
                if n_free + taken.size < n:
                    return None
                if reuse_owner is None:
                    reuse_owner = np.full(ub.n_tokens, -1, dtype=np.int64)
                reuse_owner[tok[n_free:]] = owners
                cells_out[tok[n_free:]] = taken
                cells_out[tok[:n_free]] = found
            elif len(found) < n:
                return None
            else:
                cells_out[tok] = found
        return SlotInfo(streams, cells_out, self.size, reuse_owner)

    def _evictable(self, cells: KVCells, need: int, ub: UBatch, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``need`` cells a sliding window has left: a cell held by one sequence
        alone whose position the window of that sequence's earliest possible next
        token (``rollback_depth`` positions before its end) hides.  Those are the
        oldest cells of each sequence, so each sequence's are taken oldest first:
        the ubatch's own sequences first, then the others.  O(sequences + cells
        taken + cells skipped because shared), with no Python call per sequence that gives
        nothing.  Returned with each cell's sequence (its one owner)."""
        own = np.asarray(ub.primary[tok], dtype=np.int64)
        if self.n_seq_max <= _FEW_SEQS:
            return self._evictable_few(cells, need, own)
        ascending = own.size <= 1 or bool((own[1:] > own[:-1]).all())  # (a decode ubatch: distinct, ascending)
        if not ascending:
            _, first = np.unique(own, return_index=True)
            own = own[np.sort(first)]  # the ubatch's sequences in order of first appearance
        order: np.ndarray | None
        if ascending and own.size == self.n_seq_max:  # a decode step of every sequence: all, in order
            order = None
        else:
            rest = np.ones(self.n_seq_max, dtype=bool)
            rest[own] = False
            order = np.concatenate([own, np.flatnonzero(rest)])
        # each sequence's earliest possible next token, and the first position its window shows
        # (the rule is plain arithmetic: applied to all sequences at once)
        p_next = cells.seq_pos.last_positions(order) + (1 - self.rollback_depth)
        return cells.oldest_alone_arrays(order, swa_visible_from_many(self.n_swa, self.swa_type, p_next), need)

    def _evictable_few(self, cells: KVCells, need: int, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_evictable` of a cache of a few sequences: one by one, with Python ints (the
        arrays' fixed cost would be most of the step)."""
        order = list(dict.fromkeys(own.tolist()))
        order += [s for s in range(self.n_seq_max) if s not in order]
        book, n_owner = cells.seq_pos, cells.n_owner
        arena = book.arena
        out: list[int] = []
        owners: list[int] = []
        for s in order:
            n = int(book.n[s])
            if not n:
                continue
            st = int(book.start[s])
            first, last = int(arena[st]), int(arena[st + n - 1])
            p_end = swa_visible_from(self.n_swa, self.swa_type, (last >> 32) + 1 - self.rollback_depth)
            end_key = pos_key(p_end)
            if first >= end_key:
                continue  # (most sequences: nothing below the window)
            if n == 1 or int(arena[st + 1]) >= end_key:  # just the oldest (a decode step, once the window is full)
                c = first & 0xFFFFFFFF
                got = [c] if n_owner[c] == 1 else []
            else:
                got = cells.oldest_alone(s, p_end, need - len(out))
            out += got
            owners += [s] * len(got)
            if len(out) >= need:
                break
        return np.asarray(out, dtype=np.int64), np.asarray(owners, dtype=np.int64)

    def _apply_ubatch(
        self, book: _Book, sinfo: SlotInfo, ub: UBatch, reused: list[tuple[int, np.ndarray, np.ndarray]] | None = None
    ) -> None:
        """Place the ubatch's tokens into the cells ``sinfo`` names.  ``reused``: where a
        sliding-window reuse is recorded, before the stream changes, as ``(stream, cells,
        their sequence rows)`` (the undo record's; the rows are the journal's before-image
        too, read once)."""
        pos = np.asarray(ub.pos, dtype=np.int64)
        # the cell's 2-D extension: the token's M-RoPE (x, y) = sections (2, 1) as
        # upstream's apply_ubatch; a 1-D ubatch stores (pos, pos)
        ext = ub.pos_ext
        if ext is None:
            ext = pos[:, None].repeat(2, axis=1)
        single = isinstance(ub.seq_id, SeqIds)  # one sequence per token: placed in bulk
        for strm, tok in self._stream_groups(ub):
            cells = book.cells[strm]
            idx = sinfo.cells[tok]
            # sliding-window reuse: remember the overwritten position per sequence
            held = pmax = _NO_ROWS
            lost: dict[int, int] = {}  # (the same, for a few reused cells)
            occupied = cells.pos[idx] != EMPTY
            occ = idx[occupied]
            reuse = None
            if occ.size > _FEW:  # (vectorised: a prefill chunk may reuse a whole window's cells)
                # the cells' owners: the plan's, where the book says each cell is still held by
                # that one sequence (one element of the sequence matrix per cell, a row each
                # was several times the rest); else the cells' rows, read once.  Either is the
                # journal's before-image and the undo record's too.
                own = None if sinfo.reuse_owner is None else sinfo.reuse_owner[tok][occupied]
                if own is not None and not (
                    (own >= 0).all() and (cells.n_owner[occ] == 1).all() and cells.seq[occ, own].all()
                ):
                    own = None
                seq_rows = cells.seq[occ] if own is None else own
                if reused is not None:
                    reused.append((strm, occ, seq_rows))
                # the lost pairs sorted by (sequence, key), one sort for the drop and for the
                # highest lost position of each losing sequence (np.maximum.at costs more)
                runs = cells.owner_runs(occ, seq_rows, own)
                held, pmax = runs.highest()
                if single:  # dropped by the placement, which refills the cells at once
                    reuse = (occupied, occ, runs, seq_rows)
                else:
                    cells.rm_many(occ, runs, seq_rows)
            elif occ.size:  # a few cells (a small batch): one by one, the arrays' fixed cost saved
                if reused is not None:
                    reused.append((strm, occ, cells.seq[occ]))
                for c in occ.tolist():
                    p = cells.pos_get(c)
                    for s in cells.seqs_of(c):
                        lost[s] = max(p, lost.get(s, -1))
                    cells.rm(c)
            if single:
                cells.place_seqs(idx, pos[tok], ext[tok], ub.seq_id.ids[tok], reuse)  # type: ignore[attr-defined]
            else:
                for k, c in enumerate(idx.tolist()):
                    i = int(tok[k])
                    cells.pos_set(c, int(pos[i]), (int(ext[i, 0]), int(ext[i, 1])))
                    for s in ub.seq_id[i]:
                        cells.seq_add(c, s)
            # purge: a sequence keeps every position between its min and max (the sequences
            # whose oldest position is still at or below one they lost; read all at once)
            if held.size:
                lo = cells.seq_pos.first_positions(held)
                for k in np.flatnonzero((lo != -1) & (lo <= pmax)).tolist():
                    self._seq_rm_cells(book, strm, int(held[k]), int(lo[k]), int(pmax[k]) + 1)
            for s, p_lost in lost.items():
                p_first = cells.seq_pos_min(s)
                if p_first != -1 and p_first <= p_lost:
                    self._seq_rm_cells(book, strm, s, p_first, p_lost + 1)
            head = int(idx.max()) + 1
            book.heads[strm] = 0 if head >= self.size else head

    def _plan_streams(self, ubatches: Sequence[UBatch]) -> list[int]:
        if self.unified:
            return [0]
        return sorted({int(s) for ub in ubatches for s in np.unique(ub.primary).tolist()})

    def prepare(self, ubatches: Sequence[UBatch]) -> list[SlotInfo] | None:
        """Slot infos for every ubatch (None: no room); changes nothing.

        Each ubatch but the last is placed on the book itself, under a journal
        (:class:`BookJournal`), so that the next one's search sees it; the
        journal then takes every placement back, exactly.  This costs the cells
        the ubatches take, where a copy of the book cost every cell.

        Raises :class:`ContextError` (nothing changed) while a copy between streams
        waits for the update: its rows move only then, so a batch placed before it
        wrote rows the copy reads (the update then copied the new tokens into the
        destination) or fills (it then overwrote them), silently.  Upstream's decode
        always runs the update first."""
        if self.pending_copies:
            ss, sd = self.pending_copies[0]
            raise ContextError(
                f"{self.name}: the copy between streams {ss} -> {sd} (seq_cp) waits for the update; "
                "apply init_update() before planning a batch"
            )
        for ub in ubatches:
            if isinstance(ub.seq_id, SeqIds):
                ids = ub.seq_id.ids
                if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.n_seq_max):
                    return None
            elif any(not 0 <= s < self.n_seq_max for ids in ub.seq_id for s in ids):
                return None
        if len(ubatches) == 1:
            sinfo = self._find_slot(self.book, ubatches[0])
            return None if sinfo is None else [sinfo]
        journal = BookJournal(self.book, self._plan_streams(ubatches))
        try:
            out = []
            for k, ub in enumerate(ubatches):
                sinfo = self._find_slot(self.book, ub)
                if sinfo is None:
                    return None
                out.append(sinfo)
                if k + 1 < len(ubatches):
                    self._apply_ubatch(self.book, sinfo, ub)
            return out
        finally:
            journal.rollback(self.book)

    def make_context(self, ubatches: Sequence[UBatch], sinfos: Sequence[SlotInfo]) -> KVCacheContext:
        return KVCacheContext(self, ubatches, sinfos)

    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False, *, varlen: bool = False
    ) -> MemoryContext:
        balloc.check_ready(self.n_seq_max)  # never initialised, or validated for another memory
        ubs = self.split(balloc, n_ubatch, varlen)
        if ubs is None:
            return StatusContext(MemoryStatus.FAILED_PREPARE, "(the splitter could not consume every token)")
        sinfos = self.prepare(ubs)
        if sinfos is None:
            return StatusContext(MemoryStatus.FAILED_PREPARE, f"({self.name}: no free slot)")
        return self.make_context(ubs, sinfos)

    def init_full(self) -> MemoryContext:
        return KVFullContext(self)

    def has_pending_update(self) -> bool:
        return bool(self.pending_copies) or any(c.has_shift for c in self.cells)

    def init_update(self, optimize: bool = False) -> MemoryContext:
        if not self.has_pending_update():
            return self.no_update_context()
        return KVUpdateContext(self)

    def get_can_shift(self) -> bool:
        """False when the slot search evicts cells a window has left: a context shift
        would move later tokens down, and their window would reach cells already gone."""
        return not self.evicts

    # -- sequence operations (docs/memory-semantics.md#kv-sequence-ops) -------------
    def _seq_rm_cells(self, book: _Book, strm: int, seq: int, p0: int, p1: int) -> bool:
        """Drop ``seq`` from its cells in [p0, p1); True when it held any.  O(cells dropped)."""
        cells = book.cells[strm]
        sc = cells.seq_pos[seq]
        lo, hi = sc.span(p0, p1)
        if lo == hi:
            return False
        gone = cells.seq_rm_many(sc.cells(lo, hi), seq)
        if gone.size:
            book.heads[strm] = min(book.heads[strm], int(gone.min()))
        return True

    def clear(self, data: bool = True) -> None:
        self._version += 1
        for c in self.cells:
            c.reset()
        self.book.heads = [0] * self.n_stream
        self.pending_copies.clear()
        if data:
            for buf in self.buffers():
                self.device.write(buf, np.zeros(buf.shape, dtype=np.float32))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        p0, p1 = normalize_range(p0, p1)
        if seq >= 0:
            strm = self.stream_of(seq)
            if self._seq_rm_cells(self.book, strm, seq, p0, p1):
                self._version += 1
            return True
        for strm, cells in enumerate(self.cells):
            hit = np.flatnonzero((cells.pos >= p0) & (cells.pos < p1))
            if hit.size:
                self._version += 1
                cells.rm_many(hit)
                self.book.heads[strm] = min(self.book.heads[strm], int(hit[0]))
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        ss, sd = self.stream_of(src, "src"), self.stream_of(dst, "dst")
        p0, p1 = normalize_range(p0, p1)
        if src == dst:
            return
        if ss != sd and (p0 != 0 or p1 != normalize_range(-1, -1)[1]):
            raise ArgumentError(
                "p0/p1", f"a copy between streams ({src} -> {dst}) must cover the whole sequence, got [{p0}, {p1})"
            )
        self._version += 1
        if ss == sd:
            cells = self.cells[ss]
            brought = [(pos, idx) for pos, idx in cells.seq_pos[src] if p0 <= pos < p1]
            # dst's own cells at a position src brings are dropped first: upstream keeps
            # them, and dst then held two cells at one position (attending to both, with
            # a blob its own state_read refuses as "duplicate positions").  dst holds
            # src's tokens at those positions, as a copy between streams does.
            at = {pos for pos, _ in brought}
            own = [idx for pos, idx in cells.seq_pos[dst] if pos in at and not cells.seq_has(idx, src)]
            if own:
                gone = cells.seq_rm_many(np.array(sorted(own), dtype=np.int64), dst)
                if gone.size:
                    self.book.heads[ss] = min(self.book.heads[ss], int(gone.min()))
            for _, idx in brought:
                cells.seq_add(idx, dst)
            return
        src_cells, dst_cells = self.cells[ss], self.cells[sd]
        dst_cells.reset()
        for pos, idx in src_cells.seq_pos[src]:
            shift = int(src_cells.shift[idx])
            dst_cells.pos_set(idx, pos - shift, tuple(int(x) for x in src_cells.ext[idx]))  # type: ignore[arg-type]
            dst_cells.seq_add(idx, dst)
            if shift:
                dst_cells.pos_add(idx, shift)
        self.book.heads[sd] = self.book.heads[ss]
        # The buffer copy waits for the next update.  Every request is kept, in
        # order: the book is already copied, so a later copy out of ``sd`` (a
        # chain 0 -> 1 -> 2) needs the earlier copy into ``sd`` to run first.
        self.pending_copies.append((ss, sd))

    def seq_keep(self, seq: int) -> None:
        self._check_seq(seq)
        self._version += 1
        for strm, cells in enumerate(self.cells):
            for idx in (int(i) for i in np.flatnonzero(cells.pos != EMPTY)):
                if not cells.seq_has(idx, seq):
                    cells.rm(idx)
                    self.book.heads[strm] = min(self.book.heads[strm], idx)
                else:
                    for s in cells.seqs_of(idx):
                        if s != seq:
                            cells.seq_rm(idx, s)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        strm = self.stream_of(seq)
        p0, p1 = normalize_range(p0, p1)
        delta = check_int32(delta, "delta")
        if delta == 0 or p0 >= p1:
            return
        cells = self.cells[strm]
        self.check_position_move(seq, p0, p1, "seq_add", delta)
        moved = [pc for pc in cells.seq_pos[seq] if p0 <= pc[0] < p1]
        if moved:
            self._version += 1
        for _, idx in moved:
            if cells.pos_add(idx, delta):
                self.book.heads[strm] = 0 if self.book.heads[strm] == 0 else min(self.book.heads[strm], idx)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        strm = self.stream_of(seq)
        d = check_divisor(d)
        p0, p1 = normalize_range(p0, p1)
        if d == 1 or p0 >= p1:
            return
        cells = self.cells[strm]
        self.check_position_move(seq, p0, p1, "seq_div", d=d)
        moved = [pc for pc in cells.seq_pos[seq] if p0 <= pc[0] < p1]
        if moved:
            self._version += 1
        for _, idx in moved:
            cells.pos_div(idx, d)

    def check_position_move(self, seq: int, p0: int, p1: int, op: str = "seq_add", delta: int = 0, d: int = 1) -> None:
        """Raise (changing nothing) if ``seq_add`` (by ``delta``) / ``seq_div`` (by ``d``)
        over [p0, p1) would be refused: a cell shared with another sequence, a
        position moved past int32, or two cells of ``seq`` left at one whole
        position (with their 2-D extension): a sequence never holds that (a state
        blob could not tell them apart, docs/state-format.md).  Composites call it
        for every part before touching any."""
        cells = self.cells[self.stream_of(seq)]
        q0, q1 = normalize_range(p0, p1)
        if q0 >= q1:
            return
        self._check_unshared(cells, seq, q0, q1, op)
        pairs = cells.seq_pos[seq]
        if delta > 0:
            inside = [p for p, _ in pairs if q0 <= p < q1]
            if inside:
                check_shifted(max(inside), delta)
        if (delta or d != 1) and pairs:
            self._check_no_twins(cells, seq, pairs, q0, q1, op, delta, d)

    @staticmethod
    def _check_no_twins(
        cells: KVCells, seq: int, pairs: Sequence[tuple[int, int]], q0: int, q1: int, op: str, delta: int, d: int
    ) -> None:
        """Refuse a move of ``pairs`` (``seq``'s cells) in [q0, q1) by ``delta`` (or ``// d``)
        that leaves two of them at one whole position."""
        seen: set[tuple[int, int, int]] = set()
        for p, c in pairs:
            q = (p + delta if delta else p // d) if q0 <= p < q1 else p
            key = (q, int(cells.ext[c, 0]), int(cells.ext[c, 1]))
            if q >= 0 and key in seen:
                raise ArgumentError(
                    "delta" if delta else "d",
                    f"{op} would leave two cells of sequence {seq} at position {q} (same 2-D extension); "
                    "remove the positions it would land on first, as a context shift does",
                )
            seen.add(key)

    @staticmethod
    def _check_unshared(cells: KVCells, seq: int, p0: int, p1: int, op: str) -> None:
        """A position lives in the cell, so moving a cell shared with another
        sequence would silently move that sequence too (upstream does): refuse."""
        for pos, idx in cells.seq_pos[seq]:
            if p0 <= pos < p1 and cells.seq_count(idx) > 1:
                others = [s for s in cells.seqs_of(idx) if s != seq]
                raise ArgumentError(
                    "seq",
                    f"{op}: position {pos} of sequence {seq} is shared with sequences {others}; remove or "
                    "copy them apart first",
                )

    # -- questions before actions (docs/memory-semantics.md#queries) ----------------
    def check_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        check_seq_id(seq, self.n_seq_max, allow_all=True)
        normalize_range(p0, p1)  # a KV cache never refuses a removal

    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        ss, sd = self.stream_of(src, "src"), self.stream_of(dst, "dst")
        q0, q1 = normalize_range(p0, p1)
        if src != dst and ss != sd and (q0, q1) != (0, POS_MAX):
            raise ArgumentError(
                "p0/p1", f"a copy between streams ({src} -> {dst}) must cover the whole sequence, got [{q0}, {q1})"
            )

    def check_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self.stream_of(seq)
        q0, q1 = normalize_range(p0, p1)
        delta = check_int32(delta, "delta")
        if delta and q0 < q1:
            self.check_position_move(seq, q0, q1, "seq_add", delta)

    def check_seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self.stream_of(seq)
        d = check_divisor(d)
        q0, q1 = normalize_range(p0, p1)
        if d != 1 and q0 < q1:
            self.check_position_move(seq, q0, q1, "seq_div", d=d)

    def check_context_shift(self, seq: int, p0: int, p1: int) -> None:
        strm = self.stream_of(seq)
        q0, q1 = normalize_range(p0, p1)
        # The removal is never refused.  The move, as the removal leaves the cells: the
        # positions from q1 on land on [q0, ...), which the removal emptied (no int32
        # overflow either); refused for a cell another sequence shares, or two cells the
        # sequence already held at one position (seq_cp onto a sequence that held some).
        if q0 < q1 < POS_MAX:
            cells = self.cells[strm]
            self._check_unshared(cells, seq, q1, POS_MAX, "context shift")
            kept = [(p, c) for p, c in cells.seq_pos[seq] if not q0 <= p < q1]
            self._check_no_twins(cells, seq, kept, q1, POS_MAX, "context shift", q0 - q1, 1)

    def rollback_reach(self, seq: int) -> RollbackReach:
        return RollbackReach(int(seq), self.seq_pos_max(seq), 0)  # a KV cache removes any range

    def seq_state(self, seq: int) -> SeqState:
        rr = self.rollback_reach(seq)
        return SeqState(rr.seq, self.version, self.seq_pos_min(seq), rr.pos_max, None, (self.seq_cells_view(seq),), rr)

    def seq_cells_view(self, seq: int) -> KVSeqCells:
        """``seq``'s cells here with their positions (:class:`~statecache.memory.KVSeqCells`)."""
        strm = self.stream_of(seq)
        cells = self.cells[strm]
        sc = cells.seq_pos[seq]
        idx = readonly_rows(sc.cells())
        rows = readonly_rows(idx + strm * self.size)
        version = self.version

        def read(il: int, v: bool) -> np.ndarray:
            view_guard(self, version)
            bufs = self.v if v else self.k
            if il not in bufs:
                raise ArgumentError("layer", f"{self.name} holds no {'V' if v else 'K'} rows of layer {il}")
            buf = bufs[il]
            out: np.ndarray = gather_rows(self.device, buf, rows).view(buf.dtype.numpy).reshape(rows.size, -1)
            return out

        shared = cells.n_owner[idx] > 1
        shared.flags.writeable = False
        layers = tuple(la.il for la in self.layers)
        pending = readonly_rows(cells.shift[idx])
        return KVSeqCells(self.name, strm, readonly_rows(sc.positions()), idx, rows, shared, pending, layers,
                          not self.v, read)  # fmt: skip

    def seq_pos_min(self, seq: int) -> int:
        return self.cells[self.stream_of(seq)].seq_pos_min(seq)

    def seq_pos_max(self, seq: int) -> int:
        return self.cells[self.stream_of(seq)].seq_pos_max(seq)

    def seq_pos_max_all(self) -> np.ndarray:
        """seq_pos_max of every sequence id in [0, n_seq_max) as one array (batch validation reads it
        once per batch instead of one checked call per sequence)."""
        n = self.n_seq_max
        cells = self.cells
        if self.unified:
            return cells[0].seq_pos.last_positions()[:n]
        return last_positions([cells[s].seq_pos[s] for s in range(n)])

    def memory_breakdown(self) -> dict[str, int]:
        return {self.device.id: sum(b.nbytes for b in self.buffers())}

    # -- mask -------------------------------------------------------------------------
    def mask(self, ub: UBatch, n_kv: int | None = None, *, causal: bool = True, alibi: bool = False) -> np.ndarray:
        """``[n_tokens, n_kv]`` mask of a ubatch; row i is over token i's stream.

        Built from the cells each token's sequence holds within its causal window
        (:func:`~statecache.kv_mask.build_mask_seqs`): the values of
        :func:`~statecache.kv_mask.build_mask` over the whole stream, in the time
        of the cells the tokens attend.  A context builds it once per ubatch
        (:meth:`KVCacheContext.mask`) and hands the same array to every layer."""
        n_kv = self.n_kv() if n_kv is None else n_kv
        primary = ub.primary
        streams = np.zeros(ub.n_tokens, dtype=np.int64) if self.unified else primary
        # M-RoPE: a cell at the token's temporal position is in the future when its
        # (y, x) is later than the token's (upstream compares 2-D positions only for a
        # ubatch that carries them)
        return build_mask_seqs(
            self.cells,
            streams,
            ub.pos,
            primary,
            n_kv,
            causal=causal,
            swa_type=self.swa_type,
            n_swa=self.n_swa,
            alibi=alibi,
            token_ext=ub.pos_ext,
        )

    # -- state (docs/state-format.md) ---------------------------------------------------
    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        w = Writer()
        self.state_write_into(w, seq)
        return pack_sections([(TAG_KV, w)], flags)

    @functools.cached_property
    def _row_layout(self) -> tuple[tuple[str, int, Buffer, bytes], ...]:
        """Per K then V buffer, in the order a KV section holds them: ``(kind, layer, buffer,
        descriptor)``, the descriptor being the bytes of its ``layer, type, row_bytes``
        fields (the cache's layers and buffers are fixed when it is built): written as
        they are, and read by comparing bytes (:meth:`Reader.match`), field by field only
        when they differ (to name what is wrong)."""
        out = []
        for kind, bufs in (("k", self.k), ("v", self.v)):
            for layer in self.layers:
                if layer.il in bufs:
                    w = Writer()
                    w.u32(layer.il)
                    w.i32(DTYPE_CODES[self.dtype])
                    w.u64(bufs[layer.il].shape[1] * self.dtype.itemsize)
                    out.append((kind, layer.il, bufs[layer.il], w.getvalue()))
        return tuple(out)

    def state_write_into(self, w: Writer, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        # a pending update is accounted for, not required (docs/memory-semantics.md#kv-state)
        data_stream = self._streams_after_copies()
        # a per-sequence blob holds only that sequence's stream (so it can be
        # restored into another sequence, hence another stream)
        streams = [self.stream_of(seq)] if seq >= 0 else list(range(self.n_stream))
        w.u32(len(streams))
        for strm in streams:
            cells = self.cells[strm]
            if seq >= 0:
                idxs = np.flatnonzero(cells.seq[:, seq])  # the sequence's cells, in cell order
            else:
                idxs = np.flatnonzero(cells.pos != EMPTY)
            ext = cells.ext[idxs]
            has_ext = bool((ext != cells.pos[idxs, None]).any())
            w.u32(int(idxs.size) | (KV_CELL_COUNT_EXT if has_ext else 0))
            if not idxs.size:
                continue
            if seq >= 0:  # one owner per cell: fixed-size records, written at once
                rec = [cells.pos[idxs], np.ones(idxs.size, dtype=np.int64), np.full(idxs.size, seq)]
                if has_ext:
                    rec += [ext[:, 0], ext[:, 1]]
                w.raw(np.stack(rec, axis=1).astype("<i4"))
            else:
                for k, idx in enumerate(idxs):
                    w.i32(int(cells.pos[idx]))
                    ids = cells.seqs_of(int(idx))
                    w.u32(len(ids))
                    for s in ids:
                        w.i32(s)
                    if has_ext:
                        w.i32(int(ext[k, 0]))
                        w.i32(int(ext[k, 1]))
            rows = idxs + data_stream[strm] * self.size
            shift = cells.shift[idxs] if self.can_shift and cells.has_shift else None
            w.u32(len(self.layers))
            rotate = shift is not None and bool(shift.any())
            for kind, il, buf, desc in self._row_layout:
                w.raw(desc)  # layer, type, row_bytes
                if kind == "k" and rotate:
                    assert shift is not None
                    w.rows(self.device, self._rotated_copy(il, buf, rows, shift), np.arange(rows.size))
                else:
                    w.rows(self.device, buf, rows)  # only the sequence's rows leave the device

    def _streams_after_copies(self) -> list[int]:
        """Per stream, the stream whose K/V rows it holds once the pending copies between
        streams ran (:class:`KVUpdateContext` runs them in request order)."""
        src = list(range(self.n_stream))
        for ss, sd in self.pending_copies:
            src[sd] = src[ss]
        return src

    def _rotated_copy(self, il: int, buf: Buffer, rows: np.ndarray, shift: np.ndarray) -> Buffer:
        """The K rows ``rows`` of layer ``il`` as the pending update leaves them: copied
        into a scratch buffer, whose shifted rows the ``k_shift`` hook re-rotates there
        (the cache itself is not touched)."""
        if self.k_shift is None:
            raise StateError(
                self.name,
                "K rows wait for a position shift and this cache has no k_shift hook to rotate a copy: run "
                "init_update() (the runtime's K rotation) before state_write, or build the cache with k_shift",
            )
        dev = self.device
        tmp = dev.alloc((rows.size, buf.shape[1]), buf.dtype)
        dev.copy_rows(buf, dev.indices(rows), tmp, dev.indices(np.arange(rows.size)))
        moved = np.flatnonzero(shift)
        self.k_shift(self, il, tmp, moved.astype(np.int64), shift[moved].astype(np.int64))
        return tmp

    def state_parse(self, r: Reader, seq: int = -1, flags: int = StateFlags.NONE) -> KVStatePlan:
        """Validate a KV section and choose destination cells; changes nothing.

        Besides the fields, the cells must describe a possible book: within a
        stream no sequence holds one position twice (with its 2-D extension:
        M-RoPE image tokens share a temporal position, never the whole of it)."""
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        streams = [self.stream_of(seq)] if seq >= 0 else list(range(self.n_stream))
        # A copy between streams still waiting for the update reads its source stream's
        # rows and fills its destination's then: restoring a sequence of either stream
        # before it had the update overwrite the restored rows (or carry them into the
        # destination), silently.  (A whole-memory read clears the pending copies.)
        for ss, sd in self.pending_copies if seq >= 0 else ():
            if streams[0] in (ss, sd):
                raise StateError(
                    f"{self.name}.stream",
                    f"stream {streams[0]} of sequence {seq} waits for the copy between streams {ss} -> {sd} "
                    "(seq_cp): apply init_update() first",
                )
        n_stream = r.u32(f"{self.name}.n_stream")
        if n_stream != len(streams):
            raise StateError(f"{self.name}.n_stream", f"blob has {n_stream} streams, expected {len(streams)}")
        placements = []
        data_field = {"k": f"{self.name}.k_data", "v": f"{self.name}.v_data"}
        k_rows: dict[int, list[np.ndarray]] = {layer.il: [] for layer in self.layers}
        v_rows: dict[int, list[np.ndarray]] = {il: [] for il in self.v}
        exts: list[np.ndarray] = []
        for strm in streams:
            word = r.u32(f"{self.name}.cell_count")
            has_ext = bool(word & KV_CELL_COUNT_EXT)
            count = word & ~KV_CELL_COUNT_EXT
            if count > self.size:
                raise StateError(f"{self.name}.cell_count", f"{count} cells do not fit a stream of {self.size}")
            one_owner = one_owner_records(r, count, has_ext) if seq >= 0 else None
            if one_owner is not None:  # a sequence's blob: fixed-size records, checked at once
                pos, ext = one_owner
                sets: list[tuple[int, ...]] = [(seq,)] * count
            else:
                pos, ext, sets = self._parse_cells(r, count, has_ext, seq, strm)
            # M-RoPE: an image's cells share a temporal position, never a whole (pos, x, y)
            increasing = count < 2 or bool((pos[1:] > pos[:-1]).all())  # (the usual case: no sort needed)
            whole = np.stack([pos, ext[:, 0], ext[:, 1]], axis=1) if seq >= 0 and not increasing else None
            if whole is not None and np.unique(whole, axis=0).shape[0] != count:
                raise StateError(f"{self.name}.pos", "duplicate positions in a per-sequence blob")
            if seq < 0:
                keys = list(zip(pos.tolist(), ext[:, 0].tolist(), ext[:, 1].tolist()))
                held = [(q, *key) for key, ids in zip(keys, sets) for q in ids]
                if len(set(held)) != len(held):
                    dup = next(h for k, h in enumerate(held) if h in held[:k])
                    raise StateError(
                        f"{self.name}.pos", f"sequence {dup[0]} holds position {dup[1]} twice in stream {strm}"
                    )
            if count:
                n_layer = r.u32(f"{self.name}.n_layer")
                if n_layer != len(self.layers):
                    raise StateError(
                        f"{self.name}.n_layer", f"blob has {n_layer} layers, this cache {len(self.layers)}"
                    )
                for kind, layer_il, buf, desc in self._row_layout:
                    width = buf.shape[1]
                    if not r.match(desc):  # some field differs: read them one by one, naming it
                        il = r.u32(f"{self.name}.{kind}_layer")
                        if il != layer_il:
                            raise StateError(f"{self.name}.{kind}_layer", f"expected layer {layer_il}, got {il}")
                        code = r.i32(f"{self.name}.{kind}_type")
                        if CODE_DTYPES.get(code) is not self.dtype:
                            raise StateError(f"{self.name}.{kind}_type", f"type code {code}, this cache {self.dtype}")
                        row_bytes = r.u64(f"{self.name}.{kind}_row_bytes")
                        if row_bytes != width * self.dtype.itemsize:
                            raise StateError(
                                f"{self.name}.{kind}_row_bytes",
                                f"{row_bytes} bytes per row, this layer has {width * self.dtype.itemsize}",
                            )
                    store = k_rows if kind == "k" else v_rows
                    store[layer_il].append(r.rows(count, width * self.dtype.itemsize, self.dtype, data_field[kind]))
            else:
                for store in (k_rows, v_rows):
                    for il in store:
                        store[il].append(np.zeros((0, 1), dtype=self.dtype.numpy))
            # destination cells
            cells = self.cells[strm]
            if seq >= 0:
                free = cells.pos == EMPTY
                mine = cells.seq[:, seq] & (cells.seq.sum(axis=1) == 1)  # freed by dropping seq first
                cand = np.flatnonzero(free | mine)
                if cand.size < count:
                    raise StateError(
                        f"{self.name}.cell_count", f"{count} cells to restore, only {cand.size} free in stream {strm}"
                    )
                dest = cand[:count]
            else:
                dest = np.arange(count, dtype=np.int64)
            placements.append((strm, dest, pos, sets))
            exts.append(ext)
        return KVStatePlan(seq, placements, k_rows, v_rows, exts)

    def _parse_cells(
        self, r: Reader, count: int, has_ext: bool, seq: int, strm: int
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
        """The cells of one stream read field by field: positions, 2-D extensions and
        sequence sets, each field checked (and named) as it is read."""
        pos = np.zeros(count, dtype=np.int64)
        ext = np.zeros((count, 2), dtype=np.int64)
        sets: list[tuple[int, ...]] = []
        for c in range(count):
            p = r.i32(f"{self.name}.pos")
            if p < 0:
                raise StateError(f"{self.name}.pos", f"cell {c} has negative position {p}")
            if p > POS_LAST:  # the open end of every range: no cell holds it (memory.POS_LAST)
                raise StateError(f"{self.name}.pos", f"cell {c} has position {p}, past the largest {POS_LAST}")
            n_ids = r.u32(f"{self.name}.n_seq_id")
            if seq >= 0 and n_ids != 1:
                raise StateError(f"{self.name}.n_seq_id", f"a per-sequence blob needs 1 id per cell, got {n_ids}")
            if n_ids == 0 or n_ids > self.n_seq_max:
                raise StateError(f"{self.name}.n_seq_id", f"cell {c} lists {n_ids} sequences")
            ids = tuple(r.i32(f"{self.name}.seq_id") for _ in range(n_ids))
            if seq < 0:
                if any(not 0 <= s < self.n_seq_max for s in ids) or len(set(ids)) != len(ids):
                    raise StateError(f"{self.name}.seq_id", f"cell {c}: bad sequence ids {ids}")
                if not self.unified and ids != (strm,):
                    raise StateError(f"{self.name}.seq_id", f"cell {c} of stream {strm} holds {ids}")
                sets.append(ids)
            else:
                sets.append((seq,))
            pos[c] = p
            if has_ext:
                ext[c] = (r.i32(f"{self.name}.ext_x"), r.i32(f"{self.name}.ext_y"))
            else:
                ext[c] = (p, p)
        return pos, ext, sets

    def state_commit(self, plan: KVStatePlan) -> None:
        self._version += 1
        if plan.seq >= 0:
            self.seq_rm(plan.seq)
        else:
            self.clear(data=False)
        for k_strm, (strm, dest, pos, sets) in enumerate(plan.placements):
            if not dest.size:
                continue
            cells = self.cells[strm]
            ext = plan.exts[k_strm] if plan.exts else np.stack([pos, pos], axis=1)
            if plan.seq >= 0:  # one owner per cell, all free once seq_rm ran: one bulk placement
                cells.place_seqs(dest, pos, ext, np.full(dest.size, plan.seq, dtype=np.int64))
            else:
                for k in range(dest.size):
                    idx = int(dest[k])
                    cells.pos_set(idx, int(pos[k]), (int(ext[k, 0]), int(ext[k, 1])))
                    for s in sets[k]:
                        cells.seq_add(idx, s)
            rows = dest + strm * self.size
            for store, bufs in ((plan.k_rows, self.k), (plan.v_rows, self.v)):
                for il, per_stream in store.items():
                    scatter_rows(self.device, bufs[il], rows, per_stream[k_strm])  # already in the cache's dtype
            self.book.heads[strm] = 0

    def landing_writes(self, plan: KVStatePlan) -> list[RowWrite]:
        """The row writes :meth:`state_commit` makes for ``plan`` into streams whose
        destination cells are all free now (no sequence holds them), so a transfer may
        receive those rows there before the commit (:func:`~statecache.state_io.rows_landing`)."""
        out = []
        for k_strm, (strm, dest, _, _) in enumerate(plan.placements):
            if not dest.size or (self.cells[strm].pos[dest] != EMPTY).any():
                continue
            rows = dest + strm * self.size
            for store, bufs in ((plan.k_rows, self.k), (plan.v_rows, self.v)):
                out += [RowWrite(self.device, bufs[il], rows, per[k_strm]) for il, per in store.items()]
        return out

    def state_landing_failed(self) -> None:
        """A read failed after a transfer's rows landed in free cells: an undo or a plan
        made before it, which may count on what those cells held, is stale now."""
        self._version += 1

    def state_tags(self, flags: int = StateFlags.NONE) -> tuple[bytes, ...]:
        """The tags of the sections :meth:`state_write` writes (with any flags)."""
        return (TAG_KV,)

    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        """Restore from a blob.  The whole blob is parsed and placed before
        anything is written, so a rejected blob (``StateError``) leaves the cache
        exactly as it was; only a failure while writing (after validation)
        drops the destination, so no half-restored sequence survives."""
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        _, sections = unpack_sections(data)  # PARTIAL_ONLY changes nothing a single cache writes
        expect_sections(sections, self.state_tags(flags), "KV cache")
        r = Reader(find_section(sections, TAG_KV))
        plan = self.state_parse(r, seq)
        r.at_end()
        rows_landing(lambda: self.landing_writes(plan), self.state_landing_failed)
        rows_ready()  # a transfer's rows may still be arriving: validated above, written below
        try:
            self.state_commit(plan)
        except BaseException:
            self._state_drop(seq)
            raise

    def _state_drop(self, seq: int) -> None:
        """Upstream's failure contract: the destination ends empty."""
        if seq >= 0:
            self.seq_rm(seq)
        else:
            self.clear(data=True)


def _owner_rows(owners: np.ndarray, n_seq_max: int) -> np.ndarray:
    """Sequence rows ``[cells, n_seq_max]`` from rows (as they are) or each cell's one sequence."""
    if owners.ndim == 2:
        return owners
    rows = np.zeros((owners.size, n_seq_max), dtype=bool)
    rows[np.arange(owners.size), owners] = True
    return rows


@dataclasses.dataclass(eq=False)
class _KVApplyRecord:
    """What :meth:`KVCacheContext.undo_rows` needs for one applied ubatch:
    ``overwrites`` are the global rows the ubatch was placed into although the
    book before it still used their cells (sliding-window reuse), ``saved``
    the copies of those rows taken at ``apply()`` (``None``: not kept)."""

    index: int
    overwrites: np.ndarray
    saved: list[tuple[Buffer, Buffer]] | None
    #: per overwritten row, the sequences that held its cell before (what an undo drops):
    #: ``owners[k, s]`` for row ``overwrites[k]`` (a copy of the cells' sequence rows, no
    #: Python work per row at apply; read only by :meth:`KVCacheContext.undo_rows_damage`),
    #: or, 1-D, ``owners[k]`` the one sequence of each (a decode step's reuse)
    owners: np.ndarray | None = None


class KVCacheContext(UBatchContext):
    """A planned batch on one KV cache; the runtime's view of a ubatch.

    Undo after a failed compute: the book comes back from :meth:`snapshot`;
    the K/V *rows* matter only where a ubatch reused a cell the old book
    still holds (sliding-window reuse), because the runtime writes the
    ubatch's rows there.  With ``keep_undo_rows`` set when a ubatch is
    applied, ``apply()`` first copies those rows of every K/V buffer to
    scratch buffers (one ``copy_rows`` per buffer, nothing when no cell is
    reused), and :meth:`undo_rows` copies them back, exactly.  Without kept
    rows :meth:`undo_rows` reports them as damaged -- whether or not the
    runtime got as far as writing them, which this object cannot see -- and
    the caller drops the sequences that own them.
    """

    def __init__(self, cache: KVCache, ubatches: Sequence[UBatch], sinfos: Sequence[SlotInfo]) -> None:
        super().__init__(ubatches, cache)
        self.cache = cache
        self.sinfos = list(sinfos)
        self.keep_undo_rows = False
        self._records: list[_KVApplyRecord] = []
        #: one per applied ubatch: what it changed in the book (snapshot/restore replay them back)
        self._journals: list[BookJournal] = []
        self._mask: np.ndarray | None = None
        self._mask_key: tuple[Any, ...] | None = None

    def _apply_ubatch(self, i: int) -> bool:
        cache, sinfo = self.cache, self.sinfos[i]
        rec = _KVApplyRecord(i, _NO_ROWS, None)
        self._records.append(rec)
        streams = [0] if cache.unified else np.unique(sinfo.streams).tolist()
        journal = BookJournal(cache.book, streams)
        self._journals.append(journal)  # before any change: a failure half-way is taken back too
        # only a window cache places tokens into cells it still uses: the book's apply reports
        # them (and their owners) as it reads them anyway, before it changes them
        reused: list[tuple[int, np.ndarray, np.ndarray]] = []
        try:
            cache._apply_ubatch(cache.book, sinfo, self.ubatches[i], reused if cache.evicts else None)
        finally:
            journal.close(cache.book)
            cache._version += 1
            journal.version_after = cache._version
            if reused:
                if len(reused) == 1:
                    strm, occ, owners = reused[0]
                    rec.overwrites, rec.owners = occ + strm * cache.size, owners
                else:
                    rec.overwrites = np.concatenate([occ + strm * cache.size for strm, occ, _ in reused])
                    rec.owners = np.concatenate([_owner_rows(o, cache.n_seq_max) for _, _, o in reused])
        if self.keep_undo_rows:
            # the rows the ubatch will write although the old book still uses them, copied
            # before the compute writes them (the book's apply wrote no K/V row)
            rows, saved = rec.overwrites, []
            if rows.size:
                dev = cache.device
                src, local = dev.indices(rows), dev.indices(np.arange(rows.size))
                for buf in cache.buffers():
                    tmp = dev.alloc((rows.size, buf.shape[1]), buf.dtype)
                    dev.copy_rows(buf, src, tmp, local)
                    saved.append((buf, tmp))
            rec.saved = saved
        return True

    @property
    def n_undoable(self) -> int:
        return len(self._records)

    def confirm(self) -> None:
        """The ubatches applied so far computed: forget their undo records (and kept rows)."""
        self._records.clear()

    def undo_rows(self, n: int) -> np.ndarray:
        """Put back the K/V rows the last ``n`` applied ubatches took from cells
        their old book still used, newest first; returns the global rows that
        could not be put back (not kept).  The book is restored separately
        (:meth:`restore`); :meth:`damaged_seqs` names the owners of those rows
        in the restored book."""
        if not 0 <= n <= len(self._records):
            raise ArgumentError("n", f"cannot undo {n} ubatches; {len(self._records)} can be undone")
        cache, dev = self.cache, self.cache.device
        damaged = np.zeros(cache.n_stream * cache.size, dtype=bool)
        for rec in reversed(self._records[len(self._records) - n :]):
            if rec.saved is None:
                damaged[rec.overwrites] = True
                continue
            rows, local = dev.indices(rec.overwrites), dev.indices(np.arange(rec.overwrites.size))
            for buf, tmp in rec.saved:
                dev.copy_rows(tmp, local, buf, rows)
            damaged[rec.overwrites] = False  # an older copy restores what a newer unkept write broke
        del self._records[len(self._records) - n :]
        return np.flatnonzero(damaged)

    def undo_rows_damage(self, n: int) -> set[int]:
        """The sequences :meth:`undo_rows` of the last ``n`` ubatches would leave damaged
        (their reused cells' rows were not kept), in the book the undo restores; a
        question before the action: changes nothing."""
        if not 0 <= n <= len(self._records):
            raise ArgumentError("n", f"cannot undo {n} ubatches; {len(self._records)} can be undone")
        recs = self._records[len(self._records) - n :]
        damaged: set[int] = set()
        for rec in reversed(recs):  # as undo_rows: an older kept copy repairs a newer unkept write
            rows = set(rec.overwrites.tolist())
            damaged = damaged | rows if rec.saved is None else damaged - rows
        # the owners a row had in the restored book: those before the first undone ubatch
        # that placed into it (none when that one found the cell free)
        first: dict[int, tuple[int, ...]] = {}
        placed: set[int] = set()
        for rec in recs:
            for k, r in enumerate(rec.overwrites.tolist()):
                if r not in placed and rec.owners is not None:
                    owners = rec.owners[k]  # (a row, or the one sequence)
                    first.setdefault(r, tuple(np.flatnonzero(owners).tolist()) if owners.ndim else (int(owners),))
            placed.update(self.sinfos[rec.index].rows.tolist())
        return {s for r in damaged for s in first.get(r, ())}

    def damaged_seqs(self, rows: np.ndarray) -> set[int]:
        """Sequences whose cells, in the cache's current book, are at global ``rows``."""
        out: set[int] = set()
        for g in rows.tolist():
            cells = self.cache.cells[g // self.cache.size]
            c = g % self.cache.size
            if not cells.is_empty(c):
                out.update(cells.seqs_of(c))
        return out

    @property
    def sinfo(self) -> SlotInfo:
        return self.sinfos[self.i_next]

    def snapshot(self) -> Any:
        """A mark of the book as it is now (composites restore it when a later part
        fails; hybrids keep it for undo): O(1), the applies after it keep journals."""
        return len(self._journals), self._applied, len(self._records)

    def restorable(self, snap: Any) -> bool:
        """Whether :meth:`restore` can take the book back to ``snap``: nothing but this
        context's own applies changed the cache since (their journals describe it)."""
        later = self._journals[snap[0] :]
        return not later or self.cache._version == later[-1].version_after

    def restore(self, snap: Any) -> None:
        """Take back every ubatch applied after ``snap`` (newest first), exactly.

        :raises ContextError: the cache changed since by something else (its
            version moved past this context's last apply); nothing changed."""
        if not self.restorable(snap):
            raise ContextError(
                f"{self.cache.name}: the cache changed after these ubatches were applied; they cannot be taken back"
            )
        later = self._journals[snap[0] :]
        for journal in reversed(later):
            journal.rollback(self.cache.book)
        del self._journals[snap[0] :]
        self.cache._version += 1
        self._applied = snap[1]  # the ubatch may be applied again
        del self._records[snap[2] :]
        self.update_version()  # the book this plan continues from, under a new version

    def k_idxs(self) -> np.ndarray:
        return self.sinfo.rows

    def n_kv(self) -> int:
        return self.cache.n_kv()

    def cpy_k(self, il: int, k_cur: Any) -> None:
        """Write this ubatch's K rows of layer ``il`` (``[n_tokens, n_embd_k]``)."""
        self._cpy(self.cache.k, il, k_cur, "k")

    def cpy_v(self, il: int, v_cur: Any) -> None:
        self._cpy(self.cache.v, il, v_cur, "v")

    def _cpy(self, bufs: dict[int, Buffer], il: int, cur: Any, what: str) -> None:
        if il not in bufs:
            raise ArgumentError("il", f"layer {il} has no {what} buffer in {self.cache.name}")
        dev = self.cache.device
        src = cur if isinstance(cur, Buffer) else dev.upload(np.asarray(cur, dtype=np.float32))
        if src.shape != (self.ubatches[self.i_next].n_tokens, bufs[il].shape[1]):
            raise ArgumentError(
                what, f"expected shape {(self.get_ubatch().n_tokens, bufs[il].shape[1])}, got {src.shape}"
            )
        dev.set_rows(bufs[il], self.write_rows_buffer(), src)

    def write_rows_buffer(self) -> Buffer:
        """:meth:`k_idxs` as a device index buffer: the cache's one reused rows buffer,
        rewritten in place for each ubatch (not a new upload per call or layer), valid
        until the next ubatch is applied."""
        rows = self.k_idxs()
        return self.cache.step_buffers.indices("rows", rows, max(ub.n_tokens for ub in self.ubatches))

    def step(self, keep_undo_rows: bool | None = None) -> Any:
        """The applied ubatch's per-layer calls (:class:`~statecache.memory_step.MemoryStep`):
        ``write_kv``, ``kv_rows``, ``mask`` by model layer, as on every memory kind.
        ``keep_undo_rows`` is accepted for one signature across kinds; a KV cache keeps
        its undo rows at ``apply()`` (see the class docstring)."""
        from statecache.memory_step import MemoryStep

        return MemoryStep(None, [self])

    def mask(self, *, causal: bool = True, alibi: bool = False) -> np.ndarray:
        """The mask of the current ubatch (:meth:`KVCache.mask`), built once per ubatch
        and book: every layer gets the same read-only array."""
        key = (self.i_next, causal, alibi, self.cache._version)
        if self._mask is None or self._mask_key != key:
            self._mask = self.cache.mask(self.get_ubatch(), causal=causal, alibi=alibi)
            self._mask.flags.writeable = False
            self._mask_key = key
        return self._mask


class KVFullContext(StatusContext):
    """Worst case for graph reservation: every cell may be read."""

    def __init__(self, cache: KVCache) -> None:
        super().__init__(MemoryStatus.SUCCESS, memory=cache)
        self.cache = cache

    def n_kv(self) -> int:
        return self.cache.size

    def apply(self) -> bool:
        self.check_version()
        return True


class KVUpdateContext(MemoryContext):
    """Pending maintenance: stream copies, then per-cell RoPE shifts.

    ``stream_copies``: ``(src_stream, dst_stream)`` pairs.  ``shift_rows`` /
    ``shift_amounts``: the global K rows the runtime must re-rotate and by
    how much (captured at ``init_update`` time).  ``apply()`` performs the
    copies with ``copy_rows``, calls the cache's ``k_shift`` hook per layer
    (when the cache has RoPE and a hook), then clears the shifts.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.stream_copies = list(cache.pending_copies)
        rows, amounts = [], []
        for strm, cells in enumerate(cache.cells):
            idx = np.flatnonzero((cells.shift != 0) & (cells.pos != EMPTY))
            rows.append(idx + strm * cache.size)
            amounts.append(cells.shift[idx])
        self.shift_rows = np.concatenate(rows).astype(np.int64)
        self.shift_amounts = np.concatenate(amounts).astype(np.int64)
        self._done = False
        # a shift or copy queued after this point would be cleared without being done
        self.record_version(cache)

    @property
    def status(self) -> MemoryStatus:
        return MemoryStatus.SUCCESS

    def get_ubatch(self) -> UBatch:
        raise ArgumentError("context", "an update context has no ubatch")

    def next(self) -> bool:
        return False

    def apply(self) -> bool:
        if self._done:
            return True
        self.check_version()
        cache, dev = self.cache, self.cache.device
        for ss, sd in self.stream_copies:
            src_rows = dev.indices(np.arange(cache.size) + ss * cache.size)
            dst_rows = dev.indices(np.arange(cache.size) + sd * cache.size)
            for buf in cache.buffers():
                dev.copy_rows(buf, src_rows, buf, dst_rows)
        if cache.can_shift and cache.k_shift is not None and self.shift_rows.size:
            for layer in cache.layers:
                cache.k_shift(cache, layer.il, cache.k[layer.il], self.shift_rows, self.shift_amounts)
        for cells in cache.cells:
            cells.reset_shift()
        # Drop exactly the copies this update ran (by position, not by value: the
        # same pair may have been queued again since init_update()).
        done = len(self.stream_copies)
        if cache.pending_copies[:done] == self.stream_copies:
            cache.pending_copies = cache.pending_copies[done:]
        cache._version += 1
        self.update_version()
        self._done = True
        return True


def iswa_sizes(
    size: int,
    n_swa: int,
    n_seq_max: int,
    n_ubatch: int,
    unified: bool,
    n_pad: int,
    swa_full: bool,
    rollback_depth: int = 0,
) -> int:
    """Size of the window cache of an iSWA pair (docs/memory-semantics.md#iswa); ``rollback_depth`` more
    positions per sequence stay in it so that a rollback finds its window."""
    if swa_full:
        return size
    return min(size, round_up((n_swa + rollback_depth) * (n_seq_max if unified else 1) + n_ubatch, n_pad))


class CompositeContext(MemoryContext):
    """Parts' contexts over one ubatch list, applied together.

    ``apply()`` applies every part in order and is all-or-nothing: a part
    that fails (returns False or raises) makes it and the parts applied
    before it restore their books from the snapshots taken before the first
    part applied (the parts' books are independent), so a composite never
    keeps half a ubatch.  Parts whose book cannot be snapshotted must
    therefore come last (the hybrids put the recurrent part there).  A KV
    part's snapshot is a mark (O(1)): its applies keep journals of the cells
    they touched, and restoring replays them back (:meth:`KVCacheContext.restore`),
    so no book is ever copied.  Nested composites get their part of the
    snapshot through :meth:`apply_from`, and the hybrids keep the same
    snapshot for undo.
    """

    def __init__(self, parts: Sequence[MemoryContext], memory: Memory | None = None) -> None:
        self.parts = list(parts)
        self.record_version(memory)

    @property
    def status(self) -> MemoryStatus:
        out = MemoryStatus.NO_UPDATE
        for k, p in enumerate(self.parts):
            out = p.status if k == 0 else _combine(out, p.status)
        return out

    def get_ubatch(self) -> UBatch:
        return self.parts[0].get_ubatch()

    def snapshot(self) -> tuple[Any, ...]:
        """Every part's book snapshot (``None`` for a part without one)."""
        return tuple(p.snapshot() if hasattr(p, "snapshot") else None for p in self.parts)

    def restorable(self, snap: tuple[Any, ...]) -> bool:
        """Whether every part can be restored to ``snap`` (nothing else changed them since)."""
        return all(
            s is None or not hasattr(p, "restorable") or p.restorable(s) for p, s in zip(self.parts, snap, strict=True)
        )

    def restore(self, snap: tuple[Any, ...]) -> None:
        for p, s in zip(self.parts, snap, strict=True):
            if s is not None:
                p.restore(s)  # type: ignore[attr-defined]
        self.update_version()  # the restored books, under their new versions

    def apply(self) -> bool:
        self.check_version()  # before the snapshot: a stale plan costs nothing
        return self.apply_from(self.snapshot())

    def apply_from(self, snap: tuple[Any, ...]) -> bool:
        """``apply()`` with the snapshots (:meth:`snapshot`) already taken, so a
        composite inside a composite, or one that keeps them for undo, copies
        each book once per ubatch.  A stale plan raises :class:`ContextError`
        before any part applies."""
        self.check_version()
        for k, p in enumerate(self.parts):
            try:
                if snap[k] is not None and isinstance(p, CompositeContext) and _plain_composite(p):
                    ok = p.apply_from(snap[k])
                else:
                    ok = p.apply()
            except Exception:
                self.restore(snap[: k + 1] + (None,) * (len(snap) - k - 1))
                self.update_version()
                raise
            if not ok:
                self.restore(snap[: k + 1] + (None,) * (len(snap) - k - 1))
                self.update_version()
                return False
        self.update_version()
        return True

    def next(self) -> bool:
        res = [p.next() for p in self.parts]
        return all(res)


def _plain_composite(p: MemoryContext) -> bool:
    """A composite whose ``apply()`` is exactly ``apply_from(snapshot())`` (an
    override, or a patched instance, must be called through ``apply()``)."""
    return isinstance(p, CompositeContext) and type(p).apply is CompositeContext.apply and "apply" not in vars(p)


def check_partial_under_full(full: Any, seq: int, end: int, field: str) -> None:
    """A ``PARTIAL_ONLY`` read restores the parts a truncation cannot rebuild
    (window caches, recurrent states) up to position ``end`` of ``seq`` and
    keeps the full-attention cells the memory holds, to be cut back to the
    checkpoint by ``seq_rm`` (upstream's server does exactly that with its
    context checkpoints).  Those cells must therefore already reach ``end``:
    read into a sequence whose full attention ends earlier, the next token
    would attend after a hole (positions up to ``end`` never written there)
    and the parts would disagree silently.  Upstream accepts that read; we
    refuse it [REC], with the memory unchanged."""
    held = int(full.seq_pos_max(seq))
    if held < end:
        raise StateError(
            field,
            f"sequence {seq}: a PARTIAL_ONLY read restores state up to position {end}, but this memory's "
            f"full-attention cells of that sequence end at {held}; a partial read keeps those cells, so they "
            "must reach the checkpoint (decode or restore the full state first, then seq_rm past the checkpoint)",
        )


def plan_positions(plan: KVStatePlan) -> dict[int, set[int]]:
    """Per sequence, the positions a validated KV section restores (cross-part checks)."""
    out: dict[int, set[int]] = {}
    if plan.seq >= 0:  # a sequence's blob: every cell is that sequence's (read at once)
        held = [pos for _, _, pos, _ in plan.placements if pos.size]
        return {plan.seq: set(np.concatenate(held).tolist())} if held else {}
    for _, _, pos, sets in plan.placements:
        for p, ids in zip(pos.tolist(), sets):
            for s in ids:
                out.setdefault(s, set()).add(p)
    return out


def one_owner_records(r: Reader, count: int, has_ext: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions and 2-D extensions of the ``count`` cells of a per-sequence blob, read
    at once when every record is well formed (``pos >= 0, 1, id`` and the extension when
    ``has_ext``; the id is the blob's, not the reader's); None, with nothing consumed,
    otherwise, so that the field-by-field reading names the bad field."""
    width = 5 if has_ext else 3
    n = count * width * 4
    if not count or r.off + n > len(r.data):
        return None
    rec = np.frombuffer(r.data[r.off : r.off + n], dtype="<i4").reshape(count, width).astype(np.int64)
    if not ((rec[:, 1] == 1).all() and (rec[:, 0] >= 0).all() and (rec[:, 0] <= POS_LAST).all()):
        return None
    r.raw(n, "cells")
    ext = rec[:, 3:5] if has_ext else np.stack([rec[:, 0], rec[:, 0]], axis=1)
    return rec[:, 0].copy(), np.ascontiguousarray(ext)


def _combine(a: MemoryStatus, b: MemoryStatus) -> MemoryStatus:
    from statecache.memory import status_combine

    return status_combine(a, b)


@dataclasses.dataclass
class ISWAPlan:
    base: KVStatePlan | None
    swa: KVStatePlan


def last_kept(pairs: Sequence[tuple[int, int]], p0: int, p1: int) -> int:
    """The last position of a sorted ``(pos, cell)`` list outside [p0, p1) (-1: none); O(log n)."""
    if not pairs:
        return -1
    if pairs[-1][0] >= p1:
        return pairs[-1][0]
    k = bisect.bisect_left(pairs, (p0, -1))
    return pairs[k - 1][0] if k > 0 else -1


def window_positions(pairs: Sequence[tuple[int, int]], swa: KVCache, end: int) -> set[int]:
    """Positions up to ``end`` of a sorted ``(pos, cell)`` list that the window of a token at
    ``end + 1`` reads (every window type hides more the further back a position is)."""
    out: set[int] = set()
    k = bisect.bisect_right(pairs, (end, 2**62)) - 1
    while k >= 0 and not is_masked_swa(swa.n_swa, swa.swa_type, pairs[k][0], end + 1):
        out.add(pairs[k][0])
        k -= 1
    return out


class KVCacheISWA(Memory):
    """iSWA pair (docs/memory-semantics.md#iswa): a base cache for the full-attention layers and a
    window cache, ``iswa_sizes`` big, for the sliding-window layers.  Both are
    planned for the same ubatches; positions are answered by the window
    cache (the base is a superset).

    The window cache reuses cells its windows have left, except with
    ``swa_full`` (it is then as big as the base and keeps every cell), and
    always keeps the ``rollback_depth`` positions behind each sequence's end
    (a hybrid sets it to its recurrent part's ``n_rs_seq``).  Because a
    context shift widens what the next window reaches, :meth:`get_can_shift`
    is true only with ``swa_full`` (upstream: "both sizes equal").

    Sizes (docs/memory-semantics.md#defaults): the base cache has ``size``
    cells (per stream, as :class:`KVCache`); the window cache
    ``min(size, round_up((n_swa + rollback_depth) * n + n_ubatch, n_pad))``
    with ``n = n_seq_max`` when unified, else 1 (:func:`iswa_sizes`): so
    ``n_ubatch``, the largest ubatch the runtime will plan, sizes it, and a
    larger ubatch later finds no room (``FAILED_PREPARE``); ``n_pad`` (256)
    rounds it up.  ``rollback_depth`` must be given here (a hybrid raises it to
    its recurrent part's ``n_rs_seq`` later, but without the room)."""

    def __init__(
        self,
        device: Device,
        layers: Sequence[KVLayer],
        swa_layers: Sequence[int],
        *,
        size: int,
        n_seq_max: int,
        n_ubatch: int,
        n_swa: int,
        swa_type: SWAType | str = SWAType.STANDARD,
        unified: bool = True,
        swa_full: bool = False,
        dtype: DType | str = DType.F16,
        n_pad: int = 256,
        k_shift: KShiftFn | None = None,
        rollback_depth: int = 0,
    ) -> None:
        swa_set = set(swa_layers)
        unknown = swa_set - {layer.il for layer in layers}
        if unknown:
            raise ArgumentError("swa_layers", f"layers {sorted(unknown)} are not attention layers")
        if SWAType.parse(swa_type) is SWAType.NONE:
            raise ArgumentError("swa_type", "an iSWA pair needs a sliding-window type")
        common: dict[str, Any] = dict(n_seq_max=n_seq_max, unified=unified, dtype=dtype, n_pad=n_pad, k_shift=k_shift)
        self.base = KVCache(device, [la for la in layers if la.il not in swa_set], size=size, name="kv_base", **common)
        swa_size = iswa_sizes(size, n_swa, n_seq_max, n_ubatch, unified, n_pad, swa_full, rollback_depth)
        self.swa = KVCache(
            device,
            [la for la in layers if la.il in swa_set],
            size=swa_size,
            swa_type=swa_type,
            n_swa=n_swa,
            name="kv_swa",
            swa_evict=not swa_full,
            rollback_depth=rollback_depth,
            **common,
        )
        self.device = device
        self.n_seq_max = n_seq_max

    @property
    def caches(self) -> tuple[KVCache, KVCache]:
        return self.base, self.swa

    @property
    def version(self) -> Hashable:
        return self.base.version, self.swa.version

    def fill_garbage(self, seed: int) -> None:
        self.base.fill_garbage(seed)
        self.swa.fill_garbage(seed + 1000)

    def split(self, balloc: BatchAllocator, n_ubatch: int, varlen: bool = False) -> list[UBatch] | None:
        return self.base.split(balloc, n_ubatch, varlen)

    def prepare(self, ubatches: Sequence[UBatch]) -> tuple[list[SlotInfo], list[SlotInfo]] | None:
        b = self.base.prepare(ubatches)
        if b is None:
            return None
        s = self.swa.prepare(ubatches)
        if s is None:
            return None
        return b, s

    def make_context(self, ubatches: Sequence[UBatch], plan: tuple[list[SlotInfo], list[SlotInfo]]) -> ISWAContext:
        """The context of a planned batch (bound to this pair's version)."""
        return ISWAContext(self, ubatches, plan)

    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False, *, varlen: bool = False
    ) -> MemoryContext:
        balloc.check_ready(self.n_seq_max)  # never initialised, or validated for another memory
        ubs = self.split(balloc, n_ubatch, varlen)
        if ubs is None:
            return StatusContext(MemoryStatus.FAILED_PREPARE, "(the splitter could not consume every token)")
        plan = self.prepare(ubs)
        if plan is None:
            return StatusContext(MemoryStatus.FAILED_PREPARE, "(iSWA: no free slot)")
        return self.make_context(ubs, plan)

    def init_full(self) -> MemoryContext:
        return CompositeContext([self.base.init_full(), self.swa.init_full()], self)

    def has_pending_update(self) -> bool:
        return self.base.has_pending_update() or self.swa.has_pending_update()

    def init_update(self, optimize: bool = False) -> MemoryContext:
        ctx = CompositeContext([self.base.init_update(optimize), self.swa.init_update(optimize)], self)
        return ctx if ctx.status is not MemoryStatus.NO_UPDATE else self.no_update_context()

    def get_can_shift(self) -> bool:
        return self.base.get_can_shift() and self.swa.get_can_shift()

    def clear(self, data: bool = True) -> None:
        self.base.clear(data)
        self.swa.clear(data)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        self.base.check_seq_rm(seq, p0, p1)  # validated before either cache changes
        if self.window_refusal(seq, *normalize_range(p0, p1)) is not None:
            return False  # refused before either cache changed
        self.base.seq_rm(seq, p0, p1)
        self.swa.seq_rm(seq, p0, p1)
        return True

    def window_refusal(self, seq: int, p0: int, p1: int) -> str | None:
        """Why ``seq_rm(seq, p0, p1)`` must be refused, or None ([REC]: upstream accepts
        it).  A removal that reaches a sequence's last position returns it to the last
        position the base cache keeps (``end``); the window cache must still hold
        ``end`` and every position the base cache holds that the window of the next
        token (at ``end + 1``) reads.  Positions the window cache already gave up
        below a later token's window (evicted during decode) are not there, so a
        rollback that deep would leave the two caches ending the sequence at
        different positions (the reported ``seq_pos_max`` from the window cache
        behind the base cache's) and the next token's window layers reading nothing
        where the model reads those positions.  ``seq`` -1 asks it of every sequence."""
        seqs = range(self.n_seq_max) if seq < 0 else (seq,)
        for s in seqs:
            pairs = self.base.cells[self.base.stream_of(s)].seq_pos[s]
            if not pairs or not (p0 <= pairs[-1][0] < p1):
                continue  # the removal leaves this sequence's end where it is
            end = last_kept(pairs, p0, p1)
            if end < 0:
                continue  # the whole sequence goes
            swa_pairs = self.swa.cells[self.swa.stream_of(s)].seq_pos[s]
            need = window_positions(pairs, self.swa, end) | {end}
            lo = bisect.bisect_left(swa_pairs, (min(need), -1))
            hi = bisect.bisect_right(swa_pairs, (end, 2**62))
            if not need <= {p for p, _ in swa_pairs[lo:hi]}:
                return (
                    f"removing [{p0}, {p1}) would return sequence {s} to position {end}, but the window cache "
                    "gave up positions the next token's window reads (evicted below a later token's window): "
                    "roll back less far (rollback_reach), or remove the whole sequence"
                )
        return None

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.check_seq_cp(src, dst, p0, p1)  # on both before touching either
        self.base.seq_cp(src, dst, p0, p1)
        self.swa.seq_cp(src, dst, p0, p1)

    # -- questions before actions (docs/memory-semantics.md#queries): both caches ------
    def check_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.base.check_seq_rm(seq, p0, p1)
        why = self.window_refusal(seq, *normalize_range(p0, p1))
        if why is not None:
            raise ArgumentError("p0/p1", why)

    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        for c in self.caches:
            c.check_seq_cp(src, dst, p0, p1)

    def check_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        for c in self.caches:
            c.check_seq_add(seq, p0, p1, delta)
        self._check_move_window(seq, p0, p1, "seq_add", int(delta), 1)

    def check_seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        for c in self.caches:
            c.check_seq_div(seq, p0, p1, d)
        self._check_move_window(seq, p0, p1, "seq_div", 0, int(d))

    def check_context_shift(self, seq: int, p0: int, p1: int) -> None:
        for c in self.caches:
            c.check_context_shift(seq, p0, p1)
        q0, q1 = normalize_range(p0, p1)
        if q0 < q1:
            why = self.shift_window_refusal(seq, q0, q1)
            if why is not None:
                raise ArgumentError("p0/p1", why)

    def shift_window_refusal(self, seq: int, q0: int, q1: int) -> str | None:
        """Why :meth:`context_shift` of ``[q0, q1)`` must be refused for the window cache,
        or None: as :meth:`window_refusal` for a removal, on the positions as the shift
        leaves them (:meth:`moved_window_refusal`).  A removal to the end (no move) is
        :meth:`window_refusal`'s case."""
        if q1 >= POS_MAX:
            return self.window_refusal(seq, q0, q1)
        delta = q1 - q0
        return self.moved_window_refusal(
            seq,
            lambda p: None if q0 <= p < q1 else (p if p < q0 else p - delta),
            f"shifting sequence {seq}'s positions from {q1} down to {q0}",
        )

    def moved_window_refusal(self, seq: int, move: Callable[[int], int | None], what: str) -> str | None:
        """Why a move of ``seq``'s positions (``move``: old position -> new one, None or
        negative: removed) must be refused for the window cache, or None.  A move that
        brings earlier positions closer to the sequence's end (a context shift, a
        negative ``seq_add`` of the tail, a ``seq_div``) widens what the next token's
        window reads over them, and the window cache may already have given them up
        (evicted below a later token's window): the next token's window layers would
        read less than the model reads, silently ([REC]: upstream moves them; its
        server refuses context shifts where ``get_can_shift`` is false).  With
        ``swa_full`` nothing is given up."""
        if seq < 0:
            return None

        def moved(cache: KVCache) -> list[tuple[int, int]]:
            pairs = cache.cells[cache.stream_of(seq)].seq_pos[seq]
            return sorted((q, c) for p, c in pairs if (q := move(p)) is not None and q >= 0)

        base = moved(self.base)
        if not base:
            return None
        end = base[-1][0]
        need = window_positions(base, self.swa, end) | {end}
        held = {p for p, _ in moved(self.swa)}
        if need <= held:
            return None
        return (
            f"{what} brings positions {sorted(need - held)[:4]} into the next token's window, which the window "
            "cache already gave up (evicted below a later token's window): move a range that keeps them out "
            "of the window, or use swa_full"
        )

    def rollback_reach(self, seq: int) -> RollbackReach:
        check_seq_id(seq, self.n_seq_max)
        P = self.seq_pos_max(seq)
        # A removal from p <= the base cache's first position takes the whole sequence
        # (accepted); above it, each p keeps at least that position.
        whole = max(self.base.seq_pos_min(seq), 0)
        if P < 0 or self.window_refusal(seq, whole + 1, POS_MAX) is None:
            return RollbackReach(int(seq), P, 0)  # everything back to the first token is held
        # A deeper rollback only needs more of what the window cache may have given up
        # (every window type reads further back from an earlier token), so the accepted
        # p above `whole` form [floor, P + 1]: bisect for the lowest with the refusal rule.
        lo, hi = whole + 2, P + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.window_refusal(seq, mid, POS_MAX) is None:
                hi = mid
            else:
                lo = mid + 1
        return RollbackReach(int(seq), P, hi, whole)

    def seq_state(self, seq: int) -> SeqState:
        rr = self.rollback_reach(seq)
        views = (self.base.seq_cells_view(seq), self.swa.seq_cells_view(seq))
        return SeqState(rr.seq, self.version, self.seq_pos_min(seq), rr.pos_max, None, views, rr)

    def seq_keep(self, seq: int) -> None:
        check_seq_id(seq, self.n_seq_max)
        self.base.seq_keep(seq)
        self.swa.seq_keep(seq)

    def check_position_move(self, seq: int, p0: int, p1: int, op: str = "seq_add", delta: int = 0, d: int = 1) -> None:
        """Raise (changing nothing) if the move would be refused by either cache, or would
        bring positions the window cache gave up into the next token's window."""
        for c in self.caches:
            c.check_position_move(seq, p0, p1, op, delta, d)
        self._check_move_window(seq, p0, p1, op, delta, d)

    def _check_move_window(self, seq: int, p0: int, p1: int, op: str, delta: int, d: int) -> None:
        q0, q1 = normalize_range(p0, p1)
        if q0 >= q1 or (delta == 0 and d == 1):
            return
        why = self.moved_window_refusal(
            seq,
            lambda p: (p + delta if delta else p // d) if q0 <= p < q1 else p,
            f"{op} over [{q0}, {q1}) of sequence {seq}",
        )
        if why is not None:
            raise ArgumentError("delta" if delta else "d", why)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        # both caches' refusals first; delta == 0 is a no-op (it used to refuse a shared cell)
        self.check_seq_add(seq, p0, p1, delta)
        self.base.seq_add(seq, p0, p1, delta)
        self.swa.seq_add(seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self.check_seq_div(seq, p0, p1, d)  # d == 1 is a no-op
        self.base.seq_div(seq, p0, p1, d)
        self.swa.seq_div(seq, p0, p1, d)

    def seq_pos_min(self, seq: int) -> int:
        return self.swa.seq_pos_min(seq)

    def seq_pos_max(self, seq: int) -> int:
        return self.swa.seq_pos_max(seq)

    def seq_pos_max_all(self) -> np.ndarray:
        return self.swa.seq_pos_max_all()

    def memory_breakdown(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.caches:
            for k, v in c.memory_breakdown().items():
                out[k] = out.get(k, 0) + v
        return out

    def state_write_into(self, w: Writer, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        if not flags & StateFlags.PARTIAL_ONLY:
            self.base.state_write_into(w, seq)
        self.swa.state_write_into(w, seq)

    def state_sections(self, seq: int = -1, flags: int = StateFlags.NONE) -> list[tuple[bytes, bytes | Writer]]:
        """Base section unless ``PARTIAL_ONLY``, then the window section (payloads as their Writers)."""
        out: list[tuple[bytes, bytes | Writer]] = []
        for tag, cache in ((TAG_KV_BASE, self.base), (TAG_KV_SWA, self.swa)):
            if tag == TAG_KV_BASE and flags & StateFlags.PARTIAL_ONLY:
                continue
            w = Writer()
            cache.state_write_into(w, seq)
            out.append((tag, w))
        return out

    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        return pack_sections(self.state_sections(seq, flags), flags)

    def state_tags(self, flags: int = StateFlags.NONE) -> tuple[bytes, ...]:
        """The tags of the sections :meth:`state_write` writes with ``flags``."""
        return (TAG_KV_SWA,) if flags & StateFlags.PARTIAL_ONLY else (TAG_KV_BASE, TAG_KV_SWA)

    def parse_sections(self, sections: Any, seq: int = -1, flags: int = StateFlags.NONE) -> ISWAPlan:
        base = None
        if not flags & StateFlags.PARTIAL_ONLY:
            r = Reader(find_section(sections, TAG_KV_BASE))
            base = self.base.state_parse(r, seq)
            r.at_end()
        r = Reader(find_section(sections, TAG_KV_SWA))
        swa = self.swa.state_parse(r, seq)
        r.at_end()
        if base is not None:
            # the window cache holds a subset of the base cache's cells, ending where they end
            held_b, held_w = plan_positions(base), plan_positions(swa)
            for s in sorted(set(held_b) | set(held_w)):
                b, w = held_b.get(s, set()), held_w.get(s, set())
                if not w <= b or max(b, default=-1) != max(w, default=-1):
                    raise StateError(
                        "kv_swa.pos",
                        f"sequence {s}: the window cache holds positions {sorted(w - b)[:4] or sorted(w)[-4:]} "
                        f"that disagree with the base cache (up to {max(b, default=-1)})",
                    )
                # ... and every position of the base cache that this memory's window of the
                # next token reads: a blob written with a narrower window (another n_swa or
                # window type) holds fewer, and its next token would attend over less than
                # the model reads, silently.
                end = max(b, default=-1)
                missing = []
                for p in sorted(b - w, reverse=True):  # every window type hides more the further back
                    if is_masked_swa(self.swa.n_swa, self.swa.swa_type, p, end + 1):
                        break
                    missing.append(p)
                if missing:
                    raise StateError(
                        "kv_swa.pos",
                        f"sequence {s}: the window cache lacks positions {sorted(missing)[:4]} that the window of "
                        f"the next token (at {end + 1}, n_swa {self.swa.n_swa}) reads: a blob of a narrower window",
                    )
        else:
            for s, held in plan_positions(swa).items():
                check_partial_under_full(self.base, s, max(held), "kv_swa.pos")
        return ISWAPlan(base, swa)

    def state_commit(self, plan: ISWAPlan) -> None:
        if plan.base is not None:
            self.base.state_commit(plan.base)
        self.swa.state_commit(plan.swa)

    def _state_drop(self, seq: int) -> None:
        self.base._state_drop(seq)
        self.swa._state_drop(seq)

    def landing_writes(self, plan: ISWAPlan) -> list[RowWrite]:
        """:meth:`KVCache.landing_writes` of both caches."""
        base = [] if plan.base is None else self.base.landing_writes(plan.base)
        return [*base, *self.swa.landing_writes(plan.swa)]

    def state_landing_failed(self) -> None:
        self.base.state_landing_failed()
        self.swa.state_landing_failed()

    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        """As :meth:`KVCache.state_read`: rejected blobs change nothing."""
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        _, sections = unpack_sections(data, flags)
        expect_sections(sections, self.state_tags(flags), "KV cache pair (iSWA)")
        plan = self.parse_sections(sections, seq, flags)
        rows_landing(lambda: self.landing_writes(plan), self.state_landing_failed)
        rows_ready()  # a transfer's rows may still be arriving: validated above, written below
        try:
            self.state_commit(plan)
        except BaseException:
            self._state_drop(seq)
            raise


class ISWAContext(CompositeContext):
    def __init__(
        self, mem: KVCacheISWA, ubatches: Sequence[UBatch], plan: tuple[list[SlotInfo], list[SlotInfo]]
    ) -> None:
        self.base = mem.base.make_context(ubatches, plan[0])
        self.swa = mem.swa.make_context(ubatches, plan[1])
        super().__init__([self.base, self.swa], mem)

    def step(self, keep_undo_rows: bool | None = None) -> Any:
        """The applied ubatch's per-layer calls; a layer goes to the base or the window cache
        that holds it (:class:`~statecache.memory_step.MemoryStep`; ``keep_undo_rows`` as
        for :meth:`KVCacheContext.step`)."""
        from statecache.memory_step import MemoryStep

        return MemoryStep(None, [self.base, self.swa])
