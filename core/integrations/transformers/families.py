"""Model families: which decoder layer is which kind, and each layer's own arithmetic.

One class per transformers model family, one place per family.  A family
says, for every decoder layer, which mixer it has (``mamba1``, ``mamba2``,
``gdn``, ``attention``, or ``none`` for a layer without one) and reproduces
the decoder layer's forward around the mixer with the model's own modules:
norms, residuals, multipliers, MLP / MoE blocks, the embedding and the LM
head.  The mixers themselves run through :mod:`.mamba`, :mod:`.delta_net` and
:mod:`.attention`.

A model type not listed here, or a decoder layer whose mixer class the
family does not know, is refused with :class:`UnsupportedModelError` (an
:class:`~statecache.errors.IntegrationError`) naming it:
nothing runs half-supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from .errors import UnsupportedModelError


class LayerRun:
    """What a family's :meth:`Family.layer` calls for the stateful parts of a decoder layer
    during one ubatch: ``mix(i, x, kind)`` runs layer ``i``'s mixer of that kind (the only
    one when ``kind`` is None) with statecache holding its state; ``kv`` (the K/V side,
    see :class:`~.attention.KVRows`) and ``pe`` (the rotary (cos, sin) or None) are there
    for families that call an attention block with their own arguments; ``embeddings`` are
    the ubatch's token embeddings (Zamba2's shared blocks read them)."""

    def __init__(self, mix: Callable[[int, Any, str | None], Any], kv: Any, pe: Any, embeddings: Any) -> None:
        self._mix = mix
        self.kv = kv
        self.pe = pe
        self.embeddings = embeddings

    def mix(self, i: int, x: Any, kind: str | None = None) -> Any:
        return self._mix(i, x, kind)


class Family:
    """Base: a causal LM whose decoder layers hold stateful parts (mixers)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    #: stateful part class name -> kind, for the classes this family knows
    mixer_kinds: ClassVar[dict[str, str]] = {}

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config

    # -- structure ---------------------------------------------------------------------
    def decoder_layers(self) -> Any:
        raise NotImplementedError

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        """The stateful modules of decoder layer ``i`` (mixers, attention), in the order
        the layer runs them; empty for a layer without state (an MLP-only block)."""
        raise NotImplementedError

    def parts(self) -> list[dict[str, Any]]:
        """Per decoder layer: kind -> module; refuses a module class the family does not know."""
        out = []
        for i, layer in enumerate(self.decoder_layers()):
            kinds: dict[str, Any] = {}
            for mod in self.parts_of(i, layer):
                kind = self.mixer_kinds.get(type(mod).__name__)
                if kind is None:
                    raise UnsupportedModelError(
                        f"{self.config.model_type} layer {i}: {type(mod).__name__} is not supported "
                        f"(supported: {', '.join(sorted(self.mixer_kinds))})"
                    )
                if kind in kinds:
                    raise UnsupportedModelError(f"{self.config.model_type} layer {i}: two {kind} parts in one layer")
                kinds[kind] = mod
            out.append(kinds)
        return out

    # -- arithmetic ----------------------------------------------------------------------
    def embed(self, ids: Any) -> Any:
        raise NotImplementedError

    def rotary(self, h: Any, pos: Any) -> Any:
        """(cos, sin) for positions ``pos`` [n_s, n_t], or None without RoPE."""
        return None

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        raise NotImplementedError

    def head(self, h: Any) -> Any:
        """Logits of the final hidden states of the output tokens (final norm included)."""
        raise NotImplementedError


class DecoderFamily(Family):
    """The layout most hybrid causal LMs share: ``model.model.embed_tokens``,
    ``model.model.layers``, ``model.model.rotary_emb`` (absent or None without RoPE)."""

    def decoder_layers(self) -> Any:
        return self.model.model.layers

    def embed(self, ids: Any) -> Any:
        return self.model.model.embed_tokens(ids)

    def rotary(self, h: Any, pos: Any) -> Any:
        rot = getattr(self.model.model, "rotary_emb", None)
        return None if rot is None else rot(h, pos)


def residual_ffn(h: Any, norm: Any, ffn: Any) -> Any:
    """``h + ffn(norm(h))``; MoE blocks that also return router logits give a tuple."""
    y = ffn(norm(h))
    return h + (y[0] if isinstance(y, tuple) else y)


