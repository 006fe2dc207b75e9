"""Slot rows: the rows of one state pool an outside kernel reads and writes for one ubatch.

A runtime that runs its own kernels (a vLLM- or SGLang-style engine) asks the
step of the applied ubatch for them with
:meth:`RecurrentStep.slot_rows <statecache.recurrent_step.RecurrentStep.slot_rows>`;
see docs/embedding.md, "Slot rows: running your own kernels".

The rule, per sequence set ``i`` of the ubatch:

- read the state from row ``read[i]`` of ``source`` (the pool itself, or a
  transient copy of the read rows when some read row is also written this
  step);
- write the final state to row ``write[i]`` of ``pool``, and the state ``j``
  tokens before the end to row ``snapshots[i, j - 1]`` of ``pool``; ``-1``
  means "write nothing there".  In a varlen ubatch set ``i`` advances by
  its own ``cu_seqlens[i + 1] - cu_seqlens[i]`` tokens (:attr:`SlotRows.cu_seqlens`),
  and its snapshot columns past that count are ``-1``.  A decode that starts from one of its own
  planes writes the next plane, so ``read[i] != write[i]`` in general.

``slot_rows`` has already done everything else the step does for that pool
(zeroed the state new sequences start from, moved the rows a cell reorder
moved, staged the reads), so the rows above are all the kernel touches;
rollback (``seq_rm`` inside the last write), copy-on-write after ``seq_cp``
and ``undo`` then stay exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from statecache.backend import Buffer


@dataclasses.dataclass(frozen=True, eq=False)
class SlotRows:
    """One state pool's rows for one applied ubatch (see the module docstring for the rule).

    Host arrays are int64 copies (the caller may keep or change them); the ``*_buffer`` fields hold the same
    values as device index buffers (``snapshots_buffer`` is ``None`` when the
    ubatch writes no snapshot, ``k == 0``)."""

    #: the layer's state pool, ``[cells * planes, row_size]``; the kernel writes its rows
    pool: Buffer
    #: where the read rows are: ``pool``, or a transient ``[n_seqs, row_size]`` copy (``staged``)
    source: Buffer
    #: ``[n_seqs]``: the row of ``source`` each sequence set reads its state from
    read: np.ndarray
    #: ``[n_seqs]``: the row of ``pool`` that receives each set's final state
    write: np.ndarray
    #: ``[n_seqs, k]``, ``k <= n_rs_seq``: column ``j - 1`` receives the state ``j`` tokens before the end (-1: nothing)
    snapshots: np.ndarray
    read_buffer: Buffer
    write_buffer: Buffer
    snapshots_buffer: Buffer | None
    #: pool row ``plane * plane_stride + cell`` is plane ``plane`` of cell ``cell``
    plane_stride: int
    #: True when ``source`` is a transient copy (some read row is also written this step)
    staged: bool
    #: varlen ubatch: int64 ``[n_seqs + 1]``, set ``i`` owns packed tokens ``cu_seqlens[i] ..
    #: cu_seqlens[i + 1] - 1`` (None for an equal ubatch: ``n_seq_tokens`` each)
    cu_seqlens: np.ndarray | None = None
    #: the same offsets as the device int32 buffer the step passes to its primitives
    cu_seqlens_buffer: Buffer | None = None

    @property
    def n_seqs(self) -> int:
        """Sequence sets in the ubatch (one row of each array per set)."""
        return int(self.read.shape[0])
