"""Cases of the linear-attention primitives: ``rwkv_wkv6``, ``rwkv_wkv7`` and
``gated_linear_attn``.

The formulas below are per-element float64 loops written from the upstream
definitions (ggml's ``ggml_compute_forward_rwkv_wkv6_f32`` /
``_rwkv_wkv7_f32`` / ``_gla_f32`` and flash-linear-attention's
``naive_recurrent_rwkv6`` / ``naive_recurrent_rwkv7`` / ``naive_recurrent_gla``),
independently of the reference backend's vectorised NumPy; every primitive
case checks the reference against them, then the device against the
reference (guard bands, unaddressed rows untouched).  The inputs follow what
the models feed these kernels: RWKV-6's decay ``-exp(x)``, RWKV-7's decay
``-0.6065 * sigmoid(x)`` with ``a = -kk`` and ``b = kk * iclr`` for an
L2-normalised key ``kk`` and a learning rate in (0, 1), GLA's gate
``logsigmoid(x) / 16``.

The contract cases of :mod:`statecache.conformance.varlen_cases` run on each
op (packed tokens with lengths 0 and 1, snapshot tables of every mode, the
equal-length form, plane rotation, chunked calls, f16/bf16 activations and
storage), and the metamorphic cases of
:mod:`statecache.conformance.metamorphic_cases` (each snapshot plane against
a call over the prefix that is that many tokens shorter, prefill split at
every token and token-by-token decode against one call, sequences decoded
together against alone).  ``strided`` cases read every input as a view into
one fused projection row per token; ``refuse`` cases pass one bad argument
each: an ArgumentError naming it, nothing written.
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
    Requirement,
    Tensor,
    assert_exact,
    check_tensor,
    compare_with_reference,
    rng_for,
    run_on,
)
from statecache.conformance.metamorphic_cases import Adapter, chunked, snapshot_prefix, together
from statecache.conformance.varlen_cases import (
    Arrays,
    Op,
    VarlenParams,
    activation_equiv_case,
    chunked_varlen_case,
    equal_form_case,
    expect_refusal,
    packed_split_case,
    rotation_case,
    varlen_call,
    varlen_case,
    varlen_tensors,
)
from statecache.dtypes import DType
from statecache.primitives import LINEAR_ATTN_INPUTS

F32 = DType.F32


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# -- the three ops, with their float64 per-element formulas -------------------------------


def _per_token(a: Arrays, names: tuple[str, ...]) -> list[np.ndarray]:
    return [a[n].astype(np.float64) for n in names]


def _blocks(row: np.ndarray, H: int, S: int) -> list[list[list[float]]]:
    """A flat state row as nested lists [h][row][col] (the storage order)."""
    flat = [float(x) for x in row]
    return [[flat[(h * S + i) * S : (h * S + i + 1) * S] for i in range(S)] for h in range(H)]


def _flat(blocks: list[list[list[float]]]) -> np.ndarray:
    return np.asarray([x for head in blocks for row in head for x in row], dtype=np.float64)


def _formula(
    H: int,
    S: int,
    names: tuple[str, ...],
    token: Callable[[list[list[float]], int, list[np.ndarray], Arrays, int, list[float]], None],
) -> Callable[[np.ndarray, np.ndarray, Arrays], tuple[list[list[np.ndarray]], np.ndarray]]:
    """The Op formula driver: ``token(M, h, inputs, weights, tok, out)`` advances
    head h's block M (lists, in place) by one token and fills ``out`` [S]."""

    def formula(starts: np.ndarray, lengths: np.ndarray, a: Arrays):  # type: ignore[no-untyped-def]
        inputs = _per_token(a, names)
        o = np.zeros(inputs[0].shape)
        states = []
        t0 = 0
        for s, n_t in enumerate(lengths):
            blocks = _blocks(starts[s], H, S)
            per_t = [_flat(blocks)]
            for t in range(int(n_t)):
                for h in range(H):
                    out = [0.0] * S
                    token(blocks[h], h, inputs, a, t0 + t, out)
                    o[t0 + t, h] = out
                per_t.append(_flat(blocks))
            states.append(per_t)
            t0 += int(n_t)
        return states, o

    return formula


