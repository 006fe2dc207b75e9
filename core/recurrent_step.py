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

from typing import TYPE_CHECKING

import numpy as np

from statecache.backend import Buffer
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
        x, weight, y, bias = self.device._tensors_in("x weight y* bias", x, weight, y, bias)
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
        x, dt, A, B, C, y = self.device._tensors_in("x dt A B C y*", x, dt, A, B, C, y)
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
        q, k, v, g, beta, o = self.device._tensors_in("q k v g beta o*", q, k, v, g, beta, o)
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
