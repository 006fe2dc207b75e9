"""The ``oracle`` family: every primitive, on every device (the reference
included), against the independent float64 loops of
:mod:`statecache.conformance.oracle`.

The primitive cases prove that a device agrees with the reference backend;
these prove that the reference (and so every device) agrees with the
published formulas.  Shapes are small (the oracle is scalar Python), but
each case is chosen to tell one plausible mistake from the truth:

* ``ssm_scan``: dt below 0, between 2 and 20 and above 20 (softplus's
  threshold), Mamba-1 (decay per state element) and Mamba-2 with groups that
  are neither 1 nor one per head (which heads share B and C), snapshot planes
  with n_t below, at and above K, start rows in place and from a plane.
* ``ssm_conv``: with and without bias + SiLU, windows of 1 to 8 columns,
  snapshot windows.
* ``gated_delta_net``: scalar gate and KDA, H_v > H_k (value heads tile the
  q/k heads), decays near 0 and 1, beta 0 and 1, snapshot planes.
* rows: conversions between every storage dtype, edge values included,
  repeated gathers, duplicate zeroing, copies inside one pool.

Storage dtypes f16/bf16 are exercised for each stateful primitive as well.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np

from statecache.backend import Buffer, Device
from statecache.conformance import oracle
from statecache.conformance.cases import NMSE, Case, Placed, Requirement, Tensor, check_tensor, rng_for, run_on
from statecache.conformance.primitive_cases import (
    EDGE_VALUES,
    PoolLayout,
    conv_call,
    decay_rates,
    delta_call,
    dt_values,
    log_decays,
    plane_kwargs,
    scan_call,
    state_case,
    write_strengths,
)
from statecache.dtypes import DType

F32, F16, BF16 = DType.F32, DType.F16, DType.BF16

#: The oracle's result for each output tensor (logical shape, storage dtype),
#: computed from the inputs exactly as they were placed on the device.
Expect = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _as_placed(placed: Mapping[str, Placed], tensors: Mapping[str, Tensor], name: str) -> np.ndarray:
    """The logical contents of one argument as the device received them."""
    t = tensors[name]
    p = placed[name]
    if t.view is None:
        n = math.prod(p.shape)
        return p.initial[p.offset : p.offset + n].reshape(p.shape)
    base_name, shape, strides, offset = t.view
    base = placed[base_name]
    flat = base.initial[base.offset + offset :]
    item = flat.dtype.itemsize
    return np.lib.stride_tricks.as_strided(flat, shape, tuple(s * item for s in strides), writeable=False).copy()


def compare_with_oracle(
    device: Device,
    tensors: Mapping[str, Tensor],
    seed: int,
    call: Callable[..., None],
    expect: Expect,
    tolerance: Mapping[str, float] | None = None,
) -> None:
    """Run ``call`` on the device, then check every tensor as the primitive
    cases do (guards, inputs and unaddressed rows bitwise unchanged), with the
    written rows compared to the oracle instead of the reference."""
    got = run_on(device, tensors, seed, call)
    placed = {name: p for name, (p, _) in got.items()}
    inputs = {name: _as_placed(placed, tensors, name) for name in tensors}
    want = expect(inputs)
    for name, t in tensors.items():
        p, got_full = got[name]
        want_full = None
        if t.output:
            want_full = p.initial.copy()
            n = math.prod(p.shape)
            want_full[p.offset : p.offset + n] = np.asarray(want[name], dtype=want_full.dtype).reshape(-1)
        check_tensor(name, t, p, got_full, want_full, (tolerance or {}).get(name))


def _suffix(**flags: object) -> str:
    return "".join(f"-{v}" for v in flags.values() if v)


# -- ssm_scan ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScanOracle:
    variant: str
    d_state: int
    head_dim: int
    n_head: int
    n_group: int
    n_t: int
    n_s: int
    n_snap: int = 1
    dtype: DType = F32
    starts: str = "perm"
    layout: str = "contig"  # contig | packed (x, B, C, dt as views of one row per token)

    @property
    def id(self) -> str:
        tail = _suffix(
            starts=self.starts if self.starts != "perm" else "", layout=self.layout if self.layout != "contig" else ""
        )
        return (
            f"oracle.ssm_scan[{self.variant}-d{self.d_state}-h{self.head_dim}-n{self.n_head}-g{self.n_group}"
            f"-t{self.n_t}-s{self.n_s}-K{self.n_snap}-{self.dtype.value}{tail}]"
        )


def scan_oracle_case(p: ScanOracle) -> Case:
    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        lay = PoolLayout(p.n_s, p.n_t, p.n_snap, p.starts, case.seed)
        H, P, N, G, T, S = p.n_head, p.head_dim, p.d_state, p.n_group, p.n_t, p.n_s
        x = _u(rng, (S, T, H, P))
        dt = dt_values(rng, (S, T, H))
        B = _u(rng, (S, T, G, N))
        C = _u(rng, (S, T, G, N))
        A = decay_rates(rng, (H, N) if p.variant == "mamba1" else (H,))
        tensors: dict[str, Tensor] = {
            "pool": Tensor(
                lay.pool(rng, H * P * N, lambda shp: _u(rng, shp)), p.dtype, output=True, written=lay.written()
            ),
            "A": Tensor(A),
            "y": Tensor(np.full((S, T, H, P), 777.0, dtype=np.float32), output=True),
        }
        if p.layout == "contig":
            tensors.update(x=Tensor(x), dt=Tensor(dt), B=Tensor(B), C=Tensor(C))
        else:
            L = H * P + 2 * G * N + H
            packed = np.concatenate(
                [x.reshape(S, T, -1), B.reshape(S, T, -1), C.reshape(S, T, -1), dt.reshape(S, T, -1)], axis=2
            )
            tensors["packed"] = Tensor(packed)
            tok = (T * L, L)
            tensors["x"] = Tensor(None, view=("packed", (S, T, H, P), (*tok, P, 1), 0))
            tensors["B"] = Tensor(None, view=("packed", (S, T, G, N), (*tok, N, 1), H * P))
            tensors["C"] = Tensor(None, view=("packed", (S, T, G, N), (*tok, N, 1), H * P + G * N))
            tensors["dt"] = Tensor(None, view=("packed", (S, T, H), (*tok, 1), H * P + 2 * G * N))

        def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            pool, y = oracle.ssm_scan(
                a["pool"],
                p.dtype,
                lay.start_rows().tolist(),
                lay.dst_rows().tolist(),
                a["x"],
                a["dt"],
                a["A"],
                a["B"],
                a["C"],
                **plane_kwargs(lay),
            )
            return {"pool": pool, "y": y}

        tol = {"pool": NMSE[p.dtype], "y": NMSE[F32]}
        compare_with_oracle(device, tensors, case.seed, scan_call(lay), expect, tol)

    shape = {"variant": p.variant, "d_state": p.d_state, "head_dim": p.head_dim}
    case = state_case(p.id, "oracle", "ssm_scan", run, p.dtype, p.n_snap, p.layout != "contig", **shape)
    return case


def scan_oracles() -> list[ScanOracle]:
    return [
        ScanOracle("mamba1", 4, 1, 6, 1, 5, 2),
        ScanOracle("mamba1", 16, 1, 5, 1, 3, 2, starts="inplace"),  # d_state 16, an odd number of heads: vector paths
        ScanOracle("mamba1", 8, 1, 3, 1, 1, 3, starts="repeat"),
        ScanOracle("mamba2", 4, 3, 4, 2, 5, 2),  # 2 groups of 2 heads
        ScanOracle("mamba2", 8, 8, 4, 4, 3, 2),  # a group per head
        ScanOracle("mamba2", 8, 8, 6, 3, 4, 2, n_snap=3),  # n_t above K
        ScanOracle("mamba2", 4, 2, 2, 1, 2, 2, n_snap=4),  # n_t below K: the input state lands in plane n_t
        ScanOracle("mamba2", 4, 2, 2, 1, 3, 2, n_snap=4),  # n_t + 1 == K
        ScanOracle("mamba2", 4, 2, 4, 2, 1, 3, n_snap=3, starts="plane"),  # decode after a rollback
        ScanOracle("mamba2", 8, 8, 2, 1, 20, 1, n_snap=2),  # long enough for chunked prefill paths
        ScanOracle("mamba2", 4, 4, 4, 2, 4, 2, layout="packed"),
        ScanOracle("mamba2", 8, 4, 4, 2, 4, 2, n_snap=2, dtype=F16),
        ScanOracle("mamba2", 8, 4, 4, 2, 4, 2, n_snap=2, dtype=BF16, starts="inplace"),
        ScanOracle("mamba1", 8, 1, 4, 1, 3, 2, dtype=F16),
        ScanOracle("mamba1", 8, 1, 4, 1, 3, 2, dtype=BF16),
    ]


# -- ssm_conv ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvOracle:
    d_conv: int
    channels: int
    n_t: int
    n_s: int
    n_snap: int = 1
    dtype: DType = F32
    bias_silu: bool = False
    starts: str = "perm"

    @property
    def id(self) -> str:
        tail = _suffix(bias="bias_silu" if self.bias_silu else "", starts=self.starts if self.starts != "perm" else "")
        return (
            f"oracle.ssm_conv[dc{self.d_conv}-ch{self.channels}-t{self.n_t}-s{self.n_s}-K{self.n_snap}"
            f"-{self.dtype.value}{tail}]"
        )


def conv_oracle_case(p: ConvOracle) -> Case:
    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        lay = PoolLayout(p.n_s, p.n_t, p.n_snap, p.starts, case.seed)
        W, ch, T, S = p.d_conv - 1, p.channels, p.n_t, p.n_s
        # Large pre-activations too (|y| up to ~12): SiLU's far tails, not just its middle.
        x = _u(rng, (S, T, ch), -3.0, 3.0)
        tensors: dict[str, Tensor] = {
            "pool": Tensor(
                lay.pool(rng, ch * W, lambda shp: _u(rng, shp, -3.0, 3.0)),
                p.dtype,
                output=True,
                written=lay.written(),
                exact=True,  # windows are copies of inputs
            ),
            "x": Tensor(x),
            "weight": Tensor(_u(rng, (ch, p.d_conv))),
            "bias": Tensor(_u(rng, (ch,), -2.0, 2.0)),
            "y": Tensor(np.full((S, T, ch), 555.0, dtype=np.float32), output=True),
        }

        def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            pool, y = oracle.ssm_conv(
                a["pool"],
                p.dtype,
                lay.start_rows().tolist(),
                lay.dst_rows().tolist(),
                a["x"],
                a["weight"],
                a["bias"] if p.bias_silu else None,
                p.bias_silu,
                **plane_kwargs(lay),
            )
            return {"pool": pool, "y": y}

        compare_with_oracle(device, tensors, case.seed, conv_call(lay, p.bias_silu), expect, {"y": NMSE[F32]})

    case = state_case(p.id, "oracle", "ssm_conv", run, p.dtype, p.n_snap, False, d_conv=p.d_conv)
    return case


def conv_oracles() -> list[ConvOracle]:
    return [
        ConvOracle(4, 8, 5, 2),
        ConvOracle(4, 8, 5, 2, bias_silu=True),
        ConvOracle(2, 9, 3, 2, bias_silu=True),  # a one-column window
        ConvOracle(9, 8, 4, 2),  # the window longer than the call
        ConvOracle(4, 16, 1, 3, bias_silu=True, starts="inplace"),  # decode
        ConvOracle(3, 8, 2, 2, n_snap=4),  # n_t below K
        ConvOracle(4, 8, 6, 2, n_snap=3, starts="repeat"),
        ConvOracle(4, 8, 1, 2, n_snap=3, starts="plane"),
        ConvOracle(4, 8, 4, 2, n_snap=3, dtype=F16, bias_silu=True),
        ConvOracle(4, 8, 4, 2, n_snap=3, dtype=BF16),
    ]


# -- gated_delta_net ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeltaOracle:
    head_size: int
    n_head_v: int
    n_head_k: int
    n_t: int
    n_s: int
    kda: bool = False
    n_snap: int = 1
    dtype: DType = F32
    starts: str = "perm"

    @property
    def id(self) -> str:
        gate = "kda" if self.kda else "scalar"
        tail = _suffix(starts=self.starts if self.starts != "perm" else "")
        return (
            f"oracle.gated_delta_net[{gate}-S{self.head_size}-hv{self.n_head_v}-hk{self.n_head_k}-t{self.n_t}"
            f"-s{self.n_s}-K{self.n_snap}-{self.dtype.value}{tail}]"
        )


def delta_oracle_case(p: DeltaOracle) -> Case:
    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        lay = PoolLayout(p.n_s, p.n_t, p.n_snap, p.starts, case.seed)
        Sz, Hv, Hk, T, S = p.head_size, p.n_head_v, p.n_head_k, p.n_t, p.n_s
        q = _u(rng, (S, T, Hk, Sz))
        k = _u(rng, (S, T, Hk, Sz))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule is stable for unit keys
        tensors: dict[str, Tensor] = {
            "pool": Tensor(
                lay.pool(rng, Hv * Sz * Sz, lambda shp: _u(rng, shp, -0.5, 0.5)),
                p.dtype,
                output=True,
                written=lay.written(),
            ),
            "q": Tensor(q),
            "k": Tensor(k.astype(np.float32)),
            "v": Tensor(_u(rng, (S, T, Hv, Sz))),
            "g": Tensor(log_decays(rng, (S, T, Hv, Sz) if p.kda else (S, T, Hv))),
            "beta": Tensor(write_strengths(rng, (S, T, Hv))),
            "o": Tensor(np.full((S, T, Hv, Sz), 333.0, dtype=np.float32), output=True),
        }

        def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            pool, o = oracle.gated_delta_net(
                a["pool"],
                p.dtype,
                lay.start_rows().tolist(),
                lay.dst_rows().tolist(),
                a["q"],
                a["k"],
                a["v"],
                a["g"],
                a["beta"],
                **plane_kwargs(lay),
            )
            return {"pool": pool, "o": o}

        tol = {"pool": NMSE[p.dtype], "o": NMSE[F32]}
        compare_with_oracle(device, tensors, case.seed, delta_call(lay), expect, tol)

    shape = {"variant": "kda" if p.kda else "scalar", "head_size": p.head_size}
    case = state_case(p.id, "oracle", "gated_delta_net", run, p.dtype, p.n_snap, False, **shape)
    return case


def delta_oracles() -> list[DeltaOracle]:
    return [
        DeltaOracle(4, 2, 2, 5, 2),
        DeltaOracle(4, 4, 2, 4, 2),  # value heads tile the q/k heads
        DeltaOracle(4, 6, 3, 3, 2, kda=True),
        DeltaOracle(8, 4, 2, 3, 2, kda=True),  # head size a multiple of 8: vector paths
        DeltaOracle(8, 4, 4, 1, 3, starts="inplace"),  # decode
        DeltaOracle(4, 4, 2, 2, 2, n_snap=4),  # n_t below K
        DeltaOracle(4, 4, 2, 5, 2, kda=True, n_snap=3, starts="repeat"),
        DeltaOracle(4, 4, 2, 1, 2, n_snap=3, starts="plane"),
        DeltaOracle(8, 4, 2, 3, 2, dtype=F16),
        DeltaOracle(8, 4, 2, 3, 2, kda=True, dtype=BF16, starts="inplace"),
    ]


# -- row primitives ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowsOracle:
    op: str
    src_dtype: DType
    dst_dtype: DType
    n: int
    index: str = "perm"  # perm | repeat | same
    n_rows: int = 12
    row_size: int = 21

    @property
    def id(self) -> str:
        dt = self.dst_dtype.value if self.op == "zero_rows" else f"{self.src_dtype.value}>{self.dst_dtype.value}"
        tail = _suffix(index=self.index if self.index != "perm" else "")
        return f"oracle.{self.op}[r{self.n_rows}-e{self.row_size}-n{self.n}-{dt}{tail}]"


def _row_values(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Every edge value of the kit (ties, subnormals, the f16 overflow
    boundary, NaNs with payloads) and ordinary values."""
    data = _u(rng, shape, -4.0, 4.0).reshape(-1)
    n = min(EDGE_VALUES.size, data.size)
    data[rng.permutation(data.size)[:n]] = EDGE_VALUES[:n]
    return data.reshape(shape)


