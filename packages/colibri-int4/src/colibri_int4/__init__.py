"""colibri-int4: the Colibri int4 container (FORMAT.md), its exporter and its numpy reader.

Reading needs only numpy and pydantic; nothing here imports torch or colibri-model.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version
from typing import TYPE_CHECKING

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-int4")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# Public names are imported on first use (PEP 562 module __getattr__), not here: `colibri-int4 --help`
# and `from colibri_int4 import Int4Error` (as colibri-stream's CLI does) then cost no numpy import.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "container": ("Container", "VerifyReport"),
    "dequantize": ("dequantize_container",),
    "errors": ("CheckpointError", "CheckpointVersionError", "ChecksumError", "ContainerError", "ContainerVersionError",
               "GGUFImportError", "HFImportError", "Int4Error"),
    "estimate": ("SizeEstimate", "estimate_container_size"),
    "expert_blob": ("ExpertBlob", "decode_expert_blob", "encode_expert_blob"),
    "export": ("ContainerFileWriter", "ExportReport", "export_checkpoint"),
    "header": ("ContainerHeader", "ExpertEntry", "TensorEntry"),
    "layout": ("ExpertBlobLayout",),
    "model_shape": ("ModelShape",),
    "positional_read": ("read_exact", "read_into"),
    "quantize": ("dequantize_q4", "dequantize_q6", "pack_q6", "quantize_q4", "quantize_q6", "unpack_nibbles",
                 "unpack_q6"),
    "scheme": ("QuantScheme",),
    "synthetic": ("SYNTHETIC_SCHEME", "write_synthetic_container"),
    "tensor_codec": ("RawTensor",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs (tests hold the two lists equal)
    from .container import Container, VerifyReport
    from .dequantize import dequantize_container
    from .errors import (
        CheckpointError,
        CheckpointVersionError,
        ChecksumError,
        ContainerError,
        ContainerVersionError,
        GGUFImportError,
        HFImportError,
        Int4Error,
    )
    from .estimate import SizeEstimate, estimate_container_size
    from .expert_blob import ExpertBlob, decode_expert_blob, encode_expert_blob
    from .export import ContainerFileWriter, ExportReport, export_checkpoint
    from .header import ContainerHeader, ExpertEntry, TensorEntry
    from .layout import ExpertBlobLayout
    from .model_shape import ModelShape
    from .positional_read import read_exact, read_into
    from .quantize import (
        dequantize_q4,
        dequantize_q6,
        pack_q6,
        quantize_q4,
        quantize_q6,
        unpack_nibbles,
        unpack_q6,
    )
    from .scheme import QuantScheme
    from .synthetic import SYNTHETIC_SCHEME, write_synthetic_container
    from .tensor_codec import RawTensor

__all__ = [
    "CheckpointError",
    "CheckpointVersionError",
    "ChecksumError",
    "Container",
    "ContainerFileWriter",
    "ContainerError",
    "ContainerHeader",
    "ContainerVersionError",
    "ExpertBlob",
    "ExpertBlobLayout",
    "ExpertEntry",
    "ExportReport",
    "GGUFImportError",
    "HFImportError",
    "Int4Error",
    "ModelShape",
    "QuantScheme",
    "RawTensor",
    "SYNTHETIC_SCHEME",
    "SizeEstimate",
    "TensorEntry",
    "VerifyReport",
    "decode_expert_blob",
    "dequantize_container",
    "dequantize_q4",
    "dequantize_q6",
    "encode_expert_blob",
    "estimate_container_size",
    "export_checkpoint",
    "pack_q6",
    "quantize_q4",
    "quantize_q6",
    "read_exact",
    "read_into",
    "unpack_nibbles",
    "unpack_q6",
    "write_synthetic_container",
]


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
