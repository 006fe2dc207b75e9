"""Batches, their validation, and the three ubatch splitters (docs/memory-semantics.md#batches).

A :class:`Batch` is what a runtime submits: tokens (or embeddings), optional
positions, sequence ids per token and output flags.  A
:class:`BatchAllocator` validates it against a memory (docs/memory-semantics.md#batch-validation), auto-fills what
was left out, and then cuts it into :class:`UBatch` es with
:meth:`~BatchAllocator.split_simple`, :meth:`~BatchAllocator.split_equal` or
:meth:`~BatchAllocator.split_seq` (docs/memory-semantics.md#splitters).  Every token is emitted exactly
once.  :meth:`~BatchAllocator.split_varlen` puts a whole mixed batch into one
ubatch in the packed (varlen) form the stateful primitives take: every
sequence set's tokens in one run, sets of any length, ``UBatch.cu_seqlens``
their offsets.  :attr:`BatchAllocator.out_ids` records the batch index of every output
token in the order the ubatches emitted them, so a caller can put logits back
in its own order.

A *sequence set* is the set of sequence ids of one token.  Tokens that belong
to more than one sequence *couple* those sequences.  Sets are kept as Python
int bitmasks (bit ``s`` = sequence ``s``), which makes intersection tests one
``&`` whatever ``n_seq_max`` is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from statecache.errors import ArgumentError, BatchError
from statecache.errors import PosError as PosError  # re-exported: it was defined here

#: Largest n_seq_max accepted (upstream's LLAMA_MAX_SEQ).
MAX_SEQ = 256

#: Positions (and token ids) are int32 everywhere downstream (cells, state blobs).
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

#: Positions per token of an M-RoPE batch (upstream's ``n_pos_per_embd``): sections
#: 0 temporal (the 1-D position), 1 y, 2 x, 3 unused by the memory.
N_POS_MROPE = 4


class SeqIds(Sequence[tuple[int, ...]]):
    """Per-token (or per-set) sequence-id tuples when every entry has exactly one id,
    backed by one int64 array so that building and slicing it costs no Python loop.

    Behaves like the ``list[tuple[int, ...]]`` it stands for (indexing gives
    ``(s,)``, slicing gives a list, it compares equal to that list); ``ids``
    is the array itself.
    """

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.size)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return [(s,) for s in self.ids[i].tolist()]
        return (int(self.ids[i]),)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return ((s,) for s in self.ids.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SeqIds):
            return np.array_equal(self.ids, other.ids)
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-array backed, like a list

    def __repr__(self) -> str:
        return f"SeqIds({self.ids.tolist()})"


def _primary_of(seq_id: Sequence[tuple[int, ...]]) -> np.ndarray:
    if isinstance(seq_id, SeqIds):
        return seq_id.ids
    return np.fromiter((ids[0] for ids in seq_id), dtype=np.int64, count=len(seq_id))


class PositionSource(Protocol):
    """What batch validation needs from a memory."""

    def seq_pos_min(self, seq: int) -> int: ...

    def seq_pos_max(self, seq: int) -> int: ...


@dataclasses.dataclass
class Batch:
    """A batch as submitted by a runtime.

    ``tokens`` int [n] or ``embd`` float [n, n_embd] (exactly one of them);
    ``pos`` int [n], or int [4, n] for M-RoPE (section-major like upstream:
    ``pos[0]`` the temporal position, used wherever a 1-D position is,
    ``pos[1]`` y, ``pos[2]`` x, ``pos[3]`` unused by the memory), or None
    (auto-filled, 1-D); ``seq_ids`` one sequence of ids per
    token or None (every token in sequence 0); ``output`` bool [n] or None
    (only the last token, or every token when the allocator is asked for
    all outputs).
    """

    tokens: Any = None
    embd: Any = None
    pos: Any = None
    seq_ids: Sequence[Sequence[int]] | Sequence[int] | None = None
    output: Any = None

    @classmethod
    def for_sequences(cls, tokens_by_seq: dict[int, Sequence[int]], *, output_all: bool = False) -> Batch:
        """One batch holding, for each sequence, its tokens (positions auto-filled).

        Every sequence listed needs at least one token (:class:`ArgumentError`
        naming ``tokens_by_seq`` otherwise: an empty entry would silently vanish)."""
        if not tokens_by_seq:
            raise ArgumentError("tokens_by_seq", "no sequence: a batch holds at least one token")
        toks: list[int] = []
        seqs: list[int] = []
        outs: list[bool] = []
        for s, ts in tokens_by_seq.items():
            ts = list(ts)
            if not ts:
                raise ArgumentError("tokens_by_seq", f"sequence {s} has no tokens")
            toks.extend(ts)
            seqs.extend([s] * len(ts))
            outs.extend([output_all or i == len(ts) - 1 for i in range(len(ts))])
        return cls(tokens=np.asarray(toks, dtype=np.int32), seq_ids=seqs, output=np.asarray(outs, dtype=bool))


@dataclasses.dataclass
class UBatch:
    """One unit of work for a memory and a graph (docs/memory-semantics.md#ubatch).

    For an equal split (``equal_seqs``) the tokens form ``n_seqs`` sets of
    ``n_seq_tokens`` tokens each, set-major: token ``s * n_seq_tokens + t``
    is token ``t`` of set ``s``, and ``set_seq_ids[s]`` are the set's
    sequence ids (primary id first).  ``token_idx`` maps every token back to
    its index in the batch.  When no token couples sequences, ``seq_id`` and
    ``set_seq_ids`` are :class:`SeqIds` (array backed, list-like).

    ``pos`` is always the 1-D (temporal) position of every token.  An M-RoPE
    ubatch also carries ``pos_sections``, int32 ``[4, n_tokens]``
    section-major (row 0 equals ``pos``, rows 1 and 2 are y and x, row 3 is
    passed through); it is None for a 1-D ubatch.  :attr:`pos_ext` gives the
    ``(x, y)`` pairs the KV cells and the mask use.

    A *varlen* (packed) ubatch (:meth:`BatchAllocator.split_varlen`) is
    set-major too, but its sets may have different lengths: set ``s`` owns
    tokens ``cu_seqlens[s] .. cu_seqlens[s + 1] - 1`` (``cu_seqlens`` int32
    ``[n_seqs + 1]``, starting at 0, every set at least one token).  Its
    ``equal_seqs`` is False and ``n_seq_tokens`` is the longest set's length;
    ``cu_seqlens`` is None for every other ubatch.
    """

    equal_seqs: bool
    n_seq_tokens: int
    n_seqs: int
    token_idx: np.ndarray
    token: np.ndarray | None
    embd: np.ndarray | None
    pos: np.ndarray
    seq_id: Sequence[tuple[int, ...]]
    output: np.ndarray
    seq_id_unq: tuple[int, ...]
    set_seq_ids: Sequence[tuple[int, ...]]
    pos_sections: np.ndarray | None = None
    cu_seqlens: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.token_idx.size)

    @property
    def is_varlen(self) -> bool:
        """Whether the ubatch is in the packed form (sets of any length, :attr:`cu_seqlens`)."""
        return self.cu_seqlens is not None

    @property
    def seq_lens(self) -> np.ndarray:
        """int64 ``[n_seqs]``: the tokens of every set (equal and varlen ubatches)."""
        if self.cu_seqlens is not None:
            return np.diff(self.cu_seqlens).astype(np.int64)
        if self.equal_seqs:
            return np.full(self.n_seqs, self.n_seq_tokens, dtype=np.int64)
        raise ArgumentError("ubatch", "a simple split (split_simple) has no sequence sets")

    @property
    def n_pos(self) -> int:
        """Positions per token: 1, or 4 for M-RoPE (upstream's ``n_pos``)."""
        return 1 if self.pos_sections is None else int(self.pos_sections.shape[0])

    @property
    def is_pos_2d(self) -> bool:
        """Whether the tokens carry 2-D ``(x, y)`` positions (upstream: ``n_pos >= 3``)."""
        return self.n_pos >= 3

    @property
    def pos_ext(self) -> np.ndarray | None:
        """int64 ``[n_tokens, 2]``: the ``(x, y)`` of every token (sections 2 and 1),
        or None for a 1-D ubatch."""
        if self.pos_sections is None or not self.is_pos_2d:
            return None
        return np.stack([self.pos_sections[2], self.pos_sections[1]], axis=1).astype(np.int64)

    @property
    def n_seqs_unq(self) -> int:
        return len(self.seq_id_unq)

    @property
    def seq_idx(self) -> dict[int, int]:
        """Sequence id -> index into ``seq_id_unq``."""
        return {s: i for i, s in enumerate(self.seq_id_unq)}

    @property
    def primary(self) -> np.ndarray:
        """Primary (first) sequence id of every token."""
        return _primary_of(self.seq_id)

    @property
    def set_primary(self) -> np.ndarray:
        """Primary sequence id of every set (equal splits)."""
        return _primary_of(self.set_seq_ids)

    @classmethod
    def empty(cls) -> UBatch:
        z = np.zeros(0, dtype=np.int64)
        return cls(False, 0, 0, z, None, None, z.astype(np.int32), [], z.astype(bool), (), [])

    @classmethod
    def reserve(cls, n_seq_tokens: int, seq_pos: Sequence[tuple[int, int]], pos_ext: Any = None) -> UBatch:
        """A blank equal ubatch (no tokens): one set per ``(seq, last_pos)``
        entry, ``n_seq_tokens`` tokens each, positions ending at last_pos.
        ``pos_ext``: optional int ``[n_tokens, 2]`` ``(x, y)`` per token, which
        makes it an M-RoPE ubatch (sections ``[pos, y, x, 0]``).
        Used when restoring state."""
        n_s = len(seq_pos)
        pos = np.concatenate(
            [np.arange(p - n_seq_tokens + 1, p + 1, dtype=np.int32) for _, p in seq_pos]
            or [np.zeros(0, dtype=np.int32)]
        )
        seq_id = [(s,) for s, _ in seq_pos for _ in range(n_seq_tokens)]
        n = n_s * n_seq_tokens
        sections = None
        if pos_ext is not None:
            ext = np.asarray(pos_ext)
            if ext.shape != (n, 2) or (ext.size and not np.issubdtype(ext.dtype, np.integer)):
                raise ArgumentError("pos_ext", f"must be an integer array of shape {(n, 2)}, got {ext.shape}")
            sections = np.stack([pos, ext[:, 1], ext[:, 0], np.zeros(n, dtype=np.int32)]).astype(np.int32)
        return cls(
            True,
            n_seq_tokens,
            n_s,
            np.arange(n, dtype=np.int64),
            None,
            None,
            pos,
            seq_id,
            np.zeros(n, dtype=bool),
            tuple(sorted({s for s, _ in seq_pos})),
            [(s,) for s, _ in seq_pos],
            sections,
        )


def _mask(ids: Sequence[int]) -> int:
    m = 0
    for s in ids:
        m |= 1 << s
    return m


class BatchAllocator:
    """Validates a batch against a memory and splits it into ubatches.

    ``n_seq_max``: the sequence ids the batches may use.  Leave it out to take it
    from the memory at :meth:`init`; given, it must equal the memory's (a
    mismatch is refused there, by name).  A memory plans a batch only from an
    allocator whose last :meth:`init` succeeded (:meth:`check_ready`)."""

    def __init__(self, n_seq_max: int | None = None) -> None:
        self.n_seq_max = 0 if n_seq_max is None else _check_n_seq_max(n_seq_max)
        self.n_tokens = 0
        self._reset_state()

    @classmethod
    def for_memory(cls, memory: PositionSource) -> BatchAllocator:
        """An allocator sized by ``memory`` (its ``n_seq_max``), so the two cannot
        disagree; ``memory.batch_allocator()`` says the same."""
        n = getattr(memory, "n_seq_max", None)
        if n is None:
            raise ArgumentError("memory", f"{type(memory).__name__} has no n_seq_max to size an allocator by")
        return cls(int(n))

    def check_ready(self, n_seq_max: int) -> None:
        """Raise :class:`ArgumentError` (naming ``balloc``) unless a batch was validated
        by :meth:`init` for a memory of ``n_seq_max`` sequences: an allocator never
        initialised, or whose last ``init`` failed, holds no batch to plan."""
        if self.n_tokens == 0:
            raise ArgumentError("balloc", "holds no batch: call balloc.init(batch, memory) before init_batch()")
        if self.n_seq_max != n_seq_max:
            raise ArgumentError(
                "balloc", f"validated its batch for n_seq_max={self.n_seq_max}, this memory holds {n_seq_max}"
            )

    def _reset_state(self) -> None:
        self.token: np.ndarray | None = None
        self.embd: np.ndarray | None = None
        self.pos = np.zeros(0, dtype=np.int32)
        self.pos_sections: np.ndarray | None = None  # int32 [4, n] for an M-RoPE batch
        self.seq_id: Sequence[tuple[int, ...]] = []
        self.primary = np.zeros(0, dtype=np.int64)
        self.output = np.zeros(0, dtype=bool)
        self.has_coupled = False
        self.seq_id_unq: tuple[int, ...] = ()
        self._set_of_token = np.zeros(0, dtype=np.int64)
        self._set_masks: list[int] | None = []
        self._set_ids: Sequence[tuple[int, ...]] = []
        self._order = np.zeros(0, dtype=np.int64)
        self._bounds = np.zeros(1, dtype=np.int64)
        self._seq_to_set_arr = np.full(self.n_seq_max + 1, -1, dtype=np.int64)
        self.split_reset()

    def _adopt(self, memory: PositionSource | None) -> None:
        """Take ``n_seq_max`` from the memory, or refuse a memory of another size."""
        mem_n = getattr(memory, "n_seq_max", None)
        if self.n_seq_max == 0:
            if mem_n is None:
                raise ArgumentError(
                    "memory", "BatchAllocator() was built without n_seq_max: init() needs the memory to take it from"
                )
            self.n_seq_max = _check_n_seq_max(mem_n)
        elif mem_n is not None and int(mem_n) != self.n_seq_max:
            raise ArgumentError(
                "n_seq_max",
                f"this allocator was built for {self.n_seq_max} sequences, the memory holds {int(mem_n)}: build it "
                f"as BatchAllocator() to take n_seq_max from the memory, or as BatchAllocator({int(mem_n)})",
            )

    # -- validation (docs/memory-semantics.md#batch-validation) ---------------
    def init(
        self,
        batch: Batch,
        memory: PositionSource | None = None,
        *,
        n_vocab: int | None = None,
        n_embd: int | None = None,
        output_all: bool = False,
    ) -> None:
        """Validate ``batch`` and auto-fill positions, sequence ids and outputs.

        Raises :class:`BatchError` naming the token, the sequence and the
        rule; on error the allocator is left empty.  A memory of another
        ``n_seq_max`` than the allocator's is refused (:class:`ArgumentError`).
        """
        self.n_tokens = 0
        self._adopt(memory)
        self._reset_state()
        if (batch.tokens is None) == (batch.embd is None):
            raise BatchError("a batch holds exactly one of tokens or embd", rule="payload")
        if batch.tokens is not None:
            token = np.asarray(batch.tokens)
            if token.ndim != 1:
                raise BatchError(f"tokens must be a 1-D integer array, got shape {token.shape}", rule="payload")
            if token.size and not np.issubdtype(token.dtype, np.integer):
                raise BatchError(f"tokens must be integer ids, got dtype {token.dtype}", rule="payload")
            if (
                token.size
                and not np.can_cast(token.dtype, np.int32)
                and (token.min() < INT32_MIN or token.max() > INT32_MAX)
            ):
                i = int(np.flatnonzero((token < INT32_MIN) | (token > INT32_MAX))[0])
                raise BatchError(f"token {i}: id {int(token[i])} is outside int32", token=i, rule="token_range")
            token = token.astype(np.int32)
            n = token.size
            if n_vocab is not None and n:
                bad = np.flatnonzero((token < 0) | (token >= n_vocab))
                if bad.size:
                    i = int(bad[0])
                    raise BatchError(
                        f"token {i}: id {int(token[i])} outside the vocabulary [0, {n_vocab})",
                        token=i,
                        rule="token_range",
                    )
            embd = None
        else:
            try:
                embd = np.asarray(batch.embd, dtype=np.float32)
            except (ValueError, TypeError) as exc:
                raise BatchError(f"embd must be a float array [n_tokens, n_embd]: {exc}", rule="payload") from exc
            if embd.ndim != 2 or (n_embd is not None and embd.shape[1] != n_embd):
                raise BatchError(f"embd must be [n_tokens, n_embd={n_embd}], got shape {embd.shape}", rule="payload")
            n = embd.shape[0]
            token = None
        if n == 0:
            raise BatchError("empty batch", rule="empty")

        # sequence ids: one int array when no token couples sequences (the common case, no
        # per-token Python), else a list of tuples
        seq_id, primary = self._parse_seq_ids(batch.seq_ids, n)
        coupled = not isinstance(seq_id, SeqIds)
        uniq_primary, set_of_primary = np.unique(primary, return_inverse=True)
        if coupled:
            all_ids = {s for ids in seq_id for s in ids}
            bad_ids = [s for s in all_ids if not 0 <= s < self.n_seq_max]
        else:
            bad_ids = uniq_primary[(uniq_primary < 0) | (uniq_primary >= self.n_seq_max)].tolist()
        if bad_ids:  # name the first offending token in batch order
            bad_set = set(bad_ids)
            i = next(k for k, ids in enumerate(seq_id) if bad_set.intersection(ids))
            s = next(q for q in seq_id[i] if q in bad_set)
            raise BatchError(
                f"token {i}: sequence id {s} outside [0, n_seq_max={self.n_seq_max})",
                token=i,
                seq=s,
                rule="seq_id_range",
            )

        # coupled sequences must agree in the memory
        if coupled and memory is not None:
            for i, ids in enumerate(seq_id):
                if len(ids) < 2:
                    continue
                ref = (memory.seq_pos_min(ids[0]), memory.seq_pos_max(ids[0]))
                for s in ids[1:]:
                    got = (memory.seq_pos_min(s), memory.seq_pos_max(s))
                    if got != ref:
                        raise BatchError(
                            f"token {i} couples sequences {ids[0]} and {s}, whose memory positions differ "
                            f"({ref} vs {got})",
                            token=i,
                            seq=s,
                            rule="coupled_pos",
                        )

        # what the memory holds per sequence, one array (vectorised when the memory offers it)
        pos_mem = np.full(self.n_seq_max, -1, dtype=np.int64)
        if memory is not None:
            bulk = getattr(memory, "seq_pos_max_all", None)
            held = None if bulk is None else np.asarray(bulk())
            if held is not None and held.shape == (self.n_seq_max,):
                pos_mem[:] = held
            else:
                for s in all_ids if coupled else uniq_primary.tolist():
                    pos_mem[s] = memory.seq_pos_max(s)

        # positions
        sections: np.ndarray | None = None
        if batch.pos is None:
            in_batch = np.fromiter(all_ids, dtype=np.int64) if coupled else uniq_primary
            # auto-filled positions would reach INT32_MAX, which no position may hold (POS_LAST)
            if int(pos_mem[in_batch].max()) + n >= INT32_MAX:
                s = int(in_batch[np.argmax(pos_mem[in_batch])])
                raise BatchError(
                    f"sequence {s} is at position {int(pos_mem[s])}: the next positions would pass int32",
                    seq=s,
                    rule="pos_range",
                )
            if not coupled and uniq_primary.size == n:  # one token per sequence (decode)
                pos = (pos_mem[primary] + 1).astype(np.int32)
            elif not coupled:
                pos = np.empty(n, dtype=np.int32)
                order = np.argsort(primary, kind="stable")
                ps = primary[order]
                starts = np.flatnonzero(_first_of_run(ps))
                rank = np.arange(n) - np.repeat(starts, np.diff(starts, append=n))
                pos[order] = (pos_mem[ps] + 1 + rank).astype(np.int32)
            else:
                nxt = {s: int(pos_mem[s]) + 1 for s in all_ids}
                pos_l = []
                for ids in seq_id:
                    p = nxt[ids[0]]
                    pos_l.append(p)
                    for s in ids:
                        nxt[s] = p + 1
                pos = np.asarray(pos_l, dtype=np.int32)
        else:
            pos, sections = _parse_pos(batch.pos, n)
            if (pos < 0).any():
                i = int(np.flatnonzero(pos < 0)[0])
                raise BatchError(f"token {i}: negative position {int(pos[i])}", token=i, rule="pos_negative")
            if (pos == INT32_MAX).any():
                # INT32_MAX is the open end of every range (p1 = -1): a token there could
                # never be removed or shifted by "to the end" (statecache.memory.POS_LAST)
                i = int(np.flatnonzero(pos == INT32_MAX)[0])
                raise BatchError(
                    f"token {i}: position {INT32_MAX} is the end of every range, the largest a token may hold "
                    f"is {INT32_MAX - 1} (int32)",
                    token=i,
                    rule="pos_range",
                )

        # per-sequence rules on the temporal position: start right after the memory,
        # consecutive in batch order (auto-filled positions of uncoupled sequences satisfy
        # them by construction); M-RoPE relaxes them (see _check_positions_mrope)
        if sections is not None:
            self._check_positions_mrope(seq_id, primary, pos, pos_mem, coupled, embd is not None)
            _check_whole_positions_unique(seq_id, primary, sections, coupled)
        elif batch.pos is not None or coupled:
            self._check_positions(seq_id, primary, pos, pos_mem, coupled)

        # outputs
        if batch.output is None:
            output = np.zeros(n, dtype=bool)
            output[-1] = True
        else:
            output = np.asarray(batch.output, dtype=bool)
            if output.shape != (n,):
                raise BatchError(f"output must have {n} entries, got shape {output.shape}", rule="output")
            output = output.copy()
        if output_all:
            output[:] = True

        # sequence sets
        if coupled:
            masks = [_mask(ids) for ids in seq_id]
            uniq: dict[int, int] = {}
            set_of_token = np.empty(n, dtype=np.int64)
            set_list: list[tuple[int, ...]] = []
            for i, m in enumerate(masks):
                k = uniq.get(m)
                if k is None:
                    k = uniq[m] = len(set_list)
                    set_list.append(seq_id[i])
                set_of_token[i] = k
            set_ids: Sequence[tuple[int, ...]] = set_list
            set_masks = list(uniq)
        else:
            uniq_seq, set_of_token = uniq_primary, set_of_primary.reshape(-1)
            set_ids = SeqIds(uniq_seq)
            set_masks = None  # built on demand: only the non-sequential split needs them
        # tokens of each set, in batch order: order[bounds[k] : bounds[k + 1]].  Every splitter
        # takes a set's tokens in batch order, so what is used of a set is always a prefix.
        self._order = np.argsort(set_of_token, kind="stable")
        self._bounds = np.zeros(len(set_ids) + 1, dtype=np.int64)
        np.cumsum(np.bincount(set_of_token, minlength=len(set_ids)), out=self._bounds[1:])
        self._seq_to_set_arr = np.full(self.n_seq_max + 1, -1, dtype=np.int64)
        if not coupled:
            self._seq_to_set_arr[uniq_seq] = np.arange(len(set_ids))

        self.token, self.embd, self.pos, self.seq_id, self.primary = token, embd, pos, seq_id, primary
        self.pos_sections = sections
        self.output, self.has_coupled = output, coupled
        self.seq_id_unq = tuple(sorted(all_ids)) if coupled else tuple(uniq_primary.tolist())
        self._set_of_token, self._set_masks, self._set_ids = set_of_token, set_masks, set_ids
        self.n_tokens = n
        self.split_reset()

    @staticmethod
    def _check_positions(
        seq_id: Sequence[tuple[int, ...]], primary: np.ndarray, pos: np.ndarray, pos_mem: np.ndarray, coupled: bool
    ) -> None:
        ss, ti, pp, new_seq = _per_sequence_order(seq_id, primary, pos, coupled)
        starts = np.flatnonzero(new_seq)
        p_start = pos_mem[ss[starts]]
        bad_start = starts[(p_start >= 0) & (pp[starts] != p_start + 1)]
        if bad_start.size:
            k = int(bad_start[0])
            s = int(ss[k])
            p_mem = int(pos_mem[s])
            i = int(ti[k])
            raise BatchError(
                f"token {i}: sequence {s} must continue at position {p_mem + 1} (the memory holds up to "
                f"{p_mem}), got {int(pp[k])}",
                token=i,
                seq=s,
                rule="pos_start",
            )
        step_bad = np.flatnonzero(~new_seq & (pp != np.roll(pp, 1) + 1))
        if step_bad.size:
            k = int(step_bad[0])
            i, s = int(ti[k]), int(ss[k])
            rule = "pos_order" if pp[k] <= pp[k - 1] else "pos_gap"
            raise BatchError(
                f"token {i}: sequence {s} jumps from position {int(pp[k - 1])} to {int(pp[k])} "
                "(positions of a sequence must be consecutive in batch order)",
                token=i,
                seq=s,
                rule=rule,
            )

    @staticmethod
    def _check_positions_mrope(
        seq_id: Sequence[tuple[int, ...]],
        primary: np.ndarray,
        pos: np.ndarray,
        pos_mem: np.ndarray,
        coupled: bool,
        is_embd: bool,
    ) -> None:
        """Position rules of an M-RoPE batch (spec 6.1), on the temporal section: a
        sequence the memory holds must start strictly after its last position
        (tokens) or not before it (embeddings, e.g. an image continuing a grid);
        positions may jump and repeat (an image's patches share one) but must not
        decrease in batch order."""
        ss, ti, pp, new_seq = _per_sequence_order(seq_id, primary, pos, coupled)
        starts = np.flatnonzero(new_seq)
        p_mem = pos_mem[ss[starts]]
        too_early = (pp[starts] < p_mem) if is_embd else (pp[starts] <= p_mem)
        bad_start = starts[(p_mem >= 0) & too_early]
        if bad_start.size:
            k = int(bad_start[0])
            s, i = int(ss[k]), int(ti[k])
            need = "at or after" if is_embd else "after"
            raise BatchError(
                f"token {i}: sequence {s} must continue {need} position {int(pos_mem[s])} (the memory holds up "
                f"to it; M-RoPE), got {int(pp[k])}",
                token=i,
                seq=s,
                rule="pos_start",
            )
        step_bad = np.flatnonzero(~new_seq & (pp < np.roll(pp, 1)))
        if step_bad.size:
            k = int(step_bad[0])
            i, s = int(ti[k]), int(ss[k])
            raise BatchError(
                f"token {i}: sequence {s} goes back from position {int(pp[k - 1])} to {int(pp[k])} "
                "(M-RoPE positions of a sequence must not decrease in batch order)",
                token=i,
                seq=s,
                rule="pos_order",
            )

    @staticmethod
    def _parse_seq_ids(seq_ids: Any, n: int) -> tuple[Sequence[tuple[int, ...]], np.ndarray]:
        """(per-token ids, primary id per token).  The ids are a :class:`SeqIds` when
        every token has exactly one sequence, else a list of tuples."""
        if seq_ids is None:
            primary = np.zeros(n, dtype=np.int64)
            return SeqIds(primary), primary
        arr = seq_ids if isinstance(seq_ids, np.ndarray) and seq_ids.ndim == 1 else None
        if arr is None and isinstance(seq_ids, Sequence) and len(seq_ids) and isinstance(seq_ids[0], int | np.integer):
            try:  # a flat list of ints: one conversion instead of a per-token loop
                flat = np.asarray(seq_ids)
            except (ValueError, TypeError):  # mixed ints and tuples
                flat = None
            if flat is not None and flat.ndim == 1 and np.issubdtype(flat.dtype, np.integer):
                arr = flat
        if arr is not None:
            if arr.shape != (n,):
                raise BatchError(f"seq_ids has {arr.size} entries for {n} tokens", rule="seq_id_count")
            primary = arr.astype(np.int64)
            return SeqIds(primary), primary
        if len(seq_ids) != n:
            raise BatchError(f"seq_ids has {len(seq_ids)} entries for {n} tokens", rule="seq_id_count")
        seq_id: list[tuple[int, ...]] = []
        for i, ids in enumerate(seq_ids):
            t = (int(ids),) if isinstance(ids, int | np.integer) else tuple(int(s) for s in ids)
            if not t:
                raise BatchError(f"token {i} belongs to no sequence", token=i, rule="seq_id_count")
            if len(set(t)) != len(t):
                raise BatchError(f"token {i} lists a sequence twice: {t}", token=i, rule="seq_id_dup")
            seq_id.append(t)
        primary = np.fromiter((ids[0] for ids in seq_id), dtype=np.int64, count=n)
        if all(len(ids) == 1 for ids in seq_id):
            return SeqIds(primary), primary
        return seq_id, primary

    # -- splitting (docs/memory-semantics.md#splitters) -----------------------
    @property
    def n_outputs(self) -> int:
        return int(self.output.sum())

    def split_reset(self) -> None:
        self.n_used = 0
        self._used = np.zeros(self.n_tokens, dtype=bool)
        self._cursor = 0  # first possibly-unused token
        self._set_cursor = np.zeros(len(self._bounds) - 1, dtype=np.int64)
        self.out_ids: list[int] = []

    def _next_unused(self) -> int:
        if self._cursor < self.n_tokens and self._used[self._cursor]:
            free = np.flatnonzero(~self._used[self._cursor :])
            self._cursor = self._cursor + int(free[0]) if free.size else self.n_tokens
        return self._cursor

    @property
    def _masks(self) -> list[int]:
        if self._set_masks is None:
            self._set_masks = [_mask(ids) for ids in self._set_ids]
        return self._set_masks

    def _set_remaining(self, k: int) -> np.ndarray:
        return self._order[self._bounds[k] + self._set_cursor[k] : self._bounds[k + 1]]

    def _emit(
        self,
        idx: np.ndarray,
        equal: bool,
        n_seq_tokens: int,
        set_ids: Sequence[tuple[int, ...]],
        sets: np.ndarray | None = None,
        cu_seqlens: np.ndarray | None = None,
    ) -> UBatch:
        """Build the ubatch of tokens ``idx``.  ``sets`` (equal and varlen splits): the set
        indices, each contributing ``n_seq_tokens`` tokens (varlen: its ``cu_seqlens`` run),
        which lets the cursors move without a scatter."""
        idx = np.asarray(idx, dtype=np.int64)
        self._used[idx] = True
        self.n_used += int(idx.size)
        if sets is not None:
            self._set_cursor[sets] += n_seq_tokens if cu_seqlens is None else np.diff(cu_seqlens)
        else:
            np.add.at(self._set_cursor, self._set_of_token[idx], 1)
        out = self.output[idx]
        self.out_ids.extend(idx[out].tolist())
        if self.has_coupled:
            seq_id: Sequence[tuple[int, ...]] = [self.seq_id[i] for i in idx.tolist()]
            unq = tuple(sorted({s for ids in seq_id for s in ids}))
        else:
            seq_id = SeqIds(self.primary[idx])
            if isinstance(set_ids, SeqIds):  # the sets are the sequences
                unq = tuple(np.sort(set_ids.ids).tolist())
            else:
                unq = tuple(np.unique(seq_id.ids).tolist())
        return UBatch(
            equal_seqs=equal,
            n_seq_tokens=n_seq_tokens,
            n_seqs=len(set_ids) if equal or cu_seqlens is not None else int(idx.size),
            token_idx=idx,
            token=None if self.token is None else self.token[idx],
            embd=None if self.embd is None else self.embd[idx],
            pos=self.pos[idx],
            seq_id=seq_id,
            output=out,
            seq_id_unq=unq,
            set_seq_ids=set_ids,
            pos_sections=None if self.pos_sections is None else self.pos_sections[:, idx],
            cu_seqlens=cu_seqlens,
        )

    def split_simple(self, n_ubatch: int) -> UBatch:
        """The next up to ``n_ubatch`` unused tokens in batch order."""
        _check_n_ubatch(n_ubatch)
        start = self._next_unused()
        if start >= self.n_tokens:
            return UBatch.empty()
        free = np.flatnonzero(~self._used[start:])[:n_ubatch] + start
        return self._emit(free, False, 1, [])

    def split_equal(self, n_ubatch: int, sequential: bool = False, n_keep_tail: int = 0) -> UBatch:
        """Equal-length sets of sequences, lock-step, never more than ``n_ubatch`` tokens.

        Returns an empty ubatch when nothing is left, or (``sequential``) when
        the batch couples sequences.  With ``n_keep_tail > 0`` every set's last
        ``min(len, n_keep_tail)`` tokens end up in one ubatch.
        """
        _check_n_keep_tail(n_ubatch, n_keep_tail)
        if sequential and self.has_coupled:
            return UBatch.empty()
        start = self._next_unused()
        if start >= self.n_tokens:
            return UBatch.empty()

        # 1. choose sets (capped at n_ubatch: every set needs at least one token)
        chosen: list[int] = []
        if sequential and not self.has_coupled:
            # sets are single sequences: consecutive ids from the first unused token's
            s0 = self._set_ids[int(self._set_of_token[start])][0]
            cand = self._seq_to_set_arr[s0 : min(s0 + n_ubatch, self.n_seq_max)]
            ok = cand >= 0
            ok[ok] = self._remaining_count(cand[ok]) > 0
            stop = np.flatnonzero(~ok)
            ch = cand[: stop[0] if stop.size else cand.size]
        elif not self.has_coupled:
            # sets are single sequences, so no two overlap: the first n_ubatch sets in order of
            # their first unused token (one NumPy pass, where the loop below cost a step per token)
            sets = self._set_of_token[np.flatnonzero(~self._used[start:]) + start]
            _, first = np.unique(sets, return_index=True)
            ch = sets[np.sort(first)[:n_ubatch]].astype(np.int64)
        else:
            before = 0  # the sequences of every set met so far, chosen or not
            seen: set[int] = set()
            for i in range(start, self.n_tokens):
                if self._used[i]:
                    continue
                k = int(self._set_of_token[i])
                if k in seen:
                    continue
                seen.add(k)
                m = self._masks[k]
                blocked, before = m & before, before | m
                if blocked:
                    # shares a sequence with a chosen set, or with one whose unused token comes
                    # first (taking k would run that sequence out of batch order)
                    continue
                if sequential and chosen and self._set_ids[k][0] != self._set_ids[chosen[-1]][0] + 1:
                    continue
                chosen.append(k)
                if len(chosen) >= n_ubatch:
                    break

            ch = np.asarray(chosen, dtype=np.int64)

        # 2. lock-step expansion (coupled: no set past a token of another set of its sequences)
        count = self._remaining_count(ch)
        n_len = int(min(count.min(), n_ubatch // ch.size))
        lim = count
        if self.has_coupled and ch.size:
            limits = self._coupled_limits(ch.tolist())
            lim = np.asarray([limits[k] for k in ch.tolist()], dtype=np.int64)
            n_len = min(n_len, int(lim.min()))

        # 3. keep-tail rule: a set may be cut only where n_keep_tail tokens remain after the cut
        if n_keep_tail > 0:
            left = count - n_len
            bad = np.flatnonzero((left != 0) & (left < n_keep_tail))
            keep = int(bad[0]) if bad.size else ch.size
            if keep == 0:
                c0 = int(count[0])
                # the whole remainder if it fits, else cut where n_keep_tail tokens stay behind
                n_len = c0 if c0 <= n_ubatch else min(n_ubatch, c0 - n_keep_tail)
                if n_len > int(lim[0]):  # coupled: stop before another set of its sequences
                    n_len = int(lim[0])
                    if c0 - n_len < n_keep_tail:
                        return UBatch.empty()  # its tail cannot stay whole: left unplaced, the plan fails
                keep = 1
            ch = ch[:keep]

        base = self._bounds[ch] + self._set_cursor[ch]
        idx = self._order[(base[:, None] + np.arange(n_len)[None, :]).ravel()]
        if isinstance(self._set_ids, SeqIds):
            set_ids: Sequence[tuple[int, ...]] = SeqIds(self._set_ids.ids[ch])
        else:
            set_ids = [self._set_ids[k] for k in ch.tolist()]
        return self._emit(idx, True, n_len, set_ids, ch)

    def split_varlen(self, n_ubatch: int, n_keep_tail: int = 0) -> UBatch:
        """The whole batch (up to ``n_ubatch`` tokens) as one packed ubatch: every sequence
        set's remaining tokens in one run, in batch order, sets of any length
        (``UBatch.cu_seqlens``), so one primitive call per layer advances all of them.

        Sets are taken in the order of their first unused token, whatever their
        sequence ids (non-consecutive, unsorted).  Only sets that share a sequence
        (a token of several sequences next to tokens of one of them) go to
        different ubatches.  When the tokens left exceed ``n_ubatch``, a set is
        cut only where none or at least ``n_keep_tail`` of its tokens stay behind
        (the rule of :meth:`split_equal`: a sequence's last ``n_rs_seq + 1``
        tokens land in one ubatch, so its rollback planes are all written).
        Returns an empty ubatch when nothing is left.
        """
        _check_n_keep_tail(n_ubatch, n_keep_tail)
        start = self._next_unused()
        if start >= self.n_tokens:
            return UBatch.empty()
        # sets in the order of their first unused token
        sets = self._set_of_token[np.flatnonzero(~self._used[start:]) + start]
        _, first = np.unique(sets, return_index=True)
        order = sets[np.sort(first)].astype(np.int64)
        chosen: list[int] = []
        takes: list[int] = []
        budget, taken = n_ubatch, 0
        limits = self._coupled_limits(order.tolist()) if self.has_coupled else None
        for k, count in zip(order.tolist(), self._remaining_count(order).tolist(), strict=True):
            if limits is not None:
                m = self._masks[k]
                if m & taken:
                    continue  # shares a sequence with a set already in this ubatch
            take = min(count, budget) if limits is None else min(count, budget, limits[k])
            if 0 < count - take < n_keep_tail:
                take = count - n_keep_tail  # leave a whole tail behind for the next ubatch
            if take <= 0:
                continue
            chosen.append(k)
            takes.append(take)
            if self.has_coupled:
                taken |= self._masks[k]
            budget -= take
            if budget == 0:
                break
        if not chosen:
            return UBatch.empty()  # coupled sets that cannot keep their order and tails: the plan fails
        ch = np.asarray(chosen, dtype=np.int64)
        lens = np.asarray(takes, dtype=np.int64)
        cu = np.zeros(ch.size + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        base = self._bounds[ch] + self._set_cursor[ch]
        # token t of set i sits at _order[base[i] + t]: one gather for every set
        offs = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lens)
        idx = self._order[np.repeat(base, lens) + offs]
        if isinstance(self._set_ids, SeqIds):
            set_ids: Sequence[tuple[int, ...]] = SeqIds(self._set_ids.ids[ch])
        else:
            set_ids = [self._set_ids[k] for k in ch.tolist()]
        return self._emit(idx, False, int(lens.max()), set_ids, ch, cu)

    def _remaining_count(self, sets: np.ndarray) -> np.ndarray:
        count: np.ndarray = self._bounds[sets + 1] - self._bounds[sets] - self._set_cursor[sets]
        return count

    def _coupled_limits(self, sets: Sequence[int]) -> dict[int, int]:
        """Per set, how many of its remaining tokens precede the first unused token of
        another set sharing a sequence with it.  Taking more would run that sequence out
        of batch order: with ``(0,) (0, 1) (0,)`` set ``(0,)`` may not take its second
        token before the coupled one.  Only batches that couple sequences need this."""
        n_sets = len(self._bounds) - 1
        live = np.flatnonzero(self._remaining_count(np.arange(n_sets)) > 0)
        first = self._order[self._bounds[live] + self._set_cursor[live]].tolist()
        # per sequence, the two earliest first-unused tokens of the live sets holding it (and
        # whose): a set's stop is then found from its own ids, not by comparing every pair
        best: dict[int, list[tuple[int, int]]] = {}
        for j, f in zip(live.tolist(), first, strict=True):
            for q in self._set_ids[j]:
                b = best.setdefault(q, [])
                b.append((f, j))
                if len(b) > 2:
                    b.sort()
                    del b[2:]
        out: dict[int, int] = {}
        for k in sets:
            stop = self.n_tokens
            for q in self._set_ids[k]:
                stop = min([stop, *(f for f, j in best.get(q, ()) if j != k)])
            out[k] = int(np.searchsorted(self._set_remaining(k), stop))
        return out

    def split_seq(self, n_ubatch: int) -> UBatch:
        """One set per ubatch: from the first unused token, following unused tokens
        whose set is a subset of the current (narrowing) set, up to ``n_ubatch``."""
        _check_n_ubatch(n_ubatch)
        start = self._next_unused()
        if start >= self.n_tokens:
            return UBatch.empty()
        cur = self._masks[int(self._set_of_token[start])]
        first_ids = self._set_ids[int(self._set_of_token[start])]
        idx = [start]
        for i in range(start + 1, self.n_tokens):
            if len(idx) >= n_ubatch:
                break
            if self._used[i]:
                continue
            m = self._masks[int(self._set_of_token[i])]
            if m & cur == m:
                idx.append(i)
                cur = m
            elif m & cur:
                break  # a token of one of the set's sequences that this ubatch cannot take comes first
        return self._emit(np.asarray(idx), True, len(idx), [first_ids])


def _per_sequence_order(
    seq_id: Sequence[tuple[int, ...]], primary: np.ndarray, pos: np.ndarray, coupled: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (sequence, token) pair sorted by sequence, then batch order: the
    sequence, token index, position, and whether it starts its sequence's run.
    A coupled token appears once per sequence it belongs to."""
    n = pos.size
    if coupled:
        tok_seq = np.fromiter((s for ids in seq_id for s in ids), dtype=np.int64)
        tok_idx = np.repeat(np.arange(n), [len(ids) for ids in seq_id])
    else:
        tok_seq = primary
        tok_idx = np.arange(n)
    order = np.lexsort((tok_idx, tok_seq))
    ss, ti = tok_seq[order], tok_idx[order]
    return ss, ti, pos[ti].astype(np.int64), _first_of_run(ss)


def _check_whole_positions_unique(
    seq_id: Sequence[tuple[int, ...]], primary: np.ndarray, sections: np.ndarray, coupled: bool
) -> None:
    """An M-RoPE batch may repeat a temporal position (an image's patches share one),
    never a whole ``(t, y, x)`` within a sequence: two such cells could not be told
    apart (by the mask's tie-break, or in a state blob)."""
    n = sections.shape[1]
    if coupled:
        seqs = np.fromiter((s for ids in seq_id for s in ids), dtype=np.int64)
        tok = np.repeat(np.arange(n), [len(ids) for ids in seq_id])
    else:
        seqs, tok = primary, np.arange(n)
    rows = np.stack([seqs, sections[0, tok], sections[1, tok], sections[2, tok]], axis=1)
    _, first, counts = np.unique(rows, axis=0, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = rows[first[counts > 1][0]]
        i = int(tok[np.flatnonzero((rows == dup).all(axis=1))[1]])
        raise BatchError(
            f"token {i}: sequence {int(dup[0])} holds position (t={int(dup[1])}, y={int(dup[2])}, x={int(dup[3])}) "
            "twice in this batch",
            token=i,
            seq=int(dup[0]),
            rule="pos_duplicate",
        )


def _parse_pos(value: Any, n: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(pos int32 [n], sections int32 [4, n] or None)`` from ``Batch.pos``."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested lists
        raise PosError(f"must be an integer array of shape ({n},) or ({N_POS_MROPE}, {n})") from exc
    if arr.shape not in ((n,), (N_POS_MROPE, n)) or not np.issubdtype(arr.dtype, np.integer):
        kind = f"dtype {arr.dtype}" if arr.shape in ((n,), (N_POS_MROPE, n)) else f"shape {arr.shape}"
        raise PosError(
            f"must be an integer array of shape ({n},) (one position per token) or ({N_POS_MROPE}, {n}) "
            f"(M-RoPE sections t, y, x, unused), got {kind}"
        )
    if arr.size and not np.can_cast(arr.dtype, np.int32) and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        bad = np.argwhere((arr < INT32_MIN) | (arr > INT32_MAX))[0]
        i = int(bad[-1])
        raise PosError(f"token {i}: position {int(arr[tuple(bad)])} is outside int32 [{INT32_MIN}, {INT32_MAX}]")
    if arr.ndim == 1:
        return arr.astype(np.int32), None
    sections = arr.astype(np.int32)  # a fresh array: the caller's pos is never aliased
    return sections[0].copy(), sections


def _first_of_run(a: np.ndarray) -> np.ndarray:
    out = np.empty(a.size, dtype=bool)
    if a.size:
        out[0] = True
        np.not_equal(a[1:], a[:-1], out=out[1:])
    return out


def _check_n_seq_max(n_seq_max: Any) -> int:
    if isinstance(n_seq_max, bool) or not isinstance(n_seq_max, int | np.integer):
        raise BatchError(f"n_seq_max must be an integer, got {n_seq_max!r}", rule="n_seq_max")
    if not 1 <= int(n_seq_max) <= MAX_SEQ:
        raise BatchError(f"n_seq_max {n_seq_max} must be in [1, {MAX_SEQ}]", rule="n_seq_max")
    return int(n_seq_max)


def _check_n_keep_tail(n_ubatch: int, n_keep_tail: int) -> None:
    _check_n_ubatch(n_ubatch)
    if n_keep_tail < 0:
        raise BatchError(f"n_keep_tail {n_keep_tail} must be >= 0", rule="n_keep_tail")
    if n_keep_tail and n_ubatch <= n_keep_tail:
        raise BatchError(
            f"n_ubatch {n_ubatch} must exceed n_keep_tail {n_keep_tail} (the last n_rs_seq + 1 tokens of a "
            "sequence must fit in one ubatch)",
            rule="n_keep_tail",
        )


def _check_n_ubatch(n_ubatch: int) -> None:
    if not isinstance(n_ubatch, int | np.integer) or n_ubatch < 1:
        raise BatchError(f"n_ubatch must be an integer >= 1, got {n_ubatch!r}", rule="n_ubatch")
