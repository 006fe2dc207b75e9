"""A tiny random-weight model that runs through statecache's memories on the
device under test, and its full-recompute oracle.

embedding -> layers -> logits, each layer a residual mixer: a Mamba-2 mixer,
a GDN mixer, grouped-query attention with RoPE, an RWKV-6 or RWKV-7 block
(time mixing through the wkv state and a token shift, then channel mixing
through the token shift's second part) or a GLA mixer.  Three layouts:
:data:`RECURRENT_LAYERS` (Mamba-2, GDN: a :class:`~statecache.recurrent.
RecurrentMemory`), :data:`HYBRID_LAYERS` (Mamba-2, attention, GDN,
attention: a :class:`~statecache.hybrid.HybridMemory`) and
:data:`LINEAR_ATTN_LAYERS` (RWKV-6, RWKV-7, GLA: a recurrent memory).

Dense math (projections, normalisation, gates, RoPE, softmax) is NumPy on
the host; everything stateful goes through the device's primitives: conv
windows, SSM and delta-rule states through ``ssm_conv`` / ``ssm_scan`` /
``gated_delta_net`` / ``rwkv_wkv6`` / ``rwkv_wkv7`` / ``gated_linear_attn``
and the token shift (``ssm_conv`` with taps [1, 0]) (driven by a
:class:`~statecache.recurrent_step.
RecurrentStep` on the memory's pools, or, for the oracle, by direct calls over
a sequence's whole token list from a zero state in one call; the oracle's
token shift is computed on the host), and attention
K/V through ``set_rows`` into the KV cache buffers and ``get_rows`` back out.

Attention needs more than the token list to be recomputed: what a token saw
depends on the cells its sequence held when it was decoded (a context shift
drops some and moves others).  The oracle therefore takes, per token, its
*view*: the indices of the tokens its attention saw and the positions they
had then (RoPE makes scores depend on those positions only through their
differences with the query's).  K and V of every token are recomputed from
the zero state; only the visibility comes from the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from statecache.backend import Buffer, Device
from statecache.dtypes import DType
from statecache.primitives import token_view
from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec, RecurrentLayerSpec

if TYPE_CHECKING:
    from statecache.kv_cache import KVCache, KVCacheContext

VOCAB = 24
D_MODEL = 16
D_CONV = 4
# Mamba-2 mixer
M_HEADS, M_HEAD_DIM, M_STATE, M_GROUPS = 4, 4, 8, 2
M_INNER = M_HEADS * M_HEAD_DIM
M_CH = M_INNER + 2 * M_GROUPS * M_STATE
# GDN mixer (value-head repeat: 4 value heads over 2 q/k heads)
G_HEADS, G_HEADS_K, G_SIZE = 4, 2, 8
G_CH = (2 * G_HEADS_K + G_HEADS) * G_SIZE
# attention (grouped-query: 4 query heads over 2 K/V heads), RoPE on every pair of K/Q
A_HEADS, A_HEADS_KV, A_DIM = 4, 2, 8
ROPE_BASE = 100.0  # small base: even the slowest pair turns visibly over a few dozen positions

# RWKV-6 / RWKV-7 blocks and the GLA mixer: heads of R_SIZE over the whole hidden size
R_HEADS, R_SIZE = 2, 8
R_FFN = 32

RECURRENT_LAYERS = ("mamba2", "gdn")
HYBRID_LAYERS = ("mamba2", "attn", "gdn", "attn")
LINEAR_ATTN_LAYERS = ("rwkv6", "rwkv7", "gla")
KINDS = ("mamba2", "gdn", "attn", "rwkv6", "rwkv7", "gla")

#: The stateful primitives each kind of layer calls (the memory cases require them).
KIND_OPS: dict[str, tuple[str, ...]] = {
    "mamba2": ("ssm_conv", "ssm_scan"),
    "gdn": ("ssm_conv", "gated_delta_net"),
    "attn": (),
    "rwkv6": ("ssm_conv", "rwkv_wkv6"),
    "rwkv7": ("ssm_conv", "rwkv_wkv7"),
    "gla": ("gated_linear_attn",),
}


def _recurrent_spec(kind: str) -> RecurrentLayerSpec:
    if kind == "mamba2":
        return RecurrentLayerSpec.mamba2(
            d_inner=M_INNER, d_state=M_STATE, d_conv=D_CONV, n_group=M_GROUPS, head_dim=M_HEAD_DIM
        )
    if kind == "rwkv6":
        return RecurrentLayerSpec.rwkv6(n_embd=D_MODEL, head_size=R_SIZE)
    if kind == "rwkv7":
        return RecurrentLayerSpec.rwkv7(n_embd=D_MODEL, head_size=R_SIZE)
    if kind == "gla":
        return RecurrentLayerSpec.gla(n_head=R_HEADS, head_dim=R_SIZE)
    return RecurrentLayerSpec.gdn(n_head=G_HEADS, head_dim=G_SIZE, d_conv=D_CONV, n_head_k=G_HEADS_K)


def memory_spec(dtype: str = "f32", layers: Sequence[str] = RECURRENT_LAYERS) -> MemorySpec:
    """The recurrent layers' state spec (attention layers hold no recurrent state)."""
    rec = {i: _recurrent_spec(kind) for i, kind in enumerate(layers) if kind != "attn"}
    return MemorySpec.build(len(layers), rec, dtype)


