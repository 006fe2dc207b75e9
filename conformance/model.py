"""A tiny random-weight model that runs through statecache's memories on the
device under test, and its full-recompute oracle.

embedding -> [Mamba-2 mixer, GDN mixer] -> logits.  Dense math (projections,
normalisation, gates) is NumPy on the host; everything stateful (conv windows,
SSM and delta-rule states) goes through the device's primitives, driven either
by a :class:`~statecache.recurrent_step.RecurrentStep` (incremental decode
through the memory: slots, copy-on-write, rollback planes, save/restore) or,
for the oracle, by direct primitive calls over a sequence's whole token list
from a zero state in one call.  The two must agree within tolerance whatever
the memory did in between.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from statecache.backend import Buffer, Device
from statecache.spec import MemorySpec, RecurrentLayerSpec

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

LAYERS = ("mamba2", "gdn")


def memory_spec(dtype: str = "f32") -> MemorySpec:
    mamba = RecurrentLayerSpec.mamba2(
        d_inner=M_INNER, d_state=M_STATE, d_conv=D_CONV, n_group=M_GROUPS, head_dim=M_HEAD_DIM
    )
    gdn = RecurrentLayerSpec.gdn(n_head=G_HEADS, head_dim=G_SIZE, d_conv=D_CONV, n_head_k=G_HEADS_K)
    return MemorySpec.build(len(LAYERS), {0: mamba, 1: gdn}, dtype)


@dataclasses.dataclass
class Weights:
    emb: np.ndarray
    out: np.ndarray
    m_in: np.ndarray  # [D, M_CH]  xBC projection
    m_dt: np.ndarray  # [D, M_HEADS]
    m_A: np.ndarray  # [M_HEADS]
    m_conv: np.ndarray  # [M_CH, D_CONV]
    m_bias: np.ndarray  # [M_CH]
    m_out: np.ndarray  # [M_INNER, D]
    g_in: np.ndarray  # [D, G_CH]  qkv projection
    g_gate: np.ndarray  # [D, G_HEADS]
    g_beta: np.ndarray  # [D, G_HEADS]
    g_conv: np.ndarray
    g_bias: np.ndarray
    g_out: np.ndarray  # [G_HEADS * G_SIZE, D]

    @classmethod
    def random(cls, seed: int = 0) -> Weights:
        rng = np.random.default_rng(seed)

        def n(*shape: int, scale: float = 0.3) -> np.ndarray:
            return rng.normal(0.0, scale, shape).astype(np.float32)

        return cls(
            emb=n(VOCAB, D_MODEL, scale=1.0),
            out=n(D_MODEL, VOCAB),
            m_in=n(D_MODEL, M_CH),
            m_dt=n(D_MODEL, M_HEADS),
            m_A=-rng.uniform(0.3, 1.5, M_HEADS).astype(np.float32),
            m_conv=n(M_CH, D_CONV, scale=0.5),
            m_bias=n(M_CH, scale=0.1),
            m_out=n(M_INNER, D_MODEL),
            g_in=n(D_MODEL, G_CH),
            g_gate=n(D_MODEL, G_HEADS),
            g_beta=n(D_MODEL, G_HEADS),
            g_conv=n(G_CH, D_CONV, scale=0.5),
            g_bias=n(G_CH, scale=0.1),
            g_out=n(G_HEADS * G_SIZE, D_MODEL),
        )


class PoolDriver:
    """Drives the primitives directly on one-call pools (the oracle's path)."""

    def __init__(self, dev: Device, n_seqs: int) -> None:
        spec = memory_spec()
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


def _softplus(z: np.ndarray) -> np.ndarray:
    return np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0)))).astype(np.float32)


def forward(dev: Device, driver, w: Weights, tokens: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Logits [n_s, n_t, VOCAB] for tokens [n_s, n_t]; ``driver`` is a
    RecurrentStep or a PoolDriver (both offer conv/scan/delta by layer)."""
    n_s, n_t = tokens.shape
    h = w.emb[tokens]  # [n_s, n_t, D]
    f32 = np.float32
    # layer 0: Mamba-2 mixer
    xbc = dev.alloc((n_s, n_t, M_CH))
    driver.conv(
        0, dev.upload((h @ w.m_in).astype(f32)), dev.upload(w.m_conv), xbc, bias=dev.upload(w.m_bias), apply_silu=True
    )
    xbc_h = dev.download(xbc)
    x = xbc_h[..., :M_INNER].reshape(n_s, n_t, M_HEADS, M_HEAD_DIM)
    B = xbc_h[..., M_INNER : M_INNER + M_GROUPS * M_STATE].reshape(n_s, n_t, M_GROUPS, M_STATE)
    C = xbc_h[..., M_INNER + M_GROUPS * M_STATE :].reshape(n_s, n_t, M_GROUPS, M_STATE)
    dt = (h @ w.m_dt).astype(f32)
    y = dev.alloc((n_s, n_t, M_HEADS, M_HEAD_DIM))
    driver.scan(0, *(dev.upload(np.ascontiguousarray(a)) for a in (x, dt, w.m_A, B, C)), y)
    h = h + dev.download(y).reshape(n_s, n_t, M_INNER) @ w.m_out
    # layer 1: GDN mixer
    qkv = dev.alloc((n_s, n_t, G_CH))
    driver.conv(
        1, dev.upload((h @ w.g_in).astype(f32)), dev.upload(w.g_conv), qkv, bias=dev.upload(w.g_bias), apply_silu=True
    )
    qkv_h = dev.download(qkv)
    nk = G_HEADS_K * G_SIZE
    q = qkv_h[..., :nk].reshape(n_s, n_t, G_HEADS_K, G_SIZE)
    k = qkv_h[..., nk : 2 * nk].reshape(n_s, n_t, G_HEADS_K, G_SIZE)
    v = qkv_h[..., 2 * nk :].reshape(n_s, n_t, G_HEADS, G_SIZE)
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6)
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    g = -_softplus((h @ w.g_gate).astype(f32))
    beta = (1.0 / (1.0 + np.exp(-(h @ w.g_beta)))).astype(f32)
    o = dev.alloc((n_s, n_t, G_HEADS, G_SIZE))
    driver.delta(1, *(dev.upload(np.ascontiguousarray(a, dtype=f32)) for a in (q, k, v, g, beta)), o)
    h = h + dev.download(o).reshape(n_s, n_t, -1) @ w.g_out
    return (h @ w.out).astype(np.float32)


def recompute(dev: Device, w: Weights, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), VOCAB] of one sequence from a zero state, one call."""
    driver = PoolDriver(dev, 1)
    return forward(dev, driver, w, np.asarray([tokens], dtype=np.int64))[0]
