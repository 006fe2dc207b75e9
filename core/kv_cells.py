"""The attention KV cell book of one stream (docs/memory-semantics.md#kv-cells).

Per cell: a position (``-1`` = empty), a 2-D position extension ``(x, y)``
for M-RoPE ties, an accumulated pending shift (for the runtime's RoPE
re-rotation), and the set of sequences holding the cell.  Per sequence: the
ordered list of ``(pos, cell)`` pairs it holds, so that ``seq_pos_min`` and
``seq_pos_max`` are O(1) and the k-pool layout (docs/memory-semantics.md#kpool-layout) can read a
sequence's cells in order without scanning the stream.

Everything here is host-side bookkeeping; no device buffer is touched.
"""

from __future__ import annotations

import bisect

import numpy as np

from statecache.errors import ArgumentError, InvariantError

EMPTY = -1


class KVCells:
    """The cells of one stream.

    ``n_seq_max`` bounds sequence ids (``0 <= s < n_seq_max``).  The ordered
    per-sequence pair lists are the single source of truth for
    ``seq_pos_min/max``; every mutation below keeps them in step with the
    per-cell arrays.
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
        self.seq_pos: list[list[tuple[int, int]]] = [[] for _ in range(self.n_seq_max)]
        self.removals = 0  # (cell, sequence) pairs ever dropped: tells a caller whether an edit removed anything

    # -- copies (plans run on a clone, so planning never mutates the book) ---
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
        # the pairs are tuples of ints (immutable): copying each list is a deep copy, and
        # 20x cheaper than copy.deepcopy (a hybrid plans on a clone of every stream each step)
        out.seq_pos = [list(pairs) for pairs in self.seq_pos]
        out.removals = self.removals
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
            and self.seq_pos == other.seq_pos
        )

    # -- queries ----------------------------------------------------------------
    def is_empty(self, i: int) -> bool:
        return bool(self.pos[i] == EMPTY)

    def pos_get(self, i: int) -> int:
        return int(self.pos[i])

    def seq_has(self, i: int, s: int) -> bool:
        return bool(self.seq[i, s])

    def seq_count(self, i: int) -> int:
        return int(self.seq[i].sum())

    def seqs_of(self, i: int) -> list[int]:
        return [int(s) for s in np.flatnonzero(self.seq[i])]

    def seq_pos_min(self, s: int) -> int:
        pairs = self.seq_pos[s]
        return pairs[0][0] if pairs else -1

    def seq_pos_max(self, s: int) -> int:
        pairs = self.seq_pos[s]
        return pairs[-1][0] if pairs else -1

    def seq_cells(self, s: int) -> list[tuple[int, int]]:
        """The ``(pos, cell)`` pairs of ``s`` sorted by position then cell."""
        return list(self.seq_pos[s])

    def used_max_p1(self) -> int:
        """One past the highest non-empty cell (0 when the stream is empty)."""
        nz = np.flatnonzero(self.pos != EMPTY)
        return int(nz[-1]) + 1 if nz.size else 0

    def check(self) -> None:
        """Raise :class:`InvariantError` unless the book is consistent (tests call
        this after every step; explicit raises, so ``python -O`` keeps them)."""
        n_used = int((self.pos != EMPTY).sum())
        if self.used != n_used:
            raise InvariantError("kv-used", f"used is {self.used} but {n_used} cells hold a position")
        for i in range(self.size):
            if self.pos[i] == EMPTY and self.seq[i].any():
                raise InvariantError("kv-empty", f"empty cell {i} holds sequences")
            if self.pos[i] != EMPTY and not self.seq[i].any():
                raise InvariantError("kv-empty", f"cell {i} at pos {self.pos[i]} holds no sequence")
        for s in range(self.n_seq_max):
            expect = sorted((int(self.pos[i]), int(i)) for i in np.flatnonzero(self.seq[:, s]))
            if self.seq_pos[s] != expect:
                raise InvariantError("kv-seq-pos", f"ordered positions of seq {s} out of step")
        if self.shift.any() and not self.has_shift:
            raise InvariantError("kv-shift", "a cell holds a shift but has_shift is False")

    # -- per-sequence ordered positions ------------------------------------------
    def _index_add(self, s: int, p: int, i: int) -> None:
        bisect.insort(self.seq_pos[s], (p, i))

    def _index_rm(self, s: int, p: int, i: int) -> None:
        pairs = self.seq_pos[s]
        k = bisect.bisect_left(pairs, (p, i))
        assert k < len(pairs) and pairs[k] == (p, i)
        del pairs[k]
        self.removals += 1

    # -- cell mutations -----------------------------------------------------------
    def pos_set(self, i: int, p: int, ext: tuple[int, int] = (0, 0)) -> None:
        """Occupy an empty cell at position ``p`` (sequences are added after)."""
        assert self.pos[i] == EMPTY, f"cell {i} is not empty"
        assert p >= 0
        self.pos[i] = p
        self.ext[i] = ext
        self.shift[i] = 0
        self.used += 1

    def seq_add(self, i: int, s: int) -> None:
        assert self.pos[i] != EMPTY
        if not self.seq[i, s]:
            self.seq[i, s] = True
            self._index_add(s, int(self.pos[i]), i)

    def seq_rm(self, i: int, s: int) -> bool:
        """Drop ``s`` from cell ``i``; True when the cell became empty."""
        if not self.seq[i, s]:
            return False
        self.seq[i, s] = False
        self._index_rm(s, int(self.pos[i]), i)
        if not self.seq[i].any():
            self._empty(i)
            return True
        return False

    def rm(self, i: int) -> None:
        """Empty cell ``i`` whatever sequences hold it."""
        if self.pos[i] == EMPTY:
            return
        p = int(self.pos[i])
        for s in np.flatnonzero(self.seq[i]):
            self._index_rm(int(s), p, i)
        self.seq[i] = False
        self._empty(i)

    def _empty(self, i: int) -> None:
        self.pos[i] = EMPTY
        self.ext[i] = 0
        self.shift[i] = 0
        self.used -= 1

    def _repos(self, i: int, new: int) -> None:
        old = int(self.pos[i])
        for s in np.flatnonzero(self.seq[i]):
            self._index_rm(int(s), old, i)
            self._index_add(int(s), new, i)
        self.pos[i] = new

    def pos_add(self, i: int, d: int) -> bool:
        """Shift cell ``i`` by ``d``; a position pushed below 0 empties the
        cell (True returned).  The shift accumulates for the RoPE update.  The
        2-D extension is left as it is (upstream's ``pos_add``: only ``pos`` moves)."""
        assert self.pos[i] != EMPTY
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
        old = int(self.pos[i])
        new = old // d
        self.shift[i] += new - old
        self.has_shift = True
        self._repos(i, new)

    def reset_shift(self) -> None:
        self.shift[:] = 0
        self.has_shift = False

    def reset(self) -> None:
        self.removals += sum(len(pairs) for pairs in self.seq_pos)
        self.pos[:] = EMPTY
        self.ext[:] = 0
        self.shift[:] = 0
        self.seq[:] = False
        self.used = 0
        self.has_shift = False
        self.seq_pos = [[] for _ in range(self.n_seq_max)]

    def snapshot(self, idxs: np.ndarray) -> tuple[np.ndarray, ...]:
        """Contents of a list of cells (restored exactly by :meth:`restore`)."""
        return (self.pos[idxs].copy(), self.ext[idxs].copy(), self.shift[idxs].copy(), self.seq[idxs].copy())

    def restore(self, idxs: np.ndarray, snap: tuple[np.ndarray, ...]) -> None:
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
