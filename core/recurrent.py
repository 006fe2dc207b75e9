"""The recurrent cell book with exact rollback planes (docs/memory-semantics.md#rollback).

Every sequence owns at most one *cell*; a cell holds the state of "every
token up to ``pos``" for each recurrent layer, as one row per state tensor
in a pool of ``size * (1 + n_rs_seq)`` rows (row ``p * size + c`` is plane
``p`` of cell ``c``).

**Rotating planes.**  No plane is "the live one" for good: a step reads each
sequence's state from the plane it is in and writes the new state into the
*next* plane (mod ``n_snap``), so the state it read stays where it was, as
the snapshot one token back.  A decode therefore writes one row per state
tensor with rollback planes as without them (vLLM's ``(N, 1 + K)`` state
slots work the same way); before rotation every decode also copied its input
state into a snapshot plane.

Book per cell: ``pos``, ``src`` (the pool row, of the cell's own planes at
rest, that holds the cell's *logical* state; ``-1`` for a new cell whose
state is zero), the number of owning sequences (which ones follows from the
per-sequence ``tail``), and snapshot provenance ``snap_end`` /
``snap_valid``: the *live plane* ``L`` of a cell is the plane its last write
ended in, and plane ``(L - j) mod n_snap`` holds the state after position
``snap_end - j`` for ``j < snap_valid``.  A pending rollback of depth ``d``
is ``src`` pointing ``d`` planes back from ``L`` with ``pos = snap_end - d``,
so ``L`` is never stored: it is ``src``'s plane plus ``snap_end - pos``
(:func:`_live_planes`).  A rollback is a property of the cell: it can never
go stale on a sequence that lost its cell (docs/memory-semantics.md#inv-31),
and sharing a cell shares its logical state; it costs no copy either (the
next step reads that plane and writes the one after it).

Deviations from upstream (the [REC] of the spec): rollback is exact or
refused (docs/memory-semantics.md#rollback-exact), a shared cell cannot be rolled back, negative sequence ids in
``seq_rm`` follow docs/memory-semantics.md#seq-rm, ``seq_add`` below position 0 removes the
state, a pending rollback is consumed when the ubatch that reads it is
committed (``apply``), ``state_read`` validates before touching anything,
and a failed compute can be undone (:meth:`RecurrentContext.undo`, docs/memory-semantics.md#failed-compute).

Cost: the whole book is one small int64 array (a plan copies it with one
memcpy), per-sequence lookups are O(1) array reads, and placing a ubatch is
vectorised and O(size): no work grows as ``n_seq_max ** 2``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from statecache.backend import Buffer, Device
from statecache.batch import BatchAllocator, SeqIds, UBatch
from statecache.dtypes import DType
from statecache.errors import ArgumentError, BatchError, InvariantError, StatecacheWarning, StateError
from statecache.hostmem import gather_rows, scatter_rows
from statecache.launch_memo import LaunchMemo
from statecache.memory import (
    POS_LAST,
    POS_MAX,
    ContextError,
    Memory,
    MemoryContext,
    MemoryStatus,
    RecurrentRows,
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
    view_guard,
)
from statecache.spec import MemorySpec, RecurrentLayerSpec
from statecache.state_io import (
    CODE_DTYPES,
    DTYPE_CODES,
    WITH_PLANES,
    Reader,
    RowWrite,
    Writer,
    expect_sections,
    find_section,
    pack_sections,
    planes_apart,
    rows_landing,
    rows_ready,
    unpack_sections,
)

SECTION_TAG = b"RECR"
#: Sanity bound on the snapshot planes a transfer may announce per cell (a memory keeps
#: ``caps.max_snapshots`` at most, 16 by default; anything near this is a corrupt count).
MAX_PLANES = 4096
_EMPTY_ROWS = np.zeros(0, dtype=np.int64)
_EMPTY_ROWS.flags.writeable = False


@dataclasses.dataclass(frozen=True)
class _TensorLayout:
    """One state tensor as the recurrent section describes it: its descriptor's bytes
    (name, dtype code, row bytes, as :class:`Writer` writes them) and the names its
    rows' fields carry in errors."""

    name: str
    buf: Buffer
    row_bytes: int
    desc: bytes
    rows_field: str
    planes_field: str


@dataclasses.dataclass(frozen=True)
class _SectionLayout:
    """The fields of a recurrent section that depend on the memory alone (its layers
    and pools, fixed when it is built): written as stored bytes, and read by comparing
    bytes (:meth:`Reader.match`), field by field only when they differ (to name what
    is wrong).  ``head``: ``s_trans, n_layer, n_state_layers``; per layer, the bytes of
    ``layer, n_tensors`` and its tensors."""

    head: bytes
    layers: tuple[tuple[int, bytes, tuple[_TensorLayout, ...]], ...]


class NonConsecutivePositionWarning(StatecacheWarning):
    """find_slot saw a ubatch that does not continue a sequence's position (docs/memory-semantics.md#find-slot)."""


class _Book:
    """The cell book as one ``int64 [6, size]`` array, so that a copy (every plan makes
    one) is a single memcpy whatever the number of sequences.

    Rows: ``pos`` (-1 = empty), ``src`` (pool row of the logical state, -1 = zero
    state; its plane is the cell's live plane unless a rollback is pending),
    ``snap_end``, ``snap_valid`` (per cell; ``snap_end - pos`` is the depth of a
    pending rollback); ``tail`` (per *sequence*: its cell or -1); ``n_own`` (per
    cell: number of sequences whose tail it is).  A cell's sequence set is implied
    by ``tail`` (invariant I1), so it is never stored twice; :meth:`owners` /
    :attr:`seqs` derive it when needed.
    """

    __slots__ = ("a", "head", "n_own", "pos", "snap_end", "snap_valid", "src", "tail", "used")

    def __init__(self, a: np.ndarray, head: int = 0, used: int = 0) -> None:
        self.a = a
        self.pos, self.src, self.snap_end, self.snap_valid, self.tail, self.n_own = a
        self.head = head
        self.used = used

    @classmethod
    def empty(cls, size: int) -> _Book:
        a = np.full((6, size), -1, dtype=np.int64)
        a[3] = 0  # snap_valid
        a[5] = 0  # n_own
        return cls(a)

    def copy(self) -> _Book:
        return _Book(self.a.copy(), self.head, self.used)

    def same(self, other: _Book) -> bool:
        return np.array_equal(self.a, other.a) and (self.head, self.used) == (other.head, other.used)

    @property
    def size(self) -> int:
        return int(self.a.shape[1])

    def owners(self, c: int) -> list[int]:
        return np.flatnonzero(self.tail == c).tolist()

    @property
    def seqs(self) -> list[set[int]]:
        """Per cell, its set of sequences (derived from ``tail``; for inspection)."""
        out: list[set[int]] = [set() for _ in range(self.size)]
        for q, c in enumerate(self.tail.tolist()):
            if c >= 0:
                out[c].add(q)
        return out

    def detach(self, q: int) -> int:
        """Remove sequence ``q`` from its cell (freed when it was the last owner); returns the cell."""
        c = int(self.tail[q])
        if c >= 0:
            self.tail[q] = -1
            self.n_own[c] -= 1
            if self.n_own[c] == 0:
                self.free_cell(c)
        return c

    def free_cell(self, c: int) -> None:
        """Clear cell ``c``; the caller has already detached its sequences' tails."""
        if self.pos[c] >= 0 or self.n_own[c]:
            self.used -= 1
        self.a[:4, c] = (-1, -1, -1, 0)
        self.n_own[c] = 0


@dataclasses.dataclass(frozen=True)
class RecurrentInputs:
    """What the graph side needs for one committed ubatch (docs/memory-semantics.md#graph-side).

    Per sequence set ``i`` (its results go to cell ``head + i``; it advances by
    ``n_seq_tokens`` tokens, or by its own count in a varlen ubatch, see
    :attr:`cu_seqlens`), exactly the
    rows a primitive call takes: ``start_rows[i]``, the row it reads its state
    from (any plane of any cell; the zero row for a new sequence), and
    ``dst_table[i]``, its snapshot table: column 0 the row that receives the
    final state (:attr:`write_rows`), column ``j`` the row that receives the
    state ``j`` tokens before the end (:attr:`snapshot_rows`), ``-1`` where
    nothing is written.  A sequence that starts from one of its own planes
    writes the planes after it (the input state stays where it is as the
    snapshot), so a decode writes one row.

    ``extra_src``/``extra_dst`` materialise the live rows of cells of the
    slot's extra range that the reorder moved (row ``extra_src[k]`` is copied
    to ``extra_dst[k]``, the same plane of the new cell), ``plane_src`` /
    ``plane_dst`` their still-valid snapshot planes, so that a rollback stays
    possible wherever the cell goes.  ``staged``: some read row is also
    written in this step, so the step first copies every read aside.
    """

    size: int
    n_snap: int
    head: int
    n_rs: int
    n_seqs: int
    n_seq_tokens: int
    rs_z: int
    start_rows: np.ndarray
    dst_table: np.ndarray
    extra_src: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_ROWS)
    extra_dst: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_ROWS)
    staged: bool = False
    plane_src: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_ROWS)
    plane_dst: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_ROWS)
    cu_seqlens: np.ndarray | None = None

    @property
    def is_varlen(self) -> bool:
        """The ubatch is in the packed form: set ``i`` owns tokens ``cu_seqlens[i] ..
        cu_seqlens[i + 1] - 1`` of one token axis (``n_seq_tokens`` is then the longest)."""
        return self.cu_seqlens is not None

    @property
    def seq_lens(self) -> np.ndarray:
        """int64 ``[n_seqs]``: the tokens each set advances by."""
        if self.cu_seqlens is not None:
            return np.diff(self.cu_seqlens).astype(np.int64)
        return np.full(self.n_seqs, self.n_seq_tokens, dtype=np.int64)

    @property
    def n_tokens(self) -> int:
        """Tokens of the ubatch (every set's)."""
        return int(self.cu_seqlens[-1]) if self.cu_seqlens is not None else self.n_seqs * self.n_seq_tokens

    @property
    def copy_src(self) -> np.ndarray:
        """Every row the step copies besides the primitive (extras, then planes)."""
        return np.concatenate([self.extra_src, self.plane_src]) if self.plane_src.size else self.extra_src

    @property
    def copy_dst(self) -> np.ndarray:
        """Where the rows of :attr:`copy_src` go."""
        return np.concatenate([self.extra_dst, self.plane_dst]) if self.plane_dst.size else self.extra_dst

    @property
    def write_rows(self) -> np.ndarray:
        """Per sequence, the row that receives its final state."""
        return self.dst_table[:, 0]

    @property
    def snapshot_rows(self) -> np.ndarray:
        """Per sequence, the rows of its states 1, 2, ... tokens before the end (-1: not written)."""
        return self.dst_table[:, 1:]

    def written_rows(self) -> np.ndarray:
        """Every row the primitive writes, sequence by sequence (column order within one)."""
        t = self.dst_table.ravel()
        return t[t >= 0]

    def written_owners(self) -> np.ndarray:
        """The sequence that writes each row of :meth:`written_rows`."""
        n_w = self.dst_table.shape[1]
        return np.repeat(np.arange(self.n_seqs, dtype=np.int64), n_w)[self.dst_table.ravel() >= 0]


