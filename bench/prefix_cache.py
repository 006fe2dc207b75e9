"""Prefix caching of recurrent / hybrid state: how much prompt work each policy saves.

    python bench/prefix_cache.py                  # counting mode: every trace kind, 3 budgets (~1 min)
    python bench/prefix_cache.py --real           # + real-model mode: prefill time on small traces (cpu device)
    python bench/prefix_cache.py --kinds chat,short --scale 0.5

Two modes, both driving the real :class:`statecache.prefix.PrefixCache`
(tree, tiers, policies) for "ours" and for the block-grid baseline:

* **counting** (default): the cache runs over
  :class:`statecache.prefix.SimulatedMemory` (token tuples as states,
  checkpoint bytes of the conformance suite's tiny hybrid model), so full-size
  traces (prompts of thousands of tokens, hundreds of requests) run in
  seconds.  It reports the fraction of prompt tokens each method recomputes.
* **real** (``--real``): the tiny hybrid model of the conformance suite on
  the cpu device (reference device when the cpu backend is missing), on
  traces scaled down 16x (blocks of 32 tokens), reporting the measured
  prefill time (prompt pieces computed, restores included) next to the
  recomputed fraction, relative to no cache.

Trace kinds (synthetic, fixed seeds): ``chat`` (multi-turn conversations over
two shared system prompts), ``agent`` (transcripts growing by tool outputs of
heavy-tailed length), ``shared`` (many requests sharing one of four long
prefixes cut at arbitrary positions, then a unique suffix), ``short``
(prompts shorter than one 512-token block over one system prompt),
``resend`` (conversations re-sent with the last few prompt tokens of the
previous turn changed, or its thinking block stripped).

Methods: ``no cache``; ``last state`` (one state per live sequence slot, a
request hits only when a slot's tokens are a proper prefix of its prompt:
llama.cpp server style); ``grid-512 lru`` (states at every multiple of 512
tokens, prefill and decode, LRU: vLLM ``align`` style, our cache configured
so); ``oracle`` (unlimited memory: every token some earlier request had as a
prefix is reused, the lower bound); ``ours <policy>`` (end of prompt, end of
generation, junction, 32 before the end of each prompt, every 256 tokens on
the runtime's 256-token chunks; each eviction policy).  Every cached method gets the same
device budget, in checkpoints of the tiny model's state (bytes printed).

Targets checked and printed: at the largest budget, (ours - oracle) /
(grid - oracle) <= 0.5 on every kind; at every budget, ours with the default
policy recomputes no more than any other method; short prompts hit.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statecache.prefix import (
    DEFAULT_POLICY,
    POLICIES,
    PrefixCache,
    PrefixCacheNoOpWarning,
    PrefixConfig,
    SimulatedMemory,
    checkpoint_bytes,
)

BLOCK = 512  # the grid baseline's block
CHUNK = 256  # the runtime's prefill chunk (ubatch), for every method
LIVE = 8  # concurrent sequences of the runtime (and slots of "last state")
BUDGETS = (8, 32, 240)
#: recomputed fractions closer than this (0.1% of the prompt tokens) count as equal in the targets
TIE = 1e-3  # device checkpoints (240: what 248 reserved ids of a 256-sequence memory hold)
VOCAB = 50_000


@dataclasses.dataclass(frozen=True)
class Req:
    conv: int
    prompt: tuple[int, ...]
    gen: tuple[int, ...]


# -- traces ----------------------------------------------------------------------------


class _Gen:
    def __init__(self, seed: int, scale: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.scale = scale

    def n(self, lo: int, hi: int) -> int:
        return max(1, int(self.rng.integers(max(1, int(lo * self.scale)), max(2, int(hi * self.scale)) + 1)))

    def toks(self, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.rng.integers(0, VOCAB, n))


def _interleave(rng: np.random.Generator, convs: list[list[Req]]) -> list[Req]:
    """Requests of all conversations, each conversation's turns in order."""
    out: list[Req] = []
    pos = [0] * len(convs)
    left = [c for c in range(len(convs)) if convs[c]]
    while left:
        c = int(rng.choice(left))
        out.append(convs[c][pos[c]])
        pos[c] += 1
        if pos[c] == len(convs[c]):
            left.remove(c)
    return out


