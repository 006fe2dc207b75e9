"""Splitters keep every sequence's tokens in batch order (hunt26).

A batch may couple sequences (a token of several sequences) between tokens
of those sequences alone: ``(0,) (1,) (0, 1) (0,)``.  Whatever the cut,
each sequence must advance through its tokens in batch order: a state (or
a K/V cache's causal mask) that sees position 7 before position 6 is
wrong.  The splitters that take sets in one ubatch (``split_varlen``,
``split_equal`` without ``sequential``) once took all of set ``(0,)``'s
tokens, positions 5 and 7, before the coupled token at position 6.

The property: for random valid batches with coupled tokens, every token is
emitted at most once, and per sequence the emitted order (ubatch by
ubatch, and inside a ubatch in its token order) is the batch order.
Tokens that cannot be placed are left (the memory then refuses the plan);
without a keep-tail rule every token is placed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from statecache.batch import Batch, BatchAllocator
from statecache.errors import BatchError

N_SEQ = 4


@st.composite
def coupled_batches(draw):  # type: ignore[no-untyped-def]
    """(seq_ids per token, positions): runs of tokens of random sequence sets; a coupled
    run's sequences stand at one position (the batch validation's rule)."""
    pos = [0] * N_SEQ
    seq_ids: list[tuple[int, ...]] = []
    positions: list[int] = []
    for _ in range(draw(st.integers(1, 7))):
        members = draw(st.lists(st.integers(0, N_SEQ - 1), min_size=1, max_size=3, unique=True))
        members = tuple(sorted(q for q in members if pos[q] == pos[members[0]]))
        count = draw(st.integers(1, 4))
        if len(members) > 1 and draw(st.booleans()):  # each alone first, level: then coupling stays valid
            for q in members:
                for _ in range(count):
                    seq_ids.append((q,))
                    positions.append(pos[q])
                    pos[q] += 1
        for _ in range(count):
            seq_ids.append(members)
            positions.append(pos[members[0]])
            for q in members:
                pos[q] += 1
    return seq_ids, positions


def _emitted_in_order(balloc: BatchAllocator, split, n_keep_tail: int = 0) -> list[int]:  # type: ignore[no-untyped-def]
    """Run a splitter to exhaustion; check each sequence advances in batch order and, when
    every token was placed, each set's last ``n_keep_tail`` tokens share one ubatch."""
    seen: list[int] = []
    last = {q: -1 for q in range(N_SEQ)}
    ubatch_of: dict[int, int] = {}
    k = 0
    while (ub := split(balloc)).n_tokens:
        for i in ub.token_idx.tolist():
            for q in balloc.seq_id[i]:
                assert i > last[q], f"sequence {q}: token {i} emitted after token {last[q]}"
                last[q] = i
            seen.append(i)
            ubatch_of[i] = k
        k += 1
    assert len(seen) == len(set(seen))
    if n_keep_tail and len(seen) == balloc.n_tokens:
        by_set: dict[tuple[int, ...], list[int]] = {}
        for i in range(balloc.n_tokens):
            by_set.setdefault(tuple(balloc.seq_id[i]), []).append(i)
        for ids, toks in by_set.items():
            tail = {ubatch_of[i] for i in toks[-n_keep_tail:]}
            assert len(tail) == 1, f"set {ids}: its last {n_keep_tail} tokens span ubatches {sorted(tail)}"
    return seen


def _allocator(seq_ids, positions) -> BatchAllocator:  # type: ignore[no-untyped-def]
    balloc = BatchAllocator(N_SEQ)
    n = len(seq_ids)
    try:
        balloc.init(Batch(tokens=np.arange(n), seq_ids=seq_ids, pos=np.asarray(positions)), None)
    except BatchError:
        assume(False)
    return balloc


@given(coupled_batches(), st.integers(1, 12), st.sampled_from([0, 0, 2, 3]))
def test_split_varlen_keeps_each_sequence_in_batch_order(batch, n_ubatch, n_keep_tail) -> None:  # type: ignore[no-untyped-def]
    assume(n_ubatch > n_keep_tail)
    balloc = _allocator(*batch)
    seen = _emitted_in_order(balloc, lambda b: b.split_varlen(n_ubatch, n_keep_tail), n_keep_tail)
    if n_keep_tail == 0:
        assert len(seen) == balloc.n_tokens


