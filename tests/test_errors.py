"""One hierarchy of errors and warnings (core/errors.py): every exception
the package defines is a StatecacheError, every warning a StatecacheWarning,
and the classes that moved there are still importable from their old homes."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import pytest

from statecache import errors

PACKAGES = (
    "statecache",
    "statecache.conformance",
    "statecache.backends.reference",
    "statecache.backends.cpu",
    "statecache.backends.opencl",
    "statecache.backends.cuda",
)
#: A failed conformance check is an AssertionError on purpose: pytest reports it as a failure.
NOT_STATECACHE_ERRORS = {"statecache.conformance.cases.ConformanceFailure"}


def _defined_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules = [name]
        for info in pkgutil.iter_modules(package.__path__, f"{name}."):
            if not info.ispkg and not info.name.endswith("__main__"):
                modules.append(info.name)
        for module_name in modules:
            if module_name.rsplit(".", 1)[-1].startswith(("test_", "conftest")):
                continue
            module = importlib.import_module(module_name)
            for obj in vars(module).values():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module_name:
                    found[f"{module_name}.{obj.__qualname__}"] = obj
    return found


def test_every_error_is_a_statecache_error_and_every_warning_a_statecache_warning():
    classes = _defined_classes()
    assert "statecache.errors.InvariantError" in classes
    assert "statecache.backends.cuda.device.CudaError" in classes  # the walk reaches the backends
    for name, cls in classes.items():
        if issubclass(cls, Warning):
            assert issubclass(cls, errors.StatecacheWarning), f"{name} is not a StatecacheWarning"
        elif name not in NOT_STATECACHE_ERRORS:
            assert issubclass(cls, errors.StatecacheError), f"{name} is not a StatecacheError"


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("statecache.memory", "ContextError"),
        ("statecache.batch", "PosError"),
        ("statecache.backends.cuda.build", "BuildError"),
        ("statecache.conformance.selection", "SelectionError"),
        ("statecache.registry", "DuplicateBackendWarning"),
    ],
)
def test_moved_classes_are_importable_from_their_old_homes(module, name):
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_the_hierarchy_keeps_the_builtin_bases_callers_catch():
    assert issubclass(errors.SelectionError, errors.StatecacheError)
    assert issubclass(errors.BuildError, RuntimeError)  # what the CUDA build raised before
    assert issubclass(errors.InvariantError, AssertionError)  # what the old `assert`s raised
    assert issubclass(errors.PosError, errors.BatchError) and issubclass(errors.PosError, errors.ArgumentError)
    assert issubclass(errors.SettingsError, ValueError)
    from statecache.backends.opencl.build import KernelBuildError

    assert issubclass(KernelBuildError, errors.BuildError)


def test_integration_error_names_the_extra_and_the_versions():
    err = errors.IntegrationError("transformers", extra="transformers", found="4.30.0", needed=">=4.44,<5")
    assert str(err) == (
        "found transformers 4.30.0; statecache needs transformers >=4.44,<5 (pip install 'statecache[transformers]')"
    )
    missing = errors.IntegrationError("torch", extra="torch", found=None, needed="==2.13.0")
    assert str(missing).startswith("torch is not installed; statecache needs torch ==2.13.0")
    assert isinstance(missing, ImportError)


def test_one_filter_silences_every_statecache_warning():
    from statecache.recurrent import NonConsecutivePositionWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", errors.StatecacheWarning)
        for category in (errors.DuplicateBackendWarning, errors.SettingsWarning, NonConsecutivePositionWarning):
            warnings.warn("x", category, stacklevel=1)
