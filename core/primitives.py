"""Argument validation for the primitives, shared by every backend.

The contract itself (math, shapes, snapshot mapping) is documented on the
methods of :class:`statecache.backend.Device`.  This module checks a call
against it and returns the resolved sizes, so that every backend rejects the
same mistakes with the same message *before* any launch or write.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from statecache.dtypes import STORAGE_DTYPES, DType
from statecache.errors import ArgumentError

if TYPE_CHECKING:
    from statecache.backend import Buffer, Device


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
        items = values.ravel().tolist()
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
#
# Backends see one form of every stateful call (protocol 2):
#
# * tokens packed along one axis: every per-token argument is [T, ...] with
#   the tokens of sequence s at [cu_seqlens[s], cu_seqlens[s + 1]);
# * snapshot rows as a table ``snap_rows`` int32 [n_seqs, n_cols]: column j
#   of sequence s is the pool row that receives its state after
#   n_t(s) - j tokens, -1 where nothing is written.
#
# The public methods also take the equal-length form ([n_s, n_t, ...] inputs)
# and 1-D destination rows with ``n_snap`` / ``plane_stride``; the helpers
# below validate both and turn them into the packed form: views of the
# caller's buffers (merging the sequence and token axes) and small derived
# index buffers, cached so that a repeated decode call pays for none of it.

_INTEGER = (int, np.integer)  # a tuple: isinstance() with a union is slower, and this runs per call

#: Fused epilogues, by primitive (``Caps.epilogues``, ``supports(op, epilogues=...)``).
SCAN_EPILOGUES: tuple[str, ...] = ("dt_bias", "dt_limit", "D", "z")
DELTA_EPILOGUES: tuple[str, ...] = ("grouped_heads", "qk_l2norm", "raw_gate", "beta_sigmoid")
EPILOGUES: tuple[str, ...] = SCAN_EPILOGUES + DELTA_EPILOGUES

#: q/k head mappings of gated_delta_net: value head h reads q/k head
#: ``h % H_k`` (tiled, llama.cpp) or ``h // (H_v // H_k)`` (grouped:
#: transformers, flash-linear-attention, vLLM).
HEAD_MAPS: tuple[str, ...] = ("tiled", "grouped")

#: Added to the sum of squares before the square root of the in-kernel q/k
#: L2 normalisation: ``q / sqrt(sum(q * q) + eps)``, as flash-linear-attention's
#: l2norm and transformers' Qwen3-Next do.
L2NORM_EPS = 1e-6

#: Dtypes a per-token activation (x, dt, B, C, z, y, q, k, v, g, beta, o) may
#: have; each device says which it takes in ``Caps.activation_dtypes``.
ACTIVATION_DTYPES: frozenset[DType] = STORAGE_DTYPES


@dataclasses.dataclass(frozen=True)
class StateWrite:
    """Sizes shared by the stateful primitives, in the packed form backends see."""

    n_seqs: int
    n_tokens: int  # T: every sequence's tokens along one axis
    max_tokens: int  # the longest sequence's token count (scratch sizes)
    n_rows: int  # rows of the pool
    row_size: int  # elements per pool row
    n_cols: int  # snapshot columns: snap_rows is [n_seqs, n_cols]
    equal_tokens: int  # n_t when every sequence has n_t tokens, else -1


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
    dt_limit: tuple[float, float] | None  # NaN-preserving clamp of softplus(dt + dt_bias), or None


@dataclasses.dataclass(frozen=True)
class DeltaShape(StateWrite):
    n_head_k: int
    n_head_v: int
    head_size: int
    variant: str  # "scalar" | "kda"
    head_map: str  # "tiled" | "grouped"
    qk_l2norm: bool
    raw_gate: bool  # g holds the raw projection a: gate = -exp(A_log) * softplus(a + dt_bias)
    beta_sigmoid: bool  # beta holds the raw projection b: beta = sigmoid(b)
    scale: float  # of the output: o = scale * M^T q

    def qk_head(self, h: int) -> int:
        """The q/k head value head ``h`` reads."""
        if self.head_map == "grouped":
            return h // (self.n_head_v // self.n_head_k)
        return h % self.n_head_k


@dataclasses.dataclass(frozen=True)
class LinearAttnShape(StateWrite):
    """Sizes of ``rwkv_wkv6``, ``rwkv_wkv7`` and ``gated_linear_attn``: ``n_head``
    heads of ``head_size`` keys and values, each with a [head_size, head_size]
    state block (layout per variant: see the primitives' docstrings)."""

    n_head: int
    head_size: int
    variant: str  # "rwkv6" | "rwkv7" | "gla"
    scale: float  # of the output


def scan_epilogues(shape: ScanShape, D: object, z: object, dt_bias: object) -> frozenset[str]:
    """The fused epilogues (``Caps.epilogues`` names) a validated ``ssm_scan`` call uses;
    ``shape.dt_limit`` is None for a limit that clamps nothing."""
    given = (("dt_bias", dt_bias), ("dt_limit", shape.dt_limit), ("D", D), ("z", z))
    return frozenset(name for name, value in given if value is not None)


def delta_epilogues(shape: DeltaShape, A_log: object) -> frozenset[str]:
    """The fused options (``Caps.epilogues`` names) a validated ``gated_delta_net`` call uses."""
    given = (
        ("grouped_heads", shape.head_map == "grouped"),
        ("qk_l2norm", shape.qk_l2norm),
        ("raw_gate", A_log is not None),
        ("beta_sigmoid", shape.beta_sigmoid),
    )
    return frozenset(name for name, used in given if used)


# Shapes are frozen, so equal sizes may share one instance: building a frozen
# dataclass costs microseconds (a setattr per field), a cache hit a hash of
# the sizes, and decode repeats the same sizes call after call.
@functools.lru_cache(maxsize=256)
def _conv_shape(*sizes: object) -> ConvShape:
    return ConvShape(*sizes)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _scan_shape(*sizes: object) -> ScanShape:
    return ScanShape(*sizes)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _delta_shape(*sizes: object) -> DeltaShape:
    return DeltaShape(*sizes)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=256)
