"""CPU device: aligned host buffers and C kernels compiled with cffi (API mode).

Buffers are 64-byte aligned NumPy storage, so the host sees them without a
copy: :class:`CpuBuffer` implements ``__array__`` and ``__dlpack__``, and
:meth:`CpuDevice.from_dlpack` / :meth:`CpuDevice.from_numpy` wrap external host
memory (a torch tensor, a NumPy array) as a buffer, again without a copy.

Every kernel call goes through cffi, which releases the GIL; the C side never
touches Python objects.  Index arguments are passed from the host copies the
validator checked (never re-read from device memory that a zero-copy user
could have changed since), so a kernel cannot index out of bounds.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statecache import __version__, settings
from statecache.backend import PRIMITIVES, PROTOCOL_VERSION, Backend, Buffer, Caps, Device, DeviceKind
from statecache.dlpack import (
    KDL_BFLOAT,
    KDL_CPU,
    KDL_UINT,
    DLDataType,
    ExchangeReader,
    TensorMemory,
    capsule_tensor,
    host_flat,
)
from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.errors import ArgumentError
from statecache.hostmem import aligned_empty, physical_memory_bytes
from statecache.launch_memo import LaunchMemo
from statecache.primitives import ACTIVATION_DTYPES, EPILOGUES, L2NORM_EPS

#: The C ABI this Python code was written against (SC_CPU_ABI_VERSION).
ABI_VERSION = 3

_DTYPE_CODE = {DType.F32: 0, DType.F16: 1, DType.BF16: 2}


@functools.cache
def load_kernels() -> tuple[Any, Any, str]:
    """``(ffi, lib, "")`` when the compiled module is usable, else
    ``(None, None, reason)``.  Never raises: discovery must survive a build
    without a compiler."""
    try:
        with settings.openmp_defaults():
            from statecache.backends.cpu import _kernels  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, None, f"the C kernels are not built ({exc}); reinstall statecache with a C compiler"
    lib = _kernels.lib
    found = int(lib.sc_cpu_abi_version())
    if found != ABI_VERSION or int(lib.SC_CPU_ABI_VERSION) != ABI_VERSION:
        return None, None, f"C kernel ABI version {found} does not match the Python side's {ABI_VERSION}; rebuild"
    stale = _stale_build_reason(_kernels.ffi, lib)
    if stale:
        return None, None, stale
    if not lib.sc_cpu_isa_supported():
        isa = _kernels.ffi.string(lib.sc_cpu_isa()).decode()
        return None, None, f"the C kernels were compiled for {isa}, which this CPU does not support; rebuild here"
    return _kernels.ffi, lib, ""


def _stale_build_reason(ffi: Any, lib: Any) -> str:
    """Why the loaded library no longer matches the kernel sources installed
    beside it, or "".  A library built without a digest (a hand-made build,
    e.g. tools/kernel_coverage.py) and an installation without sources pass."""
    from statecache.backends.cpu import build

    recorder = getattr(lib, "sc_cpu_source_digest", None)
    if recorder is None:
        return ""
    built, now = ffi.string(recorder()).decode(), build.source_digest()
    if now is None or built == now:
        return ""
    return (
        f"the C kernels were built from other sources (digest {built}) than the ones in {build.HERE} ({now}); "
        "rebuild them: pip install -e . (or python setup.py build_ext --inplace)"
    )


# -- DLPack -------------------------------------------------------------------
# NumPy exports and imports DLPack for f32/f16/i32 but knows no bf16.  bf16
# travels as uint16 with the capsule's dtype code relabelled (kDLUInt <->
# kDLBfloat), which is the same bits under another name.


def _capsule_dtype(capsule: Any) -> DLDataType:
    """The dtype field of an unconsumed DLPack capsule (legacy or versioned)."""
    return capsule_tensor(capsule)[0].dtype


def _dlpack_kwargs(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _import_dlpack(obj: Any) -> np.ndarray:
    """A NumPy view (no copy) of a host DLPack producer, bf16 included."""
    seen_bf16 = []

    class _Relabelled:
        def __dlpack_device__(self) -> tuple[int, int]:
            return obj.__dlpack_device__()

        def __dlpack__(self, **kwargs: Any) -> Any:
            capsule = obj.__dlpack__(**kwargs)
            dtype = _capsule_dtype(capsule)
            if dtype.code == KDL_BFLOAT and dtype.bits == 16:
                dtype.code = KDL_UINT
                seen_bf16.append(True)
            return capsule

    device_type, _ = obj.__dlpack_device__()
    if int(device_type) != KDL_CPU:
        raise ArgumentError("obj", f"DLPack device type {int(device_type)} is not host memory (kDLCPU)")
    arr = np.from_dlpack(_Relabelled())
    if seen_bf16:
        arr = arr.view(DType.BF16.numpy)
    return arr


# -- buffers ------------------------------------------------------------------


class CpuBuffer(Buffer):
    """A buffer in host memory: NumPy and DLPack consumers see it in place."""

    __slots__ = ("_cffi", "address")

    def __init__(self, *args: Any, address: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the storage's element 0 (passed in where known: asking NumPy costs microseconds)
        self.address: int = self.storage.__array_interface__["data"][0] if address is None else address
        self._cffi: dict[str, Any] = {}  # cffi pointers / view structs of this buffer

    def view(self, shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0) -> CpuBuffer:
        out = super().view(shape, strides, offset)  # type(self): already a CpuBuffer
        assert isinstance(out, CpuBuffer)
        return out

    def _new_view(self, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Buffer:
        return CpuBuffer(
            self.device, self.storage, self.dtype, shape, strides=strides, offset=offset, capacity=self.capacity,
            address=self.address,
        )  # fmt: skip

    def _storage_base(self) -> int:
        return self.address

    def host_view(self) -> np.ndarray:
        """A writable NumPy view of exactly this buffer (shape, strides, offset)."""
        flat: np.ndarray = self.storage
        if self.is_contiguous:
            return flat[self.offset : self.offset + self.size].reshape(self.shape)
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(
            flat[self.offset :], shape=self.shape, strides=tuple(s * item for s in self.strides)
        )

    def _exported(self) -> np.ndarray:
        self.mark_exported()  # the caller may now write it behind the validator's back
        return self.host_view()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self._exported()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(f"{self!r} holds {self.dtype}; converting to {np.dtype(dtype)} needs a copy")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: Any = None,
        copy: bool | None = None,
    ) -> Any:
        arr = self._exported()
        kwargs = _dlpack_kwargs(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)
        if self.dtype is DType.BF16:
            capsule = arr.view(np.uint16).__dlpack__(**kwargs)
            _capsule_dtype(capsule).code = KDL_BFLOAT
            return capsule
        return arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CPU, 0)


# -- device -------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "host CPU"


class CpuDevice(Device):
    def __init__(self, ffi: Any, lib: Any) -> None:
        self._ffi = ffi
        self._lib = lib
        self.id = "cpu:0"
        self.backend_name = "cpu"
        self.kind = DeviceKind.CPU
        self.isa = ffi.string(lib.sc_cpu_isa()).decode()
        # Relaunches read torch tensors through the DLPack C exchange API in one C call
        # (statecache.dlpack.ExchangeReader; sc_dlpack.c).
        self._exchange_reader, self._place = _helpers(ffi, lib)
        # A remembered call's probe and launch in C (sc_dlpack.c): the launch memo's probe, and
        # each prepared launch a builtin running its kernel's block (no Python frame, no cffi
        # argument conversions).  None in a hand-made build without them.
        self._runner, prober, self._threads = _memo_helpers(ffi, lib)
        self._launches = LaunchMemo(prober)
        self.name = f"{_cpu_name()} (C kernels, {self.isa})"
        self.memory_bytes = physical_memory_bytes()
        self.caps = Caps(
            ops=frozenset(PRIMITIVES),
            storage_dtypes=STORAGE_DTYPES,
            max_snapshots=64,
            strided_inputs=True,
            host_visible=True,
            async_launch=False,
            varlen=True,
            activation_dtypes=ACTIVATION_DTYPES,
            epilogues=frozenset(EPILOGUES),
        )

    @property
    def properties(self) -> dict[str, Any]:
        props = super().properties
        props.update(isa=self.isa, threads=self.num_threads, openmp=bool(self._lib.sc_cpu_has_threads()))
        return props

    @property
    def num_threads(self) -> int:
        """Threads per kernel (:func:`statecache.settings.num_threads`:
        ``STATECACHE_NUM_THREADS``, else torch's count when torch is imported,
        else the cores), read at every call."""
        return settings.num_threads()

    # -- zero-copy wrapping of host memory -------------------------------------
    def from_numpy(self, array: np.ndarray) -> CpuBuffer:
        """A buffer over ``array``'s memory (no copy); writes go both ways."""
        if not isinstance(array, np.ndarray):
            raise ArgumentError("array", f"expected a numpy.ndarray, got {type(array).__name__}")
        try:
            dtype = DType.parse(array.dtype)
        except ValueError:
            raise ArgumentError("array", f"dtype {array.dtype} is not one of f32, f16, bf16, i32") from None
        if not array.flags.writeable:
            raise ArgumentError("array", "is read-only; primitives may write buffers")
        if not array.flags.aligned:
            raise ArgumentError("array", "is not aligned to its element size")
        item = array.itemsize
        if any(s < 0 or s % item for s in array.strides):
            raise ArgumentError("array", f"strides {array.strides} must be non-negative multiples of {item}")
        strides = tuple(s // item for s in array.strides)
        span = 1 + sum((n - 1) * s for n, s in zip(array.shape, strides)) if array.size else 0
        flat = np.lib.stride_tricks.as_strided(array, shape=(span,), strides=(item,)) if span else array.reshape(-1)
        buf = CpuBuffer(self, flat, dtype, array.shape, strides=strides, offset=0, capacity=span)
        if dtype is DType.I32 and buf.is_contiguous:
            buf.host_indices = None
        return buf

    def from_dlpack(self, obj: Any) -> CpuBuffer:
        """A buffer over a host DLPack producer's memory (``torch.Tensor``,
        NumPy array, ...) without a copy; bf16 included."""
        if not hasattr(obj, "__dlpack__"):
            raise ArgumentError("obj", f"{type(obj).__name__} does not implement __dlpack__")
        return self.from_numpy(_import_dlpack(obj))

    def _import_memory(self, memory: TensorMemory, dtype: DType) -> CpuBuffer | None:
        """Host tensors: a buffer over their memory (the kernels take any
        strides of the per-token inputs; statecache.tensor_args keeps the
        wrap only while the tensor is an argument)."""
        if not memory.on_host:
            return None
        flat = host_flat(memory, dtype.numpy)
        return CpuBuffer(
            self, flat, dtype, memory.shape, strides=memory.strides, capacity=flat.size, address=memory.address
        )

    # -- memory -----------------------------------------------------------------
    def _alloc(self, shape: tuple[int, ...], dtype: DType) -> Buffer:
        return CpuBuffer(self, aligned_empty(math.prod(shape), dtype), dtype, shape)

    def _write(self, buffer: Buffer, host: np.ndarray) -> None:
        _view(buffer)[...] = host

    def _read(self, buffer: Buffer) -> np.ndarray:
        return np.array(_view(buffer), copy=True)

    def _copy_buffer(self, src: Buffer, dst: Buffer) -> None:
        """Threaded memcpy: the bound the benchmarks compare kernels with."""
        self._lib.sc_memcpy(self._ptr(dst), self._ptr(src), src.nbytes, self.num_threads)

    # -- cffi plumbing ------------------------------------------------------------
    def _ptr(self, buf: Buffer, ctype: str = "void *") -> Any:
        # A buffer's address never changes: cache the cast per (buffer, type),
        # since decode steps pass the same buffers call after call.
        cache = getattr(buf, "_cffi", None)
        if cache is not None:
            hit = cache.get(ctype)
            if hit is not None:
                return hit
        ptr = self._ffi.cast(ctype, _address(buf) + buf.offset * buf.dtype.itemsize)
        if cache is not None:
            cache[ctype] = ptr
        return ptr

    def _rows(self, values: np.ndarray, buf: Buffer | None = None) -> tuple[Any, np.ndarray]:
        # Keep the int32 copy alive alongside its pointer until the call returns.
        # The validated host shadow of an index buffer is the same array call
        # after call (decode reuses its index buffers): its pointer is cached
        # on the buffer, and used only while the shadow is still that array.
        cache = getattr(buf, "_cffi", None)
        if cache is not None:
            hit = cache.get("rows")
            if hit is not None and hit[0] is values:
                return hit[1], values
        arr = np.ascontiguousarray(values, dtype=np.int32)
        ptr = self._ffi.from_buffer("int32_t[]", arr)
        if cache is not None and arr is values and buf.host_indices is values:  # type: ignore[union-attr]
            cache["rows"] = (values, ptr)
        return ptr, arr

    def _sview(self, buf: Buffer) -> Any:
        cache = getattr(buf, "_cffi", None)
        if cache is not None and "view" in cache:
            return cache["view"]
        v = self._ffi.new("sc_view *")
        v.data = self._ptr(buf, "float *")
        v.strides = list(buf.strides) + [0] * (4 - len(buf.strides))
        v.dtype = _DTYPE_CODE[buf.dtype]
        if cache is not None:
            cache["view"] = v  # the struct is read-only to the kernels
        return v

    # -- primitives -----------------------------------------------------------------
    # Each ``_<op>_call`` turns validated arguments into (kernel, arguments
    # without the thread count, arrays to keep alive).  ``_<op>`` launches it
    # at once; :meth:`_prepare_launch` keeps it for the launch memo, so that
    # a repeated decode call costs one builtin call (sc_dlpack.c's run, which
    # calls the kernel without cffi's argument conversions).  Pointers are plain
    # addresses (no reference to a Buffer): the memo checks that the buffers
    # are alive before it launches.
    def _copy_call(
        self,
        src: Buffer,
        src_rows: np.ndarray | None,
        dst: Buffer,
        dst_rows: np.ndarray | None,
        n: int,
        src_index: Buffer | None = None,
        dst_index: Buffer | None = None,
    ) -> tuple[Any, tuple[Any, ...], Any]:
        null = self._ffi.NULL
        s_ptr, s_keep = self._rows(src_rows, src_index) if src_rows is not None else (null, None)
        d_ptr, d_keep = self._rows(dst_rows, dst_index) if dst_rows is not None else (null, None)
        args = (
            self._ptr(src),
            _DTYPE_CODE[src.dtype],
            s_ptr,
            self._ptr(dst),
            _DTYPE_CODE[dst.dtype],
            d_ptr,
            n,
            src.shape[1],
        )
        return self._lib.sc_copy_rows, args, (s_keep, d_keep)

    def _get_rows_call(self, src, rows_buf, dst, rows_host):  # type: ignore[no-untyped-def]
        return self._copy_call(src, rows_host, dst, None, len(rows_host), src_index=rows_buf)

    def _set_rows_call(self, dst, rows_buf, src, rows_host):  # type: ignore[no-untyped-def]
        return self._copy_call(src, None, dst, rows_host, len(rows_host), dst_index=rows_buf)

    def _copy_rows_call(self, src, src_rows, dst, dst_rows, src_host, dst_host):  # type: ignore[no-untyped-def]
        return self._copy_call(src, src_host, dst, dst_host, len(src_host), src_rows, dst_rows)

    def _zero_rows_call(self, dst, rows_buf, rows_host):  # type: ignore[no-untyped-def]
        r_ptr, keep = self._rows(rows_host, rows_buf)
        args = (self._ptr(dst), _DTYPE_CODE[dst.dtype], r_ptr, len(rows_host), dst.shape[1])
        return self._lib.sc_zero_rows, args, keep

    def _state(self, shp: Any, pool: Buffer, start_rows: Buffer, snap_rows: Buffer, cu_seqlens: Buffer) -> Any:
        """The sc_state of a call and the host index arrays its pointers point into."""
        start_ptr, start_keep = self._rows(self.index_values(start_rows), start_rows)
        snap_ptr, snap_keep = self._rows(self.index_values(snap_rows), snap_rows)
        cu_ptr, cu_keep = self._rows(self.index_values(cu_seqlens), cu_seqlens)
        # One initializer in field order: field by field costs a microsecond more per validated call.
        st = self._ffi.new(
            "sc_state *",
            [
                self._ptr(pool),
                _DTYPE_CODE[pool.dtype],
                shp.n_cols,
                shp.row_size,
                start_ptr,
                snap_ptr,
                cu_ptr,
                shp.n_seqs,
                shp.n_tokens,
                shp.max_tokens,
            ],
        )
        return st, (start_keep, snap_keep, cu_keep, start_ptr, snap_ptr, cu_ptr)

    def _ssm_conv_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, weight, bias, y, apply_silu):  # type: ignore[no-untyped-def]
        st, keep = self._state(shp, pool, start_rows, snap_rows, cu_seqlens)
        # The kernel indexes weight and bias densely; validation lets them be strided (a slice of a
        # wider weight), as for A, D and dt_bias: copies when strided.
        dense = [_contiguous(self, b) if b is not None else None for b in (weight, bias)]
        args = (
            st,
            self._sview(x),
            self._ptr(dense[0], "float *"),
            self._ffi.NULL if dense[1] is None else self._ptr(dense[1], "float *"),
            self._ptr(y),
            _DTYPE_CODE[y.dtype],
            shp.channels,
            shp.d_conv,
            int(bool(apply_silu)),
        )
        return self._lib.sc_ssm_conv, args, (keep, dense)

    def _ssm_scan_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, dt, A, B, C, y, D, z, dt_bias):  # type: ignore[no-untyped-def]
        st, keep = self._state(shp, pool, start_rows, snap_rows, cu_seqlens)
        dense = [_contiguous(self, b) if b is not None else None for b in (A, D, dt_bias)]  # copies when strided
        dense_A, dense_D, dense_bias = dense
        opt = self._ffi.new("sc_scan_options *")
        null = self._ffi.NULL
        opt.dt_bias = null if dense_bias is None else self._ptr(dense_bias, "float *")
        opt.D = null if dense_D is None else self._ptr(dense_D, "float *")
        opt.d_per_dim = int(D is not None and D.ndim == 2)
        if shp.dt_limit is not None:
            opt.dt_clamp = 1
            opt.dt_lo, opt.dt_hi = shp.dt_limit
        if z is not None:
            opt.z.data = self._ptr(z, "float *")
            opt.z.strides = list(z.strides) + [0] * (4 - z.ndim)
            opt.z.dtype = _DTYPE_CODE[z.dtype]
        args = (
            st,
            self._sview(x),
            self._sview(dt),
            self._ptr(dense_A, "float *"),
            int(shp.variant == "mamba1"),
            self._sview(B),
            self._sview(C),
            self._ptr(y),
            _DTYPE_CODE[y.dtype],
            opt,
            shp.n_head,
            shp.head_dim,
            shp.d_state,
            shp.n_group,
        )
        return self._lib.sc_ssm_scan, args, (keep, dense)

    def _gated_delta_net_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, beta, o, A_log, dt_bias):  # type: ignore[no-untyped-def]
        st, keep = self._state(shp, pool, start_rows, snap_rows, cu_seqlens)
        dense = [_contiguous(self, b) if b is not None else None for b in (A_log, dt_bias)]
        null = self._ffi.NULL
        opt = self._ffi.new("sc_delta_options *")
        opt.grouped = int(shp.head_map == "grouped")
        opt.qk_l2norm = int(shp.qk_l2norm)
        opt.beta_sigmoid = int(shp.beta_sigmoid)
        opt.A_log = null if dense[0] is None else self._ptr(dense[0], "float *")
        opt.dt_bias = null if dense[1] is None else self._ptr(dense[1], "float *")
        opt.scale = shp.scale
        opt.l2norm_eps = L2NORM_EPS
        args = (
            st,
            self._sview(q),
            self._sview(k),
            self._sview(v),
            self._sview(g),
            int(shp.variant == "kda"),
            self._sview(beta),
            self._ptr(o),
            _DTYPE_CODE[o.dtype],
            opt,
            shp.n_head_k,
            shp.n_head_v,
            shp.head_size,
        )
        return self._lib.sc_gated_delta_net, args, (keep, dense)

    def _linear_attn_call(
        self,
        kernel: Any,
        shp: Any,
        pool: Buffer,
        index: tuple[Buffer, ...],
        tokens: tuple[Buffer, ...],
        u: Buffer | None,
        o: Buffer,
    ) -> tuple[Any, tuple[Any, ...], Any]:
        st, keep = self._state(shp, pool, *index)
        dense = _contiguous(self, u) if u is not None else None  # u is indexed densely
        extra = () if dense is None else (self._ptr(dense, "float *"),)
        args = (st, *(self._sview(t) for t in tokens), *extra, self._ptr(o), _DTYPE_CODE[o.dtype], shp.scale,
                shp.n_head, shp.head_size)  # fmt: skip
        return kernel, args, (keep, dense)

    def _rwkv_wkv6_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, k, v, w, u, o):  # type: ignore[no-untyped-def]
        rows = (start_rows, snap_rows, cu_seqlens)
        return self._linear_attn_call(self._lib.sc_rwkv_wkv6, shp, pool, rows, (r, k, v, w), u, o)

    def _rwkv_wkv7_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, w, k, v, a, b, o):  # type: ignore[no-untyped-def]
        rows = (start_rows, snap_rows, cu_seqlens)
        return self._linear_attn_call(self._lib.sc_rwkv_wkv7, shp, pool, rows, (r, w, k, v, a, b), None, o)

    def _gated_linear_attn_call(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, o):  # type: ignore[no-untyped-def]
        rows = (start_rows, snap_rows, cu_seqlens)
        return self._linear_attn_call(self._lib.sc_gated_linear_attn, shp, pool, rows, (q, k, v, g), None, o)

    def _prepare_relaunch(self, op: str, call_args: tuple[Any, ...], tensors: dict[int, int]) -> Any:
        slots = _RELAUNCH_SLOTS.get(op)
        if slots is None:
            return None
        launch = self._prepare_launch(op, call_args)  # None: weights packed per call
        if launch is None:
            return None
        kernel, args, keep = getattr(self, f"_{op}_call")(*call_args)
        args = list(args)
        ffi = self._ffi
        # A pointer inside a struct is set by writing the address through a
        # uintptr_t alias of the field: no pointer object per call (five
        # times cheaper than casting and assigning).  A pointer passed as an
        # argument is cast per call, unless its address is the previous one.
        fields: list[tuple[int, int, Any]] = []  # (address index, byte offset, alias of the field)
        pointers: list[tuple[int, int, str, int]] = []  # (address index, byte offset, ctype, argument)
        placed: set[int] = set()
        for pos, buf in enumerate(call_args):
            if not isinstance(buf, Buffer):
                continue
            k = tensors.get(id(buf.storage))
            if k is None:
                continue  # the device's own memory: its pointer stays
            how = slots.get(pos)
            if how is None:
                return None  # a tensor where no pointer can be replaced (a tensor pool): validate instead
            delta = buf.offset * buf.dtype.itemsize
            if how[0] == "arg":
                pointers.append((k, delta, how[2], how[1]))
            else:
                if how[0] == "view":
                    struct = ffi.new("sc_view *")  # the validated buffer's cached struct stays as it is
                    struct[0] = args[how[1]][0]
                    args[how[1]] = struct
                    path: tuple[str, ...] = ("data",)
                else:
                    struct = args[how[1]]  # the options struct: made for this call, private
                    path = tuple(how[2].split("."))
                fields.append((k, delta, ffi.cast("uintptr_t *", ffi.addressof(struct[0], *path))))
            placed.add(k)
        if placed != set(tensors.values()):
            return None  # a tensor the call does not pass as a pointer: nothing to relaunch safely
        cast = ffi.cast
        num_threads = self._threads
        field_steps = tuple(fields)
        place = self._place
        if place is not None:  # the fields set in one C call (sc_dlpack.c): their addresses
            targets = [len(fields)]
            for k, delta, alias in fields:
                targets += [k, delta, int(ffi.cast("uintptr_t", alias))]
            field_targets = np.array(targets, np.int64).tobytes()
        pointer_steps = tuple(pointers)
        last = [-1] * len(pointer_steps)
        # The structs are patched in place and the kernel runs without the GIL: a second thread
        # relaunching the same call meanwhile would move the first one's pointers.  It takes the
        # ordinary path instead (relaunch returns False, nothing done).
        busy = threading.Lock()
        acquire, release = busy.acquire, busy.release  # bound once: this runs on every fresh-tensor call
        numbered = tuple((i, *step) for i, step in enumerate(pointer_steps))

        def relaunch(addresses: list[int]) -> bool:
            if not acquire(False):  # (positional: a keyword costs a dict per call)
                return False
            try:
                if place is not None:
                    place(addresses, field_targets)
                else:
                    for k, delta, alias in field_steps:
                        alias[0] = addresses[k] + delta
                for i, k, delta, ctype, arg in numbered:
                    address = addresses[k] + delta
                    if address != last[i]:
                        args[arg] = cast(ctype, address)
                        last[i] = address
                kernel(*args, num_threads())
            finally:
                release()
            return True

        relaunch.keep = (keep, args)  # type: ignore[attr-defined]  # the structs the aliases write into
        reader = self._exchange_reader
        if reader is not None and reader.launches:
            # The same call as a block for the reader's launch (sc_dlpack.c), which matches the
            # tensors, places their addresses and runs the kernel in one C call.
            block = _launch_block(ffi, kernel, args, fields, pointers)
            if block is not None:
                relaunch.block = int(ffi.cast("uintptr_t", block))  # type: ignore[attr-defined]
                relaunch.threads = num_threads  # type: ignore[attr-defined]
                relaunch.keep = (keep, args, block)  # type: ignore[attr-defined]
        return relaunch

    def _launch(self, call: tuple[Any, tuple[Any, ...], Any]) -> None:
        kernel, args, _keep = call
        kernel(*args, self.num_threads)

    def _get_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._get_rows_call(*args))

    def _set_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._set_rows_call(*args))

    def _copy_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._copy_rows_call(*args))

    def _zero_rows(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._zero_rows_call(*args))

    def _ssm_conv(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._ssm_conv_call(*args))

    def _ssm_scan(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._ssm_scan_call(*args))

    def _gated_delta_net(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._gated_delta_net_call(*args))

    def _rwkv_wkv6(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._rwkv_wkv6_call(*args))

    def _rwkv_wkv7(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._rwkv_wkv7_call(*args))

    def _gated_linear_attn(self, *args):  # type: ignore[no-untyped-def]
        self._launch(self._gated_linear_attn_call(*args))

    def _prepare_launch(self, op: str, call_args: tuple[Any, ...]) -> Any:
        weights = {"ssm_conv": (6, 7), "ssm_scan": (7, 11, 13), "gated_delta_net": (11, 12), "rwkv_wkv6": (9,)}
        if any(call_args[i] is not None and not call_args[i].is_contiguous for i in weights.get(op, ())):
            return None  # weights are packed per call when strided: a kept copy would miss the caller's updates
        kernel, args, keep = getattr(self, f"_{op}_call")(*call_args)
        num_threads = self._threads
        ffi = self._ffi
        if self._runner is not None and _launch_kinds(ffi, kernel) is not None:
            # A builtin (sc_dlpack.c's run): the first call through cffi, then its block is
            # made and the kernel called directly, the thread count read at every call.
            return self._runner(
                kernel, tuple(args), num_threads, keep, lambda: _launch_block(ffi, kernel, args, [], [], as_bytes=True)
            )

        def launch() -> None:
            kernel(*args, num_threads())

        launch.keep = keep  # type: ignore[attr-defined]  # index arrays (and a packed A) the pointers point into
        return launch


