"""The transformers integration's engine, refusals and glue, beyond per-family agreement."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from statecache.errors import ArgumentError

torch = pytest.importorskip("torch", reason="the transformers integration needs the torch extra")
transformers = pytest.importorskip("transformers", reason="the transformers integration needs statecache[transformers]")

from tiny_models import V, build  # noqa: E402

from statecache import primitives  # noqa: E402
from statecache.batch import Batch  # noqa: E402
from statecache.integrations.transformers import (  # noqa: E402
    Engine,
    IntegrationError,
    NgramDraft,
    Sampling,
    StatecacheCausalLM,
    supported_model_types,
)
from statecache.integrations.transformers.engine import speculative_pick  # noqa: E402

pytestmark = pytest.mark.torch


def _oracle(model, context):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(torch.tensor([context])).logits[0].float()


def _assert_logits_match(model, req):  # type: ignore[no-untyped-def]
    ref = _oracle(model, req.context)
    for n, row in req.logits:
        want = ref[n - 1]
        assert float((row - want).abs().max()) <= 5e-5 * max(1.0, float(want.abs().max()))


def test_package_imports_without_torch_or_transformers():
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'transformers'):
                    raise ImportError('blocked: ' + name)
                return None
        sys.meta_path.insert(0, Block())
        import statecache.integrations.transformers as t
        assert 'mamba2' in t.supported_model_types() and 'qwen3_next' in t.supported_model_types()
        assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]
        print('ok')
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- refusals ------------------------------------------------------------------------------------------


def test_unsupported_model_type_is_refused_by_name():
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    with pytest.raises(IntegrationError, match=r"'llama'.*supported: .*mamba2"):
        StatecacheCausalLM(transformers.LlamaForCausalLM(cfg))
    assert "qwen3_next" in supported_model_types() and "llama" not in supported_model_types()


def test_unsupported_layer_is_refused_by_layer_and_reason():
    cfg = transformers.Qwen3NextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=16, num_experts=0, layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    with pytest.raises(IntegrationError, match=r"layer 0 .*Qwen3NextGatedDeltaNet.*head size 8 != value head size 16"):
        StatecacheCausalLM(transformers.Qwen3NextForCausalLM(cfg))
    mcfg = transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, state_size=8, hidden_act="gelu")
    with pytest.raises(IntegrationError, match=r"layer 0 .*MambaMixer.*'gelu'"):
        StatecacheCausalLM(transformers.MambaForCausalLM(mcfg))


def test_attention_implementation_without_an_additive_mask_is_refused():
    m = build("bamba")
    m.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(IntegrationError, match="'flash_attention_2'"):
            StatecacheCausalLM(m)
    finally:
        m.config._attn_implementation = "sdpa"


# -- engine API ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mamba2():  # type: ignore[no-untyped-def]
    return build("mamba2")


@pytest.fixture(scope="module")
def bamba():  # type: ignore[no-untyped-def]
    return build("bamba")


def test_bad_requests_are_refused_and_nothing_is_queued(bamba):  # type: ignore[no-untyped-def]
    eng = Engine(StatecacheCausalLM(bamba, n_seq_max=2, n_ctx=32))
    with pytest.raises(ArgumentError, match="prompt"):
        eng.add([1, V + 3])
    with pytest.raises(ArgumentError, match="prompt"):
        eng.add([])
    with pytest.raises(ArgumentError, match="max_new_tokens"):
        eng.add([1, 2], max_new_tokens=0)
    with pytest.raises(ArgumentError, match="n_ctx 32"):
        eng.add(list(range(20)), max_new_tokens=20)
    with pytest.raises(ArgumentError, match="rid"):
        eng.fork(123)
    assert not eng.busy and not eng.requests


def test_seeded_sampling_is_reproducible_and_follows_the_model(mamba2):  # type: ignore[no-untyped-def]
    runs = []
    for _ in range(2):
        eng = Engine(StatecacheCausalLM(mamba2, n_seq_max=4, n_rs_seq=3), record_logits=True)
        s = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=5)
        rids = [eng.add([1, 2, 3, 4], max_new_tokens=8, sampling=s), eng.add([9, 8], max_new_tokens=8, sampling=s)]
        eng.run()
        runs.append([eng.tokens(r) for r in rids])
        for r in rids:
            _assert_logits_match(mamba2, eng.requests[r])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_speculative_sampling_rolls_back_exactly(bamba):  # type: ignore[no-untyped-def]
    """Seeded sampling with an n-gram draft: whatever is accepted, every later logits row
    matches a forward over the tokens actually kept."""
    eng = Engine(StatecacheCausalLM(bamba, n_seq_max=3, n_rs_seq=4, n_ctx=64), record_logits=True)
    loop = [4, 5, 6, 7] * 4
    rid = eng.add(loop, max_new_tokens=12, sampling=Sampling(temperature=0.7, seed=2), draft=NgramDraft(), n_draft=4)
    eng.run()
    req = eng.requests[rid]
    assert req.drafted > 0
    _assert_logits_match(bamba, req)


def test_speculative_pick_has_the_target_distribution():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6))
    n = 20000
    for draft in (int(np.argmax(p)), int(np.argmin(p))):
        counts = np.bincount([speculative_pick(p, draft, rng) for _ in range(n)], minlength=6)
        sigma = np.sqrt(n * p * (1 - p))
        assert np.all(np.abs(counts - n * p) < 5 * sigma + 1), (draft, counts / n, p)


def test_ngram_draft_proposes_what_followed_the_latest_match():
    d = NgramDraft(max_n=3)
    assert d([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # latest match of [1, 2, 3]
    assert d([5, 6, 5], 3) == [6, 5]  # falls back to a 1-gram
    assert d([1, 2, 3], 4) == []
    with pytest.raises(ValueError):
        NgramDraft(max_n=1, min_n=2)


def test_leaving_requests_free_their_slots_and_the_rest_stay_in_one_ubatch(mamba2):  # type: ignore[no-untyped-def]
    lm = StatecacheCausalLM(mamba2, n_seq_max=4)
    eng = Engine(lm, record_logits=True)
    rids = [eng.add([1 + i, 2, 3], max_new_tokens=n) for i, n in enumerate((6, 2, 6, 3))]
    ubatches = []
    real = lm._ubatch

    def counting(ctx, ub):  # type: ignore[no-untyped-def]
        ubatches.append(ub.n_seqs)
        return real(ctx, ub)

    lm._ubatch = counting  # type: ignore[method-assign]
    eng.step()
    eng.step()  # request 1 finishes: its slot is freed and the highest request moves into it
    assert sorted(eng.active) == [0, 1, 2]
    ubatches.clear()
    eng.step()
    assert ubatches == [3]  # one ubatch for the three remaining sequences
    eng.late = eng.add([7, 7, 7], max_new_tokens=2)  # type: ignore[attr-defined]
    eng.run()
    assert lm.memory.seq_pos_max(3) == -1 and not eng.active
    for r in [*rids, eng.late]:  # type: ignore[attr-defined]
        _assert_logits_match(mamba2, eng.requests[r])


def _fail_second_layer(lm):  # type: ignore[no-untyped-def]
    real = lm.family.layer
    calls = []

    def failing(i, h, run):  # type: ignore[no-untyped-def]
        calls.append(i)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(i, h, run)

    return failing, real


@pytest.mark.parametrize(("keep", "n_rs_seq"), [(True, 2), (False, 2), (False, 0)])
def test_a_failed_forward_is_undone(bamba, keep, n_rs_seq):  # type: ignore[no-untyped-def]
    """With kept undo rows a forward that fails half way changes nothing; so does a
    decode without kept rows on rollback planes (it writes the next plane, never the
    state it read).  Without either, the sequences whose states it overwrote are
    dropped and named, and the rest are untouched."""
    lm = StatecacheCausalLM(bamba, n_seq_max=2, n_rs_seq=n_rs_seq, n_ctx=32, keep_undo_rows=keep)
    lm.forward(Batch.for_sequences({0: [1, 2, 3], 1: [4, 5]}))
    before = (lm.memory.seq_pos_max(0), lm.memory.seq_pos_max(1))
    failing, real = _fail_second_layer(lm)
    lm.family.layer = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom") as info:
        lm.forward(Batch.for_sequences({0: [6], 1: [7]}))
    lm.family.layer = real  # type: ignore[method-assign]
    if not keep and not n_rs_seq:
        assert lm.last_dropped == (0, 1)
        assert "dropped sequences [0, 1]" in "".join(getattr(info.value, "__notes__", []))
        assert (lm.memory.seq_pos_max(0), lm.memory.seq_pos_max(1)) == (-1, -1)
        return
    assert lm.last_dropped == ()
    assert (lm.memory.seq_pos_max(0), lm.memory.seq_pos_max(1)) == before
    got = lm.forward(Batch.for_sequences({0: [6], 1: [7]}))
    for k, ctx in enumerate(([1, 2, 3, 6], [4, 5, 7])):
        want = _oracle(bamba, ctx)[-1]
        assert float((got[k] - want).abs().max()) <= 5e-5 * max(1.0, float(want.abs().max()))


def test_engine_ends_requests_whose_states_a_failed_step_dropped(mamba2):  # type: ignore[no-untyped-def]
    lm = StatecacheCausalLM(mamba2, n_seq_max=2)
    eng = Engine(lm)
    a, b = eng.add([1, 2, 3], max_new_tokens=4), eng.add([4, 5], max_new_tokens=4)
    eng.step()
    failing, real = _fail_second_layer(lm)
    lm.family.layer = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        eng.step()
    lm.family.layer = real  # type: ignore[method-assign]
    assert eng.requests[a].finish_reason == eng.requests[b].finish_reason == "failed"
    assert not eng.busy


def test_steady_decode_reuses_buffers_and_skips_validation(mamba2, monkeypatch):  # type: ignore[no-untyped-def]
    """The workspace hands the same Buffers to the primitives at every decode step of one
    shape, so the device's launch memo recognises the calls: no validation after warm-up."""
    lm = StatecacheCausalLM(mamba2, n_seq_max=2)
    lm.forward(Batch.for_sequences({0: [1, 2, 3], 1: [4, 5, 6]}))
    for t in (7, 8):
        lm.forward(Batch.for_sequences({0: [t], 1: [t]}))
    checks = []
    for name in ("check_ssm_scan", "check_ssm_conv"):
        real = getattr(primitives, name)
        monkeypatch.setattr(primitives, name, lambda *a, _r=real, _n=name, **k: (checks.append(_n), _r(*a, **k))[1])
    lm.forward(Batch.for_sequences({0: [9], 1: [9]}))
    assert checks == []


def test_refusals_are_integration_errors_naming_what_was_refused(monkeypatch):  # type: ignore[no-untyped-def]
    """An unsupported model is an UnsupportedModelError, which is the core's IntegrationError;
    a transformers outside the mapped versions is the core's IntegrationError with the versions."""
    from statecache.errors import IntegrationError as CoreIntegrationError
    from statecache.integrations.transformers import UnsupportedModelError

    assert issubclass(UnsupportedModelError, CoreIntegrationError) and issubclass(UnsupportedModelError, ValueError)
    m = build("mamba2")
    # the module object transformers leaves in sys.modules once its lazy submodules loaded
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(CoreIntegrationError, match=r"found transformers 4\.57\.1.*statecache\[transformers\]") as info:
        StatecacheCausalLM(m)
    assert info.value.found == "4.57.1" and info.value.extra == "transformers"
