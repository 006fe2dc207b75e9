"""CUDA device: nvcc-built kernels loaded with cffi in ABI mode.

Buffers are plain device memory from ``cudaMalloc`` (never managed memory),
wrapped in :class:`CudaBuffer`, which exposes ``__cuda_array_interface__``
and ``__dlpack__`` so torch and CuPy see them without a copy.  CUDA tensors
(DLPack, device memory of this GPU) are taken as primitive arguments without
a copy (:meth:`CudaDevice._import_memory`).

Streams.  Every copy and launch is asynchronous on the stream current when
it is queued (:attr:`CudaDevice.launch_stream`): the one of an enclosing
``with device.use_stream(s):``, else, once torch has initialised CUDA in
this process, torch's current stream on this GPU (so statecache's kernels
order with the runtime's torch ops exactly as another torch op would, and a
``torch.cuda.graph`` capture records them), else the device's own
non-blocking stream.  :meth:`CudaDevice.synchronize` waits for every stream
used since the last one.  Nothing a steady decode step does allocates or
copies through the host (index buffers, derived tables and prepared launches
are reused), so such a step can be captured in a CUDA graph; work that would
break a capture (allocation, host copies, synchronisation) is refused with a
clear error while the launch stream is capturing.

The cdef is derived from ``statecache_cuda.h`` itself, so the header is the
one description of the ABI; the library's ABI version and struct sizes are
checked when it is loaded, and a test checks every symbol and field offset.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from statecache import __version__
from statecache.backend import (
    PRIMITIVES,
    PROTOCOL_VERSION,
    Backend,
    Buffer,
    Caps,
    Device,
    DeviceKind,
    Support,
)
from statecache.backends.cuda import build
from statecache.dlpack import DLDataType, DLDevice, DLTensor, TensorMemory
from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.errors import StatecacheError
from statecache.primitives import ACTIVATION_DTYPES, EPILOGUES, L2NORM_EPS

#: The ABI this Python code speaks; the library must report the same.
ABI_VERSION = 3

#: Storage dtype codes of the header.
DTYPE_CODES: dict[DType, int] = {DType.F32: 0, DType.F16: 1, DType.BF16: 2}

#: Argument structs whose size is checked at load time.
STRUCTS = (
    "statecache_cuda_view",
    "statecache_cuda_state_args",
    "statecache_cuda_conv_args",
    "statecache_cuda_scan_args",
    "statecache_cuda_delta_args",
    "statecache_cuda_linear_attn_args",
)

#: Variant codes of statecache_cuda_linear_attn_args, by the shape's variant.
LINEAR_ATTN_VARIANTS = {"rwkv6": 0, "rwkv7": 1, "gla": 2}


class CudaError(StatecacheError):
    """A CUDA runtime call or kernel launch failed (status and text included)."""


class AbiMismatchError(StatecacheError):
    """The loaded library was built for another ABI version or struct layout."""


def header_cdef(header: Path | None = None) -> str:
    """The header as cffi cdef text: comments, preprocessor lines and the
    ``extern "C"`` guard removed, declarations kept verbatim."""
    text = (header or build.PACKAGE_DIR / build.HEADER).read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#ifdef __cplusplus"):
            skipping = True
            continue
        if stripped.startswith("#"):
            if stripped.startswith("#endif"):
                skipping = False
            continue
        if not skipping:
            out.append(line)
    return "\n".join(out)


def declared_functions(cdef: str) -> list[str]:
    """Names of the functions a cdef declares (every one must be exported)."""
    return sorted(set(re.findall(r"\b(statecache_cuda_\w+)\s*\(", cdef)))


@dataclasses.dataclass
class Runtime:
    """A loaded library: the cffi handle plus small helpers."""

    ffi: Any
    lib: Any
    path: Path

    def error_text(self, status: int) -> str:
        return self.ffi.string(self.lib.statecache_cuda_error_string(int(status))).decode(errors="replace")

    def check(self, status: int, what: str) -> None:
        if status:
            raise CudaError(f"{what}: {self.error_text(status)} (status {status})")

    def device_count(self) -> tuple[int, int]:
        """(count, status): status is the cudaGetDeviceCount error, 0 if none."""
        count = self.ffi.new("int *")
        status = int(self.lib.statecache_cuda_device_count(count))
        return (int(count[0]) if status == 0 else 0), status


def load_library(path: str | Path) -> Runtime:
    """dlopen the library and refuse it unless its ABI matches ours.

    Loading calls nothing in the CUDA driver, so it works on machines
    without a GPU (the tests rely on that)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(header_cdef())
    lib = ffi.dlopen(str(path))
    got = int(lib.statecache_cuda_abi_version())
    if got != ABI_VERSION:
        raise AbiMismatchError(f"{path} implements ABI version {got}; this statecache needs {ABI_VERSION}")
    for name in STRUCTS:
        size = int(lib.statecache_cuda_layout(name.encode()))
        if size != ffi.sizeof(name):
            raise AbiMismatchError(f"{path}: sizeof({name}) is {size} in the library, {ffi.sizeof(name)} in the cdef")
    return Runtime(ffi, lib, Path(path))


