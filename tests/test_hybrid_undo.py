"""Undo after a failed compute through the hybrid memories (spec §10 item 22):
the recurrent part undoes (exactly, or by dropping damaged sequences), the K/V
rows a ubatch took from cells the old attention book still uses (sliding-window
reuse) come back (or their sequences are dropped), and the attention books go
back to their state before apply().  An undo is refused, changing nothing, when
the memory was edited since the first ubatch it would take back was applied, also
by an edit only the attention part sees."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import ATTN, E, HybridToy, emb, make_hybrid, run_layers
from recurrent_toy import toy_spec
from test_hybrid import books, check, same_books

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.hybrid import HybridISWAMemory
from statecache.kv_cache import KVCacheISWA, KVLayer
from statecache.memory import ContextError, MemoryStatus
from statecache.recurrent import RecurrentMemory


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def compute(toy: HybridToy, ctx, keep: bool) -> None:  # type: ignore[no-untyped-def]
    """The graph of the applied ubatch: recurrent step, attention K/V rows."""
    ub = ctx.get_ubatch()
    run_layers(toy.dev, ctx.recr.step(keep_undo_rows=keep), toy.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
    actx = ctx.attn.swa if isinstance(toy.mem.attn, KVCacheISWA) else ctx.attn
    actx.cpy_k(ATTN, np.stack([emb(int(t), 1) for t in ub.token]))
    actx.cpy_v(ATTN, np.stack([emb(int(t), 2) for t in ub.token]))


def plan(toy: HybridToy, batch, n_ubatch: int = 4):  # type: ignore[no-untyped-def]
    balloc = BatchAllocator(toy.mem.n_seq_max)
    balloc.init(Batch.for_sequences(batch, output_all=True), toy.mem)
    ctx = toy.mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    return ctx


def failing_decode(toy: HybridToy, batch, mode: str, n_ubatch: int = 4):
    """Apply every ubatch of ``batch``; all compute fine except the last, which fails as
    ``mode`` says ("never": before the graph, "kept": after it, rows kept, "ran": after
    it, rows not kept).  Returns what undo() returned."""
    ctx = plan(toy, batch, n_ubatch)
    ctx.keep_undo_rows = mode != "ran"
    while True:
        assert ctx.apply()
        last = ctx.recr.i_next == len(ctx.recr.ubatches) - 1
        if not (last and mode == "never"):
            compute(toy, ctx, keep=mode != "ran")
        if last:
            lost = ctx.undo_loses()
            if lost:  # refused, changing nothing, unless asked for
                version = toy.mem.version
                with pytest.raises(ContextError, match="cannot be exact"):
                    ctx.undo()
                assert toy.mem.version == version
            dropped = ctx.undo(drop=True)
            assert dropped == lost
            return ctx, dropped
        assert ctx.next()


def history(toy: HybridToy) -> None:
    toy.decode({0: [1, 2, 3], 1: [4, 5]})
    toy.decode({0: [6], 1: [7]})


@pytest.mark.parametrize("mode", ["never", "kept"])
@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_item22_hybrid_exact_undo_then_redecode(dev, kind: str, mode: str) -> None:
    toy = HybridToy(dev, make_hybrid(dev, kind, n_rs_seq=2))
    history(toy)
    before = books(toy.mem)
    batch = {0: [8, 9, 10], 1: [11], 2: [12, 13]}
    _, dropped = failing_decode(toy, batch, mode)
    assert dropped == ()
    assert same_books(before, books(toy.mem))
    out = toy.decode(batch)
    check(toy, out, (0, 1, 2))


@pytest.mark.parametrize("kind", ["hybrid", "idx"])
def test_item22_hybrid_lossy_undo_drops_from_every_part(dev, kind: str) -> None:
    toy = HybridToy(dev, make_hybrid(dev, kind))
    history(toy)
    pos = {s: toy.mem.seq_pos_max(s) for s in (0, 1)}
    _, dropped = failing_decode(toy, {0: [8], 1: [9]}, "ran")
    assert dropped == (0, 1)  # both live rows were overwritten in place
    for s in (0, 1):
        assert pos[s] >= 0
        assert toy.mem.recr.seq_pos_max(s) == -1 and toy.mem.attn.seq_pos_max(s) == -1
        toy.forget(s)
    out = toy.decode({0: [1, 2], 1: [3]})  # the memory keeps working from scratch for them
    check(toy, out, (0, 1))


def state_of(mem):  # type: ignore[no-untyped-def]
    """Books of every part (with the hybrid-idx marks) and the whole state blob."""
    return books(mem), mem.state_write()


def assert_same_state(a, b) -> None:  # type: ignore[no-untyped-def]
    assert same_books(a[0], b[0])
    assert a[1] == b[1]


def decoded(toy: HybridToy, batch) -> None:  # type: ignore[no-untyped-def]
    """The oracle's side of a batch decoded outside :meth:`HybridToy.decode`."""
    for s, ts in batch.items():
        hist = toy.attn_hist.setdefault(s, [])
        p0 = hist[-1][0] + 1 if hist else 0
        toy.recr_tokens.setdefault(s, []).extend(ts)
        hist.extend((p0 + k, t) for k, t in enumerate(ts))


