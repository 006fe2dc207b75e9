"""The graph side of the recurrent memory (docs/memory-semantics.md#graph-side): one committed ubatch, one layer.

For every state tensor of a recurrent layer the step

1. zeroes the zero row ``rs_z`` (plane 0) before anything reads it;
2. materialises the slot's extra cells (moved by the reorder, or with a
   pending rollback): their source row (any plane) is copied into their own
   plane-0 row;
3. runs the primitive with ``start_rows`` = each set's source row (any plane),
   ``dst_rows = head + i``, ``n_snap = 1 + n_rs_seq`` and ``plane_stride =
   size``, so the final state lands in plane 0 and the snapshots (including
   the input state when ``n_t < n_snap``) in the planes above.

Every read happens before any write.  When the plan says a row is both read
and written by different parties (``inputs.staged``: a reorder swapped cells,
two new sequences share the zero row, a copy-on-write reader of a cell that
its remaining owner updates in place), all reads are first copied aside into
transient buffers, the primitive runs on a transient pool of ``n_seqs``
cells, and the results are copied back.  Only public Device primitives are
used, so this is the same code on every backend.

Undo support (see :class:`~statecache.recurrent.RecurrentContext`): a step
built for the memory's most recently applied ubatch reports, before its
first write to each pool, that it is writing; with ``keep_undo_rows`` it
first copies every row it will overwrite in that pool (``overwrites``: the
zero row when it zeroes it in place, the extra rows, and the planes the
primitive writes) into a scratch buffer, so that the context can put them
back if the compute fails.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache import primitives as P
from statecache.backend import Buffer, Device
from statecache.errors import ArgumentError

if TYPE_CHECKING:
    from statecache.recurrent import RecurrentInputs, RecurrentMemory


class RecurrentStep:
    """Runs the device side of one committed ubatch, layer by layer."""

    def __init__(self, memory: RecurrentMemory, inputs: RecurrentInputs, *, keep_undo_rows: bool | None = None) -> None:
        self.memory = memory
        self.inputs = inputs
        self.device = dev = memory.device
        inp = inputs
        rec = memory._last_apply
        # only the step of the ubatch applied last, with the memory unchanged since, can be undone
        self._record = (
            rec if rec is not None and rec.inputs is inputs and rec.version_after == memory._version else None
        )
        self.keep_undo_rows = bool(rec.keep_rows if keep_undo_rows is None and rec is not None else keep_undo_rows)
        self._zero = dev.indices([inp.rs_z]) if inp.rs_z >= 0 and not inp.staged else None
        self._needs_zero = bool((inp.start_rows == inp.rs_z).any()) if inp.rs_z >= 0 else False
        # the destination rows depend only on (head, n_seqs), and a steady decode starts every
        # set from its own row: reuse uploaded index buffers instead of uploading per step
        self._dst = memory._row_indices(inp.head, inp.n_seqs)
        in_place = inp.start_rows.size == inp.n_seqs and inp.start_rows[0] == inp.head
        if in_place and np.array_equal(inp.start_rows, inp.dst_rows):
            self._start = self._dst
        else:
            self._start = dev.indices(inp.start_rows)
        self._ex_src = dev.indices(inp.extra_src) if inp.extra_src.size else None
        self._ex_dst = dev.indices(inp.extra_dst) if inp.extra_dst.size else None
        if inp.staged:
            n = inp.n_seqs
            local = np.arange(n, dtype=np.int64)
            self._local = dev.indices(local)
            j = np.arange(inp.n_written, dtype=np.int64)
            self._local_written = dev.indices((local[:, None] + n * j[None, :]).ravel())
            self._pool_written = dev.indices(inp.written_rows())
            self._fresh_local = local[inp.start_rows == inp.rs_z] if self._needs_zero else local[:0]
            self._fresh_local_idx = dev.indices(self._fresh_local) if self._fresh_local.size else None
            self._read_rows = dev.indices(inp.start_rows)
        self.done: set[tuple[int, str]] = set()
        # token-shift parts stepped so far, and where each tensor's first part ran (see shift)
        self._shift_done: set[tuple[int, str, int]] = set()
        self._shift_targets: dict[tuple[int, str], tuple[Buffer, Buffer, Buffer, int]] = {}

    def _pool(self, layer: int, name: str) -> Buffer:
        try:
            return self.memory.pools[layer][name]
        except KeyError:
            raise ArgumentError("layer", f"layer {layer} has no recurrent state tensor {name!r}") from None

    def _mark(self, layer: int, name: str) -> None:
        key = (layer, name)
        if key in self.done:
            raise ArgumentError("layer", f"state tensor {name!r} of layer {layer} already stepped for this ubatch")
        self.done.add(key)

    @property
    def overwrites(self) -> np.ndarray:
        """Every pool row (any plane) this step writes, sorted, without repeats."""
        inp = self.inputs
        parts = [inp.written_rows(), inp.extra_dst]
        if not inp.staged and self._zero is not None and self._needs_zero:
            parts.append(np.asarray([inp.rs_z], dtype=np.int64))
        return np.unique(np.concatenate(parts))

    def _before_write(self, layer: int, name: str, pool: Buffer) -> None:
        rec = self._record
        if rec is None or (layer, name) in rec.written:
            return  # untracked, or an earlier step already saw this pool's old rows
        if rec.overwrites is None:
            rec.overwrites = self.overwrites
        saved = None
        if self.keep_undo_rows:
            dev = self.device
            saved = dev.alloc((rec.overwrites.size, pool.shape[1]), pool.dtype)
            dev.get_rows(pool, dev.indices(rec.overwrites), saved)
        rec.written[(layer, name)] = (pool, saved)

    def _run(self, layer: int, name: str, launch) -> None:  # type: ignore[no-untyped-def]
        """Zero, materialise extras and launch the primitive for one pool."""
        self._mark(layer, name)
        dev, inp = self.device, self.inputs
        pool = self._pool(layer, name)
        self._before_write(layer, name, pool)
        if not inp.staged:
            if self._zero is not None and self._needs_zero:
                dev.zero_rows(pool, self._zero)
            if self._ex_src is not None and self._ex_dst is not None:
                dev.copy_rows(pool, self._ex_src, pool, self._ex_dst)
            launch(pool, self._start, self._dst, inp.size)
            return
        # staged: read everything first
        n = inp.n_seqs
        tmp = dev.alloc((n * inp.n_snap, pool.shape[1]), pool.dtype)
        dev.copy_rows(pool, self._read_rows, tmp, self._local)
        if self._fresh_local_idx is not None:
            dev.zero_rows(tmp, self._fresh_local_idx)
        if self._ex_src is not None and self._ex_dst is not None:
            ex = dev.alloc((inp.extra_src.size, pool.shape[1]), pool.dtype)
            dev.get_rows(pool, self._ex_src, ex)
            dev.set_rows(pool, self._ex_dst, ex)
        launch(tmp, self._local, self._local, n)
        dev.copy_rows(tmp, self._local_written, pool, self._pool_written)

    # -- per state tensor -----------------------------------------------------
    def conv(
        self,
        layer: int,
        x: Buffer,
        weight: Buffer,
        y: Buffer,
        *,
        bias: Buffer | None = None,
        apply_silu: bool = False,
        tensor: str = "r",
    ) -> None:
        """``ssm_conv`` on the layer's conv-window pool (``x`` [n_seqs, n_seq_tokens, ch])."""
        snap = self.inputs.n_snap

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            self.device.ssm_conv(
                pool, start, dst, x, weight, y, bias=bias, apply_silu=apply_silu, n_snap=snap, plane_stride=stride
            )

        self._run(layer, tensor, launch)

    def scan(
        self, layer: int, x: Buffer, dt: Buffer, A: Buffer, B: Buffer, C: Buffer, y: Buffer, *, tensor: str = "s"
    ) -> None:
        """``ssm_scan`` (Mamba-1/2) on the layer's state pool."""
        snap = self.inputs.n_snap

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            self.device.ssm_scan(pool, start, dst, x, dt, A, B, C, y, n_snap=snap, plane_stride=stride)

        self._run(layer, tensor, launch)

    def delta(
        self,
        layer: int,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        beta: Buffer,
        o: Buffer,
        *,
        scale: float | None = None,
        tensor: str = "s",
    ) -> None:
        """``gated_delta_net`` (GDN / KDA) on the layer's state pool."""
        snap = self.inputs.n_snap

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            self.device.gated_delta_net(
                pool, start, dst, q, k, v, g, beta, o, n_snap=snap, plane_stride=stride, scale=scale
            )

        self._run(layer, tensor, launch)

    def copy_only(self, layer: int, tensor: str) -> None:
        """Materialise extras for a state tensor that this ubatch does not advance
        with a primitive (the runtime writes it itself)."""

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            return None

        self._run(layer, tensor, launch)

    # -- linear attention and the token shift (RWKV-6, RWKV-7, GLA) ------------
    def wkv6(
        self,
        layer: int,
        r: Buffer,
        k: Buffer,
        v: Buffer,
        w: Buffer,
        u: Buffer,
        o: Buffer,
        *,
        scale: float | None = None,
        tensor: str = "s",
    ) -> None:
        """``rwkv_wkv6`` on the layer's wkv state pool (r/k/v/w/o [n_seqs, n_seq_tokens, H, S])."""
        self._linear_attn_step("rwkv_wkv6", layer, tensor, {"r": r, "k": k, "v": v, "w": w, "o": o}, scale, u)

    def wkv7(
        self,
        layer: int,
        r: Buffer,
        w: Buffer,
        k: Buffer,
        v: Buffer,
        a: Buffer,
        b: Buffer,
        o: Buffer,
        *,
        scale: float | None = None,
        tensor: str = "s",
    ) -> None:
        """``rwkv_wkv7`` on the layer's wkv state pool (every per-token tensor [n_seqs, n_seq_tokens, H, S])."""
        per_token = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b, "o": o}
        self._linear_attn_step("rwkv_wkv7", layer, tensor, per_token, scale)

    def gla(
        self,
        layer: int,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        g: Buffer,
        o: Buffer,
        *,
        scale: float | None = None,
        tensor: str = "s",
    ) -> None:
        """``gated_linear_attn`` on the layer's state pool (q/k/v/g/o [n_seqs, n_seq_tokens, H, S])."""
        self._linear_attn_step("gated_linear_attn", layer, tensor, {"q": q, "k": k, "v": v, "g": g, "o": o}, scale)

    def _linear_attn_step(
        self,
        op: str,
        layer: int,
        tensor: str,
        per_token: dict[str, Buffer],
        scale: float | None,
        u: Buffer | None = None,
    ) -> None:
        """Primitive ``op`` (``Device.<op>``) on the layer's pool: ``per_token`` holds its
        inputs by name and the output ``o``; ``u`` is RWKV-6's bonus."""
        self._linear_attn_shapes(layer, tensor, per_token, u)
        snap = self.inputs.n_snap
        call = getattr(self.device, op)
        args = (*(per_token[name] for name in P.LINEAR_ATTN_INPUTS[op]), *(() if u is None else (u,)), per_token["o"])

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            call(pool, start, dst, *args, n_snap=snap, plane_stride=stride, scale=scale)

        self._run(layer, tensor, launch)

    def _linear_attn_shapes(
        self, layer: int, tensor: str, per_token: dict[str, Buffer], u: Buffer | None = None
    ) -> None:
        """Refuse, before anything is written, per-token buffers that are not
        [n_seqs, n_seq_tokens, H, S] of this ubatch and of the layer's state rows
        (the primitive checks the rest, dtypes and storages, when it launches)."""
        inp = self.inputs
        pool = self._pool(layer, tensor)
        want: tuple[int, ...] | None = None
        for name, buf in per_token.items():
            if not isinstance(buf, Buffer):
                raise ArgumentError(name, f"expected a Buffer, got {type(buf).__name__}")
            shape = tuple(buf.shape)
            if want is None:
                if len(shape) != 4 or shape[:2] != (inp.n_seqs, inp.n_seq_tokens):
                    raise ArgumentError(
                        name, f"shape {shape} must be [n_seqs={inp.n_seqs}, n_seq_tokens={inp.n_seq_tokens}, H, S]"
                    )
                if shape[2] * shape[3] * shape[3] != pool.shape[1]:
                    raise ArgumentError(
                        name, f"shape {shape}: H * S * S must be this layer's state row of {pool.shape[1]}"
                    )
                want = shape
            elif shape != want:
                raise ArgumentError(name, f"shape {shape} must be {want}, as {next(iter(per_token))}'s")
        if u is not None and want is not None and (not isinstance(u, Buffer) or tuple(u.shape) != want[2:]):
            raise ArgumentError("u", f"must be a Buffer of shape [H, S] = {want[2:]}")

    def shift(self, layer: int, x: Buffer, x_prev: Buffer, *, part: int = 0, tensor: str = "r") -> None:
        """RWKV's token shift: ``x_prev`` [n_seqs, n_seq_tokens, n_embd] receives each
        token's previous hidden vector (the first token's from the state), and the
        state keeps the last token's, with snapshot planes like every state tensor.

        The layer's token-shift row holds ``token_shift_count`` vectors of n_embd
        (llama.cpp's layout: the time mixing's input first, then the channel
        mixing's); ``part`` says which one ``x`` is.  The parts of one ubatch come
        at different times (the channel mixing's input exists only after the time
        mixing), so each is its own call; the first to come zeroes and
        materialises the tensor's rows for all of them.

        No new primitive: a token shift is a depthwise causal conv of width 2
        with taps ``[1, 0]``.  Its window is the last token, its snapshot column j
        the token j before the end (the input state for column n_t) and its
        output the previous token, so ``ssm_conv`` gives all of it, on a view of
        the pool whose rows are the parts (row ``c * count + part`` is part
        ``part`` of cell row ``c``).  The output equals the previous token's x
        exactly for finite inputs (an infinite x turns ``0 * x`` into NaN in the
        token before it)."""
        dev, inp = self.device, self.inputs
        pool = self._pool(layer, tensor)
        for name, buf in (("x", x), ("x_prev", x_prev)):
            if not isinstance(buf, Buffer) or buf.ndim != 3 or buf.shape[:2] != (inp.n_seqs, inp.n_seq_tokens):
                raise ArgumentError(
                    name,
                    f"must be a Buffer [n_seqs={inp.n_seqs}, n_seq_tokens={inp.n_seq_tokens}, n_embd] (this ubatch)",
                )
        if x_prev.shape != x.shape:
            raise ArgumentError("x_prev", f"shape {x_prev.shape} must be x's {x.shape}")
        n_embd = x.shape[-1]
        if n_embd < 1 or pool.shape[1] % n_embd:
            raise ArgumentError(
                "x", f"shape {x.shape}: its hidden size does not divide the token-shift row of {pool.shape[1]}"
            )
        count = pool.shape[1] // n_embd
        if not isinstance(part, int | np.integer) or not 0 <= part < count:
            raise ArgumentError("part", f"must be an integer in [0, {count}) (token_shift_count), got {part!r}")
        done, targets = self._shift_done, self._shift_targets
        if (layer, tensor, int(part)) in done:
            raise ArgumentError("part", f"token-shift part {part} of layer {layer} already stepped for this ubatch")
        weight = _shift_taps(dev, n_embd)
        snap = self.inputs.n_snap

        def launch(target: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            rows = target.view((target.shape[0] * count, n_embd))
            s_rows, d_rows = _part_rows(dev, start, count, int(part)), _part_rows(dev, dst, count, int(part))
            dev.ssm_conv(rows, s_rows, d_rows, x, weight, x_prev, n_snap=snap, plane_stride=stride * count)

        key = (layer, tensor)
        if key not in targets:
            # the first part: zero row, extras and (staged) the transient copy, as for any tensor

            def first(target: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
                launch(target, start, dst, stride)
                targets[key] = (target, start, dst, stride)

            self._run(layer, tensor, first)
        else:
            target, start, dst, stride = targets[key]
            launch(target, start, dst, stride)
            if target is not pool:  # staged: the transient pool's written rows go back after every part
                dev.copy_rows(target, self._local_written, pool, self._pool_written)
        done.add((layer, tensor, int(part)))


#: Per device and hidden size: the taps [1, 0] of the token shift's conv.
_SHIFT_TAPS: weakref.WeakKeyDictionary[Device, dict[int, Buffer]] = weakref.WeakKeyDictionary()
#: Per index buffer: its rows as part rows (``row * count + part``), with the host
#: values they were derived from (a buffer written since gets new ones).
_PART_ROWS: weakref.WeakKeyDictionary[Buffer, dict[tuple[int, int], tuple[Any, Buffer]]] = weakref.WeakKeyDictionary()


def _shift_taps(dev: Device, n_embd: int) -> Buffer:
    per_dev = _SHIFT_TAPS.setdefault(dev, {})
    taps = per_dev.get(n_embd)
    if taps is None:
        host = np.zeros((n_embd, 2), dtype=np.float32)
        host[:, 0] = 1.0  # y[t] = window[t] (the previous token), the current token weighs 0
        taps = per_dev[n_embd] = dev.upload(host)
    return taps


def _part_rows(dev: Device, rows: Buffer, count: int, part: int) -> Buffer:
    """``rows * count + part`` as an index buffer, kept while ``rows`` keeps its
    values: decode passes the same row buffers step after step, and new index
    buffers would defeat the launch memo."""
    if count == 1:
        return rows
    values = rows.host_indices
    cache = _PART_ROWS.setdefault(rows, {})
    hit = cache.get((count, part))
    if hit is not None and values is not None and hit[0] is values:
        return hit[1]
    host = dev.index_values(rows).astype(np.int64) * count + part
    derived = dev.indices(host)
    if values is not None:
        cache[(count, part)] = (values, derived)
    return derived
