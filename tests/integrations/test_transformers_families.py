"""transformers' own models, run with statecache holding every state, agree with transformers.

For every covered family (tiny models from configs, seeded random weights, constants
randomised: see ``tiny_models.py``) one engine run covers the four scenarios of the proof:

* batched prefill of prompts of different lengths, then greedy decoding;
* a request joining while the others decode;
* forks (``seq_cp``) whose branches decode differently (an appended token; seeded sampling);
* a speculative draft partly accepted and rolled back exactly (``seq_rm`` through the snapshot
  planes; Mamba-1 models, which have none, through a scratch fork).

Every logits row a generated token was chosen from is compared with transformers' own forward
over the same token prefix (one full forward per request: the model is causal), and the greedy
tokens with ``model.generate``.

Tolerance: ``max |delta| <= max(5e-5 * max(1, max |logits|), 4 * s)`` where ``s`` is the model's
own float32 noise floor: how far transformers' forward moves the logits when the input
embeddings are perturbed by one unit in the last place (measured per model, a few forwards).
Both sides compute in float32 but in different orders (sequential vs chunked scans, fused conv
vs ``F.conv1d``, statecache's K/V cells vs one padded sequence), so they can only be expected to
agree to what rounding the model amplifies: about 1e-5 of the logit scale for most of these
models, 1e-4 for the tiny Zamba2 (its logits move by 2e-4 under a one-ulp input change).  A
wrong convention moves logits by 1e-2 or more (``test_a_stale_mapping_is_caught``), and against
a float64 run statecache's error stays within the same floor
(``test_error_within_the_float32_noise_floor``).

CI runs the engine scenario for every model type on the cpu device, the other checks for every
variant, and the reference device on the core families; ``STATECACHE_TRANSFORMERS_FULL=1`` runs
the engine scenario for every variant on every device.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the transformers integration needs the torch extra")
pytest.importorskip("transformers", reason="the transformers integration needs statecache[transformers]")

from tiny_models import BUILDERS, MODEL_TYPES, V, build  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from statecache.batch import Batch  # noqa: E402
from statecache.integrations.transformers import (  # noqa: E402
    Engine,
    Sampling,
    StatecacheCausalLM,
)

pytestmark = pytest.mark.torch

REL_TOL = 5e-5
FULL = os.environ.get("STATECACHE_TRANSFORMERS_FULL") == "1"
#: families the reference device runs in CI (every family runs on cpu)
REFERENCE = ("mamba2", "qwen3_next")


def _noise_floor(m):  # type: ignore[no-untyped-def]
    """Largest logit change of transformers' own forward under one-ulp input perturbations."""
    ids = torch.tensor([list(range(1, 13))])
    with torch.no_grad():
        e = m.get_input_embeddings()(ids)
        base = m(inputs_embeds=e).logits[0]
        worst = 0.0
        for k in range(3):
            g = torch.Generator().manual_seed(k)
            e2 = e * (1 + 1.2e-7 * torch.randn(e.shape, generator=g))
            worst = max(worst, float((m(inputs_embeds=e2).logits[0] - base).abs().max()))
    return worst


class Model:
    def __init__(self, name):  # type: ignore[no-untyped-def]
        self.name = name
        self.m = build(name)
        self.floor = _noise_floor(self.m)

    def tol(self, ref):  # type: ignore[no-untyped-def]
        return max(REL_TOL * max(1.0, float(ref.abs().max())), 4 * self.floor)


_MODELS: dict[str, Model] = {}


def model_named(name):  # type: ignore[no-untyped-def]
    if name not in _MODELS:
        _MODELS[name] = Model(name)
    return _MODELS[name]


def _oracle(model, context):  # type: ignore[no-untyped-def]
    """transformers' own forward over the whole context: row n-1 is the logits after n tokens."""
    with torch.no_grad():
        return model(torch.tensor([context])).logits[0].float()


def _check_request(mod, req):  # type: ignore[no-untyped-def]
    assert req.logits, f"request {req.id} recorded no logits"
    ref = _oracle(mod.m, req.context)
    for n, row in req.logits:
        want = ref[n - 1]
        err = float((row - want).abs().max())
        assert err <= mod.tol(want), f"request {req.id}, logits after {n} tokens: off by {err:.3g}"
        if req.sampling.greedy:  # the chosen token is the model's own argmax
            assert req.context[n] == int(torch.argmax(want))