def hole(toy: HybridToy, s: int, p0: int, p1: int) -> None:
    """``seq_rm(s, p0, p1)`` strictly inside the history: only the attention part
    changes (the recurrent part accepts it as a no-op on its state and its version)."""
    v_recr = toy.mem.recr._version
    assert toy.mem.seq_rm(s, p0, p1)
    assert toy.mem.recr._version == v_recr  # the recurrent part alone would not refuse an undo
    toy.attn_hist[s] = [(p, t) for p, t in toy.attn_hist[s] if not p0 <= p < p1]


@pytest.mark.parametrize("edit", ["hole", "update"])
@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_item22_undo_refused_after_an_attention_only_edit(dev, kind: str, edit: str) -> None:
    """After the ubatch was applied (it failed after its graph, rows kept), an edit only
    the attention part sees: a hole inside a history, or an applied update (the pending
    shift of an earlier seq_add).  Restoring the attention books would silently take it
    back: undo is refused, and every book and the state blob are as after the edit."""
    toy = HybridToy(dev, make_hybrid(dev, kind))
    history(toy)  # sequence 0 at positions 0..3, sequence 1 at 0..2
    mem = toy.mem
    if edit == "update":
        mem.seq_add(1, 2, -1, 1)  # a pending attention shift of sequence 1, before the batch
        toy.attn_hist[1] = [(p + (p >= 2), t) for p, t in toy.attn_hist[1]]
    batch = {0: [8, 9]}
    ctx = plan(toy, batch)
    ctx.keep_undo_rows = True
    assert ctx.apply()
    compute(toy, ctx, keep=True)
    if edit == "hole":
        hole(toy, 1, 1, 2)
    else:
        v_recr = mem.recr._version
        assert mem.init_update().apply()
        assert mem.recr._version == v_recr
    after = state_of(mem)
    for n in (None, 1):
        with pytest.raises(ContextError, match="changed"):
            ctx.undo(n)
        assert_same_state(state_of(mem), after)
    assert not ctx.next()  # the batch stands (its graph did run): the memory keeps working
    decoded(toy, batch)
    check(toy, toy.decode({0: [30], 1: [31]}), (0, 1))


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_item22_edit_between_two_applies_makes_the_rest_of_the_plan_stale(dev, kind: str) -> None:
    """An attention-only edit after the first ubatch was applied and before the second:
    the second ubatch was planned on the books before the edit, so applying it is refused
    (issue 12 item 1: ContextError, nothing changed), and undoing the first would take the
    edit back (refused, nothing changed).  The runtime plans the rest again, and the batch
    then completes as one that never failed."""
    toy = HybridToy(dev, make_hybrid(dev, kind))
    history(toy)
    mem = toy.mem
    batch = {0: [20, 21, 22, 23, 24, 25]}
    ctx = plan(toy, batch)
    assert len(ctx.recr.ubatches) == 2
    ctx.keep_undo_rows = True
    assert ctx.apply()
    compute(toy, ctx, keep=True)
    assert ctx.next()
    hole(toy, 1, 1, 2)
    mid = state_of(mem)
    with pytest.raises(ContextError, match="changed"):
        ctx.apply()
    assert_same_state(state_of(mem), mid)
    for n in (None, 1):
        with pytest.raises(ContextError, match="changed"):
            ctx.undo(n)  # the first ubatch was applied before the edit
        assert_same_state(state_of(mem), mid)
    decoded(toy, {0: batch[0][:4]})  # the first ubatch computed
    check(toy, toy.decode({0: batch[0][4:]}), (0,))  # the rest, planned again
    check(toy, toy.decode({0: [30], 1: [31]}), (0, 1))


@pytest.mark.parametrize("kind", ["hybrid", "iswa"])
def test_item22_seq_rm_of_nothing_keeps_undo(dev, kind: str) -> None:
    """Only a seq_rm that changes something counts as an edit: removing an empty
    sequence or a range past the end leaves the applied ubatch undoable, exactly."""
    toy = HybridToy(dev, make_hybrid(dev, kind))
    history(toy)
    mem = toy.mem
    before = state_of(mem)
    ctx = plan(toy, {0: [8, 9]})
    ctx.keep_undo_rows = True
    assert ctx.apply()
    compute(toy, ctx, keep=True)
    assert mem.seq_rm(2, -1, -1) and mem.seq_rm(1, 10, -1)
    assert ctx.undo() == ()
    assert_same_state(state_of(mem), before)
    check(toy, toy.decode({0: [30], 1: [31]}), (0, 1))


