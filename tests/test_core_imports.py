"""The core never imports torch, cffi or pyopencl (DESIGN.md, style lesson 1)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import statecache


def core_modules():
    return sorted(m.name for m in pkgutil.iter_modules(statecache.__path__, "statecache.") if not m.ispkg)


def test_core_imports_without_torch_cffi_pyopencl():
    modules = [m for m in core_modules() if m != "statecache.__main__"]
    code = textwrap.dedent(
        f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'cffi', '_cffi_backend', 'pyopencl'):
                    raise ImportError('blocked: ' + name)
                return None
        sys.meta_path.insert(0, Block())
        for m in {modules!r}:
            importlib.import_module(m)
        bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cffi', 'pyopencl')]
        assert not bad, bad
        import statecache
        statecache.get_device('reference')
        print('ok', len({modules!r}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"STATECACHE_BACKENDS": "reference", "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_regular_and_editable_layout_expose_the_same_names():
    import statecache.backends.reference as ref
    import statecache.conformance as conf

    assert ref.__name__ == "statecache.backends.reference"
    assert conf.__name__ == "statecache.conformance"
    assert "get_device" in statecache.__all__
