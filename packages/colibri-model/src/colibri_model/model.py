"""ColibriForCausalLM: the decoder. One file to read end to end (nanoGPT-style).

    tokens -> embed -> [block x n_layers] -> norm -> lm_head -> logits
    block  = h + attn(attn_norm(h));  h + ffn(ffn_norm(h))
    ffn    = dense SwiGLU for the first n_dense_layers, MoELayer after

`forward(input_ids, targets=None)`: `targets` are the next tokens, already aligned with the
inputs (targets[t] is what position t should predict; -100 is ignored), so data loaders own the
shift and loss masks (SFT masks non-assistant tokens with -100).

Init follows GPT-2/nanoGPT: N(0, 0.02), with residual output projections (o_proj, down_proj)
scaled by 1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ColibriConfig
from .experts import ExpertBackend, GroupedExperts
from .layers import Attention, KVCache, RMSNorm, SwiGLU
from .moe import MoELayer
from .router import RouterStats


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None  # mean cross-entropy over targets != -100 (+ aux loss)
    lm_loss: torch.Tensor | None = None  # cross-entropy alone
    aux_loss: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)


class Block(nn.Module):
    def __init__(self, config: ColibriConfig, index: int, experts: ExpertBackend | None = None):
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, index)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        if config.is_moe_layer(index):
            self.moe = MoELayer(config, index, experts)
        else:
            self.ffn = SwiGLU(config.d_model, config.dense_ffn_dim)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), positions, cache)
        ffn = self.moe if self.is_moe else self.ffn
        return h + ffn(self.ffn_norm(h))


class ColibriForCausalLM(nn.Module):
    """The Colibri MoE language model.

    Example:
        >>> from colibri_model import ColibriForCausalLM, get_preset
        >>> model = ColibriForCausalLM(get_preset("tiny"))
        >>> out = model(torch.tensor([[1, 2, 3]]))
        >>> out.logits.shape
        torch.Size([1, 3, 49152])
    """

    def __init__(self, config: ColibriConfig, expert_backends: dict[int, ExpertBackend] | None = None):
        super().__init__()
        self.config = config
        backends = expert_backends or {}
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i, backends.get(i)) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()
        self.activation_checkpointing = False

    # --- init ---------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_output = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=out_std if is_output else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(std, out_std)
        for layer in self.moe_layers():
            nn.init.normal_(layer.router.weight, std=std)
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.zero_()

    # --- structure ----------------------------------------------------------------------------
    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for block in self.layers if block.is_moe]

    def set_top_k(self, top_k: int | None) -> None:
        """Pin the number of routed experts per token (None: train/infer top_k by mode)."""
        for layer in self.moe_layers():
            layer.top_k_override = top_k

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    # --- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> CausalLMOutput:
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=input_ids.device)
        h = self.embed(input_ids)
        for block in self.layers:
            if self.activation_checkpointing and self.training and cache is None:
                h = torch.utils.checkpoint.checkpoint(block, h, positions, use_reentrant=False)
            else:
                h = block(h, positions, cache)
        if cache is not None:
            cache.length += T
        h = self.norm(h)
        logits = F.linear(h, self.lm_head_weight())
        if targets is None:
            return CausalLMOutput(logits=logits)
        lm_loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        aux = [layer.aux_loss for layer in self.moe_layers() if layer.aux_loss is not None]
        aux_loss = torch.stack(aux).sum() if aux else None
        loss = lm_loss + aux_loss if aux_loss is not None else lm_loss
        return CausalLMOutput(logits=logits, loss=loss, lm_loss=lm_loss, aux_loss=aux_loss)

    # --- router statistics --------------------------------------------------------------------
    def router_stats(self, reset: bool = False) -> list[RouterStats]:
        """Per MoE layer load since the last reset (the balancer resets every optimizer step)."""
        stats = []
        for layer in self.moe_layers():
            stats.append(RouterStats.from_counts(layer.layer_index, layer.router.tokens_per_expert.cpu()))
            if reset:
                layer.router.tokens_per_expert.zero_()
        return stats

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        param = self.embed.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_seq_len, param.device, param.dtype)

    # --- checkpoints (see checkpoint.py) --------------------------------------------------------
    def save_pretrained(self, directory, tokenizer_json: str | None = None) -> None:
        from .checkpoint import save_checkpoint

        save_checkpoint(self, directory, tokenizer_json=tokenizer_json)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None) -> ColibriForCausalLM:
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, dtype=dtype, device=device)
