"""The state format's error reports and field codecs, pinned exactly (mutants
of ``state_io`` that survived the other tests: errors that named the wrong
field or said the wrong number, signed/unsigned codecs, boundaries of the
truncation checks, a reader aliasing its caller's buffer).

Errors must name what was wrong (``StateError.field``) and say by how much,
so that a caller can act without reading our source.
"""

from __future__ import annotations

import struct
import zlib

import pytest

from statecache.errors import StateError
from statecache.state_io import FORMAT_VERSION, MAGIC, Reader, Writer, find_section, pack_sections, unpack_sections

HEADER = 12  # magic, u16 version, u16 flags, u32 count
SECTION = 16  # tag, u64 length, u32 crc32 of the payload (format version 2)


def header(count: int, version: int = FORMAT_VERSION, magic: bytes = MAGIC, flags: int = 0) -> bytes:
    return struct.pack("<4sHHI", magic, version, flags, count)


def section(tag: bytes, payload: bytes, length: int | None = None) -> bytes:
    """A version-2 section header and its payload (``length`` overrides the stored length)."""
    n = len(payload) if length is None else length
    return struct.pack("<4sQI", tag, n, zlib.crc32(payload)) + payload


def refused(data, field: str, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StateError) as err:
        unpack_sections(data)
    assert err.value.field == field
    assert message in str(err.value), str(err.value)


def test_unpack_sections_names_every_fault():
    refused(object(), "blob", "expected bytes, got object")
    refused(b"SCST\x01\x00", "magic", "truncated: blob has 6 bytes, the header needs 12")
    refused(header(0, magic=b"ABCD"), "magic", "is b'ABCD', expected b'SCST'")
    newer = FORMAT_VERSION + 1
    refused(header(0, version=newer), "version", f"is {newer}, this library reads versions 1, 2")
    refused(header(0, version=0), "version", "is 0, this library reads versions 1, 2")
    refused(header(0, flags=8), "flags", "is 0x8: bits 0x8 are not StateFlags")
    refused(header(0, flags=13), "flags", "is 0xd: bits 0x8 are not StateFlags")
    refused(header(1) + b"KVA", "section[0].tag", "truncated: section header missing")
    refused(header(1) + b"KVAT" + struct.pack("<Q", 0), "section[0].tag", "truncated: section header missing")  # no crc
    refused(header(2) + section(b"KVAT", b""), "section[1].tag", "truncated: section header missing")
    refused(header(1) + section(b"KVAT", b"12345", 9), "section[0].length", "is 9, only 5 bytes left")
    refused(header(1) + section(b"KVAT", b"12", None) + b"345", "length", "3 trailing bytes after the last section")
    bad = bytearray(header(1) + section(b"KVAT", b"12345"))
    bad[-1] ^= 1
    refused(bytes(bad), "section[0].crc32", "section 'KVAT': checksum mismatch")
    # version 1: no checksum word
    refused(header(1, version=1) + b"KVAT" + struct.pack("<Q", 9) + b"12345", "section[0].length", "is 9, only 5")


def test_unpack_sections_accepts_exact_fits():
    assert unpack_sections(header(0)) == (0, [])  # exactly a header
    flags, sections = unpack_sections(header(1, flags=3) + section(b"KVAT", b""))  # an empty last section
    assert flags == 3 and [(t, bytes(p)) for t, p in sections] == [(b"KVAT", b"")]
    blob = header(2) + section(b"AAAA", b"x") + section(b"BBBB", b"yz")
    assert [(t, bytes(p)) for t, p in unpack_sections(bytearray(blob))[1]] == [(b"AAAA", b"x"), (b"BBBB", b"yz")]
    assert [(t, bytes(p)) for t, p in unpack_sections(memoryview(blob))[1]] == [(b"AAAA", b"x"), (b"BBBB", b"yz")]
    v1 = header(2, version=1) + b"AAAA" + struct.pack("<Q", 1) + b"x" + b"BBBB" + struct.pack("<Q", 2) + b"yz"
    assert [(t, bytes(p)) for t, p in unpack_sections(v1)[1]] == [(b"AAAA", b"x"), (b"BBBB", b"yz")]


def test_pack_sections_header_and_tags():
    blob = pack_sections([(b"RECR", b"abc")])
    assert blob == header(1) + section(b"RECR", b"abc")  # flags 0 unless given
    assert len(blob) == HEADER + SECTION + 3
    assert pack_sections([], 3)[:HEADER] == header(0, flags=3)
    with pytest.raises(ValueError, match=r"unknown state flags 0x9 \(known: 0x7\)"):
        pack_sections([], 9)
    with pytest.raises(ValueError, match="section tag b'REC' must be 4 bytes"):
        pack_sections([(b"REC", b"")])


