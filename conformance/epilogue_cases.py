"""Cases of the fused epilogues, with the semantics runtimes already use.

ssm_scan, as mamba_ssm's ``selective_state_update`` /
``mamba_chunk_scan_combined``: ``dt_bias`` added before softplus, the
``dt_limit`` clamp after it, the ``D`` skip ([n_head] or [n_head, head_dim]),
the ``z`` gate ``y * silu(z)`` last.  gated_delta_net: the ``grouped`` q/k
head map of transformers / flash-linear-attention / vLLM, in-kernel q/k L2
normalisation (fla's ``use_qk_l2norm_in_kernel``, eps 1e-6 inside the
square root), and the gate and beta from raw projections as Qwen3-Next
computes them (``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``; per key for KDA).

Primitive cases check the reference against the float64 formulas of
:mod:`statecache.conformance.varlen_cases` (which include every epilogue)
and the device against the reference.  Metamorphic cases tie each option to
the plain call it replaces: ``grouped`` == ``tiled`` with q and k repeated
per value head (bitwise), in-kernel L2 norm ~ normalising on the host, raw
gates ~ gates computed on the host.  ``refuse`` cases pass one bad option
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
    ConformanceFailure,
    Requirement,
    assert_close,
    assert_exact,
    rng_for,
)
from statecache.conformance.varlen_cases import (
    Op,
    VarlenParams,
    delta_op,
    expect_refusal,
    packed_split_case,
    scan_op,
    varlen_case,
)
from statecache.dtypes import DType
from statecache.primitives import L2NORM_EPS

F32 = DType.F32


def _with_epilogues(op: Op, names: tuple[str, ...]) -> Op:
    """The op's requirement names the epilogues it uses (cases are 'not
    supported' on a device without them, never failed)."""
    return dataclasses.replace(op, params={**op.params, "epilogues": names})


def scan_ops() -> list[Op]:
    m2 = {"N": 16, "P": 8, "H": 4, "G": 2}
    limit = (0.05, 0.6)  # clamps on both sides for dt in [-2, 1] plus a bias in [-1, 1]
    return [
        _with_epilogues(scan_op("mamba2", **m2, dt_bias=True), ("dt_bias",)),
        _with_epilogues(scan_op("mamba2", **m2, dt_bias=True, dt_limit=limit), ("dt_bias", "dt_limit")),
        _with_epilogues(scan_op("mamba2", **m2, D="h"), ("D",)),
        _with_epilogues(scan_op("mamba2", **m2, D="hp", z=True), ("D", "z")),
        _with_epilogues(
            scan_op("mamba2", **m2, dt_bias=True, dt_limit=limit, D="hp", z=True), ("dt_bias", "dt_limit", "D", "z")
        ),
        _with_epilogues(scan_op("mamba1", 16, 1, 24, 1, dt_bias=True, D="h", z=True), ("dt_bias", "D", "z")),
    ]


def _label(op: Op) -> Op:
    tags = []
    kw = op.kwargs
    for key, tag in (("dt_bias", "bias"), ("D", "D"), ("z", "z")):
        if kw.get(key):
            tags.append(tag if key != "D" else f"D{kw['D']}")
    if kw.get("dt_limit"):
        tags.append("limit")
    for key, tag in (("qk_l2norm", "l2"), ("raw_gate", "raw"), ("beta_sigmoid", "sig")):
        if kw.get(key):
            tags.append(tag)
    if kw.get("head_map") == "grouped":
        tags.append("grouped")
    if kw.get("scale") is not None:
        tags.append(f"scale{kw['scale']}")
    return dataclasses.replace(op, label=op.label + "-" + "_".join(tags))


def delta_ops() -> list[Op]:
    return [
        _with_epilogues(delta_op(False, 8, 8, 2, head_map="grouped"), ("grouped_heads",)),
        _with_epilogues(delta_op(True, 8, 4, 2, head_map="grouped"), ("grouped_heads",)),
        _with_epilogues(delta_op(False, 16, 4, 4, qk_l2norm=True), ("qk_l2norm",)),
        _with_epilogues(delta_op(False, 8, 4, 2, raw_gate=True, beta_sigmoid=True), ("raw_gate", "beta_sigmoid")),
        _with_epilogues(delta_op(True, 8, 4, 4, raw_gate=True), ("raw_gate",)),
        _with_epilogues(
            delta_op(False, 16, 6, 2, head_map="grouped", qk_l2norm=True, raw_gate=True, beta_sigmoid=True, scale=0.25),
            ("grouped_heads", "qk_l2norm", "raw_gate", "beta_sigmoid"),
        ),
    ]


