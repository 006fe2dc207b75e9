"""Hunt 27: tensor-parallel checkpoints of the delta-rule families, by the model's semantics.

A GDN layer (both q/k head maps: ``tiled``, value head h reads key head h % Hk,
and ``grouped``, h // (Hv / Hk)) and a KDA layer decode through an unsharded
memory; the checkpoint taken there is scattered over t = 2 (and resharded to
t = 4 and back to t = 1), and each rank continues with *its own* model: the
conv channels and heads it holds, chosen here from the head map's definition,
not from statecache's shard maps, each rank's step passing the local head map.
Gathering the ranks' checkpoints must give, bitwise on the reference device,
the checkpoint of the unsharded memory after the same continuation (per head
and per channel the math is the same, in the same order).  A world that does
not divide the key heads is refused naming them.
"""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.batch import Batch, BatchAllocator
from statecache.distributed import gather_state, reshard, restore_shard, save_shard, scatter_state
from statecache.errors import ArgumentError
from statecache.memory import StateFlags
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec, RecurrentLayerSpec

DEV = statecache.get_device("reference")
VOCAB, S, D_CONV = 8, 3, 3


def _v_heads(head_map: str, Hv: int, Hk: int, k_heads: np.ndarray) -> np.ndarray:
    """The value heads that read the key heads ``k_heads``, in increasing order."""
    reads = np.arange(Hv) % Hk if head_map == "tiled" else np.arange(Hv) // (Hv // Hk)
    return np.flatnonzero(np.isin(reads, k_heads))


class Layer:
    """One delta-rule layer's tables; ``part(rank, world)`` is the layer one rank holds."""

    def __init__(self, family: str, Hv: int, Hk: int, head_map: str) -> None:
        self.family, self.Hv, self.Hk, self.head_map = family, Hv, Hk, head_map
        rng = np.random.default_rng(11)
        ch = (2 * Hk + Hv) * S
        gshape = (VOCAB, Hv, S) if family == "kda" else (VOCAB, Hv)
        self.emb = rng.normal(0, 0.5, (VOCAB, ch)).astype(np.float32)
        self.conv = rng.normal(0, 0.5, (ch, D_CONV)).astype(np.float32)
        self.g = -rng.uniform(0.05, 1.0, gshape).astype(np.float32)
        self.beta = rng.uniform(0.1, 0.9, (VOCAB, Hv)).astype(np.float32)

    def spec(self) -> RecurrentLayerSpec:
        if self.family == "kda":
            return RecurrentLayerSpec.kda(n_head=self.Hv, head_dim=S, d_conv=D_CONV)
        return RecurrentLayerSpec.gdn(
            n_head=self.Hv, head_dim=S, d_conv=D_CONV, n_head_k=self.Hk, head_map=self.head_map
        )

    def part(self, rank: int, world: int) -> Layer:
        hk = self.Hk // world
        k_heads = np.arange(rank * hk, (rank + 1) * hk)
        v_heads = _v_heads(self.head_map, self.Hv, self.Hk, k_heads)
        blocks = lambda heads, base: (base + heads[:, None] * S + np.arange(S)).ravel()  # noqa: E731
        ch = np.concatenate([blocks(k_heads, 0), blocks(k_heads, self.Hk * S), blocks(v_heads, 2 * self.Hk * S)])
        out = object.__new__(Layer)
        out.family, out.Hv, out.Hk, out.head_map = self.family, v_heads.size, hk, self.head_map
        out.emb, out.conv = self.emb[:, ch], self.conv[ch]
        out.g, out.beta = self.g[:, v_heads], self.beta[:, v_heads]
        return out

    def forward(self, step, toks: np.ndarray) -> None:  # type: ignore[no-untyped-def]
        n_s, n_t = toks.shape
        x = DEV.upload(self.emb[toks])
        y = DEV.alloc(x.shape)
        step.conv(0, x, DEV.upload(self.conv), y, apply_silu=True)
        qkv = DEV.download(y)
        unit = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
        Hk, Hv = self.Hk, self.Hv
        q = unit(qkv[..., : Hk * S].reshape(n_s, n_t, Hk, S))
        k = unit(qkv[..., Hk * S : 2 * Hk * S].reshape(n_s, n_t, Hk, S))
        v = qkv[..., 2 * Hk * S :].reshape(n_s, n_t, Hv, S)
        args = [DEV.upload(np.ascontiguousarray(a, dtype=np.float32)) for a in (q, k, v, self.g[toks], self.beta[toks])]
        step.delta(0, *args, DEV.alloc((n_s, n_t, Hv, S)), head_map=self.head_map)


