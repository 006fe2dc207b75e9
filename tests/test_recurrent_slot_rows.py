"""Public slot rows (issue 15 item 4): an outside kernel run through ``step.slot_rows``
matches the primitive path, over prefill, decode, fork, rollback and a cell reorder.

The outside kernels (the causal conv and the Mamba-2 scan) are written in torch
from the formulas, reading and writing the pools through NumPy views; they
call no statecache primitive.  Layer 0 (conv + scan) and the conv of layer 2
run outside; the gated delta net of layer 2 stays on the primitive, so a
ubatch mixes both kinds of pool.  ``STATECACHE_SLOT_ROWS_EXAMPLES=N`` runs the
property test with N examples (default 15)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import CH, D_CONV, VOCAB, G, H, N, P, Toy, W

import statecache
from statecache.errors import ArgumentError
from statecache.hostmem import as_array
from statecache.slot_rows import SlotRows

torch = pytest.importorskip("torch", reason="the outside kernels are written in torch")

DEVICES = ["reference", "cpu"]


def _view(buf):  # type: ignore[no-untyped-def]
    return torch.from_numpy(as_array(buf))  # the device's memory itself (host devices)


def outside_conv(rows: SlotRows, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal conv over concat(window, x); x [n_s, n_t, CH] -> y [n_s, n_t, CH]."""
    n_s, n_t, _ = x.shape
    src, pool = _view(rows.source), _view(rows.pool)
    window = src[torch.tensor(rows.read)].double().view(n_s, CH, W)  # read every state before writing
    ext = torch.cat([window, torch.from_numpy(x).double().transpose(1, 2)], dim=2)  # [n_s, CH, W + n_t]
    taps = ext.unfold(2, D_CONV, 1)[:, :, :n_t]  # [n_s, CH, n_t, D_CONV]
    y = (taps * torch.from_numpy(w).double()[None, :, None, :]).sum(-1).transpose(1, 2)
    for s in range(n_s):
        columns = [int(rows.write[s]), *(int(r) for r in rows.snapshots[s])]
        for j, row in enumerate(columns):  # column j: the window j tokens before the end
            if row >= 0 and j <= n_t:
                pool[row] = ext[s, :, n_t - j : n_t - j + W].reshape(-1).float()
    return y.float().numpy()


def outside_scan(rows: SlotRows, x, dt, A, B, C) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Mamba-2 selective scan; x [n_s, n_t, H, P], dt [n_s, n_t, H], A [H], B/C [n_s, n_t, G, N]."""
    n_s, n_t = dt.shape[:2]
    src, pool = _view(rows.source), _view(rows.pool)
    t64 = lambda a: torch.from_numpy(np.asarray(a)).double()  # noqa: E731
    x, dt, A, B, C = (t64(a) for a in (x, dt, A, B, C))
    group = torch.arange(H) // (H // G)
    state = src[torch.tensor(rows.read)].double().view(n_s, H, P, N)
    y = torch.empty(n_s, n_t, H, P, dtype=torch.float64)
    states = [state]  # states[t]: after t tokens
    for t in range(n_t):
        d = torch.where(dt[:, t] > 20.0, dt[:, t], torch.log1p(torch.exp(dt[:, t].clamp(max=20.0))))  # softplus
        decay = torch.exp(d * A)  # [n_s, H]
        Bt, Ct = B[:, t][:, group], C[:, t][:, group]  # [n_s, H, N]
        state = state * decay[:, :, None, None] + (x[:, t] * d[:, :, None])[..., None] * Bt[:, :, None, :]
        y[:, t] = torch.einsum("shpn,shn->shp", state, Ct)
        states.append(state)
    for s in range(n_s):
        columns = [int(rows.write[s]), *(int(r) for r in rows.snapshots[s])]
        for j, row in enumerate(columns):
            if row >= 0 and j <= n_t:
                pool[row] = states[n_t - j][s].reshape(-1).float()
    return y.float().numpy()


def run_through_slot_rows(dev, step, tb, toks: np.ndarray, check=None):  # type: ignore[no-untyped-def]
    """``recurrent_toy.run_layers`` with layer 0 and layer 2's conv run by the outside kernels."""
    n_s, n_t = toks.shape
    outs = []
    for L in (0, 2):
        rows = step.slot_rows(L, "r")
        if check is not None:
            check(step, rows, n_t)
        outs.append(outside_conv(rows, tb.conv_x[L][toks], tb.conv_w[L]))
        if L == 0:
            rows = step.slot_rows(0, "s")
            if check is not None:
                check(step, rows, n_t)
            ys = outside_scan(rows, tb.x[toks], tb.dt[toks], tb.A, tb.B[toks], tb.C[toks])
        else:
            args = [dev.upload(a) for a in (tb.q[toks], tb.k[toks], tb.v[toks], tb.g[toks], tb.beta[toks])]
            y = dev.alloc((n_s, n_t, 2, 3))
            step.delta(2, *args, y)
            ys = y.numpy()
        outs.append(ys.reshape(n_s, n_t, -1))
    return np.concatenate(outs, axis=-1)


