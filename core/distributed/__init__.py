"""statecache beyond one process: tensor-parallel state pools and sequence transfer.

Over ``torch.distributed`` (gloo for host memory, NCCL for CUDA), imported
only when a function communicates: importing this package needs no torch.

* Tensor parallelism: :meth:`MemorySpec.shard` / :meth:`ModelSpec.shard` give
  the spec of rank ``r`` of ``t`` (whole heads per rank); each rank builds its
  memory from it and feeds it the same batches and edits, so the books agree.
  :func:`check_books` / :class:`BookCheck` prove it at run time;
  :func:`save_shard`, :func:`gather_state`, :func:`scatter_state`,
  :func:`reshard`, :func:`gather_memory`, :func:`scatter_memory` move
  checkpoints between tensor-parallel degrees.
* Disaggregated serving: :func:`send_sequence` / :func:`recv_sequence` move
  one sequence's whole state between two instances' memories.

docs/distributed.md shows how a runtime wires both, and the limits.
"""

from __future__ import annotations

from statecache.distributed.books import BookCheck, BookField, book_digest, book_fields, check_books, first_divergence
from statecache.distributed.checkpoint import (
    gather_memory,
    gather_state,
    reshard,
    restore_shard,
    save_shard,
    scatter_memory,
    scatter_state,
)
from statecache.distributed.errors import BookDivergenceError, TransferError
from statecache.distributed.transfer import Transfer, recv_sequence, send_sequence

__all__ = [
    "BookCheck",
    "BookDivergenceError",
    "BookField",
    "Transfer",
    "TransferError",
    "book_digest",
    "book_fields",
    "check_books",
    "first_divergence",
    "gather_memory",
    "gather_state",
    "recv_sequence",
    "reshard",
    "restore_shard",
    "save_shard",
    "scatter_memory",
    "scatter_state",
    "send_sequence",
]