def trace_chat(g: _Gen) -> list[Req]:
    systems = [g.toks(g.n(800, 800)), g.toks(g.n(1500, 1500))]
    convs = []
    for c in range(24):
        ctx = systems[c % 2]
        turns = []
        for _ in range(5):
            prompt = ctx + g.toks(g.n(30, 300))
            gen = g.toks(g.n(80, 400))
            turns.append(Req(c, prompt, gen))
            ctx = prompt + gen
        convs.append(turns)
    return _interleave(g.rng, convs)


def trace_agent(g: _Gen) -> list[Req]:
    system = g.toks(g.n(1000, 1000))
    convs = []
    for c in range(8):
        ctx = system + g.toks(g.n(50, 200))  # the task
        steps = []
        for _ in range(12):
            gen = g.toks(g.n(30, 150))  # the model's action
            steps.append(Req(c, ctx, gen))
            tool = int(min(4000, 40 * (1 + g.rng.pareto(1.1))) * g.scale) + 1  # heavy-tailed tool output
            ctx = ctx + gen + g.toks(tool)
        convs.append(steps)
    return _interleave(g.rng, convs)


def trace_shared(g: _Gen) -> list[Req]:
    prefixes = [g.toks(g.n(2000, 6000)) for _ in range(4)]
    out = []
    for k in range(120):
        p = prefixes[int(g.rng.integers(0, 4))]
        cut = int(len(p) * g.rng.uniform(0.3, 1.0))
        out.append(Req(k, p[:cut] + g.toks(g.n(20, 200)), g.toks(g.n(20, 100))))
    return out


def trace_short(g: _Gen) -> list[Req]:
    system = g.toks(g.n(180, 180))
    return [Req(k, system + g.toks(g.n(10, 250)), g.toks(g.n(20, 100))) for k in range(150)]


def trace_resend(g: _Gen) -> list[Req]:
    system = g.toks(g.n(600, 600))
    convs = []
    for c in range(24):
        turns = []
        prompt = system + g.toks(g.n(30, 300))
        for _ in range(4):
            think, answer = g.toks(g.n(50, 300)), g.toks(g.n(40, 200))
            turns.append(Req(c, prompt, think + answer))
            if g.rng.random() < 0.5:  # the template re-renders the last few prompt tokens
                k = int(g.rng.integers(1, 25))
                prev = prompt[:-k] + g.toks(k) + think + answer
            else:  # the thinking block is stripped from the history
                prev = prompt + answer
            prompt = prev + g.toks(g.n(30, 300))
        convs.append(turns)
    return _interleave(g.rng, convs)


TRACES: dict[str, Callable[[_Gen], list[Req]]] = {
    "chat": trace_chat,
    "agent": trace_agent,
    "shared": trace_shared,
    "short": trace_short,
    "resend": trace_resend,
}


# -- methods (counting mode) --------------------------------------------------------------


class Method:
    name = ""

    def serve(self, r: Req, seq: int) -> int:
        """Serve one request on live sequence ``seq``; returns the prompt tokens recomputed."""
        raise NotImplementedError

    def memory(self) -> str:
        return ""


class NoCache(Method):
    name = "no cache"

    def serve(self, r: Req, seq: int) -> int:
        return len(r.prompt)


class LastState(Method):
    """One state per slot; a request reuses a slot whose tokens are a proper prefix of it."""

    name = "last state"

    def __init__(self, slots: int, ckpt: int) -> None:
        self.slots: list[tuple[int, ...]] = [() for _ in range(slots)]
        self.ckpt = ckpt

    def serve(self, r: Req, seq: int) -> int:
        best, hit = 0, 0
        for k, s in enumerate(self.slots):
            if 0 < len(s) < len(r.prompt) and r.prompt[: len(s)] == s and len(s) > hit:
                best, hit = k, len(s)
        if not hit:  # a new request takes the least useful slot: the one it shares least with
            best = min(range(len(self.slots)), key=lambda k: _lcp(self.slots[k], r.prompt))
        self.slots[best] = r.prompt + r.gen
        return len(r.prompt) - hit

    def memory(self) -> str:
        return f"{len(self.slots)} states = {len(self.slots) * self.ckpt} B"


