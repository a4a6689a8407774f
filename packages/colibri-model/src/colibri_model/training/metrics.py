"""`metrics.jsonl`: one JSON object per logged step (schema `MetricsRecord`, `metrics_version`).

Other tools (the relay dashboard, plots) read this file, so the schema is a pydantic model
with a version. Only rank 0 writes. On resume, records beyond the resumed step (logged after
the last checkpoint of a crashed run) are dropped so the file describes one consistent history.

MFU: model FLOPs per token = 6 x active parameters (at top_k_train; the embedding lookup is not
a matmul and is excluded, the LM head is included) + 12 x n_layers x n_heads x head_dim x
seq_len for attention scores and values (PaLM's convention, not halved for causality), against
a peak given per device (`peak_tflops`), or looked up for known GPUs in bf16 dense.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from ..config import ColibriConfig, count_params
from ..router import RouterStats

METRICS_FILE = "metrics.jsonl"
METRICS_VERSION = "1.0"

# bf16 dense peak TFLOP/s (no sparsity) of common accelerators, matched on the device name: the
# first key the name contains wins, so each variant comes before its family ("NVIDIA H100 PCIe",
# "NVIDIA H100 NVL"; the SXM part reports as "NVIDIA H100 80GB HBM3"). Others: --peak-tflops.
KNOWN_PEAK_TFLOPS = {"H200 NVL": 835.0, "H200": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
                     "A100": 312.0, "L40S": 362.0, "L40": 181.0, "A10G": 125.0, "L4": 121.0,
                     "4090": 165.0, "3090": 71.0}


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
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type == "cuda":
        peak = known_peak_tflops(torch.cuda.get_device_name(device))
        return peak * 1e12 if peak is not None else None
    return None


def known_peak_tflops(device_name: str) -> float | None:
    """bf16 dense peak of a GPU by its CUDA device name (None when unknown)."""
    return next((value for key, value in KNOWN_PEAK_TFLOPS.items() if key in device_name), None)


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
