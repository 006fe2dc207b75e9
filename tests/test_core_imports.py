"""The core never imports torch, cffi or pyopencl (DESIGN.md, style lesson 1).

Every module of the core is imported, subpackages included, with those
packages blocked; only ``statecache.integrations`` (adapters for outside
runtimes, which import their runtime lazily on the top floor) is exempt.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import statecache

CORE = pathlib.Path(__file__).resolve().parents[1] / "core"
#: Subpackages of the core allowed to import outside runtimes.
EXEMPT = ("integrations",)


def core_modules() -> list[str]:
    """Import names of every module under core/, found by walking the folder
    (not pkgutil over ``statecache.__path__``: an installed wheel merges the
    backends and the suite into that path, and they may import cffi)."""
    out = []
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).with_suffix("")
        if rel.parts[0] in EXEMPT or rel.name == "__main__":
            continue
        out.append(".".join(("statecache", *rel.parts)).removesuffix(".__init__"))
    return out


def test_core_imports_without_torch_cffi_pyopencl():
    modules = core_modules()
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


def test_make_memory_lives_above_the_memories_and_old_imports_still_work():
    from statecache import factory, spec

    assert spec.make_memory is factory.make_memory
    assert spec.make_model_memory is factory.make_model_memory
    # spec.py is data below the memories: it imports none of them at import time.
    text = (CORE / "spec.py").read_text()
    for module in ("recurrent", "kv_cache", "hybrid", "hybrid_idx", "factory"):
        assert f"from statecache.{module} import" not in text.split("def __getattr__", 1)[0]


def test_ml_dtypes_is_imported_only_when_bf16_is_used():
    """ml_dtypes costs about half a second of CPU to import; a process that
    never touches bf16 (the CLI, each rank of a distributed test) must not
    pay it, and the first bf16 use must still find the same dtype."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import statecache
        from statecache.dtypes import DType
        dev = statecache.get_device("reference")
        buf = dev.upload(np.ones(4, np.float32))
        assert DType.parse("f16") is DType.F16 and DType.F16.itemsize == 2
        assert "ml_dtypes" not in sys.modules, "imported without bf16"
        assert DType.BF16.itemsize == 2 and "ml_dtypes" not in sys.modules
        import ml_dtypes
        assert DType.BF16.numpy == np.dtype(ml_dtypes.bfloat16)
        assert DType.parse(np.dtype(ml_dtypes.bfloat16)) is DType.BF16
        bf = dev.upload(np.arange(4, dtype=np.float32), "bf16")
        assert bf.dtype is DType.BF16
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
