"""Refused batches change nothing (hunt27b), on every memory kind.

After a random history (decodes, removals, copies, moves), a batch the memory cannot take is
offered: more tokens than its cells hold, positions that do not follow the sequence (a gap, a
repeat, a negative one), a sequence id out of range, coupled sequences, an empty batch.  Each
is refused (``init_batch`` fails, or the allocator raises ``BatchError`` / ``ArgumentError``) and
the whole memory, book, rows, versions and state views, is as it was; the next good batch then
plans as it would have.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_adversarial_traces import BUILDERS, fingerprint
from test_memory_queries import decode

from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, BatchError
from statecache.memory import ContextError

EXAMPLES = 10 if settings.default.max_examples <= 40 else settings.default.max_examples

PREP = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), st.dictionaries(st.integers(0, 2), st.integers(1, 5), min_size=1)),
        st.tuples(st.just("seq_rm"), st.integers(0, 2), st.integers(-1, 8), st.integers(-1, 12)),
        st.tuples(st.just("seq_cp"), st.integers(0, 2), st.integers(0, 2), st.just(-1), st.just(-1)),
        st.tuples(st.just("seq_add"), st.integers(0, 2), st.integers(-1, 6), st.just(-1), st.integers(-3, 3)),
    ),
    max_size=6,
)


def bad_batches(mem: Any, s: int) -> list[tuple[str, Batch]]:
    top = mem.seq_pos_max(s)
    nxt = top + 1
    out = [
        ("too many tokens", Batch.for_sequences({s: list(range(1, 200))})),
        ("a gap", Batch(tokens=np.array([1, 2], dtype=np.int32), pos=np.array([nxt + 2, nxt + 3]), seq_ids=[s, s])),
        ("a repeat", Batch(tokens=np.array([1, 2], dtype=np.int32), pos=np.array([nxt, nxt]), seq_ids=[s, s])),
        ("negative", Batch(tokens=np.array([1], dtype=np.int32), pos=np.array([-2]), seq_ids=[s])),
        ("bad id", Batch(tokens=np.array([1], dtype=np.int32), seq_ids=[mem.n_seq_max])),
        ("bad id -1", Batch(tokens=np.array([1], dtype=np.int32), seq_ids=[-1])),
        ("empty", Batch(tokens=np.zeros(0, dtype=np.int32), seq_ids=[])),
    ]
    if top >= 0:  # a position the sequence already holds
        out.append(("old position", Batch(tokens=np.array([1], dtype=np.int32), pos=np.array([top]), seq_ids=[s])))
    return out


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@settings(max_examples=EXAMPLES)
@given(prep=PREP, s=st.integers(0, 2), n_ubatch=st.sampled_from([1, 4, 16]))
def test_a_refused_batch_changes_nothing(kind: str, prep: list[Any], s: int, n_ubatch: int) -> None:
    mem = BUILDERS[kind]()
    s %= mem.n_seq_max
    decode(mem, {q: n for q, n in ((0, 3), (1, 2), (2, 4)) if q < mem.n_seq_max})
    for op in prep:
        if op[0] == "decode":
            decode(mem, op[1])
            continue
        try:
            getattr(mem, op[0])(*op[1:])
        except ArgumentError:
            pass
    ctx = mem.init_update()
    if ctx.status.name == "SUCCESS":
        assert ctx.apply()
    for what, batch in bad_batches(mem, s):
        before = fingerprint(mem)
        balloc = BatchAllocator(mem.n_seq_max)
        try:
            balloc.init(batch, mem)
            ctx = mem.init_batch(balloc, n_ubatch)
        except (BatchError, ArgumentError, ContextError):
            pass
        else:
            if not ctx.status.is_fail:  # accepted: the memory may take it (planning alone changes nothing)
                assert what not in ("bad id", "bad id -1", "empty", "negative"), what
        assert fingerprint(mem) == before, what
    # the memory still takes a good batch
    decode(mem, {s: 1})
