"""Meta-tests of the conformance suite: coverage of the protocol, deliberately
broken backends are caught, a third-party plugin package runs the kit, and
the pytest plugin stays inert in ordinary runs."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from statecache import hookspecs
from statecache.backend import PRIMITIVES, Buffer, Caps
from statecache.backends.reference import linear_attn as ref_linear
from statecache.backends.reference import ssm_scan as ref_scan
from statecache.backends.reference.device import ReferenceDevice
from statecache.conformance import catalog
from statecache.conformance.cases import Case, ConformanceFailure, Requirement
from statecache.dtypes import DType
from statecache.hostmem import as_array

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGIN_PKG = ROOT / "tests" / "plugin_pkg"


def _cases(prefix: str) -> list[Case]:
    return [c for c in catalog.all_cases() if c.id.startswith(prefix)]


# -- coverage --------------------------------------------------------------------


@pytest.mark.parametrize("op", PRIMITIVES)
def test_every_primitive_has_reference_and_metamorphic_cases(op):
    families = {c.family for c in catalog.all_cases() if op in c.ops}
    assert {"primitive", "metamorphic"} <= families, f"{op} is covered only by {families}"
    assert any(c.family == "primitive" and c.ops == (op,) for c in catalog.all_cases())


def test_memory_cases_exist_and_ids_are_stable():
    ids = [c.id for c in catalog.all_cases()]
    assert len(ids) == len(set(ids))
    assert any(c.family == "memory" for c in catalog.all_cases())
    assert "ssm_scan[mamba2-d128-h64-n16-g2-t32-s4-K1-f32]" in ids
    assert "ssm_scan[mamba1-d16-h1-n1024-g1-t32-s4-K1-f32]" in ids
    assert [c.id for c in catalog.all_cases()] == ids  # same order every time


@pytest.mark.parametrize("hook", hookspecs.all_hook_names())
def test_every_hook_is_documented(hook):
    spec = getattr(hookspecs, hook)
    assert spec.__doc__ and ":param" in spec.__doc__, f"{hook} has no parameter documentation"
    text = (ROOT / "docs" / "writing-a-backend.md").read_text(encoding="utf-8")
    assert hook in text, f"docs/writing-a-backend.md does not mention {hook}"


def test_unknown_capability_names_are_errors():
    with pytest.raises(ValueError, match="unknown capability"):
        Case("x[y]", "primitive", ("get_rows",), lambda d: None, caps={"tensor_cores": True})
    with pytest.raises(ValueError, match="unknown primitive"):
        Requirement("ssm_scan2")


# -- broken backends are caught ------------------------------------------------------


class WritesPastRows(ReferenceDevice):
    """Scatter and scan write one element past the last row they address."""

    def _set_rows(self, dst, rows_buf, src, rows_host):
        super()._set_rows(dst, rows_buf, src, rows_host)
        end = dst.offset + (int(rows_host.max()) + 1) * dst.shape[1]
        if end < dst.storage.size:
            dst.storage[end] = -dst.storage[end] - 7  # sign flip: visible in every dtype

    def _ssm_scan(self, shp, pool, start_rows, snap_rows, *args):
        super()._ssm_scan(shp, pool, start_rows, snap_rows, *args)
        end = pool.offset + (int(self.index_values(snap_rows).max()) + 1) * pool.shape[1]
        if end < pool.storage.size:
            pool.storage[end] = -pool.storage[end] - 7


class SkipsSnapshotPlanes(ReferenceDevice):
    """A scan (and linear attention) that writes only the final state, whatever n_snap asks for."""

    def _final_only(self, fn, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors):
        table = self.index_values(snap_rows).reshape(shp.n_seqs, shp.n_cols)
        final = np.ascontiguousarray(table[:, :1])
        fn(dataclasses.replace(shp, n_cols=1), as_array(pool), self.index_values(start_rows), final,
           self.index_values(cu_seqlens), *(as_array(t) for t in tensors))  # fmt: skip

    def _rwkv_wkv6(self, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors):
        self._final_only(ref_linear.rwkv_wkv6, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors)

    def _rwkv_wkv7(self, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors):
        self._final_only(ref_linear.rwkv_wkv7, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors)

    def _gated_linear_attn(self, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors):
        self._final_only(ref_linear.gated_linear_attn, shp, pool, start_rows, snap_rows, cu_seqlens, *tensors)

    def _ssm_scan(self, shp, pool, start_rows, snap_rows, cu_seqlens, x, dt, A, B, C, y, D, z, dt_bias):
        table = self.index_values(snap_rows).reshape(shp.n_seqs, shp.n_cols)
        ref_scan.ssm_scan(
            dataclasses.replace(shp, n_cols=1),
            as_array(pool),
            self.index_values(start_rows),
            np.ascontiguousarray(table[:, :1]),
            self.index_values(cu_seqlens),
            *(as_array(t) for t in (x, dt, A, B, C, y)),
            *(None if t is None else as_array(t) for t in (D, z, dt_bias)),
        )


class RoundsBf16Up(ReferenceDevice):
    """Converts to bf16 by rounding ties away from zero instead of to even."""

    def _set_rows(self, dst, rows_buf, src, rows_host):
        if dst.dtype is not DType.BF16:
            return super()._set_rows(dst, rows_buf, src, rows_host)
        bits = as_array(src).astype(np.float32).view(np.uint32)
        up = ((bits.astype(np.uint64) + 0x8000) >> 16).astype(np.uint16)
        as_array(dst)[rows_host] = up.view(DType.BF16.numpy)


def _failures(device, cases):
    failed, passed = [], []
    for case in cases:
        ok, _ = case.support(device)
        assert ok
        try:
            with np.errstate(all="ignore"):
                case.run(device)
        except ConformanceFailure:
            failed.append(case.id)
        else:
            passed.append(case.id)
    return failed, passed


def test_writing_past_rows_is_caught():
    dev = WritesPastRows()
    failed, _ = _failures(dev, _cases("set_rows[") + _cases("ssm_scan[mamba2-d64"))
    assert {c.id for c in _cases("set_rows[")} <= set(failed)
    assert all(c.id in failed for c in _cases("ssm_scan[mamba2-d64"))


def test_skipping_snapshot_planes_is_caught():
    dev = SkipsSnapshotPlanes()
    # (A one-token call starting from its own plane-1 row rewrites that row with
    # the same input state, so skipping it is invisible there: not counted.)
    multi = [c for c in _cases("ssm_scan[") if "-K1-" not in c.id and not c.id.endswith("-plane]")]
    meta = _cases("ssm_scan.snapshot_prefix")
    failed, passed = _failures(dev, multi + meta)
    assert set(failed) == {c.id for c in multi + meta}, passed
    # ...while single-plane scans still pass: the cases are precise, not noisy.
    ok_failed, _ = _failures(dev, [c for c in _cases("ssm_scan[") if "-K1-" in c.id][:3])
    assert ok_failed == []


def test_wrong_bf16_rounding_is_caught():
    failed, _ = _failures(RoundsBf16Up(), _cases("set_rows[r32-e51-n7-f32>bf16-edge]"))
    assert failed == ["set_rows[r32-e51-n7-f32>bf16-edge]"]


# -- the device protocol through views ------------------------------------------------


class WritesAtTheStart(ReferenceDevice):
    """``_write`` ignores ``buffer.offset``: it writes at the start of the storage."""

    def _write(self, buffer, host):
        buffer.storage[: host.size] = host.reshape(-1)


class ReadsFromTheStart(ReferenceDevice):
    """``_read`` ignores ``buffer.offset`` (strides honoured)."""

    def _read(self, buffer):
        at_start = Buffer(self, buffer.storage, buffer.dtype, buffer.shape, strides=buffer.strides, offset=0)
        return super()._read(at_start)


class CopiesFromTheStart(ReferenceDevice):
    """``_copy_buffer`` copies whole storages from their first element."""

    def _copy_buffer(self, src, dst):
        dst.storage[: dst.size] = src.storage[: src.size].astype(dst.storage.dtype)


class IndexKernelsIgnoreViews(ReferenceDevice):
    """Row kernels read their index array from the start of its storage, as a
    kernel given the storage handle without the view's offset and strides does."""

    def _get_rows(self, src, rows_buf, dst, rows_host):
        super()._get_rows(src, rows_buf, dst, rows_buf.storage[: rows_buf.size].copy())


