"""k-pool layout, new-pool tracking, graph inputs and stale marks of the
indexer cache (``docs/memory-semantics.md#kpool``).

An indexer layer stores per cell a row ``[per-token part | pooled slot]``.
Groups of ``kpool`` cells of one sequence form a *pool*; its pooled key lives
in the pooled slot of its last member (the *rep*).  This module decides which
cells form which pools, which pools a ubatch must (re)compute, and fills the
index/mask arrays the graph uses.  It is pure host logic: the cells come
from the caller (the indexer KV cache of :mod:`statecache.hybrid_idx`).

Array layouts are NumPy C order; the spec's ggml shapes are reversed
(``pool_idxs`` ggml ``[kpool, n_pool]`` is NumPy ``(n_pool, kpool)``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from statecache.errors import ArgumentError, InvariantError
from statecache.kv_cells import _CELL_BITS, _CELL_MASK, SeqCells, SeqPairBook

#: A stale mark of "clean" (no pooled key of the sequence may be wrong).
POS_CLEAN = 2**31 - 1
#: Pool counts are padded to this multiple (graph shapes stay stable).
POOL_PAD = 64


#: a layout's fields read by C-level ``map`` over every sequence (:meth:`KPoolLayout.mark`)
_CELLS = operator.attrgetter("cells")
_POOLS = operator.attrgetter("pools")
_J_NEXT = operator.attrgetter("j_next")
_SRC_STAMP = operator.attrgetter("src_stamp")
_TOK_SEQS = operator.itemgetter(1)
_TOK_POS = operator.itemgetter(0)
_FIRST = operator.itemgetter(0)


def _pick(items: list[Any], rows: np.ndarray) -> tuple[Any, ...]:
    """``items[r]`` for each of ``rows`` (one C-level ``itemgetter``)."""
    if rows.size <= 1:
        return (items[int(rows[0])],) if rows.size else ()
    return operator.itemgetter(*rows.tolist())(items)  # type: ignore[no-any-return]


def _consume(it: Iterable[Any]) -> None:
    """Run an iterator of side effects to its end (C-level, nothing kept)."""
    collections.deque(it, maxlen=0)


#: an empty pool table (a layout's arrays before its first :meth:`SeqLayout.pool_table`)
_NO_TABLE: np.ndarray = np.zeros((0, 0), dtype=np.int64)
_NO_POS: np.ndarray = np.zeros(0, dtype=np.int64)


def kpool_pad(n: int) -> int:
    """Padded pool count: a multiple of 64, at least 64, always > ``n``."""
    return max(POOL_PAD, -(-(n + 1) // POOL_PAD) * POOL_PAD)


@dataclasses.dataclass
class SeqLayout:
    """Pools of one sequence (docs/memory-semantics.md#kpool-pools): ``pools[k]`` indexes ``cells``."""

    strm: int = 0
    cells: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (pos, stream-local cell)
    pos_min: int = 0
    pools: list[int] = dataclasses.field(default_factory=list)
    j_next: int = 0
    #: the ``stamp`` of the sequence's cells (:class:`~statecache.kv_cells.SeqCells`) when ``cells`` was
    #: last made equal to them: while the stamp is unchanged, those pairs are still its first ones and
    #: only appends happened since, so :meth:`KPoolLayout.update` reads just the new pairs
    #: (0: none; stamps start at 1)
    src_stamp: int = dataclasses.field(default=0, compare=False)
    #: ``pools`` as arrays, filled up to ``_n_table`` pools (:meth:`pool_table`): pools and their
    #: members are only appended between edits, so the arrays grow by the new pools alone, and the
    #: graph inputs copy them with NumPy instead of a Python loop over every pool of the context
    _members: np.ndarray = dataclasses.field(default_factory=lambda: _NO_TABLE, compare=False, repr=False)
    _first_pos: np.ndarray = dataclasses.field(default_factory=lambda: _NO_POS, compare=False, repr=False)
    _last_pos: np.ndarray = dataclasses.field(default_factory=lambda: _NO_POS, compare=False, repr=False)
    _n_table: int = dataclasses.field(default=0, compare=False, repr=False)

    def copy(self) -> SeqLayout:
        return SeqLayout(self.strm, list(self.cells), self.pos_min, list(self.pools), self.j_next, self.src_stamp)

    def truncate(self, n_cells: int, n_pools: int, j_next: int, stamp: int) -> None:
        """Put back the lengths of an earlier :meth:`KPoolLayout.mark` (the table keeps only its
        first ``n_pools`` rows: the pools appended later may come back different)."""
        del self.cells[n_cells:]
        del self.pools[n_pools:]
        self.j_next, self.src_stamp = j_next, stamp
        self._n_table = min(self._n_table, n_pools)

    def pool_table(self, kpool: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pool: its members' stream-local cells ``(n_pools, kpool)``, its first and last
        position ``(n_pools,)`` (views, valid until the layout changes).  O(pools added since
        the last call): each pool's row is converted once."""
        n, done = len(self.pools), self._n_table
        if self._members.shape[0] < n or self._members.shape[1] != kpool:  # grow (amortised O(1) a pool)
            cap = max(n, 2 * self._members.shape[0], 16)
            members = np.empty((cap, kpool), dtype=np.int64)
            first, last = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)
            if done:
                members[:done], first[:done] = self._members[:done], self._first_pos[:done]
                last[:done] = self._last_pos[:done]
            self._members, self._first_pos, self._last_pos = members, first, last
        if done + 1 == n:  # the decode case: one new pool, no NumPy round trip
            j = self.pools[done]
            pairs = self.cells[j : j + kpool]
            self._members[done] = [c for _, c in pairs]
            self._first_pos[done], self._last_pos[done] = pairs[0][0], pairs[-1][0]
            self._n_table = n
        elif done < n:
            starts = np.asarray(self.pools[done:n], dtype=np.int64)
            lo = int(starts[0])
            block = np.asarray(self.cells[lo : int(starts[-1]) + kpool], dtype=np.int64).reshape(-1, 2)
            rows = (starts - lo)[:, None] + np.arange(kpool)
            self._members[done:n] = block[rows, 1]
            self._first_pos[done:n] = block[rows[:, 0], 0]
            self._last_pos[done:n] = block[rows[:, -1], 0]
            self._n_table = n
        return self._members[:n], self._first_pos[:n], self._last_pos[:n]

    def first_cell_at(self, pos: int) -> int:
        """The lowest stream-local cell at ``pos``, or -1; O(log cells)."""
        r = bisect.bisect_left(self.cells, (pos,))
        return self.cells[r][1] if r < len(self.cells) and self.cells[r][0] == pos else -1


def scan_pools(layout: SeqLayout, kpool: int, by_order: bool) -> None:
    """Resume the pool scan at ``j_next`` (docs/memory-semantics.md#kpool-layout); only complete pools exist."""
    cells = layout.cells
    j = layout.j_next
    while j + kpool <= len(cells):
        if by_order:
            layout.pools.append(j)
            j += kpool
            continue
        p0 = cells[j][0]
        if (p0 - layout.pos_min) % kpool != 0:
            j += 1
            continue
        if all(cells[j + k][0] == p0 + k for k in range(1, kpool)):
            layout.pools.append(j)
            j += kpool
        else:
            j += 1
    layout.j_next = j


def rebuild(pairs: Sequence[tuple[int, int]], strm: int, kpool: int, by_order: bool) -> SeqLayout:
    """A layout computed from scratch (the reference the append path must match)."""
    layout = SeqLayout(strm=strm, cells=list(pairs), pos_min=pairs[0][0] if pairs else 0)
    scan_pools(layout, kpool, by_order)
    return layout


class StaleMarks:
    """Per sequence, the lowest position from which pooled keys may be wrong (docs/memory-semantics.md#kpool-stale)."""

    def __init__(self, n_seq: int) -> None:
        self.marks = np.full(n_seq, POS_CLEAN, dtype=np.int64)
        #: bumped by every call that may change a mark (part of the memory's version)
        self.version = 0

    def set(self, s: int, p: int) -> None:
        """Lower the mark of ``s`` (all sequences when ``s < 0``) to ``p``."""
        p = max(int(p), 0)
        self.version += 1
        if s < 0:
            np.minimum(self.marks, p, out=self.marks)
        else:
            if s >= self.marks.size:
                raise ArgumentError("seq", f"sequence {s} out of range [0, {self.marks.size})")
            self.marks[s] = min(int(self.marks[s]), p)

    def clear(self) -> None:
        self.marks[:] = POS_CLEAN
        self.version += 1

    def restore(self, marks: np.ndarray) -> None:
        """Put back marks taken with :meth:`copy` (undo)."""
        self.marks[:] = marks
        self.version += 1

    def is_clean(self, s: int) -> bool:
        return bool(self.marks[s] == POS_CLEAN)

    def copy(self) -> np.ndarray:
        return self.marks.copy()


def stale_pos(s: int, p0: int, pos_min_before: int) -> int:
    """Where an edit starting at ``p0`` stales ``s`` (evaluated before the edit):
    0 when it reaches the sequence's first position (re-aligning every pool)."""
    return 0 if s < 0 or p0 <= pos_min_before else int(p0)


@dataclasses.dataclass
class KPoolState:
    """What the current ubatch must pool (docs/memory-semantics.md#kpool-new)."""

    n_pool_real: int
    n_kpool: int
    is_new: np.ndarray  # bool [n_pool_real], by global pool index ip
    n_new: int
    n_new_g: int


@dataclasses.dataclass
class KPoolInputs:
    """The graph inputs (docs/memory-semantics.md#kpool-inputs), NumPy C order (see module docstring)."""

    pool_cells: np.ndarray  # int32 (n_pool,)
    pool_idxs: np.ndarray  # int32 (n_pool, kpool)
    pool_mask: np.ndarray  # float32 (n_tokens, n_pool)
    tail_idxs: np.ndarray  # int32 (n_tokens, kpool - 1)
    new_pool_idxs: np.ndarray  # int32 (n_new_g, kpool)
    new_pool_rep: np.ndarray  # int64 (n_new_g,)
    sel_mask: np.ndarray | None = None  # float32 (n_tokens, n_sel)
    new_pool_pos: np.ndarray | None = None  # int32 (4 * n_new_g,), section-major


class Token(NamedTuple):
    """A ubatch token as the k-pool needs it: position, sequence ids (the
    first is the primary one), its own stream-local cell.  A named tuple: one
    is made per token and ubatch (256 a decode step at 256 sequences)."""

    pos: int
    seqs: tuple[int, ...]
    cell: int


class LayoutMark(NamedTuple):
    """:meth:`KPoolLayout.mark`: each sequence's layout object and the lengths and scan
    state it had (lists indexed by sequence)."""

    layouts: list[SeqLayout]
    n_cells: list[int] | np.ndarray
    n_pools: list[int] | np.ndarray
    j_next: list[int] | np.ndarray
    src_stamp: list[int] | np.ndarray


class _DecodeArrays:
    """What a decode step reads of every layout, as arrays indexed by sequence: kept equal
    to the :class:`SeqLayout` objects by :meth:`KPoolLayout._update_live` (the decode path
    changes both), refreshed row by row where the general path of :meth:`KPoolLayout.update`
    changed a layout, dropped when anything else replaces or cuts layouts (``seqs`` set,
    :meth:`KPoolLayout.restore`) and made again from the objects at the next update."""

    __slots__ = ("j_next", "last_first", "last_last", "last_rep", "n_cells", "n_pools", "pos_min", "src", "strm")

    def __init__(self, seqs: Sequence[SeqLayout], kpool: int) -> None:
        n = len(seqs)
        self.n_cells = np.zeros(n, dtype=np.int64)
        self.src = np.zeros(n, dtype=np.int64)
        self.strm = np.zeros(n, dtype=np.int64)
        self.pos_min = np.zeros(n, dtype=np.int64)
        self.j_next = np.zeros(n, dtype=np.int64)
        self.n_pools = np.zeros(n, dtype=np.int64)
        #: the last pool's first and last position and its rep's stream-local cell (-1: no pool)
        self.last_first = np.full(n, -1, dtype=np.int64)
        self.last_last = np.full(n, -1, dtype=np.int64)
        self.last_rep = np.full(n, -1, dtype=np.int64)
        self.refresh(seqs, range(n), kpool)

    def refresh(self, seqs: Sequence[SeqLayout], rows: Iterable[int], kpool: int) -> None:
        """Read the rows ``rows`` again from their layouts (O(rows))."""
        for s in rows:
            x = seqs[s]
            self.n_cells[s], self.src[s], self.strm[s] = len(x.cells), x.src_stamp, x.strm
            self.pos_min[s], self.j_next[s], self.n_pools[s] = x.pos_min, x.j_next, len(x.pools)
            if x.pools:
                j = x.pools[-1]
                self.last_first[s], (self.last_last[s], self.last_rep[s]) = x.cells[j][0], x.cells[j + kpool - 1]
            else:
                self.last_first[s] = self.last_last[s] = self.last_rep[s] = -1

    def equals(self, other: _DecodeArrays) -> bool:
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in self.__slots__)


