"""Every primitive against the NumPy reference, with guard bands."""

from statecache.conformance.plugin import run_case

CASE_FAMILY = "primitive"


def test_primitive(conformance_device, conformance_case):
    run_case(conformance_device, conformance_case)
