"""The backend protocol: Backend -> Device -> Buffer, and the primitive contract.

A *backend* (``cpu``, ``opencl``, ``cuda``, ``reference``, or a third-party
one) offers *devices*.  A device allocates *buffers* (opaque device memory
the host may not be able to touch), moves data to and from NumPy explicitly,
declares what it can do as data (:class:`Caps`) plus a shape-dependent
predicate (:meth:`Device.supports`), and runs the primitives.

The primitives are written once here, as template methods: the public method
validates every argument with :mod:`statecache.primitives` (so every backend
raises the same error for the same mistake, before anything is launched or
written) and then calls the backend's ``_name`` implementation.  Backends
override only the underscored methods.

A validated call is remembered per argument identity
(:mod:`statecache.launch_memo`), so a decode loop that passes the same
buffers call after call pays for validation once.

Launches may be asynchronous; :meth:`Device.synchronize` waits for all work
queued on the device.  :meth:`Device.download` always synchronizes first.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from statecache import primitives as P
from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.errors import ArgumentError, CapabilityError
from statecache.launch_memo import LaunchMemo

#: Names of every primitive of the contract, in documentation order.
PRIMITIVES: tuple[str, ...] = (
    "get_rows",
    "set_rows",
    "zero_rows",
    "copy_rows",
    "ssm_conv",
    "ssm_scan",
    "gated_delta_net",
)


class DeviceKind(enum.Enum):
    CPU = "cpu"
    GPU = "gpu"
    ACCEL = "accel"


@dataclasses.dataclass(frozen=True)
class Caps:
    """What a device can do, as data.  The conformance suite gates on this.

    ``ops``: primitive names from :data:`PRIMITIVES` the device implements.
    ``storage_dtypes``: dtypes a buffer (state pool, K/V, output) may have.
    ``max_snapshots``: largest ``n_snap`` the stateful primitives accept.
    ``strided_inputs``: whether non-contiguous views are accepted as inputs
    of the stateful primitives (x/B/C/dt, q/k/v/g/beta).
    ``host_visible``: whether buffers live in host memory (zero-copy NumPy).
    ``async_launch``: whether launches return before the work is done.
    """

    ops: frozenset[str]
    storage_dtypes: frozenset[DType]
    max_snapshots: int = 16
    strided_inputs: bool = True
    host_visible: bool = False
    async_launch: bool = False

    #: Capability names that ``require()`` understands; anything else is an error.
    NAMES = (
        "ops",
        "storage_dtypes",
        "max_snapshots",
        "strided_inputs",
        "host_visible",
        "async_launch",
    )

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(PRIMITIVES)
        if unknown:
            raise ValueError(f"Caps.ops names unknown primitives: {sorted(unknown)}")
        bad = set(self.storage_dtypes) - set(STORAGE_DTYPES)
        if bad:
            raise ValueError(f"Caps.storage_dtypes holds non-storage dtypes: {sorted(map(str, bad))}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": sorted(self.ops),
            "storage_dtypes": sorted(d.value for d in self.storage_dtypes),
            "max_snapshots": self.max_snapshots,
            "strided_inputs": self.strided_inputs,
            "host_visible": self.host_visible,
            "async_launch": self.async_launch,
        }


@dataclasses.dataclass(frozen=True)
class Support:
    """Answer of :meth:`Device.supports`: truthy when supported, else a reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


