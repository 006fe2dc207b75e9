"""A recurrent memory on the cpu device whose rows are rewritten by state reads, copies,
clears and rollbacks between decodes: every decode (through remembered launches, the
index buffers of the step before rewritten in place) equals the oracle's recompute."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import Toy, oracle

import statecache
from statecache.memory import StateFlags

try:
    CPU = statecache.get_device("cpu")
except Exception as exc:  # the C kernels are not built here
    pytest.skip(f"no cpu device: {exc}", allow_module_level=True)
REF = statecache.get_device("reference")
N = 3
S = st.integers(0, N - 1)
OPS = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(S, st.integers(1, 3), min_size=1)),
    st.tuples(st.just("round_trip"), S, S, st.sampled_from([StateFlags.NONE, StateFlags.WITH_PLANES])),
    st.tuples(st.just("round_trip_all")),
    st.tuples(st.just("seq_cp"), S, S),
    st.tuples(st.just("seq_rm"), S),
    st.tuples(st.just("rollback"), S, st.integers(1, 3)),
)


@settings(max_examples=25, deadline=None)
@given(program=st.lists(OPS, min_size=1, max_size=10))
def test_decodes_between_state_reads_and_moves_equal_a_recompute(program: list[Any]) -> None:
    toy = Toy(CPU, n_seq_max=N, n_rs_seq=3)
    mem = toy.mem
    rec: dict[int, list[int]] = {s: [] for s in range(N)}
    tok = iter(1 + k % 31 for k in range(10**6))

    def decode(tokens: dict[int, list[int]]) -> None:
        out = toy.decode(tokens)
        assert out is not None
        for s, ts in tokens.items():
            rec[s] += ts
            want, _ = oracle(REF, toy.tables, rec[s])
            np.testing.assert_allclose(out[(s, len(rec[s]) - 1)], want[-1], atol=2e-4, err_msg=f"{s}: {program}")

    decode({0: [next(tok) for _ in range(3)], 1: [next(tok)]})
    for op in program:
        if op[0] == "decode":
            decode({s: [next(tok) for _ in range(n)] for s, n in op[1].items()})
        elif op[0] == "round_trip":
            _, s, d, flags = op
            blob = mem.state_write(s, flags)
            mem.seq_rm(d, -1, -1)
            mem.state_read(blob, d, flags)
            rec[d] = list(rec[s])
        elif op[0] == "round_trip_all":
            blob = mem.state_write(-1)
            mem.clear(True)
            mem.state_read(blob, -1)
        elif op[0] == "seq_cp":
            mem.seq_cp(op[1], op[2], -1, -1)
            rec[op[2]] = list(rec[op[1]])
        elif op[0] == "seq_rm":
            mem.seq_rm(op[1], -1, -1)
            rec[op[1]] = []
        else:
            _, s, k = op
            P = mem.seq_pos_max(s)
            if P - k + 1 > 0 and mem.seq_rm(s, P - k + 1, -1):
                rec[s] = rec[s][:-k]
        for s in range(N):
            assert mem.seq_pos_max(s) == len(rec[s]) - 1, (op, s)
    decode({s: [next(tok)] for s in range(N)})
