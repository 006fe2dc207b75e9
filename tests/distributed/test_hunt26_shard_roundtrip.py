"""Tensor-parallel sharding of random specs (hunt26).

For a random model (every recurrent family with random head counts and
sizes, attention layers, a recurrent-only or hybrid memory) and two world
sizes the model's counts divide: scattering a memory's blob over the ranks,
restoring each part into that rank's memory and saving it back, then
gathering, gives the blob back bitwise; resharding ``world -> other ->
world`` gives the parts back; each rank's part holds exactly the elements
``shard_index`` names.  A world that does not divide some count is refused
by ``shard`` and ``scatter_state`` alike, naming the field.
"""

from __future__ import annotations

import math

import pytest
from dist_memories import build, place
from hypothesis import given
from hypothesis import strategies as st

import statecache
from statecache.distributed import gather_state, reshard, restore_shard, save_shard, scatter_state
from statecache.errors import ArgumentError
from statecache.memory import StateFlags
from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec

DEV = statecache.get_device("reference")
FAMILIES = ("mamba1", "mamba2", "gdn", "kda", "rwkv6", "rwkv7", "gla", "shortconv")


def layer(draw, family: str, m: int) -> RecurrentLayerSpec:  # type: ignore[no-untyped-def]
    """A layer of ``family`` whose split counts are multiples of ``m``."""
    a = draw(st.integers(1, 2))
    small = st.integers(1, 2)
    d_conv = draw(st.integers(2, 4))
    if family == "mamba1":
        return RecurrentLayerSpec.mamba1(d_inner=m * a, d_state=draw(small), d_conv=d_conv)
    if family == "mamba2":
        G, P = m * a, draw(small)
        return RecurrentLayerSpec.mamba2(
            d_inner=G * draw(small) * P, d_state=draw(small), d_conv=d_conv, n_group=G, head_dim=P
        )
    if family == "gdn":
        hk = m * a
        return RecurrentLayerSpec.gdn(n_head=hk * draw(small), head_dim=draw(small), d_conv=d_conv, n_head_k=hk)
    if family == "kda":
        return RecurrentLayerSpec.kda(n_head=m * a, head_dim=draw(small), d_conv=d_conv)
    if family in ("rwkv6", "rwkv7"):
        hs = draw(small)
        return getattr(RecurrentLayerSpec, family)(n_embd=m * a * hs, head_size=hs)
    if family == "gla":
        return RecurrentLayerSpec.gla(n_head=m * a, head_dim=draw(small))
    return RecurrentLayerSpec.shortconv(n_embd=m * a, l_cache=d_conv)


@st.composite
def models(draw):  # type: ignore[no-untyped-def]
    world = draw(st.sampled_from([2, 3, 4]))
    other = draw(st.sampled_from([1, 2, 3, 4]))
    m = math.lcm(world, other)
    fams = draw(st.lists(st.sampled_from(FAMILIES), min_size=1, max_size=3))
    n_attn = draw(st.integers(0, 2))
    n_layer = len(fams) + n_attn
    rec = {i: layer(draw, f, m) for i, f in enumerate(fams)}
    if n_attn == 0 and draw(st.booleans()):
        spec: MemorySpec | ModelSpec = MemorySpec.build(n_layer, rec)
    else:
        heads = [m * draw(st.integers(1, 2)) for _ in range(n_attn)]
        attn = {len(fams) + j: AttentionLayerSpec(h, draw(st.integers(1, 3))) for j, h in enumerate(heads)}
        spec = ModelSpec.build(n_layer, recurrent=rec, attention=attn, kv_dtype=draw(st.sampled_from(["f16", "f32"])))
    return spec, world, other


@given(models(), st.sampled_from([-1, 0, 1]), st.booleans(), st.integers(0, 1000))
def test_scatter_restore_save_gather_and_reshard_are_exact(model, seq, planes, seed) -> None:  # type: ignore[no-untyped-def]
    spec, world, other = model
    n_rs = 2 if planes else 0
    flags = StateFlags.WITH_PLANES if planes else StateFlags.NONE
    mem = build_with(spec, n_rs)
    mem.fill_garbage(seed) if hasattr(mem, "fill_garbage") else _garble(mem, seed)
    place(mem, {0: [1, 2, 3, 4], 2: [5, 6]})
    place(mem, {0: [7], 1: [8, 9]})
    blob = mem.state_write(seq, flags)
    parts = scatter_state(blob, spec, world)
    assert len(parts) == world
    for rank, part in enumerate(parts):
        shard = build_with(spec.shard(rank, world), n_rs)
        restore_shard(shard, part, rank, world, seq, flags)
        assert save_shard(shard, rank, world, seq, flags) == part
    assert gather_state(parts, spec) == blob
    there = reshard(parts, spec, other)
    assert there == scatter_state(blob, spec, other)
    assert reshard(there, spec, world) == parts


