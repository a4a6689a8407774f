"""colibri-int4: the Colibri int4 container (FORMAT.md), its exporter and its numpy reader.

Reading needs only numpy and pydantic; nothing here imports torch or colibri-model.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

from .container import Container, VerifyReport
from .dequantize import dequantize_container
from .errors import CheckpointError, ChecksumError, ContainerError, HFImportError, Int4Error
from .estimate import SizeEstimate, estimate_container_size
from .expert_blob import ExpertBlob, decode_expert_blob, encode_expert_blob
from .export import ContainerFileWriter, ExportReport, export_checkpoint
from .header import ContainerHeader, ExpertEntry, TensorEntry
from .layout import ExpertBlobLayout, ModelShape
from .positional_read import read_exact, read_into
from .quantize import dequantize_q4, quantize_q4, unpack_nibbles
from .scheme import QuantScheme
from .synthetic import SYNTHETIC_SCHEME, write_synthetic_container
from .tensor_codec import RawTensor

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-int4")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CheckpointError",
    "ChecksumError",
    "Container",
    "ContainerFileWriter",
    "ContainerError",
    "ContainerHeader",
    "ExpertBlob",
    "ExpertBlobLayout",
    "ExpertEntry",
    "ExportReport",
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
    "encode_expert_blob",
    "estimate_container_size",
    "export_checkpoint",
    "quantize_q4",
    "read_exact",
    "read_into",
    "unpack_nibbles",
    "write_synthetic_container",
]
