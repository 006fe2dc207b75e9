"""Only here because cffi's ``cffi_modules`` needs a setup() call: it builds
the CPU backend's C kernels at install time.  Everything else is in
pyproject.toml."""

import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_BUILD = os.path.join("backends", "cpu", "build.py")

setup(
    cffi_modules=[f"{CPU_BUILD}:ffibuilder"] if os.path.exists(os.path.join(HERE, CPU_BUILD)) else [],
)
