"""The peers' prefix-caching bugs as regression tests (peers.md section 7), on the
tiny model of the conformance suite through real memories (reference device)."""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.conformance.model import VOCAB
from statecache.conformance.prefix_cases import ColdOracle, ModelRuntime, serve
from statecache.memory import StateFlags
from statecache.prefix import PrefixCache, PrefixConfig, check_invariants

DEV = statecache.get_device("reference")


def setup(kind: str, n_res: int = 8, n_rs_seq: int = 0, **cfg):  # type: ignore[no-untyped-def]
    rt = ModelRuntime(DEV, kind, 2 + n_res, seed=3, n_rs_seq=n_rs_seq)
    config = PrefixConfig(**{"chunk": 8, "interval": 16, "before_end": 0, **cfg})
    cache = PrefixCache(rt.mem, reserved=range(2, 2 + n_res), config=config)
    oracle = ColdOracle(lambda: ModelRuntime(DEV, kind, 1, seed=11, n_rs_seq=n_rs_seq), kind != "hybrid_iswa")
    return rt, cache, oracle


def toks(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_idx", "hybrid_iswa"])
def test_attention_hit_longer_than_the_recurrent_one_shrinks(kind):
    """vllm #43090 / #45238 / #47491: the attention group hit 30 tokens, the recurrent
    group had no state there; the hit must be the common exact point, with every
    part of the sequence there (not an empty recurrent state at 30)."""
    rt, cache, oracle = setup(kind, end_of_prompt=False)
    a = toks(1, 30)
    served = serve(rt, cache, oracle, 0, a, [5, 6, 7])  # checkpoints at 16 and 33 (end of generation)
    prompt = [*a, (served.generated[0] + 1) % VOCAB, 3, 4]
    m = cache.match(prompt)
    assert (m.part("attention"), m.part("recurrent"), m.length) == (30, 16, 16)
    b = serve(rt, cache, oracle, 1, prompt)  # the oracle checks bitwise against a cold run
    assert b.request.resume == 16
    mem = rt.mem
    assert mem.recr.seq_pos_max(1) == mem.attn.seq_pos_max(1) == len(prompt) - 1
    check_invariants(cache)


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_checkpoint_inside_a_multi_request_batch_equals_a_solo_run(kind):
    """SGLang #37836 / #33450: the state stored at p for a request prefilled in a batch
    with others is the state of a solo run truncated at p.  "Same calls": the
    memory splits a batch of unequal pieces into equal ubatches, and kernels may
    round differently across other call boundaries (the metamorphic ``chunked``
    cases allow it), so the solo run repeats the calls the batch made for that
    sequence; a state taken on the batch's packed grid instead would differ."""
    rt, cache, _ = setup(kind)
    prompts = {0: toks(2, 37), 1: toks(3, 29)}
    reqs = {s: cache.start(s, p) for s, p in prompts.items()}
    pos = {s: 0 for s in prompts}
    while any(pos[s] < len(prompts[s]) for s in prompts):
        batch = {}
        for s, r in reqs.items():
            nxt = [e for e in r.pieces if e > pos[s]]
            if nxt:
                batch[s] = prompts[s][pos[s] : nxt[0]]
        rt.run(batch)  # both requests' pieces in one batch
        for s in batch:
            pos[s] += len(batch[s])
            cache.reached(reqs[s], pos[s])
    for r in reqs.values():
        cache.finish(r)
    entries = list(cache.entries())
    assert sorted(e.length for e in entries) == [16, 16, 29, 32, 37]  # each prompt's own
    for e in entries:
        tokens = list(e.node.tokens())
        s = next(q for q, p in prompts.items() if p[: e.length] == tokens)
        solo = ModelRuntime(DEV, kind, 1, seed=5)
        prev = 0
        for end in [b for b in rt.calls[s] if b <= e.length]:  # the calls the batches made for s
            solo.run({0: tokens[prev:end]})
            prev = end
        got = rt.mem.state_write(e.device_seq, StateFlags.PARTIAL_ONLY)
        assert got == solo.mem.state_write(0, StateFlags.PARTIAL_ONLY), f"checkpoint at {e.length} of prompt {s}"


@pytest.mark.parametrize("n_rs_seq", [0, 2])
def test_a_short_last_chunk_never_writes_into_a_shared_entry(n_rs_seq):
    """vllm #56196: a short prefill chunk after a hit wrote its conv state into the
    shared prefix block.  Here every stored checkpoint's bytes stay as they were
    while later requests continue from them (short chunks, decode steps,
    speculative drafts rolled back)."""
    rt, cache, oracle = setup("hybrid", n_res=16, n_rs_seq=n_rs_seq)
    a = toks(4, 33)
    serve(rt, cache, oracle, 0, a)  # 16, 32, 33
    gen = [7, 8, ([9, 1], [2, 3])] if n_rs_seq else [7, 8, 9]
    for seq, prompt, hit in ((1, [*a[:16], 5], 16), (0, [*a[:32], 6], 32), (1, [*a[:33], 1], 33)):
        stored = {e.device_seq: (e, rt.mem.state_write(e.device_seq)) for e in cache.entries()}
        served = serve(rt, cache, oracle, seq, prompt, gen)  # a one-token last chunk right after the hit
        assert served.request.resume == hit
        for r, (e, blob) in stored.items():
            assert e.device_seq == r and e.node.entry is e  # nothing was evicted here
            assert rt.mem.state_write(r) == blob, f"checkpoint of {e.length} tokens under sequence {r} changed"
    check_invariants(cache)


def test_a_reused_checkpoint_row_never_leaks_a_previous_tenant():
    """vllm #56524: a recycled state row read before its new tenant wrote it.  Two
    reserved ids, no host tier: every checkpoint evicts and recycles; each hit on
    a recycled id and each cold start on a recycled cell equals its cold run."""
    rt, cache, oracle = setup("hybrid", n_res=2)
    used: dict[int, set[tuple[int, ...]]] = {}
    for k in range(6):
        prompt = toks(10 + k, 20 + k)
        serve(rt, cache, oracle, k % 2, prompt)
        again = serve(rt, cache, oracle, 1 - k % 2, [*prompt, 2, 3])
        assert again.request.resume == len(prompt)
        for e in cache.entries():
            used.setdefault(e.device_seq, set()).add(e.node.tokens())
    assert all(len(v) > 2 for v in used.values())  # every id had several tenants
    check_invariants(cache)


def test_tiers_that_share_host_memory_are_counted_once_each():
    """On a host backend the device tier is host memory too: each tier keeps its own
    budget and count, and the host-memory figure is their sum (never one hidden)."""
    from statecache.prefix import describe

    ckpt = describe(ModelRuntime(DEV, "recurrent", 1).mem).checkpoint_bytes
    rt, cache, oracle = setup("recurrent", device_budget=2 * ckpt, host_budget=1 << 20)
    assert cache.layout.host_memory
    serve(rt, cache, oracle, 0, toks(20, 40))
    st = cache.stats()
    assert st["entries_device"] == 2 and st["entries_host"] >= 1
    assert st["bytes_device"] == 2 * cache.layout.checkpoint_bytes
    assert st["bytes_host"] == sum(len(e.host_blob) for e in cache.entries() if e.host_blob is not None)
    assert st["bytes_in_host_memory"] == st["bytes_device"] + st["bytes_host"]
    check_invariants(cache)
