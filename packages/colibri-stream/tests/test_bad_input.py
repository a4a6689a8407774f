"""Bad input gets one clear error: corrupted blobs name (layer, expert), budgets name the minimum."""

from __future__ import annotations

import shutil

import pytest
from colibri_int4 import ChecksumError, Container, ContainerError
from colibri_int4.header import PREAMBLE_SIZE, pack_preamble
from colibri_stream import BudgetError, Engine, ExpertCorruptError, SizeFormatError, parse_size


@pytest.mark.parametrize("prefetch", ["off", "on"])  # on: the bad blob may be read by a worker
def test_corrupted_expert_blob_names_layer_and_expert(corrupted, prefetch):
    path, (layer, expert), prompt = corrupted
    with Engine.open(path, ram_budget="200MB", record_trace=True, prefetch=prefetch) as eng:
        with pytest.raises(ExpertCorruptError) as info:
            eng.logits(eng.encode(prompt))
        reached = {(e.layer, x) for e in eng.stats.trace for x in e.experts}
        with pytest.raises(ExpertCorruptError):  # again: the same clear error, no hang
            eng.logits(eng.encode(prompt))
    assert (info.value.layer, info.value.expert) == (layer, expert)
    assert f"layer {layer}, expert {expert}" in str(info.value)
    assert "checksum" in str(info.value)
    assert (layer, expert) in reached
    # the damaged expert never entered the cache, so it is never computed with
    assert (layer, expert) not in eng.cache


def test_truncated_container_is_refused_at_open(tiny, tmp_path):
    path = tmp_path / "short.coli"
    data = tiny[0].read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ContainerError, match="truncated|file_size|size"):
        Engine.open(path, ram_budget="200MB")


def test_budget_below_minimum_names_the_minimum(tiny, minimum_budget):
    fixed = dict(dtype="f32", max_context=256, prefill_chunk=128)  # nothing left to step down
    minimum = minimum_budget(tiny[0], **fixed)
    assert minimum == minimum_budget(tiny[0])  # the preferred defaults are these values
    with pytest.raises(BudgetError) as info:  # (every projection held: map_weights="off")
        Engine.open(tiny[0], ram_budget=minimum - 1, map_weights="off", **fixed)
    assert info.value.minimum_bytes == minimum
    assert str(minimum) in str(info.value) and "too small" in str(info.value)
    with Engine.open(tiny[0], ram_budget=minimum, **fixed) as eng:  # exactly the minimum is enough
        assert eng.budget.slots == 1
        assert eng.budget.accounted_bytes <= minimum
        eng.generate([1, 2, 3], max_new_tokens=4)


def test_budget_splits_and_caps_at_all_experts(tiny):
    with Engine.open(tiny[0], ram_budget="1GB") as eng:
        b = eng.budget
        assert b.slots == b.total_experts == 48
        assert b.accounted_bytes <= b.ram_budget
        assert eng.stats.resident_bytes <= b.resident_bytes
        assert eng.stats.to_dict()["resident_mb"] > 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("600MB", 600_000_000),
        ("1GiB", 1 << 30),
        ("512 KiB", 512 * 1024),
        ("4096", 4096),
        ("1.5GB", 1_500_000_000),
        ("2mib", 2 << 20),
        (123, 123),
        ("10B", 10),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "12 parsecs", "-5MB", "1e9", "five"])
def test_parse_size_rejects(text):
    with pytest.raises(SizeFormatError, match="size"):
        parse_size(text)


def test_unknown_model_config_version_is_refused(tiny, tmp_path):
    """A container whose embedded config says checkpoint format 2.0 is refused, naming both versions."""
    path = tmp_path / "v2.coli"
    shutil.copy(tiny[0], path)
    with Container.open(path) as c:
        header = c.header
        old_length = len(header.to_json_bytes())
    config = dict(header.config, format_version="2.0")
    new_json = header.model_copy(update={"config": config}).to_json_bytes()
    assert len(new_json) == old_length  # "1.0" -> "2.0": same length, so the layout is unchanged
    with open(path, "r+b") as f:
        f.write(pack_preamble(new_json) + new_json)
        assert f.tell() == PREAMBLE_SIZE + len(new_json)
    with pytest.raises(ValueError, match=r"2\.0 is not supported.*reads 1\.0"):
        Engine.open(path, ram_budget="200MB")


def test_a_corrupt_embedding_is_refused_at_open_naming_the_tensor(tiny, tmp_path):
    """The embedding is mapped rather than read, and still checked against its CRC at open."""
    assert Engine.plan(tiny[0]).footprint.mapped_bytes > 0  # untied: the mapped path
    bad = tmp_path / "bad-embedding.coli"
    shutil.copy(tiny[0], bad)
    with Container.open(bad) as c:
        entry = next(t for t in c.header.tensors if t.name == "embed.weight")
    with open(bad, "r+b") as f:
        f.seek(entry.offset + entry.length // 3)
        byte = f.read(1)
        f.seek(entry.offset + entry.length // 3)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="tensor 'embed.weight' at bytes"):
        Engine.open(bad, ram_budget="200MB")
