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
