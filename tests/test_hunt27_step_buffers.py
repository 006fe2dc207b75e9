"""Hunt 27: the reused per-step device buffers (statecache.step_buffers) after a ubatch
of another shape.

Regression: :meth:`StepBuffers.floats` skipped a write when the values equalled the
last ones written *through a view of the same shape*, but every shape of a role is a
view of one storage: a mask of one token written in between overwrote the first row
of the two-token mask, and a later two-token ubatch whose mask equalled the earlier
one read that stale row.  A speculative decoder meets this at once (a draft of two
tokens, another sequence's one-token step, the draft rejected and the same two
positions decoded again); found by tests/test_hunt27_state_blobs.py (a sequence
restored to the layout it had before).
"""

from __future__ import annotations

import numpy as np
from recurrent_toy import Tables
from test_memory_step import decode_loop, make_memory

import statecache
from statecache.step_buffers import StepBuffers

DEV = statecache.get_device("reference")


def test_equal_values_are_written_again_after_another_shape_wrote_the_storage() -> None:
    sb = StepBuffers(DEV)
    two = np.arange(6, dtype=np.float32).reshape(2, 3)
    one = np.full((1, 3), -1.0, dtype=np.float32)
    sb.floats("m", two)
    sb.floats("m", one)
    np.testing.assert_array_equal(DEV.download(sb.floats("m", two.copy())), two)
    np.testing.assert_array_equal(DEV.download(sb.floats("m", two)), two)  # the same array object too


def test_a_rejected_draft_decoded_again_reads_a_fresh_mask() -> None:
    for kind in ("kv", "hybrid", "kv-iswa", "hybrid-iswa", "hybrid-idx"):
        tables = Tables()
        mem = make_memory(DEV, kind)
        decode_loop(mem, tables, {0: [1, 2, 3], 1: [4]})
        draft = decode_loop(mem, tables, {0: [5, 6]})  # a two-token draft
        decode_loop(mem, tables, {1: [7]})  # another sequence's one-token step
        assert mem.seq_rm(0, 3, -1)  # the draft rejected ...
        again = decode_loop(mem, tables, {0: [5, 6]})  # ... and the same tokens decoded again
        fresh = make_memory(DEV, kind)  # the accepted history decoded from scratch
        decode_loop(fresh, tables, {0: [1, 2, 3], 1: [4]})
        want = decode_loop(fresh, tables, {0: [5, 6]})
        for k, w in want.items():
            np.testing.assert_array_equal(draft[k], w, err_msg=f"{kind}: draft {k}")
            np.testing.assert_array_equal(again[k], w, err_msg=f"{kind}: again {k}")