BROKEN_TRANSFERS = {
    WritesAtTheStart: {"device.write_views[f32]", "device.write_views[i32]", "device.fill_bytes_view[f32]"},
    ReadsFromTheStart: {"device.read_views[f32]", "device.read_views[bf16]", "device.upload_download[f32]"},
    CopiesFromTheStart: {"device.copy_buffer_views[f32]", "device.copy_buffer_views[f16]"},
    IndexKernelsIgnoreViews: {"device.index_views[f32]"},
}


@pytest.mark.parametrize("broken", list(BROKEN_TRANSFERS), ids=lambda c: c.__name__)
def test_transfers_that_ignore_view_offsets_are_caught(broken):
    failed, passed = [], []
    for case in _cases("device."):
        try:  # the suite fails a case on any exception: a refusal of corrupt indices counts
            with np.errstate(all="ignore"):
                case.run(broken())
        except Exception:
            failed.append(case.id)
        else:
            passed.append(case.id)
    assert BROKEN_TRANSFERS[broken] <= set(failed), failed
    # Precise, not noisy: the cases on whole buffers still pass.
    assert "device.alloc_zero[f32]" in passed and "device.indices[i32]" in passed


def test_the_reported_write_through_a_view_is_caught():
    """The issue's reproduction: ``dev.write(b.view((1, 3), (3, 1), 6), ...)``
    wrote row 0 instead of row 2, and every case passed."""
    dev = WritesAtTheStart()
    b = dev.upload(np.zeros((3, 3), np.float32))
    dev.write(b.view((1, 3), (3, 1), 6), np.ones((1, 3), np.float32))
    assert b.numpy()[0].tolist() == [1, 1, 1]  # the bug, reproduced
    with pytest.raises(ConformanceFailure, match=r"write\(\) through view"):
        next(c for c in _cases("device.write_views[f32]")).run(dev)