def rwkv6_op(S: int, H: int, scale: float | None = None) -> Op:
    names = LINEAR_ATTN_INPUTS["rwkv_wkv6"]
    sc = 1.0 if scale is None else float(scale)

    def tokens(rng: np.random.Generator, T: int) -> Arrays:
        return {
            "r": _u(rng, (T, H, S)),
            "k": _u(rng, (T, H, S)),
            "v": _u(rng, (T, H, S)),
            "w": (-np.exp(rng.uniform(-4.0, 0.5, (T, H, S)))).astype(np.float32),
        }

    def weights(rng: np.random.Generator) -> Arrays:
        return {"w_u": _u(rng, (H, S))}

    def call(dev, pool, start, dst, cu, b, out, **kw):  # type: ignore[no-untyped-def]
        dev.rwkv_wkv6(pool, start, dst, b["r"], b["k"], b["v"], b["w"], b["w_u"], out, scale=scale, cu_seqlens=cu,
                      **kw)  # fmt: skip

    def token(M, h, inp, a, tok, out):  # type: ignore[no-untyped-def]
        r, k, v, w = (x[tok, h] for x in inp)
        u = a["w_u"].astype(np.float64)[h]
        for j in range(S):  # M[i][j]: i key, j value; the output sees the state before this token
            out[j] = sc * sum(r[i] * (M[i][j] + u[i] * k[i] * v[j]) for i in range(S))
        for i in range(S):
            decay = math.exp(w[i])
            for j in range(S):
                M[i][j] = decay * M[i][j] + k[i] * v[j]

    label = f"rwkv6-S{S}-h{H}" + ("" if scale is None else f"-scale{scale}")
    formula = _formula(H, S, names, token)
    return Op("rwkv_wkv6", label, H * S * S, (H, S), tokens, weights, call, formula, False, {"head_size": S})


def rwkv7_op(S: int, H: int, scale: float | None = None) -> Op:
    names = LINEAR_ATTN_INPUTS["rwkv_wkv7"]
    sc = 1.0 if scale is None else float(scale)

    def tokens(rng: np.random.Generator, T: int) -> Arrays:
        kk = rng.uniform(-1.0, 1.0, (T, H, S))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        iclr = _sigmoid(rng.uniform(-3.0, 3.0, (T, H, S)))
        return {
            "r": _u(rng, (T, H, S)),
            "w": (-0.606531 * _sigmoid(rng.uniform(-3.0, 3.0, (T, H, S)))).astype(np.float32),
            "k": _u(rng, (T, H, S)),
            "v": _u(rng, (T, H, S)),
            "a": (-kk).astype(np.float32),
            "b": (kk * iclr).astype(np.float32),
        }

    def weights(rng: np.random.Generator) -> Arrays:
        return {}

    def call(dev, pool, start, dst, cu, b, out, **kw):  # type: ignore[no-untyped-def]
        dev.rwkv_wkv7(pool, start, dst, b["r"], b["w"], b["k"], b["v"], b["a"], b["b"], out, scale=scale,
                      cu_seqlens=cu, **kw)  # fmt: skip

    def token(M, h, inp, a_, tok, out):  # type: ignore[no-untyped-def]
        r, w, k, v, a, b = (x[tok, h] for x in inp)
        for i in range(S):  # M[i][j]: i value, j key
            sa = sum(a[j] * M[i][j] for j in range(S))  # the state before this token
            for j in range(S):
                M[i][j] = M[i][j] * math.exp(w[j]) + sa * b[j] + v[i] * k[j]
            out[i] = sc * sum(M[i][j] * r[j] for j in range(S))

    label = f"rwkv7-S{S}-h{H}" + ("" if scale is None else f"-scale{scale}")
    formula = _formula(H, S, names, token)
    return Op("rwkv_wkv7", label, H * S * S, (H, S), tokens, weights, call, formula, False, {"head_size": S})


