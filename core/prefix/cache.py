"""The prefix cache: exact reuse of recurrent and hybrid state across requests.

A runtime keeps one :class:`PrefixCache` per memory and tells it three things
about every request: that it starts (:meth:`PrefixCache.start`: the cache
looks the prompt up, puts the sequence at the longest exact hit, and plans
where to split the prefill and checkpoint), that the sequence has absorbed
the prompt up to a piece end (:meth:`PrefixCache.reached`: the cache takes a
checkpoint when one is planned there), and that it is done
(:meth:`PrefixCache.finish`: the end-of-generation checkpoint)::

    cache = PrefixCache(memory, reserved=range(8, 40), config=PrefixConfig(chunk=512))
    req = cache.start(seq, prompt)              # seq now holds the state after req.resume tokens
    prev = req.resume
    for end in req.pieces:                      # the runtime's chunks, split where checkpoints go
        run(seq, prompt[prev:end]); prev = end  # any batch, with other requests' pieces
        cache.reached(req, end)
    ...generate (speculative rollback is fine)...
    cache.finish(req, generated)                # the tokens the state absorbed after the prompt

Hits are exact or nothing: a hit of length ``p`` means every part of the
memory resumes at exactly ``p`` (the recurrent state and sliding-window cells
come from a checkpoint taken after exactly ``p`` tokens, the attention and
indexer cells hold positions ``0 .. p-1``), ``p`` is the largest such length,
and at least one prompt token is always left to compute (a runtime needs the
logits of the last one).  Nothing the cache stores changes when a live
sequence writes: see :mod:`statecache.prefix.store`.

The sequence ids in ``reserved`` belong to the cache: a runtime must not
decode into them or edit them.  A runtime's ``seq_keep``/``clear`` still
drops them; the cache notices at the next use (the entry is counted ``lost``
and the hit shrinks), it never restores a state it does not hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from statecache.errors import ArgumentError, StateError
from statecache.prefix.key import ExtraKey, check_tokens, namespace
from statecache.prefix.metrics import Metrics, PrefixCacheNoOpWarning
from statecache.prefix.policy import DEFAULT_POLICY, get_policy
from statecache.prefix.pool import UNLIMITED, Tier
from statecache.prefix.store import CheckpointStore, Layout, ParkedStore, describe
from statecache.prefix.tree import ORIGINS, Entry, Node, Tree, Walk
from statecache.state_io import Reader, Writer, find_section, pack_sections, unpack_sections

#: Version of the cache file (its sections live inside a state-format blob).
FILE_VERSION = 1
_TAG_HEAD, _TAG_ENTRIES, _TAG_CHECK = b"PXHD", b"PXEN", b"PXCK"


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """Where checkpoints go and how much memory they may take.

    :param chunk: the prefill chunk (ubatch) the runtime runs; pieces end at
        multiples of it, so routine checkpoints cost no extra pass.
    :param interval: routine checkpoints at multiples of this many tokens (a
        multiple of ``chunk``; 0: none).
    :param before_end: a checkpoint this many tokens before the end of every
        prompt (clients re-send a conversation with its last tokens changed;
        0: none).
    :param junction: checkpoint where a prompt leaves the cached prefixes, so
        the next request sharing that prefix hits it fully.
    :param end_of_prompt: checkpoint after every prompt.
    :param end_of_generation: checkpoint after every generation.
    :param device_budget: bytes of device checkpoints (None: as many as the
        reserved sequence ids hold).
    :param host_budget: bytes of host-tier blobs (0: no host tier).
    :param attention_budget: attention cells (tokens) the cache may keep on the
        device through its checkpoints (None: no limit beyond the memory's).
    :param policy: eviction policy name (:mod:`statecache.prefix.policy`).
    :param value_alpha: weight of efficiency against recency in ``value``.
    :param decay: how fast ``adaptive`` forgets an unused entry, in requests.
    :param flops_per_token: cost model of the ``value`` policy: FLOPs of one
        token independent of the context (0 with ``flops_per_attended`` 0:
        count tokens instead).
    :param flops_per_attended: FLOPs per (token, earlier token) pair of the
        attention layers.
    :param salt: cache-wide namespace salt.
    """

    chunk: int = 512
    interval: int = 2048
    before_end: int = 32
    junction: bool = True
    end_of_prompt: bool = True
    end_of_generation: bool = True
    device_budget: int | None = None
    host_budget: int = 0
    attention_budget: int | None = None
    policy: str = DEFAULT_POLICY
    value_alpha: float = 1.0
    decay: float = 2.0
    flops_per_token: float = 0.0
    flops_per_attended: float = 0.0
    salt: bytes = b""

    def __post_init__(self) -> None:
        for name in ("chunk", "interval", "before_end"):  # token counts: 4.5 would shift the piece grid
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise ArgumentError(name, f"must be a whole number of tokens, got {v!r}")
        if self.chunk < 1:
            raise ArgumentError("chunk", f"must be >= 1, got {self.chunk}")
        if self.interval < 0 or self.interval % self.chunk:
            raise ArgumentError(
                "interval", f"must be 0 or a multiple of chunk={self.chunk} (checkpoints ride on chunk ends), "
                f"got {self.interval}"
            )  # fmt: skip
        for name in ("before_end", "host_budget"):
            if getattr(self, name) < 0:
                raise ArgumentError(name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("device_budget", "attention_budget"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ArgumentError(name, f"must be >= 0 or None, got {v}")
        if self.flops_per_token < 0 or self.flops_per_attended < 0:
            raise ArgumentError("flops_per_token", "FLOP costs must be >= 0")
        get_policy(self.policy, self.value_alpha, self.decay)


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The answer of a lookup (nothing changed to compute it).

    ``length``: tokens every part can resume from exactly (0: miss); at most
    ``len(prompt) - 1``.  ``matched``: tokens of the prompt the index knows (a
    junction checkpoint goes there when it is beyond ``length``).  ``tier``:
    where the state at ``length`` lives (``"device"``, ``"host"``, None on a
    miss).  ``parts``: what each part of the memory could reuse on its own
    (``attention``/``indexer``: cells held; ``recurrent``/``swa``: the deepest
    checkpoint), so a caller sees why the hit is what it is.
    """

    length: int
    matched: int
    tier: str | None
    parts: tuple[tuple[str, int], ...]

    def part(self, name: str) -> int:
        for k, v in self.parts:
            if k == name:
                return v
        raise ArgumentError("name", f"no part {name!r}; parts: {', '.join(k for k, _ in self.parts)}")


class Request:
    """A request in flight: where its sequence resumed, and its plan.

    ``resume``: tokens restored from the cache (the first position to
    compute).  ``pieces``: ascending ends of the prefill pieces (chunk
    multiples plus the planned checkpoints; the last is ``len(prompt)``).
    ``checkpoints``: planned checkpoint position -> origin.
    """

    def __init__(
        self, cache: PrefixCache, seq: int, prompt: tuple[int, ...], ns: bytes, match: PrefixMatch, resume: int
    ) -> None:
        self._cache = cache
        self.seq = seq
        self.prompt = prompt
        self.namespace = ns
        self.match = match
        self.resume = resume
        self.checkpoints: dict[int, str] = {}
        self.pieces: tuple[int, ...] = ()
        self.pinned: Entry | None = None
        self.done = False

    def __repr__(self) -> str:
        return (
            f"Request(seq={self.seq}, prompt={len(self.prompt)} tokens, resume={self.resume}, "
            f"checkpoints={sorted(self.checkpoints)})"
        )


class PrefixCache:
    """Prefix caching of a memory's state across requests (module docstring).

    :param memory: a recurrent, hybrid, hybrid-iSWA or hybrid-idx memory
        (attention unified), or anything :func:`statecache.prefix.store.describe`
        accepts.
    :param reserved: sequence ids the cache may park checkpoints under
        (empty, never used by the runtime).
    :param config: :class:`PrefixConfig`.
    :param store: another :class:`~statecache.prefix.store.CheckpointStore`
        (default: :class:`~statecache.prefix.store.ParkedStore`).
    """

    def __init__(
        self,
        memory: Any,
        reserved: Iterable[int] = (),
        config: PrefixConfig | None = None,
        *,
        store: CheckpointStore | None = None,
    ) -> None:
        self.config = config = config if config is not None else PrefixConfig()
        self.layout: Layout = describe(memory)
        self.memory = memory
        res = tuple(reserved)
        odd = [r for r in res if isinstance(r, bool) or not isinstance(r, int | np.integer)]
        if odd:  # int() would truncate 2.5 to 2, silently reserving a sequence the runtime may use
            raise ArgumentError("reserved", f"sequence ids must be integers, got {odd}")
        res = tuple(int(r) for r in res)
        n_seq_max = int(memory.n_seq_max)
        if len(set(res)) != len(res):
            raise ArgumentError("reserved", f"duplicate sequence ids in {res}")
        bad = [r for r in res if not 0 <= r < n_seq_max]
        if bad:
            raise ArgumentError("reserved", f"sequence ids {bad} outside [0, n_seq_max={n_seq_max})")
        busy = [r for r in res if memory.seq_pos_max(r) >= 0]
        if busy:
            raise ArgumentError("reserved", f"sequences {busy} hold state; the cache needs empty ones")
        self.reserved = frozenset(res)
        self.store: CheckpointStore = store if store is not None else ParkedStore(memory, res)
        self.policy = get_policy(config.policy, config.value_alpha, config.decay)
        self.tree = Tree()
        dev_budget = UNLIMITED if config.device_budget is None else config.device_budget
        self.device = Tier("device", dev_budget)
        self.host = Tier("host", config.host_budget)
        self.metrics = Metrics()
        self._active: dict[int, Request] = {}
        #: requests started (the clock of last_use and of the policies' ages)
        self._clock = 0
        #: checkpoints created (orders entries taken within one request)
        self._serial = 0
        self._warned = False
        self._warn_static()

    # -- warnings -------------------------------------------------------------------
    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"the prefix cache cannot reuse anything: {why}", PrefixCacheNoOpWarning, stacklevel=3)

    def _device_capacity(self) -> int:
        if not self.reserved:
            return 0
        return min(len(self.reserved), self.device.budget // max(self.layout.checkpoint_bytes, 1))

    def _warn_static(self) -> None:
        c = self.config
        if self._device_capacity() == 0 and self.host.budget < self.layout.checkpoint_bytes:
            self._warn(
                f"no device checkpoint fits ({len(self.reserved)} reserved ids, device budget {c.device_budget}) "
                f"and the host budget ({c.host_budget} bytes) is below one checkpoint "
                f"({self.layout.checkpoint_bytes} bytes)"
            )
        elif not (c.interval or c.before_end or c.end_of_prompt or c.end_of_generation):
            self._warn("interval, before_end, end_of_prompt and end_of_generation are all off")

    # -- lookup -----------------------------------------------------------------------
    def _ns(self, extra: ExtraKey) -> bytes:
        return namespace(self.layout.fingerprint, extra, self.config.salt)

    @staticmethod
    def _candidates(walk: Walk, n: int) -> list[Entry]:
        """Entries on the matched path a prompt of ``n`` tokens can resume from, deepest first."""
        out = [node.entry for node in walk.nodes if node.entry is not None and node.entry.length <= n - 1]
        return out[::-1]

    @staticmethod
    def _held_cover(walk: Walk) -> int:
        """Tokens of the walked prefix whose attention cells some device entry holds (P4)."""
        if walk.partial is not None and walk.partial.held > 0:
            return walk.matched
        for node in reversed(walk.nodes):
            if node.held > 0:
                return node.depth
        return 0

    def _match(self, walk: Walk, n: int) -> PrefixMatch:
        cands = self._candidates(walk, n)
        best = cands[0] if cands else None
        length = best.length if best is not None else 0
        deepest_host = max((e.length for e in cands if e.host_blob is not None), default=0)
        attn = min(max(self._held_cover(walk), deepest_host), n - 1) if n else 0
        parts = []
        for part in self.layout.parts:
            parts.append((part, attn if part in ("attention", "indexer") else length))
        return PrefixMatch(length, walk.matched, best.tier if best is not None else None, tuple(parts))

    def match(self, prompt: Sequence[int], extra: ExtraKey = None) -> PrefixMatch:
        """Look ``prompt`` up; changes nothing (not even the counters)."""
        tokens = check_tokens(prompt, "prompt")
        return self._match(self.tree.walk(self._ns(extra), tokens), len(tokens))

    # -- requests ---------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _stamp(self, entry: Entry) -> None:
        self._serial += 1
        entry.last_use = self._clock
        entry.created = self._serial

    def _check_seq(self, seq: int) -> None:
        if not isinstance(seq, int) or not 0 <= seq < int(self.memory.n_seq_max):
            raise ArgumentError("seq", f"{seq!r} is not a sequence id in [0, n_seq_max={self.memory.n_seq_max})")
        if seq in self.reserved:
            raise ArgumentError("seq", f"sequence {seq} is reserved for the prefix cache's checkpoints")

    def start(self, seq: int, prompt: Sequence[int], extra: ExtraKey = None) -> Request:
        """Begin a request: put ``seq`` at the longest exact hit and plan the prefill.

        Whatever ``seq`` held is replaced: on a hit it holds exactly the state
        after ``request.resume`` prompt tokens, on a miss it is empty.  The
        entry it resumed from is pinned until :meth:`finish` / :meth:`cancel`.

        :raises ArgumentError: empty prompt, reserved or busy ``seq``, bad
            ``extra`` (nothing changed).
        """
        self._check_seq(seq)
        if seq in self._active:
            raise ArgumentError("seq", f"sequence {seq} already runs a request; finish or cancel it first")
        tokens = check_tokens(prompt, "prompt")
        n = len(tokens)
        if n == 0:
            raise ArgumentError("prompt", "is empty: a request computes at least one token")
        ns = self._ns(extra)
        walk = self.tree.walk(ns, tokens)
        m = self._match(walk, n)
        now = self._tick()
        hit: Entry | None = None
        for entry in self._candidates(walk, n):
            if self._restore(entry, seq):
                hit = entry
                break
        if hit is None:
            self.memory.seq_rm(seq, -1, -1)
        resume = hit.length if hit is not None else 0
        if hit is not None and (hit.length != m.length or hit.tier != m.tier):
            # a deeper entry was lost on the way: the answer is what was restored
            m = dataclasses.replace(m, length=hit.length, tier=hit.tier)
        req = Request(self, seq, tokens, ns, m, resume)
        met = self.metrics
        met.queries += 1
        met.prompt_tokens += n
        met.recomputed_tokens += n - resume
        if hit is not None:
            met.hits += 1
            met.hit_tokens += resume
            if hit.hits == 0:
                met.reused[hit.origin] = met.reused.get(hit.origin, 0) + 1
            k = len(hit.node.children)
            shape = "leaf" if k == 0 else "chain" if k == 1 else "branch"
            met.hit_shapes[shape] = met.hit_shapes.get(shape, 0) + 1
            hit.hits += 1
            hit.last_use = now
            self._pin(hit, +1)  # before the promotion, so making device room cannot evict it
            req.pinned = hit
            if hit.host_blob is not None:
                self._promote(hit, seq)
        self._plan(req, walk.matched)
        self._active[seq] = req
        return req

    def _restore(self, entry: Entry, seq: int) -> bool:
        """Put ``seq`` at ``entry``; False (entry dropped, nothing else changed) if the
        memory no longer holds it or refuses its blob."""
        L = entry.length
        if entry.device_seq is not None:
            if not self.store.alive(entry.device_seq, L):
                self.metrics.lost += 1
                self._drop(entry)
                return False
            self.store.restore(entry.device_seq, seq, L)
            if self.memory.seq_pos_max(seq) != L - 1:  # a memory broke its seq_cp contract: never continue wrong
                raise StateError("restore", f"sequence {seq} is at {self.memory.seq_pos_max(seq)} after restoring {L}")
            return True
        assert entry.host_blob is not None
        try:
            self.store.restore_blob(entry.host_blob, seq, L)
        except StateError:
            self.metrics.lost += 1
            self._drop(entry)
            return False
        return True

    def _plan(self, req: Request, matched: int) -> None:
        c, n, r = self.config, len(req.prompt), req.resume
        plan: dict[int, str] = {}
        if c.interval:
            for p in range((r // c.interval + 1) * c.interval, n + 1, c.interval):
                plan[p] = "interval"
        if c.before_end and n - c.before_end > r:
            plan[n - c.before_end] = "before_end"
        if c.junction and r < matched < n:
            plan[matched] = "junction"
        if c.end_of_prompt:
            plan[n] = "prompt_end"
        req.checkpoints = plan
        ends = set(range((r // c.chunk + 1) * c.chunk, n, c.chunk)) | set(plan) | {n}
        req.pieces = tuple(sorted(ends))
        never = not (c.end_of_prompt or c.end_of_generation or 0 < c.before_end < n or 0 < c.interval <= n)
        if never:  # not this request only: no request of this length can ever leave a checkpoint
            self._warn(
                f"a {n}-token prompt never gets a checkpoint (interval {c.interval}, before_end {c.before_end}, "
                "end_of_prompt and end_of_generation off)"
            )

    def _check_request(self, req: Request) -> None:
        if not isinstance(req, Request) or req._cache is not self:
            raise ArgumentError("request", "is not a request of this cache")
        if req.done:
            raise ArgumentError("request", f"the request of sequence {req.seq} is finished")

    def _check_at(self, req: Request, n_tokens: int, argument: str) -> None:
        pos = self.memory.seq_pos_max(req.seq)
        if pos != n_tokens - 1:
            raise ArgumentError(
                argument, f"sequence {req.seq} is at position {pos}, expected {n_tokens - 1} (run the tokens first)"
            )

    def reached(self, req: Request, end: int) -> bool:
        """``req``'s sequence has absorbed the prompt up to ``end`` (a piece end).

        Takes the checkpoint planned there, if any; returns whether one was
        taken.  Call it after the compute of the batch holding that piece.

        :raises ArgumentError: ``end`` is not a piece end, or the sequence is not
            at ``end`` (nothing changed).
        """
        self._check_request(req)
        if end not in req.pieces:
            raise ArgumentError("end", f"{end} is not a piece end of this request ({list(req.pieces)})")
        self._check_at(req, end, "end")
        origin = req.checkpoints.get(end)
        if origin is None:
            return False
        return self._capture(req.seq, req.namespace, req.prompt[:end], origin)

    def checkpoint(self, req: Request, generated: Sequence[int] = (), origin: str = "interval") -> bool:
        """Take a checkpoint now, after the prompt and ``generated`` (e.g. at an
        interval boundary during a long generation); returns whether one was taken.

        :raises ArgumentError: the sequence is not after ``prompt + generated``, or
            ``origin`` is not a checkpoint origin (nothing changed).
        """
        self._check_request(req)
        if origin not in ORIGINS or origin == "loaded":
            raise ArgumentError("origin", f"{origin!r} is not one of {', '.join(o for o in ORIGINS if o != 'loaded')}")
        total = req.prompt + check_tokens(generated, "generated")
        self._check_at(req, len(total), "generated")
        return self._capture(req.seq, req.namespace, total, origin)

    def finish(self, req: Request, generated: Sequence[int] = ()) -> bool:
        """The request is done; ``generated``: the tokens its state absorbed after the
        prompt (empty: none).  Takes the end-of-generation checkpoint and unpins.

        :raises ArgumentError: the sequence is not after ``prompt + generated``
            (nothing changed; the request stays open).
        """
        self._check_request(req)
        gen = check_tokens(generated, "generated")
        taken = False
        if gen and self.config.end_of_generation:
            total = req.prompt + gen
            self._check_at(req, len(total), "generated")
            taken = self._capture(req.seq, req.namespace, total, "generation_end")
        self.cancel(req)
        return taken

    def cancel(self, req: Request) -> None:
        """Drop the request without a checkpoint (its sequence is left as it is)."""
        self._check_request(req)
        if req.pinned is not None and req.pinned.node.entry is req.pinned:
            self._pin(req.pinned, -1)
        req.pinned = None
        req.done = True
        self._active.pop(req.seq, None)

    # -- tiers ------------------------------------------------------------------------
    def _tier(self, entry: Entry) -> Tier:
        return self.device if entry.device_seq is not None else self.host

    def _pin(self, entry: Entry, step: int) -> None:
        before = entry.pins
        entry.pins += step
        self._tier(entry).pin_step(entry.nbytes, before, entry.pins)

    # -- what the policies may ask (statecache.prefix.policy.PolicyContext) ----------------
    @property
    def now(self) -> int:
        return self._clock

    def first_hit_rate(self, origin: str) -> float:
        m = self.metrics
        return (m.reused.get(origin, 0) + 1) / (m.checkpoints.get(origin, 0) + 2)

    def chain_share(self) -> float:
        h = self.metrics.hit_shapes
        return (h.get("chain", 0) + 1) / (sum(h.values()) + 2)

    def saved(self, entry: Entry) -> float:
        """What evicting ``entry`` costs a later hit: the work back to its nearest ancestor entry."""
        anc = self.tree.ancestor_entry(entry.node)
        a, b = (anc.length if anc is not None else 0), entry.length
        c = self.config
        if not (c.flops_per_token or c.flops_per_attended):
            return float(b - a)
        return c.flops_per_token * (b - a) + c.flops_per_attended * (b * (b - 1) - a * (a - 1)) / 2

    def _evictable(self, tier: str, exclude: Entry | None = None) -> list[Entry]:
        out = [e for e in self.tree.entries() if e.pins == 0 and e.tier == tier and e is not exclude]
        return self.policy.order(out, self)

    def _drop(self, entry: Entry) -> None:
        if entry.device_seq is not None:
            self.store.release(entry.device_seq)
            self.device.release(entry.nbytes, entry.pins > 0)
        else:
            self.host.release(entry.nbytes, entry.pins > 0)
        ns = self._namespace_of(entry.node)
        self.tree.detach(entry)
        if ns is not None:
            self.tree.drop_namespace_if_empty(ns)

    def _namespace_of(self, node: Node) -> bytes | None:
        top = node
        while top.parent is not None:
            top = top.parent
        for ns, root in self.tree.roots.items():
            if root is top:
                return ns
        return None

    def _demote(self, entry: Entry) -> None:
        """Move a device entry to the host tier, or drop it when the host tier has no room for it."""
        assert entry.device_seq is not None and entry.pins == 0
        self.metrics.evictions_device += 1
        if not self.store.alive(entry.device_seq, entry.length):
            self.metrics.lost += 1
            self._drop(entry)
            return
        if self.host.budget < self.layout.checkpoint_bytes:
            self._drop(entry)
            return
        try:
            blob = self.store.export(entry.device_seq)
        except StateError:  # e.g. the memory has pending K shifts: keeping it would need an update first
            self._drop(entry)
            return
        if not self._host_room(len(blob), entry):
            self._drop(entry)
            return
        handle = entry.device_seq
        self.tree.hold(entry.node, -1)
        self.device.release(entry.nbytes, False)
        self.store.release(handle)
        entry.device_seq = None
        entry.host_blob = blob
        entry.nbytes = len(blob)
        self.host.admit(entry.nbytes, False)
        self.metrics.demotions += 1

    def _host_room(self, nbytes: int, newcomer: Entry | None) -> bool:
        """Evict host entries, in policy order, until ``nbytes`` fit; when the newcomer
        itself would be evicted first, evict nothing and say no."""
        if nbytes > self.host.budget:
            return False
        if self.host.fits(nbytes):
            return True
        victims = self._evictable("host")
        if newcomer is not None:
            order = self.policy.order([*victims, newcomer], self)
            freed = 0
            for v in order:
                if v is newcomer:
                    return False
                freed += v.nbytes
                if self.host.room + freed >= nbytes:
                    break
        for v in victims:
            if self.host.fits(nbytes):
                break
            self.metrics.evictions_host += 1
            self._drop(v)
        return self.host.fits(nbytes)

    def _device_room(self, new_held: Callable[[], int], exclude: Entry | None) -> bool:
        """Demote device entries, in policy order, until one more checkpoint fits
        (bytes, a free handle, the attention cells it adds)."""
        need = self.layout.checkpoint_bytes
        att = self.config.attention_budget

        def fits() -> bool:
            if not self.device.fits(need) or self.store.free == 0:
                return False
            return att is None or self.tree.held_tokens + new_held() <= att

        if self.device.budget < need or not self.reserved:
            return False
        while not fits():
            victims = self._evictable("device", exclude)
            if not victims:
                return False
            self._demote(victims[0])
        return True

    def _new_held(self, ns: bytes, tokens: Sequence[int]) -> int:
        return len(tokens) - self._held_cover(self.tree.walk(ns, tokens))

    def _capture(self, seq: int, ns: bytes, tokens: tuple[int, ...], origin: str) -> bool:
        node = self.tree.find(ns, tokens)
        if node is not None and node.entry is not None:
            node.entry.last_use = self._clock
            self.metrics.captures_present += 1
            return False
        L = len(tokens)
        if self._device_room(lambda: self._new_held(ns, tokens), None):
            handle = self.store.capture(seq, L)
            if handle is not None:
                node = self.tree.insert(ns, tokens)
                entry = Entry(node, L, origin, self.layout.checkpoint_bytes, device_seq=handle)
                self._stamp(entry)
                self.tree.attach(node, entry)
                self.device.admit(entry.nbytes, False)
                self.metrics.count_checkpoint(origin)
                return True
        # straight to the host tier (no device room): one download of the live state
        if self.host.budget >= self.layout.checkpoint_bytes:
            try:
                blob = bytes(self.memory.state_write(seq))
            except StateError:
                blob = b""
            if blob and self._host_room(len(blob), None):
                node = self.tree.insert(ns, tokens)
                entry = Entry(node, L, origin, len(blob), host_blob=blob)
                self._stamp(entry)
                self.tree.attach(node, entry)
                self.host.admit(entry.nbytes, False)
                self.metrics.count_checkpoint(origin)
                return True
        self.metrics.captures_skipped += 1
        return False

    def _promote(self, entry: Entry, seq: int) -> None:
        """A host entry was just restored into ``seq``: park it on the device when there
        is room, freeing its blob (the restore already paid the copy)."""
        if not self._device_room(lambda: self._new_held_entry(entry), entry):
            return
        handle = self.store.capture(seq, entry.length)
        if handle is None:
            return
        pinned = entry.pins > 0
        self.host.release(entry.nbytes, pinned)
        entry.host_blob = None
        entry.device_seq = handle
        entry.nbytes = self.layout.checkpoint_bytes
        self.device.admit(entry.nbytes, pinned)
        self.tree.hold(entry.node, +1)
        self.metrics.promotions += 1

    def _new_held_entry(self, entry: Entry) -> int:
        node: Node | None = entry.node
        new = 0
        while node is not None and node.parent is not None and node.held == 0:
            new += len(node.edge)
            node = node.parent
        return new

    def make_room(self, device_bytes: int = 0, attention_tokens: int = 0) -> bool:
        """Demote unpinned device entries (policy order) until ``device_bytes`` more fit
        the device tier and the cache holds ``attention_tokens`` fewer attention
        cells (a runtime calls it when a batch finds no room in the memory).
        Returns whether that was reached."""
        if device_bytes < 0 or attention_tokens < 0:
            raise ArgumentError("device_bytes" if device_bytes < 0 else "attention_tokens", "amounts must be >= 0")
        goal = self.tree.held_tokens - attention_tokens
        while not self.device.fits(device_bytes) or self.tree.held_tokens > goal:
            victims = self._evictable("device")
            if not victims:
                return False
            self._demote(victims[0])
        return True

    def sweep(self) -> int:
        """Drop the device entries the memory no longer holds (a runtime's ``seq_keep``
        or ``clear`` removed their sequences); returns how many.  Lookups find
        them anyway when they would use them; this only frees their accounting."""
        lost = [
            e for e in self.tree.entries() if e.device_seq is not None and not self.store.alive(e.device_seq, e.length)
        ]
        for e in lost:
            self.metrics.lost += 1
            self._drop(e)
        return len(lost)

    def clear(self) -> None:
        """Forget every checkpoint (releasing the reserved sequences)."""
        for req in self._active.values():
            req.pinned = None
        for entry in list(self.tree.entries()):
            if entry.pins:
                self._pin(entry, -entry.pins)
            self._drop(entry)

    # -- inspection -------------------------------------------------------------------
    def entries(self) -> Iterator[Entry]:
        """Every checkpoint entry (read them, do not edit them)."""
        return self.tree.entries()

    def stats(self) -> dict[str, object]:
        """Counters plus the resident figures of both tiers, now."""
        out = self.metrics.as_dict()
        out.update(
            bytes_device=self.device.resident,
            bytes_host=self.host.resident,
            bytes_in_host_memory=self.host.resident + (self.device.resident if self.layout.host_memory else 0),
            entries_device=self.device.entries,
            entries_host=self.host.entries,
            attention_tokens_held=self.tree.held_tokens,
            checkpoint_bytes=self.layout.checkpoint_bytes,
        )
        return out

    # -- persistence ------------------------------------------------------------------
    def save(self, file: str | os.PathLike[str] | BinaryIO) -> int:
        """Write every checkpoint to ``file`` (a path or a binary file); returns how many.

        The file is a state-format blob (``statecache.state_io``) of three
        sections: a header (file version, layout fingerprint), the entries
        (namespace digest, tokens, origin, hits, each entry's own state blob)
        and a SHA-256 of both, so :meth:`load` refuses any corrupt byte.
        """
        rows: list[tuple[bytes, Entry, bytes]] = []
        for ns, root in self.tree.roots.items():
            stack = [root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                e = node.entry
                if e is None:
                    continue
                if e.device_seq is not None:
                    if not self.store.alive(e.device_seq, e.length):
                        continue
                    blob = self.store.export(e.device_seq)
                else:
                    assert e.host_blob is not None
                    blob = e.host_blob
                rows.append((ns, e, blob))
        head = Writer()
        head.u32(FILE_VERSION)
        head.name(self.layout.fingerprint)
        head.u32(len(rows))
        body = Writer()
        for ns, e, blob in rows:
            body.raw(ns)
            toks = e.node.tokens()
            body.u32(len(toks))
            for t in toks:
                body.u32(t)
            body.name(e.origin)
            body.u32(e.hits)
            body.u64(len(blob))
            body.raw(blob)
        h, b = head.getvalue(), body.getvalue()
        digest = hashlib.sha256(h + b).digest()
        data = pack_sections([(_TAG_HEAD, h), (_TAG_ENTRIES, b), (_TAG_CHECK, digest)])
        if isinstance(file, str | os.PathLike):
            with open(file, "wb") as f:
                f.write(data)
        else:
            file.write(data)
        return len(rows)

    def load(self, file: str | os.PathLike[str] | BinaryIO | bytes) -> int:
        """Add the checkpoints of a file written by :meth:`save`; returns how many were added.

        Everything is validated before anything changes: a corrupt file
        (checksum), another layout (fingerprint), a malformed entry or state
        blob raises :class:`~statecache.errors.StateError` and the cache and
        the memory are as they were.  Entries go to the host tier while it has
        room, else to the device tier; entries already present, or with no
        room left, are skipped (existing entries are never evicted for them).
        """
        if isinstance(file, bytes | bytearray):
            data = bytes(file)
        elif isinstance(file, str | os.PathLike):
            with open(file, "rb") as f:
                data = f.read()
        else:
            data = file.read()
        _, sections = unpack_sections(data)
        h, b, digest = (bytes(find_section(sections, t)) for t in (_TAG_HEAD, _TAG_ENTRIES, _TAG_CHECK))
        if hashlib.sha256(h + b).digest() != digest:
            raise StateError("checksum", "the file's SHA-256 does not match its contents (corrupt file)")
        r = Reader(h, "prefix header")
        r.expect("version", r.u32("version"), FILE_VERSION)
        fp = r.name("fingerprint")
        if fp != self.layout.fingerprint:
            raise StateError(
                "fingerprint", f"file written for memory layout {fp}, this memory is {self.layout.fingerprint}"
            )
        count = r.u32("count")
        r.at_end()
        rb = Reader(b, "prefix entries")
        parsed: list[tuple[bytes, tuple[int, ...], str, int, bytes]] = []
        for i in range(count):
            ns = bytes(rb.raw(16, f"entry[{i}].namespace"))
            n = rb.u32(f"entry[{i}].n_tokens")
            if n == 0:
                rb.fail(f"entry[{i}].n_tokens", "is 0; a checkpoint covers at least one token")
            toks = tuple(rb.u32(f"entry[{i}].token") for _ in range(n))
            origin = rb.name(f"entry[{i}].origin")
            if origin not in ORIGINS:
                rb.fail(f"entry[{i}].origin", f"is {origin!r}; known: {', '.join(ORIGINS)}")
            hits = rb.u32(f"entry[{i}].hits")
            blob = bytes(rb.raw(rb.u64(f"entry[{i}].blob_bytes"), f"entry[{i}].blob"))
            unpack_sections(blob)  # framing of the state blob itself
            parsed.append((ns, toks, origin, hits, blob))
        rb.at_end()
        return self._admit_loaded(parsed)

    def _admit_loaded(self, parsed: list[tuple[bytes, tuple[int, ...], str, int, bytes]]) -> int:
        added: list[Entry] = []
        try:
            for ns, toks, origin, hits, blob in parsed:
                node = self.tree.find(ns, toks)
                if node is not None and node.entry is not None:
                    continue
                if self.host.fits(len(blob)):
                    node = self.tree.insert(ns, toks)
                    entry = Entry(node, len(toks), origin, len(blob), host_blob=blob, hits=hits)
                    self.tree.attach(node, entry)
                    self.host.admit(entry.nbytes, False)
                elif self.device.fits(self.layout.checkpoint_bytes) and self.store.free > 0:
                    handle = self.store.import_blob(blob, len(toks))
                    if handle is None:
                        continue
                    node = self.tree.insert(ns, toks)
                    entry = Entry(node, len(toks), origin, self.layout.checkpoint_bytes, device_seq=handle, hits=hits)
                    self.tree.attach(node, entry)
                    self.device.admit(entry.nbytes, False)
                else:
                    continue
                self._stamp(entry)
                added.append(entry)
                self.metrics.count_checkpoint("loaded")
        except BaseException:
            for entry in added:  # all or nothing
                self._drop(entry)
                self.metrics.checkpoints["loaded"] -= 1
            raise
        return len(added)
