"""Public slot rows of packed (varlen) ubatches through an outside kernel (hunt26).

``tests/test_recurrent_slot_rows.py`` runs its torch kernels through the slot
rows of equal ubatches only, and checks that a packed ubatch's rows carry its
offsets.  Here the same kernels run per sequence set of a *packed* ubatch
(``rows.cu_seqlens``: set ``i`` owns tokens ``cu[i] .. cu[i + 1] - 1``, its own
length, so its own snapshot columns) over random walks of mixed batches,
rollbacks, forks and undone batches; the memory, book and outputs must match the primitive
path (packed too).  ``STATECACHE_HUNT26_SLOT_EXAMPLES`` (default 25).
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recurrent_toy import VOCAB, Toy
from test_recurrent_slot_rows import SlotToy, _same, outside_conv, outside_scan

import statecache

pytest.importorskip("torch", reason="the outside kernels are written in torch")


def _set_rows(rows, i: int):  # type: ignore[no-untyped-def]
    """Set ``i``'s rows as a one-set SlotRows (what the outside kernels read)."""
    return types.SimpleNamespace(
        source=rows.source, pool=rows.pool, read=rows.read[i : i + 1], write=rows.write[i : i + 1],
        snapshots=rows.snapshots[i : i + 1],
    )  # fmt: skip


class PackedSlotToy(SlotToy):
    def run_step(self, step, toks: np.ndarray):  # type: ignore[no-untyped-def]
        if toks.ndim == 2:
            return super().run_step(step, toks)
        tb, dev = self.tables, self.dev
        outs = []
        for L in (0, 2):
            rows = step.slot_rows(L, "r")
            cu = rows.cu_seqlens
            assert cu is not None and int(cu[-1]) == toks.size
            lens = np.diff(cu)
            assert np.all(rows.snapshots[np.arange(rows.snapshots.shape[1])[None, :] >= lens[:, None]] == -1)
            yc = np.concatenate(
                [outside_conv(_set_rows(rows, i), tb.conv_x[L][toks[cu[i] : cu[i + 1]]][None], tb.conv_w[L])[0]
                 for i in range(lens.size)]
            )  # fmt: skip
            outs.append(yc)
            if L == 0:
                rows = step.slot_rows(0, "s")
                ys = []
                for i in range(lens.size):
                    t = toks[cu[i] : cu[i + 1]][None]
                    ys.append(outside_scan(_set_rows(rows, i), tb.x[t], tb.dt[t], tb.A, tb.B[t], tb.C[t])[0])
                outs.append(np.concatenate(ys).reshape(toks.size, -1))
            else:
                args = [dev.upload(a) for a in (tb.q[toks], tb.k[toks], tb.v[toks], tb.g[toks], tb.beta[toks])]
                y = dev.alloc((toks.size, 2, 3))
                step.delta(2, *args, y)
                outs.append(y.numpy().reshape(toks.size, -1))
        return np.concatenate(outs, axis=-1)


class PackedToy(Toy):
    def decode(self, tokens_by_seq, n_ubatch=512, **kw):  # type: ignore[no-untyped-def]
        return super().decode(tokens_by_seq, n_ubatch, varlen=True, **kw)


class PackedSlot(PackedSlotToy):
    def decode(self, tokens_by_seq, n_ubatch=512, **kw):  # type: ignore[no-untyped-def]
        return super().decode(tokens_by_seq, n_ubatch, varlen=True, **kw)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("feed"), st.dictionaries(st.integers(0, 2), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                                  max_size=5), min_size=1)),
        st.tuples(st.just("undo"), st.dictionaries(st.integers(0, 2), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                                  max_size=5), min_size=1)),
        st.tuples(st.just("seq_rm"), st.integers(0, 2), st.integers(0, 3)),
        st.tuples(st.just("seq_cp"), st.integers(0, 2), st.integers(0, 2)),
    ),
    min_size=1,
    max_size=8,
)  # fmt: skip


@settings(max_examples=int(os.environ.get("STATECACHE_HUNT26_SLOT_EXAMPLES", "25")), deadline=None)
@given(ops=_OPS, device=st.sampled_from(["reference", "cpu"]), n_ubatch=st.sampled_from([5, 8, 512]))
def test_packed_walks_through_slot_rows_match_the_packed_primitives(ops, device: str, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
    dev = statecache.get_device(device)
    a, b = PackedToy(dev, 3, n_rs_seq=3, size=5), PackedSlot(dev, 3, n_rs_seq=3, size=5)
    for op in ops:
        if op[0] == "feed":
            _same(a, b, a.decode(op[1], n_ubatch), b.decode(op[1], n_ubatch), dev)
        elif op[0] == "undo":  # computed, then taken back: every byte as before, in both
            blobs = [t.mem.state_write() for t in (a, b)]
            _same(a, b, a.decode(op[1], n_ubatch, undo=True), b.decode(op[1], n_ubatch, undo=True), dev)
            assert [t.mem.state_write() for t in (a, b)] == blobs
        elif op[0] == "seq_rm":
            keep = max(0, a.mem.seq_pos_max(op[1]) + 1 - op[2])
            assert a.mem.seq_rm(op[1], keep, -1) == b.mem.seq_rm(op[1], keep, -1)
        else:
            assert a.mem.seq_cp(op[1], op[2]) == b.mem.seq_cp(op[1], op[2])
        _same(a, b, None, None, dev)
