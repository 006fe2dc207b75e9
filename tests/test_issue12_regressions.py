"""Regression tests of issue 12 (items 1-12: the parts of a hybrid never disagree, a
stale plan is refused, bad input changes nothing) and of the memory items of issue 14
(out-of-range sequence ids, the batch allocator, positions outside int32).

Each test is the issue's reproduction, widened to every memory kind the defect can
reach; the property tests (``test_hybrid_stateful.py``, ``test_recurrent_stateful.py``)
cover the classes.  Every refusal is checked to change nothing: the books of every
part, their versions and every device buffer byte (:func:`fingerprint`).
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hybrid_toy import ATTN, E, HybridToy, make_hybrid
from recurrent_toy import CH, D_CONV, HV, H, N, P, S, Tables, Toy, oracle, toy_spec
from test_hybrid import check

import statecache
from statecache import state_io
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, BatchError, StateError
from statecache.hybrid import HybridMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.memory import ContextError, MemoryStatus, StateFlags
from statecache.recurrent import RecurrentMemory

DEV = statecache.get_device("reference")
HYBRIDS = ["hybrid", "iswa", "idx"]


# -- helpers ----------------------------------------------------------------------------


def _kv_fingerprint(cache: KVCache) -> tuple:
    cells = tuple(
        (c.pos.tobytes(), c.ext.tobytes(), c.shift.tobytes(), c.seq.tobytes(), tuple(map(tuple, c.seq_pos)))
        for c in cache.cells
    )
    data = tuple(b.numpy().tobytes() for b in cache.buffers())
    return cells, tuple(cache.book.heads), tuple(cache.pending_copies), getattr(cache, "version", None), data


def fingerprint(mem) -> tuple:  # type: ignore[no-untyped-def]
    """Everything a refused operation must leave as it was: books, versions, buffers."""
    if isinstance(mem, RecurrentMemory):
        b = mem.book_snapshot()
        data = tuple(buf.numpy().tobytes() for pools in mem.pools.values() for buf in pools.values())
        return b.a.tobytes(), b.head, b.used, getattr(mem, "version", None), data
    if isinstance(mem, KVCache):
        return _kv_fingerprint(mem)
    if isinstance(mem, KVCacheISWA):
        return fingerprint(mem.base), fingerprint(mem.swa)
    out = [fingerprint(mem.attn), fingerprint(mem.recr), getattr(mem, "version", None)]
    if hasattr(mem, "idx"):
        out += [fingerprint(mem.idx), mem.marks.copy().tobytes()]
    return tuple(out)


def plan(mem, tokens_by_seq, n_ubatch=8):  # type: ignore[no-untyped-def]
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), mem)
    ctx = mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    return ctx


def parts_agree(mem) -> None:  # type: ignore[no-untyped-def]
    """Every part of a hybrid holds the same sequences, ending at the same position; a
    window cache may start later, never earlier than the base."""
    for s in range(mem.n_seq_max):
        ends = {"recurrent": mem.recr.seq_pos_max(s)}
        for name, cache in zip(("base", "window"), mem.kv_caches, strict=False):
            ends[name] = cache.seq_pos_max(s)
        if hasattr(mem, "idx"):
            ends["indexer"] = mem.idx.seq_pos_max(s)
        assert len(set(ends.values())) == 1, (s, ends)
        assert mem.seq_pos_min(s) <= mem.seq_pos_max(s), (s, mem.seq_pos_min(s), mem.seq_pos_max(s))


def kv_memory(kind: str, n_seq_max: int = 3):  # type: ignore[no-untyped-def]
    """A KV cache ("kv", "kv_swa") or an iSWA pair ("kv_iswa") with one toy layer."""
    layers = [KVLayer(ATTN, E, E)]
    common = dict(n_seq_max=n_seq_max, dtype="f32", n_pad=1)
    if kind == "kv":
        return KVCache(DEV, layers, size=16, **common)
    if kind == "kv_swa":
        return KVCache(DEV, layers, size=16, swa_type="standard", n_swa=3, **common)
    return KVCacheISWA(DEV, layers, [ATTN], size=16, n_ubatch=8, n_swa=3, **common)


def any_memory(kind: str, n_seq_max: int = 3):  # type: ignore[no-untyped-def]
    if kind == "recurrent":
        return RecurrentMemory(toy_spec(), DEV, n_seq_max=n_seq_max, n_rs_seq=2)
    if kind.startswith("kv"):
        return kv_memory(kind, n_seq_max)
    return make_hybrid(DEV, kind, n_seq_max=n_seq_max, n_rs_seq=2)


ALL_KINDS = ["recurrent", "kv", "kv_swa", "kv_iswa", *HYBRIDS]


def fill(mem, tokens_by_seq) -> None:  # type: ignore[no-untyped-def]
    """Apply a batch to the books (no compute: enough for book-level tests)."""
    ctx = plan(mem, tokens_by_seq)
    while True:
        assert ctx.apply()
        if not ctx.next():
            return


# -- item 1: a plan applied after the memory changed ---------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_item1_second_plan_from_the_same_state_is_refused(kind: str) -> None:
    mem = any_memory(kind, n_seq_max=4)
    fill(mem, {0: [1, 2]})
    a = plan(mem, {2: [1, 2, 3]})
    b = plan(mem, {3: [4, 5]})
    assert a.apply()
    before = fingerprint(mem)
    with pytest.raises(ContextError, match="changed"):
        b.apply()
    assert fingerprint(mem) == before
    if kind.startswith("kv") or kind in HYBRIDS:  # sequence 2 kept its cells
        cache = mem if isinstance(mem, KVCache) else (mem.swa if isinstance(mem, KVCacheISWA) else mem.kv_caches[-1])
        assert cache.seq_pos_min(2) == 0 and cache.seq_pos_max(2) == 2


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("edit", ["seq_rm", "seq_cp", "seq_keep", "seq_add", "clear", "state_read"])
def test_item1_every_edit_between_plan_and_apply_makes_it_stale(kind: str, edit: str) -> None:
    mem = any_memory(kind)
    fill(mem, {0: [1, 2, 3], 1: [4]})
    blob = mem.state_write() if edit == "state_read" else b""
    ctx = plan(mem, {0: [5], 1: [6]})
    if edit == "seq_rm":
        mem.seq_rm(1, -1, -1)
    elif edit == "seq_cp":
        mem.seq_cp(0, 2)
    elif edit == "seq_keep":
        mem.seq_keep(0)
    elif edit == "seq_add":
        mem.seq_add(1, 0, -1, 3)
    elif edit == "clear":
        mem.clear(False)
    else:
        mem.state_read(blob)
    before = fingerprint(mem)
    with pytest.raises(ContextError):
        ctx.apply()
    assert fingerprint(mem) == before


@pytest.mark.parametrize("kind", ["kv", "kv_iswa", "hybrid", "iswa", "idx"])
def test_item1_update_and_full_contexts_are_refused_once_the_memory_moved(kind: str) -> None:
    """An update planned before another shift would clear that shift without doing it;
    a NO_UPDATE answer and a full (reservation) context go stale the same way."""
    mem = any_memory(kind)
    fill(mem, {0: [1, 2, 3, 4]})
    full = mem.init_full()
    none = mem.init_update()
    assert none.status is MemoryStatus.NO_UPDATE
    mem.seq_rm(0, 1, 2)
    mem.seq_add(0, 2, -1, -1)  # a pending shift
    for ctx in (full, none):
        before = fingerprint(mem)
        with pytest.raises(ContextError):
            ctx.apply()
        assert fingerprint(mem) == before
    upd = mem.init_update()
    assert upd.status is MemoryStatus.SUCCESS
    mem.seq_add(0, 0, 1, 1)  # another shift after the update was planned
    before = fingerprint(mem)
    with pytest.raises(ContextError):
        upd.apply()
    assert fingerprint(mem) == before
    assert mem.init_update().apply()  # planned again, it does both shifts


def test_item1_recurrent_context_refuses_instead_of_placing_again() -> None:
    """The recurrent context used to place a stale ubatch again on the new book; it
    now refuses (documented choice), and a fresh plan decodes exactly."""
    t = Toy(DEV, 4)
    t.decode({0: [1, 2]})
    a, b = plan(t.mem, {0: [3]}), plan(t.mem, {1: [4, 5]})
    assert b.apply()
    before = fingerprint(t.mem)
    with pytest.raises(ContextError, match="plan the batch again"):
        a.apply()
    assert fingerprint(t.mem) == before


def test_item1_hybrid_second_plan_decodes_correctly_when_planned_again() -> None:
    toy = HybridToy(DEV, make_hybrid(DEV, n_seq_max=4))
    toy.decode({0: [1, 2]})
    stale = plan(toy.mem, {3: [4, 5]})
    check(toy, toy.decode({2: [1, 2, 3]}), (2,))
    with pytest.raises(ContextError):
        stale.apply()
    check(toy, toy.decode({3: [4, 5]}), (3,))
    check(toy, toy.decode({2: [6]}), (2,))  # sequence 2 kept every cell
    parts_agree(toy.mem)


# -- item 2: hybrid-iSWA window eviction defeats rollback -----------------------------------


def test_item2_window_keeps_what_a_rollback_returns_to() -> None:
    toy = HybridToy(DEV, make_hybrid(DEV, "iswa", n_seq_max=2, n_rs_seq=2, n_swa=3, n_pad=1, size=32))
    mem = toy.mem
    toy.decode({1: [7], 0: [1, 2, 3]})
    assert mem.seq_rm(1, 0, -1)
    toy.forget(1)
    toy.decode({1: [8, 9]})
    parts_agree(mem)
    assert mem.seq_rm(0, 1, -1)  # roll sequence 0 back to position 0
    del toy.recr_tokens[0][1:], toy.attn_hist[0][1:]
    parts_agree(mem)
    assert mem.attn.swa.seq_pos_max(0) == 0
    check(toy, toy.decode({0: [4]}), (0,))  # its window still sees position 0


def test_item2_a_rollback_the_window_cannot_serve_is_refused() -> None:
    """A window cache sized and told nothing of rollbacks (its depth reset by hand):
    the rollback is refused, nothing changed, instead of leaving the parts apart."""
    toy = HybridToy(DEV, make_hybrid(DEV, "iswa", n_seq_max=2, n_rs_seq=2, n_swa=3, n_pad=1, size=32))
    mem = toy.mem
    mem.attn.swa.rollback_depth = 0
    toy.decode({1: [7], 0: [1, 2, 3]})
    assert mem.seq_rm(1, 0, -1)
    toy.forget(1)
    toy.decode({1: [8, 9]})
    if mem.attn.swa.seq_pos_min(0) > 0:  # the window gave position 0 up
        before = fingerprint(mem)
        assert mem.seq_rm(0, 1, -1) is False
        assert fingerprint(mem) == before
    parts_agree(mem)


# -- item 3: a removal from position 0 trims snapshot planes ----------------------------------


@pytest.mark.parametrize("kind", HYBRIDS)
def test_item3_head_removal_then_rollback_keeps_the_parts_together(kind: str) -> None:
    toy = HybridToy(DEV, make_hybrid(DEV, kind, n_rs_seq=2))
    mem = toy.mem
    toy.decode({0: [1, 2, 3]})
    assert mem.seq_rm(0, 0, 2)
    parts_agree(mem)
    before = fingerprint(mem)
    assert mem.seq_rm(0, 2, -1) is False  # position 1 is gone from the attention part
    assert fingerprint(mem) == before
    parts_agree(mem)


def test_item3_recurrent_head_removal_drops_the_planes_before_it() -> None:
    t = Toy(DEV, 1, n_rs_seq=2)
    t.decode({0: [1, 2, 3]})
    assert t.mem.seq_rm(0, 0, 2)
    assert t.mem.seq_rm(0, 2, -1) is False  # the plane at position 1 describes a removed history
    assert t.mem.seq_pos_max(0) == 2


# -- item 4: seq_cp with a partial range ---------------------------------------------------------


@pytest.mark.parametrize("kind", HYBRIDS)
def test_item4_partial_copy_into_a_hybrid_is_refused(kind: str) -> None:
    toy = HybridToy(DEV, make_hybrid(DEV, kind))
    toy.decode({0: list(range(10))})
    before = fingerprint(toy.mem)
    for p0, p1 in ((0, 4), (3, -1), (0, 9)):
        with pytest.raises(ArgumentError) as info:
            toy.mem.seq_cp(0, 1, p0, p1)
        assert info.value.argument == "p0/p1"
        assert fingerprint(toy.mem) == before
    toy.mem.seq_cp(0, 1, *((-1, -1) if kind == "idx" else (0, 10)))  # every position (idx: spelled -1, -1)
    parts_agree(toy.mem)


# -- item 5: hybrid-iSWA can shift only when the shift keeps every needed cell -----------------


def _shift_after_whole_read(swa_full: bool) -> HybridToy:
    toy = HybridToy(DEV, make_hybrid(DEV, "iswa", n_seq_max=1, n_swa=3, n_pad=1, size=16, swa_full=swa_full))
    toy.decode({0: [1, 2, 3, 4, 5, 6]})
    blob = toy.mem.state_write()
    toy.mem.state_read(blob)  # the search heads go back to 0
    toy.decode({0: [7, 8]})
    return toy


def test_item5_window_cache_that_evicts_cannot_shift() -> None:
    toy = _shift_after_whole_read(swa_full=False)
    assert toy.mem.get_can_shift() is False
    assert toy.mem.attn.get_can_shift() is False and toy.mem.attn.swa.get_can_shift() is False


def test_item5_full_window_cache_can_shift_and_keeps_every_cell() -> None:
    toy = _shift_after_whole_read(swa_full=True)
    mem = toy.mem
    assert mem.get_can_shift() is True
    assert mem.seq_rm(0, 4, 6)
    mem.seq_add(0, 6, -1, -2)
    assert mem.init_update().apply()
    hist = toy.attn_hist[0]
    toy.attn_hist[0] = [(p, t) for p, t in hist if p < 4] + [(p - 2, t) for p, t in hist if p >= 6]
    assert [p for p, _ in mem.attn.swa.cells[0].seq_pos[0]] == [p for p, _ in toy.attn_hist[0]]
    check(toy, toy.decode({0: [9]}), (0,))  # the window of position 6 reads 4 and 5: both held


# -- item 6: blobs whose parts disagree ------------------------------------------------------------


def _sections(blob: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    flags, secs = state_io.unpack_sections(blob)
    return flags, [(t, bytes(p)) for t, p in secs]


@pytest.mark.parametrize("kind", HYBRIDS)
@pytest.mark.parametrize("seq", [-1, 0])
def test_item6_hybrid_blob_with_disagreeing_parts_is_refused(kind: str, seq: int) -> None:
    long_ = HybridToy(DEV, make_hybrid(DEV, kind))
    long_.decode({0: list(range(10))})
    short = HybridToy(DEV, make_hybrid(DEV, kind))
    short.decode({0: list(range(6))})
    flags, mixed = _sections(short.mem.state_write(seq))
    recr = dict(_sections(long_.mem.state_write(seq))[1])[b"RECR"]
    mixed = [(t, recr if t == b"RECR" else p) for t, p in mixed]  # recurrent at 9, attention up to 5
    dst = HybridToy(DEV, make_hybrid(DEV, kind))
    dst.decode({0: [1], 1: [2, 3]})
    before = fingerprint(dst.mem)
    with pytest.raises(StateError, match="must agree"):
        dst.mem.state_read(state_io.pack_sections(mixed, flags), seq)
    assert fingerprint(dst.mem) == before


def _patch_kv_pos(blob: bytes, cell: int, new_pos: int) -> bytes:
    """Set the position of ``cell`` in a single-stream, single-id KV section (and re-pack)."""
    flags, secs = _sections(blob)
    tag, payload = secs[0]
    off = 4 + 4 + cell * 12  # n_stream, cell_count, then (pos, n_seq_id, seq_id) per cell
    payload = payload[:off] + struct.pack("<i", new_pos) + payload[off + 4 :]
    return state_io.pack_sections([(tag, payload)], flags)


def test_item6_kv_blob_with_one_position_twice_is_refused() -> None:
    src = kv_memory("kv")
    fill(src, {0: [1, 2, 3]})
    bad = _patch_kv_pos(src.state_write(), 1, 0)  # two cells of sequence 0 at position 0
    dst = kv_memory("kv")
    fill(dst, {1: [4]})
    before = fingerprint(dst)
    with pytest.raises(StateError, match="twice"):
        dst.state_read(bad)
    assert fingerprint(dst) == before


@pytest.mark.parametrize("kind", ["recurrent", "kv", "kv_iswa", "hybrid", "iswa", "idx"])
def test_item6_header_flags_and_checksums_are_checked(kind: str) -> None:
    """Unknown flag bits and a corrupted payload are refused everywhere; a PARTIAL_ONLY
    bit that disagrees with the reader's flags wherever it changes the sections (an
    iSWA pair, the hybrids)."""
    mem = any_memory(kind)
    fill(mem, {0: [1, 2, 3]})
    blob = bytearray(mem.state_write())
    before = fingerprint(mem)
    bad_flags = bytearray(blob)
    struct.pack_into("<H", bad_flags, 6, 0x80)
    partial = bytearray(blob)
    struct.pack_into("<H", partial, 6, int(StateFlags.PARTIAL_ONLY))
    corrupt = bytearray(blob)
    corrupt[-3] ^= 0x10  # a flipped bit in the last section's payload
    cases = [(bad_flags, "flags"), (corrupt, "crc32")]
    if kind not in ("recurrent", "kv"):  # the flag decides which sections the blob holds
        cases.append((partial, "flags"))
    for data, field in cases:
        with pytest.raises(StateError) as info:
            mem.state_read(bytes(data))
        assert field in info.value.field
        assert fingerprint(mem) == before


def test_item6_version_1_blobs_still_read() -> None:
    mem = any_memory("hybrid")
    fill(mem, {0: [1, 2, 3], 1: [4]})
    flags, secs = _sections(mem.state_write())
    v1 = struct.pack("<4sHHI", b"SCST", 1, flags, len(secs)) + b"".join(
        struct.pack("<4sQ", t, len(p)) + p for t, p in secs
    )
    other = any_memory("hybrid")
    other.state_read(v1)
    assert other.state_write() == mem.state_write()
    assert zlib.crc32(secs[0][1]) == struct.unpack_from("<I", mem.state_write(), 12 + 12)[0]


# -- item 7: rollback after a later ubatch of the same batch moved the cell -----------------------


@pytest.mark.parametrize("n_ubatch", [4, 5, 6, 8])
def test_item7_planes_follow_a_cell_the_reorder_moves(n_ubatch: int) -> None:
    t = Toy(DEV, 3, n_rs_seq=1)
    hist = {0: [1], 2: [2], 1: [3, 4]}
    t.decode(hist)
    batch = {2: [5, 6], 0: [7, 8], 1: [9, 10]}
    t.decode(batch, n_ubatch=n_ubatch)
    for s, toks in batch.items():
        hist[s] = hist[s] + toks
    for s in (2, 0, 1):  # every sequence rolls back one token after its 2-token write
        assert t.mem.seq_rm(s, len(hist[s]) - 1, -1), s
        hist[s] = hist[s][:-1]
    out = t.decode({0: [11], 1: [12], 2: [13]})
    for s in (0, 1, 2):
        hist[s] = hist[s] + [11 + s]
        y, _ = oracle(DEV, t.tables, hist[s])
        np.testing.assert_allclose(out[(s, len(hist[s]) - 1)], y[-1], rtol=2e-4, atol=2e-5)


def test_item7_hybrid_multi_sequence_speculation_rolls_back() -> None:
    toy = HybridToy(DEV, make_hybrid(DEV, n_rs_seq=1))
    toy.decode({0: [1], 2: [2], 1: [3, 4]})
    toy.decode({2: [5, 6], 0: [7, 8], 1: [9, 10]}, n_ubatch=4)
    for s in (2, 0, 1):
        hist = toy.attn_hist[s]
        assert toy.mem.seq_rm(s, hist[-1][0], -1), s
        del toy.recr_tokens[s][-1], hist[-1]
    parts_agree(toy.mem)
    check(toy, toy.decode({0: [11], 1: [12], 2: [13]}), (0, 1, 2))


# -- item 8: k-pool order mode, two pools of one rep row -------------------------------------------


def _reps_unique(mem) -> None:  # type: ignore[no-untyped-def]
    """No rep row is claimed by two pools with different members (one pooled slot per row)."""
    claimed: dict[int, tuple] = {}
    lay = mem.layout
    for s in range(mem.n_seq_max):
        strm, pairs = mem.pairs_of(s)
        layout = type(lay.seqs[s])(strm=strm)
        from statecache.kpool import rebuild

        layout = rebuild(pairs, strm, lay.kpool, lay.by_order)
        for j in layout.pools:
            members = tuple(c for _, c in pairs[j : j + lay.kpool])
            rep = strm * lay.kv_size + members[-1]
            assert claimed.setdefault(rep, members) == members, (s, rep, members, claimed[rep])


@pytest.mark.parametrize("by_order", [True, False])
def test_item8_shared_cells_never_get_two_groupings(by_order: bool) -> None:
    toy = HybridToy(DEV, make_hybrid(DEV, "idx", size=32, by_order=by_order))
    mem = toy.mem
    toy.decode({1: list(range(8))})
    mem.seq_cp(1, 0)
    toy.recr_tokens[0], toy.attn_hist[0] = list(toy.recr_tokens[1]), list(toy.attn_hist[1])
    before = fingerprint(mem)
    if mem.seq_rm(0, 1, 5):
        toy.attn_hist[0] = [(p, t) for p, t in toy.attn_hist[0] if not 1 <= p < 5]
    else:
        assert by_order  # order mode groups by rank: the removal would regroup shared cells
        assert fingerprint(mem) == before
    _reps_unique(mem)
    toy.decode({0: [20]})
    _reps_unique(mem)
    parts_agree(mem)


def test_item8_order_mode_refuses_moving_own_cells_across_shared_ones() -> None:
    """Sequence 0 shares cells 0..7 (positions 0..7) with sequence 1 and owns 8..11.
    Moving its own cells down by 6 interleaves them with the shared ones: in order
    mode its third pool would become (5, 11, 6, 7), whose rep 7 is the rep of
    sequence 1's pool (4, 5, 6, 7).  Refused, nothing changed; a move that keeps
    every shared rep's members (down by 8) goes through."""
    toy = HybridToy(DEV, make_hybrid(DEV, "idx", size=32, by_order=True))
    mem = toy.mem
    toy.decode({1: list(range(8))})
    mem.seq_cp(1, 0)
    toy.decode({0: [8, 9, 10, 11]})
    before = fingerprint(mem)
    with pytest.raises(ArgumentError, match="k-pools"):
        mem.seq_add(0, 8, -1, -6)
    assert fingerprint(mem) == before
    _reps_unique(mem)


