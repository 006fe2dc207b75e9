"""Decode throughput of transformers' own path vs the statecache integration, same model.

For every covered family a small model (random weights drawn so activations are O(1)) decodes
greedily from ``n`` prompts of equal length (no padding, so transformers batches them without
masking tricks), for ``n`` in ``--seqs``:

* transformers: ``model.generate`` (its own cache objects, its torch fallbacks for the kernels);
* statecache: :class:`~statecache.integrations.transformers.Engine` over the same model object.

Both paths run the prompts once with one new token and once with ``1 + steps`` new tokens; the
difference is the decode time of ``steps`` tokens per sequence (prefill cancels).  Reported:
decode tokens per second of each path, from process CPU time (what this process spent; a shared
machine inflates wall time) and from wall time, and the ratio statecache / transformers.

Threads are set once, the same for both paths: torch's intra-op threads and statecache's C
threads (``STATECACHE_NUM_THREADS``) both get ``--threads`` (default 1).  Leaving both at "all
cores" oversubscribes a small machine (the two OpenMP pools spin against each other).
Denormal floats are flushed to zero for both paths (``torch.set_flush_denormal``) unless
``--keep-denormals``: recurrent states that decay towards zero pass through the denormal range,
where x86 arithmetic is 10-100x slower, and the C scan kernels do not set FTZ/DAZ themselves yet.

    python bench/transformers_decode.py [--families mamba2,bamba] [--seqs 1,8,32] [--steps 16]
                                        [--prompt 16] [--threads 1] [--keep-denormals] [--unified-kv]

Target: statecache faster than transformers at 8 and more sequences for every family.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _models(T: Any) -> dict[str, Callable[[], Any]]:
    d, v = 256, 2048
    m2 = dict(mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2)
    attn = dict(num_attention_heads=4, num_key_value_heads=2)
    return {
        "mamba": lambda: T.MambaForCausalLM(
            T.MambaConfig(vocab_size=v, hidden_size=d, num_hidden_layers=4, state_size=16, expand=2)
        ),
        "mamba2": lambda: T.Mamba2ForCausalLM(
            T.Mamba2Config(
                vocab_size=v, hidden_size=d, num_hidden_layers=4, num_heads=8, head_dim=64, n_groups=1,
                state_size=64, expand=2, chunk_size=64,
            )
        ),
        "bamba": lambda: T.BambaForCausalLM(
            T.BambaConfig(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4, attn_layer_indices=[2],
                mamba_chunk_size=64, **attn, **m2,
            )
        ),
        "granitemoehybrid": lambda: T.GraniteMoeHybridForCausalLM(
            T.GraniteMoeHybridConfig(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4,
                layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
                shared_intermediate_size=512, mamba_chunk_size=64, **attn, **m2,
            )
        ),
        "qwen3_next": lambda: T.Qwen3NextForCausalLM(
            T.Qwen3NextConfig(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4, head_dim=64,
                linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                num_experts=0, **attn,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            )
        ),
        "jamba": lambda: T.JambaForCausalLM(
            T.JambaConfig(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4, attn_layer_period=4,
                attn_layer_offset=2, num_experts=1, mamba_d_state=16, mamba_expand=2, **attn,
            )
        ),
        "nemotron_h": lambda: T.NemotronHForCausalLM(
            T.NemotronHConfig(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4, head_dim=64,
                layers_block_type=["mamba", "mlp", "attention", "mamba"], mamba_num_heads=8, mamba_head_dim=64,
                n_groups=1, ssm_state_size=64, chunk_size=64, **attn,
            )
        ),
        "falcon_h1": lambda: T.FalconH1ForCausalLM(
            T.FalconH1Config(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4, mamba_n_heads=8,
                mamba_d_head=64, mamba_d_ssm=512, mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=64, **attn,
            )
        ),
        "zamba2": lambda: T.Zamba2ForCausalLM(
            T.Zamba2Config(
                vocab_size=v, hidden_size=d, intermediate_size=512, num_hidden_layers=4,
                layers_block_type=["mamba", "hybrid", "mamba", "mamba"], n_mamba_heads=8, mamba_headdim=64,
                mamba_ngroups=1, mamba_d_state=64, chunk_size=64, num_attention_heads=4, num_key_value_heads=4,
            )
        ),
    }  # fmt: skip


def _randomise(model: Any, torch: Any) -> Any:
    """Matrices ~ N(0, 1/fan_in): activations O(1), as in a trained model (the models' own init
    is 0.02-wide, which leaves activations tiny and recurrent states in the denormal range)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def bench_family(
    name: str, build: Callable[[], Any], seqs: list[int], steps: int, prompt: int, unified_kv: bool = False
) -> list[str]:
    import torch
    from transformers import GenerationConfig

    from statecache.integrations.transformers import Engine, StatecacheCausalLM

    model = _randomise(build(), torch)
    vocab = model.config.vocab_size
    rows = []
    for n in seqs:
        prompts = np.random.default_rng(n).integers(1, vocab, (n, prompt))
        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)

        lm = StatecacheCausalLM(model, n_seq_max=n, n_ctx=prompt + steps + 32, unified_kv=unified_kv)

        def hf(new: int, ids: Any = ids, mask: Any = mask) -> None:
            gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, generation_config=gen)

        def sc(new: int, lm: Any = lm, prompts: Any = prompts) -> None:
            eng = Engine(lm)
            for p in prompts:
                eng.add(p.tolist(), max_new_tokens=new)
            eng.run()

        best: dict[str, tuple[float, float]] = {}
        for path, fn in (("hf", hf), ("sc", sc)):
            fn(2)  # warm-up: first-call costs (allocations, validation) do not count
            runs = []
            for _ in range(2):
                c1, w1 = _timed(lambda fn=fn: fn(1))
                cn, wn = _timed(lambda fn=fn: fn(1 + steps))
                runs.append((max(cn - c1, 1e-9), max(wn - w1, 1e-9)))
            best[path] = (min(r[0] for r in runs), min(r[1] for r in runs))
        toks = n * steps
        hc, hw = (toks / t for t in best["hf"])
        sc_c, sc_w = (toks / t for t in best["sc"])
        rows.append(
            f"{name:17s} {n:5d} {hc:12.0f} {sc_c:12.0f} {sc_c / hc:7.2f}x {hw:12.0f} {sc_w:12.0f} {sc_w / hw:7.2f}x"
        )
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="all", help="comma-separated (default: all covered families)")
    ap.add_argument("--seqs", default="1,8,32", help="sequence counts")
    ap.add_argument("--steps", type=int, default=16, help="decode steps measured per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="prompt length")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads = statecache C threads")
    ap.add_argument("--keep-denormals", action="store_true", help="do not flush denormals (both paths)")
    ap.add_argument("--unified-kv", action="store_true", help="hybrids: one KV stream for all sequences")
    args = ap.parse_args(argv)

    # before torch and the C kernels start their thread pools
    os.environ["STATECACHE_NUM_THREADS"] = str(args.threads)
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # generate() warns about eos_token_id=-1 (no early stop) every call
    ftz = False if args.keep_denormals else bool(torch.set_flush_denormal(True))
    models = _models(transformers)
    names = list(models) if args.families == "all" else args.families.split(",")
    unknown = [n for n in names if n not in models]
    if unknown:
        print(f"unknown families {unknown}; known: {', '.join(models)}", file=sys.stderr)
        return 2
    seqs = [int(s) for s in args.seqs.split(",")]
    print(
        f"decode tokens/s, {args.steps} steps after a {args.prompt}-token prompt; threads {args.threads} "
        f"(torch and statecache); denormals flushed: {ftz}; "
        f"KV streams: {'one' if args.unified_kv else 'one per sequence'}; "
        f"transformers {transformers.__version__}, torch {torch.__version__}"
    )
    print(f"{'family':17s} {'seqs':>5s} {'hf cpu-t/s':>12s} {'sc cpu-t/s':>12s} {'ratio':>8s} "
          f"{'hf wall-t/s':>12s} {'sc wall-t/s':>12s} {'ratio':>8s}")  # fmt: skip
    for name in names:
        bench_family(name, models[name], seqs, args.steps, args.prompt, args.unified_kv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
