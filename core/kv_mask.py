"""The attention mask of a ubatch over a KV stream (docs/memory-semantics.md#kv-mask), as NumPy.

``mask[i, j]`` is the additive bias of token ``i`` on cell ``j`` of the
stream that holds token ``i``'s primary sequence: ``0`` (or ``-|p_cell -
p_token|`` with ALiBi) when visible, ``-inf`` otherwise.  A cell is visible
iff it is non-empty, holds the token's primary sequence, is not in the
future (causal; a position tie is broken by the M-RoPE 2-D extension), and
is not hidden by the sliding window.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from statecache.errors import ArgumentError
from statecache.kv_cells import EMPTY, KVCells


class SWAType(enum.Enum):
    NONE = "none"
    STANDARD = "standard"
    CHUNKED = "chunked"
    SYMMETRIC = "symmetric"

    @classmethod
    def parse(cls, value: SWAType | str) -> SWAType:
        if isinstance(value, SWAType):
            return value
        for member in cls:
            if member.value == str(value).lower():
                return member
        raise ArgumentError("swa_type", f"unknown {value!r}; expected one of {', '.join(m.value for m in cls)}")


def is_masked_swa(n_swa: int, swa_type: SWAType, p0: np.ndarray | int, p1: np.ndarray | int) -> np.ndarray:
    """Whether a cell at ``p0`` is outside the window of a token at ``p1``.

    Vectorised over NumPy arrays (broadcasting).  ``n_swa <= 0`` with a
    window type other than NONE is a configuration error caught earlier.
    """
    p0 = np.asarray(p0, dtype=np.int64)
    p1 = np.asarray(p1, dtype=np.int64)
    if swa_type is SWAType.NONE:
        return np.zeros(np.broadcast(p0, p1).shape, dtype=bool)
    if swa_type is SWAType.STANDARD:
        return np.asarray((p1 - p0) >= n_swa)
    if swa_type is SWAType.CHUNKED:
        return np.asarray(p0 < (p1 // n_swa) * n_swa)
    if swa_type is SWAType.SYMMETRIC:
        return np.asarray(np.abs(p1 - p0) > n_swa // 2)
    raise ArgumentError("swa_type", f"unhandled {swa_type}")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def n_kv_for(used_max_p1: int, size: int, n_pad: int) -> int:
    """Cells the attention reads: the used extent padded to ``n_pad`` (at
    least one pad unit, so shapes stay stable), capped at the stream size."""
    return min(size, max(n_pad, round_up(used_max_p1, n_pad)))


def build_mask(
    cells: KVCells,
    token_pos: Sequence[int] | np.ndarray,
    token_seq: Sequence[int] | np.ndarray,
    n_kv: int,
    *,
    causal: bool = True,
    swa_type: SWAType | str = SWAType.NONE,
    n_swa: int = 0,
    alibi: bool = False,
    token_ext: np.ndarray | None = None,
) -> np.ndarray:
    """The float32 mask ``[n_tokens, n_kv]`` of some tokens over one stream.

    ``token_pos``/``token_seq``: each token's position and primary sequence.
    ``token_ext``: optional ``[n_tokens, 2]`` M-RoPE ``(x, y)``; with it a
    cell at the same temporal position is in the future when its ``(y, x)``
    is lexicographically greater than the token's.
    """
    swa = SWAType.parse(swa_type)
    if swa is not SWAType.NONE and n_swa <= 0:
        raise ArgumentError("n_swa", f"sliding window {swa.value} needs n_swa > 0, got {n_swa}")
    if not 0 < n_kv <= cells.size:
        raise ArgumentError("n_kv", f"must be in [1, {cells.size}], got {n_kv}")
    p1 = np.asarray(token_pos, dtype=np.int64).reshape(-1, 1)
    seqs = np.asarray(token_seq, dtype=np.int64)
    if seqs.shape[0] != p1.shape[0]:
        raise ArgumentError("token_seq", f"{seqs.shape[0]} entries for {p1.shape[0]} tokens")
    if seqs.size and (seqs.min() < 0 or seqs.max() >= cells.n_seq_max):
        raise ArgumentError("token_seq", f"sequence ids must be in [0, {cells.n_seq_max})")
    p0 = cells.pos[:n_kv].reshape(1, -1)
    visible = (p0 != EMPTY) & cells.seq[:n_kv, :].T[seqs]
    if causal:
        future = p0 > p1
        if token_ext is not None:
            ext = np.asarray(token_ext, dtype=np.int64).reshape(-1, 2)
            cx, cy = cells.ext[:n_kv, 0].reshape(1, -1), cells.ext[:n_kv, 1].reshape(1, -1)
            tx, ty = ext[:, 0:1], ext[:, 1:2]
            tie_later = (cy > ty) | ((cy == ty) & (cx > tx))
            future |= (p0 == p1) & tie_later
        visible &= ~future
    visible &= ~is_masked_swa(n_swa, swa, p0, p1)
    out = np.full(visible.shape, -np.inf, dtype=np.float32)
    if alibi:
        out[visible] = -np.abs(p0 - p1).astype(np.float32)[visible]
    else:
        out[visible] = 0.0
    return out