def gla_op(S: int, H: int, scale: float | None = None) -> Op:
    names = LINEAR_ATTN_INPUTS["gated_linear_attn"]
    sc = 1.0 / math.sqrt(S) if scale is None else float(scale)

    def tokens(rng: np.random.Generator, T: int) -> Arrays:
        gate = -np.log1p(np.exp(-rng.uniform(-2.0, 5.0, (T, H, S)))) / 16.0  # logsigmoid(x) / 16
        return {
            "q": _u(rng, (T, H, S)),
            "k": _u(rng, (T, H, S)),
            "v": _u(rng, (T, H, S)),
            "g": gate.astype(np.float32),
        }

    def weights(rng: np.random.Generator) -> Arrays:
        return {}

    def call(dev, pool, start, dst, cu, b, out, **kw):  # type: ignore[no-untyped-def]
        dev.gated_linear_attn(pool, start, dst, b["q"], b["k"], b["v"], b["g"], out, scale=scale, cu_seqlens=cu,
                              **kw)  # fmt: skip

    def token(M, h, inp, a, tok, out):  # type: ignore[no-untyped-def]
        q, k, v, g = (x[tok, h] for x in inp)
        for i in range(S):  # M[i][j]: i key, j value; the output sees the updated state
            decay = math.exp(g[i])
            for j in range(S):
                M[i][j] = decay * M[i][j] + k[i] * v[j]
        for j in range(S):
            out[j] = sc * sum(q[i] * M[i][j] for i in range(S))

    label = f"gla-S{S}-h{H}" + ("" if scale is None else f"-scale{scale}")
    formula = _formula(H, S, names, token)
    return Op("gated_linear_attn", label, H * S * S, (H, S), tokens, weights, call, formula, False, {"head_size": S})


def ops() -> list[Op]:
    return [rwkv6_op(16, 3), rwkv7_op(16, 3), gla_op(16, 3)]


# -- metamorphic cases through the Adapter interface --------------------------------------


def adapter_of(op: Op) -> Adapter:
    """The op driven by :mod:`statecache.conformance.metamorphic_cases` (inputs
    [n_s, n_t, ...] and 1-D destination rows with n_snap / plane_stride)."""

    def inputs(rng: np.random.Generator, n_s: int, n_t: int) -> Arrays:
        toks = {k: v.reshape(n_s, n_t, *v.shape[1:]) for k, v in op.tokens(rng, n_s * n_t).items()}
        return {**toks, **op.weights(rng)}

    def call(dev, pool, start, dst, b, out, n_snap, stride):  # type: ignore[no-untyped-def]
        op.call(dev, pool, start, dst, None, b, out, n_snap=n_snap, plane_stride=stride)

    return Adapter(op.op, op.label, op.row_size, op.out_tail, inputs, call, op.exact_state, op.params)


def _metamorphic(case_id: str, ad: Adapter, dtype: DType, K: int, fn: Callable[[Device, int], None]) -> Case:
    def run(device: Device) -> None:
        fn(device, case.seed)

    caps = {"storage_dtypes": {dtype.value}, "max_snapshots": K}
    case = Case(case_id, "metamorphic", (ad.op,), run, (ad.requirement(dtype, K),), caps)
    return case


def metamorphic(op: Op) -> list[Case]:
    ad = adapter_of(op)
    cases = []
    for dtype in (F32, DType.F16, DType.BF16):
        tag = f"{ad.label}-{dtype.value}"
        for n_t, K in ((5, 4), (2, 4), (6, 3)) if dtype is F32 else ((5, 4),):

            def prefix(d: Device, seed: int, dt: DType = dtype, n: int = n_t, k: int = K) -> None:
                snapshot_prefix(d, ad, dt, 2, n, k, seed)

            cases.append(_metamorphic(f"{ad.op}.snapshot_prefix[{tag}-t{n_t}-K{K}]", ad, dtype, K, prefix))
        cases.append(_metamorphic(f"{ad.op}.chunked[{tag}-t6]", ad, dtype, 1,
                                  lambda d, seed, dt=dtype: chunked(d, ad, dt, 2, 6, seed)))  # fmt: skip
        cases.append(_metamorphic(f"{ad.op}.together[{tag}-s3]", ad, dtype, 1,
                                  lambda d, seed, dt=dtype: together(d, ad, dt, 3, 4, seed)))  # fmt: skip
    return cases


