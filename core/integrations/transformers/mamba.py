"""Mamba-1 and Mamba-2 mixers of transformers models, advanced by statecache.

Each mixer is mapped once, by one function per family that turns the
module's parameters into primitive arguments (:func:`mamba2_layout`,
:func:`mamba1_layout`); the forward functions then run the module's own
projections and norms in torch and every state update through the
recurrent step (``step.conv`` / ``step.scan``), which owns the conv windows
and SSM states of every sequence.

Conventions, transformers -> statecache (one line each, also in
docs/integrations/transformers.md):

* conv window width: transformers keeps ``d_conv`` columns per channel (the
  newest input included), statecache the ``d_conv - 1`` columns the next
  token needs; the arithmetic is the same, only the stored window differs.
* conv bias and SiLU: ``ssm_conv(bias=conv1d.bias, apply_silu=True)``, fused.
* dt bias and softplus: transformers computes ``softplus(dt + dt_bias)``, as
  the scan's fused ``dt_bias`` does: the raw dt columns of ``in_proj``'s
  output go to the scan as they are (a strided view, no copy).  Mamba-1's
  bias is ``dt_proj.bias``: the projection runs without it and the bias is
  the scan's ``dt_bias`` (mamba_ssm's ``delta_bias``).
* dt limit: the chunked path clamps the softplus output to
  ``time_step_limit``: the scan's ``dt_limit`` (``(0, inf)`` is no clamp).
* D skip: ``y += D * x``, the scan's ``D`` (per head; Mamba-1: per channel).
* gating and norm placement: Mamba-1 multiplies by ``silu(z)`` after the D
  skip, the scan's ``z`` (z is a strided view of ``in_proj``'s output), as
  does Falcon-H1 without ``mamba_rms_norm``; Mamba-2 hands ``y`` and ``z`` to
  the model's own gated RMSNorm, which gates *before* normalising per group
  (``norm_before_gate=False``), so that z is not fused: the norm needs the
  ungated ``y``.
* group and head mapping: Mamba-2 head ``h`` reads B/C group
  ``h // (n_head / n_group)`` in both (repeat-interleave); Mamba-1 is the
  scan with ``head_dim = 1``, ``n_head = d_inner``, one group and a
  ``[d_inner, d_state]`` A.
* A: ``-exp(A_log)`` computed once per attach (:meth:`refresh`).
* state layout: transformers' SSM state ``[batch, n_head, head_dim, d_state]``
  is statecache's row layout ``[n_head, head_dim, d_state]``: no transposition.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from statecache.backend import Buffer
from statecache.spec import RecurrentLayerSpec

from .bridge import Bridge, Workspace
from .errors import UnsupportedModelError

_SILU = ("silu", "swish")


@dataclasses.dataclass(frozen=True)
class ConvArgs:
    """A mixer's depthwise causal conv as ``ssm_conv`` arguments (SiLU after it, fused)."""

    weight: Buffer  # [channels, d_conv]
    bias: Buffer | None
    channels: int
    d_conv: int


def conv_arguments(mixer: Any, il: int, bridge: Bridge) -> ConvArgs:
    """Upload ``mixer.conv1d`` (weight ``[channels, 1, d_conv]``, optional bias) once; refuses a
    conv activation other than SiLU (the one the conv primitive fuses).  Shared by every family."""
    act = getattr(mixer, "activation", "silu")
    if act not in _SILU:
        raise UnsupportedModelError(
            f"layer {il} ({type(mixer).__name__}): conv activation {act!r}; statecache's conv fuses SiLU or nothing"
        )
    w = mixer.conv1d.weight
    ch, d_conv = int(w.shape[0]), int(w.shape[-1])
    bias = mixer.conv1d.bias
    return ConvArgs(bridge.upload(w, (ch, d_conv)), None if bias is None else bridge.upload(bias), ch, d_conv)


