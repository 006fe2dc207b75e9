"""Undo after a failed compute (spec §1.3 [REC], §10 item 22): the ubatch's state
changes are not visible afterwards.

Every scenario decodes a batch, applies it, "fails" the compute at some
point (before the step, after part of the step, after the whole step), undoes
and decodes the same batch again.  Exact undo must leave the book and every
pool byte (garbage included) as before apply(), and the re-decode must give
the outputs and states of a twin memory that never failed and of the
from-zero recompute.  Lossy undo (rows overwritten and not kept) must drop
exactly the damaged sequences and leave every other one correct.
"""

from __future__ import annotations

import numpy as np
import pytest
from recurrent_toy import Toy, oracle, run_layers
from test_recurrent_book import ATOL, Checked, assert_unchanged, data_snapshot

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.memory import ContextError, MemoryStatus


@pytest.fixture(scope="module")
def dev():  # type: ignore[no-untyped-def]
    return statecache.get_device("reference")


def plan(t: Toy, batch: dict[int, list[int]], n_ubatch: int = 512):  # type: ignore[no-untyped-def]
    balloc = BatchAllocator(t.mem.n_seq_max)
    balloc.init(Batch.for_sequences(batch, output_all=True), t.mem)
    ctx = t.mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    return ctx


def run_step(t: Toy, ctx, ub, *, keep: bool | None, stop_after: int | None = None) -> None:  # type: ignore[no-untyped-def]
    """Run the ubatch's step; ``stop_after`` = number of state tensors written before the
    simulated failure (None: all of them)."""
    step = ctx.step(keep_undo_rows=keep)
    if stop_after is not None:
        real = step._run
        count = {"n": 0}

        def limited(layer, name, launch, *rest):  # type: ignore[no-untyped-def]
            if count["n"] >= stop_after:
                raise RuntimeError("injected compute failure")
            count["n"] += 1
            real(layer, name, launch, *rest)

        step._run = limited
        with pytest.raises(RuntimeError, match="injected"):
            run_layers(t.dev, step, t.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
    else:
        run_layers(t.dev, step, t.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))


def fail_batch(t: Toy, batch, mode: str, n_ubatch: int = 512, fail_at: int = 0):  # type: ignore[no-untyped-def]
    """Decode ``batch``; ubatches before ``fail_at`` compute fine, ubatch ``fail_at`` fails
    as ``mode`` says.  Returns (context, what undo() returned)."""
    ctx = plan(t, batch, n_ubatch)
    for i in range(fail_at + 1):
        ub = ctx.get_ubatch()
        assert ctx.apply()
        if i < fail_at:
            run_step(t, ctx, ub, keep=mode != "ran")
            assert ctx.next()
            continue
        if mode == "never":  # the graph failed before the step wrote anything
            ctx.step()
        elif mode == "partial":
            run_step(t, ctx, ub, keep=True, stop_after=1)
        elif mode == "kept":
            run_step(t, ctx, ub, keep=True)
        elif mode == "ran":  # no kept rows: lossy
            run_step(t, ctx, ub, keep=False)
    return ctx, undo_asking_first(t.mem, ctx)


def undo_asking_first(mem, ctx) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """undo() as a runtime does it: ask what it would drop; a lossy undo is refused,
    changing nothing, until asked for with drop=True, and then drops exactly those."""
    lost = ctx.undo_loses()
    if lost:
        before = mem.book_snapshot()
        with pytest.raises(ContextError, match="cannot be exact"):
            ctx.undo()
        assert mem.book_snapshot().same(before)
    dropped = ctx.undo(drop=True)
    assert dropped == lost
    return dropped