class KPoolLayout:
    """Layouts of every sequence, updated at each ``apply()`` (docs/memory-semantics.md#kpool-layout)."""

    def __init__(self, kpool: int, by_order: bool, n_seq_max: int, kv_size: int, n_stream: int) -> None:
        if kpool <= 1:
            raise ArgumentError("kpool", f"must be > 1, got {kpool}")
        if n_stream not in (1, n_seq_max):
            raise ArgumentError("n_stream", f"must be 1 or n_seq_max ({n_seq_max}), got {n_stream}")
        self.kpool = int(kpool)
        self.by_order = bool(by_order)
        self.n_seq_max = int(n_seq_max)
        self.kv_size = int(kv_size)
        self.n_stream = int(n_stream)
        self.seqs = [SeqLayout() for _ in range(self.n_seq_max)]

    @property
    def seqs(self) -> list[SeqLayout]:
        """Each sequence's layout (replace the list, never a layout in place, from outside)."""
        return self._seqs

    @seqs.setter
    def seqs(self, layouts: list[SeqLayout]) -> None:
        self._seqs = layouts
        self._fast: _DecodeArrays | None = None

    def _arrays(self) -> _DecodeArrays:
        if self._fast is None:
            self._fast = _DecodeArrays(self._seqs, self.kpool)
        return self._fast

    def check(self) -> None:
        """Raise :class:`InvariantError` unless the decode arrays (when made) equal the layouts."""
        if self._fast is not None and not self._fast.equals(_DecodeArrays(self._seqs, self.kpool)):
            raise InvariantError("kpool-arrays", "the decode arrays of the k-pool layout are out of step")

    @property
    def n_pool_max(self) -> int:
        return (self.kv_size // self.kpool) * self.n_seq_max

    def g(self, s: int, cell: int) -> int:
        return self.seqs[s].strm * self.kv_size + cell

    def pool_counts(self) -> list[int]:
        """Pools per sequence."""
        if self._fast is not None:
            return self._fast.n_pools.tolist()
        return list(map(len, map(_POOLS, self.seqs)))

    def pool_start(self) -> list[int]:
        """Global index of each sequence's first pool (sequences in order)."""
        return [0, *itertools.accumulate(self.pool_counts())][:-1]

    @property
    def n_pool_real(self) -> int:
        return sum(self.pool_counts())

    def members(self, s: int, k: int) -> list[tuple[int, int]]:
        layout = self.seqs[s]
        j = layout.pools[k]
        return layout.cells[j : j + self.kpool]

    def update(
        self,
        pairs_of: Callable[[int], tuple[int, Sequence[tuple[int, int]] | SeqCells]],
        marks: StaleMarks,
        live: Sequence[SeqCells] | None = None,
    ) -> dict[int, int]:
        """Bring every layout up to date with the cells (append-only when clean).

        ``live``, when given, are the live pairs of every sequence (what ``pairs_of`` returns,
        in the stream the layout was built from): a clean sequence whose pairs still have the
        stamp and length its layout was made from is unchanged, and is skipped without a call.

        Returns extra stale positions: a clean sequence whose cells changed
        other than by a suffix append (docs/memory-semantics.md#kpool-hazards H1, e.g. a token inserted
        below cached ones) is rebuilt *and* re-pooled from the first entry
        that differs, where upstream would rebuild without re-pooling.
        """
        forced: dict[int, int] = {}
        todo: Sequence[int] = range(self.n_seq_max)
        clean_arr = marks.marks == POS_CLEAN
        kp = self.kpool
        if live is not None:
            todo = self._update_live(live, clean_arr)
        else:
            self._fast = None
        clean_all = clean_arr.tolist() if todo else []
        for s in todo:
            strm, sp = pairs_of(s)
            layout = self.seqs[s]
            old = layout.cells
            clean = clean_all[s]
            stamp = sp.stamp if isinstance(sp, SeqCells) else 0
            n_old, n_now = len(old), len(sp)
            if (
                clean
                and n_old
                and stamp
                and stamp == layout.src_stamp
                and strm == layout.strm
                and n_now >= n_old  # fewer pairs under the stamp: appends it saw were rolled back
            ):
                # the pairs it was built from are still the first ones: read only the appended
                # ones (O(new pairs), where comparing the whole list cost the context)
                if n_now > n_old:
                    if n_now == n_old + 1:  # a decode token
                        old.append(sp[n_old])
                    else:
                        old.extend(sp.pairs_from(n_old))  # type: ignore[union-attr]  # a stamp: SeqCells
                    if layout.j_next + kp <= n_now:  # a pool may be complete
                        scan_pools(layout, kp, self.by_order)
                continue
            if clean and old and sp and layout.pos_min == sp[0][0] and strm == layout.strm:
                cut = bisect.bisect_right(sp, old[-1])
                if sp[:cut] == old:
                    old.extend(sp[cut:])
                    scan_pools(layout, self.kpool, self.by_order)
                    layout.src_stamp = stamp
                    continue
            if clean and old:
                first_diff = next((k for k in range(min(len(old), len(sp))) if old[k] != sp[k]), min(len(old), len(sp)))
                candidates = [x[first_diff][0] for x in (old, sp) if first_diff < len(x)]
                if candidates:
                    forced[s] = max(0, min(candidates))
            self.seqs[s] = rebuild(sp, strm, self.kpool, self.by_order)
            self.seqs[s].src_stamp = stamp
        if self._fast is not None and todo:
            self._fast.refresh(self._seqs, todo, kp)
        return forced

    def _update_live(self, live: Sequence[SeqCells], clean_all: np.ndarray) -> list[int]:
        """:meth:`update` of the sequences whose pairs did not change (skipped) or, under the
        stamp the layout was made from, gained one pair at the end (a decode token: appended
        from the last key); returns the others, for the general path.  ``live[s]`` is in
        stream ``s`` with one stream per sequence, else in stream 0.

        No Python call per sequence (256 a decode step): the sequences' counts, stamps and
        last keys are arrays (read whole from the stream's :class:`SeqPairBook` when ``live``
        is one), the layouts' fields are read and written by C-level ``map``, and the pool a
        decode token may complete is checked for all of them at once (:meth:`_close_pools`)."""
        seqs, n_seq, fast = self._seqs, self.n_seq_max, self._arrays()
        if isinstance(live, SeqPairBook):  # one stream: its arrays, read whole
            stamps, counts, lasts = live.stamps[:n_seq], live.n[:n_seq], live.last_keys()[:n_seq]
        else:
            stamps = np.fromiter((sc.stamp for sc in live), dtype=np.int64, count=n_seq)
            counts = np.fromiter(map(len, live), dtype=np.int64, count=n_seq)
            lasts = np.fromiter((sc.last_key for sc in live), dtype=np.int64, count=n_seq)
        n_old = fast.n_cells
        own_strm = 0 if self.n_stream == 1 else np.arange(n_seq)
        ok = clean_all & (n_old > 0) & (stamps == fast.src)
        # a sequence that holds nothing and whose layout is empty in its stream: nothing to do
        idle = (counts == 0) & (n_old == 0) & (fast.n_pools == 0) & (fast.j_next == 0) & (fast.pos_min == 0)
        same = (ok & (counts == n_old)) | (idle & (fast.strm == own_strm))
        grew = ok & (counts == n_old + 1) & (fast.strm == own_strm)
        rows = np.flatnonzero(grew)
        if rows.size:
            k = lasts[rows]
            pairs = zip((k >> _CELL_BITS).tolist(), (k & _CELL_MASK).tolist(), strict=True)
            _consume(map(list.append, map(_CELLS, _pick(seqs, rows)), pairs))
            n_old[rows] += 1
            j_next = fast.j_next[rows]
            may = j_next + self.kpool <= counts[rows]  # a pool may be complete
            if may.any():
                self._close_pools(rows[may], j_next[may], counts[rows[may]], live)
        return np.flatnonzero(~(same | grew)).tolist()

    def _close_pools(self, rows: np.ndarray, j_next: np.ndarray, counts: np.ndarray, live: Sequence[SeqCells]) -> None:
        """:func:`scan_pools` of the layouts ``rows`` after one appended pair: the scan left
        ``j_next + kpool`` past the old count, so with one pair more the only candidate pool
        starts at ``j_next`` and ends at the new last pair; checked for all rows at once from
        the live keys (equal to the layouts' pairs under their stamps), else row by row."""
        kp, seqs = self.kpool, self._seqs
        if isinstance(live, SeqPairBook) and (j_next + kp == counts).all():
            fast = self._arrays()
            keys = live.arena[live.start[rows][:, None] + j_next[:, None] + np.arange(kp)]
            if self.by_order:
                good = np.ones(rows.size, dtype=bool)
            else:
                pos = keys >> _CELL_BITS
                aligned = (pos[:, 0] - fast.pos_min[rows]) % kp == 0
                good = aligned & (pos == pos[:, :1] + np.arange(kp)).all(axis=1)
            if good.any():
                g_rows, g_keys = rows[good], keys[good]
                _consume(map(list.append, map(_POOLS, _pick(seqs, g_rows)), j_next[good].tolist()))
                fast.n_pools[g_rows] += 1
                fast.last_first[g_rows] = g_keys[:, 0] >> _CELL_BITS
                fast.last_last[g_rows] = g_keys[:, -1] >> _CELL_BITS
                fast.last_rep[g_rows] = g_keys[:, -1] & _CELL_MASK
            # a pool: the scan goes on after it; none: the scan moves one pair on (scan_pools' steps)
            fast.j_next[rows] = np.where(good, j_next + kp, j_next + 1)
            _consume(map(setattr, _pick(seqs, rows), itertools.repeat("j_next"), fast.j_next[rows].tolist()))
            return
        for s in rows.tolist():
            scan_pools(seqs[s], kp, self.by_order)
        if self._fast is not None:
            self._fast.refresh(seqs, rows.tolist(), kp)

    def mark(self) -> LayoutMark:
        """A mark of every layout, O(sequences): :meth:`update` only appends to a layout
        in place (or replaces it), so the object and its lengths describe it exactly.
        Kept as one list per field (made by C-level ``map``: no tuple per sequence)."""
        seqs = list(self._seqs)
        fast = self._fast
        if fast is not None:  # the decode arrays: copies, no pass over the layouts
            return LayoutMark(seqs, fast.n_cells.copy(), fast.n_pools.copy(), fast.j_next.copy(), fast.src.copy())
        return LayoutMark(
            seqs,
            list(map(len, map(_CELLS, seqs))),
            list(map(len, map(_POOLS, seqs))),
            list(map(_J_NEXT, seqs)),
            list(map(_SRC_STAMP, seqs)),
        )

    def restore(self, mark: LayoutMark) -> None:
        """Put every layout back as it was at :meth:`mark` (undo)."""
        fields = [np.asarray(f).tolist() for f in mark[1:]]
        for x, n_cells, n_pools, j_next, stamp in zip(mark.layouts, *fields, strict=True):
            x.truncate(n_cells, n_pools, j_next, stamp)
        self.seqs = list(mark.layouts)

    # -- per-ubatch state (docs/memory-semantics.md#kpool-new) -----------------
    def _rank(self, s: int, pos: int, cell: int) -> int:
        cells = self.seqs[s].cells
        r = bisect.bisect_left(cells, (pos, cell))
        if r >= len(cells) or cells[r] != (pos, cell):
            raise AssertionError(f"token at pos {pos} cell {cell} not in the layout of seq {s}")
        return r

    def _pool_of_pos(self, s: int, pos: int) -> int:
        """Position mode: the pool holding ``pos``, or -1."""
        layout = self.seqs[s]
        cells, pools = layout.cells, layout.pools
        if pools and cells[pools[-1]][0] <= pos:  # a decode token: the last pool or none
            k = len(pools) - 1
        else:
            k = bisect.bisect_right(pools, pos, key=lambda j: cells[j][0]) - 1  # O(log pools)
        if k < 0:
            return -1
        last = layout.cells[layout.pools[k] + self.kpool - 1][0]
        return k if pos <= last else -1

    def build_state(
        self,
        tokens: Sequence[Token],
        stale_batch: np.ndarray | None,
        n_seqs_unq: int,
        *,
        forced: dict[int, int] | None = None,
        reserve: bool = False,
        one_seq: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> KPoolState:
        """Which pools are new this ubatch.  ``stale_batch`` is the copy of the
        marks taken when the batch was planned, given only for its first ubatch;
        ``forced`` are the extra marks returned by :meth:`update`.  ``one_seq``: the
        tokens' positions and sequences as arrays when each token has one sequence (a
        decode ubatch is then read without touching ``tokens``, which may be lazy)."""
        counts = self.pool_counts()
        starts = [0, *itertools.accumulate(counts)]
        n_real = starts.pop()
        if reserve:
            n_real_r = max(n_real, self.n_pool_max)
            return KPoolState(n_real_r, kpool_pad(n_real_r), np.ones(n_real, dtype=bool), n_real_r, max(n_real_r, 1))
        is_new = np.zeros(n_real, dtype=bool)
        seen_reps: set[int] = set()

        def mark(s: int, k: int) -> None:
            layout = self.seqs[s]
            rep = self.g(s, layout.cells[layout.pools[k] + self.kpool - 1][1])
            if rep not in seen_reps:  # shared pools (same rep row) are pooled once
                seen_reps.add(rep)
                is_new[starts[s] + k] = True

        stale = np.full(self.n_seq_max, POS_CLEAN, dtype=np.int64) if stale_batch is None else stale_batch.copy()
        for s, p in (forced or {}).items():
            stale[s] = min(int(stale[s]), p)
        for s in np.flatnonzero(stale != POS_CLEAN).tolist():
            last_pos = self.seqs[s].pool_table(self.kpool)[2]
            for k in np.flatnonzero(last_pos >= stale[s]).tolist():  # the pools from the mark on
                mark(s, k)
        kp, seqs = self.kpool, self.seqs
        decoded = False
        if not self.by_order and len(tokens):
            if one_seq is None:
                tok_seqs = list(map(_TOK_SEQS, tokens))
                if all(map((1).__eq__, map(len, tok_seqs))):
                    pos_a = np.fromiter(map(_TOK_POS, tokens), dtype=np.int64, count=len(tokens))
                    one_seq = (pos_a, np.fromiter(map(_FIRST, tok_seqs), dtype=np.int64, count=len(tokens)))
            if one_seq is not None:
                decoded = self._mark_decode_tokens(one_seq[0], one_seq[1], counts, starts, is_new, seen_reps)
        for tok in () if decoded else tokens:
            for s in tok.seqs:
                if self.by_order:
                    r = self._rank(s, tok.pos, tok.cell)
                    if r // kp < len(seqs[s].pools):
                        mark(s, r // kp)
                    continue
                layout = seqs[s]
                cells, pools = layout.cells, layout.pools
                if pools and cells[pools[-1]][0] <= tok.pos:
                    # a decode token: its pool is the last one or none (_pool_of_pos, inlined:
                    # once per token of the batch)
                    if tok.pos <= cells[pools[-1] + kp - 1][0]:
                        mark(s, len(pools) - 1)
                    continue
                k = self._pool_of_pos(s, tok.pos)
                if k >= 0:
                    mark(s, k)
        n_new = int(is_new.sum())
        bound = len(tokens) // self.kpool + n_seqs_unq
        n_new_g = max(n_new, 1, min(bound, kpool_pad(n_real) - 1, self.n_pool_max))
        return KPoolState(n_real, kpool_pad(n_real), is_new, n_new, n_new_g)

    def _mark_decode_tokens(
        self,
        pos: np.ndarray,
        ts: np.ndarray,
        counts: list[int],
        starts: list[int],
        is_new: np.ndarray,
        seen_reps: set[int],
    ) -> bool:
        """The token loop of :meth:`build_state` (position mode) for a ubatch of decode tokens
        at positions ``pos`` of sequences ``ts`` (one each), none before its sequence's last
        pool, read for all of them at once: each token's pool is its sequence's last one or
        none.  False (nothing marked) when some token is not such a token: the loop then
        takes every token."""
        pos, ts = np.asarray(pos, dtype=np.int64), np.asarray(ts, dtype=np.int64)
        fast = self._arrays()
        n_pools = fast.n_pools[ts]
        has = n_pools > 0
        if (has & (pos < fast.last_first[ts])).any():
            return False  # a token before its last pool (a prefill or an insert): the loop
        tok = np.flatnonzero(has & (pos <= fast.last_last[ts]))  # tokens whose pool is their last (about 1 in kpool)
        if not tok.size:
            return True
        # build_state's mark() of each, at once: the pool's rep row, claimed by its first claimer
        reps = fast.strm[ts[tok]] * self.kv_size + fast.last_rep[ts[tok]]
        _, first = np.unique(reps, return_index=True)
        first.sort()  # token order
        fresh = [k for k in first.tolist() if int(reps[k]) not in seen_reps] if seen_reps else first.tolist()
        seen_reps.update(reps[fresh].tolist())
        at = np.asarray(starts, dtype=np.int64)[ts[tok[fresh]]] + n_pools[tok[fresh]] - 1
        is_new[at] = True
        return True

    # -- graph inputs (docs/memory-semantics.md#kpool-inputs) -------------------------
    def build_inputs(
        self,
        state: KPoolState,
        tokens: Sequence[Token],
        n_kv: int,
        *,
        n_sel: int | None = None,
        with_pos: bool = False,
        ext_of: Callable[[int, int], tuple[int, int]] | None = None,
    ) -> KPoolInputs:
        """Fill the inputs.  ``ext_of(stream, cell)`` gives a cell's stored 2-D
        position (for ``new_pool_pos``); ``n_sel`` enables ``sel_mask``."""
        if not tokens:
            raise ArgumentError("tokens", "a ubatch has at least one token")
        kp = self.kpool
        S = int(n_kv)
        n_pool = state.n_kpool
        seqs_in_ub = {s for tok in tokens for s in tok.seqs}
        first = tokens[0]
        s0 = first.seqs[0]
        dummy_cell = self.seqs[s0].first_cell_at(first.pos)
        if dummy_cell < 0:
            raise AssertionError(f"no cell of seq {s0} at pos {first.pos} for the padded pools")

        # Every pool of every sequence, in global order (sequence, then pool): the per-sequence
        # tables grow by the pools added since the last step, and are joined with NumPy copies
        # (no Python work per pool of the context).
        tables = [layout.pool_table(kp) for layout in self.seqs]
        counts = np.fromiter((len(layout.pools) for layout in self.seqs), dtype=np.int64, count=len(self.seqs))
        starts = np.zeros(len(self.seqs), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        n_real = int(counts.sum())
        assert state.is_new.shape == (n_real,), "the k-pool state was built for another layout"
        assert n_real < n_pool, "the last padded pool must never be real"
        local = np.concatenate([t[0] for t in tables]) if n_real else np.zeros((0, kp), dtype=np.int64)
        strms = np.fromiter((layout.strm for layout in self.seqs), dtype=np.int64, count=len(self.seqs))
        offset = np.repeat(strms * self.kv_size, counts)  # stream-local cell -> global row
        reps = local[:, -1] + offset

        pool_cells = np.full(n_pool, self.g(s0, dummy_cell), dtype=np.int32)
        pool_cells[:n_real] = reps
        pool_idxs = np.full((n_pool, kp), S, dtype=np.int32)
        if self.n_stream > 1:  # another stream's pools are inert: only the ubatch's sequences are indexed
            active = np.zeros(len(self.seqs), dtype=bool)
            active[sorted(seqs_in_ub)] = True
            rows = np.repeat(active, counts)
            pool_idxs[:n_real][rows] = local[rows]
        else:
            pool_idxs[:n_real] = local
        new = np.flatnonzero(state.is_new)
        assert new.size == state.n_new
        new_rows = local[new] + offset[new, None]
        new_reps = reps[new]

        n_tok = len(tokens)
        pool_mask = np.full((n_tok, n_pool), -np.inf, dtype=np.float32)
        tail_idxs = np.full((n_tok, kp - 1), S, dtype=np.int32)
        nvs = np.zeros(n_tok, dtype=np.int64)
        for i, tok in enumerate(tokens):  # O(log cells) per token
            s = tok.seqs[0]
            layout = self.seqs[s]
            if self.by_order:
                r = self._rank(s, tok.pos, tok.cell)
                nv = min(len(layout.pools), (r + 1) // kp)
                n_tail = (r + 1) % kp
                for k in range(min(n_tail, kp - 1)):
                    tail_idxs[i, k] = layout.cells[r - k][1]
            else:
                last_pos = tables[s][2]
                if last_pos.size and last_pos[-1] <= tok.pos:  # a decode token: every pool is visible
                    nv = int(last_pos.size)
                else:
                    nv = int(np.searchsorted(last_pos, tok.pos, side="right"))  # pools ending at or before pos
                n_tail = (tok.pos - layout.pos_min + 1) % kp
                for k in range(min(n_tail, kp - 1)):
                    c = layout.first_cell_at(tok.pos - k)
                    if c >= 0:
                        tail_idxs[i, k] = c
            st = int(starts[s])
            pool_mask[i, st : st + nv] = 0.0
            nvs[i] = nv

        # Pad scatter rows: distinct rows that are never a current rep (the lowest such rows:
        # among the first n_pad + n_real rows at least n_pad are free of reps).
        n_pad_new = state.n_new_g - state.n_new
        taken = np.zeros(n_pad_new + n_real, dtype=bool)
        taken[reps[reps < taken.size]] = True
        pads = np.flatnonzero(~taken)[:n_pad_new]
        assert (pads < self.kv_size * self.n_stream).all()
        new_pool_idxs = np.concatenate([new_rows, np.repeat(pads[:, None], kp, axis=1)]).astype(np.int32)
        new_pool_rep = np.concatenate([new_reps, pads]).astype(np.int64)

        sel_mask = None
        if n_sel is not None:
            if n_sel % kp not in (0, kp - 1):
                raise ArgumentError("n_sel", f"n_sel % kpool must be 0 or kpool-1, got {n_sel} with kpool {kp}")
            n_top = n_sel // kp
            sel_mask = np.full((n_tok, n_sel), -np.inf, dtype=np.float32)
            for i in range(n_tok):
                sel_mask[i, : kp * min(int(nvs[i]), n_top)] = 0.0
                if n_sel % kp == kp - 1:
                    sel_mask[i, kp * n_top :] = np.where(tail_idxs[i] != S, 0.0, -np.inf)

        new_pool_pos = None
        if with_pos:
            ng = state.n_new_g
            new_pool_pos = np.zeros(4 * ng, dtype=np.int32)
            new_first_pos = np.concatenate([t[1] for t in tables])[new] if n_real else new
            new_strm = np.repeat(strms, counts)[new]
            for e, (p, strm, c) in enumerate(zip(new_first_pos.tolist(), new_strm.tolist(), local[new, 0].tolist())):
                x, y = ext_of(strm, c) if ext_of is not None else (0, 0)
                new_pool_pos[e] = p
                new_pool_pos[ng + e] = y
                new_pool_pos[2 * ng + e] = x
                new_pool_pos[3 * ng + e] = p
        return KPoolInputs(
            pool_cells, pool_idxs, pool_mask, tail_idxs, new_pool_idxs, new_pool_rep, sel_mask, new_pool_pos
        )
