"""Position edits on hybrid memories against a recompute (hunt27b).

The hybrid toy (tests/hybrid_toy.py: recurrent layers plus one attention layer) decodes
between ``seq_add``, ``seq_div``, ``context_shift`` and whole-sequence copies.  A position
edit moves the recurrent state's position and the attention cells' positions and nothing
else, so every output must equal the recurrent oracle over the tokens absorbed plus
attention over the moved ``(position, token)`` history (window applied for hybrid-iSWA); the
next token lands right after the highest position both parts agree on; a refused edit
changes nothing (full fingerprint).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hybrid_toy import HybridToy, attention, emb, make_hybrid
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import Toy, oracle
from test_adversarial_traces import fingerprint

import statecache
from statecache.errors import ArgumentError
from statecache.kv_mask import is_masked_swa
from statecache.memory import MemoryStatus

DEV = statecache.get_device("reference")
EXAMPLES = 15 if settings.default.max_examples <= 40 else settings.default.max_examples
N = 3

OPS = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(st.integers(0, N - 1), st.integers(1, 3), min_size=1)),
    st.tuples(st.just("seq_add"), st.integers(0, N - 1), st.integers(-1, 8), st.integers(-1, 10), st.integers(-4, 4)),
    st.tuples(st.just("seq_div"), st.integers(0, N - 1), st.integers(-1, 8), st.integers(-1, 10), st.integers(1, 3)),
    st.tuples(st.just("context_shift"), st.integers(0, N - 1), st.integers(0, 6), st.integers(1, 9)),
    st.tuples(st.just("seq_cp"), st.integers(0, N - 1), st.integers(0, N - 1), st.just(-1), st.just(-1)),
    st.tuples(st.just("seq_keep"), st.integers(0, N - 1)),
)


def norm(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (2**31 - 1 if p1 < 0 else p1)


def edit(hist: list[tuple[int, int]], op: tuple[Any, ...]) -> list[tuple[int, int]]:
    """The same edit on a plain (position, token) history."""
    name = op[0]
    if name == "context_shift":
        _, _, p0, p1 = op
        if p0 >= p1:
            return hist  # an empty range: a no-op
        return [(p - (p1 - p0) if p >= p1 else p, t) for p, t in hist if not p0 <= p < p1]
    q0, q1 = norm(op[2], op[3])
    if name == "seq_add":
        moved = [(p + op[4] if q0 <= p < q1 else p, t) for p, t in hist]
        return [(p, t) for p, t in moved if p >= 0]
    return [(p // op[4] if q0 <= p < q1 else p, t) for p, t in hist]


def check_against_oracle(toy: HybridToy, out: dict[Any, Any], tokens: dict[int, list[int]],
                         hist: dict[int, list[tuple[int, int]]], rec: dict[int, list[int]]) -> None:  # fmt: skip
    """Append ``tokens`` to each sequence's history (``hist``: (position, token) in decode
    order; ``rec``: the recurrent state's tokens) and compare every output of the decode with
    the recurrent oracle plus (windowed) attention over the history's positions."""
    window = toy.window
    for s, ts in tokens.items():
        p = max((q for q, _ in hist[s]), default=-1) + 1
        for k, t in enumerate(ts):
            hist[s].append((p + k, t))
            rec[s].append(t)
            vis = [
                (q, u)
                for q, u in hist[s]
                if q <= p + k and not (window and is_masked_swa(window[1], window[0], q, p + k))
            ]
            y_rec, _ = oracle(DEV, toy.tables, rec[s])
            kk = np.stack([emb(u, 1) for _, u in vis])
            vv = np.stack([emb(u, 2) for _, u in vis])
            a = attention(emb(t, 3), kk, vv, np.zeros(len(vis), dtype=np.float32))
            np.testing.assert_allclose(out[(s, p + k)], np.concatenate([y_rec[-1], a]), atol=2e-4)


