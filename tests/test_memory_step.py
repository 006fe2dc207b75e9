"""One step API across memory kinds (issue 15 items 5 and 8): ``ctx.step()`` on a
recurrent, KV, KV-iSWA, hybrid, hybrid-iSWA and hybrid-idx memory, driven by one
decode loop (``decode_loop`` below, unchanged for every kind) and compared with a
full recompute from the plain token lists.

The "model": layers 0 (Mamba-2-like) and 2 (GDN-like) are the recurrent toy of
``recurrent_toy.py``; layers 1 and 3 are attention layers whose K/V/q are fixed
functions of the token id (no RoPE), so the oracle recomputes every output from
a sequence's token history.  Layer 3 is a sliding-window layer in the iSWA kinds.
A memory holds the layers of its kind only; every output vector is the
concatenation of its layers' outputs in layer order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_toy import attention, emb
from recurrent_toy import CH, HV, H, P, S, Tables, oracle, toy_spec

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.hostmem import as_array
from statecache.hybrid import HybridISWAMemory, HybridMemory
from statecache.hybrid_idx import HybridIdxMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.kv_mask import SWAType, is_masked_swa
from statecache.memory import ContextError
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec

E = 4  # K/V width of the attention layers
N_SWA = 4
IDX_HEAD, IDX_FACTOR = 2, 2  # indexer row: head_size * row_factor
KINDS = ("recurrent", "kv", "kv-iswa", "hybrid", "hybrid-iswa", "hybrid-idx")
N_RS_SEQ = 2


def spec4() -> MemorySpec:
    """The toy spec with a fourth (attention) layer: recurrent layers 0 and 2."""
    base = toy_spec()
    return MemorySpec.build(4, {L: base.layers[L] for L in (0, 2)})


def make_memory(dev, kind: str, *, n_seq_max: int = 3, size: int = 32):  # type: ignore[no-untyped-def]
    recr = RecurrentMemory(spec4(), dev, n_seq_max=n_seq_max, n_rs_seq=N_RS_SEQ)
    layers = [KVLayer(1, E, E), KVLayer(3, E, E)]
    common = dict(n_seq_max=n_seq_max, unified=True, dtype="f32", n_pad=8)
    iswa = dict(size=size, n_ubatch=8, n_swa=N_SWA, rollback_depth=N_RS_SEQ, **common)
    if kind == "recurrent":
        mem = recr
    elif kind == "kv":
        mem = KVCache(dev, layers, size=size, **common)
    elif kind == "kv-iswa":
        mem = KVCacheISWA(dev, layers, [3], **iswa)
    elif kind == "hybrid":
        mem = HybridMemory(KVCache(dev, layers, size=size, **common), recr)
    elif kind == "hybrid-iswa":
        mem = HybridISWAMemory(KVCacheISWA(dev, layers, [3], **iswa), recr)
    else:
        attn = KVCache(dev, layers, size=size, **common)
        mem = HybridIdxMemory(attn, recr, [1], head_size=IDX_HEAD, row_factor=IDX_FACTOR, kpool=2)
    fill = getattr(mem, "fill_garbage", None)
    if fill is not None:
        fill(3)  # nothing may rely on zeroed K/V or states
    if kind == "recurrent":
        for L, pools in mem.pools.items():
            for j, buf in enumerate(pools.values()):
                dev.fill_bytes(buf, 40 + 10 * L + j)
    return mem


# -- the decode loop: one function, every memory kind ---------------------------------
def recurrent_layer(step, tables: Tables, layer: int, toks: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Conv then scan (layer 0) or delta (layer 2); arguments are NumPy arrays (DLPack)."""
    n_s, n_t = toks.shape
    yc = np.empty((n_s, n_t, CH), dtype=np.float32)
    step.conv(layer, tables.conv_x[layer][toks], tables.conv_w[layer], yc)
    if layer == 0:
        ys = np.empty((n_s, n_t, H, P), dtype=np.float32)
        step.scan(layer, tables.x[toks], tables.dt[toks], tables.A, tables.B[toks], tables.C[toks], ys)
    else:
        ys = np.empty((n_s, n_t, HV, S), dtype=np.float32)
        step.delta(layer, tables.q[toks], tables.k[toks], tables.v[toks], tables.g[toks], tables.beta[toks], ys)
    return np.concatenate([yc.reshape(n_s * n_t, -1), ys.reshape(n_s * n_t, -1)], axis=1)