class Buffer:
    """A typed, shaped view of device storage.

    ``storage`` is the backend's opaque handle (a NumPy array for host
    backends, a ``cl.Buffer``, a CUDA device pointer ...).  Shapes and strides
    are in elements, C order.  ``view()`` makes another Buffer over the same
    storage (used for overlapping x/B/C inputs); primitives that write a
    buffer require it to be contiguous.

    ``host_indices`` is a host copy of an int32 buffer's contents, kept when
    the buffer was filled from the host, so that index validation (range,
    duplicates) never needs a device round trip.  Assigning it (a new copy,
    or None when the contents may have changed behind it) also withdraws the
    copies of every other Buffer over the same storage: a write through a
    view must not leave its parent validated against old values.
    """

    __slots__ = (
        "__weakref__",
        "_contig",
        "_index_cache",
        "_shadow",
        "_shadow_gen",
        "_size",
        "capacity",
        "device",
        "dtype",
        "offset",
        "shape",
        "storage",
        "strides",
    )

    def __init__(
        self,
        device: Device,
        storage: Any,
        dtype: DType,
        shape: Sequence[int],
        *,
        strides: Sequence[int] | None = None,
        offset: int = 0,
        capacity: int | None = None,
    ) -> None:
        self.device = device
        self.storage = storage
        self.dtype = dtype
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides) if strides is not None else _c_strides(self.shape)
        self.offset = int(offset)
        self._size = math.prod(self.shape)
        self.capacity = int(capacity) if capacity is not None else self._size
        # Geometry never changes after construction: decide contiguity once
        # (primitives ask on every call, and decode calls are microseconds).
        self._contig = self.strides == _c_strides(self.shape) or self._size <= 1
        self._shadow: np.ndarray | None = None  # see host_indices
        self._shadow_gen = 0
        self._index_cache: Any = None  # statecache.primitives caches index facts here

    # -- host copy of an index buffer -----------------------------------------
    @property
    def host_indices(self) -> np.ndarray | None:
        """The host copy of this int32 buffer's contents, or None when only the
        device knows them (never filled from the host, exported, or another
        Buffer over the same storage was written since)."""
        shadow = self._shadow
        if shadow is not None and _STORAGE_WRITES.get(id(self.storage), 0) != self._shadow_gen:
            self._shadow = shadow = None
        return shadow

    @host_indices.setter
    def host_indices(self, value: np.ndarray | None) -> None:
        if self.dtype is DType.I32:
            key = id(self.storage)
            self._shadow_gen = _STORAGE_WRITES[key] = _STORAGE_WRITES.get(key, 0) + 1
        self._shadow = value

    def mark_exported(self) -> None:
        """A backend calls this when it hands the memory to a consumer that may
        write it (NumPy, DLPack, the CUDA array interface): from then on index
        validation reads the contents back instead of trusting a host copy
        (and the launch memo stops remembering calls with this storage)."""
        self.host_indices = None

    # -- geometry -----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self._contig

    def view(self, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0) -> Buffer:
        """Another buffer over the same storage; bounds are checked here."""
        shape_t: tuple[int, ...] = tuple(int(s) for s in shape)
        strides_t = tuple(int(s) for s in strides) if strides is not None else _c_strides(shape_t)
        if len(strides_t) != len(shape_t):
            raise ArgumentError("view", f"strides {strides_t} do not match shape {shape_t}")
        if any(s < 0 for s in strides_t) or offset < 0:
            raise ArgumentError("view", "negative strides or offset are not supported")
        start = self.offset + int(offset)
        empty = any(n == 0 for n in shape_t)
        last = start + sum((n - 1) * s for n, s in zip(shape_t, strides_t, strict=True))
        if not empty and last >= self.capacity:
            raise ArgumentError("view", f"view reaches element {last} of a storage of {self.capacity}")
        # type(self): a backend's Buffer subclass (DLPack / CUDA array interface) survives views.
        out = type(self)(
            self.device, self.storage, self.dtype, shape_t, strides=strides_t, offset=start, capacity=self.capacity
        )
        return out

    def same_storage(self, other: Buffer) -> bool:
        return self.storage is other.storage

    def numpy(self) -> np.ndarray:
        """Download a copy (synchronizes the device)."""
        return self.device.download(self)

    def __repr__(self) -> str:
        extra = "" if self.is_contiguous and self.offset == 0 else f", strides={self.strides}, offset={self.offset}"
        return f"Buffer({self.device.id}, {self.dtype}, shape={self.shape}{extra})"


#: id(storage) -> how many times the contents of that int32 storage were set
#: or handed out; a Buffer's host copy is valid only at the count it was
#: taken at.  Ids of freed storages may be reused: a new storage's first
#: write just continues the old count, which no live Buffer holds.
_STORAGE_WRITES: dict[int, int] = {}


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


