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

Wherever a primitive takes a Buffer it also takes any object speaking DLPack
(a torch tensor, a NumPy array): the first statement of every template
method, :meth:`Device._tensors_in`, turns those into Buffers, remembered by
the tensor's memory and geometry (:mod:`statecache.tensor_args`), so fresh
activation tensors at the allocator's usual addresses still hit the memo.

Launches may be asynchronous; :meth:`Device.synchronize` waits for all work
queued on the device.  :meth:`Device.download` always synchronizes first.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache import primitives as P
from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.errors import ArgumentError, CapabilityError
from statecache.launch_memo import STORAGE_WRITES as _STORAGE_WRITES
from statecache.launch_memo import LaunchMemo
from statecache.tensor_args import Relaunches, TensorWraps

if TYPE_CHECKING:
    from statecache.dlpack import TensorMemory

#: Names of every primitive of the contract, in documentation order.
PRIMITIVES: tuple[str, ...] = (
    "get_rows",
    "set_rows",
    "zero_rows",
    "copy_rows",
    "ssm_conv",
    "ssm_scan",
    "gated_delta_net",
    "rwkv_wkv6",
    "rwkv_wkv7",
    "gated_linear_attn",
)

#: The linear-attention primitives (RWKV-6, RWKV-7, GLA).  They joined the
#: contract without changing any existing signature, so protocol 2 stands: a
#: protocol-2 backend written before them simply lacks them in ``caps.ops``
#: (the Device methods that would run them are not abstract).
LINEAR_ATTN_PRIMITIVES: frozenset[str] = frozenset({"rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn"})


#: Version of the backend protocol this statecache speaks: the signatures of
#: the underscored primitive methods a backend implements.  1: equal-length
#: token inputs and 1-D destination rows with ``n_snap`` / ``plane_stride``.
#: 2: every stateful primitive gets its tokens packed along one axis with
#: ``cu_seqlens``, an explicit snapshot table, and optional fused epilogues
#: (see :class:`Device`).  A backend declares the version it implements in
#: :attr:`Backend.protocol`; any other is listed unavailable.
PROTOCOL_VERSION = 2


_F32 = DType.F32
_NO_DTYPES: frozenset[DType] = frozenset()