class OracleRun:
    """A hybrid toy over ``mem`` with the oracle's books: ``hist`` holds attention's
    (position, token) of each sequence in decode order, ``rec`` the recurrent state's
    tokens.  ``run`` decodes and checks the outputs against a recompute over both;
    ``removed`` applies an accepted ``seq_rm`` to the books."""

    def __init__(self, mem: Any, n_seq: int, apply_updates: bool = False) -> None:
        for cache in mem.kv_caches:
            cache.can_shift = False  # the toy's attention has no RoPE: a shift only moves positions
        self.mem, self.apply_updates = mem, apply_updates
        self.toy = HybridToy(DEV, mem)
        self.hist: dict[int, list[tuple[int, int]]] = {s: [] for s in range(n_seq)}
        self.rec: dict[int, list[int]] = {s: [] for s in range(n_seq)}

    def run(self, tokens: dict[int, list[int]]) -> None:
        if self.apply_updates:  # a pending shift is applied before the batch, as a runtime does
            ctx = self.mem.init_update()
            if ctx.status is MemoryStatus.SUCCESS:
                assert ctx.apply()
        out = self.toy.decode(tokens)
        assert out is not None
        check_against_oracle(self.toy, out, tokens, self.hist, self.rec)

    def applied(self, op: tuple[Any, ...], n_seq: int) -> None:
        """The books after an accepted ``seq_cp``, ``seq_keep``, ``seq_add`` or ``seq_div``."""
        hist, rec = self.hist, self.rec
        if op[0] == "seq_cp":
            if op[1] != op[2]:
                hist[op[2]], rec[op[2]] = list(hist[op[1]]), list(rec[op[1]])
        elif op[0] == "seq_keep":
            for s in range(n_seq):
                if s != op[1]:
                    hist[s], rec[s] = [], []
        else:
            s = op[1]
            hist[s] = edit(hist[s], op)
            if not hist[s]:
                rec[s] = []  # every position gone: the state goes with them

    def removed(self, s: int, q0: int, q1: int, P: int) -> None:
        """The books after an accepted ``seq_rm(s, q0, q1)`` of a sequence ending at ``P``."""
        hist, rec = self.hist, self.rec
        kept = [(q, t) for q, t in hist[s] if not q0 <= q < q1]
        if q0 <= P < q1 and q0 > 0:  # a rollback: the last k tokens decoded, in both parts
            k = P - q0 + 1
            assert len(hist[s]) - len(kept) == k and hist[s][:-k] == kept, ((q0, q1), hist[s])
            rec[s] = rec[s][:-k]
        elif q0 <= P < q1:  # from 0 through the end: everything goes
            assert not kept, ((q0, q1), hist[s])
            rec[s] = []
        hist[s] = kept  # a hole or a head: the state keeps what attention drops


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_streams", "iswa_full", "idx"])
@settings(max_examples=EXAMPLES)
@given(program=st.lists(OPS, min_size=2, max_size=12))
def test_hybrid_position_edits_match_a_recompute(kind: str, program: list[Any]) -> None:
    base = {"hybrid_streams": "hybrid", "iswa_full": "iswa"}.get(kind, kind)
    mem = make_hybrid(DEV, base, size=40, unified=kind != "hybrid_streams", swa_full=True, n_swa=3)
    o = OracleRun(mem, N, apply_updates=True)
    hist, run = o.hist, o.run
    tok = iter(1 + k % 31 for k in range(10**6))  # the toy vocabulary: 32 tokens

    run({0: [next(tok) for _ in range(4)], 1: [next(tok) for _ in range(2)]})
    for op in program:
        if op[0] == "decode":
            if sum(len(h) for h in hist.values()) + sum(op[1].values()) > 30:
                continue
            run({s: [next(tok) for _ in range(n)] for s, n in op[1].items()})
            continue
        before = fingerprint(mem)
        try:
            getattr(mem, op[0])(*op[1:])
        except ArgumentError:
            assert fingerprint(mem) == before, op
            continue
        o.applied(op, N)
        for s in range(N):
            top = max((q for q, _ in hist[s]), default=-1)
            assert mem.seq_pos_max(s) == top, (op, s, mem.seq_pos_max(s), top)
    run({s: [next(tok)] for s in range(N)})


ROLL_OPS = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(st.integers(0, 1), st.integers(1, 2), min_size=1)),
    st.tuples(st.just("seq_add"), st.integers(0, 1), st.integers(-1, 8), st.just(-1), st.integers(-3, 4)),
    st.tuples(st.just("seq_div"), st.integers(0, 1), st.integers(-1, 8), st.just(-1), st.integers(2, 3)),
    st.tuples(st.just("rollback"), st.integers(0, 1), st.integers(0, 12)),
)


