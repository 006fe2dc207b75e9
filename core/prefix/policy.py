"""Eviction policies, selected by name.

A policy orders the evictable entries of one tier; the cache evicts the
first.  What evicting an entry costs a later request is the work between it
and the checkpoint a hit would fall back to (its nearest ancestor entry):
``saved`` tokens, or FLOPs when the cache is given a cost model
(:class:`PolicyContext`).

* ``adaptive`` (the default): expected work saved per byte, fading with
  time since last use.  An entry's chance of being used again is learned
  from the requests so far: an entry that was hit counts as certain; a fresh
  one gets the observed first-hit rate of checkpoints of its origin (end of
  generation, before the end, junction, ...), so a workload where re-sent
  conversations hit the before-end checkpoints keeps those and one where
  every turn continues the last generation keeps the ends of generation.
  An entry on a chain (its node has exactly one child: a later checkpoint of
  the same conversation lies below it) is only used by a request that
  diverges between the two, so its chance is scaled by the observed share of
  hits that landed on chain entries; without that, the states a conversation
  has moved past crowd out the ones it will resume from.  Score:
  ``p * saved / bytes / (1 + age / decay)``; the lowest goes first.
* ``value``: Marconi-style utility, ``recency + alpha * efficiency``, both
  ranked to [0, 1] over the candidates: recency by last use, efficiency by
  ``saved / bytes`` (tokens or FLOPs saved per byte kept).  Evicts the lowest.
* ``slru``: segmented LRU.  Routine interval checkpoints that no request has
  hit yet are on probation and go first, least recently used first; the
  others go only when no probationary entry is left, again in LRU order.
* ``lru``: plain least recently used (the benchmarks' baseline: routine
  checkpoints of long unique prompts push out the states the next turns need).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from statecache.errors import ArgumentError
from statecache.prefix.tree import Entry

#: Origins whose checkpoints sit where a later request is likely to resume (``slru``).
PROTECTED_ORIGINS = frozenset({"junction", "before_end", "prompt_end", "generation_end"})


class PolicyContext(Protocol):
    """What a policy may ask the cache (:class:`statecache.prefix.cache.PrefixCache` is one)."""

    @property
    def now(self) -> int:
        """The cache's clock: requests started so far (entries' ``last_use`` is on it)."""

    def saved(self, entry: Entry) -> float:
        """Work (tokens, or FLOPs under a cost model) a hit on ``entry`` saves over its ancestor entry."""

    def first_hit_rate(self, origin: str) -> float:
        """Observed share of checkpoints of ``origin`` hit at least once (Laplace-smoothed)."""

    def chain_share(self) -> float:
        """Observed share of hits on entries whose node had exactly one child (Laplace-smoothed)."""


class Policy(Protocol):
    name: str

    def order(self, candidates: Sequence[Entry], ctx: PolicyContext) -> list[Entry]:
        """``candidates`` in eviction order (first = evicted first)."""


class LRU:
    """Plain least recently used."""

    name = "lru"

    def order(self, candidates: Sequence[Entry], ctx: PolicyContext) -> list[Entry]:
        return sorted(candidates, key=lambda e: (e.last_use, e.created))


class SegmentedLRU:
    """Probation (routine, never hit) before the rest; LRU within each."""

    name = "slru"

    def order(self, candidates: Sequence[Entry], ctx: PolicyContext) -> list[Entry]:
        def protected(e: Entry) -> bool:
            return e.hits > 0 or e.origin in PROTECTED_ORIGINS

        return sorted(candidates, key=lambda e: (protected(e), e.last_use, e.created))


class Value:
    """Marconi-style utility: recency rank + ``alpha`` x (saved per byte) rank."""

    name = "value"

    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = float(alpha)

    def order(self, candidates: Sequence[Entry], ctx: PolicyContext) -> list[Entry]:
        n = len(candidates)
        if n <= 1:
            return list(candidates)
        by_recency = sorted(range(n), key=lambda i: (candidates[i].last_use, candidates[i].created))
        eff = [ctx.saved(e) / max(e.nbytes, 1) for e in candidates]
        by_eff = sorted(range(n), key=lambda i: eff[i])
        rank_r = [0.0] * n
        rank_e = [0.0] * n
        for r, i in enumerate(by_recency):
            rank_r[i] = r / (n - 1)
        for r, i in enumerate(by_eff):
            rank_e[i] = r / (n - 1)
        util = [rank_r[i] + self.alpha * rank_e[i] for i in range(n)]
        return [candidates[i] for i in sorted(range(n), key=lambda i: (util[i], candidates[i].last_use))]


class Adaptive:
    """Learned reuse chance x saved work per byte, fading with age (module docstring)."""

    name = "adaptive"

    def __init__(self, decay: float = 2.0) -> None:
        self.decay = float(decay)

    def score(self, e: Entry, ctx: PolicyContext, chain: float) -> float:
        p = 1.0 if e.hits else ctx.first_hit_rate(e.origin)
        if len(e.node.children) == 1:
            p *= chain
        age = max(ctx.now - e.last_use, 0)
        return p * ctx.saved(e) / max(e.nbytes, 1) / (1.0 + age / self.decay)

    def order(self, candidates: Sequence[Entry], ctx: PolicyContext) -> list[Entry]:
        chain = ctx.chain_share()
        return sorted(candidates, key=lambda e: (self.score(e, ctx, chain), e.last_use, e.created))


#: name -> factory(alpha of ``value``, decay of ``adaptive``)
POLICIES: dict[str, Callable[[float, float], Policy]] = {
    "adaptive": lambda alpha, decay: Adaptive(decay),
    "value": lambda alpha, decay: Value(alpha),
    "slru": lambda alpha, decay: SegmentedLRU(),
    "lru": lambda alpha, decay: LRU(),
}
DEFAULT_POLICY = "adaptive"


def get_policy(name: str, alpha: float = 1.0, decay: float = 2.0) -> Policy:
    """The policy called ``name``; the error lists the known names."""
    make = POLICIES.get(name)
    if make is None:
        raise ArgumentError("policy", f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    if alpha < 0 or decay <= 0:
        raise ArgumentError("policy", f"needs alpha >= 0 and decay > 0, got alpha={alpha}, decay={decay}")
    return make(alpha, decay)
