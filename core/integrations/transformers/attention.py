"""Attention layers of hybrid models, with their K/V rows in statecache's KV cache.

The model's own attention module runs unchanged (projections, q/k norms,
rotary embedding, output gate, its configured attention function); it is
handed a :class:`KVRows` object where it expects a transformers ``Cache``.
``update(k, v, layer_idx)`` writes this ubatch's K/V rows into the cells
statecache's KV cache chose for them (``set_rows`` into the cache's own
buffers) and returns every cell the ubatch may see, viewed without a copy;
the additive mask statecache builds for the ubatch hides the cells each
token must not see (other sequences, future positions).

Conventions: K/V rows are stored token-major ``[n_head_kv * head_dim]``
(transformers' ``[batch, n_head_kv, seq, head_dim]`` transposed); K is stored
after the rotary embedding, as transformers caches it.  With one stream per
sequence (the default) a token attends over its own sequence's cells only;
with a unified cache, over every cell, masked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from statecache.backend import Buffer

from .bridge import Bridge, Workspace


class KVRows:
    """The K/V side of one applied ubatch, shaped like the part of a transformers
    ``Cache`` an attention module uses (``update``)."""

    def __init__(
        self,
        actx: Any,
        ub: Any,
        bridge: Bridge,
        ws: Workspace,
        views: dict[int, tuple[Any, Any]],
        slots: dict[int, int],
        dtype: Any,
    ) -> None:
        torch = bridge.torch
        self.bridge = bridge
        self.ws = ws
        self.cache = cache = actx.cache
        self.views = views  # memory layer -> (K tensor, V tensor) over the cache's buffers
        self.slots = slots  # decoder layer index (what attention modules pass) -> memory layer
        self.n_s, self.n_t = int(ub.n_seqs), int(ub.n_seq_tokens)
        self.n_kv = int(actx.n_kv())
        self.rows: Buffer = actx.write_rows_buffer()  # the cache's reused rows, shared by every layer
        mask = actx.mask()  # [n_tokens, n_kv], 0 or -inf
        # a copy: the memory hands every layer one read-only mask, and a model's
        # attention code may edit its mask in place (one [n_tokens, n_kv] copy per ubatch)
        self.mask = torch.tensor(mask, dtype=dtype, device=bridge.torch_device)
        self.mask = self.mask.view(self.n_s, 1, self.n_t, self.n_kv)
        self.streams = None
        if not cache.unified:
            firsts = np.asarray([ids[0] for ids in ub.set_seq_ids], dtype=np.int64)
            self.streams = torch.from_numpy(firsts).to(bridge.torch_device)

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Write this ubatch's K/V of layer ``layer_idx``; return the visible cells
        as ``[n_s, n_head_kv, n_kv, head_dim]`` (K and V)."""
        n_s, n_t, n_kv = self.n_s, self.n_t, self.n_kv
        hkv, dk = int(key_states.shape[1]), int(key_states.shape[-1])
        dv = int(value_states.shape[-1])
        dev = self.cache.device
        il = self.slots[layer_idx]
        for src, buf_of, width, role in (
            (key_states, self.cache.k, hkv * dk, "k_rows"),
            (value_states, self.cache.v, hkv * dv, "v_rows"),
        ):
            rows_buf, rows_t = self.ws.get(role, (n_s * n_t, width))
            rows_t.view(n_s, n_t, hkv, -1).copy_(src.transpose(1, 2))
            dev.set_rows(buf_of[il], self.rows, rows_buf)
        K, V = self.views[il]
        if self.streams is None:
            k = K[:n_kv].view(1, n_kv, hkv, dk).transpose(1, 2).expand(n_s, hkv, n_kv, dk)
            v = V[:n_kv].view(1, n_kv, hkv, dv).transpose(1, 2).expand(n_s, hkv, n_kv, dv)
        else:
            size = self.cache.size
            k = K.view(-1, size, hkv, dk)[self.streams, :n_kv].transpose(1, 2)
            v = V.view(-1, size, hkv, dv)[self.streams, :n_kv].transpose(1, 2)
        dtype = key_states.dtype
        return k.to(dtype), v.to(dtype)


def attention_forward(attn: Any, h: Any, kv: KVRows, position_embeddings: Any) -> Any:
    """Run the model's attention module on ``h`` [n_s, n_t, hidden] with statecache's K/V."""
    kwargs = {} if position_embeddings is None else {"position_embeddings": position_embeddings}
    out = attn(hidden_states=h, attention_mask=kv.mask, past_key_values=kv, **kwargs)
    return out[0] if isinstance(out, tuple) else out
