"""The attention mask of a ubatch over a KV stream (docs/memory-semantics.md#kv-mask), as NumPy.

``mask[i, j]`` is the additive bias of token ``i`` on cell ``j`` of the
stream that holds token ``i``'s primary sequence: ``0`` (or ``-|p_cell -
p_token|`` with ALiBi) when visible, ``-inf`` otherwise.  A cell is visible
iff it is non-empty, holds the token's primary sequence, is not in the
future (causal; a position tie is broken by the M-RoPE 2-D extension), and
is not hidden by the sliding window.

Two builders give the same values: :func:`build_mask` reads the whole book
(the reference: every cell of the stream, every token), :func:`build_mask_seqs`
reads only the cells each token's sequence holds inside the token's causal
window (one slice of the sequence's ordered cells), so a decode step costs
what its tokens attend, not what the book holds.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import cast

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


def swa_visible_from(n_swa: int, swa_type: SWAType, p1: int) -> int:
    """The smallest position ``p0 <= p1`` that the window of a token at ``p1`` does not
    hide: every ``p0`` below it is hidden, none from it up to ``p1`` is (all window
    types hide more the further back a position is).  Very negative without a window."""
    if swa_type is SWAType.NONE:
        return -(2**62)
    if swa_type is SWAType.STANDARD:
        return p1 - n_swa + 1
    if swa_type is SWAType.CHUNKED:
        return (p1 // n_swa) * n_swa
    if swa_type is SWAType.SYMMETRIC:
        return p1 - n_swa // 2
    raise ArgumentError("swa_type", f"unhandled {swa_type}")


def swa_visible_from_many(n_swa: int, swa_type: SWAType, p1: np.ndarray) -> np.ndarray:
    """:func:`swa_visible_from` of every position in ``p1`` (int64, the same shape)."""
    # the rule is plain arithmetic, so NumPy applies it elementwise (a window cache's decode
    # step asks for all its sequences: no conversion when ``p1`` is int64 already)
    p1 = np.asarray(p1, dtype=np.int64)
    if swa_type is SWAType.NONE:
        return np.full(p1.shape, swa_visible_from(n_swa, swa_type, 0), dtype=np.int64)
    return cast(np.ndarray, swa_visible_from(n_swa, swa_type, cast(int, p1)))


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


def build_mask_seqs(
    streams: Sequence[KVCells],
    token_stream: Sequence[int] | np.ndarray,
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
    """:func:`build_mask` for tokens over several streams (row ``i`` is over stream
    ``token_stream[i]``), from the cells each token's sequence holds.

    Per sequence of the ubatch, one slice of its ordered ``(pos, cell)`` pairs
    (those a causal, windowed token can see) is read, and the visibility of
    every (token, cell) pair in it is computed at once: the time is that of
    filling ``[n_tokens, n_kv]`` with ``-inf`` plus the pairs the tokens
    attend, never a scan of the stream."""
    swa = SWAType.parse(swa_type)
    if swa is not SWAType.NONE and n_swa <= 0:
        raise ArgumentError("n_swa", f"sliding window {swa.value} needs n_swa > 0, got {n_swa}")
    size = streams[0].size
    if not 0 < n_kv <= size:
        raise ArgumentError("n_kv", f"must be in [1, {size}], got {n_kv}")
    pos = np.asarray(token_pos, dtype=np.int64).reshape(-1)
    seqs = np.asarray(token_seq, dtype=np.int64).reshape(-1)
    strm = np.asarray(token_stream, dtype=np.int64).reshape(-1)
    n_tok = pos.size
    if seqs.size != n_tok or strm.size != n_tok:
        raise ArgumentError("token_seq", f"{seqs.size} sequences and {strm.size} streams for {n_tok} tokens")
    n_seq_max = streams[0].n_seq_max
    if n_tok and (seqs.min() < 0 or seqs.max() >= n_seq_max):
        raise ArgumentError("token_seq", f"sequence ids must be in [0, {n_seq_max})")
    out = np.full((n_tok, n_kv), -np.inf, dtype=np.float32)
    if not n_tok:
        return out
    ext = None if token_ext is None else np.asarray(token_ext, dtype=np.int64).reshape(-1, 2)
    # tokens grouped by (stream, sequence): one slice of the sequence's pairs per group
    group_key = strm * n_seq_max + seqs
    order = np.argsort(group_key, kind="stable")
    keys_sorted = group_key[order]
    starts = np.flatnonzero(np.r_[True, keys_sorted[1:] != keys_sorted[:-1]])
    ends = np.r_[starts[1:], n_tok]
    symmetric_ahead = n_swa // 2 if swa is SWAType.SYMMETRIC else 0
    pair_keys: list[np.ndarray] = []
    pair_tok: list[np.ndarray | int] = []  # a group's tokens, or its one token (a decode step: built at the end)
    ties: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    pos_l, order_l = pos.tolist(), order.tolist()
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        g = int(keys_sorted[a])
        cells = streams[g // n_seq_max]
        sc = cells.seq_pos[g % n_seq_max]
        if not sc:
            continue
        if b - a == 1:
            row: np.ndarray | int = order_l[a]
            p_lo = p_hi = pos_l[order_l[a]]
        else:
            row = order[a:b]
            p_lo, p_hi = int(pos[row].min()), int(pos[row].max())
        first = swa_visible_from(n_swa, swa, p_lo) if swa is not SWAType.NONE else 0
        last = p_hi + symmetric_ahead if (causal or swa is SWAType.SYMMETRIC) else 2**31
        # the pairs in [first, last]: the whole sequence needs no search (a decode token of a
        # cache without a window sees every pair it holds)
        if first <= sc.first_pos() and last >= sc.last_pos():
            keys = sc.keys
        else:
            lo, hi = sc.span(first, last + 1)
            if lo == hi:
                continue
            keys = sc.keys[lo:hi]
        if isinstance(row, int):
            pair_keys.append(keys)
            pair_tok.append(row if ext is None else np.full(keys.size, row, dtype=np.int64))
        else:
            pair_keys.append(np.tile(keys, row.size))
            pair_tok.append(np.repeat(row, keys.size))
        if causal and ext is not None:
            ties.append((pair_keys[-1], pair_tok[-1], cells.ext))  # type: ignore[arg-type]  # arrays with ext
    if not pair_keys:
        return out
    k_all = np.concatenate(pair_keys) if len(pair_keys) > 1 else pair_keys[0]
    sizes = np.fromiter(map(len, pair_keys), dtype=np.int64, count=len(pair_keys))
    if all(isinstance(t, int) for t in pair_tok):
        t_all = np.repeat(np.asarray(pair_tok, dtype=np.int64), sizes)
    else:
        t_all = np.concatenate(
            [
                np.full(n, t, dtype=np.int64) if isinstance(t, int) else t
                for t, n in zip(pair_tok, sizes.tolist(), strict=True)
            ]
        )
    c_pos = k_all >> 32
    c_cell = k_all & 0xFFFFFFFF
    p1 = pos[t_all]
    visible = c_cell < n_kv
    if causal:
        visible &= c_pos <= p1
        if ext is not None:
            # M-RoPE: a cell at the token's temporal position is in the future when its
            # (y, x) is later than the token's (per group: each stream has its own extensions)
            later = np.zeros(k_all.size, dtype=bool)
            at = 0
            for keys, toks, cell_ext in ties:
                cells_g = keys & 0xFFFFFFFF
                cx, cy = cell_ext[cells_g, 0], cell_ext[cells_g, 1]
                tx, ty = ext[toks, 0], ext[toks, 1]
                later[at : at + keys.size] = (cy > ty) | ((cy == ty) & (cx > tx))
                at += keys.size
            visible &= ~((c_pos == p1) & later)
    visible &= ~is_masked_swa(n_swa, swa, c_pos, p1)
    t_vis, c_vis = t_all[visible], c_cell[visible]
    if alibi:
        out[t_vis, c_vis] = -np.abs(c_pos[visible] - p1[visible]).astype(np.float32)
    else:
        out[t_vis, c_vis] = 0.0
    return out