# -- metamorphic: each option against the plain call it replaces -----------------------


def _run_packed(dev: Device, op: Op, arrays: dict[str, np.ndarray], pool_host: np.ndarray, n_s: int, n_t: int,
                **kw: Any) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One packed call of n_s sequences of n_t tokens, each in place on its own row."""
    pool = dev.upload(pool_host)
    rows = dev.indices(np.arange(n_s))
    out = dev.alloc((n_s * n_t, *op.out_tail))
    bufs = {k: dev.upload(v) for k, v in arrays.items()}
    op.call(dev, pool, rows, rows, dev.indices(np.arange(n_s + 1) * n_t), bufs, out, **kw)
    return dev.download(pool), dev.download(out)


def grouped_equiv_case(kda: bool, S_: int, Hv: int, Hk: int) -> Case:
    """``head_map="grouped"`` == the tiled map with q and k repeated per value
    head (repeat_interleave, what a transformers runtime does by hand), bitwise."""
    case_id = f"gated_delta_net.grouped_equiv[{'kda' if kda else 'scalar'}-S{S_}-hv{Hv}-hk{Hk}]"
    grouped = delta_op(kda, S_, Hv, Hk, head_map="grouped")
    tiled = delta_op(kda, S_, Hv, Hv)

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        n_s, n_t = 2, 5
        arrays = {**grouped.tokens(rng, n_s * n_t), **grouped.weights(rng)}
        pool_host = rng.uniform(-0.5, 0.5, (n_s, grouped.row_size)).astype(np.float32)
        repeated = dict(arrays)
        for name in ("q", "k"):
            repeated[name] = np.ascontiguousarray(np.repeat(arrays[name], Hv // Hk, axis=1))
        with np.errstate(all="ignore"):
            pool_g, out_g = _run_packed(device, grouped, arrays, pool_host, n_s, n_t)
            pool_t, out_t = _run_packed(device, tiled, repeated, pool_host, n_s, n_t)
        assert_exact(f"{case_id}: outputs", out_g, out_t)
        assert_exact(f"{case_id}: states", pool_g, pool_t)
        # the maps really differ here: the tiled map on the same q/k gives other results
        with np.errstate(all="ignore"):
            _, out_tiled = _run_packed(device, delta_op(kda, S_, Hv, Hk), arrays, pool_host, n_s, n_t)
        if np.array_equal(out_tiled, out_g):
            raise ConformanceFailure(f"{case_id}: grouped and tiled maps gave the same outputs")

    req = Requirement("gated_delta_net", {"head_size": S_, "varlen": True, "epilogues": ("grouped_heads",)})
    case = Case(case_id, "metamorphic", ("gated_delta_net",), run, (req,), {"varlen": True})
    return case


def option_equiv_case(option: str, kda: bool) -> Case:
    """An in-kernel option ~ the plain call on inputs the host prepared:
    ``qk_l2norm`` vs q/k normalised on the host, ``raw_gate`` (with
    ``beta_sigmoid``) vs the gate and beta computed on the host (float32
    tolerance: the same math, rounded in other places)."""
    case_id = f"gated_delta_net.{option}_equiv[{'kda' if kda else 'scalar'}]"
    S_, Hv, Hk = 16, 4, 2
    kwargs: dict[str, Any] = {"qk_l2norm": True} if option == "qk_l2norm" else {"raw_gate": True, "beta_sigmoid": True}
    fused = delta_op(kda, S_, Hv, Hk, **kwargs)
    plain = delta_op(kda, S_, Hv, Hk)
    names = ("qk_l2norm",) if option == "qk_l2norm" else ("raw_gate", "beta_sigmoid")

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        n_s, n_t = 3, 4
        arrays = {**fused.tokens(rng, n_s * n_t), **fused.weights(rng)}
        pool_host = rng.uniform(-0.5, 0.5, (n_s, fused.row_size)).astype(np.float32)
        host = {k: v.astype(np.float64) for k, v in arrays.items()}
        prepared = {k: v for k, v in arrays.items() if not k.startswith("w_")}
        if option == "qk_l2norm":
            for name in ("q", "k"):
                a = host[name]
                prepared[name] = (a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + L2NORM_EPS)).astype(np.float32)
        else:
            a = host["g"] + (host["w_dt_bias"] if kda else host["w_dt_bias"][None, :])
            softplus = np.where(a > 20.0, a, np.log1p(np.exp(np.minimum(a, 20.0))))
            rate = np.exp(host["w_A_log"])
            prepared["g"] = (-(rate[None, :, None] if kda else rate[None, :]) * softplus).astype(np.float32)
            prepared["beta"] = (1.0 / (1.0 + np.exp(-host["beta"]))).astype(np.float32)
        with np.errstate(all="ignore"):
            pool_f, out_f = _run_packed(device, fused, arrays, pool_host, n_s, n_t)
            pool_p, out_p = _run_packed(device, plain, prepared, pool_host, n_s, n_t)
        assert_close(f"{case_id}: outputs", out_f, out_p, NMSE[F32])
        assert_close(f"{case_id}: states", pool_f, pool_p, NMSE[F32])

    req = Requirement(
        "gated_delta_net",
        {"head_size": S_, "variant": "kda" if kda else "scalar", "varlen": True, "epilogues": names},
    )
    case = Case(case_id, "metamorphic", ("gated_delta_net",), run, (req,), {"varlen": True})
    return case


def scan_bias_equiv_case() -> Case:
    """``dt_bias`` ~ dt + dt_bias added on the host; ``D`` and ``z`` ~ applied
    to the plain call's y on the host (float32 tolerance)."""
    case_id = "ssm_scan.epilogue_equiv[mamba2-d16-h8-n4-g2]"
    fused = scan_op("mamba2", 16, 8, 4, 2, dt_bias=True, D="hp", z=True)
    plain = scan_op("mamba2", 16, 8, 4, 2)

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        n_s, n_t = 3, 5
        arrays = {**fused.tokens(rng, n_s * n_t), **fused.weights(rng)}
        pool_host = rng.uniform(-1, 1, (n_s, fused.row_size)).astype(np.float32)
        prepared = {k: arrays[k] for k in ("x", "B", "C", "w_A")}
        prepared["dt"] = (arrays["dt"].astype(np.float64) + arrays["w_dt_bias"]).astype(np.float32)
        with np.errstate(all="ignore"):
            pool_f, y_f = _run_packed(device, fused, arrays, pool_host, n_s, n_t)
            pool_p, y_p = _run_packed(device, plain, prepared, pool_host, n_s, n_t)
        z = arrays["z"].astype(np.float64)
        want = (y_p + arrays["w_D"][None] * arrays["x"].astype(np.float64)) * (z / (1.0 + np.exp(-z)))
        assert_close(f"{case_id}: states (dt_bias fused vs added on the host)", pool_f, pool_p, NMSE[F32])
        assert_close(f"{case_id}: y (D and z fused vs applied on the host)", y_f, want, NMSE[F32])

    req = Requirement("ssm_scan", {"variant": "mamba2", "varlen": True, "epilogues": ("dt_bias", "D", "z")})
    case = Case(case_id, "metamorphic", ("ssm_scan",), run, (req,), {"varlen": True})
    return case


