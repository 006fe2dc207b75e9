"""Hypothesis stateful test: random request traces through a PrefixCache over a real
memory of the tiny model, every request checked against its cold run.

Traces mix fresh prompts, prompts sharing any prefix of an earlier request's
tokens (so multi-turn continuations, re-sent conversations with a changed
tail, and junctions all occur), generation with speculative steps rolled
back, small device budgets with or without a host tier (evictions and tier
moves), save / clear / load, checkpoints dropped behind the cache's back, and
a runtime's own ``seq_cp``/``state_read``/``seq_rm`` on its live sequences.
The oracle (:class:`statecache.conformance.prefix_cases.ColdOracle`) demands
that every output after a hit is bitwise the output of a cold run with the
same calls, and within f32 NMSE of a one-call recompute; the cache's
invariants (P1-P6) are checked after every step.

Examples: ``STATECACHE_PREFIX_EXAMPLES`` (default 5) traces of at most 10 steps.
"""

from __future__ import annotations

import io
import os

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import statecache
from statecache.conformance.model import VOCAB
from statecache.conformance.prefix_cases import ColdOracle, ModelRuntime, serve
from statecache.prefix import PrefixCache, PrefixConfig, check_invariants, describe

DEV = statecache.get_device("reference")
N_LIVE, N_RES, N_RS = 2, 6, 2
token = st.integers(0, VOCAB - 1)
gen_item = st.one_of(
    token,
    st.tuples(st.lists(token, max_size=2), st.lists(token, min_size=1, max_size=N_RS)),  # draft, some rejected
)


class PrefixMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(["recurrent", "hybrid"]),
        policy=st.sampled_from(["slru", "lru", "value"]),
        slots=st.integers(1, 4),
        host=st.booleans(),
        seed=st.integers(0, 3),
    )
    def setup(self, kind: str, policy: str, slots: int, host: bool, seed: int) -> None:
        self.rt = ModelRuntime(DEV, kind, N_LIVE + N_RES, seed, n_rs_seq=N_RS)
        ckpt = describe(self.rt.mem).checkpoint_bytes
        self.config = PrefixConfig(
            chunk=4, interval=8, before_end=2, device_budget=slots * ckpt, host_budget=(1 << 20) if host else 0,
            policy=policy,
        )  # fmt: skip
        self.cache = PrefixCache(self.rt.mem, reserved=range(N_LIVE, N_LIVE + N_RES), config=self.config)
        self.oracle = ColdOracle(lambda: ModelRuntime(DEV, kind, 1, seed + 100, n_rs_seq=N_RS))
        self.seen: list[list[int]] = []

    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        seq = data.draw(st.integers(0, N_LIVE - 1), label="seq")
        base = data.draw(st.sampled_from(self.seen), label="base") if self.seen else []
        # whole (the next turn), nearly whole (re-sent with its end changed), or anywhere (a junction)
        n = len(base)
        cut = data.draw(st.one_of(st.sampled_from([n, max(n - 1, 0), max(n - 3, 0)]), st.integers(0, n)), label="cut")
        prompt = base[:cut] + data.draw(st.lists(token, min_size=1, max_size=10), label="suffix")
        gen = data.draw(st.lists(gen_item, max_size=3), label="gen")
        served = serve(self.rt, self.cache, self.oracle, seq, prompt, gen, label=f"prompt of {len(prompt)}")
        self.seen.append(prompt + served.generated)
        m = served.request.match
        event(f"hit from {m.tier}" if served.request.resume else "miss")
        if any(isinstance(g, tuple) for g in gen):
            event("speculative step")

    @rule(data=st.data(), what=st.sampled_from(["drop", "save_load", "seq_cp", "state_read", "seq_rm"]))
    def disturb(self, data: st.DataObject, what: str) -> None:
        """Everything but a request, as one rule so that requests stay half the steps."""
        mem = self.rt.mem
        held = sorted((e for e in self.cache.entries() if e.device_seq is not None), key=lambda e: e.length)
        if what == "drop" and held:
            # a runtime breaking the rules (a reserved id reused): the cache must notice, never restore it
            victim = data.draw(st.sampled_from(held), label="dropped")
            mem.seq_rm(victim.device_seq, -1, -1)
            assert self.cache.sweep() == 1
        elif what == "save_load":
            f = io.BytesIO()
            n = self.cache.save(f)
            self.cache.clear()
            loaded = self.cache.load(f.getvalue())
            assert loaded <= n
            event(f"reloaded {'all' if loaded == n else 'some'} checkpoints")
        elif mem.seq_pos_max(0) >= 0:
            # a runtime's own sequence operations never reach the stored checkpoints
            if what == "seq_cp":
                mem.seq_cp(0, 1)
            elif what == "state_read":
                mem.state_read(mem.state_write(0), 1)
            else:
                mem.seq_rm(0, max(mem.seq_pos_max(0), 1), -1)  # a rollback: accepted or refused, both fine

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "cache"):
            check_invariants(self.cache)
            st_ = self.cache.stats()
            if st_["demotions"]:
                event("demotion")
            if st_["promotions"]:
                event("promotion")
            assert st_["prompt_tokens"] == st_["hit_tokens"] + st_["recomputed_tokens"]


PrefixMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STATECACHE_PREFIX_EXAMPLES", "5")), stateful_step_count=10, deadline=None
)
TestPrefixMachine = PrefixMachine.TestCase
