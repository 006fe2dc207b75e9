"""Shared test configuration for the core tests.

Hypothesis: the ``ci`` profile is derandomized and bounded so CI time is
predictable; ``dev`` explores more; ``stress`` runs ``HYPOTHESIS_MAX_EXAMPLES``
examples (default 2000; ``HYPOTHESIS_STATEFUL_STEPS`` rules per state-machine run,
default 40) of every property and state machine, randomized, for
the heavy runs before a release (e.g. ``HYPOTHESIS_PROFILE=stress pytest
tests/test_hybrid_stateful.py tests/test_recurrent_stateful.py``).  Select with
HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.register_profile(
    "stress",
    deadline=None,
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "2000")),
    stateful_step_count=int(os.environ.get("HYPOTHESIS_STATEFUL_STEPS", "40")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def ref_device():
    """The reference device from a registry that loads only the reference backend."""
    from statecache.registry import BackendRegistry

    return BackendRegistry(allowlist=["reference"]).get_device("reference")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
