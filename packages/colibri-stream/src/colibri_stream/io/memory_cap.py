"""`ram_budget="auto"`: the budget that fits under this process's memory cap.

A memory cgroup charges a process its anonymous memory *and* the file-backed pages it faults in
(shared libraries, files read through the page cache). Anonymous memory stays charged; file
pages are reclaimable, and under the limit the kernel takes the cold ones back (torch's libraries
are mostly code run once at import). Only the file pages a run keeps touching must stay, or they
are read again on every touch (the seed's 11.7-minute thrash under a 1.0 GB cap read 392 GB:
torch's libraries, over and over). So the room an engine has is

    room   = limit - charged now - runtime file pages
    budget = room - margin

- limit: cgroup v2 `memory.max` or v1 `memory.limit_in_bytes` of this process's cgroup and every
  ancestor up to the mount (the smallest counts), found through /proc/self/cgroup and
  /proc/self/mountinfo. Without a limit, `MemAvailable` of /proc/meminfo stands in (it already
  leaves out what this process holds, so "charged now" is 0 there).
- charged now: what stays charged whatever the kernel reclaims: the larger of this process's
  RssAnon + RssShmem (/proc/self/status) and the cgroup's own anon + shmem (memory.stat; other
  processes of the same cgroup), read after the C heap's free pages are given back (io/heap.py:
  imports and the container's header leave 14 MB of freed heap by then, measured).
- runtime file pages: the library pages a run keeps touching, which must stay resident.
  Measured (AMD EPYC, torch 2.13 CPU, 1 thread; `/proc/self/clear_refs`, then the `Referenced`
  pages of file-backed mappings in /proc/self/smaps): a 37-token prefill and 16 decode steps of a
  24-layer x 64-expert container touched 7-12 MB of library pages and 3 MB of the container's
  mapped embedding. The library pages resident grew by 19 MB from the moment `auto` reads the cap
  (the page cache dropped first) to the end of a generation, and by 28 MB from right after
  `import torch`. `RUNTIME_FILE_BYTES` (32 MiB) covers the largest of them.
- margin: `MARGIN_FRACTION` of the room, at least `MIN_MARGIN_BYTES`, for what the plan cannot
  see coming (the kernel's headroom near the limit, other threads of the process). The plan
  itself is an upper bound: the peak anonymous RSS growth of a run was measured at 0.58-0.88 of
  its budget with the native kernels, from the smallest budget the plan allows to a quarter of the
  experts cached, and 0.83-0.98 with torch's int4 kernels or dequantized matmuls
  (`bench/ram_budget.py [--compute C]`, NanoColibri shapes and a 24 x 64 Qwen3-MoE; bench/RESULTS.md).

Counting every faulted file page as charged (as this did before) left a third of a small cap
unused: under a 777 MB cap it offered 433 MB where 700 MB ran (bench/RESULTS.md has the runs
under real caps with the rule as it is now).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..sizes import format_size
from .heap import release_free_heap

RUNTIME_FILE_BYTES = 32 << 20
MARGIN_FRACTION = 0.10
MIN_MARGIN_BYTES = 16 << 20
UNLIMITED = 1 << 60  # v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712)


@dataclass(frozen=True)
class MemoryCap:
    """One reading of the cap and what is already charged.

    Attributes:
        source: where the limit came from, e.g. "cgroup v1 /sys/fs/cgroup/memory/job".
        limit_bytes: the cgroup limit, or None when there is none (then `available` is MemAvailable).
        available_bytes: limit - charged now (or MemAvailable).
        charged_bytes: what stays charged (see module doc); 0 with MemAvailable.
    """

    source: str
    limit_bytes: int | None
    available_bytes: int
    charged_bytes: int
    runtime_file_bytes: int = RUNTIME_FILE_BYTES

    @property
    def room_bytes(self) -> int:
        return max(0, self.available_bytes - self.runtime_file_bytes)

    @property
    def margin_bytes(self) -> int:
        return max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * self.room_bytes))

    @property
    def budget_bytes(self) -> int:
        return max(0, self.room_bytes - self.margin_bytes)

    def describe(self) -> str:
        if self.limit_bytes is None:
            head = f"no memory limit ({self.source}): MemAvailable {format_size(self.available_bytes)}"
        else:
            head = (f"{self.source}: limit {format_size(self.limit_bytes)} - charged now "
                    f"{format_size(self.charged_bytes)}")
        return (f"{head} - runtime file pages {format_size(self.runtime_file_bytes)} - margin "
                f"{format_size(self.margin_bytes)} = budget {format_size(self.budget_bytes)}")

    def to_dict(self) -> dict:
        return {"source": self.source, "limit_bytes": self.limit_bytes, "available_bytes": self.available_bytes,
                "charged_bytes": self.charged_bytes, "runtime_file_bytes": self.runtime_file_bytes,
                "margin_bytes": self.margin_bytes, "budget_bytes": self.budget_bytes}


def read_memory_cap(proc: str | os.PathLike = "/proc") -> MemoryCap:
    """The cap of this process (see module doc). `proc` is /proc, or a copy of its files
    (self/cgroup, self/mountinfo, self/status, meminfo) for tests."""
    proc = Path(proc)
    release_free_heap()  # freed heap is not charged once given back
    process = process_anon_bytes(proc / "self" / "status")
    found = cgroup_memory_dir(proc)
    if found is not None:
        version, directory, mount = found
        limit = _effective_limit(version, directory, mount)
        if limit is not None:
            charged = max(process, _cgroup_charged(version, directory))
            return MemoryCap(f"cgroup {version} {directory}", limit, max(0, limit - charged), charged)
    return MemoryCap(f"{proc / 'meminfo'} MemAvailable", None, _mem_available(proc / "meminfo"), 0)


def process_anon_bytes(status: str | os.PathLike = "/proc/self/status") -> int:
    """RssAnon + RssShmem of /proc/self/status: what stays charged to this process under a cgroup
    (its file-backed pages are reclaimable)."""
    fields = _kib_fields(status, ("RssAnon", "RssShmem"))
    return sum(fields.values())


def rss_anon_bytes(status: str | os.PathLike = "/proc/self/status") -> int:
    return _kib_fields(status, ("RssAnon",)).get("RssAnon", 0)


def cgroup_memory_dir(proc: Path) -> tuple[str, Path, Path] | None:
    """("v1" | "v2", this process's memory cgroup directory, its mount point), or None.

    The v1 memory controller wins where both exist (a hybrid host's v2 tree has no memory
    controller then). A cgroup path is relative to the mount's root (a container often mounts
    its own cgroup as the root)."""
    try:
        cgroups = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in cgroups:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            paths["v1"] = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            paths["v2"] = parts[2]
    for version in ("v1", "v2"):
        if version not in paths:
            continue
        for line in mounts:
            pre, _, post = line.partition(" - ")
            fields, tail = pre.split(), post.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            fstype, superopts = tail[0], tail[2].split(",")
            if (version == "v2" and fstype == "cgroup2") or (version == "v1" and fstype == "cgroup"
                                                             and "memory" in superopts):
                root, mount_point = fields[3], Path(_unescape(fields[4]))
                relative = os.path.relpath(paths[version], root) if paths[version].startswith(root) else "."
                directory = (mount_point / relative).resolve() if relative != "." else mount_point
                limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
                if (directory / limit_file).exists() or (mount_point / limit_file).exists():
                    return version, directory, mount_point
    return None


def _effective_limit(version: str, directory: Path, mount: Path) -> int | None:
    name = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    limit = None
    current = directory
    while True:
        try:
            text = (current / name).read_text().strip()
        except OSError:
            text = "max"
        if text != "max" and text.isdigit() and int(text) < UNLIMITED:
            limit = int(text) if limit is None else min(limit, int(text))
        if current == mount or current.parent == current or mount not in current.parents:
            return limit
        current = current.parent


def _cgroup_charged(version: str, directory: Path) -> int:
    names = ("anon", "shmem") if version == "v2" else ("total_rss", "total_shmem")
    try:
        lines = (directory / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    stat = dict(line.split(None, 1) for line in lines if " " in line)
    return sum(int(stat[n]) for n in names if n in stat and stat[n].strip().isdigit())


def _mem_available(meminfo: Path) -> int:
    fields = _kib_fields(meminfo, ("MemAvailable",))
    if "MemAvailable" not in fields:
        raise OSError(f"{meminfo} has no MemAvailable line (not Linux?): give --ram-budget a size")
    return fields["MemAvailable"]


def _kib_fields(path: str | os.PathLike, names: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in names and value.split():
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return out


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path
