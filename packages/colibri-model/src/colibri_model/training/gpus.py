"""Known accelerators: memory and dense bf16 peak, for MFU (metrics.py) and the memory planner.

One table, matched two ways: by a short key (`h100-sxm`, `a100-40gb`, ...) that a person types
into `colibri-model plan-memory --gpu`, and by the name the driver reports
(`torch.cuda.get_device_name()`, e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
"NVIDIA A100-SXM4-40GB"), which is how the trainer finds its MFU peak.

NOTE: variants of one chip differ by up to 30% (H100 SXM 989, NVL 835, PCIe 756 TFLOP/s), so a
bare "H100" must not mean all three. Names are matched on whole words, most specific first:
"NVL" and "PCIe" before the plain chip name, and "GH200" never matches "H200". A name that
matches nothing gets no peak: the trainer then reports no MFU unless `--peak-tflops` is given,
rather than a number against the wrong peak.

Figures are vendor datasheet values (dense, no sparsity; bf16 with fp32 accumulation) and the
memory that nvidia-smi reports in MiB (the H200's 143771 MiB was read on this workplace's lent
machine, the others are leads). The A10G (AWS only) has no public datasheet: 70 TFLOP/s is the
figure third-party comparisons give, below the A10's 125.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UnknownGpuError

MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    key: str  # what `--gpu` takes
    label: str
    memory_bytes: int  # total device memory as nvidia-smi reports it
    peak_bf16_tflops: float  # dense, no sparsity
    pattern: str  # regex on the upper-cased device name, '-' and '_' read as spaces


# Order matters: the first pattern that matches a device name wins.
GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("h200-nvl", "H200 NVL 141 GB", 143771 * MIB, 835.0, r"\bH200\b.*\bNVL\b"),
    GpuSpec("h200", "H200 SXM 141 GB", 143771 * MIB, 989.0, r"\bH200\b"),
    GpuSpec("h100-nvl", "H100 NVL 94 GB", 95830 * MIB, 835.0, r"\bH100\b.*\bNVL\b"),
    GpuSpec("h100-pcie", "H100 PCIe 80 GB", 81559 * MIB, 756.0, r"\bH100\b.*\bPCIE\b"),
    GpuSpec("h100-sxm", "H100 SXM 80 GB", 81559 * MIB, 989.0, r"\bH100\b"),
    GpuSpec("a100-80gb", "A100 80 GB", 81920 * MIB, 312.0, r"\bA100\b.*\b80GB\b"),
    GpuSpec("a100-40gb", "A100 40 GB", 40960 * MIB, 312.0, r"\bA100\b"),
    GpuSpec("l40s", "L40S 48 GB", 46068 * MIB, 362.0, r"\bL40S\b"),
    GpuSpec("l40", "L40 48 GB", 46068 * MIB, 181.0, r"\bL40\b"),
    GpuSpec("l4", "L4 24 GB", 23034 * MIB, 121.0, r"\bL4\b"),
    GpuSpec("a10g", "A10G 24 GB", 23028 * MIB, 70.0, r"\bA10G\b"),
    GpuSpec("rtx4090", "GeForce RTX 4090 24 GB", 24564 * MIB, 165.0, r"\bRTX 4090\b"),
    GpuSpec("rtx3090", "GeForce RTX 3090 24 GB", 24576 * MIB, 71.0, r"\bRTX 3090\b"),
)


def _normalise(name: str) -> str:
    return re.sub(r"[-_\s]+", " ", name.upper()).strip()


def match_device_name(name: str) -> GpuSpec | None:
    """The table entry for a driver-reported device name, or None if it is not known."""
    normal = _normalise(name)
    for spec in GPUS:
        if re.search(spec.pattern, normal):
            return spec
    return None


def gpu_spec(name: str) -> GpuSpec:
    """A GPU by key (`h100-pcie`) or by device name ("NVIDIA H100 PCIe"); UnknownGpuError otherwise."""
    key = name.strip().lower()
    for spec in GPUS:
        if spec.key == key:
            return spec
    spec = match_device_name(name)
    if spec is None:
        raise UnknownGpuError(f"unknown GPU {name!r}; choose one of {', '.join(s.key for s in GPUS)} "
                              f"(or a device name such as 'NVIDIA H100 PCIe')")
    return spec
