"""Export -> open -> read -> verify -> dequantize on synthetic checkpoints, and the estimator."""

import json
import tracemalloc

import numpy as np
import pytest
from colibri_int4 import (
    ChecksumError,
    Container,
    QuantScheme,
    dequantize_container,
    estimate_container_size,
    export_checkpoint,
)
from colibri_int4.error_report import tensor_error_summary
from colibri_int4.layout import PAGE
from colibri_int4.quantize import bf16_bits_to_f32, dequantize_q4, f32_to_bf16_bits, quantize_q4
from safetensors.numpy import load_file


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(group_size=64, symmetric=True, resident_dtype="int8", embed_dtype="bf16"),
        QuantScheme(group_size=32, symmetric=False, resident_dtype="int4", embed_dtype="int4", scale_dtype="fp16"),
        QuantScheme(group_size=128, symmetric=True, resident_dtype="bf16", embed_dtype="int8"),
    ],
    ids=["g64-sym-int8", "g32-asym-int4", "g128-sym-bf16"],
)
def test_export_roundtrip(make_checkpoint, tmp_path, scheme):
    ckpt, config, tensors = make_checkpoint(tokenizer='{"hello": "tokenizer"}')
    out = tmp_path / "m.coli"
    report = export_checkpoint(ckpt, out, scheme)
    assert out.stat().st_size == report.file_size == estimate_container_size(config, scheme, tokenizer_length=22).file_size
    with Container.open(out) as c:
        assert c.read_tokenizer_json() == '{"hello": "tokenizer"}'
        assert c.resident_bytes % PAGE == 0 and c.blob_length % PAGE == 0
        for e in c.header.experts.entries:
            assert e.offset % PAGE == 0 and e.length == c.blob_length
        resident = c.read_resident()
        limits = {"bf16": 0.005, "q8": 0.01, "q4": 0.15, "f32": 0.0}
        for t in c.header.tensors:
            assert rel(resident[t.name], tensors[t.name]) <= limits[t.encoding], t.name
        assert c.read_resident()["layers.1.moe.router.expert_bias"].dtype == np.float32
        # an expert read through the API equals quantizing the checkpoint slice directly
        buf = np.empty(c.blob_length, dtype=np.uint8)
        blob = c.read_expert_into(2, 3, buf)
        direct = tensors["layers.2.moe.experts.down_proj"][3]
        group = c.blob_layout.groups["down"]  # d_model 64 < 128: the effective group is 64
        assert group == min(scheme.group_size, 64)
        q = quantize_q4(direct, group, scheme.symmetric, scheme.scale_dtype)
        np.testing.assert_array_equal(blob.packed["down"], q.data)
        np.testing.assert_array_equal(blob.scales["down"], q.scales)
        np.testing.assert_array_equal(blob.dequantize()["down"], dequantize_q4(q.data, q.scales, q.zeros, group, scheme.scale_dtype))
        assert np.shares_memory(blob.packed["gate"], buf)  # views, no copy
        assert c.verify().ok
    back = dequantize_container(out, tmp_path / "back")
    assert json.loads((back / "config.json").read_text()) == config
    assert (back / "tokenizer.json").read_text() == '{"hello": "tokenizer"}'
    loaded = load_file(str(back / "model.safetensors"))  # the real safetensors library reads our writer
    assert set(loaded) == set(tensors)
    for name, value in tensors.items():
        assert loaded[name].shape == value.shape
        assert rel(loaded[name], value) < 0.15, name


