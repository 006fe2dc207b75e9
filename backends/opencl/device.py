"""OpenCL device through pyopencl: cl.Buffer storage, queued launches.

Every device of every OpenCL platform is offered as ``opencl:N``, in the
order the ICD loader lists platforms and each platform lists its devices
(the order ``PYOPENCL_CTX`` indices refer to).  ``PYOPENCL_CTX`` restricts
the list to the devices it names.  Each device gets its own context and one
in-order queue; launches and copies are queued, ``synchronize()`` finishes the
queue and ``download()`` synchronizes first.

pyopencl is imported only when the backend is asked about availability or
devices, so listing backends without the ``opencl`` extra never fails.

Tensors as arguments: a ``cl.Buffer`` cannot be made over host memory the
device does not own, so this device imports none (``_import_memory`` is
the default): host tensors that a primitive only reads are copied in before
each call, host tensors it writes are refused with an ArgumentError naming
them, and index tensors arrive as index buffers (statecache.tensor_args).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import numpy as np

from statecache import __version__, settings
from statecache import primitives as P
from statecache.backend import (
    LINEAR_ATTN_PRIMITIVES,
    PRIMITIVES,
    PROTOCOL_VERSION,
    SUPPORTED,
    Backend,
    Buffer,
    Caps,
    Device,
    DeviceKind,
    Support,
)
from statecache.backends.opencl import build
from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.primitives import ACTIVATION_DTYPES, EPILOGUES, L2NORM_EPS

INSTALL_HINT = "apt-get install pocl-opencl-icd"
EXTRA_HINT = "pip install 'statecache[opencl]'"

#: uint4 per work-item of the vector row kernels (rows.cl STRETCH).
ROW_STRETCH = 64

#: Work-items per work-group of the row-parallel kernels (scan, delta rule, conv) on GPUs.
ROWS_LOCAL_SIZE = 64

#: On CPU devices those kernels run as single-work-item groups, each walking
#: this many state rows (channels for the conv) in a loop.  PoCL otherwise
#: wraps a work-group in a loop over its work-items and vectorises across
#: them, which fights the kernels' own 8-wide vectors: measured with one
#: thread, Mamba-2 decode took 2x the time and the conv 1.5-2x.
ROWS_PER_ITEM_CPU = 64


# Kernel scalars go in as plain Python numbers: every kernel has its argument
# types declared (build.typed_kernel), which makes a call ~30x cheaper.
def _long(value: int) -> int:
    return int(value)


def _int(value: int | bool) -> int:
    return int(value)


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def _transfer_view(host: np.ndarray) -> np.ndarray:
    """Host arrays cross the pyopencl boundary as plain integer/float arrays
    (bf16 from ml_dtypes has no buffer-protocol format pyopencl knows)."""
    if host.dtype.itemsize == 2:
        return host.view(np.uint16)
    return host


def _serialized(method: Any) -> Any:
    """Run a launch sequence under the device's lock: clSetKernelArg on a shared
    kernel object and the shared scratch buffer are not safe across threads."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._launch_lock:
            return method(self, *args, **kwargs)

    return locked


