"""The C kernels of rwkv_wkv6, rwkv_wkv7 and gated_linear_attn beyond the
conformance cases: the same bits for any thread count (the thread split
lifted to every call, and as shipped), at the conformance sizes and at model
head sizes (64, 128: the AVX2 column and row tiles), and every path of the
kernels (f32 pools in place, other dtypes through the tile) against the
reference."""

from __future__ import annotations

import numpy as np
import pytest
from cpu_cases import assert_packed_call_thread_invariant, cpu_device

from statecache.conformance import linear_attn_cases as L
from statecache.conformance import varlen_cases as V
from statecache.conformance.cases import NMSE, compare_with_reference
from statecache.dtypes import DType

OPS = [*L.ops(), L.rwkv6_op(64, 3), L.rwkv7_op(64, 3), L.gla_op(128, 2), L.rwkv7_op(24, 2), L.gla_op(40, 2)]


@pytest.mark.usefixtures("split_small_calls")
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.label)
def test_packed_calls_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch, op: V.Op) -> None:
    assert_packed_call_thread_invariant(monkeypatch, op, (7, 0, 1, 5, 3))


@pytest.mark.parametrize("op", OPS[3:], ids=lambda op: op.label)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16, DType.BF16])
@pytest.mark.parametrize("mode", ["planes", "rotate", "shared"])
def test_model_head_sizes_against_the_reference(op: V.Op, dtype: DType, mode: str) -> None:
    """Column tiles of 32 (RWKV-6, GLA) and row tiles (RWKV-7) at head sizes 64 and
    128, odd widths (24, 40: a partial AVX2 tile), every pool dtype, starts in
    place, from other planes and shared."""
    dev = cpu_device()
    lengths = (3, 1, 0, 2) if mode != "rotate" else (1, 1, 1)
    params = V.VarlenParams(op, lengths, 3, mode, dtype)
    tensors, rows, _ = V.varlen_tensors(params, seed=3)
    call = V.varlen_call(params, rows)
    with np.errstate(all="ignore"):
        compare_with_reference(dev, tensors, 3, call, {"pool": NMSE[dtype], "out": NMSE[DType.F32]})
