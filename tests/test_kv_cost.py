"""The KV book's O(batch) machinery (issue 13, docs/memory-semantics.md#kv-cost) against
plain recomputation: the journal puts a stream back exactly, the derived counts
(free cells per block, owners per cell, used extent) always match the cells, the
block-skipping slot search finds the cells of a cyclic scan, and the mask built from
the cells each token attends equals the reference mask over the whole book."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecache.errors import InvariantError
from statecache.kpool import KPoolLayout, KPoolState, StaleMarks, Token, rebuild
from statecache.kv_cells import BLOCK, EMPTY, KVCells, SeqPairBook
from statecache.kv_mask import SWAType, build_mask, build_mask_seqs

N_SEQ = 3


def random_book(rng: np.random.Generator, size: int, fill: float, n_seq: int = N_SEQ) -> KVCells:
    c = KVCells(size, n_seq)
    for i in range(size):
        if rng.random() < fill:
            c.pos_set(i, int(rng.integers(0, 3 * BLOCK)), (int(rng.integers(0, 3)), int(rng.integers(0, 3))))
            for s in range(n_seq):
                if rng.random() < 0.4:
                    c.seq_add(i, s)
            if not c.seq_count(i):
                c.seq_add(i, int(rng.integers(0, n_seq)))
    return c


def naive_free_from(c: KVCells, start: int, n: int) -> list[int]:
    order = [(start + k) % c.size for k in range(c.size)]
    return [i for i in order if c.pos[i] == EMPTY][:n]


def mutate(c: KVCells, rng: np.random.Generator) -> None:
    """One random edit through every mutation entry point."""
    used = np.flatnonzero(c.pos != EMPTY)
    free = np.flatnonzero(c.pos == EMPTY)
    op = int(rng.integers(0, 8))
    if op == 0 and free.size:  # bulk placement, one sequence per cell
        idx = rng.choice(free, size=int(rng.integers(1, min(free.size, 9) + 1)), replace=False)
        pos = rng.integers(0, 3 * BLOCK, size=idx.size)
        ext = rng.integers(0, 3, size=(idx.size, 2))
        c.place_seqs(idx.astype(np.int64), pos.astype(np.int64), ext.astype(np.int64), rng.integers(0, N_SEQ, idx.size))
    elif op == 1 and free.size:
        i = int(rng.choice(free))
        c.pos_set(i, int(rng.integers(0, 3 * BLOCK)))
        c.seq_add(i, int(rng.integers(0, N_SEQ)))
    elif op == 2 and used.size:
        i = int(rng.choice(used))
        c.seq_rm(i, int(rng.choice(c.seqs_of(i))))
    elif op == 3 and used.size:
        c.rm_many(rng.choice(used, size=int(rng.integers(1, min(used.size, 9) + 1)), replace=False).astype(np.int64))
    elif op == 4:
        s = int(rng.integers(0, N_SEQ))
        held = c.seq_pos[s].cells()
        if held.size:
            c.seq_rm_many(rng.choice(held, size=int(rng.integers(1, held.size + 1)), replace=False), s)
    elif op == 5 and used.size:
        i = int(rng.choice(used))
        c.pos_add(i, int(rng.integers(-4, 5)))
    elif op == 6 and used.size:
        i = int(rng.choice(used))
        c.seq_add(i, int(rng.integers(0, N_SEQ)))
    elif op == 7 and used.size:  # a window reuse: the cells emptied with their rows read once, then placed
        idx = rng.choice(used, size=int(rng.integers(1, min(used.size, 9) + 1)), replace=False).astype(np.int64)
        seq_rows = c.seq[idx]
        runs = c.owner_runs(idx, seq_rows)
        lost_seqs, lost_pos = runs.highest()
        for s, p in zip(lost_seqs.tolist(), lost_pos.tolist(), strict=True):  # each loser's highest lost pair
            assert p == max(pos for pos, cell in c.seq_cells(s) if cell in set(idx.tolist()))
        # some free cells too; placed either after an rm_many or by the placement's own reuse
        extra = rng.choice(free, size=int(rng.integers(0, min(free.size, 3) + 1)), replace=False) if free.size else free
        cells = np.concatenate([idx, extra.astype(np.int64)])
        pos = rng.integers(0, 3 * BLOCK, size=cells.size).astype(np.int64)
        seqs = rng.integers(0, N_SEQ, cells.size)
        ext = np.zeros((cells.size, 2), np.int64)
        other = c.clone()
        occupied = other.pos[cells] != EMPTY
        other.rm_many(idx, other.owner_runs(idx), other.seq[idx])
        other.place_seqs(cells, pos, ext, seqs)
        if rng.random() < 0.5:
            c.rm_many(idx, runs, seq_rows)
            c.place_seqs(cells, pos, ext, seqs)
        else:
            c.place_seqs(cells, pos, ext, seqs, (occupied, idx, runs, seq_rows))
        assert c.same_as(other) and c.removals == other.removals


@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(1, 30), fill=st.floats(0.0, 1.0))
def test_journal_rollback_is_exact_and_counts_stay_in_step(seed: int, n_ops: int, fill: float) -> None:
    rng = np.random.default_rng(seed)
    c = random_book(rng, int(rng.integers(1, 4 * BLOCK)), fill)
    c.check()
    before, removals = c.clone(), c.removals
    journal = c.attach()
    for _ in range(n_ops):
        mutate(c, rng)
        c.check()  # owners, free counts and used extent recomputed from the cells
    c.rollback(journal)
    c.check()
    assert c.same_as(before) and c.removals == removals
    assert c._journal is None


@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(1, 12), fill=st.floats(0.0, 0.9), only_place=st.booleans())
def test_rollback_gives_back_a_stamp_only_with_the_same_pairs(
    seed: int, n_ops: int, fill: float, only_place: bool
) -> None:
    """The stamp contract across a rollback: a sequence that has its stamp of before the
    attach holds exactly its pairs of then; after trial placements alone, every sequence
    gets its stamp back (a reader of the pairs, the k-pool layout, then reads none again)."""
    rng = np.random.default_rng(seed)
    c = random_book(rng, int(rng.integers(1, 4 * BLOCK)), fill)
    before = [(sc.stamp, list(sc)) for sc in c.seq_pos]
    journal = c.attach()
    for _ in range(n_ops):
        if only_place:
            free = np.flatnonzero(c.pos == EMPTY)
            if free.size:
                i = int(rng.choice(free))
                c.pos_set(i, int(rng.integers(0, 3 * BLOCK)))
                c.seq_add(i, int(rng.integers(0, N_SEQ)))
        else:
            mutate(c, rng)
    c.rollback(journal)
    for sc, (stamp, pairs) in zip(c.seq_pos, before, strict=True):
        assert list(sc) == pairs
        if sc.stamp == stamp:
            assert len(sc) == len(pairs)
        elif only_place:
            raise AssertionError("trial placements alone rolled back, yet a stamp changed")


@given(seed=st.integers(0, 2**32 - 1), fill=st.floats(0.0, 1.0))
def test_free_from_is_the_cyclic_scan(seed: int, fill: float) -> None:
    rng = np.random.default_rng(seed)
    c = random_book(rng, int(rng.integers(1, 6 * BLOCK)), fill)
    n_free = int((c.pos == EMPTY).sum())
    for start in {0, 1, c.size - 1, c.size, int(rng.integers(0, c.size + 1))}:
        for n in {1, max(1, n_free), n_free + 1, int(rng.integers(1, c.size + 2))}:
            assert c.free_from(start, n) == naive_free_from(c, start % c.size, n), (start, n)
    nz = np.flatnonzero(c.pos != EMPTY)
    assert c.used_max_p1() == (int(nz[-1]) + 1 if nz.size else 0)


def test_journal_refuses_a_second_attach_and_a_reset() -> None:
    c = KVCells(8, 2)
    c.attach()
    with pytest.raises(InvariantError, match="already attached"):
        c.attach()
    with pytest.raises(InvariantError, match="journal"):
        c.reset()


@given(
    seed=st.integers(0, 2**32 - 1),
    n_stream=st.integers(1, 3),
    swa=st.sampled_from(list(SWAType)),
    n_swa=st.integers(1, 9),
    causal=st.booleans(),
    alibi=st.booleans(),
    with_ext=st.booleans(),
)
def test_mask_from_attended_cells_equals_the_whole_book_mask(
    seed: int, n_stream: int, swa: SWAType, n_swa: int, causal: bool, alibi: bool, with_ext: bool
) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 3 * BLOCK))
    streams = [random_book(rng, size, float(rng.random())) for _ in range(n_stream)]
    n_tok = int(rng.integers(1, 12))
    tok_stream = rng.integers(0, n_stream, size=n_tok)
    tok_pos = rng.integers(0, 3 * BLOCK + 4, size=n_tok)
    tok_seq = rng.integers(0, N_SEQ, size=n_tok)
    tok_ext = rng.integers(0, 3, size=(n_tok, 2)) if with_ext else None
    n_kv = int(rng.integers(1, size + 1))
    kw = dict(causal=causal, swa_type=swa, n_swa=n_swa, alibi=alibi)
    got = build_mask_seqs(streams, tok_stream, tok_pos, tok_seq, n_kv, token_ext=tok_ext, **kw)  # type: ignore[arg-type]
    for i in range(n_tok):
        ref = build_mask(
            streams[int(tok_stream[i])],
            tok_pos[i : i + 1],
            tok_seq[i : i + 1],
            n_kv,
            token_ext=None if tok_ext is None else tok_ext[i : i + 1],
            **kw,  # type: ignore[arg-type]
        )
        np.testing.assert_array_equal(got[i : i + 1], ref)


def edit_pairs(
    c: KVCells, s: int, op: int, rng: np.random.Generator, marks: StaleMarks, n_max: int, mark_max: int
) -> np.ndarray:
    """One edit of sequence ``s`` for the k-pool layout tests: ops 0-2 append up to ``n_max``
    pairs (the decode case), 3 inserts them below the end, 4 removes a tail, 5 sets a stale
    mark; other ops do nothing here.  Returns the cells placed."""
    free = c.free_from(0, c.size)
    if op <= 3 and free:
        n = int(rng.integers(1, min(n_max, len(free)) + 1))
        top = c.seq_pos_max(s) + 1
        base = top if op <= 2 or top == 0 else int(rng.integers(0, top))
        placed = rng.choice(free, size=n, replace=False).astype(np.int64)
        c.place_seqs(placed, np.arange(base, base + n, dtype=np.int64), np.zeros((n, 2), np.int64), np.full(n, s))
        return placed
    if op == 4 and c.seq_pos[s]:
        held = c.seq_pos[s].cells()
        c.seq_rm_many(held[-int(rng.integers(1, held.size + 1)) :], s)
    elif op == 5:
        marks.set(s, int(rng.integers(0, mark_max)))
    return np.zeros(0, dtype=np.int64)


@given(seed=st.integers(0, 2**32 - 1), by_order=st.booleans(), n_steps=st.integers(1, 25))
def test_kpool_layout_from_live_cells_matches_the_copied_pairs(seed: int, by_order: bool, n_steps: int) -> None:
    """The k-pool layout fed the live pairs (read from their end while only appends
    happened) and one fed copies of them give the same layouts and forced re-pools,
    whatever edit (append, insert below cached pairs, removal) comes between updates."""
    rng = np.random.default_rng(seed)
    size = 96
    c = KVCells(size, 2)
    live, copied = KPoolLayout(4, by_order, 2, size, 1), KPoolLayout(4, by_order, 2, size, 1)
    marks = StaleMarks(2)
    for _ in range(n_steps):
        s = int(rng.integers(0, 2))
        op = int(rng.integers(0, 7))
        free = c.free_from(0, size)
        edit_pairs(c, s, op, rng, marks, n_max=5, mark_max=8)
        if op == 6 and free:  # a trial: appends the layout reads, then taken back (the stamp comes back)
            journal = c.attach()
            top = c.seq_pos_max(s) + 1
            cells = np.asarray(free[:2], dtype=np.int64)
            c.place_seqs(
                cells,
                np.arange(top, top + cells.size, dtype=np.int64),
                np.zeros((cells.size, 2), np.int64),
                np.full(cells.size, s),
            )
            assert live.update(lambda q: (0, c.seq_pos[q]), marks) == copied.update(
                lambda q: (0, c.seq_cells(q)), marks
            )
            c.rollback(journal)
        forced_live = live.update(lambda q: (0, c.seq_pos[q]), marks, c.seq_pos if rng.random() < 0.5 else None)
        live.check()  # the decode arrays equal the layouts
        forced_copied = copied.update(lambda q: (0, c.seq_cells(q)), marks)
        assert forced_live == forced_copied
        for q in range(2):
            assert live.seqs[q] == copied.seqs[q] == rebuild(c.seq_cells(q), 0, 4, by_order)
        if rng.random() < 0.5:
            marks.clear()


@given(seed=st.integers(0, 2**32 - 1), fill=st.floats(0.0, 1.0), need=st.integers(0, 80))
def test_oldest_alone_is_the_naive_pick(seed: int, fill: float, need: int) -> None:
    """A window cache's reusable cells of a sequence: those below the window it holds alone,
    oldest (position, then cell) first -- read a few at a time, equal to filtering every pair."""
    rng = np.random.default_rng(seed)
    c = random_book(rng, int(rng.integers(1, 4 * BLOCK)), fill)
    s = int(rng.integers(0, N_SEQ))
    p_end = int(rng.integers(-2, 3 * BLOCK + 2))
    naive = [cell for p, cell in c.seq_cells(s) if p < p_end and c.seq_count(cell) == 1][:need]
    assert c.oldest_alone(s, p_end, need) == naive


@given(
    seed=st.integers(0, 2**32 - 1),
    fill=st.floats(0.0, 1.0),
    need=st.integers(0, 80),
    n_seq=st.sampled_from([5, 12, 40]),
    every=st.booleans(),
)
def test_oldest_alone_many_is_the_loop_of_oldest_alone(
    seed: int, fill: float, need: int, n_seq: int, every: bool
) -> None:
    """The window cache's eviction asks every sequence at once (their first pairs read
    together; ``every``: all sequences in order, given as None, read without a gather of
    rows): the same cells, in the same order, as asking them one after the other."""
    rng = np.random.default_rng(seed)
    c = random_book(rng, int(rng.integers(1, 4 * BLOCK)), fill, n_seq)
    for _ in range(int(rng.integers(0, 4))):  # long single-owner runs: sequences with more than a head below
        free = np.flatnonzero(c.pos == EMPTY)[: int(rng.integers(0, 40))]
        if free.size:
            s = int(rng.integers(0, n_seq))
            top = max(c.seq_pos_max(s) + 1, 0)
            zeros = np.zeros((free.size, 2), np.int64)
            c.place_seqs(free, np.arange(top, top + free.size), zeros, np.full(free.size, s))
    if every:
        order = list(range(n_seq))
    else:
        order = [int(s) for s in rng.permutation(n_seq)][: int(rng.integers(0, n_seq + 1))]
    p_end = rng.integers(-2, 4 * BLOCK, size=len(order))
    loop: list[int] = []
    for s, p in zip(order, p_end.tolist(), strict=True):
        loop += c.oldest_alone(s, p, need - len(loop))
        if len(loop) >= need:
            break
    owners: list[int] = []
    assert c.oldest_alone_many(None if every else order, p_end, need, owners) == loop
    assert owners == [c.seqs_of(cell)[0] for cell in loop]  # each cell's one sequence


def reference_kpool_inputs(lay: KPoolLayout, state: KPoolState, tokens: list[Token], n_kv: int, **kw: Any) -> Any:
    """The k-pool graph inputs by plain loops over every pool and cell of the layout
    (docs/memory-semantics.md#kpool-inputs), the oracle of the incremental build."""
    kp, S, n_pool = lay.kpool, n_kv, state.n_kpool
    starts = lay.pool_start()
    in_ub = {s for t in tokens for s in t.seqs}
    dummy = next(lay.g(tokens[0].seqs[0], c) for p, c in lay.seqs[tokens[0].seqs[0]].cells if p == tokens[0].pos)
    pool_cells = np.full(n_pool, dummy, dtype=np.int32)
    pool_idxs = np.full((n_pool, kp), S, dtype=np.int32)
    reps, new_rows, new_first = [], [], []
    for s, layout in enumerate(lay.seqs):
        for k in range(len(layout.pools)):
            ip, mem = starts[s] + k, lay.members(s, k)
            pool_cells[ip] = lay.g(s, mem[-1][1])
            reps.append(lay.g(s, mem[-1][1]))
            if lay.n_stream == 1 or s in in_ub:
                pool_idxs[ip] = [c for _, c in mem]
            if state.is_new[ip]:
                new_rows.append([lay.g(s, c) for _, c in mem])
                new_first.append((mem[0][0], layout.strm, mem[0][1]))
    pool_mask = np.full((len(tokens), n_pool), -np.inf, dtype=np.float32)
    tail_idxs = np.full((len(tokens), kp - 1), S, dtype=np.int32)
    nvs = []
    for i, tok in enumerate(tokens):
        s = tok.seqs[0]
        layout = lay.seqs[s]
        if lay.by_order:
            r = layout.cells.index((tok.pos, tok.cell))
            nv, n_tail = min(len(layout.pools), (r + 1) // kp), (r + 1) % kp
            tails = [layout.cells[r - k][1] for k in range(min(n_tail, kp - 1))]
        else:
            nv = sum(1 for k in range(len(layout.pools)) if lay.members(s, k)[-1][0] <= tok.pos)
            n_tail = (tok.pos - layout.pos_min + 1) % kp
            first_at: dict[int, int] = {}
            for p, c in layout.cells:
                first_at.setdefault(p, c)
            tails = [first_at.get(tok.pos - k, S) for k in range(min(n_tail, kp - 1))]
        tail_idxs[i, : len(tails)] = tails
        pool_mask[i, starts[s] : starts[s] + nv] = 0.0
        nvs.append(nv)
    pads, counter = [], 0
    for _ in range(state.n_new_g - state.n_new):
        while counter in set(reps):
            counter += 1
        pads.append(counter)
        counter += 1
    sel_mask = None
    if kw.get("n_sel") is not None:
        n_sel = kw["n_sel"]
        sel_mask = np.full((len(tokens), n_sel), -np.inf, dtype=np.float32)
        for i in range(len(tokens)):
            sel_mask[i, : kp * min(nvs[i], n_sel // kp)] = 0.0
            if n_sel % kp == kp - 1:
                sel_mask[i, kp * (n_sel // kp) :] = np.where(tail_idxs[i] != S, 0.0, -np.inf)
    ng = state.n_new_g
    new_pool_pos = np.zeros(4 * ng, dtype=np.int32)
    for e, (p, strm, c) in enumerate(new_first):
        x, y = kw["ext_of"](strm, c)
        new_pool_pos[[e, ng + e, 2 * ng + e, 3 * ng + e]] = [p, y, x, p]
    return {
        "pool_cells": pool_cells,
        "pool_idxs": pool_idxs,
        "pool_mask": pool_mask,
        "tail_idxs": tail_idxs,
        "new_pool_idxs": np.array(new_rows + [[pc] * kp for pc in pads], dtype=np.int32).reshape(ng, kp),
        "new_pool_rep": np.array([r[-1] for r in new_rows] + pads, dtype=np.int64),
        "sel_mask": sel_mask,
        "new_pool_pos": new_pool_pos,
    }


def reference_is_new(lay: KPoolLayout, tokens: list[Token], stale: np.ndarray | None, forced: dict[int, int]) -> Any:
    """Which pools a ubatch must pool, by plain loops over the layouts: every pool whose last
    position is at or past its sequence's stale mark, then each token's pool (order mode: the
    pool of its rank; position mode: the last pool starting at or before its position, if it
    reaches it); a rep row claimed twice is pooled once, by its first claimer."""
    kp = lay.kpool
    marks = np.full(lay.n_seq_max, 2**31 - 1, dtype=np.int64) if stale is None else stale.copy()
    for s, p in forced.items():
        marks[s] = min(int(marks[s]), p)
    claims: list[tuple[int, int]] = []
    for s, layout in enumerate(lay.seqs):
        if marks[s] != 2**31 - 1:
            claims += [(s, k) for k, j in enumerate(layout.pools) if layout.cells[j + kp - 1][0] >= marks[s]]
    for tok in tokens:
        for s in tok.seqs:
            layout = lay.seqs[s]
            if lay.by_order:
                r = layout.cells.index((tok.pos, tok.cell))
                claims += [(s, k) for k, j in enumerate(layout.pools) if j <= r < j + kp]
                continue
            before = [k for k, j in enumerate(layout.pools) if layout.cells[j][0] <= tok.pos]
            if before and tok.pos <= layout.cells[layout.pools[before[-1]] + kp - 1][0]:
                claims.append((s, before[-1]))
    starts = np.cumsum([0] + [len(x.pools) for x in lay.seqs])
    out = np.zeros(int(starts[-1]), dtype=bool)
    seen: set[int] = set()
    for s, k in claims:
        j = lay.seqs[s].pools[k]
        rep = lay.seqs[s].strm * lay.kv_size + lay.seqs[s].cells[j + kp - 1][1]
        if rep not in seen:
            seen.add(rep)
            out[starts[s] + k] = True
    return out


@given(
    seed=st.integers(0, 2**32 - 1),
    by_order=st.booleans(),
    split=st.booleans(),
    n_steps=st.integers(1, 30),
    n_sel_tail=st.booleans(),
)
def test_kpool_inputs_from_the_pool_tables_equal_a_from_scratch_build(
    seed: int, by_order: bool, split: bool, n_steps: int, n_sel_tail: bool
) -> None:
    """The k-pool graph inputs (and the new-pool state) built from per-sequence pool tables
    that grow by the new pools only, across appends, inserts below cached pairs, removals,
    shared cells, stale marks and undo (a restored layout mark, then different appends),
    equal the inputs built by plain loops over a layout rebuilt from scratch."""
    rng = np.random.default_rng(seed)
    size, n_seq, kp = 64, 3, 4
    n_stream = n_seq if split else 1
    books = [KVCells(size, n_seq) for _ in range(n_stream)]
    book = (lambda s: books[s]) if split else (lambda s: books[0])
    strm_of = (lambda s: s) if split else (lambda s: 0)
    lay = KPoolLayout(kp, by_order, n_seq, size, n_stream)
    marks = StaleMarks(n_seq)
    n_sel = kp * 3 + (kp - 1 if n_sel_tail else 0)

    def ext_of(strm: int, c: int) -> tuple[int, int]:
        return strm * 1000 + c, 3 * c + 1

    def live_pairs(q: int) -> tuple[int, Any]:
        return strm_of(q), book(q).seq_pos[q]

    def copied_pairs(q: int) -> tuple[int, Any]:
        return strm_of(q), book(q).seq_cells(q)

    for _ in range(n_steps):
        s = int(rng.integers(0, n_seq))
        c = book(s)
        op = int(rng.integers(0, 7))
        placed = edit_pairs(c, s, op, rng, marks, n_max=6, mark_max=12)
        if op == 6 and not split:  # another sequence's cell becomes shared (pools may share rep rows)
            other = int(rng.integers(0, n_seq))
            if other != s and c.seq_pos[other]:
                c.seq_add(int(rng.choice(c.seq_pos[other].cells())), s)
        before = lay.mark()
        live = rng.random() < 0.5
        live_list: Any = [book(q).seq_pos[q] for q in range(n_seq)] if live and rng.random() < 0.7 else None
        if live_list is not None and not split and rng.random() < 0.5:
            live_list = books[0].seq_pos  # the stream's whole book: the layout reads its arrays
        forced = lay.update(live_pairs if live else copied_pairs, marks, live_list)
        lay.check()
        ref = KPoolLayout(kp, by_order, n_seq, size, n_stream)
        ref.seqs = [rebuild(book(q).seq_cells(q), strm_of(q), kp, by_order) for q in range(n_seq)]
        holders = [(q, p, cell) for q in range(n_seq) for p, cell in book(q).seq_cells(q)]
        if holders:
            picks = rng.choice(len(holders), size=int(rng.integers(1, min(5, len(holders)) + 1)), replace=False)
            tokens = [Token(holders[i][1], (holders[i][0],), holders[i][2]) for i in picks.tolist()]
            if rng.random() < 0.5:  # a decode ubatch: the newest pair of every sequence that holds one
                newest = {q: book(q).seq_cells(q)[-1] for q in range(n_seq) if book(q).seq_cells(q)}
                tokens = [Token(p, (q,), cell) for q, (p, cell) in newest.items()]
            stale = marks.copy() if rng.random() < 0.5 else None
            got_state = lay.build_state(tokens, stale, len({t.seqs[0] for t in tokens}), forced=forced)
            lay.check()
            ref_state = ref.build_state(tokens, stale, len({t.seqs[0] for t in tokens}), forced=forced)
            assert (got_state.n_pool_real, got_state.n_new, got_state.n_new_g, got_state.n_kpool) == (
                ref_state.n_pool_real,
                ref_state.n_new,
                ref_state.n_new_g,
                ref_state.n_kpool,
            )
            np.testing.assert_array_equal(got_state.is_new, ref_state.is_new)
            np.testing.assert_array_equal(got_state.is_new, reference_is_new(ref, tokens, stale, forced))
            got = lay.build_inputs(got_state, tokens, size, n_sel=n_sel, with_pos=True, ext_of=ext_of)
            want = reference_kpool_inputs(ref, ref_state, tokens, size, n_sel=n_sel, ext_of=ext_of)
            for name, arr in want.items():
                np.testing.assert_array_equal(getattr(got, name), arr, err_msg=name)
                assert getattr(got, name).dtype == arr.dtype, name
        if placed.size and rng.random() < 0.4:  # undo: the layout mark back, the placed cells gone
            lay.restore(before)
            lay.check()
            c.seq_rm_many(placed, s)
        elif rng.random() < 0.5:
            marks.clear()


@pytest.mark.parametrize("kind", ["kv", "hybrid", "hybrid-iswa", "hybrid-idx"])
@pytest.mark.parametrize("unified", [True, False])
def test_seq_pos_max_all_is_seq_pos_max_of_every_sequence(kind: str, unified: bool) -> None:
    """Batch validation reads every sequence's last position in one call: it equals the
    per-sequence query after prefills of different lengths, removals and a clear."""
    import statecache
    from statecache.batch import Batch, BatchAllocator
    from statecache.factory import make_model_memory
    from statecache.spec import AttentionLayerSpec, IndexerSpec, ModelSpec, RecurrentLayerSpec

    gdn = RecurrentLayerSpec.gdn(n_head=1, head_dim=4, d_conv=2)
    att = AttentionLayerSpec(n_head_kv=1, head_dim_k=4)
    specs = {
        "kv": ModelSpec.build(1, attention={0: att}, kv_dtype="f32"),
        "hybrid": ModelSpec.build(2, recurrent={0: gdn}, attention={1: att}, kv_dtype="f32"),
        "hybrid-iswa": ModelSpec.build(
            3,
            recurrent={0: gdn},
            attention={1: att, 2: AttentionLayerSpec(n_head_kv=1, head_dim_k=4, swa=True)},
            kv_dtype="f32",
            n_swa=4,
        ),
        "hybrid-idx": ModelSpec.build(
            2, recurrent={0: gdn}, attention={1: att}, kv_dtype="f32", indexer=IndexerSpec(layers=(1,), head_size=4)
        ),
    }
    n_seq = 4
    mem = make_model_memory(specs[kind], statecache.get_device("reference"), n_seq, n_ctx=64, unified=unified)
    balloc = BatchAllocator(n_seq)

    def check() -> None:
        assert mem.seq_pos_max_all().tolist() == [mem.seq_pos_max(s) for s in range(n_seq)]

    check()
    ids = np.repeat(np.arange(3, dtype=np.int32), [5, 2, 9])  # sequence 3 stays empty
    balloc.init(Batch(tokens=np.ones(ids.size, dtype=np.int32), seq_ids=ids), mem)
    ctx = mem.init_batch(balloc, 16)
    while ctx.apply() and ctx.next():
        pass
    check()
    assert mem.seq_rm(2, 7, -1) == (kind == "kv")  # a hybrid refuses a partial removal (no rollback planes)
    check()
    assert mem.seq_rm(0, -1, -1)
    check()
    mem.clear()
    check()


@given(seed=st.integers(0, 2**32 - 1), n_ops=st.integers(1, 120), n_rows=st.integers(1, 5))
def test_seq_pair_book_holds_each_rows_sorted_keys_through_every_edit(seed: int, n_ops: int, n_rows: int) -> None:
    """Every sequence's keys in one arena (:class:`SeqPairBook`): through appends (one row or
    many at once), inserts before and between pairs, removals of the oldest, the newest or
    inner pairs (one row or runs of many rows at once), growth, moves and repacks, each row
    holds exactly its sorted keys (a plain sorted list per row is the oracle), the segments
    stay apart, and a row's stamp is unchanged exactly when only appends happened to it."""
    rng = np.random.default_rng(seed)
    book = SeqPairBook(n_rows)
    model: list[list[int]] = [[] for _ in range(n_rows)]
    used: set[int] = set()

    def fresh(lo: int = 0, hi: int = 1 << 20) -> int:
        k = int(rng.integers(lo, hi))
        while k in used:
            k = int(rng.integers(lo, hi))
        used.add(k)
        return k

    def held_keys(r: int) -> list[int]:
        """Some of row ``r``'s keys, sorted: its oldest, its newest, or any."""
        m = int(rng.integers(1, len(model[r]) + 1))
        pick = int(rng.choice(3))
        chosen = model[r][:m] if pick == 0 else model[r][-m:] if pick == 1 else rng.choice(model[r], m, False)
        return sorted(int(k) for k in chosen)

    for _ in range(n_ops):
        op = int(rng.integers(0, 8))
        stamps = book.stamps.copy()
        appended_only = np.ones(n_rows, dtype=bool)
        if op == 0:  # many rows, one key each: mostly appends, some inserts
            rows = rng.permutation(n_rows)[: int(rng.integers(1, n_rows + 1))]
            keys = []
            for r in rows.tolist():
                top = model[r][-1] + 1 if model[r] and rng.random() < 0.8 else 0
                keys.append(fresh(top, top + 64) if top else fresh())
                appended_only[r] = not model[r] or keys[-1] > model[r][-1]
                model[r] = sorted([*model[r], keys[-1]])
            book.append_keys(rows.astype(np.int64), np.asarray(keys, dtype=np.int64))
        elif op == 1:  # one row, one key anywhere
            r = int(rng.integers(0, n_rows))
            k = fresh()
            appended_only[r] = not model[r] or k > model[r][-1]
            book.add_key(r, k)
            model[r] = sorted([*model[r], k])
        elif op == 2:  # one row, a sorted run
            r = int(rng.integers(0, n_rows))
            ks = sorted(fresh() for _ in range(int(rng.integers(1, 40))))
            appended_only[r] = not model[r] or ks[0] > model[r][-1]
            book.add_many(r, np.asarray(ks, dtype=np.int64))
            model[r] = sorted(model[r] + ks)
        elif op == 3:  # one row, one held key
            r = int(rng.integers(0, n_rows))
            if model[r]:
                k = model[r][int(rng.choice([0, -1, int(rng.integers(0, len(model[r])))]))]
                book.remove_key(r, k)
                model[r].remove(k)
                appended_only[r] = False
        elif op == 4:  # one row, some held keys (a head, a tail or any)
            r = int(rng.integers(0, n_rows))
            if model[r]:
                ks = held_keys(r)
                book.remove_many(r, np.asarray(ks, dtype=np.int64))
                model[r] = [k for k in model[r] if k not in set(ks)]
                appended_only[r] = False
        elif op == 5:  # runs of several rows at once (a window cache's decode step)
            rows = [r for r in rng.permutation(n_rows).tolist() if model[r]][: int(rng.integers(1, n_rows + 1))]
            rows.sort()
            bounds, keys = [0], []
            for r in rows:
                ks = held_keys(r)
                keys += ks
                bounds.append(len(keys))
                model[r] = [k for k in model[r] if k not in set(ks)]
                appended_only[r] = False
            if rows:
                book.remove_runs(np.asarray(rows), np.asarray(bounds), np.asarray(keys, dtype=np.int64))
        elif op == 6:
            book = book.copy()
        elif rng.random() < 0.2:
            book.clear()
            model = [[] for _ in range(n_rows)]
            appended_only[:] = False
        book.check()
        for r in range(n_rows):
            assert book[r].keys.tolist() == model[r], r
            assert book[r].first_key == (model[r][0] if model[r] else -1)
            assert book[r].last_key == (model[r][-1] if model[r] else -1)
        assert book.first_keys().tolist() == [m[0] if m else -1 for m in model]
        assert book.last_keys().tolist() == [m[-1] if m else -1 for m in model]
        if op != 6:
            assert ((book.stamps == stamps) == appended_only).all(), (op, book.stamps, stamps, appended_only)


def _window_cache(n_seq: int, swa: SWAType, rollback_depth: int, unified: bool) -> Any:
    import statecache
    from statecache.kv_cache import KVCache, KVLayer

    dev = statecache.get_device("reference")
    size = (6 + rollback_depth) * n_seq + 8 if unified else 6 + rollback_depth + 8
    return KVCache(
        dev, [KVLayer(0, 2, 2)], size=size, n_seq_max=n_seq, unified=unified, dtype="f32",
        swa_type=swa, n_swa=4, n_pad=8, rollback_depth=rollback_depth,
    )  # fmt: skip


def _naive_evictable(cache: Any, cells: KVCells, need: int, own: list[int]) -> list[int]:
    """Every sequence asked in turn (the ubatch's own first, in order of appearance), each
    giving the cells below its next token's window that it holds alone, oldest first."""
    from statecache.kv_mask import swa_visible_from

    order = list(dict.fromkeys(own)) + [s for s in range(cache.n_seq_max) if s not in own]
    out: list[int] = []
    for s in order:
        pairs = cells.seq_cells(s)
        if not pairs:
            continue
        p_end = swa_visible_from(cache.n_swa, cache.swa_type, pairs[-1][0] + 1 - cache.rollback_depth)
        out += [c for p, c in pairs if p < p_end and cells.seq_count(c) == 1]
    return out[:need]


@given(
    seed=st.integers(0, 2**32 - 1),
    n_seq=st.sampled_from([3, 6, 12]),
    swa=st.sampled_from([SWAType.STANDARD, SWAType.CHUNKED, SWAType.SYMMETRIC]),
    rollback_depth=st.integers(0, 2),
    unified=st.booleans(),
    n_steps=st.integers(1, 25),
)
def test_window_eviction_one_by_one_and_vectorised_agree_with_asking_each_sequence(
    seed: int, n_seq: int, swa: SWAType, rollback_depth: int, unified: bool, n_steps: int
) -> None:
    """A window cache's decode steps and prefill chunks, run on two caches: one that plans and
    applies every reuse with the few-sequence Python path, one with the vectorised path.  The
    cells each ubatch is given are those of asking every sequence in turn (the naive pick), the
    two books stay equal and consistent, and an undo of the last batch puts a book back."""
    from statecache import kv_cache as kvc
    from statecache.batch import Batch, BatchAllocator

    rng = np.random.default_rng(seed)
    caches = [_window_cache(n_seq, swa, rollback_depth, unified) for _ in range(2)]
    few = [10**9, 0]  # the threshold each cache runs under
    saved = kvc._FEW, kvc._FEW_SEQS
    try:
        for _ in range(n_steps):
            if unified and rng.random() < 0.15:  # a copied sequence: cells held by two (never reused)
                src, dst = (int(x) for x in rng.choice(n_seq, size=2, replace=False))
                for cache in caches:
                    cache.seq_rm(dst)
                    cache.seq_cp(src, dst)
            seqs = sorted(rng.choice(n_seq, size=int(rng.integers(1, n_seq + 1)), replace=False).tolist())
            chunk = 1 if rng.random() < 0.6 else int(rng.integers(2, 7))
            ids = np.repeat(np.asarray(seqs, dtype=np.int32), chunk)
            if rng.random() < 0.3:
                ids = rng.permutation(ids).astype(np.int32)
            batch = Batch(tokens=np.ones(ids.size, dtype=np.int32), seq_ids=ids)
            n_ubatch = int(rng.integers(1, ids.size + 1))
            placed, books = [], []
            for cache, f in zip(caches, few, strict=True):
                kvc._FEW = kvc._FEW_SEQS = f
                balloc = BatchAllocator(n_seq)
                balloc.init(batch, cache)
                ctx = cache.init_batch(balloc, n_ubatch if cache.unified else ids.size)
                if ctx.status.is_fail:
                    placed.append(None)
                    continue
                cells_seen = []
                while True:
                    ub, sinfo = ctx.get_ubatch(), ctx.sinfo
                    for strm, tok in cache._stream_groups(ub):
                        cells = cache.cells[strm]
                        found = sinfo.cells[tok]
                        reused = [int(c) for c in found if cells.pos[c] != EMPTY]
                        if reused:  # the reused cells: the naive pick after the free ones
                            own = [int(s) for s in ub.primary[tok]]
                            assert reused == _naive_evictable(cache, cells, len(reused), own), f"threshold {f}"
                            # and the plan's owner of each: the one sequence that holds it
                            assert sinfo.reuse_owner is not None
                            planned = [int(sinfo.reuse_owner[t]) for t, c in zip(tok, found) if cells.pos[c] != EMPTY]
                            assert planned == [cells.seqs_of(c)[0] for c in reused]
                    cells_seen.append(sinfo.cells.tolist())
                    assert ctx.apply()
                    if not ctx.next():
                        break
                for cells in cache.cells:
                    cells.check()
                placed.append(cells_seen)
                books.append(ctx)
            assert placed[0] == placed[1]
            for a, b in zip(caches[0].cells, caches[1].cells, strict=True):
                assert a.same_as(b)
            if placed[0] is not None:  # what an undo without kept rows would drop: the same on both
                n_done = books[0].n_undoable
                assert books[0].undo_rows_damage(n_done) == books[1].undo_rows_damage(n_done)
            if placed[0] is not None and rng.random() < 0.2:  # undo the batch: each book as it was
                before = [[c.clone() for c in cache.cells] for cache in caches]
                for cache, ctx in zip(caches, books, strict=True):
                    ctx.restore((0, 0, 0))
                    for cells in cache.cells:
                        cells.check()
                for a, b in zip(caches[0].cells, caches[1].cells, strict=True):
                    assert a.same_as(b)
                for cache, bk in zip(caches, before, strict=True):  # and something was taken back
                    assert not all(c.same_as(d) for c, d in zip(cache.cells, bk, strict=True))
    finally:
        kvc._FEW, kvc._FEW_SEQS = saved
