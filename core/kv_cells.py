"""The attention KV cell book of one stream (docs/memory-semantics.md#kv-cells).

Per cell: a position (``-1`` = empty), a 2-D position extension ``(x, y)``
for M-RoPE ties, an accumulated pending shift (for the runtime's RoPE
re-rotation), and the set of sequences holding the cell.  Per sequence: the
ordered ``(pos, cell)`` pairs it holds (:class:`SeqCells`, NumPy-backed), so
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
import operator
from collections.abc import Iterator, Sequence
from typing import Any

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

#: A pair ``(pos, cell)`` is stored as one int64 key ``pos << 32 | cell``, so sorting the
#: keys sorts by position then cell (positions are int32 >= 0 in a book, cells < 2**32).
_CELL_BITS = 32
_CELL_MASK = (1 << _CELL_BITS) - 1
_POS_END = 1 << 31  # one past the largest position

#: Stamps of :class:`SeqCells` contents: a new, never reused value at every change
#: that is not an append at the end, so a reader that saw stamp ``t`` and ``n``
#: pairs knows that, while the stamp is still ``t``, those ``n`` pairs are unchanged.
_STAMPS = itertools.count(1)

_NO_KEYS = np.zeros(0, dtype=np.int64)

#: (stamp, pair count) and the last key of a :class:`SeqCells`, read by C-level ``map`` over
#: every sequence of a stream (a decode step at 256 sequences pays no Python call per sequence)
_STAMP_AND_N = operator.attrgetter("stamp", "_n")
_LAST_KEY = operator.attrgetter("_last")
_FIRST_KEY = operator.attrgetter("_first")
_STAMP = operator.attrgetter("stamp")
_N = operator.attrgetter("_n")


def _key(p: int, c: int) -> int:
    return (p << _CELL_BITS) | c


def _pos_key(p: int) -> int:
    """The smallest key at position ``p`` (clamped to the int32 range)."""
    return min(max(p, 0), _POS_END) << _CELL_BITS


class SeqCells(Sequence[tuple[int, int]]):
    """The ``(pos, cell)`` pairs one sequence holds in one stream, sorted by position
    then cell: a growable int64 array of keys (``pos << 32 | cell``).

    Reads like a sequence of tuples (``len``, indexing, slicing, iteration,
    ``==`` with a list of tuples) for callers that want pairs; the hot paths
    use :meth:`positions`, :meth:`cells` and :meth:`span` (NumPy arrays and
    index bounds).  Adding a pair after the last one is O(1) amortised;
    adding or removing elsewhere moves the later keys (one ``memmove``).
    """

    __slots__ = ("_first", "_keys", "_last", "_n", "stamp")

    def __init__(self) -> None:
        self._keys = _NO_KEYS
        self._n = 0
        #: the last key as a Python int (-1 when empty): the decode append compares against it,
        #: and ``seq_pos_max`` of every sequence is read without a NumPy scalar per sequence
        self._last = -1
        #: the first key likewise (a window cache asks every sequence whether its oldest pair left the window)
        self._first = -1
        #: changes at every edit that is not an append at the end (see ``_STAMPS``)
        self.stamp = next(_STAMPS)

    # -- reads ----------------------------------------------------------------------
    @property
    def keys(self) -> np.ndarray:
        """The sorted keys (a view: never write through it)."""
        return self._keys[: self._n]

    def positions(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return self._keys[lo : self._n if hi is None else hi] >> _CELL_BITS

    def cells(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        return self._keys[lo : self._n if hi is None else hi] & _CELL_MASK

    def pairs_from(self, lo: int) -> list[tuple[int, int]]:
        """The pairs from index ``lo`` on, as tuples (O(pairs returned))."""
        return [(k >> _CELL_BITS, k & _CELL_MASK) for k in self._keys[lo : self._n].tolist()]

    def first_pos(self) -> int:
        return self._first >> _CELL_BITS  # -1 >> 32 is -1: empty

    def last_pos(self) -> int:
        return self._last >> _CELL_BITS  # -1 >> 32 is -1: empty

    @property
    def last_key(self) -> int:
        """The last key (``pos << 32 | cell``), -1 when empty; O(1)."""
        return self._last

    def span(self, p0: int, p1: int) -> tuple[int, int]:
        """Index bounds ``[lo, hi)`` of the pairs with ``p0 <= pos < p1``; O(log n)."""
        if p1 <= p0 or not self._n:
            return 0, 0
        keys = self.keys
        lo = int(np.searchsorted(keys, _pos_key(p0))) if p0 > 0 else 0
        hi = self._n if p1 >= _POS_END else int(np.searchsorted(keys, _pos_key(p1)))
        return lo, max(lo, hi)

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        keys = self.keys
        return zip((keys >> _CELL_BITS).tolist(), (keys & _CELL_MASK).tolist(), strict=True)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            keys = self.keys[i]
            return list(zip((keys >> _CELL_BITS).tolist(), (keys & _CELL_MASK).tolist(), strict=True))
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"pair {i} out of range ({self._n} pairs)")
        k = int(self._keys[i])  # no view of the keys: one read (the k-pool layout's decode append)
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

    def copy(self) -> SeqCells:
        out = SeqCells()
        out._keys = self._keys[: self._n].copy() if self._n else _NO_KEYS
        out._n = self._n
        out._last = self._last
        out._first = self._first
        return out

    # -- edits --------------------------------------------------------------------------
    def _room(self, extra: int) -> None:
        need = self._n + extra
        if need > self._keys.size:
            grown = np.empty(max(8, need, 2 * self._keys.size), dtype=np.int64)
            grown[: self._n] = self._keys[: self._n]
            self._keys = grown

    def add(self, p: int, c: int) -> None:
        k = _key(int(p), int(c))
        n = self._n
        self._room(1)
        keys = self._keys
        if k > self._last:
            keys[n] = k
            self._last = k
        else:
            i = int(np.searchsorted(keys[:n], k))
            keys[i + 1 : n + 1] = keys[i:n]  # NumPy copies overlapping slices correctly
            keys[i] = k
            self.stamp = next(_STAMPS)
        if n == 0 or k < self._first:
            self._first = k
        self._n = n + 1

    def add_key(self, k: int) -> None:
        """:meth:`add` of a pair given as its key (the decode path: usually an append)."""
        n = self._n
        if k > self._last and n < self._keys.size:
            self._keys[n] = k
            self._n = n + 1
            self._last = k
            if n == 0:
                self._first = k
        else:
            self.add(k >> _CELL_BITS, k & _CELL_MASK)

    def add_many(self, keys_sorted: np.ndarray) -> None:
        """Add sorted keys none of which is held yet (one merge)."""
        m = int(keys_sorted.size)
        if not m:
            return
        n = self._n
        self._room(m)
        if keys_sorted[0] > self._last:
            self._keys[n : n + m] = keys_sorted
        else:
            merged = np.concatenate([self._keys[:n], keys_sorted])
            merged.sort(kind="stable")
            self._keys[: n + m] = merged
            self.stamp = next(_STAMPS)
        self._n = n + m
        self._last = int(self._keys[n + m - 1])
        self._first = int(self._keys[0])

    def remove(self, p: int, c: int) -> None:
        self.remove_key(_key(p, c))

    def remove_key(self, k: int) -> None:
        """Remove one held pair given as its key: O(1) for the oldest or the newest."""
        n, keys = self._n, self._keys
        if n and k == self._last:
            pass  # the newest: just shorter
        elif n and keys[0] == k:
            keys[: n - 1] = keys[1:n]
        else:
            i = int(np.searchsorted(keys[:n], k))
            if i >= n or keys[i] != k:
                raise InvariantError("kv-seq-pos", f"pair (pos {k >> _CELL_BITS}, cell {k & _CELL_MASK}) is not held")
            keys[i : n - 1] = keys[i + 1 : n]
        self._n = n - 1
        self._last = int(keys[n - 2]) if n > 1 else -1
        self._first = int(keys[0]) if n > 1 else -1
        self.stamp = next(_STAMPS)

    def remove_many(self, keys_sorted: np.ndarray) -> None:
        """Remove sorted keys, every one of them held (a tail is cut in O(m))."""
        m = int(keys_sorted.size)
        if not m:
            return
        n = self._n
        keys = self._keys[:n]
        # m distinct held keys (the precondition) between the first and the last of a run of m
        # held keys are exactly that run: the ends alone tell a tail or a head (O(1) each)
        if m <= n and int(keys_sorted[-1]) == self._last and keys[n - m] == keys_sorted[0]:
            self._n = n - m
        elif m <= n and keys[0] == keys_sorted[0] and keys[m - 1] == keys_sorted[-1]:
            # the oldest pairs (a window cache reusing a sequence's first cells): one move
            self._keys[: n - m] = self._keys[m:n]
            self._n = n - m
        else:
            idx = np.searchsorted(keys, keys_sorted)
            if (idx >= n).any() or not np.array_equal(keys[np.minimum(idx, n - 1)], keys_sorted):
                raise InvariantError("kv-seq-pos", "removing pairs that are not held")
            kept = np.delete(keys, idx)
            self._keys[: kept.size] = kept
            self._n = int(kept.size)
        self._last = int(self._keys[self._n - 1]) if self._n else -1
        self._first = int(self._keys[0]) if self._n else -1
        self.stamp = next(_STAMPS)


def stamps_and_counts(seqs: Sequence[SeqCells]) -> Iterator[tuple[int, int]]:
    """``(stamp, len)`` of each of ``seqs``, lazily, with no Python call per sequence."""
    return map(_STAMP_AND_N, seqs)


def last_keys(seqs: Sequence[SeqCells]) -> Iterator[int]:
    """:attr:`SeqCells.last_key` of each of ``seqs``, lazily, with no Python call per sequence."""
    return map(_LAST_KEY, seqs)


def first_positions(seqs: Sequence[SeqCells]) -> np.ndarray:
    """``first_pos()`` of each of ``seqs`` (-1: holds nothing) as one int64 array."""
    keys = np.fromiter(map(_FIRST_KEY, seqs), dtype=np.int64, count=len(seqs))
    return keys >> _CELL_BITS


def last_positions(seqs: Sequence[SeqCells]) -> np.ndarray:
    """``last_pos()`` of each of ``seqs`` (-1: holds nothing) as one int64 array."""
    keys = np.fromiter(map(_LAST_KEY, seqs), dtype=np.int64, count=len(seqs))
    return keys >> _CELL_BITS  # an arithmetic shift: -1 stays -1


class CellJournal:
    """Before-images of the cells of one stream that mutations touched while attached
    (:meth:`KVCells.attach`), and the book's counters: :meth:`KVCells.rollback`
    puts the stream back exactly as it was at attach time.

    Each cell is saved once, at its first touch: one at a time (``saved``, ``empty_before``)
    or, for the bulk mutations, a whole set of cells as arrays (``bulk``), so that a decode
    step that reuses 256 window cells saves them with a few NumPy copies, not 256 tuples."""

    __slots__ = ("bulk", "bulk_cells", "counts", "empty_before", "has_shift", "removals", "saved", "stamps", "used")

    def __init__(self, cells: KVCells) -> None:
        #: cell -> (pos, ext x, ext y, shift, sequences) of a cell that held a position at its first touch
        self.saved: dict[int, tuple[int, int, int, int, tuple[int, ...]]] = {}
        #: cells that were empty at their first touch
        self.empty_before: set[int] = set()
        #: (cells, pos, ext, shift, sequence rows) of cells saved together, each holding a position
        #: at its first touch; ``bulk_cells`` is every cell of them (disjoint from ``saved``)
        self.bulk: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.bulk_cells: set[int] = set()
        self.used = cells.used
        self.has_shift = cells.has_shift
        self.removals = cells.removals
        #: each sequence's (stamp, pair count) at attach: given back by a rollback that finds the
        #: same pairs (O(sequences), so a reader of the pairs need not read them again)
        seq_pos = cells.seq_pos
        self.stamps = np.fromiter(map(_STAMP, seq_pos), dtype=np.int64, count=len(seq_pos))
        self.counts = np.fromiter(map(_N, seq_pos), dtype=np.int64, count=len(seq_pos))

    def _seen(self, i: int) -> bool:
        return i in self.saved or i in self.empty_before or i in self.bulk_cells

    def touch(self, cells: KVCells, i: int) -> None:
        if self._seen(i):
            return
        if cells.pos[i] == EMPTY:
            self.empty_before.add(i)
        else:
            x, y = cells.ext[i]
            self.saved[i] = (int(cells.pos[i]), int(x), int(y), int(cells.shift[i]), tuple(cells.seqs_of(i)))

    def touch_many(self, cells: KVCells, idx: np.ndarray) -> None:
        """:meth:`touch` for the cells ``idx`` (distinct, each holding a position), read in bulk."""
        if self.saved or self.empty_before or self.bulk_cells:
            new = [i for i in idx.tolist() if not self._seen(i)]
            if not new:
                return
            sel = np.asarray(new, dtype=np.int64)
        else:  # the first touch of this journal (a decode step's window reuse): every cell is new
            new = idx.tolist()
            sel = np.array(idx, dtype=np.int64)
        self.bulk.append((sel, cells.pos[sel], cells.ext[sel], cells.shift[sel], cells.seq[sel]))
        self.bulk_cells.update(new)

    def touch_empty(self, idx: np.ndarray) -> None:
        """The cells ``idx``, all empty now, are about to be placed in bulk.  (One
        already saved with a position keeps that before-image: rollback empties
        every touched cell before it puts the saved ones back.)"""
        self.empty_before.update(idx.tolist())

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
        self.seq_pos: list[SeqCells] = [SeqCells() for _ in range(self.n_seq_max)]
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
        out.seq_pos = [sc.copy() for sc in self.seq_pos]
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
        if n <= 0:
            return out
        start = min(max(start, 0), self.size)
        self._collect_free(start, self.size, n, out)
        if len(out) < n and start > 0:
            self._collect_free(0, start, n, out)
        return out

    def _collect_free(self, lo: int, hi: int, n: int, out: list[int]) -> None:
        i = lo
        while i < hi and len(out) < n:
            b = i >> BLOCK_SHIFT
            if self._nfree[b] == 0:
                nb = self._next_block_with_free(b + 1, ((hi - 1) >> BLOCK_SHIFT) + 1)
                if nb < 0:
                    return
                i = nb << BLOCK_SHIFT
                continue
            end = min((b + 1) << BLOCK_SHIFT, hi)
            free = np.flatnonzero(self.pos[i:end] == EMPTY)
            out.extend((free[: n - len(out)] + i).tolist())
            i = end

    def _next_block_with_free(self, b0: int, b1: int) -> int:
        while b0 < b1:
            w = min(b1, b0 + _BLOCK_WINDOW)
            nz = np.flatnonzero(self._nfree[b0:w])
            if nz.size:
                return b0 + int(nz[0])
            b0 = w
        return -1

    def oldest_alone_many(self, seqs: Sequence[int], p_end: np.ndarray, need: int) -> list[int]:
        """:meth:`oldest_alone` of ``seqs`` in order (``p_end[k]`` for ``seqs[k]``), until ``need``
        cells are found: the same cells as a loop of calls, but read with NumPy for many
        sequences at once (a decode step of a full window cache asks each of its 256 sequences
        for about one cell): the sequences whose oldest pair is below their end, then the first
        :data:`_HEAD` pairs of those, in runs that double until ``need`` is met; a sequence whose
        first pairs are all below its end may hold more there, and is asked alone."""
        if need <= 0 or not len(seqs):
            return []
        seq_pos = self.seq_pos
        end_key = np.clip(np.asarray(p_end, dtype=np.int64), 0, _POS_END) << _CELL_BITS
        first = np.fromiter(map(_FIRST_KEY, [seq_pos[s] for s in seqs]), dtype=np.int64, count=len(seqs))
        giving = np.flatnonzero((first >= 0) & (first < end_key)).tolist()
        out: list[int] = []
        if len(giving) <= 2:  # one or two sequences give (a small batch): asked one by one, no gather
            for g in giving:
                out += self.oldest_alone(seqs[g], int(end_key[g] >> _CELL_BITS), need - len(out))
                if len(out) >= need:
                    break
            return out
        lo, run = 0, 16
        while lo < len(giving) and len(out) < need:
            sel = giving[lo : lo + run]
            out += self._oldest_alone_heads([seqs[g] for g in sel], end_key[sel], need - len(out))
            lo, run = lo + run, 2 * run
        return out

    def _oldest_alone_heads(self, seqs: list[int], end_key: np.ndarray, need: int) -> list[int]:
        """:meth:`oldest_alone_many` of sequences that each give at least one pair."""
        seq_pos = self.seq_pos
        heads = [seq_pos[s]._keys[: min(_HEAD, seq_pos[s]._n)] for s in seqs]
        lens = np.fromiter(map(len, heads), dtype=np.int64, count=len(heads))
        flat = np.concatenate(heads)
        row = np.repeat(np.arange(len(heads)), lens)
        below = flat < end_key[row]
        cells = flat & _CELL_MASK
        take = below & (self.n_owner[cells] == 1)
        more = (np.bincount(row, weights=below, minlength=len(heads)) == _HEAD).nonzero()[0].tolist()
        out: list[int] = []
        lo = 0
        for r in [*more, len(heads)]:
            seg = take & (row >= lo) & (row < r) if lo or r < len(heads) else take
            out += cells[seg][: need - len(out)].tolist()
            if len(out) >= need or r == len(heads):
                break
            out += self._oldest_alone_from(seqs[r], 0, int(end_key[r] >> _CELL_BITS), need - len(out))
            if len(out) >= need:
                break
            lo = r + 1
        return out

    def oldest_alone(self, s: int, p_end: int, need: int) -> list[int]:
        """Up to ``need`` cells of ``s`` at positions below ``p_end`` that ``s`` holds alone,
        oldest first (a window cache's reusable cells).  The first few pairs are read one
        by one (a decode step takes about one cell per sequence), then a slice at a time:
        O(cells taken + shared cells skipped), never the whole sequence."""
        out: list[int] = []
        if need <= 0 or p_end <= 0:
            return out
        sc = self.seq_pos[s]
        keys, n, end_key, owners = sc._keys, len(sc), _pos_key(p_end), self.n_owner
        j = 0
        while j < min(n, 8) and len(out) < need:
            k = int(keys[j])
            if k >= end_key:
                return out
            c = k & _CELL_MASK
            if owners[c] == 1:
                out.append(c)
            j += 1
        if len(out) >= need or j >= n:
            return out
        return out + self._oldest_alone_from(s, j, p_end, need - len(out))

    def _oldest_alone_from(self, s: int, j: int, p_end: int, need: int) -> list[int]:
        """:meth:`oldest_alone` from the ``j``-th pair of ``s`` on, a slice at a time."""
        out: list[int] = []
        if need <= 0 or p_end <= 0:
            return out
        sc, owners = self.seq_pos[s], self.n_owner
        _, hi = sc.span(0, p_end)
        while j < hi and len(out) < need:
            stop = min(hi, j + max(64, 2 * (need - len(out))))
            cand = sc.cells(j, stop)
            cand = cand[owners[cand] == 1]
            out.extend(cand[: need - len(out)].tolist())
            j = stop
        return out

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
            if (self.seq_pos[s]._first, self.seq_pos[s].last_key) != (
                (int(expect[0]), int(expect[-1])) if expect.size else (-1, -1)
            ):
                raise InvariantError("kv-seq-pos", f"first or last pair of seq {s} out of step")
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
        if journal.empty_before:
            self.rm_many(np.fromiter(journal.empty_before, dtype=np.int64, count=len(journal.empty_before)))
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
            now = np.fromiter(map(_N, self.seq_pos), dtype=np.int64, count=len(self.seq_pos))
            for s in np.flatnonzero(now == journal.counts).tolist():
                self.seq_pos[s].stamp = int(journal.stamps[s])
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

    def _empty(self, i: int) -> None:
        self.pos[i] = EMPTY
        self.ext[i] = 0
        self.shift[i] = 0
        self.used -= 1
        self._nfree[i >> BLOCK_SHIFT] += 1
        if i == self._hi - 1:
            self._hi_dirty = True

    def place_seqs(self, idx: np.ndarray, pos: np.ndarray, ext: np.ndarray, seqs: np.ndarray) -> None:
        """Occupy the empty cells ``idx`` (distinct) at positions ``pos`` with 2-D
        extensions ``ext`` [n, 2], cell ``idx[k]`` held by sequence ``seqs[k]`` alone:
        the bulk form of ``pos_set`` + ``seq_add`` (a ubatch with one sequence per
        token), vectorised but for one append per sequence."""
        n = int(idx.size)
        if not n:
            return
        if self._journal is not None:
            self._journal.touch_empty(idx)
        self.pos[idx] = pos
        self.ext[idx] = ext
        self.shift[idx] = 0
        self.seq[idx, seqs] = True
        self.n_owner[idx] = 1
        self.used += n
        np.subtract.at(self._nfree, idx >> BLOCK_SHIFT, 1)
        top = int(idx.max()) + 1
        if top > self._hi:
            self._hi = top
        keys = (pos << _CELL_BITS) | idx
        if n == 1:
            k = int(keys[0])
            self.seq_pos[int(seqs[0])].add(k >> _CELL_BITS, k & _CELL_MASK)
            return
        if np.bincount(seqs).max() == 1:  # one cell per sequence (a decode step): one append each
            seq_pos = self.seq_pos
            for s, k in zip(seqs.tolist(), keys.tolist(), strict=True):
                seq_pos[s].add_key(k)  # an append: compares Python ints, writes one key
            return
        order = np.lexsort((keys, seqs))
        seqs_sorted, keys_sorted = seqs[order], keys[order]
        new_seq = seqs_sorted[1:] != seqs_sorted[:-1]
        starts = np.flatnonzero(np.r_[True, new_seq])
        ends = np.r_[starts[1:], n]
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            sc = self.seq_pos[int(seqs_sorted[a])]
            if b - a == 1:
                k = int(keys_sorted[a])
                sc.add(k >> _CELL_BITS, k & _CELL_MASK)
            else:
                sc.add_many(keys_sorted[a:b])

    def _put_back(self, idx: np.ndarray, pos: np.ndarray, ext: np.ndarray, shift: np.ndarray, seq: np.ndarray) -> None:
        """Occupy the empty cells ``idx`` (distinct) with saved contents: positions, 2-D
        extensions, shifts and sequence rows ``[n, n_seq_max]`` (a bulk before-image of
        :class:`CellJournal`); the journal must be detached."""
        n = int(idx.size)
        if not n:
            return
        self.pos[idx] = pos
        self.ext[idx] = ext
        self.shift[idx] = shift
        self.seq[idx] = seq
        self.n_owner[idx] = seq.sum(axis=1)
        self.used += n
        np.subtract.at(self._nfree, idx >> BLOCK_SHIFT, 1)
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
        np.add.at(self._nfree, idx >> BLOCK_SHIFT, 1)
        if int(idx.max()) >= self._hi - 1:
            self._hi_dirty = True

    def owner_pairs(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``np.nonzero(self.seq[idx])``: every (row of ``idx``, sequence) pair, rows ascending,
        each row's sequences ascending; one ``argmax`` when every cell has one owner."""
        if (self.n_owner[idx] == 1).all():
            return np.arange(idx.size), self.seq[idx].argmax(axis=1)
        rows, seqs = np.nonzero(self.seq[idx])
        return rows, seqs

    def rm_many(self, idx: np.ndarray, owners: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Empty the cells ``idx`` (distinct), whatever sequences hold them; vectorised.
        ``owners``: :meth:`owner_pairs` of ``idx`` when the caller has it (every cell then
        holds a position)."""
        if owners is None:
            idx = idx[self.pos[idx] != EMPTY]
        if not idx.size:
            return
        if self._journal is not None:
            self._journal.touch_many(self, idx)
        rows, seqs = self.owner_pairs(idx) if owners is None else owners  # every (cell, sequence) pair dropped
        keys = ((self.pos[idx] << _CELL_BITS) | idx)[rows]
        order = np.lexsort((keys, seqs))
        seqs, keys = seqs[order], keys[order]
        new_seq = seqs[1:] != seqs[:-1]
        if new_seq.all():  # one cell per sequence (a decode step's window reuse): no grouping
            for q, k in zip(seqs.tolist(), keys.tolist(), strict=True):
                self.seq_pos[q].remove_key(k)
        else:
            bounds = [0, *(np.flatnonzero(new_seq) + 1).tolist(), int(seqs.size)]
            seq_l, key_l = seqs.tolist(), keys.tolist()
            for a, b in itertools.pairwise(bounds):
                sc = self.seq_pos[seq_l[a]]
                n, m, held = sc._n, b - a, sc._keys
                if m < n and sc._first == key_l[a] and held[m - 1] == key_l[b - 1]:
                    # a sequence's oldest pairs (a window cache's reuse): SeqCells.remove_many's
                    # head case, inlined (once per sequence that gave cells)
                    held[: n - m] = held[m:n]
                    sc._n = n - m
                    sc._first = int(held[0])
                    sc.stamp = next(_STAMPS)
                else:
                    sc.remove_many(keys[a:b])
        self.removals += int(seqs.size)
        self.seq[idx] = False
        self.n_owner[idx] = 0
        self._empty_many(idx)

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
        self.removals += sum(len(sc) for sc in self.seq_pos)
        self.pos[:] = EMPTY
        self.ext[:] = 0
        self.shift[:] = 0
        self.seq[:] = False
        self.used = 0
        self.has_shift = False
        self.seq_pos = [SeqCells() for _ in range(self.n_seq_max)]
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