def attention_layer(step, layer: int, tokens: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Write this ubatch's K/V, then attend over the rows the step names, through its mask."""
    step.write_kv(
        layer, np.stack([emb(t, 10 * layer + 1) for t in tokens]), np.stack([emb(t, 10 * layer + 2) for t in tokens])
    )
    rows = step.kv_rows(layer)
    mask = as_array(step.mask(layer))  # a device Buffer; on a host device, its memory
    k, v = as_array(rows.k), as_array(rows.v)
    out = []
    for i, t in enumerate(tokens):
        lo = int(rows.read_start[i])
        out.append(attention(emb(t, 10 * layer + 3), k[lo : lo + rows.n_kv], v[lo : lo + rows.n_kv], mask[i]))
    return np.stack(out)


def index_keys(tokens: list[int]) -> np.ndarray:
    return np.stack([np.resize(emb(t, 77), IDX_HEAD * IDX_FACTOR) for t in tokens])


def decode_loop(mem, tables: Tables, tokens_by_seq: dict[int, list[int]], n_ubatch: int = 8, on_step=None):  # type: ignore[no-untyped-def]
    """One batch through ``ctx.step()``; returns {(seq, pos): output vector}."""
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), mem)
    ctx = mem.init_batch(balloc, n_ubatch)
    assert not ctx.status.is_fail
    out = {}
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        step = ctx.step()
        if on_step is not None:
            on_step(step, ub)
        toks = ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
        tokens = [int(t) for t in ub.token]
        parts = []
        for layer in range(4):
            if layer in step.recurrent_layers:
                parts.append(recurrent_layer(step, tables, layer, toks))
            elif layer in step.attention_layers:
                parts.append(attention_layer(step, layer, tokens))
            if layer in step.index_layers:
                step.write_index_keys(layer, index_keys(tokens))
                written = as_array(step.index_rows(layer).k)[step.index_rows(layer).write]
                np.testing.assert_array_equal(written, index_keys(tokens))
                inputs, on_device = step.kpool_inputs(), step.kpool_buffers()
                assert inputs.pool_mask.shape[0] == ub.n_tokens
                for name, buf in on_device.items():  # the same values, in reused device buffers
                    np.testing.assert_array_equal(as_array(buf), getattr(inputs, name), err_msg=name)
                assert set(on_device) == {f for f, v in vars(inputs).items() if v is not None}
        y = np.concatenate(parts, axis=1)
        for i in range(ub.n_tokens):
            for q in ub.seq_id[i]:
                out[(int(q), int(ub.pos[i]))] = y[i]
        if not ctx.next():
            return out


