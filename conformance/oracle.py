"""An oracle independent of the reference backend: every primitive as
per-element float64 loops over Python floats, written from the published
formulas and the contract docstrings in :mod:`statecache.backend`, never from
``backends/reference``.

The primitive cases compare a device with the reference backend, so a mistake
in the reference itself (a softplus threshold, which q/k head a value head
reads) would pass on the reference and on every backend that copied it.  The
``oracle`` case family (:mod:`statecache.conformance.oracle_cases`) compares
every device, the reference included, with the functions here instead.  They
are slow on purpose (scalar loops, small shapes only) and shaped differently
from the reference (element loops instead of array expressions, explicit
storage offsets instead of reshapes), so the two can only agree by both being
right.

Sources of each formula:

* ``ssm_scan``: ``selective_scan_ref`` of mamba_ssm (Mamba-1: ``deltaA =
  exp(delta A)``, ``deltaB_u = delta B u``, ``x = deltaA x + deltaB_u``,
  ``y = x . C``; delta through ``torch.nn.functional.softplus`` whose
  threshold is 20) and Mamba-2's ``selective_state_update`` / SSD recurrence
  (one decay per head, B and C shared by the ``n_head / n_group`` consecutive
  heads of a group).
* ``ssm_conv``: ``causal_conv1d_ref`` of causal-conv1d with initial states
  (``conv1d(concat(initial_states, x), weight, bias)``, then SiLU; the final
  state is the last ``d_conv - 1`` inputs).
* ``gated_delta_net``: flash-linear-attention's ``naive_recurrent_gated_delta_rule``
  (``S *= exp(g)``; ``v' = beta (v - S^T k)``; ``S += k v'^T``;
  ``o = scale q^T S``), with KDA's per-key gate scaling row ``i`` by
  ``exp(g[i])``, and value head ``h`` reading q/k head ``h % H_k`` as the
  contract says.
* conversions: IEEE 754 round to nearest, ties to even, through float32
  (f16: overflow to infinity, NaN keeps the top of its payload; bf16: NaN
  becomes the quiet NaN with the sign kept, as the contract of the row
  primitives and the kit's edge values say).

Every function takes and returns host NumPy arrays only at its boundary;
inside it reads elements one at a time as Python floats (float64).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np

from statecache.dtypes import DType

# -- storage conversions ----------------------------------------------------------

_F16_MAX = 65504.0
_BF16_MAX = (2.0 - 2.0**-7) * 2.0**127


def _f32_bits(x: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", x))[0])


def _round_to_grid(x: float, mantissa_bits: int, min_exp: int) -> float:
    """``x`` rounded to the nearest value with ``mantissa_bits`` explicit bits
    (ties to even), subnormals below ``2**min_exp``; the result may exceed the
    format's largest finite value (the caller turns that into infinity)."""
    if x == 0.0 or not math.isfinite(x):
        return x
    _, e = math.frexp(abs(x))  # abs(x) = m * 2**e with m in [0.5, 1)
    exp = max(e - 1, min_exp)
    quantum = 2.0 ** (exp - mantissa_bits)
    # x / quantum is exact (a power-of-two scaling); round() ties to even.
    return round(x / quantum) * quantum


