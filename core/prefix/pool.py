"""Checkpoint tiers (byte budgets, pinned vs evictable bytes) and sizing helpers.

Two tiers: **device** (checkpoints the memory holds, restored by sharing
cells: :class:`statecache.prefix.store.ParkedStore`) and **host** (state
blobs in host memory, restored by a validated ``state_read``).  Each has its
own byte budget; a tier's bytes are split into *protected* (entries pinned by
a live request) and *evictable*, and an entry's bytes move between the two
only when its pin count steps 0 -> 1 or 1 -> 0 (invariant P5 of
:mod:`statecache.prefix.tree`).

On a host backend (the cpu and reference devices, PoCL) the device tier is
host memory too.  The tiers keep separate budgets and separate counts, so
nothing is counted twice or hidden: ``bytes_in_host_memory`` in the metrics
adds the device tier's bytes when they are host memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from statecache.errors import ArgumentError

UNLIMITED = 2**62


@dataclasses.dataclass
class Tier:
    """Byte accounting of one tier (P5: ``evictable + protected == resident <= budget``)."""

    name: str
    budget: int
    evictable: int = 0
    protected: int = 0
    entries: int = 0

    @property
    def resident(self) -> int:
        return self.evictable + self.protected

    def fits(self, nbytes: int) -> bool:
        return self.resident + nbytes <= self.budget

    def admit(self, nbytes: int, pinned: bool) -> None:
        if not self.fits(nbytes):
            raise ArgumentError("nbytes", f"{nbytes} bytes do not fit the {self.name} tier ({self.room} free)")
        if pinned:
            self.protected += nbytes
        else:
            self.evictable += nbytes
        self.entries += 1

    def release(self, nbytes: int, pinned: bool) -> None:
        if pinned:
            self.protected -= nbytes
        else:
            self.evictable -= nbytes
        self.entries -= 1

    def pin_step(self, nbytes: int, pins_before: int, pins_after: int) -> None:
        """Move an entry's bytes when its pin count crosses zero (and only then)."""
        if pins_before == 0 and pins_after > 0:
            self.evictable -= nbytes
            self.protected += nbytes
        elif pins_before > 0 and pins_after == 0:
            self.protected -= nbytes
            self.evictable += nbytes

    @property
    def room(self) -> int:
        return self.budget - self.resident


# -- sizing helpers ------------------------------------------------------------------


def checkpoint_bytes(spec: Any) -> int:
    """Device bytes one checkpoint holds alone, for a model spec.

    :param spec: a :class:`~statecache.spec.MemorySpec` (pure recurrent) or
        :class:`~statecache.spec.ModelSpec`: the recurrent rows of every layer
        (one plane), plus for a sliding-window model the window's K/V cells
        (``n_swa`` cells of every sliding-window layer), which a checkpoint
        keeps too.  Full-attention cells are shared along the prefix and
        counted per token instead (:func:`attention_bytes_per_token`).
    """
    from statecache.spec import MemorySpec, ModelSpec

    if isinstance(spec, MemorySpec):
        return spec.state_bytes(1, 0)
    if isinstance(spec, ModelSpec):
        out = spec.recurrent.state_bytes(1, 0)
        swa = [a for a in spec.attention.values() if a.swa]
        out += spec.n_swa * sum(a.n_embd_k + a.n_embd_v for a in swa) * spec.kv_dtype.itemsize
        return out
    raise ArgumentError("spec", f"expected a MemorySpec or ModelSpec, got {type(spec).__name__}")


def attention_bytes_per_token(spec: Any) -> int:
    """K/V (and indexer) bytes of one full-attention cell of a model spec (0 without attention)."""
    from statecache.spec import MemorySpec, ModelSpec

    if isinstance(spec, MemorySpec):
        return 0
    if not isinstance(spec, ModelSpec):
        raise ArgumentError("spec", f"expected a MemorySpec or ModelSpec, got {type(spec).__name__}")
    out = sum(a.n_embd_k + a.n_embd_v for a in spec.attention.values() if not a.swa) * spec.kv_dtype.itemsize
    if spec.indexer is not None:
        ix = spec.indexer
        out += len(ix.layers) * ix.head_size * ix.row_factor * spec.kv_dtype.itemsize
    return out


def checkpoints_in(budget: int, spec: Any) -> int:
    """How many checkpoints a byte budget holds for a model spec."""
    if budget < 0:
        raise ArgumentError("budget", f"must be >= 0, got {budget}")
    return budget // checkpoint_bytes(spec)


def budget_for(n_checkpoints: int, spec: Any) -> int:
    """The byte budget that holds ``n_checkpoints`` checkpoints of a model spec."""
    if n_checkpoints < 0:
        raise ArgumentError("n_checkpoints", f"must be >= 0, got {n_checkpoints}")
    return n_checkpoints * checkpoint_bytes(spec)


def reserved_ids_for(n_live: int, budget: int, spec: Any, cap: int = 256) -> tuple[int, int]:
    """``(n_seq_max, n_reserved)`` for a memory that runs ``n_live`` sequences and
    parks as many device checkpoints as ``budget`` bytes hold (each needs one
    reserved sequence id; memories accept at most ``cap`` ids)."""
    if n_live < 1:
        raise ArgumentError("n_live", f"must be >= 1, got {n_live}")
    n_res = min(checkpoints_in(budget, spec), cap - n_live)
    if n_res < 0:
        raise ArgumentError("n_live", f"{n_live} live sequences leave no id under the cap of {cap}")
    return n_live + n_res, n_res
