"""Counters of the prefix cache, and the warning that it cannot help.

Counters only grow (except the resident figures, which the tiers own and
:meth:`statecache.prefix.cache.PrefixCache.stats` reads at the time of the
call).  ``prompt_tokens = hit_tokens + recomputed_tokens`` over every started
request.
"""

from __future__ import annotations

import dataclasses

from statecache.errors import StatecacheWarning


class PrefixCacheNoOpWarning(StatecacheWarning):
    """The configuration makes the prefix cache unable to reuse anything for this
    model or these requests (issued once per cache)."""


@dataclasses.dataclass
class Metrics:
    queries: int = 0
    hits: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    #: checkpoints taken, by origin (interval, junction, before_end, prompt_end, generation_end, loaded)
    checkpoints: dict[str, int] = dataclasses.field(default_factory=dict)
    #: checkpoints hit at least once, by origin (with ``checkpoints``: which kinds pay off here)
    reused: dict[str, int] = dataclasses.field(default_factory=dict)
    #: hits by the shape of the entry's node then: ``leaf`` (no child), ``chain`` (one), ``branch`` (more)
    hit_shapes: dict[str, int] = dataclasses.field(default_factory=dict)
    #: a planned checkpoint that no tier had room for (every resident entry pinned or too big)
    captures_skipped: int = 0
    #: a planned checkpoint already present (same tokens, same namespace): touched instead
    captures_present: int = 0
    evictions_device: int = 0
    evictions_host: int = 0
    #: device -> host moves (a demotion) and host -> device moves (a promotion on hit or load)
    demotions: int = 0
    promotions: int = 0
    #: device entries found dropped by someone else (seq_keep, clear) and host blobs the memory refused
    lost: int = 0

    def count_checkpoint(self, origin: str) -> None:
        self.checkpoints[origin] = self.checkpoints.get(origin, 0) + 1

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["checkpoints_total"] = sum(self.checkpoints.values())
        return out
