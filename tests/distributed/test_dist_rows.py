"""A sequence moved as metadata plus one contiguous row buffer, in one process.

This is what ``send_sequence`` / ``recv_sequence`` do on either side of the wire
(``transfer._rows_payload`` on the sender; ``_check_positions`` and ``_read`` on
the receiver), without torch: the rows path must install exactly what the state
format installs, carry the snapshot planes still valid (so the receiver rolls
back like the sender), and leave the receiver untouched when the rows or the
metadata are bad.
"""

from __future__ import annotations

import numpy as np
import pytest
from dist_memories import GDN, M2, SPECS, build, garbage_memory, place
from hypothesis import example, given
from hypothesis import strategies as st

import statecache
from statecache.distributed import transfer as T
from statecache.errors import StateError
from statecache.factory import make_memory
from statecache.spec import AttentionLayerSpec, ModelSpec


def payload(mem, seq):
    """What the sender puts on the wire: (metadata, rows) as separate copies."""
    data, meta_bytes, _ = T._rows_payload(mem, seq, 0)
    return bytes(data[:meta_bytes]), data[meta_bytes:].copy()


def receive(mem, seq, meta, rows, pos_max):
    T._check_positions(meta, pos_max, rows)
    T._read(mem, meta, rows, seq, 0)


def everything(mem):
    """The receiver's whole observable state: its blob and its recurrent book."""
    recr = mem if not hasattr(mem, "recr") else mem.recr
    return mem.state_write(), recr.book_snapshot().a.copy()


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_rows_install_what_the_state_format_installs(kind, backend):
    """Into another backend and a memory of another size: the same state as state_read of the blob."""
    src = garbage_memory(kind, statecache.get_device("cpu"), seed=11)
    dev = statecache.get_device(backend)
    for seq in (0, 1, 2):
        by_rows, by_blob = build(SPECS[kind], dev, n_seq_max=4), build(SPECS[kind], dev, n_seq_max=4)
        for mem in (by_rows, by_blob):  # the destination sequence holds something else first
            place(mem, {seq: [4, 4], 3: [5]})
        receive(by_rows, seq, *payload(src, seq), src.seq_pos_max(seq))
        by_blob.state_read(src.state_write(seq), seq)
        assert by_rows.state_write() == by_blob.state_write()  # every sequence, the untouched one too
        assert by_rows.state_write(seq) == src.state_write(seq)


def _deep_spec(family):
    layer = {"gdn": GDN, "mamba2": M2}[family]
    return ModelSpec.build(2, recurrent={0: layer}, attention={1: AttentionLayerSpec(2, 4)}, kv_dtype="f16")


@given(
    family=st.sampled_from(["gdn", "mamba2"]),
    k_src=st.integers(1, 4),
    k_dst=st.integers(0, 4),
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    pending=st.integers(0, 2),
    depth=st.integers(1, 6),
    seed=st.integers(0, 100),
)
# deep rollbacks, behind a pending one and without (the ci profile draws few examples)
@example(family="gdn", k_src=4, k_dst=3, steps=[2, 5], pending=1, depth=3, seed=1)
@example(family="mamba2", k_src=3, k_dst=4, steps=[6], pending=0, depth=3, seed=2)
def test_receiver_rolls_back_exactly_like_the_sender(family, k_src, k_dst, steps, pending, depth, seed):
    """Planes travel: after the transfer (the sender possibly with a rollback pending), the
    receiver accepts a rollback exactly when the sender, asked for the same target
    position before it armed anything, accepts it and the receiver keeps that many
    planes; and then both hold the same state."""
    spec, dev = _deep_spec(family), statecache.get_device("cpu")

    def sender():
        mem = make_memory(spec, dev, 1, k_src, n_ctx=32, n_ubatch=8)
        mem.fill_garbage(seed)
        pos = 0
        for n in steps:  # the rows hold garbage; every step records its planes in the book
            place(mem, {0: list(range(pos, pos + n))})
            pos += n
        return mem

    src, reference = sender(), sender()
    dst = make_memory(spec, dev, 2, k_dst, n_ctx=32, n_ubatch=8)
    dst.fill_garbage(seed + 1)
    place(dst, {0: [7, 7], 1: [3]})  # the receiving sequence held another state
    end = src.seq_pos_max(0)
    if pending and src.seq_rm(0, end + 1 - pending, -1):  # a rollback armed, not yet consumed
        end -= pending
    other = dst.state_write(1)
    receive(dst, 0, *payload(src, 0), end)
    assert dst.state_write(0) == src.state_write(0) and dst.state_write(1) == other
    p0 = end + 1 - depth
    ok_ref, ok_dst = reference.seq_rm(0, p0, -1), dst.seq_rm(0, p0, -1)
    if p0 <= 0:  # the whole state goes on both sides
        assert ok_ref and ok_dst
    else:
        assert ok_dst == (ok_ref and depth <= k_dst)
    if ok_dst:
        assert dst.state_write(0) == reference.state_write(0)


