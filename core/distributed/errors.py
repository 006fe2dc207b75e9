"""The errors of :mod:`statecache.distributed` (both name what went wrong and where)."""

from __future__ import annotations

from statecache.errors import StatecacheError


class TransferError(StatecacheError):
    """A sequence transfer failed: no or a corrupt header, a peer that died or timed
    out, a payload the receiver refused.  The receiving memory is as it was."""

    def __init__(self, peer: int, message: str) -> None:
        self.peer = peer
        super().__init__(message)


class BookDivergenceError(StatecacheError):
    """The books of tensor-parallel ranks differ: ``field`` is the first book field
    that differs, ``ranks`` the ranks whose value differs from rank 0's, ``index``
    the first cell (or sequence) where it does and ``seqs`` the sequences there."""

    def __init__(self, field: str, ranks: list[int], index: int | None, seqs: list[int], message: str) -> None:
        self.field = field
        self.ranks = ranks
        self.index = index
        self.seqs = seqs
        super().__init__(message)
