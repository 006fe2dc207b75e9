"""Argument validation for the primitives, shared by every backend.

The contract itself (math, shapes, snapshot mapping) is documented on the
methods of :class:`statecache.backend.Device`.  This module checks a call
against it and returns the resolved sizes, so that every backend rejects the
same mistakes with the same message *before* any launch or write.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.errors import ArgumentError

if TYPE_CHECKING:
    from statecache.backend import Buffer, Device


@dataclasses.dataclass(frozen=True)
class StateWrite:
    """Sizes shared by the stateful primitives."""

    n_seqs: int
    n_tokens: int
    n_rows: int  # rows of the pool
    row_size: int  # elements per pool row
    n_snap: int
    plane_stride: int

    @property
    def n_written(self) -> int:
        """Planes written per sequence: min(n_tokens + 1, n_snap)."""
        return min(self.n_tokens + 1, self.n_snap)


@dataclasses.dataclass(frozen=True)
class ConvShape(StateWrite):
    channels: int
    d_conv: int
    has_bias: bool

    @property
    def window(self) -> int:
        return self.d_conv - 1


@dataclasses.dataclass(frozen=True)
class ScanShape(StateWrite):
    n_head: int
    head_dim: int
    d_state: int
    n_group: int
    variant: str  # "mamba1" | "mamba2"


@dataclasses.dataclass(frozen=True)
class DeltaShape(StateWrite):
    n_head_k: int
    n_head_v: int
    head_size: int
    variant: str  # "scalar" | "kda"


# Shapes are frozen, so equal sizes may share one instance: building a frozen
# dataclass costs microseconds (a setattr per field), a cache hit a hash of
# the sizes, and decode repeats the same sizes call after call.
@functools.lru_cache(maxsize=256)
def _conv_shape(*sizes: int | str | bool) -> ConvShape:
    return ConvShape(*sizes)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _scan_shape(*sizes: int | str) -> ScanShape:
    return ScanShape(*sizes)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _delta_shape(*sizes: int | str) -> DeltaShape:
    return DeltaShape(*sizes)  # type: ignore[arg-type]


# -- helpers ------------------------------------------------------------------


_BUFFER_CLASS: type | None = None


def _own(dev: Device, buf: object, name: str) -> Buffer:
    global _BUFFER_CLASS
    if _BUFFER_CLASS is None:  # backend.py imports this module: resolve lazily, once
        from statecache.backend import Buffer

        _BUFFER_CLASS = Buffer
    if not isinstance(buf, _BUFFER_CLASS):
        raise ArgumentError(name, f"expected a Buffer, got {type(buf).__name__}")
    if buf.device is not dev:  # type: ignore[attr-defined]
        raise ArgumentError(name, f"buffer lives on {buf.device.id}, not on {dev.id}")  # type: ignore[attr-defined]
    return buf  # type: ignore[return-value]


def _shape(buf: Buffer, name: str, expected: tuple[int, ...]) -> None:
    if buf.shape != expected:
        raise ArgumentError(name, f"shape {buf.shape} does not match expected {expected}")


def _f32(buf: Buffer, name: str) -> None:
    if buf.dtype is not DType.F32:
        raise ArgumentError(name, f"dtype {buf.dtype} must be f32")


def _storage(buf: Buffer, name: str) -> None:
    if buf.dtype not in STORAGE_DTYPES:
        raise ArgumentError(name, f"dtype {buf.dtype} is not a storage dtype (f32, f16, bf16)")


def _contig(buf: Buffer, name: str) -> None:
    if not buf.is_contiguous:
        raise ArgumentError(name, "must be contiguous")


@dataclasses.dataclass(frozen=True, slots=True)
class IndexFacts:
    """What validation needs to know about an index array, computed once per
    upload: decode steps reuse the same index buffers call after call."""

    values: np.ndarray  # int32, the host copy
    lo: int
    hi: int
    unique: bool


def index_facts(dev: Device, buf: Buffer) -> IndexFacts:
    host = buf.host_indices if buf.is_contiguous else None
    cached = buf._index_cache
    if host is not None and cached is not None and cached.values is host:
        return cached  # type: ignore[no-any-return]
    values = host if host is not None else np.asarray(dev.index_values(buf), dtype=np.int32)
    if values.size == 0:
        facts = IndexFacts(values, 0, -1, True)
    elif values.size <= 32:  # Python is faster than NumPy's reductions on a handful
        items = values.tolist()
        facts = IndexFacts(values, min(items), max(items), len(set(items)) == len(items))
    else:
        facts = IndexFacts(
            values, int(values.min()), int(values.max()), int(np.unique(values).size) == int(values.size)
        )
    if host is not None:
        buf._index_cache = facts
    return facts


def _index(dev: Device, buf: object, name: str, length: int | None = None) -> tuple[Buffer, IndexFacts]:
    b = _own(dev, buf, name)
    if b.dtype is not DType.I32:
        raise ArgumentError(name, f"dtype {b.dtype} must be i32")
    if b.ndim != 1:
        raise ArgumentError(name, f"must be 1-D, got shape {b.shape}")
    if length is not None and b.shape[0] != length:
        raise ArgumentError(name, f"length {b.shape[0]} does not match expected {length}")
    return b, index_facts(dev, b)


def _in_range(facts: IndexFacts, n: int, name: str) -> None:
    if facts.values.size and (facts.lo < 0 or facts.hi >= n):
        v = facts.values
        bad = int(v[(v < 0) | (v >= n)][0])
        raise ArgumentError(name, f"index {bad} out of range [0, {n})")


def _in_range_array(values: np.ndarray, n: int, name: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= n):
        bad = int(values[(values < 0) | (values >= n)][0])
        raise ArgumentError(name, f"index {bad} out of range [0, {n})")


def _unique(values: np.ndarray, name: str) -> None:
    if values.size != np.unique(values).size:
        vals, counts = np.unique(values, return_counts=True)
        raise ArgumentError(name, f"duplicate destination row {int(vals[counts > 1][0])}")


def _unique_facts(facts: IndexFacts, name: str) -> None:
    if not facts.unique:
        _unique(facts.values, name)


def _pool(dev: Device, pool: object, name: str = "pool") -> Buffer:
    b = _own(dev, pool, name)
    _storage(b, name)
    if b.ndim != 2:
        raise ArgumentError(name, f"must be 2-D [rows, row_size], got shape {b.shape}")
    _contig(b, name)
    return b


def _distinct_storage(out: Buffer, out_name: str, *others: tuple[Buffer | None, str]) -> None:
    for other, other_name in others:
        if other is not None and out.same_storage(other):
            raise ArgumentError(out_name, f"shares storage with {other_name}")


# -- rows ---------------------------------------------------------------------


def check_rows_op(dev: Device, op: str, *, src: Buffer, rows: Buffer, dst: Buffer, unique: bool = False) -> np.ndarray:
    src = _own(dev, src, "src")
    dst = _own(dev, dst, "dst")
    for b, n in ((src, "src"), (dst, "dst")):
        _storage(b, n)
        if b.ndim != 2:
            raise ArgumentError(n, f"must be 2-D [rows, row_size], got shape {b.shape}")
        _contig(b, n)
    if src.shape[1] != dst.shape[1]:
        raise ArgumentError("dst", f"row size {dst.shape[1]} does not match src row size {src.shape[1]}")
    _distinct_storage(dst, "dst", (src, "src"))
    if op == "get_rows":
        _, idx = _index(dev, rows, "rows", dst.shape[0])
        _in_range(idx, src.shape[0], "rows")
    else:
        _, idx = _index(dev, rows, "rows", src.shape[0])
        _in_range(idx, dst.shape[0], "rows")
        if unique:
            _unique_facts(idx, "rows")
    return idx.values


def check_zero_rows(dev: Device, *, dst: Buffer, rows: Buffer) -> np.ndarray:
    dst = _pool(dev, dst, "dst")
    _, idx = _index(dev, rows, "rows")
    _in_range(idx, dst.shape[0], "rows")
    return idx.values


def check_copy_rows(
    dev: Device, *, src: Buffer, src_rows: Buffer, dst: Buffer, dst_rows: Buffer
) -> tuple[np.ndarray, np.ndarray]:
    src = _pool(dev, src, "src")
    dst = _pool(dev, dst, "dst")
    if src.shape[1] != dst.shape[1]:
        raise ArgumentError("dst", f"row size {dst.shape[1]} does not match src row size {src.shape[1]}")
    _, s_idx = _index(dev, src_rows, "src_rows")
    _, d_idx = _index(dev, dst_rows, "dst_rows", s_idx.values.size)
    _in_range(s_idx, src.shape[0], "src_rows")
    _in_range(d_idx, dst.shape[0], "dst_rows")
    _unique_facts(d_idx, "dst_rows")
    if src.same_storage(dst):
        clash = np.intersect1d(s_idx.values, d_idx.values)
        if clash.size:
            raise ArgumentError("dst_rows", f"row {int(clash[0])} is both read and written in one copy")
    return s_idx.values, d_idx.values


# -- stateful -----------------------------------------------------------------


_INTEGER = (int, np.integer)  # a tuple: isinstance() with a union is slower, and this runs per call


def _state_rows(
    dev: Device,
    pool: Buffer,
    start_rows: object,
    dst_rows: object,
    n_seqs: int,
    n_tokens: int,
    n_snap: int,
    plane_stride: int,
) -> None:
    """Check start/destination rows and the planes a call will write."""
    n_rows = pool.shape[0]
    if not isinstance(n_snap, _INTEGER) or n_snap < 1:
        raise ArgumentError("n_snap", f"must be an integer >= 1, got {n_snap!r}")
    if n_snap > 1 and plane_stride <= 0:
        raise ArgumentError("plane_stride", "must be > 0 when n_snap > 1")
    if plane_stride < 0:
        raise ArgumentError("plane_stride", "must be >= 0")
    _, start = _index(dev, start_rows, "start_rows", n_seqs)
    _, dst = _index(dev, dst_rows, "dst_rows", n_seqs)
    _in_range(start, n_rows, "start_rows")
    n_written = min(n_tokens + 1, n_snap)
    if dst.lo < 0 or dst.hi + (n_written - 1) * plane_stride >= n_rows:
        written = dst.values.astype(np.int64)[:, None] + plane_stride * np.arange(n_written)[None, :]
        _in_range_array(written.ravel(), n_rows, "dst_rows")
    # Fast path (every decode step): destinations distinct and within one plane's
    # width, so planes cannot collide, and each sequence starts from its own row.
    one_plane = n_written == 1 or dst.hi - dst.lo < plane_stride
    if dst.unique and one_plane and (start_rows is dst_rows or np.array_equal(start.values, dst.values)):
        return
    written = dst.values.astype(np.int64)[:, None] + plane_stride * np.arange(n_written, dtype=np.int64)[None, :]
    if not (dst.unique and one_plane):
        _unique(written.ravel(), "dst_rows")
    # A start row may be one of the sequence's own outputs (in-place update or
    # rollback), never another sequence's: that read would race its write.
    flat = written.ravel()
    owner = np.repeat(np.arange(n_seqs), n_written)
    order = np.argsort(flat, kind="stable")
    flat_sorted, owner_sorted = flat[order], owner[order]
    st = start.values.astype(np.int64)
    pos = np.minimum(np.searchsorted(flat_sorted, st), flat_sorted.size - 1)
    clash = (flat_sorted[pos] == st) & (owner_sorted[pos] != np.arange(n_seqs))
    if clash.any():
        s = int(np.flatnonzero(clash)[0])
        raise ArgumentError(
            "start_rows",
            f"sequence {s} starts from row {int(st[s])}, which sequence {int(owner_sorted[pos[s]])} writes "
            "in the same call",
        )


def _input(dev: Device, buf: object, name: str, shape: tuple[int, ...]) -> Buffer:
    b = _own(dev, buf, name)
    _f32(b, name)
    _shape(b, name, shape)
    return b


def _output(dev: Device, buf: object, name: str, shape: tuple[int, ...]) -> Buffer:
    b = _input(dev, buf, name, shape)
    _contig(b, name)
    return b


def check_ssm_conv(
    dev: Device,
    *,
    pool: Buffer,
    start_rows: Buffer,
    dst_rows: Buffer,
    x: Buffer,
    weight: Buffer,
    y: Buffer,
    bias: Buffer | None,
    n_snap: int,
    plane_stride: int,
) -> ConvShape:
    pool = _pool(dev, pool)
    x = _own(dev, x, "x")
    if x.ndim != 3:
        raise ArgumentError("x", f"must be 3-D [n_seqs, n_tokens, channels], got shape {x.shape}")
    n_s, n_t, ch = x.shape
    if n_t < 1 or n_s < 1 or ch < 1:
        raise ArgumentError("x", f"empty shape {x.shape}")
    weight = _own(dev, weight, "weight")
    if weight.ndim != 2 or weight.shape[0] != ch:
        y_ch = _own(dev, y, "y").shape[-1:]
        if weight.ndim == 2 and y_ch == (weight.shape[0],):  # weight and y agree: x is the odd one out
            raise ArgumentError("x", f"shape {x.shape} has {ch} channels, weight and y have {weight.shape[0]}")
        raise ArgumentError("weight", f"shape {weight.shape} must be [channels={ch}, d_conv]")
    d_conv = weight.shape[1]
    if d_conv < 2:
        raise ArgumentError("weight", f"d_conv {d_conv} must be >= 2")
    _input(dev, x, "x", (n_s, n_t, ch))
    _input(dev, weight, "weight", (ch, d_conv))
    if bias is not None:
        _input(dev, bias, "bias", (ch,))
    if pool.shape[1] != ch * (d_conv - 1):
        if pool.shape[1] % ch == 0:  # a window of whole columns: the kernel width is what disagrees
            raise ArgumentError(
                "weight",
                f"d_conv {d_conv} needs pool rows of channels * (d_conv - 1) = {ch * (d_conv - 1)}, the pool's rows "
                f"hold {pool.shape[1]} (d_conv {pool.shape[1] // ch + 1})",
            )
        raise ArgumentError("pool", f"row size {pool.shape[1]} must be channels * (d_conv - 1) = {ch * (d_conv - 1)}")
    y = _output(dev, y, "y", (n_s, n_t, ch))
    _distinct_storage(y, "y", (pool, "pool"), (x, "x"), (weight, "weight"), (bias, "bias"))
    _state_rows(dev, pool, start_rows, dst_rows, n_s, n_t, n_snap, plane_stride)
    # Positional, in field order: StateWrite's, then ConvShape's.
    return _conv_shape(
        n_s, n_t, pool.shape[0], pool.shape[1], int(n_snap), int(plane_stride), ch, d_conv, bias is not None
    )


def check_ssm_scan(
    dev: Device,
    *,
    pool: Buffer,
    start_rows: Buffer,
    dst_rows: Buffer,
    x: Buffer,
    dt: Buffer,
    A: Buffer,
    B: Buffer,
    C: Buffer,
    y: Buffer,
    n_snap: int,
    plane_stride: int,
) -> ScanShape:
    pool = _pool(dev, pool)
    x = _own(dev, x, "x")
    if x.ndim != 4:
        raise ArgumentError("x", f"must be 4-D [n_seqs, n_tokens, n_head, head_dim], got shape {x.shape}")
    n_s, n_t, n_head, head_dim = x.shape
    if min(x.shape) < 1:
        raise ArgumentError("x", f"empty shape {x.shape}")
    B = _own(dev, B, "B")
    if B.ndim != 4 or B.shape[:2] != (n_s, n_t):
        raise ArgumentError("B", f"shape {B.shape} must be [n_seqs={n_s}, n_tokens={n_t}, n_group, d_state]")
    n_group, d_state = B.shape[2], B.shape[3]
    if n_group < 1 or d_state < 1 or n_head % n_group:
        raise ArgumentError("B", f"n_group {n_group} must divide n_head {n_head}")
    A = _own(dev, A, "A")
    if A.shape == (n_head,):
        variant = "mamba2"
    elif A.shape == (n_head, d_state):
        variant = "mamba1"
    else:
        dt_shape = _own(dev, dt, "dt").shape
        if A.ndim >= 1 and A.shape[0] != n_head and dt_shape == (n_s, n_t, A.shape[0]):  # x is the odd one out
            raise ArgumentError("x", f"shape {x.shape} has {n_head} heads, A and dt have {A.shape[0]}")
        raise ArgumentError("A", f"shape {A.shape} must be [n_head={n_head}] or [n_head={n_head}, d_state={d_state}]")
    if variant == "mamba1":
        if head_dim != 1 or n_group != 1:
            raise ArgumentError("A", "Mamba-1 (A of [n_head, d_state]) needs head_dim == 1 and n_group == 1")
        if n_snap != 1:
            raise ArgumentError("n_snap", f"Mamba-1 scans emit only the final state (n_snap == 1), got {n_snap}")
    # x, A and B are owned and their shapes were read from them: only their
    # dtype is left to check (in the same order as for the other inputs).
    _f32(x, "x")
    _input(dev, dt, "dt", (n_s, n_t, n_head))
    _f32(A, "A")
    _f32(B, "B")
    C_shape = _own(dev, C, "C").shape
    row = pool.shape[1]
    if C_shape != B.shape and row % (n_head * head_dim) == 0 and C_shape[-1:] == (row // (n_head * head_dim),):
        # C agrees with the pool's d_state: B is the odd one out
        raise ArgumentError("B", f"shape {B.shape} disagrees with C {C_shape} and the pool's d_state")
    _input(dev, C, "C", (n_s, n_t, n_group, d_state))
    if pool.shape[1] != n_head * head_dim * d_state:
        raise ArgumentError(
            "pool", f"row size {pool.shape[1]} must be n_head * head_dim * d_state = {n_head * head_dim * d_state}"
        )
    y = _output(dev, y, "y", (n_s, n_t, n_head, head_dim))
    _distinct_storage(y, "y", (pool, "pool"), (x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C"))
    _state_rows(dev, pool, start_rows, dst_rows, n_s, n_t, n_snap, plane_stride)
    # Positional, in field order: StateWrite's, then ScanShape's.
    return _scan_shape(
        n_s,
        n_t,
        pool.shape[0],
        pool.shape[1],
        int(n_snap),
        int(plane_stride),
        n_head,
        head_dim,
        d_state,
        n_group,
        variant,
    )


def check_gated_delta_net(
    dev: Device,
    *,
    pool: Buffer,
    start_rows: Buffer,
    dst_rows: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    g: Buffer,
    beta: Buffer,
    o: Buffer,
    n_snap: int,
    plane_stride: int,
) -> DeltaShape:
    pool = _pool(dev, pool)
    v = _own(dev, v, "v")
    if v.ndim != 4 or min(v.shape) < 1:
        raise ArgumentError("v", f"must be 4-D [n_seqs, n_tokens, H_v, S], got shape {v.shape}")
    n_s, n_t, h_v, size = v.shape
    q = _own(dev, q, "q")
    if q.ndim != 4 or q.shape[:2] != (n_s, n_t) or q.shape[3] != size:
        raise ArgumentError("q", f"shape {q.shape} must be [n_seqs={n_s}, n_tokens={n_t}, H_k, S={size}]")
    h_k = q.shape[2]
    if h_k < 1 or h_v % h_k:
        raise ArgumentError("q", f"H_k {h_k} must divide H_v {h_v}")
    _input(dev, q, "q", (n_s, n_t, h_k, size))
    _input(dev, k, "k", (n_s, n_t, h_k, size))
    _input(dev, v, "v", (n_s, n_t, h_v, size))
    g = _own(dev, g, "g")
    if g.shape == (n_s, n_t, h_v):
        variant = "scalar"
    elif g.shape == (n_s, n_t, h_v, size):
        variant = "kda"
    else:
        raise ArgumentError("g", f"shape {g.shape} must be [{n_s}, {n_t}, {h_v}] or [{n_s}, {n_t}, {h_v}, {size}]")
    _input(dev, g, "g", g.shape)
    _input(dev, beta, "beta", (n_s, n_t, h_v))
    if pool.shape[1] != h_v * size * size:
        raise ArgumentError("pool", f"row size {pool.shape[1]} must be H_v * S * S = {h_v * size * size}")
    o = _output(dev, o, "o", (n_s, n_t, h_v, size))
    _distinct_storage(o, "o", (pool, "pool"), (q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"))
    _state_rows(dev, pool, start_rows, dst_rows, n_s, n_t, n_snap, plane_stride)
    # Positional, in field order: StateWrite's, then DeltaShape's.
    return _delta_shape(n_s, n_t, pool.shape[0], pool.shape[1], int(n_snap), int(plane_stride), h_k, h_v, size, variant)