# -- the oracle: a full recompute from the token history --------------------------------
def expected(dev, kind: str, tables: Tables, hist: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The output of the last token of ``hist`` (a sequence's tokens from position 0)."""
    parts = []
    y_rec = oracle(dev, tables, hist)[0][-1] if kind in ("recurrent", "hybrid", "hybrid-iswa", "hybrid-idx") else None
    p1 = len(hist) - 1
    for layer in range(4):
        if layer in (0, 2) and y_rec is not None:
            # oracle's columns: conv 0, scan 0, conv 2, delta 2
            lo = 0 if layer == 0 else CH + H * P
            parts.append(y_rec[lo : lo + CH + (H * P if layer == 0 else HV * S)])
        elif layer in (1, 3) and kind != "recurrent":
            windowed = layer == 3 and kind.endswith("iswa")
            vis = [p for p in range(p1 + 1) if not (windowed and is_masked_swa(N_SWA, SWAType.STANDARD, p, p1))]
            k = np.stack([emb(hist[p], 10 * layer + 1) for p in vis])
            v = np.stack([emb(hist[p], 10 * layer + 2) for p in vis])
            parts.append(attention(emb(hist[p1], 10 * layer + 3), k, v, np.zeros(len(vis), dtype=np.float32)))
    return np.concatenate(parts)


class Driver:
    def __init__(self, dev, kind: str) -> None:  # type: ignore[no-untyped-def]
        self.dev, self.kind = dev, kind
        self.mem = make_memory(dev, kind)
        self.tables = Tables()
        self.hist: dict[int, list[int]] = {}
        self.checked = 0

    def run(self, tokens_by_seq: dict[int, list[int]], after=None, **kw) -> None:  # type: ignore[no-untyped-def]
        out = decode_loop(self.mem, self.tables, tokens_by_seq, **kw)
        if after is not None:
            after()  # before the oracle runs
        for s, ts in tokens_by_seq.items():
            self.hist.setdefault(s, []).extend(ts)
        for (s, p), y in out.items():
            want = expected(self.dev, self.kind, self.tables, self.hist[s][: p + 1])
            np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5, err_msg=f"{self.kind} seq {s} pos {p}")
            self.checked += 1

    def rollback(self, s: int, n: int) -> None:
        keep = len(self.hist[s]) - n
        assert self.mem.seq_rm(s, keep, -1)
        del self.hist[s][keep:]

    def fork(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        self.hist[dst] = list(self.hist[src])


@pytest.fixture(scope="module", params=["reference", "cpu"])
def dev(request):  # type: ignore[no-untyped-def]
    return statecache.get_device(request.param)


@pytest.mark.parametrize("kind", KINDS)
def test_one_decode_loop_matches_full_recompute_on_every_memory_kind(dev, kind) -> None:  # type: ignore[no-untyped-def]
    d = Driver(dev, kind)
    rng = np.random.default_rng(KINDS.index(kind))
    tok = lambda n: rng.integers(0, 32, size=n).tolist()  # noqa: E731
    d.run({0: tok(6), 1: tok(3)})  # prefill of unequal lengths: several ubatches
    for _ in range(3):
        d.run({0: tok(1), 1: tok(1)})
    d.fork(0, 2)  # copy-on-write of the recurrent state, shared attention cells
    d.run({0: tok(1), 2: tok(1)})
    d.run({2: tok(3)})  # a speculative draft of 3 ...
    d.rollback(2, 2)  # ... one accepted
    d.run({2: tok(1), 1: tok(1)})
    assert d.checked >= 20


def test_layer_lists_name_every_part(dev) -> None:  # type: ignore[no-untyped-def]
    want = {
        "recurrent": ((0, 2), (), ()), "kv": ((), (1, 3), ()), "kv-iswa": ((), (1, 3), ()),
        "hybrid": ((0, 2), (1, 3), ()), "hybrid-iswa": ((0, 2), (1, 3), ()), "hybrid-idx": ((0, 2), (1, 3), (1,)),
    }  # fmt: skip
    seen: list = []
    for kind, layers in want.items():
        seen.clear()
        decode_loop(make_memory(dev, kind), Tables(), {0: [1, 2]}, on_step=lambda st, ub: seen.append(st))
        st = seen[0]
        assert (st.recurrent_layers, st.attention_layers, st.index_layers) == layers, kind


# -- refused input changes nothing -------------------------------------------------------
def _snapshot(mem):  # type: ignore[no-untyped-def]
    bufs = []
    for part in getattr(mem, "kv_caches", None) or getattr(mem, "caches", None) or [mem]:
        if isinstance(part, KVCache):
            bufs += part.buffers()
    idx = getattr(mem, "idx", None)
    if idx is not None:
        bufs += idx.buffers()
    recr = getattr(mem, "recr", mem if isinstance(mem, RecurrentMemory) else None)
    if recr is not None:
        bufs += [b for pools in recr.pools.values() for b in pools.values()]
    return [b.numpy().copy() for b in bufs]


@pytest.mark.parametrize("kind", KINDS)
def test_refused_calls_change_nothing(dev, kind) -> None:  # type: ignore[no-untyped-def]
    d = Driver(dev, kind)
    d.run({0: [1, 2, 3], 1: [4, 5]})
    refused = []

    def misuse(step, ub) -> None:  # type: ignore[no-untyped-def]
        n = ub.n_tokens
        before = _snapshot(d.mem)
        good = np.zeros((n, E), dtype=np.float32)
        attempts = [
            lambda: step.write_kv(0, good, good),  # a recurrent layer (or absent)
            lambda: step.write_kv(7, good, good),  # no such layer
            lambda: step.write_kv(1, np.zeros((n + 1, E), np.float32), good),  # k: wrong token count
            lambda: step.write_kv(1, good, np.zeros((n, E + 1), np.float32)),  # v wrong: k not written either
            lambda: step.write_kv(1, good),  # v missing
            lambda: step.mask(2),
            lambda: step.kv_rows(0),
            lambda: step.write_index_keys(3, np.zeros((n, IDX_HEAD * IDX_FACTOR), np.float32)),
            lambda: step.conv(
                1, np.zeros((1, n, CH), np.float32), Tables().conv_w[0], np.zeros((1, n, CH), np.float32)
            ),
        ]
        for attempt in attempts:
            with pytest.raises(statecache.ArgumentError) as info:
                attempt()
            refused.append(info.value.argument)
        if "idx" not in kind:
            for ask in (step.kpool_inputs, step.kpool_buffers):
                with pytest.raises(statecache.ArgumentError, match="k-pools"):
                    ask()
        for a, b in zip(before, _snapshot(d.mem), strict=True):
            np.testing.assert_array_equal(a, b)

    d.run({0: [6], 1: [7]}, on_step=misuse)  # the corrected calls of the loop then run and match the oracle
    d.run({0: [8], 1: [9]})
    assert {"layer", "k", "v"} <= set(refused) or kind == "recurrent"
    assert d.checked == 9


# -- reused index buffers: no device allocation in a steady decode ----------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_steady_decode_allocates_nothing_on_the_device(dev, kind, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    d = Driver(dev, kind)
    d.run({0: [1, 2, 3, 4, 5], 1: [6, 7, 8]})
    for t in range(2 * (N_RS_SEQ + 1)):  # warm-up: every plane of the rotation seen once
        d.run({0: [t], 1: [t + 1]})
    calls = []
    real = dev._alloc

    def counting(shape, dtype):  # type: ignore[no-untyped-def]
        calls.append((shape, dtype))
        return real(shape, dtype)

    monkeypatch.setattr(dev, "_alloc", counting)
    masks, rows = set(), set()

    def remember(step, ub) -> None:  # type: ignore[no-untyped-def]
        for layer in step.attention_layers:
            step_rows = step.kv_rows(layer)
            masks.add(id(step.mask(layer).storage))
            rows.add(id(step_rows.write_buffer.storage))

    for t in range(5):  # the loop alone (the oracle allocates its own pools)
        decode_loop(d.mem, d.tables, {0: [t + 3], 1: [t + 9]}, on_step=remember)
    assert calls == []
    if kind != "recurrent":  # one reused storage per cache (an iSWA pair: two), not one per step
        assert len(masks) == len(rows) == (2 if "iswa" in kind else 1)


def test_old_accessors_still_work(dev) -> None:  # type: ignore[no-untyped-def]
    mem = make_memory(dev, "hybrid-iswa")
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [1, 2, 3]}, output_all=True), mem)
    ctx = mem.init_batch(balloc, 8)
    assert ctx.apply()
    ctx.attn.swa.cpy_k(3, np.ones((3, E), np.float32))  # the per-cache context, as before
    step = ctx.step()
    assert step.kv_rows(3).k is mem.attn.swa.k[3]
    np.testing.assert_array_equal(as_array(step.kv_rows(3).k)[step.kv_rows(3).write], np.ones((3, E)))
    np.testing.assert_array_equal(as_array(step.mask(3)), ctx.attn.swa.mask())
    assert ctx.recr.step().recurrent_layers == (0, 2)


