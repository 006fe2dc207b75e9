"""The conformance suite's tiny hybrid model (statecache.conformance.model), run
tensor-parallel: rank r of t holds its heads' weights and its shard of the memory.

The model code itself runs unchanged.  Its mixers read their head counts from
module constants at call time, so :func:`local_dims` sets them to one rank's
share while that rank computes; the output projections are row-parallel, so
each returns a partial sum that :class:`RowParallel` all-reduces where the
model multiplies by it (``y @ p["out"]``).  Which weight rows and columns a
rank holds is written here from the model's own semantics (Mamba-2 heads with
their B/C groups, GDN key heads with the value heads that read them, value
head h reading key head h % Hk; attention K/V heads with their query heads),
independently of statecache's shard maps, so the test checks those maps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from statecache.batch import Batch, BatchAllocator
from statecache.conformance import model as M


@contextlib.contextmanager
def local_dims(world: int) -> Iterator[None]:
    """The model's head counts as one rank of ``world`` holds them (only inside the block)."""
    names = ("M_HEADS", "M_GROUPS", "M_INNER", "M_CH", "G_HEADS", "G_HEADS_K", "G_CH", "A_HEADS", "A_HEADS_KV")
    saved = {n: getattr(M, n) for n in names}
    m_heads, m_groups = M.M_HEADS // world, M.M_GROUPS // world
    g_heads, g_heads_k = M.G_HEADS // world, M.G_HEADS_K // world
    local = {
        "M_HEADS": m_heads,
        "M_GROUPS": m_groups,
        "M_INNER": m_heads * M.M_HEAD_DIM,
        "M_CH": m_heads * M.M_HEAD_DIM + 2 * m_groups * M.M_STATE,
        "G_HEADS": g_heads,
        "G_HEADS_K": g_heads_k,
        "G_CH": (2 * g_heads_k + g_heads) * M.G_SIZE,
        "A_HEADS": M.A_HEADS // world,
        "A_HEADS_KV": M.A_HEADS_KV // world,
    }
    try:
        for n, v in local.items():
            setattr(M, n, v)
        yield
    finally:
        for n, v in saved.items():
            setattr(M, n, v)


class RowParallel:
    """A row-parallel output projection: ``y @ RowParallel(w)`` is the all-reduced
    sum of every rank's ``y_local @ w_local``."""

    __array_ufunc__ = None  # make numpy hand ``ndarray @ self`` to __rmatmul__

    def __init__(self, w: np.ndarray, allreduce: Callable[[np.ndarray], np.ndarray]) -> None:
        self.w = w
        self.allreduce = allreduce

    def __rmatmul__(self, y: np.ndarray) -> np.ndarray:
        return self.allreduce(np.ascontiguousarray(y @ self.w, dtype=np.float32))


def _blocks(heads: Any, width: int) -> np.ndarray:
    return (np.asarray(heads, dtype=np.int64)[:, None] * width + np.arange(width)).ravel()


def shard_weights(w: M.Weights, rank: int, world: int, allreduce: Callable[[np.ndarray], np.ndarray]) -> M.Weights:
    """Rank ``rank``'s weights: column-parallel input projections, row-parallel outputs."""
    per_layer = []
    for kind, p in zip(w.layers, w.per_layer, strict=True):
        if kind == "mamba2":
            h = M.M_HEADS // world
            g = M.M_GROUPS // world
            heads = np.arange(rank * h, (rank + 1) * h)
            groups = np.arange(rank * g, (rank + 1) * g)  # heads are repeat-interleaved over groups
            x = _blocks(heads, M.M_HEAD_DIM)
            ch = np.concatenate([x, M.M_INNER + _blocks(groups, M.M_STATE), M.M_INNER + M.M_GROUPS * M.M_STATE
                                 + _blocks(groups, M.M_STATE)])  # fmt: skip
            q = {"in": p["in"][:, ch], "dt": p["dt"][:, heads], "A": p["A"][heads], "conv": p["conv"][ch],
                 "bias": p["bias"][ch], "out": p["out"][x]}  # fmt: skip
        elif kind == "gdn":
            hk = M.G_HEADS_K // world
            k_heads = np.arange(rank * hk, (rank + 1) * hk)
            v_heads = [h for h in range(M.G_HEADS) if h % M.G_HEADS_K in k_heads]
            S = M.G_SIZE
            ch = np.concatenate([_blocks(k_heads, S), M.G_HEADS_K * S + _blocks(k_heads, S),
                                 2 * M.G_HEADS_K * S + _blocks(v_heads, S)])  # fmt: skip
            q = {"in": p["in"][:, ch], "gate": p["gate"][:, v_heads], "beta": p["beta"][:, v_heads],
                 "conv": p["conv"][ch], "bias": p["bias"][ch], "out": p["out"][_blocks(v_heads, S)]}  # fmt: skip
        else:
            kv = M.A_HEADS_KV // world
            kv_heads = np.arange(rank * kv, (rank + 1) * kv)
            q_heads = [h for h in range(M.A_HEADS) if h // (M.A_HEADS // M.A_HEADS_KV) in kv_heads]
            qc, kc = _blocks(q_heads, M.A_DIM), _blocks(kv_heads, M.A_DIM)
            q = {"q": p["q"][:, qc], "k": p["k"][:, kc], "v": p["v"][:, kc], "out": p["out"][qc]}
        q["out"] = RowParallel(np.ascontiguousarray(q["out"]), allreduce)
        per_layer.append({k: v if isinstance(v, RowParallel) else np.ascontiguousarray(v) for k, v in q.items()})
    return dataclasses.replace(w, per_layer=per_layer)


def decode(
    mem: Any, weights: M.Weights, tokens_by_seq: dict[int, list[int]], world: int = 1, check: Any = None
) -> dict[int, np.ndarray]:
    """Run one batch through ``mem`` (a hybrid memory of the model, or of one rank's
    shard when ``world > 1``); returns each sequence's logits ``[n_tokens, VOCAB]``.
    ``check``: a :class:`~statecache.distributed.BookCheck` that checks the books at every apply."""
    dev = mem.device
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens_by_seq, output_all=True), mem)
    ctx = mem.init_batch(balloc, 512)
    assert not ctx.status.is_fail, ctx.status
    if check is not None:
        ctx = check.wrap(ctx)
    got: dict[int, dict[int, np.ndarray]] = {}
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        toks = ub.token.reshape(ub.n_seqs, ub.n_seq_tokens)
        with local_dims(world) if world > 1 else contextlib.nullcontext():
            logits = M.forward(dev, M.StepMixers(dev, ctx.recr.step(), ctx.attn), weights, toks)
        for s in range(ub.n_seqs):
            for t in range(ub.n_seq_tokens):
                i = s * ub.n_seq_tokens + t
                for q in ub.seq_id[i]:
                    got.setdefault(q, {})[int(ub.pos[i])] = logits[s, t]
        if not ctx.next():
            break
    return {q: np.stack([by_pos[p] for p in sorted(by_pos)]) for q, by_pos in got.items()}


def make_memory(dev: Any, spec: Any, n_seq_max: int = 2, n_ctx: int = 48, **kw: Any) -> Any:
    """A hybrid memory of ``spec`` (the model's, or a shard of it)."""
    from statecache.factory import make_memory as factory

    return factory(spec, dev, n_seq_max, kw.pop("n_rs_seq", 0), n_ctx=n_ctx, n_pad=8, **kw)
