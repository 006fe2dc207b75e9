"""Hypothesis stateful test of the hybrid memories: random interleavings of decodes
and sequence operations against a model that keeps token lists, recomputes the
recurrent part from a zero state and the attention part over the visible history
(mask rules: sequence isolation, causality, the window of iSWA; after an iSWA
context shift, only what the window cache still holds, see ``window_holdings``).  Every decode
output must match; refused operations must change nothing in any part."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import HybridToy, make_hybrid
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from recurrent_toy import VOCAB
from test_hybrid import books, same_books

import statecache
from statecache.errors import ArgumentError, StateError
from statecache.kv_mask import is_masked_swa
from statecache.memory import MemoryStatus

N_SEQ = 3
DEV = statecache.get_device("reference")
MAX_TOKENS = 40  # keeps every batch inside the 64-cell caches


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(["hybrid", "iswa", "idx"]), n_rs_seq=st.sampled_from([0, 2]), seed=st.integers(0, 3)
    )
    def setup(self, kind: str, n_rs_seq: int, seed: int) -> None:
        self.kind = kind
        # iSWA: a small window cache (window 2, no padding: 14 cells) so cells are reused and given up
        self.geom = dict(n_seq_max=N_SEQ, size=64, **(dict(n_swa=2, n_pad=1) if kind == "iswa" else {}))
        self.toy = HybridToy(DEV, make_hybrid(DEV, kind, n_rs_seq=n_rs_seq, seed=seed, **self.geom))
        self.mem = self.toy.mem

    def live(self) -> list[int]:
        return sorted(s for s, h in self.toy.recr_tokens.items() if h)

    def total(self) -> int:
        return sum(len(h) for h in self.toy.attn_hist.values())

    def update(self) -> None:
        ctx = self.mem.init_update()
        if ctx.status is MemoryStatus.SUCCESS:
            assert ctx.apply()

    @precondition(lambda self: self.total() < MAX_TOKENS)
    @rule(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1), n_ubatch=st.integers(4, 9))
    def decode(self, data, seqs, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
        batch = {s: data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)) for s in sorted(seqs)}
        out = self.toy.decode(batch, n_ubatch)
        assert out is not None
        for s in batch:
            pos = self.toy.attn_hist[s][-1][0]
            np.testing.assert_allclose(out[(s, pos)], self.toy.expected(s), rtol=3e-4, atol=3e-5)

    @rule(src=st.integers(0, N_SEQ - 1), dst=st.integers(0, N_SEQ - 1))
    def seq_cp(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        self.update()
        if src != dst:
            self.toy.recr_tokens[dst] = list(self.toy.recr_tokens.get(src, []))
            self.toy.attn_hist[dst] = list(self.toy.attn_hist.get(src, []))

    @rule(s=st.integers(0, N_SEQ - 1))
    def seq_rm_whole(self, s: int) -> None:
        assert self.mem.seq_rm(s, -1, -1)
        self.toy.forget(s)

    def tail_ok(self, s: int) -> bool:
        return len(self.toy.recr_tokens[s]) > 1 and len(self.toy.attn_hist[s]) > 1

    @precondition(lambda self: any(self.tail_ok(s) for s in self.live()))
    @rule(data=st.data())
    def seq_rm_tail(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from([s for s in self.live() if self.tail_ok(s)]))
        hist = self.toy.attn_hist[s]
        k = data.draw(st.integers(1, min(3, len(hist) - 1, len(self.toy.recr_tokens[s]) - 1)))
        before = books(self.mem)
        if self.mem.seq_rm(s, hist[-k][0], -1):
            del self.toy.recr_tokens[s][-k:]
            del hist[-k:]
        else:
            assert same_books(before, books(self.mem))

    def window_holdings(self, s: int) -> list[tuple[int, int]]:
        """iSWA: the history the window cache still holds.  Its cells are reused once
        masked for the sequence's next token and the purge rule (spec §10 item 50) then
        drops every position up to the reused one, so it holds exactly the positions from
        its ``seq_pos_min`` up.  Checked here: nothing it gave up was visible to the next
        token.  A context shift moves later tokens down, so the next token's window can
        reach back past that minimum: llama.cpp's window cache has lost those tokens too,
        and the well-defined behaviour is that the window layers see only what the window
        cache holds; the oracle follows it from the shift on (the base cache of the
        full-attention layers keeps everything)."""
        swa = self.mem.attn.swa
        hist, lo = self.toy.attn_hist[s], swa.seq_pos_min(s)
        p_next = hist[-1][0] + 1
        lost = [p for p, _ in hist if p < lo]
        assert all(is_masked_swa(swa.n_swa, swa.swa_type, p, p_next) for p in lost), (lost, p_next)
        return [(p, t) for p, t in hist if p >= lo]

    @precondition(lambda self: any(len(self.toy.attn_hist[s]) > 4 for s in self.live()))
    @rule(data=st.data())
    def context_shift(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from([s for s in self.live() if len(self.toy.attn_hist[s]) > 4]))
        hist = self.toy.attn_hist[s]
        n_keep = data.draw(st.integers(0, 1))
        n_discard = data.draw(st.integers(1, len(hist) - n_keep - 2))
        p_keep, p_end = hist[n_keep][0], hist[n_keep + n_discard][0]
        if self.kind == "iswa":
            hist = self.window_holdings(s)
        shared = any(
            cells.seq_count(idx) > 1
            for cache in self.mem.kv_caches
            for cells in cache.cells
            for p, idx in cells.seq_pos[s]
            if p >= p_end
        )
        if shared:  # moving a shared cell would move the other sequence: refused, nothing changes
            before = books(self.mem)
            with pytest.raises(ArgumentError, match="shared"):
                self.mem.seq_add(s, p_end, -1, -(p_end - p_keep))
            assert same_books(before, books(self.mem))
            return
        assert self.mem.seq_rm(s, p_keep, p_end)
        self.mem.seq_add(s, p_end, -1, -(p_end - p_keep))
        self.update()
        d = p_end - p_keep
        self.toy.attn_hist[s] = [(p, t) for p, t in hist if p < p_keep] + [(p - d, t) for p, t in hist if p >= p_end]

    @rule(s=st.integers(0, N_SEQ - 1))
    def seq_keep(self, s: int) -> None:
        self.mem.seq_keep(s)
        for q in range(N_SEQ):
            if q != s:
                self.toy.forget(q)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def save_restore(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from(self.live()))
        blob = self.mem.state_write(s)
        other = make_hybrid(DEV, self.kind, n_rs_seq=self.mem.recr.n_rs_seq, seed=9, **self.geom)
        other.state_read(blob, s)
        self.mem.seq_rm(s, -1, -1)
        try:
            self.mem.state_read(other.state_write(s), s)
        except StateError as e:
            # cells s shared with other sequences stay in use, so a restored copy needs
            # fresh ones; only the small iSWA window cache can run out.  The contract:
            # a rejected blob changes nothing (s was removed just above, so it stays
            # empty in every part).
            assert self.kind == "iswa" and "free" in str(e), e
            assert self.mem.seq_pos_max(s) == -1 and self.mem.recr.seq_pos_max(s) == -1
            self.toy.forget(s)

    @invariant()
    def parts_agree(self) -> None:
        if not hasattr(self, "mem"):
            return
        self.mem.recr.check_invariants()
        for cache in self.mem.kv_caches:
            for cells in cache.cells:
                cells.check()
        for s in range(N_SEQ):
            hist = self.toy.attn_hist.get(s, [])
            want = hist[-1][0] if hist else -1
            assert self.mem.seq_pos_max(s) == want
            assert self.mem.recr.seq_pos_max(s) == want
        if self.kind == "idx":
            for a, i in zip(self.mem.attn.cells, self.mem.idx.cells, strict=True):
                assert np.array_equal(a.pos, i.pos) and np.array_equal(a.seq, i.seq)


HybridMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=15, deadline=None)
TestHybridMachine = HybridMachine.TestCase