@pytest.mark.parametrize("kind", HYBRIDS)
def test_item_class_a_move_below_kept_positions_is_refused(kind: str) -> None:
    """The class of items 3 and 4 for position moves: the recurrent part moves its one
    position, the attention part every cell of the range, so moving the end below
    positions the range leaves behind would split the parts."""
    toy = HybridToy(DEV, make_hybrid(DEV, kind))
    mem = toy.mem
    toy.decode({0: list(range(8))})
    before = fingerprint(mem)
    for call, name in ((lambda: mem.seq_add(0, 6, -1, -4), "delta"), (lambda: mem.seq_div(0, 6, -1, 2), "d")):
        with pytest.raises(ArgumentError) as info:
            call()
        assert info.value.argument == name
        assert fingerprint(mem) == before
    assert mem.seq_rm(0, 2, 6)  # a context shift: remove first, then move
    mem.seq_add(0, 6, -1, -4)
    parts_agree(mem)


# -- item 9 / issue 14: out-of-range sequence ids ---------------------------------------------------


def _bad_calls(mem, bad: int):  # type: ignore[no-untyped-def]
    blob = mem.state_write(0)
    calls = [
        ("seq_cp", lambda: mem.seq_cp(bad, 0)),
        ("seq_cp", lambda: mem.seq_cp(0, bad)),
        ("seq_keep", lambda: mem.seq_keep(bad)),
        ("seq_add", lambda: mem.seq_add(bad, 0, -1, 1)),
        ("seq_div", lambda: mem.seq_div(bad, 0, -1, 2)),
        ("seq_pos_min", lambda: mem.seq_pos_min(bad)),
        ("seq_pos_max", lambda: mem.seq_pos_max(bad)),
    ]
    if bad >= 0:  # a negative id means "every sequence" for these
        calls += [
            ("seq_rm", lambda: mem.seq_rm(bad, -1, -1)),
            ("state_write", lambda: mem.state_write(bad)),
            ("state_read", lambda: mem.state_read(blob, bad)),
        ]
    return calls


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("bad", [3, 99, -1, -7])
def test_item9_out_of_range_ids_raise_in_every_method(kind: str, bad: int) -> None:
    mem = any_memory(kind)
    fill(mem, {0: [1, 2], 1: [3]})
    before = fingerprint(mem)
    for name, call in _bad_calls(mem, bad):
        with pytest.raises(ArgumentError) as info:
            call()
        assert info.value.argument in ("seq", "src", "dst"), (name, info.value)
        assert fingerprint(mem) == before, name


