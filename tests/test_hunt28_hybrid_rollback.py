"""The hybrid rollback rule after reordering moves, over wider traces (hunt28).

Three sequences; besides decodes, position moves (reordering ones included) and removals:
``seq_cp`` to a sequence that then shares the source's state and cells, ``seq_keep``, and
state round trips (one sequence written and read back in place or into another sequence,
with and without the rollback planes, and the whole memory).  After every step: an accepted
removal cut from the attention part exactly the tokens the recurrent part undid (checked
against a recompute of both parts); a refused one changed nothing; ``can_seq_rm`` agrees
with ``seq_rm``, ``rollback_reach`` with ``can_seq_rm``; the next decode of every sequence
matches a recompute."""

from __future__ import annotations

from typing import Any

import pytest
from hybrid_toy import make_hybrid
from hypothesis import given, settings
from hypothesis import strategies as st
from test_adversarial_traces import fingerprint
from test_hunt27b_hybrid_positions import OracleRun, check_reach, norm

import statecache
from statecache.errors import ArgumentError, StateError
from statecache.memory import StateFlags

DEV = statecache.get_device("reference")
EXAMPLES = 20 if settings.default.max_examples <= 40 else settings.default.max_examples
N = 3
S = st.integers(0, N - 1)
FLAGS = st.sampled_from([StateFlags.NONE, StateFlags.WITH_PLANES])

OPS = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(S, st.integers(1, 3), min_size=1)),
    st.tuples(st.just("seq_add"), S, st.integers(-1, 8), st.integers(-1, 10), st.integers(-4, 4)),
    st.tuples(st.just("seq_div"), S, st.integers(-1, 8), st.integers(-1, 10), st.integers(2, 3)),
    st.tuples(st.just("seq_cp"), S, S, st.just(-1), st.just(-1)),
    st.tuples(st.just("seq_keep"), S),
    st.tuples(st.just("seq_rm"), S, st.integers(-1, 12), st.just(-1)),
    st.tuples(st.just("seq_rm"), S, st.integers(-1, 12), st.integers(-1, 14)),
    st.tuples(st.just("round_trip"), S, S, FLAGS),  # write one sequence, read it into another (or itself)
    st.tuples(st.just("round_trip_all"), FLAGS),
)


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_streams", "iswa_full", "iswa", "idx"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(program=st.lists(OPS, min_size=2, max_size=14))
def test_rollbacks_stay_in_step_through_copies_keeps_and_state_round_trips(kind: str, program: list[Any]) -> None:
    base = {"hybrid_streams": "hybrid", "iswa_full": "iswa"}.get(kind, kind)
    mem = make_hybrid(
        DEV, base, size=48, n_seq_max=N, n_rs_seq=4, unified=kind != "hybrid_streams", swa_full=kind != "iswa", n_swa=3
    )
    o = OracleRun(mem, N, apply_updates=True)
    hist, rec, run = o.hist, o.rec, o.run
    removed = o.removed
    tok = iter(1 + k % 31 for k in range(10**6))

    run({0: [next(tok) for _ in range(4)], 1: [next(tok) for _ in range(2)]})
    run({0: [next(tok)], 1: [next(tok)], 2: [next(tok) for _ in range(3)]})
    for op in program:
        name = op[0]
        before = fingerprint(mem)
        if name == "decode":
            if sum(len(h) for h in hist.values()) + sum(op[1].values()) > 36:
                continue
            run({s: [next(tok) for _ in range(n)] for s, n in op[1].items()})
        elif name == "seq_rm":
            s, p0, p1 = op[1:]
            q0, q1 = norm(p0, p1)
            P = mem.seq_pos_max(s)
            can = mem.can_seq_rm(s, p0, p1)
            if not mem.seq_rm(s, p0, p1):
                assert not can and fingerprint(mem) == before, op
                continue
            assert can, op
            removed(s, q0, q1, P)
        elif name == "round_trip":
            _, s, d, flags = op
            blob = mem.state_write(s, flags)
            if s != d:
                mem.seq_rm(d, -1, -1)  # a read lands in an empty sequence
            mem.seq_rm(s, -1, -1) if s == d else None
            try:
                mem.state_read(blob, d, flags)
            except StateError:  # no room for the copy: the destination was emptied above
                hist[d], rec[d] = [], []
                continue
            hist[d], rec[d] = list(hist[s]), list(rec[s])
        elif name == "round_trip_all":
            blob = mem.state_write(-1, op[1])
            mem.clear(True)
            mem.state_read(blob, -1, op[1])
        else:
            try:
                getattr(mem, name)(*op[1:])
            except ArgumentError:
                assert fingerprint(mem) == before, op
                continue
            o.applied(op, N)
        for s in range(N):
            assert mem.seq_pos_max(s) == max((q for q, _ in hist[s]), default=-1), (op, s)
            check_reach(mem, s)
    run({s: [next(tok)] for s in range(N)})
