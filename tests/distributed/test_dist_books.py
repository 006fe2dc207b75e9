"""The book comparison behind check_books, in one process: two memories that saw the
same calls have equal books and equal digests; one more call on one of them is named
(field, cell, sequence).  The collective itself runs in test_dist_processes.py."""

from __future__ import annotations

from dist_memories import SPECS, build, place
from dist_tp_model import make_memory
from hypothesis import given
from hypothesis import strategies as st

import statecache
from statecache.conformance import model as M
from statecache.distributed import book_digest, book_fields, first_divergence

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("batch"), st.integers(0, 2), st.integers(1, 3)),
        st.tuples(st.just("rm"), st.integers(0, 2), st.integers(-1, 4)),
        st.tuples(st.just("cp"), st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(-2, 2)),
    ),
    max_size=8,
)


def apply(mem, op):
    kind, a, b = op
    if kind == "batch":
        place(mem, {a: list(range(1, b + 1))})
    elif kind == "rm":
        mem.seq_rm(a, b, -1)
    elif kind == "cp":
        mem.seq_cp(a, b)
    elif mem.seq_pos_max(a) >= 0:
        mem.seq_add(a, 0, -1, b)
        upd = mem.init_update()
        if upd.status.value == "success":
            upd.apply()


def pair(kind):
    dev = statecache.get_device("reference")
    if kind == "hybrid":
        return [make_memory(dev, M.model_spec("f32"), n_seq_max=3, n_ctx=16) for _ in range(2)]
    return [build(SPECS[kind], dev) for _ in range(2)]


def try_apply(mem, op):
    try:
        apply(mem, op)
    except Exception as exc:  # a refused edit (shared cell, full memory) is refused alike on both
        return type(exc).__name__
    return None


@given(kind=st.sampled_from(["hybrid", "hybrid_iswa", "hybrid_idx", "recurrent"]), ops=OPS, seq=st.integers(0, 2))
def test_same_calls_same_books_and_one_more_call_is_named(kind, ops, seq):
    a, b = pair(kind)
    for op in ops:
        assert try_apply(a, op) == try_apply(b, op)
    books = [book_fields(a), book_fields(b)]
    assert first_divergence(books) is None
    assert book_digest(books[0]) == book_digest(books[1])
    place(b, {seq: [7]})  # rank 1 alone decodes one more token of ``seq``
    books[1] = book_fields(b)
    err = first_divergence(books)
    assert err is not None and book_digest(books[0]) != book_digest(books[1])
    assert err.ranks == [1] and seq in err.seqs, err
    names = [f.name for f in books[0]]
    k = names.index(err.field)
    values = [books[r][k].values for r in (0, 1)]
    assert all(books[0][j].values.tobytes() == books[1][j].values.tobytes() for j in range(k))  # the first one
    assert err.index is not None and (values[0][err.index] != values[1][err.index]).any()
    assert f"field {err.field!r}" in str(err)


def test_memories_of_different_kinds_are_named_by_their_fields():
    dev = statecache.get_device("reference")
    a = build(SPECS["recurrent"], dev)
    b = make_memory(dev, M.model_spec("f32"), n_seq_max=3, n_ctx=16)
    err = first_divergence([book_fields(a), book_fields(b)])
    assert err is not None and err.field == "fields" and err.ranks == [1]
