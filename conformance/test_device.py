"""Device protocol: buffers, transfers, views, refusals."""

from statecache.conformance.plugin import run_case

CASE_FAMILY = "device"


def test_device(conformance_device, conformance_case):
    run_case(conformance_device, conformance_case)