@pytest.mark.parametrize("kind", ["hybrid", "iswa_full", "idx"])
@settings(max_examples=EXAMPLES)
@given(program=st.lists(ROLL_OPS, min_size=2, max_size=12))
def test_rollback_after_position_edits_keeps_the_parts_in_step(kind: str, program: list[Any]) -> None:
    """A rollback ``seq_rm(s, p, -1)`` after position edits: when accepted, the recurrent
    state left must be the one of exactly the tokens attention keeps (those now below ``p``,
    a prefix of the decode order), and the next output must match a recompute."""
    base = {"iswa_full": "iswa"}.get(kind, kind)
    mem = make_hybrid(DEV, base, size=40, n_seq_max=2, n_rs_seq=3, swa_full=True, n_swa=3)
    o = OracleRun(mem, 2)
    hist, rec, run = o.hist, o.rec, o.run
    tok = iter(1 + k % 31 for k in range(10**6))

    run({0: [next(tok) for _ in range(3)], 1: [next(tok)]})
    run({0: [next(tok)], 1: [next(tok)]})
    for op in program:
        if op[0] == "decode":
            if sum(len(h) for h in hist.values()) + sum(op[1].values()) > 24:
                continue
            run({s: [next(tok) for _ in range(n)] for s, n in op[1].items()})
        elif op[0] == "rollback":
            s, p = op[1:]
            before = fingerprint(mem)
            can = mem.can_seq_rm(s, p, -1)
            if not mem.seq_rm(s, p, -1):
                assert not can and fingerprint(mem) == before, op
                continue
            assert can, op
            kept = [(q, t) for q, t in hist[s] if q < p]
            if len(kept) < len(hist[s]):
                # the recurrent state can only be the one after a prefix of the decode order
                assert hist[s][: len(kept)] == kept, f"rollback {op} keeps a non-prefix {kept} of {hist[s]}"
                # the state drops the tokens rolled back (it keeps any a shift pushed below 0)
                # (removing every position removes the state)
                n_rec = len(rec[s]) - (len(hist[s]) - len(kept)) if kept else 0
                hist[s], rec[s] = kept, rec[s][:n_rec]
        else:
            try:
                getattr(mem, op[0])(*op[1:])
            except ArgumentError:
                continue
            s = op[1]
            hist[s] = edit(hist[s], op)
            if not hist[s]:
                rec[s] = []
        for s in range(2):
            assert mem.seq_pos_max(s) == max((q for q, _ in hist[s]), default=-1), (op, s)
    run({s: [next(tok)] for s in range(2)})


@pytest.mark.parametrize("kind", ["hybrid", "iswa_full", "idx"])
def test_a_rollback_after_a_reordering_move_keeps_the_parts_in_step(kind: str) -> None:
    """Found by the stress profile of the property above: seq_add(0, 2, -1, -3) folds positions
    3 and 4 onto 0 and 1; seq_rm(0, 1, -1) would remove, from attention, the tokens now at 1
    (decoded second and fifth) while the recurrent state undoes only the last one.  It is
    refused, changing nothing; the reach says so; a rollback that cuts only the last token
    decoded, and a full removal, are still accepted, and the next token matches a recompute."""
    base = {"iswa_full": "iswa"}.get(kind, kind)
    mem = make_hybrid(DEV, base, size=40, n_seq_max=2, n_rs_seq=3, swa_full=True, n_swa=3)
    o = OracleRun(mem, 2)
    hist, rec, run = o.hist, o.rec, o.run

    run({0: [1, 2, 3], 1: [4]})
    run({0: [5], 1: [6]})
    run({0: [7]})
    mem.seq_add(0, 2, -1, -3)  # accepted, as upstream does: positions 0, 1, (gone), 0, 1
    hist[0] = edit(hist[0], ("seq_add", 0, 2, -1, -3))
    assert [q for q, _ in hist[0]] == [0, 1, 0, 1]
    before = fingerprint(mem)
    assert not mem.can_seq_rm(0, 1, -1)
    with pytest.raises(ArgumentError, match="reordered"):
        mem.check_seq_rm(0, 1, -1)
    assert not mem.seq_rm(0, 1, -1)
    assert fingerprint(mem) == before
    reach = mem.rollback_reach(0)
    assert (reach.pos_max, reach.floor) == (1, 2)  # nothing but dropping it all
    assert not reach.accepts(1) and reach.accepts(0) and reach.accepts(2)
    # the other sequence never moved: its rollback still works
    assert mem.seq_rm(1, 1, -1)
    hist[1], rec[1] = hist[1][:1], rec[1][:1]
    run({0: [8], 1: [9]})  # sequence 0 at 2, after the four tokens its state holds
    # the token just decoded is the only one at position 2: rolling it back is exact
    assert mem.rollback_reach(0).floor == 2 and mem.seq_rm(0, 2, -1)
    hist[0], rec[0] = hist[0][:-1], rec[0][:-1]
    run({0: [10]})
    assert mem.seq_rm(0, -1, -1) and mem.seq_pos_max(0) == -1  # a full removal is always accepted
    hist[0], rec[0] = [], []
    run({0: [11, 12], 1: [13]})


