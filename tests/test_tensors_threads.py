"""The C kernels' thread count next to torch (settings.num_threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from statecache import settings


@pytest.fixture
def no_override(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv("STATECACHE_NUM_THREADS", raising=False)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def test_without_torch_every_core(no_override, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert settings.num_threads() == _cores()


def test_follows_torch_and_its_changes(no_override, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    count = {"n": 3}
    fake = types.SimpleNamespace(get_num_threads=lambda: count["n"])
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert settings.num_threads() == 3
    count["n"] = 1  # torch.set_num_threads(1) between two kernel calls
    assert settings.num_threads() == 1


def test_the_variable_overrides_torch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 7))
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "2")
    assert settings.num_threads() == 2


def test_a_torch_being_imported_or_broken_is_ignored(no_override, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace())  # get_num_threads not defined yet
    assert settings.num_threads() == _cores()

    def broken() -> int:
        raise RuntimeError("no")

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=broken))
    assert settings.num_threads() == _cores()


def test_the_real_torch_and_the_cpu_device(no_override) -> None:  # type: ignore[no-untyped-def]
    """In a fresh process: the cpu device reports torch's count, set before or after it loaded."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    code = (
        "import statecache, torch\n"
        "dev = statecache.get_device('cpu')\n"
        "torch.set_num_threads(1)\n"
        "a = dev.num_threads\n"
        "torch.set_num_threads(2)\n"
        "print(a, dev.num_threads, dev.properties['threads'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "STATECACHE_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["1", "2", "2"]


def test_the_documented_default() -> None:
    var = next(v for v in settings.VARIABLES if v.name == "STATECACHE_NUM_THREADS")
    assert "torch.get_num_threads()" in var.meaning


def test_the_variable_is_read_at_every_call(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """num_threads() reads the environment's raw mapping directly (cheaper than
    os.environ.get): every way of changing the variable still shows at the next call."""
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 5))
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "3")
    assert settings.num_threads() == 3
    os.environ["STATECACHE_NUM_THREADS"] = "1"
    assert settings.num_threads() == 1
    monkeypatch.delenv("STATECACHE_NUM_THREADS")
    assert settings.num_threads() == 5
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "")  # empty: unset
    assert settings.num_threads() == 5
    monkeypatch.setenv("STATECACHE_NUM_THREADS", "x")
    with pytest.raises(ValueError, match="STATECACHE_NUM_THREADS"):
        settings.num_threads()
    # A stand-in for os.environ (a plain dict) is read through its own get().
    monkeypatch.setattr(os, "environ", {"STATECACHE_NUM_THREADS": "4"})
    assert settings.num_threads() == 4
    os.environ["STATECACHE_NUM_THREADS"] = "2"
    assert settings.num_threads() == 2
    monkeypatch.undo()
    monkeypatch.delenv("STATECACHE_NUM_THREADS", raising=False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda: 6))
    assert settings.num_threads() == 6  # the real os.environ again


def test_torch_returning_odd_counts(no_override, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    for given, want in ((0, 1), (-3, 1), (2.0, 2), ("3", 3), (True, 1)):
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(get_num_threads=lambda g=given: g))
        assert settings.num_threads() == want, given