@dataclasses.dataclass(eq=False)
class _ApplyRecord:
    """What :meth:`RecurrentContext.undo` needs for one applied ubatch.

    ``book_before`` is the book object that ``apply()`` replaced: apply installs
    a new book object (the plan's) instead of editing the old one, so keeping
    the old one costs nothing.  ``written`` is filled by the step: for every
    pool it wrote, the scratch copy of the rows it overwrote (``None`` when
    rows were not kept).  ``overwrites`` are those pool rows.
    """

    index: int
    book_before: _Book
    version_after: int
    inputs: RecurrentInputs
    keep_rows: bool
    overwrites: np.ndarray | None = None
    written: dict[tuple[int, str], tuple[Buffer, Buffer | None]] = dataclasses.field(default_factory=dict)


class RecurrentContext(UBatchContext):
    """A planned batch: the ubatches, and the book after each (installed by apply).

    **Undo after a failed compute** (``MemoryStatus.FAILED_COMPUTE``,
    docs/memory-semantics.md#failed-compute).  Every ``apply()`` keeps an undo record: the book it
    replaced (a reference, O(1)) and, once a step writes, which pools it wrote.
    :meth:`undo` then puts the memory back:

    * the step never wrote (the failure came before the graph ran, or the
      runtime never built a step): the old book is reinstalled and the pools
      are untouched, so the memory is exactly as before ``apply()``;
    * the step wrote and the rows were kept (``keep_undo_rows``: the step
      copies the rows it is about to overwrite into scratch buffers before its
      first write to each pool, about ``n_seqs * min(n_t + 1, 1 + n_rs_seq)``
      rows per state tensor): the rows are copied back, then the old book is
      reinstalled -- exact again;
    * the step wrote without kept rows: exactness is impossible when a
      sequence's logical state row was overwritten (with rotating planes a
      step usually leaves it in its plane, and undo stays exact).  Then
      ``undo()`` is refused (:class:`ContextError`, nothing changed, the
      sequences named; :meth:`undo_loses` asks first), and ``undo(drop=True)``
      is *consistent but lossy*: the old book comes back minus every cell whose
      logical state row was overwritten (those sequences are dropped, as if
      ``seq_rm(s, 0, -1)``; undo returns their ids so the runtime can
      re-prefill them), and snapshot planes that were overwritten are no
      longer offered for rollback.

    Keeping rows costs one device copy of the slot's rows per state tensor (and
    a scratch allocation per pool and step, which a CUDA graph cannot hold), so
    it is off by default (``RecurrentMemory(keep_undo_rows=...)``, this
    context's ``keep_undo_rows`` attribute, or ``step(keep_undo_rows=True)``);
    the book part of undo is always free.  ``undo()`` is refused
    (:class:`ContextError`, nothing changed) once the memory was changed by
    anything else after the last ``apply()``.  After an exact undo the context
    points at the first undone ubatch again and may ``apply()`` it anew.
    :meth:`confirm` forgets the records (and frees kept rows) of the ubatches
    applied so far, when the runtime knows their compute succeeded.

    **Stale plans** (every context, :meth:`MemoryContext.check_version`): the
    plan of every ubatch is computed at ``init_batch`` on a copy of the book.
    Once the memory changed by anything but this context's own ``apply()``
    (another context's apply, a sequence operation, a state read), ``apply()``
    raises :class:`ContextError` and changes nothing; the runtime plans the
    batch again.  (Earlier versions re-placed the ubatch on the new book, which
    let two plans made from one state both claim the same cells and silently
    continued sequences whose state had meanwhile been dropped.)  After an
    exact undo the context may apply the undone ubatches again; after a lossy
    one (sequences dropped) its plans no longer describe the book and it
    refuses them.
    """

    def __init__(
        self,
        memory: RecurrentMemory,
        ubatches: Sequence[UBatch],
        plans: list[tuple[_Book, Any]],
        *,
        keep_undo_rows: bool | None = None,
    ) -> None:
        super().__init__(ubatches, memory)
        self.memory = memory
        self._plans = plans
        self.inputs: RecurrentInputs | None = None
        self.keep_undo_rows = memory.keep_undo_rows if keep_undo_rows is None else bool(keep_undo_rows)
        self._records: list[_ApplyRecord] = []

    def _apply_ubatch(self, i: int) -> bool:
        # apply() refused a stale plan before this point (check_version): the book is
        # exactly the one the plan of ubatch i was computed on.  Placing the ubatch
        # again on a memory that moved would silently give it other cells (and re-read
        # states another plan may already have advanced), so it is never done here.
        mem = self.memory
        before = mem._book
        book, inputs = self._plans[i]
        mem._book = book  # a plan book is never edited while it is not installed
        mem._version += 1
        self.inputs = inputs
        rec = _ApplyRecord(i, before, mem._version, inputs, self.keep_undo_rows)
        self._records.append(rec)
        mem._last_apply = rec
        return True

    def step(self, keep_undo_rows: bool | None = None) -> Any:
        """The graph side for the applied ubatch (see :mod:`statecache.recurrent_step`).
        ``keep_undo_rows`` overrides the context's setting for this step."""
        from statecache.recurrent_step import RecurrentStep

        if self.inputs is None or self._applied != self.i_next:  # after next(): the next ubatch is not applied
            raise ArgumentError("context", "apply() a ubatch before asking for its step")
        return RecurrentStep(self.memory, self.inputs, keep_undo_rows=keep_undo_rows)

    @property
    def n_undoable(self) -> int:
        """How many applied ubatches :meth:`undo` can still take back."""
        return len(self._records)

    def confirm(self) -> None:
        """The compute of every ubatch applied so far succeeded: drop their undo records."""
        self._records.clear()

    def _undo_records(self, n: int | None) -> list[_ApplyRecord]:
        """The records :meth:`undo` of ``n`` takes back; :class:`ContextError` when it cannot."""
        k = len(self._records) if n is None else int(n)
        if not 0 <= k <= len(self._records):
            raise ContextError(f"cannot undo {n} ubatches; {len(self._records)} can be undone")
        recs = self._records[len(self._records) - k :]
        if recs and self.memory._version != recs[-1].version_after:
            raise ContextError("the memory changed after the last apply(); its ubatches can no longer be undone")
        return recs

    def _damaged_rows(self, recs: Sequence[_ApplyRecord]) -> np.ndarray:
        """Pool rows (a bool mask) that undoing ``recs`` cannot put back: written by a step
        that kept no copy, and not restored by the kept copy of an older step."""
        mem = self.memory
        n_rows = mem.size * mem.n_snap
        damaged: dict[tuple[int, str], np.ndarray] = {}
        for rec in reversed(recs):  # newest first: each kept copy is the state before its own step
            if not rec.written:
                continue
            assert rec.overwrites is not None
            for key, (_, saved) in rec.written.items():
                if saved is not None:
                    if key in damaged:
                        damaged[key][rec.overwrites] = False
                else:
                    damaged.setdefault(key, np.zeros(n_rows, dtype=bool))[rec.overwrites] = True
        bad = np.zeros(n_rows, dtype=bool)
        for mask in damaged.values():
            bad |= mask
        return bad

    def undo_loses(self, n: int | None = None) -> tuple[int, ...]:
        """The sequences :meth:`undo` of the last ``n`` ubatches would have to drop (their
        state rows were overwritten and not kept); empty: the undo is exact.  A question
        before the action: changes nothing.

        :raises ContextError: the undo is refused anyway (``n`` out of range, the memory
            changed since the last ``apply()``)."""
        recs = self._undo_records(n)
        if not recs:
            return ()
        bad = self._damaged_rows(recs)
        return _lost_sequences(recs[0].book_before, bad) if bad.any() else ()

    def undo(self, n: int | None = None, *, drop: bool = False) -> tuple[int, ...]:
        """Take back the last ``n`` applied ubatches (default: all not confirmed), newest first.

        Exact when no state row was overwritten without being kept
        (``keep_undo_rows``, or a step that left the old state in its plane).
        Otherwise the undo can only be consistent, by dropping the sequences
        whose rows are gone (:meth:`undo_loses` names them): it does that only
        with ``drop=True`` and returns their ids; without it it is refused.

        :raises ContextError: changing nothing, when the memory was modified
            since the last ``apply()``, ``n`` is out of range, or the undo would
            drop sequences and ``drop`` is False.
        """
        recs = self._undo_records(n)
        if not recs:
            return ()
        k = len(recs)
        mem = self.memory
        bad = self._damaged_rows(recs)
        if not drop and bad.any():
            lost = _lost_sequences(recs[0].book_before, bad)
            if lost:
                raise ContextError(
                    f"undo cannot be exact: the state rows of sequences {list(lost)} were overwritten and not kept "
                    "(keep_undo_rows); nothing changed. undo(drop=True) drops them (re-prefill them after), "
                    "or keep undo rows before the step"
                )
        dev = mem.device
        for rec in reversed(recs):  # newest first: each kept copy is the state before its own step
            if not rec.written:
                continue
            assert rec.overwrites is not None
            rows = dev.indices(rec.overwrites)
            for pool, saved in rec.written.values():
                if saved is not None:
                    dev.set_rows(pool, rows, saved)
        mem._book = recs[0].book_before
        mem._version += 1
        mem._last_apply = None
        del self._records[len(self._records) - k :]
        dropped: tuple[int, ...] = ()
        if bad.any():
            # the book differs from the plans': the context stays stale, apply() refuses
            dropped = mem._forget_damaged(bad)
        else:
            self.update_version()  # exactly the book the undone plans start from
        self.i_next = recs[0].index
        self._applied = -1
        self.inputs = None
        return dropped