# -- primitive cases at model sizes: the device against the reference ----------------------


def reference_case(op: Op, lengths: tuple[int, ...], K: int, mode: str, dtype: DType = F32) -> Case:
    """Model-sized heads (the formula loops would take too long there): the
    device against the reference only, guard bands and untouched rows checked."""
    p = VarlenParams(op, lengths, K, mode, dtype, tag="model_size")

    def run(device: Device) -> None:
        seed = case.seed
        tensors, rows, _ = varlen_tensors(p, seed)
        cu = np.concatenate([[0], np.cumsum(lengths)])

        def call(dev: Device, b: dict[str, Buffer]) -> None:
            op.call(dev, b["pool"], dev.indices(rows.start), dev.indices(rows.table), dev.indices(cu), b, b["out"])

        compare_with_reference(device, tensors, seed, call, {"pool": NMSE[dtype], "out": NMSE[F32]})

    case = Case(p.id, "primitive", (op.op,), run, (p.requirement(),), p.caps)
    return case


def strided_case(op: Op, n_s: int, n_t: int) -> Case:
    """Every per-token input a view into one fused projection row per token
    ([n_s, n_t, L] with the inputs side by side and some padding), as a
    runtime's fused in_proj leaves them; the weights contiguous."""
    case_id = f"{op.op}.strided[{op.label}-s{n_s}-t{n_t}]"

    def run(device: Device) -> None:
        seed = case.seed
        rng = rng_for(seed)
        H, S = op.out_tail
        names = LINEAR_ATTN_INPUTS[op.op]
        toks = op.tokens(rng, n_s * n_t)
        width = H * S
        L = len(names) * width + 5
        fused = _u(rng, (n_s, n_t, L))  # the padding: 3 elements before the first input, 2 after the last
        tensors: dict[str, Tensor] = {"fused": Tensor(fused)}
        for m, name in enumerate(names):
            at = 3 + m * width
            fused[:, :, at : at + width] = toks[name].reshape(n_s, n_t, width)
            tensors[name] = Tensor(None, view=("fused", (n_s, n_t, H, S), (n_t * L, L, S, 1), at))
        for name, value in op.weights(rng).items():
            tensors[name] = Tensor(value)
        n_rows = 2 * n_s + 2
        pool = rng.uniform(-1e3, 1e3, (n_rows, op.row_size)).astype(np.float32)
        pool[1 : n_s + 1] = _u(rng, (n_s, op.row_size))
        dst = 1 + n_s + rng.permutation(n_s)
        tensors["pool"] = Tensor(pool, output=True, written=dst)
        tensors["out"] = Tensor(np.full((n_s, n_t, H, S), 55.0, np.float32), output=True)

        def call(dev: Device, b: dict[str, Buffer]) -> None:
            op.call(dev, b["pool"], dev.indices(1 + np.arange(n_s)), dev.indices(dst), None, b, b["out"])

        compare_with_reference(device, tensors, seed, call, {"pool": NMSE[F32], "out": NMSE[F32]})

    req = Requirement(op.op, {**op.params, "strided": True})
    case = Case(case_id, "primitive", (op.op,), run, (req,), {"strided_inputs": True})
    return case


# -- the oracle family: the device against the formulas themselves -------------------------


