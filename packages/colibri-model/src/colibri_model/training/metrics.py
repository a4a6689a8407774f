"""Writing `metrics.jsonl`: one JSON object per logged step. Its schema (`MetricsRecord`,
`metrics_version`) and its one reader (`read_metrics`) are colibri-spec's, which the relay
dashboard and `colibri status` read too; they are re-exported here. Only rank 0 writes. On
resume, records beyond the resumed step (logged after the last checkpoint of a crashed run) are
dropped so the file describes one consistent history.

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
from colibri_spec import METRICS_FILE, METRICS_VERSION, MetricsRecord, RouterLayerMetrics, read_metrics

from ..config import ColibriConfig
from ..param_count import count_params
from .gpus import match_device_name

__all__ = [
    "METRICS_FILE", "METRICS_VERSION", "MetricsRecord", "MetricsWriter", "RouterLayerMetrics", "UnknownPeakWarning",
    "flops_per_token", "peak_flops", "peak_flops_for_device_name", "read_metrics",
]


class UnknownPeakWarning(UserWarning):
    """MFU is not reported: the GPU's peak is not known and no `--peak-tflops` was given."""


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
