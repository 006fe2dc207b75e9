"""Do the books of tensor-parallel ranks agree?  A hash per step, details on a mismatch.

Every rank of a tensor-parallel memory sees the same batches and the same
sequence edits, so its book (cells, positions, owners, rollback provenance,
the KV cells and their sequence sets) is every other rank's by construction;
only the rows differ.  A rank that diverges (a runtime bug that skipped an
edit on one rank, a batch split differently) corrupts its shard silently
until the outputs go wrong many steps later.  :func:`check_books` finds it at
the step it happens: every rank hashes its book; one all-reduce of
``(max, -min)`` of the hashes tells whether they agree (the cost of a
healthy step: one 16-byte all-reduce plus hashing O(cells) integers); only
on a mismatch are the books gathered to name the first field, cell and
sequence that differ, and every rank raises the same
:class:`~statecache.distributed.errors.BookDivergenceError`.

:class:`BookCheck` runs it every ``every`` steps; :meth:`BookCheck.wrap`
makes a memory context check after each ``apply()``.  The checks are
collectives: every rank must make the same calls, as every rank already
makes the same memory calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from statecache.distributed.errors import BookDivergenceError
from statecache.errors import ArgumentError
from statecache.memory import MemoryContext, MemoryStatus


@dataclasses.dataclass
class BookField:
    """One array of a book.  ``per``: what axis 0 indexes (``"cell"``, ``"seq"`` or
    ``""``); ``owners``: for per-cell fields, the field that says which sequences own
    a cell (``tail``: per sequence, its cell; ``matrix``: per cell, a row of flags)."""

    name: str
    values: np.ndarray
    per: str = ""
    owners: str = ""

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.name}|{self.values.dtype.str}|{self.values.shape}".encode())
        h.update(np.ascontiguousarray(self.values).data)
        return h.digest()


def _recurrent_fields(prefix: str, memory: Any) -> list[BookField]:
    b = memory.book_snapshot()
    tail = f"{prefix}.tail"
    fields = [BookField(f"{prefix}.{n}", getattr(b, n), "cell", tail) for n in ("pos", "src", "snap_end", "snap_valid")]
    fields.append(BookField(f"{prefix}.n_own", b.n_own, "cell", tail))
    fields.append(BookField(tail, b.tail, "seq"))
    fields.append(BookField(f"{prefix}.head_used", np.asarray([b.head, b.used], dtype=np.int64)))
    return fields


def _kv_fields(prefix: str, cache: Any) -> list[BookField]:
    out = []
    for strm, cells in enumerate(cache.cells):
        p = f"{prefix}.stream[{strm}]"
        seq = f"{p}.seq"
        out += [
            BookField(f"{p}.pos", cells.pos, "cell", seq),
            BookField(f"{p}.ext", cells.ext, "cell", seq),
            BookField(f"{p}.shift", cells.shift, "cell", seq),
            BookField(seq, cells.seq.astype(np.uint8), "cell", seq),
            BookField(f"{p}.used", np.asarray([cells.used], dtype=np.int64)),
        ]
    return out


def book_fields(memory: Any) -> list[BookField]:
    """The book of a recurrent, KV, hybrid, hybrid-iSWA or hybrid-idx memory as named arrays."""
    from statecache.hybrid import HybridMemory
    from statecache.kv_cache import KVCache, KVCacheISWA
    from statecache.recurrent import RecurrentMemory

    if isinstance(memory, HybridMemory):
        out = []
        for cache in memory.kv_caches:
            out += _kv_fields(f"attention.{cache.name}", cache)
        out += _recurrent_fields("recurrent", memory.recr)
        idx = getattr(memory, "idx", None)
        if idx is not None:
            out += _kv_fields("indexer", idx)
        return out
    if isinstance(memory, RecurrentMemory):
        return _recurrent_fields("recurrent", memory)
    if isinstance(memory, KVCacheISWA):
        return [f for cache in memory.caches for f in _kv_fields(f"attention.{cache.name}", cache)]
    if isinstance(memory, KVCache):
        return _kv_fields(f"attention.{memory.name}", memory)
    raise ArgumentError("memory", f"no book layout is known for {type(memory).__name__}")


def book_digest(fields: Sequence[BookField]) -> int:
    """One 62-bit hash of a whole book (non-negative, so its negation fits int64)."""
    h = hashlib.blake2b(digest_size=8)
    for f in fields:
        h.update(f.digest())
    return int.from_bytes(h.digest(), "little") >> 2


def _owners(book: dict[str, BookField], field: BookField, cell: int) -> set[int]:
    own = book.get(field.owners)
    if own is None or field.per != "cell":
        return set()
    if own.per == "seq":  # tail: sequence -> cell
        return {int(q) for q in np.flatnonzero(own.values == cell)}
    return {int(q) for q in np.flatnonzero(own.values[cell])} if cell < own.values.shape[0] else set()


def first_divergence(books: Sequence[Sequence[BookField]]) -> BookDivergenceError | None:
    """The first field (in book order) where some rank's book differs from rank 0's,
    as the error every rank raises; None when all books are equal."""
    base = books[0]
    names = [f.name for f in base]
    for r, book in enumerate(books):
        if [f.name for f in book] != names:
            return BookDivergenceError(
                "fields", [r], None, [], f"rank {r}'s memory has book fields {[f.name for f in book]}, rank 0 {names}"
            )
    for k, f0 in enumerate(base):
        ranks = [r for r in range(1, len(books)) if not np.array_equal(books[r][k].values, f0.values)]
        if not ranks:
            continue
        index: int | None = None
        seqs: set[int] = set()
        for r in ranks:
            a, b = f0.values, books[r][k].values
            if a.shape != b.shape:
                continue
            i = int(np.argwhere(a != b)[0][0])
            if index is None or i < index:
                index = i
        if index is not None:
            for r in (0, *ranks):
                seqs |= _owners({f.name: f for f in books[r]}, books[r][k], index)
            if f0.per == "seq":
                seqs.add(index)
            elif f0.values.ndim == 2 and f0.owners == f0.name:  # a sequence-set row: the flags that differ
                seqs |= {int(q) for r in ranks for q in np.flatnonzero(books[r][k].values[index] != f0.values[index])}
        where = "" if index is None else f" at {f0.per or 'entry'} {index}"
        if seqs:
            where += f" (sequence{'s' if len(seqs) > 1 else ''} {', '.join(map(str, sorted(seqs)))})"
        if index is None:
            have = ", ".join(f"rank {r} has shape {books[r][k].values.shape}" for r in (0, *ranks))
        else:
            have = ", ".join(f"rank {r} has {books[r][k].values[index].tolist()}" for r in (0, *ranks))
        names_r = ", ".join(map(str, ranks))
        return BookDivergenceError(
            f0.name,
            ranks,
            index,
            sorted(seqs),
            f"book of rank{'s' if len(ranks) > 1 else ''} {names_r} differs from rank 0's in field "
            f"{f0.name!r}{where}: {have}",
        )
    return None


def check_books(memory: Any, group: Any = None) -> None:
    """Collective: raise :class:`BookDivergenceError` on every rank of ``group`` when
    the ranks' books differ (naming the first field, the ranks, the cell and the
    sequences).  A healthy check costs one all-reduce of two int64."""
    from statecache.distributed.wire import group_device, group_rank, torch_dist

    torch, dist = torch_dist()
    fields = book_fields(memory)
    digest = book_digest(fields)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = (int(x) for x in t.tolist())
    if hi == -neg_lo:
        return
    _, world = group_rank(group)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, fields, group=group)
    err = first_divergence(every)
    if err is None:  # pragma: no cover - equal books hash equal
        raise BookDivergenceError("digest", [], None, [], "book hashes differ but the gathered books are equal")
    raise err


class BookCheck:
    """Debug mode: :func:`check_books` every ``every`` steps (``every=1``: each step)."""

    def __init__(self, memory: Any, group: Any = None, every: int = 1) -> None:
        if every < 1:
            raise ArgumentError("every", f"must be >= 1, got {every}")
        self.memory = memory
        self.group = group
        self.every = int(every)
        self.steps = 0

    def step(self) -> None:
        """Count one step; check on every ``every``-th."""
        self.steps += 1
        if self.steps % self.every == 0:
            check_books(self.memory, self.group)

    def wrap(self, ctx: MemoryContext) -> MemoryContext:
        """``ctx`` whose ``apply()`` and ``undo()`` are followed by a step of this check."""
        return _CheckedContext(ctx, self)


class _CheckedContext(MemoryContext):
    """A context that checks the books after each apply / undo; everything else is ``inner``'s."""

    def __init__(self, inner: MemoryContext, check: BookCheck) -> None:
        self.inner = inner
        self.check = check

    @property
    def status(self) -> MemoryStatus:
        return self.inner.status

    def get_ubatch(self) -> Any:
        return self.inner.get_ubatch()

    def apply(self) -> bool:
        ok = self.inner.apply()
        self.check.step()
        return ok

    def next(self) -> bool:
        return self.inner.next()

    def undo(self, n: int | None = None, *, drop: bool = False) -> tuple[int, ...]:
        dropped = self.inner.undo(n, drop=drop)
        self.check.step()
        return dropped

    def __getattr__(self, name: str) -> Any:  # recr / attn / step() of the wrapped context
        return getattr(self.inner, name)
