"""Reference device: buffers are aligned NumPy arrays, kernels are NumPy.

Clear rather than fast: every stateful primitive computes in float64 and
rounds once when storing into the buffer's dtype.
"""

from __future__ import annotations

import numpy as np

from statecache import __version__
from statecache.backend import PRIMITIVES, PROTOCOL_VERSION, Backend, Buffer, Caps, Device, DeviceKind
from statecache.backends.reference import delta_net, linear_attn, rows, ssm_conv, ssm_scan
from statecache.dlpack import TensorMemory, host_flat
from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.hostmem import aligned_empty, host_view, physical_memory_bytes
from statecache.primitives import ACTIVATION_DTYPES, EPILOGUES


class ReferenceDevice(Device):
    def __init__(self) -> None:
        self.id = "reference:0"
        self.backend_name = "reference"
        self.kind = DeviceKind.CPU
        self.name = "NumPy reference (float64 math)"
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

    # memory
    def _alloc(self, shape: tuple[int, ...], dtype: DType) -> Buffer:
        n = int(np.prod(shape, dtype=np.int64))
        return Buffer(self, aligned_empty(n, dtype), dtype, shape)

    def _write(self, buffer: Buffer, host: np.ndarray) -> None:
        host_view(buffer)[...] = host

    def _read(self, buffer: Buffer) -> np.ndarray:
        return np.array(host_view(buffer), copy=True)

    def _import_memory(self, memory: TensorMemory, dtype: DType) -> Buffer | None:
        """Host tensors: a buffer over their memory, no copy."""
        if not memory.on_host:
            return None
        flat = host_flat(memory, dtype.numpy)
        return Buffer(self, flat, dtype, memory.shape, strides=memory.strides, capacity=flat.size)

    # primitives
    def _get_rows(self, src, rows_buf, dst, rows_host):  # type: ignore[no-untyped-def]
        rows.get_rows(host_view(src), rows_host, host_view(dst))

    def _set_rows(self, dst, rows_buf, src, rows_host):  # type: ignore[no-untyped-def]
        rows.set_rows(host_view(dst), rows_host, host_view(src))

    def _zero_rows(self, dst, rows_buf, rows_host):  # type: ignore[no-untyped-def]
        rows.zero_rows(host_view(dst), rows_host)

    def _copy_rows(self, src, src_rows, dst, dst_rows, src_host, dst_host):  # type: ignore[no-untyped-def]
        rows.copy_rows(host_view(src), src_host, host_view(dst), dst_host)

    def _ssm_conv(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, weight, bias, y, apply_silu):  # type: ignore[no-untyped-def]
        ssm_conv.ssm_conv(
            shp,
            host_view(pool),
            self.index_values(start_rows),
            self.index_values(snap_rows),
            self.index_values(cu_seqlens),
            host_view(x),
            host_view(weight),
            _opt(bias),
            host_view(y),
            apply_silu,
        )

    def _ssm_scan(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, dt, A, B, C, y, D, z, dt_bias):  # type: ignore[no-untyped-def]
        ssm_scan.ssm_scan(
            shp,
            host_view(pool),
            self.index_values(start_rows),
            self.index_values(snap_rows),
            self.index_values(cu_seqlens),
            *(host_view(t) for t in (x, dt, A, B, C, y)),
            _opt(D),
            _opt(z),
            _opt(dt_bias),
        )

    def _gated_delta_net(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, beta, o, A_log, dt_bias):  # type: ignore[no-untyped-def]
        delta_net.gated_delta_net(
            shp,
            host_view(pool),
            self.index_values(start_rows),
            self.index_values(snap_rows),
            self.index_values(cu_seqlens),
            *(host_view(t) for t in (q, k, v, g, beta, o)),
            _opt(A_log),
            _opt(dt_bias),
        )

    def _rwkv_wkv6(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, k, v, w, u, o):  # type: ignore[no-untyped-def]
        linear_attn.rwkv_wkv6(shp, host_view(pool), *self._rows(start_rows, snap_rows, cu_seqlens),
                              *(host_view(t) for t in (r, k, v, w, u, o)))  # fmt: skip

    def _rwkv_wkv7(self, shp, pool, start_rows, snap_rows, cu_seqlens, r, w, k, v, a, b, o):  # type: ignore[no-untyped-def]
        linear_attn.rwkv_wkv7(shp, host_view(pool), *self._rows(start_rows, snap_rows, cu_seqlens),
                              *(host_view(t) for t in (r, w, k, v, a, b, o)))  # fmt: skip

    def _gated_linear_attn(self, shp, pool, start_rows, snap_rows, cu_seqlens, q, k, v, g, o):  # type: ignore[no-untyped-def]
        linear_attn.gated_linear_attn(shp, host_view(pool), *self._rows(start_rows, snap_rows, cu_seqlens),
                                      *(host_view(t) for t in (q, k, v, g, o)))  # fmt: skip

    def _rows(self, *index_bufs: Buffer) -> tuple[np.ndarray, ...]:
        return tuple(self.index_values(b) for b in index_bufs)


def _opt(buf: Buffer | None) -> np.ndarray | None:
    return None if buf is None else host_view(buf)


class ReferenceBackend(Backend):
    name = "reference"
    version = __version__
    priority = 0  # chosen automatically only when nothing faster is usable
    description = "NumPy reference implementation (always available, slow)"
    provided_by = "statecache"
    protocol = PROTOCOL_VERSION

    def __init__(self) -> None:
        self._devices: list[Device] | None = None

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def devices(self) -> list[Device]:
        if self._devices is None:
            self._devices = [ReferenceDevice()]
        return self._devices
