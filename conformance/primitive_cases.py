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

Inputs cross every branch of the math (see the generators below): dt below
0, between 2 and 20 and above 20; decays near 0 and near 1; beta 0 and 1;
the ``range`` cases store states near the f16/bf16 limits and subnormals;
n_snap from 1 to ``MAX_PLANES`` (zero-length index
arrays are in the oracle family); vector tails (channels, heads and d_state off a multiple of 8) and
inputs whose last stride is not 1 (``interleaved``).  ``tools/kernel_coverage.py``
reports which branches of the C kernels the kit reaches.

Start-row modes (``starts``): ``perm`` shuffled rows of a separate region,
``repeat`` several sequences starting from one row, ``inplace`` each sequence
from its own destination row (decode), ``plane`` each sequence from its own
plane-1 row (decode right after a rollback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from statecache.backend import Buffer, Caps, Device
from statecache.conformance.cases import NMSE, Case, Requirement, Tensor, compare_with_reference, rng_for
from statecache.dtypes import DType

F32 = DType.F32

#: The most snapshot planes every device offers: ``Caps.max_snapshots`` unless
#: a device declares more (the built-in ones offer 64; a case asking for more
#: than a device declares is "not supported", never run).
MAX_PLANES: int = Caps.__dataclass_fields__["max_snapshots"].default


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


# -- inputs that cross every branch ---------------------------------------------------
#
# Uniform draws from a narrow range reach one side of every threshold only: a
# CPU kernel whose softplus switched to the identity above 2 instead of 20
# passed every case while dt came from [-2, 1).  Each generator below mixes
# regions so that every branch of the math is taken by some elements of every
# case (the coverage command, tools/kernel_coverage, shows which are reached).


def _regions(rng: np.random.Generator, shape: tuple[int, ...], regions: list[tuple[float, float, float]]) -> np.ndarray:
    """Each element drawn uniformly from one of ``(lo, hi, weight)``, chosen by weight."""
    w = np.array([r[2] for r in regions], dtype=np.float64)
    pick = rng.choice(len(regions), size=shape, p=w / w.sum())
    lo = np.array([r[0] for r in regions])[pick]
    hi = np.array([r[1] for r in regions])[pick]
    return rng.uniform(lo, hi).astype(np.float32)


def dt_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """dt before softplus: below 0 (softplus near exp(dt), decay near 1),
    between 0 and 2, between 2 and 20 (log1p(exp(dt)), not dt: where a
    threshold too low shows, most at 2..6 where the difference is largest),
    and above 20 (the identity; with a large |A| the decay is near 0)."""
    return _regions(rng, shape, [(-8.0, 0.0, 3), (0.0, 2.0, 2), (2.0, 6.0, 3), (6.0, 20.0, 1), (20.0, 24.0, 1)])


def decay_rates(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A (negative): mostly Mamba's [-1, -0.05], some near 0 (decay near 1)
    and some strong (decay near 0 already at moderate dt)."""
    return -_regions(rng, shape, [(0.05, 1.0, 6), (1e-4, 1e-2, 1), (4.0, 8.0, 1)])


def log_decays(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """g (log decay) of the delta rule: ggml's [-1, -1e-4], plus decays within
    1e-6 of 1, exactly 1 (g = 0), and decays near 0, down past where a float32
    exp underflows (g < -87.3)."""
    g = _regions(rng, shape, [(-1.0, -1e-4, 6), (-1e-6, 0.0, 1), (-30.0, -8.0, 1), (-120.0, -88.0, 1)])
    flat = g.reshape(-1)
    flat[:: max(1, flat.size // 3)][:1] = 0.0
    return g


def write_strengths(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """beta in [0, 1] with the ends exactly (no write; a full overwrite)."""
    beta = rng.uniform(0.0, 1.0, shape).astype(np.float32)
    flat = beta.reshape(-1)
    flat[::7] = 0.0
    flat[3::7] = 1.0
    return beta


def extreme_states(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """States in [-1, 1] with, stored as f16 or bf16, some elements near the
    format's largest finite value and some below its smallest normal
    (subnormals), so that loads and stores cross the conversion branches.
    Only for the ``range`` cases: one huge element dominates an NMSE, so mixed
    into every case it would hide the errors of all the others."""
    data = _u(rng, shape)
    if dtype is F32:
        return data
    flat = data.reshape(-1)
    big = 6.0e4 if dtype is DType.F16 else 1.0e30  # f16's max is 65504; bf16 shares float32's range
    tiny = 3.0e-6 if dtype is DType.F16 else 4.0e-39  # below the smallest normal of each
    flat[5::97] = np.where(flat[5::97] < 0, -big, big)
    flat[11::89] = tiny
    flat[17::83] = -tiny / 3
    return data
    flat = data.reshape(-1)
    big = 6.0e4 if dtype is DType.F16 else 1.0e30  # f16 max 65504; bf16 shares f32's range
    tiny = 3.0e-6 if dtype is DType.F16 else 4.0e-39  # below f16 min normal 6.1e-5 / f32 min normal
    flat[5::97] = big * np.sign(flat[5::97] + 0.5)
    flat[11::89] = tiny
    flat[17::83] = -tiny / 3
    return data


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


def _starts(
    rng: np.random.Generator, dtype: DType, special: str, scale: float = 1.0
) -> Callable[[tuple[int, ...]], np.ndarray]:
    """Start states for :meth:`PoolLayout.pool`: near the storage format's
    limits for the ``range`` cases, else plausible values in [-scale, scale]."""
    if special == "range":
        return lambda shp: extreme_states(rng, shp, dtype)
    return lambda shp: _u(rng, shp, -scale, scale)


def plane_kwargs(layout: PoolLayout) -> dict[str, int]:
    """``n_snap`` and ``plane_stride`` of a stateful call over ``layout``."""
    return {"n_snap": layout.n_snap, "plane_stride": layout.plane_stride if layout.n_snap > 1 else 0}


Call = Callable[[Device, dict[str, Buffer]], None]


def scan_call(lay: PoolLayout) -> Call:
    """``ssm_scan`` over the placed tensors named as :func:`scan_tensors` names them."""

    def call(dev: Device, b: dict[str, Buffer]) -> None:
        rows = (dev.indices(lay.start_rows()), dev.indices(lay.dst_rows()))
        dev.ssm_scan(b["pool"], *rows, *(b[n] for n in ("x", "dt", "A", "B", "C", "y")), **plane_kwargs(lay))

    return call


def conv_call(lay: PoolLayout, bias_silu: bool) -> Call:
    """``ssm_conv`` over ``pool``, ``x``, ``weight``, ``y`` (and ``bias`` with SiLU)."""

    def call(dev: Device, b: dict[str, Buffer]) -> None:
        rows = (dev.indices(lay.start_rows()), dev.indices(lay.dst_rows()))
        bias = b["bias"] if bias_silu else None
        dev.ssm_conv(
            b["pool"], *rows, b["x"], b["weight"], b["y"], bias=bias, apply_silu=bias_silu, **plane_kwargs(lay)
        )

    return call


def delta_call(lay: PoolLayout) -> Call:
    """``gated_delta_net`` over ``pool``, ``q``, ``k``, ``v``, ``g``, ``beta``, ``o``."""

    def call(dev: Device, b: dict[str, Buffer]) -> None:
        rows = (dev.indices(lay.start_rows()), dev.indices(lay.dst_rows()))
        dev.gated_delta_net(b["pool"], *rows, *(b[n] for n in ("q", "k", "v", "g", "beta", "o")), **plane_kwargs(lay))

    return call


def state_case(
    case_id: str,
    family: str,
    op: str,
    run: Callable[[Device], None],
    dtype: DType,
    n_snap: int,
    strided: bool,
    **shape: object,
) -> Case:
    """A case of a stateful primitive, gated on its storage dtype, snapshot
    count, strided inputs and shape (what ``supports()`` is asked)."""
    req = Requirement(op, {"dtype": dtype.value, "n_snap": n_snap, "strided": strided, **shape})
    caps: dict[str, object] = {"storage_dtypes": {dtype.value}, "max_snapshots": n_snap}
    if strided:
        caps["strided_inputs"] = True
    return Case(case_id, family, (op,), run, (req,), caps)


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
    layout: str = "contig"  # contig | packed | overlap | interleaved
    starts: str = "perm"
    special: str = "none"  # none | nanf | range (states near the storage format's limits)

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
        "pool": Tensor(
            lay.pool(rng, row, _starts(rng, p.dtype, p.special)), p.dtype, output=True, written=lay.written()
        ),
    }
    x = _u(rng, (S, T, H, P))
    dt = dt_values(rng, (S, T, H))
    B = _u(rng, (S, T, G, N))
    C = _u(rng, (S, T, G, N))
    if p.special == "nanf":
        # One NaN in x and one +Inf in B of sequence 0; other sequences stay finite.
        x[0, T // 2, 0, 0] = np.nan
        B[0, T - 1, G - 1, 0] = np.inf
    A = decay_rates(rng, (H, N) if p.variant == "mamba1" else (H,))
    tensors["A"] = Tensor(A)
    if p.layout == "contig":
        tensors.update(x=Tensor(x), dt=Tensor(dt), B=Tensor(B), C=Tensor(C))
    elif p.layout == "interleaved":
        # B and C element by element in one tensor: views whose last stride is
        # 2, which kernels that vectorise over d_state must gather or pack.
        bc = np.stack([B, C], axis=-1)
        tensors["bc"] = Tensor(bc)
        st = (T * G * N * 2, G * N * 2, N * 2, 2)
        tensors["B"] = Tensor(None, view=("bc", (S, T, G, N), st, 0))
        tensors["C"] = Tensor(None, view=("bc", (S, T, G, N), st, 1))
        tensors.update(x=Tensor(x), dt=Tensor(dt))
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

        compare_with_reference(device, tensors, seed, scan_call(lay), {"pool": NMSE[p.dtype], "y": NMSE[F32]})

    shape = {"variant": p.variant, "d_state": p.d_state, "head_dim": p.head_dim}
    case = state_case(p.id, "primitive", "ssm_scan", run, p.dtype, p.n_snap, p.layout != "contig", **shape)
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
    g += [
        # the most snapshot planes every device offers, with n_t below and above
        ScanParams("mamba2", 16, 8, 2, 1, 5, 2, n_snap=MAX_PLANES),
        ScanParams("mamba2", 16, 8, 2, 1, 2 * MAX_PLANES + 3, 2, n_snap=MAX_PLANES),
        # groups that are neither 1 nor one per head: which heads share B and C
        ScanParams("mamba2", 16, 8, 8, 4, 6, 2),
        # B and C with a last stride of 2, prefill and decode, both variants
        ScanParams("mamba2", 32, 16, 4, 2, 20, 2, n_snap=2, layout="interleaved"),
        ScanParams("mamba2", 16, 8, 4, 2, 1, 3, layout="interleaved", starts="inplace"),
        ScanParams("mamba1", 16, 1, 63, 1, 5, 2, layout="interleaved"),
        ScanParams("mamba1", 12, 1, 31, 1, 3, 2),  # d_state not a multiple of 8, an odd number of heads
    ]
    for dt in (DType.F16, DType.BF16):
        g.append(ScanParams("mamba2", 64, 32, 8, 2, 8, 3, n_snap=3, dtype=dt))
        g.append(ScanParams("mamba1", 16, 1, 256, 1, 8, 3, dtype=dt, starts="inplace"))
        g.append(ScanParams("mamba2", 64, 32, 8, 2, 8, 3, n_snap=3, dtype=dt, special="range"))
        g.append(ScanParams("mamba1", 16, 1, 256, 1, 8, 3, dtype=dt, special="range"))
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
    layout: str = "contig"  # contig | packed | interleaved
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
            lay.pool(rng, ch * W, _starts(rng, p.dtype, p.special)),
            p.dtype,
            output=True,
            written=lay.written(),
            exact=True,
        ),
        "weight": Tensor(_u(rng, (ch, p.d_conv))),
        "bias": Tensor(_u(rng, (ch,))),
        "y": Tensor(np.full((S, T, ch), 555.0, dtype=np.float32), output=True),
    }
    x = _u(rng, (S, T, ch))
    if p.special == "range":
        # Windows are copies of x: storing them crosses the format's overflow
        # (65519 rounds to 65504, 65520 to inf in f16) and subnormal branches.
        x = extreme_states(rng, (S, T, ch), p.dtype)
        x[:, :, -1] = np.where(np.arange(T) % 2 == 0, 6.0e4, -6.0e4)  # SiLU's far tails, in the vector tail too
        if p.dtype is DType.F16:
            x[:, -1, :4] = [65519.0, 65520.0, -65520.0, 6.0e-8]
    if p.special == "nanf":
        x[0, 0, 1] = np.nan
        x[0, T - 1, 2] = np.inf
        x[0, T - 1, 3] = -np.inf
    if p.layout == "contig":
        tensors["x"] = Tensor(x)
    elif p.layout == "interleaved":
        # x channels two elements apart (another tensor's values in between).
        pair = np.stack([x, _u(rng, (S, T, ch))], axis=-1)
        tensors["pair"] = Tensor(pair)
        tensors["x"] = Tensor(None, view=("pair", (S, T, ch), (T * ch * 2, ch * 2, 2), 0))
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

        compare_with_reference(device, tensors, seed, conv_call(lay, p.bias_silu), {"y": NMSE[F32]})

    case = state_case(p.id, "primitive", "ssm_conv", run, p.dtype, p.n_snap, p.layout != "contig", d_conv=p.d_conv)
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
    g += [
        ConvParams(2, 256, 5, 3, n_snap=3),  # a one-column window
        ConvParams(2, 256, 1, 3, bias_silu=True, starts="inplace"),
        ConvParams(4, 64, 5, 2, n_snap=MAX_PLANES),  # the most planes every device offers
        ConvParams(4, 64, 2 * MAX_PLANES + 3, 2, n_snap=MAX_PLANES),
        # channels not a multiple of 8 (vector tails), x with a channel stride of 2
        ConvParams(4, 36, 1, 3, bias_silu=True, starts="inplace"),
        ConvParams(4, 36, 1, 3, n_snap=2),
        ConvParams(5, 36, 1, 3, n_snap=2, starts="plane"),
        ConvParams(5, 36, 1, 3, bias_silu=True),
        ConvParams(4, 36, 6, 2, n_snap=2, bias_silu=True),
        ConvParams(4, 40, 1, 3, layout="interleaved", starts="inplace"),
        ConvParams(3, 36, 1, 3, bias_silu=True, layout="interleaved"),
        ConvParams(4, 40, 6, 2, n_snap=3, layout="interleaved"),
    ]
    for dt in (DType.F16, DType.BF16):
        g.append(ConvParams(4, 256, 5, 3, n_snap=3, dtype=dt, bias_silu=True))
        g.append(ConvParams(4, 256, 1, 3, dtype=dt, starts="inplace"))
        g.append(ConvParams(4, 36, 5, 3, n_snap=3, dtype=dt, bias_silu=True, special="range"))
        g.append(ConvParams(4, 36, 1, 3, dtype=dt, bias_silu=True, starts="inplace", special="range"))
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
    layout: str = "contig"  # contig | packed | interleaved
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
            lay.pool(rng, Hv * S_ * S_, _starts(rng, p.dtype, p.special, 0.5)),
            p.dtype,
            output=True,
            written=lay.written(),
        ),
        "o": Tensor(np.full((S, T, Hv, S_), 333.0, dtype=np.float32), output=True),
    }
    # q/k L2-normalised as upstream; g (log decay) and beta across their ranges' ends.
    q = _l2(_u(rng, (S, T, Hk, S_)))
    k = _l2(_u(rng, (S, T, Hk, S_)))
    v = _u(rng, (S, T, Hv, S_))
    g = log_decays(rng, (S, T, Hv, S_) if p.kda else (S, T, Hv))
    beta = write_strengths(rng, (S, T, Hv))
    if p.special == "nanf":
        v[0, T // 2, 0, 1] = np.nan
        q[0, T - 1, 0, 0] = np.inf
    if p.layout == "contig":
        tensors.update(q=Tensor(q), k=Tensor(k), v=Tensor(v), g=Tensor(g), beta=Tensor(beta))
    elif p.layout == "interleaved":
        # q and k element by element in one tensor (last stride 2).
        qk = np.stack([q, k], axis=-1)
        tensors["qk"] = Tensor(qk)
        st = (T * Hk * S_ * 2, Hk * S_ * 2, S_ * 2, 2)
        tensors["q"] = Tensor(None, view=("qk", (S, T, Hk, S_), st, 0))
        tensors["k"] = Tensor(None, view=("qk", (S, T, Hk, S_), st, 1))
        tensors.update(v=Tensor(v), g=Tensor(g), beta=Tensor(beta))
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

        compare_with_reference(device, tensors, seed, delta_call(lay), {"pool": NMSE[p.dtype], "o": NMSE[F32]})

    shape = {"variant": "kda" if p.kda else "scalar", "head_size": p.head_size}
    case = state_case(p.id, "primitive", "gated_delta_net", run, p.dtype, p.n_snap, p.layout != "contig", **shape)
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
    g += [
        DeltaParams(16, 4, 2, 5, 2, n_snap=MAX_PLANES),  # the most planes every device offers
        DeltaParams(16, 4, 2, 2 * MAX_PLANES + 3, 2, n_snap=MAX_PLANES, kda=True),
        DeltaParams(16, 4, 2, 5, 2, layout="interleaved"),  # q and k with a last stride of 2
        DeltaParams(16, 4, 2, 1, 3, kda=True, layout="interleaved", starts="inplace"),
    ]
    for dt in (DType.F16, DType.BF16):
        g.append(DeltaParams(64, 4, 2, 6, 3, n_snap=3, dtype=dt))
        g.append(DeltaParams(64, 4, 4, 1, 3, kda=True, dtype=dt, starts="inplace"))
        g.append(DeltaParams(64, 4, 2, 6, 3, n_snap=3, dtype=dt, special="range"))
        g.append(DeltaParams(64, 4, 2, 1, 3, kda=True, dtype=dt, starts="inplace", special="range"))
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
#: maximum and the first value that overflows it, bf16 and f16 ties, infinities, NaN,
#: and NaNs with payloads and either sign (NumPy keeps the top payload bits in
#: f16; ml_dtypes makes every bf16 NaN the quiet 0x7fc0 with the sign kept).
EDGE_VALUES = np.array(
    [
        *(0.0, -0.0, 1e-8, -6e-8, 6.1e-5, 65504.0, 65520.0, -65520.0, 1e38),
        *(1.00390625, 1.01171875, 3.0e-39, np.inf, -np.inf, np.nan, 1.0, -2.5),
        # f16 ties to even, normal and subnormal, and a subnormal just above a
        # tie (the sticky bits a shift drops must round it up)
        *(1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 2.0**-25 + 2.0**-45),
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