def test_planes_behind_a_pending_rollback_are_rebased():
    """Sender: 5 tokens in one ubatch, then a rollback by 2 armed.  The receiver holds the
    state at position 2 with nothing pending and can go 2 further back, to the state the
    sender reaches by rolling back 4 from its end."""
    spec, dev = _deep_spec("gdn"), statecache.get_device("cpu")

    def sender():
        mem = make_memory(spec, dev, 1, 4, n_ctx=32, n_ubatch=8)
        mem.fill_garbage(3)
        place(mem, {0: [1, 2, 3, 4, 5]})
        return mem

    src, reference = sender(), sender()
    dst = make_memory(spec, dev, 1, 4, n_ctx=32, n_ubatch=8)
    assert src.seq_rm(0, 3, -1)
    receive(dst, 0, *payload(src, 0), 2)
    assert dst.recr.pending_rollback(0) == 0 and dst.seq_pos_max(0) == 2
    assert dst.seq_rm(0, 1, -1) and reference.seq_rm(0, 1, -1)  # to position 0 on both
    assert dst.state_write(0) == reference.state_write(0)


@pytest.mark.parametrize("damage", ["short", "long", "meta"])
def test_bad_rows_or_metadata_change_nothing(damage):
    dev = statecache.get_device("cpu")
    src = garbage_memory("hybrid_iswa", dev, seed=5)
    dst = garbage_memory("hybrid_iswa", dev, seed=6)
    meta, rows = payload(src, 0)
    if damage == "short":
        rows = rows[:-1]
    elif damage == "long":
        rows = np.concatenate([rows, np.zeros(2, dtype=np.uint8)])
    else:
        bad = bytearray(meta)
        bad[-5] ^= 0x10
        meta = bytes(bad)
    before = everything(dst)
    with pytest.raises(StateError):
        receive(dst, 0, meta, rows, src.seq_pos_max(0))
    if damage != "long":  # the memory's own reader refuses it too (extra rows: the check above)
        with pytest.raises(StateError):
            T._read(dst, meta, rows, 0, 0)
    after = everything(dst)
    assert before[0] == after[0] and np.array_equal(before[1], after[1])


def _opencl():
    from statecache.registry import default_registry

    found = [d for d in default_registry().available_devices() if d.backend_name == "opencl"]
    if not found:
        pytest.skip("no OpenCL device")
    return found[0]


