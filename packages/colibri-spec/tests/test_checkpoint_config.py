"""config.json of a checkpoint: the one writer and reader, and what a reader refuses."""

from __future__ import annotations

import json

import pytest
from colibri_spec import (
    CheckpointFormatError,
    CheckpointVersionError,
    VersionMismatchError,
    checkpoint_config_dict,
    get_preset,
    load_config,
    parse_checkpoint_config,
    read_config,
)


def test_written_config_reads_back(tmp_path):
    config = get_preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(checkpoint_config_dict(config)))
    assert read_config(tmp_path) == config
    assert load_config(tmp_path / "config.json") == config
    config.save(tmp_path / "bare.json")
    assert load_config(tmp_path / "bare.json") == config


def test_another_major_format_version_names_both_versions():
    data = {**checkpoint_config_dict(get_preset("tiny")), "format_version": "2.0"}
    with pytest.raises(CheckpointVersionError) as caught:
        parse_checkpoint_config(data, "ckpt/config.json")
    assert str(caught.value) == ("ckpt/config.json: checkpoint format_version 2.0 is not supported "
                                 "(this colibri-spec reads 1.0)")
    assert isinstance(caught.value, CheckpointFormatError) and isinstance(caught.value, VersionMismatchError)
    assert (caught.value.found, caught.value.known) == ("2.0", "1.0")


def test_another_major_schema_version_names_both_versions():
    data = {**checkpoint_config_dict(get_preset("tiny")), "schema_version": "3.1"}
    with pytest.raises(CheckpointVersionError, match=r"config schema_version 3.1 is not supported \(this colibri-spec reads 1.2\)"):
        parse_checkpoint_config(data, "c.json")


def test_a_newer_minor_is_read():
    data = {**checkpoint_config_dict(get_preset("tiny")), "format_version": "1.7"}
    assert parse_checkpoint_config(data, "c.json") == get_preset("tiny")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.pop("format_version"), "c.json: no format_version field"),
    (lambda d: d.pop("model_type"), "c.json: no model_type field"),
    (lambda d: d.update(model_type="llama"), "c.json: model_type 'llama' is not 'colibri'"),
    (lambda d: d.update(d_model=-1), "c.json: invalid config: .*d_model"),
])
def test_malformed_config_is_refused_naming_the_source(edit, message):
    data = checkpoint_config_dict(get_preset("tiny"))
    edit(data)
    with pytest.raises(CheckpointFormatError, match=message):
        parse_checkpoint_config(data, "c.json")


def test_directory_without_a_config_or_with_bad_json(tmp_path):
    with pytest.raises(CheckpointFormatError, match=r"config.json: missing \(not a Colibri checkpoint directory\)"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointFormatError, match="config.json: not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(CheckpointFormatError, match="config.json: expected a JSON object"):
        read_config(tmp_path)
