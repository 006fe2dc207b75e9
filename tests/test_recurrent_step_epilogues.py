"""The fused options of the recurrent step's ``scan`` and ``delta`` equal the glue a runtime
would otherwise write around each call (here in NumPy, the formulas transformers and
mamba_ssm use), on the reference and cpu devices; bad option arguments are refused naming
them, and a device without an epilogue refuses the call with the primitive's own capability
error.  Every refusal changes nothing.

Each case runs two ubatches (a prefill of three tokens for two sequences, then one decode
token each) through two fresh memories, one with the option fused, one with the glue, and
compares the outputs of both ubatches and the final state pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import statecache
from statecache.backend import Device
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, CapabilityError
from statecache.factory import make_memory
from statecache.memory import MemoryStatus
from statecache.spec import MemorySpec, RecurrentLayerSpec

DEVICES = ("reference", "cpu")
SCAN_OPTIONS = ("dt_bias", "dt_limit", "D", "z")
DELTA_OPTIONS = ("grouped", "qk_l2norm", "raw_gate", "gate_bias", "beta_sigmoid")
PROMPTS = {0: [1, 2, 3], 1: [4, 5, 6]}
# float32 rounding: the fused and glued paths order a few additions differently
TOL = dict(rtol=2e-5, atol=2e-6)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _run(
    dev: Device, layer: RecurrentLayerSpec, call: Callable[[Any, int, int, int], list[np.ndarray]]
) -> tuple[list[np.ndarray], np.ndarray]:
    """Prefill then one decode token through a fresh memory; ``call(step, ubatch_no, n_s, n_t)``
    steps the state tensor ``s`` and returns its outputs.  Returns every output and the pool."""
    mem = make_memory(MemorySpec.build(1, {0: layer}), dev, n_seq_max=2)
    outs: list[np.ndarray] = []
    for no, batch in enumerate((Batch.for_sequences(PROMPTS), Batch.for_sequences({0: [7], 1: [8]}))):
        balloc = BatchAllocator(mem.n_seq_max)
        balloc.init(batch, mem)
        ctx = mem.init_batch(balloc, 8)
        assert ctx.status is MemoryStatus.SUCCESS
        assert ctx.apply()
        ub = ctx.get_ubatch()
        step = ctx.step()
        outs += call(step, no, ub.n_seqs, ub.n_seq_tokens)
        step.copy_only(0, "r")
    return outs, mem.pools[0]["s"].numpy().copy()


# -- ssm_scan -------------------------------------------------------------------------------


@dataclasses.dataclass
class ScanCase:
    """Random inputs of one Mamba-2 (or Mamba-1: head_dim 1, A [H, N]) scan layer."""

    mamba1: bool
    seed: int
    H: int = 4
    P: int = 3
    N: int = 5
    G: int = 2

    def __post_init__(self) -> None:
        if self.mamba1:
            self.P, self.G = 1, 1
        rng = np.random.default_rng(self.seed)
        self.rng = rng
        H, N = self.H, self.N
        shape_A = (H, N) if self.mamba1 else (H,)
        self.A = -np.exp(rng.normal(0, 0.5, shape_A)).astype(np.float32)
        self.D = rng.normal(0, 1, (H,)).astype(np.float32)
        self.dt_bias = rng.normal(0, 1, (H,)).astype(np.float32)
        # a limit that clamps some of softplus(dt + dt_bias) on both sides
        self.dt_limit = (0.4, 1.2)
        self.tokens: dict[int, dict[str, np.ndarray]] = {}

    def spec(self) -> RecurrentLayerSpec:
        if self.mamba1:
            return RecurrentLayerSpec.mamba1(d_inner=self.H, d_state=self.N, d_conv=2)
        return RecurrentLayerSpec.mamba2(d_inner=self.H * self.P, d_state=self.N, d_conv=2, n_group=self.G,
                                         head_dim=self.P)  # fmt: skip

    def inputs(self, no: int, n_s: int, n_t: int) -> dict[str, np.ndarray]:
        if no not in self.tokens:  # the same draw for the fused and the glued run
            r, H, P, G, N = self.rng, self.H, self.P, self.G, self.N
            self.tokens[no] = {
                "x": r.normal(0, 1, (n_s, n_t, H, P)),
                "dt": r.normal(0, 1.5, (n_s, n_t, H)),
                "B": r.normal(0, 1, (n_s, n_t, G, N)),
                "C": r.normal(0, 1, (n_s, n_t, G, N)),
                "z": r.normal(0, 2, (n_s, n_t, H, P)),
            }
            self.tokens[no] = {k: v.astype(np.float32) for k, v in self.tokens[no].items()}
        return self.tokens[no]

    def fused(self, dev: Device, options: frozenset[str]) -> Callable[[Any, int, int, int], list[np.ndarray]]:
        def call(step: Any, no: int, n_s: int, n_t: int) -> list[np.ndarray]:
            t = self.inputs(no, n_s, n_t)
            y = dev.alloc(t["x"].shape)
            up = dev.upload
            kw: dict[str, Any] = {}
            if "dt_bias" in options:
                kw["dt_bias"] = up(self.dt_bias)
            if "dt_limit" in options:
                kw["dt_limit"] = self.dt_limit
            if "D" in options:
                kw["D"] = up(self.D)
            if "z" in options:
                kw["z"] = up(t["z"])
            step.scan(0, up(t["x"]), up(t["dt"]), up(self.A), up(t["B"]), up(t["C"]), y, **kw)
            return [y.numpy().copy()]

        return call

    def glued(self, dev: Device, options: frozenset[str]) -> Callable[[Any, int, int, int], list[np.ndarray]]:
        def call(step: Any, no: int, n_s: int, n_t: int) -> list[np.ndarray]:
            t = self.inputs(no, n_s, n_t)
            dt = t["dt"].astype(np.float64)
            if "dt_bias" in options:
                dt = dt + self.dt_bias
            if "dt_limit" in options:  # clamp softplus, hand the scan its inverse
                d = np.clip(_softplus(dt), *self.dt_limit)
                dt = d + np.log(-np.expm1(-d))
            y = dev.alloc(t["x"].shape)
            up = dev.upload
            step.scan(0, up(t["x"]), up(dt.astype(np.float32)), up(self.A), up(t["B"]), up(t["C"]), y)
            out = y.numpy().astype(np.float64)
            if "D" in options:
                out = out + self.D[:, None] * t["x"]
            if "z" in options:
                out = out * _silu(t["z"].astype(np.float64))
            return [out]

        return call


@pytest.mark.parametrize("name", DEVICES)
@given(options=st.sets(st.sampled_from(SCAN_OPTIONS), min_size=1), mamba1=st.booleans(), seed=st.integers(0, 2**16))
def test_scan_options_equal_the_glue(name: str, options: set[str], mamba1: bool, seed: int) -> None:
    dev = statecache.get_device(name)
    case = ScanCase(mamba1, seed)
    opts = frozenset(options)
    fused_out, fused_pool = _run(dev, case.spec(), case.fused(dev, opts))
    glued_out, glued_pool = _run(dev, case.spec(), case.glued(dev, opts))
    for a, b in zip(fused_out, glued_out, strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(fused_pool, glued_pool, **TOL)


# -- gated_delta_net ------------------------------------------------------------------------


@dataclasses.dataclass
class DeltaCase:
    """Random inputs of one grouped-head gated delta net layer (H_k = 2, H_v = 4)."""

    seed: int
    HK: int = 2
    HV: int = 4
    S: int = 3

    def __post_init__(self) -> None:
        rng = self.rng = np.random.default_rng(self.seed)
        self.A_log = rng.normal(0, 0.5, (self.HV,)).astype(np.float32)
        self.dt_bias = rng.normal(0, 1, (self.HV,)).astype(np.float32)
        self.tokens: dict[int, dict[str, np.ndarray]] = {}

    def spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec.gdn(n_head=self.HV, head_dim=self.S, d_conv=2, n_head_k=self.HK)

    def inputs(self, no: int, n_s: int, n_t: int) -> dict[str, np.ndarray]:
        if no not in self.tokens:
            r, HK, HV, S = self.rng, self.HK, self.HV, self.S
            self.tokens[no] = {
                "q": r.normal(0, 1, (n_s, n_t, HK, S)),
                "k": r.normal(0, 1, (n_s, n_t, HK, S)),
                "v": r.normal(0, 1, (n_s, n_t, HV, S)),
                "a": r.normal(0, 1, (n_s, n_t, HV)),  # raw gate projection
                "b": r.normal(0, 2, (n_s, n_t, HV)),  # raw beta projection
            }
            self.tokens[no] = {k: v.astype(np.float32) for k, v in self.tokens[no].items()}
        return self.tokens[no]

    def _normalised(self, t: dict[str, np.ndarray], options: frozenset[str]) -> tuple[np.ndarray, np.ndarray]:
        """q and k as the primitive must see them without the options (the glue)."""
        q, k = t["q"].astype(np.float64), t["k"].astype(np.float64)
        if "qk_l2norm" in options:  # fla's l2norm, eps 1e-6
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        rep = self.HV // self.HK
        if "grouped" in options:  # value head h reads key head h // rep: repeat-interleave
            q, k = np.repeat(q, rep, axis=2), np.repeat(k, rep, axis=2)
        else:  # tiled: h % HK
            q, k = np.tile(q, (1, 1, rep, 1)), np.tile(k, (1, 1, rep, 1))
        return q.astype(np.float32), k.astype(np.float32)

    def gate_beta(self, t: dict[str, np.ndarray], options: frozenset[str]) -> tuple[np.ndarray, np.ndarray]:
        """Qwen3-Next's gate and beta from the raw projections (the glue)."""
        a, b = t["a"].astype(np.float64), t["b"].astype(np.float64)
        g = -np.exp(self.A_log) * _softplus(a + (self.dt_bias if "gate_bias" in options else 0.0))
        return g.astype(np.float32), _sigmoid(b).astype(np.float32)

    def fused(self, dev: Device, options: frozenset[str]) -> Callable[[Any, int, int, int], list[np.ndarray]]:
        def call(step: Any, no: int, n_s: int, n_t: int) -> list[np.ndarray]:
            t = self.inputs(no, n_s, n_t)
            up = dev.upload
            kw: dict[str, Any] = {"head_map": "grouped" if "grouped" in options else "tiled"}
            kw["qk_l2norm"] = "qk_l2norm" in options
            g, beta = self.gate_beta(t, options)  # what the options do not fuse comes precomputed
            if "raw_gate" in options:
                g = t["a"]
                kw["A_log"] = up(self.A_log)
                if "gate_bias" in options:
                    kw["dt_bias"] = up(self.dt_bias)
            if "beta_sigmoid" in options:
                beta, kw["beta_sigmoid"] = t["b"], True
            o = dev.alloc(t["v"].shape)
            step.delta(0, up(t["q"]), up(t["k"]), up(t["v"]), up(g), up(beta), o, **kw)
            return [o.numpy().copy()]

        return call

    def glued(self, dev: Device, options: frozenset[str]) -> Callable[[Any, int, int, int], list[np.ndarray]]:
        def call(step: Any, no: int, n_s: int, n_t: int) -> list[np.ndarray]:
            t = self.inputs(no, n_s, n_t)
            up = dev.upload
            q, k = self._normalised(t, options)
            g, beta = self.gate_beta(t, options)
            o = dev.alloc(t["v"].shape)
            step.delta(0, up(q), up(k), up(t["v"]), up(g), up(beta), o)
            return [o.numpy().copy()]

        return call


