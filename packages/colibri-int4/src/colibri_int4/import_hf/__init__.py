"""`import_hf`: a Hugging Face checkpoint directory (config.json, safetensors shards, tokenizer,
chat template) into a container, without torch and in bounded memory.

    config_fields.py   config.json field by field: every field mapped or refused by name and value
    hf_directory.py    the directory: shards (index or single file), tokenizer.json, chat template
    names.py           Colibri tensor names -> the Llama-style HF names (per-expert and fused experts)
    families/          one module per family: qwen3_moe, qwen2_moe, olmoe, mixtral, llama (dense),
                       deepseek_v3, deepseek_v2 (multi-head latent attention; shared parts in deepseek_mla), gpt_oss
    gpt_oss_experts.py GPT-OSS's stacked experts (interleaved bf16 or MXFP4 blocks) -> Colibri's layout
    convert.py         the conversion: names checked both ways, then the exporter's body writer
    planned.py         config.json alone -> the container the import would write, without a file

Supported model types: qwen3_moe, qwen2_moe, olmoe, mixtral, llama, deepseek_v3, deepseek_v2, gpt_oss. The
produced config is a colibri-model config.json (CHECKPOINT.md, schema 1.1; 1.2 for DeepSeek, GPT-OSS and yarn RoPE) that colibri-model's reader validates when
a runtime opens the container.
"""

from .convert import QUANT_PRESETS, ImportReport, colibri_config_from_hf, import_hf, quant_scheme
from .families import FAMILIES
from .planned import is_hf_config, planned_container, read_hf_config, sizes_by_quant

__all__ = ["FAMILIES", "QUANT_PRESETS", "ImportReport", "colibri_config_from_hf", "import_hf", "is_hf_config",
           "planned_container", "quant_scheme", "read_hf_config", "sizes_by_quant"]
