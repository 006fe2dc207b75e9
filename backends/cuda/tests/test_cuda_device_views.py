"""The conformance kit's device cases on the CUDA marshalling (host emulation):
transfers and index arguments through views with offsets and strides."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.conformance.catalog import cases_of

# copy_buffer is a cudaMemcpy the host emulation does not have (the GPU runs those cases).
VIEW_CASES = [c for c in cases_of("device") if "view" in c.id and "copy_buffer" not in c.id]


@pytest.mark.parametrize("case", VIEW_CASES, ids=lambda c: c.id)
def test_device_view_cases_on_the_cuda_marshalling(emu, case) -> None:
    ok, why = case.support(emu)
    if not ok:
        pytest.skip(f"not supported: {why}")
    with np.errstate(all="ignore"):
        case.run(emu)
