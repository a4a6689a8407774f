"""Which CPU kernel sets torch can dispatch to on this machine, read off the CPU, not assumed.

torch compiles its CPU kernels several times (x86: default, AVX2, AVX-512) and picks one at
start-up by the capability it detects; `ATEN_CPU_CAPABILITY=default|avx2|avx512` makes it
dispatch as on a lesser CPU. Kernel layouts differ between them (int4_repack.py), so the suite
runs its CPU-sensitive tests under every capability this machine can execute, and the
benchmarks report per capability. torch accepts a request above what the CPU has, and its
kernels then die on an illegal instruction, so the list comes from the CPU's own flags with the
feature sets torch requires for each level.

    python -m colibri_stream.compute.cpu_capability                   # e.g. "default avx2 avx512"
    python -m colibri_stream.compute.cpu_capability --besides-native  # those torch did not pick here
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

# what torch's cpuinfo checks before it picks each level (aten/src/ATen/native/DispatchStub.cpp)
X86_LEVELS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"},
}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def supported_capabilities(flags: set[str] | None = None, machine: str | None = None) -> list[str]:
    """Values of ATEN_CPU_CAPABILITY this CPU can run, lowest first; always includes "default"."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return ["default"]  # other architectures: one kernel set besides default is not assumed
    flags = cpu_flags() if flags is None else flags
    return ["default"] + [level for level, needs in X86_LEVELS.items() if needs <= flags]


def native_capability() -> str:
    """The level torch picked in this process (lower-cased), e.g. "avx512"; honours the env var."""
    import torch

    return torch.backends.cpu.get_cpu_capability().lower()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--besides-native"]):
        print("usage: python -m colibri_stream.compute.cpu_capability [--besides-native]", file=sys.stderr)
        sys.exit(2)
    levels = supported_capabilities()
    if args:
        native = native_capability()
        levels = [level for level in levels if level != native]
    print(" ".join(levels))


if __name__ == "__main__":
    main()
