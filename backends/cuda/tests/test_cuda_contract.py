"""The conformance cases of the protocol-2 contract (packed tokens, snapshot
tables, Mamba-1 snapshots, fused epilogues, refusals, and the linear-attention
primitives with their metamorphic cases) on the CUDA kernels
through the host emulation: the same kernel bodies, indexing and argument
structs the GPU runs (the GPU itself runs them in ``gpu_check.sh``).

The linear-attention primitives are new enough to get more here: their
oracle cases (the published per-element formulas, every pool dtype) and the
tiny RWKV-6 + RWKV-7 + GLA model through the recurrent memory in f32 (the
wkv states and the token shift, which runs ``ssm_conv`` on a view of the
pool whose rows are the shift's parts)."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.conformance import epilogue_cases, linear_attn_cases, memory_cases, oracle_cases, varlen_cases
from statecache.primitives import LINEAR_ATTN_INPUTS

_LINEAR_EXTRA = [
    c for c in oracle_cases.all_cases() if any(c.id.startswith(f"oracle.{op}[") for op in LINEAR_ATTN_INPUTS)
]
_LINEAR_EXTRA += [
    c for c in memory_cases.all_cases() if c.id.startswith("memory.linear_attn[") and c.id.endswith("-f32]")
]
CASES = varlen_cases.all_cases() + epilogue_cases.all_cases() + linear_attn_cases.all_cases() + _LINEAR_EXTRA


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_contract_case_on_the_emulated_kernels(emu, case) -> None:  # type: ignore[no-untyped-def]
    ok, reason = case.support(emu)
    assert ok, reason  # the CUDA kernels implement the whole contract
    with np.errstate(all="ignore"):
        case.run(emu)
