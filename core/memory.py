"""The memory interface (docs/memory-semantics.md#interface), written once for every memory.

A :class:`Memory` owns a cell book and device buffers.  ``init_batch`` /
``init_full`` / ``init_update`` are *dry runs*: they return a
:class:`MemoryContext` (a plan: the ubatches and whatever slot data places
them) and never mutate the memory.  :meth:`MemoryContext.apply` is the only
commit point; :meth:`MemoryContext.next` advances to the next ubatch.

When the graph compute of an applied ubatch fails (``FAILED_COMPUTE``), a
runtime calls :meth:`MemoryContext.undo` on the context instead of the
best-effort ``seq_rm`` of upstream (docs/memory-semantics.md#failed-compute): a context that supports it puts
the memory back as it was before the ubatch(es) it applied (the recurrent
memory does, exactly or, when state rows were overwritten and not kept and
the caller asks for it with ``undo(drop=True)``, consistently by dropping the
affected sequences, whose ids it returns; ``undo_loses`` asks first).

Before acting, a runtime can ask what an operation would do
(docs/memory-semantics.md#queries): ``*_refusal`` / ``can_*`` for every
sequence operation, ``rollback_reach``, and ``seq_state`` (a read-only view of
a sequence's state rows).

Composite memories (hybrids) split the batch themselves, ask every part to
``prepare(ubatches)`` and build each part's context from the same ubatch
list; their ``apply()`` applies one ubatch in each part and combines the
statuses with :func:`status_combine`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.errors import ArgumentError, InvariantError

# Re-exported: ContextError was defined here before the errors moved to one module.
from statecache.errors import ContextError as ContextError

if TYPE_CHECKING:
    from statecache.batch import BatchAllocator, UBatch

#: Positions are signed 32-bit; a negative p1 means "to the end", that is POS_MAX.
POS_MAX = 2**31 - 1

#: The largest position a token may hold.  POS_MAX itself is the open end of every
#: range (``p1 = -1``): a token there was outside ``[p0, POS_MAX)``, so
#: ``seq_rm(s, -1, -1)`` returned True and left it, and ``seq_add(s, p, -1, d)`` never
#: moved it.  Batches, shifts and state blobs refuse it instead.
POS_LAST = POS_MAX - 1


#: Smallest signed 32-bit value (positions and sequence ids are int32 in a blob).
POS_MIN = -(2**31)


def normalize_range(p0: int, p1: int) -> tuple[int, int]:
    """Spec convention: ``p0 < 0 -> 0`` and ``p1 < 0 -> +inf`` (POS_MAX).

    Both ends must be integers inside int32 (:class:`ArgumentError` naming
    ``p0`` or ``p1`` otherwise): a position is an int32 everywhere else."""
    p0 = check_int32(p0, "p0")
    p1 = check_int32(p1, "p1")
    return max(p0, 0), POS_MAX if p1 < 0 else p1


def check_int32(value: Any, name: str) -> int:
    """``value`` as an int, or :class:`ArgumentError` naming ``name`` when it is not an
    integer or lies outside int32 (what a position, a shift or a divisor must be)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentError(name, f"must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if not POS_MIN <= v <= POS_MAX:
        raise ArgumentError(name, f"{v} is outside the int32 range [{POS_MIN}, {POS_MAX}]")
    return v


def check_divisor(d: Any) -> int:
    """The divisor of ``seq_div``: an int32 integer >= 1 (:class:`ArgumentError` naming ``d``)."""
    divisor = check_int32(d, "d")
    if divisor < 1:
        raise ArgumentError("d", f"divisor must be >= 1, got {divisor}")
    return divisor


def check_shifted(pos: int, delta: int) -> None:
    """Refuse a ``seq_add`` that would move position ``pos`` past :data:`POS_LAST` (a
    shift below 0 is allowed: it removes the cell); every later write of the position
    would fail, and POS_MAX is the open end no range reaches."""
    if pos + delta > POS_LAST:
        raise ArgumentError(
            "delta",
            f"moves position {pos} to {pos + delta}, past the largest position {POS_LAST} "
            f"(int32; {POS_MAX} is the end of every range)",
        )


def check_seq_id(seq: Any, n_seq_max: int, name: str = "seq", *, allow_all: bool = False) -> int:
    """``seq`` as an int when it is a sequence id of a memory of ``n_seq_max``
    sequences; with ``allow_all`` a negative value (every sequence) passes too.
    Anything else raises :class:`ArgumentError` naming ``name``, so every memory
    refuses a bad id the same way, before it changes anything."""
    if isinstance(seq, bool) or not isinstance(seq, int | np.integer):
        raise ArgumentError(name, f"must be an integer sequence id, got {type(seq).__name__} {seq!r}")
    s = int(seq)
    if s < 0 and allow_all:
        return -1
    if not 0 <= s < n_seq_max:
        every = " (or negative: every sequence)" if allow_all else ""
        raise ArgumentError(name, f"sequence {s} outside [0, n_seq_max={n_seq_max}){every}")
    return s


def refusal_of(check: Callable[[], object]) -> str | None:
    """Run ``check`` (a validation that raises :class:`ArgumentError` and changes
    nothing): its message when it raises, else None.  The queries of
    :class:`Memory` answer with it, so a query and its action share one check."""
    try:
        check()
    except ArgumentError as exc:
        return str(exc)
    return None


@dataclasses.dataclass(frozen=True)
class RollbackReach:
    """How far a sequence can roll back right now (:meth:`Memory.rollback_reach`).

    ``seq_rm(seq, p, -1)`` is accepted exactly for ``p <= whole`` (the whole
    sequence goes) and for ``p >= floor`` (``p > pos_max`` removes nothing), and
    refused for ``whole < p < floor``.  ``floor == 0``: every position is accepted;
    ``floor == pos_max + 1``: no rollback is possible (only dropping it all).
    """

    seq: int
    #: ``seq_pos_max(seq)`` now (-1: the sequence holds nothing).
    pos_max: int
    floor: int
    #: A removal from any ``p <= whole`` takes every position the sequence holds, so it is
    #: accepted whatever the floor: 0, or the lowest position held where a memory refuses
    #: some rollbacks of a sequence whose head was removed (an iSWA pair).
    whole: int = 0

    def accepts(self, p: int) -> bool:
        """Whether ``seq_rm(seq, p, -1)`` would be accepted (``p < 0`` means 0; a ``p``
        outside int32 is refused, as every position is)."""
        return POS_MIN <= p <= POS_MAX and (p <= self.whole or p >= self.floor)

    @property
    def depth(self) -> int:
        """The most trailing tokens a rollback can remove while keeping at least one
        (``seq_rm(seq, pos_max + 1 - depth, -1)``); dropping everything is always possible."""
        return max(0, self.pos_max + 1 - max(self.floor, 1))


#: Reads rows of a state view: ``(layer, tensor) -> host array`` (see :class:`RecurrentRows`).
RowReader = Callable[[int, str], np.ndarray]


@dataclasses.dataclass(frozen=True)
class RecurrentRows:
    """One sequence's rows in a recurrent memory's pools (:meth:`Memory.seq_state`).

    Every recurrent layer has one pool per state tensor (``tensors``: the
    ``(layer, tensor name)`` pairs), all with the same row layout, so the rows
    below are the rows of every pool.  ``row``: the pool row holding the
    sequence's logical state (its position ``pos``; any plane, the one a
    pending rollback reads); ``-1`` when the state is all zeros (a cell no step
    wrote yet).  ``planes[j - 1]`` holds the state at ``pos - j``: exactly the
    snapshot planes a rollback can still read.  ``sharers``: every sequence
    that shares the cell (``seq`` included; copy on write).  ``cell == -1``: the
    sequence holds no recurrent state.
    """

    cell: int
    pos: int
    row: int
    planes: tuple[int, ...]
    pending_rollback: int
    sharers: tuple[int, ...]
    tensors: tuple[tuple[int, str], ...]
    _read: RowReader | None = dataclasses.field(default=None, repr=False, compare=False)

    def read(self, layer: int, tensor: str) -> np.ndarray:
        """``[1 + len(planes), row_size]``: the logical state (zeros when ``row == -1``),
        then the planes, nearest first, of pool ``(layer, tensor)``, copied to the host.

        :raises ContextError: the memory changed since this view was taken."""
        if self._read is None:
            raise ArgumentError("seq", "holds no recurrent state")
        return self._read(layer, tensor)


@dataclasses.dataclass(frozen=True)
class KVSeqCells:
    """One sequence's cells in one attention (or indexer) cache (:meth:`Memory.seq_state`).

    ``cache``: the cache's name (``kv``, ``kv_base``, ``kv_swa``, ``idx``);
    ``stream``: the stream the sequence lives in.  Per cell, sorted by position:
    ``positions``, ``cells``, ``rows`` (``stream * size + cell``: the K/V row
    of every layer), ``shared`` (another sequence sees the cell too) and
    ``pending_shift`` (the position change the next update re-rotates K by).
    ``layers``: the model layers with K (and, unless ``key_only``, V) rows here.
    Arrays are read-only.
    """

    cache: str
    stream: int
    positions: np.ndarray
    cells: np.ndarray
    rows: np.ndarray
    shared: np.ndarray
    pending_shift: np.ndarray
    layers: tuple[int, ...]
    key_only: bool = False
    _read: Callable[[int, bool], np.ndarray] | None = dataclasses.field(default=None, repr=False, compare=False)

    def read(self, layer: int, v: bool = False) -> np.ndarray:
        """``[len(rows), width]``: the K (``v``: V) rows of ``layer``, copied to the host,
        as stored (a pending shift is not applied).

        :raises ContextError: the memory changed since this view was taken."""
        assert self._read is not None
        return self._read(layer, v)


@dataclasses.dataclass(frozen=True)
class SeqState:
    """A read-only view of what a memory holds for one sequence (:meth:`Memory.seq_state`):
    what outside code would otherwise read from private books.  ``version`` is the
    memory's version it describes; reading rows through it after the memory changed
    raises :class:`ContextError`."""

    seq: int
    version: Hashable
    pos_min: int
    pos_max: int
    recurrent: RecurrentRows | None
    kv: tuple[KVSeqCells, ...]
    rollback: RollbackReach


def readonly_rows(arr: Any) -> np.ndarray:
    """A read-only int64 copy (what the state views hand out)."""
    out = np.array(arr, dtype=np.int64, copy=True)
    out.flags.writeable = False
    return out


def view_guard(memory: Memory, version: Hashable) -> None:
    """Raise :class:`ContextError` when ``memory`` moved past ``version`` (a state view is stale)."""
    if memory.version != version:
        raise ContextError(
            f"{type(memory).__name__}: the memory changed since this state view was taken "
            f"(version {version} -> {memory.version}); ask seq_state() again"
        )


class MemoryStatus(enum.Enum):
    SUCCESS = "success"
    NO_UPDATE = "no_update"
    FAILED_PREPARE = "failed_prepare"
    FAILED_COMPUTE = "failed_compute"

    @property
    def is_fail(self) -> bool:
        return self in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE)


