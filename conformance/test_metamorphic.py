"""The device against itself: snapshots vs prefix calls, chunking, batching, round trips."""

from statecache.conformance.plugin import run_case

CASE_FAMILY = "metamorphic"


def test_metamorphic(conformance_device, conformance_case):
    run_case(conformance_device, conformance_case)