def _linear_attn_shape(*sizes: object) -> LinearAttnShape:
    return LinearAttnShape(*sizes)  # type: ignore[arg-type]


class StateCall(NamedTuple):
    """What validating one stateful call resolved, kept by the launch memo.

    ``snap_rows`` / ``cu_seqlens``: derived int32 buffers (the snapshot
    table of a 1-D ``dst_rows``, the offsets of the equal-length form), or
    None where the caller's own argument is already in that form (a 1-D
    ``dst_rows`` with ``n_snap == 1`` is the one-column table).  Neither
    references a caller's storage, so the memo may hold them.  ``packed``:
    the caller passed the packed form, so its per-token buffers go to the
    backend as they are (else :func:`token_view` merges their first two
    axes).  ``copied``: a per-token argument could not be viewed as packed
    and was copied for this call, which therefore cannot be remembered.
    (A named tuple: built on every validated call, and faster than a frozen
    dataclass.)
    """

    shape: StateWrite
    snap_rows: Buffer | None
    cu_seqlens: Buffer | None
    packed: bool
    copied: bool = False


def token_view(buf: Buffer) -> Buffer | None:
    """``buf`` [n_s, n_t, *tail] as [n_s * n_t, *tail] over the same storage
    (cached on the buffer: its geometry never changes), or None when its
    strides cannot express the merged axis."""
    cached = buf._tokens
    if cached is not None:
        return cached
    n_s, n_t = buf.shape[0], buf.shape[1]
    s0, s1 = buf.strides[0], buf.strides[1]
    if n_t == 1:
        step = s0
    elif n_s == 1 or s0 == n_t * s1:
        step = s1
    else:
        return None
    view = buf.view((n_s * n_t, *buf.shape[2:]), (step, *buf.strides[2:]))
    buf._tokens = view
    return view


def packed_tokens(dev: Device, call: StateCall, *bufs: Buffer | None) -> tuple[Buffer | None, ...]:
    """The per-token arguments of a validated call in the packed form."""
    if call.packed:
        return bufs
    out: list[Buffer | None] = []
    for buf in bufs:
        if buf is None:
            out.append(None)
            continue
        view = token_view(buf)
        if view is None:
            # Strides that cannot express one token axis: a contiguous copy
            # (through the host; slow, and such calls are never remembered).
            view = token_view(dev.upload(dev.download(buf), buf.dtype))
            assert view is not None
        out.append(view)
    return tuple(out)


def _activation(dev: Device, buf: object, name: str, shape: tuple[int, ...]) -> Buffer:
    b = _own(dev, buf, name)
    dt = b.dtype
    # identity tests: `in` a set of enums hashes in Python, and this runs per argument
    if dt is not DType.F32 and dt is not DType.F16 and dt is not DType.BF16:
        raise ArgumentError(name, f"dtype {b.dtype} must be f32, f16 or bf16")
    _shape(b, name, shape)
    return b


def _param(dev: Device, buf: object, name: str, shape: tuple[int, ...]) -> Buffer:
    """A weight-like f32 input (A, D, dt_bias, A_log, conv weight and bias)."""
    b = _own(dev, buf, name)
    _f32(b, name)
    _shape(b, name, shape)
    return b


def _output(dev: Device, buf: object, name: str, shape: tuple[int, ...]) -> Buffer:
    b = _activation(dev, buf, name, shape)
    _contig(b, name)
    return b


