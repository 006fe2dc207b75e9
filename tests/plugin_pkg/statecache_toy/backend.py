"""The toy backends' devices."""

from __future__ import annotations

from statecache.backend import PROTOCOL_VERSION, Backend, Device
from statecache.backends.reference.device import ReferenceDevice


class ToyDevice(ReferenceDevice):
    def __init__(self, backend_name: str, broken: bool) -> None:
        super().__init__()
        self.id = f"{backend_name}:0"
        self.backend_name = backend_name
        self.name = "toy device" + (" (writes past its rows)" if broken else "")
        self.broken = broken

    def _set_rows(self, dst, rows_buf, src, rows_host):  # type: ignore[no-untyped-def]
        super()._set_rows(dst, rows_buf, src, rows_host)
        if self.broken:
            # The classic off-by-one: one element after the last addressed row.
            flat = dst.storage
            end = dst.offset + (int(rows_host.max()) + 1) * dst.shape[1]
            if end < flat.size:
                flat[end] = -flat[end] - 7  # sign flip: visible in every dtype


class ToyBackend(Backend):
    version = "0.0.1"
    description = "toy third-party backend (tests)"
    provided_by = "statecache-toy"
    protocol = PROTOCOL_VERSION

    def __init__(self, name: str, broken: bool) -> None:
        self.name = name
        self._devices: list[Device] = [ToyDevice(name, broken)]

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def devices(self) -> list[Device]:
        return self._devices


class NoDeviceBackend(Backend):
    name = "toy_nodev"
    version = "0.0.1"
    protocol = PROTOCOL_VERSION

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def devices(self) -> list[Device]:
        return []
