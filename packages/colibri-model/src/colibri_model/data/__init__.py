"""Data pipeline: token shards, `prepare`, the packed loader, and the SFT chat dataset.

- shards.py    the uint16 shard file (header + tokens), atomic writes, memmap reads
- manifest.py  `manifest.json` of a data directory (pydantic, `manifest_version`)
- sources.py   documents from .txt / .jsonl / .parquet files or a Hub dataset id
- prepare.py   documents -> shards + validation shard, resumable
- loader.py    deterministic packed sequences with a saved position
- sft.py       chat JSONL -> token stream + assistant-only loss mask
"""

from .loader import IGNORE_INDEX, LoaderError, LoaderPosition, PackedLoader, TokenSource, fixed_batches
from .manifest import DataManifest, ManifestError, open_data_dir, read_manifest
from .prepare import prepare
from .shards import ShardFormatError, read_header, read_shard, write_shard
from .sources import DataSourceError

__all__ = [
    "IGNORE_INDEX",
    "DataManifest",
    "DataSourceError",
    "LoaderError",
    "LoaderPosition",
    "ManifestError",
    "PackedLoader",
    "ShardFormatError",
    "TokenSource",
    "fixed_batches",
    "open_data_dir",
    "prepare",
    "read_header",
    "read_manifest",
    "read_shard",
    "write_shard",
]