@dataclasses.dataclass(frozen=True, slots=True)
class _Tokens:
    """The token axes of a call: ``lead`` prefixes every per-token shape."""

    lead: tuple[int, ...]  # (n_s, n_t) equal-length, (T,) packed
    n_seqs: int
    n_tokens: int
    max_tokens: int
    equal: int  # n_t of the equal-length form (or of a packed call whose sequences are all that long), else -1
    lengths: np.ndarray | None  # per-sequence tokens of the packed form (None: all `equal`)
    cu: IndexFacts | None


def _token_axes(dev: Device, first: Buffer, name: str, tail: str, n_tail: int, cu_seqlens: object) -> _Tokens:
    """Read the token axes from the first per-token argument (and cu_seqlens)."""
    if cu_seqlens is None:
        if first.ndim != 2 + n_tail:
            raise ArgumentError(
                name,
                f"must be {2 + n_tail}-D [n_seqs, n_tokens, {tail}] (or {1 + n_tail}-D [n_tokens, {tail}] with "
                f"cu_seqlens), got shape {first.shape}",
            )
        n_s, n_t = first.shape[0], first.shape[1]
        if n_s < 1 or n_t < 1 or min(first.shape[2:], default=1) < 1:
            raise ArgumentError(name, f"empty shape {first.shape}")
        return _Tokens((n_s, n_t), n_s, n_s * n_t, n_t, n_t, None, None)
    if first.ndim != 1 + n_tail:
        raise ArgumentError(name, f"must be {1 + n_tail}-D [n_tokens, {tail}] with cu_seqlens, got shape {first.shape}")
    if min(first.shape[1:], default=1) < 1:
        raise ArgumentError(name, f"empty shape {first.shape}")
    n_tokens = first.shape[0]
    cu_buf = _own(dev, cu_seqlens, "cu_seqlens")
    if cu_buf.dtype is not DType.I32:
        raise ArgumentError("cu_seqlens", f"dtype {cu_buf.dtype} must be i32")
    if cu_buf.ndim != 1 or cu_buf.shape[0] < 2:
        raise ArgumentError("cu_seqlens", f"must be 1-D [n_seqs + 1] with n_seqs >= 1, got shape {cu_buf.shape}")
    _contig(cu_buf, "cu_seqlens")
    facts = index_facts(dev, cu_buf)
    cu = facts.values.astype(np.int64)
    if cu[0] != 0:
        raise ArgumentError("cu_seqlens", f"must start at 0, got {int(cu[0])}")
    lengths = np.diff(cu)
    if (lengths < 0).any():
        s = int(np.flatnonzero(lengths < 0)[0])
        raise ArgumentError("cu_seqlens", f"must not decrease: entry {s + 1} is {int(cu[s + 1])} < {int(cu[s])}")
    if cu[-1] != n_tokens:
        raise ArgumentError("cu_seqlens", f"ends at {int(cu[-1])}, but {name} holds {n_tokens} tokens")
    n_s = lengths.size
    longest = int(lengths.max())
    equal = longest if int(lengths.min()) == longest else -1
    return _Tokens((n_tokens,), n_s, n_tokens, longest, equal, lengths, facts)


def _lengths_of(tok: _Tokens) -> np.ndarray:
    if tok.lengths is not None:
        return tok.lengths
    return np.full(tok.n_seqs, tok.equal, dtype=np.int64)


def _index2(dev: Device, buf: Buffer, name: str, n_rows_expected: int) -> IndexFacts:
    if buf.dtype is not DType.I32:
        raise ArgumentError(name, f"dtype {buf.dtype} must be i32")
    if buf.shape[0] != n_rows_expected:
        raise ArgumentError(name, f"has {buf.shape[0]} rows, expected one per sequence ({n_rows_expected})")
    if buf.shape[1] < 1:
        raise ArgumentError(name, f"needs at least one snapshot column, got shape {buf.shape}")
    _contig(buf, name)
    return index_facts(dev, buf)


