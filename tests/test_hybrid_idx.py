"""Hybrid-idx at the memory level: kpool-spec K.9 items 8, 9, 21, 22 (marks per
operation) on the reference device with garbage-filled buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import HybridToy, make_hybrid

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.kpool import POS_CLEAN, rebuild
from statecache.memory import ContextError, StateFlags


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


class TagModel:
    """Each indexer row's pooled slot as a tag: what the graph last scattered there."""

    def __init__(self) -> None:
        self.tags: dict[int, object] = {}
        self.checked = 0  # pooled rows compared, so a run that checks nothing fails

    def on_apply(self, ctx) -> None:  # type: ignore[no-untyped-def]
        mem = ctx.mem
        mem.layout.check()  # the decode arrays equal the layouts
        for s in range(mem.n_seq_max):  # the incremental layout (appends only) is the one built from scratch
            strm, pairs = mem.pairs_of(s)
            assert mem.layout.seqs[s] == rebuild(pairs, strm, mem.layout.kpool, mem.layout.by_order), s
        inp = ctx.kpool_inputs()
        st = ctx.kpool_state
        for row in ctx.idx.k_idxs().tolist():  # cpy_k writes the per-token part and zeroes the slot
            self.tags[row] = "zero"
        for e in range(st.n_new_g):
            rep = int(inp.new_pool_rep[e])
            self.tags[rep] = tuple(inp.new_pool_idxs[e].tolist()) if e < st.n_new else "junk"
        starts = mem.layout.pool_start()
        for s, layout in enumerate(mem.layout.seqs):
            for k in range(len(layout.pools)):
                ip = starts[s] + k
                members = tuple(mem.layout.g(s, c) for _, c in mem.layout.members(s, k))
                assert self.tags.get(int(inp.pool_cells[ip])) == members, (s, k)
                self.checked += 1


def test_item9_pooled_rows_always_hold_their_pool(dev):
    rng = np.random.default_rng(7)
    toy = HybridToy(dev, make_hybrid(dev, "idx", size=64, n_rs_seq=2))
    model = TagModel()
    mem = toy.mem
    for step in range(40):
        op = rng.integers(0, 9) if step > 2 else 0
        live = [s for s in range(3) if mem.seq_pos_max(s) >= 0]
        if op <= 2 or not live or sum(max(mem.seq_pos_max(s) + 1, 0) for s in range(3)) > 45:
            if sum(max(mem.seq_pos_max(s) + 1, 0) for s in range(3)) > 45:
                mem.clear(True)
                model.tags.clear()
            seqs = rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist()
            toy.decode({int(s): rng.integers(0, 32, size=int(rng.integers(1, 7))).tolist() for s in seqs},
                       n_ubatch=int(rng.integers(4, 9)), on_apply=model.on_apply)  # fmt: skip
            continue
        s = int(rng.choice(live))
        pmax = mem.seq_pos_max(s)
        if op == 3:
            mem.seq_rm(s, max(pmax - 1, 1), -1)  # tail (rollback or refused)
        elif op == 4:
            mem.seq_rm(s, 1, max(pmax - 1, 2))  # middle (recurrent no-op, attention hole)
        elif op == 5:
            mem.seq_cp(s, (s + 1) % 3)
        elif op == 6:
            mem.seq_keep(s)
        elif op == 7:
            try:
                mem.seq_add(s, 2, -1, int(rng.choice([-2, 1, 3])))
            except statecache.ArgumentError:
                pass  # shared cells: refused, nothing changed
            upd = mem.init_update()
            upd.apply()
        else:
            blob = mem.state_write(s)
            mem.state_read(blob, s)
    assert model.checked > 10  # the run really compared pooled rows (25 with this seed)


def test_item8_sizes_only_after_apply(dev):
    toy = HybridToy(dev, make_hybrid(dev, "idx"))
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({0: [1, 2, 3, 4, 5]}), toy.mem)
    ctx = toy.mem.init_batch(balloc, 8)
    with pytest.raises(ContextError, match="after apply"):
        ctx.n_kpool()
    with pytest.raises(ContextError):
        ctx.kpool_inputs()
    assert ctx.apply()
    assert ctx.n_kpool() == 64 and ctx.n_kpool_new() == 2