class Oracle(Method):
    """Unlimited memory: reuse the longest prefix any earlier request had (a trie of all tokens)."""

    name = "oracle"

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}

    def serve(self, r: Req, seq: int) -> int:
        node, m = self.root, 0
        for t in r.prompt:
            if t not in node:
                break
            node = node[t]
            m += 1
        node = self.root
        for t in r.prompt + r.gen:
            node = node.setdefault(t, {})
        return len(r.prompt) - min(m, len(r.prompt) - 1)


class Cached(Method):
    """A PrefixCache over a simulated memory (ours, or configured as the block grid)."""

    def __init__(self, name: str, config: PrefixConfig, ckpt: int, n_res: int, grid_decode: bool = False) -> None:
        self.name = name
        self.mem = SimulatedMemory(LIVE + n_res, kind="hybrid", checkpoint_bytes=ckpt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrefixCacheNoOpWarning)
            self.cache = PrefixCache(self.mem, reserved=range(LIVE, LIVE + n_res), config=config)
        self.grid_decode = grid_decode
        self.peak = 0
        self.peak_cells = 0

    def serve(self, r: Req, seq: int) -> int:
        cache, mem = self.cache, self.mem
        req = cache.start(seq, r.prompt)
        prev = req.resume
        for end in req.pieces:
            mem.absorb(seq, r.prompt[prev:end])
            prev = end
            cache.reached(req, end)
        if self.grid_decode:  # vLLM caches a block's state when decode fills it too
            n = len(r.prompt)
            done = 0
            for b in range((n // BLOCK + 1) * BLOCK, n + len(r.gen) + 1, BLOCK):
                mem.absorb(seq, r.gen[done : b - n])
                done = b - n
                cache.checkpoint(req, r.gen[:done])
            mem.absorb(seq, r.gen[done:])
        else:
            mem.absorb(seq, r.gen)
        cache.finish(req, r.gen)
        self.peak = max(self.peak, cache.device.resident + cache.host.resident)
        self.peak_cells = max(self.peak_cells, cache.tree.held_tokens)
        return len(r.prompt) - req.resume

    def memory(self) -> str:
        return f"peak {self.peak} B, {self.peak_cells} attention cells"


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def ours_config(policy: str, budget: int, chunk: int = CHUNK, interval: int = CHUNK, before: int = 32) -> PrefixConfig:
    return PrefixConfig(chunk=chunk, interval=interval, before_end=before, device_budget=budget, policy=policy)


def grid_config(budget: int, block: int = BLOCK, chunk: int = CHUNK) -> PrefixConfig:
    return PrefixConfig(
        chunk=chunk, interval=block, before_end=0, junction=False, end_of_prompt=False, end_of_generation=False,
        device_budget=budget, policy="lru",
    )  # fmt: skip


def methods(n_ckpt: int, ckpt: int) -> list[Method]:
    budget = n_ckpt * ckpt
    out: list[Method] = [
        NoCache(),
        LastState(LIVE, ckpt),
        Cached("grid-512 lru", grid_config(budget), ckpt, n_ckpt, True),
    ]
    out.append(Oracle())
    for pol in [DEFAULT_POLICY, *sorted(p for p in POLICIES if p != DEFAULT_POLICY)]:
        out.append(Cached(f"ours {pol}", ours_config(pol, budget), ckpt, n_ckpt))
    return out


#: the no-op warnings each method raised (the grid's, on prompts shorter than a block)
WARNED: dict[str, str] = {}


def run_trace(trace: list[Req], ms: list[Method]) -> dict[str, float]:
    total = sum(len(r.prompt) for r in trace)
    out = {}
    for m in ms:
        seqs: dict[int, int] = {}
        recomputed = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PrefixCacheNoOpWarning)
            for r in trace:
                seq = seqs.setdefault(r.conv, len(seqs) % LIVE)
                recomputed += m.serve(r, seq)
        for w in caught:
            WARNED.setdefault(m.name, str(w.message))
        out[m.name] = recomputed / total
    return out


# -- real-model mode ---------------------------------------------------------------------------


def real_mode(kinds: Sequence[str], seed: int, scale: float = 1 / 8, n_req: int = 30) -> None:
    """The tiny hybrid model on the cpu device, traces scaled down (blocks and chunks with them)."""
    import statecache
    from statecache.conformance.prefix_cases import ModelRuntime
    from statecache.prefix import describe

    try:
        dev = statecache.get_device("cpu")
    except Exception:  # no compiled cpu backend here
        dev = statecache.get_device("reference")
    block, n_ckpt = max(2, int(BLOCK * scale)), 32
    chunk = max(1, int(CHUNK * scale))
    print(
        f"\nreal mode: tiny hybrid model on {dev.id}; first {n_req} requests of each trace scaled by {scale:g}; "
        f"grid blocks of {block}, chunks of {chunk}, {n_ckpt} device checkpoints"
    )
    print("  prefill = wall time of the prompt pieces and restores; model = the forward passes inside it")
    print(
        f"{'kind':<8} {'method':<14} {'recomputed':>10} {'prefill s':>10} {'model s':>8} {'vs none':>8} "
        f"{'model vs none':>14}"
    )
    for kind in kinds:
        trace = TRACES[kind](_Gen(seed, scale))[:n_req]
        n_ctx = max(len(r.prompt) + len(r.gen) for r in trace) + 8
        total = sum(len(r.prompt) for r in trace)
        base: tuple[float, float] | None = None
        for name in ("no cache", "grid lru", f"ours {DEFAULT_POLICY}"):
            rt = _real_runtime(ModelRuntime, dev, LIVE + n_ckpt, n_ctx)
            ckpt = describe(rt.mem).checkpoint_bytes
            if name == "no cache":
                cfg = None
            elif name == "grid lru":
                cfg = grid_config(n_ckpt * ckpt, block, chunk)
            else:
                cfg = ours_config(
                    DEFAULT_POLICY, n_ckpt * ckpt, chunk=chunk, interval=chunk, before=max(1, int(32 * scale))
                )
            t, model, rec = _real_run(rt, cfg, trace, n_ckpt, chunk)
            base = (t, model) if base is None else base
            print(
                f"{kind:<8} {name:<14} {rec / total:>10.3f} {t:>10.2f} {model:>8.2f} {t / base[0]:>8.2f} "
                f"{model / base[1]:>14.2f}"
            )


def _real_runtime(cls: Any, dev: Any, n_seq_max: int, n_ctx: int) -> Any:
    from statecache.conformance import prefix_cases

    old = prefix_cases.N_CTX
    prefix_cases.N_CTX = n_ctx
    try:
        return cls(dev, "hybrid", n_seq_max, seed=1)
    finally:
        prefix_cases.N_CTX = old


def _real_run(rt: Any, cfg: PrefixConfig | None, trace: list[Req], n_res: int, chunk: int) -> tuple[float, float, int]:
    """Prefill seconds (pieces + restores), the model's share of them, prompt tokens recomputed."""
    rng = np.random.default_rng(0)
    vocab = 24
    fold = {}

    def f(t: int) -> int:  # the tiny model's vocabulary is 24: fold ids, keeping distinct prefixes distinct enough
        if t not in fold:
            fold[t] = int(rng.integers(0, vocab))
        return fold[t]

    cache = None
    if cfg is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PrefixCacheNoOpWarning)
            cache = PrefixCache(rt.mem, reserved=range(LIVE, LIVE + n_res), config=cfg)
        cache._warned = True  # the counting mode reports the warnings
    seqs: dict[int, int] = {}
    spent, model, rec = 0.0, 0.0, 0
    for r in trace:
        seq = seqs.setdefault(r.conv, len(seqs) % LIVE)
        prompt = [f(t) for t in r.prompt]
        gen = [f(t) for t in r.gen]
        t0, m0 = time.perf_counter(), rt.compute_s
        if cache is None:  # the same runtime chunks, from zero
            rt.mem.seq_rm(seq, -1, -1)
            for a in range(0, len(prompt), chunk):
                rt.run({seq: prompt[a : a + chunk]})
            rec += len(prompt)
        else:
            req = cache.start(seq, prompt)
            rec += len(prompt) - req.resume
            prev = req.resume
            for end in req.pieces:
                rt.run({seq: prompt[prev:end]})
                prev = end
                cache.reached(req, end)
        spent += time.perf_counter() - t0
        model += rt.compute_s - m0
        rt.run({seq: gen})  # generation, not timed (teacher-forced in one call)
        if cache is not None:
            cache.finish(req, gen)
    return spent, model, rec