def test_item9_recurrent_seq_keep_out_of_range_wipes_nothing() -> None:
    t = Toy(DEV, 3)
    t.decode({0: [1], 1: [2]})
    before = fingerprint(t.mem)
    for bad in (99, -1, 3):
        with pytest.raises(ArgumentError, match="outside"):
            t.mem.seq_keep(bad)
    assert fingerprint(t.mem) == before
    assert t.mem.seq_pos_max(0) == 0 and t.mem.seq_pos_max(1) == 0


# -- item 10 / issue 14: the batch allocator -------------------------------------------------------


def test_item10_allocator_of_another_size_is_refused_by_name() -> None:
    mem = RecurrentMemory(toy_spec(), DEV, n_seq_max=4)
    with pytest.raises(ArgumentError) as info:
        BatchAllocator(8).init(Batch.for_sequences({0: [1]}), mem)
    assert info.value.argument == "n_seq_max" and "BatchAllocator()" in str(info.value)
    balloc = BatchAllocator()  # takes n_seq_max from the memory
    balloc.init(Batch.for_sequences({3: [1]}), mem)
    assert balloc.n_seq_max == 4
    assert mem.init_batch(balloc, 8).status is MemoryStatus.SUCCESS
    with pytest.raises(ArgumentError, match="memory"):
        BatchAllocator().init(Batch.for_sequences({0: [1]}))  # nothing to take it from


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_item10_uninitialised_allocator_is_refused_at_init_batch(kind: str) -> None:
    mem = any_memory(kind)
    before = fingerprint(mem)
    for balloc in (BatchAllocator(mem.n_seq_max), BatchAllocator()):
        with pytest.raises(ArgumentError) as info:
            mem.init_batch(balloc, 8)
        assert info.value.argument == "balloc"
    failed = BatchAllocator(mem.n_seq_max)
    with pytest.raises(BatchError):
        failed.init(Batch(tokens=[1], seq_ids=[7]), mem)
    with pytest.raises(ArgumentError, match="balloc"):
        mem.init_batch(failed, 8)  # a failed init leaves nothing to plan
    other = BatchAllocator(mem.n_seq_max + 1)
    other.init(Batch.for_sequences({0: [1]}))
    with pytest.raises(ArgumentError, match="balloc"):
        mem.init_batch(other, 8)
    assert fingerprint(mem) == before


