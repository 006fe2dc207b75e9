"""``statecache conformance --perf`` prints bandwidth, the ratio to the
device's memcpy bound and, for other backends, the ratio to the C backend.
Numbers are printed, never asserted (this is not a timed test): the test
checks the report's shape on two tiny benchmark shapes."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from statecache.conformance import benchmarks, perf
from statecache.registry import BackendRegistry


@pytest.fixture
def tiny_shapes(monkeypatch):
    shapes = (
        benchmarks.Shape("tiny gather", "get_rows", {"n": 2, "E": 256}),
        benchmarks.Shape("tiny mamba2", "ssm_scan", {"N": 16, "P": 8, "H": 2, "G": 1, "n_t": 1, "n_s": 2, "K": 1}),
    )
    monkeypatch.setattr(benchmarks, "SHAPES", shapes)
    return shapes


def test_perf_reports_bandwidth_and_ratios(tiny_shapes):
    reg = BackendRegistry()
    devices = [d for d in reg.available_devices() if d.backend_name in ("reference", "cpu", "opencl")]
    names = {d.backend_name for d in devices}
    if "cpu" not in names:
        pytest.fail("the C backend must be built for this test (it is the comparison baseline)")
    out = io.StringIO()
    assert perf.run(devices, Console(file=out, width=200), min_time=0.001) == perf.EXIT_OK
    text = out.getvalue()
    assert "reference:0: skipped" in text
    for shape in tiny_shapes:
        assert text.count(shape.name) == len(names - {"reference"})
    assert "x memcpy bound" in text
    if "opencl" in names:
        assert "x cpu:0" in text  # other backends are compared with the C backend
