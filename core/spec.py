"""What a model's recurrent memory holds: per-layer state sizes per family (spec §2.1).

A :class:`MemorySpec` lists the model's layers (``n_layer`` counts every
layer, attention ones too) and, for each recurrent layer, its
:class:`RecurrentLayerSpec`: the state tensors (conv window ``r`` and scan /
delta / wkv state ``s``, plus optional extras) with their row sizes in
elements.  The family constructors compute those sizes from the usual
hyperparameters.  :meth:`MemorySpec.memory_breakdown` gives the bytes per
device a recurrent memory allocates; :func:`make_memory` builds the memory
for a pure-recurrent model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from statecache.dtypes import DType
from statecache.errors import ArgumentError

if TYPE_CHECKING:
    from statecache.backend import Device
    from statecache.recurrent import RecurrentMemory

#: Families whose every state tensor gets snapshot planes from the primitives, so
#: rollback (n_rs_seq > 0) is exact for them (Mamba-1's scan writes snapshot
#: planes like Mamba-2's since protocol 2).  The RWKV wkv kernels are not part of
#: our primitive set: a memory of such a model refuses rollback planes.
ROLLBACK_FAMILIES = frozenset({"mamba1", "mamba2", "gdn", "kda", "shortconv"})


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """One per-layer state tensor: ``name`` (``"r"`` conv / token shift, ``"s"``
    scan / delta / wkv state, ``"p"`` extra conv history) and its row size in elements."""

    name: str
    row_size: int

    def __post_init__(self) -> None:
        if self.row_size <= 0:
            raise ArgumentError("row_size", f"state tensor {self.name!r} needs a positive row size")


@dataclasses.dataclass(frozen=True)
class RecurrentLayerSpec:
    """The state tensors of one recurrent layer, and the shape parameters the
    recurrent step needs (``params``: d_conv, channels, n_head, head_dim, ...)."""

    family: str
    tensors: tuple[StateTensor, ...]
    params: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def row_sizes(self) -> dict[str, int]:
        return {t.name: t.row_size for t in self.tensors}

    @property
    def rollback_capable(self) -> bool:
        return self.family in ROLLBACK_FAMILIES

    # -- family constructors (hyperparameters -> row sizes, spec §2.1) ----------
    @classmethod
    def mamba1(cls, *, d_inner: int, d_state: int, d_conv: int) -> RecurrentLayerSpec:
        # Mamba-1 is Mamba-2 with head_dim 1, n_head = d_inner, one group (B, C not convolved).
        return cls(
            "mamba1",
            (StateTensor("r", (d_conv - 1) * d_inner), StateTensor("s", d_state * d_inner)),
            {"d_conv": d_conv, "channels": d_inner, "n_head": d_inner, "head_dim": 1, "d_state": d_state},
        )

    @classmethod
    def mamba2(cls, *, d_inner: int, d_state: int, d_conv: int, n_group: int, head_dim: int) -> RecurrentLayerSpec:
        if d_inner % head_dim:
            raise ArgumentError("head_dim", f"{head_dim} must divide d_inner {d_inner}")
        channels = d_inner + 2 * n_group * d_state  # x, B and C go through the conv
        return cls(
            "mamba2",
            (StateTensor("r", (d_conv - 1) * channels), StateTensor("s", d_state * d_inner)),
            {
                "d_conv": d_conv,
                "channels": channels,
                "n_head": d_inner // head_dim,
                "head_dim": head_dim,
                "d_state": d_state,
                "n_group": n_group,
            },
        )

    @classmethod
    def gdn(cls, *, n_head: int, head_dim: int, d_conv: int, n_head_k: int | None = None) -> RecurrentLayerSpec:
        """Gated delta net (Qwen3-Next style): q, k, v convolved (3 * n_head * head_dim
        channels when q/k have as many heads as v), state head_dim^2 per value head."""
        hk = n_head if n_head_k is None else n_head_k
        channels = (2 * hk + n_head) * head_dim
        return cls(
            "gdn",
            (StateTensor("r", (d_conv - 1) * channels), StateTensor("s", head_dim * head_dim * n_head)),
            {"d_conv": d_conv, "channels": channels, "n_head": n_head, "n_head_k": hk, "head_dim": head_dim},
        )

    @classmethod
    def kda(cls, *, n_head: int, head_dim: int, d_conv: int) -> RecurrentLayerSpec:
        channels = 3 * n_head * head_dim
        return cls(
            "kda",
            (StateTensor("r", (d_conv - 1) * channels), StateTensor("s", head_dim * head_dim * n_head)),
            {"d_conv": d_conv, "channels": channels, "n_head": n_head, "n_head_k": n_head, "head_dim": head_dim},
        )

    @classmethod
    def rwkv6(cls, *, n_embd: int, head_size: int, token_shift_count: int = 2) -> RecurrentLayerSpec:
        return cls(
            "rwkv6",
            (StateTensor("r", token_shift_count * n_embd), StateTensor("s", n_embd * head_size)),
            {"n_embd": n_embd, "head_size": head_size},
        )

    @classmethod
    def rwkv7(cls, *, n_embd: int, head_size: int, token_shift_count: int = 2) -> RecurrentLayerSpec:
        spec = cls.rwkv6(n_embd=n_embd, head_size=head_size, token_shift_count=token_shift_count)
        return dataclasses.replace(spec, family="rwkv7")

    @classmethod
    def shortconv(cls, *, n_embd: int, l_cache: int) -> RecurrentLayerSpec:
        """LFM2 short conv: only a conv window of L_cache - 1 columns."""
        return cls("shortconv", (StateTensor("r", n_embd * (l_cache - 1)),), {"d_conv": l_cache, "channels": n_embd})


@dataclasses.dataclass(frozen=True)
class MemorySpec:
    """A model's layer map.  ``layers[i]`` is the spec of layer ``i`` or None for a
    layer without recurrent state (attention, MLP-only)."""

    layers: tuple[RecurrentLayerSpec | None, ...]
    dtype: DType = DType.F32

    @classmethod
    def build(
        cls,
        n_layer: int,
        recurrent: Mapping[int, RecurrentLayerSpec],
        dtype: DType | str = DType.F32,
    ) -> MemorySpec:
        bad = [i for i in recurrent if not 0 <= i < n_layer]
        if bad:
            raise ArgumentError("recurrent", f"layer indices {bad} outside [0, {n_layer})")
        return cls(tuple(recurrent.get(i) for i in range(n_layer)), DType.parse(dtype))

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, spec in enumerate(self.layers) if spec is not None]

    @property
    def rollback_capable(self) -> bool:
        return all(spec.rollback_capable for spec in self.layers if spec is not None)

    def effective_n_rs_seq(self, n_rs_seq: int) -> int:
        """Rollback planes a memory of this model allocates: ``n_rs_seq`` itself, or
        0 for a model without recurrent layers (rollback then only moves positions).

        :raises ArgumentError: ``n_rs_seq`` is negative, or positive while a recurrent
            layer's family cannot write snapshot planes (not in
            :data:`ROLLBACK_FAMILIES`): asking for rollback must fail loudly at
            construction, not give a memory whose every rollback is refused.
        """
        if n_rs_seq < 0:
            raise ArgumentError("n_rs_seq", f"must be >= 0, got {n_rs_seq}")
        if not self.recurrent_layers:
            return 0
        if n_rs_seq > 0 and not self.rollback_capable:
            families = sorted({spec.family for spec in self.layers if spec is not None and not spec.rollback_capable})
            raise ArgumentError(
                "n_rs_seq",
                f"{n_rs_seq} rollback planes asked for, but the kernels of {', '.join(families)} layers write no "
                "snapshot planes, so rollback could never be exact: pass n_rs_seq=0",
            )
        return n_rs_seq

    def state_bytes(self, size: int, n_rs_seq: int = 0) -> int:
        """Bytes of recurrent state for ``size`` cells with ``n_rs_seq`` rollback planes."""
        planes = 1 + self.effective_n_rs_seq(n_rs_seq)
        per_cell = sum(t.row_size for spec in self.layers if spec is not None for t in spec.tensors)
        return size * planes * per_cell * self.dtype.itemsize

    def memory_breakdown(
        self, n_seq_max: int, n_rs_seq: int = 0, devices: Sequence[str] | str = "device"
    ) -> dict[str, int]:
        """Bytes per device id.  ``devices`` is one id for every layer, or one id per
        model layer (layer offloading); layers without state add nothing."""
        per_layer = [devices] * self.n_layer if isinstance(devices, str) else list(devices)
        if len(per_layer) != self.n_layer:
            raise ArgumentError("devices", f"{len(per_layer)} device ids for {self.n_layer} layers")
        planes = 1 + self.effective_n_rs_seq(n_rs_seq)
        out: dict[str, int] = {}
        for spec, dev in zip(self.layers, per_layer, strict=True):
            if spec is None:
                continue
            nbytes = sum(t.row_size for t in spec.tensors) * n_seq_max * planes * self.dtype.itemsize
            out[dev] = out.get(dev, 0) + nbytes
        return out


def make_memory(
    spec: MemorySpec | ModelSpec,
    device: Device,
    n_seq_max: int,
    n_rs_seq: int = 0,
    **kwargs: Any,
) -> RecurrentMemory | Any:
    """The memory of a pure-recurrent model (every stateful layer recurrent); a
    :class:`ModelSpec` (attention / indexer layers too) picks its class itself."""
    if isinstance(spec, ModelSpec):
        return make_model_memory(spec, device, n_seq_max, n_rs_seq, **kwargs)
    from statecache.recurrent import RecurrentMemory

    return RecurrentMemory(spec, device, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq, **kwargs)


# -- attention and indexer layers (hybrid models) --------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionLayerSpec:
    """One attention layer's KV rows: ``n_head_kv`` heads of ``head_dim_k`` (K)
    and ``head_dim_v`` (V, defaults to K's); ``swa``: a sliding-window layer."""

    n_head_kv: int
    head_dim_k: int
    head_dim_v: int | None = None
    swa: bool = False

    def __post_init__(self) -> None:
        if self.n_head_kv <= 0 or self.head_dim_k <= 0 or (self.head_dim_v is not None and self.head_dim_v <= 0):
            raise ArgumentError("attention", "heads and head sizes must be positive")

    @property
    def n_embd_k(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.n_head_kv * (self.head_dim_k if self.head_dim_v is None else self.head_dim_v)


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    """The key-only indexer cache of hybrid-idx models (kpool-spec K.1)."""

    layers: tuple[int, ...]
    head_size: int
    row_factor: int = 3
    kpool: int = 4
    by_order: bool = False


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A whole model's memory map: recurrent layers (a :class:`MemorySpec`),
    attention layers, the KV storage dtype, the sliding window, an indexer."""

    recurrent: MemorySpec
    attention: Mapping[int, AttentionLayerSpec]
    kv_dtype: DType = DType.F16
    n_swa: int = 0
    swa_type: str = "standard"
    indexer: IndexerSpec | None = None

    @classmethod
    def build(
        cls,
        n_layer: int,
        *,
        recurrent: Mapping[int, RecurrentLayerSpec] | None = None,
        attention: Mapping[int, AttentionLayerSpec] | None = None,
        dtype: DType | str = DType.F32,
        kv_dtype: DType | str = DType.F16,
        n_swa: int = 0,
        swa_type: str = "standard",
        indexer: IndexerSpec | None = None,
    ) -> ModelSpec:
        recurrent = dict(recurrent or {})
        attention = dict(attention or {})
        both = set(recurrent) & set(attention)
        if both:
            raise ArgumentError("attention", f"layers {sorted(both)} are both recurrent and attention")
        bad = [i for i in attention if not 0 <= i < n_layer]
        if bad:
            raise ArgumentError("attention", f"layer indices {bad} outside [0, {n_layer})")
        if any(a.swa for a in attention.values()) and n_swa <= 0:
            raise ArgumentError("n_swa", "sliding-window layers need n_swa > 0")
        if indexer is not None:
            if not recurrent or not attention:
                raise ArgumentError("indexer", "an indexer needs a hybrid (attention + recurrent) model")
            if any(a.swa for a in attention.values()):
                raise ArgumentError("indexer", "hybrid-idx with sliding-window layers is not supported")
            if any(not 0 <= i < n_layer for i in indexer.layers):
                raise ArgumentError("indexer", f"indexer layers {indexer.layers} outside [0, {n_layer})")
        return cls(
            MemorySpec.build(n_layer, recurrent, dtype),
            attention,
            DType.parse(kv_dtype),
            int(n_swa),
            swa_type,
            indexer,
        )

    @property
    def n_layer(self) -> int:
        return self.recurrent.n_layer

    @property
    def kind(self) -> str:
        """``attention``, ``recurrent``, ``hybrid``, ``hybrid_iswa`` or ``hybrid_idx``."""
        has_r = bool(self.recurrent.recurrent_layers)
        has_swa = any(a.swa for a in self.attention.values())
        if not self.attention:
            return "recurrent"
        if not has_r:
            return "attention_iswa" if has_swa else "attention"
        if self.indexer is not None:
            return "hybrid_idx"
        return "hybrid_iswa" if has_swa else "hybrid"

    def kv_bytes(self, n_seq_max: int, n_ctx: int) -> int:
        """Bytes of K and V for ``n_seq_max`` sequences of ``n_ctx`` positions
        (full-size caches; an iSWA window cache is smaller, see :func:`make_memory`)."""
        width = sum(a.n_embd_k + a.n_embd_v for a in self.attention.values())
        return width * n_seq_max * n_ctx * self.kv_dtype.itemsize

    def memory_breakdown(self, n_seq_max: int, n_ctx: int, n_rs_seq: int = 0, device: str = "device") -> dict[str, int]:
        out = dict(self.recurrent.memory_breakdown(n_seq_max, n_rs_seq, device))
        kv = self.kv_bytes(n_seq_max, n_ctx)
        if self.indexer is not None:
            kv += (
                len(self.indexer.layers)
                * self.indexer.head_size
                * self.indexer.row_factor
                * n_seq_max
                * n_ctx
                * self.kv_dtype.itemsize
            )
        if kv:
            out[device] = out.get(device, 0) + kv
        return out


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
) -> Any:
    """Pure attention (KVCache / KVCacheISWA), pure recurrent, hybrid, hybrid-iSWA
    or hybrid-idx, as the spec says.  ``n_ctx``: positions per sequence."""
    from statecache.kv_cache import KVCache, KVCacheISWA, KVLayer
    from statecache.recurrent import RecurrentMemory

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
            swa_type=spec.swa_type, swa_full=swa_full, k_shift=k_shift, **common,
        )  # fmt: skip
    else:
        attn = KVCache(device, layers, size=size, k_shift=k_shift, **common)
    if kind.startswith("attention"):
        return attn
    recr = RecurrentMemory(spec.recurrent, device, n_seq_max=n_seq_max, n_rs_seq=n_rs_seq)
    if kind == "hybrid_idx":
        from statecache.hybrid_idx import HybridIdxMemory

        ix = spec.indexer
        assert ix is not None
        return HybridIdxMemory(
            attn, recr, ix.layers, head_size=ix.head_size, row_factor=ix.row_factor, kpool=ix.kpool,
            by_order=ix.by_order,
        )  # fmt: skip
    from statecache.hybrid import HybridISWAMemory, HybridMemory

    return HybridISWAMemory(attn, recr) if kind == "hybrid_iswa" else HybridMemory(attn, recr)
