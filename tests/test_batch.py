"""Batch validation (§6.1), splitters (§6.3) and the memory status rules (§1)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecache.batch import Batch, BatchAllocator, UBatch
from statecache.errors import BatchError
from statecache.memory import MemoryStatus, StatusContext, normalize_range, status_combine


class FakeMemory:
    def __init__(self, pos: dict[int, int]) -> None:
        self.pos = pos

    def seq_pos_min(self, s: int) -> int:
        return self.pos.get(s, -1)

    def seq_pos_max(self, s: int) -> int:
        return self.pos.get(s, -1)


def drain(balloc: BatchAllocator, split) -> list[UBatch]:  # type: ignore[no-untyped-def]
    balloc.split_reset()
    out = []
    while True:
        ub = split()
        if ub.n_tokens == 0:
            return out
        out.append(ub)


# -- validation -----------------------------------------------------------------


def test_autofill_positions_continue_from_memory() -> None:
    b = BatchAllocator(4)
    b.init(Batch(tokens=[1, 2, 3, 4, 5], seq_ids=[0, 1, 0, 1, 3]), FakeMemory({0: 9, 1: -1}))
    assert b.pos.tolist() == [10, 0, 11, 1, 0]
    assert b.output.tolist() == [False, False, False, False, True]


def test_autofill_seq_and_output_all() -> None:
    b = BatchAllocator(2)
    b.init(Batch(tokens=[5, 6, 7]), None, output_all=True)
    assert b.seq_id == [(0,), (0,), (0,)]
    assert b.output.all()


@pytest.mark.parametrize(
    ("batch", "mem", "rule", "token", "seq"),
    [
        (Batch(tokens=[1, 2], seq_ids=[0, 4]), {}, "seq_id_range", 1, 4),
        (Batch(tokens=[1, 2], seq_ids=[0, -1]), {}, "seq_id_range", 1, -1),
        (Batch(tokens=[1, 2], pos=[5, 6]), {0: 3}, "pos_start", 0, 0),
        (Batch(tokens=[1, 2], pos=[3, 3]), {0: 2}, "pos_order", 1, 0),
        (Batch(tokens=[1, 2], pos=[3, 5]), {0: 2}, "pos_gap", 1, 0),
        (Batch(tokens=[1, 2], pos=[0, 0], seq_ids=[(0, 1), 1]), {0: 3}, "coupled_pos", 0, 1),
        (Batch(tokens=[1, 2], pos=[4, -1]), {}, "pos_negative", 1, None),
    ],
)
def test_validation_errors_name_token_seq_rule(batch, mem, rule, token, seq) -> None:  # type: ignore[no-untyped-def]
    b = BatchAllocator(4)
    with pytest.raises(BatchError) as ei:
        b.init(batch, FakeMemory(mem))
    assert ei.value.rule == rule
    assert ei.value.token == token
    assert ei.value.seq == seq
    assert b.n_tokens == 0


def test_vocab_and_payload_errors() -> None:
    b = BatchAllocator(2)
    with pytest.raises(BatchError, match="vocabulary"):
        b.init(Batch(tokens=[1, 99]), None, n_vocab=10)
    with pytest.raises(BatchError, match="exactly one"):
        b.init(Batch(), None)
    with pytest.raises(BatchError, match="n_seq_max"):
        BatchAllocator(0)


# -- splitters ----------------------------------------------------------------


def _check_cover(balloc: BatchAllocator, ubs: list[UBatch]) -> None:
    seen = np.concatenate([u.token_idx for u in ubs])
    assert sorted(seen.tolist()) == list(range(balloc.n_tokens))  # every token exactly once
    assert balloc.n_used == balloc.n_tokens
    # per sequence, positions are emitted in increasing order
    for s in balloc.seq_id_unq:
        ps = [int(p) for u in ubs for p, ids in zip(u.pos, u.seq_id) if s in ids]
        assert ps == sorted(ps)


def test_split_simple_order() -> None:
    b = BatchAllocator(3)
    b.init(Batch(tokens=list(range(7)), seq_ids=[0, 1, 2, 0, 1, 2, 0]), None, output_all=True)
    ubs = drain(b, lambda: b.split_simple(3))
    assert [u.n_tokens for u in ubs] == [3, 3, 1]
    assert np.concatenate([u.token_idx for u in ubs]).tolist() == list(range(7))
    assert b.out_ids == list(range(7))


@pytest.mark.parametrize("n_ubatch", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("sequential", [False, True])
def test_split_equal_shapes(n_ubatch: int, sequential: bool) -> None:
    rng = np.random.default_rng(n_ubatch)
    seqs = rng.integers(0, 5, size=23).tolist()
    b = BatchAllocator(5)
    b.init(Batch(tokens=list(range(23)), seq_ids=seqs), None, output_all=True)
    ubs = drain(b, lambda: b.split_equal(n_ubatch, sequential))
    _check_cover(b, ubs)
    for u in ubs:
        assert u.equal_seqs and u.n_tokens <= n_ubatch
        assert u.n_tokens == u.n_seqs * u.n_seq_tokens
        for s in range(u.n_seqs):
            block = u.seq_id[s * u.n_seq_tokens : (s + 1) * u.n_seq_tokens]
            assert all(ids == u.set_seq_ids[s] for ids in block)
        assert list(u.seq_id_unq) == sorted(set(u.seq_id_unq))
        if sequential:
            prim = [ids[0] for ids in u.set_seq_ids]
            assert prim == list(range(prim[0], prim[0] + len(prim)))
    # output order recoverable: out_ids is the batch index of each output in emission order
    assert sorted(b.out_ids) == list(range(23))
    assert b.out_ids == np.concatenate([u.token_idx[u.output] for u in ubs]).tolist()


@given(
    seqs=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    n_ubatch=st.integers(1, 12),
    n_keep_tail=st.integers(0, 3),
)
def test_split_equal_picks_sets_by_first_unused_token(seqs: list[int], n_ubatch: int, n_keep_tail: int) -> None:
    """Non-sequential equal split of a batch without coupled tokens: each ubatch takes the
    first n_ubatch sequences in order of their first unused token, and from each the same
    number of its earliest unused tokens (the rule the per-token loop applied; with a kept
    tail, some of those sequences may wait for a later ubatch)."""
    b = BatchAllocator(7)
    b.init(Batch(tokens=list(range(len(seqs))), seq_ids=seqs), None, output_all=True)
    n_ubatch = max(n_ubatch, n_keep_tail + 1)
    used = [False] * len(seqs)
    for u in drain(b, lambda: b.split_equal(n_ubatch, False, n_keep_tail)):
        order: list[int] = []
        for i, s in enumerate(seqs):
            if not used[i] and s not in order:
                order.append(s)
        got = [ids[0] for ids in u.set_seq_ids]
        if n_keep_tail:  # the keep-tail rule may leave some of them out of this ubatch
            assert got == [s for s in order[:n_ubatch] if s in got] and got
        else:
            assert got == order[:n_ubatch]
        want = got
        for k, s in enumerate(want):
            mine = u.token_idx[k * u.n_seq_tokens : (k + 1) * u.n_seq_tokens].tolist()
            assert mine == [i for i, q in enumerate(seqs) if q == s and not used[i]][: u.n_seq_tokens]
        for i in u.token_idx.tolist():
            used[i] = True
    assert all(used)


def test_split_equal_caps_sets_at_n_ubatch() -> None:
    b = BatchAllocator(8)
    b.init(Batch(tokens=list(range(8)), seq_ids=list(range(8))), None)
    ubs = drain(b, lambda: b.split_equal(3, True))
    assert [u.n_tokens for u in ubs] == [3, 3, 2]


@pytest.mark.parametrize("n_keep_tail", [1, 2, 4])
@pytest.mark.parametrize("n_ubatch", [5, 6, 9])
def test_split_equal_keeps_tail_together(n_keep_tail: int, n_ubatch: int) -> None:
    rng = np.random.default_rng(n_keep_tail * 31 + n_ubatch)
    seqs = rng.integers(0, 4, size=40).tolist()
    b = BatchAllocator(4)
    b.init(Batch(tokens=list(range(40)), seq_ids=seqs), None)
    ubs = drain(b, lambda: b.split_equal(n_ubatch, True, n_keep_tail))
    _check_cover(b, ubs)
    for s in set(seqs):
        n_s = seqs.count(s)
        tail = sorted(i for i, q in enumerate(seqs) if q == s)[-min(n_s, n_keep_tail) :]
        holders = {k for k, u in enumerate(ubs) for i in tail if i in u.token_idx.tolist()}
        assert len(holders) == 1, (s, tail)
    for u in ubs:
        assert u.n_tokens <= n_ubatch


def test_split_equal_rejects_small_n_ubatch_and_coupled() -> None:
    b = BatchAllocator(4)
    b.init(Batch(tokens=[1, 2, 3], seq_ids=[(0, 1), 0, 1]), None)
    with pytest.raises(BatchError, match="n_keep_tail"):
        b.split_equal(3, True, 3)
    assert b.split_equal(4, True).n_tokens == 0  # coupled + sequential refused
    ubs = drain(b, lambda: b.split_equal(4, False))
    _check_cover(b, ubs)
    assert ubs[0].set_seq_ids == [(0, 1)]


def test_split_seq_narrows_sets() -> None:
    b = BatchAllocator(4)
    b.init(Batch(tokens=[1, 2, 3, 4], seq_ids=[(0, 1), 0, 1, 0]), None)
    ubs = drain(b, lambda: b.split_seq(8))
    _check_cover(b, ubs)
    assert ubs[0].token_idx.tolist() == [0, 1, 3]
    assert ubs[0].n_seqs == 1 and ubs[0].set_seq_ids == [(0, 1)]
    assert ubs[1].token_idx.tolist() == [2]


# -- memory interface -----------------------------------------------------------


def test_status_combine_rule() -> None:
    S, N, FP, FC = (
        MemoryStatus.SUCCESS,
        MemoryStatus.NO_UPDATE,
        MemoryStatus.FAILED_PREPARE,
        MemoryStatus.FAILED_COMPUTE,
    )
    assert status_combine(S, N) is S and status_combine(N, S) is S
    assert status_combine(N, N) is N and status_combine(S, S) is S
    assert status_combine(FP, FC) is FP and status_combine(FC, FP) is FC
    assert status_combine(S, FC) is FC and status_combine(N, FP) is FP
    assert FP.is_fail and FC.is_fail and not S.is_fail and not N.is_fail


def test_status_context_and_range() -> None:
    ctx = StatusContext(MemoryStatus.NO_UPDATE)
    assert ctx.apply() and not ctx.next()
    assert normalize_range(-1, -1) == (0, 2**31 - 1)
    assert normalize_range(3, 5) == (3, 5)
