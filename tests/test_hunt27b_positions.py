"""Position edits against a RoPE oracle (hunt27b).

A KV memory whose K rows are RoPE-rotated at their position, with a ``k_shift`` hook
that rotates rows as the runtime would, decodes batches between random position
edits (``seq_add`` / context shift, ``seq_div`` / self-extend, ``seq_keep``,
``seq_rm``, ``seq_cp`` then edits on one of the sharers) and state round trips taken
while a K-shift still waits.  Every output is compared with a full recompute from
plain ``(position, token)`` histories to which the same edits were applied; a
refused edit must be predicted by the oracle (a shared cell, two cells at one
position, a partial copy between streams) and change nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.errors import ArgumentError
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.kv_mask import is_masked_swa
from statecache.memory import MemoryStatus

DEV = statecache.get_device("reference")
E = 4
N_SEQ = 3
THETA = np.array([0.7, 0.05])
EXAMPLES = 25 if settings.default.max_examples <= 40 else settings.default.max_examples


def rope(x: np.ndarray, pos: np.ndarray | int) -> np.ndarray:
    """Rotate the pairs (x0, x1), (x2, x3) of each row by ``pos * THETA``."""
    x = np.atleast_2d(np.asarray(x, dtype=np.float64))
    a = np.asarray(pos, dtype=np.float64).reshape(-1, 1) * THETA[None, :]
    c, s = np.cos(a), np.sin(a)
    out = np.empty_like(x)
    out[:, 0::2] = x[:, 0::2] * c - x[:, 1::2] * s
    out[:, 1::2] = x[:, 0::2] * s + x[:, 1::2] * c
    return out


def rope_shift(cache: KVCache, il: int, buf: Any, rows: np.ndarray, shifts: np.ndarray) -> None:
    if not rows.size:
        return
    k = DEV.download(buf)[rows]
    DEV.set_rows(buf, DEV.indices(rows), DEV.upload(rope(k, shifts).astype(np.float32)))


def emb(token: int, salt: int) -> np.ndarray:
    return np.random.default_rng(token * 7919 + salt).standard_normal(E)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = k @ q
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v


def build(kind: str) -> Any:
    common: dict[str, Any] = dict(n_seq_max=N_SEQ, dtype="f32", n_pad=8, k_shift=rope_shift)
    if kind.startswith("iswa"):  # "iswa_evict": the window cache gives up cells a window has left
        full = kind == "iswa"
        mem: Any = KVCacheISWA(
            DEV, [KVLayer(0, E, E), KVLayer(1, E, E)], [1], size=40, n_ubatch=8, n_swa=3, swa_full=full, **common
        )
    else:
        mem = KVCache(DEV, [KVLayer(0, E, E)], size=40, unified=kind == "kv", **common)
    mem.fill_garbage(5)
    return mem


def caches(mem: Any) -> list[KVCache]:
    return [mem.base, mem.swa] if isinstance(mem, KVCacheISWA) else [mem]


def run_update(mem: Any) -> None:
    ctx = mem.init_update()
    if ctx.status is MemoryStatus.SUCCESS:
        assert ctx.apply()
    assert not mem.has_pending_update()


class Oracle:
    """Per sequence: [cell id, position, token, extension] entries (the extension of a
    1-D cell is the position it was decoded at: a move keeps it, as upstream).  Cell ids say which entries
    share a cell (a copy within one stream shares; between streams it copies)."""

    def __init__(self, unified: bool) -> None:
        self.unified = unified
        self.hist: dict[int, list[list[int]]] = {s: [] for s in range(N_SEQ)}
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def shared(self, s: int, cid: int) -> bool:
        return any(e[0] == cid for q, h in self.hist.items() if q != s for e in h)

    def pos_max(self, s: int) -> int:
        return max((e[1] for e in self.hist[s]), default=-1)

    def pos_min(self, s: int) -> int:
        return min((e[1] for e in self.hist[s]), default=-1)

    def move_refused(self, s: int, p0: int, p1: int, f: Any) -> bool:
        inside = [e for e in self.hist[s] if p0 <= e[1] < p1]
        if any(self.shared(s, e[0]) for e in inside):
            return True
        # two cells at one whole position (position and extension) are refused
        new = [(f(e[1]), e[3]) if p0 <= e[1] < p1 else (e[1], e[3]) for e in self.hist[s]]
        kept = [p for p in new if p[0] >= 0]
        return len(kept) != len(set(kept))

    def move(self, s: int, p0: int, p1: int, f: Any) -> None:
        for e in self.hist[s]:
            if p0 <= e[1] < p1:
                e[1] = f(e[1])
        self.hist[s] = [e for e in self.hist[s] if e[1] >= 0]

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        self.hist[s] = [e for e in self.hist[s] if not p0 <= e[1] < p1]

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if src == dst:
            return
        brought = [e for e in self.hist[src] if p0 <= e[1] < p1]
        at = {e[1] for e in brought}
        src_ids = {e[0] for e in self.hist[src]}
        if self.unified:
            keep = [e for e in self.hist[dst] if e[1] not in at or e[0] in src_ids]
            have = {e[0] for e in keep}
            self.hist[dst] = keep + [list(e) for e in brought if e[0] not in have]
        else:
            self.hist[dst] = [[self.new_id(), *e[1:]] for e in self.hist[src]]

    def seq_keep(self, s: int) -> None:
        for q in self.hist:
            if q != s:
                self.hist[q] = []


def decode(mem: Any, orc: Oracle, tokens: dict[int, list[int]], n_ubatch: int) -> None:
    """One batch through every cache (K rotated at the token position), each output
    checked against a recompute over the oracle's history."""
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens, output_all=True), mem)
    ctx = mem.init_batch(balloc, n_ubatch)
    assert ctx.status is MemoryStatus.SUCCESS, getattr(ctx, "reason", "")
    # the oracle's view after the batch (a token sees earlier tokens of its batch)
    for s, ts in tokens.items():
        p = orc.pos_max(s) + 1
        orc.hist[s].extend([orc.new_id(), p + k, t, p + k] for k, t in enumerate(ts))
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        subs = [ctx.base, ctx.swa] if isinstance(mem, KVCacheISWA) else [ctx]
        for cache, sub in zip(caches(mem), subs, strict=True):
            for layer in cache.layers:
                il = layer.il
                pos = ub.pos.astype(np.int64)
                sub.cpy_k(il, rope(np.stack([emb(int(t), 1 + il) for t in ub.token]), pos).astype(np.float32))
                sub.cpy_v(il, np.stack([emb(int(t), 100 + il) for t in ub.token]).astype(np.float32))
                mask = sub.mask()
                kb, vb = cache.k[il].numpy(), cache.v[il].numpy()
                for i in range(ub.n_tokens):
                    s, p, t = int(ub.primary[i]), int(pos[i]), int(ub.token[i])
                    base = cache.stream_of(s) * cache.size
                    vis = np.isfinite(mask[i])
                    n_kv = mask.shape[1]
                    got = attention(
                        rope(emb(t, 50 + il), p)[0], kb[base : base + n_kv][vis], vb[base : base + n_kv][vis]
                    )
                    hist = [
                        (pk, tk)
                        for _, pk, tk, _ in orc.hist[s]
                        if pk <= p and not is_masked_swa(cache.n_swa, cache.swa_type, pk, p)
                    ]
                    k = rope(np.stack([emb(tk, 1 + il) for _, tk in hist]), np.array([pk for pk, _ in hist]))
                    v = np.stack([emb(tk, 100 + il) for _, tk in hist])
                    want = attention(rope(emb(t, 50 + il), p)[0], k, v)
                    np.testing.assert_allclose(got, want, atol=2e-4, err_msg=f"seq {s} pos {p} layer {il}")
        if not ctx.next():
            break