def neg_exp(bridge: Bridge, A_log: Any) -> Any:
    """``A = -exp(A_log)`` in float32 on the bridge's torch device (every family's A)."""
    torch = bridge.torch
    with torch.no_grad():
        return (-torch.exp(A_log.detach().float())).to(bridge.torch_device)


def _dt_limit(mixer: Any) -> tuple[float, float] | None:
    lim = getattr(mixer, "time_step_limit", None)
    if lim is None:
        return None
    lo, hi = float(lim[0]), float(lim[1])
    return None if lo <= 0.0 and math.isinf(hi) else (lo, hi)


# -- Mamba-2 ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Mamba2Layout:
    """Primitive arguments of one Mamba-2 mixer (shapes, uploaded parameters)."""

    il: int
    d_inner: int
    n_head: int
    head_dim: int
    n_group: int
    d_state: int
    d_conv: int
    conv_dim: int
    proj: int
    conv_weight: Buffer  # [conv_dim, d_conv]
    conv_bias: Buffer | None
    A: Buffer  # [n_head]: -exp(A_log)
    dt_bias: Buffer  # [n_head], added to dt before softplus
    D: Buffer  # [n_head], the skip y += D * x
    dt_limit: tuple[float, float] | None  # clamp of softplus(dt + dt_bias), None: no clamp
    in_scale: float | None = None  # Falcon-H1: ssm_in_multiplier on the mixer's input
    proj_scale: Any = None  # Falcon-H1: mup_vector, per feature of [z | xBC | dt]
    gated_norm: bool = True  # the model's gated RMSNorm, else y * silu(z) (Falcon-H1 without mamba_rms_norm)

    @property
    def spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec.mamba2(
            d_inner=self.d_inner, d_state=self.d_state, d_conv=self.d_conv, n_group=self.n_group, head_dim=self.head_dim
        )


def mamba2_layout(mixer: Any, il: int, bridge: Bridge) -> Mamba2Layout:
    """Map a transformers Mamba-2 mixer (Mamba2Mixer, BambaMixer, GraniteMoeHybridMambaLayer
    and the mixers that share their attribute names) onto ``ssm_conv`` / ``ssm_scan`` arguments."""
    conv = conv_arguments(mixer, il, bridge)
    d_inner = int(mixer.intermediate_size)
    n_head, head_dim = int(mixer.num_heads), int(mixer.head_dim)
    n_group, d_state = int(mixer.n_groups), int(mixer.ssm_state_size)
    if n_head * head_dim != d_inner:
        raise UnsupportedModelError(f"layer {il}: {n_head} heads x {head_dim} != intermediate size {d_inner}")
    if n_head % n_group:
        raise UnsupportedModelError(
            f"layer {il} ({type(mixer).__name__}): {n_group} groups do not divide {n_head} heads"
        )
    conv_dim = d_inner + 2 * n_group * d_state
    proj = int(mixer.in_proj.out_features)
    if proj != d_inner + conv_dim + n_head or conv.channels != conv_dim:
        raise UnsupportedModelError(
            f"layer {il} ({type(mixer).__name__}): in_proj gives {proj} features and the conv {conv.channels} "
            f"channels, expected z, xBC and dt ({d_inner + conv_dim + n_head}) and xBC ({conv_dim})"
        )
    return Mamba2Layout(
        il=il,
        d_inner=d_inner,
        n_head=n_head,
        head_dim=head_dim,
        n_group=n_group,
        d_state=d_state,
        d_conv=conv.d_conv,
        conv_dim=conv_dim,
        proj=proj,
        conv_weight=conv.weight,
        conv_bias=conv.bias,
        A=bridge.upload(neg_exp(bridge, mixer.A_log)),
        dt_bias=bridge.upload(mixer.dt_bias, (n_head,)),
        D=bridge.upload(mixer.D, (n_head,)),
        dt_limit=_dt_limit(mixer),
        # Falcon-H1's muP multipliers: input scale, and a per-feature scale of the projection
        in_scale=float(mixer.ssm_in_multiplier) if hasattr(mixer, "ssm_in_multiplier") else None,
        proj_scale=getattr(mixer, "mup_vector", None),
        gated_norm=bool(getattr(mixer, "mamba_rms_norm", True)),
    )


