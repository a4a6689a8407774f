"""colibri-int4: the Colibri int4 container (FORMAT.md), its exporter and its numpy reader.

Reading needs only numpy and pydantic; nothing here imports torch or colibri-model.
"""

from .container import Container, VerifyReport
from .dequantize import dequantize_container
from .errors import CheckpointError, ContainerError, Int4Error
from .estimate import SizeEstimate, estimate_container_size
from .expert_blob import ExpertBlob, decode_expert_blob, encode_expert_blob
from .export import ContainerFileWriter, ExportReport, export_checkpoint
from .header import ContainerHeader, ExpertEntry, TensorEntry
from .layout import ExpertBlobLayout, ModelShape
from .quantize import dequantize_q4, quantize_q4, unpack_nibbles
from .scheme import QuantScheme
from .tensor_codec import RawTensor

__version__ = "0.2.0"

__all__ = [
    "CheckpointError",
    "Container",
    "ContainerFileWriter",
    "ContainerError",
    "ContainerHeader",
    "ExpertBlob",
    "ExpertBlobLayout",
    "ExpertEntry",
    "ExportReport",
    "Int4Error",
    "ModelShape",
    "QuantScheme",
    "RawTensor",
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
    "unpack_nibbles",
]