def _check_table(table: np.ndarray, start: np.ndarray, lengths: np.ndarray, n_rows: int) -> None:
    """Every rule on a snapshot table [n_s, n_cols] (argument ``dst_rows``)."""
    n_s, n_cols = table.shape
    bad = (table < -1) | (table >= n_rows)
    if bad.any():
        s, j = (int(i) for i in np.argwhere(bad)[0])
        raise ArgumentError(
            "dst_rows", f"row {int(table[s, j])} (sequence {s}, column {j}) is neither -1 nor in [0, {n_rows})"
        )
    past = (np.arange(n_cols)[None, :] > lengths[:, None]) & (table >= 0)
    if past.any():
        s, j = (int(i) for i in np.argwhere(past)[0])
        raise ArgumentError(
            "dst_rows",
            f"sequence {s} has {int(lengths[s])} tokens, so column {j} (its state {j} tokens before the end) "
            f"does not exist and must be -1, got row {int(table[s, j])}",
        )
    flat = table.ravel().astype(np.int64)
    owner = np.repeat(np.arange(n_s), n_cols)
    kept = flat >= 0
    flat, owner = flat[kept], owner[kept]
    if flat.size != np.unique(flat).size:
        _unique(flat, "dst_rows")
    if flat.size == 0:
        return
    # A start row may be one of the sequence's own outputs (in-place update or
    # rollback), never another sequence's: that read would race its write.
    order = np.argsort(flat, kind="stable")
    flat_sorted, owner_sorted = flat[order], owner[order]
    st = start.astype(np.int64)
    pos = np.minimum(np.searchsorted(flat_sorted, st), flat_sorted.size - 1)
    clash = (flat_sorted[pos] == st) & (owner_sorted[pos] != np.arange(n_s))
    if clash.any():
        s = int(np.flatnonzero(clash)[0])
        raise ArgumentError(
            "start_rows",
            f"sequence {s} starts from row {int(st[s])}, which sequence {int(owner_sorted[pos[s]])} writes "
            "in the same call",
        )


def snapshot_table(dst: np.ndarray, n_snap: int, plane_stride: int, lengths: np.ndarray) -> np.ndarray:
    """The snapshot table [n_s, n_snap] of 1-D destination rows: column j is
    ``dst + j * plane_stride`` while j <= the sequence's tokens, else -1."""
    cols = np.arange(n_snap, dtype=np.int64)
    table = dst.astype(np.int64)[:, None] + plane_stride * cols[None, :]
    table[cols[None, :] > lengths[:, None]] = -1
    return table.astype(np.int32)


def _derived_table(
    dev: Device, dst_rows: Buffer, facts: IndexFacts, n_snap: int, plane_stride: int, tok: _Tokens
) -> Buffer:
    """The snapshot table of a 1-D dst_rows as a device buffer, cached on
    dst_rows for as long as its contents and the token lengths are the same."""
    cu_values = None if tok.cu is None else tok.cu.values
    key = (n_snap, plane_stride, tok.equal if cu_values is None else -1)
    cache = dst_rows._derived
    if cache is None:
        cache = dst_rows._derived = {}
    hit = cache.get(key)
    if hit is not None and hit[0] is facts.values and hit[1] is cu_values:
        cached: Buffer = hit[2]
        return cached
    table = snapshot_table(facts.values, n_snap, plane_stride, _lengths_of(tok))
    buf = dev.indices(table)
    if len(cache) >= 8:  # a handful of (n_snap, lengths) per index buffer in practice
        cache.clear()
    if facts.values is dst_rows.host_indices:  # only what validation saw may be reused
        cache[key] = (facts.values, cu_values, buf)
    return buf


def _state_rows(
    dev: Device,
    pool: Buffer,
    start_rows: object,
    dst_rows: object,
    tok: _Tokens,
    n_snap: int,
    plane_stride: int,
) -> tuple[Buffer | None, int]:
    """Check start and destination rows and the rows a call will write.

    Returns the derived snapshot table (None when ``dst_rows`` is already
    one) and the number of snapshot columns."""
    n_rows, n_seqs = pool.shape[0], tok.n_seqs
    _, start = _index(dev, start_rows, "start_rows", n_seqs)
    _in_range(start, n_rows, "start_rows")
    dst_buf = _own(dev, dst_rows, "dst_rows")
    if dst_buf.ndim == 2:
        if n_snap != 1 or plane_stride != 0:
            raise ArgumentError(
                "n_snap" if n_snap != 1 else "plane_stride",
                "must stay at its default with 2-D dst_rows: the table's columns are the snapshot rows",
            )
        facts = _index2(dev, dst_buf, "dst_rows", n_seqs)
        _check_table(facts.values, start.values, _lengths_of(tok), n_rows)
        return None, dst_buf.shape[1]
    if not isinstance(n_snap, _INTEGER) or n_snap < 1:
        raise ArgumentError("n_snap", f"must be an integer >= 1, got {n_snap!r}")
    if not isinstance(plane_stride, _INTEGER) or plane_stride < 0:
        raise ArgumentError("plane_stride", f"must be an integer >= 0, got {plane_stride!r}")
    if n_snap > 1 and plane_stride <= 0:
        raise ArgumentError("plane_stride", "must be > 0 when n_snap > 1")
    if dst_buf.ndim != 1:
        raise ArgumentError("dst_rows", f"must be 1-D [n_seqs] or 2-D [n_seqs, n_cols], got shape {dst_buf.shape}")
    _, dst = _index(dev, dst_buf, "dst_rows", n_seqs)
    n_written = min(tok.max_tokens + 1, n_snap)
    if dst.lo < 0 or dst.hi + (n_written - 1) * plane_stride >= n_rows:
        table = snapshot_table(dst.values, n_snap, plane_stride, _lengths_of(tok)).astype(np.int64)
        _in_range_array(table[table != -1] if dst.lo >= 0 else dst.values, n_rows, "dst_rows")
    # Fast path (every decode step): destinations distinct and within one plane's
    # width, so planes cannot collide, and each sequence starts from its own row.
    one_plane = n_written == 1 or dst.hi - dst.lo < plane_stride
    if not (dst.unique and one_plane and (start_rows is dst_rows or np.array_equal(start.values, dst.values))):
        table = snapshot_table(dst.values, n_snap, plane_stride, _lengths_of(tok))
        _check_table(table, start.values, _lengths_of(tok), n_rows)
    if n_snap == 1 and dst_buf.is_contiguous:
        return None, 1  # one column: the 1-D rows are the table ([n_s] and [n_s, 1] share their bytes)
    return _derived_table(dev, dst_buf, dst, n_snap, plane_stride, tok), n_snap


