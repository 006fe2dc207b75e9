"""Splitter shapes that the property tests accept but a runtime pays for
(issue 20, items 6 and 7): exact ubatch shapes, not only validity."""

from __future__ import annotations

import numpy as np

from statecache.batch import Batch, BatchAllocator, UBatch


def drain(balloc: BatchAllocator, split) -> list[UBatch]:  # type: ignore[no-untyped-def]
    balloc.split_reset()
    out = []
    while (ub := split()).n_tokens:
        out.append(ub)
    return out


def shapes(ubs: list[UBatch]) -> list[tuple[int, int]]:
    return [(ub.n_seqs, ub.n_seq_tokens) for ub in ubs]


def test_split_equal_cuts_lock_step_where_the_kept_tail_allows():
    """3 sequences x 4 tokens, n_ubatch 6, n_keep_tail 2: two 3x2 ubatches
    (each cut leaves exactly n_keep_tail tokens behind), not three 1x4 ones,
    which are valid too but run three times as many small steps."""
    b = BatchAllocator(3)
    b.init(Batch.for_sequences({0: [1] * 4, 1: [2] * 4, 2: [3] * 4}), None)
    ubs = drain(b, lambda: b.split_equal(6, n_keep_tail=2))
    assert shapes(ubs) == [(3, 2), (3, 2)]
    # every sequence's last two tokens arrived together
    for s in range(3):
        assert ubs[1].pos[s * 2 : s * 2 + 2].tolist() == [2, 3]
    # one token fewer per sequence: a 3x2 cut would leave 1 < 2 behind, so the
    # first tail goes whole, and the other two fit lock-step in the next ubatch
    b.init(Batch.for_sequences({0: [1] * 3, 1: [2] * 3, 2: [3] * 3}), None)
    assert shapes(drain(b, lambda: b.split_equal(6, n_keep_tail=2))) == [(1, 3), (2, 3)]
    # without the rule, lock step as far as n_ubatch allows
    b.init(Batch.for_sequences({0: [1] * 4, 1: [2] * 4, 2: [3] * 4}), None)
    assert shapes(drain(b, lambda: b.split_equal(6))) == [(3, 2), (3, 2)]


def test_split_seq_follows_only_subsets_of_the_current_set():
    """Tokens of {0, 1} then tokens of {1, 2}: {1, 2} is not a subset of
    {0, 1}, so they are two ubatches, one set each."""
    b = BatchAllocator(3)
    seq_ids = [(0, 1), (0, 1), (1, 2), (1, 2)]
    b.init(Batch(tokens=np.arange(4), pos=[0, 1, 2, 3], seq_ids=seq_ids), None)
    ubs = drain(b, lambda: b.split_seq(8))
    assert [ub.token_idx.tolist() for ub in ubs] == [[0, 1], [2, 3]]
    assert [list(ub.set_seq_ids[0]) for ub in ubs] == [[0, 1], [1, 2]]
    # a narrowing set is followed: {0, 1, 2}, {0, 1}, {1} make one ubatch
    b.init(Batch(tokens=np.arange(3), pos=[0, 1, 2], seq_ids=[(0, 1, 2), (0, 1), (1,)]), None)
    assert [ub.token_idx.tolist() for ub in drain(b, lambda: b.split_seq(8))] == [[0, 1, 2]]
