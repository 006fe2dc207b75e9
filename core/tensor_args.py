"""Tensors as primitive arguments: any DLPack object wherever a Buffer goes.

Every primitive (and every ``step.*`` call) first passes its buffer
arguments through :meth:`Device._tensors_in
<statecache.backend.Device._tensors_in>`, which leaves Buffers and None as
they are and turns any object speaking DLPack (``__dlpack__``,
``__dlpack_device__``: a torch tensor, a NumPy array, ...) into a Buffer:

* **float tensors** (f32, f16, bf16) become a Buffer over the tensor's own
  memory, without a copy, when the device can address that memory (host
  tensors on host devices, CUDA tensors on the cuda device:
  :meth:`Device._import_memory`).  A host tensor on a device that cannot
  address host memory (opencl) is copied in, every call, when the primitive
  only reads it, and refused when the primitive writes it.
* **index tensors** (int32 or int64) are copied into an int32 index buffer
  the device owns, with the host copy that validation checks.

What is remembered, and why it is safe
--------------------------------------
Exporting a tensor costs microseconds, and a newly wrapped buffer would be
validated again on every call (the launch memo, :mod:`statecache.launch_memo`,
remembers calls by buffer identity).  So wraps are remembered per device,
keyed by the tensor's *fingerprint* (:func:`statecache.dlpack.fingerprint`:
type, data address, shape, strides, element type, device), never by the
tensor object: a decode step's fresh ``nn.Linear`` outputs land at the
addresses the allocator handed out the step before, get the same
fingerprints, hence the same Buffer objects, and the launch memo recognises
the call.

* A float wrap never keeps the tensor's memory alive (so the allocator can
  hand the same block out again) and is used only while a tensor with that
  fingerprint is an argument of the current call, so its memory is alive and
  is exactly that tensor's (every caller of ``_tensors_in`` keeps the objects
  it was given referenced until it returns: the last reference to a
  temporary argument may be the callee's own parameter).  If the memory was freed and reused at the same
  address with the same geometry, the new tensor *is* that memory: kernels
  read a float input's contents at launch time, and nothing about a float
  input's contents was validated.
* An index tensor's *contents* were validated (range, duplicates), and a
  tensor at the same address may hold other values next call (rewritten in
  place, or freed and reallocated).  So every call compares the tensor's
  current values with the ones in the device copy, and a change rewrites the
  copy, which replaces its host shadow: the launch memo then validates the
  call again, as for any rewritten index buffer.  (Reading the values of a
  CUDA index tensor is a device-to-host copy per call: pass index Buffers,
  ``device.indices(...)``, in a decode loop.)
* A read-only export (a NumPy array that is not writeable) is refused where
  the primitive writes.
* Tensors that overlap in memory are compared by address range, not by
  object: an output over the same memory as an input is refused even when
  both were passed as separate tensors over one storage
  (:meth:`statecache.backend.Buffer.same_storage`).

Relaunching by geometry
-----------------------
Where the allocator hands out a new address every step (small CPU
tensors), remembering wraps by fingerprint does not help: every call would
wrap its tensors again (a Buffer, and its token view, per tensor), match the
validated call by geometry, and rebuild the backend's launch.
:class:`Relaunches` skips all of that.  Once a call has been matched by
geometry, it is remembered per primitive, scalars and state pool (the
*anchor*): its *geometry* (per argument: None, the Buffer validated there,
or the tensor's type, shape, strides, dtype and device), with a backend
launch that takes the tensors' addresses
(:meth:`Device._prepare_relaunch <statecache.backend.Device._prepare_relaunch>`).
A later call at that anchor compares its arguments with the anchor's
geometries, field by field (no key is built or hashed: reading a torch
tensor's five facts is most of what a relaunch costs), reads each tensor's
address (no DLPack export, no Buffer) and launches, after the checks the
geometry path makes:

* every position holds what it held when validated: the very Buffer (weak
  references), None, or a tensor of the same type and geometry; and every
  index Buffer still holds the host copy that was checked (a geometry
  validated again replaces the remembered one, with its new copies);
* the device's capabilities are the same object;
* every tensor address is aligned to its elements;
* no written argument overlaps another (tensor address ranges against each
  other and against the Buffers' ranges), as for any call matched by
  geometry;
* no type read directly has been found to disagree with its own DLPack
  export since (:data:`statecache.dlpack.DEMOTIONS`).

Where the device has compiled readers (``Device._exchange_reader``, the
cpu device's: :class:`statecache.dlpack.ExchangeReader`) and every tensor's
type publishes the DLPack C exchange API (torch 2.13 does), a remembered geometry
also gets a *plan* (:class:`statecache.dlpack.Plan`): the tensors' positions,
exact types and DLTensor geometries, then the alignment mask and overlap
pairs above.  One C call checks the Buffers and None positions (weak
references), reads every tensor through the producer's
``dltensor_from_py_object_no_sync`` (and torch's negative bit), compares and
checks, and checks the index Buffers by their storages' write counts, in a
tenth of the time torch's accessors take.  Where the backend also prepared
the launch as a block for that C call (the cpu device: the kernel's
arguments as words, and where each tensor's address goes), the same call
places the addresses and runs the kernel (``fused``): a relaunch is one call
from Python.  Otherwise the addresses come back and the backend's launch
runs.  A plan is made only when each tensor's C reading describes exactly
the memory its validated Buffer covers (address, shape, strides on axes
longer than one, dtype) and every index Buffer still holds the host copy
it was validated with; the capabilities stay in Python.

Index tensors and host tensors that are copied in never take this path
(their values or copies are refreshed per call); nor does a call that
passes one tensor object in two places.  The launch keeps no reference to a
tensor: its pointers are set from this call's addresses before every
launch.

Parameters that require grad are read through ``.detach()``
(:func:`statecache.dlpack.exportable` says why).  Nothing here imports
torch.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from statecache.dlpack import (
    DEMOTIONS,
    KDL_INT,
    READERS,
    ExchangeReader,
    Plan,
    TensorMemory,
    confirm_fingerprint,
    describe,
    export_fingerprint,
    exported_memory,
    fingerprint,
    geometry_reader,
    host_array,
    reader_for,
    torch_geometry,
)
from statecache.dtypes import DType
from statecache.errors import ArgumentError
from statecache.launch_memo import (
    STORAGE_WRITES,
    index_stamps,  # the memo's probe makes the same test
)

if TYPE_CHECKING:
    from statecache.backend import Buffer, Device

#: Wraps kept per device.  A decode loop meets a few fingerprints per layer
#: and step; prefill shapes come and go.  Past the limit the oldest half goes.
WRAP_LIMIT = 2048

_INT32 = np.iinfo(np.int32)


class _Wrap:
    """A remembered tensor: the Buffer a call gets, and how to refresh it."""

    __slots__ = ("buffer", "host", "kind", "last", "read_only", "wide", "words")

    BORROWED = 0  # a Buffer over the tensor's own memory
    COPIED = 1  # a device buffer the host tensor is copied into before each call
    INDEX = 2  # an int32 device copy of an integer tensor, refreshed when its values change

    def __init__(self, kind: int, buffer: Buffer, *, read_only: bool = False) -> None:
        self.kind = kind
        self.buffer = buffer
        self.read_only = read_only
        self.host: np.ndarray | None = None  # host view of the tensor (COPIED, host INDEX)
        self.words: Buffer | None = None  # device-memory INDEX: the tensor's memory as int32 words
        self.last: bytes | None = None  # INDEX: the values the device copy holds
        self.wide = False  # INDEX: the tensor holds int64


@functools.lru_cache(maxsize=256)
def argument_names(names: str) -> tuple[tuple[str, bool], ...]:
    """``"pool* rows x y*"`` -> ``(("pool", True), ("rows", False), ...)``:
    ``*`` marks an argument the primitive writes."""
    return tuple((n.rstrip("*"), n.endswith("*")) for n in names.split())


def _name(names: str, i: int) -> str:
    spec = argument_names(names)
    return spec[i][0] if i < len(spec) else f"argument {i}"


class TensorWraps:
    """One device's remembered wraps, by fingerprint."""

    __slots__ = ("_templates", "_wraps")

    def __init__(self) -> None:
        self._wraps: dict[Any, _Wrap] = {}
        # fingerprint without the address -> that tensor's export with address 0: a tensor of a
        # known type and geometry at a new address needs no export (several microseconds)
        self._templates: dict[Any, TensorMemory] = {}

    def __len__(self) -> int:
        return len(self._wraps)

    def clear(self) -> None:
        self._wraps.clear()

    def coerce(self, dev: Device, names: str, args: tuple[Any, ...], buffer_type: type) -> tuple[Any, ...]:
        """``args`` with every DLPack object replaced by a Buffer of ``dev``
        (``buffer_type``: the Buffer class, passed in by the module that defines it)."""
        wraps = self._wraps
        out = list(args)
        for i, obj in enumerate(args):
            if obj is None or isinstance(obj, buffer_type):
                continue
            # Inlined fingerprint and lookup: this loop runs for every tensor of every call.
            reader = READERS.get(type(obj))
            if reader is None:
                reader = reader_for(type(obj))
            try:
                fp = reader(obj) if reader is not export_fingerprint else reader(obj, dev._dlpack_stream())
            except Exception as exc:  # a producer that cannot export this tensor
                raise ArgumentError(_name(names, i), f"cannot be read through DLPack: {exc}") from None
            if fp is None:
                continue  # not a tensor: validation says what is wrong with it
            wrap = wraps.get(fp)
            if wrap is not None and wrap.kind == _Wrap.BORROWED and not wrap.read_only:
                out[i] = wrap.buffer
            else:
                out[i] = self._buffer_for(dev, obj, fp, wrap, names, i)
        return tuple(out)

    def _buffer_for(self, dev: Device, obj: Any, fp: Any, wrap: _Wrap | None, names: str, i: int) -> Buffer:
        name, written = argument_names(names)[i]
        if wrap is None:
            wrap = self._new(dev, obj, fp, name)
        kind = wrap.kind
        if kind == _Wrap.BORROWED:
            if written and wrap.read_only:
                raise ArgumentError(name, "is a read-only tensor, and this primitive writes it")
            return wrap.buffer
        if kind == _Wrap.INDEX:
            _refresh_index(dev, wrap, name)
            return wrap.buffer
        if written:
            raise ArgumentError(
                name,
                f"is a host tensor, which {dev.id} cannot write in place: pass one of its Buffers "
                "(device.alloc) and read the result with device.download",
            )
        dev.write(wrap.buffer, wrap.host)  # copied in: its contents may have changed since the last call
        return wrap.buffer

    def _new(self, dev: Device, obj: Any, fp: Any, name: str) -> _Wrap:
        exported = exported_memory(fp)
        shape_key = None if exported is not None else (fp[0], *fp[2:])
        template = None if shape_key is None else self._templates.get(shape_key)
        if exported is not None:
            memory = exported
        elif template is not None:
            memory = TensorMemory(fp[1], *template[1:])  # (not _replace: several times slower)
        else:
            try:
                memory = describe(obj, stream=dev._dlpack_stream())
            except Exception as exc:
                raise ArgumentError(name, f"cannot be read through DLPack: {exc}") from None
            if not confirm_fingerprint(obj, fp, memory):
                fp = fingerprint(obj)  # this type is exported on every call from now on
            elif shape_key is not None:
                if len(self._templates) >= WRAP_LIMIT:
                    self._templates.clear()
                self._templates[shape_key] = memory._replace(address=0)
        if memory.is_integer:
            wrap = _index_wrap(dev, memory, name)
        else:
            wrap = _float_wrap(dev, memory, name)
        wraps = self._wraps
        if len(wraps) >= WRAP_LIMIT:
            for key in list(wraps)[: WRAP_LIMIT // 2]:
                del wraps[key]
        wraps[fp] = wrap
        return wrap


def _float_wrap(dev: Device, memory: TensorMemory, name: str) -> _Wrap:
    dtype = memory.dtype
    if dtype is None or dtype is DType.I32:
        # This wrap does not know whether the argument is data or an index
        # (an integer tensor would have gone to _index_wrap), so name both.
        raise ArgumentError(
            name,
            f"dtype {memory.type_name()} must be float32, float16 or bfloat16 (data) or int32/int64 (row indices)",
        )
    if any(s < 0 for s in memory.strides):
        raise ArgumentError(name, f"has negative strides {memory.strides}: pass a copy (.contiguous())")
    if memory.address % memory.itemsize:
        raise ArgumentError(name, f"is not aligned to its {memory.itemsize}-byte elements: pass a copy")
    buf = dev._import_memory(memory, dtype)
    if buf is not None:
        buf._geometry = (type(buf), buf.dtype, buf.shape, buf.strides, buf.offset, buf.capacity)
        return _Wrap(_Wrap.BORROWED, buf, read_only=memory.read_only)
    if not memory.on_host:
        raise ArgumentError(
            name,
            f"lives on DLPack device {(memory.device_type, memory.device_id)}, which {dev.id} cannot address; "
            "pass a tensor in host memory or one of the device's Buffers",
        )
    wrap = _Wrap(_Wrap.COPIED, dev.alloc(memory.shape, dtype))
    wrap.host = host_array(memory)
    return wrap


def _index_wrap(dev: Device, memory: TensorMemory, name: str) -> _Wrap:
    if memory.code != KDL_INT or memory.bits not in (32, 64):
        raise ArgumentError(name, f"dtype {memory.type_name()} is not an index type: use int32 or int64")
    wrap = _Wrap(_Wrap.INDEX, dev.alloc(memory.shape, DType.I32))
    wrap.wide = memory.bits == 64
    if memory.on_host:
        wrap.host = host_array(memory)
        return wrap
    # Device memory: read through the device as int32 words (an int64 is two,
    # low word first on every little-endian device statecache runs on).
    if wrap.wide:
        words = memory._replace(
            code=KDL_INT, bits=32, shape=(*memory.shape, 2), strides=(*(2 * s for s in memory.strides), 1)
        )
    else:
        words = memory
    wrap.words = dev._import_memory(words, DType.I32)
    if wrap.words is None:
        raise ArgumentError(
            name,
            f"lives on DLPack device {(memory.device_type, memory.device_id)}, which {dev.id} cannot read; "
            "pass a host tensor or an index Buffer (device.indices)",
        )
    return wrap


def _refresh_index(dev: Device, wrap: _Wrap, name: str) -> None:
    """Make the device copy hold the tensor's current values (validated again
    by the primitive when they changed)."""
    if wrap.host is not None:
        values = wrap.host
    else:
        assert wrap.words is not None
        words = dev.download(wrap.words)  # synchronizes: the values the producer wrote are there
        values = np.ascontiguousarray(words).view(np.int64).reshape(wrap.buffer.shape) if wrap.wide else words
    raw = values.tobytes()
    if raw == wrap.last:
        return
    if values.dtype != np.int32 and values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
        bad = values[(values < _INT32.min) | (values > _INT32.max)].flat[0]
        raise ArgumentError(name, f"index {int(bad)} does not fit in int32")
    wrap.last = None  # a failed write must not leave the old values marked current
    dev.write(wrap.buffer, values)
    wrap.last = raw


#: Relaunches kept per device (a model has a few call geometries per layer kind).
RELAUNCH_LIMIT = 1024
#: Geometries kept per primitive, scalars and state pool (decode, a few prefill
#: lengths, a few row sets): a call compares its arguments with each, newest first.
GEOMETRIES_PER_POOL = 8


def _absent() -> None:
    """The expected object at a position that was None (see ``_Relaunch.fixed``)."""
    return None


class _Relaunch:
    """One call geometry remembered for relaunching: what to check, and the launch."""

    __slots__ = ("align", "c_fixed", "c_shadows", "caps", "direct", "fixed", "fused", "native_pairs", "plan", "run",
                 "shadows", "signature", "tensor_pairs", "tensors")  # fmt: skip

    def __init__(
        self,
        caps: object,
        signature: tuple[Any, ...],
        fixed: tuple[tuple[int, Callable[[], Any]], ...],
        tensors: tuple[tuple[Any, ...], ...],
        direct: bool,
        shadows: tuple[tuple[int, Any], ...],
        align: int,
        tensor_pairs: tuple[tuple[int, int, int, int], ...],
        native_pairs: tuple[tuple[int, int, int], ...],
        run: Callable[[list[int]], bool],
    ) -> None:
        self.caps = caps
        self.signature = signature  # per position: None, id(Buffer) or the tensor's geometry (for learn())
        # Every position that is not a tensor: (position, callable returning the object expected
        # there): a weak reference to the Buffer validated there, or _absent for None.
        self.fixed = fixed
        # The tensors, in argument order: direct (torch-like, read inline by relaunched()):
        # (position, type, shape, strides, dtype, device); else (position, type, split reader,
        # geometry) as statecache.dlpack.geometry_reader reads them.
        self.tensors = tensors
        self.direct = direct
        self.shadows = shadows  # (position, host copy that index Buffer held when validated)
        # The largest element size less one: an address with any of these bits set may be
        # misaligned (checked on all addresses at once: a false alarm only costs the ordinary path).
        self.align = align
        # Overlap checks, as Device._remembered_by_geometry makes them, in the form relaunched()
        # checks fastest: tensors k and m (extents n_k, n_m bytes) overlap iff
        # -n_k < address_k - address_m < n_m: (k, m, -n_k, n_m); tensor k and a Buffer's bytes
        # [lo, hi) iff lo - n_k < address_k < hi: (k, lo - n_k, hi).
        self.tensor_pairs = tensor_pairs
        self.native_pairs = native_pairs
        self.run = run  # the backend's launch, given the tensors' addresses in argument order (False: busy)
        # The tensors read in C instead (statecache.dlpack.Plan), where the device has a reader
        # and every tensor's type publishes the DLPack C exchange API; None: read as above.
        self.plan: Plan | None = None
        # fixed flattened for the plan's match (position, None or the weak reference, ...), and the
        # index shadows as their storages' write counts (STORAGE_WRITES, id(storage), count, ...;
        # see _index_stamps): checked in the same C call
        self.c_fixed = tuple(x for pos, expected in fixed for x in (pos, None if expected is _absent else expected))
        self.c_shadows: tuple[Any, ...] = ()
        # The launch as a block the plan's launch runs (match, addresses placed and the kernel, in
        # one C call: run's ``block``, with run's ``threads`` giving its thread count), as
        # relaunched() calls it: (launch, words, c_fixed, c_shadows, block, threads, caps, run),
        # read in one go.  run owns the block and the structs its words point into: the tuple
        # held while the kernel runs keeps them alive should another thread drop this entry
        # meanwhile (the kernel runs without the GIL).  None: the plan's match, then run.
        self.fused: tuple[Any, ...] | None = None


def _read_by_readers(tensors: tuple[tuple[Any, ...], ...], given: tuple[Any, ...], addresses: list[int]) -> bool:
    """Whether every tensor of ``given`` at the positions of ``tensors`` (not
    direct: see ``_Relaunch.tensors``) has the geometry remembered; their
    addresses are appended to ``addresses``."""
    for pos, cls, reader, geometry in tensors:
        obj = given[pos]
        if type(obj) is not cls:
            return False
        now, address = reader(obj)
        if now != geometry:
            return False
        addresses.append(address)
    return True


def _index_stamps(index_bufs: Sequence[Any], shadows: Sequence[Any]) -> tuple[Any, ...] | None:
    """The index checks of a plan's match: ``(STORAGE_WRITES, id(storage),
    count, ...)`` of each index Buffer, taken now, when each still holds the
    host copy it was validated with (``shadows``); None otherwise.  The same
    test as comparing the host copies later (a copy is replaced only through
    ``Buffer.host_indices``' setter, which counts a write of its storage; the
    launch memo's probe relies on it too), without reading the Buffers."""
    if any(buf.host_indices is not shadow for buf, shadow in zip(index_bufs, shadows)):
        return None
    stamps = index_stamps(index_bufs)
    if stamps is None:
        return None
    if not stamps:
        return ()
    return (STORAGE_WRITES, *(w for stamp in dict.fromkeys(stamps) for w in stamp))


class Relaunches:
    """One device's calls remembered by geometry, relaunched with new tensor
    addresses (see "Relaunching by geometry" above).

    Remembered per *anchor*: the primitive and its scalars (``site``) and the
    identity of the first argument, the state pool (a call whose pool is not
    a Buffer is never relaunched).  A call compares each of its arguments
    with the anchor's geometries directly, without building a key: reading a
    torch tensor's shape, strides, dtype, device and address is most of what
    a relaunch costs, and hashing what was read would cost as much again."""

    __slots__ = ("_chains", "_count", "_demotions")

    def __init__(self) -> None:
        self._chains: dict[tuple[Any, int], list[_Relaunch]] = {}
        self._count = 0
        self._demotions = DEMOTIONS[0]

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        self._chains.clear()
        self._count = 0

    def relaunched(self, dev: Device, site: tuple[Any, ...], given: tuple[Any, ...], buffer_type: type) -> bool:
        """Launch the call if its geometry was remembered and every check
        passes (True); False: nothing was done, take the ordinary path."""
        if self._demotions != DEMOTIONS[0]:  # a type read directly was found lying: read nothing directly
            self.clear()
            self._demotions = DEMOTIONS[0]
            return False
        try:
            chain = self._chains.get((site, id(given[0])))
        except TypeError:  # an unhashable scalar: the ordinary path says what is wrong with it
            return False
        if chain is None:
            return False
        for entry in chain:
            fused = entry.fused
            if fused is not None:
                # The plan's match below, then the addresses placed and the kernel run, in one C call
                launch, words, fixed, shadows, block, threads, caps, _ = fused  # (fused holds run: see _Relaunch)
                if caps is not dev.caps:
                    return False
                done = launch(given, words, fixed, shadows, block, threads())
                if done is None:
                    continue  # another geometry
                return done  # type: ignore[no-any-return]  # (False: misaligned, overlapping, or running in another thread)
            plan = entry.plan
            if plan is not None:
                # The fixed positions and every tensor read and compared, and the alignment,
                # overlap and index shadow checks below made, in one C call (DLPack C exchange API)
                found = plan.match(given, plan.words, entry.c_fixed, entry.c_shadows)
                if found is None:
                    continue  # another geometry
                if found is False or entry.caps is not dev.caps:
                    return False  # (misaligned or overlapping: the ordinary path refuses it by name)
                return entry.run(found)
            for pos, expected in entry.fixed:  # the very Buffers validated, None where None was
                if expected() is not given[pos]:
                    break
            else:
                addresses = []
                try:
                    if entry.direct:
                        # dlpack.torch_geometry, inlined and compared field by field: this runs
                        # for every tensor of every call
                        for pos, cls, shape, strides, dtype, device, _ in entry.tensors:
                            obj = given[pos]
                            if (
                                type(obj) is not cls
                                or obj.shape != shape
                                or obj.stride() != strides
                                or obj.dtype is not dtype
                                or obj.device != device
                                or obj.is_neg()  # (validated tensors never are: see dlpack.torch_like)
                            ):
                                break
                            addresses.append(obj.data_ptr())
                        else:
                            break  # this entry
                    elif _read_by_readers(entry.tensors, given, addresses):
                        break
                except Exception:  # a producer that cannot say where it is: the ordinary path says
                    return False
        else:
            return False
        if entry.caps is not dev.caps:
            return False
        bits = 0
        for address in addresses:
            bits |= address
        if bits & entry.align:
            return False  # (misaligned: the ordinary path refuses it by name)
        for pos, shadow in entry.shadows:
            if given[pos].host_indices is not shadow:
                return False
        # Overlaps, pair by pair (each pair is one subtraction and one chained comparison)
        for k, m, lo, hi in entry.tensor_pairs:
            if lo < addresses[k] - addresses[m] < hi:
                return False  # the ordinary path refuses it by name
        for k, lo, hi in entry.native_pairs:
            if lo < addresses[k] < hi:
                return False
        return entry.run(addresses)

    def learn(
        self,
        dev: Device,
        op: str,
        site: tuple[Any, ...],
        names: str,
        given: tuple[Any, ...],
        coerced: Sequence[Any],
        index_bufs: Sequence[Any],
        shadows: Sequence[Any],
        call_args: tuple[Any, ...],
        buffer_type: type,
    ) -> None:
        """Remember a call just matched by geometry (``coerced``: its arguments
        as Buffers, in the order of ``given``; ``shadows``: the index copies
        it was validated with), if the backend can relaunch it.  A geometry
        already remembered is replaced (its index shadows may be stale)."""
        if not given or not isinstance(given[0], buffer_type):
            return  # no state pool Buffer to anchor on
        anchor = (site, id(given[0]))
        try:
            hash(anchor)
        except TypeError:
            return
        signature: list[Any] = []
        fixed: list[tuple[int, Callable[[], Any]]] = []
        slots: list[tuple[Any, ...]] = []
        direct = True
        tensors: list[int] = []  # positions of the tensors, in argument order
        for pos, (obj, buf) in enumerate(zip(given, coerced)):
            if obj is None:
                fixed.append((pos, _absent))
                signature.append(None)
                continue
            if isinstance(obj, buffer_type):
                fixed.append((pos, weakref.ref(obj)))
                signature.append(id(obj))
                continue
            if buf is None or buf._geometry is None:
                return  # an index tensor or a copied one: refreshed per call, never relaunched
            reader = geometry_reader(type(obj))
            if reader is None:
                return  # exported on every call: no direct reading to compare
            geometry, _ = reader(obj)
            signature.append(geometry)
            slots.append((pos, type(obj), reader, geometry))
            direct = direct and reader is torch_geometry
            tensors.append(pos)
        if not tensors:
            return  # nothing a relaunch would refresh (and no itemsize to take the max of)
        if len({id(coerced[p]) for p in tensors}) != len(tensors):
            return  # one tensor in two places: the backend could not tell which pointer is which
        shadow_at: list[tuple[int, Any]] = []
        for buf, shadow in zip(index_bufs, shadows):
            at = next((p for p, obj in enumerate(given) if obj is buf), None)
            if at is None:
                return
            if all(p != at for p, _ in shadow_at):
                shadow_at.append((at, shadow))
        ranges = {pos: coerced[pos].byte_range() for pos in range(len(given)) if coerced[pos] is not None}
        if any(r is None for r in ranges.values()):
            return  # a Buffer that does not say where it is: overlaps could not be checked
        order = {pos: k for k, pos in enumerate(tensors)}
        extent = {pos: ranges[pos][1] - ranges[pos][0] for pos in tensors}
        tensor_pairs: set[tuple[int, int, int, int]] = set()
        native_pairs: set[tuple[int, int, int]] = set()
        for w, (_, written) in enumerate(argument_names(names)):
            if not written or coerced[w] is None:
                continue
            for j in ranges:
                if j == w or (w not in order and j not in order):
                    continue
                if w in order and j in order:
                    k, m = sorted((order[w], order[j]))
                    tensor_pairs.add((k, m, -extent[tensors[k]], extent[tensors[m]]))
                else:
                    t, native = (w, j) if w in order else (j, w)
                    lo, hi = ranges[native]
                    native_pairs.add((order[t], lo - extent[t], hi))
        templates = {id(coerced[pos].storage): k for k, pos in enumerate(tensors)}
        run = dev._prepare_relaunch(op, call_args, templates)
        if run is None:
            return
        if direct:  # torch_geometry's (type, shape, strides, dtype, device, is_neg), by position
            slots = [(pos, *geometry) for pos, _, _, geometry in slots]
        entry = _Relaunch(
            dev.caps,
            tuple(signature),
            tuple(fixed),
            tuple(slots),
            direct,
            tuple(shadow_at),
            max(coerced[pos].dtype.itemsize for pos in tensors) - 1,
            tuple(sorted(tensor_pairs)),
            tuple(sorted(native_pairs)),
            run,
        )
        in_c: ExchangeReader | None = getattr(dev, "_exchange_reader", None)
        stamps = _index_stamps(index_bufs, shadows) if in_c is not None and direct else None
        if in_c is not None and stamps is not None:
            entry.c_shadows = stamps
            entry.plan = in_c.plan(
                given, tensors, [coerced[pos] for pos in tensors], entry.align, entry.tensor_pairs, entry.native_pairs
            )
            plan, block, threads = entry.plan, getattr(run, "block", 0), getattr(run, "threads", None)
            if plan is not None and plan.launch is not None and block and callable(threads):
                entry.fused = (plan.launch, plan.words, entry.c_fixed, entry.c_shadows, block, threads, entry.caps, run)
        chain = self._chains.get(anchor)
        if chain is None:
            if self._count >= RELAUNCH_LIMIT:
                self.clear()
            chain = self._chains[anchor] = []
        else:
            kept = [old for old in chain if old.signature != entry.signature][: GEOMETRIES_PER_POOL - 1]
            self._count -= len(chain) - len(kept)
            chain[:] = kept
        chain.insert(0, entry)
        self._count += 1
