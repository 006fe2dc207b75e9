"""Non-finite log decays on every stateful primitive.

A NaN, +Inf or -Inf where a primitive takes the log of a decay (Mamba's
``dt``, which the decay exponentiates through softplus; the gated delta
rule's ``g``; RWKV's ``w``; GLA's ``g``), at one token in the middle of a
long sequence: the device puts NaN and Inf where the reference backend's
float64 ``exp`` does (``exp(NaN) = NaN``, ``exp(+Inf) = +Inf``,
``exp(-Inf) = 0``), element by element (:func:`assert_close`'s parity), and
stays within the usual tolerance elsewhere.  The sequence is long enough
that the C device's chunked prefill forms run chunks before the poisoned one
and hand the rest to their token loops; a second, finite sequence in the
same call must come out finite and as the reference computes it.
"""

from __future__ import annotations

import numpy as np

from statecache.backend import Buffer, Device
from statecache.conformance import linear_attn_cases as LA
from statecache.conformance import varlen_cases as V
from statecache.conformance.cases import NMSE, Case, compare_with_reference
from statecache.dtypes import DType

#: The input of each primitive that holds a log decay, per token.
DECAY_INPUT = {"ssm_scan": "dt", "gated_delta_net": "g", "rwkv_wkv6": "w", "rwkv_wkv7": "w", "gated_linear_attn": "g"}

#: Where the non-finite value goes: token 21 of the first sequence (its second
#: chunk of 16), head 1.
POISON_TOKEN, POISON_HEAD = 21, 1

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _ops() -> list[V.Op]:
    return [
        V.scan_op("mamba2", 16, 8, 4, 2),
        V.scan_op("mamba1", 16, 1, 24, 1),
        V.delta_op(False, 16, 4, 2),
        V.delta_op(True, 16, 2, 2),
        LA.rwkv6_op(16, 2),
        LA.rwkv7_op(16, 2),
        LA.gla_op(16, 2),
    ]


def nonfinite_decay_case(op: V.Op, value: str) -> Case:
    lengths = (40, 18)
    p = V.VarlenParams(op, lengths, 4, "planes", tag="nonfinite_decay")
    case_id = f"{op.op}.nonfinite_decay[{op.label}-{value}]"

    def run(device: Device) -> None:
        tensors, rows, _ = V.varlen_tensors(p, case.seed)
        decay = tensors[DECAY_INPUT[op.op]].data
        assert decay is not None
        decay[(POISON_TOKEN, POISON_HEAD) + (0,) * (decay.ndim - 2)] = VALUES[value]
        cu = np.concatenate([[0], np.cumsum(lengths)])

        def call(dev: Device, b: dict[str, Buffer]) -> None:
            op.call(dev, b["pool"], dev.indices(rows.start), dev.indices(rows.table), dev.indices(cu), b, b["out"])

        with np.errstate(all="ignore"):
            compare_with_reference(device, tensors, case.seed, call, {"pool": NMSE[DType.F32], "out": NMSE[DType.F32]})

    case = Case(case_id, "primitive", (op.op,), run, (p.requirement(),), p.caps)
    return case


def all_cases() -> list[Case]:
    return [nonfinite_decay_case(op, value) for op in _ops() for value in VALUES]
