"""The trainer's fresh model (meta device -> `to_empty` -> seeded `reset_parameters`) writes every
parameter and buffer, for every architecture variant the model supports.

`to_empty` hands back uninitialised storage: usually small finite leftovers, now and then NaN. A
tensor that `reset_parameters` forgets trains from that garbage, which a short training test only
catches when the leftovers happen to be NaN (GPT-OSS's attention sinks did exactly that, once in
many CI runs). Here the storage is filled with NaN before the init, so a forgotten tensor fails
every time, and the result must equal the same seeded init of an eagerly built model bit for bit.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from colibri_model import ColibriConfig, ColibriForCausalLM, get_preset
from colibri_model.training.model_init import initialise, meta_model


def _test_module(name: str):
    """Another test file's module: the variant configs are defined once, beside their own tests."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _variant_configs() -> dict[str, ColibriConfig]:
    variants = _test_module("test_model_variants")
    configs = {"tiny": get_preset("tiny").model_copy(update={"vocab_size": 512})}
    configs.update({name: variants._config(name) for name in variants.VARIANTS})
    configs["mla"] = ColibriConfig(name="mla", **_test_module("test_model_mla").MLA)
    configs["gpt-oss"] = _test_module("test_model_gpt_oss_variant")._config()
    return configs


CONFIGS = _variant_configs()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_tensor_is_written_by_the_seeded_init(name):
    config = CONFIGS[name]
    model = meta_model(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.fill_(float("nan") if tensor.is_floating_point() else -1)
    initialise(model, seed=7)
    eager = ColibriForCausalLM(config)
    initialise(eager, seed=7)

    meta_tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    eager_tensors = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    assert meta_tensors.keys() == eager_tensors.keys()
    unwritten = [n for n, t in meta_tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert not unwritten, f"{name}: reset_parameters leaves {unwritten} uninitialised"
    differ = [n for n, t in meta_tensors.items() if not torch.equal(t, eager_tensors[n])]
    assert not differ, f"{name}: the meta-device init differs from the eager one in {differ}"


def test_a_skeleton_on_the_meta_device_imports_no_compiler():
    """A runtime builds the model on meta and assigns its weights after: the embedding's own init
    must not run there (torch's meta normal_ imports torch._dynamo: seconds and ~70 MB)."""
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from colibri_model import ColibriForCausalLM, get_preset\n"
             "with torch.device('meta'):\n"
             "    model = ColibriForCausalLM(get_preset('tiny'))\n"
             "assert model.embed.weight.is_meta\n"
             "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
