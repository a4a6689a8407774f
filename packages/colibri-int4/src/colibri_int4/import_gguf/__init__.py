"""`import_gguf`: a GGUF file (llama.cpp's format) into a container, read with the `gguf` package
(`pip install 'colibri-int4[gguf]'`), without torch and in bounded memory. GGUF.md says what is
read and what is refused.

    gguf_file.py       the file through gguf-py's GGUFReader: metadata, tensors in torch's order, dequantized
    metadata.py        GGUF metadata -> the transformers config.json it stands for (then import-hf's mapping)
    tokenizer_json.py  tokenizer.* metadata -> tokenizer.json, chat template and special tokens
    convert.py         names through gguf-py's TensorNameMap, q/k un-permuted, the exporter's body writer
    file_grid.py       the int4 grouping that holds the file's own 4-bit blocks exactly (Q4_0, Q4_1, Q4_K)

Architectures: llama (dense, and Mixtral's experts), qwen3moe, qwen2moe, olmoe, gpt-oss, deepseek2
(DeepSeek-V2/V3); tensors
in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K..Q6_K and MXFP4, requantized to
the scheme (on the file's own grid where int4 holds its blocks exactly: file_grid.py).
"""

from .convert import GGUFImportReport, colibri_config_from_gguf, import_gguf
from .file_grid import EXACT_GRIDS, FileGrid
from .gguf_file import SUPPORTED_TYPES, GGUFFile
from .metadata import ARCHITECTURES, hf_config_from_gguf
from .tokenizer_json import tokenizer_from_gguf

__all__ = ["ARCHITECTURES", "EXACT_GRIDS", "SUPPORTED_TYPES", "FileGrid", "GGUFFile", "GGUFImportReport",
           "colibri_config_from_gguf", "hf_config_from_gguf", "import_gguf", "tokenizer_from_gguf"]
