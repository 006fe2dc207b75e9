"""A pool-free memory for tests and the benchmark's counting mode.

:class:`SimulatedMemory` answers the public calls the prefix cache makes
(``seq_cp``, ``seq_rm``, ``seq_pos_max``, ``state_write``/``state_read``,
``seq_keep``, ``clear``) over a book of plain token tuples: the "state" of a
sequence is the list of tokens it absorbed, which is exactly what an exact
state is a function of.  So a test can check that a hit restored the right
state by comparing tuples, and the benchmark can count recomputed tokens over
thousands of requests in seconds, with the real cache, tree and policies.

Blobs are real state-format blobs (a ``SIMT`` section: layout name, tokens),
padded to the size the modelled memory would write, so the host tier's byte
accounting matches the modelled model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from statecache.errors import ArgumentError, StateError
from statecache.memory import StateFlags
from statecache.prefix.store import Layout
from statecache.state_io import Reader, Writer, find_section, pack_sections, unpack_sections

TAG_SIM = b"SIMT"


class SimulatedMemory:
    """Token-tuple "states" for ``n_seq_max`` sequences.

    :param kind: ``"recurrent"`` or ``"hybrid"`` (which parts a lookup reports).
    :param checkpoint_bytes: modelled bytes of one recurrent state.
    :param attention_bytes_per_token: modelled K/V bytes per token (hybrid).
    """

    def __init__(
        self,
        n_seq_max: int,
        kind: str = "hybrid",
        checkpoint_bytes: int = 4096,
        attention_bytes_per_token: int = 256,
    ) -> None:
        if kind not in ("recurrent", "hybrid"):
            raise ArgumentError("kind", f"must be 'recurrent' or 'hybrid', got {kind!r}")
        if not 1 <= n_seq_max <= 1 << 16:
            raise ArgumentError("n_seq_max", f"must be in [1, 65536], got {n_seq_max}")
        self.n_seq_max = int(n_seq_max)
        self.kind = kind
        self.checkpoint_bytes = int(checkpoint_bytes)
        self.attention_bytes_per_token = int(attention_bytes_per_token) if kind == "hybrid" else 0
        self.seqs: dict[int, tuple[int, ...]] = {}
        #: tokens absorbed through :meth:`absorb` (the work a runtime did)
        self.computed = 0

    def prefix_layout(self) -> Layout:
        parts = ("attention", "recurrent") if self.kind == "hybrid" else ("recurrent",)
        name = f"simulated-{self.kind}/{self.checkpoint_bytes}/{self.attention_bytes_per_token}"
        return Layout(
            f"simulated-{self.kind}", parts, self.checkpoint_bytes, self.attention_bytes_per_token, name, False
        )

    def _check(self, seq: int, name: str = "seq") -> None:
        if not 0 <= seq < self.n_seq_max:
            raise ArgumentError(name, f"sequence {seq} outside [0, n_seq_max={self.n_seq_max})")

    # -- what a runtime does ----------------------------------------------------------
    def absorb(self, seq: int, tokens: Sequence[int]) -> None:
        """The runtime computed ``tokens`` for ``seq``."""
        self._check(seq)
        self.seqs[seq] = self.seqs.get(seq, ()) + tuple(int(t) for t in tokens)
        self.computed += len(tokens)

    def history(self, seq: int) -> tuple[int, ...]:
        return self.seqs.get(seq, ())

    # -- the public memory calls the cache uses ---------------------------------------
    def seq_pos_max(self, seq: int) -> int:
        return len(self.seqs.get(seq, ())) - 1

    def seq_pos_min(self, seq: int) -> int:
        return 0 if self.seqs.get(seq) else -1

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._check(src, "src")
        self._check(dst, "dst")
        if src == dst:
            return
        if src in self.seqs:
            self.seqs[dst] = self.seqs[src]
        else:
            self.seqs.pop(dst, None)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        if seq < 0:
            self.seqs.clear()
            return True
        self._check(seq)
        p0 = max(p0, 0)
        toks = self.seqs.get(seq, ())
        if p0 == 0 and (p1 < 0 or p1 >= len(toks)):
            self.seqs.pop(seq, None)
        elif p1 < 0 or p1 >= len(toks):
            self.seqs[seq] = toks[:p0]
        return True

    def seq_keep(self, seq: int) -> None:
        self.seqs = {seq: self.seqs[seq]} if seq in self.seqs else {}

    def clear(self, data: bool = True) -> None:
        self.seqs.clear()

    def state_write(self, seq: int = -1, flags: int = StateFlags.NONE) -> bytes:
        self._check(seq)
        toks = self.seqs.get(seq, ())
        w = Writer()
        w.name(self.prefix_layout().fingerprint)
        w.u32(len(toks))
        for t in toks:
            w.u32(t)
        modelled = self.checkpoint_bytes + self.attention_bytes_per_token * len(toks)
        w.u64(max(modelled - 4 * len(toks), 0))
        w.raw(bytes(max(modelled - 4 * len(toks), 0)))
        return pack_sections([(TAG_SIM, w.getvalue())], flags)

    def state_read(self, data: Any, seq: int = -1, flags: int = StateFlags.NONE) -> None:
        self._check(seq)
        _, sections = unpack_sections(data)
        r = Reader(find_section(sections, TAG_SIM), "simulated")
        r.expect("layout", r.name("layout"), self.prefix_layout().fingerprint)
        n = r.u32("n_tokens")
        toks = tuple(r.u32("token") for _ in range(n))
        r.raw(r.u64("padding_bytes"), "padding")
        r.at_end()
        if not toks:
            raise StateError("n_tokens", "a simulated checkpoint holds at least one token")
        self.seqs[seq] = toks
