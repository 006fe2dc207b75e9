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


def test_memcpy_floor_takes_the_in_place_pass_only_where_the_call_updates_in_place():
    """The memcpy floor of a call that reads and writes its state at the same
    rows includes an in-place pass (1 and N threads); a rotated decode, one
    with snapshot planes or over many layers writes elsewhere and keeps the
    copy.  Each row's floor is the fastest of the ways it printed."""
    shapes = {s.name: s for s in benchmarks.SHAPES}
    assert benchmarks.updates_in_place(shapes["rwkv7 decode n_s=1"])
    assert benchmarks.updates_in_place(shapes["gdn prefill"])
    for name in ("mamba2 prefill K=4", "gdn decode n_s=8 K=4 rotate", "gdn decode n_s=8 x layers"):
        assert not benchmarks.updates_in_place(shapes[name]), name
    assert not benchmarks.updates_in_place(shapes["gather 8 x 1 MiB"])

    tiny = [
        benchmarks.Shape("tiny rwkv7", "linear_attn", {"variant": "rwkv7", "H": 2, "S": 16, "n_t": 1, "n_s": 1}),
        benchmarks.Shape(
            "tiny gdn K=2", "gdn", {"H": 2, "S": 16, "n_t": 1, "n_s": 2, "kda": False, "K": 2, "rotate": True}
        ),
    ]
    rows = benchmarks.run("cpu", shapes=tiny, reference=False, scalar=False, min_time=0.001, out=None)
    in_place, rotated = rows
    threads = benchmarks.settings.num_threads()
    want = {"copy", "in place, 1 thread"} | ({f"in place, {threads} threads"} if threads > 1 else set())
    assert set(in_place["memcpy_ways"]) == want
    assert set(rotated["memcpy_ways"]) == {"copy"}
    for row in rows:
        # the bound is the copy (issue 18's memcpy floor); the in-place floor is the stricter column beside it
        assert row["memcpy_how"] == "copy" and row["memcpy_seconds"] == row["memcpy_ways"]["copy"]
        inplace = [v for w, v in row["memcpy_ways"].items() if w != "copy"]
        assert row["inplace_seconds"] == (min(inplace) if inplace else None)
    assert in_place["inplace_ratio"] == in_place["inplace_seconds"] / in_place["seconds"]
    assert rotated["inplace_ratio"] is None
