"""`metrics.jsonl`: one JSON object per logged step (schema `MetricsRecord`, `metrics_version`).

Other tools (the relay dashboard, plots) read this file, so the schema is a pydantic model
with a version. Only rank 0 writes. On resume, records beyond the resumed step (logged after
the last checkpoint of a crashed run) are dropped so the file describes one consistent history.

MFU: model FLOPs per token = 6 x active parameters (at top_k_train; the embedding lookup is not
a matmul and is excluded, the LM head is included) + 12 x n_layers x n_heads x head_dim x
seq_len for attention scores and values (PaLM's convention, not halved for causality), against
a peak given per device (`peak_tflops`), or looked up by device name in gpus.py (bf16 dense;
SXM, PCIe and NVL variants apart). An unknown GPU gets no MFU, with one warning that says how to
give the peak, rather than an MFU against another card's peak.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from ..config import ColibriConfig
from ..param_count import count_params
from ..router import RouterStats
from .gpus import match_device_name

METRICS_FILE = "metrics.jsonl"
METRICS_VERSION = "1.0"



class UnknownPeakWarning(UserWarning):
    """MFU is not reported: the GPU's peak is not known and no `--peak-tflops` was given."""


class RouterLayerMetrics(BaseModel):
    model_config = ConfigDict(extra="forbid")
    layer: int
    max_vio: float
    dead_experts: int
    load_entropy: float
    load: list[float]

    @classmethod
    def from_stats(cls, s: RouterStats) -> RouterLayerMetrics:
        return cls(layer=s.layer, max_vio=round(s.max_vio, 5), dead_experts=s.dead_experts,
                   load_entropy=round(s.load_entropy, 5), load=s.load)


class MetricsRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metrics_version: str = METRICS_VERSION
    step: int  # optimizer steps completed
    time: float  # unix seconds
    kind: str = "pretrain"
    loss: float | None  # mean LM cross-entropy over the global batch (None when skipped)
    aux_loss: float | None = None
    lr: float
    phase: str
    grad_norm: float | None
    tokens_seen: int
    tokens_per_s: float
    mfu: float | None
    skipped: bool = False
    skip_reason: str | None = None
    val_loss: float | None = None  # at top_k_train, on the fixed validation batches
    val_loss_infer: float | None = None  # at top_k_infer (serving), when measured
    router: list[RouterLayerMetrics] = []


def flops_per_token(config: ColibriConfig, seq_len: int) -> float:
    active = count_params(config)["active_params_train"]
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 6.0 * active + attention


def peak_flops(device: torch.device, peak_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU: `peak_tflops` if given, else the table's (CUDA only)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None  # MFU of a CPU run means nothing; no warning either
    return peak_flops_for_device_name(torch.cuda.get_device_name(device))


def peak_flops_for_device_name(name: str) -> float | None:
    """The table's dense bf16 peak for a driver-reported name; None (and a warning) if unknown."""
    spec = match_device_name(name)
    if spec is None:
        warnings.warn(UnknownPeakWarning(
            f"MFU is not reported: no peak FLOP/s known for GPU {name!r}; pass --peak-tflops "
            f"(its dense bf16 TFLOP/s) to report it"), stacklevel=2)
        return None
    return spec.peak_bf16_tflops * 1e12


class MetricsWriter:
    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records with step > `step` (atomically rewrites the file)."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a kill mid-write
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: MetricsRecord) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(record.model_dump_json(exclude_none=False) + "\n")


def read_metrics(run_dir: str | os.PathLike) -> list[MetricsRecord]:
    """Parse a run's metrics.jsonl (refusing an unknown major version)."""
    records = []
    path = Path(run_dir) / METRICS_FILE
    for number, line in enumerate(path.read_text().splitlines(), 1):
        data = json.loads(line)
        version = str(data.get("metrics_version", ""))
        if version.split(".")[0] != METRICS_VERSION.split(".")[0]:
            raise ValueError(f"{path}:{number}: metrics_version {version} is not supported "
                             f"(this colibri-model reads {METRICS_VERSION})")
        records.append(MetricsRecord.model_validate(data))
    return records