def model_spec(dtype: str = "f32", layers: Sequence[str] = HYBRID_LAYERS) -> ModelSpec:
    """The whole model's memory map; K/V are stored in ``dtype`` like the recurrent states."""
    rec = {i: _recurrent_spec(kind) for i, kind in enumerate(layers) if kind != "attn"}
    att = {i: AttentionLayerSpec(A_HEADS_KV, A_DIM) for i, kind in enumerate(layers) if kind == "attn"}
    return ModelSpec.build(len(layers), recurrent=rec, attention=att, dtype=dtype, kv_dtype=dtype)


@dataclasses.dataclass
class Weights:
    layers: tuple[str, ...]
    emb: np.ndarray  # [VOCAB, D]
    out: np.ndarray  # [D, VOCAB]
    per_layer: list[dict[str, np.ndarray]]

    @classmethod
    def random(cls, seed: int = 0, layers: Sequence[str] = RECURRENT_LAYERS) -> Weights:
        unknown = set(layers) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown layer kinds {sorted(unknown)}; known: {KINDS}")
        rng = np.random.default_rng(seed)

        def n(*shape: int, scale: float = 0.3) -> np.ndarray:
            return rng.normal(0.0, scale, shape).astype(np.float32)

        per_layer: list[dict[str, np.ndarray]] = []
        for kind in layers:
            if kind == "mamba2":
                per_layer.append(
                    {
                        "in": n(D_MODEL, M_CH),  # xBC projection
                        "dt": n(D_MODEL, M_HEADS),
                        "A": -rng.uniform(0.3, 1.5, M_HEADS).astype(np.float32),
                        "conv": n(M_CH, D_CONV, scale=0.5),
                        "bias": n(M_CH, scale=0.1),
                        "out": n(M_INNER, D_MODEL),
                    }
                )
            elif kind == "gdn":
                per_layer.append(
                    {
                        "in": n(D_MODEL, G_CH),  # qkv projection
                        "gate": n(D_MODEL, G_HEADS),
                        "beta": n(D_MODEL, G_HEADS),
                        "conv": n(G_CH, D_CONV, scale=0.5),
                        "bias": n(G_CH, scale=0.1),
                        "out": n(G_HEADS * G_SIZE, D_MODEL),
                    }
                )
            elif kind in ("rwkv6", "rwkv7"):
                mixes = ("r", "w", "k", "v", "a")
                layer = {f"mu_{m}": rng.uniform(0.0, 1.0, D_MODEL).astype(np.float32) for m in mixes}
                layer.update({f"W{m}": n(D_MODEL, D_MODEL, scale=0.4) for m in mixes})
                layer.update(
                    {
                        "w0": rng.uniform(-2.0, 0.5, D_MODEL).astype(np.float32),  # RWKV-6: decay -exp(w0 + x Ww)
                        "u": n(R_HEADS, R_SIZE, scale=0.5),
                        "out": n(D_MODEL, D_MODEL),
                        "mu_ffn": rng.uniform(0.0, 1.0, D_MODEL).astype(np.float32),
                        "ffn_in": n(D_MODEL, R_FFN),
                        "ffn_out": n(R_FFN, D_MODEL, scale=0.2),
                    }
                )
                per_layer.append(layer)
            elif kind == "gla":
                per_layer.append({f"W{m}": n(D_MODEL, D_MODEL, scale=0.4) for m in ("q", "k", "v", "g")})
                per_layer[-1]["out"] = n(D_MODEL, D_MODEL)
            else:
                per_layer.append(
                    {
                        "q": n(D_MODEL, A_HEADS * A_DIM, scale=0.5),
                        "k": n(D_MODEL, A_HEADS_KV * A_DIM, scale=0.5),
                        "v": n(D_MODEL, A_HEADS_KV * A_DIM),
                        "out": n(A_HEADS * A_DIM, D_MODEL),
                    }
                )
        return cls(tuple(layers), n(VOCAB, D_MODEL, scale=1.0), n(D_MODEL, VOCAB), per_layer)