def _delta_sets() -> st.SearchStrategy[frozenset[str]]:
    # the gate bias is part of the raw gate form: drawn only with it
    return (
        st.sets(st.sampled_from(DELTA_OPTIONS), min_size=1)
        .map(lambda s: frozenset(s - {"gate_bias"} if "raw_gate" not in s else s))
        .filter(bool)
    )


@pytest.mark.parametrize("name", DEVICES)
@given(options=_delta_sets(), seed=st.integers(0, 2**16))
def test_delta_options_equal_the_glue(name: str, options: frozenset[str], seed: int) -> None:
    dev = statecache.get_device(name)
    case = DeltaCase(seed)
    fused_out, fused_pool = _run(dev, case.spec(), case.fused(dev, options))
    glued_out, glued_pool = _run(dev, case.spec(), case.glued(dev, options))
    for a, b in zip(fused_out, glued_out, strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(fused_pool, glued_pool, **TOL)


# -- refusals -------------------------------------------------------------------------------


def _memory_step(
    dev: Device, layer: RecurrentLayerSpec, keep_undo_rows: bool | None = None
) -> tuple[Any, Any, Any, dict[str, np.ndarray]]:
    mem = make_memory(MemorySpec.build(1, {0: layer}), dev, n_seq_max=2)
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(PROMPTS), mem)
    ctx = mem.init_batch(balloc, 8)
    assert ctx.apply()
    before = {n: b.numpy().copy() for n, b in mem.pools[0].items()}
    return mem, ctx.get_ubatch(), ctx.step(keep_undo_rows), before


