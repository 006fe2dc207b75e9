"""Every primitive against the independent float64 oracle (reference included)."""

from statecache.conformance.plugin import run_case

CASE_FAMILY = "oracle"


def test_oracle(conformance_device, conformance_case):
    run_case(conformance_device, conformance_case)