def _cu_buffer(dev: Device, tok: _Tokens) -> Buffer | None:
    """The offsets of the equal-length form, one cached buffer per (n_s, n_t)."""
    if tok.cu is not None:
        return None
    cache = dev._cu_cache
    if cache is None:
        cache = dev._cu_cache = {}
    key = (tok.n_seqs, tok.equal)
    buf = cache.get(key)
    if buf is None:
        if len(cache) >= 64:
            cache.clear()
        buf = cache[key] = dev.indices(np.arange(tok.n_seqs + 1, dtype=np.int64) * tok.equal)
    return buf


def _finish(
    dev: Device, pool: Buffer, start_rows: object, dst_rows: object, tok: _Tokens, n_snap: int, plane_stride: int,
    token_args: tuple[Buffer | None, ...],
) -> tuple[Buffer | None, Buffer | None, int, bool]:  # fmt: skip
    snap, n_cols = _state_rows(dev, pool, start_rows, dst_rows, tok, n_snap, plane_stride)
    copied = tok.cu is None and any(b is not None and token_view(b) is None for b in token_args)
    return snap, _cu_buffer(dev, tok), n_cols, copied


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
    cu_seqlens: Buffer | None = None,
) -> StateCall:
    pool = _pool(dev, pool)
    x = _own(dev, x, "x")
    tok = _token_axes(dev, x, "x", "channels", 1, cu_seqlens)
    ch = x.shape[-1]
    weight = _own(dev, weight, "weight")
    if weight.ndim != 2 or weight.shape[0] != ch:
        y_ch = _own(dev, y, "y").shape[-1:]
        if weight.ndim == 2 and y_ch == (weight.shape[0],):  # weight and y agree: x is the odd one out
            raise ArgumentError("x", f"shape {x.shape} has {ch} channels, weight and y have {weight.shape[0]}")
        raise ArgumentError("weight", f"shape {weight.shape} must be [channels={ch}, d_conv]")
    d_conv = weight.shape[1]
    if d_conv < 2:
        raise ArgumentError("weight", f"d_conv {d_conv} must be >= 2")
    _activation(dev, x, "x", (*tok.lead, ch))
    _param(dev, weight, "weight", (ch, d_conv))
    if bias is not None:
        _param(dev, bias, "bias", (ch,))
    if pool.shape[1] != ch * (d_conv - 1):
        if pool.shape[1] % ch == 0:  # a window of whole columns: the kernel width is what disagrees
            raise ArgumentError(
                "weight",
                f"d_conv {d_conv} needs pool rows of channels * (d_conv - 1) = {ch * (d_conv - 1)}, the pool's rows "
                f"hold {pool.shape[1]} (d_conv {pool.shape[1] // ch + 1})",
            )
        raise ArgumentError("pool", f"row size {pool.shape[1]} must be channels * (d_conv - 1) = {ch * (d_conv - 1)}")
    y = _output(dev, y, "y", (*tok.lead, ch))
    _distinct_storage(y, "y", (pool, "pool"), (x, "x"), (weight, "weight"), (bias, "bias"))
    snap, cu, n_cols, copied = _finish(dev, pool, start_rows, dst_rows, tok, n_snap, plane_stride, (x,))
    # Positional, in field order: StateWrite's, then ConvShape's.
    shp = _conv_shape(
        tok.n_seqs, tok.n_tokens, tok.max_tokens, pool.shape[0], pool.shape[1], n_cols, tok.equal,
        ch, d_conv, bias is not None,
    )  # fmt: skip
    return StateCall(shp, snap, cu, tok.cu is not None, copied)


