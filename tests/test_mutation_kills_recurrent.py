"""Recurrent memory details that survived mutation of ``core/recurrent.py``:
a shift that lands exactly on position 0 keeps the state, and the argument or
field each refusal names."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from recurrent_toy import Toy, toy_spec

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, StateError
from statecache.recurrent import RecurrentMemory
from statecache.state_io import pack_sections, unpack_sections


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def test_a_shift_onto_position_0_keeps_the_state_one_further_drops_it(dev):
    t = Toy(dev, 2)
    t.decode({0: [1, 2, 3, 4], 1: [5, 6, 7, 8]})
    before = t.state(0)
    t.mem.seq_add(0, 0, -1, -3)  # positions 0..3 -> the state now sits at 0
    assert t.mem.seq_pos_max(0) == 0 and t.mem.cell_of(0) >= 0
    after = t.state(0)
    assert all((after[L][n] == before[L][n]).all() for L in before for n in before[L])
    t.mem.seq_add(1, 0, -1, -4)  # one position further: before the start, the state goes
    assert t.mem.seq_pos_max(1) == -1 and t.mem.cell_of(1) < 0


@pytest.mark.parametrize("n_seq_max", [0, 257])
def test_n_seq_max_out_of_range_names_the_argument(dev, n_seq_max):
    with pytest.raises(ArgumentError) as err:
        RecurrentMemory(toy_spec(), dev, n_seq_max=n_seq_max)
    assert err.value.argument == "n_seq_max" and f"must be in [1, 256], got {n_seq_max}" in str(err.value)


def test_seq_div_by_zero_names_the_divisor(dev):
    t = Toy(dev, 1)
    t.decode({0: [1, 2]})
    with pytest.raises(ArgumentError) as err:
        t.mem.seq_div(0, 0, -1, 0)
    assert err.value.argument == "d" and "divisor must be >= 1, got 0" in str(err.value)


def _patched(blob: bytes, offset: int, value: int) -> bytes:
    flags, sections = unpack_sections(blob)
    (tag, payload), *_ = sections
    body = bytearray(bytes(payload))
    body[offset : offset + 4] = struct.pack("<I", value)
    return pack_sections([(tag, bytes(body))], flags)


def test_a_blob_that_does_not_fit_names_the_field(dev):
    t = Toy(dev, 2)
    t.decode({0: [1, 2], 1: [3]})
    blob = t.mem.state_write()
    with pytest.raises(StateError) as err:
        t.mem.state_read(_patched(blob, 0, 9))  # cell_count 9 in a memory of 2 cells
    assert err.value.field == "recurrent.cell_count" and "is 9, the memory has 2 cells" in str(err.value)
    # after 2 cells (i32 pos, u32 n_ids, i32 id each) and s_trans: n_layer
    with pytest.raises(StateError) as err:
        t.mem.state_read(_patched(blob, 4 + 2 * 12 + 4, 7))
    assert err.value.field == "recurrent.n_layer" and "is 7, this memory expects 3" in str(err.value)


def test_mrope_text_ubatch_keeps_its_planes_an_image_ubatch_does_not(dev):
    """M-RoPE positions that advance one per token (text) keep every snapshot
    plane reachable; a ubatch whose temporal positions repeat (an image grid)
    keeps only the final state."""
    for t_pos, rollback_ok in (([0, 1, 2, 3], True), ([0, 1, 1, 2], False)):
        t = Toy(dev, 1, n_rs_seq=2)
        x_pos = [0, 0, 1, 0]  # the two tokens at t = 1 are two patches of one image row (a whole position once)
        pos = np.array([t_pos, t_pos, x_pos, [0] * 4])
        balloc = BatchAllocator(1)
        balloc.init(Batch(tokens=[1, 2, 3, 4], pos=pos, seq_ids=[0] * 4), t.mem)
        ctx = t.mem.init_batch(balloc, 8)
        assert ctx.apply()
        assert t.mem.seq_rm(0, t_pos[-1], -1) is rollback_ok


def test_a_blob_cut_before_n_layer_names_it(dev):
    t = Toy(dev, 1)
    t.decode({0: [1, 2]})
    flags, sections = unpack_sections(t.mem.state_write())
    (tag, payload), *_ = sections
    cut = bytes(payload)[: 4 + 12 + 4]  # cell_count, one cell, s_trans: n_layer is missing
    with pytest.raises(StateError) as err:
        t.mem.state_read(pack_sections([(tag, cut)], flags))
    assert err.value.field == "recurrent.n_layer" and "truncated" in str(err.value)
