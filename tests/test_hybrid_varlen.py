"""The hybrid memories (hybrid, hybrid-iSWA, hybrid-idx) plan a mixed batch as one packed
ubatch (``init_batch(varlen=True)``): the recurrent part advances every sequence in one
call per layer, the K/V part places the packed tokens one by one, and the mask rows follow
the packed token order, so every output equals the equal split's and the oracle's."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import HybridToy, make_hybrid

import statecache

ATOL = 2e-5
HISTORY = {4: [3, 1, 4, 1], 1: [5, 9, 2]}
#: three prompts, a decode (4) and a draft (1), ids neither sorted nor consecutive
EXAMPLE = {3: [2, 6, 5, 3, 5, 8], 4: [7], 0: [9, 3], 1: [2, 3, 8], 2: [4, 6, 2, 6, 4]}


@pytest.mark.parametrize(("kind", "unified"), [("hybrid", True), ("hybrid", False), ("iswa", True), ("idx", True)])
def test_hybrid_plans_a_mixed_batch_as_one_packed_ubatch(kind: str, unified: bool) -> None:
    dev = statecache.get_device("reference")
    packed, equal = (
        HybridToy(dev, make_hybrid(dev, kind, n_seq_max=5, size=48, unified=unified, n_rs_seq=2, n_swa=5))
        for _ in range(2)
    )
    for t, varlen in ((packed, True), (equal, False)):
        assert t.decode(HISTORY, n_ubatch=64, varlen=varlen) is not None
    got = packed.decode(EXAMPLE, n_ubatch=64, varlen=True)
    want = equal.decode(EXAMPLE, n_ubatch=64)
    assert got is not None and want is not None
    assert packed.forwards == 1 and equal.forwards > 1
    assert got.keys() == want.keys()
    for k in got:  # the attention half of every output sees exactly the cells of its sequence
        np.testing.assert_allclose(got[k], want[k], atol=ATOL, err_msg=str(k))
    for s in EXAMPLE:
        np.testing.assert_allclose(got[(s, packed.mem.seq_pos_max(s))], packed.expected(s), atol=ATOL)
    # the draft of sequence 1 is rejected after its first token: both parts roll back
    assert packed.mem.seq_rm(1, len(HISTORY[1]) + 1, -1)
    packed.recr_tokens[1] = packed.recr_tokens[1][:-2]
    packed.attn_hist[1] = packed.attn_hist[1][:-2]
    got = packed.decode({1: [6], 0: [1]}, n_ubatch=64, varlen=True)
    assert got is not None
    for s in (1, 0):
        np.testing.assert_allclose(got[(s, packed.mem.seq_pos_max(s))], packed.expected(s), atol=ATOL)


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
def test_a_varlen_batch_that_does_not_fit_is_refused_and_changes_nothing(kind: str) -> None:
    from statecache.batch import Batch, BatchAllocator
    from statecache.errors import BatchError
    from statecache.memory import MemoryStatus

    dev = statecache.get_device("reference")
    toy = HybridToy(dev, make_hybrid(dev, kind, n_seq_max=5, size=16, n_rs_seq=2, n_swa=16, swa_full=True))
    assert toy.decode(HISTORY, n_ubatch=64, varlen=True) is not None
    mem = toy.mem
    before = mem.state_write()
    balloc = BatchAllocator(5)
    balloc.init(Batch.for_sequences({0: list(range(6)), 2: list(range(7)), 3: [1]}), mem)  # 14 > 9 free cells
    ctx = mem.init_batch(balloc, 64, varlen=True)
    assert ctx.status is MemoryStatus.FAILED_PREPARE
    with pytest.raises(BatchError):  # a sequence id the memory does not hold
        balloc.init(Batch.for_sequences({0: [1], 5: [2]}), mem)
    assert mem.state_write() == before
    got = toy.decode({0: [1, 2], 3: [4]}, n_ubatch=64, varlen=True)  # what fits still runs, packed
    assert got is not None and toy.forwards == 1
    for s in (0, 3):
        np.testing.assert_allclose(got[(s, mem.seq_pos_max(s))], toy.expected(s), atol=ATOL)


def test_a_kv_cache_plans_a_varlen_batch_with_offsets_and_the_mask_in_packed_order() -> None:
    from statecache.batch import Batch, BatchAllocator
    from statecache.kv_cache import KVCache, KVLayer

    dev = statecache.get_device("reference")
    cache = KVCache(dev, [KVLayer(0, 4, 4)], size=32, n_seq_max=5, unified=True, dtype="f32", n_pad=8)
    balloc = BatchAllocator(5)
    balloc.init(Batch(tokens=np.arange(6), seq_ids=[3, 1, 3, 3, 1, 0]), cache)
    ctx = cache.init_batch(balloc, 64, varlen=True)
    assert ctx.apply()
    ub = ctx.get_ubatch()
    np.testing.assert_array_equal(ub.cu_seqlens, [0, 3, 5, 6])
    np.testing.assert_array_equal(ub.primary, [3, 3, 3, 1, 1, 0])
    mask = ctx.mask()
    cell = ctx.sinfo.rows  # where each packed token was placed
    for i in range(ub.n_tokens):  # token i sees exactly the cells of its sequence's tokens up to itself
        want = {int(cell[j]) for j in range(ub.n_tokens) if ub.primary[j] == ub.primary[i] and ub.pos[j] <= ub.pos[i]}
        assert set(np.flatnonzero(np.isfinite(mask[i])).tolist()) == want, i
