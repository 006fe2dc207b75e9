"""The transformers integration on other shapes (hunt27b): tiny models whose head counts,
layer patterns, groups and kernel sizes differ from the CI variants, run through
StatecacheCausalLM on a mixed batch of prompt lengths and decode steps, each sequence's logits
compared with transformers' own forward over the whole context."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs the torch extra")
pytest.importorskip("transformers", reason="the transformers integration needs statecache[transformers]")

from tiny_models import _MAMBA2_HYBRID, V, _randomise  # noqa: E402

from statecache.batch import Batch  # noqa: E402
from statecache.integrations.transformers import StatecacheCausalLM  # noqa: E402

pytestmark = pytest.mark.torch


def _granite(**kw: Any) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg: dict[str, Any] = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, layer_types=["attention", "mamba", "attention"], mamba_chunk_size=8,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=24, **_MAMBA2_HYBRID,
    )  # fmt: skip
    cfg.update(kw)
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**cfg))


def _bamba() -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    hy = dict(_MAMBA2_HYBRID, mamba_n_heads=2, mamba_d_head=32, mamba_n_groups=1, mamba_d_conv=3)
    cfg = BambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=2, attn_layer_indices=[0, 2], mamba_chunk_size=4, **hy,
    )  # fmt: skip
    return BambaForCausalLM(cfg)


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_value_heads=6, linear_num_key_heads=3, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=2,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    )  # fmt: skip
    return Qwen3NextForCausalLM(cfg)


def _mamba() -> Any:
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(
        vocab_size=V, hidden_size=24, num_hidden_layers=3, state_size=5, conv_kernel=2, expand=3, time_step_rank=3
    )
    return MambaForCausalLM(cfg)


def _mamba2() -> Any:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(
        vocab_size=V,
        hidden_size=24,
        num_hidden_layers=2,
        num_heads=6,
        head_dim=8,
        n_groups=3,
        state_size=4,
        conv_kernel=2,
        expand=2,
        chunk_size=5,
    )
    return Mamba2ForCausalLM(cfg)


def _jamba() -> Any:
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=1, attn_layer_period=3, attn_layer_offset=0, expert_layer_period=3,
        expert_layer_offset=2, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=2,
        mamba_expand=1, mamba_dt_rank=2,
    )  # fmt: skip
    return JambaForCausalLM(cfg)


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layers_block_type=["attention", "mamba", "attention", "mlp"],
        mamba_num_heads=2, mamba_head_dim=32, n_groups=1, ssm_state_size=6, conv_kernel=3, chunk_size=4,
    )  # fmt: skip
    return NemotronHForCausalLM(cfg)


BUILDERS = {
    "granite_kv1_attn_first": _granite,
    "granite_nope": lambda: _granite(position_embedding_type="nope"),
    "bamba_two_attn": _bamba,
    "qwen3_next_heads": _qwen3_next,
    "mamba_odd": _mamba,
    "mamba2_groups3": _mamba2,
    "jamba_attn_first": _jamba,
    "nemotron_h_attn_first": _nemotron_h,
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_other_shapes_agree_with_transformers(name: str) -> None:
    torch.manual_seed(3)
    m = _randomise(BUILDERS[name](), 3)
    lm = StatecacheCausalLM(m, n_seq_max=3, n_ctx=64)
    rng = np.random.default_rng(5)
    ctx = {s: rng.integers(0, V, n).tolist() for s, n in enumerate((1, 6, 13))}
    got = lm.forward(Batch.for_sequences(ctx, output_all=True), output_all=True)
    rows: dict[int, Any] = {}
    k = 0
    for s, toks in ctx.items():
        rows[s] = got[k : k + len(toks)]
        k += len(toks)
    for step in range(3):
        live = [s for s in ctx if step == 0 or s != 0]  # sequence 0 stops early: the others decode on
        nxt = {s: [int(rng.integers(0, V))] for s in live}
        out = lm.forward(Batch.for_sequences(nxt))
        for j, s in enumerate(live):
            ctx[s] = ctx[s] + nxt[s]
            rows[s] = torch.cat([rows[s], out[j : j + 1]])
    for s, toks in ctx.items():
        with torch.no_grad():
            want = m(torch.tensor([toks])).logits[0].float()
        err = float((rows[s] - want).abs().max())
        assert err <= 1e-4 * max(1.0, float(want.abs().max())), (name, s, err)


@pytest.mark.parametrize("name", ["bamba_two_attn", "granite_kv1_attn_first", "mamba2_groups3", "qwen3_next_heads"])
def test_engine_forks_and_drafts_on_other_shapes(name: str) -> None:
    """Requests of three prompt lengths, a late join, a fork that takes another token and a
    speculative request whose drafts are half wrong: every recorded logit row equals
    transformers' forward over the request's context so far."""
    from statecache.integrations.transformers import Engine

    torch.manual_seed(4)
    m = _randomise(BUILDERS[name](), 4)
    lm = StatecacheCausalLM(m, n_seq_max=6, n_rs_seq=3, n_ctx=64)
    eng = Engine(lm, record_logits=True)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, V, n).tolist() for n in (2, 8, 11)]
    rids = [eng.add(p, max_new_tokens=5) for p in prompts]
    eng.step()
    late = eng.add(rng.integers(0, V, 4).tolist(), max_new_tokens=3)
    eng.step()
    fork = eng.fork(rids[2], append=[int(rng.integers(0, V))])

    def wrong_half(context: list[int], k: int) -> list[int]:
        return [int(context[-1]), (int(context[-1]) * 7 + 1) % V, 3][:k]

    spec = eng.add(prompts[1], max_new_tokens=5, draft=wrong_half, n_draft=3)
    eng.run()
    for rid in [*rids, late, fork, spec]:
        req = eng.requests[rid]
        assert req.finished and req.logits, (rid, req.finish_reason)
        with torch.no_grad():
            ref = m(torch.tensor([req.context])).logits[0].float()
        for n, row in req.logits:
            want = ref[n - 1]
            err = float((row - want).abs().max())
            assert err <= 1e-4 * max(1.0, float(want.abs().max())), (name, rid, n, err)
    assert eng.requests[spec].generated == eng.requests[rids[1]].generated
