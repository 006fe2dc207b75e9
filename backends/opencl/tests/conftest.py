"""Fixtures of the OpenCL backend tests: one OpenCL device and the reference
device, each built once per session (PoCL compiles slowly, so the kernels a
session builds are kept on the device object and reused by every test)."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.registry import BackendRegistry


@pytest.fixture(scope="session")
def cl_device():
    registry = BackendRegistry(load_entry_points=False, plugins=[_opencl_plugin()])
    entry = next(e for e in registry.entries() if e.name == "opencl")
    ok, reason = entry.availability()
    if not ok:
        pytest.skip(f"no OpenCL device: {reason}")
    return registry.get_device("opencl")


@pytest.fixture(scope="session")
def ref_dev():
    from statecache.backends import reference

    return BackendRegistry(load_entry_points=False, plugins=[reference]).get_device("reference")


@pytest.fixture
def rng():
    return np.random.default_rng(20240607)


def _opencl_plugin():
    from statecache.backends import opencl

    return opencl
