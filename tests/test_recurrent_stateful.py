"""Hypothesis stateful test: random interleavings of decodes and sequence operations
against a model that keeps each sequence as a plain token list and recomputes its
state from zero with the reference primitives.

Outputs and states must match the recompute; refused operations (seq_rm returning
False) must leave the book and every pool byte unchanged.  A rollback within the
planes of an unshared sequence's last write must be accepted (issue 12 item 7:
also after a batch of several sequences split into ubatches, whose reorder moves
cells), and a plan made before another batch was applied is refused (item 1).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from recurrent_toy import VOCAB, Tables, Toy, oracle

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError
from statecache.memory import ContextError, MemoryStatus, StateFlags

N_SEQ = 3
ATOL = 3e-5
DEV = statecache.get_device("reference")
TABLES = Tables()


@functools.lru_cache(maxsize=4096)
def recompute(tokens: tuple[int, ...]):  # type: ignore[no-untyped-def]
    return oracle(DEV, TABLES, list(tokens))


class RecurrentMachine(RuleBasedStateMachine):
    @initialize(n_rs_seq=st.sampled_from([0, 1, 3]), seed=st.integers(0, 3))
    def setup(self, n_rs_seq: int, seed: int) -> None:
        self.toy = Toy(DEV, N_SEQ, n_rs_seq=n_rs_seq, seed=seed)
        self.mem = self.toy.mem
        self.hist: dict[int, list[int]] = {}
        self.offset: dict[int, int] = {}  # position of the first token (seq_add shifts it)
        self.group: dict[int, int] = {}  # sequences sharing one state (seq_cp) share a group
        self.next_group = 0
        self.budget: dict[int, int] = {}  # how deep a rollback of each sequence must be accepted

    def _fresh_group(self, s: int) -> None:
        self.group[s] = self.next_group
        self.next_group += 1

    def _sharers(self, s: int) -> list[int]:
        return [q for q in self.hist if self.group[q] == self.group[s]]

    def _snapshot(self):  # type: ignore[no-untyped-def]
        return self.mem.book_snapshot(), {(L, n): b.numpy() for L, p in self.mem.pools.items() for n, b in p.items()}

    def _assert_same(self, snap) -> None:  # type: ignore[no-untyped-def]
        book, data = snap
        assert self.mem.book_snapshot().same(book)
        for (L, n), v in data.items():
            np.testing.assert_array_equal(self.mem.pools[L][n].numpy(), v)

    @rule(
        data=st.data(),
        seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1),
        n_ubatch=st.integers(1, 9),
    )
    def decode(self, data, seqs, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
        if self.mem.n_rs_seq:
            n_ubatch = max(n_ubatch, self.mem.n_rs_seq + 2)
        batch = {s: data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)) for s in sorted(seqs)}
        out = self.toy.decode(batch, n_ubatch)
        assert out is not None
        for s, toks in batch.items():
            if s not in self.hist:
                self.hist[s], self.offset[s] = [], 0
            self._fresh_group(s)  # copy-on-write: the decoded sequence owns its state now
            self.budget[s] = min(len(toks), self.mem.n_rs_seq)
            n0 = len(self.hist[s])
            self.hist[s] += toks
            ref, _ = recompute(tuple(self.hist[s]))
            for k in range(n0, len(self.hist[s])):
                np.testing.assert_allclose(out[(s, self.offset[s] + k)], ref[k], atol=ATOL)

    @rule(src=st.integers(0, N_SEQ - 1), dst=st.integers(0, N_SEQ - 1))
    def seq_cp(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        if src == dst:
            return
        if src in self.hist:
            self.hist[dst], self.offset[dst] = list(self.hist[src]), self.offset[src]
            self.group[dst] = self.group[src]
            self.budget[dst] = self.budget.get(src, 0)
        else:
            self.hist.pop(dst, None)
            self.offset.pop(dst, None)

    @rule(s=st.integers(0, N_SEQ - 1))
    def seq_rm_whole(self, s: int) -> None:
        assert self.mem.seq_rm(s, 0, -1)
        self.hist.pop(s, None)
        self.offset.pop(s, None)

    @precondition(lambda self: any(len(h) > 1 for h in self.hist.values()))
    @rule(data=st.data())
    def seq_rm_partial(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from(sorted(s for s, h in self.hist.items() if len(h) > 1)))
        keep = data.draw(st.integers(1, len(self.hist[s]) - 1))
        snap = self._snapshot()
        depth = len(self.hist[s]) - keep
        must = depth <= self.budget.get(s, 0) and len(self._sharers(s)) == 1
        if self.mem.seq_rm(s, self.offset[s] + keep, -1):
            assert len(self._sharers(s)) == 1, "a shared state was rolled back"
            assert self.mem.n_rs_seq > 0, "a rollback was accepted without rollback planes"
            self.hist[s] = self.hist[s][:keep]
            self.budget[s] = 0  # pending: a second rollback is refused
        else:
            assert not must, f"a rollback of {depth} within a budget of {self.budget[s]} was refused"
            self._assert_same(snap)

    @precondition(lambda self: sum(len(h) for h in self.hist.values()) < 60)
    @rule(data=st.data(), n_ubatch=st.integers(1, 6))
    def stale_plan(self, data, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
        """Two plans from the same state: once one is applied, the other is refused
        (it used to be placed again on the new book)."""
        if self.mem.n_rs_seq:
            n_ubatch = max(n_ubatch, self.mem.n_rs_seq + 2)
        a, b = data.draw(st.permutations(range(N_SEQ)))[:2]
        balloc = BatchAllocator()
        balloc.init(Batch.for_sequences({b: [1, 2]}), self.mem)
        stale = self.mem.init_batch(balloc, n_ubatch)
        assert stale.status is MemoryStatus.SUCCESS
        self.decode(data, {a}, n_ubatch)
        snap = self._snapshot()
        with pytest.raises(ContextError, match="changed"):
            stale.apply()
        self._assert_same(snap)

    @precondition(lambda self: bool(self.hist))
    @rule(data=st.data())
    def seq_rm_inside_history(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from(sorted(self.hist)))
        snap = self._snapshot()
        end = self.offset[s] + len(self.hist[s]) - 1
        p0 = max(1, end - 3)
        assert self.mem.seq_rm(s, p0, end)  # strictly inside: accepted, the state is kept
        self.budget[s] = 0  # every plane ends before the hole's end
        assert self.mem.seq_rm(s, end + 1, -1)  # after the tail: no-op
        # Only the reachable snapshot planes may shrink (a rollback across the hole
        # would restore a history that no longer exists); nothing else changes.
        before, data = snap
        book = self.mem.book_snapshot()
        assert (book.snap_valid <= before.snap_valid).all()
        book.snap_valid[...] = before.snap_valid
        assert book.same(before)
        for (L, n), v in data.items():
            np.testing.assert_array_equal(self.mem.pools[L][n].numpy(), v)
        if p0 < end:  # no rollback may land before the hole's end
            probe = self._snapshot()
            assert not self.mem.seq_rm(s, p0, -1)
            self._assert_same(probe)

    @rule(s=st.integers(0, N_SEQ - 1))
    def seq_keep(self, s: int) -> None:
        self.mem.seq_keep(s)
        if s in self.hist:
            self._fresh_group(s)  # the only owner now
        for q in list(self.hist):
            if q != s:
                del self.hist[q]
                del self.offset[q]

    @precondition(lambda self: bool(self.hist))
    @rule(data=st.data(), delta=st.integers(1, 4))
    def seq_add(self, data, delta: int) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from(sorted(self.hist)))
        if len(self._sharers(s)) > 1:  # moving a shared state would move every sharer: refused
            snap = self._snapshot()
            with pytest.raises(ArgumentError, match="shares its recurrent state"):
                self.mem.seq_add(s, 0, -1, delta)
            self._assert_same(snap)
            return
        self.mem.seq_add(s, 0, -1, delta)
        self.offset[s] += delta

    @precondition(lambda self: bool(self.hist))
    @rule(data=st.data(), whole=st.booleans())
    def save_restore(self, data, whole: bool) -> None:  # type: ignore[no-untyped-def]
        if whole:
            blob = self.mem.state_write(-1, StateFlags.PARTIAL_ONLY)
            self.mem.clear(data=False)
            self.mem.state_read(blob, flags=StateFlags.PARTIAL_ONLY)
            self.budget.clear()  # planes are not part of a blob
            return
        s = data.draw(st.sampled_from(sorted(self.hist)))
        blob = self.mem.state_write(s)
        other = Toy(DEV, N_SEQ, n_rs_seq=self.mem.n_rs_seq, seed=11)
        other.mem.state_read(blob, s)
        self.mem.seq_rm(s, 0, -1)
        self.mem.state_read(other.mem.state_write(s), s)
        self._fresh_group(s)
        self.budget[s] = 0

    @invariant()
    def states_match_recompute(self) -> None:
        if not hasattr(self, "mem"):
            return
        self.mem.check_invariants()
        for s in range(N_SEQ):
            if s not in self.hist:
                assert self.mem.seq_pos_max(s) == -1
                continue
            assert self.mem.seq_pos_max(s) == self.offset[s] + len(self.hist[s]) - 1
            _, ref = recompute(tuple(self.hist[s]))
            got = self.toy.state(s)
            for L in ref:
                for n in ref[L]:
                    np.testing.assert_allclose(got[L][n], ref[L][n], atol=ATOL, err_msg=f"seq {s} L{L} {n}")


_PROFILE = settings._current_profile or "ci"
RecurrentMachine.TestCase.settings = settings(
    settings.get_profile(_PROFILE),
    stateful_step_count=settings.get_profile(_PROFILE).stateful_step_count if _PROFILE == "stress" else 30,
)
TestRecurrentStateful = RecurrentMachine.TestCase