class Device(abc.ABC):
    """One device of a backend.  Subclasses implement the underscored methods.

    Attributes every device sets: ``id`` (``"cpu:0"``), ``backend_name``,
    ``kind`` (:class:`DeviceKind`), ``name`` (human readable), ``memory_bytes``
    (``None`` if unknown) and ``caps`` (:class:`Caps`).  ``properties`` (a
    JSON-able dict for reports) is built from them; a device adds its own
    facts by assigning a dict to it or by overriding it and extending
    ``super().properties``.
    """

    id: str
    backend_name: str
    kind: DeviceKind
    name: str
    memory_bytes: int | None
    caps: Caps

    @property
    def properties(self) -> dict[str, Any]:
        """The standard facts (id, backend, kind, name, memory_bytes, caps) plus
        those the device assigned (``self.properties = {"driver": ...}``)."""
        return {
            **self.__dict__.get("_extra_properties", {}),
            "id": self.id,
            "backend": self.backend_name,
            "kind": self.kind.value,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "caps": self.caps.as_dict(),
        }

    @properties.setter
    def properties(self, extra: Mapping[str, Any]) -> None:
        # Settable: a backend author's natural first try (it used to raise
        # AttributeError inside devices()).  The standard keys stay derived
        # from the attributes, so reports cannot disagree with them.
        self._extra_properties = dict(extra)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.name!r}>"

    # -- capabilities ---------------------------------------------------------
    def supports(self, op: str, **params: Any) -> Support:
        """Whether ``op`` with these parameters runs on this device.

        Parameters a backend may look at: ``dtype`` (storage dtype of the
        pool), ``n_snap``, ``variant`` (``"mamba1"``/``"mamba2"`` for ssm_scan,
        ``"scalar"``/``"kda"`` for gated_delta_net), ``strided`` (bool), and
        shape sizes such as ``d_state``, ``head_dim``, ``d_conv``, ``head_size``.
        The default answers from :attr:`caps`; backends with shape limits
        override and call ``super()``.
        """
        if op not in PRIMITIVES:
            raise CapabilityError(f"unknown primitive {op!r}; known: {', '.join(PRIMITIVES)}")
        if op not in self.caps.ops:
            return Support(False, f"{self.id} does not implement {op}")
        dtype = params.get("dtype")
        if dtype is not None and DType.parse(dtype) not in self.caps.storage_dtypes:
            return Support(False, f"{self.id} cannot store {DType.parse(dtype)}")
        n_snap = params.get("n_snap")
        if n_snap is not None and int(n_snap) > self.caps.max_snapshots:
            return Support(False, f"{self.id} emits at most {self.caps.max_snapshots} snapshots")
        if params.get("strided") and not self.caps.strided_inputs:
            return Support(False, f"{self.id} needs contiguous inputs")
        return SUPPORTED

    #: (caps, {(op, *params): Support}): see :meth:`_require`.
    _support_memo: tuple[Caps, dict[tuple[Any, ...], Support]] | None = None

    def _require(self, op: str, **params: Any) -> None:
        # Every primitive call asks; decode calls are a few microseconds, so
        # answers are remembered per (op, params).  supports() depends only on
        # them and on the caps (frozen; a device given new caps starts afresh).
        memo = self._support_memo
        if memo is None or memo[0] is not self.caps:
            memo = self._support_memo = (self.caps, {})
        key = (op, *params.items())
        answer = memo[1].get(key)
        if answer is None:
            answer = self.supports(op, **params)
            if len(memo[1]) < 1024:  # bounded: shapes vary little in practice
                memo[1][key] = answer
        if not answer:
            raise CapabilityError(answer.reason)

    # -- launch memo: see statecache.launch_memo ---------------------------------
    _launches: LaunchMemo | None = None

    def _remembered(self, key: tuple[Any, ...], bufs: tuple[Any, ...], index_bufs: tuple[Any, ...]) -> Any:
        """The remembered launch of an identical earlier call, or None."""
        memo = self._launches
        if memo is None:
            return None
        try:
            return memo.lookup(key, self.caps, bufs, index_bufs)
        except TypeError:  # an unhashable scalar: validation will say what is wrong
            return None

    def _remember(
        self,
        key: tuple[Any, ...],
        bufs: tuple[Any, ...],
        index_bufs: tuple[Any, ...],
        checked: Any,
        op: str,
        call_args: tuple[Any, ...],
    ) -> Callable[[], None] | None:
        """Remember a validated call; returns the backend's prepared launch, if any."""
        launch = self._prepare_launch(op, call_args)
        memo = self._launches
        if memo is None:
            memo = self._launches = LaunchMemo()
        memo.store(key, self.caps, bufs, index_bufs, checked, launch)
        return launch

    def _prepare_launch(self, op: str, call_args: tuple[Any, ...]) -> Callable[[], None] | None:
        """Optionally turn a validated call into a zero-argument launch.

        ``call_args`` are the positional arguments of ``_<op>``.  The launch
        is reused for later calls with the same arguments (same objects,
        same index shadows), so it may precompute everything but must not
        keep references to the buffers (the memo holds them weakly and
        checks they are alive before launching).  ``None``, the default,
        means every call goes through ``_<op>``.
        """
        return None

    # -- memory ---------------------------------------------------------------
    def alloc(self, shape: int | Sequence[int], dtype: DType | str = DType.F32) -> Buffer:
        """A new zero-filled contiguous buffer."""
        dt = DType.parse(dtype)
        shape_t = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ArgumentError("shape", f"negative dimension in {shape_t}")
        if dt is not DType.I32 and dt not in self.caps.storage_dtypes:
            raise CapabilityError(f"{self.id} cannot store {dt}")
        return self._alloc(shape_t, dt)

    def upload(self, array: Any, dtype: DType | str | None = None) -> Buffer:
        """A new buffer holding ``array`` (converted to ``dtype`` if given)."""
        host = np.asarray(array)
        dt = DType.parse(dtype) if dtype is not None else DType.parse(host.dtype)
        buf = self.alloc(host.shape, dt)
        self.write(buf, host)
        return buf

    def indices(self, values: Any) -> Buffer:
        """Upload an int32 index array (keeps a host copy for validation)."""
        host = np.ascontiguousarray(np.asarray(values, dtype=np.int64))
        if host.size and (host.min() < np.iinfo(np.int32).min or host.max() > np.iinfo(np.int32).max):
            raise ArgumentError("indices", "values do not fit in int32")
        return self.upload(host.astype(np.int32), DType.I32)

    def write(self, buffer: Buffer, array: Any) -> None:
        """Copy host data into a contiguous buffer (converting to its dtype)."""
        self._check_own(buffer, "buffer")
        if not buffer.is_contiguous:
            raise ArgumentError("buffer", "write() needs a contiguous buffer")
        host = np.asarray(array)
        if host.shape != buffer.shape:
            raise ArgumentError("array", f"shape {host.shape} does not match buffer shape {buffer.shape}")
        if buffer.dtype is DType.I32:
            host = np.ascontiguousarray(host.astype(np.int32, copy=False))
            buffer.host_indices = host.copy()
        else:
            buffer.host_indices = None
            # Convert through float32: the same rounding on every backend.
            host = np.ascontiguousarray(host.astype(np.float32, copy=False).astype(buffer.dtype.numpy))
        self._write(buffer, host)

    def download(self, buffer: Buffer) -> np.ndarray:
        """A host copy of the buffer's logical contents (synchronizes first)."""
        self._check_own(buffer, "buffer")
        self.synchronize()
        return self._read(buffer)

    def fill_bytes(self, buffer: Buffer, seed: int) -> None:
        """Fill a buffer with pseudo-random garbage (tests use this to prove no
        code relies on zero-filled memory).  Float buffers get finite values."""
        rng = np.random.default_rng(seed)
        if buffer.dtype is DType.I32:
            data = rng.integers(-(2**31), 2**31 - 1, size=buffer.shape, dtype=np.int64).astype(np.int32)
        else:
            data = rng.uniform(-1e3, 1e3, size=buffer.shape).astype(np.float32)
        self.write(buffer, data)

    def copy_buffer(self, src: Buffer, dst: Buffer) -> None:
        """Plain device-to-device copy of a whole contiguous buffer into another
        of the same dtype and size.  Benchmarks use it as the memcpy bound;
        backends override :meth:`_copy_buffer` with their native copy."""
        self._check_own(src, "src")
        self._check_own(dst, "dst")
        if not (src.is_contiguous and dst.is_contiguous):
            raise ArgumentError("src", "copy_buffer() needs contiguous buffers")
        if src.dtype is not dst.dtype or src.size != dst.size:
            raise ArgumentError("dst", f"{dst} does not match {src} in dtype and size")
        if src.same_storage(dst):
            raise ArgumentError("dst", "shares storage with src")
        if src.size:
            self._copy_buffer(src, dst)
        if dst.dtype is DType.I32:  # the copy is what validation must see from now on
            dst.host_indices = None if src.host_indices is None else src.host_indices.copy()

    def _copy_buffer(self, src: Buffer, dst: Buffer) -> None:
        """Copy validated, non-empty, contiguous buffers (generic: one row copy)."""
        if src.dtype is DType.I32:  # not a storage dtype: the row primitives refuse it
            self._write(dst, self._read(src))
            return
        zero = self.indices([0])
        self.copy_rows(src.view((1, src.size)), zero, dst.view((1, dst.size)), zero)

    def synchronize(self) -> None:
        """Wait until every queued launch and copy has finished."""
        # Synchronous backends have nothing to wait for; queued ones override.
        return None

    def index_values(self, buffer: Buffer) -> np.ndarray:
        """Host values of an int32 buffer (the shadow copy when there is one)."""
        if buffer.host_indices is not None and buffer.is_contiguous:
            return buffer.host_indices
        return self.download(buffer).astype(np.int32, copy=False)

    def _check_own(self, buffer: Buffer, name: str) -> None:
        if not isinstance(buffer, Buffer):
            raise ArgumentError(name, f"expected a Buffer, got {type(buffer).__name__}")
        if buffer.device is not self:
            raise ArgumentError(name, f"buffer lives on {buffer.device.id}, not on {self.id}")

    # -- primitives (validated template methods) ------------------------------
    def get_rows(self, src: Buffer, rows: Buffer, dst: Buffer) -> None:
        """Gather: ``dst[i, :] = convert(src[rows[i], :])``.

        ``src`` [R, E] and ``dst`` [N, E] are contiguous 2-D buffers of any
        storage dtype (conversion goes through float32: exact for f32 -> f32
        and for widening); ``rows`` is int32 [N] with every value in [0, R).
        Rows may come from any plane of a state pool.  ``src`` and ``dst``
        must be different storages.
        """
        bufs = (src, rows, dst)
        key = ("get_rows", id(src), id(rows), id(dst))
        hit = self._remembered(key, bufs, (rows,))
        if hit is not None:
            if hit.launch is None:
                self._get_rows(src, rows, dst, hit.shape)
            else:
                hit.launch()
            return
        rows_np = P.check_rows_op(self, "get_rows", src=src, rows=rows, dst=dst)
        self._require("get_rows", dtype=src.dtype)
        self._require("get_rows", dtype=dst.dtype)
        launch = self._remember(key, bufs, (rows,), rows_np, "get_rows", (src, rows, dst, rows_np))
        if launch is None:
            self._get_rows(src, rows, dst, rows_np)
        else:
            launch()

    def set_rows(self, dst: Buffer, rows: Buffer, src: Buffer) -> None:
        """Scatter: ``dst[rows[i], :] = convert(src[i, :])``.

        ``dst`` [R, E], ``src`` [N, E] contiguous; ``rows`` int32 [N] in
        [0, R) with no duplicates (a duplicate destination is refused, since
        its result would depend on the launch order).  Other rows of ``dst``
        are untouched.  ``src`` and ``dst`` must be different storages.
        """
        bufs = (dst, rows, src)
        key = ("set_rows", id(dst), id(rows), id(src))
        hit = self._remembered(key, bufs, (rows,))
        if hit is not None:
            if hit.launch is None:
                self._set_rows(dst, rows, src, hit.shape)
            else:
                hit.launch()
            return
        rows_np = P.check_rows_op(self, "set_rows", src=src, rows=rows, dst=dst, unique=True)
        self._require("set_rows", dtype=src.dtype)
        self._require("set_rows", dtype=dst.dtype)
        launch = self._remember(key, bufs, (rows,), rows_np, "set_rows", (dst, rows, src, rows_np))
        if launch is None:
            self._set_rows(dst, rows, src, rows_np)
        else:
            launch()

    def zero_rows(self, dst: Buffer, rows: Buffer) -> None:
        """``dst[rows[i], :] = 0`` for contiguous 2-D ``dst``; ``rows`` int32 [N]
        in range (duplicates allowed: zeroing twice is harmless)."""
        bufs = (dst, rows)
        key = ("zero_rows", id(dst), id(rows))
        hit = self._remembered(key, bufs, (rows,))
        if hit is not None:
            if hit.launch is None:
                self._zero_rows(dst, rows, hit.shape)
            else:
                hit.launch()
            return
        rows_np = P.check_zero_rows(self, dst=dst, rows=rows)
        self._require("zero_rows", dtype=dst.dtype)
        launch = self._remember(key, bufs, (rows,), rows_np, "zero_rows", (dst, rows, rows_np))
        if launch is None:
            self._zero_rows(dst, rows, rows_np)
        else:
            launch()

    def copy_rows(self, src: Buffer, src_rows: Buffer, dst: Buffer, dst_rows: Buffer) -> None:
        """``dst[dst_rows[i], :] = convert(src[src_rows[i], :])``.

        Both 2-D contiguous with the same row length; index arrays int32 [N]
        of equal length, in range, ``dst_rows`` without duplicates.  ``src``
        may be ``dst`` (copies between planes of one pool) provided no
        destination row is also a source row: every read must be independent
        of every write, whatever the launch order.
        """
        bufs = (src, src_rows, dst, dst_rows)
        key = ("copy_rows", id(src), id(src_rows), id(dst), id(dst_rows))
        hit = self._remembered(key, bufs, (src_rows, dst_rows))
        if hit is not None:
            if hit.launch is None:
                self._copy_rows(src, src_rows, dst, dst_rows, *hit.shape)
            else:
                hit.launch()
            return
        checked = P.check_copy_rows(self, src=src, src_rows=src_rows, dst=dst, dst_rows=dst_rows)
        self._require("copy_rows", dtype=src.dtype)
        self._require("copy_rows", dtype=dst.dtype)
        launch = self._remember(key, bufs, (src_rows, dst_rows), checked, "copy_rows", (*bufs, *checked))
        if launch is None:
            self._copy_rows(src, src_rows, dst, dst_rows, *checked)
        else:
            launch()

    def ssm_conv(
        self,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        x: Buffer,
        weight: Buffer,
        y: Buffer,
        *,
        bias: Buffer | None = None,
        apply_silu: bool = False,
        n_snap: int = 1,
        plane_stride: int = 0,
    ) -> None:
        """Depthwise causal conv over ``concat(window, x)``, with window snapshots.

        Shapes (C order; ``W = d_conv - 1``, ``n_s`` sequences, ``n_t``
        tokens each, ``ch`` channels):

        * ``pool`` [R, ch * W], storage dtype; a row is a window laid out
          [ch, W] (time fastest, as upstream's conv state).
        * ``start_rows``, ``dst_rows`` int32 [n_s]: the row each sequence's
          window is read from (any plane) and the plane-0 row its new window
          goes to.
        * ``x`` [n_s, n_t, ch] float32 (may be a strided view).
        * ``weight`` [ch, d_conv] float32, ``bias`` [ch] float32 or None.
        * ``y`` [n_s, n_t, ch] float32 contiguous output.

        With ``ext[s, c, :] = concat(pool[start_rows[s], c, :], x[s, :, c])``
        (length ``W + n_t``)::

            y[s, t, c] = sum_k ext[s, c, t + k] * weight[c, k]  (+ bias[c])
            y = silu(y) if apply_silu

        Snapshots: for ``j in 0 .. min(n_t, n_snap - 1)`` the window ending
        ``j`` tokens before the end, ``ext[s, :, n_t - j : n_t - j + W]``, is
        written to row ``dst_rows[s] + j * plane_stride``.  Plane 0 is the
        new window; plane ``n_t`` (when ``n_t < n_snap``) is the input window,
        which makes undoing the whole call exact.  Slots past that are not
        written.  A sequence's start row may be one of its own written rows
        (in-place decode, rollback); it must not be another sequence's.
        """
        bufs = (pool, start_rows, dst_rows, x, weight, bias, y)
        silu = bool(apply_silu)
        key = ("ssm_conv", n_snap, plane_stride, silu, id(pool), id(start_rows), id(dst_rows), id(x), id(weight),
               id(bias), id(y))  # fmt: skip
        hit = self._remembered(key, bufs, (start_rows, dst_rows))
        if hit is not None:
            if hit.launch is None:
                self._ssm_conv(hit.shape, *bufs, silu)
            else:
                hit.launch()
            return
        shp = P.check_ssm_conv(
            self,
            pool=pool,
            start_rows=start_rows,
            dst_rows=dst_rows,
            x=x,
            weight=weight,
            y=y,
            bias=bias,
            n_snap=n_snap,
            plane_stride=plane_stride,
        )
        self._require("ssm_conv", dtype=pool.dtype, n_snap=n_snap, strided=not x.is_contiguous, d_conv=shp.d_conv)
        launch = self._remember(key, bufs, (start_rows, dst_rows), shp, "ssm_conv", (shp, *bufs, silu))
        if launch is None:
            self._ssm_conv(shp, *bufs, silu)
        else:
            launch()

    def ssm_scan(
        self,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        x: Buffer,
        dt: Buffer,
        A: Buffer,
        B: Buffer,
        C: Buffer,
        y: Buffer,
        *,
        n_snap: int = 1,
        plane_stride: int = 0,
    ) -> None:
        """Mamba-1 / Mamba-2 selective scan from start rows, with snapshot planes.

        Shapes (C order):

        * ``pool`` [R, n_head * head_dim * d_state], storage dtype; a row is a
          state laid out [n_head, head_dim, d_state] (d_state fastest).
        * ``start_rows``, ``dst_rows`` int32 [n_s].
        * ``x`` [n_s, n_t, n_head, head_dim], ``dt`` [n_s, n_t, n_head],
          ``B``/``C`` [n_s, n_t, n_group, d_state], all float32, may be strided
          (and may overlap: they are read only).
        * ``A`` float32 [n_head] (Mamba-2, one decay per head) or
          [n_head, d_state] (Mamba-1, expressed as head_dim 1, n_head =
          d_inner, n_group 1).  Mamba-1 requires ``n_snap == 1``.
        * ``y`` [n_s, n_t, n_head, head_dim] float32 contiguous output.

        Head ``h`` uses group ``h // (n_head // n_group)`` (repeat-interleave).
        For each sequence ``s`` and head ``h``, starting from
        ``S = pool[start_rows[s]][h]`` ([head_dim, d_state]) and for each token::

            d = softplus(dt[s, t, h])       # z if z > 20 else log1p(exp(z))
            S[i, k] = S[i, k] * exp(d * A[h(, k)]) + B[s, t, g, k] * x[s, t, h, i] * d
            y[s, t, h, i] = sum_k S[i, k] * C[s, t, g, k]

        Snapshots: for ``j in 0 .. min(n_t, n_snap - 1)`` the state after
        ``n_t - j`` tokens is written to row ``dst_rows[s] + j * plane_stride``
        (``j == n_t`` is the input state, written so that undoing the whole
        call is exact).  Nothing else of the pool is written.  Start-row
        aliasing rules as for :meth:`ssm_conv`.
        """
        bufs = (pool, start_rows, dst_rows, x, dt, A, B, C, y)
        key = ("ssm_scan", n_snap, plane_stride, id(pool), id(start_rows), id(dst_rows), id(x), id(dt), id(A),
               id(B), id(C), id(y))  # fmt: skip
        hit = self._remembered(key, bufs, (start_rows, dst_rows))
        if hit is not None:
            if hit.launch is None:
                self._ssm_scan(hit.shape, *bufs)
            else:
                hit.launch()
            return
        shp = P.check_ssm_scan(
            self,
            pool=pool,
            start_rows=start_rows,
            dst_rows=dst_rows,
            x=x,
            dt=dt,
            A=A,
            B=B,
            C=C,
            y=y,
            n_snap=n_snap,
            plane_stride=plane_stride,
        )
        # Spelled out: a generator here costs a decode call about a microsecond.
        strided = not (x.is_contiguous and dt.is_contiguous and B.is_contiguous and C.is_contiguous)
        self._require(
            "ssm_scan",
            dtype=pool.dtype,
            n_snap=n_snap,
            strided=strided,
            variant=shp.variant,
            d_state=shp.d_state,
            head_dim=shp.head_dim,
        )
        launch = self._remember(key, bufs, (start_rows, dst_rows), shp, "ssm_scan", (shp, *bufs))
        if launch is None:
            self._ssm_scan(shp, *bufs)
        else:
            launch()

    def gated_delta_net(
        self,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        beta: Buffer,
        o: Buffer,
        *,
        n_snap: int = 1,
        plane_stride: int = 0,
        scale: float | None = None,
    ) -> None:
        """Gated delta rule (GDN; per-key gate = KDA) from start rows, with snapshots.

        Shapes (C order; ``S`` = head size, same for keys and values):

        * ``pool`` [R, H_v * S * S], storage dtype; per head a block [S, S]
          where element ``[j, i]`` (i fastest) is ``M[i][j]``, i = key index,
          j = value index (upstream's transposed storage).
        * ``start_rows``, ``dst_rows`` int32 [n_s].
        * ``q``, ``k`` [n_s, n_t, H_k, S]; ``v`` [n_s, n_t, H_v, S] with
          ``H_v % H_k == 0``; value head ``h`` uses q/k head ``h % H_k``.
        * ``g`` [n_s, n_t, H_v] (scalar log-decay per head) or
          [n_s, n_t, H_v, S] (KDA: per key dimension).
        * ``beta`` [n_s, n_t, H_v].  All inputs float32, may be strided.
        * ``o`` [n_s, n_t, H_v, S] float32 contiguous output.

        Per sequence and value head, from ``M = pool[start_rows[s]][h]``::

            M[i, :] *= exp(g[i])             (KDA)  |  M *= exp(g)  (scalar)
            delta[j] = (v[j] - sum_i M[i, j] * k[i]) * beta
            M[i, j] += k[i] * delta[j]
            o[j] = scale * sum_i M[i, j] * q[i]      # scale defaults to 1/sqrt(S)

        Snapshots exactly as :meth:`ssm_scan`.
        """
        bufs = (pool, start_rows, dst_rows, q, k, v, g, beta, o)
        key = ("gated_delta_net", n_snap, plane_stride, scale, id(pool), id(start_rows), id(dst_rows), id(q), id(k),
               id(v), id(g), id(beta), id(o))  # fmt: skip
        hit = self._remembered(key, bufs, (start_rows, dst_rows))
        if hit is not None:
            if hit.launch is None:
                self._gated_delta_net(hit.shape[0], *bufs, hit.shape[1])
            else:
                hit.launch()
            return
        shp = P.check_gated_delta_net(
            self,
            pool=pool,
            start_rows=start_rows,
            dst_rows=dst_rows,
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            o=o,
            n_snap=n_snap,
            plane_stride=plane_stride,
        )
        strided = not (
            q.is_contiguous and k.is_contiguous and v.is_contiguous and g.is_contiguous and beta.is_contiguous
        )
        self._require(
            "gated_delta_net",
            dtype=pool.dtype,
            n_snap=n_snap,
            strided=strided,
            variant=shp.variant,
            head_size=shp.head_size,
        )
        eff_scale = float(scale) if scale is not None else 1.0 / math.sqrt(shp.head_size)
        args = (shp, *bufs, eff_scale)
        launch = self._remember(key, bufs, (start_rows, dst_rows), (shp, eff_scale), "gated_delta_net", args)
        if launch is None:
            self._gated_delta_net(*args)
        else:
            launch()

    # -- what a backend implements --------------------------------------------
    @abc.abstractmethod
    def _alloc(self, shape: tuple[int, ...], dtype: DType) -> Buffer:
        """Allocate a zero-filled contiguous buffer."""

    @abc.abstractmethod
    def _write(self, buffer: Buffer, host: np.ndarray) -> None:
        """Copy a contiguous host array of the buffer's dtype into it."""

    @abc.abstractmethod
    def _read(self, buffer: Buffer) -> np.ndarray:
        """Return the buffer's logical contents (views too) as a new array."""

    @abc.abstractmethod
    def _get_rows(self, src: Buffer, rows: Buffer, dst: Buffer, rows_host: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _set_rows(self, dst: Buffer, rows: Buffer, src: Buffer, rows_host: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _zero_rows(self, dst: Buffer, rows: Buffer, rows_host: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _copy_rows(
        self,
        src: Buffer,
        src_rows: Buffer,
        dst: Buffer,
        dst_rows: Buffer,
        src_rows_host: np.ndarray,
        dst_rows_host: np.ndarray,
    ) -> None: ...

    @abc.abstractmethod
    def _ssm_conv(
        self,
        shp: P.ConvShape,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        x: Buffer,
        weight: Buffer,
        bias: Buffer | None,
        y: Buffer,
        apply_silu: bool,
    ) -> None: ...

    @abc.abstractmethod
    def _ssm_scan(
        self,
        shp: P.ScanShape,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        x: Buffer,
        dt: Buffer,
        A: Buffer,
        B: Buffer,
        C: Buffer,
        y: Buffer,
    ) -> None: ...

    @abc.abstractmethod
    def _gated_delta_net(
        self,
        shp: P.DeltaShape,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        beta: Buffer,
        o: Buffer,
        scale: float,
    ) -> None: ...


class Backend(abc.ABC):
    """A family of devices registered under one name.

    ``name``: the selection name (``"cpu"``).  ``version``: the backend's own
    version string.  ``priority``: larger wins automatic selection when the
    user names nothing.  ``description``: one line for ``statecache backends``.
    ``provided_by``: the distribution or extra that installs it (used in
    error messages).
    """

    name: str
    version: str = "0"
    priority: int = 0
    description: str = ""
    provided_by: str = "statecache"

    @abc.abstractmethod
    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` when usable, else ``(False, reason)``.  Must not raise."""

    @abc.abstractmethod
    def devices(self) -> Sequence[Device]:
        """The usable devices, in a stable order (``<name>:0`` first)."""

    def info(self) -> Mapping[str, Any]:
        ok, reason = self.availability()
        return {"name": self.name, "version": self.version, "available": ok, "reason": reason}
