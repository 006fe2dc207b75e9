"""The cache's rules over a pool-free memory: where hits land, where checkpoints go,
tiers and budgets, pins, policies, refusals and the no-op warning."""

from __future__ import annotations

import io

import pytest
from sim_runtime import serve

from statecache.errors import ArgumentError, StateError
from statecache.prefix import (
    PrefixCache,
    PrefixCacheNoOpWarning,
    PrefixConfig,
    SimulatedMemory,
    check_invariants,
    get_policy,
)

CK = 4096  # the simulated checkpoint size


def make(n_res: int = 8, kind: str = "hybrid", **cfg):  # type: ignore[no-untyped-def]
    mem = SimulatedMemory(4 + n_res, kind=kind, checkpoint_bytes=CK)
    config = PrefixConfig(**{"chunk": 4, "interval": 8, "before_end": 2, **cfg})
    return mem, PrefixCache(mem, reserved=range(4, 4 + n_res), config=config)


P = list(range(1, 20))  # 19 tokens


def test_plan_checkpoints_and_pieces():
    mem, cache = make()
    req = serve(cache, mem, 0, P)
    assert req.resume == 0
    assert req.checkpoints == {8: "interval", 16: "interval", 17: "before_end", 19: "prompt_end"}
    assert req.pieces == (4, 8, 12, 16, 17, 19)  # chunk ends plus the checkpoints, no extra pass
    check_invariants(cache)
    # after a hit, pieces restart at the next chunk multiple (the runtime's grid is absolute)
    req = serve(cache, mem, 1, [*P[:18], 30, 31, 32])
    assert req.resume == 17 and req.pieces == (18, 19, 20, 21)
    assert req.checkpoints == {18: "junction", 19: "before_end", 21: "prompt_end"}


def test_hit_is_the_deepest_checkpoint_and_leaves_one_token():
    mem, cache = make()
    serve(cache, mem, 0, P, gen=[7, 7])
    for prompt, want in (
        (P, 17),  # the end of prompt 19 is a checkpoint, but one token must be left to compute
        ([*P, 7, 7, 1], 21),  # the next turn: end of generation
        ([*P, 7, 7], 19),
        (P[:12], 8),
        (P[:9], 8),
        (P[:8], 0),  # the checkpoint at 8 would leave nothing to compute
        ([2, *P], 0),
    ):
        m = cache.match(prompt)
        assert m.length == want, (len(prompt), m)
        assert m.part("recurrent") == want
        req = serve(cache, mem, 1, prompt)
        assert req.resume == want
    check_invariants(cache)


def test_attention_longer_than_recurrent_shrinks_to_the_checkpoint():
    mem, cache = make(end_of_prompt=False, before_end=0)
    serve(cache, mem, 0, P, gen=[7, 7, 7])  # checkpoints 8, 16 (interval) and 22 (generation)
    prompt = [*P, 9, 9]  # leaves the generation at 19
    m = cache.match(prompt)
    assert m.part("attention") == 19  # the generation checkpoint holds the cells of 0..21
    assert m.length == m.part("recurrent") == 16
    req = serve(cache, mem, 1, prompt)
    assert req.resume == 16 and req.checkpoints[19] == "junction"
    assert cache.match([*P, 9, 9, 9]).length == 19  # the junction made the whole shared prefix a hit


def test_extra_key_separates_namespaces():
    mem, cache = make()
    serve(cache, mem, 0, P, extra=b"image-1")
    assert cache.match(P).length == 0
    assert cache.match(P, extra=b"image-2").length == 0
    assert cache.match(P, extra=b"image-1").length == 17
    with pytest.raises(ArgumentError, match="extra"):
        cache.match(P, extra=1.5)  # type: ignore[arg-type]


def test_device_budget_spills_to_host_and_hits_promote():
    mem, cache = make(device_budget=2 * CK, host_budget=10**6)
    serve(cache, mem, 0, P)
    st = cache.stats()
    assert st["entries_device"] == 2 and st["entries_host"] == 2 and st["demotions"] == 2
    assert st["bytes_device"] == 2 * CK <= cache.device.budget
    host_len = min(e.length for e in cache.entries() if e.tier == "host")
    req = serve(cache, mem, 1, [*P[:host_len], 40, 41])
    assert req.resume == host_len and req.match.tier == "host"
    assert cache.stats()["promotions"] == 1
    assert next(e for e in cache.entries() if e.length == host_len).tier == "device"
    check_invariants(cache)


