"""Colibri tensor names (CHECKPOINT.md) -> the Hugging Face names of the Llama-style decoders.

Every family here names its tensors like Llama (`model.layers.{i}.self_attn.q_proj.weight`,
`input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`); they differ only in
the MoE block: its module name (`mlp`, Mixtral's `block_sparse_moe`), the names of an expert's
three projections (`gate_proj`/`up_proj`/`down_proj`, Mixtral's `w1`/`w3`/`w2`) and the shared
expert (Qwen2-MoE). Checkpoints store routed experts one tensor per expert
(`...experts.{j}.gate_proj.weight`); transformers 5's in-memory layout (`experts.gate_up_proj`
`[E, 2 * expert_dim, d]`, gate rows first, and `experts.down_proj` `[E, d, expert_dim]`) is read
too, should a checkpoint be saved that way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["IGNORED", "LlamaStyleNames"]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LlamaStyleNames:
    moe: str = "mlp"
    parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared: str = "shared_expert"  # DeepSeek: shared_experts
    router_bias: str = "expert_bias"  # the selection bias; DeepSeek-V3: e_score_correction_bias
    # DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder layer
    # (`model.layers.{num_hidden_layers}.*`): only speculative decoding reads them
    extra_layers_ignored: bool = False
    router: str = "gate"  # the router's module under `moe` (GPT-OSS: "router")
    experts: str = "llama"  # how routed experts are stored; "gpt_oss": gpt_oss_experts.py

    def resident(self, name: str) -> str:
        """The HF name of a non-expert Colibri tensor."""
        top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}
        if name in top:
            return top[name]
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(name)
        i, rest = match.groups()
        base = f"model.layers.{i}."
        if rest == "moe.router.expert_bias":
            return base + f"{self.moe}.gate.{self.router_bias}"
        for colibri, hf in (
            ("attn_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."), ("attn.", "self_attn."),
            ("ffn.", "mlp."), ("moe.router.", f"{self.moe}.{self.router}."), ("moe.shared.", f"{self.moe}.{self.shared}."),
            ("moe.shared_gate.", f"{self.moe}.shared_expert_gate."),
        ):
            if rest.startswith(colibri):
                return base + hf + rest[len(colibri):]
        raise KeyError(name)

    def ignored(self, hf_name: str, n_layers: int) -> bool:
        """Whether a shard tensor is not a weight of the model (a recomputed buffer, MTP layers)."""
        if IGNORED.search(hf_name):
            return True
        match = _HF_LAYER.match(hf_name)
        return self.extra_layers_ignored and match is not None and int(match.group(1)) >= n_layers

    def expert(self, layer: int, expert: int) -> tuple[str, str, str]:
        """HF names of one routed expert's gate, up and down weights."""
        prefix = f"model.layers.{layer}.{self.moe}.experts.{expert}."
        return tuple(prefix + part + ".weight" for part in self.parts)

    def fused(self, layer: int) -> tuple[str, str]:
        """HF names of transformers 5's stacked `gate_up_proj` and `down_proj` of one layer."""
        prefix = f"model.layers.{layer}.{self.moe}.experts."
        return prefix + "gate_up_proj", prefix + "down_proj"


# Tensors some checkpoints carry that are not weights (recomputed buffers).
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
