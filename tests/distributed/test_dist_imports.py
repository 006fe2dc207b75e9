"""statecache.distributed imports without torch (DESIGN.md: only integrations may
import a runtime at import time); what needs torch says so when called."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import statecache.distributed


def test_distributed_imports_without_torch_and_asks_for_it_when_called():
    modules = sorted(m.name for m in pkgutil.iter_modules(statecache.distributed.__path__, "statecache.distributed."))
    assert "statecache.distributed.transfer" in modules
    code = textwrap.dedent(
        f"""
        import importlib, sys
        sys.modules['torch'] = None  # any import of torch now fails
        import statecache.distributed as d
        for m in {modules!r}:
            importlib.import_module(m)
        assert not [m for m, v in sys.modules.items() if m.split('.')[0] == 'torch' and v is not None]
        try:
            d.check_books(object())
        except ImportError as exc:
            print('ok', exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"STATECACHE_BACKENDS": "reference", "PATH": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok") and "statecache[torch]" in out.stdout