def test_pinned_entries_are_never_evicted_and_captures_skip_instead():
    mem, cache = make(n_res=1)  # one device slot, no host tier
    serve(cache, mem, 0, P)
    (only,) = list(cache.entries())
    req = cache.start(1, [*P[: only.length], 50, 51, 52, 53, 54])
    assert req.resume == only.length and only.pins == 1 and cache.device.protected == CK
    end = min(req.checkpoints)
    mem.absorb(1, req.prompt[req.resume : end])
    skipped = cache.metrics.captures_skipped
    assert not cache.reached(req, end)  # a checkpoint is planned there: no room, the pinned entry stays
    assert cache.metrics.captures_skipped == skipped + 1
    assert list(cache.entries()) == [only]
    check_invariants(cache)
    cache.cancel(req)
    assert only.pins == 0 and cache.device.evictable == CK
    check_invariants(cache)


def test_slru_protects_resume_points_where_lru_does_not():
    """Under pressure, routine checkpoints of a long unique prompt push the end of a
    conversation out of plain LRU, not out of the default policy."""
    turn = [*range(100, 112)]

    def run(policy: str) -> int:
        mem, cache = make(n_res=3, policy=policy, before_end=0)
        serve(cache, mem, 0, turn, gen=[1, 2])  # checkpoints: 8 (interval), 12 (prompt end), 14 (generation)
        serve(cache, mem, 1, [*range(200, 230)])  # 8, 16, 24 (interval), 30 (end)
        return cache.match([*turn, 1, 2, 3]).length

    assert run("lru") < 14
    assert run("slru") == 14


def test_value_policy_prefers_saved_work_per_byte():
    pol = get_policy("value", alpha=10.0)
    mem, cache = make()
    serve(cache, mem, 0, P)  # 8, 16, 17, 19: 17 and 19 save 1 and 2 tokens over their ancestors
    order = pol.order(list(cache.entries()), cache)
    assert [e.length for e in order][:2] == [17, 19]
    with pytest.raises(ArgumentError, match="known: adaptive, lru, slru, value"):
        get_policy("fifo")


def test_lost_checkpoint_is_never_restored():
    mem, cache = make()
    serve(cache, mem, 0, P)
    mem.seq_keep(0)  # a runtime's seq_keep drops every other sequence, reserved ones included
    req = serve(cache, mem, 1, P)
    assert req.resume == 0 and cache.metrics.lost >= 1
    check_invariants(cache, memory=False)  # lost entries off this prompt's path are found lazily
    assert cache.sweep() >= 1
    check_invariants(cache)


def test_bad_arguments_change_nothing():
    mem, cache = make()
    before = cache.stats()
    for call, arg in (
        (lambda: cache.start(5, P), "seq"),  # reserved
        (lambda: cache.start(99, P), "seq"),
        (lambda: cache.start(0, []), "prompt"),
        (lambda: cache.start(0, [1, -2]), "prompt"),
        (lambda: cache.start(0, P, extra=[1]), "extra"),
    ):
        with pytest.raises(ArgumentError) as info:
            call()
        assert info.value.argument == arg
    assert cache.stats() == before and not mem.seqs
    req = cache.start(0, P)
    with pytest.raises(ArgumentError, match="already runs"):
        cache.start(0, P)
    with pytest.raises(ArgumentError) as info:
        cache.reached(req, 5)
    assert info.value.argument == "end"
    with pytest.raises(ArgumentError, match="position -1"):
        cache.reached(req, 4)  # the runtime did not run it
    with pytest.raises(ArgumentError) as info:
        cache.finish(req, [1, 2])
    assert info.value.argument == "generated" and not req.done
    cache.cancel(req)
    with pytest.raises(ArgumentError, match="finished"):
        cache.reached(req, 4)
    for kw, name in (({"interval": 6}, "interval"), ({"chunk": 0}, "chunk"), ({"host_budget": -1}, "host_budget"),
                     ({"policy": "mru"}, "policy")):  # fmt: skip
        with pytest.raises(ArgumentError) as info:
            PrefixConfig(**kw)
        assert info.value.argument == name
    mem.absorb(0, [1])
    with pytest.raises(ArgumentError, match="reserved"):
        PrefixCache(mem, reserved=[0])  # sequence 0 holds state
    with pytest.raises(ArgumentError, match="reserved"):
        PrefixCache(mem, reserved=[4, 4])


