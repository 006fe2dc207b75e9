"""Recurrent cell book: spec §10 items 1-22 (reference device, garbage-filled pools)."""

from __future__ import annotations

import numpy as np
import pytest
from recurrent_toy import Toy, oracle

import statecache
from statecache.batch import Batch, BatchAllocator, UBatch
from statecache.errors import ArgumentError, BatchError
from statecache.memory import MemoryStatus
from statecache.recurrent import NonConsecutivePositionWarning

ATOL = 2e-5


@pytest.fixture(scope="module")
def dev():  # type: ignore[no-untyped-def]
    return statecache.get_device("reference")


class Checked(Toy):
    """Toy plus the token history of every sequence, checked against the oracle."""

    def __init__(self, dev, *a, **k) -> None:  # type: ignore[no-untyped-def]
        super().__init__(dev, *a, **k)
        self.hist: dict[int, list[int]] = {}

    def feed(self, batch: dict[int, list[int]], n_ubatch: int = 512) -> None:
        out = self.decode(batch, n_ubatch)
        assert out is not None
        for s, toks in batch.items():
            self.hist[s] = self.hist.get(s, []) + list(toks)
        for s in batch:
            ref, _ = oracle(self.dev, self.tables, self.hist[s])
            for p in range(len(self.hist[s]) - len(batch[s]), len(self.hist[s])):
                np.testing.assert_allclose(out[(s, p)], ref[p], atol=ATOL, err_msg=f"seq {s} pos {p}")
        self.mem.check_invariants()

    def check_state(self, s: int) -> None:
        _, ref = oracle(self.dev, self.tables, self.hist[s])
        got = self.state(s)
        for L in ref:
            for n in ref[L]:
                np.testing.assert_allclose(got[L][n], ref[L][n], atol=ATOL, err_msg=f"seq {s} layer {L} {n}")
        assert self.mem.seq_pos_max(s) == len(self.hist[s]) - 1


def data_snapshot(toy: Toy) -> dict:  # type: ignore[type-arg]
    return {(L, n): b.numpy() for L, p in toy.mem.pools.items() for n, b in p.items()}


def assert_unchanged(toy: Toy, book, data) -> None:  # type: ignore[no-untyped-def]
    assert toy.mem.book_snapshot().same(book)
    for k, v in data_snapshot(toy).items():
        np.testing.assert_array_equal(v, data[k])


def test_item01_new_sequence_starts_from_zero_despite_garbage(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3)
    t.feed({0: [1, 2, 3]})
    t.check_state(0)
    t.feed({2: [4]})  # a second new sequence, in another cell
    t.check_state(2)


@pytest.mark.parametrize("n_rs_seq", [0, 2])
def test_item02_token_by_token_chunked_and_whole_agree(dev, n_rs_seq: int) -> None:  # type: ignore[no-untyped-def]
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    a = Checked(dev, 1, n_rs_seq)
    for x in toks:
        a.feed({0: [x]})
    b = Checked(dev, 1, n_rs_seq)
    b.feed({0: toks}, n_ubatch=4)
    c = Checked(dev, 1, n_rs_seq)
    c.feed({0: toks})
    for t in (a, b, c):
        t.check_state(0)


def test_item03_multi_sequence_equals_alone_and_isolated(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 4)
    t.feed({0: [1, 2], 1: [3, 4], 2: [5, 6], 3: [7, 8]})
    before = t.state(3)
    t.feed({0: [9], 1: [10], 2: [11]}, n_ubatch=2)
    after = t.state(3)
    for L in before:
        for n in before[L]:
            np.testing.assert_array_equal(before[L][n], after[L][n])
    for s in range(4):
        t.check_state(s)


def test_item04_seq_cp_copy_on_write(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3)
    t.feed({0: [1, 2, 3]})
    t.mem.seq_cp(0, 2)
    t.hist[2] = list(t.hist[0])
    assert t.mem.used == 1 and t.mem.cell_of(2) == t.mem.cell_of(0)
    t.feed({2: [7]})
    assert t.mem.used == 2 and t.mem.cell_of(2) != t.mem.cell_of(0)
    t.feed({0: [8]})
    t.feed({0: [9], 2: [10]})
    for s in (0, 2):
        t.check_state(s)


