"""Shared fixtures: the bundled SmolLM2 tokenizer and a tiny random Llama saved as an HF dir."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

ASSETS = Path(__file__).parent / "assets"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """NOTE: on the shared 2-core box, 2 OpenMP threads wait on each other whenever another
    process holds a core (a SmolLM2 forward measured ~10x slower than with 1 thread)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_bytes(gzip.decompress((ASSETS / "smollm2-49152.tokenizer.json.gz").read_bytes()))
    return path


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> Path:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json), eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # a larger init spreads the log-likelihoods, so no item is a near-tie
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_dir: Path):
    from colibri_eval import load_model

    return load_model(f"hf:{tiny_hf_dir}")
