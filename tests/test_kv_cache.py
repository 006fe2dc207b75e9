"""KV cell book, mask and KV cache (spec §5, §10 items 50-54) on the reference
device with garbage-filled buffers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError, StateError
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer, iswa_sizes
from statecache.kv_cells import KVCells
from statecache.kv_mask import SWAType, build_mask, is_masked_swa, n_kv_for
from statecache.memory import MemoryStatus, StateFlags

E = 8  # K and V row width of the test layers


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def emb(token: int, salt: int) -> np.ndarray:
    return np.random.default_rng(token * 7919 + salt).standard_normal(E).astype(np.float32)


def make_cache(dev, *, size=32, n_seq_max=4, unified=True, swa=SWAType.NONE, n_swa=0, k_shift=None, n_layers=2):
    cache = KVCache(
        dev,
        [KVLayer(il, E, E) for il in range(n_layers)],
        size=size,
        n_seq_max=n_seq_max,
        unified=unified,
        dtype="f32",
        swa_type=swa,
        n_swa=n_swa,
        n_pad=8,
        k_shift=k_shift,
    )
    cache.fill_garbage(11)
    return cache


def decode(mem, tokens_by_seq, n_ubatch=8, attend=None):
    """Run one batch; write K/V from token embeddings; return attention outputs by (seq, pos)."""
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), mem)
    ctx = mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS, getattr(ctx, "reason", "")
    out = {}
    while True:
        assert ctx.apply()
        ub = ctx.get_ubatch()
        toks = ub.token
        for il in range(len(mem.layers)):
            ctx.cpy_k(il, np.stack([emb(int(t), 1 + il) for t in toks]))
            ctx.cpy_v(il, np.stack([emb(int(t), 100 + il) for t in toks]))
        mask = ctx.mask()
        kbuf = mem.k[0].numpy()
        vbuf = mem.v[0].numpy()
        for i in range(ub.n_tokens):
            strm = mem.stream_of(int(ub.primary[i]))
            n_kv = mask.shape[1]
            k = kbuf[strm * mem.size : strm * mem.size + n_kv]
            v = vbuf[strm * mem.size : strm * mem.size + n_kv]
            out[(int(ub.primary[i]), int(ub.pos[i]))] = attention(emb(int(toks[i]), 50), k, v, mask[i])
        if not ctx.next():
            break
    return out


def attention(q, k, v, bias):
    vis = np.isfinite(bias)
    s = (k[vis] @ q) + bias[vis]
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v[vis]


def expected(history, q_token):
    """Full recompute over the visible history [(pos, token)]."""
    k = np.stack([emb(t, 1) for _, t in history])
    v = np.stack([emb(t, 100) for _, t in history])
    return attention(emb(q_token, 50), k, v, np.zeros(len(history), dtype=np.float32))


# -- cells --------------------------------------------------------------------------


def test_cells_ordered_positions_and_shift():
    c = KVCells(8, 2)
    for i, p in enumerate([3, 1, 2]):
        c.pos_set(i, p)
        c.seq_add(i, 0)
    assert (c.seq_pos_min(0), c.seq_pos_max(0)) == (1, 3)
    assert c.pos_add(1, -5) is True  # pushed below 0: cell emptied
    assert c.is_empty(1) and c.used == 2 and c.has_shift
    c.pos_div(0, 2)
    assert c.pos_get(0) == 1 and c.shift[0] == -2
    c.check()
    assert c.seq_pos_min(1) == -1


# -- mask (item 54) ---------------------------------------------------------------


def naive_visible(cell_pos, cell_seqs, cell_ext, p1, s, ext1, swa, n_swa, causal=True):
    if cell_pos < 0 or s not in cell_seqs:
        return False
    if causal and (cell_pos > p1 or (cell_pos == p1 and (cell_ext[1], cell_ext[0]) > (ext1[1], ext1[0]))):
        return False
    if swa is SWAType.STANDARD and p1 - cell_pos >= n_swa:
        return False
    if swa is SWAType.CHUNKED and cell_pos < (p1 // n_swa) * n_swa:
        return False
    if swa is SWAType.SYMMETRIC and abs(p1 - cell_pos) > n_swa // 2:
        return False
    return True


@pytest.mark.parametrize("swa", list(SWAType))
@pytest.mark.parametrize("causal", [True, False])
def test_mask_matches_naive_rules(swa, causal):
    rng = np.random.default_rng(5)
    c = KVCells(24, 3)
    for i in range(20):
        if rng.random() < 0.2:
            continue
        c.pos_set(i, int(rng.integers(0, 12)), (int(rng.integers(0, 3)), int(rng.integers(0, 3))))
        for s in range(3):
            if rng.random() < 0.5 or s == 2:
                c.seq_add(i, s)
    n_swa = 4
    tok_pos = rng.integers(0, 14, size=9)
    tok_seq = rng.integers(0, 3, size=9)
    tok_ext = rng.integers(0, 3, size=(9, 2))
    m = build_mask(c, tok_pos, tok_seq, 24, causal=causal, swa_type=swa, n_swa=n_swa, token_ext=tok_ext, alibi=True)
    for i, j in itertools.product(range(9), range(24)):
        vis = naive_visible(
            int(c.pos[j]), c.seqs_of(j) if c.pos[j] >= 0 else [], c.ext[j], int(tok_pos[i]), int(tok_seq[i]),
            tok_ext[i], swa, n_swa, causal,
        )  # fmt: skip
        if vis:
            assert m[i, j] == -abs(int(c.pos[j]) - int(tok_pos[i]))
        else:
            assert m[i, j] == -np.inf


def test_mask_swa_types_by_hand():
    assert is_masked_swa(4, SWAType.STANDARD, 1, 5) and not is_masked_swa(4, SWAType.STANDARD, 2, 5)
    assert is_masked_swa(4, SWAType.CHUNKED, 3, 4) and not is_masked_swa(4, SWAType.CHUNKED, 4, 7)
    assert is_masked_swa(4, SWAType.SYMMETRIC, 8, 5) and not is_masked_swa(4, SWAType.SYMMETRIC, 7, 5)
    assert not is_masked_swa(4, SWAType.NONE, 0, 1000)
    assert n_kv_for(0, 100, 8) == 8 and n_kv_for(9, 100, 8) == 16 and n_kv_for(99, 100, 8) == 100


def test_mask_rejects_bad_args():
    c = KVCells(4, 1)
    with pytest.raises(ArgumentError, match="n_swa"):
        build_mask(c, [0], [0], 4, swa_type="standard", n_swa=0)
    with pytest.raises(ArgumentError, match="token_seq"):
        build_mask(c, [0], [3], 4)


# -- cache -------------------------------------------------------------------------


@pytest.mark.parametrize("unified", [True, False])
def test_decode_matches_full_recompute_and_isolates_sequences(dev, unified):
    cache = make_cache(dev, unified=unified)
    hist = {0: [], 1: []}
    rng = np.random.default_rng(1)
    for step in range(4):
        toks = {s: rng.integers(0, 1000, size=int(rng.integers(1, 5))).tolist() for s in (0, 1)}
        out = decode(cache, toks, n_ubatch=5)
        for s, ts in toks.items():
            for t in ts:
                p = len(hist[s])
                hist[s].append((p, t))
                np.testing.assert_allclose(out[(s, p)], expected(hist[s], t), rtol=1e-5, atol=1e-6)
        del step
    for c in cache.cells:
        c.check()


def test_init_batch_is_a_dry_run_and_fails_cleanly(dev):
    cache = make_cache(dev, size=8)
    decode(cache, {0: [1, 2, 3]})
    before = [c.clone() for c in cache.cells], list(cache.book.heads)
    balloc = BatchAllocator(4)
    balloc.init(Batch.for_sequences({0: [4, 5]}), cache)
    ctx = cache.init_batch(balloc, 8)
    assert ctx.status is MemoryStatus.SUCCESS
    assert all(a.same_as(b) for a, b in zip(before[0], cache.cells)) and before[1] == cache.book.heads
    balloc.init(Batch.for_sequences({1: list(range(6))}), cache)
    ctx = cache.init_batch(balloc, 8)
    assert ctx.status is MemoryStatus.FAILED_PREPARE
    assert all(a.same_as(b) for a, b in zip(before[0], cache.cells))


def test_swa_reuse_keeps_every_position_between_min_and_max(dev):
    """Item 50: after SWA overwrites, each sequence still holds a gap-free range."""
    cache = make_cache(dev, size=8, n_seq_max=2, swa=SWAType.STANDARD, n_swa=3)
    hist = []
    for step in range(12):
        t = 10 + step
        out = decode(cache, {0: [t]})
        hist.append((step, t))
        window = [(p, tt) for p, tt in hist if step - p < 3]
        np.testing.assert_allclose(out[(0, step)], expected(window, t), rtol=1e-5, atol=1e-6)
        held = sorted(p for p, _ in cache.cells[0].seq_pos[0])
        assert held == list(range(held[0], held[-1] + 1))
        cache.cells[0].check()
    # a 3-token ubatch in a window of 3 over 8 cells keeps working
    out = decode(cache, {0: [1, 2, 3]})
    held = sorted(p for p, _ in cache.cells[0].seq_pos[0])
    assert held == list(range(held[0], held[-1] + 1)) and held[-1] == 14


def test_seq_rm_always_true_and_seq_add_below_zero_removes(dev):
    """Item 51."""
    cache = make_cache(dev)
    decode(cache, {0: list(range(6)), 1: [7, 8]})
    assert cache.seq_rm(0, 2, 4) is True
    assert [p for p, _ in cache.cells[0].seq_pos[0]] == [0, 1, 4, 5]
    cache.seq_add(0, 4, -1, -3)  # positions 4, 5 -> 1, 2; 0 and 1 untouched
    assert [p for p, _ in cache.cells[0].seq_pos[0]] == [0, 1, 1, 2]
    used = cache.cells[0].used
    cache.seq_add(0, 0, 2, -1)  # 0 -> -1 (cell removed), both 1 -> 0
    assert [p for p, _ in cache.cells[0].seq_pos[0]] == [0, 0, 2]
    assert cache.cells[0].used == used - 1
    assert cache.seq_pos_max(1) == 1
    cache.cells[0].check()


def test_pending_shifts_are_handed_out_once_and_cleared(dev):
    """Item 51: shifts reach the runtime's RoPE hook exactly once, then clear."""
    calls = []
    cache = make_cache(dev, k_shift=lambda c, il, buf, rows, sh: calls.append((il, rows.tolist(), sh.tolist())))
    decode(cache, {0: [1, 2, 3, 4]})
    assert cache.init_update().status is MemoryStatus.NO_UPDATE
    cache.seq_add(0, 2, -1, 5)
    cache.seq_add(0, 7, -1, 1)
    ctx = cache.init_update()
    assert ctx.status is MemoryStatus.SUCCESS
    rows = sorted(idx for p, idx in cache.cells[0].seq_pos[0] if p >= 7)
    assert ctx.shift_rows.tolist() == rows and ctx.shift_amounts.tolist() == [6, 6]
    assert ctx.apply()
    assert calls == [(0, rows, [6, 6]), (1, rows, [6, 6])]
    assert cache.init_update().status is MemoryStatus.NO_UPDATE
    assert [p for p, _ in cache.cells[0].seq_pos[0]] == [0, 1, 8, 9]


