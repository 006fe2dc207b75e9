"""statecache.distributed across real processes: gloo on 127.0.0.1, bounded in time.

One pair of processes runs every two-rank scenario (workers.everything: starting
a process that imports torch costs more than any scenario), a second run of four
processes a disaggregated, tensor-parallel pair of instances.  The processes
return what they saw; the assertions are here.

The bound of the tensor-parallel comparison: a row-parallel output projection
sums each rank's partial product and then the ranks' sums, where one process
sums all terms in one pass.  Each such reduction of n <= 32 products differs by
at most 2 * gamma_(n-1) * sum|x_i w_i| (gamma_k = k u / (1 - k u), u = 2**-24);
through four layers and six batches, that stays far inside 32 units of f32
rounding of the logits' magnitude (32 * eps * max|logit|, eps = 2**-23), which
is what the test asserts (observed: about 3 eps * max|logit|).  A wrong shard
(a head with another rank's group, a channel out of place) moves the logits by
their whole magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import dist_launch as launch
import dist_workers as workers

from statecache.distributed.sections import parse_section
from statecache.distributed.transfer import BAD_CHECKSUM, BAD_HEADER, OK, REFUSED, TOO_LARGE
from statecache.state_io import unpack_sections

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def two_ranks():
    return launch.run(workers.everything, 2, timeout=60.0, expect_exit={0: 17})


def test_tensor_parallel_decode_equals_single_process_within_split_rounding(two_ranks):
    r0, r1 = (r["tp"] for r in two_ranks)
    for tp, single in zip(r0["tp"], r0["single"], strict=True):
        assert tp.keys() == single.keys() == {0, 1}
        for q in tp:
            bound = 32 * EPS32 * float(np.abs(single[q]).max())
            err = float(np.abs(tp[q] - single[q]).max())
            assert err <= bound, (q, err, bound)
    # the ranks all-reduce every layer's output, so they compute the same logits bit for bit
    for a, b in zip(r0["tp"], r1["tp"], strict=True):
        assert all(np.array_equal(a[q], b[q]) for q in a)


def test_ranks_books_agree_after_tensor_parallel_steps(two_ranks):
    b0, b1 = (r["tp"]["books"] for r in two_ranks)
    assert b0.keys() == b1.keys() and all(np.array_equal(b0[k], b1[k]) for k in b0)
    assert (b0["recurrent.pos"] >= 0).sum() == 2  # both sequences hold a cell: the books are not empty
    checks = [r["tp"]["checks"] for r in two_ranks]  # one per applied ubatch (the prompts take more than one)
    assert checks[0] == checks[1] > len(workers.STEPS)


def test_gathered_checkpoint_restores_the_unsharded_model(two_ranks):
    """gather_memory at t=2, state_read at t=1: the unsharded model continues like the
    single-process run (within the split rounding, which the gathered state carries)."""
    for restored, single in two_ranks[0]["tp"]["restored_vs_single"]:
        for q in single:
            assert np.abs(restored[q] - single[q]).max() <= 32 * EPS32 * np.abs(single[q]).max()


def test_scattered_checkpoint_continues_bitwise(two_ranks):
    """gather to one blob, scatter into fresh shard memories: they continue exactly like the originals."""
    for r in two_ranks:
        for fresh, original in r["tp"]["after_scatter"]:
            assert fresh.keys() == original.keys() == {0, 1}
            assert all(np.array_equal(fresh[q], original[q]) for q in fresh)


def test_book_check_names_the_diverged_rank_field_and_sequence(two_ranks):
    """Rank 1 dropped sequence 1 where rank 0 did not: every rank raises the same error."""
    for r in two_ranks:
        field, ranks, index, seqs, message = r["tp"]["divergence"]
        assert ranks == [1] and seqs == [1]
        assert field.startswith("attention.") and field.endswith(".pos")
        assert index is not None and "rank 1" in message and "sequence 1" in message
    assert two_ranks[0]["tp"]["divergence"] == two_ranks[1]["tp"]["divergence"]


def test_prefill_transfer_decode_is_bitwise_equal_to_decoding_on_the_sender(two_ranks):
    s, r = two_ranks[0]["transfer"], two_ranks[1]["transfer"]
    assert s["sent"] == r["got"] and s["sent"][2] == len(workers.PROMPT) - 1
    assert len(s["logits"]) == len(r["logits"]) == len(workers.DECODE)
    assert all(np.array_equal(a, b) for a, b in zip(s["logits"], r["logits"], strict=True))
    assert r["other_untouched"]  # the receiver's other sequence kept its state
    # that transfer sent every row block in the coalesced message (protocol 5); the same
    # sequence with every block in its own message decodes bit for bit the same
    assert s["coalesced"]
    assert all(np.array_equal(a, b) for a, b in zip(s["logits"], r["per_block_logits"], strict=True))


def test_transfer_to_another_backend_carries_the_same_rows_and_positions(two_ranks):
    """cpu -> reference: the rows arrive bit for bit; decoding agrees to the backends' rounding."""
    s, r = two_ranks[0]["transfer"], two_ranks[1]["transfer"]
    sent = [parse_section(t, p) for t, p in unpack_sections(s["blob"])[1]]
    got = [parse_section(t, p) for t, p in unpack_sections(r["ref_blob"])[1]]
    assert [x.tag for x in sent] == [x.tag for x in got]
    for a, b in zip(sent, got, strict=True):
        assert a.positions == b.positions and a.positions
        assert all(np.array_equal(x.rows, y.rows) and x.key == y.key for x, y in zip(a.blocks, b.blocks, strict=True))
    for a, b in zip(s["logits"], r["ref_logits"], strict=True):
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()