def test_bf16_checkpoint_reads_like_its_fp32_widening(tmp_path, make_checkpoint):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    ckpt, config, tensors = make_checkpoint()
    widened = {k: bf16_bits_to_f32(f32_to_bf16_bits(v)) for k, v in tensors.items()}
    bf16_dir = tmp_path / "bf16"
    bf16_dir.mkdir()
    (bf16_dir / "config.json").write_text(json.dumps(config))
    save_file({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}, str(bf16_dir / "model.safetensors"))
    f32_dir = tmp_path / "f32"
    f32_dir.mkdir()
    (f32_dir / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import save_file as save_np

    save_np(widened, str(f32_dir / "model.safetensors"))
    export_checkpoint(bf16_dir, tmp_path / "a.coli")
    export_checkpoint(f32_dir, tmp_path / "b.coli")
    assert (tmp_path / "a.coli").read_bytes() == (tmp_path / "b.coli").read_bytes()


def test_bits_per_weight_and_raw_resident(tiny_container):
    path, config, _ = tiny_container
    with Container.open(path) as c:
        assert c.scheme.expert_bits_per_weight() == 5.0  # group 32 asym: 4 + 32/32
        assert c.bits_per_weight >= 5.0
        raw = c.read_resident(dequantize=False)
        q = raw["layers.0.attn.q_proj.weight"]
        assert q.encoding == "q4" and q.data.dtype == np.uint8 and q.zeros is not None
        assert q.data.shape == (64, 32) and q.scales.shape == (64, 2)


def test_iter_resident_reads_tensor_by_tensor_and_row_blocks_match(tiny_container):
    """`iter_resident` yields what `read_resident` does, one tensor read at a time; `rows`
    dequantizes any block of a 2-D tensor exactly as the whole tensor does."""
    path, _, _ = tiny_container
    with Container.open(path) as c:
        whole = c.read_resident(dequantize=False)
        one_by_one = list(c.iter_resident())
    assert [t.name for t in one_by_one] == list(whole)
    encodings = set()
    for raw in one_by_one:
        np.testing.assert_array_equal(raw.dequantize(), whole[raw.name].dequantize())
        if len(raw.shape) == 2:
            encodings.add(raw.encoding)
            full = raw.dequantize()
            for start, stop in ((0, 1), (3, 17), (raw.shape[0] - 5, raw.shape[0] + 9)):
                block = raw.rows(start, stop)
                assert block.shape == (len(range(raw.shape[0])[start:stop]), raw.shape[1])
                np.testing.assert_array_equal(block.dequantize(), full[start:stop])
        else:
            with pytest.raises(ValueError, match="only 2-D"):
                raw.rows(0, 1)
    assert "q4" in encodings


def test_map_resident_gives_read_only_views_of_the_file_that_outlive_close(tiny_container):
    """`map_resident` decodes the same stored bytes as `iter_resident`, as read-only views over a
    map of the file, CRC-checked; `skip` leaves tensors out of `iter_resident`."""
    path, _, _ = tiny_container
    with Container.open(path) as c:
        whole = {t.name: t for t in c.iter_resident()}
        name = max(whole, key=lambda n: whole[n].data.nbytes)
        mapped = c.map_resident(name)
        assert [t.name for t in c.iter_resident(skip={name})] == [n for n in whole if n != name]
        with pytest.raises(KeyError, match="no resident tensor 'nope'"):
            c.map_resident("nope")
    assert not mapped.data.flags.writeable
    np.testing.assert_array_equal(mapped.dequantize(), whole[name].dequantize())  # after close


def test_map_resident_refuses_a_corrupt_tensor(tiny_container, tmp_path):
    path, _, _ = tiny_container
    with Container.open(path) as c:
        entry = max(c.header.tensors, key=lambda t: t.length)
    bad = tmp_path / "bad.coli"
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    with Container.open(bad) as c:
        with pytest.raises(ChecksumError, match=f"tensor '{entry.name}' at bytes \\[{entry.offset}, "):
            c.map_resident(entry.name)


def test_estimator_for_nano_matches_the_design():
    nano = {"vocab_size": 49152, "d_model": 1024, "n_layers": 24, "n_dense_layers": 1, "n_heads": 16,
            "n_kv_heads": 4, "head_dim": 64, "qk_norm": True, "dense_ffn_dim": 3072, "n_experts": 64,
            "expert_dim": 512, "shared_expert_dim": 2048, "tie_embeddings": False}
    est = estimate_container_size(nano, QuantScheme(group_size=64, symmetric=True))
    assert est.blob_length == 835_584  # 204 pages: no padding at NanoColibri shapes
    assert est.bits_per_weight == 4.25
    assert 2.55e9 < est.total_params < 2.75e9
    assert est.n_experts_total == 23 * 64
    assert est.file_size == est.resident_bytes + est.expert_bytes + 4096 * -(-est.header_bytes // 4096)


def test_export_streams_tensor_by_tensor(make_checkpoint, tmp_path):
    """Peak traced allocation during export stays a small fraction of the checkpoint."""
    ckpt, _, tensors = make_checkpoint(n_layers=6, n_experts=32, expert_dim=128, d_model=128,
                                       n_heads=4, head_dim=32, dense_ffn_dim=128, shared_expert_dim=128)
    checkpoint_bytes = sum(v.nbytes for v in tensors.values())
    del tensors
    tracemalloc.start()
    try:
        export_checkpoint(ckpt, tmp_path / "s.coli")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert checkpoint_bytes > 30e6
    assert peak < checkpoint_bytes / 10, (peak, checkpoint_bytes)


def test_error_summary_reports_every_tensor_type(tiny_container, tmp_path):
    path, _, _ = tiny_container
    ckpt = path.parent / "ckpt"
    summary = tensor_error_summary(ckpt, path)
    assert {"embed.weight", "attn.q_proj.weight", "moe.experts.gate_proj", "moe.router.weight"} <= set(summary)
    assert summary["moe.experts.gate_proj"]["tensors"] == 8 and 0.01 < summary["moe.experts.gate_proj"]["relative_rmse"] < 0.15
    assert summary["attn_norm.weight"]["relative_rmse"] == 0.0


def test_blob_reads_with_o_direct_into_an_aligned_buffer(tiny_container):
    """What colibri-stream will do: its own O_DIRECT fd, a page-aligned mmap buffer, one preadv
    at the index's offset/length, then ExpertBlob.parse on the buffer."""
    import mmap
    import os

    from colibri_int4 import ExpertBlob

    path = tiny_container[0]
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    with Container.open(path) as c:
        entry = c.expert_entry(2, 1)
        expected = c.read_expert(2, 1)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pytest.skip("this filesystem refuses O_DIRECT")
        buf = mmap.mmap(-1, entry.length)  # anonymous mmaps are page-aligned
        try:
            try:
                n = os.preadv(fd, [buf], entry.offset)
            except OSError:
                pytest.skip("this filesystem refuses O_DIRECT reads")
            assert n == entry.length
            blob = ExpertBlob.parse(buf, c.blob_layout, entry.crc32)
            for part, array in blob.dequantize().items():
                np.testing.assert_array_equal(array, expected[part])
            del blob
        finally:
            os.close(fd)
            buf.close()
