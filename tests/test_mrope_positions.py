"""M-RoPE positions end to end (spec §5.1 cell extension, §5.5 2-D tie-break,
§6.1/§6.2 ``n_pos`` = 4 section-major positions).

A batch may carry positions ``[4, n]``: section 0 the temporal position (used
wherever a 1-D position is), sections 1 and 2 the token's ``y`` and ``x``,
section 3 unused by the memory.  As upstream's ``apply_ubatch``, a KV cell
stores ``ext = (x, y) = (pos[2], pos[1])``, and the causal mask hides a cell at
the token's own temporal position when the cell is later in ``(y, x)`` order.

The expected masks here are computed from the test's own token table (which
token the cache put in which cell), never from the cell book under test.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import statecache
from statecache.batch import Batch, BatchAllocator, UBatch
from statecache.errors import ArgumentError, BatchError, StateError
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.kv_cells import KVCells
from statecache.memory import MemoryStatus

E = 4  # K/V row width of the test layers


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def make_cache(dev, *, size=48, n_seq_max=2, unified=True) -> KVCache:
    cache = KVCache(dev, [KVLayer(0, E, E)], size=size, n_seq_max=n_seq_max, unified=unified, dtype="f32", n_pad=8)
    cache.fill_garbage(3)
    return cache


def image_prompt(t0: int, h: int, w: int, n_text_before: int = 2, n_text_after: int = 2) -> np.ndarray:
    """Qwen2-VL style positions ``[4, n]`` of text, an ``h x w`` image, text: text tokens
    have every section equal to their position; the image's patches all sit at the
    temporal position ``t0 + n_text_before`` with ``y``/``x`` = that plus row/column;
    the text after it continues at ``t_img + max(h, w)``."""
    cols = [(t0 + k, t0 + k, t0 + k) for k in range(n_text_before)]
    t_img = t0 + n_text_before
    cols += [(t_img, t_img + r, t_img + c) for r in range(h) for c in range(w)]
    t_after = t_img + max(h, w)
    cols += [(t_after + k, t_after + k, t_after + k) for k in range(n_text_after)]
    t, y, x = (np.asarray(v, dtype=np.int64) for v in zip(*cols, strict=True))
    return np.stack([t, y, x, np.zeros_like(t)])


def later_2d(cell: tuple[int, int, int], tok: tuple[int, int, int]) -> bool:
    """Straightforward causal rule on (t, y, x): the cell is in the token's future."""
    ct, cy, cx = cell
    tt, ty, tx = tok
    if ct != tt:
        return ct > tt
    return (cy, cx) > (ty, tx)


def run(cache, batch: Batch, n_ubatch: int, table: dict | None = None):
    """Apply every ubatch of ``batch``; returns [(ubatch, mask, expected mask)].

    ``table[(stream, cell)] = (seqs, (t, y, x))`` is the test's own record of
    what each cell holds (from the batch's positions and the slot the cache
    chose), from which the expected mask is built."""
    table = {} if table is None else table
    balloc = BatchAllocator(cache.n_seq_max)
    balloc.init(batch, cache)
    ctx = cache.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS
    pos = np.asarray(batch.pos)
    out = []
    while True:
        assert ctx.apply()
        ub = ctx.get_ubatch()
        sinfo = ctx.sinfo
        rng = np.random.default_rng(ub.n_tokens)
        ctx.cpy_k(0, rng.standard_normal((ub.n_tokens, E)).astype(np.float32))
        ctx.cpy_v(0, rng.standard_normal((ub.n_tokens, E)).astype(np.float32))
        toks = []
        for i, b in enumerate(ub.token_idx.tolist()):
            tyx = (int(pos[0, b]), int(pos[1, b]), int(pos[2, b])) if pos.ndim == 2 else (int(pos[b]),) * 3
            table[(int(sinfo.streams[i]), int(sinfo.cells[i]))] = (set(ub.seq_id[i]), tyx)
            toks.append(tyx)
        mask = ctx.mask()
        want = np.full(mask.shape, -np.inf, dtype=np.float32)
        for i, tyx in enumerate(toks):
            s, strm = int(ub.primary[i]), int(sinfo.streams[i])
            for j in range(mask.shape[1]):
                held = table.get((strm, j))
                if held is not None and s in held[0] and not later_2d(held[1], tyx):
                    want[i, j] = 0.0
        out.append((ub, mask, want))
        if not ctx.next():
            break
    return out


