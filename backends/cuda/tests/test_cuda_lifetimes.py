"""Host-side bookkeeping of the CUDA device that needs no GPU: what must stay
alive until the stream is past it, and when index validation must stop
trusting its host copy.  The device and its memory are stand-ins; the code
under test is the real CudaBuffer / CudaDevice methods (``emu`` is the
CudaDevice of conftest.py whose memory is host memory)."""

from __future__ import annotations

import numpy as np

from statecache.backends.cuda.device import CudaBuffer
from statecache.dtypes import DType


class _Storage:
    ptr = 0x10000


class _Device:
    """Just what CudaBuffer's exports ask of their device."""

    dlpack_device_type = 2
    index = 0

    def __init__(self) -> None:
        self.synchronized = 0

    def exchange_stream(self) -> int | None:
        return None

    def synchronize(self) -> None:
        self.synchronized += 1


def _index_buffer(device: object) -> CudaBuffer:
    buf = CudaBuffer(device, _Storage(), DType.I32, (4,))  # type: ignore[arg-type]
    buf.host_indices = np.arange(4, dtype=np.int32)
    return buf


def test_exported_index_buffer_drops_its_host_shadow() -> None:
    # The kernels read indices from device memory: once a consumer may write
    # them, validation (and the launch memo) must not trust the host copy.
    for export in (lambda b: b.__cuda_array_interface__, lambda b: b.__dlpack__()):
        buf = _index_buffer(_Device())
        export(buf)
        assert buf.host_indices is None


def test_export_withdraws_host_copies_of_its_own_storage_only() -> None:
    device = _Device()
    index = _index_buffer(device)
    values = CudaBuffer(device, _Storage(), DType.F32, (4,))  # type: ignore[arg-type]
    values.__cuda_array_interface__  # noqa: B018 - the property is the export
    assert values.host_indices is None
    assert index.host_indices is not None  # another storage: its copy still holds
    view = index.view((2,), (1,), 2)
    view.__dlpack__()  # a consumer may write the parent's elements through it
    assert index.host_indices is None


def test_strided_index_temporary_lives_until_synchronize(emu) -> None:
    parent = emu.indices([5, 6, 7, 8])
    strided = parent.view((2,), (2,))
    _ptr, tmp = emu._rows_ptr(strided, np.array([5, 7], dtype=np.int32))
    assert tmp is not strided and any(kept is tmp for kept in emu._pending_host)
    emu.synchronize()
    assert emu._pending_host == []


def test_contiguous_index_buffer_needs_no_temporary(emu) -> None:
    rows = emu.indices([1, 2])
    emu.synchronize()
    _ptr, keep = emu._rows_ptr(rows, rows.host_indices)
    assert keep is rows and emu._pending_host == []


def test_repeated_calls_conformance_case_through_prepared_launches(emu) -> None:
    """The conformance case for remembered calls, on the real CudaDevice
    marshalling: repeated calls go through prepared launches (argument structs
    built once) and must equal fresh calls."""
    from statecache.conformance.catalog import all_cases

    (case,) = [c for c in all_cases() if c.id == "device.repeated_calls[f32]"]
    case.run(emu)
    prepared = [e for e in emu._launches._entries.values() if e.launch is not None]
    assert prepared, "no call was remembered with a prepared launch"


def test_strided_index_calls_are_not_prepared(emu) -> None:
    pool = emu.upload(np.zeros((4, 3), np.float32))
    rows = emu.indices([0, 9, 2, 9]).view((2,), (2,))  # rows 0 and 2
    src = emu.upload(np.ones((2, 3), np.float32))
    assert emu._prepare_launch("set_rows", (pool, rows, src, np.array([0, 2], np.int32))) is None
    emu.set_rows(pool, rows, src)
    np.testing.assert_array_equal(emu.download(pool)[[0, 2]], 1.0)
    np.testing.assert_array_equal(emu.download(pool)[[1, 3]], 0.0)
