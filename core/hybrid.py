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
  before any part is touched.  A removal after which the parts would end
  at different positions is refused too (a rollback whose position the
  attention part no longer holds: a head removal before it, or a window
  cache that gave the cell up).  So is ``seq_cp`` of a range that leaves out
  part of the source (a recurrent state cannot be copied in part).
* A rollback (``seq_rm(s, p0, p1)`` reaching the end) must cut from the
  attention part exactly the tokens the recurrent part undoes, the last
  ``seq_pos_max - p0 + 1`` decoded: after a position move that reordered the
  sequence against its decode order (accepted, as upstream does) the cells
  at ``[p0, p1)`` may be other tokens, and the removal is refused instead of
  letting the parts disagree (:meth:`_rollback_cuts_what_it_undoes`).
* The parts never disagree: after every operation each part holds the
  same sequences and ends them at the same position (a window cache may
  start later).  A stale plan (:meth:`MemoryContext.check_version`: the
  memory's version is the tuple of its parts') is refused before any part
  applies.
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
* ``state_read`` validates every section of every part, and that the parts
  agree (every sequence ends at the same position in each), before writing
  any; a rejected blob changes nothing.
* Undo after a failed compute (docs/memory-semantics.md#inv-22, :meth:`HybridContext.undo`) is
  refused, changing nothing, when the memory was edited after the first
  ubatch it would take back was applied, also by an edit only the attention
  part sees (a hole inside the history, a shift applied by an update), which
  restoring the attention books would silently take back.  The memory counts
  its edits for that: clear, a ``seq_rm`` that changes something, seq_cp,
  seq_keep, seq_add, seq_div, a state read or drop, an applied update.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.errors import ArgumentError, StateError
from statecache.kv_cache import (
    TAG_KV,
    CompositeContext,
    ISWAPlan,
    KVCache,
    KVCacheContext,
    KVCacheISWA,
    KVStatePlan,
    check_partial_under_full,
    last_kept,
    plan_positions,
)
from statecache.memory import (
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
    normalize_range,
)
from statecache.state_io import (
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

    def step(self, keep_undo_rows: bool | None = None) -> Any:
        """The applied ubatch's per-layer calls, every part by model layer
        (:class:`~statecache.memory_step.MemoryStep`): the recurrent calls of
        ``self.recr.step()`` and the attention calls of the KV part(s).
        ``keep_undo_rows`` overrides the context's setting for the recurrent part."""
        from statecache.memory_step import MemoryStep

        if not hasattr(self.recr, "step"):
            raise ContextError("only a planned batch (init_batch) has a step")
        recr = self.recr.step(keep_undo_rows)
        return MemoryStep(recr, _kv_parts(self.attn))

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
        self.check_version()  # a stale plan: refused before any book is copied or changed
        snap = self.snapshot()
        extra = self._undo_extra_snapshot()
        edits = None if self.memory is None else self.memory._edits
        ok = self.apply_from(snap)
        if ok:
            self._undo_log.append((snap, extra, edits))
        return ok

    def undo_loses(self, n: int | None = None) -> tuple[int, ...]:
        """The sequences :meth:`undo` of the last ``n`` ubatches would drop (recurrent rows,
        or reused window-cache rows, overwritten and not kept); empty: the undo is exact.
        Changes nothing.

        :raises ContextError: the undo is refused anyway (``n`` out of range)."""
        k = len(self._undo_log) if n is None else int(n)
        if not 0 <= k <= len(self._undo_log):
            raise ContextError(f"cannot undo {n} ubatches; {len(self._undo_log)} can be undone")
        lost = set(self.recr.undo_loses(k)) if k else set()
        for p in self._leaves():
            if isinstance(p, KVCacheContext):
                lost |= p.undo_rows_damage(k)
        return tuple(sorted(lost))

    def undo(self, n: int | None = None, *, drop: bool = False) -> tuple[int, ...]:
        """Take back the last ``n`` applied ubatches (default: all); returns the dropped
        sequences.  An undo that would drop sequences (:meth:`undo_loses`) is refused
        with :class:`ContextError`, changing nothing, unless ``drop`` is True."""
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
        if not self.restorable(snap):  # an attention book changed since by something else
            raise ContextError("the attention part changed after these ubatches were applied; they cannot be undone")
        if not drop:
            lost = self.undo_loses(k)
            if lost:
                raise ContextError(
                    f"undo cannot be exact: the state rows of sequences {list(lost)} were overwritten and not kept "
                    "(keep_undo_rows); nothing changed. undo(drop=True) drops them (re-prefill them after)"
                )
        # the recurrent part refuses, changing nothing, when it changed since
        dropped = set(self.recr.undo(k, drop=True))
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
            for s in sorted(dropped):  # the plans no longer describe the book: stale from here on
                self.memory.seq_rm(s, -1, -1)
        else:
            self.update_version()  # exactly the books the undone plans start from
        return tuple(sorted(dropped))


def _kv_parts(ctx: MemoryContext) -> list[KVCacheContext]:
    """The KV contexts of an attention part's context (one, or an iSWA pair's two)."""
    if isinstance(ctx, KVCacheContext):
        return [ctx]
    return [p for p in getattr(ctx, "parts", ()) if isinstance(p, KVCacheContext)]


class HybridUpdateContext(HybridContext):
    """``init_update()``'s context: applying it edits the memory (shifts, stream copies)."""

    def __init__(
        self, memory: HybridMemory, attn: MemoryContext, recr: MemoryContext, extra: Sequence[MemoryContext] = ()
    ) -> None:
        super().__init__(attn, recr, extra)
        self.memory = memory
        self.record_version(memory)

    def apply(self) -> bool:
        try:
            return super().apply()
        finally:
            if self.memory is not None:
                self.memory._edits += 1


class HybridMemory(Memory):
    """Attention + recurrent memory (hybrid, or hybrid-iSWA when ``attn`` is an iSWA pair).

    The parts are built by the caller and keep their own sizes
    (docs/memory-semantics.md#defaults): both must have the same ``n_seq_max``;
    a window cache's ``rollback_depth`` is raised to ``recr.n_rs_seq`` here
    (size the window with ``KVCacheISWA(rollback_depth=n_rs_seq)`` for the room);
    contexts keep undo rows as ``recr.keep_undo_rows`` says (default: no, and a
    lossy undo is refused unless asked for)."""

    def __init__(self, attn: AttentionPart, recr: RecurrentMemory) -> None:
        if attn.n_seq_max != recr.n_seq_max:
            raise ArgumentError("n_seq_max", f"attention has {attn.n_seq_max}, recurrent {recr.n_seq_max}")
        self.attn = attn
        self.recr = recr
        self.n_seq_max = attn.n_seq_max
        self.device = recr.device
        # A window cache keeps what a rollback of the recurrent part can return to
        # (size it with KVCacheISWA(rollback_depth=n_rs_seq) to keep its room).
        for cache in self.kv_caches:
            if cache.evicts:
                cache.rollback_depth = max(cache.rollback_depth, recr.n_rs_seq)
        #: Edits of the books outside a batch (sequence operations, state reads and
        #: drops, applied updates): ubatches applied before one can no longer be undone.
        self._edits = 0

    # -- parts -------------------------------------------------------------------
    @property
    def version(self) -> Any:
        return self.attn.version, self.recr.version

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
    def split(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool, varlen: bool = False) -> list[UBatch] | None:
        """The ubatches of a validated batch (``varlen``: packed, see :meth:`init_batch`)."""
        balloc.split_reset()
        keep = self.recr.n_rs_seq + 1 if self.recr.n_rs_seq > 0 else 0
        out = []
        while True:
            if varlen:
                # the K/V part places tokens one by one and builds the mask in ubatch
                # token order, so the packed (set-major) order needs nothing more there
                ub = balloc.split_varlen(n_ubatch, n_keep_tail=keep)
            elif embd_all:
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

    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False, *, varlen: bool = False
    ) -> MemoryContext:
        """Plan a validated batch (:meth:`Memory.init_batch`); ``varlen=True`` puts it into
        one packed ubatch (:meth:`RecurrentMemory.init_batch
        <statecache.recurrent.RecurrentMemory.init_batch>` says what changes for the
        recurrent step).  Both parts plan the same ubatches."""
        balloc.check_ready(self.n_seq_max)  # never initialised, or validated for another memory
        ubs = self.split(balloc, n_ubatch, embd_all, varlen)
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
        ctx.record_version(self)
        return ctx

    def init_full(self) -> MemoryContext:
        ctx = HybridContext(self.attn.init_full(), self.recr.init_full())
        ctx.record_version(self)
        return ctx

    def init_update(self, optimize: bool = False) -> MemoryContext:
        a = self.attn.init_update(optimize)
        r = self.recr.init_update(optimize)
        if a.status is MemoryStatus.NO_UPDATE and r.status is MemoryStatus.NO_UPDATE:
            return self.no_update_context()
        return HybridUpdateContext(self, a, r)

    def get_can_shift(self) -> bool:
        return self.attn.get_can_shift()

    # -- sequence operations ----------------------------------------------------------
    def _check_seq(self, seq: int, name: str = "seq") -> int:
        return check_seq_id(seq, self.n_seq_max, name)

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
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        q0, q1 = normalize_range(p0, p1)
        if seq >= 0 and not self._seq_rm_allowed(seq, q0, q1):
            return False  # refused before any part changed
        before = self._rm_witness()
        if not self.recr.seq_rm(seq, p0, p1):
            return False
        try:
            return self._seq_rm_rest(seq, p0, p1)
        finally:
            if self._rm_witness() != before:
                self._edits += 1  # a removal of nothing leaves open batches undoable

    def _seq_rm_allowed(self, seq: int, p0: int, p1: int) -> bool:
        """Checks a subclass may extend: whether ``seq_rm`` may go ahead (asked before
        any part changes; ``p0``/``p1`` normalised)."""
        return self._parts_would_agree(seq, p0, p1) and self._rollback_cuts_what_it_undoes(seq, p0, p1)

    def _rollback_cuts_what_it_undoes(self, seq: int, p0: int, p1: int) -> bool:
        """Whether a rollback (``0 < p0 <= P < p1``, ``P`` the recurrent position) would cut
        from the attention part exactly the tokens the recurrent part undoes.

        The recurrent part undoes by count, in decode order: the last ``k = P - p0 + 1``
        tokens, which its planes label ``P, P - 1, ..., p0`` (every move that relabels
        them without moving the state shrinks the planes, see
        :meth:`RecurrentMemory._forget_moved_planes`, so those labels are the tokens'
        positions now).  Those ``k`` tokens sit at ``k`` distinct positions in
        ``[p0, P]`` in every attention cache (a window cache keeps the last
        ``rollback_depth >= n_rs_seq`` positions), so a cache cuts exactly them when it
        holds ``k`` cells of ``seq`` in ``[p0, p1)``, and more when a move reordered the
        positions against the decode order (a block folded onto or below positions it
        came after, a ``seq_div`` making tokens share a position): a removal by position
        would then cut tokens the state keeps, so it is refused.  Needs no book of its
        own: the count is read from the cells, whatever seq_cp, seq_keep, a context shift
        or a state read did before."""
        if not self.recr.has_layers:
            return True  # positions only: nothing is undone but the position itself
        P = self.recr.seq_pos_max(seq)
        if not 0 < p0 <= P < p1:
            return True  # not a rollback: the whole state goes, or none of it
        k = P - p0 + 1
        for cache in self.kv_caches:
            pairs = cache.cells[cache.stream_of(seq)].seq_pos[seq]
            lo = bisect.bisect_left(pairs, (p0, -1))
            hi = bisect.bisect_left(pairs, (p1, -1))
            if hi - lo != k:
                return False
        return True

    def _parts_would_agree(self, seq: int, p0: int, p1: int) -> bool:
        """Whether after ``seq_rm(seq, p0, p1)`` every part would end ``seq`` at the
        same position (asked before any part changes).  The recurrent part ends
        at ``p0 - 1`` when the range reaches its position (a rollback, or the whole
        state when ``p0 == 0``), else where it is; each attention cache ends at
        the last position it holds outside the range.  A window cache must also
        still hold every position the base cache holds that the next token's
        window reads (what a rollback returns to)."""
        P = self.recr.seq_pos_max(seq)
        end = p0 - 1 if p0 <= P < p1 else P
        for cache in self.kv_caches:
            if last_kept(cache.cells[cache.stream_of(seq)].seq_pos[seq], p0, p1) != end:
                return False
        if isinstance(self.attn, KVCacheISWA) and p0 <= P < p1 and end >= 0:  # a rollback
            # the window cache's own rule (the caches end together here, checked above)
            return self.attn.window_refusal(seq, p0, p1) is None
        return True

    def _seq_rm_rest(self, seq: int, p0: int, p1: int) -> bool:
        """``seq_rm`` in the parts after the recurrent one, which accepted it."""
        return self.attn.seq_rm(seq, p0, p1)

    def _check_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._check_seq(src, "src")
        self._check_seq(dst, "dst")
        q0, q1 = normalize_range(p0, p1)
        if not self.unified and src != dst and (q0, q1) != normalize_range(-1, -1):
            raise ArgumentError("p0/p1", f"a copy between streams ({src} -> {dst}) must cover the whole sequence")
        # the recurrent part can only copy a whole state: the range must hold every
        # position src holds in every part, or the parts of dst would disagree
        held = [p for cache in self.kv_caches for p, _ in cache.cells[cache.stream_of(src)].seq_pos[src]]
        P = self.recr.seq_pos_max(src)
        if P >= 0:
            held.append(P)
        if held and not (q0 <= min(held) and max(held) < q1):
            raise ArgumentError(
                "p0/p1",
                f"sequence {src} holds positions {min(held)}..{max(held)} and its recurrent state carries all "
                f"of them; a copy of [{q0}, {q1}) cannot leave any out: copy whole sequences (p0 = p1 = -1)",
            )

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``dst`` becomes a copy of ``src``, which must be copied whole (a range that
        leaves out part of it is refused, nothing changed).  The attention part
        first drops dst's cells (upstream leaves them, and the parts then disagree)."""
        self.check_seq_cp(src, dst, p0, p1)
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
        self.check_seq_add(seq, p0, p1, delta)  # refusals change nothing anywhere
        self._edits += 1
        self.attn.seq_add(seq, p0, p1, delta)
        self.recr.seq_add(seq, p0, p1, delta)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self.check_seq_div(seq, p0, p1, d)
        self._edits += 1
        self.attn.seq_div(seq, p0, p1, d)
        self.recr.seq_div(seq, p0, p1, d)

    # -- questions before actions (docs/memory-semantics.md#queries) ----------------
    def check_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        q0, q1 = normalize_range(p0, p1)
        if seq >= 0 and not self._seq_rm_allowed(seq, q0, q1):
            if not self._parts_would_agree(seq, q0, q1):
                why = (
                    f"after removing [{q0}, {q1}) the parts would end sequence {seq} at different positions "
                    "(the attention part no longer holds the position a rollback returns to, or the window "
                    "cache gave up a position the next token reads)"
                )
            elif not self._rollback_cuts_what_it_undoes(seq, q0, q1):
                P = self.recr.seq_pos_max(seq)
                why = (
                    f"the recurrent state of sequence {seq} would undo its last {P - q0 + 1} decoded tokens, but the "
                    f"attention part holds a different number of its tokens at positions [{q0}, {q1}): a position "
                    "move reordered them against the decode order (seq_add / seq_div), so a removal by position "
                    "would cut other tokens than the rollback undoes; remove the whole sequence instead"
                )
            else:
                why = f"removing [{q0}, {q1}) would regroup k-pools that sequence {seq} shares with another"
            raise ArgumentError("p0/p1", why)
        self.recr.check_seq_rm(seq, q0, q1)
        self.attn.check_seq_rm(seq, q0, q1)

    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._check_cp(src, dst, p0, p1)

    def check_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self._check_seq(seq)
        normalize_range(p0, p1)
        delta = check_int32(delta, "delta")
        if delta != 0:
            self.recr.check_position_move(seq, p0, p1, "seq_add", delta)
            self.attn.check_position_move(seq, p0, p1, "seq_add", delta)
            self._check_move_keeps_ends(seq, p0, p1, lambda p: p + delta, "delta")

    def check_seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self._check_seq(seq)
        normalize_range(p0, p1)
        d = check_divisor(d)
        if d != 1:
            self.recr.check_position_move(seq, p0, p1, "seq_div")
            self._check_move_keeps_ends(seq, p0, p1, lambda p: p // d, "d")
            self.attn.check_position_move(seq, p0, p1, "seq_div", d=d)

    def check_context_shift(self, seq: int, p0: int, p1: int) -> None:
        seq = self._check_seq(seq)
        q0, q1 = normalize_range(p0, p1)
        if q0 >= q1:
            return
        self.check_seq_rm(seq, q0, q1)
        # The move as the removal leaves the parts: each part's own check.  Their ends
        # stay equal: the removal was checked to leave them equal, and the move shifts
        # every position from q1 on, in every part, by the same amount.
        self.recr.check_context_shift(seq, q0, q1)
        self.attn.check_context_shift(seq, q0, q1)

    def rollback_reach(self, seq: int) -> RollbackReach:
        seq = self._check_seq(seq)
        P = self.seq_pos_max(seq)
        if P < 0:
            return RollbackReach(seq, -1, 0)
        # Below the recurrent part's floor it refuses.  Above it the parts must still
        # agree: every attention cache must hold p - 1 (so p - 1 lies in the last run of
        # consecutive positions it holds), and a window cache the positions the next
        # token's window reads, which only fails deeper the further back p goes.  So the
        # accepted p form [floor, P]: bisect for the lowest with the seq_rm check itself.
        lo = max(self.recr.rollback_reach(seq).floor, 1)
        for cache in self.kv_caches:
            held = np.unique(cache.cells[cache.stream_of(seq)].seq_pos[seq].positions())
            gaps = np.flatnonzero(np.diff(held) > 1)
            start = int(held[gaps[-1] + 1]) if gaps.size else int(held[0]) if held.size else P + 1
            lo = max(lo, start + 1)
        hi = P + 1  # accepted: every p >= hi
        if self.recr.has_layers:
            # A rollback must also cut what it undoes (_rollback_cuts_what_it_undoes): walk
            # down from the top, at most the recurrent part's planes deep, and stop at the
            # first refusal, so the reach never claims a p that seq_rm refuses.
            while hi > lo and self.can_seq_rm(seq, hi - 1, -1):
                hi -= 1
            return RollbackReach(seq, P, hi if hi > 1 else 0)
        while lo < hi:  # positions only: the accepted p form [floor, P]; bisect in [lo, hi)
            mid = (lo + hi) // 2
            if self.can_seq_rm(seq, mid, -1):
                hi = mid
            else:
                lo = mid + 1
        return RollbackReach(seq, P, hi if hi > 1 else 0)

    def _kv_views(self, seq: int) -> tuple[KVSeqCells, ...]:
        """``seq``'s cells in every attention cache (hybrid-idx adds its indexer)."""
        return tuple(cache.seq_cells_view(seq) for cache in self.kv_caches)

    def seq_state(self, seq: int) -> SeqState:
        seq = self._check_seq(seq)
        return SeqState(seq, self.version, self.seq_pos_min(seq), self.seq_pos_max(seq),
                        self.recr.recurrent_rows(seq), self._kv_views(seq), self.rollback_reach(seq))  # fmt: skip

    def _check_move_keeps_ends(self, seq: int, p0: int, p1: int, move: Any, name: str) -> None:
        """Refuse (changing nothing) a position move after which the parts would end
        ``seq`` at different positions: the recurrent part moves its one position
        (the last) only when it is in [p0, p1), each attention cache moves every
        cell in the range, so moving the last position below positions the range
        leaves behind (or a range that stops short of the end) splits them."""
        q0, q1 = normalize_range(p0, p1)
        P = self.recr.seq_pos_max(seq)
        end = move(P) if q0 <= P < q1 else P
        end = max(end, -1)
        for cache in self.kv_caches:
            pairs = cache.cells[cache.stream_of(seq)].seq_pos[seq]
            got = max((move(p) if q0 <= p < q1 else p for p, _ in pairs), default=-1)
            if max(got, -1) != end:
                raise ArgumentError(
                    name,
                    f"moving [{q0}, {q1}) of sequence {seq} would end its attention cells at {max(got, -1)} and its "
                    f"recurrent state at {end}; the parts of a hybrid must agree (remove the positions in between "
                    "first, as a context shift does)",
                )

    def seq_pos_min(self, seq: int) -> int:
        self._check_seq(seq)
        return max(self.attn.seq_pos_min(seq), self.recr.seq_pos_min(seq))

    def seq_pos_max(self, seq: int) -> int:
        return min(self.attn.seq_pos_max(seq), self.recr.seq_pos_max(seq))

    def seq_pos_max_all(self) -> np.ndarray:
        """seq_pos_max of every sequence id as one array (batch validation)."""
        held: np.ndarray = np.minimum(self.attn.seq_pos_max_all(), self.recr.seq_pos_max_all())
        return held

    def memory_breakdown(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in (self.attn, self.recr):
            for k, v in part.memory_breakdown().items():
                out[k] = out.get(k, 0) + v
        return out

    # -- state ------------------------------------------------------------------------
    def _attn_sections(self, seq: int, flags: int) -> list[tuple[bytes, bytes | Writer]]:
        if isinstance(self.attn, KVCacheISWA):
            return self.attn.state_sections(seq, flags)
        if flags & StateFlags.PARTIAL_ONLY:
            return []
        w = Writer()
        self.attn.state_write_into(w, seq)
        return [(TAG_KV, w)]

    def state_sections(self, seq: int = -1, flags: int = StateFlags.NONE) -> list[tuple[bytes, bytes | Writer]]:
        """``(tag, payload)`` per section; a payload may be the :class:`Writer` holding it
        (:func:`~statecache.state_io.pack_sections` takes either)."""
        return [*self._attn_sections(seq, flags), (TAG_RECR, self.recr.write_section(seq, flags))]

    def state_tags(self, flags: int = StateFlags.NONE) -> tuple[bytes, ...]:
        """The tags of the sections :meth:`state_sections` writes with ``flags``."""
        if isinstance(self.attn, KVCacheISWA):
            attn = self.attn.state_tags(flags)
        else:
            attn = () if flags & StateFlags.PARTIAL_ONLY else (TAG_KV,)
        return (*attn, TAG_RECR)

    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
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
        """Validate every section of every part, and that they agree; returns the
        plans.  Changes nothing."""
        plans = {
            "attn": self._parse_attn(sections, seq, flags),
            "recr": self.recr.parse_section(
                find_section(sections, TAG_RECR), seq, planes=bool(flags & StateFlags.WITH_PLANES)
            ),
        }
        self._check_blob_parts_agree(plans, seq)
        if flags & StateFlags.PARTIAL_ONLY:
            # the recurrent state must not run ahead of the full-attention cells a partial read keeps
            full = self.attn.base if isinstance(self.attn, KVCacheISWA) else self.attn
            for p, ids in plans["recr"]["cells"]:
                for q in ids if seq < 0 else [seq]:
                    if p >= 0:
                        check_partial_under_full(full, q, p, "recr.pos")
        return plans

    def _check_blob_parts_agree(self, plans: dict[str, Any], seq: int) -> None:
        """Every sequence of the blob ends at the same position in every part (and is
        in every part): a blob whose recurrent state is at 9 while its attention
        cells end at 5 would restore parts that disagree."""
        recr_end: dict[int, int] = {}
        for p, ids in plans["recr"]["cells"]:
            for q in ids if seq < 0 else [seq]:
                recr_end[q] = p
        attn = plans["attn"]
        kv: list[tuple[str, KVStatePlan | None]] = [("kv", attn)]
        if isinstance(attn, ISWAPlan):
            kv = [("kv_base", attn.base), ("kv_swa", attn.swa)]
        for name, plan in kv:
            if plan is None:  # a partial blob holds no full-attention section
                continue
            held = plan_positions(plan)
            for q in sorted(set(held) | set(recr_end)):
                a_end, r_end = max(held.get(q, ()), default=-1), recr_end.get(q, -1)
                if a_end != r_end:
                    raise StateError(
                        f"{name}.pos",
                        f"sequence {q}: the attention cells end at position {a_end}, the recurrent state is at "
                        f"{r_end}; the parts of a hybrid blob must agree",
                    )

    def commit_all(self, plans: dict[str, Any]) -> None:
        self._edits += 1
        if plans["attn"] is not None:
            self.attn.state_commit(plans["attn"])
        self.recr.apply_section(plans["recr"])

    def landing_writes(self, plans: dict[str, Any]) -> list[RowWrite]:
        """The row writes :meth:`commit_all` makes into rows free now, every part's
        (see :func:`~statecache.state_io.rows_landing`)."""
        attn = [] if plans["attn"] is None else self.attn.landing_writes(plans["attn"])
        return [*attn, *self.recr.landing_writes(plans["recr"])]

    def state_landing_failed(self) -> None:
        """A read failed after a transfer's rows landed in free rows: plans and undos made
        before it are stale (every part's and the composite's)."""
        self._edits += 1
        self.attn.state_landing_failed()
        self.recr.state_landing_failed()

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
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        blob_flags, sections = unpack_sections(data, flags)
        # the blob's own WITH_PLANES bit says whether its recurrent section carries planes
        flags = (int(flags) & ~StateFlags.WITH_PLANES) | (blob_flags & StateFlags.WITH_PLANES)
        expect_sections(sections, self.state_tags(flags), type(self).__name__)
        plans = self.parse_all(sections, seq, flags)
        rows_landing(lambda: self.landing_writes(plans), self.state_landing_failed)
        rows_ready()  # a transfer's rows may still be arriving: validated above, written below
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