@pytest.mark.parametrize("kind", ["hybrid", "iswa_full", "idx"])
def test_moves_below_the_state_keep_the_rollback_labels_true(kind: str) -> None:
    """Moves that leave the recurrent state where it is still relabel tokens a rollback would
    undo: seq_add(0, 3, 4, -3) puts the fourth token at 0 and seq_add(0, 1, 2, 2) the second
    at 3, so positions 3.. hold the second and fifth tokens, as many as a rollback to 2
    undoes, but not the same ones (the fifth and the fourth).  The planes those moves
    relabelled are no longer offered, so that rollback is refused; a move below every plane
    keeps them, and the rollback then matches a recompute."""
    base = {"iswa_full": "iswa"}.get(kind, kind)
    mem = make_hybrid(DEV, base, size=40, n_seq_max=2, n_rs_seq=4, swa_full=True, n_swa=3)
    o = OracleRun(mem, 2)
    hist, rec, run = o.hist, o.rec, o.run

    def move(*op: Any) -> None:
        getattr(mem, op[0])(*op[1:])
        hist[op[1]] = edit(hist[op[1]], op)

    run({0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10]})
    assert mem.rollback_reach(0).floor == 0  # every depth
    move("seq_add", 0, 3, 4, -3)
    move("seq_add", 0, 1, 2, 2)
    assert [q for q, _ in hist[0]] == [0, 3, 2, 0, 4]
    before = fingerprint(mem)
    assert not mem.can_seq_rm(0, 3, -1) and not mem.seq_rm(0, 3, -1)
    assert fingerprint(mem) == before and mem.rollback_reach(0).floor == 5
    run({0: [11]})  # still continues after what it holds
    # a move below every plane a rollback reads keeps them
    move("seq_add", 1, 0, 1, -1)  # the first token of sequence 1 goes (below 0)
    assert mem.rollback_reach(1).floor == 2
    assert mem.seq_rm(1, 2, -1)  # undoes the last three tokens decoded: positions 2, 3, 4
    hist[1], rec[1] = hist[1][:-3], rec[1][:-3]
    run({0: [12], 1: [13]})


def test_recurrent_moves_below_the_state_keep_the_rollback_labels_true() -> None:
    """The recurrent memory alone: seq_add(0, 2, 4, -1) moves the third and fourth tokens to 1
    and 2; a rollback to 1 would undo three tokens, one of them now at position 1, and set
    the position to 1 after the second token.  Only the planes above the range stay offered
    (here: none but the state); a divisor below the planes keeps them, and a rollback then
    equals a recompute of what it keeps."""
    toy = Toy(DEV, n_seq_max=2, n_rs_seq=4)
    mem = toy.mem
    toy.decode({0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10]})
    assert mem.rollback_reach(0).floor == 0  # every depth
    mem.seq_add(0, 2, 4, -1)
    assert mem.seq_pos_max(0) == 4 and mem.rollback_reach(0).floor == 5
    before = fingerprint(mem)
    assert not mem.can_seq_rm(0, 2, -1) and not mem.seq_rm(0, 4, -1)
    assert fingerprint(mem) == before
    mem.seq_div(1, 0, 2, 2)  # positions 0, 0, 2, 3, 4: the planes from 2 up stay
    assert mem.rollback_reach(1).floor == 3
    assert mem.seq_rm(1, 3, -1)  # undoes the tokens at 4 and 3
    out = toy.decode({1: [11]})
    assert out is not None
    want, _ = oracle(DEV, toy.tables, [6, 7, 8, 11])
    np.testing.assert_allclose(out[(1, 3)], want[-1], atol=2e-4)


