"""Checkpoints that carry the snapshot planes (``StateFlags.WITH_PLANES``).

The state format holds each cell's live state; with ``WITH_PLANES`` the
recurrent section also carries the planes still valid behind it, so a memory
restored from the blob rolls back exactly as the original could.  The oracle
is the original memory itself: after the same ``seq_rm`` into its last write,
both must accept or refuse alike and then hold the same state.  The rows hold
garbage (every plane a different one), so restoring a wrong plane shows.
(Here rather than in tests/ for the shared helpers; the per-rank path is in
test_dist_checkpoint.py.)
"""

from __future__ import annotations

import struct
import zlib

import pytest
from dist_memories import place
from hypothesis import example, given, settings
from hypothesis import strategies as st

import statecache
from statecache import state_io
from statecache.errors import StateError
from statecache.factory import make_memory
from statecache.memory import StateFlags
from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec

GDN = RecurrentLayerSpec.gdn(n_head=4, head_dim=2, d_conv=3, n_head_k=2)
M2 = RecurrentLayerSpec.mamba2(d_inner=8, d_state=2, d_conv=3, n_group=2, head_dim=2)
SPECS = {
    "hybrid": ModelSpec.build(3, recurrent={0: GDN, 2: M2}, attention={1: AttentionLayerSpec(2, 4)}, kv_dtype="f16"),
    "recurrent": MemorySpec.build(2, {0: M2, 1: GDN}),
}
PLANES = StateFlags.WITH_PLANES


def build(kind, backend, n_seq_max, n_rs_seq, seed):
    dev = statecache.get_device(backend)
    spec = SPECS[kind]
    if isinstance(spec, MemorySpec):
        mem = make_memory(spec, dev, n_seq_max, n_rs_seq)
        for k, pools in enumerate(mem.pools.values()):  # every plane row a different garbage
            for j, buf in enumerate(pools.values()):
                dev.fill_bytes(buf, seed + 10 * k + j)
    else:
        mem = make_memory(spec, dev, n_seq_max, n_rs_seq, n_ctx=32, n_ubatch=8)
        mem.fill_garbage(seed)
    return mem


def written(kind, backend, k, steps, seed):
    """Sequence 1 after ``steps`` multi-token writes; sequence 0 holds something else."""
    mem = build(kind, backend, 2, k, seed)
    place(mem, {0: [5, 5]})
    pos = 0
    for n in steps:
        place(mem, {1: list(range(pos, pos + n))})
        pos += n
    return mem


@settings(max_examples=12)
@given(
    kind=st.sampled_from(sorted(SPECS)),
    backend=st.sampled_from(["reference", "cpu"]),
    k=st.integers(1, 4),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    depth=st.integers(1, 5),
    seq=st.sampled_from([1, -1]),
    seed=st.integers(0, 100),
)
@example(kind="hybrid", backend="cpu", k=3, steps=[2, 5], depth=3, seq=1, seed=1)
@example(kind="recurrent", backend="reference", k=4, steps=[6], depth=4, seq=-1, seed=2)
def test_a_restored_memory_rolls_back_as_the_original(kind, backend, k, steps, depth, seq, seed):
    original = written(kind, backend, k, steps, seed)
    blob = original.state_write(seq, PLANES)
    restored = build(kind, backend, 2, k, seed + 7)
    place(restored, {1: [9]})  # the destination held a state of its own
    restored.state_read(blob, seq)
    assert restored.state_write(seq) == original.state_write(seq)
    p0 = original.seq_pos_max(1) + 1 - depth
    ok = original.seq_rm(1, p0, -1)
    assert restored.seq_rm(1, p0, -1) == ok
    assert ok == (p0 <= 0 or depth <= min(k, steps[-1]))  # the last write armed that many planes
    assert restored.state_write(seq) == original.state_write(seq)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_without_the_flag_the_bytes_are_the_format_and_no_rollback_survives(backend):
    original = written("hybrid", backend, 3, [4], seed=3)
    plain, with_planes = original.state_write(1), original.state_write(1, PLANES)
    flags, sections = state_io.unpack_sections(plain)
    assert flags == 0 and [t for t, _ in sections] == [b"KVAT", b"RECR"]
    _, sections_p = state_io.unpack_sections(with_planes)
    assert sections_p[0] == sections[0]  # only the recurrent section grows: by its planes
    recr, recr_p = bytes(sections[1][1]), bytes(sections_p[1][1])
    assert recr_p.startswith(recr) and len(recr_p) > len(recr)
    restored = build("hybrid", backend, 2, 3, seed=4)
    restored.state_read(plain, 1)
    assert not restored.seq_rm(1, original.seq_pos_max(1), -1)  # the format alone: no planes


def test_a_reader_without_planes_refuses_the_flag_by_name(monkeypatch):
    """What a reader of this format older than WITH_PLANES does with such a blob."""
    original = written("recurrent", "cpu", 2, [3], seed=5)
    blob = original.state_write(1, PLANES)
    reader = build("recurrent", "cpu", 2, 2, seed=6)
    before = reader.state_write()
    monkeypatch.setattr(state_io, "KNOWN_FLAGS", 0b11)
    with pytest.raises(StateError) as err:
        reader.state_read(blob, 1)
    assert err.value.field == "flags" and "0x4" in str(err.value)
    monkeypatch.undo()
    assert reader.state_write() == before


def _recr_payload_offset(blob):
    """Offset of the recurrent section's payload and its length, and the CRC word's offset."""
    off = 12
    for _ in range(struct.unpack_from("<I", blob, 8)[0]):
        tag, length, _ = struct.unpack_from("<4sQI", blob, off)
        if tag == b"RECR":
            return off + 16, length, off + 12
        off += 16 + length
    raise AssertionError("no RECR section")


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("damage", ["plane_row", "count_rechecksummed", "truncated_rechecksummed"])
def test_a_corrupt_planes_section_is_refused_and_changes_nothing(kind, damage):
    original = written(kind, "cpu", 3, [4], seed=8)
    blob = bytearray(original.state_write(1, PLANES))
    start, length, crc_at = _recr_payload_offset(blob)
    plain_len = len(state_io.unpack_sections(original.state_write(1))[1][-1][1])
    assert length > plain_len  # the planes: a u32 count, then rows
    if damage == "plane_row":  # caught by the section's checksum
        blob[start + length - 1] ^= 0x40
        field = "crc32"
    else:  # a forger who fixes the checksum: the structure is checked too
        if damage == "count_rechecksummed":
            struct.pack_into("<I", blob, start + plain_len, 0xFFFF_FFF0)  # more planes than any memory keeps
        else:
            del blob[start + length - 3 : start + length]
            struct.pack_into("<Q", blob, crc_at - 8, length - 3)
            length -= 3
        struct.pack_into("<I", blob, crc_at, zlib.crc32(bytes(blob[start : start + length])))
        field = "planes" if damage == "truncated_rechecksummed" else "n_planes"
    reader = build(kind, "cpu", 2, 3, seed=9)
    place(reader, {1: [2, 2], 0: [1]})
    before = reader.state_write(-1, PLANES)
    with pytest.raises(StateError) as err:
        reader.state_read(bytes(blob), 1)
    assert field in err.value.field, (err.value.field, str(err.value))
    assert reader.state_write(-1, PLANES) == before