def test_item05_seq_cp_src_dst_and_range(dev) -> None:  # type: ignore[no-untyped-def]
    """[REC] of spec item 5: src == dst is a no-op, but an out-of-range id and a range that
    leaves out part of the state are refused (ArgumentError, nothing changed) instead of
    being ignored (issue 12 item 4, issue 14)."""
    t = Checked(dev, 3)
    t.feed({0: [1, 2], 1: [3]})
    book = t.mem.book_snapshot()
    t.mem.seq_cp(0, 0)
    for args, name in (((0, 7), "dst"), ((-1, 1), "src"), ((0, 1, 5, 6), "p0/p1"), ((0, 1, 0, 1), "p0/p1")):
        with pytest.raises(ArgumentError) as info:
            t.mem.seq_cp(*args)
        assert info.value.argument == name
    assert t.mem.book_snapshot().same(book)
    t.mem.seq_cp(0, 1, 1, 6)  # holds the state's position 1: the whole state is shared; 1's old cell released
    t.hist[1] = list(t.hist[0])
    assert t.mem.used == 1 and t.mem.seq_pos_max(1) == 1
    t.feed({1: [4]})
    t.check_state(1)


def test_item06_full_removal_restarts_from_zero(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, n_rs_seq=2)
    t.feed({0: [1, 2, 3, 4]})
    assert t.mem.seq_rm(0, 3, -1) and t.mem.pending_rollback(0) == 1
    assert t.mem.seq_rm(0, 0, 10)  # contains the tail, p0 == 0
    assert t.mem.seq_pos_max(0) == -1 and t.mem.used == 0 and t.mem.pending_rollback(0) == 0
    t.hist[0] = []
    t.feed({0: [5, 6]})
    t.check_state(0)


