"""Undo after a failed compute on hybrid-idx (llama-memory-spec §10 item 22 with
kpool-spec K.3/K.4/K.7): besides the attention, indexer and recurrent books,
undo puts back the k-pool layout, the stale marks (also when the first ubatch's
``next()`` cleared them) and the context's ``i_cur`` / ``kpool_state``, so
applying the same ubatches again gives the same k-pool inputs and ends in the
same memory as a twin that never failed.  It refuses, changing nothing, when
the memory was edited since, also by edits the recurrent part does not see."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hybrid_toy import ATTN, E, HybridToy, emb, make_hybrid, run_layers
from test_hybrid import books, check, same_books

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.kpool import POS_CLEAN, rebuild
from statecache.memory import ContextError, MemoryStatus

C = POS_CLEAN
BATCH = {0: [20, 21, 22, 23, 24], 1: [25, 26], 2: [27, 28, 29]}


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def scenario(dev, by_order: bool, edit: str, n_rs_seq: int = 2) -> HybridToy:  # type: ignore[no-untyped-def]
    """Two sequences decoded, then ``edit`` sets stale marks (or not) before the batch."""
    toy = HybridToy(dev, make_hybrid(dev, "idx", size=32, n_rs_seq=n_rs_seq))
    mem = toy.mem
    mem.layout.by_order = by_order
    toy.decode({0: list(range(10)), 1: [4, 5, 6, 7, 8]})
    if edit == "rollback":
        assert mem.seq_rm(0, 8, -1)
    elif edit == "add+1":
        mem.seq_add(0, 5, -1, 1)
        assert mem.init_update().apply()
    elif edit == "head":
        assert mem.seq_rm(0, 0, 2)  # pos_min moves: every pool of 0 regroups
    want = {"none": C, "rollback": 8, "add+1": 5, "head": 0}[edit]
    assert mem.marks.copy().tolist() == [want, C, C]
    return toy


def plan(toy: HybridToy, batch=BATCH, n_ubatch: int = 4):  # type: ignore[no-untyped-def]
    balloc = BatchAllocator(toy.mem.n_seq_max)
    balloc.init(Batch.for_sequences(batch, output_all=True), toy.mem)
    ctx = toy.mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    return ctx


def compute(toy: HybridToy, ctx, keep: bool) -> None:  # type: ignore[no-untyped-def]
    """The graph of the applied ubatch: recurrent step, attention K/V rows, indexer rows."""
    ub = ctx.get_ubatch()
    run_layers(toy.dev, ctx.recr.step(keep_undo_rows=keep), toy.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
    ctx.attn.cpy_k(ATTN, np.stack([emb(int(t), 1) for t in ub.token]))
    ctx.attn.cpy_v(ATTN, np.stack([emb(int(t), 2) for t in ub.token]))
    ctx.idx.cpy_k(ATTN, np.stack([emb(int(t), 4)[:E] for t in ub.token]))


def drive(toy: HybridToy, ctx, n: int | None = None, fail: str | None = None) -> list:  # type: ignore[no-untyped-def]
    """Apply ``n`` ubatches from the current one (default: to the end); each computes and
    moves on, except the last one when ``fail`` says how it fails ("never": before the
    graph, "kept": after it with rows kept, "ran": after it, rows not kept).
    Returns ``(kpool_state, kpool_inputs)`` of every apply."""
    ctx.keep_undo_rows = fail != "ran"
    out = []
    k = 0
    while True:
        assert ctx.apply()
        out.append((ctx.kpool_state, ctx.kpool_inputs(n_sel=7, with_pos=True)))
        k += 1
        last = n is not None and k == n
        if last and fail == "never":
            return out
        compute(toy, ctx, keep=fail != "ran")
        if last and fail is not None:
            return out
        if not ctx.next() or last:
            return out


def same_inputs(a, b) -> None:  # type: ignore[no-untyped-def]
    (sa, ia), (sb, ib) = a, b
    assert (sa.n_pool_real, sa.n_kpool, sa.n_new, sa.n_new_g) == (sb.n_pool_real, sb.n_kpool, sb.n_new, sb.n_new_g)
    np.testing.assert_array_equal(sa.is_new, sb.is_new)
    for f in dataclasses.fields(ia):
        x, y = getattr(ia, f.name), getattr(ib, f.name)
        assert (x is None) == (y is None), f.name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=f.name)


def state_of(mem):  # type: ignore[no-untyped-def]
    """Books (with marks), the k-pool layout of every sequence, and the whole state blob."""
    return books(mem), [s.copy() for s in mem.layout.seqs], mem.state_write()


def assert_same_state(a, b) -> None:  # type: ignore[no-untyped-def]
    assert same_books(a[0], b[0])
    assert a[1] == b[1]  # pools per sequence (cells, pos_min, pools, scan point)
    assert a[2] == b[2]


def ctx_state(ctx):  # type: ignore[no-untyped-def]
    return ctx.i_cur, ctx._state_for, ctx.kpool_state, len(ctx._undo_log)


@pytest.mark.parametrize("again", ["same_ctx", "replan"])
@pytest.mark.parametrize("fail", ["never", "kept"])
@pytest.mark.parametrize("edit", ["none", "rollback", "add+1", "head"])
@pytest.mark.parametrize("by_order", [False, True])
def test_undo_all_restores_kpool_state_and_again_matches_a_twin(dev, by_order, edit, fail, again) -> None:
    toy, twin = scenario(dev, by_order, edit), scenario(dev, by_order, edit)
    before = state_of(toy.mem)
    ctx = plan(toy)
    n_ub = len(ctx.recr.ubatches)
    assert n_ub >= 3
    first = drive(toy, ctx, n_ub, fail=fail)  # every ubatch applied, the last one fails
    assert len(first) == n_ub
    assert toy.mem.marks.is_clean(0)  # the first ubatch's next() cleared them
    if edit in ("add+1", "head"):
        assert first[0][0].n_new >= 1  # stale pools were due for re-pooling
    assert ctx.undo() == ()
    assert_same_state(state_of(toy.mem), before)  # marks are back, layout too
    assert ctx.i_cur == 0 and ctx.recr.i_next == 0
    with pytest.raises(ContextError, match="after apply"):
        ctx.n_kpool()
    second = drive(toy, ctx if again == "same_ctx" else plan(toy))
    ref = drive(twin, plan(twin))
    assert len(second) == len(ref) == n_ub
    for a, b, r in zip(first, second, ref, strict=True):
        same_inputs(a, r)  # the failed attempt saw what a batch that never failed sees
        same_inputs(b, r)
    assert_same_state(state_of(toy.mem), state_of(twin.mem))


@pytest.mark.parametrize("edit", ["none", "head"])
@pytest.mark.parametrize("by_order", [False, True])
def test_undo_last_ubatch_then_all_across_the_marks_clearing_next(dev, by_order, edit) -> None:
    toy, twin = scenario(dev, by_order, edit), scenario(dev, by_order, edit)
    mem = toy.mem
    before = state_of(mem)
    ctx = plan(toy)
    first = drive(toy, ctx, 1)  # ubatch 0 computes; next() clears the marks
    assert mem.marks.copy().tolist() == [C, C, C]
    mid, mid_ctx = state_of(mem), ctx_state(ctx)
    failed = drive(toy, ctx, 1, fail="kept")
    assert ctx.undo(1) == ()
    assert_same_state(state_of(mem), mid)  # the marks stay cleared: ubatch 0 did compute
    assert ctx_state(ctx) == mid_ctx and ctx.i_cur == 1
    with pytest.raises(ContextError, match="after apply"):
        ctx.kpool_inputs()
    redo = drive(toy, ctx, 1, fail="kept")
    same_inputs(failed[0], redo[0])
    assert ctx.undo() == ()  # both ubatches, across the next() that cleared the marks
    assert_same_state(state_of(mem), before)
    assert ctx.i_cur == 0
    full = drive(toy, ctx)
    ref = drive(twin, plan(twin))
    same_inputs(first[0], ref[0])
    for a, r in zip(full, ref, strict=True):
        same_inputs(a, r)
    assert_same_state(state_of(mem), state_of(twin.mem))


def test_lossy_undo_drops_sequences_and_marks_them(dev) -> None:
    toy = scenario(dev, False, "head", n_rs_seq=0)
    mem = toy.mem
    ctx = plan(toy, {0: [8], 1: [9]})
    drive(toy, ctx, fail="ran")
    assert ctx.undo_loses() == (0, 1)  # both live recurrent rows were overwritten in place
    version = mem.version
    with pytest.raises(ContextError, match="cannot be exact"):
        ctx.undo()  # a lossy undo is asked for, not silent
    assert mem.version == version
    assert ctx.undo(drop=True) == (0, 1)
    for s in (0, 1):
        assert mem.recr.seq_pos_max(s) == mem.attn.seq_pos_max(s) == mem.idx.seq_pos_max(s) == -1
        toy.forget(s)
    assert mem.marks.copy().tolist() == [0, 0, C]  # dropped through the hybrid-idx seq_rm
    out = toy.decode({0: [1, 2, 3, 4, 5, 6], 1: [3, 4, 5, 6, 7]})
    check(toy, out, (0, 1))
    for s in (0, 1):
        strm, pairs = mem.pairs_of(s)
        assert mem.layout.seqs[s] == rebuild(pairs, strm, mem.layout.kpool, mem.layout.by_order)
        assert len(mem.layout.seqs[s].pools) == 1


@pytest.mark.parametrize("edit", ["seq_cp", "hole", "div1", "update", "between"])
def test_undo_refused_after_the_memory_changed(dev, edit) -> None:
    """Refused, nothing changed; "hole", "div1" and "update" are edits the recurrent part
    does not see (only the attention/indexer cells, the marks or the shifts change).
    "between": an edit between the two applies makes the second one stale (refused too)."""
    toy = scenario(dev, False, "none")
    mem = toy.mem
    if edit == "update":
        mem.seq_add(1, 2, -1, 1)  # a pending attention shift (mark of 1 -> 2)
    ctx = plan(toy, {0: [20, 21, 22, 23, 24, 25]})
    assert len(ctx.recr.ubatches) == 2
    drive(toy, ctx, 1)
    if edit == "between":
        mem.seq_div(1, 0, -1, 1)  # between the two applies: marks 1 only
        mid, mid_ctx = state_of(mem), ctx_state(ctx)
        with pytest.raises(ContextError, match="changed"):  # the second ubatch's plan is stale (issue 12 item 1)
            ctx.apply()
        assert_same_state(state_of(mem), mid)
        assert ctx_state(ctx) == mid_ctx
        with pytest.raises(ContextError, match="changed"):  # and the first was applied before the edit
            ctx.undo()
        assert_same_state(state_of(mem), mid)
        return
    drive(toy, ctx, 1, fail="kept")
    v_recr = mem.recr._version
    if edit == "seq_cp":
        mem.seq_cp(1, 2)
    elif edit == "hole":
        assert mem.seq_rm(1, 1, 2)  # the recurrent part accepts it as a no-op on its state
    elif edit == "div1":
        mem.seq_div(1, 0, -1, 1)  # changes only the mark of 1
    elif edit == "update":
        assert mem.init_update().apply()
    if edit != "seq_cp":
        assert mem.recr._version == v_recr  # the recurrent part alone would not refuse
    after, after_ctx = state_of(mem), ctx_state(ctx)
    inputs = (ctx.kpool_state, ctx.kpool_inputs(n_sel=7, with_pos=True))
    with pytest.raises(ContextError, match="changed"):
        ctx.undo()
    assert_same_state(state_of(mem), after)
    assert ctx_state(ctx) == after_ctx
    same_inputs(inputs, (ctx.kpool_state, ctx.kpool_inputs(n_sel=7, with_pos=True)))