@given(coupled_batches(), st.integers(1, 12), st.sampled_from([0, 0, 2, 3]))
def test_split_equal_keeps_each_sequence_in_batch_order(batch, n_ubatch, n_keep_tail) -> None:  # type: ignore[no-untyped-def]
    assume(n_ubatch > n_keep_tail)
    balloc = _allocator(*batch)
    seen = _emitted_in_order(balloc, lambda b: b.split_equal(n_ubatch, False, n_keep_tail), n_keep_tail)
    if n_keep_tail == 0:
        assert len(seen) == balloc.n_tokens


def test_the_example_own_coupled_own() -> None:
    # seq 0: 5 (own), 6 (with 1), 7 (own); seq 1: 5 (own), 6 (with 0)
    seq_ids = [(0,), (1,), (0, 1), (0,)]
    for split in (lambda b: b.split_varlen(64), lambda b: b.split_equal(64, False)):
        balloc = _allocator(seq_ids, [5, 5, 6, 7])
        assert sorted(_emitted_in_order(balloc, split)) == [0, 1, 2, 3]


@pytest.mark.parametrize("varlen", [True, False])
def test_split_seq_is_unaffected(varlen: bool) -> None:  # split_seq walks batch order by construction
    balloc = _allocator([(0,), (1,), (0, 1), (0,)], [5, 5, 6, 7])
    _emitted_in_order(balloc, lambda b: b.split_seq(64))


def test_a_varlen_recurrent_batch_with_a_coupled_token_between_own_tokens_equals_recompute() -> None:
    """Through the memory: sequence 0's own token at position 7 once ran before the
    coupled token at 6 (one packed ubatch took both of set (0,)'s tokens)."""
    from recurrent_toy import Toy, oracle

    import statecache

    dev = statecache.get_device("reference")
    t = Toy(dev, n_seq_max=3)
    t.decode({0: [1, 2, 3, 4, 5]})
    t.decode({1: [1, 2, 3, 4, 6]})
    batch = Batch(tokens=np.asarray([7, 8, 9, 10]), seq_ids=[(0,), (1,), (0, 1), (0,)], pos=np.asarray([5, 5, 6, 7]))
    balloc = BatchAllocator(3)
    balloc.init(batch, t.mem)
    ctx = t.mem.init_batch(balloc, 512, varlen=True)
    assert not ctx.status.is_fail
    out = {}
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        y = t.run_step(ctx.step(), ub.token).reshape(ub.n_tokens, -1)
        for i in range(ub.n_tokens):
            out[int(ub.token_idx[i])] = y[i]
        if not ctx.next():
            break
    want, _ = oracle(dev, t.tables, [1, 2, 3, 4, 5, 7, 9, 10])
    np.testing.assert_allclose(np.stack([out[0], out[2], out[3]]), want[-3:], atol=2e-5)
    assert t.mem.seq_pos_max(0) == 7


@settings(max_examples=int(os.environ.get("STATECACHE_HUNT26_COUPLED_EXAMPLES", "40")), deadline=None)
@given(coupled_batches(), st.sampled_from([4, 6, 64]), st.sampled_from([0, 2]))
def test_coupled_varlen_batches_through_a_recurrent_memory_equal_recompute(batch, n_ubatch, n_rs_seq) -> None:  # type: ignore[no-untyped-def]
    """Every planned coupled batch computes what each sequence's history gives from zeros: a
    coupled token's sequences continue from its first (primary) sequence's state (the
    secondaries give up theirs, docs/memory-semantics.md); a plan that fails changes nothing."""
    from recurrent_toy import VOCAB, Toy, oracle

    import statecache

    seq_ids, positions = batch
    dev = statecache.get_device("reference")
    t = Toy(dev, n_seq_max=N_SEQ, n_rs_seq=n_rs_seq)
    tokens = [(7 * i + 3) % VOCAB for i in range(len(seq_ids))]
    balloc = BatchAllocator(N_SEQ)
    try:
        balloc.init(Batch(tokens=np.asarray(tokens), seq_ids=seq_ids, pos=np.asarray(positions)), t.mem)
    except BatchError:
        assume(False)
    before = t.mem.state_write()
    ctx = t.mem.init_batch(balloc, n_ubatch, varlen=True)
    if ctx.status.is_fail:
        assert t.mem.state_write() == before
        return
    out = {}
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        y = t.run_step(ctx.step(), ub.token).reshape(ub.n_tokens, -1)
        for i in range(ub.n_tokens):
            out[int(ub.token_idx[i])] = y[i]
        if not ctx.next():
            break
    hist: dict[int, list[int]] = {q: [] for q in range(N_SEQ)}
    for i, ids in enumerate(seq_ids):  # batch order is each sequence's order
        h = [*hist[ids[0]], tokens[i]]
        for q in ids:
            hist[q] = list(h)
        want, _ = oracle(dev, t.tables, h)
        np.testing.assert_allclose(out[i], want[-1], atol=2e-5, err_msg=f"token {i} of {ids}")
    for q, h in hist.items():
        if h:
            _, states = oracle(dev, t.tables, h)
            assert t.mem.seq_pos_max(q) == len(h) - 1
            for L, tensors in t.state(q).items():
                for name, row in tensors.items():
                    np.testing.assert_allclose(row, states[L][name], atol=2e-5, err_msg=f"seq {q} {L} {name}")