def oracle_case(op: Op, lengths: tuple[int, ...], K: int, mode: str, dtype: DType = F32) -> Case:
    """The device's pool and outputs against the per-element formulas directly
    (no reference in between), with the guard and untouched-row checks of
    every primitive case."""
    p = VarlenParams(op, lengths, K, mode, dtype)
    lens = "_".join(map(str, lengths))
    case_id = f"oracle.{op.op}[{op.label}-L{lens}-K{K}-{mode}-{dtype.value}]"

    def run(device: Device) -> None:
        seed = case.seed
        tensors, rows, arrays = varlen_tensors(p, seed)
        got = run_on(device, tensors, seed, varlen_call(p, rows))
        pool_in = tensors["pool"].data
        assert pool_in is not None
        starts = pool_in.astype(dtype.numpy).astype(np.float64)[rows.start]
        states, out = op.formula(starts, np.asarray(lengths), arrays)
        want: dict[str, np.ndarray] = {"out": out}
        pool_want = pool_in.astype(dtype.numpy).astype(np.float64)
        for s, n_t in enumerate(lengths):
            for j in range(K):
                if rows.table[s, j] >= 0:
                    pool_want[rows.table[s, j]] = states[s][n_t - j]
        want["pool"] = pool_want
        for name, t in tensors.items():
            placed, got_full = got[name]
            want_full = None
            if t.output:
                want_full = placed.initial.copy()
                n = want[name].size
                want_full[placed.offset : placed.offset + n] = want[name].reshape(-1).astype(want_full.dtype)
            tol = NMSE[dtype] if name == "pool" else NMSE[F32]
            check_tensor(name, t, placed, got_full, want_full, tol)

    case = Case(case_id, "oracle", (op.op,), run, (p.requirement(),), p.caps)
    return case


# -- refusals --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    argument: str
    change: Callable[[dict[str, Any]], None]


def _refusals(op: str) -> list[Refusal]:
    names = LINEAR_ATTN_INPUTS[op]
    second, last = names[1], names[-1]

    def shape(name: str, new: tuple[int, ...]) -> Callable[[dict[str, Any]], None]:
        return lambda a: a["shapes"].update({name: new})

    out = [
        Refusal("o_shape", "o", shape("o", (6, 2, 7))),
        Refusal(f"{second}_head_size", second, shape(second, (6, 2, 7))),
        Refusal(f"{last}_heads", last, shape(last, (6, 3, 8))),
        Refusal(f"{second}_dtype", second, lambda a: a["dtypes"].update({second: "i32"})),
        Refusal("o_aliases_input", "o", lambda a: a.update(alias=True)),
        Refusal("pool_row", "pool", lambda a: a.update(row=2 * 8 * 8 + 1)),
        Refusal("scale_nan", "scale", lambda a: a["kw"].update(scale=float("nan"))),
        Refusal("scale_str", "scale", lambda a: a["kw"].update(scale="0.5")),
        Refusal("cu_wrong_end", "cu_seqlens", lambda a: a.update(cu=np.asarray([0, 3, 3, 5]))),
        Refusal("table_past_tokens", "dst_rows", lambda a: a.update(table=np.asarray([[1, 4], [7, 11], [2, 5]]))),
    ]
    if op == "rwkv_wkv6":
        out += [
            Refusal("u_shape", "u", shape("w_u", (2,))),
            Refusal("u_dtype", "u", lambda a: a["dtypes"].update(w_u="f16")),
        ]
    return out


def refusal_case(op: str, r: Refusal) -> Case:
    """One bad argument: ArgumentError naming it, pool and output unchanged."""
    case_id = f"{op}.refuse[{r.name}]"

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        dev = device
        H, S, T = 2, 8, 6
        names = LINEAR_ATTN_INPUTS[op]
        a: dict[str, Any] = {
            "shapes": {**{n: (T, H, S) for n in names}, "o": (T, H, S), "w_u": (H, S)},
            "dtypes": {},
            "kw": {},
            "alias": False,
            "row": H * S * S,
            "cu": np.asarray([0, 3, 3, 6]),
            "table": np.asarray([[1, 4], [7, -1], [2, 5]]),
        }
        r.change(a)
        pool_host = _u(rng, (12, a["row"]))
        pool = dev.upload(pool_host)
        bufs = {}
        for n in (*names, "w_u"):
            shp = a["shapes"][n]
            dtype = a["dtypes"].get(n, "f32")
            bufs[n] = dev.indices(np.zeros(shp)) if dtype == "i32" else dev.upload(_u(rng, shp), dtype)
        o_host = np.full(a["shapes"]["o"], 7.0, np.float32)
        o = dev.upload(o_host)
        if a["alias"]:  # o shares its storage with the second input (a view of its first half)
            base = dev.upload(_u(rng, (2, T, H, S)))
            bufs[names[1]] = base.view((T, H, S), offset=T * H * S)
            o = base.view((T, H, S))
        cu = dev.indices(a["cu"])
        start, table = dev.indices(np.asarray([1, 9, 10])), dev.indices(a["table"])
        token_bufs = [bufs[n] for n in names]
        if op == "rwkv_wkv6":

            def call() -> None:
                dev.rwkv_wkv6(pool, start, table, *token_bufs, bufs["w_u"], o, cu_seqlens=cu, **a["kw"])
        else:

            def call() -> None:
                getattr(dev, op)(pool, start, table, *token_bufs, o, cu_seqlens=cu, **a["kw"])

        expect_refusal(case_id, r.argument, call)
        assert_exact(f"{case_id}: pool after a refused call", dev.download(pool), pool_host)
        if not a["alias"]:
            assert_exact(f"{case_id}: o after a refused call", dev.download(o), o_host)

    req = Requirement(op, {"varlen": True, "n_snap": 2})
    case = Case(case_id, "primitive", (op,), run, (req,), {"varlen": True, "max_snapshots": 2})
    return case