def test_issue14_for_sequences_refuses_a_sequence_without_tokens() -> None:
    for arg in ({0: []}, {0: [1], 1: []}, {}):
        with pytest.raises(ArgumentError) as info:
            Batch.for_sequences(arg)
        assert info.value.argument == "tokens_by_seq"


# -- item 11: a refused step call writes nothing and may be retried ---------------------------------


def _step_toy() -> tuple[Toy, object, np.ndarray]:
    """A new sequence (it starts from the zero row, which the step zeroes) next to an
    old one, after apply(); returns the toy, the context and its tokens."""
    t = Toy(DEV, 3, n_rs_seq=2)
    t.decode({0: [1, 2, 3]})
    ctx = plan(t.mem, {0: [4, 5], 1: [6, 7]})
    assert ctx.apply()
    ub = ctx.get_ubatch()
    return t, ctx, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)


def _pools(t: Toy) -> bytes:
    return b"".join(buf.numpy().tobytes() for pools in t.mem.pools.values() for buf in pools.values())


def test_item11_bad_step_calls_change_nothing_and_name_the_argument() -> None:
    t, ctx, toks = _step_toy()
    step = ctx.step()
    tb = Tables()
    up = DEV.upload
    n_s, n_t = toks.shape
    x, w, y = up(tb.conv_x[0][toks]), up(tb.conv_w[0]), DEV.alloc((n_s, n_t, CH))
    bad_conv = {
        "x": dict(x=up(tb.conv_x[0][toks][:, :1])),  # one token short of the ubatch
        "weight": dict(weight=up(np.zeros((CH, D_CONV + 1), np.float32))),  # a kernel too wide
        "y": dict(y=DEV.alloc((n_s, n_t, CH + 1))),
    }
    before = _pools(t)
    for name, change in bad_conv.items():
        args = {"x": x, "weight": w, "y": y, **change}
        with pytest.raises(ArgumentError) as info:
            step.conv(0, args["x"], args["weight"], args["y"])
        assert info.value.argument == name, info.value
        assert _pools(t) == before
    scan = [up(a) for a in (tb.x[toks], tb.dt[toks], tb.A, tb.B[toks], tb.C[toks])]
    ys = DEV.alloc((n_s, n_t, H, P))
    bad_scan = {
        "x": (0, up(np.zeros((n_s, n_t, H + 2, P), np.float32))),  # heads that A and dt do not have
        "B": (3, up(np.zeros((n_s, n_t, 1, N + 1), np.float32))),  # a d_state the state rows do not hold
        "A": (2, up(np.zeros((H + 1,), np.float32))),
    }
    for name, (k, arg) in bad_scan.items():
        args = list(scan)
        args[k] = arg
        with pytest.raises(ArgumentError) as info:
            step.scan(0, *args, ys)
        assert info.value.argument == name, info.value
        assert _pools(t) == before
    # corrected, the very same step goes through and the result is exact
    from recurrent_toy import run_layers as run_recurrent

    y_out = run_recurrent(DEV, step, t.tables, toks)
    for s, hist in ((0, [1, 2, 3, 4, 5]), (1, [6, 7])):
        ref, _ = oracle(DEV, t.tables, hist)
        np.testing.assert_allclose(y_out[s], ref[-2:], rtol=2e-4, atol=2e-5)
    t.mem.check_invariants()


