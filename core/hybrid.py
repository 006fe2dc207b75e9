"""Hybrid memories (docs/memory-semantics.md#hybrid): an attention part and a recurrent part.

Each model layer is routed to exactly one part (``attn_layers`` /
``recurrent_layers``).  The attention part is a :class:`KVCache` (hybrid) or
a :class:`KVCacheISWA` pair (hybrid-iSWA); the recurrent part is a
:class:`RecurrentMemory`.

Where we differ from upstream, on purpose:

* ``init_batch``: recurrent plan first, then attention; both are dry runs,
  so a failure returns FAILED_PREPARE with nothing changed anywhere.
* ``apply()`` is all-or-nothing: attention applies first, the recurrent part
  last; if the recurrent part fails the attention book is restored.
* ``seq_rm`` is atomic: the recurrent part decides first and, when it
  refuses, nothing changes anywhere.  Arguments are validated for every part
  before any part is touched.
* Context shift (``seq_rm(s, n_keep, n_keep + n_discard)`` then
  ``seq_add(s, n_keep + n_discard, -1, -n_discard)``), the gap upstream leaves:
  the recurrent part accepts a removal strictly inside the history as a
  no-op on its *state* (a recurrent state cannot forget tokens), the
  attention part drops those cells; the following ``seq_add`` moves the
  attention positions (pending RoPE shifts) and the recurrent tail position
  by the same amount, so both parts report the same ``seq_pos_max`` and the
  next token continues at ``seq_pos_max + 1`` in both.  The documented
  consequence: attention no longer sees the discarded tokens, the recurrent
  state still carries their influence.  A removal that reaches the tail is
  either an exact rollback in both parts or refused in both.
* ``state_read`` validates every section of every part before writing any;
  a bad blob raises with the destination dropped from every part (upstream
  contract) and every other sequence untouched.
* Undo after a failed compute (docs/memory-semantics.md#inv-22, :meth:`HybridContext.undo`) is
  refused, changing nothing, when the memory was edited after the first
  ubatch it would take back was applied, also by an edit only the attention
  part sees (a hole inside the history, a shift applied by an update), which
  restoring the attention books would silently take back.  The memory counts
  its edits for that: clear, a ``seq_rm`` that changes something, seq_cp,
  seq_keep, seq_add, seq_div, a state read or drop, an applied update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from statecache.errors import ArgumentError
from statecache.kv_cache import (
    TAG_KV,
    CompositeContext,
    KVCache,
    KVCacheContext,
    KVCacheISWA,
    KVStatePlan,
)
from statecache.memory import (
    ContextError,
    Memory,
    MemoryContext,
    MemoryStatus,
    StateFlags,
    StatusContext,
    UBatchContext,
    normalize_range,
)
from statecache.state_io import Reader, Writer, find_section, pack_sections, unpack_sections

if TYPE_CHECKING:
    from statecache.batch import BatchAllocator, UBatch
    from statecache.recurrent import RecurrentMemory

TAG_RECR = b"RECR"

AttentionPart = KVCache | KVCacheISWA


class HybridContext(CompositeContext):
    """Attention and recurrent contexts over the same ubatches (recurrent applied last).

    Undo after a failed compute (docs/memory-semantics.md#inv-22): ``apply()`` keeps the
    book snapshots it takes anyway (one per snapshot-able part, see
    :meth:`CompositeContext.apply_from`), and :meth:`undo` lets the recurrent
    part undo first (it refuses, changing nothing, when the memory changed
    since), puts back the K/V rows the ubatches took from cells the old
    attention books still use (sliding-window reuse, see
    :class:`~statecache.kv_cache.KVCacheContext`), then restores the books.
    Undo is exact when rows were kept (``keep_undo_rows``, set for every part
    at once; the default is the recurrent memory's); otherwise the sequences
    whose recurrent rows or reused K/V cells were overwritten are dropped
    from the whole hybrid (``memory`` is set by the memory that built the
    context) and returned.  Each apply also records the memory's edit count
    (:attr:`HybridMemory._edits`): undo refuses, changing nothing, when the
    memory was edited since the first ubatch it would take back was applied
    (the recurrent version alone misses edits of the attention part only).

    A subclass whose ``apply()`` changes more than the parts' books (the
    k-pool layout and stale marks of hybrid-idx) takes part in undo through
    two hooks: :meth:`_undo_extra_snapshot` (taken with the books, before
    the parts apply) and :meth:`_undo_extra_restore`.  A subclass that
    overrides ``apply()`` without them cannot undo.
    """

    def __init__(self, attn: MemoryContext, recr: MemoryContext, extra: Sequence[MemoryContext] = ()) -> None:
        self.attn = attn
        self.recr = recr
        super().__init__([attn, *extra, recr])
        self.memory: HybridMemory | None = None
        self._undo_log: list[tuple[tuple[Any, ...], Any, int | None]] = []  # (books, extra, edits) before each apply
        self.keep_undo_rows = bool(getattr(recr, "keep_undo_rows", False))

    def _leaves(self) -> list[MemoryContext]:
        out: list[MemoryContext] = []
        todo = list(self.parts)
        while todo:
            p = todo.pop(0)
            if isinstance(p, CompositeContext):
                todo[:0] = p.parts
            else:
                out.append(p)
        return out

    @property
    def keep_undo_rows(self) -> bool:
        return self._keep_undo_rows

    @keep_undo_rows.setter
    def keep_undo_rows(self, keep: bool) -> None:
        """Whether later applies keep the rows an undo needs, in every part (recurrent: rows its steps overwrite)."""
        self._keep_undo_rows = bool(keep)
        for p in self._leaves():
            if isinstance(p, KVCacheContext) or p is self.recr:
                p.keep_undo_rows = self._keep_undo_rows  # type: ignore[attr-defined]

    # -- undo hooks for subclasses whose apply() changes more than the parts' books ----------
    def _undo_extra_snapshot(self) -> Any:
        """What ``apply()`` changes besides the parts' books, taken before the parts apply."""
        return None

    def _undo_extra_restore(self, extra: Any) -> None:
        """Put back what :meth:`_undo_extra_snapshot` returned (after the books are restored)."""

    def apply(self) -> bool:
        snap = self.snapshot()
        extra = self._undo_extra_snapshot()
        edits = None if self.memory is None else self.memory._edits
        ok = self.apply_from(snap)
        if ok:
            self._undo_log.append((snap, extra, edits))
        return ok

    def undo(self, n: int | None = None) -> tuple[int, ...]:
        """Take back the last ``n`` applied ubatches (default: all); returns the dropped sequences."""
        cls = type(self)
        if cls.apply is not HybridContext.apply and cls._undo_extra_restore is HybridContext._undo_extra_restore:
            raise ContextError(f"{cls.__name__}.apply() keeps state that undo() cannot restore")
        k = len(self._undo_log) if n is None else int(n)
        if not 0 <= k <= len(self._undo_log):
            raise ContextError(f"cannot undo {n} ubatches; {len(self._undo_log)} can be undone")
        if k == 0:
            return ()
        snap, extra, edits = self._undo_log[-k]
        if self.memory is not None and edits != self.memory._edits:
            raise ContextError("the memory changed after these ubatches were applied; they can no longer be undone")
        dropped = set(self.recr.undo(k))  # refuses, changing nothing, when the recurrent memory changed since
        kv = [p for p in self._leaves() if isinstance(p, KVCacheContext)]
        damaged = [(p, p.undo_rows(k)) for p in kv]
        self.restore(snap)  # the recurrent part has no snapshot: its undo did it
        del self._undo_log[-k:]
        for p in self._leaves():
            if isinstance(p, UBatchContext):
                p.i_next = self.recr.i_next  # type: ignore[attr-defined]
        self._undo_extra_restore(extra)
        for p, rows in damaged:
            dropped |= p.damaged_seqs(rows)
        if dropped and self.memory is not None:
            for s in sorted(dropped):
                self.memory.seq_rm(s, -1, -1)
        return tuple(sorted(dropped))


class HybridUpdateContext(HybridContext):
    """``init_update()``'s context: applying it edits the memory (shifts, stream copies)."""

    def __init__(
        self, memory: HybridMemory, attn: MemoryContext, recr: MemoryContext, extra: Sequence[MemoryContext] = ()
    ) -> None:
        super().__init__(attn, recr, extra)
        self.memory = memory

    def apply(self) -> bool:
        try:
            return super().apply()
        finally:
            if self.memory is not None:
                self.memory._edits += 1


class HybridMemory(Memory):
    """Attention + recurrent memory (hybrid, or hybrid-iSWA when ``attn`` is an iSWA pair)."""

    def __init__(self, attn: AttentionPart, recr: RecurrentMemory) -> None:
        if attn.n_seq_max != recr.n_seq_max:
            raise ArgumentError("n_seq_max", f"attention has {attn.n_seq_max}, recurrent {recr.n_seq_max}")
        self.attn = attn
        self.recr = recr
        self.n_seq_max = attn.n_seq_max
        self.device = recr.device
        #: Edits of the books outside a batch (sequence operations, state reads and
        #: drops, applied updates): ubatches applied before one can no longer be undone.
        self._edits = 0

    # -- parts -------------------------------------------------------------------
    @property
    def kv_caches(self) -> list[KVCache]:
        return list(self.attn.caches) if isinstance(self.attn, KVCacheISWA) else [self.attn]

    @property
    def unified(self) -> bool:
        return self.kv_caches[0].unified

    def fill_garbage(self, seed: int) -> None:
        self.attn.fill_garbage(seed)
        for k, pools in enumerate(self.recr.pools.values()):
            for j, buf in enumerate(pools.values()):
                self.device.fill_bytes(buf, seed + 500 + 10 * k + j)

    # -- plans -------------------------------------------------------------------
    def split(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool) -> list[UBatch] | None:
        balloc.split_reset()
        keep = self.recr.n_rs_seq + 1 if self.recr.n_rs_seq > 0 else 0
        out = []
        while True:
            if embd_all:
                ub = balloc.split_seq(n_ubatch)
            else:
                ub = balloc.split_equal(n_ubatch, sequential=not self.unified, n_keep_tail=keep)
            if ub.n_tokens == 0:
                break
            out.append(ub)
        return out if balloc.n_used == balloc.n_tokens else None

    def _plan(self, ubs: Sequence[UBatch]) -> tuple[Any, Any] | str:
        recr_plan = self.recr.prepare(ubs)
        if recr_plan is None:
            return "the ubatches do not fit the recurrent memory"
        attn_plan = self.attn.prepare(ubs)
        if attn_plan is None:
            return "no free attention slot"
        return recr_plan, attn_plan

    def _contexts(self, ubs: Sequence[UBatch], plans: tuple[Any, Any]) -> tuple[MemoryContext, MemoryContext]:
        from statecache.recurrent import RecurrentContext

        return self.attn.make_context(ubs, plans[1]), RecurrentContext(self.recr, ubs, plans[0])

    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> MemoryContext:
        ubs = self.split(balloc, n_ubatch, embd_all)
        if ubs is None:
            return StatusContext(MemoryStatus.FAILED_PREPARE, "(the splitter could not consume every token)")
        plans = self._plan(ubs)
        if isinstance(plans, str):
            return StatusContext(MemoryStatus.FAILED_PREPARE, f"({plans})")
        attn, recr = self._contexts(ubs, plans)
        return self._batch_context(ubs, plans, attn, recr)

    def _batch_context(
        self, ubs: Sequence[UBatch], plans: tuple[Any, Any], attn: MemoryContext, recr: MemoryContext
    ) -> HybridContext:
        """The context of a planned batch (hybrid-idx adds its indexer part)."""
        ctx = HybridContext(attn, recr)
        ctx.memory = self  # undo checks the edit count and drops damaged sequences through it
        return ctx

    def init_full(self) -> MemoryContext:
        return HybridContext(self.attn.init_full(), self.recr.init_full())

    def init_update(self, optimize: bool = False) -> MemoryContext:
        a = self.attn.init_update(optimize)
        r = self.recr.init_update(optimize)
        if a.status is MemoryStatus.NO_UPDATE and r.status is MemoryStatus.NO_UPDATE:
            return StatusContext(MemoryStatus.NO_UPDATE)
        return HybridUpdateContext(self, a, r)

    def get_can_shift(self) -> bool:
        return self.attn.get_can_shift()

    # -- sequence operations ----------------------------------------------------------
    def _check_seq(self, seq: int, name: str = "seq") -> None:
        if not 0 <= seq < self.n_seq_max:
            raise ArgumentError(name, f"sequence {seq} outside [0, n_seq_max={self.n_seq_max})")

    def clear(self, data: bool = True) -> None:
        self._edits += 1
        self.attn.clear(data)
        self.recr.clear(data)

    def _rm_witness(self) -> tuple[Any, ...]:
        """What a ``seq_rm`` that changes something changes: the recurrent version and
        the count of (cell, sequence) pairs every attention stream has dropped."""
        removals = sum(cells.removals for cache in self.kv_caches for cells in cache.cells)
        return self.recr._version, removals

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        if seq >= self.n_seq_max:
            return False  # the recurrent contract: refused, nothing changed
        before = self._rm_witness()
        if not self.recr.seq_rm(seq, p0, p1):
            return False
        try:
            return self._seq_rm_rest(seq, p0, p1)
        finally:
            if self._rm_witness() != before:
                self._edits += 1  # a removal of nothing leaves open batches undoable

    def _seq_rm_rest(self, seq: int, p0: int, p1: int) -> bool:
        """``seq_rm`` in the parts after the recurrent one, which accepted it."""
        return self.attn.seq_rm(seq, p0, p1)

    def _check_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._check_seq(src, "src")
        self._check_seq(dst, "dst")
        if not self.unified and src != dst and normalize_range(p0, p1) != normalize_range(-1, -1):
            raise ArgumentError("p0/p1", f"a copy between streams ({src} -> {dst}) must cover the whole sequence")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``dst`` becomes a copy of ``src``.  The recurrent part replaces dst's
        state whatever the range, so the attention part first drops dst's
        cells too (upstream leaves them, and the parts then disagree)."""
        self._check_cp(src, dst, p0, p1)
        if src == dst:
            return
        self._edits += 1
        self.attn.seq_rm(dst, -1, -1)
        self.attn.seq_cp(src, dst, p0, p1)
        self.recr.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq: int) -> None:
        self._check_seq(seq)
        self._edits += 1
        self.attn.seq_keep(seq)
        self.recr.seq_keep(seq)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self._check_seq(seq)
        if delta != 0:
            self.recr.check_position_move(seq, p0, p1, "seq_add")  # refusals change nothing anywhere
        self._edits += 1
        self.attn.seq_add(seq, p0, p1, delta)  # raises before any change on a shared cell
        self.recr.seq_add(seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self._check_seq(seq)
        if d <= 0:
            raise ArgumentError("d", f"divisor must be >= 1, got {d}")
        if d != 1:
            self.recr.check_position_move(seq, p0, p1, "seq_div")
        self._edits += 1
        self.attn.seq_div(seq, p0, p1, d)
        self.recr.seq_div(seq, p0, p1, d)

    def seq_pos_min(self, seq: int) -> int:
        return max(self.attn.seq_pos_min(seq), self.recr.seq_pos_min(seq))

    def seq_pos_max(self, seq: int) -> int:
        return min(self.attn.seq_pos_max(seq), self.recr.seq_pos_max(seq))

    def memory_breakdown(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in (self.attn, self.recr):
            for k, v in part.memory_breakdown().items():
                out[k] = out.get(k, 0) + v
        return out

    # -- state ------------------------------------------------------------------------
    def _attn_sections(self, seq: int, flags: int) -> list[tuple[bytes, bytes]]:
        if isinstance(self.attn, KVCacheISWA):
            return self.attn.state_sections(seq, flags)
        if flags & StateFlags.PARTIAL_ONLY:
            return []
        w = Writer()
        self.attn.state_write_into(w, seq)
        return [(TAG_KV, w.getvalue())]

    def state_sections(self, seq: int = -1, flags: int = StateFlags.NONE) -> list[tuple[bytes, bytes]]:
        return [*self._attn_sections(seq, flags), (TAG_RECR, self.recr.write_section(seq, flags))]

    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        if seq >= 0:
            self._check_seq(seq)
        return pack_sections(self.state_sections(seq, flags), flags)

    def _parse_attn(self, sections: Any, seq: int, flags: int) -> Any:
        if isinstance(self.attn, KVCacheISWA):
            return self.attn.parse_sections(sections, seq, flags)
        if flags & StateFlags.PARTIAL_ONLY:
            return None
        r = Reader(find_section(sections, TAG_KV))
        plan: KVStatePlan = self.attn.state_parse(r, seq)
        r.at_end()
        return plan

    def parse_all(self, sections: Any, seq: int, flags: int) -> dict[str, Any]:
        """Validate every section of every part; returns the plans.  Changes nothing."""
        return {
            "attn": self._parse_attn(sections, seq, flags),
            "recr": self.recr.parse_section(find_section(sections, TAG_RECR), seq),
        }

    def commit_all(self, plans: dict[str, Any]) -> None:
        self._edits += 1
        if plans["attn"] is not None:
            self.attn.state_commit(plans["attn"])
        self.recr.apply_section(plans["recr"])

    def state_drop(self, seq: int) -> None:
        """Drop the destination from every part (docs/memory-semantics.md#state-failures)."""
        self._edits += 1
        if seq < 0:
            self.clear(True)
        else:
            self.attn._state_drop(seq)
            self.recr.seq_rm(seq, -1, -1)

    def _drop_read_parts(self, seq: int, flags: int) -> None:
        """After a failed write (post-validation): drop the destination from the
        parts the read would have written (a partial read never touches full-attention caches)."""
        self._edits += 1
        if not flags & StateFlags.PARTIAL_ONLY:
            self.state_drop(seq)
            return
        if isinstance(self.attn, KVCacheISWA):
            self.attn.swa._state_drop(seq)
        if seq >= 0:
            self.recr.seq_rm(seq, -1, -1)
        else:
            self.recr.clear(True)

    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        """Restore every part from one blob, all or nothing.

        Every section of every part is parsed, checked and placed before any
        part is written, so a rejected blob (``StateError``: corrupt, truncated,
        mismatched, or no room) leaves the whole memory exactly as it was
        (stricter than upstream, which drops the destination).  Only a
        failure while writing, after validation, drops the destination from the
        parts the read would have written: no half-restored sequence survives."""
        if seq >= 0:
            self._check_seq(seq)
        _, sections = unpack_sections(data)
        plans = self.parse_all(sections, seq, flags)
        try:
            self.commit_all(plans)
        except BaseException:
            self._drop_read_parts(seq, flags)
            raise


class HybridISWAMemory(HybridMemory):
    """Hybrid with an iSWA attention part (docs/memory-semantics.md#hybrid-iswa): the same composition rules;
    positions of the attention part come from its window cache."""

    def __init__(self, attn: KVCacheISWA, recr: RecurrentMemory) -> None:
        if not isinstance(attn, KVCacheISWA):
            raise ArgumentError("attn", f"hybrid-iSWA needs a KVCacheISWA, got {type(attn).__name__}")
        super().__init__(attn, recr)
