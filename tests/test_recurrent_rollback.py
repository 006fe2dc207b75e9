"""Rollback planes: spec §10 items 23-35 with the exact semantics of §3.7."""

from __future__ import annotations

import numpy as np
import pytest
from recurrent_toy import Toy, toy_spec
from test_recurrent_book import Checked, assert_unchanged, data_snapshot

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, BatchError
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec, RecurrentLayerSpec, StateTensor


@pytest.fixture(scope="module")
def dev():  # type: ignore[no-untyped-def]
    return statecache.get_device("reference")


def accept(t: Checked, seq: int, keep: int) -> bool:
    """Keep the first ``keep`` tokens of ``seq`` (a rollback); mirror it in the history."""
    ok = t.mem.seq_rm(seq, keep, -1)
    if ok:
        t.hist[seq] = t.hist[seq][:keep]
    return ok


@pytest.mark.parametrize("d", [1, 2, 3])
def test_item23_rollback_then_decode_equals_recompute(dev, d: int) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4, 5, 6]})
    assert accept(t, 0, 6 - d)
    assert t.mem.seq_pos_max(0) == 5 - d
    t.check_state(0)  # the logical state (read from its plane) is the accepted prefix
    t.feed({0: [9, 8]})
    t.check_state(0)


def test_item24_depth_beyond_budget_refused(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 1, n_rs_seq=2)
    t.feed({0: [1, 2, 3, 4, 5, 6]})
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert not t.mem.seq_rm(0, 3, -1)  # d = 3 > 2
    assert_unchanged(t, book, data)


def test_item25_second_partial_refused_full_allowed(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 1, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4, 5, 6]})
    assert accept(t, 0, 5)
    book = t.mem.book_snapshot()
    assert not t.mem.seq_rm(0, 4, -1)
    assert t.mem.book_snapshot().same(book)
    assert t.mem.seq_rm(0, 0, -1) and t.mem.pending_rollback(0) == 0


def test_item26_pending_consumed_once_also_from_extra_range(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3, n_rs_seq=2)
    for s, toks in ((0, [1, 2, 3]), (2, [4, 5, 6]), (1, [7, 8, 9])):  # cells 0, 1, 2
        t.feed({s: toks})
    assert accept(t, 2, 2)  # seq 2 (cell 1) pending
    # seqs 0 and 1 (cells 0 and 2) take cells 0 and 1: seq 2 moves to cell 2, the extra range
    t.feed({0: [10], 1: [11]})
    assert t.mem.cell_of(2) == 2 and t.mem.pending_rollback(2) == 0
    t.check_state(2)
    t.feed({2: [12]})
    t.check_state(2)
    # pending, outside the next slot: stays pending
    assert accept(t, 2, 2)
    t.feed({0: [13], 1: [14]})  # cells 0 and 1 only; cell 2 outside the slot stays pending
    assert t.mem.pending_rollback(2) == 1
    t.check_state(2)


def test_item27_undo_whole_last_ubatch(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 1, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4]})
    t.feed({0: [5, 6]})  # n = 2 < K = 4: plane 2 holds the pre-ubatch state
    assert accept(t, 0, 4)
    t.check_state(0)
    t.feed({0: [7]})
    t.check_state(0)


def test_item28_rollback_after_single_token_steps_exact_or_refused(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 1, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4, 5]})
    t.feed({0: [6]})
    t.feed({0: [7]})
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert not t.mem.seq_rm(0, 5, -1)  # two steps back: that plane was overwritten
    assert_unchanged(t, book, data)
    assert accept(t, 0, 6)  # one step back: plane 1 is the state before the last token
    t.check_state(0)
    t.feed({0: [8]})
    t.check_state(0)


def test_item29_every_state_tensor_agrees_for_every_depth(dev) -> None:  # type: ignore[no-untyped-def]
    for d in (1, 2, 3):
        t = Checked(dev, 1, n_rs_seq=3)
        t.feed({0: [3, 1, 4, 1, 5, 9, 2]})
        assert accept(t, 0, 7 - d)
        t.check_state(0)  # conv windows and scan/delta states of both layers


def test_item30_shared_cell_rollback_refused(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4]})
    t.mem.seq_cp(0, 1)
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert not t.mem.seq_rm(0, 3, -1)
    assert not t.mem.seq_rm(1, 3, -1)
    assert_unchanged(t, book, data)