def test_memory_cases_catch_broken_backends():
    """The memory cases fail on their own, not only through the primitive cases."""
    hybrid = _cases("memory.hybrid[")
    assert {c.id.split("[")[1].rsplit("-", 1)[0] for c in hybrid} >= {"context_shift", "fork_streams"}
    assert {c.id.rsplit("-", 1)[1] for c in hybrid} == {"f32]", "f16]", "bf16]"}
    rollback = [c for c in _cases("memory.") if "[speculative-" in c.id or "[context_shift-" in c.id]
    _, passed = _failures(SkipsSnapshotPlanes(), rollback)
    assert not passed, passed
    _, passed = _failures(WritesPastRows(), _cases("memory.hybrid[continuous_batching-"))
    assert not passed, passed


def test_context_shift_case_needs_the_k_rotation(monkeypatch):
    """Without re-rotating the moved K rows, decoding after a shift no longer
    matches the recompute: the case checks the shift, not only the bookkeeping."""
    from statecache.conformance import memory_cases

    monkeypatch.setattr(memory_cases, "rope_k_shift", lambda *args: None)
    _, passed = _failures(ReferenceDevice(), _cases("memory.hybrid[context_shift-"))
    assert not passed, passed


def test_unsupported_cases_are_not_supported_not_failures():
    dev = ReferenceDevice()
    dev.caps = Caps(ops=frozenset(PRIMITIVES) - {"gated_delta_net"}, storage_dtypes=frozenset({DType.F32}))
    verdicts = {c.id: c.support(dev) for c in catalog.all_cases()}
    assert verdicts["device.alloc_zero[bf16]"] == (False, f"{dev.id} cannot store bf16")
    assert not verdicts["gated_delta_net[scalar-S128-hv4-hk4-t32-s2-K1-f32]"][0]
    assert verdicts["ssm_scan[mamba2-d128-h64-n16-g2-t32-s4-K1-f32]"] == (True, "")


# -- the kit run by a third-party package, through pytest and the CLI -----------------


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_PKG), env.get("PYTHONPATH", "")])
    return env