def _dt_limit(dt_limit: object) -> tuple[float, float] | None:
    if dt_limit is None:
        return None
    try:
        lo, hi = (float(v) for v in dt_limit)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ArgumentError("dt_limit", f"must be a pair (min, max) of numbers, got {dt_limit!r}") from None
    if np.isnan(lo) or np.isnan(hi) or lo > hi:
        raise ArgumentError("dt_limit", f"must satisfy min <= max (no NaN), got ({lo}, {hi})")
    if lo <= 0.0 and hi == np.inf:
        return None  # softplus is >= 0 already: mamba2's default (0, inf) changes nothing
    return (lo, hi)


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
    cu_seqlens: Buffer | None = None,
    D: Buffer | None = None,
    z: Buffer | None = None,
    dt_bias: Buffer | None = None,
    dt_limit: object = None,
) -> StateCall:
    pool = _pool(dev, pool)
    x = _own(dev, x, "x")
    tok = _token_axes(dev, x, "x", "n_head, head_dim", 2, cu_seqlens)
    lead = tok.lead
    n_head, head_dim = x.shape[-2], x.shape[-1]
    B = _own(dev, B, "B")
    if B.ndim != len(lead) + 2 or B.shape[: len(lead)] != lead:
        raise ArgumentError("B", f"shape {B.shape} must be [{', '.join(map(str, lead))}, n_group, d_state]")
    n_group, d_state = B.shape[-2], B.shape[-1]
    if n_group < 1 or d_state < 1 or n_head % n_group:
        raise ArgumentError("B", f"n_group {n_group} must divide n_head {n_head}")
    A = _own(dev, A, "A")
    if A.shape == (n_head,):
        variant = "mamba2"
    elif A.shape == (n_head, d_state):
        variant = "mamba1"
    else:
        dt_shape = _own(dev, dt, "dt").shape
        if A.ndim >= 1 and A.shape[0] != n_head and dt_shape == (*lead, A.shape[0]):  # x is the odd one out
            raise ArgumentError("x", f"shape {x.shape} has {n_head} heads, A and dt have {A.shape[0]}")
        raise ArgumentError("A", f"shape {A.shape} must be [n_head={n_head}] or [n_head={n_head}, d_state={d_state}]")
    if variant == "mamba1" and (head_dim != 1 or n_group != 1):
        raise ArgumentError("A", "Mamba-1 (A of [n_head, d_state]) needs head_dim == 1 and n_group == 1")
    _activation(dev, x, "x", (*lead, n_head, head_dim))
    _activation(dev, dt, "dt", (*lead, n_head))
    _f32(A, "A")
    _activation(dev, B, "B", B.shape)
    C_shape = _own(dev, C, "C").shape
    row = pool.shape[1]
    if C_shape != B.shape and row % (n_head * head_dim) == 0 and C_shape[-1:] == (row // (n_head * head_dim),):
        # C agrees with the pool's d_state: B is the odd one out
        raise ArgumentError("B", f"shape {B.shape} disagrees with C {C_shape} and the pool's d_state")
    _activation(dev, C, "C", (*lead, n_group, d_state))
    if D is not None:
        D = _own(dev, D, "D")
        if D.shape not in ((n_head,), (n_head, head_dim)):
            raise ArgumentError("D", f"shape {D.shape} must be [n_head={n_head}] or [n_head, head_dim={head_dim}]")
        _f32(D, "D")
    if z is not None:
        _activation(dev, z, "z", (*lead, n_head, head_dim))
    if dt_bias is not None:
        _param(dev, dt_bias, "dt_bias", (n_head,))
    limit = _dt_limit(dt_limit)
    if pool.shape[1] != n_head * head_dim * d_state:
        raise ArgumentError(
            "pool", f"row size {pool.shape[1]} must be n_head * head_dim * d_state = {n_head * head_dim * d_state}"
        )
    y = _output(dev, y, "y", (*lead, n_head, head_dim))
    _distinct_storage(
        y, "y", (pool, "pool"), (x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C"), (D, "D"), (z, "z"),
        (dt_bias, "dt_bias"),
    )  # fmt: skip
    snap, cu, n_cols, copied = _finish(dev, pool, start_rows, dst_rows, tok, n_snap, plane_stride, (x, dt, B, C, z))
    # Positional, in field order: StateWrite's, then ScanShape's.
    shp = _scan_shape(
        tok.n_seqs, tok.n_tokens, tok.max_tokens, pool.shape[0], pool.shape[1], n_cols, tok.equal,
        n_head, head_dim, d_state, n_group, variant, limit,
    )  # fmt: skip
    return StateCall(shp, snap, cu, tok.cu is not None, copied)


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
    cu_seqlens: Buffer | None = None,
    head_map: str = "tiled",
    qk_l2norm: bool = False,
    A_log: Buffer | None = None,
    dt_bias: Buffer | None = None,
    beta_sigmoid: bool = False,
    scale: float | None = None,
) -> StateCall:
    pool = _pool(dev, pool)
    v = _own(dev, v, "v")
    tok = _token_axes(dev, v, "v", "H_v, S", 2, cu_seqlens)
    lead = tok.lead
    h_v, size = v.shape[-2], v.shape[-1]
    q = _own(dev, q, "q")
    if q.ndim != len(lead) + 2 or q.shape[: len(lead)] != lead or q.shape[-1] != size:
        raise ArgumentError("q", f"shape {q.shape} must be [{', '.join(map(str, lead))}, H_k, S={size}]")
    h_k = q.shape[-2]
    if h_k < 1 or h_v % h_k:
        raise ArgumentError("q", f"H_k {h_k} must divide H_v {h_v}")
    _activation(dev, q, "q", (*lead, h_k, size))
    _activation(dev, k, "k", (*lead, h_k, size))
    _activation(dev, v, "v", (*lead, h_v, size))
    g = _own(dev, g, "g")
    if g.shape == (*lead, h_v):
        variant = "scalar"
    elif g.shape == (*lead, h_v, size):
        variant = "kda"
    else:
        want = ", ".join(map(str, lead))
        raise ArgumentError("g", f"shape {g.shape} must be [{want}, {h_v}] or [{want}, {h_v}, {size}]")
    _activation(dev, g, "g", g.shape)
    _activation(dev, beta, "beta", (*lead, h_v))
    if head_map not in HEAD_MAPS:
        raise ArgumentError("head_map", f"must be one of {', '.join(HEAD_MAPS)}, got {head_map!r}")
    if not 1 < h_k < h_v:
        head_map = "tiled"  # both maps agree when every value head has its own q/k head or all share one
    if scale is None:
        eff_scale = 1.0 / float(np.sqrt(size))
    elif isinstance(scale, int | float | np.integer | np.floating) and np.isfinite(scale):
        eff_scale = float(scale)
    else:
        raise ArgumentError("scale", f"must be a finite number or None, got {scale!r}")
    if not isinstance(qk_l2norm, bool | np.bool_):
        raise ArgumentError("qk_l2norm", f"must be a bool, got {qk_l2norm!r}")
    if not isinstance(beta_sigmoid, bool | np.bool_):
        raise ArgumentError("beta_sigmoid", f"must be a bool, got {beta_sigmoid!r}")
    if A_log is not None:
        _param(dev, A_log, "A_log", (h_v,))
    if dt_bias is not None:
        if A_log is None:
            raise ArgumentError("dt_bias", "is part of the raw gate form: pass A_log too")
        _param(dev, dt_bias, "dt_bias", (h_v, size) if variant == "kda" else (h_v,))
    if pool.shape[1] != h_v * size * size:
        raise ArgumentError("pool", f"row size {pool.shape[1]} must be H_v * S * S = {h_v * size * size}")
    o = _output(dev, o, "o", (*lead, h_v, size))
    _distinct_storage(
        o, "o", (pool, "pool"), (q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (A_log, "A_log"),
        (dt_bias, "dt_bias"),
    )  # fmt: skip
    snap, cu, n_cols, copied = _finish(dev, pool, start_rows, dst_rows, tok, n_snap, plane_stride, (q, k, v, g, beta))
    # Positional, in field order: StateWrite's, then DeltaShape's.
    shp = _delta_shape(
        tok.n_seqs, tok.n_tokens, tok.max_tokens, pool.shape[0], pool.shape[1], n_cols, tok.equal,
        h_k, h_v, size, variant, head_map, bool(qk_l2norm), A_log is not None, bool(beta_sigmoid), eff_scale,
    )  # fmt: skip
    return StateCall(shp, snap, cu, tok.cu is not None, copied)


#: The per-token inputs of each linear-attention primitive, in call order
#: (all [T, n_head, head_size]); the output is ``o``.
LINEAR_ATTN_INPUTS: dict[str, tuple[str, ...]] = {
    "rwkv_wkv6": ("r", "k", "v", "w"),
    "rwkv_wkv7": ("r", "w", "k", "v", "a", "b"),
    "gated_linear_attn": ("q", "k", "v", "g"),
}

#: The output scale each linear-attention primitive uses when the caller
#: passes None: 1 for the RWKV kernels (ggml's, and what RWKV models pass to
#: flash-linear-attention), 1 / sqrt(head_size) for GLA (ggml's QRWKV call
#: and fla's default).
_DEFAULT_SCALE = {"rwkv_wkv6": 1.0, "rwkv_wkv7": 1.0, "gated_linear_attn": None}


def check_linear_attn(
    dev: Device,
    op: str,
    *,
    pool: Buffer,
    start_rows: Buffer,
    dst_rows: Buffer,
    inputs: dict[str, Buffer],
    o: Buffer,
    u: Buffer | None = None,
    n_snap: int,
    plane_stride: int,
    cu_seqlens: Buffer | None = None,
    scale: float | None = None,
) -> StateCall:
    """Validate ``rwkv_wkv6`` / ``rwkv_wkv7`` / ``gated_linear_attn``: every
    per-token input ``inputs[name]`` (names of :data:`LINEAR_ATTN_INPUTS`)
    and ``o`` are [T, H, S] (or [n_s, n_t, H, S]), ``u`` (RWKV-6) f32 [H, S],
    pool rows H * S * S."""
    pool = _pool(dev, pool)
    names = LINEAR_ATTN_INPUTS[op]
    first = _own(dev, inputs[names[0]], names[0])
    tok = _token_axes(dev, first, names[0], "n_head, head_size", 2, cu_seqlens)
    lead = tok.lead
    n_head, size = first.shape[-2], first.shape[-1]
    bufs = []
    for name in names:
        bufs.append(_activation(dev, inputs[name], name, (*lead, n_head, size)))
    if op == "rwkv_wkv6":
        if u is None:
            raise ArgumentError("u", "the RWKV-6 time-first bonus is required")
        _param(dev, u, "u", (n_head, size))
    if scale is None:
        scale = _DEFAULT_SCALE[op]
    if scale is None:
        eff_scale = 1.0 / float(np.sqrt(size))
    elif isinstance(scale, int | float | np.integer | np.floating) and not isinstance(scale, bool):
        if not np.isfinite(scale):
            raise ArgumentError("scale", f"must be a finite number or None, got {scale!r}")
        eff_scale = float(scale)
    else:
        raise ArgumentError("scale", f"must be a finite number or None, got {scale!r}")
    if pool.shape[1] != n_head * size * size:
        raise ArgumentError("pool", f"row size {pool.shape[1]} must be n_head * head_size^2 = {n_head * size * size}")
    o = _output(dev, o, "o", (*lead, n_head, size))
    _distinct_storage(o, "o", (pool, "pool"), *zip(bufs, names, strict=True), (u, "u"))
    snap, cu, n_cols, copied = _finish(dev, pool, start_rows, dst_rows, tok, n_snap, plane_stride, tuple(bufs))
    variant = {"rwkv_wkv6": "rwkv6", "rwkv_wkv7": "rwkv7", "gated_linear_attn": "gla"}[op]
    # Positional, in field order: StateWrite's, then LinearAttnShape's.
    shp = _linear_attn_shape(
        tok.n_seqs, tok.n_tokens, tok.max_tokens, pool.shape[0], pool.shape[1], n_cols, tok.equal,
        n_head, size, variant, eff_scale,
    )  # fmt: skip
    return StateCall(shp, snap, cu, tok.cu is not None, copied)


# The per-op forms (keyword buffers, as check_ssm_scan and check_gated_delta_net take them).


def check_rwkv_wkv6(
    dev: Device, *, pool: Buffer, start_rows: Buffer, dst_rows: Buffer, r: Buffer, k: Buffer, v: Buffer, w: Buffer,
    u: Buffer, o: Buffer, n_snap: int, plane_stride: int, cu_seqlens: Buffer | None = None, scale: float | None = None,
) -> StateCall:  # fmt: skip
    return check_linear_attn(dev, "rwkv_wkv6", pool=pool, start_rows=start_rows, dst_rows=dst_rows,
                             inputs={"r": r, "k": k, "v": v, "w": w}, o=o, u=u, n_snap=n_snap,
                             plane_stride=plane_stride, cu_seqlens=cu_seqlens, scale=scale)  # fmt: skip


def check_rwkv_wkv7(
    dev: Device, *, pool: Buffer, start_rows: Buffer, dst_rows: Buffer, r: Buffer, w: Buffer, k: Buffer, v: Buffer,
    a: Buffer, b: Buffer, o: Buffer, n_snap: int, plane_stride: int, cu_seqlens: Buffer | None = None,
    scale: float | None = None,
) -> StateCall:  # fmt: skip
    return check_linear_attn(dev, "rwkv_wkv7", pool=pool, start_rows=start_rows, dst_rows=dst_rows,
                             inputs={"r": r, "w": w, "k": k, "v": v, "a": a, "b": b}, o=o, n_snap=n_snap,
                             plane_stride=plane_stride, cu_seqlens=cu_seqlens, scale=scale)  # fmt: skip


def check_gated_linear_attn(
    dev: Device, *, pool: Buffer, start_rows: Buffer, dst_rows: Buffer, q: Buffer, k: Buffer, v: Buffer, g: Buffer,
    o: Buffer, n_snap: int, plane_stride: int, cu_seqlens: Buffer | None = None, scale: float | None = None,
) -> StateCall:  # fmt: skip
    return check_linear_attn(dev, "gated_linear_attn", pool=pool, start_rows=start_rows, dst_rows=dst_rows,
                             inputs={"q": q, "k": k, "v": v, "g": g}, o=o, n_snap=n_snap, plane_stride=plane_stride,
                             cu_seqlens=cu_seqlens, scale=scale)  # fmt: skip