# -- refusals ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bad:
    op: str
    name: str
    argument: str
    kwargs: Callable[[Device, np.random.Generator], dict[str, Any]]


def _bad_options() -> list[Bad]:
    def buf(*shape: int, dtype: str = "f32") -> Callable[[Device, np.random.Generator], Buffer]:
        return lambda dev, rng: dev.upload(rng.uniform(-1, 1, shape).astype(np.float32), dtype)

    def kw(**items: Any) -> Callable[[Device, np.random.Generator], dict[str, Any]]:
        return lambda dev, rng: {k: (v(dev, rng) if callable(v) else v) for k, v in items.items()}

    # ssm_scan below: T = 6 tokens, n_head 4, head_dim 8; gated_delta_net: H_v 4, H_k 2, S 8
    return [
        Bad("ssm_scan", "D_shape", "D", kw(D=buf(3))),
        Bad("ssm_scan", "D_dtype", "D", kw(D=buf(4, dtype="f16"))),
        Bad("ssm_scan", "z_shape", "z", kw(z=buf(6, 4, 7))),
        Bad("ssm_scan", "z_dtype", "z", kw(z=buf(6, 4, 8, dtype="i32"))),
        Bad("ssm_scan", "dt_bias_shape", "dt_bias", kw(dt_bias=buf(4, 1))),
        Bad("ssm_scan", "dt_limit_order", "dt_limit", kw(dt_limit=(1.0, 0.5))),
        Bad("ssm_scan", "dt_limit_nan", "dt_limit", kw(dt_limit=(0.0, math.nan))),
        Bad("ssm_scan", "dt_limit_single", "dt_limit", kw(dt_limit=0.5)),
        Bad("gated_delta_net", "head_map", "head_map", kw(head_map="interleaved")),
        Bad("gated_delta_net", "qk_l2norm_type", "qk_l2norm", kw(qk_l2norm="yes")),
        Bad("gated_delta_net", "beta_sigmoid_type", "beta_sigmoid", kw(beta_sigmoid=1)),
        Bad("gated_delta_net", "A_log_shape", "A_log", kw(A_log=buf(2))),
        Bad("gated_delta_net", "dt_bias_without_A_log", "dt_bias", kw(dt_bias=buf(4))),
        Bad("gated_delta_net", "dt_bias_shape", "dt_bias", kw(A_log=buf(4), dt_bias=buf(4, 8))),
        Bad("gated_delta_net", "scale_inf", "scale", kw(scale=math.inf)),
    ]