def status_combine(a: MemoryStatus, b: MemoryStatus) -> MemoryStatus:
    """Combine two part statuses: the first failure (``a`` before ``b``) wins;
    otherwise SUCCESS if either succeeded, else NO_UPDATE."""
    if a.is_fail:
        return a
    if b.is_fail:
        return b
    if MemoryStatus.SUCCESS in (a, b):
        return MemoryStatus.SUCCESS
    return MemoryStatus.NO_UPDATE


class StateFlags(enum.IntFlag):
    """``PARTIAL_ONLY``: only the memories that cannot be rebuilt by truncating a
    later state (recurrent state, SWA caches).  ``ON_DEVICE``: reserved.
    ``WITH_PLANES``: the recurrent section also carries each cell's snapshot planes
    still valid, so the restored memory rolls back as the original could
    (docs/state-format.md); the reader follows the blob's own bit."""

    NONE = 0
    PARTIAL_ONLY = 1
    ON_DEVICE = 2
    WITH_PLANES = 4


class MemoryContext(abc.ABC):
    """A plan produced by ``init_*`` (docs/memory-semantics.md#contexts).

    **Stale plans are refused.**  A plan is only valid for the book it was
    computed on: two plans made from the same state would otherwise both
    place their tokens in the same free cells.  So every context records the
    :attr:`Memory.version` of the memory it was planned against
    (:meth:`record_version`), ``apply()`` raises :class:`ContextError`,
    changing nothing, once the memory moved (:meth:`check_version`), and
    the context takes the memory's new version after each change it makes
    itself (:meth:`update_version`: its own ``apply()``, ``next()``, undo).
    """

    _planned_on: Memory | None = None
    _planned_version: Hashable = None

    def record_version(self, memory: Memory | None) -> None:
        """This plan was made against ``memory`` as it is now (None: bound to nothing)."""
        self._planned_on = memory
        self._planned_version = None if memory is None else memory.version

    def check_version(self) -> None:
        """Raise :class:`ContextError` if the memory changed since the plan (or the last
        change this context made); called by ``apply()`` before anything changes."""
        mem = self._planned_on
        if mem is not None and mem.version != self._planned_version:
            raise ContextError(
                f"{type(self).__name__}: the {type(mem).__name__} changed after this plan was made "
                f"(version {self._planned_version} -> {mem.version}); nothing was applied, plan the batch again"
            )

    def update_version(self) -> None:
        """The context itself changed the memory: its plan continues from the new version."""
        if self._planned_on is not None:
            self._planned_version = self._planned_on.version

    @property
    @abc.abstractmethod
    def status(self) -> MemoryStatus:
        """SUCCESS, NO_UPDATE, or FAILED_PREPARE for a plan that could not be made."""

    def get_status(self) -> MemoryStatus:
        """The plan's :attr:`status` (upstream's accessor name)."""
        return self.status

    @abc.abstractmethod
    def get_ubatch(self) -> UBatch:
        """The current ubatch.

        :raises ContextError: the plan failed, has no ubatches, or is exhausted."""

    @abc.abstractmethod
    def apply(self) -> bool:
        """Commit the current ubatch (or perform the update): the only place a
        memory's book changes.

        :return: True when the ubatch was committed.
        :raises ContextError: past the last ubatch, or this ubatch was already
            applied, or the plan is stale (the memory changed since it was
            made, docs/memory-semantics.md#stale-plans); nothing changes."""

    @abc.abstractmethod
    def next(self) -> bool:
        """Advance to the next ubatch.

        :return: False when there is none (the plan is exhausted)."""

    def undo(self, n: int | None = None, *, drop: bool = False) -> tuple[int, ...]:
        """Take back the last ``n`` applied ubatches (default: all) after a failed compute.

        Exact, or refused: when some sequences' state rows were overwritten and
        not kept (``keep_undo_rows``), the undo could only drop those sequences,
        and it does so only with ``drop=True`` (:meth:`undo_loses` names them
        first); without it, :class:`ContextError` and nothing changed.

        :return: the sequences dropped (empty tuple: exact).
        :raises ContextError: this context cannot undo, the memory changed since,
            or the undo would drop sequences without ``drop``; nothing changed.
        """
        raise ContextError(f"{type(self).__name__} cannot undo an applied ubatch")

    def undo_loses(self, n: int | None = None) -> tuple[int, ...]:
        """The sequences :meth:`undo` of ``n`` ubatches would have to drop (empty: it
        would be exact).  A question before the action: changes nothing.

        :raises ContextError: the undo would be refused anyway."""
        raise ContextError(f"{type(self).__name__} cannot undo an applied ubatch")


