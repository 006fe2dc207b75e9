"""Hybrid, hybrid-iSWA and hybrid-idx composition (spec §4, §8.3-8.4, §10 items
43-49), with the recurrent toy plus one attention layer, garbage-filled buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import HybridToy, make_hybrid

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, StateError
from statecache.kv_cache import KVCacheISWA
from statecache.memory import MemoryStatus, StateFlags, status_combine

KINDS = ["hybrid", "iswa", "idx"]
#: (memory kind, part made to fail): the indexer exists only in hybrid-idx
VICTIMS = [(k, v) for k in KINDS for v in ("attn", "recr", *(("idx",) if k == "idx" else ()))]


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def books(mem):
    """Everything that must not change: every KV book, the recurrent book, k-pool marks."""
    caches = list(mem.kv_caches) + ([mem.idx] if hasattr(mem, "idx") else [])
    kv = [([c.clone() for c in cache.cells], list(cache.book.heads), list(cache.pending_copies)) for cache in caches]
    marks = mem.marks.copy().tolist() if hasattr(mem, "marks") else None
    return kv, mem.recr.book_snapshot(), marks


def same_books(a, b):
    (kva, ra, ma), (kvb, rb, mb) = a, b
    for (ca, ha, pa), (cb, hb, pb) in zip(kva, kvb, strict=True):
        if ha != hb or pa != pb or not all(x.same_as(y) for x, y in zip(ca, cb, strict=True)):
            return False
    return ra.same(rb) and ma == mb


def check(toy, outs, seqs):
    for s in seqs:
        pos = toy.attn_hist[s][-1][0]
        np.testing.assert_allclose(outs[(s, pos)], toy.expected(s), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_matches_oracle(dev, kind):
    toy = HybridToy(dev, make_hybrid(dev, kind))
    rng = np.random.default_rng(2)
    for _ in range(5):
        batch = {s: rng.integers(0, 32, size=int(rng.integers(1, 4))).tolist() for s in (0, 1)}
        out = toy.decode(batch, n_ubatch=4)
        check(toy, out, (0, 1))


@pytest.mark.parametrize("kind", KINDS)
def test_item43_seq_rm_atomic_when_recurrent_refuses(dev, kind):
    toy = HybridToy(dev, make_hybrid(dev, kind))
    toy.decode({0: [1, 2, 3, 4, 5]})
    before = books(toy.mem)
    assert toy.mem.seq_rm(0, 2, -1) is False  # partial tail removal, no rollback budget
    assert same_books(before, books(toy.mem))
    with pytest.raises(ArgumentError, match="outside"):  # out-of-range id: refused loudly (issue 14)
        toy.mem.seq_rm(7, 0, -1)
    assert toy.mem.seq_rm(-1, 1, 3) is False
    assert same_books(before, books(toy.mem))


@pytest.mark.parametrize("kind", KINDS)
def test_item44_attention_prepare_failure_leaves_recurrent_unchanged(dev, kind):
    toy = HybridToy(dev, make_hybrid(dev, kind, size=24))
    toy.decode({0: [1, 2, 3]})
    before = books(toy.mem)
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({1: list(range(30))}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    assert ctx.status is MemoryStatus.FAILED_PREPARE
    assert same_books(before, books(toy.mem))
    # recurrent plan failure (more sequences than cells) also changes nothing
    toy.mem.recr.prepare = lambda ubs: None
    balloc.init(Batch.for_sequences({1: [1]}), toy.mem)
    assert toy.mem.init_batch(balloc, 8).status is MemoryStatus.FAILED_PREPARE
    assert same_books(before, books(toy.mem))


@pytest.mark.parametrize("kind", KINDS)
def test_item45_positions_merge(dev, kind):
    toy = HybridToy(dev, make_hybrid(dev, kind))
    toy.decode({0: [1, 2, 3, 4]})
    mem = toy.mem
    assert mem.seq_pos_min(0) == max(mem.attn.seq_pos_min(0), mem.recr.seq_pos_min(0)) == 3
    assert mem.seq_pos_max(0) == 3
    # a sequence present only in attention reports -1
    for cache in mem.kv_caches:
        cache.seq_cp(0, 2)
    assert mem.attn.seq_pos_max(2) == 3 and mem.recr.seq_pos_max(2) == -1 and mem.seq_pos_max(2) == -1


@pytest.mark.parametrize("kind", KINDS)
def test_item46_context_shift(dev, kind):
    """seq_rm(s, n_keep, n_keep + n_discard) + seq_add: true, both parts shift together,
    and decoding continues: attention over the kept tokens, recurrent over all."""
    toy = HybridToy(dev, make_hybrid(dev, kind, size=24))
    toks = list(range(1, 11))
    toy.decode({0: toks})
    n_keep, n_discard = 2, 4
    assert toy.mem.seq_rm(0, n_keep, n_keep + n_discard) is True
    toy.mem.seq_add(0, n_keep + n_discard, -1, -n_discard)
    assert toy.mem.seq_pos_max(0) == toy.mem.attn.seq_pos_max(0) == toy.mem.recr.seq_pos_max(0) == 5
    upd = toy.mem.init_update()
    assert upd.status is MemoryStatus.SUCCESS
    assert upd.apply()
    assert toy.mem.init_update().status is MemoryStatus.NO_UPDATE
    hist = toy.attn_hist[0]
    toy.attn_hist[0] = hist[:n_keep] + [(p - n_discard, t) for p, t in hist[n_keep + n_discard :]]
    out = toy.decode({0: [20, 21]})
    check(toy, out, (0,))
    assert toy.mem.seq_pos_max(0) == 7
    for cache in toy.mem.kv_caches:
        held = sorted(p for p, _ in cache.cells[0].seq_pos[0])
        assert held == list(range(held[0], 8))


@pytest.mark.parametrize("kind", KINDS)
def test_item47_state_round_trip_and_atomic_failure(dev, kind):
    src = HybridToy(dev, make_hybrid(dev, kind, seed=1))
    src.decode({0: [3, 4, 5, 6], 1: [7, 8]})
    blob = src.mem.state_write(0)
    dst = HybridToy(dev, make_hybrid(dev, kind, seed=2))
    dst.decode({2: [9, 9, 9]})
    dst.mem.state_read(blob, 1)
    dst.recr_tokens[1], dst.attn_hist[1] = list(src.recr_tokens[0]), list(src.attn_hist[0])
    out = dst.decode({1: [10]})
    check(dst, out, (1,))
    # a blob whose *recurrent* section is corrupt: no part keeps a half-restored sequence
    good = bytearray(src.mem.state_write(0))
    bad = good[:-3]
    fresh = HybridToy(dev, make_hybrid(dev, kind, seed=3))
    fresh.decode({2: [9, 9]})
    before_other = fresh.mem.seq_pos_max(2)
    with pytest.raises(StateError):
        fresh.mem.state_read(bytes(bad), 1)
    assert fresh.mem.attn.seq_pos_max(1) == -1 and fresh.mem.recr.seq_pos_max(1) == -1
    assert fresh.mem.seq_pos_max(2) == before_other
    if hasattr(fresh.mem, "idx"):
        assert fresh.mem.idx.seq_pos_max(1) == -1


@pytest.mark.parametrize("kind", KINDS)
def test_item38_partial_only(dev, kind):
    src = HybridToy(dev, make_hybrid(dev, kind))
    src.decode({0: [3, 4, 5, 6]})
    full = src.mem.state_write(0)
    part = src.mem.state_write(0, StateFlags.PARTIAL_ONLY)
    assert len(part) < len(full)
    # Into a sequence whose full attention does not reach the checkpoint: the next token would
    # attend after a hole.  Upstream accepts it; we refuse it, the memory unchanged [REC].
    dst = HybridToy(dev, make_hybrid(dev, kind))
    before, blob = books(dst.mem), dst.mem.state_write()
    with pytest.raises(StateError, match=r"restores state up to position 3.*end at -1"):
        dst.mem.state_read(part, 0, StateFlags.PARTIAL_ONLY)
    assert same_books(before, books(dst.mem)) and dst.mem.state_write() == blob
    # The checkpoint flow (upstream's server): the sequence went on past the checkpoint; the
    # partial read takes the parts a truncation cannot rebuild back to position 3, seq_rm cuts
    # the full attention back, and decoding continues as if 7 and 8 had never been decoded.
    src.decode({0: [7, 8]})
    src.mem.state_read(part, 0, StateFlags.PARTIAL_ONLY)
    assert src.mem.recr.seq_pos_max(0) == 3
    if isinstance(src.mem.attn, KVCacheISWA):
        assert src.mem.attn.swa.seq_pos_max(0) == 3 and src.mem.attn.base.seq_pos_max(0) == 5
    assert src.mem.seq_rm(0, 4, -1) and src.mem.seq_pos_max(0) == 3
    src.recr_tokens[0], src.attn_hist[0] = src.recr_tokens[0][:4], src.attn_hist[0][:4]
    out = src.decode({0: [9]})
    np.testing.assert_allclose(out[(0, 4)], src.expected(0), rtol=1e-5, atol=1e-6)


def test_item48_idx_cells_follow_attention_and_partial_cp_refused(dev):
    toy = HybridToy(dev, make_hybrid(dev, "idx"))
    rng = np.random.default_rng(4)
    for step in range(6):
        toy.decode({s: rng.integers(0, 32, size=int(rng.integers(1, 3))).tolist() for s in (0, 1)})
        if step == 2:
            toy.mem.seq_cp(0, 2)
        if step == 4:
            toy.mem.seq_rm(2, -1, -1)
        for a, i in zip(toy.mem.attn.cells, toy.mem.idx.cells, strict=True):
            assert np.array_equal(a.pos, i.pos) and np.array_equal(a.seq, i.seq)
    before = books(toy.mem)
    with pytest.raises(ArgumentError, match="whole sequences"):
        toy.mem.seq_cp(0, 2, 1, -1)
    assert same_books(before, books(toy.mem))


def test_item49_status_combine_rule():
    S, N, FP, FC = (MemoryStatus.SUCCESS, MemoryStatus.NO_UPDATE, MemoryStatus.FAILED_PREPARE,
                    MemoryStatus.FAILED_COMPUTE)  # fmt: skip
    assert status_combine(S, N) is S and status_combine(N, N) is N
    assert status_combine(FP, FC) is FP and status_combine(FC, FP) is FC and status_combine(S, FC) is FC


# -- failure injection: each part's plan, apply and state read fails in turn ------------------


def parts_of(mem):
    out = {"attn": mem.attn, "recr": mem.recr}
    if hasattr(mem, "idx"):
        out["idx"] = mem.idx
    return out


@pytest.mark.parametrize(("kind", "victim"), VICTIMS)
def test_failure_injection_apply(dev, kind, victim):
    toy = HybridToy(dev, make_hybrid(dev, kind))
    toy.decode({0: [1, 2, 3]})
    before = books(toy.mem)
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({0: [4, 5], 1: [6]}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    assert ctx.status is MemoryStatus.SUCCESS
    target = {"attn": ctx.attn, "recr": ctx.recr, "idx": getattr(ctx, "idx", None)}[victim]

    def boom():
        raise RuntimeError("injected apply failure")

    target.apply = boom
    with pytest.raises(RuntimeError, match="injected"):
        ctx.apply()
    assert same_books(before, books(toy.mem))
    target.apply = lambda: False
    assert ctx.apply() is False
    assert same_books(before, books(toy.mem))
    # the memory still works afterwards
    out = toy.decode({0: [4]})
    check(toy, out, (0,))


@pytest.mark.parametrize(("kind", "victim"), VICTIMS)
def test_failure_injection_plan(dev, kind, victim):
    toy = HybridToy(dev, make_hybrid(dev, kind))
    parts = parts_of(toy.mem)
    toy.decode({0: [1, 2, 3]})
    before = books(toy.mem)
    part = parts[victim]
    if victim == "idx":  # the indexer has no plan of its own: it is placed into the attention slots
        part.prepare = lambda ubs: pytest.fail("the indexer must not search its own slots")
    else:
        part.prepare = lambda ubs: None
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({0: [4, 5]}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    if victim == "idx":
        assert ctx.status is MemoryStatus.SUCCESS
    else:
        assert ctx.status is MemoryStatus.FAILED_PREPARE
    assert same_books(before, books(toy.mem))


@pytest.mark.parametrize(("kind", "victim"), VICTIMS)
@pytest.mark.parametrize("seq", [1, -1])
def test_failure_injection_state_read_rejected_changes_nothing(dev, kind, victim, seq):
    """Any part rejecting its section (StateError while parsing) leaves the whole
    memory exactly as it was: every part parses and places before any writes."""
    src = HybridToy(dev, make_hybrid(dev, kind, seed=5))
    src.decode({0: [3, 4, 5], 1: [6]})
    blob = src.mem.state_write(0 if seq >= 0 else -1)
    dst = HybridToy(dev, make_hybrid(dev, kind, seed=6))
    parts = parts_of(dst.mem)
    dst.decode({1: [7, 7, 7], 2: [9, 9]})
    before = books(dst.mem)
    part = parts[victim]

    def bad_parse(*a, **k):
        raise StateError("injected", "parse failure")

    for name in ("state_parse", "parse_section", "parse_sections"):
        if hasattr(part, name):
            setattr(part, name, bad_parse)
    with pytest.raises(StateError, match="injected"):
        dst.mem.state_read(blob, seq)
    assert same_books(before, books(dst.mem))
    out = dst.decode({1: [8], 2: [4]})  # both sequences carry on as if nothing happened
    check(dst, out, (1, 2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seq", [1, -1])
def test_failure_while_writing_state_drops_the_destination_everywhere(dev, kind, seq):
    """A failure after validation (while writing rows) must not leave a
    half-restored sequence in any part: the destination is dropped from all."""
    src = HybridToy(dev, make_hybrid(dev, kind, seed=5))
    src.decode({0: [3, 4, 5], 1: [6]})
    blob = src.mem.state_write(0 if seq >= 0 else -1)
    dst = HybridToy(dev, make_hybrid(dev, kind, seed=6))
    dst.decode({1: [7, 7, 7], 2: [9, 9]})

    def broken_apply(*a, **k):
        raise RuntimeError("device lost while writing")

    dst.mem.recr.apply_section = broken_apply  # attention is written first, then this fails
    with pytest.raises(RuntimeError, match="device lost"):
        dst.mem.state_read(blob, seq)
    parts = parts_of(dst.mem)
    if seq >= 0:
        for p in parts.values():
            assert p.seq_pos_max(1) == -1
        assert dst.mem.seq_pos_max(2) == 1  # other sequences untouched
        del dst.mem.recr.apply_section
        out = dst.decode({2: [4]})
        check(dst, out, (2,))
    else:
        for p in parts.values():
            assert p.seq_pos_max(1) == -1 and p.seq_pos_max(2) == -1


@pytest.mark.parametrize("kind", KINDS)
def test_seq_cp_replaces_destination_in_every_part(dev, kind):
    """The recurrent part replaces dst's state; attention drops dst's old cells too."""
    toy = HybridToy(dev, make_hybrid(dev, kind))
    toy.decode({0: [1, 2], 1: [3, 4, 5, 6]})
    toy.mem.seq_cp(0, 1)
    assert toy.mem.seq_pos_max(1) == toy.mem.attn.seq_pos_max(1) == toy.mem.recr.seq_pos_max(1) == 1
    toy.mem.seq_cp(2, 1)  # copying an empty sequence empties dst everywhere
    assert toy.mem.attn.seq_pos_max(1) == toy.mem.recr.seq_pos_max(1) == -1


def test_rollback_across_a_context_shift_is_refused(dev):
    """After a hole is punched in the history (context shift), no plane holds a
    state for a position before the hole's end: such a rollback must be refused,
    while a rollback that stays after the hole is still exact."""
    from statecache.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec, make_memory

    spec = ModelSpec.build(
        2,
        recurrent={0: RecurrentLayerSpec.shortconv(n_embd=4, l_cache=3)},
        attention={1: AttentionLayerSpec(1, 4)},
        kv_dtype="f32",
    )
    mem = make_memory(spec, dev, 1, 5, n_ctx=32, n_pad=8)

    def decode(n):
        balloc = BatchAllocator(1)
        balloc.init(Batch.for_sequences({0: [1] * n}), mem)
        ctx = mem.init_batch(balloc, 16)
        while True:
            assert ctx.apply()
            if not ctx.next():
                break

    decode(5)  # positions 0..4
    decode(5)  # 5..9 in one ubatch: planes reach back to "after position 4"
    assert mem.seq_rm(0, 3, 7)  # discard 3..6 ...
    mem.seq_add(0, 7, -1, -4)  # ... and 7..9 become 3..5
    before = mem.recr.book_snapshot()
    # Plane 4 holds the state after old position 5: it still holds token 2's
    # successors that were discarded, so it is no rollback to "after position 1".
    assert not mem.seq_rm(0, 2, -1)
    assert mem.recr.book_snapshot().same(before)
    assert mem.seq_pos_max(0) == 5
    # Undoing the last token (after the hole) is still exact and accepted.
    assert mem.seq_rm(0, 5, -1)
    assert mem.seq_pos_max(0) == 4