# -- the grid ---------------------------------------------------------------------------------


def all_cases() -> list[Case]:
    cases: list[Case] = []
    F16, BF16 = DType.F16, DType.BF16
    for op in ops():
        cases += [
            varlen_case(VarlenParams(op, (5, 0, 1, 3), 3, "planes")),
            varlen_case(VarlenParams(op, (4, 1, 0, 6), 4, "sparse")),
            varlen_case(VarlenParams(op, (1, 1, 1), 3, "rotate")),
            varlen_case(VarlenParams(op, (2, 3, 1, 4), 3, "shared")),
            varlen_case(VarlenParams(op, (3, 0, 2), 3, "planes", F16)),
            varlen_case(VarlenParams(op, (3, 0, 2), 2, "sparse", BF16)),
            packed_split_case(VarlenParams(op, (20, 0, 1, 5), 4, "sparse", tag="packed_split")),
            packed_split_case(VarlenParams(op, (1, 1, 1, 1), 3, "rotate", tag="packed_split")),
            packed_split_case(VarlenParams(op, (3, 2, 0, 4), 3, "shared", tag="packed_split")),
            packed_split_case(VarlenParams(op, (2, 0, 3), 3, "planes", BF16, tag="packed_split")),
            equal_form_case(op, 3, 4, 3),
            rotation_case(op, 3, 4, 6),
            chunked_varlen_case(op, (9, 4, 1, 20), (4, 0, 1, 17)),
            strided_case(op, 2, 3),
        ]
        for act in (F16, BF16):
            cases += [
                varlen_case(VarlenParams(op, (4, 0, 1, 3), 3, "sparse", act=act)),
                packed_split_case(VarlenParams(op, (17, 1, 0, 2), 3, "planes", tag="packed_split", act=act)),
                activation_equiv_case(op, act),
            ]
        cases += metamorphic(op)
    # other head sizes and an explicit scale (odd sizes: no vector-width assumption)
    for op in (rwkv6_op(5, 2, 0.5), rwkv7_op(12, 2, 0.25), gla_op(9, 2, 0.3)):
        cases.append(varlen_case(VarlenParams(op, (3, 1, 0), 3, "planes")))
    # model sizes (RWKV-6/7 and GLA heads are 64 wide; 128 for wider models)
    for make in (rwkv6_op, rwkv7_op, gla_op):
        cases.append(reference_case(make(64, 4), (9, 1, 0, 3), 3, "planes"))
        cases.append(reference_case(make(128, 2), (1, 1, 4), 2, "rotate"))
        cases.append(reference_case(make(64, 2), (1, 2, 1), 3, "sparse", DType.F16))
    for op in (rwkv6_op(8, 2), rwkv7_op(8, 2), gla_op(8, 2)):
        cases += [
            oracle_case(op, (3, 0, 1, 2), 3, "planes"),
            oracle_case(op, (2, 4, 1), 3, "sparse", DType.F16),
            oracle_case(op, (1, 1), 2, "rotate", DType.BF16),
        ]
    for op_name in LINEAR_ATTN_INPUTS:
        cases += [refusal_case(op_name, r) for r in _refusals(op_name)]
    return cases