def test_cross_stream_copy_whole_only_and_deferred(dev):
    """Item 52."""
    cache = make_cache(dev, unified=False, n_seq_max=2)
    decode(cache, {0: [1, 2, 3]})
    with pytest.raises(ArgumentError, match="whole sequence"):
        cache.seq_cp(0, 1, 0, 2)
    assert cache.seq_pos_max(1) == -1  # refused copy changed nothing
    k_before = cache.k[0].numpy()
    cache.seq_cp(0, 1)
    assert cache.seq_pos_max(1) == 2
    np.testing.assert_array_equal(cache.k[0].numpy(), k_before)  # deferred
    ctx = cache.init_update()
    assert ctx.stream_copies == [(0, 1)]
    ctx.apply()
    k = cache.k[0].numpy()
    np.testing.assert_array_equal(k[cache.size : cache.size + 3], k[:3])
    out = decode(cache, {1: [9]})
    hist = [(0, 1), (1, 2), (2, 3), (3, 9)]
    np.testing.assert_allclose(out[(1, 3)], expected(hist, 9), rtol=1e-5, atol=1e-6)


def test_same_stream_copy_shares_cells_and_keep(dev):
    cache = make_cache(dev)
    decode(cache, {0: [1, 2, 3]})
    cache.seq_cp(0, 2, 0, 2)
    assert (cache.seq_pos_min(2), cache.seq_pos_max(2)) == (0, 1)
    cache.seq_keep(2)
    assert cache.seq_pos_max(0) == -1 and cache.cells[0].used == 2
    cache.cells[0].check()