class FullContext(MemoryContext):
    """Worst case (``init_full``): every cell in one slot."""

    def __init__(self, memory: RecurrentMemory) -> None:
        size, n_snap = memory.size, memory.n_snap
        rows = np.arange(size, dtype=np.int64)
        # a decode of every cell from plane 0 into the next plane (its own with one plane)
        table = (rows + (1 % n_snap) * size)[:, None]
        self.inputs = RecurrentInputs(size, n_snap, 0, size, size, 1, 0, rows, table)
        self.record_version(memory)

    @property
    def status(self) -> MemoryStatus:
        return MemoryStatus.SUCCESS

    def get_ubatch(self) -> UBatch:
        return UBatch.empty()

    def apply(self) -> bool:
        self.check_version()
        return True

    def next(self) -> bool:
        return False


class RecurrentMemory(Memory):
    """Recurrent state for ``n_seq_max`` sequences (docs/memory-semantics.md#recurrent-book).

    What each argument sizes, and its default (docs/memory-semantics.md#defaults):

    * ``n_seq_max`` (1..256): the sequence ids ``[0, n_seq_max)``.
    * ``size``: cells, default ``n_seq_max`` (one state per sequence; more
      cells only give copy on write room to spare).  Each state tensor's pool
      holds ``size * (1 + n_rs_seq)`` rows.
    * ``n_rs_seq``: snapshot planes per cell, default 0: **no rollback** (a
      partial ``seq_rm`` of the tail is refused).  ``n_rs_seq = K - 1`` lets a
      sequence roll back up to ``K - 1`` tokens and costs ``K`` times the
      state memory; refused at construction for a family without snapshot
      kernels, or above the device's ``caps.max_snapshots``.
    * ``dtype``: the state dtype, default the spec's (f32).
    * ``keep_undo_rows``: default False.  A step then keeps no copy of the
      rows it overwrites, so an undo after a failed compute that would lose a
      sequence's state is refused unless asked for with ``drop=True``
      (:meth:`RecurrentContext.undo`); True makes every undo exact at one row
      copy (and a scratch allocation) per state tensor and step.
    """

    def __init__(
        self,
        spec: MemorySpec | Sequence[RecurrentLayerSpec | None],
        device: Device,
        *,
        n_seq_max: int,
        n_rs_seq: int = 0,
        size: int | None = None,
        dtype: DType | str | None = None,
        keep_undo_rows: bool = False,
    ) -> None:
        if not isinstance(spec, MemorySpec):
            spec = MemorySpec(tuple(spec), DType.parse(dtype) if dtype is not None else DType.F32)
        elif dtype is not None:
            spec = dataclasses.replace(spec, dtype=DType.parse(dtype))
        for arg, value in (("n_seq_max", n_seq_max), ("n_rs_seq", n_rs_seq), ("size", -1 if size is None else size)):
            check_int32(value, arg)  # int() would take 1.5 planes as 1
        if not 1 <= n_seq_max <= 256:
            raise ArgumentError("n_seq_max", f"must be in [1, 256], got {n_seq_max}")
        size = max(1, n_seq_max) if size is None else int(size)
        if size < n_seq_max:
            raise ArgumentError("size", f"{size} cells cannot hold {n_seq_max} sequences (size >= n_seq_max)")
        self.spec = spec
        self.device = device
        self.n_seq_max = int(n_seq_max)
        self.size = size
        self.n_rs_seq = spec.effective_n_rs_seq(int(n_rs_seq))
        self.n_snap = 1 + self.n_rs_seq
        self.dtype = spec.dtype
        if self.n_rs_seq and device.caps.max_snapshots < self.n_snap:
            raise ArgumentError("n_rs_seq", f"{device.id} emits at most {device.caps.max_snapshots} snapshots")
        #: pools[layer][tensor name] -> Buffer [size * n_snap, row_size]
        self.pools: dict[int, dict[str, Buffer]] = {}
        for i in spec.recurrent_layers:
            layer = spec.layers[i]
            assert layer is not None
            self.pools[i] = {t.name: device.alloc((size * self.n_snap, t.row_size), self.dtype) for t in layer.tensors}
        self._book = _Book.empty(size)
        self._version = 0
        #: default for new contexts: steps keep the rows they overwrite so undo() is exact (see RecurrentContext)
        self.keep_undo_rows = bool(keep_undo_rows)
        self._last_apply: _ApplyRecord | None = None
        self._index_cache: dict[tuple[tuple[int, ...], bytes], Buffer] = {}
        #: calls the recurrent step validated before its first write (see RecurrentStep._validate)
        self._step_checks = LaunchMemo()

    # -- introspection ----------------------------------------------------------
    @property
    def has_layers(self) -> bool:
        return bool(self.pools)

    @property
    def head(self) -> int:
        return self._book.head

    @property
    def used(self) -> int:
        return self._book.used

    def cell_of(self, seq: int) -> int:
        return int(self._book.tail[seq]) if 0 <= seq < self.size else -1

    def pending_rollback(self, seq: int) -> int:
        """Depth of the rollback pending on ``seq``'s cell (how many planes back from
        its last write the next step reads), 0 if none."""
        c = self.cell_of(seq)
        if c < 0 or self._book.src[c] < 0:
            return 0
        return int(self._book.snap_end[c] - self._book.pos[c])

    def book_snapshot(self) -> _Book:
        """A copy of the book (tests compare it to prove nothing changed)."""
        return self._book.copy()

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` naming the book invariant (I1-I3 of
        docs/memory-semantics.md#recurrent-book) that no longer holds."""
        b = self._book
        t = b.tail
        owned = t[t >= 0]
        if not np.array_equal(np.bincount(owned, minlength=self.size), b.n_own):
            raise InvariantError("I1", "n_own disagrees with tail")
        empty = b.n_own == 0
        if not ((b.pos[empty] == -1).all() and (b.src[empty] == -1).all()):
            raise InvariantError("I3", "an empty cell keeps data")
        if int((~empty).sum()) != b.used:
            raise InvariantError("I2", f"used is {b.used} but {int((~empty).sum())} cells are owned")
        owned = np.flatnonzero(~empty)
        src = b.src[owned]
        if ((src >= 0) & (src % self.size != owned)).any():
            raise InvariantError("I5", "a cell's state is not in one of its own planes")
        depth = b.snap_end[owned] - b.pos[owned]
        if self.has_layers and ((src >= 0) & ((depth < 0) | (depth >= np.maximum(b.snap_valid[owned], 1)))).any():
            raise InvariantError("I5", "a pending rollback reads a plane its provenance does not offer")

    def _index_buffer(self, rows: np.ndarray) -> Buffer:
        """Device index buffer holding ``rows`` (int64, 1-D or 2-D), cached by contents:
        steps never write index buffers, and a decode with rotating planes cycles
        through ``n_snap`` row sets, so the same buffers come back (and the launch
        memo, keyed by buffer identity, skips validating them again)."""
        key = (rows.shape, rows.tobytes())
        buf = self._index_cache.get(key)
        if buf is None:
            if len(self._index_cache) >= 256:
                self._index_cache.clear()
            buf = self._index_cache[key] = self.device.indices(rows)
        return buf

    # -- queries ----------------------------------------------------------------
    def seq_pos_min(self, seq: int) -> int:
        c = int(self._book.tail[check_seq_id(seq, self.n_seq_max)])
        return int(self._book.pos[c]) if c >= 0 else -1

    seq_pos_max = seq_pos_min

    def seq_pos_max_all(self) -> np.ndarray:
        """seq_pos_max of every sequence id in [0, n_seq_max) as one array (batch validation)."""
        b = self._book
        t = b.tail[: self.n_seq_max]
        return np.where(t >= 0, b.pos[np.maximum(t, 0)], -1)

    def memory_breakdown(self) -> dict[str, int]:
        total = sum(b.nbytes for pools in self.pools.values() for b in pools.values())
        return {self.device.id: total} if total else {}

    # -- plans ------------------------------------------------------------------
    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False, *, varlen: bool = False
    ) -> MemoryContext:
        """Plan a validated batch (:meth:`Memory.init_batch`).

        ``varlen=False`` (the default) splits it into equal ubatches: every set of
        a ubatch advances by the same number of tokens, consecutive sequence ids
        (``split_equal(sequential=True)``; ``split_seq`` with ``embd_all``), per-token
        tensors ``[n_seqs, n_seq_tokens, ...]``.  ``varlen=True`` puts the whole
        batch into one packed ubatch when it fits ``n_ubatch``
        (:meth:`BatchAllocator.split_varlen`): sets of any length and any ids, one
        primitive call per layer, per-token tensors ``[n_tokens, ...]`` with the
        offsets ``ub.cu_seqlens`` (the step passes them to every primitive).
        Rollback planes, copy-on-write and undo are the same in both forms.
        """
        balloc.check_ready(self.n_seq_max)  # never initialised, or validated for another memory
        balloc.split_reset()
        ubatches: list[UBatch] = []
        keep = self.n_rs_seq + 1 if self.n_rs_seq > 0 else 0
        while True:
            if varlen:
                ub = balloc.split_varlen(n_ubatch, n_keep_tail=keep)
            elif embd_all:
                ub = balloc.split_seq(n_ubatch)
            else:
                ub = balloc.split_equal(n_ubatch, sequential=True, n_keep_tail=keep)
            if ub.n_tokens == 0:
                break
            ubatches.append(ub)
        if balloc.n_used < balloc.n_tokens:
            return StatusContext(
                MemoryStatus.FAILED_PREPARE, f"split left {balloc.n_tokens - balloc.n_used} tokens unused"
            )
        return self.init_ubatches(ubatches)

    def init_ubatches(self, ubatches: Sequence[UBatch]) -> MemoryContext:
        """Context for a ubatch list split by someone else (a hybrid); dry run."""
        plans = self.prepare(ubatches)
        if plans is None:
            return StatusContext(MemoryStatus.FAILED_PREPARE, "the ubatches do not fit the recurrent memory")
        return RecurrentContext(self, ubatches, plans)

    def prepare(self, ubatches: Sequence[UBatch]) -> list[tuple[_Book, RecurrentInputs]] | None:
        """Dry run of every ubatch on a copy of the book; None if one does not fit.
        Never mutates the memory."""
        book = self._book.copy()
        plans = []
        for k, ub in enumerate(ubatches):
            inputs = self._find_slot(book, ub)
            if inputs is None:
                return None
            plans.append((book if k == len(ubatches) - 1 else book.copy(), inputs))
        return plans

    def init_full(self) -> MemoryContext:
        return FullContext(self)

    # -- find_slot (docs/memory-semantics.md#find-slot) -------------------------
    def _find_slot(self, b: _Book, ub: UBatch) -> RecurrentInputs | None:
        """Place ``ub`` on book ``b`` (mutated; callers pass a copy).  None if it does not fit.

        Vectorised over the sets; the only Python loops left run over coupled
        (multi-id) sets, shared cells being split, and reorder swaps, none of
        which the steady decode path meets.  Per-ubatch work is O(size).
        """
        if not ub.equal_seqs and not ub.is_varlen:
            raise BatchError(
                "the recurrent memory needs sequence sets (split_equal, split_seq or split_varlen)", rule="split"
            )
        n_seqs = ub.n_seqs
        size = self.size
        if n_seqs == 0:
            return None
        # 1. head heuristic
        if b.head > b.used + 2 * n_seqs:
            b.head = 0
        fast = self._find_slot_fast(b, ub)
        if fast is not None:
            return fast
        sets = ub.set_seq_ids
        q = ub.set_primary
        # 2. validate ids; secondary ids drop their own state (they join the set's cell)
        if q.min() < 0 or q.max() >= self.n_seq_max:
            return None
        coupled = not isinstance(sets, SeqIds) and any(len(ids) > 1 for ids in sets)
        if coupled:
            for ids in sets:
                if any(not 0 <= x < self.n_seq_max for x in ids):
                    return None
                for x in ids[1:]:
                    b.detach(x)
        # 3. empty cells from head, wrapping around
        empty = np.flatnonzero((b.pos < 0) & (b.n_own == 0))
        empty = np.concatenate([empty[empty >= b.head], empty[empty < b.head]])
        # 4. give every set a cell it owns alone (copy-on-write of shared cells)
        c = b.tail[q]
        take = c < 0  # a sequence without state gets a fresh cell
        shared = np.flatnonzero((c >= 0) & (b.n_own[np.maximum(c, 0)] > 1))
        if shared.size:  # in set order: the last sharer to be decoded keeps the cell
            left: dict[int, int] = {}
            for k in shared.tolist():
                cc = int(c[k])
                n_left = left.get(cc, int(b.n_own[cc]))
                if n_left > 1:
                    take[k] = True
                    left[cc] = n_left - 1
        need = np.flatnonzero(take)
        if need.size > empty.size:
            return None
        chosen = c.copy()
        if need.size:
            e = empty[: need.size]
            old = c[need]
            had = old >= 0
            np.subtract.at(b.n_own, old[had], 1)
            src_cell = np.maximum(old, 0)
            b.pos[e] = np.where(had, b.pos[src_cell], -1)  # a copy starts from the shared state
            b.src[e] = np.where(had, b.src[src_cell], -1)
            b.snap_end[e] = -1
            b.snap_valid[e] = 0
            b.n_own[e] = 1
            b.tail[q[need]] = e
            b.used += int(need.size)
            chosen[need] = e
        lo, hi = int(chosen.min()), int(chosen.max())
        # 5. reorder metadata so that set s lives in cell lo + s (data stays; src travels).
        # The sequential swaps of the spec are replayed on an index permutation of the slot,
        # then applied to the book in one gather.
        slot = np.arange(lo, hi + 1, dtype=np.int64)
        if not np.array_equal(chosen, slot[:n_seqs]):
            content = np.arange(hi - lo + 1)  # slot index -> original slot index of its metadata
            where = content.copy()  # original slot index -> current slot index
            for k, orig in enumerate((chosen - lo).tolist()):
                cur = int(where[orig])
                if cur == k:
                    continue
                other = int(content[k])
                content[k], content[cur] = orig, other
                where[orig], where[other] = k, cur
            b.a[:4, lo : hi + 1] = b.a[:4, content + lo]
            b.n_own[lo : hi + 1] = b.n_own[content + lo]
            t = b.tail
            in_slot = (t >= lo) & (t <= hi)
            t[in_slot] = where[t[in_slot] - lo] + lo
        # 6. advance positions; provenance of the planes this write produces
        n_t, first, last = _set_spans(ub)
        cells = slot[:n_seqs]
        old_pos = b.pos[cells]
        consecutive = (old_pos < 0) | (old_pos == first - 1)
        if not consecutive.all() and ub.pos_sections is None:  # M-RoPE positions may jump: no warning
            k = int(np.flatnonzero(~consecutive)[0])
            warnings.warn(
                f"sequence {int(q[k])}: ubatch starts at position {int(first[k])} but the state is at "
                f"{int(old_pos[k])}",
                NonConsecutivePositionWarning,
                stacklevel=3,
            )
        start_rows = b.src[cells].copy()
        b.pos[cells] = last
        if coupled:  # the secondary ids join the set's cell
            for k, ids in enumerate(sets):
                for x in ids[1:]:
                    b.tail[x] = lo + k
                b.n_own[lo + k] = len(ids)
        b.snap_end[cells] = last
        b.snap_valid[cells] = np.where(consecutive, np.minimum(n_t + 1, self.n_snap), np.minimum(n_t, self.n_snap))
        if ub.pos_sections is not None and (n_t > 1).any():
            # M-RoPE positions may repeat or jump inside a ubatch (an image grid shares
            # one temporal position): plane j then holds no state "after snap_end - j",
            # so only the final state stays reachable.
            b.snap_valid[cells] = np.where(_one_position_per_token(ub, n_t), b.snap_valid[cells], 1)
        # 7. zero row: first cell of the slot none of whose rows a cell names as its source
        # (a cell's snapshot planes are rows of the cell its source is in, so they are
        # never the zero row either).  The sources are still those before the step.
        src = b.src
        refs = np.bincount(src[src >= 0] % size, minlength=size)
        free = np.flatnonzero(refs[lo : hi + 1] == 0)
        rs_z = lo + int(free[0]) if free.size else -1
        fresh = start_rows < 0
        if fresh.any():
            if rs_z < 0:  # cannot happen: a new set's own cell is unreferenced
                return None
            start_rows[fresh] = rs_z
        # Every set writes the planes after the one it starts from: a set starting from
        # its own cell's plane P (its state, a pending rollback, or the zero row when
        # that is its own cell) leaves P as the snapshot of its input state; any other
        # start (copy on write, a cell the reorder moved, the zero row of another
        # cell) counts from plane 0 and writes the input state there too.
        own = start_rows % size == cells
        dst_table, live = _rotated_writes(cells, np.where(own, start_rows // size, 0), own, n_t, self.n_snap, size)
        src[cells] = live
        # The extra range: cells of the slot that no set of this ubatch writes.  A
        # pending rollback is consumed here (its plane becomes the live plane: no
        # copy), and a cell the reorder moved gets its live plane and its still-valid
        # snapshot planes copied to the same planes of its new cell, so a rollback of
        # it stays exact (several sequences of one batch can be rolled back after a
        # split into ubatches).
        extra = slot[n_seqs:]
        extra = extra[src[extra] >= 0]
        ex_src = src[extra]
        ex_plane = ex_src // size
        ex_valid = np.maximum(b.snap_valid[extra] - (b.snap_end[extra] - b.pos[extra]), 1)
        b.snap_end[extra] = b.pos[extra]
        b.snap_valid[extra] = ex_valid
        src[extra] = ex_plane * size + extra
        moved = ex_src % size != extra
        extra_dst = src[extra[moved]]
        extra_src = ex_src[moved]
        plane_src, plane_dst = _plane_rows(
            extra_src % size, extra[moved], ex_plane[moved], ex_valid[moved], size, self.n_snap
        )
        # 8.
        b.head = lo
        inputs = RecurrentInputs(
            size=size,
            n_snap=self.n_snap,
            head=lo,
            n_rs=hi - lo + 1,
            n_seqs=n_seqs,
            n_seq_tokens=ub.n_seq_tokens,
            rs_z=rs_z,
            start_rows=start_rows,
            dst_table=dst_table,
            extra_src=extra_src,
            extra_dst=extra_dst,
            staged=False,
            plane_src=plane_src,
            plane_dst=plane_dst,
            cu_seqlens=_host_offsets(ub),
        )
        return dataclasses.replace(inputs, staged=_needs_staging(inputs))

    def _find_slot_fast(self, b: _Book, ub: UBatch) -> RecurrentInputs | None:
        """The common decode case, vectorised: single-id sets whose sequences own their
        cell alone, already in set order and contiguous.  None -> take the general path."""
        sets = ub.set_seq_ids
        n_seqs, n_t = ub.n_seqs, ub.n_seq_tokens
        if not isinstance(sets, SeqIds) and any(len(ids) != 1 for ids in sets):
            return None
        q = ub.set_primary
        if q.min() < 0 or q.max() >= self.n_seq_max:
            return None
        cells = b.tail[q]
        lo = int(cells[0])
        if lo < 0 or cells[-1] != lo + n_seqs - 1 or not np.array_equal(cells, np.arange(lo, lo + n_seqs)):
            return None
        if (b.n_own[lo : lo + n_seqs] != 1).any():
            return None
        cells = np.arange(lo, lo + n_seqs, dtype=np.int64)
        start_rows = b.src[lo : lo + n_seqs].copy()
        if (start_rows < 0).any() or (start_rows % self.size != cells).any():
            return None
        if n_t > 1 and ub.pos_sections is not None:
            return None  # M-RoPE positions: the general path decides which planes stay reachable
        if b.head > b.used + 2 * n_seqs:
            b.head = 0
        lens, first, last = _set_spans(ub)
        old = b.pos[lo : lo + n_seqs]
        consecutive = (old < 0) | (old == first - 1)
        if not consecutive.all() and ub.pos_sections is None:  # M-RoPE positions may jump: no warning
            s = int(np.flatnonzero(~consecutive)[0])
            warnings.warn(
                f"sequence {int(q[s])}: ubatch starts at position {int(first[s])} but the state is at {int(old[s])}",
                NonConsecutivePositionWarning,
                stacklevel=4,
            )
        b.pos[lo : lo + n_seqs] = last
        b.snap_end[lo : lo + n_seqs] = last
        n_written = np.minimum(lens + 1, self.n_snap)
        b.snap_valid[lo : lo + n_seqs] = (
            n_written if consecutive.all() else np.where(consecutive, n_written, np.minimum(lens, self.n_snap))
        )
        own = np.ones(n_seqs, dtype=bool)
        table, live = _rotated_writes(cells, start_rows // self.size, own, lens, self.n_snap, self.size)
        b.src[lo : lo + n_seqs] = live
        b.head = lo
        return RecurrentInputs(
            self.size, self.n_snap, lo, n_seqs, n_seqs, n_t, -1, start_rows, table, cu_seqlens=_host_offsets(ub)
        )

    def _forget_damaged(self, bad_rows: np.ndarray) -> tuple[int, ...]:
        """After a lossy undo: drop every cell whose logical state row is in ``bad_rows``
        (a bool mask over pool rows) and stop offering overwritten snapshot planes.
        Returns the dropped sequences."""
        b = self._book
        size = self.size
        owned = np.flatnonzero(b.n_own > 0)
        src = b.src[owned]
        lost = owned[(src >= 0) & bad_rows[np.maximum(src, 0)]]
        dropped = np.asarray(_lost_sequences(b, bad_rows), dtype=np.int64)
        if lost.size:
            b.tail[dropped] = -1
            b.used -= int(lost.size)
            b.a[:4, lost] = np.array([-1, -1, -1, 0], dtype=np.int64)[:, None]
            b.n_own[lost] = 0
            b.head = min(b.head, int(lost[0]))
        kept = np.flatnonzero(b.n_own > 0)
        live = _live_planes(b, kept, size, self.n_snap)
        # Planes older than a damaged one are unreachable too.  The planes after a
        # pending rollback's (j < depth) hold states it dropped: their damage is moot.
        depth = b.snap_end[kept] - b.pos[kept]
        for j in range(1, self.n_snap):
            hit = bad_rows[(live - j) % self.n_snap * size + kept] & (b.snap_valid[kept] > j) & (depth < j)
            b.snap_valid[kept[hit]] = j
        self._version += 1
        return tuple(dropped.tolist())

    # -- sequence operations (docs/memory-semantics.md#recurrent-sequence-ops) ----
    def clear(self, data: bool = True) -> None:
        self._book = _Book.empty(self.size)
        self._version += 1
        if data:
            for pools in self.pools.values():
                for buf in pools.values():
                    self.device.zero_rows(buf, self.device.indices(np.arange(buf.shape[0])))

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        p0, p1 = normalize_range(p0, p1)
        b = self._book
        if seq >= 0:
            c = int(b.tail[seq])
            if c >= 0:
                P = int(b.pos[c])
                if 0 < p0 <= P < p1:
                    return self._rollback(seq, c, p0)
                if p0 <= P < p1:  # p0 == 0: the whole state goes
                    b.detach(seq)
                    if b.n_own[c] == 0:
                        b.head = min(b.head, c)
                    self._version += 1
                elif p0 < p1 <= P:
                    # A hole inside the history (context shift), or the head of it
                    # (p0 == 0): the state cannot forget those tokens, so the removal
                    # is accepted as upstream does, but a plane ending inside or
                    # before the removed range describes a position that no longer
                    # exists (or, once seq_add shifts the later positions, is
                    # labelled wrongly).  Keep only planes that end at p1 or later,
                    # so a rollback into or across the range is refused instead of
                    # restoring a history that is gone.  A pending rollback (its
                    # plane ends at P >= p1) stays reachable.
                    keep = max(1, int(b.snap_end[c]) - p1 + 1)
                    if keep < int(b.snap_valid[c]):
                        b.snap_valid[c] = keep
                        self._version += 1
            return True
        # negative seq: every sequence, only for an empty or complete range (docs/memory-semantics.md#seq-rm)
        if p0 >= p1:  # empty, also when p0 > p1 (docs/memory-semantics.md#ranges)
            return True
        if not (p0 == 0 and p1 == POS_MAX):
            return False
        self._book = _Book.empty(self.size)
        self._version += 1
        return True

    def _rollback(self, seq: int, c: int, p0: int) -> bool:
        b = self._book
        if not self.has_layers:  # positions only (e.g. a draft context): any depth
            b.pos[c] = b.snap_end[c] = p0 - 1
            self._version += 1
            return True
        if b.n_own[c] > 1:  # rolling back would move every sharer
            return False
        if b.snap_end[c] != b.pos[c]:  # a rollback is already pending
            return False
        depth = int(b.snap_end[c]) - (p0 - 1)
        if not 0 < depth < int(b.snap_valid[c]):
            return False
        # The state `depth` tokens back is `depth` planes before the live one: the next
        # step reads it from there and writes the plane after it (no copy).
        plane = (int(b.src[c]) // self.size - depth) % self.n_snap
        b.src[c] = plane * self.size + c
        b.pos[c] = p0 - 1
        self._version += 1
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``dst`` shares ``src``'s state (copy-on-write at its next step).

        A recurrent state holds its whole history, so the range must contain the
        position of ``src``'s state (``seq_pos_min == seq_pos_max`` here): a
        narrower range is refused (:class:`ArgumentError`, nothing changed)
        instead of copying more than was asked (upstream ignores the range)."""
        src = check_seq_id(src, self.n_seq_max, "src")
        dst = check_seq_id(dst, self.n_seq_max, "dst")
        q0, q1 = normalize_range(p0, p1)
        self.check_copy_range(src, q0, q1)
        if src == dst:
            return
        b = self._book
        b.detach(dst)
        c = int(b.tail[src])
        if c >= 0:
            b.n_own[c] += 1
            b.tail[dst] = c
        self._version += 1

    def check_copy_range(self, src: int, p0: int, p1: int) -> None:
        """Raise (changing nothing) unless the normalised range [p0, p1) holds the
        position of ``src``'s state (any range does for a sequence without state)."""
        P = self.seq_pos_max(src)
        if P >= 0 and not p0 <= P < p1:
            raise ArgumentError(
                "p0/p1",
                f"sequence {src}'s recurrent state is at position {P} and holds every token up to it; "
                f"a copy of [{p0}, {p1}) cannot leave any out: copy whole sequences (p0 = p1 = -1)",
            )

    def seq_keep(self, seq: int) -> None:
        seq = check_seq_id(seq, self.n_seq_max)
        b = self._book
        keep = int(b.tail[seq])
        drop = b.n_own > 0
        if keep >= 0:
            drop[keep] = False
        freed = np.flatnonzero(drop)
        others = np.ones(self.size, dtype=bool)
        others[seq] = False
        b.tail[others] = -1  # every other sequence loses its state (stale rollbacks go with the cell)
        if keep >= 0:
            b.n_own[keep] = 1
        if freed.size:
            b.used -= int(freed.size)
            b.a[:4, freed] = np.array([-1, -1, -1, 0], dtype=np.int64)[:, None]
            b.n_own[freed] = 0
            b.head = min(b.head, int(freed[0]))
        self._version += 1

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        seq = check_seq_id(seq, self.n_seq_max)
        p0, p1 = normalize_range(p0, p1)
        delta = check_int32(delta, "delta")
        if delta == 0 or p0 >= p1:
            return
        b = self._book
        c = int(b.tail[seq])
        if c < 0 or not p0 <= b.pos[c] < p1:
            self._forget_moved_planes(c, p1)
            return
        self._refuse_shared_move(seq, c, "seq_add")
        check_shifted(int(b.pos[c]), delta)
        if b.pos[c] + delta < 0:  # shifted before the start: the state is gone
            self.seq_rm(seq, 0, -1)
            return
        # Positions are labels: a snapshot plane moves with the position it holds, but
        # only the positions inside [p0, p1) move.  A plane of an earlier position
        # would take a label that now belongs to a later token (the attention part
        # keeps that earlier position where it was), so it is no longer offered.
        b.snap_valid[c] = max(1, min(int(b.snap_valid[c]), int(b.snap_end[c]) - p0 + 1))
        b.pos[c] += delta
        b.snap_end[c] += delta
        self._version += 1

    def _forget_moved_planes(self, c: int, p1: int) -> None:
        """A move of [p0, p1) that leaves cell ``c``'s position where it is (``p1 <= pos``)
        still relabels the tokens it covers, and plane ``j`` is only offered as "the state
        after position ``snap_end - j``" while the tokens it would undo keep those labels.
        A rollback to a plane below ``p1`` would undo a token that now sits elsewhere (and
        keep its label as the state's position), so only planes that end at ``p1`` or later
        stay, as after a removal of [p0, p1) (:meth:`seq_rm`).  ``c < 0``: no state."""
        b = self._book
        if c < 0 or p1 > int(b.pos[c]):
            return  # no state, or the range lies above it: no plane's tokens move
        keep = max(1, int(b.snap_end[c]) - p1 + 1)
        if keep < int(b.snap_valid[c]):
            b.snap_valid[c] = keep
            self._version += 1

    def check_position_move(self, seq: int, p0: int, p1: int, op: str = "seq_add", delta: int = 0) -> None:
        """Raise (changing nothing) if ``seq_add``/``seq_div`` over [p0, p1) would be
        refused; composites call it before touching any other part.  ``delta``: the
        shift of a ``seq_add`` (its result must stay inside int32)."""
        seq = check_seq_id(seq, self.n_seq_max)
        p0, p1 = normalize_range(p0, p1)
        if p0 >= p1:
            return
        c = int(self._book.tail[seq])
        if c >= 0 and p0 <= self._book.pos[c] < p1:
            self._refuse_shared_move(seq, c, op)
            if delta:
                check_shifted(int(self._book.pos[c]), delta)

    def _refuse_shared_move(self, seq: int, c: int, op: str) -> None:
        """Moving the position of a cell other sequences share would silently
        relabel their state too (upstream does exactly that); refuse instead,
        as a rollback of a shared cell is refused, and change nothing."""
        b = self._book
        if b.n_own[c] > 1:
            others = [q for q in b.owners(c) if q != seq]
            raise ArgumentError(
                "seq",
                f"{op}: sequence {seq} shares its recurrent state with sequences {others}; "
                "moving its position would move theirs too",
            )

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        seq = check_seq_id(seq, self.n_seq_max)
        p0, p1 = normalize_range(p0, p1)
        d = check_divisor(d)
        if d == 1 or p0 >= p1:
            return
        b = self._book
        c = int(b.tail[seq])
        if c < 0 or not p0 <= b.pos[c] < p1:
            self._forget_moved_planes(c, p1)
            return
        self._refuse_shared_move(seq, c, "seq_div")
        pending = int(b.snap_end[c] - b.pos[c])
        b.pos[c] //= d
        # Division breaks the plane -> position mapping: only the state itself stays
        # reachable (a pending rollback stays pending, and reads the same plane).
        b.snap_end[c], b.snap_valid[c] = b.pos[c] + pending, pending + 1
        self._version += 1

    # -- questions before actions (docs/memory-semantics.md#queries) ----------------
    def check_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        q0, q1 = normalize_range(p0, p1)
        if seq < 0:
            if q0 < q1 and not (q0 == 0 and q1 == POS_MAX):
                raise ArgumentError(
                    "seq", f"-1 (every sequence) removes only an empty or the complete range, got [{q0}, {q1})"
                )
            return
        c = int(self._book.tail[seq])
        if c >= 0 and 0 < q0 <= int(self._book.pos[c]) < q1:
            self._check_rollback(seq, c, q0)

    def _check_rollback(self, seq: int, c: int, p0: int) -> None:
        """Raise when :meth:`_rollback` of ``seq`` (cell ``c``) to ``p0 - 1`` would return False."""
        b = self._book
        if not self.has_layers:
            return
        if b.n_own[c] > 1:
            others = [q for q in b.owners(c) if q != seq]
            raise ArgumentError(
                "seq", f"sequence {seq} shares its recurrent state with {others}; a rollback would move theirs too"
            )
        if b.snap_end[c] != b.pos[c]:
            raise ArgumentError(
                "seq", f"a rollback of sequence {seq} to {int(b.pos[c])} is pending; decode (or remove it all) first"
            )
        depth = int(b.snap_end[c]) - (p0 - 1)
        valid = int(b.snap_valid[c])
        if not 0 < depth < valid:
            reach = f"back to position {int(b.snap_end[c]) - valid + 1}" if valid > 1 else "nowhere (no plane)"
            raise ArgumentError(
                "p0", f"no snapshot plane holds sequence {seq}'s state at position {p0 - 1}; its planes reach {reach}"
            )

    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        check_seq_id(src, self.n_seq_max, "src")
        check_seq_id(dst, self.n_seq_max, "dst")
        q0, q1 = normalize_range(p0, p1)
        self.check_copy_range(int(src), q0, q1)

    def check_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        check_seq_id(seq, self.n_seq_max)
        normalize_range(p0, p1)
        if check_int32(delta, "delta"):
            self.check_position_move(seq, p0, p1, "seq_add", int(delta))

    def check_seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        check_seq_id(seq, self.n_seq_max)
        normalize_range(p0, p1)
        if check_divisor(d) != 1:
            self.check_position_move(seq, p0, p1, "seq_div")

    def check_context_shift(self, seq: int, p0: int, p1: int) -> None:
        seq = check_seq_id(seq, self.n_seq_max)
        q0, q1 = normalize_range(p0, p1)
        if q0 >= q1:
            return
        self.check_seq_rm(seq, q0, q1)
        # the move, as the removal leaves the book: a hole keeps the cell and its
        # owners; a removal reaching the position leaves it below q1 (nothing moves)
        c = int(self._book.tail[seq])
        if q1 < POS_MAX and c >= 0 and int(self._book.pos[c]) >= q1:
            self._refuse_shared_move(seq, c, "context shift")

    def rollback_reach(self, seq: int) -> RollbackReach:
        seq = check_seq_id(seq, self.n_seq_max)
        b = self._book
        c = int(b.tail[seq])
        if c < 0:
            return RollbackReach(seq, -1, 0)
        P = int(b.pos[c])
        if not self.has_layers:
            return RollbackReach(seq, P, 0)
        if b.n_own[c] > 1 or b.snap_end[c] != b.pos[c]:
            return RollbackReach(seq, P, P + 1)
        floor = P + 2 - int(b.snap_valid[c])  # depth P + 1 - p < snap_valid
        return RollbackReach(seq, P, floor if floor > 1 else 0)

    def seq_state(self, seq: int) -> SeqState:
        seq = check_seq_id(seq, self.n_seq_max)
        return SeqState(seq, self.version, self.seq_pos_min(seq), self.seq_pos_max(seq),
                        self.recurrent_rows(seq), (), self.rollback_reach(seq))  # fmt: skip

    def recurrent_rows(self, seq: int) -> RecurrentRows:
        """``seq``'s rows in the pools (:class:`~statecache.memory.RecurrentRows`), the
        recurrent part of :meth:`seq_state`."""
        seq = check_seq_id(seq, self.n_seq_max)
        b = self._book
        c = int(b.tail[seq])
        tensors = tuple((layer, name) for layer, pools in self.pools.items() for name in pools)
        if c < 0:
            return RecurrentRows(-1, -1, -1, (), 0, (), tensors)
        row = int(b.src[c])
        planes = tuple(self._valid_planes(c).tolist())
        version = self.version

        def read(layer: int, tensor: str) -> np.ndarray:
            view_guard(self, version)
            try:
                buf = self.pools[layer][tensor]
            except KeyError:
                have = f"no recurrent pool ({layer}, {tensor!r}); have {tensors}"
                raise ArgumentError("layer/tensor", have) from None
            width = int(buf.shape[1])
            rows = np.asarray(planes, dtype=np.int64)
            data = gather_rows(self.device, buf, rows).view(buf.dtype.numpy).reshape(len(planes), width)
            state = np.zeros((1, width), dtype=buf.dtype.numpy)
            if row >= 0:
                state = gather_rows(self.device, buf, np.asarray([row])).view(buf.dtype.numpy).reshape(1, width)
            return np.concatenate([state, data])

        return RecurrentRows(c, int(b.pos[c]), row, planes, self.pending_rollback(seq),
                             tuple(b.owners(c)), tensors, read)  # fmt: skip

    # -- state save / restore (docs/memory-semantics.md#state) ----------------------
    def _cells_for(self, seq: int) -> list[int]:
        b = self._book
        if seq >= 0:
            c = self.cell_of(seq)
            return [c] if c >= 0 else []
        return np.flatnonzero(b.n_own > 0).tolist()

    @functools.cached_property
    def _layout(self) -> _SectionLayout:
        """The section's memory-only fields (:class:`_SectionLayout`), built once: every
        state transfer and blob of one sequence writes and checks the same ones."""

        def tensor(layer: int, name: str, buf: Buffer) -> _TensorLayout:
            w = Writer()
            w.name(name)
            w.i32(DTYPE_CODES[buf.dtype])
            w.u64(buf.shape[1] * buf.dtype.itemsize)
            field = f"layer[{layer}].{name}"
            return _TensorLayout(
                name, buf, buf.shape[1] * buf.dtype.itemsize, w.getvalue(), f"{field}.rows", f"{field}.planes"
            )

        def u32s(*values: int) -> bytes:
            w = Writer()
            for v in values:
                w.u32(v)
            return w.getvalue()

        head = u32s(0, self.spec.n_layer, len(self.pools))  # s_trans, n_layer, n_state_layers
        layers = tuple(
            (layer, u32s(layer, len(pools)), tuple(tensor(layer, name, buf) for name, buf in pools.items()))
            for layer, pools in self.pools.items()
        )
        return _SectionLayout(head, layers)

    def write_section(self, seq: int = -1, flags: int = StateFlags.NONE) -> Writer:
        """The recurrent section payload, as the :class:`Writer` holding it (the logical
        state: a pending rollback is written from its plane)."""
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        b = self._book
        cells = self._cells_for(seq)
        owners: dict[int, list[int]] = {}
        if seq < 0:  # one pass over the tails instead of one per cell
            for q, c in enumerate(b.tail.tolist()):
                if c >= 0:
                    owners.setdefault(c, []).append(q)
        w = Writer()
        w.u32(len(cells))
        for c in cells:
            w.i32(int(b.pos[c]))
            ids = owners.get(c, [])
            w.u32(len(ids))
            for q in ids:
                w.i32(q)
        layout = self._layout
        w.raw(layout.head)  # s_trans (0), n_layer, n_state_layers
        rows = np.array([int(b.src[c]) if b.src[c] >= 0 else c for c in cells], dtype=np.int64)
        for _, head, tensors in layout.layers:
            w.raw(head)  # layer, n_tensors
            for t in tensors:
                w.raw(t.desc)  # name, dtype code, row bytes
                if rows.size:
                    w.rows(self.device, t.buf, rows)
        if planes_apart() or flags & StateFlags.WITH_PLANES:
            self._write_planes(w, cells)
        return w

    def _valid_planes(self, c: int) -> np.ndarray:
        """Pool rows of cell ``c``'s snapshot planes still valid behind its logical state
        (the state one, two, ... positions back), nearest first.  A pending rollback's
        logical state is a plane itself: only the planes behind it count."""
        b = self._book
        src = int(b.src[c])
        if src < 0 or src % self.size != c or not self.has_layers:
            return _EMPTY_ROWS
        depth = int(b.snap_end[c]) - int(b.pos[c])  # of a pending rollback (planes rotate: see the module doc)
        behind = np.arange(1, int(b.snap_valid[c]) - depth, dtype=np.int64)
        return (src // self.size - behind) % self.n_snap * self.size + c

    def _write_planes(self, w: Writer, cells: Sequence[int]) -> None:
        """With ``StateFlags.WITH_PLANES`` or inside a transfer (see
        :func:`statecache.state_io.planes_apart`): per cell the number of valid planes
        behind its state, then per state tensor their rows."""
        planes = [self._valid_planes(c) for c in cells]
        for p in planes:
            w.u32(int(p.size))
        rows = np.concatenate(planes) if planes else _EMPTY_ROWS
        for pools in self.pools.values():
            for buf in pools.values():
                if rows.size:
                    w.rows(self.device, buf, rows)

    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        return pack_sections([(SECTION_TAG, self.write_section(seq, flags))], flags)

    def parse_section(self, payload: Any, seq: int = -1, planes: bool = False) -> dict[str, Any]:
        """Validate a recurrent section completely; returns a restore plan.  Mutates nothing.
        ``planes``: the section ends with snapshot planes (a ``WITH_PLANES`` blob)."""
        seq = check_seq_id(seq, self.n_seq_max, allow_all=True)
        r = Reader(payload, "recurrent")
        n_cells = r.u32("cell_count")
        if n_cells > self.size:
            r.fail("cell_count", f"is {n_cells}, the memory has {self.size} cells")
        if seq >= 0 and n_cells > 1:
            r.fail("cell_count", f"is {n_cells}; a single sequence owns at most one cell")
        cells = []
        seen: set[int] = set()
        for i in range(n_cells):
            p = r.i32(f"cell[{i}].pos")
            if not 0 <= p <= POS_LAST:  # POS_MAX is the open end of every range (memory.POS_LAST)
                r.fail(f"cell[{i}].pos", f"is {p}; a stored cell holds a position in [0, {POS_LAST}]")
            n_ids = r.u32(f"cell[{i}].n_seq_id")
            if seq >= 0 and n_ids != 0:
                r.fail(f"cell[{i}].n_seq_id", f"is {n_ids}; a single-sequence entry must be sequence-agnostic (0)")
            if seq < 0 and n_ids == 0:
                r.fail(f"cell[{i}].n_seq_id", "is 0; a whole-memory cell needs its sequences")
            if n_ids > self.n_seq_max:
                r.fail(f"cell[{i}].n_seq_id", f"is {n_ids}, more than n_seq_max {self.n_seq_max}")
            ids = []
            for k in range(n_ids):
                q = r.i32(f"cell[{i}].seq_id[{k}]")
                if not 0 <= q < self.n_seq_max:
                    r.fail(f"cell[{i}].seq_id[{k}]", f"is {q}, outside [0, {self.n_seq_max})")
                if q in seen:
                    r.fail(f"cell[{i}].seq_id[{k}]", f"sequence {q} appears in two cells (duplicate tail)")
                seen.add(q)
                ids.append(q)
            cells.append((p, ids))
        layout = self._layout
        if not r.match(layout.head):  # some field differs: read them one by one, naming it
            r.expect("s_trans", r.u32("s_trans"), 0)
            r.expect("n_layer", r.u32("n_layer"), self.spec.n_layer)
            r.expect("n_state_layers", r.u32("n_state_layers"), len(self.pools))
        data: dict[int, dict[str, np.ndarray]] = {}
        for layer, head, tensors in layout.layers:
            if not r.match(head):
                r.expect("layer", r.u32("layer"), layer)
                r.expect(f"layer[{layer}].n_tensors", r.u32(f"layer[{layer}].n_tensors"), len(tensors))
            data[layer] = {}
            for t in tensors:
                name, buf = t.name, t.buf
                if not r.match(t.desc):
                    r.expect(f"layer[{layer}].tensor", r.name(f"layer[{layer}].tensor"), name)
                    code = r.i32(f"layer[{layer}].{name}.type")
                    if CODE_DTYPES.get(code) is not buf.dtype:
                        r.fail(f"layer[{layer}].{name}.type", f"is code {code}, this memory stores {buf.dtype}")
                    r.expect(f"layer[{layer}].{name}.row_bytes", r.u64(f"layer[{layer}].{name}.row_bytes"), t.row_bytes)
                data[layer][name] = r.rows(n_cells, t.row_bytes, buf.dtype, t.rows_field)
        plane_rows = self._parse_planes(r, n_cells) if planes or planes_apart() else None
        r.at_end()
        return {"seq": seq, "cells": cells, "data": data, "planes": plane_rows}

    def _parse_planes(self, r: Reader, n_cells: int) -> tuple[list[int], dict[int, dict[str, np.ndarray]]]:
        """The snapshot planes :meth:`_write_planes` wrote: per cell how many, per tensor the rows."""
        counts = []
        for i in range(n_cells):
            n = r.u32(f"cell[{i}].n_planes")
            if n > MAX_PLANES:
                r.fail(f"cell[{i}].n_planes", f"is {n}; no memory keeps more than {MAX_PLANES} planes")
            counts.append(n)
        total = sum(counts)
        data: dict[int, dict[str, np.ndarray]] = {}
        for layer, _, tensors in self._layout.layers:
            data[layer] = {t.name: r.rows(total, t.row_bytes, t.buf.dtype, t.planes_field) for t in tensors}
        return counts, data

    def apply_section(self, plan: dict[str, Any]) -> None:
        """Install a validated restore plan (cannot fail on a plan from parse_section)."""
        seq, cells, data = plan["seq"], plan["cells"], plan["data"]
        if seq >= 0:
            self.seq_rm(seq, 0, -1)
            b = self._book
            if not cells:
                return
            targets = np.flatnonzero(b.n_own == 0)[:1].tolist()
            p, _ = cells[0]
            c = targets[0]
            b.pos[c], b.src[c], b.n_own[c], b.tail[seq] = p, c, 1, c
            b.snap_end[c], b.snap_valid[c] = p, 1
            b.used += 1
        else:
            self._book = b = _Book.empty(self.size)
            targets = list(range(len(cells)))
            for c, (p, ids) in enumerate(cells):
                b.pos[c], b.src[c], b.n_own[c] = p, c, len(ids)
                b.snap_end[c], b.snap_valid[c] = p, 1
                for q in ids:
                    b.tail[q] = c
            b.used = len(cells)
        self._version += 1
        if targets:
            idx = np.asarray(targets, dtype=np.int64)
            for layer, pools in self.pools.items():
                for name, buf in pools.items():
                    scatter_rows(self.device, buf, idx, data[layer][name])
        if plan.get("planes") is not None:
            self._install_planes(targets, cells, *plan["planes"])

    def landing_writes(self, plan: dict[str, Any]) -> list[RowWrite]:
        """The row writes :meth:`apply_section` makes for a one-sequence ``plan`` when the
        cell it will take is free now: no sequence owns it and no cell names one of its rows
        as its source (so never a shared cell, the destination's own cell or a row another
        state starts from).  A transfer may receive those rows there before the commit
        (:func:`~statecache.state_io.rows_landing`); the zero row is chosen per step, later."""
        seq, cells, data = plan["seq"], plan["cells"], plan["data"]
        b = self._book
        if seq < 0 or not cells:
            return []
        own = int(b.tail[seq])
        free = b.n_own == 0
        if own >= 0 and b.n_own[own] == 1:
            free[own] = True  # apply_section removes the destination first
        targets = np.flatnonzero(free)[:1]
        if not targets.size:
            return []
        c = int(targets[0])
        owned = b.n_own > 0
        if c == own or b.pos[c] >= 0 or b.n_own[c] or (b.src[owned] % self.size == c).any():
            return []
        idx = np.asarray([c], dtype=np.int64)
        out = [
            RowWrite(self.device, buf, idx, data[layer][name])
            for layer, pools in self.pools.items()
            for name, buf in pools.items()
        ]
        if plan.get("planes") is not None:  # as _install_planes: plane j of the cell, j states back
            counts, planes = plan["planes"]
            keep = min(counts[0], self.n_snap - 1) if self.has_layers else 0
            if keep:
                rows = np.asarray([(-j) % self.n_snap * self.size + c for j in range(1, keep + 1)], dtype=np.int64)
                for layer, pools in self.pools.items():
                    out += [RowWrite(self.device, buf, rows, planes[layer][name][:keep]) for name, buf in pools.items()]
        return out

    def state_landing_failed(self) -> None:
        """A read failed after a transfer's rows landed in a free cell: an undo or a plan
        made before it, which may count on what that cell held, is stale now."""
        self._version += 1

    def _install_planes(
        self, targets: Sequence[int], cells: Sequence[tuple[int, Any]], counts: list[int], data: dict[int, Any]
    ) -> None:
        """Put the planes a transfer carried behind the restored states: plane ``j`` of
        the target cell gets the state ``j`` positions back, as many as this memory keeps
        (``n_snap - 1``), and the cell offers rollbacks that deep."""
        b = self._book
        dst: list[int] = []
        src: list[int] = []
        start = 0
        for c, (p, _), n in zip(targets, cells, counts, strict=True):
            keep = min(n, self.n_snap - 1) if self.has_layers else 0
            live = int(b.src[c]) // self.size  # the restored state's plane: the others rotate back from it
            dst += [(live - j) % self.n_snap * self.size + c for j in range(1, keep + 1)]
            src += range(start, start + keep)
            start += n
            b.snap_end[c], b.snap_valid[c] = p, 1 + keep
        if dst:
            idx = np.asarray(dst, dtype=np.int64)
            # one cell (a sequence's blob): its first planes, a view (which a transfer may have landed)
            sel: Any = slice(0, len(src)) if src == list(range(len(src))) else np.asarray(src, dtype=np.int64)
            for layer, pools in self.pools.items():
                for name, buf in pools.items():
                    scatter_rows(self.device, buf, idx, data[layer][name][sel])

    def state_tags(self, flags: int = StateFlags.NONE) -> tuple[bytes, ...]:
        """The tags of the sections :meth:`state_write` writes (with any flags)."""
        return (SECTION_TAG,)

    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        if hasattr(data, "read") and not isinstance(data, bytes | bytearray | memoryview):
            data = data.read()
        # PARTIAL_ONLY does not change what a recurrent memory writes: only unknown flag bits are refused
        blob_flags, sections = unpack_sections(data)
        expect_sections(sections, self.state_tags(flags), "recurrent memory")
        plan = self.parse_section(find_section(sections, SECTION_TAG), seq, planes=bool(blob_flags & WITH_PLANES))
        rows_landing(lambda: self.landing_writes(plan), self.state_landing_failed)
        rows_ready()  # a transfer's rows may still be arriving: validated above, written below
        self.apply_section(plan)


def _lost_sequences(book: _Book, bad_rows: np.ndarray) -> tuple[int, ...]:
    """The sequences of ``book`` whose logical state row is in ``bad_rows`` (a bool mask
    over pool rows): what :meth:`RecurrentMemory._forget_damaged` drops."""
    owned = np.flatnonzero(book.n_own > 0)
    src = book.src[owned]
    lost = owned[(src >= 0) & bad_rows[np.maximum(src, 0)]]
    return tuple(np.flatnonzero(np.isin(book.tail, lost)).tolist()) if lost.size else ()


def _rotated_writes(
    cells: np.ndarray, start_plane: np.ndarray, own: np.ndarray, n_t: np.ndarray, n_snap: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The snapshot tables of sets that start from plane ``start_plane`` and write
    ``n_t[i]`` tokens into ``cells[i]``, and the row each one's final state lands in.

    The final state goes ``n_t`` planes after the start (mod ``n_snap``), column
    ``j`` (the state ``j`` tokens before the end) ``j`` planes before that, so
    column ``n_t``, the input state, is the start plane itself: not written for a
    set that starts from its own cell (``own``), whose input state is already
    there; written for the others when ``n_t < n_snap``.  A decode from its own
    cell writes one row.  A set of a varlen ubatch shorter than the table's
    width writes nothing in the columns past its own (``-1``), so every set's
    columns are exactly those an equal ubatch of its length gives it."""
    live = (start_plane + n_t) % n_snap
    # columns each set writes: its states after 1..n_t tokens (at most n_snap), plus
    # its input state when it does not start from its own cell and has room for it
    n_w = np.minimum(n_t, n_snap) + ((n_t < n_snap) & ~own)
    cols = np.arange(int(n_w.max()), dtype=np.int64)
    table = ((live[:, None] - cols[None, :]) % n_snap) * size + cells[:, None]
    table[cols[None, :] >= n_w[:, None]] = -1
    return table, live * size + cells


def _set_spans(ub: UBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per set of an equal or varlen ubatch: its token count, first and last position (int64)."""
    if ub.cu_seqlens is None:
        n_s, n_t = ub.n_seqs, ub.n_seq_tokens
        pos = ub.pos.reshape(n_s, n_t)
        return np.full(n_s, n_t, dtype=np.int64), pos[:, 0].astype(np.int64), pos[:, -1].astype(np.int64)
    cu = ub.cu_seqlens.astype(np.int64)
    return np.diff(cu), ub.pos[cu[:-1]].astype(np.int64), ub.pos[cu[1:] - 1].astype(np.int64)


def _one_position_per_token(ub: UBatch, n_t: np.ndarray) -> np.ndarray:
    """Per set: whether its positions advance by exactly one per token."""
    step_ok = np.diff(ub.pos.astype(np.int64)) == 1  # token i -> i + 1, across set borders too
    bad = np.flatnonzero(~step_ok)
    if not bad.size:
        return np.ones(n_t.size, dtype=bool)
    ends = np.cumsum(n_t)  # a set's steps are those between its first and last token
    starts = ends - n_t
    # a set is fine when no bad step k has starts <= k < ends - 1
    first_bad = np.searchsorted(bad, starts)
    fine: np.ndarray = (first_bad >= bad.size) | (bad[np.minimum(first_bad, bad.size - 1)] >= ends - 1)
    return fine


def _host_offsets(ub: UBatch) -> np.ndarray | None:
    """A varlen ubatch's set offsets as int64 (None for an equal ubatch)."""
    return None if ub.cu_seqlens is None else ub.cu_seqlens.astype(np.int64)


def _live_planes(b: _Book, cells: np.ndarray, size: int, n_snap: int) -> np.ndarray:
    """The live plane of each (owned, at rest) cell: the plane its last write ended
    in, which is its source's plane plus the depth of a pending rollback."""
    live: np.ndarray = (b.src[cells] // size + b.snap_end[cells] - b.pos[cells]) % n_snap
    return live


def _plane_rows(
    old: np.ndarray, new: np.ndarray, live: np.ndarray, n_valid: np.ndarray, size: int, n_snap: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the snapshot planes ``live[k] - j`` (mod ``n_snap``), ``1 <= j < n_valid[k]``,
    of cell ``old[k]`` and of cell ``new[k]``."""
    if not old.size:
        return _EMPTY_ROWS, _EMPTY_ROWS
    reps = n_valid - 1
    k = np.repeat(np.arange(old.size), reps)
    j = np.arange(int(reps.sum()), dtype=np.int64) - np.repeat(np.cumsum(reps) - reps, reps) + 1
    plane = (live[k] - j) % n_snap
    return plane * size + old[k], plane * size + new[k]


def _needs_staging(inp: RecurrentInputs) -> bool:
    """True when a row the step reads is also written in the same step by someone else."""
    owner = np.full(inp.size * inp.n_snap, -1, dtype=np.int64)
    owner[inp.written_rows()] = inp.written_owners()
    o = owner[inp.start_rows]
    if ((o >= 0) & (o != np.arange(inp.n_seqs))).any():
        return True
    copy_dst = inp.copy_dst
    if copy_dst.size:
        owner[copy_dst] = inp.n_seqs  # written by the copies that run besides the primitive
        if (owner[inp.copy_src] >= 0).any() or np.isin(copy_dst, inp.start_rows).any():
            return True
    return False


__all__ = [
    "FullContext",
    "NonConsecutivePositionWarning",
    "RecurrentContext",
    "RecurrentInputs",
    "RecurrentMemory",
    "StateError",
]
