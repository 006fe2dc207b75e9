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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# Re-exported: ContextError was defined here before the errors moved to one module.
from statecache.errors import ContextError as ContextError

if TYPE_CHECKING:
    from statecache.batch import BatchAllocator, UBatch

#: Positions are signed 32-bit; a negative p1 means "to the end".
POS_MAX = 2**31 - 1


def normalize_range(p0: int, p1: int) -> tuple[int, int]:
    """Spec convention: ``p0 < 0 -> 0`` and ``p1 < 0 -> +inf`` (POS_MAX)."""
    p0 = 0 if p0 < 0 else int(p0)
    p1 = POS_MAX if p1 < 0 else int(p1)
    return p0, p1


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


class MemoryContext(abc.ABC):
    """A plan produced by ``init_*``; see module docstring."""

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

    def __init__(self, status: MemoryStatus, reason: str = "") -> None:
        self._status = status
        self.reason = reason

    @property
    def status(self) -> MemoryStatus:
        return self._status

    def get_ubatch(self) -> UBatch:
        raise ContextError(f"no ubatch in a {self._status.value} context {self.reason}".rstrip())

    def apply(self) -> bool:
        return self._status is MemoryStatus.NO_UPDATE

    def next(self) -> bool:
        return False

    def undo(self, n: int | None = None) -> tuple[int, ...]:
        return ()  # nothing was ever applied


class UBatchContext(MemoryContext):
    """Iterates a ubatch list; subclasses implement :meth:`_apply_ubatch`."""

    def __init__(self, ubatches: Sequence[UBatch]) -> None:
        self.ubatches = list(ubatches)
        self.i_next = 0
        self._applied = -1

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
        ok = self._apply_ubatch(self.i_next)
        self._applied = self.i_next
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

    @abc.abstractmethod
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> MemoryContext: ...

    @abc.abstractmethod
    def init_full(self) -> MemoryContext: ...

    def init_update(self, optimize: bool = False) -> MemoryContext:
        return StatusContext(MemoryStatus.NO_UPDATE)

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
