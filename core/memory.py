"""The memory interface (spec §1), written once for every memory.

A :class:`Memory` owns a cell book and device buffers.  ``init_batch`` /
``init_full`` / ``init_update`` are *dry runs*: they return a
:class:`MemoryContext` (a plan: the ubatches and whatever slot data places
them) and never mutate the memory.  :meth:`MemoryContext.apply` is the only
commit point; :meth:`MemoryContext.next` advances to the next ubatch.

When the graph compute of an applied ubatch fails (``FAILED_COMPUTE``), a
runtime calls :meth:`MemoryContext.undo` on the context instead of the
best-effort ``seq_rm`` of upstream (§1.3): a context that supports it puts
the memory back as it was before the ubatch(es) it applied (the recurrent
memory does, exactly or, when state rows were overwritten and not kept,
consistently by dropping the affected sequences, whose ids it returns).

Composite memories (hybrids) split the batch themselves, ask every part to
``prepare(ubatches)`` and build each part's context from the same ubatch
list; their ``apply()`` applies one ubatch in each part and combines the
statuses with :func:`status_combine`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.errors import ArgumentError, StatecacheError

if TYPE_CHECKING:
    from statecache.batch import BatchAllocator, UBatch

#: Positions are signed 32-bit; a negative p1 means "to the end".
POS_MAX = 2**31 - 1


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
    d = check_int32(d, "d")
    if d < 1:
        raise ArgumentError("d", f"divisor must be >= 1, got {d}")
    return d


def check_shifted(pos: int, delta: int) -> None:
    """Refuse a ``seq_add`` that would move position ``pos`` past int32 (a shift below 0
    is allowed: it removes the cell); every later write of the position would fail."""
    if pos + delta > POS_MAX:
        raise ArgumentError(
            "delta", f"moves position {pos} to {pos + delta}, past the largest position {POS_MAX} (int32)"
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
    later state (recurrent state, SWA caches).  ``ON_DEVICE``: reserved."""

    NONE = 0
    PARTIAL_ONLY = 1
    ON_DEVICE = 2


class ContextError(StatecacheError):
    """A context was used out of order (ubatch of a failed plan, apply past the end),
    or its plan is stale: the memory changed after the plan was made."""


class MemoryContext(abc.ABC):
    """A plan produced by ``init_*``; see module docstring.

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
    def status(self) -> MemoryStatus: ...

    def get_status(self) -> MemoryStatus:
        return self.status

    @abc.abstractmethod
    def get_ubatch(self) -> UBatch: ...

    @abc.abstractmethod
    def apply(self) -> bool:
        """Commit the current ubatch (or perform the update).  The only mutation."""

    @abc.abstractmethod
    def next(self) -> bool:
        """Advance to the next ubatch; False when exhausted."""

    def undo(self, n: int | None = None) -> tuple[int, ...]:
        """Take back the last ``n`` applied ubatches (default: all) after a failed compute.

        Returns the sequences that could not be restored and were dropped
        instead (empty tuple: exact).  Contexts that cannot undo raise
        :class:`ContextError`.
        """
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

    def undo(self, n: int | None = None) -> tuple[int, ...]:
        return ()  # nothing was ever applied


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

    ``seq_rm`` returns False when it refuses, and then nothing changed.
    """

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
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> MemoryContext: ...

    @abc.abstractmethod
    def init_full(self) -> MemoryContext: ...

    def init_update(self, optimize: bool = False) -> MemoryContext:
        return self.no_update_context()

    def get_can_shift(self) -> bool:
        return True

    @abc.abstractmethod
    def clear(self, data: bool = True) -> None: ...

    @abc.abstractmethod
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool: ...

    @abc.abstractmethod
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...

    @abc.abstractmethod
    def seq_keep(self, seq: int) -> None: ...

    @abc.abstractmethod
    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None: ...

    @abc.abstractmethod
    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None: ...

    @abc.abstractmethod
    def seq_pos_min(self, seq: int) -> int: ...

    @abc.abstractmethod
    def seq_pos_max(self, seq: int) -> int: ...

    @abc.abstractmethod
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes held, per device id."""

    @abc.abstractmethod
    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes: ...

    @abc.abstractmethod
    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None: ...
