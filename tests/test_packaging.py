"""A regular install (a built wheel) and the editable install expose the same
import names: core/ -> statecache, backends/<n>/ -> statecache.backends.<n>,
conformance/ -> statecache.conformance."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {
    "statecache": ROOT / "core",
    "statecache.backends": ROOT / "backends",
    "statecache.conformance": ROOT / "conformance",
}


@pytest.mark.slow
def test_wheel_and_editable_install_share_module_names(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("statecache-*.whl")
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