def test_no_op_configuration_warns_once():
    mem = SimulatedMemory(8)
    with pytest.warns(PrefixCacheNoOpWarning, match="host budget"):
        PrefixCache(mem, reserved=(), config=PrefixConfig(chunk=4, interval=8))
    cfg = PrefixConfig(chunk=4, interval=64, before_end=0, end_of_prompt=False, end_of_generation=False)
    cache = PrefixCache(mem, reserved=[6, 7], config=cfg)
    with pytest.warns(PrefixCacheNoOpWarning, match="never gets a checkpoint") as rec:
        serve(cache, mem, 0, P)
        serve(cache, mem, 1, P)
    assert len(rec) == 1


def test_sim_save_load_roundtrip_and_refusals():
    mem, cache = make(host_budget=10**6)
    serve(cache, mem, 0, P, gen=[3])
    f = io.BytesIO()
    n = cache.save(f)
    assert n == len(list(cache.entries())) == 5
    mem2, cache2 = make(host_budget=10**6)
    assert cache2.load(f.getvalue()) == 5
    assert cache2.stats()["entries_host"] == 5  # loaded to the host tier, promoted on a hit
    req = serve(cache2, mem2, 0, [*P, 3, 8])
    assert req.resume == 20 and cache2.stats()["promotions"] == 1
    assert cache2.load(f.getvalue()) == 0  # present already
    data = bytearray(f.getvalue())
    for k in (20, len(data) // 2, len(data) - 40):
        bad = bytearray(data)
        bad[k] ^= 1
        before = cache2.stats()
        with pytest.raises(StateError):
            cache2.load(bytes(bad))
        assert cache2.stats() == before
    other = SimulatedMemory(8, kind="recurrent", checkpoint_bytes=CK)
    with pytest.raises(StateError, match="fingerprint"):
        PrefixCache(other, reserved=[7]).load(f.getvalue())
    check_invariants(cache2)


def test_clear_releases_everything():
    mem, cache = make()
    serve(cache, mem, 0, P)
    req = cache.start(1, P)
    cache.clear()
    assert not list(cache.entries()) and cache.store.free == 8 and cache.device.resident == 0
    assert all(mem.seq_pos_max(r) == -1 for r in cache.reserved)
    cache.cancel(req)
    check_invariants(cache)


def test_make_room_demotes_unpinned_device_entries():
    mem, cache = make(host_budget=10**6)
    serve(cache, mem, 0, P)
    held = cache.stats()["attention_tokens_held"]
    assert held == 19
    assert cache.make_room(attention_tokens=held)
    assert cache.stats()["attention_tokens_held"] == 0 and cache.stats()["entries_host"] == 4
    check_invariants(cache)


def test_attention_budget_limits_cells_held():
    mem, cache = make(attention_budget=20, host_budget=10**6)
    serve(cache, mem, 0, P)
    serve(cache, mem, 1, list(range(50, 66)))
    assert cache.tree.held_tokens <= 20
    check_invariants(cache)


def test_adaptive_keeps_the_states_conversations_resume_from():
    """Two conversations take turns; each turn's long tool output leaves routine checkpoints
    and the turn before lies on a chain below the new end.  With room for three
    checkpoints, the default policy keeps both conversations' last ends of generation
    (every turn after the first resumes there); plain LRU does not."""

    def run(policy: str) -> list[int]:
        mem, cache = make(n_res=3, policy=policy, before_end=2)
        ctx = {0: [*range(100, 106)], 1: [*range(200, 206)]}
        resumed = []
        for turn in range(5):
            for conv in (0, 1):
                tool = [1000 * (conv + 1) + 10 * turn + k for k in range(9)]
                gen = [7, 8, 9]
                prompt = ctx[conv] + tool
                req = serve(cache, mem, conv, prompt, gen)
                if turn:
                    resumed.append(req.resume == len(ctx[conv]))
                ctx[conv] = prompt + gen
        check_invariants(cache)
        return resumed

    assert all(run("adaptive"))
    assert not all(run("lru"))