@pytest.mark.parametrize("unified", [True, False])
def test_state_round_trip_per_sequence_into_fragmented_cache(dev, unified):
    """Items 36/53: restore into non-contiguous free cells, then continue identically."""
    src = make_cache(dev, unified=unified)
    decode(src, {0: [5, 6, 7, 8], 1: [9, 10]})
    blob = src.state_write(0)
    dst = make_cache(dev, size=12, unified=unified)
    decode(dst, {0: list(range(10))})
    dst.seq_rm(0, 1, 3)
    dst.seq_rm(0, 5, 6)
    dst.seq_rm(0, 8, 9)  # 4 free cells, none contiguous pairs beyond two
    dst.seq_cp(0, 3) if unified else None
    dst.state_read(blob, 1)
    assert (dst.seq_pos_min(1), dst.seq_pos_max(1)) == (0, 3)
    out_src = decode(src, {0: [11]})
    out_dst = decode(dst, {1: [11]})
    np.testing.assert_allclose(out_dst[(1, 4)], out_src[(0, 4)], rtol=1e-6)
    for c in dst.cells:
        c.check()


def test_state_whole_cache_round_trip(dev):
    src = make_cache(dev)
    decode(src, {0: [5, 6, 7], 1: [8, 9]})
    src.seq_cp(1, 3)
    dst = make_cache(dev)
    dst.state_read(src.state_write())
    for s in range(4):
        assert (dst.seq_pos_min(s), dst.seq_pos_max(s)) == (src.seq_pos_min(s), src.seq_pos_max(s))
    np.testing.assert_allclose(decode(dst, {3: [4]})[(3, 2)], decode(src, {3: [4]})[(3, 2)], rtol=1e-6)