class StatusContext(MemoryContext):
    """A context with nothing to do: NO_UPDATE, or a failed plan (``reason`` says why)."""

    def __init__(self, status: MemoryStatus, reason: str = "", memory: Memory | None = None) -> None:
        self._status = status
        self.reason = reason
        self.record_version(memory)  # NO_UPDATE from init_update: refused once the memory moved

    @property
    def status(self) -> MemoryStatus:
        return self._status

    def get_ubatch(self) -> UBatch:
        raise ContextError(f"no ubatch in a {self._status.value} context {self.reason}".rstrip())

    def apply(self) -> bool:
        if self._status is not MemoryStatus.NO_UPDATE:
            return False
        self.check_version()
        return True

    def next(self) -> bool:
        return False

    def undo(self, n: int | None = None, *, drop: bool = False) -> tuple[int, ...]:
        return ()  # nothing was ever applied

    def undo_loses(self, n: int | None = None) -> tuple[int, ...]:
        return ()


class UBatchContext(MemoryContext):
    """Iterates a ubatch list; subclasses implement :meth:`_apply_ubatch`."""

    def __init__(self, ubatches: Sequence[UBatch], memory: Memory | None = None) -> None:
        self.ubatches = list(ubatches)
        self.i_next = 0
        self._applied = -1
        self.record_version(memory)

    @property
    def status(self) -> MemoryStatus:
        return MemoryStatus.SUCCESS

    def get_ubatch(self) -> UBatch:
        if self.i_next >= len(self.ubatches):
            raise ContextError("context exhausted")
        return self.ubatches[self.i_next]

    def apply(self) -> bool:
        if self.i_next >= len(self.ubatches):
            raise ContextError("apply() past the last ubatch")
        if self._applied == self.i_next:
            raise ContextError(f"ubatch {self.i_next} already applied")
        self.check_version()
        ok = self._apply_ubatch(self.i_next)
        self._applied = self.i_next
        self.update_version()
        return ok

    def next(self) -> bool:
        self.i_next += 1
        return self.i_next < len(self.ubatches)

    @abc.abstractmethod
    def _apply_ubatch(self, i: int) -> bool: ...


