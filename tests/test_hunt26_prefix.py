"""Prefix cache under traces the other machine does not draw (hunt26).

``tests/prefix/test_prefix_stateful.py`` covers recurrent/hybrid memories on
the reference device with the slru/lru/value policies.  This machine adds:
the default ``adaptive`` policy, the hybrid-iSWA and hybrid-idx kinds, the
cpu device, extra namespace keys, cancelled requests, mid-generation
checkpoints, ``make_room``, and refused calls (bad arguments, ``reached`` at a
wrong end, ``finish`` with a wrong generation), each of which must change
nothing: the cache's entries, counters and the memory's bytes stay as they were.
Every served request is held to its cold run (bitwise) and a one-call
recompute (NMSE) by :class:`ColdOracle`; the invariants P1-P6 after every step.

Examples: ``STATECACHE_HUNT26_PREFIX_EXAMPLES`` (default 12) traces of 8 steps.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import statecache
from statecache.conformance.model import VOCAB
from statecache.conformance.prefix_cases import ColdOracle, ModelRuntime, serve
from statecache.errors import ArgumentError, StatecacheError
from statecache.prefix import PrefixCache, PrefixConfig, check_invariants, describe

N_LIVE, N_RES, N_RS = 2, 5, 2
token = st.integers(0, VOCAB - 1)


def _books(cache: PrefixCache, mem) -> tuple:  # type: ignore[no-untyped-def]
    entries = sorted(
        (e.length, e.origin, -1 if e.device_seq is None else e.device_seq, e.host_blob is not None, e.pins, e.hits)
        for e in cache.entries()
    )
    return entries, cache.stats(), mem.state_write()


class Hunt26PrefixMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(["recurrent", "hybrid", "hybrid_iswa", "hybrid_idx"]),
        device=st.sampled_from(["reference", "cpu"]),
        policy=st.sampled_from(["adaptive", "adaptive", "value"]),
        slots=st.integers(1, 3),
        host=st.booleans(),
        seed=st.integers(0, 3),
    )
    def setup(self, kind: str, device: str, policy: str, slots: int, host: bool, seed: int) -> None:
        dev = statecache.get_device(device)
        self.rt = ModelRuntime(dev, kind, N_LIVE + N_RES, seed, n_rs_seq=N_RS)
        ckpt = describe(self.rt.mem).checkpoint_bytes
        self.config = PrefixConfig(
            chunk=4, interval=8, before_end=2, device_budget=slots * ckpt, host_budget=(1 << 20) if host else 0,
            policy=policy,
        )  # fmt: skip
        self.cache = PrefixCache(self.rt.mem, reserved=range(N_LIVE, N_LIVE + N_RES), config=self.config)
        # the one-call recompute knows no sliding window (as in the conformance cases)
        self.oracle = ColdOracle(
            lambda: ModelRuntime(dev, kind, 1, seed + 100, n_rs_seq=N_RS), with_recompute=kind != "hybrid_iswa"
        )
        self.seen: list[tuple[object, list[int]]] = []

    def _prompt(self, data: st.DataObject) -> tuple[object, list[int]]:
        extra, base = data.draw(st.sampled_from(self.seen)) if self.seen else (None, [])
        if data.draw(st.integers(0, 5)) == 0:
            extra = data.draw(st.sampled_from([None, "lora-a", b"img"]), label="extra")
        cut = data.draw(st.one_of(st.just(len(base)), st.integers(0, len(base))), label="cut")
        return extra, base[:cut] + data.draw(st.lists(token, min_size=1, max_size=9), label="suffix")

    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        seq = data.draw(st.integers(0, N_LIVE - 1), label="seq")
        extra, prompt = self._prompt(data)
        draft = st.tuples(st.lists(token, max_size=1), st.lists(token, min_size=1, max_size=N_RS))
        gen = data.draw(st.lists(st.one_of(token, draft), max_size=3), label="gen")
        served = serve(self.rt, self.cache, self.oracle, seq, prompt, gen, extra=extra, label="request")
        self.seen.append((extra, prompt + served.generated))

    @rule(data=st.data())
    def cancelled_or_checkpointed(self, data: st.DataObject) -> None:
        """A request cancelled half-way, or one checkpointed mid-generation then finished."""
        seq = data.draw(st.integers(0, N_LIVE - 1), label="seq")
        extra, prompt = self._prompt(data)
        req = self.cache.start(seq, prompt, extra)
        assert self.rt.mem.seq_pos_max(seq) == req.resume - 1
        prev = req.resume
        pieces = list(req.pieces)
        stop = data.draw(st.integers(0, len(pieces)), label="pieces run")
        outs, after = [], []  # logits and calls, for the oracle (it learns where calls ended)

        def run(tokens: list[int]) -> None:
            n0 = len(self.rt.calls.get(seq, []))
            outs.append(self.rt.run({seq: tokens})[seq])
            after.extend(self.rt.calls[seq][n0:])

        for end in pieces[:stop]:
            run(prompt[prev:end])
            prev = end
            self.cache.reached(req, end)
        if stop < len(pieces) or data.draw(st.booleans()):
            self.cache.cancel(req)
            if outs:
                self.oracle.check("cancelled", prompt[:prev], req.resume, after, np.concatenate(outs))
            self.rt.mem.seq_rm(seq, -1, -1)
            return
        gen = data.draw(st.lists(token, min_size=1, max_size=3), label="generated")
        run(gen)
        self.cache.checkpoint(req, gen)
        self.cache.finish(req, gen)
        self.oracle.check("checkpointed", prompt + gen, req.resume, after, np.concatenate(outs))
        # the mid-generation checkpoint (and the end one) must be what a cold run computes
        full = prompt + gen
        self.seen.append((extra, full))
        again = self.cache.match([*full, 0], extra)
        assert again.length <= len(full)

    @rule(
        data=st.data(), what=st.sampled_from(["start_bad_seq", "start_empty", "reached_wrong", "finish_wrong", "neg"])
    )
    def refused(self, data: st.DataObject, what: str) -> None:
        mem = self.rt.mem
        if what in ("reached_wrong", "finish_wrong"):
            extra, prompt = self._prompt(data)
            req = self.cache.start(0, prompt, extra)
            before = _books(self.cache, mem)
            with pytest.raises(StatecacheError):
                if what == "reached_wrong":
                    self.cache.reached(req, req.pieces[0] + 1 if req.pieces else len(prompt) + 1)
                else:
                    self.cache.finish(req, [1, 2])  # the sequence absorbed nothing
            assert _books(self.cache, mem) == before
            self.cache.cancel(req)
            mem.seq_rm(0, -1, -1)
            return
        before = _books(self.cache, mem)
        with pytest.raises(StatecacheError):
            if what == "start_bad_seq":
                self.cache.start(data.draw(st.sampled_from([N_LIVE, N_LIVE + N_RES, -1])), [1, 2, 3])
            elif what == "start_empty":
                self.cache.start(0, [])
            else:
                self.cache.make_room(-1)
        assert _books(self.cache, mem) == before

    @rule(nbytes=st.integers(0, 1 << 12), ntok=st.integers(0, 12))
    def make_room(self, nbytes: int, ntok: int) -> None:
        self.cache.make_room(nbytes, ntok)

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "cache"):
            check_invariants(self.cache)
            s = self.cache.stats()
            assert s["prompt_tokens"] == s["hit_tokens"] + s["recomputed_tokens"]


Hunt26PrefixMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("STATECACHE_HUNT26_PREFIX_EXAMPLES", "12")),
    stateful_step_count=8,
    deadline=None,
    # STATECACHE_HUNT26_NO_SHRINK=1: a long hunt reports failures as drawn (shrinking one trace takes minutes)
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("STATECACHE_HUNT26_NO_SHRINK")
    else list(Phase),
)
TestHunt26PrefixMachine = Hunt26PrefixMachine.TestCase


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ([1, 2.5, 3], "integer"),  # once truncated to 2: a hit on another prompt's checkpoint
        (np.asarray([1.0, 2.0]), "integer"),
        ([1, 2**31], "int32"),  # once accepted; save() then failed packing it
        ([1, 2**40], "int32"),
    ],
)
def test_prompts_the_memory_would_refuse_are_refused_and_change_nothing(prompt, why: str) -> None:  # type: ignore[no-untyped-def]
    """Token ids follow the batch's rules (integers that fit int32), so the cache never
    keys a checkpoint by a prompt no batch can hold, nor by a rounded one."""
    dev = statecache.get_device("reference")
    rt = ModelRuntime(dev, "recurrent", 4, 0)
    cache = PrefixCache(rt.mem, reserved=range(2, 4), config=PrefixConfig(chunk=4, interval=8, before_end=2))
    serve(rt, cache, None, 0, [1, 2, 3, 4, 5, 6], [7])
    before = _books(cache, rt.mem)
    for call in (lambda: cache.start(1, prompt), lambda: cache.match(prompt)):
        with pytest.raises(StatecacheError, match=why):
            call()
        assert _books(cache, rt.mem) == before
    cache.save(io.BytesIO())  # the cache holds only what it can write


def test_make_room_names_the_negative_amount() -> None:
    dev = statecache.get_device("reference")
    rt = ModelRuntime(dev, "recurrent", 4, 0)
    cache = PrefixCache(rt.mem, reserved=range(2, 4), config=PrefixConfig(chunk=4))
    for args, name in (((-1, 0), "device_bytes"), ((0, -1), "attention_tokens")):
        with pytest.raises(ArgumentError) as e:
            cache.make_room(*args)
        assert e.value.argument == name


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"reserved": [2.5, 3]}, "reserved"),  # once truncated: sequence 2 silently reserved
        ({"reserved": [True]}, "reserved"),
        ({"config": {"chunk": 4.5}}, "chunk"),  # once refused naming interval
        ({"config": {"chunk": 4, "interval": 8.0}}, "interval"),
        ({"config": {"before_end": 1.5}}, "before_end"),
    ],
)
def test_fractional_ids_and_token_counts_are_refused(kwargs, name: str) -> None:  # type: ignore[no-untyped-def]
    dev = statecache.get_device("reference")
    rt = ModelRuntime(dev, "recurrent", 4, 0)
    with pytest.raises(ArgumentError) as e:
        config = PrefixConfig(**kwargs["config"]) if "config" in kwargs else None
        PrefixCache(rt.mem, reserved=kwargs.get("reserved", range(2, 4)), config=config)
    assert e.value.argument == name
