"""The chunked prefill forms of the C kernels: Mamba-2's SSD blocks (heads of a
group walked together), the gated delta rule / KDA in flash-linear-
attention's WY form, RWKV-6 / GLA in its chunked gated form and RWKV-7 in
its chunked WY form of the generalized (diagonal plus low rank) delta rule.  A sequence
takes them when a run of at least 16 tokens (8 for RWKV-6 / GLA) lies between
its snapshot positions, so every case here has such runs, with snapshot
columns anywhere in the sequence (chunks end at each of them).

Checked: the reference against independent float64 loops and the device
against the reference (the conformance varlen cases, every pool and
activation dtype, fused options); one packed call against one call per
sequence and 1, 2 or 3 threads, bitwise; NaN and Inf from an input in the
middle of a long sequence land where the definition puts them; KDA blocks
and RWKV-6 / GLA chunks whose decay spans too much to factor.  Hypothesis examples:
``STATECACHE_CHUNKED_EXAMPLES`` (default 10)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from cpu_cases import assert_packed_call_thread_invariant, cpu_device
from hypothesis import given, settings
from hypothesis import strategies as st

from statecache.conformance import linear_attn_cases as LA
from statecache.conformance import varlen_cases as V
from statecache.conformance.cases import assert_close
from statecache.dtypes import DType
from statecache.registry import get_device

EXAMPLES = int(os.environ.get("STATECACHE_CHUNKED_EXAMPLES", "10"))

#: The ops with a chunked form, small enough for the float64 formulas: Mamba-2
#: with one block of heads, with a block and a remainder (12 heads of one
#: group: 8 + 4) and with three groups; GDN and KDA plain and with every fused
#: option (grouped heads, in-kernel L2 norm, raw gate, beta sigmoid).
CHUNKED_OPS: tuple[Callable[[], V.Op], ...] = (
    lambda: V.scan_op("mamba2", 16, 8, 4, 2),
    lambda: V.scan_op("mamba2", 16, 8, 12, 1, D="hp", z=True, dt_bias=True),
    lambda: V.scan_op("mamba2", 8, 16, 12, 3),
    lambda: V.delta_op(False, 16, 4, 2),
    lambda: V.delta_op(True, 16, 2, 2),
    lambda: V.delta_op(
        False, 16, 4, 2, head_map="grouped", qk_l2norm=True, raw_gate=True, beta_sigmoid=True, scale=0.3
    ),
    lambda: V.delta_op(True, 8, 4, 2, head_map="grouped", qk_l2norm=True, raw_gate=True, beta_sigmoid=True),
    lambda: LA.rwkv6_op(16, 3),
    lambda: LA.gla_op(16, 3),
    lambda: LA.rwkv6_op(24, 2, scale=0.5),
    lambda: LA.rwkv7_op(16, 3),
    lambda: LA.rwkv7_op(8, 2, scale=0.5),
)


@st.composite
def chunked_calls(draw: st.DrawFn) -> V.VarlenParams:
    op = CHUNKED_OPS[draw(st.integers(0, len(CHUNKED_OPS) - 1))]()
    long_one = draw(st.integers(17, 90))
    others = draw(st.lists(st.integers(0, 40), max_size=3))
    lengths = [long_one, *others]
    draw(st.randoms(use_true_random=False)).shuffle(lengths)
    return V.VarlenParams(
        op,
        tuple(lengths),
        draw(st.integers(1, 48)),  # columns: snapshot positions anywhere in a sequence
        draw(st.sampled_from(("planes", "sparse", "shared", "rotate"))),
        draw(st.sampled_from((DType.F32, DType.F16, DType.BF16))),
        act=draw(st.sampled_from((DType.F32, DType.BF16))),
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(p=chunked_calls())
def test_chunked_forms_pass_the_contract_cases(p: V.VarlenParams) -> None:
    """Reference vs formula, device vs reference (guards, rows not addressed),
    and one packed call == one call per sequence, bitwise (each case's data
    are seeded by its id)."""
    dev = cpu_device()
    with np.errstate(all="ignore"):
        V.varlen_case(p).run(dev)
        V.packed_split_case(V.VarlenParams(p.op, p.lengths, p.K, p.mode, p.dtype, "packed_split", p.act)).run(dev)


@pytest.fixture
def split_small_calls() -> Iterator[None]:
    lib = cpu_device()._lib
    previous = lib.sc_set_state_parallel_min_bytes(0)
    yield
    lib.sc_set_state_parallel_min_bytes(previous)


@pytest.mark.usefixtures("split_small_calls")
@pytest.mark.parametrize("make_op", CHUNKED_OPS)
def test_chunked_forms_do_not_depend_on_the_thread_count(
    make_op: Callable[[], V.Op], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_packed_call_thread_invariant(monkeypatch, make_op(), (75, 3, 0, 40, 18), n_cols=30, seed=3)


# -- non-finite inputs -------------------------------------------------------------------

N_T = 100  # chunks of 16: the poked token sits in the middle of the sequence


def _delta_inputs(rng: np.random.Generator, kda: bool, S: int, H: int) -> dict[str, np.ndarray]:
    q, k = rng.uniform(-1, 1, (2, N_T, H, S)).astype(np.float32)
    return {
        "q": q / np.linalg.norm(q, axis=-1, keepdims=True),
        "k": k / np.linalg.norm(k, axis=-1, keepdims=True),
        "v": rng.uniform(-1, 1, (N_T, H, S)).astype(np.float32),
        "g": rng.uniform(-1, -1e-3, (N_T, H, S) if kda else (N_T, H)).astype(np.float32),
        "beta": rng.uniform(0, 1, (N_T, H)).astype(np.float32),
    }


def _scan_inputs(rng: np.random.Generator, H: int, G: int, P: int, N: int) -> dict[str, np.ndarray]:
    return {
        "x": rng.uniform(-1, 1, (N_T, H, P)).astype(np.float32),
        "dt": rng.uniform(-4, 1, (N_T, H)).astype(np.float32),
        "A": -rng.uniform(0.2, 2.0, (H,)).astype(np.float32),
        "B": rng.uniform(-1, 1, (N_T, G, N)).astype(np.float32),
        "C": rng.uniform(-1, 1, (N_T, G, N)).astype(np.float32),
    }


def _both_devices(op: str, state: int, inputs: dict[str, np.ndarray], out_shape: tuple[int, ...]) -> list:  # type: ignore[type-arg]
    """Pool rows and outputs of one call (start row 0, snapshot columns 0..3 in
    rows 1..4) on the C device and the reference."""
    rng = np.random.default_rng(1)
    pool0 = rng.uniform(-0.5, 0.5, (5, state)).astype(np.float32)
    results = []
    for dev in (cpu_device(), get_device("reference")):
        pool, out = dev.upload(pool0), dev.upload(np.zeros(out_shape, np.float32))
        args = [dev.upload(a) for a in inputs.values()]
        table, cu = dev.indices(np.asarray([[1, 2, 3, 4]])), dev.indices([0, N_T])
        with np.errstate(all="ignore"):
            getattr(dev, op)(pool, dev.indices([0]), table, *args, out, cu_seqlens=cu)
        results.append((dev.download(pool)[1:], dev.download(out)))
    return results


POKES = [("v", np.nan), ("q", np.inf), ("k", -np.inf), ("g", np.nan), ("beta", np.inf)]


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize(("name", "value"), POKES)
def test_delta_rule_places_non_finite_inputs_as_the_definition(kda: bool, name: str, value: float) -> None:
    """A NaN or Inf in a chunk past the first: the chunks before it stay
    chunked, the rest runs token by token, and NaN/Inf parity with the
    reference holds element by element (an Inf times a masked zero, or Infs
    of both signs summed, would make NaN where the recurrence has Inf)."""
    S, H = 16, 2
    inputs = _delta_inputs(np.random.default_rng(7), kda, S, H)
    inputs[name][(41, 1) if inputs[name].ndim == 2 else (41, 1, 3)] = value
    (pool, o), (pool_ref, o_ref) = _both_devices("gated_delta_net", H * S * S, inputs, (N_T, H, S))
    assert_close("o", o, o_ref, 1e-7)
    assert_close("snapshots", pool, pool_ref, 1e-7)
    assert np.isfinite(o[:41]).all() and not np.isfinite(o[41:]).all()


@pytest.mark.parametrize(("name", "value"), [("x", np.nan), ("B", np.inf), ("C", -np.inf), ("dt", np.nan)])
def test_mamba2_places_non_finite_inputs_as_the_definition(name: str, value: float) -> None:
    H, G, P, N = 12, 1, 8, 16
    inputs = _scan_inputs(np.random.default_rng(8), H, G, P, N)
    inputs[name][(57, 0) if inputs[name].ndim == 2 else (57, 0, 2)] = value
    (pool, y), (pool_ref, y_ref) = _both_devices("ssm_scan", H * P * N, inputs, (N_T, H, P))
    assert_close("y", y, y_ref, 1e-7)
    assert_close("snapshots", pool, pool_ref, 1e-7)
    assert np.isfinite(y[:57]).all() and not np.isfinite(y[57:]).all()


@pytest.mark.parametrize("kda", [False, True])
def test_non_finite_start_state_takes_the_token_loop(kda: bool) -> None:
    """The chunked form gives up before its first chunk; the token loop then
    needs its own copy of the gates (KDA's chunked form reads them in place)."""
    S, H = 16, 2
    inputs = _delta_inputs(np.random.default_rng(9), kda, S, H)
    results = []
    for dev in (cpu_device(), get_device("reference")):
        pool0 = np.random.default_rng(2).uniform(-0.5, 0.5, (2, H * S * S)).astype(np.float32)
        pool0[0, 5] = np.inf
        pool, o = dev.upload(pool0), dev.upload(np.zeros((N_T, H, S), np.float32))
        with np.errstate(all="ignore"):
            dev.gated_delta_net(pool, dev.indices([0]), dev.indices([[1]]), *(dev.upload(a) for a in inputs.values()),
                                o, cu_seqlens=dev.indices([0, N_T]))  # fmt: skip
        results.append((dev.download(pool)[1], dev.download(o)))
    assert_close("o", results[0][1], results[1][1], 1e-7)
    assert_close("state", results[0][0], results[1][0], 1e-7)


def _rwkv7_inputs(rng: np.random.Generator, S: int, H: int, decay_min: float) -> dict[str, np.ndarray]:
    """RWKV-7's inputs as a model makes them: a = -kk, b = kk * iclr with kk a
    unit vector and iclr in (0, 1) (the in-context learning rate)."""
    r, k, v = rng.uniform(-1, 1, (3, N_T, H, S)).astype(np.float32)
    kk = rng.uniform(-1, 1, (N_T, H, S))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    w = rng.uniform(decay_min, -1e-3, (N_T, H, S)).astype(np.float32)
    iclr = rng.uniform(0, 1, (N_T, H, S))
    return {"r": r, "w": w, "k": k, "v": v, "a": (-kk).astype(np.float32), "b": (kk * iclr).astype(np.float32)}


def _linear_attn_inputs(rng: np.random.Generator, gla: bool, S: int, H: int, gate_min: float) -> dict[str, np.ndarray]:
    q, k, v = rng.uniform(-1, 1, (3, N_T, H, S)).astype(np.float32)
    g = rng.uniform(gate_min, -1e-3, (N_T, H, S)).astype(np.float32)
    if gla:
        return {"q": q, "k": k, "v": v, "g": g}
    return {"r": q, "k": k, "v": v, "w": g, "u": rng.uniform(-1, 1, (H, S)).astype(np.float32)}


@pytest.mark.parametrize("gla", [False, True])
@pytest.mark.parametrize(
    ("name", "value"), [("q", np.nan), ("k", np.inf), ("v", np.nan), ("g", -np.inf), ("g", np.nan), ("g", np.inf)]
)
def test_linear_attn_places_non_finite_inputs_as_the_definition(gla: bool, name: str, value: float) -> None:
    """RWKV-6 / GLA: a NaN or Inf in a chunk past the first (chunks of 16)
    lands where the reference puts it; the chunks before it stay finite (a
    log decay of -Inf is a decay of 0: everything stays finite).
    A NaN or +Inf log decay is a NaN or +Inf decay (sc_exp lets both
    through, as exp does).  Left out, as the token loop (which such chunks
    run) differs there: an infinite v (RWKV-6 adds its bonus as
    (sum_i r u k) v, an Inf where ggml's per-key sum of Infs of both signs is
    NaN)."""
    S, H = 16, 2
    inputs = _linear_attn_inputs(np.random.default_rng(13), gla, S, H, -1.0)
    key = name if gla else {"q": "r", "g": "w"}.get(name, name)
    inputs[key][41, 1, 3] = value
    op = "gated_linear_attn" if gla else "rwkv_wkv6"
    (pool, o), (pool_ref, o_ref) = _both_devices(op, H * S * S, inputs, (N_T, H, S))
    assert_close("o", o, o_ref, 1e-7)
    assert_close("snapshots", pool, pool_ref, 1e-7)
    assert np.isfinite(o[:41]).all() and np.isfinite(o[41:]).all() == (value == -np.inf)


# -- precision ---------------------------------------------------------------------------


def _nmse(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return float(((g - w) ** 2).sum() / (w * w).sum())


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("gate_min", [-1.0, -12.0])
def test_delta_rule_chunked_rounding(kda: bool, gate_min: float) -> None:
    """Against the float64 reference the chunked form stays within what
    float32 rounding gives (measured about 1e-14 .. 1e-12 here): far inside
    the contract's 1e-7, which the chunked form needs no loosening of.  Steep
    gates (down to -12 per token) give KDA sub-blocks whose decay spans too
    much to factor, whose own pairs are then summed with exact decays."""
    S, H = 32, 2
    inputs = _delta_inputs(np.random.default_rng(10), kda, S, H)
    inputs["g"] = np.random.default_rng(11).uniform(gate_min, -1e-3, inputs["g"].shape).astype(np.float32)
    (pool, o), (pool_ref, o_ref) = _both_devices("gated_delta_net", H * S * S, inputs, (N_T, H, S))
    assert _nmse(o, o_ref) < 1e-10
    assert _nmse(pool, pool_ref) < 1e-10


def test_mamba2_chunked_rounding() -> None:
    H, G, P, N = 12, 3, 16, 32
    inputs = _scan_inputs(np.random.default_rng(12), H, G, P, N)
    (pool, y), (pool_ref, y_ref) = _both_devices("ssm_scan", H * P * N, inputs, (N_T, H, P))
    assert _nmse(y, y_ref) < 1e-10
    assert _nmse(pool, pool_ref) < 1e-10


@pytest.mark.parametrize("gla", [False, True])
@pytest.mark.parametrize("gate_min", [-1.0, -5.5, -12.0])
def test_linear_attn_chunked_rounding(gla: bool, gate_min: float) -> None:
    """RWKV-6 / GLA against the float64 reference, at head size 64 (the shape
    of the bench rows).  Gates down to -1 per token keep every chunk factored;
    down to -5.5, two of the twelve (chunk, head) pairs of 16 tokens span more
    than 60 in log decay and run the token loop between chunked ones; down to
    -12 all do."""
    S, H = 64, 2
    inputs = _linear_attn_inputs(np.random.default_rng(14), gla, S, H, gate_min)
    op = "gated_linear_attn" if gla else "rwkv_wkv6"
    (pool, o), (pool_ref, o_ref) = _both_devices(op, H * S * S, inputs, (N_T, H, S))
    assert _nmse(o, o_ref) < 1e-10
    assert _nmse(pool, pool_ref) < 1e-10


@pytest.mark.parametrize("decay_min", [-0.6065, -10.0, -20.0])
def test_rwkv7_chunked_rounding(decay_min: float) -> None:
    """RWKV-7 against the float64 reference at head size 64 (the bench's).
    Log decays down to -e^-0.5 per token (RWKV-7's own range) keep every chunk
    factored; down to -10, about one in eight of the (chunk, head) pairs of 8 tokens
    span more than 60 and run the token loop between chunked ones; down to -20
    all do."""
    S, H = 64, 2
    inputs = _rwkv7_inputs(np.random.default_rng(15), S, H, decay_min)
    (pool, o), (pool_ref, o_ref) = _both_devices("rwkv_wkv7", H * S * S, inputs, (N_T, H, S))
    assert _nmse(o, o_ref) < 1e-10
    assert _nmse(pool, pool_ref) < 1e-10


@pytest.mark.parametrize(
    ("name", "value"), [("r", np.nan), ("k", np.inf), ("v", np.nan), ("a", -np.inf), ("b", np.nan)]
)
def test_rwkv7_places_non_finite_inputs_as_the_definition(name: str, value: float) -> None:
    """A NaN or Inf in a chunk past the first: the chunks before it stay
    chunked (finite), the rest runs token by token and NaN/Inf land where the
    reference puts them."""
    S, H = 16, 2
    inputs = _rwkv7_inputs(np.random.default_rng(16), S, H, -0.6065)
    inputs[name][41, 1, 3] = value
    (pool, o), (pool_ref, o_ref) = _both_devices("rwkv_wkv7", H * S * S, inputs, (N_T, H, S))
    assert_close("o", o, o_ref, 1e-7)
    assert_close("snapshots", pool, pool_ref, 1e-7)
    assert np.isfinite(o[:41]).all() and not np.isfinite(o[41:]).all()


@st.composite
def rwkv7_varlen_calls(draw: st.DrawFn) -> dict:  # type: ignore[type-arg]
    """A packed RWKV-7 prefill: 1-3 sequences of 0-70 tokens (one of at least
    9, so chunks of 8 and a remainder), head sizes the chunked form takes
    (multiples of 8), snapshot columns anywhere (chunks end at each one), some
    columns without a row, and log decays from RWKV-7's range to steep ones
    (chunks that span too much run the token loop between chunked ones)."""
    lengths = [draw(st.integers(9, 70)), *draw(st.lists(st.integers(0, 70), max_size=2))]
    draw(st.randoms(use_true_random=False)).shuffle(lengths)
    return {
        "lengths": lengths,
        "S": draw(st.sampled_from((8, 16, 24, 32, 64))),
        "H": draw(st.integers(1, 3)),
        "n_cols": draw(st.integers(1, 40)),
        "decay_min": draw(st.sampled_from((-0.6065, -3.0, -10.0))),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=max(EXAMPLES, 20), deadline=None)
@given(p=rwkv7_varlen_calls())
def test_rwkv7_chunked_matches_the_sequential_definition(p: dict) -> None:  # type: ignore[type-arg]
    """Chunked vs sequential: the C prefill (the chunked WY form, chunk
    boundaries at every snapshot position and every 8 tokens between) against
    the float64 reference, which runs the definition token by token, on random
    shapes, varlen packed sequences and snapshot planes.  Outputs and every
    pool row (each snapshot plane is the state the recurrence passes through at
    its position; rows no column addresses stay as they were) within the
    chunked forms' NMSE of 1e-10."""
    rng = np.random.default_rng(p["seed"])
    lengths, S, H, n_cols = p["lengths"], p["S"], p["H"], p["n_cols"]
    n_s, T = len(lengths), sum(lengths)
    r, k, v = rng.uniform(-1, 1, (3, T, H, S)).astype(np.float32)
    kk = rng.uniform(-1, 1, (T, H, S))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    w = rng.uniform(p["decay_min"], -1e-3, (T, H, S)).astype(np.float32)
    b = (kk * rng.uniform(0, 1, (T, H, S))).astype(np.float32)
    inputs = [r, w, k, v, (-kk).astype(np.float32), b]
    # rows 0..n_s-1 start states; every (sequence, column) its own row, or none
    table = (n_s + np.arange(n_s * n_cols)).reshape(n_s, n_cols)
    table[rng.uniform(size=table.shape) < 0.25] = -1
    table[np.arange(n_cols)[None, :] > np.asarray(lengths)[:, None]] = -1  # columns past a sequence's start
    pool0 = rng.uniform(-0.5, 0.5, (n_s * (n_cols + 1), H * S * S)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    results = []
    for dev in (cpu_device(), get_device("reference")):
        pool, o = dev.upload(pool0), dev.upload(np.zeros((T, H, S), np.float32))
        dev.rwkv_wkv7(
            pool, dev.indices(np.arange(n_s)), dev.indices(table), *(dev.upload(a) for a in inputs), o,
            cu_seqlens=dev.indices(cu), scale=0.5,
        )  # fmt: skip
        results.append((dev.download(pool), dev.download(o)))
    (pool, o), (pool_ref, o_ref) = results
    if T:
        assert _nmse(o, o_ref) < 1e-10
    assert _nmse(pool, pool_ref) < 1e-10
    written = np.zeros(len(pool0), bool)
    written[table[table >= 0]] = True
    np.testing.assert_array_equal(pool[~written], pool0[~written])
