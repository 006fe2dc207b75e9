"""Gated delta net mixers (Qwen3-Next style) of transformers models, advanced by statecache.

:func:`gdn_layout` maps the module once; :func:`gdn_forward` runs the
model's own projections and output norm in torch and the conv window and
delta-rule state of every sequence through the recurrent step.

Conventions, transformers -> statecache:

* conv: q, k and v are convolved together, channels ``[q | k | v]`` (each
  head-major), no bias, SiLU fused (``ssm_conv(apply_silu=True)``); the
  window width differs as for Mamba (``d_conv`` vs ``d_conv - 1`` columns).
* q/k L2 norm (eps 1e-6, FLA's ``l2norm``) in torch (GLUE: switches to the
  in-kernel q/k l2norm option).
* head mapping: transformers' value head ``h`` reads q/k head
  ``h // (H_v / H_k)`` (grouped, repeat-interleave); today's primitive reads
  ``h % H_k`` (tiled), so q and k are repeat-interleaved to ``H_v`` heads in
  torch (GLUE: switches to ``head_map="grouped"``).
* gate and beta: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)`` in torch (GLUE: switches to the raw gate / beta
  option).
* scale: ``1 / sqrt(head_k_dim)``, the primitive's default.
* state transposition: transformers keeps ``[H_v, d_k, d_v]`` per sequence,
  statecache stores each head's block as ``[d_v, d_k]`` (key index fastest):
  the same matrix transposed, never exchanged, so nothing to convert.
* output: the model's own gated RMSNorm (norm, weight, then ``* silu(z)``)
  and ``out_proj``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from statecache.backend import Buffer
from statecache.spec import RecurrentLayerSpec

from .bridge import Bridge, Workspace
from .errors import UnsupportedModelError
from .mamba import conv_arguments, neg_exp


@dataclasses.dataclass
class GdnLayout:
    """Primitive arguments of one gated-delta-net mixer."""

    il: int
    n_head_k: int
    n_head_v: int
    head_dim: int
    d_conv: int
    conv_dim: int
    conv_weight: Buffer  # [conv_dim, d_conv]
    conv_bias: Buffer | None
    neg_A: Any  # torch [H_v]: -exp(A_log)   GLUE -> raw gate option
    dt_bias: Any  # torch [H_v]

    @property
    def spec(self) -> RecurrentLayerSpec:
        # q and k are repeat-interleaved to H_v heads before the primitive, but the conv runs
        # on the model's own [q | k | v] channels (H_k heads for q and k).
        return RecurrentLayerSpec.gdn(
            n_head=self.n_head_v, head_dim=self.head_dim, d_conv=self.d_conv, n_head_k=self.n_head_k
        )


def gdn_layout(mixer: Any, il: int, bridge: Bridge) -> GdnLayout:
    """Map a transformers gated-delta-net mixer (Qwen3NextGatedDeltaNet) onto ``ssm_conv`` /
    ``gated_delta_net`` arguments."""
    hk, hv = int(mixer.num_k_heads), int(mixer.num_v_heads)
    dk, dv = int(mixer.head_k_dim), int(mixer.head_v_dim)
    if dk != dv:
        raise UnsupportedModelError(
            f"layer {il} ({type(mixer).__name__}): key head size {dk} != value head size {dv}; "
            "statecache's gated_delta_net needs one head size"
        )
    if hv % hk:
        raise UnsupportedModelError(f"layer {il}: {hv} value heads are not a multiple of {hk} key heads")
    conv = conv_arguments(mixer, il, bridge)
    if conv.channels != (2 * hk + hv) * dk:
        raise UnsupportedModelError(f"layer {il}: conv has {conv.channels} channels, expected q, k and v")
    return GdnLayout(
        il=il,
        n_head_k=hk,
        n_head_v=hv,
        head_dim=dk,
        d_conv=conv.d_conv,
        conv_dim=conv.channels,
        conv_weight=conv.weight,
        conv_bias=conv.bias,
        neg_A=neg_exp(bridge, mixer.A_log),
        dt_bias=mixer.dt_bias.detach().float().to(bridge.torch_device),
    )


def _l2norm_(torch: Any, x: Any) -> Any:
    # FLA's l2norm: x * rsqrt(sum(x^2) + 1e-6)
    return x.mul_(torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6))


def gdn_forward(mixer: Any, lay: GdnLayout, h: Any, step: Any, ws: Workspace) -> Any:
    """The mixer's output for hidden states ``h`` [n_s, n_t, hidden] of the applied ubatch."""
    torch = ws.bridge.torch
    F = torch.nn.functional
    n_s, n_t, _ = h.shape
    Hk, Hv, S, cd = lay.n_head_k, lay.n_head_v, lay.head_dim, lay.conv_dim
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(h), mixer.in_proj_ba(h))
    qkv_buf, qkv = ws.get("qkv", (n_s, n_t, cd))
    kd = Hk * S
    qkv[..., :kd].copy_(q.reshape(n_s, n_t, kd))
    qkv[..., kd : 2 * kd].copy_(k.reshape(n_s, n_t, kd))
    qkv[..., 2 * kd :].copy_(v.reshape(n_s, n_t, Hv * S))
    conv_buf, conv = ws.get("conv_out", (n_s, n_t, cd))
    step.conv(lay.il, qkv_buf, lay.conv_weight, conv_buf, bias=lay.conv_bias, apply_silu=True)
    rep = Hv // Hk
    q_buf, qt = ws.get("q", (n_s, n_t, Hv, S))
    k_buf, kt = ws.get("k", (n_s, n_t, Hv, S))
    # GLUE -> head_map="grouped" and in-kernel l2norm: repeat-interleave the normalised q/k heads
    qn = _l2norm_(torch, conv[..., :kd].reshape(n_s, n_t, Hk, S).clone())
    kn = _l2norm_(torch, conv[..., kd : 2 * kd].reshape(n_s, n_t, Hk, S).clone())
    qt.view(n_s, n_t, Hk, rep, S).copy_(qn.unsqueeze(3).expand(n_s, n_t, Hk, rep, S))
    kt.view(n_s, n_t, Hk, rep, S).copy_(kn.unsqueeze(3).expand(n_s, n_t, Hk, rep, S))
    vv = ws.sub("conv_out", (n_s, n_t, cd), "v", (n_s, n_t, Hv, S), (n_t * cd, cd, S, 1), 2 * kd)
    g_buf, g = ws.get("g", (n_s, n_t, Hv))
    beta_buf, beta = ws.get("beta", (n_s, n_t, Hv))
    # GLUE -> raw gate option: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    torch.mul(F.softplus(a.float() + lay.dt_bias), lay.neg_A, out=g)
    torch.sigmoid(b.float(), out=beta)
    o_buf, o = ws.get("o", (n_s, n_t, Hv, S))
    step.delta(lay.il, q_buf, k_buf, vv, g_buf, beta_buf, o_buf)
    out = mixer.norm(o.reshape(-1, S).to(h.dtype), z.reshape(-1, S))
    return mixer.out_proj(out.reshape(n_s, n_t, Hv * S))
