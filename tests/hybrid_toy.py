"""A tiny hybrid "model" for the hybrid tests: the recurrent toy of
``recurrent_toy.py`` (layers 0 and 2) plus one attention layer (layer 1) and
an oracle that recomputes both from plain token lists.

The attention layer writes K/V rows that are a fixed function of the token
id (no RoPE, so position shifts only move mask positions), and a token's
attention output is softmax(q . k) . v over the cells its mask shows.  The
oracle keeps, per sequence, the tokens the recurrent state absorbed (from a
zero state) and the ``(pos, token)`` pairs attention can still see, and
recomputes both from scratch.
"""

from __future__ import annotations

import numpy as np
from recurrent_toy import Tables, oracle, run_layers, toy_spec

from statecache.batch import Batch, BatchAllocator
from statecache.hybrid import HybridISWAMemory, HybridMemory
from statecache.hybrid_idx import HybridIdxMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.kv_mask import is_masked_swa
from statecache.recurrent import RecurrentMemory

E = 4  # attention K/V width
ATTN = 1  # the attention layer of the toy spec


def emb(token: int, salt: int) -> np.ndarray:
    return np.random.default_rng(token * 7919 + salt).standard_normal(E).astype(np.float32)


def attention(q, k, v, bias):  # type: ignore[no-untyped-def]
    vis = np.isfinite(bias)
    s = (k[vis] @ q) + bias[vis]
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v[vis]


def make_hybrid(
    dev,
    kind="hybrid",
    *,
    n_seq_max=3,
    size=24,
    unified=True,
    n_rs_seq=0,
    n_swa=4,
    seed=0,
    kpool=4,
    n_pad=8,
    by_order=False,
    swa_full=False,
):  # type: ignore[no-untyped-def]
    """A garbage-filled hybrid ("hybrid"), hybrid-iSWA ("iswa": its window cache keeps the
    rollback depth, ``swa_full`` makes it as big as the base) or hybrid-idx ("idx":
    ``by_order`` for order-mode k-pools)."""
    recr = RecurrentMemory(toy_spec(), dev, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq)
    common = dict(n_seq_max=n_seq_max, unified=unified, dtype="f32", n_pad=n_pad)
    if kind == "iswa":
        attn = KVCacheISWA(
            dev, [KVLayer(ATTN, E, E)], [ATTN], size=size, n_ubatch=8, n_swa=n_swa, swa_full=swa_full,
            rollback_depth=n_rs_seq, **common,
        )  # fmt: skip
        mem = HybridISWAMemory(attn, recr)
    elif kind == "idx":
        attn = KVCache(dev, [KVLayer(ATTN, E, E)], size=size, **common)
        mem = HybridIdxMemory(attn, recr, [ATTN], head_size=2, row_factor=2, kpool=kpool, by_order=by_order)
    else:
        attn = KVCache(dev, [KVLayer(ATTN, E, E)], size=size, **common)
        mem = HybridMemory(attn, recr)
    mem.fill_garbage(seed)
    return mem


class HybridToy:
    def __init__(self, dev, mem) -> None:  # type: ignore[no-untyped-def]
        self.dev = dev
        self.mem = mem
        self.tables = Tables()
        self.window = None
        if isinstance(mem.attn, KVCacheISWA):
            self.window = (mem.attn.swa.swa_type, mem.attn.swa.n_swa)
        self.recr_tokens: dict[int, list[int]] = {}
        self.attn_hist: dict[int, list[tuple[int, int]]] = {}

    @property
    def attn_cache(self) -> KVCache:
        return self.mem.attn.swa if isinstance(self.mem.attn, KVCacheISWA) else self.mem.attn

    def decode(self, tokens_by_seq, n_ubatch=8, on_apply=None, varlen=False):  # type: ignore[no-untyped-def]
        """One batch; returns {(seq, pos): output vector} or None when planning failed.
        ``varlen``: planned with ``init_batch(varlen=True)`` (packed ubatches)."""
        balloc = BatchAllocator(self.mem.n_seq_max)
        balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), self.mem)
        ctx = self.mem.init_batch(balloc, n_ubatch, varlen=varlen)
        if ctx.status.is_fail:
            return None
        self.forwards = 0
        out = {}
        cache = self.attn_cache
        while True:
            ub = ctx.get_ubatch()
            assert ctx.apply()
            if on_apply is not None:
                on_apply(ctx)
            self.forwards += 1
            toks = ub.token if ub.is_varlen else ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
            y_rec = run_layers(self.dev, ctx.recr.step(), self.tables, toks)
            y_rec = y_rec.reshape(ub.n_tokens, -1)
            actx = ctx.attn.swa if isinstance(self.mem.attn, KVCacheISWA) else ctx.attn
            actx.cpy_k(ATTN, np.stack([emb(int(t), 1) for t in ub.token]))
            actx.cpy_v(ATTN, np.stack([emb(int(t), 2) for t in ub.token]))
            mask = actx.mask()
            k_all, v_all = cache.k[ATTN].numpy(), cache.v[ATTN].numpy()
            for i in range(ub.n_tokens):
                s = int(ub.primary[i])
                base = cache.stream_of(s) * cache.size
                n_kv = mask.shape[1]
                a = attention(emb(int(ub.token[i]), 3), k_all[base : base + n_kv], v_all[base : base + n_kv], mask[i])
                y = np.concatenate([y_rec[i], a])
                for q in ub.seq_id[i]:
                    out[(q, int(ub.pos[i]))] = y
            if not ctx.next():
                break
        for s, ts in tokens_by_seq.items():
            hist = self.attn_hist.setdefault(s, [])
            p0 = hist[-1][0] + 1 if hist else 0
            self.recr_tokens.setdefault(s, []).extend(ts)
            hist.extend((p0 + k, t) for k, t in enumerate(ts))
        return out

    def expected(self, s: int) -> np.ndarray:
        """The oracle output of sequence ``s``'s last token."""
        y_rec, _ = oracle(self.dev, self.tables, self.recr_tokens[s])
        hist = self.attn_hist[s]
        p1, t1 = hist[-1]
        vis = [(p, t) for p, t in hist if not (self.window and is_masked_swa(self.window[1], self.window[0], p, p1))]
        k = np.stack([emb(t, 1) for _, t in vis])
        v = np.stack([emb(t, 2) for _, t in vis])
        a = attention(emb(t1, 3), k, v, np.zeros(len(vis), dtype=np.float32))
        return np.concatenate([y_rec[-1], a])

    def forget(self, s: int) -> None:
        self.recr_tokens[s] = []
        self.attn_hist[s] = []