RM_OPS = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(st.integers(0, 1), st.integers(1, 3), min_size=1)),
    st.tuples(st.just("seq_add"), st.integers(0, 1), st.integers(-1, 8), st.integers(-1, 10), st.integers(-4, 4)),
    st.tuples(st.just("seq_div"), st.integers(0, 1), st.integers(-1, 8), st.integers(-1, 10), st.integers(2, 3)),
    st.tuples(st.just("seq_cp"), st.integers(0, 1), st.integers(0, 1), st.just(-1), st.just(-1)),
    st.tuples(st.just("context_shift"), st.integers(0, 1), st.integers(0, 6), st.integers(1, 9)),
    st.tuples(st.just("seq_rm"), st.integers(0, 1), st.integers(-1, 12), st.just(-1)),
    st.tuples(st.just("seq_rm"), st.integers(0, 1), st.integers(-1, 12), st.integers(-1, 14)),
)


def check_reach(mem: Any, s: int) -> None:
    """``rollback_reach`` says exactly which rollbacks ``seq_rm`` accepts."""
    reach = mem.rollback_reach(s)
    for p in range(0, mem.seq_pos_max(s) + 2):
        assert reach.accepts(p) == mem.can_seq_rm(s, p, -1), (s, p, reach)


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_streams", "iswa_full", "iswa", "idx"])
@settings(max_examples=EXAMPLES)
@given(program=st.lists(RM_OPS, min_size=2, max_size=14))
def test_every_accepted_removal_keeps_the_parts_in_step(kind: str, program: list[Any]) -> None:
    """Removals by position between decodes, position moves (reordering ones included) and
    copies: an accepted rollback cuts from attention exactly the tokens the recurrent part
    undoes (the last ``k`` decoded, ``k = seq_pos_max - p0 + 1``), a hole or head removal
    cuts the range from attention and keeps the state (a context shift's half), a full
    removal drops both; every later output matches a recompute over what each part holds.
    A refused removal changes nothing (full fingerprint), ``can_seq_rm`` agrees with
    ``seq_rm`` and ``rollback_reach`` with ``can_seq_rm``."""
    base = {"hybrid_streams": "hybrid", "iswa_full": "iswa"}.get(kind, kind)
    mem = make_hybrid(
        DEV, base, size=40, n_seq_max=2, n_rs_seq=4, unified=kind != "hybrid_streams", swa_full=kind != "iswa", n_swa=3
    )
    o = OracleRun(mem, 2, apply_updates=True)
    hist, run = o.hist, o.run
    removed = o.removed
    tok = iter(1 + k % 31 for k in range(10**6))

    run({0: [next(tok) for _ in range(4)], 1: [next(tok) for _ in range(2)]})
    run({0: [next(tok)], 1: [next(tok)]})
    for op in program:
        if op[0] == "decode":
            if sum(len(h) for h in hist.values()) + sum(op[1].values()) > 30:
                continue
            run({s: [next(tok) for _ in range(n)] for s, n in op[1].items()})
        elif op[0] == "seq_rm":
            s, p0, p1 = op[1:]
            q0, q1 = norm(p0, p1)
            P = mem.seq_pos_max(s)
            before = fingerprint(mem)
            can = mem.can_seq_rm(s, p0, p1)
            if not mem.seq_rm(s, p0, p1):
                assert not can and fingerprint(mem) == before, op
                continue
            assert can, op
            removed(s, q0, q1, P)
        else:
            if op[0] == "context_shift" and op[2] < op[3]:
                P = mem.seq_pos_max(op[1])
            before = fingerprint(mem)
            try:
                getattr(mem, op[0])(*op[1:])
            except ArgumentError:
                assert fingerprint(mem) == before, op
                continue
            if op[0] == "context_shift":
                if op[2] < op[3]:  # the removal (it may reach the end: a rollback), then the move
                    s, q0, q1 = op[1:]
                    removed(s, q0, q1, P)
                    hist[s] = edit(hist[s], ("seq_add", s, q1, -1, q0 - q1))
            else:
                o.applied(op, 2)
        for s in range(2):
            assert mem.seq_pos_max(s) == max((q for q, _ in hist[s]), default=-1), (op, s)
            check_reach(mem, s)
    run({s: [next(tok)] for s in range(2)})
