"""A small generation engine over :class:`~.model.StatecacheCausalLM`.

Requests bring their own prompts and settings; :meth:`Engine.step` runs one
forward for every active request at once (continuous batching): a new
request's prompt is prefilled in the same batch as the others' decode
tokens, a finished request leaves and its states are freed
(``seq_rm``), and a waiting request takes its sequence slot at the next
step.  :meth:`Engine.fork` copies a request's states into a new request
(``seq_cp``; the states are shared until one side writes).

Speculative decoding: a request with a draft source (:class:`~.draft.NgramDraft`,
or any ``(context, k) -> tokens`` callable) feeds ``k`` drafted tokens behind
its next token, gets ``k + 1`` logits from one forward, keeps the drafted
tokens the target model agrees with and removes the rest from the memory:
``seq_rm`` rolls the recurrent states back exactly through the memory's
snapshot planes (and drops the rejected K/V cells).  A model whose states have
no snapshot planes (Mamba-1 today) forks the request into a scratch sequence
before the verify forward instead, and on a rejection restores that copy and
feeds the accepted tokens again at the next step: exact as well, at the cost
of re-reading them.

Sampling is greedy (``temperature == 0``) or seeded (temperature, top-k,
top-p, one NumPy generator per request); speculative sampling accepts a
drafted token with the target probability of that token and otherwise
samples from the target distribution without it, which leaves the output
distribution exactly the target's.

Sequence ids: the recurrent memory batches consecutive sequence ids
together, so when requests leave the engine moves the requests with the
highest ids into the holes (``seq_cp`` then ``seq_rm``, book operations,
plus one K/V stream copy per attention layer for a hybrid with one stream
per sequence).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statecache.batch import Batch
from statecache.errors import ArgumentError

from .model import StatecacheCausalLM

DraftSource = Callable[[Sequence[int], int], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a request picks tokens: greedy when ``temperature == 0``, else
    softmax(logits / temperature) restricted to the ``top_k`` most likely
    tokens (0: all) and the smallest set whose probability reaches ``top_p``,
    drawn with a generator seeded by ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ArgumentError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ArgumentError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The sampling distribution (float64) of one logits row."""
        z = logits.astype(np.float64) / self.temperature
        if self.top_k and self.top_k < z.size:
            cut = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= cut, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.top_p  # smallest prefix reaching top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        out: np.ndarray = p
        return out


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


def speculative_pick(p: np.ndarray, draft: int | None, rng: np.random.Generator) -> int:
    """One token from distribution ``p`` given a deterministic draft token: keep the draft with
    probability ``p[draft]``, else draw from ``p`` without it (renormalised).  The result is
    distributed exactly as ``p`` (``P(t) = p[d] [t = d] + (1 - p[d]) p[t] / (1 - p[d])``), so
    drafting never changes what a seeded request samples in distribution.  Without a draft:
    a plain draw."""
    if draft is None:
        return _draw(p, rng)
    if rng.random() < p[draft]:
        return int(draft)
    rest = p.copy()
    rest[draft] = 0.0
    return _draw(rest, rng) if rest.sum() > 0 else int(draft)


