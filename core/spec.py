"""What a model's recurrent memory holds: per-layer state sizes per family (docs/memory-semantics.md#state-sizes).

A :class:`MemorySpec` lists the model's layers (``n_layer`` counts every
layer, attention ones too) and, for each recurrent layer, its
:class:`RecurrentLayerSpec`: the state tensors (conv window ``r`` and scan /
delta / wkv state ``s``, plus optional extras) with their row sizes in
elements.  The family constructors compute those sizes from the usual
hyperparameters.  :meth:`MemorySpec.memory_breakdown` gives the bytes per
device a recurrent memory allocates; :func:`statecache.factory.make_memory`
builds the memory a spec describes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from statecache.dtypes import DType
from statecache.errors import ArgumentError

#: Families whose every state tensor gets snapshot planes from the primitives, so
#: rollback (n_rs_seq > 0) is exact for them (Mamba-1's scan writes snapshot
#: planes like Mamba-2's since protocol 2; RWKV-6/7 and GLA since the
#: linear-attention primitives, their token shift through ``ssm_conv``, see
#: :meth:`statecache.recurrent_step.RecurrentStep.shift`).  A family outside
#: this set gets no rollback planes: a memory of such a model refuses them.
ROLLBACK_FAMILIES = frozenset({"mamba1", "mamba2", "gdn", "kda", "shortconv", "rwkv6", "rwkv7", "gla"})


def _check_sizes(family: str, d_conv: tuple[str, int] | None = None, **sizes: int) -> None:
    """Refuse a hyperparameter that no kernel can run, naming it: without this a zero
    or negative size surfaced as "state tensor 'r' needs a positive row size", or not
    at all until the first step.  ``d_conv`` (its name and value) is a conv window,
    which keeps ``d_conv - 1`` columns of state, so it must be at least 2."""
    for name, value in (*sizes.items(), *([d_conv] if d_conv is not None else [])):
        # int(8.5) would pass as 8 and a fractional size reach the row sizes
        if not _whole(value) or int(value) < 1:
            raise ArgumentError(name, f"{family}: must be a positive integer, got {value!r}")
    if d_conv is not None and int(d_conv[1]) < 2:
        raise ArgumentError(
            d_conv[0], f"{family}: must be >= 2 (the conv state keeps {d_conv[0]} - 1 columns), got {d_conv[1]}"
        )


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

    # -- family constructors (hyperparameters -> row sizes, docs/memory-semantics.md#state-sizes) ----------
    @classmethod
    def mamba1(cls, *, d_inner: int, d_state: int, d_conv: int) -> RecurrentLayerSpec:
        _check_sizes("mamba1", ("d_conv", d_conv), d_inner=d_inner, d_state=d_state)
        # Mamba-1 is Mamba-2 with head_dim 1, n_head = d_inner, one group (B, C not convolved).
        return cls(
            "mamba1",
            (StateTensor("r", (d_conv - 1) * d_inner), StateTensor("s", d_state * d_inner)),
            {"d_conv": d_conv, "channels": d_inner, "n_head": d_inner, "head_dim": 1, "d_state": d_state},
        )

    @classmethod
    def mamba2(cls, *, d_inner: int, d_state: int, d_conv: int, n_group: int, head_dim: int) -> RecurrentLayerSpec:
        _check_sizes("mamba2", ("d_conv", d_conv), d_inner=d_inner, d_state=d_state, n_group=n_group, head_dim=head_dim)
        if d_inner % head_dim:
            raise ArgumentError("head_dim", f"{head_dim} must divide d_inner {d_inner}")
        if (d_inner // head_dim) % n_group:
            # ssm_scan would refuse it at the first step: head h reads B/C group h // (n_head / n_group)
            raise ArgumentError("n_group", f"{n_group} must divide n_head = d_inner / head_dim = {d_inner // head_dim}")
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
    def gdn(
        cls, *, n_head: int, head_dim: int, d_conv: int, n_head_k: int | None = None, head_map: str = "tiled"
    ) -> RecurrentLayerSpec:
        """Gated delta net (Qwen3-Next style): q, k, v convolved (3 * n_head * head_dim
        channels when q/k have as many heads as v), state head_dim^2 per value head.

        ``head_map`` is the runtime's q/k head mapping (the ``head_map`` its
        ``gated_delta_net`` calls pass): ``"tiled"`` (value head h reads key
        head ``h % n_head_k``, llama.cpp) or ``"grouped"`` (``h // (n_head /
        n_head_k)``, transformers, flash-linear-attention, vLLM).  Rows are the
        same either way; only a tensor-parallel split depends on it (which
        value heads go with a rank's key heads, see :meth:`shard`)."""
        hk = n_head if n_head_k is None else n_head_k
        _check_sizes("gdn", ("d_conv", d_conv), n_head=n_head, head_dim=head_dim, n_head_k=hk)
        if head_map not in ("tiled", "grouped"):
            raise ArgumentError("head_map", f"must be 'tiled' or 'grouped', got {head_map!r}")
        channels = (2 * hk + n_head) * head_dim
        params = {"d_conv": d_conv, "channels": channels, "n_head": n_head, "n_head_k": hk, "head_dim": head_dim}
        if head_map == "grouped" and hk not in (1, n_head):  # else grouped is the tiled map: one spec for both
            params["grouped_heads"] = 1
        return cls(
            "gdn",
            (StateTensor("r", (d_conv - 1) * channels), StateTensor("s", head_dim * head_dim * n_head)),
            params,
        )

    @classmethod
    def kda(cls, *, n_head: int, head_dim: int, d_conv: int) -> RecurrentLayerSpec:
        _check_sizes("kda", ("d_conv", d_conv), n_head=n_head, head_dim=head_dim)
        channels = 3 * n_head * head_dim
        return cls(
            "kda",
            (StateTensor("r", (d_conv - 1) * channels), StateTensor("s", head_dim * head_dim * n_head)),
            {"d_conv": d_conv, "channels": channels, "n_head": n_head, "n_head_k": n_head, "head_dim": head_dim},
        )

    @classmethod
    def rwkv6(cls, *, n_embd: int, head_size: int, token_shift_count: int = 2) -> RecurrentLayerSpec:
        """RWKV-6: the token shift ``r`` (``token_shift_count`` hidden vectors: the
        last input of the time mixing, then of the channel mixing, as llama.cpp
        stores them) and the wkv state ``s``, ``n_embd / head_size`` heads of
        [head_size, head_size] (the layout of :meth:`statecache.backend.Device.rwkv_wkv6`)."""
        _check_sizes("rwkv", n_embd=n_embd, head_size=head_size, token_shift_count=token_shift_count)
        if n_embd % head_size:
            raise ArgumentError("head_size", f"{head_size} must divide n_embd {n_embd}")
        return cls(
            "rwkv6",
            (StateTensor("r", token_shift_count * n_embd), StateTensor("s", n_embd * head_size)),
            {
                "n_embd": n_embd,
                "head_size": head_size,
                "n_head": n_embd // head_size,
                "token_shift_count": token_shift_count,
            },
        )

    @classmethod
    def rwkv7(cls, *, n_embd: int, head_size: int, token_shift_count: int = 2) -> RecurrentLayerSpec:
        """RWKV-7: as :meth:`rwkv6`, with RWKV-7's wkv state layout (:meth:`statecache.backend.Device.rwkv_wkv7`)."""
        spec = cls.rwkv6(n_embd=n_embd, head_size=head_size, token_shift_count=token_shift_count)
        return dataclasses.replace(spec, family="rwkv7")

    @classmethod
    def gla(cls, *, n_head: int, head_dim: int) -> RecurrentLayerSpec:
        """Gated linear attention (GLA, QRWKV-6): only the state ``s``, ``n_head``
        blocks of [head_dim, head_dim] (:meth:`statecache.backend.Device.gated_linear_attn`)."""
        _check_sizes("gla", n_head=n_head, head_dim=head_dim)
        return cls("gla", (StateTensor("s", n_head * head_dim * head_dim),), {"n_head": n_head, "head_dim": head_dim})

    @classmethod
    def shortconv(cls, *, n_embd: int, l_cache: int) -> RecurrentLayerSpec:
        """LFM2 short conv: only a conv window of L_cache - 1 columns."""
        _check_sizes("shortconv", ("l_cache", l_cache), n_embd=n_embd)
        return cls("shortconv", (StateTensor("r", n_embd * (l_cache - 1)),), {"d_conv": l_cache, "channels": n_embd})

    # -- tensor parallelism: the shard of rank r of t ----------------------------
    def shard(self, rank: int, world: int) -> RecurrentLayerSpec:
        """The layer as rank ``rank`` of ``world`` tensor-parallel ranks holds it.

        Heads split the way Megatron and vLLM split them: whole heads per rank,
        each rank keeping the groups (Mamba-2 B/C groups, GDN key heads) its
        heads read, so every rank's step is the unsharded step on fewer heads.
        A split that does not divide raises :class:`ArgumentError` naming the
        hyperparameter.  ``world == 1`` returns the layer unchanged.
        """
        return _shard_layer(self, rank, world)[0]

    def shard_index(self, rank: int, world: int) -> dict[str, np.ndarray]:
        """Per state tensor, which elements of the unsharded row rank ``rank``'s row
        holds, in its own order (``full_row[index] == shard_row``).  Replicated
        tensors (an RWKV token shift: the layer input every rank holds) map onto
        the whole row on every rank."""
        return _shard_layer(self, rank, world)[1]


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

    def shard(self, rank: int, world: int) -> MemorySpec:
        """The spec of tensor-parallel rank ``rank`` of ``world``: every recurrent layer's
        shard (:meth:`RecurrentLayerSpec.shard`); an error names the layer and field."""
        layers = tuple(
            None if spec is None else _in_layer(i, spec.shard, rank, world) for i, spec in enumerate(self.layers)
        )
        return MemorySpec(layers, self.dtype)

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
        sizes = (self.n_head_kv, self.head_dim_k, *(() if self.head_dim_v is None else (self.head_dim_v,)))
        if not all(_whole(v) for v in sizes):
            raise ArgumentError("attention", f"heads and head sizes must be integers, got {sizes}")
        if self.n_head_kv <= 0 or self.head_dim_k <= 0 or (self.head_dim_v is not None and self.head_dim_v <= 0):
            raise ArgumentError("attention", "heads and head sizes must be positive")

    @property
    def n_embd_k(self) -> int:
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.n_head_kv * (self.head_dim_k if self.head_dim_v is None else self.head_dim_v)

    def shard(self, rank: int, world: int) -> AttentionLayerSpec:
        """Rank ``rank`` of ``world`` holds ``n_head_kv / world`` whole K/V heads (its
        query heads' groups); a count that does not divide is refused, not replicated."""
        check_rank(rank, world)
        return dataclasses.replace(self, n_head_kv=_split("n_head_kv", self.n_head_kv, world, "K/V heads"))

    def shard_index(self, rank: int, world: int) -> dict[str, np.ndarray]:
        """Which elements of an unsharded K row (``"k"``) and V row (``"v"``) rank ``rank`` holds."""
        local = self.shard(rank, world)
        return {
            "k": np.arange(rank * local.n_embd_k, (rank + 1) * local.n_embd_k, dtype=np.int64),
            "v": np.arange(rank * local.n_embd_v, (rank + 1) * local.n_embd_v, dtype=np.int64),
        }


@dataclasses.dataclass(frozen=True)
class IndexerSpec:
    """The key-only indexer cache of hybrid-idx models (docs/memory-semantics.md#kpool-rows)."""

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

    def shard(self, rank: int, world: int) -> ModelSpec:
        """The spec of tensor-parallel rank ``rank`` of ``world``: recurrent and attention
        layers split by heads; the indexer cache (one key head) is replicated on every rank."""
        recurrent = self.recurrent.shard(rank, world)
        attention = {il: _in_layer(il, a.shard, rank, world) for il, a in sorted(self.attention.items())}
        return dataclasses.replace(self, recurrent=recurrent, attention=attention)

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
        (full-size caches; an iSWA window cache is smaller, see :func:`statecache.factory.make_memory`)."""
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


# -- tensor-parallel shards (Megatron / vLLM: whole heads per rank) -----------------------


def _whole(value: object) -> bool:
    """An integer (a NumPy one too), not a bool or a float."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_rank(rank: int, world: int) -> None:
    """Refuse (:class:`ArgumentError` naming it) a rank or world that is not an
    integer, or a rank outside ``[0, world)``."""
    for name, value in (("world", world), ("rank", rank)):
        if not _whole(value):  # a fractional rank made fractional element maps
            raise ArgumentError(name, f"must be an integer, got {value!r}")
    if world < 1:
        raise ArgumentError("world", f"needs at least one rank, got {world}")
    if not 0 <= rank < world:
        raise ArgumentError("rank", f"{rank} outside [0, world={world})")


def _split(field: str, value: int, world: int, what: str) -> int:
    if value % world:
        raise ArgumentError(field, f"{value} {what} do not split over {world} ranks")
    return value // world


def _in_layer(layer: int, shard: Any, rank: int, world: int) -> Any:
    """``shard(rank, world)`` with the layer index added to an error."""
    try:
        return shard(rank, world)
    except ArgumentError as exc:
        raise ArgumentError(exc.argument, f"layer {layer}: {str(exc)[len(exc.argument) + 2 :]}") from None


def _blocks(starts: np.ndarray, width: int) -> np.ndarray:
    """Concatenated ranges ``[s, s + width)`` for every ``s`` in ``starts``."""
    return (np.asarray(starts, dtype=np.int64)[:, None] + np.arange(width, dtype=np.int64)).ravel()


def _shard_layer(spec: RecurrentLayerSpec, rank: int, world: int) -> tuple[RecurrentLayerSpec, dict[str, np.ndarray]]:
    """The local spec and the element maps of one recurrent layer (see :meth:`RecurrentLayerSpec.shard`).

    Row layouts (fixed by the primitives): a conv window row is ``[channel, d_conv - 1]``;
    a Mamba state row is ``[head, head_dim, d_state]``; a delta-rule or wkv state row
    is ``[head, head_dim, head_dim]``.  So a rank's rows are its channels' and heads'
    blocks of the full rows, in increasing order.
    """
    check_rank(rank, world)
    p = spec.params
    full = {t.name: np.arange(t.row_size, dtype=np.int64) for t in spec.tensors}
    if p.get("tp_world", 1) != 1:
        raise ArgumentError("world", f"the {spec.family} layer is already rank {p['tp_rank']} of {p['tp_world']}")
    if world == 1:
        return spec, full
    fam = spec.family
    tp = {"tp_rank": rank, "tp_world": world}
    if fam in ("mamba1", "mamba2"):
        P, N = p["head_dim"], p["d_state"]
        H = _split("d_inner" if fam == "mamba1" else "n_head", p["n_head"], world, "heads")
        d_inner = p["n_head"] * P
        channels = [np.arange(rank * H * P, (rank + 1) * H * P)]
        if fam == "mamba2":
            G = p["n_group"]
            g = _split("n_group", G, world, "groups")
            for base in (d_inner, d_inner + G * N):  # B, then C: each rank keeps its heads' groups
                channels.append(base + np.arange(rank * g * N, (rank + 1) * g * N))
            local = RecurrentLayerSpec.mamba2(d_inner=H * P, d_state=N, d_conv=p["d_conv"], n_group=g, head_dim=P)
        else:
            local = RecurrentLayerSpec.mamba1(d_inner=H, d_state=N, d_conv=p["d_conv"])
        heads = np.arange(rank * H, (rank + 1) * H)
        index = {"r": np.concatenate(channels), "s": _blocks(heads * P * N, P * N)}
    elif fam in ("gdn", "kda"):
        S, Hv, Hk = p["head_dim"], p["n_head"], p["n_head_k"]
        if Hv % Hk:
            raise ArgumentError("n_head", f"{Hv} value heads are not a multiple of {Hk} key heads")
        _split("n_head", Hv, world, "value heads")
        hk = _split("n_head_k", Hk, world, "key heads")
        k_heads = np.arange(rank * hk, (rank + 1) * hk)
        grouped = bool(p.get("grouped_heads", 0))
        if grouped:
            # value head h reads key head h // (Hv / Hk): a rank's key heads are read by
            # one contiguous run of value heads (vLLM's split), which the local grouped
            # map h' // (hv / hk) sends to the same key heads
            v_heads = np.arange(rank * (Hv // world), (rank + 1) * (Hv // world))
        else:
            # value head h reads key head h % Hk (tiled): a rank holds the value heads
            # of its key heads, in increasing order, which the local tiling h' % hk
            # maps onto the same key heads
            v_heads = np.flatnonzero(np.isin(np.arange(Hv) % Hk, k_heads))
        index = {
            "r": np.concatenate(
                [_blocks(k_heads * S, S), _blocks((Hk + k_heads) * S, S), _blocks((2 * Hk + v_heads) * S, S)]
            ),
            "s": _blocks(v_heads * S * S, S * S),
        }
        if fam == "gdn":
            local = RecurrentLayerSpec.gdn(
                n_head=v_heads.size, head_dim=S, d_conv=p["d_conv"], n_head_k=hk,
                head_map="grouped" if grouped else "tiled",
            )  # fmt: skip
        else:
            local = RecurrentLayerSpec.kda(n_head=v_heads.size, head_dim=S, d_conv=p["d_conv"])
    elif fam in ("rwkv6", "rwkv7"):
        hs = p["head_size"]
        h = _split("n_head", p["n_embd"] // hs, world, "heads")
        heads = np.arange(rank * h, (rank + 1) * h)
        # the token shift holds the layer input, which every tensor-parallel rank holds whole
        index = {"r": full["r"], "s": _blocks(heads * hs * hs, hs * hs)}
        tensors = (StateTensor("r", spec.row_sizes["r"]), StateTensor("s", h * hs * hs))
        return RecurrentLayerSpec(fam, tensors, {**p, "n_head": h, **tp}), index
    elif fam == "gla":
        hd = p["head_dim"]
        h = _split("n_head", p["n_head"], world, "heads")
        local = RecurrentLayerSpec.gla(n_head=h, head_dim=hd)
        index = {"s": _blocks(np.arange(rank * h, (rank + 1) * h) * hd * hd, hd * hd)}
        return dataclasses.replace(local, params={**local.params, **tp}), index
    elif fam == "shortconv":
        c = _split("channels", p["channels"], world, "channels")
        local = RecurrentLayerSpec.shortconv(n_embd=c, l_cache=p["d_conv"])
        index = {"r": np.arange(rank * c, (rank + 1) * c)}
    else:
        raise ArgumentError("family", f"no tensor-parallel split is defined for {fam!r}")
    window = p["d_conv"] - 1
    index["r"] = _blocks(index["r"] * window, window)  # channels -> elements of the [channel, window] row
    return dataclasses.replace(local, params={**local.params, **tp}), index


def __getattr__(name: str) -> Any:
    # make_memory and make_model_memory moved to statecache.factory, above the
    # memories (this module is data and sits below them).  Resolved on first
    # use so that old imports keep working without this floor importing the
    # memories at import time.
    if name in ("make_memory", "make_model_memory"):
        from statecache import factory

        return getattr(factory, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