# -- DLPack ---------------------------------------------------------------------
# Plain ctypes: a capsule's deleter is a C function pointer, and ctypes keeps
# the GIL rules simple (callbacks take the GIL).

KDL_CPU = 1
KDL_CUDA = 2
_DL_CODES = {DType.F32: (2, 32), DType.F16: (2, 16), DType.BF16: (4, 16), DType.I32: (0, 32)}


class _DLManagedTensor(ctypes.Structure):
    pass


_DL_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DL_DELETER)]

# Exported tensors by address: the struct, its shape/strides arrays and the
# buffer, kept alive until the consumer calls the deleter.
_DL_LIVE: dict[int, tuple[Any, ...]] = {}
_DL_LOCK = threading.Lock()


@_DL_DELETER
def _dl_deleter(managed: Any) -> None:
    with _DL_LOCK:
        _DL_LIVE.pop(ctypes.cast(managed, ctypes.c_void_p).value or 0, None)


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Private prototypes: setting argtypes on the shared ctypes.pythonapi function
# objects would leak into (and be clobbered by) any other module doing the same.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


@_CAPSULE_DESTRUCTOR
def _capsule_destructor(capsule: int) -> None:
    # A consumer renames the capsule to "used_dltensor" and owns the deleter
    # call; a capsule that was never consumed still holds our tensor.
    if _capsule_is_valid(capsule, b"dltensor"):
        address = _capsule_pointer(capsule, b"dltensor")
        with _DL_LOCK:
            _DL_LIVE.pop(address, None)


def _dlpack_capsule(buf: Buffer, data_ptr: int, device_type: int, device_id: int) -> Any:
    code, bits = _DL_CODES[buf.dtype]
    shape = (ctypes.c_int64 * max(buf.ndim, 1))(*buf.shape)
    strides = (ctypes.c_int64 * max(buf.ndim, 1))(*buf.strides)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = data_ptr
    managed.dl_tensor.device = DLDevice(device_type, device_id)
    managed.dl_tensor.ndim = buf.ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, 1)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _dl_deleter
    address = ctypes.addressof(managed)
    with _DL_LOCK:
        _DL_LIVE[address] = (managed, shape, strides, buf)
    return _capsule_new(address, b"dltensor", _capsule_destructor)


def dlpack_live_count() -> int:
    """Exported tensors not yet released (tests check nothing leaks)."""
    with _DL_LOCK:
        return len(_DL_LIVE)


# -- memory ---------------------------------------------------------------------


class Allocation:
    """One cudaMalloc block; freed when the last Buffer (or export) lets go."""

    __slots__ = ("__weakref__", "device_index", "nbytes", "ptr", "runtime")

    def __init__(self, runtime: Runtime, device_index: int, nbytes: int) -> None:
        self.runtime = runtime
        self.device_index = device_index
        self.nbytes = nbytes
        out = runtime.ffi.new("void **")
        runtime.check(runtime.lib.statecache_cuda_set_device(device_index), "cudaSetDevice")
        runtime.check(runtime.lib.statecache_cuda_malloc(out, nbytes), f"cudaMalloc({nbytes} bytes)")
        self.ptr = int(runtime.ffi.cast("uintptr_t", out[0]))

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                self.runtime.lib.statecache_cuda_set_device(self.device_index)
                self.runtime.lib.statecache_cuda_free(self.runtime.ffi.cast("void *", ptr))
            except Exception:  # interpreter shutdown: the process frees it anyway
                pass


