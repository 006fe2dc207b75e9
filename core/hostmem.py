"""Host-memory storage shared by backends whose buffers live in RAM.

Storage is one flat, 64-byte aligned NumPy array per allocation; a Buffer
(or a view of one) maps onto it with ``as_array``.  Alignment matters to the
C kernels (vector loads) and costs nothing here.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from statecache.backend import Buffer
from statecache.dtypes import DType
from statecache.errors import ArgumentError
from statecache.state_io import rows_landed, rows_ready

ALIGNMENT = 64


def physical_memory_bytes() -> int | None:
    """RAM of this machine, for host devices' ``memory_bytes`` (None if unknown)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def aligned_empty(n_elements: int, dtype: DType) -> np.ndarray:
    """A flat, zero-filled array whose data pointer is ALIGNMENT-aligned."""
    itemsize = dtype.itemsize
    nbytes = max(n_elements, 1) * itemsize
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGNMENT
    return raw[shift : shift + nbytes].view(dtype.numpy)[: max(n_elements, 0)]


def as_array(buf: Buffer) -> np.ndarray:
    """A NumPy view (no copy) of a host buffer with its shape and strides.

    The caller may write through it, so an index buffer is marked exported
    (:meth:`Buffer.mark_exported`), as ``np.asarray`` and DLPack exports mark
    it: its next validation reads the rows back instead of trusting the host
    copy of what statecache last wrote (a row rewritten here was once used
    unvalidated, out of range included).  Backends read and write their own
    buffers through :func:`host_view`, which marks nothing."""
    if buf.dtype is DType.I32:
        buf.mark_exported()
    return host_view(buf)


def host_view(buf: Buffer) -> np.ndarray:
    """:func:`as_array` for a backend's own reads and writes (their index
    buffers' host copies stay valid: :meth:`Device.write` keeps them)."""
    flat: np.ndarray = buf.storage
    if buf.is_contiguous:
        return flat[buf.offset : buf.offset + buf.size].reshape(buf.shape)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[buf.offset :], shape=buf.shape, strides=tuple(s * item for s in buf.strides), writeable=False
    )


def gather_rows(device: Any, buf: Buffer, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Rows ``idx`` of the 2-D buffer ``buf`` as host bytes (``uint8``, ``len(idx) * row
    bytes``), written into ``out`` when given.  Only those rows cross to the host: on a
    host-visible device one gather straight from the buffer's memory, elsewhere the
    device's ``get_rows`` into a buffer of just those rows and one download."""
    n_rows, width = int(idx.size), int(buf.shape[1])
    nbytes = n_rows * width * buf.dtype.itemsize
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    if not n_rows:
        return out
    dst = out.view(buf.dtype.numpy).reshape(n_rows, width)
    if device.caps.host_visible and isinstance(buf.storage, np.ndarray) and buf.is_contiguous:
        if idx.min() < 0 or idx.max() >= buf.shape[0]:
            raise ArgumentError("idx", f"rows outside [0, {buf.shape[0]})")
        device.synchronize()
        run = _as_run(idx)
        if run is not None:  # a sequence's cells are often one run: a plain copy
            np.copyto(dst, host_view(buf)[run])
        else:
            np.take(host_view(buf), idx, axis=0, out=dst, mode="clip")  # "raise" would buffer the whole output
        return out
    tmp = device.alloc((n_rows, width), buf.dtype)
    device.get_rows(buf, device.indices(idx), tmp)
    dst[...] = device.download(tmp)
    return out


def scatter_rows(device: Any, buf: Buffer, idx: np.ndarray, rows: np.ndarray) -> None:
    """``buf[idx[i]] = rows[i]`` for host rows already in ``buf``'s dtype and distinct
    ``idx`` (a restore's destination cells): one copy straight into a host-visible
    buffer's memory, elsewhere one upload and the device's ``set_rows``."""
    if not idx.size:
        return
    rows_ready(writing=True)  # a memory that did not wait for a transfer's rows before writing waits here
    if rows_landed(buf, idx, rows):  # a transfer received these rows straight into buf[idx]
        return
    if device.caps.host_visible and isinstance(buf.storage, np.ndarray) and buf.is_contiguous:
        if idx.min() < 0 or idx.max() >= buf.shape[0]:
            raise ArgumentError("idx", f"rows outside [0, {buf.shape[0]})")
        device.synchronize()
        flat: np.ndarray = buf.storage
        run = _as_run(idx)
        flat[buf.offset : buf.offset + buf.size].reshape(buf.shape)[idx if run is None else run] = rows
        return
    device.set_rows(buf, device.indices(idx), device.upload(rows, buf.dtype))


def row_run(device: Any, buf: Buffer, idx: np.ndarray) -> np.ndarray | None:
    """The rows ``idx`` of ``buf`` as one writable host array (a view of the buffer's
    memory, rows back to back) when they are one ascending run of a host-visible,
    contiguous buffer; else None.  A transfer receives rows straight into it."""
    if not (device.caps.host_visible and isinstance(buf.storage, np.ndarray) and buf.is_contiguous):
        return None
    if not idx.size or int(idx[0]) < 0 or int(idx[-1]) >= buf.shape[0]:
        return None
    run = _as_run(idx) if idx.size > 1 else slice(int(idx[0]), int(idx[0]) + 1)
    if run is None:
        return None
    flat: np.ndarray = buf.storage
    out: np.ndarray = flat[buf.offset : buf.offset + buf.size].reshape(buf.shape)[run]
    return out


def _as_run(idx: np.ndarray) -> slice | None:
    """``idx`` as a slice when it is one ascending run of rows (copies then need no index)."""
    first, n = int(idx[0]), int(idx.size)
    if n > 1 and int(idx[-1]) - first == n - 1 and bool((np.diff(idx) == 1).all()):
        return slice(first, first + n)
    return None
