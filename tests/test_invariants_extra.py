"""Invariants of spec §10 that the per-area test files covered only in part
(see tests/INVARIANTS.md): here at the memory level."""

from __future__ import annotations

import pytest
from hybrid_toy import make_hybrid
from test_hybrid import books, same_books

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.memory import MemoryStatus


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_item55_leftover_tokens_fail_prepare_and_change_nothing(dev, kind):
    """Item 55: tokens the splitter cannot emit make init_batch FAILED_PREPARE,
    with every part unchanged.  One stream per sequence needs sequential equal
    splits, which refuse a token coupled to two sequences."""
    mem = make_hybrid(dev, kind, unified=False)
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [1, 2], 1: [3, 4]}), mem)
    ctx = mem.init_batch(balloc, 4)
    assert ctx.status is MemoryStatus.SUCCESS
    while True:
        assert ctx.apply()
        if not ctx.next():
            break
    before = books(mem)
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch(tokens=[4, 5, 6], seq_ids=[(0, 1), 0, 1]), mem)
    ctx = mem.init_batch(balloc, 4)
    assert ctx.status is MemoryStatus.FAILED_PREPARE
    assert "consume" in getattr(ctx, "reason", "")
    assert same_books(before, books(mem))
