"""The conformance cases of the protocol-2 contract (packed tokens, snapshot
tables, Mamba-1 snapshots, fused epilogues, refusals, and the linear-attention
primitives with their metamorphic cases) on the CUDA kernels
through the host emulation: the same kernel bodies, indexing and argument
structs the GPU runs (the GPU itself runs them in ``gpu_check.sh``)."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.conformance import epilogue_cases, linear_attn_cases, varlen_cases

CASES = varlen_cases.all_cases() + epilogue_cases.all_cases() + linear_attn_cases.all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_contract_case_on_the_emulated_kernels(emu, case) -> None:  # type: ignore[no-untyped-def]
    ok, reason = case.support(emu)
    assert ok, reason  # the CUDA kernels implement the whole contract
    with np.errstate(all="ignore"):
        case.run(emu)