# -- batch validation ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((3, 5), dtype=np.int32),  # 3 sections
        np.zeros((4, 6), dtype=np.int32),  # one entry too many per section
        np.zeros((5, 4), dtype=np.int32),  # token-major
        np.zeros((4, 5, 1), dtype=np.int32),  # 3-D
        np.zeros(6, dtype=np.int32),  # 1-D of the wrong length
        np.zeros((4, 5), dtype=np.float32),  # not integers
        np.zeros(5, dtype=bool),
        [[0, 1, 2, 3, 4], [0, 1]],  # ragged
    ],
)
def test_bad_pos_shapes_are_refused_and_change_nothing(dev, bad):
    cache = make_cache(dev)
    run(cache, Batch(tokens=[1, 2, 3], pos=image_prompt(0, 1, 1, 2, 0)), 8)
    before = cache.cells[0].clone()
    bad_copy = [list(r) for r in bad] if isinstance(bad, list) else bad.copy()
    balloc = BatchAllocator(2)
    with pytest.raises(ArgumentError) as ei:
        balloc.init(Batch(tokens=[5, 6, 7, 8, 9], pos=bad), cache)
    assert ei.value.argument == "pos"
    assert isinstance(ei.value, BatchError) and ei.value.rule == "pos"  # as a bad 1-D pos always was
    assert balloc.n_tokens == 0 and balloc.pos_sections is None
    assert cache.cells[0].same_as(before)
    if isinstance(bad, list):
        assert bad == bad_copy
    else:
        np.testing.assert_array_equal(bad, bad_copy)


def test_mrope_pos_accepted_and_section0_is_the_position():
    pos = image_prompt(0, 2, 3)
    pos_in = pos.copy()
    balloc = BatchAllocator(1)
    balloc.init(Batch(tokens=np.arange(pos.shape[1]), pos=pos), None)
    np.testing.assert_array_equal(balloc.pos, pos[0])
    np.testing.assert_array_equal(balloc.pos_sections, pos)
    np.testing.assert_array_equal(pos, pos_in)  # the caller's array is not touched
    assert balloc.pos_sections is not pos
    # auto-filled positions stay 1-D
    balloc.init(Batch(tokens=[1, 2, 3]), None)
    assert balloc.pos_sections is None
    ub = balloc.split_simple(8)
    assert ub.n_pos == 1 and ub.pos_sections is None and ub.pos_ext is None and not ub.is_pos_2d


@pytest.mark.parametrize(
    ("pos", "embd", "mem", "rule", "token", "seq"),
    [
        # tokens must start strictly after what the memory holds (M-RoPE: jumps allowed)
        ([[5, 6], [5, 6], [5, 6], [0, 0]], False, {0: 5}, "pos_start", 0, 0),
        ([[2, 3], [2, 3], [2, 3], [0, 0]], True, {0: 5}, "pos_start", 0, 0),
        # temporal positions must not decrease within a sequence
        ([[7, 6], [7, 6], [7, 6], [0, 0]], False, {0: 5}, "pos_order", 1, 0),
        # temporal section negative
        ([[-1, 0], [0, 0], [0, 0], [0, 0]], False, {}, "pos_negative", 0, None),
    ],
)
def test_mrope_position_rules_use_section0(pos, embd, mem, rule, token, seq):
    class Mem:
        def seq_pos_min(self, s):
            return mem.get(s, -1)

        def seq_pos_max(self, s):
            return mem.get(s, -1)

    payload = dict(embd=np.zeros((2, 3), dtype=np.float32)) if embd else dict(tokens=[1, 2])
    balloc = BatchAllocator(2)
    with pytest.raises(BatchError) as ei:
        balloc.init(Batch(pos=np.asarray(pos), **payload), Mem())
    assert (ei.value.rule, ei.value.token, ei.value.seq) == (rule, token, seq)
    assert balloc.n_tokens == 0