class SlotToy(Toy):
    """The toy model with layer 0 and layer 2's conv run by the outside kernels."""

    def __init__(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **k)
        self.seen_staged = self.seen_moves = 0

    def run_step(self, step, toks: np.ndarray):  # type: ignore[no-untyped-def]
        self.seen_staged += int(step.inputs.staged)
        self.seen_moves += int(step.inputs.copy_src.size > 0)
        return run_through_slot_rows(self.dev, step, self.tables, toks, check=self.check_rows)

    def check_rows(self, step, rows: SlotRows, n_t: int) -> None:  # type: ignore[no-untyped-def]
        """The host arrays and the device buffers agree; rows are in range; no state j > n_t is asked for."""
        dev, mem = self.dev, self.mem
        np.testing.assert_array_equal(dev.index_values(rows.read_buffer), rows.read)
        np.testing.assert_array_equal(dev.index_values(rows.write_buffer), rows.write)
        assert rows.snapshots.shape[0] == step.inputs.n_seqs and rows.snapshots.shape[1] <= mem.n_rs_seq
        if rows.snapshots_buffer is not None:
            np.testing.assert_array_equal(dev.index_values(rows.snapshots_buffer).reshape(rows.snapshots.shape),
                                          rows.snapshots)  # fmt: skip
        assert np.all(rows.snapshots[:, n_t:] == -1)
        assert rows.plane_stride == mem.size and rows.pool.shape[0] == mem.size * mem.n_snap
        assert 0 <= rows.read.min() and rows.read.max() < rows.source.shape[0]
        assert (rows.source is not rows.pool) == rows.staged


def _pair(dev, **k):  # type: ignore[no-untyped-def]
    return Toy(dev, 3, n_rs_seq=3, size=5, **k), SlotToy(dev, 3, n_rs_seq=3, size=5, **k)


def _same(a: Toy, b: Toy, out_a, out_b, dev) -> None:  # type: ignore[no-untyped-def]
    rtol, atol = (1e-6, 1e-7) if dev.id == "reference" else (3e-5, 3e-6)
    assert (out_a is None) == (out_b is None)
    if out_a is not None:
        assert out_a.keys() == out_b.keys()
        for key in out_a:
            np.testing.assert_allclose(out_b[key], out_a[key], rtol=rtol, atol=atol, err_msg=str(key))
    assert a.mem.book_snapshot().same(b.mem.book_snapshot())
    for L, pools in a.mem.pools.items():
        for name, buf in pools.items():
            np.testing.assert_allclose(b.mem.pools[L][name].numpy(), buf.numpy(), rtol=rtol, atol=atol,
                                       err_msg=f"layer {L} {name}")  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_outside_kernel_through_slot_rows_matches_the_primitives(device: str) -> None:
    dev = statecache.get_device(device)
    a, b = _pair(dev)

    def feed(batch: dict[int, list[int]]) -> None:
        _same(a, b, a.decode(batch), b.decode(batch), dev)

    def both(op: str, *args: int) -> None:
        assert getattr(a.mem, op)(*args) == getattr(b.mem, op)(*args)
        _same(a, b, None, None, dev)

    feed({0: [1, 2, 3, 4]})  # prefill
    feed({2: [5, 6]})
    feed({1: [7]})  # cells: seq 0 -> 0, seq 2 -> 1, seq 1 -> 2
    feed({0: [8], 1: [9]})  # one ubatch needs cells 0, 1: seq 2's cell, live and snapshot planes, moves
    assert a.mem.seq_rm(2, 1, -1) and b.mem.seq_rm(2, 1, -1)  # a rollback of the moved cell is exact
    feed({2: [10]})
    both("seq_cp", 0, 2)  # fork: 2 shares 0's cell until one of them writes
    feed({0: [11], 2: [12]})  # copy-on-write, decode: the next plane
    feed({2: [13, 14, 15]})  # a speculative draft ...
    assert a.mem.seq_rm(2, 8, -1) and b.mem.seq_rm(2, 8, -1)  # ... rolled back inside its last write
    feed({2: [16], 1: [17, 18]})
    both("seq_rm", 1, -1, -1)
    feed({1: [19, 20], 0: [21, 22]})  # a new sequence from the zero row next to a running one
    assert b.seen_staged and b.seen_moves, "the walk must cover staged reads and moved rows"
    for seq in range(3):
        for L, tensors in a.state(seq).items():
            for name, row in tensors.items():
                assert np.isfinite(row).all() and np.abs(row).max() > 0, (seq, L, name)