def build_with(spec, n_rs):  # type: ignore[no-untyped-def]
    if n_rs == 0:
        return build(spec, DEV)
    from statecache.factory import make_memory

    if isinstance(spec, MemorySpec):
        return make_memory(spec, DEV, 3, n_rs)
    return make_memory(spec, DEV, 3, n_rs, n_ctx=16, n_ubatch=8, n_pad=8)


def _garble(mem, seed: int) -> None:  # type: ignore[no-untyped-def]
    for k, pools in enumerate(mem.pools.values()):
        for j, buf in enumerate(pools.values()):
            DEV.fill_bytes(buf, seed + 10 * k + j)


ONE = {  # one of everything that splits: only world 1 divides it
    "mamba1": RecurrentLayerSpec.mamba1(d_inner=1, d_state=2, d_conv=3),
    "mamba2": RecurrentLayerSpec.mamba2(d_inner=4, d_state=2, d_conv=3, n_group=1, head_dim=2),
    "gdn": RecurrentLayerSpec.gdn(n_head=2, head_dim=2, d_conv=3, n_head_k=1),
    "kda": RecurrentLayerSpec.kda(n_head=1, head_dim=2, d_conv=3),
    "rwkv6": RecurrentLayerSpec.rwkv6(n_embd=2, head_size=2),
    "rwkv7": RecurrentLayerSpec.rwkv7(n_embd=2, head_size=2),
    "gla": RecurrentLayerSpec.gla(n_head=1, head_dim=2),
    "shortconv": RecurrentLayerSpec.shortconv(n_embd=1, l_cache=3),
}


@given(st.sampled_from(FAMILIES), st.sampled_from([2, 3, 4]), st.booleans())
def test_a_world_that_does_not_divide_is_refused_by_shard_and_scatter(family, world, attention) -> None:  # type: ignore[no-untyped-def]
    if attention:  # the recurrent layer divides; the attention layer's single K/V head does not
        rec = layer(lambda s: 2, family, world)
        spec: MemorySpec | ModelSpec = ModelSpec.build(2, recurrent={0: rec}, attention={1: AttentionLayerSpec(1, 2)})
    else:
        spec = MemorySpec.build(1, {0: ONE[family]})
    for rank in range(world):
        with pytest.raises(ArgumentError):
            spec.shard(rank, world)
    mem = build(spec, DEV)
    place(mem, {0: [1, 2]})
    with pytest.raises(ArgumentError):
        scatter_state(mem.state_write(), spec, world)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ONE["mamba2"].shard(0.5, 1), "rank"),  # once accepted: fractional element maps
        (lambda: MemorySpec.build(1, {0: ONE["gla"]}).shard(0, 1.0), "world"),
        (lambda: ONE["kda"].shard(True, 2), "rank"),
        (lambda: AttentionLayerSpec(2, 4).shard(0.5, 2), "rank"),
        (lambda: AttentionLayerSpec(2.5, 4), "attention"),  # once accepted
        (lambda: RecurrentLayerSpec.mamba2(d_inner=8.5, d_state=2, d_conv=3, n_group=1, head_dim=2), "d_inner"),
        (lambda: RecurrentLayerSpec.gla(n_head=2, head_dim=2.0), "head_dim"),
    ],
)
def test_fractional_sizes_ranks_and_worlds_are_refused_naming_them(call, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArgumentError) as e:
        call()
    assert e.value.argument == name


@pytest.mark.parametrize(
    ("rank", "world", "name"), [(5, 2, "rank"), (0.5, 2, "rank"), (0, 0, "world"), (-1, 2, "rank")]
)
def test_save_shard_refuses_a_rank_outside_its_world(rank, world, name: str) -> None:  # type: ignore[no-untyped-def]
    """Once a blob was marked "rank 5 of 2" (or struct failed on 0.5) and restored nowhere."""
    mem = build(MemorySpec.build(1, {0: ONE["gla"]}), DEV)
    place(mem, {0: [1, 2]})
    with pytest.raises(ArgumentError) as e:
        save_shard(mem, rank, world)
    assert e.value.argument == name
