"""Backend registry: entry points, third-party plugins, hook validation,
allowlist, duplicates, selection and error texts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings

import pluggy
import pytest

import statecache
from statecache.backend import PROTOCOL_VERSION, Backend
from statecache.backends.reference.device import ReferenceDevice
from statecache.errors import BackendNotFoundError, BackendUnavailableError, SettingsWarning
from statecache.hookspecs import hookimpl
from statecache.registry import BackendRegistry, DuplicateBackendWarning


class FakeBackend(Backend):
    protocol = PROTOCOL_VERSION

    def __init__(self, name, priority=5, ok=True, reason=""):
        self.name = name
        self.priority = priority
        self._ok, self._reason = ok, reason
        self._devices = None

    def availability(self):
        return self._ok, self._reason

    def devices(self):
        if self._devices is None:
            dev = ReferenceDevice()
            dev.id = f"{self.name}:0"
            dev.backend_name = self.name
            self._devices = [dev] if self._ok else []
        return self._devices


def plugin_with(*backends):
    mod = types.ModuleType("fake_plugin_" + "_".join(f"{b.name}{id(b)}" for b in backends))

    @hookimpl
    def statecache_register_backends(registry):
        for b in backends:
            registry.add(b)

    mod.statecache_register_backends = statecache_register_backends
    return mod


def test_entry_points_register_the_builtin_reference_backend():
    reg = BackendRegistry()
    assert "reference" in reg.names()
    entry = next(e for e in reg.entries() if e.name == "reference")
    assert entry.distribution == "statecache"
    assert entry.availability() == (True, "")
    assert reg.get_device("reference").id == "reference:0"


def test_builtin_backends_are_declared_as_entry_points_like_third_parties():
    import importlib.metadata

    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="statecache.backends")}
    assert eps["reference"] == "statecache.backends.reference"
    assert {"cpu", "opencl", "cuda"} <= set(eps)


def test_third_party_plugin_object_registers_a_backend():
    reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(FakeBackend("acme", priority=50))])
    assert reg.names() == ["acme"]
    assert reg.get_device().id == "acme:0"  # highest priority wins when nothing is named


def test_plugin_registered_late_is_still_called():
    reg = BackendRegistry(load_entry_points=False)
    assert reg.names() == []
    reg.register_plugin(plugin_with(FakeBackend("late")), distribution="late-dist", version="1.2")
    assert reg.names() == ["late"]


def test_misspelled_hook_fails_loudly():
    mod = types.ModuleType("typo_plugin")

    @hookimpl
    def statecache_regsiter_backends(registry):  # the typo under test
        pass

    mod.statecache_regsiter_backends = statecache_regsiter_backends
    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'statecache_regsiter_backends'"):
        BackendRegistry(load_entry_points=False, plugins=[mod])


def test_allowlist_restricts_loading(monkeypatch):
    monkeypatch.setenv("STATECACHE_BACKENDS", "acme")
    reg = BackendRegistry(plugins=[plugin_with(FakeBackend("acme"), FakeBackend("other"))])
    assert reg.names() == ["acme"]
    with pytest.raises(BackendNotFoundError, match="STATECACHE_BACKENDS restricts loading"):
        reg.get_device("reference")


def test_empty_allowlist_loads_nothing(monkeypatch):
    monkeypatch.setenv("STATECACHE_BACKENDS", "")
    assert BackendRegistry().names() == []


def test_duplicate_names_warn_naming_both():
    a, b = FakeBackend("dup"), FakeBackend("dup")
    with pytest.warns(DuplicateBackendWarning, match="registered twice"):
        reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(a), plugin_with(b)])
    assert reg.get_backend("dup") in (a, b)
    assert len(reg.names()) == 1


def test_unknown_name_lists_installed_and_says_who_provides_it():
    reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(FakeBackend("acme"))])
    with pytest.raises(BackendNotFoundError) as err:
        reg.get_device("opencl:0")
    text = str(err.value)
    assert "no backend named 'opencl'" in text and "installed: acme" in text
    assert "statecache[opencl]" in text
    with pytest.raises(BackendNotFoundError, match="is the plugin package installed"):
        reg.get_device("nosuch")


def test_unavailable_backend_is_listed_with_reason_not_crashing():
    broken = FakeBackend("gpuish", ok=False, reason="no CUDA driver")
    reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(broken, FakeBackend("fine", priority=1))])
    entry = next(e for e in reg.entries() if e.name == "gpuish")
    assert entry.availability() == (False, "no CUDA driver")
    with pytest.raises(BackendUnavailableError, match="no CUDA driver"):
        reg.get_device("gpuish")
    assert reg.get_device().id == "fine:0"


def test_availability_that_raises_is_contained():
    class Exploding(FakeBackend):
        def availability(self):
            raise RuntimeError("boom")

    reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(Exploding("x"))])
    ok, reason = next(iter(reg.entries())).availability()
    assert not ok and "boom" in reason


def test_device_selection_by_index_and_environment(monkeypatch):
    reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(FakeBackend("acme"))])
    assert reg.get_device("acme:0").id == "acme:0"
    with pytest.raises(BackendNotFoundError, match="acme has: acme:0"):
        reg.get_device("acme:3")
    with pytest.raises(BackendNotFoundError, match="not an integer"):
        reg.get_device("acme:x")
    monkeypatch.setenv("STATECACHE_DEVICE", "acme:0")
    assert reg.get_device().id == "acme:0"


def test_each_registry_owns_its_plugin_manager():
    a = BackendRegistry(load_entry_points=False)
    b = BackendRegistry(load_entry_points=False)
    assert a.pm is not b.pm


def test_default_registry_is_lazy():
    code = textwrap.dedent(
        """
        import statecache.registry as r
        assert r._default is None
        import statecache
        assert r._default is None
        statecache.get_device("reference")
        assert r._default is not None
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_hook_is_prefixed_and_documented():
    from statecache import hookspecs

    names = hookspecs.all_hook_names()
    assert names, "no hooks found"
    for name in names:
        doc = getattr(hookspecs, name).__doc__ or ""
        assert ":param" in doc and ":return" in doc, f"{name} is not documented"


