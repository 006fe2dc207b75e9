"""The conv's multi-token rows with d_conv 4 and the SiLU (conv4_silu_rows in
ssm_conv.c, the path of every Mamba and GDN prefill): with and without a
bias, channel blocks of an even and an odd number of vectors, streamed and
stored outputs; against the reference, across thread counts, and bitwise
equal to decoding the same tokens one call at a time (both paths use the
same SiLU, so a prompt split anywhere gives the outputs of one call)."""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cases import Arg, against_reference, assert_bitwise, cpu_device, run

from statecache.dtypes import DType

# channels, tokens, sequences, bias: 3328 channels x 160 tokens x 2 moves
# 8.7 MB (outputs streamed, past the 4 MiB threshold); 3336 leaves a last
# block of one vector; 200 channels (25 vectors) an odd vector count per block.
SHAPES = [(3328, 160, 2, False), (3336, 7, 3, True), (200, 5, 2, True), (200, 9, 1, False)]


def _u(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def _args(rng: np.random.Generator, ch: int, n_t: int, n_s: int) -> dict[str, Arg]:
    return {
        "pool": Arg(_u(rng, (n_s + 1, ch * 3))),
        "start_rows": Arg(np.arange(n_s), DType.I32),  # in place, as a prefill from the live window
        "dst_rows": Arg(np.arange(n_s), DType.I32),
        "x": Arg(_u(rng, (n_s, n_t, ch), -6, 6)),  # both tails of the SiLU
        "weight": Arg(_u(rng, (ch, 4))),
        "bias": Arg(_u(rng, (ch,))),
        "y": Arg(_u(rng, (n_s, n_t, ch))),
    }


@pytest.mark.usefixtures("split_small_calls")
@pytest.mark.parametrize("ch,n_t,n_s,with_bias", SHAPES)
def test_silu_rows_match_the_reference_on_any_thread_count(
    monkeypatch: pytest.MonkeyPatch, ch: int, n_t: int, n_s: int, with_bias: bool
) -> None:
    args = _args(np.random.default_rng(ch + n_t), ch, n_t, n_s)

    def call(dev, pool, start_rows, dst_rows, x, weight, bias, y, **_):  # type: ignore[no-untyped-def]
        dev.ssm_conv(pool, start_rows, dst_rows, x, weight, y, bias=bias if with_bias else None, apply_silu=True)

    dev = cpu_device()
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("STATECACHE_NUM_THREADS", threads)
        results.append(run(dev, args, call)[0])
    for i, other in enumerate(results[1:], 2):
        for name in results[0]:
            assert_bitwise(f"{name}, {i} threads vs 1", other[name], results[0][name])
    against_reference(args, call, {"pool": np.arange(n_s), "y": None})


@pytest.mark.parametrize("with_bias", [False, True])
def test_prefill_outputs_are_those_of_token_by_token_decode(with_bias: bool) -> None:
    """Bitwise: the prefill rows and the decode path (d_conv 4 shuffles) apply
    the same taps, bias and SiLU in the same order."""
    ch, n_t, n_s = 200, 6, 2
    rng = np.random.default_rng(7)
    pool0, x = _u(rng, (n_s, ch * 3)), _u(rng, (n_s, n_t, ch), -6, 6)
    w, b = _u(rng, (ch, 4)), _u(rng, (ch,))
    dev = cpu_device()
    rows = dev.indices(np.arange(n_s))
    weight, bias = dev.upload(w), dev.upload(b) if with_bias else None

    pool = dev.upload(pool0)
    y = dev.alloc((n_s, n_t, ch))
    dev.ssm_conv(pool, rows, rows, dev.upload(x), weight, y, bias=bias, apply_silu=True)
    y_one, pool_one = dev.download(y), dev.download(pool)

    pool = dev.upload(pool0)
    steps = []
    for t in range(n_t):
        y_t = dev.alloc((n_s, 1, ch))
        dev.ssm_conv(pool, rows, rows, dev.upload(np.ascontiguousarray(x[:, t : t + 1])), weight, y_t, bias=bias,
                     apply_silu=True)  # fmt: skip
        steps.append(dev.download(y_t))
    assert_bitwise("outputs, decoded token by token vs one call", np.concatenate(steps, axis=1), y_one)
    assert_bitwise("window after the last token", dev.download(pool), pool_one)


@pytest.mark.parametrize("d_conv", [4, 3])
@pytest.mark.parametrize("n_t", [1, 5])
def test_silu_is_accurate_element_by_element_over_its_range(d_conv: int, n_t: int) -> None:
    """With the last tap 1 and the others 0 the conv's output is silu(x), in the
    decode shuffles (n_t 1, d_conv 4), the gathers (d_conv 3), the prefill
    rows and the scalar channel tail (203 channels).  Each element within
    1e-6 of x / (1 + exp(-x)) in float64, relative, over the range where that
    is a normal float; past it only a tiny value.  The conformance NMSE bound
    (1e-7) would let a SiLU off by 3e-4 everywhere pass."""
    ch, n_s = 203, 2
    rng = np.random.default_rng(d_conv * 10 + n_t)
    x = rng.uniform(-12, 12, (n_s, n_t, ch)).astype(np.float32)
    x.reshape(-1)[: 2 * ch] = np.linspace(-100, 100, 2 * ch, dtype=np.float32)  # the tails and the clamps
    w = np.zeros((ch, d_conv), np.float32)
    w[:, -1] = 1.0
    dev = cpu_device()
    rows = dev.indices(np.arange(n_s))
    pool = dev.upload(_u(rng, (n_s, ch * (d_conv - 1))))
    y = dev.alloc((n_s, n_t, ch))
    dev.ssm_conv(pool, rows, rows, dev.upload(x), dev.upload(w), y, apply_silu=True)
    got = dev.download(y).astype(np.float64)
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        want = x64 / (1.0 + np.exp(-x64))
    normal = x64 >= -85.0
    rel = np.abs(got - want)[normal] / np.abs(want[normal])
    worst = int(np.argmax(rel))
    assert rel[worst] <= 1e-6, f"silu({x64[normal][worst]!r}) = {got[normal][worst]!r}, want {want[normal][worst]!r}"
    assert np.all(np.abs(got[~normal]) <= 1e-33), "silu of x < -85 is not tiny"
