"""Undo after a failed compute through the hybrid memories (spec §10 item 22):
the recurrent part undoes (exactly, or by dropping damaged sequences) and the
attention books go back to their state before apply()."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import ATTN, HybridToy, emb, make_hybrid, run_layers
from test_hybrid import books, check, same_books

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.kv_cache import KVCacheISWA
from statecache.memory import ContextError, MemoryStatus


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def failing_decode(toy: HybridToy, batch, mode: str, n_ubatch: int = 4):
    """Apply every ubatch of ``batch``; all compute fine except the last, which fails as
    ``mode`` says ("never": before the graph, "kept": after it, rows kept, "ran": after
    it, rows not kept).  Returns what undo() returned."""
    balloc = BatchAllocator(toy.mem.n_seq_max)
    balloc.init(Batch.for_sequences(batch, output_all=True), toy.mem)
    ctx = toy.mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        last = ctx.recr.i_next == len(ctx.recr.ubatches) - 1
        if not (last and mode == "never"):
            step = ctx.recr.step(keep_undo_rows=mode != "ran")
            run_layers(toy.dev, step, toy.tables, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
            actx = ctx.attn.swa if isinstance(toy.mem.attn, KVCacheISWA) else ctx.attn
            actx.cpy_k(ATTN, np.stack([emb(int(t), 1) for t in ub.token]))
            actx.cpy_v(ATTN, np.stack([emb(int(t), 2) for t in ub.token]))
        if last:
            return ctx, ctx.undo()
        assert ctx.next()


def history(toy: HybridToy) -> None:
    toy.decode({0: [1, 2, 3], 1: [4, 5]})
    toy.decode({0: [6], 1: [7]})


@pytest.mark.parametrize("mode", ["never", "kept"])
@pytest.mark.parametrize("kind", ["hybrid", "iswa"])
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


def test_item22_hybrid_lossy_undo_drops_from_every_part(dev) -> None:
    toy = HybridToy(dev, make_hybrid(dev, "hybrid"))
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


def test_item22_hybrid_idx_refuses_undo(dev) -> None:
    toy = HybridToy(dev, make_hybrid(dev, "idx"))
    history(toy)
    balloc = BatchAllocator(toy.mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [8]}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 4)
    assert ctx.apply()
    with pytest.raises(ContextError, match="cannot restore"):
        ctx.undo()