def _pytest(tmp_path, *args):
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "statecache.conformance", "-p", "no:cacheprovider", "-q"]
    cmd += ["--statecache-plugin", "statecache_toy", "--conformance-report", str(report), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_third_party_backend_passes_the_kit(tmp_path):
    proc, report = _pytest(tmp_path, "--backend", "toy", "--device", "all", "-k", "rows or alloc or snapshot_prefix")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["devices"][0]["id"] == "toy:0"
    assert report["devices"][0]["backend_version"] == "0.0.1"
    statuses = {c["status"] for c in report["cases"]}
    assert statuses == {"pass"}
    assert len(report["cases"]) > 40
    assert report["summary"]["toy:0"]["pass"] == len(report["cases"])


def test_broken_third_party_backend_fails_with_xfail_and_stale_entries(tmp_path):
    proc, report = _pytest(tmp_path, "--backend", "toy_oob", "-k", "set_rows or get_rows")
    assert proc.returncode == 1, proc.stdout[-3000:]
    by_id = {c["case"]: c for c in report["cases"]}
    assert by_id["set_rows[r16-e33-n5-f32]"]["status"] == "xfail"
    assert by_id["set_rows[r64-e4096-n8-f32]"]["status"] == "fail"
    assert (
        "guard band" in by_id["set_rows[r64-e4096-n8-f32]"]["detail"]
        or "must not touch" in (by_id["set_rows[r64-e4096-n8-f32]"]["detail"])
    )
    assert by_id["get_rows[r64-e4096-n8-f32]"]["status"] == "pass"
    assert report["stale_expected_failures"] == [
        {
            "backend": "toy_oob",
            "entry": "set_rows[no-such-case]",
            "source": "statecache_conformance_expected_failures hook",
        }
    ]
    assert "stale expected failure" in proc.stdout


def _run_plugin_pkg(tmp_path, module, backend, k):
    """Run the kit with pytest on a plugin package written under tmp_path/pkg."""
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "pkg"), env["PYTHONPATH"]])
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "statecache.conformance", "-p", "no:cacheprovider", "-q"]
    cmd += ["--statecache-plugin", module, "--backend", backend, "-k", k, "--conformance-report", str(report)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_not_supported_is_its_own_status(tmp_path):
    pkg = tmp_path / "pkg" / "statecache_nof16"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from statecache.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def statecache_register_backends(registry):\n"
        "    from statecache import Caps, DType\n"
        "    from statecache.backend import PRIMITIVES\n"
        "    from statecache_toy.backend import ToyBackend\n"
        "    b = ToyBackend('nof16', broken=False)\n"
        "    b._devices[0].caps = Caps(ops=frozenset(PRIMITIVES), storage_dtypes=frozenset({DType.F32}))\n"
        "    registry.add(b)\n"
    )
    proc, data = _run_plugin_pkg(tmp_path, "statecache_nof16", "nof16", "alloc_zero or zero_rows")
    assert proc.returncode == 0, proc.stdout[-3000:]
    by_id = {c["case"]: c["status"] for c in data["cases"]}
    assert by_id["device.alloc_zero[f16]"] == "not supported"
    assert by_id["device.alloc_zero[f32]"] == "pass"
    assert data["summary"]["nof16:0"]["not supported"] == 4
    assert "not supported" in proc.stdout


def _cli(tmp_path, *args):
    cmd = [sys.executable, "-m", "statecache.cli", "conformance", "--plugin", "statecache_toy", "--width", "160"]
    return subprocess.run([*cmd, *args], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)


def test_cli_runs_the_kit_and_prints_a_table(tmp_path):
    report = tmp_path / "cli.json"
    proc = _cli(tmp_path, "--backend", "toy", "-k", "zero_rows", "--report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "toy:0" in proc.stdout and "not supported" in proc.stdout
    data = json.loads(report.read_text())
    assert {c["status"] for c in data["cases"]} == {"pass"}
    started = datetime.datetime.fromisoformat(data["started"])  # ISO 8601, in UTC
    assert started.utcoffset() == datetime.timedelta(0)


def test_cli_exit_codes(tmp_path):
    assert _cli(tmp_path, "--backend", "toy_oob", "-k", "set_rows and r64").returncode == 1
    assert _cli(tmp_path, "--backend", "no_such_backend").returncode == 2
    assert _cli(tmp_path, "--backend", "toy", "--device", "toy:7").returncode == 2
    assert _cli(tmp_path, "--backend", "toy_nodev", "--require-device").returncode == 1


def test_plugin_is_inert_in_ordinary_runs(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_one():\n    assert True\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--backend", "nonexistent", "test_plain.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout
    assert "statecache conformance" not in proc.stdout


def test_device_ids_of_backends_not_under_test_are_usage_errors(tmp_path):
    # cpu:0 would have been dropped without a word while only toy is tested
    proc = _cli(tmp_path, "--backend", "toy", "--device", "toy:0,cpu:0", "-k", "zero_rows")
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "names a backend not given to --backend" in proc.stdout


def test_a_skip_that_is_not_not_supported_is_a_failure(tmp_path):
    """A backend that calls pytest.skip inside a primitive must not pass unseen."""
    pkg = tmp_path / "pkg" / "statecache_skippy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from statecache.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def statecache_register_backends(registry):\n"
        "    import pytest\n"
        "    from statecache_toy.backend import ToyBackend\n"
        "    b = ToyBackend('skippy', broken=False)\n"
        "    def lazy(*a, **k):\n"
        "        pytest.skip('not implemented yet')\n"
        "    b._devices[0]._zero_rows = lazy\n"
        "    registry.add(b)\n"
    )
    proc, data = _run_plugin_pkg(tmp_path, "statecache_skippy", "skippy", "zero_rows")
    assert proc.returncode == 1, proc.stdout[-3000:]
    statuses = {c["status"] for c in data["cases"] if c["case"].startswith("zero_rows")}
    assert statuses == {"fail"}
    assert all("skipped without a not-supported reason" in c["detail"] for c in data["cases"] if c["status"] == "fail")
