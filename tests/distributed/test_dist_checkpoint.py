"""Tensor-parallel checkpoints in one process: scatter, restore per rank, gather back.

No torch needed: the collectives (gather_memory / scatter_memory) are these
functions plus one gather or scatter of bytes, run across processes in
test_dist_processes.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from dist_memories import M2, SPECS, build, garbage_memory, place
from dist_tp_model import decode
from hypothesis import given
from hypothesis import strategies as st

import statecache
from statecache.conformance import model as M
from statecache.distributed import gather_state, reshard, restore_shard, save_shard, scatter_state
from statecache.distributed.sections import RowBlock, Section, parse_section
from statecache.errors import ArgumentError, StateError
from statecache.factory import make_memory
from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec
from statecache.state_io import pack_sections, unpack_sections


def round_trip(spec, mem, world, seq, dev):
    blob = mem.state_write(seq)
    parts = scatter_state(blob, spec, world)
    assert len(parts) == world
    for rank, part in enumerate(parts):
        shard = build(spec.shard(rank, world), dev)
        restore_shard(shard, part, rank, world, seq)  # the shard's memory accepts its part
        assert save_shard(shard, rank, world, seq) == part  # and writes it back unchanged
    assert gather_state(parts, spec) == blob
    return blob, parts


@given(kind=st.sampled_from(sorted(SPECS)), world=st.sampled_from([1, 2]), seq=st.sampled_from([-1, 0, 1]),
       seed=st.integers(0, 1000))  # fmt: skip
def test_scatter_restore_save_gather_is_the_identity(kind, world, seq, seed):
    dev = statecache.get_device("reference")
    round_trip(SPECS[kind], garbage_memory(kind, dev, seed), world, seq, dev)


def test_a_checkpoint_of_two_ranks_restores_at_one_and_four(ref_device):
    # every field of this spec splits over 4 ranks
    spec = ModelSpec.build(3, recurrent={0: RecurrentLayerSpec.kda(n_head=4, head_dim=2, d_conv=2),
                                         1: RecurrentLayerSpec.rwkv6(n_embd=8, head_size=2)},
                           attention={2: AttentionLayerSpec(4, 2)})  # fmt: skip
    mem = build(spec, ref_device)
    mem.fill_garbage(5)
    place(mem, {1: [1, 2, 3], 0: [4]})
    blob, two = round_trip(spec, mem, 2, -1, ref_device)
    four = reshard(two, spec, 4)
    assert four == scatter_state(blob, spec, 4)
    assert reshard(four, spec, 2) == two
    one = build(spec, ref_device)
    restore_shard(one, reshard(two, spec, 1)[0], 0, 1)
    assert one.state_write() == blob
    for rank, part in enumerate(four):
        restore_shard(build(spec.shard(rank, 4), ref_device), part, rank, 4)
    with pytest.raises(ArgumentError) as err:
        scatter_state(blob, spec, 8)
    assert err.value.argument == "n_head"


def test_the_tiny_model_after_decoding(ref_device):
    spec = M.model_spec("f32")
    mem = make_memory(spec, ref_device, 2, n_ctx=48, n_pad=8)
    w = M.Weights.random(3, M.HYBRID_LAYERS)
    decode(mem, w, {0: [1, 2, 3, 4], 1: [5, 6]})
    decode(mem, w, {0: [7], 1: [8]})
    for seq in (-1, 1):
        _, parts = round_trip(spec, mem, 2, seq, ref_device)
        sections = unpack_sections(parts[0])[1]
        assert [t for t, _ in sections] == [b"SHRD", b"KVAT", b"RECR"]
        recr = parse_section(b"RECR", sections[2][1])
        assert recr.positions == ([4, 2] if seq < 0 else [2])  # last positions of sequences 0 and 1


def _edit_rows(part, tag, key, fn):
    flags, sections = unpack_sections(part)
    out = []
    for t, payload in sections:
        if t == tag:
            sec = parse_section(t, payload)
            edit = [isinstance(p, RowBlock) and p.key == key for p in sec.parts]
            parts = [RowBlock(p.key, p.field, p.type_code, fn(p.rows.copy())) if e else p
                     for p, e in zip(sec.parts, edit, strict=True)]  # fmt: skip
            payload = Section(t, parts, sec.positions).payload()
        out.append((t, bytes(payload)))
    return pack_sections(out, flags)


def test_what_gather_refuses(ref_device):
    spec = SPECS["recurrent"]
    mem = garbage_memory("recurrent", ref_device, 1)
    parts = scatter_state(mem.state_write(), spec, 2)
    with pytest.raises(StateError) as err:
        gather_state(parts[::-1], spec)  # ranks out of order
    assert err.value.field == "shard"
    place(mem, {2: [3]})  # a book one step ahead
    ahead = scatter_state(mem.state_write(), spec, 2)
    with pytest.raises(StateError, match="books diverged") as err:
        gather_state([parts[0], ahead[1]], spec)
    assert err.value.field == "recurrent.metadata"

    def flip(rows):
        rows[0, 0] ^= 1
        return rows

    bad = _edit_rows(parts[1], b"RECR", ("recr", 1, "r"), flip)  # the RWKV token shift is replicated
    with pytest.raises(StateError, match="replicated") as err:
        gather_state([parts[0], bad], spec)
    assert err.value.field == "recurrent.layer[1].r.rows"
    wider = RecurrentLayerSpec.rwkv7(n_embd=8, head_size=2)
    other = MemorySpec.build(4, {0: M2, 1: wider, 3: SPECS["recurrent"].layers[3]})
    with pytest.raises(StateError) as err:
        gather_state(parts, other)
    assert err.value.field == "recurrent.layer[1].r.row_bytes"  # the token shift of 8 channels, not 4
    with pytest.raises(StateError) as err:
        gather_state([parts[0], parts[1][:-5]], spec)
    assert "length" in err.value.field or "rows" in err.value.field


def test_a_part_restores_only_into_its_own_rank(ref_device):
    spec = SPECS["hybrid_idx"]
    parts = scatter_state(garbage_memory("hybrid_idx", ref_device, 2).state_write(), spec, 2)
    shard = build(spec.shard(0, 2), ref_device)
    place(shard, {1: [4, 4]})
    before = shard.state_write()
    with pytest.raises(StateError) as err:
        restore_shard(shard, parts[1], 0, 2)  # same sizes, other heads
    assert err.value.field == "shard"
    assert shard.state_write() == before
    np.testing.assert_equal(shard.seq_pos_max(1), 1)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_checkpoints_with_planes_roll_back_after_a_scatter_gather_and_reshard(backend):
    """StateFlags.WITH_PLANES through the per-rank path: scatter to 2 ranks, restore and
    save each shard, gather (and reshard to 1): the unsharded memory restored from that
    rolls back into the last write exactly as the original."""
    from statecache.memory import StateFlags

    planes = StateFlags.WITH_PLANES
    spec = ModelSpec.build(3, recurrent={0: SPECS["hybrid_iswa"].recurrent.layers[0], 2: M2},
                           attention={1: AttentionLayerSpec(2, 4)}, kv_dtype="f16")  # fmt: skip
    dev = statecache.get_device(backend)

    def memory(local, seed):
        mem = make_memory(local, dev, 2, 3, n_ctx=16, n_ubatch=8)
        mem.fill_garbage(seed)
        return mem

    def written():
        mem = memory(spec, 1)
        place(mem, {0: [1, 2], 1: [3]})
        place(mem, {0: [4, 5, 6, 7]})  # the last write of sequence 0 arms three planes
        return mem

    original = written()
    parts = scatter_state(original.state_write(0, planes), spec, 2)
    shards = []
    for rank, part in enumerate(parts):
        shard = memory(spec.shard(rank, 2), 10 + rank)
        restore_shard(shard, part, rank, 2, 0)
        shards.append(save_shard(shard, rank, 2, 0, planes))
    assert shards == parts  # the planes survive each rank's restore and save
    for blob in (gather_state(shards, spec), reshard(shards, spec, 1)[0]):
        restored = memory(spec, 20)
        restore_shard(restored, blob, 0, 1, 0)
        twin = written()  # the original, rolled back itself
        for depth in (3, 2):
            p0 = original.seq_pos_max(0) + 1 - depth
            assert restored.seq_rm(0, p0, -1) and twin.seq_rm(0, p0, -1)
            assert restored.state_write(0) == twin.state_write(0)
            place(restored, {0: list(range(p0, p0 + depth))})
            place(twin, {0: list(range(p0, p0 + depth))})
    # a corrupt plane row in one rank's part is refused by that rank, which stays as it was
    bad = bytearray(parts[1])
    bad[-1] ^= 1
    shard = memory(spec.shard(1, 2), 30)
    before = shard.state_write(-1, planes)
    with pytest.raises(StateError):
        restore_shard(shard, bytes(bad), 1, 2, 0)
    assert shard.state_write(-1, planes) == before
