"""A transformers causal LM whose every state lives in statecache.

:class:`StatecacheCausalLM` wraps a loaded model without changing it: the
model's modules and parameters do the dense math, a statecache memory holds
every recurrent state (conv windows, SSM and delta-rule states) and, for
hybrids, the attention K/V rows.  :meth:`StatecacheCausalLM.forward` takes a
statecache :class:`~statecache.batch.Batch` (any mix of sequences, prompts
and decode tokens) and returns the logits of its output tokens; sequence
operations (fork, rollback, removal) go straight to :attr:`memory`
(``seq_cp``, ``seq_rm``).  :class:`~.engine.Engine` builds request
scheduling on top.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import statecache
from statecache.backend import Device
from statecache.batch import Batch
from statecache.dtypes import DType
from statecache.errors import MemoryPlanError
from statecache.factory import make_model_memory
from statecache.memory import MemoryStatus
from statecache.recurrent import RecurrentMemory
from statecache.spec import AttentionLayerSpec, MemorySpec, ModelSpec

from .attention import KVRows, attention_forward
from .bridge import Bridge, Workspace, check_transformers
from .delta_net import gdn_forward, gdn_layout
from .errors import UnsupportedModelError
from .families import LayerRun, family_of
from .mamba import mamba1_forward, mamba1_layout, mamba2_forward, mamba2_layout

#: per recurrent kind: the convention mapping (run once per attach) and the forward (per ubatch)
_LAYOUTS: dict[str, Callable[..., Any]] = {"mamba1": mamba1_layout, "mamba2": mamba2_layout, "gdn": gdn_layout}
_FORWARDS: dict[str, Callable[..., Any]] = {"mamba1": mamba1_forward, "mamba2": mamba2_forward, "gdn": gdn_forward}
_ATTN_IMPLS = ("eager", "sdpa")


def _dtype_name(torch: Any, dtype: Any) -> str:
    names = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise UnsupportedModelError(f"model dtype {dtype} is not one of float32, float16, bfloat16")
    return names[dtype]


class StatecacheCausalLM:
    """Run a transformers recurrent or hybrid causal LM with statecache holding its states.

    ``model``: a loaded ``*ForCausalLM`` of a supported family
    (:func:`~.families.supported_model_types`).  ``device``: a statecache
    device or its name (default: the cpu device); torch must see its memory
    and the model must live where that memory is (cpu for cpu/reference).
    ``n_seq_max``: sequences the memory holds at once.  ``n_rs_seq``:
    rollback planes (how many tokens of the last multi-token write
    ``seq_rm`` can take back exactly; families without snapshot planes,
    Mamba-1 today, get 0, see :attr:`rollback_depth`).  ``n_ctx``: positions
    per sequence of the attention KV cache (hybrids only).  ``state_dtype``:
    storage of the recurrent states; ``kv_dtype``: of K/V (default: the
    model's dtype, so attention reads them without a conversion).
    ``unified_kv``: one KV stream for every sequence instead of one each.
    ``n_ubatch``: most tokens per ubatch.  ``keep_undo_rows``: every step first copies the
    state rows it overwrites, so that a forward that fails half way is undone exactly; without
    it the undo is consistent but drops the sequences whose rows were overwritten (their ids are
    in :attr:`last_dropped` and in a note on the exception).

    The parameters the primitives read (conv weights, A) are copied to the
    device once; call :meth:`refresh` after changing the model's weights.
    """

    def __init__(
        self,
        model: Any,
        *,
        device: Device | str | None = "cpu",
        n_seq_max: int = 8,
        n_rs_seq: int = 0,
        n_ctx: int = 1024,
        state_dtype: DType | str = DType.F32,
        kv_dtype: DType | str | None = None,
        unified_kv: bool = False,
        n_ubatch: int = 512,
        kv_pad: int = 32,
        keep_undo_rows: bool = False,
    ) -> None:
        self.model = model
        self.transformers_version = check_transformers()
        self.family = family_of(model)
        self.device = device if isinstance(device, Device) else statecache.get_device(device)
        self.bridge = Bridge(self.device)
        self.torch = torch = self.bridge.torch
        self.ws = Workspace(self.bridge)
        param = next(model.parameters())
        if param.device != self.bridge.torch_device:
            raise UnsupportedModelError(
                f"the model lives on {param.device} but device {self.device.id} shares memory with "
                f"{self.bridge.torch_device}; move the model there first"
            )
        self.dtype = param.dtype
        self.parts = self.family.parts()
        self.n_layer = len(self.parts)
        # memory layer of every stateful part: the decoder layer's index when no layer has two
        # parts, else one memory layer per part (statecache routes a layer to exactly one part)
        self.slots: dict[tuple[int, str], int] = {}
        two = any(len(p) > 1 for p in self.parts)
        for i, p in enumerate(self.parts):
            for kind in p:
                self.slots[(i, kind)] = len(self.slots) if two else i
        self.n_mem_layers = len(self.slots) if two else self.n_layer
        self.n_seq_max = int(n_seq_max)
        self.n_ubatch = int(n_ubatch)
        self.n_vocab = int(model.config.vocab_size)
        self.n_ctx = int(n_ctx)
        self.keep_undo_rows = bool(keep_undo_rows)
        #: sequences the undo of the last failed forward had to drop (empty: it was exact)
        self.last_dropped: tuple[int, ...] = ()
        attn = {self.slots[(i, "attention")]: p["attention"] for i, p in enumerate(self.parts) if "attention" in p}
        self._attn_slots = {i: self.slots[(i, "attention")] for i, p in enumerate(self.parts) if "attention" in p}
        if attn:
            impl = getattr(model.config, "_attn_implementation", "eager") or "eager"
            if impl not in _ATTN_IMPLS:
                raise UnsupportedModelError(
                    f"attention implementation {impl!r}: the integration passes an additive mask and "
                    f"statecache's K/V, which {', '.join(_ATTN_IMPLS)} accept"
                )
        self.refresh()
        recurrent = {i: lay.spec for i, lay in self.layouts.items()}
        if attn:
            spec = ModelSpec.build(
                self.n_mem_layers,
                recurrent=recurrent,
                attention={i: self._attention_spec(i, m) for i, m in attn.items()},
                dtype=state_dtype,
                kv_dtype=kv_dtype if kv_dtype is not None else _dtype_name(torch, self.dtype),
            )
            self.memory: Any = make_model_memory(
                spec,
                self.device,
                self.n_seq_max,
                n_rs_seq,
                n_ctx=int(n_ctx),
                unified=bool(unified_kv),
                n_ubatch=self.n_ubatch,
                n_pad=int(kv_pad),
            )
            self.recurrent: RecurrentMemory | None = getattr(self.memory, "recr", None)
            caches: list[Any] = list(getattr(self.memory, "kv_caches", [self.memory]))
            self._kv_views = {
                il: (self.bridge.tensor(c.k[il]), self.bridge.tensor(c.v[il])) for c in caches for il in c.k
            }
        else:
            self.memory = RecurrentMemory(
                MemorySpec.build(self.n_mem_layers, recurrent, dtype=state_dtype),
                self.device,
                n_seq_max=self.n_seq_max,
                n_rs_seq=n_rs_seq,
            )
            self.recurrent = self.memory
            self._kv_views = {}
        self.has_attention = bool(attn)

    # -- mapping -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Map every recurrent mixer again (re-read parameters after the weights changed)."""
        layouts: dict[int, Any] = {}
        for i, parts in enumerate(self.parts):
            for kind, mixer in parts.items():
                if kind in _LAYOUTS:
                    slot = self.slots[(i, kind)]
                    layouts[slot] = _LAYOUTS[kind](mixer, slot, self.bridge)
        self.layouts = layouts

    def _attention_spec(self, il: int, attn: Any) -> AttentionLayerSpec:
        cfg = self.model.config
        head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return AttentionLayerSpec(int(cfg.num_key_value_heads), int(head_dim))

    @property
    def rollback_depth(self) -> int:
        """Tokens of the last multi-token write each sequence can roll back exactly (n_rs_seq in effect)."""
        return 0 if self.recurrent is None else int(self.recurrent.n_rs_seq)

    # -- running ---------------------------------------------------------------------------------
    def _run_updates(self) -> None:
        # pending KV work (cross-stream copies queued by seq_cp) must land before the next batch reads
        upd = self.memory.init_update()
        if upd.status is MemoryStatus.SUCCESS:
            upd.apply()

    def forward(self, batch: Batch, *, output_all: bool = False) -> Any:
        """Logits ``[n_outputs, n_vocab]`` (float32 torch tensor) of ``batch``'s output tokens,
        in batch order.  The batch is validated against the memory first (positions continue
        each sequence; a bad batch raises and changes nothing); a compute that fails after the
        memory planned it is undone before the error propagates."""
        torch = self.torch
        balloc = self.memory.batch_allocator()
        balloc.init(batch, self.memory, n_vocab=self.n_vocab, output_all=output_all)
        self._run_updates()
        ctx = self.memory.init_batch(balloc, self.n_ubatch)
        if ctx.status.is_fail:
            raise MemoryPlanError(f"the memory could not place the batch {getattr(ctx, 'reason', '')}".rstrip())
        if self.keep_undo_rows:
            ctx.keep_undo_rows = True
        outs = []
        applied = False
        try:
            with torch.inference_mode():
                while True:
                    if not ctx.apply():
                        raise MemoryPlanError("the memory could not apply a ubatch it had planned")
                    applied = True
                    outs.append(self._ubatch(ctx, ctx.get_ubatch()))
                    if not ctx.next():
                        break
        except BaseException as exc:
            if applied:
                # the model documents the lossy undo (keep_undo_rows=False): ask for it
                self.last_dropped = tuple(ctx.undo(drop=True))
                if self.last_dropped:
                    exc.add_note(f"statecache undid the batch and dropped sequences {list(self.last_dropped)}")
            raise
        logits = torch.cat(outs) if len(outs) > 1 else outs[0]
        order = np.asarray(balloc.out_ids, dtype=np.int64)
        if order.size and not np.all(order[1:] > order[:-1]):
            perm = torch.from_numpy(np.argsort(order, kind="stable")).to(logits.device)
            logits = logits.index_select(0, perm)
        return logits

    def _ubatch(self, ctx: Any, ub: Any) -> Any:
        torch = self.torch
        fam = self.family
        n_s, n_t = int(ub.n_seqs), int(ub.n_seq_tokens)
        dev = self.bridge.torch_device
        ids = torch.from_numpy(ub.token.astype(np.int64)).view(n_s, n_t).to(dev)
        step = None
        if self.layouts:
            step = ctx.recr.step() if self.has_attention else ctx.step()
        kv = None
        h = fam.embed(ids)
        pe = None
        if self.has_attention:
            kv = KVRows(ctx.attn, ub, self.bridge, self.ws, self._kv_views, self._attn_slots, h.dtype)
            pos = torch.from_numpy(ub.pos.astype(np.int64)).view(n_s, n_t).to(dev)
            pe = fam.rotary(h, pos)
        parts, slots, layouts, ws = self.parts, self.slots, self.layouts, self.ws

        def mix(i: int, x: Any, kind: str | None) -> Any:
            p = parts[i]
            if kind is None:
                (kind,) = p
            mixer = p[kind]
            if kind == "attention":
                return attention_forward(mixer, x, kv, pe)  # type: ignore[arg-type]
            return _FORWARDS[kind](mixer, layouts[slots[(i, kind)]], x, step, ws)

        run = LayerRun(mix, kv, pe, h)
        for i in range(self.n_layer):
            h = fam.layer(i, h, run)
        out = torch.from_numpy(np.flatnonzero(ub.output)).to(dev)
        return fam.head(h.reshape(n_s * n_t, -1).index_select(0, out)).float()
