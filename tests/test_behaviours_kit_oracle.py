"""The kit's independent oracle catches mistakes in the reference itself.

The primitive cases take the reference backend as truth, so a bug in the
reference's math passes them on the reference device (and on every backend
that copied it).  Each test here plants one such bug in the reference
(monkeypatched, nothing on disk changes) and shows that the ``oracle`` family
fails on the reference device while the ``primitive`` family still passes:
the oracle is what catches it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from statecache.backend import PRIMITIVES
from statecache.backends.reference import delta_net as ref_delta
from statecache.backends.reference import rows as ref_rows
from statecache.backends.reference import ssm_conv as ref_conv
from statecache.backends.reference import ssm_scan as ref_scan
from statecache.backends.reference.device import ReferenceDevice
from statecache.conformance import catalog, oracle
from statecache.conformance.cases import Case, ConformanceFailure
from statecache.dtypes import DType


def _cases(family: str, prefix: str) -> list[Case]:
    return [c for c in catalog.cases_of(family) if c.id.startswith(prefix)]


def _verdicts(cases: list[Case]) -> tuple[list[str], list[str]]:
    dev = ReferenceDevice()
    failed, passed = [], []
    for case in cases:
        ok, why = case.support(dev)
        assert ok, why
        try:
            with np.errstate(all="ignore"):
                case.run(dev)
        except ConformanceFailure:
            failed.append(case.id)
        else:
            passed.append(case.id)
    return failed, passed


@pytest.mark.parametrize("op", PRIMITIVES)
def test_every_primitive_has_oracle_cases(op):
    assert any(c.ops == (op,) for c in catalog.cases_of("oracle")), op


def test_the_reference_agrees_with_the_oracle():
    failed, passed = _verdicts(catalog.cases_of("oracle"))
    assert failed == []
    assert len(passed) > 50


def test_softplus_threshold_of_2_fails_the_kit_on_the_reference(monkeypatch):
    def softplus_threshold_2(z):
        return np.where(z > 2.0, z, np.log1p(np.exp(np.minimum(z, 2.0))))

    monkeypatch.setattr(ref_scan, "softplus", softplus_threshold_2)
    failed, passed = _verdicts(_cases("oracle", "oracle.ssm_scan["))
    assert len(passed) <= 1, passed  # a case may draw no dt in (2, 20) at all
    assert any("mamba1" in c for c in failed) and any("mamba2" in c for c in failed)
    # The reference compared with itself sees nothing: that is why the oracle exists.
    failed_primitive, _ = _verdicts(_cases("primitive", "ssm_scan[mamba2-d64"))
    assert failed_primitive == []


def _interleaved_qk(original):
    """The reference as if value head h read q/k head h // (H_v / H_k)
    (repeat-interleave) instead of h % H_k (tiling)."""

    def gated_delta_net(shp, pool, start, snap, cu, q, k, v, g, beta, o, A_log, dt_bias):
        # protocol 2: tokens are packed, so heads are axis 1 of q/k [T, H_k, S]
        heads = np.arange(shp.n_head_v) // (shp.n_head_v // shp.n_head_k)
        wide = dataclasses.replace(shp, n_head_k=shp.n_head_v)
        return original(wide, pool, start, snap, cu, q[:, heads], k[:, heads], v, g, beta, o, A_log, dt_bias)

    return gated_delta_net


def test_qk_heads_repeat_interleaved_fail_the_kit_on_the_reference(monkeypatch):
    monkeypatch.setattr(ref_delta, "gated_delta_net", _interleaved_qk(ref_delta.gated_delta_net))
    cases = _cases("oracle", "oracle.gated_delta_net[")
    failed, passed = _verdicts(cases)
    tiled = {c.id for c in cases if "-hv2-hk2-" not in c.id and "-hv4-hk4-" not in c.id}
    assert set(failed) == tiled, passed  # exactly the cases with H_v > H_k
    failed_primitive, _ = _verdicts(_cases("primitive", "gated_delta_net[scalar-S64-hv8-hk4"))
    assert failed_primitive == []


def test_groups_tiled_instead_of_interleaved_fail_the_kit(monkeypatch):
    """Mamba-2's B/C groups: head h uses group h // (H / G), not h % G."""
    original = ref_scan.ssm_scan

    def tiled_groups(shp, pool, start, snap, cu, x, dt, A, B, C, y, D, z, dt_bias):
        H, G = shp.n_head, shp.n_group
        heads = np.arange(H) % G
        wide = dataclasses.replace(shp, n_group=H)
        return original(wide, pool, start, snap, cu, x, dt, A, B[:, heads], C[:, heads], y, D, z, dt_bias)

    monkeypatch.setattr(ref_scan, "ssm_scan", tiled_groups)
    failed, _ = _verdicts(_cases("oracle", "oracle.ssm_scan[mamba2-d4-h3-n4-g2"))
    assert failed == ["oracle.ssm_scan[mamba2-d4-h3-n4-g2-t5-s2-K1-f32]"]


def test_conv_without_its_bias_fails_the_kit(monkeypatch):
    original = ref_conv.ssm_conv

    def no_bias(shp, pool, start, snap, cu, x, weight, bias, y, apply_silu):
        return original(shp, pool, start, snap, cu, x, weight, None, y, apply_silu)

    monkeypatch.setattr(ref_conv, "ssm_conv", no_bias)
    failed, passed = _verdicts(_cases("oracle", "oracle.ssm_conv["))
    assert failed and all("bias_silu" in c for c in failed)
    assert all("bias_silu" not in c for c in passed)


def test_bf16_rounding_by_truncation_fails_the_kit(monkeypatch):
    original = ref_rows._convert

    def truncating(rows, dtype):
        if dtype != DType.BF16.numpy:
            return original(rows, dtype)
        bits = rows.astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(dtype)

    monkeypatch.setattr(ref_rows, "_convert", truncating)
    failed, _ = _verdicts(_cases("oracle", "oracle.get_rows["))
    assert {c for c in failed if ">bf16" in c} == {
        c.id for c in _cases("oracle", "oracle.get_rows[") if ">bf16" in c.id
    }


# -- the oracle's conversions are IEEE's, independently of NumPy --------------------------


def test_oracle_conversions_agree_with_numpy_and_ml_dtypes():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    # plus the neighbourhoods of every boundary: ties, overflow, subnormals
    special = np.array([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 1 + 2.0**-11], dtype=np.float32)
    values = np.concatenate([bits.view(np.float32), special, -special])
    finite = values[~np.isnan(values)]
    with np.errstate(over="ignore"):
        want16 = finite.astype(np.float16).view(np.uint16)
        want_bf = finite.astype(DType.BF16.numpy).view(np.uint16)
    got16 = np.array([oracle.f16_bits(float(v)) for v in finite], dtype=np.uint16)
    got_bf = np.array([oracle.bf16_bits(float(v)) for v in finite], dtype=np.uint16)
    assert (got16 == want16).all(), finite[got16 != want16][:5]
    assert (got_bf == want_bf).all(), finite[got_bf != want_bf][:5]
    # decoding is exact
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    decoded = np.array(oracle.decode(halves.view(np.float16), DType.F16))
    ok = ~np.isnan(decoded)
    assert (decoded[ok] == halves.view(np.float16)[ok].astype(np.float64)).all()
    assert (np.isnan(decoded) == np.isnan(halves.view(np.float16))).all()