@settings(max_examples=int(os.environ.get("STATECACHE_HUNT26_COUPLED_EXAMPLES", "40")), deadline=None)
@given(coupled_batches(), st.sampled_from([4, 64]), st.booleans(), st.sampled_from(["hybrid", "iswa", "idx"]))
def test_coupled_batches_through_a_hybrid_memory_equal_recompute(batch, n_ubatch, varlen, kind) -> None:  # type: ignore[no-untyped-def]
    """A unified hybrid splits coupled batches with ``split_equal`` (not sequential) or
    ``split_varlen``: the attention part of each token must see exactly its primary
    sequence's tokens at positions up to its own (a token of a later position computed
    first saw fewer), the recurrent part the primary's history."""
    from hybrid_toy import ATTN, attention, emb, make_hybrid
    from recurrent_toy import VOCAB, Tables, oracle, run_layers

    import statecache

    seq_ids, positions = batch
    dev = statecache.get_device("reference")
    mem = make_hybrid(dev, kind, n_seq_max=N_SEQ, size=48, n_swa=48)  # a window that hides nothing here
    tables = Tables()
    tokens = [(5 * i + 1) % VOCAB for i in range(len(seq_ids))]
    balloc = BatchAllocator(N_SEQ)
    try:
        balloc.init(Batch(tokens=np.asarray(tokens), seq_ids=seq_ids, pos=np.asarray(positions)), mem)
    except BatchError:
        assume(False)
    ctx = mem.init_batch(balloc, n_ubatch, varlen=varlen)
    if ctx.status.is_fail:
        return
    out = {}
    iswa = kind == "iswa"
    cache = mem.attn.swa if iswa else mem.attn
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        toks = ub.token if ub.is_varlen else ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
        y_rec = run_layers(dev, ctx.recr.step(), tables, toks).reshape(ub.n_tokens, -1)
        actx = ctx.attn.swa if iswa else ctx.attn
        actx.cpy_k(ATTN, np.stack([emb(int(t), 1) for t in ub.token]))
        actx.cpy_v(ATTN, np.stack([emb(int(t), 2) for t in ub.token]))
        mask = actx.mask()
        k_all, v_all = cache.k[ATTN].numpy(), cache.v[ATTN].numpy()
        n_kv = mask.shape[1]
        for i in range(ub.n_tokens):
            a = attention(emb(int(ub.token[i]), 3), k_all[:n_kv], v_all[:n_kv], mask[i])
            out[int(ub.token_idx[i])] = (y_rec[i], a)
        if not ctx.next():
            break
    hist: dict[int, list[int]] = {q: [] for q in range(N_SEQ)}
    for i, ids in enumerate(seq_ids):
        h = [*hist[ids[0]], tokens[i]]
        for q in ids:
            hist[q] = list(h)
        want_rec, _ = oracle(dev, tables, h)
        np.testing.assert_allclose(out[i][0], want_rec[-1], atol=2e-5, err_msg=f"recurrent, token {i} of {ids}")
        seen = [j for j in range(len(seq_ids)) if ids[0] in seq_ids[j] and positions[j] <= positions[i]]
        k = np.stack([emb(tokens[j], 1) for j in seen])
        v = np.stack([emb(tokens[j], 2) for j in seen])
        want_a = attention(emb(tokens[i], 3), k, v, np.zeros(len(seen), dtype=np.float32))
        np.testing.assert_allclose(out[i][1], want_a, atol=2e-5, err_msg=f"attention, token {i} of {ids}")