def test_a_transferred_sequence_rolls_back_like_the_sender(two_ranks):
    """The snapshot planes still valid travel with the rows: every rollback depth the sender
    accepts the receiver accepts, and decoding from there is bitwise the sender's."""
    sent, got = two_ranks[0]["transfer"]["rolled"], two_ranks[1]["transfer"]["rolled"]
    assert [ok for ok, _ in sent] == [ok for ok, _ in got] == [False] + [True] * workers.ROLLBACK
    for (_, a), (_, b) in zip(sent[1:], got[1:], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize(
    ("case", "code", "error", "words"),
    [
        ("bad_magic", [BAD_HEADER], "TransferError", "corrupt header"),
        ("bad_hash", [BAD_HEADER], "TransferError", "header hash"),
        ("too_large", [TOO_LARGE], "TransferError", "max_bytes"),
        ("bad_crc", [OK, BAD_CHECKSUM], "TransferError", "CRC-32"),
        ("bad_pos", [OK, REFUSED], "StateError", "position"),
    ],
)
def test_a_bad_transfer_leaves_the_receiver_unchanged(two_ranks, case, code, error, words):
    assert two_ranks[0]["transfer"][case] == code  # what the sender was answered
    got_error, message, unchanged = two_ranks[1]["transfer"][case]
    assert (got_error, unchanged) == (error, True), message
    assert words in message


def test_a_refused_layout_raises_on_both_sides_and_changes_nothing(two_ranks):
    assert "refused" in two_ranks[0]["transfer"]["refused"]
    error, message, unchanged = two_ranks[1]["transfer"]["refused"]
    assert (error, unchanged) == ("StateError", True) and "type" in message


def test_a_refused_eager_payload_is_drained_and_the_tag_carries_the_next_transfer(two_ranks):
    """Protocol 6 posts the rows right behind the header; the receiver that refuses the
    state drains them, so the next transfer on the same tag installs the sequence (the
    same positions and rows as the sender's)."""
    s, r = two_ranks[0]["transfer"], two_ranks[1]["transfer"]
    assert "refused" in s["refused"] and r["refused"][2]
    sent = [parse_section(t, p) for t, p in unpack_sections(s["blob_again"])[1]]
    got = [parse_section(t, p) for t, p in unpack_sections(r["blob_again"])[1]]
    assert [x.tag for x in sent] == [x.tag for x in got]
    for a, b in zip(sent, got, strict=True):
        assert a.positions == b.positions and a.positions
        assert all(np.array_equal(x.rows, y.rows) and x.key == y.key for x, y in zip(a.blocks, b.blocks, strict=True))


def test_an_eager_payload_refused_on_its_header_says_the_tag_is_spent(two_ranks):
    """Over max_bytes: refused before the receiver knows what to drain; it is unchanged,
    and both sides name the tag as out of step."""
    error, message, unchanged = two_ranks[1]["transfer"]["too_large_eager"]
    assert (error, unchanged) == ("TransferError", True)
    assert "max_bytes" in message and "fresh" in message
    assert "larger than the receiving memory" in two_ranks[0]["transfer"]["too_large_eager"]
    assert "fresh tag" in two_ranks[0]["transfer"]["too_large_eager"]


def test_a_sender_that_cannot_write_tells_the_receiver(two_ranks):
    assert two_ranks[0]["transfer"]["abort"] == "ArgumentError"
    error, message, unchanged = two_ranks[1]["transfer"]["abort"]
    assert (error, unchanged) == ("TransferError", True) and "could not write" in message


@pytest.mark.parametrize("case", ["timeout", "died"])
def test_a_stalled_or_dead_sender_times_out_and_changes_nothing(two_ranks, case):
    """``died``: rank 0 exits (code 17) while its payload is on the way."""
    error, message, unchanged = two_ranks[1]["transfer"][case]
    assert (error, unchanged) == ("TransferError", True)
    assert "receiving the payload" in message and "rank 0" in message


def test_metadata_whose_rows_never_come_changes_nothing(two_ranks):
    """The receiver validates the metadata while the rows travel; rows that never come
    end the wait for them before anything is written."""
    assert two_ranks[0]["transfer"]["lost_rows"] == [OK]
    error, message, unchanged = two_ranks[1]["transfer"]["lost_rows"]
    assert (error, unchanged) == ("TransferError", True), message
    assert "receiving the rows" in message and "rank 0" in message


@pytest.mark.slow
def test_disaggregated_tensor_parallel_instances():
    """Prefill at t=2 (ranks 0, 1) -> decode at t=2 (ranks 2, 3) with smaller memories:
    the decode instance's logits equal the prefill instance's continuing, bit for bit."""
    logits = launch.run(workers.disaggregated, 4, timeout=60.0)
    assert len(logits[0]) == len(workers.DECODE)
    for k in (1, 2, 3):
        assert all(np.array_equal(a, b) for a, b in zip(logits[0], logits[k], strict=True))
