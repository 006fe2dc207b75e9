"""Primitive cases as data: one spec per primitive (parameter grid, input
generator, tolerance per dtype), each compared with the reference backend.

Grids follow ggml's test-backend-ops (llama-memory-spec.md §9) and the CPU
backend issue: d_conv 3/4/9; Mamba-1 (16, 1, 1024, 1, 32, 4); Mamba-2
(128, 64, 16, 2, 32, 4) and (256, 64, 8, 2, 32, 4); overlapping x/B/C views
(128, 128, 4, 4, 16, 2); K = 3 and 4 with n_t below and above K; GDN with and
without the KDA gate and value-head repeat; f16/bf16 storage.  On top of the
math, every case checks guard bands around every tensor, that inputs and
unaddressed pool rows stay bitwise unchanged, and that destination rows hold
garbage beforehand (a kernel that reads its destination instead of its start
row is caught).

Start-row modes (``starts``): ``perm`` shuffled rows of a separate region,
``repeat`` several sequences starting from one row, ``inplace`` each sequence
from its own destination row (decode), ``plane`` each sequence from its own
plane-1 row (decode right after a rollback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from statecache.backend import Buffer, Device
from statecache.conformance.cases import NMSE, Case, Requirement, Tensor, compare_with_reference, rng_for
from statecache.dtypes import DType

F32 = DType.F32


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


# -- pool geometry shared by the stateful primitives ---------------------------


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """Rows of a state pool for one call.

    Two unaddressed rows first, then ``n_snap`` planes of ``n_seqs + 2`` rows
    (the two spare rows of each plane are never addressed), then a source
    region the ``perm``/``repeat`` modes start from, then two more unaddressed
    rows.
    """

    n_seqs: int
    n_tokens: int
    n_snap: int
    starts: str
    seed: int

    @property
    def plane_stride(self) -> int:
        return self.n_seqs + 2

    @property
    def source(self) -> int:
        return 2 + self.n_snap * self.plane_stride

    @property
    def n_rows(self) -> int:
        return self.source + self.n_seqs + 2

    def dst_rows(self) -> np.ndarray:
        perm = np.random.default_rng(self.seed).permutation(self.n_seqs)
        return 2 + perm

    def start_rows(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed + 1)
        dst = self.dst_rows()
        if self.starts == "perm":
            return self.source + rng.permutation(self.n_seqs)
        if self.starts == "repeat":
            return self.source + np.arange(self.n_seqs) // 2
        if self.starts == "inplace":
            return dst.copy()
        if self.starts == "plane":
            return dst + self.plane_stride
        raise ValueError(f"unknown starts mode {self.starts!r}")

    def written(self) -> np.ndarray:
        n_written = min(self.n_tokens + 1, self.n_snap)
        stride = self.plane_stride if self.n_snap > 1 else 0
        return (self.dst_rows()[:, None] + stride * np.arange(n_written)[None, :]).ravel()

    def pool(self, rng: np.random.Generator, row_size: int, start_values: Callable[[tuple[int, ...]], np.ndarray]):
        """Garbage everywhere (large, so reading a wrong row cannot hide),
        plausible states in the rows sequences start from."""
        data = rng.uniform(-1e3, 1e3, (self.n_rows, row_size)).astype(np.float32)
        starts = np.unique(self.start_rows())
        data[starts] = start_values((starts.size, row_size))
        return data


def _state_call_kwargs(layout: PoolLayout) -> dict[str, int]:
    return {"n_snap": layout.n_snap, "plane_stride": layout.plane_stride if layout.n_snap > 1 else 0}


def _suffix(*flags: tuple[str, object, object]) -> str:
    """Append ``-value`` for each parameter that differs from its default."""
    return "".join(f"-{value}" for _, value, default in flags if value != default)


# -- ssm_scan -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScanParams:
    variant: str
    d_state: int
    head_dim: int
    n_head: int
    n_group: int
    n_t: int
    n_s: int
    n_snap: int = 1
    dtype: DType = F32
    layout: str = "contig"  # contig | packed | overlap
    starts: str = "perm"
    special: str = "none"  # none | nanf

    @property
    def id(self) -> str:
        base = (
            f"ssm_scan[{self.variant}-d{self.d_state}-h{self.head_dim}-n{self.n_head}-g{self.n_group}"
            f"-t{self.n_t}-s{self.n_s}-K{self.n_snap}-{self.dtype.value}"
        )
        tail = _suffix(("layout", self.layout, "contig"), ("starts", self.starts, "perm"), ("sp", self.special, "none"))
        return base + tail + "]"


def scan_tensors(p: ScanParams, seed: int) -> tuple[dict[str, Tensor], PoolLayout]:
    rng = rng_for(seed)
    lay = PoolLayout(p.n_s, p.n_t, p.n_snap, p.starts, seed)
    H, P, N, G, T, S = p.n_head, p.head_dim, p.d_state, p.n_group, p.n_t, p.n_s
    row = H * P * N
    tensors: dict[str, Tensor] = {
        "pool": Tensor(lay.pool(rng, row, lambda shp: _u(rng, shp)), p.dtype, output=True, written=lay.written()),
    }
    x = _u(rng, (S, T, H, P))
    dt = _u(rng, (S, T, H), -2.0, 1.0)
    B = _u(rng, (S, T, G, N))
    C = _u(rng, (S, T, G, N))
    if p.special == "nanf":
        # One NaN in x and one +Inf in B of sequence 0; other sequences stay finite.
        x[0, T // 2, 0, 0] = np.nan
        B[0, T - 1, G - 1, 0] = np.inf
    A = -rng.uniform(0.05, 1.0, (H, N) if p.variant == "mamba1" else (H,)).astype(np.float32)
    tensors["A"] = Tensor(A)
    if p.layout == "contig":
        tensors.update(x=Tensor(x), dt=Tensor(dt), B=Tensor(B), C=Tensor(C))
    else:
        # Mamba-2's in_proj output keeps x, B, C and dt side by side in one row
        # per token; "overlap" additionally lets C start halfway into B (read-only).
        GN = G * N
        L = H * P + 2 * GN + H
        packed = np.zeros((S, T, L), dtype=np.float32)
        b_off = H * P
        c_off = H * P + (GN // 2 if p.layout == "overlap" else GN)
        dt_off = H * P + 2 * GN
        packed[:, :, :b_off] = x.reshape(S, T, H * P)
        packed[:, :, b_off : b_off + GN] = B.reshape(S, T, GN)
        if p.layout == "packed":
            packed[:, :, c_off : c_off + GN] = C.reshape(S, T, GN)
        packed[:, :, dt_off:] = dt
        tensors["packed"] = Tensor(packed)
        tok = (T * L, L)
        tensors["x"] = Tensor(None, view=("packed", (S, T, H, P), (*tok, P, 1), 0))
        tensors["B"] = Tensor(None, view=("packed", (S, T, G, N), (*tok, N, 1), b_off))
        tensors["C"] = Tensor(None, view=("packed", (S, T, G, N), (*tok, N, 1), c_off))
        tensors["dt"] = Tensor(None, view=("packed", (S, T, H), (*tok, 1), dt_off))
    tensors["y"] = Tensor(np.zeros((S, T, H, P), dtype=np.float32) + 777.0, output=True)
    return tensors, lay


def scan_case(p: ScanParams) -> Case:
    def run(device: Device) -> None:
        seed = case.seed
        tensors, lay = scan_tensors(p, seed)

        def call(dev: Device, b: dict[str, Buffer]) -> None:
            dev.ssm_scan(
                b["pool"],
                dev.indices(lay.start_rows()),
                dev.indices(lay.dst_rows()),
                b["x"],
                b["dt"],
                b["A"],
                b["B"],
                b["C"],
                b["y"],
                **_state_call_kwargs(lay),
            )

        compare_with_reference(device, tensors, seed, call, {"pool": NMSE[p.dtype], "y": NMSE[F32]})

    strided = p.layout != "contig"
    req = Requirement(
        "ssm_scan",
        {
            "dtype": p.dtype.value,
            "n_snap": p.n_snap,
            "strided": strided,
            "variant": p.variant,
            "d_state": p.d_state,
            "head_dim": p.head_dim,
        },
    )
    caps = {"storage_dtypes": {p.dtype.value}, "max_snapshots": p.n_snap}
    if strided:
        caps["strided_inputs"] = True
    case = Case(p.id, "primitive", ("ssm_scan",), run, (req,), caps)
    return case


def scan_grid() -> list[ScanParams]:
    g = [
        # ggml's shapes
        ScanParams("mamba1", 16, 1, 1024, 1, 32, 4),
        ScanParams("mamba2", 128, 64, 16, 2, 32, 4),
        ScanParams("mamba2", 256, 64, 8, 2, 32, 4),
        ScanParams("mamba2", 128, 128, 4, 4, 16, 2, layout="overlap"),
        # decode
        ScanParams("mamba1", 16, 1, 1024, 1, 1, 4, starts="inplace"),
        ScanParams("mamba2", 128, 64, 16, 2, 1, 4, starts="inplace"),
        # snapshot planes: K = 3 and 4, n_t below, equal to and above K
        ScanParams("mamba2", 128, 64, 16, 2, 32, 4, n_snap=4),
        ScanParams("mamba2", 64, 32, 8, 2, 2, 3, n_snap=3),
        ScanParams("mamba2", 64, 32, 8, 2, 3, 3, n_snap=4),
        ScanParams("mamba2", 64, 32, 8, 2, 4, 3, n_snap=4),
        ScanParams("mamba2", 64, 32, 8, 2, 9, 3, n_snap=3),
        ScanParams("mamba2", 64, 32, 8, 2, 1, 3, n_snap=4, starts="plane"),
        # start rows: repeated, in place, from a plane; packed inputs
        ScanParams("mamba2", 64, 32, 8, 2, 8, 4, n_snap=3, starts="repeat"),
        ScanParams("mamba2", 64, 32, 8, 2, 8, 4, n_snap=3, starts="inplace"),
        ScanParams("mamba2", 64, 32, 8, 1, 8, 3, n_snap=2, layout="packed"),
        ScanParams("mamba1", 16, 1, 256, 1, 8, 3, starts="repeat"),
        # NaN / Inf parity
        ScanParams("mamba2", 32, 16, 4, 2, 6, 2, n_snap=2, special="nanf"),
        ScanParams("mamba1", 16, 1, 64, 1, 6, 2, special="nanf"),
    ]
    for dt in (DType.F16, DType.BF16):
        g.append(ScanParams("mamba2", 64, 32, 8, 2, 8, 3, n_snap=3, dtype=dt))
        g.append(ScanParams("mamba1", 16, 1, 256, 1, 8, 3, dtype=dt, starts="inplace"))
    return g


# -- ssm_conv -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvParams:
    d_conv: int
    channels: int
    n_t: int
    n_s: int
    n_snap: int = 1
    dtype: DType = F32
    bias_silu: bool = False
    layout: str = "contig"  # contig | packed
    starts: str = "perm"
    special: str = "none"

    @property
    def id(self) -> str:
        base = f"ssm_conv[dc{self.d_conv}-ch{self.channels}-t{self.n_t}-s{self.n_s}-K{self.n_snap}-{self.dtype.value}"
        tail = _suffix(
            ("bias", "bias_silu" if self.bias_silu else "", ""),
            ("layout", self.layout, "contig"),
            ("starts", self.starts, "perm"),
            ("sp", self.special, "none"),
        )
        return base + tail + "]"


def conv_tensors(p: ConvParams, seed: int) -> tuple[dict[str, Tensor], PoolLayout]:
    rng = rng_for(seed)
    lay = PoolLayout(p.n_s, p.n_t, p.n_snap, p.starts, seed)
    W = p.d_conv - 1
    ch, T, S = p.channels, p.n_t, p.n_s
    # Windows are copies of inputs: the pool must match the reference bitwise.
    tensors: dict[str, Tensor] = {
        "pool": Tensor(
            lay.pool(rng, ch * W, lambda shp: _u(rng, shp)), p.dtype, output=True, written=lay.written(), exact=True
        ),
        "weight": Tensor(_u(rng, (ch, p.d_conv))),
        "bias": Tensor(_u(rng, (ch,))),
        "y": Tensor(np.full((S, T, ch), 555.0, dtype=np.float32), output=True),
    }
    x = _u(rng, (S, T, ch))
    if p.special == "nanf":
        x[0, 0, 1] = np.nan
        x[0, T - 1, 2] = np.inf
        x[0, T - 1, 3] = -np.inf
    if p.layout == "contig":
        tensors["x"] = Tensor(x)
    else:
        # x is the middle of a wider per-token row (the xBC slice of in_proj).
        L = ch + 24
        packed = _u(rng, (S, T, L))
        packed[:, :, 8 : 8 + ch] = x
        tensors["packed"] = Tensor(packed)
        tensors["x"] = Tensor(None, view=("packed", (S, T, ch), (T * L, L, 1), 8))
    return tensors, lay


def conv_case(p: ConvParams) -> Case:
    def run(device: Device) -> None:
        seed = case.seed
        tensors, lay = conv_tensors(p, seed)

        def call(dev: Device, b: dict[str, Buffer]) -> None:
            dev.ssm_conv(
                b["pool"],
                dev.indices(lay.start_rows()),
                dev.indices(lay.dst_rows()),
                b["x"],
                b["weight"],
                b["y"],
                bias=b["bias"] if p.bias_silu else None,
                apply_silu=p.bias_silu,
                **_state_call_kwargs(lay),
            )

        compare_with_reference(device, tensors, seed, call, {"y": NMSE[F32]})

    strided = p.layout != "contig"
    req = Requirement("ssm_conv", {"dtype": p.dtype.value, "n_snap": p.n_snap, "strided": strided, "d_conv": p.d_conv})
    caps = {"storage_dtypes": {p.dtype.value}, "max_snapshots": p.n_snap}
    if strided:
        caps["strided_inputs"] = True
    case = Case(p.id, "primitive", ("ssm_conv",), run, (req,), caps)
    return case


def conv_grid() -> list[ConvParams]:
    g: list[ConvParams] = []
    for dc in (3, 4, 9):
        g.append(ConvParams(dc, 1024, 1, 4, starts="inplace"))
        g.append(ConvParams(dc, 1024, 2 * dc, 4))
        g.append(ConvParams(dc, 1024, 64, 1, bias_silu=True))
        g.append(ConvParams(dc, 256, 2, 3, n_snap=3))  # n_t below K
        g.append(ConvParams(dc, 256, 7, 3, n_snap=4))  # n_t above K
    g += [
        ConvParams(4, 256, 3, 3, n_snap=4),  # n_t + 1 == K: the input window lands in the last plane
        ConvParams(4, 256, 1, 3, n_snap=4, starts="plane"),
        ConvParams(4, 256, 5, 4, n_snap=3, starts="repeat"),
        ConvParams(4, 256, 5, 3, n_snap=3, bias_silu=True, layout="packed"),
        ConvParams(4, 64, 4, 2, special="nanf"),
    ]
    for dt in (DType.F16, DType.BF16):
        g.append(ConvParams(4, 256, 5, 3, n_snap=3, dtype=dt, bias_silu=True))
        g.append(ConvParams(4, 256, 1, 3, dtype=dt, starts="inplace"))
    return g


# -- gated_delta_net -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeltaParams:
    head_size: int
    n_head_v: int
    n_head_k: int
    n_t: int
    n_s: int
    kda: bool = False
    n_snap: int = 1
    dtype: DType = F32
    layout: str = "contig"  # contig | packed
    starts: str = "perm"
    special: str = "none"

    @property
    def id(self) -> str:
        gate = "kda" if self.kda else "scalar"
        base = (
            f"gated_delta_net[{gate}-S{self.head_size}-hv{self.n_head_v}-hk{self.n_head_k}"
            f"-t{self.n_t}-s{self.n_s}-K{self.n_snap}-{self.dtype.value}"
        )
        tail = _suffix(("layout", self.layout, "contig"), ("starts", self.starts, "perm"), ("sp", self.special, "none"))
        return base + tail + "]"


def _l2(a: np.ndarray) -> np.ndarray:
    return (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)


def delta_tensors(p: DeltaParams, seed: int) -> tuple[dict[str, Tensor], PoolLayout]:
    rng = rng_for(seed)
    lay = PoolLayout(p.n_s, p.n_t, p.n_snap, p.starts, seed)
    S_, Hv, Hk, T, S = p.head_size, p.n_head_v, p.n_head_k, p.n_t, p.n_s
    tensors: dict[str, Tensor] = {
        "pool": Tensor(
            lay.pool(rng, Hv * S_ * S_, lambda shp: _u(rng, shp, -0.5, 0.5)),
            p.dtype,
            output=True,
            written=lay.written(),
        ),
        "o": Tensor(np.full((S, T, Hv, S_), 333.0, dtype=np.float32), output=True),
    }
    # ggml's ranges: q/k L2-normalised, g in [-1, -1e-4] (log decay), beta in [0, 1].
    q = _l2(_u(rng, (S, T, Hk, S_)))
    k = _l2(_u(rng, (S, T, Hk, S_)))
    v = _u(rng, (S, T, Hv, S_))
    g = _u(rng, (S, T, Hv, S_) if p.kda else (S, T, Hv), -1.0, -1e-4)
    beta = _u(rng, (S, T, Hv), 0.0, 1.0)
    if p.special == "nanf":
        v[0, T // 2, 0, 1] = np.nan
        q[0, T - 1, 0, 0] = np.inf
    if p.layout == "contig":
        tensors.update(q=Tensor(q), k=Tensor(k), v=Tensor(v), g=Tensor(g), beta=Tensor(beta))
    else:
        # One fused projection row per token: [q | k | v | beta], g separately.
        L = 2 * Hk * S_ + Hv * S_ + Hv
        packed = np.concatenate(
            [q.reshape(S, T, -1), k.reshape(S, T, -1), v.reshape(S, T, -1), beta.reshape(S, T, -1)], axis=2
        )
        tensors["packed"] = Tensor(packed)
        tok = (T * L, L)
        tensors["q"] = Tensor(None, view=("packed", (S, T, Hk, S_), (*tok, S_, 1), 0))
        tensors["k"] = Tensor(None, view=("packed", (S, T, Hk, S_), (*tok, S_, 1), Hk * S_))
        tensors["v"] = Tensor(None, view=("packed", (S, T, Hv, S_), (*tok, S_, 1), 2 * Hk * S_))
        tensors["beta"] = Tensor(None, view=("packed", (S, T, Hv), (*tok, 1), 2 * Hk * S_ + Hv * S_))
        tensors["g"] = Tensor(g)
    return tensors, lay


def delta_case(p: DeltaParams) -> Case:
    def run(device: Device) -> None:
        seed = case.seed
        tensors, lay = delta_tensors(p, seed)

        def call(dev: Device, b: dict[str, Buffer]) -> None:
            dev.gated_delta_net(
                b["pool"],
                dev.indices(lay.start_rows()),
                dev.indices(lay.dst_rows()),
                b["q"],
                b["k"],
                b["v"],
                b["g"],
                b["beta"],
                b["o"],
                **_state_call_kwargs(lay),
            )

        compare_with_reference(device, tensors, seed, call, {"pool": NMSE[p.dtype], "o": NMSE[F32]})

    strided = p.layout != "contig"
    req = Requirement(
        "gated_delta_net",
        {
            "dtype": p.dtype.value,
            "n_snap": p.n_snap,
            "strided": strided,
            "variant": "kda" if p.kda else "scalar",
            "head_size": p.head_size,
        },
    )
    caps = {"storage_dtypes": {p.dtype.value}, "max_snapshots": p.n_snap}
    if strided:
        caps["strided_inputs"] = True
    case = Case(p.id, "primitive", ("gated_delta_net",), run, (req,), caps)
    return case


def delta_grid() -> list[DeltaParams]:
    g = [
        DeltaParams(128, 4, 4, 32, 2),
        DeltaParams(128, 4, 4, 32, 2, kda=True),
        DeltaParams(64, 8, 4, 16, 3),  # value-head repeat
        DeltaParams(64, 8, 4, 16, 3, kda=True),
        DeltaParams(128, 8, 8, 1, 4, starts="inplace"),  # decode
        DeltaParams(64, 4, 2, 1, 4, kda=True, starts="inplace"),
        DeltaParams(64, 4, 4, 2, 3, n_snap=3),
        DeltaParams(64, 4, 4, 3, 3, n_snap=4, kda=True),
        DeltaParams(64, 4, 2, 9, 3, n_snap=4),
        DeltaParams(64, 4, 2, 9, 3, n_snap=3, kda=True),
        DeltaParams(64, 4, 4, 1, 3, n_snap=4, starts="plane"),
        DeltaParams(32, 4, 2, 6, 4, n_snap=2, starts="repeat"),
        DeltaParams(32, 4, 2, 6, 3, n_snap=2, layout="packed"),
        DeltaParams(32, 2, 2, 5, 2, special="nanf"),
    ]
    for dt in (DType.F16, DType.BF16):
        g.append(DeltaParams(64, 4, 2, 6, 3, n_snap=3, dtype=dt))
        g.append(DeltaParams(64, 4, 4, 1, 3, kda=True, dtype=dt, starts="inplace"))
    return g


# -- row primitives ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowsParams:
    op: str  # get_rows | set_rows | zero_rows | copy_rows
    n_rows: int
    row_size: int
    n: int
    src_dtype: DType = F32
    dst_dtype: DType = F32
    index: str = "perm"  # perm | repeat | planes | same (copy within one pool)
    values: str = "uniform"  # uniform | edge

    @property
    def id(self) -> str:
        dt = (
            self.src_dtype.value
            if self.src_dtype is self.dst_dtype
            else f"{self.src_dtype.value}>{self.dst_dtype.value}"
        )
        if self.op == "zero_rows":
            dt = self.dst_dtype.value
        tail = _suffix(("index", self.index, "perm"), ("values", self.values, "uniform"))
        return f"{self.op}[r{self.n_rows}-e{self.row_size}-n{self.n}-{dt}{tail}]"


#: Values whose conversion every backend must round exactly like NumPy/ml_dtypes
#: (through float32, round to nearest even): zeros, f16 subnormals, the f16
#: maximum and the first value that overflows it, bf16 ties, infinities, NaN,
#: and NaNs with payloads and either sign (NumPy keeps the top payload bits in
#: f16; ml_dtypes makes every bf16 NaN the quiet 0x7fc0 with the sign kept).
EDGE_VALUES = np.array(
    [
        *(0.0, -0.0, 1e-8, -6e-8, 6.1e-5, 65504.0, 65520.0, -65520.0, 1e38),
        *(1.00390625, 1.01171875, 3.0e-39, np.inf, -np.inf, np.nan, 1.0, -2.5),
    ],
    dtype=np.float32,
)
EDGE_VALUES = np.concatenate(
    [EDGE_VALUES, np.array([0x7F812345, 0xFFA00001, 0x7FC00001, 0xFF800001], dtype=np.uint32).view(np.float32)]
)


def _row_values(rng: np.random.Generator, p: RowsParams, shape: tuple[int, int]) -> np.ndarray:
    data = _u(rng, shape, -4.0, 4.0)
    if p.values == "edge":
        flat = data.reshape(-1)
        flat[: EDGE_VALUES.size * (flat.size // EDGE_VALUES.size)] = np.tile(EDGE_VALUES, flat.size // EDGE_VALUES.size)
    return data


def rows_case(p: RowsParams) -> Case:
    def run(device: Device) -> None:
        seed = case.seed
        rng = rng_for(seed)
        R, E, N = p.n_rows, p.row_size, p.n
        tensors: dict[str, Tensor] = {}
        if p.op == "get_rows":
            if p.index == "repeat":
                rows = rng.integers(0, R, N)
                rows[N // 2 :] = rows[0]
            else:
                rows = rng.permutation(R)[:N]
            tensors["src"] = Tensor(_row_values(rng, p, (R, E)), p.src_dtype)
            tensors["dst"] = Tensor(_u(rng, (N, E), -1e3, 1e3), p.dst_dtype, output=True, exact=True)

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                dev.get_rows(b["src"], dev.indices(rows), b["dst"])

        elif p.op == "set_rows":
            rows = rng.permutation(R)[:N]
            tensors["src"] = Tensor(_row_values(rng, p, (N, E)), p.src_dtype)
            tensors["dst"] = Tensor(_u(rng, (R, E), -1e3, 1e3), p.dst_dtype, output=True, written=rows, exact=True)

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                dev.set_rows(b["dst"], dev.indices(rows), b["src"])

        elif p.op == "zero_rows":
            rows = rng.integers(0, R, N)  # duplicates are allowed
            tensors["dst"] = Tensor(_u(rng, (R, E), -1e3, 1e3), p.dst_dtype, output=True, written=rows, exact=True)

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                dev.zero_rows(b["dst"], dev.indices(rows))

        else:
            perm = rng.permutation(R)
            if p.index == "same":
                src_rows, dst_rows = perm[:N], perm[N : 2 * N]  # plane to plane inside one pool
                tensors["dst"] = Tensor(
                    _row_values(rng, p, (R, E)), p.dst_dtype, output=True, written=dst_rows, exact=True
                )
            else:
                src_rows, dst_rows = perm[:N], rng.permutation(R)[:N]
                tensors["src"] = Tensor(_row_values(rng, p, (R, E)), p.src_dtype)
                tensors["dst"] = Tensor(
                    _u(rng, (R, E), -1e3, 1e3), p.dst_dtype, output=True, written=dst_rows, exact=True
                )

            def call(dev: Device, b: dict[str, Buffer]) -> None:
                src = b["dst"] if p.index == "same" else b["src"]
                dev.copy_rows(src, dev.indices(src_rows), b["dst"], dev.indices(dst_rows))

        compare_with_reference(device, tensors, seed, call)

    dtypes = {p.dst_dtype.value} if p.op == "zero_rows" else {p.src_dtype.value, p.dst_dtype.value}
    reqs = tuple(Requirement(p.op, {"dtype": d}) for d in sorted(dtypes))
    case = Case(p.id, "primitive", (p.op,), run, reqs, {"storage_dtypes": dtypes})
    return case


def rows_grid() -> list[RowsParams]:
    F16, BF16 = DType.F16, DType.BF16
    g: list[RowsParams] = []
    for op in ("get_rows", "set_rows", "copy_rows"):
        g += [
            RowsParams(op, 64, 4096, 1),
            RowsParams(op, 64, 4096, 8),
            RowsParams(op, 96, 1024, 32),
            RowsParams(op, 16, 33, 5),  # odd row size: no vector-width assumptions
            RowsParams(op, 32, 512, 6, F16, F16),
            RowsParams(op, 32, 512, 6, BF16, BF16),
            RowsParams(op, 32, 512, 6, F32, F16),
            RowsParams(op, 32, 512, 6, F32, BF16),
            RowsParams(op, 32, 512, 6, F16, F32),
            RowsParams(op, 32, 512, 6, BF16, F32),
            RowsParams(op, 32, 51, 7, F32, F16, values="edge"),
            RowsParams(op, 32, 51, 7, F32, BF16, values="edge"),
            RowsParams(op, 32, 51, 7, F32, F32, values="edge"),
        ]
    g += [
        RowsParams("get_rows", 64, 1024, 16, index="repeat"),
        RowsParams("copy_rows", 64, 1024, 8, index="same"),
        RowsParams("copy_rows", 64, 1024, 8, F16, F16, index="same"),
        RowsParams("zero_rows", 64, 4096, 8),
        RowsParams("zero_rows", 16, 33, 6),
        RowsParams("zero_rows", 32, 512, 5, F16, F16),
        RowsParams("zero_rows", 32, 512, 5, BF16, BF16),
    ]
    return g


def all_cases() -> list[Case]:
    cases = [rows_case(p) for p in rows_grid()]
    cases += [conv_case(p) for p in conv_grid()]
    cases += [scan_case(p) for p in scan_grid()]
    cases += [delta_case(p) for p in delta_grid()]
    ids = [c.id for c in cases]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise RuntimeError(f"duplicate conformance case ids: {sorted(dup)}")
    return cases