#: How a relaunch (CpuDevice._prepare_relaunch) puts a tensor's new address into a prepared
#: call: per position in the ``_<op>`` arguments, ("arg", i, ctype): argument i is the pointer;
#: ("view", i): argument i is an sc_view whose data it is; ("opt", i, field): a pointer field
#: of the options struct at argument i (z.data: the gate's view).
_RELAUNCH_SLOTS: dict[str, dict[int, tuple[Any, ...]]] = {
    # (shp, pool, start_rows, snap_rows, cu_seqlens, x, weight, bias, y, apply_silu)
    "ssm_conv": {5: ("view", 1), 6: ("arg", 2, "float *"), 7: ("arg", 3, "float *"), 8: ("arg", 4, "void *")},
    # (shp, pool, start_rows, snap_rows, cu_seqlens, x, dt, A, B, C, y, D, z, dt_bias)
    "ssm_scan": {
        5: ("view", 1),
        6: ("view", 2),
        7: ("arg", 3, "float *"),
        8: ("view", 5),
        9: ("view", 6),
        10: ("arg", 7, "void *"),
        11: ("opt", 9, "D"),
        12: ("opt", 9, "z.data"),
        13: ("opt", 9, "dt_bias"),
    },
    # (shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, beta, o, A_log, dt_bias)
    "gated_delta_net": {
        5: ("view", 1),
        6: ("view", 2),
        7: ("view", 3),
        8: ("view", 4),
        9: ("view", 6),
        10: ("arg", 7, "void *"),
        11: ("opt", 9, "A_log"),
        12: ("opt", 9, "dt_bias"),
    },
}