# -- RoPE and attention math (host) -----------------------------------------------


def rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rotate every pair ``(x[2i], x[2i+1])`` of the last axis by ``pos * ROPE_BASE**(-2i/d)``.

    ``x`` [n, heads, d], ``pos`` [n] (any integers, negative too: rotating by
    ``a`` then by ``b`` is rotating by ``a + b``, which is what a K shift uses).
    """
    d = x.shape[-1]
    freq = ROPE_BASE ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, dtype=np.float64).reshape(-1, 1, 1) * freq  # [n, 1, d/2]
    cos, sin = np.cos(ang), np.sin(ang)
    x = x.astype(np.float64)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out.astype(np.float32)


def attend_one(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Softmax attention of one token: ``q`` [A_HEADS, d] over ``k``/``v`` [n, A_HEADS_KV, d]."""
    group = A_HEADS // A_HEADS_KV
    kk = np.repeat(k.astype(np.float64), group, axis=1)  # [n, A_HEADS, d]
    vv = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("hd,nhd->hn", q.astype(np.float64), kk) / np.sqrt(A_DIM)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,nhd->hd", w, vv).astype(np.float32)


def rope_k_shift(cache: KVCache, il: int, k_buf: Buffer, rows: np.ndarray, shifts: np.ndarray) -> None:
    """The runtime's K re-rotation hook for a context shift: gather the shifted
    rows (``get_rows``, converting to f32), rotate them on the host by their
    position change, scatter them back (``set_rows``, converting to storage)."""
    dev = cache.device
    idx = dev.indices(rows)
    tmp = dev.alloc((rows.size, k_buf.shape[1]), DType.F32)
    dev.get_rows(k_buf, idx, tmp)
    k = dev.download(tmp).reshape(rows.size, A_HEADS_KV, A_DIM)
    dev.set_rows(k_buf, idx, dev.upload(rope(k, shifts).reshape(rows.size, -1)))


# -- mixers: where the stateful work of each layer goes ------------------------------


class Mixers(Protocol):
    def conv(self, layer: int, x: Buffer, w: Buffer, y: Buffer, *, bias: Buffer, apply_silu: bool) -> None: ...

    def scan(self, layer: int, *args: Buffer) -> None: ...

    def delta(self, layer: int, *args: Buffer) -> None: ...

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray: ...

    def shift(self, layer: int, x: np.ndarray, part: int) -> np.ndarray: ...

    def linear_attn(self, layer: int, op: str, *args: Buffer) -> None: ...


class PoolDriver:
    """Drives the recurrent primitives directly on one-call pools (the oracle's path):
    row ``s`` of each pool is sequence ``s``'s state (alloc zero-fills)."""

    def __init__(self, dev: Device, n_seqs: int, layers: Sequence[str] = RECURRENT_LAYERS) -> None:
        spec = memory_spec(layers=layers)
        self.dev = dev
        self.pools = {
            L: {t.name: dev.alloc((n_seqs, t.row_size)) for t in layer.tensors}
            for L, layer in enumerate(spec.layers)
            if layer is not None
        }
        self.rows = dev.indices(np.arange(n_seqs))

    def conv(self, L: int, x: Buffer, w: Buffer, y: Buffer, *, bias: Buffer, apply_silu: bool) -> None:
        self.dev.ssm_conv(self.pools[L]["r"], self.rows, self.rows, x, w, y, bias=bias, apply_silu=apply_silu)

    def scan(self, L: int, *args: Buffer) -> None:
        self.dev.ssm_scan(self.pools[L]["s"], self.rows, self.rows, *args)

    def delta(self, L: int, *args: Buffer) -> None:
        self.dev.gated_delta_net(self.pools[L]["s"], self.rows, self.rows, *args)

    def linear_attn(self, L: int, op: str, *args: Buffer) -> None:
        getattr(self.dev, op)(self.pools[L]["s"], self.rows, self.rows, *args)

    def shift(self, L: int, x: np.ndarray, part: int) -> np.ndarray:
        """The token shift from a zero state, on the host: each token's previous input."""
        out = np.zeros_like(x)
        out[:, 1:] = x[:, :-1]
        return out


