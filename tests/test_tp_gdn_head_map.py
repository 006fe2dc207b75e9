"""Tensor-parallel GDN shards follow the runtime's q/k head map.

A grouped runtime (transformers, flash-linear-attention, vLLM: value head h
reads key head h // (H_v / H_k)) splits value heads contiguously; a tiled one
(llama.cpp: h % H_k) gives each rank the value heads of its key heads.  For
both maps, every rank's ``gated_delta_net`` on its shard (the spec's shard of
the state row, its key heads' q/k, its value heads' v/g/beta) must compute
exactly the full call's outputs and state restricted to that shard: the step
of a rank is the unsharded step on fewer heads, which is what
:meth:`RecurrentLayerSpec.shard` promises.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statecache
from statecache.errors import ArgumentError
from statecache.hostmem import as_array
from statecache.spec import RecurrentLayerSpec

S = 4


def _call(dev, head_map, state, q, k, v, g, beta):  # type: ignore[no-untyped-def]
    pool = dev.upload(state[None].astype(np.float32))
    rows = dev.indices([0])
    o = dev.alloc((1, q.shape[1], v.shape[2], S))
    dev.gated_delta_net(
        pool, rows, rows, *(dev.upload(a.astype(np.float32)) for a in (q, k, v, g, beta)), o, head_map=head_map
    )
    return np.array(as_array(o)), np.array(as_array(pool))[0]


@settings(deadline=None, max_examples=30)
@given(
    head_map=st.sampled_from(["tiled", "grouped"]),
    hk_world=st.sampled_from([(2, 2), (4, 2), (4, 4), (2, 1)]),
    ratio=st.sampled_from([2, 3]),
    n_t=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_a_rank_steps_its_shard_as_the_full_layer_does(head_map, hk_world, ratio, n_t, seed) -> None:  # type: ignore[no-untyped-def]
    hk, world = hk_world
    hv = hk * ratio
    dev = statecache.get_device("reference")
    spec = RecurrentLayerSpec.gdn(n_head=hv, head_dim=S, d_conv=2, n_head_k=hk, head_map=head_map)
    rng = np.random.default_rng(seed)
    state = rng.standard_normal(spec.row_sizes["s"]) * 0.5
    q, k = rng.standard_normal((2, 1, n_t, hk, S)) * 0.5
    v = rng.standard_normal((1, n_t, hv, S))
    g = -rng.random((1, n_t, hv))
    beta = rng.random((1, n_t, hv))
    o_full, s_full = _call(dev, head_map, state, q, k, v, g, beta)
    # the map, written out here: which key head each value head reads
    reads = np.arange(hv) % hk if head_map == "tiled" else np.arange(hv) // ratio
    for rank in range(world):
        local = spec.shard(rank, world)
        index = spec.shard_index(rank, world)["s"]
        v_heads = index[:: S * S] // (S * S)
        k_heads = np.arange(rank * hk // world, (rank + 1) * hk // world)
        assert set(reads[v_heads]) <= set(k_heads), "a rank holds a value head whose key head it lacks"
        local_map = "grouped" if local.params.get("grouped_heads") else "tiled"
        o, s = _call(dev, local_map, state[index], q[:, :, k_heads], k[:, :, k_heads], v[:, :, v_heads],
                     g[:, :, v_heads], beta[:, :, v_heads])  # fmt: skip
        np.testing.assert_array_equal(o, o_full[:, :, v_heads])
        np.testing.assert_array_equal(s, s_full[index])


def test_grouped_split_is_contiguous_and_tiled_is_strided() -> None:
    grouped = RecurrentLayerSpec.gdn(n_head=8, head_dim=S, d_conv=2, n_head_k=2, head_map="grouped")
    tiled = RecurrentLayerSpec.gdn(n_head=8, head_dim=S, d_conv=2, n_head_k=2)
    heads = [spec.shard_index(1, 2)["s"][:: S * S] // (S * S) for spec in (grouped, tiled)]
    np.testing.assert_array_equal(heads[0], [4, 5, 6, 7])
    np.testing.assert_array_equal(heads[1], [1, 3, 5, 7])


def test_a_grouped_map_that_is_the_tiled_map_is_one_spec() -> None:
    for hk in (1, 4):
        assert RecurrentLayerSpec.gdn(n_head=4, head_dim=S, d_conv=2, n_head_k=hk, head_map="grouped") == (
            RecurrentLayerSpec.gdn(n_head=4, head_dim=S, d_conv=2, n_head_k=hk)
        )


def test_an_unknown_head_map_is_refused() -> None:
    with pytest.raises(ArgumentError, match="head_map"):
        RecurrentLayerSpec.gdn(n_head=4, head_dim=S, d_conv=2, n_head_k=2, head_map="interleaved")