class ForeignMemory:
    """Device memory another library owns (a tensor's, imported through
    DLPack): never freed here, and never kept alive by the Buffers over it."""

    __slots__ = ("__weakref__", "nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes


#: Bytes of upload sources and launch temporaries kept alive before a forced synchronize.
_MAX_PENDING_HOST_BYTES = 64 << 20

_TYPESTR = {DType.F32: "<f4", DType.F16: "<f2", DType.I32: "<i4"}


class CudaBuffer(Buffer):
    """A Buffer over device memory, visible to torch / CuPy without copies."""

    __slots__ = ()

    def data_ptr(self) -> int:
        """Address of the first element (the view's offset included)."""
        return int(self.storage.ptr) + self.offset * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 of Numba's CUDA Array Interface.  ``stream`` is the
        device's launch stream: a consumer synchronizes with it before reading.
        bf16 has no typestr in the interface; use ``__dlpack__`` for it."""
        if self.dtype not in _TYPESTR:
            raise AttributeError(f"{self.dtype} has no __cuda_array_interface__ typestr; use __dlpack__")
        self.mark_exported()  # the kernels read indices from device memory, which the consumer may write
        device: CudaDevice = self.device  # type: ignore[assignment]
        itemsize = self.dtype.itemsize
        return {
            "shape": self.shape,
            "typestr": _TYPESTR[self.dtype],
            "data": (self.data_ptr(), False),
            "strides": None if self.is_contiguous else tuple(s * itemsize for s in self.strides),
            "version": 3,
            "stream": device.exchange_stream(),
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        device: CudaDevice = self.device  # type: ignore[assignment]
        return device.dlpack_device_type, device.index

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A legacy ("dltensor") DLPack capsule over this memory, no copy.

        Every queued write to the buffer is finished before the capsule is
        handed out (unless ``stream == -1``, the consumer's "no sync")."""
        if copy:
            raise BufferError("statecache CUDA buffers are exported without copying (copy=True unsupported)")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"buffer lives on {self.__dlpack_device__()}, not on {tuple(dl_device)}")
        if stream != -1:
            self.device.synchronize()
        self.mark_exported()  # the kernels read indices from device memory, which the consumer may write
        device_type, device_id = self.__dlpack_device__()
        return _dlpack_capsule(self, self.data_ptr(), device_type, device_id)


# -- device ---------------------------------------------------------------------


def _view(runtime: Runtime, view: Any, buf: Buffer | None) -> None:
    """Fill a statecache_cuda_view from a buffer (any strides); None leaves it NULL."""
    if buf is None:
        return
    assert isinstance(buf, CudaBuffer)
    view.data = runtime.ffi.cast("const float *", buf.data_ptr())
    view.strides = list(buf.strides) + [0] * (4 - buf.ndim)
    view.dtype = DTYPE_CODES[buf.dtype]


def stream_handle_of(stream: Any) -> int:
    """A ``cudaStream_t`` as an int, from an int or a stream object: torch's
    (``cuda_stream``), CuPy's (``ptr``) or one with ``__cuda_stream__()``
    (the CUDA Python protocol, returning ``(version, handle)``)."""
    if isinstance(stream, int):
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if callable(protocol):
        return int(protocol()[1])
    for attr in ("cuda_stream", "ptr", "handle"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"not a CUDA stream: {type(stream).__name__} (pass a cudaStream_t as an int or a stream object)")


