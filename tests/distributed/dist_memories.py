"""Small memories of every kind with sequences in their books, for the in-process tests."""

from __future__ import annotations

from statecache.batch import Batch, BatchAllocator
from statecache.factory import make_memory
from statecache.spec import AttentionLayerSpec, IndexerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec

GDN = RecurrentLayerSpec.gdn(n_head=4, head_dim=2, d_conv=3, n_head_k=2)
M2 = RecurrentLayerSpec.mamba2(d_inner=8, d_state=2, d_conv=3, n_group=2, head_dim=2)
RWKV = RecurrentLayerSpec.rwkv7(n_embd=4, head_size=2)
SPECS = {
    "hybrid_iswa": ModelSpec.build(
        3, recurrent={0: GDN}, attention={1: AttentionLayerSpec(2, 4, swa=True), 2: AttentionLayerSpec(2, 4, 6)},
        n_swa=4, kv_dtype="f16",
    ),
    "hybrid_idx": ModelSpec.build(
        3, recurrent={0: M2}, attention={1: AttentionLayerSpec(2, 4), 2: AttentionLayerSpec(4, 2)},
        indexer=IndexerSpec((1,), head_size=2), kv_dtype="bf16",
    ),
    "recurrent": MemorySpec.build(4, {0: M2, 1: RWKV, 3: RecurrentLayerSpec.shortconv(n_embd=4, l_cache=3)}),
}  # fmt: skip


def build(spec, dev, n_seq_max=3):
    if isinstance(spec, MemorySpec):
        return make_memory(spec, dev, n_seq_max)
    return make_memory(spec, dev, n_seq_max, n_ctx=16, n_ubatch=8, n_pad=8)


def place(mem, tokens_by_seq):
    """Commit a batch to the book without computing anything (the rows keep their garbage)."""
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(tokens_by_seq), mem)
    ctx = mem.init_batch(balloc, 8)
    assert not ctx.status.is_fail
    while True:
        assert ctx.apply()
        if not ctx.next():
            break


def garbage_memory(kind, dev, seed):
    mem = build(SPECS[kind], dev)
    if hasattr(mem, "fill_garbage"):
        mem.fill_garbage(seed)
    else:
        for k, pools in enumerate(mem.pools.values()):
            for j, buf in enumerate(pools.values()):
                dev.fill_bytes(buf, seed + 10 * k + j)
    place(mem, {0: [1, 2, 3, 4, 5], 2: [6, 7]})
    place(mem, {0: [8], 1: [9, 1, 2]})
    return mem