def test_item11_bad_delta_calls_name_the_argument() -> None:
    t, ctx, toks = _step_toy()
    step = ctx.step()
    tb = t.tables
    n_s, n_t = toks.shape
    args = [DEV.upload(a) for a in (tb.q[toks], tb.k[toks], tb.v[toks], tb.g[toks], tb.beta[toks])]
    o = DEV.alloc((n_s, n_t, HV, S))
    before = _pools(t)
    for k, name in enumerate(("q", "k", "v", "g", "beta")):
        bad = list(args)
        shape = list(args[k].shape)
        shape[-1] += 1
        bad[k] = DEV.alloc(tuple(shape))
        with pytest.raises(ArgumentError) as info:
            step.delta(2, *bad, o)
        assert info.value.argument == name, info.value
        assert _pools(t) == before


def test_item11_float_tokens_are_named_as_a_dtype_problem() -> None:
    with pytest.raises(BatchError, match="dtype"):
        BatchAllocator(2).init(Batch(tokens=np.array([1.0, 2.0])))


# -- item 12: positions outside int32 --------------------------------------------------------------


def test_item12_batch_positions_outside_int32_are_refused() -> None:
    for pos in ([2**33], [2**31], [1, -(2**31) - 1], np.array([2**31], dtype=np.uint32)):
        b = BatchAllocator(2)
        with pytest.raises(BatchError) as info:
            b.init(Batch(tokens=[1] * len(pos), pos=pos))
        assert "int32" in str(info.value)
        assert b.n_tokens == 0
    with pytest.raises(BatchError, match="int32"):
        BatchAllocator(2).init(Batch(tokens=[2**40]))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_item12_shifts_and_divisors_outside_int32_are_refused(kind: str) -> None:
    mem = any_memory(kind)
    fill(mem, {0: [1, 2, 3]})
    before = fingerprint(mem)
    for call, name in (
        (lambda: mem.seq_add(0, 0, -1, 2**31), "delta"),
        (lambda: mem.seq_add(0, 0, -1, 2**31 - 2), "delta"),  # within int32, but position 2 would pass it
        (lambda: mem.seq_add(0, 0, 2**40, 1), "p1"),
        (lambda: mem.seq_div(0, 0, -1, 2**40), "d"),
        (lambda: mem.seq_div(0, 0, -1, 0), "d"),
        (lambda: mem.seq_add(0, 0, -1, 1.5), "delta"),
    ):
        with pytest.raises(ArgumentError) as info:
            call()
        assert info.value.argument == name, info.value
        assert fingerprint(mem) == before
    mem.state_write()  # nothing left that a blob cannot hold


