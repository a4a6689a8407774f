"""HF checkpoint directory -> container, tensor by tensor (the exporter's writer and body loop).

1. config.json -> the Colibri config (colibri-spec's HF config mapping; every field taken or refused).
2. Names: every tensor of the Colibri table (layout.py) is found in the shards with its shape;
   every shard tensor must be used (or be a recomputed buffer like `rotary_emb.inv_freq`), so an
   unmapped weight (a bias Colibri has no place for) fails before anything is written.
3. The layout is planned, then `export.write_body` reads one resident tensor or one routed expert
   at a time through `HFTensors`, encodes it and writes it at its final offset; the header, with
   the tokenizer settings and chat template, comes last.

Memory: one routed expert in fp32 plus its encoding, or one block of rows of a large matrix
(export.ROW_BLOCK_BYTES), never a whole tensor of the size of the vocabulary and never a shard:
bench/import_hf_memory.py measures it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from colibri_spec.hf_config import hf_config_dict
from tqdm import tqdm

from ..errors import HFImportError
from ..export import ContainerFileWriter, plan_with_header, write_body
from ..header import model_shape
from ..model_shape import checkpoint_tensor_shapes
from ..scheme import QuantScheme
from . import gpt_oss_experts
from .families import family_for
from .hf_directory import HFDirectory
from .names import LlamaStyleNames

# --quant: routed experts / attention, dense FFN, shared experts / embeddings and LM head.
# The LM head is int8 below bf16: a decode token reads it whole (on a 49k-vocabulary 24 x 64 MoE,
# 100 MB of bf16 a token, more than its experts), and int8 groups cost SmolLM2-135M's tied
# embedding +0.12% perplexity (bench/RESULTS.md); llama.cpp's Q4 files hold it in Q6_K, the size of
# `--embed-dtype int6`.
QUANT_PRESETS = {
    "bf16": dict(expert_dtype="bf16", resident_dtype="bf16", embed_dtype="bf16"),
    "int8": dict(expert_dtype="int8", resident_dtype="int8", embed_dtype="int8"),
    "int4": dict(expert_dtype="int4", resident_dtype="int8", embed_dtype="int8"),
}


def quant_scheme(quant: str, group_size: int = 64, **overrides) -> QuantScheme:
    """The scheme `--quant` names, with explicit `resident_dtype` / `embed_dtype` etc. winning."""
    if quant not in QUANT_PRESETS:
        raise HFImportError(f"--quant {quant!r}: choose one of {', '.join(QUANT_PRESETS)}")
    settings = {**QUANT_PRESETS[quant], **{k: v for k, v in overrides.items() if v is not None}}
    return QuantScheme(group_size=group_size, **settings)


@dataclass
class ImportReport:
    path: Path
    model_type: str
    file_size: int
    checkpoint_bytes: int  # bytes of the safetensors shards' tensors
    seconds: float
    config: dict


class HFTensors:
    """The HF shards seen through Colibri names: a `write_body` source (export.py)."""

    def __init__(self, hf: HFDirectory, names: LlamaStyleNames, table: dict[str, tuple[int, ...]], tied: bool):
        self.hf, self.names = hf, names
        self.resident = {n: names.resident(n) for n in table if ".moe.experts." not in n}
        self.fused: set[int] = set()
        used = set(self.resident.values())
        for name, hf_name in self.resident.items():
            self._check(hf_name, table[name], f"Colibri tensor '{name}'")
        for name, dims in table.items():
            if name.endswith("moe.experts.gate_proj"):
                layer = int(name.split(".")[1])
                used |= self._check_experts(layer, dims)
        if tied:  # some tied checkpoints store the head anyway
            used.add("lm_head.weight")
        n_layers = 1 + max((int(n.split(".")[1]) for n in table if n.startswith("layers.")), default=-1)
        unused = sorted(n for n in hf.names - used if not names.ignored(n, n_layers))
        if unused:
            raise HFImportError(
                f"{hf.path}: tensor '{unused[0]}' has no place in the Colibri model ({len(unused)} unused); "
                "the config describes a different architecture"
            )

    def _check(self, hf_name: str, dims: tuple[int, ...], what: str) -> None:
        if hf_name not in self.hf.names:
            raise HFImportError(f"{self.hf.path}: tensor '{hf_name}' is missing ({what})")
        if self.hf.shape(hf_name) != tuple(dims):
            raise HFImportError(
                f"{self.hf.path}: tensor '{hf_name}' has shape {list(self.hf.shape(hf_name))}, "
                f"config.json implies {list(dims)}"
            )

    def _check_experts(self, layer: int, stacked: tuple[int, ...]) -> set[str]:
        n_experts, expert_dim, d = stacked
        if self.names.experts == "gpt_oss":
            return gpt_oss_experts.check_layer(self.hf, layer, n_experts, expert_dim, d)
        first = self.names.expert(layer, 0)
        if first[0] not in self.hf.names and all(n in self.hf.names for n in self.names.fused(layer)):
            gate_up, down = self.names.fused(layer)
            self._check(gate_up, (n_experts, 2 * expert_dim, d), f"layer {layer} experts")
            self._check(down, (n_experts, d, expert_dim), f"layer {layer} experts")
            self.fused.add(layer)
            return {gate_up, down}
        used = set()
        for expert in range(n_experts):
            for hf_name, dims in zip(self.names.expert(layer, expert), ((expert_dim, d), (expert_dim, d), (d, expert_dim))):
                self._check(hf_name, dims, f"routed expert (layer {layer}, expert {expert})")
                used.add(hf_name)
        return used

    def read(self, name: str) -> tuple[np.ndarray, int]:
        return self.hf.tensor(self.resident[name])

    def read_rows(self, name: str, start: int, stop: int) -> tuple[np.ndarray, int]:
        return self.hf.rows(self.resident[name], start, stop)

    def read_expert(self, layer: int, expert: int) -> tuple[list[np.ndarray], int]:
        if self.names.experts == "gpt_oss":  # with the biases: [gate, up, down, gate_b, up_b, down_b]
            return gpt_oss_experts.read_expert(self.hf, layer, expert)
        if layer in self.fused:
            gate_up_name, down_name = self.names.fused(layer)
            gate_up, n1 = self.hf.tensor(gate_up_name, index=expert)
            down, n2 = self.hf.tensor(down_name, index=expert)
            gate, up = np.split(gate_up, 2, axis=0)
            return [gate, up, down], n1 + n2
        parts = [self.hf.tensor(name) for name in self.names.expert(layer, expert)]
        return [array for array, _ in parts], sum(n for _, n in parts)


def colibri_config_from_hf(data: dict, where: str | os.PathLike = "config.json", name: str | None = None) -> dict:
    """The Colibri config dict (colibri-spec's CHECKPOINT.md) of a Hugging Face config.json
    object, every field mapped or refused (`HFImportError` naming the field and `where`): the
    object a container header carries. Needs no weights: `colibri-stream plan config.json` sizes
    a model from this. The mapping is colibri-spec's `hf_config_dict`; here the config is also
    held to the bounds a container header is checked with.

    >>> colibri_config_from_hf(json.load(open("Qwen3-30B-A3B/config.json")))["n_experts"]  # doctest: +SKIP
    128
    """
    config = hf_config_dict(data, where, name, error=HFImportError)
    try:
        model_shape(config)
    except ValueError as exc:
        raise HFImportError(f"{where}: {exc}") from None
    return config


def import_hf(
    hf_dir: str | os.PathLike, out_path: str | os.PathLike, scheme: QuantScheme | None = None,
    name: str | None = None, progress: bool = False,
) -> ImportReport:
    """Convert a Hugging Face checkpoint directory into a container at `out_path`.

    >>> import_hf("Qwen3-30B-A3B/", "qwen3-30b-a3b.coli", quant_scheme("int4"))  # doctest: +SKIP
    """
    scheme = scheme or quant_scheme("int4")
    started = time.perf_counter()
    with HFDirectory(hf_dir) as hf:
        where, model_type = hf.path / "config.json", hf.config.get("model_type")
        config = colibri_config_from_hf(hf.config, where, name or f"{model_type}:{hf.path.resolve().name}")
        family = family_for(model_type, str(where))
        shape = model_shape(config)
        table = checkpoint_tensor_shapes(shape)
        source = HFTensors(hf, family.NAMES, table, shape.tie_embeddings)
        tokenizer, tokenizer_config = hf.tokenizer_json(), hf.tokenizer_config()
        try:
            plan, json_length = plan_with_header(config, shape, scheme, len(tokenizer), tokenizer_config)
        except ValueError as exc:
            raise HFImportError(f"{hf.path}: cannot quantize with this scheme: {exc}") from None
        total = hf.nbytes
        with ContainerFileWriter(out_path, config, scheme, plan, json_length, tokenizer_config) as writer:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="import-hf", disable=not progress)
            writer.crcs.update(write_body(writer.fd, source, plan, scheme, tokenizer, bar))
            bar.close()
    return ImportReport(Path(out_path), model_type, plan.file_size, total, time.perf_counter() - started, config)
