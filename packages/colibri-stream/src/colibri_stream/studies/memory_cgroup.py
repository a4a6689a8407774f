"""Run a command under a real memory cap: a child memory cgroup (v1 or v2) made for the run.

`ram_budget="auto"` must be true where it matters, under a cgroup limit, so the check runs the
real CLI in one: `run_capped(["colibri-stream", "generate", ...], limit)` creates a child of this
process's memory cgroup, sets `memory.limit_in_bytes` (v1) or `memory.max` (v2), starts the
command inside it (the child moves itself in before exec), samples its RssAnon every 10 ms,
and reports the exit status, the peak, the cgroup's own peak and whether the OOM killer ran.
The cgroup is removed afterwards.

It needs root (or a delegated cgroup) and a writable memory controller; `cgroup_unavailable()`
says why not where it cannot run, so tests skip with that reason.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..io.memory_cap import cgroup_memory_dir


@dataclass
class CappedRun:
    returncode: int
    stdout: str
    stderr: str
    limit_bytes: int
    peak_rss_anon: int  # of the command's process, sampled
    cgroup_peak: int | None  # the cgroup's own peak usage (v1 max_usage_in_bytes, v2 memory.peak), page cache included
    oom_kills: int
    seconds: float


def _memory_root() -> tuple[str, Path] | None:
    found = cgroup_memory_dir(Path("/proc"))
    return None if found is None else (found[0], found[1])


def cgroup_unavailable() -> str | None:
    """None if `run_capped` can work here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root to create a memory cgroup"
    root = _memory_root()
    if root is None:
        return "no memory cgroup controller is mounted (neither v1 memory nor v2 memory.max)"
    version, directory = root
    probe = directory / f"colibri-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a child of {directory} ({exc.strerror})"
    try:
        limit = probe / ("memory.max" if version == "v2" else "memory.limit_in_bytes")
        if not limit.exists():
            return f"{probe} has no {limit.name}: the memory controller is not enabled for children"
        try:
            limit.write_text(str(256 << 20))
        except OSError as exc:
            return f"cannot set {limit} ({exc.strerror})"
    finally:
        probe.rmdir()
    return None


def run_capped(command: list[str], limit_bytes: int, timeout: float = 300, env: dict | None = None) -> CappedRun:
    reason = cgroup_unavailable()
    if reason:
        raise RuntimeError(reason)
    version, directory = _memory_root()
    group = directory / f"colibri-capped-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(str(limit_bytes))

        def enter() -> None:  # runs in the child before exec: everything it maps is charged here
            (group / "cgroup.procs").write_text(str(os.getpid()))

        started = time.monotonic()
        process = subprocess.Popen(command, preexec_fn=enter, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
        peak = 0
        status = Path(f"/proc/{process.pid}/status")
        while process.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except OSError:
                pass
            if time.monotonic() - started > timeout:
                process.kill()
            time.sleep(0.01)
        stdout, stderr = process.communicate()
        seconds = time.monotonic() - started
        peak_file = group / ("memory.peak" if version == "v2" else "memory.max_usage_in_bytes")
        cgroup_peak = int(peak_file.read_text()) if peak_file.exists() else None
        return CappedRun(process.returncode, stdout, stderr, limit_bytes, peak, cgroup_peak, _oom_kills(version, group),
                         seconds)
    finally:
        for _ in range(50):  # the exited child leaves the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def _oom_kills(version: str, group: Path) -> int:
    name = "memory.events" if version == "v2" else "memory.oom_control"
    try:
        fields = dict(line.split() for line in (group / name).read_text().splitlines() if " " in line)
    except OSError:
        return 0
    return int(fields.get("oom_kill", 0))