def test_trace_switch_prints_hook_calls(monkeypatch, capsys):
    monkeypatch.setenv("STATECACHE_TRACE_PLUGINS", "1")
    BackendRegistry(load_entry_points=False, plugins=[plugin_with(FakeBackend("acme"))])
    assert "statecache_register_backends" in capsys.readouterr().out


def test_package_exports_get_device():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert statecache.get_device("reference").backend_name == "reference"


def _make_dist(root, dist, module, backend_name, ep_name=None):
    """A minimal installed distribution (dist-info + module) under ``root``."""
    (root / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from statecache.hookspecs import hookimpl
            from statecache.backends.reference.device import ReferenceBackend

            class {module.title().replace("_", "")}(ReferenceBackend):
                name = {backend_name!r}
                priority = 99

            @hookimpl
            def statecache_register_backends(registry):
                registry.add({module.title().replace("_", "")}())
            """
        )
    )
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[statecache.backends]\n{ep_name or backend_name} = {module}\n")


def test_third_party_distribution_is_found_through_entry_points(tmp_path):
    _make_dist(tmp_path, "acme-statecache", "acme_sc", "acme")
    code = textwrap.dedent(
        """
        from statecache.registry import BackendRegistry
        reg = BackendRegistry()
        e = next(e for e in reg.entries() if e.name == 'acme')
        print(e.distribution, e.dist_version, reg.get_device().id)
        """
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["acme-statecache", "1.0"]


def test_two_distributions_claiming_one_name_warn_naming_both(tmp_path):
    _make_dist(tmp_path, "rogue-statecache", "rogue_sc", "reference")
    code = textwrap.dedent(
        """
        import warnings
        from statecache.registry import BackendRegistry
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            BackendRegistry()
        print([str(x.message) for x in w])
        """
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "rogue-statecache" in out.stdout and "statecache 0" in out.stdout


def test_allowlist_names_no_plugin_provides_are_a_warning(monkeypatch):
    monkeypatch.setenv("STATECACHE_BACKENDS", "acme,acmee")
    with pytest.warns(SettingsWarning, match=r"STATECACHE_BACKENDS names 'acmee', which no installed plugin provides"):
        reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(FakeBackend("acme"))])
    assert reg.names() == ["acme"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit allowlist is the caller's own: no warning
        BackendRegistry(load_entry_points=False, allowlist=["nosuch"])


def test_empty_registry_says_why(monkeypatch):
    monkeypatch.setenv("STATECACHE_BACKENDS", "")
    assert "STATECACHE_BACKENDS is set but empty" in BackendRegistry().why_empty()
    monkeypatch.delenv("STATECACHE_BACKENDS")
    assert BackendRegistry().why_empty() == ""
    assert "entry-point group 'statecache.backends' is empty" in BackendRegistry(load_entry_points=False).why_empty()


@pytest.mark.parametrize("value", ["nosuch", "acme:7"])
def test_a_device_from_statecache_device_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("STATECACHE_DEVICE", value)
    reg = BackendRegistry(load_entry_points=False, plugins=[plugin_with(FakeBackend("acme"))])
    with pytest.raises(BackendNotFoundError, match=f"^STATECACHE_DEVICE='{value}': no "):
        reg.get_device()


def test_get_device_with_nothing_usable_says_why_the_allowlist_left_nothing(monkeypatch):
    """`get_device()` under an empty or mistyped STATECACHE_BACKENDS names the variable,
    not only "backends known: none"."""
    monkeypatch.setenv("STATECACHE_BACKENDS", "")
    with pytest.raises(BackendNotFoundError, match="STATECACHE_BACKENDS is set but empty"):
        BackendRegistry().get_device()
    monkeypatch.setenv("STATECACHE_BACKENDS", "refrence")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SettingsWarning)  # the typo warning is tested above
        reg = BackendRegistry()
    with pytest.raises(BackendNotFoundError, match=r"allows only refrence.*installed: .*reference"):
        reg.get_device()
