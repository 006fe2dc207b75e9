"""The attention KV cell book of one stream (docs/memory-semantics.md#kv-cells).

Per cell: a position (``-1`` = empty), a 2-D position extension ``(x, y)``
for M-RoPE ties, an accumulated pending shift (for the runtime's RoPE
re-rotation), and the set of sequences holding the cell.  Per sequence: the
ordered ``(pos, cell)`` pairs it holds (:class:`SeqCells`, a view of its run in
the stream's :class:`SeqPairBook`, one arena for every sequence), so
that ``seq_pos_min`` and ``seq_pos_max`` are O(1), the cells a token attends
are one slice, and the k-pool layout (docs/memory-semantics.md#kpool-layout)
can read a sequence's cells in order without scanning the stream.

What a decode step costs must not grow with the context the book holds
(docs/memory-semantics.md#kv-cost), so besides the cells the book keeps:

* free cells per block of :data:`BLOCK` cells, so the slot search skips
  occupied runs a block (and 256 blocks per NumPy call) at a time;
* the number of sequences of each cell (``n_owner``) and one past the highest
  used cell (``used_max_p1``), kept as cells change;
* an optional :class:`CellJournal`: while one is attached, every mutation
  first saves the before-image of the cell it touches, and
  :meth:`KVCells.rollback` puts exactly those cells back.  Plans and undo use
  it instead of copying the book (O(cells touched), not O(cells)).

Everything here is host-side bookkeeping; no device buffer is touched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

import numpy as np

from statecache.errors import ArgumentError, InvariantError

EMPTY = -1

#: Cells per block of the free counts (a power of two).
BLOCK_SHIFT = 6
BLOCK = 1 << BLOCK_SHIFT
#: Blocks examined per NumPy call when skipping full (or empty) blocks.
_BLOCK_WINDOW = 256
#: Pairs of each sequence read together by :meth:`KVCells.oldest_alone_many`.
_HEAD = 8
_HEAD_J = np.arange(_HEAD, dtype=np.int64)

#: A pair ``(pos, cell)`` is stored as one int64 key ``pos << 32 | cell``, so sorting the
#: keys sorts by position then cell (positions are int32 >= 0 in a book, cells < 2**32).
_CELL_BITS = 32
_CELL_MASK = (1 << _CELL_BITS) - 1
_POS_END = 1 << 31  # one past the largest position

#: Pair capacity a sequence's row starts with in a :class:`SeqPairBook` arena.
_ROW_CAP0 = 8


class _StampClock:
    """Stamps of sequence contents: a new, never reused value at every change that is not
    an append at the end, so a reader that saw stamp ``t`` and ``n`` pairs knows that,
    while the stamp is still ``t``, those ``n`` pairs are unchanged.  Handed out one at a
    time or as a block (a decode step that changes 256 sequences at once)."""

    next = 1

    @classmethod
    def one(cls) -> int:
        v = cls.next
        cls.next = v + 1
        return v

    @classmethod
    def block(cls, m: int) -> np.ndarray:
        v = cls.next
        cls.next = v + m
        return np.arange(v, v + m, dtype=np.int64)


_NO_KEYS = np.zeros(0, dtype=np.int64)


def _key(p: int, c: int) -> int:
    return (p << _CELL_BITS) | c


def _pos_key(p: int) -> int:
    """The smallest key at position ``p`` (clamped to the int32 range)."""
    return min(max(p, 0), _POS_END) << _CELL_BITS


#: The smallest key (``pos << 32 | cell``) at a position, for a caller that reads the pair arena.
pos_key = _pos_key


class SeqPairBook(Sequence["SeqCells"]):
    """The ``(pos, cell)`` pairs of every sequence of one stream, each sequence's sorted by
    position then cell, as int64 keys (``pos << 32 | cell``) in one shared arena.

    Sequence ``s`` holds ``arena[start[s] : start[s] + n[s]]``, inside its own reserved
    segment ``[base[s], end[s])``; segments never overlap.  Because every sequence's
    bounds are rows of NumPy arrays, the edits a decode step makes to all its sequences
    at once (one appended pair each, a window cache's oldest pair of each dropped) are a
    few vectorised operations (:meth:`append_keys`, :meth:`remove_keys`), not a Python
    call per sequence.  Dropping the oldest pair moves ``start`` (no copy) and leaves
    room in front, so taking that drop back (a rolled-back plan) is O(1) too.  A row that
    runs out of room at its end is moved to its segment's start when it fills at most half
    of it, else to a new segment twice its size at the arena's top; the arena is repacked
    when its top is reached (both amortised O(1) per pair).

    ``book[s]`` is sequence ``s``'s :class:`SeqCells` (a view that reads the arrays).

    The arena keeps at least :data:`_HEAD` slots past the top segment, so that any row's
    first ``_HEAD`` slots, and the slot before and at its start, can be read by one gather
    with no clipping (a read past a row's pairs is masked by its count).
    """

    __slots__ = ("_rows", "_top", "arena", "base", "end", "n", "stamps", "start")

    def __init__(self, n_rows: int) -> None:
        self.arena = np.empty(max(64, 2 * _ROW_CAP0 * n_rows) + _HEAD, dtype=np.int64)
        self.base = np.arange(n_rows, dtype=np.int64) * _ROW_CAP0
        self.start = self.base.copy()
        self.end = self.base + _ROW_CAP0
        self.n = np.zeros(n_rows, dtype=np.int64)
        #: per sequence, its stamp (:class:`_StampClock`)
        self.stamps = _StampClock.block(n_rows)
        self._top = n_rows * _ROW_CAP0
        self._rows = [SeqCells(self, s) for s in range(n_rows)]

    # -- the rows ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[SeqCells]:
        return iter(self._rows)

    @overload
    def __getitem__(self, s: int) -> SeqCells: ...

    @overload
    def __getitem__(self, s: slice) -> list[SeqCells]: ...

    def __getitem__(self, s: int | slice) -> SeqCells | list[SeqCells]:
        return self._rows[s]

    def copy(self) -> SeqPairBook:
        """An independent book with the same pairs (and stamps), packed."""
        out = SeqPairBook.__new__(SeqPairBook)
        n_rows = len(self._rows)
        out.n = self.n.copy()
        out.stamps = self.stamps.copy()
        caps = np.maximum(_ROW_CAP0, 2 * out.n)
        out.base = np.zeros(n_rows, dtype=np.int64)
        np.cumsum(caps[:-1], out=out.base[1:])
        out.start = out.base.copy()
        out.end = out.base + caps
        out._top = int(caps.sum())
        out.arena = np.empty(max(64, 2 * out._top) + _HEAD, dtype=np.int64)
        src, dst = self._ranges(self.start, self.n), self._ranges(out.start, out.n)
        out.arena[dst] = self.arena[src]
        out._rows = [SeqCells(out, s) for s in range(n_rows)]
        return out

    @staticmethod
    def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The arena indices of every row's pairs, rows in order (one gather, no loop)."""
        total = int(counts.sum())
        if not total:
            return _NO_KEYS
        offs = np.repeat(starts - np.cumsum(counts) + counts, counts)
        return offs + np.arange(total, dtype=np.int64)

    def clear(self) -> None:
        """Every sequence holds nothing (new stamps); the arena is kept."""
        self.start[:] = self.base
        self.n[:] = 0
        self.stamps[:] = _StampClock.block(len(self._rows))

    def keys_of(self, s: int) -> np.ndarray:
        st = int(self.start[s])
        return self.arena[st : st + int(self.n[s])]

    def first_keys(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The first key of each of ``rows`` (all when None), -1 for an empty one."""
        st, n = (self.start, self.n) if rows is None else (self.start[rows], self.n[rows])
        return np.where(n > 0, self.arena[st], -1)  # (a start is below the arena's end: no clip)

    def last_keys(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The last key of each of ``rows`` (all when None), -1 for an empty one."""
        st, n = (self.start, self.n) if rows is None else (self.start[rows], self.n[rows])
        return np.where(n > 0, self.arena[st + n - 1], -1)  # (an empty row at 0 reads slot -1: masked)

    def first_positions(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``first_pos()`` of each of ``rows`` (all when None; -1: holds nothing)."""
        return self.first_keys(rows) >> _CELL_BITS  # an arithmetic shift: -1 stays -1

    def last_positions(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``last_pos()`` of each of ``rows`` (all when None; -1: holds nothing)."""
        return self.last_keys(rows) >> _CELL_BITS

    def check(self) -> None:
        """Raise :class:`InvariantError` unless every row lies in its segment and no two overlap."""
        if ((self.base > self.start) | (self.start + self.n > self.end) | (self.end > self._top)).any():
            raise InvariantError("kv-seq-pos", "a sequence's pairs lie outside its segment")
        if self._top + _HEAD > self.arena.size:
            raise InvariantError("kv-seq-pos", f"the segments leave fewer than {_HEAD} slots at the arena's end")
        order = np.argsort(self.base, kind="stable")
        if (self.end[order][:-1] > self.base[order][1:]).any():
            raise InvariantError("kv-seq-pos", "two sequences' segments overlap")

    # -- room -----------------------------------------------------------------------------------
    def _room(self, s: int, extra: int) -> int:
        """Make room for ``extra`` more pairs after row ``s``'s last; returns its start."""
        st, n, end = int(self.start[s]), int(self.n[s]), int(self.end[s])
        if st + n + extra <= end:
            return st
        base = int(self.base[s])
        if n + extra <= (end - base) // 2:  # the row drifted to its segment's end: back to the start
            self.arena[base : base + n] = self.arena[st : st + n]  # NumPy copies overlapping slices correctly
            self.start[s] = base
            return base
        cap = max(_ROW_CAP0, 2 * (n + extra))
        if self._top + cap + _HEAD > self.arena.size:  # (the slack of the class docstring)
            self._repack(s, cap)
        else:
            top = self._top
            self.arena[top : top + n] = self.arena[st : st + n]
            self.base[s] = self.start[s] = top
            self.end[s] = top + cap
            self._top = top + cap
        return int(self.start[s])

    def _repack(self, s: int, cap_s: int) -> None:
        """A new arena with every row packed at the start of a segment of twice its pairs
        (row ``s``: ``cap_s``), the arena twice their total: O(pairs), once per doubling."""
        caps = np.maximum(_ROW_CAP0, 2 * self.n)
        caps[s] = max(int(caps[s]), cap_s)
        base = np.zeros(len(self._rows), dtype=np.int64)
        np.cumsum(caps[:-1], out=base[1:])
        top = int(caps.sum())
        arena = np.empty(max(64, 2 * top) + _HEAD, dtype=np.int64)
        arena[self._ranges(base, self.n)] = self.arena[self._ranges(self.start, self.n)]
        self.arena, self.base, self.start, self.end, self._top = arena, base, base.copy(), base + caps, top

    # -- edits of one row -----------------------------------------------------------------------
    def add_key(self, s: int, k: int) -> None:
        n = int(self.n[s])
        st = int(self.start[s])
        arena = self.arena
        if n == 0 or k > int(arena[st + n - 1]):
            st = self._room(s, 1)
            self.arena[st + n] = k
        elif k < int(arena[st]) and st > int(self.base[s]):  # before the first, with room in front
            arena[st - 1] = k
            self.start[s] = st - 1
            self.stamps[s] = _StampClock.one()
        else:
            st = self._room(s, 1)
            arena = self.arena
            i = st + int(np.searchsorted(arena[st : st + n], k))
            arena[i + 1 : st + n + 1] = arena[i : st + n]
            arena[i] = k
            self.stamps[s] = _StampClock.one()
        self.n[s] = n + 1

    def add_many(self, s: int, keys_sorted: np.ndarray) -> None:
        m = int(keys_sorted.size)
        if not m:
            return
        n = int(self.n[s])
        st = self._room(s, m)
        arena = self.arena
        if n == 0 or keys_sorted[0] > arena[st + n - 1]:
            arena[st + n : st + n + m] = keys_sorted
        else:
            merged = np.concatenate([arena[st : st + n], keys_sorted])
            merged.sort(kind="stable")
            arena[st : st + n + m] = merged
            self.stamps[s] = _StampClock.one()
        self.n[s] = n + m

    def remove_key(self, s: int, k: int) -> None:
        n, st = int(self.n[s]), int(self.start[s])
        arena = self.arena
        if n and k == int(arena[st + n - 1]):
            pass  # the newest: just shorter
        elif n and k == int(arena[st]):
            self.start[s] = st + 1  # the oldest: the row starts one later
        else:
            i = int(np.searchsorted(arena[st : st + n], k))
            if i >= n or arena[st + i] != k:
                raise InvariantError("kv-seq-pos", f"pair (pos {k >> _CELL_BITS}, cell {k & _CELL_MASK}) is not held")
            arena[st + i : st + n - 1] = arena[st + i + 1 : st + n]
        self.n[s] = n - 1
        self.stamps[s] = _StampClock.one()

    def remove_many(self, s: int, keys_sorted: np.ndarray) -> None:
        m = int(keys_sorted.size)
        if not m:
            return
        n, st = int(self.n[s]), int(self.start[s])
        keys = self.arena[st : st + n]
        # m distinct held keys (the precondition) between the first and the last of a run of m
        # held keys are exactly that run: the ends alone tell a tail or a head (O(1) each)
        if m <= n and keys[n - 1] == keys_sorted[-1] and keys[n - m] == keys_sorted[0]:
            self.n[s] = n - m
        elif m <= n and keys[0] == keys_sorted[0] and keys[m - 1] == keys_sorted[-1]:
            self.start[s] = st + m  # the oldest pairs (a window cache reusing a sequence's first cells)
            self.n[s] = n - m
        else:
            idx = np.searchsorted(keys, keys_sorted)
            if (idx >= n).any() or not np.array_equal(keys[np.minimum(idx, n - 1)], keys_sorted):
                raise InvariantError("kv-seq-pos", "removing pairs that are not held")
            kept = np.delete(keys, idx)
            keys[: kept.size] = kept
            self.n[s] = int(kept.size)
        self.stamps[s] = _StampClock.one()

    # -- edits of many rows at once (a decode step) -------------------------------------------
    def append_keys(self, rows: np.ndarray, keys: np.ndarray) -> None:
        """Add ``keys[k]`` to row ``rows[k]`` (rows distinct, keys not held): one NumPy
        write for those that go after their row's last pair with room left, :meth:`add_key`
        for the others (a row that must grow: about one in ``cap / 2`` appends)."""
        st, n = self.start[rows], self.n[rows]
        at = st + n
        last = np.where(n > 0, self.arena[np.maximum(at - 1, 0)], -1)
        fast = (keys > last) & (at < self.end[rows])
        if fast.all():
            self.arena[at] = keys
            self.n[rows] = n + 1
            return
        self.arena[at[fast]] = keys[fast]
        self.n[rows[fast]] += 1
        for s, k in zip(rows[~fast].tolist(), keys[~fast].tolist(), strict=True):
            self.add_key(s, k)

    def remove_runs(self, rows: np.ndarray, bounds: np.ndarray, keys: np.ndarray) -> None:
        """Remove ``keys[bounds[g] : bounds[g + 1]]`` (sorted, each held) from row ``rows[g]``
        (rows distinct): every run that is its row's oldest or newest pairs in one NumPy pass
        for all of them (a window cache's decode step drops each sequence's oldest), the
        others one by one (:meth:`remove_many`)."""
        m = bounds[1:] - bounds[:-1]
        st, n = self.start[rows], self.n[rows]
        g_first, g_last = keys[bounds[:-1]], keys[bounds[1:] - 1]
        arena = self.arena
        head = (g_first == arena[st]) & (g_last == arena[st + m - 1])
        if head.all():  # (a window cache's decode step: every run is its row's oldest pairs)
            self.start[rows] = st + m
            self.n[rows] = n - m
            self.stamps[rows] = _StampClock.block(int(rows.size))
            return
        tail = ~head & (g_last == arena[st + n - 1]) & (g_first == arena[st + n - m])
        done = head | tail
        if not done.all():
            for g in np.flatnonzero(~done).tolist():
                self.remove_many(int(rows[g]), keys[bounds[g] : bounds[g + 1]])
            rows, m, head = rows[done], m[done], head[done]
        self.start[rows[head]] += m[head]
        self.n[rows] -= m
        self.stamps[rows] = _StampClock.block(int(rows.size))


class SeqCells(Sequence[tuple[int, int]]):
    """The ``(pos, cell)`` pairs one sequence holds in one stream, sorted by position
    then cell: a view of its row of the stream's :class:`SeqPairBook`.

    Reads like a sequence of tuples (``len``, indexing, slicing, iteration,
    ``==`` with a list of tuples) for callers that want pairs; the hot paths
    use :meth:`positions`, :meth:`cells` and :meth:`span` (NumPy arrays and
    index bounds).  Adding a pair after the last one is O(1) amortised, so is
    removing the first or the last; elsewhere the later keys move (one ``memmove``).
    """

    __slots__ = ("_book", "_s")

    def __init__(self, book: SeqPairBook, s: int) -> None:
        self._book = book
        self._s = s

    # -- reads ----------------------------------------------------------------------
    @property
    def keys(self) -> np.ndarray:
        """The sorted keys (a view: never write through it; valid until the next edit of the stream)."""
        return self._book.keys_of(self._s)

    @property
    def stamp(self) -> int:
        """Changes at every edit that is not an append at the end (:class:`_StampClock`)."""
        return int(self._book.stamps[self._s])

    @stamp.setter
    def stamp(self, value: int) -> None:
        self._book.stamps[self._s] = value

    def positions(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return self.keys[lo:hi] >> _CELL_BITS

    def cells(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return self.keys[lo:hi] & _CELL_MASK

    def pairs_from(self, lo: int) -> list[tuple[int, int]]:
        """The pairs from index ``lo`` on, as tuples (O(pairs returned))."""
        return [(k >> _CELL_BITS, k & _CELL_MASK) for k in self.keys[lo:].tolist()]

    @property
    def first_key(self) -> int:
        """The first key (``pos << 32 | cell``), -1 when empty; O(1)."""
        b, s = self._book, self._s
        return int(b.arena[b.start[s]]) if b.n[s] else -1

    @property
    def last_key(self) -> int:
        """The last key (``pos << 32 | cell``), -1 when empty; O(1)."""
        b, s = self._book, self._s
        n = int(b.n[s])
        return int(b.arena[int(b.start[s]) + n - 1]) if n else -1

    def first_pos(self) -> int:
        return self.first_key >> _CELL_BITS  # -1 >> 32 is -1: empty

    def last_pos(self) -> int:
        return self.last_key >> _CELL_BITS  # -1 >> 32 is -1: empty

    def span(self, p0: int, p1: int) -> tuple[int, int]:
        """Index bounds ``[lo, hi)`` of the pairs with ``p0 <= pos < p1``; O(log n)."""
        n = len(self)
        if p1 <= p0 or not n:
            return 0, 0
        keys = self.keys
        lo = int(np.searchsorted(keys, _pos_key(p0))) if p0 > 0 else 0
        hi = n if p1 >= _POS_END else int(np.searchsorted(keys, _pos_key(p1)))
        return lo, max(lo, hi)

    def __len__(self) -> int:
        return int(self._book.n[self._s])

    def __bool__(self) -> bool:
        return bool(self._book.n[self._s])

    def __iter__(self) -> Iterator[tuple[int, int]]:
        keys = self.keys
        return zip((keys >> _CELL_BITS).tolist(), (keys & _CELL_MASK).tolist(), strict=True)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            keys = self.keys[i]
            return list(zip((keys >> _CELL_BITS).tolist(), (keys & _CELL_MASK).tolist(), strict=True))
        b, s = self._book, self._s
        n = int(b.n[s])
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"pair {i} out of range ({n} pairs)")
        k = int(b.arena[int(b.start[s]) + i])  # no view of the keys: one read
        return (k >> _CELL_BITS, k & _CELL_MASK)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SeqCells):
            return bool(np.array_equal(self.keys, other.keys))
        if isinstance(other, list | tuple):
            return list(self) == [tuple(x) for x in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SeqCells({list(self)!r})"

    # -- edits (of the book's row) ------------------------------------------------------
    def add(self, p: int, c: int) -> None:
        self._book.add_key(self._s, _key(int(p), int(c)))

    def add_key(self, k: int) -> None:
        """:meth:`add` of a pair given as its key."""
        self._book.add_key(self._s, k)

    def add_many(self, keys_sorted: np.ndarray) -> None:
        """Add sorted keys none of which is held yet (one merge)."""
        self._book.add_many(self._s, keys_sorted)

    def remove(self, p: int, c: int) -> None:
        self._book.remove_key(self._s, _key(p, c))

    def remove_key(self, k: int) -> None:
        """Remove one held pair given as its key: O(1) for the oldest or the newest."""
        self._book.remove_key(self._s, k)

    def remove_many(self, keys_sorted: np.ndarray) -> None:
        """Remove sorted keys, every one of them held (a tail or a head is cut in O(m))."""
        self._book.remove_many(self._s, keys_sorted)


class OwnerRuns(NamedTuple):
    """``(sequence, key)`` pairs sorted by sequence then key (:meth:`KVCells.owner_runs`):
    sequence ``seqs[bounds[g]]`` holds ``keys[bounds[g] : bounds[g + 1]]``."""

    seqs: np.ndarray
    keys: np.ndarray
    bounds: np.ndarray

    def highest(self) -> tuple[np.ndarray, np.ndarray]:
        """Each run's sequence (ascending) and the highest position it holds in the run."""
        last = self.bounds[1:] - 1
        return self.seqs[last], self.keys[last] >> _CELL_BITS


def last_positions(seqs: Sequence[SeqCells]) -> np.ndarray:
    """``last_pos()`` of each of ``seqs`` (-1: holds nothing) as one int64 array."""
    keys = np.fromiter((sc.last_key for sc in seqs), dtype=np.int64, count=len(seqs))
    return keys >> _CELL_BITS  # an arithmetic shift: -1 stays -1


class CellJournal:
    """Before-images of the cells of one stream that mutations touched while attached
    (:meth:`KVCells.attach`), and the book's counters: :meth:`KVCells.rollback`
    puts the stream back exactly as it was at attach time.

    Each cell is saved once, at its first touch: one at a time (``saved``, ``empty_before``)
    or, for the bulk mutations, a whole set of cells as arrays (``bulk``), so that a decode
    step that reuses 256 window cells saves them with a few NumPy copies, not 256 tuples.
    The cells the bulk mutations touch are kept as the arrays they came in and turned into
    sets (:attr:`empty_before`, :attr:`bulk_cells`) only when a later touch must ask whether
    a cell was seen: a decode step's apply (a bulk reuse, then a bulk placement) builds no
    set at all (a set of 256 ints cost more than the rest of the journal)."""

    __slots__ = (
        "_bulk_cells",
        "_bulk_new",
        "_empty",
        "_empty_new",
        "bulk",
        "counts",
        "has_shift",
        "removals",
        "saved",
        "stamps",
        "used",
    )

    def __init__(self, cells: KVCells) -> None:
        #: cell -> (pos, ext x, ext y, shift, sequences) of a cell that held a position at its first touch
        self.saved: dict[int, tuple[int, int, int, int, tuple[int, ...]]] = {}
        #: cells that were empty at their first touch: a set and arrays not yet joined to it
        self._empty: set[int] = set()
        self._empty_new: list[np.ndarray] = []
        #: (cells, pos, ext, shift, sequence rows or, 1-D, each cell's one sequence) of cells saved
        #: together, each holding a position at its first touch; their cells (disjoint from
        #: ``saved``): a set and arrays not yet joined
        self.bulk: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._bulk_cells: set[int] = set()
        self._bulk_new: list[np.ndarray] = []
        self.used = cells.used
        self.has_shift = cells.has_shift
        self.removals = cells.removals
        #: each sequence's (stamp, pair count) at attach: given back by a rollback that finds the
        #: same pairs (O(sequences), so a reader of the pairs need not read them again)
        self.stamps = cells.seq_pos.stamps.copy()
        self.counts = cells.seq_pos.n.copy()

    @property
    def empty_before(self) -> set[int]:
        """The cells that were empty at their first touch."""
        if self._empty_new:
            for a in self._empty_new:
                self._empty.update(a.tolist())
            self._empty_new.clear()
        return self._empty

    @property
    def bulk_cells(self) -> set[int]:
        """Every cell of :attr:`bulk`."""
        if self._bulk_new:
            for a in self._bulk_new:
                self._bulk_cells.update(a.tolist())
            self._bulk_new.clear()
        return self._bulk_cells

    def _any(self) -> bool:
        """Whether any cell was touched."""
        return bool(self.saved or self._empty or self._empty_new or self.bulk)

    def empty_cells(self) -> np.ndarray:
        """:attr:`empty_before` as a sorted array (no set built when it is arrays alone)."""
        if not self._empty:
            if not self._empty_new:
                return _NO_KEYS
            if len(self._empty_new) == 1:
                return np.unique(self._empty_new[0])
            return np.unique(np.concatenate(self._empty_new))
        e = self.empty_before
        return np.sort(np.fromiter(e, dtype=np.int64, count=len(e)))

    def _seen(self, i: int) -> bool:
        return i in self.saved or i in self.empty_before or i in self.bulk_cells

    def touch(self, cells: KVCells, i: int) -> None:
        if self._seen(i):
            return
        if cells.pos[i] == EMPTY:
            self._empty.add(i)
        else:
            x, y = cells.ext[i]
            self.saved[i] = (int(cells.pos[i]), int(x), int(y), int(cells.shift[i]), tuple(cells.seqs_of(i)))

    def touch_many(self, cells: KVCells, idx: np.ndarray, seq_rows: np.ndarray | None = None) -> None:
        """:meth:`touch` for the cells ``idx`` (distinct, each holding a position), read in bulk.
        ``seq_rows``: ``cells.seq[idx]`` when the caller has read it already, or (1-D) each cell's
        one sequence (it is kept, not copied: the caller must not write it)."""
        if self._any():
            empty, bulk = self.empty_before, self.bulk_cells
            fresh = [k for k, i in enumerate(idx.tolist()) if i not in self.saved and i not in empty and i not in bulk]
            if not fresh:
                return
            if len(fresh) < idx.size:
                sel_k = np.asarray(fresh, dtype=np.int64)
                idx = idx[sel_k]
                seq_rows = None if seq_rows is None else seq_rows[sel_k]
        sel = np.array(idx, dtype=np.int64)  # a copy: the caller's array may change
        self.bulk.append(
            (sel, cells.pos[sel], cells.ext[sel], cells.shift[sel], cells.seq[sel] if seq_rows is None else seq_rows)
        )
        self._bulk_new.append(sel)

    def touch_empty(self, idx: np.ndarray) -> None:
        """The cells ``idx``, all empty now, are about to be placed in bulk.  (One
        already saved with a position keeps that before-image: rollback empties
        every touched cell before it puts the saved ones back.)"""
        self._empty_new.append(np.array(idx, dtype=np.int64))

    @property
    def n_touched(self) -> int:
        return len(self.saved) + len(self.empty_before | self.bulk_cells)


class KVCells:
    """The cells of one stream.

    ``n_seq_max`` bounds sequence ids (``0 <= s < n_seq_max``).  The ordered
    per-sequence pairs (``seq_pos``) are the single source of truth for
    ``seq_pos_min/max``; every mutation below keeps them, the per-cell arrays
    and the derived counts in step (:meth:`check` verifies it).
    """

    def __init__(self, size: int, n_seq_max: int) -> None:
        if size <= 0:
            raise ArgumentError("size", f"a KV stream needs at least one cell, got {size}")
        if n_seq_max <= 0:
            raise ArgumentError("n_seq_max", f"must be positive, got {n_seq_max}")
        self.size = int(size)
        self.n_seq_max = int(n_seq_max)
        self.pos = np.full(self.size, EMPTY, dtype=np.int64)
        self.ext = np.zeros((self.size, 2), dtype=np.int64)  # (x, y) of M-RoPE positions
        self.shift = np.zeros(self.size, dtype=np.int64)
        self.seq = np.zeros((self.size, self.n_seq_max), dtype=bool)
        self.used = 0
        self.has_shift = False
        #: every sequence's ordered pairs (``seq_pos[s]``: a :class:`SeqCells`)
        self.seq_pos = SeqPairBook(self.n_seq_max)
        self.removals = 0  # (cell, sequence) pairs ever dropped: tells a caller whether an edit removed anything
        self._derive()
        self._journal: CellJournal | None = None

    def _derive(self) -> None:
        """The derived counts, from the cells (construction, copies)."""
        n_blocks = -(-self.size // BLOCK)
        self._cap = np.full(n_blocks, BLOCK, dtype=np.int32)
        self._cap[-1] = self.size - (n_blocks - 1) * BLOCK
        empty = np.zeros(n_blocks * BLOCK, dtype=np.int32)
        empty[: self.size] = self.pos == EMPTY
        self._nfree = empty.reshape(n_blocks, BLOCK).sum(axis=1).astype(np.int32)
        self.n_owner = self.seq.sum(axis=1).astype(np.int32)
        nz = np.flatnonzero(self.pos != EMPTY)
        self._hi = int(nz[-1]) + 1 if nz.size else 0
        self._hi_dirty = False

    # -- copies (tests: prove that nothing changed) -------------------------------------
    def clone(self) -> KVCells:
        out = KVCells.__new__(KVCells)
        out.size = self.size
        out.n_seq_max = self.n_seq_max
        out.pos = self.pos.copy()
        out.ext = self.ext.copy()
        out.shift = self.shift.copy()
        out.seq = self.seq.copy()
        out.used = self.used
        out.has_shift = self.has_shift
        out.seq_pos = self.seq_pos.copy()
        out.removals = self.removals
        out._derive()
        out._journal = None
        return out

    def same_as(self, other: KVCells) -> bool:
        """Whole-book equality (tests use it to prove nothing changed)."""
        return (
            self.size == other.size
            and np.array_equal(self.pos, other.pos)
            and np.array_equal(self.ext, other.ext)
            and np.array_equal(self.shift, other.shift)
            and np.array_equal(self.seq, other.seq)
            and self.used == other.used
            and self.has_shift == other.has_shift
            and all(a == b for a, b in zip(self.seq_pos, other.seq_pos, strict=True))
        )

    # -- queries ----------------------------------------------------------------------
    def is_empty(self, i: int) -> bool:
        return bool(self.pos[i] == EMPTY)

    def pos_get(self, i: int) -> int:
        return int(self.pos[i])

    def seq_has(self, i: int, s: int) -> bool:
        return bool(self.seq[i, s])

    def seq_count(self, i: int) -> int:
        return int(self.n_owner[i])

    def seqs_of(self, i: int) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.seq[i])]

    def seq_pos_min(self, s: int) -> int:
        return self.seq_pos[s].first_pos()

    def seq_pos_max(self, s: int) -> int:
        return self.seq_pos[s].last_pos()

    def seq_cells(self, s: int) -> list[tuple[int, int]]:
        """The ``(pos, cell)`` pairs of ``s`` sorted by position then cell (a copy; O(n))."""
        return list(self.seq_pos[s])

    def used_max_p1(self) -> int:
        """One past the highest non-empty cell (0 when the stream is empty); O(1)
        unless the highest cell was freed since, then O(blocks freed above)."""
        if self._hi_dirty:
            self._hi = self._last_used_p1(self._hi)
            self._hi_dirty = False
        return self._hi

    def _last_used_p1(self, below: int) -> int:
        """One past the last used cell; every cell from ``below`` up is empty."""
        b_end = -(-below // BLOCK)
        while b_end > 0:
            b0 = max(0, b_end - _BLOCK_WINDOW)
            part = np.flatnonzero(self._nfree[b0:b_end] != self._cap[b0:b_end])
            if part.size:
                lo = (b0 + int(part[-1])) * BLOCK
                nz = np.flatnonzero(self.pos[lo : lo + BLOCK] != EMPTY)
                return lo + int(nz[-1]) + 1
            b_end = b0
        return 0

    def free_from(self, start: int, n: int) -> list[int]:
        """Up to ``n`` empty cells in cyclic order from ``start`` (upstream's scan from
        the search head), skipping full blocks; O(n + blocks skipped / 256)."""
        out: list[int] = []
        n = min(n, self.size - self.used)  # (a full window cache has none: no block is read)
        if n <= 0:
            return out
        start = min(max(start, 0), self.size)
        self._collect_free(start, self.size, n, out)
        if len(out) < n and start > 0:
            self._collect_free(0, start, n, out)
        return out

    def _collect_free(self, lo: int, hi: int, n: int, out: list[int]) -> None:
        """Append to ``out`` the empty cells of ``[lo, hi)`` in order until it holds ``n``:
        a block that starts before ``lo`` alone, then up to :data:`_BLOCK_WINDOW` blocks per
        NumPy pass, reading only as many blocks with free cells as their counts say it needs."""
        i = lo
        b_hi = ((hi - 1) >> BLOCK_SHIFT) + 1
        while i < hi and len(out) < n:
            b = i >> BLOCK_SHIFT
            if i & (BLOCK - 1):  # inside a block: its rest alone
                end = min((b + 1) << BLOCK_SHIFT, hi)
                if self._nfree[b]:
                    free = np.flatnonzero(self.pos[i:end] == EMPTY)
                    out.extend((free[: n - len(out)] + i).tolist())
                i = end
                continue
            w = min(b_hi, b + _BLOCK_WINDOW)
            nfree = self._nfree[b:w]
            nz = np.flatnonzero(nfree)
            if not nz.size:
                i = w << BLOCK_SHIFT
                continue
            need = n - len(out)
            k = int(np.searchsorted(np.cumsum(nfree[nz]), need)) + 1  # the blocks that hold enough
            blocks = b + nz[:k]
            cand = ((blocks[:, None] << BLOCK_SHIFT) + np.arange(BLOCK)).reshape(-1)
            cand = cand[cand < hi]
            cand = cand[self.pos[cand] == EMPTY]
            out.extend(cand[:need].tolist())
            i = (int(blocks[-1]) + 1) << BLOCK_SHIFT

    def oldest_alone_many(
        self,
        seqs: Sequence[int] | np.ndarray | None,
        p_end: np.ndarray | int,
        need: int,
        owners: list[int] | None = None,
    ) -> list[int]:
        """:meth:`oldest_alone` of ``seqs`` in order (``p_end[k]`` for ``seqs[k]``; None: every
        sequence, ascending), until ``need`` cells are found: the same cells as a loop of calls
        (:meth:`oldest_alone_arrays`, as a list).  ``owners``: where the sequence of each cell
        returned is appended (its only owner)."""
        cells, who = self.oldest_alone_arrays(seqs, p_end, need)
        if owners is not None:
            owners += who.tolist()
        out: list[int] = cells.tolist()
        return out

    def oldest_alone_arrays(
        self, seqs: Sequence[int] | np.ndarray | None, p_end: np.ndarray | int, need: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`oldest_alone_many` as arrays: the cells and each one's sequence.  They are
        read with NumPy for many sequences at once (a decode step of a full window cache asks
        each of its 256 sequences for about one cell): the first :data:`_HEAD` pairs of the
        sequences, in runs that double until ``need`` is met; a sequence whose first pairs are
        all below its end may hold more there, and is asked alone.  When there are many more
        sequences than ``need``, only those whose oldest pair is below their end are read."""
        n_rows = self.n_seq_max if seqs is None else len(seqs)
        if need <= 0 or not n_rows:
            return _NO_KEYS, _NO_KEYS
        rows = None if seqs is None else np.asarray(seqs, dtype=np.int64)
        end_key = np.minimum(np.maximum(p_end, 0), _POS_END).astype(np.int64) << _CELL_BITS  # (np.clip costs 10x)
        if end_key.ndim == 0:
            end_key = np.full(n_rows, end_key, dtype=np.int64)
        run = max(16, need)
        if 8 < n_rows <= 2 * run:  # a decode step: every sequence's head in one gather, no pre-filter
            return self._oldest_alone_heads(rows, end_key, need)
        if rows is None:
            rows = np.arange(n_rows, dtype=np.int64)
        first = self.seq_pos.first_keys(rows)
        giving = np.flatnonzero((first >= 0) & (first < end_key))
        cells: list[np.ndarray] = []
        who: list[np.ndarray] = []
        got_n = 0
        if giving.size <= 2:  # one or two sequences give (a small batch): asked one by one, no gather
            for g in giving.tolist():
                got = self._oldest_alone_from(int(rows[g]), 0, int(end_key[g]), need - got_n)
                cells.append(got)
                who.append(np.full(got.size, rows[g], dtype=np.int64))
                got_n += int(got.size)
                if got_n >= need:
                    break
        else:
            lo = 0
            while lo < giving.size and got_n < need:
                sel = giving[lo : lo + run]
                c, w = self._oldest_alone_heads(rows[sel], end_key[sel], need - got_n)
                cells.append(c)
                who.append(w)
                got_n += int(c.size)
                lo, run = lo + run, 2 * run
        if not cells:
            return _NO_KEYS, _NO_KEYS
        return np.concatenate(cells), np.concatenate(who)

    def _oldest_alone_heads(
        self, seqs: np.ndarray | None, end_key: np.ndarray, need: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`oldest_alone_arrays` of some sequences (None: all, ascending; ``end_key``:
        their ends as keys): the first :data:`_HEAD` pairs of every one of them in one gather
        ``[sequences, _HEAD]`` (the arena's slack makes it safe without a clip); only a sequence
        whose head pairs are all below its end is read further (:meth:`_oldest_alone_from`)."""
        book = self.seq_pos
        start, n = (book.start, book.n) if seqs is None else (book.start[seqs], book.n[seqs])
        flat = book.arena[start[:, None] + _HEAD_J]
        # keys are sorted, so ``below`` is a prefix of each row: its last column says "all"
        below = (flat < end_key[:, None]) & (_HEAD_J < n[:, None])
        cells = flat[below] & _CELL_MASK  # row-major: each sequence's cells oldest first, in order
        alone = self.n_owner[cells] == 1
        counts = below.sum(axis=1)
        ids = np.repeat(np.arange(counts.size) if seqs is None else seqs, counts)  # each cell's sequence
        if not below[:, -1].any():
            return cells[alone][:need], ids[alone][:need]
        # a sequence may hold more below its end than its head: read it alone, in its turn
        ends = np.cumsum(counts)
        out: list[np.ndarray] = []
        who: list[np.ndarray] = []
        got_n = lo = 0
        for r in np.flatnonzero(below[:, -1]).tolist():
            hi = int(ends[r])
            if hi - _HEAD > lo:  # the rows before it (none when it follows another such row)
                k = need - got_n
                out.append(cells[lo : hi - _HEAD][alone[lo : hi - _HEAD]][:k])
                who.append(ids[lo : hi - _HEAD][alone[lo : hi - _HEAD]][:k])
                got_n += int(out[-1].size)
            if got_n < need:  # the row itself, from its first pair
                s = r if seqs is None else int(seqs[r])
                got = self._oldest_alone_from(s, 0, int(end_key[r]), need - got_n)
                out.append(got)
                who.append(np.full(got.size, s, dtype=np.int64))
                got_n += int(got.size)
            if got_n >= need:
                return np.concatenate(out), np.concatenate(who)
            lo = hi
        k = need - got_n
        out.append(cells[lo:][alone[lo:]][:k])
        who.append(ids[lo:][alone[lo:]][:k])
        return np.concatenate(out), np.concatenate(who)

    def oldest_alone(self, s: int, p_end: int, need: int) -> list[int]:
        """Up to ``need`` cells of ``s`` at positions below ``p_end`` that ``s`` holds alone,
        oldest first (a window cache's reusable cells): a slice of its pairs at a time,
        O(cells taken + shared cells skipped), never the whole sequence."""
        if need <= 0 or p_end <= 0:
            return []
        out: list[int] = self._oldest_alone_from(s, 0, _pos_key(p_end), need).tolist()
        return out

    def _oldest_alone_from(self, s: int, j: int, end_key: int, need: int) -> np.ndarray:
        """:meth:`oldest_alone` from the ``j``-th pair of ``s`` on, below the key ``end_key``,
        as an array, a slice at a time (the first one twice ``need`` pairs or 64: a decode
        step's)."""
        if need <= 0 or end_key <= 0:
            return _NO_KEYS
        book, owners = self.seq_pos, self.n_owner
        st, n = int(book.start[s]), int(book.n[s])
        if j >= n or int(book.arena[st + j]) >= end_key:  # (most sequences of a small batch give nothing)
            return _NO_KEYS
        keys = book.arena[st : st + n]
        hi = int(np.searchsorted(keys, end_key))
        out: list[np.ndarray] = []
        got = 0
        while j < hi and got < need:
            stop = min(hi, j + max(64, 2 * (need - got)))
            cand = keys[j:stop] & _CELL_MASK
            cand = cand[owners[cand] == 1][: need - got]
            out.append(cand)
            got += int(cand.size)
            j = stop
        return out[0] if len(out) == 1 else np.concatenate(out) if out else _NO_KEYS

    def check(self) -> None:
        """Raise :class:`InvariantError` unless the book is consistent (tests call
        this after every step; explicit raises, so ``python -O`` keeps them)."""
        n_used = int((self.pos != EMPTY).sum())
        if self.used != n_used:
            raise InvariantError("kv-used", f"used is {self.used} but {n_used} cells hold a position")
        owners = self.seq.sum(axis=1)
        bad = np.flatnonzero((self.pos == EMPTY) & (owners > 0))
        if bad.size:
            raise InvariantError("kv-empty", f"empty cell {int(bad[0])} holds sequences")
        bad = np.flatnonzero((self.pos != EMPTY) & (owners == 0))
        if bad.size:
            i = int(bad[0])
            raise InvariantError("kv-empty", f"cell {i} at pos {self.pos[i]} holds no sequence")
        for s in range(self.n_seq_max):
            held = np.flatnonzero(self.seq[:, s])
            expect = np.sort((self.pos[held] << _CELL_BITS) | held)
            if not np.array_equal(self.seq_pos[s].keys, expect):
                raise InvariantError("kv-seq-pos", f"ordered positions of seq {s} out of step")
        self.seq_pos.check()
        if self.shift.any() and not self.has_shift:
            raise InvariantError("kv-shift", "a cell holds a shift but has_shift is False")
        fresh = self.clone()  # the derived counts recomputed from the cells
        if not np.array_equal(fresh.n_owner, self.n_owner):
            raise InvariantError("kv-owners", "per-cell sequence counts out of step")
        if not np.array_equal(fresh._nfree, self._nfree):
            raise InvariantError("kv-free", "per-block free counts out of step")
        if fresh._hi != self.used_max_p1():
            raise InvariantError("kv-extent", f"used extent {self.used_max_p1()}, cells say {fresh._hi}")

    # -- the journal (plans and undo without copying the book) ---------------------------
    def attach(self, journal: CellJournal | None = None) -> CellJournal:
        """Start recording before-images (returns the journal; one at a time)."""
        if self._journal is not None:
            raise InvariantError("kv-journal", "a journal is already attached to this stream")
        self._journal = CellJournal(self) if journal is None else journal
        return self._journal

    def detach(self) -> CellJournal | None:
        j, self._journal = self._journal, None
        return j

    def rollback(self, journal: CellJournal) -> None:
        """Put back every cell ``journal`` saved and the counters it took, exactly
        (also ``removals``: a rolled-back plan removed nothing).  The journal is
        detached first; O(cells touched)."""
        if self._journal is journal:
            self._journal = None
        empty = journal.empty_cells()
        if empty.size:
            self.rm_many(empty)
        for i in journal.saved:
            self.rm(i)
        for chunk in journal.bulk:
            self.rm_many(chunk[0])
        for i, (p, x, y, sh, seqs) in journal.saved.items():
            self.pos_set(i, p, (x, y))
            self.shift[i] = sh
            for s in seqs:
                self.seq_add(i, s)
        for chunk in journal.bulk:
            self._put_back(*chunk)
        self.has_shift = journal.has_shift
        self.removals = journal.removals
        if not journal.saved and not journal.bulk:
            # Only cells empty at attach were touched (trial placements), and they are empty
            # again: every sequence holds exactly its pairs of then, so it gets its stamp of then
            # back (the k-pool layout then reads no pair again at the next apply).
            same = self.seq_pos.n == journal.counts
            self.seq_pos.stamps[same] = journal.stamps[same]
        if self.used != journal.used:
            raise InvariantError("kv-journal", f"rollback left {self.used} cells used, expected {journal.used}")

    # -- cell mutations -----------------------------------------------------------------
    def _occupy(self, i: int) -> None:
        self._nfree[i >> BLOCK_SHIFT] -= 1
        if i >= self._hi:
            self._hi = i + 1

    def pos_set(self, i: int, p: int, ext: tuple[int, int] = (0, 0)) -> None:
        """Occupy an empty cell at position ``p`` (sequences are added after)."""
        assert self.pos[i] == EMPTY, f"cell {i} is not empty"
        assert p >= 0
        if self._journal is not None:
            self._journal.touch(self, i)
        self.pos[i] = p
        self.ext[i] = ext
        self.shift[i] = 0
        self.used += 1
        self._occupy(i)

    def seq_add(self, i: int, s: int) -> None:
        assert self.pos[i] != EMPTY
        if not self.seq[i, s]:
            if self._journal is not None:
                self._journal.touch(self, i)
            self.seq[i, s] = True
            self.n_owner[i] += 1
            self.seq_pos[s].add(int(self.pos[i]), i)

    def seq_rm(self, i: int, s: int) -> bool:
        """Drop ``s`` from cell ``i``; True when the cell became empty."""
        if not self.seq[i, s]:
            return False
        if self._journal is not None:
            self._journal.touch(self, i)
        self.seq[i, s] = False
        self.n_owner[i] -= 1
        self.seq_pos[s].remove(int(self.pos[i]), i)
        self.removals += 1
        if not self.n_owner[i]:
            self._empty(i)
            return True
        return False

    def rm(self, i: int) -> None:
        """Empty cell ``i`` whatever sequences hold it."""
        if self.pos[i] == EMPTY:
            return
        if self._journal is not None:
            self._journal.touch(self, i)
        p = int(self.pos[i])
        for s in np.flatnonzero(self.seq[i]).tolist():
            self.seq_pos[s].remove(p, i)
            self.removals += 1
        self.seq[i] = False
        self.n_owner[i] = 0
        self._empty(i)

    def _count_free(self, idx: np.ndarray, d: int) -> None:
        """Add ``d`` to the free count of the block of each of the cells ``idx`` (one
        ``bincount``: ``np.add.at`` costs several times more for a decode step's 256 cells)."""
        per_block = np.bincount(idx >> BLOCK_SHIFT)
        if d < 0:
            self._nfree[: per_block.size] -= per_block.astype(np.int32)
        else:
            self._nfree[: per_block.size] += per_block.astype(np.int32)

    def _empty(self, i: int) -> None:
        self.pos[i] = EMPTY
        self.ext[i] = 0
        self.shift[i] = 0
        self.used -= 1
        self._nfree[i >> BLOCK_SHIFT] += 1
        if i == self._hi - 1:
            self._hi_dirty = True

    def place_seqs(
        self,
        idx: np.ndarray,
        pos: np.ndarray,
        ext: np.ndarray,
        seqs: np.ndarray,
        reuse: tuple[np.ndarray, np.ndarray, OwnerRuns, np.ndarray] | None = None,
    ) -> None:
        """Occupy the empty cells ``idx`` (distinct) at positions ``pos`` with 2-D
        extensions ``ext`` [n, 2], cell ``idx[k]`` held by sequence ``seqs[k]`` alone:
        the bulk form of ``pos_set`` + ``seq_add`` (a ubatch with one sequence per
        token), vectorised but for one append per sequence.

        ``reuse``: ``(occupied, occ, runs, seq_rows)`` when some of the cells still hold a
        position (a window cache's reuse): ``occupied`` marks them in ``idx``, ``occ`` are
        they, ``runs`` / ``seq_rows`` as for :meth:`rm_many`.  Their owners are dropped
        first, as :meth:`rm_many` then a placement would, but the cells are not emptied
        and filled again (no free counts, extent or fields written twice)."""
        n = int(idx.size)
        if not n:
            return
        fresh = idx
        if reuse is not None:
            occupied, occ, runs, seq_rows = reuse
            self._drop_owners(occ, runs, seq_rows)
            fresh = idx[~occupied] if occ.size < n else _NO_KEYS
        if self._journal is not None:
            self._journal.touch_empty(idx)  # (a reused cell keeps its bulk before-image: rollback empties first)
        self.pos[idx] = pos
        self.ext[idx] = ext
        self.shift[idx] = 0
        self.seq[idx, seqs] = True
        self.n_owner[idx] = 1
        self.used += int(fresh.size)
        if fresh.size:
            self._count_free(fresh, -1)
        top = int(idx.max()) + 1
        if top > self._hi:
            self._hi = top
        keys = (pos << _CELL_BITS) | idx
        if n == 1:
            self.seq_pos.add_key(int(seqs[0]), int(keys[0]))
            return
        if seqs[0] == seqs[-1] and bool((seqs == seqs[0]).all()):  # one sequence (a prefill, a restore): no grouping
            self.seq_pos.add_many(int(seqs[0]), np.sort(keys))
            return
        if np.bincount(seqs).max() == 1:  # one cell per sequence (a decode step): one NumPy append for all
            self.seq_pos.append_keys(np.asarray(seqs, dtype=np.int64), keys)
            return
        order = np.lexsort((keys, seqs))
        seqs_sorted, keys_sorted = seqs[order], keys[order]
        new_seq = seqs_sorted[1:] != seqs_sorted[:-1]
        starts = np.flatnonzero(np.r_[True, new_seq])
        ends = np.r_[starts[1:], n]
        book = self.seq_pos
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            if b - a == 1:
                book.add_key(int(seqs_sorted[a]), int(keys_sorted[a]))
            else:
                book.add_many(int(seqs_sorted[a]), keys_sorted[a:b])

    def _put_back(self, idx: np.ndarray, pos: np.ndarray, ext: np.ndarray, shift: np.ndarray, seq: np.ndarray) -> None:
        """Occupy the empty cells ``idx`` (distinct) with saved contents: positions, 2-D
        extensions, shifts and sequence rows ``[n, n_seq_max]`` or (1-D) each cell's one
        sequence (a bulk before-image of :class:`CellJournal`); the journal must be detached."""
        n = int(idx.size)
        if not n:
            return
        if seq.ndim == 1:
            expanded = np.zeros((n, self.n_seq_max), dtype=bool)
            expanded[np.arange(n), seq] = True
            seq = expanded
        self.pos[idx] = pos
        self.ext[idx] = ext
        self.shift[idx] = shift
        self.seq[idx] = seq
        self.n_owner[idx] = seq.sum(axis=1)
        self.used += n
        self._count_free(idx, -1)
        self._hi = max(self._hi, int(idx.max()) + 1)
        rows, owners = np.nonzero(seq)
        keys = ((pos << _CELL_BITS) | idx)[rows]
        order = np.lexsort((keys, owners))
        owners, keys = owners[order], keys[order]
        bounds = [0, *(np.flatnonzero(owners[1:] != owners[:-1]) + 1).tolist(), int(owners.size)]
        for a, b in itertools.pairwise(bounds):
            if b > a:
                self.seq_pos[int(owners[a])].add_many(keys[a:b])

    def seq_rm_many(self, idx: np.ndarray, s: int) -> np.ndarray:
        """Drop ``s`` from the cells ``idx`` (distinct, each held by ``s``); returns the
        cells that became empty.  The bulk form of :meth:`seq_rm`."""
        if not idx.size:
            return idx
        if self._journal is not None:
            self._journal.touch_many(self, idx)
        self.seq_pos[s].remove_many(np.sort((self.pos[idx] << _CELL_BITS) | idx))
        self.removals += int(idx.size)
        self.seq[idx, s] = False
        self.n_owner[idx] -= 1
        gone: np.ndarray = idx[self.n_owner[idx] == 0]
        if gone.size:
            self._empty_many(gone)
        return gone

    def _empty_many(self, idx: np.ndarray) -> None:
        """Clear the cells ``idx`` (distinct, non-empty, no sequence left) and the counts."""
        self.pos[idx] = EMPTY
        self.ext[idx] = 0
        self.shift[idx] = 0
        self.used -= int(idx.size)
        self._count_free(idx, 1)
        if int(idx.max()) >= self._hi - 1:
            self._hi_dirty = True

    def owner_runs(
        self, idx: np.ndarray, seq_rows: np.ndarray | None = None, owners: np.ndarray | None = None
    ) -> OwnerRuns:
        """Every ``(sequence, key)`` pair the cells ``idx`` (distinct, each holding a position)
        hold, sorted by sequence then key, with the bounds of each sequence's run: what
        :meth:`rm_many` drops from the pair book, and (the last key of each run) the highest
        position each sequence loses.  ``seq_rows``: ``self.seq[idx]`` when the caller read it;
        one ``argmax`` when every cell has one owner (a window cache's reuse).  ``owners``: the
        one sequence of each cell when the caller knows it (checked by the caller: no row of
        the sequence matrix is read)."""
        keys = (self.pos[idx] << _CELL_BITS) | idx
        if owners is not None:
            seqs = owners
        else:
            if seq_rows is None:
                seq_rows = self.seq[idx]
            if (self.n_owner[idx] == 1).all():
                seqs = seq_rows.argmax(axis=1)
            else:
                rows, seqs = np.nonzero(seq_rows)
                keys = keys[rows]
        order = np.lexsort((keys, seqs))
        seqs, keys = seqs[order], keys[order]
        change = np.ones(seqs.size + 1, dtype=bool)  # (np.r_ costs more than the rest of this)
        np.not_equal(seqs[1:], seqs[:-1], out=change[1:-1])
        return OwnerRuns(seqs, keys, np.flatnonzero(change))

    def rm_many(self, idx: np.ndarray, runs: OwnerRuns | None = None, seq_rows: np.ndarray | None = None) -> None:
        """Empty the cells ``idx`` (distinct), whatever sequences hold them; vectorised.
        ``runs``: :meth:`owner_runs` of ``idx`` and ``seq_rows``: ``self.seq[idx]`` or (1-D,
        every cell held by one sequence) those sequences, when the caller has them (every cell
        then holds a position; ``seq_rows`` is kept by the journal as the cells' before-image,
        so the caller must not write it)."""
        if runs is None:
            idx = idx[self.pos[idx] != EMPTY]
        if not idx.size:
            return
        if runs is None:
            runs = self.owner_runs(idx)
        self._drop_owners(idx, runs, seq_rows)
        self.n_owner[idx] = 0
        self._empty_many(idx)

    def _drop_owners(self, idx: np.ndarray, runs: OwnerRuns, seq_rows: np.ndarray | None) -> None:
        """Drop every sequence from the cells ``idx`` (each holding a position; ``runs``: their
        :meth:`owner_runs`), leaving the cells' position and counts to the caller.  ``seq_rows``:
        ``self.seq[idx]``, or (1-D) the one sequence of each cell."""
        if self._journal is not None:
            self._journal.touch_many(self, idx, seq_rows)
        # each sequence's run of keys (a window cache's reuse: its oldest pairs), all at once
        self.seq_pos.remove_runs(runs.seqs[runs.bounds[:-1]], runs.bounds, runs.keys)
        self.removals += int(runs.seqs.size)
        if seq_rows is not None and seq_rows.ndim == 1:
            self.seq[idx, seq_rows] = False  # (one element per cell: no row of the matrix read)
        else:
            self.seq[idx] = False

    def _repos(self, i: int, new: int) -> None:
        old = int(self.pos[i])
        for s in np.flatnonzero(self.seq[i]).tolist():
            self.seq_pos[s].remove(old, i)
            self.seq_pos[s].add(new, i)
        self.pos[i] = new

    def pos_add(self, i: int, d: int) -> bool:
        """Shift cell ``i`` by ``d``; a position pushed below 0 empties the
        cell (True returned).  The shift accumulates for the RoPE update.  The
        2-D extension is left as it is (upstream's ``pos_add``: only ``pos`` moves)."""
        assert self.pos[i] != EMPTY
        if self._journal is not None:
            self._journal.touch(self, i)
        new = int(self.pos[i]) + d
        self.shift[i] += d
        self.has_shift = True
        if new < 0:
            self.rm(i)
            return True
        self._repos(i, new)
        return False

    def pos_div(self, i: int, d: int) -> None:
        """Divide the position of cell ``i`` by ``d`` (the extension is kept, as upstream)."""
        assert self.pos[i] != EMPTY and d > 0
        if self._journal is not None:
            self._journal.touch(self, i)
        old = int(self.pos[i])
        new = old // d
        self.shift[i] += new - old
        self.has_shift = True
        self._repos(i, new)

    def reset_shift(self) -> None:
        if self._journal is not None:
            raise InvariantError("kv-journal", "reset_shift() while a journal is attached")
        self.shift[:] = 0
        self.has_shift = False

    def reset(self) -> None:
        if self._journal is not None:
            raise InvariantError("kv-journal", "reset() while a journal is attached")
        self.removals += int(self.seq_pos.n.sum())
        self.pos[:] = EMPTY
        self.ext[:] = 0
        self.shift[:] = 0
        self.seq[:] = False
        self.used = 0
        self.has_shift = False
        self.seq_pos.clear()  # in place: views of its rows stay valid
        self._derive()

    def snapshot(self, idxs: np.ndarray) -> tuple[np.ndarray, ...]:
        """Contents of a list of cells (restored exactly by :meth:`restore`)."""
        return (self.pos[idxs].copy(), self.ext[idxs].copy(), self.shift[idxs].copy(), self.seq[idxs].copy())

    def restore(self, idxs: Sequence[int] | np.ndarray, snap: tuple[np.ndarray, ...]) -> None:
        pos, ext, shift, seq = snap
        for i in idxs:
            self.rm(int(i))
        for k, i in enumerate(idxs):
            i = int(i)
            if pos[k] == EMPTY:
                continue
            self.pos_set(i, int(pos[k]), (int(ext[k][0]), int(ext[k][1])))
            self.shift[i] = shift[k]
            for s in np.flatnonzero(seq[k]):
                self.seq_add(i, int(s))
        self.has_shift = bool(self.shift.any())