class Memory(abc.ABC):
    """The interface every memory implements (``llama_memory_i``).

    The contract of every method is written here, once; each memory's
    differences are stated in the method's docstring.  Semantics, with the
    rules each memory follows: ``docs/memory-semantics.md``.  Two rules hold
    for every method:

    * A sequence id outside ``[0, n_seq_max)`` raises :class:`ArgumentError`
      naming the argument (``seq``, ``src``, ``dst``); only ``seq_rm`` and
      ``state_write`` / ``state_read`` accept ``-1`` ("every sequence").
    * Whatever is refused (a ``False`` return or an exception) leaves the
      memory exactly as it was: book, positions, pending rollbacks and data.

    Position ranges are half-open ``[p0, p1)``; ``p0 < 0`` means 0 and
    ``p1 < 0`` means "to the end" (docs/memory-semantics.md#ranges).
    """

    #: Sequence ids are ``[0, n_seq_max)``; every memory sets it at construction.
    n_seq_max: int

    #: Bumped by every change of the book (sequence operations, applied ubatches and
    #: updates, state reads, clears); never goes back.  See :attr:`version`.
    _version: int = 0

    @property
    def version(self) -> Hashable:
        """A value that changes whenever the memory's book changes; contexts compare it
        to refuse a stale plan.  Composite memories answer with their parts' versions."""
        return self._version

    def no_update_context(self) -> StatusContext:
        """The NO_UPDATE context of :meth:`init_update`, bound to this memory's version."""
        return StatusContext(MemoryStatus.NO_UPDATE, memory=self)

    @abc.abstractmethod
    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False, *, varlen: bool = False
    ) -> MemoryContext:
        """Plan a validated batch: split it into ubatches of at most ``n_ubatch``
        tokens and find each one's slot.  A dry run: nothing changes until the
        context's :meth:`MemoryContext.apply`.

        :param balloc: a :class:`~statecache.batch.BatchAllocator` whose
            ``init(batch, self)`` succeeded.
        :param n_ubatch: the most tokens per ubatch.
        :param embd_all: every token is an output (splits one sequence set per ubatch).
        :param varlen: split with :meth:`~statecache.batch.BatchAllocator.split_varlen`:
            the whole batch in one packed ubatch when it fits ``n_ubatch`` (sets of any
            length and any sequence ids, offsets in ``ubatch.cu_seqlens``), so one
            primitive call per layer advances every sequence.  The default (False) keeps
            each memory's own split (equal ubatches for recurrent state).  Takes
            precedence over ``embd_all``'s split.
        :return: the plan; its status is ``FAILED_PREPARE`` (nothing changed)
            when the splitter cannot place every token or the slots do not fit.
            The plan is refused (``ContextError`` at ``apply()``) once the
            memory changed (docs/memory-semantics.md#stale-plans).
        :raises ArgumentError: ``balloc`` holds no validated batch, or was
            validated for another ``n_seq_max``; nothing changed.
        """

    @abc.abstractmethod
    def init_full(self) -> MemoryContext:
        """A plan of the worst case (every cell, the largest ubatch geometry), for
        sizing compute buffers before the first batch.

        :return: a context describing that case."""

    def init_update(self, optimize: bool = False) -> MemoryContext:
        """A plan for pending maintenance: K shifts and copies between streams
        of attention caches.

        :param optimize: also defragment where a memory can (none does yet).
        :return: ``NO_UPDATE`` when there is nothing to do (always, for a
            recurrent memory); else a context whose ``apply()`` performs it."""
        return self.no_update_context()

    def get_can_shift(self) -> bool:
        """Whether ``seq_add`` / ``seq_div`` can move positions (RoPE re-rotation).

        :return: True for a recurrent memory; False for an attention cache
            that reuses cells a sliding window left (a shift would widen what
            the next windows reach), and so for a hybrid holding one."""
        return True

    @abc.abstractmethod
    def clear(self, data: bool = True) -> None:
        """Drop every sequence and any pending rollback or update.

        :param data: also zero every device buffer (costs a write of all of them).
        """

    @abc.abstractmethod
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove ``seq``'s tokens at positions ``p0 <= pos < p1``.

        :param seq: sequence id; ``-1``: every sequence.
        :param p0: first position removed; negative: 0.
        :param p1: first position kept; negative: none (to the end).
        :return: True when none of those tokens remain (also when none were
            there).  False when refused, and then nothing changed: a recurrent
            state (alone or in a hybrid) cannot forget part of its history, so
            a partial removal of the tail is refused unless a snapshot plane
            holds the state at ``p0 - 1`` (docs/memory-semantics.md#seq-rm:
            no plane that deep, a rollback already pending, a shared cell), and
            ``seq=-1`` is refused for a range that is neither empty nor
            complete.  A KV cache never refuses.  A hybrid asks its recurrent
            part first and, when it refuses, changes nothing in any part; it
            also refuses a removal after which its parts would end ``seq`` at
            different positions (docs/memory-semantics.md#hybrid).
        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)`` and not -1;
            nothing changed.
        """

    @abc.abstractmethod
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` hold ``src``'s tokens at ``p0 <= pos < p1`` (no data moves:
        cells are shared, copy on write for recurrent states).

        :param src: sequence copied from.  :param dst: sequence copied to;
            ``src == dst`` is a no-op.
        :param p0: first position copied.  :param p1: first position not copied.
        :raises ArgumentError: ``src`` or ``dst`` outside ``[0, n_seq_max)``; a
            partial range between two streams of a multi-stream cache, or any
            partial range on hybrid-idx (whole sequences only).  Nothing changed.
            A recurrent state can only be copied whole, so a range that leaves
            out a position ``src`` holds is refused by every memory with one
            (argument ``p0/p1``).

        The copied state replaces ``dst``'s own; a hybrid therefore drops
        ``dst`` from its attention part first (docs/memory-semantics.md#hybrid).
        """

    @abc.abstractmethod
    def seq_keep(self, seq: int) -> None:
        """Drop every sequence but ``seq`` (and their pending rollbacks);
        ``seq`` becomes the only owner of what it holds.

        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)``; nothing changed.
        """

    @abc.abstractmethod
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift ``seq``'s positions in ``[p0, p1)`` by ``delta`` (a context shift).

        Data is not touched: an attention cache records the shift and
        re-rotates K at the next update; a recurrent state only moves its
        position (and its snapshot planes with it).  Positions pushed below 0
        remove those tokens.  ``delta == 0`` or an empty range is a no-op.

        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)``, or a moved
            position belongs to a cell another sequence shares (moving it would
            move theirs), or ``delta`` or a moved position leaves int32, or a
            hybrid's parts would end ``seq`` at different positions; nothing
            changed.
        """

    @abc.abstractmethod
    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide ``seq``'s positions in ``[p0, p1)`` by ``d``
        (self-extend); ``d == 1`` or an empty range is a no-op.  A recurrent
        state's snapshot planes no longer match its positions and are dropped.

        :raises ArgumentError: ``d < 1``; ``seq`` outside ``[0, n_seq_max)``; a
            divided position belongs to a shared cell; a hybrid's parts would
            end ``seq`` at different positions.  Nothing changed.
        """

    @abc.abstractmethod
    def seq_pos_min(self, seq: int) -> int:
        """Smallest position held for ``seq``, ``-1`` when it holds none.

        A recurrent state holds one position (its last); a hybrid answers the
        larger of its parts' minima (docs/memory-semantics.md#hybrid)."""

    @abc.abstractmethod
    def seq_pos_max(self, seq: int) -> int:
        """Largest position held for ``seq``, ``-1`` when it holds none; the next
        batch of ``seq`` must start at ``seq_pos_max(seq) + 1``.  A hybrid
        answers the smaller of its parts' maxima."""

    # -- questions before actions (docs/memory-semantics.md#queries) -----------------
    # Each ``check_*`` raises exactly when its action would be refused (an exception, or
    # ``False`` from seq_rm) and changes nothing; the ``*_refusal`` / ``can_*`` answers
    # are built on them, so a query and its action can never disagree.

    @abc.abstractmethod
    def check_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Raise :class:`ArgumentError` (naming the argument) exactly when
        ``seq_rm(seq, p0, p1)`` would return False or raise; changes nothing."""

    @abc.abstractmethod
    def check_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Raise :class:`ArgumentError` exactly when ``seq_cp(src, dst, p0, p1)`` would; changes nothing."""

    @abc.abstractmethod
    def check_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Raise :class:`ArgumentError` exactly when ``seq_add(seq, p0, p1, delta)`` would (``delta``
        0 never refuses a valid range); changes nothing."""

    @abc.abstractmethod
    def check_seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """Raise :class:`ArgumentError` exactly when ``seq_div(seq, p0, p1, d)`` would (``d`` 1
        never refuses a valid range); changes nothing."""

    @abc.abstractmethod
    def check_context_shift(self, seq: int, p0: int, p1: int) -> None:
        """Raise :class:`ArgumentError` exactly when :meth:`context_shift` would:
        when either of its halves (the removal, or the move of the later positions
        as it would find them after the removal) would be refused; changes nothing."""

    def seq_rm_refusal(self, seq: int, p0: int = -1, p1: int = -1) -> str | None:
        """Why ``seq_rm(seq, p0, p1)`` would be refused (return False, or raise for a bad
        argument).  Changes nothing.

        A recurrent state (alone or in a hybrid) refuses a partial removal of its
        tail that no snapshot plane can undo, a second rollback while one is
        pending, a rollback of a shared cell, and ``seq=-1`` with a range neither
        empty nor complete; a hybrid also refuses what would leave its parts
        ending ``seq`` at different positions; hybrid-idx a hole that would regroup
        k-pools shared with another sequence (docs/memory-semantics.md#seq-rm).

        :return: the reason (the message of the :class:`ArgumentError` that
            :meth:`check_seq_rm` raises, naming the argument), or None when
            ``seq_rm`` would return True."""
        return refusal_of(lambda: self.check_seq_rm(seq, p0, p1))

    def seq_cp_refusal(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> str | None:
        """Why ``seq_cp(src, dst, p0, p1)`` would raise: a bad ``src`` or ``dst`` id, a
        partial copy between streams or of a recurrent state, any partial range on
        hybrid-idx.  Changes nothing.

        :return: the reason, or None when the copy would be accepted."""
        return refusal_of(lambda: self.check_seq_cp(src, dst, p0, p1))

    def seq_add_refusal(self, seq: int, p0: int, p1: int, delta: int) -> str | None:
        """Why ``seq_add(seq, p0, p1, delta)`` would raise: a moved position another
        sequence shares, a ``delta`` that moves a position past int32, two cells left
        at one position, a hybrid's parts ending at different positions, a k-pool
        regrouping.  Changes nothing.

        :return: the reason, or None when the shift would be accepted."""
        return refusal_of(lambda: self.check_seq_add(seq, p0, p1, delta))

    def seq_div_refusal(self, seq: int, p0: int, p1: int, d: int) -> str | None:
        """Why ``seq_div(seq, p0, p1, d)`` would raise: a divisor ``d < 1``, a shared
        cell, or the other refusals of :meth:`seq_add_refusal`.  Changes nothing.

        :return: the reason, or None when the division would be accepted."""
        return refusal_of(lambda: self.check_seq_div(seq, p0, p1, d))

    def context_shift_refusal(self, seq: int, p0: int, p1: int) -> str | None:
        """Why :meth:`context_shift` would be refused (either half, as
        :meth:`check_context_shift` says).  Changes nothing.

        :return: the reason, or None when the shift would be accepted."""
        return refusal_of(lambda: self.check_context_shift(seq, p0, p1))

    def can_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """``seq_rm_refusal(...) is None``: whether ``seq_rm`` would return True, changing nothing.

        :return: True when the removal would be accepted."""
        return self.seq_rm_refusal(seq, p0, p1) is None

    def can_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> bool:
        """``seq_cp_refusal(src, dst, ...) is None``: whether the copy would be accepted.

        :return: True when ``seq_cp`` would not raise."""
        return self.seq_cp_refusal(src, dst, p0, p1) is None

    def can_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> bool:
        """``seq_add_refusal(..., delta) is None``: whether the shift would be accepted.

        :return: True when ``seq_add`` would not raise."""
        return self.seq_add_refusal(seq, p0, p1, delta) is None

    def can_seq_div(self, seq: int, p0: int, p1: int, d: int) -> bool:
        """``seq_div_refusal(..., d) is None``: whether the division would be accepted.

        :return: True when ``seq_div`` would not raise."""
        return self.seq_div_refusal(seq, p0, p1, d) is None

    def can_context_shift(self, seq: int, p0: int, p1: int) -> bool:
        """``context_shift_refusal(...) is None``: whether :meth:`context_shift` would be accepted.

        :return: True when the shift would not raise."""
        return self.context_shift_refusal(seq, p0, p1) is None

    def context_shift(self, seq: int, p0: int, p1: int) -> None:
        """Drop ``seq``'s positions ``[p0, p1)`` and move every later position down by
        ``p1 - p0``, as one operation: ``seq_rm(seq, p0, p1)`` then
        ``seq_add(seq, p1, -1, p0 - p1)`` (docs/memory-semantics.md#context-shift).

        Both halves are checked before either runs, so a refused shift (a forked
        sequence whose later cells are shared, a removal the recurrent part
        refuses ...) changes nothing; upstream applies the removal and then
        refuses the move.  An empty range is a no-op.

        :raises ArgumentError: naming the argument, as :meth:`check_context_shift`
            says; nothing changed."""
        self.check_context_shift(seq, p0, p1)
        q0, q1 = normalize_range(p0, p1)
        if q0 >= q1:
            return
        if not self.seq_rm(seq, q0, q1):
            raise InvariantError("context-shift", f"seq_rm({seq}, {q0}, {q1}) was refused after its check passed")
        if q1 < POS_MAX:
            self.seq_add(seq, q1, -1, q0 - q1)

    @abc.abstractmethod
    def rollback_reach(self, seq: int) -> RollbackReach:
        """How far ``seq`` can roll back right now: the positions ``p`` for which
        ``seq_rm(seq, p, -1)`` would be accepted (:class:`RollbackReach`).  A KV cache
        accepts every ``p``; a recurrent state as deep as its valid snapshot planes
        go (none while a rollback is pending or its cell is shared); a hybrid where
        every part accepts and they would still agree.

        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)``."""

    def rollback_reach_all(self) -> list[RollbackReach]:
        """:meth:`rollback_reach` of every sequence id in ``[0, n_seq_max)``."""
        return [self.rollback_reach(s) for s in range(self.n_seq_max)]

    @abc.abstractmethod
    def seq_state(self, seq: int) -> SeqState:
        """A read-only view of ``seq``'s state rows (:class:`SeqState`): its recurrent
        rows (the logical state's row and the snapshot planes still valid, the same
        rows in every layer's pools) and its cells with positions in every attention
        and indexer cache, with readers for their data.  Changes nothing; the view
        refuses to read once the memory changed.

        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)``."""

    def batch_allocator(self) -> BatchAllocator:
        """A :class:`~statecache.batch.BatchAllocator` sized for this memory (its ``n_seq_max``)."""
        from statecache.batch import BatchAllocator

        return BatchAllocator.for_memory(self)

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of device memory this memory holds (every pool, plane and cache part).

        :return: ``{device id: bytes}``."""

    @abc.abstractmethod
    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        """Save ``seq`` (``-1``: every sequence) in the format of
        ``docs/state-format.md``.  Changes nothing.

        :param flags: ``StateFlags.PARTIAL_ONLY``: only the parts that cannot be
            rebuilt from a later state (recurrent state, sliding-window caches).
        :return: the blob.  A pending rollback is written from its plane, with
            its rolled-back position (docs/memory-semantics.md#state).  A pending
            update (a K shift, a copy between streams) need not be run first: the
            blob holds the rows as :meth:`init_update` would leave them, K rotated
            on a copy by the cache's ``k_shift`` hook (the memory is not changed).
        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)`` and not -1.
        :raises StateError: a whole-memory write of a cell that sequences with
            different pending rollbacks share; a written K row waits for a shift
            while the cache has no ``k_shift`` hook (the runtime rotates K itself:
            run its update first).
        """

    @abc.abstractmethod
    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        """Restore what :meth:`state_write` saved, into ``seq`` (``-1``: the whole
        memory, replacing everything).  No rollback is pending afterwards.

        :param data: a blob (bytes-like) written with the same ``flags``.
        :raises StateError: naming the field, when the blob is truncated,
            corrupt (a section's checksum), has unknown header flags, was
            written for another layout, describes an impossible book (a
            sequence holding one position twice, parts ending a sequence at
            different positions), or does not fit; every section
            of every part is checked before anything is written, so the memory
            is left exactly as it was (docs/memory-semantics.md#state-failures).
        :raises ArgumentError: ``seq`` outside ``[0, n_seq_max)`` and not -1.
        """
