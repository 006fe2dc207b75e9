"""One call per layer for a whole mixed batch: the varlen (packed) split of a recurrent memory.

``init_batch(..., varlen=True)`` puts a batch of prompts of different lengths,
a decode and a speculative draft, with unsorted and non-consecutive sequence
ids, into ONE packed ubatch.  What it must equal:

* each sequence decoded alone (one batch per sequence, so the same calls
  per sequence): bitwise, on every device (the primitives' contract: a packed
  call computes per sequence exactly what a call for that sequence alone
  does);
* the equal split of the same batch (several ubatches) and a per-sequence
  full recompute from a zero state: the same book (positions, rollback
  depths, planes offered) exactly, outputs and states to float32 rounding.
  Not bitwise: the equal split cuts a prompt into several calls, and a call
  rounds its state to float32 at its end (the reference computes in float64
  inside a call), so a different cut rounds at different tokens.

Rollback (``seq_rm`` into the last write), copy-on-write (``seq_cp``), undo
and refused batches behave exactly as with the equal split (a hypothesis
property over random mixed batches).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import CH, VOCAB, Toy, oracle, run_layers

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, BatchError

#: The example of the issue: three prompts of different lengths, a decode and a
#: speculative draft, listed in an order that is neither sorted nor consecutive.
HISTORY = {6: [3, 1, 4, 1], 2: [5, 9, 2]}
EXAMPLE = {5: [2, 6, 5, 3, 5, 8, 9], 6: [7], 0: [9, 3], 2: [2, 3, 8], 3: [4, 6, 2, 6, 4]}
N_RS_SEQ = 3
#: outputs and states of differently cut calls: float32 rounding at different tokens
ATOL = 2e-5


def _device(name: str):  # type: ignore[no-untyped-def]
    try:
        return statecache.get_device(name)
    except Exception as exc:  # the backend is not built or not installed here
        pytest.skip(f"no {name} device: {exc}")


def seq_state(t: Toy, seq: int):  # type: ignore[no-untyped-def]
    """What a sequence holds, independent of which cell: (position, pending rollback depth,
    rollback depth offered, every pool's rows of its logical state and valid planes, nearest first)."""
    mem = t.mem
    c = mem.cell_of(seq)
    if c < 0:
        return None
    b = mem.book_snapshot()
    rows = np.concatenate([[int(b.src[c])], mem._valid_planes(c)]).astype(np.int64)
    data = {(L, n): buf.numpy()[rows] for L, p in mem.pools.items() for n, buf in p.items()}
    return int(b.pos[c]), mem.pending_rollback(seq), int(rows.size), data


def assert_same_states(a: Toy, b: Toy, exact: bool) -> None:
    for seq in range(a.mem.n_seq_max):
        sa, sb = seq_state(a, seq), seq_state(b, seq)
        assert (sa is None) == (sb is None), seq
        if sa is None or sb is None:
            continue
        assert sa[:3] == sb[:3], (seq, sa[:3], sb[:3])
        for key in sa[3]:
            if exact:
                np.testing.assert_array_equal(sa[3][key], sb[3][key], err_msg=f"seq {seq} {key}")
            else:
                np.testing.assert_allclose(sa[3][key], sb[3][key], atol=ATOL, err_msg=f"seq {seq} {key}")


def assert_same_outputs(a: dict, b: dict, exact: bool) -> None:  # type: ignore[type-arg]
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
        else:
            np.testing.assert_allclose(a[k], b[k], atol=ATOL, err_msg=str(k))


def decode_alone(t: Toy, batch: dict[int, list[int]], n_ubatch: int = 512, undo: bool = False):  # type: ignore[no-untyped-def]
    """Each sequence of ``batch`` in a batch of its own, in the batch's order."""
    out = {}
    for s, toks in batch.items():
        got = t.decode({s: toks}, n_ubatch, undo=undo)
        assert got is not None
        out.update(got)
    return out


# -- the splitter ------------------------------------------------------------------------
def test_split_varlen_puts_the_example_batch_into_one_packed_ubatch() -> None:
    balloc = BatchAllocator(8)
    balloc.init(Batch.for_sequences(EXAMPLE, output_all=True), None)
    ub = balloc.split_varlen(512)
    assert ub.is_varlen and not ub.equal_seqs
    assert list(ub.set_primary) == [5, 6, 0, 2, 3]  # batch order of first tokens, ids as given
    np.testing.assert_array_equal(ub.cu_seqlens, [0, 7, 8, 10, 13, 18])
    np.testing.assert_array_equal(ub.seq_lens, [7, 1, 2, 3, 5])
    assert (ub.n_seqs, ub.n_seq_tokens, ub.n_tokens) == (5, 7, 18)
    want = np.concatenate([np.asarray(v) for v in EXAMPLE.values()])
    np.testing.assert_array_equal(ub.token, want)  # grouped per sequence, batch order inside each
    assert balloc.split_varlen(512).n_tokens == 0
    assert balloc.out_ids == list(range(18))


def test_split_varlen_regroups_interleaved_tokens_per_sequence() -> None:
    balloc = BatchAllocator(8)
    seqs = [4, 1, 4, 7, 1, 4]
    balloc.init(Batch(tokens=np.arange(6), seq_ids=seqs, output=np.ones(6, bool)), None)
    ub = balloc.split_varlen(64)
    np.testing.assert_array_equal(ub.token_idx, [0, 2, 5, 1, 4, 3])
    np.testing.assert_array_equal(ub.cu_seqlens, [0, 3, 5, 6])
    np.testing.assert_array_equal(ub.pos, [0, 1, 2, 0, 1, 0])
    assert balloc.out_ids == [0, 2, 5, 1, 4, 3]  # where each output row came from


def test_split_varlen_cuts_only_where_a_whole_tail_stays_behind() -> None:
    balloc = BatchAllocator(8)
    balloc.init(Batch.for_sequences({5: list(range(4)), 2: [1, 2], 7: [3], 0: [4, 5, 6, 7]}), None)
    cuts = []
    while (ub := balloc.split_varlen(5, n_keep_tail=2)).n_tokens:
        cuts.append((ub.set_primary.tolist(), np.diff(ub.cu_seqlens).tolist()))
    # seq 2 would leave 1 < 2 tokens behind: it waits; seq 0 is cut leaving exactly 2
    assert cuts == [([5, 7], [4, 1]), ([2, 0], [2, 2]), ([0], [2])]
    with pytest.raises(BatchError, match="n_keep_tail"):
        balloc.split_varlen(2, n_keep_tail=2)


def test_split_varlen_keeps_sets_that_share_a_sequence_apart() -> None:
    balloc = BatchAllocator(4)
    balloc.init(Batch(tokens=np.arange(5), seq_ids=[(0, 1), (0, 1), 0, 1, 2]), None)
    first, second = balloc.split_varlen(64), balloc.split_varlen(64)
    assert list(first.set_seq_ids) == [(0, 1), (2,)] and list(second.set_seq_ids) == [(0,), (1,)]
    assert balloc.split_varlen(64).n_tokens == 0


# -- the example batch through the memory ----------------------------------------------
@pytest.mark.parametrize("name", ["reference", "cpu", "opencl"])
def test_example_batch_is_one_forward_and_equals_per_sequence_calls_the_equal_split_and_recompute(name: str) -> None:
    dev = _device(name)
    packed, alone, equal = (Toy(dev, n_seq_max=8, n_rs_seq=N_RS_SEQ, seed=3) for _ in range(3))
    for t in (packed, alone, equal):
        assert decode_alone(t, HISTORY) is not None
        t.forwards = 0
    got = packed.decode(EXAMPLE, varlen=True)
    assert got is not None
    assert packed.forwards == 1  # the whole mixed batch: one call per layer
    assert_same_outputs(got, decode_alone(alone, EXAMPLE), exact=True)
    assert_same_states(packed, alone, exact=True)
    want = equal.decode(EXAMPLE)
    assert want is not None
    # the equal split (consecutive ids, equal lengths, the last n_rs_seq + 1 tokens of a
    # sequence together): {5: 1, 6: 1}, {5: 6}, {0: 2}, {2: 3} (3 would leave 2 < 4 behind), {3: 5}
    assert equal.forwards == 5
    assert_same_outputs(got, want, exact=False)
    assert_same_states(packed, equal, exact=False)
    history = {s: HISTORY.get(s, []) + EXAMPLE[s] for s in EXAMPLE}
    ref = statecache.get_device("reference")
    for s, toks in history.items():  # a per-sequence full recompute from a zero state
        y, states = oracle(ref, packed.tables, toks)
        n_new = len(EXAMPLE[s])
        mine = np.stack([got[(s, p)] for p in range(len(toks) - n_new, len(toks))])
        np.testing.assert_allclose(mine, y[len(toks) - n_new :], atol=ATOL)
        for (L, n), rows in seq_state(packed, s)[3].items():
            np.testing.assert_allclose(rows[0], states[L][n], atol=ATOL)
    # the draft is rejected after its first token: rollback through the planes, then continue
    for t in (packed, alone, equal):
        assert t.mem.seq_rm(2, len(history[2]) - 2, -1)
    assert_same_states(packed, alone, exact=True)
    nxt = {2: [11], 7: [1, 2, 3], 6: [5]}
    got = packed.decode(nxt, varlen=True)
    assert got is not None
    assert_same_outputs(got, decode_alone(alone, nxt), exact=True)
    assert_same_states(packed, alone, exact=True)
    assert_same_outputs(got, equal.decode(nxt), exact=False)
    assert_same_states(packed, equal, exact=False)
    y, _ = oracle(ref, packed.tables, [*history[2][:-2], 11])
    np.testing.assert_allclose(got[(2, len(history[2]) - 2)], y[-1], atol=ATOL)


def test_packed_step_refuses_equal_form_tensors_naming_the_argument() -> None:
    dev = statecache.get_device("reference")
    t = Toy(dev, n_seq_max=8, n_rs_seq=N_RS_SEQ)
    balloc = BatchAllocator(8)
    balloc.init(Batch.for_sequences(EXAMPLE), t.mem)
    ctx = t.mem.init_batch(balloc, 512, varlen=True)
    assert ctx.apply()
    step = ctx.step()
    assert step.cu_seqlens is not None
    np.testing.assert_array_equal(dev.download(step.cu_seqlens), ctx.get_ubatch().cu_seqlens)
    before = {k: v.numpy().copy() for k, v in t.mem.pools[0].items()}
    x = dev.alloc((5, 7, CH))  # the equal form of the same ubatch
    with pytest.raises(ArgumentError, match=r"x: shape \(5, 7, 6\) must be \[n_tokens, channels\] with n_tokens=18"):
        step.conv(0, x, dev.upload(t.tables.conv_w[0]), dev.alloc((5, 7, CH)))
    for k, v in t.mem.pools[0].items():
        np.testing.assert_array_equal(v.numpy(), before[k])
    # corrected, the same call runs, and slot rows name the same offsets
    toks = ctx.get_ubatch().token
    y = run_layers(dev, step, t.tables, toks)
    assert y.shape[0] == 18


def test_slot_rows_of_a_packed_ubatch_carry_its_offsets() -> None:
    dev = statecache.get_device("reference")
    t = Toy(dev, n_seq_max=8, n_rs_seq=N_RS_SEQ)
    assert t.decode(HISTORY, varlen=True) is not None
    balloc = BatchAllocator(8)
    balloc.init(Batch.for_sequences(EXAMPLE), t.mem)
    ctx = t.mem.init_batch(balloc, 512, varlen=True)
    assert ctx.apply()
    rows = ctx.step().slot_rows(0, "s")
    ub = ctx.get_ubatch()
    np.testing.assert_array_equal(rows.cu_seqlens, ub.cu_seqlens)
    np.testing.assert_array_equal(dev.download(rows.cu_seqlens_buffer), ub.cu_seqlens)
    # a set of n tokens writes its states after 1..n tokens (at most n_snap of them), plus
    # its input state when it does not start from its own cell: never a column past n
    table = np.concatenate([rows.write[:, None], rows.snapshots], axis=1)
    lens = ub.seq_lens
    cols = np.arange(table.shape[1])[None, :]
    assert (table[cols > lens[:, None]] == -1).all()
    written = (table >= 0).sum(axis=1)
    assert (written >= np.minimum(lens, N_RS_SEQ + 1)).all() and (written <= np.minimum(lens + 1, N_RS_SEQ + 1)).all()
    assert (table[:, 0] >= 0).all() and len(np.unique(table[table >= 0])) == written.sum()


# -- the property: varlen == equal split, operation by operation ----------------------------
def varlen_chunks(batch: dict[int, list[int]], n_ubatch: int, n_keep_tail: int) -> list[dict[int, list[int]]]:
    """The tokens of each sequence in each ubatch ``split_varlen`` makes of ``batch``."""
    balloc = BatchAllocator(_SEQS)
    balloc.init(Batch.for_sequences(batch), None)
    toks = np.concatenate([np.asarray(v) for v in batch.values()])
    out = []
    while (ub := balloc.split_varlen(n_ubatch, n_keep_tail)).n_tokens:
        cu = ub.cu_seqlens
        out.append({int(s): toks[ub.token_idx[cu[i] : cu[i + 1]]].tolist() for i, s in enumerate(ub.set_primary)})
    return out


_SEQS = 5


@st.composite
def _ops(draw):  # type: ignore[no-untyped-def]
    ops = []
    for _ in range(draw(st.integers(2, 6))):
        kind = draw(st.sampled_from(["batch", "batch", "batch", "rollback", "fork", "undo", "refused"]))
        if kind in ("batch", "undo"):
            ids = draw(st.lists(st.integers(0, _SEQS - 1), min_size=1, max_size=_SEQS, unique=True))
            ops.append((kind, {s: draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)) for s in ids}))
        elif kind == "rollback":
            ops.append((kind, draw(st.integers(0, _SEQS - 1)), draw(st.integers(1, 3))))
        elif kind == "fork":
            ops.append((kind, draw(st.integers(0, _SEQS - 1)), draw(st.integers(0, _SEQS - 1))))
        else:
            ops.append((kind, draw(st.sampled_from(["bad_id", "keep_tail"]))))
    return ops