class OpenCLDevice(Device):
    """One OpenCL device; the context, queue and kernels are created on first use."""

    def __init__(self, index: int, cl_platform: Any, cl_device: Any) -> None:
        import pyopencl as cl

        self.id = f"opencl:{index}"
        self.backend_name = "opencl"
        self.cl_platform = cl_platform
        self.cl_device = cl_device
        dev_type = int(cl_device.type)
        if dev_type & cl.device_type.GPU:
            self.kind = DeviceKind.GPU
        elif dev_type & cl.device_type.CPU:
            self.kind = DeviceKind.CPU
        else:
            self.kind = DeviceKind.ACCEL
        self.name = f"{cl_device.name.strip()} ({cl_platform.name.strip()})"
        self.memory_bytes: int | None = int(cl_device.global_mem_size)
        self.max_work_group_size = int(cl_device.max_work_group_size)
        self.caps = Caps(
            ops=frozenset(PRIMITIVES),
            # bf16 is stored as ushort with explicit round-to-nearest-even
            # conversions and f16 through vload_half/vstore_half_rte, both core
            # OpenCL C: every device can store all three.
            storage_dtypes=STORAGE_DTYPES,
            max_snapshots=64,
            strided_inputs=True,
            host_visible=False,
            async_launch=True,
            varlen=True,
            activation_dtypes=ACTIVATION_DTYPES,
            epilogues=frozenset(EPILOGUES),
        )
        self._lock = threading.Lock()
        # One launch sequence at a time: the kernels' arguments are set on shared
        # cl.Kernel objects and the prep kernels share one scratch buffer.
        self._launch_lock = threading.RLock()
        self._context: Any = None
        self._queue: Any = None
        self._kernels: build.KernelCache | None = None
        self._scratch: Any = None
        self._scratch_bytes = 0

    @property
    def properties(self) -> dict[str, Any]:
        props = super().properties
        props.update(
            platform=self.cl_platform.name.strip(),
            platform_version=self.cl_platform.version.strip(),
            device_version=self.cl_device.version.strip(),
            max_work_group_size=self.max_work_group_size,
        )
        return props

    # -- lazily created OpenCL objects ----------------------------------------
    def _setup(self) -> None:
        import pyopencl as cl

        with self._lock:
            if self._queue is None:
                self._context = cl.Context([self.cl_device])
                self._queue = cl.CommandQueue(self._context, self.cl_device)
                self._kernels = build.KernelCache(self._context, self.cl_device)

    @property
    def context(self) -> Any:
        if self._context is None:
            self._setup()
        return self._context

    @property
    def queue(self) -> Any:
        if self._queue is None:
            self._setup()
        return self._queue

    def kernel(self, family: str, name: str, pool_dtype: DType | None = None) -> Any:
        """A built ``cl.Kernel`` (the family is built on first use)."""
        if self._kernels is None:
            self._setup()
        assert self._kernels is not None
        return self._kernels.kernel(family, name, pool_dtype)

    def scratch(self, nbytes: int) -> Any:
        """A device buffer of at least ``nbytes`` for per-call temporaries.

        One buffer, grown on demand: the queue is in order, so a launch that
        reuses it runs after every earlier user of it has finished."""
        import pyopencl as cl

        if self._scratch is None or self._scratch_bytes < nbytes:
            size = max(_round_up(nbytes, 4096), 4096)
            self._scratch = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size=size)
            self._scratch_bytes = size
        return self._scratch

    # -- capabilities ---------------------------------------------------------
    def supports(self, op: str, **params: Any) -> Support:
        answer = super().supports(op, **params)
        if not answer:
            return answer
        d_conv = params.get("d_conv")
        if op == "ssm_conv" and d_conv is not None and int(d_conv) - 1 > build.MAX_WINDOW:
            return Support(False, f"{self.id} keeps conv windows of at most {build.MAX_WINDOW} (d_conv <= 33)")
        size = params.get("head_size")
        if (op == "gated_delta_net" or op in LINEAR_ATTN_PRIMITIVES) and size is not None:
            if int(size) > build.MAX_HEAD_SIZE:
                return Support(False, f"{self.id} runs {op} with head size <= {build.MAX_HEAD_SIZE}")
        return SUPPORTED

    # -- memory ---------------------------------------------------------------
    def _alloc(self, shape: tuple[int, ...], dtype: DType) -> Buffer:
        import pyopencl as cl

        nbytes = math.prod(shape) * dtype.itemsize
        # OpenCL refuses empty buffers; a 4-byte minimum keeps fill patterns aligned.
        size = max(_round_up(nbytes, 4), 4)
        storage = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, size=size)
        cl.enqueue_fill_buffer(self.queue, storage, np.uint32(0), 0, size)
        return Buffer(self, storage, dtype, shape)

    def _write(self, buffer: Buffer, host: np.ndarray) -> None:
        import pyopencl as cl

        if buffer.size == 0:
            return
        cl.enqueue_copy(
            self.queue,
            buffer.storage,
            _transfer_view(host).reshape(-1),
            dst_offset=buffer.offset * buffer.dtype.itemsize,
            is_blocking=True,  # the host array may be a temporary
        )

    def _read(self, buffer: Buffer) -> np.ndarray:
        import pyopencl as cl

        dt = buffer.dtype.numpy
        if buffer.size == 0:
            return np.empty(buffer.shape, dtype=dt)
        # Fetch the span the view covers, then apply its strides on the host.
        span = 1 + sum((n - 1) * s for n, s in zip(buffer.shape, buffer.strides, strict=True))
        flat = np.empty(span, dtype=dt)
        cl.enqueue_copy(
            self.queue,
            _transfer_view(flat),
            buffer.storage,
            src_offset=buffer.offset * buffer.dtype.itemsize,
            is_blocking=True,
        )
        if buffer.is_contiguous:
            return flat.reshape(buffer.shape)
        view = np.lib.stride_tricks.as_strided(
            flat, shape=buffer.shape, strides=tuple(s * flat.itemsize for s in buffer.strides)
        )
        return np.array(view, copy=True)

    def synchronize(self) -> None:
        if self._queue is not None:
            self._queue.finish()

    @_serialized
    def _copy_buffer(self, src: Buffer, dst: Buffer) -> None:
        """The native device copy (clEnqueueCopyBuffer): the memcpy bound."""
        import pyopencl as cl

        item = src.dtype.itemsize
        cl.enqueue_copy(
            self.queue,
            dst.storage,
            src.storage,
            byte_count=src.nbytes,
            src_offset=src.offset * item,
            dst_offset=dst.offset * item,
        )

    # -- rows -------------------------------------------------------------------
    def _launch_rows(self, src: Buffer, src_rows: Any, dst: Buffer, dst_rows: Any, n_rows: int, row_len: int) -> None:
        """``dst[dst_rows[i]] = convert(src[src_rows[i]])``; ``None`` rows mean identity."""
        if n_rows == 0 or row_len == 0:
            return
        gsize = (row_len, n_rows)
        if src.dtype is dst.dtype and self._vector_rows(row_len, src, dst):
            item = src.dtype.itemsize
            row_len4 = row_len * item // 16
            self.kernel("rows", "copy_rows_v16")(
                self.queue,
                (-(-row_len4 // ROW_STRETCH), n_rows),
                None,
                src.storage,
                src.offset * item // 4,
                src_rows,
                dst.storage,
                dst.offset * item // 4,
                dst_rows,
                row_len4,
            )
            return
        if src.dtype is dst.dtype:
            unit = "u32" if src.dtype.itemsize == 4 else "u16"
            knl = self.kernel("rows", f"copy_rows_{unit}")
            knl(
                self.queue,
                gsize,
                None,
                src.storage,
                _long(src.offset),
                src_rows,
                dst.storage,
                _long(dst.offset),
                dst_rows,
                _long(row_len),
            )
            return
        knl = self.kernel("rows", "copy_rows_convert")
        knl(
            self.queue,
            gsize,
            None,
            src.storage,
            _long(src.offset),
            _int(build.DTYPE_CODES[src.dtype]),
            src_rows,
            dst.storage,
            _long(dst.offset),
            _int(build.DTYPE_CODES[dst.dtype]),
            dst_rows,
            _long(row_len),
        )

    @staticmethod
    def _vector_rows(row_len: int, *buffers: Buffer) -> bool:
        """Whether rows can move as uint4: 16-byte multiples at 4-byte-aligned offsets."""
        item = buffers[0].dtype.itemsize
        return (row_len * item) % 16 == 0 and all((b.offset * item) % 4 == 0 for b in buffers)

    @_serialized
    def _get_rows(self, src: Buffer, rows: Buffer, dst: Buffer, rows_host: np.ndarray) -> None:
        self._launch_rows(src, self._index_storage(rows, rows_host), dst, None, dst.shape[0], dst.shape[1])

    @_serialized
    def _set_rows(self, dst: Buffer, rows: Buffer, src: Buffer, rows_host: np.ndarray) -> None:
        self._launch_rows(src, None, dst, self._index_storage(rows, rows_host), src.shape[0], src.shape[1])

    @_serialized
    def _copy_rows(
        self,
        src: Buffer,
        src_rows: Buffer,
        dst: Buffer,
        dst_rows: Buffer,
        src_rows_host: np.ndarray,
        dst_rows_host: np.ndarray,
    ) -> None:
        src_idx, dst_idx = self._index_storage(src_rows, src_rows_host), self._index_storage(dst_rows, dst_rows_host)
        self._launch_rows(src, src_idx, dst, dst_idx, src_rows.shape[0], src.shape[1])

    @_serialized
    def _zero_rows(self, dst: Buffer, rows: Buffer, rows_host: np.ndarray) -> None:
        n, row_len = rows.shape[0], dst.shape[1]
        if n == 0 or row_len == 0:
            return
        if self._vector_rows(row_len, dst):
            row_len4 = row_len * dst.dtype.itemsize // 16
            self.kernel("rows", "zero_rows_v16")(
                self.queue,
                (-(-row_len4 // ROW_STRETCH), n),
                None,
                dst.storage,
                dst.offset * dst.dtype.itemsize // 4,
                self._index_storage(rows, rows_host),
                row_len4,
            )
            return
        unit = "u32" if dst.dtype.itemsize == 4 else "u16"
        knl = self.kernel("rows", f"zero_rows_{unit}")
        rows_arg = self._index_storage(rows, rows_host)
        knl(self.queue, (row_len, n), None, dst.storage, _long(dst.offset), rows_arg, _long(row_len))

    # -- stateful primitives ------------------------------------------------------
    def _row_geometry(self, n_rows: int, n_seqs: int) -> tuple[tuple[int, int], tuple[int, int], int]:
        """Global size, local size and rows per work-item for a row-parallel kernel."""
        if self.kind is DeviceKind.CPU:
            per_item = ROWS_PER_ITEM_CPU
            return (-(-n_rows // per_item), n_seqs), (1, 1), per_item
        local = min(ROWS_LOCAL_SIZE, n_rows, self.max_work_group_size)
        return (_round_up(n_rows, local), n_seqs), (local, 1), 1

    def _index_storage(self, rows: Buffer, values: np.ndarray | None = None) -> Any:
        """What a kernel reads ``rows`` from.  The kernels take index arrays
        without an offset or strides, so a view into a larger index buffer is
        uploaded afresh (OpenCL keeps the copy alive until the launch has run)."""
        if rows.offset == 0 and rows.is_contiguous:
            return rows.storage
        import pyopencl as cl

        host = np.ascontiguousarray(self.index_values(rows) if values is None else values, dtype=np.int32)
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        return cl.Buffer(self.context, flags, hostbuf=host if host.size else np.zeros(1, np.int32))

    @staticmethod
    def _strided(buf: Buffer | None, ndim: int | None = None) -> list[Any]:
        """A read-only input as kernel arguments: storage, offset, strides
        (elements; ``ndim`` of them, padded with 0).  None gives a NULL
        buffer and zeros."""
        n = ndim if ndim is not None else (0 if buf is None else buf.ndim)
        if buf is None:
            return [None, _long(0), *([_long(0)] * n)]
        strides = [*buf.strides, *([0] * (n - buf.ndim))]
        return [buf.storage, _long(buf.offset), *(_long(v) for v in strides)]

    def _state_rows(self, shp: Any, start_rows: Buffer, snap_rows: Buffer, cu_seqlens: Buffer) -> list[Any]:
        """Index arguments of a stateful kernel (offsets in elements).  The
        table and offsets are contiguous; strided start rows are uploaded
        contiguously (the kernels index them densely)."""
        if not start_rows.is_contiguous:
            start_rows = self.indices(self.index_values(start_rows))
        return [
            start_rows.storage,
            _long(start_rows.offset),
            snap_rows.storage,
            _long(snap_rows.offset),
            _long(shp.n_cols),
            cu_seqlens.storage,
            _long(cu_seqlens.offset),
        ]

    def _widened(self, buf: Buffer | None, scratch: Any, at: int) -> list[Any]:
        """Kernel arguments of a per-token input: its own (storage, offset,
        strides), or for f16/bf16 those of a float32 copy widened into
        ``scratch`` at float offset ``at`` (contiguous)."""
        if buf is None or buf.dtype is DType.F32:
            return self._strided(buf)
        if buf.ndim == 2:
            n0, n1, n2 = buf.shape[0], 1, buf.shape[1]
            s0, s1, s2 = buf.strides[0], 0, buf.strides[1]
            strides = [n2, 1]
        else:
            n0, n1, n2 = buf.shape
            s0, s1, s2 = buf.strides
            strides = [n1 * n2, n2, 1]
        if buf.size:
            self.kernel("rows", "widen_act")(
                self.queue,
                (n2, n1, n0),
                None,
                buf.storage,
                _long(buf.offset),
                _int(build.DTYPE_CODES[buf.dtype]),
                _long(s0),
                _long(s1),
                _long(s2),
                _long(n1),
                _long(n2),
                scratch,
                _long(at),
            )
        return [scratch, _long(at), *(_long(v) for v in strides)]

    def _narrow(self, scratch: Any, at: int, out: Buffer) -> None:
        """Store a float32 result from ``scratch`` into an f16/bf16 output."""
        if out.size:
            self.kernel("rows", "narrow_act")(
                self.queue,
                (_round_up(out.size, 64),),
                None,
                scratch,
                _long(at),
                out.storage,
                _long(out.offset),
                _int(build.DTYPE_CODES[out.dtype]),
                _long(out.size),
            )

    @staticmethod
    def _plan(regions: dict[str, int], *buffers: tuple[str, Buffer | None]) -> dict[str, int]:
        """Float offsets in the scratch buffer: the given regions first, then
        one per non-f32 buffer (its widened copy or float32 result);
        ``"end"`` is the total."""
        at, offsets = 0, {}
        for name, size in [
            *regions.items(),
            *((n, b.size) for n, b in buffers if b is not None and b.dtype is not DType.F32),
        ]:
            offsets[name] = at
            at += int(size)
        offsets["end"] = at
        return offsets

    @_serialized
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
        plan = self._plan({}, ("x", x), ("y", y))
        scratch = self.scratch(4 * max(plan["end"], 1))
        y_args = [scratch, _long(plan["y"])] if "y" in plan else [y.storage, _long(y.offset)]
        knl = self.kernel("ssm_conv", "ssm_conv", pool.dtype)
        gsize, lsize, per_item = self._row_geometry(shp.channels, shp.n_seqs)
        knl(
            self.queue,
            gsize,
            lsize,
            pool.storage,
            _long(pool.offset),
            _long(shp.row_size),
            *self._state_rows(shp, start_rows, snap_rows, cu_seqlens),
            *self._widened(x, scratch, plan.get("x", 0)),
            *self._strided(weight),
            *self._strided(bias, 1),
            *y_args,
            _long(shp.channels),
            _long(shp.d_conv),
            _int(apply_silu),
            per_item,
        )
        if "y" in plan:
            self._narrow(scratch, plan["y"], y)

    @_serialized
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
        n_prep = max(shp.n_tokens * shp.n_head, 1)
        # scratch: softplus(dt), then the Mamba-2 decays; widened f16/bf16 inputs; a float32 y
        plan = self._plan({"prep": 2 * n_prep}, ("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z), ("y", y))
        prep = self.scratch(4 * plan["end"])
        x_args, dt_args = self._widened(x, prep, plan.get("x", 0)), self._widened(dt, prep, plan.get("dt", 0))
        B_args, C_args = self._widened(B, prep, plan.get("B", 0)), self._widened(C, prep, plan.get("C", 0))
        z_args = self._widened(z, prep, plan.get("z", 0)) if z is not None else self._strided(None, 3)
        y_args = [prep, _long(plan["y"])] if "y" in plan else [y.storage, _long(y.offset)]
        a_args = self._strided(A, 2)
        mamba1 = shp.variant == "mamba1"
        lo, hi = shp.dt_limit if shp.dt_limit is not None else (0.0, 0.0)
        if shp.n_tokens:
            self.kernel("ssm_scan", "ssm_scan_prep", pool.dtype)(
                self.queue,
                (shp.n_tokens,),
                None,
                *dt_args,
                *a_args[:3],
                _int(mamba1),
                *self._strided(dt_bias, 1),
                _int(shp.dt_limit is not None),
                float(lo),
                float(hi),
                prep,
                n_prep,
                _long(shp.n_tokens),
                _long(shp.n_head),
            )
        contiguous_k = B_args[-1] == 1 and C_args[-1] == 1 and (A.ndim == 1 or A.strides[1] == 1)
        name = "ssm_scan_vec8" if contiguous_k and shp.d_state % 8 == 0 else "ssm_scan"
        knl = self.kernel("ssm_scan", name, pool.dtype)
        gsize, lsize, per_item = self._row_geometry(shp.n_head * shp.head_dim, shp.n_seqs)
        d_args = self._strided(D, 2)  # D [n_head] gets stride 0 along head_dim
        knl(
            self.queue,
            gsize,
            lsize,
            pool.storage,
            _long(pool.offset),
            _long(shp.row_size),
            *self._state_rows(shp, start_rows, snap_rows, cu_seqlens),
            *x_args,
            prep,
            n_prep,
            *a_args,
            *B_args,
            *C_args,
            *y_args,
            *d_args,
            *z_args,
            _long(shp.n_head),
            _long(shp.head_dim),
            _long(shp.d_state),
            _long(shp.n_head // shp.n_group),
            _int(mamba1),
            per_item,
        )
        if "y" in plan:
            self._narrow(prep, plan["y"], y)

    @_serialized
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
        size, T = shp.head_size, shp.n_tokens
        per_head = size if shp.variant == "kda" else 1
        n_gate = T * shp.n_head_v * per_head
        beta_at = n_gate  # scratch: gates, then beta, then (with qk_l2norm) normalised q and k
        n_qk = T * shp.n_head_k * size
        qn_at = beta_at + T * shp.n_head_v
        kn_at = qn_at + n_qk
        regions = {"gates": kn_at + (n_qk if shp.qk_l2norm else 0)}
        plan = self._plan(regions, ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("o", o))
        scratch = self.scratch(4 * max(plan["end"], 1))
        q_args, k_args = self._widened(q, scratch, plan.get("q", 0)), self._widened(k, scratch, plan.get("k", 0))
        v_args = self._widened(v, scratch, plan.get("v", 0))
        g_args, beta_args = (
            self._widened(g, scratch, plan.get("g", 0)),
            self._widened(beta, scratch, plan.get("beta", 0)),
        )
        if len(g_args) == 4:  # scalar gate [T, H_v]: no per-key stride
            g_args.append(_long(0))
        o_args = [scratch, _long(plan["o"])] if "o" in plan else [o.storage, _long(o.offset)]
        if T:
            self.kernel("delta_net", "gated_delta_net_gate", pool.dtype)(
                self.queue,
                (T * shp.n_head_v,),
                None,
                *g_args,
                *beta_args,
                *self._strided(A_log, 1),
                *self._strided(dt_bias, 2),
                _int(shp.beta_sigmoid),
                scratch,
                _long(beta_at),
                _long(T),
                _long(shp.n_head_v),
                _long(per_head),
            )
        contiguous_i = q_args[-1] == 1 and k_args[-1] == 1
        if shp.qk_l2norm:
            if T:
                self.kernel("delta_net", "gated_delta_net_l2norm", pool.dtype)(
                    self.queue,
                    (2 * T * shp.n_head_k,),
                    None,
                    *q_args,
                    *k_args,
                    scratch,
                    _long(qn_at),
                    _long(kn_at),
                    _long(T),
                    _long(shp.n_head_k),
                    _long(size),
                    float(L2NORM_EPS),
                )
            row = [_long(shp.n_head_k * size), _long(size), _long(1)]
            q_args, k_args = [scratch, _long(qn_at), *row], [scratch, _long(kn_at), *row]
            contiguous_i = True
        name = "gated_delta_net_vec8" if contiguous_i and size % 8 == 0 else "gated_delta_net"
        knl = self.kernel("delta_net", name, pool.dtype)
        gsize, lsize, per_item = self._row_geometry(shp.n_head_v * size, shp.n_seqs)
        knl(
            self.queue,
            gsize,
            lsize,
            pool.storage,
            _long(pool.offset),
            _long(shp.row_size),
            *self._state_rows(shp, start_rows, snap_rows, cu_seqlens),
            *q_args,
            *k_args,
            *v_args,
            scratch,
            _long(beta_at),
            *o_args,
            _long(shp.n_head_k),
            _long(shp.n_head_v),
            _long(size),
            _int(shp.variant == "kda"),
            _int(shp.head_map == "grouped"),
            float(shp.scale),
            per_item,
        )
        if "o" in plan:
            self._narrow(scratch, plan["o"], o)

    @_serialized
    def _rwkv_wkv6(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, k, v, w, u, o):  # type: ignore[no-untyped-def]
        self._launch_linear_attn(shp, pool, (start_rows, snap_rows, cu_seqlens), {"q": r, "k": k, "v": v, "w": w}, u, o)

    @_serialized
    def _rwkv_wkv7(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, w, k, v, a, b, o):  # type: ignore[no-untyped-def]
        ins = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b}
        self._launch_linear_attn(shp, pool, (start_rows, snap_rows, cu_seqlens), ins, None, o)

    @_serialized
    def _gated_linear_attn(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, o):  # type: ignore[no-untyped-def]
        ins = {"q": q, "k": k, "v": v, "w": g}  # the log-gate in the decay's place
        self._launch_linear_attn(shp, pool, (start_rows, snap_rows, cu_seqlens), ins, None, o)

    def _launch_linear_attn(
        self,
        shp: P.LinearAttnShape,
        pool: Buffer,
        index: tuple[Buffer, Buffer, Buffer],
        ins: dict[str, Buffer],
        u: Buffer | None,
        o: Buffer,
    ) -> None:
        """RWKV-6 / GLA (``ins`` q, k, v, w: q is r for RWKV-6, w the log-gate for
        GLA) and RWKV-7 (r, w, k, v, a, b): the decays (and RWKV-6's bonus) by
        linear_attn_prep into scratch, then the column or row kernel."""
        T, H, S = shp.n_tokens, shp.n_head, shp.head_size
        rwkv6, rwkv7 = shp.variant == "rwkv6", shp.variant == "rwkv7"
        n_e = T * H * S
        bonus_at = n_e if rwkv6 else -1
        plan = self._plan({"e": n_e + (T * H if rwkv6 else 0)}, *ins.items(), ("o", o))
        scratch = self.scratch(4 * max(plan["end"], 1))
        args = {name: self._widened(buf, scratch, plan.get(name, 0)) for name, buf in ins.items()}
        o_args = [scratch, _long(plan["o"])] if "o" in plan else [o.storage, _long(o.offset)]
        none3 = self._strided(None, 3)
        if T:
            self.kernel("linear_attn", "linear_attn_prep", pool.dtype)(
                self.queue,
                (T * H,),
                None,
                *args["w"],
                *(args["q"] if rwkv6 else none3),
                *(args["k"] if rwkv6 else none3),
                *self._strided(u, 2),
                scratch,
                _long(bonus_at),
                float(shp.scale),
                _long(T),
                _long(H),
                _long(S),
            )
        rows = [pool.storage, _long(pool.offset), _long(shp.row_size), *self._state_rows(shp, *index)]
        unit_last = [args[name][-1] == 1 for name in (("r", "k", "a", "b") if rwkv7 else ("q", "k", "v"))]
        vec8 = S % 8 == 0 and all(unit_last)
        if rwkv7:
            knl = self.kernel("linear_attn", "rwkv_wkv7_vec8" if vec8 else "rwkv_wkv7", pool.dtype)
            gsize, lsize, per_item = self._row_geometry(H * S, shp.n_seqs)
            tokens = [*args["r"], *args["k"], *args["v"], *args["a"], *args["b"]]
            knl(self.queue, gsize, lsize, *rows, *tokens, scratch, *o_args, _long(H), _long(S), float(shp.scale),
                per_item)  # fmt: skip
        else:
            # Eight columns per work-item only on CPU devices: a GPU work-item cannot hold S float8 privately,
            # while neighbouring work-items of the scalar kernel read neighbouring columns (coalesced).
            vec8 = vec8 and self.kind is DeviceKind.CPU
            knl = self.kernel("linear_attn", "linear_attn_kv_vec8" if vec8 else "linear_attn_kv", pool.dtype)
            gsize, lsize, per_item = self._row_geometry(H * S // 8 if vec8 else H * S, shp.n_seqs)
            if vec8:
                per_item = max(1, per_item // 8)  # a unit is eight columns
                gsize = (-(-(H * S // 8) // per_item), shp.n_seqs)
            tokens = [*args["q"], *args["k"], *args["v"]]
            knl(self.queue, gsize, lsize, *rows, *tokens, scratch, _long(bonus_at), *o_args, _long(H), _long(S),
                _int(shp.variant == "gla"), float(shp.scale), per_item)  # fmt: skip
        if "o" in plan:
            self._narrow(scratch, plan["o"], o)


def _match(answer: str, candidates: list[Any], what: str) -> list[int]:
    """Indices of ``candidates`` an answer of PYOPENCL_CTX selects (index or name substring)."""
    answer = answer.strip()
    if not answer:
        return list(range(len(candidates)))
    try:
        index = int(answer)
    except ValueError:
        needle = answer.lower()
        return [i for i, c in enumerate(candidates) if needle in c.name.lower()]
    return [index] if 0 <= index < len(candidates) else []


class OpenCLBackend(Backend):
    name = "opencl"
    version = __version__
    priority = 20  # below the C CPU backend on a CPU-only machine, above the reference
    description = "OpenCL C kernels through pyopencl (any OpenCL 1.2+ platform; PoCL on CPUs)"
    provided_by = "statecache[opencl]"
    protocol = PROTOCOL_VERSION

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: list[Device] | None = None
        self._reason = ""

    def _discover(self) -> None:
        with self._lock:
            if self._devices is not None:
                return
            devices: list[Device] = []
            try:
                devices = self._enumerate()
            except ImportError as exc:
                self._reason = f"pyopencl is not installed ({exc}); install the 'opencl' extra: {EXTRA_HINT}"
            except Exception as exc:  # discovery must never crash
                self._reason = (
                    f"no usable OpenCL platform ({type(exc).__name__}: {exc}); install one, e.g. {INSTALL_HINT}"
                )
            self._devices = devices

    def _enumerate(self) -> list[Device]:
        import pyopencl as cl

        try:
            platforms = list(cl.get_platforms())
        except cl.Error as exc:
            # The ICD loader reports "no platform" as PLATFORM_NOT_FOUND_KHR.
            self._reason = f"no OpenCL platform found ({exc}); install one, e.g. {INSTALL_HINT}"
            return []
        if not platforms:
            self._reason = f"no OpenCL platform found; install one, e.g. {INSTALL_HINT}"
            return []
        pairs: list[tuple[Any, Any]] = []
        spec = settings.opencl_ctx()
        platform_part, _, device_part = (spec or "").partition(":")
        for pi in _match(platform_part, platforms, "platform"):
            platform = platforms[pi]
            try:
                devs = list(platform.get_devices())
            except cl.Error:  # a platform without devices (DEVICE_NOT_FOUND)
                devs = []
            for di in _match(device_part, devs, "device"):
                pairs.append((platform, devs[di]))
        if not pairs:
            if spec:
                listing = "; ".join(f"{pi}: {p.name.strip()}" for pi, p in enumerate(platforms))
                self._reason = f"PYOPENCL_CTX={spec!r} selects no OpenCL device (platforms: {listing})"
            else:
                self._reason = f"the OpenCL platforms list no devices; install one, e.g. {INSTALL_HINT}"
            return []
        return [OpenCLDevice(i, platform, dev) for i, (platform, dev) in enumerate(pairs)]

    def availability(self) -> tuple[bool, str]:
        self._discover()
        if self._devices:
            return True, ""
        return False, self._reason

    def devices(self) -> list[Device]:
        self._discover()
        return list(self._devices or [])
