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

Every Buffer argument of ``conv``, ``scan`` and ``delta`` may be a torch
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

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache import primitives as P
from statecache.backend import Buffer
from statecache.errors import ArgumentError, CapabilityError

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
        copy_src, copy_dst = inp.copy_src, inp.copy_dst  # extras, and planes of moved cells
        self._ex_src = dev.indices(copy_src) if copy_src.size else None
        self._ex_dst = dev.indices(copy_dst) if copy_dst.size else None
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
        if not inp.staged and self._zero is not None and self._needs_zero:
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
                  start: Buffer, dst: Buffer, stride: int) -> None:  # fmt: skip
        """Run ``validate`` unless this very call (same buffers, same index contents,
        same capabilities) was validated before: decode repeats one call per layer
        step after step, and a full check costs more than a small kernel."""
        if validate is None:
            return
        dev = self.device
        full = (target, start, dst, *bufs)
        key = (*key, stride, *(id(b) for b in full))
        memo = self.memory._step_checks
        try:
            if memo.lookup(key, dev.caps, full, (start, dst)) is not None:
                return
        except TypeError:  # an unhashable scalar: validation says what is wrong
            pass
        validate(target, start, dst, stride)
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
            self._validate(validate, (name, *op_key), bufs, pool, self._start, self._dst, inp.size)
            registered = self._before_write(layer, name, pool)
            self.done.add(key)
            if self._zero is not None and self._needs_zero:
                dev.zero_rows(pool, self._zero)
            self._launch_refusable(key, registered, lambda: launch(pool, self._start, self._dst, inp.size))
            if self._ex_src is not None and self._ex_dst is not None:
                dev.copy_rows(pool, self._ex_src, pool, self._ex_dst)
            return
        # staged: read everything first (into transient buffers), write the pool last
        n = inp.n_seqs
        tmp = dev.alloc((n * inp.n_snap, pool.shape[1]), pool.dtype)
        self._validate(validate, (name, *op_key), bufs, tmp, self._local, self._local, n)
        registered = self._before_write(layer, name, pool)
        self.done.add(key)
        dev.copy_rows(pool, self._read_rows, tmp, self._local)
        if self._fresh_local_idx is not None:
            dev.zero_rows(tmp, self._fresh_local_idx)
        ex = None
        if self._ex_src is not None:
            ex = dev.alloc((self._ex_src.shape[0], pool.shape[1]), pool.dtype)
            dev.get_rows(pool, self._ex_src, ex)
        self._launch_refusable(key, registered, lambda: launch(tmp, self._local, self._local, n))
        if ex is not None and self._ex_dst is not None:
            dev.set_rows(pool, self._ex_dst, ex)
        dev.copy_rows(tmp, self._local_written, pool, self._pool_written)

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
        self, layer: int, x: Buffer, dt: Buffer, A: Buffer, B: Buffer, C: Buffer, y: Buffer, *, tensor: str = "s"
    ) -> None:
        """``ssm_scan`` (Mamba-1/2) on the layer's state pool."""
        given = (x, dt, A, B, C, y)  # held until return (Device._tensors_in says why)
        x, dt, A, B, C, y = self.device._tensors_in("x dt A B C y*", *given)
        self._primitive(
            "ssm_scan", layer, tensor, {"x": x, "dt": dt, "A": A, "B": B, "C": C, "y": y}, {}, {},
            lambda row: self._scan_shapes(layer, row, x, dt, A, B, C, y),
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
        tensor: str = "s",
    ) -> None:
        """``gated_delta_net`` (GDN / KDA) on the layer's state pool."""
        given = (q, k, v, g, beta, o)  # held until return (Device._tensors_in says why)
        q, k, v, g, beta, o = self.device._tensors_in("q k v g beta o*", *given)
        self._primitive(
            "gated_delta_net", layer, tensor, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "o": o}, {},
            {"scale": scale}, lambda row: self._delta_shapes(layer, row, q, k, v, g, beta, o),
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
    ) -> None:
        """Run primitive ``op`` (``Device.<op>``, validated by ``primitives.check_<op>``) on the
        layer's pool.  ``args``: its buffers in call order; ``optional``: keyword buffers;
        ``scalars``: keyword scalars the validator does not take; ``shapes(row_size)``:
        the checks against the ubatch and the layer."""
        dev, snap = self.device, self.inputs.n_snap
        check = getattr(P, f"check_{op}")  # the validator the device runs too
        call = getattr(dev, op)

        def validate(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            shapes(pool.shape[1])
            check(dev, pool=pool, start_rows=start, dst_rows=dst, **args, **optional, n_snap=snap, plane_stride=stride)

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            call(pool, start, dst, *args.values(), **optional, **scalars, n_snap=snap, plane_stride=stride)

        key = (op, snap, *scalars.values())
        self._run(layer, tensor, launch, validate, key, (*args.values(), *optional.values()))

    def copy_only(self, layer: int, tensor: str) -> None:
        """Materialise extras for a state tensor that this ubatch does not advance
        with a primitive (the runtime writes it itself)."""

        def launch(pool: Buffer, start: Buffer, dst: Buffer, stride: int) -> None:
            return None

        self._run(layer, tensor, launch)

    # -- shapes against the ubatch and the layer (names the argument that is wrong) ----
    def _tokens_dims(self, name: str, buf: object, ndim: int, layout: str) -> tuple[int, ...]:
        """The shape of a per-token input, checked against the ubatch: ``ndim`` axes,
        the first two ``[n_seqs, n_seq_tokens]``."""
        inp = self.inputs
        want = (inp.n_seqs, inp.n_seq_tokens)
        shape = _shape_of(buf, name)
        if len(shape) != ndim or shape[:2] != want:
            raise ArgumentError(
                name,
                f"shape {shape} must be [{layout}] with n_seqs={want[0]}, n_seq_tokens={want[1]} (this ubatch)",
            )
        return shape

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
        xs = self._tokens_dims("x", x, 3, "n_seqs, n_seq_tokens, channels")
        if xs[2] != ch:
            raise ArgumentError("x", f"shape {xs} has {xs[2]} channels, the layer's conv has {ch}")
        ys = _shape_of(y, "y")
        if ys != xs:
            raise ArgumentError("y", f"shape {ys} must be {xs} (one output per input of x)")
        if bias is not None and _shape_of(bias, "bias") != (ch,):
            raise ArgumentError("bias", f"shape {_shape_of(bias, 'bias')} must be [channels={ch}]")

    def _scan_shapes(
        self, layer: int, row: int, x: object, dt: object, A: object, B: object, C: object, y: object
    ) -> None:
        par = self._layer_params(layer)
        xs = self._tokens_dims("x", x, 4, "n_seqs, n_seq_tokens, n_head, head_dim")
        n_s, n_t = xs[:2]
        dts, As = _shape_of(dt, "dt"), _shape_of(A, "A")
        if "n_head" in par and "head_dim" in par:
            h, hd = par["n_head"], par["head_dim"]
        elif len(dts) == 3 and len(As) >= 1 and dts[2] == As[0] != xs[2]:
            h, hd = As[0], xs[3]  # dt and A agree on the head count: x is the odd one out
        else:
            h, hd = xs[2], xs[3]
        if xs[2:] != (h, hd) or row % (h * hd):
            raise ArgumentError(
                "x", f"shape {xs}: [n_head, head_dim] = {xs[2:]} does not fit this layer's state rows of {row}"
            )
        n = par.get("d_state", row // (h * hd))
        if dts != (n_s, n_t, h):
            raise ArgumentError("dt", f"shape {dts} must be [n_seqs={n_s}, n_seq_tokens={n_t}, n_head={h}]")
        if As not in ((h,), (h, n)):
            raise ArgumentError("A", f"shape {As} must be [n_head={h}] (Mamba-2) or [n_head={h}, d_state={n}]")
        Bs, Cs = _shape_of(B, "B"), _shape_of(C, "C")
        for name, sh in (("B", Bs), ("C", Cs)):
            if len(sh) != 4 or sh[:2] != (n_s, n_t) or sh[3] != n or sh[2] < 1 or h % sh[2]:
                raise ArgumentError(
                    name, f"shape {sh} must be [n_seqs={n_s}, n_seq_tokens={n_t}, n_group (dividing {h}), d_state={n}]"
                )
        if Cs != Bs:
            raise ArgumentError("C", f"shape {Cs} must equal B's {Bs}")
        ys = _shape_of(y, "y")
        if ys != xs:
            raise ArgumentError("y", f"shape {ys} must be {xs} (one output per input of x)")

    def _delta_shapes(
        self, layer: int, row: int, q: object, k: object, v: object, g: object, beta: object, o: object
    ) -> None:
        par = self._layer_params(layer)
        vs = self._tokens_dims("v", v, 4, "n_seqs, n_seq_tokens, H_v, S")
        n_s, n_t, h_v, size = vs
        if ("n_head" in par and (par["n_head"], par["head_dim"]) != (h_v, size)) or h_v * size * size != row:
            raise ArgumentError("v", f"shape {vs}: [H_v, S] = {vs[2:]} does not fit this layer's state rows of {row}")
        qs = self._tokens_dims("q", q, 4, "n_seqs, n_seq_tokens, H_k, S")
        # q/k carry the layer's key heads, or H_v heads when the runtime repeated them
        # itself (the head map is then the identity, which is what it computed)
        h_k = qs[2]
        allowed = {par["n_head_k"], h_v} if "n_head_k" in par else {h_k}
        if qs != (n_s, n_t, h_k, size) or h_k < 1 or h_v % h_k or h_k not in allowed:
            want = " or ".join(str(a) for a in sorted(allowed)) if "n_head_k" in par else f"H_k dividing H_v={h_v}"
            raise ArgumentError("q", f"shape {qs} must be [{n_s}, {n_t}, {want}, S={size}]")
        ks = _shape_of(k, "k")
        if ks != qs:
            raise ArgumentError("k", f"shape {ks} must equal q's {qs}")
        gs = _shape_of(g, "g")
        if gs not in ((n_s, n_t, h_v), (n_s, n_t, h_v, size)):
            raise ArgumentError("g", f"shape {gs} must be [{n_s}, {n_t}, {h_v}] or [{n_s}, {n_t}, {h_v}, {size}]")
        bs = _shape_of(beta, "beta")
        if bs != (n_s, n_t, h_v):
            raise ArgumentError("beta", f"shape {bs} must be [{n_s}, {n_t}, {h_v}]")
        os_ = _shape_of(o, "o")
        if os_ != vs:
            raise ArgumentError("o", f"shape {os_} must be {vs} (one output per value of v)")


_Launch = Callable[[Buffer, Buffer, Buffer, int], None]


def _shape_of(buf: Any, name: str) -> tuple[int, ...]:
    if not isinstance(buf, Buffer):
        raise ArgumentError(name, f"expected a Buffer, got {type(buf).__name__}")
    return tuple(buf.shape)