SCENARIOS = {
    # name: (n_seq_max, n_rs_seq, history batches, failing batch, n_ubatch)
    "in_place_decode": (3, 0, [{0: [1, 2, 3], 1: [4, 5]}], {0: [6], 1: [7]}, 512),
    "new_sequences_and_zero_row": (4, 0, [{0: [1, 2]}], {1: [3, 4], 2: [5], 0: [6]}, 512),
    "copy_on_write": (3, 0, [{0: [1, 2, 3]}, "cp 0 2"], {0: [4], 2: [5, 6]}, 512),
    "reorder_staged": (3, 0, [{1: [1, 2]}, {0: [3]}], {0: [4], 1: [5]}, 512),
    "snapshot_planes": (2, 3, [{0: [1, 2, 3, 4, 5]}, {1: [6, 7]}], {0: [8, 9], 1: [1]}, 512),
    "pending_rollback": (2, 3, [{0: [1, 2, 3, 4, 5]}, "rm 0 3"], {0: [9, 8]}, 512),
    "several_ubatches": (4, 2, [{0: [1, 2], 1: [3]}], {0: [4, 5, 6, 7], 1: [8, 9, 1, 2], 2: [3, 4, 5, 6]}, 4),
}


def build(dev, name: str, seed: int = 3) -> Checked:  # type: ignore[no-untyped-def]
    n_seq_max, n_rs_seq, history, _, _ = SCENARIOS[name]
    t = Checked(dev, n_seq_max, n_rs_seq, seed=seed)
    for h in history:
        if isinstance(h, str):
            op, a, b = h.split()
            if op == "cp":
                t.mem.seq_cp(int(a), int(b))
                t.hist[int(b)] = list(t.hist[int(a)])
            else:
                assert t.mem.seq_rm(int(a), int(b), -1)
                t.hist[int(a)] = t.hist[int(a)][: int(b)]
        else:
            t.feed(h)
    return t


