"""Tiny transformers models of every family the integration covers, built from configs with
seeded random weights (no downloads).

Parameters that a model initialises to constants (D, dt_bias, A_log, norm weights, conv bias,
muP multipliers) are randomised too, so that a convention mapped wrongly (a missing D skip, the
dt bias added twice, a norm before instead of after the gate, the wrong group of a head) changes
the logits by far more than float32 rounding.  Weights are drawn with a larger spread than the
models' own init so that logits are O(1)-O(10), not O(0.01) where an error could hide.
"""

from __future__ import annotations

from typing import Any

import torch

V = 96  # vocabulary


def _randomise(model: Any, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":  # A = -exp(A_log) in [-4.5, -0.4]: strong and weak decays
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=g))
            elif leaf in ("D", "dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.6 + 0.2)
            elif "norm" in name and leaf == "weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1.0)
            elif leaf == "bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.3 / fan_in**0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _mamba(**kw: Any) -> Any:
    from transformers import MambaConfig, MambaForCausalLM

    cfg = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2)
    cfg.update(time_step_rank=4, use_conv_bias=True)
    cfg.update(kw)
    return MambaForCausalLM(MambaConfig(**cfg))


def _falcon_mamba() -> Any:
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    return FalconMambaForCausalLM(
        FalconMambaConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=3, expand=2, time_step_rank=4
        )
    )


def _mamba2(**kw: Any) -> Any:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=2)
    cfg.update(state_size=8, conv_kernel=4, expand=2, chunk_size=8)
    cfg.update(kw)
    return Mamba2ForCausalLM(Mamba2Config(**cfg))


_MAMBA2_HYBRID = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2
)


def _bamba() -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_chunk_size=8, **_MAMBA2_HYBRID,
    )  # fmt: skip
    return BambaForCausalLM(cfg)


def _granite(rope: bool = True) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"], mamba_chunk_size=8,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=24, embedding_multiplier=2.5,
        residual_multiplier=0.6, logits_scaling=1.7, attention_multiplier=0.3,
        position_embedding_type="rope" if rope else "nope", **_MAMBA2_HYBRID,
    )  # fmt: skip
    return GraniteMoeHybridForCausalLM(cfg)


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )  # fmt: skip
    return Qwen3NextForCausalLM(cfg)


def _jamba() -> Any:
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4,
    )  # fmt: skip
    return JambaForCausalLM(cfg)


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layers_block_type=["mamba", "attention", "mlp", "mamba"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
    )  # fmt: skip
    return NemotronHForCausalLM(cfg)


def _falcon_h1(rms_norm: bool = True) -> Any:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = FalconH1Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_rms_norm=rms_norm,
        embedding_multiplier=1.8, lm_head_multiplier=0.6, attention_in_multiplier=0.7, ssm_out_multiplier=1.4,
        attention_out_multiplier=0.5, key_multiplier=1.6, ssm_in_multiplier=0.8,
        ssm_multipliers=[1.5, 0.6, 1.3, 0.7, 1.2], mlp_multipliers=[1.3, 0.7],
    )  # fmt: skip
    return FalconH1ForCausalLM(cfg)


def _zamba2() -> Any:
    from transformers import Zamba2Config, Zamba2ForCausalLM

    cfg = Zamba2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=4,
        mamba_headdim=16, mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, chunk_size=8,
        num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=4, use_mem_rope=True,
    )  # fmt: skip
    return Zamba2ForCausalLM(cfg)


#: name -> builder; the names the tests parametrise over
BUILDERS = {
    "mamba": _mamba,
    "falcon_mamba": _falcon_mamba,
    "mamba2": _mamba2,
    # a finite time_step_limit: the clamp between softplus and the scan is exercised
    "mamba2_dt_limit": lambda: _mamba2(time_step_limit=(0.3, 1.2)),
    "bamba": _bamba,
    "granitemoehybrid": _granite,
    "granitemoehybrid_nope": lambda: _granite(rope=False),
    "qwen3_next": _qwen3_next,
    "jamba": _jamba,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "falcon_h1_no_norm": lambda: _falcon_h1(rms_norm=False),
    "zamba2": _zamba2,
}


#: one variant per transformers model type (the others exercise a mapping branch)
MODEL_TYPES = (
    "mamba",
    "falcon_mamba",
    "mamba2",
    "bamba",
    "granitemoehybrid",
    "qwen3_next",
    "jamba",
    "nemotron_h",
    "falcon_h1",
    "zamba2",
)


def build(name: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return _randomise(BUILDERS[name](), seed)
