"""Gated delta net mixers (Qwen3-Next style) of transformers models, advanced by statecache.

:func:`gdn_layout` maps the module once; :func:`gdn_forward` runs the
model's own projections and output norm in torch and the conv window and
delta-rule state of every sequence through the recurrent step.

Conventions, transformers -> statecache:

* conv: q, k and v are convolved together, channels ``[q | k | v]`` (each
  head-major), no bias, SiLU fused (``ssm_conv(apply_silu=True)``); the
  window width differs as for Mamba (``d_conv`` vs ``d_conv - 1`` columns).
* q/k L2 norm (eps 1e-6, FLA's ``l2norm``): in the kernel
  (``qk_l2norm=True``, the same formula ``x / sqrt(sum(x * x) + 1e-6)``).
* head mapping: transformers' value head ``h`` reads q/k head
  ``h // (H_v / H_k)`` (grouped, repeat-interleave): ``head_map="grouped"``,
  so q and k go to the kernel with their ``H_k`` heads, as strided views of
  the conv output (no copy, no repeat).
* gate and beta: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
  ``beta = sigmoid(b)``: the raw projections ``a`` and ``b`` go to the
  kernel with ``A_log``, ``dt_bias`` and ``beta_sigmoid=True``.
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
from .mamba import conv_arguments


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
    A_log: Buffer  # [H_v]: the raw gate's decay, -exp(A_log) * softplus(a + dt_bias)
    dt_bias: Buffer  # [H_v]

    @property
    def spec(self) -> RecurrentLayerSpec:
        # the conv runs on the model's own [q | k | v] channels (H_k heads for q and k)
        # grouped: the head map this integration's gated_delta_net calls pass (transformers' order), which a
        # tensor-parallel split of the spec must follow
        return RecurrentLayerSpec.gdn(
            n_head=self.n_head_v, head_dim=self.head_dim, d_conv=self.d_conv, n_head_k=self.n_head_k,
            head_map="grouped",
        )  # fmt: skip


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
        A_log=bridge.upload(mixer.A_log, (hv,)),
        dt_bias=bridge.upload(mixer.dt_bias, (hv,)),
    )


def gdn_forward(mixer: Any, lay: GdnLayout, h: Any, step: Any, ws: Workspace) -> Any:
    """The mixer's output for hidden states ``h`` [n_s, n_t, hidden] of the applied ubatch."""
    n_s, n_t, _ = h.shape
    Hk, Hv, S, cd = lay.n_head_k, lay.n_head_v, lay.head_dim, lay.conv_dim
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(h), mixer.in_proj_ba(h))
    qkv_buf, qkv = ws.get("qkv", (n_s, n_t, cd))
    kd = Hk * S
    qkv[..., :kd].copy_(q.reshape(n_s, n_t, kd))
    qkv[..., kd : 2 * kd].copy_(k.reshape(n_s, n_t, kd))
    qkv[..., 2 * kd :].copy_(v.reshape(n_s, n_t, Hv * S))
    conv_buf, _ = ws.get("conv_out", (n_s, n_t, cd))
    step.conv(lay.il, qkv_buf, lay.conv_weight, conv_buf, bias=lay.conv_bias, apply_silu=True)
    cshape, cstr = (n_s, n_t, cd), (n_t * cd, cd, S, 1)
    qq = ws.sub("conv_out", cshape, "q", (n_s, n_t, Hk, S), cstr, 0)
    kk = ws.sub("conv_out", cshape, "k", (n_s, n_t, Hk, S), cstr, kd)
    vv = ws.sub("conv_out", cshape, "v", (n_s, n_t, Hv, S), cstr, 2 * kd)
    a_raw, a_t = ws.get("a", (n_s, n_t, Hv))  # the raw gate and beta projections
    b_raw, b_t = ws.get("b", (n_s, n_t, Hv))
    a_t.copy_(a)
    b_t.copy_(b)
    o_buf, o = ws.get("o", (n_s, n_t, Hv, S))
    step.delta(
        lay.il, qq, kk, vv, a_raw, b_raw, o_buf, head_map="grouped", qk_l2norm=True, A_log=lay.A_log,
        dt_bias=lay.dt_bias, beta_sigmoid=True,
    )  # fmt: skip
    out = mixer.norm(o.reshape(-1, S).to(h.dtype), z.reshape(-1, S))
    return mixer.out_proj(out.reshape(n_s, n_t, Hv * S))