def test_item31_lost_cell_restarts_from_zero(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3, n_rs_seq=2)
    t.feed({0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9]})
    assert accept(t, 1, 2) and accept(t, 2, 2)
    t.mem.seq_keep(0)  # 1 loses its cell with a pending rollback
    t.hist[1] = []
    t.hist[2] = []
    t.feed({1: [3, 3]})
    t.check_state(1)
    t.feed({2: [1]})
    t.mem.seq_cp(0, 2)  # dst 2 loses its cell
    t.hist[2] = list(t.hist[0])
    t.feed({2: [6]})
    t.check_state(2)


def test_item32_keep_tail_and_small_n_ubatch(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, n_rs_seq=3)
    b = BatchAllocator(2)
    b.init(Batch.for_sequences({0: [1] * 10, 1: [2] * 7}), t.mem)
    with pytest.raises(BatchError, match="n_keep_tail"):
        t.mem.init_batch(b, 4)
    # n_ubatch 5: the last 4 tokens of each sequence arrive in one ubatch -> depth 3 works
    t.feed({0: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1: [2, 3, 4, 5, 6, 7, 8]}, n_ubatch=5)
    for s, n in ((0, 10), (1, 7)):
        assert accept(t, s, n - 3)
        t.check_state(s)


def test_item33_pending_replay_longer_than_n_ubatch(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3, n_rs_seq=2)
    t.feed({0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 1, 2, 3]})
    assert accept(t, 0, 3) and accept(t, 1, 2)
    t.feed({0: list(range(1, 12)), 1: list(range(3, 13)), 2: [4, 5, 6, 7, 8]}, n_ubatch=6)
    for s in range(3):
        t.check_state(s)


def test_item34_no_recurrent_layers_rollback_moves_position(dev) -> None:  # type: ignore[no-untyped-def]
    mem = RecurrentMemory(MemorySpec.build(2, {}), dev, n_seq_max=2, n_rs_seq=3)
    b = BatchAllocator(2)
    b.init(Batch.for_sequences({0: list(range(10))}), mem)
    ctx = mem.init_batch(b, 16)
    assert ctx.apply()
    assert mem.seq_rm(0, 2, -1) and mem.seq_pos_max(0) == 1
    assert mem.seq_rm(0, 1, -1) and mem.seq_pos_max(0) == 0


def test_item35_rollback_planes_or_a_loud_refusal(dev) -> None:  # type: ignore[no-untyped-def]
    m1 = RecurrentLayerSpec.mamba1(d_inner=8, d_state=4, d_conv=4)
    mem = RecurrentMemory(MemorySpec.build(1, {0: m1}), dev, n_seq_max=2, n_rs_seq=3)
    assert mem.n_rs_seq == 3 and mem.pools[0]["s"].shape[0] == 8  # Mamba-1 gets planes too
    mem2 = RecurrentMemory(toy_spec(), dev, n_seq_max=2, n_rs_seq=3)
    assert mem2.n_rs_seq == 3 and mem2.pools[0]["s"].shape[0] == 8
    rwkv = RecurrentLayerSpec.rwkv6(n_embd=8, head_size=4)  # its primitives write snapshot planes too
    mem3 = RecurrentMemory(MemorySpec.build(1, {0: rwkv}), dev, n_seq_max=2, n_rs_seq=3)
    assert mem3.n_rs_seq == 3 and mem3.pools[0]["r"].shape[0] == 8 and mem3.pools[0]["s"].shape[0] == 8
    other = RecurrentLayerSpec("retnet", (StateTensor("s", 16),))  # a family without snapshot-writing kernels
    with pytest.raises(ArgumentError, match="n_rs_seq"):
        RecurrentMemory(MemorySpec.build(1, {0: other}), dev, n_seq_max=2, n_rs_seq=3)


def test_rollback_several_sequences_same_ubatch(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 4, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10], 2: [1, 1, 2, 3, 5], 3: [2, 7, 1, 8, 2]})
    for s, keep in ((0, 4), (1, 2), (3, 3)):
        assert accept(t, s, keep)
    t.feed({0: [9, 9], 1: [9, 9], 2: [9, 9], 3: [9, 9]})
    for s in range(4):
        t.check_state(s)


