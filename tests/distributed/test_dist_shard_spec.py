"""Sharded specs: whole heads per rank, groups with their heads, refusals that name the field.

The element maps are checked three ways: they partition every row (property);
they equal what the model's semantics say for small cases worked out by hand;
and running a primitive on a rank's rows with that rank's heads gives exactly
the rank's part of the unsharded result (the row layouts the maps assume are
the primitives' layouts).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecache.errors import ArgumentError
from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec


def _elements(channels, window):
    return [c * window + w for c in channels for w in range(window)]


@st.composite
def layer_and_world(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    m = draw(st.integers(1, 2))  # multiples of the world size
    fam = draw(st.sampled_from(["mamba1", "mamba2", "gdn", "kda", "rwkv6", "rwkv7", "shortconv", "gla"]))
    d_conv = draw(st.integers(2, 4))
    if fam == "mamba1":
        spec = RecurrentLayerSpec.mamba1(d_inner=world * m * 2, d_state=draw(st.integers(1, 4)), d_conv=d_conv)
    elif fam == "mamba2":
        g = world * draw(st.integers(1, 2))
        hd = draw(st.integers(1, 3))
        spec = RecurrentLayerSpec.mamba2(d_inner=g * m * hd, d_state=draw(st.integers(1, 3)), d_conv=d_conv,
                                         n_group=g, head_dim=hd)  # fmt: skip
    elif fam == "gdn":
        hk = world * draw(st.integers(1, 2))
        spec = RecurrentLayerSpec.gdn(n_head=hk * m, head_dim=draw(st.integers(1, 3)), d_conv=d_conv, n_head_k=hk)
    elif fam == "kda":
        spec = RecurrentLayerSpec.kda(n_head=world * m, head_dim=draw(st.integers(1, 3)), d_conv=d_conv)
    elif fam == "shortconv":
        spec = RecurrentLayerSpec.shortconv(n_embd=world * m * 3, l_cache=d_conv)
    elif fam == "gla":
        spec = RecurrentLayerSpec.gla(n_head=world * m, head_dim=draw(st.integers(1, 3)))
    else:
        hs = draw(st.integers(1, 3))
        make = RecurrentLayerSpec.rwkv6 if fam == "rwkv6" else RecurrentLayerSpec.rwkv7
        spec = make(n_embd=world * m * hs, head_size=hs)
    return spec, world


@given(layer_and_world())
def test_shards_partition_every_row(case):
    spec, world = case
    counts = {t.name: np.zeros(t.row_size, dtype=np.int64) for t in spec.tensors}
    for rank in range(world):
        local = spec.shard(rank, world)
        index = spec.shard_index(rank, world)
        assert local.family == spec.family and local.row_sizes == {k: v.size for k, v in index.items()}
        for name, idx in index.items():
            counts[name][idx] += 1
    for name, c in counts.items():
        replicated = spec.family.startswith("rwkv") and name == "r"  # the token shift: the layer input
        assert (c == (world if replicated else 1)).all(), (name, c)
    if world == 1:
        assert spec.shard(0, 1) == spec


def test_worked_examples():
    # GDN, 4 value heads over 2 key heads (value head h reads key head h % 2), head size 2, window 1
    gdn = RecurrentLayerSpec.gdn(n_head=4, head_dim=2, d_conv=2, n_head_k=2)
    local = gdn.shard(0, 2)
    assert (local.params["n_head"], local.params["n_head_k"], local.params["channels"]) == (2, 1, 8)
    assert local.row_sizes == {"r": 8, "s": 8} and (local.params["tp_rank"], local.params["tp_world"]) == (0, 2)
    idx = gdn.shard_index(0, 2)
    # channels: q heads 0..1 -> 0..3, k heads -> 4..7, v heads 0..3 -> 8..15; rank 0: key head 0, value heads 0, 2
    assert idx["r"].tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    assert idx["s"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]  # value heads 0 and 2, 4 elements each
    # Mamba-2: 4 heads of 2, 2 groups of state 2, window 2; rank 1: heads 2, 3 and group 1
    m2 = RecurrentLayerSpec.mamba2(d_inner=8, d_state=2, d_conv=3, n_group=2, head_dim=2)
    idx = m2.shard_index(1, 2)
    channels = [4, 5, 6, 7, 10, 11, 14, 15]  # x of heads 2, 3; B of group 1 (8 + 2..3); C of group 1 (12 + 2..3)
    assert idx["r"].tolist() == _elements(channels, 2)
    assert idx["s"].tolist() == list(range(8, 16))
    # attention: 4 K/V heads of 3 split in 2
    att = AttentionLayerSpec(4, 3, 5)
    assert att.shard(1, 2) == AttentionLayerSpec(2, 3, 5)
    assert att.shard_index(1, 2)["k"].tolist() == list(range(6, 12))
    assert att.shard_index(1, 2)["v"].tolist() == list(range(10, 20))


@pytest.mark.parametrize(
    ("spec", "world", "field", "where"),
    [
        (MemorySpec.build(2, {1: RecurrentLayerSpec.mamba2(d_inner=8, d_state=2, d_conv=3, n_group=2, head_dim=2)}),
         4, "n_group", "layer 1"),
        (MemorySpec.build(1, {0: RecurrentLayerSpec.gdn(n_head=4, head_dim=2, d_conv=2, n_head_k=2)}), 4, "n_head_k",
         "layer 0"),
        (MemorySpec.build(1, {0: RecurrentLayerSpec.gdn(n_head=3, head_dim=2, d_conv=2, n_head_k=2)}), 1, None, None),
        (MemorySpec.build(1, {0: RecurrentLayerSpec.gdn(n_head=3, head_dim=2, d_conv=2, n_head_k=2)}), 2, "n_head", ""),
        (MemorySpec.build(1, {0: RecurrentLayerSpec.shortconv(n_embd=6, l_cache=3)}), 4, "channels", "6 channels"),
        (MemorySpec.build(1, {0: RecurrentLayerSpec.rwkv6(n_embd=6, head_size=2)}), 2, "n_head", "3 heads"),
        (ModelSpec.build(2, recurrent={0: RecurrentLayerSpec.kda(n_head=4, head_dim=2, d_conv=2)},
                         attention={1: AttentionLayerSpec(2, 4)}), 4, "n_head_kv", "layer 1"),
    ],
)  # fmt: skip
def test_a_split_that_does_not_divide_is_refused_naming_the_field(spec, world, field, where):
    if field is None:
        assert spec.shard(0, world) == spec
        return
    with pytest.raises(ArgumentError) as err:
        spec.shard(0, world)
    assert err.value.argument == field and where in str(err.value)


def test_bad_ranks_and_double_sharding_are_refused():
    layer = RecurrentLayerSpec.kda(n_head=4, head_dim=2, d_conv=2)
    for rank, world, field in ((2, 2, "rank"), (-1, 2, "rank"), (0, 0, "world")):
        with pytest.raises(ArgumentError) as err:
            layer.shard(rank, world)
        assert err.value.argument == field
    with pytest.raises(ArgumentError, match="already rank 1 of 2"):
        layer.shard(1, 2).shard(0, 2)


# -- the maps agree with the primitives' row layouts ------------------------------------------


def _run(dev, family, spec, rows, heads, groups, rng_inputs):
    """One primitive step of ``family`` on ``rows`` (one sequence); inputs restricted to
    ``heads`` (and ``groups``); returns the new rows per tensor."""
    p = spec.params
    pools = {name: dev.upload(r[None].astype(np.float32)) for name, r in rows.items()}
    idx = dev.indices([0])
    x_conv = rng_inputs["conv_x"][..., rng_inputs["channels"]]
    w = rng_inputs["conv_w"][rng_inputs["channels"]]
    dev.ssm_conv(pools["r"], idx, idx, dev.upload(x_conv), dev.upload(w), dev.alloc(x_conv.shape))
    if family == "mamba1":
        A = rng_inputs["A"][heads]
        dev.ssm_scan(pools["s"], idx, idx, *(dev.upload(np.ascontiguousarray(a)) for a in (
            rng_inputs["x"][:, :, heads], rng_inputs["dt"][:, :, heads], A, rng_inputs["B"], rng_inputs["C"])),
            dev.alloc((1, 2, len(heads), 1)))  # fmt: skip
    elif family == "kda":
        S = p["head_dim"]
        q, k, v = (rng_inputs[n][:, :, heads] for n in "qkv")
        g, beta = rng_inputs["g"][:, :, heads], rng_inputs["beta"][:, :, heads]
        dev.gated_delta_net(pools["s"], idx, idx, *(dev.upload(np.ascontiguousarray(a)) for a in (q, k, v, g, beta)),
                            dev.alloc((1, 2, len(heads), S)))  # fmt: skip
    return {name: dev.download(b)[0] for name, b in pools.items()}


@pytest.mark.parametrize("family", ["mamba1", "kda", "shortconv"])
def test_a_ranks_rows_step_like_its_part_of_the_full_rows(ref_device, rng, family):
    dev, world, n_t = ref_device, 2, 2
    if family == "mamba1":
        spec = RecurrentLayerSpec.mamba1(d_inner=4, d_state=3, d_conv=3)
        H, ch = 4, 4
    elif family == "kda":
        spec = RecurrentLayerSpec.kda(n_head=4, head_dim=2, d_conv=3)
        H, ch = 4, 24
    else:
        spec = RecurrentLayerSpec.shortconv(n_embd=6, l_cache=3)
        H, ch = 0, 6
    S = spec.params.get("head_dim", 1)
    f = np.float32
    inputs = {
        "conv_x": rng.normal(size=(1, n_t, ch)).astype(f),
        "conv_w": rng.normal(size=(ch, 3)).astype(f),
        "x": rng.normal(size=(1, n_t, H, 1)).astype(f),
        "dt": rng.normal(size=(1, n_t, H)).astype(f),
        "A": -rng.uniform(0.5, 1.0, (H, 3)).astype(f),
        "B": rng.normal(size=(1, n_t, 1, 3)).astype(f),
        "C": rng.normal(size=(1, n_t, 1, 3)).astype(f),
        "q": rng.normal(size=(1, n_t, H, S)).astype(f),
        "k": rng.normal(size=(1, n_t, H, S)).astype(f) / 2,
        "v": rng.normal(size=(1, n_t, H, S)).astype(f),
        "g": -rng.uniform(0.1, 0.5, (1, n_t, H, S)).astype(f),
        "beta": rng.uniform(0.2, 0.8, (1, n_t, H)).astype(f),
    }
    full_rows = {t.name: rng.normal(size=t.row_size).astype(f) for t in spec.tensors}
    full = _run(dev, family, spec, full_rows, list(range(H)), None, {**inputs, "channels": np.arange(ch)})
    for rank in range(world):
        index = spec.shard_index(rank, world)
        heads = list(range(rank * H // world, (rank + 1) * H // world))
        # the model's split: each rank convolves its heads' channels (q, k, v blocks for KDA)
        if family == "kda":
            channels = np.concatenate([b * 4 * S + np.arange(heads[0] * S, (heads[-1] + 1) * S) for b in range(3)])
        else:
            channels = np.arange(rank * ch // world, (rank + 1) * ch // world)
        local_rows = {name: full_rows[name][idx] for name, idx in index.items()}
        local = _run(dev, family, spec.shard(rank, world), local_rows, heads, None, {**inputs, "channels": channels})
        for name, idx in index.items():
            np.testing.assert_array_equal(local[name], full[name][idx], err_msg=f"{family}.{name} rank {rank}")