def _unchanged(mem: Any, before: dict[str, np.ndarray]) -> None:
    for n, b in mem.pools[0].items():
        np.testing.assert_array_equal(b.numpy(), before[n])


SCAN_BAD = [
    ("D", {"D": (4, 2)}),
    ("z", {"z": (2, 3, 4, 2)}),
    ("dt_bias", {"dt_bias": (3,)}),
    ("dt_limit", {"dt_limit": (2.0, 1.0)}),
]


@pytest.mark.parametrize(("argument", "bad"), SCAN_BAD, ids=[a for a, _ in SCAN_BAD])
def test_a_bad_scan_option_is_refused_naming_it_and_changes_nothing(argument: str, bad: dict[str, Any]) -> None:
    dev = statecache.get_device("reference")
    case = ScanCase(False, 0)
    mem, ub, step, before = _memory_step(dev, case.spec())
    t = case.inputs(0, ub.n_seqs, ub.n_seq_tokens)
    up = dev.upload
    kw = {k: v if k == "dt_limit" else dev.alloc(v) for k, v in bad.items()}
    with pytest.raises(ArgumentError) as info:
        step.scan(0, up(t["x"]), up(t["dt"]), up(case.A), up(t["B"]), up(t["C"]), dev.alloc(t["x"].shape), **kw)
    assert info.value.argument == argument
    _unchanged(mem, before)
    # the call was not counted: the corrected one runs
    step.scan(0, up(t["x"]), up(t["dt"]), up(case.A), up(t["B"]), up(t["C"]), dev.alloc(t["x"].shape))