def test_item12_hybrid_state_write_after_a_big_shift_is_refused_before() -> None:
    toy = HybridToy(DEV, make_hybrid(DEV))
    toy.decode({0: [1, 2]})
    with pytest.raises(ArgumentError, match="int32"):
        toy.mem.seq_add(0, 0, -1, 2**31)
    assert HybridMemory.state_write(toy.mem)  # the blob writes


def test_item_class_seq_add_drops_planes_of_positions_it_does_not_move() -> None:
    """A shift of the last position only: the planes of earlier positions would take
    labels of later tokens, so a rollback onto them is refused (parts stay together)."""
    toy = HybridToy(DEV, make_hybrid(DEV, n_rs_seq=2))
    mem = toy.mem
    toy.decode({1: [0, 0, 0]})  # positions 0, 1, 2 in one write: planes for 2, 1, 0
    mem.seq_add(1, 2, -1, -1)  # 2 -> 1: the attention holds 0, 1, 1
    parts_agree(mem)
    before = fingerprint(mem)
    assert mem.seq_rm(1, 1, -1) is False  # would need the state after position 0 alone
    assert fingerprint(mem) == before
    t = Toy(DEV, 1, n_rs_seq=2)
    t.decode({0: [1, 2, 3]})
    t.mem.seq_add(0, 2, -1, 5)  # only position 2 moves (to 7)
    assert t.mem.seq_rm(0, 7, -1) is False  # position 6 never existed
    t.mem.seq_add(0, 0, -1, 1)  # every position moves: the plane of the shifted write stays
    t2 = Toy(DEV, 1, n_rs_seq=2)
    t2.decode({0: [1, 2, 3]})
    t2.mem.seq_add(0, 0, -1, 4)
    assert t2.mem.seq_rm(0, 6, -1)  # a rollback of one over the whole shifted history is exact
    assert t2.mem.seq_pos_max(0) == 5
    _, ref = oracle(DEV, t2.tables, [1, 2])
    got = t2.state(0)
    for layer in ref:
        for name in ref[layer]:
            np.testing.assert_allclose(got[layer][name], ref[layer][name], atol=3e-5)


