"""Hypothesis stateful test of the hybrid memories: random interleavings of decodes
and sequence operations against a model that keeps token lists, recomputes the
recurrent part from a zero state and the attention part over the visible history
(mask rules: sequence isolation, causality, the window of iSWA; after an iSWA
context shift, only what the window cache still holds, see ``window_holdings``).  Every decode
output must match; refused operations must change nothing in any part.

Memories: hybrid, hybrid-iSWA (a window cache that evicts, and one of full size
that never does and so may shift), hybrid-idx (position-mode and order-mode
k-pools).  After every rule (issue 12) the parts must agree: each part holds the
same sequences, every part ends each sequence at the oracle's last position,
the attention part starts where the oracle's history starts (a window cache no
earlier), and hybrid-idx never gives one rep row two different pools.  The
rules include what used to split the parts: a plan applied after the memory
moved (refused), a removal from position 0 followed by a rollback, a partial
``seq_cp``, position moves that would leave the recurrent end behind, rollbacks
after multi-sequence batches split into ubatches (which must be accepted within
the planes' budget), whole-memory save/restore in place, and bad input.

``HYPOTHESIS_PROFILE=stress`` (see ``conftest.py``) runs many more examples.
"""

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
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, StateError
from statecache.kpool import rebuild
from statecache.kv_mask import is_masked_swa
from statecache.memory import ContextError, MemoryStatus

N_SEQ = 3
DEV = statecache.get_device("reference")
MAX_TOKENS = 40  # keeps every batch inside the 64-cell caches
KINDS = ["hybrid", "iswa", "iswa_full", "idx", "idx_order"]


def reps_unique(mem) -> None:  # type: ignore[no-untyped-def]
    """Hybrid-idx: no rep row is the last member of two pools with different members."""
    lay = mem.layout
    lay.check()  # the decode arrays equal the layouts
    claimed: dict[int, tuple[int, ...]] = {}
    for s in range(mem.n_seq_max):
        strm, pairs = mem.pairs_of(s)
        for j in rebuild(pairs, strm, lay.kpool, lay.by_order).pools:
            members = tuple(c for _, c in pairs[j : j + lay.kpool])
            rep = strm * lay.kv_size + members[-1]
            assert claimed.setdefault(rep, members) == members, (s, rep, members, claimed[rep])


class HybridMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(KINDS), n_rs_seq=st.sampled_from([0, 2]), seed=st.integers(0, 3))
    def setup(self, kind: str, n_rs_seq: int, seed: int) -> None:
        self.kind = kind
        self.base_kind = kind.split("_")[0]
        # iSWA: a small window cache (window 2, no padding) so cells are reused and given up
        geom: dict = dict(n_seq_max=N_SEQ, size=64)
        if self.base_kind == "iswa":
            geom.update(n_swa=2, n_pad=1, swa_full=kind == "iswa_full")
        if kind == "idx_order":
            geom.update(by_order=True)
        self.geom = geom
        self.toy = HybridToy(DEV, make_hybrid(DEV, self.base_kind, n_rs_seq=n_rs_seq, seed=seed, **geom))
        self.mem = self.toy.mem
        # per sequence: how many tokens a rollback may take back (the planes of its last write,
        # less whatever an edit since made unreachable), and its sharing group (seq_cp)
        self.budget: dict[int, int] = {}
        self.group: dict[int, int] = {}
        self.next_group = 0

    # -- the model's side ----------------------------------------------------------------
    def live(self) -> list[int]:
        return sorted(s for s, h in self.toy.recr_tokens.items() if h)

    def total(self) -> int:
        return sum(len(h) for h in self.toy.attn_hist.values())

    def forget(self, s: int) -> None:
        self.toy.forget(s)
        self.budget[s] = 0
        self.group.pop(s, None)

    def fresh_group(self, s: int) -> None:
        self.group[s] = self.next_group
        self.next_group += 1

    def shared(self, s: int) -> bool:
        return s in self.group and sum(g == self.group[s] for g in self.group.values()) > 1

    def end(self, s: int) -> int:
        hist = self.toy.attn_hist.get(s, [])
        return hist[-1][0] if hist else -1

    def update(self) -> None:
        ctx = self.mem.init_update()
        if ctx.status is MemoryStatus.SUCCESS:
            assert ctx.apply()

    def plan(self, batch: dict[int, list[int]], n_ubatch: int):  # type: ignore[no-untyped-def]
        balloc = BatchAllocator()
        balloc.init(Batch.for_sequences(batch, output_all=True), self.mem)
        return self.mem.init_batch(balloc, n_ubatch)

    def check_decode(self, batch: dict[int, list[int]], out) -> None:  # type: ignore[no-untyped-def]
        assert out is not None
        for s in batch:
            pos = self.toy.attn_hist[s][-1][0]
            np.testing.assert_allclose(out[(s, pos)], self.toy.expected(s), rtol=3e-4, atol=3e-5)
            self.budget[s] = min(len(batch[s]), self.mem.recr.n_rs_seq)
            self.fresh_group(s)  # copy-on-write: the decoded sequence owns its state now

    # -- rules --------------------------------------------------------------------------
    @precondition(lambda self: self.total() < MAX_TOKENS)
    @rule(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1), n_ubatch=st.integers(4, 9))
    def decode(self, data, seqs, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
        batch = {s: data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)) for s in sorted(seqs)}
        before = books(self.mem)
        out = self.toy.decode(batch, n_ubatch)
        if out is None:
            # Only the small window cache can run out: cells shared after a seq_cp are never
            # reused, so n_swa cells per sequence is no bound then.  A failed plan changes nothing.
            assert self.kind == "iswa", "a batch did not fit"
            assert same_books(before, books(self.mem))
            return
        self.check_decode(batch, out)

    @precondition(lambda self: self.total() < MAX_TOKENS - 10)
    @rule(data=st.data(), n_ubatch=st.integers(4, 6))
    def stale_plan(self, data, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
        """Two plans from the same state: once one is applied, the other is refused."""
        a, b = data.draw(st.permutations(range(N_SEQ)))[:2]
        stale = self.plan({b: [1, 2]}, n_ubatch)
        assert stale.status is MemoryStatus.SUCCESS
        batch = {a: data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3))}
        self.check_decode(batch, self.toy.decode(batch, n_ubatch))
        before = books(self.mem)
        with pytest.raises(ContextError, match="changed"):
            stale.apply()
        assert same_books(before, books(self.mem))

    @rule(src=st.integers(0, N_SEQ - 1), dst=st.integers(0, N_SEQ - 1))
    def seq_cp(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        self.update()
        if src != dst:
            self.toy.recr_tokens[dst] = list(self.toy.recr_tokens.get(src, []))
            self.toy.attn_hist[dst] = list(self.toy.attn_hist.get(src, []))
            self.budget[dst] = self.budget.get(src, 0)
            if src in self.group:
                self.group[dst] = self.group[src]
            else:
                self.group.pop(dst, None)

    @precondition(lambda self: any(len(self.toy.attn_hist[s]) > 1 for s in self.live()))
    @rule(data=st.data())
    def seq_cp_partial(self, data) -> None:  # type: ignore[no-untyped-def]
        """A copy that leaves out part of the source: a recurrent state cannot be cut."""
        src = data.draw(st.sampled_from([s for s in self.live() if len(self.toy.attn_hist[s]) > 1]))
        hist = self.toy.attn_hist[src]
        ranges = [(0, hist[-1][0])]  # leaves the last position out
        if hist[0][0] < hist[-1][0]:
            ranges.append((hist[0][0] + 1, -1))  # leaves the first position out
        p0, p1 = data.draw(st.sampled_from(ranges))
        before = books(self.mem)
        with pytest.raises(ArgumentError, match="p0/p1"):
            self.mem.seq_cp(src, (src + 1) % N_SEQ, p0, p1)
        assert same_books(before, books(self.mem))

    @rule(s=st.integers(0, N_SEQ - 1))
    def seq_rm_whole(self, s: int) -> None:
        assert self.mem.seq_rm(s, -1, -1)
        self.forget(s)

    def tail_ok(self, s: int) -> bool:
        return len(self.toy.recr_tokens[s]) > 1 and len(self.toy.attn_hist[s]) > 1

    @precondition(lambda self: any(self.tail_ok(s) for s in self.live()))
    @rule(data=st.data())
    def seq_rm_tail(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from([s for s in self.live() if self.tail_ok(s)]))
        hist = self.toy.attn_hist[s]
        k = data.draw(st.integers(1, min(3, len(hist) - 1, len(self.toy.recr_tokens[s]) - 1)))
        before = books(self.mem)
        must = k <= self.budget.get(s, 0) and not self.shared(s)  # exact rollback within the planes
        p0 = hist[-k][0]
        if self.mem.seq_rm(s, p0, -1):
            # every token at p0 or later goes (after an end move two may share a position);
            # they are the newest ones, whose influence the recurrent state drops
            gone = sum(1 for p, _ in hist if p >= p0)
            if p0 == 0:
                self.forget(s)
                return
            del self.toy.recr_tokens[s][-gone:]
            self.toy.attn_hist[s] = [(p, t) for p, t in hist if p < p0]
            self.budget[s] = 0  # a rollback is pending: a second one is refused
        else:
            assert not must, f"a rollback of {k} within a budget of {self.budget[s]} was refused"
            assert same_books(before, books(self.mem))

    @precondition(lambda self: any(len(self.toy.attn_hist[s]) > 1 for s in self.live()))
    @rule(data=st.data())
    def seq_rm_head(self, data) -> None:  # type: ignore[no-untyped-def]
        """Remove the first positions: the recurrent state keeps their influence, the
        attention part drops them, and no plane ending before them stays reachable."""
        s = data.draw(st.sampled_from([s for s in self.live() if len(self.toy.attn_hist[s]) > 1]))
        hist = self.toy.attn_hist[s]
        p1 = hist[data.draw(st.integers(1, len(hist) - 1))][0]
        before = books(self.mem)
        if self.mem.seq_rm(s, 0, p1):
            self.toy.attn_hist[s] = [(p, t) for p, t in hist if p >= p1]
            self.budget[s] = min(self.budget.get(s, 0), self.end(s) - p1)
        else:  # order-mode k-pools: the removal would regroup cells shared with another sequence
            assert self.kind == "idx_order" and self.shared_cells(s), "a head removal was refused"
            assert same_books(before, books(self.mem))

    def shared_cells(self, s: int) -> bool:
        cache = self.mem.attn if self.base_kind != "iswa" else self.mem.attn.base
        cells = cache.cells[cache.stream_of(s)]
        return any(cells.seq_count(c) > 1 for _, c in cells.seq_pos[s])

    def window_holdings(self, s: int) -> list[tuple[int, int]]:
        """iSWA: the history the window cache still holds.  Its cells are reused once
        masked for the sequence's next token and the purge rule (docs/memory-semantics.md#inv-50) then
        drops every position up to the reused one, so it holds exactly the positions from
        its ``seq_pos_min`` up.  Checked here: nothing it gave up was visible to the next
        token.  A context shift moves later tokens down, so the next token's window can
        reach back past that minimum: llama.cpp's window cache has lost those tokens too,
        and the well-defined behaviour is that the window layers see only what the window
        cache holds; the oracle follows it from the shift on (the base cache of the
        full-attention layers keeps everything).  A window cache of full size never gives
        a cell up, so it may shift (``get_can_shift``) and the oracle keeps everything."""
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
        assert self.mem.get_can_shift() == (self.kind != "iswa")
        if self.kind == "iswa":
            hist = self.window_holdings(s)
        shared = self.shared(s) or any(
            cells.seq_count(idx) > 1
            for cache in self.mem.kv_caches
            for cells in cache.cells
            for p, idx in cells.seq_pos[s]
            if p >= p_end
        )
        if shared:  # moving a shared cell would move the other sequence: refused, nothing changes
            before = books(self.mem)
            with pytest.raises(ArgumentError, match="share"):
                self.mem.seq_add(s, p_end, -1, -(p_end - p_keep))
            assert same_books(before, books(self.mem))
            return
        before = books(self.mem)
        if not self.mem.seq_rm(s, p_keep, p_end):
            assert self.kind == "idx_order" and self.shared_cells(s), "a context shift's removal was refused"
            assert same_books(before, books(self.mem))
            return
        self.mem.seq_add(s, p_end, -1, -(p_end - p_keep))
        self.update()
        d = p_end - p_keep
        self.toy.attn_hist[s] = [(p, t) for p, t in hist if p < p_keep] + [(p - d, t) for p, t in hist if p >= p_end]
        self.budget[s] = 0

    @precondition(lambda self: self.kind != "iswa" and any(len(self.toy.attn_hist[s]) > 2 for s in self.live()))
    @rule(data=st.data(), d=st.integers(1, 3))
    def move_end(self, data, d: int) -> None:  # type: ignore[no-untyped-def]
        """Move the last positions down without removing what lies between: accepted only
        while the parts still end together (the moved cells land on the last one kept),
        otherwise refused with nothing changed."""
        s = data.draw(st.sampled_from([s for s in self.live() if len(self.toy.attn_hist[s]) > 2]))
        hist = self.toy.attn_hist[s]
        p = hist[-1][0]
        before = books(self.mem)
        try:
            self.mem.seq_add(s, p, -1, -d)
        except ArgumentError:
            assert same_books(before, books(self.mem))
            return
        self.update()
        moved = [(q - d if q >= p else q, t) for q, t in hist]
        self.toy.attn_hist[s] = sorted((x for x in moved if x[0] >= 0), key=lambda x: x[0])  # stable: newest last
        if not self.toy.attn_hist[s]:
            self.forget(s)
        self.budget[s] = 0

    @rule(s=st.integers(0, N_SEQ - 1))
    def seq_keep(self, s: int) -> None:
        self.mem.seq_keep(s)
        for q in range(N_SEQ):
            if q != s:
                self.forget(q)
        if s in self.group:
            self.fresh_group(s)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def save_restore(self, data) -> None:  # type: ignore[no-untyped-def]
        s = data.draw(st.sampled_from(self.live()))
        blob = self.mem.state_write(s)
        other = make_hybrid(DEV, self.base_kind, n_rs_seq=self.mem.recr.n_rs_seq, seed=9, **self.geom)
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
            self.forget(s)
            return
        self.budget[s] = 0
        self.fresh_group(s)

    @precondition(lambda self: bool(self.live()))
    @rule()
    def whole_restore_in_place(self) -> None:
        """A whole-memory read puts every search head back to 0 (old cells get reused
        from the start of the cache afterwards); rollback planes are not restored."""
        blob = self.mem.state_write()
        self.mem.state_read(blob)
        assert self.mem.state_write() == blob
        for s in self.budget:
            self.budget[s] = 0

    @rule(data=st.data())
    def bad_input(self, data) -> None:  # type: ignore[no-untyped-def]
        """Out-of-range ids, positions past int32: refused by name, nothing changed."""
        m = self.mem
        bad = data.draw(st.sampled_from([N_SEQ, 99, -2]))
        calls = [
            lambda: m.seq_cp(0, bad),
            lambda: m.seq_keep(bad),
            lambda: m.seq_add(bad, 0, -1, 1),
            lambda: m.seq_div(bad, 0, -1, 2),
            lambda: m.seq_pos_max(bad),
            lambda: m.seq_add(0, 0, -1, 2**31),
            lambda: m.seq_div(0, 0, -1, 0),
        ]
        if bad >= 0:
            calls += [lambda: m.seq_rm(bad, -1, -1), lambda: m.state_write(bad)]
        before = books(self.mem)
        with pytest.raises(ArgumentError):
            data.draw(st.sampled_from(calls))()
        assert same_books(before, books(self.mem))

    # -- after every rule: the parts agree with each other and with the oracle ------------
    @invariant()
    def parts_agree(self) -> None:
        if not hasattr(self, "mem"):
            return
        mem = self.mem
        mem.recr.check_invariants()
        for cache in mem.kv_caches:
            for cells in cache.cells:
                cells.check()
        for s in range(N_SEQ):
            hist = self.toy.attn_hist.get(s, [])
            want_max = hist[-1][0] if hist else -1
            want_min = min(p for p, _ in hist) if hist else -1
            ends = {"hybrid": mem.seq_pos_max(s), "recurrent": mem.recr.seq_pos_max(s)}
            ends |= {cache.name: cache.seq_pos_max(s) for cache in mem.kv_caches}
            if self.base_kind == "idx":
                ends["indexer"] = mem.idx.seq_pos_max(s)
            assert set(ends.values()) == {want_max}, (s, want_max, ends)  # no part holds a sequence alone
            assert mem.recr.seq_pos_min(s) == want_max
            assert mem.seq_pos_min(s) == want_max  # the hybrid's minimum is the recurrent part's
            first = mem.kv_caches[0]
            if self.kind == "iswa":  # after a shift the oracle follows the window cache
                assert first.seq_pos_min(s) <= want_min <= mem.attn.swa.seq_pos_min(s)
            else:  # a window cache of full size never gives a cell up
                mins = {cache.name: cache.seq_pos_min(s) for cache in mem.kv_caches}
                assert set(mins.values()) == {want_min}, (s, want_min, mins)
        if self.base_kind == "idx":
            for a, i in zip(mem.attn.cells, mem.idx.cells, strict=True):
                assert np.array_equal(a.pos, i.pos) and np.array_equal(a.seq, i.seq)
            reps_unique(mem)


def _settings() -> settings:
    """60 examples of 15 steps under the CI profile; the ``stress`` profile decides both,
    ``dev`` the number of examples."""
    name = settings._current_profile or "ci"
    profile = settings.get_profile(name)
    n = 60 if name == "ci" else profile.max_examples
    steps = profile.stateful_step_count if name == "stress" else 15
    return settings(profile, max_examples=n, stateful_step_count=steps, deadline=None)


HybridMachine.TestCase.settings = _settings()
TestHybridMachine = HybridMachine.TestCase
