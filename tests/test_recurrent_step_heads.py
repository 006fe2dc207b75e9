"""The recurrent step's delta call on a grouped-head (GQA-style) gated delta net
layer: q/k may carry the layer's key heads, or H_v heads a runtime repeated itself
(transformers' Qwen3-Next does); both give the same outputs and states.  Any other
head count is refused, naming q, and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError
from statecache.factory import make_memory
from statecache.memory import MemoryStatus
from statecache.spec import MemorySpec, RecurrentLayerSpec

DEV = statecache.get_device("reference")
HV, HK, S, D_CONV = 4, 2, 3, 2


def _stepped(q_heads: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """One prefill of two sequences through a fresh memory; returns (o, the state
    pool) with q/k given with ``q_heads`` heads (HK, or HV repeated as the head map reads them)."""
    spec = MemorySpec.build(1, {0: RecurrentLayerSpec.gdn(n_head=HV, head_dim=S, d_conv=D_CONV, n_head_k=HK)})
    mem = make_memory(spec, DEV, n_seq_max=2)
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [1, 2, 3], 1: [4, 5, 6]}, output_all=True), mem)
    ctx = mem.init_batch(balloc, 8)
    assert ctx.status is MemoryStatus.SUCCESS
    assert ctx.apply()
    ub = ctx.get_ubatch()
    n_s, n_t = ub.n_seqs, ub.n_seq_tokens
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 0.5, (n_s, n_t, HK, S)).astype(np.float32)
    k = rng.normal(0, 0.5, (n_s, n_t, HK, S)).astype(np.float32)
    v = rng.normal(0, 0.5, (n_s, n_t, HV, S)).astype(np.float32)
    g = -np.abs(rng.normal(0.3, 0.1, (n_s, n_t, HV))).astype(np.float32)
    beta = rng.uniform(0.2, 0.8, (n_s, n_t, HV)).astype(np.float32)
    if q_heads == HV:  # the step's head map is tiled: value head h reads key head h % HK
        q, k = np.tile(q, (1, 1, HV // HK, 1)), np.tile(k, (1, 1, HV // HK, 1))
    elif q_heads != HK:
        q, k = q[:, :, :1], k[:, :, :1]
    step = ctx.step()
    o = DEV.alloc((n_s, n_t, HV, S))
    before = {name: buf.numpy().copy() for name, buf in mem.pools[0].items()}
    try:
        step.delta(0, *(DEV.upload(a) for a in (q, k, v, g, beta)), o)
    except ArgumentError:
        assert all(np.array_equal(before[n], b.numpy()) for n, b in mem.pools[0].items())
        raise
    return o.numpy(), {name: buf.numpy() for name, buf in mem.pools[0].items()}


def test_repeated_key_heads_equal_the_grouped_layer() -> None:
    o_grouped, pools_grouped = _stepped(HK)
    o_repeated, pools_repeated = _stepped(HV)
    np.testing.assert_allclose(o_repeated, o_grouped, rtol=1e-6, atol=1e-7)
    for name in pools_grouped:
        np.testing.assert_allclose(pools_repeated[name], pools_grouped[name], rtol=1e-6, atol=1e-7)


def test_another_head_count_is_refused_naming_q() -> None:
    with pytest.raises(ArgumentError) as info:
        _stepped(1)
    assert info.value.argument == "q"
    assert "2 or 4" in str(info.value)
