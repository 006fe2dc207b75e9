"""Cases of the stateful-primitive contract, protocol 2: packed (varlen)
tokens, explicit snapshot tables, Mamba-1 snapshots, and refusals.

Every primitive case here checks the reference backend against an
independent formula written below (per-element float64 loops, not the
reference's vectorised code) and then the device against the reference
(guard bands, unaddressed rows untouched, as the other primitive cases).
The metamorphic cases hold the device to itself, bitwise:

* ``packed_split``: one packed call equals one call per sequence (lengths 0
  and 1 included, start rows from any plane, in place, shared);
* ``equal_form``: the equal-length form equals the packed form;
* ``rotation``: a decode loop that reads plane p and writes only plane
  p + 1 (a 2-D table ``[[row_p1, -1]]``) computes what the 1-D form with
  ``n_snap`` planes computes, without writing the input state;
* ``chunked_varlen``: a batch advanced in two packed calls of uneven
  chunks equals one packed call (within float32 tolerance: chunk bounds
  change the summation order of chunked kernels);
* ``snapshots_mamba1``: Mamba-1's snapshot column j equals the final state
  of a call over the prefix j tokens shorter.

``refuse`` cases pass one bad new argument each and check the error names
it and that nothing was written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from statecache.backend import Buffer, Device
from statecache.conformance.cases import (
    NMSE,
    Case,
    ConformanceFailure,
    Requirement,
    Tensor,
    assert_close,
    assert_exact,
    compare_with_reference,
    reference_device,
    rng_for,
    run_on,
)
from statecache.dtypes import DType
from statecache.errors import ArgumentError, StatecacheError
from statecache.primitives import L2NORM_EPS

F32 = DType.F32
Arrays = dict[str, np.ndarray]

#: NMSE of the reference against the float64 formulas: one rounding to the
#: pool's storage dtype (and to float32 for outputs).
FORMULA_NMSE = {DType.F32: 1e-12, DType.F16: 1e-6, DType.BF16: 1e-4}


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _softplus(z: float) -> float:
    return z if z > 20.0 else math.log1p(math.exp(z))


def _silu(z: float) -> float:
    return z / (1.0 + math.exp(-z))


def _l2n(vec: list[float]) -> list[float]:
    inv = 1.0 / math.sqrt(sum(v * v for v in vec) + L2NORM_EPS)
    return [v * inv for v in vec]


# -- the primitives as adapters -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """One stateful primitive configuration, driven from host arrays.

    ``tokens(rng, T)``: per-token inputs, [T, ...]; ``weights(rng)``: the
    rest; ``call(dev, pool, start, dst, cu, bufs, out, **kw)`` runs it
    (``cu`` None: equal-length form, bufs then [n_s, n_t, ...]);
    ``formula(states, lengths, arrays)`` gives, in float64, the state after
    every prefix of every sequence (``states[s][t]``: after t tokens) and
    the outputs [T, ...]; ``kwargs`` are fixed options of the call (the
    epilogue cases use them).
    """

    op: str
    label: str
    row_size: int
    out_tail: tuple[int, ...]
    tokens: Callable[[np.random.Generator, int], Arrays]
    weights: Callable[[np.random.Generator], Arrays]
    call: Callable[..., None]
    formula: Callable[[np.ndarray, np.ndarray, Arrays], tuple[list[list[np.ndarray]], np.ndarray]]
    exact_state: bool
    params: dict[str, Any]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    start_scale: float = 1.0

    def requirement(self, dtype: DType, n_cols: int, varlen: bool) -> Requirement:
        return Requirement(self.op, {"dtype": dtype.value, "n_snap": n_cols, "varlen": varlen, **self.params})


def conv_op(d_conv: int, ch: int, bias_silu: bool) -> Op:
    W = d_conv - 1

    def tokens(rng: np.random.Generator, T: int) -> Arrays:
        return {"x": _u(rng, (T, ch))}

    def weights(rng: np.random.Generator) -> Arrays:
        return {"w_weight": _u(rng, (ch, d_conv)), "w_bias": _u(rng, (ch,))}

    def call(dev, pool, start, dst, cu, b, out, **kw):  # type: ignore[no-untyped-def]
        dev.ssm_conv(pool, start, dst, b["x"], b["w_weight"], out, bias=b["w_bias"] if bias_silu else None,
                     apply_silu=bias_silu, cu_seqlens=cu, **kw)  # fmt: skip

    def formula(starts: np.ndarray, lengths: np.ndarray, a: Arrays):  # type: ignore[no-untyped-def]
        x, w, bias = a["x"].astype(np.float64), a["w_weight"].astype(np.float64), a["w_bias"].astype(np.float64)
        y = np.zeros(x.shape)
        states = []
        t0 = 0
        for s, n_t in enumerate(lengths):
            per_t = [np.zeros(ch * W) for _ in range(n_t + 1)]
            for c in range(ch):
                ext = [float(v) for v in starts[s][c * W : (c + 1) * W]] + [float(x[t0 + t, c]) for t in range(n_t)]
                for t in range(n_t):
                    acc = sum(ext[t + k] * w[c, k] for k in range(d_conv))
                    if bias_silu:
                        acc = _silu(acc + bias[c])
                    y[t0 + t, c] = acc
                for t in range(n_t + 1):  # the window after t tokens ends at ext[W + t - 1]
                    per_t[t][c * W : (c + 1) * W] = ext[t : t + W]
            states.append(per_t)
            t0 += n_t
        return states, y

    label = f"dc{d_conv}-ch{ch}" + ("-bias_silu" if bias_silu else "")
    return Op("ssm_conv", label, ch * W, (ch,), tokens, weights, call, formula, True, {"d_conv": d_conv})


def scan_op(variant: str, N: int, P: int, H: int, G: int, **kwargs: Any) -> Op:
    mamba1 = variant == "mamba1"

    def tokens(rng: np.random.Generator, T: int) -> Arrays:
        arrays = {
            "x": _u(rng, (T, H, P)),
            "dt": _u(rng, (T, H), -2.0, 1.0),
            "B": _u(rng, (T, G, N)),
            "C": _u(rng, (T, G, N)),
        }
        if kwargs.get("z"):
            arrays["z"] = _u(rng, (T, H, P), -3.0, 3.0)
        return arrays

    def weights(rng: np.random.Generator) -> Arrays:
        arrays = {"w_A": -rng.uniform(0.05, 1.0, (H, N) if mamba1 else (H,)).astype(np.float32)}
        if kwargs.get("D"):
            arrays["w_D"] = _u(rng, (H, P) if kwargs["D"] == "hp" else (H,))
        if kwargs.get("dt_bias"):
            arrays["w_dt_bias"] = _u(rng, (H,), -1.0, 1.0)
        return arrays

    def call(dev, pool, start, dst, cu, b, out, **kw):  # type: ignore[no-untyped-def]
        extra = {name: b.get(name if name == "z" else f"w_{name}") for name in ("D", "z", "dt_bias")}
        extra = {k: v for k, v in extra.items() if v is not None}
        if kwargs.get("dt_limit") is not None:
            extra["dt_limit"] = kwargs["dt_limit"]
        dev.ssm_scan(pool, start, dst, b["x"], b["dt"], b["w_A"], b["B"], b["C"], out, cu_seqlens=cu, **extra, **kw)

    def formula(starts: np.ndarray, lengths: np.ndarray, a: Arrays):  # type: ignore[no-untyped-def]
        x, dt = a["x"].astype(np.float64), a["dt"].astype(np.float64)
        B, C, A = a["B"].astype(np.float64), a["C"].astype(np.float64), a["w_A"].astype(np.float64)
        D = a["w_D"].astype(np.float64) if "w_D" in a else None
        z = a["z"].astype(np.float64) if "z" in a else None
        bias = a["w_dt_bias"].astype(np.float64) if "w_dt_bias" in a else None
        lo, hi = kwargs.get("dt_limit") or (-math.inf, math.inf)
        y = np.zeros(x.shape)
        states = []
        t0 = 0
        for s, n_t in enumerate(lengths):
            per_t = [np.array(starts[s], dtype=np.float64) for _ in range(n_t + 1)]
            for h in range(H):
                g = h // (H // G)
                for t in range(n_t):
                    tok = t0 + t
                    z_dt = dt[tok, h] + (bias[h] if bias is not None else 0.0)
                    d = min(max(_softplus(z_dt), lo), hi)
                    for i in range(P):
                        acc = 0.0
                        for k in range(N):
                            at = (h * P + i) * N + k
                            rate = A[h, k] if mamba1 else A[h]
                            value = per_t[t][at] * math.exp(d * rate) + B[tok, g, k] * x[tok, h, i] * d
                            per_t[t + 1][at] = value
                            acc += value * C[tok, g, k]
                        if D is not None:
                            acc += (D[h, i] if D.ndim == 2 else D[h]) * x[tok, h, i]
                        if z is not None:
                            acc *= _silu(z[tok, h, i])
                        y[tok, h, i] = acc
            states.append(per_t)
            t0 += n_t
        return states, y

    label = f"{variant}-d{N}-h{P}-n{H}-g{G}"
    params = {"variant": variant, "d_state": N, "head_dim": P}
    return Op("ssm_scan", label, H * P * N, (H, P), tokens, weights, call, formula, False, params, kwargs)


def delta_op(kda: bool, S_: int, Hv: int, Hk: int, **kwargs: Any) -> Op:
    grouped = kwargs.get("head_map") == "grouped"
    l2norm = bool(kwargs.get("qk_l2norm"))
    raw = bool(kwargs.get("raw_gate"))
    sig = bool(kwargs.get("beta_sigmoid"))
    scale = kwargs.get("scale")

    def tokens(rng: np.random.Generator, T: int) -> Arrays:
        q, k = _u(rng, (T, Hk, S_)), _u(rng, (T, Hk, S_))
        if not l2norm:  # the kernel's usual inputs: already normalised
            q /= np.linalg.norm(q, axis=-1, keepdims=True)
            k /= np.linalg.norm(k, axis=-1, keepdims=True)
        gshape = (T, Hv, S_) if kda else (T, Hv)
        return {
            "q": q.astype(np.float32),
            "k": k.astype(np.float32),
            "v": _u(rng, (T, Hv, S_)),
            "g": _u(rng, gshape, -3.0, 2.0) if raw else _u(rng, gshape, -1.0, -1e-4),
            "beta": _u(rng, (T, Hv), -4.0, 4.0) if sig else _u(rng, (T, Hv), 0.0, 1.0),
        }

    def weights(rng: np.random.Generator) -> Arrays:
        if not raw:
            return {}
        return {"w_A_log": _u(rng, (Hv,), -2.0, 1.0), "w_dt_bias": _u(rng, (Hv, S_) if kda else (Hv,))}

    def call(dev, pool, start, dst, cu, b, out, **kw):  # type: ignore[no-untyped-def]
        extra: dict[str, Any] = {}
        if raw:
            extra.update(A_log=b["w_A_log"], dt_bias=b["w_dt_bias"])
        for name in ("head_map", "qk_l2norm", "beta_sigmoid", "scale"):
            if name in kwargs:
                extra[name] = kwargs[name]
        dev.gated_delta_net(pool, start, dst, b["q"], b["k"], b["v"], b["g"], b["beta"], out, cu_seqlens=cu,
                            **extra, **kw)  # fmt: skip

    def formula(starts: np.ndarray, lengths: np.ndarray, a: Arrays):  # type: ignore[no-untyped-def]
        q, k, v = (a[n].astype(np.float64) for n in ("q", "k", "v"))
        g, beta = a["g"].astype(np.float64), a["beta"].astype(np.float64)
        A_log = a["w_A_log"].astype(np.float64) if raw else None
        bias = a["w_dt_bias"].astype(np.float64) if raw else None
        sc = 1.0 / math.sqrt(S_) if scale is None else float(scale)
        o = np.zeros(v.shape)
        states = []
        t0 = 0
        for s, n_t in enumerate(lengths):
            per_t = [np.array(starts[s], dtype=np.float64) for _ in range(n_t + 1)]
            for h in range(Hv):
                hk = h // (Hv // Hk) if grouped else h % Hk
                # M[i][j] is stored at [h, j, i]
                M = [[per_t[0][(h * S_ + j) * S_ + i] for j in range(S_)] for i in range(S_)]
                for t in range(n_t):
                    tok = t0 + t
                    qv, kv = list(q[tok, hk]), list(k[tok, hk])
                    if l2norm:
                        qv, kv = _l2n(qv), _l2n(kv)
                    b = beta[tok, h]
                    if sig:
                        b = 1.0 / (1.0 + math.exp(-b))
                    for i in range(S_):
                        gi = g[tok, h, i] if kda else g[tok, h]
                        if raw:
                            assert A_log is not None and bias is not None
                            gi = -math.exp(A_log[h]) * _softplus(gi + (bias[h, i] if kda else bias[h]))
                        decay = math.exp(gi)
                        for j in range(S_):
                            M[i][j] *= decay
                    for j in range(S_):
                        delta = (v[tok, h, j] - sum(M[i][j] * kv[i] for i in range(S_))) * b
                        for i in range(S_):
                            M[i][j] += kv[i] * delta
                        o[tok, h, j] = sc * sum(M[i][j] * qv[i] for i in range(S_))
                    for i in range(S_):
                        for j in range(S_):
                            per_t[t + 1][(h * S_ + j) * S_ + i] = M[i][j]
            states.append(per_t)
            t0 += n_t
        return states, o

    gate = "kda" if kda else "scalar"
    label = f"{gate}-S{S_}-hv{Hv}-hk{Hk}"
    params = {"variant": gate, "head_size": S_}
    return Op(
        "gated_delta_net", label, Hv * S_ * S_, (Hv, S_), tokens, weights, call, formula, False, params, kwargs, 0.5
    )


# -- rows: planes, tables and start modes -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rows:
    """Pool rows of a packed call: one spare row, then ``K`` planes of
    ``n_s + 1`` rows (the last of each plane never addressed), then a
    shared source region, then a spare row.  ``table[s, j]`` is the row of
    column j (-1: none); ``start[s]`` the row sequence s starts from."""

    n_rows: int
    start: np.ndarray
    table: np.ndarray

    def written(self) -> np.ndarray:
        return np.unique(self.table[self.table >= 0])


def plane_row(s: int, p: int, n_s: int) -> int:
    return 1 + p * (n_s + 1) + s


def make_rows(lengths: np.ndarray, K: int, mode: str, seed: int) -> Rows:
    """Snapshot tables and start rows of one call.

    ``planes``: every column j <= n_t(s) written (the 1-D form's table), each
    sequence starting from a random plane of its own (which it may also
    write: in place).  ``sparse``: a random subset of those columns written,
    rows permuted among the sequence's planes.  ``rotate``: read plane p,
    write only column 0 to plane p + 1 mod K.  ``shared``: sequences start
    in pairs from rows of the source region nobody writes."""
    rng = np.random.default_rng(seed)
    n_s = lengths.size
    source = 1 + K * (n_s + 1)
    n_rows = source + n_s + 1
    table = np.full((n_s, K), -1, dtype=np.int64)
    start = np.zeros(n_s, dtype=np.int64)
    for s, n_t in enumerate(lengths):
        cols = min(int(n_t), K - 1) + 1
        own = [plane_row(s, p, n_s) for p in range(K)]
        if mode == "planes":
            table[s, :cols] = own[:cols]
            start[s] = own[int(rng.integers(0, K))]
        elif mode == "sparse":
            perm = rng.permutation(K)
            keep = rng.random(cols) < 0.6
            keep[int(rng.integers(0, cols))] = True  # at least one column per sequence
            for j in range(cols):
                if keep[j]:
                    table[s, j] = own[perm[j]]
            start[s] = own[int(rng.integers(0, K))]
        elif mode == "rotate":
            p = int(rng.integers(0, K))
            table[s, 0] = own[(p + 1) % K]
            start[s] = own[p]
        elif mode == "shared":
            table[s, :cols] = own[:cols]
            start[s] = source + s // 2
        else:
            raise ValueError(f"unknown rows mode {mode!r}")
    return Rows(n_rows, start, table)


def _cu(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _pool_data(op: Op, rows: Rows, rng: np.random.Generator) -> np.ndarray:
    """Garbage everywhere (large, so reading a wrong row cannot hide),
    plausible states in the rows sequences start from."""
    data = rng.uniform(-1e3, 1e3, (rows.n_rows, op.row_size)).astype(np.float32)
    starts = np.unique(rows.start)
    data[starts] = _u(rng, (starts.size, op.row_size), -op.start_scale, op.start_scale)
    return data


# -- primitive cases: reference vs formula, device vs reference ---------------------------


@dataclasses.dataclass(frozen=True)
class VarlenParams:
    op: Op
    lengths: tuple[int, ...]
    K: int
    mode: str
    dtype: DType = F32
    tag: str = "varlen"
    act: DType = F32  # dtype of the per-token inputs and outputs

    @property
    def id(self) -> str:
        lens = "_".join(map(str, self.lengths))
        act = "" if self.act is F32 else f"-act{self.act.value}"
        return f"{self.op.op}.{self.tag}[{self.op.label}-L{lens}-K{self.K}-{self.mode}-{self.dtype.value}{act}]"

    @property
    def caps(self) -> dict[str, Any]:
        caps: dict[str, Any] = {"storage_dtypes": {self.dtype.value}, "max_snapshots": self.K, "varlen": True}
        if self.act is not F32:
            caps["activation_dtypes"] = {self.act.value}
        return caps

    def requirement(self) -> Requirement:
        req = self.op.requirement(self.dtype, self.K, True)
        if self.act is F32:
            return req
        return Requirement(req.op, {**req.params, "activation_dtypes": (self.act.value,)})


def varlen_tensors(p: VarlenParams, seed: int) -> tuple[dict[str, Tensor], Rows, Arrays]:
    rng = rng_for(seed)
    lengths = np.asarray(p.lengths, dtype=np.int64)
    rows = make_rows(lengths, p.K, p.mode, seed)
    T = int(lengths.sum())
    arrays = {**p.op.tokens(rng, T), **p.op.weights(rng)}
    # per-token values as the device holds them (rounded to the activation dtype)
    arrays = {k: v if k.startswith("w_") else v.astype(p.act.numpy).astype(np.float32) for k, v in arrays.items()}
    out = np.full((T, *p.op.out_tail), 777.0, dtype=np.float32)
    tensors = {
        "pool": Tensor(
            _pool_data(p.op, rows, rng), p.dtype, output=True, written=rows.written(), exact=p.op.exact_state
        ),
        "out": Tensor(out, p.act, output=True),
        **{name: Tensor(value, F32 if name.startswith("w_") else p.act) for name, value in arrays.items()},
    }
    return tensors, rows, arrays


def _check_formula(p: VarlenParams, tensors: dict[str, Tensor], rows: Rows, arrays: Arrays, ref: dict) -> None:
    """The reference's results against the independent float64 formula."""
    lengths = np.asarray(p.lengths, dtype=np.int64)
    pool_in = tensors["pool"].data
    assert pool_in is not None
    starts = pool_in.astype(p.dtype.numpy).astype(np.float64)[rows.start]
    states, out = p.op.formula(starts, lengths, arrays)
    placed, got_pool = ref["pool"]
    body = got_pool[placed.offset : placed.offset + pool_in.size].reshape(pool_in.shape)
    want = body.astype(np.float64).copy()
    for s, n_t in enumerate(lengths):
        for j in range(p.K):
            row = int(rows.table[s, j])
            if row >= 0:
                want[row] = states[s][int(n_t) - j]
    tol = FORMULA_NMSE[p.dtype]
    written = rows.written()
    assert_close(f"reference pool vs formula ({p.id})", body[written].astype(np.float64), want[written], tol)
    placed_o, got_out = ref["out"]
    out_body = got_out[placed_o.offset : placed_o.offset + out.size].reshape(out.shape)
    if out.size:
        assert_close(f"reference outputs vs formula ({p.id})", out_body, out, FORMULA_NMSE[p.act])


def varlen_call(p: VarlenParams, rows: Rows) -> Callable[[Device, dict[str, Buffer]], None]:
    lengths = np.asarray(p.lengths, dtype=np.int64)

    def call(dev: Device, b: dict[str, Buffer]) -> None:
        p.op.call(dev, b["pool"], dev.indices(rows.start), dev.indices(rows.table), dev.indices(_cu(lengths)), b,
                  b["out"])  # fmt: skip

    return call


def varlen_case(p: VarlenParams) -> Case:
    def run(device: Device) -> None:
        seed = case.seed
        tensors, rows, arrays = varlen_tensors(p, seed)
        call = varlen_call(p, rows)
        with np.errstate(all="ignore"):
            ref = run_on(reference_device(), tensors, seed, call)
        _check_formula(p, tensors, rows, arrays, ref)
        compare_with_reference(device, tensors, seed, call, {"pool": NMSE[p.dtype], "out": NMSE[p.act]})

    case = Case(p.id, "primitive", (p.op.op,), run, (p.requirement(),), p.caps)
    return case


# -- metamorphic cases -------------------------------------------------------------------


def _upload_tokens(dev: Device, arrays: Arrays, lo: int, hi: int, act: DType = F32) -> dict[str, Buffer]:
    out: dict[str, Buffer] = {}
    for name, value in arrays.items():
        if name.startswith("w_"):
            out[name] = dev.upload(value)
        else:
            out[name] = dev.upload(np.ascontiguousarray(value[lo:hi]), act)
    return out


def _bits_equal(what: str, got: np.ndarray, want: np.ndarray) -> None:
    assert_exact(what, got, want)


def packed_split_case(p: VarlenParams) -> Case:
    """One packed call == one call per sequence, bitwise (outputs and every pool row)."""

    def run(device: Device) -> None:
        seed = case.seed
        tensors, rows, arrays = varlen_tensors(p, seed)
        pool_host = tensors["pool"].data
        assert pool_host is not None
        lengths = np.asarray(p.lengths, dtype=np.int64)
        cu = _cu(lengths)
        dev = device
        with np.errstate(all="ignore"):
            pool = dev.upload(pool_host, p.dtype)
            out = dev.alloc((int(cu[-1]), *p.op.out_tail), p.act)
            bufs = _upload_tokens(dev, arrays, 0, int(cu[-1]), p.act)
            p.op.call(dev, pool, dev.indices(rows.start), dev.indices(rows.table), dev.indices(cu), bufs, out)
            packed_pool, packed_out = dev.download(pool), dev.download(out)
            pool2 = dev.upload(pool_host, p.dtype)
            for s, n_t in enumerate(lengths):
                lo, hi = int(cu[s]), int(cu[s + 1])
                part = _upload_tokens(dev, arrays, lo, hi, p.act)
                out_s = dev.alloc((int(n_t), *p.op.out_tail), p.act)
                p.op.call(dev, pool2, dev.indices(rows.start[s : s + 1]), dev.indices(rows.table[s : s + 1]),
                          dev.indices([0, int(n_t)]), part, out_s)  # fmt: skip
                _bits_equal(f"{p.id}: outputs of sequence {s} (packed vs alone)", packed_out[lo:hi],
                            dev.download(out_s))  # fmt: skip
            _bits_equal(f"{p.id}: pool (packed vs one call per sequence)", packed_pool, dev.download(pool2))

    case = Case(p.id, "metamorphic", (p.op.op,), run, (p.requirement(),), p.caps)
    return case


def equal_form_case(op: Op, n_s: int, n_t: int, K: int) -> Case:
    """The equal-length form ([n_s, n_t, ...], 1-D rows with n_snap) == the
    packed form with the equivalent table, bitwise."""
    case_id = f"{op.op}.equal_form[{op.label}-s{n_s}-t{n_t}-K{K}]"

    def run(device: Device) -> None:
        seed = case.seed
        rng = rng_for(seed)
        lengths = np.full(n_s, n_t, dtype=np.int64)
        rows = make_rows(lengths, K, "planes", seed)
        arrays = {**op.tokens(rng, n_s * n_t), **op.weights(rng)}
        pool_host = _pool_data(op, rows, rng)
        dev = device
        stride = n_s + 1
        dst = rows.table[:, 0]
        with np.errstate(all="ignore"):
            pool_a = dev.upload(pool_host)
            out_a = dev.alloc((n_s, n_t, *op.out_tail))
            bufs = {
                k: dev.upload(v if k.startswith("w_") else v.reshape(n_s, n_t, *v.shape[1:])) for k, v in arrays.items()
            }
            op.call(dev, pool_a, dev.indices(rows.start), dev.indices(dst), None, bufs, out_a, n_snap=K,
                    plane_stride=stride)  # fmt: skip
            pool_b = dev.upload(pool_host)
            out_b = dev.alloc((n_s * n_t, *op.out_tail))
            op.call(dev, pool_b, dev.indices(rows.start), dev.indices(rows.table), dev.indices(_cu(lengths)),
                    _upload_tokens(dev, arrays, 0, n_s * n_t), out_b)  # fmt: skip
            _bits_equal(f"{case_id}: outputs", dev.download(out_a).reshape(n_s * n_t, -1),
                        dev.download(out_b).reshape(n_s * n_t, -1))  # fmt: skip
            _bits_equal(f"{case_id}: pool", dev.download(pool_a), dev.download(pool_b))

    case = Case(case_id, "metamorphic", (op.op,), run, (op.requirement(F32, K, True),),
                {"max_snapshots": K, "varlen": True})  # fmt: skip
    return case


def rotation_case(op: Op, n_s: int, K: int, steps: int) -> Case:
    """Decode with plane rotation (read plane p, write only plane p + 1) ==
    decode with the 1-D form (read plane 0, write planes 0 and 1), bitwise:
    after every step the rotated live plane holds the 1-D form's plane 0 and
    the plane before it the 1-D form's plane 1; other planes never change."""
    case_id = f"{op.op}.rotation[{op.label}-s{n_s}-K{K}-steps{steps}]"

    def run(device: Device) -> None:
        seed = case.seed
        rng = rng_for(seed)
        dev = device
        n_rows = K * n_s
        pool_host = _u(rng, (n_rows, op.row_size), -op.start_scale, op.start_scale)
        rot_host = np.full_like(pool_host, 999.0)
        rot_host[:n_s] = pool_host[:n_s]  # plane 0 holds the start states; other planes garbage
        weights = op.weights(rng)
        wbufs = {k: dev.upload(v) for k, v in weights.items()}
        with np.errstate(all="ignore"):
            flat = dev.upload(pool_host)
            rot = dev.upload(rot_host)
            seqs = np.arange(n_s)
            plain_dst = dev.indices(seqs)
            for step in range(steps):
                toks = op.tokens(rng, n_s)
                bufs = {**wbufs, **{k: dev.upload(v.reshape(n_s, 1, *v.shape[1:])) for k, v in toks.items()}}
                out_a = dev.alloc((n_s, 1, *op.out_tail))
                op.call(dev, flat, plain_dst, plain_dst, None, bufs, out_a, n_snap=K, plane_stride=n_s)
                p, q = step % K, (step + 1) % K
                table = np.full((n_s, 2), -1, dtype=np.int64)
                table[:, 0] = q * n_s + seqs
                out_b = dev.alloc((n_s, *op.out_tail))
                packed = {**wbufs, **{k: dev.upload(v) for k, v in toks.items()}}
                op.call(dev, rot, dev.indices(p * n_s + seqs), dev.indices(table), dev.indices(np.arange(n_s + 1)),
                        packed, out_b)  # fmt: skip
                a, b = dev.download(flat), dev.download(rot)
                _bits_equal(f"{case_id}: step {step} outputs", dev.download(out_a).reshape(n_s, -1),
                            dev.download(out_b).reshape(n_s, -1))  # fmt: skip
                _bits_equal(f"{case_id}: step {step} live plane", b[q * n_s : (q + 1) * n_s], a[:n_s])
                if K > 1:
                    _bits_equal(f"{case_id}: step {step} previous plane", b[p * n_s : (p + 1) * n_s],
                                a[n_s : 2 * n_s])  # fmt: skip
                untouched = [r for r in range(K) if r not in (p, q) and r > step + 1]
                for r in untouched:
                    _bits_equal(f"{case_id}: step {step} plane {r} (never written yet)",
                                b[r * n_s : (r + 1) * n_s], rot_host[r * n_s : (r + 1) * n_s])  # fmt: skip

    case = Case(case_id, "metamorphic", (op.op,), run, (op.requirement(F32, K, True),),
                {"max_snapshots": K, "varlen": True})  # fmt: skip
    return case


def chunked_varlen_case(op: Op, lengths: tuple[int, ...], cut: tuple[int, ...]) -> Case:
    """Two packed calls over uneven chunks of each sequence (the second
    starting in place from the first's rows) == one packed call, within
    float32 tolerance (conv windows: bitwise)."""
    lens = "_".join(map(str, lengths))
    cuts = "_".join(map(str, cut))
    case_id = f"{op.op}.chunked_varlen[{op.label}-L{lens}-cut{cuts}]"

    def run(device: Device) -> None:
        seed = case.seed
        rng = rng_for(seed)
        dev = device
        L = np.asarray(lengths, dtype=np.int64)
        first = np.asarray(cut, dtype=np.int64)
        second = L - first
        n_s = L.size
        T = int(L.sum())
        arrays = {**op.tokens(rng, T), **op.weights(rng)}
        pool_host = _u(rng, (n_s, op.row_size), -op.start_scale, op.start_scale)
        rows = dev.indices(np.arange(n_s))
        cu = _cu(L)
        order = [np.arange(cu[s], cu[s] + first[s]) for s in range(n_s)]
        rest = [np.arange(cu[s] + first[s], cu[s + 1]) for s in range(n_s)]

        def take(idx: list[np.ndarray]) -> dict[str, Buffer]:
            sel = np.concatenate(idx).astype(np.int64)
            return {k: dev.upload(v if k.startswith("w_") else np.ascontiguousarray(v[sel])) for k, v in arrays.items()}

        with np.errstate(all="ignore"):
            whole = dev.upload(pool_host)
            out_whole = dev.alloc((T, *op.out_tail))
            op.call(dev, whole, rows, rows, dev.indices(cu), _upload_tokens(dev, arrays, 0, T), out_whole)
            parts = dev.upload(pool_host)
            out1 = dev.alloc((int(first.sum()), *op.out_tail))
            op.call(dev, parts, rows, rows, dev.indices(_cu(first)), take(order), out1)
            out2 = dev.alloc((int(second.sum()), *op.out_tail))
            op.call(dev, parts, rows, rows, dev.indices(_cu(second)), take(rest), out2)
            joined = np.zeros((T, *op.out_tail), dtype=np.float32)
            joined[np.concatenate(order).astype(np.int64)] = dev.download(out1)
            joined[np.concatenate(rest).astype(np.int64)] = dev.download(out2)
            got, want = dev.download(parts), dev.download(whole)
        assert_close(f"{case_id}: outputs (chunked vs one call)", joined, dev.download(out_whole), NMSE[F32])
        if op.exact_state:
            _bits_equal(f"{case_id}: windows", got, want)
        else:
            assert_close(f"{case_id}: states (chunked vs one call)", got, want, NMSE[F32])

    case = Case(case_id, "metamorphic", (op.op,), run, (op.requirement(F32, 1, True),), {"varlen": True})
    return case


def mamba1_snapshots_case(n_t: int, K: int) -> Case:
    """Mamba-1 writes snapshot planes: column j equals the final state of a
    call over the prefix n_t - j tokens long (within float32 tolerance: the
    two calls may take different kernel paths), and column n_t (when kept)
    the input state, bitwise."""
    op = scan_op("mamba1", 16, 1, 48, 1)
    case_id = f"ssm_scan.snapshots_mamba1[{op.label}-t{n_t}-K{K}]"

    def run(device: Device) -> None:
        seed = case.seed
        rng = rng_for(seed)
        dev = device
        n_s = 2
        arrays = {**op.tokens(rng, n_s * n_t), **op.weights(rng)}
        start_host = _u(rng, (n_s, op.row_size))
        pool_host = np.full((K * n_s, op.row_size), 555.0, dtype=np.float32)
        pool_host[:n_s] = start_host
        per_seq = {k: (v if k.startswith("w_") else v.reshape(n_s, n_t, *v.shape[1:])) for k, v in arrays.items()}
        with np.errstate(all="ignore"):
            pool = dev.upload(pool_host)
            rows = dev.indices(np.arange(n_s))
            y = dev.alloc((n_s, n_t, *op.out_tail))
            op.call(dev, pool, rows, rows, None, {k: dev.upload(v) for k, v in per_seq.items()}, y, n_snap=K,
                    plane_stride=n_s)  # fmt: skip
            got = dev.download(pool)
            for j in range(1, min(K, n_t + 1)):
                prefix = n_t - j
                fresh = dev.upload(pool_host[:n_s])
                if prefix:
                    part = {k: dev.upload(v if k.startswith("w_") else np.ascontiguousarray(v[:, :prefix]))
                            for k, v in per_seq.items()}  # fmt: skip
                    op.call(dev, fresh, rows, rows, None, part, dev.alloc((n_s, prefix, *op.out_tail)))
                want, column = dev.download(fresh), got[j * n_s : (j + 1) * n_s]
                what = f"{case_id}: column {j} vs a call over {prefix} tokens"
                if prefix:
                    assert_close(what, column, want, NMSE[F32])
                else:  # the input state: a copy
                    _bits_equal(what, column, want)

    case = Case(case_id, "metamorphic", ("ssm_scan",), run, (op.requirement(F32, K, False),), {"max_snapshots": K})
    return case


def activation_equiv_case(op: Op, act: DType) -> Case:
    """A call with f16/bf16 activations computes what a float32 call on the
    same values computes: the states within float32 tolerance (the math is
    float32 either way), the outputs as the float32 outputs rounded once to
    the activation dtype (within that dtype's tolerance)."""
    case_id = f"{op.op}.activations[{op.label}-{act.value}]"

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        dev = device
        lengths = np.asarray([3, 1, 0, 4], dtype=np.int64)
        T = int(lengths.sum())
        arrays = {**op.tokens(rng, T), **op.weights(rng)}
        arrays = {k: v if k.startswith("w_") else v.astype(act.numpy).astype(np.float32) for k, v in arrays.items()}
        rows = make_rows(lengths, 2, "planes", case.seed)
        pool_host = _pool_data(op, rows, rng)
        cu = dev.indices(_cu(lengths))
        start, table = dev.indices(rows.start), dev.indices(rows.table)
        results = []
        with np.errstate(all="ignore"):
            for dtype in (act, F32):
                pool = dev.upload(pool_host)
                out = dev.alloc((T, *op.out_tail), dtype)
                op.call(dev, pool, start, table, cu, _upload_tokens(dev, arrays, 0, T, dtype), out)
                results.append((dev.download(pool), dev.download(out)))
        (pool_a, out_a), (pool_f, out_f) = results
        written = rows.written()
        assert_close(f"{case_id}: states ({act.value} activations vs f32)", pool_a[written], pool_f[written], NMSE[F32])
        assert_exact(f"{case_id}: rows not written", np.delete(pool_a, written, 0), np.delete(pool_host, written, 0))
        assert_close(f"{case_id}: outputs ({act.value} vs f32 rounded)", out_a, out_f.astype(act.numpy), NMSE[act])

    req = Requirement(op.op, {**op.params, "varlen": True, "activation_dtypes": (act.value,)})
    case = Case(case_id, "metamorphic", (op.op,), run, (req,), {"varlen": True, "activation_dtypes": {act.value}})
    return case


# -- refusals ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    argument: str
    change: Callable[[dict[str, Any]], None]


def _refusals() -> list[Refusal]:
    def cu(values: list[int]) -> Callable[[dict[str, Any]], None]:
        return lambda a: a.update(cu=np.asarray(values))

    def table_at(s: int, j: int, value: int) -> Callable[[dict[str, Any]], None]:
        def change(a: dict[str, Any]) -> None:
            t = a["table"].copy()
            t[s, j] = value
            a["table"] = t

        return change

    return [
        Refusal("cu_not_from_0", "cu_seqlens", cu([1, 3, 3, 6])),
        Refusal("cu_decreasing", "cu_seqlens", cu([0, 4, 3, 6])),
        Refusal("cu_wrong_end", "cu_seqlens", cu([0, 3, 3, 5])),
        Refusal("cu_wrong_count", "start_rows", cu([0, 3, 6])),
        Refusal("cu_dtype", "cu_seqlens", lambda a: a.update(cu_dtype="f32")),
        Refusal("cu_2d", "cu_seqlens", lambda a: a.update(cu=np.asarray([[0, 3, 3, 6]]))),
        Refusal("table_past_tokens", "dst_rows", table_at(1, 1, 11)),  # sequence 1 has 0 tokens
        Refusal("table_below_minus_1", "dst_rows", table_at(0, 1, -2)),
        Refusal("table_out_of_range", "dst_rows", table_at(0, 1, 99)),
        Refusal("table_duplicate", "dst_rows", table_at(2, 1, 1)),  # row 1 is sequence 0's column 0
        Refusal("table_other_start", "start_rows", lambda a: a.update(start=np.asarray([2, 9, 10]))),
        Refusal("table_rows_count", "dst_rows", lambda a: a.update(table=a["table"][:2])),
        Refusal("table_with_n_snap", "n_snap", lambda a: a.update(kw={"n_snap": 2, "plane_stride": 3})),
        Refusal("packed_x_ndim", "x", lambda a: a.update(x_shape="equal")),
    ]


def expect_refusal(case_id: str, argument: str, call: Callable[[], None]) -> None:
    """``call`` must raise an ArgumentError naming ``argument``."""
    try:
        call()
    except ArgumentError as exc:
        if exc.argument != argument:
            raise ConformanceFailure(
                f"{case_id}: refused naming {exc.argument!r}, expected {argument!r}: {exc}"
            ) from exc
    except StatecacheError as exc:
        raise ConformanceFailure(f"{case_id}: {type(exc).__name__} instead of an ArgumentError: {exc}") from exc
    else:
        raise ConformanceFailure(f"{case_id}: the call was not refused")


def refusal_case(r: Refusal) -> Case:
    """One bad argument of the packed form: ArgumentError naming it, nothing written."""
    case_id = f"ssm_scan.refuse[{r.name}]"

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        dev = device
        H, P_, N = 2, 4, 8
        lengths = np.asarray([3, 0, 3])
        a: dict[str, Any] = {
            "cu": _cu(lengths),
            "cu_dtype": "i32",
            "start": np.asarray([1, 9, 10]),
            "table": np.asarray([[1, 4, -1], [7, -1, -1], [2, 5, 8]]),
            "kw": {},
            "x_shape": "packed",
        }
        r.change(a)
        pool_host = _u(rng, (12, H * P_ * N))
        pool = dev.upload(pool_host)
        T = 6
        x = dev.upload(_u(rng, (T, H, P_)) if a["x_shape"] == "packed" else _u(rng, (3, 2, H, P_)))
        y = dev.upload(np.full((T, H, P_), 7.0, np.float32))
        cu_buf = dev.upload(a["cu"], a["cu_dtype"]) if a["cu_dtype"] != "i32" else dev.indices(a["cu"])
        args = (
            pool, dev.indices(a["start"]), dev.indices(a["table"]), x, dev.upload(_u(rng, (T, H))),
            dev.upload(-rng.uniform(0.1, 1, H).astype(np.float32)), dev.upload(_u(rng, (T, 1, N))),
            dev.upload(_u(rng, (T, 1, N))), y,
        )  # fmt: skip
        expect_refusal(case_id, r.argument, lambda: dev.ssm_scan(*args, cu_seqlens=cu_buf, **a["kw"]))
        assert_exact(f"{case_id}: pool after a refused call", dev.download(pool), pool_host)
        assert_exact(f"{case_id}: y after a refused call", dev.download(y), np.full((T, H, P_), 7.0, np.float32))

    req = Requirement("ssm_scan", {"varlen": True, "n_snap": 3})
    case = Case(case_id, "primitive", ("ssm_scan",), run, (req,), {"varlen": True, "max_snapshots": 3})
    return case


# -- the grid ---------------------------------------------------------------------------


def ops() -> list[Op]:
    return [
        conv_op(4, 24, True),
        conv_op(3, 20, False),
        scan_op("mamba2", 16, 8, 4, 2),
        scan_op("mamba1", 16, 1, 24, 1),
        delta_op(False, 16, 4, 2),
        delta_op(True, 8, 2, 2),
    ]


def all_cases() -> list[Case]:
    cases: list[Case] = []
    F16 = DType.F16
    for op in ops():
        cases += [
            varlen_case(VarlenParams(op, (5, 0, 1, 3), 3, "planes")),
            varlen_case(VarlenParams(op, (4, 1, 0, 6), 4, "sparse")),
            varlen_case(VarlenParams(op, (1, 1, 1), 3, "rotate")),
            varlen_case(VarlenParams(op, (2, 3, 1, 4), 3, "shared")),
            varlen_case(VarlenParams(op, (3, 0, 2), 3, "planes", F16)),
            packed_split_case(VarlenParams(op, (20, 0, 1, 5), 4, "sparse", tag="packed_split")),
            packed_split_case(VarlenParams(op, (1, 1, 1, 1), 3, "rotate", tag="packed_split")),
            packed_split_case(VarlenParams(op, (3, 2, 0, 4), 3, "shared", tag="packed_split")),
            packed_split_case(VarlenParams(op, (2, 0, 3), 3, "planes", DType.BF16, tag="packed_split")),
            equal_form_case(op, 3, 4, 3),
            rotation_case(op, 3, 4, 6),
            chunked_varlen_case(op, (9, 4, 1, 20), (4, 0, 1, 17)),
        ]
        for act in (DType.F16, DType.BF16):
            cases += [
                varlen_case(VarlenParams(op, (4, 0, 1, 3), 3, "sparse", act=act)),
                packed_split_case(VarlenParams(op, (17, 1, 0, 2), 3, "planes", tag="packed_split", act=act)),
                activation_equiv_case(op, act),
            ]
    cases.append(mamba1_snapshots_case(6, 4))
    cases.append(mamba1_snapshots_case(2, 4))
    cases += [refusal_case(r) for r in _refusals()]
    return cases
