"""Meta-tests: the invariant checks and the conformance cases catch what they claim to.

* one skipped counter move (a pin step, a held-token step) raises InvariantError;
* check_invariants works under ``python -O`` (no asserts);
* a broken store (restoring another checkpoint, capturing one token late) or a
  cache that trusts the attention length is caught by the prefix conformance cases;
* layouts of every memory kind, refusals of what the cache cannot serve, and
  the sizing helpers against the memories' own buffers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from sim_runtime import serve

import statecache
from statecache.conformance.cases import ConformanceFailure
from statecache.conformance.prefix_cases import build_memory, exact_hits, refusals
from statecache.errors import ArgumentError
from statecache.prefix import (
    InvariantError,
    PrefixCache,
    PrefixConfig,
    SimulatedMemory,
    attention_bytes_per_token,
    budget_for,
    check_invariants,
    checkpoint_bytes,
    checkpoints_in,
    describe,
    reserved_ids_for,
)
from statecache.prefix.pool import Tier
from statecache.prefix.store import ParkedStore
from statecache.prefix.tree import Tree

DEV = statecache.get_device("reference")
P = list(range(1, 20))


def sim_cache():  # type: ignore[no-untyped-def]
    mem = SimulatedMemory(12)
    cache = PrefixCache(mem, reserved=range(4, 12), config=PrefixConfig(chunk=4, interval=8, before_end=2))
    serve(cache, mem, 0, P)
    return mem, cache


def test_a_skipped_pin_step_is_caught(monkeypatch):
    _, cache = sim_cache()
    monkeypatch.setattr(Tier, "pin_step", lambda self, nbytes, before, after: None)
    cache.start(1, P)  # pins the hit entry, but its bytes stay "evictable"
    with pytest.raises(InvariantError) as info:
        check_invariants(cache)
    assert info.value.invariant == "P5"


def test_a_skipped_hold_step_is_caught():
    _, cache = sim_cache()
    cache.tree.held_tokens += 1
    with pytest.raises(InvariantError, match="P4"):
        check_invariants(cache)
    cache.tree.held_tokens -= 1
    e = next(iter(cache.entries()))
    e.host_blob = b"also on the host"
    with pytest.raises(InvariantError, match="P6"):
        check_invariants(cache)


def test_a_node_without_entry_and_one_child_is_caught(monkeypatch):
    mem, cache = sim_cache()
    monkeypatch.setattr(Tree, "_prune", lambda self, node: None)  # no merge after a removal
    cache.make_room(attention_tokens=cache.tree.held_tokens)  # no host tier: everything dropped
    serve(cache, mem, 1, [*P[:10], 50])
    serve(cache, mem, 2, [*P[:10], 60])
    cache.clear()
    with pytest.raises(InvariantError, match="P3"):
        check_invariants(cache)


def test_checks_survive_python_O():
    code = textwrap.dedent(
        """
        from statecache.prefix import PrefixCache, PrefixConfig, SimulatedMemory, check_invariants, InvariantError
        mem = SimulatedMemory(8)
        cache = PrefixCache(mem, reserved=[6, 7], config=PrefixConfig(chunk=4, interval=8))
        req = cache.start(0, list(range(10)))
        mem.absorb(0, list(range(8)))
        cache.reached(req, 8)
        cache.device.evictable += 1
        try:
            check_invariants(cache)
        except InvariantError as e:
            print("caught", e.invariant)
        """
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "caught P5"


def test_the_cold_oracle_catches_a_store_that_restores_another_tenant(monkeypatch):
    """A store that restores the checkpoint of another prompt at the same length:
    every position checks out, the outputs do not."""
    from statecache.conformance.prefix_cases import ColdOracle, ModelRuntime
    from statecache.conformance.prefix_cases import serve as serve_model

    def wrong(self, handle, seq, length):  # type: ignore[no-untyped-def]
        twin = [r for r in self.reserved if r != handle and self.memory.seq_pos_max(r) == length - 1]
        self.memory.seq_cp(twin[0] if twin else handle, seq)

    rt = ModelRuntime(DEV, "hybrid", 8, seed=2)
    cache = PrefixCache(rt.mem, reserved=range(2, 8), config=PrefixConfig(chunk=8, interval=16, before_end=0))
    oracle = ColdOracle(lambda: ModelRuntime(DEV, "hybrid", 1, seed=9))
    x, y = [1, 2, 3] * 7, [4, 5, 6] * 7  # both checkpointed at 16 and 21
    serve_model(rt, cache, oracle, 0, x)
    serve_model(rt, cache, oracle, 1, y)
    serve_model(rt, cache, oracle, 0, [*x[:18], 9])  # the right store passes
    monkeypatch.setattr(ParkedStore, "restore", wrong)
    with pytest.raises(ConformanceFailure, match="differ from the cold run"):
        serve_model(rt, cache, oracle, 1, [*y[:18], 9])


def test_conformance_catches_a_checkpoint_filed_under_other_tokens(monkeypatch):
    """A cache that files a state under a key differing in its last token (a wrong
    block hash): positions all check out, the state does not."""
    from statecache.conformance.model import VOCAB
    from statecache.prefix import cache as cache_mod

    orig = cache_mod.PrefixCache._capture

    def misfiled(self, seq, ns, tokens, origin):  # type: ignore[no-untyped-def]
        return orig(self, seq, ns, (*tokens[:-1], (tokens[-1] + 1) % VOCAB), origin)

    monkeypatch.setattr(cache_mod.PrefixCache, "_capture", misfiled)
    with pytest.raises(ConformanceFailure):
        exact_hits(DEV, "recurrent", 1)


def test_conformance_catches_a_cache_that_trusts_the_attention_length(monkeypatch):
    from statecache.prefix import cache as cache_mod

    orig = cache_mod.PrefixCache._match

    def attention_wins(self, walk, n):  # type: ignore[no-untyped-def]
        m = orig(self, walk, n)
        return cache_mod.PrefixMatch(max(m.length, m.parts[0][1]), m.matched, m.tier, m.parts)

    monkeypatch.setattr(cache_mod.PrefixCache, "_match", attention_wins)
    with pytest.raises(ConformanceFailure, match="hit"):
        refusals(DEV, "hybrid", 1)


@pytest.mark.parametrize(
    ("kind", "parts"),
    [
        ("recurrent", ("recurrent",)),
        ("hybrid", ("attention", "recurrent")),
        ("hybrid_iswa", ("attention", "swa", "recurrent")),
        ("hybrid_idx", ("attention", "indexer", "recurrent")),
    ],
)
def test_layouts_and_sizing_agree_with_the_buffers(kind, parts):
    from statecache.conformance.model import A_DIM, A_HEADS_KV
    from statecache.prefix.store import Layout

    mem = build_memory(DEV, kind, 3, seed=0)
    layout = describe(mem)
    assert isinstance(layout, Layout) and layout.kind == kind and layout.parts == parts
    recr = mem if kind == "recurrent" else mem.recr
    rows = sum(b.shape[1] * b.dtype.itemsize for p in recr.pools.values() for b in p.values())
    swa = 6 * 2 * A_HEADS_KV * A_DIM * 4 if kind == "hybrid_iswa" else 0  # n_swa cells of K and V
    assert layout.checkpoint_bytes == rows + swa
    spec = _spec_of(kind)
    assert checkpoint_bytes(spec) == layout.checkpoint_bytes
    assert attention_bytes_per_token(spec) == layout.attention_bytes_per_token
    assert checkpoints_in(budget_for(7, spec) + 1, spec) == 7
    assert reserved_ids_for(4, budget_for(10, spec), spec) == (14, 10)
    assert reserved_ids_for(250, budget_for(10, spec), spec) == (256, 6)
    assert describe(build_memory(DEV, kind, 3, seed=1)).fingerprint == layout.fingerprint


def _spec_of(kind):  # type: ignore[no-untyped-def]
    from statecache.conformance.model import A_DIM, A_HEADS_KV, HYBRID_LAYERS, RECURRENT_LAYERS, memory_spec
    from statecache.spec import AttentionLayerSpec, IndexerSpec, ModelSpec

    if kind == "recurrent":
        return memory_spec("f32", RECURRENT_LAYERS)
    rec = memory_spec("f32", HYBRID_LAYERS)
    swa = kind == "hybrid_iswa"
    return ModelSpec.build(
        4,
        recurrent={i: s for i, s in enumerate(rec.layers) if s is not None},
        attention={i: AttentionLayerSpec(A_HEADS_KV, A_DIM, swa=swa and i == 3) for i in (1, 3)},
        dtype="f32",
        kv_dtype="f32",
        n_swa=6 if swa else 0,
        indexer=IndexerSpec((1,), head_size=2, row_factor=2) if kind == "hybrid_idx" else None,
    )


def test_memories_the_cache_cannot_serve_are_refused():
    from statecache.factory import make_memory
    from statecache.kv_cache import KVCache, KVLayer

    kv = KVCache(DEV, [KVLayer(0, 4, 4)], size=16, n_seq_max=2)
    with pytest.raises(ArgumentError, match="no recurrent part"):
        PrefixCache(kv, reserved=[1])
    split = make_memory(_spec_of("hybrid"), DEV, 3, n_ctx=16, unified=False)
    with pytest.raises(ArgumentError, match="unified"):
        PrefixCache(split, reserved=[2])
    other = build_memory(DEV, "hybrid", 3, seed=0)
    with pytest.raises(ArgumentError, match="outside"):
        PrefixCache(other, reserved=[3])


def test_no_memory_imports_the_prefix_cache_and_it_imports_no_backend():
    import ast
    import pathlib

    core = pathlib.Path(statecache.__file__).parent
    for path in core.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.startswith("statecache.prefix")], f"{path.name} imports statecache.prefix"
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'cffi', '_cffi_backend', 'pyopencl'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import statecache.prefix, statecache.prefix.sim
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
