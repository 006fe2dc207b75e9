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


@pytest.mark.parametrize(
    ("kind", "unified"), [("hybrid", True), ("hybrid", False), ("iswa", True), ("idx", True)]
)
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