class OracleMixers(PoolDriver):
    """One sequence from a zero state in one call per layer; attention over each
    token's recorded view (see the module docstring).  K/V are rounded to the
    KV storage dtype, as the cache stores them."""

    def __init__(
        self,
        dev: Device,
        layers: Sequence[str],
        qpos: Sequence[int],
        views: Sequence[tuple[np.ndarray, np.ndarray]],
        kv_dtype: DType = DType.F32,
    ) -> None:
        super().__init__(dev, 1, layers)
        self.qpos = np.asarray(qpos, dtype=np.int64)
        self.views = views
        self.kv_dtype = kv_dtype

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        q, k, v = q[0], k[0], v[0]  # one sequence: [n, heads, d]
        store = self.kv_dtype.numpy
        qr = rope(q, self.qpos)
        out = np.empty_like(qr)
        for j, (idx, pos) in enumerate(self.views):
            kj = rope(k[idx], pos).astype(store).astype(np.float32)
            vj = v[idx].astype(store).astype(np.float32)
            out[j] = attend_one(qr[j], kj, vj)
        return out[None]


def _packed(buf: Buffer) -> Buffer:
    """``buf`` [1, n_tokens, ...] as [n_tokens, ...] over the same memory."""
    view = token_view(buf)
    assert view is not None  # one row of tokens can always drop its leading axis
    return view


class StepMixers:
    """One committed ubatch of a memory: recurrent layers through its
    :class:`RecurrentStep`, attention through its KV cache context (K/V written
    with ``set_rows``, the mask from the cache, K/V read back with ``get_rows``)."""

    def __init__(self, dev: Device, step: Any, attn_ctx: KVCacheContext | None = None) -> None:
        self.dev = dev
        self.step = step
        self.attn_ctx = attn_ctx
        # A varlen step (``init_batch(varlen=True)``) takes per-token tensors packed,
        # [n_tokens, ...]; the model computes the ubatch as one row of n_tokens tokens,
        # [1, n_tokens, ...], in the ubatch's (set-major) order: the same memory.
        self.packed = getattr(step, "cu_seqlens", None) is not None

    def _tokens(self, args: tuple[Buffer, ...]) -> tuple[Buffer, ...]:
        if not self.packed:
            return args
        # per-token tensors are [1, n_tokens, ...] (3-D or more); weights have fewer axes
        return tuple(_packed(b) if b.ndim >= 3 and b.shape[0] == 1 else b for b in args)

    def conv(self, L: int, x: Buffer, w: Buffer, y: Buffer, *, bias: Buffer, apply_silu: bool) -> None:
        x, y = self._tokens((x, y))
        self.step.conv(L, x, w, y, bias=bias, apply_silu=apply_silu)

    def scan(self, L: int, *args: Buffer) -> None:
        self.step.scan(L, *self._tokens(args))

    def delta(self, L: int, *args: Buffer) -> None:
        self.step.delta(L, *self._tokens(args))

    def linear_attn(self, L: int, op: str, *args: Buffer) -> None:
        method = {"rwkv_wkv6": self.step.wkv6, "rwkv_wkv7": self.step.wkv7, "gated_linear_attn": self.step.gla}[op]
        method(L, *self._tokens(args))

    def shift(self, L: int, x: np.ndarray, part: int) -> np.ndarray:
        dev = self.dev
        prev = dev.alloc(x.shape)
        (x_buf, prev_view) = self._tokens((dev.upload(np.ascontiguousarray(x, dtype=np.float32)), prev))
        self.step.shift(L, x_buf, prev_view, part=part)
        return dev.download(prev)

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        ctx = self.attn_ctx
        if ctx is None:
            raise ValueError("this memory has no attention part")
        dev, cache, ub = self.dev, ctx.cache, ctx.get_ubatch()
        n_s, n_t = q.shape[:2]
        n = n_s * n_t
        pos = np.asarray(ub.pos, dtype=np.int64)
        qr = rope(q.reshape(n, A_HEADS, A_DIM), pos)
        ctx.cpy_k(layer, rope(k.reshape(n, A_HEADS_KV, A_DIM), pos).reshape(n, -1))
        ctx.cpy_v(layer, v.reshape(n, -1))
        mask = ctx.mask()
        n_kv = mask.shape[1]
        streams = np.zeros(n, dtype=np.int64) if cache.unified else np.asarray(ub.primary, dtype=np.int64)
        out = np.empty_like(qr)
        for strm in np.unique(streams):
            rows = dev.indices(np.arange(n_kv) + int(strm) * cache.size)
            kv = []
            for buf in (cache.k[layer], cache.v[layer]):
                tmp = dev.alloc((n_kv, buf.shape[1]), DType.F32)
                dev.get_rows(buf, rows, tmp)
                kv.append(dev.download(tmp).reshape(n_kv, A_HEADS_KV, A_DIM))
            for i in np.flatnonzero(streams == strm):
                # only the cells the mask shows: the others hold garbage or other sequences
                vis = np.isfinite(mask[i])
                out[i] = attend_one(qr[i], kv[0][vis], kv[1][vis])
        return out.reshape(n_s, n_t, A_HEADS, A_DIM)