def small_window_toy(dev) -> HybridToy:
    """One sequence, window 4, rollback depth 2, a window cache of exactly
    n_swa + n_rs_seq + n_ubatch = 10 cells (n_pad 1): once it is full, every new
    token reuses the oldest cell no token after a rollback can see."""
    recr = RecurrentMemory(toy_spec(), dev, n_seq_max=1, n_rs_seq=2)
    common = dict(n_seq_max=1, unified=True, dtype="f32", n_pad=1)
    attn = KVCacheISWA(dev, [KVLayer(ATTN, E, E)], [ATTN], size=32, n_ubatch=4, n_swa=4, rollback_depth=2, **common)
    mem = HybridISWAMemory(attn, recr)
    mem.fill_garbage(5)
    assert attn.swa.size == 10
    return HybridToy(dev, mem)


def window_rows(toy: HybridToy) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """K and V rows of every cell the window cache's book uses."""
    swa = toy.mem.attn.swa
    used = np.flatnonzero(swa.cells[0].pos >= 0)
    return {int(c): (swa.k[ATTN].numpy()[c].copy(), swa.v[ATTN].numpy()[c].copy()) for c in used}


@pytest.mark.parametrize("mode", ["kept", "ran"])
def test_item22_iswa_undo_puts_back_reused_window_rows(dev, mode: str) -> None:
    """The failed batch is placed into one empty cell and three cells holding positions
    0..2 (still in the old book; masked for every token the sequence can continue with,
    after a rollback by n_rs_seq = 2 too).  Exact undo puts their rows back byte for
    byte, and the memory then decodes (after a rollback by 2) as a from-zero recompute;
    without kept rows the sequence is dropped instead."""
    toy = small_window_toy(dev)
    toy.decode({0: [1, 2, 3, 4, 5]}, n_ubatch=5)
    toy.decode({0: [6, 7, 8, 9]}, n_ubatch=4)  # P = 8; the cache is full, one ubatch of 4 (rollback depth 2)
    before_books, before_rows = books(toy.mem), window_rows(toy)
    ctx, dropped = failing_decode(toy, {0: [20, 21, 22, 23]}, mode)
    reused = set(ctx.attn.swa.sinfos[0].cells.tolist()) & set(before_rows)
    assert len(reused) == 3  # the failed ubatch did overwrite rows the old book still uses
    if mode == "ran":
        assert dropped == (0,)
        assert toy.mem.seq_pos_max(0) == -1 and toy.mem.attn.swa.seq_pos_max(0) == -1
        toy.forget(0)
        check(toy, toy.decode({0: [3, 1, 4]}), (0,))
        return
    assert dropped == ()
    assert same_books(before_books, books(toy.mem))
    after = window_rows(toy)
    assert after.keys() == before_rows.keys()
    for c, (k, v) in before_rows.items():
        assert np.array_equal(after[c][0], k) and np.array_equal(after[c][1], v), c
    assert toy.mem.seq_rm(0, 7, -1)  # rollback by 2: position 4 is visible again
    del toy.recr_tokens[0][-2:]
    del toy.attn_hist[0][-2:]
    check(toy, toy.decode({0: [11]}), (0,))
    check(toy, toy.decode({0: [12, 13, 14]}), (0,))


def test_item22_iswa_undo_rows_kept_only_when_asked(dev) -> None:
    """Keeping rows costs copies only for reused cells, and only when asked."""
    toy = small_window_toy(dev)
    toy.decode({0: list(range(10))}, n_ubatch=5)
    balloc = BatchAllocator(1)
    balloc.init(Batch.for_sequences({0: [1, 2]}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 4)
    assert ctx.keep_undo_rows is False  # the recurrent memory's default
    assert ctx.apply()
    rec = ctx.attn.swa._records[-1]
    assert rec.saved is None and rec.overwrites.size == 2
    assert ctx.attn.base._records[-1].overwrites.size == 0  # the full cache never reuses a cell


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_item22_undo_refused_after_another_batch_was_applied(dev, kind: str) -> None:
    """A batch of another sequence applied after this one: its cells are in the attention
    book now, so taking this batch's cells back (its journal) would take them back too.
    Undo is refused, every book and the state blob stay as they are, and both batches stand."""
    toy = HybridToy(dev, make_hybrid(dev, kind))
    history(toy)
    mem = toy.mem
    first = {0: [8, 9]}
    ctx = plan(toy, first)
    ctx.keep_undo_rows = True
    assert ctx.apply()
    compute(toy, ctx, keep=True)
    assert not ctx.next()
    decoded(toy, first)
    check(toy, toy.decode({1: [10, 11]}), (1,))
    after = state_of(mem)
    for n in (None, 1):
        with pytest.raises(ContextError, match="changed"):
            ctx.undo(n)
        assert_same_state(state_of(mem), after)
    check(toy, toy.decode({0: [30], 1: [31]}), (0, 1))