class PreNormFamily(DecoderFamily):
    """Decoder layers ``input_layernorm -> mixer -> + residual -> <ffn_norm> -> <ffn> -> +
    residual`` whose mixer is the layer's ``<mixer_attr>`` (recurrent) or ``self_attn``, and a
    final ``model.model.<final_norm>`` before ``lm_head``; a family names its attributes."""

    mixer_attr: ClassVar[str] = "mamba"
    ffn_norm: ClassVar[str] = "pre_ff_layernorm"
    ffn: ClassVar[str] = "feed_forward"
    final_norm: ClassVar[str] = "final_layernorm"

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        mixer = getattr(layer, self.mixer_attr, None)
        return [mixer if mixer is not None else layer.self_attn]

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        blk = self.model.model.layers[i]
        h = h + run.mix(i, blk.input_layernorm(h))
        return residual_ffn(h, getattr(blk, self.ffn_norm), getattr(blk, self.ffn))

    def head(self, h: Any) -> Any:
        return self.model.lm_head(getattr(self.model.model, self.final_norm)(h))


# -- pure recurrent: Mamba, FalconMamba, Mamba-2 -------------------------------------------------


class MambaFamily(Family):
    """MambaForCausalLM / FalconMambaForCausalLM / Mamba2ForCausalLM: ``backbone.layers[i]`` is
    ``norm -> mixer -> + residual`` (residual kept in fp32 when ``residual_in_fp32``)."""

    model_types = ("mamba", "falcon_mamba", "mamba2")
    mixer_kinds = {"MambaMixer": "mamba1", "FalconMambaMixer": "mamba1", "Mamba2Mixer": "mamba2"}

    def decoder_layers(self) -> Any:
        return self.model.backbone.layers

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        return [layer.mixer]

    def embed(self, ids: Any) -> Any:
        return self.model.backbone.embeddings(ids)

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        blk = self.model.backbone.layers[i]
        residual = h
        x = blk.norm(h.to(dtype=blk.norm.weight.dtype))
        if blk.residual_in_fp32:
            residual = residual.float()
        return residual + run.mix(i, x)

    def head(self, h: Any) -> Any:
        h = self.model.backbone.norm_f(h)
        lm = self.model.lm_head
        return lm(h.to(lm.weight.dtype)).float()


# -- Mamba-2 / attention hybrids -----------------------------------------------------------------


class BambaFamily(PreNormFamily):
    """BambaForCausalLM: ``input_layernorm -> (mamba | self_attn) -> + residual ->
    pre_ff_layernorm -> feed_forward -> + residual``, ``final_layernorm``."""

    model_types = ("bamba",)
    mixer_kinds = {"BambaMixer": "mamba2", "BambaAttention": "attention"}


class GraniteMoeHybridFamily(DecoderFamily):
    """GraniteMoeHybridForCausalLM: embeddings times ``embedding_multiplier``; each branch
    added as ``residual + out * residual_multiplier``; MoE plus shared MLP (or the shared MLP
    alone); logits divided by ``logits_scaling``; RoPE only when ``position_embedding_type``
    is ``rope``."""

    model_types = ("granitemoehybrid",)
    mixer_kinds = {"GraniteMoeHybridMambaLayer": "mamba2", "GraniteMoeHybridAttention": "attention"}

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        return [layer.mamba if layer.mamba is not None else layer.self_attn]

    def embed(self, ids: Any) -> Any:
        return super().embed(ids) * self.model.model.embedding_multiplier

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        blk = self.model.model.layers[i]
        h = h + run.mix(i, blk.input_layernorm(h)) * blk.residual_multiplier
        x = blk.post_attention_layernorm(h)
        y = blk.shared_mlp(x)
        if blk.has_experts:
            y = blk.block_sparse_moe(x) + y
        return h + y * blk.residual_multiplier

    def head(self, h: Any) -> Any:
        return self.model.lm_head(self.model.model.norm(h)) / self.config.logits_scaling


# -- gated delta net / attention hybrids -----------------------------------------------------------


class Qwen3NextFamily(PreNormFamily):
    """Qwen3NextForCausalLM: ``input_layernorm -> (linear_attn | self_attn) -> + residual ->
    post_attention_layernorm -> mlp (dense or sparse MoE) -> + residual``, ``norm``."""

    model_types = ("qwen3_next",)
    mixer_kinds = {"Qwen3NextGatedDeltaNet": "gdn", "Qwen3NextAttention": "attention"}
    mixer_attr, ffn_norm, ffn, final_norm = "linear_attn", "post_attention_layernorm", "mlp", "norm"

    def decoder_layers(self) -> Any:
        return self.model.model.layers[: self.config.num_hidden_layers]


class JambaFamily(PreNormFamily):
    """JambaForCausalLM: Mamba-1 (with RMS norms on dt, B, C) and attention (no RoPE) decoder
    layers, each ``input_layernorm -> mixer -> + residual -> pre_ff_layernorm -> feed_forward
    (MLP or MoE) -> + residual``, ``final_layernorm``."""

    model_types = ("jamba",)
    mixer_kinds = {"JambaMambaMixer": "mamba1", "JambaAttention": "attention"}