@pytest.mark.parametrize(
    "corrupt",
    ["truncate", "n_stream", "n_layer", "row_bytes", "type", "cell_count", "n_seq_id"],
)
def test_corrupt_kv_blob_errors_and_changes_nothing(dev, corrupt):
    src = make_cache(dev)
    decode(src, {0: [5, 6, 7]})
    blob = bytearray(src.state_write(0))
    # 24 bytes of blob and section header, then the KV payload:
    # u32 n_stream | u32 count | 3 x (i32 pos, u32 n, i32 id) | u32 n_layer | u32 il, i32 type, u64 rb ...
    h = 24
    meta_end = h + 8 + 3 * 12
    if corrupt == "truncate":
        blob = blob[:-5]
    elif corrupt == "n_stream":
        blob[h : h + 4] = (2).to_bytes(4, "little")
    elif corrupt == "n_layer":
        blob[meta_end : meta_end + 4] = (5).to_bytes(4, "little")
    elif corrupt == "type":
        blob[meta_end + 8 : meta_end + 12] = (1).to_bytes(4, "little")
    elif corrupt == "row_bytes":
        blob[meta_end + 12 : meta_end + 20] = (12).to_bytes(8, "little")
    elif corrupt == "cell_count":
        blob[h + 4 : h + 8] = (10**6).to_bytes(4, "little")
    elif corrupt == "n_seq_id":
        blob[h + 12 : h + 16] = (2).to_bytes(4, "little")
    dst = make_cache(dev)
    decode(dst, {1: [1, 2], 2: [3]})
    k_before = [dst.k[il].numpy().copy() for il in sorted(dst.k)]
    with pytest.raises(StateError):
        dst.state_read(bytes(blob), 1)
    # Validated before anything is written: the destination keeps its own cells.
    assert dst.seq_pos_max(1) == 1 and dst.seq_pos_max(2) == 0
    for before, il in zip(k_before, sorted(dst.k), strict=True):
        np.testing.assert_array_equal(dst.k[il].numpy(), before)
    out = decode(dst, {1: [5]})
    np.testing.assert_allclose(out[(1, 2)], expected([(0, 1), (1, 2), (2, 5)], 5), rtol=1e-5)


def test_state_write_refuses_pending_update(dev):
    cache = make_cache(dev)
    decode(cache, {0: [1, 2]})
    cache.seq_add(0, 0, -1, 1)
    with pytest.raises(StateError, match="init_update"):
        cache.state_write()


def test_bad_sequence_ids_raise(dev):
    cache = make_cache(dev)
    with pytest.raises(ArgumentError, match="sequence 9"):
        cache.seq_rm(9)
    with pytest.raises(ArgumentError, match="divisor"):
        cache.seq_div(0, 0, -1, 0)


