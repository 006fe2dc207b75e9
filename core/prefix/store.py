"""Where checkpoints live, behind one small interface (:class:`CheckpointStore`).

The cache decides *which* states to keep; a store keeps them.  The first
store, :class:`ParkedStore`, uses only the memories' public sequence API and
the state format:

* **capture** (device tier): ``memory.seq_cp(seq, r)`` with ``r`` one of the
  sequence ids the runtime reserved for the cache.  Every memory already
  makes a copy share what it can: the attention and indexer cells gain a
  sequence id (no bytes move), the recurrent cell (with its sliding-window
  cells) gains an owner, and the first write of the live sequence after that
  gives the live sequence a cell of its own, reading its start row straight
  from the shared one (copy-on-write inside ``find_slot``; the scan reads the
  start row in place, so even that costs no extra copy).  So a capture moves
  no bytes at all, and a checkpoint can never be changed by later writes to
  the live sequence: those go to the live sequence's own cell.
* **restore** from the device tier: ``memory.seq_cp(r, seq)``: the same
  sharing, the other way.
* **host tier**: ``memory.state_write(r)``, a validated blob of every part
  of that sequence; ``memory.state_read(blob, seq)`` restores it (all or
  nothing: a rejected blob changes nothing).

Why this and not the alternatives: ``state_write(seq, PARTIAL_ONLY)`` plus
``state_read`` would copy the recurrent rows through the host at every
capture and restore, where ``seq_cp`` copies nothing; a separate checkpoint
pool filled with ``copy_rows`` would need rows of the memory that only its
private book names, and a restore would still need a public way to install a
row into a sequence's cell, which the memories do not offer yet.  The price
of parking is one reserved sequence id and one recurrent cell per device
checkpoint (the runtime sizes ``n_seq_max`` for it: :func:`statecache.
prefix.pool.reserved_ids_for`).  When the memories gain public slot rows, a
``SlotRowStore`` implementing the same protocol can replace this one without
the cache changing.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Protocol

from statecache.errors import ArgumentError, StateError

#: An opaque handle of a device-resident checkpoint (for :class:`ParkedStore`:
#: the reserved sequence id that holds it).
Handle = int


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the cache needs to know about a memory.

    ``kind``: ``recurrent``, ``hybrid``, ``hybrid_iswa``, ``hybrid_idx`` (or a
    simulated kind).  ``parts``: the parts a lookup reports on.
    ``checkpoint_bytes``: device bytes one checkpoint holds alone (recurrent
    rows of every layer, plus the sliding-window cells of an iSWA model).
    ``attention_bytes_per_token``: K/V (and indexer) bytes of one attention
    cell, 0 without attention.  ``fingerprint``: layer layout and storage
    dtypes (two memories with the same fingerprint read each other's blobs).
    ``host_memory``: the device's memory *is* host memory (cpu backends), so
    both tiers draw on the same RAM.
    """

    kind: str
    parts: tuple[str, ...]
    checkpoint_bytes: int
    attention_bytes_per_token: int
    fingerprint: str
    host_memory: bool


def _kv_widths(cache: Any) -> list[tuple[str, int, int, str]]:
    out = []
    for layer in cache.layers:
        out.append((cache.name, layer.il, layer.n_embd_k + layer.n_embd_v, cache.dtype.value))
    return out


def _kv_row_bytes(cache: Any) -> int:
    return sum((layer.n_embd_k + layer.n_embd_v) * cache.dtype.itemsize for layer in cache.layers)


