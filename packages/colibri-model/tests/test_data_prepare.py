"""`prepare`: shards + manifest + validation split from text/JSONL/parquet, resumable after a crash."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from colibri_model.cli import main
from colibri_model.corpus import chat_file, prose_files
from colibri_model.data import ManifestError, prepare, read_manifest, read_shard
from colibri_model.data.prepare import is_validation, partial_dir
from colibri_model.data.sources import DataSourceError, iter_documents
from colibri_model.tokenizer import load_tokenizer


def _docs(n):
    return [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog. " * (3 + i % 5) for i in range(n)]


def test_jsonl_documents_become_shards_with_eos_between(tmp_path):
    docs = _docs(60)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    manifest = prepare([str(src)], tmp_path / "out", shard_tokens=500, val_fraction=0.1, progress=False)
    assert manifest.complete and len(manifest.train_shards) > 2 and manifest.val_shard.documents > 0
    tok = load_tokenizer()
    train = np.concatenate([read_shard(tmp_path / "out" / s.file) for s in manifest.train_shards])
    val = read_shard(tmp_path / "out" / "val.bin")
    expected_train = [d for d in docs if not is_validation(d, 0.1)]
    expected_val = [d for d in docs if is_validation(d, 0.1)]
    assert manifest.val_shard.documents == len(expected_val)
    # every document, in order, followed by EOS (id 0); no document in both splits
    for stream, expected in ((train, expected_train), (val, expected_val)):
        ends = np.flatnonzero(np.asarray(stream) == 0)
        assert len(ends) == len(expected)
        starts = np.concatenate([[0], ends[:-1] + 1])
        decoded = [tok.decode(stream[s:e].tolist()) for s, e in zip(starts, ends, strict=False)]
        assert decoded == expected
    assert manifest.train_tokens + manifest.val_shard.tokens == len(train) + len(val)
    assert read_manifest(tmp_path / "out") == manifest


def test_text_and_parquet_inputs(tmp_path):
    pq.write_table(pa.table({"text": _docs(5)}), tmp_path / "a.parquet")
    text = tmp_path / "b.txt"
    text.write_text("\ufeffPara one.\r\n\r\nPara two.\r\n\r\n\r\nPara three.")
    assert list(iter_documents(str(text), text_doc_chars=15)) == ["Para one.\n\nPara two.", "Para three."]
    manifest = prepare([str(tmp_path)], tmp_path / "out", shard_tokens=10_000, val_fraction=0.5,
                       text_doc_chars=15, progress=False)
    assert [p.rsplit("/", 1)[-1] for p in manifest.inputs] == ["a.parquet", "b.txt"]
    assert sum(s.documents for s in manifest.train_shards) + manifest.val_shard.documents == 7


def test_interrupted_prepare_resumes_to_the_same_result(tmp_path, monkeypatch):
    inputs = [str(p) for p in prose_files()]
    kwargs = dict(shard_tokens=60_000, val_fraction=0.02, progress=False)
    whole = prepare(inputs, tmp_path / "whole", **kwargs)

    prepare_module = importlib.import_module("colibri_model.data.prepare")
    real_write = prepare_module.write_manifest
    calls = {"n": 0}

    def crash_after_three(directory, manifest):
        calls["n"] += 1
        real_write(directory, manifest)
        if calls["n"] == 4:  # the initial manifest + 3 shards, then "kill"
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "write_manifest", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, tmp_path / "resumed", **kwargs)
    assert not (tmp_path / "resumed").exists()  # only a complete data set gets the --out name
    partial = read_manifest(partial_dir(tmp_path / "resumed"))
    assert not partial.complete and len(partial.train_shards) == 3
    monkeypatch.setattr(prepare_module, "write_manifest", real_write)
    resumed = prepare(inputs, tmp_path / "resumed", **kwargs)
    assert [s.sha256 for s in resumed.train_shards] == [s.sha256 for s in whole.train_shards]
    assert resumed.val_shard == whole.val_shard
    assert not (tmp_path / "resumed" / "val.partial").exists() and not partial_dir(tmp_path / "resumed").exists()


def test_bad_inputs_give_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataSourceError, match=r"bad.jsonl:2: not valid JSON"):
        prepare([str(bad)], tmp_path / "o1", progress=False)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"content": "x"}\n')
    with pytest.raises(DataSourceError, match=r"nofield.jsonl:1: no string field 'text'"):
        prepare([str(nofield)], tmp_path / "o2", progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(ManifestError, match="not empty"):
        prepare([str(prose_files()[0])], tmp_path / "busy", progress=False)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "manifest.json").write_text(json.dumps({"manifest_version": "9.1"}))
    with pytest.raises(ManifestError, match=r"manifest_version 9.1 is not supported \(this colibri-model reads 1.0\)"):
        read_manifest(tmp_path / "m")


def test_cli_prepare_and_its_errors(tmp_path):
    runner = CliRunner()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(40)))
    ok = runner.invoke(main, ["prepare", str(src), "--out", str(tmp_path / "d"), "--val-fraction", "0.2",
                              "--no-progress"])
    assert ok.exit_code == 0, ok.output
    assert "train shards" in ok.output
    missing = runner.invoke(main, ["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "e")])
    assert missing.exit_code == 2 and "no such file or directory" in missing.output
    assert missing.output.strip().count("\n") == 0 and "Traceback" not in missing.output
    wrong = runner.invoke(main, ["prepare", str(chat_file()), "--out", str(tmp_path / "f")])
    assert wrong.exit_code == 2 and "no string field 'text'" in wrong.output
    flag = runner.invoke(main, ["prepare", str(src), "--out", str(tmp_path / "g"), "--val-fraction", "2"])
    assert flag.exit_code == 2
    for tokenizer, message in ((tmp_path / "nope.json", "no such tokenizer file"), (src, "not a readable tokenizer")):
        bad = runner.invoke(main, ["prepare", str(src), "--out", str(tmp_path / "h"), "--tokenizer", str(tokenizer)])
        assert bad.exit_code == 2 and message in bad.output and bad.output.strip().count("\n") == 0, bad.output


def test_a_failed_prepare_does_not_block_the_retry(tmp_path):
    runner = CliRunner()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(40)))
    out = tmp_path / "d"
    # no document falls into a validation split this small: the run fails, about its settings
    failed = runner.invoke(main, ["prepare", str(src), "--out", str(out), "--val-fraction", "0.0001"])
    assert failed.exit_code == 2 and "raise --val-fraction" in failed.output
    assert not out.exists() and not partial_dir(out).exists()
    # an interrupted run with other settings leaves OUT.partial; a retry with new ones starts afresh
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": oops}\n')
    with pytest.raises(DataSourceError, match="bad.jsonl:1"):
        prepare([str(src), str(bad)], out, shard_tokens=300, progress=False)
    assert not out.exists() and len(read_manifest(partial_dir(out)).train_shards) > 1
    retry = runner.invoke(main, ["prepare", str(src), "--out", str(out), "--val-fraction", "0.2"])
    assert retry.exit_code == 0, retry.output
    assert read_manifest(out).complete and not partial_dir(out).exists()
    # OUT holds a finished run: the same command says so; other settings are refused in one line
    again = runner.invoke(main, ["prepare", str(src), "--out", str(out), "--val-fraction", "0.2"])
    assert again.exit_code == 0 and "already prepared by an earlier run" in again.output
    other = runner.invoke(main, ["prepare", str(src), "--out", str(out), "--val-fraction", "0.3"])
    assert other.exit_code == 2 and "holds a finished prepare of other inputs or settings" in other.output
    assert other.output.strip().count("\n") == 0