# -- the model -------------------------------------------------------------------


def _softplus(z: np.ndarray) -> np.ndarray:
    return np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0)))).astype(np.float32)


def _mamba2(dev: Device, mix: Mixers, L: int, p: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    n_s, n_t = h.shape[:2]
    f32 = np.float32
    xbc = dev.alloc((n_s, n_t, M_CH))
    mix.conv(L, dev.upload((h @ p["in"]).astype(f32)), dev.upload(p["conv"]), xbc, bias=dev.upload(p["bias"]),
             apply_silu=True)  # fmt: skip
    xbc_h = dev.download(xbc)
    x = xbc_h[..., :M_INNER].reshape(n_s, n_t, M_HEADS, M_HEAD_DIM)
    B = xbc_h[..., M_INNER : M_INNER + M_GROUPS * M_STATE].reshape(n_s, n_t, M_GROUPS, M_STATE)
    C = xbc_h[..., M_INNER + M_GROUPS * M_STATE :].reshape(n_s, n_t, M_GROUPS, M_STATE)
    dt = (h @ p["dt"]).astype(f32)
    y = dev.alloc((n_s, n_t, M_HEADS, M_HEAD_DIM))
    mix.scan(L, *(dev.upload(np.ascontiguousarray(a)) for a in (x, dt, p["A"], B, C)), y)
    return dev.download(y).reshape(n_s, n_t, M_INNER) @ p["out"]


def _gdn(dev: Device, mix: Mixers, L: int, p: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    n_s, n_t = h.shape[:2]
    f32 = np.float32
    qkv = dev.alloc((n_s, n_t, G_CH))
    mix.conv(L, dev.upload((h @ p["in"]).astype(f32)), dev.upload(p["conv"]), qkv, bias=dev.upload(p["bias"]),
             apply_silu=True)  # fmt: skip
    qkv_h = dev.download(qkv)
    nk = G_HEADS_K * G_SIZE
    q = qkv_h[..., :nk].reshape(n_s, n_t, G_HEADS_K, G_SIZE)
    k = qkv_h[..., nk : 2 * nk].reshape(n_s, n_t, G_HEADS_K, G_SIZE)
    v = qkv_h[..., 2 * nk :].reshape(n_s, n_t, G_HEADS, G_SIZE)
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6)
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    g = -_softplus((h @ p["gate"]).astype(f32))
    beta = (1.0 / (1.0 + np.exp(-(h @ p["beta"])))).astype(f32)
    o = dev.alloc((n_s, n_t, G_HEADS, G_SIZE))
    mix.delta(L, *(dev.upload(np.ascontiguousarray(a, dtype=f32)) for a in (q, k, v, g, beta)), o)
    return dev.download(o).reshape(n_s, n_t, -1) @ p["out"]


def _rms(h: np.ndarray) -> np.ndarray:
    return (h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-z))).astype(np.float32)


def _heads(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.reshape(*a.shape[:2], R_HEADS, R_SIZE), dtype=np.float32)