def _activations(*dtypes: DType) -> frozenset[DType]:
    """The non-f32 activation dtypes of a call (usually none: no enum hashing then)."""
    for dt in dtypes:
        if dt is not _F32:
            return frozenset(d for d in dtypes if d is not _F32)
    return _NO_DTYPES


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
    ``varlen``: whether the stateful primitives take the packed form
    (``cu_seqlens``, sequences of different lengths, zero-length ones
    included).  Equal-length calls reach a protocol-2 backend packed too, so
    this only says whether mixed lengths may be asked for.
    ``activation_dtypes``: dtypes the per-token inputs and outputs of the
    stateful primitives (x, dt, B, C, z, y; q, k, v, g, beta, o) may have;
    math is float32 whatever they are.
    ``epilogues``: fused options the stateful primitives implement, names
    from :data:`statecache.primitives.EPILOGUES` (``dt_bias``, ``dt_limit``,
    ``D``, ``z`` for ssm_scan; ``grouped_heads``, ``qk_l2norm``,
    ``raw_gate``, ``beta_sigmoid`` for gated_delta_net).  A call that uses
    one the device lacks is refused as not supported, never run without it.
    """

    ops: frozenset[str]
    storage_dtypes: frozenset[DType]
    max_snapshots: int = 16
    strided_inputs: bool = True
    host_visible: bool = False
    async_launch: bool = False
    varlen: bool = True
    activation_dtypes: frozenset[DType] = frozenset({DType.F32})
    epilogues: frozenset[str] = frozenset()

    #: Capability names that ``require()`` understands; anything else is an error.
    NAMES = (
        "ops",
        "storage_dtypes",
        "max_snapshots",
        "strided_inputs",
        "host_visible",
        "async_launch",
        "varlen",
        "activation_dtypes",
        "epilogues",
    )

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(PRIMITIVES)
        if unknown:
            raise ValueError(f"Caps.ops names unknown primitives: {sorted(unknown)}")
        bad = set(self.storage_dtypes) - set(STORAGE_DTYPES)
        if bad:
            raise ValueError(f"Caps.storage_dtypes holds non-storage dtypes: {sorted(map(str, bad))}")
        bad = set(self.activation_dtypes) - set(P.ACTIVATION_DTYPES)
        if bad or DType.F32 not in self.activation_dtypes:
            raise ValueError("Caps.activation_dtypes must hold f32 and only f32, f16, bf16")
        unknown = set(self.epilogues) - set(P.EPILOGUES)
        if unknown:
            raise ValueError(f"Caps.epilogues names unknown epilogues: {sorted(unknown)}; known: {P.EPILOGUES}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": sorted(self.ops),
            "storage_dtypes": sorted(d.value for d in self.storage_dtypes),
            "max_snapshots": self.max_snapshots,
            "strided_inputs": self.strided_inputs,
            "host_visible": self.host_visible,
            "async_launch": self.async_launch,
            "varlen": self.varlen,
            "activation_dtypes": sorted(d.value for d in self.activation_dtypes),
            "epilogues": sorted(self.epilogues),
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
        "_derived",
        "_geometry",
        "_index_cache",
        "_range",
        "_shadow",
        "_shadow_gen",
        "_size",
        "_tokens",
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
        # map(int, ...): a generator costs twice as much, and tensors as arguments
        # make a Buffer for every new address of an activation tensor.
        self.shape = shape_t = tuple(map(int, shape))
        dense = _c_strides(shape_t)
        self.strides = tuple(map(int, strides)) if strides is not None else dense
        self.offset = int(offset)
        self._size = math.prod(shape_t)
        self.capacity = int(capacity) if capacity is not None else self._size
        # Geometry never changes after construction: decide contiguity once
        # (primitives ask on every call, and decode calls are microseconds).
        self._contig = self.strides == dense or self._size <= 1
        self._shadow: np.ndarray | None = None  # see host_indices
        self._shadow_gen = 0
        self._index_cache: Any = None  # statecache.primitives caches index facts here
        self._tokens: Buffer | None = None  # this [n_s, n_t, ...] input as [n_s * n_t, ...] (primitives.token_view)
        self._derived: dict[Any, Any] | None = None  # index buffers derived from this one (snapshot tables)
        self._range: tuple[int, int] | bool | None = False  # byte_range(), once asked (False: not yet)
        # A Buffer over a tensor's memory (statecache.tensor_args): what validation saw of it
        # (class, dtype, shape, strides, offset, extent), which calls are remembered by.  None: native.
        self._geometry: tuple[Any, ...] | None = None

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
        return self._new_view(shape_t, strides_t, start)

    def _new_view(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Buffer:
        """Construct a checked view (a subclass carries its own per-storage facts over)."""
        # type(self): a backend's Buffer subclass (DLPack / CUDA array interface) survives views.
        return type(self)(
            self.device, self.storage, self.dtype, shape, strides=strides, offset=offset, capacity=self.capacity
        )

    def byte_range(self) -> tuple[int, int] | None:
        """``[lo, hi)``: the addresses of the bytes this buffer may touch (its
        storage's address plus the view's extent), or None when the storage
        does not say where it is (:func:`storage_address`)."""
        cached = self._range
        if cached is not False:
            return cached  # type: ignore[return-value]
        base = self._storage_base()
        if base is None:
            self._range = None
            return None
        item = self.dtype.itemsize
        span = 0 if self._size == 0 else 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        lo = base + self.offset * item
        self._range = (lo, lo + span * item)
        return self._range

    def _storage_base(self) -> int | None:
        """The address of the storage's element 0 (:func:`storage_address`;
        a subclass that already knows it says so)."""
        return storage_address(self.storage)

    def overlaps(self, other: Buffer) -> bool:
        """Whether the two buffers' byte ranges intersect (False when either is
        empty or does not know its address)."""
        a, b = self.byte_range(), other.byte_range()
        return a is not None and b is not None and a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]

    def same_storage(self, other: Buffer) -> bool:
        """Whether the buffers may share memory: the same storage, or storages
        whose addressed bytes overlap (two tensors over one allocation, each
        wrapped on its own, are two storages over the same bytes)."""
        return self.storage is other.storage or self.overlaps(other)

    def numpy(self) -> np.ndarray:
        """Download a copy (synchronizes the device)."""
        return self.device.download(self)

    def __repr__(self) -> str:
        extra = "" if self.is_contiguous and self.offset == 0 else f", strides={self.strides}, offset={self.offset}"
        return f"Buffer({self.device.id}, {self.dtype}, shape={self.shape}{extra})"


def storage_address(storage: Any) -> int | None:
    """The address of a storage's element 0: a NumPy array's data pointer, or
    the ``ptr`` integer of a backend's allocation object (a CUDA device
    address); None for storages that do not say (cl.Buffer)."""
    if isinstance(storage, np.ndarray):
        return int(storage.__array_interface__["data"][0])
    ptr = getattr(storage, "ptr", None)
    return ptr if isinstance(ptr, int) else None


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
    def _stored(self) -> str:
        """The storage dtypes, for a refusal that says what would work instead."""
        return ", ".join(sorted(d.value for d in self.caps.storage_dtypes))

    def supports(self, op: str, **params: Any) -> Support:
        """Whether ``op`` with these parameters runs on this device.

        Parameters a backend may look at: ``dtype`` (storage dtype of the
        pool), ``n_snap`` (snapshot columns), ``variant`` (``"mamba1"``/
        ``"mamba2"`` for ssm_scan, ``"scalar"``/``"kda"`` for
        gated_delta_net), ``strided`` (bool), ``varlen`` (bool: the packed
        form was asked for), ``epilogues`` (names of the fused options used),
        ``activation_dtypes`` (dtypes of the per-token tensors), and shape
        sizes such as ``d_state``, ``head_dim``, ``d_conv``, ``head_size``.
        The default answers from :attr:`caps`; backends with shape limits
        override and call ``super()``.
        """
        if op not in PRIMITIVES:
            raise CapabilityError(f"unknown primitive {op!r}; known: {', '.join(PRIMITIVES)}")
        if op not in self.caps.ops:
            return Support(
                False,
                f"{self.id} does not implement {op} (it implements {', '.join(sorted(self.caps.ops)) or 'nothing'}; "
                "`statecache backends` lists the other devices)",
            )
        dtype = params.get("dtype")
        if dtype is not None and DType.parse(dtype) not in self.caps.storage_dtypes:
            return Support(False, f"{self.id} cannot store {DType.parse(dtype)} (it stores {self._stored()})")
        n_snap = params.get("n_snap")
        if n_snap is not None and int(n_snap) > self.caps.max_snapshots:
            return Support(False, f"{self.id} emits at most {self.caps.max_snapshots} snapshots")
        if params.get("strided") and not self.caps.strided_inputs:
            return Support(False, f"{self.id} needs contiguous inputs")
        if params.get("varlen") and not self.caps.varlen:
            return Support(False, f"{self.id} does not take the packed (cu_seqlens) form")
        epilogues = params.get("epilogues")
        if epilogues:
            missing = set(epilogues) - set(self.caps.epilogues)
            if missing:
                return Support(False, f"{self.id} does not fuse {', '.join(sorted(missing))} into {op}")
        acts = params.get("activation_dtypes")
        if acts:
            missing_dt = {DType.parse(d) for d in acts} - set(self.caps.activation_dtypes)
            if missing_dt:
                names = ", ".join(sorted(d.value for d in missing_dt))
                return Support(False, f"{self.id} does not take {names} activations in {op}")
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

    # -- tensors as arguments: see statecache.tensor_args ------------------------
    #: fingerprint of a DLPack tensor -> the Buffer a call gets for it.
    _wraps: TensorWraps | None = None

    def _tensors_in(self, names: str, *args: Any) -> tuple[Any, ...]:
        """``args`` with every DLPack object (torch tensor, NumPy array ...)
        replaced by a Buffer of this device; Buffers and None pass unchanged.

        The first statement of every primitive, so that everything after it
        (the launch memo, validation, the backend) sees only Buffers::

            given = (pool, rows, x, y)
            pool, rows, x, y = self._tensors_in("pool* rows x y*", *given)

        ``given`` must stay referenced until the primitive returns: the Buffers
        returned do not keep a tensor's memory alive, and rebinding the
        argument names drops what may be the last reference to a temporary
        argument (``f(torch.empty(...))``: CPython moves the caller's
        references into the callee's locals), whose memory the allocator
        would then hand out while the kernel still writes it.

        ``names`` lists the arguments in order (error messages name them);
        ``*`` marks one the primitive writes (a read-only tensor, or a host
        tensor that must be copied in, is refused there).  A call with
        Buffers only pays for one type check per argument."""
        for arg in args:
            if arg is not None and not isinstance(arg, Buffer):
                break
        else:
            return args
        wraps = self._wraps
        if wraps is None:
            wraps = self._wraps = TensorWraps()
        return wraps.coerce(self, names, args, Buffer)

    #: calls matched by geometry, relaunched with new tensor addresses (statecache.tensor_args.Relaunches)
    _relaunches: Relaunches | None = None

    def _tensors_or_relaunch(
        self, site: tuple[Any, ...], names: str, given: tuple[Any, ...], fresh: bool = False
    ) -> tuple[Any, ...] | None:
        """:meth:`_tensors_in` for a primitive that can be relaunched by
        geometry (:class:`statecache.tensor_args.Relaunches`; ``site``: the
        primitive and its scalars): None when the call was launched that way,
        else the arguments as Buffers.  A call with Buffers only pays for one
        type check per argument, as with :meth:`_tensors_in`; ``fresh``: the
        caller saw that its activation is not a Buffer (a fresh tensor, which
        the launch memo never holds), so that loop is skipped."""
        if not fresh:
            for arg in given:
                if arg is not None and not isinstance(arg, Buffer):
                    break
            else:
                return given
        relaunches = self._relaunches
        if relaunches is not None and relaunches.relaunched(self, site, given, Buffer):
            return None
        return self._tensors_in(names, *given)

    def _learn_relaunch(
        self,
        op: str,
        site: tuple[Any, ...],
        names: str,
        given: tuple[Any, ...],
        coerced: tuple[Any, ...],
        index_bufs: tuple[Any, ...],
        hit: Any,
        call_args: tuple[Any, ...],
    ) -> None:
        """After a call matched by geometry (``hit``, a loose memo entry) ran:
        remember it for :meth:`_relaunched`."""
        relaunches = self._relaunches
        if relaunches is None:
            relaunches = self._relaunches = Relaunches()
        relaunches.learn(self, op, site, names, given, coerced, index_bufs, hit.shadows, call_args, Buffer)

    def _prepare_relaunch(
        self, op: str, call_args: tuple[Any, ...], tensors: dict[int, int]
    ) -> Callable[[list[int]], bool] | None:
        """Optionally turn a validated call into a launch that takes its
        tensors' addresses.

        ``call_args`` are the positional arguments of ``_<op>``; ``tensors``
        maps ``id(storage)`` of each tensor Buffer among them (or of the
        Buffer a token view was made of: the same storage) to the index of
        its address in the list the launch gets.  A Buffer over a tensor has
        offset 0 at the tensor's address; the launch must put every one of
        them at its new address (and keep no pointer of the validated call),
        or the backend returns None.  The launch returns True, or False when
        it did nothing (another thread is running it): the call then takes
        the ordinary path.  A backend whose ``_exchange_reader`` has a
        ``launch`` (:class:`statecache.dlpack.ExchangeReader`) may give the
        launch a ``block`` (int: the call prepared in that launch's layout,
        owned by the launch's attributes) and ``threads`` (the thread count,
        read per call): relaunches then match and launch in one call of it.
        None, the default: no relaunching."""
        return None

    def _import_memory(self, memory: TensorMemory, dtype: DType) -> Buffer | None:
        """A Buffer over a tensor's memory (a DLPack export), without a copy,
        or None when this device cannot address that memory.

        ``memory`` says where the elements are (``address`` with the export's
        offset included, ``shape``, ``strides`` in elements, ``device_type``
        and ``device_id`` as DLPack numbers them); ``dtype`` is the Buffer's.
        The Buffer must not keep the memory alive (the tensor's owner frees
        it; the Buffer is used only while a tensor over exactly that memory
        is an argument of the running call) and its ``storage`` should say
        where it is (:func:`storage_address`), so that overlaps are found.
        The default imports nothing: host tensors are then copied in before
        each call that reads them, and refused where a primitive writes."""
        return None

    def _dlpack_stream(self) -> int | None:
        """The ``stream`` argument a DLPack export for this device's next
        launch gets (CUDA: the stream launches go to); None elsewhere."""
        return None

    # -- launch memo: see statecache.launch_memo ---------------------------------
    _launches: LaunchMemo | None = None
    #: (n_seqs, n_tokens) -> the cu_seqlens buffer of that equal-length form.
    _cu_cache: dict[tuple[int, int], Buffer] | None = None

    def _remembered(self, key: tuple[Any, ...], bufs: tuple[Any, ...], index_bufs: tuple[Any, ...]) -> Any:
        """The remembered launch of an identical earlier call, or None.

        ``key`` ends with the ids of ``bufs``, in order.  When tensors have
        been passed on this device, a call that is new by identity may still
        match a validated call by the geometry of its tensor Buffers (see
        :mod:`statecache.launch_memo`)."""
        memo = self._launches
        if memo is None:
            return None
        try:
            hit = memo.lookup(key, self.caps, bufs, index_bufs)
            if hit is None and self._wraps is not None:
                hit = self._remembered_by_geometry(memo, key, bufs, index_bufs)
            return hit
        except TypeError:  # an unhashable scalar: validation will say what is wrong
            return None

    def _remembered_by_geometry(
        self, memo: LaunchMemo, key: tuple[Any, ...], bufs: tuple[Any, ...], index_bufs: tuple[Any, ...]
    ) -> Any:
        written = _WRITTEN_AT.get(key[0])
        if written is None:
            return None  # a primitive matched by identity only
        loose_key = _geometry_key(key, bufs)
        if loose_key is None:
            return None
        hit = memo.lookup(loose_key, self.caps, bufs, index_bufs)
        if hit is None or _may_overlap(bufs, written):
            return None  # never validated in this shape, or tensors now overlap: validation says what
        # Remember this exact combination too: the next identical call skips the geometry key.
        memo.store(key, self.caps, bufs, index_bufs, hit.shape, None)
        return hit

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
        if self._wraps is not None and key[0] in _WRITTEN_AT:
            loose_key = _geometry_key(key, bufs)
            if loose_key is not None:
                loose = [b is not None and b._geometry is not None for b in bufs]
                memo.store(loose_key, self.caps, bufs, index_bufs, checked, None, loose=loose)
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

    def _launch_again(self, op: str, hit: Any, call_args: tuple[Any, ...]) -> bool:
        """Run a remembered call that has no prepared launch; returns whether
        it was matched by geometry (``hit.loose``: worth relaunching by
        geometry next time).  An entry matched by identity gets its launch
        prepared now: it was stored without one by a call matched by geometry,
        and is met again (tensors at the addresses of an earlier call)."""
        if not hit.loose and not hit.prepared:
            hit.prepared = True  # asked once: a backend that declines is not asked again
            hit.launch = self._prepare_launch(op, call_args)
            if hit.launch is not None:
                hit.launch()
                return False
        getattr(self, f"_{op}")(*call_args)
        return bool(hit.loose)

    # -- memory ---------------------------------------------------------------
    def alloc(self, shape: int | Sequence[int], dtype: DType | str = DType.F32) -> Buffer:
        """A new zero-filled contiguous buffer."""
        dt = DType.parse(dtype)
        shape_t = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape_t):
            raise ArgumentError("shape", f"negative dimension in {shape_t}")
        if dt is not DType.I32 and dt not in self.caps.storage_dtypes:
            raise CapabilityError(f"{self.id} cannot store {dt} (it stores {self._stored()})")
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
        given = np.asarray(values)
        if given.dtype.kind == "f" and given.size:
            # the int64 conversion below would truncate 1.5 to row 1 without a word
            flat = given.ravel()
            fractional = flat[~np.isfinite(flat) | (flat != np.trunc(flat))]
            if fractional.size:
                raise ArgumentError("indices", f"values must be whole numbers, got {fractional[0]} ({given.dtype})")
        host = np.ascontiguousarray(np.asarray(given, dtype=np.int64))
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
            # Convert through float32: the same rounding on every backend.  Data already in
            # the buffer's dtype is copied as it is (the round trip is exact, and costs two
            # passes over e.g. a restored K/V cache).
            if host.dtype != buffer.dtype.numpy:
                host = host.astype(np.float32, copy=False).astype(buffer.dtype.numpy)
            host = np.ascontiguousarray(host)
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
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("get_rows", id(src), id(rows), id(dst)), self.caps)
            if hit is not None:
                if hit.launch is None:
                    self._get_rows(src, rows, dst, hit.shape)
                else:
                    hit.launch()
                return
        given = (src, rows, dst)  # held until return: see _tensors_in
        src, rows, dst = self._tensors_in("src rows dst*", *given)
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
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("set_rows", id(dst), id(rows), id(src)), self.caps)
            if hit is not None:
                if hit.launch is None:
                    self._set_rows(dst, rows, src, hit.shape)
                else:
                    hit.launch()
                return
        given = (dst, rows, src)  # held until return: see _tensors_in
        dst, rows, src = self._tensors_in("dst* rows src", *given)
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
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("zero_rows", id(dst), id(rows)), self.caps)
            if hit is not None:
                if hit.launch is None:
                    self._zero_rows(dst, rows, hit.shape)
                else:
                    hit.launch()
                return
        given = (dst, rows)  # held until return: see _tensors_in
        dst, rows = self._tensors_in("dst* rows", *given)
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
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("copy_rows", id(src), id(src_rows), id(dst), id(dst_rows)), self.caps)
            if hit is not None:
                if hit.launch is None:
                    self._copy_rows(src, src_rows, dst, dst_rows, *hit.shape)
                else:
                    hit.launch()
                return
        given = (src, src_rows, dst, dst_rows)  # held until return: see _tensors_in
        src, src_rows, dst, dst_rows = self._tensors_in("src src_rows dst* dst_rows", *given)
        bufs = (src, src_rows, dst, dst_rows)
        key = ("copy_rows", id(src), id(src_rows), id(dst), id(dst_rows))
        hit = self._remembered(key, bufs, (src_rows, dst_rows))
        if hit is not None:
            if hit.launch is None:
                self._copy_rows(src, src_rows, dst, dst_rows, *hit.shape)
            else:
                hit.launch()
            return
        if src.storage is not dst.storage and src.overlaps(dst):
            # Rows of one pool are compared by index; two wraps of overlapping memory
            # are not one pool, and their rows cannot be compared.
            raise ArgumentError("dst", "overlaps src in memory without being the same buffer")
        checked = P.check_copy_rows(self, src=src, src_rows=src_rows, dst=dst, dst_rows=dst_rows)
        self._require("copy_rows", dtype=src.dtype)
        self._require("copy_rows", dtype=dst.dtype)
        launch = self._remember(key, bufs, (src_rows, dst_rows), checked, "copy_rows", (*bufs, *checked))
        if launch is None:
            self._copy_rows(src, src_rows, dst, dst_rows, *checked)
        else:
            launch()

    # -- stateful primitives ----------------------------------------------------
    # Rules shared by every stateful primitive (ssm_conv, ssm_scan, gated_delta_net,
    # rwkv_wkv6, rwkv_wkv7, gated_linear_attn: the contract;
    # statecache.primitives checks every one of them before anything runs):
    #
    # Tokens.  Either the equal-length form, every per-token argument
    # [n_s, n_t, ...] (n_t >= 1 tokens for each of n_s sequences), or the
    # packed form with ``cu_seqlens`` int32 [n_s + 1]: every per-token
    # argument [T, ...], sequence s owning tokens cu_seqlens[s] ..
    # cu_seqlens[s + 1] - 1 (cu_seqlens[0] == 0, non-decreasing, last == T;
    # a zero-length sequence is allowed).  n_t(s) is a sequence's token count.
    #
    # Rows.  ``start_rows`` int32 [n_s]: the pool row each sequence's state is
    # read from (any plane).  ``dst_rows``, either
    # * int32 [n_s, n_w] (n_w <= caps.max_snapshots): column j of sequence s
    #   is the row that receives its state after n_t(s) - j tokens (j = 0 the
    #   final state, j = n_t(s) the input state), -1 where nothing is written;
    #   columns j > n_t(s) must be -1; or
    # * int32 [n_s] with ``n_snap`` and ``plane_stride``: the table whose
    #   column j is dst_rows + j * plane_stride for j <= min(n_t(s), n_snap - 1),
    #   -1 past that (plane 0 the final state, plane j the state j tokens
    #   before the end, the input state in plane n_t when n_t < n_snap, so
    #   that undoing the whole call is exact).
    # Every non-negative destination row is unique in the call, and nothing
    # else of the pool is written.  A start row may be one of its own
    # sequence's destination rows (in place; a rollback start), never another
    # sequence's: the kernels read each slice of a start row before they write
    # it, but not before another sequence does.  Rotating planes costs no
    # extra traffic: a decode that reads plane p and writes only plane
    # p + 1 (``[[row_p1, -1]]`` per sequence) leaves the old state where it
    # was as the snapshot.
    #
    # Results.  The sequences are independent: a packed call computes, per
    # sequence, exactly (bitwise) what a call for that sequence alone
    # computes, on every backend.

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
        cu_seqlens: Buffer | None = None,
    ) -> None:
        """Depthwise causal conv over ``concat(window, x)``, with window snapshots.

        Rows, snapshot columns and the two token forms as described above
        the stateful primitives (``W = d_conv - 1``, ``ch`` channels):

        * ``pool`` [R, ch * W], storage dtype; a row is a window laid out
          [ch, W] (time fastest, as upstream's conv state).
        * ``x`` [n_s, n_t, ch] or, with ``cu_seqlens``, [T, ch]; an
          activation dtype of the device (may be a strided view).
        * ``weight`` [ch, d_conv] float32, ``bias`` [ch] float32 or None.
        * ``y`` like ``x``, contiguous output.

        With ``ext[s, c, :] = concat(pool[start_rows[s], c, :], x of s[:, c])``
        (length ``W + n_t(s)``)::

            y[s, t, c] = sum_k ext[s, c, t + k] * weight[c, k]  (+ bias[c])
            y = silu(y) if apply_silu

        Snapshot column j is the window ending j tokens before the end,
        ``ext[s, :, n_t - j : n_t - j + W]`` (column n_t(s) is the input window).
        """
        silu = bool(apply_silu)
        memo = self._launches
        # The very Buffers of a remembered call: see LaunchMemo.probe.  Its keys hold live
        # Buffers' ids only, so a call whose activation is not a Buffer (a fresh tensor) would
        # miss: it goes straight to the relaunch by geometry instead.
        if memo is not None and isinstance(x, Buffer):
            if cu_seqlens is None:
                hit = memo.probe(("ssm_conv", n_snap, plane_stride, silu, id(pool), id(start_rows), id(dst_rows),
                                  id(x), id(weight), id(bias), id(y)), self.caps)  # fmt: skip
            else:
                hit = memo.probe(("ssm_conv+", n_snap, plane_stride, silu, id(pool), id(start_rows), id(dst_rows),
                                  id(x), id(weight), id(bias), id(y), id(cu_seqlens)), self.caps)  # fmt: skip
            if hit is not None:
                if hit.launch is None:
                    args = (pool, start_rows, dst_rows, x, weight, bias, y, cu_seqlens)
                    self._launch_again("ssm_conv", hit, self._conv_args(hit.shape, args, silu))
                else:
                    hit.launch()
                return
        given = (pool, start_rows, dst_rows, x, weight, y, bias, cu_seqlens)  # held until return: see _tensors_in
        site = ("ssm_conv", n_snap, plane_stride, silu)
        coerced = self._tensors_or_relaunch(site, _CONV_NAMES, given, not isinstance(x, Buffer))
        if coerced is None:
            return
        pool, start_rows, dst_rows, x, weight, y, bias, cu_seqlens = coerced
        # The key and the buffers the memo checks hold only the arguments given:
        # a decode call without the optional ones pays for no more than before.
        if cu_seqlens is None:
            bufs: tuple[Any, ...] = (pool, start_rows, dst_rows, x, weight, bias, y)
            key: tuple[Any, ...] = ("ssm_conv", n_snap, plane_stride, silu, id(pool), id(start_rows),
                                    id(dst_rows), id(x), id(weight), id(bias), id(y))  # fmt: skip
            index_bufs: tuple[Any, ...] = (start_rows, dst_rows)
        else:
            bufs = (pool, start_rows, dst_rows, x, weight, bias, y, cu_seqlens)
            key = ("ssm_conv+", n_snap, plane_stride, silu, id(pool), id(start_rows), id(dst_rows), id(x),
                   id(weight), id(bias), id(y), id(cu_seqlens))  # fmt: skip
            index_bufs = (start_rows, dst_rows, cu_seqlens)
        hit = self._remembered(key, bufs, index_bufs)
        if hit is not None:
            if hit.launch is None:
                args = self._conv_args(hit.shape, bufs, silu)
                if self._launch_again("ssm_conv", hit, args):
                    self._learn_relaunch("ssm_conv", site, _CONV_NAMES, given, coerced, index_bufs, hit, args)
            else:
                hit.launch()
            return
        call = P.check_ssm_conv(
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
            cu_seqlens=cu_seqlens,
        )
        shp = call.shape
        assert isinstance(shp, P.ConvShape)
        acts = _activations(x.dtype, y.dtype)
        self._require(
            "ssm_conv",
            dtype=pool.dtype,
            n_snap=shp.n_cols,
            strided=not x.is_contiguous,
            d_conv=shp.d_conv,
            varlen=cu_seqlens is not None,
            activation_dtypes=acts,
        )
        self._launch_state("ssm_conv", key, bufs, index_bufs, call, self._conv_args(call, bufs, silu))

    def _conv_args(self, call: P.StateCall, bufs: tuple[Any, ...], silu: bool) -> tuple[Any, ...]:
        pool, start_rows, dst_rows, x, weight, bias, y, *rest = bufs
        cu_seqlens = rest[0] if rest else None
        x, y = P.packed_tokens(self, call, x, y)
        snap = dst_rows if call.snap_rows is None else call.snap_rows
        cu = cu_seqlens if call.cu_seqlens is None else call.cu_seqlens
        return (call.shape, pool, start_rows, snap, cu, x, weight, bias, y, silu)

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
        cu_seqlens: Buffer | None = None,
        D: Buffer | None = None,
        z: Buffer | None = None,
        dt_bias: Buffer | None = None,
        dt_limit: tuple[float, float] | None = None,
    ) -> None:
        """Mamba-1 / Mamba-2 selective scan from start rows, with snapshot rows.

        Rows, snapshot columns and the two token forms as described above
        the stateful primitives.  Per-token shapes are given for the packed
        form ([T, ...]); the equal-length form has [n_s, n_t, ...] instead.

        * ``pool`` [R, n_head * head_dim * d_state], storage dtype; a row is a
          state laid out [n_head, head_dim, d_state] (d_state fastest).
        * ``x`` [T, n_head, head_dim], ``dt`` [T, n_head], ``B``/``C``
          [T, n_group, d_state]: activation dtypes of the device, may be
          strided (and may overlap: they are read only).
        * ``A`` float32 [n_head] (Mamba-2, one decay per head) or
          [n_head, d_state] (Mamba-1, expressed as head_dim 1, n_head =
          d_inner, n_group 1).  Both families write every snapshot column.
        * ``y`` [T, n_head, head_dim] contiguous output.

        Fused epilogues, as mamba_ssm's ``selective_state_update`` /
        ``mamba_chunk_scan_combined`` (each needs its name in
        ``caps.epilogues``): ``dt_bias`` float32 [n_head], added to dt before
        softplus; ``dt_limit=(lo, hi)``, a clamp of softplus's result
        (NaN stays NaN; ``(0, inf)`` is no clamp); ``D`` float32 [n_head] or
        [n_head, head_dim], the skip ``y += D * x``; ``z`` like ``x``, the
        gate ``y *= silu(z)`` applied last.

        Head ``h`` uses group ``h // (n_head // n_group)`` (repeat-interleave).
        For each sequence ``s`` and head ``h``, starting from
        ``S = pool[start_rows[s]][h]`` ([head_dim, d_state]) and for each token::

            d = softplus(dt[t, h] + dt_bias[h])     # z if z > 20 else log1p(exp(z))
            d = clamp(d, lo, hi)                     # with dt_limit
            S[i, k] = S[i, k] * exp(d * A[h(, k)]) + B[t, g, k] * x[t, h, i] * d
            y[t, h, i] = (sum_k S[i, k] * C[t, g, k] + D[h(, i)] * x[t, h, i]) * silu(z[t, h, i])

        Snapshot column j receives S after n_t(s) - j tokens.
        """
        memo = self._launches
        if memo is not None and isinstance(x, Buffer):  # see ssm_conv: a fresh tensor's call would miss
            if cu_seqlens is None and D is None and z is None and dt_bias is None and dt_limit is None:
                hit = memo.probe(("ssm_scan", n_snap, plane_stride, id(pool), id(start_rows), id(dst_rows), id(x),
                                  id(dt), id(A), id(B), id(C), id(y)), self.caps)  # fmt: skip
            else:
                hit = memo.probe(("ssm_scan+", n_snap, plane_stride, dt_limit, id(pool), id(start_rows),
                                  id(dst_rows), id(x), id(dt), id(A), id(B), id(C), id(y), id(cu_seqlens), id(D),
                                  id(z), id(dt_bias)), self.caps)  # fmt: skip
            if hit is not None:
                if hit.launch is None:
                    args = (pool, start_rows, dst_rows, x, dt, A, B, C, y, cu_seqlens, D, z, dt_bias)
                    self._launch_again("ssm_scan", hit, self._scan_args(hit.shape, args))
                else:
                    hit.launch()
                return
        given = (pool, start_rows, dst_rows, x, dt, A, B, C, y, cu_seqlens, D, z, dt_bias)  # held: see _tensors_in
        site = ("ssm_scan", n_snap, plane_stride, dt_limit)
        coerced = self._tensors_or_relaunch(site, _SCAN_NAMES, given, not isinstance(x, Buffer))
        if coerced is None:
            return
        pool, start_rows, dst_rows, x, dt, A, B, C, y, cu_seqlens, D, z, dt_bias = coerced
        # The key and the buffers the memo checks hold only the arguments given:
        # a decode call without the optional ones pays for no more than before.
        if cu_seqlens is None and D is None and z is None and dt_bias is None and dt_limit is None:
            bufs: tuple[Any, ...] = (pool, start_rows, dst_rows, x, dt, A, B, C, y)
            key: tuple[Any, ...] = ("ssm_scan", n_snap, plane_stride, id(pool), id(start_rows), id(dst_rows), id(x),
                                    id(dt), id(A), id(B), id(C), id(y))  # fmt: skip
        else:
            bufs = (pool, start_rows, dst_rows, x, dt, A, B, C, y, cu_seqlens, D, z, dt_bias)
            key = ("ssm_scan+", n_snap, plane_stride, dt_limit, id(pool), id(start_rows), id(dst_rows), id(x),
                   id(dt), id(A), id(B), id(C), id(y), id(cu_seqlens), id(D), id(z), id(dt_bias))  # fmt: skip
        index_bufs = (start_rows, dst_rows) if cu_seqlens is None else (start_rows, dst_rows, cu_seqlens)
        hit = self._remembered(key, bufs, index_bufs)
        if hit is not None:
            if hit.launch is None:
                args = self._scan_args(hit.shape, bufs)
                if self._launch_again("ssm_scan", hit, args):
                    self._learn_relaunch("ssm_scan", site, _SCAN_NAMES, given, coerced, index_bufs, hit, args)
            else:
                hit.launch()
            return
        call = P.check_ssm_scan(
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
            cu_seqlens=cu_seqlens,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_limit=dt_limit,
        )
        shp = call.shape
        assert isinstance(shp, P.ScanShape)
        # Spelled out: a generator here costs a decode call about a microsecond.
        strided = not (x.is_contiguous and dt.is_contiguous and B.is_contiguous and C.is_contiguous)
        if z is not None and not z.is_contiguous:
            strided = True
        epilogues = P.scan_epilogues(shp, D, z, dt_bias)
        acts = _activations(x.dtype, dt.dtype, B.dtype, C.dtype, y.dtype, DType.F32 if z is None else z.dtype)
        self._require(
            "ssm_scan",
            dtype=pool.dtype,
            n_snap=shp.n_cols,
            strided=strided,
            variant=shp.variant,
            d_state=shp.d_state,
            head_dim=shp.head_dim,
            varlen=cu_seqlens is not None,
            epilogues=epilogues,
            activation_dtypes=acts,
        )
        self._launch_state("ssm_scan", key, bufs, index_bufs, call, self._scan_args(call, bufs))

    def _scan_args(self, call: P.StateCall, bufs: tuple[Any, ...]) -> tuple[Any, ...]:
        pool, start_rows, dst_rows, x, dt, A, B, C, y, *rest = bufs
        cu_seqlens, D, z, dt_bias = rest if rest else (None, None, None, None)
        x, dt, B, C, y, z = P.packed_tokens(self, call, x, dt, B, C, y, z)
        snap = dst_rows if call.snap_rows is None else call.snap_rows
        cu = cu_seqlens if call.cu_seqlens is None else call.cu_seqlens
        return (call.shape, pool, start_rows, snap, cu, x, dt, A, B, C, y, D, z, dt_bias)

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
        cu_seqlens: Buffer | None = None,
        head_map: str = "tiled",
        qk_l2norm: bool = False,
        A_log: Buffer | None = None,
        dt_bias: Buffer | None = None,
        beta_sigmoid: bool = False,
    ) -> None:
        """Gated delta rule (GDN; per-key gate = KDA) from start rows, with snapshot rows.

        Rows, snapshot columns and the two token forms as described above
        the stateful primitives; per-token shapes for the packed form
        (``S`` = head size, same for keys and values):

        * ``pool`` [R, H_v * S * S], storage dtype; per head a block [S, S]
          where element ``[j, i]`` (i fastest) is ``M[i][j]``, i = key index,
          j = value index (upstream's transposed storage).
        * ``q``, ``k`` [T, H_k, S]; ``v`` [T, H_v, S] with ``H_v % H_k == 0``.
        * ``g`` [T, H_v] (scalar log-decay per head) or [T, H_v, S] (KDA: per
          key dimension); ``beta`` [T, H_v].  Activation dtypes, may be strided.
        * ``o`` [T, H_v, S] contiguous output.

        Options (fused epilogues, each needs its name in ``caps.epilogues``):

        * ``head_map``: value head ``h`` reads q/k head ``h % H_k``
          (``"tiled"``, llama.cpp's order after conversion) or
          ``h // (H_v // H_k)`` (``"grouped"``, epilogue ``grouped_heads``: as
          transformers, flash-linear-attention and vLLM).
        * ``qk_l2norm``: q and k are first normalised,
          ``q / sqrt(sum(q * q) + 1e-6)`` (fla's ``use_qk_l2norm_in_kernel``).
        * ``A_log`` float32 [H_v] (epilogue ``raw_gate``): ``g`` holds the raw
          projection ``a`` and the log-decay is
          ``-exp(A_log[h]) * softplus(a + dt_bias)`` (Qwen3-Next; KDA's
          ``fused_kda_gate`` with per-key ``a``); ``dt_bias`` float32 [H_v]
          ([H_v, S] for KDA) or None.
        * ``beta_sigmoid``: ``beta`` holds the raw projection ``b`` and
          ``sigmoid(b)`` is used.

        Per sequence and value head, from ``M = pool[start_rows[s]][h]``::

            M[i, :] *= exp(g[i])             (KDA)  |  M *= exp(g)  (scalar)
            delta[j] = (v[j] - sum_i M[i, j] * k[i]) * beta
            M[i, j] += k[i] * delta[j]
            o[j] = scale * sum_i M[i, j] * q[i]      # scale defaults to 1/sqrt(S)

        (``head_map="grouped"`` with H_k == 1 or H_k == H_v is the tiled map,
        and is run as such.)

        Snapshot column j receives M after n_t(s) - j tokens.
        """
        memo = self._launches
        if memo is not None and isinstance(q, Buffer):  # see ssm_conv: a fresh tensor's call would miss
            if cu_seqlens is None and A_log is None and dt_bias is None:
                hit = memo.probe(("gated_delta_net", n_snap, plane_stride, scale, head_map, qk_l2norm, beta_sigmoid,
                                  id(pool), id(start_rows), id(dst_rows), id(q), id(k), id(v), id(g), id(beta),
                                  id(o)), self.caps)  # fmt: skip
            else:
                hit = memo.probe(("gated_delta_net+", n_snap, plane_stride, scale, head_map, qk_l2norm, beta_sigmoid,
                                  id(pool), id(start_rows), id(dst_rows), id(q), id(k), id(v), id(g), id(beta), id(o),
                                  id(cu_seqlens), id(A_log), id(dt_bias)), self.caps)  # fmt: skip
            if hit is not None:
                if hit.launch is None:
                    args = (pool, start_rows, dst_rows, q, k, v, g, beta, o, cu_seqlens, A_log, dt_bias)
                    self._launch_again("gated_delta_net", hit, self._delta_args(hit.shape, args))
                else:
                    hit.launch()
                return
        given = (pool, start_rows, dst_rows, q, k, v, g, beta, o, cu_seqlens, A_log, dt_bias)  # held: see _tensors_in
        site = ("gated_delta_net", n_snap, plane_stride, scale, head_map, qk_l2norm, beta_sigmoid)
        coerced = self._tensors_or_relaunch(site, _DELTA_NAMES, given, not isinstance(q, Buffer))
        if coerced is None:
            return
        pool, start_rows, dst_rows, q, k, v, g, beta, o, cu_seqlens, A_log, dt_bias = coerced
        # The key and the buffers the memo checks hold only the arguments given:
        # a decode call without the optional ones pays for no more than before.
        if cu_seqlens is None and A_log is None and dt_bias is None:
            bufs: tuple[Any, ...] = (pool, start_rows, dst_rows, q, k, v, g, beta, o)
            key: tuple[Any, ...] = ("gated_delta_net", n_snap, plane_stride, scale, head_map, qk_l2norm,
                                    beta_sigmoid, id(pool), id(start_rows), id(dst_rows), id(q), id(k), id(v), id(g),
                                    id(beta), id(o))  # fmt: skip
        else:
            bufs = (pool, start_rows, dst_rows, q, k, v, g, beta, o, cu_seqlens, A_log, dt_bias)
            key = ("gated_delta_net+", n_snap, plane_stride, scale, head_map, qk_l2norm, beta_sigmoid, id(pool),
                   id(start_rows), id(dst_rows), id(q), id(k), id(v), id(g), id(beta), id(o), id(cu_seqlens),
                   id(A_log), id(dt_bias))  # fmt: skip
        index_bufs = (start_rows, dst_rows) if cu_seqlens is None else (start_rows, dst_rows, cu_seqlens)
        hit = self._remembered(key, bufs, index_bufs)
        if hit is not None:
            if hit.launch is None:
                args = self._delta_args(hit.shape, bufs)
                if self._launch_again("gated_delta_net", hit, args):
                    self._learn_relaunch("gated_delta_net", site, _DELTA_NAMES, given, coerced, index_bufs, hit, args)
            else:
                hit.launch()
            return
        call = P.check_gated_delta_net(
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
            cu_seqlens=cu_seqlens,
            head_map=head_map,
            qk_l2norm=qk_l2norm,
            A_log=A_log,
            dt_bias=dt_bias,
            beta_sigmoid=beta_sigmoid,
            scale=scale,
        )
        shp = call.shape
        assert isinstance(shp, P.DeltaShape)
        strided = not (
            q.is_contiguous and k.is_contiguous and v.is_contiguous and g.is_contiguous and beta.is_contiguous
        )
        epilogues = P.delta_epilogues(shp, A_log)
        acts = _activations(q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, o.dtype)
        self._require(
            "gated_delta_net",
            dtype=pool.dtype,
            n_snap=shp.n_cols,
            strided=strided,
            variant=shp.variant,
            head_size=shp.head_size,
            varlen=cu_seqlens is not None,
            epilogues=epilogues,
            activation_dtypes=acts,
        )
        self._launch_state("gated_delta_net", key, bufs, index_bufs, call, self._delta_args(call, bufs))

    def _delta_args(self, call: P.StateCall, bufs: tuple[Any, ...]) -> tuple[Any, ...]:
        pool, start_rows, dst_rows, q, k, v, g, beta, o, *rest = bufs
        cu_seqlens, A_log, dt_bias = rest if rest else (None, None, None)
        q, k, v, g, beta, o = P.packed_tokens(self, call, q, k, v, g, beta, o)
        snap = dst_rows if call.snap_rows is None else call.snap_rows
        cu = cu_seqlens if call.cu_seqlens is None else call.cu_seqlens
        return (call.shape, pool, start_rows, snap, cu, q, k, v, g, beta, o, A_log, dt_bias)

    # -- linear attention: RWKV-6, RWKV-7, GLA ------------------------------------
    # State blocks are [head_size, head_size] per head; every decay and gate
    # is given in log space (the kernels take exp), as flash-linear-attention
    # takes them.  ggml's kernels take the factor itself (llama.cpp computes
    # exp(-exp(x)) in the graph and passes that): pass its log, -exp(x).  Log
    # space keeps f16/bf16 activations usable: a factor of 0.999 has no bf16
    # neighbours closer than 0.004, its log -1e-3 keeps 3 significant digits.

    def rwkv_wkv6(
        self,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        r: Buffer,
        k: Buffer,
        v: Buffer,
        w: Buffer,
        u: Buffer,
        o: Buffer,
        *,
        n_snap: int = 1,
        plane_stride: int = 0,
        scale: float | None = None,
        cu_seqlens: Buffer | None = None,
    ) -> None:
        """RWKV-6 ("Finch") time mixing, from start rows, with snapshot rows.

        Rows, snapshot columns and the two token forms as described above
        the stateful primitives; per-token shapes for the packed form
        (``H`` heads of ``S`` = head size):

        * ``pool`` [R, H * S * S], storage dtype; per head a block [S, S]
          whose element ``[i, j]`` (j fastest) is ``S[i][j]``, i = key
          index, j = value index: ggml's ``rwkv_wkv6`` state layout, and
          flash-linear-attention's ``[K, V]``.
        * ``r`` (receptance), ``k``, ``v``, ``w`` [T, H, S]: activation
          dtypes, may be strided.  ``w`` is the data-dependent per-key
          log-decay (RWKV-6 computes ``w = -exp(w0 + lora(x))``; ggml is
          passed ``exp(w)``).
        * ``u`` float32 [H, S]: the time-first bonus (``time_faaaa``).
        * ``o`` [T, H, S] contiguous output.
        * ``scale`` multiplies the output (None: 1, as ggml and the RWKV-6
          models; flash-linear-attention's functional default is
          ``S ** -0.5``).

        Per sequence and head, from ``S = pool[start_rows[s]][h]``, for each
        token (ggml ``ggml_compute_forward_rwkv_wkv6_f32``, fla
        ``naive_recurrent_rwkv6``)::

            o[j] = scale * sum_i r[i] * (S[i][j] + u[i] * k[i] * v[j])   # the bonus: this token, undecayed
            S[i][j] = exp(w[i]) * S[i][j] + k[i] * v[j]

        Snapshot column j receives S after n_t(s) - j tokens.
        """
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("rwkv_wkv6", n_snap, plane_stride, scale, id(pool), id(start_rows), id(dst_rows), id(r),
                              id(k), id(v), id(w), id(u), id(o), id(cu_seqlens)), self.caps)  # fmt: skip
            if hit is not None:
                if hit.launch is None:
                    args = (pool, start_rows, dst_rows, r, k, v, w, u, o, cu_seqlens)
                    self._rwkv_wkv6(*self._linear_attn_args(hit.shape, args))
                else:
                    hit.launch()
                return
        given = (pool, start_rows, dst_rows, r, k, v, w, u, o, cu_seqlens)  # held until return: see _tensors_in
        pool, start_rows, dst_rows, r, k, v, w, u, o, cu_seqlens = self._tensors_in(
            "pool* start_rows dst_rows r k v w u o* cu_seqlens", *given
        )
        self._linear_attn_template("rwkv_wkv6", pool, start_rows, dst_rows, (r, k, v, w), u, o, n_snap, plane_stride,
                          scale, cu_seqlens)  # fmt: skip

    def rwkv_wkv7(
        self,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        r: Buffer,
        w: Buffer,
        k: Buffer,
        v: Buffer,
        a: Buffer,
        b: Buffer,
        o: Buffer,
        *,
        n_snap: int = 1,
        plane_stride: int = 0,
        scale: float | None = None,
        cu_seqlens: Buffer | None = None,
    ) -> None:
        """RWKV-7 ("Goose") time mixing, from start rows, with snapshot rows.

        Shapes as :meth:`rwkv_wkv6` (``r``, ``w``, ``k``, ``v``, ``a``,
        ``b``, ``o`` all [T, H, S]; ``w`` the log-decay), except the state
        layout: per head a block [S, S] whose element ``[i, j]`` (j fastest)
        is ``S[i][j]`` with i = **value** index and j = key index, ggml's
        ``rwkv_wkv7`` layout (flash-linear-attention stores the transpose).

        The state update is the generalised delta rule
        ``S = S . (diag(exp(w)) + a^T b) + v^T k``: the diagonal decay plus
        the in-context learning-rate term, where llama.cpp and fla's RWKV-7
        pass ``a = -kk`` and ``b = kk * iclr`` (``kk`` the L2-normalised key,
        ``iclr`` the learning rate in (0, 1)), so that ``S a^T b`` removes
        the part of S along kk at that rate before ``v^T k`` writes the new
        value.  Per sequence and head, for each token (ggml
        ``ggml_compute_forward_rwkv_wkv7_f32``, fla
        ``fused_recurrent_rwkv7``)::

            sa[i] = sum_j a[j] * S[i][j]                       # with the state before this token
            S[i][j] = S[i][j] * exp(w[j]) + sa[i] * b[j] + v[i] * k[j]
            o[i] = scale * sum_j S[i][j] * r[j]               # after the update; scale None: 1

        Snapshot column j receives S after n_t(s) - j tokens.
        """
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("rwkv_wkv7", n_snap, plane_stride, scale, id(pool), id(start_rows), id(dst_rows),
                              id(r), id(w), id(k), id(v), id(a), id(b), id(None), id(o), id(cu_seqlens)),
                             self.caps)  # fmt: skip
            if hit is not None:
                if hit.launch is None:
                    args = (pool, start_rows, dst_rows, r, w, k, v, a, b, None, o, cu_seqlens)
                    self._rwkv_wkv7(*self._linear_attn_args(hit.shape, args))
                else:
                    hit.launch()
                return
        given = (pool, start_rows, dst_rows, r, w, k, v, a, b, o, cu_seqlens)  # held until return: see _tensors_in
        pool, start_rows, dst_rows, r, w, k, v, a, b, o, cu_seqlens = self._tensors_in(
            "pool* start_rows dst_rows r w k v a b o* cu_seqlens", *given
        )
        self._linear_attn_template("rwkv_wkv7", pool, start_rows, dst_rows, (r, w, k, v, a, b), None, o, n_snap,
                          plane_stride, scale, cu_seqlens)  # fmt: skip

    def gated_linear_attn(
        self,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        o: Buffer,
        *,
        n_snap: int = 1,
        plane_stride: int = 0,
        scale: float | None = None,
        cu_seqlens: Buffer | None = None,
    ) -> None:
        """Gated linear attention (GLA, and QRWKV-6) with a per-key gate, from
        start rows, with snapshot rows.

        Shapes and state layout as :meth:`rwkv_wkv6` (``q``, ``k``, ``v``,
        ``g``, ``o`` [T, H, S]; per head ``S[i][j]``, i = key, j = value,
        j fastest: ggml's ``gated_linear_attn`` layout, fla's ``[K, V]``).
        ``g`` is the per-key log-gate (GLA: ``logsigmoid(x) / 16``; ggml is
        passed ``exp(g)``).  Per sequence and head, for each token (ggml
        ``ggml_compute_forward_gla_f32``, fla ``naive_recurrent_gla``)::

            S[i][j] = exp(g[i]) * S[i][j] + k[i] * v[j]
            o[j] = scale * sum_i q[i] * S[i][j]     # after the update; scale None: 1 / sqrt(S)

        Snapshot column j receives S after n_t(s) - j tokens.
        """
        memo = self._launches
        if memo is not None:  # the very Buffers of a remembered call: see LaunchMemo.probe
            hit = memo.probe(("gated_linear_attn", n_snap, plane_stride, scale, id(pool), id(start_rows), id(dst_rows),
                              id(q), id(k), id(v), id(g), id(None), id(o), id(cu_seqlens)), self.caps)  # fmt: skip
            if hit is not None:
                if hit.launch is None:
                    args = (pool, start_rows, dst_rows, q, k, v, g, None, o, cu_seqlens)
                    self._gated_linear_attn(*self._linear_attn_args(hit.shape, args))
                else:
                    hit.launch()
                return
        given = (pool, start_rows, dst_rows, q, k, v, g, o, cu_seqlens)  # held until return: see _tensors_in
        pool, start_rows, dst_rows, q, k, v, g, o, cu_seqlens = self._tensors_in(
            "pool* start_rows dst_rows q k v g o* cu_seqlens", *given
        )
        self._linear_attn_template("gated_linear_attn", pool, start_rows, dst_rows, (q, k, v, g), None, o, n_snap,
                          plane_stride, scale, cu_seqlens)  # fmt: skip

    def _linear_attn_template(
        self,
        op: str,
        pool: Buffer,
        start_rows: Buffer,
        dst_rows: Buffer,
        tokens: tuple[Buffer, ...],
        u: Buffer | None,
        o: Buffer,
        n_snap: int,
        plane_stride: int,
        scale: float | None,
        cu_seqlens: Buffer | None,
    ) -> None:
        """The template of the three linear-attention primitives (memo, validation, capability check)."""
        bufs: tuple[Any, ...] = (pool, start_rows, dst_rows, *tokens, u, o, cu_seqlens)
        key: tuple[Any, ...] = (op, n_snap, plane_stride, scale, *(id(b) for b in bufs))
        index_bufs = (start_rows, dst_rows) if cu_seqlens is None else (start_rows, dst_rows, cu_seqlens)
        hit = self._remembered(key, bufs, index_bufs)
        if hit is not None:
            if hit.launch is None:
                getattr(self, f"_{op}")(*self._linear_attn_args(hit.shape, bufs))
            else:
                hit.launch()
            return
        names = P.LINEAR_ATTN_INPUTS[op]
        if len(tokens) != len(names):  # a bug of the callers above, never a user's
            raise AssertionError(f"{op} takes {names}")
        call = P.check_linear_attn(
            self,
            op,
            pool=pool,
            start_rows=start_rows,
            dst_rows=dst_rows,
            inputs=dict(zip(names, tokens, strict=True)),
            o=o,
            u=u,
            n_snap=n_snap,
            plane_stride=plane_stride,
            cu_seqlens=cu_seqlens,
            scale=scale,
        )
        shp = call.shape
        assert isinstance(shp, P.LinearAttnShape)
        self._require(
            op,
            dtype=pool.dtype,
            n_snap=shp.n_cols,
            strided=not all(t.is_contiguous for t in tokens),
            head_size=shp.head_size,
            varlen=cu_seqlens is not None,
            activation_dtypes=_activations(*(t.dtype for t in tokens), o.dtype),
        )
        self._launch_state(op, key, bufs, index_bufs, call, self._linear_attn_args(call, bufs))

    def _linear_attn_args(self, call: P.StateCall, bufs: tuple[Any, ...]) -> tuple[Any, ...]:
        pool, start_rows, dst_rows, *tokens, u, o, cu_seqlens = bufs
        *tokens, o = P.packed_tokens(self, call, *tokens, o)
        snap = dst_rows if call.snap_rows is None else call.snap_rows
        cu = cu_seqlens if call.cu_seqlens is None else call.cu_seqlens
        extra = (u,) if call.shape.variant == "rwkv6" else ()  # type: ignore[attr-defined]
        return (call.shape, pool, start_rows, snap, cu, *tokens, *extra, o)

    def _launch_state(
        self,
        op: str,
        key: tuple[Any, ...],
        bufs: tuple[Any, ...],
        index_bufs: tuple[Any, ...],
        call: P.StateCall,
        args: tuple[Any, ...],
    ) -> None:
        """Run a validated stateful call, remembering it unless an input was copied."""
        _refuse_pool_overlap(op, bufs)
        impl = getattr(self, f"_{op}")
        if call.copied:
            impl(*args)  # its copy holds this call's data: nothing to remember
            return
        launch = self._remember(key, bufs, index_bufs, call, op, args)
        if launch is None:
            impl(*args)
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
        snap_rows: Buffer,
        cu_seqlens: Buffer,
        x: Buffer,
        weight: Buffer,
        bias: Buffer | None,
        y: Buffer,
        apply_silu: bool,
    ) -> None:
        """The conv in the packed form: ``x``/``y`` [T, ch]; ``snap_rows`` int32
        holding the [n_s, shp.n_cols] table (a 1-D [n_s] buffer when
        n_cols == 1); ``cu_seqlens`` int32 [n_s + 1].  Index buffers are
        contiguous but may have an offset."""

    @abc.abstractmethod
    def _ssm_scan(
        self,
        shp: P.ScanShape,
        pool: Buffer,
        start_rows: Buffer,
        snap_rows: Buffer,
        cu_seqlens: Buffer,
        x: Buffer,
        dt: Buffer,
        A: Buffer,
        B: Buffer,
        C: Buffer,
        y: Buffer,
        D: Buffer | None,
        z: Buffer | None,
        dt_bias: Buffer | None,
    ) -> None:
        """The scan in the packed form (x [T, H, P], dt [T, H], B/C [T, G, N],
        y and z [T, H, P]); ``shp.dt_limit`` is the clamp or None."""

    @abc.abstractmethod
    def _gated_delta_net(
        self,
        shp: P.DeltaShape,
        pool: Buffer,
        start_rows: Buffer,
        snap_rows: Buffer,
        cu_seqlens: Buffer,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        beta: Buffer,
        o: Buffer,
        A_log: Buffer | None,
        dt_bias: Buffer | None,
    ) -> None:
        """The delta rule in the packed form (q/k [T, H_k, S], v/o [T, H_v, S],
        g [T, H_v(, S)], beta [T, H_v]); options and scale are in ``shp``."""

    # Not abstract: a backend written before these primitives existed leaves
    # them out of caps.ops, and the template methods never call them then.
    def _rwkv_wkv6(
        self,
        shp: P.LinearAttnShape,
        pool: Buffer,
        start_rows: Buffer,
        snap_rows: Buffer,
        cu_seqlens: Buffer,
        r: Buffer,
        k: Buffer,
        v: Buffer,
        w: Buffer,
        u: Buffer,
        o: Buffer,
    ) -> None:
        """RWKV-6 in the packed form (r/k/v/w/o [T, H, S], u [H, S]); scale in ``shp``."""
        raise NotImplementedError(f"{self.id} does not implement rwkv_wkv6 (not in caps.ops)")

    def _rwkv_wkv7(
        self,
        shp: P.LinearAttnShape,
        pool: Buffer,
        start_rows: Buffer,
        snap_rows: Buffer,
        cu_seqlens: Buffer,
        r: Buffer,
        w: Buffer,
        k: Buffer,
        v: Buffer,
        a: Buffer,
        b: Buffer,
        o: Buffer,
    ) -> None:
        """RWKV-7 in the packed form (every per-token tensor [T, H, S]); scale in ``shp``."""
        raise NotImplementedError(f"{self.id} does not implement rwkv_wkv7 (not in caps.ops)")

    def _gated_linear_attn(
        self,
        shp: P.LinearAttnShape,
        pool: Buffer,
        start_rows: Buffer,
        snap_rows: Buffer,
        cu_seqlens: Buffer,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        o: Buffer,
    ) -> None:
        """GLA in the packed form (q/k/v/g/o [T, H, S]); scale in ``shp``."""
        raise NotImplementedError(f"{self.id} does not implement gated_linear_attn (not in caps.ops)")


#: Argument names of the primitives relaunched by geometry, in the order of their ``given``
#: (``*``: written); see Device._tensors_in.
_CONV_NAMES = "pool* start_rows dst_rows x weight y* bias cu_seqlens"
_SCAN_NAMES = "pool* start_rows dst_rows x dt A B C y* cu_seqlens D z dt_bias"
_DELTA_NAMES = "pool* start_rows dst_rows q k v g beta o* cu_seqlens A_log dt_bias"

#: Per memo key name, the positions in ``bufs`` of the arguments the
#: primitive writes: where a call matched by geometry must not overlap any
#: other argument.  A primitive missing here is matched by identity only.
_WRITTEN_AT: dict[str, tuple[int, ...]] = {
    "get_rows": (2,),
    "set_rows": (0,),
    "zero_rows": (0,),
    "copy_rows": (2,),
    "ssm_conv": (0, 6),
    "ssm_conv+": (0, 6),
    "ssm_scan": (0, 8),
    "ssm_scan+": (0, 8),
    "gated_delta_net": (0, 8),
    "gated_delta_net+": (0, 8),
    # pool, start_rows, dst_rows, the per-token inputs, u, o, cu_seqlens
    "rwkv_wkv6": (0, 8),
    "rwkv_wkv7": (0, 10),
    "gated_linear_attn": (0, 8),
}


def _geometry_key(key: tuple[Any, ...], bufs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``key`` with the ids of tensor Buffers replaced by their geometry, or
    None when no argument is a tensor."""
    sigs = []
    loose = False
    for buf in bufs:
        geometry = getattr(buf, "_geometry", None)  # (not a Buffer at all: validation names it)
        if geometry is None:
            sigs.append(id(buf))
        else:
            sigs.append(geometry)
            loose = True
    if not loose:
        return None
    return ("by geometry", *key[: len(key) - len(bufs)], *sigs)


def _may_overlap(bufs: tuple[Any, ...], written: tuple[int, ...]) -> bool:
    """Whether a written argument may share bytes with another argument where
    either one is a tensor (native pairs were checked under the same ids)."""
    for w in written:
        out = bufs[w]
        if out is None:
            continue
        out_range = out.byte_range()
        out_native = out._geometry is None
        for j, other in enumerate(bufs):
            if j == w or other is None or (out_native and other._geometry is None):
                continue
            if other is out:
                return True
            r = other.byte_range()
            if out_range is None or r is None or (r[0] < out_range[1] and out_range[0] < r[1]):
                return True  # an unknown address might overlap: validate
    return False


#: The buffers each stateful primitive hands to ``_launch_state``, in order
#: (pool first): the names its overlap errors use.
_STATE_BUFFERS: dict[str, tuple[str, ...]] = {
    "ssm_conv": ("pool", "start_rows", "dst_rows", "x", "weight", "bias", "y", "cu_seqlens"),
    "ssm_scan": ("pool", "start_rows", "dst_rows", "x", "dt", "A", "B", "C", "y", "cu_seqlens", "D", "z", "dt_bias"),
    "gated_delta_net": (
        "pool", "start_rows", "dst_rows", "q", "k", "v", "g", "beta", "o", "cu_seqlens", "A_log", "dt_bias",
    ),
    "rwkv_wkv6": ("pool", "start_rows", "dst_rows", "r", "k", "v", "w", "u", "o", "cu_seqlens"),
    "rwkv_wkv7": ("pool", "start_rows", "dst_rows", "r", "w", "k", "v", "a", "b", "u", "o", "cu_seqlens"),
    "gated_linear_attn": ("pool", "start_rows", "dst_rows", "q", "k", "v", "g", "u", "o", "cu_seqlens"),
}  # fmt: skip


def _refuse_pool_overlap(op: str, bufs: tuple[Any, ...]) -> None:
    """The pool is written while every other argument is read: none may share
    its bytes (tensors over one allocation are caught by address range)."""
    pool = bufs[0]
    for i in range(1, len(bufs)):
        other = bufs[i]
        if other is not None and other is not pool and pool.overlaps(other):
            names = _STATE_BUFFERS.get(op, ())
            name = names[i] if i < len(names) else f"argument {i}"
            raise ArgumentError(name, "overlaps the state pool in memory, which the primitive writes")


class Backend(abc.ABC):
    """A family of devices registered under one name.

    ``name``: the selection name (``"cpu"``).  ``version``: the backend's own
    version string.  ``priority``: larger wins automatic selection when the
    user names nothing.  ``description``: one line for ``statecache backends``.
    ``provided_by``: the distribution or extra that installs it (used in
    error messages).  ``protocol``: the version of the backend protocol its
    devices implement (:data:`PROTOCOL_VERSION`).  It defaults to 1, what
    backends written before the attribute existed implement; a backend whose
    protocol is not this statecache's reports itself unavailable, with the
    reason, and offers no device, so a backend written against other
    primitive signatures is never called with arguments it misreads.
    """

    name: str
    version: str = "0"
    priority: int = 0
    description: str = ""
    provided_by: str = "statecache"
    protocol: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every subclass's availability() and devices() check the protocol
        # first, including those of backends that override both and know
        # nothing of protocols (the registry calls exactly these two).
        super().__init_subclass__(**kwargs)
        for method in ("availability", "devices"):
            impl = cls.__dict__.get(method)
            if impl is not None and not getattr(impl, "_checks_protocol", False):
                setattr(cls, method, _protocol_checked(method, impl))

    def protocol_problem(self) -> str:
        """Why this backend's protocol does not fit this statecache, or ``""``."""
        if self.protocol == PROTOCOL_VERSION:
            return ""
        from statecache import __version__

        return (
            f"backend {self.name!r} implements protocol {self.protocol}, statecache {__version__} needs "
            f"{PROTOCOL_VERSION}; update the backend (see docs/writing-a-backend.md)"
        )

    @abc.abstractmethod
    def availability(self) -> tuple[bool, str]:
        """``(True, "")`` when usable, else ``(False, reason)``.  Must not raise."""

    @abc.abstractmethod
    def devices(self) -> Sequence[Device]:
        """The usable devices, in a stable order (``<name>:0`` first)."""

    def info(self) -> Mapping[str, Any]:
        ok, reason = self.availability()
        return {
            "name": self.name,
            "version": self.version,
            "protocol": self.protocol,
            "available": ok,
            "reason": reason,
        }


def _protocol_checked(method: str, impl: Callable[..., Any]) -> Callable[..., Any]:
    def checked(self: Backend) -> Any:
        problem = self.protocol_problem()
        if problem:
            return (False, problem) if method == "availability" else []
        return impl(self)

    checked.__name__ = impl.__name__
    checked.__qualname__ = getattr(impl, "__qualname__", impl.__name__)
    checked.__doc__ = impl.__doc__
    checked._checks_protocol = True  # type: ignore[attr-defined]
    return checked