# 15 examples keep CI short (about 6 s on a loaded machine); raise it for a heavy run:
# STATECACHE_VARLEN_EXAMPLES=2000 pytest tests/test_recurrent_varlen.py
@settings(max_examples=int(os.environ.get("STATECACHE_VARLEN_EXAMPLES", "15")), deadline=None)
@given(_ops(), st.integers(4, 9))
def test_varlen_equals_per_sequence_calls_and_the_equal_split(ops, n_ubatch) -> None:  # type: ignore[no-untyped-def]
    """Random mixed batches, rollbacks, forks, undone batches and refused batches on three
    twin memories: varlen, one batch per sequence (bitwise equal to varlen when the
    batch fits one ubatch) and the equal split (same book, states to float32 rounding)."""
    dev = statecache.get_device("reference")
    packed, alone, equal = (Toy(dev, n_seq_max=_SEQS, n_rs_seq=2, size=_SEQS + 2, seed=k) for k in range(3))
    twins = (packed, alone, equal)
    for op in ops:
        if op[0] in ("batch", "undo"):
            undo = op[0] == "undo"
            blobs = [t.mem.state_write() for t in (packed, equal)] if undo else None
            got = packed.decode(op[1], n_ubatch, varlen=True, undo=undo)
            want = equal.decode(op[1], n_ubatch, undo=undo)
            assert got is not None and want is not None
            assert_same_outputs(got, want, exact=False)
            if not undo:  # (an undone batch leaves the alone twin as it is: nothing to run)
                alone_got = {}
                for chunk in varlen_chunks(op[1], n_ubatch, n_keep_tail=3):  # the cuts varlen made
                    alone_got.update(decode_alone(alone, chunk))
                assert_same_outputs(got, alone_got, exact=True)
            if blobs is not None:  # exact undo: every byte of every memory as before
                assert [t.mem.state_write() for t in (packed, equal)] == blobs
        elif op[0] == "rollback":
            _, seq, depth = op
            results = []
            for t in twins:
                p = t.mem.seq_pos_max(seq)
                results.append(t.mem.seq_rm(seq, max(p - depth + 1, 1), -1) if p >= 0 else None)
            assert results[0] == results[1] == results[2]
        elif op[0] == "fork":
            for t in twins:
                t.mem.seq_cp(op[1], op[2])
        else:
            for t in twins:
                before, book = t.mem.state_write(), t.mem.book_snapshot()
                balloc = BatchAllocator(_SEQS)
                if op[1] == "bad_id":
                    with pytest.raises(BatchError):
                        balloc.init(Batch.for_sequences({0: [1], _SEQS: [2]}), t.mem)
                else:  # n_ubatch too small to keep the last n_rs_seq + 1 tokens together
                    balloc.init(Batch.for_sequences({0: [1, 2, 3, 4]}), t.mem)
                    with pytest.raises(BatchError, match="n_keep_tail"):
                        t.mem.init_batch(balloc, 3, varlen=True)
                assert t.mem.state_write() == before and t.mem.book_snapshot().same(book)
        assert_same_states(packed, alone, exact=True)
        assert_same_states(packed, equal, exact=False)
        packed.mem.check_invariants()


