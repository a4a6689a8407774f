"""`colibri-int4 estimate` on a real colibri-model checkpoint (with SmolLM2's 1.56 MB tokenizer.json)
equals the size of the container `colibri-int4 export` writes from it, to the byte."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from colibri_int4.cli import main as int4_cli
from colibri_model import ColibriForCausalLM, get_preset
from colibri_model.tokenizer import default_tokenizer_json


def test_estimate_equals_a_real_export(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "ckpt"
    ColibriForCausalLM(get_preset("tiny")).save_pretrained(checkpoint, tokenizer_json=default_tokenizer_json())
    assert (checkpoint / "tokenizer.json").stat().st_size > 1_500_000
    runner = CliRunner()
    for scheme in ([], ["--group", "32", "--asym", "--resident-dtype", "int4"]):
        out = tmp_path / f"tiny{len(scheme)}.coli"
        exported = runner.invoke(int4_cli, ["export", str(checkpoint), str(out), "--no-progress", *scheme])
        assert exported.exit_code == 0, exported.output
        estimate = runner.invoke(int4_cli, ["estimate", str(checkpoint / "config.json"), "--json", *scheme])
        assert json.loads(estimate.output)["file_size"] == out.stat().st_size, scheme
