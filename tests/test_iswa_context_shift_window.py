"""A context shift on an iSWA pair whose window cache evicts: the move brings positions
below the removed range closer to the sequence's end, so the next token's window may
reach positions the window cache already gave up.  Such a shift is refused (nothing
changed), as a rollback that deep is (docs/memory-semantics.md §3.5); an accepted one
leaves the window cache holding every position the next token's window reads.  A tail
removal through context_shift follows seq_rm's rule exactly (it used to pass the check
and then hit an InvariantError when seq_rm refused it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError
from statecache.kv_cache import KVCacheISWA, KVLayer
from statecache.kv_mask import SWAType, is_masked_swa

E = 4


def decoded(n_tokens: int, n_swa: int, swa_type: SWAType, chunk: int) -> KVCacheISWA:
    dev = statecache.get_device("reference")
    mem = KVCacheISWA(
        dev, [KVLayer(il, E, E) for il in range(2)], [1], size=64, n_seq_max=1, n_ubatch=4, n_swa=n_swa,
        swa_type=swa_type, dtype="f32", n_pad=8,
    )  # fmt: skip
    balloc = BatchAllocator(1)
    done = 0
    while done < n_tokens:
        n = min(chunk, n_tokens - done)
        balloc.init(Batch.for_sequences({0: list(range(1, n + 1))}), mem)
        ctx = mem.init_batch(balloc, 4)
        assert not ctx.status.is_fail
        while True:
            assert ctx.apply()
            if not ctx.next():
                break
        done += n
    return mem


def positions(cache) -> list[int]:  # type: ignore[no-untyped-def]
    return [p for p, _ in cache.cells[cache.stream_of(0)].seq_pos[0]]


#: An evicting iSWA pair decoded ``n_tokens`` tokens ``chunk`` at a time (see :func:`decoded`).
EVICTING_PAIRS = {
    "n_tokens": st.integers(2, 30),
    "n_swa": st.integers(1, 6),
    "swa_type": st.sampled_from([SWAType.STANDARD, SWAType.SYMMETRIC, SWAType.CHUNKED]),
    "chunk": st.integers(1, 5),
}


def window_holds_what_the_next_token_reads(mem: KVCacheISWA) -> bool:
    base, held = positions(mem.base), set(positions(mem.swa))
    if not base:
        return True
    end = base[-1]
    need = {p for p in base if not is_masked_swa(mem.swa.n_swa, mem.swa.swa_type, p, end + 1)} | {end}
    return need <= held


@settings(max_examples=200, deadline=None)
@given(**EVICTING_PAIRS, data=st.data())
def test_a_context_shift_never_leaves_the_window_short(n_tokens, n_swa, swa_type, chunk, data):  # type: ignore[no-untyped-def]
    mem = decoded(n_tokens, n_swa, swa_type, chunk)
    assert window_holds_what_the_next_token_reads(mem)
    end = mem.base.seq_pos_max(0)
    q0 = data.draw(st.integers(0, end), label="p0")
    q1 = data.draw(st.sampled_from([-1, *range(q0 + 1, end + 2)]), label="p1")
    before = mem.state_write()
    refusal = mem.context_shift_refusal(0, q0, q1)
    if refusal is not None:
        with pytest.raises(ArgumentError):
            mem.context_shift(0, q0, q1)
        assert mem.state_write() == before  # refused: nothing changed
        return
    mem.context_shift(0, q0, q1)
    assert window_holds_what_the_next_token_reads(mem)
    if q1 == -1:  # a tail removal: exactly seq_rm's rule
        fresh = decoded(n_tokens, n_swa, swa_type, chunk)
        assert fresh.seq_rm(0, q0, -1)


def test_a_tail_removal_seq_rm_refuses_is_refused_by_context_shift_too():
    mem = decoded(24, 4, SWAType.STANDARD, 1)
    refused = [p for p in range(1, 24) if not mem.can_seq_rm(0, p, -1)]
    assert refused, "the window cache evicted nothing: the case does not arise"
    before = mem.state_write()
    for p in refused:
        assert mem.context_shift_refusal(0, p, -1) is not None
        with pytest.raises(ArgumentError, match="window cache"):
            mem.context_shift(0, p, -1)
    assert mem.state_write() == before
    assert np.array_equal(positions(mem.base), np.arange(24))


@settings(max_examples=200, deadline=None)
@given(**EVICTING_PAIRS, data=st.data())
def test_a_position_move_never_leaves_the_window_short(n_tokens, n_swa, swa_type, chunk, data):  # type: ignore[no-untyped-def]
    """seq_add (negative: the tail moved down onto earlier positions) and seq_div (self-extend)
    widen what the next token's window reads over earlier positions, as a context shift does."""
    mem = decoded(n_tokens, n_swa, swa_type, chunk)
    end = mem.base.seq_pos_max(0)
    q0 = data.draw(st.integers(0, end), label="p0")
    q1 = data.draw(st.sampled_from([-1, *range(q0 + 1, end + 2)]), label="p1")
    op = data.draw(st.sampled_from(["seq_add", "seq_div"]), label="op")
    arg = data.draw(st.integers(-end - 2, 5) if op == "seq_add" else st.integers(1, 4), label="delta/d")
    before = mem.state_write()
    refusal = (mem.seq_add_refusal if op == "seq_add" else mem.seq_div_refusal)(0, q0, q1, arg)
    if refusal is not None:
        with pytest.raises(ArgumentError):
            getattr(mem, op)(0, q0, q1, arg)
        assert mem.state_write() == before  # refused: nothing changed
        return
    getattr(mem, op)(0, q0, q1, arg)
    assert window_holds_what_the_next_token_reads(mem)
