"""Host-memory storage shared by backends whose buffers live in RAM.

Storage is one flat, 64-byte aligned NumPy array per allocation; a Buffer
(or a view of one) maps onto it with ``as_array``.  Alignment matters to the
C kernels (vector loads) and costs nothing here.
"""

from __future__ import annotations

import os

import numpy as np

from statecache.backend import Buffer
from statecache.dtypes import DType

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
    """A NumPy view (no copy) of a host buffer with its shape and strides."""
    flat: np.ndarray = buf.storage
    if buf.is_contiguous:
        return flat[buf.offset : buf.offset + buf.size].reshape(buf.shape)
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[buf.offset :], shape=buf.shape, strides=tuple(s * item for s in buf.strides), writeable=False
    )