def fingerprint(mem: Any) -> tuple[Any, ...]:
    books = tuple(
        (c.stream_of(s), sorted(c.cells[c.stream_of(s)].seq_pos[s]), c.cells[c.stream_of(s)].shift.tolist())
        for c in caches(mem)
        for s in range(N_SEQ)
    )
    return mem.version, books, mem.state_write(-1)


RANGES = st.tuples(st.integers(-1, 14), st.integers(-1, 16))
OPS = st.one_of(
    st.tuples(st.just("decode"), st.dictionaries(st.integers(0, N_SEQ - 1), st.integers(1, 4), min_size=1)),
    st.tuples(st.just("add"), st.integers(0, N_SEQ - 1), RANGES, st.integers(-6, 5)),
    st.tuples(st.just("shift"), st.integers(0, N_SEQ - 1), st.integers(0, 6), st.integers(1, 5)),
    st.tuples(st.just("div"), st.integers(0, N_SEQ - 1), RANGES, st.integers(1, 4)),
    st.tuples(st.just("rm"), st.integers(0, N_SEQ - 1), RANGES),
    st.tuples(st.just("cp"), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1), RANGES),
    st.tuples(st.just("keep"), st.integers(0, N_SEQ - 1)),
    st.tuples(st.just("roundtrip"), st.integers(-1, N_SEQ - 1)),
    st.tuples(st.just("update")),
    st.tuples(st.just("cshift"), st.integers(0, N_SEQ - 1), st.integers(0, 8), st.integers(0, 10)),
)