def _torch_stream_getter() -> Callable[[int], int] | None:
    """Torch's current raw stream per device index, once torch has initialised
    CUDA in this process (looked up, never imported: statecache does not
    need torch); None before that."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return None
    except Exception:  # a half-imported or stubbed torch: behave as without torch
        return None
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # type: ignore[union-attr]
    if callable(raw):
        return raw  # type: ignore[no-any-return]  # (device index) -> cudaStream_t as int, no Stream object

    def current(index: int) -> int:
        return int(cuda.current_stream(index).cuda_stream)

    return current


class CudaDevice(Device):
    """One CUDA GPU.  Launches are asynchronous, on the stream current when
    they are queued (see the module doc and :attr:`launch_stream`)."""

    dlpack_device_type = KDL_CUDA

    def __init__(self, runtime: Runtime, index: int) -> None:
        self.runtime = runtime
        self.index = index
        self.id = f"cuda:{index}"
        self.backend_name = "cuda"
        self.kind = DeviceKind.GPU
        ffi, lib = runtime.ffi, runtime.lib
        name = ffi.new("char[256]")
        total = ffi.new("size_t *")
        major, minor, sms = ffi.new("int *"), ffi.new("int *"), ffi.new("int *")
        runtime.check(lib.statecache_cuda_device_info(index, name, 256, total, major, minor, sms), "device info")
        self.name = ffi.string(name).decode(errors="replace")
        self.memory_bytes: int | None = int(total[0])
        self.compute_capability = (int(major[0]), int(minor[0]))
        self.multiprocessors = int(sms[0])
        self._activate()
        stream = ffi.new("void **")
        runtime.check(lib.statecache_cuda_stream_create(stream), "cudaStreamCreateWithFlags")
        self._stream = stream[0]
        self.stream_handle = int(ffi.cast("uintptr_t", self._stream))
        self._init_streams()
        self.caps = self._caps()
        # Host sources of queued uploads and device temporaries of queued
        # launches: both must outlive the work that reads them, so they are
        # released at synchronize() (freeing device memory early would rely on
        # cudaFree happening to synchronize, which pools and cudaFreeAsync do not).
        self._pending_host: list[Any] = []
        self._pending_bytes = 0

    def _caps(self) -> Caps:
        return Caps(
            ops=frozenset(PRIMITIVES),
            storage_dtypes=STORAGE_DTYPES,
            max_snapshots=64,
            strided_inputs=True,
            host_visible=False,
            async_launch=True,
            varlen=True,
            activation_dtypes=ACTIVATION_DTYPES,
            epilogues=frozenset(EPILOGUES),
        )

    @property
    def properties(self) -> dict[str, Any]:
        props = super().properties
        props.update(
            compute_capability=".".join(map(str, self.compute_capability)),
            multiprocessors=self.multiprocessors,
            library=str(self.runtime.path),
        )
        return props

    def _activate(self) -> None:
        self.runtime.check(self.runtime.lib.statecache_cuda_set_device(self.index), f"cudaSetDevice({self.index})")

    # -- streams ------------------------------------------------------------------
    def _init_streams(self) -> None:
        #: Follow torch's current stream once torch has initialised CUDA (see the module doc).
        self.follow_torch_stream = True
        self._local = threading.local()  # .streams: this thread's use_stream() stack
        self._torch_stream: Callable[[int], int] | None = None
        self._stream_ptrs: dict[int, Any] = {}  # handle -> cffi void *, cast once
        self._used_streams: dict[int, Any] = {}  # handle -> pointer, queued on since the last synchronize
        self._capture_flag = self.runtime.ffi.new("int *")

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Queue this thread's work on this device to ``stream`` inside the
        block (a ``cudaStream_t`` as an int, ``torch.cuda.Stream``, a CuPy
        stream ...).  The caller orders it with the producers of the tensors
        it passes, as for any work on a stream of its own."""
        handle = stream_handle_of(stream)
        stack = self._local.__dict__.setdefault("streams", [])
        stack.append(handle)
        try:
            yield
        finally:
            stack.pop()

    @property
    def launch_stream(self) -> int:
        """The ``cudaStream_t`` (an int; 0 is the legacy default stream) that
        work queued now goes to: ``use_stream``'s, else torch's current one
        (``follow_torch_stream``, once torch has initialised CUDA), else the
        device's own."""
        return int(self._stream_now()[0])

    def _stream_now(self) -> tuple[int, Any]:
        stack = getattr(self._local, "streams", None)
        if stack:
            handle = stack[-1]
        else:
            getter = self._torch_stream
            if getter is None and self.follow_torch_stream:
                getter = self._torch_stream = _torch_stream_getter()
            if getter is None or not self.follow_torch_stream:
                return self.stream_handle, self._stream
            handle = int(getter(self.index))
        ptr = self._stream_ptrs.get(handle)
        if ptr is None:
            ptr = self._stream_ptrs[handle] = self.runtime.ffi.cast("void *", handle)
        return handle, ptr

    def exchange_stream(self) -> int | None:
        """The launch stream as the exchange protocols number it (DLPack's
        ``stream`` and the CUDA Array Interface's: 1 is the legacy default,
        0 is not allowed), None where the memory is not CUDA's."""
        if self.dlpack_device_type != KDL_CUDA:
            return None
        handle = self.launch_stream
        return 1 if handle == 0 else handle

    def _dlpack_stream(self) -> int | None:
        return self.exchange_stream()

    def _capturing(self, stream: Any) -> bool:
        flag = self._capture_flag
        status = self.runtime.lib.statecache_cuda_stream_is_capturing(stream, flag)
        return status == 0 and bool(flag[0])

    def _refuse_while_capturing(self, what: str) -> None:
        handle, ptr = self._stream_now()
        if self._capturing(ptr):
            raise CudaError(
                f"{self.id}: cannot {what} while stream {handle:#x} is being captured into a CUDA graph "
                "(it would be recorded, or break the capture): do it before the capture begins"
            )

    def _launch(self, op: str, *args: Any) -> None:
        """Queue entry point ``statecache_cuda_<op>`` on the launch stream."""
        self._activate()
        handle, stream = self._stream_now()
        self._used_streams[handle] = stream
        status = getattr(self.runtime.lib, f"statecache_cuda_{op}")(*args, stream)
        self.runtime.check(status, op)

    def _ptr(self, buf: Buffer, ctype: str = "void *") -> Any:
        assert isinstance(buf, CudaBuffer)
        return self.runtime.ffi.cast(ctype, buf.data_ptr())

    def _rows_ptr(self, rows: Buffer, host: np.ndarray) -> tuple[Any, Any]:
        """Pointer to contiguous int32 indices; a strided index view is
        re-uploaded (the returned buffer must live until the launch is queued)."""
        if rows.is_contiguous:
            return self._ptr(rows, "const int32_t *"), rows
        tmp = self.indices(host)
        self._keep_until_synchronized(tmp, tmp.nbytes)
        return self._ptr(tmp, "const int32_t *"), tmp

    # -- capabilities -----------------------------------------------------------
    def supports(self, op: str, **params: Any) -> Support:
        limit = int(self.runtime.lib.statecache_cuda_max_state_dim())
        for key in ("d_state", "head_size"):
            value = params.get(key)
            if value is not None and int(value) > limit:
                return Support(False, f"{self.id} handles {key} up to {limit}, got {value}")
        d_conv = params.get("d_conv")
        max_d_conv = int(self.runtime.lib.statecache_cuda_max_d_conv())
        if d_conv is not None and int(d_conv) > max_d_conv:
            return Support(False, f"{self.id} handles d_conv up to {max_d_conv}, got {d_conv}")
        return super().supports(op, **params)

    # -- memory -----------------------------------------------------------------
    def _import_memory(self, memory: TensorMemory, dtype: DType) -> Buffer | None:
        """CUDA tensors on this GPU: a buffer over their device memory (no copy,
        not kept alive).  Host tensors are copied in by the caller instead."""
        if memory.device_type != self.dlpack_device_type or memory.device_id != self.index:
            return None
        storage = self._borrowed_storage(memory, dtype)
        return CudaBuffer(self, storage, dtype, memory.shape, strides=memory.strides, capacity=memory.span())

    def _borrowed_storage(self, memory: TensorMemory, dtype: DType) -> Any:
        return ForeignMemory(memory.address, memory.span() * dtype.itemsize)

    def _alloc(self, shape: tuple[int, ...], dtype: DType) -> Buffer:
        self._refuse_while_capturing("allocate device memory")
        return self._alloc_memory(shape, dtype)

    def _alloc_memory(self, shape: tuple[int, ...], dtype: DType) -> Buffer:
        nbytes = math.prod(shape) * dtype.itemsize
        allocation = Allocation(self.runtime, self.index, nbytes)
        buf = CudaBuffer(self, allocation, dtype, shape)
        if nbytes:
            self._launch("memset_async", self._ptr(buf), 0, nbytes)
        return buf

    def _write(self, buffer: Buffer, host: np.ndarray) -> None:
        self._refuse_while_capturing("copy host data to the device")
        self._copy_in(buffer, host)

    def _copy_in(self, buffer: Buffer, host: np.ndarray) -> None:
        if host.nbytes:
            src = self.runtime.ffi.cast("const void *", host.ctypes.data)
            self._launch("memcpy_h2d_async", self._ptr(buffer), src, host.nbytes)
            # The runtime stages pageable sources before returning, but the
            # docs only promise "might be synchronous": keep the source alive
            # until the stream is known to be past the copy.
            self._keep_until_synchronized(host, host.nbytes)

    def _keep_until_synchronized(self, obj: Any, nbytes: int) -> None:
        self._pending_host.append(obj)
        self._pending_bytes += nbytes
        if self._pending_bytes > _MAX_PENDING_HOST_BYTES:
            self.synchronize()

    def _read(self, buffer: Buffer) -> np.ndarray:
        self._refuse_while_capturing("copy device data to the host")
        return self._copy_out(buffer)

    def _copy_out(self, buffer: Buffer) -> np.ndarray:
        if buffer.size == 0:
            return np.empty(buffer.shape, dtype=buffer.dtype.numpy)
        span = 1 + sum((n - 1) * s for n, s in zip(buffer.shape, buffer.strides))
        flat = np.empty(span, dtype=buffer.dtype.numpy)
        dst = self.runtime.ffi.cast("void *", flat.ctypes.data)
        self._launch("memcpy_d2h_async", dst, self._ptr(buffer), flat.nbytes)
        self.synchronize()
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat, shape=buffer.shape, strides=tuple(s * item for s in buffer.strides), writeable=False
        )
        return np.array(view, copy=True)

    def synchronize(self) -> None:
        """Wait for the work queued on every stream used since the last call
        (and on the device's own stream)."""
        self._activate()
        streams = {self.stream_handle: self._stream, **self._used_streams}
        for handle, stream in streams.items():
            if self._capturing(stream):
                raise CudaError(
                    f"{self.id}: cannot synchronize while stream {handle:#x} is being captured into a CUDA graph"
                )
            self.runtime.check(self.runtime.lib.statecache_cuda_stream_synchronize(stream), "synchronize")
        self._used_streams.clear()
        self._pending_host.clear()
        self._pending_bytes = 0

    def _copy_buffer(self, src: Buffer, dst: Buffer) -> None:
        """cudaMemcpyAsync device to device: the bandwidth bound benchmarks use."""
        self._launch("memcpy_d2d_async", self._ptr(dst), self._ptr(src), src.nbytes)

    # -- primitives ---------------------------------------------------------------
    # Each ``_<op>_call`` turns validated arguments into (entry point, launch
    # arguments); ``_<op>`` queues it at once, and :meth:`_prepare_launch`
    # keeps it for the launch memo, so that a repeated decode call queues
    # without rebuilding its argument struct.  The arguments hold device
    # addresses and cffi structs, never a Buffer: the memo checks that the
    # buffers are alive before it launches.
    def _get_rows_call(self, src, rows, dst, rows_host):  # type: ignore[no-untyped-def]
        rows_p, _keep = self._rows_ptr(rows, rows_host)
        null = self.runtime.ffi.NULL
        args = (self._ptr(src), DTYPE_CODES[src.dtype], rows_p, self._ptr(dst), DTYPE_CODES[dst.dtype], null)
        return "copy_rows", (*args, dst.shape[0], src.shape[1])

    def _set_rows_call(self, dst, rows, src, rows_host):  # type: ignore[no-untyped-def]
        rows_p, _keep = self._rows_ptr(rows, rows_host)
        null = self.runtime.ffi.NULL
        args = (self._ptr(src), DTYPE_CODES[src.dtype], null, self._ptr(dst), DTYPE_CODES[dst.dtype], rows_p)
        return "copy_rows", (*args, src.shape[0], src.shape[1])

    def _zero_rows_call(self, dst, rows, rows_host):  # type: ignore[no-untyped-def]
        rows_p, _keep = self._rows_ptr(rows, rows_host)
        return "zero_rows", (self._ptr(dst), DTYPE_CODES[dst.dtype], rows_p, rows.shape[0], dst.shape[1])

    def _copy_rows_call(self, src, src_rows, dst, dst_rows, src_host, dst_host):  # type: ignore[no-untyped-def]
        src_p, _keep_src = self._rows_ptr(src_rows, src_host)
        dst_p, _keep_dst = self._rows_ptr(dst_rows, dst_host)
        args = (self._ptr(src), DTYPE_CODES[src.dtype], src_p, self._ptr(dst), DTYPE_CODES[dst.dtype], dst_p)
        return "copy_rows", (*args, src_rows.shape[0], src.shape[1])

    def _state_args(
        self, args: Any, shp: Any, pool: Buffer, start_rows: Buffer, snap_rows: Buffer, cu_seqlens: Buffer
    ) -> None:
        """Fill the shared state fields (strided index temporaries are kept until synchronize)."""
        start_p, _keep_start = self._rows_ptr(start_rows, self.index_values(start_rows))
        st = args.state
        st.pool = self._ptr(pool)
        st.start_rows = start_p
        st.snap_rows = self._ptr(snap_rows, "const int32_t *")  # contiguous (the validator made sure)
        st.cu_seqlens = self._ptr(cu_seqlens, "const int32_t *")
        st.row_size = shp.row_size
        st.pool_dtype = DTYPE_CODES[pool.dtype]
        st.n_seqs = shp.n_seqs
        st.n_tokens = shp.n_tokens
        st.max_tokens = shp.max_tokens
        st.n_cols = shp.n_cols

    def _new_args(self, struct: str) -> Any:
        args = self.runtime.ffi.new(f"{struct} *")
        args.struct_size = self.runtime.ffi.sizeof(struct)
        return args

    def _ssm_conv_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, weight, bias, y, apply_silu):  # type: ignore[no-untyped-def]
        rt = self.runtime
        a = self._new_args("statecache_cuda_conv_args")
        self._state_args(a, shp, pool, start_rows, snap_rows, cu_seqlens)
        _view(rt, a.x, x)
        _view(rt, a.weight, weight)
        _view(rt, a.bias, bias)
        a.y = self._ptr(y)
        a.y_dtype = DTYPE_CODES[y.dtype]
        a.channels = shp.channels
        a.d_conv = shp.d_conv
        a.apply_silu = int(bool(apply_silu))
        return "ssm_conv", (a,)

    def _ssm_scan_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, dt, A, B, C, y, D, z, dt_bias):  # type: ignore[no-untyped-def]
        rt = self.runtime
        a = self._new_args("statecache_cuda_scan_args")
        self._state_args(a, shp, pool, start_rows, snap_rows, cu_seqlens)
        for field, buf in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z)):
            _view(rt, getattr(a, field), buf)
        _view(rt, a.dt_bias, dt_bias)
        if D is not None and D.ndim == 1:
            a.D.strides = [D.strides[0], 0, 0, 0]  # [n_head]: the same skip for every head_dim index
        a.y = self._ptr(y)
        a.y_dtype = DTYPE_CODES[y.dtype]
        a.n_head = shp.n_head
        a.head_dim = shp.head_dim
        a.d_state = shp.d_state
        a.n_group = shp.n_group
        a.mamba1 = int(shp.variant == "mamba1")
        if shp.dt_limit is not None:
            a.dt_clamp = 1
            a.dt_lo, a.dt_hi = shp.dt_limit
        return "ssm_scan", (a,)

    def _gated_delta_net_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, beta, o, A_log, dt_bias):  # type: ignore[no-untyped-def]
        rt = self.runtime
        a = self._new_args("statecache_cuda_delta_args")
        self._state_args(a, shp, pool, start_rows, snap_rows, cu_seqlens)
        for field, buf in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log)):
            _view(rt, getattr(a, field), buf)
        _view(rt, a.dt_bias, dt_bias)
        a.o = self._ptr(o)
        a.o_dtype = DTYPE_CODES[o.dtype]
        a.scale = shp.scale
        a.l2norm_eps = L2NORM_EPS
        a.n_head_k = shp.n_head_k
        a.n_head_v = shp.n_head_v
        a.head_size = shp.head_size
        a.kda = int(shp.variant == "kda")
        a.grouped = int(shp.head_map == "grouped")
        a.qk_l2norm = int(shp.qk_l2norm)
        a.beta_sigmoid = int(shp.beta_sigmoid)
        return "gated_delta_net", (a,)

    def _linear_attn_call(
        self, shp: Any, pool: Buffer, index: tuple[Buffer, ...], tokens: tuple[Buffer, ...], u: Buffer | None, o: Buffer
    ) -> tuple[str, tuple[Any, ...]]:
        rt = self.runtime
        a = self._new_args("statecache_cuda_linear_attn_args")
        self._state_args(a, shp, pool, *index)
        for i, buf in enumerate(tokens):
            _view(rt, a.inputs[i], buf)
        _view(rt, a.u, u)
        a.o = self._ptr(o)
        a.o_dtype = DTYPE_CODES[o.dtype]
        a.variant = LINEAR_ATTN_VARIANTS[shp.variant]
        a.n_head = shp.n_head
        a.head_size = shp.head_size
        a.scale = shp.scale
        return "linear_attn", (a,)

    def _rwkv_wkv6_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, k, v, w, u, o):  # type: ignore[no-untyped-def]
        return self._linear_attn_call(shp, pool, (start_rows, snap_rows, cu_seqlens), (r, k, v, w), u, o)

    def _rwkv_wkv7_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, w, k, v, a, b, o):  # type: ignore[no-untyped-def]
        return self._linear_attn_call(shp, pool, (start_rows, snap_rows, cu_seqlens), (r, w, k, v, a, b), None, o)

    def _gated_linear_attn_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, o):  # type: ignore[no-untyped-def]
        return self._linear_attn_call(shp, pool, (start_rows, snap_rows, cu_seqlens), (q, k, v, g), None, o)

    def _rwkv_wkv6(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._rwkv_wkv6_call(*args)))

    def _rwkv_wkv7(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._rwkv_wkv7_call(*args)))

    def _gated_linear_attn(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._gated_linear_attn_call(*args)))

    def _get_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._get_rows_call(*args)))

    def _set_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._set_rows_call(*args)))

    def _zero_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._zero_rows_call(*args)))

    def _copy_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._copy_rows_call(*args)))

    def _ssm_conv(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._ssm_conv_call(*args)))

    def _ssm_scan(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._ssm_scan_call(*args)))

    def _gated_delta_net(self, *args):  # type: ignore[no-untyped-def]
        self._launch(*_flat(self._gated_delta_net_call(*args)))

    def _prepare_launch(self, op: str, call_args: tuple[Any, ...]) -> Any:
        if any(isinstance(a, Buffer) and a.dtype is DType.I32 and not a.is_contiguous for a in call_args):
            return None  # a strided index view is re-uploaded per call into a temporary
        entry, args = getattr(self, f"_{op}_call")(*call_args)
        launch_now = self._launch

        def launch() -> None:
            launch_now(entry, *args)

        return launch