def bad_option_case(bad: Bad) -> Case:
    case_id = f"{bad.op}.refuse[{bad.name}]"

    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        dev = device
        T = 6
        cu = dev.indices([0, 2, 6])
        rows = dev.indices([0, 1])

        def f(*shape: int, lo: float = -1.0, hi: float = 1.0) -> Buffer:
            return dev.upload(rng.uniform(lo, hi, shape).astype(np.float32))

        if bad.op == "ssm_scan":
            H, P_, N = 4, 8, 8
            pool_host = rng.uniform(-1, 1, (3, H * P_ * N)).astype(np.float32)
            out_shape: tuple[int, ...] = (T, H, P_)
        else:
            Hv, Hk, S_ = 4, 2, 8
            pool_host = rng.uniform(-1, 1, (3, Hv * S_ * S_)).astype(np.float32)
            out_shape = (T, Hv, S_)
        pool = dev.upload(pool_host)
        out = dev.upload(np.full(out_shape, 5.0, np.float32))
        options = bad.kwargs(dev, rng)

        def call() -> None:
            if bad.op == "ssm_scan":
                dev.ssm_scan(pool, rows, rows, f(T, H, P_), f(T, H), f(H, lo=-1, hi=-0.1), f(T, 1, N), f(T, 1, N),
                             out, cu_seqlens=cu, **options)  # fmt: skip
            else:
                dev.gated_delta_net(pool, rows, rows, f(T, Hk, S_), f(T, Hk, S_), f(T, Hv, S_), f(T, Hv, lo=-1, hi=0),
                                    f(T, Hv, lo=0, hi=1), out, cu_seqlens=cu, **options)  # fmt: skip

        expect_refusal(case_id, bad.argument, call)
        assert_exact(f"{case_id}: pool after a refused call", dev.download(pool), pool_host)
        assert_exact(f"{case_id}: output after a refused call", dev.download(out), np.full(out_shape, 5.0, np.float32))

    case = Case(case_id, "primitive", (bad.op,), run, (Requirement(bad.op, {"varlen": True}),), {"varlen": True})
    return case


# -- the grid ---------------------------------------------------------------------------


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for op in [*map(_label, scan_ops()), *map(_label, delta_ops())]:
        cases.append(varlen_case(VarlenParams(op, (4, 0, 1, 3), 3, "sparse", tag="epilogue")))
        cases.append(packed_split_case(VarlenParams(op, (18, 1, 0, 3), 3, "planes", tag="epilogue_split")))
    cases.append(varlen_case(VarlenParams(_label(scan_ops()[-1]), (3, 2), 2, "planes", DType.F16, tag="epilogue")))
    cases += [
        grouped_equiv_case(False, 8, 8, 2),
        grouped_equiv_case(True, 8, 6, 3),
        option_equiv_case("qk_l2norm", False),
        option_equiv_case("raw_gate", False),
        option_equiv_case("raw_gate", True),
        scan_bias_equiv_case(),
    ]
    cases += [bad_option_case(b) for b in _bad_options()]
    return cases
