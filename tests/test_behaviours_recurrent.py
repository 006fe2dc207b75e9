"""Recurrent memory behaviours that were caught only by accident (issue 20,
item 10): a rollback onto the plane that ends exactly at a hole's end, and a
per-sequence restore next to a shared cell.  States are compared with a
recompute from the token list (recurrent_toy's oracle), never with the book.
"""

from __future__ import annotations

import numpy as np
import pytest
from recurrent_toy import Toy, oracle

import statecache


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def assert_state_is(t: Toy, seq: int, tokens: list[int]) -> None:
    _, want = oracle(t.dev, t.tables, tokens)
    got = t.state(seq)
    for layer, tensors in want.items():
        for name, row in tensors.items():
            np.testing.assert_allclose(got[layer][name], row, rtol=1e-5, atol=1e-6, err_msg=f"{layer}.{name}")


def test_rollback_onto_the_plane_ending_at_a_holes_end_stays_allowed(dev):
    """Ten tokens in one ubatch with 4 planes: they hold the state after
    positions 9, 8, 7, 6.  A hole [5, 7) makes the plane after 6 describe a
    removed position, but the plane after 7 (the first position past the
    hole) is still exact, so rolling back onto it must stay allowed."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    t = Toy(dev, 1, n_rs_seq=3)
    t.decode({0: tokens})
    assert t.mem.seq_rm(0, 5, 7)  # the hole: accepted, the state keeps those tokens
    assert not t.mem.seq_rm(0, 7, -1)  # "after 6" lies inside the hole: refused
    assert t.mem.seq_rm(0, 8, -1)  # "after 7": the hole's end, allowed
    assert t.mem.seq_pos_max(0) == 7
    assert_state_is(t, 0, tokens[:8])  # every token up to position 7, the hole's included
    t.decode({0: [7]})
    assert_state_is(t, 0, [*tokens[:8], 7])


def test_per_sequence_restore_never_takes_the_cell_it_shares(dev):
    """Sequences 0 and 1 share a cell (seq_cp); restoring a per-sequence blob
    into 0 must give 0 a cell of its own and leave 1's state as it was."""
    t = Toy(dev, 3, n_rs_seq=2)
    t.decode({0: [1, 2, 3]})
    blob = t.mem.state_write(0)
    t.decode({0: [4, 5]})
    t.mem.seq_cp(0, 1)
    shared = t.mem.cell_of(1)
    t.mem.state_read(blob, 0)
    assert t.mem.cell_of(1) == shared and t.mem.cell_of(0) != shared
    assert_state_is(t, 1, [1, 2, 3, 4, 5])
    assert_state_is(t, 0, [1, 2, 3])
    # both continue independently
    t.decode({0: [6], 1: [7]})
    assert_state_is(t, 0, [1, 2, 3, 6])
    assert_state_is(t, 1, [1, 2, 3, 4, 5, 7])