def _f32(x: float) -> float:
    """``x`` rounded to float32 (Python's struct rounds to nearest even)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:  # beyond float32's range: rounds to infinity
        return math.copysign(math.inf, x)


def f16_bits(x32: float) -> int:
    """The f16 bit pattern of the float32 value ``x32``."""
    bits = _f32_bits(x32)
    sign = (bits >> 16) & 0x8000
    if math.isnan(x32):
        payload = (bits & 0x7FFFFF) >> 13
        return sign | 0x7C00 | (payload if payload else 1)  # still a NaN
    r = _round_to_grid(x32, 10, -14)
    if abs(r) > _F16_MAX:
        return sign | 0x7C00
    packed = struct.pack("<e", r) if r != 0.0 else (b"\x00\x80" if sign else b"\x00\x00")
    return int(struct.unpack("<H", packed)[0])


def bf16_bits(x32: float) -> int:
    """The bf16 bit pattern of the float32 value ``x32``."""
    bits = _f32_bits(x32)
    sign = (bits >> 16) & 0x8000
    if math.isnan(x32):
        return sign | 0x7FC0
    r = _round_to_grid(x32, 7, -126)
    if abs(r) > _BF16_MAX:
        return sign | 0x7F80
    if r == 0.0:
        return sign
    return _f32_bits(r) >> 16  # r has at most 8 significant bits: exact in the top half


def f16_value(h: int) -> float:
    sign = -1.0 if h & 0x8000 else 1.0
    exp, man = (h >> 10) & 0x1F, h & 0x3FF
    if exp == 0x1F:
        return sign * math.inf if man == 0 else math.copysign(math.nan, sign)
    if exp == 0:
        return sign * man * 2.0**-24
    return sign * (1024 + man) * 2.0 ** (exp - 25)


def bf16_value(b: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0])


def decode(stored: np.ndarray, dtype: DType) -> list[float]:
    """Elements of a storage array (C order) as Python floats, bit by bit."""
    flat = np.ascontiguousarray(stored).reshape(-1)
    if dtype is DType.F32:
        return [float(v) for v in flat.astype(np.float32)]  # float32 -> float64 is exact
    raw = flat.view(np.uint16)
    convert = f16_value if dtype is DType.F16 else bf16_value
    return [convert(int(v)) for v in raw]


def encode(values: Sequence[float], dtype: DType) -> np.ndarray:
    """Python floats stored as ``dtype``: rounded to float32 first, then to the
    storage format (the contract's 'conversions go through float32')."""
    as32 = [_f32(float(v)) for v in values]
    if dtype is DType.F32:
        return np.array(as32, dtype=np.float32)
    to_bits = f16_bits if dtype is DType.F16 else bf16_bits
    return np.array([to_bits(v) for v in as32], dtype=np.uint16).view(dtype.numpy)


# -- scalar helpers ---------------------------------------------------------------


def _exp(z: float) -> float:
    if z > 709.0:  # math.exp raises instead of overflowing to inf
        return math.inf
    return math.exp(z)


def softplus(z: float) -> float:
    """``torch.nn.functional.softplus`` (beta 1, threshold 20), which
    ``selective_scan_ref`` applies to dt: the identity above 20."""
    if z > 20.0:
        return z
    if math.isnan(z):
        return z
    return math.log1p(_exp(z))


def silu(z: float) -> float:
    if math.isnan(z):
        return z
    if z >= 0.0:
        return z / (1.0 + _exp(-z))
    e = _exp(z)
    if math.isinf(z):
        return math.nan  # -inf * sigmoid(-inf) = -inf * 0, as IEEE says
    return z * e / (1.0 + e)


def _snapshot_tokens(n_t: int, n_snap: int) -> list[tuple[int, int]]:
    """(plane j, tokens consumed) for every plane a call writes: plane j holds
    the state after ``n_t - j`` tokens, for j = 0 .. min(n_t, n_snap - 1)."""
    return [(j, n_t - j) for j in range(min(n_t, n_snap - 1) + 1)]


class _Planes:
    """The snapshot planes of one sequence, recorded as its state passes them."""

    def __init__(self, n_t: int, n_snap: int) -> None:
        self.plane_after = {consumed: j for j, consumed in _snapshot_tokens(n_t, n_snap)}
        self.values: dict[int, list[float]] = {}

    def passed(self, consumed: int, state: list[float]) -> None:
        """The state after ``consumed`` tokens (0: the start state)."""
        if consumed in self.plane_after:
            self.values[self.plane_after[consumed]] = list(state)

    def store(self, out: np.ndarray, dst_row: int, plane_stride: int, dtype: DType) -> None:
        for j, values in self.values.items():
            out[dst_row + j * plane_stride] = encode(values, dtype)


# -- row primitives -----------------------------------------------------------------


def convert_rows(src: np.ndarray, src_dtype: DType, dst_dtype: DType) -> np.ndarray:
    """Every element of ``src`` (stored as ``src_dtype``) stored as ``dst_dtype``."""
    return encode(decode(src, src_dtype), dst_dtype).reshape(src.shape)


def get_rows(src: np.ndarray, src_dtype: DType, rows: Sequence[int], dst_dtype: DType) -> np.ndarray:
    """``dst[i, :] = convert(src[rows[i], :])``: the gathered block."""
    out = np.empty((len(rows), src.shape[1]), dtype=dst_dtype.numpy)
    for i, r in enumerate(rows):
        out[i] = convert_rows(src[int(r)], src_dtype, dst_dtype)
    return out


def set_rows(dst: np.ndarray, dst_dtype: DType, rows: Sequence[int], src: np.ndarray, src_dtype: DType) -> np.ndarray:
    """``dst`` after ``dst[rows[i], :] = convert(src[i, :])``."""
    out = dst.copy()
    for i, r in enumerate(rows):
        out[int(r)] = convert_rows(src[i], src_dtype, dst_dtype)
    return out


def zero_rows(dst: np.ndarray, dst_dtype: DType, rows: Sequence[int]) -> np.ndarray:
    out = dst.copy()
    zero = encode([0.0] * dst.shape[1], dst_dtype)
    for r in rows:
        out[int(r)] = zero
    return out


def copy_rows(
    src: np.ndarray,
    src_dtype: DType,
    src_rows: Sequence[int],
    dst: np.ndarray,
    dst_dtype: DType,
    dst_rows: Sequence[int],
) -> np.ndarray:
    """``dst`` after ``dst[dst_rows[i]] = convert(src[src_rows[i]])``; every
    read happens before any write (``src`` may be ``dst``)."""
    read = [convert_rows(src[int(r)], src_dtype, dst_dtype) for r in src_rows]
    out = dst.copy()
    for r, row in zip(dst_rows, read, strict=True):
        out[int(r)] = row
    return out


# -- ssm_conv ------------------------------------------------------------------------


def ssm_conv(
    pool: np.ndarray,
    dtype: DType,
    start_rows: Sequence[int],
    dst_rows: Sequence[int],
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    apply_silu: bool,
    n_snap: int,
    plane_stride: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(pool after the call, y)``; ``pool`` rows hold windows ``[ch, W]``."""
    n_s, n_t, ch = x.shape
    d_conv = weight.shape[1]
    W = d_conv - 1
    row_len = pool.shape[1]
    starts = [decode(pool[int(r)], dtype) for r in start_rows]  # every read before any write
    out = pool.copy()
    y = np.empty((n_s, n_t, ch), dtype=np.float32)
    for s in range(n_s):
        planes = {j: [0.0] * row_len for j, _ in _snapshot_tokens(n_t, n_snap)}
        for c in range(ch):
            # The sequence this channel sees: its stored window, then its inputs.
            seq = [starts[s][c * W + w] for w in range(W)] + [float(x[s, t, c]) for t in range(n_t)]
            for t in range(n_t):
                acc = 0.0
                for k in range(d_conv):
                    acc += seq[t + k] * float(weight[c, k])
                if bias is not None:
                    acc += float(bias[c])
                y[s, t, c] = silu(acc) if apply_silu else acc
            for j, consumed in _snapshot_tokens(n_t, n_snap):
                # The window after `consumed` tokens: the W inputs before it.
                for w in range(W):
                    planes[j][c * W + w] = seq[consumed + w]
        for j, values in planes.items():
            out[int(dst_rows[s]) + j * plane_stride] = encode(values, dtype)
    return out, y


# -- ssm_scan ---------------------------------------------------------------------------


def ssm_scan(
    pool: np.ndarray,
    dtype: DType,
    start_rows: Sequence[int],
    dst_rows: Sequence[int],
    x: np.ndarray,
    dt: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    n_snap: int,
    plane_stride: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(pool after the call, y)``.  A row is a state ``[n_head, head_dim,
    d_state]``; ``A`` is ``[n_head]`` (Mamba-2) or ``[n_head, d_state]``
    (Mamba-1, head_dim 1)."""
    n_s, n_t, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    heads_per_group = H // G
    per_state = A.ndim == 2
    starts = [decode(pool[int(r)], dtype) for r in start_rows]
    out = pool.copy()
    y = np.empty((n_s, n_t, H, P), dtype=np.float32)
    for s in range(n_s):
        state = list(starts[s])
        planes = _Planes(n_t, n_snap)
        planes.passed(0, state)
        for t in range(n_t):
            for h in range(H):
                grp = h // heads_per_group  # consecutive heads share a group
                delta = softplus(float(dt[s, t, h]))
                for p in range(P):
                    xv = float(x[s, t, h, p])
                    acc = 0.0
                    for n in range(N):
                        a = float(A[h, n]) if per_state else float(A[h])
                        at = (h * P + p) * N + n
                        state[at] = _exp(delta * a) * state[at] + delta * float(B[s, t, grp, n]) * xv
                        acc += state[at] * float(C[s, t, grp, n])
                    y[s, t, h, p] = acc
            planes.passed(t + 1, state)
        planes.store(out, int(dst_rows[s]), plane_stride, dtype)
    return out, y


# -- gated_delta_net -----------------------------------------------------------------------


def gated_delta_net(
    pool: np.ndarray,
    dtype: DType,
    start_rows: Sequence[int],
    dst_rows: Sequence[int],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    n_snap: int,
    plane_stride: int,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(pool after the call, o)``.  Head ``h``'s block in a row stores the
    key-by-value state ``M[i][j]`` at offset ``h*S*S + j*S + i``."""
    n_s, n_t, Hv, S = v.shape
    Hk = q.shape[2]
    kda = g.ndim == 4
    sc = 1.0 / math.sqrt(S) if scale is None else scale
    starts = [decode(pool[int(r)], dtype) for r in start_rows]
    out = pool.copy()
    o = np.empty((n_s, n_t, Hv, S), dtype=np.float32)

    def at(h: int, i: int, j: int) -> int:
        return h * S * S + j * S + i

    for s in range(n_s):
        M = list(starts[s])
        planes = _Planes(n_t, n_snap)
        planes.passed(0, M)
        for t in range(n_t):
            for h in range(Hv):
                hk = h % Hk  # value heads tile the q/k heads
                kv = [float(k[s, t, hk, i]) for i in range(S)]
                qv = [float(q[s, t, hk, i]) for i in range(S)]
                b = float(beta[s, t, h])
                for i in range(S):
                    decay = _exp(float(g[s, t, h, i])) if kda else _exp(float(g[s, t, h]))
                    for j in range(S):
                        M[at(h, i, j)] *= decay
                for j in range(S):
                    recalled = 0.0
                    for i in range(S):
                        recalled += M[at(h, i, j)] * kv[i]
                    new_v = b * (float(v[s, t, h, j]) - recalled)
                    for i in range(S):
                        M[at(h, i, j)] += kv[i] * new_v
                for j in range(S):
                    acc = 0.0
                    for i in range(S):
                        acc += qv[i] * M[at(h, i, j)]
                    o[s, t, h, j] = sc * acc
            planes.passed(t + 1, M)
        planes.store(out, int(dst_rows[s]), plane_stride, dtype)
    return out, o