def test_mrope_position_rules_accept_jumps_repeats_and_embeddings_at_the_tail():
    class Mem:
        def seq_pos_min(self, s):
            return 0 if s in (0, 1) else -1

        def seq_pos_max(self, s):
            return 5 if s in (0, 1) else -1

    balloc = BatchAllocator(2)
    # a jump past the tail, then a repeated temporal position (an image grid)
    balloc.init(Batch(tokens=[1, 2, 3], pos=[[9, 9, 9], [9, 9, 10], [9, 10, 9], [0, 0, 0]]), Mem())
    # embeddings may continue at the memory's last position
    balloc.init(Batch(embd=np.zeros((2, 3), dtype=np.float32), pos=[[5, 5], [5, 6], [6, 5], [0, 0]]), Mem())
    # coupled sequences: the rules apply to section 0 of every member
    balloc.init(Batch(tokens=[1, 2], seq_ids=[(0, 1), (0, 1)], pos=[[6, 6], [6, 7], [7, 6], [0, 0]]), Mem())
    assert balloc.has_coupled and balloc.pos.tolist() == [6, 6]


# -- splitters ---------------------------------------------------------------------


def tagged_batch(seq_ids, coupled=False) -> tuple[Batch, np.ndarray]:
    """Positions whose sections identify the token: y = 1000 + i, x = 2000 + i,
    section 3 = 3000 + i; temporal positions count per sequence (primary id)."""
    n = len(seq_ids)
    t = np.zeros(n, dtype=np.int64)
    seen: dict[int, int] = {}
    for i, ids in enumerate(seq_ids):
        s = ids[0] if isinstance(ids, tuple) else ids
        t[i] = seen.get(s, 0)
        for q in ids if isinstance(ids, tuple) else (ids,):
            seen[q] = int(t[i]) + 1
    idx = np.arange(n)
    pos = np.stack([t, 1000 + idx, 2000 + idx, 3000 + idx])
    return Batch(tokens=np.arange(n) + 100, pos=pos, seq_ids=list(seq_ids), output=np.ones(n, dtype=bool)), pos


def check_aligned(ub: UBatch, pos: np.ndarray) -> None:
    b = ub.token_idx
    assert ub.n_pos == 4 and ub.is_pos_2d
    assert ub.pos_sections.shape == (4, ub.n_tokens)
    np.testing.assert_array_equal(ub.pos_sections, pos[:, b])
    np.testing.assert_array_equal(ub.pos, pos[0, b])
    np.testing.assert_array_equal(ub.pos_ext, np.stack([pos[2, b], pos[1, b]], axis=1))
    np.testing.assert_array_equal(ub.token, np.asarray(b) + 100)


