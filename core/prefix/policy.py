"""Eviction policies, selected by name.

A policy orders the evictable entries of one tier; the cache evicts the
first.  What evicting an entry costs a later request is the work between it
and the checkpoint a hit would fall back to (its nearest ancestor entry):
``saved`` tokens, or FLOPs when the cache is given a cost model.

* ``slru`` (the default): segmented LRU.  Routine interval checkpoints that
  no request has hit yet are on probation and go first, least recently used
  first; entries that were hit, or that mark where requests end or diverge
  (end of prompt, end of generation, junction, just before the end), are
  protected and go only when no probationary entry is left, again in LRU
  order.  Plain LRU lets a long unique prompt's routine checkpoints push out
  the end-of-turn states that the next turn of every conversation needs.
* ``lru``: plain least recently used (the baseline of the benchmarks).
* ``value``: Marconi-style utility, ``recency + alpha * efficiency``, both
  ranked to [0, 1] over the candidates: recency by last use, efficiency by
  ``saved / bytes`` (tokens or FLOPs saved per byte kept).  Evicts the lowest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from statecache.errors import ArgumentError
from statecache.prefix.tree import Entry

#: Origins whose checkpoints sit where a later request is likely to resume.
PROTECTED_ORIGINS = frozenset({"junction", "before_end", "prompt_end", "generation_end"})


class Policy(Protocol):
    name: str

    def order(self, candidates: Sequence[Entry], saved: Callable[[Entry], float]) -> list[Entry]:
        """``candidates`` in eviction order (first = evicted first)."""


class LRU:
    """Plain least recently used."""

    name = "lru"

    def order(self, candidates: Sequence[Entry], saved: Callable[[Entry], float]) -> list[Entry]:
        return sorted(candidates, key=lambda e: (e.last_use, e.created))


class SegmentedLRU:
    """Probation (routine, never hit) before protection (hit, or at a resume point); LRU within each."""

    name = "slru"

    def order(self, candidates: Sequence[Entry], saved: Callable[[Entry], float]) -> list[Entry]:
        def protected(e: Entry) -> bool:
            return e.hits > 0 or e.origin in PROTECTED_ORIGINS

        return sorted(candidates, key=lambda e: (protected(e), e.last_use, e.created))


class Value:
    """Marconi-style utility: recency rank + ``alpha`` x (saved per byte) rank."""

    name = "value"

    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = float(alpha)

    def order(self, candidates: Sequence[Entry], saved: Callable[[Entry], float]) -> list[Entry]:
        n = len(candidates)
        if n <= 1:
            return list(candidates)
        by_recency = sorted(range(n), key=lambda i: (candidates[i].last_use, candidates[i].created))
        eff = [saved(e) / max(e.nbytes, 1) for e in candidates]
        by_eff = sorted(range(n), key=lambda i: eff[i])
        rank_r = [0.0] * n
        rank_e = [0.0] * n
        for r, i in enumerate(by_recency):
            rank_r[i] = r / (n - 1)
        for r, i in enumerate(by_eff):
            rank_e[i] = r / (n - 1)
        util = [rank_r[i] + self.alpha * rank_e[i] for i in range(n)]
        return [candidates[i] for i in sorted(range(n), key=lambda i: (util[i], candidates[i].last_use))]


POLICIES: dict[str, Callable[[float], Policy]] = {
    "slru": lambda alpha: SegmentedLRU(),
    "lru": lambda alpha: LRU(),
    "value": lambda alpha: Value(alpha),
}
DEFAULT_POLICY = "slru"


def get_policy(name: str, alpha: float = 1.0) -> Policy:
    """The policy called ``name``; the error lists the known names."""
    make = POLICIES.get(name)
    if make is None:
        raise ArgumentError("policy", f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return make(alpha)
