"""MFU's peak: the GPU variants that share a family name but not a peak are told apart."""

import torch
from colibri_model.training.metrics import known_peak_tflops, peak_flops


def test_peak_tflops_tells_sxm_pcie_and_nvl_apart():
    assert known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert known_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert known_peak_tflops("NVIDIA H100 NVL") == 835.0
    assert known_peak_tflops("NVIDIA H200") == 989.0
    assert known_peak_tflops("NVIDIA H200 NVL") == 835.0
    assert known_peak_tflops("NVIDIA L40S") == 362.0 and known_peak_tflops("NVIDIA L40") == 181.0
    assert known_peak_tflops("NVIDIA L4") == 121.0
    assert known_peak_tflops("Tesla T4") is None


def test_an_explicit_peak_wins_and_cpu_has_none():
    assert peak_flops(torch.device("cpu"), None) is None
    assert peak_flops(torch.device("cpu"), 100.0) == 100e12
