"""ColibriForCausalLM: the decoder. One file to read end to end (nanoGPT-style).

    tokens -> embed -> [block x n_layers] -> norm -> lm_head -> logits
    block  = h + attn(attn_norm(h));  h + ffn(ffn_norm(h))
    ffn    = dense SwiGLU for the first n_dense_layers, MoELayer after

`forward(input_ids, targets=None, cache=None, return_logits=False, positions=None,
attention_mask=None)`: `targets` are the next tokens, already aligned with the
inputs (targets[t] is what position t should predict; -100 is ignored), so data loaders own the
shift and loss masks (SFT masks non-assistant tokens with -100). With targets, the loss runs the
LM head in row chunks (loss.py) and returns no logits, unless `return_logits=True` asks for the
plain path (whole-batch logits, then one cross-entropy). `cache` (a `KVCache`, `new_kv_cache`)
makes the pass incremental: the T tokens go to cache columns length..length+T. `positions` ([T]
or [B, T], default length..length+T for every row) and `attention_mask` ([B, length + T], or per
query [B, T, length + T]; True = a real key) let a right-padded batch run each row at its own
position and hide its padding, or packed sequences share a row: see `Attention` (layers.py) for
the exact rule. Both None: the plain causal forward, unchanged.

`compile_blocks()` compiles each block with `torch.compile(fullgraph=True)` (the torchtitan way:
the blocks are where the FLOPs are, one graph each, no graph break; the loop over blocks, the
loss chunks and hooks such as FSDP's stay eager).

Init follows GPT-2/nanoGPT: N(0, 0.02), with residual output projections (o_proj, down_proj)
scaled by 1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint_io import read_checkpoint, save_checkpoint
from .config import ColibriConfig
from .experts import ExpertBackend, GroupedExperts
from .layers import Attention, KVCache, RMSNorm, SwiGLU
from .loss import DEFAULT_CHUNK_ROWS, chunked_cross_entropy
from .mla import MultiHeadLatentAttention
from .moe import MoELayer
from .router import RouterStats


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # None when a loss was asked for without return_logits
    loss: torch.Tensor | None = None  # mean cross-entropy over targets != -100 (+ aux loss)
    lm_loss: torch.Tensor | None = None  # cross-entropy alone
    aux_loss: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)


class Block(nn.Module):
    def __init__(self, config: ColibriConfig, index: int, experts: ExpertBackend | None = None):
        super().__init__()
        self.index = index
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = MultiHeadLatentAttention(config, index) if config.attention_kind == "mla" else Attention(config, index)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        if config.is_moe_layer(index):
            self.moe = MoELayer(config, index, experts)
        else:
            self.ffn = SwiGLU(config.d_model, config.dense_ffn_dim)

    @property
    def is_moe(self) -> bool:
        return hasattr(self, "moe")

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), positions, cache, attention_mask)
        ffn = self.moe if self.is_moe else self.ffn
        return h + ffn(self.ffn_norm(h))


class _TrainingCompiled:
    """A block's forward: the compiled one in training mode without a KV cache or padding mask (the
    graph it was compiled for), else the eager one."""

    def __init__(self, block: Block, compiled, eager):
        self.block, self.compiled, self.eager = block, compiled, eager

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.block.training and cache is None and attention_mask is None:
            return self.compiled(h, positions)
        return self.eager(h, positions, cache, attention_mask)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its own init when built on the meta device (a runtime's skeleton,
    whose weights are assigned later): torch's meta `normal_` imports torch._dynamo, 2 s and
    ~70 MB of a streaming runtime's memory for values nobody reads. Elsewhere it draws as before,
    so a seed gives the same model."""
    device = torch.empty(0).device
    if device.type == "meta":  # a given weight is taken as is (what nn.Embedding.from_pretrained does)
        return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim, device=device))
    return nn.Embedding(rows, dim)


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
        self.embed = _embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i, backends.get(i)) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()
        self.activation_checkpointing = False
        self.loss_chunk_rows = DEFAULT_CHUNK_ROWS

    # --- init ---------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Write every parameter and buffer the model holds: after `to_empty` (the trainer's meta-device
        build) storage is uninitialised, and a tensor this misses trains from garbage, at times NaN.
        tests/test_model_init.py fills storage with NaN first and checks each config variant."""
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
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.zeros_(module.sinks)  # as transformers' GPT-OSS starts: no mass on the sink
        for layer in self.moe_layers():
            nn.init.normal_(layer.router.weight, std=std)
            if layer.router.bias is not None:
                nn.init.zeros_(layer.router.bias)
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.zero_()
            layer.router.tokens_per_expert.zero_()  # a running count since the last balancer step

    # --- structure ----------------------------------------------------------------------------
    def moe_layers(self) -> list[MoELayer]:
        return [block.moe for block in self.layers if block.is_moe]

    def set_top_k(self, top_k: int | None) -> None:
        """Pin the number of routed experts per token (None: train/infer top_k by mode)."""
        for layer in self.moe_layers():
            layer.top_k_override = top_k

    def limit_positions(self, max_len: int) -> None:
        """Positions stay below `max_len` from now on (a runtime's KV cache length): the rotary
        tables hold that many rows instead of the config's max_seq_len (21 MB at 40,960 positions
        and head_dim 64). A longer forward still grows them."""
        for block in self.layers:
            block.attn.rope.limit(max_len)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def compile_blocks(self, **compile_kwargs) -> None:
        """`torch.compile(fullgraph=True)` each block's training forward in place (names and hooks
        unchanged: FSDP's and checkpointing's wrappers stay eager around it).

        Dense and MoE blocks each compile once and the graph is reused by every block of the same
        kind (dynamo inlines the module, its parameters are graph inputs): two graphs in all.
        Eval mode and KV-cache decoding run the eager forward: validation's modes (top_k 1 and 2,
        a shorter last batch) would each compile again, tripling compile time, and dynamo's
        recompile limit (8 per code object, shared by all blocks) would be reached. kwargs go to
        torch.compile (e.g. backend="aot_eager"). Requires `torch._grouped_mm` (else a block has
        the reference loop's data-dependent shapes and cannot be one graph).
        """
        compile_kwargs.setdefault("fullgraph", True)
        for block in self.layers:
            eager = block.forward
            block.forward = _TrainingCompiled(block, torch.compile(eager, **compile_kwargs), eager)

    # --- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_logits: bool = False,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device)
        elif tuple(positions.shape) not in ((T,), (B, T)):
            raise ValueError(f"positions must be [T] = [{T}] or [B, T] = [{B}, {T}], got {list(positions.shape)}")
        for block in self.layers:  # host-side: the RoPE tables exist before a compiled block runs
            block.attn.rope.ensure(start + T, input_ids.device)
        h = self.embed(input_ids)
        for block in self.layers:
            if self.activation_checkpointing and self.training and cache is None:
                h = torch.utils.checkpoint.checkpoint(block, h, positions, None, attention_mask, use_reentrant=False)
            else:
                h = block(h, positions, cache, attention_mask)
        if cache is not None:
            cache.length += T
        h = self.norm(h)
        if targets is None or return_logits:
            # the module itself when untied, so a runtime may hold it in its own form (a q4 kernel)
            logits = F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)
            if targets is None:
                return CausalLMOutput(logits=logits)
            lm_loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        else:
            logits = None
            lm_loss = chunked_cross_entropy(h.view(B * T, -1), self.lm_head_weight(), targets.reshape(B * T),
                                            self.loss_chunk_rows)
        aux = [layer.aux_loss for layer in self.moe_layers() if layer.aux_loss is not None]
        aux_loss = torch.stack(aux).sum() if aux else None
        loss = lm_loss + aux_loss if aux_loss is not None else lm_loss
        return CausalLMOutput(logits=logits, loss=loss, lm_loss=lm_loss, aux_loss=aux_loss)

    # --- router statistics --------------------------------------------------------------------
    def router_stats(self, reset: bool = False) -> list[RouterStats]:
        """Per MoE layer load since the last reset (the balancer resets every optimizer step)."""
        layers = self.moe_layers()
        if not layers:
            return []
        counts = torch.stack([layer.router.tokens_per_expert for layer in layers]).tolist()  # one host copy
        if reset:
            for layer in layers:
                layer.router.tokens_per_expert.zero_()
        return [RouterStats.from_counts(layer.layer_index, c) for layer, c in zip(layers, counts)]

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        param = self.embed.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_seq_len, param.device, param.dtype)

    # --- checkpoints (checkpoint_io.py reads and writes the files) ------------------------------
    def save_pretrained(self, directory, tokenizer_json: str | None = None) -> None:
        save_checkpoint(self, directory, tokenizer_json=tokenizer_json)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None) -> ColibriForCausalLM:
        """The model of a checkpoint directory (or Hub repo id); tensors held as `load_tensors` says."""
        config, state = read_checkpoint(path, dtype)
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, assign=True)  # names and shapes were checked against the tensor table
        # Buffers that are not saved (token counters) must be materialised off the meta device.
        for layer in model.moe_layers():
            layer.router.tokens_per_expert = torch.zeros(config.n_experts, dtype=torch.float32)
            if layer.router.expert_bias is not None:
                layer.router.expert_bias = layer.router.expert_bias.float()
        if device is not None:
            model.to(device)
        return model