def rows_oracle_case(p: RowsOracle) -> Case:
    def run(device: Device) -> None:
        rng = rng_for(case.seed)
        R, E, N = p.n_rows, p.row_size, p.n
        tensors: dict[str, Tensor] = {}
        expect: Expect
        if p.op == "get_rows":
            rows = rng.integers(0, R, N) if p.index == "repeat" else rng.permutation(R)[:N]
            tensors["src"] = Tensor(_row_values(rng, (R, E)), p.src_dtype)
            tensors["dst"] = Tensor(_u(rng, (N, E), -1e3, 1e3), p.dst_dtype, output=True, exact=True)

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                dev.get_rows(b["src"], dev.indices(rows), b["dst"])

            def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                return {"dst": oracle.get_rows(a["src"], p.src_dtype, rows.tolist(), p.dst_dtype)}

        elif p.op == "set_rows":
            rows = rng.permutation(R)[:N]
            tensors["src"] = Tensor(_row_values(rng, (N, E)), p.src_dtype)
            tensors["dst"] = Tensor(_u(rng, (R, E), -1e3, 1e3), p.dst_dtype, output=True, written=rows, exact=True)

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                dev.set_rows(b["dst"], dev.indices(rows), b["src"])

            def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                return {"dst": oracle.set_rows(a["dst"], p.dst_dtype, rows.tolist(), a["src"], p.src_dtype)}

        elif p.op == "zero_rows":
            rows = rng.integers(0, R, N)  # duplicates allowed
            tensors["dst"] = Tensor(_row_values(rng, (R, E)), p.dst_dtype, output=True, written=rows, exact=True)

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                dev.zero_rows(b["dst"], dev.indices(rows))

            def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                return {"dst": oracle.zero_rows(a["dst"], p.dst_dtype, rows.tolist())}

        else:
            perm = rng.permutation(R)
            src_rows, dst_rows = perm[:N], perm[N : 2 * N] if p.index == "same" else rng.permutation(R)[:N]
            if p.index == "same":  # plane to plane inside one pool
                tensors["dst"] = Tensor(
                    _row_values(rng, (R, E)), p.dst_dtype, output=True, written=dst_rows, exact=True
                )
            else:
                tensors["src"] = Tensor(_row_values(rng, (R, E)), p.src_dtype)
                tensors["dst"] = Tensor(
                    _u(rng, (R, E), -1e3, 1e3), p.dst_dtype, output=True, written=dst_rows, exact=True
                )

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                src = b["dst"] if p.index == "same" else b["src"]
                dev.copy_rows(src, dev.indices(src_rows), b["dst"], dev.indices(dst_rows))

            def expect(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                src, src_dt = (a["dst"], p.dst_dtype) if p.index == "same" else (a["src"], p.src_dtype)
                out = oracle.copy_rows(src, src_dt, src_rows.tolist(), a["dst"], p.dst_dtype, dst_rows.tolist())
                return {"dst": out}

        compare_with_oracle(device, tensors, case.seed, call, expect)

    dtypes = {p.dst_dtype.value} if p.op == "zero_rows" else {p.src_dtype.value, p.dst_dtype.value}
    reqs = tuple(Requirement(p.op, {"dtype": d}) for d in sorted(dtypes))
    case = Case(p.id, "oracle", (p.op,), run, reqs, {"storage_dtypes": dtypes})
    return case


def rows_oracles() -> list[RowsOracle]:
    pairs = [(F32, F32), (F32, F16), (F32, BF16), (F16, F32), (BF16, F32), (F16, BF16), (BF16, F16), (F16, F16)]
    g = [RowsOracle(op, s, d, 5) for op in ("get_rows", "set_rows", "copy_rows") for s, d in pairs]
    g += [
        RowsOracle("get_rows", F32, F32, 9, index="repeat"),
        RowsOracle("copy_rows", F32, F32, 4, index="same"),
        RowsOracle("copy_rows", BF16, BF16, 4, index="same"),
        # zero-length index arrays: a call that moves nothing writes nothing
        RowsOracle("get_rows", F32, F32, 0),
        RowsOracle("set_rows", F32, F16, 0),
        RowsOracle("copy_rows", F32, F32, 0),
        RowsOracle("zero_rows", F32, F32, 0),
    ]
    g.append(RowsOracle("zero_rows", F32, F32, 6))  # duplicates allowed (f16/bf16 zeros: the primitive cases)
    return g


def all_cases() -> list[Case]:
    cases = [rows_oracle_case(p) for p in rows_oracles()]
    cases += [conv_oracle_case(p) for p in conv_oracles()]
    cases += [scan_oracle_case(p) for p in scan_oracles()]
    cases += [delta_oracle_case(p) for p in delta_oracles()]
    return cases
