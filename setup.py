"""Only here because cffi's ``cffi_modules`` needs a setup() call: it builds
the CPU backend's C kernels at install time.  Everything else is in
pyproject.toml."""

import os
import shutil

from setuptools import setup
from setuptools.command.build import build

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_BUILD = os.path.join("backends", "cpu", "build.py")

#: The oldest CPython the package supports (pyproject's requires-python).  cffi
#: compiles the kernels' module with Py_LIMITED_API (it is named
#: ``_kernels.abi3.so``), so one wheel serves every CPython from this one on;
#: the wheel's tag must say so (``cp311-abi3``), or pip treats it as 3.11-only.
LIMITED_API = "cp311"


class FreshBuild(build):
    """Build into emptied folders.  setuptools reuses ``build/lib.*`` and
    copies whatever is there into the wheel, so a module deleted or renamed
    since an earlier in-tree build (or an extension of an older name) would
    ship again."""

    def run(self) -> None:
        for folder in (self.build_lib, self.build_temp):
            if folder and os.path.isdir(folder):
                shutil.rmtree(folder)
        super().run()


has_kernels = os.path.exists(os.path.join(HERE, CPU_BUILD))
setup(
    cffi_modules=[f"{CPU_BUILD}:ffibuilder"] if has_kernels else [],
    cmdclass={"build": FreshBuild},
    options={"bdist_wheel": {"py_limited_api": LIMITED_API}} if has_kernels else {},
)
