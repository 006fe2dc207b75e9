"""Building a memory from a spec: the factory above the memories.

:mod:`statecache.spec` describes what a model's memory holds (data only, below
every memory); this module picks and builds the memory class that holds it, so
it sits above :mod:`statecache.recurrent`, :mod:`statecache.kv_cache` and the
hybrids and nothing below imports it.  (``statecache.spec.make_memory`` still
resolves here for older code.)
"""

from __future__ import annotations

from typing import Any

from statecache.backend import Device
from statecache.hybrid import HybridISWAMemory, HybridMemory
from statecache.hybrid_idx import HybridIdxMemory
from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
from statecache.memory import Memory
from statecache.recurrent import RecurrentMemory
from statecache.spec import MemorySpec, ModelSpec

__all__ = ["make_memory", "make_model_memory"]


def make_memory(
    spec: MemorySpec | ModelSpec,
    device: Device,
    n_seq_max: int,
    n_rs_seq: int = 0,
    **kwargs: Any,
) -> Memory:
    """The memory of a pure-recurrent model (every stateful layer recurrent); a
    :class:`ModelSpec` (attention / indexer layers too) picks its class itself."""
    if isinstance(spec, ModelSpec):
        return make_model_memory(spec, device, n_seq_max, n_rs_seq, **kwargs)
    # n_ctx sizes KV cells, which a recurrent memory has none of; accepted (and unused,
    # as for a pure-recurrent ModelSpec) so that one call builds either spec's memory
    # (docs/distributed.md: ``make_memory(spec.shard(r, t), ..., n_ctx=n_ctx)``).
    kwargs.pop("n_ctx", None)
    return RecurrentMemory(spec, device, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq, **kwargs)


def make_model_memory(
    spec: ModelSpec,
    device: Device,
    n_seq_max: int,
    n_rs_seq: int = 0,
    *,
    n_ctx: int,
    unified: bool = True,
    n_ubatch: int = 512,
    swa_full: bool = False,
    n_pad: int = 256,
    k_shift: Any = None,
) -> Memory:
    """Pure attention (KVCache / KVCacheISWA), pure recurrent, hybrid, hybrid-iSWA
    or hybrid-idx, as the spec says.

    What sizes what (docs/memory-semantics.md#defaults):

    * ``n_ctx``: positions *per sequence*.  A unified cache (the default) gets
      ``n_ctx * n_seq_max`` cells shared by all sequences (one long sequence
      may then use more than ``n_ctx`` of them); ``unified=False`` gives each
      sequence a stream of ``n_ctx`` cells.  (llama.cpp's ``n_ctx`` is the
      total of a unified cache instead.)
    * ``n_ubatch`` (512): sizes the window cache of an iSWA pair (it must
      hold a whole ubatch besides the windows); plan with at most this many
      tokens per ubatch.
    * ``n_pad`` (256): rounds ``n_kv`` and the window cache up.
    * The recurrent part has ``n_seq_max`` cells and ``n_rs_seq`` snapshot
      planes (0: no rollback); a hybrid-iSWA window keeps ``n_rs_seq`` more
      positions per sequence.
    * ``k_shift``: the runtime's K re-rotation hook (None: the runtime rotates
      K from the update context itself, and ``state_write`` refuses rows a
      shift still waits for)."""
    kind = spec.kind
    if kind == "recurrent":
        return RecurrentMemory(spec.recurrent, device, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq)
    layers = [KVLayer(il, a.n_embd_k, a.n_embd_v) for il, a in sorted(spec.attention.items())]
    size = n_ctx * n_seq_max if unified else n_ctx
    common: dict[str, Any] = dict(n_seq_max=n_seq_max, unified=unified, dtype=spec.kv_dtype, n_pad=n_pad)
    if kind in ("attention_iswa", "hybrid_iswa"):
        swa_layers = [il for il, a in spec.attention.items() if a.swa]
        attn: Any = KVCacheISWA(
            device, layers, swa_layers, size=size, n_ubatch=n_ubatch, n_swa=spec.n_swa,
            swa_type=spec.swa_type, swa_full=swa_full, k_shift=k_shift,
            # a hybrid's window keeps what its recurrent part can roll back to; sized
            # here, or the hybrid raises the depth later without the room for it
            rollback_depth=n_rs_seq if kind == "hybrid_iswa" else 0, **common,
        )  # fmt: skip
    else:
        attn = KVCache(device, layers, size=size, k_shift=k_shift, **common)
    if kind.startswith("attention"):
        attention_only: Memory = attn
        return attention_only
    recr = RecurrentMemory(spec.recurrent, device, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq)
    if kind == "hybrid_idx":
        ix = spec.indexer
        assert ix is not None  # ModelSpec.kind says "hybrid_idx" only when there is an indexer
        return HybridIdxMemory(
            attn, recr, ix.layers, head_size=ix.head_size, row_factor=ix.row_factor, kpool=ix.kpool,
            by_order=ix.by_order,
        )  # fmt: skip
    return HybridISWAMemory(attn, recr) if kind == "hybrid_iswa" else HybridMemory(attn, recr)