def test_pending_rollback_is_copied_by_seq_cp(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 2, n_rs_seq=3)
    t.feed({0: [1, 2, 3, 4, 5]})
    assert accept(t, 0, 3)
    t.mem.seq_cp(0, 1)
    t.hist[1] = list(t.hist[0])
    assert t.mem.pending_rollback(1) == 2
    t.feed({1: [7]})
    t.feed({0: [8]})
    for s in (0, 1):
        t.check_state(s)


def test_rollback_survives_reorder_of_its_cell(dev) -> None:  # type: ignore[no-untyped-def]
    t = Checked(dev, 3, n_rs_seq=2)
    t.feed({2: [1, 2, 3]})
    t.feed({1: [4, 5, 6]})
    t.feed({0: [7, 8, 9]})
    assert accept(t, 2, 2) and accept(t, 0, 1)
    t.feed({0: [5], 1: [6], 2: [7]})
    for s in range(3):
        t.check_state(s)
    assert np.all(t.mem.book_snapshot().snap_valid[[t.mem.cell_of(s) for s in range(3)]] == 2)


def test_toy_is_not_trivially_zero(dev) -> None:  # type: ignore[no-untyped-def]
    t = Toy(dev, 1)
    out = t.decode({0: [1, 2]})
    assert out is not None and np.abs(out[(0, 1)]).max() > 1e-3


def test_rollback_into_a_removed_hole_is_refused(dev) -> None:  # type: ignore[no-untyped-def]
    """After seq_rm punches a hole [p0, p1) inside the history, no rollback may
    land on a removed position (found by review: a plane ending at p1 - 1 stayed
    reachable), while one that stays after the hole is still exact."""
    t = Checked(dev, 1, n_rs_seq=3)
    t.feed({0: list(range(1, 11))})  # positions 0..9 in one ubatch: planes reach "after 6"
    assert t.mem.seq_rm(0, 8, 9)  # hole at position 8: accepted, the state keeps it
    book, data = t.mem.book_snapshot(), data_snapshot(t)
    assert not t.mem.seq_rm(0, 9, -1)  # would restore "after 8", a removed position
    assert not t.mem.seq_rm(0, 8, -1)  # "after 7": across the hole
    assert_unchanged(t, book, data)
    assert t.mem.seq_pos_max(0) == 9
    t2 = Checked(dev, 1, n_rs_seq=3)
    t2.feed({0: list(range(1, 11))})
    assert t2.mem.seq_rm(0, 5, 7)  # hole at 5..6; positions 7..9 still exist
    assert accept(t2, 0, 9)  # roll back the last token: "after 8" is after the hole
    assert t2.mem.seq_pos_max(0) == 8
    t2.check_state(0)  # the state holds every token up to position 8, the hole's included


@pytest.mark.parametrize("n_rs_seq", [0, 1, 3])
def test_decode_writes_one_row_per_sequence_and_keeps_the_input_state(dev, n_rs_seq: int) -> None:  # type: ignore[no-untyped-def]
    """Rotating planes (issue 13): a decode changes exactly one row per sequence and
    state tensor, with rollback planes as without them (before rotation it also
    copied the input state into a snapshot plane).  With planes, the row it read is
    left untouched, and a rollback by one token then reads it and equals recompute,
    at every plane the rotation passes through."""
    t = Checked(dev, 3, n_rs_seq=n_rs_seq)
    t.feed({0: [1, 2, 3], 1: [4, 5], 2: [6]})
    for k in range(2 * (n_rs_seq + 1)):  # every plane is live twice
        b = t.mem.book_snapshot()
        read = {s: int(b.src[t.mem.cell_of(s)]) for s in range(3)}
        before = data_snapshot(t)
        t.feed({0: [7 + k], 1: [8 + k], 2: [9 + k]})
        for key, old in before.items():
            changed = np.flatnonzero((data_snapshot(t)[key] != old).any(axis=1))
            assert changed.size == 3, f"{key}: step {k} changed rows {changed.tolist()}"
            if n_rs_seq:
                assert not np.isin(changed, list(read.values())).any(), f"{key}: step {k} overwrote its input state"
    if n_rs_seq:
        assert accept(t, 1, len(t.hist[1]) - 1)
        t.check_state(1)
        t.feed({1: [20], 2: [21]})
        t.check_state(1)
        t.check_state(2)
