"""On a machine without an OpenCL platform the tests and the main command pass.

``OCL_ICD_VENDORS`` pointed at an empty folder makes the ICD loader find no
platform, exactly as on a fresh machine where ``pocl-opencl-icd`` (or a GPU
driver's ICD) was never installed.  Run in subprocesses under a time bound:
the OpenCL tests of this folder must all skip with the backend's reason (or
pass, for those that fake the missing platform themselves), ``statecache
backends`` must list opencl as unavailable with that reason, and
``statecache conformance`` must pass on the devices that remain.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
NO_PLATFORM = "no OpenCL platform found"


def _without_platform(tmp_path: pathlib.Path) -> dict[str, str]:
    empty = tmp_path / "no-icds"
    empty.mkdir()
    env = dict(os.environ, OCL_ICD_VENDORS=str(empty))
    env.pop("PYOPENCL_CTX", None)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_opencl_tests_and_conformance_pass_with_the_platform_hidden(tmp_path):
    env = _without_platform(tmp_path)
    pyopencl_installed = _run([sys.executable, "-c", "import pyopencl"], env, tmp_path).returncode == 0

    backends = _run([sys.executable, "-m", "statecache.cli", "backends"], env, tmp_path)
    assert backends.returncode == 0, backends.stdout + backends.stderr
    assert "opencl: unavailable: " in backends.stdout
    if pyopencl_installed:
        assert NO_PLATFORM in backends.stdout and "apt-get install pocl-opencl-icd" in backends.stdout

    tests = _run(
        [sys.executable, "-m", "pytest", str(HERE), "-q", "-rs", "-p", "no:cacheprovider", f"--ignore={__file__}"],
        env,
        tmp_path,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    summary = tests.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary and "skipped" in summary, summary
    skips = [line for line in tests.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("no OpenCL device: " in s or "pyopencl is not installed" in s for s in skips), skips

    conformance = _run([sys.executable, "-m", "statecache.cli", "conformance", "-k", "device.indices"], env, tmp_path)
    assert conformance.returncode == 0, conformance.stdout[-4000:]
    assert "opencl: no usable device: unavailable: " in conformance.stdout