#: The kernels sc_dlpack.c's launch and run call (its SC_LAUNCH_*, by C name), and its block's
#: layout: a head of (busy, kernel, number of targets), the kernel's arguments but n_threads,
#: then the targets.
_LAUNCH_KERNELS = {
    "sc_ssm_conv": 1,
    "sc_ssm_scan": 2,
    "sc_gated_delta_net": 3,
    "sc_rwkv_wkv6": 4,
    "sc_rwkv_wkv7": 5,
    "sc_gated_linear_attn": 6,
    "sc_copy_rows": 7,
    "sc_zero_rows": 8,
}
_LAUNCH_HEAD = 3
_LAUNCH_ARGS = 16
_BLOCK_WORDS = struct.Struct(f"={_LAUNCH_HEAD + _LAUNCH_ARGS}q")
#: Integer parameters a block word passes (as their C type: the compiler checks sc_dlpack.c's calls).
_LAUNCH_INTEGERS = frozenset({"int", "int64_t", "sc_dtype"})


def _float_word(value: float) -> int:
    """The bits of ``value`` as the C float a cffi call would pass (the same
    double-to-float conversion), in a block word's low 32 (sc_dlpack.c's word_float)."""
    return int(np.array(value, np.float32).view(np.uint32))


def _launch_block(
    ffi: Any,
    kernel: Any,
    args: list[Any],
    fields: list[tuple[int, int, Any]],
    pointers: list[tuple[int, int, str, int]],
    as_bytes: bool = False,
) -> Any:
    """A prepared call (``kernel(*args, n_threads)``, its tensors placed by
    ``fields`` and ``pointers`` as CpuDevice._prepare_relaunch makes them) as
    the block sc_dlpack.c's launch runs: an int64 array (the caller keeps it,
    and the structs its words point into, alive), or None when the call has
    an argument a word cannot carry (it is then relaunched by the closure).
    ``as_bytes``: the block of a call without targets (no ``fields`` nor
    ``pointers``) as bytes, which sc_dlpack.c's run reads in place."""
    kinds = _launch_kinds(ffi, kernel)
    if kinds is None or len(kinds) != len(args):
        return None
    kernel_id = _LAUNCH_KERNELS[kernel.__name__]
    words: list[int] = []
    cdata, cast = ffi.CData, ffi.cast
    for arg, kind in zip(args, kinds):
        if kind == "pointer" and isinstance(arg, cdata):
            words.append(int(cast("uintptr_t", arg)))
        elif kind == "int" and type(arg) is int:
            words.append(arg)
        elif kind == "float" and type(arg) is float:
            words.append(_float_word(arg))
        else:
            return None
    words += [0] * (_LAUNCH_ARGS - len(words))
    if as_bytes:  # a remembered launch (CpuDevice._prepare_launch): never written, made in one go
        return _BLOCK_WORDS.pack(0, kernel_id, 0, *words)
    targets = [(k, delta, int(cast("uintptr_t", alias))) for k, delta, alias in fields]
    block = ffi.new("int64_t[]", _LAUNCH_HEAD + _LAUNCH_ARGS + 3 * (len(targets) + len(pointers)))
    base = int(cast("uintptr_t", block))
    # A pointer argument is a word of the block itself: its address is the target.
    targets += [(k, delta, base + 8 * (_LAUNCH_HEAD + arg)) for k, delta, _, arg in pointers]
    block[0 : _LAUNCH_HEAD + _LAUNCH_ARGS] = [0, kernel_id, len(targets), *words]
    for i, target in enumerate(targets):
        block[_LAUNCH_HEAD + _LAUNCH_ARGS + 3 * i : _LAUNCH_HEAD + _LAUNCH_ARGS + 3 * i + 3] = list(target)
    return block