@pytest.mark.parametrize(
    ("name", "device"),
    [(n, "cpu") for n in MODEL_TYPES]
    + [(n, "reference") for n in REFERENCE]
    + ([(n, d) for n in BUILDERS for d in ("cpu", "reference") if n not in MODEL_TYPES or d != "cpu"] if FULL else []),
)
def test_engine_agrees_with_transformers(name, device):  # type: ignore[no-untyped-def]
    mod = model_named(name)
    m = mod.m
    lm = StatecacheCausalLM(m, device=device, n_seq_max=8, n_rs_seq=3, n_ctx=64)
    eng = Engine(lm, record_logits=True)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, V, n).tolist() for n in (3, 9, 14)]
    rids = [eng.add(p, max_new_tokens=6) for p in prompts]  # one batch, three prompt lengths
    eng.step()
    eng.step()
    late = eng.add(rng.integers(0, V, 5).tolist(), max_new_tokens=4)  # joins while the others decode
    eng.step()
    fork_a = eng.fork(rids[1], append=[int(rng.integers(0, V))])  # this branch takes another token
    fork_b = eng.fork(rids[2], sampling=Sampling(temperature=2.0, seed=11))  # this one samples

    # Speculative: the same prompt as the first request, greedy, drafted with the first request's
    # tokens (it is ahead: it started three steps earlier) followed by two wrong ones, so every
    # verify step keeps part of the draft and rolls the rest back.
    lead = eng.requests[rids[0]]

    def half_right(context, k):  # type: ignore[no-untyped-def]
        i = len(context) - len(prompts[0])
        nxt = lead.generated[i] if i < len(lead.generated) else int(context[-1])
        return [nxt, (nxt + 1) % V, (nxt + 2) % V][:k]

    spec = eng.add(prompts[0], max_new_tokens=6, draft=half_right, n_draft=3)
    eng.run()

    for rid in [*rids, late, fork_a, fork_b, spec]:
        req = eng.requests[rid]
        assert req.finished and len(req.generated) == req.max_new_tokens, (rid, req.finish_reason)
        _check_request(mod, req)
    assert not eng.active and lm.memory.seq_pos_max(0) == -1  # finished requests freed their states
    # the branches decode differently from their parents
    parent, child = eng.requests[rids[1]], eng.requests[fork_a]
    assert child.context[: len(prompts[1]) + 3] == parent.context[: len(prompts[1]) + 3]
    assert child.context[len(parent.prompt) + 3 :] != parent.context[len(parent.prompt) + 3 :]
    assert eng.requests[fork_b].generated != eng.requests[rids[2]].generated
    # the speculative request verified drafts, kept some, rolled the rest back, and ended where
    # plain greedy decoding of the same prompt ends
    sreq = eng.requests[spec]
    assert 0 < sreq.accepted < sreq.drafted
    assert sreq.generated == lead.generated
    if name == "mamba2_dt_limit":
        return  # transformers' single-token decode ignores time_step_limit: its generate() and its
        # forward disagree on this model; statecache follows the forward (see docs)
    # greedy tokens equal transformers' own generate (no EOS stop; an explicit mask, since a prompt
    # token equal to pad_token_id is no padding)
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    for rid, p in zip(rids, prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = m.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        assert out[0, len(p) :].tolist() == eng.tokens(rid), f"request {rid} differs from generate()"


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model(request):  # type: ignore[no-untyped-def]
    return model_named(request.param)


def test_forward_agrees_on_a_mixed_batch(model):  # type: ignore[no-untyped-def]
    """Prompts of three lengths in one batch (several ubatches), then two decode steps."""
    lm = StatecacheCausalLM(model.m, n_seq_max=3, n_ctx=64)
    rng = np.random.default_rng(1)
    ctx = {s: rng.integers(0, V, n).tolist() for s, n in enumerate((2, 7, 11))}
    got = lm.forward(Batch.for_sequences(ctx, output_all=True), output_all=True)
    rows = {}
    k = 0
    for s, toks in ctx.items():
        rows[s] = got[k : k + len(toks)]
        k += len(toks)
    for _ in range(2):
        nxt = {s: [int(rng.integers(0, V))] for s in ctx}
        step = lm.forward(Batch.for_sequences(nxt))
        for s in ctx:
            ctx[s] = ctx[s] + nxt[s]
            rows[s] = torch.cat([rows[s], step[s : s + 1]])
    for s, toks in ctx.items():
        want = _oracle(model.m, toks)
        err = float((rows[s] - want).abs().max())
        assert err <= model.tol(want), (s, err)


def test_rollback_leaves_exactly_the_accepted_state(model):  # type: ignore[no-untyped-def]
    """After a partly rejected draft, the next logits equal a sequence that never saw the draft."""
    name, m = model.name, model.m
    lm = StatecacheCausalLM(m, n_seq_max=4, n_rs_seq=4, n_ctx=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    lm.forward(Batch.for_sequences({0: prompt}))
    draft = [7, 7, 7, 7]
    lm.forward(Batch.for_sequences({0: [5, *draft]}, output_all=True), output_all=True)
    assert lm.memory.seq_pos_max(0) == len(prompt) + 4
    if lm.rollback_depth == 0:
        # Mamba-1 states have no snapshot planes: the memory refuses and nothing changes (the
        # engine forks into a scratch sequence instead, test_engine_agrees_with_transformers)
        assert name in ("mamba", "falcon_mamba", "jamba")
        assert not lm.memory.seq_rm(0, len(prompt) + 2, -1)
        assert lm.memory.seq_pos_max(0) == len(prompt) + 4
        return
    assert lm.memory.seq_rm(0, len(prompt) + 2, -1)  # keep the token and one drafted token
    assert lm.memory.seq_pos_max(0) == len(prompt) + 1
    got = lm.forward(Batch.for_sequences({0: [8]}))[0]
    want = _oracle(m, [*prompt, 5, 7, 8])[-1]
    assert float((got - want).abs().max()) <= model.tol(want)


def test_a_stale_mapping_is_caught(model):  # type: ignore[no-untyped-def]
    """The comparison can fail: parameters copied at attach and changed afterwards give logits
    outside the tolerance until refresh() maps them again."""
    m = copy.deepcopy(model.m)
    lm = StatecacheCausalLM(m, n_seq_max=2, n_ctx=64)
    mixer = next(p[k] for p in lm.parts for k in p if k != "attention")
    ctx = [1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        mixer.A_log.add_(0.05)  # A = -exp(A_log) is uploaded at attach
        mixer.conv1d.weight.mul_(1.05)
    got = lm.forward(Batch.for_sequences({0: ctx}))[0]
    want = _oracle(m, ctx)[-1]
    assert float((got - want).abs().max()) > 20 * model.tol(want)
    lm.memory.seq_rm(0, -1, -1)
    lm.refresh()
    got = lm.forward(Batch.for_sequences({0: ctx}))[0]
    assert float((got - want).abs().max()) <= model.tol(want)


@pytest.mark.parametrize("name", ["mamba", "mamba2", "bamba", "zamba2", "falcon_h1", "nemotron_h"])
def test_error_within_the_float32_noise_floor(name):  # type: ignore[no-untyped-def]
    """Against a float64 run of the same weights, statecache's float32 logits are off by no more
    than the model's float32 noise floor allows (families without MoE: grouped_mm has no float64);
    transformers' own float32 forward is held to the same bound, as a check of the bound."""
    mod = model_named(name)
    m64 = copy.deepcopy(mod.m).double()
    lm = StatecacheCausalLM(mod.m, n_seq_max=2, n_ctx=64)
    ctx = np.random.default_rng(3).integers(0, V, 20).tolist()
    got = lm.forward(Batch.for_sequences({0: ctx}, output_all=True), output_all=True).double()
    with torch.no_grad():
        ref32 = mod.m(torch.tensor([ctx])).logits[0].double()
        ref64 = m64(torch.tensor([ctx])).logits[0]
    ours, theirs = float((got - ref64).abs().max()), float((ref32 - ref64).abs().max())
    assert theirs <= mod.tol(ref64), (theirs, mod.tol(ref64))
    assert ours <= mod.tol(ref64), (ours, theirs, mod.tol(ref64))
