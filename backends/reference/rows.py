"""Row primitives: gather, scatter, zero, copy.  Conversions go through
float32 so every backend rounds the same way."""

from __future__ import annotations

import numpy as np


def _convert(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if rows.dtype == dtype:
        return rows
    # NaN payloads and overflow to inf are defined results here, not errors.
    with np.errstate(invalid="ignore", over="ignore"):
        return rows.astype(np.float32).astype(dtype)


def get_rows(src: np.ndarray, rows: np.ndarray, dst: np.ndarray) -> None:
    dst[...] = _convert(src[rows], dst.dtype)


def set_rows(dst: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    dst[rows] = _convert(src, dst.dtype)


def zero_rows(dst: np.ndarray, rows: np.ndarray) -> None:
    dst[rows] = 0


def copy_rows(src: np.ndarray, src_rows: np.ndarray, dst: np.ndarray, dst_rows: np.ndarray) -> None:
    # Fancy indexing copies the source first, so reads precede writes.
    dst[dst_rows] = _convert(src[src_rows], dst.dtype)
