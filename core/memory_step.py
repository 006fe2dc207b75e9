"""One step API for every memory kind: the per-layer calls of one applied ubatch.

``ctx.step()`` on the context of any memory -- recurrent, KV, KV-iSWA,
hybrid, hybrid-iSWA, hybrid-idx -- returns an object with the same methods,
so a runtime writes one decode loop (docs/embedding.md, "A hybrid step")::

    while True:
        assert ctx.apply()
        step = ctx.step()
        for layer in model_layers:
            if layer in step.recurrent_layers:      # conv, scan, delta, wkv6, wkv7, gla, shift, slot_rows
                step.conv(layer, ...); step.scan(layer, ...)
            elif layer in step.attention_layers:
                step.write_kv(layer, k, v)           # this ubatch's K/V rows, set_rows into the cache
                rows, mask = step.kv_rows(layer), step.mask(layer)   # what to read, a device Buffer
            if layer in step.index_layers:           # hybrid-idx
                step.write_index_keys(layer, keys); step.kpool_inputs()
        if not ctx.next():
            break

A runtime passes its own layer index; the step finds the part that holds it
(the recurrent memory, an iSWA pair's base or window cache, the indexer
cache).  A call for a layer the memory does not hold in that form raises
:class:`~statecache.errors.ArgumentError` naming ``layer``; every argument
is checked before anything is written, so a refused call changes nothing
and may be made again, corrected.

Why the calls stay per layer: layer ``l + 1``'s input is layer ``l``'s
output, so the compute of one token cannot be batched across layers; the
layers' states are separate device buffers, so each call works on one of
them.  What is shared across layers is shared once per ubatch: the K/V write
rows and the mask of a cache are one reused device buffer each, written once
per ubatch and handed to every layer of that cache (:mod:`statecache.step_buffers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.backend import Buffer
from statecache.errors import ArgumentError
from statecache.memory import ContextError

if TYPE_CHECKING:
    from statecache.kpool import KPoolInputs
    from statecache.kv_cache import KVCacheContext
    from statecache.kv_cells import KVCells
    from statecache.recurrent_step import RecurrentStep
    from statecache.slot_rows import SlotRows


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionRows:
    """What an attention (or indexer) layer reads and writes for the applied ubatch.

    Token ``i`` reads the ``n_kv`` rows ``read_start[i] .. read_start[i] + n_kv``
    of ``k`` / ``v`` (its stream's first cells), masked by row ``i`` of the
    layer's mask; it wrote its own K/V to row ``write[i]``.  Global row
    ``stream * size + cell`` is cell ``cell`` of stream ``stream``.
    ``write_buffer`` is ``write`` as the device index buffer (reused across
    steps: valid until the next ubatch is applied).
    """

    k: Buffer
    v: Buffer | None
    n_kv: int
    size: int
    streams: np.ndarray  # int64 [n_tokens]: the stream each token reads
    read_start: np.ndarray  # int64 [n_tokens]: streams * size
    write: np.ndarray  # int64 [n_tokens]
    write_buffer: Buffer
    _cells: Sequence[KVCells] = dataclasses.field(repr=False)

    def positions(self) -> np.ndarray:
        """int64 ``[n_stream, n_kv]``: the position each read cell holds (-1: empty)."""
        return np.stack([np.asarray(c.pos[: self.n_kv], dtype=np.int64) for c in self._cells])


class LayerStep:
    """The calls every memory kind's step answers (see the module docstring).

    This base answers "not in this memory" for every call; the recurrent step
    (:class:`~statecache.recurrent_step.RecurrentStep`) and :class:`MemoryStep`
    implement the parts their memory has.
    """

    #: model layers with recurrent state / attention K/V / an indexer cache in this memory
    recurrent_layers: tuple[int, ...] = ()
    attention_layers: tuple[int, ...] = ()
    index_layers: tuple[int, ...] = ()

    def _absent(self, layer: int, what: str) -> ArgumentError:
        return ArgumentError("layer", f"layer {layer}: this memory ({type(self).__name__}) has no {what}")

    def prepare(
        self, *, causal: bool = True, alibi: bool = False, n_sel: int | None = None, with_pos: bool = False
    ) -> None:
        """Write this ubatch's reused device inputs now (nothing to write here)."""
        return None

    # -- attention ------------------------------------------------------------
    def write_kv(self, layer: int, k: Any, v: Any = None) -> None:
        """Write this ubatch's K (and V) rows of attention layer ``layer``: ``[n_tokens, n_embd]``."""
        raise self._absent(layer, "attention K/V")

    def kv_rows(self, layer: int) -> AttentionRows:
        """The K/V buffers, rows and positions attention layer ``layer`` reads this ubatch."""
        raise self._absent(layer, "attention K/V")

    def mask(self, layer: int, *, causal: bool = True, alibi: bool = False) -> Buffer:
        """Attention layer ``layer``'s ``[n_tokens, n_kv]`` float32 mask as a device Buffer."""
        raise self._absent(layer, "attention K/V")

    # -- indexer (hybrid-idx) ---------------------------------------------------
    def write_index_keys(self, layer: int, keys: Any) -> None:
        """Write this ubatch's indexer key rows of ``layer`` (``[n_tokens, row width]``)."""
        raise self._absent(layer, "indexer cache")

    def index_rows(self, layer: int) -> AttentionRows:
        """The indexer cache's rows of ``layer`` (``v`` is None: a key-only cache)."""
        raise self._absent(layer, "indexer cache")

    def kpool_inputs(self, *, n_sel: int | None = None, with_pos: bool = False) -> KPoolInputs:
        """The k-pool inputs of this ubatch (hybrid-idx; docs/memory-semantics.md#kpool-inputs)."""
        raise ArgumentError("memory", f"this memory ({type(self).__name__}) has no k-pools (hybrid-idx only)")

    def kpool_buffers(self, *, n_sel: int | None = None, with_pos: bool = False) -> dict[str, Buffer]:
        """:meth:`kpool_inputs` as reused device buffers (hybrid-idx)."""
        raise ArgumentError("memory", f"this memory ({type(self).__name__}) has no k-pools (hybrid-idx only)")


def _recurrent_call(name: str) -> Any:
    """A :class:`MemoryStep` method that hands a recurrent call to the recurrent part's step."""

    def call(self: MemoryStep, layer: int, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._recurrent_for(layer), name)(layer, *args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"``RecurrentStep.{name}`` on the recurrent part (``layer`` is a recurrent layer)."
    return call


class MemoryStep(LayerStep):
    """The step of a KV, KV-iSWA, hybrid, hybrid-iSWA or hybrid-idx context.

    ``recurrent``: the recurrent part's step (None for a KV memory);
    ``attention``: the applied KV contexts (one, or an iSWA pair's base and
    window); ``index``: hybrid-idx's indexer context, ``kpool``: the context
    whose ``kpool_inputs`` it answers.
    """

    def __init__(
        self,
        recurrent: RecurrentStep | None,
        attention: Sequence[KVCacheContext],
        index: KVCacheContext | None = None,
        kpool: Any = None,
    ) -> None:
        parts = (*attention, *([index] if index is not None else []))
        for part in parts:
            if part._applied != part.i_next:
                raise ContextError("apply() the current ubatch before asking for its step")
        self._ubatch = parts[0].i_next if parts else -1  # the step belongs to this ubatch only
        self._write_rows: dict[int, Buffer] = {}
        self.recurrent = recurrent
        self.recurrent_layers = recurrent.recurrent_layers if recurrent is not None else ()
        self._attn: dict[int, KVCacheContext] = {il: part for part in attention for il in part.cache.k}
        self.attention_layers = tuple(sorted(self._attn))
        self._index = index
        self.index_layers = tuple(sorted(index.cache.k)) if index is not None else ()
        self._kpool = kpool
        self._masks: dict[tuple[int, bool, bool], Buffer] = {}

    # -- recurrent (the recurrent part's step) --------------------------------------
    def _recurrent_for(self, layer: int) -> RecurrentStep:
        if self.recurrent is None:
            raise self._absent(layer, "recurrent part")
        return self.recurrent

    conv = _recurrent_call("conv")
    scan = _recurrent_call("scan")
    delta = _recurrent_call("delta")
    wkv6 = _recurrent_call("wkv6")
    wkv7 = _recurrent_call("wkv7")
    gla = _recurrent_call("gla")
    shift = _recurrent_call("shift")
    copy_only = _recurrent_call("copy_only")

    def slot_rows(self, layer: int, tensor: str) -> SlotRows:
        """``RecurrentStep.slot_rows`` on the recurrent part."""
        return self._recurrent_for(layer).slot_rows(layer, tensor)

    def prepare(
        self, *, causal: bool = True, alibi: bool = False, n_sel: int | None = None, with_pos: bool = False
    ) -> None:
        """Write this ubatch's reused device inputs now: every cache's K/V write rows and
        mask, and on hybrid-idx the indexer's rows and :meth:`kpool_buffers` (``n_sel``,
        ``with_pos`` as the layers will ask).  The layers' calls with the same arguments
        then copy nothing from the host, which a CUDA graph needs: call it before
        capturing a decode step and before each replay (the graph reads the same
        buffers, rewritten in place)."""
        for part in {id(p): p for p in self._attn.values()}.values():
            self._rows_buffer(self._current(part))
            self.mask(part.cache.layers[0].il, causal=causal, alibi=alibi)
        if self._index is not None:
            self._rows_buffer(self._current(self._index))
            if self._kpool is not None:
                self.kpool_buffers(n_sel=n_sel, with_pos=with_pos)

    # -- attention ----------------------------------------------------------------
    def _part(self, layer: int) -> KVCacheContext:
        part = self._attn.get(layer) if isinstance(layer, int | np.integer) else None
        if part is None:
            raise ArgumentError(
                "layer", f"layer {layer!r} is not an attention layer of this memory {self.attention_layers}"
            )
        return self._current(part)

    def _current(self, part: KVCacheContext) -> KVCacheContext:
        """``part``, unless its context has moved past the ubatch this step was built for
        (the reused rows and mask buffers then hold another ubatch's values)."""
        if part.i_next != self._ubatch or part._applied != self._ubatch:
            raise ContextError(f"this step belongs to ubatch {self._ubatch}; the context has moved on")
        return part

    def _rows_buffer(self, part: KVCacheContext) -> Buffer:
        """The part's reused write rows, filled once per step (every layer and K and V share them)."""
        buf = self._write_rows.get(id(part))
        if buf is None:
            buf = self._write_rows[id(part)] = part.write_rows_buffer()
        return buf

    def _write(self, part: KVCacheContext, layer: int, pairs: list[tuple[str, Any, dict[int, Buffer]]]) -> None:
        """Check every ``(name, rows, buffers)`` against the ubatch first, then ``set_rows`` each."""
        dev = part.cache.device
        n_tokens = part.get_ubatch().n_tokens
        given = tuple(rows for _, rows, _ in pairs)  # held until return (Device._tensors_in says why)
        names = " ".join(name for name, _, _ in pairs)
        srcs = dev._tensors_in(names, *given)
        for (name, _, bufs), src in zip(pairs, srcs, strict=True):
            if layer not in bufs:
                raise ArgumentError(name, f"layer {layer} has no {name} rows in {part.cache.name} (a key-only cache)")
            width = bufs[layer].shape[1]
            if not isinstance(src, Buffer) or src.shape != (n_tokens, width):
                shape = getattr(src, "shape", None)
                raise ArgumentError(name, f"shape {shape} must be [n_tokens={n_tokens}, {width}] (this ubatch)")
        rows = self._rows_buffer(part)
        for (_, _, bufs), src in zip(pairs, srcs, strict=True):
            dev.set_rows(bufs[layer], rows, src)

    def write_kv(self, layer: int, k: Any, v: Any = None) -> None:
        part = self._part(layer)
        pairs = [("k", k, part.cache.k)]
        if v is not None:
            pairs.append(("v", v, part.cache.v))
        elif layer in part.cache.v:
            raise ArgumentError("v", f"layer {layer} stores V rows: pass v with k")
        self._write(part, layer, pairs)

    def _rows(self, part: KVCacheContext, layer: int) -> AttentionRows:
        cache = part.cache
        ub = part.get_ubatch()
        streams = np.zeros(ub.n_tokens, dtype=np.int64) if cache.unified else np.asarray(ub.primary, dtype=np.int64)
        return AttentionRows(
            k=cache.k[layer], v=cache.v.get(layer), n_kv=part.n_kv(), size=cache.size, streams=streams,
            read_start=streams * cache.size, write=part.k_idxs().astype(np.int64),
            write_buffer=self._rows_buffer(part), _cells=cache.cells,
        )  # fmt: skip

    def kv_rows(self, layer: int) -> AttentionRows:
        return self._rows(self._part(layer), layer)

    def mask(self, layer: int, *, causal: bool = True, alibi: bool = False) -> Buffer:
        """The layer's ``[n_tokens, n_kv]`` float32 mask (0 visible, -inf hidden, ALiBi biases)
        as a device Buffer: one per cache and ubatch, shared by its layers, rewritten in place
        in the cache's reused mask storage.  Read-only: a runtime that edits its mask copies it.
        ``torch.from_dlpack(mask)`` views it on devices whose buffers speak DLPack (cpu, cuda);
        ``statecache.hostmem.as_array(mask)`` on host devices."""
        part = self._part(layer)
        key = (id(part), bool(causal), bool(alibi))
        buf = self._masks.get(key)
        if buf is None:
            host = part.mask(causal=causal, alibi=alibi)
            cap = _ubatch_capacity(part) * part.cache.size  # n_kv never exceeds the cache size
            buf = part.cache.step_buffers.floats(f"mask:{int(causal)}{int(alibi)}", host, capacity=cap)
            self._masks[key] = buf
        return buf

    # -- indexer ------------------------------------------------------------------
    def _index_part(self, layer: int) -> KVCacheContext:
        if self._index is None or layer not in self._index.cache.k:
            raise self._absent(layer, "indexer cache")
        return self._current(self._index)

    def write_index_keys(self, layer: int, keys: Any) -> None:
        part = self._index_part(layer)
        self._write(part, layer, [("keys", keys, part.cache.k)])

    def index_rows(self, layer: int) -> AttentionRows:
        return self._rows(self._index_part(layer), layer)

    def kpool_inputs(self, *, n_sel: int | None = None, with_pos: bool = False) -> KPoolInputs:
        if self._kpool is None:
            return super().kpool_inputs(n_sel=n_sel, with_pos=with_pos)
        if self._index is not None:
            self._current(self._index)
        inputs: KPoolInputs = self._kpool.kpool_inputs(n_sel=n_sel, with_pos=with_pos)
        return inputs

    def kpool_buffers(self, *, n_sel: int | None = None, with_pos: bool = False) -> dict[str, Buffer]:
        """:meth:`kpool_inputs` as device buffers, by field name (int32 indices, float32
        masks; fields that are None are left out), in the indexer cache's reused storage:
        rewritten in place each step, grown (to twice the need) only when the k-pools
        outgrow it."""
        inputs = self.kpool_inputs(n_sel=n_sel, with_pos=with_pos)
        assert self._index is not None  # kpool_inputs answered: a hybrid-idx step
        store = self._index.cache.step_buffers
        out = {}
        for field in dataclasses.fields(inputs):
            value = getattr(inputs, field.name)
            if value is None:
                continue
            role, cap = f"kpool:{field.name}", 2 * int(value.size)
            if value.dtype.kind == "f":
                out[field.name] = store.floats(role, value, capacity=cap)
            else:
                out[field.name] = store.indices(role, value, capacity=cap)
        return out


def _ubatch_capacity(part: KVCacheContext) -> int:
    """The most tokens any ubatch of this context has: reused buffers are sized for it once."""
    return max(ub.n_tokens for ub in part.ubatches)
