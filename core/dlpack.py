"""DLPack: the C structures (dlpack.h, ABI 1.x) as ctypes, and reading what a
producer exports.

The structures are shared by the backends that export or import buffers
without copies; what a backend puts in the fields (device type, who frees the
memory) stays in that backend.  Reading an export (:func:`describe`) and
naming a tensor's memory cheaply (:func:`fingerprint`) serve
:mod:`statecache.tensor_args`, which lets every primitive take a DLPack
tensor wherever it takes a Buffer.  ctypes is part of the standard library,
and nothing here imports torch: a tensor is used through the DLPack protocol
and, for speed, through methods any torch-like tensor has.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from statecache.dtypes import DType

KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3  # pinned host memory: addressable by the host like kDLCPU
KDL_CUDA_MANAGED = 13

#: DLDataType codes
KDL_INT = 0
KDL_UINT = 1
KDL_FLOAT = 2
KDL_BFLOAT = 4
KDL_COMPLEX = 5
KDL_BOOL = 6

#: DLManagedTensorVersioned.flags bit: the consumer must not write the memory.
DLPACK_FLAG_READ_ONLY = 1

#: Device types whose exports synchronise with a consumer's stream.
STREAM_DEVICE_TYPES = frozenset({KDL_CUDA, KDL_CUDA_MANAGED, 10})  # 10: kDLROCM

#: Device types whose memory the host reads and writes directly.
HOST_DEVICE_TYPES = frozenset({KDL_CPU, KDL_CUDA_HOST})


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """The legacy ("dltensor") capsule payload."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The DLPack 1.x ("dltensor_versioned") capsule payload."""

    _fields_ = [
        ("version_major", ctypes.c_uint32),
        ("version_minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# Private prototypes: setting argtypes on the shared ctypes.pythonapi function
# objects would leak into (and be clobbered by) any other module doing the same.
_capsule_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def capsule_tensor(capsule: Any) -> tuple[DLTensor, int]:
    """The DLTensor of an unconsumed capsule (legacy or versioned) and its
    flags (0 for a legacy capsule).  The capsule keeps ownership: dropping it
    calls the producer's deleter, as the protocol says for unconsumed ones."""
    name = _capsule_name(capsule)
    ptr = _capsule_pointer(capsule, name)
    if name == b"dltensor_versioned":
        managed = DLManagedTensorVersioned.from_address(ptr)
        return managed.dl_tensor, int(managed.flags)
    if name == b"dltensor":
        return DLManagedTensor.from_address(ptr).dl_tensor, 0
    raise BufferError(f"not an unconsumed DLPack capsule: {name!r}")


#: (code, bits) -> NumPy dtype of the element types statecache reads (bf16's
#: is DType.BF16.numpy, looked up when met: it imports ml_dtypes).
_NUMPY_OF_DL: dict[tuple[int, int], np.dtype] = {
    (KDL_FLOAT, 32): np.dtype(np.float32),
    (KDL_FLOAT, 16): np.dtype(np.float16),
    (KDL_INT, 32): np.dtype(np.int32),
    (KDL_INT, 64): np.dtype(np.int64),
}

#: (code, bits) -> the statecache dtype a buffer over that memory has.
_DTYPE_OF_DL: dict[tuple[int, int], DType] = {
    (KDL_FLOAT, 32): DType.F32,
    (KDL_FLOAT, 16): DType.F16,
    (KDL_BFLOAT, 16): DType.BF16,
    (KDL_INT, 32): DType.I32,
}

_CODE_NAMES = {
    KDL_INT: "int",
    KDL_UINT: "uint",
    KDL_FLOAT: "float",
    KDL_BFLOAT: "bfloat",
    KDL_COMPLEX: "complex",
    KDL_BOOL: "bool",
}


class TensorMemory(NamedTuple):
    """What a DLPack producer exported: where one tensor's elements are.

    ``address`` already includes the export's byte offset; ``strides`` are
    in elements (C order when the producer gave none)."""

    address: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    code: int  # DLDataType code
    bits: int
    device_type: int
    device_id: int
    read_only: bool

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The NumPy dtype of the elements, or None for a type statecache never reads."""
        if self.code == KDL_BFLOAT and self.bits == 16:
            return DType.BF16.numpy
        return _NUMPY_OF_DL.get((self.code, self.bits))

    @property
    def dtype(self) -> DType | None:
        """The buffer dtype of the elements (int64 has none: indices are int32 inside)."""
        return _DTYPE_OF_DL.get((self.code, self.bits))

    @property
    def is_integer(self) -> bool:
        """Integer-like elements (bool included): what only index arguments hold."""
        return self.code in (KDL_INT, KDL_UINT, KDL_BOOL)

    @property
    def on_host(self) -> bool:
        return self.device_type in HOST_DEVICE_TYPES

    @property
    def itemsize(self) -> int:
        return max(self.bits // 8, 1)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def span(self) -> int:
        """Elements from the first to one past the last one addressed (0 when empty)."""
        if self.size == 0:
            return 0
        return 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides))

    def byte_range(self) -> tuple[int, int]:
        """``[lo, hi)`` bytes this tensor may touch (empty: ``lo == hi``)."""
        return self.address, self.address + self.span() * self.itemsize

    def type_name(self) -> str:
        if self.code == KDL_BOOL:
            return "bool"
        return f"{_CODE_NAMES.get(self.code, f'code {self.code} ')}{self.bits}"


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def read_tensor(tensor: DLTensor, flags: int = 0) -> TensorMemory:
    ndim = int(tensor.ndim)
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    strides = tuple(int(tensor.strides[i]) for i in range(ndim)) if tensor.strides else _c_strides(shape)
    dtype = tensor.dtype
    if int(dtype.lanes) != 1:
        raise BufferError(f"vector element types (lanes={int(dtype.lanes)}) are not supported")
    return TensorMemory(
        address=int(tensor.data or 0) + int(tensor.byte_offset),
        shape=shape,
        strides=strides,
        code=int(dtype.code),
        bits=int(dtype.bits),
        device_type=int(tensor.device.device_type),
        device_id=int(tensor.device.device_id),
        read_only=bool(flags & DLPACK_FLAG_READ_ONLY),
    )


def exportable(obj: Any) -> Any:
    """``obj``, or the object whose DLPack export reads the same memory.

    A tensor that requires grad refuses DLPack export (torch: "use
    tensor.detach()"), because a consumer cannot record autograd history.
    statecache's primitives are inference kernels that never take part in
    autograd (like any custom kernel run under ``torch.no_grad()``), so the
    detached tensor, which shares the memory and exists only for the export,
    is exactly what they need: parameters that require grad are accepted
    without the caller detaching them."""
    if getattr(obj, "requires_grad", False):
        detach = getattr(obj, "detach", None)
        if callable(detach):
            return detach()
    return obj


def describe(obj: Any, *, stream: int | None = None) -> TensorMemory:
    """Export ``obj`` through DLPack and read where its elements are.

    ``stream`` (CUDA): the stream the consumer will use; the producer makes
    it wait for the producer's pending work (the protocol's synchronisation).
    Raises BufferError (or the producer's own error) when the object cannot
    be exported.  A NumPy array is read from its array interface instead: the
    same facts without a capsule, and bf16 (ml_dtypes), which NumPy cannot
    export through DLPack, included."""
    if isinstance(obj, np.ndarray):
        return _numpy_memory(obj)
    obj = exportable(obj)
    is_neg = getattr(obj, "is_neg", None)
    if callable(is_neg) and is_neg():
        # torch exports such a view's memory as it is, without the sign its
        # values carry, so a kernel reading it would see the wrong numbers.
        raise BufferError(
            "it has torch's negative bit set (a lazy negation view, such as z.conj().imag), so its memory "
            "holds its values without their sign: pass t.resolve_neg()"
        )
    if stream is not None and int(obj.__dlpack_device__()[0]) not in STREAM_DEVICE_TYPES:
        stream = None  # host memory: producers refuse a stream there
    kwargs: dict[str, Any] = {} if stream is None else {"stream": stream}
    try:
        capsule = obj.__dlpack__(max_version=(1, 1), **kwargs)
    except TypeError:  # a producer older than DLPack 1.0 (no max_version)
        capsule = obj.__dlpack__(**kwargs)
    tensor, flags = capsule_tensor(capsule)
    memory = read_tensor(tensor, flags)
    del tensor  # points into the capsule's payload, which the producer frees with it
    return memory


def _numpy_memory(arr: np.ndarray) -> TensorMemory:
    dtype = arr.dtype
    if dtype.name == "bfloat16" and dtype == DType.BF16.numpy:  # the name first: no ml_dtypes import
        code = KDL_BFLOAT
    else:
        code = {"f": KDL_FLOAT, "i": KDL_INT, "u": KDL_UINT, "b": KDL_BOOL}.get(dtype.kind, -1)
    item = dtype.itemsize
    if code < 0 or any(s % item for s in arr.strides):
        raise BufferError(f"NumPy dtype {dtype} (strides {arr.strides}) has no DLPack equivalent")
    return TensorMemory(
        address=int(arr.__array_interface__["data"][0]),
        shape=tuple(int(n) for n in arr.shape),
        strides=tuple(int(s) // item for s in arr.strides),
        code=code,
        bits=8 * item,
        device_type=KDL_CPU,
        device_id=0,
        read_only=not arr.flags.writeable,
    )


class _HostMemory:
    """An ``__array_interface__`` over an address: NumPy makes a view of it
    without a copy and without owning the memory (keeps only this object)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], typestr: str) -> None:
        self.__array_interface__ = {
            "data": (address, False),
            "shape": shape,
            "strides": strides,
            "typestr": typestr,
            "version": 3,
        }


#: Element types the array interface names directly.
_TYPESTR = {np.dtype(np.float32): "<f4", np.dtype(np.float16): "<f2", np.dtype(np.int32): "<i4"}

#: Plain element types NumPy's array interface names by size (bf16 is read as
#: uint16 and relabelled: the same bits).
_TYPESTR_BY_SIZE = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def host_array(memory: TensorMemory, dtype: np.dtype | None = None) -> np.ndarray:
    """A writable NumPy view (no copy, no ownership) of host memory.

    The view does not keep the memory alive: use it only while the tensor
    that exported it is."""
    npd = dtype if dtype is not None else memory.numpy_dtype
    if npd is None:
        raise BufferError(f"no NumPy dtype for {memory.type_name()}")
    if memory.span() == 0 or memory.address == 0:
        return np.empty(memory.shape, dtype=npd)
    item = npd.itemsize
    strides = tuple(s * item for s in memory.strides)
    raw = np.asarray(_HostMemory(memory.address, memory.shape, strides, _TYPESTR_BY_SIZE[item]))
    return raw.view(npd)


def host_flat(memory: TensorMemory, dtype: np.dtype) -> np.ndarray:
    """The host memory a tensor addresses as one flat array of ``dtype``
    (``memory.span()`` elements from its first element; no copy, no ownership):
    the storage of a host buffer over it, whose shape and strides are the tensor's."""
    span = memory.span()
    if span == 0 or memory.address == 0:
        return np.empty(span, dtype=dtype)
    typestr = _TYPESTR.get(dtype)
    if typestr is not None:  # named directly: no relabelling view (this runs per new tensor address)
        return np.asarray(_HostMemory(memory.address, (span,), (dtype.itemsize,), typestr))
    return np.asarray(_HostMemory(memory.address, (span,), (dtype.itemsize,), _TYPESTR_BY_SIZE[dtype.itemsize])).view(
        dtype
    )


# -- fingerprints -----------------------------------------------------------------
#
# A fingerprint names a tensor's memory and geometry (type, data address,
# shape, strides, element type, device; always in that order, the address
# second) without exporting it: a decode step
# passes fresh activation tensors every call, at the addresses the caching
# allocator handed out the step before, and a DLPack export costs several
# microseconds.  Torch-like tensors (``data_ptr()``, ``stride()``, ``shape``,
# ``dtype``, ``device``) and NumPy arrays are read directly; any other
# producer is exported every call.  The first export of each type is compared
# with its direct reading, and a type whose methods disagree with its own
# export is never read directly again.

Fingerprint = tuple[Any, ...]


# ``is_neg()``: torch exports a lazy negation view's memory as it is, without
# the sign its values carry, so such a view must never pass for the tensor whose
# memory (and so whose address, shape and strides) it shares; describe() refuses it.
def torch_like(obj: Any) -> Fingerprint:
    return (type(obj), obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_neg())


def _torch_like_without_neg(obj: Any) -> Fingerprint:
    """A producer with torch's methods but no ``is_neg`` (no negation views)."""
    return (type(obj), obj.data_ptr(), obj.shape, obj.stride(), obj.dtype, obj.device)


def _numpy_like(obj: Any) -> Fingerprint:
    iface = obj.__array_interface__
    return (type(obj), iface["data"][0], obj.shape, obj.strides, obj.dtype, obj.flags.writeable)


def export_fingerprint(obj: Any, stream: int | None = None) -> Fingerprint:
    """The fingerprint of a producer read by exporting it (every call: the
    export is also the protocol's synchronisation with ``stream``)."""
    memory = describe(obj, stream=stream)
    return (type(obj), memory.address, memory)


def _not_a_tensor(obj: Any) -> None:
    return None


#: How many types read directly were found to disagree with their own export
#: (:func:`confirm_fingerprint`); a change tells whoever remembered direct
#: readings of a type (:class:`statecache.tensor_args.Relaunches`) to forget them.
DEMOTIONS = [0]

#: type -> how its fingerprint is read (``_not_a_tensor`` for types without ``__dlpack__``;
#: ``export_fingerprint`` for producers read by exporting them, which a caller
#: with a stream to synchronise with calls with that stream).
READERS: dict[type, Callable[[Any], Fingerprint | None]] = {}


def reader_for(cls: type) -> Callable[[Any], Fingerprint | None]:
    """How fingerprints of ``cls`` instances are read (decided once per type)."""
    reader = READERS.get(cls)
    if reader is not None:
        return reader
    if not callable(getattr(cls, "__dlpack__", None)):
        reader = _not_a_tensor
    elif all(callable(getattr(cls, m, None)) for m in ("data_ptr", "stride")) and all(
        hasattr(cls, a) for a in ("shape", "dtype", "device")
    ):
        reader = torch_like if callable(getattr(cls, "is_neg", None)) else _torch_like_without_neg
    elif isinstance(getattr(cls, "__array_interface__", None), property) or issubclass(cls, np.ndarray):
        reader = _numpy_like
    else:
        reader = export_fingerprint
    READERS[cls] = reader
    return reader


def exported_memory(fp: Fingerprint) -> TensorMemory | None:
    """The export a fingerprint was made from, for producers that are exported
    on every call (None for those read directly)."""
    memory = fp[2] if len(fp) == 3 else None
    return memory if type(memory) is TensorMemory else None


def fingerprint(obj: Any) -> Fingerprint | None:
    """A hashable name of the memory ``obj`` exports: equal fingerprints mean
    the same address, shape, strides, element type and device (None: ``obj``
    does not speak DLPack)."""
    return reader_for(type(obj))(obj)


def torch_geometry(obj: Any) -> tuple[Fingerprint, int]:
    return (type(obj), obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_neg()), obj.data_ptr()


def _torch_geometry_without_neg(obj: Any) -> tuple[Fingerprint, int]:
    return (type(obj), obj.shape, obj.stride(), obj.dtype, obj.device), obj.data_ptr()


def _numpy_geometry(obj: Any) -> tuple[Fingerprint, int]:
    return (type(obj), obj.shape, obj.strides, obj.dtype, obj.flags.writeable), obj.__array_interface__["data"][0]


#: The readers of types read directly, split: ``(geometry, address)``, the
#: geometry being the fingerprint without its address (what a call validated
#: once in that geometry depends on), for :class:`statecache.tensor_args.Relaunches`.
_SPLIT_READERS: dict[Callable[[Any], Fingerprint | None], Callable[[Any], tuple[Fingerprint, int]]] = {
    torch_like: torch_geometry,
    _torch_like_without_neg: _torch_geometry_without_neg,
    _numpy_like: _numpy_geometry,
}


def geometry_reader(cls: type) -> Callable[[Any], tuple[Fingerprint, int]] | None:
    """How ``(geometry, address)`` of a ``cls`` instance is read, or None for
    types that are not read directly (exported on every call, or not tensors).
    Follows :func:`reader_for`, including a type demoted by
    :func:`confirm_fingerprint`."""
    reader = READERS.get(cls)
    if reader is None:
        reader = reader_for(cls)
    return _SPLIT_READERS.get(reader)


def confirm_fingerprint(obj: Any, fp: Fingerprint, memory: TensorMemory) -> bool:
    """Whether a direct reading ``fp`` agrees with the export ``memory``; a type
    that disagrees is exported on every call from then on."""
    reader = READERS.get(type(obj))
    if reader is None or reader is export_fingerprint:
        return True
    address, shape, strides = fp[1], tuple(fp[2]), tuple(fp[3])
    if reader is _numpy_like:  # NumPy strides are in bytes
        item = memory.itemsize
        strides = tuple(s // item if s % item == 0 else -1 for s in strides)
    # The stride of an axis of length 1 is free: producers report it differently.
    ok = address == memory.address and shape == memory.shape
    ok = ok and all(a == b for n, a, b in zip(shape, strides, memory.strides) if n != 1)
    if not ok:
        READERS[type(obj)] = export_fingerprint
        DEMOTIONS[0] += 1
    return ok


# -- the DLPack C exchange API ------------------------------------------------------
#
# A torch tensor's five facts read through Python cost about 0.6 us per tensor
# (``shape``, ``stride()``, ``dtype``, ``device``, ``data_ptr()``: one call and
# one object each); a relaunch of a decode step reads nine.  DLPack 1.2+
# producers publish C functions on the type (``__dlpack_c_exchange_api__``, a
# capsule), one of which fills a DLTensor from the object without an export.
# A backend with compiled code can read every tensor of a call through it in
# one C call (:class:`ExchangeReader`); the geometry compared is the DLTensor's.

#: DLPackExchangeAPI, in pointer-sized words: the header (version: two uint32, prev_api), then
#: managed_tensor_allocator, managed_tensor_from_py_object_no_sync, managed_tensor_to_py_object_no_sync,
#: dltensor_from_py_object_no_sync (this word), current_work_stream.
_DLTENSOR_FROM_PY_SLOT = 5
_EXCHANGE_API_NAME = b"dlpack_exchange_api"

#: cls -> address of its producer's ``dltensor_from_py_object_no_sync`` (0: none usable).
_EXCHANGE_FUNCTIONS: dict[type, int] = {}


def exchange_function(cls: type) -> int:
    """The address of ``cls``'s ``dltensor_from_py_object_no_sync`` (DLPack
    C exchange API, major version 1), or 0 when ``cls`` publishes none."""
    found = _EXCHANGE_FUNCTIONS.get(cls)
    if found is not None:
        return found
    address = 0
    capsule = getattr(cls, "__dlpack_c_exchange_api__", None)
    if capsule is not None:
        try:
            if _capsule_name(capsule) == _EXCHANGE_API_NAME:
                api = _capsule_pointer(capsule, _EXCHANGE_API_NAME)
                if api and (ctypes.c_uint32 * 2).from_address(api)[0] == 1:
                    words = (ctypes.c_void_p * (_DLTENSOR_FROM_PY_SLOT + 1)).from_address(api)
                    address = words[_DLTENSOR_FROM_PY_SLOT] or 0
        except (TypeError, ValueError, OSError):  # not a capsule (ctypes refuses it): none usable
            address = 0
    _EXCHANGE_FUNCTIONS[cls] = address
    return address


#: dlpack.h DLDataType word (code | bits << 8 | lanes << 16) of the dtypes a float Buffer has.
_DTYPE_WORD = {
    DType.F32: KDL_FLOAT | 32 << 8 | 1 << 16,
    DType.F16: KDL_FLOAT | 16 << 8 | 1 << 16,
    DType.BF16: KDL_BFLOAT | 16 << 8 | 1 << 16,
}


class ExchangeReader:
    """Compiled readers of tensors through the DLPack C exchange API: a
    backend's ``read(obj, function)`` and ``match(given, plan)`` builtins
    (see backends/cpu/sc_dlpack.c for what they take and return), and
    optionally its ``launch(given, plan, fixed, shadows, block, n_threads)``:
    the match, then the call prepared in ``block`` (a backend's own layout)
    run with the addresses found, in one call (True, or match's None / False
    with nothing done)."""

    __slots__ = ("_launch", "_match", "_read")

    def __init__(
        self,
        read: Callable[[Any, int], tuple[int, ...] | None],
        match: Callable[..., Any],
        launch: Callable[..., bool | None] | None = None,
    ) -> None:
        self._read = read
        self._match = match
        self._launch = launch

    @property
    def launches(self) -> bool:
        """Whether the backend's ``launch`` is there (plans then carry it)."""
        return self._launch is not None

    def reading(self, obj: Any) -> tuple[int, ...] | None:
        """``obj``'s reading (address, ndim, dtype word, device word, shape...,
        strides...), or None when its type publishes no usable exchange API or
        the producer refuses it."""
        function = exchange_function(type(obj))
        return self._read(obj, function) if function else None

    def plan(
        self,
        given: tuple[Any, ...],
        positions: list[int],
        buffers: list[Any],
        align: int,
        tensor_pairs: tuple[tuple[int, int, int, int], ...],
        fixed_pairs: tuple[tuple[int, int, int], ...],
    ) -> Plan | None:
        """A plan matching the tensors at ``positions`` of a call like
        ``given`` (validated with the Buffers ``buffers`` over them), then
        checking their addresses against ``align`` (a mask) and the overlap
        pairs (as ``statecache.tensor_args._Relaunch`` has them); or None when
        one of them cannot be read in C, or its reading does not describe
        exactly the memory its Buffer was validated over."""
        words: list[int] = [len(positions)]
        for pos, buf in zip(positions, buffers):
            obj = given[pos]
            reading = self.reading(obj)
            if reading is None:
                return None
            address, ndim, dtype, device = reading[:4]
            shape, strides = reading[4 : 4 + ndim], reading[4 + ndim :]
            rng = buf.byte_range()
            if (
                rng is None
                or (address != rng[0] and buf.size != 0)
                or shape != tuple(buf.shape)
                or dtype != _DTYPE_WORD.get(buf.dtype)
                or any(n != 1 and a != b for n, a, b in zip(shape, strides, buf.strides))
            ):
                return None  # (a producer whose C reading and export disagree: the Python path)
            words += [pos, id(type(obj)), exchange_function(type(obj)), ndim, dtype, device, *shape, *strides]
        words += [align, len(tensor_pairs), *(w for pair in tensor_pairs for w in pair)]
        words += [len(fixed_pairs), *(w for pair in fixed_pairs for w in pair)]
        words_bytes = np.array(words, np.int64).tobytes()
        return Plan(self._match, words_bytes, [type(given[p]) for p in positions], self._launch)


class Plan:
    """One call's tensors to match in C (:meth:`ExchangeReader.plan`)."""

    __slots__ = ("_keep", "launch", "match", "words")

    def __init__(
        self,
        match: Callable[..., Any],
        words: bytes,
        types: list[type],
        launch: Callable[..., bool | None] | None = None,
    ) -> None:
        # match(given, words[, fixed, shadows]): the tensors' addresses (a list), None (another
        # geometry, or a fixed position holding another object), or False (the geometry, but
        # misaligned, overlapping, or an index Buffer whose host copy changed)
        self.match = match
        self.words = words
        # launch(given, words, fixed, shadows, block, n_threads): match, then run the call
        # prepared in block (True); None or False as match, nothing done.  None: no launch.
        self.launch = launch
        self._keep = types  # the plan holds their addresses: they must outlive it
