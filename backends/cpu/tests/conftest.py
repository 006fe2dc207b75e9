"""Fixtures shared by the CPU backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cpu_cases import cpu_device


@pytest.fixture(params=["split", "default"])
def split_small_calls(request: pytest.FixtureRequest) -> Iterator[None]:
    """Small stateful calls normally run on one thread (waking a second costs
    more than it saves); test shapes are small, so "split" lifts that rule to
    test the thread split itself, "default" tests the rule as shipped."""
    lib = cpu_device()._lib
    previous = lib.sc_set_state_parallel_min_bytes(0 if request.param == "split" else 512 << 10)
    assert previous == 512 << 10  # the shipped default, restored below
    yield
    lib.sc_set_state_parallel_min_bytes(previous)
