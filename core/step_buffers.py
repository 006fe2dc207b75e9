"""Device buffers a memory rewrites in place every step instead of uploading new ones.

A decode step hands the runtime index rows (where this ubatch's K/V rows go)
and an attention mask.  Uploading them as new buffers costs a device
allocation per call, defeats the launch memo (it remembers calls by buffer
identity) and cannot be captured in a CUDA graph.  :class:`StepBuffers` keeps
one storage per role (``"rows"``, a mask variant), grown only when a ubatch
needs more than any before it, and hands out views of it by shape: the same
Buffer object for the same shape, step after step, its contents rewritten in
place (not even that when the values did not change).

The rows of a step belong to the ubatch applied last: a runtime computes one
ubatch at a time, and the device orders the rewrite after the launches that
read the previous values (every backend's ``write`` is stream-ordered or
blocking).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from statecache.backend import Buffer, Device
from statecache.dtypes import DType

#: Views kept per role before the oldest shapes are forgotten (decode meets a few shapes again and again).
_VIEWS_PER_ROLE = 16


class StepBuffers:
    """Per memory (one KV cache): reused device buffers for per-step index rows and masks."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._storage: dict[str, Buffer] = {}
        self._views: dict[str, dict[tuple[int, ...], Buffer]] = {}
        # Per role: the shape and host array of the last write to its storage.  Keyed by role,
        # not by shape: every shape of a role is a view of one storage, so a write through
        # one view changes what the others hold (a one-token mask overwrites the first row
        # of a two-token one), and equal values are only "already there" when the last
        # write to the storage was of this very shape.
        self._source: dict[str, tuple[tuple[int, ...], Any]] = {}

    def _view(self, role: str, shape: tuple[int, ...], dtype: DType, capacity: int) -> Buffer:
        views = self._views.setdefault(role, {})
        view = views.get(shape)
        if view is not None:
            return view
        need = math.prod(shape)
        store = self._storage.get(role)
        if store is None or store.size < need:
            # the first ubatch of a new largest shape: grow to ``capacity`` (a decode after a
            # prefill, or a mask whose n_kv grows with the context, fits without another alloc)
            store = self._storage[role] = self.device.alloc((max(need, capacity, 1),), dtype)
            views.clear()  # views of the old storage stay valid for whoever holds them
            self._source.pop(role, None)
        if len(views) >= _VIEWS_PER_ROLE:
            views.pop(next(iter(views)))
        view = views[shape] = store.view(shape)
        return view

    def indices(self, role: str, values: np.ndarray, capacity: int = 0) -> Buffer:
        """An int32 index buffer holding ``values`` (rewritten only when they changed)."""
        host = np.ascontiguousarray(np.asarray(values, dtype=np.int64).astype(np.int32))
        buf = self._view(role, host.shape, DType.I32, capacity)
        known = buf.host_indices
        if known is None or not np.array_equal(known, host):
            self.device.write(buf, host)
        return buf

    def floats(self, role: str, values: np.ndarray, capacity: int = 0) -> Buffer:
        """An f32 buffer holding ``values`` (rewritten only when they changed: the same host
        array, by identity, or one equal to the last is not written again).  The host
        arrays are kept, not copied: pass arrays that are not edited afterwards."""
        shape = tuple(values.shape)
        buf = self._view(role, shape, DType.F32, capacity)
        last_shape, last = self._source.get(role, ((), None))
        if last_shape != shape or (last is not values and not (last is not None and np.array_equal(last, values))):
            self.device.write(buf, values)
        self._source[role] = (shape, values)
        return buf
