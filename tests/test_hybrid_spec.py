"""MemorySpec grows attention and indexer layers (ModelSpec); make_memory picks the class."""

from __future__ import annotations

import pytest
from recurrent_toy import toy_spec

import statecache
from statecache.errors import ArgumentError
from statecache.hybrid import HybridISWAMemory, HybridMemory
from statecache.hybrid_idx import HybridIdxMemory
from statecache.kv_cache import KVCache, KVCacheISWA
from statecache.recurrent import RecurrentMemory
from statecache.spec import AttentionLayerSpec, IndexerSpec, ModelSpec, make_memory

MiB = 2**20


@pytest.fixture(scope="module")
def dev():
    return statecache.get_device("reference")


def test_seed_example_768_mib():
    """12 attention layers, 4 KV heads of 128, f16, 4 sequences x 8192 positions = 768 MiB."""
    spec = ModelSpec.build(12, attention={i: AttentionLayerSpec(4, 128) for i in range(12)}, kv_dtype="f16")
    assert spec.kind == "attention"
    assert spec.memory_breakdown(n_seq_max=4, n_ctx=8192) == {"device": 768 * MiB}


def test_seed_example_allocated(dev):
    spec = ModelSpec.build(12, attention={i: AttentionLayerSpec(4, 128) for i in range(12)}, kv_dtype="f16")
    mem = make_memory(spec, dev, 4, n_ctx=8192)
    assert isinstance(mem, KVCache)
    assert mem.memory_breakdown() == {dev.id: 768 * MiB}


def hybrid_spec(**kw):
    rec = toy_spec()
    return ModelSpec.build(
        3, recurrent={i: rec.layers[i] for i in rec.recurrent_layers}, attention={1: AttentionLayerSpec(2, 4, **kw)}
    )


def test_make_memory_picks_the_class(dev):
    rec = toy_spec()
    assert isinstance(make_memory(rec, dev, 2), RecurrentMemory)
    only_r = ModelSpec.build(3, recurrent={i: rec.layers[i] for i in rec.recurrent_layers})
    assert isinstance(make_memory(only_r, dev, 2, n_ctx=16), RecurrentMemory)
    h = make_memory(hybrid_spec(), dev, 2, n_ctx=16)
    assert type(h) is HybridMemory and h.attn.size == 32
    spec_swa = ModelSpec.build(
        3, recurrent={0: rec.layers[0]}, attention={1: AttentionLayerSpec(2, 4, swa=True), 2: AttentionLayerSpec(2, 4)},
        n_swa=8,
    )  # fmt: skip
    hs = make_memory(spec_swa, dev, 2, n_ctx=512, n_ubatch=16, n_pad=32)
    assert isinstance(hs, HybridISWAMemory) and hs.attn.swa.size == 32 and hs.attn.base.size == 1024
    spec_idx = ModelSpec.build(
        3, recurrent={i: rec.layers[i] for i in rec.recurrent_layers}, attention={1: AttentionLayerSpec(2, 4)},
        indexer=IndexerSpec((1,), head_size=2, row_factor=3, kpool=4),
    )  # fmt: skip
    hi = make_memory(spec_idx, dev, 2, n_ctx=16)
    assert isinstance(hi, HybridIdxMemory) and hi.idx.k[1].shape == (32, 6)
    assert spec_idx.memory_breakdown(2, 16)["device"] == sum(hi.memory_breakdown().values())
    pure_swa = ModelSpec.build(
        2, attention={0: AttentionLayerSpec(1, 4, swa=True), 1: AttentionLayerSpec(1, 4)}, n_swa=4
    )
    assert isinstance(make_memory(pure_swa, dev, 1, n_ctx=64, n_ubatch=8, n_pad=8), KVCacheISWA)


def test_hybrid_breakdown_sums_parts(dev):
    spec = hybrid_spec()
    mem = make_memory(spec, dev, 3, n_ctx=8)
    assert spec.memory_breakdown(3, 8) == {"device": sum(mem.memory_breakdown().values())}


def test_spec_rejects_bad_layer_maps():
    rec = toy_spec()
    with pytest.raises(ArgumentError, match="both recurrent and attention"):
        ModelSpec.build(3, recurrent={0: rec.layers[0]}, attention={0: AttentionLayerSpec(1, 4)})
    with pytest.raises(ArgumentError, match="n_swa"):
        ModelSpec.build(3, attention={1: AttentionLayerSpec(1, 4, swa=True)})
    with pytest.raises(ArgumentError, match="indexer"):
        ModelSpec.build(3, attention={1: AttentionLayerSpec(1, 4)}, indexer=IndexerSpec((1,), 2))
