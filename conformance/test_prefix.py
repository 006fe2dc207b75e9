"""The prefix cache over the tiny model: hits exact against cold runs, refusals change nothing."""

from statecache.conformance.plugin import run_case

CASE_FAMILY = "prefix"


def test_prefix(conformance_device, conformance_case):
    run_case(conformance_device, conformance_case)