DELTA_BAD = [
    ("head_map", {"head_map": "interleaved"}),
    ("A_log", {"A_log": (3,)}),
    ("dt_bias", {"A_log": (4,), "dt_bias": (4, 3)}),
    ("dt_bias", {"dt_bias": (4,)}),  # without A_log: the bias belongs to the raw gate
    ("qk_l2norm", {"qk_l2norm": "yes"}),
]


@pytest.mark.parametrize(("argument", "bad"), DELTA_BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(DELTA_BAD)])
def test_a_bad_delta_option_is_refused_naming_it_and_changes_nothing(argument: str, bad: dict[str, Any]) -> None:
    dev = statecache.get_device("reference")
    case = DeltaCase(0)
    mem, ub, step, before = _memory_step(dev, case.spec())
    t = case.inputs(0, ub.n_seqs, ub.n_seq_tokens)
    up = dev.upload
    kw = {k: dev.alloc(v) if isinstance(v, tuple) else v for k, v in bad.items()}
    args = (up(t["q"]), up(t["k"]), up(t["v"]), up(t["a"]), up(_sigmoid(t["b"])), dev.alloc(t["v"].shape))
    with pytest.raises(ArgumentError) as info:
        step.delta(0, *args, **kw)
    assert info.value.argument == argument
    _unchanged(mem, before)
    step.delta(0, *args, head_map="grouped")


class _NoEpilogues(type(statecache.get_device("reference"))):  # type: ignore[misc]
    """A device that implements the primitives but fuses nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.caps = dataclasses.replace(self.caps, epilogues=frozenset())


@pytest.mark.parametrize(
    ("op", "option", "message"),
    [
        ("scan", {"D": True}, "does not fuse D into ssm_scan"),
        ("scan", {"dt_limit": (0.1, 1.0)}, "does not fuse dt_limit into ssm_scan"),
        ("delta", {"head_map": "grouped"}, "does not fuse grouped_heads into gated_delta_net"),
        ("delta", {"qk_l2norm": True, "beta_sigmoid": True}, "does not fuse beta_sigmoid, qk_l2norm into"),
    ],
)
def test_a_device_without_the_epilogue_refuses_and_nothing_is_written(
    op: str, option: dict[str, Any], message: str
) -> None:
    dev = _NoEpilogues()
    if op == "scan":
        case: Any = ScanCase(False, 1)
    else:
        case = DeltaCase(1)
    mem, ub, step, before = _memory_step(dev, case.spec(), keep_undo_rows=True)  # copies rows before writing
    t = case.inputs(0, ub.n_seqs, ub.n_seq_tokens)
    up = dev.upload
    if op == "scan":
        kw = {k: up(case.D) if k == "D" else v for k, v in option.items()}
        args: tuple[Any, ...] = (up(t["x"]), up(t["dt"]), up(case.A), up(t["B"]), up(t["C"]), dev.alloc(t["x"].shape))
        run = step.scan
    else:
        kw = dict(option)
        args = (up(t["q"]), up(t["k"]), up(t["v"]), up(t["a"]), up(_sigmoid(t["b"])), dev.alloc(t["v"].shape))
        run = step.delta
    with pytest.raises(CapabilityError, match=message):
        run(0, *args, **kw)
    _unchanged(mem, before)
    # the primitive itself says the same
    pool, rows = mem.pools[0]["s"], dev.indices([0])
    first = [a if a.ndim < 3 else up(a.numpy()[:1, :1]) for a in args[:-1]]  # sequence 0's first token
    out = dev.alloc((1, 1, *args[-1].shape[2:]))
    with pytest.raises(CapabilityError, match=message):
        (dev.ssm_scan if op == "scan" else dev.gated_delta_net)(pool, rows, rows, *first, out, **kw)
    run(0, *args)  # without the option the device runs it
