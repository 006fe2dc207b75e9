"""torch.distributed, imported when first used, and the few moves built on it.

The core imports no torch (DESIGN.md); everything here imports it inside the
function that needs it, so ``import statecache.distributed`` works without
torch and only a call that communicates needs it.

Tensors travel on the device the group's backend moves: host tensors for
gloo, CUDA tensors for NCCL (``torch.cuda.current_device()``, which a runtime
sets per rank as NCCL requires).  Byte strings become ``uint8`` tensors
without a copy on the host.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from statecache.distributed.errors import TransferError


def torch_dist() -> tuple[Any, Any]:
    """``(torch, torch.distributed)``; a clear error when torch or its distributed
    package is missing (install the ``torch`` extra)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - the torch extra is installed where this is tested
        raise ImportError("statecache.distributed needs torch: pip install 'statecache[torch]'") from exc
    if not dist.is_available():  # pragma: no cover
        raise ImportError("this torch build has no torch.distributed")
    return torch, dist


def group_device(group: Any = None) -> Any:
    """Where tensors of ``group`` live: ``cuda:<current>`` for NCCL, else the host."""
    torch, dist = torch_dist()
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_rank(group: Any = None) -> tuple[int, int]:
    """``(rank in group, group size)``."""
    _, dist = torch_dist()
    return int(dist.get_rank(group)), int(dist.get_world_size(group))


def global_rank(group: Any, rank: int) -> int:
    """The global rank of group rank ``rank`` (torch's collectives take global ranks)."""
    _, dist = torch_dist()
    if group is None or group is dist.group.WORLD:
        return int(rank)
    return int(dist.get_global_rank(group, rank))


def on_host(device: Any) -> bool:
    """Whether tensors on ``device`` are host memory (gloo) rather than a GPU's (NCCL):
    the one place the transfer decides between sharing a host buffer and copying."""
    return bool(device.type == "cpu")


def as_tensor(data: bytes | bytearray | memoryview | np.ndarray, device: Any) -> Any:
    """A ``uint8`` tensor over ``data`` (no copy on the host; one copy to a GPU)."""
    torch, _ = torch_dist()
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).ravel()
    if arr.flags.writeable:  # (a pool's rows, a gathered block: no warning to silence, whose filter costs more)
        t = torch.from_numpy(arr)
    else:
        with warnings.catch_warnings():
            # torch warns that a read-only buffer is not writable; sends only read it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    return t if on_host(device) else t.to(device, copy=True)


def host_view(t: Any) -> memoryview:
    """The bytes of a received ``uint8`` tensor as a memoryview (no copy on the host)."""
    return memoryview(t.cpu().numpy()).cast("B")


def post(start: Callable[[], Any], peer: int, what: str) -> Any:
    """Start one send/recv (``start()`` returns its work); a closed pair or group
    raises :class:`TransferError` naming the peer."""
    try:
        return start()
    except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError / DistError
        raise TransferError(peer, f"{what}: the connection to rank {peer} is gone ({exc})") from exc


def wait(work: Any, timeout: float, peer: int, what: str) -> None:
    """Wait for one send/recv to finish within ``timeout`` seconds; a dead peer, a
    timeout or a closed group becomes :class:`TransferError` naming the peer."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise TransferError(peer, f"{what}: rank {peer} did not complete it within {timeout:g} s ({exc})") from exc


def gather_bytes(data: bytes, dst: int, group: Any = None) -> list[bytes] | None:
    """Every rank's ``data`` on group rank ``dst`` (in rank order), None elsewhere."""
    torch, dist = torch_dist()
    dev = group_device(group)
    rank, world = group_rank(group)
    sizes = _all_sizes(len(data), group)
    pad = max(sizes)
    mine = torch.zeros(pad, dtype=torch.uint8, device=dev)
    mine[: len(data)] = as_tensor(data, dev)
    bufs = [torch.empty(pad, dtype=torch.uint8, device=dev) for _ in range(world)] if rank == dst else None
    dist.gather(mine, bufs, dst=global_rank(group, dst), group=group)
    if bufs is None:
        return None
    return [bytes(host_view(b)[:n]) for b, n in zip(bufs, sizes, strict=True)]


def scatter_bytes(parts: Sequence[bytes] | None, src: int, group: Any = None) -> bytes:
    """Group rank ``src`` hands ``parts[r]`` to rank ``r``; returns this rank's part."""
    torch, dist = torch_dist()
    dev = group_device(group)
    rank, world = group_rank(group)
    sizes = torch.zeros(world, dtype=torch.int64, device=dev)
    if rank == src:
        assert parts is not None and len(parts) == world
        sizes[:] = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    dist.broadcast(sizes, src=global_rank(group, src), group=group)
    n = [int(x) for x in sizes.tolist()]
    pad = max(n)
    out = torch.empty(pad, dtype=torch.uint8, device=dev)
    bufs = None
    if rank == src:
        assert parts is not None
        bufs = []
        for p in parts:
            b = torch.zeros(pad, dtype=torch.uint8, device=dev)
            b[: len(p)] = as_tensor(p, dev)
            bufs.append(b)
    dist.scatter(out, bufs, src=global_rank(group, src), group=group)
    return bytes(host_view(out)[: n[rank]])


def _all_sizes(n: int, group: Any) -> list[int]:
    torch, dist = torch_dist()
    dev = group_device(group)
    _, world = group_rank(group)
    mine = torch.tensor([n], dtype=torch.int64, device=dev)
    every = [torch.empty(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [int(t.item()) for t in every]


def all_agree(ok: bool, group: Any = None) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    torch, dist = torch_dist()
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())