def test_a_step_used_after_the_context_moved_on_is_refused(dev) -> None:  # type: ignore[no-untyped-def]
    mem = make_memory(dev, "hybrid-idx")
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences({0: [1, 2, 3, 4, 5, 6], 1: [7, 8]}, output_all=True), mem)
    ctx = mem.init_batch(balloc, 4)
    assert ctx.apply()
    old = ctx.step()
    old.mask(1)
    assert ctx.next()
    with pytest.raises((ContextError, statecache.ArgumentError), match="apply"):
        ctx.step()  # the next ubatch is not applied yet
    with pytest.raises(statecache.ArgumentError, match="apply"):
        ctx.recr.step()  # the recurrent part alone: not the previous ubatch's step either
    assert ctx.apply()
    n = ctx.get_ubatch().n_tokens
    zeros = np.zeros((n, E), np.float32)
    stale = (lambda: old.write_kv(1, zeros, zeros), lambda: old.kv_rows(3), old.kpool_inputs)
    for call in (*stale, lambda: old.write_index_keys(1, index_keys([1] * n))):
        with pytest.raises(ContextError, match="moved on"):
            call()
    ctx.step().write_kv(1, np.zeros((n, E), np.float32), np.zeros((n, E), np.float32))


@pytest.mark.parametrize("kind", ["kv-iswa", "hybrid-idx"])
def test_after_prepare_the_layer_calls_copy_nothing_from_the_host(dev, kind, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What a CUDA graph capture needs: prepare() writes the reused inputs, the layers only read them."""
    d = Driver(dev, kind)
    d.run({0: [1, 2, 3], 1: [4, 5]})
    d.run({0: [1], 1: [2]})  # warm-up of the decode shape (as before a capture)
    real_write = dev.write

    def capture(step, ub) -> None:  # type: ignore[no-untyped-def]
        step.prepare()
        monkeypatch.setattr(dev, "write", lambda *a: pytest.fail("a host copy during the layer calls"))

    def restore() -> None:
        monkeypatch.setattr(dev, "write", real_write)

    d.run({0: [6], 1: [7]}, on_step=capture, after=restore)  # the loop's calls, then the oracle check
    d.run({0: [8], 1: [9]}, on_step=capture, after=restore)  # rows changed: rewritten in place, still right
    assert d.checked == 11
