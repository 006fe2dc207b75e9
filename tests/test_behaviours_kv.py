"""KV cache behaviours that no other test pinned (issue 20, items 1-4 and the
KV half of 10): each test below failed on a bug planted by hand in a clone
and passes on the code as it is.  Everything goes through the public API
(``seq_*``, ``state_*``, ``init_batch``); the cell book is only read.
"""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import StateError
from statecache.kv_cache import TAG_KV, KVCache, KVLayer
from statecache.kv_mask import SWAType
from statecache.memory import MemoryStatus
from statecache.state_io import pack_sections, unpack_sections

E = 4


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def make_cache(dev, *, size, n_seq_max=2, unified=True, swa=SWAType.NONE, n_swa=0) -> KVCache:
    cache = KVCache(
        dev,
        [KVLayer(0, E, E)],
        size=size,
        n_seq_max=n_seq_max,
        unified=unified,
        dtype="f32",
        swa_type=swa,
        n_swa=n_swa,
        n_pad=8,
    )
    cache.fill_garbage(5)
    return cache


def k_row(token: int) -> np.ndarray:
    return np.full(E, float(token), dtype=np.float32)


def run(cache: KVCache, batch: Batch, n_ubatch: int = 16) -> None:
    """Apply a batch; each token's K and V rows are its token id repeated."""
    balloc = BatchAllocator(cache.n_seq_max)
    balloc.init(batch, cache)
    ctx = cache.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    while True:
        assert ctx.apply()
        ub = ctx.get_ubatch()
        rows = np.stack([k_row(int(t)) for t in ub.token])
        ctx.cpy_k(0, rows)
        ctx.cpy_v(0, rows)
        if not ctx.next():
            return


def held(cache: KVCache, seq: int) -> list[tuple[int, int]]:
    """``(position, token in its K row)`` of every cell ``seq`` holds, by position."""
    strm = cache.stream_of(seq)
    k = cache.k[0].numpy()
    return sorted((p, int(k[strm * cache.size + c][0])) for p, c in cache.cells[strm].seq_cells(seq))


# -- item 1: sliding-window reuse of a shared cell ---------------------------------------


def test_swa_reuse_never_takes_a_cell_another_sequence_still_holds(dev):
    """seq_cp(0, 1), then decode sequence 0 past the window: the cache must
    reuse only cells that sequence 0 holds alone, so sequence 1 keeps every
    position (and K row) it was given."""
    cache = make_cache(dev, size=6, swa=SWAType.STANDARD, n_swa=2)
    run(cache, Batch.for_sequences({0: [10, 11, 12]}))
    cache.seq_cp(0, 1)
    want = held(cache, 1)
    assert want == [(0, 10), (1, 11), (2, 12)]
    for step in range(6):  # positions 3..8: three empty cells, then reuse
        run(cache, Batch.for_sequences({0: [20 + step]}))
        assert held(cache, 1) == want, f"step {step}"
        cache.cells[0].check()
    # sequence 0 only ever overwrote its own cells, and kept a gap-free window
    assert cache.seq_pos_max(0) == 8
    mine = [p for p, _ in held(cache, 0)]
    assert mine == list(range(mine[0], 9))


# -- item 2: M-RoPE positions with sliding-window reuse ------------------------------------


def test_swa_reuse_of_one_image_cell_purges_the_others_at_that_position(dev):
    """Several cells of an image share a temporal position.  When the window
    reuses one of them, the sequence no longer holds that position at all:
    the other patches at the same position go too (a sequence keeps every
    position between its min and max, never half of one)."""
    cache = make_cache(dev, size=8, swa=SWAType.STANDARD, n_swa=2)
    # text at 0, a 2x2 image at temporal position 1, text at 3 and 4
    t = [0, 1, 1, 1, 1, 3, 4]
    y = [0, 1, 1, 2, 2, 3, 4]
    x = [0, 1, 2, 1, 2, 3, 4]
    pos = np.array([t, y, x, [0] * 7])
    run(cache, Batch(tokens=np.arange(30, 37), pos=pos, seq_ids=[0] * 7))
    assert [p for p, _ in held(cache, 0)] == t
    run(cache, Batch.for_sequences({0: [40]}))  # position 5: the last empty cell
    run(cache, Batch.for_sequences({0: [41]}))  # position 6: reuses the cell at 0
    assert [p for p, _ in held(cache, 0)] == [1, 1, 1, 1, 3, 4, 5, 6]
    run(cache, Batch.for_sequences({0: [42]}))  # position 7: reuses one image cell
    positions = [p for p, _ in held(cache, 0)]
    assert 1 not in positions, positions
    assert positions == list(range(positions[0], 8))
    cache.cells[0].check()