@pytest.mark.parametrize("kind", ["kv", "kv_iswa", "hybrid"])
def test_item6_class_no_edit_leaves_a_sequence_at_one_whole_position_twice(kind: str) -> None:
    """A blob with one sequence at one (pos, x, y) twice is refused, so no edit may
    produce that book either (the memory must read back what it writes): a shift
    that lands a cell on another of its sequence's is refused, nothing changed."""
    mem = any_memory(kind)
    fill(mem, {0: [1, 2, 3]})
    mem.seq_add(0, 2, -1, -1)  # 2 -> 1: another cell holds 1, but with another extension (from position 1)
    fill(mem, {0: [4]})  # a new cell at 2, extension (2, 2): the one moved from 2 has it too
    before = fingerprint(mem)
    with pytest.raises(ArgumentError) as info:
        mem.seq_add(0, 2, -1, -1)
    assert info.value.argument == "delta"
    assert fingerprint(mem) == before
    assert mem.init_update().apply()  # the pending K shift
    blob = mem.state_write()
    mem.state_read(blob)  # every reachable book reads back
    assert mem.state_write() == blob


def test_item6_class_mrope_batch_repeating_a_whole_position_is_refused() -> None:
    pos = np.array([[5, 5], [1, 1], [2, 2], [0, 0]])  # two patches at t=5, y=1, x=2
    with pytest.raises(BatchError, match="twice") as info:
        BatchAllocator(2).init(Batch(embd=np.zeros((2, 3), np.float32), pos=pos))
    assert info.value.rule == "pos_duplicate"
