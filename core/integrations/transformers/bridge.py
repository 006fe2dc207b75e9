"""Torch tensors and statecache buffers over the same memory, in one place.

Torch tensors are not yet first-class primitive arguments, so every tensor a
primitive reads or writes goes through this module:

* :meth:`Bridge.tensor` views a statecache :class:`~statecache.backend.Buffer`
  as a torch tensor without a copy (host devices: the NumPy storage; devices
  whose buffers speak DLPack, such as cuda: ``torch.from_dlpack``).
* :class:`Workspace` keeps the activation buffers of the dense math: one
  growing storage per role (``"zxbcdt"``, ``"conv_out"`` ...), handed out as a
  (Buffer, tensor) pair per shape.  Torch writes its results straight into
  the tensor (``matmul(..., out=)``, ``copy_``), the primitive reads the
  Buffer.  The same shape gets the *same* Buffer objects step after step, so
  the device's launch memo recognises a decode step's calls and skips their
  validation (a freshly wrapped tensor costs a full validation per call).
* :meth:`Bridge.upload` copies a parameter (conv weight, A) into a device
  buffer once, when a model is attached.

The direction is always "statecache allocates, torch views": that works on
every device whose memory torch can see, including those that cannot import
foreign memory (cuda today), and keeps the buffers the memo remembers alive
for as long as the workspace lives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from statecache.backend import Buffer, Device
from statecache.dtypes import DType
from statecache.hostmem import as_array

from .errors import IntegrationError, UnsupportedModelError

#: the versions the integration was mapped against (the ``transformers`` extra pins them)
TORCH_NEEDED = "2.13.0"
TRANSFORMERS_NEEDED = ">=5.23,<6 (mapped against 5.23.0)"

#: Views kept per role before the oldest shapes are forgotten: a serving loop
#: meets a few decode shapes again and again and many one-off prefill shapes.
_VIEWS_PER_ROLE = 48


def import_torch() -> Any:
    """torch, or the core's IntegrationError naming the extra that installs it."""
    try:
        import torch
    except ImportError:  # pragma: no cover - the extra pulls torch in
        raise IntegrationError("torch", extra="transformers", found=None, needed=TORCH_NEEDED) from None
    return torch


def check_transformers() -> str:
    """The installed transformers version; IntegrationError outside the mapped major version
    (module and attribute names of the covered families are release-specific)."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - a model object implies the package
        raise IntegrationError("transformers", extra="transformers", found=None, needed=TRANSFORMERS_NEEDED) from None
    version = str(transformers.__version__)
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        major, minor = (0, 0)
    if not (major == 5 and minor >= 23):
        raise IntegrationError("transformers", extra="transformers", found=version, needed=TRANSFORMERS_NEEDED)
    return version


class Bridge:
    """Zero-copy views between one statecache device and torch."""

    def __init__(self, device: Device) -> None:
        self.torch = torch = import_torch()
        self.device = device
        probe = device.alloc((1,), DType.F32)
        if device.caps.host_visible and isinstance(probe.storage, np.ndarray):
            self.mode = "host"
            self.torch_device = torch.device("cpu")
        elif hasattr(probe, "__dlpack__"):
            self.mode = "dlpack"
            self.torch_device = torch.from_dlpack(probe).device
        else:
            raise UnsupportedModelError(
                f"device {device.id}: torch cannot see its memory (not host-visible, no DLPack export); "
                "use the cpu, reference or cuda device"
            )

    def tensor(self, buf: Buffer) -> Any:
        """A torch tensor over ``buf``'s memory (no copy; writes go both ways)."""
        torch = self.torch
        if self.mode == "dlpack":
            return torch.from_dlpack(buf)
        arr = as_array(buf)
        if buf.dtype is DType.BF16:  # NumPy's bf16 is ml_dtypes', which torch does not import
            return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    def upload(self, t: Any, shape: Sequence[int] | None = None) -> Buffer:
        """A float32 device copy of a tensor (a parameter), reshaped to ``shape``."""
        host = t.detach().to(device="cpu", dtype=self.torch.float32).contiguous().numpy()
        if shape is not None:
            host = host.reshape(tuple(shape))
        return self.device.upload(host, DType.F32)


class _Role:
    __slots__ = ("capacity", "storage", "views")

    def __init__(self) -> None:
        self.storage: Buffer | None = None
        self.capacity = 0
        self.views: dict[tuple[Any, ...], tuple[Buffer, Any]] = {}


class Workspace:
    """Float32 activation buffers shared by torch and the primitives (see module doc).

    ``get(role, shape)`` returns a contiguous (Buffer, tensor) pair; ``sub``
    returns a cached strided view of one (the x / B / C parts of a conv
    output).  Roles never alias each other; a role's contents are only valid
    until the next ``get`` of the same role with another shape grows it.
    """

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        self._roles: dict[str, _Role] = {}

    def get(self, role: str, shape: Sequence[int]) -> tuple[Buffer, Any]:
        key = tuple(int(s) for s in shape)
        r = self._roles.get(role)
        if r is None:
            r = self._roles[role] = _Role()
        hit = r.views.get(key)
        if hit is not None:
            return hit
        n = math.prod(key)
        if r.storage is None or n > r.capacity:
            r.capacity = max(n, 2 * r.capacity, 1)
            r.storage = self.bridge.device.alloc((r.capacity,), DType.F32)
            r.views.clear()  # views of the old storage must not be handed out again
        if len(r.views) >= _VIEWS_PER_ROLE:
            r.views.pop(next(iter(r.views)))
        buf = r.storage.view(key)
        pair = (buf, self.bridge.tensor(buf))
        r.views[key] = pair
        return pair

    def sub(
        self, role: str, shape: Sequence[int], name: str, vshape: Sequence[int], vstrides: Sequence[int], offset: int
    ) -> Buffer:
        """A strided view (``vshape``/``vstrides``/``offset`` in elements) of ``get(role, shape)``'s Buffer."""
        base, _ = self.get(role, shape)
        r = self._roles[role]
        # the geometry is part of the key: two mixers may read the same role and shape differently
        key = (tuple(int(s) for s in shape), name, tuple(vshape), tuple(vstrides), int(offset))
        hit = r.views.get(key)
        if hit is not None:
            return hit[0]
        view = base.view(vshape, vstrides, offset)
        r.views[key] = (view, None)
        return view
