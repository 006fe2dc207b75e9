"""statecache.prefix: prefix caching of recurrent and hybrid state across requests.

Hits are exact or nothing; checkpoints go where later requests resume (chunk
ends at an interval, the end of every prompt and generation, the junction
where a prompt leaves the cached prefixes, a short distance before the end);
a device tier with a byte budget spills to a host tier; eviction policies
are chosen by name.  See ``docs/prefix-cache.md``.

The cache uses the memories' public API and the state format only; no
memory imports it.
"""

from __future__ import annotations

from statecache.errors import InvariantError
from statecache.prefix.cache import PrefixCache, PrefixConfig, PrefixMatch, Request
from statecache.prefix.check import check_invariants
from statecache.prefix.key import namespace
from statecache.prefix.metrics import Metrics, PrefixCacheNoOpWarning
from statecache.prefix.policy import DEFAULT_POLICY, POLICIES, get_policy
from statecache.prefix.pool import (
    attention_bytes_per_token,
    budget_for,
    checkpoint_bytes,
    checkpoints_in,
    reserved_ids_for,
)
from statecache.prefix.sim import SimulatedMemory
from statecache.prefix.store import CheckpointStore, Layout, ParkedStore, describe

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "CheckpointStore",
    "InvariantError",
    "Layout",
    "Metrics",
    "ParkedStore",
    "PrefixCache",
    "PrefixCacheNoOpWarning",
    "PrefixConfig",
    "PrefixMatch",
    "Request",
    "SimulatedMemory",
    "attention_bytes_per_token",
    "budget_for",
    "check_invariants",
    "checkpoint_bytes",
    "checkpoints_in",
    "describe",
    "get_policy",
    "namespace",
    "reserved_ids_for",
]
