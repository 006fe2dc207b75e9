"""What a built wheel holds.

A regular install (a built wheel) and the editable install expose the same
import names: core/ -> statecache, backends/<n>/ -> statecache.backends.<n>,
conformance/ -> statecache.conformance.  The wheel's tag is the one its
extension has (abi3: cffi compiles the kernels with Py_LIMITED_API), and a
build never ships what an earlier build left under build/.

One wheel is built (from a copy of the sources, with stale artifacts planted
in its build/ folder) and shared by the tests of this module.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {
    "statecache": ROOT / "core",
    "statecache.backends": ROOT / "backends",
    "statecache.conformance": ROOT / "conformance",
}
#: Files an earlier in-tree build could have left: a module since deleted and an
#: extension under the name a non-abi3 build gives it.
STALE = ("statecache/stale_module.py", "statecache/backends/cpu/_kernels.cpython-311-x86_64-linux-gnu.so")


def _sources(dest: pathlib.Path) -> pathlib.Path:
    """A copy of the files a clone has (no build/, no virtual environment)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0:
        for rel in filter(None, listed.stdout.split("\0")):
            if (ROOT / rel).is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dest / rel)
    else:  # not a git checkout (an sdist): everything but build products
        ignore = shutil.ignore_patterns("build", "dist", ".venv", ".tox", "*.egg-info", "__pycache__", "*.so")
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    src = _sources(tmp_path_factory.mktemp("src"))
    lib = f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    for folder in ("lib", lib):
        for rel in STALE:
            (src / "build" / folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / "build" / folder / rel).write_text("stale = True\n")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("statecache-*.whl")
    return built


@pytest.mark.slow
def test_wheel_is_tagged_abi3_like_its_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    extensions = [n for n in names if n.endswith(".so")]
    assert extensions == ["statecache/backends/cpu/_kernels.abi3.so"], extensions
    tags = [
        line.split(": ", 1)[1]
        for line in zipfile.ZipFile(wheel)
        .read(next(n for n in names if n.endswith(".dist-info/WHEEL")))
        .decode()
        .splitlines()
        if line.startswith("Tag: ")
    ]
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert tags == [f"cp311-abi3-{platform}"]
    assert wheel.name.endswith(f"-cp311-abi3-{platform}.whl")


@pytest.mark.slow
def test_wheel_never_ships_what_an_earlier_build_left(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not names & set(STALE), sorted(names & set(STALE))


@pytest.mark.slow
def test_wheel_and_editable_install_share_module_names(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    wheel_modules = sorted(
        n[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for n in names
        if n.startswith("statecache/") and n.endswith(".py")
    )
    assert "statecache.backends.reference.device" in wheel_modules
    assert "statecache.conformance" in wheel_modules
    assert "statecache/py.typed" in names
    for module in wheel_modules:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{module} is in the wheel but not importable here"
        origin = pathlib.Path(spec.origin).resolve()
        assert ROOT in origin.parents, f"{module} resolves outside the checkout: {origin}"
    # Every Python file of the mapped folders is shipped (nothing forgotten).
    shipped = set(wheel_modules)
    for pkg, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            if "tests" in rel.parts:
                continue
            name = ".".join((pkg, *rel.parts)).removesuffix(".__init__")
            if (
                pkg == "statecache.backends"
                and len(rel.parts) > 1
                and rel.parts[0] not in {"reference", "cpu", "opencl", "cuda"}
            ):
                continue
            assert name in shipped, f"{path} is not in the wheel as {name}"