def test_item07_partial_removal_without_budget_refused(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    t.feed({0: [1, 2, 3]})
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert not t.mem.seq_rm(0, 2, -1)
    assert not t.mem.seq_rm(0, 1, 5)
    assert_unchanged(t, book, data)


def test_item08_removal_after_tail_or_inside_history_is_noop(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    t.feed({0: [1, 2, 3, 4]})
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert t.mem.seq_rm(0, 4, -1)
    assert t.mem.seq_rm(0, 1, 3)
    assert t.mem.seq_rm(1, 0, -1)  # a sequence without state
    assert_unchanged(t, book, data)


def test_item09_negative_seq(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    t.feed({0: [1, 2], 1: [3]})
    book = t.mem.book_snapshot()
    assert not t.mem.seq_rm(-1, 1, -1)
    assert t.mem.seq_rm(-1, 3, 3)  # empty range
    assert t.mem.book_snapshot().same(book)
    assert t.mem.seq_rm(-1, -1, -1)
    assert t.mem.used == 0 and t.mem.seq_pos_max(0) == -1 and t.mem.seq_pos_max(1) == -1


def test_item10_seq_out_of_range(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, size=3)
    t.feed({0: [1]})
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    with pytest.raises(ArgumentError, match="outside"):  # [REC] refused loudly (issue 14), not False
        t.mem.seq_rm(2, 0, -1)
    ub = UBatch.reserve(1, [(2, 0)])
    assert t.mem.init_ubatches([ub]).status is MemoryStatus.FAILED_PREPARE
    with pytest.raises(BatchError):
        BatchAllocator(2).init(Batch(tokens=[1], seq_ids=[2]), t.mem)
    assert_unchanged(t, book, data)


def test_item11_prepare_is_a_dry_run(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3)
    t.feed({0: [1, 2], 1: [3]})
    t.mem.seq_cp(0, 2)
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    ok = t.mem.prepare([UBatch.reserve(1, [(0, 2), (1, 1), (2, 2)])])
    assert ok is not None
    assert t.mem.prepare([UBatch.reserve(1, [(0, 2), (5, 0)])]) is None
    b = BatchAllocator(3)
    b.init(Batch.for_sequences({0: [4], 2: [5]}), t.mem)
    ctx = t.mem.init_batch(b, 8)
    assert ctx.status is MemoryStatus.SUCCESS
    assert_unchanged(t, book, data)


def test_item12_seq_keep(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3, n_rs_seq=2)
    t.feed({0: [1, 2, 3], 1: [4, 5, 6]})
    t.mem.seq_cp(0, 2)
    assert t.mem.seq_rm(1, 2, -1) and t.mem.pending_rollback(1) == 1
    t.mem.seq_keep(0)
    assert t.mem.used == 1 and t.mem.cell_of(1) == -1 and t.mem.cell_of(2) == -1
    assert t.mem.pending_rollback(1) == 0
    t.mem.check_invariants()
    t.feed({0: [7]})
    t.check_state(0)


def test_item13_seq_add_div(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    t.feed({0: [1, 2, 3, 4]})
    data = data_snapshot(t)
    book = t.mem.book_snapshot()
    t.mem.seq_add(0, 0, -1, 0)
    t.mem.seq_div(0, 0, -1, 1)
    t.mem.seq_add(0, 5, 5, 3)
    t.mem.seq_add(0, 0, 3, 10)  # tail pos 3 not in [0, 3)
    assert t.mem.book_snapshot().same(book)
    t.mem.seq_add(0, 0, -1, 10)
    assert t.mem.seq_pos_max(0) == 13
    t.mem.seq_div(0, 10, 20, 2)
    assert t.mem.seq_pos_max(0) == 6
    assert_unchanged(t, t.mem.book_snapshot(), data)  # data untouched
    t.mem.seq_add(0, 0, -1, -100)  # below 0 removes the state
    assert t.mem.seq_pos_max(0) == -1 and t.mem.used == 0


def test_item14_pos_min_equals_max(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    assert t.mem.seq_pos_min(0) == t.mem.seq_pos_max(0) == -1
    t.feed({0: [1, 2, 3]})
    assert t.mem.seq_pos_min(0) == t.mem.seq_pos_max(0) == 2


def test_item15_batch_must_continue_and_find_slot_only_warns(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    t.feed({0: [1, 2, 3]})
    b = BatchAllocator(2)
    with pytest.raises(BatchError) as ei:
        b.init(Batch(tokens=[4], pos=[5], seq_ids=[0]), t.mem)
    assert ei.value.rule == "pos_start"
    with pytest.raises(BatchError):
        b.init(Batch(tokens=[4], pos=[2], seq_ids=[0]), t.mem)
    with pytest.warns(NonConsecutivePositionWarning):
        ctx = t.mem.init_ubatches([UBatch.reserve(1, [(0, 9)])])
        assert ctx.apply()


def test_item16_coupled_tokens_share_the_set_cell(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3)
    t.feed({0: [1, 2], 1: [3, 4, 5]})
    t.mem.seq_rm(1, 0, -1)
    t.mem.seq_cp(0, 1)
    t.hist[1] = list(t.hist[0])
    b = BatchAllocator(3)
    b.init(Batch(tokens=[6], seq_ids=[(0, 1)]), t.mem)
    assert b.split_equal(4, sequential=True).n_tokens == 0  # coupled batches refused by sequential split
    b.split_reset()
    ub = b.split_equal(4, sequential=False)
    ctx = t.mem.init_ubatches([ub])
    assert ctx.apply()
    assert t.mem.cell_of(0) == t.mem.cell_of(1) and t.mem.used == 1
    t.mem.check_invariants()


def test_item17_n_seq_max_sequences_always_fit(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 4)
    t.feed({0: [1, 2]})
    for d in (1, 2, 3):
        t.mem.seq_cp(0, d)
        t.hist[d] = list(t.hist[0])
    t.feed({0: [3], 1: [4], 2: [5], 3: [6]})
    assert t.mem.used == 4
    for s in range(4):
        t.check_state(s)


def test_item18_full_context(dev) -> None:  # type: ignore[no-untyped-def]
    t = Toy(dev, 3)
    ctx = t.mem.init_full()
    assert ctx.inputs.n_rs == 3 and ctx.inputs.head == 0 and ctx.inputs.rs_z == 0


def test_item19_inputs_do_not_modify_the_book(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, n_rs_seq=2)
    t.feed({0: [1, 2, 3], 1: [4, 5, 6]})
    assert t.mem.seq_rm(0, 2, -1)
    b = BatchAllocator(2)
    b.init(Batch.for_sequences({1: [7]}), t.mem)
    ctx = t.mem.init_batch(b, 8)
    assert ctx.apply()
    book = t.mem.book_snapshot()
    _ = (ctx.inputs.dst_table, ctx.inputs.written_rows(), ctx.inputs.start_rows, ctx.step())
    assert t.mem.book_snapshot().same(book)


def test_item20_inputs_record_slot_geometry(dev) -> None:  # type: ignore[no-untyped-def]
    # every ubatch's inputs carry head / rs_z / sizes; a graph keyed on them cannot reuse stale rows
    t = Checked(dev, 3)
    t.feed({0: [1], 1: [2], 2: [3]})
    seen = set()
    for batch in ({0: [4]}, {1: [5]}, {2: [6]}, {1: [7], 2: [8]}):
        b = BatchAllocator(3)
        b.init(Batch.for_sequences(batch), t.mem)
        ctx = t.mem.init_batch(b, 8)
        assert ctx.apply()
        i = ctx.inputs
        seen.add((i.head, i.rs_z, i.n_rs, i.n_seqs))
        assert i.start_rows.tolist() == [t.mem.cell_of(s) for s in sorted(batch)]
    assert len(seen) == 4


def test_item21_zero_row_never_a_source_and_reads_before_writes(dev) -> None:  # type: ignore[no-untyped-def]
    # seq 1 takes cell 0 and seq 0 cell 1: a two-sequence ubatch swaps them (a read/write cycle)
    t = Checked(dev, 3)
    t.feed({1: [1, 2]})
    t.feed({0: [3]})
    assert t.mem.cell_of(1) == 0 and t.mem.cell_of(0) == 1
    t.feed({0: [4], 1: [5]})
    assert t.staged_steps >= 1
    for s in (0, 1):
        t.check_state(s)
    # new sequence next to moved ones: the zero row is unreferenced
    t.feed({2: [6, 7], 1: [8, 9]})
    b = t.mem.book_snapshot()
    for s in range(3):
        t.check_state(s)
    assert (b.src[b.src >= 0] % 3).size == t.mem.used


def test_item22_prepare_failure_leaves_memory_usable(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2)
    t.feed({0: [1, 2]})
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    ctx = t.mem.init_ubatches([UBatch.reserve(1, [(0, 2), (3, 0)])])
    assert ctx.status is MemoryStatus.FAILED_PREPARE
    assert_unchanged(t, book, data)
    t.feed({0: [3]})
    t.check_state(0)


def test_seq_add_and_div_on_a_shared_state_are_refused(dev) -> None:  # type: ignore[no-untyped-def]
    """Upstream moves every sharer of a cell; we refuse with a clear error and
    change nothing (found by review: another sequence's positions moved)."""
    from statecache.errors import ArgumentError

    t = Checked(dev, 2, n_rs_seq=0)
    t.feed({0: [1, 2, 3]})
    t.mem.seq_cp(0, 1)
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    with pytest.raises(ArgumentError, match=r"seq_add: sequence 1 shares its recurrent state with sequences \[0\]"):
        t.mem.seq_add(1, 0, -1, 100)
    with pytest.raises(ArgumentError, match="seq_div"):
        t.mem.seq_div(1, 0, -1, 2)
    assert_unchanged(t, book, data)
    assert t.mem.seq_pos_max(0) == t.mem.seq_pos_max(1) == 2