def test_item7_reserve_bounds(dev):
    toy = HybridToy(dev, make_hybrid(dev, "idx", size=24))
    sizes = []
    toy.decode({0: list(range(9)), 1: list(range(5))}, on_apply=lambda c: sizes.append((c.n_kpool(), c.n_kpool_new())))
    full = toy.mem.init_full().kpool_state
    assert all(full.n_kpool >= a and full.n_new_g >= b for a, b in sizes)


def marks(mem):
    return mem.marks.marks.tolist()


def test_items21_22_marks_per_operation(dev):
    C = POS_CLEAN
    toy = HybridToy(dev, make_hybrid(dev, "idx", n_rs_seq=2))
    mem = toy.mem
    toy.decode({0: list(range(10)), 1: list(range(6))})
    assert marks(mem) == [C, C, C]  # cleared at the first next()
    assert mem.seq_rm(0, 4, -1) is False  # refused: no mark
    assert marks(mem) == [C, C, C]
    assert mem.seq_rm(0, 8, -1) is True  # rollback by 2
    assert marks(mem) == [8, C, C]
    mem.seq_rm(0, 9, 12)
    assert marks(mem) == [8, C, C]  # marks only go down
    mem.seq_cp(1, 2)
    assert marks(mem) == [8, C, 0]  # only the destination
    with pytest.raises(statecache.ArgumentError, match="whole sequences"):
        mem.seq_cp(1, 2, 2, -1)
    mem.seq_add(0, 5, -1, 1)
    assert marks(mem) == [5, C, 0]
    mem.seq_add(0, 5, -1, -1)  # a negative shift stales from p0 + shift
    assert marks(mem) == [4, C, 0]
    mem.seq_div(1, 0, -1, 1)
    assert marks(mem)[1] == 0
    # state read: PARTIAL_ONLY marks nothing, a full read marks the destination
    assert mem.init_update().apply()  # the shifts (indexer: cleared, never rotated)
    assert mem.idx.init_update().status.value == "no_update"
    toy.decode({0: [1]})
    assert marks(mem) == [C, C, C]
    blob_p = mem.state_write(0, StateFlags.PARTIAL_ONLY)
    mem.state_read(blob_p, 0, StateFlags.PARTIAL_ONLY)
    assert marks(mem) == [C, C, C]
    mem.state_read(mem.state_write(1), 1)
    assert marks(mem) == [C, 0, C]
    mem.seq_keep(0)
    assert marks(mem) == [0, 0, 0]
    toy.decode({0: [2]})
    mem.clear(False)
    assert marks(mem) == [0, 0, 0]


def test_item24_tail_removal_keeps_earlier_pools(dev):
    toy = HybridToy(dev, make_hybrid(dev, "idx", n_rs_seq=2))
    toy.decode({0: list(range(12))})
    assert toy.mem.seq_rm(0, 10, -1)
    news = []
    toy.decode({0: [5, 6]}, on_apply=lambda c: news.append(c.kpool_state.is_new.tolist()))
    assert news == [[False, False, True]]  # only the pool ending at or after position 10


@pytest.mark.parametrize("edit", ["add+1", "add-2", "div2", "rm_head"])
@pytest.mark.parametrize("by_order", [False, True])
def test_item9_regrouping_edits_repool(dev, edit, by_order):
    """Edits that regroup pools (shifts, division, a removal reaching pos_min) must
    re-pool every affected pool on the next batch, or stale rows would be read."""
    toy = HybridToy(dev, make_hybrid(dev, "idx", size=32))
    toy.mem.layout.by_order = by_order
    model = TagModel()
    toy.decode({0: list(range(14))}, on_apply=model.on_apply)
    mem = toy.mem
    if edit == "add+1":
        mem.seq_add(0, 5, -1, 1)
    elif edit == "add-2":
        mem.seq_rm(0, 3, 5)
        mem.seq_add(0, 5, -1, -2)
    elif edit == "div2":
        mem.seq_div(0, 0, -1, 2)
    else:
        mem.seq_rm(0, 0, 2)  # attention drops the first two positions: pos_min moves
    assert mem.init_update().apply()
    toy.decode({0: [7]}, on_apply=model.on_apply)