@dataclasses.dataclass
class Request:
    """One generation request; :attr:`generated` grows as it runs."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_tokens: frozenset[int]
    draft: DraftSource | None
    n_draft: int
    seq: int = -1  # memory sequence id while active
    generated: list[int] = dataclasses.field(default_factory=list)
    #: tokens decided but not in the memory yet (the prompt, then the last sampled token)
    unfed: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # ... and kept
    #: every token of the sequence in order: the prompt, appended and generated tokens
    context: list[int] = dataclasses.field(default_factory=list)
    #: per generated token (when the engine records them): how many tokens of ``context``
    #: preceded it, and the logits row it was chosen from
    logits: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    rng: np.random.Generator = dataclasses.field(default_factory=np.random.default_rng)


class Engine:
    """Continuous batching, forks and speculative decoding over one :class:`StatecacheCausalLM`.

    ``record_logits``: keep the logits row behind every generated token
    (tests compare them with the model's own forward).
    """

    def __init__(self, lm: StatecacheCausalLM, *, record_logits: bool = False) -> None:
        self.lm = lm
        self.record_logits = bool(record_logits)
        self._ids = itertools.count()
        self.requests: dict[int, Request] = {}
        self.waiting: list[Request] = []
        self.active: dict[int, Request] = {}  # seq -> request
        self.steps = 0
        self.forwards = 0

    # -- requests --------------------------------------------------------------------------------
    def _check_n_ctx(self, n_tokens: int) -> None:
        if self.lm.has_attention and n_tokens > self.lm.n_ctx:
            raise ArgumentError("max_new_tokens", f"{n_tokens} positions exceed the KV cache's n_ctx {self.lm.n_ctx}")

    def add(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int = 16,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        draft: DraftSource | None = None,
        n_draft: int = 4,
    ) -> int:
        """Queue a request; it joins at the next :meth:`step` with a free sequence slot.
        Returns its id."""
        toks = [int(t) for t in prompt]
        if not toks:
            raise ArgumentError("prompt", "needs at least one token")
        bad = [t for t in toks if not 0 <= t < self.lm.n_vocab]
        if bad:
            raise ArgumentError("prompt", f"token {bad[0]} outside the vocabulary [0, {self.lm.n_vocab})")
        if max_new_tokens < 1:
            raise ArgumentError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
        if n_draft < 0:
            raise ArgumentError("n_draft", f"must be >= 0, got {n_draft}")
        self._check_n_ctx(len(toks) + max_new_tokens + n_draft)
        s = sampling or Sampling()
        req = Request(
            next(self._ids), toks, int(max_new_tokens), s, frozenset(int(t) for t in stop_tokens), draft, int(n_draft)
        )
        req.unfed = list(toks)
        req.context = list(toks)
        req.rng = np.random.default_rng(s.seed)
        self.requests[req.id] = req
        self.waiting.append(req)
        return req.id

    def fork(
        self,
        rid: int,
        *,
        append: Sequence[int] = (),
        sampling: Sampling | None = None,
        max_new_tokens: int | None = None,
    ) -> int:
        """A new request that continues request ``rid`` from where it is now: its states are
        copied (``seq_cp``, shared until one side writes), its generated tokens so far are the
        branch's too.  ``append``: tokens the branch takes next, in place of nothing (the
        branch then decodes from them); ``sampling`` / ``max_new_tokens``: the branch's own
        (default: the parent's, and the parent's remaining budget)."""
        parent = self.requests.get(rid)
        if parent is None or parent.seq < 0 or parent.finished:
            raise ArgumentError("rid", f"request {rid} is not running (fork needs its states)")
        seq = self._free_seq()
        if seq is None:
            raise ArgumentError("rid", f"no free sequence slot for a fork (n_seq_max={self.lm.n_seq_max})")
        extra = [int(t) for t in append]
        budget = parent.max_new_tokens - len(parent.generated) if max_new_tokens is None else int(max_new_tokens)
        s = sampling or parent.sampling
        child = Request(
            next(self._ids),
            list(parent.prompt),
            len(parent.generated) + budget,
            s,
            parent.stop_tokens,
            parent.draft,
            parent.n_draft,
        )
        child.generated = list(parent.generated)
        child.unfed = list(parent.unfed) + extra
        child.context = list(parent.context) + extra
        child.rng = np.random.default_rng(s.seed)
        if self.record_logits:
            child.logits = list(parent.logits)
        self._check_n_ctx(len(child.context) - len(child.generated) + child.max_new_tokens + child.n_draft)
        self.lm.memory.seq_cp(parent.seq, seq)
        child.seq = seq
        self.requests[child.id] = child
        self.active[seq] = child
        return child.id

    def cancel(self, rid: int) -> None:
        req = self.requests[rid]
        if not req.finished:
            self._finish(req, "cancelled")
            self._compact()

    def tokens(self, rid: int) -> list[int]:
        return list(self.requests[rid].generated)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    # -- sequence slots ----------------------------------------------------------------------------
    def _free_seq(self, exclude: set[int] | None = None) -> int | None:
        for s in range(self.lm.n_seq_max):
            if s not in self.active and (exclude is None or s not in exclude):
                return s
        return None

    def _finish(self, req: Request, reason: str) -> None:
        req.finished = True
        req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
        if req.seq >= 0:
            self.lm.memory.seq_rm(req.seq, -1, -1)  # frees its states (and K/V cells)
            del self.active[req.seq]
            req.seq = -1

    def _compact(self) -> None:
        """Move the highest sequence ids into the lowest holes (see module doc)."""
        mem = self.lm.memory
        while self.active:
            hi = max(self.active)
            lo = self._free_seq()
            if lo is None or lo > hi:
                return
            req = self.active.pop(hi)
            mem.seq_cp(hi, lo)
            mem.seq_rm(hi, -1, -1)
            req.seq = lo
            self.active[lo] = req

    def _admit(self) -> None:
        while self.waiting:
            seq = self._free_seq()
            if seq is None:
                return
            req = self.waiting.pop(0)
            req.seq = seq
            self.active[seq] = req

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One forward over every active request (admitting waiting ones first).
        Returns the ids of the requests that produced tokens."""
        self._admit()
        if not self.active:
            return []
        lm, mem = self.lm, self.lm.memory
        order = sorted(self.active)
        depth = lm.rollback_depth
        plans = []  # (req, n_fed, drafts, scratch seq)
        toks: list[int] = []
        seqs: list[int] = []
        outs: list[bool] = []
        taken = set(order)
        for s in order:
            req = self.active[s]
            drafts: list[int] = []
            scratch = None
            room = req.max_new_tokens - len(req.generated) - 1  # the last token is always sampled
            k = min(req.n_draft, room)
            if req.draft is not None and k > 0 and depth < k:  # no snapshot planes that deep: fork first
                scratch = self._free_seq(exclude=taken)
                if scratch is None:
                    k = min(k, depth)
            if req.draft is not None and k > 0:
                drafts = [int(t) for t in req.draft(req.context, k)][:k]
                drafts = [t for t in drafts if 0 <= t < lm.n_vocab]
            if not drafts:
                scratch = None
            if scratch is not None:
                mem.seq_cp(s, scratch)
                taken.add(scratch)
            fed = req.unfed + drafts
            toks.extend(fed)
            seqs.extend([s] * len(fed))
            outs.extend([False] * (len(req.unfed) - 1) + [True] * (1 + len(drafts)))
            plans.append((req, len(fed), drafts, scratch))
        batch = Batch(tokens=np.asarray(toks, dtype=np.int32), seq_ids=seqs, output=np.asarray(outs, dtype=bool))
        try:
            logits = lm.forward(batch)
        except BaseException:
            # the memory undid the batch; requests whose states it had to drop cannot go on
            for req, _, _, scratch in plans:
                if scratch is not None:
                    mem.seq_rm(scratch, -1, -1)
                if req.seq in lm.last_dropped:
                    self._finish(req, "failed")
            self._compact()
            raise
        self.forwards += 1
        self.steps += 1
        rows = logits.cpu().numpy()
        best = rows.argmax(axis=1).tolist()  # every row's greedy token in one pass (a loop per row costs more)
        row = 0
        progressed = []
        for req, n_fed, drafts, scratch in plans:
            n_out = 1 + len(drafts)
            self._accept(
                req, rows[row : row + n_out], logits[row : row + n_out], n_fed, drafts, scratch, best[row : row + n_out]
            )
            row += n_out
            progressed.append(req.id)
        if any(r.finished for r, *_ in plans):
            self._compact()
        return progressed

    def _accept(
        self,
        req: Request,
        rows: np.ndarray,
        trows: Any,
        n_fed: int,
        drafts: list[int],
        scratch: int | None,
        best: list[int],
    ) -> None:
        """Choose the new tokens of one request from its logits rows (``best``: each row's
        argmax) and roll back what was rejected."""
        mem = self.lm.memory
        s = req.sampling
        new: list[int] = []
        used_rows: list[int] = []
        for i in range(len(drafts) + 1):
            d = drafts[i] if i < len(drafts) else None
            if s.greedy:
                t = best[i]
            else:
                t = speculative_pick(s.probs(rows[i]), d, req.rng)
            new.append(t)
            used_rows.append(i)
            if d is None or t != d:
                break
        n_acc = len(new) - 1  # drafts kept (new[:-1] equal the drafts)
        # stop tokens and the length budget cut the new tokens
        keep = len(new)
        budget = req.max_new_tokens - len(req.generated)
        for j, t in enumerate(new):
            if t in req.stop_tokens:
                keep = j + 1
                break
        keep = min(keep, budget)
        new = new[:keep]
        req.drafted += len(drafts)
        req.accepted += min(n_acc, keep)
        if self.record_logits:
            n0 = len(req.context)
            req.logits.extend((n0 + j, trows[i].clone()) for j, i in enumerate(used_rows[:keep]))
        req.generated.extend(new)
        req.context.extend(new)
        done = (new and new[-1] in req.stop_tokens) or len(req.generated) >= req.max_new_tokens
        n_kept_fed = n_fed - len(drafts) + min(n_acc, keep)  # fed tokens that stay in the memory
        if done:
            if scratch is not None:
                mem.seq_rm(scratch, -1, -1)
            self._finish(req, "stop" if new and new[-1] in req.stop_tokens else "length")
            return
        rejected = n_fed - n_kept_fed
        if scratch is None:
            if rejected:
                p_end = mem.seq_pos_max(req.seq) + 1
                if not mem.seq_rm(req.seq, p_end - rejected, -1):
                    raise RuntimeError(f"request {req.id}: the memory refused to roll back {rejected} tokens")
            req.unfed = [new[-1]]
            return
        # forked before the verify: keep the verified states, or go back to the copy and re-feed
        if rejected:
            mem.seq_rm(req.seq, -1, -1)
            mem.seq_cp(scratch, req.seq)
            req.unfed = req.unfed + drafts[: n_kept_fed - (n_fed - len(drafts))] + [new[-1]]
        else:
            req.unfed = [new[-1]]
        mem.seq_rm(scratch, -1, -1)

    def run(self, max_steps: int | None = None) -> None:
        """Step until every request finished (or ``max_steps`` steps)."""
        n = 0
        while self.busy and (max_steps is None or n < max_steps):
            self.step()
            n += 1
