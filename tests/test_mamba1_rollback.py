"""Mamba-1 rolls back like every other family (issue 15 item 6): its scan
writes snapshot planes, so a memory of a Mamba-1 model with rollback planes
undoes speculative tokens exactly, on every device that runs the suite here
(the reference and the C backend)."""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec, RecurrentLayerSpec

VOCAB, D_INNER, D_STATE, D_CONV = 16, 8, 4, 3


class Tables:
    """Every primitive input a fixed function of the token id."""

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        f = np.float32
        self.conv_x = rng.normal(0, 0.5, (VOCAB, D_INNER)).astype(f)
        self.conv_w = rng.normal(0, 0.5, (D_INNER, D_CONV)).astype(f)
        self.x = rng.normal(0, 0.5, (VOCAB, D_INNER, 1)).astype(f)
        self.dt = rng.normal(-1.0, 0.5, (VOCAB, D_INNER)).astype(f)
        self.A = -np.abs(rng.normal(1.0, 0.3, (D_INNER, D_STATE))).astype(f)
        self.B = rng.normal(0, 0.5, (VOCAB, 1, D_STATE)).astype(f)
        self.C = rng.normal(0, 0.5, (VOCAB, 1, D_STATE)).astype(f)


def layer(dev, step_or_pools, t: Tables, toks: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Conv and scan of the one Mamba-1 layer for tokens [n_s, n_t]; outputs [n_s, n_t, 2 * D_INNER]."""
    n_s, n_t = toks.shape
    xc, wc, yc = dev.upload(t.conv_x[toks]), dev.upload(t.conv_w), dev.alloc((n_s, n_t, D_INNER))
    args = [dev.upload(a) for a in (t.x[toks], t.dt[toks], t.A, t.B[toks], t.C[toks])]
    ys = dev.alloc((n_s, n_t, D_INNER, 1))
    if isinstance(step_or_pools, tuple):
        pools, rows = step_or_pools
        dev.ssm_conv(pools["r"], rows, rows, xc, wc, yc)
        dev.ssm_scan(pools["s"], rows, rows, *args, ys)
    else:
        step_or_pools.conv(0, xc, wc, yc)
        step_or_pools.scan(0, *args, ys)
    return np.concatenate([yc.numpy().reshape(n_s, n_t, -1), ys.numpy().reshape(n_s, n_t, -1)], axis=-1)


@pytest.fixture(params=["reference", "cpu"])
def dev(request):  # type: ignore[no-untyped-def]
    return statecache.get_device(request.param)


def test_mamba1_speculative_rollback_equals_recompute(dev) -> None:  # type: ignore[no-untyped-def]
    spec = MemorySpec.build(1, {0: RecurrentLayerSpec.mamba1(d_inner=D_INNER, d_state=D_STATE, d_conv=D_CONV)})
    mem = RecurrentMemory(spec, dev, n_seq_max=2, n_rs_seq=3)
    assert mem.n_rs_seq == 3
    for k, buf in enumerate(mem.pools[0].values()):
        dev.fill_bytes(buf, 40 + k)  # garbage: nothing may rely on zeroed memory
    t = Tables()
    hist: dict[int, list[int]] = {0: [], 1: []}

    def feed(batch: dict[int, list[int]]) -> dict[tuple[int, int], np.ndarray]:
        balloc = BatchAllocator(mem.n_seq_max)
        balloc.init(Batch.for_sequences(batch, output_all=True), mem)
        ctx = mem.init_batch(balloc, 64)
        out = {}
        while True:
            ub = ctx.get_ubatch()
            assert ctx.apply()
            y = layer(dev, ctx.step(), t, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
            for s in range(ub.n_seqs):
                for j in range(ub.n_seq_tokens):
                    i = s * ub.n_seq_tokens + j
                    out[(int(ub.seq_id[i][0]), int(ub.pos[i]))] = y[s, j]
            if not ctx.next():
                break
        for s, toks in batch.items():
            hist[s] += toks
        return out

    def recompute(tokens: list[int]) -> np.ndarray:
        pools = {n: dev.alloc((1, size)) for n, size in spec.layers[0].row_sizes.items()}
        return layer(dev, (pools, dev.indices([0])), t, np.asarray([tokens]))[0]

    feed({0: [1, 2, 3, 4], 1: [5, 6]})
    feed({0: [7, 8, 9], 1: [10, 11, 12]})  # speculative drafts: 3 tokens each
    assert mem.seq_rm(0, 5, -1)  # accept 1 of sequence 0's 3 draft tokens
    assert mem.seq_rm(1, 3, -1)  # accept 1 of sequence 1's 3
    hist[0], hist[1] = hist[0][:5], hist[1][:3]
    out = feed({0: [13], 1: [14]})
    for s in (0, 1):
        want = recompute(hist[s])
        np.testing.assert_allclose(out[(s, len(hist[s]) - 1)], want[-1], atol=2e-5, err_msg=f"sequence {s}")
    assert not mem.seq_rm(0, 1, -1)  # five tokens back: beyond the planes, refused
    assert mem.seq_pos_max(0) == len(hist[0]) - 1
