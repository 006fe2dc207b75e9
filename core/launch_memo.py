"""Validated launches remembered by argument identity.

A decode step calls every primitive with the same buffers as the step
before: the same pools, the index buffers the memory keeps per row set, and
the activation buffers a runtime allocates once.  Validating those calls
gives the same answer every time, yet costs more than a single-sequence
decode kernel (about ten microseconds of Python).  :class:`LaunchMemo`
remembers, per primitive and per tuple of argument identities, that a call
was valid and how to launch it, so that the next identical call goes
straight to the kernel.

A remembered launch is reused only while it is still right:

* every argument is the very object validated (weak references: the memo
  never keeps a pool alive, and a new buffer that happens to get a dead
  one's ``id`` does not match);
* every index buffer still holds the host shadow that was checked
  (``write()`` replaces it; a zero-copy export to NumPy, DLPack or torch
  drops it, and a buffer without a shadow is never remembered, since its
  contents could change behind the validator's back);
* the device's capabilities are the same object (``supports()`` answers
  depend on them).

Buffer geometry (shape, strides, offset, storage, dtype) is fixed at
construction, so identity covers it.

Tensors passed as arguments (:mod:`statecache.tensor_args`) become Buffers
remembered by their memory's address and geometry, so a decode loop whose
fresh tensors land at the addresses of the step before meets the same
Buffers again.  Where the allocator hands out new addresses every step (small
CPU tensors), a second entry per validated call matches them by *geometry*
(``loose`` entries: the key holds each tensor Buffer's class, dtype, shape,
strides, offset and extent instead of its identity).  Validation depends on
nothing else about those Buffers except where they are, so before such an
entry is used the device checks again that no written argument overlaps
another one (:meth:`statecache.backend.Device._remembered`); the native
Buffers and index shadows are checked as for any entry.  A call met again
in a geometry it was matched by is then relaunched without Buffers at all
(:class:`statecache.tensor_args.Relaunches`).  Scalars (``n_snap``, ``plane_stride``,
``scale``, ``dt_limit``, ``head_map`` ...) are part of the key.  What a
stateful call derived while validated (the snapshot table of 1-D destination
rows, the offsets of the equal-length form) is kept in the entry: small
index buffers of its own, never a caller's storage; the packed views of the
caller's inputs are cached on those inputs themselves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from statecache.dtypes import DType

if TYPE_CHECKING:
    from statecache.backend import Buffer

#: id(storage) -> how many times the contents of that int32 storage were set
#: or handed out; a Buffer's host copy is valid only at the count it was
#: taken at (``Buffer.host_indices``).  Ids of freed storages may be reused: a
#: new storage's first write just continues the old count, which no live
#: Buffer holds.  Counts only grow, so an index buffer whose storage still
#: has the count it had when a call was remembered still has the host copy
#: that call was validated with (:meth:`LaunchMemo.probe`).
STORAGE_WRITES: dict[int, int] = {}

#: The liveness flag of an entry that is never probed.
_ALWAYS_DEAD = [False]

#: Entries kept per device.  A step remembers one entry per layer call and
#: rotation of rollback planes (layers x primitives x (1 + n_rs_seq) x the
#: batch shapes in use): a deep model with rollback holds thousands, and a
#: working set above the limit would be validated again on every call.
MEMO_LIMIT = 16384


class Remembered:
    """One validated call: what to check and what to run."""

    __slots__ = ("caps", "launch", "live", "loose", "prepared", "refs", "shadows", "shape", "stamps")

    def __init__(
        self,
        caps: object,
        refs: tuple[weakref.ref[Buffer] | None, ...],
        shadows: tuple[Any, ...],
        shape: Any,
        launch: Callable[[], None] | None,
        loose: bool = False,
    ) -> None:
        self.caps = caps
        self.refs = refs
        self.shadows = shadows
        self.shape = shape  # what the validator returned (sizes or index values)
        self.launch = launch  # a backend's prepared launch, or None: call _op(shape, ...)
        self.loose = loose  # positions without a reference are matched by the key alone
        self.prepared = launch is not None  # a launch was prepared, or asked for (Device._launch_again)
        # For probe(): [False] once a buffer of the call has died (set by the weakrefs'
        # callback), and per index buffer (id(storage), write count) while its host
        # copy is the one validated (None: not probed).
        self.live = _ALWAYS_DEAD
        self.stamps: tuple[tuple[int, int], ...] | None = None


#: Makes a compiled :meth:`LaunchMemo.probe` over a memo's dict and
#: :data:`STORAGE_WRITES`: ``prober(entries, writes)`` returns ``probe(key, caps)``.
Prober = Callable[[dict[tuple[Any, ...], Remembered], dict[int, int]], Callable[[tuple[Any, ...], object], Any]]


class LaunchMemo:
    """Per-device map from ``(op, scalars..., ids...)`` to :class:`Remembered`.

    ``prober``: a backend's compiled :meth:`probe` (the CPU backend's, in
    sc_dlpack.c: the same steps, about a quarter of the Python's 0.3 us);
    it reads the memo's dict itself, so that dict is never replaced."""

    __slots__ = ("_entries", "probe")

    def __init__(self, prober: Prober | None = None) -> None:
        self._entries: dict[tuple[Any, ...], Remembered] = {}
        self.probe: Callable[[tuple[Any, ...], object], Remembered | None] = (
            self.probe_python if prober is None else prober(self._entries, STORAGE_WRITES)
        )

    def probe_python(self, key: tuple[Any, ...], caps: object) -> Remembered | None:
        """:meth:`lookup` for a key of argument ids alone, without the
        arguments: the cheapest check a decode call can make.  (``probe``:
        this method, or a backend's compiled copy of it.)

        ``key`` must end with the ``id()`` of each argument the entry was
        stored with (``id(None)`` for an argument not given), in order, and
        the caller must hold those arguments while it probes.  Then the key
        proves identity while every remembered buffer is alive: a live object
        is the only one with its id.  Liveness is one flag, cleared by the
        weakrefs' callback, which runs when a buffer is freed and before its
        memory (its id) can be handed to another object.  Index buffers are checked by their
        storage's write count (``STORAGE_WRITES``) instead of their host
        copy, which is the same test without reading the Buffers; a count
        moved by a write that left the host copy as it was (never, in
        practice) only costs a validation.  Entries matched by geometry are
        never probed.  None also for an unhashable key (a bad scalar:
        validation says what is wrong)."""
        try:
            entry = self._entries.get(key)
        except TypeError:
            return None
        if entry is None or entry.caps is not caps:
            return None
        stamps = entry.stamps
        if stamps is None or not entry.live[0]:
            return None  # not probed (loose, index buffers of no known storage), or a buffer died
        writes = STORAGE_WRITES
        for storage, count in stamps:
            if writes.get(storage) != count:
                return None
        return entry

    def lookup(
        self, key: tuple[Any, ...], caps: object, bufs: Sequence[Buffer | None], index_bufs: Sequence[Buffer]
    ) -> Remembered | None:
        entry = self._entries.get(key)
        if entry is None or entry.caps is not caps:
            return None
        if entry.loose:
            for ref, buf in zip(entry.refs, bufs):
                if ref is not None and ref() is not buf:
                    return None
        else:
            for ref, buf in zip(entry.refs, bufs):
                if (None if ref is None else ref()) is not buf:
                    return None
        for shadow, buf in zip(entry.shadows, index_bufs):
            if buf.host_indices is not shadow:
                return None
        return entry

    def store(
        self,
        key: tuple[Any, ...],
        caps: object,
        bufs: Sequence[Buffer | None],
        index_bufs: Sequence[Buffer],
        shape: Any,
        launch: Callable[[], None] | None,
        loose: Sequence[bool] | None = None,
    ) -> None:
        """Remember a validated call.  ``loose``: per buffer, True where the key
        itself names the argument (by geometry) and its identity is not kept."""
        # Loops, not generators: tensors as arguments store an entry per new address.
        shadows = []
        for buf in index_bufs:
            shadow = buf.host_indices
            if shadow is None or not buf.is_contiguous:
                return  # contents only the device knows: validate every call
            shadows.append(shadow)
        if len(self._entries) >= MEMO_LIMIT:
            self._prune()
        ref = weakref.ref
        if loose is None:
            live = [True]

            def died(_: object, live: list[bool] = live) -> None:
                live[0] = False  # no reference to the entry: no cycle to collect

            refs = tuple([None if buf is None else ref(buf, died) for buf in bufs])
            entry = Remembered(caps, refs, tuple(shadows), shape, launch)
            entry.live = live
            entry.stamps = index_stamps(index_bufs)
        else:
            refs = tuple([None if buf is None or free else ref(buf) for buf, free in zip(bufs, loose)])
            entry = Remembered(caps, refs, tuple(shadows), shape, launch, loose=True)
        self._entries[key] = entry

    def _prune(self) -> None:
        # Drop entries whose buffers are gone; if that frees too little, drop
        # the older half of the rest (insertion order): a caller making new
        # buffers every call loses old entries it never meets again, and a
        # steady working set keeps its newer half rather than nothing.
        live = {k: e for k, e in self._entries.items() if all(r is None or r() is not None for r in e.refs)}
        if len(live) >= MEMO_LIMIT // 2:
            items = list(live.items())
            live = dict(items[len(items) // 2 :])
        self._entries.clear()  # the same dict: a compiled probe reads it
        self._entries.update(live)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def index_stamps(index_bufs: Sequence[Buffer]) -> tuple[tuple[int, int], ...] | None:
    """(id(storage), write count) of each int32 index buffer whose host copy
    is current (see :data:`STORAGE_WRITES`); None if one is not such a Buffer.
    The memo's probe and the relaunch's C match (statecache.tensor_args) test
    index Buffers by these."""
    stamps = []
    writes = STORAGE_WRITES
    for buf in index_bufs:
        try:
            count, storage, dtype = buf._shadow_gen, id(buf.storage), buf.dtype
        except AttributeError:  # a stand-in (tests): never probed
            return None
        if dtype is not DType.I32 or writes.get(storage, 0) != count:
            return None  # not an index buffer, or its host copy is stale
        stamps.append((storage, count))
    return tuple(stamps)
