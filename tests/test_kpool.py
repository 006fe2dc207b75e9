"""k-pool layout, counts, inputs and stale marks (kpool-spec.md K.9 invariants
that need no memory; the memory-level ones live in test_hybrid_idx.py)."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.errors import ArgumentError
from statecache.kpool import (
    POS_CLEAN,
    KPoolLayout,
    StaleMarks,
    Token,
    kpool_pad,
    rebuild,
    stale_pos,
)

KP = 4


def feed(layout, marks, pairs_by_seq, tokens, n_seqs_unq=1, first=True, n_kv=256, **kw):
    forced = layout.update(lambda s: (0, sorted(pairs_by_seq.get(s, []))), marks)
    st = layout.build_state(tokens, marks.copy() if first else None, n_seqs_unq, forced=forced)
    return st, layout.build_inputs(st, tokens, n_kv, **kw)


def test_worked_example_k6():
    """kpool-spec K.6 batch A and B, position mode (= order mode for plain text)."""
    for by_order in (False, True):
        lay = KPoolLayout(KP, by_order, 1, 256, 1)
        marks = StaleMarks(1)
        pairs = {0: [(p, p) for p in range(10)]}
        toks = [Token(p, (0,), p) for p in range(10)]
        st, inp = feed(lay, marks, pairs, toks, n_sel=259, with_pos=True, ext_of=lambda strm, c: (c, c))
        assert (st.n_pool_real, st.n_new, st.n_new_g, st.n_kpool) == (2, 2, 3, 64)
        assert inp.pool_cells[:3].tolist() == [3, 7, 0] and (inp.pool_cells[2:] == 0).all()
        assert inp.pool_idxs[0].tolist() == [0, 1, 2, 3] and (inp.pool_idxs[2:] == 256).all()
        assert inp.new_pool_idxs.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 0, 0, 0]]
        assert inp.new_pool_rep.tolist() == [3, 7, 0]
        assert inp.new_pool_pos.tolist() == [0, 4, 0, 0, 4, 0, 0, 4, 0, 0, 4, 0]
        S = 256
        expect_tail = [[0, S, S], [1, 0, S], [2, 1, 0], [S, S, S], [4, S, S], [5, 4, S], [6, 5, 4], [S] * 3]
        expect_tail += [[8, S, S], [9, 8, S]]
        assert inp.tail_idxs.tolist() == expect_tail
        nv = [(np.isfinite(inp.pool_mask[i])).sum() for i in range(10)]
        assert nv == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
        assert (inp.sel_mask[3, :4] == 0).all() and np.isinf(inp.sel_mask[3, 4:256]).all()
        assert inp.sel_mask[6, 256:].tolist() == [0, 0, 0] and np.isinf(inp.sel_mask[7, 256:]).all()
        marks.clear()
        # batch B: positions 10, 11, 12
        pairs[0] += [(10, 10), (11, 11), (12, 12)]
        toks = [Token(p, (0,), p) for p in (10, 11, 12)]
        st, inp = feed(lay, marks, pairs, toks)
        assert (st.n_pool_real, st.n_new, st.n_new_g) == (3, 1, 1)
        assert inp.pool_cells[:4].tolist() == [3, 7, 11, 10]
        assert inp.new_pool_idxs.tolist() == [[8, 9, 10, 11]] and inp.new_pool_rep.tolist() == [11]
        assert inp.tail_idxs.tolist() == [[10, 9, 8], [S, S, S], [12, S, S]]
        # decode pos 13: nothing new, the single pad scatters to row 0 (not a rep)
        pairs[0].append((13, 13))
        st, inp = feed(lay, marks, pairs, [Token(13, (0,), 13)])
        assert (st.n_new, st.n_new_g) == (0, 1)
        assert inp.new_pool_idxs.tolist() == [[0, 0, 0, 0]] and inp.new_pool_rep.tolist() == [0]


def test_invariant_1_3_4_append_equals_rebuild_and_split_independent():
    """Items 1, 3, 4: the append path matches a rebuild at every step; existing pools
    never change between edits; the final layout does not depend on the split."""
    rng = np.random.default_rng(0)
    for by_order in (False, True):
        finals = []
        for trial in range(6):
            lay = KPoolLayout(KP, by_order, 1, 256, 1)
            marks = StaleMarks(1)
            pairs = []
            p = 0
            prev_pools = []
            while p < 40:
                n = int(rng.integers(1, 7)) if trial else 40
                new = [(q, q) for q in range(p, min(40, p + n))]
                pairs += new
                lay.update(lambda s, pairs=pairs: (0, list(pairs) if s == 0 else []), marks)
                ref = rebuild(pairs, 0, KP, by_order)
                assert (lay.seqs[0].cells, lay.seqs[0].pools) == (ref.cells, ref.pools)
                assert lay.seqs[0].pools[: len(prev_pools)] == prev_pools
                prev_pools = list(lay.seqs[0].pools)
                p += len(new)
            finals.append(lay.seqs[0].pools)
        assert all(f == finals[0] for f in finals)


def test_invariant_2_pool_shape_position_and_order_mode():
    pairs = [(p, p) for p in [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15]]  # hole at 6
    pos_mode = rebuild(pairs, 0, KP, False)
    for j in pos_mode.pools:
        p0 = pairs[j][0]
        assert (p0 - pos_mode.pos_min) % KP == 0
        assert [pairs[j + k][0] for k in range(KP)] == list(range(p0, p0 + KP))
    assert [pairs[j][0] for j in pos_mode.pools] == [0, 8, 12]  # the holed group [4..7] is no pool
    order = rebuild(pairs, 0, KP, True)
    assert order.pools == [0, 4, 8] and len(pairs) - len(pairs) % KP == 12


def test_invariant_5_padded_counts():
    for n in [0, 1, 62, 63, 64, 65, 127, 128, 1000]:
        pad = kpool_pad(n)
        assert pad % 64 == 0 and pad >= 64 and pad > n


def test_invariant_6_and_11_new_counts_clean_decode_and_prefill():
    lay = KPoolLayout(KP, False, 1, 256, 1)
    marks = StaleMarks(1)
    pairs = {0: []}
    for p in range(20):  # one-token decode
        pairs[0].append((p, p))
        st, _ = feed(lay, marks, pairs, [Token(p, (0,), p)], first=(p == 0))
        assert st.n_new_g == 1
        assert st.n_new == (1 if p % KP == KP - 1 else 0)
    lay = KPoolLayout(KP, False, 1, 256, 1)
    pairs = {0: [(p, p) for p in range(13)]}
    st, _ = feed(lay, marks, pairs, [Token(p, (0,), p) for p in range(13)])
    assert st.n_new == 3 and st.n_new_g == min(13 // KP + 1, st.n_kpool - 1, lay.n_pool_max)


def test_invariant_7_reserve_bounds_every_batch():
    lay = KPoolLayout(KP, False, 2, 64, 1)
    marks = StaleMarks(2)
    pairs = {0: [(p, p) for p in range(30)], 1: [(p, 30 + p) for p in range(30)]}
    toks = [Token(p, (0,), p) for p in range(30)] + [Token(p, (1,), 30 + p) for p in range(30)]
    st, _ = feed(lay, marks, pairs, toks, n_seqs_unq=2)
    res = lay.build_state([], None, 0, reserve=True)
    assert res.n_kpool >= st.n_kpool and res.n_new_g >= st.n_new_g
    assert res.n_pool_real == max(st.n_pool_real, lay.n_pool_max)


def test_invariant_10_12_13_new_entries_distinct_ordered_in_range():
    rng = np.random.default_rng(3)
    lay = KPoolLayout(KP, False, 3, 64, 1)
    marks = StaleMarks(3)
    cells = rng.permutation(64)
    pairs = {0: [(p, int(cells[p])) for p in range(9)], 1: [(p, int(cells[20 + p])) for p in range(14)]}
    toks = [Token(p, (0,), c) for p, c in pairs[0]] + [Token(p, (1,), c) for p, c in pairs[1]]
    st, inp = feed(lay, marks, pairs, toks, n_seqs_unq=2, n_kv=64)
    reps = inp.new_pool_rep.tolist()
    assert len(set(reps)) == len(reps)
    real = set(inp.pool_cells[: st.n_pool_real].tolist())
    assert not set(reps[st.n_new :]) & real
    starts = lay.pool_start()
    ips = [ip for ip in range(st.n_pool_real) if st.is_new[ip]]
    assert ips == sorted(ips)
    for e, ip in enumerate(ips):
        assert inp.new_pool_idxs[e].tolist() == inp.pool_idxs[ip].tolist()  # one stream: local == global
        assert reps[e] == inp.new_pool_idxs[e][-1]
    assert inp.pool_cells.max() < 64 and inp.pool_idxs.max() <= 64 and inp.tail_idxs.max() <= 64
    del starts


@pytest.mark.parametrize("by_order", [False, True])
def test_invariant_14_15_16_mask_causality_coverage(by_order):
    lay = KPoolLayout(KP, by_order, 2, 64, 1)
    marks = StaleMarks(2)
    pairs = {0: [(p, 2 * p) for p in range(3, 17)], 1: [(p, 2 * p + 1) for p in range(7)]}
    toks = [Token(p, (0,), c) for p, c in pairs[0]] + [Token(p, (1,), c) for p, c in pairs[1]]
    st, inp = feed(lay, marks, pairs, toks, n_seqs_unq=2, n_kv=64)
    starts = lay.pool_start()
    S = 64
    for i, tok in enumerate(toks):
        s = tok.seqs[0]
        row = np.isfinite(inp.pool_mask[i])
        zeros = np.flatnonzero(row)
        nv = zeros.size
        if nv:
            assert zeros.tolist() == list(range(starts[s], starts[s] + nv))
        assert not row[st.n_pool_real :].any()
        reach = [c for ip in zeros for c in inp.pool_idxs[ip].tolist()]
        tail = [c for c in inp.tail_idxs[i].tolist() if c != S]
        pos_of = dict((c, p) for p, c in pairs[s])
        assert all(pos_of[c] <= tok.pos for c in reach + tail)
        rank = sorted(pairs[s]).index((tok.pos, tok.cell))
        assert KP * nv + len(tail) == rank + 1  # no holes: rank == pos - pos_min
        if tail:
            assert tail[0] == tok.cell


def test_invariant_17_sel_mask():
    lay = KPoolLayout(KP, False, 1, 64, 1)
    pairs = {0: [(p, p) for p in range(14)]}
    toks = [Token(p, (0,), p) for p in range(14)]
    n_top = 2
    st, inp = feed(lay, StaleMarks(1), pairs, toks, n_kv=64, n_sel=KP * n_top + KP - 1)
    for i in range(14):
        nv = int(np.isfinite(inp.pool_mask[i]).sum())
        k = KP * min(nv, n_top)
        assert (inp.sel_mask[i, :k] == 0).all() and np.isinf(inp.sel_mask[i, k : KP * n_top]).all()
        assert (inp.sel_mask[i, KP * n_top :] == 0).tolist() == (inp.tail_idxs[i] != 64).tolist()
    with pytest.raises(ArgumentError, match="n_sel"):
        lay.build_inputs(st, toks, 64, n_sel=KP * 2 + 1)


def test_invariant_18_new_pool_pos_pads_zero_and_first_member():
    lay = KPoolLayout(KP, True, 1, 64, 1)
    pairs = {0: [(p, p) for p in range(9)]}
    st, inp = feed(
        lay, StaleMarks(1), pairs, [Token(p, (0,), p) for p in range(9)], n_kv=64, with_pos=True,
        ext_of=lambda strm, c: (100 + c, 200 + c),
    )  # fmt: skip
    ng = st.n_new_g
    assert ng == 3 and st.n_new == 2
    pos = inp.new_pool_pos.reshape(4, ng)
    assert pos[:, 0].tolist() == [0, 200, 100, 0] and pos[:, 1].tolist() == [4, 204, 104, 4]
    assert pos[:, 2].tolist() == [0, 0, 0, 0]


def test_invariant_19_multistream_inert_pools():
    lay = KPoolLayout(KP, False, 2, 16, 2)
    marks = StaleMarks(2)
    store = {0: [(p, p) for p in range(8)], 1: [(p, p) for p in range(5)]}
    lay.update(lambda s: (s, store[s]), marks)
    toks = [Token(8, (0,), 8)]
    store[0].append((8, 8))
    lay.update(lambda s: (s, store[s]), marks)
    st = lay.build_state(toks, None, 1)
    inp = lay.build_inputs(st, toks, 16)
    starts = lay.pool_start()
    ip1 = starts[1]
    assert (inp.pool_idxs[ip1] == 16).all() and inp.pool_cells[ip1] == 16 + 3
    assert inp.pool_idxs[0].tolist() == [0, 1, 2, 3]


def test_invariant_20_stale_pos():
    assert stale_pos(-1, 5, 0) == 0
    assert stale_pos(0, 3, 3) == 0 and stale_pos(0, 2, 3) == 0
    assert stale_pos(0, 6, 3) == 6


def test_invariant_21_marks_only_decrease_until_cleared():
    m = StaleMarks(3)
    m.set(1, 10)
    m.set(1, 12)
    assert m.marks[1] == 10
    m.set(-1, 4)
    assert m.marks.tolist() == [4, 4, 4]
    m.set(0, -3)
    assert m.marks[0] == 0
    m.clear()
    assert (m.marks == POS_CLEAN).all()
    with pytest.raises(ArgumentError, match="sequence 7"):
        m.set(7, 0)


def test_invariant_24_tail_removal_keeps_earlier_pools_warm():
    lay = KPoolLayout(KP, False, 1, 64, 1)
    marks = StaleMarks(1)
    pairs = {0: [(p, p) for p in range(12)]}
    feed(lay, marks, pairs, [Token(p, (0,), p) for p in range(12)])
    marks.clear()
    # seq_rm(0, 6, -1) then positions 6, 7 re-decoded into cells 20, 21
    marks.set(0, stale_pos(0, 6, 0))
    pairs[0] = [(p, p) for p in range(6)] + [(6, 20), (7, 21)]
    st, inp = feed(lay, marks, pairs, [Token(6, (0,), 20), Token(7, (0,), 21)])
    assert st.is_new.tolist() == [False, True]
    assert inp.new_pool_idxs[0].tolist() == [4, 5, 20, 21]


def test_h1_insert_below_cached_pairs_forces_repool():
    """Hazard H1 [REC]: an order-mode insert in the middle re-pools from there."""
    lay = KPoolLayout(KP, True, 1, 64, 1)
    marks = StaleMarks(1)
    pairs = {0: [(p, 10 + p) for p in range(8)]}
    feed(lay, marks, pairs, [Token(p, (0,), 10 + p) for p in range(8)])
    pairs[0].append((5, 2))  # same position as a cached token, lower cell
    st, inp = feed(lay, marks, pairs, [Token(5, (0,), 2)], first=False)
    assert st.is_new.tolist() == [False, True]
    assert inp.new_pool_idxs[0].tolist() == [14, 2, 15, 16]


def test_layout_rejects_bad_config():
    with pytest.raises(ArgumentError, match="kpool"):
        KPoolLayout(1, False, 1, 16, 1)
    with pytest.raises(ArgumentError, match="n_stream"):
        KPoolLayout(4, False, 4, 16, 2)
