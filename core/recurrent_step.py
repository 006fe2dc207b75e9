"""The graph side of the recurrent memory (docs/memory-semantics.md#graph-side): one committed ubatch, one layer.

For every state tensor of a recurrent layer the step

1. zeroes the zero row ``rs_z`` (plane 0) before anything reads it;
2. runs the primitive with ``start_rows`` = each set's source row (any plane)
   and ``dst_rows`` = its snapshot table (``RecurrentInputs.dst_table``): the
   final state lands in the plane after the one the set starts from, the
   snapshots in the planes before that, and the input state stays where it
   is (a decode writes one row; one-column tables are passed as 1-D rows);
3. materialises the slot's extra cells that the reorder moved: their live
   and still-valid snapshot planes are copied to the same planes of their
   new cell.

Every argument is checked before anything is written: the shapes against
the ubatch and the layer's state rows (so an error names the argument that
is wrong, not one it was compared with), then the primitive's own contract
(``statecache.primitives``).  The device checks its capabilities when it
launches, and the writes are ordered so that a refused launch has written
nothing a sequence reads.  A refused call changes nothing and may be made
again, corrected; only a call that ran counts as done.

Every read happens before any write.  When the plan says a row is both read
and written by different parties (``inputs.staged``: a reorder swapped cells,
two new sequences share the zero row, a copy-on-write reader of a cell that
its remaining owner updates in place), all reads are first copied aside into
transient buffers, the primitive runs on a transient pool of ``n_seqs``
cells, and the results are copied back.  Only public Device primitives are
used, so this is the same code on every backend.

Token layout.  An equal ubatch's per-token tensors are ``[n_seqs,
n_seq_tokens, ...]``; a varlen ubatch's (``init_batch(..., varlen=True)``)
are packed, ``[n_tokens, ...]``, set ``i`` owning tokens ``cu_seqlens[i] ..
cu_seqlens[i + 1] - 1``.  The step checks every shape against the ubatch's
form and passes its offsets (:attr:`RecurrentStep.cu_seqlens`, uploaded
once per distinct set of offsets and reused) to every primitive it calls, so
one call per layer advances every sequence of the batch.

Every Buffer argument of the per-layer calls (``conv``, ``scan``, ``delta``,
``wkv6``, ``wkv7``, ``gla``, ``shift``) may be a torch
tensor (any DLPack object): it is turned into a Buffer first, before anything
is checked or written (see :mod:`statecache.tensor_args`).

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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache import primitives as P
from statecache.backend import Buffer, Device
from statecache.errors import ArgumentError, CapabilityError
from statecache.slot_rows import SlotRows

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
        # Also when staged: new sequences then read zeros from the transient copy, but
        # the one whose own cell holds the zero row keeps it as the snapshot of its
        # input state (plane n_t back), so the pool's row must hold zeros too.
        self._zero = dev.indices([inp.rs_z]) if inp.rs_z >= 0 else None
        self._needs_zero = bool((inp.start_rows == inp.rs_z).any()) if inp.rs_z >= 0 else False
        # A decode with rotating planes cycles through n_snap row sets: the memory hands
        # back the same uploaded index buffers for the same rows (so the launch memo
        # recognises the call) instead of uploading per step.  A one-column table is
        # passed as 1-D rows (the same bytes; without planes, an in-place decode's start
        # and destination are then one buffer, the cheapest call to check).
        table = inp.dst_table
        self._dst = memory._index_buffer(table[:, 0] if table.shape[1] == 1 else table)
        if table.shape[1] == 1 and np.array_equal(inp.start_rows, table[:, 0]):
            self._start = self._dst
        else:
            self._start = memory._index_buffer(inp.start_rows)
        copy_src, copy_dst = inp.copy_src, inp.copy_dst  # extras, and planes of moved cells
        # the varlen offsets: one device buffer for every layer of this step, and the same
        # buffer again for a later step with the same offsets (cached by contents)
        self._cu = memory._index_buffer(inp.cu_seqlens) if inp.cu_seqlens is not None else None
        self._lead: tuple[int, ...] = (inp.n_tokens,) if self._cu is not None else (inp.n_seqs, inp.n_seq_tokens)
        self._ex_src = dev.indices(copy_src) if copy_src.size else None
        self._ex_dst = dev.indices(copy_dst) if copy_dst.size else None
        if inp.staged:
            # a transient pool of n_w planes of n cells: set i reads local row i and
            # writes column j to local row i + j * n, copied back to the table's row
            n, n_w = inp.n_seqs, table.shape[1]
            local = np.arange(n, dtype=np.int64)
            self._local = dev.indices(local)
            local_table = np.where(table >= 0, local[:, None] + n * np.arange(n_w)[None, :], -1)
            self._local_dst = dev.indices(local_table[:, 0] if n_w == 1 else local_table)
            self._local_written = dev.indices(local_table[table >= 0])
            self._pool_written = dev.indices(inp.written_rows())
            self._fresh_local = local[inp.start_rows == inp.rs_z] if self._needs_zero else local[:0]
            self._fresh_local_idx = dev.indices(self._fresh_local) if self._fresh_local.size else None
            self._read_rows = dev.indices(inp.start_rows)
        self.done: set[tuple[int, str]] = set()
        # token-shift parts stepped so far, and where each tensor's first part ran (see shift)
        self._shift_done: set[tuple[int, str, int]] = set()
        self._shift_targets: dict[tuple[int, str], tuple[Buffer, Buffer, Buffer]] = {}

    @property
    def cu_seqlens(self) -> Buffer | None:
        """The device offsets (int32 ``[n_seqs + 1]``) the step passes to every primitive of
        a varlen ubatch (None for an equal ubatch); host values: ``inputs.cu_seqlens``."""
        return self._cu

    def _pool(self, layer: int, name: str) -> Buffer:
        try:
            return self.memory.pools[layer][name]
        except KeyError:
            raise ArgumentError("layer", f"layer {layer} has no recurrent state tensor {name!r}") from None

    def _not_done(self, layer: int, name: str) -> None:
        if (layer, name) in self.done:
            raise ArgumentError("layer", f"state tensor {name!r} of layer {layer} already stepped for this ubatch")

    def _layer_params(self, layer: int) -> Mapping[str, int]:
        spec = self.memory.spec.layers[layer] if 0 <= layer < self.memory.spec.n_layer else None
        return {} if spec is None else spec.params

    @property
    def overwrites(self) -> np.ndarray:
        """Every pool row (any plane) this step writes, sorted, without repeats."""
        inp = self.inputs
        parts = [inp.written_rows(), inp.copy_dst]
        if self._zero is not None and self._needs_zero:
            parts.append(np.asarray([inp.rs_z], dtype=np.int64))
        return np.unique(np.concatenate(parts))

    def _before_write(self, layer: int, name: str, pool: Buffer) -> bool:
        """Record (for undo) that this pool is about to be written; True when this call did."""
        rec = self._record
        if rec is None or (layer, name) in rec.written:
            return False  # untracked, or an earlier step already saw this pool's old rows
        if rec.overwrites is None:
            rec.overwrites = self.overwrites
        saved = None
        if self.keep_undo_rows:
            dev = self.device
            saved = dev.alloc((rec.overwrites.size, pool.shape[1]), pool.dtype)
            dev.get_rows(pool, dev.indices(rec.overwrites), saved)
        rec.written[(layer, name)] = (pool, saved)
        return True

    def _validate(self, validate: _Launch | None, key: tuple[Any, ...], bufs: tuple[Any, ...], target: Buffer,
                  start: Buffer, dst: Buffer) -> None:  # fmt: skip
        """Run ``validate`` unless this very call (same buffers, same index contents,
        same capabilities) was validated before: decode repeats one call per layer
        step after step, and a full check costs more than a small kernel."""
        if validate is None:
            return
        dev = self.device
        full = (target, start, dst, *bufs)
        key = (*key, *(id(b) for b in full))
        memo = self.memory._step_checks
        try:
            if memo.lookup(key, dev.caps, full, (start, dst)) is not None:
                return
        except TypeError:  # an unhashable scalar (a list as dt_limit): validate every call
            validate(target, start, dst)
            return
        validate(target, start, dst)
        memo.store(key, dev.caps, full, (start, dst), None, None)

    def _run(
        self,
        layer: int,
        name: str,
        launch: _Launch,
        validate: _Launch | None = None,
        op_key: tuple[Any, ...] = (),
        bufs: tuple[Any, ...] = (),
    ) -> None:
        """Validate, then zero, launch the primitive and materialise extras for one pool.

        ``validate`` gets the arguments ``launch`` will get and raises, before any
        write, when the arguments would be refused (``key``/``bufs``: the scalars
        and buffers of the call, to skip a check made before).  The device checks
        its capabilities when it launches; the writes are ordered so that a launch
        it refuses has written nothing a sequence reads (at most the zero row,
        which no cell names yet): the extras are copied after the primitive (in
        the unstaged path no extra row is read or written by it).  A refused call
        therefore does not count as stepped and may be made again, corrected."""
        self._not_done(layer, name)
        dev, inp = self.device, self.inputs
        pool = self._pool(layer, name)
        key = (layer, name)
        if not inp.staged:
            self._validate(validate, (name, *op_key), bufs, pool, self._start, self._dst)
            registered = self._before_write(layer, name, pool)
            self.done.add(key)
            if self._zero is not None and self._needs_zero:
                dev.zero_rows(pool, self._zero)
            self._launch_refusable(key, registered, lambda: launch(pool, self._start, self._dst))
            if self._ex_src is not None and self._ex_dst is not None:
                dev.copy_rows(pool, self._ex_src, pool, self._ex_dst)
            return
        # staged: read everything first (into transient buffers), write the pool last
        n = inp.n_seqs
        tmp = dev.alloc((n * inp.dst_table.shape[1], pool.shape[1]), pool.dtype)
        self._validate(validate, (name, *op_key), bufs, tmp, self._local, self._local_dst)
        registered = self._before_write(layer, name, pool)
        self.done.add(key)
        self._read_aside(pool, tmp)
        ex = None
        if self._ex_src is not None:
            ex = dev.alloc((self._ex_src.shape[0], pool.shape[1]), pool.dtype)
            dev.get_rows(pool, self._ex_src, ex)
        self._zero_pool_row(pool)  # after every read of the pool, before its writes
        self._launch_refusable(key, registered, lambda: launch(tmp, self._local, self._local_dst))
        if ex is not None and self._ex_dst is not None:
            dev.set_rows(pool, self._ex_dst, ex)
        dev.copy_rows(tmp, self._local_written, pool, self._pool_written)

    def _zero_pool_row(self, pool: Buffer) -> None:
        """Staged ubatch: zero the pool's zero row (see ``_zero`` in ``__init__``)."""
        if self._zero is not None and self._needs_zero:
            self.device.zero_rows(pool, self._zero)

    def _read_aside(self, pool: Buffer, local: Buffer) -> None:
        """Staged ubatch: copy each set's input state into row i of ``local`` (the
        zero state for a new sequence) before anything writes the pool."""
        self.device.copy_rows(pool, self._read_rows, local, self._local)
        if self._fresh_local_idx is not None:
            self.device.zero_rows(local, self._fresh_local_idx)

    def _launch_refusable(self, key: tuple[int, str], registered: bool, launch: Callable[[], None]) -> None:
        """Launch; a call the device refuses before running (arguments, capabilities) is
        not stepped and leaves no undo record, so it may be made again."""
        try:
            launch()
        except (ArgumentError, CapabilityError):
            self.done.discard(key)
            if registered and self._record is not None:
                self._record.written.pop(key, None)
            raise

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
        given = (x, weight, y, bias)  # held until return (Device._tensors_in says why)
        x, weight, y, bias = self.device._tensors_in("x weight y* bias", *given)
        self._primitive(
            "ssm_conv", layer, tensor, {"x": x, "weight": weight, "y": y}, {"bias": bias},
            {"apply_silu": bool(apply_silu)}, lambda row: self._conv_shapes(layer, row, x, weight, y, bias),
        )  # fmt: skip

    def scan(
        self,
        layer: int,
        x: Buffer,
        dt: Buffer,
        A: Buffer,
        B: Buffer,
        C: Buffer,
        y: Buffer,
        *,
        D: Buffer | None = None,
        z: Buffer | None = None,
        dt_bias: Buffer | None = None,
        dt_limit: tuple[float, float] | None = None,
        tensor: str = "s",
    ) -> None:
        """``ssm_scan`` (Mamba-1/2) on the layer's state pool, with the fused epilogues of
        :meth:`Device.ssm_scan <statecache.backend.Device.ssm_scan>` (mamba_ssm's semantics):
        ``dt_bias`` [n_head] added before softplus, ``dt_limit=(lo, hi)`` clamping its result,
        the skip ``y += D * x`` (``D`` [n_head] or [n_head, head_dim]) and the gate
        ``y *= silu(z)`` (``z`` shaped like ``x``), applied last."""
        given = (x, dt, A, B, C, y, D, z, dt_bias)  # held until return (Device._tensors_in says why)
        x, dt, A, B, C, y, D, z, dt_bias = self.device._tensors_in("x dt A B C y* D z dt_bias", *given)
        self._primitive(
            "ssm_scan", layer, tensor, {"x": x, "dt": dt, "A": A, "B": B, "C": C, "y": y},
            {"D": D, "z": z, "dt_bias": dt_bias}, {},
            lambda row: self._scan_shapes(layer, row, x, dt, A, B, C, y, D=D, z=z, dt_bias=dt_bias),
            {"dt_limit": dt_limit}, lambda shp: P.scan_epilogues(shp, D, z, dt_bias),
        )  # fmt: skip

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
        head_map: str = "tiled",
        qk_l2norm: bool = False,
        A_log: Buffer | None = None,
        dt_bias: Buffer | None = None,
        beta_sigmoid: bool = False,
        tensor: str = "s",
    ) -> None:
        """``gated_delta_net`` (GDN / KDA) on the layer's state pool, with the options of
        :meth:`Device.gated_delta_net <statecache.backend.Device.gated_delta_net>`:
        ``head_map`` (``"tiled"``: value head h reads q/k head ``h % H_k``; ``"grouped"``:
        ``h // (H_v / H_k)``, as transformers and fla), ``qk_l2norm`` (q and k normalised in
        the kernel), ``A_log`` [H_v] with optional ``dt_bias`` (``g`` is then the raw
        projection ``a``: log-decay ``-exp(A_log) * softplus(a + dt_bias)``) and
        ``beta_sigmoid`` (``beta`` is the raw ``b``: ``sigmoid(b)`` is used)."""
        given = (q, k, v, g, beta, o, A_log, dt_bias)  # held until return (Device._tensors_in says why)
        q, k, v, g, beta, o, A_log, dt_bias = self.device._tensors_in("q k v g beta o* A_log dt_bias", *given)
        self._primitive(
            "gated_delta_net", layer, tensor, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "o": o},
            {"A_log": A_log, "dt_bias": dt_bias}, {},
            lambda row: self._delta_shapes(layer, row, q, k, v, g, beta, o, A_log=A_log, dt_bias=dt_bias),
            {"scale": scale, "head_map": head_map, "qk_l2norm": qk_l2norm, "beta_sigmoid": beta_sigmoid},
            lambda shp: P.delta_epilogues(shp, A_log),
        )  # fmt: skip

    def _primitive(
        self,
        op: str,
        layer: int,
        tensor: str,
        args: dict[str, Buffer],
        optional: dict[str, Buffer | None],
        scalars: dict[str, Any],
        shapes: Callable[[int], None],
        options: dict[str, Any] | None = None,
        fused: Callable[[Any], frozenset[str]] | None = None,
    ) -> None:
        """Run primitive ``op`` (``Device.<op>``, validated by ``primitives.check_<op>``) on the
        layer's pool.  ``args``: its buffers in call order; ``optional``: keyword buffers;
        ``scalars``: keyword scalars the validator does not take; ``options``: keyword scalars
        it takes too; ``shapes(row_size)``: the checks against the ubatch and the layer;
        ``fused(shape)``: the epilogue names the validated call uses, asked of the device
        before anything is written (the same refusal the primitive would raise)."""
        dev = self.device
        check = getattr(P, f"check_{op}")  # the validator the device runs too
        call = getattr(dev, op)
        opts = options or {}
        optional = {**optional, "cu_seqlens": self._cu}  # None for an equal ubatch

        # dst is a snapshot table (or its one column as 1-D rows): n_snap and plane_stride stay default
        def validate(pool: Buffer, start: Buffer, dst: Buffer) -> None:
            shapes(pool.shape[1])
            checked = check(
                dev, pool=pool, start_rows=start, dst_rows=dst, **args, **optional, **opts, n_snap=1, plane_stride=0
            )
            names = fused(checked.shape) if fused is not None else None
            if names:
                answer = dev.supports(op, epilogues=names)
                if not answer:
                    raise CapabilityError(answer.reason)

        def launch(pool: Buffer, start: Buffer, dst: Buffer) -> None:
            call(pool, start, dst, *args.values(), **optional, **scalars, **opts)

        key = (op, *scalars.values(), *opts.values())
        self._run(layer, tensor, launch, validate, key, (*args.values(), *optional.values()))

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
        given = (r, k, v, w, u, o)  # held until return (Device._tensors_in says why)
        r, k, v, w, u, o = self.device._tensors_in("r k v w u o*", *given)
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
        given = (r, w, k, v, a, b, o)  # held until return (Device._tensors_in says why)
        r, w, k, v, a, b, o = self.device._tensors_in("r w k v a b o*", *given)
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
        given = (q, k, v, g, o)  # held until return (Device._tensors_in says why)
        q, k, v, g, o = self.device._tensors_in("q k v g o*", *given)
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
        args = {name: per_token[name] for name in P.LINEAR_ATTN_INPUTS[op]}
        if u is not None:
            args["u"] = u
        args["o"] = per_token["o"]
        self._primitive(
            op, layer, tensor, args, {}, {"scale": scale},
            lambda row: self._linear_attn_shapes(layer, row, per_token, u),
        )  # fmt: skip

    def _linear_attn_shapes(self, layer: int, row: int, per_token: dict[str, Buffer], u: Buffer | None) -> None:
        """Per-token buffers must be [n_seqs, n_seq_tokens, H, S] (varlen: [n_tokens, H, S]) of this ubatch and of the
        layer's state rows (H * S * S; the layer's heads when its spec names them)."""
        par = self._layer_params(layer)
        names = iter(per_token.items())
        first, buf = next(names)
        h, size = self._tokens_dims(first, buf, 2, "H, S")
        want = self._per_token(h, size)
        layer_size = par.get("head_dim", par.get("head_size"))
        if ("n_head" in par and (par["n_head"], layer_size) != (h, size)) or h * size * size != row:
            raise ArgumentError(
                first, f"shape {want}: [H, S] = {(h, size)} does not fit this layer's state rows of {row}"
            )
        for name, buf in names:
            shape = _shape_of(buf, name)
            if shape != want:
                raise ArgumentError(name, f"shape {shape} must be {want}, as {first}'s")
        if u is not None and _shape_of(u, "u") != (h, size):
            raise ArgumentError("u", f"shape {_shape_of(u, 'u')} must be [H, S] = {(h, size)}")

    def shift(self, layer: int, x: Buffer, x_prev: Buffer, *, part: int = 0, tensor: str = "r") -> None:
        """RWKV's token shift: ``x_prev`` [n_seqs, n_seq_tokens, n_embd] (varlen: [n_tokens,
        n_embd]) receives each
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
        given = (x, x_prev)  # held until return (Device._tensors_in says why)
        x, x_prev = self.device._tensors_in("x x_prev*", *given)
        dev = self.device
        pool = self._pool(layer, tensor)
        for name, buf in (("x", x), ("x_prev", x_prev)):
            self._tokens_dims(name, buf, 1, "n_embd")
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

        # dst: the snapshot table (or its one column), its rows mapped to the part's view rows
        def launch(target: Buffer, start: Buffer, dst: Buffer) -> None:
            rows = target.view((target.shape[0] * count, n_embd))
            s_rows, d_rows = _part_rows(dev, start, count, int(part)), _part_rows(dev, dst, count, int(part))
            dev.ssm_conv(rows, s_rows, d_rows, x, weight, x_prev, cu_seqlens=self._cu)

        key = (layer, tensor)
        if key not in targets:
            # the first part: zero row, extras and (staged) the transient copy, as for any tensor

            def first(target: Buffer, start: Buffer, dst: Buffer) -> None:
                launch(target, start, dst)
                targets[key] = (target, start, dst)

            self._run(layer, tensor, first)
        else:
            target, start, dst = targets[key]
            launch(target, start, dst)
            if target is not pool:  # staged: the transient pool's written rows go back after every part
                dev.copy_rows(target, self._local_written, pool, self._pool_written)
        done.add((layer, tensor, int(part)))

    def copy_only(self, layer: int, tensor: str) -> None:
        """Materialise extras for a state tensor that this ubatch does not advance
        with a primitive (the runtime writes it itself: each set's state from
        ``inputs.start_rows`` into the rows of ``inputs.dst_table``)."""

        def launch(pool: Buffer, start: Buffer, dst: Buffer) -> None:
            return None

        self._run(layer, tensor, launch)

    def slot_rows(self, layer: int, tensor: str) -> SlotRows:
        """Hand state tensor ``tensor`` of ``layer`` to an outside kernel for this ubatch.

        Does every row copy the step would do around a primitive (zero the row
        new sequences start from, move the rows a cell reorder moved, and,
        when some read row is also written, copy the reads aside into
        ``source``), records the pool for undo, marks it stepped, and returns
        the rows the kernel must read and write (the rule:
        :mod:`statecache.slot_rows`).  The kernel then writes before anything
        else touches the pool.  A second call for the same pool raises
        :class:`ArgumentError` (it would redo the copies)."""
        self._not_done(layer, tensor)
        dev, inp, mem = self.device, self.inputs, self.memory
        pool = self._pool(layer, tensor)
        self._before_write(layer, tensor, pool)
        self.done.add((layer, tensor))
        table = inp.dst_table
        write = np.ascontiguousarray(table[:, 0])
        snaps = np.ascontiguousarray(table[:, 1:])
        write_buf = self._dst if table.shape[1] == 1 else mem._index_buffer(write)
        snaps_buf = mem._index_buffer(snaps) if snaps.shape[1] else None
        if not inp.staged:
            # no extra row is read or written by the kernel here, so copying first is the same as after
            if self._zero is not None and self._needs_zero:
                dev.zero_rows(pool, self._zero)
            if self._ex_src is not None and self._ex_dst is not None:
                dev.copy_rows(pool, self._ex_src, pool, self._ex_dst)
            source, read, read_buf = pool, inp.start_rows, self._start
        else:
            # every read first (the states, the moved rows), then the moved rows' writes;
            # the kernel's writes come last, as the staged primitive's copy-back does
            source = dev.alloc((inp.n_seqs, pool.shape[1]), pool.dtype)
            self._read_aside(pool, source)
            if self._ex_src is not None and self._ex_dst is not None:
                moved = dev.alloc((self._ex_src.shape[0], pool.shape[1]), pool.dtype)
                dev.get_rows(pool, self._ex_src, moved)
                self._zero_pool_row(pool)
                dev.set_rows(pool, self._ex_dst, moved)
            else:
                self._zero_pool_row(pool)
            read, read_buf = np.arange(inp.n_seqs, dtype=np.int64), self._local
        return SlotRows(
            pool=pool, source=source,
            read=read.astype(np.int64), write=write.astype(np.int64), snapshots=snaps.astype(np.int64),
            read_buffer=read_buf, write_buffer=write_buf, snapshots_buffer=snaps_buf,
            plane_stride=mem.size, staged=bool(inp.staged),
            cu_seqlens=None if inp.cu_seqlens is None else inp.cu_seqlens.astype(np.int64),
            cu_seqlens_buffer=self._cu,
        )  # fmt: skip

    # -- shapes against the ubatch and the layer (names the argument that is wrong) ----
    def _tokens_dims(self, name: str, buf: object, n_tail: int, tail: str) -> tuple[int, ...]:
        """The shape of a per-token input, checked against the ubatch: the token axes
        (``[n_seqs, n_seq_tokens]``, or ``[n_tokens]`` for a varlen ubatch) and then
        ``n_tail`` axes named ``tail``.  Returns the tail."""
        lead = self._lead
        shape = _shape_of(buf, name)
        if len(shape) != len(lead) + n_tail or shape[: len(lead)] != lead:
            if len(lead) == 1:
                want = f"[n_tokens, {tail}] with n_tokens={lead[0]} (this varlen ubatch)"
            else:
                want = f"[n_seqs, n_seq_tokens, {tail}] with n_seqs={lead[0]}, n_seq_tokens={lead[1]} (this ubatch)"
            raise ArgumentError(name, f"shape {shape} must be {want}")
        return shape[len(lead) :]

    def _per_token(self, *tail: int) -> tuple[int, ...]:
        """The full shape of a per-token tensor of this ubatch with trailing axes ``tail``."""
        return (*self._lead, *tail)

    def _conv_shapes(self, layer: int, row: int, x: object, weight: object, y: object, bias: object | None) -> None:
        par = self._layer_params(layer)
        w = _shape_of(weight, "weight")
        if "channels" in par and "d_conv" in par:
            if w != (par["channels"], par["d_conv"]):
                raise ArgumentError("weight", f"shape {w} must be [channels={par['channels']}, d_conv={par['d_conv']}]")
        elif len(w) != 2 or w[1] < 2 or w[0] * (w[1] - 1) != row:
            raise ArgumentError(
                "weight",
                f"shape {w} must be [channels, d_conv] with channels * (d_conv - 1) = {row}, "
                f"the conv window this layer's state rows hold",
            )
        ch = w[0]
        (x_ch,) = self._tokens_dims("x", x, 1, "channels")
        xs = self._per_token(x_ch)
        if x_ch != ch:
            raise ArgumentError("x", f"shape {xs} has {x_ch} channels, the layer's conv has {ch}")
        ys = _shape_of(y, "y")
        if ys != xs:
            raise ArgumentError("y", f"shape {ys} must be {xs} (one output per input of x)")
        if bias is not None and _shape_of(bias, "bias") != (ch,):
            raise ArgumentError("bias", f"shape {_shape_of(bias, 'bias')} must be [channels={ch}]")

    def _scan_shapes(
        self, layer: int, row: int, x: object, dt: object, A: object, B: object, C: object, y: object, *,
        D: object | None = None, z: object | None = None, dt_bias: object | None = None,
    ) -> None:  # fmt: skip
        par = self._layer_params(layer)
        x_tail = self._tokens_dims("x", x, 2, "n_head, head_dim")
        xs = self._per_token(*x_tail)
        dts, As = _shape_of(dt, "dt"), _shape_of(A, "A")
        if "n_head" in par and "head_dim" in par:
            h, hd = par["n_head"], par["head_dim"]
        elif len(dts) == len(xs) - 1 and len(As) >= 1 and dts[-1] == As[0] != x_tail[0]:
            h, hd = As[0], x_tail[1]  # dt and A agree on the head count: x is the odd one out
        else:
            h, hd = x_tail
        if x_tail != (h, hd) or row % (h * hd):
            raise ArgumentError(
                "x", f"shape {xs}: [n_head, head_dim] = {x_tail} does not fit this layer's state rows of {row}"
            )
        n = par.get("d_state", row // (h * hd))
        lead = self._lead
        if dts != self._per_token(h):
            raise ArgumentError("dt", f"shape {dts} must be {list(self._per_token(h))} (tokens of this ubatch, n_head)")
        if As not in ((h,), (h, n)):
            raise ArgumentError("A", f"shape {As} must be [n_head={h}] (Mamba-2) or [n_head={h}, d_state={n}]")
        Bs, Cs = _shape_of(B, "B"), _shape_of(C, "C")
        k = len(lead)
        for name, sh in (("B", Bs), ("C", Cs)):
            if len(sh) != k + 2 or sh[:k] != lead or sh[-1] != n or sh[k] < 1 or h % sh[k]:
                raise ArgumentError(
                    name, f"shape {sh} must be [{', '.join(map(str, lead))}, n_group (dividing {h}), d_state={n}]"
                )
        if Cs != Bs:
            raise ArgumentError("C", f"shape {Cs} must equal B's {Bs}")
        ys = _shape_of(y, "y")
        if ys != xs:
            raise ArgumentError("y", f"shape {ys} must be {xs} (one output per input of x)")
        if D is not None and _shape_of(D, "D") not in ((h,), (h, hd)):
            raise ArgumentError("D", f"shape {_shape_of(D, 'D')} must be [n_head={h}] or [n_head={h}, head_dim={hd}]")
        if z is not None and _shape_of(z, "z") != xs:
            raise ArgumentError("z", f"shape {_shape_of(z, 'z')} must be {xs} (one gate per input of x)")
        if dt_bias is not None and _shape_of(dt_bias, "dt_bias") != (h,):
            raise ArgumentError("dt_bias", f"shape {_shape_of(dt_bias, 'dt_bias')} must be [n_head={h}]")

    def _delta_shapes(
        self, layer: int, row: int, q: object, k: object, v: object, g: object, beta: object, o: object, *,
        A_log: object | None = None, dt_bias: object | None = None,
    ) -> None:  # fmt: skip
        par = self._layer_params(layer)
        h_v, size = self._tokens_dims("v", v, 2, "H_v, S")
        vs = self._per_token(h_v, size)
        if ("n_head" in par and (par["n_head"], par["head_dim"]) != (h_v, size)) or h_v * size * size != row:
            raise ArgumentError(
                "v", f"shape {vs}: [H_v, S] = {(h_v, size)} does not fit this layer's state rows of {row}"
            )
        h_k, q_size = self._tokens_dims("q", q, 2, "H_k, S")
        qs = self._per_token(h_k, q_size)
        # q/k carry the layer's key heads, or H_v heads when the runtime repeated them
        # itself (the head map is then the identity, which is what it computed)
        allowed = {par["n_head_k"], h_v} if "n_head_k" in par else {h_k}
        if q_size != size or h_k < 1 or h_v % h_k or h_k not in allowed:
            want = " or ".join(str(a) for a in sorted(allowed)) if "n_head_k" in par else f"H_k dividing H_v={h_v}"
            lead = ", ".join(map(str, self._lead))
            raise ArgumentError("q", f"shape {qs} must be [{lead}, {want}, S={size}]")
        ks = _shape_of(k, "k")
        if ks != qs:
            raise ArgumentError("k", f"shape {ks} must equal q's {qs}")
        gs = _shape_of(g, "g")
        g_forms = (self._per_token(h_v), self._per_token(h_v, size))
        if gs not in g_forms:
            raise ArgumentError("g", f"shape {gs} must be {list(g_forms[0])} or {list(g_forms[1])}")
        bs = _shape_of(beta, "beta")
        if bs != self._per_token(h_v):
            raise ArgumentError("beta", f"shape {bs} must be {list(self._per_token(h_v))}")
        os_ = _shape_of(o, "o")
        if os_ != vs:
            raise ArgumentError("o", f"shape {os_} must be {vs} (one output per value of v)")
        # the raw gate: per value head (per key dimension of it for KDA's [.., H_v, S] gate)
        if A_log is not None and _shape_of(A_log, "A_log") != (h_v,):
            raise ArgumentError("A_log", f"shape {_shape_of(A_log, 'A_log')} must be [H_v={h_v}]")
        want_bias = (h_v,) if gs == g_forms[0] else (h_v, size)
        if dt_bias is not None and _shape_of(dt_bias, "dt_bias") != want_bias:
            raise ArgumentError("dt_bias", f"shape {_shape_of(dt_bias, 'dt_bias')} must be {list(want_bias)}")


_Launch = Callable[[Buffer, Buffer, Buffer], None]


def _shape_of(buf: Any, name: str) -> tuple[int, ...]:
    if not isinstance(buf, Buffer):
        raise ArgumentError(name, f"expected a Buffer, got {type(buf).__name__}")
    return tuple(buf.shape)


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
    """``rows * count + part`` as an index buffer (a snapshot table's -1 stays -1),
    kept while ``rows`` keeps its values: decode passes the same row buffers step
    after step, and new index buffers would defeat the launch memo."""
    if count == 1:
        return rows
    values = rows.host_indices
    cache = _PART_ROWS.setdefault(rows, {})
    hit = cache.get((count, part))
    if hit is not None and values is not None and hit[0] is values:
        return hit[1]
    v = dev.index_values(rows).astype(np.int64)
    host = np.where(v >= 0, v * count + part, -1)
    derived = dev.indices(host)
    if values is not None:
        cache[(count, part)] = (values, derived)
    return derived
