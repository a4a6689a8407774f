"""`import_hf`: a Hugging Face checkpoint directory (config.json, safetensors shards, tokenizer,
chat template) into a container, without torch and in bounded memory.

    config_fields.py   colibri-spec's HF config mapping (`colibri_spec.hf_config`), refusing with HFImportError
    families/          colibri-spec's families, refusing with HFImportError
    names.py           colibri-spec's Colibri -> HF tensor names
    hf_directory.py    the directory: shards (index or single file), tokenizer.json, chat template
    gpt_oss_experts.py GPT-OSS's stacked experts (interleaved bf16 or MXFP4 blocks) -> Colibri's layout
    convert.py         the conversion: names checked both ways, then the exporter's body writer
    planned.py         config.json alone -> the container the import would write, without a file

Supported model types: qwen3_moe, qwen2_moe, olmoe, mixtral, llama, deepseek_v3, deepseek_v2, gpt_oss. The
produced config is a checkpoint config.json (colibri-spec's CHECKPOINT.md, schema 1.1; 1.2 for DeepSeek,
GPT-OSS and yarn RoPE), validated by colibri-spec's reader before anything is written.
"""

from .convert import QUANT_PRESETS, ImportReport, colibri_config_from_hf, import_hf, quant_scheme
from .families import FAMILIES
from .planned import is_hf_config, planned_container, read_hf_config, sizes_by_quant

__all__ = ["FAMILIES", "QUANT_PRESETS", "ImportReport", "colibri_config_from_hf", "import_hf", "is_hf_config",
           "planned_container", "quant_scheme", "read_hf_config", "sizes_by_quant"]