#: kernel -> how each of its parameters but n_threads travels in a block word
#: ("pointer", "int", "float"), or None: a kernel no block runs (_launch_kinds).
_KINDS: dict[Any, tuple[str, ...] | None] = {}


def _launch_kinds(ffi: Any, kernel: Any) -> tuple[str, ...] | None:
    """How ``kernel``'s arguments travel in a block (asked once per kernel:
    cffi's type reflection costs microseconds per validated call)."""
    try:
        return _KINDS[kernel]
    except KeyError:
        pass
    kinds: tuple[str, ...] | None = None
    params = ffi.typeof(kernel).args
    if _LAUNCH_KERNELS.get(getattr(kernel, "__name__", "")) is not None and len(params) - 1 <= _LAUNCH_ARGS:
        made = []
        for param in params[:-1]:
            if param.kind == "pointer":
                made.append("pointer")
            elif param.kind in ("primitive", "enum") and param.cname in _LAUNCH_INTEGERS:
                made.append("int")
            elif param.kind == "primitive" and param.cname == "float":
                made.append("float")
            else:
                made = []
                break
        kinds = tuple(made) if made else None
    _KINDS[kernel] = kinds
    return kinds


def _helpers(ffi: Any, lib: Any) -> tuple[ExchangeReader | None, Any]:
    """The library's Python builtins (sc_dlpack.c): the DLPack readers (with
    ``launch``: match, place and run a prepared call), and ``place`` (pointer
    fields set from a list of addresses); fetched once through ctypes (with
    the GIL held, unlike a cffi call).  Nones if that fails."""
    try:
        address = int(ffi.cast("uintptr_t", ffi.addressof(lib, "sc_dlpack_functions")))
    except AttributeError:  # a hand-made build that does not declare them (tools/kernel_coverage.py)
        return None, None
    try:
        read, match, place, launch = _builtins(address)[:4]
    except (ValueError, TypeError):  # NULL (no memory) or not the four
        return None, None
    return ExchangeReader(read, match, launch), place