def test_mrope_positions_offer_the_same_planes_in_both_forms() -> None:
    """An M-RoPE image grid repeats a temporal position: only the final state of that
    sequence stays reachable; its neighbour in the packed ubatch keeps all its planes."""
    dev = statecache.get_device("reference")
    t_pos = [0, 1, 1, 1, 1, 2, 0, 1, 2]  # sequence 4: text, a 2x2 image at t=1, text; sequence 1: text
    y = [0, 0, 0, 1, 1, 2, 0, 1, 2]
    x = [0, 0, 1, 0, 1, 2, 0, 1, 2]
    sections = np.asarray([t_pos, y, x, [0] * 9])
    depths = []
    for varlen in (True, False):
        t = Toy(dev, n_seq_max=8, n_rs_seq=N_RS_SEQ)
        balloc = BatchAllocator(8)
        balloc.init(Batch(tokens=np.arange(9), pos=sections, seq_ids=[4] * 6 + [1] * 3), t.mem)
        ctx = t.mem.init_batch(balloc, 64, varlen=varlen)
        while True:  # the book after every ubatch (a step would write what it says)
            assert ctx.apply()
            if not ctx.next():
                break
        b = t.mem.book_snapshot()
        depths.append([int(b.snap_valid[t.mem.cell_of(s)]) for s in (4, 1)])
    assert depths[0] == depths[1] == [1, N_RS_SEQ + 1]