# -- report -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(TRACES), help=f"trace kinds ({', '.join(TRACES)})")
    ap.add_argument("--scale", type=float, default=1.0, help="scale every length of the traces")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also run the real-model mode (prefill time)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(TRACES)
    if unknown:
        ap.error(f"unknown trace kinds {sorted(unknown)}; known: {', '.join(TRACES)}")
    from statecache.conformance.model import A_DIM, A_HEADS_KV, HYBRID_LAYERS, memory_spec
    from statecache.spec import AttentionLayerSpec, ModelSpec

    rec = memory_spec("f32", HYBRID_LAYERS)
    spec = ModelSpec.build(
        4, recurrent={i: s for i, s in enumerate(rec.layers) if s is not None},
        attention={1: AttentionLayerSpec(A_HEADS_KV, A_DIM), 3: AttentionLayerSpec(A_HEADS_KV, A_DIM)},
        dtype="f32", kv_dtype="f32",
    )  # fmt: skip
    ckpt = checkpoint_bytes(spec)
    print(f"counting mode: checkpoint = {ckpt} B (tiny hybrid model, f32); {LIVE} live sequences; blocks of {BLOCK}")
    print("budgets: " + ", ".join(f"{n} checkpoints = {n * ckpt} B" for n in BUDGETS))
    failures: list[str] = []
    header = f"{'kind':<7} {'budget':>6}  " + "  ".join(f"{m.name:>13}" for m in methods(1, ckpt))
    print(header)
    t0 = time.perf_counter()
    for kind in kinds:
        trace = TRACES[kind](_Gen(args.seed, args.scale))
        results = {}
        for n_ckpt in BUDGETS:
            ms = methods(n_ckpt, ckpt)
            res = run_trace(trace, ms)
            results[n_ckpt] = res
            print(f"{kind:<7} {n_ckpt:>6}  " + "  ".join(f"{res[m.name]:>13.4f}" for m in ms))
            if n_ckpt == max(BUDGETS):
                used = [f"{m.name}: {m.memory()}" for m in ms if m.memory()]
                print(f"{'':<7} {'':>6}  memory used at {n_ckpt} checkpoints: " + "; ".join(used))
        failures += check_targets(kind, results)
        n_prompt = sum(len(r.prompt) for r in trace)
        print(f"{'':<7} {'':>6}  {len(trace)} requests, {n_prompt} prompt tokens")
    print(f"counting mode took {time.perf_counter() - t0:.1f} s")
    for name, msg in WARNED.items():
        print(f"{name} warned once per cache: {msg}")
    if args.real:
        real_mode(kinds, args.seed)
    print(
        f"\ntargets (fractions within {TIE} count as equal): "
        + ("all met" if not failures else f"{len(failures)} missed")
    )
    for f in failures:
        print("  " + f)
    return 0


