"""The GPU table: device names as drivers report them map to the right variant's peak and memory,
unknown GPUs get no MFU (with a warning naming --peak-tflops), and --peak-tflops reaches the metrics."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from colibri_model import get_preset
from colibri_model.data import TokenSource
from colibri_model.training import TrainConfig, Trainer
from colibri_model.training.gpus import GPUS, UnknownGpuError, gpu_spec, match_device_name
from colibri_model.training.metrics import UnknownPeakWarning, peak_flops, peak_flops_for_device_name


@pytest.mark.parametrize("name, key, tflops", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm", 989.0),
    ("NVIDIA H100 SXM5 80GB", "h100-sxm", 989.0),
    ("NVIDIA H100 PCIe", "h100-pcie", 756.0),
    ("NVIDIA H100 NVL", "h100-nvl", 835.0),
    ("NVIDIA H200", "h200", 989.0),
    ("NVIDIA H200 NVL", "h200-nvl", 835.0),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb", 312.0),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb", 312.0),
    ("NVIDIA A100 80GB PCIe", "a100-80gb", 312.0),
    ("NVIDIA A100-PCIE-40GB", "a100-40gb", 312.0),
    ("NVIDIA L4", "l4", 121.0),
    ("NVIDIA L40S", "l40s", 362.0),
    ("NVIDIA L40", "l40", 181.0),
    ("NVIDIA A10G", "a10g", 70.0),
    ("NVIDIA GeForce RTX 4090", "rtx4090", 165.0),
    ("NVIDIA GeForce RTX 3090", "rtx3090", 71.0),
])
def test_device_names_match_their_variant(name, key, tflops):
    spec = match_device_name(name)
    assert spec is not None and spec.key == key and spec.peak_bf16_tflops == tflops
    assert gpu_spec(name) is spec and gpu_spec(key.upper()) is spec
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_flops_for_device_name(name) == tflops * 1e12


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "Tesla T4", "NVIDIA A10", "AMD Instinct MI300X",
                                  "NVIDIA H800", ""])
def test_unknown_gpus_report_no_mfu(name):
    assert match_device_name(name) is None
    with pytest.warns(UnknownPeakWarning, match="MFU is not reported.*pass --peak-tflops"):
        assert peak_flops_for_device_name(name) is None
    with pytest.raises(UnknownGpuError, match="unknown GPU"):
        gpu_spec(name)


def test_table_is_consistent():
    assert len({g.key for g in GPUS}) == len(GPUS)
    assert all(g.memory_bytes > 16 * 2**30 and g.peak_bf16_tflops > 0 for g in GPUS)
    assert gpu_spec("h100-sxm").memory_bytes < gpu_spec("h100-nvl").memory_bytes < gpu_spec("h200").memory_bytes


def test_peak_on_cpu_needs_the_flag():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU run is not an unknown GPU: no warning
        assert peak_flops(torch.device("cpu"), None) is None
    assert peak_flops(torch.device("cpu"), 2.5) == 2.5e12


def test_peak_tflops_gives_mfu_in_metrics(tmp_path):
    config = get_preset("tiny", vocab_size=512)
    tokens = np.random.default_rng(0).integers(0, 512, size=4000).astype(np.uint16)
    source = TokenSource([tokens])
    train = TrainConfig(steps=2, seq_len=16, batch_size=2, micro_batch=2, warmup_steps=0, eval_every=0,
                        eval_batches=1, peak_tflops=0.001, progress=False, device="cpu")
    trainer = Trainer(tmp_path / "run", train, source, source, config)
    try:
        trainer.train()
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["step"] > 0]
    assert logged and all(r["mfu"] is not None and r["mfu"] > 0 for r in logged)