def _flat(call: tuple[str, tuple[Any, ...]]) -> tuple[Any, ...]:
    entry, args = call
    return (entry, *args)


# -- backend ----------------------------------------------------------------------


def driver_problem() -> str | None:
    """Why the CUDA driver library cannot be loaded, or None when it can."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"no CUDA driver: libcuda.so.1 cannot be loaded ({exc})"
    return None


@dataclasses.dataclass
class _Probe:
    ok: bool
    reason: str
    runtime: Runtime | None = None
    count: int = 0


class CudaBackend(Backend):
    """CUDA GPUs through an nvcc-built library (built on first use, cached).

    :param cache_root: where built libraries go (default
        ``<STATECACHE_CACHE_DIR or user cache>/cuda``); tests pass a temp dir.
    """

    name = "cuda"
    version = __version__
    priority = 200  # above the C CPU backend (100): a usable GPU wins automatic selection
    description = "CUDA kernels built by nvcc, loaded with cffi (ABI mode)"
    provided_by = "statecache"
    protocol = PROTOCOL_VERSION

    def __init__(self, cache_root: str | Path | None = None) -> None:
        self.cache_root = cache_root
        self._probe_result: _Probe | None = None
        self._devices: list[Device] | None = None
        self._lock = threading.Lock()

    def _probe(self) -> _Probe:
        with self._lock:
            if self._probe_result is None:
                self._probe_result = self._run_probe()
            return self._probe_result

    def _run_probe(self) -> _Probe:
        # The driver first: without one nothing else matters, and the reason
        # must not depend on whether nvcc or a cached library happens to be
        # here (nor spend a minute in nvcc for a library nothing can run).
        problem = driver_problem()
        if problem is not None:
            return _Probe(False, problem)
        tc = build.toolchain()
        if tc is None:
            return _Probe(
                False, "nvcc not found (PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda): cannot build the kernels"
            )
        path = build.cached_library(self.cache_root, tc)
        if path is None:
            try:
                path = build.ensure_built(self.cache_root, tc).path
            except build.BuildError as exc:
                return _Probe(False, f"building the CUDA library failed: {exc}")
        try:
            runtime = load_library(path)
        except (OSError, AbiMismatchError) as exc:
            return _Probe(False, f"cannot load {path}: {exc}")
        count, status = runtime.device_count()
        if status:
            return _Probe(
                False, f"CUDA runtime: {runtime.error_text(status)} (cudaGetDeviceCount status {status})", runtime
            )
        if count == 0:
            return _Probe(False, "CUDA runtime reports no device", runtime)
        return _Probe(True, "", runtime, count)

    def availability(self) -> tuple[bool, str]:
        try:
            probe = self._probe()
        except Exception as exc:  # discovery must never crash
            return False, f"CUDA probe raised {type(exc).__name__}: {exc}"
        return probe.ok, probe.reason

    def devices(self) -> list[Device]:
        probe = self._probe()
        if not probe.ok or probe.runtime is None:
            return []
        with self._lock:
            if self._devices is None:
                self._devices = [CudaDevice(probe.runtime, i) for i in range(probe.count)]
            return self._devices