def _rwkv(dev: Device, mix: Mixers, L: int, p: dict[str, np.ndarray], h: np.ndarray, kind: str) -> np.ndarray:
    """An RWKV-6 / RWKV-7 block: time mixing (token-shift part 0, then the wkv state),
    then channel mixing (token-shift part 1); returns the new residual stream."""
    n_s, n_t = h.shape[:2]
    x = _rms(h)
    dx = mix.shift(L, x, 0) - x
    mixed = {m: (x + dx * p[f"mu_{m}"]) @ p[f"W{m}"] for m in ("r", "w", "k", "v", "a")}
    r, k, v = (_heads(mixed[m]) for m in ("r", "k", "v"))
    o = dev.alloc((n_s, n_t, R_HEADS, R_SIZE))
    up = dev.upload
    if kind == "rwkv6":
        w = _heads(-np.exp(np.minimum(p["w0"] + mixed["w"], 4.0)))  # per-key log-decay
        mix.linear_attn(L, "rwkv_wkv6", up(r), up(k), up(v), up(w), up(p["u"]), o)
    else:
        w = _heads(-0.606531 * _sigmoid(mixed["w"]))
        kk = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        iclr = _heads(_sigmoid(mixed["a"]))
        mix.linear_attn(L, "rwkv_wkv7", up(r), up(w), up(k), up(v), up(_heads(-kk)), up(_heads(kk * iclr)), o)
    h = h + dev.download(o).reshape(n_s, n_t, -1) @ p["out"]
    x2 = _rms(h)
    k2 = x2 + (mix.shift(L, x2, 1) - x2) * p["mu_ffn"]
    return h + np.square(np.maximum(k2 @ p["ffn_in"], 0.0)) @ p["ffn_out"]


def _gla(dev: Device, mix: Mixers, L: int, p: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    n_s, n_t = h.shape[:2]
    x = _rms(h)
    q, k, v = (_heads(x @ p[f"W{m}"]) for m in ("q", "k", "v"))
    g = _heads(-np.log1p(np.exp(-(x @ p["Wg"]))) / 4.0)  # logsigmoid / 4: a per-key log-gate
    o = dev.alloc((n_s, n_t, R_HEADS, R_SIZE))
    mix.linear_attn(L, "gated_linear_attn", *(dev.upload(a) for a in (q, k, v, g)), o)
    return dev.download(o).reshape(n_s, n_t, -1) @ p["out"]


def _attention(mix: Mixers, L: int, p: dict[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    n_s, n_t = h.shape[:2]
    # RMS-normalised input keeps the scores in a range where softmax is neither flat nor one-hot
    x = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    q = (x @ p["q"]).astype(np.float32).reshape(n_s, n_t, A_HEADS, A_DIM)
    k = (x @ p["k"]).astype(np.float32).reshape(n_s, n_t, A_HEADS_KV, A_DIM)
    v = (x @ p["v"]).astype(np.float32).reshape(n_s, n_t, A_HEADS_KV, A_DIM)
    o = mix.attend(L, q, k, v)
    return o.reshape(n_s, n_t, -1) @ p["out"]


def forward(dev: Device, mix: Mixers, w: Weights, tokens: np.ndarray) -> np.ndarray:
    """Logits [n_s, n_t, VOCAB] for tokens [n_s, n_t] (``n_s`` sets of
    ``n_t`` consecutive tokens, the equal split's layout)."""
    h = w.emb[tokens]  # [n_s, n_t, D]
    for L, (kind, p) in enumerate(zip(w.layers, w.per_layer, strict=True)):
        if kind == "mamba2":
            h = h + _mamba2(dev, mix, L, p, h)
        elif kind == "gdn":
            h = h + _gdn(dev, mix, L, p, h)
        elif kind in ("rwkv6", "rwkv7"):
            h = _rwkv(dev, mix, L, p, h, kind)
        elif kind == "gla":
            h = h + _gla(dev, mix, L, p, h)
        else:
            h = h + _attention(mix, L, p, h)
    return (h @ w.out).astype(np.float32)


def recompute(
    dev: Device,
    w: Weights,
    tokens: Sequence[int],
    qpos: Sequence[int] | None = None,
    views: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    kv_dtype: DType = DType.F32,
) -> np.ndarray:
    """Logits [len(tokens), VOCAB] of one sequence from a zero state, one call per
    layer.  ``qpos``/``views``: each token's position and attention view (only
    needed when the model has attention; by default token ``j`` is at ``j`` and
    saw tokens ``0..j`` at their indices)."""
    n = len(tokens)
    if qpos is None:
        qpos = list(range(n))
    if views is None:
        views = [(np.arange(j + 1), np.arange(j + 1)) for j in range(n)]
    mix = OracleMixers(dev, w.layers, qpos, views, kv_dtype)
    return forward(dev, mix, w, np.asarray([list(tokens)], dtype=np.int64))[0]