@pytest.mark.parametrize("kind", ["hybrid_iswa", "recurrent"])
def test_rows_cross_a_device_whose_memory_the_host_cannot_see(kind):
    """OpenCL buffers are not host-visible: the sender gathers with get_rows and downloads
    only those rows, the receiver uploads them and scatters with set_rows."""
    ocl, cpu = _opencl(), statecache.get_device("cpu")
    for src_dev, dst_dev in ((ocl, cpu), (cpu, ocl)):
        src = garbage_memory(kind, src_dev, seed=21)
        dst = build(SPECS[kind], dst_dev, n_seq_max=4)
        place(dst, {0: [3, 3, 3]})
        receive(dst, 0, *payload(src, 1), src.seq_pos_max(1))
        ref = build(SPECS[kind], cpu, n_seq_max=4)
        ref.state_read(src.state_write(1), 0)
        assert dst.state_write(0) == ref.state_write(0)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_rows_that_arrive_while_the_metadata_is_validated_install_and_a_lost_tail_changes_nothing(kind):
    """recv_sequence validates the metadata while the rows are on the wire: every memory
    waits for them (state_io.rows_ready) after validating and before writing.  Rows that
    land only at that wait install the same state as rows that were there first; rows
    that never come raise at the wait with the receiver untouched, its destination
    sequence holding a state of its own (so a write would show)."""
    from statecache.distributed.errors import TransferError
    from statecache.state_io import RowSource

    dev = statecache.get_device("cpu")
    src = garbage_memory(kind, dev, seed=31)
    meta, rows = payload(src, 1)
    staging = np.zeros_like(rows)  # what the receiver holds before the rows arrive

    def arrive():
        staging[:] = rows

    late, ref = build(SPECS[kind], dev, n_seq_max=4), build(SPECS[kind], dev, n_seq_max=4)
    for mem in (late, ref):
        place(mem, {0: [4, 4], 3: [5]})
    T._check_positions(meta, src.seq_pos_max(1), staging)
    T._read(late, meta, RowSource(staging, wait=arrive), 0, 0)
    ref.state_read(src.state_write(1), 0)
    assert late.state_write() == ref.state_write()

    def lost():
        raise TransferError(0, "receiving the rows: rank 0 is gone")

    before = everything(late)
    source = RowSource(np.zeros_like(rows), wait=lost)
    with pytest.raises(TransferError, match="receiving the rows"):
        T._read(late, meta, source, 3, 0)
    assert not source.late  # the wait came before any write, not from scatter_rows
    after = everything(late)
    assert before[0] == after[0] and np.array_equal(before[1], after[1])


def _outcome(check, meta, pos_max, rows):
    """What a positions check returns or raises (type and message)."""
    try:
        return ("ok", check(meta, pos_max, rows))
    except StateError as exc:
        return ("refused", str(exc))


def _repacked(meta, edit):
    """``meta`` with its sections' payloads edited by ``edit(index, bytearray)`` and their
    CRC-32s rewritten, so that the edit reaches the section parsers."""
    from statecache.state_io import pack_sections, unpack_sections

    flags, sections = unpack_sections(meta)
    out = []
    for i, (tag, payload) in enumerate(sections):
        data = bytearray(payload)
        edit(i, data)
        out.append((tag, bytes(data)))
    return pack_sections(out, flags)


@given(
    kind=st.sampled_from([*sorted(SPECS), "deep"]),
    seq=st.integers(0, 2),
    section=st.integers(0, 3),
    at=st.floats(0, 1, exclude_max=True),
    value=st.integers(0, 255),
    cut=st.integers(-3, 3),
    pos_delta=st.sampled_from([0, 0, 1, -1]),
)
@example(kind="hybrid_iswa", seq=0, section=0, at=0.0, value=0, cut=0, pos_delta=0)
@example(kind="deep", seq=0, section=1, at=0.99, value=7, cut=0, pos_delta=0)  # a cell's plane count
def test_the_receivers_fast_scan_decides_exactly_as_the_full_parse(kind, seq, section, at, value, cut, pos_delta):
    """The receiver checks metadata whose rows are apart with a fast scan
    (``sections.scan_apart``), falling back to the full parse; over intact and damaged
    metadata of every memory kind (a byte of a section changed, its CRC rewritten; a
    section cut short or grown; the header's last position off by one), it returns the
    same row block sizes, or refuses with the same error, as the full parse alone."""
    dev = statecache.get_device("cpu")
    if kind == "deep":  # rollback planes behind the state
        src = make_memory(_deep_spec("gdn"), dev, 1, 3, n_ctx=32, n_ubatch=8)
        place(src, {0: [1, 2, 3]})
        place(src, {0: [4]})
        seq = 0
    else:
        src = garbage_memory(kind, dev, seed=3)
    meta, rows = payload(src, seq)
    pos_max = src.seq_pos_max(seq) + pos_delta

    def edit(i, data):
        if i != section % 2 or not data:
            return
        data[int(at * len(data))] = value
        if cut < 0:
            del data[cut:]
        elif cut > 0:
            data.extend(bytes(cut))

    damaged = _repacked(meta, edit)
    for m in (meta, damaged):
        fast = _outcome(T._check_positions, m, pos_max, rows)
        assert fast == _outcome(T._parse_positions, m, pos_max, rows)
    intact = T._scan_positions(meta, src.seq_pos_max(seq), rows)
    assert intact is not None and intact == T._parse_positions(meta, src.seq_pos_max(seq), rows)
