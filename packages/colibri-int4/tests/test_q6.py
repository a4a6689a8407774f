"""The q6 encoding (format 1.3, `embed_dtype` "int6"): its bytes bit for bit as FORMAT.md lays
them out, its error bound, containers that carry it (and only those labelled 1.3), and the
refusals: in_features not a multiple of 64, int6 outside the embedding and head, short buffers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from colibri_int4 import (
    CheckpointError,
    ChecksumError,
    Container,
    ContainerError,
    QuantScheme,
    dequantize_q6,
    estimate_container_size,
    export_checkpoint,
    pack_q6,
    quantize_q6,
    unpack_q6,
)
from colibri_int4.cli import main
from colibri_int4.layout import encoded_length
from colibri_int4.quantize import decode_half, encode_half
from colibri_int4.tensor_codec import decode_tensor, encode_tensor
from pydantic import ValidationError

HEAD_NAMES = ("embed.weight", "lm_head.weight")


def spec_bytes(codes: list[list[int]]) -> bytes:
    """q6 data bytes of `codes` (rows of 6-bit ints) written column by column from FORMAT.md's
    words, independently of `pack_q6`."""
    out = bytearray()
    for row in codes:
        cols = len(row)
        lows, highs = bytearray(cols // 2), bytearray(cols // 4)
        for col, code in enumerate(row):
            lows[col // 2] |= (code & 0xF) << (4 * (col % 2))  # column 2j: bits 0-3, 2j+1: bits 4-7
            span, k = divmod(col, 64)
            # k = 2i -> bits 0-1, 2i+1 -> bits 2-3, 32+2i -> bits 4-5, 33+2i -> bits 6-7 of highs[16*span + i]
            i, shift = (k // 2, 2 * (k % 2)) if k < 32 else ((k - 32) // 2, 4 + 2 * (k % 2))
            highs[16 * span + i] |= (code >> 4) << shift
        out += lows + highs
    return bytes(out)


def test_a_2_x_128_matrix_is_laid_out_bit_for_bit_as_the_spec_says():
    rng = np.random.default_rng(3)
    codes = rng.integers(1, 64, size=(2, 128)).astype(np.uint8)  # no 0: each group's extreme is +31 steps
    codes[:, ::32] = 63
    scale = np.float32(2.0**-7)  # exact in bf16: w / s gives the codes back exactly
    weights = scale * (codes.astype(np.float32) - 32)
    expected = spec_bytes(codes.tolist())
    assert len(expected) == 2 * 96

    assert pack_q6(codes).tobytes() == expected
    np.testing.assert_array_equal(unpack_q6(np.frombuffer(expected, np.uint8).reshape(2, 96)), codes)
    quantized = quantize_q6(weights, 32, "bf16")
    assert quantized.data.tobytes() == expected and quantized.zeros is None
    scale_bits = int(np.float32(scale).view(np.uint32) >> 16)
    assert quantized.scales.tobytes() == np.full(8, scale_bits, "<u2").tobytes()

    scheme = QuantScheme(group_size=32, embed_dtype="int6")
    sections = encode_tensor(weights, "q6", scheme)
    stored = b"".join(np.ascontiguousarray(s).tobytes() for s in sections)
    assert stored == expected + quantized.scales.tobytes()  # data, then scales
    assert len(stored) == encoded_length("q6", (2, 128), scheme) == 2 * 128 * 3 // 4 + 2 * 4 * 2
    raw = decode_tensor(stored, "lm_head.weight", "q6", (2, 128), scheme)
    assert raw.data.shape == (2, 96) and raw.data.dtype == np.uint8 and raw.scales.shape == (2, 4)
    np.testing.assert_array_equal(raw.dequantize(), weights)


@pytest.mark.parametrize("column, byte, value", [
    (0, 64, 0x03), (1, 64, 0x0C), (32, 64, 0x30), (33, 64, 0xC0),  # span 0, i = 0
    (30, 64 + 15, 0x03), (63, 64 + 15, 0xC0),                       # span 0, i = 15
    (64 + 2 * 5 + 1, 64 + 16 + 5, 0x0C), (64 + 32 + 2 * 7, 64 + 16 + 7, 0x30),  # span 1
])
def test_each_columns_top_bits_land_where_the_spec_says(column, byte, value):
    codes = np.zeros((1, 128), np.uint8)
    codes[0, column] = 0b110000  # top bits 3, low nibble 0
    data = pack_q6(codes)[0]
    assert np.flatnonzero(data).tolist() == [byte] and data[byte] == value
    codes[0, column] = 0b001111  # low nibble only
    data = pack_q6(codes)[0]
    assert np.flatnonzero(data).tolist() == [column // 2] and data[column // 2] == 0xF << (4 * (column % 2))


@pytest.mark.parametrize("scale_dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("group", [32, 64])
def test_quantization_error_is_at_most_half_a_step(scale_dtype, group):
    rng = np.random.default_rng(group)
    rows, cols = 2100, 256  # more rows than one quantizer block
    weights = (0.02 * rng.standard_normal((rows, cols))).astype(np.float32)
    weights.reshape(-1)[rng.integers(0, weights.size, 500)] *= 10.0  # outliers
    weights[5, :group] = 0.0  # a group of zeros
    quantized = quantize_q6(weights, group, scale_dtype)
    assert quantized.data.shape == (rows, cols * 3 // 4) and quantized.scales.shape == (rows, cols // group)

    scales = decode_half(quantized.scales, scale_dtype)
    codes = unpack_q6(quantized.data).reshape(rows, cols // group, group)
    assert codes.max() <= 63
    assert scales[5, 0] == 0 and (codes[5, 0] == 32).all()
    levels = codes.astype(np.int32) - 32
    live = scales > 0
    assert (np.abs(levels).max(axis=-1)[live] == 31).all()  # each group's largest magnitude on 31 steps
    # the rule: divide by the stored scale, round half to even, clamp
    grouped = weights.reshape(rows, cols // group, group)
    safe = np.where(live, scales, 1.0)[..., None]
    rule = np.where(live[..., None], np.clip(np.rint(grouped / safe), -32, 31), 0)
    np.testing.assert_array_equal(levels, rule)

    back = dequantize_q6(quantized.data, quantized.scales, group, scale_dtype)
    error = np.abs(back - weights).reshape(rows, cols // group, group)
    assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all()
    np.testing.assert_array_equal(back.reshape(rows, -1, group), levels * scales[..., None])


def test_row_slices_of_a_q6_tensor_dequantize_to_their_rows():
    scheme = QuantScheme(group_size=64, embed_dtype="int6", scale_dtype="fp16")
    weights = np.random.default_rng(0).standard_normal((10, 192)).astype(np.float32)
    stored = b"".join(np.ascontiguousarray(s).tobytes() for s in encode_tensor(weights, "q6", scheme))
    raw = decode_tensor(stored, "embed.weight", "q6", (10, 192), scheme)
    whole = raw.dequantize()
    np.testing.assert_array_equal(raw.rows(3, 7).dequantize(), whole[3:7])
    np.testing.assert_array_equal(raw.take(np.array([9, 0, 9])).dequantize(), whole[[9, 0, 9]])


def assert_within_half_a_step(raw, reference: np.ndarray) -> None:
    scales = raw.scales_f32()
    error = np.abs(raw.dequantize() - reference).reshape(*scales.shape, -1)
    assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("tied, group, scale_dtype", [(False, 32, "bf16"), (True, 64, "fp16")])
def test_an_int6_head_container_reads_back_as_format_1_3(make_checkpoint, tmp_path, tied, group, scale_dtype):
    ckpt, config, tensors = make_checkpoint(tie_embeddings=tied)
    scheme = QuantScheme(group_size=group, scale_dtype=scale_dtype, embed_dtype="int6")
    out = tmp_path / "m.coli"
    report = export_checkpoint(ckpt, out, scheme)
    assert report.file_size == out.stat().st_size == estimate_container_size(config, scheme).file_size
    names = HEAD_NAMES[:1] if tied else HEAD_NAMES
    with Container.open(out) as c:
        assert c.version == (1, 3) and c.header.container_version == "1.3" and c.scheme.embed_dtype == "int6"
        encodings = {t.name: t.encoding for t in c.header.tensors}
        assert [n for n, e in encodings.items() if e == "q6"] == list(names)
        assert ("lm_head.weight" in encodings) is not tied
        raw = c.read_resident(dequantize=False)
        for name in names:
            rows, cols = tensors[name].shape
            assert raw[name].data.shape == (rows, cols * 3 // 4) and raw[name].scales.shape == (rows, cols // group)
            assert_within_half_a_step(raw[name], tensors[name])
        assert_within_half_a_step(c.map_resident("embed.weight"), tensors["embed.weight"])
        assert c.verify().ok
    assert out.read_bytes()[8:12] == b"\x01\x00\x03\x00"  # preamble: major 1, minor 3

    back = tmp_path / "back"
    assert CliRunner().invoke(main, ["dequantize", str(out), str(back), "--no-progress"]).exit_code == 0
    assert (back / "model.safetensors").stat().st_size > 0


def test_containers_without_int6_keep_their_version(make_checkpoint, tmp_path):
    ckpt, _, _ = make_checkpoint()
    export_checkpoint(ckpt, tmp_path / "m.coli", QuantScheme(embed_dtype="int8"))
    with Container.open(tmp_path / "m.coli") as c:
        assert c.version == (1, 0) and {t.encoding for t in c.header.tensors if t.name in HEAD_NAMES} == {"q8"}


def test_cli_export_and_estimate_take_embed_dtype_int6(make_checkpoint, tmp_path):
    ckpt, _, _ = make_checkpoint()
    out = tmp_path / "m.coli"
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(ckpt), str(out), "--group", "32", "--embed-dtype", "int6", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "embeddings int6" in runner.invoke(main, ["inspect", str(out)]).output
    result = runner.invoke(main, ["estimate", str(ckpt / "config.json"), "--group", "32", "--embed-dtype", "int6", "--json"])
    assert json.loads(result.output)["file_size"] == out.stat().st_size
    for command in ("export", "estimate", "import-hf", "import-gguf"):
        help_text = " ".join(runner.invoke(main, [command, "--help"]).output.split())  # unwrapped
        assert "int6: 6.5 bits a weight at group 32, llama.cpp's Q6_K size for the head" in help_text


def test_in_features_not_a_multiple_of_64_are_refused_before_writing(make_checkpoint, tmp_path):
    ckpt, config, _ = make_checkpoint(d_model=96)  # 96 = 3 x 32: fine for int8, not for int6
    out = tmp_path / "m.coli"
    scheme = QuantScheme(group_size=32, embed_dtype="int6")
    message = r"embed\.weight: shape \[256, 96\]: int6 \(q6\) needs in_features a multiple of 64, got 96; use --embed-dtype int8"
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(ckpt, out, scheme)
    assert list(tmp_path.glob("m.coli*")) == []
    with pytest.raises(ValueError, match=message):
        estimate_container_size(config, scheme)
    result = CliRunner().invoke(main, ["export", str(ckpt), str(out), "--embed-dtype", "int6", "--no-progress"])
    assert result.exit_code == 2 and "use --embed-dtype int8" in result.output and "Traceback" not in result.output
    with pytest.raises(ValueError, match="q6 needs in_features a multiple of 64, got 96"):
        quantize_q6(np.zeros((2, 96), np.float32), 32, "bf16")
    export_checkpoint(ckpt, out, QuantScheme(group_size=32, embed_dtype="int8"))  # what the message suggests


@pytest.mark.parametrize("field", ["resident_dtype", "expert_dtype"])
def test_int6_is_only_for_the_embedding_and_head(field, make_config, tmp_path):
    with pytest.raises(ValidationError, match=field):
        QuantScheme(**{field: "int6"})
    (tmp_path / "config.json").write_text(json.dumps(make_config()))
    result = CliRunner().invoke(main, ["estimate", str(tmp_path / "config.json"), "--resident-dtype", "int6"])
    assert result.exit_code == 2 and "'int6' is not one of" in result.output


def test_short_or_corrupt_q6_bytes_are_refused_by_name(make_checkpoint, tmp_path, hostile):
    scheme = QuantScheme(group_size=32, embed_dtype="int6")
    stored = b"".join(np.ascontiguousarray(s).tobytes()
                      for s in encode_tensor(np.ones((2, 128), np.float32), "q6", scheme))
    with pytest.raises(ContainerError, match=r"tensor 'lm_head\.weight': q6 \[2, 128\] takes 208 bytes, got 207"):
        decode_tensor(stored[:-1], "lm_head.weight", "q6", (2, 128), scheme)
    with pytest.raises(ContainerError, match=r"tensor 'lm_head\.weight': .*multiple of 64, got 96"):
        decode_tensor(stored[:144], "lm_head.weight", "q6", (2, 96), scheme)

    ckpt, _, _ = make_checkpoint()
    path = tmp_path / "m.coli"
    export_checkpoint(ckpt, path, scheme)
    with Container.open(path) as c:
        head = next(t for t in c.header.tensors if t.name == "lm_head.weight")
    data = bytearray(path.read_bytes())
    data[head.offset + 5] ^= 0x40
    (tmp_path / "bad.coli").write_bytes(bytes(data))
    with Container.open(tmp_path / "bad.coli") as c, pytest.raises(ChecksumError, match=r"tensor 'lm_head\.weight'"):
        c.read_resident()

    def shorten_head(header):
        entry = next(t for t in header["tensors"] if t["name"] == "lm_head.weight")
        entry["length"] -= 1

    (tmp_path / "short.coli").write_bytes(hostile(bytes(path.read_bytes()), shorten_head, minor=3))
    with pytest.raises(ContainerError, match=r"tensor 'lm_head\.weight': length \d+ but q6 \[256, 64\] takes \d+ bytes"):
        Container.open(tmp_path / "short.coli")

    def claim_int8(header):
        header["quantization"]["embed_dtype"] = "int8"

    (tmp_path / "claim.coli").write_bytes(hostile(bytes(path.read_bytes()), claim_int8, minor=3))
    with pytest.raises(ContainerError, match=r"tensor 'embed\.weight': q6 \[256, 64\], but config and scheme give q8"):
        Container.open(tmp_path / "claim.coli")


def test_scales_are_stored_as_rounded_and_divided_by_as_stored():
    # 0.3 / 31 is not a bf16 number: the codes are the weights divided by the scale as stored
    weights = np.linspace(-0.3, 0.3, 64, dtype=np.float32)[None, :]
    quantized = quantize_q6(weights, 64, "bf16")
    stored = decode_half(quantized.scales, "bf16")[0, 0]
    assert quantized.scales[0, 0] == encode_half(np.float32(0.3) / np.float32(31.0), "bf16")
    levels = unpack_q6(quantized.data).astype(np.int32)[0] - 32
    np.testing.assert_array_equal(levels, np.clip(np.rint(weights[0] / stored), -32, 31))