def norm(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (2**31 - 1 if p1 < 0 else p1)


@pytest.mark.parametrize("kind", ["kv", "kv_streams", "iswa", "iswa_evict"])
@settings(max_examples=EXAMPLES)
@given(program=st.lists(OPS, min_size=3, max_size=14), n_ubatch=st.sampled_from([1, 3, 8]))
def test_position_edits_match_a_rope_recompute(kind: str, program: list[Any], n_ubatch: int) -> None:
    mem = build(kind)
    orc = Oracle(unified=kind != "kv_streams")
    tok = iter(range(1, 10**6))
    decode(mem, orc, {0: [next(tok) for _ in range(5)], 1: [next(tok) for _ in range(3)]}, n_ubatch)
    for op in program:
        if op[0] == "decode":
            run_update(mem)  # the runtime's decode always runs the update first
            if sum(op[1].values()) + sum(len(h) for h in orc.hist.values()) > 30:
                continue
            decode(mem, orc, {s: [next(tok) for _ in range(n)] for s, n in op[1].items()}, n_ubatch)
        elif op[0] in ("add", "div", "shift", "cshift") and not mem.get_can_shift():
            continue  # a cache that evicts promises no shift (get_can_shift): a window would reach lost cells
        elif op[0] in ("add", "div", "shift"):
            if op[0] == "shift":  # context shift: drop [n_keep, n_keep + n_discard), move the rest down
                s, n_keep, n_discard = op[1:]
                p0, p1 = n_keep, n_keep + n_discard
                assert mem.seq_rm(s, p0, p1)
                orc.seq_rm(s, p0, p1)
                q0, q1, f = p1, 2**31 - 1, lambda p, d=n_discard: p - d
                args: tuple[Any, ...] = ("seq_add", s, p1, -1, -n_discard)
            elif op[0] == "add":
                s, (a, b), delta = op[1:]
                (q0, q1), f = norm(a, b), lambda p, d=delta: p + d
                args = ("seq_add", s, a, b, delta)
            else:
                s, (a, b), d = op[1:]
                (q0, q1), f = norm(a, b), lambda p, d=d: p // d
                args = ("seq_div", s, a, b, d)
            moves = q0 < q1 and args[-1] != (0 if args[0] == "seq_add" else 1)
            refused = moves and orc.move_refused(s, q0, q1, f)
            before = fingerprint(mem)
            try:
                getattr(mem, "check_" + args[0])(*args[1:])
                getattr(mem, args[0])(*args[1:])
            except ArgumentError:
                assert refused, f"{args} refused, the oracle allows it: {orc.hist}"
                assert fingerprint(mem) == before
                continue
            assert not refused, f"{args} done, the oracle refuses it: {orc.hist}"
            if moves:
                orc.move(s, q0, q1, f)
        elif op[0] == "rm":
            s, (a, b) = op[1:]
            before = fingerprint(mem)
            can = mem.can_seq_rm(s, a, b)
            if not mem.seq_rm(s, a, b):  # only a window cache that gave up cells refuses
                assert kind == "iswa_evict" and not can and fingerprint(mem) == before, op
                continue
            assert can, op
            orc.seq_rm(s, *norm(a, b))
        elif op[0] == "cp":
            src, dst, (a, b) = op[1:]
            q0, q1 = norm(a, b)
            if kind == "kv_streams" and src != dst and (q0, q1) != (0, 2**31 - 1):
                before = fingerprint(mem)
                with pytest.raises(ArgumentError):
                    mem.seq_cp(src, dst, a, b)
                assert fingerprint(mem) == before
                continue
            mem.seq_cp(src, dst, a, b)
            orc.seq_cp(src, dst, q0, q1)
        elif op[0] == "keep":
            mem.seq_keep(op[1])
            orc.seq_keep(op[1])
        elif op[0] == "update":
            run_update(mem)
        elif op[0] == "cshift":  # the atomic context shift: refused as a whole, or done as a whole
            s, p0, p1 = op[1:]
            after = Oracle(orc.unified)
            after.hist = {q: [list(e) for e in h] for q, h in orc.hist.items()}
            after.next_id = orc.next_id
            refused = False
            if p0 < p1:
                after.seq_rm(s, p0, p1)
                refused = after.move_refused(s, p1, 2**31 - 1, lambda p, d=p1 - p0: p - d)
                if not refused:
                    after.move(s, p1, 2**31 - 1, lambda p, d=p1 - p0: p - d)
            assert mem.can_context_shift(s, p0, p1) is not refused, (op, orc.hist)
            before = fingerprint(mem)
            try:
                mem.context_shift(s, p0, p1)
            except ArgumentError:
                assert refused, (op, orc.hist)
                assert fingerprint(mem) == before
                continue
            assert not refused, (op, orc.hist)
            orc.hist = after.hist
        elif op[0] == "roundtrip":  # a state blob taken while a K-shift may wait
            s = op[1]
            if kind == "kv_streams":
                run_update(mem)  # a copy between streams must land before a blob reads its rows
            blob = mem.state_write(s)
            if s < 0:
                mem = build(kind)
                mem.state_read(blob, s)
            else:
                mem.seq_rm(s)
                mem.state_read(blob, s)
                if orc.unified:  # the read cells are the sequence's own now
                    for e in orc.hist[s]:
                        e[0] = orc.new_id()
        for s in range(N_SEQ):
            assert mem.seq_pos_max(s) == orc.pos_max(s), (op, s)
            if kind == "iswa_evict":  # pos_min is the window cache's (upstream): it gave up earlier cells
                assert mem.seq_pos_min(s) >= orc.pos_min(s), (op, s)
            else:
                assert mem.seq_pos_min(s) == orc.pos_min(s), (op, s)
    run_update(mem)
    decode(mem, orc, {s: [next(tok)] for s in range(N_SEQ)}, n_ubatch)
