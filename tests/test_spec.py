"""MemorySpec: per-family state sizes (spec §2.1) and memory_breakdown."""

from __future__ import annotations

import numpy as np
import pytest

import statecache
from statecache.errors import ArgumentError
from statecache.spec import MemorySpec, RecurrentLayerSpec, StateTensor, make_memory


def hybrid_qwen3_next_like() -> MemorySpec:
    # 48 layers, every 4th is attention: 36 GDN layers (n_embd 2048, 16 heads of 128, d_conv 4)
    gdn = RecurrentLayerSpec.gdn(n_head=16, head_dim=128, d_conv=4)
    return MemorySpec.build(48, {i: gdn for i in range(48) if i % 4 != 3})


def test_worked_example_breakdown() -> None:
    spec = hybrid_qwen3_next_like()
    assert len(spec.recurrent_layers) == 36
    expected = 4 * 36 * (128 * 128 * 16 + 3 * 3 * 2048) * 4
    assert spec.memory_breakdown(4) == {"device": expected}
    assert 150 < expected / 2**20 < 160  # "about 154 MiB"
    assert spec.memory_breakdown(4, n_rs_seq=3) == {"device": 4 * expected}


def test_breakdown_per_device_offload() -> None:
    spec = hybrid_qwen3_next_like()
    devices = ["cuda:0"] * 24 + ["cuda:1"] * 24
    split = spec.memory_breakdown(2, devices=devices)
    assert sum(split.values()) == spec.memory_breakdown(2)["device"]
    assert split["cuda:0"] == split["cuda:1"]
    with pytest.raises(ArgumentError):
        spec.memory_breakdown(2, devices=["x"])


@pytest.mark.parametrize(
    ("layer", "r", "s"),
    [
        (RecurrentLayerSpec.mamba1(d_inner=1536, d_state=16, d_conv=4), 3 * 1536, 16 * 1536),
        (
            RecurrentLayerSpec.mamba2(d_inner=4096, d_state=128, d_conv=4, n_group=8, head_dim=64),
            3 * (4096 + 2 * 8 * 128),
            128 * 4096,
        ),
        (
            RecurrentLayerSpec.gdn(n_head=32, head_dim=128, d_conv=4, n_head_k=16),
            3 * (2 * 16 + 32) * 128,
            128 * 128 * 32,
        ),
        (RecurrentLayerSpec.kda(n_head=32, head_dim=128, d_conv=4), 3 * 3 * 32 * 128, 128 * 128 * 32),
        (RecurrentLayerSpec.rwkv6(n_embd=2048, head_size=64), 2 * 2048, 2048 * 64),
        (RecurrentLayerSpec.rwkv7(n_embd=2560, head_size=64), 2 * 2560, 2560 * 64),
        (RecurrentLayerSpec.rwkv7(n_embd=2048, head_size=64, token_shift_count=1), 2048, 2048 * 64),
        (RecurrentLayerSpec.shortconv(n_embd=1024, l_cache=3), 1024 * 2, None),
    ],
)
def test_family_row_sizes(layer: RecurrentLayerSpec, r: int, s: int | None) -> None:
    sizes = layer.row_sizes
    assert sizes["r"] == r
    assert sizes.get("s") == s


def test_gla_holds_only_its_state_heads() -> None:
    gla = RecurrentLayerSpec.gla(n_head=16, head_dim=128)
    assert gla.row_sizes == {"s": 16 * 128 * 128}
    with pytest.raises(ArgumentError, match="head_size"):
        RecurrentLayerSpec.rwkv6(n_embd=100, head_size=64)


def test_rollback_planes_for_every_family_with_snapshots_else_refused() -> None:
    m1 = MemorySpec.build(2, {0: RecurrentLayerSpec.mamba1(d_inner=8, d_state=4, d_conv=4)})
    assert m1.effective_n_rs_seq(3) == 3  # Mamba-1 scans write snapshot planes
    for layer in (
        RecurrentLayerSpec.rwkv6(n_embd=8, head_size=4),
        RecurrentLayerSpec.rwkv7(n_embd=8, head_size=4),
        RecurrentLayerSpec.gla(n_head=2, head_dim=4),
    ):  # the linear-attention primitives and the token shift (through ssm_conv) write snapshot planes
        assert MemorySpec.build(1, {0: layer}).effective_n_rs_seq(2) == 2
    other = RecurrentLayerSpec("retnet", (StateTensor("s", 16),))  # a family without snapshot-writing kernels
    assert MemorySpec.build(1, {0: other}).effective_n_rs_seq(0) == 0
    with pytest.raises(ArgumentError, match="n_rs_seq: 2 rollback planes asked for, but the kernels of retnet"):
        MemorySpec.build(1, {0: other}).effective_n_rs_seq(2)
    m2 = MemorySpec.build(1, {0: RecurrentLayerSpec.mamba2(d_inner=8, d_state=4, d_conv=4, n_group=1, head_dim=4)})
    assert m2.effective_n_rs_seq(3) == 3
    with pytest.raises(ArgumentError):
        m2.effective_n_rs_seq(-1)
    with pytest.raises(ArgumentError):
        MemorySpec.build(2, {5: RecurrentLayerSpec.shortconv(n_embd=4, l_cache=3)})


