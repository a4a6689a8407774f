"""Every kind of bad input gets one ContainerError / CheckpointError saying what and where."""

import json
import os
import struct

import numpy as np
import pytest
from colibri_int4 import CheckpointError, Container, ContainerError, export_checkpoint


def write(tmp_path, data: bytes, name="bad.coli"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def open_and_read_all(path):
    with Container.open(path) as c:
        c.read_resident()
        buf = bytearray(c.blob_length)
        for e in c.header.experts.entries:
            c.read_expert_into(e.layer, e.expert, buf)
        assert c.verify().ok


@pytest.fixture
def good(tiny_container):
    return tiny_container[0].read_bytes()


def test_wrong_magic_and_empty(tmp_path, good):
    with pytest.raises(ContainerError, match="not a colibri-int4 container: magic"):
        Container.open(write(tmp_path, b"GGUF" + good[4:]))
    with pytest.raises(ContainerError, match="truncated: the file has 0 bytes"):
        Container.open(write(tmp_path, b""))


@pytest.mark.parametrize("keep", [10, 31, 40, 5000, -4096, -1])
def test_truncated(tmp_path, good, keep):
    with pytest.raises(ContainerError, match="truncated|exceeds the file"):
        Container.open(write(tmp_path, good[:keep]))


def test_future_major_is_refused_naming_both_versions(tmp_path, good, hostile):
    with pytest.raises(ContainerError, match=r"preamble: container format 2\.0 is not supported \(this colibri-int4 reads 1\.3\)"):
        Container.open(write(tmp_path, hostile(good, major=2)))


def test_newer_minor_with_extra_key_is_read(tmp_path, good, hostile):
    def add_key(h):
        h["future_feature"] = {"x": 1}

    open_and_read_all(write(tmp_path, hostile(good, add_key, minor=7)))
    with pytest.raises(ContainerError, match="invalid header field 'future_feature'"):
        Container.open(write(tmp_path, hostile(good, add_key, minor=0)))


def test_header_bit_flip_is_caught_by_the_header_crc(tmp_path, good):
    data = bytearray(good)
    data[100] ^= 0x04
    with pytest.raises(ContainerError, match="CRC-32 of the header JSON"):
        Container.open(write(tmp_path, bytes(data)))
    data = bytearray(good)
    data[17] ^= 0x01  # json_length
    with pytest.raises(ContainerError, match="corrupted preamble"):
        Container.open(write(tmp_path, bytes(data)))


def test_blob_bit_flip_names_the_expert(tmp_path, good):
    with Container.open(write(tmp_path, good, "ok.coli")) as c:
        entry = c.expert_entry(2, 1)
    data = bytearray(good)
    data[entry.offset + 123] ^= 0x10
    path = write(tmp_path, bytes(data))
    with Container.open(path) as c:
        c.read_resident()  # the resident region is intact
        with pytest.raises(ContainerError, match=r"expert \(layer 2, expert 1\).*checksum mismatch"):
            c.read_expert(2, 1)
        report = c.verify()
        assert not report.ok and len(report.failures) == 1 and "layer 2, expert 1" in report.failures[0]
        c.read_expert(2, 0)


def test_resident_bit_flip_names_the_tensor(tmp_path, good):
    with Container.open(write(tmp_path, good, "ok.coli")) as c:
        t = next(t for t in c.header.tensors if t.name == "layers.1.attn.v_proj.weight")
    data = bytearray(good)
    data[t.offset + 5] ^= 0x80
    with Container.open(write(tmp_path, bytes(data))) as c, pytest.raises(ContainerError, match="v_proj.*checksum mismatch"):
        c.read_resident()
    with Container.open(write(tmp_path, bytes(data))) as c, pytest.raises(ContainerError, match="v_proj.*checksum mismatch"):
        list(c.iter_resident())  # the tensor-by-tensor reader checks each CRC too


def _first_expert(field, value):
    def mutate(h):
        h["experts"]["entries"][0][field] = value
    return mutate


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_first_expert("offset", 1 << 40), "outside"),
        (_first_expert("offset", -4096), "greater than or equal to 0"),
        (_first_expert("offset", 4097), "unaligned"),
        (_first_expert("length", 1 << 50), "length"),
        (_first_expert("layer", 0), "not a routed expert"),
        (_first_expert("expert", 1), "not a routed expert of this config, or appears twice"),
        (lambda h: h["experts"]["entries"].pop(), "expert index has 7 entries"),
        (lambda h: h["experts"].update(blob_length=1 << 30), "blob_length"),
        (lambda h: h["experts"]["entries"][1].update(offset=h["experts"]["entries"][0]["offset"]), "overlap"),
        (lambda h: h["tensors"][3].update(offset=h["tensors"][2]["offset"]), "overlap"),
        (lambda h: h["tensors"][0].update(length=1 << 45), "length"),
        (lambda h: h["tensors"][0].update(shape=[1 << 30, 1 << 30]), "config and scheme give"),
        (lambda h: h["tensors"].pop(), "missing"),
        (lambda h: h["resident"].update(length=1 << 52), "outside the file"),
        (lambda h: h["config"].update(vocab_size=1 << 40), "vocab_size"),
        (lambda h: h["config"].update(n_experts=-3), "n_experts"),
        (lambda h: h.update(file_size=12), "header says 12 bytes"),
        (lambda h: h["quantization"].update(group_size=48), "group_size"),
        (lambda h: h.update(format_name="gguf"), "format_name"),
        (lambda h: h["tokenizer"].update(length=1 << 33), "tokenizer range"),
        (lambda h: h["experts"]["entries"][0].update(crc32="zz"), "crc32"),
    ],
)
def test_hostile_header_with_valid_checksums(tmp_path, good, hostile, mutate, message):
    with pytest.raises(ContainerError, match=message):
        Container.open(write(tmp_path, hostile(good, mutate)))


