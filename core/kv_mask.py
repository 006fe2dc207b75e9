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
    return build_mask_streams(
        [cells], None, token_pos, token_seq, n_kv, causal=causal, swa_type=swa_type, n_swa=n_swa, alibi=alibi,
        token_ext=token_ext,
    )  # fmt: skip


def build_mask_streams(
    streams: Sequence[KVCells],
    token_stream: np.ndarray | None,
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
    """:func:`build_mask` of tokens over several streams at once: row ``i`` is over the
    cells of ``streams[token_stream[i]]`` (``token_stream`` None: every token over
    ``streams[0]``).  One vectorised pass instead of one call per stream: a KV cache
    with a stream per sequence would otherwise build its decode mask in as many calls
    as it has sequences."""
    swa = SWAType.parse(swa_type)
    if swa is not SWAType.NONE and n_swa <= 0:
        raise ArgumentError("n_swa", f"sliding window {swa.value} needs n_swa > 0, got {n_swa}")
    size = min(c.size for c in streams)
    if not 0 < n_kv <= size:
        raise ArgumentError("n_kv", f"must be in [1, {size}], got {n_kv}")
    p1 = np.asarray(token_pos, dtype=np.int64).reshape(-1, 1)
    seqs = np.asarray(token_seq, dtype=np.int64)
    if seqs.shape[0] != p1.shape[0]:
        raise ArgumentError("token_seq", f"{seqs.shape[0]} entries for {p1.shape[0]} tokens")
    n_seq_max = min(c.n_seq_max for c in streams)
    if seqs.size and (seqs.min() < 0 or seqs.max() >= n_seq_max):
        raise ArgumentError("token_seq", f"sequence ids must be in [0, {n_seq_max})")
    if token_stream is None or len(streams) == 1:
        cells = streams[0]
        p0 = cells.pos[:n_kv].reshape(1, -1)
        held = cells.seq[:n_kv, :].T[seqs]
        ext_of_cells: np.ndarray | None = cells.ext[:n_kv].reshape(1, n_kv, 2)
    else:
        k = np.asarray(token_stream, dtype=np.int64)
        p0 = np.stack([c.pos[:n_kv] for c in streams])[k]  # [n_tokens, n_kv]
        held = np.stack([c.seq[:n_kv] for c in streams])[k, :, seqs]  # [n_tokens, n_kv]
        ext_of_cells = np.stack([c.ext[:n_kv] for c in streams])[k] if token_ext is not None else None
    visible = (p0 != EMPTY) & held
    if causal:
        future = p0 > p1
        if token_ext is not None:
            assert ext_of_cells is not None
            ext = np.asarray(token_ext, dtype=np.int64).reshape(-1, 2)
            cx, cy = ext_of_cells[..., 0], ext_of_cells[..., 1]
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
