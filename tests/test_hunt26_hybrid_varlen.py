"""Hybrid memories in the packed form over random walks (hunt26).

``tests/test_hybrid_varlen.py`` checks fixed batches.  Here hypothesis walks
a hybrid, hybrid-iSWA or hybrid-idx memory (unified or one stream per
sequence) through random mixed batches planned packed or equal, speculative
rollbacks (``seq_rm`` of the last tokens: accepted exactly when
``can_seq_rm`` says so, and then both parts are back), forks (``seq_cp``:
copy-on-write of both parts) and whole-sequence removals; after every batch
each sequence's last output equals the toy's oracle (recurrent recompute +
attention over exactly the cells the sequence can see).
``STATECACHE_HUNT26_HYBRID_EXAMPLES`` (default 40).
"""

from __future__ import annotations

import os

import numpy as np
from hybrid_toy import HybridToy, make_hybrid
from hypothesis import given, settings
from hypothesis import strategies as st

import statecache
from statecache.memory import MemoryStatus

ATOL = 2e-5
N_SEQ = 4
token = st.integers(0, 31)
batch = st.dictionaries(st.integers(0, N_SEQ - 1), st.lists(token, min_size=1, max_size=5), min_size=1)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("batch"), batch, st.booleans()),
        st.tuples(st.just("rollback"), st.integers(0, N_SEQ - 1), st.integers(1, 3)),
        st.tuples(st.just("fork"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1)),
        st.tuples(st.just("drop"), st.integers(0, N_SEQ - 1)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=int(os.environ.get("STATECACHE_HUNT26_HYBRID_EXAMPLES", "40")), deadline=None)
@given(ops, st.sampled_from([("hybrid", True), ("hybrid", False), ("iswa", True), ("idx", True)]),
       st.sampled_from([5, 64]), st.sampled_from([3, 64]))  # fmt: skip
def test_random_walks_of_packed_batches_equal_the_oracle(program, kind, n_ubatch, n_swa) -> None:  # type: ignore[no-untyped-def]
    dev = statecache.get_device("reference")
    name, unified = kind
    mem = make_hybrid(dev, name, n_seq_max=N_SEQ, size=64, unified=unified, n_rs_seq=2, n_swa=n_swa)
    toy = HybridToy(dev, mem)
    for op in program:
        if op[0] == "batch":
            got = toy.decode(op[1], n_ubatch=n_ubatch, varlen=op[2])
            if got is None:  # refused (no room): nothing changed (the toy records only what ran)
                continue
            for s in op[1]:
                np.testing.assert_allclose(got[(s, mem.seq_pos_max(s))], toy.expected(s), atol=ATOL, err_msg=str(op))
        elif op[0] == "rollback":
            s, k = op[1], op[2]
            P = mem.seq_pos_max(s)
            if P < 0:
                continue
            p0 = max(P + 1 - k, 1)
            can = mem.can_seq_rm(s, p0, -1)
            assert mem.seq_rm(s, p0, -1) == can
            if can:
                toy.recr_tokens[s] = toy.recr_tokens[s][:p0]
                toy.attn_hist[s] = [(p, t) for p, t in toy.attn_hist[s] if p < p0]
        elif op[0] == "fork":
            a, b = op[1], op[2]
            if a == b or mem.seq_pos_max(a) < 0:
                continue
            mem.seq_rm(b, -1, -1)
            mem.seq_cp(a, b)
            upd = mem.init_update()  # a copy between streams waits for the update, as a runtime runs it
            if upd.status is MemoryStatus.SUCCESS:
                assert upd.apply()
            toy.recr_tokens[b] = list(toy.recr_tokens.get(a, []))
            toy.attn_hist[b] = list(toy.attn_hist.get(a, []))
        else:
            assert mem.seq_rm(op[1], -1, -1)
            toy.forget(op[1])
        for s in range(N_SEQ):
            assert mem.seq_pos_max(s) == len(toy.recr_tokens.get(s, [])) - 1, (s, op)