def mamba2_forward(mixer: Any, lay: Mamba2Layout, h: Any, step: Any, ws: Workspace) -> Any:
    """The mixer's output for hidden states ``h`` [n_s, n_t, hidden] of the applied ubatch."""
    n_s, n_t, _ = h.shape
    E, cd, H, P, G, N = lay.d_inner, lay.conv_dim, lay.n_head, lay.head_dim, lay.n_group, lay.d_state
    _, proj = ws.get("zxbcdt", (n_s, n_t, lay.proj))
    if lay.in_scale is not None:
        h = h * lay.in_scale
    proj.copy_(mixer.in_proj(h))  # the model's own projection; [z | xBC | dt]
    if lay.proj_scale is not None:
        proj.mul_(lay.proj_scale.reshape(lay.proj))
    shape = (n_s, n_t, lay.proj)
    xbc_in = ws.sub("zxbcdt", shape, "xbc", (n_s, n_t, cd), (n_t * lay.proj, lay.proj, 1), E)
    conv_buf, _ = ws.get("conv_out", (n_s, n_t, cd))
    step.conv(lay.il, xbc_in, lay.conv_weight, conv_buf, bias=lay.conv_bias, apply_silu=True)
    cshape = (n_s, n_t, cd)
    x = ws.sub("conv_out", cshape, "x", (n_s, n_t, H, P), (n_t * cd, cd, P, 1), 0)
    B = ws.sub("conv_out", cshape, "B", (n_s, n_t, G, N), (n_t * cd, cd, N, 1), E)
    C = ws.sub("conv_out", cshape, "C", (n_s, n_t, G, N), (n_t * cd, cd, N, 1), E + G * N)
    pstr = (n_t * lay.proj, lay.proj)
    dt = ws.sub("zxbcdt", shape, "dt", (n_s, n_t, H), (*pstr, 1), E + cd)  # raw: bias and softplus fused
    y_buf, y = ws.get("y", (n_s, n_t, H, P))
    # the model's gated RMSNorm gates y before normalising it: z stays out of the scan then
    z = None if lay.gated_norm else ws.sub("zxbcdt", shape, "z", (n_s, n_t, H, P), (*pstr, P, 1), 0)
    step.scan(lay.il, x, dt, lay.A, B, C, y_buf, D=lay.D, z=z, dt_bias=lay.dt_bias, dt_limit=lay.dt_limit)
    y3 = y.view(n_s, n_t, E)
    out = mixer.norm(y3.to(h.dtype), proj[..., :E].to(h.dtype)) if lay.gated_norm else y3
    return mixer.out_proj(out.to(h.dtype))


# -- Mamba-1 ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Mamba1Layout:
    """Primitive arguments of one Mamba-1 mixer."""

    il: int
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_weight: Buffer  # [d_inner, d_conv]
    conv_bias: Buffer | None
    A: Buffer  # [d_inner, d_state]: -exp(A_log)
    D: Buffer  # [d_inner], the skip y += D * x
    dt_weight: Any  # torch [d_inner, dt_rank]: dt_proj without its bias
    dt_bias: Buffer | None  # [d_inner]: dt_proj's bias, added before softplus in the scan
    bcdt_norm: bool  # FalconMamba-style RMS norms on B, C and dt before the scan

    @property
    def spec(self) -> RecurrentLayerSpec:
        return RecurrentLayerSpec.mamba1(d_inner=self.d_inner, d_state=self.d_state, d_conv=self.d_conv)