def _memo_helpers(ffi: Any, lib: Any) -> tuple[Any, Any, Callable[[], int]]:
    """The library's builtins for the launch memo (sc_dlpack.c): ``runner``
    (a prepared launch as a builtin), ``prober`` (LaunchMemo.probe in C) and
    the thread count (settings.num_threads in C, itself where the library
    lacks them, as are the others then: None)."""
    try:
        address = int(ffi.cast("uintptr_t", ffi.addressof(lib, "sc_dlpack_functions")))
    except AttributeError:
        return None, None, settings.num_threads
    try:
        _, _, _, _, runner, prober, threader = _builtins(address)
        threads = threader(vars(settings), vars(os), settings.num_threads, settings._threads_from(None))
    except (ValueError, TypeError):  # NULL (no memory), or a library without them
        return None, None, settings.num_threads
    return runner, prober, threads


def _builtins(address: int) -> tuple[Any, ...]:
    """What sc_dlpack_functions at ``address`` returns (a tuple of builtins)."""
    return tuple(ctypes.PYFUNCTYPE(ctypes.py_object)(address)())


def _address(buf: Buffer) -> int:
    address = getattr(buf, "address", None)
    if address is None:  # a plain Buffer made over our storage by core code
        address = int(buf.storage.__array_interface__["data"][0])
    return int(address)


