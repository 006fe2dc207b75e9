"""Fixtures of the OpenCL backend tests: one OpenCL device and the reference
device, each built once per session (PoCL compiles slowly, so the kernels a
session builds are kept on the device object and reused by every test).

Every test that needs a platform asks for ``cl_platform`` (or ``cl_device``),
which skips with the backend's own reason on a machine without one (no
pyopencl, no ICD, no device); tests that fake a missing platform ask for
``pyopencl`` only."""

from __future__ import annotations

import numpy as np
import pytest

from statecache.registry import BackendRegistry


@pytest.fixture(scope="session")
def pyopencl():
    """The pyopencl module (the ``opencl`` extra), or a skip saying it is missing."""
    return pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install 'statecache[opencl]')")


@pytest.fixture(scope="session")
def cl_platform():
    """The registry that found an OpenCL device here, or a skip with the reason there is none."""
    registry = BackendRegistry(load_entry_points=False, plugins=[_opencl_plugin()])
    entry = next(e for e in registry.entries() if e.name == "opencl")
    ok, reason = entry.availability()
    if not ok:
        pytest.skip(f"no OpenCL device: {reason}")
    return registry


@pytest.fixture(scope="session")
def cl_device(cl_platform):
    return cl_platform.get_device("opencl")


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
