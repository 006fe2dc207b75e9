"""State save/restore: spec §10 items 36-42, corruptions, truncation and byte flips."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from recurrent_toy import Toy
from test_recurrent_book import Checked, assert_unchanged, data_snapshot

import statecache
from statecache import state_io
from statecache.errors import StateError
from statecache.memory import StateFlags
from statecache.recurrent import SECTION_TAG


@pytest.fixture(scope="module")
def dev():  # type: ignore[no-untyped-def]
    return statecache.get_device("reference")


def make(dev, n_seq: int = 3, n_rs_seq: int = 2, seed: int = 0) -> Checked:  # type: ignore[no-untyped-def]
    t = Checked(dev, n_seq, n_rs_seq, seed=seed)
    t.feed({0: [1, 2, 3, 4], 1: [5, 6, 7], 2: [8, 9]})
    return t


def adopt(dst: Checked, src: Checked, seqs) -> None:  # type: ignore[no-untyped-def]
    for s in seqs:
        dst.hist[s] = list(src.hist[s])


def test_item36_round_trip_per_sequence_and_whole(dev) -> None:  # type: ignore[no-untyped-def]
    a = make(dev)
    whole = a.mem.state_write()
    one = a.mem.state_write(1)
    b = Checked(dev, 3, 2, seed=5)  # garbage-filled destination
    b.mem.state_read(whole)
    adopt(b, a, (0, 1, 2))
    for s in range(3):
        b.check_state(s)
    b.feed({0: [1], 1: [2], 2: [3]})
    c = Checked(dev, 3, 2, seed=6)
    c.feed({1: [9, 9, 9, 9, 9]})
    c.mem.state_read(one, 1)
    adopt(c, a, (1,))
    c.check_state(1)
    c.feed({1: [4]})
    c.check_state(1)


def test_item37_pending_rollback_saved_from_its_plane(dev) -> None:  # type: ignore[no-untyped-def]
    a = make(dev)
    assert a.mem.seq_rm(0, 2, -1)
    a.hist[0] = a.hist[0][:2]
    blob = a.mem.state_write(0)
    for seed in (1, 2):  # fresh, and a "dirty" context with its own pending rollback
        b = Checked(dev, 3, 2, seed=seed)
        if seed == 2:
            b.feed({0: [7, 7, 7]})
            assert b.mem.seq_rm(0, 2, -1)
        b.mem.state_read(blob, 0)
        assert b.mem.pending_rollback(0) == 0
        adopt(b, a, (0,))
        b.check_state(0)
        b.feed({0: [5]})
        b.check_state(0)


def test_item38_partial_only_flag(dev) -> None:  # type: ignore[no-untyped-def]
    a = make(dev)
    blob = a.mem.state_write(-1, StateFlags.PARTIAL_ONLY)
    flags, sections = state_io.unpack_sections(blob)
    assert flags == StateFlags.PARTIAL_ONLY and [t for t, _ in sections] == [SECTION_TAG]
    b = Checked(dev, 3, 2, seed=3)
    b.mem.state_read(blob, -1, StateFlags.PARTIAL_ONLY)
    adopt(b, a, (0, 1, 2))
    b.check_state(2)


# -- corruptions (item 39, 40, 42) ----------------------------------------------------


def _payload(blob: bytes) -> bytes:
    return bytes(state_io.find_section(state_io.unpack_sections(blob)[1], SECTION_TAG))


def _rebuild(payload: bytes) -> bytes:
    return state_io.pack_sections([(SECTION_TAG, payload)])


def _layer_offset(payload: bytes, n_cells_meta: int) -> int:
    return n_cells_meta


def corrupt_cases(a: Checked) -> dict[str, tuple[bytes, int, str]]:
    """name -> (blob, seq, field substring)"""
    whole = a.mem.state_write()
    one = a.mem.state_write(1)
    pw, p1 = _payload(whole), _payload(one)
    # whole payload: cell_count, then per cell pos, n_seq_id, ids
    cases: dict[str, tuple[bytes, int, str]] = {}
    cases["truncated"] = (whole[:-7], -1, "length")
    cases["bad magic"] = (b"XXXX" + whole[4:], -1, "magic")
    cases["bad version"] = (whole[:4] + struct.pack("<H", 99) + whole[6:], -1, "version")
    cases["cell_count > size"] = (_rebuild(struct.pack("<I", 4) + pw[4:]), -1, "cell_count")
    # per-sequence entry: cell_count 1, pos, n_seq_id must be 0
    cases["per-seq n_seq_id != 0"] = (_rebuild(p1[:8] + struct.pack("<Ii", 1, 1) + p1[12:]), 1, "n_seq_id")
    cases["per-seq cell_count > 1"] = (_rebuild(struct.pack("<I", 2) + p1[4:12] + p1[4:]), 1, "cell_count")
    # whole: first cell's first id -> out of range; second cell's id -> duplicate of first's
    first_id_off = 4 + 4 + 4
    cases["seq id out of range"] = (
        _rebuild(pw[:first_id_off] + struct.pack("<i", 9) + pw[first_id_off + 4 :]),
        -1,
        "seq_id",
    )
    first = struct.unpack_from("<i", pw, first_id_off)[0]
    second_id_off = first_id_off + 4 + 8
    cases["duplicate tail"] = (
        _rebuild(pw[:second_id_off] + struct.pack("<i", first) + pw[second_id_off + 4 :]),
        -1,
        "duplicate",
    )
    meta_end = 4 + 3 * (4 + 4 + 4)
    cases["s_trans != 0"] = (_rebuild(pw[:meta_end] + struct.pack("<I", 1) + pw[meta_end + 4 :]), -1, "s_trans")
    cases["wrong layer count"] = (
        _rebuild(pw[: meta_end + 4] + struct.pack("<I", 4) + pw[meta_end + 8 :]),
        -1,
        "n_layer",
    )
    # first tensor of first layer: layer u32, n_tensors u32, name (u8 + bytes), type i32, row_bytes u64
    t0 = meta_end + 12 + 8 + 2
    cases["wrong type"] = (_rebuild(pw[:t0] + struct.pack("<i", 1) + pw[t0 + 4 :]), -1, "type")
    rb = struct.unpack_from("<Q", pw, t0 + 4)[0]
    cases["wrong row size"] = (_rebuild(pw[: t0 + 4] + struct.pack("<Q", rb + 4) + pw[t0 + 12 :]), -1, "row_bytes")
    cases["trailing bytes"] = (_rebuild(pw + b"\0"), -1, "length")
    return cases


@pytest.mark.parametrize(
    "name",
    [
        "truncated",
        "bad magic",
        "bad version",
        "cell_count > size",
        "per-seq n_seq_id != 0",
        "per-seq cell_count > 1",
        "seq id out of range",
        "duplicate tail",
        "s_trans != 0",
        "wrong layer count",
        "wrong type",
        "wrong row size",
        "trailing bytes",
    ],
)
def test_item39_40_42_corrupt_blob_rejected_and_nothing_changes(dev, name: str) -> None:  # type: ignore[no-untyped-def]
    a = make(dev)
    blob, seq, field = corrupt_cases(a)[name]
    b = make(dev, seed=4)
    b.feed({1: [3]})
    book, data = b.mem.book_snapshot(), data_snapshot(b)
    with pytest.raises(StateError) as ei:
        b.mem.state_read(blob, seq)
    assert field in str(ei.value), str(ei.value)
    assert ei.value.field
    assert_unchanged(b, book, data)
    b.feed({0: [1], 1: [2], 2: [3]})  # later decodes behave normally
    for s in range(3):
        b.check_state(s)


def test_item41_shared_cell_pending_rollback_is_consistent(dev) -> None:  # type: ignore[no-untyped-def]
    # a pending rollback belongs to the cell, so sharers cannot disagree; the write is exact
    a = make(dev)
    assert a.mem.seq_rm(0, 3, -1)
    a.hist[0] = a.hist[0][:3]
    a.mem.seq_cp(0, 2)
    a.hist[2] = list(a.hist[0])
    blob = a.mem.state_write()
    b = Checked(dev, 3, 2, seed=8)
    b.mem.state_read(blob)
    adopt(b, a, (0, 1, 2))
    assert b.mem.cell_of(0) == b.mem.cell_of(2)
    for s in range(3):
        b.check_state(s)


def test_item42_layer_count_includes_stateless_layers(dev) -> None:  # type: ignore[no-untyped-def]
    a = make(dev)
    pw = _payload(a.mem.state_write())
    meta_end = 4 + 3 * 12
    assert struct.unpack_from("<II", pw, meta_end + 4) == (3, 2)  # 3 model layers, 2 with state


def test_random_truncation_and_byte_flips(dev) -> None:  # type: ignore[no-untyped-def]
    a = make(dev)
    rng = np.random.default_rng(0)
    b = make(dev, seed=9)
    book, data = b.mem.book_snapshot(), data_snapshot(b)
    for seq in (-1, 1):
        blob = a.mem.state_write(seq)
        for cut in rng.integers(0, len(blob), size=25):
            with pytest.raises(StateError):
                b.mem.state_read(blob[: int(cut)], seq)
        header_and_meta = 16 + 12 + (4 + 3 * 12 if seq < 0 else 12) + 12
        for _ in range(40):
            pos = int(rng.integers(0, header_and_meta))
            flipped = bytearray(blob)
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
            try:
                b.mem.state_read(bytes(flipped), seq)
            except StateError:
                assert_unchanged(b, book, data)
            else:  # a flip in a position field is still a valid blob; restore the reference
                b = make(dev, seed=9)
                book, data = b.mem.book_snapshot(), data_snapshot(b)
    assert_unchanged(b, book, data)


def test_state_read_accepts_streams_and_checks_seq(dev) -> None:  # type: ignore[no-untyped-def]
    import io

    a = make(dev)
    b = Toy(dev, 3, 2)
    b.mem.state_read(io.BytesIO(a.mem.state_write(2)), 2)
    assert b.mem.seq_pos_max(2) == 1
    with pytest.raises(statecache.ArgumentError):
        a.mem.state_write(5)


def _descriptor_offsets(payload: bytes, n_cells: int, cells_bytes: int) -> list[int]:
    """Offsets of every byte of a recurrent section that depends on the memory alone
    (s_trans, n_layer, n_state_layers, and per layer its id, tensor count and each
    tensor's name, type and row size), read from the payload's own fields."""
    off = cells_bytes
    out = list(range(off, off + 12))
    n_state = struct.unpack_from("<I", payload, off + 8)[0]
    off += 12
    for _ in range(n_state):
        n_tensors = struct.unpack_from("<I", payload, off + 4)[0]
        out += range(off, off + 8)
        off += 8
        for _ in range(n_tensors):
            desc = 1 + payload[off] + 4 + 8
            row_bytes = struct.unpack_from("<Q", payload, off + desc - 8)[0]
            out += range(off, off + desc)
            off += desc + n_cells * row_bytes
    return out


@pytest.mark.parametrize("seq", [-1, 1])
def test_every_bit_of_the_layout_fields_is_checked(dev, seq: int) -> None:  # type: ignore[no-untyped-def]
    """The layout fields are compared as bytes (state_io.Reader.match) and read one by one
    only when they differ: a blob with any one bit of them flipped (checksum rebuilt) is
    refused, naming a field, and nothing changes."""
    a = make(dev)
    payload = _payload(a.mem.state_write(seq))
    n_cells = struct.unpack_from("<I", payload, 0)[0]
    cells_bytes = 4
    for _ in range(n_cells):  # pos, n_seq_id, ids
        cells_bytes += 8 + 4 * struct.unpack_from("<I", payload, cells_bytes + 4)[0]
    offsets = _descriptor_offsets(payload, n_cells, cells_bytes)
    assert len(offsets) > 12 + 8  # the walk found the layers
    b = make(dev, seed=4)
    book, data = b.mem.book_snapshot(), data_snapshot(b)
    for off in offsets:
        for bit in range(8):
            flipped = bytearray(payload)
            flipped[off] ^= 1 << bit
            with pytest.raises(StateError) as ei:
                b.mem.state_read(_rebuild(bytes(flipped)), seq)
            assert ei.value.field
    assert_unchanged(b, book, data)
    b.mem.state_read(_rebuild(payload), seq)  # the unflipped payload still reads