def _view(buf: Buffer) -> np.ndarray:
    if isinstance(buf, CpuBuffer):
        return buf.host_view()
    return CpuBuffer(
        buf.device, buf.storage, buf.dtype, buf.shape, strides=buf.strides, offset=buf.offset, capacity=buf.capacity
    ).host_view()


def _contiguous(device: CpuDevice, buf: Buffer) -> Buffer:
    """Small weight-like inputs (A) the kernels index densely."""
    if buf.is_contiguous:
        return buf
    return device.upload(_view(buf))


class CpuBackend(Backend):
    name = "cpu"
    version = __version__
    priority = 100  # preferred over the NumPy reference whenever it is built
    description = "C kernels (cffi, OpenMP) on the host CPU"
    provided_by = "statecache"
    protocol = PROTOCOL_VERSION

    def __init__(self) -> None:
        self._devices: list[Device] | None = None

    def availability(self) -> tuple[bool, str]:
        _, lib, reason = load_kernels()
        if lib is not None:
            try:
                settings.num_threads()  # every kernel call reads it: a bad value fails them all
            except ValueError as exc:
                return False, str(exc)
        return lib is not None, reason

    def devices(self) -> list[Device]:
        if self._devices is None:
            ffi, lib, _ = load_kernels()
            self._devices = [CpuDevice(ffi, lib)] if lib is not None else []
        return self._devices