class NemotronHFamily(DecoderFamily):
    """NemotronHForCausalLM: every block is ``norm -> mixer -> + residual`` where the mixer is
    Mamba-2, attention (no RoPE), an MLP or an MoE (the last two hold no state)."""

    model_types = ("nemotron_h",)
    mixer_kinds = {"NemotronHMamba2Mixer": "mamba2", "NemotronHAttention": "attention"}

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        return [layer.mixer] if layer.block_type in ("linear_attention", "full_attention") else []

    def embed(self, ids: Any) -> Any:
        return self.model.model.embeddings(ids)

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        blk = self.model.model.layers[i]
        x = blk.norm(h.to(dtype=blk.norm.weight.dtype))
        if blk.block_type in ("linear_attention", "full_attention"):
            return h + run.mix(i, x)
        return h + blk.mixer(x)

    def head(self, h: Any) -> Any:
        return self.model.lm_head(self.model.model.norm_f(h)).float()


class FalconH1Family(DecoderFamily):
    """FalconH1ForCausalLM: every layer runs Mamba-2 and attention *in parallel* on the same
    normalised input (attention's input times ``attention_in_multiplier``), adds
    ``ssm_out_multiplier * mamba + attn_out_multiplier * attention`` to the residual, then the
    MLP; embeddings times ``embedding_multiplier``, logits times ``lm_head_multiplier``.  Each
    layer's two parts get a memory layer each (statecache routes a layer to one part)."""

    model_types = ("falcon_h1",)
    mixer_kinds = {"FalconH1Mixer": "mamba2", "FalconH1Attention": "attention"}

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        return [layer.self_attn, layer.mamba]

    def embed(self, ids: Any) -> Any:
        return super().embed(ids) * self.model.model.embedding_multiplier

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        blk = self.model.model.layers[i]
        x = blk.input_layernorm(h)
        m = run.mix(i, x, "mamba2") * blk.ssm_out_multiplier
        a = run.mix(i, x * blk.attention_in_multiplier, "attention") * blk.attn_out_multiplier
        return residual_ffn(h + (m + a), blk.pre_ff_layernorm, blk.feed_forward)

    def head(self, h: Any) -> Any:
        return self.model.lm_head(self.model.model.final_layernorm(h)) * self.model.model.lm_head_multiplier


class Zamba2Family(DecoderFamily):
    """Zamba2ForCausalLM: every layer is a Mamba-2 block (``input_layernorm -> mamba -> +
    residual``); a *hybrid* layer first runs a shared transformer block (attention + MLP with
    per-layer LoRA adapters, weights tied across layers) on ``concat(hidden, embeddings)``,
    projects it with the layer's ``linear`` and adds it to the Mamba block's input.  The
    shared block is called as the model's own module with statecache's K/V for that layer."""

    model_types = ("zamba2",)
    mixer_kinds = {"Zamba2MambaMixer": "mamba2", "Zamba2Attention": "attention"}

    def parts_of(self, i: int, layer: Any) -> list[Any]:
        if hasattr(layer, "shared_transformer"):
            return [layer.shared_transformer.self_attn, layer.mamba_decoder.mamba]
        return [layer.mamba]

    def rotary(self, h: Any, pos: Any) -> Any:
        return super().rotary(h, pos) if self.config.use_mem_rope else None

    def layer(self, i: int, h: Any, run: LayerRun) -> Any:
        blk = self.model.model.layers[i]
        x = h
        if hasattr(blk, "shared_transformer"):
            t = blk.shared_transformer(
                h,
                original_hidden_states=run.embeddings,
                layer_idx=i,
                attention_mask=run.kv.mask,
                past_key_values=run.kv,
                position_embeddings=run.pe,
            )
            x = h + blk.linear(t)
            blk = blk.mamba_decoder
        return h + run.mix(i, blk.input_layernorm(x), "mamba2")

    def head(self, h: Any) -> Any:
        return self.model.lm_head(self.model.model.final_layernorm(h))


FAMILIES: tuple[type[Family], ...] = (
    MambaFamily,
    BambaFamily,
    GraniteMoeHybridFamily,
    Qwen3NextFamily,
    JambaFamily,
    NemotronHFamily,
    FalconH1Family,
    Zamba2Family,
)


def supported_model_types() -> list[str]:
    return sorted(t for fam in FAMILIES for t in fam.model_types)


def family_of(model: Any) -> Family:
    """The family of a loaded transformers causal LM, or UnsupportedModelError naming its type."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam(model)
    raise UnsupportedModelError(
        f"model type {model_type!r} ({type(model).__name__}) is not supported; "
        f"supported: {', '.join(supported_model_types())}"
    )