@pytest.mark.parametrize("mode", ["never", "partial", "kept"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_item22_exact_undo_then_redecode_equals_never_failed(dev, name: str, mode: str) -> None:  # type: ignore[no-untyped-def]
    *_, batch, n_ubatch = SCENARIOS[name]
    t = build(dev, name)
    twin = build(dev, name)
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    pending = {s: t.mem.pending_rollback(s) for s in range(t.mem.n_seq_max)}
    n_ub = len(plan(t, batch, n_ubatch).ubatches)
    fail_at = n_ub - 1  # the earlier ubatches (if any) computed fine: undo takes them back too
    ctx, dropped = fail_batch(t, batch, mode, n_ubatch, fail_at)
    assert dropped == ()
    assert_unchanged(t, book, data)  # the book and every pool byte, garbage included
    assert {s: t.mem.pending_rollback(s) for s in range(t.mem.n_seq_max)} == pending
    t.mem.check_invariants()
    assert ctx.n_undoable == 0 and ctx.undo() == ()
    # decoding again equals the memory that never failed, and the recompute from zero
    out = t.decode(batch, n_ubatch)
    ref = twin.decode(batch, n_ubatch)
    assert out is not None and ref is not None and out.keys() == ref.keys()
    for k in out:
        np.testing.assert_array_equal(out[k], ref[k])
    for s, toks in batch.items():
        t.hist[s] = t.hist.get(s, []) + toks
        y, _ = oracle(dev, t.tables, t.hist[s])
        for p in range(len(t.hist[s]) - len(toks), len(t.hist[s])):
            np.testing.assert_allclose(out[(s, p)], y[p], atol=ATOL)
        t.check_state(s)
    assert t.mem.book_snapshot().same(twin.mem.book_snapshot())


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_item22_exact_undo_allows_reapplying_the_same_context(dev, name: str) -> None:  # type: ignore[no-untyped-def]
    *_, batch, n_ubatch = SCENARIOS[name]
    t = build(dev, name)
    ctx, dropped = fail_batch(t, batch, "kept", n_ubatch)
    assert dropped == () and ctx.i_next == 0
    out = {}
    while True:  # the runtime retries the very same plan
        ub = ctx.get_ubatch()
        assert ctx.apply()
        y = run_layers(dev, ctx.step(), t.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
        for s in range(ub.n_seqs):
            for k in range(ub.n_seq_tokens):
                i = s * ub.n_seq_tokens + k
                out[(ub.seq_id[i][0], int(ub.pos[i]))] = y[s, k]
        if not ctx.next():
            break
    for s, toks in batch.items():
        t.hist[s] = t.hist.get(s, []) + toks
        y, _ = oracle(dev, t.tables, t.hist[s])
        for p in range(len(t.hist[s]) - len(toks), len(t.hist[s])):
            np.testing.assert_allclose(out[(s, p)], y[p], atol=ATOL)
        t.check_state(s)
    t.mem.check_invariants()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_item22_lossy_undo_drops_exactly_the_damaged_sequences(dev, name: str) -> None:  # type: ignore[no-untyped-def]
    *_, batch, n_ubatch = SCENARIOS[name]
    t = build(dev, name)
    before = {s: t.mem.seq_pos_max(s) for s in range(t.mem.n_seq_max)}
    old_hist = {s: list(h) for s, h in t.hist.items()}
    _, dropped = fail_batch(t, batch, "ran", n_ubatch)
    t.mem.check_invariants()
    assert set(dropped) <= {s for s in before if before[s] >= 0}
    if name == "in_place_decode":  # both live rows were overwritten in place
        assert dropped == (0, 1)
    for s in range(t.mem.n_seq_max):
        if s in dropped:
            assert t.mem.seq_pos_max(s) == -1 and t.mem.cell_of(s) == -1
            t.hist[s] = []
        else:  # everything else is exactly as before the batch, and correct
            assert t.mem.seq_pos_max(s) == before[s]
            if before[s] >= 0:
                t.check_state(s)
    # the memory keeps working: re-prefill the dropped ones and decode the batch again
    redo = {s: old_hist.get(s, []) + batch.get(s, []) if s in dropped else batch[s] for s in {*batch, *dropped}}
    t.feed({s: v for s, v in redo.items() if v}, n_ubatch)
    for s in redo:
        if t.hist.get(s):
            t.check_state(s)


def test_item22_never_ran_is_free_and_exact_without_kept_rows(dev) -> None:  # type: ignore[no-untyped-def]
    t = build(dev, "snapshot_planes")
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    ctx = plan(t, {0: [8, 9], 1: [1]})
    assert ctx.apply()
    assert not t.mem.book_snapshot().same(book)
    assert ctx.undo() == ()  # no step was built: nothing to copy back
    assert_unchanged(t, book, data)


def test_item22_undo_only_the_last_ubatch(dev) -> None:  # type: ignore[no-untyped-def]
    t = build(dev, "several_ubatches")
    twin = build(dev, "several_ubatches")
    *_, batch, n_ubatch = SCENARIOS["several_ubatches"]
    ctx = plan(t, batch, n_ubatch)
    tctx = plan(twin, batch, n_ubatch)
    assert len(ctx.ubatches) >= 2
    for c, toy in ((ctx, t), (tctx, twin)):  # the first ubatch computes fine in both
        ub = c.get_ubatch()
        assert c.apply()
        run_step(toy, c, ub, keep=True)
        assert c.next()
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert ctx.apply()
    run_step(t, ctx, ctx.get_ubatch(), keep=True, stop_after=2)
    assert ctx.undo(1) == ()
    assert_unchanged(t, book, data)
    assert ctx.n_undoable == 1 and ctx.i_next == 1
    ctx.confirm()  # the runtime accepts the first ubatch
    assert ctx.n_undoable == 0 and ctx.undo() == ()
    assert_unchanged(t, book, data)
    assert t.mem.book_snapshot().same(twin.mem.book_snapshot())
    for k, v in data_snapshot(twin).items():
        np.testing.assert_array_equal(data[k], v)


def test_item22_undo_refused_after_another_change(dev) -> None:  # type: ignore[no-untyped-def]
    t = build(dev, "in_place_decode")
    ctx = plan(t, {0: [6], 1: [7]})
    assert ctx.apply()
    t.mem.seq_cp(0, 2)
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    with pytest.raises(ContextError, match="changed"):
        ctx.undo()
    assert_unchanged(t, book, data)
    with pytest.raises(ContextError, match="cannot undo"):
        ctx.undo(5)


def test_item22_keep_rows_default_on_the_memory(dev) -> None:  # type: ignore[no-untyped-def]
    t = build(dev, "in_place_decode")
    t.mem.keep_undo_rows = True  # every new context keeps rows: undo after a full step is exact
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    ctx = plan(t, {0: [6], 1: [7]})
    assert ctx.apply()
    ub = ctx.get_ubatch()
    run_layers(dev, ctx.step(), t.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
    assert ctx.undo() == ()
    assert_unchanged(t, book, data)
