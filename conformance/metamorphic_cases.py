"""Metamorphic cases: the device against itself, no reference needed.

* ``snapshot_prefix``: each snapshot plane equals the final state of a fresh
  call over the prefix of that length (ggml's SSM_SCAN_ROLLBACK idea), the
  outputs of the prefix call equal the first outputs of the full call
  (causality), and the plane ``n_t`` (when ``n_t < K``) is the input state,
  bitwise.
* ``chunked``: prefill split at every point (two calls, the second starting
  from the first one's row, in place) equals one pass; token-by-token decode
  in place equals one pass.
* ``together``: decoding sequences in one call equals decoding each alone.
* ``roundtrip``: gather then scatter (and copy between planes and back)
  reproduces the rows bitwise, through every storage dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from statecache.backend import Device
from statecache.conformance.cases import (
    NMSE,
    Case,
    ConformanceFailure,
    Requirement,
    assert_close,
    assert_exact,
    rng_for,
)
from statecache.dtypes import DType

F32 = DType.F32
Inputs = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Adapter:
    """How to drive one stateful primitive from host arrays.

    ``inputs(rng, n_s, n_t)`` returns per-token arrays (axis 0 sequences,
    axis 1 tokens) plus token-independent ones under names starting ``w_``.
    ``call(dev, pool, start, dst, bufs, out, n_snap, stride)`` runs it.
    """

    op: str
    label: str
    row_size: int
    out_tail: tuple[int, ...]
    inputs: Callable[[np.random.Generator, int, int], Inputs]
    call: Callable[..., None]
    exact_state: bool  # conv windows are copies of inputs
    params: dict

    def requirement(self, dtype: DType, n_snap: int) -> Requirement:
        return Requirement(self.op, {"dtype": dtype.value, "n_snap": n_snap, **self.params})


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def scan_adapter(variant: str, N: int, P: int, H: int, G: int) -> Adapter:
    def inputs(rng: np.random.Generator, S: int, T: int) -> Inputs:
        return {
            "x": _u(rng, (S, T, H, P)),
            "dt": _u(rng, (S, T, H), -2.0, 1.0),
            "B": _u(rng, (S, T, G, N)),
            "C": _u(rng, (S, T, G, N)),
            "w_A": -rng.uniform(0.05, 1.0, (H, N) if variant == "mamba1" else (H,)).astype(np.float32),
        }

    def call(dev, pool, start, dst, b, out, n_snap, stride):  # type: ignore[no-untyped-def]
        dev.ssm_scan(
            pool, start, dst, b["x"], b["dt"], b["w_A"], b["B"], b["C"], out, n_snap=n_snap, plane_stride=stride
        )

    params = {"variant": variant, "d_state": N, "head_dim": P}
    return Adapter("ssm_scan", f"{variant}-d{N}-h{P}-n{H}-g{G}", H * P * N, (H, P), inputs, call, False, params)


def conv_adapter(d_conv: int, ch: int, bias_silu: bool) -> Adapter:
    def inputs(rng: np.random.Generator, S: int, T: int) -> Inputs:
        return {"x": _u(rng, (S, T, ch)), "w_weight": _u(rng, (ch, d_conv)), "w_bias": _u(rng, (ch,))}

    def call(dev, pool, start, dst, b, out, n_snap, stride):  # type: ignore[no-untyped-def]
        dev.ssm_conv(
            pool,
            start,
            dst,
            b["x"],
            b["w_weight"],
            out,
            bias=b["w_bias"] if bias_silu else None,
            apply_silu=bias_silu,
            n_snap=n_snap,
            plane_stride=stride,
        )

    label = f"dc{d_conv}-ch{ch}" + ("-bias_silu" if bias_silu else "")
    return Adapter("ssm_conv", label, ch * (d_conv - 1), (ch,), inputs, call, True, {"d_conv": d_conv})


def delta_adapter(kda: bool, S_: int, Hv: int, Hk: int) -> Adapter:
    def inputs(rng: np.random.Generator, S: int, T: int) -> Inputs:
        def l2(a: np.ndarray) -> np.ndarray:
            return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)

        return {
            "q": l2(_u(rng, (S, T, Hk, S_))),
            "k": l2(_u(rng, (S, T, Hk, S_))),
            "v": _u(rng, (S, T, Hv, S_)),
            "g": _u(rng, (S, T, Hv, S_) if kda else (S, T, Hv), -1.0, -1e-4),
            "beta": _u(rng, (S, T, Hv), 0.0, 1.0),
        }

    def call(dev, pool, start, dst, b, out, n_snap, stride):  # type: ignore[no-untyped-def]
        dev.gated_delta_net(
            pool, start, dst, b["q"], b["k"], b["v"], b["g"], b["beta"], out, n_snap=n_snap, plane_stride=stride
        )

    gate = "kda" if kda else "scalar"
    params = {"variant": gate, "head_size": S_}
    return Adapter(
        "gated_delta_net", f"{gate}-S{S_}-hv{Hv}-hk{Hk}", Hv * S_ * S_, (Hv, S_), inputs, call, False, params
    )


# -- running an adapter on host arrays ----------------------------------------------


def _slice(inputs: Inputs, seqs: slice | list[int], t0: int, t1: int) -> Inputs:
    return {
        name: (a if name.startswith("w_") else np.ascontiguousarray(a[seqs][:, t0:t1])) for name, a in inputs.items()
    }


def run_adapter(
    dev: Device,
    ad: Adapter,
    pool: np.ndarray,
    dtype: DType,
    start: list[int],
    dst: list[int],
    inputs: Inputs,
    n_snap: int = 1,
    stride: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """One call; returns (pool after, outputs).  ``pool`` is host data."""
    pool_buf = dev.upload(pool, dtype)
    bufs = {name: dev.upload(a) for name, a in inputs.items()}
    n_s, n_t = next(a.shape[:2] for n, a in inputs.items() if not n.startswith("w_"))
    out = dev.alloc((n_s, n_t, *ad.out_tail))
    with np.errstate(all="ignore"):
        ad.call(dev, pool_buf, dev.indices(start), dev.indices(dst), bufs, out, n_snap, stride)
    return dev.download(pool_buf), dev.download(out)


def _state_check(ad: Adapter, dtype: DType, what: str, got: np.ndarray, want: np.ndarray) -> None:
    if ad.exact_state:
        assert_exact(what, got, want)
    else:
        assert_close(what, got, want, NMSE[dtype])


def _initial_pool(rng: np.random.Generator, n_rows: int, row: int, dtype: DType) -> np.ndarray:
    return rng.uniform(-0.5, 0.5, (n_rows, row)).astype(np.float32).astype(dtype.numpy)


def snapshot_prefix(dev: Device, ad: Adapter, dtype: DType, n_s: int, n_t: int, K: int, seed: int) -> None:
    rng = rng_for(seed)
    stride = n_s + 1
    n_rows = 1 + K * stride + n_s
    pool = _initial_pool(rng, n_rows, ad.row_size, dtype)
    src = [1 + K * stride + s for s in range(n_s)]
    dst = [1 + s for s in range(n_s)]
    inputs = ad.inputs(rng, n_s, n_t)
    after, y_full = run_adapter(dev, ad, pool, dtype, src, dst, inputs, K, stride)
    for j in range(min(n_t + 1, K)):
        plane = after[[d + j * stride for d in dst]]
        L = n_t - j
        if L == 0:
            assert_exact(f"plane {j} (= n_t: the input state, undo the whole call)", plane, pool[src])
            continue
        fresh = np.zeros((n_s + 1, ad.row_size), dtype=np.float32)
        fresh[:n_s] = pool[src]
        fresh_after, y_prefix = run_adapter(
            dev, ad, fresh, dtype, list(range(n_s)), list(range(n_s)), _slice(inputs, slice(None), 0, L)
        )
        _state_check(ad, dtype, f"plane {j} vs a prefix call of {L} tokens", plane, fresh_after[:n_s])
        assert_close(f"outputs of a {L}-token prefix call vs the full call", y_prefix, y_full[:, :L], NMSE[F32])
    for j in range(min(n_t + 1, K), K):
        untouched = after[[d + j * stride for d in dst]]
        assert_exact(
            f"plane {j} (beyond n_t + 1 planes: must not be written)", untouched, pool[[d + j * stride for d in dst]]
        )


def chunked(dev: Device, ad: Adapter, dtype: DType, n_s: int, n_t: int, seed: int) -> None:
    rng = rng_for(seed)
    pool = _initial_pool(rng, 2 * n_s, ad.row_size, dtype)
    src = list(range(n_s))
    dst = list(range(n_s, 2 * n_s))
    inputs = ad.inputs(rng, n_s, n_t)
    one, y_one = run_adapter(dev, ad, pool, dtype, src, dst, inputs)
    want = one[dst]
    for p in range(1, n_t):
        mid, y1 = run_adapter(dev, ad, pool, dtype, src, dst, _slice(inputs, slice(None), 0, p))
        end, y2 = run_adapter(dev, ad, mid, dtype, dst, dst, _slice(inputs, slice(None), p, n_t))
        _state_check(ad, dtype, f"state after split at token {p}", end[dst], want)
        # The state in between is rounded to the storage dtype, so later outputs
        # may differ from the one-pass ones by that rounding.
        assert_close(f"outputs with a split at token {p}", np.concatenate([y1, y2], axis=1), y_one, NMSE[dtype])
    # token by token, in place
    cur = pool.copy()
    cur[dst] = pool[src]
    ys = []
    for t in range(n_t):
        cur, y = run_adapter(dev, ad, cur, dtype, dst, dst, _slice(inputs, slice(None), t, t + 1))
        ys.append(y)
    _state_check(ad, dtype, "state after token-by-token decode in place", cur[dst], want)
    assert_close("outputs of token-by-token decode", np.concatenate(ys, axis=1), y_one, NMSE[dtype])


def together(dev: Device, ad: Adapter, dtype: DType, n_s: int, n_t: int, seed: int) -> None:
    rng = rng_for(seed)
    pool = _initial_pool(rng, 2 * n_s, ad.row_size, dtype)
    src = list(range(n_s))
    dst = list(reversed(range(n_s, 2 * n_s)))
    inputs = ad.inputs(rng, n_s, n_t)
    all_after, y_all = run_adapter(dev, ad, pool, dtype, src, dst, inputs)
    for s in range(n_s):
        alone, y_alone = run_adapter(dev, ad, pool, dtype, [src[s]], [dst[s]], _slice(inputs, [s], 0, n_t))
        _state_check(ad, dtype, f"state of sequence {s} decoded alone vs together", alone[dst[s]], all_after[dst[s]])
        assert_close(f"outputs of sequence {s} decoded alone vs together", y_alone[0], y_all[s], NMSE[F32])


def roundtrip(dev: Device, dtype: DType, seed: int) -> None:
    rng = rng_for(seed)
    R, E, N = 24, 96, 7
    host = rng.uniform(-3, 3, (R, E)).astype(np.float32).astype(dtype.numpy)
    pool = dev.upload(host, dtype)
    rows = rng.permutation(R)[:N]
    for mid_dtype in sorted({F32, dtype}, key=lambda d: d.value):
        tmp = dev.alloc((N, E), mid_dtype)
        dev.get_rows(pool, dev.indices(rows), tmp)
        other = dev.upload(rng.uniform(-1e3, 1e3, (R, E)).astype(np.float32), dtype)
        dev.set_rows(other, dev.indices(rows), tmp)
        assert_exact(f"gather({dtype}->{mid_dtype}) then scatter back", dev.download(other)[rows], host[rows])
    # copy to free rows of another plane and back, inside one pool
    free = np.setdiff1d(np.arange(R), rows)[:N]
    dev.copy_rows(pool, dev.indices(rows), pool, dev.indices(free))
    dev.zero_rows(pool, dev.indices(rows))
    if np.any(dev.download(pool)[rows].astype(np.float32) != 0):
        raise ConformanceFailure("zero_rows left non-zero values")
    dev.copy_rows(pool, dev.indices(free), pool, dev.indices(rows))
    assert_exact("copy to other rows, zero, copy back", dev.download(pool)[rows], host[rows])


# -- the case list -------------------------------------------------------------------


def _adapters() -> list[Adapter]:
    return [
        scan_adapter("mamba2", 16, 8, 4, 2),
        conv_adapter(4, 48, True),
        conv_adapter(3, 32, False),
        delta_adapter(False, 16, 4, 2),
        delta_adapter(True, 16, 2, 2),
    ]


def _case(case_id: str, op_reqs: list[Requirement], dtype: DType, n_snap: int, fn: Callable[[Device, int], None]):
    ops = tuple(sorted({r.op for r in op_reqs}))
    seed_holder: dict[str, Case] = {}

    def run(device: Device) -> None:
        fn(device, seed_holder["case"].seed)

    case = Case(
        case_id, "metamorphic", ops, run, tuple(op_reqs), {"storage_dtypes": {dtype.value}, "max_snapshots": n_snap}
    )
    seed_holder["case"] = case
    return case


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for dtype in (F32, DType.F16, DType.BF16):
        for ad in _adapters():
            if dtype is not F32 and ad.label.startswith("dc3"):
                continue
            tag = f"{ad.label}-{dtype.value}"
            for n_t, K in ((5, 4), (2, 4), (6, 3)):
                if dtype is not F32 and n_t != 5:
                    continue
                cases.append(
                    _case(
                        f"{ad.op}.snapshot_prefix[{tag}-t{n_t}-K{K}]",
                        [ad.requirement(dtype, K)],
                        dtype,
                        K,
                        lambda dev, seed, ad=ad, dtype=dtype, n_t=n_t, K=K: snapshot_prefix(
                            dev, ad, dtype, 2, n_t, K, seed
                        ),
                    )
                )
            cases.append(
                _case(
                    f"{ad.op}.chunked[{tag}-t6]",
                    [ad.requirement(dtype, 1)],
                    dtype,
                    1,
                    lambda dev, seed, ad=ad, dtype=dtype: chunked(dev, ad, dtype, 2, 6, seed),
                )
            )
            cases.append(
                _case(
                    f"{ad.op}.together[{tag}-s3]",
                    [ad.requirement(dtype, 1)],
                    dtype,
                    1,
                    lambda dev, seed, ad=ad, dtype=dtype: together(dev, ad, dtype, 3, 4, seed),
                )
            )
    m1 = scan_adapter("mamba1", 16, 1, 64, 1)
    cases.append(
        _case(
            f"ssm_scan.chunked[{m1.label}-f32-t6]",
            [m1.requirement(F32, 1)],
            F32,
            1,
            lambda dev, seed: chunked(dev, m1, F32, 2, 6, seed),
        )
    )
    cases.append(
        _case(
            f"ssm_scan.together[{m1.label}-f32-s3]",
            [m1.requirement(F32, 1)],
            F32,
            1,
            lambda dev, seed: together(dev, m1, F32, 3, 4, seed),
        )
    )
    for dtype in (F32, DType.F16, DType.BF16):
        reqs = [
            Requirement(op, {"dtype": d.value})
            for op in ("get_rows", "set_rows", "copy_rows", "zero_rows")
            for d in {F32, dtype}
        ]
        cases.append(
            _case(
                f"rows.roundtrip[{dtype.value}]",
                reqs,
                dtype,
                1,
                lambda dev, seed, dtype=dtype: roundtrip(dev, dtype, seed),
            )
        )
    return cases
