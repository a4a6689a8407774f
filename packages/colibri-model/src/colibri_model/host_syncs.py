"""Host syncs: counted op by op on any device (`HostSyncCounter`), and on CUDA as the runtime sees them
(`count_host_syncs`, for benchmarks on a GPU).

## Op by op, on any device

`torch.cuda.set_sync_debug_mode` only works on CUDA. `HostSyncCounter` works on CPU too, so
the "no host sync inside a micro-batch" promise is tested where the suite runs: a
TorchDispatchMode sees every aten op (forward and backward) and counts those that read device
data on the host or whose output shape depends on device data:

- `_local_scalar_dense`: `.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`;
- copies from a device to the CPU (`.cpu()`, `.tolist()`, `.numpy()` of a device tensor);
- data-dependent shapes: `nonzero`, `bincount`, `unique`, `masked_select`, `repeat_interleave`
  without `output_size`, indexing with a boolean mask, `histc` with min == max;
- `_grouped_mm` (or our `grouped_linear` op) on CUDA in another dtype than bf16 or below sm90:
  its fallback copies the group offsets to the host.

On CPU, `.tolist()`, `.numpy()` and `.cpu()` of a CPU tensor dispatch nothing; the counter
patches those three methods while it is active and counts them as `host_read`, so a CPU test
also sees the reads that would be device-to-host copies on a GPU.

Example:
    >>> with HostSyncCounter() as syncs:
    ...     model(x, targets=y).loss.backward()
    >>> syncs.total, dict(syncs.events)      # 0, {} when the micro-batch is sync-free

## On CUDA

Count the host syncs of a training step on CUDA, two independent ways.

A host sync (`.item()`, a device-to-host copy, `nonzero`, a data-dependent shape) stalls the CPU
until the GPU drains its queue, so the next kernels launch late; at a few hundred per
micro-batch they cap MFU. `count_host_syncs(step, device)` runs `step()` a few times and returns,
per step:

- `sync_debug_warnings`: the warnings of `torch.cuda.set_sync_debug_mode("warn")`, which flags
  each synchronizing call torch itself makes (including from the autograd engine's threads,
  whose warnings it hands back to the caller);
- `cuda_sync_calls`: the CUDA runtime's synchronizing calls the profiler records
  (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, blocking cudaMemcpy);
- `cuda_memcpy_async`: every cudaMemcpyAsync, for context (host-to-device input copies too).

On CPU there is no asynchronous device to wait for: `None`, which reports print as "not
countable". Uses only APIs that torch 2.11 already has.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DATA_DEPENDENT = {"nonzero", "bincount", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}
_PATCHED = ("tolist", "numpy", "cpu")


def _op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def sync_reason(func, args, kwargs) -> str | None:
    """Why this aten call would block the host on an accelerator (None: it would not)."""
    name = _op_name(func)
    if name == "_local_scalar_dense":
        return "item"
    if name in _DATA_DEPENDENT:
        return name
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None \
            and (len(args) < 4 or args[3] is None):
        return "repeat_interleave"
    if name in ("index", "index_put", "index_put_") and len(args) > 1:
        indices = args[1] or []
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "boolean_index"
    if name == "histc":
        low, high = kwargs.get("min", args[2] if len(args) > 2 else 0), kwargs.get("max", args[3] if len(args) > 3 else 0)
        if low == high:
            return "histc_range"
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst_device = args[0].device if name == "copy_" else kwargs.get("device")
        if src.device.type != "cpu" and dst_device is not None and torch.device(dst_device).type == "cpu":
            return "device_to_host"
    if "grouped_mm" in name or "grouped_linear" in name:
        x = _first_tensor(args)
        if x is not None and x.device.type == "cuda" and (
                x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0)):
            return "grouped_mm_fallback"
    return None


class HostSyncCounter(TorchDispatchMode):
    """Counts would-be host syncs by cause in `events`; `total` sums them (see the module doc)."""

    def __init__(self):
        super().__init__()
        self.events: Counter[str] = Counter()
        self._saved: dict[str, object] = {}
        self._ignoring = 0

    @property
    def total(self) -> int:
        return sum(self.events.values())

    @contextlib.contextmanager
    def ignoring(self):
        """Count nothing inside (e.g. a CPU-only code path that reads host tensors)."""
        self._ignoring += 1
        try:
            yield
        finally:
            self._ignoring -= 1

    def _count(self, reason: str) -> None:
        if not self._ignoring:
            self.events[reason] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self._count(reason)
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self
        for method in _PATCHED:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor, *args, _original=original, **kwargs):
                if tensor.device.type == "cpu":  # a device tensor's copy is seen by the dispatch mode
                    counter._count("host_read")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for method, original in self._saved.items():
                setattr(torch.Tensor, method, original)
            self._saved.clear()


# --- on CUDA: torch's sync debug mode and the profiler -------------------------------------------
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def count_host_syncs(step: Callable[[], object], device: torch.device, steps: int = 2) -> dict[str, float] | None:
    """Host syncs per call of `step()` on `device` (see the module docstring); None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    flagged = sum("synchroniz" in str(w.message).lower() for w in caught)
    torch.cuda.synchronize(device)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    calls = {row.key: row.count for row in prof.key_averages()}
    sync_calls = sum(calls.get(name, 0) for name in SYNC_CALLS) - 1  # our own synchronize above
    return {"sync_debug_warnings": flagged / steps, "cuda_sync_calls": max(sync_calls, 0) / steps,
            "cuda_memcpy_async": calls.get("cudaMemcpyAsync", 0) / steps}
