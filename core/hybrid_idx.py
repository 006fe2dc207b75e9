"""Hybrid memory with an indexer cache (docs/memory-semantics.md#hybrid-idx).

The indexer cache is a key-only KV cache (one row of width ``D * row_factor``
per cell and indexer layer, no RoPE) with the same size, streams and slot
infos as the attention cache: it never searches its own cells, it is placed
into the attention slots, so its cells always equal the attention cells.

On top sits the k-pool machinery of :mod:`statecache.kpool`: the layout of
pools per sequence (updated at every ``apply()``), which pools the current
ubatch must (re)compute, the graph inputs, and the stale marks that every
sequence edit sets (docs/memory-semantics.md#kpool-stale).  Marks are copied when a batch is planned
and cleared at the first ``next()`` of the batch.

Undo after a failed compute (docs/memory-semantics.md#inv-22) works as for the
plain hybrid (:meth:`HybridContext.undo`), and also puts back the k-pool
layout, the stale marks (a ``next()`` that cleared them is undone too) and
the context's ubatch bookkeeping, so applying the same ubatches again gives
the same k-pool inputs.  An undo is refused, changing nothing, when the
memory was edited since the first ubatch it would take back was applied (the
edit count of :class:`HybridMemory`); here that also covers edits that only
set stale marks, such as ``seq_div`` by 1.

One pooled slot per rep row: when several sequences share cells (after
``seq_cp`` in a unified cache) their pools share rep rows, which is only
right while every sharer groups the shared cells the same way.  An edit of
one sharer that would regroup them differently (a hole or head removal,
or own cells moved across shared ones, in order mode above all: pools there
go by rank) would make two different pools write the same slot, so it is
refused: ``seq_rm`` returns False, ``seq_add``/``seq_div`` raise, nothing
changed (docs/memory-semantics.md#hybrid-idx: a shared cell holds a single pool grouping).
The memory's version (stale plans, :meth:`MemoryContext.check_version`)
includes the indexer cache and the stale marks.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.batch import SeqIds
from statecache.errors import ArgumentError, StateError
from statecache.hybrid import HybridContext, HybridMemory, HybridUpdateContext
from statecache.kpool import (
    KPoolInputs,
    KPoolLayout,
    KPoolState,
    LayoutMark,
    StaleMarks,
    Token,
    rebuild,
    stale_pos,
)
from statecache.kv_cache import KVCache, KVLayer
from statecache.kv_cells import SeqCells
from statecache.memory import (
    ContextError,
    KVSeqCells,
    MemoryContext,
    MemoryStatus,
    StateFlags,
    check_divisor,
    check_int32,
    normalize_range,
)
from statecache.state_io import Reader, RowWrite, Writer, find_section

if TYPE_CHECKING:
    from statecache.batch import UBatch
    from statecache.recurrent import RecurrentMemory

TAG_IDX = b"IDXK"


class HybridIdxMemory(HybridMemory):
    """Attention + recurrent + indexer (key-only) caches.

    ``idx_layers``: model layers with an indexer; ``head_size``: indexer head
    size ``D``; ``row_factor``: row width in units of ``D`` (3 for glm5-next,
    2 for qwen4exp); ``kpool``: tokens per pool; ``by_order``: order mode
    (pools by rank) instead of position mode.

    Defaults (docs/memory-semantics.md#defaults): ``row_factor`` 3, ``kpool`` 4,
    position mode; the indexer cache takes ``attn``'s size, streams, window and
    padding, and its dtype unless ``dtype`` is given.
    """

    def __init__(
        self,
        attn: KVCache,
        recr: RecurrentMemory,
        idx_layers: Sequence[int],
        *,
        head_size: int,
        row_factor: int = 3,
        kpool: int = 4,
        by_order: bool = False,
        dtype: Any = None,
    ) -> None:
        if not isinstance(attn, KVCache):
            raise ArgumentError("attn", "hybrid-idx needs a plain KVCache attention part")
        if row_factor < 2 or head_size <= 0:
            raise ArgumentError("row_factor", "an indexer row holds a per-token part and a pooled slot (factor >= 2)")
        super().__init__(attn, recr)
        self.idx = KVCache(
            attn.device,
            [KVLayer(il, head_size * row_factor, 0) for il in idx_layers],
            size=attn.size,
            n_seq_max=attn.n_seq_max,
            unified=attn.unified,
            dtype=attn.dtype if dtype is None else dtype,
            swa_type=attn.swa_type,
            n_swa=attn.n_swa,
            n_pad=attn.n_pad,
            can_shift=False,  # no RoPE on indexer keys: shifts are cleared, never rotated
            name="idx",
        )
        self.head_size = int(head_size)
        self.layout = KPoolLayout(kpool, by_order, attn.n_seq_max, attn.size, attn.n_stream)
        self.marks = StaleMarks(attn.n_seq_max)

    @property
    def version(self) -> Any:
        return (*super().version, self.idx.version, self.marks.version)

    def fill_garbage(self, seed: int) -> None:
        super().fill_garbage(seed)
        self.idx.fill_garbage(seed + 2000)

    def pairs_of(self, s: int) -> tuple[int, list[tuple[int, int]]]:
        strm = self.idx.stream_of(s)
        return strm, self.idx.cells[strm].seq_cells(s)

    def _pairs_view(self, s: int) -> tuple[int, SeqCells]:
        """:meth:`pairs_of` without the copy: the live pairs, with their stamp, for
        :meth:`KPoolLayout.update` (which then reads only what was appended)."""
        strm = 0 if self.idx.unified else s  # s is a loop index in range: no check (once per sequence and apply)
        return strm, self.idx.cells[strm].seq_pos[s]

    def _live_pairs(self) -> Sequence[SeqCells]:
        """The live pairs of every sequence, in its stream (what :meth:`_pairs_view` returns):
        with one stream, its whole book (the layout reads its arrays)."""
        cells = self.idx.cells
        if self.idx.unified:
            return cells[0].seq_pos
        return [cells[s].seq_pos[s] for s in range(self.idx.n_seq_max)]

    # -- plans ----------------------------------------------------------------------
    def _batch_context(
        self, ubs: Sequence[UBatch], plans: tuple[Any, Any], attn: MemoryContext, recr: MemoryContext
    ) -> HybridContext:
        idx = self.idx.make_context(ubs, plans[1])  # the attention slots, not a search of its own
        return HybridIdxContext(self, attn, idx, recr)

    def init_full(self) -> MemoryContext:
        ctx = HybridContext(self.attn.init_full(), self.recr.init_full(), [self.idx.init_full()])
        self.layout.update(self._pairs_view, self.marks)  # marks are kept (docs/memory-semantics.md#kpool-hazards, H6)
        ctx.kpool_state = self.layout.build_state([], None, 0, reserve=True)  # type: ignore[attr-defined]
        ctx.record_version(self)
        return ctx

    def init_update(self, optimize: bool = False) -> MemoryContext:
        a = self.attn.init_update(optimize)
        i = self.idx.init_update(optimize)
        r = self.recr.init_update(optimize)
        if all(c.status is MemoryStatus.NO_UPDATE for c in (a, i, r)):
            return self.no_update_context()
        return HybridUpdateContext(self, a, r, [i])

    # -- one pooled slot per rep row ---------------------------------------------------
    def _groupings_agree(self, seq: int, moved: dict[int, int | None]) -> bool:
        """Whether, after ``seq``'s cells move as ``moved`` says (cell -> new position,
        None: removed from ``seq``), every pool of ``seq`` whose rep row another
        sequence's pool also uses has the same members there.  Fast when ``seq``
        shares no cell."""
        strm, pairs = self.pairs_of(seq)
        cells = self.idx.cells[strm]
        sharers = {q for _, c in pairs if cells.seq_count(c) > 1 for q in cells.seqs_of(c)} - {seq}
        if not sharers:
            return True
        lay = self.layout
        new_pairs = sorted((moved.get(c, p), c) for p, c in pairs if moved.get(c, p) is not None)

        def reps(s: int, sp: list[tuple[int, int]]) -> dict[int, tuple[int, ...]]:
            layout = rebuild(sp, strm, lay.kpool, lay.by_order)
            out = {}
            for j in layout.pools:
                members = tuple(c for _, c in sp[j : j + lay.kpool])
                out[strm * lay.kv_size + members[-1]] = members
            return out

        mine = reps(seq, new_pairs)  # type: ignore[arg-type]
        for q in sharers:
            for rep, members in reps(q, self.pairs_of(q)[1]).items():
                if mine.get(rep, members) != members:
                    return False
        return True

    def _seq_rm_allowed(self, seq: int, p0: int, p1: int) -> bool:
        if not super()._seq_rm_allowed(seq, p0, p1):
            return False
        pairs = self.idx.cells[self.idx.stream_of(seq)].seq_pos[seq]  # not a copy: O(1) for a rollback
        if not pairs or p1 > pairs[-1][0]:
            return True  # a tail removal (a rollback) keeps every other cell's rank and position
        return self._groupings_agree(seq, {c: None for p, c in pairs if p0 <= p < p1})

    def _check_regroup(self, seq: int, p0: int, p1: int, new_pos: Any, op: str) -> None:
        q0, q1 = normalize_range(p0, p1)
        _, pairs = self.pairs_of(seq)
        moved = {c: (new_pos(p) if new_pos(p) >= 0 else None) for p, c in pairs if q0 <= p < q1}
        if moved and not self._groupings_agree(seq, moved):
            raise ArgumentError(
                "seq",
                f"{op}: sequence {seq} shares indexer cells with other sequences, and moving its cells in "
                f"[{q0}, {q1}) would group the shared ones into different k-pools (one pooled slot per cell)",
            )

    # -- sequence operations with stale marks (docs/memory-semantics.md#kpool-stale) ------
    def clear(self, data: bool = True) -> None:
        super().clear(data)
        self.idx.clear(data)
        self.marks.set(-1, 0)

    def _rm_witness(self) -> tuple[Any, ...]:
        return (*super()._rm_witness(), self.marks.copy().tobytes())  # a mark alone is a change

    def _seq_rm_rest(self, seq: int, p0: int, p1: int) -> bool:
        # the recurrent part accepted (when it refuses: no part changed, no mark)
        q0, _ = normalize_range(p0, p1)
        st = stale_pos(seq, q0, self.idx.seq_pos_min(seq) if seq >= 0 else 0)
        self.idx.seq_rm(seq, p0, p1)
        self.marks.set(seq, st)
        return super()._seq_rm_rest(seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        if not (p0 <= 0 and p1 < 0):
            raise ArgumentError("p0/p1", f"hybrid-idx copies whole sequences only, got [{p0}, {p1})")
        super().seq_cp(src, dst, p0, p1)
        if src != dst:
            self.idx.seq_rm(dst, -1, -1)  # the indexer follows the attention cells exactly
        self.idx.seq_cp(src, dst, p0, p1)
        if src != dst:
            self.marks.set(dst, 0)

    def seq_keep(self, seq: int) -> None:
        super().seq_keep(seq)
        self.idx.seq_keep(seq)
        self.marks.set(-1, 0)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        super().seq_add(seq, p0, p1, delta)  # checks first (check_seq_add), every part's and the k-pools'
        delta = int(delta)
        q0, q1 = normalize_range(p0, p1)
        if delta == 0 or q0 >= q1:
            return
        st = stale_pos(seq, q0 + delta if delta < 0 else q0, self.idx.seq_pos_min(seq))
        self.idx.seq_add(seq, p0, p1, delta)
        self.marks.set(seq, st)

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        super().seq_div(seq, p0, p1, d)  # checks first (check_seq_div)
        self.idx.seq_div(seq, p0, p1, d)
        self.marks.set(seq, 0)

    # -- questions before actions: the k-pools' refusals on top of the hybrid's ----------
    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        if not (p0 <= 0 and p1 < 0):
            raise ArgumentError("p0/p1", f"hybrid-idx copies whole sequences only, got [{p0}, {p1})")
        super().check_seq_cp(src, dst, p0, p1)

    def check_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        self._check_seq(seq)
        d = check_int32(delta, "delta")
        if d:
            self._check_regroup(seq, p0, p1, lambda p: p + d, "seq_add")
        super().check_seq_add(seq, p0, p1, delta)

    def check_seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        self._check_seq(seq)
        div = check_divisor(d)
        if div != 1:
            self._check_regroup(seq, p0, p1, lambda p: p // div, "seq_div")
        super().check_seq_div(seq, p0, p1, d)

    def check_context_shift(self, seq: int, p0: int, p1: int) -> None:
        super().check_context_shift(seq, p0, p1)
        q0, q1 = normalize_range(p0, p1)
        _, pairs = self.pairs_of(seq)
        if q0 >= q1 or not any(p >= q1 for p, _ in pairs):
            return  # nothing moves after the removal (checked above)
        # the move as the removal leaves the cells: removed ones gone, later ones down by q1 - q0
        moved: dict[int, int | None] = {c: (None if p < q1 else p - (q1 - q0)) for p, c in pairs if p >= q0}
        if not self._groupings_agree(seq, moved):
            raise ArgumentError(
                "seq",
                f"context shift: sequence {seq} shares indexer cells with other sequences, and shifting "
                f"[{q0}, {q1}) out would group the shared ones into different k-pools (one pooled slot per cell)",
            )

    def _kv_views(self, seq: int) -> tuple[KVSeqCells, ...]:
        return (*super()._kv_views(seq), self.idx.seq_cells_view(seq))

    def memory_breakdown(self) -> dict[str, int]:
        out = super().memory_breakdown()
        for k, v in self.idx.memory_breakdown().items():
            out[k] = out.get(k, 0) + v
        return out

    # -- state ------------------------------------------------------------------------------
    def state_sections(self, seq: int = -1, flags: int = StateFlags.NONE) -> list[tuple[bytes, bytes | Writer]]:
        out = super().state_sections(seq, flags)
        if not flags & StateFlags.PARTIAL_ONLY:
            w = Writer()
            self.idx.state_write_into(w, seq)
            out.append((TAG_IDX, w))
        return out

    def state_tags(self, flags: int = StateFlags.NONE) -> tuple[bytes, ...]:
        tags = super().state_tags(flags)
        return tags if flags & StateFlags.PARTIAL_ONLY else (*tags, TAG_IDX)

    def parse_all(self, sections: Any, seq: int, flags: int) -> dict[str, Any]:
        plans = super().parse_all(sections, seq, flags)
        plans["idx"] = None
        if not flags & StateFlags.PARTIAL_ONLY:
            r = Reader(find_section(sections, TAG_IDX))
            plans["idx"] = self.idx.state_parse(r, seq)
            r.at_end()
            a, i = plans["attn"], plans["idx"]
            # Stream, cell, position *and* sequence set of every cell: the indexer
            # follows the attention cells exactly (docs/memory-semantics.md#hybrid-idx), or its pools are wrong.
            same = len(a.placements) == len(i.placements) and all(
                (pa[0], pa[1].tolist(), pa[2].tolist(), [tuple(x) for x in pa[3]])
                == (pi[0], pi[1].tolist(), pi[2].tolist(), [tuple(x) for x in pi[3]])
                for pa, pi in zip(a.placements, i.placements)
            )
            if not same:
                raise StateError("idx.cells", "the indexer section does not hold the attention section's cells")
        return plans

    def commit_all(self, plans: dict[str, Any]) -> None:
        super().commit_all(plans)
        if plans["idx"] is not None:
            self.idx.state_commit(plans["idx"])
            self.marks.set(plans["idx"].seq, 0)

    def landing_writes(self, plans: dict[str, Any]) -> list[RowWrite]:
        idx = [] if plans["idx"] is None else self.idx.landing_writes(plans["idx"])
        return [*super().landing_writes(plans), *idx]

    def state_landing_failed(self) -> None:
        super().state_landing_failed()
        self.idx.state_landing_failed()

    def state_drop(self, seq: int) -> None:
        super().state_drop(seq)
        if seq >= 0:
            self.idx._state_drop(seq)
        else:
            self.idx.clear(True)
        self.marks.set(seq, 0)


class _LazyTokens(Sequence[Token]):
    """:meth:`HybridIdxContext.tokens` made on first read (a decode ubatch's k-pool state is
    read from arrays and never needs them)."""

    def __init__(self, ctx: HybridIdxContext, n: int) -> None:
        self._ctx, self._n = ctx, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        return self._ctx.tokens()[i]


@dataclasses.dataclass(frozen=True)
class _UndoExtra:
    """What ``HybridIdxContext.apply()`` (and a later ``next()``) change besides the books."""

    layout: LayoutMark  # KPoolLayout.mark()
    marks: np.ndarray
    i_cur: int
    state_for: int
    kpool_state: KPoolState | None


class HybridIdxContext(HybridContext):
    """A planned batch on the three caches, with the per-ubatch k-pool state.

    :meth:`undo` (inherited) also restores the k-pool layout, the stale marks
    and ``i_cur`` / ``kpool_state`` as they were before the first ubatch it
    takes back was applied; it refuses, changing nothing, when the memory was
    edited since (the edit count of :class:`HybridMemory`).
    """

    def __init__(self, mem: HybridIdxMemory, attn: MemoryContext, idx: MemoryContext, recr: MemoryContext) -> None:
        super().__init__(attn, recr, [idx])
        self.mem = mem
        self.memory = mem  # undo checks its edit count, drops damaged sequences through its operations (marks)
        self.record_version(mem)
        self.idx = idx
        self.stale_batch = mem.marks.copy()  # the marks as planned (docs/memory-semantics.md#kpool-stale)
        self.i_cur = 0
        self._state_for = -1
        self.kpool_state: KPoolState | None = None
        self._tokens: list[Token] = []
        self._tokens_for: tuple[Any, Any] | None = None  # (ubatch, slot info) the tokens were made of

    def apply(self) -> bool:
        if not super().apply():
            return False
        mem = self.mem
        forced = mem.layout.update(mem._pairs_view, mem.marks, mem._live_pairs())
        first = self.stale_batch if self.i_cur == 0 else None
        ub = self.get_ubatch()
        if isinstance(ub.seq_id, SeqIds):  # one sequence per token: read as arrays, Token tuples made only if needed
            one_seq = (np.asarray(ub.pos), ub.seq_id.ids)
            tokens: Sequence[Token] = _LazyTokens(self, ub.n_tokens)
        else:
            one_seq, tokens = None, self.tokens()
        self.kpool_state = mem.layout.build_state(tokens, first, ub.n_seqs_unq, forced=forced, one_seq=one_seq)
        self._state_for = self.i_cur
        return True

    def step(self, keep_undo_rows: bool | None = None) -> Any:
        """:meth:`HybridContext.step` plus the indexer cache (``write_index_keys``,
        ``index_rows``) and this ubatch's ``kpool_inputs``."""
        from statecache.memory_step import MemoryStep

        recr = self.recr.step(keep_undo_rows)  # type: ignore[attr-defined]
        return MemoryStep(recr, [self.attn], index=self.idx, kpool=self)  # type: ignore[list-item,arg-type]

    # -- undo (HybridContext hooks) ---------------------------------------------------------
    def _undo_extra_snapshot(self) -> _UndoExtra:
        mem = self.mem
        # apply() appends to the layouts in place: a mark (lengths), not a copy of every layout
        return _UndoExtra(mem.layout.mark(), mem.marks.copy(), self.i_cur, self._state_for, self.kpool_state)

    def _undo_extra_restore(self, extra: Any) -> None:
        mem = self.mem
        mem.layout.restore(extra.layout)
        mem.marks.restore(extra.marks)
        self.i_cur, self._state_for, self.kpool_state = extra.i_cur, extra.state_for, extra.kpool_state

    def next(self) -> bool:
        current = self.mem.version == self._planned_version  # a stale plan stays stale
        if self.i_cur == 0:
            self.mem.marks.clear()  # the first ubatch computed: every re-pool is done
        self.i_cur += 1
        more = super().next()
        if current:
            self.update_version()
        return more

    def tokens(self) -> list[Token]:
        """The current ubatch's tokens as the k-pool reads them (made once per ubatch: the
        ubatch and its planned cells never change)."""
        ub, sinfo = self.get_ubatch(), self.idx.sinfo  # type: ignore[attr-defined]
        if self._tokens_for is not None and self._tokens_for[0] is ub and self._tokens_for[1] is sinfo:
            return self._tokens
        cells = sinfo.cells.tolist()
        pos = np.asarray(ub.pos).tolist()
        if isinstance(ub.seq_id, SeqIds):  # one sequence per token: no per-token set to read
            # Token(p, (s,), c) for each token, built in C (one per token: 256 a decode step)
            out = list(map(tuple.__new__, itertools.repeat(Token), zip(pos, zip(ub.seq_id.ids.tolist()), cells)))
        else:
            out = [Token(pos[i], tuple(ub.seq_id[i]), cells[i]) for i in range(ub.n_tokens)]
        self._tokens, self._tokens_for = out, (ub, sinfo)
        return out

    def _state(self) -> KPoolState:
        if self._state_for != self.i_cur or self.kpool_state is None:
            raise ContextError("k-pool sizes and inputs exist only after apply() of the current ubatch")
        return self.kpool_state

    def n_kpool(self) -> int:
        return self._state().n_kpool

    def n_kpool_new(self) -> int:
        return self._state().n_new_g

    def kpool_inputs(self, *, n_sel: int | None = None, with_pos: bool = False) -> KPoolInputs:
        st = self._state()
        idx: KVCache = self.mem.idx
        return self.mem.layout.build_inputs(
            st,
            self.tokens(),
            idx.n_kv(),
            n_sel=n_sel,
            with_pos=with_pos,
            ext_of=lambda strm, c: (int(idx.cells[strm].ext[c][0]), int(idx.cells[strm].ext[c][1])),
        )

    def get_ubatch(self) -> UBatch:
        return self.parts[0].get_ubatch()
