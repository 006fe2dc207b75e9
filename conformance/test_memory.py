"""Incremental decode through statecache's memories vs full recompute."""

from statecache.conformance.plugin import run_case

CASE_FAMILY = "memory"


def test_memory(conformance_device, conformance_case):
    run_case(conformance_device, conformance_case)