def _memory(layer: Layer, spec: MemorySpec) -> RecurrentMemory:
    mem = RecurrentMemory(spec, DEV, n_seq_max=2, n_rs_seq=2)
    for k, buf in enumerate(mem.pools[0].values()):
        DEV.fill_bytes(buf, 5 + k)
    return mem


def _decode(mem: RecurrentMemory, layer: Layer, batch: dict[int, list[int]]) -> None:
    balloc = BatchAllocator(mem.n_seq_max)
    balloc.init(Batch.for_sequences(batch, output_all=True), mem)
    ctx = mem.init_batch(balloc, 512)
    assert not ctx.status.is_fail
    while True:
        ub = ctx.get_ubatch()
        assert ctx.apply()
        layer.forward(ctx.step(), ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
        if not ctx.next():
            break


CASES = [("gdn", 8, 4, "tiled"), ("gdn", 8, 4, "grouped"), ("gdn", 4, 2, "grouped"), ("kda", 4, 4, "tiled")]


@pytest.mark.parametrize(("family", "Hv", "Hk", "head_map"), CASES)
@pytest.mark.parametrize("planes", [False, True])
def test_ranks_continue_a_checkpoint_as_the_unsharded_model(
    family: str, Hv: int, Hk: int, head_map: str, planes: bool
) -> None:
    layer = Layer(family, Hv, Hk, head_map)
    spec = MemorySpec.build(1, {0: layer.spec()})
    flags = StateFlags.WITH_PLANES if planes else StateFlags.NONE
    full = _memory(layer, spec)
    _decode(full, layer, {0: [1, 2, 3, 4, 5], 1: [6, 7]})
    blob = full.state_write(-1, flags)
    more = [{0: [2, 6], 1: [3]}, {1: [5, 1, 4]}]
    for world in (2, 4):
        if Hk % world:
            continue
        parts = scatter_state(blob, spec, world) if world == 2 else reshard(scatter_state(blob, spec, 2), spec, world)
        ranks = []
        for rank, part in enumerate(parts):
            mem = _memory(layer, spec.shard(rank, world))
            restore_shard(mem, part, rank, world, -1, flags)
            ranks.append(mem)
            for batch in more:
                _decode(mem, layer.part(rank, world), batch)
        gathered = gather_state([save_shard(m, r, world, -1, flags) for r, m in enumerate(ranks)], spec)
        one = _memory(layer, spec)  # back to t = 1, continuing as the unsharded memory does
        one.state_read(blob, -1, flags)
        for batch in more:
            _decode(one, layer, batch)
        assert gathered == one.state_write(-1, flags), (family, head_map, world)
        if planes:  # the planes came along: a rollback after the gather is exact too
            back = _memory(layer, spec)
            back.state_read(gathered, -1, flags)
            assert back.seq_rm(1, back.seq_pos_max(1) - 1, -1) and one.seq_rm(1, one.seq_pos_max(1) - 1, -1)
            _decode(back, layer, {1: [7]})
            _decode(one, layer, {1: [7]})
            assert back.state_write(1) == one.state_write(1)


@pytest.mark.parametrize("head_map", ["tiled", "grouped"])
def test_a_world_that_does_not_divide_the_key_heads_is_refused_naming_them(head_map: str) -> None:
    layer = Layer("gdn", 8, 4, head_map)
    spec = MemorySpec.build(1, {0: layer.spec()})
    full = _memory(layer, spec)
    _decode(full, layer, {0: [1, 2, 3]})
    for world in (3, 8):
        with pytest.raises(ArgumentError) as err:
            scatter_state(full.state_write(-1), spec, world)
        assert err.value.argument in ("n_head_k", "n_head"), err.value