def test_find_section_says_what_it_found():
    sections = [(b"KVAT", memoryview(b"1")), (b"RECR", memoryview(b"2")), (b"RECR", memoryview(b"3"))]
    assert bytes(find_section(sections, b"KVAT")) == b"1"
    for tag, n in ((b"IDXK", 0), (b"RECR", 2)):
        with pytest.raises(StateError) as err:
            find_section(sections, tag)
        assert err.value.field == "section"
        assert f"expected exactly one {tag.decode()} section, found {n} in ['KVAT', 'RECR', 'RECR']" in str(err.value)
    with pytest.raises(StateError) as err:  # undecodable tags are still shown
        find_section([(b"\xff\xfe\xfd\xfc", memoryview(b""))], b"KVAT")
    assert "in ['\ufffd\ufffd\ufffd\ufffd']" in str(err.value)


# -- Reader / Writer --------------------------------------------------------------------


def test_codecs_round_trip_the_whole_range_of_each_field():
    w = Writer()
    w.u8(255)
    w.u32(2**32 - 1)
    w.i32(-(2**31))
    w.i32(2**31 - 1)
    w.u64(2**64 - 1)
    w.name("état")
    w.raw(b"\x00\x01")
    data = w.getvalue()
    assert data[:1] == b"\xff" and len(data) == 1 + 4 + 4 + 4 + 8 + 1 + len("état".encode()) + 2
    r = Reader(data)
    got = (r.u8("a"), r.u32("b"), r.i32("c"), r.i32("d"), r.u64("e"))
    assert got == (255, 2**32 - 1, -(2**31), 2**31 - 1, 2**64 - 1)
    assert r.name("f") == "état"
    assert bytes(r.raw(2, "g")) == b"\x00\x01"
    assert bytes(r.raw(0, "h")) == b""  # a zero-length read is fine
    r.at_end()
    with pytest.raises(struct.error):
        Writer().i32(2**31)  # i32 is signed


@pytest.mark.parametrize(
    ("read", "size"), [("u8", 1), ("u32", 4), ("i32", 4), ("u64", 8), ("name", 1)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("where", ["", "recurrent"])
def test_truncated_reads_name_the_field_and_the_shortfall(read, size, where):
    r = Reader(b"\x07" * (size - 1) if read != "name" else b"", where)
    field = f"{where}.fld" if where else "fld"
    with pytest.raises(StateError) as err:
        getattr(r, read)("fld")
    assert err.value.field == field
    assert f"truncated: needs {size} bytes at offset 0, {size - 1} left" in str(err.value)


def test_reader_refuses_negative_lengths_and_names_fields_with_its_prefix():
    r = Reader(b"\x03abc\x02\xff\xfe", "kv")
    with pytest.raises(StateError) as err:
        r.raw(-1, "data")
    assert err.value.field == "kv.data" and "needs -1 bytes at offset 0, 7 left" in str(err.value)
    assert r.name("tensor") == "abc"
    with pytest.raises(StateError) as err:
        r.name("tensor")
    assert err.value.field == "kv.tensor" and "not valid UTF-8" in str(err.value)
    with pytest.raises(StateError) as err:
        Reader(b"\x05ab", "kv").name("tensor")  # the length says 5, 2 bytes follow
    assert err.value.field == "kv.tensor" and "needs 5 bytes at offset 1, 2 left" in str(err.value)


def test_reader_expect_fail_and_at_end_report_exactly():
    r = Reader(b"\x01\x00\x00\x00xyz", "recurrent")
    with pytest.raises(StateError) as err:
        r.expect("n_layer", 3, 4)
    assert err.value.field == "recurrent.n_layer" and "is 3, this memory expects 4" in str(err.value)
    r.expect("n_layer", 4, 4)  # equal: nothing raised
    with pytest.raises(StateError) as err:
        r.fail("cell", "is bad")
    assert err.value.field == "recurrent.cell" and "is bad" in str(err.value)
    r.u32("n")
    with pytest.raises(StateError) as err:
        r.at_end()
    assert err.value.field == "recurrent.length" and "3 unread trailing bytes" in str(err.value)


def test_reader_reads_a_snapshot_of_a_mutable_buffer():
    """A reader over a bytearray must not see later writes to it (a blob being
    received into a reused buffer); a memoryview is read in place."""
    buf = bytearray(struct.pack("<I", 7))
    r = Reader(buf)
    buf[0] = 9
    assert r.u32("n") == 7
