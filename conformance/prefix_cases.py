"""Prefix-cache cases: :class:`statecache.prefix.PrefixCache` over the tiny model
of ``model.py`` on the device under test.

What "exact" means here.  A hit restores a state some earlier run produced
after exactly those tokens; continuing from it must give, bitwise, the
outputs of a *cold run* of the same tokens from an empty memory.  Kernels may
legitimately round differently when a sequence is split into calls at other
points (the metamorphic ``chunked`` cases hold them to NMSE, not bits), so
the cold run makes the same calls: the call boundaries of the run that
produced the restored state, then those of the warm run.  The
:class:`ColdOracle` learns those boundaries from the runs themselves (every
piece end of every request), never from the cache, and when several earlier
runs reached the same tokens through different boundaries it accepts the
warm run if it equals the cold run of one of them.  A restored state that no
earlier run produced, or one at the wrong position, or with another tenant's
bytes, matches none.  Where the model has no sliding window, every warm
output is also compared with the one-call recompute on the reference device
(NMSE, as the memory cases do), which no self-consistent mistake passes.

Scenarios, per memory kind (recurrent, hybrid, hybrid-iSWA, hybrid-idx):

* ``exact_hits``: routine, before-end, end-of-prompt, end-of-generation and
  junction checkpoints are hit where they should be (the resume positions are
  asserted) and every continuation equals its cold run.
* ``refusals``: attention cells cover more than the recurrent checkpoints
  (the hit shrinks to the deepest checkpoint, and every part of the sequence
  is at that position); a checkpoint dropped behind the cache's back is never
  restored (the hit shrinks, ``lost`` counts it); a corrupt or mismatched
  cache file and bad arguments change nothing.
* ``tiers``: a device tier of two checkpoints spilling to a host tier: hits
  from the host tier (and their promotion) and after a save / load into a
  fresh memory are exact.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from statecache.backend import Device
from statecache.conformance.cases import Case, ConformanceFailure, Requirement, assert_close, reference_device
from statecache.conformance.model import (
    HYBRID_LAYERS,
    RECURRENT_LAYERS,
    VOCAB,
    StepMixers,
    Weights,
    forward,
    memory_spec,
    recompute,
    rope_k_shift,
)

#: Positions per sequence in the KV caches, their padding, the window of the
#: iSWA model's sliding layer (layer 3), the indexer of the hybrid-idx model.
N_CTX = 96
N_PAD = 8
N_SWA = 6
KINDS = ("recurrent", "hybrid", "hybrid_iswa", "hybrid_idx")
LOGITS_NMSE = 1e-6  # f32, as the memory cases


def model_layers(kind: str) -> tuple[str, ...]:
    return RECURRENT_LAYERS if kind == "recurrent" else HYBRID_LAYERS


def build_memory(dev: Device, kind: str, n_seq_max: int, seed: int, n_rs_seq: int = 0, dtype: str = "f32") -> Any:
    """A garbage-filled memory of the tiny model, of one of :data:`KINDS`."""
    from statecache.conformance.model import A_DIM, A_HEADS_KV
    from statecache.factory import make_memory
    from statecache.spec import AttentionLayerSpec, IndexerSpec, ModelSpec

    if kind not in KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; known: {KINDS}")
    layers = model_layers(kind)
    rec = memory_spec(dtype, layers)
    if kind == "recurrent":
        mem = make_memory(rec, dev, n_seq_max, n_rs_seq)
        for L, pools in mem.pools.items():
            for k, name in enumerate(sorted(pools)):
                dev.fill_bytes(pools[name], seed * 100 + L * 10 + k)
        return mem
    swa = kind == "hybrid_iswa"
    att = {i: AttentionLayerSpec(A_HEADS_KV, A_DIM, swa=swa and i == 3) for i, k in enumerate(layers) if k == "attn"}
    spec = ModelSpec.build(
        len(layers),
        recurrent={i: s for i, s in enumerate(rec.layers) if s is not None},
        attention=att,
        dtype=dtype,
        kv_dtype=dtype,
        n_swa=N_SWA if swa else 0,
        indexer=IndexerSpec((1,), head_size=2, row_factor=2, kpool=4) if kind == "hybrid_idx" else None,
    )
    mem = make_memory(
        spec, dev, n_seq_max, n_rs_seq, n_ctx=N_CTX, unified=True, n_pad=N_PAD, n_ubatch=64, k_shift=rope_k_shift
    )
    mem.fill_garbage(seed)
    return mem


class _Mixers(StepMixers):
    """StepMixers that route each attention layer to its cache of an iSWA pair."""

    def __init__(self, dev: Device, step: Any, attn_ctx: Any, swa_layers: frozenset[int]) -> None:
        super().__init__(dev, step, attn_ctx)
        self.swa_layers = swa_layers

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        ctx = self.attn_ctx
        if ctx is not None and hasattr(ctx, "swa"):  # an iSWA context: base and window sub-contexts
            sub = ctx.swa if layer in self.swa_layers else ctx.base
            return StepMixers(self.dev, self.step, sub).attend(layer, q, k, v)
        return super().attend(layer, q, k, v)


class ModelRuntime:
    """A minimal runtime: the tiny model computing batches through one memory
    (``n_rs_seq`` rollback planes for speculative steps)."""

    def __init__(self, dev: Device, kind: str, n_seq_max: int, seed: int = 0, n_rs_seq: int = 0) -> None:
        self.dev = dev
        self.kind = kind
        self.mem = build_memory(dev, kind, n_seq_max, seed, n_rs_seq)
        self.layers = model_layers(kind)
        self.weights = Weights.random(1234, self.layers)
        self.swa_layers = frozenset({3}) if kind == "hybrid_iswa" else frozenset()
        #: per sequence, where each call (ubatch) that wrote it ended: the memory's
        #: splitter may cut a batch's pieces further, and only the calls made matter
        self.calls: dict[int, list[int]] = {}
        #: seconds spent in the model's forward (the work a hit saves), apart from planning
        self.compute_s = 0.0

    def run(self, pieces: Mapping[int, Sequence[int]], n_ubatch: int = 512) -> dict[int, np.ndarray]:
        """Compute one batch (each sequence's tokens continue its state); returns the
        logits of every token, per sequence ``[n_tokens, VOCAB]``."""
        from statecache.batch import Batch, BatchAllocator
        from statecache.memory import MemoryStatus

        mem = self.mem
        upd = mem.init_update()
        if upd.status.is_fail or (upd.status is MemoryStatus.SUCCESS and not upd.apply()):
            raise ConformanceFailure(f"the memory update failed ({upd.status.value})")
        balloc = BatchAllocator(mem.n_seq_max)
        balloc.init(Batch.for_sequences({s: list(t) for s, t in pieces.items()}, output_all=True), mem)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a sequence whose parts disagree on its position must not pass quietly
            ctx = mem.init_batch(balloc, n_ubatch)
        if ctx.status.is_fail:
            raise ConformanceFailure(f"the memory could not plan the batch ({ctx.status.value})")
        got: dict[tuple[int, int], np.ndarray] = {}
        hybrid = self.kind != "recurrent"
        while True:
            ub = ctx.get_ubatch()
            if not ctx.apply():
                raise ConformanceFailure("apply() failed")
            step = ctx.recr.step() if hybrid else ctx.step()  # type: ignore[attr-defined]
            mix = _Mixers(self.dev, step, ctx.attn if hybrid else None, self.swa_layers)  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            logits = forward(self.dev, mix, self.weights, ub.token.reshape(ub.n_seqs, ub.n_seq_tokens))
            self.compute_s += time.perf_counter() - t0
            for s in range(ub.n_seqs):
                for t in range(ub.n_seq_tokens):
                    i = s * ub.n_seq_tokens + t
                    for q in ub.seq_id[i]:
                        got[(q, int(ub.pos[i]))] = logits[s, t]
                last = (s + 1) * ub.n_seq_tokens - 1
                for q in ub.seq_id[last]:
                    self.calls.setdefault(q, []).append(int(ub.pos[last]) + 1)
            if not ctx.next():
                break
        out = {}
        for s in pieces:
            pos = sorted(p for q, p in got if q == s)
            out[s] = np.stack([got[(s, p)] for p in pos])
        return out


#: One call of a run: the position it ended at, or ``(end, rejected)``: a speculative
#: call that also wrote the ``rejected`` draft tokens and was rolled back to ``end``.
Call = int | tuple[int, tuple[int, ...]]


def call_end(call: Call) -> int:
    return call[0] if isinstance(call, tuple) else call


class ColdOracle:
    """Checks warm continuations against cold runs with the same call boundaries
    (module docstring).  ``make`` builds a fresh runtime of the same kind."""

    def __init__(self, make: Callable[[], ModelRuntime], with_recompute: bool = True) -> None:
        self.make = make
        self.with_recompute = with_recompute
        #: tokens -> histories (call boundaries from 0) of every state a run produced after them
        self.made: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        self.weights: Weights | None = None
        self.cold_runs = 0

    def record(self, tokens: Sequence[int], history: Sequence[Call]) -> None:
        for k, call in enumerate(history):
            self.made.setdefault(tuple(tokens[: call_end(call)]), set()).add(tuple(history[: k + 1]))

    def cold(self, tokens: Sequence[int], history: Sequence[Call]) -> np.ndarray:
        rt = self.make()
        self.weights = rt.weights
        self.cold_runs += 1
        outs, prev = [], 0
        for call in history:
            b = call_end(call)
            rejected = list(call[1]) if isinstance(call, tuple) else []
            outs.append(rt.run({0: [*tokens[prev:b], *rejected]})[0][: b - prev])
            if rejected and not rt.mem.seq_rm(0, b, -1):
                raise ConformanceFailure(f"cold run: the rollback of {len(rejected)} drafted tokens was refused")
            prev = b
        return np.concatenate(outs)

    def check(self, label: str, tokens: Sequence[int], p: int, after: Sequence[Call], warm: np.ndarray) -> None:
        """``tokens``: all the warm sequence absorbed; ``p``: where it resumed; ``after``:
        its calls after ``p``; ``warm``: its logits for positions ``p ..``."""
        tokens = list(tokens)
        if warm.shape[0] != len(tokens) - p:
            raise ConformanceFailure(f"{label}: {warm.shape[0]} warm outputs for positions {p}..{len(tokens) - 1}")
        hists = {()} if p == 0 else self.made.get(tuple(tokens[:p]), set())
        if not hists:
            raise ConformanceFailure(f"{label}: resumed after {p} tokens that no earlier run ended a call at")
        first_err = ""
        for h in sorted(hists, key=repr):
            cold = self.cold(tokens, [*h, *after])[p:]
            diff = cold != warm  # bitwise: f32, and NaN would be a failure anyway
            if not diff.any():
                self.record(tokens, [*h, *after])
                break
            if not first_err:
                at = tuple(int(i) for i in np.argwhere(diff)[0])
                first_err = (
                    f"{int(diff.sum())} of {diff.size} logits differ from the cold run with calls ending at "
                    f"{[*h, *after]}; first at position {p + at[0]}: warm {warm[at]!r}, cold {cold[at]!r}"
                )
        else:
            raise ConformanceFailure(f"{label}: resumed after {p} tokens: {first_err}")
        if self.with_recompute and self.weights is not None:
            want = recompute(reference_device(), self.weights, tokens)[p:]
            assert_close(f"{label}: warm logits vs a full recompute of {len(tokens)} tokens", warm, want, LOGITS_NMSE)


@dataclasses.dataclass
class Served:
    request: Any
    logits: np.ndarray
    after: list[Call]
    generated: list[int]


def serve(
    rt: ModelRuntime,
    cache: Any,
    oracle: ColdOracle | None,
    seq: int,
    prompt: Sequence[int],
    gen: Sequence[int | tuple[Sequence[int], Sequence[int]]] = (),
    *,
    extra: Any = None,
    label: str = "",
) -> Served:
    """One request through the cache: start, prefill piece by piece, generate, finish;
    then the cold-run check.  ``gen`` items: a token (one decode step), or
    ``(accepted, rejected)``: a speculative step that decodes both in one call and
    rolls the rejected drafts back (the memory needs ``n_rs_seq >= len(rejected)``)."""
    prompt = list(prompt)
    req = cache.start(seq, prompt, extra)
    if rt.mem.seq_pos_max(seq) != req.resume - 1:
        raise ConformanceFailure(f"{label}: sequence at {rt.mem.seq_pos_max(seq)} after a hit of {req.resume}")
    outs: list[np.ndarray] = []
    after: list[Call] = []  # the calls the memory made for seq (its splitter may cut a piece)
    prev = req.resume

    def run(tokens: list[int]) -> np.ndarray:
        n0 = len(rt.calls.get(seq, []))
        out = rt.run({seq: tokens})[seq]
        after.extend(rt.calls[seq][n0:])
        return out

    for end in req.pieces:
        outs.append(run(prompt[prev:end]))
        prev = end
        cache.reached(req, end)
    generated: list[int] = []
    for item in gen:
        acc, rej = ([int(item)], []) if isinstance(item, int | np.integer) else (list(item[0]), list(item[1]))
        n_calls = len(after)
        outs.append(run([*acc, *rej])[: len(acc)])
        generated += acc
        end = len(prompt) + len(generated)
        if rej:
            if not rt.mem.seq_rm(seq, end, -1):
                raise ConformanceFailure(f"{label}: rolling back {len(rej)} drafted tokens was refused")
            if len(after) != n_calls + 1:
                raise ConformanceFailure(f"{label}: a speculative step was split into several calls")
            after[-1] = (end, tuple(rej))
    cache.finish(req, generated)
    logits = np.concatenate(outs)
    if oracle is not None:
        oracle.check(label or f"request on sequence {seq}", [*prompt, *generated], req.resume, after, logits)
    return Served(req, logits, after, generated)


def _tokens(rng: np.random.Generator, n: int, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` random tokens, the first not in ``avoid`` (so a prompt leaves earlier ones exactly there)."""
    out = [int(t) for t in rng.integers(0, VOCAB, n)]
    while out and out[0] in avoid:
        out[0] = (out[0] + 1) % VOCAB
    return out


def _expect(label: str, got: Any, want: Any) -> None:
    if got != want:
        raise ConformanceFailure(f"{label}: got {got}, expected {want}")


def _setup(dev: Device, kind: str, seed: int, **config: Any) -> tuple[ModelRuntime, Any, ColdOracle]:
    from statecache.prefix import PrefixCache, PrefixConfig

    n_live, n_res = 2, 24  # room for every checkpoint: these scenarios test placement, not eviction
    rt = ModelRuntime(dev, kind, n_live + n_res, seed)
    cfg = PrefixConfig(**{"chunk": 8, "interval": 16, "before_end": 4, **config})
    cache = PrefixCache(rt.mem, reserved=range(n_live, n_live + n_res), config=cfg)
    oracle = ColdOracle(lambda: ModelRuntime(dev, kind, 1, seed + 7), with_recompute=kind != "hybrid_iswa")
    return rt, cache, oracle


def exact_hits(dev: Device, kind: str, seed: int) -> None:
    from statecache.prefix import check_invariants

    rng = np.random.default_rng(seed)
    rt, cache, oracle = _setup(dev, kind, seed)
    a_prompt, a_gen = _tokens(rng, 37), _tokens(rng, 3)
    a = serve(rt, cache, oracle, 0, a_prompt, a_gen, label="A: cold prompt of 37 + 3 generated")
    _expect("A resumed at", a.request.resume, 0)
    _expect("A's checkpoints", sorted(a.request.checkpoints), [16, 32, 33, 37])
    b_prompt = a_prompt[:29] + _tokens(rng, 9, avoid=[a_prompt[29]])
    b = serve(rt, cache, oracle, 1, b_prompt, label="B shares 29 tokens of A")
    _expect("B resumed at (routine checkpoint)", b.request.resume, 16)
    _expect("B's junction", b.request.checkpoints.get(29), "junction")
    c_prompt = a_prompt[:29] + _tokens(rng, 5, avoid=[a_prompt[29], b_prompt[29]])
    c = serve(rt, cache, oracle, 0, c_prompt, label="C shares the same 29 tokens")
    _expect("C resumed at (B's junction)", c.request.resume, 29)
    d = serve(rt, cache, oracle, 1, a_prompt + a_gen + _tokens(rng, 6), [1, 2], label="D: the next turn of A")
    _expect("D resumed at (A's end of generation)", d.request.resume, 40)
    e_prompt = a_prompt[:35] + _tokens(rng, 2, avoid=[a_prompt[35]])
    e = serve(rt, cache, oracle, 0, e_prompt, label="E: A re-sent with its end changed")
    _expect("E resumed at (before the end of A)", e.request.resume, 33)
    f = serve(rt, cache, oracle, 1, a_prompt, label="F: A's prompt again")
    _expect("F resumed at (E's junction; A's end needs one token left)", f.request.resume, 35)
    g = serve(rt, cache, oracle, 0, a_prompt[:20], extra="adapter-x", label="G: another extra key")
    _expect("G resumed at (other namespace)", g.request.resume, 0)
    _expect("evictions (the resume points above assume none)", cache.metrics.evictions_device, 0)
    check_invariants(cache)


def refusals(dev: Device, kind: str, seed: int) -> None:
    from statecache.errors import ArgumentError, StateError
    from statecache.prefix import PrefixCache, check_invariants

    rng = np.random.default_rng(seed)
    rt, cache, oracle = _setup(dev, kind, seed, before_end=0, end_of_prompt=False)
    a_prompt, a_gen = _tokens(rng, 30), _tokens(rng, 4)
    serve(rt, cache, oracle, 0, a_prompt, a_gen, label="A: prompt of 30 + 4 generated")
    prompt = a_prompt + _tokens(rng, 5)
    prompt[30] = (a_gen[0] + 1) % VOCAB  # leaves A's generation right at 30
    m = cache.match(prompt)
    if "attention" in dict(m.parts):
        _expect("attention cells the cache holds for B", m.part("attention"), 30)
    _expect("deepest checkpoint for B", m.part("recurrent"), 16)
    _expect("B's hit (the common exact point, not the attention length)", m.length, 16)
    b = serve(rt, cache, oracle, 1, prompt, label="B: attention could reuse 30, the recurrent state 16")
    _expect("B resumed at", b.request.resume, 16)
    # a checkpoint dropped behind the cache's back (a runtime using a reserved id) is never restored
    deepest = max((e for e in cache.entries() if e.device_seq is not None), key=lambda e: e.length)
    rt.mem.seq_rm(deepest.device_seq, -1, -1)
    lost_before = cache.metrics.lost
    tokens = list(deepest.node.tokens()) + _tokens(rng, 3)
    c = serve(rt, cache, oracle, 0, tokens, label="C: its deepest checkpoint was dropped")
    _expect("C's entries found lost", cache.metrics.lost - lost_before, 1)
    if c.request.resume >= deepest.length:
        raise ConformanceFailure(f"C resumed at {c.request.resume} from a dropped checkpoint of {deepest.length}")
    check_invariants(cache)
    # bad arguments and bad files change nothing
    blobs = {r: rt.mem.state_write(r) for r in sorted(cache.reserved)}
    stats = cache.stats()
    saved = _saved_bytes(cache)
    req = cache.start(1, [*a_prompt[:10], 1, 2, 3])
    for bad, what in ((lambda: cache.reached(req, 5), "a piece end the request does not have"),
                      (lambda: cache.reached(req, req.pieces[-1]), "a piece the sequence has not run")):  # fmt: skip
        try:
            bad()
        except ArgumentError:
            pass
        else:
            raise ConformanceFailure(f"reached() accepted {what}")
    cache.cancel(req)
    corrupt = bytearray(saved)
    corrupt[len(corrupt) // 2] ^= 0x40
    other = PrefixCache(build_memory(dev, "recurrent" if kind != "recurrent" else "hybrid", 3, seed), reserved=[2])
    foreign = _saved_bytes(other)
    for data, what in ((bytes(corrupt), "a corrupt file"), (foreign, "a file of another memory layout"),
                       (saved[:-9], "a truncated file")):  # fmt: skip
        try:
            cache.load(data)
        except StateError:
            pass
        else:
            raise ConformanceFailure(f"load() accepted {what}")
    stats_after = {k: v for k, v in cache.stats().items() if k not in ("queries", "hits", "hit_tokens")}
    stats_before = {k: v for k, v in stats.items() if k not in ("queries", "hits", "hit_tokens")}
    stats_before["prompt_tokens"] = stats_after["prompt_tokens"]
    stats_before["recomputed_tokens"] = stats_after["recomputed_tokens"]
    _expect("cache counters after refused loads", stats_after, stats_before)
    for r, blob in blobs.items():
        if rt.mem.state_write(r) != blob:
            raise ConformanceFailure(f"a refused load changed reserved sequence {r}")
    check_invariants(cache)


def _saved_bytes(cache: Any) -> bytes:
    import io

    f = io.BytesIO()
    cache.save(f)
    return f.getvalue()


def tiers(dev: Device, kind: str, seed: int) -> None:
    from statecache.prefix import PrefixCache, PrefixConfig, check_invariants

    rng = np.random.default_rng(seed)
    rt0 = ModelRuntime(dev, kind, 1, seed)  # only to size a host blob
    from statecache.prefix.store import describe

    ckpt = describe(rt0.mem).checkpoint_bytes
    rt, cache, oracle = _setup(dev, kind, seed, device_budget=2 * ckpt, host_budget=1 << 22)
    a_prompt = _tokens(rng, 40)
    serve(rt, cache, oracle, 0, a_prompt, _tokens(rng, 2), label="A: 40 + 2 generated, 5 checkpoints in 2 slots")
    _expect("device entries", cache.device.entries, 2)
    if cache.metrics.demotions < 1:
        raise ConformanceFailure("no checkpoint moved to the host tier")
    host_lengths = sorted(e.length for e in cache.entries() if e.host_blob is not None)
    p = host_lengths[0]
    b_prompt = a_prompt[:p] + _tokens(rng, 6, avoid=[a_prompt[p]])
    b = serve(rt, cache, oracle, 1, b_prompt, label=f"B: hit of {p} from the host tier")
    _expect("B resumed at (host entry)", b.request.resume, p)
    if cache.metrics.promotions < 1:
        raise ConformanceFailure("the host hit was not promoted to the device tier")
    check_invariants(cache)
    # save, load into a fresh memory, hit there exactly
    data = _saved_bytes(cache)
    rt2 = ModelRuntime(dev, kind, 4, seed + 3)
    cache2 = PrefixCache(rt2.mem, reserved=[2, 3], config=PrefixConfig(chunk=8, interval=16, host_budget=1 << 22))
    n = cache2.load(data)
    _expect("entries loaded", n, len(list(cache.entries())))
    c = serve(rt2, cache2, oracle, 0, a_prompt[:37] + _tokens(rng, 3, avoid=[a_prompt[37]]), label="C: after a load")
    _expect("C resumed at (before the end of A)", c.request.resume, 36)
    check_invariants(cache2)


#: name -> (scenario, kinds it runs on)
SCENARIOS: dict[str, tuple[Callable[[Device, str, int], None], tuple[str, ...]]] = {
    "exact_hits": (exact_hits, KINDS),
    "refusals": (refusals, ("recurrent", "hybrid")),
    "tiers": (tiers, ("recurrent", "hybrid")),
}

_ROW_OPS = ("get_rows", "set_rows", "zero_rows", "copy_rows")
_STATE_OPS = ("ssm_conv", "ssm_scan", "gated_delta_net")


def _case(name: str, fn: Callable[[Device, str, int], None], kind: str) -> Case:
    reqs = [Requirement(op, {"dtype": "f32"}) for op in _ROW_OPS]
    reqs += [Requirement(op, {"dtype": "f32", "n_snap": 1}) for op in _STATE_OPS]
    holder: dict[str, Case] = {}

    def run(device: Device) -> None:
        with np.errstate(all="ignore"):
            fn(device, kind, holder["case"].seed % 10_000)

    case = Case(f"prefix.{kind}[{name}-f32]", "prefix", _ROW_OPS + _STATE_OPS, run, tuple(reqs),
                {"storage_dtypes": {"f32"}})  # fmt: skip
    holder["case"] = case
    return case


def all_cases() -> list[Case]:
    import importlib.util

    if importlib.util.find_spec("statecache.prefix") is None:
        return []
    return [_case(name, fn, kind) for name, (fn, kinds) in SCENARIOS.items() for kind in kinds]


__all__ = ["KINDS", "Call", "ColdOracle", "ModelRuntime", "Served", "all_cases", "build_memory", "call_end", "serve"]