@pytest.mark.parametrize("n_ubatch", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("split", ["simple", "equal", "equal_seq", "seq"])
def test_splitters_keep_sections_aligned_with_tokens(split, n_ubatch):
    seqs = [0, 1, 0, 2, 1, 0, 2, 2, 1, 0, 0, 3]
    batch, pos = tagged_batch(seqs)
    balloc = BatchAllocator(4)
    balloc.init(batch, None)
    fn = {
        "simple": lambda: balloc.split_simple(n_ubatch),
        "equal": lambda: balloc.split_equal(n_ubatch),
        "equal_seq": lambda: balloc.split_equal(n_ubatch, True),
        "seq": lambda: balloc.split_seq(n_ubatch),
    }[split]
    seen = []
    while True:
        ub = fn()
        if ub.n_tokens == 0:
            break
        check_aligned(ub, pos)
        seen.extend(ub.token_idx.tolist())
    assert sorted(seen) == list(range(len(seqs)))


@pytest.mark.parametrize("split", ["equal", "seq"])
def test_splitters_keep_sections_aligned_with_coupled_tokens(split):
    batch, pos = tagged_batch([(0, 1), (0, 1), 0, 1, 0, 2])
    balloc = BatchAllocator(3)
    balloc.init(batch, None)
    seen = []
    while True:
        ub = balloc.split_equal(2) if split == "equal" else balloc.split_seq(2)
        if ub.n_tokens == 0:
            break
        check_aligned(ub, pos)
        seen.extend(ub.token_idx.tolist())
    assert sorted(seen) == list(range(6))


def test_reserve_carries_sections():
    ext = np.array([[7, 8], [9, 10], [11, 12], [13, 14]])
    ub = UBatch.reserve(2, [(0, 4), (1, 9)], pos_ext=ext)
    assert ub.pos.tolist() == [3, 4, 8, 9]
    np.testing.assert_array_equal(ub.pos_sections, [[3, 4, 8, 9], [8, 10, 12, 14], [7, 9, 11, 13], [0, 0, 0, 0]])
    np.testing.assert_array_equal(ub.pos_ext, ext)
    assert UBatch.reserve(2, [(0, 4)]).pos_sections is None
    with pytest.raises(ArgumentError, match="pos_ext"):
        UBatch.reserve(2, [(0, 4)], pos_ext=np.zeros((3, 2), dtype=int))


# -- cells and mask ------------------------------------------------------------------


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_ubatch", [3, 64])
def test_cells_get_the_tokens_x_y(dev, unified, n_ubatch):
    cache = make_cache(dev, unified=unified)
    pos = image_prompt(0, 2, 3)
    n = pos.shape[1]
    pos2 = pos + np.array([[0], [50], [60], [0]])  # a different grid for sequence 1
    both = np.concatenate([pos, pos2], axis=1)
    run(cache, Batch(tokens=np.arange(2 * n), pos=both, seq_ids=[0] * n + [1] * n), n_ubatch)
    for s, p in ((0, pos), (1, pos2)):
        cells = cache.cells[cache.stream_of(s)]
        got = sorted((int(cells.pos[c]), int(cells.ext[c, 0]), int(cells.ext[c, 1])) for _, c in cells.seq_cells(s))
        assert got == sorted(zip(p[0].tolist(), p[2].tolist(), p[1].tolist(), strict=True))
        cells.check()


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_ubatch", [1, 4, 64])
def test_mask_image_grid_hides_exactly_the_later_patches(dev, unified, n_ubatch):
    cache = make_cache(dev, unified=unified)
    h, w = 3, 3
    pos = image_prompt(0, h, w)
    n = pos.shape[1]
    seqs = [0] * n + [1] * n  # two sequences with the same grid: each sees only its own cells
    ubs = run(cache, Batch(tokens=np.arange(2 * n), pos=np.concatenate([pos, pos], axis=1), seq_ids=seqs), n_ubatch)
    for _, mask, want in ubs:
        np.testing.assert_array_equal(mask, want)
    # and by hand: the middle patch (row 1, column 1) sees the text before and
    # the patches up to itself in raster order, and none after it
    table: dict = {}
    cache2 = make_cache(dev, unified=unified)
    ubs = run(cache2, Batch(tokens=np.arange(n), pos=pos), n_ubatch, table)
    mid = 2 + 1 * w + 1
    for ub, mask, _ in ubs:
        where = np.flatnonzero(ub.token_idx == mid)
        if not where.size:
            continue
        row = mask[int(where[0])]
        vis = {table[(0, j)][1] for j in np.flatnonzero(np.isfinite(row))}
        grid = {(2, 2 + r, 2 + c) for r in range(h) for c in range(w)}
        assert vis & grid == {(2, 2, 2), (2, 2, 3), (2, 2, 4), (2, 3, 2), (2, 3, 3)}
        assert {(0, 0, 0), (1, 1, 1)} <= vis
        assert all(t <= 2 for t, _, _ in vis)


def test_mask_continues_across_batches_and_text_after_sees_the_whole_image(dev):
    cache = make_cache(dev)
    table: dict = {}
    pos = image_prompt(0, 2, 2, n_text_after=0)
    run(cache, Batch(tokens=np.arange(pos.shape[1]), pos=pos), 2, table)
    # a second image at the next temporal position, then text; the memory holds up to t = 2
    nxt = image_prompt(3, 2, 2, n_text_before=0, n_text_after=2)
    for _, mask, want in run(cache, Batch(tokens=np.arange(nxt.shape[1]), pos=nxt), 3, table):
        np.testing.assert_array_equal(mask, want)
    # the text after the second image sees every cell
    _, mask, _ = run(cache, Batch(tokens=[1], pos=[[9], [9], [9], [0]]), 1, table)[0]
    assert np.isfinite(mask[0]).sum() == len(table)


def test_one_d_batch_after_an_image_ignores_the_extension(dev):
    """Upstream compares 2-D positions only for a ubatch that carries them."""
    cache = make_cache(dev)
    run(cache, Batch(tokens=np.arange(6), pos=image_prompt(0, 2, 2, 2, 0)), 8)  # t = 0, 1, 2, 2, 2, 2
    cells = cache.cells[0]
    ub = UBatch.reserve(1, [(0, 2)])  # a 1-D token at the image's temporal position
    mask = cache.mask(ub)
    assert np.isfinite(mask[0]).sum() == 6  # every image cell at t = 2 is visible
    ub2 = UBatch.reserve(1, [(0, 2)], pos_ext=[[2, 2]])  # the same token as the first patch (y, x) = (2, 2)
    row = cache.mask(ub2)[0]
    expect = [
        not later_2d((int(cells.pos[j]), int(cells.ext[j, 1]), int(cells.ext[j, 0])), (2, 2, 2)) for j in range(6)
    ]
    assert np.isfinite(row[:6]).tolist() == expect and expect.count(True) == 3


# -- copies, shifts, state --------------------------------------------------------------


def book(cache: KVCache, seq: int) -> list[tuple[int, int, int]]:
    cells = cache.cells[cache.stream_of(seq)]
    return sorted((int(cells.pos[c]), int(cells.ext[c, 0]), int(cells.ext[c, 1])) for _, c in cells.seq_cells(seq))


def test_cross_stream_copy_keeps_ext_and_shift_moves_only_pos(dev):
    cache = make_cache(dev, unified=False)
    pos = image_prompt(0, 2, 2)
    run(cache, Batch(tokens=np.arange(pos.shape[1]), pos=pos), 8)
    src = book(cache, 0)
    assert any(x != p or y != p for p, x, y in src)
    cache.seq_cp(0, 1)
    assert book(cache, 1) == src
    cache.init_update().apply()
    cache.seq_add(1, 0, -1, 3)  # context shift: pos moves, (x, y) stays (upstream's pos_add)
    assert book(cache, 1) == sorted((p + 3, x, y) for p, x, y in src)
    cache.seq_cp(1, 0)  # a copy with a pending shift keeps the extension too
    assert book(cache, 0) == book(cache, 1)
    c = KVCells(4, 1)
    c.pos_set(0, 5, (7, 9))
    c.seq_add(0, 0)
    c.pos_div(0, 2)
    assert c.pos_get(0) == 2 and tuple(c.ext[0]) == (7, 9)


@pytest.mark.parametrize("unified", [True, False])
def test_state_round_trip_keeps_ext(dev, unified):
    src = make_cache(dev, unified=unified)
    pos = image_prompt(0, 3, 2)
    n = pos.shape[1]
    pos1 = pos + np.array([[0], [100], [200], [0]])
    run(src, Batch(tokens=np.arange(2 * n), pos=np.concatenate([pos, pos1], axis=1), seq_ids=[0] * n + [1] * n), 4)
    # whole cache
    dst = make_cache(dev, unified=unified)
    dst.state_read(src.state_write())
    for s in (0, 1):
        assert book(dst, s) == book(src, s)
    # one sequence, into a fragmented destination, under another id
    dst = make_cache(dev, size=24, unified=unified)
    run(dst, Batch(tokens=np.arange(10), pos=np.tile(np.arange(10), (4, 1))), 8)
    dst.seq_rm(0, 1, 3)
    dst.seq_rm(0, 5, 6)
    dst.state_read(src.state_write(1), 1)
    assert book(dst, 1) == book(src, 1)
    for c in dst.cells:
        c.check()
    # the restored image still masks in raster order
    table = {}
    dst2 = make_cache(dev, unified=unified)
    dst2.state_read(src.state_write(0), 0)
    cells = dst2.cells[dst2.stream_of(0)]
    ub = UBatch.reserve(1, [(0, 2)], pos_ext=[[3, 3]])  # the patch at (y, x) = (3, 3) of the t = 2 grid
    row = dst2.mask(ub)[0]
    for j in range(row.size):
        if cells.pos[j] >= 0:
            table[j] = (int(cells.pos[j]), int(cells.ext[j, 1]), int(cells.ext[j, 0]))
    assert [np.isfinite(row[j]) for j in sorted(table)] == [not later_2d(table[j], (2, 3, 3)) for j in sorted(table)]
    assert sum(np.isfinite(row)) == 2 + 4  # text 0, 1 and patches (2,2), (2,3), (3,2), (3,3)


def test_state_layout_of_one_d_cells_unchanged_and_ext_flagged(dev):
    """A cache without 2-D positions writes the version-1 layout (no flag, no
    extension); an M-RoPE cache flags the stream and appends (x, y) per cell."""
    h = 28  # blob header (12 bytes) and section header (tag, length, crc32: 16 bytes, format version 2)
    plain = make_cache(dev)
    run(plain, Batch(tokens=[1, 2, 3], pos=[0, 1, 2]), 8)
    blob = plain.state_write(0)
    assert struct.unpack_from("<I", blob, h + 4)[0] == 3  # no flag
    assert struct.unpack_from("<iIi", blob, h + 8) == (0, 1, 0)  # pos, n_seq_id, seq_id; no ext
    assert struct.unpack_from("<iIi", blob, h + 20) == (1, 1, 0)
    # text-only M-RoPE positions (every section equal) are the same bytes
    text = make_cache(dev)
    run(text, Batch(tokens=[1, 2, 3], pos=np.tile([0, 1, 2], (4, 1)) * [[1], [1], [1], [0]]), 8)
    assert text.state_write(0) == blob
    img = make_cache(dev)
    run(img, Batch(tokens=[1, 2, 3], pos=[[0, 1, 1], [0, 1, 1], [0, 1, 2], [0, 0, 0]]), 8)
    blob2 = img.state_write(0)
    assert struct.unpack_from("<I", blob2, h + 4)[0] == 3 | (1 << 31)
    assert struct.unpack_from("<iIiii", blob2, h + 8 + 2 * 20) == (1, 1, 0, 2, 1)  # pos 1, seq 0, x 2, y 1


def test_corrupt_ext_blob_is_refused_and_changes_nothing(dev):
    src = make_cache(dev)
    run(src, Batch(tokens=[1, 2, 3], pos=[[0, 1, 1], [0, 1, 1], [0, 1, 2], [0, 0, 0]]), 8)
    blob = src.state_write(0)
    # clear the flag: the reader then misreads (x, y) as the next cell and refuses the blob
    bad = bytearray(blob)
    bad[24 + 4 : 24 + 8] = struct.pack("<I", 3)
    dst = make_cache(dev)
    run(dst, Batch(tokens=[4, 5], pos=[[0, 1], [0, 1], [0, 0], [0, 0]]), 8)
    before = dst.cells[0].clone()
    for b in (bytes(bad), blob[:-3]):
        with pytest.raises(StateError):
            dst.state_read(b, 0)
        assert dst.cells[0].same_as(before)


def test_iswa_pair_both_caches_get_ext(dev):
    mem = KVCacheISWA(
        dev, [KVLayer(0, E, E), KVLayer(1, E, E)], [1], size=32, n_seq_max=1, n_ubatch=4, n_swa=4, dtype="f32", n_pad=8
    )
    pos = image_prompt(0, 2, 2, 1, 0)
    balloc = BatchAllocator(1)
    balloc.init(Batch(tokens=np.arange(pos.shape[1]), pos=pos), mem)
    ctx = mem.init_batch(balloc, 8)
    assert ctx.apply()
    want = sorted(zip(pos[0].tolist(), pos[2].tolist(), pos[1].tolist(), strict=True))
    assert book(mem.base, 0) == want and book(mem.swa, 0) == want


# -- recurrent state: snapshot planes are labelled by position ------------------------------


def test_recurrent_rollback_inside_an_image_ubatch_is_refused(dev) -> None:
    """Plane j of a write holds the state after all but j tokens, which is "the
    state after position snap_end - j" only when the ubatch has one token per
    position.  An image shares one temporal position over its patches, so a
    rollback into that ubatch must be refused (the plane it would pick holds
    the state after the wrong number of tokens), changing nothing."""
    from statecache.spec import MemorySpec, RecurrentLayerSpec, make_memory

    layer = RecurrentLayerSpec.mamba2(d_inner=8, d_state=4, d_conv=4, n_group=1, head_dim=4)
    mem = make_memory(MemorySpec.build(1, {0: layer}), dev, n_seq_max=1, n_rs_seq=3)
    pos = image_prompt(0, 1, 3, n_text_before=2, n_text_after=0)  # temporal 0 1 2 2 2
    balloc = BatchAllocator(1)
    balloc.init(Batch(tokens=np.arange(5, dtype=np.int32), pos=pos, seq_ids=[0] * 5), mem)
    ctx = mem.init_batch(balloc, n_ubatch=8)
    assert ctx.status is MemoryStatus.SUCCESS
    assert ctx.apply()
    assert ctx.get_ubatch().n_seq_tokens == 5  # one write of five tokens
    assert not ctx.next()
    book = mem.book_snapshot()
    assert not mem.seq_rm(0, 2, -1)  # "keep positions 0..1" = the state after 2 of the 5 tokens
    assert mem.book_snapshot().same(book)
    assert mem.seq_pos_max(0) == 2


def test_recurrent_decode_after_an_image_jump_is_silent_and_keeps_planes(dev) -> None:
    """Text after an image continues at t_img + max(h, w): a jump the 1-D rules
    would warn about is normal for M-RoPE.  Planes are labelled by position, so
    a rollback across the jump is refused (nothing changed) while a one-token
    step after it is still exactly undoable."""
    import warnings

    from statecache.spec import MemorySpec, RecurrentLayerSpec, make_memory

    layer = RecurrentLayerSpec.mamba2(d_inner=8, d_state=4, d_conv=4, n_group=1, head_dim=4)
    mem = make_memory(MemorySpec.build(1, {0: layer}), dev, n_seq_max=1, n_rs_seq=3)
    pos = image_prompt(0, 2, 2, n_text_before=1, n_text_after=2)  # temporal 0 1 1 1 1 3 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cols in (slice(0, 5), slice(5, 6), slice(6, 7)):
            balloc = BatchAllocator(1)
            n = pos[:, cols].shape[1]
            balloc.init(Batch(tokens=np.arange(n, dtype=np.int32), pos=pos[:, cols], seq_ids=[0] * n), mem)
            ctx = mem.init_batch(balloc, n_ubatch=8)
            assert ctx.apply()
            assert not ctx.next()
    assert mem.seq_pos_max(0) == 4
    book = mem.book_snapshot()
    assert not mem.seq_rm(0, 2, -1)  # "after position 1" lies before the jump 1 -> 3
    assert mem.book_snapshot().same(book)
    assert mem.seq_rm(0, 4, -1)  # the last text token: plane 1 is the state after position 3
    assert mem.seq_pos_max(0) == 3
