"""Tensor-parallel checkpoints: per-rank state, gathered to one blob and scattered back.

Rank ``r`` of ``t`` holds the rows of its heads (:meth:`MemorySpec.shard`);
its books are every other rank's.  So a whole-model checkpoint is the
metadata of any rank plus, for every row, the ranks' parts put back where
:meth:`RecurrentLayerSpec.shard_index` / :meth:`AttentionLayerSpec.shard_index`
say they came from.  That is all :func:`gather_state` does, on blobs in the
state format (docs/state-format.md): it checks that every rank's metadata is
byte-identical (the books agree), that replicated parts (an RWKV token shift,
the indexer cache) agree, and that the parts cover every element; it writes
one blob that the unsharded memory reads with ``state_read``.
:func:`scatter_state` cuts such a blob into the blobs of ``t`` ranks.  A
checkpoint taken at ``t = 2`` restores at ``t = 1`` or ``t = 4`` wherever the
spec splits that way (:func:`reshard`).

Per-rank blobs from :func:`save_shard` carry one extra section, ``SHRD``
(``u32 rank, u32 world``), so a blob cannot be restored into the wrong rank;
:func:`restore_shard` checks and drops it before the memory reads the rest.

:func:`gather_memory` / :func:`scatter_memory` do the same over a
``torch.distributed`` group (imported when called).  ``scatter_memory`` is
all or nothing across ranks: when any rank refuses its part, the ranks that
accepted theirs put back what they held.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from statecache.distributed.sections import RowBlock, Section, parse_section
from statecache.errors import StateError
from statecache.hybrid_idx import TAG_IDX
from statecache.memory import StateFlags
from statecache.spec import MemorySpec, ModelSpec, check_rank
from statecache.state_io import pack_sections, unpack_sections

SHARD_TAG = b"SHRD"
_SHARD = struct.Struct("<II")


def _shard_section(rank: int, world: int) -> tuple[bytes, bytes]:
    check_rank(rank, world)  # a rank outside the world (or 0.5) was packed as it came, or failed in struct
    return SHARD_TAG, _SHARD.pack(rank, world)


def _split_blob(blob: Any) -> tuple[int, tuple[int, int] | None, list[tuple[bytes, memoryview]]]:
    """``(flags, (rank, world) or None, the memory's sections)`` of a blob."""
    flags, sections = unpack_sections(blob)
    shard = None
    rest = []
    for tag, payload in sections:
        if tag != SHARD_TAG:
            rest.append((tag, payload))
        elif len(payload) != _SHARD.size:
            raise StateError("shard", f"section is {len(payload)} bytes, expected {_SHARD.size}")
        else:
            shard = _SHARD.unpack(bytes(payload))
    return flags, shard, rest


def _layout(spec: MemorySpec | ModelSpec, sec: Section, block: RowBlock, rank: int, world: int) -> tuple[Any, int]:
    """``(element index of rank's row in the full row or None if replicated, full row elements)``."""
    if sec.tag == TAG_IDX:
        return None, block.elements  # one key head: every rank holds the whole row
    if block.key[0] == "recr":
        _, layer, name = block.key
        recurrent = spec.recurrent if isinstance(spec, ModelSpec) else spec
        layers = recurrent.layers
        ls = layers[layer] if 0 <= layer < len(layers) else None
        if ls is None or name not in ls.row_sizes:
            raise StateError(block.field, f"layer {layer} has no recurrent state tensor {name!r} in this spec")
        return ls.shard_index(rank, world)[name], ls.row_sizes[name]
    kind, il = block.key
    att = spec.attention.get(il) if isinstance(spec, ModelSpec) else None
    if att is None:
        raise StateError(block.field, f"layer {il} is not an attention layer of this spec")
    return att.shard_index(rank, world)[kind], att.n_embd_k if kind == "k" else att.n_embd_v


def _parse_all(blob: Any) -> tuple[int, tuple[int, int] | None, list[Section]]:
    flags, shard, sections = _split_blob(blob)
    planes = bool(flags & StateFlags.WITH_PLANES)
    return flags, shard, [parse_section(tag, payload, planes) for tag, payload in sections]


def gather_state(blobs: Sequence[Any], spec: MemorySpec | ModelSpec) -> bytes:
    """One blob for the unsharded memory of ``spec`` from the blobs of ranks ``0 .. t-1``.

    ``blobs`` come from :func:`save_shard` (or each rank's ``state_write``, in rank
    order) of the same sequence (or whole memory) with the same flags.  Raises
    :class:`StateError` naming the section and field when the ranks' metadata
    differ, a replicated part differs, or a row does not fit the spec.
    """
    world = len(blobs)
    if world < 1:
        raise StateError("blobs", "no blob to gather")
    spec.shard(0, world)
    parsed = [_parse_all(b) for b in blobs]
    flags0, _, secs0 = parsed[0]
    for r, (flags, shard, secs) in enumerate(parsed):
        if shard is not None and shard != (r, world):
            raise StateError("shard", f"blob {r} is rank {shard[0]} of {shard[1]}, expected rank {r} of {world}")
        if flags != flags0:
            raise StateError("flags", f"rank {r} wrote flags {flags}, rank 0 wrote {flags0}")
        tags, tags0 = [s.tag for s in secs], [s.tag for s in secs0]
        if tags != tags0:
            raise StateError("section", f"rank {r} has sections {tags}, rank 0 {tags0}")
    out = []
    for k, sec0 in enumerate(secs0):
        per_rank = [secs[k] for _, _, secs in parsed]
        _same_metadata(per_rank)
        parts: list[bytes | RowBlock] = []
        for j, part in enumerate(sec0.parts):
            if isinstance(part, RowBlock):
                blocks = [s.parts[j] for s in per_rank]
                assert all(isinstance(b, RowBlock) for b in blocks)
                parts.append(_gather_block(spec, per_rank, blocks, world))  # type: ignore[arg-type]
            else:
                parts.append(part)
        out.append((sec0.tag, Section(sec0.tag, parts, sec0.positions).payload()))
    return pack_sections(out, flags0)


def _same_metadata(per_rank: list[Section]) -> None:
    """Every rank's section has the same metadata bytes and row blocks (keys, dtypes, cells)."""
    base = per_rank[0]
    for r, sec in enumerate(per_rank[1:], 1):
        if len(sec.parts) != len(base.parts):
            raise StateError(
                f"{sec.name}.layers", f"rank {r} holds {len(sec.blocks)} row blocks, rank 0 {len(base.blocks)}"
            )
        for j, (a, b) in enumerate(zip(base.parts, sec.parts, strict=True)):
            if isinstance(a, RowBlock) and isinstance(b, RowBlock):
                if (a.key, a.type_code, a.rows.shape[0]) != (b.key, b.type_code, b.rows.shape[0]):
                    raise StateError(
                        b.field, f"rank {r} wrote {b.key} code {b.type_code}, rank 0 {a.key} code {a.type_code}"
                    )
            elif a != b:
                nxt = next((p.field for p in base.parts[j:] if isinstance(p, RowBlock)), "the end")
                raise StateError(
                    f"{sec.name}.metadata",
                    f"rank {r}'s cells, positions, owners or layers before {nxt} differ from rank 0's: "
                    "the ranks' books diverged (did every rank see the same batches and edits?)",
                )


def _gather_block(spec: MemorySpec | ModelSpec, secs: list[Section], blocks: list[RowBlock], world: int) -> RowBlock:
    b0 = blocks[0]
    item = b0.dtype.itemsize
    n = b0.rows.shape[0]
    _, full = _layout(spec, secs[0], b0, 0, world)
    out = np.empty((n, full, item), dtype=np.uint8)
    seen = np.zeros(full, dtype=bool)
    for r, block in enumerate(blocks):
        idx, _ = _layout(spec, secs[r], block, r, world)
        idx = np.arange(full) if idx is None else idx
        local = block.rows.reshape(n, -1, item)
        if local.shape[1] != idx.size:
            raise StateError(
                f"{block.field}.row_bytes",
                f"rank {r} holds {local.shape[1]} elements per row, its shard has {idx.size}",
            )
        again = seen[idx]
        if again.any() and not np.array_equal(out[:, idx[again]], local[:, again]):
            raise StateError(f"{block.field}.rows", f"rank {r}'s copy of the replicated part differs from rank 0's")
        out[:, idx] = local
        seen[idx] = True
    if not seen.all():
        raise StateError(f"{b0.field}.rows", f"{int((~seen).sum())} elements of each row are held by no rank")
    return dataclasses.replace(b0, rows=out.reshape(n, full * item))


def scatter_state(blob: Any, spec: MemorySpec | ModelSpec, world: int) -> list[bytes]:
    """The blobs of ranks ``0 .. world-1`` (each with its ``SHRD`` section) from one
    unsharded blob of ``spec``; a split the spec refuses raises ArgumentError."""
    spec.shard(0, world)  # a split the spec refuses is refused here, naming the layer and field
    flags, shard, secs = _parse_all(blob)
    if shard is not None and shard != (0, 1):
        raise StateError("shard", f"blob is rank {shard[0]} of {shard[1]}; gather the ranks' blobs first")
    out = []
    for rank in range(world):
        sections = [_shard_section(rank, world)]
        for sec in secs:
            parts: list[bytes | RowBlock] = []
            for part in sec.parts:
                if not isinstance(part, RowBlock):
                    parts.append(part)
                    continue
                idx, full = _layout(spec, sec, part, rank, world)
                if part.elements != full or part.rows.shape[1] % part.dtype.itemsize:
                    raise StateError(
                        f"{part.field}.row_bytes", f"rows of {part.elements} elements, the spec has {full}"
                    )
                if idx is not None:
                    n, item = part.rows.shape[0], part.dtype.itemsize
                    local = part.rows.reshape(n, full, item)[:, idx].reshape(n, -1)
                    part = dataclasses.replace(part, rows=local)
                parts.append(part)
            sections.append((sec.tag, Section(sec.tag, parts, sec.positions).payload()))
        out.append(pack_sections(sections, flags))
    return out


def reshard(blobs: Sequence[Any], spec: MemorySpec | ModelSpec, world: int) -> list[bytes]:
    """The blobs of ``world`` ranks from the blobs of ``len(blobs)`` ranks (2 -> 4, 2 -> 1, ...)."""
    return scatter_state(gather_state(blobs, spec), spec, world)


def save_shard(memory: Any, rank: int, world: int, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
    """``memory.state_write(seq, flags)`` of tensor-parallel rank ``rank`` of ``world``,
    marked with its rank so it restores only there."""
    mflags, sections = unpack_sections(memory.state_write(seq, flags))
    return pack_sections([_shard_section(rank, world), *((t, bytes(p)) for t, p in sections)], mflags)


def restore_shard(memory: Any, blob: Any, rank: int, world: int, seq: int = -1, flags: int = StateFlags.NONE) -> None:
    """Read a blob of :func:`save_shard` / :func:`scatter_state` into rank ``rank``'s memory.
    A blob of another rank or world size raises StateError (``field == "shard"``) and
    changes nothing; the memory's own ``state_read`` validates the rest."""
    mflags, shard, sections = _split_blob(blob)
    if shard is not None and shard != (rank, world):
        raise StateError("shard", f"blob is rank {shard[0]} of {shard[1]}, this memory is rank {rank} of {world}")
    memory.state_read(pack_sections([(t, bytes(p)) for t, p in sections], mflags), seq, flags)


# -- over a torch.distributed group ------------------------------------------------------


def gather_memory(
    memory: Any, spec: MemorySpec | ModelSpec, group: Any = None, dst: int = 0, seq: int = -1, flags: int = 0
) -> bytes | None:
    """Collective: every rank of ``group`` saves its shard; group rank ``dst`` returns
    the unsharded blob of ``spec`` (:func:`gather_state`), the others None."""
    from statecache.distributed.wire import gather_bytes, group_rank

    rank, world = group_rank(group)
    blobs = gather_bytes(save_shard(memory, rank, world, seq, flags), dst, group)
    return None if blobs is None else gather_state(blobs, spec)


def scatter_memory(
    memory: Any,
    spec: MemorySpec | ModelSpec,
    blob: Any,
    group: Any = None,
    src: int = 0,
    seq: int = -1,
    flags: int = 0,
) -> None:
    """Collective: group rank ``src`` cuts ``blob`` (an unsharded blob of ``spec``; None
    on the other ranks) into one part per rank and every rank restores its part.

    All or nothing: if any rank refuses its part (or ``src`` cannot cut the blob),
    every rank that restored its part puts back what it held, and every rank raises
    :class:`StateError`.
    """
    from statecache.distributed.wire import all_agree, group_rank, scatter_bytes

    rank, world = group_rank(group)
    parts: list[bytes] | None = None
    failure: Exception | None = None
    if rank == src:
        try:
            parts = scatter_state(blob, spec, world)
        except Exception as exc:
            failure = exc
    if not all_agree(failure is None, group):
        if failure is not None:
            raise failure
        raise StateError("blob", f"rank {src} could not cut the blob into {world} parts")
    mine = scatter_bytes(parts, src, group)
    backup = memory.state_write(seq, flags | StateFlags.WITH_PLANES)  # put back with its rollback budget
    try:
        restore_shard(memory, mine, rank, world, seq, flags)
    except Exception as exc:
        failure = exc
    if all_agree(failure is None, group):
        return
    if isinstance(failure, StateError):
        raise failure  # refused while validating: state_read changed nothing
    memory.state_read(backup, seq, flags)  # restored here, or failed after validating
    if failure is not None:
        raise failure
    raise StateError("blob", "another rank refused its part; this rank's restore was taken back")