def mamba1_layout(mixer: Any, il: int, bridge: Bridge) -> Mamba1Layout:
    """Map a transformers Mamba-1 mixer (MambaMixer, FalconMambaMixer, JambaMambaMixer) onto
    ``ssm_conv`` / ``ssm_scan`` arguments (the Mamba-1 variant: head_dim 1, A [d_inner, d_state])."""
    conv = conv_arguments(mixer, il, bridge)
    d_inner = int(mixer.intermediate_size)
    return Mamba1Layout(
        il=il,
        d_inner=d_inner,
        d_state=int(mixer.ssm_state_size),
        d_conv=conv.d_conv,
        dt_rank=int(mixer.time_step_rank),
        conv_weight=conv.weight,
        conv_bias=conv.bias,
        A=bridge.upload(neg_exp(bridge, mixer.A_log)),
        D=bridge.upload(mixer.D, (d_inner,)),
        dt_weight=mixer.dt_proj.weight,
        dt_bias=None if mixer.dt_proj.bias is None else bridge.upload(mixer.dt_proj.bias, (d_inner,)),
        bcdt_norm=hasattr(mixer, "b_layernorm"),
    )


def mamba1_forward(mixer: Any, lay: Mamba1Layout, h: Any, step: Any, ws: Workspace) -> Any:
    """The Mamba-1 mixer's output for ``h`` [n_s, n_t, hidden] of the applied ubatch."""
    torch = ws.bridge.torch
    n_s, n_t, _ = h.shape
    E, N, R = lay.d_inner, lay.d_state, lay.dt_rank
    _, xz = ws.get("xz", (n_s, n_t, 2 * E))
    xz.copy_(mixer.in_proj(h))  # [x | z]
    x_in = ws.sub("xz", (n_s, n_t, 2 * E), "x", (n_s, n_t, E), (n_t * 2 * E, 2 * E, 1), 0)
    conv_buf, conv = ws.get("conv_out", (n_s, n_t, E))
    step.conv(lay.il, x_in, lay.conv_weight, conv_buf, bias=lay.conv_bias, apply_silu=True)
    W = R + 2 * N
    _, xdbl = ws.get("xdbl", (n_s, n_t, W))
    xdbl.copy_(mixer.x_proj(conv.to(h.dtype)))  # [dt_low | B | C]
    dt_low = xdbl[..., :R]
    if lay.bcdt_norm:  # FalconMamba / Jamba: the model's own RMS norms on dt, B and C
        dt_low = mixer.dt_layernorm(dt_low)
        xdbl[..., R : R + N].copy_(mixer.b_layernorm(xdbl[..., R : R + N]))
        xdbl[..., R + N :].copy_(mixer.c_layernorm(xdbl[..., R + N :]))
    B = ws.sub("xdbl", (n_s, n_t, W), "B", (n_s, n_t, 1, N), (n_t * W, W, N, 1), R)
    C = ws.sub("xdbl", (n_s, n_t, W), "C", (n_s, n_t, 1, N), (n_t * W, W, N, 1), R + N)
    dt_buf, dt = ws.get("dt", (n_s, n_t, E))
    # dt_proj without its bias: the scan adds it before softplus (mamba_ssm's delta_bias)
    if dt_low.dtype == dt.dtype == lay.dt_weight.dtype:
        torch.matmul(dt_low, lay.dt_weight.t(), out=dt)
    else:
        dt.copy_(torch.nn.functional.linear(dt_low.to(h.dtype), lay.dt_weight))
    x4 = ws.sub("conv_out", (n_s, n_t, E), "x4", (n_s, n_t, E, 1), (n_t * E, E, 1, 1), 0)
    z4 = ws.sub("xz", (n_s, n_t, 2 * E), "z4", (n_s, n_t, E, 1), (n_t * 2 * E, 2 * E, 1, 1), E)
    y_buf, y = ws.get("y", (n_s, n_t, E, 1))
    step.scan(lay.il, x4, dt_buf, lay.A, B, C, y_buf, D=lay.D, z=z4, dt_bias=lay.dt_bias)  # y = (scan + D x) silu(z)
    return mixer.out_proj(y.view(n_s, n_t, E).to(h.dtype))