def test_iswa_sizes_and_partial_state(dev):
    assert iswa_sizes(4096, 128, 4, 64, True, 256, False) == 768
    assert iswa_sizes(4096, 128, 4, 64, False, 256, False) == 256
    assert iswa_sizes(4096, 128, 4, 64, True, 256, True) == 4096
    mem = KVCacheISWA(
        dev, [KVLayer(il, E, E) for il in range(3)], [1], size=64, n_seq_max=2, n_ubatch=4, n_swa=4, dtype="f32",
        n_pad=8,
    )  # fmt: skip
    mem.fill_garbage(3)
    assert mem.swa.size == 16 and mem.base.size == 64
    balloc = BatchAllocator(2)
    for _ in range(8):
        balloc.init(Batch.for_sequences({0: [1, 2, 3]}), mem)
        ctx = mem.init_batch(balloc, 4)
        while True:
            assert ctx.apply()
            if not ctx.next():
                break
    assert mem.seq_pos_max(0) == 23 and mem.base.seq_pos_min(0) == 0
    assert mem.seq_pos_min(0) == mem.swa.seq_pos_min(0) > 0
    full = mem.state_write(0)
    part = mem.state_write(0, StateFlags.PARTIAL_ONLY)
    assert len(part) < len(full)
    other = KVCacheISWA(
        dev, [KVLayer(il, E, E) for il in range(3)], [1], size=64, n_seq_max=2, n_ubatch=4, n_swa=4, dtype="f32",
        n_pad=8,
    )  # fmt: skip
    # a partial read keeps the base cache's cells, which here do not reach the window's 23:
    # refused, nothing changed (upstream accepts it and leaves a hole before the next token) [REC]
    blob = other.state_write()
    with pytest.raises(StateError, match=r"up to position 23.*end at -1"):
        other.state_read(part, 1, StateFlags.PARTIAL_ONLY)
    assert other.state_write() == blob
    other.state_read(full, 1)
    assert other.base.seq_pos_min(1) == 0 and other.base.seq_pos_max(1) == 23
    other.state_read(part, 1, StateFlags.PARTIAL_ONLY)  # the base cells reach it now
    assert other.base.seq_pos_max(1) == 23 and other.swa.seq_pos_max(1) == 23


def test_memory_breakdown_seed_example(dev):
    """12 attention layers, 4 KV heads of 128, f16, 4 sequences x 8192 positions = 768 MiB."""
    cache = KVCache(dev, [KVLayer(il, 4 * 128, 4 * 128) for il in range(12)], size=4 * 8192, n_seq_max=4)
    assert cache.memory_breakdown() == {dev.id: 768 * 2**20}


def test_seq_add_on_a_shared_cell_is_refused_and_changes_nothing(dev):
    cache = make_cache(dev)
    decode(cache, {0: [1, 2, 3]})
    cache.seq_cp(0, 1, 1, -1)
    before = [c.clone() for c in cache.cells]
    with pytest.raises(ArgumentError, match="shared with sequences"):
        cache.seq_add(0, 0, -1, 2)
    with pytest.raises(ArgumentError, match="shared"):
        cache.seq_div(0, 0, -1, 2)
    assert all(a.same_as(b) for a, b in zip(before, cache.cells))
    cache.seq_add(0, 0, 1, 5)  # position 0 is not shared: allowed
    assert cache.seq_pos_max(0) == 5 and cache.seq_pos_max(1) == 2


def test_chained_cross_stream_copies_all_run_in_order(dev):
    """seq_cp(0,1); seq_cp(1,2); seq_cp(3,1): the books are copied at once, the
    buffers at the next update, so every queued copy must run, in order (found by
    review: the first copy was dropped and stream 2 got stream 1's old rows)."""
    from statecache.kv_cache import KVCache, KVLayer

    kv = KVCache(dev, [KVLayer(0, 4, 4)], size=8, n_seq_max=4, unified=False, dtype="f32", n_pad=8)
    for buf in kv.buffers():
        dev.fill_bytes(buf, 3)
    balloc = BatchAllocator(4)
    balloc.init(Batch.for_sequences({0: [1, 2, 3], 1: [4, 5], 3: [7, 7, 7, 7]}, output_all=True), kv)
    ctx = kv.init_batch(balloc, 512)
    while True:
        assert ctx.apply()
        ub = ctx.get_ubatch()
        cur = np.array([[100 * ub.seq_id[i][0] + ub.pos[i]] * 4 for i in range(ub.n_tokens)], np.float32)
        ctx.cpy_k(0, cur)
        ctx.cpy_v(0, cur)
        if not ctx.next():
            break
    kv.seq_cp(0, 1)
    kv.seq_cp(1, 2)
    kv.seq_cp(3, 1)
    upd = kv.init_update()
    assert upd.apply()
    assert kv.init_update().status is MemoryStatus.NO_UPDATE
    k = kv.k[0].numpy()
    # stream 1 holds seq 1 = a copy of seq 3; stream 2 holds seq 2 = a copy of seq 0
    for strm, holder, origin, n in ((1, 1, 3, 4), (2, 2, 0, 3)):
        cells = sorted(kv.cells[strm].seq_pos[holder])
        assert [p for p, _ in cells] == list(range(n))
        for pos, idx in cells:
            assert k[strm * kv.size + idx, 0] == 100 * origin + pos, (strm, pos)
