"""Hybrid composition details that survived mutation of ``core/hybrid.py``
and ``core/hybrid_idx.py``: the argument each refusal names, ``clear()``
wiping the data of every part by default, and the indexer cache following
the attention part's window without RoPE shifts."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import ATTN, E, HybridToy, make_hybrid
from recurrent_toy import toy_spec

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError
from statecache.hybrid import HybridISWAMemory, HybridMemory
from statecache.hybrid_idx import HybridIdxMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.kv_mask import SWAType
from statecache.memory import ContextError, StateFlags
from statecache.recurrent import RecurrentMemory


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def test_composing_mismatched_parts_names_the_argument(dev):
    attn = KVCache(dev, [KVLayer(ATTN, E, E)], size=8, n_seq_max=2, dtype="f32")
    recr = RecurrentMemory(toy_spec(), dev, n_seq_max=3)
    with pytest.raises(ArgumentError) as err:
        HybridMemory(attn, recr)
    assert err.value.argument == "n_seq_max" and "attention has 2, recurrent 3" in str(err.value)
    with pytest.raises(ArgumentError) as err:
        HybridISWAMemory(attn, RecurrentMemory(toy_spec(), dev, n_seq_max=2))  # type: ignore[arg-type]
    assert err.value.argument == "attn" and "needs a KVCacheISWA, got KVCache" in str(err.value)


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_sequence_operations_name_the_bad_argument(dev, kind):
    mem = make_hybrid(dev, kind, unified=False)
    cases = [
        (lambda: mem.seq_cp(5, 0), "src", "sequence 5 outside [0, n_seq_max=3)"),
        (lambda: mem.seq_cp(0, -1), "dst", "sequence -1 outside"),
        (lambda: mem.seq_cp(0, 1, 2, -1), "p0/p1", "whole sequence"),
        (lambda: mem.seq_add(3, 0, -1, 1), "seq", "sequence 3 outside"),
        (lambda: mem.seq_div(0, 0, -1, 0), "d", "divisor must be >= 1, got 0"),
    ]
    for call, argument, words in cases:
        with pytest.raises(ArgumentError) as err:
            call()
        assert err.value.argument == argument and words in str(err.value), str(err.value)


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_clear_wipes_every_parts_data_by_default(dev, kind):
    toy = HybridToy(dev, make_hybrid(dev, kind))
    toy.decode({0: [1, 2, 3], 1: [4]})
    toy.mem.clear()
    assert all(toy.mem.seq_pos_max(s) == -1 for s in range(3))
    for pools in toy.mem.recr.pools.values():
        for buf in pools.values():
            assert not np.asarray(buf.numpy()).any()
    for cache in toy.mem.kv_caches:
        for buf in cache.buffers():
            assert not np.asarray(buf.numpy()).any()


def test_hybrid_idx_refusals_and_its_indexer_cache(dev):
    recr = RecurrentMemory(toy_spec(), dev, n_seq_max=2)
    iswa = KVCacheISWA(dev, [KVLayer(ATTN, E, E)], [ATTN], size=16, n_seq_max=2, n_ubatch=4, n_swa=4, dtype="f32")
    with pytest.raises(ArgumentError) as err:
        HybridIdxMemory(iswa, recr, [ATTN], head_size=2)  # type: ignore[arg-type]
    assert err.value.argument == "attn" and "needs a plain KVCache attention part" in str(err.value)
    attn = KVCache(
        dev, [KVLayer(ATTN, E, E)], size=16, n_seq_max=2, dtype="f32", swa_type=SWAType.STANDARD, n_swa=4, n_pad=8
    )
    mem = HybridIdxMemory(attn, recr, [ATTN], head_size=2)
    # the indexer keeps exactly the attention's cells, so it slides with the same window,
    # and its keys carry no RoPE: shifts are cleared, never rotated
    assert (mem.idx.swa_type, mem.idx.n_swa) == (SWAType.STANDARD, 4)
    assert mem.idx.can_shift is False
    with pytest.raises(ArgumentError) as err:
        mem.seq_cp(0, 1, 0, 0)  # an empty range is not the whole sequence
    assert err.value.argument == "p0/p1" and "copies whole sequences only, got [0, 0)" in str(err.value)


def test_a_second_removal_between_apply_and_undo_still_blocks_undo(dev):
    """The hybrid tells "seq_rm removed something" from the attention streams'
    removal counters: a removal must be seen as a change however many came
    before it, or undo would silently take the later one back."""
    toy = HybridToy(dev, make_hybrid(dev, "hybrid"))
    toy.decode({0: [1, 2, 3], 1: [4, 5, 6, 7]})
    mem = toy.mem
    assert mem.seq_rm(1, 1, 2)  # an earlier removal (a hole)
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [8]}), mem)
    ctx = mem.init_batch(balloc, 8)
    ctx.keep_undo_rows = True
    assert ctx.apply()
    assert mem.seq_rm(1, 2, 3)  # another hole, after the apply
    with pytest.raises(ContextError, match="changed"):
        ctx.undo()


def test_hybrid_idx_defaults_and_undo_rows_follow_the_recurrent_part(dev):
    recr = RecurrentMemory(toy_spec(), dev, n_seq_max=2, keep_undo_rows=True)
    attn = KVCache(dev, [KVLayer(ATTN, E, E)], size=16, n_seq_max=2, dtype="f32", n_pad=8)
    mem = HybridIdxMemory(attn, recr, [ATTN], head_size=2)
    # kpool-spec K.1: rows of D * row_factor, row_factor 3 by default (key | gate | pooled)
    assert mem.idx.k[ATTN].shape == (16, 2 * 3)
    assert mem.layout.by_order is False
    for memory in (mem, HybridMemory(KVCache(dev, [KVLayer(ATTN, E, E)], size=16, n_seq_max=2, dtype="f32"), recr)):
        balloc = BatchAllocator(2)
        balloc.init(Batch.for_sequences({0: [1, 2]}), memory)
        assert memory.init_batch(balloc, 8).keep_undo_rows is True  # as the recurrent part asks


def test_undo_rows_reach_every_leaf_of_a_nested_composite(dev):
    """Hybrid-iSWA's attention context is itself a composite (base + window):
    asking the hybrid context to keep undo rows must reach both caches and the
    recurrent part, not stop at the nested composite."""
    toy = HybridToy(dev, make_hybrid(dev, "iswa"))
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({0: [1, 2]}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    ctx.keep_undo_rows = True
    assert ctx.recr.keep_undo_rows is True
    assert all(p.keep_undo_rows is True for p in ctx.attn.parts)


def test_a_failed_partial_read_drops_the_window_and_recurrent_state_of_sequence_0(dev, monkeypatch):
    """A partial read (PARTIAL_ONLY: the window cache and the recurrent state)
    that fails while writing, after validation, drops the destination from
    exactly the parts it would have written: sequence 0 too, not only s > 0."""
    toy = HybridToy(dev, make_hybrid(dev, "iswa"))
    toy.decode({0: [1, 2, 3], 1: [4, 5]})
    mem = toy.mem
    blob = mem.state_write(0, StateFlags.PARTIAL_ONLY)

    def broken(plan):  # type: ignore[no-untyped-def]
        raise RuntimeError("device lost")

    monkeypatch.setattr(mem.recr, "apply_section", broken)
    with pytest.raises(RuntimeError):
        mem.state_read(blob, 0, StateFlags.PARTIAL_ONLY)
    base, swa = mem.attn.caches
    assert swa.seq_pos_max(0) == -1 and mem.recr.seq_pos_max(0) == -1
    assert base.seq_pos_max(0) == 2  # a partial read never touches the full-attention cache
    assert swa.seq_pos_max(1) == 1 and mem.recr.seq_pos_max(1) == 1