def test_absurd_json_length_is_refused_before_allocating(tmp_path, good, hostile):
    with pytest.raises(ContainerError, match="exceeds the file"):
        Container.open(write(tmp_path, hostile(good, json_length=1 << 62)))


def test_file_that_grew_is_refused(tmp_path, good):
    with pytest.raises(ContainerError, match="truncated or extended"):
        Container.open(write(tmp_path, good + b"\0" * 4096))


def test_short_caller_buffer(tiny_container):
    with Container.open(tiny_container[0]) as c, pytest.raises(ValueError, match="buffer has 10 bytes"):
        c.read_expert_into(1, 0, bytearray(10))


# --- bad checkpoints -----------------------------------------------------------------------

def test_checkpoint_errors(make_checkpoint, tmp_path):
    ckpt, config, tensors = make_checkpoint()
    out = tmp_path / "x.coli"
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        export_checkpoint(tmp_path / "nowhere", out)
    (ckpt / "config.json").write_text(json.dumps({**config, "format_version": "2.0"}))
    with pytest.raises(CheckpointError, match=r"format_version 2\.0 is not supported \(this colibri-int4 reads 1\.0\)"):
        export_checkpoint(ckpt, out)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        export_checkpoint(ckpt, out)
    assert not out.exists() and not os.path.exists(str(out) + ".tmp")


def test_config_is_carried_opaquely_beyond_the_shape_fields(make_checkpoint, tmp_path):
    """model_type and the schema are colibri-model's to validate (FORMAT.md): the export keeps
    whatever config.json holds, and the reader hands it back as stored."""
    ckpt, config, _ = make_checkpoint()
    del config["model_type"]
    config["a_future_field"] = {"nested": [1, 2]}
    (ckpt / "config.json").write_text(json.dumps(config))
    export_checkpoint(ckpt, tmp_path / "x.coli")
    with Container.open(tmp_path / "x.coli") as c:
        assert c.config == config
        c.config["d_model"] = 1  # a copy: the header is not changed through it
        assert c.config == config and c.shape.d_model == config["d_model"]
    (ckpt / "config.json").write_text(json.dumps({**config, "d_model": 0}))
    with pytest.raises(CheckpointError, match="d_model"):  # a shape field is this package's business
        export_checkpoint(ckpt, tmp_path / "y.coli")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("norm.weight"), "'norm.weight' is missing"),
        (lambda t: t.update({"extra.weight": np.zeros(3, np.float32)}), "unexpected tensor 'extra.weight'"),
        (lambda t: t.update({"embed.weight": np.zeros((255, 64), np.float32)}), "shape"),
    ],
)
def test_checkpoint_tensor_mismatch(make_checkpoint, tmp_path, edit, message):
    from safetensors.numpy import save_file

    ckpt, config, tensors = make_checkpoint()
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(ckpt, tmp_path / "x.coli")


def test_ungroupable_width_and_garbage_safetensors(make_checkpoint, tmp_path):
    ckpt, _, _ = make_checkpoint(expert_dim=48)
    with pytest.raises(CheckpointError, match="not a multiple of 32"):
        export_checkpoint(ckpt, tmp_path / "x.coli")
    ckpt, _, _ = make_checkpoint(name="garbage")
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        export_checkpoint(ckpt, tmp_path / "x.coli")
