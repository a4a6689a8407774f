"""`read_into` / `read_exact`: the one preadv loop, through short reads and early end of file."""

from __future__ import annotations

import os

import pytest
from colibri_int4 import Container, ContainerError, read_exact, read_into

DATA = bytes(range(256)) * 40  # 10240 bytes


@pytest.fixture
def fd(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(DATA)
    handle = os.open(path, os.O_RDONLY)
    yield handle
    os.close(handle)


@pytest.fixture
def short_reads(monkeypatch):
    """Make every os.preadv return at most 7 bytes (as a signal, NFS or FUSE may); returns the
    offsets the loop asked for."""
    real, offsets = os.preadv, []

    def preadv(fd, buffers, offset):
        offsets.append(offset)
        return real(fd, [memoryview(buffers[0])[:7]], offset)

    monkeypatch.setattr(os, "preadv", preadv)
    return offsets


def test_short_reads_are_finished(fd, short_reads):
    assert read_exact(fd, 100, 1000) == DATA[1000:1100]
    assert short_reads == list(range(1000, 1100, 7))  # each call continues where the last ended
    buf = bytearray(50)
    read_into(fd, memoryview(buf), 10_190)  # up to the last byte exactly
    assert buf == DATA[10_190:]


def test_end_of_file_names_the_source_and_the_byte(fd, short_reads):
    with pytest.raises(EOFError, match=r"^blob 3: file ends at byte 10240, wanted 100 bytes at 10200$"):
        read_exact(fd, 100, 10_200, "blob 3")
    with pytest.raises(EOFError, match="file ends at byte 20000"):
        read_into(fd, bytearray(1), 20_000)


def test_empty_read_needs_no_call(fd, short_reads):
    assert read_exact(fd, 0, 99_999) == b"" and short_reads == []


def test_container_reads_survive_short_reads(tiny_container, short_reads):
    path, _, _ = tiny_container
    with Container.open(path) as c:
        weights = c.read_resident()  # the resident region and header go through the loop too
        blob = c.read_expert_into(1, 0, bytearray(c.blob_length))  # and its CRC still checks
    assert len(short_reads) > 100 and weights and blob is not None


def test_truncated_expert_is_a_container_error(tiny_container, tmp_path):
    path, _, _ = tiny_container
    with Container.open(path) as c:
        entry = c.expert_entry(2, 3)
    cut = tmp_path / "cut.coli"
    cut.write_bytes(path.read_bytes())
    with Container.open(cut) as c:  # the header checked the size; cut the file afterwards
        os.truncate(cut, entry.offset + 10)
        with pytest.raises(ContainerError, match=rf"expert \(layer 2, expert 3\): file ends at byte {entry.offset + 10}"):
            c.read_expert_into(2, 3, bytearray(c.blob_length))
