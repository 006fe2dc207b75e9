"""The C kernels of rwkv_wkv6, rwkv_wkv7 and gated_linear_attn beyond the
conformance cases: the same bits for any thread count (the thread split
lifted to every call, and as shipped), at the conformance sizes and at model
head sizes (64, 128: the AVX2 column and row tiles; RWKV-7 at 96, row tiles
of 84 rows: groups of eight, then one of four), and every path of the
kernels (f32 pools in place, other dtypes through the tile) against the
reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from cpu_cases import assert_bitwise, assert_packed_call_thread_invariant, cpu_device

from statecache.conformance import linear_attn_cases as L
from statecache.conformance import varlen_cases as V
from statecache.conformance.cases import NMSE, compare_with_reference
from statecache.dtypes import DType

OPS = [
    *L.ops(),
    L.rwkv6_op(64, 3),
    L.rwkv7_op(64, 3),
    L.gla_op(128, 2),
    L.rwkv7_op(24, 2),
    L.gla_op(40, 2),
    L.rwkv7_op(96, 2),
]


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


@pytest.mark.parametrize("op", [L.rwkv6_op(64, 2), L.gla_op(64, 2), L.rwkv7_op(64, 2)], ids=lambda op: op.label)
def test_prefill_reads_element_strided_inputs_as_it_reads_contiguous_ones(op: V.Op) -> None:
    """The chunked prefill reads head rows whose elements are adjacent in place
    and packs the others (here every input has element stride 2): both give
    the same bits, through full chunks, the short chunks between snapshot
    stops and a poisoned chunk's token loop (a NaN log decay in sequence 1)."""
    from statecache.conformance.cases import Tensor, run_on
    from statecache.primitives import LINEAR_ATTN_INPUTS

    dev = cpu_device()
    params = V.VarlenParams(op, (40, 23, 1), 4, "planes")
    tensors, rows, _ = V.varlen_tensors(params, seed=5)
    decay = "g" if op.op == "gated_linear_attn" else "w"
    poisoned = np.array(tensors[decay].data)
    poisoned[40 + 9, 1, 0] = np.nan
    tensors[decay] = dataclasses.replace(tensors[decay], data=poisoned)
    call = V.varlen_call(params, rows)
    strided = dict(tensors)
    for name in LINEAR_ATTN_INPUTS[op.op]:
        values = np.asarray(tensors[name].data)
        base = np.full((*values.shape, 2), 3.0e3, np.float32)  # the odd elements: garbage the kernel must skip
        base[..., 0] = values
        T, H, S = values.shape
        strided[f"{name}_base"] = Tensor(base)
        strided[name] = Tensor(None, view=(f"{name}_base", (T, H, S), (2 * H * S, 2 * S, 2), 0))
    want, got = run_on(dev, tensors, 5, call), run_on(dev, strided, 5, call)
    for name in ("pool", "out"):
        assert_bitwise(name, got[name][1], want[name][1])


#: Decode-only calls (every sequence one token or none), where the kernels allocate
#: no tile and pack the token on the stack unless a state goes to no row or the pool
#: is not float32: RWKV-6 / RWKV-7 / GLA at model head sizes (RWKV-7 at both sizes its rows are
#: compiled for), and the gated delta rule.
DECODE_OPS = [L.rwkv6_op(64, 3), L.rwkv7_op(64, 3), L.rwkv7_op(128, 2), L.gla_op(128, 2), V.delta_op(False, 128, 2, 2)]


@pytest.mark.parametrize("op", DECODE_OPS, ids=lambda op: op.label)
@pytest.mark.parametrize("dtype", [DType.F32, DType.F16])
def test_decode_only_calls_with_states_written_nowhere(op: V.Op, dtype: DType) -> None:
    """A decode-only call whose sparse table leaves some sequence's column 0
    unwritten (its new state goes to no row, the input state to a snapshot)
    next to sequences that write it: every path of the decode units (in place,
    through the tile, dropped) against the reference."""
    dev = cpu_device()
    lengths = (1, 0, 1, 1, 1)
    seen_dropped = seen_written = False
    for seed in range(4):
        params = V.VarlenParams(op, lengths, 3, "sparse", dtype)
        tensors, rows, _ = V.varlen_tensors(params, seed=seed)
        col0 = np.asarray(rows.table)[:, 0][np.asarray(lengths) == 1]
        seen_dropped |= bool((col0 < 0).any())
        seen_written |= bool((col0 >= 0).any())
        call = V.varlen_call(params, rows)
        with np.errstate(all="ignore"):
            compare_with_reference(dev, tensors, seed, call, {"pool": NMSE[dtype], "out": NMSE[DType.F32]})
    assert seen_dropped and seen_written  # both kinds of decode unit ran


@pytest.mark.usefixtures("split_small_calls")
@pytest.mark.parametrize("op", DECODE_OPS, ids=lambda op: op.label)
def test_decode_only_calls_do_not_depend_on_the_thread_count(monkeypatch: pytest.MonkeyPatch, op: V.Op) -> None:
    assert_packed_call_thread_invariant(monkeypatch, op, (1, 0, 1, 1, 1), n_cols=3)