def test_make_memory_allocates_what_the_spec_says() -> None:
    dev = statecache.get_device("reference")
    spec = MemorySpec.build(
        3,
        {
            0: RecurrentLayerSpec.gdn(n_head=2, head_dim=4, d_conv=4),
            2: RecurrentLayerSpec.mamba2(d_inner=8, d_state=4, d_conv=4, n_group=1, head_dim=4),
        },
    )
    mem = make_memory(spec, dev, n_seq_max=3, n_rs_seq=2)
    assert mem.memory_breakdown() == {dev.id: spec.memory_breakdown(3, 2)["device"]}
    assert spec.state_bytes(3, 2) == spec.memory_breakdown(3, 2)["device"]


def test_make_memory_sizes_a_hybrid_iswa_window_for_its_rollback_depth() -> None:
    """make_memory gives a hybrid-iSWA window cache room for the positions its
    recurrent part can roll back to (n_rs_seq), not only the window; a pure
    attention iSWA memory has no recurrent rollback and keeps the plain size."""
    from statecache.kv_cache import iswa_sizes
    from statecache.spec import AttentionLayerSpec, ModelSpec, RecurrentLayerSpec, make_memory

    dev = statecache.get_device("reference")
    attention = {1: AttentionLayerSpec(1, 4, swa=True), 2: AttentionLayerSpec(1, 4)}
    hybrid = ModelSpec.build(
        3, recurrent={0: RecurrentLayerSpec.shortconv(n_embd=4, l_cache=3)}, attention=attention,
        n_swa=4, kv_dtype="f32",
    )  # fmt: skip
    pure = ModelSpec.build(3, attention=attention, n_swa=4, kv_dtype="f32")
    for spec, depth in ((hybrid, 3), (pure, 0)):
        mem = make_memory(spec, dev, 2, 3, n_ctx=256, n_pad=1, n_ubatch=8)
        swa = mem.attn.swa if hasattr(mem, "attn") else mem.swa
        assert swa.rollback_depth == depth
        assert swa.size == iswa_sizes(512, 4, 2, 8, True, 1, False, depth)
    assert iswa_sizes(512, 4, 2, 8, True, 1, False, 3) > iswa_sizes(512, 4, 2, 8, True, 1, False, 0)


@pytest.mark.parametrize(
    ("build", "field", "says"),
    [
        (lambda: RecurrentLayerSpec.mamba2(d_inner=32, d_state=16, d_conv=1, n_group=1, head_dim=8), "d_conv", ">= 2"),
        (
            lambda: RecurrentLayerSpec.mamba2(d_inner=32, d_state=16, d_conv=4, n_group=0, head_dim=8),
            "n_group",
            "got 0",
        ),
        (
            lambda: RecurrentLayerSpec.mamba2(d_inner=32, d_state=16, d_conv=4, n_group=3, head_dim=8),
            "n_group",
            "n_head",
        ),
        (lambda: RecurrentLayerSpec.mamba2(d_inner=32, d_state=0, d_conv=4, n_group=1, head_dim=8), "d_state", "got 0"),
        (lambda: RecurrentLayerSpec.mamba1(d_inner=-4, d_state=16, d_conv=4), "d_inner", "got -4"),
        (lambda: RecurrentLayerSpec.gdn(n_head=4, head_dim=0, d_conv=4), "head_dim", "got 0"),
        (lambda: RecurrentLayerSpec.kda(n_head=4, head_dim=8, d_conv=0), "d_conv", "got 0"),
        (lambda: RecurrentLayerSpec.rwkv6(n_embd=0, head_size=8), "n_embd", "got 0"),
        (lambda: RecurrentLayerSpec.gla(n_head=0, head_dim=8), "n_head", "got 0"),
        (lambda: RecurrentLayerSpec.shortconv(n_embd=16, l_cache=1), "l_cache", ">= 2"),
    ],
)
def test_a_layer_no_kernel_can_run_is_refused_naming_the_hyperparameter(build, field: str, says: str) -> None:  # type: ignore[no-untyped-def]
    """A newcomer's inconsistent sizes fail at the spec, naming what to change, not as a
    row size they never passed or at the first step."""
    with pytest.raises(ArgumentError, match=says) as info:
        build()
    assert info.value.argument == field


def test_a_float64_upload_says_how_to_convert() -> None:
    dev = statecache.get_device("reference")
    with pytest.raises(ValueError, match=r"float64 .*astype\(np\.float32\).*upload\(array, 'f32'\)"):
        dev.upload(np.zeros(3))
    assert dev.upload(np.zeros(3), "f32").numpy().dtype == np.float32