def test_slot_rows_refuses_a_second_call_and_an_unknown_tensor() -> None:
    dev = statecache.get_device("reference")
    toy = SlotToy(dev, 2, n_rs_seq=2)
    toy.decode({0: [1, 2]})
    from statecache.batch import Batch, BatchAllocator

    balloc = BatchAllocator(2)
    balloc.init(Batch.for_sequences({0: [3]}, output_all=True), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    ctx.get_ubatch()
    assert ctx.apply()
    step = ctx.step()
    with pytest.raises(ArgumentError) as e:
        step.slot_rows(0, "nope")
    assert e.value.argument == "layer"
    rows = step.slot_rows(0, "r")
    assert rows.n_seqs == 1 and rows.write[0] != rows.read[0]  # a decode writes the next plane
    with pytest.raises(ArgumentError, match="already stepped"):
        step.slot_rows(0, "r")
    with pytest.raises(ArgumentError, match="already stepped"):
        step.conv(0, dev.alloc((1, 1, CH)), dev.alloc((CH, D_CONV)), dev.alloc((1, 1, CH)))


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("feed"), st.dictionaries(st.integers(0, 2), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                                  max_size=4), min_size=1)),
        st.tuples(st.just("seq_rm"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("seq_cp"), st.integers(0, 2), st.integers(0, 2)),
    ),
    min_size=1,
    max_size=8,
)  # fmt: skip


@settings(max_examples=int(os.environ.get("STATECACHE_SLOT_ROWS_EXAMPLES", "15")), deadline=None)
@given(ops=_OPS, device=st.sampled_from(DEVICES))
def test_any_walk_through_slot_rows_matches_the_primitives(ops, device: str) -> None:  # type: ignore[no-untyped-def]
    """Any sequence of batches, rollbacks (kept length counted from the end) and forks."""
    dev = statecache.get_device(device)
    a, b = _pair(dev)
    for op in ops:
        if op[0] == "feed":
            _same(a, b, a.decode(op[1]), b.decode(op[1]), dev)
        elif op[0] == "seq_rm":
            keep = max(0, a.mem.seq_pos_max(op[1]) + 1 - op[2])
            assert a.mem.seq_rm(op[1], keep, -1) == b.mem.seq_rm(op[1], keep, -1)
        else:
            assert a.mem.seq_cp(op[1], op[2]) == b.mem.seq_cp(op[1], op[2])
        _same(a, b, None, None, dev)


@pytest.mark.parametrize("device", DEVICES)
def test_the_recurrent_part_of_a_hybrid_through_slot_rows_matches_recompute(device: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A hybrid's ``ctx.recr.step()`` hands out the same slot rows: prefill, decode, fork and
    rollback checked against the oracle's recompute of every sequence's last output."""
    import hybrid_toy

    dev = statecache.get_device(device)
    monkeypatch.setattr(hybrid_toy, "run_layers", run_through_slot_rows)
    toy = hybrid_toy.HybridToy(dev, hybrid_toy.make_hybrid(dev, n_rs_seq=3))
    atol = 1e-5 if device == "reference" else 5e-5

    def feed(batch: dict[int, list[int]]) -> None:
        out = toy.decode(batch)
        assert out is not None
        for s in batch:
            last = max(p for q, p in out if q == s)
            np.testing.assert_allclose(out[(s, last)], toy.expected(s), atol=atol, err_msg=f"seq {s}")

    feed({0: [1, 2, 3, 4], 1: [5, 6]})
    feed({0: [7], 1: [8]})
    toy.mem.seq_cp(0, 2)
    toy.recr_tokens[2], toy.attn_hist[2] = list(toy.recr_tokens[0]), list(toy.attn_hist[0])
    feed({0: [9], 2: [10, 11, 12]})
    assert toy.mem.seq_rm(2, 7, -1)  # back 2 of the 3 draft tokens
    toy.recr_tokens[2], toy.attn_hist[2] = toy.recr_tokens[2][:7], toy.attn_hist[2][:7]
    feed({2: [13], 1: [14]})


@pytest.mark.parametrize("device", DEVICES)
def test_undo_after_an_outside_kernel_puts_every_row_back(device: str) -> None:
    """The rows the slot rows name (and the copies slot_rows made) are all the undo record
    keeps: after a staged ubatch with moved rows written by the outside kernels, undo
    restores every pool bit for bit and the book."""
    from statecache.batch import Batch, BatchAllocator

    dev = statecache.get_device(device)
    toy = SlotToy(dev, 3, n_rs_seq=3, size=5)
    toy.mem.keep_undo_rows = True
    for batch in ({0: [1, 2, 3, 4]}, {2: [5, 6]}, {1: [7]}):
        toy.decode(batch)
    before = {(L, n): b.numpy() for L, p in toy.mem.pools.items() for n, b in p.items()}
    book = toy.mem.book_snapshot()
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({0: [8], 1: [9]}, output_all=True), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    ub = ctx.get_ubatch()
    assert ctx.apply()
    step = ctx.step()
    assert step.inputs.staged and step.inputs.copy_src.size  # the case with every kind of copy
    toy.run_step(step, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
    changed = any(not np.array_equal(b.numpy(), before[(L, n)]) for L, p in toy.mem.pools.items() for n, b in p.items())
    assert changed
    assert ctx.undo() == ()
    assert toy.mem.book_snapshot().same(book)
    for (L, n), data in before.items():
        np.testing.assert_array_equal(toy.mem.pools[L][n].numpy(), data, err_msg=f"layer {L} {n}")
