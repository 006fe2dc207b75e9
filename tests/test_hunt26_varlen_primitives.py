"""Packed (varlen) primitive calls over random shapes (hunt26).

The conformance cases ``*.packed_split`` and ``*.varlen`` fix their shapes
and lengths.  Here hypothesis draws the primitive (conv with or without
bias+SiLU, Mamba-1/2 scans with every epilogue, GDN tiled or grouped, KDA),
its sizes (odd channel counts, d_state 1 or 17, head sizes that are not
powers of two), sequence lengths (0, 1, lengths past a chunk), snapshot
columns, the rows mode (planes, sparse, rotate, shared starts), the pool and
activation dtypes, and holds every device to: one packed call == one call per
sequence, bitwise; cpu and opencl == the reference within the conformance
tolerances.  ``STATECACHE_HUNT26_VARLEN_EXAMPLES`` (default 25).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statecache
from statecache.conformance import varlen_cases as vc
from statecache.dtypes import DType

DEVICES = ["reference", "cpu", "opencl"]


def _device(name: str):  # type: ignore[no-untyped-def]
    try:
        return statecache.get_device(name)
    except Exception as exc:  # the backend is not built or not installed here
        pytest.skip(f"no {name} device: {exc}")


@st.composite
def ops(draw):  # type: ignore[no-untyped-def]
    kind = draw(st.sampled_from(["conv", "mamba2", "mamba1", "gdn", "kda", "mamba2_epilogues"]))
    small = st.sampled_from([1, 2, 3, 5, 8])
    if kind == "conv":
        return vc.conv_op(draw(st.integers(2, 5)), draw(st.integers(1, 37)), draw(st.booleans()))
    if kind == "mamba2":
        G = draw(st.sampled_from([1, 2, 3]))
        H = G * draw(st.integers(1, 3))
        return vc.scan_op("mamba2", draw(st.sampled_from([1, 3, 16, 17])), draw(small), H, G)
    if kind == "mamba1":
        return vc.scan_op("mamba1", draw(st.sampled_from([1, 4, 17])), 1, draw(st.integers(1, 33)), 1)
    if kind == "gdn":
        hk = draw(st.sampled_from([1, 2]))
        head_map = draw(st.sampled_from(["tiled", "grouped"]))
        return vc.delta_op(False, draw(st.sampled_from([2, 5, 8, 16])), hk * draw(st.integers(1, 3)), hk,
                           head_map=head_map)  # fmt: skip
    if kind == "kda":
        return vc.delta_op(True, draw(st.sampled_from([2, 5, 8])), 2, 2)
    return vc.scan_op("mamba2", 8, 4, 4, 2, D=draw(st.sampled_from(["h", "hp"])), z=True, dt_bias=True,
                      dt_limit=draw(st.sampled_from([None, (0.0, 0.5)])))  # fmt: skip


@st.composite
def params(draw):  # type: ignore[no-untyped-def]
    op = draw(ops())
    lengths = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 16, 17, 40]), min_size=1, max_size=5)))
    mode = draw(st.sampled_from(["planes", "sparse", "rotate", "shared"]))
    K = draw(st.integers(2 if mode == "rotate" else 1, 5))
    dtype = draw(st.sampled_from([DType.F32, DType.F32, DType.F16, DType.BF16]))
    act = draw(st.sampled_from([DType.F32, DType.F32, DType.F16, DType.BF16]))
    return op, lengths, K, mode, dtype, act


@settings(max_examples=int(os.environ.get("STATECACHE_HUNT26_VARLEN_EXAMPLES", "25")), deadline=None)
@given(params(), st.sampled_from(DEVICES))
def test_packed_equals_per_sequence_bitwise(p, name) -> None:  # type: ignore[no-untyped-def]
    op, lengths, K, mode, dtype, act = p
    vc.packed_split_case(vc.VarlenParams(op, lengths, K, mode, dtype, tag="packed_split", act=act)).run(_device(name))


@settings(max_examples=int(os.environ.get("STATECACHE_HUNT26_VARLEN_EXAMPLES", "25")), deadline=None)
@given(params(), st.sampled_from(["cpu", "opencl"]), st.integers(0, 1000))
def test_packed_call_matches_the_reference(p, name, seed) -> None:  # type: ignore[no-untyped-def]
    op, lengths, K, mode, dtype, act = p
    vp = vc.VarlenParams(op, lengths, K, mode, dtype, act=act)
    tensors, rows, _ = vc.varlen_tensors(vp, seed)
    tol = {"pool": vc.NMSE[dtype], "out": vc.NMSE[act]}
    vc.compare_with_reference(_device(name), tensors, seed, vc.varlen_call(vp, rows), tol)