def check_targets(kind: str, results: dict[int, dict[str, float]]) -> list[str]:
    out = []
    big = results[max(results)]
    ours, grid, oracle = big[f"ours {DEFAULT_POLICY}"], big["grid-512 lru"], big["oracle"]
    gap = grid - oracle
    ratio = (ours - oracle) / gap if gap > 0 else (0.0 if ours <= oracle + 1e-12 else float("inf"))
    verdict = "ok" if ratio <= 0.5 else "MISSED"
    print(f"{'':<7} {'':>6}  (ours - oracle) / (grid - oracle) at {max(results)} checkpoints: {ratio:.3f} {verdict}")
    if ratio > 0.5:
        out.append(f"{kind}: (ours - oracle) / (grid - oracle) = {ratio:.3f} > 0.5 at {max(results)} checkpoints")
    for n, res in results.items():
        mine = res[f"ours {DEFAULT_POLICY}"]
        for name, v in res.items():
            if name != "oracle" and v < mine - TIE:
                why = ""
                if name == "last state" and n <= LIVE:
                    why = (
                        f" (why: with {n} checkpoints, as many as last state's {LIVE} slots, ours also keeps the "
                        "shared prefix every new request hits, so one running sequence per round falls back to it)"
                    )
                out.append(f"{kind}, {n} checkpoints: ours {DEFAULT_POLICY} recomputes {mine:.4f}, {name} {v:.4f}{why}")
    if kind == "short" and big[f"ours {DEFAULT_POLICY}"] >= big["no cache"]:
        out.append("short: prompts shorter than a block never hit")
    return out


if __name__ == "__main__":
    sys.exit(main())
