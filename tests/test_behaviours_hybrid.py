"""Hybrid composition behaviours no other test pinned (issue 20, item 5):
with one attention stream per sequence, a position move that the recurrent
part must refuse changes nothing in any part."""

from __future__ import annotations

import pytest
from hybrid_toy import HybridToy, make_hybrid

import statecache
from statecache.errors import ArgumentError
from statecache.memory import MemoryStatus


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def observed(mem) -> tuple:  # type: ignore[no-untyped-def]
    """What a caller can see: every part's positions, pending work, the state blob."""
    parts = [*mem.kv_caches, mem.recr] + ([mem.idx] if hasattr(mem, "idx") else [])
    positions = [(p.seq_pos_min(s), p.seq_pos_max(s)) for p in parts for s in range(mem.n_seq_max)]
    pending = [p.has_pending_update() for p in parts if hasattr(p, "has_pending_update")]
    return positions, pending, mem.state_write()


@pytest.mark.parametrize("kind", ["hybrid", "iswa", "idx"])
@pytest.mark.parametrize("op", ["seq_add", "seq_div"])
def test_refused_position_move_of_a_shared_recurrent_state_changes_no_part(dev, kind, op):
    """After seq_cp(0, 1) the attention cells are copies in another stream
    (free to move) but the recurrent cell is shared: moving sequence 0 is
    refused as a whole, before the attention part moves."""
    toy = HybridToy(dev, make_hybrid(dev, kind, unified=False))
    toy.decode({0: [1, 2, 3, 4, 5, 6]})
    toy.mem.seq_cp(0, 1)
    _apply_update(toy.mem)  # the queued cross-stream copies, so state_write can run

    def move() -> None:
        if op == "seq_add":
            toy.mem.seq_add(0, 2, -1, 3)
        else:
            toy.mem.seq_div(0, 0, -1, 2)

    before = observed(toy.mem)
    with pytest.raises(ArgumentError, match="shares its recurrent state"):
        move()
    assert observed(toy.mem) == before
    # the same move is accepted once sequence 0 owns its state alone
    toy.mem.seq_rm(1, -1, -1)
    move()
    assert toy.mem.seq_pos_max(0) == (8 if op == "seq_add" else 2)


def _apply_update(mem) -> None:  # type: ignore[no-untyped-def]
    ctx = mem.init_update()
    if ctx.status is MemoryStatus.SUCCESS:
        assert ctx.apply()