def test_k7_step4_failed_first_ubatch_keeps_the_marks(dev):
    """K.7 step 4: a batch planned with stale marks whose first ubatch fails compute
    (no next()) must leave the marks set; the driver's rollback only lowers them, and
    the next batch re-pools every stale pool, so every pooled row holds its pool."""
    C = POS_CLEAN
    toy = HybridToy(dev, make_hybrid(dev, "idx", size=32, n_rs_seq=2))
    mem, model = toy.mem, TagModel()
    toy.decode({0: list(range(14)), 1: [3, 4]}, on_apply=model.on_apply)
    mem.seq_rm(0, 0, 2)  # pos_min moves: every pool of 0 regroups onto cells whose rows hold no pool
    assert marks(mem) == [0, C, C]
    balloc = BatchAllocator(3)
    balloc.init(Batch.for_sequences({0: [7], 1: [8]}), mem)
    ctx = mem.init_batch(balloc, 8)
    assert ctx.apply()
    assert ctx.kpool_state.n_new == 3  # the stale pools [2..5], [6..9], [10..13] were due for re-pooling
    ctx.recr.step()  # the recurrent graph ran, then the indexer part failed: nothing scattered, no next()
    for row in ctx.idx.k_idxs().tolist():
        model.tags[row] = "zero"  # the per-token rows were written with a zero pooled slot
    assert marks(mem) == [0, C, C]  # not cleared: the first ubatch never computed
    assert mem.seq_rm(0, 14, -1) and mem.seq_rm(1, 2, -1)  # the driver removes the failed tokens
    assert marks(mem) == [0, 2, C]  # marks only moved down
    news = []
    toy.decode({0: [7], 1: [8]}, on_apply=lambda c: (news.append(c.kpool_state.n_new), model.on_apply(c)))
    assert news == [3] and marks(mem) == [C, C, C]


def test_restore_refuses_an_indexer_section_with_other_sequences_than_attention():
    """The indexer follows the attention cells exactly (K.1): a blob whose IDX
    section tags a cell with another sequence is refused, and nothing changes
    (found by review: it was accepted and the two books diverged)."""
    import struct

    from statecache.errors import StateError
    from statecache.hybrid_idx import TAG_IDX
    from statecache.state_io import pack_sections, unpack_sections

    dev = statecache.get_device("reference")
    mem = make_hybrid(dev, "idx", n_seq_max=3, size=24, kpool=4)
    HybridToy(dev, mem).decode({0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10]})
    flags, sections = unpack_sections(mem.state_write())
    patched = []
    for tag, payload in sections:
        if tag == TAG_IDX:
            payload = bytearray(payload)
            # u32 n_stream, u32 count, then cell 0: i32 pos, u32 n_ids, i32 id
            assert struct.unpack_from("<i", payload, 16)[0] == 0
            struct.pack_into("<i", payload, 16, 2)
        patched.append((tag, bytes(payload)))
    dst = make_hybrid(dev, "idx", n_seq_max=3, size=24, kpool=4)
    HybridToy(dev, dst).decode({2: [4, 4]})
    before = (dst.attn.seq_pos_max(2), dst.idx.seq_pos_max(2), dst.recr.seq_pos_max(2))
    with pytest.raises(StateError, match=r"idx\.cells"):
        dst.state_read(pack_sections(patched, flags))
    assert (dst.attn.seq_pos_max(2), dst.idx.seq_pos_max(2), dst.recr.seq_pos_max(2)) == before
    assert dst.attn.seq_pos_max(0) == dst.idx.seq_pos_max(0) == -1