# -- item 3: seq_rm over every sequence with a finite range ----------------------------------


@pytest.mark.parametrize("unified", [True, False])
def test_seq_rm_of_every_sequence_keeps_the_cell_at_p1(dev, unified):
    cache = make_cache(dev, size=16, unified=unified)
    run(cache, Batch.for_sequences({0: [1, 2, 3, 4, 5, 6], 1: [7, 8, 9, 10, 11, 12]}))
    assert cache.seq_rm(-1, 2, 4) is True
    assert held(cache, 0) == [(0, 1), (1, 2), (4, 5), (5, 6)]
    assert held(cache, 1) == [(0, 7), (1, 8), (4, 11), (5, 12)]
    assert cache.seq_rm(-1, 5, 6) is True  # a one-position range
    assert [p for p, _ in held(cache, 0)] == [0, 1, 4]
    for cells in cache.cells:
        cells.check()


# -- item 4: a blob listing the wrong sequence in a stream -----------------------------------


def _swap_first_seq_id(blob: bytes) -> bytes:
    """The same blob with the first cell of stream 0 listing sequence 1 instead
    of 0 (layout of docs/state-format.md: u32 n_stream, u32 cell_count, then
    per cell i32 pos, u32 n_seq_id, i32 seq_id ...)."""
    flags, sections = unpack_sections(blob)
    (tag, payload), *rest = sections
    assert tag == TAG_KV
    body = bytearray(bytes(payload))
    assert int.from_bytes(body[16:20], "little", signed=True) == 0
    body[16:20] = (1).to_bytes(4, "little", signed=True)
    return pack_sections([(tag, bytes(body)), *((t, bytes(p)) for t, p in rest)], flags)


def test_stream_per_sequence_refuses_a_blob_with_another_sequence_in_a_stream(dev):
    src = make_cache(dev, size=8, unified=False)
    run(src, Batch.for_sequences({0: [1, 2, 3], 1: [4, 5]}))
    blob = _swap_first_seq_id(src.state_write())
    dst = make_cache(dev, size=8, unified=False)
    run(dst, Batch.for_sequences({0: [9, 9], 1: [8]}))
    before = [c.clone() for c in dst.cells]
    k_before = dst.k[0].numpy()
    with pytest.raises(StateError) as err:
        dst.state_read(blob)
    assert "seq_id" in err.value.field
    assert all(a.same_as(b) for a, b in zip(before, dst.cells, strict=True))
    assert np.array_equal(dst.k[0].numpy(), k_before)
    # the unpatched blob restores fine: the refusal is about the sequence id alone
    dst.state_read(src.state_write())
    assert held(dst, 0) == held(src, 0) and held(dst, 1) == held(src, 1)


# -- item 10: a per-sequence restore never takes a shared cell ------------------------------------


def test_per_sequence_restore_leaves_cells_shared_with_another_sequence(dev):
    """Sequence 0 shares its cells with 1 (seq_cp); restoring a per-sequence
    blob into 0 must place 0 in cells nobody else holds: 1 keeps its cells
    and its K/V rows bit for bit."""
    cache = make_cache(dev, size=8)
    run(cache, Batch.for_sequences({0: [1, 2, 3]}))
    blob = cache.state_write(0)
    run(cache, Batch.for_sequences({0: [4]}))
    cache.seq_cp(0, 1)
    keep = held(cache, 1)
    cells_1 = {c for _, c in cache.cells[0].seq_cells(1)}
    cache.state_read(blob, 0)
    assert held(cache, 1) == keep
    assert held(cache, 0) == [(0, 1), (1, 2), (2, 3)]
    assert not cells_1 & {c for _, c in cache.cells[0].seq_cells(0)}
    cache.cells[0].check()