def describe(memory: Any) -> Layout:
    """The :class:`Layout` of a memory, from its documented attributes.

    A memory (simulated or third-party) may describe itself with a
    ``prefix_layout()`` method; the built-in ones are read from ``pools``
    (recurrent), ``attn`` / ``recr`` / ``kv_caches`` (hybrids) and ``idx``
    (hybrid-idx).
    """
    own = getattr(memory, "prefix_layout", None)
    if callable(own):
        layout = own()
        if not isinstance(layout, Layout):
            raise ArgumentError("memory", "prefix_layout() must return a statecache.prefix.store.Layout")
        return layout
    from statecache.backend import DeviceKind
    from statecache.hybrid import HybridMemory
    from statecache.kv_cache import KVCacheISWA
    from statecache.recurrent import RecurrentMemory

    host = getattr(memory.device, "kind", None) is DeviceKind.CPU
    parts: tuple[str, ...]
    if isinstance(memory, RecurrentMemory):
        recr, kind, parts = memory, "recurrent", ("recurrent",)
        kv: list[Any] = []
        swa = None
    elif isinstance(memory, HybridMemory):
        recr = memory.recr
        if not memory.unified:
            raise ArgumentError(
                "memory",
                "the prefix cache shares attention cells between sequences; one KV stream per sequence "
                "(unified=False) would copy a whole stream per checkpoint: build the memory with unified=True",
            )
        swa = memory.attn.swa if isinstance(memory.attn, KVCacheISWA) else None
        kv = [c for c in memory.kv_caches if c is not swa]
        idx = getattr(memory, "idx", None)
        if idx is not None:
            kind, parts = "hybrid_idx", ("attention", "indexer", "recurrent")
            kv.append(idx)
        elif swa is not None:
            kind, parts = "hybrid_iswa", ("attention", "swa", "recurrent")
        else:
            kind, parts = "hybrid", ("attention", "recurrent")
    else:
        raise ArgumentError(
            "memory",
            f"{type(memory).__name__} has no recurrent part the prefix cache knows; pass a RecurrentMemory or a "
            "hybrid memory, or give the memory a prefix_layout() method",
        )
    if not recr.pools:
        raise ArgumentError("memory", "the memory has no recurrent layer: every position of it is reusable already")
    rows = [(L, name, buf.shape[1], buf.dtype.value) for L, pools in recr.pools.items() for name, buf in pools.items()]
    ckpt = sum(buf.shape[1] * buf.dtype.itemsize for pools in recr.pools.values() for buf in pools.values())
    desc: list[Any] = [kind, rows]
    if swa is not None:
        ckpt += swa.n_swa * _kv_row_bytes(swa)
        desc += [_kv_widths(swa), swa.n_swa, swa.swa_type.value]
    for cache in kv:
        desc.append(_kv_widths(cache))
    fingerprint = hashlib.sha256(repr(desc).encode()).hexdigest()[:32]
    per_token = sum(_kv_row_bytes(c) for c in kv)
    return Layout(kind, parts, ckpt, per_token, fingerprint, host)


class CheckpointStore(Protocol):
    """How checkpoints are taken and put back; see the module docstring.

    Every method leaves the memory unchanged when it fails.
    """

    @property
    def free(self) -> int:
        """Device handles still available."""

    def capture(self, seq: int, length: int) -> Handle | None:
        """Keep ``seq``'s state (exactly ``length`` tokens absorbed) on the device;
        None when no handle is free."""

    def alive(self, handle: Handle, length: int) -> bool:
        """Whether the memory still holds ``handle``'s state at ``length`` (a runtime's
        ``seq_keep``/``clear`` may have dropped it)."""

    def restore(self, handle: Handle, seq: int, length: int) -> None:
        """Make ``seq`` continue from ``handle``'s state (sharing where the memory can)."""

    def release(self, handle: Handle) -> None:
        """Forget a device checkpoint."""

    def export(self, handle: Handle) -> bytes:
        """The checkpoint as a state blob (for the host tier and files)."""

    def restore_blob(self, blob: bytes, seq: int, length: int) -> None:
        """Make ``seq`` continue from a blob; ``StateError`` (nothing changed) if rejected."""

    def import_blob(self, blob: bytes, length: int) -> Handle | None:
        """Put a blob back on the device; None when no handle is free.  ``StateError``
        (nothing changed) if rejected."""


class ParkedStore:
    """Device checkpoints parked under reserved sequence ids (module docstring)."""

    def __init__(self, memory: Any, reserved: tuple[int, ...]) -> None:
        self.memory = memory
        self.reserved = reserved
        self._free = list(reversed(reserved))  # pop() hands out the lowest id first

    @property
    def free(self) -> int:
        return len(self._free)

    def _at(self, seq: int, length: int) -> bool:
        return bool(self.memory.seq_pos_max(seq) == length - 1)

    def capture(self, seq: int, length: int) -> Handle | None:
        if not self._free:
            return None
        r = self._free.pop()
        self.memory.seq_cp(seq, r)
        if not self._at(r, length):  # cannot happen with a correct memory: refuse to keep a wrong state
            self.memory.seq_rm(r, -1, -1)
            self._free.append(r)
            raise StateError(
                "capture", f"sequence {r} is at {self.memory.seq_pos_max(r)} after the copy, not {length - 1}"
            )
        return r

    def alive(self, handle: Handle, length: int) -> bool:
        return self._at(handle, length)

    def restore(self, handle: Handle, seq: int, length: int) -> None:
        self.memory.seq_cp(handle, seq)

    def release(self, handle: Handle) -> None:
        if handle in self._free or handle not in self.reserved:
            raise ArgumentError("handle", f"{handle} is not a held checkpoint")
        self.memory.seq_rm(handle, -1, -1)
        self._free.append(handle)

    def export(self, handle: Handle) -> bytes:
        return bytes(self.memory.state_write(handle))

    def restore_blob(self, blob: bytes, seq: int, length: int) -> None:
        self.memory.state_read(blob, seq)
        if not self._at(seq, length):
            self.memory.seq_rm(seq, -1, -1)
            raise StateError("length", f"the blob restores position {self.memory.seq_pos_max(seq)}, not {length - 1}")

    def import_blob(self, blob: bytes, length: int) -> Handle | None:
        if not self._free:
            return None
        r = self._free.pop()
        try:
            self.restore_blob(blob, r, length)
        except BaseException:
            self._free.append(r)
            raise
        return r
