"""Bad data gets one line naming the file and line."""

from __future__ import annotations

import json

import pytest
from colibri_eval import DataError, get_task, load_documents


def _write(path, rows):
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def test_malformed_json_names_file_and_line(tmp_path):
    good = json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0})
    _write(tmp_path / "piqa.jsonl", [good, good, '{"goal": "g", "sol1": '])
    with pytest.raises(DataError) as info:
        load_documents(get_task("piqa"), tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'piqa.jsonl'}:3: malformed JSON")
    assert "\n" not in message


def test_missing_and_mistyped_fields(tmp_path):
    _write(tmp_path / "winogrande.jsonl", [json.dumps({"sentence": "a _ b", "option1": "x", "answer": "1"})])
    with pytest.raises(DataError, match=r"winogrande.jsonl:1: missing field 'option2'"):
        load_documents(get_task("winogrande"), tmp_path)
    _write(tmp_path / "lambada_openai.jsonl", ["", json.dumps({"text": 5})])
    with pytest.raises(DataError, match=r"lambada_openai.jsonl:2: field 'text' is int, expected str"):
        load_documents(get_task("lambada_openai"), tmp_path)
    bad_key = {"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "C"}
    _write(tmp_path / "arc_easy.jsonl", [json.dumps(bad_key)])
    with pytest.raises(DataError, match=r"arc_easy.jsonl:1: answerKey 'C' is not one of"):
        load_documents(get_task("arc_easy"), tmp_path)


def test_missing_file_and_limit(tmp_path):
    with pytest.raises(DataError, match="no data file for task hellaswag"):
        load_documents(get_task("hellaswag"), tmp_path)
    assert len(load_documents(get_task("piqa"), "bundled", limit=7)) == 7
